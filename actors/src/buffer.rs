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
//! - Range leases: [`Buffer::share_range`] and [`Buffer::share_range_mut`] lease a part of
//!   a buffer (element indices, like a slice's). The receiver's lease is exactly that part:
//!   its `len`, `as_slice`, `read_into`, `ptr` and device pointer start at the range's
//!   first element, and its layout is a vector of the range's length. To give each worker
//!   its half, send each a range.
//!
//! # One writer or many readers
//!
//! Per byte range of a buffer, the exporter grants either one writable lease or any number
//! of read-only ones, never both: a writable lease is granted only while no other lease
//! that overlaps its range is out, and no lease is granted while a writable one that
//! overlaps it is ([`ActorError::LeaseConflict`] otherwise). A whole-buffer lease
//! ([`Buffer::share`], [`Buffer::share_mut`]) covers every element, so it conflicts as it
//! always did; writable leases of disjoint ranges coexist — each worker writes its own half
//! at the same time — and read leases always coexist. The exporter refuses its own host
//! writes ([`Buffer::write_at`], [`Buffer::as_mut_slice`]) while any lease on the buffer
//! is out, whatever its range ([`Buffer::returned`] waits for them). So nothing writes
//! through Baton's safe API the bytes a `&[T]` of [`Lease::as_slice`] sees while it
//! lives, and nothing but its holder reaches the bytes of a `&mut [T]` of
//! [`LeaseMut::as_mut_slice`] while it does; see [`Lease`] and [`LeaseMut`] for what
//! `unsafe` code elsewhere could still do. Device memory follows the same rule for host
//! copies; kernels are ordered by fences (below), and not launching a kernel that writes
//! what holders still read is the exporter's ordering to keep.
//!
//! # What a range lease restricts, and what it does not
//!
//! Baton's safe API gives the holder of a range lease the range and nothing else: every
//! accessor of [`Lease`] and [`LeaseMut`] is bounded by it, and a forward of the lease
//! ([`Peer::forward`](crate::Peer::forward)) covers the same range. It is not a memory
//! protection boundary between processes on one host. For same-host sharing (host memory
//! and CUDA IPC) the importer's process maps the whole *allocation* — the handle names the
//! allocation, then the range inside it — so code in that process that reaches past the
//! range through a raw pointer in `unsafe` code ([`Lease::ptr`] plus an offset, or the
//! mapping itself) can read and write the rest of the buffer; Baton authenticates its
//! peers but does not sandbox them. Over a host link (TCP) the restriction is real: only
//! the range's bytes are sent, into a copy of exactly their size, and the receiver learns
//! nothing else of the buffer. Give a process whose reach must end at its range a copy
//! (a buffer of its own), or a peer on another host.
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
use crate::exports::{BufferCell, Part};
use crate::link_ref::{LinkHandle, PendingRelease, ReleaseLease};
use crate::order::{Finished, LeaseOrder};
use baton_ipc::cuda::cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError, SyncOnDrop, sys,
};
use baton_ipc::cuda::{RecordedEvent, RecordedFence};
use baton_ipc::{ExportedFence, Imported, MemPtr, SharedBackend, Stream, StreamRef};
use baton_messages::{AllocationId, DType, Layout, LeaseId, ProcessId, Shape};
use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod lease;
pub(crate) use lease::lease_accessors;
pub(crate) use lease::{
    HeldLease, IncomingLease, IncomingLeases, LeaseParts, Outgoing, SharedInner,
};
pub use lease::{Lease, LeaseMut, Shared, SharedMut};

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

