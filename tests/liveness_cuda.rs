//! Liveness of stream-ordered fences on a real GPU, across real processes: the rule of
//! `docs/ORDERING.md` ("Liveness: no wait on another process is unbounded") checked from
//! the side of the process that survives.
//!
//! > No Baton call, stream, driver-thread job or user-visible CUDA synchronisation waits
//! > without bound on another process. Every GPU wait that Baton queues on a peer's fence
//! > can be released by the waiting process alone, and is — within a stated deadline — when
//! > that peer dies, exits, is cut, or does not deliver. A released wait never lets memory
//! > be reused under work that may still run.
//!
//! Every process here runs with a fence deadline of 1.5 s (`BATON_FENCE_DEADLINE_MS`,
//! `CudaBackendBuilder::fence_deadline`). After the event of each scenario the survivor
//! checks three things: its stream and its whole context (`cuCtxSynchronize`, as a user's
//! `torch.cuda.synchronize()` would) synchronise — each on a thread of its own, awaited
//! with a deadline (the fence deadline plus 10 s, with either fence kind: the waiter
//! releases its own waits, counter fences in its inbox, event fences through its bridge
//! slots) — so a hang fails the test instead of hanging it; its device memory comes back to its baseline once its buffers are released
//! (the driver's per-process accounting through `nvidia-smi --query-compute-apps`, or
//! device-wide free memory where that does not list this process), and its backend holds
//! no allocation or mapping; and every helper process it started has exited or was
//! killed, and was reaped.
//!
//! 1. **A producer killed before its acquire fence lands never blocks the consumer.** A
//!    helper fills a buffer with a long kernel and shares it at once; our stream waits on
//!    the offer's acquire fence and copies; the helper is SIGKILLed while its kernel runs.
//!    Our stream and context synchronise.
//! 2. **A producer that exits with work queued never blocks the consumer.** The same, but
//!    the helper returns from `main` with its kernel (and the fence write behind it) still
//!    queued, without flushing its fences.
//! 3. **A consumer killed with work queued on a lease leaves the exporter working.** We
//!    export; the helper opens the buffer writable, queues a long kernel that writes it, and
//!    is SIGKILLed holding the lease. The lease comes back, our write lands and stays (the
//!    dead kernel never writes over it), the free completes, everything synchronises.
//! 4. **A consumer that exits right after its release leaves the exporter working.** The
//!    helper queues a long kernel writing the lease, drops the lease (its `Release` carries
//!    a fence after the kernel) and returns from `main` — once after flushing its fences
//!    (`Node::flush_fences`: we then read the helper's value), once without (we read the
//!    helper's value or our own, never anything else). The lease comes back, the host copy
//!    returns, the free completes, everything synchronises.
//! 5. **A relay that dies while the holder lives releases nothing early.** We export to a
//!    relay B (`baton-relay-peer`) that forwards to a holder C; C queues a long kernel
//!    reading the lease; B is SIGKILLed. Our memory stays allocated while C lives — past
//!    the fence deadline — and our lease table shows C's stranded lease; C's stream and
//!    context synchronise; once C drops its lease and exits, the memory is freed.
//! 6. **The exporter of a forwarded lease, killed mid-kernel, never blocks the holder.** We
//!    are the holder C: an exporter A (linked to us as well as to the relay B, so that the
//!    forwarded offer carries an acquire fence in our own inbox) fills a buffer with a long
//!    kernel and has B forward it to us; our stream waits on it and copies; A is SIGKILLed
//!    while its kernel runs. Our stream and context synchronise.
//! 7. **A peer that names a fence value it never writes is cut within the deadline.** A raw
//!    link (`baton-liveness-peer forge`) gives a lease back with a counter fence on its
//!    lane whose value it never writes; our stream's wait on it and our free are released
//!    after the fence deadline, its link is cut, and the memory the fence guarded stays
//!    allocated (`Node::held_frees`) while it lives — its work may still run — and is
//!    freed once it is killed. Counter fences; the event form (7b) is a helper whose
//!    release event is recorded behind a kernel that outlives the test, with the same
//!    checks (`baton-liveness-peer linger`, which lives on once cut).
//! 8. **A flood of releases of one reused buffer keeps fences bounded.** A helper leases and
//!    releases one buffer 10,000 times, with a kernel on it each time; our device memory
//!    stays flat, and the free waits on a bounded number of fences (at most one per slot of
//!    the helper), within the deadline. Counter fences (10,000 rounds) and event fences
//!    (2,048: the tight loop that ran the event pool dry before calls waited for a peer's
//!    backlog of events, docs/ORDERING.md).
//!
//! Each scenario is one test that runs on legacy, VMM and pool memory with counter and
//! event fences (but for 7 and 8, as said), skipping (with a printed reason) the memory
//! kinds and fence kinds the device cannot use; every variant runs even when an earlier
//! one failed, and the test then names each that failed. Needs a GPU, NVRTC and the helper binaries:
//! `cargo test --test liveness_cuda --features gpu-tests`. Each case holds the GPU test
//! lock.
//!
//! **Across two GPUs** (issue 27, "Same host, two GPUs"): scenarios 1 to 4 run again with
//! the helper's node on device 1 (`BATON_CUDA_DEVICE=1`) and ours on device 0, so that
//! every buffer and every fence crosses GPUs through peer access (the tests named
//! `…_on_another_gpu_…`): a producer on device 1 killed or exiting while our device-0
//! stream waits on its acquire fence; a consumer on device 1, its kernel writing our
//! device-0 buffer, SIGKILLed holding the lease or exiting right after its release. The
//! same checks: the lease comes back, our memory returns to its baseline, our stream and
//! context synchronise within the bound, the helper is reaped. They need two GPUs: on one
//! they print why and pass, unless `BATON_EXPECT_GPUS=2` (`support/gpus.rs`) says the run
//! expects two, and then they fail.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/gpus.rs"]
mod gpus;
#[path = "support/liveness_msgs.rs"]
mod liveness_msgs;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;
#[path = "support/relay_msgs.rs"]
mod relay_msgs;

use actix::prelude::*;
use actors::{DEADLINE, Lines, Parent, eventually, exited, run};
use baton::actors::{ActorError, Allocate, Buffer, BufferId, BufferLeases, Offered, Shared};
use baton::ipc::cuda::cudarc::driver::CudaStream;
use baton::ipc::cuda::testing::{GpuTestLock, exclusive_gpu};
use baton::ipc::cuda::{
    CudaBackend, CudaExport, DEFAULT_EVENT_LIMIT, DEVICE_ENV, EXPORT_ENV, FENCE_ENV, FenceKind,
};
use baton::ipc::inbox::FENCE_DEADLINE_ENV;
use baton::messages::protocol::CallFault;
use liveness_msgs::{
    Exit, FENCE_DEADLINE_MS, Keep, SHORT_CYCLES, SPIN_CYCLES, Scribble, SpinForward, SpinShare,
};
use relay_msgs::ForwardTo;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::mpsc::TryRecvError;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The fence deadline of every process of these tests.
const FENCE_DEADLINE: Duration = Duration::from_millis(FENCE_DEADLINE_MS);
/// What a released wait may take beyond the fence deadline: the watch thread's look, the
/// node's reaction, a process's teardown.
const MARGIN: Duration = Duration::from_secs(10);
/// `u32`s in the buffers these tests share: 32 MiB, well above the memory checks' slack.
const LEN: u32 = 8 << 20;
const MIB: u64 = 1 << 20;
/// What the exporter writes before a helper's kernel could write anything.
const START: u32 = 0x5747_4152;
/// What a helper's late kernel writes.
const LATE: u32 = 0x1A7E_0001;
/// What the exporter writes once a dead helper's lease came back.
const MARK: u32 = 0x0C0F_FEE0;
/// Cycles the kernel of a kill-matrix case (scenarios 1 to 4) spins before it writes:
/// about 0.13 to 0.17 s at an H100's or H200's clock, a hundred times what the other
/// process takes to act (a cold open, a kill). Each case asserts the kernel was still
/// running when the other process acted (else it proves nothing and says so); kept short
/// so the matrix repeats quickly (issue 46 runs it 20 times).
const QUEUED_CYCLES: i64 = SPIN_CYCLES / 12;
/// How long scenarios 3 and 4 watch for a dead helper's kernel landing, from our first
/// write after its death: twice as long as the kernel's whole spin (`QUEUED_CYCLES`),
/// which began before the kill.
const LATE_WRITE_WATCH: Duration = Duration::from_millis(300);
/// Fence waits the free of a flooded buffer may queue with counter fences: one per
/// release stream of the helper (4), and room for the buffer's own marks.
const COUNTER_FREE_WAITS: u64 = 64;

