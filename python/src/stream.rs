//! CUDA streams that Python names (torch's, CuPy's, or a raw `CUstream`), for
//! stream-ordered opens, sends and writes: Baton waits on its fences and records them on
//! the caller's stream instead of synchronising the device.
//!
//! # Safety
//!
//! Baton orders work on a stream it was given by keeping a wrapper of it (cudarc's
//! [`CudaContext::wrap_borrowed_stream`]) in the buffer's or lease's order, and records
//! fences on it later — when a lease goes back, when a buffer is shared again or freed. So
//! the stream must outlive every use Baton may make of it:
//!
//! - a stream *object* named here (torch's `torch.cuda.Stream`, CuPy's `cupy.cuda.Stream`)
//!   is kept alive by this module for the rest of the process ([`named`]), so its owner
//!   never destroys it under Baton (torch's streams come from a pool and are never
//!   destroyed anyway; a CuPy stream is destroyed when its object is collected);
//! - a raw handle (an `int`) is the caller's promise: it must stay a live stream of the
//!   device's primary context for the life of the process;
//! - every stream must belong to the device's primary context — the context Baton's
//!   CUDA backend, torch and CuPy all use.
//!
//! At most [`MAX_NAMED`] distinct streams may be named in a process: the list is bounded.
//!
//! [`CudaContext::wrap_borrowed_stream`]: baton_ipc::cuda::cudarc::driver::CudaContext::wrap_borrowed_stream

#![allow(unsafe_code)]

use crate::errors::{Failure, OrRaise};
use crate::runtime::lock;
use baton_ipc::Stream;
use baton_ipc::cuda::CudaBackend;
use baton_ipc::cuda::cudarc::driver::sys;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// The most distinct streams a process may name.
pub(crate) const MAX_NAMED: usize = 1024;

/// The stream objects named so far, by handle: kept for the life of the process.
fn kept() -> &'static Mutex<HashMap<usize, Py<PyAny>>> {
    static KEPT: OnceLock<Mutex<HashMap<usize, Py<PyAny>>>> = OnceLock::new();
    KEPT.get_or_init(Mutex::default)
}

/// The stream `obj` names — an object with `cuda_stream` (torch) or `ptr` (CuPy), or an
/// `int` handle — wrapped for `cuda`'s device (see the module docs for what it promises).
pub(crate) fn named(obj: &Bound<'_, PyAny>, cuda: &CudaBackend) -> PyResult<Stream> {
    let py = obj.py();
    let (handle, object) = if let Ok(h) = obj.getattr("cuda_stream") {
        (h.extract::<usize>()?, true)
    } else if let Ok(h) = obj.getattr("ptr") {
        (h.extract::<usize>()?, true)
    } else if let Ok(h) = obj.extract::<usize>() {
        (h, false)
    } else {
        return Err(Failure::Type(format!(
            "a stream is a torch.cuda.Stream, a cupy.cuda.Stream or an int CUstream handle, \
             not a {}",
            obj.get_type().name()?
        )))
        .or_raise(py);
    };
    if object {
        let mut kept = lock(kept());
        if !kept.contains_key(&handle) {
            if kept.len() >= MAX_NAMED {
                return Err(Failure::Value(format!(
                    "more than {MAX_NAMED} distinct streams named to Baton in this process: \
                     name a few long-lived streams"
                )))
                .or_raise(py);
            }
            kept.insert(handle, obj.clone().unbind());
        }
    }
    // SAFETY: the stream outlives every use Baton makes of the wrapper: an object's is
    // kept above for the life of the process, a raw handle's is the caller's documented
    // promise; it belongs to the primary context, which is `cuda.context()` (module docs).
    let stream = unsafe { cuda.context().wrap_borrowed_stream(handle as sys::CUstream) };
    Ok(Stream::Cuda(stream))
}
