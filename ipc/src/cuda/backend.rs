//! [`CudaBackend`] itself: what it holds, how it allocates (legacy, VMM, pool, on a
//! caller's stream), opens (another process's handle, or its own through the registry)
//! and borrows memory allocated elsewhere; its public fence API, delegated to its fence
//! service (`cuda/ordering.rs`); its [`Backend`] impl (the memory trait); and
//! `<dyn Backend>::cuda()`, the downcast from a `dyn Backend`, which lives here so that
//! the trait names no implementation. How a backend is built is `cuda/builder.rs`.

use super::context::{ContextGuard, Quiet};
use super::event::RecordedEvent;
use super::fence::{FenceKind, RecordedFence};
use super::legacy::{DeviceAlloc, IpcMapping};
use super::live::{LiveCounters, LiveMemory, LiveToken};
use super::memory::{
    Access, ExportBacking, Exported, ExportedMem, MapBacking, Mapped, borrowed_bases,
    live_allocations,
};
use super::ordering::Fences;
use super::pool::{ExportPool, ImportedPool, PoolMapping};
use super::result::{self, CudaError};
use super::table::OnceTable;
use super::vmm::{self, VmmRegion};
use super::{CudaExport, SharedStream, lock, unavailable};
use crate::backend::{Allocation, AsAny, Backend, OpenedMem};
use crate::ordering::{ExportedFence, StreamOrdering};
use crate::session::CheckedHandle;
use crate::{Error, Result};
use baton_messages::{
    AllocationId, BackendKind, CudaIpcMemHandle, CudaPoolExportData, DeviceUuid, FenceHandle,
    ProcessId, RawHandle,
};
use cudarc::driver::{CudaContext, CudaStream, sys};
use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The CUDA backend: allocates on one device, exports legacy, VMM or pool handles, opens
/// all three.
///
/// ```no_run
/// use baton_ipc::cuda::{CudaBackend, CudaExport};
/// use baton_ipc::{Backend, Session};
///
/// # fn main() -> baton_ipc::Result<()> {
/// let backend = CudaBackend::new(0, CudaExport::Legacy)?;
/// let session = Session::generate()?;
/// let buffer = backend.allocate(1 << 20)?;
/// buffer.fill(0, 1 << 20, 0xAB)?;
/// // Work on the backend's stream, then an event importers wait on.
/// let event = backend.record_event()?;
/// let handle = buffer.handle(&session).event(event.ipc_handle()).build()?;
/// # let _ = handle; Ok(()) }
/// ```
pub struct CudaBackend {
    pub(super) export: CudaExport,
    pub(super) device: DeviceUuid,
    pub(super) dev: sys::CUdevice,
    /// The VMM granularity, where the device supports VMM with POSIX fds.
    pub(super) vmm_granularity: Option<usize>,
    /// Whether the device can export memory pools as POSIX fds.
    pub(super) pools_supported: bool,
    pub(super) pool_release_threshold: u64,
    /// The largest pool allocation made or opened ([`Error::PoolTooLarge`] past it).
    pub(super) pool_size_limit: u64,
    pub(super) access: Access,
    pub(super) counters: Arc<LiveCounters>,
    pub(super) opens: AtomicU64,
    /// The exportable pool, made on first use.
    pub(super) pool: OnceTable<(), ExportPool>,
    pub(super) imported_pools: OnceTable<(ProcessId, u64), ImportedPool>,
    /// Ids of shared export pools retired at a death or a close, for the next
    /// [`Backend::retire_idle_pools`] to report (at most [`RETIRED_REMEMBERED`]).
    pub(super) retired_pools: Mutex<Vec<u64>>,
    /// Baton's copy kernel (`cuda/copy.rs`), loaded by the first copy plan.
    pub(super) gather: OnceLock<std::result::Result<Arc<super::kernel::Gather>, String>>,
    /// Everything about fences (`cuda/ordering.rs`): the backend's [`StreamOrdering`].
    /// Last, so that it drops after the memory parts, as its fields did.
    pub(super) fences: Fences,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.access.ctx.ordinal())
            .field("device", &self.device)
            .field("export", &self.export)
            .field("fence", &self.fences.fence_kind())
            .field("opens", &self.opens())
            .field("live", &self.live())
            .field("fences", &self.fences)
            .finish()
    }
}

impl CudaBackend {
    /// How this backend exports.
    pub fn export(&self) -> CudaExport {
        self.export
    }

    /// The fences [`record_fence`](Self::record_fence) records.
    pub fn fence_kind(&self) -> FenceKind {
        self.fences.fence_kind()
    }

