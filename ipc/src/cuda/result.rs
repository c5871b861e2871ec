//! Thin `Result` wrappers over the raw driver calls of `cudarc::driver::sys`, one per call,
//! each named after it. No ownership here: the RAII types in the sibling modules own what
//! these functions make.
//!
//! # Safety
//!
//! Every function here is `unsafe` where the driver call reads or writes memory the caller
//! names or acts on a handle the caller must keep valid; its `# Safety` section says what
//! the caller promises. All of them require that the driver library was found
//! ([`super::probe`] succeeded): with `dynamic-loading`, cudarc panics on the first call
//! otherwise. Calls that need a current context say so; the callers bind one first
//! (`CudaContext::bind_to_thread`).
//!
//! The raw calls return cudarc's `CUresult`, a Rust enum generated from the headers of the
//! binding version we build against (CUDA 11.4). A newer driver may return a code that
//! enum lacks; we convert every result to its integer at once and keep it as a
//! [`CudaError`] number, never turning a number back into the enum.

use crate::{Error, Result};
use cudarc::driver::sys;
use std::ffi::{c_int, c_void};
use std::fmt;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// A CUDA driver result code, kept as the raw integer (`CUresult`), so codes newer than
/// our bindings survive intact.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CudaError(pub i32);

impl CudaError {
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: CudaError = CudaError(1);
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: CudaError = CudaError(2);
    /// `CUDA_ERROR_NO_DEVICE`.
    pub const NO_DEVICE: CudaError = CudaError(100);
    /// `CUDA_ERROR_INVALID_HANDLE`.
    pub const INVALID_HANDLE: CudaError = CudaError(400);
    /// `CUDA_ERROR_NOT_READY`.
    pub const NOT_READY: CudaError = CudaError(600);
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: CudaError = CudaError(801);

    /// The raw code.
    pub fn code(self) -> i32 {
        self.0
    }

    /// The code's name in `cuda.h` (`CUDA_ERROR_INVALID_VALUE`), if it is one we know.
    /// Looked up in a table, not by calling the driver, so it works without one.
    pub fn name(self) -> Option<&'static str> {
        error_name(self.0)
    }
}

impl fmt::Debug for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaError({})", self)
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "CUDA error {}", self.0),
        }
    }
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError(e.0 as i32)
    }
}

/// Turns a raw result into `Ok` or [`Error::Cuda`] naming `op`.
pub(crate) fn check(op: &'static str, result: sys::CUresult) -> Result<()> {
    match result as i32 {
        0 => Ok(()),
        code => Err(Error::Cuda {
            op,
            code: CudaError(code),
        }),
    }
}

/// The same for errors from cudarc's safe layer.
pub(crate) fn from_driver(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda { op, code: e.into() }
}

/// `cuInit(0)`.
///
/// # Safety
/// The driver library must be present ([`super::probe`]).
#[doc(alias = "cuInit")]
pub(crate) unsafe fn init() -> Result<()> {
    // SAFETY: no pointers; the caller promises the library is loaded.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// `cuDeviceGetCount`: how many devices this process sees.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver must be loaded and initialised ([`init`]).
#[doc(alias = "cuDeviceGetCount")]
pub(crate) unsafe fn device_count() -> Result<usize> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out pointer for the call's duration.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// `cuDeviceGet`: the device handle of an ordinal.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_DEVICE` for an ordinal out of range).
///
/// # Safety
/// The driver must be loaded and initialised.
#[doc(alias = "cuDeviceGet")]
pub(crate) unsafe fn device_get(ordinal: usize) -> Result<sys::CUdevice> {
    let ordinal = c_int::try_from(ordinal).map_err(|_| Error::Cuda {
        op: "cuDeviceGet",
        code: CudaError::INVALID_VALUE,
    })?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: `dev` is a valid out pointer.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
}

/// `cuDeviceGetUuid_v2`: the device's UUID, the identity that holds across processes.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver must be loaded and initialised; `dev` must come from [`device_get`].
#[doc(alias = "cuDeviceGetUuid")]
pub(crate) unsafe fn device_uuid(dev: sys::CUdevice) -> Result<[u8; 16]> {
    let mut uuid = MaybeUninit::<sys::CUuuid>::zeroed();
    // SAFETY: `uuid` is a valid, writable `CUuuid`.
    check("cuDeviceGetUuid_v2", unsafe {
        sys::cuDeviceGetUuid_v2(uuid.as_mut_ptr(), dev)
    })?;
    // SAFETY: zero-initialised, then written by the driver; any bytes are a valid CUuuid.
    let uuid = unsafe { uuid.assume_init() };
    Ok(uuid.bytes.map(|b| b as u8))
}

/// `cuDeviceGetAttribute`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver must be loaded and initialised; `dev` must come from [`device_get`].
#[doc(alias = "cuDeviceGetAttribute")]
pub(crate) unsafe fn device_attribute(
    dev: sys::CUdevice,
    attr: sys::CUdevice_attribute,
) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out pointer.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, dev)
    })?;
    Ok(v)
}

