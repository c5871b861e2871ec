//! Host links: the control plane between nodes on different hosts, over TCP with Noise.
//! (The data plane, copies of buffers, is the TCP engine:
//! [`transfer::tcp_engine`](crate::transfer::tcp_engine).)
//!
//! Establishing a host link, in order, before any Baton message is read:
//! 1. the Noise handshake (`Noise_XXpsk0_25519_ChaChaPoly_BLAKE2s`, see `noise`): the
//!    pre-shared key is derived from the session token and mixed in from the first
//!    message, so a peer without the token fails at once ([`Error::BadToken`] on the
//!    listener's side, [`Error::Refused`] on the client's) having learnt nothing about
//!    the listener; each side's static key is checked against its [`TcpPolicy`] (pinned
//!    keys: [`Error::HostKeyNotPinned`]); each side announces, encrypted, its [`HostId`]
//!    and process;
//! 2. Baton's own handshake (`Hello`/`Welcome`/`Auth`, the messages of the Unix link)
//!    inside the channel: the process each side claims must be the one its Noise handshake
//!    announced ([`Error::HostClaimMismatch`]) — there is no `SO_PEERCRED` over TCP.
//!
//! Then the same frames and bounds as the Unix [`link`](crate::link): a frame is carried as
//! one or more Noise transport messages and reassembled under
//! [`MAX_FRAME_LEN`](baton_messages::MAX_FRAME_LEN). A message whose bytes were changed on
//! the way is [`Error::Tampered`] and ends the link. Frames cannot carry descriptors over
//! TCP ([`Error::DescriptorsOverTcp`] to send one; a received frame announcing any is
//! [`Error::MissingFds`]).
//!
//! [`HostLink`] is the blocking form; [`AsyncHostLink`] has the reader, writer and closer
//! halves of the Unix [`AsyncLink`](crate::AsyncLink). [`HostListener`] runs each
//! handshake on a thread of its own under the handshake deadline, with caps on
//! handshakes in progress, in total and per source, accepted fairly: silent, slow or
//! garbage-sending clients cost a slot each for at most the deadline, one source never
//! more than its own cap, so a flood from one source starves no other. Established links
//! are capped too, in total and per key. See `accept`. [`HostLink::connect`] bounds the
//! TCP connect by the handshake deadline as well.
//!
//! Sockets get `TCP_NODELAY`, keepalive probes and `TCP_USER_TIMEOUT` ([`Keepalive`]);
//! liveness is still the actors' heartbeat.

mod accept;
mod noise;
mod nonblocking;
#[cfg(test)]
pub(crate) mod proxy;

use crate::identity::hex;
pub use crate::identity::{HOST_ID_ENV, HostId, HostPeer, NodePublicKey, remote_process};
pub use nonblocking::{AsyncHostLink, HostLinkCloser, HostLinkReader, HostLinkWriter};

pub(crate) use accept::{Caps, Slot, serve};
use accept::{LinkCaps, LinkPermit};
pub(crate) use noise::{
    Established, Handshake, MAX_RECORD, Opener, Sealer, psk, record_at, refusal_record,
};

use crate::link::Received;
use crate::session::{Role, Session};
use crate::{Error, FrameFds, Result};
use baton_messages::codec::{FrameDecoder, encode_frame};
use baton_messages::protocol::{Auth, Hello, Nonce, RefuseReason, Refused, Welcome};
use baton_messages::{Message, PROTOCOL_VERSION, ProcessId};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// A node's static key pair (X25519): made at start, or loaded to be pinned by peers.
/// Its `Debug` shows the public half only.
#[derive(Clone)]
pub struct NodeKey {
    private: [u8; 32],
    public: NodePublicKey,
}

impl NodeKey {
    /// A fresh key pair.
    ///
    /// # Errors
    /// [`Error::Io`] if the random source fails.
    pub fn generate() -> Result<NodeKey> {
        let pair = snow::Builder::new(noise::params())
            .generate_keypair()
            .map_err(|e| Error::Io {
                op: "generating a Noise key pair",
                source: io::Error::other(e),
            })?;
        let mut key = NodeKey {
            private: [0; 32],
            public: NodePublicKey([0; 32]),
        };
        key.private.copy_from_slice(&pair.private);
        key.public.0.copy_from_slice(&pair.public);
        Ok(key)
    }

