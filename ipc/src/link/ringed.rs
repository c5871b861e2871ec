//! What an [`AsyncLink`](super::AsyncLink) keeps for its shared-memory rings (issue 48,
//! item 1; [`crate::ring`]), and the steps of the switch from the socket to a ring that do
//! no socket I/O (the driver, `nonblocking`, does that).
//!
//! One ring per direction, made by its reader:
//!
//! 1. right after the handshake, a side whose [`LinkConfig::ring`](super::LinkConfig::ring)
//!    is set creates its reading end and sends `RingOffer` with the three descriptors;
//!    its reader goes on reading the socket ([`RxRing::Offered`]);
//! 2. the peer's reader checks the descriptors ([`accept_offer`]): a ring is left in
//!    [`Shared`] for the writers; anything else is logged, the socket stays, and the
//!    peer's next send says `RingDeclined`, at which the offering reader drops its ring
//!    (and its slot in the budget of ring ends);
//! 3. the peer's next send, under the writers' lock, sends `RingReady` on the socket, its
//!    last frame there alone, and then writes into the ring ([`TxRing`]): a frame that
//!    carries descriptors, or is larger than the ring's `max_frame`, goes on the socket
//!    after a socket marker in the ring;
//! 4. the offering reader, at `RingReady`, reads the ring ([`RxRing::On`]), and goes to the
//!    socket only at a marker, for exactly one frame. Bytes on the socket with no marker
//!    before them break the protocol; the socket's end of stream still ends the link, so a
//!    peer killed without closing its ring is noticed at once.

use crate::ring::{
    AsyncRingReader, PollWindow, RingCloser, RingError, RingFds, RingReader, RingWriter,
};
use crate::{Error, Result};
use baton_messages::Message;
use baton_messages::codec::{FrameHeader, HEADER_LEN, decode_payload};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

/// What a link's reader and all its writers share.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// The link was closed (`LinkCloser::close`, `LinkWriter::shutdown`) or its reader
    /// saw the socket end: a writer waiting for room in the ring stops.
    closed: AtomicBool,
    /// Woken when `closed` is set.
    closing: Notify,
    /// A ring the peer offered and this side opened, waiting for the next send to announce
    /// it (`RingReady`) and start writing into it.
    offered: Mutex<Option<RingWriter>>,
    /// A ring the peer offered that this side does not take, waiting for the next send to
    /// say so (`RingDeclined`), so that the peer lets it go.
    declined: AtomicBool,
    /// Closes this side's reading ring when the link is closed.
    pub(super) rx_ring: Mutex<Option<RingCloser>>,
    /// Whether the writers write into a ring (read by [`writes_ring`](Self::writes_ring)).
    writing_ring: AtomicBool,
    /// The writers' state; one writer at a time holds it for a whole send, so that a
    /// marker and its socket frame, or `RingReady` and the switch, are never interleaved
    /// with another writer's frames.
    pub(super) tx: tokio::sync::Mutex<TxState>,
}

impl Shared {
    /// Marks the link closed and wakes writers waiting for room; closes both rings' ends
    /// here (the writing end at once unless a writer holds it, then when its send ends), so
    /// the peer's writer waiting for room in ours wakes too.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.closing.notify_waiters();
        if let Some(ring) = self
            .rx_ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            ring.close();
        }
        drop(self.offered().take());
        if let Ok(mut tx) = self.tx.try_lock() {
            tx.ring = None;
        }
    }

    /// Whether this side's reading ring holds an entry not yet taken.
    pub(super) fn rx_ring_has_entry(&self) -> bool {
        self.rx_ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(RingCloser::has_entry)
    }

    /// Keeps a way to close this side's reading ring with the link.
    pub(super) fn set_rx_ring(&self, closer: RingCloser) {
        *self.rx_ring.lock().unwrap_or_else(|e| e.into_inner()) = Some(closer);
    }

    pub(super) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn offered(&self) -> MutexGuard<'_, Option<RingWriter>> {
        self.offered.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Leaves a ring the peer offered for the writers. `false` if one was left already or
    /// is in use (a second offer breaks the protocol).
    pub(super) fn leave_offered(&self, writer: RingWriter) -> bool {
        let mut offered = self.offered();
        if offered.is_some() || self.writes_ring() {
            return false;
        }
        *offered = Some(writer);
        true
    }

    /// Whether a ring the peer offered waits to be announced, or declined.
    pub(super) fn has_offered(&self) -> bool {
        self.offered().is_some() || self.declined.load(Ordering::Acquire)
    }

    /// The peer's offer is not taken: the next send says so.
    pub(super) fn decline(&self) {
        self.declined.store(true, Ordering::Release);
    }

    /// Whether a decline waits to be sent (cleared).
    pub(super) fn take_declined(&self) -> bool {
        self.declined.swap(false, Ordering::AcqRel)
    }

    /// Forgets this side's reading ring: the peer declined it.
    pub(super) fn drop_rx_ring(&self) {
        drop(
            self.rx_ring
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }

    /// The ring the peer offered, if one waits to be announced.
    pub(super) fn take_offered(&self) -> Option<RingWriter> {
        self.offered().take()
    }

    /// Whether the writers write into a ring now.
    pub(super) fn writes_ring(&self) -> bool {
        self.writing_ring.load(Ordering::Acquire)
    }

    pub(super) fn set_writes_ring(&self) {
        self.writing_ring.store(true, Ordering::Release);
    }
}

