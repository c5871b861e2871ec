//! Stream-ordered pool memory: an exportable memory pool per backend, allocations from it
//! on a stream (`cuMemAllocFromPoolAsync`), and the importer's side: the pool imported once
//! per exporter process, each allocation mapped with `cuMemPoolImportPointer`.
//!
//! Exporter: [`ExportPool`] (`cuMemPoolCreate` with the POSIX-fd handle type, a release
//! threshold, the pool's descriptor exported once) and [`PoolAlloc`] (one allocation, freed
//! with `cuMemFreeAsync` on the stream it belongs to). Importer: [`ImportedPool`]
//! (`cuMemPoolImportFromShareableHandle`, then `cuMemPoolSetAccess` for the importing
//! device) and [`PoolMapping`] (one `cuMemPoolImportPointer`, freed with `cuMemFreeAsync`
//! on the importer's stream, which is then synchronised: the driver requires the
//! importer's free to have *completed* before the exporter frees).
//!
//! # Safety
//!
//! Each type owns one driver object and releases it once (an explicit `free`/`close`, or
//! `Drop`), with its context pushed, and holds a [`SharedContext`] so the context outlives
//! it. A [`PoolAlloc`] holds an `Arc` of its [`ExportPool`] and a [`PoolMapping`] one of its
//! [`ImportedPool`], so a pool outlives every allocation or mapping from it. Both hold the
//! stream they free on, so it outlives the free. Their pointers are valid device memory
//! for `size` bytes until they are freed.

use super::context::ContextGuard;
use super::{SharedContext, SharedStream, result};
use crate::Result;
use cudarc::driver::sys;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The release threshold of a backend's pool unless told otherwise
/// ([`CudaBackendBuilder::pool_release_threshold`](super::CudaBackendBuilder::pool_release_threshold)):
/// up to 256 MiB of freed pool memory stays reserved for the next allocations when a stream
/// synchronises, instead of going back to the device. That is what makes an allocation
/// from a warm pool cost microseconds; more than that is given back.
/// [`CudaBackend::trim_pool`](super::CudaBackend::trim_pool) gives it back on demand.
pub const DEFAULT_POOL_RELEASE_THRESHOLD: u64 = 256 << 20;

/// Pool ids, unique in this process: the importer finds an imported pool by (exporter
/// process, id).
fn next_pool_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// This process's exportable memory pool on one device.
///
/// Freed memory stays reserved for the next allocation (up to the release threshold) only
/// while an allocation of the pool is live: when the last one is freed the threshold
/// drops to zero, so the driver gives everything back to the device at the next
/// synchronisation (setting it returns what is already free at once), and the first
/// allocation after raises it again. That gives back the memory of a pool no other process
/// imported; one that was imported keeps its freed memory until it is destroyed *and*
/// every importer dropped its import (driver 580: `bench/probe/pool_release_with_importer.py`),
/// which is why a backend retires such a pool once it has been idle for
/// [`POOL_IDLE_RETIRE`](super::POOL_IDLE_RETIRE) ([`Backend::retire_idle_pools`](crate::Backend::retire_idle_pools),
/// whose ids the node sends the importers) and when a node closes
/// ([`Backend::release_idle`](crate::Backend::release_idle)).
pub(crate) struct ExportPool {
    ctx: SharedContext,
    raw: sys::CUmemoryPool,
    id: u64,
    /// The pool's shareable handle, exported once and sent beside the frames that carry
    /// handles of its allocations.
    fd: OwnedFd,
    /// The release threshold while allocations are live.
    threshold: u64,
    /// Live allocations, and since when there are none; the threshold changes when the
    /// count leaves or reaches zero, under the lock.
    live: Mutex<Use>,
    /// Whether the pool's descriptor was taken to be sent: another process may have
    /// imported the pool, so its freed memory goes back to the device only when it is
    /// destroyed ([`idle_shared_for`](Self::idle_shared_for)).
    shared: AtomicBool,
}

