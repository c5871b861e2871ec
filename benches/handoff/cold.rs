//! Item 3, cold handoffs: a new buffer every time, on the `baton-ipc` link (no actors: the
//! actor layer's fixed cost is item 2's, and here the driver's costs are the subject).
//!
//! Each handoff: the exporter makes a buffer (a new allocation, or a range carved from a
//! slab arena), sends its handle in an `Offer` (VMM: the descriptor beside it), the
//! importer opens it through its import cache, drops it and sends `Release`; the exporter
//! then frees the buffer. Variants:
//!
//! - `new`: a new allocation each time (host segment; `cuMemAlloc` + `cuIpcGetMemHandle`;
//!   `cuMemCreate` + export fd; `cuMemAllocFromPoolAsync` + `cuMemPoolExportPointer`): the
//!   importer opens and closes the mapping every time (pool: `cuMemPoolImportPointer`, the
//!   pool itself imported once: its descriptor crosses the link with the first offer only,
//!   as the actor layer sends it once per link and pool);
//! - `new-on-stream` (cuda-pool only): a new allocation each time made in stream order on
//!   the exporter's own stream (`CudaBackend::allocate_on`: no synchronise, unlike
//!   `Backend::allocate`, which zero-fills and waits), the offer carrying a fence recorded
//!   after it (`record_fence_on`), which the importer's cache orders its stream after; the
//!   free is `cuMemFreeAsync` on that stream;
//! - `same`: the same allocation every time, the importer holding the first lease for the
//!   whole run: every open is a cache hit, nothing is made or freed. This is the cached
//!   round trip on this same link, the base of the "cold ≤ 2× cached" target;
//! - `slab-kept`: a range of one slab each time, the importer holding one lease of the slab
//!   for the whole run (so the slab stays mapped: every open is a cache hit);
//! - `slab-unkept`: the same, with the importer holding nothing between handoffs: the import
//!   cache closes the slab's mapping when the last lease drops, so every handoff maps the
//!   whole slab again.

use crate::peer::DEADLINE;
use crate::peer::{PeerProcess, result_line};
use crate::report::Report;
use crate::stats::Summary;
use crate::{BackendName, Config, Res};
use baton::ipc::{Allocation, ImportCache, Link, LinkConfig, Listener, SlabArena, SlabBuffer};
use baton::messages::protocol::{Offer, Release};
use baton::messages::{FenceHandle, LeaseId, Message};
use baton::{Session, SocketDir};
use serde_json::json;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
/// Bytes of each buffer (a 1080p RGBA8 frame, rounded up to VMM's 2 MiB granularity).
const BUF_LEN: usize = 8 * MIB;
const SLAB_LEN: usize = 64 * MIB;

enum Made {
    Alloc(Allocation),
    Slab(SlabBuffer),
}

impl Made {
    /// The offer of a lease on it; `with_fd`: its descriptor goes in the frame (slot 0),
    /// else the importer must map it (or its pool) already.
    /// `fence`: the acquire fence the importer waits on.
    fn offer(
        &self,
        session: &Session,
        lease: LeaseId,
        with_fd: bool,
        fence: Option<FenceHandle>,
    ) -> Res<Message> {
        let slot = if with_fd { Some(0) } else { None };
        let builder = match self {
            Made::Alloc(a) => a.handle(session),
            Made::Slab(s) => s.handle(session),
        }
        .fd_slot(slot);
        let handle = match fence {
            Some(f) => builder.fence(f),
            None => builder,
        }
        .build()?;
        Ok(Message::Offer(Box::new(Offer { lease, handle })))
    }

    fn fd(&self) -> Option<BorrowedFd<'_>> {
        match self {
            Made::Alloc(a) => a.export_fd(),
            Made::Slab(s) => s.export_fd(),
        }
    }
}

/// Accepts the link of `peer`, giving up when it exits or after [`DEADLINE`].
/// Counter fences are written into their waiter's inbox (`docs/ORDERING.md`): each side of
/// a raw link lends the other a lane first — sends its `FenceInbox`, then takes the
/// other's — where its backend has counter fences (both sides run the same kind).
pub(crate) fn exchange_inboxes(link: &mut Link, backend: &dyn baton::ipc::Backend) -> Res<()> {
    let peer = link.peer().process;
    let Some(grant) = backend.ordering().inbox_grant(&peer) else {
        return Ok(());
    };
    link.send(&Message::FenceInbox(grant), &[])?;
    match link.recv()?.message {
        Message::FenceInbox(theirs) => Ok(backend.ordering().accept_inbox(&peer, &theirs)?),
        other => Err(format!("expected the peer's FenceInbox, got {}", other.kind()).into()),
    }
}

