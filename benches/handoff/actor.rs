//! Items 2 and 4, through the real actor path: `RemoteAddr::send` of a typed message with a
//! `Shared<u8>` field, to a consumer actor in another process that opens the lease and
//! drops it (which sends `Release`) before it replies. A round trip ends when the reply is
//! in and the `Release` is back at the exporter's buffer (`Buffer::leases_out`).
//!
//! Item 2's variants: `share` (unordered: `Buffer::share` of a buffer no stream used),
//! `share_after` (an IPC event recorded by hand and carried in the handle), and `ordered`
//! (the stream-ordered data path of docs/ORDERING.md: the exporter makes its own stream
//! wait on the release fences that came back (`Buffer::wait_on`) and shares on it
//! (`Buffer::share_on`: a mark, then an acquire fence on a release stream); the consumer
//! makes its own stream wait on the acquire fence (`Lease::wait_on`) and drops the lease,
//! which records a release fence after its stream; `Release` carries it back). Neither side
//! queues other work, so the figure is the ordering's own cost. `ordered` uses a buffer of
//! its own, so that the other variants and item 4 share a buffer no stream has used.
//!
//! The variants take turns, ten chunks each, so that their ratios (the targets) are of
//! samples spread over the same stretch of time.
//!
//! The consumer holds one lease of the buffer for the whole run (the first message asks it
//! to), as a consumer in a steady pipeline would, so every later open is an import-cache
//! hit: no driver call, no `mmap`. Its cache counters are reported to show it.

use crate::peer::DEADLINE;
use crate::peer::PeerProcess;
use crate::report::Report;
use crate::stats::Summary;
use crate::{BackendName, Config, Res};
use actix::prelude::*;
use baton::actors::{
    Allocate, BufferOwner, Lease, Node, NodeConfig, Peer, PeerEvent, RemoteMessage, Shared, Stats,
};
use baton::ipc::cuda::cudarc::driver::CudaStream;
use baton::ipc::cuda::{CudaBackend, fence_kind_from_env};
use baton::ipc::{HostBackend, SharedBackend, host};
use baton::{Session, SocketDir};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where the consumer is registered.
pub(crate) const CONSUMER: &str = "bench.consumer";
const STATS: &str = "bench.consumer.stats";
const PROBES: &str = "bench.consumer.probes";
/// Bytes of the buffer handed off: a 1080p RGBA8 frame rounded up to 8 MiB (a multiple of
/// the VMM granularity: `Allocate` of a size that is not fails on VMM, see BENCHMARKS.md).
const BUF_LEN: u64 = 8 << 20;
/// Handoffs in flight in the pipelined run.
const WINDOW: usize = 256;

/// The message of items 2 and 4: a buffer to open and release.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "u64")]
pub(crate) struct Handoff {
    seq: u64,
    /// Keep the lease (the warm-up handoff) instead of releasing it.
    keep: bool,
    /// Make the consumer's stream wait on the lease (`Lease::wait_on`) before dropping it:
    /// the lease then records a release fence on that stream.
    ordered: bool,
    buf: Shared<u8>,
}

impl RemoteMessage for Handoff {
    const NAME: &'static str = "bench.Handoff";
}

/// Asks the consumer for its counters.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "ConsumerStats")]
struct AskStats;

impl RemoteMessage for AskStats {
    const NAME: &'static str = "bench.AskStats";
}

/// Starts the consumer's probes (`dump: None`), or stops them and has it write its marks
/// to `dump` (issue 24's `--stages`). Answers whether its build has probes.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "bool")]
struct Probes {
    dump: Option<String>,
}

impl RemoteMessage for Probes {
    const NAME: &'static str = "bench.Probes";
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct ConsumerStats {
    handled: u64,
    cache_hits: u64,
    cache_opens: u64,
    failed: u64,
    /// The consumer process's allocations so far (`counting.rs`).
    allocations: u64,
}

struct Consumer {
    node: Node,
    /// The consumer's own stream (CUDA), for `ordered` handoffs.
    stream: Option<Arc<CudaStream>>,
    pinned: Vec<Lease<u8>>,
    handled: u64,
    failed: u64,
}

impl Actor for Consumer {
    type Context = Context<Self>;
}

impl Handler<Handoff> for Consumer {
    type Result = u64;

