//! `baton status` as text: a summary, then tables of holders, buffers, orphaned leases,
//! links and children, for the node and (with `--tree`) every node linked to it.

use baton_messages::status::NodeStatus;
use std::collections::HashMap;
use std::fmt::Write;

/// `1536` → `1.5 KiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// `1500` (ms) → `1.5 s`.
pub fn millis(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.1} s", ms as f64 / 1e3),
        60_000..3_600_000 => format!("{:.1} min", ms as f64 / 6e4),
        _ => format!("{:.1} h", ms as f64 / 3.6e6),
    }
}

/// A node's label: `pid 123 (worker-0)`.
pub fn label(s: &NodeStatus) -> String {
    match &s.name {
        Some(n) => format!("pid {} ({n})", s.pid),
        None => format!("pid {}", s.pid),
    }
}

/// Totals over every node of a tree.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    /// Nodes.
    pub nodes: u64,
    /// Buffers exported.
    pub buffers: u64,
    /// Leases out.
    pub leases: u64,
    /// Bytes pinned.
    pub pinned_bytes: u64,
    /// Buffers quarantined.
    pub quarantined: u64,
    /// Orphaned leases held.
    pub orphaned: u64,
    /// Leases granted so far.
    pub granted: u64,
}

/// Sums `status` and every status nested in it.
pub fn totals(status: &NodeStatus) -> Totals {
    let mut t = Totals::default();
    for s in status.tree() {
        t.nodes += 1;
        t.buffers += s.buffers;
        t.leases += s.leases;
        t.pinned_bytes += s.pinned_bytes;
        t.quarantined += s.quarantined;
        t.orphaned += s.orphaned;
        t.granted += s.granted;
    }
    t
}

/// Leases by path over every node of a tree: `(label, granted, opened)`, in the order the
/// labels first appear, and the downgrades taken.
pub fn path_totals(status: &NodeStatus) -> (Vec<(String, u64, u64)>, u64) {
    let mut paths: Vec<(String, u64, u64)> = Vec::new();
    let mut downgrades = 0;
    for s in status.tree() {
        for p in &s.paths {
            match paths.iter_mut().find(|(label, _, _)| *label == p.path) {
                Some(row) => {
                    row.1 += p.granted;
                    row.2 += p.opened;
                }
                None => paths.push((p.path.clone(), p.granted, p.opened)),
            }
        }
        downgrades += s.downgrades.iter().map(|d| d.count).sum::<u64>();
    }
    (paths, downgrades)
}

/// `paths (granted/opened) host-memfd 3/3 · tcp-copy 1/1 · downgrades 1`, for a tree.
pub fn paths_line(status: &NodeStatus) -> String {
    let (paths, downgrades) = path_totals(status);
    let mut line = String::from("paths (granted/opened) ");
    if paths.is_empty() {
        line.push_str("none yet");
    } else {
        let rows: Vec<String> = paths
            .iter()
            .map(|(label, g, o)| format!("{label} {g}/{o}"))
            .collect();
        line.push_str(&rows.join(" · "));
    }
    let _ = write!(line, " · downgrades {downgrades}");
    line
}

fn table(out: &mut String, indent: &str, header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut l = indent.to_owned();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                l.push_str(cell);
            } else {
                let _ = write!(l, "{cell:<w$}  ");
            }
        }
        l.trim_end().to_owned()
    };
    let _ = writeln!(out, "{}", line(header.to_vec()));
    for row in rows {
        let _ = writeln!(out, "{}", line(row.iter().map(String::as_str).collect()));
    }
}

fn left_out(out: &mut String, indent: &str, what: &str, n: u64) {
    if n > 0 {
        let _ = writeln!(out, "{indent}… and {n} more {what} (raise --limit)");
    }
}

