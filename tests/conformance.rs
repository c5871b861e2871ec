//! Backend conformance: the same tests, written once, for every backend.
//!
//! Each test is a function of a [`Flavor`]; the macro at the bottom instantiates it for
//! `host_memfd` and `host_named` (the host backend's two flavors: sealed memfds shared by
//! descriptor, named segments; both run everywhere, CI included) and for `cuda_legacy`,
//! `cuda_vmm` and `cuda_pool`, which run with `--features gpu-tests` on a machine with an
//! NVIDIA GPU and are ignored otherwise. Two processes each time: this test process and
//! `baton-conformance-peer`, spawned (never forked) and always killed and reaped by its
//! guard.
//!
//! CUDA tests hold the GPU test lock (`baton::ipc::cuda::testing::exclusive_gpu`) for their
//! whole run, so that no other Baton test shares the device while free memory is measured;
//! they also check the backend's exact count of live allocations and mappings. The fence
//! tests at the end check producer/consumer ordering across the two processes for each
//! fence kind.
//!
//! The same tests run with the other process in namespaces of its own, as a container's
//! (`*_across_namespaces`, root only: `unshare`; see [`across_namespaces`]).
//!
//! On CUDA the exporter writes with a kernel: hand-written PTX that the driver JIT-compiles
//! (no NVRTC needed at run time). Should the driver refuse the PTX, the tests fall back to
//! host-to-device copies and chains of memsets, and say so on stderr.

#[path = "support/peer.rs"]
mod peer;

use baton::Session;
use baton::ipc::cuda::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use baton::ipc::cuda::cudarc::nvrtc::Ptx;
use baton::ipc::cuda::testing::{GpuTestLock, exclusive_gpu};
use baton::ipc::cuda::{CudaBackend, CudaExport, FenceHandle, FenceKind};
use baton::ipc::{Allocation, Error, LinkConfig, Listener};
use baton::ipc::{
    Backend, FrameFds, HostBackend, HostFlavor, ImportCache, MemPtr, SharedBackend, SlabArena, host,
};
use baton::messages::protocol::{Call, Offer, Release};
use baton::messages::{Error as MessageError, HandleMsg, LeaseId, Message, RawHandle};
use peer::{Peer, Placement, accept_from, poll_until, socket_dir};
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(60);
const MIB: usize = 1 << 20;
/// The buffer every two-process test shares.
const SIZE: usize = 256 * MIB;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    HostMemfd,
    HostNamed,
    CudaLegacy,
    CudaVmm,
    CudaPool,
}

impl Flavor {
    /// The peer's backend argument.
    fn arg(self) -> &'static str {
        match self {
            Flavor::HostMemfd => "host-memfd",
            Flavor::HostNamed => "host-named",
            Flavor::CudaLegacy => "cuda-legacy",
            Flavor::CudaVmm => "cuda-vmm",
            Flavor::CudaPool => "cuda-pool",
        }
    }

    fn export(self) -> Option<CudaExport> {
        match self {
            Flavor::HostMemfd | Flavor::HostNamed => None,
            Flavor::CudaLegacy => Some(CudaExport::Legacy),
            Flavor::CudaVmm => Some(CudaExport::Vmm),
            Flavor::CudaPool => Some(CudaExport::Pool),
        }
    }
}

/// How long a GPU test waits for the others to finish.
const GPU_QUEUE: Duration = Duration::from_secs(1800);

/// The backend under test in this process, with what the tests measure on it.
struct Subject {
    flavor: Flavor,
    /// Where the other process runs.
    placement: Placement,
    ns: String,
    backend: SharedBackend,
    host: Option<Arc<HostBackend>>,
    cuda: Option<Arc<CudaBackend>>,
    /// Held by CUDA subjects for the test's whole run.
    _gpu: Option<GpuTestLock>,
}

impl Subject {
    fn new(flavor: Flavor, placement: Placement, test: &str) -> Subject {
        Self::with_fence(flavor, placement, test, FenceKind::Event)
    }

    fn with_fence(flavor: Flavor, placement: Placement, test: &str, fence: FenceKind) -> Subject {
        let ns = peer::namespace(test);
        let (backend, host, cuda, gpu): (SharedBackend, _, _, _) = match flavor.export() {
            None => {
                let b = Arc::new(
                    HostBackend::with_flavor(
                        if flavor == Flavor::HostMemfd {
                            HostFlavor::Memfd
                        } else {
                            HostFlavor::Named
                        },
                        &ns,
                    )
                    .unwrap(),
                );
                (b.clone(), Some(b), None, None)
            }
            Some(export) => {
                let gpu = exclusive_gpu(GPU_QUEUE).expect("the GPU test lock");
                let b = Arc::new(
                    CudaBackend::builder(0)
                        .export(export)
                        .fence(fence)
                        .build()
                        .unwrap_or_else(|e| panic!("the {flavor:?} backend is unavailable: {e}")),
                );
                eprintln!("conformance: {b:?}");
                (b.clone(), None, Some(b), Some(gpu))
            }
        };
        Subject {
            flavor,
            placement,
            ns,
            backend,
            host,
            cuda,
            _gpu: gpu,
        }
    }

