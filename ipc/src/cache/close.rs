//! The close path: how a mapping that lost its last view and holder is unmapped.
//!
//! [`State::close`](super::state::State::close) takes the entry out and marks its key
//! closing; the shell hands the [`CloseJob`] to the cache's executor
//! ([`Shared::dispatch`]), which runs it with no lock held: it waits until the work this
//! process queued on the mapping has completed (the views' release fences), closes the
//! mapping, unmarks the key (waking opens of the same allocation) and runs the callbacks.
//! An open of the key that finds the close queued but not started runs it itself
//! ([`Shared::settled`]).

use super::shared::{Mapping, Shared};
use super::state::{CloseJob, Closing, OnClosed};
use std::sync::Arc;

impl CloseJob<Mapping> {
    /// Closes the mapping (see the module docs).
    pub(super) fn run(self, shared: &Shared) {
        let CloseJob {
            key,
            mapping: Mapping { mem, backend },
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
                    shared.lock().end_close(&key);
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
        shared.lock().end_close(&key);
        shared.changed.notify_all();
        run(callbacks);
    }
}

impl Shared {
    /// Hands a close to the executor (outside the state lock); inline if none is set.
    pub(super) fn dispatch(self: &Arc<Self>, closing: Option<Closing<Mapping>>) {
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
}

/// Runs callbacks, in order, with no lock held.
pub(super) fn run(callbacks: Vec<OnClosed>) {
    for f in callbacks {
        f();
    }
}
