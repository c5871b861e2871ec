//! Untyped messages and buffers, for peers that do not share Rust types: another
//! language's bindings (Baton's Python package is built on this), a proxy, a recorder.
//!
//! A typed [`RemoteMessage`](crate::RemoteMessage) is encoded and decoded by Baton; a
//! *raw* message is the encoded bytes and the buffers beside them, as they travel:
//!
//! - [`Node::register_raw`] registers a [`RawHandler`] under a name, for calls of one wire
//!   type name. It receives each call's payload bytes and its buffers as unopened
//!   [`AnyShared`]s (the leases exist already: dropping one releases it), and answers with
//!   a [`RawMessage`] of its own — whose buffers are leased to the caller, as a typed
//!   reply's would be.
//! - [`Peer::call_raw`] sends a call of any wire type name with payload bytes and
//!   buffers ([`AnyBuffer::share`]), and returns the reply undecoded.
//!
//! The lease protocol is the same one, run by the same links: every check (the type name
//! the handler registered, the peer's offers, the limits) and every guarantee (leases
//! counted from the offer, released on drop, reclaimed when a process dies, orphaned when
//! the exporter does) holds for raw messages too. Only the payload is left to the caller:
//! it must be encoded the way the receiver decodes it — for a Rust receiver, its message
//! type's [`Encoding`](crate::Encoding); a buffer field under
//! [`Encoding::MessagePack`](crate::Encoding::MessagePack) is the extension
//! [`MSGPACK_SHARED_EXT`](crate::MSGPACK_SHARED_EXT) holding the buffer's index in
//! [`RawMessage::buffers`].
//!
//! Byte offsets and lengths: the raw accessors count bytes, so an
//! [`ActorError::OutOfBounds`] they return counts bytes too.
//!
//! Stream ordering is the typed handles' (see `docs/ORDERING.md`): host copies
//! ([`AnyBuffer::read`], [`AnyLease::write`], …) are ordered and complete when they
//! return; work on a device pointer is ordered with [`AnyLease::wait_on`] and
//! [`AnyBuffer::wait_on`] / [`AnyBuffer::share_on`].
//!
//! `Node::register_raw` is `Node`'s, in `node/raw.rs`; this module, below the node tree,
//! has the raw types and the handler it registers.
//!
//! [`Node::register_raw`]: crate::Node::register_raw

use crate::buffer::{IncomingLease, IncomingLeases, Outgoing, Shared, SharedInner};
use crate::error::ActorError;
use crate::exports::BufferCell;
use crate::node_core::Peer;
use crate::order::ExportOrder;
use crate::remote::{Answer, Encoded, ErasedHandler, call_encoded};
use crate::{Buffer, Element};
use baton_ipc::cuda::CudaBackend;
use baton_ipc::{Allocation, Stream};
use baton_messages::protocol::CallFault;
use baton_messages::{Layout, LeaseId, ProcessId};
use futures_util::FutureExt as _;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;

/// The stream orders of `buffers`, each once (buffers of one allocation share one).
fn orders_of<'a>(buffers: impl IntoIterator<Item = &'a AnyBuffer>) -> Vec<&'a ExportOrder> {
    let mut seen = std::collections::HashSet::new();
    buffers
        .into_iter()
        .map(|b| &*b.cell.order)
        .filter(|o| seen.insert(std::ptr::from_ref(*o)))
        .collect()
}

fn check_bytes(offset: usize, len: usize, size: usize) -> Result<(), ActorError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(ActorError::OutOfBounds {
            index: offset,
            len,
            size,
        }),
    }
}

/// The exporter's handle to a buffer of any element type: the untyped twin of
/// [`Buffer<T>`]. Cheap to clone; the buffer is freed when the last clone (typed or not)
/// drops and no live process may map it.
#[derive(Clone)]
pub struct AnyBuffer {
    cell: Arc<BufferCell>,
}

impl fmt::Debug for AnyBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyBuffer")
            .field("id", &self.cell.id)
            .field("alloc", &self.cell.alloc.id())
            .field("layout", &self.cell.layout)
            .finish()
    }
}

