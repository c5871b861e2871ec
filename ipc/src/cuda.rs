//! The CUDA backend: device memory shared between processes, on the CUDA driver API
//! (cudarc's `driver::sys`, loaded at run time so that every build works without a CUDA
//! toolkit, and runs on any driver of CUDA 11.4 or newer).
//!
//! Two ways to export, chosen per backend ([`CudaExport`], or [`EXPORT_ENV`]); one backend
//! opens both:
//!
//! | | legacy IPC ([`CudaExport::Legacy`]) | VMM ([`CudaExport::Vmm`]) |
//! |---|---|---|
//! | allocate | `cuMemAlloc_v2` (not `cuMemAllocAsync`: its memory cannot be exported) | `cuMemCreate` (POSIX-fd handle type, size rounded up to the granularity), reserve, map, set access |
//! | export | 64-byte `cuIpcGetMemHandle` in the handle | `cuMemExportToShareableHandle` fd, sent beside the frame (`SCM_RIGHTS`); the handle names its slot |
//! | open | `cuIpcOpenMemHandle_v2` with lazy peer access | import the fd, reserve, map, set access |
//! | release | `cuIpcCloseMemHandle` / `cuMemFree_v2` | unmap, free the range, `cuMemRelease` |
//!
//! - **Layers**, as in cudarc: `result` holds one thin `Result` wrapper per driver call;
//!   the RAII types of `legacy`, `vmm` and `event` own what those calls make and release it
//!   in `Drop` with their context bound; [`CudaBackend`] puts them behind the [`Backend`]
//!   trait. The context and stream are cudarc's safe [`CudaContext`] (the device's primary
//!   context) and [`CudaStream`], exposed so callers can launch their own kernels
//!   (device pointers are `u64` kernel arguments, [`MemPtr::Device`]).
//! - **Stream order.** Every read, write and fill of this backend's memory is a copy or
//!   memset on the backend's [`stream`](CudaBackend::stream), followed by a synchronise of
//!   that stream. Work launched on that stream is ordered with them.
//! - **IPC events.** An exporter records an event after the work that produced a buffer
//!   ([`CudaBackend::record_event`]) and puts its handle in the handle message; the
//!   importer's [`ImportCache`](crate::ImportCache) makes the backend stream wait on it
//!   ([`Backend::wait_event`]) before handing the buffer out, on a cache miss and on a hit.
//!   See [`event`](RecordedEvent) for the reuse contract.
//! - **Identity.** Devices are named by UUID (`cuDeviceGetUuid_v2`), never by ordinal. A
//!   handle opened in the very process that exported it (the driver refuses that for
//!   legacy handles) yields the exporter's own memory, found in a process-local registry of
//!   live allocations; the memory is then freed when both the exporter's [`Allocation`]
//!   and that [`OpenedMem`] are gone.
//! - **Availability.** With dynamic loading, cudarc panics when the driver library is
//!   missing, so [`probe`] looks for it before any other driver call, and reports its
//!   absence as [`Error::BackendUnavailable`].
//!
//! # Safety
//!
//! This module and its children hold the CUDA backend's `unsafe` code:
//! - no driver call is made before [`probe`] found the library and `cuInit` succeeded:
//!   [`CudaBackend::new`] calls it first, and every other path starts from a backend;
//! - each driver object (allocation, mapping, VMM region, event) has exactly one owner,
//!   which releases it once, with its context bound, and holds an `Arc` of that context;
//! - memory accessors ([`Allocation`], [`OpenedMem`]) check `offset + len <= size` before
//!   calling in, and the owner of the memory outlives every access (the accessors borrow
//!   it), so every copy stays inside mapped device memory; host buffers are Rust slices.
//! - raw handle bytes reach the driver only from a [`CheckedHandle`] (digest verified).

mod event;
mod legacy;
mod result;
mod vmm;

pub use cudarc;
pub use event::{DEFAULT_EVENT_LIMIT, RecordedEvent};
pub use result::CudaError;

