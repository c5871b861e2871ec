//! [`Node`]: this process in a Baton deployment — its session, backend, import cache,
//! links, and the actors other processes can reach by name.

use crate::buffer::{IncomingLease, Shared, SharedInner};
use crate::error::ActorError;
use crate::ids::LinkId;
use crate::link::{CutOff, LinkRef, PeerLink, SendPing};
use crate::remote::{ErasedHandler, Registered, RemoteAddr, RemoteMessage};
use actix::prelude::*;
use baton_ipc::{
    AsyncLink, HostBackend, ImportCache, LinkConfig, Listener, PeerInfo, Session, SharedBackend,
    SocketDir,
};
use baton_messages::{BackendKind, LeaseId, ProcessId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Something happened to a link.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
#[non_exhaustive]
pub enum PeerEvent {
    /// A link was established (either side connected).
    Up(Peer),
    /// A link ended. `reason` is `None` for a clean end of stream (including the peer's
    /// process dying), else why it was dropped.
    Down {
        /// The link.
        link: LinkId,
        /// Who was at the other end.
        peer: PeerInfo,
        /// Why, if not a clean close.
        reason: Option<Arc<ActorError>>,
    },
    /// A connection was refused before it became a link (credentials, token, version,
    /// malformed handshake, timeout).
    Refused(Arc<ActorError>),
}

/// An exporter asked for a lease back (see [`Node::on_revoke`]).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct RevokeRequested {
    /// The exporting process.
    pub peer: ProcessId,
    /// The lease it wants back.
    pub lease: LeaseId,
    /// How long the holder has before its link is cut.
    pub within: Duration,
}

/// A buffer offered outside any message (a bare `Offer` frame), for the node's inbox.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Offered {
    /// Who offered it.
    pub peer: ProcessId,
    /// The buffer, unopened; dropping it releases the lease.
    pub buffer: Shared<u8>,
}

impl fmt::Debug for Offered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Offered")
            .field("peer", &self.peer)
            .field("buffer", &self.buffer)
            .finish()
    }
}

/// A connected peer process: a link, and what it proved about itself.
#[derive(Clone)]
pub struct Peer {
    pub(crate) link: LinkRef,
    pub(crate) info: PeerInfo,
}

impl fmt::Debug for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peer")
            .field("link", &self.link.id)
            .field("process", &self.info.process)
            .field("alive", &self.link.is_alive())
            .finish()
    }
}

impl Peer {
    /// The link's id.
    pub fn link_id(&self) -> LinkId {
        self.link.id
    }

    /// The peer process (as proven in the handshake) and its credentials.
    pub fn info(&self) -> &PeerInfo {
        &self.info
    }

    /// The peer process.
    pub fn process(&self) -> ProcessId {
        self.info.process
    }

    /// Whether the link is still up.
    pub fn is_connected(&self) -> bool {
        self.link.is_alive()
    }

    /// The actor registered as `name` in the peer process, for messages of type `M`.
    pub fn remote<M: RemoteMessage>(&self, name: &str) -> RemoteAddr<M> {
        RemoteAddr {
            link: self.link.clone(),
            target: Arc::from(name),
            _m: PhantomData,
        }
    }

    /// Sends a liveness probe (the peer answers `Pong`).
    pub fn ping(&self, n: u64) {
        self.link.addr.do_send(SendPing(n));
    }

    /// Closes the link: leases granted over it are reclaimed, leases held over it orphaned.
    pub fn close(&self) {
        self.link.addr.do_send(CutOff(ActorError::LinkClosed {
            peer: self.info.process,
        }));
    }
}

struct NodeInner {
    config: LinkConfig,
    cache: ImportCache,
    backend: SharedBackend,
    handlers: Mutex<HashMap<String, Arc<dyn ErasedHandler>>>,
    links: Mutex<HashMap<LinkId, Peer>>,
    watchers: Mutex<Vec<Recipient<PeerEvent>>>,
    revoke_watchers: Mutex<Vec<Recipient<RevokeRequested>>>,
    inbox: Mutex<Option<Recipient<Offered>>>,
}

