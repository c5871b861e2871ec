//! The CUDA module's unit tests: the ones without a GPU run everywhere; the rest need
//! `--features gpu-tests` and a CUDA GPU (serialised by the GPU test lock).

use super::context::{ContextGuard, KeepCurrent};
use super::legacy::{DeviceAlloc, IpcMapping};
use super::live::{LiveCounters, LiveToken};
use super::*;
use crate::backend::{Allocation, Backend, FreeWhileMapped, MemPtr, RawMemory};
use baton_messages::{BackendKind, RawHandle};
use std::sync::atomic::Ordering;

#[test]
fn export_modes_parse() {
    assert_eq!(CudaExport::parse("vmm"), Some(CudaExport::Vmm));
    assert_eq!(CudaExport::parse(" Legacy "), Some(CudaExport::Legacy));
    assert_eq!(CudaExport::parse("pool"), Some(CudaExport::Pool));
    assert_eq!(CudaExport::parse("fabric"), None);
    assert_eq!(CudaExport::Vmm.kind(), BackendKind::CudaVmm);
    assert_eq!(CudaExport::Pool.kind(), BackendKind::CudaPool);
    assert_eq!(CudaExport::default(), CudaExport::Legacy);
    for e in [CudaExport::Legacy, CudaExport::Vmm, CudaExport::Pool] {
        assert_eq!(CudaExport::parse(e.name()), Some(e));
    }
}

/// Without a driver, asking for the backend is an error that says why, never a panic.
#[test]
fn absence_is_an_error_with_a_reason() {
    match probe() {
        Ok(n) => assert!(n > 0),
        Err(Error::BackendUnavailable { backend, reason }) => {
            assert_eq!(backend, "cuda");
            assert!(!reason.is_empty());
            for export in [CudaExport::Legacy, CudaExport::Vmm, CudaExport::Pool] {
                assert!(matches!(
                    CudaBackend::new(0, export),
                    Err(Error::BackendUnavailable { .. })
                ));
            }
            assert!(matches!(
                current_context(),
                Err(Error::BackendUnavailable { .. })
            ));
        }
        Err(other) => panic!("unexpected {other}"),
    }
}

#[test]
fn live_tokens_count_and_uncount() {
    let counters = Arc::new(LiveCounters::default());
    let a = LiveToken::new(&counters, false, 100);
    let b = LiveToken::new(&counters, true, 7);
    let c = LiveToken::new(&counters, false, 5);
    assert_eq!(
        counters.snapshot(),
        LiveMemory {
            exported: 2,
            exported_bytes: 105,
            imported: 1,
            imported_bytes: 7
        }
    );
    drop((a, b));
    assert_eq!(counters.snapshot().exported_bytes, 5);
    drop(c);
    assert!(counters.snapshot().is_empty());
}

use crate::{FrameFds, ImportCache, Session};
use baton_messages::SessionToken;
use std::time::Duration;

fn gpu_lock() -> testing::GpuTestLock {
    testing::exclusive_gpu(Duration::from_secs(1800)).expect("the GPU test lock")
}

fn gpu_backend(export: CudaExport, events: usize) -> Arc<CudaBackend> {
    Arc::new(
        CudaBackend::with_event_limit(0, export, events)
            .unwrap_or_else(|e| panic!("gpu-tests need a CUDA GPU: {e}")),
    )
}

/// Descriptors the driver hands us are closed on exec: children never inherit them.
fn assert_close_on_exec(fd: std::os::fd::BorrowedFd<'_>, what: &str) {
    let flags = rustix::io::fcntl_getfd(fd).expect("the descriptor's flags");
    assert!(
        flags.contains(rustix::io::FdFlags::CLOEXEC),
        "{what} is not close-on-exec: a child spawned later would inherit it"
    );
}

fn device_ptr(alloc: &Allocation) -> u64 {
    match alloc.ptr() {
        MemPtr::Device(p) => p,
        MemPtr::Host(_) => unreachable!("device memory"),
    }
}

