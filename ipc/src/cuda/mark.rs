//! Use marks: cudarc events recorded on a stream after each use of a buffer there, so that
//! the buffer can be given back, written again or freed only after that use.
//!
//! A [`CudaMark`] is a plain (not interprocess) cudarc [`CudaEvent`], so that cudarc's own
//! `SyncOnDrop::Record` can record it after a launch or a copy; the backend's
//! [`export_fence`](crate::StreamOrdering::export_fence) turns marks into an interprocess fence on
//! a *release stream* of its own (which waits on the marks' events, then records a pooled
//! interprocess event). Marks are pooled per backend ([`MarkPool`]): a mark goes back when
//! its holder drops it, which it does only after every wait that needs its latest record
//! was queued (a wait captures the record at the time it is queued).
//!
//! # Safety
//!
//! The raw event behind a mark is cudarc's, owned by its `CudaEvent` (destroyed by cudarc's
//! `Drop`, wrapped in [`Quiet`] so the caller's context is put back); this module only
//! records it, waits on it and queries it, with a context pushed ([`ContextGuard`]) and
//! while the mark is alive. Streams passed in are borrowed, so they are alive during the
//! call.

use super::context::{ContextGuard, KeepCurrent, Quiet};
use super::{SharedContext, SharedStream, result};
use crate::ordering::{StreamKey, StreamRef, UseMark};
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaStream};
use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};

/// How many idle marks a backend keeps for reuse.
const POOL_CAP: usize = 1024;

/// The backend's idle marks.
pub(crate) struct MarkPool {
    ctx: SharedContext,
    internal: SharedStream,
    free: Mutex<Vec<Quiet<CudaEvent>>>,
}

impl fmt::Debug for MarkPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let free = self.free.lock().map(|f| f.len()).unwrap_or(0);
        f.debug_struct("MarkPool").field("free", &free).finish()
    }
}

impl MarkPool {
    pub(crate) fn new(ctx: SharedContext, internal: SharedStream) -> Arc<Self> {
        Arc::new(Self {
            ctx,
            internal,
            free: Mutex::new(Vec::new()),
        })
    }

    /// A mark for `stream` (of the backend's context): an idle one, or a new event.
    pub(crate) fn lend(self: &Arc<Self>, stream: StreamRef<'_>) -> Result<CudaMark> {
        let key = stream.key();
        if let StreamRef::Cuda(s) = stream {
            if s.context().cu_ctx() != self.ctx.cu_ctx() {
                // cudarc records an event only on a stream of the event's context.
                return Err(Error::Cuda {
                    op: "cuEventRecord",
                    code: super::CudaError::INVALID_CONTEXT,
                });
            }
        }
        let idle = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let event = match idle {
            Some(e) => e,
            None => {
                // cudarc binds the context to make the event: put the caller's back.
                let keep = KeepCurrent::new()?;
                let event = self
                    .ctx
                    .new_event(None)
                    .map_err(result::from_driver("cuEventCreate"))?;
                drop(keep);
                Quiet::new(event)
            }
        };
        Ok(CudaMark {
            event: Some(event),
            key,
            pool: Arc::clone(self),
        })
    }

    fn stream<'a>(&'a self, stream: StreamRef<'a>) -> Result<&'a CudaStream> {
        match stream {
            StreamRef::Internal => Ok(&self.internal),
            StreamRef::Cuda(s) => Ok(s),
            StreamRef::Id(_) => Err(Error::Cuda {
                op: "cuEventRecord",
                code: super::CudaError::INVALID_VALUE,
            }),
        }
    }
}

/// One stream's use mark (see the module docs).
pub(crate) struct CudaMark {
    /// Always `Some` until `drop`, which gives it back to the pool.
    event: Option<Quiet<CudaEvent>>,
    key: StreamKey,
    pool: Arc<MarkPool>,
}

impl fmt::Debug for CudaMark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaMark")
            .field("stream", &self.key)
            .finish()
    }
}

impl CudaMark {
    fn event(&self) -> &CudaEvent {
        self.event.as_ref().expect("present until drop")
    }
}

impl UseMark for CudaMark {
    fn stream(&self) -> StreamKey {
        self.key
    }

    fn record(&self, stream: StreamRef<'_>) -> Result<()> {
        let s = self.pool.stream(stream)?;
        let _pushed = ContextGuard::push(s.context())?;
        // SAFETY: the event is alive while `self` is; the stream is borrowed (alive) and
        // of the event's context (checked when the mark was lent), which is current.
        unsafe { result::event_record(self.event().cu_event(), s.cu_stream()) }
    }

    fn order(&self, stream: StreamRef<'_>) -> Result<()> {
        let s = self.pool.stream(stream)?;
        let _pushed = ContextGuard::push(s.context())?;
        // SAFETY: as in `record`; a wait on a never-recorded event does nothing.
        unsafe { result::stream_wait_event(s.cu_stream(), self.event().cu_event()) }
    }

    fn synchronize(&self) -> Result<()> {
        let _pushed = ContextGuard::push(&self.pool.ctx)?;
        // SAFETY: the event is alive while `self` is; its context is current.
        unsafe { result::event_synchronize(self.event().cu_event()) }
    }

    fn cuda_event(&self) -> Option<&CudaEvent> {
        self.event.as_deref()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaMark {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
            if free.len() < POOL_CAP {
                free.push(event);
            } else {
                // Destroyed with the lock released.
                drop(free);
                drop(event);
            }
        }
    }
}
