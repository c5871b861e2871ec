//! `baton top`: a live view of a node and the nodes linked to it, refreshed about once a
//! second — pinned bytes per holder as bars, handoffs per second as a sparkline,
//! quarantined and orphaned counts highlighted, a row per node. `q` quits.

use crate::client::{AdminLink, CliError};
use crate::table::{bytes, label, millis, path_totals, paths_line, totals};
use baton_messages::protocol::StatusScope;
use baton_messages::status::NodeStatus;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Row, Sparkline, Table};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Handoff rates kept for the sparkline.
const HISTORY: usize = 120;

/// How often the view asks for a status.
pub const REFRESH: Duration = Duration::from_secs(1);

/// Entries per list asked for.
const LIMIT: u32 = 64;

/// What the view shows: the latest status of the tree and the handoff rates so far.
#[derive(Debug)]
pub struct TopState {
    /// The socket watched.
    pub socket: String,
    /// The latest status.
    pub latest: Option<NodeStatus>,
    /// The last error, if the last refresh failed.
    pub error: Option<String>,
    /// Handoffs per second, oldest first.
    pub rates: VecDeque<u64>,
    /// The previous sample: when, and leases granted so far per node (pid, start time).
    prev: Option<(Instant, Granted)>,
}

/// Leases granted so far per node, by (pid, start time).
type Granted = HashMap<(u32, u64), u64>;

/// A refresh's outcome and when it came.
type Update = (Result<NodeStatus, String>, Instant);

/// One holder's share of the tree's pinned memory.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Holder {
    name: Option<String>,
    leases: u64,
    pinned: u64,
    quarantined: u64,
    oldest_ms: Option<u64>,
    cut: bool,
}

impl TopState {
    /// Nothing seen yet.
    pub fn new(socket: impl Into<String>) -> Self {
        Self {
            socket: socket.into(),
            latest: None,
            error: None,
            rates: VecDeque::new(),
            prev: None,
        }
    }

    /// A new status, sampled at `at`: the handoff rate since the previous one is the sum,
    /// over nodes seen in both, of the leases each granted meanwhile (a restarted node
    /// starts its count again and is not subtracted).
    pub fn update(&mut self, status: NodeStatus, at: Instant) {
        let granted: Granted = status
            .tree()
            .iter()
            .map(|s| ((s.pid, s.start_ticks), s.granted))
            .collect();
        if let Some((then, before)) = &self.prev {
            let secs = at.saturating_duration_since(*then).as_secs_f64();
            if secs > 0.0 {
                let delta: u64 = granted
                    .iter()
                    .filter_map(|(k, now)| before.get(k).map(|b| now.saturating_sub(*b)))
                    .sum();
                self.rates.push_back((delta as f64 / secs).round() as u64);
                while self.rates.len() > HISTORY {
                    self.rates.pop_front();
                }
            }
        }
        self.prev = Some((at, granted));
        self.latest = Some(status);
        self.error = None;
    }

    /// Every holder of every node's memory, by pid, largest first.
    fn holders(&self) -> Vec<(u32, Holder)> {
        let Some(status) = &self.latest else {
            return Vec::new();
        };
        let tree = status.tree();
        let names: HashMap<u32, String> = tree
            .iter()
            .filter_map(|s| Some((s.pid, s.name.clone()?)))
            .collect();
        let mut by: BTreeMap<u32, Holder> = BTreeMap::new();
        for s in &tree {
            for p in &s.peers {
                let h = by.entry(p.pid).or_default();
                h.name = h
                    .name
                    .take()
                    .or_else(|| p.name.clone())
                    .or_else(|| names.get(&p.pid).cloned());
                h.leases += p.leases;
                h.pinned += p.pinned_bytes;
                h.quarantined += p.quarantined_bytes;
                h.cut |= p.cut;
                h.oldest_ms = h.oldest_ms.max(p.oldest_lease_ms);
            }
        }
        let mut v: Vec<(u32, Holder)> = by.into_iter().collect();
        v.sort_by(|a, b| {
            (b.1.pinned + b.1.quarantined, a.0).cmp(&(a.1.pinned + a.1.quarantined, b.0))
        });
        v
    }
}