/// Queues `n` memsets of the whole allocation on `stream` (the last one to `last`):
/// long work without a kernel.
fn long_work(alloc: &Allocation, stream: &CudaStream, n: usize, last: u8) {
    let _pushed = ContextGuard::push(stream.context()).unwrap();
    for i in 0..n {
        let byte = if i + 1 == n {
            last
        } else {
            last.wrapping_add(1)
        };
        // SAFETY: the whole live allocation, on a live stream of its context (current);
        // the caller waits for the work before the allocation drops.
        unsafe {
            result::memset_d8_async(device_ptr(alloc), byte, alloc.size(), stream.cu_stream())
        }
        .unwrap();
    }
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn the_event_pool_lends_up_to_its_limit_and_reuses_returned_events() {
    let _gpu = gpu_lock();
    let b = gpu_backend(CudaExport::Legacy, 2);
    let e1 = b.record_event().unwrap();
    let e2 = b.record_event().unwrap();
    assert_ne!(e1.ipc_handle(), e2.ipc_handle());
    assert!(matches!(
        b.record_event(),
        Err(Error::EventsExhausted { limit: 2 })
    ));
    let h1 = e1.ipc_handle();
    // A retired event is lent again once its record has completed: wait for it here, or
    // the next record may find it still pending and the pool exhausted (it did once, on
    // an H200).
    e1.synchronize().unwrap();
    drop(e1);
    let e3 = b.record_event().unwrap();
    assert_eq!(e3.ipc_handle(), h1, "the returned event is lent again");
    e3.synchronize().unwrap();
    assert!(e3.is_complete().unwrap());
    assert_eq!(b.event_counts(), (2, 2));
    drop((e2, e3));
    assert_eq!(b.event_counts(), (2, 0));
}

/// The import cache waits on an event of this very process (one wait queued on the
/// backend stream), without opening it as another process's event and without a
/// driver-level open of the memory.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn own_events_are_waited_on_without_opening_them() {
    let _gpu = gpu_lock();
    let b = gpu_backend(CudaExport::Legacy, 4);
    let session = Session::new(SessionToken::from_bytes([3; 32]));
    let cache = ImportCache::new(session.clone(), [b.clone() as crate::SharedBackend]);
    let alloc = b.allocate(1 << 20).unwrap();
    alloc.fill(0, 1 << 20, 9).unwrap();
    let ev = b.record_event().unwrap();
    let h = alloc
        .handle(&session)
        .event(ev.ipc_handle())
        .build()
        .unwrap();
    assert_eq!(b.waits(), 0);
    let opened = cache.open(&h, &mut FrameFds::none()).unwrap();
    assert_eq!(b.waits(), 1, "the cache had the backend wait on the event");
    assert_eq!(opened.to_vec().unwrap(), vec![9; 1 << 20]);
    assert_eq!((b.opens(), b.opened_events()), (0, 0));
    let again = cache.open(&h, &mut FrameFds::none()).unwrap();
    assert_eq!(b.waits(), 2, "a cache hit waits too");
    assert_eq!((b.opens(), b.opened_events()), (0, 0));
    drop((opened, again));
}

/// A legacy backend allocates VMM memory when asked (`allocate_as`), and names VMM as
/// the export for bulk buffers on a device that has it; its handle is a VMM one. (An
/// importer opening it is the Python suite's bundle tests: a Rust peer maps each.)
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_legacy_backend_allocates_vmm_memory_for_bulk_buffers() {
    let _gpu = gpu_lock();
    let b = gpu_backend(CudaExport::Legacy, 2);
    assert_eq!(b.export(), CudaExport::Legacy);
    assert_eq!(b.bulk_export(), CudaExport::Vmm, "H100 and H200 have VMM");
    let alloc = b.allocate_as(b.bulk_export(), 3 << 20).unwrap();
    assert_eq!(alloc.backend(), BackendKind::CudaVmm);
    assert!(alloc.size() >= 3 << 20);
    alloc.fill(0, 3 << 20, 5).unwrap();
    let mut back = vec![0; 3 << 20];
    alloc.read(0, &mut back).unwrap();
    assert_eq!(back, vec![5; 3 << 20]);
    assert!(matches!(
        alloc.raw().raw_handle(Some(0)).unwrap(),
        RawHandle::CudaVmmFd { slot: Some(0) }
    ));
    let fd = alloc
        .raw()
        .export_fd()
        .expect("a descriptor goes with its handles");
    assert_close_on_exec(fd, "a VMM allocation's descriptor");
    assert!(matches!(
        b.allocate_as(CudaExport::Vmm, 0),
        Err(Error::ZeroSize)
    ));
    alloc.free().unwrap();
}

