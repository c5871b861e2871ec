//! Buffers on both sides of a handoff.
//!
//! - [`Buffer<T>`]: the exporter's handle to a buffer its [`BufferOwner`](crate::BufferOwner)
//!   allocated. Cheap to clone. When the last clone drops the buffer is *freed* — as soon as
//!   no live process may map it (no lease out, every importer's warm mapping closed), never
//!   before.
//! - [`Shared<T>`]: a buffer inside a message. The sender puts `buffer.share()` in a field;
//!   sending the message grants the receiver a lease; the receiver finds an unopened lease
//!   in the same field and [`open`](Shared::open)s it.
//! - [`Lease<T>`]: the receiver's guard on the exporter's memory. Dropping it unmaps (drops
//!   its import-cache reference) and then sends `Release`, without blocking. If the
//!   exporter dies, the lease is *orphaned*: its accessors return
//!   [`ActorError::Orphaned`].

use crate::error::ActorError;
use crate::exports::Exports;
use crate::ids::BufferId;
use crate::link::{LinkHandle, ReleaseLease};
use baton_ipc::cuda::RecordedEvent;
use baton_ipc::{Allocation, Imported, MemPtr};
use baton_messages::{ActorId, DType, ExporterId, Layout, LeaseId, Shape};
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// An element type of typed buffers: plain old data with a wire [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// Its wire type.
    const DTYPE: DType;
}

macro_rules! elements {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DType = DType::$d; })*
    };
}

elements!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64, i64 => I64, f32 => F32, f64 => F64);

/// Checks an element range and turns it into a byte range.
fn byte_range<T: Element>(index: usize, len: usize, size: usize) -> Result<usize, ActorError> {
    match index.checked_add(len) {
        Some(end) if end <= size => Ok(index * size_of::<T>()),
        _ => Err(ActorError::OutOfBounds { index, len, size }),
    }
}

/// The exporter-side state of one buffer: its memory and the node's exports. Dropping the
/// last reference *retires* the buffer in the ledger, which frees it once no process may
/// map it.
pub(crate) struct BufferCell {
    pub(crate) id: BufferId,
    pub(crate) owner: ActorId,
    pub(crate) alloc: Arc<Allocation>,
    pub(crate) layout: Layout,
    pub(crate) exports: Arc<Exports>,
}

impl Drop for BufferCell {
    fn drop(&mut self) {
        self.exports.retire(self.id);
    }
}

/// The exporter's handle to a buffer of `T`s (see the [crate docs](crate)).
pub struct Buffer<T: Element> {
    pub(crate) cell: Arc<BufferCell>,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> Clone for Buffer<T> {
    fn clone(&self) -> Self {
        Self {
            cell: Arc::clone(&self.cell),
            _t: PhantomData,
        }
    }
}

impl<T: Element> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("id", &self.cell.id)
            .field("alloc", &self.cell.alloc.id())
            .field("layout", &self.cell.layout)
            .finish()
    }
}

impl<T: Element> Buffer<T> {
    pub(crate) fn new(cell: Arc<BufferCell>) -> Self {
        Self {
            cell,
            _t: PhantomData,
        }
    }

    /// Its id in its owner.
    pub fn id(&self) -> BufferId {
        self.cell.id
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        // The layout's element count, not the allocation's size: a backend may round the
        // allocation up (VMM granularity).
        self.cell.layout.shape.elements().unwrap_or(0) as usize
    }

    /// Whether it has no elements (never: empty buffers cannot be allocated).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its shape.
    pub fn shape(&self) -> &Shape {
        &self.cell.layout.shape
    }

    /// Where its first element is (host address or device pointer).
    pub fn ptr(&self) -> MemPtr {
        self.cell.alloc.ptr()
    }

    /// How many leases on it are out now. A buffer with none may be written again
    /// without racing a reader (a lease is counted from the moment its offer is sent).
    pub fn leases_out(&self) -> usize {
        self.cell.exports.leases_on(self.cell.id)
    }

    /// The backend allocation, for backend-specific work (e.g. launching a kernel on it).
    pub fn allocation(&self) -> &Allocation {
        &self.cell.alloc
    }

    /// Writes `data` starting at element `index`.
    ///
    /// # Errors
    /// [`ActorError::OutOfBounds`], or a backend error.
    pub fn write_at(&self, index: usize, data: &[T]) -> Result<(), ActorError> {
        let at = byte_range::<T>(index, data.len(), self.len())?;
        Ok(self.cell.alloc.write(at, bytemuck::cast_slice(data))?)
    }