/// `cuMemGetInfo_v2`: (free, total) bytes of the current context's device.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// A context must be current on this thread.
#[doc(alias = "cuMemGetInfo")]
pub(crate) unsafe fn mem_get_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both are valid out pointers.
    check("cuMemGetInfo_v2", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free, total))
}

/// `cuMemAlloc_v2`: `size` bytes of device memory that can be exported with
/// [`ipc_get_mem_handle`] (unlike `cuMemAllocAsync` memory).
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_OUT_OF_MEMORY`, …).
///
/// # Safety
/// A context must be current. The caller owns the result and must [`mem_free`] it once.
#[doc(alias = "cuMemAlloc")]
pub(crate) unsafe fn mem_alloc(size: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid out pointer.
    check("cuMemAlloc_v2", unsafe {
        sys::cuMemAlloc_v2(&mut ptr, size)
    })?;
    Ok(ptr)
}

/// `cuMemFree_v2`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ptr` came from [`mem_alloc`], is freed once, and nothing uses it afterwards; its
/// context (or one of its device) is current.
#[doc(alias = "cuMemFree")]
pub(crate) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) })
}

/// `cuMemGetAddressRange_v2`: the base and size of the allocation holding `ptr`.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_NOT_FOUND` for an address no allocation holds).
///
/// # Safety
/// A context must be current.
#[doc(alias = "cuMemGetAddressRange")]
pub(crate) unsafe fn mem_get_address_range(
    ptr: sys::CUdeviceptr,
) -> Result<(sys::CUdeviceptr, usize)> {
    let (mut base, mut size) = (0, 0usize);
    // SAFETY: both are valid out pointers.
    check("cuMemGetAddressRange_v2", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    Ok((base, size))
}

/// `cuIpcGetMemHandle`: the 64 opaque bytes another process opens. A capability.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_VALUE` for memory that cannot be exported, such as
/// `cuMemAllocAsync` memory).
///
/// # Safety
/// A context must be current; `ptr` is the base of a live [`mem_alloc`] allocation.
#[doc(alias = "cuIpcGetMemHandle")]
pub(crate) unsafe fn ipc_get_mem_handle(ptr: sys::CUdeviceptr) -> Result<[u8; 64]> {
    let mut handle = MaybeUninit::<sys::CUipcMemHandle>::zeroed();
    // SAFETY: `handle` is a valid, writable `CUipcMemHandle`.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(handle.as_mut_ptr(), ptr)
    })?;
    // SAFETY: zero-initialised, then written; any bytes are a valid handle struct.
    let handle = unsafe { handle.assume_init() };
    Ok(handle.reserved.map(|b| b as u8))
}