/// Every memory kind.
const EXPORTS: [CudaExport; 3] = [CudaExport::Legacy, CudaExport::Vmm, CudaExport::Pool];

/// Every memory kind with each fence kind.
fn cases() -> impl Iterator<Item = (CudaExport, FenceKind)> {
    EXPORTS
        .into_iter()
        .flat_map(|e| [FenceKind::Counter, FenceKind::Event].map(|f| (e, f)))
}

/// Runs `case` for every variant, each to its end even when an earlier one failed, then
/// fails naming every variant that failed: one run tells the whole story.
fn each<C: std::fmt::Debug>(
    scenario: &str,
    variants: impl IntoIterator<Item = C>,
    case: impl Fn(&C),
) {
    let mut failed = Vec::new();
    for v in variants {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&v))).is_err() {
            eprintln!("{scenario}: {v:?} FAILED (its panic is above)");
            failed.push(format!("{v:?}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{scenario}: {} variant(s) failed: {}",
        failed.len(),
        failed.join(", ")
    );
}

/// [`each`], for a test whose helpers are on the other GPU: where this process sees one GPU
/// it prints why and runs nothing (or fails, as `gpus::two_gpus` says).
fn each_across_gpus<C: std::fmt::Debug>(
    scenario: &str,
    variants: impl IntoIterator<Item = C>,
    case: impl Fn(&C),
) {
    if gpus::two_gpus(scenario) {
        each(scenario, variants, case);
    }
}

/// Which GPU the helper processes' nodes use; ours uses device 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerGpu {
    /// Device 0, as ours.
    Same,
    /// Device 1 (`BATON_CUDA_DEVICE=1`): every buffer and fence crosses GPUs, through peer
    /// access. Only where [`gpus::two_gpus`] said yes.
    Other,
}

impl PeerGpu {
    /// `tag`, marked for the other GPU (segment namespaces stay apart).
    fn tag(self, tag: &str) -> String {
        match self {
            PeerGpu::Same => tag.to_owned(),
            PeerGpu::Other => format!("x{tag}"),
        }
    }
}

fn liveness_peer() -> &'static str {
    peer::exe("baton-liveness-peer")
}

fn relay_peer() -> &'static str {
    peer::exe("baton-relay-peer")
}

// ---------------------------------------------------------------------------------------
// The survivor: a CUDA parent, its memory meter, bounded waits
// ---------------------------------------------------------------------------------------

/// The surviving process of a case: a CUDA node whose helpers export and fence the same
/// way, a stream of its own, and the GPU test lock.
struct Setup {
    parent: Parent,
    cuda: Arc<CudaBackend>,
    export: CudaExport,
    peers: PeerGpu,
    /// The stream our own work on leases and buffers runs on.
    stream: Arc<CudaStream>,
    _gpu: GpuTestLock,
}

impl Setup {
    /// Call inside an actix system. `None`, saying why, where the device cannot export as
    /// `export` or record `fence` fences.
    fn start(tag: &str, export: CudaExport, fence: FenceKind) -> Option<Setup> {
        Self::start_with_peers(tag, export, fence, PeerGpu::Same)
    }

    /// As [`start`](Self::start), with the helpers' nodes on `peers`' GPU.
    fn start_with_peers(
        tag: &str,
        export: CudaExport,
        fence: FenceKind,
        peers: PeerGpu,
    ) -> Option<Setup> {
        let tag = peers.tag(tag);
        let tag = tag.as_str();
        eprintln!("{tag}: {export:?} memory, {fence:?} fences, helpers on {peers:?} GPU");
        let gpu = exclusive_gpu(Duration::from_secs(1800)).expect("the GPU test lock");
        let built = CudaBackend::builder(0)
            .export(export)
            .fence(fence)
            .fence_deadline(FENCE_DEADLINE)
            .build();
        let cuda = match built {
            Ok(cuda) => cuda,
            Err(e @ baton::ipc::Error::BackendUnavailable { .. })
                if export != CudaExport::Legacy =>
            {
                gpus::skipped(
                    tag,
                    &format!("this device cannot export {export:?} memory: {e}"),
                );
                return None;
            }
            Err(e) => panic!("a CUDA device: {e}"),
        };
        if cuda.fence_kind() != fence {
            gpus::skipped(
                tag,
                &format!(
                    "this device records {:?} fences, not {fence:?} (no 64-bit stream memory operations)",
                    cuda.fence_kind()
                ),
            );
            return None;
        }
        let stream = cuda.context().new_stream().expect("a stream");
        let cuda = Arc::new(cuda);
        let mut parent = Parent::start_with(&peer::namespace(tag), cuda.clone());
        let deadline_ms = FENCE_DEADLINE_MS.to_string();
        for (k, v) in [
            ("BATON_BACKEND", "cuda"),
            (EXPORT_ENV, export.name()),
            (FENCE_ENV, fence.name()),
            (FENCE_DEADLINE_ENV, deadline_ms.as_str()),
        ] {
            parent.child_env.push((k.into(), v.into()));
        }
        if peers == PeerGpu::Other {
            parent.child_env.push((DEVICE_ENV.into(), "1".into()));
        }
        Some(Setup {
            parent,
            cuda,
            export,
            peers,
            stream,
            _gpu: gpu,
        })
    }

    /// `baton-liveness-peer serve`, linked to us, and the baseline of our device memory
    /// (after a warm-up round when the helper is on the other GPU).
    async fn served(&self) -> Served {
        let (child, link) = self.serve().await;
        let pid = child.pid();
        let base = self.baseline_after_warm_up(&link).await;
        Served {
            child,
            link,
            pid,
            base,
        }
    }

    /// Whether this case's offers are refused: pool memory between GPUs
    /// ([`assert_pool_refused`]).
    fn pool_refused(&self) -> bool {
        self.export == CudaExport::Pool && self.peers == PeerGpu::Other
    }

    /// How long a synchronisation may take once the peer it waited on is gone: the fence
    /// deadline and a margin, with either fence kind (the waiter releases its own waits:
    /// counter fences in its inbox, event fences through its bridge slots).
    fn release_bound(&self) -> Duration {
        FENCE_DEADLINE + MARGIN
    }

    /// `baton-liveness-peer serve`, linked to us.
    async fn serve(&self) -> (peer::Peer, baton::actors::Peer) {
        let socket = self.parent.socket();
        self.parent
            .spawn_linked(liveness_peer(), &["serve", socket.as_str()], false)
            .await
    }

    /// A helper process with our session and environment, not (yet) linked to us.
    fn spawn(&self, exe: &str, args: &[&str], piped: bool) -> peer::Peer {
        let env: Vec<(&str, &str)> = self
            .parent
            .child_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        peer::Peer::spawn_with(
            exe,
            &self.parent.session,
            &self.parent.ns,
            args,
            &env,
            piped,
        )
    }

    /// A buffer of `len` elements from our owner.
    async fn buffer<T: baton::actors::Element>(&self, len: u32) -> Buffer<T> {
        self.parent
            .owner
            .send(Allocate::vector(u64::from(len)))
            .await
            .unwrap()
            .unwrap()
    }

