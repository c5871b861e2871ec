//! The CUDA backend: device memory shared between processes, on the CUDA driver API
//! (entry points resolved from the driver library at run time, so that every build works
//! without a CUDA toolkit, and runs on any driver of CUDA 11.4 or newer).
//!
//! # Three ways to export
//!
//! Chosen per backend ([`CudaExport`], or [`EXPORT_ENV`]); one backend opens all three:
//!
//! | | legacy IPC ([`CudaExport::Legacy`]) | VMM ([`CudaExport::Vmm`]) | stream-ordered pool ([`CudaExport::Pool`]) |
//! |---|---|---|---|
//! | allocate | `cuMemAlloc_v2` (not `cuMemAllocAsync`: the default pool's memory cannot be exported) | `cuMemCreate` (POSIX-fd handle type, size rounded up to the granularity), reserve, map, set access | `cuMemAllocFromPoolAsync` on a stream, from the backend's exportable pool (`cuMemPoolCreate`, POSIX-fd handle type, release threshold [`DEFAULT_POOL_RELEASE_THRESHOLD`]) |
//! | export | 64-byte `cuIpcGetMemHandle` in the handle | `cuMemExportToShareableHandle` fd beside the frame (`SCM_RIGHTS`); the handle names its slot | the pool's fd (`cuMemPoolExportToShareableHandle`, one per pool) beside the frame, 64 bytes of `cuMemPoolExportPointer` in the handle |
//! | open | `cuIpcOpenMemHandle_v2` with lazy peer access | import the fd, reserve, map, set access | import the pool once per exporter process (`cuMemPoolImportFromShareableHandle`, `cuMemPoolSetAccess`), then `cuMemPoolImportPointer` |
//! | free / close | `cuMemFree_v2` / `cuIpcCloseMemHandle` | unmap, free the range, `cuMemRelease` (both sides) | `cuMemFreeAsync` on the allocation's stream / `cuMemFreeAsync` on the importer's stream, synchronised |
//! | exporter frees while an importer maps ([`FreeWhileMapped`]) | `Unsafe`: undefined behaviour, the pages may be reused | `Survives`: the driver refcounts the physical memory | `Unsafe`: the driver requires every importer's free to complete first, and the pool reuses the pages |
//! | left after SIGKILL of everyone | nothing | nothing | nothing |
//! | cold handoff with a new allocation (H200, driver 580) | ≈ 184 µs | ≈ 1.3 ms (export ≈ 0.6–0.8 ms, import + map ≈ 0.6 ms) | not measured yet (a warm pool allocates without a driver allocation) |
//!
//! - **Choose legacy** when buffers are long-lived and reused (slabs, the import cache keeps
//!   them mapped), you want no descriptors on the link, or the device lacks VMM/pools. It
//!   is the default.
//! - **Choose VMM** when an importer may outlive the exporter's free (a cut holder keeps a
//!   valid mapping, so the ledger need not quarantine), or for very large buffers, where
//!   the granularity rounding does not matter.
//! - **Choose pool** when buffers are made per handoff (a cold handoff then costs an
//!   allocation from a warm pool, not a new driver allocation), or when your work already
//!   runs on your own streams: [`CudaBackend::allocate_on`] allocates exportable memory in
//!   a stream's order, as cudarc's `alloc` would, without copying into Baton buffers.
//!
//! # How the backend works
//!
//! - **Layers**, as in cudarc: `driver` resolves the entry points (returning the raw
//!   `CUresult` integer, so a code newer than our bindings is a number, never an invalid
//!   enum), `result` holds one thin `Result` wrapper per driver call, the RAII types of
//!   `legacy`, `vmm`, `pool`, `event` and `fence` own what those calls make and release it in
//!   `Drop`, and [`CudaBackend`] puts them behind the [`Backend`] trait. The context and
//!   stream are cudarc's safe [`CudaContext`] (the device's primary context) and
//!   [`CudaStream`], exposed so callers can launch their own kernels (device pointers are
//!   `u64` kernel arguments, [`MemPtr::Device`]).
//! - **Context discipline.** Every driver call, `Drop`s included, runs with the backend's
//!   context pushed on the calling thread (`cuCtxPushCurrent_v2`) and popped after
//!   (`cuCtxPopCurrent_v2`); where cudarc binds a context itself (making or dropping a
//!   context or stream), the caller's current context is put back. A caller's current
//!   context is the same before and after any call into this backend.
//! - **Stream order.** Every read, write and fill of this backend's memory is a copy or
//!   memset on the backend's [`stream`](CudaBackend::stream), followed by a synchronise of
//!   that stream. Work launched on that stream is ordered with them.
//! - **Fences.** An exporter records a fence after the work that produced a buffer
//!   ([`CudaBackend::record_fence`], [`CudaBackend::record_event`], or
//!   [`StreamOrdering::export_fence`] from the buffer's use marks); the handle carries it
//!   ([`HandleMsg::fence`](baton_messages::HandleMsg::fence)), and the importer makes each
//!   stream it uses the buffer on wait on it ([`StreamOrdering::order_after`]) — the
//!   [`ImportCache::open`](crate::ImportCache::open) of the low-level API makes the
//!   backend's own stream wait. Release fences go the other way the same way. Fences are
//!   sequence counters (the default) or pooled IPC events ([`FenceKind`], [`FENCE_ENV`]);
//!   see [`RecordedFence`] for their reuse rules, and `docs/ORDERING.md` for the model.
//! - **Use marks and release streams.** [`StreamOrdering::use_mark`] lends a cudarc event that
//!   cudarc's `SyncOnDrop` records after each use of a buffer on a stream (`mark`);
//!   [`StreamOrdering::export_fence`] makes one of the backend's release streams wait on marks and
//!   record a fence of the backend's kind there, retired when dropped until its work
//!   completed.
//!   [`DeviceArg`] passes any cudarc `DevicePtr` type (Baton's buffers and leases) as a
//!   kernel argument.
//! - **No lock across a driver call.** What the backend opens of other processes (events,
//!   pools, counter slabs) is opened with no lock held, once per key
//!   (`table::OnceTable`).
//! - **Identity.** Devices are named by UUID (`cuDeviceGetUuid_v2`), never by ordinal. A
//!   handle opened in the very process that exported it (the driver refuses that for
//!   legacy handles) yields the exporter's own memory, found in a process-local registry of
//!   live allocations; the memory is then freed when both the exporter's [`Allocation`]
//!   and that [`OpenedMem`] are gone.
//! - **Accounting.** [`CudaBackend::live`] counts the allocations and mappings the backend
//!   holds (and their bytes), exported and imported: exact, per backend, unlike device-wide
//!   free memory.
//! - **Availability.** [`probe`] looks for the driver library before any other driver
//!   call, and reports its absence (or a driver too old for an entry point) as
//!   [`Error::BackendUnavailable`].
//!
//! # Safety
//!
//! This module and its children hold the CUDA backend's `unsafe` code:
//! - no driver call is made before [`probe`] found the library, loaded the entry points
//!   and `cuInit` succeeded: [`CudaBackend::new`] calls it first, and every other path
//!   starts from a backend (a call without a loaded table fails, it never reaches a
//!   driver);
//! - each driver object (allocation, mapping, VMM region, pool, event, counter slab) has
//!   exactly one owner, which releases it once, with its context pushed, and holds a
//!   `SharedContext` of that context; allocations and mappings from a pool hold an `Arc`
//!   of the pool;
//! - memory accessors ([`Allocation`], [`OpenedMem`]) check `offset + len <= size` before
//!   calling in, and the owner of the memory outlives every access (the accessors borrow
//!   it), so every copy stays inside mapped device memory; host buffers are Rust slices.
//! - raw handle bytes reach the driver only from a [`CheckedHandle`] (digest verified).

mod arg;
mod bridge;
mod context;
mod driver;
mod event;
mod fence;
mod inbox;
mod legacy;
mod mark;
mod pool;
mod result;
mod table;
mod vmm;

pub use arg::DeviceArg;
pub use cudarc;
pub use event::{DEFAULT_EVENT_LIMIT, RecordedEvent};
pub use fence::{
    CounterFence, DEFAULT_COUNTER_SLOTS, FENCE_ENV, FenceHandle, FenceKind, RecordedFence,
    fence_kind_from_env,
};
pub use pool::DEFAULT_POOL_RELEASE_THRESHOLD;
pub use result::CudaError;

use crate::backend::{
    Allocation, AsAny, Backend, DescriptorScope, ExportableMemory, FreeWhileMapped, MemPtr,
    OpenedMem, RawMemory,
};
use crate::ordering::{ExportedFence, FenceFaultHook, StreamOrdering, StreamRef, UseMark};
use crate::session::CheckedHandle;
use crate::{Error, Result};
use baton_messages::InboxGrant;
use baton_messages::{
    AllocationId, BackendKind, CudaIpcMemHandle, CudaPoolExportData, DeviceUuid, IpcEventHandle,
    ProcessId, RawHandle,
};
use context::{ContextGuard, KeepCurrent, Quiet};
use cudarc::driver::{CudaContext, CudaStream, sys};
use event::{EventPool, OpenedEvent};
use fence::{OpenedSlab, PeerFence};
use inbox::Inbox;
use legacy::{DeviceAlloc, IpcMapping};
use mark::MarkPool;
use pool::{ExportPool, ImportedPool, PoolAlloc, PoolMapping};
use result::StreamMemOps;
use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};
use table::OnceTable;
use vmm::VmmRegion;

/// The environment variable that picks how a CUDA backend exports: `legacy` (the default),
/// `vmm` or `pool`.
pub const EXPORT_ENV: &str = "BATON_CUDA_EXPORT";
/// The environment variable that picks the device ordinal of [`CudaBackend::from_env`]
/// (default 0).
pub const DEVICE_ENV: &str = "BATON_CUDA_DEVICE";

/// How many opened events of other processes a backend keeps before it drops them all
/// (destroying an opened event is safe even while a stream waits on it).
const OPENED_EVENT_CAP: usize = 4096;

/// How many release streams a backend has (see `CudaBackend::release_streams`).
const RELEASE_STREAMS: usize = 4;

/// How long a death waits for our release streams to drain before closing the dead
/// peer's inbox mapping (else it is closed at a later death, or with the backend).
const DYING_INBOX_WAIT: Duration = Duration::from_millis(200);

/// How many peer processes get a lane of a backend's fence inbox unless told otherwise
/// ([`CudaBackendBuilder::inbox_lanes`]).
pub const DEFAULT_INBOX_LANES: usize = 4096;

