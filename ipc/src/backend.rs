//! The memory trait, [`Backend`] (make, share and map memory), and the two guards every
//! backend hands out: [`Allocation`] (exporter side, owns the free) and [`OpenedMem`]
//! (importer side, owns the close).
//!
//! Ordering GPU work across processes is not here: it is
//! [`StreamOrdering`](crate::ordering::StreamOrdering), which a backend with queued work
//! implements beside this trait and hands out from [`Backend::ordering`]; a backend
//! without it (host) implements this trait alone, and its `ordering()` is
//! [`NoOrdering`](crate::ordering::NoOrdering), which does what a backend without fences
//! must (nothing, or "ready"). This module names no backend: implementations live in the
//! `host` and `cuda` modules, and a `dyn Backend` is downcast to one through [`AsAny`].
//!
//! # Safety
//!
//! One `unsafe` block, in [`Allocation::write_in_place`]: it calls the backend's
//! `RawMemory::host_bytes_mut`, whose contract (nothing else in this process reaches the
//! bytes while the `&mut [u8]` lives) the allocation keeps with a state word of its own:
//! its copies (`read`, `write`, `fill`, `to_vec`) count themselves in while they run, an
//! [`InPlace`] is made only when none runs and no other `InPlace` lives, and while it lives
//! every copy is refused with [`Error::InPlace`]. The
//! allocation's memory is reached otherwise only through [`Allocation::raw`], the
//! backend's escape hatch, whose `host_bytes` is handed out under the protocol of
//! `RawMemory::host_bytes` (Baton's typed buffers never do while an `InPlace` lives).

use crate::ordering::{NoOrdering, StreamOrdering};
use crate::session::{CheckedHandle, Session};
use crate::{Error, Result};
use baton_messages::{
    ActorId, AllocationId, BackendKind, DeviceUuid, ExporterId, FenceHandle, Generation,
    HandleDigest, HandleMsg, IpcEventHandle, Layout, PROTOCOL_VERSION, ProcessId, RawHandle,
    SealPrefix,
};
use std::any::Any;
use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Where a buffer's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemPtr {
    /// Host memory, mapped in this process at this address.
    Host(*mut u8),
    /// Device memory at this device address (`CUdeviceptr`), valid in this process.
    Device(u64),
}

impl MemPtr {
    /// The address `offset` bytes further on.
    pub fn offset_by(self, offset: usize) -> MemPtr {
        match self {
            MemPtr::Host(p) => MemPtr::Host(p.wrapping_add(offset)),
            MemPtr::Device(p) => MemPtr::Device(p + offset as u64),
        }
    }
}

/// Memory a backend made or mapped. Implemented by each backend; used through
/// [`Allocation`] and [`OpenedMem`], which check bounds before calling in.
pub trait RawMemory: Send + Sync + fmt::Debug {
    /// Bytes mapped.
    fn size(&self) -> usize;
    /// Where they are.
    fn ptr(&self) -> MemPtr;
    /// Copies `dst.len()` bytes from `offset` into host memory. `offset + dst.len() <= size()`.
    ///
    /// # Errors
    /// A backend error (e.g. a failed device copy).
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` to `offset`. `offset + src.len() <= size()`.
    ///
    /// # Errors
    /// A backend error.
    fn write(&self, offset: usize, src: &[u8]) -> Result<()>;
    /// Sets `len` bytes from `offset` to `byte`. `offset + len <= size()`.
    ///
    /// # Errors
    /// A backend error.
    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()>;
    /// The memory as bytes this process can read in place, if the CPU can address it
    /// (host memory; `None` for device memory, the default).
    ///
    /// The bytes are shared with other processes: another process (or this one, through
    /// [`write`](Self::write) or a raw pointer) may change them while the slice is
    /// borrowed. Callers hand such a view out only under a protocol that rules writers out
    /// for as long as it lives — Baton's typed leases: an exporter's safe writes are
    /// refused while a lease is out, and a read-only lease cannot write.
    fn host_bytes(&self) -> Option<&[u8]> {
        None
    }
    /// The memory as bytes this process can write in place, if the CPU can address it
    /// (host memory; `None` for device memory, the default). The bytes are shared with
    /// other processes, as for [`host_bytes`](Self::host_bytes).
    ///
    /// # Safety
    /// For as long as the slice lives, nothing else in this process may reach these bytes:
    /// no other slice of them ([`host_bytes`](Self::host_bytes) or this method, on this
    /// memory or on another view of the same mapping), and no copy ([`read`](Self::read),
    /// [`write`](Self::write), [`fill`](Self::fill)) or raw pointer access to them.
    /// [`Imported::host_bytes_mut`](crate::Imported::host_bytes_mut) is the safe way in.
    #[allow(unsafe_code)] // declares the contract only; implementations live in backend modules
    #[allow(clippy::mut_from_ref)] // exclusivity is the caller's contract (`# Safety`)
    unsafe fn host_bytes_mut(&self) -> Option<&mut [u8]> {
        None
    }
    /// Releases the memory (free, unmap, close), reporting failure. `Drop` does the same
    /// and logs failures instead.
    ///
    /// # Errors
    /// A backend error.
    fn close(self: Box<Self>) -> Result<()> {
        drop(self);
        Ok(())
    }
}

