//! The concurrency shell around [`State`]: the state under one lock, a condition variable
//! for keys that stop being busy, and the hooks (evictor, executor) that run with the
//! lock released.
//!
//! No lock is held across a driver call: an open marks its key *opening* (an
//! [`OpeningMark`] removes the mark, also when the open unwinds), a close marks it
//! *closing*, and [`Shared::settled`] waits for both — running a close that was queued
//! but not started itself, so that an open on the executor's own thread never waits for
//! work queued behind it.

use super::state::{Busy, State, Victims, WarmBudget};
use super::{CacheKey, Evictor, Executor};
use crate::backend::{OpenedMem, SharedBackend};
use crate::session::Session;
use crate::{Error, Result};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long an open waits for another thread's open or close of the same allocation.
const BUSY_DEADLINE: Duration = Duration::from_secs(60);

/// What the cache keeps of one mapped allocation: the memory, and the backend that opened
/// it (and orders and closes it).
#[derive(Clone)]
pub(super) struct Mapping {
    pub(super) mem: Arc<OpenedMem>,
    pub(super) backend: SharedBackend,
}

/// What every clone of an [`ImportCache`](super::ImportCache) and every
/// [`Imported`](super::Imported) view shares.
pub(super) struct Shared {
    pub(super) session: Session,
    pub(super) backends: Vec<SharedBackend>,
    pub(super) budget: WarmBudget,
    pub(super) evictor: Mutex<Option<Evictor>>,
    pub(super) executor: Mutex<Option<Executor>>,
    state: Mutex<State<Mapping>>,
    /// Notified when a key stops being busy.
    pub(super) changed: Condvar,
}

impl Shared {
    pub(super) fn new(session: Session, backends: Vec<SharedBackend>, budget: WarmBudget) -> Self {
        Self {
            session,
            backends,
            budget,
            evictor: Mutex::new(None),
            executor: Mutex::new(None),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State<Mapping>> {
        // A panic while holding the lock leaves the maps consistent (every mutation is a
        // single insert/remove), so a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the evictor for what the state returned as over the budget (outside the
    /// state lock).
    pub(super) fn evict(&self, victims: Victims) {
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

    /// Waits until no other thread opens or closes `key`; returns with the lock held. A
    /// close queued but not started is run here, so an open on the executor's own thread
    /// never waits for work queued behind it.
    ///
    /// # Errors
    /// [`Error::Timeout`] after a minute.
    pub(super) fn settled(&self, key: &CacheKey) -> Result<MutexGuard<'_, State<Mapping>>> {
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
pub(super) struct OpeningMark<'a> {
    pub(super) shared: &'a Shared,
    pub(super) key: CacheKey,
}

impl Drop for OpeningMark<'_> {
    fn drop(&mut self) {
        self.shared.lock().end_open(&self.key);
        self.shared.changed.notify_all();
    }
}