/// Memory allocated outside Baton (`cuMemAlloc`, as PyTorch's caching allocator does) is
/// borrowed through its base: shared as a legacy handle, opened (here, in the exporting
/// process, as its own memory), never freed by Baton, its keeper dropped when the
/// allocation is; an interior address, a second borrow while the first lives, and an
/// address no allocation holds are refused with a reason.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn memory_allocated_elsewhere_is_borrowed_by_its_base_and_its_keeper_dropped_with_it() {
    use std::sync::atomic::AtomicBool;
    /// Owns the allocation (freed when dropped) and says when it dropped.
    struct Keeper(
        #[expect(dead_code, reason = "held: freed on drop")] DeviceAlloc,
        Arc<AtomicBool>,
    );
    impl Drop for Keeper {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }
    let _gpu = gpu_lock();
    let b = gpu_backend(CudaExport::Vmm, 2);
    let session = Session::new(SessionToken::from_bytes([4; 32]));
    let cache = ImportCache::new(session.clone(), [b.clone() as crate::SharedBackend]);
    let theirs = DeviceAlloc::new(&b.access.ctx, 3 << 20).unwrap();
    let base = theirs.ptr();
    assert_eq!(b.address_range(base + 4096).unwrap(), (base, 3 << 20));
    let dropped = Arc::new(AtomicBool::new(false));
    let keep = Box::new(Keeper(theirs, Arc::clone(&dropped)));
    // SAFETY: `keep` owns the allocation and frees it only when dropped.
    let alloc = unsafe { b.borrow(base, keep) }.unwrap();
    assert_eq!((device_ptr(&alloc), alloc.size()), (base, 3 << 20));
    assert_eq!(
        alloc.backend(),
        BackendKind::CudaLegacy,
        "whatever the backend's export"
    );
    assert_eq!(b.live().exported_bytes, 3 << 20);
    alloc.fill(0, 3 << 20, 7).unwrap();
    let h = alloc.handle(&session).build().unwrap();
    let opened = cache.open(&h, &mut FrameFds::none()).unwrap();
    assert_eq!(opened.to_vec().unwrap(), vec![7; 3 << 20]);

    let refused = |r: Result<Allocation>| match r {
        Err(Error::NotBorrowable { reason, .. }) => reason,
        other => panic!("not refused: {other:?}"),
    };
    // SAFETY: refused before anything is kept (each of these).
    let inside = refused(unsafe { b.borrow(base + 4096, Box::new(())) });
    assert!(inside.contains("inside the allocation"), "{inside}");
    // SAFETY: as above.
    let again = refused(unsafe { b.borrow(base, Box::new(())) });
    assert!(again.contains("borrowed the allocation already"), "{again}");
    assert!(matches!(
        b.address_range(8),
        Err(Error::NotBorrowable { ptr: 8, .. })
    ));
    // Baton's own VMM memory: legacy IPC cannot share it.
    let vmm = b.allocate(1 << 20).unwrap();
    // SAFETY: as above.
    let no_ipc = refused(unsafe { b.borrow(device_ptr(&vmm), Box::new(())) });
    assert!(
        no_ipc.contains("legacy CUDA IPC cannot share it"),
        "{no_ipc}"
    );

    // The cache's warm mapping of our own memory holds it too: drop both first.
    drop((opened, cache));
    assert!(!dropped.load(Ordering::SeqCst), "the allocation lives");
    alloc.free().unwrap();
    assert!(dropped.load(Ordering::SeqCst), "freeing dropped the keeper");
    assert_eq!(
        b.live().exported_bytes,
        vmm.size(),
        "the VMM allocation only"
    );
    // Released, the allocation may be borrowed again.
    let theirs = DeviceAlloc::new(&b.access.ctx, 1 << 20).unwrap();
    let base = theirs.ptr();
    // SAFETY: as above.
    let again = unsafe { b.borrow(base, Box::new(theirs)) }.unwrap();
    again.free().unwrap();
}

/// DESIGN and this module rely on the driver refusing to open a legacy handle in the
/// process that exported it (hence the process-local registry): this fails if a driver
/// starts accepting it.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn the_driver_refuses_our_own_legacy_handle() {
    let _gpu = gpu_lock();
    let b = gpu_backend(CudaExport::Legacy, 1);
    let alloc = b.allocate(1 << 20).unwrap();
    let RawHandle::CudaIpc(raw) = alloc.raw().raw_handle(None).unwrap() else {
        unreachable!()
    };
    match IpcMapping::open(&b.access.ctx, &raw.0) {
        Ok(mut m) => {
            let at = m.ptr();
            m.close().unwrap();
            panic!(
                "the driver opened our own handle at {at:#x} (ours {:?}): update DESIGN.md",
                alloc.ptr()
            );
        }
        Err(e) => eprintln!("the driver refused our own handle, as DESIGN records: {e}"),
    }
}