    /// Our stream and then our whole context synchronise, each within
    /// [`release_bound`](Self::release_bound).
    async fn assert_synchronises(&self, when: &str) {
        let stream = Arc::clone(&self.stream);
        let (synced, on_stream) = on_thread(
            self.release_bound(),
            &format!("our stream's synchronisation {when}"),
            move || stream.synchronize(),
        )
        .await;
        // Through `CudaError`, which keeps the raw code: cudarc's enum cannot hold a code
        // newer than its bindings (formatting one hits `ud2`: SIGILL, no message).
        synced.unwrap_or_else(|e| {
            panic!(
                "our stream's synchronisation {when}: {}",
                baton::ipc::cuda::CudaError::from(e)
            )
        });
        let ctx = Arc::clone(self.cuda.context());
        let (synced, in_context) = on_thread(
            self.release_bound(),
            &format!("our context's synchronisation (cuCtxSynchronize) {when}"),
            move || ctx.synchronize(),
        )
        .await;
        synced.unwrap_or_else(|e| {
            panic!(
                "our context's synchronisation {when}: {}",
                baton::ipc::cuda::CudaError::from(e)
            )
        });
        eprintln!(
            "  {when}: our stream synchronised in {on_stream:?}, our context in {in_context:?}"
        );
    }

    /// The baseline of the checks that follow, taken after a warm-up round when the
    /// helper (linked to us as `link`, serving `Scribble`) is on the other GPU: a buffer of
    /// ours leased to it, its kernel writing it through peer access, fences both ways.
    /// What enabling peer access between two contexts costs, once, then sits in the
    /// baseline instead of counting as a leak; the warm-up prints it.
    async fn baseline_after_warm_up(&self, link: &baton::actors::Peer) -> Baseline {
        if self.peers == PeerGpu::Same || self.pool_refused() {
            return self.baseline().await;
        }
        let before = self.baseline().await;
        let buf: Buffer<u32> = self.buffer(1 << 20).await;
        buf.write_at(0, &[START]).unwrap();
        link.remote::<Scribble>("scribble")
            .send(Scribble {
                buf: buf.share_mut(),
                value: MARK,
                cycles: SHORT_CYCLES,
                keep: false,
            })
            .await
            .expect("the helper's warm-up round");
        leases_back(&buf, "the warm-up lease").await;
        let (buf, first) = first_of(buf, self.release_bound(), "reading the warm-up buffer").await;
        assert_eq!(
            first, MARK,
            "the helper's kernel on the other GPU did not write our buffer through peer access"
        );
        drop(buf);
        eventually(self.release_bound(), "the warm-up buffer's free", || {
            self.cuda.live().exported == 0
        })
        .await;
        eprintln!(
            "  warm-up round across GPUs: our device memory ({:?}) is {} KiB above what it \
             was before",
            before.meter,
            self.used_above(before).await >> 10
        );
        self.baseline().await
    }

    /// Our device memory now, as the baseline of the checks that follow.
    async fn baseline(&self) -> Baseline {
        let cuda = Arc::clone(&self.cuda);
        on_thread(DEADLINE, "measuring device memory", move || {
            settle_device(&cuda);
            match process_device_bytes(std::process::id()) {
                Ok(bytes) => Baseline {
                    meter: Meter::PerProcess,
                    bytes,
                },
                Err(why) => {
                    eprintln!(
                        "  per-process device memory cannot be read ({why}): measuring \
                         device-wide free memory instead, where every process counts"
                    );
                    Baseline {
                        meter: Meter::DeviceWide,
                        bytes: cuda.mem_get_info().expect("cuMemGetInfo").0 as u64,
                    }
                }
            }
        })
        .await
        .0
    }

    /// Bytes of device memory we use above `base`.
    async fn used_above(&self, base: Baseline) -> u64 {
        let cuda = Arc::clone(&self.cuda);
        on_thread(DEADLINE, "measuring device memory", move || {
            settle_device(&cuda);
            match base.meter {
                Meter::PerProcess => process_device_bytes(std::process::id())
                    .unwrap_or_else(|why| panic!("per-process device memory: {why}"))
                    .saturating_sub(base.bytes),
                Meter::DeviceWide => base
                    .bytes
                    .saturating_sub(cuda.mem_get_info().expect("cuMemGetInfo").0 as u64),
            }
        })
        .await
        .0
    }

