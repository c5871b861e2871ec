//! CUDA virtual memory management (VMM): physical memory from `cuMemCreate` that can be
//! exported as a POSIX file descriptor, mapped into a reserved address range.
//!
//! Exporter: create (granularity-rounded), reserve, map, grant access, export the fd.
//! Importer: import the fd, reserve, map, grant access. Both release in the reverse order:
//! unmap, free the address range, release the physical handle.
//!
//! # Safety
//!
//! A [`VmmRegion`] owns one physical allocation handle, one reserved address range and the
//! mapping of the one into the other, and records which of the three exist, so that
//! [`VmmRegion::release`] (called at most once per resource, also from `Drop` and on a
//! failed construction) undoes exactly what was done, in order, with its context pushed. It
//! holds a [`SharedContext`] of that context. While mapped, `ptr..ptr + size` is valid device memory
//! with read-write access for the region's device.

use super::context::ContextGuard;
use super::{SharedContext, result};
use crate::Result;
use cudarc::driver::sys;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

/// `size` rounded up to a multiple of `granularity` (a power of two in practice, but any
/// non-zero value works). `None` on overflow.
pub(crate) fn round_up(size: usize, granularity: usize) -> Option<usize> {
    let g = granularity.max(1);
    size.checked_add(g - 1).map(|s| s / g * g)
}

/// One VMM allocation mapped into this process.
pub(crate) struct VmmRegion {
    ctx: SharedContext,
    size: usize,
    /// The physical allocation, while held.
    phys: Option<sys::CUmemGenericAllocationHandle>,
    /// The reserved address range's start, while reserved (0: none).
    va: sys::CUdeviceptr,
    /// Whether `phys` is mapped at `va`.
    mapped: bool,
}

impl VmmRegion {
    fn empty(ctx: &SharedContext, size: usize) -> Self {
        Self {
            ctx: Arc::clone(ctx),
            size,
            phys: None,
            va: 0,
            mapped: false,
        }
    }

    /// Exporter: `cuMemCreate` of `size` bytes (a multiple of `granularity`) on `dev`,
    /// shareable as a POSIX fd, then reserve, map and grant `dev` read-write access.
    pub(crate) fn create(
        ctx: &SharedContext,
        dev: sys::CUdevice,
        size: usize,
        granularity: usize,
    ) -> Result<Self> {
        let mut region = Self::empty(ctx, size);
        let _pushed = ContextGuard::push(ctx)?;
        let prop = result::vmm_prop(dev);
        // SAFETY: the context is current; the handle is stored in `region` at once, whose
        // `release` (or `Drop`) releases it once.
        region.phys = Some(unsafe { result::mem_create(size, &prop) }?);
        region.map_and_grant(dev, granularity)?;
        Ok(region)
    }

    /// Importer: `cuMemImportFromShareableHandle` of `fd`, then reserve `size` bytes
    /// (the exporter's rounded size), map and grant `dev` read-write access. The caller
    /// may close `fd` afterwards.
    pub(crate) fn import(
        ctx: &SharedContext,
        dev: sys::CUdevice,
        fd: BorrowedFd<'_>,
        size: usize,
        granularity: usize,
    ) -> Result<Self> {
        let mut region = Self::empty(ctx, size);
        let _pushed = ContextGuard::push(ctx)?;
        // SAFETY: the context is current; the handle is stored in `region` at once.
        region.phys = Some(unsafe { result::mem_import_fd(fd) }?);
        region.map_and_grant(dev, granularity)?;
        Ok(region)
    }

    /// Reserve, map, grant access, with the context pushed by the caller. On error `self`
    /// records what exists; its `Drop` undoes it.
    fn map_and_grant(&mut self, dev: sys::CUdevice, granularity: usize) -> Result<()> {
        let phys = self.phys.expect("created or imported first");
        // SAFETY: the context is current (pushed by the caller); the range is stored in `self.va`
        // at once and freed once by `release`.
        self.va = unsafe { result::mem_address_reserve(self.size, granularity) }?;
        // SAFETY: `va..va + size` is our reserved range and `phys` our live handle; the
        // driver refuses (and maps nothing) if `phys` is smaller than `size`.
        unsafe { result::mem_map(self.va, self.size, phys) }?;
        self.mapped = true;
        // SAFETY: `va..va + size` is mapped (just above).
        unsafe { result::mem_set_access(self.va, self.size, dev) }
    }

    /// The mapped address.
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.va
    }

    /// Bytes mapped.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// `cuMemExportToShareableHandle`: a new descriptor for the physical allocation.
    pub(crate) fn export_fd(&self) -> Result<OwnedFd> {
        let phys = self.phys.expect("live region");
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: `phys` is our live handle, made shareable as a POSIX fd.
        unsafe { result::mem_export_fd(phys) }
    }

    /// Unmaps, frees the address range and releases the physical handle — each only if it
    /// exists, each once — and reports the first failure.
    pub(crate) fn release(&mut self) -> Result<()> {
        if self.phys.is_none() && self.va == 0 {
            return Ok(());
        }
        let ctx = Arc::clone(&self.ctx);
        let _pushed = ContextGuard::push(&ctx)?;
        let mut first: Result<()> = Ok(());
        if self.mapped {
            self.mapped = false;
            // SAFETY: our mapping of `size` bytes at `va`; the owner guarantees no one uses
            // it afterwards.
            first = first.and(unsafe { result::mem_unmap(self.va, self.size) });
        }
        if self.va != 0 {
            let va = std::mem::take(&mut self.va);
            // SAFETY: our reserved range, nothing mapped in it any more.
            first = first.and(unsafe { result::mem_address_free(va, self.size) });
        }
        if let Some(phys) = self.phys.take() {
            // SAFETY: our handle, released once (taken out of `self.phys`). The physical
            // memory goes when no process maps or holds it any more.
            first = first.and(unsafe { result::mem_release(phys) });
        }
        first
    }
}

impl Drop for VmmRegion {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            tracing::warn!(error = %e, size = self.size, "releasing CUDA VMM memory failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::round_up;

    #[test]
    fn sizes_round_up_to_the_granularity() {
        const G: usize = 2 << 20;
        assert_eq!(round_up(1, G), Some(G));
        assert_eq!(round_up(G, G), Some(G));
        assert_eq!(round_up(G + 1, G), Some(2 * G));
        assert_eq!(round_up(256 << 20, G), Some(256 << 20));
        assert_eq!(round_up(usize::MAX, G), None);
        assert_eq!(round_up(5, 0), Some(5));
    }
}
