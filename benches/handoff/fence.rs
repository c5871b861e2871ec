//! Item 8, fence costs: a stream-ordered handoff taken apart call by call, for each fence
//! kind (`FenceKind::Event`: pooled IPC events; `FenceKind::Counter`: stream memory
//! operations on a shared counter slab; `BATON_CUDA_FENCE` picks one for a backend built
//! from the environment, here both are built in turn with `CudaBackendBuilder::fence`).
//!
//! Two processes on a `baton-ipc` link (no actors: their fixed cost is item 2's), one
//! 2 MiB legacy allocation offered again and again, the importer keeping the first lease
//! (every later open is an import-cache hit). Each handoff, every step timed with `Instant`
//! around the one call:
//!
//! | step | side | call |
//! |---|---|---|
//! | `record_acquire` | exporter | `CudaBackend::record_fence_for(stream, importer)` (`cuEventRecord`; or a fence of its own on `stream`, a release stream waiting on it, then `cuStreamWriteValue64` into the importer's inbox) |
//! | `build_offer` | exporter | the handle with the fence, sealed (`HandleBuilder::fence(..).build()`) |
//! | `encode` | exporter | the `Offer` frame encoded (`codec::frame_bytes`, bincode) |
//! | `send` | exporter | `Link::send` (encodes again, `sendmsg`) |
//! | `open` | importer | `ImportCache::open_unordered` (a hit) |
//! | `wait_acquire` | importer | `CudaBackend::wait_fence_on(exporter, fence, stream)` (`cuStreamWaitEvent` / `cuStreamWaitValue64`) |
//! | `record_release` | importer | counters: `StreamOrdering::export_fence_on(stream, exporter)` (the stream writes the exporter's inbox itself, `cuStreamWriteValue64`: what a lease used on one stream named with `wait_on` does when it drops); events: `record_fence_for(stream, exporter)` |
//! | `send_release` | importer | `Link::send` of `Release { fences: [that fence] }` |
//! | `drop_release` | importer | the previous release fence given back to its pool (the exporter waited on it before this offer) |
//! | `wait_reply` | exporter | from the send to the `Release` in (the importer's steps and two socket hops) |
//! | `drop_acquire` | exporter | the acquire fence given back to its pool (the importer waited before it released) |
//! | `wait_release` | exporter | `wait_fence_on(importer, release fence, stream)`: the exporter's next use waits |
//!
//! The first handoff's open and waits are reported apart (they open the other process's
//! event or counter slab: `cuIpcOpenEventHandle` / `cuIpcOpenMemHandle`). Neither stream
//! queues other work; both are synchronised at the end (every wait was satisfied, or the run
//! hangs there and the deadline reports it). Medians; the kind whose driver calls cost less
//! per handoff is named.

use crate::peer::DEADLINE;
use crate::peer::{PeerProcess, result_line};
use crate::report::Report;
use crate::stats::{Summary, round};
use crate::{Config, Res};
use baton::ipc::ExportedFence;
use baton::ipc::cuda::{CudaBackend, CudaExport, FenceKind, fence_kind_from_env};
use baton::ipc::{Backend, ImportCache, Link, LinkConfig, Listener, SharedBackend, Stream};
use baton::messages::codec;
use baton::messages::protocol::{Offer, Release};
use baton::messages::{LeaseId, Message};
use baton::{Session, SocketDir};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ALLOC_LEN: usize = 2 << 20;

/// The exporter's steps, in the order they run.
const EXPORTER_STEPS: [&str; 7] = [
    "record_acquire",
    "build_offer",
    "encode",
    "send",
    "wait_reply",
    "drop_acquire",
    "wait_release",
];
/// The importer's steps.
const IMPORTER_STEPS: [&str; 5] = [
    "drop_release",
    "open",
    "wait_acquire",
    "record_release",
    "send_release",
];
/// The steps that are fence driver calls: their medians' sum is the fence's cost per handoff.
const DRIVER_STEPS: [&str; 4] = [
    "record_acquire",
    "wait_acquire",
    "record_release",
    "wait_release",
];

