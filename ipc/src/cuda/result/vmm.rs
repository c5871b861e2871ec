//! The virtual memory management (VMM) calls: physical allocations, address ranges,
//! mappings, access, and sharing them as POSIX file descriptors.
//!
//! See the parent module for the safety contract every function here keeps.

use super::*;

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
