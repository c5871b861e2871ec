//! Interprocess events: the exporter's pool of recordable events, and the importer's
//! cache of opened ones.
//!
//! The exporter records an event after the work that produced a buffer and puts its IPC
//! handle in the handle message ([`crate::HandleBuilder::event`]); the importer makes its
//! stream wait on it before it touches the buffer ([`crate::Backend::order_after`]).
//!
//! **Reuse contract.** A wait captures the event's most recent record *at the time of the
//! wait*. If the exporter re-recorded an event while an importer that was handed the older
//! record had not yet waited, the importer would wait for the wrong work. So a pooled
//! event goes back to the pool only when its [`RecordedEvent`] drops, and the exporter (the
//! actor layer) keeps that guard with the lease that carried the handle until the lease is
//! released. The pool has a ceiling ([`DEFAULT_EVENT_LIMIT`]; the driver limits live IPC
//! events too), and [`Error::EventsExhausted`] says when it is reached.
//!
//! Events recorded as *release* fences (and by [`crate::Backend::export_fence`]) follow a
//! stricter rule, because their holder cannot know when the other process waits: dropping
//! one *retires* it, and it is lent again only once its recorded work has completed. A
//! later record then only makes a late wait wait longer — never shorter, and never for
//! work that waits on the waiter (every wait, on either side, names work queued before
//! it).
//!
//! # Safety
//!
//! Raw `CUevent`s live only inside [`EventInner`] and [`OpenedEvent`], which destroy them
//! exactly once, in `Drop`, with their context pushed. Both hold a [`SharedContext`], so
//! it outlives them. The process-local registry holds only `Weak` references, so a lookup
//! can never reach a destroyed event. Every driver call runs with a context pushed
//! ([`ContextGuard`]): the event's, or the stream's for calls on a stream.

use super::context::ContextGuard;
use super::{SharedContext, result};
use crate::{Error, Result};
use baton_messages::IpcEventHandle;
use cudarc::driver::{CudaStream, sys};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// How many interprocess events a backend keeps alive at most, unless told otherwise
/// ([`super::CudaBackend::with_event_limit`]).
pub const DEFAULT_EVENT_LIMIT: usize = 256;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a single insert/remove/push/pop: a panic cannot leave
    // the data half-updated, so a poisoned lock is safe to keep using.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One interprocess event of this process.
pub(crate) struct EventInner {
    ctx: SharedContext,
    raw: sys::CUevent,
    handle: [u8; 64],
}

// SAFETY: a `CUevent` is a driver handle usable from any thread with its context current
// (every use here pushes it first); the struct has no thread-affine state.
unsafe impl Send for EventInner {}
// SAFETY: `&EventInner` allows only driver calls (record, query, wait) that the driver
// serialises internally; nothing here is mutated through a shared reference.
unsafe impl Sync for EventInner {}

/// The events this process created, by IPC handle, so that a handle opened in the process
/// that exported it uses the event itself (`cuIpcOpenEventHandle` is for other processes).
fn local_events() -> &'static Mutex<HashMap<[u8; 64], Weak<EventInner>>> {
    static LOCAL: OnceLock<Mutex<HashMap<[u8; 64], Weak<EventInner>>>> = OnceLock::new();
    LOCAL.get_or_init(Default::default)
}

/// This process's own event with that IPC handle, if it is alive.
pub(crate) fn local_event(handle: &[u8; 64]) -> Option<Arc<EventInner>> {
    lock(local_events()).get(handle).and_then(Weak::upgrade)
}

impl EventInner {
    fn new(ctx: &SharedContext) -> Result<Arc<Self>> {
        let pushed = ContextGuard::push(ctx)?;
        // SAFETY: the context is current; the event is owned by `EventInner` below, whose
        // `Drop` destroys it once.
        let raw = unsafe { result::event_create_interprocess() }?;
        let mut inner = EventInner {
            ctx: Arc::clone(ctx),
            raw,
            handle: [0; 64],
        };
        // SAFETY: `raw` is live (just made) and interprocess.
        inner.handle = unsafe { result::ipc_get_event_handle(inner.raw) }?;
        drop(pushed);
        let inner = Arc::new(inner);
        lock(local_events()).insert(inner.handle, Arc::downgrade(&inner));
        Ok(inner)
    }

    /// Makes `stream` wait for this event's latest record.
    /// Whether its latest record has completed (`cuEventQuery`).
    pub(crate) fn is_complete(&self) -> Result<bool> {
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the event is live while `self` is; its context is current.
        unsafe { result::event_query(self.raw) }
    }

