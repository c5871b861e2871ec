//! The CUDA backend's fence service, [`Fences`]: everything that orders work queued on
//! streams across processes — the pooled interprocess events, the use marks, the release
//! streams, the fence inbox (counter fences) and the peers' inboxes we write into, the
//! bridge of waits on other processes' events, the events of other processes we opened —
//! and the [`StreamOrdering`] impl a [`CudaBackend`](super::CudaBackend) hands out from
//! [`Backend::ordering`](crate::Backend::ordering). The backend holds one and delegates its
//! public fence methods (`record_fence`, `wait_fence_on`, …) to it.
//!
//! It shares the backend's context and own stream ([`Access`]) and owns nothing of the
//! backend's memory: what a forgotten process leaves in the memory half (imported pools,
//! the export pool) the backend drops itself, before it asks this service to forget the
//! rest ([`Fences::forget_process`]).

use super::bridge::Bridge;
use super::context::{ContextGuard, KeepCurrent, Quiet};
use super::event::{self, EventPool, OpenedEvent, RecordedEvent};
use super::fence::{self, FenceKind, OpenedSlab, PeerFence, RecordedFence, TwinState};
use super::inbox::Inbox;
use super::mark::MarkPool;
use super::memory::Access;
use super::result::{self, CudaError, StreamMemOps};
use super::table::OnceTable;
use super::{SharedStream, lock};
use crate::ordering::{ExportedFence, FenceFaultHook, StreamOrdering, StreamRef, UseMark};
use crate::{Error, Result};
use baton_messages::{DeviceUuid, FenceHandle, InboxGrant, IpcEventHandle, ProcessId};
use cudarc::driver::{CudaStream, sys};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// How many opened events of other processes a backend keeps before it drops them all
/// (destroying an opened event is safe even while a stream waits on it).
const OPENED_EVENT_CAP: usize = 4096;

/// How many release streams a backend has (see `Fences::release_streams`).
const RELEASE_STREAMS: usize = 4;

/// How long a death waits for our release streams to drain before closing the dead
/// peer's inbox mapping (else it is closed at a later death, or with the backend).
const DYING_INBOX_WAIT: Duration = Duration::from_millis(200);

/// What [`Fences::new`] takes from the backend's builder (its settings of the same names:
/// [`CudaBackendBuilder`](super::CudaBackendBuilder)), so that the builder, which makes the
/// fences, is above this module and not beside it.
pub(super) struct FenceSettings {
    pub(super) ordinal: usize,
    pub(super) fence: FenceKind,
    pub(super) event_limit: usize,
    pub(super) counter_slots: usize,
    pub(super) inbox_lanes: usize,
    pub(super) fence_deadline: Duration,
    pub(super) event_backlog: usize,
    /// Streams at once that may write fences themselves ([`StreamOrdering::export_fence_on`]):
    /// each holds a lane slot of every peer's inbox, and a local mark of ours, after the
    /// release streams'.
    pub(super) stream_slots: usize,
}

/// The fence service of a [`CudaBackend`](super::CudaBackend) (module docs).
pub(super) struct Fences {
    /// The backend's context and own stream (shared with its memory).
    access: Access,
    dev: sys::CUdevice,
    /// The fences `record_fence` records (after any fallback).
    fence: FenceKind,
    /// The 64-bit stream memory operations the device supports, if any.
    stream_ops: Option<StreamMemOps>,
    waits: AtomicU64,
    events: Arc<EventPool>,
    /// Use marks: local events recorded after each use of a buffer on a stream.
    marks: Arc<MarkPool>,
    /// Streams of the backend's own on which marks become interprocess fences
    /// ([`StreamOrdering::export_fence`]), made on first use; a mark's stream picks one, so
    /// that fences of one user stream wait in that stream's order, and fences of others do
    /// not queue behind them.
    release_streams: [OnceLock<SharedStream>; RELEASE_STREAMS],
    /// The fence inbox (counter fences only), made with the backend.
    inbox: Option<Inbox>,
    /// Which stream each stream slot was last bound to (a hint: the binding itself is the
    /// slot's local mark's, under its lock), and where the next claim starts looking.
    stream_slots: Mutex<(Vec<Option<crate::ordering::StreamKey>>, usize)>,
    /// Waits on other processes' interprocess events, released by us alone.
    bridge: Bridge,
    /// The fence deadline (bounds how long a close polls our own fences).
    fence_deadline: Duration,
    /// [`CudaBackendBuilder::event_backlog`](super::CudaBackendBuilder::event_backlog).
    event_backlog: usize,
    opened_events: OnceTable<(ProcessId, [u8; 64]), OpenedEvent>,
    /// Peers' fence inboxes we write into, by (process, slab id); closed once the peer
    /// is dead and no write of ours to it is queued (a mapping of a dead process's memory
    /// pins it on the device).
    peer_inboxes: OnceTable<(ProcessId, u64), OpenedSlab>,
    /// Dead peers' inboxes whose close waits for our release streams to drain.
    dying_inboxes: Mutex<Vec<Arc<OpenedSlab>>>,
}

