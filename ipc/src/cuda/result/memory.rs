//! Device memory of `cuMemAlloc` and legacy IPC of it: allocate, free, look up, share and
//! open.
//!
//! See the parent module for the safety contract every function here keeps.

use super::*;

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
