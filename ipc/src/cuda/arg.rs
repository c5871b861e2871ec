//! [`DeviceArg`]: a kernel argument made from anything that implements cudarc's
//! [`DevicePtr`] or [`DevicePtrMut`] (Baton's `Buffer` and `Lease` among them), so that a
//! launch is ordered by that type's own waits and records, as cudarc orders its
//! `CudaSlice`s:
//!
//! ```no_run
//! # use baton_ipc::cuda::DeviceArg;
//! # use baton_ipc::cuda::cudarc::driver::{CudaFunction, CudaStream, CudaSlice, LaunchConfig, PushKernelArg};
//! # fn f(stream: &std::sync::Arc<CudaStream>, kernel: &CudaFunction, src: &CudaSlice<u32>, dst: &mut CudaSlice<u32>) -> Result<(), Box<dyn std::error::Error>> {
//! let n = 1024u32;
//! // SAFETY (of this example): the kernel takes (const u32*, u32*, u32) and touches n
//! // elements of each buffer.
//! unsafe {
//!     stream
//!         .launch_builder(kernel)
//!         .arg(&DeviceArg::read(src, stream))
//!         .arg(&DeviceArg::write(dst, stream))
//!         .arg(&n)
//!         .launch(LaunchConfig::for_num_elems(n))
//! }?;
//! // The arguments dropped at the end of the statement, after the launch was queued:
//! // their uses are recorded after it.
//! # Ok(()) }
//! ```
//!
//! cudarc takes kernel arguments through its `PushKernelArg` trait, implemented for its own
//! slices; a crate that wants another type there must implement that `unsafe` trait itself.
//! `DeviceArg` is that one implementation, for every `DevicePtr` type, so that no other
//! crate needs `unsafe` for it.
//!
//! # Safety
//!
//! The `PushKernelArg` implementation pushes the address of the argument's device pointer,
//! which lives in the `DeviceArg` for as long as the launch builder borrows it (the impl's
//! lifetime bounds, as in cudarc's own impl for `CudaView`). The ordering is the wrapped
//! type's: its `device_ptr` waits before, its `SyncOnDrop` records when the `DeviceArg`
//! drops, which the borrow keeps after the launch.

use cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, LaunchArgs, PushKernelArg, SyncOnDrop, sys,
};
use std::fmt;

/// A kernel argument from a [`DevicePtr`] type (see the module docs).
pub struct DeviceArg<'a> {
    ptr: sys::CUdeviceptr,
    _sync: SyncOnDrop<'a>,
}

impl fmt::Debug for DeviceArg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceArg")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .finish()
    }
}

impl<'a> DeviceArg<'a> {
    /// An argument the kernel reads: `stream` waits for what must come before a read of
    /// `buf` now, and the read is recorded when the argument drops.
    pub fn read<T>(buf: &'a impl DevicePtr<T>, stream: &'a CudaStream) -> Self {
        let (ptr, sync) = buf.device_ptr(stream);
        Self { ptr, _sync: sync }
    }

    /// An argument the kernel writes: `stream` waits for what must come before a write of
    /// `buf` now, and the write is recorded when the argument drops.
    pub fn write<T>(buf: &'a mut impl DevicePtrMut<T>, stream: &'a CudaStream) -> Self {
        let (ptr, sync) = buf.device_ptr_mut(stream);
        Self { ptr, _sync: sync }
    }

    /// The device pointer.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

// SAFETY: pushes the address of a `CUdeviceptr` (a `u64`, which kernels take as a pointer
// argument) through cudarc's own impl for `&u64`; the pointer lives in `arg`, borrowed for
// `'b`, which outlives the builder (`'b: 'a`), so the address stays valid until the launch.
unsafe impl<'a, 'b: 'a, 'c: 'b> PushKernelArg<&'b DeviceArg<'c>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceArg<'c>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}