/// The writers' state, behind [`Shared::tx`].
#[derive(Debug, Default)]
pub(super) struct TxState {
    /// The ring the frames go into, once `RingReady` went out.
    pub(super) ring: Option<TxRing>,
    /// Bytes of frames a `try_send_encoded` began on the socket whose rest must follow on
    /// the socket before anything else (before a switch to the ring, too).
    pub(super) owed: usize,
}

/// The writing end of the peer's ring, and its space bell registered with the reactor.
#[derive(Debug)]
pub(super) struct TxRing {
    writer: RingWriter,
    space: AsyncFd<OwnedFd>,
}

/// What goes into the ring.
#[derive(Debug, Clone, Copy)]
pub(super) enum Push<'a> {
    /// A whole encoded frame without descriptors.
    Frame(&'a [u8]),
    /// A socket marker: the next frame is on the socket.
    Marker,
}

impl TxRing {
    /// Wraps a ring's writing end; `space` is a copy of its space bell, registered for
    /// reads.
    pub(super) fn new(writer: RingWriter, space: AsyncFd<OwnedFd>) -> Self {
        Self { writer, space }
    }

    /// The writer's space bell (to register a copy of it).
    pub(super) fn space_of(writer: &RingWriter) -> std::io::Result<OwnedFd> {
        writer.space_fd().try_clone_to_owned()
    }

    /// Whether `frame` (encoded, with `nfds` descriptors) goes into the ring itself.
    pub(super) fn carries(&self, frame: &[u8], nfds: usize) -> bool {
        nfds == 0 && frame.len() <= self.writer.max_frame()
    }

    /// Holds the appends made through the returned batch back until it is dropped (or
    /// [`Batch::flush`]): the frames of one send become visible to the reader, and ring
    /// its doorbell, once ([`RingWriter::hold`]). Dropped, it publishes, also when its send
    /// is cancelled or fails.
    pub(super) fn batch(&mut self) -> Batch<'_> {
        self.writer.hold();
        Batch(self)
    }

    fn try_push(&mut self, push: Push<'_>) -> std::result::Result<(), RingError> {
        match push {
            Push::Frame(frame) => self.writer.try_send(frame),
            Push::Marker => self.writer.try_send_marker(),
        }
    }

    /// Appends without waiting; `Ok(false)` when the ring is full.
    ///
    /// # Errors
    /// As [`push`](Self::push).
    pub(super) fn try_push_now(&mut self, push: Push<'_>) -> Result<bool> {
        match self.try_push(push) {
            Ok(()) => Ok(true),
            Err(RingError::Full) => Ok(false),
            Err(e) => Err(ring_error("writing into the link's ring", e)),
        }
    }

    /// Appends, waiting for room as long as the reader makes none: on the space bell,
    /// after announcing the wait (the ring's "Ordering"), until the link is closed.
    ///
    /// # Errors
    /// [`Error::Closed`] once the link is closed or the reader dropped its end;
    /// [`Error::RingCorrupt`] if the reader's words are impossible; [`Error::Io`].
    pub(super) async fn push(&mut self, shared: &Shared, push: Push<'_>) -> Result<()> {
        loop {
            if shared.is_closed() {
                return Err(Error::Closed);
            }
            if self.try_push_now(push)? {
                return Ok(());
            }
            // The reader makes room only from what it sees: a held batch is published
            // before waiting (and stays held).
            self.writer.flush();
            let closing = shared.closing.notified();
            tokio::pin!(closing);
            closing.as_mut().enable();
            self.writer.announce_waiting();
            // Look again after announcing, and after `enable`, so neither a consume nor
            // a close is missed.
            let pushed = if shared.is_closed() {
                Err(Error::Closed)
            } else {
                self.try_push_now(push)
            };
            if !matches!(pushed, Ok(false)) {
                self.writer.stop_waiting();
                return pushed.map(|_| ());
            }
            let waited = tokio::select! {
                biased;
                () = &mut closing => Ok(()),
                ready = self.space.readable() => ready.map(|mut ready| {
                    let mut count = [0u8; 8];
                    let _ = rustix::io::read(ready.get_inner().as_fd(), &mut count);
                    ready.clear_ready();
                }),
            };
            self.writer.stop_waiting();
            waited.map_err(Error::io("waiting for room in the link's ring"))?;
        }
    }
}

/// Appends to a [`TxRing`] held back from its reader until this is dropped
/// ([`TxRing::batch`]).
#[derive(Debug)]
pub(super) struct Batch<'a>(&'a mut TxRing);

impl Batch<'_> {
    /// Publishes what the batch appended so far (before a frame goes on the socket: the
    /// reader must see the marker first); later appends stay held.
    pub(super) fn flush(&mut self) {
        self.0.writer.flush();
    }
}