/// Allocate, write, read, open (a driver-level VMM import of our own descriptor, and
/// cache opens), wait on fences and drop everything, backends included, on a thread
/// with no current context and then on one whose current context is the device's
/// primary context: the thread's current context is the same afterwards.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn the_callers_current_context_is_left_as_it_was() {
    let _gpu = gpu_lock();
    fn exercise(export: CudaExport) {
        let b = Arc::new(
            CudaBackend::builder(0)
                .export(export)
                .fence(FenceKind::Counter)
                .build()
                .unwrap(),
        );
        let session = Session::new(SessionToken::from_bytes([4; 32]));
        let cache = ImportCache::new(session.clone(), [b.clone() as crate::SharedBackend]);
        let alloc = b.allocate(2 << 20).unwrap();
        alloc.write(0, b"context").unwrap();
        let mut back = [0u8; 7];
        alloc.read(0, &mut back).unwrap();
        assert_eq!(&back, b"context");
        let stream = {
            let _keep = KeepCurrent::new().unwrap();
            b.context().new_stream().unwrap()
        };
        let mine = b.allocate_on(&stream, 2 << 20);
        if b.pools_supported() {
            let mine = mine.unwrap();
            mine.fill(0, 16, 1).unwrap();
        }
        let fence = b.record_fence().unwrap();
        b.wait_fence(&crate::process::current(), &fence.handle())
            .unwrap();
        let ev = b.record_event().unwrap();
        let h = alloc
            .handle(&session)
            .event(ev.ipc_handle())
            .build()
            .unwrap();
        // What a frame carrying this handle would carry: the descriptor it names, if
        // any (a pool allocation's names the pool's).
        let mut fds = match h.raw.fd_slot() {
            Some(_) => FrameFds::new(vec![
                alloc.export_fd().unwrap().try_clone_to_owned().unwrap(),
            ]),
            None => FrameFds::none(),
        };
        let opened = cache.open(&h, &mut fds).unwrap();
        opened.write(0, b"CONTEXT").unwrap();
        if export == CudaExport::Vmm {
            let fd = alloc.export_fd().unwrap().try_clone_to_owned().unwrap();
            let checked = session.check(&h).unwrap();
            let m = b.open_remote(&checked, Some(fd)).unwrap();
            let mut got = [0u8; 7];
            m.read(0, &mut got).unwrap();
            assert_eq!(&got, b"CONTEXT");
            Box::new(m).close().unwrap();
        }
        drop((opened, ev, fence, alloc));
        let _keep = KeepCurrent::new().unwrap();
        drop(stream);
        drop(_keep);
        drop(cache);
        drop(b);
    }
    for export in [CudaExport::Legacy, CudaExport::Vmm, CudaExport::Pool] {
        // A fresh thread has no current context.
        std::thread::spawn(move || {
            assert!(current_context().unwrap().is_null());
            exercise(export);
            assert!(
                current_context().unwrap().is_null(),
                "{export:?}: Baton left a context current"
            );
        })
        .join()
        .unwrap();
        // A thread whose current context is the device's primary context, pushed by
        // the caller.
        std::thread::spawn(move || {
            let ctx = CudaContext::new(0).unwrap();
            assert_eq!(current_context().unwrap(), ctx.cu_ctx());
            exercise(export);
            assert_eq!(
                current_context().unwrap(),
                ctx.cu_ctx(),
                "{export:?}: Baton changed the current context"
            );
        })
        .join()
        .unwrap();
    }
}