    /// Everything we held for the case is released: no import-cache mapping, no
    /// allocation or mapping of our backend, and our device memory back to `base`.
    async fn assert_released(&self, base: Baseline) {
        eventually(DEADLINE, "the import cache to close every mapping", || {
            self.parent.node.cache().stats().live == 0
        })
        .await;
        eventually(
            DEADLINE,
            "our backend to hold no allocation or mapping",
            || self.cuda.live().is_empty(),
        )
        .await;
        assert_eq!(self.parent.segments(), 0, "no host segment is left");
        let start = Instant::now();
        loop {
            let over = self.used_above(base).await;
            if over <= base.meter.slack() {
                return;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "our device memory ({:?}) stayed {} KiB above its baseline with every buffer released",
                base.meter,
                over >> 10
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A helper linked to us ([`Setup::served`]).
struct Served {
    child: peer::Peer,
    link: baton::actors::Peer,
    pid: u32,
    base: Baseline,
}

/// How the survivor's device memory is measured.
#[derive(Debug, Clone, Copy)]
enum Meter {
    /// The driver's per-process accounting of this process (NVML, through `nvidia-smi
    /// --query-compute-apps`), in MiB: other processes on the GPU do not count.
    PerProcess,
    /// Device-wide free memory (`cuMemGetInfo`): every process on the GPU counts, and a
    /// dead helper's inbox stays mapped here (2 MiB each) until our backend drops.
    DeviceWide,
}

impl Meter {
    /// What a measurement may differ from the baseline by without a buffer having leaked.
    fn slack(self) -> u64 {
        match self {
            Meter::PerProcess => 6 * MIB,
            Meter::DeviceWide => 8 * MIB,
        }
    }
}

/// Device memory at some moment: bytes used ([`Meter::PerProcess`]) or free
/// ([`Meter::DeviceWide`]).
#[derive(Debug, Clone, Copy)]
struct Baseline {
    meter: Meter,
    bytes: u64,
}

/// Lets the backend's stream drain and its pool give back what no allocation uses (kept
/// memory is no leak). Blocks: call on a thread of its own.
fn settle_device(cuda: &CudaBackend) {
    cuda.synchronize()
        .expect("the backend's stream synchronises");
    cuda.trim_pool(0).expect("trimming the pool");
}

/// The device memory process `pid` uses by the driver's per-process accounting
/// (`nvidia-smi --query-compute-apps=pid,used_memory`, as `examples/renderer` reads it),
/// in bytes (MiB resolution); why not where `nvidia-smi` is missing or does not list
/// `pid` (a PID namespace hides it from the driver).
fn process_device_bytes(pid: u32) -> Result<u64, String> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("nvidia-smi did not run: {e}"))?;
    if !out.status.success() {
        return Err(format!("nvidia-smi failed: {}", out.status));
    }
    let mut listed = false;
    let mut mib = 0u64;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut fields = line.split(',').map(str::trim);
        let (Some(p), Some(used)) = (fields.next(), fields.next()) else {
            continue;
        };
        if let (Ok(p), Ok(used)) = (p.parse::<u32>(), used.parse::<u64>())
            && p == pid
        {
            listed = true;
            mib += used;
        }
    }
    if listed {
        Ok(mib * MIB)
    } else {
        Err(format!("nvidia-smi does not list pid {pid}"))
    }
}

/// This process's resident host memory (`VmRSS`), in bytes; 0 where unreadable.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// Runs `f` on a thread of its own and awaits its result — without blocking the event
/// loop, whose actors may be what releases the wait — at most `within`; panics if it has
/// not returned by then (a wait on another process that was not released). Returns the
/// result and how long it took.
async fn on_thread<R: Send + 'static>(
    within: Duration,
    what: &str,
    f: impl FnOnce() -> R + Send + 'static,
) -> (R, Duration) {
    let (done, result) = std::sync::mpsc::channel();
    let start = Instant::now();
    std::thread::Builder::new()
        .name("liveness-wait".into())
        .spawn(move || {
            let _ = done.send(f());
        })
        .expect("a thread");
    loop {
        match result.try_recv() {
            Ok(r) => return (r, start.elapsed()),
            Err(TryRecvError::Disconnected) => panic!("{what}: the thread panicked"),
            Err(TryRecvError::Empty) => {}
        }
        assert!(
            start.elapsed() < within,
            "{what} did not return within {within:?}: a wait on another process was not \
             released (the liveness rule, docs/ORDERING.md)"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Checks `holds` every 50 ms for `for_`: a window in which something must *not* happen
/// (a free, a late write). Not a sleep that the test relies on to pass: it can only fail.
async fn holds_for(for_: Duration, mut holds: impl AsyncFnMut() -> Result<(), String>) {
    let start = Instant::now();
    while start.elapsed() < for_ {
        if let Err(what) = holds().await {
            panic!("after {:?}: {what}", start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for every lease on `buf` to be back, at most [`DEADLINE`].
async fn leases_back<T: baton::actors::Element>(buf: &Buffer<T>, what: &str) {
    if tokio::time::timeout(DEADLINE, buf.returned())
        .await
        .is_err()
    {
        panic!(
            "{what}: {} leases still out after {DEADLINE:?}",
            buf.leases_out()
        );
    }
}

/// Reads element 0 of `buf` with a host copy (which waits on the release fences that
/// came back, then synchronises), on a thread of its own, within `within`.
async fn first_of(buf: Buffer<u32>, within: Duration, what: &str) -> (Buffer<u32>, u32) {
    on_thread(within, what, move || {
        let mut first = [0u32];
        buf.read_into(0, &mut first)
            .unwrap_or_else(|e| panic!("reading the buffer back: {e}"));
        (buf, first[0])
    })
    .await
    .0
}

/// The helper was SIGKILLed (not an exit of its own).
fn assert_killed(status: ExitStatus, who: &str) {
    assert_eq!(
        status.signal(),
        Some(9),
        "{who} was SIGKILLed, yet it ended with {status}"
    );
}

/// Every pid has exited and been reaped: no stray helper is left.
fn assert_reaped(pids: &[u32]) {
    for &pid in pids {
        assert!(
            peer::reaped(pid),
            "helper {pid} was left running or unreaped"
        );
    }
}

/// Pool memory does not cross GPUs: an offer of it to a process on another GPU is refused
/// before any driver open, by whichever side imports — typed (`PoolAcrossDevices`) where
/// we import, named in the helper's refusal where it does. That is the pool, other-GPU cell
/// of each scenario: the helper then goes as the scenario says, and we must carry on.
fn assert_pool_refused<T: std::fmt::Debug>(got: Result<T, ActorError>) {
    match got {
        Err(ActorError::OfferRefused(baton::ipc::Error::PoolAcrossDevices { device, here })) => {
            assert_ne!(device, here, "the refusal names two GPUs")
        }
        Err(ActorError::Remote(CallFault::OfferRefused(why)))
            if why.contains("is not opened on GPU") => {}
        other => panic!(
            "pool memory was offered across GPUs and not refused with PoolAcrossDevices: {other:?}"
        ),
    }
}

fn row(table: &[BufferLeases], id: BufferId) -> Option<&BufferLeases> {
    table.iter().find(|b| b.buffer == id)
}

/// Takes the buffers offered to a node outside any message (forwarded ones).
struct InboxKeeper(Arc<Mutex<Vec<Shared<u8>>>>);

impl Actor for InboxKeeper {
    type Context = Context<Self>;
}

impl Handler<Offered> for InboxKeeper {
    type Result = ();
    fn handle(&mut self, msg: Offered, _: &mut Context<Self>) {
        self.0.lock().unwrap().push(msg.buffer);
    }
}

// ---------------------------------------------------------------------------------------
// 1, 2: producers that go while our stream waits on their acquire fence
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Goes {
    /// SIGKILL.
    Killed,
    /// Returns from `main` without flushing its fences.
    Exits,
    /// SIGKILL right after we released our lease, our copy and the release fence behind
    /// it still queued (its fill is short: it has run by then).
    KilledAfterRelease,
}

impl Goes {
    /// The segment namespace tag of the scenario.
    fn tag(self) -> &'static str {
        match self {
            Goes::Killed => "lv-prod-kill",
            Goes::Exits => "lv-prod-exit",
            Goes::KilledAfterRelease => "lv-prod-rel",
        }
    }
}

/// A helper shares a buffer while its fill kernel runs; our stream waits on the acquire
/// fence and copies; the helper goes `how`. Our stream and context synchronise, and our
/// memory comes back.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_producer_killed_before_its_acquire_fence_lands_never_blocks_the_consumer() {
    each(
        "a_producer_killed_before_its_acquire_fence_lands_never_blocks_the_consumer",
        cases(),
        |(export, fence)| producer_goes(*export, *fence, Goes::Killed, PeerGpu::Same),
    );
}

/// As the killed producer, but the helper returns from `main` right after sharing, with
/// its kernel and the fence write behind it still queued.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_producer_that_exits_with_work_queued_never_blocks_the_consumer() {
    each(
        "a_producer_that_exits_with_work_queued_never_blocks_the_consumer",
        cases(),
        |(export, fence)| producer_goes(*export, *fence, Goes::Exits, PeerGpu::Same),
    );
}

/// Scenario 1 with the producer on device 1: its kernel fills a device-1 buffer that our
/// device-0 stream waits on and copies.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs: --features gpu-tests"
)]
fn a_producer_on_another_gpu_killed_before_its_acquire_fence_lands_never_blocks_the_consumer() {
    const TEST: &str =
        "a_producer_on_another_gpu_killed_before_its_acquire_fence_lands_never_blocks_the_consumer";
    each_across_gpus(TEST, cases(), |(export, fence)| {
        producer_goes(*export, *fence, Goes::Killed, PeerGpu::Other)
    });
}

/// Scenario 2 with the producer on device 1.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs: --features gpu-tests"
)]
fn a_producer_on_another_gpu_that_exits_with_work_queued_never_blocks_the_consumer() {
    const TEST: &str =
        "a_producer_on_another_gpu_that_exits_with_work_queued_never_blocks_the_consumer";
    each_across_gpus(TEST, cases(), |(export, fence)| {
        producer_goes(*export, *fence, Goes::Exits, PeerGpu::Other)
    });
}

fn producer_goes(export: CudaExport, fence: FenceKind, how: Goes, peers: PeerGpu) {
    run(async {
        let Some(s) = Setup::start_with_peers(how.tag(), export, fence, peers) else {
            return;
        };
        let Served {
            mut child,
            link,
            pid,
            base,
        } = s.served().await;
        let mut copy: Buffer<u32> = s.buffer(LEN).await;
        let after_release = matches!(how, Goes::KilledAfterRelease);
        let spun = link
            .remote::<SpinShare>("spin_share")
            .send(SpinShare {
                len: LEN,
                value: LATE,
                cycles: if after_release {
                    SHORT_CYCLES
                } else {
                    QUEUED_CYCLES
                },
            })
            .await;
        if s.pool_refused() {
            assert_pool_refused(spun);
            drop(copy);
            producer_leaves(&mut child, &link, how).await;
            s.assert_synchronises("after the producer went").await;
            s.assert_released(base).await;
            assert_reaped(&[pid]);
            return;
        }
        let spun = spun.expect("the producer shares its buffer");
        assert!(
            spun.running || after_release,
            "the producer's kernel had finished before it shared the buffer: raise QUEUED_CYCLES (else this proves nothing)"
        );
        let lease = spun.buf.open().expect("open the producer's buffer");
        lease.wait_on(&s.stream).expect("wait on the acquire fence");
        s.stream
            .memcpy_dtod(&lease, &mut copy)
            .expect("queue the copy");
        let lease = if after_release {
            // Released with our copy still queued: the release fence goes behind it.
            drop(lease);
            None
        } else {
            let probe = s.stream.record_event(None).unwrap();
            assert!(
                !probe.is_complete(),
                "our stream did not wait for the producer's kernel (else this proves nothing)"
            );
            Some(lease)
        };

        producer_leaves(&mut child, &link, how).await;
        s.assert_synchronises("after the producer went").await;

        if let Some(lease) = lease {
            eventually(DEADLINE, "the lease to turn orphaned", || {
                lease.is_orphaned()
            })
            .await;
        }
        drop(copy);
        s.assert_synchronises("after our lease and buffer dropped")
            .await;
        s.assert_released(base).await;
        assert_reaped(&[pid]);
    });
}