/// What an exporter's free does to another process that still maps the memory. The lease
/// ledger needs it: a holder whose link was cut may still map the memory, and only where
/// its mapping survives the free may the exporter free at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FreeWhileMapped {
    /// The importer's mapping stays valid after the exporter's free, and nobody else can
    /// be handed that memory while it lives: host memory (the kernel frees the pages with
    /// the last mapping) and CUDA VMM (the driver refcounts the physical allocation).
    Survives,
    /// Freeing while another process maps the memory is undefined behaviour, and the
    /// exporter's next allocation may reuse the pages (CUDA legacy IPC: `cuMemFree` before
    /// the importer's `cuIpcCloseMemHandle`). Such memory stays allocated — quarantined —
    /// while a live process may map it.
    Unsafe,
}

/// What the descriptor of [`ExportableMemory::export_fd`] names, and so how often it must
/// cross a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DescriptorScope {
    /// This allocation alone (CUDA VMM, host `memfd`): once per (link, allocation) — an
    /// importer keeps it with its mapping.
    Allocation,
    /// A pool many allocations come from (CUDA stream-ordered pools), named by the
    /// exporting process's id of the pool: once per (link, pool) — the importer imports
    /// the pool once and finds it again by that id.
    Pool(u64),
}

/// Exporter-side memory: [`RawMemory`] that can be shared.
pub trait ExportableMemory: RawMemory {
    /// What freeing this memory does to importers that still map it.
    fn free_while_mapped(&self) -> FreeWhileMapped;
    /// The raw handle importers open. `fd_slot` is the index the descriptor from
    /// [`export_fd`](Self::export_fd) will have among the frame's descriptors, or `None`
    /// when the descriptor is not sent because the importer already maps the memory.
    ///
    /// # Errors
    /// A backend error (e.g. `cuIpcGetMemHandle` failing).
    fn raw_handle(&self, fd_slot: Option<u8>) -> Result<RawHandle>;
    /// The descriptor to send beside the frame, for backends that share by descriptor.
    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// What [`export_fd`](Self::export_fd) names.
    fn descriptor_scope(&self) -> DescriptorScope {
        DescriptorScope::Allocation
    }
}

fn check_range(offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::OutOfBounds { offset, len, size }),
    }
}

/// The process-wide source of allocation ids: never reused, so a handle to a freed
/// allocation can always be told from one to a new allocation. Also names what is not an
/// allocation of ours but is offered as one (a copy, to another host, of a buffer this
/// process leased).
pub fn next_allocation_id() -> AllocationId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    AllocationId::new(NEXT.fetch_add(1, Ordering::Relaxed))
}