/// How an [`ExportPool`] is used now.
#[derive(Debug, Default)]
struct Use {
    live: usize,
    idle_since: Option<Instant>,
}

// SAFETY: a `CUmemoryPool` is a driver handle usable from any thread with its context
// current (every use here pushes it); the struct has no thread-affine state.
unsafe impl Send for ExportPool {}
// SAFETY: `&ExportPool` allows only driver calls (allocate, trim) that the driver
// serialises internally; nothing is mutated through a shared reference.
unsafe impl Sync for ExportPool {}

impl fmt::Debug for ExportPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportPool").field("id", &self.id).finish()
    }
}

impl ExportPool {
    /// `cuMemPoolCreate` on `dev` (pinned device memory, POSIX-fd handle type), its
    /// release threshold set, and its descriptor exported.
    pub(crate) fn create(
        ctx: &SharedContext,
        dev: sys::CUdevice,
        release_threshold: u64,
    ) -> Result<Arc<Self>> {
        let _pushed = ContextGuard::push(ctx)?;
        // SAFETY: the device's context is current; the pool is owned by `destroy_on_error`
        // at once, then by the `ExportPool` returned, which destroys it once.
        let raw = unsafe { result::mem_pool_create(dev) }?;
        let destroy_on_error = |e| {
            // SAFETY: our pool, not yet shared, destroyed once on this error path.
            if let Err(d) = unsafe { result::mem_pool_destroy(raw) } {
                tracing::warn!(error = %d, "destroying a half-made memory pool failed");
            }
            e
        };
        // SAFETY: `raw` is live (just made).
        unsafe { result::mem_pool_set_release_threshold(raw, release_threshold) }
            .map_err(destroy_on_error)?;
        // SAFETY: `raw` is live and was made with the POSIX-fd handle type.
        let fd = unsafe { result::mem_pool_export_fd(raw) }.map_err(destroy_on_error)?;
        Ok(Arc::new(Self {
            ctx: Arc::clone(ctx),
            raw,
            id: next_pool_id(),
            fd,
            threshold: release_threshold,
            live: Mutex::new(Use {
                live: 0,
                idle_since: Some(Instant::now()),
            }),
            shared: AtomicBool::new(false),
        }))
    }

    /// Whether its descriptor was ever taken to be sent (another process may have imported
    /// it).
    pub(crate) fn shared(&self) -> bool {
        self.shared.load(Ordering::Relaxed)
    }

    /// How long the pool has had no live allocation, if its descriptor was ever taken to
    /// be sent (another process may hold its memory reserved: see the type's docs).
    pub(crate) fn idle_shared_for(&self) -> Option<Duration> {
        if !self.shared() {
            return None;
        }
        let used = self.live.lock().unwrap_or_else(|p| p.into_inner());
        used.idle_since.map(|since| since.elapsed())
    }

    /// Counts an allocation in (`true`) or out; on the way to or from none, sets the
    /// release threshold: the configured one while any is live, zero when none is. The
    /// caller has the pool's context current.
    fn count(&self, allocated: bool) {
        let mut used = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let before = used.live;
        used.live = if allocated {
            before + 1
        } else {
            before.saturating_sub(1)
        };
        let threshold = match (before, used.live) {
            (0, 1) => {
                used.idle_since = None;
                self.threshold
            }
            (1, 0) => {
                used.idle_since = Some(Instant::now());
                0
            }
            _ => return,
        };
        // SAFETY: our live pool; the caller has its context current.
        if let Err(e) = unsafe { result::mem_pool_set_release_threshold(self.raw, threshold) } {
            tracing::warn!(error = %e, threshold, "setting a memory pool's release threshold failed");
        }
    }

