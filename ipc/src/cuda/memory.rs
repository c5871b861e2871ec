//! The CUDA backend's memory objects: an exported allocation ([`Exported`], shared by the
//! exporter's [`Allocation`](crate::Allocation) and any mapping this same process opened of
//! it) with what backs it, an imported mapping ([`Mapped`]) with what backs it, the
//! [`RawMemory`] / [`ExportableMemory`] views the generic guards call into, and the
//! process-wide registry of live and borrowed allocations, through which a handle opened in
//! the process that exported it finds the exporter's own memory.
//!
//! Every access to device bytes is a copy or memset on the backend's stream, with its
//! context pushed, synchronised before it returns ([`Access`]).

use super::context::ContextGuard;
use super::legacy::{DeviceAlloc, IpcMapping};
use super::live::LiveToken;
use super::pool::{PoolAlloc, PoolMapping};
use super::vmm::VmmRegion;
use super::{SharedContext, SharedStream, lock, result};
use crate::Result;
use crate::backend::{DescriptorScope, ExportableMemory, FreeWhileMapped, MemPtr, RawMemory};
use baton_messages::{AllocationId, BackendKind, CudaIpcMemHandle, CudaPoolExportData, RawHandle};
use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A context and a stream: what every access to device bytes pushes and orders on.
#[derive(Clone)]
pub(super) struct Access {
    pub(super) ctx: SharedContext,
    pub(super) stream: SharedStream,
}

impl Access {
    /// Blocks until all work on the stream has completed (pushing the context).
    pub(super) fn synchronize(&self) -> Result<()> {
        let _pushed = ContextGuard::push(&self.ctx)?;
        self.sync()
    }

    /// Synchronises the stream; the caller pushed the context.
    pub(super) fn sync(&self) -> Result<()> {
        // SAFETY: the stream is live (we hold it) and its context was pushed by the caller.
        unsafe { result::stream_synchronize(self.stream.cu_stream()) }
    }

    /// Copies `dst.len()` bytes from device address `src` (the caller checked the range
    /// lies in memory that outlives the call).
    pub(super) fn read(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the stream is live in the current context; `src..src + len` is mapped
        // (caller); `dst` is not touched until the synchronise below returns.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }?;
        self.sync()
    }

    pub(super) fn write(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: as in `read`, directions swapped; `src` outlives the synchronise below.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }?;
        self.sync()
    }

    pub(super) fn fill(&self, dst: u64, len: usize, byte: u8) -> Result<()> {
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
pub(super) enum ExportBacking {
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
pub(super) struct Exported {
    pub(super) id: AllocationId,
    pub(super) kind: BackendKind,
    pub(super) access: Access,
    pub(super) ptr: u64,
    pub(super) size: usize,
    pub(super) backing: ExportBacking,
    /// After `backing`: counted until the memory is released.
    pub(super) _live: LiveToken,
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
pub(super) fn live_allocations() -> &'static Mutex<HashMap<AllocationId, Weak<Exported>>> {
    static LIVE: OnceLock<Mutex<HashMap<AllocationId, Weak<Exported>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// The bases of the allocations this process borrowed ([`CudaBackend::borrow`]) and not yet
/// released: legacy IPC lets an importer open an allocation once, so one allocation is
/// borrowed once at a time.
pub(super) fn borrowed_bases() -> &'static Mutex<HashMap<u64, AllocationId>> {
    static BORROWED: OnceLock<Mutex<HashMap<u64, AllocationId>>> = OnceLock::new();
    BORROWED.get_or_init(Default::default)
}

/// The exporter's view: [`RawMemory`] + [`ExportableMemory`] over a shared [`Exported`].
pub(super) struct ExportedMem(pub(super) Arc<Exported>);

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
pub(super) enum MapBacking {
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
pub(super) struct Mapped {
    pub(super) access: Access,
    pub(super) ptr: u64,
    pub(super) size: usize,
    pub(super) backing: MapBacking,
    /// After `backing`: counted until the mapping is released (driver-level imports only).
    pub(super) _live: Option<LiveToken>,
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
