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
//! # Files
//!
//! - `state.rs`: the bookkeeping as plain data ([`CacheKey`], [`HolderId`], [`WarmBudget`],
//!   [`CacheStats`] and the entries, busy keys and warm set): no lock, no driver, unit-tested
//!   without a backend;
//! - `close.rs`: the close path (fences, then the backend's close, then the callbacks);
//! - `imported.rs`: [`Imported`], the view, with this crate's one `unsafe` block outside
//!   the backends ([`Imported::host_bytes_mut`]; its `# Safety` overview is there);
//! - `shared.rs`: the concurrency shell (the state under a lock, waits on busy keys, the
//!   evictor and executor hooks);
//! - this file: the front, [`ImportCache`]; `tests.rs`: its tests, with fake backends.

mod close;
mod imported;
mod shared;
mod state;
#[cfg(test)]
mod tests;

pub use imported::Imported;
pub use state::{CacheKey, CacheStats, HolderId, OnClosed, WarmBudget};

use crate::backend::SharedBackend;
use crate::link::FrameFds;
use crate::ordering::StreamRef;
use crate::session::Session;
use crate::{Error, Result};
use baton_messages::{BackendKind, HandleMsg, ProcessId};
use close::run;
use shared::{Mapping, OpeningMark, Shared};
use std::fmt;
use std::sync::Arc;

/// Asked to evict a warm mapping for a holder (see [`ImportCache::set_evictor`]).
pub type Evictor = Arc<dyn Fn(HolderId, CacheKey) + Send + Sync>;

/// Runs blocking work (mapping closes) somewhere (see [`ImportCache::set_executor`]).
pub type Executor = Arc<dyn Fn(Box<dyn FnOnce() + Send>) + Send + Sync>;

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
            shared: Arc::new(Shared::new(session, backends.into_iter().collect(), budget)),
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
        let known = self.shared.lock().is_verified(&key, handle);
        let mut checked = if known {
            None
        } else {
            Some(self.shared.session.check(handle)?)
        };
        let mut state = self.shared.settled(&key)?;
        let mapping = if state.entries.contains_key(&key) {
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
            state.start_open(key);
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
            let size = opened.size() as u64;
            let mapping = Mapping {
                mem: Arc::new(opened),
                backend,
            };
            self.shared
                .lock()
                .insert(key, mapping.clone(), size, handle);
            // Unmarked (and waiters woken) only now that the entry is in place.
            drop(mark);
            tracing::debug!(exporter = %handle.exporter, alloc = %handle.alloc, gen = %handle.generation, "mapped");
            state = self.shared.lock();
            mapping
        };
        drop(state);
        Ok(self.imported(key, handle, mapping))
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
        {
            let mut state = self.shared.lock();
            if state.busy.contains_key(&key) {
                return None;
            }
            if state.entries.get(&key)?.verified == *handle {
                // The handle this mapping was opened with, checked then: one lock.
                let found = state.hit(&key, handle, false);
                drop(state);
                return Some(found.map(|mapping| self.imported(key, handle, mapping)));
            }
        }
        // Another handle of a mapped allocation: checked with no lock held, as a miss is.
        if let Err(e) = self.shared.session.check(handle) {
            return Some(Err(e));
        }
        let mut state = self.shared.lock();
        if state.busy.contains_key(&key) || !state.entries.contains_key(&key) {
            return None;
        }
        let found = state.hit(&key, handle, true);
        drop(state);
        Some(found.map(|mapping| self.imported(key, handle, mapping)))
    }

    /// A frame's handles opened as [`open_if_mapped`](Self::open_if_mapped) hits whose
    /// fences need nothing opened first (`fence_prepared`): what an actor's thread may do
    /// with no driver call that blocks. The views, up to and with the first that fails;
    /// `None` — nothing kept open — if any handle would miss or wait, or its fence would
    /// need opening: open them where blocking is allowed.
    pub fn open_all_if_ready<'a>(
        &self,
        handles: impl IntoIterator<Item = &'a HandleMsg>,
    ) -> Option<Vec<Result<Imported>>> {
        let handles = handles.into_iter();
        let mut views = Vec::with_capacity(handles.size_hint().0);
        for handle in handles {
            let view = self.open_if_mapped(handle)?;
            if let (Ok(view), Some(fence)) = (&view, &handle.fence) {
                if !view
                    .backend()
                    .ordering()
                    .fence_prepared(&handle.exporter.process, fence)
                {
                    return None;
                }
            }
            let failed = view.is_err();
            views.push(view);
            if failed {
                break;
            }
        }
        Some(views)
    }

    fn imported(&self, key: CacheKey, handle: &HandleMsg, mapping: Mapping) -> Imported {
        Imported {
            cache: Arc::clone(&self.shared),
            key,
            generation: handle.generation,
            mem: Some(mapping.mem),
            backend: mapping.backend,
            offset: handle.offset as usize,
            len: handle.len as usize,
            layout: handle.layout.clone(),
            device: handle.device,
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
        let (new, superseded) = self.shared.lock().hold(key, holder);
        run(superseded);
        new
    }

    /// `holder` lets the mapping of `key` go. `on_closed` runs once nothing of this holder
    /// keeps it: at once if another holder keeps it or nothing maps it, after the close if
    /// nothing uses it (it closes now), else once its last view drops and it closes —
    /// unless a new [`hold`](Self::hold) comes first, which runs it then.
    pub fn unhold(&self, key: &CacheKey, holder: HolderId, on_closed: OnClosed) {
        let (now, closing) = self.shared.lock().unhold(key, holder, on_closed);
        run(now);
        self.shared.dispatch(closing);
    }

    /// `holder` is gone (its link closed): it keeps nothing warm any more. Mappings only it
    /// kept close now, or with their last view.
    pub fn drop_holder(&self, holder: HolderId) {
        let closing = self.shared.lock().drop_holder(holder);
        for c in closing {
            self.shared.dispatch(Some(c));
        }
    }

    /// The keys `holder` keeps warm or in use.
    pub fn held_by(&self, holder: HolderId) -> Vec<CacheKey> {
        self.shared.lock().held_by(holder)
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

    /// [`Backend::forget_pool`](crate::Backend::forget_pool) of every backend: `exporter`
    /// retired its memory pool `pool`, whose import goes (mappings keep theirs).
    pub fn forget_pool(&self, exporter: &ProcessId, pool: u64) {
        for backend in &self.shared.backends {
            backend.forget_pool(exporter, pool);
        }
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        self.shared.lock().stats()
    }
}
