//! DLPack capsules: the structures of `dlpack.h` (v1.0, written out here rather than taken
//! from a crate: they are a few `repr(C)` structs, and the crates that wrap them either
//! pull in a tensor library or are not maintained), and the capsule that hands one to a
//! consumer.
//!
//! A capsule named `dltensor` holds a `DLManagedTensor` (DLPack before 1.0), one named
//! `dltensor_versioned` a `DLManagedTensorVersioned` (1.0, with flags: read-only). The
//! consumer renames the capsule to `used_dltensor[_versioned]` when it takes the tensor
//! over, and calls the tensor's `deleter` when it is done with the memory; a capsule
//! collected before any consumer took it calls the deleter itself.
//!
//! # Safety
//!
//! The `unsafe` code here is FFI with the Python C API and with DLPack consumers:
//! - the managed tensor is a `Box` leaked into the capsule; its `manager_ctx` points at that
//!   same allocation, and its deleter turns it back into a `Box` and drops it exactly once:
//!   either the consumer calls it (after renaming the capsule, so the capsule's destructor
//!   does not), or the capsule's destructor does (the capsule still bears its first name:
//!   nobody took it). The `shape` array the tensor points into lives in the same box;
//! - the deleter may run on any thread, with or without the GIL (a consumer's tensor is
//!   freed by its library): it touches no Python object, only the guard the capsule was
//!   made with, which is `Send` and whose drop needs no GIL (the caller's guarantee: see
//!   [`capsule`]);
//! - the capsule destructor runs with the GIL held (CPython calls it when the capsule is
//!   collected) and only checks the capsule's name and reads its pointer;
//! - the memory the tensor points at stays mapped while the guard lives (the caller's
//!   guarantee: `memory`'s views guard their memory so).
//!
//! This module knows nothing of Baton's buffers: it takes the guard as a type parameter,
//! so the views (`memory`) use it and it uses nothing of theirs.

#![allow(unsafe_code)]

use baton_messages::DType;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{CStr, c_void};

const NAME: &CStr = c"dltensor";
const NAME_VERSIONED: &CStr = c"dltensor_versioned";

/// `DLPACK_FLAG_BITMASK_READ_ONLY`.
const FLAG_READ_ONLY: u64 = 1;

/// `DLDevice`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
#[derive(Debug)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (DLPack before 1.0).
#[repr(C)]
#[derive(Debug)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

/// `DLManagedTensorVersioned` (DLPack 1.0).
#[repr(C)]
#[derive(Debug)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// What a capsule describes.
#[derive(Debug, Clone)]
pub(crate) struct TensorSpec {
    /// Host address or device pointer.
    pub(crate) data: u64,
    /// DLPack `(device_type, device_id)`.
    pub(crate) device: (i32, i32),
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<i64>,
    pub(crate) read_only: bool,
}

fn dl_dtype(d: DType) -> DLDataType {
    // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4.
    let code = match d {
        DType::I8 | DType::I16 | DType::I32 | DType::I64 => 0,
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => 1,
        DType::BF16 => 4,
        _ => 2,
    };
    DLDataType {
        code,
        bits: (d.size() * 8) as u8,
        lanes: 1,
    }
}

/// A managed tensor and what it owns: the shape it points into and the guard `G` that
/// keeps its memory mapped. `#[repr(C)]` with the tensor first, so that a pointer to the
/// tensor is a pointer to the whole.
#[repr(C)]
struct Managed<M, G> {
    tensor: M,
    shape: Vec<i64>,
    _guard: G,
}