/// Emits the item's "not run" record.
pub(crate) fn not_run(report: &mut Report, why: &str) {
    report.emit(json!({
        "item": 8, "name": "fence_costs", "backend": "-", "variant": "not-run",
        "label": format!("fence costs: not run ({why})"),
    }));
}

pub(crate) fn run(cfg: &Config, report: &mut Report) -> Res<()> {
    let mut driver = Vec::new();
    for kind in [FenceKind::Event, FenceKind::Counter] {
        let (effective, steps, importer, total) = measure(cfg, kind)?;
        let p50 = |k: &str| -> f64 {
            steps
                .get(k)
                .or_else(|| importer.get(k))
                .and_then(|s| s["p50_us"].as_f64())
                .unwrap_or(f64::NAN)
        };
        let driver_p50: f64 = DRIVER_STEPS.iter().map(|k| p50(k)).sum();
        let fell_back = effective != kind;
        for (side, names, from) in [
            ("exporter", &EXPORTER_STEPS[..], &steps),
            ("importer", &IMPORTER_STEPS[..], &importer),
        ] {
            for &step in names {
                let mut rec = json!({
                    "item": 8, "name": "fence_step", "backend": "cuda-legacy",
                    "variant": format!("{}/{step}", effective.name()), "fence": effective.name(),
                    "side": side, "step": step,
                    "label": format!("fence {} step: {side} {step}", effective.name()),
                });
                crate::report::merge(&mut rec, from[step].clone());
                report.emit(rec);
            }
        }
        let first = |k: &str| importer["first"][k].as_f64().unwrap_or(f64::NAN);
        let mut rec = json!({
            "item": 8, "name": "fence_costs", "backend": "cuda-legacy",
            "variant": kind.name(), "fence": effective.name(), "fell_back": fell_back,
            "label": format!(
                "fence costs per handoff, {}{}",
                effective.name(),
                if fell_back { " (counter asked: the device has no 64-bit stream memory operations)" } else { "" }
            ),
            "driver_p50_us": round(driver_p50),
            "exporter": steps, "importer": importer,
            "note": format!(
                "driver calls {driver_p50:.1} µs (p50 sum): record {:.1} + importer wait {:.1} + release record {:.1} + exporter wait {:.1}; offer build {:.1}, encode {:.1}; first handoff: importer open {:.1}, wait {:.1} µs",
                p50("record_acquire"), p50("wait_acquire"), p50("record_release"), p50("wait_release"),
                p50("build_offer"), p50("encode"), first("open"), first("wait_acquire"),
            ),
        });
        crate::report::merge(&mut rec, total);
        report.emit(rec);
        if !fell_back {
            driver.push((effective, driver_p50));
        }
    }
    match driver.as_slice() {
        [(a, pa), (b, pb)] => {
            let ((cheap, pc), (dear, pd)) = if pa <= pb {
                ((a, pa), (b, pb))
            } else {
                ((b, pb), (a, pa))
            };
            report.emit(json!({
                "item": 0, "name": "fence_compare", "cheaper": cheap.name(),
                "driver_p50_us": {a.name(): round(*pa), b.name(): round(*pb)},
                "ratio": round(pd / pc),
                "note": format!(
                    "{} fences cost {pc:.1} µs of driver calls per handoff, {} {pd:.1} µs ({:.2}×)",
                    cheap.name(), dear.name(), pd / pc
                ),
            }));
        }
        _ => report.emit(json!({
            "item": 0, "name": "fence_compare", "cheaper": Value::Null,
            "note": "only one fence kind ran (counter fences fell back to events)",
        })),
    }
    Ok(())
}

