//! The actix system the extension owns, and the waits of Python threads on it.
//!
//! One thread per process (`baton-actix`) runs an actix system; every node's actors and
//! links live there. Two ways to wait on it:
//!
//! - [`Runtime::block_on`], for work that must run on that thread (starting actors,
//!   connecting): a Python call posts a closure to the thread's arbiter, which spawns the
//!   future it makes; the calling thread waits for the result *without the GIL*
//!   (`Python::detach`), in slices so that a signal (Ctrl-C) is noticed, and always under a
//!   deadline: the future runs under the caller's deadline on the runtime, and the Python
//!   side gives up a grace period later if the runtime itself stops answering.
//! - [`Runtime::wait_here`], for the hot path (a remote call, a buffer's leases coming
//!   back): the calling thread polls the future itself, with the GIL (a poll does not
//!   block), inside the runtime's tokio context, and between polls sleeps without the GIL
//!   until the future's waker rings — the runtime thread that completes it wakes the Python
//!   thread directly, with no task spawned and no hop through the runtime on the way out.
//!   The same slices and signal checks bound the wait, and the deadline is the waiter's own.
//!   Before it sleeps, a thread whose last wait ended a moment ago ([`ACTIVE`]) watches the
//!   waker's flag for up to [`SPIN`] (yielding the core between looks): a reply that comes
//!   within that window — a call answered at once — then costs no wake-up of a sleeping
//!   thread, which on a machine whose idle cores halt (a VM) is tens of microseconds. A
//!   thread that was idle longer sleeps at once: on a small VM a watching core would push
//!   the peer's wake-ups onto a colder one, which costs more than it saves
//!   (`bench/probe/call_overhead.py --gap-ms`, `docs/bench/vm/`). Where
//!   `BATON_LINK_RING_POLL_US` asks ring readers to poll longer
//!   (`baton_ipc::ring::PollWindow::configured_max`), a waiting thread watches as long, and
//!   counts as active for twice that: a latency setting that keeps the threads of a call
//!   awake across the gaps between syncs, at the price of their cores.
//!
//! The runtime thread's tokio runtime polls the links' rings before it parks
//! (`baton_actors::ring_polling_runtime`): with rings (`BATON_LINK_RING`) a frame from the
//! peer reaches it without a wake-up while its reader's window lasts.
//!
//! A wait given up (a signal, the deadline) drops the future (or aborts its task), which
//! drops what it was doing (a remote call is then cancelled on its link).

use crate::errors::{self, Failure};
use pyo3::prelude::*;
use std::cell::Cell;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::task::{Poll, Wake, Waker};
use std::time::{Duration, Instant};

/// How long a Python thread sleeps between checks for signals while it waits.
const SLICE: Duration = Duration::from_millis(100);
/// How much longer than its own deadline a wait gives the runtime to answer.
const GRACE: Duration = Duration::from_secs(10);
/// How long the runtime thread may take to start.
const START_DEADLINE: Duration = Duration::from_secs(30);
/// How long a thread in [`Runtime::wait_here`] watches for its future's waker, or one
/// popping a [`Queue`] for an item, before it sleeps, when it is active ([`watch_window`]):
/// about a remote call's round trip when the other side answers at once, so that such a
/// call's reply (or the next of calls that come back to back) finds the thread awake.
/// Watching costs this much CPU at most per wait (the core is yielded between looks, so a
/// peer on the same core still runs).
const SPIN: Duration = Duration::from_micros(300);
/// A thread whose last wait ended no longer ago than this is active: it watches before it
/// sleeps ([`watch_window`]).
const ACTIVE: Duration = Duration::from_millis(5);