/// The backend's context, shared by everything the backend made: each pushes it around its
/// driver calls, and the last one to drop releases cudarc's context without leaving the
/// caller's current context changed.
pub(crate) type SharedContext = Arc<Quiet<Arc<CudaContext>>>;
/// A stream held by the backend or by memory it made, likewise.
pub(crate) type SharedStream = Arc<Quiet<Arc<CudaStream>>>;

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

/// Looks for the CUDA driver, loads the entry points Baton calls, initialises the driver,
/// and counts the devices this process sees. Makes no driver call unless the driver
/// library is present. The answer is computed once per process.
///
/// # Errors
/// [`Error::BackendUnavailable`] with the reason: no driver library, a driver too old for
/// an entry point, `cuInit` failed, or no device visible.
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
            unsafe { driver::load() }?;
            // SAFETY: the entry points are loaded (just above).
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

/// How a [`CudaBackend`] exports the memory it allocates (module docs: which to choose).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CudaExport {
    /// `cuMemAlloc_v2` memory shared with a 64-byte legacy IPC handle.
    #[default]
    Legacy,
    /// `cuMemCreate` memory shared as a POSIX file descriptor (`SCM_RIGHTS`).
    Vmm,
    /// Stream-ordered memory from the backend's exportable pool
    /// (`cuMemAllocFromPoolAsync`): the pool shared as a POSIX file descriptor, each
    /// allocation as 64 bytes of `cuMemPoolExportPointer` data.
    Pool,
}

impl CudaExport {
    /// Parses `legacy`, `vmm` or `pool`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "legacy" | "ipc" | "" => Some(Self::Legacy),
            "vmm" => Some(Self::Vmm),
            "pool" | "mempool" => Some(Self::Pool),
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
                unavailable(format!(
                    "{EXPORT_ENV}={v:?} is not one of legacy, vmm, pool"
                ))
            }),
        }
    }

    /// The kind of handle this way of exporting makes.
    pub fn kind(self) -> BackendKind {
        match self {
            Self::Legacy => BackendKind::CudaLegacy,
            Self::Vmm => BackendKind::CudaVmm,
            Self::Pool => BackendKind::CudaPool,
        }
    }

    /// The name [`parse`](Self::parse) takes (and [`EXPORT_ENV`] holds).
    pub fn name(self) -> &'static str {
        match self {
            Self::Legacy => "legacy",
            Self::Vmm => "vmm",
            Self::Pool => "pool",
        }
    }
}

/// What a [`CudaBackend`] holds now, exported and imported: allocations and mappings it
/// made with the driver that are not released yet, and their bytes. Memory opened in the
/// process that exported it is the exporter's own and is not counted again. A pool
/// allocation counts until its `cuMemFreeAsync` is queued.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LiveMemory {
    /// Allocations this backend made and has not freed.
    pub exported: usize,
    /// Their bytes (VMM: rounded up to the granularity).
    pub exported_bytes: usize,
    /// Other processes' allocations this backend maps.
    pub imported: usize,
    /// Their bytes, as the handles claim them.
    pub imported_bytes: usize,
}

impl LiveMemory {
    /// Whether the backend holds nothing.
    pub fn is_empty(&self) -> bool {
        *self == LiveMemory::default()
    }
}

#[derive(Debug, Default)]
struct LiveCounters {
    exported: AtomicUsize,
    exported_bytes: AtomicUsize,
    imported: AtomicUsize,
    imported_bytes: AtomicUsize,
}

impl LiveCounters {
    fn snapshot(&self) -> LiveMemory {
        LiveMemory {
            exported: self.exported.load(Ordering::SeqCst),
            exported_bytes: self.exported_bytes.load(Ordering::SeqCst),
            imported: self.imported.load(Ordering::SeqCst),
            imported_bytes: self.imported_bytes.load(Ordering::SeqCst),
        }
    }
}

/// One counted allocation or mapping: counted while this lives. Declared after the memory
/// it counts in its owner, so that it drops after that memory is released.
struct LiveToken {
    counters: Arc<LiveCounters>,
    imported: bool,
    bytes: usize,
}

impl LiveToken {
    fn new(counters: &Arc<LiveCounters>, imported: bool, bytes: usize) -> Self {
        let (n, b) = if imported {
            (&counters.imported, &counters.imported_bytes)
        } else {
            (&counters.exported, &counters.exported_bytes)
        };
        n.fetch_add(1, Ordering::SeqCst);
        b.fetch_add(bytes, Ordering::SeqCst);
        Self {
            counters: Arc::clone(counters),
            imported,
            bytes,
        }
    }
}

impl Drop for LiveToken {
    fn drop(&mut self) {
        let c = &self.counters;
        let (n, b) = if self.imported {
            (&c.imported, &c.imported_bytes)
        } else {
            (&c.exported, &c.exported_bytes)
        };
        n.fetch_sub(1, Ordering::SeqCst);
        b.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

/// A context and a stream: what every access to device bytes pushes and orders on.
#[derive(Clone)]
struct Access {
    ctx: SharedContext,
    stream: SharedStream,
}

impl Access {
    /// Synchronises the stream; the caller pushed the context.
    fn sync(&self) -> Result<()> {
        // SAFETY: the stream is live (we hold it) and its context was pushed by the caller.
        unsafe { result::stream_synchronize(self.stream.cu_stream()) }
    }

    /// Copies `dst.len()` bytes from device address `src` (the caller checked the range
    /// lies in memory that outlives the call).
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the stream is live in the current context; `src..src + len` is mapped
        // (caller); `dst` is not touched until the synchronise below returns.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }?;
        self.sync()
    }

    fn write(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: as in `read`, directions swapped; `src` outlives the synchronise below.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }?;
        self.sync()
    }

    fn fill(&self, dst: u64, len: usize, byte: u8) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the stream is live in the current context; `dst..dst + len` is mapped.
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
    Pool {
        /// Holds its pool, whose descriptor is sent with handles of it.
        alloc: PoolAlloc,
        data: CudaPoolExportData,
    },
    /// A `cuMemAlloc` allocation made by someone else (PyTorch's caching allocator, say),
    /// shared as legacy IPC. Baton never frees it: "freeing" drops `keep`, which keeps it
    /// allocated ([`CudaBackend::borrow`]).
    Borrowed {
        handle: CudaIpcMemHandle,
        keep: Option<Box<dyn Send + Sync>>,
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
    /// After `backing`: counted until the memory is released.
    _live: LiveToken,
}

impl Exported {
    fn release(&mut self) -> Result<()> {
        match &mut self.backing {
            ExportBacking::Legacy { alloc, .. } => alloc.free(),
            ExportBacking::Vmm { region, .. } => region.release(),
            ExportBacking::Pool { alloc, .. } => alloc.free(),
            ExportBacking::Borrowed { keep, .. } => {
                drop(keep.take());
                Ok(())
            }
        }
    }
}

impl Drop for Exported {
    fn drop(&mut self) {
        let mut live = lock(live_allocations());
        if live.get(&self.id).is_some_and(|w| w.strong_count() == 0) {
            live.remove(&self.id);
        }
        drop(live);
        if let ExportBacking::Borrowed { .. } = self.backing {
            let mut borrowed = lock(borrowed_bases());
            if borrowed.get(&self.ptr) == Some(&self.id) {
                borrowed.remove(&self.ptr);
            }
        }
        // The backing's own `Drop` frees the memory (with its context pushed).
    }
}

/// This process's exported CUDA allocations, so that a handle opened in the process that
/// exported it finds the memory itself. Ids are never reused, so an entry can only ever
/// name its own allocation.
fn live_allocations() -> &'static Mutex<HashMap<AllocationId, Weak<Exported>>> {
    static LIVE: OnceLock<Mutex<HashMap<AllocationId, Weak<Exported>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// The bases of the allocations this process borrowed ([`CudaBackend::borrow`]) and not yet
/// released: legacy IPC lets an importer open an allocation once, so one allocation is
/// borrowed once at a time.
fn borrowed_bases() -> &'static Mutex<HashMap<u64, AllocationId>> {
    static BORROWED: OnceLock<Mutex<HashMap<u64, AllocationId>>> = OnceLock::new();
    BORROWED.get_or_init(Default::default)
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
    /// released its imported handle. Pool: the driver documentation of
    /// `cuMemPoolImportPointer` says "The imported memory must be freed from all importing
    /// processes before being freed in the exporting process", and a freed block goes back
    /// to the pool, whose next allocation may reuse it: unsafe, as legacy.
    fn free_while_mapped(&self) -> FreeWhileMapped {
        match self.0.backing {
            ExportBacking::Legacy { .. }
            | ExportBacking::Pool { .. }
            | ExportBacking::Borrowed { .. } => FreeWhileMapped::Unsafe,
            ExportBacking::Vmm { .. } => FreeWhileMapped::Survives,
        }
    }

    fn raw_handle(&self, fd_slot: Option<u8>) -> Result<RawHandle> {
        Ok(match &self.0.backing {
            ExportBacking::Legacy { handle, .. } | ExportBacking::Borrowed { handle, .. } => {
                RawHandle::CudaIpc(*handle)
            }
            ExportBacking::Vmm { .. } => RawHandle::CudaVmmFd { slot: fd_slot },
            ExportBacking::Pool { alloc, data } => RawHandle::CudaPool {
                pool: alloc.pool().id(),
                pool_slot: fd_slot,
                ptr: *data,
            },
        })
    }

    /// VMM: the allocation's descriptor. Pool: the pool's descriptor (the same for every
    /// allocation of the pool; importers import it once per exporter process).
    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.0.backing {
            ExportBacking::Legacy { .. } | ExportBacking::Borrowed { .. } => None,
            ExportBacking::Vmm { fd, .. } => Some(fd.as_fd()),
            ExportBacking::Pool { alloc, .. } => Some(alloc.pool().fd()),
        }
    }

    /// Pool memory: the pool's descriptor, once per (link, pool).
    fn descriptor_scope(&self) -> DescriptorScope {
        match &self.0.backing {
            ExportBacking::Pool { alloc, .. } => DescriptorScope::Pool(alloc.pool().id()),
            _ => DescriptorScope::Allocation,
        }
    }
}

/// What backs an imported mapping.
enum MapBacking {
    Legacy(IpcMapping),
    Vmm(VmmRegion),
    /// Holds its imported pool.
    Pool(PoolMapping),
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
    /// After `backing`: counted until the mapping is released (driver-level imports only).
    _live: Option<LiveToken>,
}

