//! Interprocess events: the exporter's pool of recordable events, and the importer's
//! cache of opened ones.
//!
//! The exporter records an event after the work that produced a buffer and puts its IPC
//! handle in the handle message ([`crate::HandleBuilder::event`]); the importer makes its
//! stream wait on it before it touches the buffer ([`crate::StreamOrdering::order_after`]).
//!
//! **Reuse contract.** A wait captures the event's most recent record *at the time of the
//! wait*, and a waiter's bridge (`super::bridge`) follows whatever record is current when
//! it *polls*. If the exporter re-recorded an event while an importer handed the older
//! record had not yet waited, or not yet seen it complete, the importer would wait for the
//! wrong work — work that may itself wait on the importer, a cycle only the fence deadline
//! breaks. So:
//!
//! - the exporter (the actor layer) keeps a [`RecordedEvent`] with the lease that carried
//!   its handle until the lease is back; dropping it *retires* the event, lent again only
//!   once its recorded work has completed;
//! - an event recorded for a process is recorded again only for that process (while it
//!   lives): the fence naming the new record reaches the only process that may still
//!   follow the old one, which takes it as word that the old one completed and releases
//!   its waits on it (`StreamOrdering::check_fence`, [`OpenedEvent::renamed`]).
//!
//! The pool has a ceiling ([`DEFAULT_EVENT_LIMIT`]; the driver limits live IPC events too),
//! and [`Error::EventsExhausted`] says when it is reached. A sender keeps short of it:
//! [`EventPool::room_for`] tells it to wait while a peer has a backlog of retired events
//! whose work has not completed (`StreamOrdering::fence_room`).
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
use crate::process::{Liveness, liveness};
use crate::{Error, Result};
use baton_messages::IpcEventHandle;
use baton_messages::ProcessId;
use cudarc::driver::{CudaStream, sys};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// Who may be waiting on an event's latest record: the process it was recorded for, or
/// `None` when Baton does not know (an event a user records and hands out themselves).
type Waiter = Option<ProcessId>;

/// The reuse bookkeeping of a pool (no driver calls, so it is tested without a GPU): which
/// events are free, for whom, and which are retired until their work completes.
///
/// Two rules keep a waiter from ever following a record that was not meant for it (the
/// ABA of pooled events: a waiter's bridge follows whatever record is current when it
/// *polls*, and a later record can wait on the waiter itself — a cycle only the fence
/// deadline would break):
///
/// - an event is recorded again only once its previous record has completed (every
///   dropped guard retires its event; [`put_back`](Self::put_back) frees it when done);
/// - an event recorded for process `W` is recorded again only for `W` (or for anyone once
///   `W` is dead), so the fence that names the new record reaches the one process that
///   may still be polling the old one, and `W` takes it as word that the old one completed
///   (`StreamOrdering::check_fence` releases its waits on that event). An event nobody was told
///   of (`None`) may go to anyone.
#[derive(Debug)]
struct Lending<T> {
    free: HashMap<Waiter, Vec<T>>,
    /// Retired: free again, for the same waiter, once their recorded work completes.
    retired: Vec<(Waiter, T)>,
    /// Events alive: free, retired and lent out.
    live: usize,
    limit: usize,
}

/// What [`Lending::take`] decided.
#[derive(Debug, PartialEq, Eq)]
enum Take<T> {
    /// Record this one again.
    Reuse(T),
    /// Make a new event (counted already; [`Lending::unmake`] if that fails).
    Make,
    /// Every event is lent out, retired, or free for another live process.
    Exhausted,
}

impl<T> Lending<T> {
    fn new(limit: usize) -> Self {
        Self {
            free: HashMap::new(),
            retired: Vec::new(),
            live: 0,
            limit,
        }
    }

    fn free_count(&self) -> usize {
        self.free.values().map(Vec::len).sum()
    }

    /// An event to record for `waiter`: one free for it; else a new one below the limit;
    /// else one free for a dead process (`alive` says), or one nobody was told of.
    fn take(&mut self, waiter: Waiter, alive: impl Fn(&ProcessId) -> bool) -> Take<T> {
        if let Some(e) = self.free.get_mut(&waiter).and_then(Vec::pop) {
            return Take::Reuse(e);
        }
        if self.live < self.limit {
            self.live += 1;
            return Take::Make;
        }
        let dead = self
            .free
            .iter()
            .find(|(w, list)| !list.is_empty() && w.is_some_and(|p| !alive(&p)))
            .map(|(w, _)| *w);
        let from = dead.or_else(|| {
            self.free
                .get(&None)
                .is_some_and(|l| !l.is_empty())
                .then_some(None)
        });
        match from.and_then(|w| self.free.get_mut(&w)).and_then(Vec::pop) {
            Some(e) => Take::Reuse(e),
            None => Take::Exhausted,
        }
    }

