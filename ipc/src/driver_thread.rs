//! [`DriverThread`]: a thread that runs blocking driver calls (opens, closes, frees, fills,
//! synchronisations) for threads that must not block, such as actix arbiters.
//!
//! Jobs run one at a time, in the order they were submitted, each with its result handed
//! back through a future ([`run`](DriverThread::run)) or dropped
//! ([`submit`](DriverThread::submit)). A job that panics is reported and the thread goes
//! on with the next. The thread ends once every handle to it is gone and its queue is
//! empty.

use crate::{Error, Result};
use std::fmt;
use std::future::Future;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send>;

/// A thread for blocking driver calls (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct DriverThread {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    id: std::thread::ThreadId,
    tx: Mutex<mpsc::Sender<Job>>,
}

impl fmt::Debug for DriverThread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverThread")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl DriverThread {
    /// Starts the thread.
    ///
    /// # Errors
    /// [`Error::Io`] if the thread cannot be spawned.
    pub fn spawn(name: &str) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                for job in rx {
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!("a job on the driver thread panicked");
                    }
                }
            })
            .map_err(Error::io("spawning the driver thread"))?;
        Ok(Self {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                id: thread.thread().id(),
                tx: Mutex::new(tx),
            }),
        })
    }

    /// Whether the calling thread is this driver thread (a job that needs the result of
    /// another job must not wait for it here: it runs it inline).
    pub fn is_current(&self) -> bool {
        std::thread::current().id() == self.inner.id
    }

    fn send(&self, job: Job) -> std::result::Result<(), Job> {
        let tx = self.inner.tx.lock().unwrap_or_else(|p| p.into_inner());
        tx.send(job).map_err(|e| e.0)
    }

    /// Queues `f`; its result is dropped.
    pub fn submit(&self, f: impl FnOnce() + Send + 'static) {
        if let Err(job) = self.send(Box::new(f)) {
            // The thread is gone (it panicked outside a job, which cannot happen, or the
            // process is exiting): run it here rather than lose a close or a free.
            job();
        }
    }

    /// Queues `f` and resolves to its result.
    ///
    /// # Errors
    /// The future resolves to [`Error::Closed`] if the job was lost (it panicked).
    pub fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> impl Future<Output = Result<R>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(move || {
            let _ = tx.send(f());
        });
        async move { rx.await.map_err(|_| Error::Closed) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_in_order_off_the_calling_thread_and_a_panic_is_contained() {
        let t = DriverThread::spawn("baton-driver-test").unwrap();
        assert!(!t.is_current());
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..5 {
            let log = Arc::clone(&log);
            t.submit(move || log.lock().unwrap().push(i));
        }
        t.submit(|| panic!("a job panics"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let t2 = t.clone();
        let (name, on_it) = rt
            .block_on(t.run(move || {
                (
                    std::thread::current().name().map(str::to_owned),
                    t2.is_current(),
                )
            }))
            .unwrap();
        assert_eq!(name.as_deref(), Some("baton-driver-test"));
        assert!(on_it);
        assert_eq!(*log.lock().unwrap(), vec![0, 1, 2, 3, 4]);
        let lost = rt.block_on(t.run(|| -> u8 { panic!("lost") }));
        assert!(matches!(lost, Err(Error::Closed)));
    }
}
