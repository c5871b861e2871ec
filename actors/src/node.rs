//! [`Node`]: this process in a Baton deployment — its session, backend, import cache,
//! links, and the actors other processes can reach by name.
//!
//! Every inherent `impl Node` is in this module tree (`tests/layers.rs` checks it), by
//! concept: this file has the node's making, its buffers, registrations and links;
//! `node/connect.rs` how it links ([`Node::connect`], [`Node::listen`], [`Node::local`],
//! over TCP [`Node::connect_tcp`], [`Node::listen_tcp`]); `node/child.rs` child processes
//! ([`Node::spawn_child`], [`Node::join`], [`Node::root`]); `node/status.rs` its status
//! ([`Node::status`], [`Node::tree_status`], [`Node::path_counts`]); `node/metrics.rs`
//! [`Node::publish_metrics`]; `node/raw.rs` [`Node::register_raw`].
//!
//! `Node` is a [`NodeCore`] (`node_core.rs`) with the public API on top. The node's state
//! has to sit below `link` — each link actor holds the node and calls back into it — while
//! making links has to sit above it: `connect` starts the link actors. So the state and
//! whatever the lower modules ask of it are `NodeCore`'s, low in the layers; `Node` sits
//! above `status`, `link`, `connect`, `raw`, `child` and `metrics`, whose types
//! ([`Listening`](crate::Listening), [`LinkedChild`](crate::LinkedChild), …) and helpers
//! (taking a `&NodeCore`) its methods use. A public method that a lower module needs too
//! (`session`, `backend`, `peers`, …), or that changes the node's tables (registrations,
//! watchers, the inbox: `NodeInner`'s fields are private to `node_core.rs`), has its body
//! on `NodeCore`, and `Node`'s is one line that calls it; every other body is in this
//! tree. No module below this one can name `Node`, so none calls its methods.

mod child;
mod connect;
mod metrics;
mod raw;
mod status;

use crate::buffer::{Buffer, Element};
use crate::error::ActorError;
use crate::exports::{BufferLeases, OwnerStats};
use crate::ledger::RevokePolicy;
use crate::node_core::{NodeConfig, NodeCore, Offered, Peer, PeerEvent, RevokeRequested};
use crate::paths::{Downgrade, LeasePath, PathDowngraded};
use crate::remote::{Registered, RemoteMessage};
use actix::prelude::*;
use baton_ipc::{ImportCache, Session, SharedBackend};
use baton_messages::{Layout, ProcessId, Shape};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// This process in a deployment (see the [crate docs](crate)). Cheap to clone.
#[derive(Clone)]
pub struct Node {
    core: NodeCore,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("process", &self.session().process())
            .field("backend", &self.core.backend().name())
            .field("links", &self.core.link_count())
            .finish()
    }
}

impl Node {
    /// The node's state, for the modules above the node tree that need more of it than
    /// the public API (the owners' exports and driver thread, the supervisors' handlers).
    pub(crate) fn core(&self) -> &NodeCore {
        &self.core
    }

    /// A node that allocates with `backend` and links with same-uid peers holding the
    /// session's token. It opens handles of `backend`'s kind and host handles.
    pub fn new(session: Session, backend: SharedBackend) -> Node {
        Self::with_config(NodeConfig::new(session), backend)
    }

