//! The CUDA driver entry points Baton calls, resolved by their versioned names from the
//! driver library cudarc loaded, and declared to return the raw `CUresult` integer.
//!
//! Why not cudarc's `driver::sys` functions: they return `CUresult` as a Rust enum
//! generated from one version of `cuda.h`. A newer driver may return a code that enum lacks
//! (CUDA 12 and 13 added several), and a value outside a Rust enum's variants is undefined
//! behaviour the moment the call returns it, before any conversion could look at it. Here
//! every entry point returns [`RawResult`] (`c_int`), so every code the driver returns is a
//! valid value, kept as a number ([`super::CudaError`]).
//!
//! Symbols are looked up by the exact versioned names `cuda.h` maps the API names to
//! (`cuMemAlloc_v2`, `cuIpcOpenMemHandle_v2`, `cuCtxPushCurrent_v2`, …), without the
//! per-thread-default-stream variants (`_ptsz`): Baton always names its streams. The table
//! is loaded once, by [`super::probe`]; a driver that lacks a required symbol is reported as
//! [`Error::BackendUnavailable`](crate::Error::BackendUnavailable) then, never at a call.
//!
//! # Safety
//!
//! Each field's type is the C prototype of its symbol in `cuda.h` (CUDA 11.4 through 13),
//! with `CUresult` and enum parameters as `c_int`/`c_uint`: a C enum whose values all fit
//! in an `int` has the size, alignment and calling convention of `int` (or `unsigned int`,
//! whose bits are the same for the non-negative codes the driver returns) in the C ABIs of
//! the Linux targets the driver ships for (x86-64 System V, AArch64 AAPCS64), and `CUDAAPI`
//! is empty on Linux, so `extern "C"` is the convention. Pointer and struct parameters use cudarc's `#[repr(C)]` bindings of the same
//! structs. The library stays loaded for the life of the process (cudarc keeps it in a
//! `static`), so the function pointers never dangle.

use crate::{Error, Result};
use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUipcEventHandle, CUipcMemHandle,
    CUmemAccessDesc, CUmemAllocationProp, CUmemGenericAllocationHandle, CUmemPoolProps,
    CUmemPoolPtrExportData, CUmemoryPool, CUmodule, CUstream, CUuuid,
};
use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_void};
use std::sync::OnceLock;

/// A `CUresult` as the driver returns it: `0` is `CUDA_SUCCESS`.
pub(crate) type RawResult = c_int;

/// `cuStreamWaitValue64` / `cuStreamWriteValue64` (both versions have this prototype).
pub(crate) type StreamValue64Fn =
    unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> RawResult;

macro_rules! driver_api {
    (
        required { $($field:ident = $sym:literal : fn($($arg:ty),* $(,)?);)* }
        optional { $($ofield:ident = $osym:literal : fn($($oarg:ty),* $(,)?);)* }
    ) => {
        /// The driver's entry points, by versioned symbol name.
        #[allow(non_snake_case)]
        pub(crate) struct Api {
            $(
                #[doc = concat!("`", $sym, "`")]
                pub(crate) $field: unsafe extern "C" fn($($arg),*) -> RawResult,
            )*
            $(
                #[doc = concat!("`", $osym, "`, where the driver has it")]
                pub(crate) $ofield: Option<unsafe extern "C" fn($($oarg),*) -> RawResult>,
            )*
        }

        impl Api {
            /// Every symbol named above, from the driver library.
            ///
            /// # Safety
            /// The driver library must be present (`sys::is_culib_present`): cudarc's
            /// loader panics otherwise.
            unsafe fn load() -> std::result::Result<Api, String> {
                // SAFETY: the library is present (the caller's promise); cudarc keeps it
                // loaded for the process's life.
                let lib = unsafe { cudarc::driver::sys::culib() };
                Ok(Api {
                    $(
                        // SAFETY: the declared type is the symbol's C prototype (module
                        // docs); the pointer is copied out of a library that stays loaded.
                        $field: unsafe {
                            *lib.get::<unsafe extern "C" fn($($arg),*) -> RawResult>($sym)
                                .map_err(|_| format!(
                                    "the NVIDIA driver library has no {}: it is older than CUDA 11.4, update the driver",
                                    $sym
                                ))?
                        },
                    )*
                    $(
                        // SAFETY: as above.
                        $ofield: unsafe {
                            lib.get::<unsafe extern "C" fn($($oarg),*) -> RawResult>($osym)
                                .ok()
                                .map(|s| *s)
                        },
                    )*
                })
            }
        }
    };
}

