//! Links: framed, authenticated channels over Unix-domain sockets, with file descriptors
//! passed out of band.
//!
//! Establishing a link, in order, before any handle can be sent:
//! 1. the socket lives in a [`SocketDir`] only our uid can enter;
//! 2. each side reads the other's kernel credentials (`SO_PEERCRED`) and checks them
//!    against its [`PeerPolicy`] (same uid by default) before reading a byte;
//! 3. the handshake ([`baton_messages::protocol`]) checks versions, checks that the
//!    identity each side claims is the connected process, and has both sides prove they
//!    hold the session token.
//!
//! Every failure is a typed [`Error`] about that one connection, which is closed; a
//! [`Listener`] goes on accepting the next.
//!
//! [`Link`] is the blocking driver (helper processes, tools, tests, benchmarks);
//! [`AsyncLink`] drives the same wire format and handshake on tokio (the actor layer), and
//! can carry its frames through a shared-memory ring per direction
//! ([`LinkConfig::with_ring`], [`crate::ring`]; the blocking driver stays on the socket).

mod creds;
mod handshake;
mod nonblocking;
#[cfg(test)]
mod ring_tests;
mod ringed;
mod socket_dir;
mod wire;

pub(crate) use creds::KernelPeer;
pub use creds::{PeerCred, PeerPolicy};
pub use nonblocking::{AsyncLink, LinkCloser, LinkReader, LinkWriter};
pub use socket_dir::{SocketDir, SocketSweepReport, sweep_dead_dirs};
pub use wire::{FrameFds, Received};

pub(crate) use handshake::{ClientHandshake, Refusal, ServerHandshake};
pub(crate) use wire::{Receiver, send_all};

use crate::identity::HostPeer;
use crate::session::Session;
use crate::{Error, Result};
use baton_messages::codec::encode_frame;
use baton_messages::{Message, ProcessId};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How links are established.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// The session whose token both sides must hold.
    pub session: Session,
    /// Which peers to accept.
    pub policy: PeerPolicy,
    /// How long a peer may take to complete the handshake.
    pub handshake_timeout: Duration,
    /// Whether an [`AsyncLink`] asks its peer to send it frames through a shared-memory
    /// ring of this many data bytes ([`crate::ring`]; a power of two between
    /// [`MIN_CAPACITY`](crate::ring::MIN_CAPACITY) and
    /// [`MAX_CAPACITY`](crate::ring::MAX_CAPACITY)), `None` for the socket alone. See
    /// [`with_ring`](Self::with_ring).
    pub ring: Option<usize>,
}

/// The environment variable [`LinkConfig::new`] reads for its ring setting: `0` for no
/// ring (the socket alone); a capacity in bytes (`1048576`); unset, empty or `1` for
/// [`DEFAULT_CAPACITY`](crate::ring::DEFAULT_CAPACITY). Every [`AsyncLink`] made from such
/// a configuration offers a ring, a node's links included (see [`LinkConfig::with_ring`]
/// for what polls), while the process's budget of ring ends lasts
/// ([`max_ends`](crate::ring::max_ends)).
pub const RING_ENV: &str = "BATON_LINK_RING";

/// The ring setting a value of [`RING_ENV`] asks for; an unreadable value is no ring (and
/// a warning).
fn ring_setting(value: Option<&str>) -> Option<usize> {
    match value.map(str::trim) {
        Some("0") => None,
        None | Some("" | "1") => Some(crate::ring::DEFAULT_CAPACITY),
        Some(bytes) => match bytes.parse() {
            Ok(capacity) => Some(capacity),
            Err(_) => {
                tracing::warn!(
                    value = bytes,
                    "{RING_ENV} is neither a capacity in bytes nor 1: links use the socket alone"
                );
                None
            }
        },
    }
}

impl LinkConfig {
    /// Same-uid peers, a 5 s handshake deadline, and the ring setting of
    /// [`RING_ENV`] (`BATON_LINK_RING`; a ring of the default capacity when it is unset).
    pub fn new(session: Session) -> Self {
        Self {
            session,
            policy: PeerPolicy::same_user(),
            handshake_timeout: Duration::from_secs(5),
            ring: ring_setting(std::env::var(RING_ENV).ok().as_deref()),
        }
    }

