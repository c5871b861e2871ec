//! How a node gets its links: [`Node::connect`](crate::Node::connect) to a node that
//! listens, [`Node::listen`](crate::Node::listen) for nodes that connect ([`Listening`],
//! [`Listening::accept`]), [`Node::local`](crate::Node::local) for a link to itself;
//! across hosts, [`Node::connect_tcp`](crate::Node::connect_tcp) and
//! [`Node::listen_tcp`](crate::Node::listen_tcp) ([`TcpListening`]) over TCP host links.
//! Each connection that passes the handshake gets its [`PeerLink`] actor here
//! ([`adopt`]) and joins the node's links.
//!
//! It sits above `link`, whose actors it starts; the node's state below it
//! ([`NodeCore`]) keeps the links once they are up and never starts one. The methods
//! themselves are `Node`'s, in `node/connect.rs` above: this module has what they are made
//! of — the listeners' guards, [`adopt`], the checks and the admin token file.

use crate::error::ActorError;
use crate::link::PeerLink;
use crate::node_core::{NodeCore, Peer};
use crate::paths::{Downgrade, LeasePath, PathDowngraded};
use crate::transport::Transport;
use baton_ipc::tcp::HostId;
use baton_ipc::{Listener, Session};
use baton_messages::{BackendKind, ProcessId};
use std::fmt;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Starts the actor of an established link, which joins `node`'s links.
pub(crate) fn adopt(node: &NodeCore, link: impl Into<Transport>) -> Peer {
    let link = link.into();
    let info = link.peer();
    let (link, calls) = PeerLink::start(node.clone(), link);
    let peer = Peer {
        link,
        calls,
        info,
        link_deadline: node.heartbeat().deadline,
    };
    node.link_up(&peer);
    peer
}

/// A host link to a peer that says it runs on `node`'s host: its buffers would be copied
/// where a Unix link would map them — a downgrade ([`Downgrade::CopyOnSameHost`]), taken
/// only if the node's policy allows it.
pub(crate) fn same_host_copies(
    node: &NodeCore,
    host: HostId,
    peer: ProcessId,
) -> Result<(), ActorError> {
    if host != node.hosts().host {
        return Ok(());
    }
    let backend = node.backend();
    let taken = match backend.kind() {
        BackendKind::Host => LeasePath::TcpCopy,
        _ => LeasePath::NcclCopy,
    };
    node.downgrade(PathDowngraded {
        kind: Downgrade::CopyOnSameHost,
        wanted: LeasePath::exported_by(&**backend),
        taken,
        peer: Some(peer),
    })
}

/// The first address `addr` names.
pub(crate) fn resolve(addr: impl ToSocketAddrs) -> Result<SocketAddr, ActorError> {
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
pub(crate) fn unspecified(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    }
}

/// A listening TCP socket for host links ([`Node::listen_tcp`](crate::Node::listen_tcp));
/// dropping it stops accepting. Links already up are unaffected.
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
    /// The guard of a listener at `addr` whose acceptor `thread` runs until `stop`, and
    /// whose `task` hands the peers it linked to `incoming`.
    pub(crate) fn new(
        addr: SocketAddr,
        stop: Arc<AtomicBool>,
        thread: std::thread::JoinHandle<()>,
        task: tokio::task::JoinHandle<()>,
        incoming: tokio::sync::mpsc::Receiver<Peer>,
    ) -> Self {
        Self {
            addr,
            stop,
            thread: Some(thread),
            task,
            incoming: Arrivals(incoming),
        }
    }

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
/// [`PeerEvent::Up`]: crate::PeerEvent::Up
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
    /// The guard of `listener` and its admin `token_file`, whose accept loop `task` hands
    /// the peers it linked to `incoming`.
    pub(crate) fn new(
        listener: Listener,
        token_file: PathBuf,
        task: tokio::task::JoinHandle<()>,
        incoming: tokio::sync::mpsc::Receiver<Peer>,
    ) -> Self {
        Self {
            path: listener.path().to_owned(),
            token_file,
            _listener: listener,
            task,
            incoming: Arrivals(incoming),
        }
    }

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
    ///
    /// [`PeerEvent::Refused`]: crate::PeerEvent::Refused
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
pub(crate) fn write_token_file(socket: &Path, session: &Session) -> Result<PathBuf, ActorError> {
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
