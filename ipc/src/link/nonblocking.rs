//! The asynchronous driver of links, on tokio: the same wire format and handshake as the
//! blocking [`Link`](super::Link), for event loops and actors.
//!
//! Once the handshake is done, the socket is registered with tokio's reactor for reads
//! only: writes are direct non-blocking `sendmsg`s, and only a write that would block
//! registers (a duplicate of) the socket for writability, until the write is done. A link
//! registered for both wakes its process every time the peer reads our bytes (write space,
//! edge-triggered) with nothing to do (issue 24: two `epoll_wait`s per round trip and, on a
//! shared core, a second wakeup of the peer).
//!
//! With a ring ([`LinkConfig::with_ring`]), frames travel through shared memory instead
//! (`ringed`, [`crate::ring`]): a writer copies each frame without descriptors into the
//! peer's ring, the reader waits on its ring's doorbell and on the socket at once (the
//! socket carries the frames with descriptors, after a marker in the ring, and tells a
//! dead peer by its end of stream). A ring that is full makes a writer wait for room on
//! the ring's space bell, until the link is closed: the ring's capacity is the bound.

use super::creds::{KernelPeer, PeerCred};
use super::handshake::{ClientHandshake, Refusal, ServerHandshake};
use super::ringed::{
    Push, RxRing, Shared, TxRing, TxState, accept_offer, decode_ring_frame, first_frame, make_ring,
    ring_error,
};
use super::wire::{FrameFds, Received, Receiver, io_error, send_some};
use super::{LinkConfig, PeerInfo, Via};
use crate::ring::{Entry, RingError, RingReader};
use crate::{Error, Result};
use baton_messages::codec::{encode_frame, frame_bytes};
use baton_messages::protocol::{RefuseReason, RingOffer};
use baton_messages::{Message, ProcessId};
use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::UnixStream;

/// An established link's socket, registered for reads only.
type Sock = AsyncFd<std::os::unix::net::UnixStream>;

/// An established, authenticated link driven by tokio. Split it into a reader and a
/// writer to receive and send from different tasks.
#[derive(Debug)]
pub struct AsyncLink {
    stream: Arc<Sock>,
    rx: Receiver,
    peer: PeerInfo,
    shared: Arc<Shared>,
    ring: RxRing,
}

async fn send_frame(
    stream: &UnixStream,
    mut bytes: &[u8],
    mut fds: &[BorrowedFd<'_>],
) -> Result<()> {
    while !bytes.is_empty() {
        let n = stream
            .async_io(Interest::WRITABLE, || send_some(stream.as_fd(), bytes, fds))
            .await
            .map_err(|e| io_error("sending a frame", e))?;
        fds = &[];
        bytes = &bytes[n..];
    }
    Ok(())
}

/// Writes all of `bytes` (`fds` with the first byte) on an established link's socket:
/// direct `sendmsg`s while the socket takes them; while one would block, a duplicate of
/// the socket is registered for writability (the link's own registration is for reads
/// only) and the write waits there. Dropped with the write, it leaves the reactor, so a
/// link that is not writing is never woken by write space. A cut (`shutdown(2)`, see
/// [`LinkCloser`]) wakes the wait, and the next `sendmsg` fails.
async fn send_direct(sock: &Sock, mut bytes: &[u8], mut fds: &[BorrowedFd<'_>]) -> Result<()> {
    let fd = sock.get_ref().as_fd();
    let mut room: Option<AsyncFd<OwnedFd>> = None;
    while !bytes.is_empty() {
        let n = match send_some(fd, bytes, fds) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let waiter = match &room {
                    Some(waiter) => waiter,
                    None => room.insert(writability(fd)?),
                };
                match waiter
                    .writable()
                    .await
                    .map_err(|e| io_error("waiting for room on the socket", e))?
                    .try_io(|_| send_some(fd, bytes, fds))
                {
                    Ok(sent) => sent.map_err(|e| io_error("sending a frame", e))?,
                    // Still full: readiness cleared, wait again.
                    Err(_would_block) => continue,
                }
            }
            Err(e) => return Err(io_error("sending a frame", e)),
        };
        fds = &[];
        bytes = &bytes[n..];
    }
    Ok(())
}

/// A duplicate of `fd` registered for writability alone. epoll tells a registration from
/// another by descriptor number, so the duplicate coexists with the link's read
/// registration; it reports the socket's state at registration, so room made between
/// the `EAGAIN` and this call is not missed.
fn writability(fd: BorrowedFd<'_>) -> Result<AsyncFd<OwnedFd>> {
    let dup = fd
        .try_clone_to_owned()
        .map_err(|e| io_error("duplicating the socket to wait for room", e))?;
    register(dup, Interest::WRITABLE)
        .map_err(|e| io_error("registering the socket to wait for room", e))
}