    /// The public half, to pin.
    pub fn public(&self) -> NodePublicKey {
        self.public
    }

    pub(crate) fn private(&self) -> &[u8] {
        &self.private
    }
}

impl fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeKey")
            .field("public", &self.public)
            .finish_non_exhaustive()
    }
}

/// Which TCP peers to accept, decided in the Noise handshake (the TCP sibling of
/// [`PeerPolicy`](crate::PeerPolicy)). Every peer must hold the session token; with a
/// pinned set, its static key must also be one of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TcpPolicy {
    pinned: Option<Vec<NodePublicKey>>,
}

impl TcpPolicy {
    /// Any holder of the session token.
    pub fn any() -> Self {
        Self::default()
    }

    /// Only these nodes (and only if they hold the token).
    pub fn pinned(keys: impl IntoIterator<Item = NodePublicKey>) -> Self {
        Self {
            pinned: Some(keys.into_iter().collect()),
        }
    }

    /// Checks a peer's static key.
    ///
    /// # Errors
    /// [`Error::HostKeyNotPinned`].
    pub fn check(&self, key: &[u8]) -> Result<()> {
        match &self.pinned {
            Some(keys) if !keys.iter().any(|k| k.0.as_slice() == key) => {
                Err(Error::HostKeyNotPinned { key: hex(key) })
            }
            _ => Ok(()),
        }
    }
}

/// Keepalive settings of a TCP socket: probes after `idle` of silence, every `interval`,
/// `count` of them; and `TCP_USER_TIMEOUT`, the longest sent data may stay unacknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Silence before the first probe.
    pub idle: Duration,
    /// Between probes.
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped.
    pub count: u32,
    /// `TCP_USER_TIMEOUT`.
    pub user_timeout: Duration,
}

impl Default for Keepalive {
    /// Probes after 5 s, every 2 s, 3 of them; 15 s user timeout.
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(5),
            interval: Duration::from_secs(2),
            count: 3,
            user_timeout: Duration::from_secs(15),
        }
    }
}

impl Keepalive {
    /// Sets `TCP_NODELAY`, `SO_KEEPALIVE` with these probes, and `TCP_USER_TIMEOUT`.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn apply(&self, sock: BorrowedFd<'_>) -> Result<()> {
        use rustix::net::sockopt;
        let io = |op| {
            move |e: rustix::io::Errno| Error::Io {
                op,
                source: e.into(),
            }
        };
        sockopt::set_tcp_nodelay(sock, true).map_err(io("setting TCP_NODELAY"))?;
        sockopt::set_socket_keepalive(sock, true).map_err(io("setting SO_KEEPALIVE"))?;
        sockopt::set_tcp_keepidle(sock, self.idle).map_err(io("setting TCP_KEEPIDLE"))?;
        sockopt::set_tcp_keepintvl(sock, self.interval).map_err(io("setting TCP_KEEPINTVL"))?;
        sockopt::set_tcp_keepcnt(sock, self.count).map_err(io("setting TCP_KEEPCNT"))?;
        let ms = u32::try_from(self.user_timeout.as_millis()).unwrap_or(u32::MAX);
        sockopt::set_tcp_user_timeout(sock, ms).map_err(io("setting TCP_USER_TIMEOUT"))
    }
}

