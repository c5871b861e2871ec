//! Baton's actor protocol, on actix.
//!
//! Actors own device (or host) buffers, and other processes borrow them under leases:
//!
//! ```text
//!  exporter process                               importer process
//!  ┌────────────────────────────┐                 ┌─────────────────────────────┐
//!  │ BufferOwner ── lease table │                 │ your actor (registered name)│
//!  │   Buffer<T> ─ share() ─┐   │   Call + offers │   Shared<T> ─ open() ─ Lease │
//!  │ RemoteAddr<M>.send(M{..})──┼──── PeerLink ───┼─▶ Handler<M>                │
//!  │                        ◀───┼─── Release ─────┼── drop(Lease)               │
//!  └────────────────────────────┘  (one actor per └─────────────────────────────┘
//!                                    connection)
//! ```
//!
//! - [`Node`]: this process in a deployment — session, backend, import cache, links, and
//!   the actors reachable by name ([`Node::register`]). [`Node::spawn_child`] starts a
//!   child process already linked to it (the child calls [`Node::join`]);
//!   [`Listening::accept`] waits for peers that connect; [`Peer::closed`] waits for a
//!   link's end; [`Node::allocate`] allocates a buffer as a plain call. Across hosts,
//!   [`Node::listen_tcp`] and [`Node::connect_tcp`] link over TCP (Noise host links), and
//!   buffers sent there arrive as copies (`docs/CROSS_HOST.md`).
//! - [`BufferOwner`]: allocates [`Buffer`]s; the node's lease ledger records every lease
//!   on them from the moment its offer is sent. Dropping the last `Buffer` handle frees the
//!   buffer once no live process may map it — no lease out, every warm mapping unmapped or
//!   its process dead — never before; memory a cut but live holder may still map is
//!   *quarantined* where the backend's free would be unsafe (CUDA legacy IPC). [`Revoke`]
//!   asks for leases back by a deadline; the holder learns it through
//!   [`Lease::revoked`]. [`Buffer::returned`] waits for every lease on a buffer to come
//!   back.
//! - [`PeerLink`]: one actor per connection; framing, handshake, descriptors, heartbeat,
//!   routing of the lease protocol; the peer's death reclaims its leases and orphans ours.
//!   Its protocol — what it holds of the peer's, what is pending, every check on a frame
//!   and the fault it is — is a state machine without I/O (`link_session`); the actor is
//!   its shell, which owns the socket, the writer, the timers and the opens.
//! - Typed buffer messages: a [`RemoteMessage`] may hold [`Shared<T>`] fields; sending it
//!   through a [`RemoteAddr`] leases its buffers to the receiver, which `open()`s them into
//!   read-only [`Lease<T>`]s ([`SharedMut<T>`] fields open writable [`LeaseMut<T>`]s: one
//!   writer or many readers per byte range; [`Buffer::share_range`] leases a part of a
//!   buffer). Replies may carry buffers too. Each message type picks its
//!   [`Encoding`]: bincode by default, MessagePack for messages that cross languages.
//! - [`raw`]: untyped calls and buffers ([`Node::register_raw`], [`Peer::call_raw`],
//!   [`AnyBuffer`], [`AnyShared`], [`AnyLease`]) for peers that do not share Rust types,
//!   such as the Python package.
//! - Forwarding: a process passes a buffer it leased on to a third one, zero-copy
//!   ([`Peer::forward`], A → B → C); the exporter's ledger counts the third process as a
//!   holder until it gives the buffer back or dies (see `docs/FORWARDING.md`).
//! - Versioned syncs: [`SyncSender`] stamps the bundles of a sync with version N+1;
//!   [`SyncReceiver`] stages them and commits N+1 only once every part has landed, so a
//!   receiver is always on exactly N or N+1 (see `docs/GUIDE.md`, "Versioned syncs").
//! - [`supervisor`]: a process supervisor that spawns, watches and restarts child processes
//!   (one-for-one or one-for-all, at most N restarts in a window), and feeds their deaths
//!   into the lease protocol.
//!
//! Design choice: the lease ledger is a state machine without I/O (`ledger.rs`,
//! property-tested against a model), one per node, behind a mutex beside the actors rather
//! than inside one. So is each link's protocol (`link_session.rs`, one per link, owned by
//! its actor): the actor feeds it frames, opens and heartbeats with their time and
//! carries out the actions it returns, the way quinn drives quinn-proto's connection, so
//! every fault a peer can commit is a unit test and random frame sequences are checked
//! against a model, with no socket or process. Leases are granted and returned on the hot path of every handoff by the
//! link actors, and a few hash-map operations under a mutex cost far less than two extra
//! mailbox round trips. Owners keep what needs time (revoke deadlines) and identity.
//!
//! Layers: each module uses only the modules below it, so none is part of an import
//! cycle. `lib.rs` declares them bottom first, and the workspace's `tests/layers.rs`
//! fails on any import of a module declared later (and on files of one module that use
//! each other around a cycle):
//!
//! 1. pure state: `ids`, `error`, `ledger` (the lease state machine), `link_session` (a
//!    link's protocol state machine), `order` (stream ordering), `offload` (where blocking
//!    calls run), `versions` (versioned syncs: the sender's stamps, a receiver's staging);
//! 2. what the node and its links share: `link_ref` (a link's handle, and the messages
//!    its actor takes), `exports` (the ledger behind its mutex), `buffer`, `remote` (typed
//!    messages and their encoding), `relay` (forwarding's tables), `observed` (what the
//!    status reports besides them);
//! 3. the node's state and its links: `node_core` (`NodeCore`: what the node keeps, and
//!    every method the modules below its public API ask of it), `status`, `transport` (a
//!    Unix socket or a TCP host link behind one reader/writer/closer shape; the writer
//!    drains a link's queue in batches), `forwarding` (the calls that start a forward),
//!    `host_copies` (a host link's copies through the node's transfer engines, without
//!    the link actor), `link` (the
//!    [`PeerLink`] actor, which serves the node: the I/O shell of its `link_session`, by
//!    concept in `link/` — `outgoing` (queue, grants), `open` (opening offers),
//!    `copy` (buffers across hosts, as copies), `leases` (the lease protocol's other
//!    messages), `forward`, `closing`), `connect` (which makes links, Unix and TCP, and
//!    starts their actors);
//! 4. what the node's public API is made of: [`raw`], [`child`], [`metrics`] (their types,
//!    and helpers that take a `NodeCore`);
//! 5. the public API on top: `node` ([`Node`], a `NodeCore` with the public API: every
//!    inherent `impl Node` is in `node.rs` and `node/`, by concept — `connect`, `child`,
//!    `status`, `metrics`, `raw`; `tests/layers.rs` checks that none is elsewhere), `owner`
//!    ([`BufferOwner`]), [`supervisor`], `sync_receiver` ([`SyncReceiver`]), `polling`
//!    ([`ring_polling_system`]).
//!
//! The node is split in two because its links point both ways: each link actor holds the
//! node and calls back into it, so the node's state must sit below `link`, while
//! [`Node::connect`] and [`Node::listen`] start link actors, so they must sit above it.
//! The state (`NodeCore`) is below, the public `Node` above; a public method that a lower
//! module needs too is defined once, on `NodeCore`, and `Node`'s calls it in one line. No
//! module below `node` can name `Node`, so none holds one to call its methods: a method
//! call, the one use of a higher module that the checker cannot see, cannot reach `Node`
//! from below.
//!
//! Where types point both ways — the node keeps its links and each link actor calls back
//! into the node; lease guards, the exports and the node hold links — the lower side
//! holds a `LinkRef`, which reaches the link actor through an actix `Recipient` of its
//! mailbox without naming the actor.
//!
//! All actors of a node run on the actix system of the calling thread. Never block that
//! thread (a `std::process::Child::wait`, a sleep, a blocking receive): the node's links
//! stop moving while it is blocked — after [`Peer::close`], a blocked parent never lets
//! the close reach a child that waits for it, a deadlock. Await instead
//! ([`Peer::close_and_wait`], [`LinkedChild::wait`]).