    pub(crate) fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        let _pushed = ContextGuard::push(stream.context())?;
        // SAFETY: the stream is live (borrowed) in its current context; the event is live.
        unsafe { result::stream_wait_event(stream.cu_stream(), self.raw) }
    }
}

impl Drop for EventInner {
    fn drop(&mut self) {
        {
            let mut local = lock(local_events());
            // Only remove our own entry: a new event could have the same handle bytes only
            // after this one is destroyed, which happens below.
            if local
                .get(&self.handle)
                .is_some_and(|w| w.strong_count() == 0)
            {
                local.remove(&self.handle);
            }
        }
        let _pushed = match ContextGuard::push(&self.ctx) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "pushing the context to destroy an event failed");
                return;
            }
        };
        // SAFETY: `raw` is live, owned by us, destroyed once (here); its context is current.
        if let Err(e) = unsafe { result::event_destroy(self.raw) } {
            tracing::warn!(error = %e, "destroying an interprocess event failed");
        }
    }
}

struct PoolState {
    free: Vec<Arc<EventInner>>,
    /// Retired events, free again once their recorded work completes.
    retired: Vec<Arc<EventInner>>,
    /// Events alive: free, retired and lent out.
    live: usize,
}

/// The exporter's pool of interprocess events.
pub(crate) struct EventPool {
    ctx: SharedContext,
    limit: usize,
    state: Mutex<PoolState>,
}

impl fmt::Debug for EventPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("EventPool")
            .field("limit", &self.limit)
            .field("live", &state.live)
            .field("free", &state.free.len())
            .finish()
    }
}

impl EventPool {
    pub(crate) fn new(ctx: SharedContext, limit: usize) -> Arc<Self> {
        Arc::new(Self {
            ctx,
            limit,
            state: Mutex::new(PoolState {
                free: Vec::new(),
                retired: Vec::new(),
                live: 0,
            }),
        })
    }

    /// (alive, lent out or retired) events.
    pub(crate) fn counts(&self) -> (usize, usize) {
        let state = lock(&self.state);
        (state.live, state.live - state.free.len())
    }

    /// Frees the retired events whose work has completed (queried with no lock held).
    fn sweep(&self) {
        let retired = std::mem::take(&mut lock(&self.state).retired);
        if retired.is_empty() {
            return;
        }
        let (done, busy): (Vec<_>, Vec<_>) = retired.into_iter().partition(|e| {
            let Ok(_pushed) = ContextGuard::push(&e.ctx) else {
                return false;
            };
            // SAFETY: the event is live (we hold it); its context is current. An error of
            // the recorded work will not complete later: count it as done.
            unsafe { result::event_query(e.raw) }.unwrap_or(true)
        });
        let mut state = lock(&self.state);
        state.free.extend(done);
        state.retired.extend(busy);
    }

    /// Takes a free event, or makes one below the limit, and records it on `stream`.
    pub(crate) fn record(self: &Arc<Self>, stream: &CudaStream) -> Result<RecordedEvent> {
        self.record_as(stream, false)
    }

    /// As [`record`](Self::record), for an event retired (not freed) when its guard drops:
    /// a release fence, whose waiter's timing its holder cannot know.
    pub(crate) fn record_retiring(self: &Arc<Self>, stream: &CudaStream) -> Result<RecordedEvent> {
        self.record_as(stream, true)
    }

    fn record_as(self: &Arc<Self>, stream: &CudaStream, retire: bool) -> Result<RecordedEvent> {
        if lock(&self.state).free.is_empty() {
            self.sweep();
        }
        let event = {
            let mut state = lock(&self.state);
            match state.free.pop() {
                Some(e) => e,
                None if state.live < self.limit => {
                    state.live += 1;
                    drop(state);
                    match EventInner::new(&self.ctx) {
                        Ok(e) => e,
                        Err(e) => {
                            lock(&self.state).live -= 1;
                            return Err(e);
                        }
                    }
                }
                None => return Err(Error::EventsExhausted { limit: self.limit }),
            }
        };
        let recorded = RecordedEvent {
            event: Some(event),
            pool: Arc::clone(self),
            retire,
        };
        let pushed = ContextGuard::push(stream.context())?;
        // SAFETY: the event and the stream are live; the stream's context is current (the
        // event's context is the backend's, as is the stream's).
        unsafe { result::event_record(recorded.inner().raw, stream.cu_stream()) }?;
        drop(pushed);
        Ok(recorded)
    }
}