    /// A node with its own configuration (a [`NodeConfig`], or just a [`LinkConfig`]).
    ///
    /// [`LinkConfig`]: baton_ipc::LinkConfig
    pub fn with_config(config: impl Into<NodeConfig>, backend: SharedBackend) -> Node {
        Node {
            core: NodeCore::new(config.into(), backend),
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
    /// [`baton_ipc::Error::NoToken`] without a token; a backend error.
    pub fn from_env() -> Result<Node, ActorError> {
        Ok(Self::new(Session::from_env()?, baton_ipc::select::auto()?))
    }

    /// The session.
    pub fn session(&self) -> &Session {
        self.core.session()
    }

    /// The node's configuration.
    pub fn config(&self) -> &NodeConfig {
        self.core.config()
    }

    /// Every buffer this node's owners export, with its leases and holders (all owners;
    /// [`LeaseTable`](crate::LeaseTable) gives one owner's).
    pub fn lease_table(&self) -> Vec<BufferLeases> {
        self.core.exports().table(None)
    }

    /// Allocations whose free is held until a producer dies — our waits on its release
    /// fences were released while it lived (it was cut, or missed the fence deadline), so
    /// its work may still use the memory — and their bytes.
    pub fn held_frees(&self) -> (usize, u64) {
        self.core.exports().held_frees()
    }

    /// Waits, at most `within`, until the fences this node's backend recorded for peers
    /// have been written (see [`baton_ipc::StreamOrdering::flush_fences`]): call it before a
    /// process exits, so that peers need not wait out their fence deadline. Blocks the
    /// calling thread. Returns whether they all were.
    pub fn flush_fences(&self, within: Duration) -> bool {
        match self.core.backend().ordering().flush_fences(within) {
            Ok(done) => done,
            Err(e) => {
                tracing::warn!(error = %e, "flushing fences failed");
                false
            }
        }
    }

    /// Counters of every buffer this node's owners export.
    pub fn export_stats(&self) -> OwnerStats {
        self.core.exports().stats(None)
    }

    /// Allocates a buffer of `len` `T`s with the node's backend, as a plain call: no
    /// actor, no mailbox round trip. The node owns it (its exporter identity is the node's
    /// own actor id) and its ledger records its leases like those of a
    /// [`BufferOwner`](crate::BufferOwner)'s buffers; it is freed when its last handle drops
    /// and no live process may map it. The memory is zeroed.
    ///
    /// The allocation runs on the calling thread. On host memory that is an `mmap` (and a
    /// `memfd_create`): microseconds. On CUDA it is a driver allocation, a zero fill and a
    /// synchronisation — it may block for milliseconds: inside an actor that must stay
    /// responsive, send [`Allocate`](crate::Allocate) to a `BufferOwner` instead, which
    /// runs it on the node's driver thread. To revoke a node-owned buffer's leases, use a
    /// `BufferOwner`'s buffers ([`Revoke`](crate::Revoke)).
    ///
    /// # Errors
    /// [`ActorError::OutOfBounds`] if `len` elements do not fit the address space; a
    /// backend error (out of memory, a zero length, …).
    pub fn allocate<T: Element>(&self, len: usize) -> Result<Buffer<T>, ActorError> {
        self.allocate_shape(Shape::vector(len as u64))
    }

    /// A [`Bundle`](crate::Bundle): one buffer holding every tensor of `layout` (see
    /// [`BundleLayout::packed`](baton_messages::BundleLayout::packed)), zeroed as
    /// [`allocate`](Self::allocate)'s buffers are. On a CUDA node it is VMM memory,
    /// whatever the backend's export
    /// ([`CudaBackend::bulk_export`](baton_ipc::cuda::CudaBackend::bulk_export)): an
    /// importer reads a VMM import as fast as its own memory, a legacy IPC import about
    /// 25 % slower. On a device that cannot share VMM memory the backend's own export is
    /// a downgrade ([`Downgrade::BundleWithoutVmm`]), taken only where the node's
    /// [`DowngradePolicy`] allows it.
    ///
    /// # Errors
    /// As `allocate`; [`ActorError::PathDowngrade`] on a device without VMM sharing
    /// unless downgrades are allowed.
    ///
    /// [`DowngradePolicy`]: crate::DowngradePolicy
    pub fn allocate_bundle(
        &self,
        layout: baton_messages::BundleLayout,
    ) -> Result<crate::Bundle, ActorError> {
        // At least a byte: a bundle of empty tensors is still one allocation.
        let bytes =
            usize::try_from(layout.byte_len().max(1)).map_err(|_| ActorError::OutOfBounds {
                index: 0,
                len: usize::MAX,
                size: 0,
            })?;
        let backend = Arc::clone(self.core.backend());
        let alloc = match backend.cuda() {
            // Read whole by importers: VMM where the device has it (see `bulk_export`);
            // the backend's own export elsewhere is a downgrade, taken only if allowed.
            Some(cuda) => {
                let export = cuda.bulk_export();
                if export != baton_ipc::cuda::CudaExport::Vmm {
                    self.core.downgrade(PathDowngraded {
                        kind: Downgrade::BundleWithoutVmm,
                        wanted: LeasePath::CudaVmm { peer_gpu: false },
                        taken: LeasePath::exported_by(&*backend),
                        peer: None,
                    })?;
                }
                cuda.allocate_as(export, bytes)?
            }
            None => backend.allocate(bytes)?,
        };
        tracing::debug!(alloc = %alloc.id(), bytes, "allocated a bundle (node)");
        let buffer = Buffer::new(self.core.exports().insert(
            alloc,
            Arc::clone(&backend),
            Layout::new(u8::DTYPE, Shape::vector(bytes as u64)),
            self.core.owner(),
            RevokePolicy::default(),
        ));
        Ok(crate::Bundle::new(buffer, layout))
    }

    /// A bundle over device memory this process allocated outside Baton — a model's
    /// parameters from PyTorch's caching allocator, say —, leased and sent as
    /// [`allocate_bundle`](Self::allocate_bundle)'s are, without a copy. `base` is the
    /// base of one CUDA allocation (`CudaBackend::address_range` of a tensor's address);
    /// `layout` names tensors at their offsets from `base`. The whole allocation is
    /// shared (legacy IPC maps whole allocations): a peer a lease of it goes to can reach
    /// all of it, not only the tensors named. When Baton is done with it — no handle,
    /// lease or mapping left, no work pending — it drops `keep`, and frees nothing.
    ///
    /// # Safety
    /// As [`CudaBackend::borrow`](baton_ipc::cuda::CudaBackend::borrow): `keep` keeps the
    /// allocation allocated until it drops, and nothing frees it meanwhile.
    ///
    /// # Errors
    /// [`ActorError::Ipc`] with `NotBorrowable` (see `CudaBackend::borrow`; also a node
    /// whose backend is not CUDA); [`ActorError::BundleTooLarge`] for a layout past the
    /// allocation's end (then `keep` is dropped at once).
    #[allow(
        unsafe_code,
        reason = "the one contract Baton cannot check: who keeps borrowed memory allocated"
    )]
    pub unsafe fn borrow_bundle(
        &self,
        base: u64,
        keep: Box<dyn Send + Sync>,
        layout: baton_messages::BundleLayout,
    ) -> Result<crate::Bundle, ActorError> {
        let backend = Arc::clone(self.core.backend());
        let cuda = backend
            .cuda()
            .ok_or_else(|| baton_ipc::Error::NotBorrowable {
                ptr: base,
                reason: format!("this node's backend is {}, not CUDA", backend.name()),
            })?;
        let needs = layout.byte_len();
        let (_, size) = cuda.address_range(base)?;
        if needs > size as u64 {
            return Err(ActorError::BundleTooLarge {
                needs,
                len: size as u64,
            });
        }
        // SAFETY: the caller's promise, passed on.
        let alloc = unsafe { cuda.borrow(base, keep) }?;
        tracing::debug!(alloc = %alloc.id(), bytes = size, "borrowed (node)");
        let buffer = Buffer::new(self.core.exports().insert(
            alloc,
            Arc::clone(&backend),
            Layout::new(u8::DTYPE, Shape::vector(size as u64)),
            self.core.owner(),
            RevokePolicy::default(),
        ));
        Ok(crate::Bundle::new(buffer, layout))
    }

