//! Tests of the [`ImportCache`](super::ImportCache) through its front, with fake backends.

use super::state::MAX_PENDING_FENCES;
use super::*;
use crate::backend::{Allocation, Backend, ExportableMemory, MemPtr, OpenedMem, RawMemory};
use crate::ordering::StreamOrdering;
use crate::session::CheckedHandle;
use baton_messages::{
    CudaIpcMemHandle, DeviceUuid, Error as MessageError, FenceHandle, IpcEventHandle, RawHandle,
    SessionToken,
};
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Plain bytes standing in for device memory.
#[derive(Debug, Clone)]
struct Bytes(Arc<Mutex<Vec<u8>>>);

impl RawMemory for Bytes {
    fn size(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn ptr(&self) -> MemPtr {
        MemPtr::Device(0x1000)
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        dst.copy_from_slice(&self.0.lock().unwrap()[offset..offset + dst.len()]);
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.0.lock().unwrap()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }
    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.0.lock().unwrap()[offset..offset + len].fill(byte);
        Ok(())
    }
}

impl ExportableMemory for Bytes {
    fn free_while_mapped(&self) -> crate::FreeWhileMapped {
        crate::FreeWhileMapped::Unsafe
    }
    fn raw_handle(&self, _fd_slot: Option<u8>) -> Result<RawHandle> {
        Ok(RawHandle::CudaIpc(CudaIpcMemHandle([7; 64])))
    }
}

/// A backend shaped like CUDA legacy IPC (handles carry events) that counts its calls.
#[derive(Debug, Default)]
struct EventBackend {
    mem: Mutex<Option<Bytes>>,
    opens: AtomicU64,
    waits: AtomicU64,
    syncs: AtomicU64,
    fence_syncs: AtomicU64,
    /// Fences a close polled one by one.
    landed: AtomicUsize,
    /// Our own fences never land (work stuck past the backend's bound).
    stuck: AtomicBool,
    /// `release_dead` calls.
    released_dead: AtomicU64,
    forgotten: AtomicU64,
}

impl Backend for EventBackend {
    fn name(&self) -> &'static str {
        "fake-cuda"
    }
    fn kind(&self) -> BackendKind {
        BackendKind::CudaLegacy
    }
    fn device(&self) -> DeviceUuid {
        DeviceUuid([1; 16])
    }
    fn allocate(&self, size: usize) -> Result<Allocation> {
        let bytes = Bytes(Arc::new(Mutex::new(vec![0; size])));
        *self.mem.lock().unwrap() = Some(bytes.clone());
        Ok(Allocation::new(self.kind(), self.device(), Box::new(bytes)))
    }
    fn open(&self, handle: CheckedHandle<'_>, _fd: Option<OwnedFd>) -> Result<OpenedMem> {
        self.opens.fetch_add(1, Ordering::Relaxed);
        let bytes = self.mem.lock().unwrap().clone().expect("allocated");
        Ok(OpenedMem::new(&handle, Box::new(bytes)))
    }
    fn ordering(&self) -> &dyn StreamOrdering {
        self
    }
    fn forget_process(&self, _process: &ProcessId) {
        self.forgotten.fetch_add(1, Ordering::Relaxed);
    }
}

