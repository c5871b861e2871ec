//! [`ImportCache`]: each exported allocation is mapped once per process, shared, and kept
//! warm for reuse.
//!
//! Keyed by (exporter, allocation). A hit makes no driver or `mmap` call. A mapping's
//! life:
//!
//! - **In use** while [`Imported`] views of it exist (one per lease).
//! - **Warm** when its last view drops but a *holder* (a link that received the
//!   allocation: [`hold`](ImportCache::hold)) keeps it: it stays mapped, so the next offer
//!   of the same buffer is a hit. Warm mappings are bounded by a [`WarmBudget`] (entries and
//!   bytes): past it, the least recently used warm mapping is handed to the *evictor*
//!   ([`set_evictor`](ImportCache::set_evictor)), which asks the exporter to let it go; the
//!   exporter answers `Unmap`, and the holder lets go with
//!   [`unhold`](ImportCache::unhold).
//! - **Closed** when it has neither views nor holders: at once if idle, else when its last
//!   view drops. [`unhold`](ImportCache::unhold)'s callback runs once the close is done,
//!   so the link can tell the exporter `Unmapped` only once nothing here maps the
//!   allocation any more.
//!
//! A mapping opened without a holder (the low-level API: `open`, use, drop) closes with
//! its last view, as before warm mappings existed.
//!
//! **No lock across a driver call.** Opens and closes run with the cache's lock released;
//! the key is marked *opening* or *closing* meanwhile, and an open of a key that is being
//! closed waits for that close to finish (running it itself if it has not started), so a
//! mapping is never closed while the same allocation is being reopened (CUDA returns the
//! same address for a second open of a handle in one process, and an unlucky interleaving
//! would otherwise close the new user's mapping). Closes run on the cache's executor
//! ([`set_executor`](ImportCache::set_executor): the actor layer's driver thread; inline by
//! default), after every release fence of the views that used the mapping has completed
//! ([`Imported::release_after`]): queued work never outlives its mapping. Callbacks run
//! after the close, with no lock held.
//!
//! **Ordering.** [`open`](ImportCache::open) orders the backend's own stream after the
//! handle's acquire fence, for callers that read through the view's copies;
//! [`open_unordered`](ImportCache::open_unordered) leaves that to the caller, who makes each
//! stream it uses wait on the fence (the actor layer's `Lease` does, once per stream).
//!
//! Generations: an exporter that reuses an allocation for a new buffer gives it the next
//! generation. A handle older than the generation this process maps is refused as
//! [`Error::StaleHandle`], without touching a driver.
//!
//! # Safety
//!
//! One `unsafe` block, in [`Imported::host_bytes_mut`]: it calls the backend's
//! `RawMemory::host_bytes_mut`, whose contract (nothing else in this process reaches the
//! bytes while the `&mut [u8]` lives) only the cache can keep, because only the cache
//! knows how many views of a mapping exist. It hands the slice out for a mapping's only
//! view, borrowed `&mut`, and opens no other view of that mapping until that view drops.

use crate::backend::{MemPtr, OpenedMem, SharedBackend};
use crate::link::FrameFds;
use crate::ordering::StreamRef;
use crate::session::Session;
use crate::{Error, Result};
use baton_messages::{
    AllocationId, BackendKind, ExporterId, FenceHandle, Generation, HandleMsg, Layout, ProcessId,
};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long an open waits for another thread's open or close of the same allocation.
const BUSY_DEADLINE: Duration = Duration::from_secs(60);

/// Which mapping: an allocation of an exporter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheKey {
    /// The exporting process and actor.
    pub exporter: ExporterId,
    /// The allocation (unique in the exporting process).
    pub alloc: AllocationId,
}

impl CacheKey {
    /// The key of the mapping a handle names.
    pub fn of(handle: &HandleMsg) -> Self {
        Self {
            exporter: handle.exporter,
            alloc: handle.alloc,
        }
    }
}

/// Who keeps a mapping warm: an opaque id chosen by the caller (the actor layer uses its
/// link ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HolderId(pub u64);

/// How many mappings the cache keeps warm (mapped with no view of them alive).
///
/// A warm mapping pins nothing the exporter has not allocated anyway, and the exporter can
/// reclaim it at any time (it sends `Unmap`); the budget bounds what one importer keeps
/// mapped: address space, descriptors and driver objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmBudget {
    /// At most this many warm mappings (default 1024).
    pub max_entries: usize,
    /// At most this many bytes of warm mappings (default 16 GiB).
    pub max_bytes: u64,
}

impl Default for WarmBudget {
    fn default() -> Self {
        Self {
            max_entries: 1024,
            max_bytes: 16 << 30,
        }
    }
}