    /// The pool's id, unique in this process.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The pool's descriptor, taken to be sent (the pool counts as shared from then on).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.shared.store(true, Ordering::Relaxed);
        self.fd.as_fd()
    }

    /// `cuMemAllocFromPoolAsync` of `size` bytes on `stream`, which the allocation is freed
    /// on too.
    pub(crate) fn allocate(
        self: &Arc<Self>,
        size: usize,
        stream: SharedStream,
    ) -> Result<PoolAlloc> {
        let pushed = ContextGuard::push(stream.context())?;
        self.count(true);
        // SAFETY: the pool and the stream are live, the stream's context is current (the
        // caller checked it is of the pool's device); the allocation is owned by the
        // `PoolAlloc` returned, which frees it once.
        let ptr = unsafe { result::mem_alloc_from_pool_async(size, self.raw, stream.cu_stream()) }
            .inspect_err(|_| self.count(false))?;
        drop(pushed);
        Ok(PoolAlloc {
            pool: Arc::clone(self),
            stream,
            ptr,
            size,
            live: true,
        })
    }

    /// `cuMemPoolTrimTo(keep)`.
    pub(crate) fn trim_to(&self, keep: usize) -> Result<()> {
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: our live pool; its context is current.
        unsafe { result::mem_pool_trim_to(self.raw, keep) }
    }
}

impl Drop for ExportPool {
    fn drop(&mut self) {
        let _pushed = match ContextGuard::push(&self.ctx) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "pushing the context to destroy a memory pool failed");
                return;
            }
        };
        // SAFETY: our pool, destroyed once (here). Every allocation from it holds an `Arc`
        // of us, so none is live; importers' mappings keep their own imported pool.
        match unsafe { result::mem_pool_destroy(self.raw) } {
            Ok(()) => tracing::debug!(pool = self.id, "export memory pool destroyed"),
            Err(e) => tracing::warn!(error = %e, "destroying a memory pool failed"),
        }
    }
}

/// One allocation from an [`ExportPool`].
pub(crate) struct PoolAlloc {
    pool: Arc<ExportPool>,
    /// The stream it was allocated on, and is freed on.
    stream: SharedStream,
    ptr: sys::CUdeviceptr,
    size: usize,
    live: bool,
}

impl PoolAlloc {
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn pool(&self) -> &Arc<ExportPool> {
        &self.pool
    }

    /// `cuMemPoolExportPointer`: the 64 bytes an importer of the pool maps it with.
    pub(crate) fn export_data(&self) -> Result<[u8; 64]> {
        let _pushed = ContextGuard::push(&self.pool.ctx)?;
        // SAFETY: `ptr` is the start of our live allocation from an exportable pool.
        unsafe { result::mem_pool_export_pointer(self.ptr) }
    }

    /// `cuMemFreeAsync` on the allocation's stream (once; later calls do nothing): the
    /// memory goes back to the pool when the stream reaches this point.
    pub(crate) fn free(&mut self) -> Result<()> {
        if !self.live {
            return Ok(());
        }
        self.live = false;
        let stream = Arc::clone(&self.stream);
        let _pushed = ContextGuard::push(stream.context())?;
        // SAFETY: our live allocation (checked above), freed once, on its own live stream in
        // its current context; the owner guarantees no work ordered after this uses it.
        let freed = unsafe { result::mem_free_async(self.ptr, stream.cu_stream()) };
        self.pool.count(false);
        freed
    }
}

impl Drop for PoolAlloc {
    fn drop(&mut self) {
        if let Err(e) = self.free() {
            tracing::warn!(error = %e, size = self.size, "freeing CUDA pool memory failed");
        }
    }
}

/// Another process's memory pool, imported into this one.
pub(crate) struct ImportedPool {
    ctx: SharedContext,
    raw: sys::CUmemoryPool,
}

// SAFETY: as for `ExportPool`: a driver handle, used only with its context current.
unsafe impl Send for ImportedPool {}
// SAFETY: `&ImportedPool` allows only `cuMemPoolImportPointer`, which the driver
// serialises internally.
unsafe impl Sync for ImportedPool {}

