//! [`Offload`]: where a node runs the backend calls that may block — opens, closes, frees,
//! allocations (which fill and synchronise), waits for release fences — so that no actor's
//! thread (an actix arbiter) blocks on a driver.
//!
//! A node whose backends declare blocking calls ([`Backend::blocking_calls`](baton_ipc::Backend::blocking_calls): CUDA) gets a
//! driver thread of its own; one whose backends do not (host memory: `mmap`,
//! `memfd_create`) runs them inline, where they cost microseconds.

use crate::error::ActorError;
use baton_ipc::{DriverThread, SharedBackend};
use std::future::Future;
use std::pin::Pin;

/// A future of a result computed somewhere else.
pub(crate) type Offloaded<R> = Pin<Box<dyn Future<Output = Result<R, ActorError>> + Send>>;

/// Where blocking backend calls run (see the module docs). Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Offload(Option<DriverThread>);

impl Offload {
    /// A driver thread if any of `backends` makes blocking calls, else inline.
    pub(crate) fn for_backends<'a>(backends: impl IntoIterator<Item = &'a SharedBackend>) -> Self {
        let blocking = backends.into_iter().any(|b| b.blocking_calls());
        if !blocking {
            return Self(None);
        }
        match DriverThread::spawn("baton-driver") {
            Ok(t) => Self(Some(t)),
            Err(e) => {
                tracing::warn!(error = %e, "no driver thread: blocking driver calls run inline");
                Self(None)
            }
        }
    }

    /// Whether calls run inline, on the caller's thread.
    pub(crate) fn is_inline(&self) -> bool {
        self.0.is_none()
    }

    /// Runs `f` there; its result is dropped.
    pub(crate) fn submit(&self, f: impl FnOnce() + Send + 'static) {
        match &self.0 {
            Some(t) => t.submit(f),
            None => f(),
        }
    }

    /// Runs `f` there and resolves to its result.
    pub(crate) fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Offloaded<R> {
        match &self.0 {
            Some(t) if !t.is_current() => {
                let fut = t.run(f);
                Box::pin(async move { fut.await.map_err(ActorError::from) })
            }
            _ => {
                let r = f();
                Box::pin(async move { Ok(r) })
            }
        }
    }
}
