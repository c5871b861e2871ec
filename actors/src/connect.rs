//! How a node gets its links: [`Node::connect`] to a node that listens, [`Node::listen`]
//! for nodes that connect ([`Listening`], [`Listening::accept`]), [`Node::local`] for a
//! link to itself; across hosts, [`Node::connect_tcp`] and [`Node::listen_tcp`]
//! ([`TcpListening`]) over TCP host links. Each connection that passes the handshake gets its [`PeerLink`] actor
//! here and joins the node's links.
//!
//! It sits above `link`, whose actors it starts; the node below it keeps the links once
//! they are up and never starts one.

use crate::error::ActorError;
use crate::link::PeerLink;
use crate::node::{Node, Peer, PeerEvent};
use crate::paths::{Downgrade, LeasePath, PathDowngraded};
use crate::transport::Transport;
use baton_ipc::tcp::{AsyncHostLink, HostId, HostListener};
use baton_ipc::{AsyncLink, Listener, Session, SocketDir};
use baton_messages::{BackendKind, ProcessId};
use std::fmt;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

impl Node {
    /// Starts the actor of an established link, which joins the node's links.
    pub(crate) fn adopt(&self, link: impl Into<Transport>) -> Peer {
        let link = link.into();
        let info = link.peer();
        let (link, calls) = PeerLink::start(self.clone(), link);
        let peer = Peer {
            link,
            calls,
            info,
            link_deadline: self.heartbeat().deadline,
        };
        self.link_up(&peer);
        peer
    }

    /// A link from this node to itself, for sending messages to actors of this process
    /// exactly as to those of another: `node.local().await?.remote::<M>(name)`. Location
    /// transparency — a handler is unit-tested in one process with the very messages
    /// another process would send it.
    ///
    /// It is a real link over a socket pair (both ends handled by this node's link actors),
    /// so everything a remote send does happens: the message is encoded, each `Shared<T>`
    /// field is a lease recorded in the ledger (held by this process: `lease_table` lists
    /// it, [`Buffer::returned`](crate::Buffer::returned) waits for it), the receiver's
    /// `open()` maps the *same* memory through the import cache (host memory: the same
    /// pages, mapped a second time; no copy), and dropping the lease sends `Release`. It is made on the first
    /// call and kept; it appears twice in [`peers`](Self::peers) (one link per end).
    /// Must be called inside an actix system.
    ///
    /// Limits: CUDA legacy IPC handles cannot be opened by the process that made them (a
    /// driver rule), so a local send of such memory fails (the offer is refused); host
    /// memory and CUDA VMM work.
    ///
    /// # Errors
    /// The socket pair cannot be made; a handshake error.
    pub async fn local(&self) -> Result<Peer, ActorError> {
        if let Some(peer) = self.loopback().as_ref() {
            if peer.is_connected() {
                return Ok(peer.clone());
            }
        }
        let (ours, theirs) = tokio::net::UnixStream::pair().map_err(|e| baton_ipc::Error::Io {
            op: "making the loopback socket pair",
            source: e,
        })?;
        let config = &self.config().link;
        let (client, server) = futures_util::future::join(
            AsyncLink::client(ours, config),
            AsyncLink::server(theirs, config),
        )
        .await;
        let (client, server) = (client?, server?);
        let peer = self.adopt(client);
        self.adopt(server);
        let mut local = self.loopback();
        match local.as_ref() {
            // Another task made one meanwhile: use it, and close ours (both ends go).
            Some(made) if made.is_connected() => {
                peer.close();
                Ok(made.clone())
            }
            _ => {
                *local = Some(peer.clone());
                Ok(peer)
            }
        }
    }

    /// Connects to a node listening at `path`. Must be called inside an actix system.
    ///
    /// # Errors
    /// A connection or handshake error.
    pub async fn connect(&self, path: impl AsRef<Path>) -> Result<Peer, ActorError> {
        let link = AsyncLink::connect(path, &self.config().link).await?;
        Ok(self.adopt(link))
    }