/// Pool memory: allocated zeroed, written and read back, counted while alive, shared as
/// a pool handle naming the pool's descriptor slot, opened in this process as its own
/// memory, declared unsafe to free while mapped; `allocate_on` a user's stream works
/// the same; nothing is counted once all is dropped.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn pool_memory_round_trips_and_is_counted() {
    let _gpu = gpu_lock();
    let b = gpu_backend(CudaExport::Pool, 4);
    assert!(b.pools_supported());
    assert!(b.live().is_empty());
    let alloc = b.allocate(3 << 20).unwrap();
    assert_eq!(alloc.backend(), BackendKind::CudaPool);
    assert_eq!(alloc.free_while_mapped(), FreeWhileMapped::Unsafe);
    assert_eq!(alloc.to_vec().unwrap(), vec![0; 3 << 20], "zeroed");
    alloc.fill(5, 100, 0x42).unwrap();
    let mut got = [0u8; 100];
    alloc.read(5, &mut got).unwrap();
    assert_eq!(got, [0x42; 100]);
    assert_eq!(
        b.live(),
        LiveMemory {
            exported: 1,
            exported_bytes: 3 << 20,
            ..LiveMemory::default()
        }
    );
    let RawHandle::CudaPool {
        pool, pool_slot, ..
    } = alloc.raw().raw_handle(Some(2)).unwrap()
    else {
        panic!("a pool handle")
    };
    assert_eq!(pool_slot, Some(2));
    let fd = alloc.export_fd().expect("the pool's descriptor");
    // A child spawned from here on must not inherit it: it would hold the pool, and its
    // memory, for as long as it lives (issue 46).
    assert_close_on_exec(fd, "the pool's descriptor");

    let session = Session::new(SessionToken::from_bytes([5; 32]));
    let cache = ImportCache::new(session.clone(), [b.clone() as crate::SharedBackend]);
    let h = alloc.handle(&session).fd_slot(None).build().unwrap();
    let opened = cache.open(&h, &mut FrameFds::none()).unwrap();
    assert_eq!(opened.ptr(), alloc.ptr(), "its own memory");
    assert_eq!(b.opens(), 0);

    let stream = {
        let _keep = KeepCurrent::new().unwrap();
        b.context().new_stream().unwrap()
    };
    let mine = b.allocate_on(&stream, 2 << 20).unwrap();
    let RawHandle::CudaPool { pool: same, .. } = mine.raw().raw_handle(None).unwrap() else {
        panic!("a pool handle")
    };
    assert_eq!(same, pool, "one pool per backend");
    assert_eq!(mine.to_vec().unwrap(), vec![0; 2 << 20], "zeroed, in order");
    assert_eq!(b.live().exported, 2);
    drop(opened);
    drop((alloc, mine));
    assert!(b.live().is_empty(), "{:?}", b.live());
    b.trim_pool(0).unwrap();
    let _keep = KeepCurrent::new().unwrap();
    drop(stream);
}

/// A counter fence recorded on a producer stream behind long work: the backend stream
/// that waits on it (a local wait: the fence is this process's) reads only the finished
/// data, and the fence reports completion only after that work.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn counter_fences_order_a_waiting_stream_after_the_producer() {
    let _gpu = gpu_lock();
    let b = CudaBackend::builder(0)
        .fence(FenceKind::Counter)
        .counter_slots(4)
        .build()
        .unwrap();
    assert_eq!(
        b.fence_kind(),
        FenceKind::Counter,
        "this GPU has no 64-bit stream memory operations"
    );
    let alloc = b.allocate(256 << 20).unwrap();
    let producer = {
        let _keep = KeepCurrent::new().unwrap();
        b.context().new_stream().unwrap()
    };
    long_work(&alloc, &producer, 2000, 0x33);
    let fence = b.record_fence_on(&producer).unwrap();
    assert_eq!(fence.kind(), FenceKind::Counter);
    assert!(
        !fence.is_complete().unwrap(),
        "the work still ran when the fence was recorded (else this test proves nothing)"
    );
    assert_eq!(b.fence_counts(), (4, 1));
    b.wait_fence(&crate::process::current(), &fence.handle())
        .unwrap();
    assert_eq!(b.waits(), 1);
    let data = alloc.to_vec().unwrap();
    assert!(
        data.iter().all(|&x| x == 0x33),
        "the waiting stream read unfinished data"
    );
    assert!(fence.is_complete().unwrap());
    fence.synchronize().unwrap();
    drop(fence);
    assert_eq!(
        b.fence_counts(),
        (4, 0),
        "a dropped fence whose value landed is free again"
    );
    // Slots are reused with a higher value each time.
    let again = b.record_fence().unwrap();
    let FenceHandle::Counter(c) = again.handle() else {
        unreachable!()
    };
    again.synchronize().unwrap();
    assert!(c.value >= 1);
    let _keep = KeepCurrent::new().unwrap();
    drop(producer);
}

