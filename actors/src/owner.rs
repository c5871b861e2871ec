//! [`BufferOwner`]: the actor that owns exportable buffers and their lease table.

use crate::buffer::{Buffer, Element};
use crate::error::ActorError;
use crate::exports::{BufferCell, BufferLeases, Exports, OwnerStats};
use crate::ids::BufferId;
use crate::ledger::RevokePolicy;
use crate::node::Node;
use crate::offload::Offload;
use crate::raw::AnyBuffer;
use actix::prelude::*;
use baton_ipc::SharedBackend;
use baton_messages::{ActorId, Layout, Shape};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The actor that owns buffers: it allocates them through a backend, and the node's lease
/// ledger records every lease on each of them from the moment an offer is sent.
///
/// - Buffers are freed by dropping their last [`Buffer`] handle — but never while a live
///   process may map them: a buffer with leases out, or mapped warm by an importer, is
///   *retired* and freed once every lease is back and every importer answered `Unmap`
///   (or died).
/// - [`Revoke`] asks the holders of a buffer to give it back by a deadline; a holder that
///   does not is cut off (its link is shut down). Its leases stop counting — but where the
///   backend's free is unsafe while a live process maps the memory (CUDA legacy IPC) the
///   memory stays *quarantined* until that process is confirmed dead. A
///   [`RevokePolicy`] can escalate: SIGKILL a holder that is our supervised child.
/// - A peer's death reclaims all its leases at once.
///
/// The lease table lives in the node (see the crate docs), so it survives a restart of the
/// actor under actix's `Supervisor`.
#[derive(Debug)]
pub struct BufferOwner {
    id: ActorId,
    exports: Arc<Exports>,
    backend: SharedBackend,
    /// Where allocations run (they fill and synchronise: driver calls, for CUDA).
    offload: Offload,
    policy: RevokePolicy,
    span: tracing::Span,
}

impl BufferOwner {
    /// An owner that allocates with the node's backend.
    pub fn new(node: &Node) -> Self {
        Self::with_backend(node, Arc::clone(node.backend()))
    }

    /// An owner that allocates with another backend.
    pub fn with_backend(node: &Node, backend: SharedBackend) -> Self {
        let id = crate::ids::next_actor();
        Self {
            id,
            exports: Arc::clone(node.core().exports()),
            offload: node.core().offload(),
            span: tracing::info_span!("buffer_owner", actor = %id, backend = backend.name()),
            backend,
            policy: RevokePolicy::default(),
        }
    }

