//! The node's state: [`NodeCore`], what a [`Node`] is under its public API — its session,
//! backend, import cache, exports, links and the actors other processes can reach by name
//! — and the types the node and its links both name ([`Peer`], [`PeerEvent`],
//! [`Offered`], [`RevokeRequested`], [`NodeConfig`], [`HostSettings`]).
//!
//! The node keeps its links and serves them (each link actor holds a `NodeCore` and calls
//! back into it), so its state sits here, below `link`; the links are made in `connect`,
//! above both; the public `Node` (`node.rs` and `node/`) wraps a `NodeCore` above all of
//! them, and every inherent `impl Node` is there. Whatever a module below `node` needs of
//! the node is a method of `NodeCore`, defined once here: a public method that such a
//! module needs too (`session`, `backend`, `peers`, …) has its body here, and `Node`'s is
//! one line that calls it. So are the few public methods that change the node's tables
//! (registrations, watchers, the inbox): `NodeInner`'s fields stay private to this file.
//!
//! [`Node`]: crate::Node

use crate::buffer::{IncomingLease, Shared, SharedInner};
use crate::error::ActorError;
use crate::exports::{BufferCell, Exports};
use crate::ids::{FastMap, FastSet, LinkId};
use crate::ledger::RevokePolicy;
use crate::link_ref::{
    CLOSE_FLUSH, Close, CutOff, Heartbeat, LinkLimits, LinkRef, LinkRings, Notice, PeerDied,
    SendPing,
};
use crate::offload::Offload;
use crate::paths::{DowngradePolicy, PathDowngraded};
use crate::remote::{ErasedHandler, OutCall, RemoteAddr, RemoteMessage};
use actix::prelude::*;
use baton_ipc::process::DeathWatch;
use baton_ipc::tcp::{HostId, NodeKey, TcpConfig, TcpPolicy};
use baton_ipc::transfer::nccl::{NcclConfig, RendezvousSink};
use baton_ipc::transfer::{EnginePeer, NcclEngine, TcpEngine};
use baton_ipc::{
    Allocation, HostBackend, ImportCache, LinkConfig, PeerInfo, Session, SharedBackend, WarmBudget,
};
use baton_messages::protocol::CallFault;
use baton_messages::{ActorId, BackendKind, Layout, LeaseId, ProcessId};
use std::fmt;
use std::marker::PhantomData;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
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
///
/// [`Node::on_revoke`]: crate::Node::on_revoke
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
    /// Where typed calls over the link go (its actor).
    pub(crate) calls: Recipient<OutCall>,
    pub(crate) info: PeerInfo,
    pub(crate) link_deadline: Duration,
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
            calls: self.calls.clone(),
            target: Arc::from(name),
            type_name: Arc::from(M::NAME),
            _m: PhantomData,
        }
    }

    /// Measures the round trip to the peer: a `Ping` out, its `Pong` back, through both
    /// processes' links. The heartbeat measures it too (see
    /// [`round_trip`](Self::round_trip)).
    ///
    /// # Errors
    /// [`ActorError::LinkClosed`] if the link goes down first; [`ActorError::Timeout`]
    /// after the heartbeat deadline.
    pub fn ping(&self) -> impl Future<Output = Result<Duration, ActorError>> + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.link.do_send(SendPing(tx));
        let (peer, after) = (self.info.process, self.link_deadline);
        async move {
            match tokio::time::timeout(after, rx).await {
                Ok(Ok(rtt)) => Ok(rtt),
                Ok(Err(_)) => Err(ActorError::link_closed(peer)),
                Err(_) => Err(ActorError::Timeout { op: "ping", after }),
            }
        }
    }

    /// The last round trip to the peer that its link measured (heartbeat or
    /// [`ping`](Self::ping)), if any.
    pub fn round_trip(&self) -> Option<Duration> {
        self.link.round_trip()
    }

    /// File descriptors this link has received from the peer so far (beside its offers:
    /// VMM and `memfd` allocations once per allocation, pools once per pool).
    pub fn descriptors_received(&self) -> u64 {
        self.link.descriptors_received()
    }

    /// Which directions of this link have carried frames through a shared-memory ring
    /// instead of the socket (on by default: [`NodeConfig::ring`]).
    pub fn rings(&self) -> LinkRings {
        self.link.rings()
    }

    /// Bytes queued for the peer's socket now (our calls, replies and protocol messages
    /// not yet written). Our calls never hold more than
    /// [`LinkLimits::send_window`] of it; the rest never more than
    /// [`LinkLimits::queued_bytes`].
    pub fn queued_bytes(&self) -> usize {
        self.link.state().queued_bytes()
    }

    /// Closes the link: leases granted over it stop counting (the memory is freed once no
    /// live process may map it), leases held over it are orphaned. It returns at once;
    /// the link actor ends on its own thread's next turn: await
    /// [`closed`](Self::closed) (or call [`close_and_wait`](Self::close_and_wait)) to know
    /// it has.
    ///
    /// What this side owes the peer goes first: answers to the peer's calls that are under
    /// way (a handler that replied just before the close) and frames already queued are
    /// written before the end of the link, for at most [`CLOSE_FLUSH`]
    /// (a peer that does not read, or a handler that never answers, does not hold the
    /// close up longer). Our own calls still waiting for the peer's answers end with
    /// [`ActorError::LinkClosed`].
    ///
    /// Do not block the thread the node's actors run on (`std::process::Child::wait`,
    /// `std::thread::sleep`, a blocking `recv`) after `close`: the link actor runs there
    /// too, so it never ends and the peer never sees the end of the link — a deadlock when
    /// the peer waits for it to exit. Await instead ([`LinkedChild::wait`](crate::LinkedChild::wait)).
    pub fn close(&self) {
        self.link.do_send(Close { flush: CLOSE_FLUSH });
    }

    /// Resolves once the link is down and the node has processed its end: leases granted
    /// over it are reclaimed, leases held over it are orphaned, and subscribers have been
    /// sent [`PeerEvent::Down`]. It resolves however the link ends — [`close`](Self::close),
    /// the peer closing or exiting, a protocol fault, a missed heartbeat — and at once if
    /// it already has. The future borrows nothing.
    ///
    /// A child process's usual end: `parent.closed().await`, then return from `main`.
    pub fn closed(&self) -> impl Future<Output = ()> + 'static + use<> {
        self.link.closed()
    }

    /// [`close`](Self::close), then [`closed`](Self::closed): resolves once the link is down
    /// and processed.
    pub fn close_and_wait(&self) -> impl Future<Output = ()> + 'static + use<> {
        self.close();
        self.closed()
    }
}