    /// Accepts links at `dir/name` until the returned guard drops. Refused connections are
    /// reported to subscribers as [`PeerEvent::Refused`]. Must be called inside an actix
    /// system.
    ///
    /// Beside the socket it writes the admin credential, `dir/name.token` (the session
    /// token in hex, mode 0600, in the directory only this uid can enter; see
    /// [`Listening::token_file`]): with it, a tool run by the same user — the `baton`
    /// command — links to the node and asks for its status knowing only the socket's path.
    /// It is removed when the guard drops.
    ///
    /// # Errors
    /// The socket cannot be bound, or the token file written.
    pub fn listen(&self, dir: &SocketDir, name: &str) -> Result<Listening, ActorError> {
        let listener = Listener::bind(dir, name, self.config().link.clone())?;
        let token_file = write_token_file(listener.path(), self.session())?;
        let std = listener
            .listener()
            .try_clone()
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| baton_ipc::Error::Io {
                op: "preparing the listener",
                source: e,
            })?;
        let tokio_listener =
            tokio::net::UnixListener::from_std(std).map_err(|e| baton_ipc::Error::Io {
                op: "registering the listener",
                source: e,
            })?;
        let node = self.clone();
        let (arrived, incoming) = tokio::sync::mpsc::channel(ACCEPT_BACKLOG);
        let task = actix::spawn(async move {
            loop {
                let stream = match tokio_listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let node = node.clone();
                let arrived = arrived.clone();
                actix::spawn(async move {
                    match AsyncLink::server(stream, &node.config().link).await {
                        Ok(link) => {
                            let peer = node.adopt(link);
                            match arrived.try_send(peer) {
                                Ok(()) => {}
                                Err(tokio::sync::mpsc::error::TrySendError::Full(peer)) => {
                                    tracing::debug!(peer = %peer.process(), "accept backlog full: the peer is linked, but not handed to `accept`");
                                }
                                // The `Listening` guard is gone: nobody accepts any more.
                                Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => {}
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "refused a connection");
                            node.notify(PeerEvent::Refused(Arc::new(e.into())));
                        }
                    }
                });
            }
        });
        Ok(Listening {
            path: listener.path().to_owned(),
            token_file,
            _listener: listener,
            task,
            incoming: Arrivals(incoming),
        })
    }
}

impl Node {
    /// Connects to a node on another host listening at `addr`
    /// ([`listen_tcp`](Self::listen_tcp)): a host link over TCP, authenticated by the
    /// session's token (the Noise pre-shared key) and the node keys its
    /// [`HostSettings`](crate::HostSettings) accept, before any message. The peer is an
    /// ordinary [`Peer`]: typed messages, supervision and status work as over a Unix link;
    /// a buffer sent over it arrives as a copy in memory the receiver's node owns (see
    /// `docs/CROSS_HOST.md`). Must be called inside an actix system.
    ///
    /// # Errors
    /// A connection or handshake error: [`baton_ipc::Error::Refused`] (wrong token, our key
    /// not accepted there), [`baton_ipc::Error::HostKeyNotPinned`],
    /// [`baton_ipc::Error::Timeout`], …
    pub async fn connect_tcp(&self, addr: impl ToSocketAddrs) -> Result<Peer, ActorError> {
        let addr = resolve(addr)?;
        let plane = self.host_plane(unspecified(addr.ip()))?;
        let link = AsyncHostLink::connect(addr, &plane.tcp).await?;
        // A refused downgrade drops the link (its peer sees it close) before it is one.
        self.same_host_copies(link.peer().host, link.peer().process)?;
        Ok(self.adopt(link))
    }

    /// A host link to a peer that says it runs on this node's host: its buffers would be
    /// copied where a Unix link would map them — a downgrade ([`Downgrade::CopyOnSameHost`]),
    /// taken only if this node's policy allows it.
    fn same_host_copies(&self, host: HostId, peer: ProcessId) -> Result<(), ActorError> {
        if host != self.hosts().host {
            return Ok(());
        }
        let backend = self.backend();
        let taken = match backend.kind() {
            BackendKind::Host => LeasePath::TcpCopy,
            _ => LeasePath::NcclCopy,
        };
        self.downgrade(PathDowngraded {
            kind: Downgrade::CopyOnSameHost,
            wanted: LeasePath::exported_by(&**backend),
            taken,
            peer: Some(peer),
        })
    }