/// This process in a deployment (see the [crate docs](crate)). Cheap to clone.
#[derive(Clone)]
pub struct Node {
    inner: Arc<NodeInner>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("process", &self.session().process())
            .field("backend", &self.inner.backend.name())
            .field("links", &lock(&self.inner.links).len())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each guarded value is a collection left consistent by every single operation.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Raises the soft limit on open files to the hard limit: every mapped host segment and
/// every link holds a descriptor, and the common default soft limit (1024) is low for
/// processes that hold thousands of leases.
fn raise_fd_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        let _ = setrlimit(Resource::Nofile, limit);
    }
}

impl Node {
    /// A node that allocates with `backend` and links with same-uid peers holding the
    /// session's token. It opens handles of `backend`'s kind and host handles.
    pub fn new(session: Session, backend: SharedBackend) -> Node {
        Self::with_config(LinkConfig::new(session), backend)
    }

    /// A node with its own link configuration (peer policy, handshake deadline).
    pub fn with_config(config: LinkConfig, backend: SharedBackend) -> Node {
        raise_fd_limit();
        let mut importers: Vec<SharedBackend> = vec![Arc::clone(&backend)];
        if !backend.can_open(BackendKind::Host) {
            if let Ok(host) = HostBackend::new() {
                importers.push(Arc::new(host));
            }
        }
        Node {
            inner: Arc::new(NodeInner {
                cache: ImportCache::new(config.session.clone(), importers),
                config,
                backend,
                handlers: Mutex::new(HashMap::new()),
                links: Mutex::new(HashMap::new()),
                watchers: Mutex::new(Vec::new()),
                revoke_watchers: Mutex::new(Vec::new()),
                inbox: Mutex::new(None),
            }),
        }
    }

    /// The node of a child process: the session its parent passed
    /// ([`Session::from_env`]: the token comes from the inherited pipe named in
    /// `BATON_TOKEN_FD`, which is read and closed, so it is in neither this process's
    /// environment nor its children's), the backend from `BATON_BACKEND` (CUDA when present,
    /// else host, in the flavor `BATON_HOST` picks). A child's entry point: call it at the
    /// top of `main`, or call [`Session::from_env`] there.
    ///
    /// # Errors
    /// [`baton_ipc::Error::BadToken`] without a token; a backend error.
    pub fn from_env() -> Result<Node, ActorError> {
        Ok(Self::new(Session::from_env()?, baton_ipc::select::auto()?))
    }

    /// The session.
    pub fn session(&self) -> &Session {
        &self.inner.config.session
    }

    /// The backend buffers are allocated with.
    pub fn backend(&self) -> &SharedBackend {
        &self.inner.backend
    }

    /// The import cache.
    pub fn cache(&self) -> &ImportCache {
        &self.inner.cache
    }

    /// Makes the actor registered as `name` reachable from other processes, for messages
    /// of type `M` (replacing any earlier registration of that name).
    pub fn register<M>(&self, name: &str, recipient: Recipient<M>)
    where
        M: RemoteMessage,
        M::Result: Serialize + DeserializeOwned + Send,
    {
        lock(&self.inner.handlers).insert(name.to_owned(), Arc::new(Registered { recipient }));
    }

    /// Removes a registration.
    pub fn unregister(&self, name: &str) {
        lock(&self.inner.handlers).remove(name);
    }

    pub(crate) fn handler(&self, name: &str) -> Option<Arc<dyn ErasedHandler>> {
        lock(&self.inner.handlers).get(name).cloned()
    }

    /// Tells `recipient` about every link that comes up, goes down or is refused.
    pub fn subscribe(&self, recipient: Recipient<PeerEvent>) {
        lock(&self.inner.watchers).push(recipient);
    }

    /// Tells `recipient` when an exporter asks for a lease back; a cooperative holder drops
    /// the lease in time.
    pub fn on_revoke(&self, recipient: Recipient<RevokeRequested>) {
        lock(&self.inner.revoke_watchers).push(recipient);
    }

    /// Where bare offers go; without an inbox they are released at once, and so is an
    /// offer without an element type and shape.
    pub fn set_inbox(&self, recipient: Recipient<Offered>) {
        *lock(&self.inner.inbox) = Some(recipient);
    }