/// An interprocess event recorded after some work, lent from the backend's pool. Put
/// [`ipc_handle`](Self::ipc_handle) in the handle message ([`crate::HandleBuilder::event`])
/// and keep this guard until every importer that got the handle has released its lease:
/// dropping it returns the event to the pool, where it may be recorded again.
pub struct RecordedEvent {
    /// Always `Some` until `drop`.
    event: Option<Arc<EventInner>>,
    pool: Arc<EventPool>,
    /// Dropping retires the event (lent again once its work completed) rather than
    /// freeing it.
    retire: bool,
}

impl RecordedEvent {
    fn inner(&self) -> &EventInner {
        self.event.as_ref().expect("present until drop")
    }

    /// The event's IPC handle, for [`crate::HandleBuilder::event`]. A capability.
    pub fn ipc_handle(&self) -> IpcEventHandle {
        IpcEventHandle(self.inner().handle)
    }

    /// The raw event, e.g. to make another stream of this process wait on it.
    pub fn cu_event(&self) -> sys::CUevent {
        self.inner().raw
    }

    /// Whether the recorded work has completed.
    ///
    /// # Errors
    /// [`Error::Cuda`] (an error of the recorded work, …).
    #[doc(alias = "cuEventQuery")]
    pub fn is_complete(&self) -> Result<bool> {
        let inner = self.inner();
        let _pushed = ContextGuard::push(&inner.ctx)?;
        // SAFETY: the event is live while `self` holds it; its context is current.
        unsafe { result::event_query(inner.raw) }
    }

    /// Blocks until the recorded work has completed.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    #[doc(alias = "cuEventSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        let inner = self.inner();
        let _pushed = ContextGuard::push(&inner.ctx)?;
        // SAFETY: the event is live while `self` holds it; its context is current.
        unsafe { result::event_synchronize(inner.raw) }
    }
}

impl crate::ordering::ExportedFence for RecordedEvent {
    fn handle(&self) -> crate::messages::FenceHandle {
        crate::messages::FenceHandle::Event(self.ipc_handle())
    }

    fn is_complete(&self) -> Result<bool> {
        RecordedEvent::is_complete(self)
    }

    fn synchronize(&self) -> Result<()> {
        RecordedEvent::synchronize(self)
    }
}

impl fmt::Debug for RecordedEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RecordedEvent(<redacted>)")
    }
}

impl Drop for RecordedEvent {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            let mut state = lock(&self.pool.state);
            if self.retire {
                state.retired.push(event);
            } else {
                state.free.push(event);
            }
        }
    }
}

/// Another process's event, opened in this one: only ever queried (see `super::bridge`).
pub(crate) struct OpenedEvent {
    ctx: SharedContext,
    raw: sys::CUevent,
}

// SAFETY: as for `EventInner`: a driver handle, used only with its context current.
unsafe impl Send for OpenedEvent {}
// SAFETY: `&OpenedEvent` allows only `is_complete`, a driver call the driver serialises
// internally; nothing is mutated through a shared reference. No stream of ours ever waits
// on it (`cuStreamWaitEvent` on a dead process's event never returns): see `bridge.rs`.
unsafe impl Sync for OpenedEvent {}

impl OpenedEvent {
    /// `cuIpcOpenEventHandle` in `ctx`.
    pub(crate) fn open(ctx: &SharedContext, handle: &[u8; 64]) -> Result<Self> {
        let _pushed = ContextGuard::push(ctx)?;
        // SAFETY: the context is current; the event is owned by the `OpenedEvent` returned,
        // whose `Drop` destroys it once.
        let raw = unsafe { result::ipc_open_event_handle(handle) }?;
        Ok(Self {
            ctx: Arc::clone(ctx),
            raw,
        })
    }

    /// Whether the event's latest record has completed (`cuEventQuery`, which never
    /// blocks). An event never recorded counts as complete, as for `cuStreamWaitEvent`.
    pub(crate) fn is_complete(&self) -> Result<bool> {
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the event is live (owned by `self`), opened in this context, current.
        unsafe { result::event_query(self.raw) }
    }
}

impl Drop for OpenedEvent {
    fn drop(&mut self) {
        let _pushed = match ContextGuard::push(&self.ctx) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "pushing the context to destroy an opened event failed");
                return;
            }
        };
        // SAFETY: `raw` is live, owned by us, destroyed once (here), its context current.
        // Destroying an event a stream still waits on is allowed: the driver defers it.
        if let Err(e) = unsafe { result::event_destroy(self.raw) } {
            tracing::warn!(error = %e, "destroying an opened interprocess event failed");
        }
    }
}