macro_rules! memory_accessors {
    () => {
        /// Bytes in the buffer.
        pub fn size(&self) -> usize {
            self.mem.size()
        }

        /// Where the bytes are.
        pub fn ptr(&self) -> MemPtr {
            self.mem.ptr()
        }

        /// Copies `dst.len()` bytes starting at `offset` into `dst`.
        ///
        /// # Errors
        /// [`Error::OutOfBounds`], or a backend error.
        pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
            let _copying = self.check_copy()?;
            check_range(offset, dst.len(), self.mem.size())?;
            self.mem.read(offset, dst)
        }

        /// Copies `src` into the buffer at `offset`.
        ///
        /// # Errors
        /// [`Error::OutOfBounds`], or a backend error.
        pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
            let _copying = self.check_copy()?;
            check_range(offset, src.len(), self.mem.size())?;
            self.mem.write(offset, src)
        }

        /// Sets `len` bytes starting at `offset` to `byte`.
        ///
        /// # Errors
        /// [`Error::OutOfBounds`], or a backend error.
        pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
            let _copying = self.check_copy()?;
            check_range(offset, len, self.mem.size())?;
            self.mem.fill(offset, len, byte)
        }

        /// The whole buffer copied into a new vector.
        ///
        /// # Errors
        /// A backend error.
        pub fn to_vec(&self) -> Result<Vec<u8>> {
            let _copying = self.check_copy()?;
            let mut v = vec![0; self.mem.size()];
            self.mem.read(0, &mut v)?;
            Ok(v)
        }
    };
}

/// Exportable memory owned by this process. Dropping it frees the memory (for the host
/// backend: unlinks the segment; importers that still map it keep their mapping).
///
/// Freeing while importers hold leases is the lease protocol's business (`BufferOwner`
/// defers the free); at this level the guard simply owns the memory.
pub struct Allocation {
    id: AllocationId,
    generation: Generation,
    backend: BackendKind,
    device: DeviceUuid,
    free_while_mapped: FreeWhileMapped,
    /// [`IN_PLACE`] while an [`InPlace`] of it lives (see
    /// [`Allocation::write_in_place`]); below it, how many of its copies are running.
    access: AtomicUsize,
    mem: Box<dyn ExportableMemory>,
    /// The seal of the last handle of it up to its fence: the next handle of the same
    /// buffer is sealed by hashing its fence alone (see [`HandleBuilder::build`]).
    sealed: std::sync::Mutex<Option<Box<SealPrefix>>>,
}

impl Allocation {
    /// Wraps backend memory, giving it a fresh allocation id. For backend implementors.
    pub fn new(backend: BackendKind, device: DeviceUuid, mem: Box<dyn ExportableMemory>) -> Self {
        Self::with_id(next_allocation_id(), backend, device, mem)
    }

    /// Reserves an allocation id before the memory exists (for backends whose raw handle
    /// embeds the id, such as host segment names).
    pub fn with_id(
        id: AllocationId,
        backend: BackendKind,
        device: DeviceUuid,
        mem: Box<dyn ExportableMemory>,
    ) -> Self {
        Self {
            id,
            generation: Generation::FIRST,
            backend,
            device,
            free_while_mapped: mem.free_while_mapped(),
            access: AtomicUsize::new(0),
            mem,
            sealed: std::sync::Mutex::new(None),
        }
    }

    /// Declares another free rule than the memory's own: for backends that wrap another
    /// one to model a third (a test backend giving host memory CUDA legacy's rule, so that
    /// the ledger's quarantine can be exercised without a GPU). Declaring
    /// [`FreeWhileMapped::Unsafe`] is always safe; declaring `Survives` for memory that
    /// does not survive breaks the ledger's promise.
    pub fn declare_free_while_mapped(mut self, rule: FreeWhileMapped) -> Self {
        self.free_while_mapped = rule;
        self
    }

    /// What freeing it does to importers that still map it.
    pub fn free_while_mapped(&self) -> FreeWhileMapped {
        self.free_while_mapped
    }

    /// A fresh allocation id for [`with_id`](Self::with_id).
    pub fn reserve_id() -> AllocationId {
        next_allocation_id()
    }

