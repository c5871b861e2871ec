//! Stream ordering across processes: the [`StreamOrdering`] trait, which backends with
//! queued work implement beside [`Backend`](crate::Backend) (reached with
//! [`Backend::ordering`](crate::Backend::ordering); [`NoOrdering`] for host memory), and the
//! vocabulary its operations speak.
//!
//! GPU work is asynchronous: a buffer handed to another process may still be written by
//! work its producer queued, and a buffer given back may still be read by work its borrower
//! queued. Baton orders both directions with fences (see `docs/ORDERING.md`):
//!
//! - **acquire**: the exporter records a fence after the work that produced the buffer
//!   ([`StreamOrdering::export_fence`]); the importer makes each
//!   stream it uses the buffer on wait on it once, before the first use
//!   ([`StreamOrdering::order_after`]);
//! - **release**: each use of a buffer on a stream is followed by a [`UseMark`] recorded on
//!   that stream (cudarc's own `SyncOnDrop` records it after a launch or a copy); giving the
//!   buffer back turns the marks into one [`ExportedFence`] that the other process waits on
//!   before it writes or frees the memory.
//!
//! Streams are named by [`StreamRef`]: the backend's own stream (host copies), a cudarc
//! stream, or a numbered stream of a backend that is not CUDA (test backends that record
//! the order of fence operations).

use crate::Result;
use baton_messages::{FenceHandle, InboxGrant, ProcessId};
use cudarc::driver::{CudaEvent, CudaStream};
use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A stream, as fence operations name it.
#[derive(Clone, Copy)]
pub enum StreamRef<'a> {
    /// The backend's own stream: the one its reads, writes and fills run on (each
    /// synchronised before it returns).
    Internal,
    /// A CUDA stream of the backend's device.
    Cuda(&'a CudaStream),
    /// A stream of a backend that is not CUDA, by that backend's own number for it.
    Id(u64),
}

impl StreamRef<'_> {
    /// Its identity, for bookkeeping.
    pub fn key(&self) -> StreamKey {
        match self {
            StreamRef::Internal => StreamKey::Internal,
            StreamRef::Cuda(s) => StreamKey::Cuda {
                ctx: s.context().cu_ctx() as usize,
                stream: s.cu_stream() as usize,
            },
            StreamRef::Id(n) => StreamKey::Id(*n),
        }
    }
}

impl fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.key().fmt(f)
    }
}

/// A stream kept by whoever must record on it later (a lease told about a stream with
/// `wait_on` records its release mark there when it drops).
#[derive(Clone)]
pub enum Stream {
    /// The backend's own stream.
    Internal,
    /// A CUDA stream.
    Cuda(Arc<CudaStream>),
    /// A numbered stream of a backend that is not CUDA.
    Id(u64),
}

impl Stream {
    /// Borrowed.
    pub fn as_ref(&self) -> StreamRef<'_> {
        match self {
            Stream::Internal => StreamRef::Internal,
            Stream::Cuda(s) => StreamRef::Cuda(s),
            Stream::Id(n) => StreamRef::Id(*n),
        }
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_ref().fmt(f)
    }
}

impl From<Arc<CudaStream>> for Stream {
    fn from(s: Arc<CudaStream>) -> Self {
        Stream::Cuda(s)
    }
}

impl From<&Arc<CudaStream>> for Stream {
    fn from(s: &Arc<CudaStream>) -> Self {
        Stream::Cuda(Arc::clone(s))
    }
}

/// The identity of a stream, for bookkeeping only: never dereferenced. (A CUDA stream is
/// named by its context and handle; a handle reused after its stream was destroyed names
/// the new stream.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKey {
    /// The backend's own stream.
    Internal,
    /// A CUDA stream: its context's and its own handle, as integers.
    Cuda {
        /// `CUcontext`.
        ctx: usize,
        /// `CUstream`.
        stream: usize,
    },
    /// A numbered stream of a backend that is not CUDA.
    Id(u64),
}