impl fmt::Debug for Fences {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fences")
            .field("fence", &self.fence)
            .field("waits", &self.waits())
            .field("events", &self.events)
            .finish()
    }
}

impl Fences {
    /// The fence service of a backend on `access`'s context (device `dev`, named
    /// `device`), as `b` asks: counter fences fall back to events on a device without
    /// 64-bit stream memory operations. `side` is the stream the inbox reads its slab back
    /// on and the bridge writes on.
    ///
    /// # Errors
    /// [`Error::Cuda`] if a stream, the inbox or its slab cannot be made.
    pub(super) fn new(
        access: &Access,
        dev: sys::CUdevice,
        device: DeviceUuid,
        side: SharedStream,
        b: &FenceSettings,
    ) -> Result<Self> {
        let ordinal = b.ordinal;
        let ctx = &access.ctx;
        // SAFETY: the driver is initialised; `dev` comes from the context.
        let stream_ops = unsafe { result::stream_mem_ops(dev) }?;
        let fence = match (b.fence, stream_ops) {
            (FenceKind::Counter, None) => {
                tracing::info!(
                    device = ordinal,
                    "device {ordinal} has no 64-bit stream memory operations: counter fences fall back to IPC events"
                );
                FenceKind::Event
            }
            (kind, _) => kind,
        };
        let inbox = match (fence, stream_ops) {
            (FenceKind::Counter, Some(ops)) => {
                let keep = KeepCurrent::new()?;
                let watch = ctx
                    .new_stream()
                    .map_err(result::from_driver("cuStreamCreate"))?;
                drop(keep);
                Some(Inbox::new(
                    ctx,
                    device,
                    ops,
                    Arc::clone(&side),
                    Arc::new(Quiet::new(watch)),
                    RELEASE_STREAMS + b.stream_slots,
                    b.counter_slots,
                    b.inbox_lanes,
                    b.fence_deadline,
                )?)
            }
            _ => None,
        };
        let bridge = Bridge::new(ctx, stream_ops, side, b.fence_deadline);
        Ok(Self {
            fence,
            dev,
            stream_ops,
            events: EventPool::new(Arc::clone(ctx), b.event_limit),
            marks: MarkPool::new(Arc::clone(ctx), Arc::clone(&access.stream)),
            release_streams: Default::default(),
            access: access.clone(),
            waits: AtomicU64::new(0),
            inbox,
            stream_slots: Mutex::new((vec![None; b.stream_slots], 0)),
            bridge,
            fence_deadline: b.fence_deadline,
            event_backlog: b.event_backlog,
            opened_events: OnceTable::default(),
            peer_inboxes: OnceTable::default(),
            dying_inboxes: Mutex::new(Vec::new()),
        })
    }

    /// [`CudaBackend::fence_kind`](super::CudaBackend::fence_kind).
    pub(super) fn fence_kind(&self) -> FenceKind {
        self.fence
    }

    /// [`CudaBackend::waits`](super::CudaBackend::waits).
    pub(super) fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    /// [`CudaBackend::record_event`](super::CudaBackend::record_event).
    pub(super) fn record_event(&self) -> Result<RecordedEvent> {
        self.events.record_for(&self.access.stream, None)
    }

    /// [`CudaBackend::record_event_on`](super::CudaBackend::record_event_on).
    pub(super) fn record_event_on(&self, stream: &CudaStream) -> Result<RecordedEvent> {
        self.events.record_for(stream, None)
    }

    /// [`CudaBackend::record_fence`](super::CudaBackend::record_fence).
    pub(super) fn record_fence(&self) -> Result<RecordedFence> {
        self.record_fence_on(&self.access.stream)
    }