    /// Its id: unique in this process, never reused.
    pub fn id(&self) -> AllocationId {
        self.id
    }

    /// Its generation.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Marks the memory as holding a new buffer (the exporter reuses the allocation, e.g.
    /// from a pool of recycled buffers): handles built from now on carry the next
    /// generation, and an importer that has seen one refuses handles of older generations
    /// ([`Error::StaleHandle`]). Returns the new generation.
    pub fn renew(&mut self) -> Generation {
        self.generation = self.generation.next();
        self.generation
    }

    /// The backend that made it.
    pub fn backend(&self) -> BackendKind {
        self.backend
    }

    /// The device it lives on.
    pub fn device(&self) -> DeviceUuid {
        self.device
    }

    memory_accessors!();

    /// Counts a copy in for as long as the guard lives; refused while an [`InPlace`]
    /// lives (so no copy ever overlaps the `&mut [u8]`).
    pub(crate) fn check_copy(&self) -> Result<CopyGuard<'_>> {
        let mut now = self.access.load(Ordering::Acquire);
        loop {
            if now & IN_PLACE != 0 {
                return Err(Error::InPlace { alloc: self.id });
            }
            match self.access.compare_exchange_weak(
                now,
                now + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(CopyGuard(Some(&self.access))),
                Err(seen) => now = seen,
            }
        }
    }

    /// Whether an [`InPlace`] of it lives now.
    pub fn is_in_place(&self) -> bool {
        self.access.load(Ordering::Acquire) & IN_PLACE != 0
    }

    /// The memory as a `&mut [u8]` this process writes in place, without a copy: host
    /// memory only (`Ok(None)` for device memory). One at a time: while the [`InPlace`]
    /// lives, a second one and the allocation's copies ([`read`](Self::read),
    /// [`write`](Self::write), [`fill`](Self::fill), [`to_vec`](Self::to_vec)) are
    /// refused with [`Error::InPlace`].
    ///
    /// Other *processes* that map the memory are not stopped by it: the caller rules them
    /// out (Baton's typed buffers hand it out only while no lease is out and none can be
    /// granted: `Buffer::as_mut_slice` in `baton-actors`).
    ///
    /// # Errors
    /// [`Error::InPlace`] while another `InPlace` of it lives, or one of its copies is
    /// running on another thread.
    pub fn write_in_place(&self) -> Result<Option<InPlace<'_>>> {
        if self.mem.host_bytes().is_none() {
            return Ok(None);
        }
        // Only from "no copy running, no `InPlace`".
        if self
            .access
            .compare_exchange(0, IN_PLACE, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(Error::InPlace { alloc: self.id });
        }
        // Cleared when the guard drops, also if the slice is missing.
        let flag = InPlaceFlag(&self.access);
        #[allow(unsafe_code)]
        // SAFETY: the state was "no copy running, no `InPlace`" and is now ours
        // (compare-exchange), so no other `InPlace` of this allocation exists and no copy
        // runs; while it is set, the allocation's copies are refused (`check_copy`), and nothing else in this crate reaches the bytes of an
        // `Allocation` but `raw()` (see the module's `# Safety`). The slice borrows `self`,
        // so the mapping (owned by `mem`) outlives it; the flag is cleared only when the
        // guard holding the slice drops.
        let bytes = unsafe { self.mem.host_bytes_mut() };
        Ok(bytes.map(|bytes| InPlace { bytes, _flag: flag }))
    }

    /// The backend memory, for backend-specific operations (kernels, streams).
    pub fn raw(&self) -> &dyn ExportableMemory {
        &*self.mem
    }

    /// The descriptor to send beside the frame that carries this allocation's handle
    /// (VMM backends), if any.
    pub fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        self.mem.export_fd()
    }

    /// What [`export_fd`](Self::export_fd) names: this allocation, or a pool shared by
    /// many (whose descriptor crosses a link once).
    pub fn descriptor_scope(&self) -> DescriptorScope {
        self.mem.descriptor_scope()
    }

    /// Starts a sealed handle message for this allocation (the whole of it, unless
    /// [`HandleBuilder::range`] says otherwise).
    pub fn handle<'a>(&'a self, session: &'a Session) -> HandleBuilder<'a> {
        HandleBuilder {
            alloc: self,
            session,
            actor: ActorId::new(0),
            offset: 0,
            len: self.size() as u64,
            layout: None,
            fd_slot: Some(0),
            fence: None,
        }
    }

    /// Frees the memory now, reporting failure.
    ///
    /// # Errors
    /// A backend error.
    pub fn free(self) -> Result<()> {
        self.mem.close()
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("alloc", &self.id)
            .field("gen", &self.generation)
            .field("backend", &self.backend)
            .field("size", &self.mem.size())
            .finish()
    }
}

