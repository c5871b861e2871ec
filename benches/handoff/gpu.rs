//! Item 5, bandwidth: in the importing process, a 1 GiB device-to-device copy
//! (`cuMemcpyDtoDAsync`) from the imported buffer vs from a local one, timed with CUDA
//! events on the backend's stream; also into the imported buffer. Alternating order,
//! warmed up, medians. GB/s count bytes read plus bytes written, as the DESIGN's 3.0 TB/s.

use crate::peer::DEADLINE;
use crate::peer::{PeerProcess, result_line};
use crate::report::Report;
use crate::stats::round;
use crate::{BackendName, Config, Res};
use baton::Session;
use baton::SocketDir;
use baton::ipc::cuda::cudarc::driver::{result as cu, sys};
use baton::ipc::cuda::{CudaBackend, CudaExport};
use baton::ipc::{
    Allocation, Backend, ImportCache, Link, LinkConfig, Listener, MemPtr, SharedBackend,
};
use baton::messages::protocol::{Offer, Release};
use baton::messages::{LeaseId, Message};
use serde_json::{Value, json};
use std::os::fd::BorrowedFd;
use std::sync::Arc;

const GIB: usize = 1 << 30;

pub(crate) fn run(cfg: &Config, name: BackendName, report: &mut Report) -> Res<()> {
    let cuda = crate::actor::cuda(name)?;
    let size = GIB;
    let src = cuda.allocate(size)?;
    src.fill(0, size, 0x5A)?;
    let reps = if cfg.quick { 5 } else { 30 };
    let here = measure(name, &src, reps, false)?;
    let gbps = |r: &Value, k: &str| r[k]["gbps"].as_f64().unwrap_or(f64::NAN);
    let rows = |report: &mut Report, r: &Value, placement: &str| {
        for (variant, label) in [
            ("local_src", "device copy 1 GiB, local → local"),
            ("imported_src", "device copy 1 GiB, imported → local"),
            ("imported_dst", "device copy 1 GiB, local → imported"),
        ] {
            report.emit(json!({
                "item": 5, "name": "bandwidth", "backend": name.as_str(), "variant": variant,
                "placement": placement,
                "label": label, "gbps": gbps(r, variant), "ms_p50": r[variant]["ms_p50"],
                "ms_min": r[variant]["ms_min"], "ms_max": r[variant]["ms_max"],
                "reps": reps, "bytes": size,
                "note": "GB/s = (read + written) / time, CUDA events",
            }));
        }
    };
    rows(report, &here, "same namespaces");
    for variant in ["imported_src", "imported_dst"] {
        let ratio = gbps(&here, variant) / gbps(&here, "local_src");
        report.emit(json!({
            "item": 0, "name": "bandwidth_ratio", "backend": name.as_str(), "variant": variant,
            "ratio": round(ratio),
        }));
    }
    if cfg.across_namespaces {
        // A path that cannot cross namespaces is a row that says why, not a failed run.
        match measure(name, &src, reps, true) {
            Ok(across) => {
                rows(report, &across, "own PID and network namespaces");
                for variant in ["imported_src", "imported_dst"] {
                    let ratio = gbps(&across, variant) / gbps(&here, variant);
                    report.emit(json!({
                        "item": 0, "name": "bandwidth_across_namespaces_ratio",
                        "backend": name.as_str(), "variant": variant, "ratio": round(ratio),
                        "note": "the importer in its own PID and network namespaces / in ours, same run",
                    }));
                }
            }
            Err(e) => report.emit(json!({
                "item": 5, "name": "bandwidth_across_namespaces_refused",
                "backend": name.as_str(), "error": e.to_string(),
            })),
        }
    }
    Ok(())
}