/// How a [`Node`] links and keeps its links and mappings.
///
/// **Rings (on by default).** Every link the node makes to a process of this host
/// ([`Node::listen`], [`Node::connect`], [`Node::local`], [`Node::spawn_child`]) asks its
/// peer to send its frames through a shared-memory ring instead of the socket (see
/// [`baton_ipc::ring`]; 256 KiB per direction by default); frames that carry descriptors or
/// are larger than half the ring still take the socket. [`ring`](Self::ring) sets the
/// capacity or turns rings off, as `BATON_LINK_RING` does in the environment (`0`: off),
/// which [`NodeConfig::new`] reads through [`LinkConfig::new`]. A process maps at most
/// [`max_ends`](baton_ipc::ring::max_ends) ring ends (64 by default, `BATON_LINK_RINGS_MAX`:
/// 32 links with a ring each way); links past that keep the socket. A link's reader runs on the actix system (or
/// arbiter) that made the link; it *polls* the ring for a short window before sleeping
/// only when that thread's runtime was built with the ring's park hook —
/// [`ring_polling_system`](crate::ring_polling_system) builds such a system. Elsewhere a
/// ring still works, each frame then costs a doorbell wakeup. [`Peer::rings`] says
/// whether a link uses them.
///
/// [`Node`]: crate::Node
/// [`Node::connect`]: crate::Node::connect
/// [`Node::listen`]: crate::Node::listen
/// [`Node::local`]: crate::Node::local
/// [`Node::spawn_child`]: crate::Node::spawn_child
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// How links are established: session, peer policy, handshake deadline, and the ring
    /// setting ([`LinkConfig::ring`]; see [`ring`](Self::ring)).
    pub link: LinkConfig,
    /// How links watch their peers' liveness.
    pub heartbeat: Heartbeat,
    /// How many mappings the import cache keeps warm.
    pub warm: WarmBudget,
    /// What one link may hold (queues, calls, offers, leases).
    pub limits: LinkLimits,
    /// How this node links to nodes on other hosts ([`Node::listen_tcp`],
    /// [`Node::connect_tcp`]).
    ///
    /// [`Node::connect_tcp`]: crate::Node::connect_tcp
    /// [`Node::listen_tcp`]: crate::Node::listen_tcp
    pub hosts: HostSettings,
    /// Whether it takes a slower path than the one wanted (see
    /// [`paths`](crate::paths)); default [`DowngradePolicy::from_env`]: refused unless
    /// `BATON_ALLOW_DOWNGRADE` allows it.
    pub downgrades: DowngradePolicy,
}

/// How a node links to nodes on other hosts: its key, whom it accepts, which host it says
/// it runs on. The session (its token is the Noise pre-shared key) is the node's.
#[derive(Debug, Clone)]
pub struct HostSettings {
    /// This node's static key; `None`: one is made on the first host link.
    pub key: Option<NodeKey>,
    /// Which peers' keys to accept (default: any holder of the session's token).
    pub policy: TcpPolicy,
    /// The host this node says it runs on (default [`HostId::current`]: `BATON_HOST_ID`,
    /// else the machine id).
    pub host: HostId,
    /// How long a host link's handshake may take (default 5 s).
    pub handshake_timeout: Duration,
    /// The NCCL engine's limits, for device memory across hosts (made on the first
    /// device copy; see `docs/CROSS_HOST.md`).
    pub nccl: NcclConfig,
}

impl Default for HostSettings {
    fn default() -> Self {
        Self {
            key: None,
            policy: TcpPolicy::any(),
            host: HostId::current(),
            handshake_timeout: Duration::from_secs(5),
            nccl: NcclConfig::default(),
        }
    }
}