impl<T: Element> From<Buffer<T>> for AnyBuffer {
    fn from(buffer: Buffer<T>) -> Self {
        Self { cell: buffer.cell }
    }
}

impl AnyBuffer {
    crate::buffer::buffer_accessors!(use<>);

    pub(crate) fn new(cell: Arc<BufferCell>) -> Self {
        Self { cell }
    }

    /// Its element type and shape.
    pub fn layout(&self) -> &Layout {
        &self.cell.layout
    }

    /// Bytes in the buffer (its layout's; the allocation may be rounded up).
    pub fn byte_len(&self) -> usize {
        self.cell
            .layout
            .byte_len()
            .and_then(|b| usize::try_from(b).ok())
            .unwrap_or(0)
    }

    /// The backend allocation, for backend-specific work.
    pub fn allocation(&self) -> &Allocation {
        &self.cell.alloc
    }

    /// Copies bytes out of the buffer, starting `offset` bytes in, after the work of
    /// importers that gave the buffer back and the buffer's uses on streams (as
    /// [`Buffer::read_into`]).
    ///
    /// # Errors
    /// [`ActorError::OutOfBounds`] (in bytes), or a backend error.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), ActorError> {
        check_bytes(offset, dst.len(), self.byte_len())?;
        self.cell.order.before_host_copy()?;
        Ok(self.cell.alloc.read(offset, dst)?)
    }

    /// Copies bytes into the buffer, starting `offset` bytes in (as
    /// [`Buffer::write_at`]: refused while leases on the buffer are out).
    ///
    /// # Errors
    /// [`ActorError::BufferLeased`]; [`ActorError::OutOfBounds`] (in bytes), or a backend
    /// error.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), ActorError> {
        self.cell.check_unleased()?;
        check_bytes(offset, src.len(), self.byte_len())?;
        self.cell.order.before_host_copy()?;
        Ok(self.cell.alloc.write(offset, src)?)
    }

    /// Like [`share`](Self::share), after the work queued on `stream` so far (as
    /// [`Buffer::share_on`]).
    ///
    /// # Errors
    /// A backend error; [`ActorError::TooManyStreams`].
    pub fn share_on(&self, stream: impl Into<Stream>) -> Result<AnyShared, ActorError> {
        let stream = stream.into();
        self.cell.order.mark_on(stream.as_ref())?;
        Ok(self.share())
    }

    /// [`wait_on`](Self::wait_on) for several buffers: the work queued on `stream` from
    /// now on waits for the release fences of all of them, each waited for once — a lease
    /// over several buffers comes back with one fence, which each buffer holds — and for
    /// their uses on other streams. Record the end of your work with
    /// [`share_all_on`](Self::share_all_on) (or each buffer's `share_on`).
    ///
    /// # Errors
    /// As [`wait_on`](Self::wait_on); on an error no buffer's fences are lost (the next
    /// use waits for them).
    pub fn wait_all_on<'a>(
        buffers: impl IntoIterator<Item = &'a AnyBuffer>,
        stream: impl Into<Stream>,
    ) -> Result<(), ActorError> {
        let stream = stream.into();
        let orders = orders_of(buffers);
        ExportOrder::wait_all_on(&orders, stream.as_ref())
    }

    /// Records on `stream` what [`share_on`](Self::share_on) records for each buffer,
    /// once for all of them: `stream` waits once for their release fences, and one mark
    /// after everything queued there so far stands for every buffer's uses on it. Offers
    /// of them made since ([`share`](Self::share) each, as a lease over all of them with
    /// [`AnyShared::lease_with_previous`]) then carry one acquire fence for the whole
    /// lease, not one per buffer. [`share_all_on`](Self::share_all_on) is this and the
    /// shares; this is for a caller that makes the shares itself (Python's encoder).
    ///
    /// # Errors
    /// As [`share_on`](Self::share_on).
    pub fn mark_all_on<'a>(
        buffers: impl IntoIterator<Item = &'a AnyBuffer>,
        stream: impl Into<Stream>,
    ) -> Result<(), ActorError> {
        let stream = stream.into();
        let orders = orders_of(buffers);
        ExportOrder::mark_all_on(&orders, stream.as_ref())
    }

    /// Shares `buffers` as **one lease over all of them** (the first, then each
    /// [`lease_with_previous`](AnyShared::lease_with_previous)), after the work queued on
    /// `stream` so far — [`share_on`](Self::share_on) of each, with one fence wait, one
    /// mark record and one acquire fence for the whole lease (see
    /// [`mark_all_on`](Self::mark_all_on)). `writable`: each as
    /// [`share_mut`](Self::share_mut). Put them in the message in this order.
    ///
    /// # Errors
    /// As [`share_on`](Self::share_on).
    pub fn share_all_on(
        buffers: &[AnyBuffer],
        stream: impl Into<Stream>,
        writable: bool,
    ) -> Result<Vec<AnyShared>, ActorError> {
        Self::mark_all_on(buffers, stream)?;
        Ok(buffers
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let shared = if writable { b.share_mut() } else { b.share() };
                if i == 0 {
                    shared
                } else {
                    shared.lease_with_previous()
                }
            })
            .collect())
    }

    /// A handle to put in a [`RawMessage`]: sending it grants the receiver a lease. The
    /// offer carries an acquire fence after the buffer's uses on streams, if it had any.
    pub fn share(&self) -> AnyShared {
        AnyShared {
            inner: SharedInner::Local(Outgoing {
                cell: Arc::clone(&self.cell),
                fence: None,
                writable: false,
                part: None,
                joins: false,
            }),
        }
    }

    /// A handle that grants its receiver a *writable* lease, as
    /// [`Buffer::share_mut`]: sending it fails with [`ActorError::LeaseConflict`] while any
    /// other lease on the buffer is out, and while it is out no other lease is granted.
    /// The raw API does not tell the receiver: a receiver in Python or on the raw API
    /// opens it writable when it asks to (`AnyLease::write`).
    pub fn share_mut(&self) -> AnyShared {
        let mut shared = self.share();
        if let SharedInner::Local(out) = &mut shared.inner {
            out.writable = true;
        }
        shared
    }

    /// [`share_mut`](Self::share_mut), after the work queued on `stream` so far (as
    /// [`share_on`](Self::share_on)).
    ///
    /// # Errors
    /// As [`share_on`](Self::share_on).
    pub fn share_mut_on(&self, stream: impl Into<Stream>) -> Result<AnyShared, ActorError> {
        let stream = stream.into();
        self.cell.order.mark_on(stream.as_ref())?;
        Ok(self.share_mut())
    }

    /// The typed handle, if `T` is its element type.
    ///
    /// # Errors
    /// [`ActorError::WrongElementType`].
    pub fn typed<T: Element>(&self) -> Result<Buffer<T>, ActorError> {
        if self.cell.layout.dtype != T::DTYPE {
            return Err(ActorError::WrongElementType {
                expected: T::DTYPE,
                got: Some(self.cell.layout.dtype),
            });
        }
        Ok(Buffer::new(Arc::clone(&self.cell)))
    }
}