impl std::ops::Deref for Batch<'_> {
    type Target = TxRing;

    fn deref(&self) -> &TxRing {
        self.0
    }
}

impl std::ops::DerefMut for Batch<'_> {
    fn deref_mut(&mut self) -> &mut TxRing {
        self.0
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        self.0.writer.publish();
    }
}

/// The length of the first encoded frame in `bytes`, and how many descriptors it announces.
///
/// # Errors
/// [`Error::Message`] if `bytes` do not start with a whole frame.
pub(super) fn first_frame(bytes: &[u8]) -> Result<(usize, usize)> {
    let truncated = || baton_messages::Error::Truncated {
        have: bytes.len(),
        need: HEADER_LEN,
    };
    let header: &[u8; HEADER_LEN] = bytes
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(truncated)?;
    let header = FrameHeader::parse(header)?;
    let len = HEADER_LEN + header.len as usize;
    if len > bytes.len() {
        return Err(baton_messages::Error::Truncated {
            have: bytes.len(),
            need: len,
        }
        .into());
    }
    Ok((len, usize::from(header.nfds)))
}

/// Decodes a frame read from the ring: one whole frame that announces no descriptors.
///
/// # Errors
/// [`Error::Message`] for bytes that do not decode; [`Error::MissingFds`] for a frame that
/// announces descriptors (they never travel through the ring).
pub(super) fn decode_ring_frame(bytes: &[u8]) -> Result<Message> {
    let (len, nfds) = first_frame(bytes)?;
    if len != bytes.len() {
        return Err(baton_messages::Error::TrailingBytes(bytes.len() - len).into());
    }
    if nfds != 0 {
        return Err(Error::MissingFds {
            need: nfds,
            have: 0,
        });
    }
    Ok(decode_payload(&bytes[HEADER_LEN..])?)
}

/// A ring error as the link reports it.
pub(super) fn ring_error(op: &'static str, e: RingError) -> Error {
    match e {
        RingError::Corrupt(reason) => Error::RingCorrupt { reason },
        RingError::Closed => Error::Closed,
        RingError::Io(source) => Error::Io { op, source },
        other => Error::Io {
            op,
            source: std::io::Error::other(other.to_string()),
        },
    }
}

/// Creates this side's reading ring of `capacity` bytes for an offer; `None` (logged) if it
/// cannot be made: the link then stays on the socket.
pub(super) fn make_ring(capacity: usize) -> Option<(RingReader, RingFds)> {
    match RingReader::create(capacity, PollWindow::for_this_machine()) {
        Ok(made) => Some(made),
        Err(e @ RingError::TooMany { .. }) => {
            tracing::debug!(error = %e, "no ring for this link: it uses the socket");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, capacity, "no ring for this link: it uses the socket");
            None
        }
    }
}

/// Opens the writing end of a ring the peer offered with `fds`; `None` (logged at debug)
/// for anything that is not a ring: the link stays on the socket.
pub(super) fn accept_offer(capacity: u64, mut fds: super::FrameFds) -> Option<RingWriter> {
    if fds.len() != 3 {
        tracing::debug!(
            fds = fds.len(),
            "ring offer refused: it carries no three descriptors"
        );
        return None;
    }
    let (Ok(memory), Ok(doorbell), Ok(space)) = (fds.take(0), fds.take(1), fds.take(2)) else {
        tracing::debug!("ring offer refused: its descriptors were lost on receipt");
        return None;
    };
    match RingWriter::open(RingFds {
        memory,
        doorbell,
        space,
    }) {
        Ok(writer) => {
            if writer.capacity() as u64 != capacity {
                tracing::debug!(
                    offered = capacity,
                    capacity = writer.capacity(),
                    "ring offer names another capacity than its memory: the memory's is used"
                );
            }
            Some(writer)
        }
        Err(e) => {
            tracing::debug!(error = %e, "ring offer refused: the link stays on the socket");
            None
        }
    }
}

/// Where a link's reader reads.
#[derive(Debug, Default)]
pub(super) enum RxRing {
    /// The socket alone: no ring offered.
    #[default]
    Off,
    /// A ring offered: the socket until the peer's `RingReady`.
    Offered(AsyncRingReader),
    /// The ring, and the socket after a marker.
    On {
        /// The ring.
        ring: AsyncRingReader,
        /// A marker was read: the next frame is on the socket.
        socket_next: bool,
        /// The peer dropped its end: only the socket's end (or a protocol break) is left.
        ring_closed: bool,
    },
}

impl RxRing {
    /// Wraps this side's reading end, once the offer is sent.
    ///
    /// # Errors
    /// [`Error::Io`] if the doorbell cannot be registered with the runtime.
    pub(super) fn offered(reader: RingReader, shared: &Shared) -> Result<Self> {
        shared.set_rx_ring(
            reader
                .closer()
                .map_err(|e| ring_error("keeping a closer of the ring", e))?,
        );
        let ring = AsyncRingReader::new(reader)
            .map_err(|e| ring_error("registering the ring's doorbell", e))?;
        Ok(Self::Offered(ring))
    }
}