    /// The device's primary context (cudarc), e.g. to load modules.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.access.ctx
    }

    /// The stream every read, write and fill of this backend's memory is ordered on, and
    /// that waits on importers' events. Launch kernels here to order them with both.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.access.stream
    }

    /// The device ordinal, in this process.
    pub fn ordinal(&self) -> usize {
        self.access.ctx.ordinal()
    }

    /// How many driver-level opens (`cuIpcOpenMemHandle_v2`, `cuMemImportFromShareableHandle`,
    /// `cuMemPoolImportPointer`) this backend has made, failed ones included. Opens in the
    /// exporting process and [`ImportCache`](crate::ImportCache) hits make none.
    pub fn opens(&self) -> u64 {
        self.opens.load(Ordering::Relaxed)
    }

    /// How many fence waits this backend has queued on a stream (`cuStreamWaitEvent`,
    /// `cuStreamWaitValue64`), own fences included.
    pub fn waits(&self) -> u64 {
        self.fences.waits()
    }

    /// What the backend holds now (allocations and mappings not yet released).
    pub fn live(&self) -> LiveMemory {
        self.counters.snapshot()
    }

    /// The VMM allocation granularity, if the device supports VMM with POSIX fds.
    pub fn vmm_granularity(&self) -> Option<usize> {
        self.vmm_granularity
    }

    /// Whether the device can share stream-ordered pools as POSIX fds
    /// ([`CudaExport::Pool`], [`allocate_on`](Self::allocate_on)).
    pub fn pools_supported(&self) -> bool {
        self.pools_supported
    }

    /// (free, total) bytes of device memory (`cuMemGetInfo_v2`).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    #[doc(alias = "cuMemGetInfo")]
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        let _pushed = ContextGuard::push(&self.access.ctx)?;
        // SAFETY: the backend's context is current.
        unsafe { result::mem_get_info() }
    }

    /// Blocks until all work on the backend's stream has completed.
    ///
    /// # Errors
    /// [`Error::Cuda`], including errors of that work.
    pub fn synchronize(&self) -> Result<()> {
        self.access.synchronize()
    }

    /// Blocks until all work in the backend's context — every stream of this process on
    /// the device's primary context — has completed (`cuCtxSynchronize`).
    ///
    /// # Errors
    /// [`Error::Cuda`], including errors of that work.
    pub fn synchronize_context(&self) -> Result<()> {
        self.access
            .ctx
            .synchronize()
            .map_err(result::from_driver("cuCtxSynchronize"))
    }

    /// Records an interprocess event on the backend's stream, after the work launched
    /// there so far. Keep the guard until every importer handed its
    /// [`ipc_handle`](RecordedEvent::ipc_handle) has released its lease and no longer
    /// waits on it: the event is recorded again once this record has completed, for
    /// anyone (Baton's own fences use events recorded for one process, which follow
    /// stricter rules: `cuda/event.rs`).
    ///
    /// # Errors
    /// [`Error::EventsExhausted`] when all events are lent out; [`Error::Cuda`].
    #[doc(alias = "cuEventRecord")]
    pub fn record_event(&self) -> Result<RecordedEvent> {
        self.fences.record_event()
    }

    /// Records an interprocess event on `stream` (of this backend's context).
    ///
    /// # Errors
    /// As [`record_event`](Self::record_event).
    pub fn record_event_on(&self, stream: &CudaStream) -> Result<RecordedEvent> {
        self.fences.record_event_on(stream)
    }

    /// Records a fence of the backend's [`fence_kind`](Self::fence_kind) on the backend's
    /// stream, after the work launched there so far.
    ///
    /// # Errors
    /// [`Error::EventsExhausted`] / [`Error::FencesExhausted`] when all are lent out;
    /// [`Error::Cuda`].
    pub fn record_fence(&self) -> Result<RecordedFence> {
        self.fences.record_fence()
    }

    /// Records a fence on `stream` (a stream of this backend's device).
    ///
    /// # Errors
    /// As [`record_fence`](Self::record_fence).
    #[doc(alias = "cuStreamWriteValue64")]
    pub fn record_fence_on(&self, stream: &CudaStream) -> Result<RecordedFence> {
        self.fences.record_fence_on(stream)
    }

    /// Records a fence on `stream` that process `to` can wait on: with counter fences, a
    /// value written into the lane of `to`'s inbox that `to` lent us
    /// ([`StreamOrdering::accept_inbox`]) — after a fence of our own on `stream`, which a release
    /// stream waits on — or, when `to` lent us none, a pooled interprocess event; with
    /// event fences, a pooled event. `to` may be this process.
    ///
    /// # Errors
    /// As [`record_fence_on`](Self::record_fence_on); a driver error mapping `to`'s inbox;
    /// [`Error::EventAcrossPidNamespaces`] where the fence would be an event and `to`
    /// lives in another PID namespace (events do not cross containers; counters do).
    #[doc(alias = "cuStreamWriteValue64")]
    pub fn record_fence_for(
        &self,
        stream: &CudaStream,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        self.fences.record_fence_for(stream, to)
    }

    /// (alive, lent out) fences of the backend's kind: events, or counter slots (a slot
    /// whose fence dropped counts as lent until its value has landed: the slab is read
    /// back here to tell).
    pub fn fence_counts(&self) -> (usize, usize) {
        self.fences.fence_counts()
    }

    /// Makes the backend's stream wait on a fence `exporter` recorded.
    ///
    /// # Errors
    /// As [`wait_fence_on`](Self::wait_fence_on).
    pub fn wait_fence(&self, exporter: &ProcessId, fence: &FenceHandle) -> Result<()> {
        self.fences.wait_fence(exporter, fence)
    }

    /// Makes `stream` (of this backend's context) wait on a fence `exporter` recorded:
    /// work queued on `stream` afterwards runs after the work the fence was recorded
    /// behind. Another process's events and counter slabs are opened once and kept until
    /// [`forget_process`](Backend::forget_process); this process's own are used directly.
    ///
    /// The fence must come from an authenticated peer (once the wire carries fences, from
    /// a sealed, checked handle). For a counter fence, this backend must outlive the wait:
    /// dropping it unmaps the counters a stream may still be waiting on.
    ///
    /// # Errors
    /// [`Error::Cuda`] (the fence cannot be opened; a counter fence on a device without
    /// stream memory operations, or outside its slab); [`Error::Timeout`] if another
    /// thread's open of the same object hangs; [`Error::EventAcrossPidNamespaces`] for an
    /// event of a process in another PID namespace (refused before any driver call).
    #[doc(alias = "cuStreamWaitEvent")]
    #[doc(alias = "cuStreamWaitValue64")]
    pub fn wait_fence_on(
        &self,
        exporter: &ProcessId,
        fence: &FenceHandle,
        stream: &CudaStream,
    ) -> Result<()> {
        self.fences.wait_fence_on(exporter, fence, stream)
    }

    /// (alive, lent out or retired with work still running) interprocess events of the
    /// pool (retired events whose work completed are swept free first).
    pub fn event_counts(&self) -> (usize, usize) {
        self.fences.event_counts()
    }

    /// How many other processes' events this backend holds open.
    pub fn opened_events(&self) -> usize {
        self.fences.opened_events()
    }

    /// How many other processes' memory pools this backend has imported.
    pub fn imported_pools(&self) -> usize {
        self.imported_pools.len()
    }

    /// Allocates `size` bytes of exportable memory from the backend's stream-ordered pool
    /// on `stream` — your stream, of this backend's device — in its order, as cudarc's
    /// `alloc` would: the memory is ready for work queued on `stream` after this call, is
    /// zeroed there, and is freed there (`cuMemFreeAsync`) when the [`Allocation`] is freed
    /// or dropped. Handles of it are [`RawHandle::CudaPool`], whatever the backend's
    /// [`export`](Self::export).
    ///
    /// The backend's own accesses ([`Allocation::read`] and friends, on the backend's
    /// stream) are ordered after the allocation. Importers must not touch the memory before
    /// the allocation and your work on it have run: record a fence on `stream` after that
    /// work ([`record_event_on`](Self::record_event_on)) and send it with the handle.
    ///
    /// ```no_run
    /// use baton_ipc::cuda::{CudaBackend, CudaExport};
    /// use baton_ipc::{MemPtr, Session};
    ///
    /// # fn main() -> baton_ipc::Result<()> {
    /// let backend = CudaBackend::new(0, CudaExport::Pool)?;
    /// let session = Session::generate()?;
    /// // Your stream, on the backend's context.
    /// let stream = backend.context().new_stream().expect("a stream");
    /// let buffer = backend.allocate_on(&stream, 64 << 20)?;
    /// let MemPtr::Device(ptr) = buffer.ptr() else { unreachable!() };
    /// // ... launch kernels on `stream` that write `ptr` (a u64 kernel argument) ...
    /// # let _ = ptr;
    /// let ready = backend.record_event_on(&stream)?;
    /// let handle = buffer.handle(&session).event(ready.ipc_handle()).build()?;
    /// // Send `handle` with `buffer.export_fd()` (the pool's descriptor) beside the frame;
    /// // keep `ready` until the importer released it.
    /// # let _ = handle; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::ZeroSize`]; [`Error::BackendUnavailable`] if the device cannot share pools;
    /// [`Error::Cuda`] (`CUDA_ERROR_INVALID_CONTEXT` for a stream of another device, out of
    /// memory, …).
    #[doc(alias = "cuMemAllocFromPoolAsync")]
    pub fn allocate_on(&self, stream: &Arc<CudaStream>, size: usize) -> Result<Allocation> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        if stream.context().cu_device() != self.dev {
            return Err(Error::Cuda {
                op: "cuMemAllocFromPoolAsync",
                code: CudaError::INVALID_CONTEXT,
            });
        }
        let id = Allocation::reserve_id();
        let shared: SharedStream = Arc::new(Quiet::new(Arc::clone(stream)));
        let exported = self.allocate_pool(id, size, shared)?;
        {
            let _pushed = ContextGuard::push(stream.context())?;
            // SAFETY: the allocation is `size` bytes of our memory, valid on `stream` in
            // its order (just allocated there); the stream is live in its current context.
            unsafe { result::memset_d8_async(exported.ptr, 0, exported.size, stream.cu_stream()) }?;
            self.order_after(stream)?;
        }
        Ok(self.finish_allocation(exported))
    }

    /// Makes the backend's stream wait until `stream` reaches the point queued so far (a
    /// private event: record, wait, destroy). The caller pushed `stream`'s context.
    fn order_after(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: a context is current (the caller's push); the event is destroyed below,
        // once, and destroying an event a stream still waits on is allowed.
        let ev = unsafe { result::event_create() }?;
        // SAFETY: `ev` is live; both streams are live, of the same device.
        let queued = unsafe { result::event_record(ev, stream.cu_stream()) }.and_then(|()| {
            // SAFETY: as above.
            unsafe { result::stream_wait_event(self.access.stream.cu_stream(), ev) }
        });
        // SAFETY: our event, destroyed once.
        let destroyed = unsafe { result::event_destroy(ev) };
        queued.and(destroyed)
    }

    /// Gives memory the backend's pool holds but no allocation uses back to the device,
    /// keeping `keep` bytes reserved (`cuMemPoolTrimTo`). Does nothing if the pool was
    /// never used.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    #[doc(alias = "cuMemPoolTrimTo")]
    pub fn trim_pool(&self, keep: usize) -> Result<()> {
        match self.pool.get(&()) {
            Some(pool) => pool.trim_to(keep),
            None => Ok(()),
        }
    }

    /// [`Backend::allocate`] shared as `export` rather than the backend's own
    /// [`export`](Self::export): `size` bytes (VMM: rounded up to the granularity), zeroed.
    /// Importers open any kind. Baton's bundles use it to be VMM memory where the device
    /// has it ([`bulk_export`](Self::bulk_export)).
    ///
    /// # Errors
    /// As [`Backend::allocate`]; [`Error::BackendUnavailable`] for an export the device
    /// does not support.
    pub fn allocate_as(&self, export: CudaExport, size: usize) -> Result<Allocation> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let id = Allocation::reserve_id();
        let exported = match export {
            CudaExport::Legacy => self.allocate_legacy(id, size)?,
            CudaExport::Vmm => self.allocate_vmm(id, size)?,
            CudaExport::Pool => self.allocate_pool(id, size, Arc::clone(&self.access.stream))?,
        };
        // Also completes a pool allocation before anyone can be handed it (the driver asks
        // that importers not touch it earlier).
        self.access.fill(exported.ptr, exported.size, 0)?;
        Ok(self.finish_allocation(exported))
    }

    /// The export for large buffers an importer reads whole — a model's weights: VMM where
    /// the device supports it, else the backend's own. An importer reads a VMM import at
    /// the bandwidth of its own memory, and a legacy IPC import about 25 % slower (an
    /// H200: a 14 GiB flat copy from a legacy import took 9.0 ms, from a VMM import 7.1,
    /// from local memory 7.2; `bench/loader_probe.py`, docs/BENCHMARKS.md).
    pub fn bulk_export(&self) -> CudaExport {
        if self.vmm_granularity.is_some() {
            CudaExport::Vmm
        } else {
            self.export
        }
    }

    /// The allocation that holds `ptr`, a device address of this process: its base and
    /// size (`cuMemGetAddressRange`). Tensors that share one allocation (as PyTorch's caching
    /// allocator packs them) are [borrowed](Self::borrow) together, through their base.
    ///
    /// # Errors
    /// [`Error::NotBorrowable`] for an address no allocation of the driver's holds.
    #[doc(alias = "cuMemGetAddressRange")]
    pub fn address_range(&self, ptr: u64) -> Result<(u64, usize)> {
        let _pushed = ContextGuard::push(&self.access.ctx)?;
        // SAFETY: a context is current.
        unsafe { result::mem_get_address_range(ptr) }.map_err(|e| Error::NotBorrowable {
            ptr,
            reason: format!("no CUDA allocation of this process holds it ({e})"),
        })
    }

    /// Wraps device memory someone else allocated — PyTorch's default caching allocator,
    /// `cuMemAlloc`, `cudaMalloc` — as an [`Allocation`] importers open as legacy IPC
    /// ([`RawHandle::CudaIpc`], whatever the backend's [`export`](Self::export)). `base` is
    /// an allocation's base ([`address_range`](Self::address_range)): the whole allocation
    /// is shared, since legacy IPC maps whole allocations, and a peer it is leased to can
    /// reach all of it. Baton never frees it: when the allocation would be freed (no
    /// handle, lease or mapping left, no work pending) it drops `keep` instead.
    ///
    /// Refused ([`Error::NotBorrowable`]) for memory legacy IPC cannot share — PyTorch's
    /// expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`) and other
    /// VMM memory, memory-pool (`cudaMallocAsync`) memory, host memory —, memory of
    /// another device, an address that is not an allocation's base, and an allocation this
    /// process borrowed already and has not released (an importer may open an allocation
    /// only once).
    ///
    /// # Safety
    /// `keep` keeps the whole allocation allocated until it drops, and nothing frees it
    /// meanwhile: Baton's freeing rule (never freed while a peer may map it or work on it
    /// may run) holds only if the allocation lives as long as `keep`.
    ///
    /// # Errors
    /// [`Error::NotBorrowable`]; [`Error::Cuda`].
    #[doc(alias = "cuIpcGetMemHandle")]
    pub unsafe fn borrow(&self, base: u64, keep: Box<dyn Send + Sync>) -> Result<Allocation> {
        let refuse = |reason: String| Error::NotBorrowable { ptr: base, reason };
        let (found, size) = self.address_range(base)?;
        if found != base {
            return Err(refuse(format!(
                "it lies inside the allocation at {found:#x}: borrow that base"
            )));
        }
        let handle = {
            let _pushed = ContextGuard::push(&self.access.ctx)?;
            // SAFETY: the driver is initialised (a context is current).
            let ordinal = unsafe { result::pointer_device_ordinal(base) }
                .map_err(|e| refuse(format!("the driver does not know it ({e})")))?;
            if usize::try_from(ordinal).ok() != Some(self.ordinal()) {
                return Err(refuse(format!(
                    "it is memory of device {ordinal}, and this backend's is {}",
                    self.ordinal()
                )));
            }
            // SAFETY: a context is current; `base` is the base of a live allocation (the
            // driver just said so); the driver refuses memory it cannot share.
            unsafe { result::ipc_get_mem_handle(base) }.map_err(|e| {
                refuse(format!(
                    "legacy CUDA IPC cannot share it ({e}): memory from cuMemAlloc/cudaMalloc \
                     (PyTorch's default caching allocator) can be leased; expandable \
                     segments, cudaMallocAsync pools and VMM memory cannot"
                ))
            })?
        };
        let id = Allocation::reserve_id();
        {
            let mut borrowed = lock(borrowed_bases());
            if borrowed.contains_key(&base) {
                return Err(refuse(
                    "this process borrowed the allocation already and has not released it"
                        .to_owned(),
                ));
            }
            borrowed.insert(base, id);
        }
        tracing::debug!(alloc = %id, size, "borrowed CUDA memory");
        Ok(self.finish_allocation(Exported {
            id,
            kind: BackendKind::CudaLegacy,
            access: self.access.clone(),
            ptr: base,
            size,
            _live: LiveToken::new(&self.counters, false, size),
            backing: ExportBacking::Borrowed {
                handle: CudaIpcMemHandle(handle),
                keep: Some(keep),
            },
        }))
    }

    fn vmm_granularity_or_err(&self) -> Result<usize> {
        self.vmm_granularity.ok_or_else(|| {
            unavailable(format!(
                "device {} cannot map VMM memory shared as POSIX file descriptors",
                self.ordinal()
            ))
        })
    }

    /// The exportable pool, made on first use.
    pub(super) fn export_pool(&self) -> Result<Arc<ExportPool>> {
        if !self.pools_supported {
            return Err(unavailable(format!(
                "device {} cannot share memory pools as POSIX file descriptors",
                self.ordinal()
            )));
        }
        self.pool.get_or_open(&(), || {
            ExportPool::create(&self.access.ctx, self.dev, self.pool_release_threshold)
        })
    }

    /// Checks, before any driver call that opens, that memory on `device` (`pool`: from a
    /// stream-ordered pool) may be
    /// mapped here: the device is ours, or one this process sees (devices are matched by
    /// UUID, whatever `CUDA_VISIBLE_DEVICES` numbers them) and ours can map its memory —
    /// and then only legacy or VMM memory. Pool memory of another GPU is refused
    /// ([`Error::PoolAcrossDevices`]): its pages go with its exporter, and our work on them
    /// would fault and end our context.
    fn check_device(&self, device: DeviceUuid, pool: bool) -> Result<()> {
        if device == self.device {
            return Ok(());
        }
        let here = self.device;
        // SAFETY: the driver is initialised (we exist).
        let n = unsafe { result::device_count() }?;
        let mut found = None;
        for ordinal in 0..n {
            // SAFETY: as above; `ordinal` is in range.
            let dev = unsafe { result::device_get(ordinal) }?;
            // SAFETY: as above; `dev` from `device_get`.
            if unsafe { result::device_uuid(dev) }? == device.0 {
                found = Some(dev);
                break;
            }
        }
        let Some(dev) = found else {
            return Err(Error::DeviceNotFound { device, here });
        };
        // SAFETY: as above; both devices from `device_get` (ours from our context).
        if !unsafe { result::can_access_peer(self.dev, dev) }? {
            return Err(Error::DeviceUnreachable { device, here });
        }
        if pool {
            return Err(Error::PoolAcrossDevices { device, here });
        }
        Ok(())
    }

    fn allocate_legacy(&self, id: AllocationId, size: usize) -> Result<Exported> {
        let alloc = DeviceAlloc::new(&self.access.ctx, size)?;
        let handle = CudaIpcMemHandle(alloc.ipc_handle()?);
        Ok(Exported {
            id,
            kind: BackendKind::CudaLegacy,
            access: self.access.clone(),
            ptr: alloc.ptr(),
            size: alloc.size(),
            _live: LiveToken::new(&self.counters, false, alloc.size()),
            backing: ExportBacking::Legacy { alloc, handle },
        })
    }

    fn allocate_vmm(&self, id: AllocationId, size: usize) -> Result<Exported> {
        let g = self.vmm_granularity_or_err()?;
        let rounded = vmm::round_up(size, g).ok_or(Error::Cuda {
            op: "cuMemCreate",
            code: CudaError::OUT_OF_MEMORY,
        })?;
        let region = VmmRegion::create(&self.access.ctx, self.dev, rounded, g)?;
        let fd = region.export_fd()?;
        Ok(Exported {
            id,
            kind: BackendKind::CudaVmm,
            access: self.access.clone(),
            ptr: region.ptr(),
            size: region.size(),
            _live: LiveToken::new(&self.counters, false, region.size()),
            backing: ExportBacking::Vmm { region, fd },
        })
    }

    /// Refuses pool memory past the bound the driver imports without crashing.
    fn check_pool_size(&self, size: u64) -> Result<()> {
        if size > self.pool_size_limit {
            return Err(Error::PoolTooLarge {
                size,
                limit: self.pool_size_limit,
            });
        }
        Ok(())
    }

    /// `size` bytes from the pool on `stream`, with their export data.
    fn allocate_pool(
        &self,
        id: AllocationId,
        size: usize,
        stream: SharedStream,
    ) -> Result<Exported> {
        self.check_pool_size(size as u64)?;
        let alloc = self.export_pool()?.allocate(size, stream)?;
        let data = CudaPoolExportData(alloc.export_data()?);
        Ok(Exported {
            id,
            kind: BackendKind::CudaPool,
            access: self.access.clone(),
            ptr: alloc.ptr(),
            size: alloc.size(),
            _live: LiveToken::new(&self.counters, false, alloc.size()),
            backing: ExportBacking::Pool { alloc, data },
        })
    }

    /// Registers the allocation for opens in this process and wraps it.
    fn finish_allocation(&self, exported: Exported) -> Allocation {
        let exported = Arc::new(exported);
        let id = exported.id;
        lock(live_allocations()).insert(id, Arc::downgrade(&exported));
        tracing::debug!(alloc = %id, size = exported.size, kind = ?exported.kind, "CUDA memory allocated");
        Allocation::with_id(
            id,
            exported.kind,
            self.device,
            Box::new(ExportedMem(exported)),
        )
    }

    /// A handle of this very process: the exporter's own memory.
    fn open_local(&self, handle: &CheckedHandle<'_>) -> Result<Mapped> {
        let exported = lock(live_allocations())
            .get(&handle.alloc)
            .and_then(Weak::upgrade)
            .ok_or(Error::AllocationGone {
                exporter: handle.exporter,
                alloc: handle.alloc,
            })?;
        if exported.kind != handle.backend || (exported.size as u64) < handle.alloc_size {
            return Err(Error::MemoryTooSmall {
                claimed: handle.alloc_size,
                actual: exported.size as u64,
            });
        }
        tracing::debug!(alloc = %handle.alloc, "opened in the exporting process: its own memory");
        Ok(Mapped {
            access: self.access.clone(),
            ptr: exported.ptr,
            size: handle.alloc_size as usize,
            backing: MapBacking::Local(exported),
            _live: None,
        })
    }

    /// The pool `exporter` calls `pool`: imported before, or now from `fd`.
    fn imported_pool(
        &self,
        handle: &CheckedHandle<'_>,
        pool: u64,
        slot: Option<u8>,
        fd: Option<OwnedFd>,
    ) -> Result<Arc<ImportedPool>> {
        let key = (handle.exporter.process, pool);
        if let Some(imported) = self.imported_pools.get(&key) {
            // Imported already (the descriptor came again): the extra descriptor closes.
            drop(fd);
            return Ok(imported);
        }
        let fd = fd.ok_or(match slot {
            Some(slot) => Error::MissingFdSlot { slot },
            None => Error::PoolNotImported {
                exporter: handle.exporter,
                pool,
            },
        })?;
        self.imported_pools.get_or_open(&key, || {
            tracing::debug!(exporter = %handle.exporter, pool, "importing a memory pool");
            // The imported pool keeps the memory; the descriptor closes after.
            ImportedPool::import(&self.access.ctx, self.dev, fd.as_fd()).map(Arc::new)
        })
    }

    /// Maps a checked handle of another process.
    pub(super) fn open_remote(
        &self,
        handle: &CheckedHandle<'_>,
        fd: Option<OwnedFd>,
    ) -> Result<Mapped> {
        let pool = matches!(handle.raw, RawHandle::CudaPool { .. });
        self.check_device(handle.device, pool)?;
        if pool {
            self.check_pool_size(handle.alloc_size)?;
        }
        let size = usize::try_from(handle.alloc_size).map_err(|_| Error::MemoryTooSmall {
            claimed: handle.alloc_size,
            actual: usize::MAX as u64,
        })?;
        let too_small = |actual: usize| Error::MemoryTooSmall {
            claimed: handle.alloc_size,
            actual: actual as u64,
        };
        let (ptr, backing) = match &handle.raw {
            RawHandle::CudaIpc(raw) => {
                self.opens.fetch_add(1, Ordering::Relaxed);
                let mut mapping = IpcMapping::open(&self.access.ctx, &raw.0)?;
                match mapping.mapped_size() {
                    Ok(actual) if actual < size => {
                        mapping.close()?;
                        return Err(too_small(actual));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot query the mapped size; trusting the sealed handle");
                    }
                }
                (mapping.ptr(), MapBacking::Legacy(mapping))
            }
            RawHandle::CudaVmmFd { slot } => {
                let fd = fd.ok_or(match slot {
                    Some(slot) => Error::MissingFdSlot { slot: *slot },
                    None => Error::NotMapped {
                        exporter: handle.exporter,
                        alloc: handle.alloc,
                    },
                })?;
                let g = self.vmm_granularity_or_err()?;
                self.opens.fetch_add(1, Ordering::Relaxed);
                let region = VmmRegion::import(&self.access.ctx, self.dev, fd.as_fd(), size, g)?;
                // The imported handle keeps the memory; the descriptor is no longer needed.
                drop(fd);
                (region.ptr(), MapBacking::Vmm(region))
            }
            RawHandle::CudaPool {
                pool,
                pool_slot,
                ptr,
            } => {
                let imported = self.imported_pool(handle, *pool, *pool_slot, fd)?;
                self.opens.fetch_add(1, Ordering::Relaxed);
                let mut mapping =
                    PoolMapping::import(imported, &ptr.0, Arc::clone(&self.access.stream))?;
                match mapping.mapped_size() {
                    Ok(actual) if actual < size => {
                        mapping.close()?;
                        return Err(too_small(actual));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot query the mapped size; trusting the sealed handle");
                    }
                }
                (mapping.ptr(), MapBacking::Pool(mapping))
            }
            _ => {
                return Err(Error::UnsupportedBackend {
                    kind: handle.backend,
                });
            }
        };
        Ok(Mapped {
            access: self.access.clone(),
            ptr,
            size,
            backing,
            _live: Some(LiveToken::new(&self.counters, true, size)),
        })
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn kind(&self) -> BackendKind {
        self.export.kind()
    }

    fn device(&self) -> DeviceUuid {
        self.device
    }

    fn can_open(&self, kind: BackendKind) -> bool {
        matches!(
            kind,
            BackendKind::CudaLegacy | BackendKind::CudaVmm | BackendKind::CudaPool
        )
    }

    /// Allocates `size` bytes (VMM: rounded up to the granularity), zeroed. Pool memory is
    /// allocated on the backend's stream, which is synchronised before this returns.
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.allocate_as(self.export, size)
    }

    /// Maps the allocation. Pool handles: the first handle of a pool from an exporter
    /// process must come with the pool's descriptor (imported then, once); later ones may
    /// come without (`pool_slot: None`), and a descriptor that comes again is closed.
    fn open(&self, handle: CheckedHandle<'_>, fd: Option<OwnedFd>) -> Result<OpenedMem> {
        if !self.can_open(handle.backend) {
            return Err(Error::UnsupportedBackend {
                kind: handle.backend,
            });
        }
        let mapped = if handle.exporter.process == crate::process::current() {
            self.open_local(&handle)?
        } else {
            let mapped = self.open_remote(&handle, fd)?;
            tracing::debug!(exporter = %handle.exporter, alloc = %handle.alloc, "CUDA memory opened");
            mapped
        };
        Ok(OpenedMem::new(&handle, Box::new(mapped)))
    }

    fn ordering(&self) -> &dyn StreamOrdering {
        &self.fences
    }

    /// Yes: opens, closes, frees and fills are driver calls (up to milliseconds for VMM).
    fn blocking_calls(&self) -> bool {
        true
    }

    /// Drops the process's opened events and imported pools (mappings from a pool keep it
    /// until they close). If it is dead, also releases every wait of ours on its counter
    /// fences ([`release_dead`](StreamOrdering::release_dead)) and retires our export pool. A
    /// process that only closed its links is left to its deadline: its queued work still
    /// writes our inbox; the node watches for its death and calls this again.
    fn forget_process(&self, process: &ProcessId) {
        let of = |p: &ProcessId| p == process;
        let dead = crate::process::liveness(process) == crate::process::Liveness::Dead;
        if dead {
            // A pool allocation freed after an importer died mapping it stays reserved in
            // the driver's pool: trimming does not return it (H100, driver 580),
            // destroying the pool does. So a death retires our export pool: new
            // allocations come from a fresh one (importers import it once more), and the
            // old one is destroyed with its last allocation. Only a death: an importer
            // that closed its links unmapped first. The other importers are told.
            self.retire(self.pool.take_where(|_| true));
        }
        drop(self.imported_pools.take_where(|(p, _)| of(p)));
        self.fences.forget_process(process, dead);
    }

    /// Retires the export pool (destroyed with its last allocation) and drops the imported
    /// pools (mappings keep theirs): see [`Backend::release_idle`].
    fn release_idle(&self) {
        self.retire(self.pool.take_where(|_| true));
        drop(self.imported_pools.take_where(|_| true));
    }

    /// Retires the export pool if its descriptor was sent and it has had no allocation for
    /// [`POOL_IDLE_RETIRE`](super::POOL_IDLE_RETIRE): see [`Backend::retire_idle_pools`].
    fn retire_idle_pools(&self) -> Vec<u64> {
        let idle = |p: &Arc<ExportPool>| {
            p.idle_shared_for()
                .is_some_and(|idle| idle >= super::POOL_IDLE_RETIRE)
        };
        let retired = self.pool.take_where_value(|_, p| idle(p));
        if !retired.is_empty() {
            tracing::debug!(
                "retiring an idle export pool another process imported: its memory goes back \
                 to the device once the importers drop theirs"
            );
        }
        self.retire(retired);
        std::mem::take(&mut *lock(&self.retired_pools))
    }

    /// Drops our import of `exporter`'s retired pool: see [`Backend::forget_pool`].
    fn forget_pool(&self, exporter: &ProcessId, pool: u64) {
        let dropped = self
            .imported_pools
            .take_where(|(p, id)| p == exporter && *id == pool);
        if !dropped.is_empty() {
            tracing::debug!(%exporter, pool, "dropping the import of a retired memory pool");
        }
        drop(dropped);
    }
}

/// How many ids of retired pools a backend keeps for its next
/// [`Backend::retire_idle_pools`] (a node that never asks again, after its close, keeps no
/// more than these).
const RETIRED_REMEMBERED: usize = 16;

impl CudaBackend {
    /// Drops retired export pools (each is destroyed with its last allocation) and
    /// remembers the ids of those another process may have imported, for the node to tell
    /// their importers ([`Backend::retire_idle_pools`]).
    fn retire(&self, pools: Vec<Arc<ExportPool>>) {
        let mut ids = lock(&self.retired_pools);
        for pool in pools.iter().filter(|p| p.shared()) {
            if ids.len() < RETIRED_REMEMBERED {
                ids.push(pool.id());
            }
        }
        drop(ids);
        drop(pools);
    }
}

impl dyn Backend {
    /// The CUDA backend, if this is one (for cudarc interoperation): the downcast lives here,
    /// beside the CUDA backend, so that the [`Backend`] trait names no implementation.
    pub fn cuda(&self) -> Option<&CudaBackend> {
        AsAny::as_any(self).downcast_ref()
    }
}