/// `cuIpcOpenMemHandle_v2` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: maps another
/// process's allocation into the current context.
///
/// # Errors
/// [`Error::Cuda`]: the exporter freed it, the handle is from this very process
/// (`CUDA_ERROR_INVALID_CONTEXT`), or it is not a handle at all.
///
/// # Safety
/// A context must be current. The caller owns the mapping and must
/// [`ipc_close_mem_handle`] it once. Integrity is the caller's business: the driver was
/// seen to accept a handle with one corrupted byte, so only sealed, checked handles may
/// come here.
#[doc(alias = "cuIpcOpenMemHandle")]
pub(crate) unsafe fn ipc_open_mem_handle(handle: &[u8; 64]) -> Result<sys::CUdeviceptr> {
    let raw = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid out pointer; the handle is passed by value.
    check("cuIpcOpenMemHandle_v2", unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            raw,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    })?;
    Ok(ptr)
}

/// `cuIpcCloseMemHandle`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ptr` came from [`ipc_open_mem_handle`] in the context that is current now, is closed
/// once, and is not used afterwards.
#[doc(alias = "cuIpcCloseMemHandle")]
pub(crate) unsafe fn ipc_close_mem_handle(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuIpcCloseMemHandle", unsafe {
        sys::cuIpcCloseMemHandle(ptr)
    })
}

/// The allocation properties of VMM memory on `dev` that can be shared as a POSIX fd.
pub(crate) fn vmm_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: `CUmemAllocationProp` is a plain C struct of integers, enums whose zero is a
    // declared variant (`*_INVALID`), and a raw pointer; all-zero is valid.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop
}

/// `cuMemGetAllocationGranularity` (minimum): what VMM sizes and addresses must be
/// multiples of.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver must be initialised.
#[doc(alias = "cuMemGetAllocationGranularity")]
pub(crate) unsafe fn mem_granularity(prop: &sys::CUmemAllocationProp) -> Result<usize> {
    let mut g = 0usize;
    // SAFETY: `g` is a valid out pointer, `prop` a valid struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(g)
}

/// `cuMemCreate`: physical memory of `size` bytes (a multiple of the granularity).
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// A context must be current. The caller owns the handle and must [`mem_release`] it once.
#[doc(alias = "cuMemCreate")]
pub(crate) unsafe fn mem_create(
    size: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `h` is a valid out pointer, `prop` a valid struct.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut h, size, prop, 0)
    })?;
    Ok(h)
}

/// `cuMemRelease`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `h` came from [`mem_create`] or [`mem_import_fd`] and is released once.
#[doc(alias = "cuMemRelease")]
pub(crate) unsafe fn mem_release(h: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
}

/// `cuMemAddressReserve`: `size` bytes of virtual address space aligned to `align`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// A context must be current. The caller must [`mem_address_free`] the range once.
#[doc(alias = "cuMemAddressReserve")]
pub(crate) unsafe fn mem_address_reserve(size: usize, align: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid out pointer.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut ptr, size, align, 0, 0)
    })?;
    Ok(ptr)
}

/// `cuMemAddressFree`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// (`ptr`, `size`) is a range from [`mem_address_reserve`] with nothing mapped in it.
#[doc(alias = "cuMemAddressFree")]
pub(crate) unsafe fn mem_address_free(ptr: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(ptr, size)
    })
}

/// `cuMemMap`: maps the whole of `h` at `ptr`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// (`ptr`, `size`) lies in a reserved range; `h` is live and at least `size` bytes.
#[doc(alias = "cuMemMap")]
pub(crate) unsafe fn mem_map(
    ptr: sys::CUdeviceptr,
    size: usize,
    h: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuMemMap", unsafe { sys::cuMemMap(ptr, size, 0, h, 0) })
}

/// `cuMemUnmap`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// (`ptr`, `size`) was mapped with [`mem_map`]; nothing uses it afterwards.
#[doc(alias = "cuMemUnmap")]
pub(crate) unsafe fn mem_unmap(ptr: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size) })
}

/// `cuMemSetAccess`: read-write access for device `dev` to (`ptr`, `size`).
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// (`ptr`, `size`) is mapped.
#[doc(alias = "cuMemSetAccess")]
pub(crate) unsafe fn mem_set_access(
    ptr: sys::CUdeviceptr,
    size: usize,
    dev: sys::CUdevice,
) -> Result<()> {
    // SAFETY: plain C struct; all-zero is valid (see `vmm_prop`).
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = dev;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: `desc` is one valid descriptor, and we pass count 1.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, size, &desc, 1)
    })
}