/// We open a helper's buffer, queue a copy of it on our stream and release the lease at
/// once (our release fence goes to the helper behind the copy); the helper is SIGKILLed
/// right after. Our stream and context synchronise, and our memory comes back.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_producer_killed_right_after_our_release_never_blocks_the_consumer() {
    each(
        "a_producer_killed_right_after_our_release_never_blocks_the_consumer",
        cases(),
        |(export, fence)| producer_goes(*export, *fence, Goes::KilledAfterRelease, PeerGpu::Same),
    );
}

/// The same with the producer on device 1.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs: --features gpu-tests"
)]
fn a_producer_on_another_gpu_killed_right_after_our_release_never_blocks_the_consumer() {
    const TEST: &str =
        "a_producer_on_another_gpu_killed_right_after_our_release_never_blocks_the_consumer";
    each_across_gpus(TEST, cases(), |(export, fence)| {
        producer_goes(*export, *fence, Goes::KilledAfterRelease, PeerGpu::Other)
    });
}

/// The producer goes `how`, and ends as it should have.
async fn producer_leaves(child: &mut peer::Peer, link: &baton::actors::Peer, how: Goes) {
    match how {
        Goes::Killed | Goes::KilledAfterRelease => child.signal_kill(),
        Goes::Exits => {
            // The reply may never come: the helper may be gone first.
            let _ = tokio::time::timeout(
                DEADLINE,
                link.remote::<Exit>("exit").send(Exit { flush_ms: 0 }),
            )
            .await;
        }
    }
    let status = exited(child, DEADLINE).await;
    match how {
        Goes::Killed | Goes::KilledAfterRelease => assert_killed(status, "the producer"),
        Goes::Exits => assert!(
            status.success(),
            "the producer returned from main, yet it ended with {status}"
        ),
    }
}

// ---------------------------------------------------------------------------------------
// 3, 4: consumers that go with work queued on our buffer
// ---------------------------------------------------------------------------------------

/// We export; the helper opens the buffer writable, queues a long kernel that writes it
/// and is SIGKILLed holding the lease. The lease comes back, our write lands and is never
/// overwritten by the dead kernel, the free completes, and everything synchronises.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_consumer_killed_with_work_queued_on_a_lease_leaves_the_exporter_working() {
    each(
        "a_consumer_killed_with_work_queued_on_a_lease_leaves_the_exporter_working",
        cases(),
        |(export, fence)| consumer_killed(*export, *fence, PeerGpu::Same),
    );
}

/// Scenario 3 with the consumer on device 1: its kernel writes our device-0 buffer through
/// peer access when it is SIGKILLed holding the lease.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs: --features gpu-tests"
)]
fn a_consumer_on_another_gpu_killed_with_work_queued_on_a_lease_leaves_the_exporter_working() {
    const TEST: &str =
        "a_consumer_on_another_gpu_killed_with_work_queued_on_a_lease_leaves_the_exporter_working";
    each_across_gpus(TEST, cases(), |(export, fence)| {
        consumer_killed(*export, *fence, PeerGpu::Other)
    });
}

fn consumer_killed(export: CudaExport, fence: FenceKind, peers: PeerGpu) {
    run(async {
        let Some(s) = Setup::start_with_peers("lv-cons-kill", export, fence, peers) else {
            return;
        };
        let Served {
            mut child,
            link,
            pid,
            base,
        } = s.served().await;
        let buf: Buffer<u32> = s.buffer(LEN).await;
        buf.write_at(0, &[START]).unwrap();
        let running = link
            .remote::<Scribble>("scribble")
            .send(Scribble {
                buf: buf.share_mut(),
                value: LATE,
                cycles: QUEUED_CYCLES,
                keep: true,
            })
            .await;
        if s.pool_refused() {
            assert_pool_refused(running);
            child.signal_kill();
            assert_killed(exited(&mut child, DEADLINE).await, "the consumer");
            return consumer_refused_and_gone(&s, buf, base, pid).await;
        }
        let running = running.expect("the consumer queues its kernel");
        assert!(
            running,
            "the consumer's kernel had finished already: raise QUEUED_CYCLES (else this proves nothing)"
        );
        assert_eq!(buf.leases_out(), 1, "the consumer holds the lease");

        child.signal_kill();
        assert_killed(exited(&mut child, DEADLINE).await, "the consumer");
        leases_back(&buf, "the dead consumer's lease").await;
        let buf = on_thread(
            s.release_bound(),
            "our write after the consumer's death",
            move || {
                buf.write_at(0, &[MARK])
                    .unwrap_or_else(|e| panic!("writing the buffer: {e}"));
                buf
            },
        )
        .await
        .0;
        // The dead consumer's kernel would have written LATE at the end of its spin: it
        // must never land over our write.
        let mut buf = Some(buf);
        holds_for(LATE_WRITE_WATCH, async || {
            let (b, first) = first_of(
                buf.take().expect("the buffer"),
                s.release_bound(),
                "reading our buffer back",
            )
            .await;
            buf = Some(b);
            if first == MARK {
                Ok(())
            } else {
                Err(format!(
                    "element 0 is {first:#x}, not our {MARK:#x}: the killed consumer's kernel \
                     wrote the buffer after it was reused"
                ))
            }
        })
        .await;
        drop(buf);
        eventually(s.release_bound(), "the free", || {
            s.cuda.live().exported == 0
        })
        .await;
        s.assert_synchronises("after the consumer's death and the free")
            .await;
        s.assert_released(base).await;
        assert_reaped(&[pid]);
    });
}

/// The helper queues a long kernel writing the lease, drops the lease (its `Release`
/// carries a fence after the kernel), and returns from `main` — after flushing its fences,
/// then without. The lease comes back, a host copy returns the helper's value (flushed),
/// or the helper's value or ours (not flushed: its kernel may have died with it), the
/// free completes and everything synchronises.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_consumer_that_exits_right_after_release_leaves_the_exporter_working() {
    each(
        "a_consumer_that_exits_right_after_release_leaves_the_exporter_working",
        cases().flat_map(|(e, f)| [(e, f, true), (e, f, false)]),
        |(export, fence, flush)| {
            consumer_exits(
                *export,
                *fence,
                Ends::Exits { flush: *flush },
                PeerGpu::Same,
            )
        },
    );
}

/// Scenario 4 with the consumer on device 1: its kernel writes our device-0 buffer through
/// peer access, it releases and returns from `main`, with and without flushing its fences.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs: --features gpu-tests"
)]
fn a_consumer_on_another_gpu_that_exits_right_after_release_leaves_the_exporter_working() {
    const TEST: &str =
        "a_consumer_on_another_gpu_that_exits_right_after_release_leaves_the_exporter_working";
    each_across_gpus(
        TEST,
        cases().flat_map(|(e, f)| [(e, f, true), (e, f, false)]),
        |(export, fence, flush)| {
            consumer_exits(
                *export,
                *fence,
                Ends::Exits { flush: *flush },
                PeerGpu::Other,
            )
        },
    );
}

/// How a consumer that released ends: returning from `main` (after flushing its fences, or
/// not), or SIGKILLed.
#[derive(Debug, Clone, Copy)]
enum Ends {
    Exits { flush: bool },
    Killed,
}

/// Scenario 4 with the consumer SIGKILLed right after its release: its kernel and the
/// release fence behind it may never run.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_consumer_killed_right_after_release_leaves_the_exporter_working() {
    each(
        "a_consumer_killed_right_after_release_leaves_the_exporter_working",
        cases(),
        |(export, fence)| consumer_exits(*export, *fence, Ends::Killed, PeerGpu::Same),
    );
}

/// The same with the consumer on device 1.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs: --features gpu-tests"
)]
fn a_consumer_on_another_gpu_killed_right_after_release_leaves_the_exporter_working() {
    const TEST: &str =
        "a_consumer_on_another_gpu_killed_right_after_release_leaves_the_exporter_working";
    each_across_gpus(TEST, cases(), |(export, fence)| {
        consumer_exits(*export, *fence, Ends::Killed, PeerGpu::Other)
    });
}

