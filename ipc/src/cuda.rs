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
//! | exporter frees while an importer maps ([`FreeWhileMapped`](crate::FreeWhileMapped)) | `Unsafe`: undefined behaviour, the pages may be reused | `Survives`: the driver refcounts the physical memory | `Unsafe`: the driver requires every importer's free to complete first, and the pool reuses the pages |
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
//!   `Drop`, and [`CudaBackend`] puts them behind the [`Backend`](crate::Backend) trait
//!   (memory) and, through its fence service, the
//!   [`StreamOrdering`](crate::StreamOrdering) trait (fences). The context and
//!   stream are cudarc's safe [`CudaContext`] (the device's primary context) and
//!   [`CudaStream`], exposed so callers can launch their own kernels (device pointers are
//!   `u64` kernel arguments, [`MemPtr::Device`](crate::MemPtr::Device)).
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
//!   [`StreamOrdering::export_fence`](crate::StreamOrdering::export_fence) from the buffer's use marks); the handle carries it
//!   ([`HandleMsg::fence`](baton_messages::HandleMsg::fence)), and the importer makes each
//!   stream it uses the buffer on wait on it ([`StreamOrdering::order_after`](crate::StreamOrdering::order_after)) — the
//!   [`ImportCache::open`](crate::ImportCache::open) of the low-level API makes the
//!   backend's own stream wait. Release fences go the other way the same way. Fences are
//!   sequence counters (the default) or pooled IPC events ([`FenceKind`], [`FENCE_ENV`]);
//!   see [`RecordedFence`] for their reuse rules, and `docs/ORDERING.md` for the model.
//! - **Use marks and release streams.** [`StreamOrdering::use_mark`](crate::StreamOrdering::use_mark) lends a cudarc event that
//!   cudarc's `SyncOnDrop` records after each use of a buffer on a stream (`mark`);
//!   [`StreamOrdering::export_fence`](crate::StreamOrdering::export_fence) makes one of the backend's release streams wait on marks and
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
//!   live allocations; the memory is then freed when both the exporter's [`Allocation`](crate::Allocation)
//!   and that [`OpenedMem`](crate::OpenedMem) are gone.
//! - **Accounting.** [`CudaBackend::live`] counts the allocations and mappings the backend
//!   holds (and their bytes), exported and imported: exact, per backend, unlike device-wide
//!   free memory.
//! - **Availability.** [`probe`] looks for the driver library before any other driver
//!   call, and reports its absence (or a driver too old for an entry point) as
//!   [`Error::BackendUnavailable`].
//!
//! # Where things are
//!
//! One concept per file; this file holds the module's docs, what every part shares (the
//! context and stream types, [`probe`], [`CudaExport`]) and the public re-exports.
//!
//! | file | holds |
//! |---|---|
//! | `cuda/backend.rs` | [`CudaBackend`]: its fields, allocate / open / borrow, the public fence API (delegated to `ordering.rs`), its [`Backend`](crate::Backend) impl, and `<dyn Backend>::cuda()`, the downcast from a `dyn Backend` |
//! | `cuda/builder.rs` | [`CudaBackendBuilder`] and how a backend is built: the device's capabilities (VMM, pools, stream memory operations), the defaults and their environment variables |
//! | `cuda/ordering.rs` | the fence service (`Fences`): the 13 fence fields (event pool, use marks, release streams, fence inbox, bridge, opened events and peer inboxes, …), recording and waiting on fences, and the backend's [`StreamOrdering`](crate::StreamOrdering) impl, which [`Backend::ordering`](crate::Backend::ordering) hands out |
//! | `cuda/memory.rs` | the memory objects: exported allocations and imported mappings ([`RawMemory`](crate::RawMemory) / [`ExportableMemory`](crate::ExportableMemory) over them), and the process-wide registry of live and borrowed allocations that lets a process open its own handles |
//! | `cuda/live.rs` | live-memory accounting ([`LiveMemory`]): what a backend holds, counted by tokens its memory objects own |
//! | `cuda/testing.rs` | `testing`: the GPU test lock and raw device copies for tests, behind the `testing` cargo feature |
//! | `cuda/tests.rs` | the module's unit tests (GPU ones need `--features gpu-tests`) |
//! | `cuda/driver.rs`, `cuda/result.rs` | the driver's entry points, and one `Result` wrapper per driver call |
//! | `cuda/context.rs` | pushing the backend's context around driver calls |
//! | `cuda/legacy.rs`, `cuda/vmm.rs`, `cuda/pool.rs` | the RAII types of the three ways to export |
//! | `cuda/event.rs`, `cuda/fence.rs`, `cuda/mark.rs`, `cuda/inbox.rs`, `cuda/bridge.rs` | the fences' RAII types: pooled IPC events, counter fences and their slabs, use marks, the fence inbox, the bridge of waits on other processes' events |
//! | `cuda/table.rs`, `cuda/arg.rs` | open-once tables, and passing Baton's buffers as kernel arguments |
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
//! - memory accessors ([`Allocation`](crate::Allocation), [`OpenedMem`](crate::OpenedMem)) check `offset + len <= size` before
//!   calling in, and the owner of the memory outlives every access (the accessors borrow
//!   it), so every copy stays inside mapped device memory; host buffers are Rust slices.
//! - raw handle bytes reach the driver only from a [`CheckedHandle`](crate::CheckedHandle) (digest verified).