thread_local! {
    /// When this thread's last wait ended ([`note_wait`]).
    static LAST_WAIT: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// How long this thread watches before it sleeps in a wait of at most `timeout`: [`SPIN`]
/// (or the rings' longer poll window, [`spin`]) if its last wait ended within [`ACTIVE`]
/// (or twice that window), else nothing.
fn watch_window(timeout: Duration) -> Duration {
    let spin = spin();
    match LAST_WAIT.get() {
        Some(ended) if ended.elapsed() <= ACTIVE.max(spin * 2) => spin.min(timeout),
        _ => Duration::ZERO,
    }
}

/// [`SPIN`], or the ring readers' poll window where `BATON_LINK_RING_POLL_US` makes it
/// longer.
fn spin() -> Duration {
    SPIN.max(baton_ipc::ring::PollWindow::configured_max())
}

/// Records that a wait of this thread was answered now (not one that timed out), for its
/// next [`watch_window`].
fn note_wait() {
    LAST_WAIT.set(Some(Instant::now()));
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every value behind these mutexes is left consistent by each single operation.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The runtime thread: its arbiter, its tokio runtime, and the process that started it.
pub(crate) struct Runtime {
    arbiter: actix::ArbiterHandle,
    /// The handle of the tokio runtime under the actix system: futures polled on Python
    /// threads ([`Runtime::wait_here`]) use its timers.
    tokio: tokio::runtime::Handle,
    pid: u32,
}

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

/// The process's runtime, started on first use.
pub(crate) fn runtime() -> Result<&'static Runtime, Failure> {
    let rt = RUNTIME
        .get_or_init(start)
        .as_ref()
        .map_err(|e| Failure::Runtime(e.clone()))?;
    if rt.pid != std::process::id() {
        return Err(Failure::Runtime(format!(
            "baton's runtime thread was started in process {} and this process ({}) is a fork of it, \
             which has no such thread: start worker processes with multiprocessing's 'spawn' or \
             'forkserver' method, or import and use baton only after the fork",
            rt.pid,
            std::process::id()
        )));
    }
    Ok(rt)
}

fn start() -> Result<Runtime, String> {
    let done = Completion::new();
    let sender = done.sender();
    std::thread::Builder::new()
        .name("baton-actix".into())
        .spawn(move || {
            let system = match baton_actors::ring_polling_system() {
                Ok(system) => system,
                Err(e) => {
                    tracing::error!(error = %e, "baton's runtime could not be built");
                    return;
                }
            };
            let started = system
                .block_on(async { (actix::Arbiter::current(), tokio::runtime::Handle::current()) });
            sender.send(started);
            if let Err(e) = system.run() {
                tracing::error!(error = %e, "baton's actix system stopped");
            }
        })
        .map_err(|e| format!("could not start baton's runtime thread: {e}"))?;
    match done.wait(START_DEADLINE) {
        Waited::Done((arbiter, tokio)) => Ok(Runtime {
            arbiter,
            tokio,
            pid: std::process::id(),
        }),
        Waited::Gone => Err("baton's runtime thread failed to start".into()),
        Waited::Pending => Err(format!(
            "baton's runtime thread did not start within {START_DEADLINE:?}"
        )),
    }
}

impl Runtime {
    /// Runs the future `make` returns on the runtime under `deadline`, and waits for its
    /// output without the GIL.
    ///
    /// # Errors
    /// [`Failure::Timeout`] past the deadline; the error of a signal handler (e.g.
    /// `KeyboardInterrupt`); [`Failure::Runtime`] if the runtime is gone.
    pub(crate) fn block_on<T, Fut, F>(
        &self,
        py: Python<'_>,
        op: &'static str,
        deadline: Duration,
        make: F,
    ) -> PyResult<T>
    where
        T: Send + 'static,
        Fut: Future<Output = T> + 'static,
        F: FnOnce() -> Fut + Send + 'static,
    {
        let done = Completion::new();
        let sender = done.sender();
        let task: Arc<Mutex<Option<tokio::task::AbortHandle>>> = Arc::default();
        let task_slot = Arc::clone(&task);
        let posted = self.arbiter.spawn_fn(move || {
            let handle = actix::spawn(async move {
                match tokio::time::timeout(deadline, make()).await {
                    Ok(out) => sender.send(Ok(out)),
                    Err(_) => sender.send(Err(())),
                }
            });
            *lock(&task_slot) = Some(handle.abort_handle());
        });
        if !posted {
            return Err(errors::to_py(
                py,
                Failure::Runtime("baton's runtime thread is gone".into()),
            ));
        }
        let abort = || {
            if let Some(task) = lock(&task).take() {
                task.abort();
            }
        };
        // `None`: a deadline too far away to count.
        let give_up = Instant::now().checked_add(deadline.saturating_add(GRACE));
        loop {
            let slice = give_up.map_or(SLICE, |t| {
                SLICE.min(t.saturating_duration_since(Instant::now()))
            });
            match py.detach(|| done.wait(slice)) {
                Waited::Done(Ok(out)) => return Ok(out),
                Waited::Done(Err(())) => {
                    return Err(errors::to_py(py, Failure::timeout(op, deadline)));
                }
                Waited::Gone => {
                    return Err(errors::to_py(
                        py,
                        Failure::Runtime(format!("{op} was dropped by the runtime")),
                    ));
                }
                Waited::Pending => {
                    if let Err(e) = py.check_signals() {
                        abort();
                        return Err(e);
                    }
                    if give_up.is_some_and(|t| Instant::now() >= t) {
                        abort();
                        return Err(errors::to_py(
                            py,
                            Failure::Runtime(format!(
                                "baton's runtime did not answer {op} within {:?}",
                                deadline + GRACE
                            )),
                        ));
                    }
                }
            }
        }
    }

    /// Makes a future with `make` and polls it on the calling thread until it is ready, under
    /// `deadline`: with the GIL while it polls (a poll never blocks), without it while the
    /// future waits, woken by the future's own waker (whichever thread completes it), so
    /// that no task is spawned and no thread stands between the runtime and the caller.
    /// `make` and every poll run inside the runtime's tokio context (timers, semaphores);
    /// the future must not need an actix context (`actix::spawn`, an arbiter): use
    /// [`block_on`](Self::block_on) for that.
    ///
    /// Signals are checked whenever a slice of the wait passes without a wake-up, and at
    /// least every slice otherwise.
    ///
    /// # Errors
    /// [`Failure::Timeout`] past the deadline; the error of a signal handler (e.g.
    /// `KeyboardInterrupt`). Either drops the future, which gives up what it was doing.
    pub(crate) fn wait_here<T, Fut, F>(
        &self,
        py: Python<'_>,
        op: &'static str,
        deadline: Duration,
        make: F,
    ) -> PyResult<T>
    where
        Fut: Future<Output = T>,
        F: FnOnce() -> Fut,
    {
        let bell = Arc::new(Bell::default());
        let waker = Waker::from(Arc::clone(&bell));
        let mut cx = std::task::Context::from_waker(&waker);
        // `None`: a deadline too far away to count.
        let give_up = Instant::now().checked_add(deadline);
        let fut = {
            let _tokio = self.tokio.enter();
            make()
        };
        let mut fut = std::pin::pin!(fut);
        let started = Instant::now();
        let window = watch_window(deadline);
        let mut signals_checked = started;
        loop {
            let polled = {
                let _tokio = self.tokio.enter();
                fut.as_mut().poll(&mut cx)
            };
            if let Poll::Ready(out) = polled {
                note_wait();
                return Ok(out);
            }
            let now = Instant::now();
            if give_up.is_some_and(|t| now >= t) {
                return Err(errors::to_py(py, Failure::timeout(op, deadline)));
            }
            let slice = give_up.map_or(SLICE, |t| SLICE.min(t.saturating_duration_since(now)));
            let rang = py.detach(|| bell.wait(slice, window));
            if !rang || signals_checked.elapsed() >= SLICE {
                py.check_signals()?;
                signals_checked = Instant::now();
            }
        }
    }

    /// Runs `f` on the runtime thread (for what must be made inside the actix system)
    /// and waits for its result.
    pub(crate) fn run<T, F>(&self, py: Python<'_>, op: &'static str, f: F) -> PyResult<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        self.block_on(py, op, START_DEADLINE, move || async move { f() })
    }
}