/// The accessors of an exporter's buffer handle, typed ([`Buffer<T>`]) or not
/// ([`AnyBuffer`](crate::AnyBuffer)), written once: each type has a `cell: Arc<BufferCell>`
/// field. The argument is the precise-capture list of the futures (`use<T>`, `use<>`).
macro_rules! buffer_accessors {
    ($($capture:tt)*) => {
        /// Its id in its owner.
        pub fn id(&self) -> $crate::ids::BufferId {
            self.cell.id
        }

        /// Where it starts (host address or device pointer).
        pub fn ptr(&self) -> ::baton_ipc::MemPtr {
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
        pub fn returned(
            &self,
        ) -> impl ::std::future::Future<Output = ()> + 'static + $($capture)* {
            self.cell.exports.returned(self.cell.id)
        }

        /// [`returned`](Self::returned) with a deadline: `Ok(())` once every lease on the
        /// buffer is back, an error if some are still out after `timeout`.
        ///
        /// # Errors
        /// [`ActorError::NotReturned`](crate::ActorError::NotReturned), with how many
        /// leases were still out.
        pub fn returned_within(
            &self,
            timeout: ::std::time::Duration,
        ) -> impl ::std::future::Future<Output = Result<(), $crate::ActorError>>
               + 'static
               + $($capture)* {
            self.cell.returned_within(timeout)
        }

        /// Orders the work you queue on `stream` from now on (with the raw
        /// [`ptr`](Self::ptr)) after the work of importers that gave the buffer back and after
        /// its uses on other streams. Record the end of your work with
        /// [`share_on`](Self::share_on), or use cudarc's API (`DevicePtr`, typed buffers),
        /// which does both.
        ///
        /// # Errors
        /// A backend error; [`ActorError::TooManyStreams`](crate::ActorError::TooManyStreams).
        pub fn wait_on(
            &self,
            stream: impl Into<::baton_ipc::Stream>,
        ) -> Result<(), $crate::ActorError> {
            let stream = stream.into();
            self.cell.order.wait_on(stream.as_ref())
        }

        /// Whether it is device memory of a CUDA backend (cudarc's traits apply).
        pub fn is_device(&self) -> bool {
            matches!(self.cell.alloc.ptr(), ::baton_ipc::MemPtr::Device(_))
                && self.cell.order.backend().cuda().is_some()
        }
    };
}
pub(crate) use buffer_accessors;

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
    buffer_accessors!(use<T>);

    pub(crate) fn new(cell: Arc<BufferCell>) -> Self {
        Self {
            cell,
            _t: PhantomData,
        }
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
    /// the buffer (of any range of it) is out, and while it is out no other lease is
    /// granted and the exporter's own [`write_at`](Self::write_at) is refused. Await
    /// [`returned`](Self::returned) to read what the holder wrote. To let several holders
    /// write at once, give each its own part: [`share_range_mut`](Self::share_range_mut).
    pub fn share_mut(&self) -> SharedMut<T> {
        let mut shared = self.shared_with(None);
        if let SharedInner::Local(out) = &mut shared.inner {
            out.writable = true;
        }
        SharedMut(shared)
    }

    /// A handle that grants its receiver a read-only lease of the elements in `range`
    /// alone (element indices, like a slice's): the receiver's [`Lease`] sees exactly
    /// them — its [`len`](Lease::len), [`as_slice`](Lease::as_slice),
    /// [`read_into`](Lease::read_into) and [`ptr`](Lease::ptr) start at `range.start` —
    /// and its [`layout`](Lease::layout) is a vector of `range.len()` elements (a range
    /// of the whole buffer is [`share`](Self::share), with the buffer's own shape). Give
    /// each worker its part of one buffer:
    ///
    /// ```no_run
    /// # use baton_actors::{ActorError, Buffer, Shared};
    /// # fn halves(data: &Buffer<f32>) -> Result<(Shared<f32>, Shared<f32>), ActorError> {
    /// let half = data.len() / 2;
    /// let first = data.share_range(..half)?; // put each in a message to its worker
    /// let second = data.share_range(half..)?;
    /// # Ok((first, second)) }
    /// ```
    ///
    /// One writer or many readers holds per byte range: it is refused when sent only while
    /// a writable lease that overlaps `range` is out (whole-buffer leases overlap every
    /// range). The exporter's own [`write_at`](Self::write_at) is refused while any lease
    /// on the buffer is out, whatever its range.
    ///
    /// # What the range restricts, and what it does not
    ///
    /// Baton's safe API gives the holder the range and nothing else: every accessor of
    /// [`Lease`] and [`LeaseMut`] is bounded by it, and a forward of the lease covers the
    /// same range. It is not a memory protection boundary between processes on one host:
    /// for same-host sharing (host memory, CUDA IPC) the importer's process maps the whole
    /// allocation — the handle names the allocation, then the range inside it — so code
    /// there that reaches past the range through a raw pointer in `unsafe` code
    /// ([`Lease::ptr`] plus an offset) can read and write the rest of the buffer; Baton
    /// authenticates its peers, it does not sandbox them. Over a host link (TCP) the
    /// restriction is real: only the range's bytes are sent, into a copy of exactly their
    /// size, and the receiver learns nothing else of the buffer. Give a process whose
    /// reach must end at its range a buffer of its own, or reach it over a host link.
    ///
    /// # Errors
    /// [`ActorError::OutOfBounds`] for a range that ends past the buffer's end, or is
    /// empty (a lease of nothing is refused: nothing could be read through it, and the
    /// wire's handles name at least one byte).
    pub fn share_range(&self, range: impl RangeBounds<usize>) -> Result<Shared<T>, ActorError> {
        let part = self.part(range)?;
        let mut shared = self.share();
        if let SharedInner::Local(out) = &mut shared.inner {
            out.part = part;
        }
        Ok(shared)
    }

    /// A handle that grants its receiver a *writable* lease ([`LeaseMut`]) of the elements
    /// in `range` alone: [`share_range`](Self::share_range) with
    /// [`share_mut`](Self::share_mut)'s grant. Writable leases of disjoint ranges coexist
    /// (give each worker its half to write, then await [`returned`](Self::returned) and
    /// read both); sending one fails with [`ActorError::LeaseConflict`] while any other
    /// lease that overlaps `range` is out, and while it is out no lease that overlaps it
    /// is granted. The exporter's own [`write_at`](Self::write_at) is refused while any
    /// lease on the buffer is out, whatever its range.
    ///
    /// # Errors
    /// As [`share_range`](Self::share_range).
    pub fn share_range_mut(
        &self,
        range: impl RangeBounds<usize>,
    ) -> Result<SharedMut<T>, ActorError> {
        let part = self.part(range)?;
        let mut shared = self.share_mut();
        if let SharedInner::Local(out) = &mut shared.0.inner {
            out.part = part;
        }
        Ok(shared)
    }

    /// The part of the buffer `range` names: `None` for all of it.
    fn part(&self, range: impl RangeBounds<usize>) -> Result<Option<Part>, ActorError> {
        use std::ops::Bound;
        let size = self.len();
        let start = match range.start_bound() {
            Bound::Included(&s) => Some(s),
            Bound::Excluded(&s) => s.checked_add(1),
            Bound::Unbounded => Some(0),
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.checked_add(1),
            Bound::Excluded(&e) => Some(e),
            Bound::Unbounded => Some(size),
        };
        let (start, end) = match (start, end) {
            (Some(start), Some(end)) if start < end && end <= size => (start, end),
            (start, end) => {
                let index = start.unwrap_or(usize::MAX);
                return Err(ActorError::OutOfBounds {
                    index,
                    len: end.unwrap_or(usize::MAX).saturating_sub(index),
                    size,
                });
            }
        };
        if start == 0 && end == size {
            return Ok(None);
        }
        let t = size_of::<T>() as u64;
        let bytes = start as u64 * t..end as u64 * t;
        let layout = crate::exports::layout_of(&self.cell.layout, &bytes);
        Ok(Some(Part { bytes, layout }))
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
        self.cell.order.mark_on(stream.as_ref())?;
        Ok(self.share())
    }

    fn shared_with(&self, fence: Option<Arc<dyn ExportedFence>>) -> Shared<T> {
        Shared {
            inner: SharedInner::Local(Outgoing {
                cell: Arc::clone(&self.cell),
                fence,
                writable: false,
                part: None,
                joins: false,
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
