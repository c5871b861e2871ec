//! The renderer's CUDA kernels: compiled at run time with NVRTC (through cudarc), launched
//! on a stream of the process's own. Buffers and leases are cudarc citizens
//! (`DevicePtr`/`DevicePtrMut`), passed as kernel arguments through `DeviceArg`, so every
//! launch is ordered by Baton without a synchronise: a tile lease's first use on the stream
//! waits on the worker's acquire fence, every use is recorded, and dropping a lease records
//! its release fence after the kernels that read it (see `docs/ORDERING.md`).

use crate::scene::{CUDA_SOURCE, TileRect};
use baton::actors::{Buffer, Lease};
use baton::ipc::cuda::cudarc::driver::{
    CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, sys,
};
use baton::ipc::cuda::cudarc::nvrtc::compile_ptx;
use baton::ipc::cuda::{CudaBackend, DeviceArg};
use std::error::Error;
use std::sync::Arc;

/// The two kernels, loaded into the backend's context, and the stream they run on.
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
    /// Compiles the scene with NVRTC and loads it; makes the stream the kernels run on.
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
            stream: backend.context().new_stream()?,
        })
    }

    /// Renders `rect` of a `width`×`height` frame at time `t` into `out` (at least
    /// `rect.w * rect.h` pixels). Asynchronous: the buffer records the write, so the offer
    /// that shares it carries a fence after it.
    pub fn render(
        &self,
        out: &mut Buffer<u32>,
        rect: &TileRect,
        width: u32,
        height: u32,
        t: f32,
    ) -> Result<(), Box<dyn Error>> {
        if out.len() < (rect.w * rect.h) as usize {
            return Err("tile buffer too small".into());
        }
        // SAFETY: the arguments match `render_tile`'s parameters in type and order (a
        // device pointer, six u32, one f32); the kernel writes only
        // `out[0 .. rect.w * rect.h]`, which the check above keeps inside the buffer, and
        // the buffer is freed only after the work recorded on it.
        unsafe {
            self.stream
                .launch_builder(&self.render)
                .arg(&DeviceArg::write(out, &self.stream))
                .arg(&rect.x)
                .arg(&rect.y)
                .arg(&rect.w)
                .arg(&rect.h)
                .arg(&width)
                .arg(&height)
                .arg(&t)
                .launch(grid(rect.w, rect.h))
        }?;
        Ok(())
    }

    /// Copies a `rect.w`×`rect.h` tile (a lease on another process's device memory, or a
    /// buffer of ours) into its place in `frame` (device memory of `frame_w`×`frame_h`).
    /// Asynchronous: the launch waits on the tile's acquire fence, and the tile and the
    /// frame record their use.
    pub fn compose(
        &self,
        frame: &mut Buffer<u32>,
        frame_w: u32,
        frame_h: u32,
        tile: Tile<'_>,
        rect: &TileRect,
    ) -> Result<(), Box<dyn Error>> {
        let tile_pixels = match tile {
            Tile::Leased(l) => l.len(),
            Tile::Own(b) => b.len(),
        };
        if rect.x + rect.w > frame_w
            || rect.y + rect.h > frame_h
            || tile_pixels < (rect.w * rect.h) as usize
            || frame.len() < (frame_w * frame_h) as usize
        {
            return Err("tile does not fit the frame".into());
        }
        let tile = match tile {
            Tile::Leased(l) => DeviceArg::read(l, &self.stream),
            Tile::Own(b) => DeviceArg::read(b, &self.stream),
        };
        // SAFETY: the arguments match `compose_tile`'s parameters (two device pointers and
        // five u32); it reads `tile[0 .. w*h]` and writes the rect of `frame`, both checked
        // above to lie inside their buffers; the tile's mapping closes only after the
        // lease's release fence, which follows this launch.
        unsafe {
            self.stream
                .launch_builder(&self.compose)
                .arg(&DeviceArg::write(frame, &self.stream))
                .arg(&frame_w)
                .arg(&tile)
                .arg(&rect.x)
                .arg(&rect.y)
                .arg(&rect.w)
                .arg(&rect.h)
                .launch(grid(rect.w, rect.h))
        }?;
        Ok(())
    }
}

impl Kernels {
    /// Records a timing event on the compose stream after everything queued there so far
    /// (a frame's compose kernels): `--frame-log` reads when each frame's GPU work ended.
    pub fn frame_mark(&self) -> Result<CudaEvent, Box<dyn Error>> {
        Ok(self
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// Waits until the compose stream has run everything queued on it (and, through the
    /// acquire fences its kernels waited on, the workers' renders of those tiles).
    pub fn synchronize(&self) -> Result<(), Box<dyn Error>> {
        Ok(self.stream.synchronize()?)
    }
}

/// The compositor's frames on the GPU, for `--frame-log`: an event after each frame's
/// compose kernels, queried without waiting at the end of each frame (how many frames of
/// GPU work are still queued: how far the host runs ahead), and timed against each other
/// once the run is over (when each frame's GPU work ended).
#[derive(Default)]
pub struct FrameMarks {
    marks: Vec<CudaEvent>,
    /// The first frame whose mark has not been seen complete.
    first_pending: usize,
}

impl FrameMarks {
    /// Marks the end of this frame's compose work; returns how many frames (this one
    /// included) the GPU has not finished yet. `cuEventQuery` only: nothing waits.
    pub fn frame_queued(&mut self, kernels: &Kernels) -> Result<u64, Box<dyn Error>> {
        self.marks.push(kernels.frame_mark()?);
        while self.first_pending < self.marks.len()
            && self.marks[self.first_pending].try_is_complete()?
        {
            self.first_pending += 1;
        }
        Ok((self.marks.len() - self.first_pending) as u64)
    }

    /// Waits until the GPU has finished frame `frame`'s compose work (nothing if that
    /// frame was never marked). A blocking wait on this process's own stream.
    pub fn wait_for(&self, frame: u64) -> Result<(), Box<dyn Error>> {
        if let Some(m) = usize::try_from(frame).ok().and_then(|i| self.marks.get(i)) {
            m.synchronize()?;
        }
        Ok(())
    }

    /// After the run (waits for every mark): the GPU time from the end of frame `f - 1`'s
    /// compose work to the end of frame `f`'s, in µs, per frame (`None` for the first).
    pub fn intervals_us(&self) -> Result<Vec<Option<f64>>, Box<dyn Error>> {
        let mut out = Vec::with_capacity(self.marks.len());
        for (i, m) in self.marks.iter().enumerate() {
            out.push(match i.checked_sub(1) {
                Some(prev) => {
                    Some((f64::from(self.marks[prev].elapsed_ms(m)?) * 1e4).round() / 10.0)
                }
                None => None,
            });
        }
        Ok(out)
    }
}

/// A tile to compose: leased from a worker, or a buffer of ours (the staged path's).
#[derive(Clone, Copy)]
pub enum Tile<'a> {
    /// A worker's tile.
    Leased(&'a Lease<u32>),
    /// Ours.
    Own(&'a Buffer<u32>),
}