/// How host links (and the TCP engine's data connections) are established.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// The session whose token both sides must hold.
    pub session: Session,
    /// This node's static key.
    pub key: NodeKey,
    /// Which peers to accept.
    pub policy: TcpPolicy,
    /// The host this node says it runs on.
    pub host: HostId,
    /// How long a peer may take to complete the handshake (Noise and Baton's).
    pub handshake_timeout: Duration,
    /// How many handshakes a listener runs at once; connections beyond are closed at once
    /// (unless a source holding more slots makes room: see `accept`'s docs).
    pub max_handshakes: usize,
    /// How many handshakes a listener runs at once for one source (an IPv4 address, an
    /// IPv6 /64); its connections beyond are closed at once.
    pub max_handshakes_per_source: usize,
    /// How many established host links a [`HostListener`] holds at once; beyond, a new
    /// link is refused ([`Error::TooManyHostLinks`]).
    pub max_links: usize,
    /// How many established host links a [`HostListener`] holds at once from one static
    /// key; beyond, a new link from that key is refused ([`Error::TooManyHostLinks`]).
    pub max_links_per_key: usize,
    /// The sockets' keepalive.
    pub keepalive: Keepalive,
    /// The port this node's TCP engine takes data connections on
    /// ([`TcpEngine::data_addr`](crate::transfer::TcpEngine::data_addr)), announced in the
    /// handshake; the peer reaches it at the address it reached the link on. `None`: no
    /// engine (the peer cannot send us buffers).
    pub data_port: Option<u16>,
}

impl TcpConfig {
    /// Any token holder, this host, a 5 s handshake deadline, 64 handshakes at once (16
    /// from one source), 256 established host links per listener (16 from one key).
    pub fn new(session: Session, key: NodeKey) -> Self {
        Self {
            session,
            key,
            policy: TcpPolicy::any(),
            host: HostId::current(),
            handshake_timeout: Duration::from_secs(5),
            max_handshakes: 64,
            max_handshakes_per_source: 16,
            max_links: 256,
            max_links_per_key: 16,
            keepalive: Keepalive::default(),
            data_port: None,
        }
    }

    /// With another peer policy.
    pub fn policy(mut self, policy: TcpPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Saying it runs on another host.
    pub fn host(mut self, host: HostId) -> Self {
        self.host = host;
        self
    }

    /// With another handshake deadline.
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Announcing its TCP engine's data port.
    pub fn data_port(mut self, port: u16) -> Self {
        self.data_port = Some(port);
        self
    }

    /// With another cap on handshakes in progress.
    pub fn max_handshakes(mut self, n: usize) -> Self {
        self.max_handshakes = n.max(1);
        self
    }

    /// With another cap on handshakes in progress from one source.
    pub fn max_handshakes_per_source(mut self, n: usize) -> Self {
        self.max_handshakes_per_source = n.max(1);
        self
    }

    /// With other caps on a listener's established host links: in all, and from one key.
    pub fn max_links(mut self, total: usize, per_key: usize) -> Self {
        self.max_links = total.max(1);
        self.max_links_per_key = per_key.max(1);
        self
    }

    /// The acceptor's caps on handshakes in progress.
    pub(crate) fn caps(&self) -> Caps {
        Caps {
            total: self.max_handshakes.max(1),
            per_source: self.max_handshakes_per_source.max(1),
        }
    }
}

/// The deadline of a handshake: every blocking read and write gets the time left.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    at: Instant,
    total: Duration,
    op: &'static str,
}

impl Deadline {
    pub(crate) fn after(total: Duration, op: &'static str) -> Self {
        Self {
            at: Instant::now() + total,
            total,
            op,
        }
    }