/// Registers `owned` with the reactor for `interest`.
///
/// `AsyncFd::with_interest` is deprecated since tokio 1.54 in favour of an `unsafe`
/// `register_with_interest`, because an arbitrary `AsRawFd` may close or change its
/// descriptor while registered. Both types used here own their descriptor for their whole
/// life (`OwnedFd`, `std::os::unix::net::UnixStream`) and the `AsyncFd` owns them, so that
/// cannot happen; this keeps `unsafe` out of the link, as the crate's rule asks.
#[allow(deprecated)]
fn register<T: std::os::fd::AsRawFd + Into<OwnedFd>>(
    owned: T,
    interest: Interest,
) -> std::io::Result<AsyncFd<T>> {
    AsyncFd::with_interest(owned, interest)
}

/// Receives the next frame on an established link's socket. After a read that drained
/// the socket (see [`Receiver::recv_drained`]) read readiness is cleared at once, so
/// the task parks without a second `recvmsg` that would only fail with `EAGAIN`; after
/// a read that filled the buffer or brought descriptors (the kernel stops a read after
/// a descriptor-carrying message, with bytes possibly still queued), it reads again.
/// tokio clears readiness only if no new event came since it was reported, so bytes that
/// arrive after the read wake the task.
async fn recv_established(sock: &Sock, rx: &mut Receiver) -> Result<Received> {
    loop {
        if let Some(received) = rx.next()? {
            return Ok(received);
        }
        rx.check_fds()?;
        let mut ready = sock.readable().await.map_err(|e| rx.recv_error(e))?;
        match rx.recv_drained(sock.get_ref().as_fd()) {
            Ok((0, _)) => return Err(rx.at_eof()),
            Ok((_, true)) => ready.clear_ready(),
            Ok((_, false)) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => ready.clear_ready(),
            Err(e) => return Err(rx.recv_error(e)),
        }
    }
}

async fn recv_frame(stream: &UnixStream, rx: &mut Receiver) -> Result<Received> {
    loop {
        if let Some(received) = rx.next()? {
            return Ok(received);
        }
        rx.check_fds()?;
        let n = stream
            .async_io(Interest::READABLE, || rx.recv_some(stream.as_fd()))
            .await
            .map_err(|e| rx.recv_error(e))?;
        if n == 0 {
            return Err(rx.at_eof());
        }
    }
}

async fn send_message(stream: &UnixStream, msg: &Message) -> Result<()> {
    let mut buf = Vec::with_capacity(256);
    encode_frame(msg, 0, &mut buf)?;
    send_frame(stream, &buf, &[]).await
}

async fn refuse(stream: &UnixStream, refusal: Refusal) -> Error {
    if let Some(reply) = refusal.reply() {
        let _ = send_message(stream, &reply).await;
    }
    refusal.error
}

/// Offers the peer a ring for its frames to this side, if the configuration asks for one
/// (`RingOffer`, the ring's three descriptors beside it): this side's reading end, or
/// `None` when no ring is asked for, none could be made (logged), or the offer could not
/// be sent (the socket's failure, a refusal the peer sent, shows at the next receive).
async fn offer_ring(stream: &UnixStream, config: &LinkConfig) -> Result<Option<RingReader>> {
    let Some(capacity) = config.ring else {
        return Ok(None);
    };
    let Some((reader, fds)) = make_ring(capacity) else {
        return Ok(None);
    };
    let offer = Message::RingOffer(RingOffer {
        capacity: capacity as u64,
    });
    let frame = frame_bytes(&offer, 3)?;
    let fds = [fds.memory.as_fd(), fds.doorbell.as_fd(), fds.space.as_fd()];
    if let Err(e) = send_frame(stream, &frame, &fds).await {
        tracing::debug!(error = %e, "the ring offer could not be sent");
        return Ok(None);
    }
    tracing::debug!(capacity, "ring offered to the peer");
    Ok(Some(reader))
}

impl AsyncLink {
    /// Connects to the listener at `path` and completes the handshake as the client.
    ///
    /// # Errors
    /// As [`Link::connect`](super::Link::connect).
    pub async fn connect(path: impl AsRef<Path>, config: &LinkConfig) -> Result<AsyncLink> {
        let stream = UnixStream::connect(path.as_ref())
            .await
            .map_err(Error::io("connecting to a Baton socket"))?;
        Self::client(stream, config).await
    }

    /// Completes the handshake as the client over a connected stream.
    ///
    /// # Errors
    /// As [`Link::client`](super::Link::client).
    pub async fn client(stream: UnixStream, config: &LinkConfig) -> Result<AsyncLink> {
        let peer = KernelPeer::of(&stream)?;
        config.policy.check(&peer.cred)?;
        let mut rx = Receiver::default();
        let handshake = async {
            let (state, hello) = ClientHandshake::start(&config.session)?;
            send_message(&stream, &hello).await?;
            let welcome = recv_frame(&stream, &mut rx).await?.message;
            let (auth, server) = match state.on_welcome(&config.session, &peer, welcome) {
                Ok(ok) => ok,
                Err(r) => return Err(refuse(&stream, r).await),
            };
            send_message(&stream, &auth).await?;
            Ok(server)
        };
        let server = deadline(config, handshake).await?;
        tracing::debug!(peer = %server, "link established (client)");
        let ring = offer_ring(&stream, config).await?;
        Self::established(stream, rx, server, peer.cred, ring)
    }

