//! Thin `Result` wrappers over the driver calls Baton makes, one per call, each named after
//! it. No ownership here: the RAII types in the sibling modules own what these functions
//! make.
//!
//! Every call goes through the [`driver`](super::driver) table, whose entry points return
//! the raw `CUresult` integer: a code newer than our bindings is kept as a number
//! ([`CudaError`]), never turned into (or read as) a Rust enum.
//!
//! # Safety
//!
//! Every function here is `unsafe` where the driver call reads or writes memory the caller
//! names or acts on a handle the caller must keep valid; its `# Safety` section says what
//! the caller promises. Calls that need a current context say so; the callers push one
//! first ([`ContextGuard`](super::context::ContextGuard)). Should the driver table not be
//! loaded ([`super::probe`] failed or never ran), every call fails as
//! `CUDA_ERROR_NOT_INITIALIZED` before reaching the driver.

use super::driver::{RawResult, StreamValue64Fn, api};
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
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    pub const NOT_INITIALIZED: CudaError = CudaError(3);
    /// `CUDA_ERROR_NO_DEVICE`.
    pub const NO_DEVICE: CudaError = CudaError(100);
    /// `CUDA_ERROR_INVALID_CONTEXT`.
    pub const INVALID_CONTEXT: CudaError = CudaError(201);
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
pub(crate) fn check(op: &'static str, code: RawResult) -> Result<()> {
    match code {
        0 => Ok(()),
        code => Err(Error::Cuda {
            op,
            code: CudaError(code),
        }),
    }
}

/// The same for errors from cudarc's safe layer (context and stream creation).
pub(crate) fn from_driver(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda { op, code: e.into() }
}

/// Calls the entry point `$f` of the driver table with the arguments, and turns its result
/// into a `Result<()>` naming it. Expands to one call through a function pointer: the call
/// site wraps it in `unsafe` with the reason it is sound.
macro_rules! call {
    ($f:ident($($arg:expr),* $(,)?)) => {
        check(stringify!($f), (api(stringify!($f))?.$f)($($arg),*))
    };
}