/// A buffer of any element type in a [`RawMessage`]: about to be sent (from
/// [`AnyBuffer::share`]) or received (an unopened lease; dropping it releases the lease).
pub struct AnyShared {
    inner: SharedInner,
}

impl fmt::Debug for AnyShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            SharedInner::Local(out) => write!(f, "AnyShared(local {:?})", out.cell.id),
            SharedInner::Incoming(l) => write!(f, "AnyShared(received {:?})", l.lease),
        }
    }
}

impl<T: Element> From<Shared<T>> for AnyShared {
    fn from(shared: Shared<T>) -> Self {
        Self {
            inner: shared.inner,
        }
    }
}

impl AnyShared {
    fn incoming(lease: Box<IncomingLease>) -> Self {
        Self {
            inner: SharedInner::Incoming(lease),
        }
    }

    /// Leases this buffer, when the message is sent, as a part of the lease of the buffer
    /// before it in the message (and so on back, over every buffer so marked): the
    /// receiver holds **one lease over several buffers**. Each part is still opened and
    /// viewed on its own, but the lease goes back — one `Release`, every part's buffer
    /// then free of it — only once every part's guard has dropped, and a revoke of any
    /// part asks for them all. It costs the peer one lease (and its frames) where it
    /// held one per buffer: what a model lent as many allocations needs
    /// (`Node.borrow_tensors` in Python). No effect on the message's first buffer, on a
    /// received buffer, or over a link to another host (each buffer crosses as its own
    /// copy there).
    pub fn lease_with_previous(mut self) -> Self {
        if let SharedInner::Local(out) = &mut self.inner {
            out.joins = true;
        }
        self
    }

