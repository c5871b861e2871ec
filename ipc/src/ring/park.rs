//! A ring's reader on a tokio current-thread runtime: polling in the runtime's park hook,
//! sleeping on the doorbell through the reactor.
//!
//! A task that awaits [`AsyncRingReader::recv`] on an empty ring registers its ring in a
//! thread-local list and returns `Pending`. When the thread has nothing left to run, tokio
//! calls the runtime's `on_thread_park` hook just before it blocks in `epoll_wait`; with
//! [`before_park`] as that hook, the thread polls the registered rings there for what is left
//! of each reader's [`PollWindow`](super::PollWindow), wakes the tasks whose ring has an entry
//! (tokio then runs them instead of blocking) and announces the sleep of the others, whose
//! doorbells the reactor then waits on ([`tokio::io::unix::AsyncFd`]):
//!
//! ```no_run
//! use baton_ipc::ring::{AsyncRingReader, PollWindow, RingReader, before_park};
//!
//! let runtime = tokio::runtime::Builder::new_current_thread()
//!     .enable_io()
//!     .on_thread_park(before_park)
//!     .build()?;
//! let (reader, fds) = RingReader::create(1 << 20, PollWindow::for_this_machine())?;
//! // ... `fds` go to the writer's process over the link ...
//! # drop(fds);
//! runtime.block_on(async {
//!     let mut ring = AsyncRingReader::new(reader)?;
//!     let mut frame = Vec::new();
//!     let entry = ring.recv(&mut frame).await?;
//!     # let _ = entry;
//!     Ok::<_, baton_ipc::ring::RingError>(())
//! })?;
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! ```
//!
//! **Without the hook** (a runtime built without it, or one whose thread never parks) a
//! task still never misses an entry: it announces its sleep itself before it returns
//! `Pending`, so the writer rings the doorbell. The hook, where it runs, takes that
//! announcement back while it polls the ring and makes it again when the window has passed
//! or when it stops polling for any reason: whenever the task is pending, either its
//! announcement stands (and was followed by a look at the ring) or the hook is polling its
//! ring on this thread.
//!
//! The hook holds the thread for at most the largest window left (50 µs by default,
//! [`PollWindow::configured_max`](super::PollWindow::configured_max)) and stops as soon as it
//! wakes a task or a task is woken from another thread (tokio's global queue is not empty:
//! a message posted to an actor of the thread, a reply for a caller's future). What it does
//! not watch waits for it to return, at most the window: timers, and sockets that are not a
//! ring's doorbell. (The next park polls again for what is left of each window.)
//!
//! `recv` is cancel-safe: an entry is taken from the ring only when `recv` returns it.

use super::{Entry, RingError, RingMap, RingReader, drain};
use std::cell::RefCell;
use std::fmt;
use std::future::poll_fn;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Poll, Waker};
use std::time::Instant;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

thread_local! {
    /// The rings whose tasks wait on this thread.
    static WAITING: RefCell<Vec<Weak<Slot>>> = const { RefCell::new(Vec::new()) };
}

/// Where a waiting task stands, as the hook sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not waiting.
    Idle,
    /// Its sleep announced (and the ring looked at since): the doorbell will wake it.
    Announced,
    /// The hook took the announcement back and is polling its ring.
    Polling,
    /// The hook woke it: an entry (or a close) is there.
    Woken,
}

struct Wait {
    phase: Phase,
    /// When the task's poll window ends.
    spin_until: Instant,
    waker: Option<Waker>,
}

/// One task's ring, as the hook reaches it.
struct Slot {
    map: Arc<RingMap>,
    /// The reader's head when the wait began (ours: the shared one is the peer's to forge).
    head: AtomicU64,
    wait: Mutex<Wait>,
}

impl Slot {
    fn ready(&self) -> bool {
        self.map.ready_after(self.head.load(Ordering::Relaxed))
    }

    fn wait(&self) -> MutexGuard<'_, Wait> {
        self.wait.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Wakes a waiting task, once.
fn wake(wait: &mut Wait) {
    wait.phase = Phase::Woken;
    if let Some(waker) = wait.waker.take() {
        waker.wake();
    }
}

/// The hook for tokio's `Builder::on_thread_park`: polls the rings whose tasks wait on this
/// thread, for as long as the first of their poll windows lasts, and wakes the tasks whose
/// ring has an entry; the others, past their window, stay announced, so their writers ring
/// the doorbells the reactor waits on. See the [module docs](self).
///
/// Cheap when nothing waits (a thread-local look); harmless on a runtime whose tasks do not
/// use rings.
pub fn before_park() {
    WAITING.with(|waiting| {
        // Not re-entered (it could only be from a waker's `wake`, which does not park).
        let Ok(mut waiting) = waiting.try_borrow_mut() else {
            return;
        };
        waiting.retain(|s| s.strong_count() > 0);
        if waiting.is_empty() {
            return;
        }
        // Tasks woken from other threads wait in the runtime's global queue: the polling
        // stops for them (else they would wait out the window).
        let metrics = tokio::runtime::Handle::try_current()
            .ok()
            .map(|h| h.metrics());
        let remote_work = || metrics.as_ref().is_some_and(|m| m.global_queue_depth() > 0);
        loop {
            let now = Instant::now();
            let (mut woke_any, mut polling) = (false, false);
            for slot in waiting.iter().filter_map(Weak::upgrade) {
                let mut wait = slot.wait();
                match wait.phase {
                    Phase::Idle | Phase::Woken => continue,
                    Phase::Announced | Phase::Polling if slot.ready() => {
                        wake(&mut wait);
                        woke_any = true;
                    }
                    Phase::Announced if now < wait.spin_until => {
                        // Poll instead: no doorbell while this thread watches the ring.
                        slot.map.woke();
                        wait.phase = Phase::Polling;
                        polling = true;
                    }
                    Phase::Polling if now >= wait.spin_until => announce(&slot, &mut wait),
                    Phase::Polling => polling = true,
                    Phase::Announced => {}
                }
                woke_any |= wait.phase == Phase::Woken;
            }
            if woke_any || !polling || remote_work() {
                break;
            }
            std::hint::spin_loop();
        }
        // Leaving: whatever is still polled is announced again (nobody will watch it).
        for slot in waiting.iter().filter_map(Weak::upgrade) {
            let mut wait = slot.wait();
            if wait.phase == Phase::Polling {
                announce(&slot, &mut wait);
            }
        }
    });
}

/// Announces a polled ring's sleep and looks at it again: an entry there wakes its task.
fn announce(slot: &Slot, wait: &mut Wait) {
    slot.map.announce_sleep();
    if slot.ready() {
        slot.map.woke();
        wake(wait);
    } else {
        wait.phase = Phase::Announced;
    }
}

/// Keeps a slot in this thread's list while its task waits.
struct Registered<'a>(&'a Arc<Slot>);

impl<'a> Registered<'a> {
    fn new(slot: &'a Arc<Slot>) -> Self {
        WAITING.with(|w| {
            if let Ok(mut w) = w.try_borrow_mut() {
                w.push(Arc::downgrade(slot));
            }
        });
        Self(slot)
    }
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        WAITING.with(|w| {
            if let Ok(mut w) = w.try_borrow_mut() {
                let me = Arc::as_ptr(self.0);
                w.retain(|s| !std::ptr::eq(s.as_ptr(), me));
            }
        });
        self.0.wait().phase = Phase::Idle;
    }
}

/// A [`RingReader`] whose waits are futures: it polls in the runtime's [`before_park`] hook
/// and sleeps on the doorbell through the reactor (see the [module docs](self)).
pub struct AsyncRingReader {
    reader: RingReader,
    /// A copy of the doorbell, registered with the reactor.
    bell: AsyncFd<OwnedFd>,
    slot: Arc<Slot>,
}

impl fmt::Debug for AsyncRingReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncRingReader")
            .field("reader", &self.reader)
            .finish_non_exhaustive()
    }
}

impl AsyncRingReader {
    /// Wraps a reader; registers a copy of its doorbell with the current tokio runtime's
    /// reactor.
    ///
    /// # Errors
    ///
    /// [`RingError::Io`] outside a tokio runtime, or if the doorbell cannot be duplicated or
    /// registered.
    ///
    /// # Panics
    ///
    /// In a runtime built without I/O (`enable_io`), as tokio's `AsyncFd` does.
    pub fn new(reader: RingReader) -> Result<Self, RingError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(RingError::Io(std::io::Error::other(
                "an AsyncRingReader needs a tokio runtime",
            )));
        }
        let copy = reader.doorbell.try_clone()?;
        // SAFETY: the `AsyncFd` owns `copy`, an `OwnedFd`: it stays open, the same
        // descriptor of the same file description, until the `AsyncFd` drops or gives it
        // back, and its `as_raw_fd` always returns that descriptor.
        let bell = unsafe { AsyncFd::register_with_interest(copy, Interest::READABLE) };
        let bell = bell.map_err(std::io::Error::from)?;
        let slot = Arc::new(Slot {
            map: Arc::clone(&reader.map),
            head: AtomicU64::new(reader.head),
            wait: Mutex::new(Wait {
                phase: Phase::Idle,
                spin_until: Instant::now(),
                waker: None,
            }),
        });
        Ok(Self { reader, bell, slot })
    }

    /// The reader inside.
    pub fn get_ref(&self) -> &RingReader {
        &self.reader
    }

    /// The reader back (its doorbell's registration with the reactor ends).
    pub fn into_inner(self) -> RingReader {
        self.reader
    }

    /// Takes the next entry without waiting ([`RingReader::try_recv`]).
    ///
    /// # Errors
    ///
    /// As [`RingReader::try_recv`].
    pub fn try_recv(&mut self, out: &mut Vec<u8>) -> Result<Option<Entry>, RingError> {
        self.reader.try_recv(out)
    }

    /// Waits for the next entry: a frame's bytes are appended to `out`. Cancel-safe.
    ///
    /// # Errors
    ///
    /// As [`RingReader::try_recv`]; [`RingError::Io`] if the reactor fails.
    pub async fn recv(&mut self, out: &mut Vec<u8>) -> Result<Entry, RingError> {
        let started = Instant::now();
        loop {
            if let Some(entry) = self.reader.try_recv(out)? {
                self.reader.window_mut().observe(started.elapsed());
                return Ok(entry);
            }
            // Announced before `Pending`, for a runtime without the hook (module docs).
            if !self.reader.prepare_to_sleep() {
                continue;
            }
            self.slot.head.store(self.reader.head, Ordering::Relaxed);
            {
                let mut wait = self.slot.wait();
                wait.phase = Phase::Announced;
                wait.spin_until = started + self.reader.window().current();
                wait.waker = None;
            }
            let registered = Registered::new(&self.slot);
            let woken = poll_fn(|cx| {
                if self.slot.ready() {
                    return Poll::Ready(Ok(()));
                }
                {
                    let mut wait = self.slot.wait();
                    if !wait.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        wait.waker = Some(cx.waker().clone());
                    }
                }
                loop {
                    match self.bell.poll_read_ready(cx) {
                        Poll::Ready(Ok(mut ready)) => {
                            let rung = drain(ready.get_inner().as_fd());
                            ready.clear_ready();
                            if rung {
                                return Poll::Ready(Ok(()));
                            }
                        }
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(RingError::Io(e))),
                        Poll::Pending => return Poll::Pending,
                    }
                }
            })
            .await;
            drop(registered);
            self.reader.woke();
            woken?;
        }
    }
}