/// Counters of an [`ImportCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Opens served from a live or warm mapping (no driver call).
    pub hits: u64,
    /// Opens that mapped memory (one driver-level open or `mmap` each).
    pub opens: u64,
    /// Mappings closed (or being closed).
    pub closes: u64,
    /// Handles refused as stale.
    pub stale: u64,
    /// Warm mappings handed to the evictor because the budget was exceeded.
    pub evictions: u64,
    /// Mappings open now (in use, warm, or being closed).
    pub live: usize,
    /// Of those, warm: mapped with no view alive.
    pub warm: usize,
    /// Bytes of the warm mappings.
    pub warm_bytes: u64,
}

/// Called when a mapping closes (see [`ImportCache::unhold`]).
pub type OnClosed = Box<dyn FnOnce() + Send>;

/// Asked to evict a warm mapping for a holder (see [`ImportCache::set_evictor`]).
pub type Evictor = Arc<dyn Fn(HolderId, CacheKey) + Send + Sync>;

/// Runs blocking work (mapping closes) somewhere (see [`ImportCache::set_executor`]).
pub type Executor = Arc<dyn Fn(Box<dyn FnOnce() + Send>) + Send + Sync>;

struct Entry {
    mem: Arc<OpenedMem>,
    backend: SharedBackend,
    users: usize,
    holders: Vec<HolderId>,
    /// The newest generation of the allocation seen.
    generation: Generation,
    /// The last handle whose digest verified for this mapping. A handle equal to it, byte
    /// for byte, would verify the same way: a hit with it skips the keyed hash (the
    /// common case: an exporter re-sharing the same buffer).
    verified: HandleMsg,
    /// When it went warm (the cache's clock), for least-recently-used eviction.
    warm_since: Option<u64>,
    /// Handed to the evictor already.
    evicting: bool,
    /// Its only view handed out a `&mut` of the mapping ([`Imported::host_bytes_mut`]):
    /// no other view is opened until that view drops.
    written_in_place: bool,
    /// Run when it closes (holders that let go while views were alive).
    on_closed: Vec<OnClosed>,
    /// Release fences (this process's) of views that queued work on the mapping: the close
    /// waits for them. One per event or counter slot ([`FenceHandle::covers`]): a pooled
    /// fence is recorded again only once its work completed, so waiting on its latest
    /// record covers every earlier one. At most [`MAX_PENDING_FENCES`]; past that,
    /// `pending_all` instead.
    pending: Vec<FenceHandle>,
    /// Too many distinct fences to keep (a mapping warm for long, used on many streams or
    /// slots): the close waits for every fence the backend has recorded
    /// ([`StreamOrdering::own_fences_landed`](crate::StreamOrdering::own_fences_landed) with `all`).
    pending_all: bool,
}

/// The most release fences a mapping keeps for its close to wait on, one by one.
const MAX_PENDING_FENCES: usize = 32;

impl Entry {
    fn bytes(&self) -> u64 {
        self.mem.size() as u64
    }
}

/// A close that has not run yet: taken by whoever runs it first (the executor, or an open
/// of the same key that must not wait behind it).
type CloseCell = Arc<Mutex<Option<CloseJob>>>;

enum Busy {
    /// A thread is opening the key with no lock held.
    Opening,
    /// The key's mapping is being closed.
    Closing(CloseCell),
}

#[derive(Default)]
struct State {
    entries: HashMap<CacheKey, Entry>,
    busy: HashMap<CacheKey, Busy>,
    clock: u64,
    stats: CacheStats,
}

/// Everything a close needs, run with no lock held.
struct CloseJob {
    key: CacheKey,
    mem: Arc<OpenedMem>,
    backend: SharedBackend,
    pending: Vec<FenceHandle>,
    pending_all: bool,
    callbacks: Vec<OnClosed>,
}

