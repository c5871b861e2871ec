//! `--stages` (issue 24): where the time of one cached handoff goes.
//!
//! In one run it measures the socket floor (item 1), the raw link's cached handoff
//! (item 3 `same`), the actor path's (item 2 `share`), and then the actor path again with
//! the probes of the link code recording (`baton::ipc::probe`, built with the
//! `stage-probes` feature): both processes stamp each stage on `CLOCK_MONOTONIC`, the
//! consumer writes its marks to a file at the end, and the two timelines are merged. Each
//! round trip is cut at a fixed list of *anchors* — the first mark of a stage at or after
//! the previous anchor — so the stages of one round add up to its round trip exactly.
//! Each stage's median and share of the median round trip are reported as JSON lines
//! (`name: "stage"`) and as a table. The raw link's round trip is split the same way.
//!
//! Without the feature, `--stages` still measures the three round trips and says that the
//! split needs it.

use crate::report::Report;
use crate::stats::{Summary, round};
use serde_json::{Value, json};
use std::path::Path;

/// Marks a stage of the benchmark's own side (nothing without `stage-probes`).
pub(crate) fn mark(stage: &'static str) {
    #[cfg(feature = "stage-probes")]
    baton::ipc::probe::mark(stage);
    #[cfg(not(feature = "stage-probes"))]
    let _ = stage;
}

/// Whether this build has the probes.
pub(crate) const PROBES: bool = cfg!(feature = "stage-probes");

/// Starts or stops this process's recording.
pub(crate) fn record(on: bool) {
    #[cfg(feature = "stage-probes")]
    baton::ipc::probe::record(on);
    #[cfg(not(feature = "stage-probes"))]
    let _ = on;
}

/// One mark: which process (`E` exporter, `C` consumer/importer), stage, frame kind, ns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stamp {
    side: char,
    stage: String,
    kind: String,
    ns: u64,
}

/// This process's marks so far, as the exporter's (`E`).
pub(crate) fn take() -> Vec<Stamp> {
    #[cfg(feature = "stage-probes")]
    {
        baton::ipc::probe::take()
            .into_iter()
            .map(|m| Stamp {
                side: 'E',
                stage: m.stage.to_owned(),
                kind: m.kind.to_owned(),
                ns: m.ns,
            })
            .collect()
    }
    #[cfg(not(feature = "stage-probes"))]
    Vec::new()
}

/// Writes this process's marks to `path` (one `stage kind ns` line each): the peer's side.
pub(crate) fn dump(path: &Path) -> crate::Res<usize> {
    use std::io::Write;
    let marks = take();
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for m in &marks {
        let kind = if m.kind.is_empty() { "-" } else { &m.kind };
        writeln!(f, "{} {kind} {}", m.stage, m.ns)?;
    }
    f.flush()?;
    Ok(marks.len())
}

/// Reads the peer's marks written by [`dump`], as `C`'s.
pub(crate) fn load(path: &Path) -> crate::Res<Vec<Stamp>> {
    let text = std::fs::read_to_string(path)?;
    let mut out = Vec::new();
    for line in text.lines() {
        let mut it = line.split(' ');
        let (Some(stage), Some(kind), Some(ns)) = (it.next(), it.next(), it.next()) else {
            return Err(format!("bad mark line {line:?}").into());
        };
        out.push(Stamp {
            side: 'C',
            stage: stage.to_owned(),
            kind: if kind == "-" {
                String::new()
            } else {
                kind.to_owned()
            },
            ns: ns.parse()?,
        });
    }
    Ok(out)
}

/// One anchor of a split: the stage that ends at the first mark of (`side`, `stage`, and
/// `kind` unless empty) at or after the previous anchor.
pub(crate) struct Anchor {
    pub(crate) side: char,
    pub(crate) stage: &'static str,
    pub(crate) kind: &'static str,
    /// Which kind of cost the stage is (one of the `const`s below).
    pub(crate) group: &'static str,
    /// Taken only where it falls before the next anchor (else the stage is 0 and the next
    /// one spans both): a `sendmsg` that returns after the peer ran, on a machine where both
    /// processes share a core.
    pub(crate) optional: bool,
    /// What the time up to this anchor is spent on.
    pub(crate) what: &'static str,
}

const ENCODE: &str = "encode + queue";
const HOP: &str = "task / mailbox hop";
const WIRE: &str = "sendmsg + wakeup + recvmsg";
const DECODE: &str = "decode";
const PROTOCOL: &str = "session / protocol";
const CACHE: &str = "import cache hit";
const RELEASE: &str = "handler + release path";

const fn at(
    side: char,
    stage: &'static str,
    kind: &'static str,
    group: &'static str,
    what: &'static str,
) -> Anchor {
    Anchor {
        side,
        stage,
        kind,
        group,
        optional: false,
        what,
    }
}