fn alarm(n: u64) -> Style {
    if n > 0 {
        Style::default()
            .fg(Color::Red)
            .add_modifier(Modifier::BOLD | Modifier::REVERSED)
    } else {
        Style::default()
    }
}

fn bar(value: u64, max: u64, width: usize) -> String {
    let filled = if max == 0 {
        0
    } else {
        ((value as f64 / max as f64) * width as f64).round() as usize
    };
    let filled = filled.min(width).max(usize::from(value > 0));
    format!("{}{}", "█".repeat(filled), "░".repeat(width - filled))
}

/// Draws the view.
pub fn draw(frame: &mut Frame<'_>, state: &TopState) {
    let holders = state.holders();
    let area = frame.area();
    let holder_rows = (holders.len().max(1) as u16 + 2)
        .min(area.height / 3)
        .max(3);
    let nodes = state.latest.as_ref().map_or(0, |s| s.tree().len());
    let head_lines = match (&state.latest, &state.error) {
        (Some(_), Some(_)) => 4,
        (Some(_), None) => 3,
        (None, _) => 2,
    };
    let [head, pinned, spark, table] = Layout::vertical([
        Constraint::Length(2 + head_lines),
        Constraint::Length(holder_rows),
        Constraint::Length(6),
        Constraint::Min(3 + nodes.min(1) as u16),
    ])
    .areas(area);

    // Header: the node, the tree's totals, the alarms.
    let title = format!(" baton top · {} · q quits ", state.socket);
    let mut lines = Vec::new();
    match &state.latest {
        Some(s) => {
            let t = totals(s);
            let rate = state.rates.back().copied();
            lines.push(Line::from(format!(
                "{} · {} · {} nodes · up {}",
                label(s),
                s.backend,
                t.nodes,
                millis(s.uptime_ms)
            )));
            lines.push(Line::from(vec![
                Span::raw(format!(
                    "buffers {} · leases {} · pinned {} · handoffs/s {} · ",
                    t.buffers,
                    t.leases,
                    bytes(t.pinned_bytes),
                    rate.map_or("…".to_owned(), |r| r.to_string())
                )),
                Span::styled(
                    format!(" quarantined {} ", t.quarantined),
                    alarm(t.quarantined),
                ),
                Span::raw(" · "),
                Span::styled(format!(" orphaned {} ", t.orphaned), alarm(t.orphaned)),
            ]));
            let (_, downgrades) = path_totals(s);
            let style = if downgrades > 0 {
                Style::default().fg(Color::Yellow)
            } else {
                Style::default()
            };
            lines.push(Line::from(Span::styled(paths_line(s), style)));
        }
        None => lines.push(Line::from("waiting for the first status…")),
    }
    if let Some(e) = &state.error {
        lines.push(Line::from(Span::styled(
            format!("refresh failed: {e}"),
            Style::default().fg(Color::Red),
        )));
    }
    frame.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(title)),
        head,
    );

    // Pinned bytes per holder, as bars.
    let max = holders
        .iter()
        .map(|(_, h)| h.pinned + h.quarantined)
        .max()
        .unwrap_or(0);
    let width = (pinned.width as usize).saturating_sub(84).clamp(5, 40);
    let rows: Vec<Line<'_>> = if holders.is_empty() {
        vec![Line::from("no process holds anything of this tree's")]
    } else {
        holders
            .iter()
            .map(|(pid, h)| {
                let who = match &h.name {
                    Some(n) => format!("{n} ({pid})"),
                    None => pid.to_string(),
                };
                let mut spans = vec![
                    Span::raw(format!("{who:<22.22} ")),
                    Span::styled(
                        bar(h.pinned + h.quarantined, max, width),
                        Style::default().fg(if h.quarantined > 0 {
                            Color::Red
                        } else {
                            Color::Cyan
                        }),
                    ),
                    Span::raw(format!(
                        " {:>10} · {:>4} leases · oldest {}",
                        bytes(h.pinned + h.quarantined),
                        h.leases,
                        h.oldest_ms.map_or("-".to_owned(), millis)
                    )),
                ];
                if h.cut {
                    let note = if h.quarantined > 0 {
                        " CUT: QUARANTINED "
                    } else {
                        " CUT: MAY MAP "
                    };
                    spans.push(Span::raw(" · "));
                    spans.push(Span::styled(note, alarm(1)));
                }
                Line::from(spans)
            })
            .collect()
    };
    frame.render_widget(
        Paragraph::new(rows).block(
            Block::default()
                .borders(Borders::ALL)
                .title(" pinned bytes per holder "),
        ),
        pinned,
    );

    // Handoffs per second.
    let data: Vec<u64> = state.rates.iter().copied().collect();
    let shown = &data[data
        .len()
        .saturating_sub(spark.width.saturating_sub(2) as usize)..];
    let peak = shown.iter().copied().max().unwrap_or(0);
    frame.render_widget(
        Sparkline::default()
            .block(
                Block::default()
                    .borders(Borders::ALL)
                    .title(format!(" handoffs per second (peak {peak}) ")),
            )
            .data(shown)
            .style(Style::default().fg(Color::Green)),
        spark,
    );

    // A row per node.
    let mut rows = Vec::new();
    if let Some(root) = &state.latest {
        let rtt: HashMap<u32, Option<u64>> = root
            .links
            .iter()
            .map(|l| (l.pid, l.round_trip_us))
            .collect();
        let restarts: HashMap<&str, (u32, &str)> = root
            .children
            .iter()
            .map(|c| (c.name.as_str(), (c.restarts, c.state.as_str())))
            .collect();
        for s in root.tree() {
            let (restarts, state) = s
                .name
                .as_deref()
                .and_then(|n| restarts.get(n).copied())
                .unwrap_or((0, if s.pid == root.pid { "root" } else { "linked" }));
            rows.push(Row::new(vec![
                Span::raw(s.pid.to_string()),
                Span::raw(s.name.clone().unwrap_or_default()),
                Span::raw(state.to_owned()),
                Span::raw(s.buffers.to_string()),
                Span::raw(s.leases.to_string()),
                Span::raw(bytes(s.pinned_bytes)),
                Span::styled(s.quarantined.to_string(), alarm(s.quarantined)),
                Span::styled(s.orphaned.to_string(), alarm(s.orphaned)),
                Span::raw(format!("{}/{}", s.cache.opens, s.cache.hits)),
                Span::raw(
                    rtt.get(&s.pid)
                        .copied()
                        .flatten()
                        .map_or("-".to_owned(), |us| format!("{:.2} ms", us as f64 / 1e3)),
                ),
                Span::raw(restarts.to_string()),
            ]));
        }
    }
    let widths = [
        Constraint::Length(8),
        Constraint::Length(12),
        Constraint::Length(10),
        Constraint::Length(7),
        Constraint::Length(6),
        Constraint::Length(10),
        Constraint::Length(5),
        Constraint::Length(8),
        Constraint::Length(12),
        Constraint::Length(9),
        Constraint::Length(8),
    ];
    frame.render_widget(
        Table::new(rows, widths)
            .header(
                Row::new(vec![
                    "PID",
                    "NAME",
                    "STATE",
                    "BUFFERS",
                    "LEASES",
                    "PINNED",
                    "QUAR",
                    "ORPHANED",
                    "OPENS/HITS",
                    "RTT",
                    "RESTARTS",
                ])
                .style(Style::default().add_modifier(Modifier::BOLD)),
            )
            .block(Block::default().borders(Borders::ALL).title(" nodes ")),
        table,
    );
}

