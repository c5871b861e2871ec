//! Serialises GPU tests: device-wide measures (free memory) are only meaningful when no
//! other test uses the GPU at the same time, in this process or another. Not a stable API.
//!
//! Built with the `testing` cargo feature (which `gpu-tests` enables) and in this
//! crate's own tests: the facade's tests and the test peers turn it on.

use crate::{Error, Result};
use std::fs::File;
use std::time::{Duration, Instant};

/// Held while a GPU test runs: an exclusive `flock` on a file in the temporary
/// directory, shared by every test binary of the workspace (and by threads of one, as
/// each takes its own open file description).
#[derive(Debug)]
pub struct GpuTestLock {
    _file: File,
}

/// Waits (polling, at most `deadline`) for the GPU to be free of other Baton tests.
///
/// # Errors
/// [`Error::Io`]; [`Error::Timeout`] past the deadline.
pub fn exclusive_gpu(deadline: Duration) -> Result<GpuTestLock> {
    use rustix::fs::{FlockOperation, flock};
    let path = std::env::temp_dir().join("baton-gpu-tests.lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(Error::io("opening the GPU test lock"))?;
    let start = Instant::now();
    loop {
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(GpuTestLock { _file: file }),
            Err(e) if e == rustix::io::Errno::WOULDBLOCK || e == rustix::io::Errno::INTR => {
                if start.elapsed() > deadline {
                    return Err(Error::Timeout {
                        op: "waiting for other GPU tests to finish",
                        after: deadline,
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(Error::Io {
                    op: "locking the GPU test lock",
                    source: e.into(),
                });
            }
        }
    }
}

/// Copies `dst.len()` bytes from device address `src` of device `ordinal`'s primary
/// context (the one every [`CudaBackend`](super::CudaBackend) of that device uses), with
/// no lease or cache in the way: a test reads what a mapping shows after its lease turned
/// orphaned.
///
/// # Safety
/// `src .. src + dst.len()` is device memory this process maps (an allocation or an
/// opened handle not yet closed): a copy from an unmapped address may fault and poison
/// the context.
///
/// # Errors
/// [`Error::Cuda`].
pub unsafe fn read_device(ordinal: usize, src: u64, dst: &mut [u8]) -> Result<()> {
    let ctx = cudarc::driver::CudaContext::new(ordinal)
        .map_err(super::result::from_driver("cuDevicePrimaryCtxRetain"))?;
    let _pushed = super::context::ContextGuard::push(&ctx)?;
    // SAFETY: the primary context is current; `dst` is a valid host slice of the length
    // copied; the device range is mapped (the caller's contract).
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, src) }
        .map_err(super::result::from_driver("cuMemcpyDtoH"))
}

/// Copies `src` to device address `dst` of device `ordinal` (`cuMemcpyHtoD`), in its
/// primary context, whatever Baton's rules say: a test's stand-in for another
/// process's unsafe code that writes through a raw pointer.
///
/// # Safety
/// As [`read_device`]: `dst..dst + src.len()` is device memory mapped in this process.
///
/// # Errors
/// [`Error::Cuda`].
pub unsafe fn write_device(ordinal: usize, dst: u64, src: &[u8]) -> Result<()> {
    let ctx = cudarc::driver::CudaContext::new(ordinal)
        .map_err(super::result::from_driver("cuDevicePrimaryCtxRetain"))?;
    let _pushed = super::context::ContextGuard::push(&ctx)?;
    // SAFETY: the primary context is current; `src` is a valid host slice of the length
    // copied; the device range is mapped (the caller's contract).
    unsafe { cudarc::driver::result::memcpy_htod_sync(dst, src) }
        .map_err(super::result::from_driver("cuMemcpyHtoD"))
}
