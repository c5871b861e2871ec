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

// The calls, grouped by what they act on as cudarc's `result` groups them (one file each),
// and used from here as one flat namespace (`result::event_record`).
mod device;
mod event;
mod memory;
mod pool;
mod stream;
mod vmm;

pub(crate) use device::*;
pub(crate) use event::*;
pub(crate) use memory::*;
pub(crate) use pool::*;
pub(crate) use stream::*;
pub(crate) use vmm::*;

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
