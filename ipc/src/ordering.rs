//! Stream ordering across processes: the vocabulary the [`Backend`](crate::Backend) fence
//! operations speak.
//!
//! GPU work is asynchronous: a buffer handed to another process may still be written by
//! work its producer queued, and a buffer given back may still be read by work its borrower
//! queued. Baton orders both directions with fences (see `docs/ORDERING.md`):
//!
//! - **acquire**: the exporter records a fence after the work that produced the buffer
//!   ([`Backend::export_fence`](crate::Backend::export_fence)); the importer makes each
//!   stream it uses the buffer on wait on it once, before the first use
//!   ([`Backend::order_after`](crate::Backend::order_after));
//! - **release**: each use of a buffer on a stream is followed by a [`UseMark`] recorded on
//!   that stream (cudarc's own `SyncOnDrop` records it after a launch or a copy); giving the
//!   buffer back turns the marks into one [`ExportedFence`] that the other process waits on
//!   before it writes or frees the memory.
//!
//! Streams are named by [`StreamRef`]: the backend's own stream (host copies), a cudarc
//! stream, or a numbered stream of a backend that is not CUDA (test backends that record
//! the order of fence operations).

use crate::Result;
use baton_messages::FenceHandle;
use cudarc::driver::{CudaEvent, CudaStream};
use std::any::Any;
use std::fmt;
use std::sync::Arc;

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
/// later use on that stream. Local to the process: [`Backend::export_fence`] turns marks
/// into a fence another process can wait on.
///
/// [`Backend::export_fence`]: crate::Backend::export_fence
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
    /// lies in the peer's inbox; its local twin lies in ours). For closing a mapping only
    /// after our own work on it.
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