/// A dropped counter fence's slot is not lent again before its value has landed: with
/// one slot, a record while the first value is still behind long work finds none free;
/// once that work has completed, the slot comes back with the next value. (Lent again
/// earlier, the slot's two writes could land out of order: a waiter for the first value
/// would be released by the second too early, or one for the second would stall.)
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_dropped_counter_slot_is_lent_again_only_once_its_value_landed() {
    let _gpu = gpu_lock();
    let b = CudaBackend::builder(0).counter_slots(1).build().unwrap();
    assert_eq!(
        b.fence_kind(),
        FenceKind::Counter,
        "counter fences are the default (this GPU has no 64-bit stream memory operations?)"
    );
    let alloc = b.allocate(256 << 20).unwrap();
    let producer = {
        let _keep = KeepCurrent::new().unwrap();
        b.context().new_stream().unwrap()
    };
    long_work(&alloc, &producer, 2000, 0x44);
    let first = b.record_fence_on(&producer).unwrap();
    let FenceHandle::Counter(c1) = first.handle() else {
        unreachable!()
    };
    assert!(
        !first.is_complete().unwrap(),
        "the work still ran when the fence was recorded (else this test proves nothing)"
    );
    drop(first);
    assert!(
        matches!(b.record_fence(), Err(Error::FencesExhausted { limit: 1 })),
        "the slot was lent again before its value landed"
    );
    {
        let _keep = KeepCurrent::new().unwrap();
        producer.synchronize().unwrap();
    }
    let second = b.record_fence().unwrap();
    let FenceHandle::Counter(c2) = second.handle() else {
        unreachable!()
    };
    assert_eq!((c2.offset, c2.value), (c1.offset, c1.value + 1));
    second.synchronize().unwrap();
    drop(second);
    let _keep = KeepCurrent::new().unwrap();
    drop(producer);
}

/// Refusals that come before any driver call: pool memory past the backend's size limit,
/// allocated or opened (`Error::PoolTooLarge`: on the drivers measured a larger import
/// crashes its process inside the driver), and memory of a GPU this process does not see
/// (`Error::DeviceNotFound`, naming both devices). The opens are of handles as another
/// process of this boot would send them; no driver-level open is tried.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn pool_memory_past_the_size_limit_and_unknown_devices_are_refused_before_the_driver() {
    let _gpu = gpu_lock();
    const MIB: usize = 1 << 20;
    let b = CudaBackend::builder(0)
        .export(CudaExport::Pool)
        .pool_size_limit(4 << 20)
        .build()
        .unwrap();
    match b.allocate(5 * MIB) {
        Err(Error::PoolTooLarge { size, limit }) => {
            assert_eq!((size, limit), (5 << 20, 4 << 20));
        }
        other => panic!("a pool allocation past the limit: {other:?}"),
    }
    assert!(b.live().is_empty(), "nothing was allocated");
    let alloc = b.allocate(4 * MIB).expect("a pool allocation at the limit");
    let session = Session::new(SessionToken::from_bytes([9; 32]));
    let ours = alloc.handle(&session).build().unwrap();
    // As another process of this boot sends it.
    let from = |edit: &dyn Fn(&mut baton_messages::HandleMsg)| {
        let mut h = ours.clone();
        h.exporter.process.pid = h.exporter.process.pid.wrapping_add(1);
        edit(&mut h);
        h.sealed(session.handle_key())
    };
    let too_large = from(&|h| {
        h.alloc_size = 6 << 20;
        h.len = 6 << 20;
    });
    let opens = b.opens();
    match b.open_remote(&session.check(&too_large).unwrap(), None) {
        Err(Error::PoolTooLarge { size, limit }) => {
            assert_eq!((size, limit), (6 << 20, 4 << 20));
        }
        other => panic!("a pool handle past the limit: {:?}", other.err()),
    }
    let elsewhere = baton_messages::DeviceUuid([0xee; 16]);
    for kind in ["pool", "legacy"] {
        let unseen = from(&|h| {
            h.device = elsewhere;
            if kind == "legacy" {
                h.backend = BackendKind::CudaLegacy;
                h.raw = RawHandle::CudaIpc(baton_messages::CudaIpcMemHandle([1; 64]));
            }
        });
        match b.open_remote(&session.check(&unseen).unwrap(), None) {
            Err(e @ Error::DeviceNotFound { device, here }) => {
                assert_eq!((device, here), (elsewhere, b.device()));
                let said = e.to_string();
                assert!(
                    said.contains(&elsewhere.to_string()) && said.contains(&here.to_string()),
                    "{kind}: the error names both devices: {said}"
                );
            }
            other => panic!(
                "{kind}: memory of a device we do not see: {:?}",
                other.err()
            ),
        }
    }
    assert_eq!(b.opens(), opens, "no driver-level open was tried");
}

