//! Transfer engines: the data plane between nodes on different hosts.
//!
//! A [`TransferEngine`] moves the bytes of one [`Region`] of this process into a region of
//! a peer's process ([`EnginePeer`]); each transfer is named by a [`TransferId`] and
//! followed by a [`Transfer`]: wait for it under a deadline, or abort it. Engines do their
//! own threading; the caller keeps the memory alive and unchanged until the transfer is
//! done, failed or aborted — and an abort returns only once the engine no longer touches
//! that memory, so the caller may free or reuse it at once.
//!
//! Backends: [`tcp_engine`] (host memory over its own authenticated TCP connections; what CI
//! runs) and [`nccl`] (device memory over NCCL point-to-point, NCCL loaded at run time).
//!
//! # Safety
//! `send` and `recv` are `unsafe fn`: the engine reads or writes the region from its own
//! threads after they return, which only the caller can make sound (see their contracts).
//! The TCP backend builds byte slices over a region only between
//! [`TransferSignal::begin_touch`] and [`TransferSignal::end_touch`], which an abort waits
//! out; the NCCL backend holds its transfer "touching" from its start until its operation
//! completed or its communicator's abort returned.

mod held;
pub mod nccl;
pub mod tcp_engine;

use crate::tcp::HostId;
use crate::{Error, MemPtr, Result};
use baton_messages::{DeviceUuid, ProcessId};
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

pub use held::{HeldTransfer, decline};
pub use nccl::NcclEngine;
pub use tcp_engine::{DataLimits, DataRefusal, TcpEngine};

/// Where a transfer's bytes are: host memory or one device's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// The first byte.
    pub ptr: MemPtr,
    /// How many bytes.
    pub len: usize,
    /// The device whose memory it is; `None` for host memory.
    pub device: Option<DeviceUuid>,
}

impl Region {
    /// `len` bytes of host memory at `ptr`.
    pub fn host(ptr: *mut u8, len: usize) -> Region {
        Region {
            ptr: MemPtr::Host(ptr),
            len,
            device: None,
        }
    }

    /// The bytes of a host buffer (keep the buffer alive and unmoved for the transfer).
    pub fn of_slice(bytes: &mut [u8]) -> Region {
        Region::host(bytes.as_mut_ptr(), bytes.len())
    }
}

/// Names one transfer between two nodes (unique per sender node).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TransferId(pub u64);

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "transfer {}", self.0)
    }
}

/// The remote node of a transfer: who it is, and how an engine reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EnginePeer {
    /// The peer process (as its host link proved it).
    pub process: ProcessId,
    /// The host it runs on.
    pub host: HostId,
    /// Its TCP engine's data address ([`TcpEngine::data_addr`]); needed to send to it
    /// over TCP, not to receive from it.
    pub data_addr: Option<SocketAddr>,
}

/// An engine that moves bytes between this process and peers on other hosts.
pub trait TransferEngine: Send + Sync + fmt::Debug {
    /// Its name: `"tcp"`, `"nccl"`.
    fn name(&self) -> &'static str;

    /// Whether it moves device memory (else host memory only).
    fn moves_device_memory(&self) -> bool;

    /// Starts sending `src` to `peer` as transfer `id`; the peer receives it with
    /// [`recv`](Self::recv) of the same id.
    ///
    /// # Errors
    /// [`Error::RegionUnsupported`] for memory this engine cannot move; an engine's own
    /// failure to start. Failures on the way come from [`Transfer::wait`].
    ///
    /// # Safety
    /// `src` must be valid for reads of `src.len` bytes, and stay valid and unchanged
    /// until the returned [`Transfer`] is done, failed or aborted (an abort returns only
    /// once the engine no longer touches it).
    unsafe fn send(&self, peer: &EnginePeer, id: TransferId, src: Region) -> Result<Transfer>;

    /// Starts receiving transfer `id` from `peer` into `dst`.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    ///
    /// # Safety
    /// `dst` must be valid for writes of `dst.len` bytes, and neither read nor written by
    /// anyone else until the returned [`Transfer`] is done, failed or aborted.
    unsafe fn recv(&self, peer: &EnginePeer, id: TransferId, dst: Region) -> Result<Transfer>;