    fn handle(&mut self, msg: Handoff, _: &mut Context<Self>) -> u64 {
        crate::stages::mark("actor.handle");
        // The lease arrived open (the link opened it through the import cache); `open`
        // types it, `ptr` is what a kernel would be given.
        let opened = msg.buf.open().and_then(|lease| {
            if let (true, Some(stream)) = (msg.ordered, &self.stream) {
                lease.wait_on(stream)?;
            }
            Ok(lease)
        });
        match opened {
            Ok(lease) => {
                std::hint::black_box(lease.ptr().ok());
                self.handled += 1;
                if msg.keep {
                    self.pinned.push(lease);
                } else {
                    // Unmap (a cache reference), then Release.
                    drop(lease);
                    crate::stages::mark("actor.dropped");
                }
                msg.seq
            }
            Err(e) => {
                eprintln!("consumer: {e}");
                self.failed += 1;
                u64::MAX
            }
        }
    }
}

impl Handler<Probes> for Consumer {
    type Result = bool;

    fn handle(&mut self, msg: Probes, _: &mut Context<Self>) -> bool {
        crate::stages::record(msg.dump.is_none());
        if let Some(path) = msg.dump {
            if let Err(e) = crate::stages::dump(std::path::Path::new(&path)) {
                eprintln!("consumer: could not write the marks: {e}");
            }
        }
        crate::stages::PROBES
    }
}

impl Handler<AskStats> for Consumer {
    type Result = MessageResult<AskStats>;