pub(crate) fn accept(listener: &Listener, peer: &mut PeerProcess) -> Res<Link> {
    listener.listener().set_nonblocking(true)?;
    let start = Instant::now();
    loop {
        match listener.accept() {
            Ok(link) => return Ok(link),
            Err(baton::ipc::Error::Io { source, .. })
                if source.kind() == std::io::ErrorKind::WouldBlock =>
            {
                if peer.exited() {
                    return Err("the importer exited before connecting".into());
                }
                if start.elapsed() > DEADLINE {
                    return Err("the importer did not connect".into());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

pub(crate) fn run(cfg: &Config, name: BackendName, report: &mut Report) -> Res<()> {
    let namespace = format!("bench{}", std::process::id());
    let backend = crate::actor::backend(name, &namespace)?;
    let new_label = match name {
        BackendName::Host => "new shared-memory segment each time",
        BackendName::CudaLegacy => "new cuMemAlloc + cuIpcGetMemHandle each time",
        BackendName::CudaVmm => "new cuMemCreate + exported fd each time",
        BackendName::CudaPool => "new cuMemAllocFromPoolAsync + exported pointer each time",
    };
    let new_n = if name == BackendName::CudaVmm {
        300
    } else {
        1_000
    };
    let mut variants = vec![
        ("new", new_label, new_n),
        (
            "same",
            "the same allocation each time, kept mapped by the importer (cached)",
            5_000,
        ),
        (
            "slab-kept",
            "range of a slab arena, slab kept mapped by the importer",
            5_000,
        ),
        (
            "slab-unkept",
            "range of a slab arena, importer keeps nothing between handoffs",
            1_000,
        ),
    ];
    if cfg.stages {
        // Issue 24: the cached variant alone, then again with the probes recording.
        variants.retain(|v| v.0 == "same");
    }
    if name == BackendName::CudaPool && !cfg.stages {
        variants.insert(
            1,
            (
                "new-on-stream",
                "new cuMemAllocFromPoolAsync on the exporter's stream (allocate_on), fence in the offer",
                1_000,
            ),
        );
    }
    let recorded = (cfg.stages && crate::stages::PROBES).then_some(("same", "recorded", 5_000));
    for (variant, label, n) in variants.into_iter().chain(recorded) {
        let recording = label == "recorded";
        let session = Session::generate()?;
        let tmp = tempfile::tempdir()?;
        let dir = SocketDir::create(tmp.path().join("s"))?;
        let listener = Listener::bind(&dir, "cold.sock", LinkConfig::new(session.clone()))?;
        let sock = listener.path().to_str().ok_or("path")?.to_owned();
        let env = crate::actor::peer_env(name, &namespace);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let pin = if matches!(variant, "slab-kept" | "same") {
            "pin"
        } else {
            "nopin"
        };
        let marks_path = tmp.path().join("importer-marks");
        let marks_arg = marks_path.to_str().ok_or("path")?;
        let args = [sock.as_str(), pin, if recording { marks_arg } else { "-" }];
        let mut peer = PeerProcess::spawn(&session, "cold-importer", &args, &env)?;
        let mut link = accept(&listener, &mut peer)?;
        link.set_timeout(Some(DEADLINE))?;
        exchange_inboxes(&mut link, &*backend)?;
        let importer_process = link.peer().process;
        let arena = if variant.starts_with("slab") {
            Some(SlabArena::allocate(&*backend, SLAB_LEN)?)
        } else {
            None
        };
        // `new-on-stream`: the exporter's own stream, of the backend's context.
        let cuda = backend.cuda();
        let stream = match (variant, cuda) {
            ("new-on-stream", Some(c)) => Some(c.context().new_stream()?),
            ("new-on-stream", None) => return Err("new-on-stream needs a CUDA backend".into()),
            _ => None,
        };
        let same = if variant == "same" {
            Some(Made::Alloc(backend.allocate(BUF_LEN)?))
        } else {
            None
        };
        let (warm, n) = (cfg.samples(n / 10).min(100), cfg.samples(n));
        let (mut make, mut handoff, mut free, mut total) = (vec![], vec![], vec![], vec![]);
        crate::stages::record(recording);
        for i in 0..(warm + n) as u64 {
            let t0 = Instant::now();
            let (made, fence) = match (&arena, &same, &stream, cuda) {
                (_, Some(_), _, _) => (None, None),
                (None, None, Some(stream), Some(c)) => {
                    let a = c.allocate_on(stream, BUF_LEN)?;
                    (
                        Some(Made::Alloc(a)),
                        c.record_fence_for(stream, &importer_process)?,
                    )
                }
                (None, None, _, _) => (Some(Made::Alloc(backend.allocate(BUF_LEN)?)), None),
                (Some(a), None, _, _) => (Some(Made::Slab(a.carve(BUF_LEN)?)), None),
            };
            let t1 = Instant::now();
            let this = made.as_ref().or(same.as_ref()).ok_or("nothing to offer")?;
            crate::stages::mark("rt.begin");
            let lease = LeaseId::new(i + 1);
            // A pool's descriptor, and the one allocation of `same`, cross the link once.
            let with_fd = i == 0 || !(variant == "same" || name == BackendName::CudaPool);
            let fds: Vec<BorrowedFd<'_>> = this.fd().into_iter().filter(|_| with_fd).collect();
            let offer = this.offer(&session, lease, with_fd, fence.as_ref().map(|f| f.handle()))?;
            link.send(&offer, &fds)?;
            match link.recv()?.message {
                Message::Release(Release { lease: back, .. }) if back == lease => {}
                other => return Err(format!("expected Release of {lease}, got {other:?}").into()),
            }
            crate::stages::mark("rt.end");
            let t2 = Instant::now();
            // The importer waited on the fence before it released.
            drop(fence);
            drop(made);
            let t3 = Instant::now();
            if i >= warm as u64 {
                make.push(t1 - t0);
                handoff.push(t2 - t1);
                free.push(t3 - t2);
                total.push(t3 - t0);
            }
        }
        if let Some(stream) = &stream {
            stream.synchronize()?;
        }
        crate::stages::record(false);
        drop(link);
        let importer = peer.result(DEADLINE)?;
        if recording {
            let mut marks = crate::stages::take();
            marks.extend(crate::stages::load(&marks_path)?);
            let unrecorded = report.p50_of("cold_handoff", name.as_str(), "same");
            let anchors = crate::stages::RAW;
            crate::stages::split(report, name.as_str(), "raw", anchors, marks, unrecorded);
            continue;
        }
        let (s_make, s_handoff, s_free) = (
            Summary::of(&make),
            Summary::of(&handoff),
            Summary::of(&free),
        );
        let mut rec = json!({
            "item": 3, "name": "cold_handoff", "backend": name.as_str(), "variant": variant,
            "label": format!("cold handoff: {label}"), "bytes": BUF_LEN,
            "make_p50_us": s_make.p50, "handoff_p50_us": s_handoff.p50, "free_p50_us": s_free.p50,
            "importer": importer,
            "note": format!(
                "make {:.1} + offer→release {:.1} + free {:.1} µs (p50); importer open {:.1}, close {:.1} µs; {} driver opens",
                s_make.p50, s_handoff.p50, s_free.p50,
                importer["open"]["p50_us"].as_f64().unwrap_or(f64::NAN),
                importer["close"]["p50_us"].as_f64().unwrap_or(f64::NAN),
                importer["cache_opens"].as_u64().unwrap_or(0),
            ),
        });
        crate::report::merge(&mut rec, Summary::of(&total).json());
        report.emit(rec);
    }
    Ok(())
}

/// The importer peer: opens every offer through its import cache, drops it (or keeps the
/// first with `pin`), releases; at end of stream prints its timings.
/// `marks`: where to write its probes' marks (issue 24's `--stages`), `-` for nowhere.
pub(crate) fn importer(socket: &str, pin: bool, marks: &str) -> Res<()> {
    crate::stages::record(marks != "-");
    let session = Session::from_env()?;
    let mut link = Link::connect(socket, &LinkConfig::new(session.clone()))?;
    let backend = baton::ipc::select::auto()?;
    exchange_inboxes(&mut link, &*backend)?;
    let exporter = link.peer().process;
    let cache = ImportCache::new(session, [backend.clone()]);
    let mut kept = None;
    let (mut open, mut close) = (Vec::new(), Vec::new());
    loop {
        let received = match link.recv() {
            Ok(r) => r,
            Err(baton::ipc::Error::Closed) => break,
            Err(e) => return Err(e.into()),
        };
        let Message::Offer(offer) = received.message else {
            return Err(format!("expected an Offer, got {}", received.message.kind()).into());
        };
        let mut fds = received.fds;
        if let Some(fence) = &offer.handle.fence {
            backend.ordering().check_fence(&exporter, fence)?;
        }
        let t0 = Instant::now();
        let imported = cache.open(&offer.handle, &mut fds)?;
        crate::stages::mark("cache.opened");
        let t1 = Instant::now();
        if pin && kept.is_none() {
            kept = Some(imported);
        } else {
            drop(imported);
        }
        let t2 = Instant::now();
        open.push(t1 - t0);
        close.push(t2 - t1);
        link.send(&Message::Release(Release::now(offer.lease)), &[])?;
    }
    drop(kept);
    if marks != "-" {
        crate::stages::dump(std::path::Path::new(marks))?;
    }
    let stats = cache.stats();
    // Skip the first open (the process's first driver-level open is the slow one).
    let skip = usize::from(open.len() > 1);
    result_line(&json!({
        "open": Summary::of(&open[skip..]).json(),
        "close": Summary::of(&close[skip..]).json(),
        "first_open_us": open.first().map(|d| d.as_secs_f64() * 1e6),
        "cache_opens": stats.opens,
        "cache_hits": stats.hits,
    }));
    Ok(())
}