    /// Completes the handshake as the server over an accepted stream.
    ///
    /// # Errors
    /// As [`Link::server`](super::Link::server).
    pub async fn server(stream: UnixStream, config: &LinkConfig) -> Result<AsyncLink> {
        let peer = KernelPeer::of(&stream)?;
        if let Err(e) = config.policy.check(&peer.cred) {
            return Err(refuse(&stream, Refusal::new(e, RefuseReason::NotAllowed)).await);
        }
        let mut rx = Receiver::default();
        let handshake = async {
            let hello = recv_frame(&stream, &mut rx).await?.message;
            let (state, welcome) = match ServerHandshake::on_hello(&config.session, &peer, hello) {
                Ok(ok) => ok,
                Err(r) => return Err(refuse(&stream, r).await),
            };
            send_message(&stream, &welcome).await?;
            let auth = recv_frame(&stream, &mut rx).await?.message;
            match state.on_auth(&config.session, auth) {
                Ok(client) => Ok(client),
                Err(r) => Err(refuse(&stream, r).await),
            }
        };
        let client = deadline(config, handshake).await?;
        tracing::debug!(peer = %client, "link established (server)");
        let ring = offer_ring(&stream, config).await?;
        Self::established(stream, rx, client, peer.cred, ring)
    }

    /// The handshake is done: the socket leaves tokio's registration for reads and
    /// writes and is registered again for reads only (see the module docs); `ring` is the
    /// reading end of the ring this side offered, if it did.
    fn established(
        stream: UnixStream,
        rx: Receiver,
        process: ProcessId,
        cred: PeerCred,
        ring: Option<RingReader>,
    ) -> Result<AsyncLink> {
        let shared = Arc::<Shared>::default();
        let ring = match ring {
            Some(reader) => RxRing::offered(reader, &shared)?,
            None => RxRing::Off,
        };
        // Still non-blocking once out of tokio's hands.
        let stream = stream
            .into_std()
            .map_err(|e| io_error("taking the socket from the runtime", e))?;
        let sock = register(stream, Interest::READABLE)
            .map_err(|e| io_error("registering the socket for reads", e))?;
        Ok(AsyncLink {
            stream: Arc::new(sock),
            rx,
            peer: PeerInfo {
                process,
                via: Via::Unix(cred),
            },
            shared,
            ring,
        })
    }

    /// Who is at the other end.
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }

    /// A handle that shuts the socket down, whatever the halves are doing (see
    /// [`LinkCloser`]).
    pub fn closer(&self) -> LinkCloser {
        LinkCloser {
            sock: Arc::clone(&self.stream),
            shared: Arc::clone(&self.shared),
        }
    }

    /// Splits into a receiving and a sending half, usable from different tasks.
    pub fn into_split(self) -> (LinkReader, LinkWriter) {
        (
            LinkReader {
                stream: Arc::clone(&self.stream),
                rx: self.rx,
                shared: Arc::clone(&self.shared),
                ring: self.ring,
                frame: Vec::new(),
            },
            LinkWriter {
                stream: self.stream,
                buf: Vec::with_capacity(512),
                shared: self.shared,
            },
        )
    }
}

async fn deadline<T>(config: &LinkConfig, fut: impl Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout(config.handshake_timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            op: "link handshake",
            after: config.handshake_timeout,
        }),
    }
}

/// Shuts an [`AsyncLink`]'s socket down in both directions (`shutdown(2)`), whatever its
/// reader and writer are doing: a writer parked on a full socket (or waiting for room in
/// the peer's ring) fails at once, a pending receive ends, and the peer sees end of
/// stream — even if it never reads what was queued.
#[derive(Debug, Clone)]
pub struct LinkCloser {
    sock: Arc<Sock>,
    shared: Arc<Shared>,
}

/// Shuts `sock` down and tells the writers (those waiting for room in a ring).
fn cut(sock: &Sock, shared: &Shared) {
    let _ = rustix::net::shutdown(sock.get_ref().as_fd(), rustix::net::Shutdown::Both);
    shared.close();
}

impl LinkCloser {
    /// Shuts the socket down. Idempotent.
    pub fn close(&self) {
        cut(&self.sock, &self.shared);
    }

    /// Whether a receive would return at once: bytes are waiting (on the socket, or in this
    /// side's ring), or the peer's end is closed (end of stream), or the socket failed.
    /// After the peer process died, `false` means its end of the socket lives on in
    /// another process (a descendant inherited it) and nothing it sent is left to read.
    pub fn readable_now(&self) -> bool {
        use rustix::net::RecvFlags;
        if self.shared.rx_ring_has_entry() {
            return true;
        }
        let mut byte = [0u8; 1];
        !matches!(
            rustix::net::recv(
                self.sock.get_ref().as_fd(),
                &mut byte,
                RecvFlags::PEEK | RecvFlags::DONTWAIT
            ),
            Err(rustix::io::Errno::AGAIN)
        )
    }
}