    /// [`allocate`](Self::allocate) with a shape.
    ///
    /// # Errors
    /// As `allocate`.
    pub fn allocate_shape<T: Element>(&self, shape: Shape) -> Result<Buffer<T>, ActorError> {
        Ok(Buffer::new(
            self.core.allocate_layout(Layout::new(T::DTYPE, shape))?,
        ))
    }

    /// The backend buffers are allocated with.
    pub fn backend(&self) -> &SharedBackend {
        self.core.backend()
    }

    /// The import cache.
    pub fn cache(&self) -> &ImportCache {
        self.core.cache()
    }

    /// Makes the actor registered as `name` reachable from other processes, for messages
    /// of type `M`.
    ///
    /// One name serves every message type registered under it: an actor that handles
    /// several types is registered once per type, under the same name, and each call goes
    /// to the registration of its type ([`RemoteMessage::NAME`]).
    /// Registering a type again under the same name replaces that type's registration
    /// only. A call of a type the name does not serve is refused with
    /// [`CallFault::WrongType`], which
    /// lists the types it does.
    ///
    /// ```no_run
    /// # use actix::prelude::*;
    /// # use baton_actors::{Node, RemoteMessage};
    /// # #[derive(serde::Serialize, serde::Deserialize, Message)] #[rtype(result = "u32")] struct Get;
    /// # impl RemoteMessage for Get { const NAME: &'static str = "doc.Get"; }
    /// # #[derive(serde::Serialize, serde::Deserialize, Message)] #[rtype(result = "()")] struct Set(u32);
    /// # impl RemoteMessage for Set { const NAME: &'static str = "doc.Set"; }
    /// # struct Cell(u32);
    /// # impl Actor for Cell { type Context = Context<Self>; }
    /// # impl Handler<Get> for Cell { type Result = u32; fn handle(&mut self, _: Get, _: &mut Context<Self>) -> u32 { self.0 } }
    /// # impl Handler<Set> for Cell { type Result = (); fn handle(&mut self, m: Set, _: &mut Context<Self>) { self.0 = m.0 } }
    /// # fn run(node: &Node) {
    /// let cell = Cell(0).start();
    /// node.register::<Get>("cell", cell.clone().recipient());
    /// node.register::<Set>("cell", cell.recipient()); // both types reach the same actor
    /// # }
    /// ```
    ///
    /// [`CallFault::WrongType`]: baton_messages::protocol::CallFault::WrongType
    pub fn register<M>(&self, name: &str, recipient: Recipient<M>)
    where
        M: RemoteMessage,
        M::Result: Serialize + DeserializeOwned + Send,
    {
        self.core
            .insert_handler(name, Arc::new(Registered { recipient }));
    }