/// Device attributes by their `cuda.h` numbers (`CUdevice_attribute`), so that attributes
/// newer than our bindings can be asked for too.
pub(crate) mod attr {
    use std::ffi::c_int;

    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1`: the v1 stream memory operations
    /// are enabled (Linux: the `NVreg_EnableStreamMemOPs=1` module option).
    pub(crate) const CAN_USE_STREAM_MEM_OPS_V1: c_int = 92;
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1` (CUDA 12+ headers:
    /// `..._64_BIT_STREAM_MEM_OPS_V1`, formerly without the suffix).
    pub(crate) const CAN_USE_64_BIT_STREAM_MEM_OPS_V1: c_int = 93;
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`.
    pub(crate) const VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED: c_int = 102;
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
    pub(crate) const HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: c_int = 103;
    /// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`.
    pub(crate) const MEMORY_POOLS_SUPPORTED: c_int = 115;
    /// `CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES`: a bit mask of
    /// `CUmemAllocationHandleType`.
    pub(crate) const MEMPOOL_SUPPORTED_HANDLE_TYPES: c_int = 119;
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS` (CUDA 12+; `..._V2` in 11.7 and
    /// 11.8): `cuStreamWaitValue64_v2`/`cuStreamWriteValue64_v2` work on this device.
    pub(crate) const CAN_USE_64_BIT_STREAM_MEM_OPS_V2: c_int = 122;
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const POSIX_FD: c_int = 1;

/// `cuInit(0)`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver table must be loaded ([`super::driver::load`]).
#[doc(alias = "cuInit")]
pub(crate) unsafe fn init() -> Result<()> {
    // SAFETY: no pointers.
    unsafe { call!(cuInit(0)) }
}

/// `cuDeviceGetCount`: how many devices this process sees.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver must be initialised ([`init`]).
#[doc(alias = "cuDeviceGetCount")]
pub(crate) unsafe fn device_count() -> Result<usize> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out pointer for the call's duration.
    unsafe { call!(cuDeviceGetCount(&mut n)) }?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// `cuDeviceGet`: the device handle of an ordinal.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_DEVICE` for an ordinal out of range).
///
/// # Safety
/// The driver must be initialised.
#[doc(alias = "cuDeviceGet")]
pub(crate) unsafe fn device_get(ordinal: usize) -> Result<sys::CUdevice> {
    let ordinal = c_int::try_from(ordinal).map_err(|_| Error::Cuda {
        op: "cuDeviceGet",
        code: CudaError::INVALID_VALUE,
    })?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: `dev` is a valid out pointer.
    unsafe { call!(cuDeviceGet(&mut dev, ordinal)) }?;
    Ok(dev)
}

/// `cuDeviceGetUuid_v2`: the device's UUID, the identity that holds across processes.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver must be initialised; `dev` must come from [`device_get`].
#[doc(alias = "cuDeviceGetUuid")]
pub(crate) unsafe fn device_uuid(dev: sys::CUdevice) -> Result<[u8; 16]> {
    let mut uuid = MaybeUninit::<sys::CUuuid>::zeroed();
    // SAFETY: `uuid` is a valid, writable `CUuuid`.
    unsafe { call!(cuDeviceGetUuid_v2(uuid.as_mut_ptr(), dev)) }?;
    // SAFETY: zero-initialised, then written by the driver; any bytes are a valid CUuuid.
    let uuid = unsafe { uuid.assume_init() };
    Ok(uuid.bytes.map(|b| b as u8))
}

/// `cuDeviceGetAttribute` of an attribute by number ([`attr`]).
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_VALUE` for an attribute this driver does not know).
///
/// # Safety
/// The driver must be initialised; `dev` must come from [`device_get`].
#[doc(alias = "cuDeviceGetAttribute")]
pub(crate) unsafe fn device_attribute(dev: sys::CUdevice, attribute: c_int) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out pointer; the attribute is passed by value.
    unsafe { call!(cuDeviceGetAttribute(&mut v, attribute, dev)) }?;
    Ok(v)
}

/// `cuCtxGetCurrent`: the context current on this thread (null: none).
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver must be initialised.
#[doc(alias = "cuCtxGetCurrent")]
pub(crate) unsafe fn ctx_get_current() -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out pointer.
    unsafe { call!(cuCtxGetCurrent(&mut ctx)) }?;
    Ok(ctx)
}

/// `cuCtxSetCurrent`: replaces the top of this thread's context stack with `ctx` (null:
/// pops it).
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ctx` is null or a live context.
#[doc(alias = "cuCtxSetCurrent")]
pub(crate) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuCtxSetCurrent(ctx)) }
}

/// `cuCtxPushCurrent_v2`: makes `ctx` current on this thread, above the one that was.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ctx` is a live context, kept alive until the matching [`ctx_pop_current`].
#[doc(alias = "cuCtxPushCurrent")]
pub(crate) unsafe fn ctx_push_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuCtxPushCurrent_v2(ctx)) }
}

/// `cuCtxPopCurrent_v2`: pops this thread's current context; returns it.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_CONTEXT` when the stack is empty).
///
/// # Safety
/// The driver must be initialised.
#[doc(alias = "cuCtxPopCurrent")]
pub(crate) unsafe fn ctx_pop_current() -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out pointer.
    unsafe { call!(cuCtxPopCurrent_v2(&mut ctx)) }?;
    Ok(ctx)
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
    unsafe { call!(cuMemGetInfo_v2(&mut free, &mut total)) }?;
    Ok((free, total))
}

/// `cuMemAlloc_v2`: `size` bytes of device memory that can be exported with
/// [`ipc_get_mem_handle`] (unlike `cuMemAllocAsync` memory of the default pool).
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
    unsafe { call!(cuMemAlloc_v2(&mut ptr, size)) }?;
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
    unsafe { call!(cuMemFree_v2(ptr)) }
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
    unsafe { call!(cuMemGetAddressRange_v2(&mut base, &mut size, ptr)) }?;
    Ok((base, size))
}

/// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)`: the ordinal of the device
/// whose memory `ptr` is.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_VALUE` for an address the driver does not know).
///
/// # Safety
/// The driver is initialised.
#[doc(alias = "cuPointerGetAttribute")]
pub(crate) unsafe fn pointer_device_ordinal(ptr: sys::CUdeviceptr) -> Result<i32> {
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (CUDA 9.2 and later).
    const DEVICE_ORDINAL: c_int = 9;
    let mut ordinal: c_int = -1;
    // SAFETY: the attribute's value is an `int`, written to a valid out pointer.
    unsafe {
        call!(cuPointerGetAttribute(
            (&mut ordinal as *mut c_int).cast(),
            DEVICE_ORDINAL,
            ptr
        ))
    }?;
    Ok(ordinal)
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
    unsafe { call!(cuIpcGetMemHandle(handle.as_mut_ptr(), ptr)) }?;
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
    // `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
    const LAZY_PEER_ACCESS: std::ffi::c_uint = 1;
    // SAFETY: `ptr` is a valid out pointer; the handle is passed by value.
    unsafe { call!(cuIpcOpenMemHandle_v2(&mut ptr, raw, LAZY_PEER_ACCESS)) }?;
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
    unsafe { call!(cuIpcCloseMemHandle(ptr)) }
}

/// The location of device `dev`.
fn device_location(dev: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    }
}

/// The allocation properties of VMM memory on `dev` that can be shared as a POSIX fd.
pub(crate) fn vmm_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: `CUmemAllocationProp` is a plain C struct of integers, enums whose zero is a
    // declared variant (`*_INVALID`), and a raw pointer; all-zero is valid.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = device_location(dev);
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
    // `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
    const MINIMUM: c_int = 0;
    // SAFETY: `g` is a valid out pointer, `prop` a valid struct.
    unsafe { call!(cuMemGetAllocationGranularity(&mut g, prop, MINIMUM)) }?;
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
    unsafe { call!(cuMemCreate(&mut h, size, prop, 0)) }?;
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
    unsafe { call!(cuMemRelease(h)) }
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
    unsafe { call!(cuMemAddressReserve(&mut ptr, size, align, 0, 0)) }?;
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
    unsafe { call!(cuMemAddressFree(ptr, size)) }
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
    unsafe { call!(cuMemMap(ptr, size, 0, h, 0)) }
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
    unsafe { call!(cuMemUnmap(ptr, size)) }
}

/// Read-write access for device `dev`.
fn read_write_access(dev: sys::CUdevice) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: device_location(dev),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
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
    let desc = read_write_access(dev);
    // SAFETY: `desc` is one valid descriptor, and we pass count 1.
    unsafe { call!(cuMemSetAccess(ptr, size, &desc, 1)) }
}

/// Wraps a descriptor the driver just wrote through an `int` out pointer.
fn owned_fd(op: &'static str, fd: c_int) -> Result<OwnedFd> {
    if fd < 0 {
        return Err(Error::Cuda {
            op,
            code: CudaError::INVALID_HANDLE,
        });
    }
    // SAFETY: the driver just opened `fd` for us (a successful export); nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
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
    unsafe {
        call!(cuMemExportToShareableHandle(
            (&mut fd as *mut c_int).cast::<c_void>(),
            h,
            POSIX_FD,
            0
        ))
    }?;
    owned_fd("cuMemExportToShareableHandle", fd)
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
    unsafe {
        call!(cuMemImportFromShareableHandle(
            &mut h,
            fd.as_raw_fd() as usize as *mut c_void,
            POSIX_FD
        ))
    }?;
    Ok(h)
}