    /// With a shared-memory ring of `capacity` data bytes for the frames the peer sends
    /// this side of an [`AsyncLink`] (issue 48; [`crate::ring`]).
    ///
    /// After the handshake this side creates the ring (a sealed, unnamed memfd and two
    /// eventfds) and offers it over the authenticated socket (`RingOffer`, its three
    /// descriptors beside it). The peer checks the descriptors; if they are a ring, it
    /// answers `RingReady` as its last frame on the socket alone and from then on writes
    /// its frames into the ring, a frame that carries descriptors or is larger than the
    /// ring's [`max_frame`](crate::ring::RingReader::max_frame) on the socket after a
    /// marker in the ring, so that order holds. A peer accepts an offer whatever its own
    /// setting, so one side asking is enough for the direction towards it; each direction
    /// has its own ring. A capacity the ring refuses, a peer that refuses the ring, or a
    /// process (either side) that maps as many ring ends as it may
    /// ([`max_ends`](crate::ring::max_ends)) leaves the link on the socket (logged); a peer
    /// that does not take the ring says so (`RingDeclined`), and this side drops it.
    ///
    /// The blocking [`Link`] neither offers nor accepts rings: it declines an offer itself
    /// (closing its descriptors; its caller never sees it), and the peer then keeps using
    /// the socket.
    ///
    /// A reader polls its ring only on a runtime built with
    /// [`before_park`](crate::ring::before_park) as its `on_thread_park` hook (see
    /// [`ring::park`](crate::ring::park)); without it every frame is a doorbell wakeup.
    pub fn with_ring(mut self, capacity: usize) -> Self {
        self.ring = Some(capacity);
        self
    }

    /// Without a ring (the socket alone), whatever [`RING_ENV`] says.
    pub fn without_ring(mut self) -> Self {
        self.ring = None;
        self
    }

    /// With another peer policy.
    pub fn policy(mut self, policy: PeerPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// With another handshake deadline.
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }
}

/// Who is at the other end of an established link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer process, as it proved in the handshake.
    pub process: ProcessId,
    /// How the link reaches it, and what the transport proved besides.
    pub via: Via,
}

/// The transport of a link, and what it proved about the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Via {
    /// A Unix socket on this host: the kernel's credentials of the peer (`SO_PEERCRED`).
    Unix(PeerCred),
    /// A host link over TCP ([`tcp`](crate::tcp)): the peer's host, static key and
    /// addresses, as its Noise handshake proved them.
    Tcp(HostPeer),
}

impl PeerInfo {
    /// The peer's kernel credentials, for a link over a Unix socket (`None` over TCP).
    pub fn cred(&self) -> Option<PeerCred> {
        match self.via {
            Via::Unix(cred) => Some(cred),
            Via::Tcp(_) => None,
        }
    }

    /// The peer's host, for a host link (`None` for a Unix socket: this host).
    pub fn host(&self) -> Option<&HostPeer> {
        match &self.via {
            Via::Tcp(host) => Some(host),
            Via::Unix(_) => None,
        }
    }
}

/// An established, authenticated, blocking link.
#[derive(Debug)]
pub struct Link {
    stream: UnixStream,
    rx: Receiver,
    tx: Vec<u8>,
    peer: PeerInfo,
}

fn with_deadline(e: Error, after: Duration) -> Error {
    match e {
        Error::Timeout { op, .. } => Error::Timeout { op, after },
        other => other,
    }
}

impl Link {
    /// Connects to the listener at `path` and completes the handshake as the client.
    ///
    /// # Errors
    /// [`Error::Io`] if nobody listens there; [`Error::PeerNotAllowed`] if the listener
    /// runs as a uid the policy refuses; a handshake error ([`Error::BadToken`],
    /// [`Error::Refused`], [`Error::Timeout`], …).
    pub fn connect(path: impl AsRef<Path>, config: &LinkConfig) -> Result<Link> {
        let stream = UnixStream::connect(path.as_ref())
            .map_err(Error::io("connecting to a Baton socket"))?;
        Self::client(stream, config)
    }