/// The bit of `Allocation::access` an [`InPlace`] holds; no copy is counted while it is set.
const IN_PLACE: usize = 1 << (usize::BITS - 1);

/// Clears an allocation's in-place bit when it drops.
struct InPlaceFlag<'a>(&'a AtomicUsize);

impl Drop for InPlaceFlag<'_> {
    fn drop(&mut self) {
        // No copy could count itself in meanwhile: the state is exactly `IN_PLACE`.
        self.0.store(0, Ordering::Release);
    }
}

/// A copy of an allocation counted in (`None`: an importer's, not counted).
pub(crate) struct CopyGuard<'a>(Option<&'a AtomicUsize>);

impl Drop for CopyGuard<'_> {
    fn drop(&mut self) {
        if let Some(access) = self.0 {
            access.fetch_sub(1, Ordering::Release);
        }
    }
}

/// A host allocation's bytes, writable in place ([`Allocation::write_in_place`]); the
/// allocation's copies are refused until it drops.
pub struct InPlace<'a> {
    bytes: &'a mut [u8],
    _flag: InPlaceFlag<'a>,
}

impl fmt::Debug for InPlace<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InPlace")
            .field("len", &self.bytes.len())
            .finish()
    }
}

impl std::ops::Deref for InPlace<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl std::ops::DerefMut for InPlace<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

/// Builds a sealed [`HandleMsg`] for (part of) an [`Allocation`].
#[derive(Debug)]
#[must_use]
pub struct HandleBuilder<'a> {
    alloc: &'a Allocation,
    session: &'a Session,
    actor: ActorId,
    offset: u64,
    len: u64,
    layout: Option<Layout>,
    fd_slot: Option<u8>,
    fence: Option<FenceHandle>,
}

impl HandleBuilder<'_> {
    /// The owning actor (default 0).
    pub fn actor(mut self, actor: ActorId) -> Self {
        self.actor = actor;
        self
    }

    /// Shares only `len` bytes from `offset` (a buffer carved from a slab).
    pub fn range(mut self, offset: u64, len: u64) -> Self {
        self.offset = offset;
        self.len = len;
        self
    }

    /// Element type and shape of the shared bytes.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = Some(layout);
        self
    }

    /// Index of this allocation's descriptor among the frame's descriptors (descriptor-shared
    /// backends; slot 0 unless set), or `None` when the descriptor is not sent because the
    /// importer maps the allocation already.
    pub fn fd_slot(mut self, slot: Option<u8>) -> Self {
        self.fd_slot = slot;
        self
    }

    /// An interprocess event importers wait on before use (CUDA): the acquire fence.
    pub fn event(mut self, event: IpcEventHandle) -> Self {
        self.fence = Some(FenceHandle::Event(event));
        self
    }

    /// The acquire fence importers wait on before use (device backends).
    pub fn fence(mut self, fence: FenceHandle) -> Self {
        self.fence = Some(fence);
        self
    }

    /// The sealed handle.
    ///
    /// # Errors
    /// A backend error making the raw handle, or a handle that does not validate (range
    /// outside the allocation, layout that does not cover it).
    pub fn build(self) -> Result<HandleMsg> {
        let a = self.alloc;
        let handle = HandleMsg {
            version: PROTOCOL_VERSION,
            exporter: ExporterId {
                process: self.session.process(),
                actor: self.actor,
            },
            alloc: a.id,
            generation: a.generation,
            backend: a.backend,
            device: a.device,
            alloc_size: a.size() as u64,
            offset: self.offset,
            len: self.len,
            layout: self.layout,
            raw: a.mem.raw_handle(self.fd_slot)?,
            fence: self.fence,
            digest: HandleDigest::default(),
        };
        handle.validate()?;
        // A buffer shared again is the same handle but for its fence: sealed from the last
        // one's seal up to the fence (the seal was an eighth of a cached handoff's work on
        // the exporter). The same digest as `seal`'s, whatever the fence.
        let key = self.session.handle_key();
        let mut handle = handle;
        let mut sealed = a.sealed.lock().unwrap_or_else(|p| p.into_inner());
        if sealed.as_mut().is_some_and(|p| p.seal(&mut handle, key)) {
            return Ok(handle);
        }
        let mut prefix = SealPrefix::new(&handle, key);
        let own = prefix.seal(&mut handle, key);
        debug_assert!(own, "a seal prefix seals the handle it was made from");
        *sealed = Some(Box::new(prefix));
        Ok(handle)
    }
}

