//! How a node gets its links: [`Node::connect`] to a node that listens, [`Node::listen`]
//! for nodes that connect ([`Listening`], [`Listening::accept`]), [`Node::local`] for a
//! link to itself. Each connection that passes the handshake gets its [`PeerLink`] actor
//! here and joins the node's links.
//!
//! It sits above `link`, whose actors it starts; the node below it keeps the links once
//! they are up and never starts one.

use crate::error::ActorError;
use crate::link::PeerLink;
use crate::node::{Node, Peer, PeerEvent};
use baton_ipc::{AsyncLink, Listener, Session, SocketDir};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

impl Node {
    /// Starts the actor of an established link, which joins the node's links.
    fn adopt(&self, link: AsyncLink) -> Peer {
        let info = *link.peer();
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
            incoming,
        })
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
    incoming: tokio::sync::mpsc::Receiver<Peer>,
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
        self.incoming.recv().await.ok_or(ActorError::NotListening)
    }

    /// [`accept`](Self::accept) with a deadline.
    ///
    /// # Errors
    /// As `accept`; [`ActorError::Timeout`] if no peer linked within `after`.
    pub async fn accept_timeout(&mut self, after: Duration) -> Result<Peer, ActorError> {
        tokio::time::timeout(after, self.accept())
            .await
            .map_err(|_| ActorError::Timeout {
                op: "accept",
                after,
            })?
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