    /// [`CudaBackend::record_fence_on`](super::CudaBackend::record_fence_on).
    pub(super) fn record_fence_on(&self, stream: &CudaStream) -> Result<RecordedFence> {
        match self.fence {
            FenceKind::Event => Ok(RecordedFence::from_event(
                self.events.record_for(stream, None)?,
            )),
            FenceKind::Counter => self.inbox()?.slab().record(stream),
        }
    }

    /// [`CudaBackend::record_fence_for`](super::CudaBackend::record_fence_for).
    pub(super) fn record_fence_for(
        &self,
        stream: &CudaStream,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        if self.fence == FenceKind::Event {
            return self.event_for(stream, to).map(Some);
        }
        let own = self.record_fence_on(stream)?;
        if *to == crate::process::current() {
            return Ok(Some(Arc::new(own)));
        }
        let me = crate::process::current();
        StreamOrdering::relay_fence(self, &me, &own.handle(), to)
    }

    /// A pooled interprocess event recorded on `stream` for `to` to wait on.
    ///
    /// # Errors
    /// [`Error::EventAcrossPidNamespaces`] if `to` lives in another PID namespace;
    /// [`Error::EventsExhausted`]; a driver error recording it.
    fn event_for(&self, stream: &CudaStream, to: &ProcessId) -> Result<Arc<dyn ExportedFence>> {
        no_event_across_pid_namespaces(to)?;
        Ok(Arc::new(self.events.record_for(stream, waiter(to))?))
    }

    /// [`CudaBackend::fence_counts`](super::CudaBackend::fence_counts).
    pub(super) fn fence_counts(&self) -> (usize, usize) {
        match (self.fence, self.inbox.as_ref().map(Inbox::slab)) {
            (FenceKind::Counter, Some(slab)) => {
                if let Err(e) = slab.sweep() {
                    tracing::warn!(error = %e, "reading the counter slab back failed");
                }
                slab.counts()
            }
            (FenceKind::Counter, None) => (0, 0),
            (FenceKind::Event, _) => self.events.counts(),
        }
    }

    /// [`CudaBackend::wait_fence`](super::CudaBackend::wait_fence).
    pub(super) fn wait_fence(&self, exporter: &ProcessId, fence: &FenceHandle) -> Result<()> {
        self.wait_fence_on(exporter, fence, &self.access.stream)
    }