fn consumer_exits(export: CudaExport, fence: FenceKind, ends: Ends, peers: PeerGpu) {
    let flush = matches!(ends, Ends::Exits { flush: true });
    run(async {
        let tag = match ends {
            Ends::Exits { flush: true } => "lv-cons-flush",
            Ends::Exits { flush: false } => "lv-cons-exit",
            Ends::Killed => "lv-cons-relkill",
        };
        let Some(s) = Setup::start_with_peers(tag, export, fence, peers) else {
            return;
        };
        let Served {
            mut child,
            link,
            pid,
            base,
        } = s.served().await;
        let buf: Buffer<u32> = s.buffer(LEN).await;
        buf.write_at(0, &[START]).unwrap();
        let running = link
            .remote::<Scribble>("scribble")
            .send(Scribble {
                buf: buf.share_mut(),
                value: LATE,
                cycles: QUEUED_CYCLES,
                keep: false,
            })
            .await;
        if s.pool_refused() {
            assert_pool_refused(running);
            consumer_ends(&mut child, &link, ends).await;
            return consumer_refused_and_gone(&s, buf, base, pid).await;
        }
        let running = running.expect("the consumer queues its kernel and releases");
        assert!(
            running,
            "the consumer's kernel had finished before it released: raise QUEUED_CYCLES (else this proves nothing)"
        );
        consumer_ends(&mut child, &link, ends).await;

        leases_back(&buf, "the consumer's release").await;
        let (buf, first) = first_of(
            buf,
            s.release_bound(),
            "a host copy of the buffer the consumer gave back",
        )
        .await;
        if flush {
            assert_eq!(
                first, LATE,
                "the consumer flushed its fences before it exited, so its kernel had run: \
                 element 0 is {first:#x}"
            );
        } else {
            assert!(
                first == LATE || first == START,
                "element 0 is {first:#x}: only the consumer's kernel ({LATE:#x}) or nothing \
                 ({START:#x}: the kernel died with its process) may have written it"
            );
            eprintln!(
                "  without a flush, the consumer's kernel {} before it exited",
                if first == LATE { "ran" } else { "did not run" }
            );
        }
        let mut buf = Some(buf);
        if first == START {
            // The kernel did not run before the release came back: it must never run
            // after it either (its process is dead).
            holds_for(LATE_WRITE_WATCH, async || {
                let (b, now) = first_of(
                    buf.take().expect("the buffer"),
                    s.release_bound(),
                    "reading our buffer back",
                )
                .await;
                buf = Some(b);
                if now == START {
                    Ok(())
                } else {
                    Err(format!(
                        "element 0 turned {now:#x} after the exited consumer's release came \
                         back: its kernel ran after the buffer was handed back"
                    ))
                }
            })
            .await;
        }
        drop(buf);
        eventually(s.release_bound(), "the free", || {
            s.cuda.live().exported == 0
        })
        .await;
        s.assert_synchronises("after the consumer's exit and the free")
            .await;
        s.assert_released(base).await;
        assert_reaped(&[pid]);
    });
}

/// The consumer ends `ends`, and ends as it should have.
async fn consumer_ends(child: &mut peer::Peer, link: &baton::actors::Peer, ends: Ends) {
    match ends {
        Ends::Exits { flush } => {
            let flush_ms = if flush {
                DEADLINE.as_millis() as u32
            } else {
                0
            };
            // The reply may never come: the helper may be gone first.
            let _ = tokio::time::timeout(
                DEADLINE,
                link.remote::<Exit>("exit").send(Exit { flush_ms }),
            )
            .await;
            let status = exited(child, DEADLINE).await;
            assert!(
                status.success(),
                "the consumer returned from main, yet it ended with {status}"
            );
        }
        Ends::Killed => {
            child.signal_kill();
            assert_killed(exited(child, DEADLINE).await, "the consumer");
        }
    }
}

/// After a refused offer of `buf` (pool memory across GPUs) and the consumer's end: the
/// lease is back, nothing wrote the buffer, and we carry on as in the other cells.
async fn consumer_refused_and_gone(s: &Setup, buf: Buffer<u32>, base: Baseline, pid: u32) {
    leases_back(&buf, "the refused lease").await;
    let (buf, first) = first_of(buf, s.release_bound(), "reading our buffer back").await;
    assert_eq!(
        first, START,
        "nothing wrote our buffer: its offer was refused"
    );
    drop(buf);
    eventually(s.release_bound(), "the free", || {
        s.cuda.live().exported == 0
    })
    .await;
    s.assert_synchronises("after the consumer went").await;
    s.assert_released(base).await;
    assert_reaped(&[pid]);
}

// ---------------------------------------------------------------------------------------
// 5, 6: forwarded leases
// ---------------------------------------------------------------------------------------

/// We export to a relay B that forwards to a holder C (linked to B only); C queues a long
/// kernel that reads the lease; B is SIGKILLed. The memory stays allocated while C lives,
/// past the fence deadline, with C's stranded lease in our table; C's stream and context
/// synchronise; once C drops its lease and exits, the memory is freed.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_relay_that_dies_while_the_holder_lives_releases_nothing_early() {
    each(
        "a_relay_that_dies_while_the_holder_lives_releases_nothing_early",
        cases(),
        |(export, fence)| relay_dies(*export, *fence),
    );
}

fn relay_dies(export: CudaExport, fence: FenceKind) {
    run(async {
        let Some(s) = Setup::start("lv-relay-dies", export, fence) else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let b_dir = dir.path().join("b");
        let b_dir = b_dir.to_str().unwrap();
        let socket = s.parent.socket();
        let (mut b, b_link) = s
            .parent
            .spawn_linked(relay_peer(), &["relay", socket.as_str(), b_dir], false)
            .await;
        // B listens before it links to us: its socket is there.
        let b_sock = format!("{b_dir}/relay.sock");
        let exit_file = dir.path().join("c-exit");
        let mut c = s.spawn(
            liveness_peer(),
            &["holder", b_sock.as_str(), exit_file.to_str().unwrap()],
            true,
        );
        let c_lines = Lines::of(c.take_stdout().unwrap());
        assert_eq!(c_lines.next_line(DEADLINE).await, "ready");
        let (b_pid, c_pid) = (b.pid(), c.pid());
        let base = s.baseline().await;

        let buf: Buffer<u32> = s.buffer(LEN).await;
        buf.write_at(0, &[START]).unwrap();
        let id = buf.id();
        let ids = b_link
            .remote::<ForwardTo>("relay")
            .send(ForwardTo {
                buffers: vec![buf.share()],
                to_pid: c_pid,
            })
            .await
            .unwrap()
            .expect("B forwards the buffer to C");
        assert_eq!(
            c_lines.next_line(DEADLINE).await,
            format!("got lease={} bytes={} running=true", ids[0], 4 * LEN),
            "C holds the forwarded lease, its kernel on it running"
        );
        {
            let table = s.parent.node.lease_table();
            let row = row(&table, id).expect("the buffer is listed");
            assert_eq!(row.forwarded.len(), 1, "{row:?}");
            assert_eq!(row.forwarded[0].holder.pid, c_pid, "C holds it");
            assert_eq!(row.forwarded[0].via.map(|p| p.pid), Some(b_pid), "via B");
        }
        // We let go: only the leases keep the memory now.
        drop(buf);

        b.kill9();
        eventually(DEADLINE, "B's link to go down", || {
            s.parent.events.down_reason(b_link.link_id()).is_some()
        })
        .await;
        eventually(DEADLINE, "B's own lease to be reclaimed", || {
            row(&s.parent.node.lease_table(), id).is_some_and(|r| r.leases.len() == 1)
        })
        .await;
        // Held while C lives, for longer than the fence deadline: no deadline frees it.
        holds_for(2 * FENCE_DEADLINE, async || {
            let table = s.parent.node.lease_table();
            let Some(row) = row(&table, id) else {
                return Err("the buffer was freed while C holds it".into());
            };
            if row.forwarded.len() != 1
                || row.forwarded[0].holder.pid != c_pid
                || row.forwarded[0].via.is_some()
            {
                return Err(format!("C's lease is not listed as stranded: {row:?}"));
            }
            if s.cuda.live().exported != 1 {
                return Err("the allocation was freed while C holds it".into());
            }
            Ok(())
        })
        .await;
        assert!(c.try_wait().is_none(), "C lives on");
        s.assert_synchronises("after the relay's death, while the holder lives")
            .await;
        let line = loop {
            let line = c_lines.next_line(DEADLINE).await;
            if line.starts_with("link-down ") {
                break line;
            }
        };
        assert!(
            line.contains("stream=ok(") && line.contains("context=ok("),
            "C's stream or context did not synchronise after its relay died: {line}"
        );

        // C drops its lease and returns from main: the memory goes once C is dead.
        std::fs::write(&exit_file, b"").unwrap();
        let status = exited(&mut c, DEADLINE).await;
        assert!(
            status.success(),
            "C returned from main, yet it ended with {status}"
        );
        eventually(DEADLINE, "the memory to be freed after C's exit", || {
            row(&s.parent.node.lease_table(), id).is_none() && s.cuda.live().exported == 0
        })
        .await;
        s.assert_synchronises("after the holder's exit").await;
        s.assert_released(base).await;
        assert_reaped(&[b_pid, c_pid]);
    });
}