impl fmt::Debug for Mapped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = match self.backing {
            MapBacking::Legacy(_) => "legacy",
            MapBacking::Vmm(_) => "vmm",
            MapBacking::Pool(_) => "pool",
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
            MapBacking::Pool(m) => m.close(),
            MapBacking::Local(_) => Ok(()),
        }
    }
}

/// How to make a [`CudaBackend`]: [`CudaBackend::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct CudaBackendBuilder {
    ordinal: usize,
    export: CudaExport,
    fence: FenceKind,
    event_limit: usize,
    counter_slots: usize,
    inbox_lanes: usize,
    fence_deadline: Duration,
    event_backlog: usize,
    pool_release_threshold: u64,
}

impl CudaBackendBuilder {
    /// How the backend exports what it allocates (default [`CudaExport::Legacy`]).
    pub fn export(mut self, export: CudaExport) -> Self {
        self.export = export;
        self
    }

    /// Which fences the backend records ([`CudaBackend::record_fence`], and the acquire and
    /// release fences of [`StreamOrdering::export_fence`]; default [`FenceKind::Counter`]).
    /// [`FenceKind::Counter`] on a device without 64-bit stream memory operations falls
    /// back to events ([`CudaBackend::fence_kind`] says which is used).
    pub fn fence(mut self, fence: FenceKind) -> Self {
        self.fence = fence;
        self
    }

    /// At most this many interprocess events lent out at once (default
    /// [`DEFAULT_EVENT_LIMIT`]; the driver limits live IPC events too).
    pub fn event_limit(mut self, limit: usize) -> Self {
        self.event_limit = limit;
        self
    }

    /// The counter fences' slots: at most this many counter fences lent out or not yet
    /// landed at once (default [`DEFAULT_COUNTER_SLOTS`], 8 bytes of device memory each).
    /// A frame that drops thousands of leases at once records as many release fences.
    pub fn counter_slots(mut self, slots: usize) -> Self {
        self.counter_slots = slots;
        self
    }

    /// How many peer processes, over the backend's life, get a lane of its fence inbox
    /// (default [`DEFAULT_INBOX_LANES`]; 32 bytes of device memory each). Fences from peers
    /// past that are made complete before they are sent (host-synchronised, slower).
    pub fn inbox_lanes(mut self, lanes: usize) -> Self {
        self.inbox_lanes = lanes;
        self
    }

    /// How long a peer may leave the fence values it named unwritten, with no progress,
    /// before our waits on them are released and it is cut (default
    /// [`crate::inbox::fence_deadline_from_env`]: `BATON_FENCE_DEADLINE_MS`, else 10 s).
    /// Raise it for kernels that run longer than that on a leased buffer.
    pub fn fence_deadline(mut self, deadline: Duration) -> Self {
        self.fence_deadline = deadline;
        self
    }

    /// How many pooled events recorded for one peer may wait for their work before a call
    /// offering that peer a buffer waits for them ([`StreamOrdering::fence_room`]; default
    /// [`DEFAULT_EVENT_BACKLOG`], or `BATON_EVENT_BACKLOG`). At least 1.
    pub fn event_backlog(mut self, backlog: usize) -> Self {
        self.event_backlog = backlog.max(1);
        self
    }

    /// Bytes of freed memory the backend's pool keeps reserved for later allocations when
    /// a stream synchronises (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; default
    /// [`DEFAULT_POOL_RELEASE_THRESHOLD`]). `0` gives everything back at every synchronise
    /// (slow allocations); `u64::MAX` never gives anything back unless
    /// [`CudaBackend::trim_pool`] is called.
    pub fn pool_release_threshold(mut self, bytes: u64) -> Self {
        self.pool_release_threshold = bytes;
        self
    }

    /// The backend.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] if there is no driver or no such device, or if the
    /// device cannot export as asked (VMM or pools shareable as POSIX fds);
    /// [`Error::Cuda`] if the context, streams or pool cannot be made.
    pub fn build(self) -> Result<CudaBackend> {
        CudaBackend::build(self)
    }
}

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
    export: CudaExport,
    /// The fences `record_fence` records (after any fallback).
    fence: FenceKind,
    device: DeviceUuid,
    dev: sys::CUdevice,
    /// The VMM granularity, where the device supports VMM with POSIX fds.
    vmm_granularity: Option<usize>,
    /// Whether the device can export memory pools as POSIX fds.
    pools_supported: bool,
    pool_release_threshold: u64,
    /// The 64-bit stream memory operations the device supports, if any.
    stream_ops: Option<StreamMemOps>,
    access: Access,
    counters: Arc<LiveCounters>,
    opens: AtomicU64,
    waits: AtomicU64,
    events: Arc<EventPool>,
    /// Use marks: local events recorded after each use of a buffer on a stream.
    marks: Arc<MarkPool>,
    /// Streams of the backend's own on which marks become interprocess fences
    /// ([`StreamOrdering::export_fence`]), made on first use; a mark's stream picks one, so that
    /// fences of one user stream wait in that stream's order, and fences of others do not
    /// queue behind them.
    release_streams: [OnceLock<SharedStream>; RELEASE_STREAMS],
    /// The exportable pool, made on first use.
    pool: OnceTable<(), ExportPool>,
    /// The fence inbox (counter fences only), made with the backend.
    inbox: Option<Inbox>,
    /// Waits on other processes' interprocess events, released by us alone.
    bridge: bridge::Bridge,
    /// The fence deadline (bounds how long a close polls our own fences).
    fence_deadline: Duration,
    /// [`CudaBackendBuilder::event_backlog`].
    event_backlog: usize,
    opened_events: OnceTable<(ProcessId, [u8; 64]), OpenedEvent>,
    imported_pools: OnceTable<(ProcessId, u64), ImportedPool>,
    /// Peers' fence inboxes we write into, by (process, slab id); closed once the peer
    /// is dead and no write of ours to it is queued (a mapping of a dead process's memory
    /// pins it on the device).
    peer_inboxes: OnceTable<(ProcessId, u64), OpenedSlab>,
    /// Dead peers' inboxes whose close waits for our release streams to drain.
    dying_inboxes: Mutex<Vec<Arc<OpenedSlab>>>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.access.ctx.ordinal())
            .field("device", &self.device)
            .field("export", &self.export)
            .field("fence", &self.fence)
            .field("opens", &self.opens())
            .field("live", &self.live())
            .field("events", &self.events)
            .finish()
    }
}

impl CudaBackend {
    /// A backend on device `ordinal` (of those this process sees), exporting as `export`,
    /// with its own non-blocking stream on the device's primary context, and counter fences
    /// (IPC events on a device without 64-bit stream memory operations).
    ///
    /// # Errors
    /// As [`CudaBackendBuilder::build`].
    pub fn new(ordinal: usize, export: CudaExport) -> Result<Self> {
        Self::builder(ordinal).export(export).build()
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
        Self::builder(ordinal)
            .export(export)
            .event_limit(event_limit)
            .build()
    }

    /// A builder for a backend on device `ordinal`, with the defaults of [`new`](Self::new).
    pub fn builder(ordinal: usize) -> CudaBackendBuilder {
        CudaBackendBuilder {
            ordinal,
            export: CudaExport::Legacy,
            fence: FenceKind::Counter,
            event_limit: DEFAULT_EVENT_LIMIT,
            counter_slots: DEFAULT_COUNTER_SLOTS,
            inbox_lanes: DEFAULT_INBOX_LANES,
            fence_deadline: crate::inbox::fence_deadline_from_env(),
            event_backlog: event_backlog_from_env(),
            pool_release_threshold: DEFAULT_POOL_RELEASE_THRESHOLD,
        }
    }

    /// The backend [`DEVICE_ENV`], [`EXPORT_ENV`] and [`FENCE_ENV`] ask for (device 0,
    /// legacy export, counter fences by default).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`Error::BackendUnavailable`] for unparsable variables.
    pub fn from_env() -> Result<Self> {
        let export = CudaExport::from_env()?;
        let fence = fence_kind_from_env()?;
        let ordinal = match std::env::var(DEVICE_ENV) {
            Err(_) => 0,
            Ok(v) => v
                .trim()
                .parse()
                .map_err(|_| unavailable(format!("{DEVICE_ENV}={v:?} is not a device ordinal")))?,
        };
        Self::builder(ordinal).export(export).fence(fence).build()
    }