/// The waker of a future polled on a Python thread ([`Runtime::wait_here`]): a flag and a
/// condition variable, rung from any thread. The waiter may watch the flag for a while
/// before it sleeps on the condition variable ([`watch_window`]).
#[derive(Default)]
struct Bell {
    rung: AtomicBool,
    /// Held to sleep and to notify, so that a ring between the waiter's last look at the
    /// flag and its sleep is not lost.
    sleep: Mutex<()>,
    cv: Condvar,
}

impl Wake for Bell {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.rung.store(true, Ordering::Release);
        let _sleep = lock(&self.sleep);
        self.cv.notify_one();
    }
}

impl Bell {
    /// Waits at most `timeout` for a ring and clears it: whether it rang. Watches the flag
    /// for up to `window` of it first.
    fn wait(&self, timeout: Duration, window: Duration) -> bool {
        let start = Instant::now();
        if watch(window.min(timeout), || {
            self.rung.swap(false, Ordering::Acquire)
        }) {
            return true;
        }
        let left = timeout.saturating_sub(start.elapsed());
        let sleep = lock(&self.sleep);
        let _sleep = self
            .cv
            .wait_timeout_while(sleep, left, |_| !self.rung.load(Ordering::Acquire))
            .unwrap_or_else(|p| p.into_inner());
        self.rung.swap(false, Ordering::Acquire)
    }
}