/// `cuMemExportToShareableHandle` (POSIX fd): a new descriptor for `h`, ours to close.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_NOT_SUPPORTED` if `h` was not made shareable as an fd).
///
/// # Safety
/// `h` is live.
#[doc(alias = "cuMemExportToShareableHandle")]
pub(crate) unsafe fn mem_export_fd(h: sys::CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: for the POSIX-fd type the driver writes an `int` through the pointer.
    check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut c_int).cast::<c_void>(),
            h,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::Cuda {
            op: "cuMemExportToShareableHandle",
            code: CudaError::INVALID_HANDLE,
        });
    }
    // SAFETY: the driver just opened `fd` for us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemImportFromShareableHandle` (POSIX fd). The driver does not take `fd`: the caller
/// may close it afterwards.
///
/// # Errors
/// [`Error::Cuda`] (not such a descriptor, …).
///
/// # Safety
/// The driver must be initialised; the caller owns the handle and must [`mem_release`]
/// it once.
#[doc(alias = "cuMemImportFromShareableHandle")]
pub(crate) unsafe fn mem_import_fd(
    fd: BorrowedFd<'_>,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: for the POSIX-fd type the descriptor's value travels as the pointer argument
    // (`(void*)(uintptr_t)fd`); `h` is a valid out pointer.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut h,
            fd.as_raw_fd() as usize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(h)
}

/// `cuEventCreate(CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// A context must be current; the caller must [`event_destroy`] the event once.
#[doc(alias = "cuEventCreate")]
pub(crate) unsafe fn event_create_interprocess() -> Result<sys::CUevent> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
    // SAFETY: `ev` is a valid out pointer.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut ev, flags)
    })?;
    Ok(ev)
}

/// `cuEventDestroy_v2`. Safe to call while the event is still pending: the driver frees it
/// once it completes.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ev` is live and destroyed once; its context is current.
#[doc(alias = "cuEventDestroy")]
pub(crate) unsafe fn event_destroy(ev: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuEventDestroy_v2", unsafe { sys::cuEventDestroy_v2(ev) })
}

/// `cuIpcGetEventHandle`: the 64 bytes another process opens the event with.
///
/// # Errors
/// [`Error::Cuda`] (the event was not made interprocess).
///
/// # Safety
/// `ev` is live.
#[doc(alias = "cuIpcGetEventHandle")]
pub(crate) unsafe fn ipc_get_event_handle(ev: sys::CUevent) -> Result<[u8; 64]> {
    let mut h = MaybeUninit::<sys::CUipcEventHandle>::zeroed();
    // SAFETY: `h` is a valid, writable handle struct.
    check("cuIpcGetEventHandle", unsafe {
        sys::cuIpcGetEventHandle(h.as_mut_ptr(), ev)
    })?;
    // SAFETY: zero-initialised, then written; any bytes are valid.
    let h = unsafe { h.assume_init() };
    Ok(h.reserved.map(|b| b as u8))
}

/// `cuIpcOpenEventHandle`: another process's interprocess event, in the current context.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// A context must be current; the caller must [`event_destroy`] the event once.
#[doc(alias = "cuIpcOpenEventHandle")]
pub(crate) unsafe fn ipc_open_event_handle(handle: &[u8; 64]) -> Result<sys::CUevent> {
    let raw = sys::CUipcEventHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: `ev` is a valid out pointer; the handle is passed by value.
    check("cuIpcOpenEventHandle", unsafe {
        sys::cuIpcOpenEventHandle(&mut ev, raw)
    })?;
    Ok(ev)
}

/// `cuEventRecord`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ev` and `stream` are live and of the current context.
#[doc(alias = "cuEventRecord")]
pub(crate) unsafe fn event_record(ev: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuEventRecord", unsafe { sys::cuEventRecord(ev, stream) })
}