/// What a node needs once it links beyond its host: the host links' configuration (with
/// its TCP engine's data port) and the engine that carries buffers' bytes to and from
/// nodes on other hosts. Made on the node's first host link.
pub(crate) struct HostPlane {
    pub(crate) tcp: TcpConfig,
    pub(crate) engine: TcpEngine,
    /// The engine for device memory, made on the first device copy ([`NodeCore::nccl`]).
    nccl: Mutex<Option<Arc<NcclEngine>>>,
}

impl HostPlane {
    /// The NCCL engine, if it was made.
    pub(crate) fn nccl(&self) -> Option<Arc<NcclEngine>> {
        lock(&self.nccl).clone()
    }
}

impl NodeConfig {
    /// Same-uid peers holding the session's token; default heartbeat and warm budget.
    pub fn new(session: Session) -> Self {
        LinkConfig::new(session).into()
    }

    /// With another heartbeat.
    pub fn heartbeat(mut self, heartbeat: Heartbeat) -> Self {
        self.heartbeat = heartbeat;
        self
    }

    /// With links on this host asking for a shared-memory ring of `capacity` data bytes
    /// for the frames their peers send (`Some`: a power of two, see
    /// [`LinkConfig::with_ring`]), or on the socket alone (`None`), whatever
    /// `BATON_LINK_RING` says. Without this call the node follows `BATON_LINK_RING` (unset:
    /// rings of [`DEFAULT_CAPACITY`](baton_ipc::ring::DEFAULT_CAPACITY)). Links to other
    /// hosts never use rings. For the reader to poll, run the node
    /// on [`ring_polling_system`](crate::ring_polling_system) (see the type's docs).
    pub fn ring(mut self, capacity: Option<usize>) -> Self {
        self.link.ring = capacity;
        self
    }

    /// With another budget of warm mappings.
    pub fn warm(mut self, warm: WarmBudget) -> Self {
        self.warm = warm;
        self
    }

    /// With other link limits.
    pub fn limits(mut self, limits: LinkLimits) -> Self {
        self.limits = limits;
        self
    }

    /// With other settings for links to other hosts.
    pub fn hosts(mut self, hosts: HostSettings) -> Self {
        self.hosts = hosts;
        self
    }

    /// With another policy for downgrades to a slower path ([`DowngradePolicy::Allow`]
    /// takes them and tells [`Node::on_downgrade`]'s subscribers; see
    /// [`paths`](crate::paths)).
    ///
    /// [`Node::on_downgrade`]: crate::Node::on_downgrade
    pub fn downgrades(mut self, policy: DowngradePolicy) -> Self {
        self.downgrades = policy;
        self
    }
}

impl From<LinkConfig> for NodeConfig {
    fn from(link: LinkConfig) -> Self {
        Self {
            link,
            heartbeat: Heartbeat::default(),
            warm: WarmBudget::default(),
            limits: LinkLimits::default(),
            hosts: HostSettings::default(),
            downgrades: DowngradePolicy::from_env(),
        }
    }
}

struct NodeInner {
    config: NodeConfig,
    cache: ImportCache,
    backend: SharedBackend,
    exports: Arc<Exports>,
    /// Where blocking backend calls run (a driver thread for CUDA; inline for host).
    offload: Offload,
    /// Reports linked processes' deaths (`None` if its thread could not start: links
    /// then learn of deaths by end of stream and from the supervisor only).
    deaths: Option<DeathWatch>,
    /// Per name, a handler per wire type name (few: a linear search).
    handlers: Mutex<FastMap<String, Vec<Arc<dyn ErasedHandler>>>>,
    /// Shared with the NCCL engine's rendezvous sink, which routes by it.
    links: Arc<Mutex<FastMap<LinkId, Peer>>>,
    /// Processes seen dead whose links are still ending.
    dead: Mutex<FastSet<ProcessId>>,
    watchers: Mutex<Vec<Recipient<PeerEvent>>>,
    revoke_watchers: Mutex<Vec<Recipient<RevokeRequested>>>,
    downgrade_watchers: Mutex<Vec<Recipient<PathDowngraded>>>,
    inbox: Mutex<Option<Recipient<Offered>>>,
    /// What the node's status reports besides the ledger, cache and links.
    observed: crate::observed::Observed,
    /// The exporter identity of buffers allocated with [`Node::allocate`].
    ///
    /// [`Node::allocate`]: crate::Node::allocate
    owner: ActorId,
    /// The calling side of the loopback link ([`Node::local`]), once made.
    ///
    /// [`Node::local`]: crate::Node::local
    local: Mutex<Option<Peer>>,
    /// The forwards this node relays or holds.
    relays: crate::relay::Relays,
    /// Its reach beyond its host, once it has a host link.
    plane: Mutex<Option<Arc<HostPlane>>>,
}

impl Drop for NodeInner {
    /// A closed node gives the device back what its backend keeps for reuse and nothing
    /// uses any more ([`Backend::release_idle`](baton_ipc::Backend::release_idle): CUDA
    /// retires its export pool, whose memory another process imported goes back only when
    /// the pool is destroyed). On the driver thread, which runs what is queued before it
    /// ends; the backend may outlive the node (a caller that keeps it), and it makes a
    /// fresh pool if asked for memory again.
    fn drop(&mut self) {
        let backend = Arc::clone(&self.backend);
        self.offload.submit(move || backend.release_idle());
    }
}