impl fmt::Debug for ImportedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ImportedPool")
    }
}

impl ImportedPool {
    /// `cuMemPoolImportFromShareableHandle(fd)`, then `cuMemPoolSetAccess` (read-write) for
    /// `dev`. The caller may close `fd` afterwards.
    pub(crate) fn import(
        ctx: &SharedContext,
        dev: sys::CUdevice,
        fd: BorrowedFd<'_>,
    ) -> Result<Self> {
        let _pushed = ContextGuard::push(ctx)?;
        // SAFETY: the context is current; the imported pool is owned by `pool` at once,
        // whose `Drop` destroys it once (also if granting access fails below).
        let raw = unsafe { result::mem_pool_import_fd(fd) }?;
        let pool = Self {
            ctx: Arc::clone(ctx),
            raw,
        };
        // SAFETY: `raw` is our live imported pool.
        unsafe { result::mem_pool_set_access(pool.raw, dev) }?;
        Ok(pool)
    }
}

impl Drop for ImportedPool {
    fn drop(&mut self) {
        let _pushed = match ContextGuard::push(&self.ctx) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "pushing the context to release an imported pool failed");
                return;
            }
        };
        // SAFETY: our imported pool, destroyed once (here); every mapping from it holds an
        // `Arc` of us, so none is live.
        match unsafe { result::mem_pool_destroy(self.raw) } {
            Ok(()) => tracing::debug!("imported memory pool released"),
            Err(e) => tracing::warn!(error = %e, "releasing an imported memory pool failed"),
        }
    }
}

/// One allocation of another process's pool, mapped in this one.
pub(crate) struct PoolMapping {
    pool: Arc<ImportedPool>,
    /// The importer's stream: the mapping is freed there.
    stream: SharedStream,
    ptr: sys::CUdeviceptr,
    live: bool,
}

impl PoolMapping {
    /// `cuMemPoolImportPointer(pool, data)`.
    pub(crate) fn import(
        pool: Arc<ImportedPool>,
        data: &[u8; 64],
        stream: SharedStream,
    ) -> Result<Self> {
        let pushed = ContextGuard::push(&pool.ctx)?;
        // SAFETY: the pool is live (we hold it) in its current context; the export data
        // comes from a sealed, checked handle (the caller's `CheckedHandle`); the mapping is
        // owned by the `PoolMapping` returned, which frees it once.
        let ptr = unsafe { result::mem_pool_import_pointer(pool.raw, data) }?;
        drop(pushed);
        Ok(Self {
            pool,
            stream,
            ptr,
            live: true,
        })
    }

    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Bytes of the allocation behind the mapping, as the driver reports them
    /// (`cuMemGetAddressRange_v2`).
    pub(crate) fn mapped_size(&self) -> Result<usize> {
        let _pushed = ContextGuard::push(&self.pool.ctx)?;
        // SAFETY: a query about our live mapping, its context current.
        let (_base, size) = unsafe { result::mem_get_address_range(self.ptr) }?;
        Ok(size)
    }

    /// `cuMemFreeAsync` on the importer's stream, then `cuStreamSynchronize`: the free has
    /// completed when this returns, as the driver requires before the exporter's free.
    /// Once; later calls do nothing.
    pub(crate) fn close(&mut self) -> Result<()> {
        if !self.live {
            return Ok(());
        }
        self.live = false;
        let stream = Arc::clone(&self.stream);
        let _pushed = ContextGuard::push(stream.context())?;
        // SAFETY: our live mapping (checked above), freed once, on the importer's live
        // stream in its current context; the owner guarantees no one uses it afterwards.
        unsafe { result::mem_free_async(self.ptr, stream.cu_stream()) }?;
        // SAFETY: the stream is live in the current context.
        unsafe { result::stream_synchronize(stream.cu_stream()) }
    }
}

impl Drop for PoolMapping {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!(error = %e, "freeing an imported pool allocation failed");
        }
    }
}
