//! The import cache's bookkeeping, as plain data: which allocations are mapped, their
//! views and holders, which keys are being opened or closed, the warm set and its budget,
//! and the counters.
//!
//! [`State`] takes no lock, makes no driver call, runs no callback and keeps no clock but
//! a counter of its own: the shell ([`super::shared`]) calls it under the cache's lock and
//! performs what it returns (closes to run, evictions to ask for, callbacks to call) once
//! the lock is released. It is generic over the mapping it keeps per entry (`M`: the
//! opened memory and its backend, for the cache), so its rules — generations, sizes,
//! in-place writes, warm budgets, pending fences — are unit-tested here without a backend.

use crate::{Error, Result};
use baton_messages::{AllocationId, ExporterId, FenceHandle, Generation, HandleMsg};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The cache's tables, hashed with foldhash (seeded per table): a hit hashes its key twice,
/// and SipHash of a key this size cost more than the rest of the lookup.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

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

/// Counters of an [`ImportCache`](super::ImportCache).
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

/// Called when a mapping closes (see [`ImportCache::unhold`](super::ImportCache::unhold)).
pub type OnClosed = Box<dyn FnOnce() + Send>;

/// The most release fences a mapping keeps for its close to wait on, one by one.
pub(super) const MAX_PENDING_FENCES: usize = 32;

/// One mapped allocation.
pub(super) struct Entry<M> {
    pub(super) mapping: M,
    /// Bytes of the mapping.
    pub(super) size: u64,
    pub(super) users: usize,
    pub(super) holders: Vec<HolderId>,
    /// The newest generation of the allocation seen.
    pub(super) generation: Generation,
    /// The last handle whose digest verified for this mapping. A handle equal to it, byte
    /// for byte, would verify the same way: a hit with it skips the keyed hash (the
    /// common case: an exporter re-sharing the same buffer).
    pub(super) verified: HandleMsg,
    /// When it went warm (the state's clock), for least-recently-used eviction.
    pub(super) warm_since: Option<u64>,
    /// Handed to the evictor already.
    pub(super) evicting: bool,
    /// Its only view handed out a `&mut` of the mapping
    /// ([`Imported::host_bytes_mut`](super::Imported::host_bytes_mut)): no other view is
    /// opened until that view drops.
    pub(super) written_in_place: bool,
    /// Run when it closes (holders that let go while views were alive).
    pub(super) on_closed: Vec<OnClosed>,
    /// Release fences (this process's) of views that queued work on the mapping: the close
    /// waits for them. One per event or counter slot ([`FenceHandle::covers`]): a pooled
    /// fence is recorded again only once its work completed, so waiting on its latest
    /// record covers every earlier one. At most [`MAX_PENDING_FENCES`]; past that,
    /// `pending_all` instead.
    pub(super) pending: Vec<FenceHandle>,
    /// Too many distinct fences to keep (a mapping warm for long, used on many streams or
    /// slots): the close waits for every fence the backend has recorded
    /// ([`StreamOrdering::own_fences_landed`](crate::StreamOrdering::own_fences_landed) with `all`).
    pub(super) pending_all: bool,
}

/// Everything a close needs, run with no lock held (by the close path, [`super::close`]).
pub(super) struct CloseJob<M> {
    pub(super) key: CacheKey,
    pub(super) mapping: M,
    pub(super) pending: Vec<FenceHandle>,
    pub(super) pending_all: bool,
    pub(super) callbacks: Vec<OnClosed>,
}

/// A close that has not run yet: taken by whoever runs it first (the executor, or an open
/// of the same key that must not wait behind it).
pub(super) type CloseCell<M> = Arc<Mutex<Option<CloseJob<M>>>>;

/// A key some thread works on with the cache's lock released.
pub(super) enum Busy<M> {
    /// A thread is opening the key with no lock held.
    Opening,
    /// The key's mapping is being closed.
    Closing(CloseCell<M>),
}

/// A close to hand to the executor once the lock is released.
pub(super) struct Closing<M>(pub(super) CloseCell<M>);

/// Warm mappings to evict, each with its holders (each is asked).
pub(super) type Victims = Vec<(Vec<HolderId>, CacheKey)>;

/// The cache's bookkeeping (see the module docs).
pub(super) struct State<M> {
    pub(super) entries: Map<CacheKey, Entry<M>>,
    pub(super) busy: Map<CacheKey, Busy<M>>,
    clock: u64,
    stats: CacheStats,
}