mod arg;
mod backend;
mod bridge;
mod builder;
mod context;
mod copy;
mod driver;
mod event;
mod fence;
mod inbox;
mod kernel;
mod legacy;
mod live;
mod mark;
mod memory;
mod ordering;
mod pool;
mod result;
mod table;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;
#[cfg(test)]
mod tests;
mod vmm;

pub use arg::DeviceArg;
pub use backend::CudaBackend;
pub use builder::{
    CudaBackendBuilder, DEFAULT_EVENT_BACKLOG, DEFAULT_INBOX_LANES, DEFAULT_STREAM_SLOTS,
    EVENT_BACKLOG_ENV, MAX_STREAM_SLOTS, STREAM_SLOTS_ENV, pool_size_limit_from_env,
};
pub use copy::{CopyDirection, CopyPlan, CopySpan, PEER_ENGINE_MIN};
pub use cudarc;
pub use event::{DEFAULT_EVENT_LIMIT, RecordedEvent};
pub use fence::{
    CounterFence, DEFAULT_COUNTER_SLOTS, FENCE_ENV, FenceHandle, FenceKind, RecordedFence,
    fence_kind_from_env,
};
pub use live::LiveMemory;
pub use pool::DEFAULT_POOL_RELEASE_THRESHOLD;
pub use result::CudaError;

use crate::{Error, Result};
use baton_messages::BackendKind;
use context::Quiet;
use cudarc::driver::{CudaContext, CudaStream, sys};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// The largest stream-ordered pool allocation a backend makes or opens unless
/// [`POOL_SIZE_LIMIT_ENV`] says otherwise: 5 GiB. On the drivers measured (580, CUDA 13.0,
/// H200) an importer of a pool allocation of 5.5 GiB or more dies with SIGSEGV inside
/// `cuMemPoolImportPointer` — a crash no error return reports — and 5 GiB imports
/// (`bench/pool_size_driver.py`). No driver is known to lift it, so it holds on every
/// driver until one is measured. Larger buffers go as VMM memory, which has no such bound.
pub const POOL_SIZE_LIMIT: u64 = 5 << 30;
/// The environment variable that sets the bound of [`POOL_SIZE_LIMIT`] in bytes, for a
/// driver measured to import more (or less).
pub const POOL_SIZE_LIMIT_ENV: &str = "BATON_CUDA_POOL_LIMIT";

/// How long an export pool that another process may have imported stays with no
/// allocation before [`Backend::retire_idle_pools`](crate::Backend::retire_idle_pools)
/// retires it: such a pool keeps its freed memory reserved until it is destroyed and every
/// importer dropped its import, whatever its release threshold. Within it, the next
/// allocation is a warm one; after it, the first allocation makes a fresh pool, which each
/// peer imports once.
pub const POOL_IDLE_RETIRE: std::time::Duration = std::time::Duration::from_secs(1);

/// `vmm` or `pool`.
pub const EXPORT_ENV: &str = "BATON_CUDA_EXPORT";
/// The environment variable that picks the device ordinal of [`CudaBackend::from_env`]
/// (default 0).
pub const DEVICE_ENV: &str = "BATON_CUDA_DEVICE";

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
