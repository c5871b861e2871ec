//! Streams: synchronise and query, the 64-bit stream memory operations (counter fences),
//! and the asynchronous copies and memsets every access to device memory is.
//!
//! See the parent module for the safety contract every function here keeps.

use super::*;

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
