//! Thin `Result` wrappers over the driver calls Baton makes, one per call, each named after
//! it. No ownership here: the RAII types in the sibling modules own what these functions
//! make. This file holds the error type, the checking every call shares and the helpers
//! several groups use; the calls live in `result/` by what they act on (`device`,
//! `memory`, `vmm`, `pool`, `event`, `stream`), re-exported here as one namespace.
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

pub use crate::error::CudaError;

/// Turns a raw result into `Ok` or [`Error::Cuda`] naming `op`. Every call through the
/// driver table comes here, so `RUST_LOG=baton_ipc::cuda::calls=trace` lists each driver call
/// Baton makes, by name, with its result code (no arguments: they may be handle bytes).
pub(crate) fn check(op: &'static str, code: RawResult) -> Result<()> {
    tracing::trace!(target: "baton_ipc::cuda::calls", op, code);
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

/// The location of device `dev`.
fn device_location(dev: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    }
}

/// Read-write access for device `dev`.
fn read_write_access(dev: sys::CUdevice) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: device_location(dev),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// Wraps a descriptor the driver just wrote through an `int` out pointer, and marks it
/// close-on-exec.
///
/// The driver opens an export's descriptor without `O_CLOEXEC`: a child this process
/// spawned later (a helper, a worker, any `Command`) would inherit it and hold the pool or
/// the physical allocation it names for as long as it lives — the device never got a
/// retired pool's memory back while such a child ran (issue 46). Marked here, at once,
/// only a fork in the instant between the export and this call can still inherit it.
fn owned_fd(op: &'static str, fd: c_int) -> Result<OwnedFd> {
    if fd < 0 {
        return Err(Error::Cuda {
            op,
            code: CudaError::INVALID_HANDLE,
        });
    }
    // SAFETY: the driver just opened `fd` for us (a successful export); nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let cloexec = rustix::io::fcntl_getfd(&fd)
        .and_then(|flags| rustix::io::fcntl_setfd(&fd, flags | rustix::io::FdFlags::CLOEXEC));
    cloexec.map_err(|e| Error::Io {
        op: "marking an export's descriptor close-on-exec",
        source: e.into(),
    })?;
    Ok(fd)
}

// The calls, grouped by what they act on as cudarc's `result` groups them (one file each),
// and used from here as one flat namespace (`result::event_record`).
mod device;
mod event;
mod memory;
mod module;
mod pool;
mod stream;
mod vmm;

pub(crate) use device::*;
pub(crate) use event::*;
pub(crate) use memory::*;
pub(crate) use module::*;
pub(crate) use pool::*;
pub(crate) use stream::*;
pub(crate) use vmm::*;

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
