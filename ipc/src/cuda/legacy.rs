//! Legacy CUDA IPC: memory from `cuMemAlloc_v2`, shared as a 64-byte `cuIpcGetMemHandle`,
//! mapped by importers with `cuIpcOpenMemHandle_v2`.
//!
//! # Safety
//!
//! [`DeviceAlloc`] owns one `cuMemAlloc_v2` allocation and [`IpcMapping`] one
//! `cuIpcOpenMemHandle_v2` mapping; each releases it exactly once (an explicit `free`/
//! `close`, or `Drop`), with its context pushed ([`ContextGuard`]), and holds a
//! [`SharedContext`] so the context outlives it. Their pointers are valid device memory for
//! `size` bytes until then.

use super::context::ContextGuard;
use super::{SharedContext, result};
use crate::Result;
use cudarc::driver::sys;
use std::sync::Arc;

/// One `cuMemAlloc_v2` allocation.
pub(crate) struct DeviceAlloc {
    ctx: SharedContext,
    ptr: sys::CUdeviceptr,
    size: usize,
    live: bool,
}

impl DeviceAlloc {
    /// `cuMemAlloc_v2(size)` in `ctx`.
    pub(crate) fn new(ctx: &SharedContext, size: usize) -> Result<Self> {
        let _pushed = ContextGuard::push(ctx)?;
        // SAFETY: the context is current; the allocation is owned by the `DeviceAlloc`
        // returned, which frees it once.
        let ptr = unsafe { result::mem_alloc(size) }?;
        Ok(Self {
            ctx: Arc::clone(ctx),
            ptr,
            size,
            live: true,
        })
    }

    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// `cuIpcGetMemHandle` of the allocation.
    pub(crate) fn ipc_handle(&self) -> Result<[u8; 64]> {
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the context is current; `ptr` is the base of our live allocation.
        unsafe { result::ipc_get_mem_handle(self.ptr) }
    }

    /// Frees the memory (once; later calls do nothing).
    pub(crate) fn free(&mut self) -> Result<()> {
        if !self.live {
            return Ok(());
        }
        self.live = false;
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: our allocation, still live (checked above), freed once; the context is
        // current; the owner guarantees no one uses it afterwards.
        unsafe { result::mem_free(self.ptr) }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if let Err(e) = self.free() {
            tracing::warn!(error = %e, size = self.size, "freeing CUDA device memory failed");
        }
    }
}

/// One `cuIpcOpenMemHandle_v2` mapping of another process's allocation.
pub(crate) struct IpcMapping {
    ctx: SharedContext,
    ptr: sys::CUdeviceptr,
    live: bool,
}

impl IpcMapping {
    /// Opens `handle` in `ctx`, with lazy peer access (for memory of another device).
    pub(crate) fn open(ctx: &SharedContext, handle: &[u8; 64]) -> Result<Self> {
        let _pushed = ContextGuard::push(ctx)?;
        // SAFETY: the context is current; the handle was sealed and checked by the caller
        // (`CheckedHandle`); the mapping is owned by the `IpcMapping` returned.
        let ptr = unsafe { result::ipc_open_mem_handle(handle) }?;
        Ok(Self {
            ctx: Arc::clone(ctx),
            ptr,
            live: true,
        })
    }

    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Bytes of the allocation behind the mapping, as the driver reports them
    /// (`cuMemGetAddressRange_v2`).
    pub(crate) fn mapped_size(&self) -> Result<usize> {
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the context is current; a query about our live mapping.
        let (_base, size) = unsafe { result::mem_get_address_range(self.ptr) }?;
        Ok(size)
    }

    /// Closes the mapping (once; later calls do nothing).
    pub(crate) fn close(&mut self) -> Result<()> {
        if !self.live {
            return Ok(());
        }
        self.live = false;
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: our live mapping (checked above), opened in this context (current), closed once;
        // the owner guarantees no one uses it afterwards.
        unsafe { result::ipc_close_mem_handle(self.ptr) }
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!(error = %e, "closing a CUDA IPC mapping failed");
        }
    }
}