use crate::backend::{
    Allocation, Backend, ExportableMemory, FreeWhileMapped, MemPtr, OpenedMem, RawMemory,
};
use crate::session::CheckedHandle;
use crate::{Error, Result};
use baton_messages::{
    AllocationId, BackendKind, CudaIpcMemHandle, DeviceUuid, ExporterId, IpcEventHandle, ProcessId,
    RawHandle,
};
use cudarc::driver::{CudaContext, CudaStream, sys};
use event::{EventPool, OpenedEvent};
use legacy::{DeviceAlloc, IpcMapping};
use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use vmm::VmmRegion;

/// The environment variable that picks how a CUDA backend exports: `legacy` (the default)
/// or `vmm`.
pub const EXPORT_ENV: &str = "BATON_CUDA_EXPORT";
/// The environment variable that picks the device ordinal of [`CudaBackend::from_env`]
/// (default 0).
pub const DEVICE_ENV: &str = "BATON_CUDA_DEVICE";

/// How many opened events of other processes a backend keeps before it drops them all
/// (destroying an opened event is safe even while a stream waits on it).
const OPENED_EVENT_CAP: usize = 4096;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a single map operation: a panic cannot leave the map
    // half-updated, so a poisoned lock is safe to keep using.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::BackendUnavailable {
        backend: "cuda",
        reason: reason.into(),
    }
}

/// Looks for the CUDA driver, initialises it, and counts the devices this process sees.
/// Makes no driver call unless the driver library is present. The answer is computed once
/// per process.
///
/// # Errors
/// [`Error::BackendUnavailable`] with the reason: no driver library, `cuInit` failed, or no
/// device visible.
pub fn probe() -> Result<usize> {
    static PROBE: OnceLock<Result<usize, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: loading libcuda runs its initialisers, which the NVIDIA driver
            // supports in any process; the library is unloaded again at once.
            if !unsafe { sys::is_culib_present() } {
                return Err(
                    "the NVIDIA driver library (libcuda.so) was not found: install \
                     the NVIDIA driver, or use the host backend (BATON_BACKEND=host)"
                        .to_owned(),
                );
            }
            // SAFETY: the library is present (checked just above).
            unsafe { result::init() }.map_err(|e| {
                format!("the NVIDIA driver did not initialise ({e}): check the driver installation")
            })?;
            // SAFETY: the driver is initialised (just above).
            let n = unsafe { result::device_count() }.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err(
                    "the NVIDIA driver sees no CUDA device: check CUDA_VISIBLE_DEVICES".to_owned(),
                );
            }
            Ok(n)
        })
        .clone()
        .map_err(unavailable)
}

/// How a [`CudaBackend`] exports the memory it allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CudaExport {
    /// `cuMemAlloc_v2` memory shared with a 64-byte legacy IPC handle.
    #[default]
    Legacy,
    /// `cuMemCreate` memory shared as a POSIX file descriptor (`SCM_RIGHTS`).
    Vmm,
}

impl CudaExport {
    /// Parses `legacy` or `vmm`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "legacy" | "ipc" | "" => Some(Self::Legacy),
            "vmm" => Some(Self::Vmm),
            _ => None,
        }
    }

    /// The choice in [`EXPORT_ENV`], `Legacy` if unset.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] if it holds something else.
    pub fn from_env() -> Result<Self> {
        match std::env::var(EXPORT_ENV) {
            Err(_) => Ok(Self::Legacy),
            Ok(v) => Self::parse(&v).ok_or_else(|| {
                unavailable(format!("{EXPORT_ENV}={v:?} is not one of legacy, vmm"))
            }),
        }
    }

    /// The kind of handle this way of exporting makes.
    pub fn kind(self) -> BackendKind {
        match self {
            Self::Legacy => BackendKind::CudaLegacy,
            Self::Vmm => BackendKind::CudaVmm,
        }
    }
}

/// A context and a stream: what every access to device bytes binds and orders on.
#[derive(Clone)]
struct Access {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl Access {
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(result::from_driver("cuCtxSetCurrent"))
    }

    fn sync(&self) -> Result<()> {
        // SAFETY: the stream is live (we hold it) and its context was bound by the caller.
        unsafe { result::stream_synchronize(self.stream.cu_stream()) }
    }