/// Renders one node (and, nested, the nodes its links answered for).
pub fn render(status: &NodeStatus) -> String {
    let mut out = String::new();
    if status.links.iter().any(|l| l.status.is_some()) {
        let t = totals(status);
        let _ = writeln!(
            out,
            "tree        {} nodes · {} buffers · {} leases · {} pinned · {} quarantined · {} orphaned · {} granted",
            t.nodes,
            t.buffers,
            t.leases,
            bytes(t.pinned_bytes),
            t.quarantined,
            t.orphaned,
            t.granted
        );
        out.push('\n');
    }
    // Names a node knows of its own (supervised children) or a linked node says of itself.
    let names: HashMap<u32, String> = status
        .tree()
        .iter()
        .flat_map(|s| {
            let own = s.name.clone().map(|n| (s.pid, n));
            let children = s
                .children
                .iter()
                .filter_map(|c| Some((c.pid?, c.name.clone())));
            own.into_iter().chain(children).collect::<Vec<_>>()
        })
        .collect();
    node(&mut out, status, "", &names);
    out
}

fn node(out: &mut String, s: &NodeStatus, indent: &str, names: &HashMap<u32, String>) {
    let opt_name = |pid: u32, n: &Option<String>| {
        n.clone()
            .or_else(|| names.get(&pid).cloned())
            .unwrap_or_default()
    };
    let _ = writeln!(
        out,
        "{indent}node        {} · {} · device {} · up {}",
        label(s),
        s.backend,
        s.device,
        millis(s.uptime_ms)
    );
    let _ = writeln!(
        out,
        "{indent}exports     {} buffers ({}) · {} leases out · {} pinned · {} quarantined ({}) · {} retiring · {} granted · {} freed",
        s.buffers,
        bytes(s.bytes),
        s.leases,
        bytes(s.pinned_bytes),
        s.quarantined,
        bytes(s.quarantined_bytes),
        s.retiring,
        s.granted,
        s.freed
    );
    let c = &s.cache;
    let _ = writeln!(
        out,
        "{indent}imports     {} cache entries ({} warm, {}) · {} opens · {} hits · {} orphaned leases ({})",
        c.entries,
        c.warm,
        bytes(c.warm_bytes),
        c.opens,
        c.hits,
        s.orphaned,
        bytes(s.orphaned_bytes)
    );

    if !s.downgrades.is_empty() {
        let _ = writeln!(
            out,
            "{indent}downgrades  {}",
            s.downgrades
                .iter()
                .map(|d| format!("{} instead of {} ×{}", d.taken, d.wanted, d.count))
                .collect::<Vec<_>>()
                .join(" · ")
        );
    }
    if !s.paths.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .paths
            .iter()
            .map(|p| {
                vec![
                    p.path.clone(),
                    p.granted.to_string(),
                    bytes(p.granted_bytes),
                    p.opened.to_string(),
                    bytes(p.opened_bytes),
                ]
            })
            .collect();
        table(
            out,
            indent,
            &["PATH", "GRANTED", "GRANTED BYTES", "OPENED", "OPENED BYTES"],
            &rows,
        );
    }
    if !s.peers.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .peers
            .iter()
            .map(|p| {
                vec![
                    p.pid.to_string(),
                    opt_name(p.pid, &p.name),
                    if p.linked { "up" } else { "down" }.to_owned(),
                    p.leases.to_string(),
                    bytes(p.pinned_bytes),
                    bytes(p.mapped_bytes),
                    p.oldest_lease_ms.map_or("-".to_owned(), millis),
                    match (p.cut, p.quarantined_bytes) {
                        (true, 0) => "cut: may still map".to_owned(),
                        (true, q) => format!("cut: quarantines {}", bytes(q)),
                        _ => String::new(),
                    },
                ]
            })
            .collect();
        table(
            out,
            indent,
            &[
                "HOLDER", "NAME", "LINK", "LEASES", "PINNED", "MAPPED", "OLDEST", "NOTE",
            ],
            &rows,
        );
        left_out(out, indent, "holders", s.omitted.peers);
    }
    if !s.buffer_table.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .buffer_table
            .iter()
            .map(|b| {
                let state = if b.quarantined {
                    "QUARANTINED"
                } else if b.retiring {
                    "retiring"
                } else {
                    "live"
                };
                let pids = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
                vec![
                    b.id.to_string(),
                    bytes(b.bytes),
                    b.backend.clone(),
                    b.device.clone(),
                    b.leases.to_string(),
                    pids(&b.holders),
                    pids(&b.cut_holders),
                    state.to_owned(),
                ]
            })
            .collect();
        table(
            out,
            indent,
            &[
                "BUFFER", "BYTES", "BACKEND", "DEVICE", "LEASES", "HOLDERS", "CUT", "STATE",
            ],
            &rows,
        );
        left_out(out, indent, "buffers", s.omitted.buffer_table);
    }
    if !s.orphaned_leases.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .orphaned_leases
            .iter()
            .map(|o| {
                vec![
                    o.pid.to_string(),
                    o.leases.to_string(),
                    bytes(o.bytes),
                    millis(o.since_ms),
                ]
            })
            .collect();
        table(
            out,
            indent,
            &["ORPHANED BY", "LEASES", "BYTES", "SINCE"],
            &rows,
        );
        left_out(out, indent, "exporters", s.omitted.orphaned_leases);
    }
    if !s.links.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .links
            .iter()
            .map(|l| {
                vec![
                    match (&l.host, &l.addr) {
                        (Some(host), Some(addr)) => format!("{} @ {addr} ({host})", l.pid),
                        _ => l.pid.to_string(),
                    },
                    match (l.requester, indent.is_empty()) {
                        (true, true) => "(this command)".to_owned(),
                        (true, false) => format!("{} (asked)", opt_name(l.pid, &l.name))
                            .trim_start()
                            .to_owned(),
                        _ => opt_name(l.pid, &l.name),
                    },
                    l.round_trip_us
                        .map_or("-".to_owned(), |us| format!("{:.2} ms", us as f64 / 1e3)),
                    bytes(l.queued_bytes),
                    l.leases_held.to_string(),
                ]
            })
            .collect();
        table(
            out,
            indent,
            &["LINK TO", "NAME", "RTT", "QUEUED", "LEASES HELD"],
            &rows,
        );
        left_out(out, indent, "links", s.omitted.links);
    }
    if !s.children.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .children
            .iter()
            .map(|c| {
                vec![
                    c.name.clone(),
                    // A child on another host: where its agent is (its pid is of that host).
                    // A child an agent runs here: for whom.
                    match (&c.host, &c.supervisor) {
                        (Some(host), _) => format!("{} on {host}", c.state),
                        (None, Some(sup)) => format!("{} for {sup}", c.state),
                        (None, None) => c.state.clone(),
                    },
                    c.pid.map_or("-".to_owned(), |p| p.to_string()),
                    c.restarts.to_string(),
                    c.last_exit.clone().unwrap_or_default(),
                ]
            })
            .collect();
        table(
            out,
            indent,
            &["CHILD", "STATE", "PID", "RESTARTS", "LAST EXIT"],
            &rows,
        );
        left_out(out, indent, "children", s.omitted.children);
    }
    let nested = format!("{indent}  │ ");
    for l in &s.links {
        if let Some(child) = &l.status {
            out.push('\n');
            let _ = writeln!(out, "{indent}  ┌ linked node {}", label(child));
            node(out, child, &nested, names);
        } else if let Some(e) = &l.status_error {
            let _ = writeln!(
                out,
                "\n{indent}  ┌ linked node pid {}: no status ({e})",
                l.pid
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_messages::status::{BufferEntry, LinkEntry, PeerLeases};

    #[test]
    fn sizes_and_ages_read_as_people_write_them() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
        assert_eq!(millis(12), "12 ms");
        assert_eq!(millis(1500), "1.5 s");
        assert_eq!(millis(90_000), "1.5 min");
    }

    #[test]
    fn children_across_hosts_show_their_agent_or_their_supervisor_beside_their_state() {
        use baton_messages::status::ChildEntry;
        let status = NodeStatus {
            pid: 10,
            children: vec![
                ChildEntry {
                    name: "local".into(),
                    state: "running".into(),
                    pid: Some(11),
                    ..Default::default()
                },
                ChildEntry {
                    name: "guest".into(),
                    state: "running".into(),
                    pid: Some(13),
                    supervisor: Some("10.0.0.1/77".into()),
                    ..Default::default()
                },
                ChildEntry {
                    name: "far".into(),
                    state: "running".into(),
                    pid: Some(12),
                    host: Some("10.0.0.2:7701".into()),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let out = render(&status);
        let line = |name: &str| {
            out.lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap_or_else(|| panic!("no row {name} in\n{out}"))
                .to_owned()
        };
        assert!(line("far").contains("running on 10.0.0.2:7701"), "{out}");
        assert!(line("guest").contains("running for 10.0.0.1/77"), "{out}");
        assert!(!line("local").contains(" on "), "{out}");
    }

    #[test]
    fn paths_and_downgrades_are_listed_when_there_are_any() {
        use baton_messages::status::{DowngradeEntry, PathEntry};
        let quiet = render(&NodeStatus::default());
        assert!(
            !quiet.contains("PATH") && !quiet.contains("downgrades"),
            "{quiet}"
        );
        let status = NodeStatus {
            paths: vec![PathEntry {
                path: "tcp-copy".into(),
                granted: 2,
                granted_bytes: 2048,
                opened: 1,
                opened_bytes: 512,
            }],
            downgrades: vec![DowngradeEntry {
                wanted: "host-memfd".into(),
                taken: "tcp-copy".into(),
                count: 1,
            }],
            ..Default::default()
        };
        let out = render(&status);
        assert!(out.contains("PATH"), "{out}");
        let row = out
            .lines()
            .find(|l| l.starts_with("tcp-copy"))
            .unwrap_or_else(|| panic!("no tcp-copy row in\n{out}"));
        assert!(row.contains("2.0 KiB") && row.contains("512 B"), "{out}");
        assert!(
            out.contains("downgrades  tcp-copy instead of host-memfd ×1"),
            "{out}"
        );
    }

    #[test]
    fn the_table_shows_holders_buffers_and_the_nested_tree_with_totals() {
        let worker = NodeStatus {
            pid: 20,
            name: Some("worker-0".into()),
            buffers: 2,
            leases: 1,
            pinned_bytes: 4096,
            granted: 9,
            peers: vec![PeerLeases {
                pid: 30,
                name: None,
                linked: true,
                leases: 1,
                pinned_bytes: 4096,
                oldest_lease_ms: Some(1500),
                ..Default::default()
            }],
            buffer_table: vec![BufferEntry {
                id: 1,
                bytes: 4096,
                backend: "Host".into(),
                device: "host".into(),
                leases: 1,
                holders: vec![30],
                quarantined: true,
                retiring: true,
                ..Default::default()
            }],
            ..Default::default()
        };
        let root = NodeStatus {
            pid: 10,
            buffers: 1,
            links: vec![
                LinkEntry {
                    pid: 20,
                    status: Some(Box::new(worker)),
                    ..Default::default()
                },
                LinkEntry {
                    pid: 99,
                    requester: true,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let t = totals(&root);
        assert_eq!((t.nodes, t.buffers, t.leases, t.granted), (2, 3, 1, 9));
        let text = render(&root);
        assert!(
            text.starts_with("tree        2 nodes · 3 buffers · 1 leases · 4.0 KiB pinned"),
            "{text}"
        );
        assert!(text.contains("(this command)"), "{text}");
        assert!(text.contains("┌ linked node pid 20 (worker-0)"), "{text}");
        let holder = text
            .lines()
            .find(|l| l.contains("│ 30 "))
            .unwrap_or_else(|| panic!("a holder row for pid 30 in:\n{text}"));
        assert!(
            holder.contains("4.0 KiB") && holder.contains("1.5 s"),
            "{holder}"
        );
        assert!(text.contains("QUARANTINED"), "{text}");
    }
}