    fn handle(&mut self, _: AskStats, _: &mut Context<Self>) -> Self::Result {
        let cache = self.node.cache().stats();
        MessageResult(ConsumerStats {
            handled: self.handled,
            cache_hits: cache.hits,
            cache_opens: cache.opens,
            failed: self.failed,
            allocations: crate::counting::allocations(),
        })
    }
}

/// Stops the consumer's system when its link goes down.
struct Stopper;

impl Actor for Stopper {
    type Context = Context<Self>;
}

impl Handler<PeerEvent> for Stopper {
    type Result = ();
    fn handle(&mut self, msg: PeerEvent, _: &mut Context<Self>) {
        if matches!(msg, PeerEvent::Down { .. }) {
            System::current().stop();
        }
    }
}

/// The consumer peer.
pub(crate) fn consumer(socket: &str) -> Res<()> {
    let system = system(ring_from_env() && std::env::var(RING_POLL_ENV).as_deref() != Ok("0"))?;
    let socket = socket.to_owned();
    system.block_on(async move {
        let node = Node::from_env().map_err(|e| e.to_string())?;
        let stream = match node.backend().cuda() {
            Some(c) => Some(c.context().new_stream().map_err(|e| e.to_string())?),
            None => None,
        };
        let consumer = Consumer {
            node: node.clone(),
            stream,
            pinned: Vec::new(),
            handled: 0,
            failed: 0,
        }
        .start();
        node.register::<Handoff>(CONSUMER, consumer.clone().recipient());
        node.register::<Probes>(PROBES, consumer.clone().recipient());
        node.register::<AskStats>(STATS, consumer.recipient());
        node.subscribe(Stopper.start().recipient());
        node.connect(&socket).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(())
    })?;
    system.run()?;
    Ok(())
}

/// An actix system; with `ring`, one whose thread polls the links' rings before it parks.
fn system(ring: bool) -> Res<SystemRunner> {
    Ok(if ring {
        baton::actors::ring_polling_system()?
    } else {
        System::new()
    })
}

/// `0` when the parent asks this peer for rings on a plain system (`--ring-unpolled`).
const RING_POLL_ENV: &str = "BATON_BENCH_RING_POLL";

/// Whether the parent asked this peer for rings (`BATON_LINK_RING=1`; `0` with `--socket`).
fn ring_from_env() -> bool {
    std::env::var(baton::ipc::link::RING_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The backend a part allocates with.
pub(crate) fn backend(name: BackendName, namespace: &str) -> Res<SharedBackend> {
    Ok(match name {
        BackendName::Host => Arc::new(HostBackend::with_namespace(namespace)?),
        BackendName::CudaLegacy | BackendName::CudaVmm | BackendName::CudaPool => cuda(name)?,
    })
}

/// A CUDA backend on device 0 exporting as `name` says, with the fences `BATON_CUDA_FENCE`
/// asks for (counters unless it says `event`; the consumer peer inherits the variable).
pub(crate) fn cuda(name: BackendName) -> Res<Arc<CudaBackend>> {
    Ok(Arc::new(
        CudaBackend::builder(0)
            .export(name.export())
            .fence(fence_kind_from_env()?)
            .build()?,
    ))
}

/// The environment of a peer that opens what `name` exports.
pub(crate) fn peer_env(name: BackendName, namespace: &str) -> Vec<(&'static str, String)> {
    vec![
        (
            baton::ipc::select::BACKEND_ENV,
            if name.is_cuda() { "cuda" } else { "host" }.to_owned(),
        ),
        (host::NAMESPACE_ENV, namespace.to_owned()),
        // The peer exports the way this process does (it opens every kind either way).
        (
            baton::ipc::cuda::EXPORT_ENV,
            name.export().name().to_owned(),
        ),
    ]
}

async fn wait_for_link(node: &Node, peer: &mut PeerProcess) -> Res<Peer> {
    let start = Instant::now();
    let pid = peer.pid();
    loop {
        if let Some(p) = node.peers().into_iter().find(|p| p.process().pid == pid) {
            return Ok(p);
        }
        if peer.exited() {
            return Err("the consumer exited before linking".into());
        }
        if start.elapsed() > DEADLINE {
            return Err("the consumer did not link".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

pub(crate) fn run(cfg: &Config, name: BackendName, report: &mut Report) -> Res<()> {
    let namespace = format!("bench{}", std::process::id());
    let (ring, polled) = (cfg.ring, cfg.ring && !cfg.ring_unpolled);
    let cfg = cfg.clone();
    let (records, recorded) =
        system(polled)?.block_on(async move { measure(&cfg, name, &namespace).await })?;
    for mut r in records {
        r["link_ring"] = json!(ring);
        r["ring_polled"] = json!(polled);
        if r["name"] == "error" {
            let what = r["what"].as_str().unwrap_or("item 2");
            report.failed(what, r["error"].as_str().unwrap_or(""));
        } else {
            report.emit(r);
        }
    }
    if let Some(marks) = recorded {
        let unrecorded = report.p50_of("cached_roundtrip", name.as_str(), "share");
        let anchors = crate::stages::ACTOR;
        crate::stages::split(report, name.as_str(), "actor", anchors, marks, unrecorded);
    }
    Ok(())
}

/// Records of a run, and the marks of its recorded round trips (`--stages`).
type Measured = (Vec<serde_json::Value>, Option<Vec<crate::stages::Stamp>>);

async fn measure(
    cfg: &Config,
    name: BackendName,
    namespace: &str,
) -> Result<Measured, Box<dyn std::error::Error>> {
    let mut out = Vec::new();
    let session = Session::generate()?;
    let cuda = if name.is_cuda() {
        Some(cuda(name)?)
    } else {
        None
    };
    let backend: SharedBackend = match &cuda {
        Some(c) => c.clone(),
        None => backend(name, namespace)?,
    };
    // Rings both ways by default (the consumer asks through its environment), none with
    // `--socket`, whatever `BATON_LINK_RING` says.
    let ring = cfg.ring.then_some(baton::ipc::ring::DEFAULT_CAPACITY);
    let node = Node::with_config(NodeConfig::new(session.clone()).ring(ring), backend);
    let tmp = tempfile::tempdir()?;
    let dir = SocketDir::create(tmp.path().join("s"))?;
    let listening = node.listen(&dir, "bench.sock")?;
    let mut env = peer_env(name, namespace);
    env.push((
        baton::ipc::link::RING_ENV,
        if cfg.ring { "1" } else { "0" }.to_owned(),
    ));
    env.push((
        RING_POLL_ENV,
        if cfg.ring_unpolled { "0" } else { "1" }.to_owned(),
    ));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let sock = listening.path().to_str().ok_or("path")?.to_owned();
    let mut peer = PeerProcess::spawn(&session, "consumer", &[&sock], &env)?;
    let link = wait_for_link(&node, &mut peer).await?;
    let owner = BufferOwner::new(&node).start();
    let buf = owner.send(Allocate::<u8>::vector(BUF_LEN)).await??;
    let consumer = link.remote::<Handoff>(CONSUMER);
    // The consumer keeps this lease: the buffer stays mapped there, later opens hit.
    pin(&consumer, &buf).await?;
    // Leases the consumer keeps for the whole run (the ordered variant pins one more).
    let mut pinned = 1;
    let backend_name = name.as_str();
    // The marks of the recorded round trips (`--stages`).
    let mut recorded = None;

    if cfg.wants(2) {
        let mut variants = vec!["share"];
        // The ordered variant's buffer and the exporter's own stream.
        let mut ordered = None;
        if let (Some(c), false) = (&cuda, cfg.stages) {
            variants.extend(["share_after", "ordered"]);
            let obuf = owner.send(Allocate::<u8>::vector(BUF_LEN)).await??;
            pin(&consumer, &obuf).await?;
            pinned += 1;
            ordered = Some((obuf, c.context().new_stream()?));
        }
        // The variants take turns, a chunk each, so that each one's samples span the whole
        // measurement and a drift of the machine moves them alike (their ratios are the
        // targets): `CHUNKS` rounds of `n / CHUNKS` round trips, each after a warm-up of its
        // own (a variant's first the longest), so that a chunk is timed after its variant
        // ran a while. (Interleaved, the ordered variant times higher against the unordered
        // one than in blocks one after the other — 1.6-2.8x against 1.2-2.5x on one H200,
        // 2-3x without the warm-ups: the variants change one another's pace; docs/BENCHMARKS.md.)
        // Allocations are counted over each variant's first chunk.
        const CHUNKS: usize = 10;
        let (warm, n) = (cfg.samples(2_000), cfg.samples(20_000));
        let chunk = n.div_ceil(CHUNKS).max(1);
        let mut measured: Vec<Option<Timed>> =
            variants.iter().map(|_| Some(Timed::default())).collect();
        for round in 0..n.div_ceil(chunk) {
            for (variant, slot) in variants.iter().zip(measured.iter_mut()) {
                let Some(timed) = slot else {
                    continue;
                };
                let this = match (*variant, &ordered) {
                    ("ordered", Some((obuf, _))) => obuf,
                    _ => &buf,
                };
                let warm = if round == 0 { warm } else { warm / 4 };
                let before = Allocations::now(&link).await?;
                let got = round_trips(
                    variant,
                    (warm, chunk),
                    &consumer,
                    this,
                    cuda.as_deref(),
                    ordered.as_ref(),
                )
                .await;
                match got {
                    Ok((samples, replies)) => {
                        if round == 0 {
                            timed.allocations =
                                Some(before.per_handoff(&link, warm + chunk).await?);
                        }
                        timed.samples.extend(samples);
                        timed.replies.extend(replies);
                    }
                    // A variant that fails is recorded; the others and item 4 still run.
                    Err(e) => {
                        out.push(json!({
                            "item": -1, "name": "error", "backend": backend_name,
                            "what": format!("item 2 {variant} on {backend_name}"),
                            "error": e.to_string(),
                        }));
                        *slot = None;
                    }
                }
            }
        }
        for (variant, timed) in variants.iter().zip(measured) {
            let Some(timed) = timed else {
                continue;
            };
            let label = match *variant {
                "share" => "cached handoff round trip, unordered (send, open = cache hit, release)",
                "share_after" => "cached handoff round trip, with an IPC event (share_after)",
                _ => "cached handoff round trip, stream-ordered (share_on, wait_on, release fence)",
            };
            let replies = Summary::of(&timed.replies);
            let mut rec = json!({
                "item": 2, "name": "cached_roundtrip", "backend": backend_name,
                "variant": variant, "label": label, "bytes": BUF_LEN,
                "fence": cuda.as_ref().map(|c| c.fence_kind().name()),
                "reply_p50_us": replies.p50,
                "interleaved_chunks": CHUNKS,
                "note": match &cuda {
                    Some(c) => format!(
                        "until the Release is back; {:.1} µs until the reply; {} fences",
                        replies.p50,
                        c.fence_kind().name()
                    ),
                    None => format!("until the Release is back; {:.1} µs until the reply", replies.p50),
                },
            });
            crate::report::merge(&mut rec, Summary::of(&timed.samples).json());
            if let Some(allocations) = timed.allocations {
                crate::report::merge(&mut rec, allocations);
            }
            out.push(rec);
        }
        if let Some((_, stream)) = &ordered {
            // Every fence recorded on the way completes (a stream that waits forever
            // would hang here, not pass).
            stream.synchronize()?;
        }
    }

    if cfg.stages && crate::stages::PROBES {
        // Issue 24: the cached round trip again, both processes' probes recording.
        let probes = link.remote::<Probes>(PROBES);
        let dump = tmp.path().join("consumer-marks");
        let call = |dump: Option<String>| probes.send(Probes { dump });
        if !call(None).await? {
            return Err("the consumer was built without probes".into());
        }
        crate::stages::record(true);
        let timed = round_trips(
            "share",
            (cfg.samples(2_000), cfg.samples(20_000)),
            &consumer,
            &buf,
            None,
            None,
        )
        .await;
        crate::stages::record(false);
        call(Some(dump.to_str().ok_or("path")?.to_owned())).await?;
        let (samples, _) = timed?;
        let mut marks = crate::stages::take();
        marks.extend(crate::stages::load(&dump)?);
        out.push(json!({
            "item": 24, "name": "recorded_roundtrip", "backend": backend_name,
            "label": "cached handoff round trip, actor path, probes recording",
            "marks": marks.len(),
            "summary": Summary::of(&samples).json(),
        }));
        recorded = Some(marks);
    }

    if cfg.wants(4) {
        let n = cfg.samples(200_000);
        // Warm up the pipeline once, untimed.
        pipeline(&consumer, &buf, cfg.samples(20_000), WINDOW).await?;
        drained(&owner, pinned).await?;
        let before = Allocations::now(&link).await?;
        let t = Instant::now();
        pipeline(&consumer, &buf, n, WINDOW).await?;
        let replies = t.elapsed();
        drained(&owner, pinned).await?;
        let all = t.elapsed();
        let allocations = before.per_handoff(&link, n).await?;
        let mut rec = json!({
            "item": 4, "name": "pipelined", "backend": backend_name, "window": WINDOW, "n": n,
            "label": format!("pipelined handoffs, {WINDOW} in flight, releases flowing back"),
            "per_s": n as f64 / all.as_secs_f64(),
            "per_s_replies": n as f64 / replies.as_secs_f64(),
            "seconds": all.as_secs_f64(),
            "note": format!("{:.0}/s counting replies only", n as f64 / replies.as_secs_f64()),
        });
        crate::report::merge(&mut rec, allocations);
        out.push(rec);
    }

    let stats = consumer_stats(&link).await?;
    out.push(json!({
        "item": 2, "name": "consumer_cache", "backend": backend_name,
        "label": "consumer's import cache over the run",
        "handled": stats.handled, "cache_hits": stats.cache_hits,
        "cache_opens": stats.cache_opens, "failed": stats.failed,
        "note": format!("{} handoffs: {} driver-level opens, {} cache hits", stats.handled, stats.cache_opens, stats.cache_hits),
    }));
    if stats.failed > 0 {
        return Err(format!("the consumer failed {} handoffs", stats.failed).into());
    }
    // Which directions really went through a ring (`Peer::rings`), in every record.
    let rings = link.rings();
    for r in &mut out {
        r["rings"] = json!({"inbound": rings.inbound, "outbound": rings.outbound});
    }
    link.close();
    let start = Instant::now();
    while !peer.exited() {
        if start.elapsed() > DEADLINE {
            return Err("the consumer did not exit".into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(listening);
    Ok((out, recorded))
}

/// One item-2 variant's round trips, gathered over its chunks.
#[derive(Default)]
struct Timed {
    samples: Vec<Duration>,
    replies: Vec<Duration>,
    /// Allocations per handoff over its first chunk.
    allocations: Option<serde_json::Value>,
}

/// Both processes' allocation counters at one moment (`counting.rs`): the consumer's is
/// asked for over the link (one small call, counted in neither figure's handoffs).
struct Allocations {
    exporter: u64,
    consumer: u64,
}

impl Allocations {
    async fn now(link: &Peer) -> Res<Self> {
        let consumer = consumer_stats(link).await?.allocations;
        Ok(Self {
            exporter: crate::counting::allocations(),
            consumer,
        })
    }

    /// Allocations per handoff on each side since `self`, over `n` handoffs.
    async fn per_handoff(&self, link: &Peer, n: usize) -> Res<serde_json::Value> {
        let exporter = crate::counting::allocations() - self.exporter;
        let consumer = consumer_stats(link).await?.allocations - self.consumer;
        let per = |a: u64| (a as f64 / n as f64 * 100.0).round() / 100.0;
        Ok(json!({
            "allocs_per_handoff_exporter": per(exporter),
            "allocs_per_handoff_consumer": per(consumer),
            "allocs_handoffs": n,
        }))
    }
}

async fn consumer_stats(link: &Peer) -> Res<ConsumerStats> {
    Ok(link
        .remote::<AskStats>(STATS)
        .send(AskStats)
        .await
        .map_err(|e| e.to_string())?)
}

/// `n` handoffs with at most `window` in flight; returns when every reply is in.
async fn pipeline(
    consumer: &baton::actors::RemoteAddr<Handoff>,
    buf: &baton::actors::Buffer<u8>,
    n: usize,
    window: usize,
) -> Res<()> {
    let mut inflight = FuturesUnordered::new();
    let (mut sent, mut done) = (0u64, 0usize);
    while done < n {
        while (sent as usize) < n && inflight.len() < window {
            sent += 1;
            inflight.push(consumer.send(Handoff {
                seq: sent,
                keep: false,
                ordered: false,
                buf: buf.share(),
            }));
        }
        match inflight.next().await {
            Some(Ok(_)) => done += 1,
            Some(Err(e)) => return Err(e.into()),
            None => break,
        }
    }
    Ok(())
}

/// `n` round trips of item 2's `variant` after `warm` untimed ones: (until the release is
/// back, until the reply).
async fn round_trips(
    variant: &str,
    (warm, n): (usize, usize),
    consumer: &baton::actors::RemoteAddr<Handoff>,
    this: &baton::actors::Buffer<u8>,
    cuda: Option<&CudaBackend>,
    ordered: Option<&(baton::actors::Buffer<u8>, Arc<CudaStream>)>,
) -> Res<(Vec<Duration>, Vec<Duration>)> {
    let mut samples = Vec::with_capacity(n);
    let mut replies = Vec::with_capacity(n);
    for i in 0..(warm + n) as u64 {
        let t = Instant::now();
        crate::stages::mark("rt.begin");
        let shared = match (variant, cuda, ordered) {
            // With an event: recorded now on the backend's stream, carried in the
            // handle; the consumer's stream waits on it when it opens the buffer.
            ("share_after", Some(c), _) => this.share_after(&Arc::new(c.record_event()?)),
            // The exporter's next use of the buffer on its stream waits on the
            // release fences that came back; the share records a mark there and
            // an acquire fence after it.
            ("ordered", _, Some((obuf, stream))) => {
                obuf.wait_on(stream)?;
                obuf.share_on(stream)?
            }
            _ => this.share(),
        };
        let call = consumer.send(Handoff {
            seq: i + 1,
            keep: false,
            ordered: variant == "ordered",
            buf: shared,
        });
        crate::stages::mark("call.queued");
        let seq = call.await?;
        crate::stages::mark("reply.back");
        if seq != i + 1 {
            return Err(format!("handoff {} answered {seq}", i + 1).into());
        }
        let replied = t.elapsed();
        // The consumer's pin stays out; this handoff's lease must be back.
        released(this, 1).await?;
        crate::stages::mark("rt.end");
        if i >= warm as u64 {
            samples.push(t.elapsed());
            replies.push(replied);
        }
    }
    Ok((samples, replies))
}

/// Hands `buf` to the consumer to keep for the whole run: later opens are cache hits.
async fn pin(
    consumer: &baton::actors::RemoteAddr<Handoff>,
    buf: &baton::actors::Buffer<u8>,
) -> Res<()> {
    consumer
        .send(Handoff {
            seq: 0,
            keep: true,
            ordered: false,
            buf: buf.share(),
        })
        .await?;
    Ok(())
}

/// Waits until at most `keep` leases of `buf` are out, yielding to the node's actors (which
/// take the `Release` in) between looks.
async fn released(buf: &baton::actors::Buffer<u8>, keep: usize) -> Res<()> {
    let start = Instant::now();
    while buf.leases_out() > keep {
        if start.elapsed() > DEADLINE {
            return Err("a release did not come back".into());
        }
        tokio::task::yield_now().await;
    }
    Ok(())
}

/// Waits until only `keep` leases are out (every release came back).
async fn drained(owner: &Addr<BufferOwner>, keep: usize) -> Res<()> {
    let start = Instant::now();
    loop {
        if owner.send(Stats).await?.leases <= keep {
            return Ok(());
        }
        if start.elapsed() > DEADLINE {
            return Err("releases did not come back".into());
        }
        tokio::time::sleep(Duration::from_micros(100)).await;
    }
}