/// `cuMemPoolCreate`: a memory pool of pinned device memory on `dev` whose allocations can
/// be exported (the pool as a POSIX file descriptor, each allocation as
/// [`mem_pool_export_pointer`] data).
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_NOT_SUPPORTED` where the device has no such pools).
///
/// # Safety
/// A context of `dev` must be current. The caller owns the pool and must
/// [`mem_pool_destroy`] it once.
#[doc(alias = "cuMemPoolCreate")]
pub(crate) unsafe fn mem_pool_create(dev: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    // SAFETY: `CUmemPoolProps` is a plain C struct (enums whose zero is a declared
    // variant, integers, a raw pointer, reserved bytes that must be zero); all-zero is
    // valid and is what `cuda.h` asks for in the fields we leave.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    props.location = device_location(dev);
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out pointer, `props` a valid struct.
    unsafe { call!(cuMemPoolCreate(&mut pool, &props)) }?;
    Ok(pool)
}

/// `cuMemPoolDestroy`. Allocations still live keep the pool's memory until they are freed
/// (the driver releases it then).
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `pool` came from [`mem_pool_create`] or [`mem_pool_import_fd`] and is destroyed once.
#[doc(alias = "cuMemPoolDestroy")]
pub(crate) unsafe fn mem_pool_destroy(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuMemPoolDestroy(pool)) }
}

/// `cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)`: how many bytes of freed
/// memory the pool keeps reserved when a stream, event or context synchronises, instead of
/// giving them back to the device.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `pool` is live.
#[doc(alias = "cuMemPoolSetAttribute")]
pub(crate) unsafe fn mem_pool_set_release_threshold(
    pool: sys::CUmemoryPool,
    bytes: u64,
) -> Result<()> {
    // `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`, whose value is a `cuuint64_t`.
    const RELEASE_THRESHOLD: c_int = 4;
    let mut value: u64 = bytes;
    // SAFETY: `value` is a valid `cuuint64_t` for the call's duration.
    unsafe {
        call!(cuMemPoolSetAttribute(
            pool,
            RELEASE_THRESHOLD,
            (&mut value as *mut u64).cast::<c_void>()
        ))
    }
}

/// `cuMemPoolTrimTo`: gives memory the pool holds but no allocation uses back to the
/// device, keeping at least `keep` bytes reserved.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `pool` is live.
#[doc(alias = "cuMemPoolTrimTo")]
pub(crate) unsafe fn mem_pool_trim_to(pool: sys::CUmemoryPool, keep: usize) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuMemPoolTrimTo(pool, keep)) }
}

/// `cuMemPoolExportToShareableHandle` (POSIX fd): a new descriptor for the pool, ours to
/// close.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_VALUE` for a pool not made exportable).
///
/// # Safety
/// `pool` is live and was made with the POSIX-fd handle type ([`mem_pool_create`]).
#[doc(alias = "cuMemPoolExportToShareableHandle")]
pub(crate) unsafe fn mem_pool_export_fd(pool: sys::CUmemoryPool) -> Result<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: for the POSIX-fd type the driver writes an `int` through the pointer.
    unsafe {
        call!(cuMemPoolExportToShareableHandle(
            (&mut fd as *mut c_int).cast::<c_void>(),
            pool,
            POSIX_FD,
            0
        ))
    }?;
    owned_fd("cuMemPoolExportToShareableHandle", fd)
}

/// `cuMemPoolImportFromShareableHandle` (POSIX fd): another process's pool. The driver
/// does not take `fd`: the caller may close it afterwards.
///
/// # Errors
/// [`Error::Cuda`] (not a pool's descriptor, …).
///
/// # Safety
/// The driver must be initialised; the caller owns the imported pool and must
/// [`mem_pool_destroy`] it once.
#[doc(alias = "cuMemPoolImportFromShareableHandle")]
pub(crate) unsafe fn mem_pool_import_fd(fd: BorrowedFd<'_>) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: for the POSIX-fd type the descriptor's value travels as the pointer argument;
    // `pool` is a valid out pointer.
    unsafe {
        call!(cuMemPoolImportFromShareableHandle(
            &mut pool,
            fd.as_raw_fd() as usize as *mut c_void,
            POSIX_FD,
            0
        ))
    }?;
    Ok(pool)
}

/// `cuMemPoolSetAccess`: read-write access for device `dev` to the pool's memory (an
/// imported pool grants none until this is called).
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `pool` is live.
#[doc(alias = "cuMemPoolSetAccess")]
pub(crate) unsafe fn mem_pool_set_access(
    pool: sys::CUmemoryPool,
    dev: sys::CUdevice,
) -> Result<()> {
    let desc = read_write_access(dev);
    // SAFETY: `desc` is one valid descriptor, and we pass count 1.
    unsafe { call!(cuMemPoolSetAccess(pool, &desc, 1)) }
}