/// Looks at `ready` until it says yes or `window` has passed, yielding the core between
/// looks (so that a thread on the same core that would make it ready still runs): whether
/// it said yes. What a thread does for a short while before it sleeps ([`watch_window`]).
fn watch(window: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= window {
            return false;
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
        std::thread::yield_now();
    }
}

/// What a wait found.
pub(crate) enum Waited<T> {
    Done(T),
    /// The sender was dropped without sending (the task was aborted or panicked).
    Gone,
    /// Not yet.
    Pending,
}

enum Slot<T> {
    Pending,
    Done(T),
    Gone,
    Taken,
}

/// A one-shot result that a thread can wait for with a deadline (a `Sync` receiver, unlike
/// `std::sync::mpsc`'s, so that a wait can run without the GIL).
pub(crate) struct Completion<T> {
    inner: Arc<(Mutex<Slot<T>>, Condvar)>,
}

/// The sending half of a [`Completion`]; dropping it unsent wakes the waiter with
/// [`Waited::Gone`].
pub(crate) struct CompletionSender<T> {
    inner: Option<Arc<(Mutex<Slot<T>>, Condvar)>>,
}

impl<T> Completion<T> {
    pub(crate) fn new() -> Self {
        Self {
            inner: Arc::new((Mutex::new(Slot::Pending), Condvar::new())),
        }
    }

    pub(crate) fn sender(&self) -> CompletionSender<T> {
        CompletionSender {
            inner: Some(Arc::clone(&self.inner)),
        }
    }