/// The text of a rendered buffer, one line per row, trailing blanks trimmed.
pub fn buffer_text(buffer: &ratatui::buffer::Buffer) -> String {
    let area = buffer.area;
    let mut out = String::new();
    for y in area.top()..area.bottom() {
        let mut line = String::new();
        for x in area.left()..area.right() {
            line.push_str(buffer[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Fetches statuses on a thread, about once a second, until `stop` is dropped.
fn fetcher(
    socket: PathBuf,
    token_file: Option<PathBuf>,
    scope: StatusScope,
) -> (mpsc::Receiver<Update>, mpsc::Sender<()>) {
    let (tx, rx) = mpsc::channel();
    let (stop, stopped) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut link: Option<AdminLink> = None;
        loop {
            let result = (|| {
                if link.is_none() {
                    link = Some(AdminLink::connect(&socket, token_file.as_deref())?);
                }
                let l = link.as_mut().expect("just set");
                l.status(scope, LIMIT, Duration::from_secs(10))
            })();
            if result.is_err() {
                // Link again on the next round.
                link = None;
            }
            let result = result.map_err(|e: CliError| e.to_string());
            if tx.send((result, Instant::now())).is_err() {
                return;
            }
            match stopped.recv_timeout(REFRESH) {
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
        }
    });
    (rx, stop)
}

/// Renders the view of `samples` refreshes (at least two, for a rate) without a
/// terminal, into a `width`×`height` screen, and returns its text.
///
/// # Errors
/// The first refresh fails.
pub fn once(
    socket: &Path,
    token_file: Option<&Path>,
    scope: StatusScope,
    samples: u32,
    (width, height): (u16, u16),
) -> Result<String, CliError> {
    let mut link = AdminLink::connect(socket, token_file)?;
    let mut state = TopState::new(socket.display().to_string());
    for i in 0..samples.max(1) {
        if i > 0 {
            std::thread::sleep(REFRESH);
        }
        let status = link.status(scope, LIMIT, Duration::from_secs(10))?;
        state.update(status, Instant::now());
    }
    let mut terminal = ratatui::Terminal::new(ratatui::backend::TestBackend::new(width, height))
        .map_err(|e| {
            CliError::Link(baton_ipc::Error::Io {
                op: "rendering",
                source: e,
            })
        })?;
    terminal.draw(|f| draw(f, &state)).map_err(|e| {
        CliError::Link(baton_ipc::Error::Io {
            op: "rendering",
            source: e,
        })
    })?;
    Ok(buffer_text(terminal.backend().buffer()))
}

/// Runs the live view on the terminal until `q`.
///
/// # Errors
/// The terminal cannot be set up.
pub fn run(socket: &Path, token_file: Option<&Path>, scope: StatusScope) -> std::io::Result<()> {
    use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
    let (updates, stop) = fetcher(socket.to_owned(), token_file.map(Path::to_owned), scope);
    let mut state = TopState::new(socket.display().to_string());
    let mut terminal = ratatui::init();
    let result = (|| {
        loop {
            while let Ok((result, at)) = updates.try_recv() {
                match result {
                    Ok(status) => state.update(status, at),
                    Err(e) => state.error = Some(e),
                }
            }
            terminal.draw(|f| draw(f, &state))?;
            if event::poll(Duration::from_millis(100))? {
                if let Event::Key(k) = event::read()? {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if k.kind == KeyEventKind::Press
                        && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
                    {
                        return Ok(());
                    }
                }
            }
        }
    })();
    ratatui::restore();
    drop(stop);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_messages::status::{ChildEntry, LinkEntry, PathEntry, PeerLeases};
    use ratatui::backend::TestBackend;

    fn worker(pid: u32, name: &str, granted: u64, holder: PeerLeases) -> NodeStatus {
        NodeStatus {
            pid,
            start_ticks: u64::from(pid),
            name: Some(name.into()),
            backend: "host (memfd)".into(),
            buffers: 4,
            leases: holder.leases,
            pinned_bytes: holder.pinned_bytes,
            granted,
            paths: vec![PathEntry {
                path: "host-memfd".into(),
                granted: 3,
                ..Default::default()
            }],
            peers: vec![holder],
            ..Default::default()
        }
    }

    fn tree(granted: u64, quarantined: u64) -> NodeStatus {
        let compositor = PeerLeases {
            pid: 300,
            name: None,
            linked: true,
            leases: 4,
            pinned_bytes: 4 << 20,
            oldest_lease_ms: Some(35),
            ..Default::default()
        };
        let mut w0 = worker(201, "worker-0", granted, compositor.clone());
        w0.quarantined = quarantined;
        if quarantined > 0 {
            w0.peers.push(PeerLeases {
                pid: 666,
                cut: true,
                quarantined_bytes: 1 << 20,
                ..Default::default()
            });
        }
        let w1 = worker(
            202,
            "worker-1",
            granted,
            PeerLeases {
                pinned_bytes: 2 << 20,
                leases: 2,
                ..compositor
            },
        );
        let comp = NodeStatus {
            pid: 300,
            start_ticks: 300,
            name: Some("compositor".into()),
            buffers: 1,
            paths: vec![PathEntry {
                path: "host-memfd".into(),
                opened: 6,
                ..Default::default()
            }],
            orphaned: 0,
            ..Default::default()
        };
        let link = |s: NodeStatus| LinkEntry {
            pid: s.pid,
            round_trip_us: Some(250),
            status: Some(Box::new(s)),
            ..Default::default()
        };
        NodeStatus {
            pid: 100,
            start_ticks: 100,
            backend: "host (memfd)".into(),
            uptime_ms: 12_000,
            links: vec![link(comp), link(w0), link(w1)],
            children: ["compositor", "worker-0", "worker-1"]
                .iter()
                .map(|n| ChildEntry {
                    name: (*n).into(),
                    state: "running".into(),
                    restarts: u32::from(*n == "worker-1"),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn render(state: &TopState) -> String {
        let mut terminal = ratatui::Terminal::new(TestBackend::new(110, 30)).unwrap();
        terminal.draw(|f| draw(f, state)).unwrap();
        buffer_text(terminal.backend().buffer())
    }

    #[test]
    fn a_frame_shows_holders_as_bars_the_handoff_rate_and_a_row_per_node() {
        let mut state = TopState::new("/run/baton/root.sock");
        let t0 = Instant::now();
        state.update(tree(1000, 0), t0);
        state.update(tree(1600, 0), t0 + Duration::from_secs(1));
        state.update(tree(2800, 1), t0 + Duration::from_secs(2));
        // Two workers, 600 then 1200 leases each per second.
        assert_eq!(state.rates, [1200, 2400]);
        let text = render(&state);
        println!("{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].contains("baton top · /run/baton/root.sock · q quits"),
            "{text}"
        );
        assert!(
            lines[1].contains("pid 100 · host (memfd) · 4 nodes · up 12.0 s"),
            "{text}"
        );
        assert!(
            lines[2].contains(
                "buffers 9 · leases 6 · pinned 6.0 MiB · handoffs/s 2400 ·  quarantined 1  ·  orphaned 0"
            ),
            "{text}"
        );
        assert!(
            lines[3].contains("paths (granted/opened) host-memfd 6/6 · downgrades 0"),
            "{text}"
        );
        // The compositor pins 4 + 2 MiB of the two workers': the longest bar; the cut
        // holder's quarantined MiB is one sixth of it.
        let comp = lines
            .iter()
            .find(|l| l.contains("compositor (300)"))
            .unwrap_or_else(|| panic!("no compositor bar in\n{text}"));
        assert!(comp.contains(&"█".repeat(26)), "{comp}");
        assert!(
            comp.contains("6.0 MiB ·    6 leases · oldest 35 ms"),
            "{comp}"
        );
        let cut = lines.iter().find(|l| l.contains("│666 ")).unwrap();
        assert!(
            cut.contains(&format!("{}{} ", "█".repeat(4), "░".repeat(22)))
                && cut.contains("1.0 MiB")
                && cut.contains("CUT: QUARANTINED"),
            "{cut}"
        );
        assert!(text.contains("handoffs per second (peak 2400)"), "{text}");
        // The sparkline's last column is full height (the peak), the one before half.
        let spark: Vec<&&str> = lines
            .iter()
            .skip_while(|l| !l.contains("handoffs per second"))
            .skip(1)
            .take(4)
            .collect();
        assert!(spark.iter().all(|l| l.contains('█')), "{text}");
        let header = lines
            .iter()
            .position(|l| l.contains("PID") && l.contains("RESTARTS"))
            .unwrap();
        let rows: Vec<&str> = lines[header + 1..header + 5].to_vec();
        assert!(
            rows[0].contains("100") && rows[0].contains("root"),
            "{text}"
        );
        assert!(
            rows.iter().any(
                |r| r.contains("worker-1") && r.trim_end_matches('│').trim_end().ends_with('1')
            ),
            "worker-1 restarted once:\n{text}"
        );
    }

    #[test]
    fn before_the_first_status_the_view_says_it_waits() {
        let mut state = TopState::new("s");
        state.error = Some("cannot link".into());
        let text = render(&state);
        assert!(text.contains("waiting for the first status…"), "{text}");
        assert!(text.contains("refresh failed: cannot link"), "{text}");
        assert!(text.contains("no process holds anything"), "{text}");
    }
}
