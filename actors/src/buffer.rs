//! Buffers on both sides of a handoff.
//!
//! - [`Buffer<T>`]: the exporter's handle to a buffer its [`BufferOwner`](crate::BufferOwner)
//!   allocated. Cheap to clone. When the last clone drops the buffer is *freed* — as soon as
//!   no live process may map it (no lease out, every importer's warm mapping closed), never
//!   before.
//! - [`Shared<T>`]: a buffer inside a message. The sender puts `buffer.share()` in a field;
//!   sending the message grants the receiver a lease; the receiver finds an unopened lease
//!   in the same field and [`open`](Shared::open)s it.
//! - [`Lease<T>`]: the receiver's read-only guard on the exporter's memory
//!   ([`Lease::as_slice`] reads host memory in place). Dropping it unmaps (drops its
//!   import-cache reference) and then sends `Release`, without blocking. If the exporter
//!   dies, the lease is *orphaned*: its accessors return [`ActorError::Orphaned`].
//! - [`SharedMut<T>`] and [`LeaseMut<T>`]: the same, writable — the sender grants write
//!   with [`Buffer::share_mut`], in a field whose type says so
//!   ([`LeaseMut::as_mut_slice`] writes host memory in place).
//!
//! # One writer or many readers
//!
//! Per buffer, the exporter grants either one writable lease or any number of read-only
//! ones, never both, and refuses its own host writes ([`Buffer::write_at`]) while any
//! lease is out ([`Buffer::returned`] waits for them). So nothing writes through Baton's
//! safe API while a `&[T]` of [`Lease::as_slice`] lives, and nothing but its holder reaches
//! the memory while a `&mut [T]` of [`LeaseMut::as_mut_slice`] does; see [`Lease`] and
//! [`LeaseMut`] for what `unsafe` code elsewhere could still do. Device memory follows the same rule for host copies;
//! kernels are ordered by fences (below), and not launching a kernel that writes what
//! holders still read is the exporter's ordering to keep.
//!
//! # Stream ordering (device memory)
//!
//! Both are cudarc citizens: they implement cudarc's `DeviceSlice`, `DevicePtr` and
//! `DevicePtrMut`, so cudarc copies (`memcpy_dtod`, `memcpy_dtoh`, `memset_zeros`, …) and
//! kernel launches (with [`DeviceArg`](baton_ipc::cuda::DeviceArg)) are ordered without
//! user code, through cudarc's own `SyncOnDrop`:
//!
//! - a lease's first use on a stream makes that stream wait on the exporter's acquire
//!   fence (once per stream); every use is followed by a mark on its stream; dropping the
//!   lease turns the marks into a release fence that `Release` carries;
//! - a buffer's use on a stream waits for the importers' release fences that came back
//!   since, and for its uses on other streams; an offer carries a fence after its uses; its
//!   free waits for all of them.
//!
//! Host copies (`read_into`, `to_vec`, `write_at`) are ordered the same way on the
//! backend's own stream and complete before they return. For raw device pointers
//! ([`Lease::ptr`], [`Buffer::ptr`]) order your stream with [`Lease::wait_on`],
//! [`Buffer::wait_on`] and [`Buffer::share_on`]. See `docs/ORDERING.md`.