/// We are the holder C: an exporter A, linked to the relay B and to us, fills a buffer
/// with a long kernel and has B forward it to us; our stream waits on the acquire fence
/// (in our own inbox: we lent A a lane) and copies; A is SIGKILLed while its kernel runs.
/// Our stream and context synchronise, and our memory comes back.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn the_exporter_of_a_forwarded_lease_killed_mid_kernel_never_blocks_the_holder() {
    each(
        "the_exporter_of_a_forwarded_lease_killed_mid_kernel_never_blocks_the_holder",
        cases(),
        |(export, fence)| forwarded_exporter_killed(*export, *fence),
    );
}

fn forwarded_exporter_killed(export: CudaExport, fence: FenceKind) {
    run(async {
        let Some(s) = Setup::start("lv-fwd-exp-kill", export, fence) else {
            return;
        };
        let offered = Arc::new(Mutex::new(Vec::new()));
        s.parent
            .node
            .set_inbox(InboxKeeper(Arc::clone(&offered)).start().recipient());
        let dir = tempfile::tempdir().unwrap();
        let b_dir = dir.path().join("b");
        let b_dir = b_dir.to_str().unwrap();
        let socket = s.parent.socket();
        let (mut b, _b_link) = s
            .parent
            .spawn_linked(relay_peer(), &["relay", socket.as_str(), b_dir], false)
            .await;
        let b_sock = format!("{b_dir}/relay.sock");
        let (mut a, a_link) = s
            .parent
            .spawn_linked(
                liveness_peer(),
                &["exporter", b_sock.as_str(), socket.as_str()],
                false,
            )
            .await;
        let (a_pid, b_pid) = (a.pid(), b.pid());
        let base = s.baseline().await;

        let mut copy: Buffer<u8> = s.buffer(4 * LEN).await;
        let (ids, running) = a_link
            .remote::<SpinForward>("spin_forward")
            .send(SpinForward {
                len: LEN,
                value: LATE,
                cycles: SPIN_CYCLES,
                relay_pid: b_pid,
                to_pid: std::process::id(),
            })
            .await
            .unwrap()
            .expect("A's buffer forwarded to us through B");
        assert!(
            running,
            "A's kernel had finished before B forwarded the buffer: raise SPIN_CYCLES (else this proves nothing)"
        );
        eventually(DEADLINE, "the forwarded offer in our inbox", || {
            !offered.lock().unwrap().is_empty()
        })
        .await;
        let shared = offered.lock().unwrap().pop().unwrap();
        let lease = shared.open().expect("open the forwarded buffer");
        assert_eq!(lease.id().get(), ids[0], "the lease B forwarded");
        lease.wait_on(&s.stream).expect("wait on the acquire fence");
        s.stream
            .memcpy_dtod(&lease, &mut copy)
            .expect("queue the copy");
        let probe = s.stream.record_event(None).unwrap();
        assert!(
            !probe.is_complete(),
            "our stream did not wait for A's kernel (else this proves nothing)"
        );

        a.signal_kill();
        assert_killed(exited(&mut a, DEADLINE).await, "the exporter");
        s.assert_synchronises("after the exporter's death mid-kernel")
            .await;

        drop(lease);
        drop(copy);
        s.assert_synchronises("after our lease and buffer dropped")
            .await;
        // B's own lease maps A's buffer, which the driver keeps while B lives: device-wide
        // free memory comes back only once B is gone.
        b.kill9();
        s.assert_released(base).await;
        assert_reaped(&[a_pid, b_pid]);
    });
}

// ---------------------------------------------------------------------------------------
// 7: a producer that does not deliver
// ---------------------------------------------------------------------------------------

/// A raw link gives a lease back with a counter fence on its own lane whose value it never
/// writes. Our stream's wait on it and our free are released after the fence deadline,
/// the link is cut, and the memory stays allocated while the peer lives (its work may
/// still run), then is freed once it is killed.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_peer_that_names_a_fence_value_it_never_writes_is_cut_within_the_deadline() {
    eprintln!(
        "counter fences here (a value in the waiter's inbox); the event form is \
         a_peer_whose_event_fence_never_completes_is_cut_within_the_deadline"
    );
    each(
        "a_peer_that_names_a_fence_value_it_never_writes_is_cut_within_the_deadline",
        EXPORTS,
        |export| forged_fence(*export),
    );
}

fn forged_fence(export: CudaExport) {
    run(async {
        let Some(s) = Setup::start("lv-forged", export, FenceKind::Counter) else {
            return;
        };
        let socket = s.parent.socket();
        let (mut child, link) = s
            .parent
            .spawn_linked(liveness_peer(), &["forge", socket.as_str()], true)
            .await;
        let lines = Lines::of(child.take_stdout().unwrap());
        let base = s.baseline().await;

        let mut buf: Buffer<u32> = s.buffer(LEN).await;
        buf.write_at(0, &[START]).unwrap();
        link.remote::<Keep>("keep")
            .send(Keep {
                buf: buf.share_mut(),
            })
            .await
            .expect("the forger answers the call");
        let line = lines.next_line(DEADLINE).await;
        assert!(line.starts_with("released value="), "{line}");
        leases_back(&buf, "the forged release").await;
        let released = Instant::now();

        // Our next use of the buffer waits on the forged fence, on our stream; the free
        // waits on it too, on the node's driver thread.
        buf.wait_on(&s.stream).expect("wait on the release fence");
        s.stream.memset_zeros(&mut buf).expect("queue a write");
        let probe = s.stream.record_event(None).unwrap();
        assert!(
            !probe.is_complete(),
            "our stream did not wait on the forged fence (else this proves nothing)"
        );
        drop(buf);
        s.assert_synchronises("after a peer named a fence value it never writes")
            .await;
        held_until_killed(&s, &mut child, &link, released, "the forger", base, |s| {
            s.parent.node.held_frees().0 == 1
        })
        .await;
        // The forger printed it once its link ended, before it was killed.
        assert_eq!(lines.next_line(DEADLINE).await, "cut");
    });
}

/// The event-fence form of 7: a helper (`linger`: it lives on once cut) opens our buffer
/// writable, queues a kernel that spins far longer than the test, and gives the lease back
/// at once: its `Release` carries an interprocess event recorded behind that kernel. Our
/// stream's wait on it (a bridge slot of ours) is released after the fence deadline, the
/// link is cut, and the memory stays allocated while the helper lives — a held free, or
/// quarantined by the ledger where the helper may still map it — then is freed once it is
/// killed.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_peer_whose_event_fence_never_completes_is_cut_within_the_deadline() {
    each(
        "a_peer_whose_event_fence_never_completes_is_cut_within_the_deadline",
        EXPORTS,
        |export| stalled_event(*export),
    );
}