/// `cuMemPoolExportPointer`: the 64 bytes another process that imported the pool passes to
/// [`mem_pool_import_pointer`]. A capability.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_VALUE` for memory not from an exportable pool).
///
/// # Safety
/// `ptr` is the start of a live allocation from an exportable pool.
#[doc(alias = "cuMemPoolExportPointer")]
pub(crate) unsafe fn mem_pool_export_pointer(ptr: sys::CUdeviceptr) -> Result<[u8; 64]> {
    let mut data = MaybeUninit::<sys::CUmemPoolPtrExportData>::zeroed();
    // SAFETY: `data` is a valid, writable export-data struct.
    unsafe { call!(cuMemPoolExportPointer(data.as_mut_ptr(), ptr)) }?;
    // SAFETY: zero-initialised, then written; any bytes are a valid struct.
    let data = unsafe { data.assume_init() };
    Ok(data.reserved)
}

/// `cuMemPoolImportPointer`: maps the allocation `data` names, from imported `pool`.
///
/// # Errors
/// [`Error::Cuda`] (the exporter freed it, `data` is not of this pool, …).
///
/// # Safety
/// `pool` is a live imported pool. The caller owns the mapping and must free it once
/// ([`mem_free_async`]), before the exporter frees the allocation. Integrity is the
/// caller's business: only sealed, checked handles may come here.
#[doc(alias = "cuMemPoolImportPointer")]
pub(crate) unsafe fn mem_pool_import_pointer(
    pool: sys::CUmemoryPool,
    data: &[u8; 64],
) -> Result<sys::CUdeviceptr> {
    let mut raw = sys::CUmemPoolPtrExportData { reserved: *data };
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid out pointer; `raw` a valid struct the driver only reads.
    unsafe { call!(cuMemPoolImportPointer(&mut ptr, pool, &mut raw)) }?;
    Ok(ptr)
}

/// `cuMemAllocFromPoolAsync`: `size` bytes from `pool`, available to work on `stream` in its
/// order (and to other streams once that point of `stream` has been reached).
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_OUT_OF_MEMORY`, …).
///
/// # Safety
/// `pool` and `stream` are live, of the current context's device. The caller owns the
/// allocation and must [`mem_free_async`] it once.
#[doc(alias = "cuMemAllocFromPoolAsync")]
pub(crate) unsafe fn mem_alloc_from_pool_async(
    size: usize,
    pool: sys::CUmemoryPool,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid out pointer.
    unsafe { call!(cuMemAllocFromPoolAsync(&mut ptr, size, pool, stream)) }?;
    Ok(ptr)
}

/// `cuMemFreeAsync`: frees `ptr` in `stream`'s order.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ptr` came from [`mem_alloc_from_pool_async`] or [`mem_pool_import_pointer`], is freed
/// once, and no work ordered after this point of `stream` uses it; `stream` is live in
/// the current context.
#[doc(alias = "cuMemFreeAsync")]
pub(crate) unsafe fn mem_free_async(ptr: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuMemFreeAsync(ptr, stream)) }
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
    unsafe { call!(cuEventCreate(&mut ev, flags)) }?;
    Ok(ev)
}

/// `cuEventCreate(CU_EVENT_DISABLE_TIMING)`: an event of this process only.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// A context must be current; the caller must [`event_destroy`] the event once.
#[doc(alias = "cuEventCreate")]
pub(crate) unsafe fn event_create() -> Result<sys::CUevent> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: `ev` is a valid out pointer.
    unsafe { call!(cuEventCreate(&mut ev, flags)) }?;
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
    unsafe { call!(cuEventDestroy_v2(ev)) }
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
    unsafe { call!(cuIpcGetEventHandle(h.as_mut_ptr(), ev)) }?;
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
    unsafe { call!(cuIpcOpenEventHandle(&mut ev, raw)) }?;
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
    unsafe { call!(cuEventRecord(ev, stream)) }
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
    match unsafe { call!(cuEventQuery(ev)) } {
        Ok(()) => Ok(true),
        Err(Error::Cuda { code, .. }) if code == CudaError::NOT_READY => Ok(false),
        Err(e) => Err(e),
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
    unsafe { call!(cuEventSynchronize(ev)) }
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
    unsafe { call!(cuStreamWaitEvent(stream, ev, 0)) }
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
    unsafe { call!(cuStreamSynchronize(stream)) }
}