fn dl_tensor(spec: &TensorSpec, shape: &mut [i64]) -> DLTensor {
    DLTensor {
        data: spec.data as *mut c_void,
        device: DLDevice {
            device_type: spec.device.0,
            device_id: spec.device.1,
        },
        ndim: shape.len() as i32,
        dtype: dl_dtype(spec.dtype),
        shape: shape.as_mut_ptr(),
        // NULL: compact row-major.
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

unsafe extern "C" fn delete_legacy<G>(tensor: *mut DLManagedTensor) {
    if tensor.is_null() {
        return;
    }
    // SAFETY: `tensor` is the first field of a leaked `Box<Managed<DLManagedTensor, G>>`
    // (`repr(C)`; `capsule::<G>` stored this deleter with it), and DLPack's contract is
    // that the deleter is called once.
    drop(unsafe { Box::from_raw(tensor.cast::<Managed<DLManagedTensor, G>>()) });
}

unsafe extern "C" fn delete_versioned<G>(tensor: *mut DLManagedTensorVersioned) {
    if tensor.is_null() {
        return;
    }
    // SAFETY: as in `delete_legacy`, for `Managed<DLManagedTensorVersioned, G>`.
    drop(unsafe { Box::from_raw(tensor.cast::<Managed<DLManagedTensorVersioned, G>>()) });
}

/// Deletes the tensor of a capsule no consumer took (one made by `capsule::<G>`).
unsafe extern "C" fn capsule_destructor<G>(capsule: *mut ffi::PyObject) {
    for (name, versioned) in [(NAME, false), (NAME_VERSIONED, true)] {
        // SAFETY: CPython calls this with the GIL held and a valid capsule;
        // `PyCapsule_IsValid` sets no exception.
        if unsafe { ffi::PyCapsule_IsValid(capsule, name.as_ptr()) } != 1 {
            continue;
        }
        // A capsule still bearing its first name was not taken: its tensor is ours to
        // delete. A renamed one (`used_…`) belongs to its consumer.
        // SAFETY: as above; the name matches, so this returns the capsule's pointer.
        let tensor = unsafe { ffi::PyCapsule_GetPointer(capsule, name.as_ptr()) };
        if versioned {
            // SAFETY: the pointer `capsule::<G>()` stored under this name, deleted once here.
            unsafe { delete_versioned::<G>(tensor.cast()) };
        } else {
            // SAFETY: as above.
            unsafe { delete_legacy::<G>(tensor.cast()) };
        }
        return;
    }
}

/// A capsule holding a managed tensor of `spec`, whose deleter drops `guard`: versioned
/// (DLPack 1.0, with the read-only flag) or not.
///
/// `guard` must keep the memory at `spec.data` valid while it lives, and its drop must be
/// safe on any thread without the GIL (the deleter's: see the module docs).
pub(crate) fn capsule<'py, G: Send + 'static>(
    py: Python<'py>,
    spec: TensorSpec,
    guard: G,
    versioned: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let (ptr, name): (*mut c_void, &CStr) = if versioned {
        let mut managed = Box::new(Managed {
            tensor: DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 0 },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned::<G>),
                flags: if spec.read_only { FLAG_READ_ONLY } else { 0 },
                dl_tensor: dl_tensor(&spec, &mut []),
            },
            shape: spec.shape.clone(),
            _guard: guard,
        });
        // The shape lives in the box, at an address that does not move with it.
        managed.tensor.dl_tensor = dl_tensor(&spec, &mut managed.shape);
        let raw = Box::into_raw(managed);
        // SAFETY: `raw` is the live allocation just leaked.
        unsafe { (*raw).tensor.manager_ctx = raw.cast() };
        (raw.cast(), NAME_VERSIONED)
    } else {
        let mut managed = Box::new(Managed {
            tensor: DLManagedTensor {
                dl_tensor: dl_tensor(&spec, &mut []),
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy::<G>),
            },
            shape: spec.shape.clone(),
            _guard: guard,
        });
        managed.tensor.dl_tensor = dl_tensor(&spec, &mut managed.shape);
        let raw = Box::into_raw(managed);
        // SAFETY: `raw` is the live allocation just leaked.
        unsafe { (*raw).tensor.manager_ctx = raw.cast() };
        (raw.cast(), NAME)
    };
    // SAFETY: `ptr` is a valid managed tensor, `name` a static C string, the destructor
    // has the signature CPython expects. On failure the capsule does not exist and the
    // tensor is still ours: it is deleted below.
    let capsule = unsafe { ffi::PyCapsule_New(ptr, name.as_ptr(), Some(capsule_destructor::<G>)) };
    if capsule.is_null() {
        if versioned {
            // SAFETY: no capsule took `ptr`; it is deleted once, here.
            unsafe { delete_versioned::<G>(ptr.cast()) };
        } else {
            // SAFETY: as above.
            unsafe { delete_legacy::<G>(ptr.cast()) };
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `capsule` is a new, owned reference.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}