/// `cuEventQuery`: whether the work before the event's last record has completed.
///
/// # Errors
/// [`Error::Cuda`] (anything but success or `CUDA_ERROR_NOT_READY`).
///
/// # Safety
/// `ev` is live.
#[doc(alias = "cuEventQuery")]
pub(crate) unsafe fn event_query(ev: sys::CUevent) -> Result<bool> {
    // SAFETY: the caller's promise.
    match unsafe { sys::cuEventQuery(ev) } as i32 {
        0 => Ok(true),
        600 => Ok(false),
        code => Err(Error::Cuda {
            op: "cuEventQuery",
            code: CudaError(code),
        }),
    }
}

/// `cuEventSynchronize`: blocks until the event's last record has completed.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ev` is live.
#[doc(alias = "cuEventSynchronize")]
pub(crate) unsafe fn event_synchronize(ev: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(ev) })
}

/// `cuStreamWaitEvent`: later work on `stream` waits for the event's last record.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `stream` is live in the current context; `ev` is live.
#[doc(alias = "cuStreamWaitEvent")]
pub(crate) unsafe fn stream_wait_event(stream: sys::CUstream, ev: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(stream, ev, 0)
    })
}

/// `cuStreamSynchronize`.
///
/// # Errors
/// [`Error::Cuda`] (including errors of earlier asynchronous work on the stream).
///
/// # Safety
/// `stream` is live in the current context.
#[doc(alias = "cuStreamSynchronize")]
pub(crate) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream)
    })
}

/// `cuMemcpyDtoHAsync_v2` of `dst.len()` bytes from `src`, ordered on `stream`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `stream` is live in the current context; `src..src + dst.len()` is mapped device
/// memory. `dst` must stay untouched until the stream is synchronised (pageable memory
/// makes the call synchronous in practice; callers synchronise anyway).
#[doc(alias = "cuMemcpyDtoHAsync")]
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: &mut [u8],
    src: sys::CUdeviceptr,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: `dst` is valid for `dst.len()` writable bytes; the caller vouches for `src`.
    check("cuMemcpyDtoHAsync_v2", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), stream)
    })
}

/// `cuMemcpyHtoDAsync_v2` of `src` to `dst`, ordered on `stream`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// As [`memcpy_dtoh_async`], with the directions swapped.
#[doc(alias = "cuMemcpyHtoDAsync")]
pub(crate) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: &[u8],
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: `src` is valid for `src.len()` bytes; the caller vouches for `dst`.
    check("cuMemcpyHtoDAsync_v2", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream)
    })
}

/// `cuMemsetD8Async`: `len` bytes at `dst` set to `byte`, ordered on `stream`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `stream` is live in the current context; `dst..dst + len` is mapped device memory.
#[doc(alias = "cuMemsetD8Async")]
pub(crate) unsafe fn memset_d8_async(
    dst: sys::CUdeviceptr,
    byte: u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's promise.
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(dst, byte, len, stream)
    })
}