    /// Completes the handshake as the client over a connected stream (e.g. one end of a
    /// `socketpair` given to a child).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub fn client(stream: UnixStream, config: &LinkConfig) -> Result<Link> {
        let peer = KernelPeer::of(&stream)?;
        config.policy.check(&peer.cred)?;
        let mut link = Self::unauthenticated(stream, peer.cred, config.handshake_timeout)?;
        let result = (|| {
            let (state, hello) = ClientHandshake::start(&config.session)?;
            link.send(&hello, &[])?;
            let welcome = link.recv()?.message;
            let (auth, server) = state
                .on_welcome(&config.session, &peer, welcome)
                .map_err(|r| link.refuse(r))?;
            link.send(&auth, &[])?;
            Ok(server)
        })();
        let server = result.map_err(|e| with_deadline(e, config.handshake_timeout))?;
        link.peer.process = server;
        link.set_timeout(None)?;
        tracing::debug!(peer = %server, "link established (client)");
        Ok(link)
    }

    /// Completes the handshake as the server over an accepted stream.
    ///
    /// # Errors
    /// [`Error::PeerNotAllowed`] (the peer is told, then dropped), or a handshake error.
    pub fn server(stream: UnixStream, config: &LinkConfig) -> Result<Link> {
        let peer = KernelPeer::of(&stream)?;
        let mut link = Self::unauthenticated(stream, peer.cred, config.handshake_timeout)?;
        if let Err(e) = config.policy.check(&peer.cred) {
            let refusal = Refusal::new(e, baton_messages::protocol::RefuseReason::NotAllowed);
            return Err(link.refuse(refusal));
        }
        let result = (|| {
            let hello = link.recv()?.message;
            let (state, welcome) = ServerHandshake::on_hello(&config.session, &peer, hello)
                .map_err(|r| link.refuse(r))?;
            link.send(&welcome, &[])?;
            let auth = link.recv()?.message;
            state
                .on_auth(&config.session, auth)
                .map_err(|r| link.refuse(r))
        })();
        let client = result.map_err(|e| with_deadline(e, config.handshake_timeout))?;
        link.peer.process = client;
        link.set_timeout(None)?;
        tracing::debug!(peer = %client, "link established (server)");
        Ok(link)
    }

    fn unauthenticated(stream: UnixStream, cred: PeerCred, timeout: Duration) -> Result<Link> {
        let mut link = Link {
            stream,
            rx: Receiver::default(),
            tx: Vec::with_capacity(512),
            peer: PeerInfo {
                via: Via::Unix(cred),
                process: ProcessId {
                    boot: crate::process::boot_id(),
                    pid: cred.pid,
                    start_ticks: 0,
                },
            },
        };
        link.set_timeout(Some(timeout))?;
        Ok(link)
    }

    /// Sends the refusal (best effort) and returns its error.
    fn refuse(&mut self, refusal: Refusal) -> Error {
        if let Some(reply) = refusal.reply() {
            let _ = self.send(&reply, &[]);
        }
        refusal.error
    }

    /// Sets (or clears) the deadline of every later blocking send and receive.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.stream
            .set_read_timeout(timeout)
            .map_err(Error::io("setting SO_RCVTIMEO"))?;
        self.stream
            .set_write_timeout(timeout)
            .map_err(Error::io("setting SO_SNDTIMEO"))
    }

    /// Who is at the other end.
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }

    /// Sends one message, with `fds` passed beside it.
    ///
    /// # Errors
    /// [`Error::Closed`] if the peer is gone, an encoding error, [`Error::Timeout`].
    pub fn send(&mut self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.tx.clear();
        encode_frame(msg, fds.len(), &mut self.tx)?;
        send_all(self.stream.as_fd(), &self.tx, fds)
    }

    /// Receives the next message and the descriptors that came with it.
    ///
    /// # Errors
    /// [`Error::Closed`] at a clean end of stream; a [`Error::Message`] for malformed or
    /// cut-off frames; [`Error::MissingFds`]/[`Error::UnexpectedFds`]; [`Error::Timeout`].
    /// After any error but a timeout, drop the link.
    pub fn recv(&mut self) -> Result<Received> {
        loop {
            if let Some(received) = self.rx.next()? {
                if matches!(received.message, Message::RingOffer(_)) {
                    // Link-level, and this link reads only its socket: declined (the peer
                    // stays on the socket and lets its ring go); its descriptors close here.
                    tracing::debug!("a ring offered to a blocking link: the socket stays");
                    drop(received);
                    if let Err(e) = self.send(&Message::RingDeclined, &[]) {
                        tracing::debug!(error = %e, "declining a ring offer failed");
                    }
                    continue;
                }
                return Ok(received);
            }
            self.rx.check_fds()?;
            match self.rx.recv_some(self.stream.as_fd()) {
                Ok(0) => return Err(self.rx.at_eof()),
                Ok(_) => {}
                Err(e) => return Err(self.rx.recv_error(e)),
            }
        }
    }

    /// Receives with a deadline, then restores blocking receives.
    ///
    /// # Errors
    /// As [`recv`](Self::recv); [`Error::Timeout`] if nothing came in time.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Received> {
        self.stream
            .set_read_timeout(Some(timeout))
            .map_err(Error::io("setting SO_RCVTIMEO"))?;
        let r = self.recv().map_err(|e| with_deadline(e, timeout));
        self.stream
            .set_read_timeout(None)
            .map_err(Error::io("setting SO_RCVTIMEO"))?;
        r
    }

    /// The underlying socket.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