/// Memory another process exported, mapped into this one. Dropping it unmaps (closes)
/// the mapping; [`close`](Self::close) does the same and reports failure.
///
/// Usually reached through the [`ImportCache`](crate::ImportCache), which opens each
/// allocation once per process and shares the mapping.
pub struct OpenedMem {
    exporter: ExporterId,
    alloc: AllocationId,
    generation: Generation,
    backend: BackendKind,
    mem: Box<dyn RawMemory>,
}

impl OpenedMem {
    /// Wraps a backend mapping of `handle`'s allocation. For backend implementors.
    pub fn new(handle: &HandleMsg, mem: Box<dyn RawMemory>) -> Self {
        Self {
            exporter: handle.exporter,
            alloc: handle.alloc,
            generation: handle.generation,
            backend: handle.backend,
            mem,
        }
    }

    /// Who exported it.
    pub fn exporter(&self) -> ExporterId {
        self.exporter
    }

    /// The exported allocation.
    pub fn alloc(&self) -> AllocationId {
        self.alloc
    }

    /// Its generation.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// The backend that mapped it.
    pub fn backend(&self) -> BackendKind {
        self.backend
    }

    memory_accessors!();

    /// An importer's copies are never refused here (its writers are ruled out by the
    /// lease protocol and the import cache).
    pub(crate) fn check_copy(&self) -> Result<CopyGuard<'_>> {
        Ok(CopyGuard(None))
    }

    /// The backend mapping, for backend-specific operations.
    pub fn raw(&self) -> &dyn RawMemory {
        &*self.mem
    }

    /// Unmaps now, reporting failure.
    ///
    /// # Errors
    /// A backend error.
    pub fn close(self) -> Result<()> {
        self.mem.close()
    }
}

impl fmt::Debug for OpenedMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenedMem")
            .field("exporter", &self.exporter)
            .field("alloc", &self.alloc)
            .field("gen", &self.generation)
            .field("backend", &self.backend)
            .field("size", &self.mem.size())
            .finish()
    }
}