impl CloseJob {
    fn run(self, shared: &Shared) {
        let CloseJob {
            key,
            mem,
            backend,
            pending,
            pending_all,
            callbacks,
        } = self;
        if pending_all || !pending.is_empty() {
            // Work this process queued on the mapping runs before it goes: polled here,
            // never a wait queued on a stream (see `StreamOrdering::own_fences_landed`).
            match backend.ordering().own_fences_landed(&pending, pending_all) {
                Ok(true) => {}
                Ok(false) => {
                    // Closing under work that may still run is never safe: the mapping
                    // stays open, and the exporter is not told it was unmapped (its ledger
                    // holds the memory until this process exits).
                    tracing::error!(alloc = %key.alloc, "work this process queued on a mapping did not complete within the backend's bound: the mapping stays open until the process exits");
                    std::mem::forget(mem);
                    let mut state = shared.lock();
                    if matches!(state.busy.get(&key), Some(Busy::Closing(_))) {
                        state.busy.remove(&key);
                    }
                    drop(state);
                    shared.changed.notify_all();
                    return;
                }
                Err(e) => {
                    tracing::warn!(alloc = %key.alloc, error = %e, "waiting for the work on a mapping before closing it failed");
                }
            }
        }
        // The cache and the views hold the only references (views hand out
        // `&OpenedMem`, never the `Arc`), and no view is left, so this is the last one.
        match Arc::try_unwrap(mem) {
            Ok(mem) => {
                if let Err(e) = mem.close() {
                    tracing::warn!(alloc = %key.alloc, error = %e, "closing an imported mapping failed");
                }
            }
            Err(_) => tracing::error!(alloc = %key.alloc, "a closed mapping still had a reference"),
        }
        tracing::debug!(exporter = %key.exporter, alloc = %key.alloc, "unmapped");
        {
            let mut state = shared.lock();
            if matches!(state.busy.get(&key), Some(Busy::Closing(_))) {
                state.busy.remove(&key);
            }
        }
        shared.changed.notify_all();
        run(callbacks);
    }
}

/// A close to hand to the executor once the lock is released.
struct Closing(CloseCell);

impl State {
    /// A hit on `key`'s entry (present): refuses a stale generation or a handle that claims
    /// more than the mapping holds, else counts one more user. `checked`: the handle was
    /// checked just now (it becomes the entry's verified one).
    fn hit(
        &mut self,
        key: &CacheKey,
        handle: &HandleMsg,
        checked: bool,
    ) -> Result<(Arc<OpenedMem>, SharedBackend)> {
        let entry = self.entries.get_mut(key).expect("a hit on a present entry");
        if entry.written_in_place {
            return Err(Error::WrittenInPlace {
                alloc: handle.alloc,
            });
        }
        if handle.generation < entry.generation {
            let current = entry.generation;
            self.stats.stale += 1;
            return Err(Error::StaleHandle {
                alloc: handle.alloc,
                generation: handle.generation,
                current,
            });
        }
        // A hit maps nothing new, but this handle may claim more than the mapping holds (a
        // confused or lying exporter): its view must stay inside it, as a miss checks
        // against the memory it opens.
        if (entry.mem.size() as u64) < handle.alloc_size {
            return Err(Error::MemoryTooSmall {
                claimed: handle.alloc_size,
                actual: entry.mem.size() as u64,
            });
        }
        entry.generation = handle.generation;
        entry.users += 1;
        if checked {
            entry.verified = handle.clone();
        }
        let found = (Arc::clone(&entry.mem), Arc::clone(&entry.backend));
        self.touch(key);
        self.stats.hits += 1;
        Ok(found)
    }

    /// Marks an entry in use (leaving the warm set if it was there).
    fn touch(&mut self, key: &CacheKey) {
        let Some(entry) = self.entries.get_mut(key) else {
            return;
        };
        if entry.warm_since.take().is_some() {
            self.stats.warm -= 1;
            self.stats.warm_bytes -= entry.bytes();
        }
    }

    /// Starts closing an entry that has neither views nor holders: removes it and marks the
    /// key closing. `more` run after its own callbacks, once it is closed.
    fn close(&mut self, key: &CacheKey, more: Vec<OnClosed>) -> Option<Closing> {
        self.touch(key);
        let entry = self.entries.remove(key)?;
        debug_assert!(entry.users == 0 && entry.holders.is_empty());
        self.stats.closes += 1;
        let mut callbacks = entry.on_closed;
        callbacks.extend(more);
        let cell: CloseCell = Arc::new(Mutex::new(Some(CloseJob {
            key: *key,
            mem: entry.mem,
            backend: entry.backend,
            pending: entry.pending,
            pending_all: entry.pending_all,
            callbacks,
        })));
        self.busy.insert(*key, Busy::Closing(Arc::clone(&cell)));
        Some(Closing(cell))
    }

    /// Warm entries over `budget`, least recently used first, marked as evicting. Those
    /// already handed to the evictor are on their way out and do not count.
    fn over_budget(&mut self, budget: &WarmBudget) -> Vec<(Vec<HolderId>, CacheKey)> {
        if self.stats.warm <= budget.max_entries && self.stats.warm_bytes <= budget.max_bytes {
            return Vec::new();
        }
        let mut warm: Vec<(u64, CacheKey, u64)> = self
            .entries
            .iter()
            .filter_map(|(k, e)| {
                e.warm_since
                    .filter(|_| !e.evicting)
                    .map(|t| (t, *k, e.bytes()))
            })
            .collect();
        let (mut count, mut bytes) = (warm.len(), warm.iter().map(|w| w.2).sum::<u64>());
        warm.sort();
        let mut out = Vec::new();
        for (_, key, size) in warm {
            if count <= budget.max_entries && bytes <= budget.max_bytes {
                break;
            }
            let entry = self.entries.get_mut(&key).expect("listed");
            entry.evicting = true;
            count -= 1;
            bytes -= size;
            self.stats.evictions += 1;
            out.push((entry.holders.clone(), key));
        }
        out
    }
}