driver_api! {
    required {
        cuInit = "cuInit": fn(c_uint);
        cuDeviceGetCount = "cuDeviceGetCount": fn(*mut c_int);
        cuDeviceGet = "cuDeviceGet": fn(*mut CUdevice, c_int);
        cuDeviceGetUuid_v2 = "cuDeviceGetUuid_v2": fn(*mut CUuuid, CUdevice);
        cuDeviceGetAttribute = "cuDeviceGetAttribute": fn(*mut c_int, c_int, CUdevice);
        cuDeviceCanAccessPeer = "cuDeviceCanAccessPeer": fn(*mut c_int, CUdevice, CUdevice);
        cuCtxGetCurrent = "cuCtxGetCurrent": fn(*mut CUcontext);
        cuCtxSetCurrent = "cuCtxSetCurrent": fn(CUcontext);
        cuCtxPushCurrent_v2 = "cuCtxPushCurrent_v2": fn(CUcontext);
        cuCtxPopCurrent_v2 = "cuCtxPopCurrent_v2": fn(*mut CUcontext);
        cuMemGetInfo_v2 = "cuMemGetInfo_v2": fn(*mut usize, *mut usize);
        cuMemAlloc_v2 = "cuMemAlloc_v2": fn(*mut CUdeviceptr, usize);
        cuMemFree_v2 = "cuMemFree_v2": fn(CUdeviceptr);
        cuMemGetAddressRange_v2 = "cuMemGetAddressRange_v2":
            fn(*mut CUdeviceptr, *mut usize, CUdeviceptr);
        cuIpcGetMemHandle = "cuIpcGetMemHandle": fn(*mut CUipcMemHandle, CUdeviceptr);
        cuPointerGetAttribute = "cuPointerGetAttribute": fn(*mut c_void, c_int, CUdeviceptr);
        cuIpcOpenMemHandle_v2 = "cuIpcOpenMemHandle_v2":
            fn(*mut CUdeviceptr, CUipcMemHandle, c_uint);
        cuIpcCloseMemHandle = "cuIpcCloseMemHandle": fn(CUdeviceptr);
        cuMemGetAllocationGranularity = "cuMemGetAllocationGranularity":
            fn(*mut usize, *const CUmemAllocationProp, c_int);
        cuMemCreate = "cuMemCreate": fn(
            *mut CUmemGenericAllocationHandle,
            usize,
            *const CUmemAllocationProp,
            c_ulonglong,
        );
        cuMemRelease = "cuMemRelease": fn(CUmemGenericAllocationHandle);
        cuMemAddressReserve = "cuMemAddressReserve":
            fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, c_ulonglong);
        cuMemAddressFree = "cuMemAddressFree": fn(CUdeviceptr, usize);
        cuMemMap = "cuMemMap":
            fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, c_ulonglong);
        cuMemUnmap = "cuMemUnmap": fn(CUdeviceptr, usize);
        cuMemSetAccess = "cuMemSetAccess":
            fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize);
        cuMemExportToShareableHandle = "cuMemExportToShareableHandle":
            fn(*mut c_void, CUmemGenericAllocationHandle, c_int, c_ulonglong);
        cuMemImportFromShareableHandle = "cuMemImportFromShareableHandle":
            fn(*mut CUmemGenericAllocationHandle, *mut c_void, c_int);
        cuEventCreate = "cuEventCreate": fn(*mut CUevent, c_uint);
        cuEventDestroy_v2 = "cuEventDestroy_v2": fn(CUevent);
        cuIpcGetEventHandle = "cuIpcGetEventHandle": fn(*mut CUipcEventHandle, CUevent);
        cuIpcOpenEventHandle = "cuIpcOpenEventHandle": fn(*mut CUevent, CUipcEventHandle);
        cuEventRecord = "cuEventRecord": fn(CUevent, CUstream);
        cuEventQuery = "cuEventQuery": fn(CUevent);
        cuEventSynchronize = "cuEventSynchronize": fn(CUevent);
        cuStreamWaitEvent = "cuStreamWaitEvent": fn(CUstream, CUevent, c_uint);
        cuStreamSynchronize = "cuStreamSynchronize": fn(CUstream);
        cuStreamQuery = "cuStreamQuery": fn(CUstream);
        cuMemcpyDtoHAsync_v2 = "cuMemcpyDtoHAsync_v2":
            fn(*mut c_void, CUdeviceptr, usize, CUstream);
        cuMemcpyHtoDAsync_v2 = "cuMemcpyHtoDAsync_v2":
            fn(CUdeviceptr, *const c_void, usize, CUstream);
        cuMemsetD8Async = "cuMemsetD8Async": fn(CUdeviceptr, c_uchar, usize, CUstream);
        cuMemcpyDtoDAsync_v2 = "cuMemcpyDtoDAsync_v2":
            fn(CUdeviceptr, CUdeviceptr, usize, CUstream);
        cuModuleLoadData = "cuModuleLoadData": fn(*mut CUmodule, *const c_void);
        cuModuleUnload = "cuModuleUnload": fn(CUmodule);
        cuModuleGetFunction = "cuModuleGetFunction":
            fn(*mut CUfunction, CUmodule, *const c_char);
        cuLaunchKernel = "cuLaunchKernel": fn(
            CUfunction,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            CUstream,
            *mut *mut c_void,
            *mut *mut c_void,
        );
        cuMemPoolCreate = "cuMemPoolCreate": fn(*mut CUmemoryPool, *const CUmemPoolProps);
        cuMemPoolDestroy = "cuMemPoolDestroy": fn(CUmemoryPool);
        cuMemPoolSetAttribute = "cuMemPoolSetAttribute": fn(CUmemoryPool, c_int, *mut c_void);
        cuMemPoolTrimTo = "cuMemPoolTrimTo": fn(CUmemoryPool, usize);
        cuMemPoolExportToShareableHandle = "cuMemPoolExportToShareableHandle":
            fn(*mut c_void, CUmemoryPool, c_int, c_ulonglong);
        cuMemPoolImportFromShareableHandle = "cuMemPoolImportFromShareableHandle":
            fn(*mut CUmemoryPool, *mut c_void, c_int, c_ulonglong);
        cuMemPoolSetAccess = "cuMemPoolSetAccess":
            fn(CUmemoryPool, *const CUmemAccessDesc, usize);
        cuMemPoolExportPointer = "cuMemPoolExportPointer":
            fn(*mut CUmemPoolPtrExportData, CUdeviceptr);
        cuMemPoolImportPointer = "cuMemPoolImportPointer":
            fn(*mut CUdeviceptr, CUmemoryPool, *mut CUmemPoolPtrExportData);
        cuMemAllocFromPoolAsync = "cuMemAllocFromPoolAsync":
            fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream);
        cuMemFreeAsync = "cuMemFreeAsync": fn(CUdeviceptr, CUstream);
    }
    optional {
        // CUDA 11.7+: on by default (the v1 versions below need a kernel-module option).
        cuStreamWaitValue64_v2 = "cuStreamWaitValue64_v2":
            fn(CUstream, CUdeviceptr, u64, c_uint);
        cuStreamWriteValue64_v2 = "cuStreamWriteValue64_v2":
            fn(CUstream, CUdeviceptr, u64, c_uint);
        cuStreamWaitValue64 = "cuStreamWaitValue64": fn(CUstream, CUdeviceptr, u64, c_uint);
        cuStreamWriteValue64 = "cuStreamWriteValue64": fn(CUstream, CUdeviceptr, u64, c_uint);
    }
}

static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();

/// Loads the table (once per process) and reports why it cannot be used.
///
/// # Safety
/// The driver library must be present (`sys::is_culib_present`).
pub(crate) unsafe fn load() -> std::result::Result<&'static Api, String> {
    // SAFETY: the caller's promise.
    API.get_or_init(|| unsafe { Api::load() })
        .as_ref()
        .map_err(Clone::clone)
}

/// The loaded table. Every path to a driver call starts from a backend, which exists only
/// after [`super::probe`] loaded it; should one not, the call fails as
/// `CUDA_ERROR_NOT_INITIALIZED` instead of panicking.
pub(crate) fn api(op: &'static str) -> Result<&'static Api> {
    match API.get() {
        Some(Ok(api)) => Ok(api),
        _ => Err(Error::Cuda {
            op,
            code: super::CudaError::NOT_INITIALIZED,
        }),
    }
}