    /// Fails and stops every transfer with `peer`; returns once none touches memory any
    /// more.
    fn abort_peer(&self, peer: &EnginePeer);
}

/// The bytes of copies a node receives at once over all its links together (a node-wide
/// bound beside each link's own): a receiver takes a copy's bytes here before it allocates
/// its memory, and gives them back when the copy has landed or failed. Without it, many
/// links of token holders could each fill their own link's bound.
#[derive(Debug, Default)]
pub struct CopyBudget {
    taken: Mutex<usize>,
}

/// Bytes taken from a [`CopyBudget`]: given back when dropped.
#[derive(Debug)]
pub struct CopyBytes {
    budget: Arc<CopyBudget>,
    bytes: usize,
}

impl CopyBudget {
    /// Takes `bytes` if the bytes taken stay within `limit`: `None` (nothing taken) if not.
    pub fn try_take(self: &Arc<Self>, bytes: usize, limit: usize) -> Option<CopyBytes> {
        let mut taken = self.taken.lock().unwrap_or_else(|p| p.into_inner());
        let after = taken.checked_add(bytes).filter(|&n| n <= limit)?;
        *taken = after;
        Some(CopyBytes {
            budget: Arc::clone(self),
            bytes,
        })
    }

    /// The bytes taken now.
    pub fn taken(&self) -> usize {
        *self.taken.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for CopyBytes {
    fn drop(&mut self) {
        let mut taken = self.budget.taken.lock().unwrap_or_else(|p| p.into_inner());
        *taken = taken.saturating_sub(self.bytes);
    }
}

/// Where a transfer stands.
#[derive(Debug)]
struct State {
    /// An engine thread is reading or writing the transfer's memory.
    touching: bool,
    aborted: bool,
    outcome: Option<Result<(), Error>>,
}

#[derive(Debug)]
struct Shared {
    id: TransferId,
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the transfer aborted (unless it finished), interrupts a thread touching its
    /// memory, and waits at most `wait` until none does: whether none does.
    fn abort(&self, interrupt: impl FnOnce(), wait: Duration) -> bool {
        let mut state = self.lock();
        if state.outcome.is_some() {
            return !state.touching;
        }
        state.aborted = true;
        if state.touching {
            drop(state);
            interrupt();
            state = self.lock();
            state = self
                .changed
                .wait_timeout_while(state, wait, |s| s.touching)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if state.outcome.is_none() {
            state.outcome = Some(Err(Error::TransferAborted { id: self.id.0 }));
        }
        self.changed.notify_all();
        !state.touching
    }
}

/// How long [`Transfer::abort`] waits for an engine to stop touching the memory before it
/// returns `false` (the liveness rule: no Baton call waits without bound, even on an
/// engine's own abort).
pub const ABORT_WAIT: Duration = Duration::from_secs(15);

/// How an engine stops a transfer whose memory one of its threads is touching (shut its
/// connection down, abort its communicator): after it, the thread must stop touching soon.
type Interrupt = Box<dyn Fn() + Send + Sync>;

/// One transfer in flight: [`wait`](Self::wait) for it under a deadline,
/// [`abort`](Self::abort) it. Dropping it does not stop it (the memory contract of
/// `send`/`recv` holds until it finishes); abort first to reuse the memory early.
pub struct Transfer {
    shared: Arc<Shared>,
    interrupt: Arc<Interrupt>,
}

impl fmt::Debug for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("id", &self.shared.id)
            .field("state", &*self.shared.lock())
            .finish()
    }
}

/// The engine's side of one [`Transfer`]: marks when its threads touch the memory, and
/// reports the outcome.
#[derive(Debug, Clone)]
pub struct TransferSignal {
    shared: Arc<Shared>,
}

/// Makes a transfer and the engine's signal for it. `interrupt` is how
/// [`Transfer::abort`] stops an engine thread that touches the memory (it must make that
/// thread call [`TransferSignal::end_touch`] soon).
pub fn transfer_pair(
    id: TransferId,
    interrupt: impl Fn() + Send + Sync + 'static,
) -> (Transfer, TransferSignal) {
    let shared = Arc::new(Shared {
        id,
        state: Mutex::new(State {
            touching: false,
            aborted: false,
            outcome: None,
        }),
        changed: Condvar::new(),
    });
    let interrupt: Arc<Interrupt> = Arc::new(Box::new(interrupt));
    (
        Transfer {
            shared: Arc::clone(&shared),
            interrupt,
        },
        TransferSignal { shared },
    )
}

/// The same error again, for a second wait on a failed transfer, or for each transfer a
/// failed connection fails.
pub(crate) fn again(e: &Error, id: TransferId) -> Error {
    match e {
        Error::BadToken => Error::BadToken,
        Error::Refused { reason } => Error::Refused { reason: *reason },
        Error::HostKeyNotPinned { key } => Error::HostKeyNotPinned { key: key.clone() },
        Error::Tampered { what } => Error::Tampered { what },
        Error::TransferPeerGone { why, .. } => Error::TransferPeerGone {
            id: id.0,
            why: why.clone(),
        },
        Error::TransferAborted { id } => Error::TransferAborted { id: *id },
        Error::TransferCorrupt { id } => Error::TransferCorrupt { id: *id },
        Error::TransferFailed { reason, .. } => Error::TransferFailed {
            id: id.0,
            reason: reason.clone(),
        },
        Error::TransferSizeMismatch { id, sent, room } => Error::TransferSizeMismatch {
            id: *id,
            sent: *sent,
            room: *room,
        },
        Error::Timeout { op, after } => Error::Timeout { op, after: *after },
        Error::DataConnectionRefused { why } => Error::DataConnectionRefused { why: *why },
        other => Error::TransferPeerGone {
            id: id.0,
            why: other.to_string(),
        },
    }
}

impl Transfer {
    /// Another handle on the same transfer (waiting on it; it does not abort on drop).
    pub(crate) fn clone_handle(&self) -> Transfer {
        Transfer {
            shared: Arc::clone(&self.shared),
            interrupt: Arc::clone(&self.interrupt),
        }
    }