/// The node's state, and what the modules below the public [`Node`] ask of
/// it: the links and their actors, the transports, the status answer, the connects. The
/// public `Node` wraps one (see the [module docs](self)). Cheap to clone.
///
/// [`Node`]: crate::Node
#[derive(Clone)]
pub(crate) struct NodeCore {
    inner: Arc<NodeInner>,
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

/// How many descriptors the table of a process with a node has room for from the start, at
/// least ([`reserve_fd_table`]), unless its limit on open files is lower.
const RESERVED_FDS: u64 = 1024;

/// Grows the process's descriptor table, once, to hold [`RESERVED_FDS`] descriptors, or
/// twice as many as are open, if more (a duplicate at the top of that range, closed at
/// once: the table never shrinks).
///
/// In a process with threads, every growth of the table waits for an RCU grace period
/// (`expand_fdtable`), 6-40 ms on the machines measured, for the thread that opens the
/// descriptor — and the processes waiting on one grace period are released together. Grown
/// at the first link instead, the wait fell on the link's set-up: a ring's descriptors took a
/// CUDA process (which holds many already) past a boundary, and the renderer's first frame
/// took 8-40 ms against 3 on the socket
/// (`docs/bench/h200/2026-11-30-c33f5be-x2-renderer-first-frame.txt`). Here it is paid when the
/// node is made, before any link. A process that maps thousands of host segments grows the
/// table further as it goes.
fn reserve_fd_table() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use rustix::process::{Resource, getrlimit};
        let limit = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
        let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
        let room = RESERVED_FDS.max(2 * open).min(limit);
        let top = i32::try_from(room.saturating_sub(1)).unwrap_or(i32::MAX);
        let started = std::time::Instant::now();
        let reserved = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
            .and_then(|probe| rustix::io::fcntl_dupfd_cloexec(&probe, top));
        match reserved {
            Ok(high) => {
                drop(high);
                tracing::debug!(room, open, took = ?started.elapsed(), "descriptor table grown");
            }
            Err(e) => tracing::debug!(error = %e, "descriptor table not grown ahead"),
        }
    });
}

impl NodeCore {
    /// The state of a node with `config` that allocates with `backend` (the body of
    /// [`Node::with_config`]): its import cache, exports, death
    /// watch and driver thread.
    ///
    /// [`Node::with_config`]: crate::Node::with_config
    pub(crate) fn new(config: NodeConfig, backend: SharedBackend) -> NodeCore {
        raise_fd_limit();
        reserve_fd_table();
        let mut importers: Vec<SharedBackend> = vec![Arc::clone(&backend)];
        if !backend.can_open(BackendKind::Host) {
            if let Ok(host) = HostBackend::new() {
                importers.push(Arc::new(host));
            }
        }
        let session = config.link.session.clone();
        let offload = Offload::for_backends(&importers);
        let inner = Arc::new_cyclic(|weak: &Weak<NodeInner>| {
            let on_death = weak.clone();
            let deaths = DeathWatch::spawn("baton-deaths", move |process| {
                if let Some(inner) = on_death.upgrade() {
                    (NodeCore { inner }).process_exited(process);
                }
            })
            .map_err(|e| tracing::warn!(error = %e, "no death watch: deaths are seen by end of stream only"))
            .ok();
            let cache = ImportCache::with_budget(session.clone(), importers, config.warm);
            if !offload.is_inline() {
                // Mapping closes (and the waits for the work queued on them) are driver
                // calls: never on an actor's thread.
                let closer = offload.clone();
                cache.set_executor(Arc::new(move |job| closer.submit(job)));
            }
            let evict = weak.clone();
            cache.set_evictor(Arc::new(move |holder, key| {
                let Some(inner) = evict.upgrade() else { return };
                let peer = lock(&inner.links)
                    .values()
                    .find(|p| p.link.id.get() == holder.0)
                    .cloned();
                if let Some(peer) = peer {
                    peer.link.do_send(Notice::Evict(key.alloc));
                }
            }));
            NodeInner {
                cache,
                exports: Exports::new(session, offload.clone()),
                offload,
                deaths,
                config,
                backend,
                handlers: Mutex::new(FastMap::default()),
                links: Arc::default(),
                dead: Mutex::new(FastSet::default()),
                watchers: Mutex::new(Vec::new()),
                revoke_watchers: Mutex::new(Vec::new()),
                downgrade_watchers: Mutex::new(Vec::new()),
                inbox: Mutex::new(None),
                observed: crate::observed::Observed::new(),
                owner: crate::ids::next_actor(),
                local: Mutex::new(None),
                relays: crate::relay::Relays::default(),
                plane: Mutex::new(None),
            }
        });
        // A producer that names fence values and does not deliver them is cut (our waits
        // on it were released already; see `baton_ipc::inbox`).
        let faulty = Arc::downgrade(&inner);
        inner
            .backend
            .ordering()
            .add_fence_fault_hook(Arc::new(move |process| {
                if let Some(inner) = faulty.upgrade() {
                    (NodeCore { inner }).disconnect(&process);
                }
            }));
        NodeCore { inner }
    }