    fn notify(&self, event: PeerEvent) {
        lock(&self.inner.watchers).retain(|w| w.connected());
        for w in lock(&self.inner.watchers).iter() {
            w.do_send(event.clone());
        }
    }

    pub(crate) fn notify_revoke(&self, event: RevokeRequested) {
        for w in lock(&self.inner.revoke_watchers).iter() {
            w.do_send(event);
        }
    }

    pub(crate) fn deliver_offer(&self, peer: ProcessId, lease: IncomingLease) {
        // Actors deal in typed buffers only (`Shared::layout` promises one): an offer
        // without an element type and shape is given back at once (dropping the lease
        // sends `Release`), never handed to user code.
        if lease.imported.as_ref().and_then(|i| i.layout()).is_none() {
            tracing::warn!(%peer, lease = %lease.lease, "bare offer without element type and shape: released");
            return;
        }
        let buffer = Shared {
            inner: SharedInner::Incoming(lease),
            _t: PhantomData,
        };
        match &*lock(&self.inner.inbox) {
            Some(inbox) => inbox.do_send(Offered { peer, buffer }),
            None => tracing::debug!(%peer, "bare offer with no inbox: released"),
        }
    }

    /// The links up now.
    pub fn peers(&self) -> Vec<Peer> {
        lock(&self.inner.links).values().cloned().collect()
    }

    /// The link to a process, if one is up.
    pub fn peer(&self, process: &ProcessId) -> Option<Peer> {
        lock(&self.inner.links)
            .values()
            .find(|p| p.info.process == *process)
            .cloned()
    }

    fn adopt(&self, link: AsyncLink) -> Peer {
        let info = *link.peer();
        let link = PeerLink::start(self.clone(), link);
        let peer = Peer { link, info };
        lock(&self.inner.links).insert(peer.link.id, peer.clone());
        self.notify(PeerEvent::Up(peer.clone()));
        peer
    }

    pub(crate) fn link_down(&self, link: LinkId, peer: PeerInfo, reason: Option<Arc<ActorError>>) {
        let last_to_process = {
            let mut links = lock(&self.inner.links);
            links.remove(&link);
            !links.values().any(|p| p.info.process == peer.process)
        };
        if last_to_process {
            // Its tombstones can only matter for handles it sends, and it sends no more.
            self.inner.cache.forget_process(&peer.process);
        }
        self.notify(PeerEvent::Down { link, peer, reason });
    }

    /// Cuts every link to the process with this pid (a supervised child died: even if a
    /// descendant inherited its socket, its leases are reclaimed now).
    pub fn disconnect_pid(&self, pid: u32) {
        for peer in self.peers() {
            if peer.info.process.pid == pid {
                peer.link.addr.do_send(CutOff(ActorError::LinkClosed {
                    peer: peer.info.process,
                }));
            }
        }
    }

    /// Connects to a node listening at `path`. Must be called inside an actix system.
    ///
    /// # Errors
    /// A connection or handshake error.
    pub async fn connect(&self, path: impl AsRef<Path>) -> Result<Peer, ActorError> {
        let link = AsyncLink::connect(path, &self.inner.config).await?;
        Ok(self.adopt(link))
    }

    /// Accepts links at `dir/name` until the returned guard drops. Refused connections are
    /// reported to subscribers as [`PeerEvent::Refused`]. Must be called inside an actix
    /// system.
    ///
    /// # Errors
    /// The socket cannot be bound.
    pub fn listen(&self, dir: &SocketDir, name: &str) -> Result<Listening, ActorError> {
        let listener = Listener::bind(dir, name, self.inner.config.clone())?;
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
                actix::spawn(async move {
                    match AsyncLink::server(stream, &node.inner.config).await {
                        Ok(link) => {
                            node.adopt(link);
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
            _listener: listener,
            task,
        })
    }
}

/// A listening socket; dropping it stops accepting and removes the socket file. Links
/// already up are unaffected.
pub struct Listening {
    path: PathBuf,
    _listener: Listener,
    task: tokio::task::JoinHandle<()>,
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
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.task.abort();
    }
}