    /// Whether this is a received buffer (as opposed to one about to be sent).
    pub fn is_received(&self) -> bool {
        matches!(self.inner, SharedInner::Incoming(_))
    }

    /// Its element type and shape; `None` for a received buffer its exporter offered
    /// untyped.
    pub fn layout(&self) -> Option<&Layout> {
        match &self.inner {
            SharedInner::Local(out) => Some(out.layout()),
            SharedInner::Incoming(l) => l.imported().layout(),
        }
    }

    /// The lease id of a received buffer.
    pub fn lease_id(&self) -> Option<LeaseId> {
        match &self.inner {
            SharedInner::Local(_) => None,
            SharedInner::Incoming(l) => Some(l.lease),
        }
    }

    /// Opens a received buffer as an untyped lease.
    ///
    /// # Errors
    /// [`ActorError::NotReceived`] for a buffer that was not received.
    pub fn open(self) -> Result<AnyLease, ActorError> {
        match self.inner {
            SharedInner::Incoming(inner) => Ok(AnyLease { inner }),
            SharedInner::Local(_) => Err(ActorError::NotReceived),
        }
    }

    /// The typed handle, if `T` is its element type.
    ///
    /// # Errors
    /// [`ActorError::WrongElementType`] (the buffer is dropped: a received one is
    /// released).
    pub fn typed<T: Element>(self) -> Result<Shared<T>, ActorError> {
        let got = self.layout().map(|l| l.dtype);
        if got != Some(T::DTYPE) {
            return Err(ActorError::WrongElementType {
                expected: T::DTYPE,
                got,
            });
        }
        Ok(Shared {
            inner: self.inner,
            _t: PhantomData,
        })
    }
}

/// An importer's guard on another process's buffer, of any element type: the untyped twin
/// of [`Lease<T>`](crate::Lease). Dropping it unmaps (drops its import-cache reference)
/// and then sends `Release`, without blocking. If the exporter dies, the lease is
/// orphaned: its accessors return [`ActorError::Orphaned`].
pub struct AnyLease {
    /// Boxed, as [`Lease`](crate::Lease)'s.
    inner: Box<IncomingLease>,
}

impl<T: Element> From<crate::Lease<T>> for AnyLease {
    fn from(lease: crate::Lease<T>) -> Self {
        Self {
            inner: lease.into_inner(),
        }
    }
}

impl fmt::Debug for AnyLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AnyLease").field(&self.inner).finish()
    }
}

impl AnyLease {
    crate::buffer::lease_accessors!(use<>);

