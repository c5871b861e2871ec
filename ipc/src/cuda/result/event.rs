//! Events: local and interprocess, recorded, queried, waited for, and waited on by a
//! stream.
//!
//! See the parent module for the safety contract every function here keeps.

use super::*;

/// `cuEventCreate(CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// A context must be current; the caller must [`event_destroy`] the event once.
#[doc(alias = "cuEventCreate")]
pub(crate) unsafe fn event_create_interprocess() -> Result<sys::CUevent> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
    // SAFETY: `ev` is a valid out pointer.
    unsafe { call!(cuEventCreate(&mut ev, flags)) }?;
    Ok(ev)
}

/// `cuEventCreate(CU_EVENT_DISABLE_TIMING)`: an event of this process only.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// A context must be current; the caller must [`event_destroy`] the event once.
#[doc(alias = "cuEventCreate")]
pub(crate) unsafe fn event_create() -> Result<sys::CUevent> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: `ev` is a valid out pointer.
    unsafe { call!(cuEventCreate(&mut ev, flags)) }?;
    Ok(ev)
}

/// `cuEventDestroy_v2`. Safe to call while the event is still pending: the driver frees it
/// once it completes.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ev` is live and destroyed once; its context is current.
#[doc(alias = "cuEventDestroy")]
pub(crate) unsafe fn event_destroy(ev: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuEventDestroy_v2(ev)) }
}

/// `cuIpcGetEventHandle`: the 64 bytes another process opens the event with.
///
/// # Errors
/// [`Error::Cuda`] (the event was not made interprocess).
///
/// # Safety
/// `ev` is live.
#[doc(alias = "cuIpcGetEventHandle")]
pub(crate) unsafe fn ipc_get_event_handle(ev: sys::CUevent) -> Result<[u8; 64]> {
    let mut h = MaybeUninit::<sys::CUipcEventHandle>::zeroed();
    // SAFETY: `h` is a valid, writable handle struct.
    unsafe { call!(cuIpcGetEventHandle(h.as_mut_ptr(), ev)) }?;
    // SAFETY: zero-initialised, then written; any bytes are valid.
    let h = unsafe { h.assume_init() };
    Ok(h.reserved.map(|b| b as u8))
}

/// `cuIpcOpenEventHandle`: another process's interprocess event, in the current context.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// A context must be current; the caller must [`event_destroy`] the event once.
#[doc(alias = "cuIpcOpenEventHandle")]
pub(crate) unsafe fn ipc_open_event_handle(handle: &[u8; 64]) -> Result<sys::CUevent> {
    let raw = sys::CUipcEventHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: `ev` is a valid out pointer; the handle is passed by value.
    unsafe { call!(cuIpcOpenEventHandle(&mut ev, raw)) }?;
    Ok(ev)
}

/// `cuEventRecord`.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ev` and `stream` are live and of the current context.
#[doc(alias = "cuEventRecord")]
pub(crate) unsafe fn event_record(ev: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuEventRecord(ev, stream)) }
}

/// `cuEventQuery`: whether the work before the event's last record has completed.
///
/// # Errors
/// [`Error::Cuda`] (anything but success or `CUDA_ERROR_NOT_READY`).
///
/// # Safety
/// `ev` is live.
#[doc(alias = "cuEventQuery")]
pub(crate) unsafe fn event_query(ev: sys::CUevent) -> Result<bool> {
    // SAFETY: the caller's promise.
    match unsafe { call!(cuEventQuery(ev)) } {
        Ok(()) => Ok(true),
        Err(Error::Cuda { code, .. }) if code == CudaError::NOT_READY => Ok(false),
        Err(e) => Err(e),
    }
}

/// `cuEventSynchronize`: blocks until the event's last record has completed.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `ev` is live.
#[doc(alias = "cuEventSynchronize")]
pub(crate) unsafe fn event_synchronize(ev: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuEventSynchronize(ev)) }
}

/// `cuStreamWaitEvent`: later work on `stream` waits for the event's last record.
///
/// # Errors
/// [`Error::Cuda`].
///
/// # Safety
/// `stream` is live in the current context; `ev` is live.
#[doc(alias = "cuStreamWaitEvent")]
pub(crate) unsafe fn stream_wait_event(stream: sys::CUstream, ev: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { call!(cuStreamWaitEvent(stream, ev, 0)) }
}