    fn arm(&self, stream: &TcpStream) -> Result<()> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timeout());
        }
        stream
            .set_read_timeout(Some(left))
            .and_then(|()| stream.set_write_timeout(Some(left)))
            .map_err(Error::io("setting a socket timeout"))
    }

    /// Connects to the first of `addr`'s addresses that answers, each tried with the time
    /// left: a blackholed address costs the deadline, not the kernel's minutes of SYN
    /// retries.
    fn connect(&self, addr: impl ToSocketAddrs) -> Result<TcpStream> {
        let op = "connecting to a host link";
        let addrs = addr.to_socket_addrs().map_err(Error::io(op))?;
        let mut last = Error::Io {
            op,
            source: io::Error::other("the address names no host"),
        };
        for a in addrs {
            let left = self.at.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.timeout());
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(stream) => return Ok(stream),
                Err(e) => last = self.map(e),
            }
        }
        Err(last)
    }

    fn timeout(&self) -> Error {
        Error::Timeout {
            op: self.op,
            after: self.total,
        }
    }

    fn map(&self, e: io::Error) -> Error {
        match io_error(self.op, e) {
            Error::Timeout { .. } => self.timeout(),
            other => other,
        }
    }

    pub(crate) fn write(&self, mut stream: &TcpStream, bytes: &[u8]) -> Result<()> {
        self.arm(stream)?;
        stream.write_all(bytes).map_err(|e| self.map(e))
    }

    fn read_exact(&self, mut stream: &TcpStream, buf: &mut [u8]) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            self.arm(stream)?;
            match stream.read(&mut buf[got..]) {
                Ok(0) => return Err(Error::Closed),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.map(e)),
            }
        }
        Ok(())
    }

    /// Reads one handshake record's body.
    pub(crate) fn read_record(&self, stream: &TcpStream) -> Result<Vec<u8>> {
        let mut prefix = [0u8; 3];
        self.read_exact(stream, &mut prefix[..2])?;
        if prefix[..2] == [0, 0] {
            self.read_exact(stream, &mut prefix[2..])?;
            record_at(&prefix)?;
        }
        let len = usize::from(u16::from_be_bytes([prefix[0], prefix[1]]));
        let mut body = vec![0u8; len];
        self.read_exact(stream, &mut body)?;
        Ok(body)
    }
}

/// Maps socket errors as the Unix link does: a reset or broken pipe is a closed link, a
/// timed-out blocking call a timeout.
pub(crate) fn io_error(op: &'static str, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::UnexpectedEof => Error::Closed,
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout {
            op,
            after: Duration::ZERO,
        },
        _ => Error::Io { op, source: e },
    }
}

/// Sends the refusal record (best effort) and returns the error. Then reads the peer's
/// bytes until it closes (or at most a second, within the deadline) so that closing does
/// not reset the connection and throw the refusal away before the peer reads it.
fn refuse(stream: &TcpStream, deadline: &Deadline, (e, reason): (Error, RefuseReason)) -> Error {
    if deadline.write(stream, &refusal_record(reason)).is_ok() {
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let linger = Deadline::after(
            deadline
                .at
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1)),
            "lingering after a refusal",
        );
        let mut sink = [0u8; 4096];
        while linger.arm(stream).is_ok() && matches!((&*stream).read(&mut sink), Ok(n) if n > 0) {}
    }
    e
}

/// The responder's verdict on the handshake, after its last message: accepted (a record
/// of length 0 with reason 0), or a refusal record.
const ACCEPTED: [u8; 3] = [0, 0, 0];

/// The Noise handshake as the initiator, on a blocking stream.
pub(crate) fn noise_client(
    stream: &TcpStream,
    config: &TcpConfig,
    deadline: &Deadline,
) -> Result<Established> {
    let (mut hs, first) = Handshake::initiator(config)?;
    deadline.write(stream, &first)?;
    let second = deadline.read_record(stream)?;
    let third = hs
        .on_second(&second)
        .map_err(|r| refuse(stream, deadline, r))?;
    deadline.write(stream, &third)?;
    let mut verdict = [0u8; 3];
    deadline.read_exact(stream, &mut verdict)?;
    if verdict != ACCEPTED {
        record_at(&verdict)?;
        return Err(Error::Refused {
            reason: RefuseReason::ProtocolViolation,
        });
    }
    hs.finish()
}

/// The Noise handshake as the responder, on a blocking stream.
pub(crate) fn noise_server(
    stream: &TcpStream,
    config: &TcpConfig,
    deadline: &Deadline,
) -> Result<Established> {
    noise_server_admitting(stream, config, deadline, |_| Ok(())).map(|(est, ())| est)
}