    /// Whether [`take`](Self::take) for `waiter` would find an event, and fewer than
    /// `backlog` of those retired for `waiter` still wait for their work (a backlog of
    /// records the other side has not waited through yet).
    fn room(&self, waiter: Waiter, backlog: usize, alive: impl Fn(&ProcessId) -> bool) -> bool {
        let behind = self.retired.iter().filter(|(w, _)| *w == waiter).count();
        let takeable = self.free.get(&waiter).is_some_and(|l| !l.is_empty())
            || self.live < self.limit
            || self
                .free
                .iter()
                .any(|(w, list)| !list.is_empty() && w.is_none_or(|p| !alive(&p)));
        behind < backlog && takeable
    }

    /// Making the event [`take`](Self::take) asked for failed.
    fn unmake(&mut self) {
        self.live -= 1;
    }

    /// The guard of an event recorded for `waiter` dropped.
    fn retire(&mut self, waiter: Waiter, event: T) {
        self.retired.push((waiter, event));
    }

    /// The retired events, to query (with no lock held) and [`put_back`](Self::put_back).
    fn take_retired(&mut self) -> Vec<(Waiter, T)> {
        std::mem::take(&mut self.retired)
    }

    /// Queried retired events back: `done` ones are free for their waiter.
    fn put_back(&mut self, queried: Vec<(Waiter, T, bool)>) {
        for (waiter, event, done) in queried {
            if done {
                self.free.entry(waiter).or_default().push(event);
            } else {
                self.retired.push((waiter, event));
            }
        }
        self.free.retain(|_, list| !list.is_empty());
    }
}

/// The exporter's pool of interprocess events.
pub(crate) struct EventPool {
    ctx: SharedContext,
    state: Mutex<Lending<Arc<EventInner>>>,
}

impl fmt::Debug for EventPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("EventPool")
            .field("limit", &state.limit)
            .field("live", &state.live)
            .field("free", &state.free_count())
            .finish()
    }
}

impl EventPool {
    pub(crate) fn new(ctx: SharedContext, limit: usize) -> Arc<Self> {
        Arc::new(Self {
            ctx,
            state: Mutex::new(Lending::new(limit)),
        })
    }

    /// (alive, lent out or retired with their work still running) events: retired ones
    /// whose work completed are swept free first.
    pub(crate) fn counts(&self) -> (usize, usize) {
        self.sweep();
        let state = lock(&self.state);
        (state.live, state.live - state.free_count())
    }

    /// Frees the retired events whose work has completed (queried with no lock held).
    fn sweep(&self) {
        let retired = lock(&self.state).take_retired();
        if retired.is_empty() {
            return;
        }
        let queried = retired
            .into_iter()
            .map(|(waiter, e)| {
                let done = ContextGuard::push(&e.ctx).is_ok_and(|_pushed| {
                    // SAFETY: the event is live (we hold it); its context is current. An
                    // error of the recorded work will not complete later: count it as done.
                    unsafe { result::event_query(e.raw) }.unwrap_or(true)
                });
                (waiter, e, done)
            })
            .collect();
        lock(&self.state).put_back(queried);
    }

    /// Whether an event for `waiter` can be recorded now with fewer than `backlog` of its
    /// retired events still waiting for their work (swept first).
    pub(crate) fn room_for(&self, waiter: Waiter, backlog: usize) -> bool {
        self.sweep();
        lock(&self.state).room(waiter, backlog, |p| liveness(p) != Liveness::Dead)
    }

    /// Takes an event (see [`Lending`]) and records it on `stream` for `waiter`: the
    /// process the handle goes to, or `None` for an event whose handle the caller hands
    /// out itself.
    pub(crate) fn record_for(
        self: &Arc<Self>,
        stream: &CudaStream,
        waiter: Waiter,
    ) -> Result<RecordedEvent> {
        let alive = |p: &ProcessId| liveness(p) != Liveness::Dead;
        let mut take = lock(&self.state).take(waiter, alive);
        if matches!(take, Take::Exhausted | Take::Make) {
            // Retired events that are done first: reuse before making more.
            self.sweep();
            let mut state = lock(&self.state);
            if matches!(take, Take::Make) {
                state.unmake();
            }
            take = state.take(waiter, alive);
        }
        let event = match take {
            Take::Reuse(e) => e,
            Take::Make => match EventInner::new(&self.ctx) {
                Ok(e) => e,
                Err(e) => {
                    lock(&self.state).unmake();
                    return Err(e);
                }
            },
            Take::Exhausted => {
                let limit = lock(&self.state).limit;
                return Err(Error::EventsExhausted { limit });
            }
        };
        if tracing::enabled!(tracing::Level::TRACE) {
            let state = lock(&self.state);
            let (live, out) = (state.live, state.live - state.free_count());
            drop(state);
            tracing::trace!(live, out, ?waiter, "recording a pooled event");
        }
        let recorded = RecordedEvent {
            event: Some(event),
            pool: Arc::clone(self),
            waiter,
        };
        let pushed = ContextGuard::push(stream.context())?;
        let recording = std::time::Instant::now();
        // SAFETY: the event and the stream are live; the stream's context is current (the
        // event's context is the backend's, as is the stream's).
        unsafe { result::event_record(recorded.inner().raw, stream.cu_stream()) }?;
        drop(pushed);
        tracing::trace!(record_us = recording.elapsed().as_micros(), "recorded");
        Ok(recorded)
    }
}