/// A listening socket that establishes a [`Link`] per accepted connection.
///
/// The socket file is removed when the listener drops.
#[derive(Debug)]
pub struct Listener {
    listener: UnixListener,
    path: PathBuf,
    config: LinkConfig,
}

impl Listener {
    /// Listens at `dir/name`. A stale socket file left by a dead listener is replaced; a
    /// live one is an error.
    ///
    /// # Errors
    /// [`Error::Io`] (`AddrInUse` if someone listens there already).
    pub fn bind(dir: &SocketDir, name: &str, config: LinkConfig) -> Result<Listener> {
        let path = dir.socket(name);
        if path.exists() {
            if UnixStream::connect(&path).is_ok() {
                return Err(Error::Io {
                    op: "binding a Baton socket",
                    source: std::io::ErrorKind::AddrInUse.into(),
                });
            }
            let _ = std::fs::remove_file(&path);
        }
        let listener = UnixListener::bind(&path).map_err(Error::io("binding a Baton socket"))?;
        Ok(Listener {
            listener,
            path,
            config,
        })
    }

    /// Where it listens.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The configuration links are established with.
    pub fn config(&self) -> &LinkConfig {
        &self.config
    }

    /// Accepts one connection and establishes a link with it (server side).
    ///
    /// # Errors
    /// An error about that one connection (not allowed, bad handshake, timeout, …); it
    /// is closed, and the listener keeps working.
    pub fn accept(&self) -> Result<Link> {
        let (stream, _) = self
            .listener
            .accept()
            .map_err(Error::io("accepting a connection"))?;
        let link = Link::server(stream, &self.config);
        if let Err(e) = &link {
            tracing::warn!(error = %e, "refused a connection");
        }
        link
    }

    /// The listening socket, for event loops.
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_messages::SessionToken;

    /// A listener owns its socket file: a second one at the same name is refused while it
    /// listens, the file goes when it drops, and a stale file (its listener gone without
    /// removing it, as a killed node leaves it) is replaced.
    #[test]
    fn a_listener_removes_its_socket_when_dropped_and_replaces_a_stale_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = SocketDir::create(tmp.path().join("node")).unwrap();
        let config = || LinkConfig::new(Session::new(SessionToken::from_bytes([3; 32])));
        let listener = Listener::bind(&dir, "n.sock", config()).unwrap();
        let path = listener.path().to_owned();
        assert!(path.exists());
        assert!(
            Listener::bind(&dir, "n.sock", config()).is_err(),
            "someone listens there"
        );
        drop(listener);
        assert!(!path.exists(), "the socket file went with its listener");
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists(), "a stale socket file");
        let again = Listener::bind(&dir, "n.sock", config()).unwrap();
        assert!(UnixStream::connect(again.path()).is_ok());
    }
}
