//! How a [`Node`] gets its links (see [`connect`](crate::connect) for what they are made
//! of): over Unix sockets on this host, to itself, and over TCP host links across hosts.

use super::Node;
use crate::connect::{
    ACCEPT_BACKLOG, Listening, TcpListening, adopt, resolve, same_host_copies, unspecified,
    write_token_file,
};
use crate::error::ActorError;
use crate::node_core::{Peer, PeerEvent};
use baton_ipc::tcp::{AsyncHostLink, HostListener};
use baton_ipc::{AsyncLink, Listener, SocketDir};
use std::net::ToSocketAddrs;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

impl Node {
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
        if let Some(peer) = self.core.loopback().as_ref() {
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
        let peer = adopt(&self.core, client);
        adopt(&self.core, server);
        let mut local = self.core.loopback();
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
        Ok(adopt(&self.core, link))
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
        let node = self.core.clone();
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
                            let peer = adopt(&node, link);
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
        Ok(Listening::new(listener, token_file, task, incoming))
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
        let plane = self.core.host_plane(unspecified(addr.ip()))?;
        let link = AsyncHostLink::connect(addr, &plane.tcp).await?;
        // A refused downgrade drops the link (its peer sees it close) before it is one.
        same_host_copies(&self.core, link.peer().host, link.peer().process)?;
        Ok(adopt(&self.core, link))
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
        let plane = self.core.host_plane(addr.ip())?;
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
        let node = self.core.clone();
        let (linked, incoming) = tokio::sync::mpsc::channel(ACCEPT_BACKLOG);
        let task = actix::spawn(async move {
            while let Some(outcome) = outcomes.recv().await {
                let outcome = outcome.and_then(AsyncHostLink::from_blocking);
                let outcome = outcome.map_err(ActorError::from).and_then(|link| {
                    let peer = link.peer();
                    same_host_copies(&node, peer.host, peer.process).map(|()| link)
                });
                match outcome {
                    Ok(link) => {
                        let peer = adopt(&node, link);
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
        Ok(TcpListening::new(local, stop, thread, task, incoming))
    }
}