    /// Copies `dst.len()` bytes from device address `src` (the caller checked the range
    /// lies in memory that outlives the call).
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the stream is live in the bound context; `src..src + len` is mapped
        // (caller); `dst` is not touched until the synchronise below returns.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }?;
        self.sync()
    }

    fn write(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: as in `read`, directions swapped; `src` outlives the synchronise below.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }?;
        self.sync()
    }

    fn fill(&self, dst: u64, len: usize, byte: u8) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the stream is live in the bound context; `dst..dst + len` is mapped.
        unsafe { result::memset_d8_async(dst, byte, len, self.stream.cu_stream()) }?;
        self.sync()
    }
}

/// What backs an exported allocation.
enum ExportBacking {
    Legacy {
        alloc: DeviceAlloc,
        handle: CudaIpcMemHandle,
    },
    Vmm {
        region: VmmRegion,
        /// The exported descriptor, kept for the allocation's life and sent with every
        /// handle of it.
        fd: OwnedFd,
    },
}

/// Memory this process allocated for export. Shared (`Arc`) between the exporter's
/// [`Allocation`] and any [`OpenedMem`] this same process opened from its handle.
struct Exported {
    id: AllocationId,
    kind: BackendKind,
    access: Access,
    ptr: u64,
    size: usize,
    backing: ExportBacking,
}

impl Exported {
    fn release(&mut self) -> Result<()> {
        match &mut self.backing {
            ExportBacking::Legacy { alloc, .. } => alloc.free(),
            ExportBacking::Vmm { region, .. } => region.release(),
        }
    }
}

impl Drop for Exported {
    fn drop(&mut self) {
        let mut live = lock(live_allocations());
        if live.get(&self.id).is_some_and(|w| w.strong_count() == 0) {
            live.remove(&self.id);
        }
        // The backing's own `Drop` frees the memory (with its context bound).
    }
}

/// This process's exported CUDA allocations, so that a handle opened in the process that
/// exported it finds the memory itself. Ids are never reused, so an entry can only ever
/// name its own allocation.
fn live_allocations() -> &'static Mutex<HashMap<AllocationId, Weak<Exported>>> {
    static LIVE: OnceLock<Mutex<HashMap<AllocationId, Weak<Exported>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// The exporter's view: [`RawMemory`] + [`ExportableMemory`] over a shared [`Exported`].
struct ExportedMem(Arc<Exported>);

impl fmt::Debug for ExportedMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAllocation")
            .field("alloc", &self.0.id)
            .field("kind", &self.0.kind)
            .field("size", &self.0.size)
            .finish()
    }
}

impl RawMemory for ExportedMem {
    fn size(&self) -> usize {
        self.0.size
    }

    fn ptr(&self) -> MemPtr {
        MemPtr::Device(self.0.ptr)
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.0.access.read(self.0.ptr + offset as u64, dst)
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.0.access.write(self.0.ptr + offset as u64, src)
    }

    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.0.access.fill(self.0.ptr + offset as u64, len, byte)
    }

    /// Frees now, unless this process also opened the allocation's handle: then the
    /// memory goes when that [`OpenedMem`] drops.
    fn close(self: Box<Self>) -> Result<()> {
        match Arc::try_unwrap(self.0) {
            Ok(mut exported) => exported.release(),
            Err(_still_opened_here) => Ok(()),
        }
    }
}

impl ExportableMemory for ExportedMem {
    /// Legacy IPC: `cuMemFree` while another process has the handle open is undefined
    /// behaviour. VMM: the driver keeps the physical memory until every importer has
    /// released its imported handle.
    fn free_while_mapped(&self) -> FreeWhileMapped {
        match self.0.backing {
            ExportBacking::Legacy { .. } => FreeWhileMapped::Unsafe,
            ExportBacking::Vmm { .. } => FreeWhileMapped::Survives,
        }
    }

    fn raw_handle(&self, fd_slot: Option<u8>) -> Result<RawHandle> {
        Ok(match &self.0.backing {
            ExportBacking::Legacy { handle, .. } => RawHandle::CudaIpc(*handle),
            ExportBacking::Vmm { .. } => RawHandle::CudaVmmFd { slot: fd_slot },
        })
    }

    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.0.backing {
            ExportBacking::Legacy { .. } => None,
            ExportBacking::Vmm { fd, .. } => Some(fd.as_fd()),
        }
    }
}