    fn opens(&self) -> u64 {
        match (&self.host, &self.cuda) {
            (Some(h), _) => h.opens(),
            (_, Some(c)) => c.opens(),
            _ => unreachable!(),
        }
    }

    fn spawn(&self, session: &Session, role: &str, args: &[&str]) -> Peer {
        let mut all = vec![self.flavor.arg(), role];
        all.extend_from_slice(args);
        Peer::spawn_placed(
            self.placement,
            peer::exe("baton-conformance-peer"),
            session,
            &self.ns,
            &all,
            &[],
            false,
        )
    }

    /// The link of `child`, which must be where the subject placed it.
    fn accept(&self, listener: &Listener, child: &mut Peer) -> baton::ipc::Link {
        let link = accept_from(listener, child, DEADLINE).unwrap();
        self.check_placement(&link);
        link
    }

    /// A peer in namespaces of its own names itself as its namespace does (pid 1, its
    /// init), and we watch it through the kernel's pidfd, not by that pid.
    fn check_placement(&self, link: &baton::ipc::Link) {
        let claimed = link.peer().process;
        let observed = baton::ipc::process::is_observed(&claimed);
        match self.placement {
            Placement::Here => assert!(!observed && claimed.pid != 1, "{claimed}"),
            Placement::OwnNamespaces => assert!(observed && claimed.pid == 1, "{claimed}"),
        }
    }

    /// What leaks would change: free device bytes (CUDA; after the pool gave back what it
    /// keeps for reuse, which is no leak), the namespace's segment count (named host
    /// segments), or what this process maps or holds open of the namespace's memfds (memfd
    /// host memory: the kernel frees it with its last holder, and the other process of each
    /// test is dead or gone when this is compared).
    fn resources(&self) -> Resources {
        match (&self.cuda, self.flavor) {
            (Some(c), _) => {
                c.synchronize().unwrap();
                c.trim_pool(0).unwrap();
                Resources::DeviceFree(c.mem_get_info().unwrap().0)
            }
            (None, Flavor::HostMemfd) => {
                let held = host::memfd_usage(std::process::id(), &self.ns).unwrap();
                Resources::MemfdsHeld(held.mappings + held.fds)
            }
            (None, _) => Resources::Segments(peer::segments(&self.ns)),
        }
    }