    /// Reads elements starting at `index` into `out`.
    ///
    /// # Errors
    /// [`ActorError::OutOfBounds`], or a backend error.
    pub fn read_into(&self, index: usize, out: &mut [T]) -> Result<(), ActorError> {
        let at = byte_range::<T>(index, out.len(), self.len())?;
        Ok(self.cell.alloc.read(at, bytemuck::cast_slice_mut(out))?)
    }

    /// All elements, copied out.
    ///
    /// # Errors
    /// A backend error.
    pub fn to_vec(&self) -> Result<Vec<T>, ActorError> {
        let mut v = vec![T::zeroed(); self.len()];
        self.read_into(0, &mut v)?;
        Ok(v)
    }

    /// A handle to put in a message: sending the message grants its receiver a lease.
    pub fn share(&self) -> Shared<T> {
        Shared {
            inner: SharedInner::Local(Outgoing {
                cell: Arc::clone(&self.cell),
                event: None,
            }),
            _t: PhantomData,
        }
    }

    /// Like [`share`](Self::share), for a buffer that device work is still writing: the
    /// handle carries `event` (recorded after that work, e.g. with
    /// [`CudaBackend::record_event`](baton_ipc::cuda::CudaBackend::record_event)), and the
    /// importer's stream waits on it before the buffer is used. The lease keeps the event
    /// out of the pool until it is released, as the event pool's reuse contract asks.
    pub fn share_after(&self, event: &Arc<RecordedEvent>) -> Shared<T> {
        Shared {
            inner: SharedInner::Local(Outgoing {
                cell: Arc::clone(&self.cell),
                event: Some(Arc::clone(event)),
            }),
            _t: PhantomData,
        }
    }
}

/// An importer's lease before it is typed: the mapping, the lease, and the link to release
/// it on.
pub(crate) struct IncomingLease {
    /// `Some` until drop, which unmaps before it sends `Release`.
    pub(crate) imported: Option<Imported>,
    pub(crate) lease: LeaseId,
    pub(crate) link: LinkHandle,
    pub(crate) held: Arc<HeldLease>,
}

/// What the importer's link knows of a lease it holds: whether the exporter asked for it
/// back, and by when.
#[derive(Debug, Default)]
pub(crate) struct HeldLease {
    /// Milliseconds since `EPOCH` at which the revoke deadline passes (0: not revoked).
    revoke_deadline_ms: AtomicU64,
}

fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl HeldLease {
    pub(crate) fn request_revoke(&self, within: Duration) {
        let at = Instant::now() + within;
        let ms = at.duration_since(epoch()).as_millis().max(1) as u64;
        self.revoke_deadline_ms.store(ms, Ordering::Release);
    }

    pub(crate) fn revoke_deadline(&self) -> Option<Instant> {
        match self.revoke_deadline_ms.load(Ordering::Acquire) {
            0 => None,
            ms => Some(epoch() + Duration::from_millis(ms)),
        }
    }
}

impl IncomingLease {
    pub(crate) fn imported(&self) -> &Imported {
        // Only `drop` takes it.
        self.imported.as_ref().expect("present until drop")
    }

    pub(crate) fn live(&self) -> Result<&Imported, ActorError> {
        if self.link.is_alive() {
            Ok(self.imported())
        } else {
            Err(ActorError::Orphaned {
                exporter: self.link.peer(),
            })
        }
    }
}

impl Drop for IncomingLease {
    fn drop(&mut self) {
        // The cache reference first (the mapping closes if it was the last), then the
        // Release, queued on the link without blocking.
        drop(self.imported.take());
        if self.link.is_alive() {
            self.link.addr.do_send(ReleaseLease(self.lease));
        }
    }
}

impl fmt::Debug for IncomingLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IncomingLease")
            .field("lease", &self.lease)
            .field("buffer", &self.imported)
            .field("orphaned", &!self.link.is_alive())
            .finish()
    }
}

/// A buffer on its way out: what the link needs to grant a lease on it.
pub(crate) struct Outgoing {
    pub(crate) cell: Arc<BufferCell>,
    /// Recorded after the work that produced the buffer; kept by the lease.
    pub(crate) event: Option<Arc<RecordedEvent>>,
}

pub(crate) enum SharedInner {
    /// On the sender's side: the buffer to lease out when the message is sent.
    Local(Outgoing),
    /// On the receiver's side: the lease, not yet opened.
    Incoming(IncomingLease),
}