    /// [`CudaBackend::wait_fence_on`](super::CudaBackend::wait_fence_on).
    pub(super) fn wait_fence_on(
        &self,
        exporter: &ProcessId,
        fence: &FenceHandle,
        stream: &CudaStream,
    ) -> Result<()> {
        let own = *exporter == crate::process::current();
        match fence {
            FenceHandle::Event(handle) => {
                let local = if own {
                    event::local_event(&handle.0)
                } else {
                    None
                };
                match local {
                    Some(ev) => ev.wait_on(stream)?,
                    // Never `cuStreamWaitEvent` on another process's event: a wait its
                    // waiter can release (`cuda/bridge.rs`).
                    None => {
                        no_event_across_pid_namespaces(exporter)?;
                        self.bridge
                            .wait(exporter, &self.opened_event(exporter, handle)?, stream)?
                    }
                }
            }
            FenceHandle::Counter(counter) => {
                if self.stream_ops.is_none() {
                    return Err(Error::Cuda {
                        op: "cuStreamWaitValue64",
                        code: CudaError::NOT_SUPPORTED,
                    });
                }
                match self.inbox.as_ref().filter(|i| i.is_ours(counter)) {
                    Some(inbox) => {
                        if !own {
                            inbox.may_wait(exporter, counter)?;
                            if inbox.is_released(exporter, counter) {
                                // Released: it passes (or, for a value named after the
                                // release, never would): no wait is queued.
                                return Ok(());
                            }
                        }
                        inbox.slab().wait(counter.offset, counter.value, stream)?;
                    }
                    // Another backend's slab in this process.
                    None => match fence::local_slab(counter.slab_id).filter(|_| own) {
                        Some(slab) => slab.wait(counter.offset, counter.value, stream)?,
                        None => {
                            return Err(Error::FenceRefused {
                                producer: *exporter,
                                reason: crate::inbox::FenceRefusal::ForeignSlab,
                            });
                        }
                    },
                }
            }
        }
        self.waits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// [`CudaBackend::event_counts`](super::CudaBackend::event_counts).
    pub(super) fn event_counts(&self) -> (usize, usize) {
        self.events.counts()
    }

    /// [`CudaBackend::opened_events`](super::CudaBackend::opened_events).
    pub(super) fn opened_events(&self) -> usize {
        self.opened_events.len()
    }

    /// The fence inbox.
    fn inbox(&self) -> Result<&Inbox> {
        self.inbox.as_ref().ok_or(Error::Cuda {
            op: "cuStreamWriteValue64",
            code: CudaError::NOT_SUPPORTED,
        })
    }

    /// `peer`'s inbox mapped here, opened on first use, with its grant; `None` if `peer`
    /// lent us none.
    fn peer_inbox(&self, peer: &ProcessId) -> Result<Option<(Arc<OpenedSlab>, InboxGrant)>> {
        let Some(inbox) = &self.inbox else {
            return Ok(None);
        };
        let Some(grant) = inbox.peer_grant(peer) else {
            return Ok(None);
        };
        let ops = self.stream_ops.ok_or(Error::Cuda {
            op: "cuStreamWriteValue64",
            code: CudaError::NOT_SUPPORTED,
        })?;
        let slab = self.peer_inboxes.get_or_open(&(*peer, grant.slab_id), || {
            OpenedSlab::open(&self.access.ctx, &grant.slab, ops).map(Arc::new)
        })?;
        Ok(Some((slab, grant)))
    }

    /// Whether a fence this process recorded has landed. One whose event or slab is gone
    /// counts as landed: nothing of ours can wait on it any more.
    fn own_fence_landed(&self, fence: &FenceHandle) -> Result<bool> {
        match fence {
            FenceHandle::Event(handle) => match event::local_event(&handle.0) {
                Some(ev) => ev.is_complete(),
                None => Ok(true),
            },
            FenceHandle::Counter(counter) => {
                let slab = match self.inbox.as_ref().filter(|i| i.is_ours(counter)) {
                    Some(inbox) => Some(Arc::clone(inbox.slab())),
                    None => fence::local_slab(counter.slab_id),
                };
                match slab {
                    Some(slab) => slab.holds(counter.offset, counter.value),
                    None => Ok(true),
                }
            }
        }
    }

    /// Release stream `i` (waited on what the fence must follow, its mark lock held)
    /// records a counter fence for `to`: written into `to`'s inbox with its local twin in
    /// ours, a fence in our own slab when `to` is us, or — without a usable lane from
    /// `to` — a pooled interprocess event.
    fn fence_on(
        &self,
        i: usize,
        stream: &SharedStream,
        mark: &mut MutexGuard<'_, TwinState>,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        // Only counter backends have an inbox, whose mark lock the caller holds.
        let inbox = self.inbox()?;
        if *to == crate::process::current() {
            return Ok(Some(Arc::new(inbox.slab().record(stream)?)));
        }
        let lane = match self.peer_inbox(to)? {
            Some((slab, grant)) => inbox
                .next_peer_value(to, i)
                .filter(|h| h.slab_id == grant.slab_id)
                .map(|h| (slab, h)),
            None => None,
        };
        match lane {
            Some((slab, handle)) => {
                slab.write_on(handle.offset, handle.value, stream)?;
                let local = inbox.write_mark(mark, i, stream);
                Ok(Some(Arc::new(PeerFence { handle, local })))
            }
            // `to` lent us no lane we can use (none, several, or it is gone): a pooled
            // interprocess event, which any process can wait on, and nothing blocks here.
            // (Its waiter bridges the wait through memory of its own: `cuda/bridge.rs`.)
            None => self.event_for(stream, to).map(Some),
        }
    }

    /// `exporter`'s event, opened once (`cuIpcOpenEventHandle`) and kept until the
    /// process is forgotten, or until the cache of opened events is full.
    fn opened_event(
        &self,
        exporter: &ProcessId,
        handle: &IpcEventHandle,
    ) -> Result<Arc<OpenedEvent>> {
        let key = (*exporter, handle.0);
        if let Some(ev) = self.opened_events.get(&key) {
            return Ok(ev);
        }
        if self.opened_events.len() >= OPENED_EVENT_CAP {
            tracing::debug!(cap = OPENED_EVENT_CAP, "dropping cached opened events");
            // Destroyed here, with no lock held.
            drop(self.opened_events.take_where(|_| true));
        }
        self.opened_events.get_or_open(&key, || {
            OpenedEvent::open(&self.access.ctx, &handle.0).map(Arc::new)
        })
    }

    /// The CUDA stream a [`StreamRef`] names: the backend's own, or the caller's (which
    /// must be of the backend's device).
    fn stream_of<'a>(&'a self, stream: StreamRef<'a>, op: &'static str) -> Result<&'a CudaStream> {
        match stream {
            StreamRef::Internal => Ok(&self.access.stream),
            StreamRef::Cuda(s) if s.context().cu_device() == self.dev => Ok(s),
            StreamRef::Cuda(_) => Err(Error::Cuda {
                op,
                code: CudaError::INVALID_CONTEXT,
            }),
            StreamRef::Id(_) => Err(Error::Cuda {
                op,
                code: CudaError::INVALID_VALUE,
            }),
        }
    }

    /// The release stream for marks of `stream` (made on first use), and its index.
    fn release_stream(&self, stream: crate::ordering::StreamKey) -> Result<(usize, SharedStream)> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(stream);
        let i = (hash as usize) % RELEASE_STREAMS;
        let slot = &self.release_streams[i];
        if let Some(s) = slot.get() {
            return Ok((i, Arc::clone(s)));
        }
        // cudarc binds the context to make a stream: put the caller's back.
        let keep = KeepCurrent::new()?;
        let made = self
            .access
            .ctx
            .new_stream()
            .map_err(result::from_driver("cuStreamCreate"))?;
        drop(keep);
        // Two threads may race here: the loser's stream is dropped (quietly).
        let made: SharedStream = Arc::new(Quiet::new(made));
        Ok((i, Arc::clone(slot.get_or_init(|| made))))
    }

    /// The stream slot bound to `cuda` (`key`), with its local mark's lock held: the one it
    /// was bound to before if it still is, else the first slot from a rotating start that
    /// [`CounterSlab::bind`](super::fence::CounterSlab::bind) lets it take. `None` if none
    /// does.
    fn stream_slot<'a>(
        &self,
        inbox: &'a Inbox,
        key: crate::ordering::StreamKey,
        cuda: &CudaStream,
        make: impl Fn() -> SharedStream,
    ) -> Result<Option<(usize, MutexGuard<'a, TwinState>)>> {
        let cu = cuda.cu_stream();
        let known = lock(&self.stream_slots)
            .0
            .iter()
            .position(|k| *k == Some(key));
        if let Some(k) = known {
            let held = inbox.mark_lock(RELEASE_STREAMS + k);
            if fence::CounterSlab::bound_to(&held, cu) {
                return Ok(Some((RELEASE_STREAMS + k, held)));
            }
        }
        let mut slots = lock(&self.stream_slots);
        let (count, start) = (slots.0.len(), slots.1);
        for n in 0..count {
            let k = (start + n) % count;
            let mut held = inbox.mark_lock(RELEASE_STREAMS + k);
            if inbox.slab().bind(&mut held, cu, &make)? {
                slots.0[k] = Some(key);
                slots.1 = (k + 1) % count;
                return Ok(Some((RELEASE_STREAMS + k, held)));
            }
        }
        Ok(None)
    }

    /// The fence half of [`Backend::forget_process`](crate::Backend::forget_process) (the
    /// backend dropped the process's pools already): drops the process's opened events
    /// and releases every wait of ours on its counter fences if it is `dead`
    /// ([`release_dead`](StreamOrdering::release_dead)); a dead process's lane is forgotten
    /// and its inbox mapping closed once our release streams drained.
    pub(super) fn forget_process(&self, process: &ProcessId, dead: bool) {
        let of = |p: &ProcessId| p == process;
        drop(self.opened_events.take_where(|(p, _)| of(p)));
        self.release_dead(process);
        if dead {
            if let Some(inbox) = &self.inbox {
                inbox.forget_peer(process);
            }
            let mut dying = lock(&self.dying_inboxes);
            dying.extend(self.peer_inboxes.take_where(|(p, _)| of(p)));
            // Writes of ours into them may still be queued: close them once every release
            // stream has drained (now, or at a later death; else when the backend drops).
            if !dying.is_empty() && matches!(self.flush_fences(DYING_INBOX_WAIT), Ok(true)) {
                dying.clear();
            }
        }
    }
}