/// The name of a `CUresult` in `cuda.h`, from a table (CUDA 13.x headers).
fn error_name(code: i32) -> Option<&'static str> {
    Some(match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        5 => "CUDA_ERROR_PROFILER_DISABLED",
        6 => "CUDA_ERROR_PROFILER_NOT_INITIALIZED",
        7 => "CUDA_ERROR_PROFILER_ALREADY_STARTED",
        8 => "CUDA_ERROR_PROFILER_ALREADY_STOPPED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        36 => "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        47 => "CUDA_ERROR_MULTICAST_RESOURCE_FULL",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        102 => "CUDA_ERROR_DEVICE_NOT_LICENSED",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        202 => "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
        205 => "CUDA_ERROR_MAP_FAILED",
        206 => "CUDA_ERROR_UNMAP_FAILED",
        207 => "CUDA_ERROR_ARRAY_IS_MAPPED",
        208 => "CUDA_ERROR_ALREADY_MAPPED",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        210 => "CUDA_ERROR_ALREADY_ACQUIRED",
        211 => "CUDA_ERROR_NOT_MAPPED",
        212 => "CUDA_ERROR_NOT_MAPPED_AS_ARRAY",
        213 => "CUDA_ERROR_NOT_MAPPED_AS_POINTER",
        214 => "CUDA_ERROR_ECC_UNCORRECTABLE",
        215 => "CUDA_ERROR_UNSUPPORTED_LIMIT",
        216 => "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
        217 => "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        218 => "CUDA_ERROR_INVALID_PTX",
        219 => "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT",
        220 => "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        221 => "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        222 => "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        223 => "CUDA_ERROR_JIT_COMPILATION_DISABLED",
        224 => "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
        225 => "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC",
        226 => "CUDA_ERROR_CONTAINED",
        227 => "CUDA_ERROR_INSUFFICIENT_LOADER_VERSION",
        300 => "CUDA_ERROR_INVALID_SOURCE",
        301 => "CUDA_ERROR_FILE_NOT_FOUND",
        302 => "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
        303 => "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        402 => "CUDA_ERROR_LOSSY_QUERY",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        703 => "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING",
        704 => "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        705 => "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
        708 => "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
        709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        710 => "CUDA_ERROR_ASSERT",
        711 => "CUDA_ERROR_TOO_MANY_PEERS",
        712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        713 => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        714 => "CUDA_ERROR_HARDWARE_STACK_ERROR",
        715 => "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        716 => "CUDA_ERROR_MISALIGNED_ADDRESS",
        717 => "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        718 => "CUDA_ERROR_INVALID_PC",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        720 => "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        721 => "CUDA_ERROR_TENSOR_MEMORY_LEAK",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        805 => "CUDA_ERROR_MPS_CONNECTION_FAILED",
        806 => "CUDA_ERROR_MPS_RPC_FAILURE",
        807 => "CUDA_ERROR_MPS_SERVER_NOT_READY",
        808 => "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
        809 => "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
        810 => "CUDA_ERROR_MPS_CLIENT_TERMINATED",
        811 => "CUDA_ERROR_CDP_NOT_SUPPORTED",
        812 => "CUDA_ERROR_CDP_VERSION_MISMATCH",
        900 => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        901 => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        902 => "CUDA_ERROR_STREAM_CAPTURE_MERGE",
        903 => "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        904 => "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        905 => "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        906 => "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        907 => "CUDA_ERROR_CAPTURED_EVENT",
        908 => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        909 => "CUDA_ERROR_TIMEOUT",
        910 => "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
        911 => "CUDA_ERROR_EXTERNAL_DEVICE",
        912 => "CUDA_ERROR_INVALID_CLUSTER_SIZE",
        913 => "CUDA_ERROR_FUNCTION_NOT_LOADED",
        914 => "CUDA_ERROR_INVALID_RESOURCE_TYPE",
        915 => "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION",
        916 => "CUDA_ERROR_KEY_ROTATION",
        917 => "CUDA_ERROR_STREAM_DETACHED",
        918 => "CUDA_ERROR_GRAPH_RECAPTURE_FAILURE",
        919 => "CUDA_ERROR_FABRIC_NOT_READY",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_print_their_name_and_number() {
        assert_eq!(CudaError(1).to_string(), "CUDA_ERROR_INVALID_VALUE (1)");
        assert_eq!(CudaError::NO_DEVICE.name(), Some("CUDA_ERROR_NO_DEVICE"));
        assert_eq!(CudaError(123_456).to_string(), "CUDA error 123456");
        assert_eq!(
            format!("{:?}", CudaError(2)),
            "CudaError(CUDA_ERROR_OUT_OF_MEMORY (2))"
        );
    }

    #[test]
    fn check_keeps_the_raw_code() {
        let e = check("cuMemAlloc_v2", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY).unwrap_err();
        assert!(
            matches!(e, Error::Cuda { op: "cuMemAlloc_v2", code } if code == CudaError::OUT_OF_MEMORY)
        );
        check("x", sys::CUresult::CUDA_SUCCESS).unwrap();
    }
}