/// A point on one stream of this process after a use of a buffer, re-recorded after each
/// later use on that stream. Local to the process: [`StreamOrdering::export_fence`] turns marks
/// into a fence another process can wait on.
pub trait UseMark: Send + Sync + fmt::Debug {
    /// The stream the mark belongs to.
    fn stream(&self) -> StreamKey;
    /// Records the mark on `stream` (its own) after the work queued there so far.
    ///
    /// # Errors
    /// A backend error.
    fn record(&self, stream: StreamRef<'_>) -> Result<()>;
    /// Makes `stream` wait for the mark's latest record.
    ///
    /// # Errors
    /// A backend error.
    fn order(&self, stream: StreamRef<'_>) -> Result<()>;
    /// Blocks until the mark's latest record has completed.
    ///
    /// # Errors
    /// A backend error.
    fn synchronize(&self) -> Result<()>;
    /// The CUDA event behind the mark, for cudarc's `SyncOnDrop::Record`.
    fn cuda_event(&self) -> Option<&CudaEvent> {
        None
    }
    /// For backends to recognise their own marks.
    fn as_any(&self) -> &dyn Any;
}

/// A fence this process recorded and another process may wait on: an acquire fence in an
/// offer, a release fence in a `Release`. Keep it until the other process has waited on
/// it or has no more reason to (its lease is back); fences that go back to a pool are not
/// recorded again before their work has completed.
pub trait ExportedFence: Send + Sync + fmt::Debug {
    /// What the other process waits on. A capability.
    fn handle(&self) -> FenceHandle;
    /// What this process waits on for the same point (a counter fence recorded for a peer
    /// lies in the peer's inbox; its local twin lies in ours, written when first read or
    /// waited on). For closing a mapping only after our own work on it.
    fn local_handle(&self) -> FenceHandle {
        self.handle()
    }
    /// Whether the work before it has completed.
    ///
    /// # Errors
    /// A backend error.
    fn is_complete(&self) -> Result<bool>;
    /// Blocks until the work before it has completed.
    ///
    /// # Errors
    /// A backend error.
    fn synchronize(&self) -> Result<()>;
}

/// How a backend orders work queued on streams across processes: fences, their inbox
/// lanes, and what a dead or cut producer leaves behind. Implemented by backends with
/// queued work (CUDA, test backends that record the order of fence operations) beside
/// [`Backend`](crate::Backend), and reached from it with
/// [`Backend::ordering`](crate::Backend::ordering). A backend whose memory is written
/// synchronously (host) implements none of it: its `ordering()` is [`NoOrdering`].
///
/// Every method has a default, which is what a backend without that kind of fence does
/// (nothing, "ready", or `None`): an implementation overrides those it has.
pub trait StreamOrdering: Send + Sync + fmt::Debug {
    /// Orders the work queued on `stream` from now on after `fence`, which `producer`
    /// recorded (CUDA: `cuStreamWaitEvent` on the opened interprocess event, or
    /// `cuStreamWaitValue64` on the mapped counter; `producer` may be this process).
    /// Backends whose memory is written synchronously (host) do nothing.
    ///
    /// # Errors
    /// A backend error (the fence cannot be opened, …).
    fn order_after(
        &self,
        stream: StreamRef<'_>,
        producer: &ProcessId,
        fence: &FenceHandle,
    ) -> Result<()> {
        let _ = (stream, producer, fence);
        Ok(())
    }
    /// Opens what waiting on `fence` (recorded by `producer`) needs — another process's
    /// event or counter slab — so that a later [`order_after`](Self::order_after) on a
    /// thread that must not block finds it open. Backends without fences do nothing.
    ///
    /// # Errors
    /// A backend error (the fence cannot be opened).
    fn prepare_fence(&self, producer: &ProcessId, fence: &FenceHandle) -> Result<()> {
        let _ = (producer, fence);
        Ok(())
    }
    /// Whether waiting on `fence` needs nothing opened first (it was
    /// [prepared](Self::prepare_fence), or is this process's own), so that
    /// [`order_after`](Self::order_after) on it makes no driver call that blocks. Backends
    /// without fences: always.
    fn fence_prepared(&self, producer: &ProcessId, fence: &FenceHandle) -> bool {
        let _ = (producer, fence);
        true
    }
    /// A new mark for uses of a buffer on `stream` (see [`UseMark`]), or `None` for backends
    /// without queued work (host).
    ///
    /// # Errors
    /// A backend error.
    fn use_mark(&self, stream: StreamRef<'_>) -> Result<Option<Box<dyn UseMark>>> {
        let _ = stream;
        Ok(None)
    }
    /// A fence process `to` can wait on, complete once the latest record of every mark in
    /// `after` has completed (CUDA: a release stream of the backend's waits on the marks'
    /// events, then writes a counter into `to`'s fence inbox — or records a pooled
    /// interprocess event, also where `to` lent us no inbox lane we can use). `to` may be
    /// this process (a fence waited on here). `None` when `after` is empty or the backend
    /// has no fences. Never blocks on queued work.
    ///
    /// # Errors
    /// A backend error ([`Error::EventsExhausted`](crate::Error::EventsExhausted) when
    /// every pooled event is in use;
    /// [`Error::EventAcrossPidNamespaces`](crate::Error::EventAcrossPidNamespaces) where
    /// the fence would be an event and `to` lives in another PID namespace).
    fn export_fence(
        &self,
        after: &[&dyn UseMark],
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let _ = (after, to);
        Ok(None)
    }
    /// A fence for process `to` written on `stream` itself, after the work queued there so
    /// far: no mark and no release stream (CUDA counter fences: one `cuStreamWriteValue64`
    /// into `to`'s inbox, from a lane slot that only `stream` writes while it holds it).
    /// `None` when the backend has no such fence for `stream` now — event fences, `to` is
    /// this process or lent us no lane, every stream slot is held by a stream still busy:
    /// then record a mark there and use [`export_fence`](Self::export_fence). The backend
    /// may keep `stream` alive for as long as its slot is bound to it. Never blocks on
    /// queued work.
    ///
    /// # Errors
    /// A backend error (the stream is not of the backend's device, …).
    fn export_fence_on(
        &self,
        stream: &Stream,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let _ = (stream, to);
        Ok(None)
    }
    /// A fence for `to` that completes once `fence` (which `producer` recorded for this
    /// process) has: how a relay passes an acquire fence on, and how a fence a user
    /// recorded here becomes one a peer can wait on. `None` for backends without fences.
    ///
    /// # Errors
    /// As [`order_after`](Self::order_after) and [`export_fence`](Self::export_fence).
    fn relay_fence(
        &self,
        producer: &ProcessId,
        fence: &FenceHandle,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let _ = (producer, fence, to);
        Ok(None)
    }
    /// The lane of this backend's fence inbox lent to `peer` (see [`crate::inbox`]), the
    /// same each time while it is live; `None` for backends without counter fences, or
    /// when every lane was lent. Sent to `peer` once per link.
    fn inbox_grant(&self, peer: &ProcessId) -> Option<InboxGrant> {
        let _ = peer;
        None
    }
    /// `peer` lent us `grant`: counter fences recorded for `peer` are written there. May
    /// open `peer`'s inbox (a driver call that may block: call it on a driver thread; a
    /// fence recorded before it finishes opens it then).
    ///
    /// # Errors
    /// A backend error (the inbox cannot be opened).
    fn accept_inbox(&self, peer: &ProcessId, grant: &InboxGrant) -> Result<()> {
        let _ = (peer, grant);
        Ok(())
    }
    /// Checks a fence `producer` sent (on an offer or a release) before anything waits on
    /// it, and notes its value (see [`crate::inbox::Lanes::announce`]). An event named
    /// again is a new record made after the older ones completed (the wire's rule,
    /// `docs/ORDERING.md`): our waits on those are released here.
    ///
    /// # Errors
    /// [`Error::FenceRefused`](crate::Error::FenceRefused): the peer's fault.
    fn check_fence(&self, producer: &ProcessId, fence: &FenceHandle) -> Result<()> {
        let _ = (producer, fence);
        Ok(())
    }
    /// Whether a fence for process `to` can be made now without running a pool dry or
    /// deepening a backlog the GPU works through slowly: `false` asks a sender to wait
    /// (asynchronously, never on an actor's thread) before it offers a buffer to `to`.
    /// CUDA event fences: an event for `to` can be had, and fewer than the backend's
    /// event backlog (`CudaBackendBuilder::event_backlog`) of the events lent to `to` wait
    /// for their work. Backends whose fences lend nothing: always.
    fn fence_room(&self, to: &ProcessId) -> bool {
        let _ = to;
        true
    }
    /// Adds where the backend reports a producer that named fence values and did not
    /// deliver them within the fence deadline (its waits are released already): each node
    /// on the backend cuts its links to it.
    fn add_fence_fault_hook(&self, hook: FenceFaultHook) {
        let _ = hook;
    }
    /// `process` is cut while it may be alive: every wait of ours on its fences is
    /// released now, and its fences guard memory until it dies
    /// ([`unsafe_to_free`](Self::unsafe_to_free)).
    fn producer_cut(&self, process: &ProcessId) {
        let _ = process;
    }
    /// Whether memory that `fence` (from `producer`) guards must not be freed yet: our wait
    /// on it was released while `producer` was alive, so its work may still run.
    fn unsafe_to_free(&self, producer: &ProcessId, fence: &FenceHandle) -> bool {
        let _ = (producer, fence);
        false
    }
    /// Waits, at most `within`, until the fences this backend recorded for other processes
    /// have been written (their work completed): what a closing node does so that its
    /// peers need not wait out their deadline. Returns whether they all were.
    ///
    /// # Errors
    /// A backend error.
    fn flush_fences(&self, within: Duration) -> Result<bool> {
        let _ = within;
        Ok(true)
    }
    /// Polls, on the calling thread and for at most a bound of the backend's own (CUDA:
    /// twice the fence deadline, and a second), until this process's own `fences` have
    /// landed — with `all`, every fence the backend has recorded so far. Returns whether
    /// they did. What a mapping's close waits on before it unmaps: never a wait queued on
    /// a stream, which would order the backend's stream after a release stream (or a
    /// pooled event's latest record) that may itself be waiting on work queued on that
    /// stream later — a cycle inside one process, which no fence deadline releases.
    ///
    /// # Errors
    /// A backend error.
    fn own_fences_landed(&self, fences: &[FenceHandle], all: bool) -> Result<bool> {
        let _ = (fences, all);
        Ok(true)
    }
    /// Blocks until the work queued on the backend's own stream has completed.
    ///
    /// # Errors
    /// A backend error, including errors of that work.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// If `process` is dead, releases at once every stream of ours still waiting on its
    /// fences (CUDA counter fences: their values will never come). Quick (no wait on other
    /// work), so it may run on any thread, and must not queue behind driver-thread work
    /// that may itself wait on those streams. Called by
    /// [`ImportCache::release_dead`](crate::ImportCache::release_dead).
    fn release_dead(&self, process: &ProcessId) {
        let _ = process;
    }
}

/// The ordering of a backend whose memory is written synchronously (host): every
/// [`StreamOrdering`] operation does nothing — no wait, no mark, no fence — and every
/// question answers "ready" (the trait's defaults).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoOrdering;

impl StreamOrdering for NoOrdering {}

/// Told of a producer that did not deliver its fences within the deadline
/// ([`StreamOrdering::add_fence_fault_hook`]). Called on the backend's watch thread: it
/// must not block.
pub type FenceFaultHook = Arc<dyn Fn(ProcessId) + Send + Sync>;
