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
//! or when it cannot go on polling: whenever the task is pending, either its announcement
//! stands (and was followed by a look at the ring) or the hook polls its ring again before
//! the thread blocks (it left a task ready, so the thread does not block before the next
//! park, which calls the hook).
//!
//! The hook never holds the thread for long: it polls for at most a short slice
//! ([`SLICE`]) and then, while a window lasts, leaves a task of its own ready to run, so that
//! tokio does not block: it polls its I/O driver without waiting (timers, sockets), runs
//! what was woken — a task woken from another thread, a message posted to an actor of the
//! thread from another thread — and parks again, which calls the hook again. So nothing
//! the runtime watches waits for more than a slice and one turn of the scheduler, however
//! long the window. (Spinning through the whole window, as the hook did first, it stopped
//! early only for tasks in tokio's global queue — but an actix actor is a task of a
//! `LocalSet`, whose wakes from other threads do not go there: such a message waited out
//! the window, and so did timers and sockets.)
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
use std::time::{Duration, Instant};
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

/// How long [`before_park`] polls before it lets the runtime look at everything else (see
/// the [module docs](self)).
pub const SLICE: Duration = Duration::from_micros(5);

/// The hook for tokio's `Builder::on_thread_park`: polls the rings whose tasks wait on this
/// thread for at most a [`SLICE`], and wakes the tasks whose ring has an entry; while a poll
/// window lasts, it leaves a task of its own ready, so that the runtime turns (I/O, timers,
/// tasks woken from other threads) and parks again instead of blocking; rings past their
/// window stay announced, so their writers ring the doorbells the reactor waits on. See the
/// [module docs](self).
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
        // Tasks woken from other threads into the runtime's own queue: stop at once.
        let metrics = tokio::runtime::Handle::try_current()
            .ok()
            .map(|h| h.metrics());
        let remote_work = || metrics.as_ref().is_some_and(|m| m.global_queue_depth() > 0);
        let until = Instant::now() + SLICE;
        let polling = loop {
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
            if woke_any || !polling {
                break false;
            }
            if remote_work() || now >= until {
                break true;
            }
            std::hint::spin_loop();
        };
        // Still polling: the runtime turns and comes back here, rather than block.
        if polling && !keep_turning() {
            // No task of ours could be left ready (no current-thread runtime here): whatever
            // is polled is announced again, so nothing waits unwatched.
            for slot in waiting.iter().filter_map(Weak::upgrade) {
                let mut wait = slot.wait();
                if wait.phase == Phase::Polling {
                    announce(&slot, &mut wait);
                }
            }
        }
    });
}

thread_local! {
    /// This thread's turner: a task of the runtime (by its id) that does nothing when woken.
    static TURNER: RefCell<Option<(tokio::runtime::Id, Arc<tokio::sync::Notify>)>> =
        const { RefCell::new(None) };
}

/// Leaves a task ready on this thread's runtime (its turner, spawned on first use), so that
/// it does not block when the hook returns; `false` if there is no current-thread runtime
/// here (a task spawned on a multi-thread runtime may run on another thread, and this one
/// would block with rings unannounced).
fn keep_turning() -> bool {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
        return false;
    }
    TURNER.with(|turner| {
        let Ok(mut turner) = turner.try_borrow_mut() else {
            return false;
        };
        match turner.as_ref() {
            Some((id, notify)) if *id == handle.id() => notify.notify_one(),
            // None yet, or one of a runtime this thread ran before (ids are never reused).
            _ => {
                let notify = Arc::new(tokio::sync::Notify::new());
                let woken = Arc::clone(&notify);
                // Spawned ready: its first poll is the turn this park needs.
                drop(handle.spawn(async move {
                    loop {
                        woken.notified().await;
                    }
                }));
                *turner = Some((handle.id(), notify));
            }
        }
        true
    })
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