    /// With another policy for holders that keep a revoked lease past its deadline.
    pub fn revoke_policy(mut self, policy: RevokePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Its actor id (in handle messages' exporter identity).
    pub fn actor_id(&self) -> ActorId {
        self.id
    }
}

impl Actor for BufferOwner {
    type Context = Context<Self>;

    fn started(&mut self, _ctx: &mut Self::Context) {
        let _g = self.span.enter();
        tracing::debug!("started");
    }
}

impl Supervised for BufferOwner {
    fn restarting(&mut self, _ctx: &mut Self::Context) {
        let _g = self.span.enter();
        tracing::info!("restarting; the lease table is kept");
    }
}

/// Allocates a buffer of `T`s of a given shape. Replies with its [`Buffer`] handle.
#[derive(Debug)]
pub struct Allocate<T: Element> {
    shape: Shape,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> Allocate<T> {
    /// A buffer of this shape.
    pub fn new(shape: Shape) -> Self {
        Self {
            shape,
            _t: PhantomData,
        }
    }

    /// A buffer of `len` elements.
    pub fn vector(len: u64) -> Self {
        Self::new(Shape::vector(len))
    }
}

impl<T: Element> Message for Allocate<T> {
    type Result = Result<Buffer<T>, ActorError>;
}

impl<T: Element> Handler<Allocate<T>> for BufferOwner {
    type Result = ResponseFuture<Result<Buffer<T>, ActorError>>;

    /// Allocates on the node's driver thread when the backend's calls block (CUDA: the
    /// allocation is zero-filled and synchronised), inline otherwise.
    fn handle(&mut self, msg: Allocate<T>, _ctx: &mut Self::Context) -> Self::Result {
        let allocating = self.allocate(Layout::new(T::DTYPE, msg.shape));
        Box::pin(async move { Ok(Buffer::new(allocating.await?)) })
    }
}

impl BufferOwner {
    /// Allocates a buffer of `layout` (on the driver thread, see `Allocate`) and enters it
    /// in the ledger.
    fn allocate(
        &mut self,
        layout: Layout,
    ) -> impl Future<Output = Result<Arc<BufferCell>, ActorError>> + 'static + use<> {
        let bytes = layout.byte_len().and_then(|b| usize::try_from(b).ok());
        let backend = Arc::clone(&self.backend);
        let allocating = bytes.map(|bytes| self.offload.run(move || backend.allocate(bytes)));
        let (exports, backend, owner, policy, span) = (
            Arc::clone(&self.exports),
            Arc::clone(&self.backend),
            self.id,
            self.policy,
            self.span.clone(),
        );
        async move {
            let (Some(bytes), Some(allocating)) = (bytes, allocating) else {
                return Err(ActorError::OutOfBounds {
                    index: 0,
                    len: usize::MAX,
                    size: 0,
                });
            };
            let alloc = allocating.await??;
            let _g = span.enter();
            tracing::debug!(alloc = %alloc.id(), gen = %alloc.generation(), bytes, "allocated");
            Ok(exports.insert(alloc, backend, layout, owner, policy))
        }
    }
}

/// Allocates a buffer of any layout — element types without a Rust type (`F16`, `BF16`)
/// included — for code that handles buffers untyped (another language's bindings). Replies
/// with its [`AnyBuffer`] handle.
#[derive(Debug, Clone)]
pub struct AllocateAny {
    /// Element type and shape.
    pub layout: Layout,
}

impl Message for AllocateAny {
    type Result = Result<AnyBuffer, ActorError>;
}

impl Handler<AllocateAny> for BufferOwner {
    type Result = ResponseFuture<Result<AnyBuffer, ActorError>>;

    /// As [`Allocate`].
    fn handle(&mut self, msg: AllocateAny, _ctx: &mut Self::Context) -> Self::Result {
        let allocating = self.allocate(msg.layout);
        Box::pin(async move { Ok(AnyBuffer::new(allocating.await?)) })
    }
}

/// Asks every holder of a buffer to release it within a deadline. Replies with how many
/// leases were asked back. Holders still holding at the deadline are cut off.
#[derive(Debug, Clone, Copy)]
pub struct Revoke {
    /// The buffer.
    pub buffer: BufferId,
    /// How long holders have.
    pub within: Duration,
}

impl Message for Revoke {
    type Result = Result<usize, ActorError>;
}

impl Handler<Revoke> for BufferOwner {
    type Result = Result<usize, ActorError>;

    fn handle(&mut self, msg: Revoke, ctx: &mut Self::Context) -> Self::Result {
        let _g = self.span.enter();
        let asked = self
            .exports
            .revoke(self.id, msg.buffer, Instant::now() + msg.within)?;
        if asked > 0 {
            // The ledger cuts whoever is still holding when the deadline has passed.
            ctx.run_later(msg.within, |act, _| act.exports.tick(Instant::now()));
        }
        Ok(asked)
    }
}

/// Replies with the owner's lease table: each buffer alive, its leases and holders.
#[derive(Debug, Clone, Copy)]
pub struct LeaseTable;

impl Message for LeaseTable {
    type Result = Vec<BufferLeases>;
}

impl Handler<LeaseTable> for BufferOwner {
    type Result = MessageResult<LeaseTable>;

    fn handle(&mut self, _: LeaseTable, _ctx: &mut Self::Context) -> Self::Result {
        MessageResult(self.exports.table(Some(self.id)))
    }
}

/// Replies with the owner's counters.
#[derive(Debug, Clone, Copy)]
pub struct Stats;

impl Message for Stats {
    type Result = OwnerStats;
}

impl Handler<Stats> for BufferOwner {
    type Result = MessageResult<Stats>;

    fn handle(&mut self, _: Stats, _ctx: &mut Self::Context) -> Self::Result {
        MessageResult(self.exports.stats(Some(self.id)))
    }
}