impl StreamOrdering for EventBackend {
    fn order_after(
        &self,
        stream: StreamRef<'_>,
        _producer: &ProcessId,
        _fence: &FenceHandle,
    ) -> Result<()> {
        assert!(matches!(stream, StreamRef::Internal));
        self.waits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        self.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn own_fences_landed(&self, fences: &[FenceHandle], all: bool) -> Result<bool> {
        if all {
            self.fence_syncs.fetch_add(1, Ordering::Relaxed);
        } else {
            self.landed.fetch_add(fences.len(), Ordering::Relaxed);
        }
        Ok(!self.stuck.load(Ordering::Relaxed))
    }
    fn release_dead(&self, _process: &ProcessId) {
        self.released_dead.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn events_are_waited_on_for_misses_and_hits_and_bad_handles_reach_no_backend() {
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
    let alloc = backend.allocate(4096).unwrap();
    alloc.fill(0, 4096, 0x42).unwrap();
    let event = IpcEventHandle([9; 64]);
    let handle = alloc.handle(&session).event(event).build().unwrap();
    let mut fds = FrameFds::none();

    // One corrupted byte of the raw handle: refused before any backend call.
    let mut bad = handle.clone();
    let RawHandle::CudaIpc(raw) = &mut bad.raw else {
        unreachable!()
    };
    raw.0[17] ^= 0x01;
    assert!(matches!(
        cache.open(&bad, &mut fds),
        Err(Error::Message(MessageError::DigestMismatch))
    ));
    // Sealed under another token: refused too.
    let other = Session::new(SessionToken::from_bytes([9; 32]));
    let foreign = alloc.handle(&other).build().unwrap();
    assert!(cache.open(&foreign, &mut fds).is_err());
    assert_eq!(backend.opens.load(Ordering::Relaxed), 0);
    assert_eq!(backend.waits.load(Ordering::Relaxed), 0);

    let first = cache.open(&handle, &mut fds).unwrap();
    let second = cache.open(&handle, &mut fds).unwrap();
    assert_eq!(first.to_vec().unwrap(), vec![0x42; 4096]);
    assert_eq!(
        backend.opens.load(Ordering::Relaxed),
        1,
        "the hit made no open"
    );
    assert_eq!(
        backend.waits.load(Ordering::Relaxed),
        2,
        "the event was waited on for the miss and for the hit"
    );
    let stats = cache.stats();
    assert_eq!((stats.opens, stats.hits, stats.live), (1, 1, 1));
    drop((first, second));
    assert_eq!(cache.stats().live, 0);

    // A handle without an event waits on nothing.
    let plain = alloc.handle(&session).build().unwrap();
    drop(cache.open(&plain, &mut fds).unwrap());
    assert_eq!(backend.waits.load(Ordering::Relaxed), 2);

    cache.forget_process(&session.process());
    assert_eq!(backend.forgotten.load(Ordering::Relaxed), 1);
}

/// `open_unordered` leaves ordering to the caller; a view released after a fence
/// keeps its mapping open until that fence's work is waited for (on the executor), and
/// an open of the same allocation that finds the close queued runs it first, then maps
/// anew: a mapping is never closed under a new user.
#[test]
fn closes_wait_for_release_fences_on_the_executor_and_reopens_never_overlap_them() {
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
    type Job = Box<dyn FnOnce() + Send>;
    let queued: Arc<Mutex<Vec<Job>>> = Arc::default();
    let q = Arc::clone(&queued);
    cache.set_executor(Arc::new(move |job| q.lock().unwrap().push(job)));
    let alloc = backend.allocate(4096).unwrap();
    let handle = alloc
        .handle(&session)
        .event(IpcEventHandle([9; 64]))
        .build()
        .unwrap();
    let mut fds = FrameFds::none();

    let view = cache.open_unordered(&handle, &mut fds).unwrap();
    assert_eq!(backend.waits.load(Ordering::Relaxed), 0, "nothing ordered");
    let release = FenceHandle::Event(IpcEventHandle([5; 64]));
    view.release_after(release);
    // The close is queued, not run: the mapping is still counted, nothing waited yet.
    assert_eq!(queued.lock().unwrap().len(), 1);
    assert_eq!((cache.stats().live, cache.stats().closes), (1, 1));
    assert_eq!(backend.waits.load(Ordering::Relaxed), 0);

    // An open of the same allocation runs the queued close itself (polling the
    // release fence first: no wait queued on a stream), then maps anew.
    let again = cache.open_unordered(&handle, &mut fds).unwrap();
    assert_eq!(
        backend.landed.load(Ordering::Relaxed),
        1,
        "the close waited"
    );
    assert_eq!(backend.waits.load(Ordering::Relaxed), 0);
    assert_eq!(backend.opens.load(Ordering::Relaxed), 2, "mapped anew");
    assert_eq!(cache.stats().live, 1);
    // The executor's turn comes later and finds nothing left to do.
    for job in queued.lock().unwrap().drain(..) {
        job();
    }
    assert_eq!(backend.landed.load(Ordering::Relaxed), 1);
    assert_eq!(cache.stats().live, 1, "the new mapping was not closed");
    drop(again);
    for job in queued.lock().unwrap().drain(..) {
        job();
    }
    assert_eq!(cache.stats().live, 0);
    // `open` orders the backend's own stream after the acquire fence.
    drop(cache.open(&handle, &mut fds).unwrap());
    assert_eq!(backend.waits.load(Ordering::Relaxed), 1);
}

/// A close whose own fences do not land within the backend's bound never unmaps under
/// that work: the mapping stays (its memory referenced), the exporter is not told it
/// was unmapped (the holder's callback does not run), and the key is free again — a
/// new open maps anew.
#[test]
fn a_close_whose_fences_do_not_land_keeps_the_mapping_and_tells_no_one() {
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    backend.stuck.store(true, Ordering::Relaxed);
    let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
    let alloc = backend.allocate(4096).unwrap();
    let handle = alloc.handle(&session).build().unwrap();
    let key = CacheKey::of(&handle);
    let refs = || Arc::strong_count(&backend.mem.lock().unwrap().as_ref().unwrap().0);
    let unmapped = refs();
    let mut fds = FrameFds::none();
    let view = cache.open_unordered(&handle, &mut fds).unwrap();
    assert_eq!(refs(), unmapped + 1, "mapped");
    assert!(cache.hold(&key, HolderId(1)));
    view.release_after(FenceHandle::Event(IpcEventHandle([5; 64])));
    let told = Arc::new(AtomicBool::new(false));
    let t = Arc::clone(&told);
    cache.unhold(
        &key,
        HolderId(1),
        Box::new(move || t.store(true, Ordering::Relaxed)),
    );
    assert_eq!(
        backend.landed.load(Ordering::Relaxed),
        1,
        "the close polled"
    );
    assert!(!told.load(Ordering::Relaxed), "the holder was not told");
    assert_eq!(refs(), unmapped + 1, "the mapping stays");
    assert_eq!(cache.stats().live, 0);
    let again = cache.open_unordered(&handle, &mut fds).unwrap();
    assert_eq!(backend.opens.load(Ordering::Relaxed), 2, "mapped anew");
    drop(again);
}

/// The release fences of views of a mapping kept warm by a holder: one per counter slot
/// (a later value of a slot replaces the earlier), and past `MAX_PENDING_FENCES` slots
/// none kept one by one: the close then waits for every fence the backend recorded.
#[test]
fn a_mappings_pending_fences_stay_few_however_many_views_released() {
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
    let alloc = backend.allocate(4096).unwrap();
    let handle = alloc.handle(&session).build().unwrap();
    let key = CacheKey::of(&handle);
    let holder = HolderId(1);
    let mut fds = FrameFds::none();
    let counter = |slot: u64, value: u64| {
        FenceHandle::Counter(baton_messages::CounterFence {
            slab: CudaIpcMemHandle([3; 64]),
            slab_id: 1,
            offset: slot * 8,
            value,
        })
    };
    let pending = |cache: &ImportCache| {
        let state = cache.shared.lock();
        let e = &state.entries[&key];
        (e.pending.len(), e.pending_all)
    };
    // A holder keeps the mapping warm between views.
    let first = cache.open_unordered(&handle, &mut fds).unwrap();
    assert!(cache.hold(&key, holder));
    drop(first);
    for value in 1..=100 {
        let view = cache.open_unordered(&handle, &mut fds).unwrap();
        view.release_after(counter(value % 3, value));
    }
    assert_eq!(pending(&cache), (3, false), "one fence per slot");
    for slot in 3..MAX_PENDING_FENCES as u64 {
        let view = cache.open_unordered(&handle, &mut fds).unwrap();
        view.release_after(counter(slot, 1));
    }
    assert_eq!(pending(&cache), (MAX_PENDING_FENCES, false));
    let view = cache.open_unordered(&handle, &mut fds).unwrap();
    view.release_after(counter(MAX_PENDING_FENCES as u64, 1));
    assert_eq!(pending(&cache), (0, true), "one slot more: wait for all");
    let view = cache.open_unordered(&handle, &mut fds).unwrap();
    view.release_after(counter(0, 1000));
    assert_eq!(pending(&cache), (0, true));
    cache.unhold(&key, holder, Box::new(|| {}));
    assert_eq!(cache.stats().live, 0, "closed once let go");
    assert_eq!(
        (
            backend.fence_syncs.load(Ordering::Relaxed),
            backend.landed.load(Ordering::Relaxed)
        ),
        (1, 0),
        "the close waited for every fence at once, none one by one"
    );
}

/// `open_if_mapped` answers only hits, and leaves a miss (or an open under way) to
/// `open_unordered`, doing nothing.
#[test]
fn open_if_mapped_opens_hits_only() {
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
    let alloc = backend.allocate(4096).unwrap();
    alloc.fill(0, 4096, 7).unwrap();
    let handle = alloc.handle(&session).build().unwrap();
    assert!(cache.open_if_mapped(&handle).is_none(), "a miss");
    assert_eq!(backend.opens.load(Ordering::Relaxed), 0);
    let first = cache
        .open_unordered(&handle, &mut FrameFds::none())
        .unwrap();
    let hit = cache.open_if_mapped(&handle).expect("a hit").unwrap();
    assert_eq!(hit.to_vec().unwrap(), vec![7; 4096]);
    assert_eq!(backend.opens.load(Ordering::Relaxed), 1, "no driver open");
    assert_eq!(cache.stats().hits, 1);
    // A handle sealed under another session is refused on a hit too.
    let other = Session::new(SessionToken::from_bytes([9; 32]));
    let foreign = alloc.handle(&other).build().unwrap();
    assert!(matches!(
        cache.open_if_mapped(&foreign),
        Some(Err(Error::Message(_)))
    ));
    drop((first, hit));
    assert_eq!(cache.stats().live, 0);
    assert!(
        cache.open_if_mapped(&handle).is_none(),
        "closed: a miss again"
    );
}

/// `open_all_if_ready` opens a frame's handles only if every one is a hit: a miss among
/// them keeps nothing open; a refused one ends the views, with its error last.
#[test]
fn open_all_if_ready_opens_all_hits_or_nothing() {
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
    let (a, b) = (
        backend.allocate(4096).unwrap(),
        backend.allocate(4096).unwrap(),
    );
    let (ha, hb) = (
        a.handle(&session).build().unwrap(),
        b.handle(&session).build().unwrap(),
    );
    let first = cache.open_unordered(&ha, &mut FrameFds::none()).unwrap();
    assert!(
        cache.open_all_if_ready([&ha, &hb]).is_none(),
        "b would miss"
    );
    drop(first);
    assert_eq!(
        cache.stats().live,
        0,
        "a's view of that attempt was let go too"
    );
    let first = cache.open_unordered(&ha, &mut FrameFds::none()).unwrap();
    let second = cache.open_unordered(&hb, &mut FrameFds::none()).unwrap();
    let views = cache.open_all_if_ready([&ha, &hb, &ha]).expect("all hits");
    assert_eq!(views.len(), 3);
    assert!(views.iter().all(Result::is_ok));
    assert_eq!(
        backend.opens.load(Ordering::Relaxed),
        3,
        "no driver open for a hit"
    );
    let foreign = a
        .handle(&Session::new(SessionToken::from_bytes([9; 32])))
        .build()
        .unwrap();
    let refused = cache
        .open_all_if_ready([&ha, &foreign, &hb])
        .expect("hits, one refused");
    assert_eq!(refused.len(), 2, "up to and with the refused one");
    assert!(matches!(refused[1], Err(Error::Message(_))));
    assert!(
        cache
            .open_all_if_ready([])
            .expect("nothing to open")
            .is_empty()
    );
    drop((first, second, views, refused));
    assert_eq!(cache.stats().live, 0);
}

fn counter() -> (Arc<AtomicU64>, OnClosed) {
    let n = Arc::new(AtomicU64::new(0));
    let m = Arc::clone(&n);
    (
        n,
        Box::new(move || {
            m.fetch_add(1, Ordering::Relaxed);
        }),
    )
}

#[test]
fn warm_mappings_stay_while_held_and_close_once_let_go_and_unused() {
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
    let alloc = backend.allocate(4096).unwrap();
    let handle = alloc.handle(&session).build().unwrap();
    let mut fds = FrameFds::none();
    let (h1, h2) = (HolderId(1), HolderId(2));

    // Held: the last view's drop leaves it warm; the next open is a hit.
    let view = cache.open(&handle, &mut fds).unwrap();
    let key = view.key();
    assert!(cache.hold(&key, h1));
    assert!(!cache.hold(&key, h1), "held once per holder");
    drop(view);
    let s = cache.stats();
    assert_eq!((s.live, s.warm, s.warm_bytes, s.closes), (1, 1, 4096, 0));
    let view = cache.open(&handle, &mut fds).unwrap();
    let s = cache.stats();
    assert_eq!((s.opens, s.hits, s.warm), (1, 1, 0));

    // Let go while a view is alive: closed (and told) only when the view drops.
    let (told, on_closed) = counter();
    cache.unhold(&key, h1, on_closed);
    assert_eq!(told.load(Ordering::Relaxed), 0);
    assert_eq!(cache.stats().live, 1);
    drop(view);
    assert_eq!(told.load(Ordering::Relaxed), 1);
    assert_eq!((cache.stats().live, cache.stats().closes), (0, 1));

    // Two holders: the first to let go is told at once; the last closes it.
    let view = cache.open(&handle, &mut fds).unwrap();
    cache.hold(&key, h1);
    cache.hold(&key, h2);
    drop(view);
    let (told1, f1) = counter();
    cache.unhold(&key, h1, f1);
    assert_eq!((told1.load(Ordering::Relaxed), cache.stats().live), (1, 1));
    let (told2, f2) = counter();
    cache.unhold(&key, h2, f2);
    assert_eq!((told2.load(Ordering::Relaxed), cache.stats().live), (1, 0));

    // A new hold supersedes one letting go: told at once, and the mapping stays.
    let view = cache.open(&handle, &mut fds).unwrap();
    cache.hold(&key, h1);
    let (told, f) = counter();
    cache.unhold(&key, h1, f);
    assert!(cache.hold(&key, h1));
    assert_eq!(told.load(Ordering::Relaxed), 1);
    drop(view);
    assert_eq!(cache.stats().warm, 1, "still held: warm, not closed");

    // A holder that goes away lets its idle mappings close.
    cache.drop_holder(h1);
    assert_eq!(cache.stats().live, 0);
    assert_eq!(backend.opens.load(Ordering::Relaxed), 3);

    // Letting go of what is not mapped tells at once.
    let (told, f) = counter();
    cache.unhold(&key, h1, f);
    assert_eq!(told.load(Ordering::Relaxed), 1);
}

#[test]
fn past_the_warm_budget_the_least_recently_used_mapping_is_handed_to_the_evictor() {
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    let budget = WarmBudget {
        max_entries: 1,
        max_bytes: 1 << 20,
    };
    let cache =
        ImportCache::with_budget(session.clone(), [backend.clone() as SharedBackend], budget);
    let asked = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&asked);
    cache.set_evictor(Arc::new(move |holder, key| {
        log.lock().unwrap().push((holder, key))
    }));
    let mut fds = FrameFds::none();
    let mut keys = Vec::new();
    for _ in 0..3 {
        let alloc = backend.allocate(4096).unwrap();
        let view = cache
            .open(&alloc.handle(&session).build().unwrap(), &mut fds)
            .unwrap();
        keys.push(view.key());
        cache.hold(&view.key(), HolderId(7));
        drop(view);
    }
    // Three warm, one allowed: the two oldest are asked for, once each.
    assert_eq!(
        *asked.lock().unwrap(),
        vec![(HolderId(7), keys[0]), (HolderId(7), keys[1])]
    );
    let s = cache.stats();
    assert_eq!(
        (s.warm, s.evictions),
        (3, 2),
        "warm until the holder lets go"
    );
    // The holder agrees (the exporter answered Unmap): they close.
    for key in &keys[..2] {
        let (told, f) = counter();
        cache.unhold(key, HolderId(7), f);
        assert_eq!(told.load(Ordering::Relaxed), 1);
    }
    let s = cache.stats();
    assert_eq!((s.live, s.warm), (1, 1));
}

/// The warm set's counts, its least-recently-warm order and its evictions, by bytes and
/// by entries; holders, accessors and the dead-process hook (written against the
/// mutants `bench/mutants.sh cache` left: docs/mutants/cache).
#[test]
fn the_warm_budget_counts_bytes_and_entries_and_evicts_the_least_recently_warm() {
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    let mut fds = FrameFds::none();
    let evicted = |cache: &ImportCache| {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&asked);
        cache.set_evictor(Arc::new(move |_, key| log.lock().unwrap().push(key)));
        asked
    };

    // By bytes: 8 KiB allowed. A and B (4 KiB each) warm in the order B, A; then C
    // (8 KiB): 16 KiB warm, so the two least recently warm go, B then A, in one call.
    let budget = WarmBudget {
        max_entries: 100,
        max_bytes: 8192,
    };
    let cache =
        ImportCache::with_budget(session.clone(), [backend.clone() as SharedBackend], budget);
    assert_eq!((cache.budget(), cache.backends().len()), (budget, 1));
    let asked = evicted(&cache);
    // (The test backend maps its latest allocation: each is opened before the next.)
    let (mut handles, mut views) = (Vec::new(), Vec::new());
    for size in [4096, 4096, 8192] {
        let alloc = backend.allocate(size).unwrap();
        let handle = alloc.handle(&session).build().unwrap();
        views.push(Some(cache.open(&handle, &mut fds).unwrap()));
        handles.push(handle);
    }
    let keys: Vec<CacheKey> = views.iter().flatten().map(Imported::key).collect();
    for key in &keys {
        assert!(cache.hold(key, HolderId(7)));
    }
    assert_eq!(cache.held_by(HolderId(7)), keys, "keys in order");
    for i in [1, 0] {
        drop(views[i].take());
    }
    let s = cache.stats();
    assert_eq!((s.warm, s.warm_bytes, s.evictions), (2, 8192, 0));
    drop(views[2].take());
    assert_eq!(*asked.lock().unwrap(), vec![keys[1], keys[0]]);
    // A hit takes its entry out of the warm set, bytes and all (C: 8 KiB).
    let hit = cache.open(&handles[2], &mut fds).unwrap();
    let s = cache.stats();
    assert_eq!((s.warm, s.warm_bytes), (2, 8192));
    drop(hit);

    // By entries: two allowed. A, B, C warm in that order: only A goes (each of its
    // two holders is asked).
    let budget = WarmBudget {
        max_entries: 2,
        max_bytes: 1 << 30,
    };
    let cache =
        ImportCache::with_budget(session.clone(), [backend.clone() as SharedBackend], budget);
    let asked = evicted(&cache);
    let mut keys = Vec::new();
    for _ in 0..3 {
        let alloc = backend.allocate(4096).unwrap();
        let view = cache
            .open(&alloc.handle(&session).build().unwrap(), &mut fds)
            .unwrap();
        keys.push(view.key());
        assert!(cache.hold(&view.key(), HolderId(1)));
        assert!(cache.hold(&view.key(), HolderId(2)));
    }
    assert_eq!(*asked.lock().unwrap(), vec![keys[0]; 2]);
    // One holder of two lets go of everything: the mappings stay for the other.
    let live = cache.stats().live;
    cache.drop_holder(HolderId(1));
    assert_eq!(cache.stats().live, live);
    assert_eq!(cache.held_by(HolderId(1)), Vec::new());

    // A death reaches every backend.
    cache.release_dead(&session.process());
    assert_eq!(backend.released_dead.load(Ordering::Relaxed), 1);
}

/// What the counters, the views and the generations promise, case by case (written
/// against the mutants `cargo mutants --file ipc/src/cache.rs` found unchecked).
#[test]
fn views_counters_and_generations_each_do_their_part() {
    use baton_messages::{DType, Layout, Shape};
    let session = Session::new(SessionToken::from_bytes([8; 32]));
    let backend = Arc::new(EventBackend::default());
    let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
    let alloc = backend.allocate(4096).unwrap();
    let mut fds = FrameFds::none();
    let layout = Layout::new(DType::F32, Shape::new([4, 8]).unwrap());
    let typed = alloc
        .handle(&session)
        .range(1024, 128)
        .layout(layout.clone())
        .build()
        .unwrap();
    let whole = alloc.handle(&session).build().unwrap();

    // Views: their own range, layout, and writes that land in the shared memory.
    let view = cache.open(&typed, &mut fds).unwrap();
    assert_eq!((view.len(), view.is_empty()), (128, false));
    assert_eq!(view.layout(), Some(&layout));
    view.write(4, b"abcd").unwrap();
    let mut back = [0u8; 4];
    alloc.read(1024 + 4, &mut back).unwrap();
    assert_eq!(&back, b"abcd", "a view's write lands at its offset");
    assert!(view.write(126, b"abcd").is_err(), "a write past the view");
    assert!(format!("{view:?}").contains("alloc"));

    // A hit whose handle claims no more than the mapping is served; one that claims
    // more is refused; the refused one takes no reference.
    let hit = cache.open(&whole, &mut fds).unwrap();
    let mut bigger = whole.clone();
    bigger.alloc_size = 8192;
    bigger.len = 8192;
    let bigger = bigger.sealed(session.handle_key());
    assert!(matches!(
        cache.open(&bigger, &mut fds),
        Err(Error::MemoryTooSmall {
            claimed: 8192,
            actual: 4096
        })
    ));
    let stats = cache.stats();
    assert_eq!((stats.opens, stats.hits, stats.live), (1, 1, 1));
    assert!(format!("{cache:?}").contains("hits: 1"));

    // The mapping lives until its last view drops, whichever goes first.
    drop(view);
    assert_eq!(cache.stats().live, 1);
    assert_eq!(hit.to_vec().unwrap()[1028..1032], *b"abcd");
    drop(hit);
    let stats = cache.stats();
    assert_eq!((stats.live, stats.closes), (0, 1));

    // Generations: once a newer generation of the allocation is mapped (the exporter
    // reused it), the older handle is stale (and counted), with no backend call.
    let mut alloc = alloc;
    let newer = alloc.renew();
    let fresh = cache
        .open(&alloc.handle(&session).build().unwrap(), &mut fds)
        .unwrap();
    assert_eq!(fresh.generation(), newer);
    let opens = backend.opens.load(Ordering::Relaxed);
    assert!(matches!(
        cache.open(&whole, &mut fds),
        Err(Error::StaleHandle { current, .. }) if current == newer
    ));
    assert_eq!(cache.stats().stale, 1);
    assert_eq!(backend.opens.load(Ordering::Relaxed), opens);
    drop(fresh);
}

/// A view writes in place only while it is its mapping's only one, and no other view
/// of the mapping is opened until it drops.
#[test]
fn a_mapping_is_written_in_place_only_through_its_only_view() {
    let ns = format!("unit-inplace-{}", std::process::id());
    let session = Session::new(SessionToken::from_bytes([9; 32]));
    let backend = Arc::new(crate::HostBackend::with_namespace(&ns).unwrap());
    let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
    let alloc = backend.allocate(4096).unwrap();
    let handle = alloc.handle(&session).range(1024, 16).build().unwrap();
    let mut fds = FrameFds::none();

    // Two views: neither writes in place.
    let mut first = cache.open(&handle, &mut fds).unwrap();
    let second = cache.open(&handle, &mut fds).unwrap();
    assert!(matches!(
        first.host_bytes_mut(),
        Err(Error::SharedMapping { views: 2, .. })
    ));
    drop(second);

    // The only view writes its own range of the shared memory.
    first
        .host_bytes_mut()
        .unwrap()
        .unwrap()
        .copy_from_slice(&[7; 16]);
    let mut back = [0u8; 18];
    alloc.read(1023, &mut back).unwrap();
    assert_eq!(back[0], 0, "nothing before the view's range");
    assert_eq!(&back[1..17], &[7; 16]);
    assert_eq!(back[17], 0, "nothing after it");

    // Until it drops, no other view of the mapping is opened.
    assert!(matches!(
        cache.open(&handle, &mut fds),
        Err(Error::WrittenInPlace { .. })
    ));
    drop(first);
    let again = cache.open(&handle, &mut fds).unwrap();
    assert_eq!(again.host_bytes(), Some(&[7u8; 16][..]));
}