    fn build(b: CudaBackendBuilder) -> Result<Self> {
        let count = probe()?;
        let ordinal = b.ordinal;
        if ordinal >= count {
            return Err(unavailable(format!(
                "there is no CUDA device {ordinal}: this process sees {count}"
            )));
        }
        // cudarc binds the context it makes (and binds it again to make streams): put the
        // caller's back afterwards, also on error (locals drop before `keep`).
        let keep = KeepCurrent::new()?;
        let ctx =
            CudaContext::new(ordinal).map_err(result::from_driver("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx
            .new_stream()
            .map_err(result::from_driver("cuStreamCreate"))?;
        let side = ctx
            .new_stream()
            .map_err(result::from_driver("cuStreamCreate"))?;
        let dev = ctx.cu_device();
        let ctx: SharedContext = Arc::new(Quiet::new(ctx));
        let stream: SharedStream = Arc::new(Quiet::new(stream));
        let side: SharedStream = Arc::new(Quiet::new(side));
        drop(keep);
        // SAFETY: the driver is initialised (`probe`); `dev` comes from the context.
        let uuid = unsafe { result::device_uuid(dev) }?;
        let vmm_granularity = vmm_support(dev)?;
        if b.export == CudaExport::Vmm && vmm_granularity.is_none() {
            return Err(unavailable(format!(
                "device {ordinal} cannot share VMM memory as POSIX file descriptors: use {EXPORT_ENV}=legacy"
            )));
        }
        let pools_supported = pool_support(dev)?;
        if b.export == CudaExport::Pool && !pools_supported {
            return Err(unavailable(format!(
                "device {ordinal} cannot share memory pools as POSIX file descriptors: use {EXPORT_ENV}=legacy"
            )));
        }
        // SAFETY: the driver is initialised; `dev` comes from the context.
        let stream_ops = unsafe { result::stream_mem_ops(dev) }?;
        let fence = match (b.fence, stream_ops) {
            (FenceKind::Counter, None) => {
                tracing::info!(
                    device = ordinal,
                    "device {ordinal} has no 64-bit stream memory operations: counter fences fall back to IPC events"
                );
                FenceKind::Event
            }
            (kind, _) => kind,
        };
        let inbox = match (fence, stream_ops) {
            (FenceKind::Counter, Some(ops)) => {
                let keep = KeepCurrent::new()?;
                let watch = ctx
                    .new_stream()
                    .map_err(result::from_driver("cuStreamCreate"))?;
                drop(keep);
                Some(Inbox::new(
                    &ctx,
                    DeviceUuid(uuid),
                    ops,
                    Arc::clone(&side),
                    Arc::new(Quiet::new(watch)),
                    RELEASE_STREAMS,
                    b.counter_slots,
                    b.inbox_lanes,
                    b.fence_deadline,
                )?)
            }
            _ => None,
        };
        let bridge = bridge::Bridge::new(&ctx, stream_ops, side, b.fence_deadline);
        let backend = Self {
            export: b.export,
            fence,
            device: DeviceUuid(uuid),
            dev,
            vmm_granularity,
            pools_supported,
            pool_release_threshold: b.pool_release_threshold,
            stream_ops,
            events: EventPool::new(Arc::clone(&ctx), b.event_limit),
            marks: MarkPool::new(Arc::clone(&ctx), Arc::clone(&stream)),
            release_streams: Default::default(),
            access: Access { ctx, stream },
            counters: Arc::default(),
            opens: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            pool: OnceTable::default(),
            inbox,
            bridge,
            fence_deadline: b.fence_deadline,
            event_backlog: b.event_backlog,
            opened_events: OnceTable::default(),
            imported_pools: OnceTable::default(),
            peer_inboxes: OnceTable::default(),
            dying_inboxes: Mutex::new(Vec::new()),
        };
        if b.export == CudaExport::Pool {
            // Made now, so that a pool that cannot be made is an error here, not at the
            // first allocation.
            backend.export_pool()?;
        }
        Ok(backend)
    }

    /// How this backend exports.
    pub fn export(&self) -> CudaExport {
        self.export
    }

    /// The fences [`record_fence`](Self::record_fence) records.
    pub fn fence_kind(&self) -> FenceKind {
        self.fence
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
        self.waits.load(Ordering::Relaxed)
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
        let _pushed = ContextGuard::push(&self.access.ctx)?;
        self.access.sync()
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
        self.events.record_for(&self.access.stream, None)
    }

    /// Records an interprocess event on `stream` (of this backend's context).
    ///
    /// # Errors
    /// As [`record_event`](Self::record_event).
    pub fn record_event_on(&self, stream: &CudaStream) -> Result<RecordedEvent> {
        self.events.record_for(stream, None)
    }

    /// Records a fence of the backend's [`fence_kind`](Self::fence_kind) on the backend's
    /// stream, after the work launched there so far.
    ///
    /// # Errors
    /// [`Error::EventsExhausted`] / [`Error::FencesExhausted`] when all are lent out;
    /// [`Error::Cuda`].
    pub fn record_fence(&self) -> Result<RecordedFence> {
        self.record_fence_on(&self.access.stream)
    }

    /// Records a fence on `stream` (a stream of this backend's device).
    ///
    /// # Errors
    /// As [`record_fence`](Self::record_fence).
    #[doc(alias = "cuStreamWriteValue64")]
    pub fn record_fence_on(&self, stream: &CudaStream) -> Result<RecordedFence> {
        match self.fence {
            FenceKind::Event => Ok(RecordedFence::from_event(
                self.events.record_for(stream, None)?,
            )),
            FenceKind::Counter => self.inbox()?.slab().record(stream),
        }
    }

    /// Records a fence on `stream` that process `to` can wait on: with counter fences, a
    /// value written into the lane of `to`'s inbox that `to` lent us
    /// ([`StreamOrdering::accept_inbox`]) — after a fence of our own on `stream`, which a release
    /// stream waits on — or, when `to` lent us none, a pooled interprocess event; with
    /// event fences, a pooled event. `to` may be this process.
    ///
    /// # Errors
    /// As [`record_fence_on`](Self::record_fence_on); a driver error mapping `to`'s inbox.
    #[doc(alias = "cuStreamWriteValue64")]
    pub fn record_fence_for(
        &self,
        stream: &CudaStream,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        if self.fence == FenceKind::Event {
            return Ok(Some(Arc::new(self.events.record_for(stream, waiter(to))?)));
        }
        let own = self.record_fence_on(stream)?;
        if *to == crate::process::current() {
            return Ok(Some(Arc::new(own)));
        }
        let me = crate::process::current();
        StreamOrdering::relay_fence(self, &me, &own.handle(), to)
    }

    /// (alive, lent out) fences of the backend's kind: events, or counter slots (a slot
    /// whose fence dropped counts as lent until its value has landed: the slab is read
    /// back here to tell).
    pub fn fence_counts(&self) -> (usize, usize) {
        match (self.fence, self.inbox.as_ref().map(Inbox::slab)) {
            (FenceKind::Counter, Some(slab)) => {
                if let Err(e) = slab.sweep() {
                    tracing::warn!(error = %e, "reading the counter slab back failed");
                }
                slab.counts()
            }
            (FenceKind::Counter, None) => (0, 0),
            (FenceKind::Event, _) => self.events.counts(),
        }
    }

    /// Makes the backend's stream wait on a fence `exporter` recorded.
    ///
    /// # Errors
    /// As [`wait_fence_on`](Self::wait_fence_on).
    pub fn wait_fence(&self, exporter: &ProcessId, fence: &FenceHandle) -> Result<()> {
        self.wait_fence_on(exporter, fence, &self.access.stream)
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
    /// thread's open of the same object hangs.
    #[doc(alias = "cuStreamWaitEvent")]
    #[doc(alias = "cuStreamWaitValue64")]
    pub fn wait_fence_on(
        &self,
        exporter: &ProcessId,
        fence: &FenceHandle,
        stream: &CudaStream,
    ) -> Result<()> {
        let own = *exporter == crate::process::current();
        match fence {
            FenceHandle::Event(handle) => {
                let local = if own {
                    event::local_event(&handle.0)
                } else {
                    None
                };
                match local {
                    Some(ev) => ev.wait_on(stream)?,
                    // Never `cuStreamWaitEvent` on another process's event: a wait its
                    // waiter can release (`cuda/bridge.rs`).
                    None => {
                        self.bridge
                            .wait(exporter, &self.opened_event(exporter, handle)?, stream)?
                    }
                }
            }
            FenceHandle::Counter(counter) => {
                if self.stream_ops.is_none() {
                    return Err(Error::Cuda {
                        op: "cuStreamWaitValue64",
                        code: CudaError::NOT_SUPPORTED,
                    });
                }
                match self.inbox.as_ref().filter(|i| i.is_ours(counter)) {
                    Some(inbox) => {
                        if !own {
                            inbox.may_wait(exporter, counter)?;
                            if inbox.is_released(exporter, counter) {
                                // Released: it passes (or, for a value named after the
                                // release, never would): no wait is queued.
                                return Ok(());
                            }
                        }
                        inbox.slab().wait(counter.offset, counter.value, stream)?;
                    }
                    // Another backend's slab in this process.
                    None => match fence::local_slab(counter.slab_id).filter(|_| own) {
                        Some(slab) => slab.wait(counter.offset, counter.value, stream)?,
                        None => {
                            return Err(Error::FenceRefused {
                                producer: *exporter,
                                reason: crate::inbox::FenceRefusal::ForeignSlab,
                            });
                        }
                    },
                }
            }
        }
        self.waits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// (alive, lent out or retired with work still running) interprocess events of the
    /// pool (retired events whose work completed are swept free first).
    pub fn event_counts(&self) -> (usize, usize) {
        self.events.counts()
    }

    /// How many other processes' events this backend holds open.
    pub fn opened_events(&self) -> usize {
        self.opened_events.len()
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
    fn export_pool(&self) -> Result<Arc<ExportPool>> {
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

    /// The fence inbox.
    fn inbox(&self) -> Result<&Inbox> {
        self.inbox.as_ref().ok_or(Error::Cuda {
            op: "cuStreamWriteValue64",
            code: CudaError::NOT_SUPPORTED,
        })
    }

    /// `peer`'s inbox mapped here, opened on first use, with its grant; `None` if `peer`
    /// lent us none.
    fn peer_inbox(&self, peer: &ProcessId) -> Result<Option<(Arc<OpenedSlab>, InboxGrant)>> {
        let Some(inbox) = &self.inbox else {
            return Ok(None);
        };
        let Some(grant) = inbox.peer_grant(peer) else {
            return Ok(None);
        };
        let ops = self.stream_ops.ok_or(Error::Cuda {
            op: "cuStreamWriteValue64",
            code: CudaError::NOT_SUPPORTED,
        })?;
        let slab = self.peer_inboxes.get_or_open(&(*peer, grant.slab_id), || {
            OpenedSlab::open(&self.access.ctx, &grant.slab, ops).map(Arc::new)
        })?;
        Ok(Some((slab, grant)))
    }

    /// Whether a fence this process recorded has landed. One whose event or slab is gone
    /// counts as landed: nothing of ours can wait on it any more.
    fn own_fence_landed(&self, fence: &FenceHandle) -> Result<bool> {
        match fence {
            FenceHandle::Event(handle) => match event::local_event(&handle.0) {
                Some(ev) => ev.is_complete(),
                None => Ok(true),
            },
            FenceHandle::Counter(counter) => {
                let slab = match self.inbox.as_ref().filter(|i| i.is_ours(counter)) {
                    Some(inbox) => Some(Arc::clone(inbox.slab())),
                    None => fence::local_slab(counter.slab_id),
                };
                match slab {
                    Some(slab) => slab.holds(counter.offset, counter.value),
                    None => Ok(true),
                }
            }
        }
    }

    /// Release stream `i` (waited on what the fence must follow, its mark lock held)
    /// records a counter fence for `to`: written into `to`'s inbox with its local twin in
    /// ours, a fence in our own slab when `to` is us, or — without a usable lane from
    /// `to` — a pooled interprocess event.
    fn fence_on(
        &self,
        i: usize,
        stream: &CudaStream,
        mark: &mut MutexGuard<'_, u64>,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        // Only counter backends have an inbox, whose mark lock the caller holds.
        let inbox = self.inbox()?;
        if *to == crate::process::current() {
            return Ok(Some(Arc::new(inbox.slab().record(stream)?)));
        }
        let lane = match self.peer_inbox(to)? {
            Some((slab, grant)) => inbox
                .next_peer_value(to, i)
                .filter(|h| h.slab_id == grant.slab_id)
                .map(|h| (slab, h)),
            None => None,
        };
        match lane {
            Some((slab, handle)) => {
                slab.write_on(handle.offset, handle.value, stream)?;
                let local = inbox.write_mark(mark, i, stream)?;
                Ok(Some(Arc::new(PeerFence { handle, local })))
            }
            // `to` lent us no lane we can use (none, several, or it is gone): a pooled
            // interprocess event, which any process can wait on, and nothing blocks here.
            // (Its waiter bridges the wait through memory of its own: `cuda/bridge.rs`.)
            None => Ok(Some(Arc::new(self.events.record_for(stream, Some(*to))?))),
        }
    }

    fn opened_event(
        &self,
        exporter: &ProcessId,
        handle: &IpcEventHandle,
    ) -> Result<Arc<OpenedEvent>> {
        let key = (*exporter, handle.0);
        if let Some(ev) = self.opened_events.get(&key) {
            return Ok(ev);
        }
        if self.opened_events.len() >= OPENED_EVENT_CAP {
            tracing::debug!(cap = OPENED_EVENT_CAP, "dropping cached opened events");
            // Destroyed here, with no lock held.
            drop(self.opened_events.take_where(|_| true));
        }
        self.opened_events.get_or_open(&key, || {
            OpenedEvent::open(&self.access.ctx, &handle.0).map(Arc::new)
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

    /// `size` bytes from the pool on `stream`, with their export data.
    fn allocate_pool(
        &self,
        id: AllocationId,
        size: usize,
        stream: SharedStream,
    ) -> Result<Exported> {
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
    fn open_remote(&self, handle: &CheckedHandle<'_>, fd: Option<OwnedFd>) -> Result<Mapped> {
        self.check_device(handle.device)?;
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

impl CudaBackend {
    /// The CUDA stream a [`StreamRef`] names: the backend's own, or the caller's (which
    /// must be of the backend's device).
    fn stream_of<'a>(&'a self, stream: StreamRef<'a>, op: &'static str) -> Result<&'a CudaStream> {
        match stream {
            StreamRef::Internal => Ok(&self.access.stream),
            StreamRef::Cuda(s) if s.context().cu_device() == self.dev => Ok(s),
            StreamRef::Cuda(_) => Err(Error::Cuda {
                op,
                code: CudaError::INVALID_CONTEXT,
            }),
            StreamRef::Id(_) => Err(Error::Cuda {
                op,
                code: CudaError::INVALID_VALUE,
            }),
        }
    }

    /// The release stream for marks of `stream` (made on first use), and its index.
    fn release_stream(&self, stream: crate::ordering::StreamKey) -> Result<(usize, SharedStream)> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(stream);
        let i = (hash as usize) % RELEASE_STREAMS;
        let slot = &self.release_streams[i];
        if let Some(s) = slot.get() {
            return Ok((i, Arc::clone(s)));
        }
        // cudarc binds the context to make a stream: put the caller's back.
        let keep = KeepCurrent::new()?;
        let made = self
            .access
            .ctx
            .new_stream()
            .map_err(result::from_driver("cuStreamCreate"))?;
        drop(keep);
        // Two threads may race here: the loser's stream is dropped (quietly).
        let made: SharedStream = Arc::new(Quiet::new(made));
        Ok((i, Arc::clone(slot.get_or_init(|| made))))
    }
}

/// The VMM granularity of `dev` if it supports VMM memory shared as POSIX fds.
fn vmm_support(dev: sys::CUdevice) -> Result<Option<usize>> {
    use result::attr::{
        HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
    };
    // SAFETY: the driver is initialised; `dev` is a valid device.
    let vmm = unsafe { result::device_attribute(dev, VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED) }?;
    // SAFETY: as above.
    let fd = unsafe { result::device_attribute(dev, HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) }?;
    if vmm == 0 || fd == 0 {
        return Ok(None);
    }
    // SAFETY: as above; the properties name `dev`.
    let g = unsafe { result::mem_granularity(&result::vmm_prop(dev)) }?;
    Ok(Some(g.max(1)))
}

/// Whether `dev` has memory pools that can be shared as POSIX fds.
fn pool_support(dev: sys::CUdevice) -> Result<bool> {
    use result::attr::{MEMORY_POOLS_SUPPORTED, MEMPOOL_SUPPORTED_HANDLE_TYPES};
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, as a bit of the mask.
    const POSIX_FD_BIT: i32 = 1;
    // SAFETY: the driver is initialised; `dev` is a valid device.
    let pools = unsafe { result::device_attribute(dev, MEMORY_POOLS_SUPPORTED) }?;
    // SAFETY: as above. A driver that does not know the attribute supports no such pools.
    let types =
        unsafe { result::device_attribute(dev, MEMPOOL_SUPPORTED_HANDLE_TYPES) }.unwrap_or(0);
    Ok(pools != 0 && types & POSIX_FD_BIT != 0)
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
        self
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
            // that closed its links unmapped first.
            drop(self.pool.take_where(|_| true));
        }
        drop(self.opened_events.take_where(|(p, _)| of(p)));
        drop(self.imported_pools.take_where(|(p, _)| of(p)));
        self.release_dead(process);
        if dead {
            if let Some(inbox) = &self.inbox {
                inbox.forget_peer(process);
            }
            let mut dying = lock(&self.dying_inboxes);
            dying.extend(self.peer_inboxes.take_where(|(p, _)| of(p)));
            // Writes of ours into them may still be queued: close them once every release
            // stream has drained (now, or at a later death; else when the backend drops).
            if !dying.is_empty() && matches!(self.flush_fences(DYING_INBOX_WAIT), Ok(true)) {
                dying.clear();
            }
        }
    }
}

impl StreamOrdering for CudaBackend {
    /// [`wait_fence_on`](CudaBackend::wait_fence_on) `stream` (the backend's own for
    /// [`StreamRef::Internal`]). Events and counter slabs of other processes are opened once
    /// and kept until [`forget_process`](Backend::forget_process); this process's own are
    /// used directly.
    fn order_after(
        &self,
        stream: StreamRef<'_>,
        producer: &ProcessId,
        fence: &FenceHandle,
    ) -> Result<()> {
        let stream = self.stream_of(stream, "cuStreamWaitEvent")?;
        self.wait_fence_on(producer, fence, stream)
    }

    /// `cuIpcOpenEventHandle` of another process's event, once per (process, event);
    /// nothing for counter fences (they lie in our own inbox) or this process's own.
    fn prepare_fence(&self, producer: &ProcessId, fence: &FenceHandle) -> Result<()> {
        if *producer == crate::process::current() {
            return Ok(());
        }
        match fence {
            FenceHandle::Event(handle) => self.opened_event(producer, handle).map(drop),
            FenceHandle::Counter(_) => Ok(()),
        }
    }

    /// Another process's event is open already; counter fences need nothing opened.
    fn fence_prepared(&self, producer: &ProcessId, fence: &FenceHandle) -> bool {
        if *producer == crate::process::current() {
            return true;
        }
        match fence {
            FenceHandle::Event(handle) => self.opened_events.get(&(*producer, handle.0)).is_some(),
            FenceHandle::Counter(_) => true,
        }
    }

    /// A pooled cudarc event of the backend's context (`cuEventCreate` on first use), for
    /// `stream`, a stream of the backend's context.
    fn use_mark(&self, stream: StreamRef<'_>) -> Result<Option<Box<dyn UseMark>>> {
        self.stream_of(stream, "cuEventRecord")?;
        Ok(Some(Box::new(self.marks.lend(stream)?)))
    }

    /// One of the backend's release streams waits on every mark (`cuStreamWaitEvent`), then
    /// records a fence of the backend's kind there: a counter written into `to`'s inbox
    /// (`cuStreamWriteValue64`, with its local twin in ours), or a pooled interprocess
    /// event (`cuEventRecord`, retired, not freed, when the fence drops: recorded again
    /// only once this work has completed). A counter slot of a lane is written by one
    /// release stream only, under its lock, so its values land in order.
    fn export_fence(
        &self,
        after: &[&dyn UseMark],
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let Some(first) = after.first() else {
            return Ok(None);
        };
        let (i, stream) = self.release_stream(first.stream())?;
        let Some(inbox) = &self.inbox else {
            for mark in after {
                mark.order(StreamRef::Cuda(&stream))?;
            }
            return Ok(Some(Arc::new(self.events.record_for(&stream, waiter(to))?)));
        };
        let mut held = inbox.mark_lock(i);
        for mark in after {
            mark.order(StreamRef::Cuda(&stream))?;
        }
        self.fence_on(i, &stream, &mut held, to)
    }

    /// A release stream waits on `fence`, then records a fence for `to` (as
    /// [`export_fence`](StreamOrdering::export_fence)).
    fn relay_fence(
        &self,
        producer: &ProcessId,
        fence: &FenceHandle,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let (i, stream) = self.release_stream(crate::ordering::StreamKey::Internal)?;
        let Some(inbox) = &self.inbox else {
            self.wait_fence_on(producer, fence, &stream)?;
            return Ok(Some(Arc::new(self.events.record_for(&stream, waiter(to))?)));
        };
        let mut held = inbox.mark_lock(i);
        self.wait_fence_on(producer, fence, &stream)?;
        self.fence_on(i, &stream, &mut held, to)
    }

    /// None for this process itself (its fences for itself use its own slots).
    fn inbox_grant(&self, peer: &ProcessId) -> Option<InboxGrant> {
        if *peer == crate::process::current() {
            return None;
        }
        self.inbox.as_ref()?.grant(peer)
    }

    /// Notes the grant, and maps the peer's inbox (`cuIpcOpenMemHandle_v2`, once per
    /// (process, slab)).
    fn accept_inbox(&self, peer: &ProcessId, grant: &InboxGrant) -> Result<()> {
        let Some(inbox) = &self.inbox else {
            return Ok(());
        };
        if *peer == crate::process::current() {
            return Ok(());
        }
        inbox.accept(peer, grant);
        self.peer_inbox(peer).map(drop)
    }

    fn check_fence(&self, producer: &ProcessId, fence: &FenceHandle) -> Result<()> {
        if *producer == crate::process::current() {
            // Our own fence (a loopback link): waited on in our own memory.
            return match fence {
                FenceHandle::Counter(c)
                    if self.inbox.as_ref().is_some_and(|i| i.is_ours(c))
                        || fence::local_slab(c.slab_id).is_some() =>
                {
                    Ok(())
                }
                FenceHandle::Counter(_) => Err(Error::FenceRefused {
                    producer: *producer,
                    reason: crate::inbox::FenceRefusal::ForeignSlab,
                }),
                FenceHandle::Event(_) => Ok(()),
            };
        }
        match (fence, &self.inbox) {
            (FenceHandle::Counter(counter), Some(inbox)) => inbox.check(producer, counter),
            (FenceHandle::Counter(_), None) => Err(Error::FenceRefused {
                producer: *producer,
                reason: crate::inbox::FenceRefusal::NoLane,
            }),
            (FenceHandle::Event(handle), _) => {
                // Named again: our waits on its older records are over (`cuda/event.rs`),
                // on a bridge slot or polled on a thread (`wait_here`).
                if let Some(ev) = self.opened_events.get(&(*producer, handle.0)) {
                    ev.renamed();
                }
                self.bridge.renamed(producer, &handle.0);
                Ok(())
            }
        }
    }

    /// Event fences only: counter fences lend nothing for long (a slot comes back when its
    /// value lands, which the GPU does on its own), and a peer without a usable lane is
    /// rare enough to meet `EventsExhausted` instead.
    fn fence_room(&self, to: &ProcessId) -> bool {
        self.fence != FenceKind::Event
            || *to == crate::process::current()
            || self.events.room_for(waiter(to), self.event_backlog)
    }

    fn add_fence_fault_hook(&self, hook: FenceFaultHook) {
        if let Some(inbox) = &self.inbox {
            inbox.add_hook(Arc::clone(&hook));
        }
        self.bridge.add_hook(hook);
    }

    fn producer_cut(&self, process: &ProcessId) {
        if let Some(inbox) = &self.inbox {
            inbox.cut(process);
        }
        self.bridge.cut(process);
    }

    fn unsafe_to_free(&self, producer: &ProcessId, fence: &FenceHandle) -> bool {
        match (fence, &self.inbox) {
            (FenceHandle::Counter(counter), Some(inbox)) => inbox.unsafe_to_free(producer, counter),
            (FenceHandle::Counter(_), None) => false,
            (FenceHandle::Event(_), _) => {
                *producer != crate::process::current() && self.bridge.unsafe_to_free(producer)
            }
        }
    }

    /// Polls the release streams (`cuStreamQuery`, which never blocks) until each has run
    /// what it was given, or `within` passed.
    fn flush_fences(&self, within: Duration) -> Result<bool> {
        let until = Instant::now() + within;
        let _pushed = ContextGuard::push(&self.access.ctx)?;
        for stream in self.release_streams.iter().filter_map(OnceLock::get) {
            loop {
                // SAFETY: a live stream of the backend's context, which is current.
                if unsafe { result::stream_query(stream.cu_stream()) }? {
                    break;
                }
                if Instant::now() >= until {
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        Ok(true)
    }

    /// Polls each fence (a counter: its slot read back on the slab's side stream; an
    /// event: `cuEventQuery`), backing off to 1 ms, for at most twice the fence deadline
    /// and a second: our own work waits on peers only until that deadline. With `all`,
    /// polls the release streams instead ([`flush_fences`](StreamOrdering::flush_fences)).
    fn own_fences_landed(&self, fences: &[FenceHandle], all: bool) -> Result<bool> {
        let bound = self.fence_deadline * 2 + Duration::from_secs(1);
        if all {
            return self.flush_fences(bound);
        }
        let until = Instant::now() + bound;
        let mut pause = Duration::from_micros(50);
        loop {
            let mut landed = true;
            for f in fences {
                if !self.own_fence_landed(f)? {
                    landed = false;
                    break;
                }
            }
            if landed {
                return Ok(true);
            }
            if Instant::now() >= until {
                return Ok(false);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn synchronize(&self) -> Result<()> {
        CudaBackend::synchronize(self)
    }

    /// If the process is dead (`/proc`), writes `u64::MAX` into the lanes of our inbox it
    /// wrote (a memset on the watch stream, waited for: microseconds), which releases
    /// every stream of ours still waiting on its fences: its queued writes died with it.
    /// Only our own memory is written, and only our own waits are released.
    fn release_dead(&self, process: &ProcessId) {
        if crate::process::liveness(process) != crate::process::Liveness::Dead {
            return;
        }
        if let Some(inbox) = &self.inbox {
            inbox.died(process);
        }
        self.bridge.died(process);
    }
}

impl dyn Backend {
    /// The CUDA backend, if this is one (for cudarc interoperation): the downcast lives here,
    /// beside the CUDA backend, so that the [`Backend`] trait names no implementation.
    pub fn cuda(&self) -> Option<&CudaBackend> {
        AsAny::as_any(self).downcast_ref()
    }
}

/// The context current on the calling thread (`cuCtxGetCurrent`), null when none: for
/// tests and diagnostics that check Baton left it as it was.
///
/// # Errors
/// [`Error::BackendUnavailable`] without a driver; [`Error::Cuda`].
#[doc(alias = "cuCtxGetCurrent")]
pub fn current_context() -> Result<sys::CUcontext> {
    probe()?;
    // SAFETY: the driver is initialised (`probe`); a query.
    unsafe { result::ctx_get_current() }
}

/// Serialises GPU tests: device-wide measures (free memory) are only meaningful when no
/// other test uses the GPU at the same time, in this process or another. Not a stable API.
#[doc(hidden)]
pub mod testing {
    use crate::{Error, Result};
    use std::fs::File;
    use std::time::{Duration, Instant};

    /// Held while a GPU test runs: an exclusive `flock` on a file in the temporary
    /// directory, shared by every test binary of the workspace (and by threads of one, as
    /// each takes its own open file description).
    #[derive(Debug)]
    pub struct GpuTestLock {
        _file: File,
    }

    /// Waits (polling, at most `deadline`) for the GPU to be free of other Baton tests.
    ///
    /// # Errors
    /// [`Error::Io`]; [`Error::Timeout`] past the deadline.
    pub fn exclusive_gpu(deadline: Duration) -> Result<GpuTestLock> {
        use rustix::fs::{FlockOperation, flock};
        let path = std::env::temp_dir().join("baton-gpu-tests.lock");
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(Error::io("opening the GPU test lock"))?;
        let start = Instant::now();
        loop {
            match flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(GpuTestLock { _file: file }),
                Err(e) if e == rustix::io::Errno::WOULDBLOCK || e == rustix::io::Errno::INTR => {
                    if start.elapsed() > deadline {
                        return Err(Error::Timeout {
                            op: "waiting for other GPU tests to finish",
                            after: deadline,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    return Err(Error::Io {
                        op: "locking the GPU test lock",
                        source: e.into(),
                    });
                }
            }
        }
    }

    /// Copies `dst.len()` bytes from device address `src` of device `ordinal`'s primary
    /// context (the one every [`CudaBackend`](super::CudaBackend) of that device uses), with
    /// no lease or cache in the way: a test reads what a mapping shows after its lease turned
    /// orphaned.
    ///
    /// # Safety
    /// `src .. src + dst.len()` is device memory this process maps (an allocation or an
    /// opened handle not yet closed): a copy from an unmapped address may fault and poison
    /// the context.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub unsafe fn read_device(ordinal: usize, src: u64, dst: &mut [u8]) -> Result<()> {
        let ctx = cudarc::driver::CudaContext::new(ordinal)
            .map_err(super::result::from_driver("cuDevicePrimaryCtxRetain"))?;
        let _pushed = super::ContextGuard::push(&ctx)?;
        // SAFETY: the primary context is current; `dst` is a valid host slice of the length
        // copied; the device range is mapped (the caller's contract).
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, src) }
            .map_err(super::result::from_driver("cuMemcpyDtoH"))
    }

    /// Copies `src` to device address `dst` of device `ordinal` (`cuMemcpyHtoD`), in its
    /// primary context, whatever Baton's rules say: a test's stand-in for another
    /// process's unsafe code that writes through a raw pointer.
    ///
    /// # Safety
    /// As [`read_device`]: `dst..dst + src.len()` is device memory mapped in this process.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub unsafe fn write_device(ordinal: usize, dst: u64, src: &[u8]) -> Result<()> {
        let ctx = cudarc::driver::CudaContext::new(ordinal)
            .map_err(super::result::from_driver("cuDevicePrimaryCtxRetain"))?;
        let _pushed = super::ContextGuard::push(&ctx)?;
        // SAFETY: the primary context is current; `src` is a valid host slice of the length
        // copied; the device range is mapped (the caller's contract).
        unsafe { cudarc::driver::result::memcpy_htod_sync(dst, src) }
            .map_err(super::result::from_driver("cuMemcpyHtoD"))
    }
}

/// How many pooled events recorded for one process may wait for their work before a
/// sender offering it a buffer waits ([`StreamOrdering::fence_room`],
/// [`CudaBackendBuilder::event_backlog`]): each such event's work waits, through the other
/// process's bridge, on the work before it, and a host loop that runs ahead of that chain
/// would run the pool dry (`docs/ORDERING.md`, "Costs and limits").
pub const DEFAULT_EVENT_BACKLOG: usize = 8;

/// The variable that sets [`CudaBackendBuilder::event_backlog`] for backends built from
/// the environment.
pub const EVENT_BACKLOG_ENV: &str = "BATON_EVENT_BACKLOG";

/// [`EVENT_BACKLOG_ENV`]'s value, [`DEFAULT_EVENT_BACKLOG`] if unset or not a positive
/// number (logged).
fn event_backlog_from_env() -> usize {
    match std::env::var(EVENT_BACKLOG_ENV) {
        Err(_) => DEFAULT_EVENT_BACKLOG,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                tracing::warn!(value = %v, "{EVENT_BACKLOG_ENV} is not a positive number: using the default");
                DEFAULT_EVENT_BACKLOG
            }
        },
    }
}

/// Whom an event recorded for `to` is lent to ([`event`]'s reuse rules): nobody in
/// particular for this process itself (its own waits capture the record when queued).
fn waiter(to: &ProcessId) -> Option<ProcessId> {
    (*to != crate::process::current()).then_some(*to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_modes_parse() {
        assert_eq!(CudaExport::parse("vmm"), Some(CudaExport::Vmm));
        assert_eq!(CudaExport::parse(" Legacy "), Some(CudaExport::Legacy));
        assert_eq!(CudaExport::parse("pool"), Some(CudaExport::Pool));
        assert_eq!(CudaExport::parse("fabric"), None);
        assert_eq!(CudaExport::Vmm.kind(), BackendKind::CudaVmm);
        assert_eq!(CudaExport::Pool.kind(), BackendKind::CudaPool);
        assert_eq!(CudaExport::default(), CudaExport::Legacy);
        for e in [CudaExport::Legacy, CudaExport::Vmm, CudaExport::Pool] {
            assert_eq!(CudaExport::parse(e.name()), Some(e));
        }
    }

    /// Without a driver, asking for the backend is an error that says why, never a panic.
    #[test]
    fn absence_is_an_error_with_a_reason() {
        match probe() {
            Ok(n) => assert!(n > 0),
            Err(Error::BackendUnavailable { backend, reason }) => {
                assert_eq!(backend, "cuda");
                assert!(!reason.is_empty());
                for export in [CudaExport::Legacy, CudaExport::Vmm, CudaExport::Pool] {
                    assert!(matches!(
                        CudaBackend::new(0, export),
                        Err(Error::BackendUnavailable { .. })
                    ));
                }
                assert!(matches!(
                    current_context(),
                    Err(Error::BackendUnavailable { .. })
                ));
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn live_tokens_count_and_uncount() {
        let counters = Arc::new(LiveCounters::default());
        let a = LiveToken::new(&counters, false, 100);
        let b = LiveToken::new(&counters, true, 7);
        let c = LiveToken::new(&counters, false, 5);
        assert_eq!(
            counters.snapshot(),
            LiveMemory {
                exported: 2,
                exported_bytes: 105,
                imported: 1,
                imported_bytes: 7
            }
        );
        drop((a, b));
        assert_eq!(counters.snapshot().exported_bytes, 5);
        drop(c);
        assert!(counters.snapshot().is_empty());
    }

    use crate::{FrameFds, ImportCache, Session};
    use baton_messages::SessionToken;
    use std::time::Duration;

    fn gpu_lock() -> testing::GpuTestLock {
        testing::exclusive_gpu(Duration::from_secs(1800)).expect("the GPU test lock")
    }

    fn gpu_backend(export: CudaExport, events: usize) -> Arc<CudaBackend> {
        Arc::new(
            CudaBackend::with_event_limit(0, export, events)
                .unwrap_or_else(|e| panic!("gpu-tests need a CUDA GPU: {e}")),
        )
    }

    fn device_ptr(alloc: &Allocation) -> u64 {
        match alloc.ptr() {
            MemPtr::Device(p) => p,
            MemPtr::Host(_) => unreachable!("device memory"),
        }
    }

    /// Queues `n` memsets of the whole allocation on `stream` (the last one to `last`):
    /// long work without a kernel.
    fn long_work(alloc: &Allocation, stream: &CudaStream, n: usize, last: u8) {
        let _pushed = ContextGuard::push(stream.context()).unwrap();
        for i in 0..n {
            let byte = if i + 1 == n {
                last
            } else {
                last.wrapping_add(1)
            };
            // SAFETY: the whole live allocation, on a live stream of its context (current);
            // the caller waits for the work before the allocation drops.
            unsafe {
                result::memset_d8_async(device_ptr(alloc), byte, alloc.size(), stream.cu_stream())
            }
            .unwrap();
        }
    }

    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn the_event_pool_lends_up_to_its_limit_and_reuses_returned_events() {
        let _gpu = gpu_lock();
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

    /// The import cache waits on an event of this very process (one wait queued on the
    /// backend stream), without opening it as another process's event and without a
    /// driver-level open of the memory.
    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn own_events_are_waited_on_without_opening_them() {
        let _gpu = gpu_lock();
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
        assert_eq!(b.waits(), 0);
        let opened = cache.open(&h, &mut FrameFds::none()).unwrap();
        assert_eq!(b.waits(), 1, "the cache had the backend wait on the event");
        assert_eq!(opened.to_vec().unwrap(), vec![9; 1 << 20]);
        assert_eq!((b.opens(), b.opened_events()), (0, 0));
        let again = cache.open(&h, &mut FrameFds::none()).unwrap();
        assert_eq!(b.waits(), 2, "a cache hit waits too");
        assert_eq!((b.opens(), b.opened_events()), (0, 0));
        drop((opened, again));
    }

    /// A legacy backend allocates VMM memory when asked (`allocate_as`), and names VMM as
    /// the export for bulk buffers on a device that has it; its handle is a VMM one. (An
    /// importer opening it is the Python suite's bundle tests: a Rust peer maps each.)
    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn a_legacy_backend_allocates_vmm_memory_for_bulk_buffers() {
        let _gpu = gpu_lock();
        let b = gpu_backend(CudaExport::Legacy, 2);
        assert_eq!(b.export(), CudaExport::Legacy);
        assert_eq!(b.bulk_export(), CudaExport::Vmm, "H100 and H200 have VMM");
        let alloc = b.allocate_as(b.bulk_export(), 3 << 20).unwrap();
        assert_eq!(alloc.backend(), BackendKind::CudaVmm);
        assert!(alloc.size() >= 3 << 20);
        alloc.fill(0, 3 << 20, 5).unwrap();
        let mut back = vec![0; 3 << 20];
        alloc.read(0, &mut back).unwrap();
        assert_eq!(back, vec![5; 3 << 20]);
        assert!(matches!(
            alloc.raw().raw_handle(Some(0)).unwrap(),
            RawHandle::CudaVmmFd { slot: Some(0) }
        ));
        assert!(
            alloc.raw().export_fd().is_some(),
            "a descriptor goes with its handles"
        );
        assert!(matches!(
            b.allocate_as(CudaExport::Vmm, 0),
            Err(Error::ZeroSize)
        ));
        alloc.free().unwrap();
    }

    /// Memory allocated outside Baton (`cuMemAlloc`, as PyTorch's caching allocator does) is
    /// borrowed through its base: shared as a legacy handle, opened (here, in the exporting
    /// process, as its own memory), never freed by Baton, its keeper dropped when the
    /// allocation is; an interior address, a second borrow while the first lives, and an
    /// address no allocation holds are refused with a reason.
    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn memory_allocated_elsewhere_is_borrowed_by_its_base_and_its_keeper_dropped_with_it() {
        use std::sync::atomic::AtomicBool;
        /// Owns the allocation (freed when dropped) and says when it dropped.
        struct Keeper(
            #[expect(dead_code, reason = "held: freed on drop")] DeviceAlloc,
            Arc<AtomicBool>,
        );
        impl Drop for Keeper {
            fn drop(&mut self) {
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let _gpu = gpu_lock();
        let b = gpu_backend(CudaExport::Vmm, 2);
        let session = Session::new(SessionToken::from_bytes([4; 32]));
        let cache = ImportCache::new(session.clone(), [b.clone() as crate::SharedBackend]);
        let theirs = DeviceAlloc::new(&b.access.ctx, 3 << 20).unwrap();
        let base = theirs.ptr();
        assert_eq!(b.address_range(base + 4096).unwrap(), (base, 3 << 20));
        let dropped = Arc::new(AtomicBool::new(false));
        let keep = Box::new(Keeper(theirs, Arc::clone(&dropped)));
        // SAFETY: `keep` owns the allocation and frees it only when dropped.
        let alloc = unsafe { b.borrow(base, keep) }.unwrap();
        assert_eq!((device_ptr(&alloc), alloc.size()), (base, 3 << 20));
        assert_eq!(
            alloc.backend(),
            BackendKind::CudaLegacy,
            "whatever the backend's export"
        );
        assert_eq!(b.live().exported_bytes, 3 << 20);
        alloc.fill(0, 3 << 20, 7).unwrap();
        let h = alloc.handle(&session).build().unwrap();
        let opened = cache.open(&h, &mut FrameFds::none()).unwrap();
        assert_eq!(opened.to_vec().unwrap(), vec![7; 3 << 20]);

        let refused = |r: Result<Allocation>| match r {
            Err(Error::NotBorrowable { reason, .. }) => reason,
            other => panic!("not refused: {other:?}"),
        };
        // SAFETY: refused before anything is kept (each of these).
        let inside = refused(unsafe { b.borrow(base + 4096, Box::new(())) });
        assert!(inside.contains("inside the allocation"), "{inside}");
        // SAFETY: as above.
        let again = refused(unsafe { b.borrow(base, Box::new(())) });
        assert!(again.contains("borrowed the allocation already"), "{again}");
        assert!(matches!(
            b.address_range(8),
            Err(Error::NotBorrowable { ptr: 8, .. })
        ));
        // Baton's own VMM memory: legacy IPC cannot share it.
        let vmm = b.allocate(1 << 20).unwrap();
        // SAFETY: as above.
        let no_ipc = refused(unsafe { b.borrow(device_ptr(&vmm), Box::new(())) });
        assert!(
            no_ipc.contains("legacy CUDA IPC cannot share it"),
            "{no_ipc}"
        );

        // The cache's warm mapping of our own memory holds it too: drop both first.
        drop((opened, cache));
        assert!(!dropped.load(Ordering::SeqCst), "the allocation lives");
        alloc.free().unwrap();
        assert!(dropped.load(Ordering::SeqCst), "freeing dropped the keeper");
        assert_eq!(
            b.live().exported_bytes,
            vmm.size(),
            "the VMM allocation only"
        );
        // Released, the allocation may be borrowed again.
        let theirs = DeviceAlloc::new(&b.access.ctx, 1 << 20).unwrap();
        let base = theirs.ptr();
        // SAFETY: as above.
        let again = unsafe { b.borrow(base, Box::new(theirs)) }.unwrap();
        again.free().unwrap();
    }

    /// DESIGN and this module rely on the driver refusing to open a legacy handle in the
    /// process that exported it (hence the process-local registry): this fails if a driver
    /// starts accepting it.
    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn the_driver_refuses_our_own_legacy_handle() {
        let _gpu = gpu_lock();
        let b = gpu_backend(CudaExport::Legacy, 1);
        let alloc = b.allocate(1 << 20).unwrap();
        let RawHandle::CudaIpc(raw) = alloc.raw().raw_handle(None).unwrap() else {
            unreachable!()
        };
        match IpcMapping::open(&b.access.ctx, &raw.0) {
            Ok(mut m) => {
                let at = m.ptr();
                m.close().unwrap();
                panic!(
                    "the driver opened our own handle at {at:#x} (ours {:?}): update DESIGN.md",
                    alloc.ptr()
                );
            }
            Err(e) => eprintln!("the driver refused our own handle, as DESIGN records: {e}"),
        }
    }

    /// Allocate, write, read, open (a driver-level VMM import of our own descriptor, and
    /// cache opens), wait on fences and drop everything, backends included, on a thread
    /// with no current context and then on one whose current context is the device's
    /// primary context: the thread's current context is the same afterwards.
    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn the_callers_current_context_is_left_as_it_was() {
        let _gpu = gpu_lock();
        fn exercise(export: CudaExport) {
            let b = Arc::new(
                CudaBackend::builder(0)
                    .export(export)
                    .fence(FenceKind::Counter)
                    .build()
                    .unwrap(),
            );
            let session = Session::new(SessionToken::from_bytes([4; 32]));
            let cache = ImportCache::new(session.clone(), [b.clone() as crate::SharedBackend]);
            let alloc = b.allocate(2 << 20).unwrap();
            alloc.write(0, b"context").unwrap();
            let mut back = [0u8; 7];
            alloc.read(0, &mut back).unwrap();
            assert_eq!(&back, b"context");
            let stream = {
                let _keep = KeepCurrent::new().unwrap();
                b.context().new_stream().unwrap()
            };
            let mine = b.allocate_on(&stream, 2 << 20);
            if b.pools_supported() {
                let mine = mine.unwrap();
                mine.fill(0, 16, 1).unwrap();
            }
            let fence = b.record_fence().unwrap();
            b.wait_fence(&crate::process::current(), &fence.handle())
                .unwrap();
            let ev = b.record_event().unwrap();
            let h = alloc
                .handle(&session)
                .event(ev.ipc_handle())
                .build()
                .unwrap();
            // What a frame carrying this handle would carry: the descriptor it names, if
            // any (a pool allocation's names the pool's).
            let mut fds = match h.raw.fd_slot() {
                Some(_) => FrameFds::new(vec![
                    alloc.export_fd().unwrap().try_clone_to_owned().unwrap(),
                ]),
                None => FrameFds::none(),
            };
            let opened = cache.open(&h, &mut fds).unwrap();
            opened.write(0, b"CONTEXT").unwrap();
            if export == CudaExport::Vmm {
                let fd = alloc.export_fd().unwrap().try_clone_to_owned().unwrap();
                let checked = session.check(&h).unwrap();
                let m = b.open_remote(&checked, Some(fd)).unwrap();
                let mut got = [0u8; 7];
                m.read(0, &mut got).unwrap();
                assert_eq!(&got, b"CONTEXT");
                Box::new(m).close().unwrap();
            }
            drop((opened, ev, fence, alloc));
            let _keep = KeepCurrent::new().unwrap();
            drop(stream);
            drop(_keep);
            drop(cache);
            drop(b);
        }
        for export in [CudaExport::Legacy, CudaExport::Vmm, CudaExport::Pool] {
            // A fresh thread has no current context.
            std::thread::spawn(move || {
                assert!(current_context().unwrap().is_null());
                exercise(export);
                assert!(
                    current_context().unwrap().is_null(),
                    "{export:?}: Baton left a context current"
                );
            })
            .join()
            .unwrap();
            // A thread whose current context is the device's primary context, pushed by
            // the caller.
            std::thread::spawn(move || {
                let ctx = CudaContext::new(0).unwrap();
                assert_eq!(current_context().unwrap(), ctx.cu_ctx());
                exercise(export);
                assert_eq!(
                    current_context().unwrap(),
                    ctx.cu_ctx(),
                    "{export:?}: Baton changed the current context"
                );
            })
            .join()
            .unwrap();
        }
    }

    /// Pool memory: allocated zeroed, written and read back, counted while alive, shared as
    /// a pool handle naming the pool's descriptor slot, opened in this process as its own
    /// memory, declared unsafe to free while mapped; `allocate_on` a user's stream works
    /// the same; nothing is counted once all is dropped.
    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn pool_memory_round_trips_and_is_counted() {
        let _gpu = gpu_lock();
        let b = gpu_backend(CudaExport::Pool, 4);
        assert!(b.pools_supported());
        assert!(b.live().is_empty());
        let alloc = b.allocate(3 << 20).unwrap();
        assert_eq!(alloc.backend(), BackendKind::CudaPool);
        assert_eq!(alloc.free_while_mapped(), FreeWhileMapped::Unsafe);
        assert_eq!(alloc.to_vec().unwrap(), vec![0; 3 << 20], "zeroed");
        alloc.fill(5, 100, 0x42).unwrap();
        let mut got = [0u8; 100];
        alloc.read(5, &mut got).unwrap();
        assert_eq!(got, [0x42; 100]);
        assert_eq!(
            b.live(),
            LiveMemory {
                exported: 1,
                exported_bytes: 3 << 20,
                ..LiveMemory::default()
            }
        );
        let RawHandle::CudaPool {
            pool, pool_slot, ..
        } = alloc.raw().raw_handle(Some(2)).unwrap()
        else {
            panic!("a pool handle")
        };
        assert_eq!(pool_slot, Some(2));
        assert!(alloc.export_fd().is_some(), "the pool's descriptor");

        let session = Session::new(SessionToken::from_bytes([5; 32]));
        let cache = ImportCache::new(session.clone(), [b.clone() as crate::SharedBackend]);
        let h = alloc.handle(&session).fd_slot(None).build().unwrap();
        let opened = cache.open(&h, &mut FrameFds::none()).unwrap();
        assert_eq!(opened.ptr(), alloc.ptr(), "its own memory");
        assert_eq!(b.opens(), 0);

        let stream = {
            let _keep = KeepCurrent::new().unwrap();
            b.context().new_stream().unwrap()
        };
        let mine = b.allocate_on(&stream, 2 << 20).unwrap();
        let RawHandle::CudaPool { pool: same, .. } = mine.raw().raw_handle(None).unwrap() else {
            panic!("a pool handle")
        };
        assert_eq!(same, pool, "one pool per backend");
        assert_eq!(mine.to_vec().unwrap(), vec![0; 2 << 20], "zeroed, in order");
        assert_eq!(b.live().exported, 2);
        drop(opened);
        drop((alloc, mine));
        assert!(b.live().is_empty(), "{:?}", b.live());
        b.trim_pool(0).unwrap();
        let _keep = KeepCurrent::new().unwrap();
        drop(stream);
    }

    /// A counter fence recorded on a producer stream behind long work: the backend stream
    /// that waits on it (a local wait: the fence is this process's) reads only the finished
    /// data, and the fence reports completion only after that work.
    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn counter_fences_order_a_waiting_stream_after_the_producer() {
        let _gpu = gpu_lock();
        let b = CudaBackend::builder(0)
            .fence(FenceKind::Counter)
            .counter_slots(4)
            .build()
            .unwrap();
        assert_eq!(
            b.fence_kind(),
            FenceKind::Counter,
            "this GPU has no 64-bit stream memory operations"
        );
        let alloc = b.allocate(256 << 20).unwrap();
        let producer = {
            let _keep = KeepCurrent::new().unwrap();
            b.context().new_stream().unwrap()
        };
        long_work(&alloc, &producer, 2000, 0x33);
        let fence = b.record_fence_on(&producer).unwrap();
        assert_eq!(fence.kind(), FenceKind::Counter);
        assert!(
            !fence.is_complete().unwrap(),
            "the work still ran when the fence was recorded (else this test proves nothing)"
        );
        assert_eq!(b.fence_counts(), (4, 1));
        b.wait_fence(&crate::process::current(), &fence.handle())
            .unwrap();
        assert_eq!(b.waits(), 1);
        let data = alloc.to_vec().unwrap();
        assert!(
            data.iter().all(|&x| x == 0x33),
            "the waiting stream read unfinished data"
        );
        assert!(fence.is_complete().unwrap());
        fence.synchronize().unwrap();
        drop(fence);
        assert_eq!(
            b.fence_counts(),
            (4, 0),
            "a dropped fence whose value landed is free again"
        );
        // Slots are reused with a higher value each time.
        let again = b.record_fence().unwrap();
        let FenceHandle::Counter(c) = again.handle() else {
            unreachable!()
        };
        again.synchronize().unwrap();
        assert!(c.value >= 1);
        let _keep = KeepCurrent::new().unwrap();
        drop(producer);
    }

    /// A dropped counter fence's slot is not lent again before its value has landed: with
    /// one slot, a record while the first value is still behind long work finds none free;
    /// once that work has completed, the slot comes back with the next value. (Lent again
    /// earlier, the slot's two writes could land out of order: a waiter for the first value
    /// would be released by the second too early, or one for the second would stall.)
    #[test]
    #[cfg_attr(
        not(feature = "gpu-tests"),
        ignore = "needs a CUDA GPU: --features gpu-tests"
    )]
    fn a_dropped_counter_slot_is_lent_again_only_once_its_value_landed() {
        let _gpu = gpu_lock();
        let b = CudaBackend::builder(0).counter_slots(1).build().unwrap();
        assert_eq!(
            b.fence_kind(),
            FenceKind::Counter,
            "counter fences are the default (this GPU has no 64-bit stream memory operations?)"
        );
        let alloc = b.allocate(256 << 20).unwrap();
        let producer = {
            let _keep = KeepCurrent::new().unwrap();
            b.context().new_stream().unwrap()
        };
        long_work(&alloc, &producer, 2000, 0x44);
        let first = b.record_fence_on(&producer).unwrap();
        let FenceHandle::Counter(c1) = first.handle() else {
            unreachable!()
        };
        assert!(
            !first.is_complete().unwrap(),
            "the work still ran when the fence was recorded (else this test proves nothing)"
        );
        drop(first);
        assert!(
            matches!(b.record_fence(), Err(Error::FencesExhausted { limit: 1 })),
            "the slot was lent again before its value landed"
        );
        {
            let _keep = KeepCurrent::new().unwrap();
            producer.synchronize().unwrap();
        }
        let second = b.record_fence().unwrap();
        let FenceHandle::Counter(c2) = second.handle() else {
            unreachable!()
        };
        assert_eq!((c2.offset, c2.value), (c1.offset, c1.value + 1));
        second.synchronize().unwrap();
        drop(second);
        let _keep = KeepCurrent::new().unwrap();
        drop(producer);
    }
}