struct Shared {
    session: Session,
    backends: Vec<SharedBackend>,
    budget: WarmBudget,
    evictor: Mutex<Option<Evictor>>,
    executor: Mutex<Option<Executor>>,
    state: Mutex<State>,
    /// Notified when a key stops being busy.
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the maps consistent (every mutation is a
        // single insert/remove), so a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the evictor for what `over_budget` returned (outside the state lock).
    fn evict(&self, victims: Vec<(Vec<HolderId>, CacheKey)>) {
        if victims.is_empty() {
            return;
        }
        let evictor = self
            .evictor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(evictor) = evictor else {
            return;
        };
        for (holders, key) in victims {
            tracing::debug!(exporter = %key.exporter, alloc = %key.alloc, "warm budget exceeded: asking to unmap");
            for holder in holders {
                evictor(holder, key);
            }
        }
    }

    /// Hands a close to the executor (outside the state lock).
    fn dispatch(self: &Arc<Self>, closing: Option<Closing>) {
        let Some(Closing(cell)) = closing else {
            return;
        };
        let executor = self
            .executor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let shared = Arc::clone(self);
        let job = move || {
            let job = cell.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(job) = job {
                job.run(&shared);
            }
        };
        match executor {
            Some(executor) => executor(Box::new(job)),
            None => job(),
        }
    }

    /// Waits until no other thread opens or closes `key`; returns with the lock held. A
    /// close queued but not started is run here, so an open on the executor's own thread
    /// never waits for work queued behind it.
    fn settled(&self, key: &CacheKey) -> Result<MutexGuard<'_, State>> {
        let start = Instant::now();
        let mut state = self.lock();
        loop {
            let cell = match state.busy.get(key) {
                None => return Ok(state),
                Some(Busy::Closing(cell)) => Some(Arc::clone(cell)),
                Some(Busy::Opening) => None,
            };
            if let Some(cell) = cell {
                drop(state);
                let job = cell.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(job) = job {
                    job.run(self);
                }
                state = self.lock();
                if !matches!(state.busy.get(key), Some(Busy::Closing(c)) if Arc::ptr_eq(c, &cell)) {
                    continue;
                }
            }
            let left = BUSY_DEADLINE.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(Error::Timeout {
                    op: "waiting for another open or close of the same allocation",
                    after: BUSY_DEADLINE,
                });
            }
            state = self
                .changed
                .wait_timeout(state, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Removes a key's `Opening` mark when the open ends, also by unwinding.
struct OpeningMark<'a> {
    shared: &'a Shared,
    key: CacheKey,
}

impl Drop for OpeningMark<'_> {
    fn drop(&mut self) {
        {
            let mut state = self.shared.lock();
            if matches!(state.busy.get(&self.key), Some(Busy::Opening)) {
                state.busy.remove(&self.key);
            }
        }
        self.shared.changed.notify_all();
    }
}

fn run(callbacks: Vec<OnClosed>) {
    for f in callbacks {
        f();
    }
}

/// The per-process import cache. Cheap to clone (shared).
#[derive(Clone)]
pub struct ImportCache {
    shared: Arc<Shared>,
}

impl fmt::Debug for ImportCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImportCache")
            .field("stats", &self.stats())
            .finish()
    }
}

impl ImportCache {
    /// A cache that opens handles with the first of `backends` that takes their kind, with
    /// the default [`WarmBudget`].
    pub fn new(session: Session, backends: impl IntoIterator<Item = SharedBackend>) -> Self {
        Self::with_budget(session, backends, WarmBudget::default())
    }