/// Waits (untimed) while `to` has a backlog of our event fences whose work has not
/// completed, as the actor layer's calls do (`StreamOrdering::fence_room`): a loop with no host
/// synchronisation runs ahead of the bridged chain of event fences and would run the
/// pool dry (docs/ORDERING.md). Counter fences always have room.
fn room_for(cuda: &CudaBackend, to: &baton::messages::ProcessId) -> Res<()> {
    let start = Instant::now();
    while !cuda.ordering().fence_room(to) {
        if start.elapsed() > DEADLINE {
            return Err("no event fence to spare within the deadline".into());
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(())
}

/// One kind: (the kind the backend used, the exporter's step summaries, the importer's
/// result, the whole handoff's summary).
fn measure(cfg: &Config, kind: FenceKind) -> Res<(FenceKind, Value, Value, Value)> {
    let cuda = Arc::new(
        CudaBackend::builder(0)
            .export(CudaExport::Legacy)
            .fence(kind)
            .build()?,
    );
    let effective = cuda.fence_kind();
    let stream = cuda.context().new_stream()?;
    let alloc = cuda.allocate(ALLOC_LEN)?;
    let (warm, n) = (cfg.samples(1_000).min(200), cfg.samples(10_000));
    let session = Session::generate()?;
    let tmp = tempfile::tempdir()?;
    let dir = SocketDir::create(tmp.path().join("s"))?;
    let listener = Listener::bind(&dir, "fence.sock", LinkConfig::new(session.clone()))?;
    let sock = listener.path().to_str().ok_or("path")?.to_owned();
    let env = [(baton::ipc::cuda::FENCE_ENV, effective.name())];
    let mut peer = PeerProcess::spawn(
        &session,
        "fence-importer",
        &[&sock, &warm.to_string()],
        &env,
    )?;
    let mut link = crate::cold::accept(&listener, &mut peer)?;
    link.set_timeout(Some(DEADLINE))?;
    crate::cold::exchange_inboxes(&mut link, &*cuda)?;
    let importer = link.peer().process;
    let mut steps: Vec<Vec<Duration>> = vec![Vec::with_capacity(n); EXPORTER_STEPS.len()];
    let mut total = Vec::with_capacity(n);
    for i in 0..(warm + n) as u64 {
        let lease = LeaseId::new(i + 1);
        room_for(&cuda, &importer)?;
        let t0 = Instant::now();
        let acquire = cuda
            .record_fence_for(&stream, &importer)?
            .ok_or("no fence recorded")?;
        let t1 = Instant::now();
        let handle = alloc.handle(&session).fence(acquire.handle()).build()?;
        let msg = Message::Offer(Box::new(Offer { lease, handle }));
        let t2 = Instant::now();
        std::hint::black_box(codec::frame_bytes(&msg, 0)?);
        let t3 = Instant::now();
        link.send(&msg, &[])?;
        let t4 = Instant::now();
        let fences = match link.recv()?.message {
            Message::Release(Release {
                lease: back,
                fences,
            }) if back == lease => fences,
            other => return Err(format!("expected Release of {lease}, got {other:?}").into()),
        };
        let t5 = Instant::now();
        // The importer's stream waited on it before the importer released.
        drop(acquire);
        let t6 = Instant::now();
        if fences.is_empty() {
            return Err("the Release carried no fence".into());
        }
        for fence in &fences {
            cuda.ordering().check_fence(&importer, fence)?;
            cuda.wait_fence_on(&importer, fence, &stream)?;
        }
        let t7 = Instant::now();
        if i >= warm as u64 {
            for (s, d) in steps.iter_mut().zip([
                t1 - t0,
                t2 - t1,
                t3 - t2,
                t4 - t3,
                t5 - t4,
                t6 - t5,
                t7 - t6,
            ]) {
                s.push(d);
            }
            total.push(t7 - t0);
        }
    }
    // Every wait queued on the way is satisfied: the chain of fences completes.
    let t = Instant::now();
    stream.synchronize()?;
    let sync_us = t.elapsed().as_secs_f64() * 1e6;
    drop(link);
    let mut result = peer.result(DEADLINE)?;
    // Events given back but not yet seen complete count as lent until the pool sweeps.
    let (alive, lent) = cuda.fence_counts();
    let mut exporter = serde_json::Map::new();
    for (name, s) in EXPORTER_STEPS.iter().zip(&steps) {
        exporter.insert((*name).into(), Summary::of(s).json());
    }
    exporter.insert("final_sync_us".into(), round(sync_us).into());
    exporter.insert("fences_alive".into(), alive.into());
    exporter.insert("fences_lent_or_retired".into(), lent.into());
    if let Some(o) = result.as_object_mut() {
        o.insert("kind".into(), effective.name().into());
    }
    Ok((
        effective,
        Value::Object(exporter),
        result,
        Summary::of(&total).json(),
    ))
}

/// The importer peer: opens each offer (a cache hit after the first, which it keeps), makes
/// its stream wait on the offer's fence, records a release fence there and sends it back in
/// `Release`; at end of stream synchronises and prints its step timings (the first
/// handoff's apart, the next `warm - 1` left out).
pub(crate) fn importer(socket: &str, warm: usize) -> Res<()> {
    let session = Session::from_env()?;
    let mut link = Link::connect(socket, &LinkConfig::new(session.clone()))?;
    let cuda = Arc::new(
        CudaBackend::builder(0)
            .fence(fence_kind_from_env()?)
            .build()?,
    );
    crate::cold::exchange_inboxes(&mut link, &*cuda)?;
    let exporter = link.peer().process;
    let cache = ImportCache::new(session, [cuda.clone() as SharedBackend]);
    let stream = cuda.context().new_stream()?;
    let mut kept = None;
    let mut previous: Option<Arc<dyn ExportedFence>> = None;
    let mut steps: Vec<Vec<Duration>> = vec![Vec::new(); IMPORTER_STEPS.len()];
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
        let fence = offer.handle.fence.ok_or("the offer carried no fence")?;
        room_for(&cuda, &exporter)?;
        let t0 = Instant::now();
        // The exporter's stream waited on it before it sent this offer.
        drop(previous.take());
        let t1 = Instant::now();
        let imported = cache.open_unordered(&offer.handle, &mut fds)?;
        let t2 = Instant::now();
        cuda.ordering()
            .check_fence(&offer.handle.exporter.process, &fence)?;
        cuda.wait_fence_on(&offer.handle.exporter.process, &fence, &stream)?;
        let t3 = Instant::now();
        // The lease's stream writes the release fence itself (a stream slot), as a lease
        // used on one stream named with `wait_on` does; where the kind has none (events),
        // a fence recorded for the exporter.
        let on_stream = cuda
            .ordering()
            .export_fence_on(&Stream::Cuda(Arc::clone(&stream)), &exporter)?;
        let release = match on_stream {
            Some(fence) => fence,
            None => cuda
                .record_fence_for(&stream, &exporter)?
                .ok_or("no fence recorded")?,
        };
        let t4 = Instant::now();
        link.send(
            &Message::Release(Release {
                lease: offer.lease,
                fences: vec![release.handle()],
            }),
            &[],
        )?;
        let t5 = Instant::now();
        previous = Some(release);
        if kept.is_none() {
            kept = Some(imported);
        }
        for (s, d) in steps
            .iter_mut()
            .zip([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4])
        {
            s.push(d);
        }
    }
    let t = Instant::now();
    stream.synchronize()?;
    let sync_us = t.elapsed().as_secs_f64() * 1e6;
    drop(previous);
    drop(kept);
    let mut out = serde_json::Map::new();
    let mut first = serde_json::Map::new();
    for (name, s) in IMPORTER_STEPS.iter().zip(&steps) {
        // The first handoff opens the exporter's memory and its event or counter slab.
        first.insert(
            (*name).into(),
            s.first().map(|d| round(d.as_secs_f64() * 1e6)).into(),
        );
        let rest = &s[warm.max(1).min(s.len())..];
        if !rest.is_empty() {
            out.insert((*name).into(), Summary::of(rest).json());
        }
    }
    out.insert("first".into(), Value::Object(first));
    out.insert("final_sync_us".into(), round(sync_us).into());
    out.insert("opened_events".into(), cuda.opened_events().into());
    out.insert("driver_opens".into(), cuda.opens().into());
    result_line(&Value::Object(out));
    Ok(())
}
