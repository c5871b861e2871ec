//! Context discipline: every driver call of the backend runs with the backend's context
//! pushed on the calling thread's context stack (`cuCtxPushCurrent_v2`) and popped after
//! (`cuCtxPopCurrent_v2`), so a caller's current context is the same before and after any
//! call into Baton, `Drop`s included.
//!
//! - [`ContextGuard`] pushes a context and pops it when it drops: the shape of every driver
//!   call path here.
//! - cudarc's safe types bind their context with `cuCtxSetCurrent` (creating a context or a
//!   stream, destroying them) and leave it bound. [`KeepCurrent`] remembers the current
//!   context and puts it back, around such calls, and [`Quiet`] wraps a cudarc value so
//!   that dropping it does the same.
//!
//! # Safety
//!
//! A [`ContextGuard`] borrows the context it pushed, so the context outlives the push; it
//! is neither `Send` nor `Sync`, so it pops on the thread that pushed. [`KeepCurrent`]
//! restores a context that was current when it was made: a context cannot be destroyed
//! while current on a thread through Baton (Baton only releases primary contexts, which
//! the driver keeps while any thread uses them), and a null context is always valid.

use super::result;
use crate::Result;
use cudarc::driver::{CudaContext, sys};
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::Deref;

/// `ctx` pushed on this thread's context stack until the guard drops.
#[must_use = "the context is popped when the guard drops"]
pub(crate) struct ContextGuard<'a> {
    raw: sys::CUcontext,
    /// Borrows the context (it outlives the push) and makes the guard `!Send`/`!Sync`.
    _ctx: PhantomData<(&'a CudaContext, *const ())>,
}

impl<'a> ContextGuard<'a> {
    /// `cuCtxPushCurrent_v2(ctx)`.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda).
    #[doc(alias = "cuCtxPushCurrent")]
    pub(crate) fn push(ctx: &'a CudaContext) -> Result<Self> {
        let raw = ctx.cu_ctx();
        // SAFETY: `raw` is cudarc's live context, borrowed for the guard's life.
        unsafe { result::ctx_push_current(raw) }?;
        Ok(Self {
            raw,
            _ctx: PhantomData,
        })
    }
}

impl Drop for ContextGuard<'_> {
    /// `cuCtxPopCurrent_v2`: the thread's current context is what it was before the push.
    fn drop(&mut self) {
        // SAFETY: we pushed a context on this thread (the guard is `!Send`).
        match unsafe { result::ctx_pop_current() } {
            Ok(popped) if popped == self.raw => {}
            Ok(_) => tracing::warn!(
                "popped a CUDA context other than the one Baton pushed: something pushed without popping"
            ),
            Err(e) => tracing::warn!(error = %e, "popping Baton's CUDA context failed"),
        }
    }
}

/// Remembers this thread's current context and makes it current again when dropped, if
/// something in between (cudarc) changed it.
pub(crate) struct KeepCurrent {
    saved: sys::CUcontext,
    _not_send: PhantomData<*const ()>,
}

impl KeepCurrent {
    /// `cuCtxGetCurrent`.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda).
    #[doc(alias = "cuCtxGetCurrent")]
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: a query; the driver is initialised (every path here starts from a probe).
        let saved = unsafe { result::ctx_get_current() }?;
        Ok(Self {
            saved,
            _not_send: PhantomData,
        })
    }
}

impl Drop for KeepCurrent {
    /// `cuCtxGetCurrent`, then `cuCtxSetCurrent(saved)` if it differs.
    fn drop(&mut self) {
        // SAFETY: a query.
        match unsafe { result::ctx_get_current() } {
            Ok(now) if now == self.saved => {}
            // SAFETY: `saved` was current on this thread when we were made, and is null or
            // a context that is still alive (module docs).
            Ok(_) => match unsafe { result::ctx_set_current(self.saved) } {
                Ok(()) => {}
                Err(e) => tracing::warn!(error = %e, "restoring the caller's CUDA context failed"),
            },
            Err(e) => tracing::warn!(error = %e, "reading the current CUDA context failed"),
        }
    }
}

/// A cudarc value whose `Drop` may bind its context (`Arc<CudaContext>`,
/// `Arc<CudaStream>`): dropping the wrapper puts the caller's current context back after.
pub(crate) struct Quiet<T>(ManuallyDrop<T>);

impl<T> Quiet<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(ManuallyDrop::new(value))
    }
}

impl<T> Deref for Quiet<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> Drop for Quiet<T> {
    fn drop(&mut self) {
        let keep = KeepCurrent::new();
        // SAFETY: dropped once, here; `self.0` is never used again.
        unsafe { ManuallyDrop::drop(&mut self.0) };
        drop(keep);
    }
}