use crate::error::ActorError;
use crate::exports::BufferCell;
use crate::ids::BufferId;
use crate::link_ref::{LinkHandle, PendingRelease, ReleaseLease};
use crate::order::{Finished, LeaseOrder};
use baton_ipc::cuda::cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError, SyncOnDrop, sys,
};
use baton_ipc::cuda::{RecordedEvent, RecordedFence};
use baton_ipc::{ExportedFence, Imported, MemPtr, SharedBackend, Stream, StreamRef};
use baton_messages::{AllocationId, DType, ExporterId, Layout, LeaseId, ProcessId, Shape};
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

    /// Resolves once every lease on the buffer is back — released by its holder, or
    /// reclaimed because the holder's link went down — at once if none is out. A lease
    /// granted after the future was made counts too (it waits for the buffer to be idle,
    /// not for one set of leases). The future borrows nothing and does not keep the
    /// buffer alive.
    ///
    /// It is woken by the node's link actors: await it from an actix system's task (or
    /// any async context), never by blocking the thread those actors run on.
    pub fn returned(&self) -> impl Future<Output = ()> + 'static + use<T> {
        self.cell.exports.returned(self.cell.id)
    }

    /// [`returned`](Self::returned) with a deadline: `Ok(())` once every lease on the
    /// buffer is back, an error if some are still out after `timeout`.
    ///
    /// # Errors
    /// [`ActorError::NotReturned`], with how many leases were still out.
    pub fn returned_within(
        &self,
        timeout: Duration,
    ) -> impl Future<Output = Result<(), ActorError>> + 'static + use<T> {
        self.cell.returned_within(timeout)
    }

    /// The buffer's elements in place, writable, without a copy: host memory only. The
    /// guard derefs to `&mut [T]`; while it lives, no lease on the buffer is granted
    /// (sending a message that shares it fails with [`ActorError::LeaseConflict`]) and its
    /// copies (`write_at`, `read_into`, `to_vec`, through any clone) are refused.
    ///
    /// Refused while a lease on the buffer is out (one writer or many readers: the
    /// holders may be reading or writing the same pages): await
    /// [`returned`](Self::returned) first. Device memory has no CPU view: it is refused
    /// with [`ActorError::NotHostMemory`] — fill it with [`write_at`](Self::write_at) or
    /// on a stream.
    ///
    /// ```no_run
    /// # async fn fill(node: baton_actors::Node) -> Result<(), baton_actors::ActorError> {
    /// let data = node.allocate::<f32>(1 << 20)?;
    /// for (i, x) in data.as_mut_slice()?.iter_mut().enumerate() {
    ///     *x = i as f32; // the shared pages themselves: no temporary, no copy
    /// } // the guard drops here: the buffer may be shared again
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ActorError::BufferLeased`] while leases are out; [`ActorError::NotHostMemory`] for
    /// device memory (or host memory not aligned for `T`); [`ActorError::Ipc`] with
    /// [`InPlace`](baton_ipc::Error::InPlace) while another such guard of it lives.
    pub fn as_mut_slice(&self) -> Result<BufferMut<'_, T>, ActorError> {
        // The flag first, then the count (see `Exports::grant`): a grant that raced us is
        // counted, and none is made once the flag is set.
        let mut place = self
            .cell
            .alloc
            .write_in_place()?
            .ok_or(ActorError::NotHostMemory)?;
        self.cell.check_unleased()?;
        self.cell.order.before_host_copy()?;
        let len = self.len() * size_of::<T>();
        let bytes = place.get_mut(..len).ok_or(ActorError::NotHostMemory)?;
        bytemuck::try_cast_slice_mut::<u8, T>(bytes).map_err(|_| ActorError::NotHostMemory)?;
        Ok(BufferMut {
            place,
            len,
            _t: PhantomData,
        })
    }

    /// The id of the backend allocation the buffer lives in (what importers' import caches
    /// and `baton top` name). The allocation itself is not handed out: its safe `write`
    /// would bypass the one-writer rule; device work goes through [`ptr`](Self::ptr) (raw,
    /// ordered with [`wait_on`](Self::wait_on) and [`share_on`](Self::share_on)) or
    /// cudarc's traits, host writes through [`write_at`](Self::write_at).
    pub fn allocation_id(&self) -> AllocationId {
        self.cell.alloc.id()
    }

    /// Writes `data` starting at element `index`, after the work of importers that gave
    /// the buffer back and the buffer's uses on streams (on the backend's own stream; done
    /// when it returns).
    ///
    /// Refused while a lease on the buffer is out: its holder may be reading the memory
    /// (a read-only lease of host memory gives it a `&[T]` of it, which must not change
    /// under it) or writing it (a writable lease). Await [`returned`](Self::returned)
    /// first. (Device work through cudarc or raw pointers is not refused: on the GPU the
    /// exporter orders its kernels after the leases' release fences, and not writing what
    /// holders still read is the program's ordering to keep.)
    ///
    /// # Errors
    /// [`ActorError::BufferLeased`] while leases are out; [`ActorError::OutOfBounds`], or a
    /// backend error.
    pub fn write_at(&self, index: usize, data: &[T]) -> Result<(), ActorError> {
        self.cell.check_unleased()?;
        let at = byte_range::<T>(index, data.len(), self.len())?;
        self.cell.order.before_host_copy()?;
        Ok(self.cell.alloc.write(at, bytemuck::cast_slice(data))?)
    }

    /// Reads elements starting at `index` into `out`, after the work of importers that
    /// gave the buffer back and the buffer's uses on streams.
    ///
    /// # Errors
    /// [`ActorError::OutOfBounds`], or a backend error.
    pub fn read_into(&self, index: usize, out: &mut [T]) -> Result<(), ActorError> {
        let at = byte_range::<T>(index, out.len(), self.len())?;
        self.cell.order.before_host_copy()?;
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
    /// The offer carries an acquire fence after the buffer's uses on streams (cudarc
    /// launches and copies, [`share_on`](Self::share_on)), if it had any.
    pub fn share(&self) -> Shared<T> {
        self.shared_with(None)
    }

    /// A handle that grants its receiver a *writable* lease ([`LeaseMut`]): put it in a
    /// [`SharedMut<T>`] field. One writer, or readers — like `&mut` and `&` across
    /// processes: sending it fails with [`ActorError::LeaseConflict`] if any other lease on
    /// the buffer is out, and while it is out no other lease is granted and the exporter's
    /// own [`write_at`](Self::write_at) is refused. Await [`returned`](Self::returned) to
    /// read what the holder wrote.
    pub fn share_mut(&self) -> SharedMut<T> {
        let mut shared = self.shared_with(None);
        if let SharedInner::Local(out) = &mut shared.inner {
            out.writable = true;
        }
        SharedMut(shared)
    }

    /// Like [`share`](Self::share), for a buffer that device work is still writing: the
    /// handle carries `event` (recorded after that work, e.g. with
    /// [`CudaBackend::record_event`](baton_ipc::cuda::CudaBackend::record_event)), and the
    /// importer's streams wait on it before the buffer is used. The lease keeps the event
    /// out of the pool until it is released, as the event pool's reuse contract asks.
    pub fn share_after(&self, event: &Arc<RecordedEvent>) -> Shared<T> {
        self.shared_with(Some(Arc::clone(event) as Arc<dyn ExportedFence>))
    }

    /// Like [`share_after`](Self::share_after), with a fence of either kind (an IPC event
    /// or a sequence counter:
    /// [`CudaBackend::record_fence_on`](baton_ipc::cuda::CudaBackend::record_fence_on)).
    pub fn share_after_fence(&self, fence: &Arc<RecordedFence>) -> Shared<T> {
        self.shared_with(Some(Arc::clone(fence) as Arc<dyn ExportedFence>))
    }

    /// Like [`share`](Self::share), after the work queued on `stream` so far (which
    /// produced the buffer): the buffer's mark is recorded there now, and the offer's
    /// acquire fence follows it.
    ///
    /// # Errors
    /// A backend error (the stream is not of the backend's device, …);
    /// [`ActorError::TooManyStreams`].
    pub fn share_on(&self, stream: impl Into<Stream>) -> Result<Shared<T>, ActorError> {
        let stream = stream.into();
        if let Some(mark) = self.cell.order.use_on(stream.as_ref())? {
            mark.record(stream.as_ref())?;
        }
        Ok(self.share())
    }

    /// Orders the work you queue on `stream` from now on (with the raw
    /// [`ptr`](Self::ptr)) after the work of importers that gave the buffer back and after
    /// its uses on other streams. Record the end of your work with
    /// [`share_on`](Self::share_on), or use cudarc's API (`DevicePtr`), which does both.
    ///
    /// # Errors
    /// A backend error; [`ActorError::TooManyStreams`].
    pub fn wait_on(&self, stream: impl Into<Stream>) -> Result<(), ActorError> {
        let stream = stream.into();
        self.cell.order.use_on(stream.as_ref())?;
        Ok(())
    }

    /// Whether it is device memory of a CUDA backend (cudarc's traits apply).
    pub fn is_device(&self) -> bool {
        matches!(self.ptr(), MemPtr::Device(_)) && self.cell.order.backend().cuda().is_some()
    }

    fn shared_with(&self, fence: Option<Arc<dyn ExportedFence>>) -> Shared<T> {
        Shared {
            inner: SharedInner::Local(Outgoing {
                cell: Arc::clone(&self.cell),
                fence,
                writable: false,
            }),
            _t: PhantomData,
        }
    }
}

/// A buffer's host memory, writable in place by its owner ([`Buffer::as_mut_slice`]):
/// derefs to `[T]`. No lease on the buffer is granted, and its copies are refused, until it
/// drops.
pub struct BufferMut<'a, T: Element> {
    place: baton_ipc::InPlace<'a>,
    /// Bytes of the buffer's elements (the allocation may be larger).
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> fmt::Debug for BufferMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferMut")
            .field("len", &(self.len / size_of::<T>()))
            .finish()
    }
}

impl<T: Element> std::ops::Deref for BufferMut<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // Checked castable when the guard was made; the bytes do not move.
        bytemuck::cast_slice(&self.place[..self.len])
    }
}

impl<T: Element> std::ops::DerefMut for BufferMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(&mut self.place[..self.len])
    }
}

/// The device address of device memory.
///
/// # Panics
/// For host memory, which cudarc's traits do not apply to.
fn device_address(ptr: MemPtr) -> sys::CUdeviceptr {
    match ptr {
        MemPtr::Device(p) => p,
        MemPtr::Host(_) => {
            panic!("host memory has no device pointer: check is_device() before using cudarc")
        }
    }
}

/// The backend's own stream, for cudarc's `DeviceSlice::stream`.
///
/// # Panics
/// For a backend that is not CUDA.
fn cuda_stream(backend: &SharedBackend) -> &Arc<CudaStream> {
    backend
        .cuda()
        .map(baton_ipc::CudaBackend::stream)
        .expect("host memory has no CUDA stream: check is_device() before using cudarc")
}

/// What cudarc does after the use: record the mark on `stream` — or, without a mark (or
/// when cudarc does not record events: a context without streams of its own, or with
/// event tracking off), synchronise the stream so that the use is complete.
fn after_use<'a>(
    used: Result<Option<&'a dyn baton_ipc::UseMark>, ActorError>,
    stream: &'a CudaStream,
) -> SyncOnDrop<'a> {
    let records = stream.context().is_managing_stream_synchronization();
    match used {
        Ok(Some(mark)) if records => match mark.cuda_event() {
            Some(event) => SyncOnDrop::Record(Some((event, stream))),
            None => SyncOnDrop::Sync(Some(stream)),
        },
        Ok(_) => SyncOnDrop::Sync(Some(stream)),
        Err(e) => {
            // cudarc's way for calls that cannot fail: the context keeps the error for
            // its next fallible call. The use is made complete, so nothing outlives it.
            tracing::warn!(error = %e, "ordering a use of a shared buffer failed");
            stream
                .context()
                .record_err::<()>(Err(DriverError(sys::cudaError_enum::CUDA_ERROR_UNKNOWN)));
            SyncOnDrop::Sync(Some(stream))
        }
    }
}

impl<T: Element> DeviceSlice<T> for Buffer<T> {
    fn len(&self) -> usize {
        Buffer::len(self)
    }

    /// The backend's own stream (host copies run there).
    ///
    /// # Panics
    /// For host memory.
    fn stream(&self) -> &Arc<CudaStream> {
        cuda_stream(self.cell.order.backend())
    }
}

impl<T: Element> DevicePtr<T> for Buffer<T> {
    /// `stream` waits for the release fences of importers that gave the buffer back and
    /// for its uses on other streams; the use is recorded on `stream` when the
    /// `SyncOnDrop` drops.
    ///
    /// # Panics
    /// For host memory.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let ptr = device_address(self.ptr());
        let used = self.cell.order.use_on(StreamRef::Cuda(stream));
        (ptr, after_use(used, stream))
    }
}

impl<T: Element> DevicePtrMut<T> for Buffer<T> {
    /// As [`device_ptr`](DevicePtr::device_ptr).
    ///
    /// # Panics
    /// For host memory.
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let ptr = device_address(self.ptr());
        let used = self.cell.order.use_on(StreamRef::Cuda(stream));
        (ptr, after_use(used, stream))
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
    /// Its uses on streams and the acquire fence they wait on.
    pub(crate) order: LeaseOrder,
}

/// What the importer's link knows of a lease it holds: whether the exporter asked for it
/// back, and by when.
#[derive(Debug, Default)]
pub(crate) struct HeldLease {
    /// Milliseconds since `EPOCH` at which the revoke deadline passes (0: not revoked).
    revoke_deadline_ms: AtomicU64,
    /// Woken when the exporter asks for the lease back ([`Lease::revoked`]).
    revoked: tokio::sync::Notify,
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
        self.revoked.notify_waiters();
    }

    /// Resolves with the revoke deadline once the exporter asks for the lease back.
    pub(crate) fn revoked(self: &Arc<Self>) -> impl Future<Output = Instant> + 'static + use<> {
        let held = Arc::clone(self);
        async move {
            loop {
                let notified = held.revoked.notified();
                let mut notified = std::pin::pin!(notified);
                // Registered before the check, so a revoke between the two wakes us.
                notified.as_mut().enable();
                if let Some(deadline) = held.revoke_deadline() {
                    return deadline;
                }
                notified.await;
            }
        }
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
        // The release fence follows every use queued on a stream; the cache reference goes
        // (its mapping closes — after that fence — if it was the last), then the Release
        // with the fence, queued on the link without blocking.
        let imported = self.imported.take();
        let (fences, pending) = match self.order.finish() {
            Finished::Idle => {
                drop(imported);
                (Vec::new(), None)
            }
            Finished::Fence(fence) => {
                let handle = fence.handle();
                if let Some(imported) = imported {
                    // The mapping closes after our own work: the fence's local twin.
                    imported.release_after(fence.local_handle());
                }
                // Dropped now: a pooled release fence is recorded again only once its work
                // has completed (see `StreamOrdering::export_fence`).
                drop(fence);
                (vec![handle], None)
            }
            Finished::Wait(marks) => (Vec::new(), Some(PendingRelease { marks, imported })),
        };
        if self.link.is_alive() {
            self.link.do_send(ReleaseLease {
                lease: self.lease,
                fences,
                pending,
            });
        } else if let Some(pending) = pending {
            // The exporter is gone; the mapping still must outlive our work on it.
            pending.wait();
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
    /// A writable lease ([`Buffer::share_mut`]): granted only while no other lease is out,
    /// and no other lease is granted while it is.
    pub(crate) writable: bool,
    /// Recorded after the work that produced the buffer; kept with the lease. `None`: the
    /// buffer's own acquire fence (after its uses on streams), if it needs one.
    pub(crate) fence: Option<Arc<dyn ExportedFence>>,
}

impl Outgoing {
    /// The offer's acquire fence, for process `to`: the buffer's own, or one after the
    /// fence the sender recorded itself (passed on into `to`'s inbox).
    pub(crate) fn acquire_fence(
        &self,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>, ActorError> {
        match &self.fence {
            Some(f) => {
                let backend = self.cell.order.backend();
                let me = baton_ipc::process::current();
                Ok(backend.ordering().relay_fence(&me, &f.local_handle(), to)?)
            }
            None => self.cell.order.acquire_fence(to),
        }
    }
}

pub(crate) enum SharedInner {
    /// On the sender's side: the buffer to lease out when the message is sent.
    Local(Outgoing),
    /// On the receiver's side: the lease, not yet opened.
    Incoming(Box<IncomingLease>),
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
                inner: *inner,
                _t: PhantomData,
            }),
            SharedInner::Local(_) => Err(ActorError::NotReceived),
        }
    }
}

/// A buffer inside a message that its receiver may write: the sender puts
/// [`buffer.share_mut()`](Buffer::share_mut) in a field of this type, and the receiver
/// [`open`](Self::open)s a [`LeaseMut<T>`]. The write grant is in the message's type,
/// which both sides share: nothing about it crosses the wire, and a [`Shared<T>`] field
/// only ever opens read-only.
///
/// The exporter enforces one writer or many readers per buffer (see
/// [`Buffer::share_mut`]).
pub struct SharedMut<T: Element>(pub(crate) Shared<T>);

impl<T: Element> fmt::Debug for SharedMut<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedMut({:?})", self.0)
    }
}

impl<T: Element> SharedMut<T> {
    /// Whether this is a received buffer (as opposed to one about to be sent).
    pub fn is_received(&self) -> bool {
        self.0.is_received()
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        self.0.layout()
    }

    /// Opens a received buffer as a writable lease.
    ///
    /// # Errors
    /// [`ActorError::NotReceived`] for a buffer that was not received.
    pub fn open(self) -> Result<LeaseMut<T>, ActorError> {
        Ok(LeaseMut {
            lease: self.0.open()?,
        })
    }
}

/// An importer's typed, read-only guard on another process's buffer (see the
/// [crate docs](crate)). A writable lease is a [`LeaseMut<T>`].
///
/// # Reading in place
///
/// [`as_slice`](Self::as_slice) gives a `&[T]` of host memory without a copy. It is sound
/// in safe code because nothing can write the memory through Baton's safe API while the
/// lease is out: a read-only lease has no write method, the exporter's
/// [`Buffer::write_at`] is refused while any lease on the buffer is out, and no writable
/// lease is granted while a read-only one is (nor the other way round). What the API
/// cannot stop: `unsafe` code — or a raw pointer ([`Buffer::ptr`], [`Lease::ptr`],
/// `Imported::ptr`) dereferenced in `unsafe` code — in the exporter's process or another
/// importer's, which writes the shared pages directly; and another process of the same
/// user that maps the memory by itself. Baton authenticates its peers (same uid and the
/// session token) but does not sandbox them: a peer that writes under a reader breaks the
/// protocol, and the reader may see torn values (the memory never goes away under the
/// slice: the mapping lives as long as the lease).
///
/// A read-only lease has no write method, nor a writable view:
///
/// ```compile_fail
/// fn write(lease: &baton_actors::Lease<u32>) {
///     lease.write_at(0, &[1]).unwrap(); // only a LeaseMut writes
/// }
/// ```
///
/// ```compile_fail
/// fn write(mut lease: baton_actors::Lease<u32>) {
///     lease.as_mut_slice().unwrap()[0] = 1; // only a LeaseMut writes in place
/// }
/// ```
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

    /// Where the first element is mapped in this process. Before queuing work that uses
    /// it on a stream, call [`wait_on`](Self::wait_on) with that stream (cudarc's API does
    /// it for you: `DevicePtr`).
    ///
    /// # Errors
    /// [`ActorError::Orphaned`].
    pub fn ptr(&self) -> Result<MemPtr, ActorError> {
        Ok(self.inner.live()?.ptr())
    }

    /// Orders the work you queue on `stream` from now on after the exporter's work that
    /// produced the buffer (the stream waits on the offer's acquire fence, once per
    /// stream), and keeps `stream`: dropping the lease records its release fence there,
    /// after everything queued by then.
    ///
    /// # Errors
    /// [`ActorError::Orphaned`]; a backend error (the fence cannot be opened, the stream is
    /// not of the backend's device); [`ActorError::TooManyStreams`].
    pub fn wait_on(&self, stream: impl Into<Stream>) -> Result<(), ActorError> {
        self.inner.live()?;
        self.inner.order.wait_on(stream.into())
    }

    /// Whether it is device memory of a CUDA backend (cudarc's traits apply).
    pub fn is_device(&self) -> bool {
        matches!(self.inner.imported().ptr(), MemPtr::Device(_))
            && self.inner.imported().backend().cuda().is_some()
    }

    /// Reads elements starting at `index` into `out` (on the backend's own stream, after
    /// the exporter's work that produced the buffer; done when it returns).
    ///
    /// # Errors
    /// [`ActorError::Orphaned`], [`ActorError::OutOfBounds`], or a backend error.
    pub fn read_into(&self, index: usize, out: &mut [T]) -> Result<(), ActorError> {
        let imported = self.inner.live()?;
        let at = byte_range::<T>(index, out.len(), self.len())?;
        self.inner.order.before_host_copy()?;
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

    /// The elements in place, without a copy: host memory only (see
    /// [Reading in place](Self#reading-in-place) for why this is sound, and what it
    /// cannot stop).
    ///
    /// # Errors
    /// [`ActorError::Orphaned`]; [`ActorError::NotHostMemory`] for device memory (copy it
    /// with [`to_vec`](Self::to_vec), or use it on a stream), or host memory not aligned
    /// for `T`.
    pub fn as_slice(&self) -> Result<&[T], ActorError> {
        let imported = self.inner.live()?;
        self.inner.order.before_host_copy()?;
        let bytes = imported
            .host_bytes()
            .and_then(|b| b.get(..self.len() * size_of::<T>()))
            .ok_or(ActorError::NotHostMemory)?;
        bytemuck::try_cast_slice(bytes).map_err(|_| ActorError::NotHostMemory)
    }

    /// Resolves with the deadline once the exporter asks for this lease back
    /// ([`Revoke`](crate::Revoke)); drop the lease before it, or the link is cut. Resolves
    /// at once if it already has; never, if it never does. The future borrows nothing, so
    /// the actor that holds the lease can handle its revoke itself:
    ///
    /// ```
    /// use actix::prelude::*;
    /// use baton_actors::Lease;
    /// use std::collections::HashMap;
    ///
    /// struct Holder {
    ///     leases: HashMap<u64, Lease<f32>>,
    /// }
    /// impl Actor for Holder {
    ///     type Context = Context<Self>;
    /// }
    /// impl Holder {
    ///     fn keep(&mut self, key: u64, lease: Lease<f32>, ctx: &mut Context<Self>) {
    ///         ctx.spawn(lease.revoked().into_actor(self).map(move |_deadline, act, _| {
    ///             act.leases.remove(&key); // dropping it gives it back
    ///         }));
    ///         self.leases.insert(key, lease);
    ///     }
    /// }
    /// ```
    ///
    /// [`Node::on_revoke`](crate::Node::on_revoke) reports every revoke of the node, by
    /// lease id, instead.
    pub fn revoked(&self) -> impl Future<Output = Instant> + 'static + use<T> {
        self.inner.held.revoked()
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

    /// The untyped lease (its id, its link).
    pub(crate) fn incoming(&self) -> &IncomingLease {
        &self.inner
    }
}