    /// Its id.
    pub fn id(&self) -> TransferId {
        self.shared.id
    }

    /// Waits at most `timeout` for the transfer to finish.
    ///
    /// # Errors
    /// [`Error::Timeout`] if it has not finished by then (it goes on: wait again, or
    /// abort); else its failure: [`Error::TransferAborted`], [`Error::TransferPeerGone`],
    /// [`Error::TransferCorrupt`], [`Error::TransferSizeMismatch`], …
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let state = self.shared.lock();
        let (state, _) = self
            .shared
            .changed
            .wait_timeout_while(state, timeout, |s| s.outcome.is_none())
            .unwrap_or_else(|p| p.into_inner());
        match &state.outcome {
            None => Err(Error::Timeout {
                op: "waiting for a transfer",
                after: timeout,
            }),
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(again(e, self.shared.id)),
        }
    }

    /// Whether it has finished (landed or failed).
    pub fn is_finished(&self) -> bool {
        self.shared.lock().outcome.is_some()
    }

    /// Stops it: it fails with [`Error::TransferAborted`] unless it had finished. Returns
    /// `true` once the engine no longer touches its memory — or `false` after
    /// [`ABORT_WAIT`] if it still does (an engine whose own abort hangs: NCCL's can): the
    /// memory must then be kept until [`is_touching`](Self::is_touching) says otherwise
    /// ([`HeldTransfer`] does that).
    pub fn abort(&self) -> bool {
        self.shared.abort(|| (self.interrupt)(), ABORT_WAIT)
    }

    /// Whether an engine thread may still read or write its memory (before its start, and
    /// after it finished or its abort returned, none does).
    pub fn is_touching(&self) -> bool {
        self.shared.lock().touching
    }

    /// Waits at most `timeout` until no engine thread touches its memory: whether none does.
    pub fn wait_untouched(&self, timeout: Duration) -> bool {
        let state = self.shared.lock();
        !self
            .shared
            .changed
            .wait_timeout_while(state, timeout, |s| s.touching)
            .unwrap_or_else(|p| p.into_inner())
            .0
            .touching
    }
}