/// A buffer of `T`s inside a message (see the [crate docs](crate)).
///
/// `Shared<T>` serializes only inside Baton's messages (as an index into the message's
/// leases); serializing it anywhere else is an error.
pub struct Shared<T: Element> {
    pub(crate) inner: SharedInner,
    pub(crate) _t: PhantomData<fn() -> T>,
}

impl<T: Element> fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            SharedInner::Local(out) => write!(f, "Shared(local {:?})", out.cell.id),
            SharedInner::Incoming(l) => write!(f, "Shared(received {:?})", l.lease),
        }
    }
}

impl<T: Element> Shared<T> {
    /// Whether this is a received buffer (as opposed to one about to be sent).
    pub fn is_received(&self) -> bool {
        matches!(self.inner, SharedInner::Incoming(_))
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        match &self.inner {
            SharedInner::Local(out) => &out.cell.layout,
            SharedInner::Incoming(l) => l.imported().layout().expect("typed on arrival"),
        }
    }

    /// Opens a received buffer as a typed lease.
    ///
    /// # Errors
    /// [`ActorError::NotReceived`] for a buffer that was not received.
    pub fn open(self) -> Result<Lease<T>, ActorError> {
        match self.inner {
            SharedInner::Incoming(inner) => Ok(Lease {
                inner,
                _t: PhantomData,
            }),
            SharedInner::Local(_) => Err(ActorError::NotReceived),
        }
    }
}

/// An importer's typed guard on another process's buffer (see the [crate docs](crate)).
pub struct Lease<T: Element> {
    inner: IncomingLease,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> fmt::Debug for Lease<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Lease").field(&self.inner).finish()
    }
}

impl<T: Element> Lease<T> {
    /// The lease id (the exporter's).
    pub fn id(&self) -> LeaseId {
        self.inner.lease
    }

    /// Who exported the buffer.
    pub fn exporter(&self) -> ExporterId {
        self.inner.imported().exporter()
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.inner.imported().len() / size_of::<T>()
    }

    /// Whether it has no elements (never, for a valid handle).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its shape.
    pub fn shape(&self) -> &Shape {
        &self.layout().shape
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        self.inner.imported().layout().expect("typed on arrival")
    }

    /// Whether the exporter is gone (its accessors then fail).
    pub fn is_orphaned(&self) -> bool {
        !self.inner.link.is_alive()
    }

    /// The deadline by which the exporter asked to have this lease back, if it did.
    /// Drop the lease before then, or the link is cut.
    pub fn revoke_deadline(&self) -> Option<Instant> {
        self.inner.held.revoke_deadline()
    }

    /// Where the first element is mapped in this process.
    ///
    /// # Errors
    /// [`ActorError::Orphaned`].
    pub fn ptr(&self) -> Result<MemPtr, ActorError> {
        Ok(self.inner.live()?.ptr())
    }

    /// Reads elements starting at `index` into `out`.
    ///
    /// # Errors
    /// [`ActorError::Orphaned`], [`ActorError::OutOfBounds`], or a backend error.
    pub fn read_into(&self, index: usize, out: &mut [T]) -> Result<(), ActorError> {
        let imported = self.inner.live()?;
        let at = byte_range::<T>(index, out.len(), self.len())?;
        Ok(imported.read(at, bytemuck::cast_slice_mut(out))?)
    }

    /// All elements, copied out.
    ///
    /// # Errors
    /// As [`read_into`](Self::read_into).
    pub fn to_vec(&self) -> Result<Vec<T>, ActorError> {
        let mut v = vec![T::zeroed(); self.len()];
        self.read_into(0, &mut v)?;
        Ok(v)
    }

    /// Writes `data` starting at element `index` (the exporter sees it: same memory).
    ///
    /// # Errors
    /// As [`read_into`](Self::read_into).
    pub fn write_at(&self, index: usize, data: &[T]) -> Result<(), ActorError> {
        let imported = self.inner.live()?;
        let at = byte_range::<T>(index, data.len(), self.len())?;
        Ok(imported.write(at, bytemuck::cast_slice(data))?)
    }

    /// The import view, for backend-specific work (e.g. a kernel reading it).
    ///
    /// # Errors
    /// [`ActorError::Orphaned`].
    pub fn imported(&self) -> Result<&Imported, ActorError> {
        self.inner.live()
    }

    /// Gives the lease back now (the same as dropping it).
    pub fn release(self) {}
}