/// The receiving half of an [`AsyncLink`].
#[derive(Debug)]
pub struct LinkReader {
    stream: Arc<Sock>,
    rx: Receiver,
    shared: Arc<Shared>,
    ring: RxRing,
    /// A frame read from the ring.
    frame: Vec<u8>,
}

/// What a frame the reader received does to the ring set-up: a peer's offer is checked
/// and left for the writers, the peer's `RingReady` switches this reader to its ring;
/// anything else is for the caller.
fn ring_control(ring: &mut RxRing, shared: &Shared, got: Received) -> Result<Option<Received>> {
    match got.message {
        Message::RingOffer(offer) => {
            match accept_offer(offer.capacity, got.fds) {
                Some(writer) => {
                    if !shared.leave_offered(writer) {
                        return Err(Error::UnexpectedMessage {
                            expected: "one RingOffer per link",
                            got: "a second RingOffer",
                        });
                    }
                }
                None => shared.decline(),
            }
            Ok(None)
        }
        Message::RingDeclined => match std::mem::take(ring) {
            RxRing::Offered(reader) => {
                tracing::debug!("the peer declined our ring: this direction stays on the socket");
                drop(reader);
                shared.drop_rx_ring();
                Ok(None)
            }
            RxRing::Off => Ok(None),
            on @ RxRing::On { .. } => {
                *ring = on;
                Err(Error::UnexpectedMessage {
                    expected: "no RingDeclined (the peer writes into our ring)",
                    got: "RingDeclined",
                })
            }
        },
        Message::RingReady => match std::mem::take(ring) {
            RxRing::Offered(reader) => {
                tracing::debug!("the peer writes into our ring");
                *ring = RxRing::On {
                    ring: reader,
                    socket_next: false,
                    ring_closed: false,
                };
                Ok(None)
            }
            other => {
                *ring = other;
                Err(Error::UnexpectedMessage {
                    expected: "no RingReady (no ring offered, or one announced already)",
                    got: "RingReady",
                })
            }
        },
        message => Ok(Some(Received {
            message,
            fds: got.fds,
        })),
    }
}

/// An entry the reader took from its ring: a frame (decoded from `frame`, which is then
/// cleared), or a marker (the next frame is on the socket).
fn ring_entry(
    entry: Entry,
    frame: &mut Vec<u8>,
    socket_next: &mut bool,
) -> Result<Option<Received>> {
    match entry {
        Entry::Frame { .. } => {
            let message = decode_ring_frame(frame);
            frame.clear();
            Ok(Some(Received {
                message: message?,
                fds: FrameFds::none(),
            }))
        }
        Entry::Socket => {
            *socket_next = true;
            Ok(None)
        }
    }
}

/// Socket bytes with no marker in the ring before them.
fn unmarked() -> Error {
    Error::UnexpectedMessage {
        expected: "frames in the ring (a frame on the socket only after a marker)",
        got: "bytes on the socket with no marker in the ring",
    }
}

impl LinkReader {
    /// Receives the next message and the descriptors that came with it.
    ///
    /// On a link whose peer writes into this side's ring, waits on the ring and the socket
    /// at once: frames come from the ring, a frame after a marker from the socket, and the
    /// socket's end of stream ends the receive as [`Error::Closed`] (a peer killed
    /// without closing its ring too).
    ///
    /// # Errors
    /// As [`Link::recv`](super::Link::recv); [`Error::RingCorrupt`] when the peer
    /// corrupted the ring; [`Error::UnexpectedMessage`] for bytes on the socket without a
    /// marker in the ring, or a ring message out of place. After an error, drop the link
    /// (writers waiting for room in the peer's ring stop with [`Error::Closed`]).
    pub async fn recv(&mut self) -> Result<Received> {
        let got = self.next().await;
        if got.is_err() {
            self.shared.close();
        }
        got
    }

    /// Whether frames come through this side's ring (the peer announced it with
    /// `RingReady`).
    pub fn uses_ring(&self) -> bool {
        matches!(self.ring, RxRing::On { .. })
    }

    /// Whether this side still keeps a ring it offered or reads (not after the peer
    /// declined it).
    #[cfg(test)]
    pub(crate) fn keeps_ring(&self) -> bool {
        !matches!(self.ring, RxRing::Off)
            || self
                .shared
                .rx_ring
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
    }