    /// Gives `leases` back once every use of them on the device has completed: each CUDA
    /// context they are mapped in is synchronised once (`cuCtxSynchronize`, after the work
    /// of every stream of the process on the device), so their `Release`s carry no release
    /// fence and their exporters have nothing to wait for before the next grant. What a
    /// holder that does not keep its streams does — Python's leases opened without a
    /// stream — with one host wait for many leases. Other leases (host memory, a backend
    /// without CUDA contexts) go back as dropped.
    ///
    /// The wait is on this process's own work; work that waits on a peer's fence is
    /// released within the fence deadline if that peer dies (see `docs/ORDERING.md`).
    ///
    /// # Errors
    /// A synchronisation that failed: every lease still goes back, those of that context
    /// with their release fences, as when dropped.
    pub fn release_synchronized(leases: Vec<AnyLease>) -> Result<(), ActorError> {
        let backends: Vec<_> = leases
            .iter()
            .map(|l| l.inner.imported().backend().clone())
            .collect();
        // The backends whose context was synchronised (one per context).
        let mut synced: Vec<&CudaBackend> = Vec::new();
        let same = |a: &CudaBackend, b: &CudaBackend| Arc::ptr_eq(a.context(), b.context());
        let mut failed = None;
        for cuda in backends.iter().filter_map(|b| b.cuda()) {
            if synced.iter().any(|c| same(c, cuda)) {
                continue;
            }
            match cuda.synchronize_context() {
                Ok(()) => synced.push(cuda),
                Err(e) => failed = Some(e),
            }
        }
        for (mut lease, backend) in leases.into_iter().zip(&backends) {
            // Only a synchronised context's leases are settled; any other goes back as
            // dropped (host memory has no uses to fence).
            if backend
                .cuda()
                .is_some_and(|cuda| synced.iter().any(|c| same(c, cuda)))
            {
                lease.inner.order.settle();
            }
            drop(lease);
        }
        failed.map_or(Ok(()), |e| Err(e.into()))
    }

    /// Element type and shape; `None` if the exporter offered it untyped.
    pub fn layout(&self) -> Option<&Layout> {
        self.inner.imported().layout()
    }

    /// Bytes in the buffer.
    pub fn byte_len(&self) -> usize {
        self.inner.imported().len()
    }

    /// Copies bytes out of the buffer, starting `offset` bytes in (on the backend's own
    /// stream, after the exporter's work that produced the buffer; done when it returns).
    ///
    /// # Errors
    /// [`ActorError::Orphaned`], [`ActorError::OutOfBounds`] (in bytes), or a backend error.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), ActorError> {
        let imported = self.inner.live()?;
        check_bytes(offset, dst.len(), imported.len())?;
        self.inner.order.before_host_copy()?;
        Ok(imported.read(offset, dst)?)
    }

    /// Copies bytes into the buffer, starting `offset` bytes in (the exporter sees them:
    /// same memory).
    ///
    /// # Errors
    /// As [`read`](Self::read).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), ActorError> {
        let imported = self.inner.live()?;
        check_bytes(offset, src.len(), imported.len())?;
        self.inner.order.before_host_copy()?;
        Ok(imported.write(offset, src)?)
    }
}

/// A message as it travels: encoded bytes, and the buffers they refer to (by index).
#[derive(Debug, Default)]
pub struct RawMessage {
    /// The encoded value.
    pub bytes: Vec<u8>,
    /// Its buffers. Outgoing: [`AnyBuffer::share`]s, each leased to the receiver when the
    /// message is sent (a received buffer cannot be forwarded: [`ActorError::NotOwned`]).
    /// Incoming: unopened leases.
    pub buffers: Vec<AnyShared>,
}

impl RawMessage {
    /// A message of `bytes` with `buffers`.
    pub fn new(bytes: Vec<u8>, buffers: Vec<AnyShared>) -> Self {
        Self { bytes, buffers }
    }

    fn into_encoded(self) -> Result<Encoded, ActorError> {
        let cells = self
            .buffers
            .into_iter()
            .map(|b| match b.inner {
                SharedInner::Local(out) => Ok(out),
                SharedInner::Incoming(_) => Err(ActorError::NotOwned),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Encoded {
            bytes: self.bytes,
            cells,
        })
    }

    fn from_incoming(bytes: Vec<u8>, leases: IncomingLeases) -> Self {
        Self {
            bytes,
            buffers: leases.into_iter().map(AnyShared::incoming).collect(),
        }
    }
}

/// A call received by a [`RawHandler`].
#[derive(Debug)]
#[non_exhaustive]
pub struct RawCall {
    /// The calling process (as proven in its link's handshake).
    pub peer: ProcessId,
    /// The message.
    pub message: RawMessage,
}

/// The answer a [`RawHandler`] gives: a reply (its buffers are leased to the caller) or a
/// fault the caller receives as [`ActorError::Remote`].
pub type RawReply = Pin<Box<dyn Future<Output = Result<RawMessage, CallFault>>>>;

/// Receives raw calls (see the [module docs](self)). Called on the arbiter of the link the
/// call came in on: return at once, and do the work in the returned future (or elsewhere,
/// answering through a channel the future awaits). Until its future completes, a call
/// holds one of the link's [`calls_in_flight`](crate::LinkLimits::calls_in_flight); if the
/// link goes down first, the future is dropped.
pub trait RawHandler: Send + Sync + 'static {
    /// Handles one call.
    fn call(&self, call: RawCall) -> RawReply;
}