/// What backs an imported mapping.
enum MapBacking {
    Legacy(IpcMapping),
    Vmm(VmmRegion),
    /// Opened in the exporting process: the exporter's own memory, kept alive by this
    /// reference.
    Local(
        #[expect(
            dead_code,
            reason = "held so the exporter's memory outlives the mapping"
        )]
        Arc<Exported>,
    ),
}

/// The importer's view of a CUDA allocation.
struct Mapped {
    access: Access,
    ptr: u64,
    size: usize,
    backing: MapBacking,
}

impl fmt::Debug for Mapped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = match self.backing {
            MapBacking::Legacy(_) => "legacy",
            MapBacking::Vmm(_) => "vmm",
            MapBacking::Local(_) => "local",
        };
        f.debug_struct("CudaMapping")
            .field("how", &how)
            .field("size", &self.size)
            .finish()
    }
}

impl RawMemory for Mapped {
    fn size(&self) -> usize {
        self.size
    }

    fn ptr(&self) -> MemPtr {
        MemPtr::Device(self.ptr)
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.access.read(self.ptr + offset as u64, dst)
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.access.write(self.ptr + offset as u64, src)
    }

    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.access.fill(self.ptr + offset as u64, len, byte)
    }

    fn close(mut self: Box<Self>) -> Result<()> {
        match &mut self.backing {
            MapBacking::Legacy(m) => m.close(),
            MapBacking::Vmm(r) => r.release(),
            MapBacking::Local(_) => Ok(()),
        }
    }
}

/// The CUDA backend: allocates on one device, exports legacy or VMM handles, opens both.
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
    export: CudaExport,
    device: DeviceUuid,
    dev: sys::CUdevice,
    /// The VMM granularity, where the device supports VMM with POSIX fds.
    vmm_granularity: Option<usize>,
    access: Access,
    opens: AtomicU64,
    events: Arc<EventPool>,
    opened_events: Mutex<HashMap<(ProcessId, [u8; 64]), OpenedEvent>>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.access.ctx.ordinal())
            .field("device", &self.device)
            .field("export", &self.export)
            .field("opens", &self.opens())
            .field("events", &self.events)
            .finish()
    }
}

impl CudaBackend {
    /// A backend on device `ordinal` (of those this process sees), exporting as `export`,
    /// with its own non-blocking stream on the device's primary context.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] if there is no driver or no such device, or if `export`
    /// is [`CudaExport::Vmm`] and the device cannot share VMM memory as POSIX fds;
    /// [`Error::Cuda`] if the context or stream cannot be made.
    pub fn new(ordinal: usize, export: CudaExport) -> Result<Self> {
        Self::with_event_limit(ordinal, export, DEFAULT_EVENT_LIMIT)
    }