    /// Waits at most `timeout` for the value.
    pub(crate) fn wait(&self, timeout: Duration) -> Waited<T> {
        let (m, cv) = &*self.inner;
        let deadline = Instant::now() + timeout;
        let mut slot = lock(m);
        loop {
            match std::mem::replace(&mut *slot, Slot::Taken) {
                Slot::Done(v) => return Waited::Done(v),
                Slot::Gone => {
                    *slot = Slot::Gone;
                    return Waited::Gone;
                }
                Slot::Taken => return Waited::Gone,
                Slot::Pending => *slot = Slot::Pending,
            }
            let now = Instant::now();
            if now >= deadline {
                return Waited::Pending;
            }
            slot = cv
                .wait_timeout(slot, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl<T> CompletionSender<T> {
    pub(crate) fn send(mut self, value: T) {
        if let Some(inner) = self.inner.take() {
            *lock(&inner.0) = Slot::Done(value);
            inner.1.notify_all();
        }
    }
}

impl<T> Drop for CompletionSender<T> {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            let mut slot = lock(&inner.0);
            if matches!(*slot, Slot::Pending) {
                *slot = Slot::Gone;
            }
            drop(slot);
            inner.1.notify_all();
        }
    }
}

/// A queue that Python threads pop with a deadline, without the GIL; closing it wakes them.
pub(crate) struct Queue<T> {
    inner: Mutex<(VecDeque<T>, bool)>,
    cv: Condvar,
}

impl<T> Queue<T> {
    pub(crate) fn new() -> Self {
        Self {
            inner: Mutex::new((VecDeque::new(), false)),
            cv: Condvar::new(),
        }
    }

    /// Adds `item`; gives it back if the queue is closed.
    pub(crate) fn push(&self, item: T) -> Result<(), T> {
        let mut q = lock(&self.inner);
        if q.1 {
            return Err(item);
        }
        q.0.push_back(item);
        drop(q);
        self.cv.notify_one();
        Ok(())
    }

    /// Closes the queue and returns what was left in it.
    pub(crate) fn close(&self) -> Vec<T> {
        let mut q = lock(&self.inner);
        q.1 = true;
        let left = q.0.drain(..).collect();
        drop(q);
        self.cv.notify_all();
        left
    }

    pub(crate) fn is_closed(&self) -> bool {
        lock(&self.inner).1
    }

    pub(crate) fn len(&self) -> usize {
        lock(&self.inner).0.len()
    }

    /// The next item within `timeout`: `Done(Some)`, `Gone` when closed and empty,
    /// `Pending` past the timeout.
    /// May watch the queue for a while before it sleeps ([`watch_window`]).
    pub(crate) fn pop(&self, timeout: Duration) -> Waited<T> {
        let started = Instant::now();
        let deadline = started + timeout;
        watch(watch_window(timeout), || {
            let q = lock(&self.inner);
            !q.0.is_empty() || q.1
        });
        let mut q = lock(&self.inner);
        loop {
            if let Some(item) = q.0.pop_front() {
                note_wait();
                return Waited::Done(item);
            }
            if q.1 {
                return Waited::Gone;
            }
            let now = Instant::now();
            if now >= deadline {
                return Waited::Pending;
            }
            q = self
                .cv
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits at most `timeout` until an item is waiting or the queue is closed, taking
    /// nothing: whether one is (or it closed).
    /// May watch the queue for a while before it sleeps ([`watch_window`]).
    pub(crate) fn wait_ready(&self, timeout: Duration) -> bool {
        let started = Instant::now();
        watch(watch_window(timeout), || {
            let q = lock(&self.inner);
            !q.0.is_empty() || q.1
        });
        let q = lock(&self.inner);
        let left = timeout.saturating_sub(started.elapsed());
        let (q, _) = self
            .cv
            .wait_timeout_while(q, left, |q| q.0.is_empty() && !q.1)
            .unwrap_or_else(|p| p.into_inner());
        let ready = !q.0.is_empty() || q.1;
        if ready {
            note_wait();
        }
        ready
    }

    /// Pops within `timeout` (`Duration::MAX`: no deadline) without the GIL, checking
    /// for signals after every slice that passes empty — the last one too, so that a
    /// caller waiting in short pops (`Mailbox.recv`) still sees Ctrl-C.
    ///
    /// # Errors
    /// A signal handler's error.
    pub(crate) fn pop_py(&self, py: Python<'_>, timeout: Duration) -> PyResult<Waited<T>>
    where
        T: Send,
    {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let slice = deadline.map_or(SLICE, |t| {
                SLICE.min(t.saturating_duration_since(Instant::now()))
            });
            match py.detach(|| self.pop(slice)) {
                Waited::Pending => {
                    py.check_signals()?;
                    if deadline.is_some_and(|t| Instant::now() >= t) {
                        return Ok(Waited::Pending);
                    }
                }
                other => return Ok(other),
            }
        }
    }
}