impl StreamOrdering for Fences {
    /// [`wait_fence_on`](Fences::wait_fence_on) `stream` (the backend's own for
    /// [`StreamRef::Internal`]). Events and counter slabs of other processes are opened once
    /// and kept until [`forget_process`](crate::Backend::forget_process); this process's own are
    /// used directly.
    fn order_after(
        &self,
        stream: StreamRef<'_>,
        producer: &ProcessId,
        fence: &FenceHandle,
    ) -> Result<()> {
        let stream = self.stream_of(stream, "cuStreamWaitEvent")?;
        self.wait_fence_on(producer, fence, stream)
    }

    /// `cuIpcOpenEventHandle` of another process's event, once per (process, event);
    /// nothing for counter fences (they lie in our own inbox) or this process's own.
    fn prepare_fence(&self, producer: &ProcessId, fence: &FenceHandle) -> Result<()> {
        if *producer == crate::process::current() {
            return Ok(());
        }
        match fence {
            FenceHandle::Event(handle) => self.opened_event(producer, handle).map(drop),
            FenceHandle::Counter(_) => Ok(()),
        }
    }

    /// Another process's event is open already; counter fences need nothing opened.
    fn fence_prepared(&self, producer: &ProcessId, fence: &FenceHandle) -> bool {
        if *producer == crate::process::current() {
            return true;
        }
        match fence {
            FenceHandle::Event(handle) => self.opened_events.get(&(*producer, handle.0)).is_some(),
            FenceHandle::Counter(_) => true,
        }
    }