    /// A cache with its own budget of warm mappings.
    pub fn with_budget(
        session: Session,
        backends: impl IntoIterator<Item = SharedBackend>,
        budget: WarmBudget,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                session,
                backends: backends.into_iter().collect(),
                budget,
                evictor: Mutex::new(None),
                executor: Mutex::new(None),
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
        }
    }

    /// The session whose key checks handles.
    pub fn session(&self) -> &Session {
        &self.shared.session
    }

    /// The budget of warm mappings.
    pub fn budget(&self) -> WarmBudget {
        self.shared.budget
    }

    /// The backends handles are opened with.
    pub fn backends(&self) -> &[SharedBackend] {
        &self.shared.backends
    }

    /// Sets who is asked to evict a warm mapping past the budget: called once per holder of
    /// the mapping, outside the cache's lock. It should ask the exporter to let the holder
    /// go and call [`unhold`](Self::unhold) when it agrees.
    pub fn set_evictor(&self, evictor: Evictor) {
        *self
            .shared
            .evictor
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(evictor);
    }

    /// Sets where mapping closes run (driver calls that may block, and waits for the work
    /// queued on a mapping): a driver thread, for callers that must not block. Inline, on
    /// the thread that let the mapping go, by default.
    pub fn set_executor(&self, executor: Executor) {
        *self
            .shared
            .executor
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(executor);
    }

    /// Opens the buffer a handle names ([`open_unordered`](Self::open_unordered)), then, if
    /// the handle carries an acquire fence, orders the backend's own stream after it
    /// ([`StreamOrdering::order_after`](crate::StreamOrdering::order_after) on
    /// [`StreamRef::Internal`]), so that the view's copies (`read`, `write`, `to_vec`) see
    /// the exporter's finished work — on a miss and on a hit.
    ///
    /// # Errors
    /// As [`open_unordered`](Self::open_unordered); a backend error waiting on the fence.
    pub fn open(&self, handle: &HandleMsg, fds: &mut FrameFds) -> Result<Imported> {
        let imported = self.open_unordered(handle, fds)?;
        if let Some(fence) = &handle.fence {
            // On a hit too: this handle's data may come from newer work on the same memory.
            // On error `imported` drops, giving its reference back.
            imported.backend.ordering().order_after(
                StreamRef::Internal,
                &handle.exporter.process,
                fence,
            )?;
        }
        Ok(imported)
    }

    /// Opens the buffer a handle names: checks the handle (digest, consistency, boot),
    /// refuses stale generations, then maps the allocation (no lock held during the driver
    /// call) or reuses its live or warm mapping. Orders nothing: the caller makes every
    /// stream it uses the buffer on wait on the handle's fence first.
    /// `fds` are the descriptors that came with the handle's frame; one not needed (a hit)
    /// is left for the frame to close.
    ///
    /// # Errors
    /// A check error, [`Error::StaleHandle`], [`Error::UnsupportedBackend`],
    /// [`Error::MissingFdSlot`], [`Error::NotMapped`] (a miss for a handle that carries no
    /// descriptor), [`Error::MemoryTooSmall`] (also on a hit, when the handle claims more
    /// than the live mapping holds), [`Error::Timeout`] (another open or close of the same
    /// allocation hangs), or the backend's open error. Nothing is opened on error.
    pub fn open_unordered(&self, handle: &HandleMsg, fds: &mut FrameFds) -> Result<Imported> {
        let key = CacheKey::of(handle);
        let known = self
            .shared
            .lock()
            .entries
            .get(&key)
            .is_some_and(|e| e.verified == *handle);
        let mut checked = if known {
            None
        } else {
            Some(self.shared.session.check(handle)?)
        };
        let mut state = self.shared.settled(&key)?;
        let (mem, backend) = if state.entries.contains_key(&key) {
            state.hit(&key, handle, checked.is_some())?
        } else {
            // The entry seen a moment ago may have closed since: check now if we skipped.
            let checked = match checked.take() {
                Some(c) => c,
                None => self.shared.session.check(handle)?,
            };
            let backend = Arc::clone(self.backend_for(handle.backend)?);
            let fd = match handle.raw.fd_slot() {
                Some(slot) => Some(fds.take(slot)?),
                None => None,
            };
            state.busy.insert(key, Busy::Opening);
            drop(state);
            let mark = OpeningMark {
                shared: &self.shared,
                key,
            };
            let opened = backend.open(checked, fd)?;
            if (opened.size() as u64) < handle.alloc_size {
                let actual = opened.size() as u64;
                if let Err(e) = opened.close() {
                    tracing::warn!(alloc = %handle.alloc, error = %e, "closing a mapping smaller than claimed failed");
                }
                return Err(Error::MemoryTooSmall {
                    claimed: handle.alloc_size,
                    actual,
                });
            }
            let mem = Arc::new(opened);
            {
                let mut state = self.shared.lock();
                state.entries.insert(
                    key,
                    Entry {
                        mem: Arc::clone(&mem),
                        backend: Arc::clone(&backend),
                        users: 1,
                        holders: Vec::new(),
                        generation: handle.generation,
                        verified: handle.clone(),
                        warm_since: None,
                        evicting: false,
                        written_in_place: false,
                        on_closed: Vec::new(),
                        pending: Vec::new(),
                        pending_all: false,
                    },
                );
                state.stats.opens += 1;
            }
            // Unmarked (and waiters woken) only now that the entry is in place.
            drop(mark);
            tracing::debug!(exporter = %handle.exporter, alloc = %handle.alloc, gen = %handle.generation, "mapped");
            state = self.shared.lock();
            (mem, backend)
        };
        drop(state);
        Ok(self.imported(key, handle, mem, backend))
    }

    /// As [`open_unordered`](Self::open_unordered), only if that is a hit: the allocation is
    /// mapped (live or warm) and no open or close of it is under way. A hit makes no
    /// driver call and never waits, so this may run on a thread that must not block (an
    /// actor's). `None` if it would be a miss or would wait: nothing was done, open with
    /// [`open_unordered`](Self::open_unordered) where blocking is allowed.
    ///
    /// # Errors
    /// As [`open_unordered`](Self::open_unordered) on a hit (a check error,
    /// [`Error::StaleHandle`], [`Error::MemoryTooSmall`]).
    pub fn open_if_mapped(&self, handle: &HandleMsg) -> Option<Result<Imported>> {
        let key = CacheKey::of(handle);
        let known = {
            let state = self.shared.lock();
            if state.busy.contains_key(&key) {
                return None;
            }
            state.entries.get(&key)?.verified == *handle
        };
        // Checked with no lock held, as a miss is.
        let checked = !known;
        if checked {
            if let Err(e) = self.shared.session.check(handle) {
                return Some(Err(e));
            }
        }
        let mut state = self.shared.lock();
        if state.busy.contains_key(&key) || !state.entries.contains_key(&key) {
            return None;
        }
        let found = state.hit(&key, handle, checked);
        drop(state);
        Some(found.map(|(mem, backend)| self.imported(key, handle, mem, backend)))
    }

    fn imported(
        &self,
        key: CacheKey,
        handle: &HandleMsg,
        mem: Arc<OpenedMem>,
        backend: SharedBackend,
    ) -> Imported {
        Imported {
            cache: Arc::clone(&self.shared),
            key,
            generation: handle.generation,
            mem: Some(mem),
            backend,
            offset: handle.offset as usize,
            len: handle.len as usize,
            layout: handle.layout.clone(),
            release: None,
            written_in_place: false,
        }
    }

    fn backend_for(&self, kind: BackendKind) -> Result<&SharedBackend> {
        self.shared
            .backends
            .iter()
            .find(|b| b.can_open(kind))
            .ok_or(Error::UnsupportedBackend { kind })
    }

    /// `holder` keeps the mapping of `key` warm from now on. Returns whether it did not
    /// already. If holders had let go and the mapping was waiting for its views to close,
    /// it stays open and their callbacks run now: this hold supersedes theirs.
    pub fn hold(&self, key: &CacheKey, holder: HolderId) -> bool {
        let (new, superseded) = {
            let mut state = self.shared.lock();
            let Some(entry) = state.entries.get_mut(key) else {
                return false;
            };
            if entry.holders.contains(&holder) {
                (false, Vec::new())
            } else {
                entry.holders.push(holder);
                entry.evicting = false;
                (true, std::mem::take(&mut entry.on_closed))
            }
        };
        run(superseded);
        new
    }

    /// `holder` lets the mapping of `key` go. `on_closed` runs once nothing of this holder
    /// keeps it: at once if another holder keeps it or nothing maps it, after the close if
    /// nothing uses it (it closes now), else once its last view drops and it closes —
    /// unless a new [`hold`](Self::hold) comes first, which runs it then.
    pub fn unhold(&self, key: &CacheKey, holder: HolderId, on_closed: OnClosed) {
        let (now, closing) = {
            let mut state = self.shared.lock();
            match state.entries.get_mut(key) {
                None => (vec![on_closed], None),
                Some(entry) => {
                    entry.holders.retain(|h| *h != holder);
                    if !entry.holders.is_empty() {
                        (vec![on_closed], None)
                    } else if entry.users == 0 {
                        (Vec::new(), state.close(key, vec![on_closed]))
                    } else {
                        entry.on_closed.push(on_closed);
                        (Vec::new(), None)
                    }
                }
            }
        };
        run(now);
        self.shared.dispatch(closing);
    }

    /// `holder` is gone (its link closed): it keeps nothing warm any more. Mappings only it
    /// kept close now, or with their last view.
    pub fn drop_holder(&self, holder: HolderId) {
        let closing = {
            let mut state = self.shared.lock();
            let keys: Vec<CacheKey> = state
                .entries
                .iter()
                .filter(|(_, e)| e.holders.contains(&holder))
                .map(|(k, _)| *k)
                .collect();
            let mut closing = Vec::new();
            for key in keys {
                let entry = state.entries.get_mut(&key).expect("listed");
                entry.holders.retain(|h| *h != holder);
                if entry.holders.is_empty() && entry.users == 0 {
                    closing.push(state.close(&key, Vec::new()));
                }
            }
            closing
        };
        for c in closing {
            self.shared.dispatch(c);
        }
    }

    /// The keys `holder` keeps warm or in use.
    pub fn held_by(&self, holder: HolderId) -> Vec<CacheKey> {
        let mut keys: Vec<CacheKey> = self
            .shared
            .lock()
            .entries
            .iter()
            .filter(|(_, e)| e.holders.contains(&holder))
            .map(|(k, _)| *k)
            .collect();
        keys.sort();
        keys
    }

    /// [`StreamOrdering::release_dead`](crate::StreamOrdering::release_dead) of every backend: if `process` is dead, the streams still
    /// waiting on its fences go on. Call it as soon as a death is known, on any thread
    /// (not behind the driver thread's queue, where a close may wait on those streams).
    pub fn release_dead(&self, process: &ProcessId) {
        for backend in &self.shared.backends {
            backend.ordering().release_dead(process);
        }
    }

    /// Forgets what the backends keep of a dead exporter process (e.g. its opened events).
    /// Mappings stay until their views drop and their holders let go.
    pub fn forget_process(&self, process: &ProcessId) {
        for backend in &self.shared.backends {
            backend.forget_process(process);
        }
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        let state = self.shared.lock();
        let closing = state
            .busy
            .values()
            .filter(|b| matches!(b, Busy::Closing(_)))
            .count();
        CacheStats {
            live: state.entries.len() + closing,
            ..state.stats
        }
    }
}

