//! Modules and launches: Baton's own kernels (`cuda/copy.rs`), and the device-to-device
//! copy a plan falls back to.
//!
//! See the parent module for the safety contract every function here keeps.

use super::*;
use std::ffi::CStr;

/// `cuModuleLoadData`: a module from a NUL-terminated PTX image, compiled for the device by
/// the driver.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION` for a driver older than the PTX).
///
/// # Safety
/// A context must be current; the caller must [`module_unload`] the module once, with
/// that context current.
#[doc(alias = "cuModuleLoadData")]
pub(crate) unsafe fn module_load_data(image: &CStr) -> Result<sys::CUmodule> {
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `module` is a valid out pointer; `image` is NUL-terminated.
    unsafe { call!(cuModuleLoadData(&mut module, image.as_ptr().cast())) }?;
    Ok(module)
}

/// `cuModuleUnload`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `module` is a live module of the current context, unloaded once; no launch of its
/// functions is still queued.
#[doc(alias = "cuModuleUnload")]
pub(crate) unsafe fn module_unload(module: sys::CUmodule) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuModuleUnload(module)) }
}

/// `cuModuleGetFunction`.
///
/// # Errors
/// [`Error::Cuda`] (`CUDA_ERROR_NOT_FOUND` for a name the module lacks).
///
/// # Safety
/// `module` is live; the function is valid while it is.
#[doc(alias = "cuModuleGetFunction")]
pub(crate) unsafe fn module_get_function(
    module: sys::CUmodule,
    name: &CStr,
) -> Result<sys::CUfunction> {
    let mut f: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: `f` is a valid out pointer; `name` is NUL-terminated.
    unsafe { call!(cuModuleGetFunction(&mut f, module, name.as_ptr())) }?;
    Ok(f)
}

/// `cuLaunchKernel` of `f` on `grid` × `block` threads (one dimension each), no dynamic
/// shared memory, ordered on `stream`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `f` is live in the current context; `stream` is live there; `params` points to one
/// value per kernel parameter, each of its parameter's type; whatever memory the kernel
/// reads or writes through them stays valid until the launch completes.
#[doc(alias = "cuLaunchKernel")]
pub(crate) unsafe fn launch_kernel(
    f: sys::CUfunction,
    grid: u32,
    block: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: the caller's promise; `params` outlives the call, which copies the values.
    unsafe {
        call!(cuLaunchKernel(
            f,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut()
        ))
    }
}

/// `cuMemcpyDtoDAsync_v2` of `len` bytes from `src` to `dst`, ordered on `stream`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `stream` is live in the current context; `src..src + len` and `dst..dst + len` are
/// mapped device memory (or memory the device can reach), valid until the copy completes.
#[doc(alias = "cuMemcpyDtoDAsync")]
pub(crate) unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuMemcpyDtoDAsync_v2(dst, src, len, stream)) }
}