    /// A pooled cudarc event of the backend's context (`cuEventCreate` on first use), for
    /// `stream`, a stream of the backend's context.
    fn use_mark(&self, stream: StreamRef<'_>) -> Result<Option<Box<dyn UseMark>>> {
        self.stream_of(stream, "cuEventRecord")?;
        Ok(Some(Box::new(self.marks.lend(stream)?)))
    }

    /// One of the backend's release streams waits on every mark (`cuStreamWaitEvent`), then
    /// records a fence of the backend's kind there: a counter written into `to`'s inbox
    /// (`cuStreamWriteValue64`, with its local twin in ours), or a pooled interprocess
    /// event (`cuEventRecord`, retired, not freed, when the fence drops: recorded again
    /// only once this work has completed). A counter slot of a lane is written by one
    /// release stream only, under its lock, so its values land in order.
    fn export_fence(
        &self,
        after: &[&dyn UseMark],
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let Some(first) = after.first() else {
            return Ok(None);
        };
        let (i, stream) = self.release_stream(first.stream())?;
        let Some(inbox) = &self.inbox else {
            for mark in after {
                mark.order(StreamRef::Cuda(&stream))?;
            }
            return self.event_for(&stream, to).map(Some);
        };
        let mut held = inbox.mark_lock(i);
        for mark in after {
            mark.order(StreamRef::Cuda(&stream))?;
        }
        self.fence_on(i, &stream, &mut held, to)
    }

    /// `stream` writes the counter into `to`'s inbox itself, from the lane slot of the
    /// stream slot bound to it (bound now if one is free or held by a stream that ran
    /// everything queued on it), with its local twin promised in ours: one
    /// `cuStreamWriteValue64`. `None` for event fences, for this process, without a lane
    /// from `to`, for a stream of another context, and while every stream slot is held by
    /// a busy stream.
    fn export_fence_on(
        &self,
        stream: &crate::ordering::Stream,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        use crate::ordering::Stream;
        let Some(inbox) = &self.inbox else {
            return Ok(None);
        };
        if *to == crate::process::current() {
            return Ok(None);
        }
        let cuda: &CudaStream = match stream {
            Stream::Internal => &self.access.stream,
            Stream::Cuda(s) if s.context().cu_ctx() == self.access.ctx.cu_ctx() => s,
            Stream::Cuda(_) | Stream::Id(_) => return Ok(None),
        };
        let Some((slab, grant)) = self.peer_inbox(to)? else {
            return Ok(None);
        };
        let make = || -> SharedStream {
            match stream {
                Stream::Cuda(s) => Arc::new(Quiet::new(Arc::clone(s))),
                _ => Arc::clone(&self.access.stream),
            }
        };
        let Some((i, mut held)) = self.stream_slot(inbox, stream.as_ref().key(), cuda, make)?
        else {
            return Ok(None);
        };
        let Some(handle) = inbox
            .next_peer_value(to, i)
            .filter(|h| h.slab_id == grant.slab_id)
        else {
            return Ok(None);
        };
        slab.write_on(handle.offset, handle.value, cuda)?;
        let bound = held.stream.clone().expect("bound by stream_slot");
        let local = inbox.write_mark(&mut held, i, &bound);
        Ok(Some(Arc::new(PeerFence { handle, local })))
    }