/// A way to make, share and map memory: the memory trait every backend implements. Object
/// safe: pick one at run time with [`crate::select::auto`].
///
/// Ordering GPU work across processes is another concept, [`StreamOrdering`], which only
/// backends with queued work implement (CUDA); [`ordering`](Self::ordering) reaches it from
/// a `dyn Backend`, and for memory written synchronously (host) it is [`NoOrdering`], whose
/// every operation does nothing. Callers write `backend.ordering().order_after(…)` whatever
/// the backend. A concrete backend is reached by downcasting through [`AsAny`] (the CUDA
/// backend's `<dyn Backend>::cuda()` is defined in the CUDA module), so that this trait
/// names no implementation of its own.
pub trait Backend: AsAny + Send + Sync + fmt::Debug {
    /// A short name for logs ("host", "cuda").
    fn name(&self) -> &'static str;
    /// The kind of handle [`allocate`](Self::allocate)d memory exports.
    fn kind(&self) -> BackendKind;
    /// The device this backend allocates on.
    fn device(&self) -> DeviceUuid;
    /// Whether [`open`](Self::open) takes handles of `kind`.
    fn can_open(&self, kind: BackendKind) -> bool {
        kind == self.kind()
    }
    /// Allocates `size` bytes of exportable memory, zeroed where the backend can.
    ///
    /// # Errors
    /// [`Error::ZeroSize`], or a backend error (out of memory, …).
    fn allocate(&self, size: usize) -> Result<Allocation>;
    /// Maps the allocation a checked handle names; `fd` is the descriptor from the
    /// handle's slot for descriptor-based handles. Each call is one driver-level open
    /// (the [`ImportCache`](crate::ImportCache) avoids repeats).
    ///
    /// # Errors
    /// A backend error: the memory is gone, is smaller than claimed, the device is absent.
    fn open(&self, handle: CheckedHandle<'_>, fd: Option<OwnedFd>) -> Result<OpenedMem>;
    /// How this backend orders work queued on streams across processes (fences); for
    /// backends whose memory is written synchronously (host), [`NoOrdering`], the default.
    fn ordering(&self) -> &dyn StreamOrdering {
        &NoOrdering
    }
    /// Whether this backend's allocations, opens, closes and frees are driver calls that may
    /// block for a while (CUDA): the actor layer then runs them on a driver thread, never
    /// on an actor's thread. Host memory (`mmap`, `memfd_create`) runs inline.
    fn blocking_calls(&self) -> bool {
        false
    }
    /// Drops what the backend keeps about a dead exporter process (CUDA: imported pools,
    /// and its ordering's opened events). Called by
    /// [`ImportCache::forget_process`](crate::ImportCache::forget_process).
    fn forget_process(&self, process: &ProcessId) {
        let _ = process;
    }
    /// Gives the device back what the backend keeps for reuse that no allocation or
    /// mapping uses any more — called by a node when it goes (its last handle dropped, or
    /// Python's `Node.close`), and by anyone done with a backend they keep. CUDA: its export pool is retired (destroyed once its last
    /// allocation is freed: memory of a pool another process imported goes back to the
    /// device only then, whatever the release threshold or a trim say) and its imported
    /// pools dropped (each mapping keeps its own); a later allocation makes a fresh pool.
    fn release_idle(&self) {}
    /// Exporter: retires the memory pools another process may have imported that have had
    /// no allocation for a while, and returns their ids, for the node to tell the
    /// processes it sent their descriptors ([`forget_pool`](Self::forget_pool) there). Called
    /// by a node on each link's heartbeat, on its driver thread when
    /// [`blocking_calls`](Self::blocking_calls). CUDA: an export pool whose descriptor was
    /// sent, idle for [`POOL_IDLE_RETIRE`](crate::cuda::POOL_IDLE_RETIRE), is retired — its
    /// freed memory goes back to the device once every importer dropped its import; a later
    /// allocation makes a fresh pool. The ids of shared pools retired since the last call
    /// for another reason (a peer's death, [`release_idle`](Self::release_idle)) come too.
    fn retire_idle_pools(&self) -> Vec<u64> {
        Vec::new()
    }
    /// Importer: `exporter` retired its memory pool `pool` (it has no allocation left):
    /// drop our import of it, so that the device gets its memory back (mappings keep their
    /// own; none should be left). A pool never imported changes nothing.
    fn forget_pool(&self, exporter: &ProcessId, pool: u64) {
        let _ = (exporter, pool);
    }
}

/// How a `dyn Backend` is downcast to the type behind it (`<dyn Backend>::cuda()`):
/// implemented for every `'static` type, so a backend never implements it itself.
pub trait AsAny {
    /// The value as [`Any`].
    fn as_any(&self) -> &dyn Any;
}

impl<T: Any> AsAny for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A shared backend.
pub type SharedBackend = Arc<dyn Backend>;