impl<T: Element> DeviceSlice<T> for Lease<T> {
    fn len(&self) -> usize {
        Lease::len(self)
    }

    /// The importing backend's own stream (host copies run there).
    ///
    /// # Panics
    /// For host memory.
    fn stream(&self) -> &Arc<CudaStream> {
        cuda_stream(self.inner.imported().backend())
    }
}

impl<T: Element> DevicePtr<T> for Lease<T> {
    /// On the lease's first use on `stream`, the stream waits on the exporter's acquire
    /// fence; the use is recorded on `stream` when the `SyncOnDrop` drops, and the
    /// lease's release fence follows it. (An orphaned lease's memory stays mapped until the
    /// lease drops: the pointer is valid, its data may be incomplete.)
    ///
    /// # Panics
    /// For host memory.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let ptr = device_address(self.inner.imported().ptr());
        let used = self.inner.order.use_on(StreamRef::Cuda(stream));
        (ptr, after_use(used, stream))
    }
}

/// An importer's writable guard on another process's buffer: a [`Lease<T>`] (every read
/// accessor, through `Deref`) that may also write. Opened from a [`SharedMut<T>`] field,
/// which the sender filled with [`Buffer::share_mut`]; while it is out, the exporter
/// grants no other lease on the buffer and refuses its own `write_at`, so this is the
/// only writer its safe API allows.
///
/// # Writing in place
///
/// [`as_mut_slice`](Self::as_mut_slice) gives a `&mut [T]` of host memory without a copy.
/// It extends the argument of [Reading in place](Lease#reading-in-place): while a
/// writable lease is out, the exporter grants no other lease on the buffer — writable or
/// read-only, to any process, this one included — and refuses its own
/// [`Buffer::write_at`], so no other holder's view of the memory exists. In this process
/// the import cache backs that up: it hands the slice out only while the lease's view is
/// the mapping's only one here, and opens no other view of it until the lease drops (an
/// offer of it fails meanwhile). The slice borrows the lease mutably, so neither this
/// lease's own copies ([`write_at`](Self::write_at), [`read_into`](Lease::read_into)) nor
/// its `&[T]` ([`as_slice`](Lease::as_slice)) can be used while it lives.
///
/// What the API cannot stop is what it cannot stop for readers: `unsafe` code, or a raw
/// pointer ([`Buffer::ptr`], [`Lease::ptr`], `Imported::ptr`) dereferenced in `unsafe`
/// code, in the exporter's process or another one, that writes or reads the shared pages
/// directly; and another process of the same user that maps the memory by itself. One
/// more: a lease whose link is cut (its revoke deadline passed, or the link failed) no
/// longer counts for the exporter, which may then write the buffer or lease it again
/// while a slice taken before the cut still lives. Drop the slice (and the lease) before
/// the revoke deadline ([`revoked`](Lease::revoked)); the memory never goes away under
/// the slice either way.
pub struct LeaseMut<T: Element> {
    lease: Lease<T>,
}