    /// Removes every registration of `name` (of every type).
    pub fn unregister(&self, name: &str) {
        self.core.unregister(name)
    }

    /// Removes the registration of `name` for the wire type `type_name` only; the name
    /// keeps serving its other types.
    pub fn unregister_type(&self, name: &str, type_name: &str) {
        self.core.unregister_type(name, type_name)
    }

    /// Tells `recipient` about every link that comes up, goes down or is refused.
    pub fn subscribe(&self, recipient: Recipient<PeerEvent>) {
        self.core.subscribe(recipient)
    }

    /// Tells `recipient` when an exporter asks for a lease back; a cooperative holder drops
    /// the lease in time. The actor that holds a lease can instead await that lease's own
    /// [`Lease::revoked`](crate::Lease::revoked), with no lease ids to map.
    pub fn on_revoke(&self, recipient: Recipient<RevokeRequested>) {
        self.core.on_revoke(recipient)
    }

    /// Tells `recipient` of every downgrade to a slower path this node takes (its
    /// [`DowngradePolicy`] allowing it; see [`paths`](crate::paths)).
    ///
    /// [`DowngradePolicy`]: crate::DowngradePolicy
    pub fn on_downgrade(&self, recipient: Recipient<PathDowngraded>) {
        self.core.on_downgrade(recipient)
    }

    /// Where bare offers go; without an inbox they are released at once, and so is an
    /// offer without an element type and shape.
    pub fn set_inbox(&self, recipient: Recipient<Offered>) {
        self.core.set_inbox(recipient)
    }

    /// The links up now.
    pub fn peers(&self) -> Vec<Peer> {
        self.core.peers()
    }

    /// The link to a process, if one is up.
    pub fn peer(&self, process: &ProcessId) -> Option<Peer> {
        self.core.peer(process)
    }

    /// Cuts every link to `process` (for instance, one whose stopping a supervisor
    /// decided). Its leases stop counting; its memory is freed once the ledger allows.
    pub fn disconnect(&self, process: &ProcessId) {
        self.core.disconnect(process)
    }

    /// `process` is dead (its pidfd said so, or its supervisor reaped it). Its links end:
    /// each reads what the process sent before it died, then ends at end of stream — or
    /// is cut at once if a descendant inherited its socket. Once no link to it is left,
    /// the ledger learns that nothing it held can be mapped there any more, and frees what
    /// waited for it (a quarantine, an `Unmapped` it never sent).
    pub fn process_exited(&self, process: ProcessId) {
        self.core.process_exited(process)
    }
}