/// The Noise handshake as the responder, on a blocking stream; once the peer has proven
/// the token and its key, `admit` decides on that key before the handshake is accepted (a
/// refusal is sent with its reason).
fn noise_server_admitting<T>(
    stream: &TcpStream,
    config: &TcpConfig,
    deadline: &Deadline,
    admit: impl FnOnce(&[u8; 32]) -> Result<T, (Error, RefuseReason)>,
) -> Result<(Established, T)> {
    let mut hs = Handshake::responder(config)?;
    let first = deadline.read_record(stream)?;
    let second = hs
        .on_first(&first)
        .map_err(|r| refuse(stream, deadline, r))?;
    deadline.write(stream, &second)?;
    let third = deadline.read_record(stream)?;
    hs.on_third(&third)
        .map_err(|r| refuse(stream, deadline, r))?;
    let admitted = admit(&hs.remote_key()).map_err(|r| refuse(stream, deadline, r))?;
    deadline.write(stream, &ACCEPTED)?;
    Ok((hs.finish()?, admitted))
}

fn check_version(version: u8) -> Result<(), (Error, RefuseReason)> {
    if version == PROTOCOL_VERSION {
        return Ok(());
    }
    Err((
        baton_messages::Error::UnsupportedVersion {
            got: version,
            supported: PROTOCOL_VERSION,
        }
        .into(),
        RefuseReason::VersionMismatch {
            supported: PROTOCOL_VERSION,
        },
    ))
}

fn check_claim(claimed: ProcessId, announced: ProcessId) -> Result<(), (Error, RefuseReason)> {
    if claimed == announced {
        Ok(())
    } else {
        Err((
            Error::HostClaimMismatch { claimed, announced },
            RefuseReason::ProtocolViolation,
        ))
    }
}

fn unexpected(expected: &'static str, got: &Message) -> (Error, RefuseReason) {
    match got {
        Message::Refused(r) => (
            Error::Refused { reason: r.reason },
            RefuseReason::ProtocolViolation,
        ),
        other => (
            Error::UnexpectedMessage {
                expected,
                got: other.kind(),
            },
            RefuseReason::ProtocolViolation,
        ),
    }
}

/// An established, authenticated, blocking host link.
#[derive(Debug)]
pub struct HostLink {
    stream: TcpStream,
    sealer: Sealer,
    opener: Opener,
    decoder: FrameDecoder,
    tx: Vec<u8>,
    wire: Vec<u8>,
    peer: HostPeer,
    /// Its place among its listener's established links (a link a listener accepted).
    permit: Option<LinkPermit>,
}

impl HostLink {
    /// Connects to a [`HostListener`] at `addr` and completes both handshakes as the
    /// client, the connect and both handshakes within one handshake deadline
    /// ([`TcpConfig::handshake_timeout`]; each of `addr`'s addresses is tried with the time
    /// left).
    ///
    /// # Errors
    /// [`Error::Io`] if nobody listens there; [`Error::Timeout`] if the connect or the
    /// handshakes did not complete in time (an address that drops connects, a silent
    /// listener); [`Error::Refused`] if the listener refused us (`BadToken`: we hold
    /// another token; `NotAllowed`: our key is not pinned there; `TooManyLinks`: it holds
    /// its cap of links); [`Error::HostKeyNotPinned`]; [`Error::Tampered`]; …
    pub fn connect(addr: impl ToSocketAddrs, config: &TcpConfig) -> Result<HostLink> {
        let deadline = Deadline::after(config.handshake_timeout, "host link handshake");
        let stream = deadline.connect(addr)?;
        Self::client_by(stream, config, deadline)
    }

    /// Completes both handshakes as the client over a connected stream.
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub fn client(stream: TcpStream, config: &TcpConfig) -> Result<HostLink> {
        let deadline = Deadline::after(config.handshake_timeout, "host link handshake");
        Self::client_by(stream, config, deadline)
    }