/// A copy plan's kernel on the memory of each export kind: a bundle-like allocation of the
/// kind copied into tensors of odd sizes at unaligned addresses (and twenty thousand small
/// ones, which exercise the kernel's search), then the tensors copied back into it, each
/// checked byte for byte; and what a plan refuses before any launch.
fn batched_copy_on(export: CudaExport) {
    let _gpu = gpu_lock();
    let b = gpu_backend(export, 2);
    let stream = Arc::clone(b.stream());
    let dst = b.allocate_as(CudaExport::Legacy, 8 << 20).unwrap();
    let base = device_ptr(&dst);
    for count in [1usize, 7, 20_000] {
        // Sizes 1.., spread over the destination at odd gaps; offsets 256-aligned, as a
        // bundle's are, and one unaligned.
        let sizes: Vec<u64> = (0..count as u64)
            .map(|i| (i * 37 + 1) % 300 + if count < 10 { 70_000 } else { 1 })
            .collect();
        let mut spans = Vec::new();
        let (mut at, mut offset) = (3u64, 0u64);
        for (i, &len) in sizes.iter().enumerate() {
            spans.push(CopySpan {
                ptr: base + at,
                offset: offset + (i == 1) as u64,
                len,
            });
            at += len + (i as u64 % 5);
            offset = (offset + 1 + len).div_ceil(256) * 256;
        }
        let src = b.allocate_as(export, offset as usize + 512).unwrap();
        let pattern: Vec<u8> = (0..src.size()).map(|i| (i * 31 + count) as u8).collect();
        src.write(0, &pattern).unwrap();
        dst.fill(0, 8 << 20, 0).unwrap();
        let plan = b.copy_plan(&spans).unwrap();
        assert!(
            plan.batched(),
            "the kernel loads (driver JIT of the shipped PTX)"
        );
        assert_eq!(plan.len(), count);
        // SAFETY: both allocations live until the stream is synchronised below.
        unsafe {
            plan.run(
                device_ptr(&src),
                src.size(),
                CopyDirection::FromBuffer,
                &stream,
            )
        }
        .unwrap();
        b.synchronize().unwrap();
        let mut got = vec![0u8; 8 << 20];
        dst.read(0, &mut got).unwrap();
        for (i, s) in spans.iter().enumerate() {
            let (p, o, n) = ((s.ptr - base) as usize, s.offset as usize, s.len as usize);
            assert_eq!(
                got[p..p + n],
                pattern[o..o + n],
                "{export:?}: tensor {i} of {count} loaded"
            );
        }
        // Back the other way: the tensors (now changed) into the buffer.
        let changed: Vec<u8> = got.iter().map(|v| v.wrapping_add(1)).collect();
        dst.write(0, &changed).unwrap();
        // SAFETY: as above.
        unsafe {
            plan.run(
                device_ptr(&src),
                src.size(),
                CopyDirection::IntoBuffer,
                &stream,
            )
        }
        .unwrap();
        b.synchronize().unwrap();
        let mut back = vec![0u8; src.size()];
        src.read(0, &mut back).unwrap();
        for (i, s) in spans.iter().enumerate() {
            let (p, o, n) = ((s.ptr - base) as usize, s.offset as usize, s.len as usize);
            assert_eq!(
                back[o..o + n],
                changed[p..p + n],
                "{export:?}: tensor {i} of {count} published"
            );
        }
        // Refused before any launch: a buffer shorter than the plan, one overlapping it.
        assert!(matches!(
            // SAFETY: refused before any driver call.
            unsafe {
                plan.run(
                    device_ptr(&src),
                    plan.end() as usize - 1,
                    CopyDirection::FromBuffer,
                    &stream,
                )
            },
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            // SAFETY: refused before any driver call.
            unsafe {
                plan.run(
                    base,
                    plan.end() as usize,
                    CopyDirection::FromBuffer,
                    &stream,
                )
            },
            Err(Error::CopyRefused { .. })
        ));
        drop(plan);
        src.free().unwrap();
    }
    batched_copy_of_parts_on(&b, export, &dst);
    // A pointer no allocation holds, and a span past its allocation's end.
    let host = [0u8; 64];
    for bad in [
        CopySpan {
            ptr: host.as_ptr() as u64,
            offset: 0,
            len: 64,
        },
        CopySpan {
            ptr: base + (8 << 20) - 10,
            offset: 0,
            len: 11,
        },
    ] {
        assert!(
            matches!(b.copy_plan(&[bad]), Err(Error::CopyRefused { .. })),
            "{bad:?} is refused"
        );
    }
    dst.free().unwrap();
    assert!(b.live().is_empty(), "nothing left: {:?}", b.live());
}