    async fn next(&mut self) -> Result<Received> {
        let LinkReader {
            stream,
            rx,
            shared,
            ring,
            frame,
        } = self;
        loop {
            let got = match ring {
                RxRing::Off | RxRing::Offered(_) => recv_established(stream, rx).await?,
                RxRing::On {
                    socket_next: socket_next @ true,
                    ..
                } => {
                    let got = recv_established(stream, rx).await?;
                    *socket_next = false;
                    got
                }
                RxRing::On {
                    ring: reader,
                    socket_next,
                    ring_closed,
                } => {
                    let entry = if rx.has_bytes() {
                        // Socket bytes follow a marker, published before them.
                        match reader.try_recv(frame) {
                            Ok(Some(entry)) => entry,
                            Ok(None) | Err(RingError::Closed) => return Err(unmarked()),
                            Err(e) => return Err(ring_error("reading the link's ring", e)),
                        }
                    } else {
                        let from_ring = tokio::select! {
                            biased;
                            entry = reader.recv(frame), if !*ring_closed => Some(entry),
                            ready = stream.readable() => {
                                let mut ready = ready.map_err(|e| rx.recv_error(e))?;
                                match reader.try_recv(frame) {
                                    Ok(Some(entry)) => Some(Ok(entry)),
                                    // Closed and read to its end: only the socket is left.
                                    Ok(None) | Err(RingError::Closed) => {
                                        // Nothing in the ring: the socket may say it ended.
                                        match rx.recv_drained(stream.get_ref().as_fd()) {
                                            Ok((0, _)) => return Err(rx.at_eof()),
                                            Ok((_, true)) => ready.clear_ready(),
                                            Ok((_, false)) => {}
                                            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                                                ready.clear_ready();
                                            }
                                            Err(e) => return Err(rx.recv_error(e)),
                                        }
                                        None
                                    }
                                    Err(e) => Some(Err(e)),
                                }
                            }
                        };
                        match from_ring {
                            None => continue,
                            Some(Ok(entry)) => entry,
                            Some(Err(RingError::Closed)) => {
                                *ring_closed = true;
                                continue;
                            }
                            Some(Err(e)) => return Err(ring_error("reading the link's ring", e)),
                        }
                    };
                    match ring_entry(entry, frame, socket_next)? {
                        Some(got) => got,
                        None => continue,
                    }
                }
            };
            if let Some(got) = ring_control(ring, shared, got)? {
                return Ok(got);
            }
        }
    }
}

/// The sending half of an [`AsyncLink`]. Closing it (drop) does not close the socket
/// while the reader lives; [`shutdown`](Self::shutdown) does.
///
/// A clone writes on the same socket. The bytes of one send go out in order, but two
/// clones sending at once may interleave their frames: whoever holds clones orders their
/// sends. (The link actor writes from its writer task alone: writing from the actor's own
/// turn with [`try_send_encoded`](Self::try_send_encoded) while nothing was queued was
/// tried for issue 24 and withdrawn, `docs/BENCHMARKS.md`.)
///
/// On a link whose peer offered a ring, the writer's next send announces it (`RingReady`,
/// the last frame on the socket alone) and writes from then on into the ring: one clone
/// at a time, for a whole send, so a marker and the socket frame after it are never
/// split by another clone's frames.
#[derive(Debug)]
pub struct LinkWriter {
    stream: Arc<Sock>,
    buf: Vec<u8>,
    shared: Arc<Shared>,
}

impl Clone for LinkWriter {
    fn clone(&self) -> Self {
        LinkWriter {
            stream: Arc::clone(&self.stream),
            buf: Vec::new(),
            shared: Arc::clone(&self.shared),
        }
    }
}