/// One importer's figures for `src`, offered over a link of its own; the importer runs in
/// namespaces of its own with `own_namespaces`.
fn measure(name: BackendName, src: &Allocation, reps: usize, own_namespaces: bool) -> Res<Value> {
    let session = Session::generate()?;
    let tmp = tempfile::tempdir()?;
    let dir = SocketDir::create(tmp.path().join("s"))?;
    let listener = Listener::bind(&dir, "bw.sock", LinkConfig::new(session.clone()))?;
    let sock = listener.path().to_str().ok_or("path")?.to_owned();
    let env = crate::actor::peer_env(name, "benchbw");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut peer = PeerProcess::spawn_placed(
        &session,
        "bw-importer",
        &[&sock, &reps.to_string()],
        &env,
        own_namespaces,
    )?;
    listener.listener().set_nonblocking(true)?;
    let mut link = loop {
        match listener.accept() {
            Ok(l) => break l,
            Err(baton::ipc::Error::Io { source, .. })
                if source.kind() == std::io::ErrorKind::WouldBlock =>
            {
                if peer.exited() {
                    return Err("the importer exited before connecting".into());
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(e) => return Err(e.into()),
        }
    };
    let handle = src.handle(&session).build()?;
    let fds: Vec<BorrowedFd<'_>> = src.export_fd().into_iter().collect();
    let lease = LeaseId::new(1);
    link.send(&Message::Offer(Box::new(Offer { lease, handle })), &fds)?;
    link.set_timeout(Some(DEADLINE))?;
    let result = peer.result(DEADLINE)?;
    match link.recv()?.message {
        Message::Release(Release { lease: back, .. }) if back == lease => Ok(result),
        other => Err(format!("expected the Release, got {other:?}").into()),
    }
}

/// Times copies of `size` bytes on the backend's stream with a pair of events.
struct Timer {
    cuda: Arc<CudaBackend>,
    start: baton::ipc::cuda::cudarc::driver::CudaEvent,
    end: baton::ipc::cuda::cudarc::driver::CudaEvent,
}

impl Timer {
    fn new(cuda: Arc<CudaBackend>) -> Res<Timer> {
        let ctx = cuda.context();
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        Ok(Timer {
            start: ctx.new_event(flags)?,
            end: ctx.new_event(flags)?,
            cuda,
        })
    }

    /// Milliseconds one copy took on the device.
    fn copy(&self, dst: MemPtr, src: MemPtr, size: usize) -> Res<f32> {
        let (MemPtr::Device(dst), MemPtr::Device(src)) = (dst, src) else {
            return Err("device pointers expected".into());
        };
        let stream = self.cuda.stream();
        self.cuda.context().bind_to_thread()?;
        self.start.record(stream)?;
        // SAFETY: the context of both buffers is bound (above); `src` and `dst` are
        // device pointers of live buffers of at least `size` bytes (an allocation of this
        // process and an import-cache mapping, both held by the caller for the call);
        // the stream is the backend's, alive as long as `self.cuda`.
        unsafe { cu::memcpy_dtod_async(dst, src, size, stream.cu_stream()) }?;
        self.end.record(stream)?;
        Ok(self.start.elapsed_ms(&self.end)?)
    }
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

/// The bandwidth peer: opens the offered buffer, times copies from and to it against a
/// local buffer of the same size, checks the bytes, releases, prints the figures.
pub(crate) fn importer(socket: &str, reps: usize) -> Res<()> {
    let session = Session::from_env()?;
    let mut link = Link::connect(socket, &LinkConfig::new(session.clone()))?;
    let cuda = Arc::new(CudaBackend::new(0, CudaExport::Legacy)?);
    let cache = ImportCache::new(session, [cuda.clone() as SharedBackend]);
    let received = link.recv()?;
    let Message::Offer(offer) = received.message else {
        return Err("expected an Offer".into());
    };
    let mut fds = received.fds;
    let imported = cache.open(&offer.handle, &mut fds)?;
    let size = imported.len();
    let local = cuda.allocate(size)?;
    local.fill(0, size, 0xA5)?;
    let dst = cuda.allocate(size)?;
    let scratch = cuda.allocate(size)?;
    let timer = Timer::new(cuda.clone())?;
    let (mut from_local, mut from_imported, mut into_imported) = (vec![], vec![], vec![]);
    for i in 0..reps + 3 {
        // Alternate which goes first, so neither always follows the other.
        let a = timer.copy(dst.ptr(), local.ptr(), size)?;
        let b = timer.copy(dst.ptr(), imported.ptr(), size)?;
        let (a, b) = if i % 2 == 0 {
            (a, b)
        } else {
            let b2 = timer.copy(dst.ptr(), imported.ptr(), size)?;
            let a2 = timer.copy(dst.ptr(), local.ptr(), size)?;
            (a2, b2)
        };
        // Into the imported buffer: save its bytes first, restore them after.
        timer.copy(scratch.ptr(), imported.ptr(), size)?;
        let c = timer.copy(imported.ptr(), local.ptr(), size)?;
        timer.copy(imported.ptr(), scratch.ptr(), size)?;
        if i >= 3 {
            from_local.push(a);
            from_imported.push(b);
            into_imported.push(c);
        }
    }
    // The copies moved the right bytes.
    let mut head = vec![0u8; 4096];
    timer.copy(dst.ptr(), imported.ptr(), size)?;
    dst.read(size - head.len(), &mut head)?;
    let imported_ok = head.iter().all(|&b| b == 0x5A);
    timer.copy(dst.ptr(), local.ptr(), size)?;
    dst.read(0, &mut head)?;
    let local_ok = head.iter().all(|&b| b == 0xA5);
    if !(imported_ok && local_ok) {
        return Err(format!(
            "wrong bytes after the copies (imported {imported_ok}, local {local_ok})"
        )
        .into());
    }
    drop(imported);
    link.send(&Message::Release(Release::now(offer.lease)), &[])?;
    let fig = |v: &[f32]| {
        let ms = f64::from(median(v.to_vec()));
        json!({
            "ms_p50": round(ms),
            "ms_min": round(f64::from(v.iter().copied().fold(f32::MAX, f32::min))),
            "ms_max": round(f64::from(v.iter().copied().fold(0.0, f32::max))),
            "gbps": round(2.0 * size as f64 / (ms / 1e3) / 1e9),
        })
    };
    result_line(&json!({
        "local_src": fig(&from_local),
        "imported_src": fig(&from_imported),
        "imported_dst": fig(&into_imported),
    }));
    // The Release stays readable after we exit.
    Ok(())
}