    /// A release stream waits on `fence`, then records a fence for `to` (as
    /// [`export_fence`](StreamOrdering::export_fence)).
    fn relay_fence(
        &self,
        producer: &ProcessId,
        fence: &FenceHandle,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let (i, stream) = self.release_stream(crate::ordering::StreamKey::Internal)?;
        let Some(inbox) = &self.inbox else {
            self.wait_fence_on(producer, fence, &stream)?;
            return self.event_for(&stream, to).map(Some);
        };
        // A local twin of ours is written when waited on, under its release stream's lock:
        // queue that write before taking ours (it may be the same lock).
        if let FenceHandle::Counter(c) = fence
            && *producer == crate::process::current()
            && inbox.is_ours(c)
        {
            inbox.slab().settle(c.offset, c.value)?;
        }
        let mut held = inbox.mark_lock(i);
        self.wait_fence_on(producer, fence, &stream)?;
        self.fence_on(i, &stream, &mut held, to)
    }

    /// None for this process itself (its fences for itself use its own slots).
    fn inbox_grant(&self, peer: &ProcessId) -> Option<InboxGrant> {
        if *peer == crate::process::current() {
            return None;
        }
        self.inbox.as_ref()?.grant(peer)
    }

    /// Notes the grant, and maps the peer's inbox (`cuIpcOpenMemHandle_v2`, once per
    /// (process, slab)).
    fn accept_inbox(&self, peer: &ProcessId, grant: &InboxGrant) -> Result<()> {
        let Some(inbox) = &self.inbox else {
            return Ok(());
        };
        if *peer == crate::process::current() {
            return Ok(());
        }
        inbox.accept(peer, grant);
        self.peer_inbox(peer).map(drop)
    }

    fn check_fence(&self, producer: &ProcessId, fence: &FenceHandle) -> Result<()> {
        if *producer == crate::process::current() {
            // Our own fence (a loopback link): waited on in our own memory.
            return match fence {
                FenceHandle::Counter(c)
                    if self.inbox.as_ref().is_some_and(|i| i.is_ours(c))
                        || fence::local_slab(c.slab_id).is_some() =>
                {
                    Ok(())
                }
                FenceHandle::Counter(_) => Err(Error::FenceRefused {
                    producer: *producer,
                    reason: crate::inbox::FenceRefusal::ForeignSlab,
                }),
                FenceHandle::Event(_) => Ok(()),
            };
        }
        match (fence, &self.inbox) {
            (FenceHandle::Counter(counter), Some(inbox)) => inbox.check(producer, counter),
            (FenceHandle::Counter(_), None) => Err(Error::FenceRefused {
                producer: *producer,
                reason: crate::inbox::FenceRefusal::NoLane,
            }),
            (FenceHandle::Event(handle), _) => {
                // Named again: our waits on its older records are over (`cuda/event.rs`),
                // on a bridge slot or polled on a thread (`wait_here`).
                if let Some(ev) = self.opened_events.get(&(*producer, handle.0)) {
                    ev.renamed();
                }
                self.bridge.renamed(producer, &handle.0);
                Ok(())
            }
        }
    }

    /// Event fences only: counter fences lend nothing for long (a slot comes back when its
    /// value lands, which the GPU does on its own), and a peer without a usable lane is
    /// rare enough to meet `EventsExhausted` instead.
    fn fence_room(&self, to: &ProcessId) -> bool {
        self.fence != FenceKind::Event
            || *to == crate::process::current()
            || self.events.room_for(waiter(to), self.event_backlog)
    }

    fn add_fence_fault_hook(&self, hook: FenceFaultHook) {
        if let Some(inbox) = &self.inbox {
            inbox.add_hook(Arc::clone(&hook));
        }
        self.bridge.add_hook(hook);
    }