/// `cuStreamQuery`: whether every operation queued on the stream has completed. Never
/// blocks.
///
/// # Errors
/// [`Error::Cuda`] (an error of that work).
///
/// # Safety
/// `stream` is live in the current context.
#[doc(alias = "cuStreamQuery")]
pub(crate) unsafe fn stream_query(stream: sys::CUstream) -> Result<bool> {
    // SAFETY: the caller's promise.
    match unsafe { call!(cuStreamQuery(stream)) } {
        Ok(()) => Ok(true),
        Err(Error::Cuda { code, .. }) if code == CudaError::NOT_READY => Ok(false),
        Err(e) => Err(e),
    }
}

/// Which entry points of the 64-bit stream memory operations a device can use.
#[derive(Clone, Copy)]
pub(crate) struct StreamMemOps {
    write: StreamValue64Fn,
    wait: StreamValue64Fn,
    write_op: &'static str,
    wait_op: &'static str,
}

impl fmt::Debug for StreamMemOps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.write_op)
    }
}

/// The 64-bit stream memory operations `dev` supports: `cuStreamWriteValue64_v2` /
/// `cuStreamWaitValue64_v2` (CUDA 11.7+, on by default) where the driver has them and the
/// device says so (`CAN_USE_64_BIT_STREAM_MEM_OPS`), else the v1 calls where they are
/// enabled (`NVreg_EnableStreamMemOPs=1`), else `None`.
///
/// # Errors
/// [`Error::Cuda`] when the driver table is not loaded.
///
/// # Safety
/// The driver must be initialised; `dev` must come from [`device_get`].
pub(crate) unsafe fn stream_mem_ops(dev: sys::CUdevice) -> Result<Option<StreamMemOps>> {
    let api = api("cuDeviceGetAttribute")?;
    // An attribute the driver does not know (older than the one that added it) reads as 0.
    // SAFETY: the caller's promise (initialised driver, valid device).
    let has = |a| unsafe { device_attribute(dev, a) }.unwrap_or(0) != 0;
    if let (Some(write), Some(wait)) = (api.cuStreamWriteValue64_v2, api.cuStreamWaitValue64_v2) {
        if has(attr::CAN_USE_64_BIT_STREAM_MEM_OPS_V2) {
            return Ok(Some(StreamMemOps {
                write,
                wait,
                write_op: "cuStreamWriteValue64_v2",
                wait_op: "cuStreamWaitValue64_v2",
            }));
        }
    }
    if let (Some(write), Some(wait)) = (api.cuStreamWriteValue64, api.cuStreamWaitValue64) {
        if has(attr::CAN_USE_STREAM_MEM_OPS_V1) && has(attr::CAN_USE_64_BIT_STREAM_MEM_OPS_V1) {
            return Ok(Some(StreamMemOps {
                write,
                wait,
                write_op: "cuStreamWriteValue64",
                wait_op: "cuStreamWaitValue64",
            }));
        }
    }
    Ok(None)
}

/// `cuStreamWriteValue64(_v2)` with the default flags: after the work queued on `stream`
/// so far, and a memory barrier that makes that work's writes visible first, writes `value`
/// to `addr`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `stream` is live in the current context; `addr` is 8-byte aligned device memory that
/// stays mapped until the write has executed.
#[doc(alias = "cuStreamWriteValue64")]
pub(crate) unsafe fn stream_write_value64(
    ops: StreamMemOps,
    stream: sys::CUstream,
    addr: sys::CUdeviceptr,
    value: u64,
) -> Result<()> {
    // `CU_STREAM_WRITE_VALUE_DEFAULT`.
    const DEFAULT: std::ffi::c_uint = 0;
    // SAFETY: the caller's promise; `ops.write` has the C prototype of its symbol.
    check(ops.write_op, unsafe {
        (ops.write)(stream, addr, value, DEFAULT)
    })
}