/// Sends encoded frames, `fds` with the first: on the socket, or into the peer's ring once
/// it is announced (announcing it first if the peer offered one since the last send).
async fn send_frames(
    sock: &Sock,
    shared: &Shared,
    mut frames: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<()> {
    let mut tx = shared.tx.lock().await;
    if tx.owed > 0 {
        // The rest of what `try_send_encoded` began on the socket.
        let (begun, after) = frames.split_at(tx.owed.min(frames.len()));
        send_direct(sock, begun, &[]).await?;
        tx.owed -= begun.len();
        frames = after;
        if frames.is_empty() {
            return Ok(());
        }
    }
    if tx.ring.is_none() && shared.take_declined() {
        send_direct(sock, &frame_bytes(&Message::RingDeclined, 0)?, &[]).await?;
    }
    if tx.ring.is_none()
        && let Some(writer) = shared.take_offered()
    {
        switch_to_ring(sock, shared, &mut tx, writer).await?;
    }
    let sent = match &mut tx.ring {
        None => send_direct(sock, frames, fds).await,
        Some(ring) => send_ringed(sock, shared, ring, frames, fds).await,
    };
    if shared.is_closed() {
        // Closed while this send held the ring: its end closes now.
        tx.ring = None;
    }
    sent
}

/// Announces the peer's ring (`RingReady`, our last frame on the socket alone) and makes
/// the writers use it. A space bell that cannot be registered leaves the link on the socket
/// (logged; the ring is dropped, unannounced).
async fn switch_to_ring(
    sock: &Sock,
    shared: &Shared,
    tx: &mut TxState,
    writer: crate::ring::RingWriter,
) -> Result<()> {
    let space = TxRing::space_of(&writer).and_then(|bell| register(bell, Interest::READABLE));
    let space = match space {
        Ok(space) => space,
        Err(e) => {
            tracing::warn!(error = %e, "the peer's ring is not used: the link stays on the socket");
            return send_direct(sock, &frame_bytes(&Message::RingDeclined, 0)?, &[]).await;
        }
    };
    let ready = frame_bytes(&Message::RingReady, 0)?;
    send_direct(sock, &ready, &[]).await?;
    tx.ring = Some(TxRing::new(writer, space));
    shared.set_writes_ring();
    tracing::debug!("writing into the peer's ring");
    Ok(())
}

/// Sends encoded frames through the peer's ring: each without descriptors that fits in the
/// ring, into it; any other after a marker, on the socket. The frames are published to the
/// reader as one batch (and before a frame goes on the socket).
async fn send_ringed(
    sock: &Sock,
    shared: &Shared,
    ring: &mut TxRing,
    mut frames: &[u8],
    mut fds: &[BorrowedFd<'_>],
) -> Result<()> {
    let mut ring = ring.batch();
    while !frames.is_empty() {
        let (len, nfds) = first_frame(frames)?;
        let (frame, rest) = frames.split_at(len);
        if ring.carries(frame, nfds.max(fds.len())) {
            ring.push(shared, Push::Frame(frame)).await?;
        } else {
            ring.push(shared, Push::Marker).await?;
            ring.flush();
            send_direct(sock, frame, fds).await?;
        }
        fds = &[];
        frames = rest;
    }
    Ok(())
}

impl LinkWriter {
    /// Sends one message with `fds` beside it.
    ///
    /// # Errors
    /// [`Error::Closed`] if the peer is gone, or an encoding error.
    pub async fn send(&mut self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.buf.clear();
        encode_frame(msg, fds.len(), &mut self.buf)?;
        send_frames(&self.stream, &self.shared, &self.buf, fds).await
    }

    /// Sends already encoded frames (see [`baton_messages::codec::encode_frame`]); `fds`
    /// go with the first byte, so they must belong to the first frame.
    ///
    /// # Errors
    /// [`Error::Closed`] if the peer is gone.
    pub async fn send_encoded(&mut self, frames: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        send_frames(&self.stream, &self.shared, frames, fds).await
    }

    /// One non-blocking `sendmsg` of already encoded frames, `fds` with the first byte:
    /// returns how many bytes the socket took now, `0` when it is full. The descriptors
    /// went with any byte taken; the rest of the bytes must follow with none (through
    /// [`send_encoded`](Self::send_encoded), say) before anything else is sent.
    ///
    /// On a link that writes into the peer's ring, it takes whole frames without
    /// descriptors into the ring while they fit, and `0` for a first frame with
    /// descriptors (send it with [`send_encoded`](Self::send_encoded)). It also takes `0`
    /// while another clone sends, or while a ring the peer offered waits to be announced
    /// or declined.
    ///
    /// # Errors
    /// [`Error::Closed`] if the peer is gone, else the socket's failure.
    pub fn try_send_encoded(&self, frames: &[u8], fds: &[BorrowedFd<'_>]) -> Result<usize> {
        let Ok(mut tx) = self.shared.tx.try_lock() else {
            return Ok(0);
        };
        if tx.owed > 0 || (tx.ring.is_none() && self.shared.has_offered()) {
            return Ok(0);
        }
        let Some(ring) = &mut tx.ring else {
            return match send_some(self.stream.get_ref().as_fd(), frames, fds) {
                Ok(n) => {
                    tx.owed = frames.len() - n;
                    if n == 0 {
                        tx.owed = 0;
                    }
                    Ok(n)
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(0),
                Err(e) => Err(io_error("sending a frame", e)),
            };
        };
        if self.shared.is_closed() {
            return Err(Error::Closed);
        }
        let mut ring = ring.batch();
        let mut taken = 0;
        while taken < frames.len() {
            let (len, nfds) = first_frame(&frames[taken..])?;
            let frame = &frames[taken..taken + len];
            let nfds = if taken == 0 {
                nfds.max(fds.len())
            } else {
                nfds
            };
            if !ring.carries(frame, nfds) || !ring.try_push_now(Push::Frame(frame))? {
                break;
            }
            taken += len;
        }
        Ok(taken)
    }

    /// Whether this side writes its frames into the peer's ring (it announced it with
    /// `RingReady`).
    pub fn uses_ring(&self) -> bool {
        self.shared.writes_ring()
    }

    /// Shuts the socket down in both directions: the peer sees end of stream, our
    /// reader's pending receive ends, and a clone waiting for room in the peer's ring
    /// stops.
    pub fn shutdown(&self) {
        cut(&self.stream, &self.shared);
    }
}

#[cfg(test)]
impl LinkWriter {
    /// Test: bytes straight onto the socket, past the ring and its markers.
    pub(super) fn send_raw_for_test(&self, bytes: &[u8]) -> std::io::Result<usize> {
        send_some(self.stream.get_ref().as_fd(), bytes, &[])
    }

    /// Test: takes the peer's ring out of the writers without closing it, as a killed
    /// process leaves it.
    pub(super) fn take_ring_for_test(&self) -> Option<TxRing> {
        self.shared.tx.try_lock().ok()?.ring.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Session;
    use baton_messages::SessionToken;

    #[tokio::test(flavor = "current_thread")]
    async fn handshake_and_frames_with_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let config = LinkConfig::new(Session::new(SessionToken::from_bytes([8; 32])));
        let (server, client) =
            tokio::join!(AsyncLink::server(a, &config), AsyncLink::client(b, &config));
        let (server, client) = (server.unwrap(), client.unwrap());
        assert_eq!(server.peer().process, crate::process::current());
        let (mut rx, _wx) = server.into_split();
        let (_crx, mut cwx) = client.into_split();
        let file = tempfile::tempfile().unwrap();
        cwx.send(&Message::Ping(5), &[file.as_fd()]).await.unwrap();
        cwx.send(&Message::Pong(6), &[]).await.unwrap();
        let got = rx.recv().await.unwrap();
        assert_eq!(got.message, Message::Ping(5));
        assert_eq!(got.fds.len(), 1);
        let got = rx.recv().await.unwrap();
        assert_eq!((got.message, got.fds.len()), (Message::Pong(6), 0));
        cwx.shutdown();
        assert!(matches!(rx.recv().await, Err(Error::Closed)));
    }

    /// `readable_now` (the reader's verdict on a dead peer): nothing waiting is `false`;
    /// bytes waiting are `true`, and peeking leaves them to be read; the peer's end closed
    /// is `true` (a receive would return the end of the stream at once).
    #[tokio::test(flavor = "current_thread")]
    async fn readable_now_tells_waiting_bytes_and_a_closed_peer_from_silence() {
        let (a, b) = UnixStream::pair().unwrap();
        let config = LinkConfig::new(Session::new(SessionToken::from_bytes([8; 32])));
        let (server, client) =
            tokio::join!(AsyncLink::server(a, &config), AsyncLink::client(b, &config));
        let server = server.unwrap();
        let closer = server.closer();
        let (mut rx, _wx) = server.into_split();
        let (_crx, mut cwx) = client.unwrap().into_split();
        assert!(!closer.readable_now(), "nothing was sent");
        cwx.send(&Message::Ping(1), &[]).await.unwrap();
        assert!(closer.readable_now(), "a frame is waiting");
        assert_eq!(rx.recv().await.unwrap().message, Message::Ping(1));
        assert!(!closer.readable_now(), "the frame was read");
        cwx.shutdown();
        assert!(closer.readable_now(), "the peer's end is closed");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn one_frame_carries_as_many_descriptors_as_scm_rights_allows() {
        let (a, b) = UnixStream::pair().unwrap();
        let config = LinkConfig::new(Session::new(SessionToken::from_bytes([8; 32])));
        let (server, client) =
            tokio::join!(AsyncLink::server(a, &config), AsyncLink::client(b, &config));
        let (mut rx, _wx) = server.unwrap().into_split();
        let (_crx, mut cwx) = client.unwrap().into_split();
        let max = baton_messages::MAX_FDS_PER_FRAME;
        let files: Vec<std::fs::File> = (0..max).map(|_| tempfile::tempfile().unwrap()).collect();
        let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
        cwx.send(&Message::Ping(1), &fds).await.unwrap();
        cwx.send(&Message::Ping(2), &fds[..3]).await.unwrap();
        let got = rx.recv().await.unwrap();
        assert_eq!((got.message, got.fds.len()), (Message::Ping(1), max));
        let got = rx.recv().await.unwrap();
        assert_eq!((got.message, got.fds.len()), (Message::Ping(2), 3));
    }

    /// A cut closes: a writer parked on a full socket (the peer reads nothing) fails at
    /// once, and the peer — once it reads — finds the end of the stream after the bytes
    /// already in its buffer, not the rest of the frame.
    #[tokio::test(flavor = "current_thread")]
    async fn closing_unparks_a_writer_on_a_full_socket_and_the_peer_sees_the_end() {
        let (a, b) = UnixStream::pair().unwrap();
        let config = LinkConfig::new(Session::new(SessionToken::from_bytes([8; 32])));
        let (server, client) =
            tokio::join!(AsyncLink::server(a, &config), AsyncLink::client(b, &config));
        let server = server.unwrap();
        let closer = server.closer();
        let (_rx, mut wx) = server.into_split();
        let (mut peer_rx, _peer_wx) = client.unwrap().into_split();
        // Far more than a socket buffer holds: the writer parks until someone reads.
        let big = vec![0u8; 64 << 20];
        let writer = tokio::spawn(async move { wx.send_encoded(&big, &[]).await });
        tokio::task::yield_now().await;
        assert!(
            !writer.is_finished(),
            "the writer is parked on the full socket"
        );
        closer.close();
        let sent = tokio::time::timeout(std::time::Duration::from_secs(10), writer)
            .await
            .expect("the parked writer is woken")
            .unwrap();
        assert!(
            sent.is_err(),
            "the write fails once the socket is shut down"
        );
        // The peer reads what was buffered (garbage as frames), then the end: an error,
        // never a hang.
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), peer_rx.recv())
            .await
            .expect("the peer sees the end of the stream");
        assert!(got.is_err(), "{got:?}");
    }

    async fn linked() -> (AsyncLink, AsyncLink) {
        let (a, b) = UnixStream::pair().unwrap();
        let config = LinkConfig::new(Session::new(SessionToken::from_bytes([8; 32])));
        let (server, client) =
            tokio::join!(AsyncLink::server(a, &config), AsyncLink::client(b, &config));
        (server.unwrap(), client.unwrap())
    }

    const WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

    /// Frames with descriptors sent back to back, before the reader wakes: the kernel
    /// stops each read after a descriptor-carrying message with more bytes queued, so
    /// the reader must read again rather than park (it would wait forever: no new byte
    /// comes to wake it).
    #[tokio::test(flavor = "current_thread")]
    async fn frames_with_descriptors_queued_back_to_back_all_arrive_without_a_new_wakeup() {
        let (server, client) = linked().await;
        let (mut rx, _wx) = server.into_split();
        let (_crx, mut cwx) = client.into_split();
        let files: Vec<std::fs::File> = (0..3).map(|_| tempfile::tempfile().unwrap()).collect();
        for i in 0..40u64 {
            let fds: Vec<_> = files
                .iter()
                .take((i % 4) as usize)
                .map(|f| f.as_fd())
                .collect();
            cwx.send(&Message::Ping(i), &fds).await.unwrap();
        }
        for i in 0..40u64 {
            let got = tokio::time::timeout(WITHIN, rx.recv())
                .await
                .expect("every queued frame is read without another byte arriving")
                .unwrap();
            assert_eq!(
                (got.message, got.fds.len()),
                (Message::Ping(i), (i % 4) as usize)
            );
        }
    }

    /// A peer that does not read: the direct write fills the socket and says so
    /// (`try_send_encoded` takes nothing more), a blocking send waits for room (it is not
    /// woken for nothing, and does not spin), and once the peer reads, every frame arrives
    /// whole, in order, with its descriptors.
    #[tokio::test(flavor = "current_thread")]
    async fn a_full_socket_makes_writes_wait_for_room_and_frames_arrive_in_order() {
        let (server, client) = linked().await;
        let (mut rx, _wx) = server.into_split();
        let (_crx, mut cwx) = client.into_split();
        let direct = cwx.clone();
        let filler = frame_bytes(&Message::Ping(0), 0).unwrap();
        let mut sent = 0u64;
        loop {
            let n = direct.try_send_encoded(&filler, &[]).unwrap();
            if n == 0 {
                break;
            }
            assert_eq!(n, filler.len(), "small frames go whole or not at all here");
            sent += 1;
        }
        assert!(sent > 0, "the socket took frames before it filled");
        let file = tempfile::tempfile().unwrap();
        let writer = tokio::spawn(async move {
            let fd = file.as_fd();
            cwx.send(&Message::Ping(1), &[fd]).await?;
            cwx.send(&Message::Pong(2), &[]).await
        });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!writer.is_finished(), "the writer waits for room");
        for _ in 0..sent {
            let got = tokio::time::timeout(WITHIN, rx.recv())
                .await
                .unwrap()
                .unwrap();
            assert_eq!((got.message, got.fds.len()), (Message::Ping(0), 0));
        }
        let got = tokio::time::timeout(WITHIN, rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!((got.message, got.fds.len()), (Message::Ping(1), 1));
        let got = tokio::time::timeout(WITHIN, rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!((got.message, got.fds.len()), (Message::Pong(2), 0));
        tokio::time::timeout(WITHIN, writer)
            .await
            .expect("the writer finishes once there is room")
            .unwrap()
            .unwrap();
    }

    /// A direct write on a link whose peer is gone is `Closed`, not a hang or a panic.
    #[tokio::test(flavor = "current_thread")]
    async fn a_direct_write_to_a_gone_peer_is_closed() {
        let (server, client) = linked().await;
        let (_rx, wx) = server.into_split();
        drop(client);
        let frame = frame_bytes(&Message::Ping(0), 0).unwrap();
        assert!(matches!(
            wx.try_send_encoded(&frame, &[]),
            Err(Error::Closed)
        ));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_silent_peer_times_out() {
        let (a, _b) = UnixStream::pair().unwrap();
        let config = LinkConfig::new(Session::new(SessionToken::from_bytes([8; 32])))
            .handshake_timeout(std::time::Duration::from_millis(50));
        assert!(matches!(
            AsyncLink::server(a, &config).await,
            Err(Error::Timeout { .. })
        ));
    }
}