#![deny(unsafe_code)]

// The modules, bottom layer first: each uses only the modules declared above it (see
// "Layers" in the crate docs; the workspace's `tests/layers.rs` checks it). One comment
// line per module keeps rustfmt from sorting them.

// 1. Pure state.
// Ids local to this process.
mod ids;
// Which path each lease took, counted, and the downgrade policy.
pub mod paths;
// The crate's error type.
mod error;
// The lease ledger: a state machine without I/O.
mod ledger;
// A link's protocol: a state machine without I/O.
mod link_session;
// Stream ordering of a buffer on either side of a handoff.
mod order;
// Where blocking backend calls run.
mod offload;
// Versioned syncs: the sender's stamps and the receiver's staging, without I/O.
mod versions;

// 2. What the node and its links share.
// A link as the rest of the crate holds it, and the messages its actor takes.
mod link_ref;
// The node's exported buffers: the ledger behind a mutex, and its actions.
mod exports;
// Buffers and leases on both sides of a handoff.
mod buffer;
// Many named tensors in one buffer.
mod bundle;
// Typed messages to actors in other processes, and their encoding.
mod remote;
// Forwarding's tables.
mod relay;
// What a node keeps for its status.
mod observed;

// 3. The node's state and its links.
// The node's state, and what its links and the modules below its API ask of it.
mod node_core;
// A node's status, as it answers it.
mod status;
// The two transports of a link (Unix socket, TCP host link) behind one shape.
mod transport;
// The calls that start a forward, and what a forward across hosts shares with its links.
mod forwarding;
// A host link's copies through the node's transfer engines, without the link actor.
mod host_copies;
// One actor per connection.
mod link;
// How a node gets its links.
mod connect;