/// `cuStreamWaitValue64(_v2)` with `CU_STREAM_WAIT_VALUE_GEQ`: later work on `stream` waits
/// until the 64-bit value at `addr` is at least `value`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `stream` is live in the current context; `addr` is 8-byte aligned device memory that
/// stays mapped until the wait has been satisfied. A value that never comes blocks the
/// stream forever.
#[doc(alias = "cuStreamWaitValue64")]
pub(crate) unsafe fn stream_wait_value64(
    ops: StreamMemOps,
    stream: sys::CUstream,
    addr: sys::CUdeviceptr,
    value: u64,
) -> Result<()> {
    // `CU_STREAM_WAIT_VALUE_GEQ`: a *cyclic* comparison, `(*addr - value) as i64 >= 0`
    // (so `u64::MAX` does not satisfy a wait for 1: see `crate::inbox::RELEASE_STEP`).
    const GEQ: std::ffi::c_uint = 0;
    // SAFETY: the caller's promise; `ops.wait` has the C prototype of its symbol.
    check(ops.wait_op, unsafe { (ops.wait)(stream, addr, value, GEQ) })
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
    unsafe {
        call!(cuMemcpyDtoHAsync_v2(
            dst.as_mut_ptr().cast(),
            src,
            dst.len(),
            stream
        ))
    }
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
    unsafe {
        call!(cuMemcpyHtoDAsync_v2(
            dst,
            src.as_ptr().cast(),
            src.len(),
            stream
        ))
    }
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
    unsafe { call!(cuMemsetD8Async(dst, byte, len, stream)) }
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
        assert_eq!(
            format!("{:?}", CudaError(2)),
            "CudaError(CUDA_ERROR_OUT_OF_MEMORY (2))"
        );
        // Codes of CUDA 12 and 13 that the CUDA 11.4 bindings' enum lacks.
        assert_eq!(CudaError(46).name(), Some("CUDA_ERROR_DEVICE_UNAVAILABLE"));
        assert_eq!(CudaError(919).name(), Some("CUDA_ERROR_FABRIC_NOT_READY"));
    }

    /// A code no header has (yet) stays the number the driver returned.
    #[test]
    fn unknown_codes_are_kept_as_numbers() {
        for code in [123_456, 920, -1, i32::MAX] {
            let e = CudaError(code);
            assert_eq!(e.name(), None);
            assert_eq!(e.code(), code);
            assert_eq!(e.to_string(), format!("CUDA error {code}"));
            assert_eq!(format!("{e:?}"), format!("CudaError(CUDA error {code})"));
        }
    }

    /// Every constant names the code `cuda.h` gives it.
    #[test]
    fn constants_match_the_table() {
        for (c, name) in [
            (CudaError::INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"),
            (CudaError::OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"),
            (CudaError::NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"),
            (CudaError::NO_DEVICE, "CUDA_ERROR_NO_DEVICE"),
            (CudaError::INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"),
            (CudaError::INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"),
            (CudaError::NOT_READY, "CUDA_ERROR_NOT_READY"),
            (CudaError::NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"),
        ] {
            assert_eq!(c.name(), Some(name));
        }
    }

    #[test]
    fn check_keeps_the_raw_code() {
        let e = check("cuMemAlloc_v2", 2).unwrap_err();
        assert!(
            matches!(e, Error::Cuda { op: "cuMemAlloc_v2", code } if code == CudaError::OUT_OF_MEMORY)
        );
        // A code past every enum variant of the bindings survives as itself.
        let e = check("cuMemAlloc_v2", 4242).unwrap_err();
        assert!(matches!(
            e,
            Error::Cuda {
                code: CudaError(4242),
                ..
            }
        ));
        assert_eq!(
            e.to_string(),
            "cuMemAlloc_v2 failed: CUDA error 4242",
            "the message names the call and the number"
        );
        check("x", 0).unwrap();
    }

    /// Before the driver table is loaded, a wrapper fails with a typed error naming its
    /// call, without reaching a driver (none is needed for this test).
    #[test]
    fn wrappers_without_a_loaded_driver_fail_cleanly() {
        if api("probe").is_ok() {
            return; // a driver is loaded in this process: nothing to check here
        }
        // SAFETY: with no table loaded, the wrapper returns before any driver call.
        let e = unsafe { mem_alloc(16) }.unwrap_err();
        assert!(
            matches!(e, Error::Cuda { op: "cuMemAlloc_v2", code } if code == CudaError::NOT_INITIALIZED),
            "{e}"
        );
    }
}