    /// As [`new`](Self::new), keeping at most `event_limit` interprocess events alive.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_event_limit(
        ordinal: usize,
        export: CudaExport,
        event_limit: usize,
    ) -> Result<Self> {
        let count = probe()?;
        if ordinal >= count {
            return Err(unavailable(format!(
                "there is no CUDA device {ordinal}: this process sees {count}"
            )));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(result::from_driver("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx
            .new_stream()
            .map_err(result::from_driver("cuStreamCreate"))?;
        let dev = ctx.cu_device();
        // SAFETY: the driver is initialised (`probe`); `dev` comes from the context.
        let uuid = unsafe { result::device_uuid(dev) }?;
        let vmm_granularity = vmm_support(dev)?;
        if export == CudaExport::Vmm && vmm_granularity.is_none() {
            return Err(unavailable(format!(
                "device {ordinal} cannot share VMM memory as POSIX file descriptors: use {EXPORT_ENV}=legacy"
            )));
        }
        Ok(Self {
            export,
            device: DeviceUuid(uuid),
            dev,
            vmm_granularity,
            events: EventPool::new(Arc::clone(&ctx), event_limit),
            access: Access { ctx, stream },
            opens: AtomicU64::new(0),
            opened_events: Mutex::new(HashMap::new()),
        })
    }

    /// The backend [`DEVICE_ENV`] and [`EXPORT_ENV`] ask for (device 0, legacy export by
    /// default).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`Error::BackendUnavailable`] for unparsable variables.
    pub fn from_env() -> Result<Self> {
        let export = CudaExport::from_env()?;
        let ordinal = match std::env::var(DEVICE_ENV) {
            Err(_) => 0,
            Ok(v) => v
                .trim()
                .parse()
                .map_err(|_| unavailable(format!("{DEVICE_ENV}={v:?} is not a device ordinal")))?,
        };
        Self::new(ordinal, export)
    }

    /// How this backend exports.
    pub fn export(&self) -> CudaExport {
        self.export
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

    /// How many driver-level opens (`cuIpcOpenMemHandle_v2`, `cuMemImportFromShareableHandle`)
    /// this backend has made, failed ones included. Opens in the exporting process and
    /// [`ImportCache`](crate::ImportCache) hits make none.
    pub fn opens(&self) -> u64 {
        self.opens.load(Ordering::Relaxed)
    }

    /// The VMM allocation granularity, if the device supports VMM with POSIX fds.
    pub fn vmm_granularity(&self) -> Option<usize> {
        self.vmm_granularity
    }

    /// (free, total) bytes of device memory (`cuMemGetInfo_v2`).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    #[doc(alias = "cuMemGetInfo")]
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.access.bind()?;
        // SAFETY: the backend's context is bound.
        unsafe { result::mem_get_info() }
    }

    /// Blocks until all work on the backend's stream has completed.
    ///
    /// # Errors
    /// [`Error::Cuda`], including errors of that work.
    pub fn synchronize(&self) -> Result<()> {
        self.access.bind()?;
        self.access.sync()
    }

    /// Records an interprocess event on the backend's stream, after the work launched
    /// there so far. Keep the guard until every importer handed its
    /// [`ipc_handle`](RecordedEvent::ipc_handle) has released its lease.
    ///
    /// # Errors
    /// [`Error::EventsExhausted`] when all events are lent out; [`Error::Cuda`].
    #[doc(alias = "cuEventRecord")]
    pub fn record_event(&self) -> Result<RecordedEvent> {
        self.events.record(&self.access.stream)
    }

    /// Records an interprocess event on `stream` (of this backend's context).
    ///
    /// # Errors
    /// As [`record_event`](Self::record_event).
    pub fn record_event_on(&self, stream: &CudaStream) -> Result<RecordedEvent> {
        self.events.record(stream)
    }

    /// (alive, lent out) interprocess events of the pool.
    pub fn event_counts(&self) -> (usize, usize) {
        self.events.counts()
    }

    /// How many other processes' events this backend holds open.
    pub fn opened_events(&self) -> usize {
        lock(&self.opened_events).len()
    }

    fn vmm_granularity_or_err(&self) -> Result<usize> {
        self.vmm_granularity.ok_or_else(|| {
            unavailable(format!(
                "device {} cannot map VMM memory shared as POSIX file descriptors",
                self.ordinal()
            ))
        })
    }

    /// Checks that the memory's device is visible here (ours, or a peer we may map).
    fn check_device(&self, device: DeviceUuid) -> Result<()> {
        if device == self.device {
            return Ok(());
        }
        // SAFETY: the driver is initialised (we exist).
        let n = unsafe { result::device_count() }?;
        for ordinal in 0..n {
            // SAFETY: as above; `ordinal` is in range.
            let dev = unsafe { result::device_get(ordinal) }?;
            // SAFETY: as above; `dev` from `device_get`.
            if unsafe { result::device_uuid(dev) }? == device.0 {
                return Ok(());
            }
        }
        Err(Error::DeviceNotFound { device })
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
            backing: ExportBacking::Vmm { region, fd },
        })
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
        })
    }
}