    /// The session.
    pub(crate) fn session(&self) -> &Session {
        &self.inner.config.link.session
    }

    /// The node's configuration.
    pub(crate) fn config(&self) -> &NodeConfig {
        &self.inner.config
    }

    /// The exporter identity of buffers the node allocates itself
    /// ([`Node::allocate`]).
    ///
    /// [`Node::allocate`]: crate::Node::allocate
    pub(crate) fn owner(&self) -> ActorId {
        self.inner.owner
    }

    /// How many links are up now.
    pub(crate) fn link_count(&self) -> usize {
        lock(&self.inner.links).len()
    }

    /// The calling side of the loopback link ([`Node::local`]), once made.
    ///
    /// [`Node::local`]: crate::Node::local
    pub(crate) fn loopback(&self) -> MutexGuard<'_, Option<Peer>> {
        lock(&self.inner.local)
    }

    pub(crate) fn heartbeat(&self) -> Heartbeat {
        self.inner.config.heartbeat
    }

    /// How it links to nodes on other hosts.
    pub(crate) fn hosts(&self) -> &HostSettings {
        &self.inner.config.hosts
    }

    pub(crate) fn limits(&self) -> LinkLimits {
        self.inner.config.limits
    }

    pub(crate) fn exports(&self) -> &Arc<Exports> {
        &self.inner.exports
    }

    pub(crate) fn relays(&self) -> &crate::relay::Relays {
        &self.inner.relays
    }

    pub(crate) fn offload(&self) -> Offload {
        self.inner.offload.clone()
    }

    /// Drops what the backends keep of a process whose last link went down or that died
    /// (opened events and pools: driver calls), off the actor's thread. If it is dead, the
    /// streams waiting on its fences are released first, at once, on this thread: the
    /// driver thread's queue may hold a close that waits on those very streams.
    fn forget(&self, process: ProcessId) {
        self.inner.cache.release_dead(&process);
        let cache = self.inner.cache.clone();
        self.inner
            .offload
            .submit(move || cache.forget_process(&process));
    }

    pub(crate) fn observed(&self) -> &crate::observed::Observed {
        &self.inner.observed
    }

    /// Leases held over a link that went down, still alive in their guards: orphaned.
    pub(crate) fn record_orphans(
        &self,
        exporter: ProcessId,
        leases: Vec<(Weak<crate::buffer::HeldLease>, u64)>,
    ) {
        self.inner.observed.record_orphans(exporter, leases);
    }

    /// Reports `process`'s death to the ledger when it happens.
    pub(crate) fn watch(&self, process: ProcessId) {
        if let Some(deaths) = &self.inner.deaths {
            deaths.watch(process);
        }
    }

    /// Its reach beyond its host: made on the first call, its TCP engine taking data
    /// connections at `ip` (any free port).
    pub(crate) fn host_plane(&self, ip: IpAddr) -> Result<Arc<HostPlane>, ActorError> {
        let mut plane = lock(&self.inner.plane);
        if let Some(made) = plane.as_ref() {
            return Ok(Arc::clone(made));
        }
        let settings = &self.inner.config.hosts;
        let key = match &settings.key {
            Some(key) => key.clone(),
            None => NodeKey::generate()?,
        };
        let tcp = TcpConfig::new(self.session().clone(), key)
            .policy(settings.policy.clone())
            .host(settings.host)
            .handshake_timeout(settings.handshake_timeout);
        // A transfer whose connection makes no progress for a heartbeat deadline fails,
        // as a silent link is cut.
        let engine = TcpEngine::bind((ip, 0), tcp.clone(), self.heartbeat().deadline)?;
        let tcp = tcp.data_port(engine.data_addr().port());
        tracing::info!(host = %settings.host, key = %tcp.key.public(), data = %engine.data_addr(), "links beyond this host");
        let made = Arc::new(HostPlane {
            tcp,
            engine,
            nccl: Mutex::new(None),
        });
        *plane = Some(Arc::clone(&made));
        Ok(made)
    }

    /// Its reach beyond its host, if it has linked beyond it.
    pub(crate) fn plane(&self) -> Option<Arc<HostPlane>> {
        lock(&self.inner.plane).clone()
    }

    /// Its NCCL engine, for device memory across hosts: made on the first call, for the
    /// device this node's CUDA backend allocates on. Its rendezvous messages go to the
    /// peer over a host link to it (the links are the sink's only state: the engine,
    /// which the node owns, never holds the node): a live host link whose peer is the
    /// engine's peer as the links know it — its process id in its proven key's namespace,
    /// and its host — never a link found by what a peer claims (issue 45).
    ///
    /// # Errors
    /// [`RegionUnsupported`](baton_ipc::Error::RegionUnsupported) without a host link or
    /// a CUDA backend; [`NcclUnavailable`](baton_ipc::Error::NcclUnavailable) without
    /// NCCL.
    pub(crate) fn nccl(&self) -> Result<Arc<NcclEngine>, baton_ipc::Error> {
        let unsupported = |reason| baton_ipc::Error::RegionUnsupported {
            engine: "nccl",
            reason,
        };
        let plane = self
            .plane()
            .ok_or_else(|| unsupported("this node has no host link"))?;
        let mut made = lock(&plane.nccl);
        if let Some(engine) = made.as_ref() {
            return Ok(Arc::clone(engine));
        }
        let me = EnginePeer {
            process: self.session().process(),
            host: self.inner.config.hosts.host,
            data_addr: Some(plane.engine.data_addr()),
        };
        let links = Arc::clone(&self.inner.links);
        let sink: RendezvousSink = Arc::new(move |peer: &EnginePeer, bytes: Vec<u8>| {
            // Called under the engine's lock: only queue.
            let link = lock(&links)
                .values()
                .find(|p| {
                    p.info.process == peer.process
                        && p.info.host().is_some_and(|h| h.host == peer.host)
                        && p.link.is_alive()
                })
                .map(|p| p.link.clone());
            match link {
                Some(link) => link.do_send(Notice::Rendezvous(bytes)),
                None => {
                    tracing::debug!(peer = %peer.process, "no host link for an NCCL rendezvous: its transfers fail by their deadline")
                }
            }
        });
        let config = self.inner.config.hosts.nccl;
        // A test's fake NCCL, where one serves this node's host (the ipc crate's `testing`
        // feature; never otherwise).
        let engine = match baton_ipc::transfer::nccl::testing_engine(&me, config, sink.clone()) {
            Some(fake) => fake,
            None => {
                let Some(cuda) = self
                    .backend()
                    .as_any()
                    .downcast_ref::<baton_ipc::CudaBackend>()
                else {
                    return Err(unsupported(
                        "this node allocates host memory: device memory crosses hosts between nodes with CUDA backends",
                    ));
                };
                let engine = NcclEngine::new(cuda.ordinal(), &me, config, sink)?;
                tracing::info!(
                    device = cuda.ordinal(),
                    "NCCL engine made: device memory crosses hosts"
                );
                engine
            }
        };
        let engine = Arc::new(engine);
        *made = Some(Arc::clone(&engine));
        Ok(engine)
    }

    /// A buffer of this node with `layout`'s bytes (zeroed), as [`Node::allocate`]
    /// makes them.
    ///
    /// [`Node::allocate`]: crate::Node::allocate
    pub(crate) fn allocate_layout(&self, layout: Layout) -> Result<Arc<BufferCell>, ActorError> {
        let bytes = layout
            .byte_len()
            .and_then(|b| usize::try_from(b).ok())
            .ok_or(ActorError::OutOfBounds {
                index: 0,
                len: usize::MAX,
                size: 0,
            })?;
        let alloc = self.inner.backend.allocate(bytes)?;
        Ok(self.adopt_allocation(alloc, layout))
    }

    /// Makes `alloc` (of this node's backend) one of the node's buffers.
    pub(crate) fn adopt_allocation(&self, alloc: Allocation, layout: Layout) -> Arc<BufferCell> {
        tracing::debug!(alloc = %alloc.id(), gen = %alloc.generation(), bytes = alloc.size(), "allocated (node)");
        self.inner.exports.insert(
            alloc,
            Arc::clone(&self.inner.backend),
            layout,
            self.inner.owner,
            RevokePolicy::default(),
        )
    }

    /// The backend buffers are allocated with.
    pub(crate) fn backend(&self) -> &SharedBackend {
        &self.inner.backend
    }

    /// The import cache.
    pub(crate) fn cache(&self) -> &ImportCache {
        &self.inner.cache
    }

    /// Adds `handler` to the types `name` serves (replacing its type's earlier handler).
    pub(crate) fn insert_handler(&self, name: &str, handler: Arc<dyn ErasedHandler>) {
        let mut handlers = lock(&self.inner.handlers);
        let types = handlers.entry(name.to_owned()).or_default();
        types.retain(|h| h.type_name() != handler.type_name());
        types.push(handler);
    }

    /// Removes every registration of `name` (of every type).
    pub(crate) fn unregister(&self, name: &str) {
        lock(&self.inner.handlers).remove(name);
    }

    /// Removes the registration of `name` for the wire type `type_name` only.
    pub(crate) fn unregister_type(&self, name: &str, type_name: &str) {
        let mut handlers = lock(&self.inner.handlers);
        if let Some(types) = handlers.get_mut(name) {
            types.retain(|h| h.type_name() != type_name);
            if types.is_empty() {
                handlers.remove(name);
            }
        }
    }

    /// The handler of `name` for calls of `type_name`: refused with `NoSuchActor` if
    /// nothing is registered as `name`, `WrongType` (naming the types it serves) if the
    /// name does not serve this type.
    pub(crate) fn handler(
        &self,
        name: &str,
        type_name: &str,
    ) -> Result<Arc<dyn ErasedHandler>, CallFault> {
        let handlers = lock(&self.inner.handlers);
        let types = handlers.get(name).ok_or(CallFault::NoSuchActor)?;
        if let Some(h) = types.iter().find(|h| h.type_name() == type_name) {
            return Ok(Arc::clone(h));
        }
        let served: Vec<&str> = types.iter().map(|h| h.type_name()).collect();
        Err(CallFault::WrongType {
            expected: served.join(" or "),
        })
    }

    /// Tells `recipient` about every link that comes up, goes down or is refused.
    pub(crate) fn subscribe(&self, recipient: Recipient<PeerEvent>) {
        lock(&self.inner.watchers).push(recipient);
    }

    /// Tells `recipient` when an exporter asks for a lease back.
    pub(crate) fn on_revoke(&self, recipient: Recipient<RevokeRequested>) {
        lock(&self.inner.revoke_watchers).push(recipient);
    }

    /// Tells `recipient` of every downgrade to a slower path this node takes.
    pub(crate) fn on_downgrade(&self, recipient: Recipient<PathDowngraded>) {
        lock(&self.inner.downgrade_watchers).push(recipient);
    }

    /// Takes the downgrade `event` describes if this node's policy allows it — counted,
    /// logged at warn, told to [`Node::on_downgrade`]'s subscribers — or
    /// refuses it.
    ///
    /// # Errors
    /// [`ActorError::PathDowngrade`] under [`DowngradePolicy::Refuse`].
    ///
    /// [`Node::on_downgrade`]: crate::Node::on_downgrade
    pub(crate) fn downgrade(&self, event: PathDowngraded) -> Result<(), ActorError> {
        let PathDowngraded {
            kind,
            wanted,
            taken,
            peer,
        } = event;
        if !self.inner.config.downgrades.allows() {
            tracing::debug!(%kind, %wanted, %taken, "refused a downgrade");
            return Err(ActorError::PathDowngrade {
                kind,
                wanted,
                available: taken,
                reason: kind.why(),
            });
        }
        self.inner.observed.paths.downgraded(&event);
        tracing::warn!(%kind, %wanted, %taken, peer = ?peer, "downgraded to a slower path: {}", kind.why());
        let mut watchers = lock(&self.inner.downgrade_watchers);
        watchers.retain(|w| w.connected());
        for w in watchers.iter() {
            w.do_send(event);
        }
        Ok(())
    }

    /// Where bare offers go (see [`Node::set_inbox`]).
    ///
    /// [`Node::set_inbox`]: crate::Node::set_inbox
    pub(crate) fn set_inbox(&self, recipient: Recipient<Offered>) {
        *lock(&self.inner.inbox) = Some(recipient);
    }

    pub(crate) fn notify(&self, event: PeerEvent) {
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

    pub(crate) fn deliver_offer(&self, peer: ProcessId, lease: Box<IncomingLease>) {
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
    pub(crate) fn peers(&self) -> Vec<Peer> {
        lock(&self.inner.links).values().cloned().collect()
    }

    /// The link to a process, if one is up.
    pub(crate) fn peer(&self, process: &ProcessId) -> Option<Peer> {
        lock(&self.inner.links)
            .values()
            .find(|p| p.info.process == *process)
            .cloned()
    }

    /// A link is up (see `connect`): it joins the node's links, and subscribers hear of it.
    pub(crate) fn link_up(&self, peer: &Peer) {
        let stale = {
            let mut links = lock(&self.inner.links);
            links.insert(peer.link.id, peer.clone());
            stale_incarnations(links.values().map(|p| (p.link.id, &p.info)), &peer.info)
        };
        for link in stale {
            let old = lock(&self.inner.links).get(&link).cloned();
            if let Some(old) = old {
                // Its host rebooted: that process is gone, whatever its link still says.
                tracing::warn!(old = %old.process(), new = %peer.process(), "a host came back with a new boot id: its old links are cut, their leases void");
                old.link
                    .do_send(CutOff(ActorError::link_closed(old.process())));
            }
        }
        self.notify(PeerEvent::Up(peer.clone()));
    }

    pub(crate) fn link_down(&self, link: LinkId, peer: PeerInfo, reason: Option<Arc<ActorError>>) {
        let last_to_process = {
            let mut links = lock(&self.inner.links);
            links.remove(&link);
            !links.values().any(|p| p.info.process == peer.process)
        };
        if last_to_process && peer.host().is_some() {
            // A peer on another host maps nothing of ours (buffers reach it as copies, and
            // their sends were aborted before the link's leases were taken back): once its
            // last link is down, nothing it held can be mapped there. Its pid names no
            // process of this host, so it is not watched.
            self.forget(peer.process);
            lock(&self.inner.dead).remove(&peer.process);
            self.inner.exports.process_dead(peer.process);
        } else if last_to_process {
            if baton_ipc::process::liveness(&peer.process) != baton_ipc::process::Liveness::Dead {
                if reason.is_some() {
                    // Cut (a fault, a missed heartbeat or deadline): our waits on its
                    // fences are released now; memory they guard is held until it dies.
                    self.inner.backend.ordering().producer_cut(&peer.process);
                }
                // Its death releases what we still hold for it (waits, frees, pools).
                self.watch(peer.process);
            }
            // What the backends keep of it (its opened events) only serves handles it
            // sends, and it sends no more.
            self.forget(peer.process);
            if lock(&self.inner.dead).remove(&peer.process) {
                self.inner.exports.process_dead(peer.process);
            }
        }
        self.notify(PeerEvent::Down { link, peer, reason });
    }

    /// Cuts every link to `process` (see [`Node::disconnect`]).
    ///
    /// [`Node::disconnect`]: crate::Node::disconnect
    pub(crate) fn disconnect(&self, process: &ProcessId) {
        for peer in self.peers() {
            if peer.info.process == *process {
                peer.link
                    .do_send(CutOff(ActorError::link_closed(peer.info.process)));
            }
        }
    }

    /// `process` is dead: its links end, then the ledger learns it (see
    /// [`Node::process_exited`]).
    ///
    /// [`Node::process_exited`]: crate::Node::process_exited
    pub(crate) fn process_exited(&self, process: ProcessId) {
        let links: Vec<Peer> = self
            .peers()
            .into_iter()
            .filter(|p| p.info.process == process)
            .collect();
        if links.is_empty() {
            self.inner.exports.process_dead(process);
            self.forget(process);
            return;
        }
        // `link_down` of the last link finishes the job.
        lock(&self.inner.dead).insert(process);
        for peer in links {
            peer.link.do_send(PeerDied);
        }
    }
}

/// The links to processes of `new`'s host that ran before its host's last boot: the old
/// incarnation, whose leases a reconnect with a new boot id voids. Only host links (a
/// Unix link's peer is on this host, whose boot is ours), and only those of `new`'s own
/// key: a boot id is a claim, so a key can void only what it proved itself — another
/// key that names the same host with a forged boot id cuts nothing of that host's.
fn stale_incarnations<'a>(
    links: impl Iterator<Item = (LinkId, &'a PeerInfo)>,
    new: &PeerInfo,
) -> Vec<LinkId> {
    let Some(host) = new.host() else {
        return Vec::new();
    };
    links
        .filter(|(_, p)| {
            p.host().is_some_and(|h| {
                h.host == host.host && h.key == host.key && h.claimed.boot != host.claimed.boot
            })
        })
        .map(|(id, _)| id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_ipc::tcp::{HostId, HostPeer, NodePublicKey};
    use baton_ipc::{PeerCred, Via};
    use baton_messages::BootId;

    fn on(host: &str, boot: u8, pid: u32) -> PeerInfo {
        by(0, host, boot, pid)
    }

    /// A peer over TCP with static key `key` that claims `pid` of boot `boot` on `host`.
    fn by(key: u8, host: &str, boot: u8, pid: u32) -> PeerInfo {
        let key = NodePublicKey([key; 32]);
        let claimed = ProcessId {
            boot: BootId([boot; 16]),
            pid,
            start_ticks: 1,
        };
        let process = baton_ipc::tcp::remote_process(&key, claimed);
        PeerInfo {
            process,
            via: Via::Tcp(HostPeer {
                process,
                claimed,
                host: HostId::named(host),
                key,
                addr: "10.0.0.1:1".parse().unwrap(),
                data_addr: None,
            }),
        }
    }

    #[test]
    fn a_host_back_with_a_new_boot_id_voids_only_its_old_incarnation() {
        let local = PeerInfo {
            process: ProcessId {
                boot: BootId([9; 16]),
                pid: 7,
                start_ticks: 1,
            },
            via: Via::Unix(PeerCred {
                pid: 7,
                uid: 0,
                gid: 0,
            }),
        };
        let links = [
            (LinkId::next(), on("a", 1, 10)),
            (LinkId::next(), on("a", 1, 11)),
            (LinkId::next(), on("a", 2, 12)),
            (LinkId::next(), on("b", 1, 10)),
            (LinkId::next(), local),
        ];
        let stale = |new: &PeerInfo| stale_incarnations(links.iter().map(|(id, p)| (*id, p)), new);
        // Host a rebooted (boot 2): its boot-1 processes are gone.
        assert_eq!(stale(&on("a", 2, 13)), vec![links[0].0, links[1].0]);
        // Host b's boot is unchanged: nothing is void.
        assert!(stale(&on("b", 1, 20)).is_empty());
        // A Unix peer is on this host, whose boot is ours.
        assert!(stale(&local).is_empty());
        // Another key that names host a with a new boot id voids nothing of host a's
        // (issue 45, finding 9): a boot id is a claim, only the key that proved it may
        // change it.
        assert!(stale(&by(5, "a", 3, 14)).is_empty());
        // Another key on host b, on b's boot: nothing either (two nodes of one host).
        assert!(stale(&by(6, "b", 1, 21)).is_empty());
    }

    /// The size of this process's descriptor table (`FDSize` in `/proc/self/status`).
    fn fd_table_size() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("FDSize:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("an FDSize line")
    }

    #[test]
    fn a_node_makes_room_in_the_descriptor_table_before_any_link() {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        reserve_fd_table();
        let want = RESERVED_FDS.min(limit);
        assert!(
            fd_table_size() >= want,
            "descriptor table of {} after the reservation, want room for {want}",
            fd_table_size()
        );
        // Once per process: a second call neither fails nor shrinks it.
        reserve_fd_table();
        assert!(fd_table_size() >= want);
    }
}