/// An optional anchor (see [`Anchor::optional`]).
const fn opt(side: char, stage: &'static str, group: &'static str, what: &'static str) -> Anchor {
    Anchor {
        optional: true,
        ..at(side, stage, "", group, what)
    }
}

/// The round trips of the merged timeline: the marks from each `rt.begin` of the exporter
/// to its next `rt.end`, as offsets in ns from the beginning.
fn rounds(mut marks: Vec<Stamp>) -> Vec<Vec<Stamp>> {
    marks.sort_by_key(|m| m.ns);
    let mut out = Vec::new();
    let mut cur: Option<Vec<Stamp>> = None;
    for m in marks {
        let exporter = m.side == 'E';
        if exporter && m.stage == "rt.begin" {
            cur = Some(vec![m]);
        } else if let Some(round) = cur.as_mut() {
            let end = exporter && m.stage == "rt.end";
            round.push(m);
            if end {
                out.extend(cur.take());
            }
        }
    }
    out
}

/// Cuts one round at the anchors: each stage's ns, or `None` if an anchor is missing.
fn cut(round: &[Stamp], anchors: &[Anchor]) -> Option<Vec<u64>> {
    let find = |a: &Anchor, from: usize| {
        round[from..]
            .iter()
            .position(|m| {
                m.side == a.side && m.stage == a.stage && (a.kind.is_empty() || m.kind == a.kind)
            })
            .map(|j| j + from)
    };
    let mut i = 0;
    let mut prev = round.first()?.ns;
    let mut out = Vec::with_capacity(anchors.len());
    for (k, a) in anchors.iter().enumerate() {
        let j = if a.optional {
            // The next anchor that must be there.
            let next = anchors[k + 1..]
                .iter()
                .find(|n| !n.optional)
                .and_then(|n| find(n, i));
            match (find(a, i), next) {
                (Some(j), Some(n)) if j < n => j,
                _ => {
                    out.push(0);
                    continue;
                }
            }
        } else {
            find(a, i)?
        };
        out.push(round[j].ns - prev);
        prev = round[j].ns;
        i = j + 1;
    }
    Some(out)
}