    /// CUDA: the backend holds no allocation or mapping (exact, unlike free memory).
    fn assert_nothing_live(&self, when: &str) {
        if let Some(c) = &self.cuda {
            assert!(c.live().is_empty(), "{when}: still live: {:?}", c.live());
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resources {
    DeviceFree(usize),
    Segments(usize),
    MemfdsHeld(usize),
}

impl Resources {
    /// Whether `self` is back at `baseline` (device memory: within 1 MiB).
    fn back_to(self, baseline: Resources) -> bool {
        match (self, baseline) {
            (Resources::DeviceFree(now), Resources::DeviceFree(base)) => now + MIB >= base,
            (Resources::Segments(now), Resources::Segments(base)) => now == base,
            (Resources::MemfdsHeld(now), Resources::MemfdsHeld(base)) => now == base,
            _ => false,
        }
    }
}

// --- the exporter's work -------------------------------------------------------------

/// Word `i` of the fill pattern, the same on the CPU and in the kernel.
fn pattern_word(i: u64, seed: u32) -> u32 {
    let v = (i as u32).wrapping_mul(0x9E37_79B1).wrapping_add(seed);
    v ^ (v >> 15)
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 4);
    for i in 0..len.div_ceil(4) as u64 {
        out.extend_from_slice(&pattern_word(i, seed).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// `baton_fill(ptr, n_words, seed, spin_ns)`: every thread first spins for `spin_ns`
/// nanoseconds of `%globaltimer`, then the grid writes `pattern_word(i, seed)` to word `i`.
const FILL_PTX: &str = r#"
.version 7.0
.target sm_75
.address_size 64

.visible .entry baton_fill(
    .param .u64 p_ptr,
    .param .u64 p_n,
    .param .u32 p_seed,
    .param .u64 p_spin
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [p_ptr];
    ld.param.u64 %rd2, [p_n];
    ld.param.u32 %r1, [p_seed];
    ld.param.u64 %rd3, [p_spin];
    cvta.to.global.u64 %rd1, %rd1;

    setp.eq.u64 %p1, %rd3, 0;
    @%p1 bra SPUN;
    mov.u64 %rd4, %globaltimer;
SPIN:
    mov.u64 %rd5, %globaltimer;
    sub.u64 %rd6, %rd5, %rd4;
    setp.lt.u64 %p2, %rd6, %rd3;
    @%p2 bra SPIN;
SPUN:
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd7, %r2, %r3;
    cvt.u64.u32 %rd8, %r4;
    add.u64 %rd7, %rd7, %rd8;
    mov.u32 %r5, %nctaid.x;
    mul.wide.u32 %rd9, %r5, %r3;
LOOP:
    setp.ge.u64 %p3, %rd7, %rd2;
    @%p3 bra DONE;
    cvt.u32.u64 %r6, %rd7;
    mul.lo.s32 %r6, %r6, -1640531535;
    add.s32 %r6, %r6, %r1;
    shr.u32 %r7, %r6, 15;
    xor.b32 %r6, %r6, %r7;
    shl.b64 %rd10, %rd7, 2;
    add.u64 %rd11, %rd1, %rd10;
    st.global.u32 [%rd11], %r6;
    add.u64 %rd7, %rd7, %rd9;
    bra LOOP;
DONE:
    ret;
}
"#;

/// The fill kernel, if the driver JIT-compiles it.
fn fill_kernel(cuda: &CudaBackend) -> Option<CudaFunction> {
    let loaded = cuda
        .context()
        .load_module(Ptx::from_src(FILL_PTX))
        .and_then(|m| m.load_function("baton_fill"));
    match loaded {
        Ok(f) => Some(f),
        Err(e) => {
            eprintln!(
                "conformance: the driver refused the PTX kernel ({e:?}); falling back to copies and memsets"
            );
            None
        }
    }
}

fn device_ptr(alloc: &Allocation) -> u64 {
    match alloc.ptr() {
        MemPtr::Device(p) => p,
        MemPtr::Host(_) => panic!("not device memory"),
    }
}

/// Launches the fill kernel over the whole allocation on the backend's stream (async).
fn launch_fill(
    cuda: &CudaBackend,
    f: &CudaFunction,
    alloc: &Allocation,
    seed: u32,
    spin: Duration,
) {
    let ptr = device_ptr(alloc);
    let words = (alloc.size() / 4) as u64;
    let spin_ns = spin.as_nanos() as u64;
    let stream = cuda.stream();
    let mut launch = stream.launch_builder(f);
    launch.arg(&ptr).arg(&words).arg(&seed).arg(&spin_ns);
    let cfg = LaunchConfig {
        grid_dim: (1024, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel takes (u64 pointer, u64 words, u32 seed, u64 nanoseconds), as
    // pushed; it writes words 0..words of `ptr`, which is the allocation's base, and the
    // allocation (`words * 4` bytes or more) outlives the launch: the tests synchronise or
    // wait on an event recorded after it before the allocation drops.
    unsafe { launch.launch(cfg) }.expect("launching the fill kernel");
}

/// Writes `pattern(alloc.size(), seed)` into the allocation, with the kernel where there
/// is one; returns the pattern's digest.
fn produce(subject: &Subject, alloc: &Allocation, seed: u32) -> blake3::Hash {
    let expected = pattern(alloc.size(), seed);
    match subject
        .cuda
        .as_deref()
        .and_then(|c| fill_kernel(c).map(|f| (c, f)))
    {
        Some((cuda, f)) => {
            launch_fill(cuda, &f, alloc, seed, Duration::ZERO);
            cuda.synchronize().unwrap();
        }
        None => alloc.write(0, &expected).unwrap(),
    }
    blake3::hash(&expected)
}

fn offer(link: &mut baton::ipc::Link, lease: u64, handle: HandleMsg, fd: Option<BorrowedFd<'_>>) {
    let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    link.send(
        &Message::Offer(Box::new(Offer {
            lease: LeaseId::new(lease),
            handle,
        })),
        &fds,
    )
    .unwrap();
}

/// The same handle with one byte of its raw part flipped (or, for a VMM handle, whose raw
/// part is only a slot index, one byte of the device UUID).
fn corrupted(handle: &HandleMsg) -> HandleMsg {
    let mut bad = handle.clone();
    match &mut bad.raw {
        RawHandle::CudaIpc(raw) => raw.0[21] ^= 0x01,
        RawHandle::CudaPool { ptr, .. } => ptr.0[21] ^= 0x01,
        RawHandle::HostSegment(name) => {
            let mut s = name.as_str().to_owned();
            let last = s.pop().unwrap();
            s.push(if last == '0' { '1' } else { '0' });
            *name = baton::messages::SegmentName::new(s).unwrap();
        }
        _ => bad.device.0[5] ^= 0x01,
    }
    bad
}

fn expect_release(link: &mut baton::ipc::Link, lease: u64) {
    let got = link.recv_timeout(DEADLINE).unwrap().message;
    assert_eq!(got, Message::Release(Release::now(LeaseId::new(lease))));
}

// --- the tests, once ------------------------------------------------------------------

/// A 256 MiB buffer written by the exporter is read back exactly by the importer, whose
/// reply the exporter then sees. Before it, a corrupted handle is refused with no driver
/// open; after it, reopening the handle hits the cache (no driver open).
fn round_trip(flavor: Flavor, placement: Placement) {
    let subject = Subject::new(flavor, placement, "rt");
    let session = Session::generate().unwrap();
    let (_tmp, dir) = socket_dir();
    let listener = Listener::bind(&dir, "x.sock", LinkConfig::new(session.clone())).unwrap();

    let alloc = subject.backend.allocate(SIZE).unwrap();
    let digest = produce(&subject, &alloc, 0x5eed);
    const REPLY_OFFSET: usize = SIZE - MIB;
    const REPLY_LEN: usize = MIB;
    const REPLY_SEED: u64 = 77;

    let sock = listener.path().to_str().unwrap().to_owned();
    let mut child = subject.spawn(
        &session,
        "import-check",
        &[
            &sock,
            digest.to_hex().as_str(),
            &REPLY_OFFSET.to_string(),
            &REPLY_LEN.to_string(),
            &REPLY_SEED.to_string(),
        ],
    );
    let mut link = subject.accept(&listener, &mut child);
    let handle = alloc.handle(&session).build().unwrap();
    assert_eq!(handle.alloc_size, SIZE as u64);
    assert_eq!(handle.device, subject.backend.device());

    offer(&mut link, 1, corrupted(&handle), alloc.export_fd());
    assert_eq!(
        link.recv_timeout(DEADLINE).unwrap().message,
        Message::Ping(1),
        "the importer refused the corrupted handle before any driver call"
    );
    offer(&mut link, 2, handle, alloc.export_fd());
    expect_release(&mut link, 2);

    let mut reply = vec![0u8; REPLY_LEN];
    alloc.read(REPLY_OFFSET, &mut reply).unwrap();
    let want: Vec<u8> = (0..REPLY_LEN as u64)
        .map(|i| (i * 31 + REPLY_SEED) as u8)
        .collect();
    assert!(reply == want, "the exporter sees what the importer wrote");
    drop(link);
    assert!(
        child.wait(DEADLINE).success(),
        "the importer's checks passed"
    );
    alloc.free().unwrap();
    subject.assert_nothing_live("after the free");
}

/// The exporter launches long work that writes the buffer, records an event after it and
/// offers the handle at once; the importer waits on the event and never sees stale data.
fn event_ordering(flavor: Flavor, placement: Placement) {
    let subject = Subject::new(flavor, placement, "ev");
    let session = Session::generate().unwrap();
    let (_tmp, dir) = socket_dir();
    let listener = Listener::bind(&dir, "x.sock", LinkConfig::new(session.clone())).unwrap();
    let alloc = subject.backend.allocate(SIZE).unwrap();
    alloc.fill(0, SIZE, 0x11).unwrap(); // the stale contents

    const SEED: u32 = 0xfeed;
    let kernel = subject.cuda.as_deref().and_then(fill_kernel);
    let expected = match (&subject.cuda, &kernel) {
        (Some(_), Some(_)) => blake3::hash(&pattern(SIZE, SEED)),
        (Some(_), None) => blake3::hash(&vec![0x33; SIZE]),
        (None, _) => blake3::hash(&pattern(SIZE, SEED)),
    };
    let sock = listener.path().to_str().unwrap().to_owned();
    let mut child = subject.spawn(
        &session,
        "import-expect",
        &[&sock, expected.to_hex().as_str()],
    );
    // The importer has made its backend (and CUDA context) by the time it connects.
    let mut link = subject.accept(&listener, &mut child);

    let mut event = None;
    let mut builder = alloc.handle(&session);
    match (&subject.cuda, &kernel) {
        (Some(cuda), Some(f)) => {
            launch_fill(cuda, f, &alloc, SEED, Duration::from_millis(500));
        }
        (Some(cuda), None) => {
            // About as long, without a kernel: a chain of whole-buffer memsets.
            // Baton leaves the caller's current context alone: the raw calls below need
            // the backend's bound (cudarc binds it for its own calls, as here).
            cuda.context().bind_to_thread().unwrap();
            for i in 0..4000 {
                let byte = if i == 3999 { 0x33 } else { 0x22 };
                // SAFETY: the whole allocation, on the backend's live stream, whose context is
                // bound just above; the allocation outlives the work (we wait for the
                // importer's release, after its wait on the event, before freeing).
                unsafe {
                    baton::ipc::cuda::cudarc::driver::result::memset_d8_async(
                        device_ptr(&alloc),
                        byte,
                        SIZE,
                        cuda.stream().cu_stream(),
                    )
                }
                .unwrap();
            }
        }
        (None, _) => alloc.write(0, &pattern(SIZE, SEED)).unwrap(),
    }
    if let Some(cuda) = &subject.cuda {
        let recorded = cuda.record_event().unwrap();
        assert!(
            !recorded.is_complete().unwrap(),
            "the work was still running when the handle was offered (else this test proves nothing)"
        );
        builder = builder.event(recorded.ipc_handle());
        event = Some(recorded);
    }
    offer(&mut link, 1, builder.build().unwrap(), alloc.export_fd());
    expect_release(&mut link, 1);
    drop(link);
    let status = child.wait(DEADLINE);
    if subject.cuda.is_some() && placement == Placement::OwnNamespaces {
        // Across PID namespaces an event is refused before any driver call (the driver
        // keeps it in our /dev/shm, which the importer's container does not see): the
        // lease came back, and the importer says so by its exit status.
        assert_eq!(
            status.code(),
            Some(3),
            "the importer refused our event as one across PID namespaces ({status})"
        );
        if let Some(cuda) = &subject.cuda {
            cuda.synchronize().unwrap();
        }
    } else {
        assert!(status.success(), "the importer saw only the finished data");
    }
    if let (Some(cuda), Some(event)) = (&subject.cuda, event) {
        drop(event);
        assert_eq!(
            cuda.event_counts(),
            (1, 0),
            "the event went back to the pool"
        );
    }
    alloc.free().unwrap();
}

/// The importer is SIGKILLed while it maps the buffer; the exporter sees the link close
/// (`Closed`), frees, and the device's free memory (host: the segments) returns to the
/// baseline. On CUDA the driver keeps memory an importer maps, so the baseline comes back
/// only once the importer's death and the free both happened. On host the free removes the
/// name whether or not the importer lives: there this shows the clean close and that the
/// free leaves no segment — not that the free waited for the importer (no ledger at this
/// level; see `tests/actors_protocol.rs` for that).
fn importer_sigkill(flavor: Flavor, placement: Placement) {
    let subject = Subject::new(flavor, placement, "ik");
    let session = Session::generate().unwrap();
    let (_tmp, dir) = socket_dir();
    let listener = Listener::bind(&dir, "x.sock", LinkConfig::new(session.clone())).unwrap();
    let baseline = subject.resources();

    let alloc = subject.backend.allocate(SIZE).unwrap();
    alloc.fill(0, SIZE, 0x5A).unwrap();
    let sock = listener.path().to_str().unwrap().to_owned();
    let mut child = subject.spawn(&session, "import-hold", &[&sock]);
    let mut link = subject.accept(&listener, &mut child);
    offer(
        &mut link,
        1,
        alloc.handle(&session).build().unwrap(),
        alloc.export_fd(),
    );
    assert_eq!(
        link.recv_timeout(DEADLINE).unwrap().message,
        Message::Ping(1)
    );
    assert!(
        !subject.resources().back_to(baseline),
        "the allocation is visible in the measure"
    );
    if let Some(c) = &subject.cuda {
        assert_eq!((c.live().exported, c.live().exported_bytes), (1, SIZE));
    }
    if flavor == Flavor::HostMemfd {
        let theirs = host::memfd_usage(child.pid(), &subject.ns).unwrap();
        assert_eq!(
            (theirs.mappings, theirs.fds),
            (1, 0),
            "the importer maps the memfd and closed its descriptor"
        );
    }

    child.kill9();
    assert!(matches!(link.recv_timeout(DEADLINE), Err(Error::Closed)));
    alloc.free().unwrap();
    // What a node does when a peer process dies: the backend drops what it kept of it
    // (CUDA pools: our export pool retires, as memory a dead importer mapped comes back
    // only with the pool).
    subject.backend.forget_process(&link.peer().process);
    subject.assert_nothing_live("after the free");
    // The driver may release a dead process's context asynchronously: poll.
    poll_until(DEADLINE, "the memory to return to its baseline", || {
        subject.resources().back_to(baseline)
    });
    eprintln!(
        "conformance: {flavor:?} baseline {baseline:?}, after {:?}",
        subject.resources()
    );
}

/// The exporter is SIGKILLed while the importer maps its buffer; the importer releases
/// cleanly and its backend (CUDA: context) stays usable.
fn exporter_sigkill(flavor: Flavor, placement: Placement) {
    let subject = Subject::new(flavor, placement, "ek");
    let session = Session::generate().unwrap();
    let (_tmp, dir) = socket_dir();
    let listener = Listener::bind(&dir, "x.sock", LinkConfig::new(session.clone())).unwrap();
    let sock = listener.path().to_str().unwrap().to_owned();
    let mut child = subject.spawn(&session, "export-hold", &[&sock, &(64 * MIB).to_string()]);
    let mut link = subject.accept(&listener, &mut child);
    let received = link.recv_timeout(DEADLINE).unwrap();
    let Message::Offer(offered) = received.message else {
        panic!("expected an offer, got {:?}", received.message)
    };
    let mut fds = received.fds;
    let fd = offered
        .handle
        .raw
        .fd_slot()
        .map(|slot| fds.take(slot).unwrap());
    // Opened directly (not through the cache), to see the close's result.
    let mem = subject
        .backend
        .open(session.check(&offered.handle).unwrap(), fd)
        .unwrap();
    assert_eq!(mem.to_vec().unwrap(), vec![0xAB; 64 * MIB]);
    assert_eq!(subject.opens(), 1);

    child.kill9();
    assert!(matches!(link.recv_timeout(DEADLINE), Err(Error::Closed)));
    let mut first = [0u8; 16];
    let readable = mem.read(0, &mut first);
    eprintln!("conformance: {flavor:?} read after the exporter died: {readable:?} {first:02x?}");
    if let Some(c) = &subject.cuda {
        assert_eq!((c.live().imported, c.live().imported_bytes), (1, 64 * MIB));
    }
    if subject.host.is_some() {
        // Host memory lives on while we map it: the kernel frees it with its last holder.
        readable.expect("host memory stays readable");
        assert_eq!(first, [0xAB; 16]);
    }
    mem.close().expect("the importer releases cleanly");
    subject.assert_nothing_live("after the close");

    let check = subject.backend.allocate(16 * MIB).unwrap();
    check.fill(0, 16 * MIB, 0x5C).unwrap();
    assert_eq!(
        check.to_vec().unwrap(),
        vec![0x5C; 16 * MIB],
        "still usable"
    );
    check.free().unwrap();
    subject.assert_nothing_live("after the check allocation");
    if let Some(cuda) = &subject.cuda {
        cuda.mem_get_info().expect("the context still answers");
    } else if flavor == Flavor::HostNamed {
        // The dead owner skipped its Drop; sweep its segment.
        assert_eq!(host::sweep(&subject.ns).unwrap().removed.len(), 1);
    } else {
        // A memfd has no name: nothing was left behind, nothing to sweep.
        assert!(host::list_segments(&subject.ns).unwrap().is_empty());
        assert_eq!(host::sweep(&subject.ns).unwrap().removed.len(), 0);
        assert!(
            host::memfd_usage(std::process::id(), &subject.ns)
                .unwrap()
                .is_empty(),
            "we hold none of it any more"
        );
    }
}

/// Many buffers carved from one slab cost the importer one driver open.
fn slab_buffers_share_one_open(flavor: Flavor, placement: Placement) {
    let subject = Subject::new(flavor, placement, "sl");
    let session = Session::generate().unwrap();
    let (_tmp, dir) = socket_dir();
    let listener = Listener::bind(&dir, "x.sock", LinkConfig::new(session.clone())).unwrap();
    let arena = SlabArena::allocate(&*subject.backend, 8 * MIB).unwrap();
    let buffers: Vec<_> = (0..3).map(|_| arena.carve(MIB + 100).unwrap()).collect();
    for (i, b) in buffers.iter().enumerate() {
        b.fill(0, b.len(), i as u8 + 1).unwrap();
    }
    let sock = listener.path().to_str().unwrap().to_owned();
    let mut child = subject.spawn(&session, "import-slab", &[&sock, "3"]);
    let mut link = subject.accept(&listener, &mut child);
    for (i, b) in buffers.iter().enumerate() {
        offer(
            &mut link,
            i as u64 + 1,
            b.handle(&session).build().unwrap(),
            b.export_fd(),
        );
    }
    for i in 0..3 {
        expect_release(&mut link, i + 1);
    }
    drop(link);
    assert!(
        child.wait(DEADLINE).success(),
        "one driver open for three buffers"
    );
    drop(buffers);
    assert_eq!(arena.live_buffers(), 0);
}

/// In one process: a corrupted handle is refused before the driver is called; the
/// exporter's own handle opens to its own memory (CUDA: the same device pointer, no driver
/// open, since the driver refuses that open) and stays valid after the exporter's guard
/// drops; VMM sizes are rounded up to the granularity.
fn same_process_open_and_corrupted_handles(flavor: Flavor, placement: Placement) {
    let subject = Subject::new(flavor, placement, "sp");
    let session = Session::generate().unwrap();
    let cache = ImportCache::new(session.clone(), [subject.backend.clone()]);
    let alloc = subject.backend.allocate(MIB).unwrap();
    alloc.fill(0, MIB, 0x77).unwrap();
    let handle = alloc.handle(&session).build().unwrap();
    // What a frame carrying this handle would carry: the VMM descriptor, if any.
    let mut fds = FrameFds::new(
        alloc
            .export_fd()
            .map(|fd| fd.try_clone_to_owned().unwrap())
            .into_iter()
            .collect(),
    );

    let bad = corrupted(&handle);
    assert!(matches!(
        cache.open(&bad, &mut fds),
        Err(Error::Message(MessageError::DigestMismatch))
    ));
    assert_eq!(subject.opens(), 0, "no driver call for a corrupted handle");
    assert_eq!(cache.stats().opens, 0);

    if let Some(cuda) = &subject.cuda {
        let opened = cache.open(&handle, &mut fds).unwrap();
        assert_eq!(opened.ptr(), alloc.ptr(), "the exporter's own mapping");
        assert_eq!(cuda.opens(), 0, "no driver open in the exporting process");
        opened.write(10, b"mine").unwrap();
        let mut back = [0u8; 4];
        alloc.read(10, &mut back).unwrap();
        assert_eq!(&back, b"mine");
        alloc.free().unwrap();
        opened.read(10, &mut back).unwrap();
        assert_eq!(
            &back, b"mine",
            "the memory lives until the opened view drops"
        );
        drop(opened);
        assert_eq!(cache.stats().live, 0);
        subject.assert_nothing_live("after the exporter's free and the opened view's drop");
        if flavor == Flavor::CudaVmm {
            let g = cuda.vmm_granularity().unwrap();
            let small = cuda.allocate(1000).unwrap();
            assert_eq!(small.size(), g, "rounded up to the granularity");
            let h = small.handle(&session).build().unwrap();
            assert_eq!(h.alloc_size, g as u64);
            assert!(small.export_fd().is_some());
        }
    } else {
        let opened = cache.open(&handle, &mut fds).unwrap();
        assert_eq!(opened.to_vec().unwrap(), vec![0x77; MIB]);
        assert_eq!(subject.opens(), 1);
    }
}

/// The exporter queues about half a second of work that writes the buffer on its stream,
/// records a fence of `kind` after it and at once sends the fence and the buffer's handle
/// (in a `Call`: fences travel as bytes until the wire vocabulary has a fence variant);
/// the importer makes its stream wait on the fence and must never read stale data.
fn fence_ordering(kind: FenceKind, placement: Placement) {
    let subject = Subject::with_fence(Flavor::CudaLegacy, placement, "fe", kind);
    let cuda = subject.cuda.clone().expect("a CUDA subject");
    assert_eq!(
        cuda.fence_kind(),
        kind,
        "this device falls back from {kind:?} fences (no 64-bit stream memory operations)"
    );
    let session = Session::generate().unwrap();
    let (_tmp, dir) = socket_dir();
    let listener = Listener::bind(&dir, "x.sock", LinkConfig::new(session.clone())).unwrap();
    let alloc = subject.backend.allocate(SIZE).unwrap();
    alloc.fill(0, SIZE, 0x11).unwrap(); // the stale contents

    const SEED: u32 = 0xfe1c;
    let kernel = fill_kernel(&cuda);
    let expected = match &kernel {
        Some(_) => blake3::hash(&pattern(SIZE, SEED)),
        None => blake3::hash(&vec![0x33; SIZE]),
    };
    let sock = listener.path().to_str().unwrap().to_owned();
    let name = match kind {
        FenceKind::Event => "event",
        FenceKind::Counter => "counter",
    };
    let mut child = subject.spawn(
        &session,
        "import-fence",
        &[&sock, name, expected.to_hex().as_str()],
    );
    // The importer has made its backend (and CUDA context) by the time it connects.
    let mut link = listener.accept().unwrap();
    subject.check_placement(&link);
    let importer = link.peer().process;
    if kind == FenceKind::Event && placement == Placement::OwnNamespaces {
        // No event crosses PID namespaces: refused before anything is recorded.
        assert!(
            matches!(
                cuda.record_fence_for(cuda.stream(), &importer),
                Err(Error::EventAcrossPidNamespaces { peer }) if peer == importer
            ),
            "an event fence for a process in another PID namespace is refused"
        );
        assert_eq!(cuda.fence_counts(), (0, 0), "nothing was recorded");
        return;
    }
    if kind == FenceKind::Counter {
        // Counter fences for the importer are written into its inbox: it lends us a lane.
        let got = link.recv_timeout(DEADLINE).unwrap().message;
        let Message::FenceInbox(grant) = got else {
            panic!("expected the importer's FenceInbox, got {}", got.kind());
        };
        cuda.ordering().accept_inbox(&importer, &grant).unwrap();
    }
    match &kernel {
        Some(f) => launch_fill(&cuda, f, &alloc, SEED, Duration::from_millis(500)),
        None => {
            cuda.context().bind_to_thread().unwrap();
            for i in 0..4000 {
                let byte = if i == 3999 { 0x33 } else { 0x22 };
                // SAFETY: the whole allocation, on the backend's live stream, whose context is
                // bound just above; the allocation outlives the work (we wait for the
                // importer's release, after its wait on the fence, before freeing).
                unsafe {
                    baton::ipc::cuda::cudarc::driver::result::memset_d8_async(
                        device_ptr(&alloc),
                        byte,
                        SIZE,
                        cuda.stream().cu_stream(),
                    )
                }
                .unwrap();
            }
        }
    }
    let fence = cuda
        .record_fence_for(cuda.stream(), &importer)
        .unwrap()
        .expect("the importer lent an inbox");
    assert_eq!(fence.handle().kind(), kind);
    assert!(
        !fence.is_complete().unwrap(),
        "the work was still running when the fence was sent (else this test proves nothing)"
    );
    let payload = match fence.handle() {
        FenceHandle::Event(h) => h.0.to_vec(),
        FenceHandle::Counter(c) => c.to_bytes().to_vec(),
    };
    let handle = alloc.handle(&session).build().unwrap();
    assert!(
        handle.fence.is_none(),
        "the fence alone orders the importer"
    );
    link.send(
        &Message::Call(Call {
            id: 1,
            target: "fence".into(),
            type_name: name.into(),
            payload,
            offers: vec![Offer {
                lease: LeaseId::new(1),
                handle,
            }],
        }),
        &[],
    )
    .unwrap();
    expect_release(&mut link, 1);
    drop(link);
    assert!(
        child.wait(DEADLINE).success(),
        "the importer saw only the finished data"
    );
    assert!(fence.is_complete().unwrap());
    drop(fence);
    assert_eq!(cuda.fence_counts().1, 0, "the fence went back to its pool");
    alloc.free().unwrap();
    subject.assert_nothing_live("after the free");
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn event_fences_order_the_importers_stream() {
    fence_ordering(FenceKind::Event, Placement::Here);
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn counter_fences_order_the_importers_stream() {
    fence_ordering(FenceKind::Counter, Placement::Here);
}

macro_rules! conformance {
    (every backend: $($test:ident),* $(,)?; device memory only: $($gpu:ident),* $(,)?) => {
        mod on_host_memfd {
            $(
                #[test]
                fn $test() {
                    super::$test(super::Flavor::HostMemfd, super::Placement::Here)
                }
            )*
        }

        mod on_host_named {
            $(
                #[test]
                fn $test() {
                    super::$test(super::Flavor::HostNamed, super::Placement::Here)
                }
            )*
        }

        mod on_cuda_legacy {
            $(
                #[test]
                #[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU: --features gpu-tests")]
                fn $test() {
                    super::$test(super::Flavor::CudaLegacy, super::Placement::Here)
                }
            )*
            $(
                #[test]
                #[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU: --features gpu-tests")]
                fn $gpu() {
                    super::$gpu(super::Flavor::CudaLegacy, super::Placement::Here)
                }
            )*
        }

        mod on_cuda_vmm {
            $(
                #[test]
                #[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU: --features gpu-tests")]
                fn $test() {
                    super::$test(super::Flavor::CudaVmm, super::Placement::Here)
                }
            )*
            $(
                #[test]
                #[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU: --features gpu-tests")]
                fn $gpu() {
                    super::$gpu(super::Flavor::CudaVmm, super::Placement::Here)
                }
            )*
        }

        mod on_cuda_pool {
            $(
                #[test]
                #[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU: --features gpu-tests")]
                fn $test() {
                    super::$test(super::Flavor::CudaPool, super::Placement::Here)
                }
            )*
            $(
                #[test]
                #[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU: --features gpu-tests")]
                fn $gpu() {
                    super::$gpu(super::Flavor::CudaPool, super::Placement::Here)
                }
            )*
        }
    };
}

// `event_ordering` needs asynchronous writes to order: on host a write is done when it
// returns and there is no event, so there it could only repeat `round_trip`.
conformance!(
    every backend:
        round_trip,
        importer_sigkill,
        exporter_sigkill,
        slab_buffers_share_one_open,
        same_process_open_and_corrupted_handles;
    device memory only:
        event_ordering,
);

/// The conformance set across namespaces (issue 51): the other process runs in PID,
/// network, IPC and mount namespaces of its own with a `/dev/shm` of its own, as a
/// container's process does, sharing with us only the socket's directory and the devices
/// ([`Placement::OwnNamespaces`]; needs root). Host memory crosses as memfds (named
/// segments live in a `/dev/shm`, which containers do not share; `docs/CROSS_HOST.md`,
/// "Containers"); device memory of every export kind crosses, and counter fences do,
/// while an interprocess event is refused, typed, on either side (the driver keeps it in
/// the exporter's `/dev/shm`).
fn across_namespaces(flavor: Flavor) {
    let at = Placement::OwnNamespaces;
    round_trip(flavor, at);
    importer_sigkill(flavor, at);
    exporter_sigkill(flavor, at);
    slab_buffers_share_one_open(flavor, at);
    if flavor.export().is_some() {
        event_ordering(flavor, at);
    }
}

#[test]
#[ignore = "needs root (unshare: the namespaces of a container)"]
fn host_memfd_conformance_across_namespaces() {
    across_namespaces(Flavor::HostMemfd);
}

macro_rules! across_namespaces_on_gpu {
    ($($test:ident: $run:expr),* $(,)?) => {
        $(
            #[test]
            #[cfg_attr(feature = "gpu-tests", ignore = "needs root (unshare: the namespaces of a container)")]
            #[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU (--features gpu-tests) and root")]
            fn $test() {
                $run;
            }
        )*
    };
}

across_namespaces_on_gpu!(
    cuda_legacy_conformance_across_namespaces: across_namespaces(Flavor::CudaLegacy),
    cuda_vmm_conformance_across_namespaces: across_namespaces(Flavor::CudaVmm),
    cuda_pool_conformance_across_namespaces: across_namespaces(Flavor::CudaPool),
    event_fences_order_the_importers_stream_across_namespaces:
        fence_ordering(FenceKind::Event, Placement::OwnNamespaces),
    counter_fences_order_the_importers_stream_across_namespaces:
        fence_ordering(FenceKind::Counter, Placement::OwnNamespaces),
);

#[test]
fn the_fill_pattern_is_stable() {
    // The kernel computes the same words; pin a few so a change to either side shows.
    assert_eq!(pattern_word(0, 0), 0);
    assert_eq!(pattern(8, 1)[..4], pattern_word(0, 1).to_le_bytes());
    let w = 0x9E37_79B1u32.wrapping_add(7);
    assert_eq!(pattern_word(1, 7), w ^ (w >> 15));
}