    /// Accepts host links from nodes on other hosts at `addr` (port 0: any free port; see
    /// [`TcpListening::local_addr`]) until the returned guard drops. Each handshake runs
    /// under the handshake deadline on a thread of its own, at most 64 at once and 16 from
    /// one source address, accepted fairly: silent or garbage-sending connections cost a
    /// slot for at most the deadline, and a flood from one source starves no other. At most
    /// 256 links are up at once, 16 per static key (the `TcpConfig` defaults; see
    /// `docs/CROSS_HOST.md`). Refused connections are reported to subscribers as
    /// [`PeerEvent::Refused`].
    /// The node's TCP engine takes data connections at the same IP address. Must be
    /// called inside an actix system.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn listen_tcp(&self, addr: impl ToSocketAddrs) -> Result<TcpListening, ActorError> {
        let addr = resolve(addr)?;
        let plane = self.host_plane(addr.ip())?;
        let listener = HostListener::bind(addr, plane.tcp.clone())?;
        let local = listener.local_addr();
        let stop = Arc::new(AtomicBool::new(false));
        let (arrived, mut outcomes) = tokio::sync::mpsc::channel(ACCEPT_BACKLOG);
        // The listener's `accept` blocks: a thread hands its outcomes to the node's
        // arbiter, and ends within a poll once the guard drops.
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("baton-tcp-links".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        match listener.accept_timeout(Duration::from_millis(200)) {
                            Err(baton_ipc::Error::Timeout { .. }) => {}
                            // `Closed` is also one connection's outcome: a client that
                            // hung up mid-handshake (a scanner, a rogue). The listener
                            // goes on; only `stop` ends it. A stopped acceptor would
                            // answer `Closed` at once every time: a short pause keeps
                            // that from spinning until the guard drops.
                            Err(baton_ipc::Error::Closed) => {
                                if arrived
                                    .blocking_send(Err(baton_ipc::Error::Closed))
                                    .is_err()
                                {
                                    break;
                                }
                                std::thread::sleep(Duration::from_millis(1));
                            }
                            outcome => {
                                if arrived.blocking_send(outcome).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                })
                .map_err(|e| baton_ipc::Error::Io {
                    op: "spawning the host link acceptor",
                    source: e,
                })?
        };
        let node = self.clone();
        let (linked, incoming) = tokio::sync::mpsc::channel(ACCEPT_BACKLOG);
        let task = actix::spawn(async move {
            while let Some(outcome) = outcomes.recv().await {
                let outcome = outcome.and_then(AsyncHostLink::from_blocking);
                let outcome = outcome.map_err(ActorError::from).and_then(|link| {
                    let peer = link.peer();
                    node.same_host_copies(peer.host, peer.process)
                        .map(|()| link)
                });
                match outcome {
                    Ok(link) => {
                        let peer = node.adopt(link);
                        if linked.try_send(peer).is_err() {
                            tracing::debug!(
                                "accept backlog full: the peer is linked, but not handed to `accept`"
                            );
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "refused a host link");
                        node.notify(PeerEvent::Refused(Arc::new(e)));
                    }
                }
            }
        });
        Ok(TcpListening {
            addr: local,
            stop,
            thread: Some(thread),
            task,
            incoming: Arrivals(incoming),
        })
    }
}

/// The first address `addr` names.
fn resolve(addr: impl ToSocketAddrs) -> Result<SocketAddr, ActorError> {
    let io = |source| baton_ipc::Error::Io {
        op: "resolving a host link address",
        source,
    };
    addr.to_socket_addrs()
        .map_err(io)?
        .next()
        .ok_or_else(|| io(std::io::Error::other("the address names no host")).into())
}

/// The unspecified address of `ip`'s family: a connecting node's TCP engine takes data
/// connections on every interface (its peer reaches it at the address the link came from).
fn unspecified(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    }
}

/// A listening TCP socket for host links ([`Node::listen_tcp`]); dropping it stops
/// accepting. Links already up are unaffected.
pub struct TcpListening {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    task: tokio::task::JoinHandle<()>,
    incoming: Arrivals,
}