impl<M> Default for State<M> {
    fn default() -> Self {
        Self {
            entries: Map::default(),
            busy: Map::default(),
            clock: 0,
            stats: CacheStats::default(),
        }
    }
}

impl<M: Clone> State<M> {
    /// Whether `key` is mapped and `handle` is, byte for byte, the last handle verified for
    /// it (so a hit with it may skip the check).
    pub(super) fn is_verified(&self, key: &CacheKey, handle: &HandleMsg) -> bool {
        self.entries.get(key).is_some_and(|e| e.verified == *handle)
    }

    /// A hit on `key`'s entry (present): refuses a stale generation or a handle that claims
    /// more than the mapping holds, else counts one more user. `checked`: the handle was
    /// checked just now (it becomes the entry's verified one).
    ///
    /// # Errors
    /// [`Error::WrittenInPlace`], [`Error::StaleHandle`] or [`Error::MemoryTooSmall`].
    pub(super) fn hit(&mut self, key: &CacheKey, handle: &HandleMsg, checked: bool) -> Result<M> {
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
        if entry.size < handle.alloc_size {
            return Err(Error::MemoryTooSmall {
                claimed: handle.alloc_size,
                actual: entry.size,
            });
        }
        entry.generation = handle.generation;
        entry.users += 1;
        if checked {
            entry.verified = handle.clone();
        }
        let found = entry.mapping.clone();
        self.touch(key);
        self.stats.hits += 1;
        Ok(found)
    }

    /// One more view of `key`, whose entry a live view keeps present; refused while a
    /// view hands out its bytes writable.
    pub(super) fn add_view(&mut self, key: &CacheKey, alloc: AllocationId) -> Result<()> {
        let entry = self
            .entries
            .get_mut(key)
            .expect("a live view keeps its entry");
        if entry.written_in_place {
            return Err(Error::WrittenInPlace { alloc });
        }
        entry.users += 1;
        Ok(())
    }