/// One buffer opened through the [`ImportCache`]: a view of `len` bytes at `offset` of a
/// shared mapping. The mapping stays open while a view of it or a holder is left.
pub struct Imported {
    cache: Arc<Shared>,
    key: CacheKey,
    generation: Generation,
    /// Always `Some` until `drop`, which takes it to release it under the cache lock.
    mem: Option<Arc<OpenedMem>>,
    backend: SharedBackend,
    offset: usize,
    len: usize,
    layout: Option<Layout>,
    /// A release fence of this process after the work queued on the view
    /// ([`release_after`](Self::release_after)).
    release: Option<FenceHandle>,
    /// It handed out a `&mut` of the mapping ([`host_bytes_mut`](Self::host_bytes_mut)),
    /// so its entry refuses new views until it drops.
    written_in_place: bool,
}

impl Imported {
    fn mem(&self) -> &OpenedMem {
        self.mem.as_ref().expect("present until drop")
    }

    /// Bytes in this buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never, for a valid handle).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element type and shape, for typed buffers.
    pub fn layout(&self) -> Option<&Layout> {
        self.layout.as_ref()
    }

    /// Which mapping it is a view of.
    pub fn key(&self) -> CacheKey {
        self.key
    }

    /// Who exported it.
    pub fn exporter(&self) -> ExporterId {
        self.key.exporter
    }