impl fmt::Debug for TcpListening {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpListening")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpListening {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for the next peer that linked here (as [`Listening::accept`]).
    ///
    /// # Errors
    /// [`ActorError::NotListening`] if the accept loop has ended.
    pub async fn accept(&mut self) -> Result<Peer, ActorError> {
        self.incoming.accept().await
    }

    /// [`accept`](Self::accept) with a deadline.
    ///
    /// # Errors
    /// As `accept`; [`ActorError::Timeout`] if no peer linked within `after`.
    pub async fn accept_timeout(&mut self, after: Duration) -> Result<Peer, ActorError> {
        self.incoming.accept_timeout(after).await
    }
}

impl Drop for TcpListening {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.abort();
        // The thread ends within its poll (200 ms); not joined here, which may run on
        // the node's arbiter.
        drop(self.thread.take());
    }
}

/// The peers a listener linked, for its `accept`.
struct Arrivals(tokio::sync::mpsc::Receiver<Peer>);

impl Arrivals {
    async fn accept(&mut self) -> Result<Peer, ActorError> {
        self.0.recv().await.ok_or(ActorError::NotListening)
    }

    async fn accept_timeout(&mut self, after: Duration) -> Result<Peer, ActorError> {
        tokio::time::timeout(after, self.accept())
            .await
            .map_err(|_| ActorError::Timeout {
                op: "accept",
                after,
            })?
    }
}

/// How many linked peers [`Listening`] keeps for [`Listening::accept`] before it hands
/// newer ones to subscribers only.
pub const ACCEPT_BACKLOG: usize = 256;

/// A listening socket; dropping it stops accepting and removes the socket file. Links
/// already up are unaffected.
///
/// Every connection that passes the handshake becomes a link at once (its peer can call
/// registered actors right away, and subscribers get [`PeerEvent::Up`]); [`accept`]
/// hands the linked peers out in the order they arrived. Peers nobody accepts stay linked:
/// `accept` is for code that wants to wait for a peer, not a gate. Up to
/// [`ACCEPT_BACKLOG`] peers wait to be accepted; past that, newer ones are only reported
/// to subscribers.
///
/// [`accept`]: Listening::accept
pub struct Listening {
    path: PathBuf,
    token_file: PathBuf,
    _listener: Listener,
    task: tokio::task::JoinHandle<()>,
    incoming: Arrivals,
}

impl fmt::Debug for Listening {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listening")
            .field("path", &self.path)
            .finish()
    }
}

impl Listening {
    /// Where it listens.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The admin credential beside the socket (`<socket>.token`): the session token in
    /// hex, readable only by this uid. Removed when this guard drops.
    pub fn token_file(&self) -> &Path {
        &self.token_file
    }

    /// Waits for the next peer that linked here (handshake passed) and returns it; a peer
    /// that linked before the call is returned at once. Connections refused in the
    /// handshake are not returned (subscribers see [`PeerEvent::Refused`]); the wait goes
    /// on. The returned peer may already be down again: check
    /// [`Peer::is_connected`] or await [`Peer::closed`].
    ///
    /// # Errors
    /// [`ActorError::NotListening`] if the accept loop has ended (its actix system is
    /// stopping).
    pub async fn accept(&mut self) -> Result<Peer, ActorError> {
        self.incoming.accept().await
    }

    /// [`accept`](Self::accept) with a deadline.
    ///
    /// # Errors
    /// As `accept`; [`ActorError::Timeout`] if no peer linked within `after`.
    pub async fn accept_timeout(&mut self, after: Duration) -> Result<Peer, ActorError> {
        self.incoming.accept_timeout(after).await
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.token_file);
    }
}

/// The path of the admin credential of the socket at `socket`: `<socket>.token`.
pub fn token_file_of(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(".token");
    PathBuf::from(name)
}

/// Writes `<socket>.token`: the session token in hex, created with mode 0600 (a stale
/// file of a dead listener is replaced).
fn write_token_file(socket: &Path, session: &Session) -> Result<PathBuf, ActorError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = token_file_of(socket);
    let io = |op| move |source| baton_ipc::Error::Io { op, source };
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("removing a stale token file")(e).into()),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io("creating the token file"))?;
    file.write_all(session.token().to_hex().as_bytes())
        .and_then(|()| file.write_all(b"\n"))
        .map_err(io("writing the token file"))?;
    Ok(path)
}