impl<F> RawHandler for F
where
    F: Fn(RawCall) -> RawReply + Send + Sync + 'static,
{
    fn call(&self, call: RawCall) -> RawReply {
        self(call)
    }
}

/// A [`RawHandler`] registered for calls of one wire type name
/// ([`Node::register_raw`](crate::Node::register_raw)).
pub(crate) struct RawRegistered {
    type_name: String,
    handler: Arc<dyn RawHandler>,
}

impl RawRegistered {
    /// `handler`, for calls of `type_name`.
    pub(crate) fn new(type_name: &str, handler: impl RawHandler) -> Self {
        Self {
            type_name: type_name.to_owned(),
            handler: Arc::new(handler),
        }
    }
}

impl ErasedHandler for RawRegistered {
    fn type_name(&self) -> &str {
        &self.type_name
    }

    fn invoke(
        &self,
        peer: ProcessId,
        payload: &[u8],
        leases: IncomingLeases,
    ) -> Result<Answer, CallFault> {
        let reply = self.handler.call(RawCall {
            peer,
            message: RawMessage::from_incoming(payload.to_vec(), leases),
        });
        Ok(Box::pin(async move {
            reply
                .await?
                .into_encoded()
                .map_err(|e| CallFault::ReplyFailed(e.to_string()))
        }))
    }
}

impl Peer {
    /// Sends a raw call to the actor registered as `target` in the peer process, as wire
    /// type `type_name`, and returns its reply undecoded (its buffers are unopened leases).
    /// The buffers of `message` are leased to the peer before it leaves. Queued and
    /// bounded like [`RemoteAddr::send`](crate::RemoteAddr::send): calls leave in the order
    /// they were made; dropping the future gives the call up.
    ///
    /// # Errors
    /// [`ActorError::NotOwned`] for a received buffer in `message`;
    /// [`ActorError::LinkClosed`] if the link goes down first; [`ActorError::Remote`] if
    /// the receiver refused the call (no such actor, another type, a payload it could not
    /// decode); [`ActorError::OfferRefused`] if a buffer of the reply could not be opened
    /// here.
    pub fn call_raw(
        &self,
        target: &str,
        type_name: &str,
        message: RawMessage,
    ) -> impl Future<Output = Result<RawMessage, ActorError>> + 'static + use<> {
        let reply = call_encoded(
            &self.link,
            &self.calls,
            &Arc::from(target),
            &Arc::from(type_name),
            message.into_encoded(),
        );
        // A combinator, not an `async` block, which would keep `reply` twice.
        reply.map(|payload| {
            let payload = payload?;
            Ok(RawMessage::from_incoming(payload.bytes, payload.leases))
        })
    }
}

#[cfg(test)]
mod tests {
    /// As `remote::tests::a_calls_future_stays_small_and_sendable`: a raw call's future is
    /// what a pipelined caller stores, and an `async` block around the queued call kept it
    /// twice (1,896 bytes for `send`'s).
    #[test]
    fn a_raw_calls_future_stays_small_and_sendable() {
        fn size_of_future<F: Future + Send>(_: fn(&super::Peer, super::RawMessage) -> F) -> usize {
            size_of::<F>()
        }
        let raw = size_of_future(|peer, msg| peer.call_raw("target", "test.Probe", msg));
        assert!(raw <= 512, "Peer::call_raw's future is {raw} bytes");
    }
}