    /// The exported allocation.
    pub fn alloc(&self) -> AllocationId {
        self.key.alloc
    }

    /// The generation of the handle it was opened with.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Where the buffer's first byte is.
    pub fn ptr(&self) -> MemPtr {
        self.mem().ptr().offset_by(self.offset)
    }

    /// The whole mapping this buffer is part of.
    pub fn mapping(&self) -> &OpenedMem {
        self.mem()
    }

    /// The backend that opened it: the one that orders work on it.
    pub fn backend(&self) -> &SharedBackend {
        &self.backend
    }

    /// Drops the view after queued work that uses it, which `fence` (recorded by this
    /// process) follows: the mapping is not closed before that work has completed.
    pub fn release_after(mut self, fence: FenceHandle) {
        self.release = Some(fence);
    }

    fn check(&self, offset: usize, len: usize) -> Result<usize> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.offset + offset),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies bytes from the buffer, starting `offset` bytes in.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or a backend error.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let at = self.check(offset, dst.len())?;
        self.mem().read(at, dst)
    }

    /// Copies bytes into the buffer, starting `offset` bytes in.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or a backend error.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let at = self.check(offset, src.len())?;
        self.mem().write(at, src)
    }

    /// The buffer's bytes in place, if the CPU can address them (host memory; `None` for
    /// device memory). The memory is shared: see [`RawMemory::host_bytes`](crate::RawMemory::host_bytes)
    /// for who may change it while the slice is borrowed.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let all = self.mem().raw().host_bytes()?;
        all.get(self.offset..self.offset.checked_add(self.len)?)
    }

    /// The buffer's bytes in place, writable, if the CPU can address them (`Ok(None)` for
    /// device memory). Given only while this is the mapping's only view in this process;
    /// from then until this view drops, the cache opens no other view of the mapping (an
    /// open of it fails with [`Error::WrittenInPlace`]). So while the slice lives nothing
    /// else in this process reaches the bytes through this crate's safe API: the slice
    /// borrows this view mutably, and no other view exists. Another process may still
    /// write them (see [`RawMemory::host_bytes`](crate::RawMemory::host_bytes)), as may
    /// `unsafe` code here through a raw pointer ([`ptr`](Self::ptr)) taken earlier.
    ///
    /// # Errors
    /// [`Error::SharedMapping`] when the mapping has other views in this process (another
    /// lease on the allocation in this process: drop it, or copy with
    /// [`write`](Self::write)).
    pub fn host_bytes_mut(&mut self) -> Result<Option<&mut [u8]>> {
        if self.mem().raw().host_bytes().is_none() {
            return Ok(None);
        }
        let range = self.offset..self.offset + self.len;
        {
            let mut state = self.cache.lock();
            let entry = state
                .entries
                .get_mut(&self.key)
                .expect("a view's entry stays until the view drops");
            if entry.users != 1 {
                return Err(Error::SharedMapping {
                    alloc: self.key.alloc,
                    views: entry.users,
                });
            }
            entry.written_in_place = true;
        }
        self.written_in_place = true;
        let mem = self.mem.as_deref().expect("present until drop");
        #[allow(unsafe_code)]
        // SAFETY: this view is the mapping's only one in this process (`users == 1`, checked
        // under the cache lock), and its entry now refuses new views until this view drops
        // (`State::hit`; a miss cannot happen while the entry exists). Views hand out
        // `&OpenedMem`/`&[u8]` only borrowed from themselves, and the slice returned here
        // borrows `self` mutably, so no other reference to these bytes, and no copy
        // through this crate, exists in this process while it lives. The bytes are the
        // host mapping's, which `mem` keeps mapped for as long as `self` lives.
        let all = unsafe { mem.raw().host_bytes_mut() };
        match all {
            None => Ok(None),
            Some(all) => Ok(all.get_mut(range)),
        }
    }

    /// The buffer's bytes, copied.
    ///
    /// # Errors
    /// A backend error.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len];
        self.read(0, &mut v)?;
        Ok(v)
    }
}