    fn producer_cut(&self, process: &ProcessId) {
        if let Some(inbox) = &self.inbox {
            inbox.cut(process);
        }
        self.bridge.cut(process);
    }

    fn unsafe_to_free(&self, producer: &ProcessId, fence: &FenceHandle) -> bool {
        match (fence, &self.inbox) {
            (FenceHandle::Counter(counter), Some(inbox)) => inbox.unsafe_to_free(producer, counter),
            (FenceHandle::Counter(_), None) => false,
            (FenceHandle::Event(_), _) => {
                *producer != crate::process::current() && self.bridge.unsafe_to_free(producer)
            }
        }
    }

    /// Polls the release streams and the streams bound to stream slots (`cuStreamQuery`,
    /// which never blocks) until each has run what it was given, or `within` passed.
    fn flush_fences(&self, within: Duration) -> Result<bool> {
        let until = Instant::now() + within;
        let _pushed = ContextGuard::push(&self.access.ctx)?;
        let mut streams: Vec<SharedStream> = self
            .release_streams
            .iter()
            .filter_map(OnceLock::get)
            .cloned()
            .collect();
        if let Some(inbox) = &self.inbox {
            // Streams that wrote fences themselves (`export_fence_on`).
            let slots = lock(&self.stream_slots).0.len();
            streams.extend(
                inbox
                    .slab()
                    .bound_streams(RELEASE_STREAMS..RELEASE_STREAMS + slots),
            );
        }
        for stream in &streams {
            loop {
                // SAFETY: a live stream of the backend's context, which is current.
                if unsafe { result::stream_query(stream.cu_stream()) }? {
                    break;
                }
                if Instant::now() >= until {
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        Ok(true)
    }

    /// Polls each fence (a counter: its slot read back on the slab's side stream; an
    /// event: `cuEventQuery`), backing off to 1 ms, for at most twice the fence deadline
    /// and a second: our own work waits on peers only until that deadline. With `all`,
    /// polls the release streams instead ([`flush_fences`](StreamOrdering::flush_fences)).
    fn own_fences_landed(&self, fences: &[FenceHandle], all: bool) -> Result<bool> {
        let bound = self.fence_deadline * 2 + Duration::from_secs(1);
        if all {
            return self.flush_fences(bound);
        }
        let until = Instant::now() + bound;
        let mut pause = Duration::from_micros(50);
        loop {
            let mut landed = true;
            for f in fences {
                if !self.own_fence_landed(f)? {
                    landed = false;
                    break;
                }
            }
            if landed {
                return Ok(true);
            }
            if Instant::now() >= until {
                return Ok(false);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.access.synchronize()
    }

    /// If the process is dead (`/proc`), writes `u64::MAX` into the lanes of our inbox it
    /// wrote (a memset on the watch stream, waited for: microseconds), which releases
    /// every stream of ours still waiting on its fences: its queued writes died with it.
    /// Only our own memory is written, and only our own waits are released.
    fn release_dead(&self, process: &ProcessId) {
        if crate::process::liveness(process) != crate::process::Liveness::Dead {
            return;
        }
        if let Some(inbox) = &self.inbox {
            inbox.died(process);
        }
        self.bridge.died(process);
    }
}

/// Refuses an interprocess event to or from `peer` if it lives in another PID namespace
/// (a process Baton watches through a pidfd: `process::is_observed`), before any driver
/// call: the driver keeps the event in its exporter's `/dev/shm` (`cuda.shm.*`), which
/// containers do not share, and an importer that opened one it could not find there was
/// killed by a signal (H200, driver 580) instead of getting an error. Baton cannot tell
/// whether two processes of different PID namespaces share a `/dev/shm`, so no event
/// crosses PID namespaces; counter fences do.
fn no_event_across_pid_namespaces(peer: &ProcessId) -> Result<()> {
    if crate::process::is_observed(peer) {
        return Err(Error::EventAcrossPidNamespaces { peer: *peer });
    }
    Ok(())
}

/// Whom an event recorded for `to` is lent to ([`event`]'s reuse rules): nobody in
/// particular for this process itself (its own waits capture the record when queued).
fn waiter(to: &ProcessId) -> Option<ProcessId> {
    (*to != crate::process::current()).then_some(*to)
}