impl TransferSignal {
    /// The transfer's id.
    pub fn id(&self) -> TransferId {
        self.shared.id
    }

    /// An engine thread is about to touch the memory: `false` if it must not (the
    /// transfer was aborted or has finished).
    pub fn begin_touch(&self) -> bool {
        let mut state = self.shared.lock();
        if state.aborted || state.outcome.is_some() {
            return false;
        }
        state.touching = true;
        true
    }

    /// The engine thread no longer touches the memory.
    pub fn end_touch(&self) {
        let mut state = self.shared.lock();
        state.touching = false;
        self.shared.changed.notify_all();
    }

    /// Whether both signal the same transfer.
    pub fn same(&self, other: &TransferSignal) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Whether the transfer was aborted (checked between chunks).
    pub fn is_aborted(&self) -> bool {
        self.shared.lock().aborted
    }

    /// Whether it has finished.
    pub fn is_finished(&self) -> bool {
        self.shared.lock().outcome.is_some()
    }

    /// Reports the outcome (the first report wins; an aborted transfer stays aborted).
    pub fn finish(&self, outcome: Result<()>) {
        let mut state = self.shared.lock();
        if state.outcome.is_none() {
            state.outcome = Some(if state.aborted {
                Err(Error::TransferAborted {
                    id: self.shared.id.0,
                })
            } else {
                outcome
            });
        }
        self.shared.changed.notify_all();
    }

    /// Aborts it from the engine's side (as [`Transfer::abort`], for `abort_peer`):
    /// `interrupt` stops a thread that touches the memory; returns once none does (or,
    /// `false`, after [`ABORT_WAIT`]).
    pub fn abort(&self, interrupt: impl FnOnce()) -> bool {
        self.shared.abort(interrupt, ABORT_WAIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn a_copy_budget_is_shared_and_given_back() {
        let budget = Arc::new(CopyBudget::default());
        let a = budget.try_take(600, 1000).unwrap();
        assert!(budget.try_take(500, 1000).is_none(), "past the limit");
        let b = budget.try_take(400, 1000).unwrap();
        assert_eq!(budget.taken(), 1000);
        drop(a);
        assert_eq!(budget.taken(), 400);
        assert!(
            budget.try_take(usize::MAX, usize::MAX).is_none(),
            "no overflow"
        );
        drop(b);
        assert_eq!(budget.taken(), 0);
    }

    #[test]
    fn a_transfer_reports_its_outcome_to_every_wait() {
        let (t, signal) = transfer_pair(TransferId(1), || {});
        assert!(matches!(
            t.wait(Duration::from_millis(1)),
            Err(Error::Timeout { .. })
        ));
        signal.finish(Err(Error::TransferCorrupt { id: 1 }));
        signal.finish(Ok(()));
        for _ in 0..2 {
            assert!(matches!(
                t.wait(Duration::ZERO),
                Err(Error::TransferCorrupt { id: 1 })
            ));
        }
        assert!(t.is_finished());
    }

    /// An abort interrupts a thread touching the memory and returns only once it stopped.
    #[test]
    fn abort_waits_until_no_thread_touches_the_memory() {
        let stop = Arc::new(AtomicBool::new(false));
        let (t, signal) = transfer_pair(TransferId(2), {
            let stop = Arc::clone(&stop);
            move || stop.store(true, Ordering::SeqCst)
        });
        assert!(signal.begin_touch());
        let left = Arc::new(AtomicBool::new(false));
        let worker = std::thread::spawn({
            let (stop, left) = (Arc::clone(&stop), Arc::clone(&left));
            move || {
                while !stop.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                std::thread::sleep(Duration::from_millis(20));
                left.store(true, Ordering::SeqCst);
                signal.end_touch();
                signal.finish(Ok(()));
                signal
            }
        });
        t.abort();
        assert!(left.load(Ordering::SeqCst), "abort returned while touching");
        assert!(matches!(
            t.wait(Duration::ZERO),
            Err(Error::TransferAborted { id: 2 })
        ));
        let signal = worker.join().unwrap();
        assert!(
            !signal.begin_touch(),
            "an aborted transfer is not touched again"
        );
    }
}