/// A plan of three parts (three allocations of the kind, a model lent one allocation per
/// segment): loaded into the tensors of `dst` in one launch, then run again with a part at
/// another address (the span table written again), then the other way.
fn batched_copy_of_parts_on(b: &CudaBackend, export: CudaExport, dst: &Allocation) {
    let stream = Arc::clone(b.stream());
    let base = device_ptr(dst);
    let sizes = [70_001u64, 3, 4096, 256, 65_537, 1, 100_000, 17, 9];
    let mut lists = vec![Vec::new(); 3];
    let mut offsets = [0u64; 3];
    let mut at = 11;
    for (i, &len) in sizes.iter().enumerate() {
        let part = i % 3;
        lists[part].push(CopySpan {
            ptr: base + at,
            offset: offsets[part],
            len,
        });
        offsets[part] = (offsets[part] + len).div_ceil(256) * 256;
        at += len + 5;
    }
    let parts: Vec<Allocation> = offsets
        .iter()
        .map(|&end| b.allocate_as(export, end as usize + 256).unwrap())
        .collect();
    let other = b.allocate_as(export, offsets[1] as usize + 256).unwrap();
    let largest = parts
        .iter()
        .chain([&other])
        .map(|m| m.size())
        .max()
        .unwrap();
    let patterns: Vec<Vec<u8>> = (0..4)
        .map(|k| (0..largest).map(|i| (i * 13 + k * 7 + 1) as u8).collect())
        .collect();
    for (k, m) in parts.iter().chain([&other]).enumerate() {
        m.write(0, &patterns[k][..m.size()]).unwrap();
    }
    let slices: Vec<&[CopySpan]> = lists.iter().map(Vec::as_slice).collect();
    let plan = b.copy_plan_parts(&slices).unwrap();
    assert_eq!(plan.len(), sizes.len());
    assert_eq!(plan.ends().len(), 3);
    let check_loaded = |which: [usize; 3], what: &str| {
        let mut got = vec![0u8; dst.size()];
        dst.read(0, &mut got).unwrap();
        for (part, list) in lists.iter().enumerate() {
            for s in list {
                let (p, o, n) = ((s.ptr - base) as usize, s.offset as usize, s.len as usize);
                assert_eq!(
                    got[p..p + n],
                    patterns[which[part]][o..o + n],
                    "{export:?}: {what}, a tensor of part {part}"
                );
            }
        }
    };
    // Twice on the same parts (the table written once), then with part 1 elsewhere.
    for (which, what) in [
        ([0, 1, 2], "loaded from three parts"),
        ([0, 1, 2], "loaded again"),
        ([0, 3, 2], "loaded with a part moved"),
    ] {
        let bufs: Vec<(u64, usize)> = which
            .iter()
            .map(|&k| {
                let m = if k == 3 { &other } else { &parts[k] };
                (device_ptr(m), m.size())
            })
            .collect();
        dst.fill(0, dst.size(), 0).unwrap();
        // SAFETY: every allocation lives until the stream is synchronised below.
        unsafe { plan.run_parts(&bufs, CopyDirection::FromBuffer, &stream) }.unwrap();
        b.synchronize().unwrap();
        check_loaded(which, what);
    }
    // The tensors back into the first three parts.
    let changed: Vec<u8> = (0..dst.size()).map(|i| (i * 3 + 5) as u8).collect();
    dst.write(0, &changed).unwrap();
    let bufs: Vec<(u64, usize)> = parts.iter().map(|m| (device_ptr(m), m.size())).collect();
    // SAFETY: as above.
    unsafe { plan.run_parts(&bufs, CopyDirection::IntoBuffer, &stream) }.unwrap();
    b.synchronize().unwrap();
    for (part, list) in lists.iter().enumerate() {
        let mut back = vec![0u8; parts[part].size()];
        parts[part].read(0, &mut back).unwrap();
        for s in list {
            let (p, o, n) = ((s.ptr - base) as usize, s.offset as usize, s.len as usize);
            assert_eq!(
                back[o..o + n],
                changed[p..p + n],
                "{export:?}: published into part {part}"
            );
        }
    }
    // Refused before any launch: two buffers for a plan of three.
    assert!(matches!(
        // SAFETY: refused before any driver call.
        unsafe { plan.run_parts(&bufs[..2], CopyDirection::FromBuffer, &stream) },
        Err(Error::CopyRefused { .. })
    ));
    drop(plan);
    for m in parts.into_iter().chain([other]) {
        m.free().unwrap();
    }
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn batched_copies_on_legacy_memory() {
    batched_copy_on(CudaExport::Legacy);
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn batched_copies_on_vmm_memory() {
    batched_copy_on(CudaExport::Vmm);
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn batched_copies_on_pool_memory() {
    batched_copy_on(CudaExport::Pool);
}