    fn client_by(stream: TcpStream, config: &TcpConfig, deadline: Deadline) -> Result<HostLink> {
        config.keepalive.apply(stream.as_fd())?;
        let est = noise_client(&stream, config, &deadline)?;
        let mut link = Self::established(stream, est)?;
        let session = &config.session;
        let nonce = Nonce(crate::session::random_bytes()?);
        let me = session.process();
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            process: me,
            nonce,
        });
        let steps = (|| {
            link.send_by(&hello, &deadline)?;
            let welcome = link.recv_by(&deadline)?;
            let step = (|| {
                let Message::Welcome(w) = &welcome else {
                    return Err(unexpected("Welcome", &welcome));
                };
                check_version(w.version)?;
                check_claim(w.process, link.peer.claimed)?;
                if !session.check_proof(Role::Server, &nonce, &w.nonce, &w.process, &w.proof) {
                    return Err((Error::BadToken, RefuseReason::BadToken));
                }
                Ok(Message::Auth(Auth {
                    proof: session.proof(Role::Client, &nonce, &w.nonce, &me),
                }))
            })();
            match step {
                Ok(auth) => link.send_by(&auth, &deadline),
                Err(r) => Err(link.refuse(r, &deadline)),
            }
        })();
        steps?;
        link.set_timeout(None)?;
        tracing::debug!(peer = %link.peer.process, claimed = %link.peer.claimed, host = %link.peer.host, "host link established (client)");
        Ok(link)
    }

    /// Completes both handshakes as the server over an accepted stream.
    ///
    /// # Errors
    /// [`Error::BadToken`] (the peer holds another token, or its handshake was changed on
    /// the way), [`Error::HostKeyNotPinned`], [`Error::HostClaimMismatch`],
    /// [`Error::Timeout`], a frame error (garbage): the peer is told where it can be, then
    /// dropped.
    pub fn server(stream: TcpStream, config: &TcpConfig) -> Result<HostLink> {
        Self::server_capped(stream, config, None)
    }

    /// As [`server`](Self::server); with `caps`, the link is counted against them (and
    /// refused beyond them) once the peer has proven its key.
    fn server_capped(
        stream: TcpStream,
        config: &TcpConfig,
        caps: Option<&LinkCaps>,
    ) -> Result<HostLink> {
        config.keepalive.apply(stream.as_fd())?;
        let deadline = Deadline::after(config.handshake_timeout, "host link handshake");
        let (est, permit) = noise_server_admitting(&stream, config, &deadline, |key| {
            caps.map(|caps| caps.admit(*key))
                .transpose()
                .map_err(|e| (e, RefuseReason::TooManyLinks))
        })?;
        let mut link = Self::established(stream, est)?;
        link.permit = permit;
        let session = &config.session;
        let steps = (|| {
            let hello = link.recv_by(&deadline)?;
            let step = (|| {
                let Message::Hello(h) = &hello else {
                    return Err(unexpected("Hello", &hello));
                };
                check_version(h.version)?;
                check_claim(h.process, link.peer.claimed)?;
                Ok(h.nonce)
            })();
            let client_nonce = step.map_err(|r| link.refuse(r, &deadline))?;
            let server_nonce = Nonce(crate::session::random_bytes()?);
            let me = session.process();
            let welcome = Message::Welcome(Welcome {
                version: PROTOCOL_VERSION,
                process: me,
                nonce: server_nonce,
                proof: session.proof(Role::Server, &client_nonce, &server_nonce, &me),
            });
            link.send_by(&welcome, &deadline)?;
            let auth = link.recv_by(&deadline)?;
            let client = link.peer.claimed;
            let step = match &auth {
                Message::Auth(a)
                    if session.check_proof(
                        Role::Client,
                        &client_nonce,
                        &server_nonce,
                        &client,
                        &a.proof,
                    ) =>
                {
                    Ok(())
                }
                Message::Auth(_) => Err((Error::BadToken, RefuseReason::BadToken)),
                other => Err(unexpected("Auth", other)),
            };
            step.map_err(|r| link.refuse(r, &deadline))
        })();
        steps?;
        link.set_timeout(None)?;
        tracing::debug!(peer = %link.peer.process, claimed = %link.peer.claimed, host = %link.peer.host, "host link established (server)");
        Ok(link)
    }

    fn established(stream: TcpStream, est: Established) -> Result<HostLink> {
        let addr = stream
            .peer_addr()
            .map_err(Error::io("reading a peer address"))?;
        let process = est.process();
        Ok(HostLink {
            sealer: Sealer::new(Arc::clone(&est.transport)),
            opener: Opener::new(est.transport),
            decoder: FrameDecoder::new(),
            tx: Vec::with_capacity(512),
            wire: Vec::with_capacity(1024),
            peer: HostPeer {
                process,
                claimed: est.claim.process,
                host: est.claim.host,
                key: NodePublicKey(est.remote_key),
                addr,
                data_addr: (est.claim.data_port != 0)
                    .then(|| SocketAddr::new(addr.ip(), est.claim.data_port)),
            },
            stream,
            permit: None,
        })
    }

    fn refuse(&mut self, (e, reason): (Error, RefuseReason), deadline: &Deadline) -> Error {
        let _ = self.send_by(&Message::Refused(Refused { reason }), deadline);
        e
    }

    fn send_by(&mut self, msg: &Message, deadline: &Deadline) -> Result<()> {
        deadline.arm(&self.stream)?;
        self.send(msg, &[]).map_err(|e| match e {
            Error::Timeout { .. } => deadline.timeout(),
            other => other,
        })
    }

    fn recv_by(&mut self, deadline: &Deadline) -> Result<Message> {
        loop {
            if let Some(msg) = self.opener.next_message(&mut self.decoder)? {
                return Ok(msg);
            }
            deadline.arm(&self.stream)?;
            if self.fill().map_err(|e| match e {
                Error::Timeout { .. } => deadline.timeout(),
                other => other,
            })? == 0
            {
                return Err(self.opener.at_eof(&self.decoder));
            }
        }
    }

    /// One read of ciphertext; 0 at end of stream.
    fn fill(&mut self) -> Result<usize> {
        loop {
            match self.stream.read(self.opener.spare()) {
                Ok(n) => {
                    self.opener.commit(n);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return match io_error("receiving a frame", e) {
                        Error::Closed => Ok(0),
                        other => Err(other),
                    };
                }
            }
        }
    }

    /// Who is at the other end.
    pub fn peer(&self) -> &HostPeer {
        &self.peer
    }

    /// Sets (or clears) the deadline of every later blocking send and receive.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.stream
            .set_read_timeout(timeout)
            .and_then(|()| self.stream.set_write_timeout(timeout))
            .map_err(Error::io("setting a socket timeout"))
    }

    /// Sends one message. `fds` must be empty: descriptors cannot cross TCP (the signature
    /// is the Unix [`Link::send`](crate::Link::send)'s, so callers keep one path).
    ///
    /// # Errors
    /// [`Error::DescriptorsOverTcp`]; [`Error::Closed`] if the peer is gone; an encoding
    /// error; [`Error::Timeout`].
    pub fn send(&mut self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<()> {
        if !fds.is_empty() {
            return Err(Error::DescriptorsOverTcp { nfds: fds.len() });
        }
        self.tx.clear();
        encode_frame(msg, 0, &mut self.tx)?;
        let frames = std::mem::take(&mut self.tx);
        let r = self.send_encoded(&frames);
        self.tx = frames;
        r
    }

    /// Sends already encoded frames (see [`encode_frame`]).
    ///
    /// # Errors
    /// [`Error::Closed`] if the peer is gone; [`Error::Timeout`].
    pub fn send_encoded(&mut self, frames: &[u8]) -> Result<()> {
        self.wire.clear();
        self.sealer.seal(frames, &mut self.wire)?;
        (&self.stream)
            .write_all(&self.wire)
            .map_err(|e| io_error("sending a frame", e))
    }

    /// Receives the next message (its [`FrameFds`] are always empty).
    ///
    /// # Errors
    /// [`Error::Closed`] at a clean end of stream; [`Error::Tampered`]; a
    /// [`Error::Message`] for malformed or cut-off frames; [`Error::MissingFds`] for a
    /// frame that announces descriptors; [`Error::Timeout`]. After any error but a
    /// timeout, drop the link.
    pub fn recv(&mut self) -> Result<Received> {
        loop {
            if let Some(message) = self.opener.next_message(&mut self.decoder)? {
                return Ok(Received {
                    message,
                    fds: FrameFds::none(),
                });
            }
            if self.fill()? == 0 {
                return Err(self.opener.at_eof(&self.decoder));
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
        let r = self.recv().map_err(|e| match e {
            Error::Timeout { op, .. } => Error::Timeout { op, after: timeout },
            other => other,
        });
        self.stream
            .set_read_timeout(None)
            .map_err(Error::io("setting SO_RCVTIMEO"))?;
        r
    }

    /// The underlying socket.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }

    #[allow(clippy::type_complexity)]
    pub(crate) fn into_parts(
        self,
    ) -> (
        TcpStream,
        Sealer,
        Opener,
        FrameDecoder,
        HostPeer,
        Option<LinkPermit>,
    ) {
        (
            self.stream,
            self.sealer,
            self.opener,
            self.decoder,
            self.peer,
            self.permit,
        )
    }
}

/// A TCP listener that establishes a [`HostLink`] per accepted connection, each handshake
/// on a thread of its own under the handshake deadline, at most
/// [`TcpConfig::max_handshakes`] at once and [`TcpConfig::max_handshakes_per_source`]
/// from one source (connections beyond are closed at once; a full listener makes room
/// by cutting the oldest handshake of the source that holds the most), and at most
/// [`TcpConfig::max_links`] established links still up ([`TcpConfig::max_links_per_key`]
/// from one key; beyond, refused with [`Error::TooManyHostLinks`]). See the `accept`
/// module's docs. Dropping it stops accepting; handshakes in progress end by their
/// deadline.
#[derive(Debug)]
pub struct HostListener {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    outcomes: Mutex<mpsc::Receiver<Result<HostLink>>>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

/// How many outcomes wait for `accept` before more are dropped (logged).
const OUTCOMES: usize = 1024;

impl HostListener {
    /// Listens at `addr` (port 0: any free port; see [`local_addr`](Self::local_addr)).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn bind(addr: impl ToSocketAddrs, config: TcpConfig) -> Result<HostListener> {
        let listener =
            TcpListener::bind(addr).map_err(Error::io("binding a host link listener"))?;
        let local = listener
            .local_addr()
            .map_err(Error::io("reading a listener address"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::sync_channel(OUTCOMES);
        let acceptor = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("baton-tcp-accept".into())
                .spawn(move || accept_loop(listener, config, stop, tx))
                .map_err(Error::io("spawning the host link acceptor"))?
        };
        Ok(HostListener {
            addr: local,
            stop,
            outcomes: Mutex::new(rx),
            acceptor: Some(acceptor),
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next connection's outcome: an established link, or the error about that one
    /// connection (refused, bad handshake, timeout, …; it is closed, and the listener keeps
    /// working).
    ///
    /// # Errors
    /// That connection's error; [`Error::Closed`] if the acceptor stopped.
    pub fn accept(&self) -> Result<HostLink> {
        let rx = self.outcomes.lock().unwrap_or_else(|p| p.into_inner());
        rx.recv().unwrap_or(Err(Error::Closed))
    }

    /// As [`accept`](Self::accept), waiting at most `timeout`.
    ///
    /// # Errors
    /// As [`accept`](Self::accept); [`Error::Timeout`] if none came in time.
    pub fn accept_timeout(&self, timeout: Duration) -> Result<HostLink> {
        let rx = self.outcomes.lock().unwrap_or_else(|p| p.into_inner());
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(Error::Timeout {
                op: "accepting a host link",
                after: timeout,
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Error::Closed),
        }
    }
}

impl Drop for HostListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    config: TcpConfig,
    stop: Arc<AtomicBool>,
    tx: mpsc::SyncSender<Result<HostLink>>,
) {
    let caps = config.caps();
    let links = LinkCaps::new(config.max_links, config.max_links_per_key);
    serve(
        listener,
        caps,
        stop,
        "baton-tcp-handshake",
        move |stream, slot| {
            let outcome = HostLink::server_capped(stream, &config, Some(&links));
            drop(slot);
            if let Err(e) = &outcome {
                tracing::warn!(error = %e, "refused a host link");
            }
            if tx.try_send(outcome).is_err() {
                tracing::warn!("nobody accepts host links: one dropped");
            }
        },
    );
}

#[cfg(test)]
mod tests;