/// The VMM granularity of `dev` if it supports VMM memory shared as POSIX fds.
fn vmm_support(dev: sys::CUdevice) -> Result<Option<usize>> {
    use sys::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED as POSIX_FD,
        CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED as VMM,
    };
    // SAFETY: the driver is initialised; `dev` is a valid device.
    let vmm = unsafe { result::device_attribute(dev, VMM) }?;
    // SAFETY: as above.
    let fd = unsafe { result::device_attribute(dev, POSIX_FD) }?;
    if vmm == 0 || fd == 0 {
        return Ok(None);
    }
    // SAFETY: as above; the properties name `dev`.
    let g = unsafe { result::mem_granularity(&result::vmm_prop(dev)) }?;
    Ok(Some(g.max(1)))
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
        matches!(kind, BackendKind::CudaLegacy | BackendKind::CudaVmm)
    }

    /// Allocates `size` bytes (VMM: rounded up to the granularity), zeroed.
    fn allocate(&self, size: usize) -> Result<Allocation> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let id = Allocation::reserve_id();
        let exported = match self.export {
            CudaExport::Legacy => self.allocate_legacy(id, size)?,
            CudaExport::Vmm => self.allocate_vmm(id, size)?,
        };
        self.access.fill(exported.ptr, exported.size, 0)?;
        let exported = Arc::new(exported);
        lock(live_allocations()).insert(id, Arc::downgrade(&exported));
        tracing::debug!(alloc = %id, size = exported.size, kind = ?exported.kind, "CUDA memory allocated");
        Ok(Allocation::with_id(
            id,
            exported.kind,
            self.device,
            Box::new(ExportedMem(exported)),
        ))
    }

    fn open(&self, handle: CheckedHandle<'_>, fd: Option<OwnedFd>) -> Result<OpenedMem> {
        if !self.can_open(handle.backend) {
            return Err(Error::UnsupportedBackend {
                kind: handle.backend,
            });
        }
        if handle.exporter.process == crate::process::current() {
            let mapped = self.open_local(&handle)?;
            return Ok(OpenedMem::new(&handle, Box::new(mapped)));
        }
        self.check_device(handle.device)?;
        let size = usize::try_from(handle.alloc_size).map_err(|_| Error::MemoryTooSmall {
            claimed: handle.alloc_size,
            actual: usize::MAX as u64,
        })?;
        let mapped = match &handle.raw {
            RawHandle::CudaIpc(raw) => {
                self.opens.fetch_add(1, Ordering::Relaxed);
                let mut mapping = IpcMapping::open(&self.access.ctx, &raw.0)?;
                match mapping.mapped_size() {
                    Ok(actual) if actual < size => {
                        mapping.close()?;
                        return Err(Error::MemoryTooSmall {
                            claimed: handle.alloc_size,
                            actual: actual as u64,
                        });
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot query the mapped size; trusting the sealed handle");
                    }
                }
                Mapped {
                    access: self.access.clone(),
                    ptr: mapping.ptr(),
                    size,
                    backing: MapBacking::Legacy(mapping),
                }
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
                Mapped {
                    access: self.access.clone(),
                    ptr: region.ptr(),
                    size,
                    backing: MapBacking::Vmm(region),
                }
            }
            _ => {
                return Err(Error::UnsupportedBackend {
                    kind: handle.backend,
                });
            }
        };
        tracing::debug!(exporter = %handle.exporter, alloc = %handle.alloc, "CUDA memory opened");
        Ok(OpenedMem::new(&handle, Box::new(mapped)))
    }

    /// Makes the backend's stream wait on the exporter's event. Events of other processes
    /// are opened once (`cuIpcOpenEventHandle`) and kept until
    /// [`forget_process`](Backend::forget_process); this process's own events are used
    /// directly.
    fn wait_event(&self, exporter: &ExporterId, event: &IpcEventHandle) -> Result<()> {
        if exporter.process == crate::process::current() {
            if let Some(own) = event::local_event(&event.0) {
                return own.wait_on(&self.access.stream);
            }
        }
        let mut opened = lock(&self.opened_events);
        let key = (exporter.process, event.0);
        if !opened.contains_key(&key) {
            if opened.len() >= OPENED_EVENT_CAP {
                tracing::debug!(cap = OPENED_EVENT_CAP, "dropping cached opened events");
                opened.clear();
            }
            let ev = OpenedEvent::open(&self.access.ctx, &event.0)?;
            opened.insert(key, ev);
        }
        opened[&key].wait_on(&self.access.stream)
    }

    fn forget_process(&self, process: &ProcessId) {
        lock(&self.opened_events).retain(|(p, _), _| p != process);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_modes_parse() {
        assert_eq!(CudaExport::parse("vmm"), Some(CudaExport::Vmm));
        assert_eq!(CudaExport::parse(" Legacy "), Some(CudaExport::Legacy));
        assert_eq!(CudaExport::parse("fabric"), None);
        assert_eq!(CudaExport::Vmm.kind(), BackendKind::CudaVmm);
        assert_eq!(CudaExport::default(), CudaExport::Legacy);
    }

    /// Without a driver, asking for the backend is an error that says why, never a panic.
    #[test]
    fn absence_is_an_error_with_a_reason() {
        match probe() {
            Ok(n) => assert!(n > 0),
            Err(Error::BackendUnavailable { backend, reason }) => {
                assert_eq!(backend, "cuda");
                assert!(!reason.is_empty());
                assert!(matches!(
                    CudaBackend::new(0, CudaExport::Legacy),
                    Err(Error::BackendUnavailable { .. })
                ));
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }

    use crate::{FrameFds, ImportCache, Session};
    use baton_messages::SessionToken;

    fn gpu_backend(export: CudaExport, events: usize) -> Arc<CudaBackend> {
        Arc::new(
            CudaBackend::with_event_limit(0, export, events)
                .unwrap_or_else(|e| panic!("gpu-tests need a CUDA GPU: {e}")),
        )
    }

    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn the_event_pool_lends_up_to_its_limit_and_reuses_returned_events() {
        let b = gpu_backend(CudaExport::Legacy, 2);
        let e1 = b.record_event().unwrap();
        let e2 = b.record_event().unwrap();
        assert_ne!(e1.ipc_handle(), e2.ipc_handle());
        assert!(matches!(
            b.record_event(),
            Err(Error::EventsExhausted { limit: 2 })
        ));
        let h1 = e1.ipc_handle();
        drop(e1);
        let e3 = b.record_event().unwrap();
        assert_eq!(e3.ipc_handle(), h1, "the returned event is lent again");
        e3.synchronize().unwrap();
        assert!(e3.is_complete().unwrap());
        assert_eq!(b.event_counts(), (2, 2));
        drop((e2, e3));
        assert_eq!(b.event_counts(), (2, 0));
    }

    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn own_events_are_waited_on_without_opening_them() {
        let b = gpu_backend(CudaExport::Legacy, 4);
        let session = Session::new(SessionToken::from_bytes([3; 32]));
        let cache = ImportCache::new(session.clone(), [b.clone() as crate::SharedBackend]);
        let alloc = b.allocate(1 << 20).unwrap();
        alloc.fill(0, 1 << 20, 9).unwrap();
        let ev = b.record_event().unwrap();
        let h = alloc
            .handle(&session)
            .event(ev.ipc_handle())
            .build()
            .unwrap();
        let opened = cache.open(&h, &mut FrameFds::none()).unwrap();
        assert_eq!(opened.to_vec().unwrap(), vec![9; 1 << 20]);
        assert_eq!((b.opens(), b.opened_events()), (0, 0));
    }

    /// What the driver does when a process opens its own legacy handle (DESIGN: it
    /// refuses, which is why such opens never reach it). Reported, not asserted.
    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn report_what_the_driver_does_with_our_own_legacy_handle() {
        let b = gpu_backend(CudaExport::Legacy, 1);
        let alloc = b.allocate(1 << 20).unwrap();
        let RawHandle::CudaIpc(raw) = alloc.raw().raw_handle(None).unwrap() else {
            unreachable!()
        };
        match IpcMapping::open(b.context(), &raw.0) {
            Ok(mut m) => {
                eprintln!(
                    "driver opened our own handle at {:#x} (ours {:?})",
                    m.ptr(),
                    alloc.ptr()
                );
                m.close().unwrap();
            }
            Err(e) => eprintln!("driver refused our own handle: {e}"),
        }
    }
}
