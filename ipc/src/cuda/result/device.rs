//! Initialising the driver, devices and their attributes, and the current context.
//!
//! See the parent module for the safety contract every function here keeps.

use super::*;

/// `cuInit(0)`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver table must be loaded ([`driver::load`](crate::cuda::driver::load)).
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

/// `cuDeviceCanAccessPeer`: whether `dev`'s contexts can map memory of `peer` (NVLink or
/// PCIe peer access).
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// The driver must be initialised; both devices must come from [`device_get`].
#[doc(alias = "cuDeviceCanAccessPeer")]
pub(crate) unsafe fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
    let mut can: c_int = 0;
    // SAFETY: `can` is a valid out pointer; the devices are passed by value.
    unsafe { call!(cuDeviceCanAccessPeer(&mut can, dev, peer)) }?;
    Ok(can != 0)
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