/// An interprocess event recorded after some work, lent from the backend's pool. Put
/// [`ipc_handle`](Self::ipc_handle) in the handle message ([`crate::HandleBuilder::event`])
/// and keep this guard until every importer that got the handle has released its lease:
/// dropping it retires the event, recorded again once this record has completed.
pub struct RecordedEvent {
    /// Always `Some` until `drop`.
    event: Option<Arc<EventInner>>,
    pool: Arc<EventPool>,
    /// The process this record was made for (its next record is for it too).
    waiter: Waiter,
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
            lock(&self.pool.state).retire(self.waiter, event);
        }
    }
}

/// Another process's event, opened in this one: only ever queried (see `super::bridge`).
pub(crate) struct OpenedEvent {
    ctx: SharedContext,
    raw: sys::CUevent,
    handle: [u8; 64],
    /// Bumped each time its producer names the event in a fence again: the older records
    /// have completed ([`Lending`]'s rules), so a wait on one of them is over.
    named: AtomicU64,
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
            handle: *handle,
            named: AtomicU64::new(0),
        })
    }

    /// The IPC handle it was opened from.
    pub(crate) fn handle(&self) -> &[u8; 64] {
        &self.handle
    }

    /// How often its producer named it again since it was opened (see `named`).
    pub(crate) fn named(&self) -> u64 {
        self.named.load(Ordering::Acquire)
    }

    /// Its producer named it in a fence again: it recorded it anew, after the older
    /// records completed.
    pub(crate) fn renamed(&self) {
        self.named.fetch_add(1, Ordering::AcqRel);
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn pid(n: u32) -> ProcessId {
        ProcessId {
            boot: baton_messages::BootId([7; 16]),
            pid: n,
            start_ticks: u64::from(n),
        }
    }

    /// Takes for `waiter` and, when asked to make one, makes `next`.
    fn take(
        l: &mut Lending<u32>,
        waiter: Waiter,
        dead: &HashSet<u32>,
        next: &mut u32,
    ) -> Option<u32> {
        match l.take(waiter, |p| !dead.contains(&p.pid)) {
            Take::Reuse(e) => Some(e),
            Take::Make => {
                *next += 1;
                Some(*next)
            }
            Take::Exhausted => None,
        }
    }

    #[test]
    fn an_event_is_recorded_again_only_once_done_and_only_for_the_process_it_was_for() {
        let mut l = Lending::new(2);
        let none = HashSet::new();
        let mut next = 0;
        let a = take(&mut l, Some(pid(1)), &none, &mut next).unwrap();
        l.retire(Some(pid(1)), a);
        // Not done yet: a new one, for anyone.
        let b = take(&mut l, Some(pid(1)), &none, &mut next).unwrap();
        assert_ne!(a, b);
        l.retire(Some(pid(2)), b);
        let queried = l
            .take_retired()
            .into_iter()
            .map(|(w, e)| (w, e, true))
            .collect();
        l.put_back(queried);
        // At the limit, each is free for its own process only.
        assert_eq!(take(&mut l, Some(pid(3)), &none, &mut next), None);
        assert_eq!(take(&mut l, None, &none, &mut next), None);
        assert_eq!(take(&mut l, Some(pid(2)), &none, &mut next), Some(b));
        assert_eq!(take(&mut l, Some(pid(1)), &none, &mut next), Some(a));
        assert_eq!(l.live, 2);
    }

    #[test]
    fn a_dead_processs_events_and_those_nobody_was_told_of_go_to_anyone() {
        let mut l = Lending::new(2);
        let mut dead = HashSet::new();
        let mut next = 0;
        let a = take(&mut l, Some(pid(1)), &dead, &mut next).unwrap();
        let b = take(&mut l, None, &dead, &mut next).unwrap();
        l.retire(Some(pid(1)), a);
        l.retire(None, b);
        l.put_back(vec![(Some(pid(1)), a, true), (None, b, true)]);
        assert_eq!(take(&mut l, Some(pid(2)), &dead, &mut next), Some(b));
        assert_eq!(take(&mut l, Some(pid(2)), &dead, &mut next), None);
        dead.insert(1);
        assert_eq!(take(&mut l, Some(pid(2)), &dead, &mut next), Some(a));
    }

    #[test]
    fn room_runs_out_with_a_backlog_of_retired_events_or_none_to_take() {
        let mut l = Lending::new(3);
        let none = HashSet::new();
        let alive = |p: &ProcessId| !none.contains(&p.pid);
        let mut next = 0;
        assert!(l.room(Some(pid(1)), 2, alive));
        let a = take(&mut l, Some(pid(1)), &none, &mut next).unwrap();
        let b = take(&mut l, Some(pid(1)), &none, &mut next).unwrap();
        l.retire(Some(pid(1)), a);
        assert!(l.room(Some(pid(1)), 2, alive), "one behind");
        l.retire(Some(pid(1)), b);
        assert!(!l.room(Some(pid(1)), 2, alive), "two behind");
        assert!(
            l.room(Some(pid(2)), 2, alive),
            "another peer's backlog is its own"
        );
        let _c = take(&mut l, Some(pid(2)), &none, &mut next).unwrap();
        assert!(!l.room(Some(pid(2)), 2, alive), "none left to take");
        assert_eq!(l.take_retired().len(), 2);
        l.put_back(vec![(Some(pid(1)), a, true), (Some(pid(1)), b, false)]);
        assert!(l.room(Some(pid(1)), 2, alive));
        assert!(
            !l.room(Some(pid(2)), 2, alive),
            "pid 1's free event is not for pid 2"
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Record for waiter `n` (3: nobody in particular).
        Take(u32),
        /// Drop the guard of the `i`th lent event.
        Drop(usize),
        /// The `i`th retired event's work completes, and a sweep runs.
        Done(usize),
        Die(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u32..4).prop_map(Op::Take),
            2 => (0usize..6).prop_map(Op::Drop),
            2 => (0usize..6).prop_map(Op::Done),
            1 => (0u32..3).prop_map(Op::Die),
        ]
    }

    proptest! {
        /// Against a model of each event's last record: an event is recorded again only
        /// once that record completed, and only for the process it was for (or for anyone
        /// once that process is dead, or when it was for nobody in particular); never more
        /// than the limit alive; exhausted only when no event may be taken or made.
        #[test]
        fn events_are_reused_only_as_the_rules_allow(ops in proptest::collection::vec(op(), 1..200)) {
            const LIMIT: usize = 4;
            let mut l: Lending<u32> = Lending::new(LIMIT);
            let mut dead = HashSet::new();
            let mut next = 0;
            // event -> (its last record's waiter, completed)
            let mut last: HashMap<u32, (Waiter, bool)> = HashMap::new();
            let mut lent: Vec<(u32, Waiter)> = Vec::new();
            let mut retired: Vec<u32> = Vec::new();
            let waiter_of = |n: u32| (n < 3).then(|| pid(n));
            for op in ops {
                match op {
                    Op::Take(n) => {
                        let w = waiter_of(n);
                        match take(&mut l, w, &dead, &mut next) {
                            Some(e) => {
                                if let Some(&(was, done)) = last.get(&e) {
                                    prop_assert!(done, "recorded again before its record completed");
                                    prop_assert!(
                                        was == w || was.is_none_or(|p| dead.contains(&p.pid)),
                                        "recorded for {:?}, then for {:?}", was, w
                                    );
                                }
                                last.insert(e, (w, false));
                                lent.push((e, w));
                            }
                            None => {
                                prop_assert_eq!(l.live, LIMIT);
                                // Nothing free that this waiter may take (retired ones are
                                // swept only as the backend does, before a take).
                                let free = last.iter().filter(|(e, (was, done))| {
                                    *done && !lent.iter().any(|(x, _)| x == *e)
                                        && !retired.contains(e)
                                        && (*was == w || was.is_none_or(|p| dead.contains(&p.pid)))
                                }).count();
                                prop_assert_eq!(free, 0);
                            }
                        }
                    }
                    Op::Drop(i) => {
                        if i < lent.len() {
                            let (e, w) = lent.remove(i);
                            l.retire(w, e);
                            retired.push(e);
                        }
                    }
                    Op::Done(i) => {
                        if let Some(&e) = retired.get(i) {
                            last.get_mut(&e).expect("recorded").1 = true;
                        }
                        let queried = l.take_retired().into_iter().map(|(w, e)| {
                            let done = last[&e].1;
                            (w, e, done)
                        }).collect();
                        l.put_back(queried);
                        retired.retain(|e| !last[e].1);
                    }
                    Op::Die(n) => {
                        dead.insert(n);
                    }
                }
                prop_assert!(l.live <= LIMIT);
                prop_assert_eq!(l.live, last.len());
                prop_assert_eq!(l.live - l.free_count(), lent.len() + retired.len());
            }
        }
    }
}