fn stalled_event(export: CudaExport) {
    /// About 30 to 40 s: the kernel outlives the test's checks, and dies with its process.
    const STALL_CYCLES: i64 = 20 * SPIN_CYCLES;
    run(async {
        let Some(s) = Setup::start("lv-stalled", export, FenceKind::Event) else {
            return;
        };
        let socket = s.parent.socket();
        let (mut child, link) = s
            .parent
            .spawn_linked(liveness_peer(), &["linger", socket.as_str()], false)
            .await;
        let pid = child.pid();
        let base = s.baseline().await;

        let mut buf: Buffer<u32> = s.buffer(LEN).await;
        buf.write_at(0, &[START]).unwrap();
        let id = buf.id();
        let running = link
            .remote::<Scribble>("scribble")
            .send(Scribble {
                buf: buf.share_mut(),
                value: LATE,
                cycles: STALL_CYCLES,
                keep: false,
            })
            .await
            .expect("the helper answers the call");
        assert!(
            running,
            "the helper's kernel had finished (else this proves nothing)"
        );
        leases_back(&buf, "the stalled release").await;
        let released = Instant::now();

        buf.wait_on(&s.stream).expect("wait on the release fence");
        s.stream.memset_zeros(&mut buf).expect("queue a write");
        let probe = s.stream.record_event(None).unwrap();
        assert!(
            !probe.is_complete(),
            "our stream did not wait on the helper's event (else this proves nothing)"
        );
        drop(buf);
        s.assert_synchronises("after a peer's event fence stalled")
            .await;
        // Held one of two ways while the helper lives: where the helper's warm mapping
        // may outlive its cut link and freeing under it is unsafe (legacy IPC, pool), the
        // ledger quarantines the buffer before any free is tried; otherwise (VMM) the free
        // is tried, finds our wait on the helper's event released early, and is held.
        held_until_killed(&s, &mut child, &link, released, "the helper", base, |s| {
            s.parent.node.held_frees().0 == 1
                || row(&s.parent.node.lease_table(), id)
                    .is_some_and(|r| r.quarantined && r.cut_holders.iter().any(|p| p.pid == pid))
        })
        .await;
    });
}

/// The end of scenario 7, either fence kind, once our stream synchronised: the peer's link
/// is cut within the deadline, the memory stays allocated and `held` (a held free, or the
/// ledger's quarantine) for twice the deadline while the peer lives — its work may still
/// use it — and is freed once the peer is killed; then everything synchronises and our
/// memory is back to `base`.
#[allow(
    clippy::too_many_arguments,
    reason = "one call per scenario, each argument its own"
)]
async fn held_until_killed(
    s: &Setup,
    child: &mut peer::Peer,
    link: &baton::actors::Peer,
    released: Instant,
    who: &str,
    base: Baseline,
    held: impl Fn(&Setup) -> bool,
) {
    let pid = child.pid();
    eventually(
        FENCE_DEADLINE + MARGIN,
        &format!("{who}'s link to be cut"),
        || s.parent.events.down_reason(link.link_id()).is_some(),
    )
    .await;
    eprintln!(
        "  released and cut {:?} after the release: {:?}",
        released.elapsed(),
        s.parent.events.down_reason(link.link_id())
    );
    eventually(FENCE_DEADLINE + MARGIN, "the memory to be held", || held(s)).await;
    holds_for(2 * FENCE_DEADLINE, async || {
        if s.cuda.live().exported != 1 {
            return Err(format!("the memory was freed while {who} lives"));
        }
        if !held(s) {
            return Err(format!(
                "the memory is no longer held (held frees {:?})",
                s.parent.node.held_frees()
            ));
        }
        Ok(())
    })
    .await;
    assert!(child.try_wait().is_none(), "{who} lives on");

    child.signal_kill();
    assert_killed(exited(child, DEADLINE).await, who);
    eventually(
        DEADLINE,
        &format!("the held memory to be freed after {who}'s death"),
        || s.parent.node.held_frees() == (0, 0) && s.cuda.live().exported == 0,
    )
    .await;
    s.assert_synchronises(&format!("after {who}'s death")).await;
    s.assert_released(base).await;
    assert_reaped(&[pid]);
}

// ---------------------------------------------------------------------------------------
// 8: a flood of releases
// ---------------------------------------------------------------------------------------

/// A helper leases and releases one buffer 10,000 times with a short kernel on it each
/// time. Our device memory stays flat, and the free waits on a bounded number of fences,
/// within the deadline.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_flood_of_releases_of_one_reused_buffer_keeps_fences_bounded() {
    each(
        "a_flood_of_releases_of_one_reused_buffer_keeps_fences_bounded",
        EXPORTS,
        |export| {
            flood(*export, FenceKind::Counter);
            flood(*export, FenceKind::Event);
        },
    );
}

fn flood(export: CudaExport, fence: FenceKind) {
    // Event fences: a bridged chain whose hops cost milliseconds on a GPU shared by two
    // processes (docs/ORDERING.md): fewer rounds, still 8 times the event pool.
    let (rounds, early_round): (u32, u32) = match fence {
        FenceKind::Counter => (10_000, 1_000),
        FenceKind::Event => (2_048, 256),
    };
    run(async {
        let Some(s) = Setup::start("lv-flood", export, fence) else {
            return;
        };
        let (mut child, link) = s.serve().await;
        let pid = child.pid();
        let base = s.baseline().await;
        let buf: Buffer<u32> = s.buffer(LEN).await;
        buf.write_at(0, &[START]).unwrap();
        let scribble = link.remote::<Scribble>("scribble");
        let mut early = (0, 0);
        let start = Instant::now();
        for r in 0..rounds {
            scribble
                .send(Scribble {
                    buf: buf.share_mut(),
                    value: r,
                    cycles: SHORT_CYCLES,
                    keep: false,
                })
                .await
                .unwrap_or_else(|e| panic!("round {r} of {rounds}: {e}"));
            leases_back(&buf, &format!("round {r}'s release")).await;
            if r == early_round {
                early = (s.used_above(base).await, rss_bytes());
            }
        }
        let (used, rss) = (s.used_above(base).await, rss_bytes());
        eprintln!(
            "  {rounds} releases in {:?}; device memory above baseline {} KiB after {early_round}, \
             {} KiB after {rounds}; resident host memory {} KiB, then {} KiB",
            start.elapsed(),
            early.0 >> 10,
            used >> 10,
            early.1 >> 10,
            rss >> 10
        );
        assert!(
            used <= early.0 + base.meter.slack(),
            "our device memory ({:?}) grew by {} KiB between round {early_round} and round {rounds}",
            base.meter,
            (used - early.0) >> 10
        );
        assert_eq!(s.cuda.live().exported, 1, "one allocation, reused");

        // The free waits on what the ledger kept of 10,000 releases' fences: at most one
        // per slot (counters) or per event of the helper's pool.
        // TODO(api): a count of the release fences the ledger keeps per allocation (say
        // `BufferLeases::release_fences`) would state this bound directly; the fence waits
        // the free queues (`CudaBackend::waits`, which counts every `wait_fence_on`) stand
        // in for it here.
        let bound = match fence {
            FenceKind::Counter => COUNTER_FREE_WAITS,
            FenceKind::Event => DEFAULT_EVENT_LIMIT as u64 + COUNTER_FREE_WAITS,
        };
        let waits_before = s.cuda.waits();
        drop(buf);
        eventually(s.release_bound(), "the free of the flooded buffer", || {
            s.cuda.live().exported == 0
        })
        .await;
        let waits = s.cuda.waits() - waits_before;
        eprintln!("  the free queued {waits} fence waits");
        assert!(
            waits <= bound,
            "the free of a buffer released {rounds} times queued {waits} fence waits (at most \
             {bound}): its release fences are not bounded"
        );

        link.close();
        let status = exited(&mut child, DEADLINE).await;
        assert!(status.success(), "the helper ended with {status}");
        s.assert_synchronises("after the flood and the free").await;
        s.assert_released(base).await;
        assert_reaped(&[pid]);
    });
}