impl fmt::Debug for Imported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Imported")
            .field("exporter", &self.key.exporter)
            .field("alloc", &self.key.alloc)
            .field("gen", &self.generation)
            .field("range", &format_args!("{}..+{}", self.offset, self.len))
            .finish()
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        let (closing, victims) = {
            let mut state = self.cache.lock();
            // Our reference goes while the lock is held, so that a close below sees the
            // cache's as the last one.
            drop(self.mem.take());
            let Some(entry) = state.entries.get_mut(&self.key) else {
                return;
            };
            if self.written_in_place {
                entry.written_in_place = false;
            }
            if let Some(fence) = self.release.take() {
                // One fence per event or counter slot, the latest (it covers the others),
                // and at most MAX_PENDING_FENCES: a mapping warm for long collects no list.
                if !entry.pending_all && !entry.pending.iter().any(|p| p.covers(&fence)) {
                    entry.pending.retain(|p| !fence.covers(p));
                    if entry.pending.len() < MAX_PENDING_FENCES {
                        entry.pending.push(fence);
                    } else {
                        entry.pending = Vec::new();
                        entry.pending_all = true;
                    }
                }
            }
            entry.users -= 1;
            if entry.users > 0 {
                return;
            }
            if entry.holders.is_empty() {
                (state.close(&self.key, Vec::new()), Vec::new())
            } else {
                let bytes = entry.bytes();
                state.clock += 1;
                let now = state.clock;
                let entry = state.entries.get_mut(&self.key).expect("present");
                entry.warm_since = Some(now);
                state.stats.warm += 1;
                state.stats.warm_bytes += bytes;
                (None, state.over_budget(&self.cache.budget))
            }
        };
        self.cache.dispatch(closing);
        self.cache.evict(victims);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Allocation, Backend, ExportableMemory, RawMemory};
    use crate::ordering::StreamOrdering;
    use crate::session::CheckedHandle;
    use baton_messages::{
        CudaIpcMemHandle, DeviceUuid, Error as MessageError, IpcEventHandle, RawHandle,
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
}