    /// A miss mapped `key` (marked opening, so absent until now): its entry, with one user.
    pub(super) fn insert(&mut self, key: CacheKey, mapping: M, size: u64, handle: &HandleMsg) {
        self.entries.insert(
            key,
            Entry {
                mapping,
                size,
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
        self.stats.opens += 1;
    }

    /// Marks `key` as being opened with no lock held.
    pub(super) fn start_open(&mut self, key: CacheKey) {
        self.busy.insert(key, Busy::Opening);
    }

    /// Removes `key`'s opening mark, if it has one.
    pub(super) fn end_open(&mut self, key: &CacheKey) {
        if matches!(self.busy.get(key), Some(Busy::Opening)) {
            self.busy.remove(key);
        }
    }

    /// Removes `key`'s closing mark, if it has one.
    pub(super) fn end_close(&mut self, key: &CacheKey) {
        if matches!(self.busy.get(key), Some(Busy::Closing(_))) {
            self.busy.remove(key);
        }
    }

    /// Marks an entry in use (leaving the warm set if it was there).
    fn touch(&mut self, key: &CacheKey) {
        let Some(entry) = self.entries.get_mut(key) else {
            return;
        };
        if entry.warm_since.take().is_some() {
            self.stats.warm -= 1;
            self.stats.warm_bytes -= entry.size;
        }
    }

    /// Starts closing an entry that has neither views nor holders: removes it and marks the
    /// key closing. `more` run after its own callbacks, once it is closed.
    pub(super) fn close(&mut self, key: &CacheKey, more: Vec<OnClosed>) -> Option<Closing<M>> {
        self.touch(key);
        let entry = self.entries.remove(key)?;
        debug_assert!(entry.users == 0 && entry.holders.is_empty());
        self.stats.closes += 1;
        let mut callbacks = entry.on_closed;
        callbacks.extend(more);
        let cell: CloseCell<M> = Arc::new(Mutex::new(Some(CloseJob {
            key: *key,
            mapping: entry.mapping,
            pending: entry.pending,
            pending_all: entry.pending_all,
            callbacks,
        })));
        self.busy.insert(*key, Busy::Closing(Arc::clone(&cell)));
        Some(Closing(cell))
    }

    /// A view of `key` dropped, after work that `release` (a fence of this process)
    /// follows; `wrote_in_place`: it had handed out a `&mut` of the mapping. The mapping
    /// closes if that was its last view and nobody holds it; goes warm if a holder does
    /// (and the warm mappings past `budget` are returned, to evict).
    pub(super) fn view_dropped(
        &mut self,
        key: &CacheKey,
        release: Option<FenceHandle>,
        wrote_in_place: bool,
        budget: &WarmBudget,
    ) -> (Option<Closing<M>>, Victims) {
        let Some(entry) = self.entries.get_mut(key) else {
            return (None, Vec::new());
        };
        if wrote_in_place {
            entry.written_in_place = false;
        }
        if let Some(fence) = release {
            // One fence per event or counter slot, the latest (it covers the others), and
            // at most MAX_PENDING_FENCES: a mapping warm for long collects no list.
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
            return (None, Vec::new());
        }
        if entry.holders.is_empty() {
            return (self.close(key, Vec::new()), Vec::new());
        }
        let size = entry.size;
        self.clock += 1;
        let now = self.clock;
        let entry = self.entries.get_mut(key).expect("present");
        entry.warm_since = Some(now);
        self.stats.warm += 1;
        self.stats.warm_bytes += size;
        (None, self.over_budget(budget))
    }

    /// The only view of `key` hands out a `&mut` of the mapping: from now until it drops,
    /// no other view is opened.
    ///
    /// # Errors
    /// [`Error::SharedMapping`] if the mapping has other views.
    pub(super) fn write_in_place(&mut self, key: &CacheKey) -> Result<()> {
        let entry = self
            .entries
            .get_mut(key)
            .expect("a view's entry stays until the view drops");
        if entry.users != 1 {
            return Err(Error::SharedMapping {
                alloc: key.alloc,
                views: entry.users,
            });
        }
        entry.written_in_place = true;
        Ok(())
    }

    /// `holder` keeps `key` warm from now on: whether it did not already, and the callbacks
    /// of holders that let go before, which this hold supersedes (to run now).
    pub(super) fn hold(&mut self, key: &CacheKey, holder: HolderId) -> (bool, Vec<OnClosed>) {
        let Some(entry) = self.entries.get_mut(key) else {
            return (false, Vec::new());
        };
        if entry.holders.contains(&holder) {
            (false, Vec::new())
        } else {
            entry.holders.push(holder);
            entry.evicting = false;
            (true, std::mem::take(&mut entry.on_closed))
        }
    }

    /// `holder` lets `key` go: the callbacks to run now, and the close to start, if any
    /// (`on_closed` runs after it); else `on_closed` waits for the last view.
    pub(super) fn unhold(
        &mut self,
        key: &CacheKey,
        holder: HolderId,
        on_closed: OnClosed,
    ) -> (Vec<OnClosed>, Option<Closing<M>>) {
        match self.entries.get_mut(key) {
            None => (vec![on_closed], None),
            Some(entry) => {
                entry.holders.retain(|h| *h != holder);
                if !entry.holders.is_empty() {
                    (vec![on_closed], None)
                } else if entry.users == 0 {
                    (Vec::new(), self.close(key, vec![on_closed]))
                } else {
                    entry.on_closed.push(on_closed);
                    (Vec::new(), None)
                }
            }
        }
    }

    /// `holder` is gone: the closes of the mappings only it kept and nothing uses.
    pub(super) fn drop_holder(&mut self, holder: HolderId) -> Vec<Closing<M>> {
        let mut closing = Vec::new();
        for key in self.held_by(holder) {
            let entry = self.entries.get_mut(&key).expect("listed");
            entry.holders.retain(|h| *h != holder);
            if entry.holders.is_empty() && entry.users == 0 {
                closing.extend(self.close(&key, Vec::new()));
            }
        }
        closing
    }

    /// The keys `holder` keeps warm or in use, in order.
    pub(super) fn held_by(&self, holder: HolderId) -> Vec<CacheKey> {
        let mut keys: Vec<CacheKey> = self
            .entries
            .iter()
            .filter(|(_, e)| e.holders.contains(&holder))
            .map(|(k, _)| *k)
            .collect();
        keys.sort();
        keys
    }

    /// The counters, with the mappings live now (closing ones included).
    pub(super) fn stats(&self) -> CacheStats {
        let closing = self
            .busy
            .values()
            .filter(|b| matches!(b, Busy::Closing(_)))
            .count();
        CacheStats {
            live: self.entries.len() + closing,
            ..self.stats
        }
    }

    /// Warm entries over `budget`, least recently used first, marked as evicting. Those
    /// already handed to the evictor are on their way out and do not count.
    fn over_budget(&mut self, budget: &WarmBudget) -> Victims {
        if self.stats.warm <= budget.max_entries && self.stats.warm_bytes <= budget.max_bytes {
            return Vec::new();
        }
        let mut warm: Vec<(u64, CacheKey, u64)> = self
            .entries
            .iter()
            .filter_map(|(k, e)| {
                e.warm_since
                    .filter(|_| !e.evicting)
                    .map(|t| (t, *k, e.size))
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

#[cfg(test)]
mod tests {
    use super::*;
    use baton_messages::{
        ActorId, BackendKind, BootId, CounterFence, CudaIpcMemHandle, DeviceUuid, PROTOCOL_VERSION,
        ProcessId, RawHandle, SegmentName,
    };

    /// A handle naming allocation `alloc` of one exporter, `size` bytes, at `generation`.
    /// Plain data: the state never checks a digest.
    fn handle(alloc: u64, size: u64, generation: Generation) -> HandleMsg {
        HandleMsg {
            version: PROTOCOL_VERSION,
            exporter: ExporterId {
                process: ProcessId {
                    boot: BootId([1; 16]),
                    pid: 7,
                    start_ticks: 1,
                },
                actor: ActorId::new(1),
            },
            alloc: AllocationId::new(alloc),
            generation,
            backend: BackendKind::Host,
            device: DeviceUuid::HOST,
            alloc_size: size,
            offset: 0,
            len: size,
            layout: None,
            raw: RawHandle::HostSegment(SegmentName::new("/state.test").unwrap()),
            fence: None,
            digest: Default::default(),
        }
    }

    /// Each mapping stands for itself by its allocation number.
    type TestState = State<u64>;

    const HOLDER: HolderId = HolderId(1);

    /// Maps `alloc` (`size` bytes) with one view, held by [`HOLDER`].
    fn map(state: &mut TestState, alloc: u64, size: u64) -> CacheKey {
        let h = handle(alloc, size, Generation::FIRST);
        let key = CacheKey::of(&h);
        state.start_open(key);
        state.insert(key, alloc, size, &h);
        state.end_open(&key);
        assert!(state.hold(&key, HOLDER).0);
        key
    }

    /// Drops `key`'s last view: it goes warm (it is held); the victims past `budget`.
    fn go_warm(state: &mut TestState, key: &CacheKey, budget: &WarmBudget) -> Vec<CacheKey> {
        let (closing, victims) = state.view_dropped(key, None, false, budget);
        assert!(closing.is_none(), "a held mapping stays open");
        victims
            .into_iter()
            .map(|(holders, key)| {
                assert_eq!(holders, [HOLDER]);
                key
            })
            .collect()
    }

    #[test]
    fn the_warm_budget_by_entries_evicts_the_least_recently_warm_once() {
        let budget = WarmBudget {
            max_entries: 2,
            max_bytes: u64::MAX,
        };
        let mut state = TestState::default();
        let [a, b, c] = [1, 2, 3].map(|alloc| map(&mut state, alloc, 100));
        assert!(go_warm(&mut state, &b, &budget).is_empty());
        assert!(go_warm(&mut state, &a, &budget).is_empty());
        // Three warm, two allowed: b went warm first.
        assert_eq!(go_warm(&mut state, &c, &budget), [b]);
        let stats = state.stats();
        assert_eq!((stats.warm, stats.warm_bytes, stats.evictions), (3, 300, 1));
        assert!(state.entries[&b].evicting);
        // An entry handed to the evictor is on its way out: it is not asked again, and
        // the others fit without it.
        let d = map(&mut state, 4, 100);
        assert_eq!(go_warm(&mut state, &d, &budget), [a]);
        assert_eq!(state.stats().evictions, 2);
        // A new hold keeps it: it may be asked again later.
        state.hold(&b, HolderId(2));
        assert!(!state.entries[&b].evicting);
    }

    #[test]
    fn the_warm_budget_by_bytes_evicts_until_what_stays_fits() {
        let budget = WarmBudget {
            max_entries: 100,
            max_bytes: 450,
        };
        let mut state = TestState::default();
        let keys = [(1, 100), (2, 200), (3, 300)].map(|(alloc, size)| map(&mut state, alloc, size));
        assert!(go_warm(&mut state, &keys[0], &budget).is_empty());
        assert!(go_warm(&mut state, &keys[1], &budget).is_empty());
        // 600 bytes warm: the oldest (100) is not enough, the next (200) is.
        assert_eq!(go_warm(&mut state, &keys[2], &budget), [keys[0], keys[1]]);
        assert_eq!(state.stats().warm_bytes, 600, "counted until they close");
    }

    #[test]
    fn a_hit_takes_a_mapping_out_of_the_warm_set_and_a_let_go_closes_it() {
        let budget = WarmBudget::default();
        let mut state = TestState::default();
        let key = map(&mut state, 1, 4096);
        go_warm(&mut state, &key, &budget);
        assert_eq!((state.stats().warm, state.stats().warm_bytes), (1, 4096));
        let h = handle(1, 4096, Generation::FIRST);
        assert!(state.is_verified(&key, &h));
        assert_eq!(state.hit(&key, &h, false).unwrap(), 1);
        let stats = state.stats();
        assert_eq!((stats.warm, stats.warm_bytes, stats.hits), (0, 0, 1));
        // Let go while a view lives: the callback waits for the view.
        let (now, closing) = state.unhold(&key, HOLDER, Box::new(|| {}));
        assert!(now.is_empty() && closing.is_none());
        let (closing, victims) = state.view_dropped(&key, None, false, &budget);
        assert!(victims.is_empty());
        let Closing(cell) = closing.expect("its last view, no holder: it closes");
        let job = cell.lock().unwrap().take().unwrap();
        assert_eq!((job.mapping, job.callbacks.len()), (1, 1));
        // Closing: still live, and busy until the close path is done.
        assert_eq!((state.stats().live, state.stats().closes), (1, 1));
        assert!(matches!(state.busy.get(&key), Some(Busy::Closing(_))));
        state.end_close(&key);
        assert_eq!(state.stats().live, 0);
    }

    #[test]
    fn hits_refuse_stale_generations_oversized_claims_and_views_of_memory_written_in_place() {
        let mut state = TestState::default();
        let g2 = Generation::FIRST.next();
        let h2 = handle(1, 4096, g2);
        let key = CacheKey::of(&h2);
        state.insert(key, 1, 4096, &h2);
        let old = handle(1, 4096, Generation::FIRST);
        assert!(matches!(
            state.hit(&key, &old, true),
            Err(Error::StaleHandle { .. })
        ));
        assert_eq!(state.stats().stale, 1);
        let big = handle(1, 8192, g2);
        assert!(matches!(
            state.hit(&key, &big, true),
            Err(Error::MemoryTooSmall {
                claimed: 8192,
                actual: 4096
            })
        ));
        state.write_in_place(&key).unwrap();
        assert!(matches!(
            state.hit(&key, &h2, true),
            Err(Error::WrittenInPlace { .. })
        ));
        // The writer drops: views may open again, and then none may write in place.
        let (closing, _) = state.view_dropped(&key, None, true, &WarmBudget::default());
        assert!(closing.is_some(), "no holder: closes");
        assert!(state.entries.is_empty());
    }

    #[test]
    fn a_mapping_keeps_the_latest_fence_per_slot_and_at_most_a_bound() {
        let budget = WarmBudget::default();
        let mut state = TestState::default();
        let key = map(&mut state, 1, 64);
        let h = handle(1, 64, Generation::FIRST);
        let fence = |slot: u64, value: u64| {
            FenceHandle::Counter(CounterFence {
                slab: CudaIpcMemHandle([3; 64]),
                slab_id: 1,
                offset: slot * 8,
                value,
            })
        };
        let release = |state: &mut TestState, fence: FenceHandle| {
            state.hit(&key, &h, false).unwrap();
            state.view_dropped(&key, Some(fence), false, &budget);
        };
        release(&mut state, fence(0, 1));
        release(&mut state, fence(0, 3));
        release(&mut state, fence(0, 2));
        assert_eq!(
            state.entries[&key].pending,
            [fence(0, 3)],
            "the latest covers the rest"
        );
        for slot in 1..MAX_PENDING_FENCES as u64 {
            release(&mut state, fence(slot, 1));
        }
        assert_eq!(state.entries[&key].pending.len(), MAX_PENDING_FENCES);
        release(&mut state, fence(MAX_PENDING_FENCES as u64, 1));
        let entry = &state.entries[&key];
        assert!(entry.pending.is_empty() && entry.pending_all);
    }
}
