//! The gather kernel of batched copies (`kernels/gather.cu`, shipped as PTX), loaded once
//! per context: below both the backend, which keeps it, and `copy`, which launches it.

use super::context::ContextGuard;
use super::{SharedContext, result};
use crate::{Error, Result};
use cudarc::driver::sys;
use std::ffi::CStr;
use std::sync::Arc;

/// The kernel, as PTX with the NUL the driver wants.
const PTX: &str = concat!(include_str!("kernels/gather.ptx"), "\0");
/// The kernel's entry point.
const ENTRY: &CStr = c"baton_gather";

/// The loaded kernel of one context.
pub(crate) struct Gather {
    ctx: SharedContext,
    module: sys::CUmodule,
    function: sys::CUfunction,
}

// SAFETY: module and function handles are context-wide driver objects that any thread may
// use with the context pushed (every use here pushes it).
unsafe impl Send for Gather {}
// SAFETY: as above; nothing here is mutated after loading.
unsafe impl Sync for Gather {}

impl Gather {
    /// Loads the kernel into `ctx`.
    pub(crate) fn load(ctx: &SharedContext) -> Result<Self> {
        let _pushed = ContextGuard::push(ctx)?;
        let image = CStr::from_bytes_with_nul(PTX.as_bytes()).map_err(|_| Error::Cuda {
            op: "cuModuleLoadData",
            code: super::CudaError::INVALID_VALUE,
        })?;
        // SAFETY: the context is current; the module is unloaded once, in `Drop`.
        let module = unsafe { result::module_load_data(image) }?;
        // SAFETY: the module is live.
        match unsafe { result::module_get_function(module, ENTRY) } {
            Ok(function) => Ok(Self {
                ctx: Arc::clone(ctx),
                module,
                function,
            }),
            Err(e) => {
                // SAFETY: loaded above, nothing launched from it.
                let _ = unsafe { result::module_unload(module) };
                Err(e)
            }
        }
    }
}

impl Gather {
    /// The kernel's function handle (launch it with the context pushed).
    pub(crate) fn function(&self) -> sys::CUfunction {
        self.function
    }
}

impl Drop for Gather {
    fn drop(&mut self) {
        // Every plan holding this module waited for its launches before letting go.
        if let Ok(_pushed) = ContextGuard::push(&self.ctx) {
            // SAFETY: loaded once, unloaded once, with its context current.
            if let Err(e) = unsafe { result::module_unload(self.module) } {
                tracing::warn!(error = %e, "unloading Baton's copy kernel failed");
            }
        }
    }
}
