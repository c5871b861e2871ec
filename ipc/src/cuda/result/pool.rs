//! Stream-ordered memory pools: create, configure, share as POSIX file descriptors, import,
//! and allocate or free in a stream's order.
//!
//! See the parent module for the safety contract every function here keeps.

use super::*;

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
