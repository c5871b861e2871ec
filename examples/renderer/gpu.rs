//! The renderer's CUDA kernels: compiled at run time with NVRTC (through cudarc), launched
//! on the Baton CUDA backend's stream, so they are ordered with Baton's own copies and
//! with the IPC events it records and waits on.

use crate::scene::{CUDA_SOURCE, TileRect};
use baton::ipc::cuda::CudaBackend;
use baton::ipc::cuda::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use baton::ipc::cuda::cudarc::nvrtc::compile_ptx;
use std::error::Error;
use std::sync::Arc;

/// The two kernels, loaded into the backend's context.
pub struct Kernels {
    render: CudaFunction,
    compose: CudaFunction,
    stream: Arc<CudaStream>,
}

fn grid(w: u32, h: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (w.div_ceil(16), h.div_ceil(16), 1),
        block_dim: (16, 16, 1),
        shared_mem_bytes: 0,
    }
}

impl Kernels {
    /// Compiles the scene with NVRTC and loads it.
    pub fn load(backend: &CudaBackend) -> Result<Self, Box<dyn Error>> {
        // SAFETY: this only tries to load libnvrtc (running its initialisers, which have no
        // preconditions); with dynamic loading cudarc would panic at the first NVRTC call
        // if the library were missing, so ask first and fail with a clear message.
        if !unsafe { baton::ipc::cuda::cudarc::nvrtc::sys::is_culib_present() } {
            return Err(
                "NVRTC (libnvrtc.so) not found: add the CUDA toolkit's lib64 to LD_LIBRARY_PATH"
                    .into(),
            );
        }
        let ptx = compile_ptx(CUDA_SOURCE)
            .map_err(|e| format!("NVRTC could not compile the scene: {e}"))?;
        let module = backend.context().load_module(ptx)?;
        Ok(Self {
            render: module.load_function("render_tile")?,
            compose: module.load_function("compose_tile")?,
            stream: Arc::clone(backend.stream()),
        })
    }

    /// Renders `rect` of a `width`×`height` frame at time `t` into `out`, a device buffer
    /// of at least `rect.w * rect.h` pixels. Asynchronous on the backend stream.
    pub fn render(
        &self,
        out: u64,
        out_pixels: usize,
        rect: &TileRect,
        width: u32,
        height: u32,
        t: f32,
    ) -> Result<(), Box<dyn Error>> {
        if out_pixels < (rect.w * rect.h) as usize {
            return Err("tile buffer too small".into());
        }
        let mut launch = self.stream.launch_builder(&self.render);
        launch
            .arg(&out)
            .arg(&rect.x)
            .arg(&rect.y)
            .arg(&rect.w)
            .arg(&rect.h)
            .arg(&width)
            .arg(&height)
            .arg(&t);
        // SAFETY: the arguments match `render_tile`'s parameters in type and order (a
        // device pointer as u64, six u32, one f32); the kernel writes only
        // `out[0 .. rect.w * rect.h]`, which the check above keeps inside the buffer, and
        // the buffer outlives the launch (its owner holds it until the lease returns).
        unsafe { launch.launch(grid(rect.w, rect.h)) }?;
        Ok(())
    }

    /// Copies a `rect.w`×`rect.h` tile (device memory, imported) into its place in the
    /// frame (device memory of `frame_w`×`frame_h`). Asynchronous on the backend stream.
    pub fn compose(
        &self,
        frame: u64,
        frame_w: u32,
        frame_h: u32,
        tile: u64,
        tile_pixels: usize,
        rect: &TileRect,
    ) -> Result<(), Box<dyn Error>> {
        if rect.x + rect.w > frame_w
            || rect.y + rect.h > frame_h
            || tile_pixels < (rect.w * rect.h) as usize
        {
            return Err("tile does not fit the frame".into());
        }
        let mut launch = self.stream.launch_builder(&self.compose);
        launch
            .arg(&frame)
            .arg(&frame_w)
            .arg(&tile)
            .arg(&rect.x)
            .arg(&rect.y)
            .arg(&rect.w)
            .arg(&rect.h);
        // SAFETY: the arguments match `compose_tile`'s parameters; it reads
        // `tile[0 .. w*h]` and writes the rect of `frame`, both checked above to lie
        // inside their buffers, which stay mapped until the stream is synchronised (the
        // compositor synchronises before it drops the tile leases).
        unsafe { launch.launch(grid(rect.w, rect.h)) }?;
        Ok(())
    }

    /// Waits for everything launched so far.
    pub fn synchronize(&self) -> Result<(), Box<dyn Error>> {
        Ok(self.stream.synchronize()?)
    }
}