/// A round as text: each mark's offset in µs from the round's beginning.
fn timeline(round: &[Stamp]) -> String {
    let t0 = round.first().map_or(0, |m| m.ns);
    round
        .iter()
        .map(|m| {
            let kind = if m.kind.is_empty() {
                String::new()
            } else {
                format!("({})", m.kind)
            };
            format!(
                "{:>8.2} µs  {} {}{kind}",
                (m.ns - t0) as f64 / 1e3,
                m.side,
                m.stage
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The ns from the first (`side`, `from`) of `round` to the first `to` after it.
fn interval(round: &[Stamp], side: char, from: &str, to: &str) -> Option<u64> {
    let i = round
        .iter()
        .position(|m| m.side == side && m.stage == from)?;
    let j = round[i..]
        .iter()
        .position(|m| m.side == side && m.stage == to)?;
    Some(round[i + j].ns - round[i].ns)
}

/// The median of some ns, in µs, and how many.
fn p50_us(ns: impl Iterator<Item = u64>) -> Option<Summary> {
    let v: Vec<f64> = ns.map(|n| n as f64 / 1e3).collect();
    (!v.is_empty()).then(|| Summary::of_micros(v))
}

/// Splits the round trips in `marks` at `anchors` and reports each stage (`path`: `actor`
/// or `raw`), each group of stages, and the `sendmsg` calls. `unrecorded`: the same
/// path's round trip measured without recording, to show the probes' own cost.
pub(crate) fn split(
    report: &mut Report,
    backend: &str,
    path: &str,
    anchors: &[Anchor],
    marks: Vec<Stamp>,
    unrecorded: Option<f64>,
) {
    let all = rounds(marks);
    // A heartbeat's frames in a round would be taken for the handoff's.
    let clean: Vec<&Vec<Stamp>> = all
        .iter()
        .filter(|r| !r.iter().any(|m| m.kind == "Ping" || m.kind == "Pong"))
        .collect();
    if std::env::var_os("BENCH_STAGES_TIMELINES").is_some() {
        for r in clean.iter().skip(clean.len() / 2).take(3) {
            eprintln!("-- a {path} round on {backend}:\n{}", timeline(r));
        }
    }
    let cuts: Vec<Vec<u64>> = clean.iter().filter_map(|r| cut(r, anchors)).collect();
    let Some(total) = p50_us(cuts.iter().map(|c| c.iter().sum::<u64>())) else {
        report.failed(
            &format!("stages of the {path} path on {backend}"),
            &format!(
                "no round had every anchor in order ({} rounds, {} without heartbeats)",
                all.len(),
                clean.len()
            ),
        );
        return;
    };
    let stage = |k: usize| p50_us(cuts.iter().map(|c| c[k])).expect("rounds were cut");
    let medians: Vec<f64> = (0..anchors.len()).map(|k| stage(k).p50).collect();
    let sum: f64 = medians.iter().sum();
    println!();
    println!(
        "## Stages of one cached handoff round trip, {path} path, {backend} ({} of {} rounds cut; p50 {:.2} µs recorded{})",
        cuts.len(),
        all.len(),
        total.p50,
        unrecorded.map_or(String::new(), |r| format!(", {r:.2} µs unrecorded"))
    );
    println!();
    println!("| # | stage | group | p50 | p90 | share |\n|---:|---|---|---:|---:|---:|");
    for (k, a) in anchors.iter().enumerate() {
        let s = stage(k);
        let share = medians[k] / sum;
        println!(
            "| {} | {} | {} | {:.2} µs | {:.2} µs | {:.1}% |",
            k + 1,
            a.what,
            a.group,
            s.p50,
            s.p90,
            share * 100.0
        );
        let kind = if a.kind.is_empty() {
            String::new()
        } else {
            format!("({})", a.kind)
        };
        report.emit(json!({
            "item": 24, "name": "stage", "backend": backend, "path": path, "index": k + 1,
            "ends_at": format!("{} {}{kind}", a.side, a.stage), "group": a.group,
            "what": a.what, "p50_us": round(s.p50), "p90_us": round(s.p90),
            "share": round(share), "n": s.n,
        }));
    }
    println!(
        "| | sum of the stages' medians | | {sum:.2} µs | | 100% |\n| | round trip (p50 of the rounds' sums) | | {:.2} µs | {:.2} µs | |",
        total.p50, total.p90
    );
    // By group, in the order the groups first appear.
    let mut groups: Vec<(&str, f64, usize)> = Vec::new();
    for (a, m) in anchors.iter().zip(&medians) {
        match groups.iter_mut().find(|g| g.0 == a.group) {
            Some(g) => {
                g.1 += m;
                g.2 += 1;
            }
            None => groups.push((a.group, *m, 1)),
        }
    }
    groups.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!();
    println!("| group ({path}, {backend}) | stages | sum of p50s | share |\n|---|---:|---:|---:|");
    for (group, us, n) in &groups {
        println!("| {group} | {n} | {us:.2} µs | {:.1}% |", us / sum * 100.0);
        report.emit(json!({
            "item": 24, "name": "stage_group", "backend": backend, "path": path,
            "group": group, "stages": n, "p50_sum_us": round(*us), "share": round(us / sum),
        }));
    }
    for &(side, from, to, what) in SYSCALLS {
        let Some(s) = p50_us(clean.iter().filter_map(|r| interval(r, side, from, to))) else {
            continue;
        };
        println!(
            "- {what}: p50 {:.2} µs, p90 {:.2} µs (overlaps the next stage)",
            s.p50, s.p90
        );
        report.emit(json!({
            "item": 24, "name": "syscall", "backend": backend, "path": path, "what": what,
            "p50_us": round(s.p50), "p90_us": round(s.p90), "n": s.n,
        }));
    }
    let mut rec: Value = json!({
        "item": 24, "name": "stage_total", "backend": backend, "path": path,
        "rounds": all.len(), "rounds_cut": cuts.len(),
        "sum_of_medians_us": round(sum),
        "unrecorded_p50_us": unrecorded.map(round),
        "label": format!("{path} path, recorded: round trip split into {} stages", anchors.len()),
    });
    crate::report::merge(&mut rec, total.json());
    report.emit(rec);
}

/// The actor path's anchors (`RemoteAddr::send` → consumer actor → `Release` and reply
/// back in one `sendmsg`; see `actor.rs`), in the order a round trip passes them.
#[rustfmt::skip]
pub(crate) const ACTOR: &[Anchor] = &[
    at('E', "call.queued", "", ENCODE, "E send(): encode message (rmp), turn/window/slot, do_send OutCall"),
    at('E', "link.call", "", HOP, "E mailbox hop: caller task → PeerLink (OutCall)"),
    at('E', "link.call.queued", "", ENCODE, "E grant lease (handle + MAC), encode Call frame, queue"),
    at('E', "sock.send", "", HOP, "E writer task wakeup, batch"),
    at('C', "sock.read", "", WIRE, "E sendmsg (Call) → C epoll wakeup → reader task → recvmsg"),
    at('C', "frame.decoded", "Call", DECODE, "C decode Call frame"),
    at('C', "link.frame", "", HOP, "C reader stream → PeerLink StreamHandler"),
    at('C', "link.session", "", PROTOCOL, "C session: check frame and offer, lease books"),
    at('C', "link.opened", "", CACHE, "C import cache hit (handle MAC), lease guard"),
    at('C', "link.invoked", "", DECODE, "C decode payload (rmp), do_send to the actor"),
    at('C', "actor.handle", "", HOP, "C mailbox hop: PeerLink → consumer actor"),
    at('C', "actor.dropped", "", RELEASE, "C handler: open, drop lease (unref, do_send ReleaseLease)"),
    at('C', "link.release", "", HOP, "C mailbox hop: ReleaseLease → PeerLink"),
    at('C', "link.answer", "", RELEASE, "C encode + queue Release; actor's answer → PeerLink task"),
    at('C', "sock.send", "", ENCODE, "C encode + queue Reply; writer task wakeup, batch"),
    opt('C', "sock.sent", WIRE, "C sendmsg (Release + Reply)"),
    opt('E', "sock.sent", WIRE, "C after its send, to sleep; E back from its own sendmsg (one core: E was preempted there)"),
    at('E', "sock.read", "", WIRE, "E writer loop, tokio, epoll_wait, recvmsg (one core); else C sendmsg → E wakeup → recvmsg"),
    at('E', "frame.decoded", "Release", DECODE, "E decode Release frame"),
    at('E', "link.release.in", "", PROTOCOL, "E stream → PeerLink, session checks Release"),
    at('E', "frame.decoded", "Reply", RELEASE, "E exporter's books (lease back); decode Reply frame"),
    at('E', "link.reply", "", PROTOCOL, "E stream → PeerLink, session, hand reply to caller"),
    at('E', "reply.back", "", HOP, "E caller task wakeup (oneshot), decode reply (rmp)"),
    at('E', "rt.end", "", RELEASE, "E caller sees the lease back (leases_out)"),
];

/// The raw link's anchors (`cold.rs`, variant `same`: an `Offer` frame out, the importer
/// opens it through its import cache, drops it, sends `Release`; blocking sockets).
#[rustfmt::skip]
pub(crate) const RAW: &[Anchor] = &[
    at('E', "sock.send", "", ENCODE, "E build handle (MAC), encode Offer frame"),
    at('C', "sock.read", "", WIRE, "E sendmsg (Offer) → C blocked recvmsg returns"),
    at('C', "frame.decoded", "Offer", DECODE, "C decode Offer frame"),
    at('C', "cache.opened", "", CACHE, "C check fence, import cache hit (handle MAC)"),
    at('C', "sock.send", "", RELEASE, "C drop view, encode Release"),
    opt('C', "sock.sent", WIRE, "C sendmsg (Release)"),
    opt('E', "sock.sent", WIRE, "C after its send, to sleep; E back from its own sendmsg (one core)"),
    at('E', "sock.read", "", WIRE, "E blocked recvmsg returns (one core); else C sendmsg → E wakeup"),
    at('E', "frame.decoded", "Release", DECODE, "E decode Release frame"),
    at('E', "rt.end", "", PROTOCOL, "E check Release"),
];

/// Intervals off the chain above (they overlap the next stage), reported beside it: the
/// `sendmsg` calls themselves, which return after the peer may already be running.
pub(crate) const SYSCALLS: &[(char, &str, &str, &str)] = &[
    (
        'E',
        "sock.send",
        "sock.sent",
        "E sendmsg system call (exporter's frame)",
    ),
    (
        'C',
        "sock.send",
        "sock.sent",
        "C sendmsg system call (importer's frames)",
    ),
];

/// Says that this build cannot split the round trips.
pub(crate) fn no_probes(report: &mut Report) {
    report.failed(
        "per-stage split",
        "this build has no probes: run `cargo bench --bench handoff --features stage-probes -- --stages`",
    );
}

/// The cached round trips the table compares, from the records of this run.
pub(crate) fn summary(report: &mut Report, backend: &str) {
    let floor = report.p50_of("floor", "-", "");
    let raw = report.p50_of("cold_handoff", backend, "same");
    let actor = report.p50_of("cached_roundtrip", backend, "share");
    println!();
    println!("## Cached handoff round trips on {backend} (p50, unrecorded)");
    println!();
    println!("| what | p50 | × floor |\n|---|---:|---:|");
    for (what, v) in [
        ("socket floor (blocking ping-pong)", floor),
        ("raw ipc link, cached (item 3 `same`)", raw),
        ("actor path, cached (item 2 `share`)", actor),
    ] {
        let ratio = match (v, floor) {
            (Some(v), Some(f)) => format!("{:.2}×", v / f),
            _ => String::new(),
        };
        println!(
            "| {what} | {} | {ratio} |",
            v.map_or("—".to_owned(), |v| format!("{v:.1} µs"))
        );
    }
    report.emit(json!({
        "item": 24, "name": "roundtrips", "backend": backend,
        "floor_p50_us": floor, "raw_p50_us": raw, "actor_p50_us": actor,
        "actor_minus_raw_us": match (actor, raw) { (Some(a), Some(r)) => Some(round(a - r)), _ => None },
    }));
}