// 4. What the node's public API is made of.
// Untyped calls and buffers.
pub mod raw;
// Child processes linked to their parent.
pub mod child;
// A node's status as metrics.
pub mod metrics;

// 5. The public API on top.
// This process in a deployment: every inherent `impl Node`.
mod node;
// The actor that allocates buffers.
mod owner;
// The process supervisor.
pub mod supervisor;
// Versioned syncs received: staged, then committed whole.
mod sync_receiver;
// Runtimes whose thread polls link rings before it parks.
mod polling;

pub use buffer::{Buffer, BufferMut, Element, Lease, LeaseMut, Shared, SharedMut};
pub use bundle::{Bundle, BundleLease, SharedBundle, copy_spans};
pub use child::{LinkedChild, PARENT_SOCKET_ENV};
pub use connect::{ACCEPT_BACKLOG, Listening, TcpListening, token_file_of};
pub use error::{ActorError, LinkEnd};
pub use exports::{BufferLeases, ForwardedLease, OwnerStats};
pub use ids::{BufferId, LinkId};
pub use ledger::RevokePolicy;
pub use link::PeerLink;
pub use link_ref::{CLOSE_FLUSH, Heartbeat, LinkLimits, LinkRings};
pub use metrics::MetricsPublisher;
pub use node::Node;
pub use node_core::{HostSettings, NodeConfig, Offered, Peer, PeerEvent, RevokeRequested};
pub use order::MAX_STREAMS;
pub use owner::{Allocate, AllocateAny, BufferOwner, LeaseTable, Revoke, Stats};
pub use paths::{ALLOW_DOWNGRADE_ENV, Downgrade, DowngradePolicy, LeasePath, PathDowngraded};
pub use polling::{ring_polling_runtime, ring_polling_system};
pub use raw::{AnyBuffer, AnyLease, AnyShared, RawCall, RawHandler, RawMessage, RawReply};
pub use remote::{Encoding, MSGPACK_SHARED_EXT, RemoteAddr, RemoteMessage};
pub use status::TREE_DEADLINE;
pub use supervisor::{
    ChildPeer, ChildRunning, ChildSpec, ChildStatus, Children, KillChild, ProcessSupervisor,
    RemoteChildSpec, Restart, RestartPolicy, Shutdown, Strategy, SupervisorEvent,
};
pub use sync_receiver::SyncReceiver;
pub use versions::{Staged, SyncProgress, SyncSender, SyncState};

pub use actix;