impl<T: Element> fmt::Debug for LeaseMut<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("LeaseMut").field(&self.lease.inner).finish()
    }
}

impl<T: Element> std::ops::Deref for LeaseMut<T> {
    type Target = Lease<T>;
    fn deref(&self) -> &Lease<T> {
        &self.lease
    }
}

impl<T: Element> LeaseMut<T> {
    /// Writes `data` starting at element `index` (the exporter sees it: same memory, on
    /// the backend's own stream, done when it returns).
    ///
    /// # Errors
    /// [`ActorError::Orphaned`], [`ActorError::OutOfBounds`], or a backend error.
    pub fn write_at(&self, index: usize, data: &[T]) -> Result<(), ActorError> {
        let imported = self.lease.inner.live()?;
        let at = byte_range::<T>(index, data.len(), self.lease.len())?;
        self.lease.inner.order.before_host_copy()?;
        Ok(imported.write(at, bytemuck::cast_slice(data))?)
    }

    /// The elements in place, writable, without a copy: host memory only (see
    /// [Writing in place](Self#writing-in-place) for why this is sound, and what it cannot
    /// stop). The exporter sees what was written: it is the same memory, and the
    /// exporter reads it once the lease is back.
    ///
    /// # Errors
    /// [`ActorError::Orphaned`]; [`ActorError::NotHostMemory`] for device memory (write it
    /// with [`write_at`](Self::write_at), or on a stream), or host memory not aligned for
    /// `T`; [`ActorError::Ipc`] with [`SharedMapping`](baton_ipc::Error::SharedMapping)
    /// if another lease of this process maps the same allocation (which the exporter
    /// grants only once this lease's link was cut).
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], ActorError> {
        let len = self.lease.len() * size_of::<T>();
        let inner = &mut self.lease.inner;
        if !inner.link.is_alive() {
            return Err(ActorError::Orphaned {
                exporter: inner.link.peer(),
            });
        }
        inner.order.before_host_copy()?;
        let bytes = inner
            .imported
            .as_mut()
            .expect("present until drop")
            .host_bytes_mut()?
            .and_then(|b| b.get_mut(..len))
            .ok_or(ActorError::NotHostMemory)?;
        bytemuck::try_cast_slice_mut(bytes).map_err(|_| ActorError::NotHostMemory)
    }

    /// Gives the lease back now (the same as dropping it).
    pub fn release(self) {}
}

impl<T: Element> DeviceSlice<T> for LeaseMut<T> {
    fn len(&self) -> usize {
        Lease::len(&self.lease)
    }

    /// The importing backend's own stream (host copies run there).
    ///
    /// # Panics
    /// For host memory.
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::stream(&self.lease)
    }
}

impl<T: Element> DevicePtr<T> for LeaseMut<T> {
    /// As for [`Lease`].
    ///
    /// # Panics
    /// For host memory.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.lease.device_ptr(stream)
    }
}

impl<T: Element> DevicePtrMut<T> for LeaseMut<T> {
    /// As [`device_ptr`](DevicePtr::device_ptr): the exporter sees what was written once
    /// the lease is back (its uses wait for the lease's release fence).
    ///
    /// # Panics
    /// For host memory.
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.lease.device_ptr(stream)
    }
}
