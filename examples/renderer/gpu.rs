//! The renderer's CUDA kernels: compiled at run time with NVRTC (through cudarc), launched
//! on a stream of the process's own. Buffers and leases are cudarc citizens
//! (`DevicePtr`/`DevicePtrMut`), passed as kernel arguments through `DeviceArg`, so every
//! launch is ordered by Baton without a synchronise: a sheet lease's first use on the stream
//! waits on the worker's acquire fence, every use is recorded, and dropping a lease records
//! its release fence after the kernels that read it (see `docs/ORDERING.md`). One launch
//! renders a worker's whole tile sheet (`scene::Sheet`), one composes it: a tile per
//! z-slice of the grid, its place in the frame found by arithmetic in the kernel.

use crate::scene::{CUDA_SOURCE, Sheet};
use baton::actors::{Buffer, Lease};
use baton::ipc::cuda::cudarc::driver::{
    CudaEvent, CudaFunction, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg, sys,
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

/// Tiles of a sheet one launch covers: CUDA's limit on `gridDim.z`.
const TILES_PER_LAUNCH: u32 = 65_535;

/// The launches that cover `sheet`: 16×16 blocks over its largest tile, one z-slice of
/// blocks per tile, at most [`TILES_PER_LAUNCH`] tiles each; each with its first tile
/// `j0`. One launch unless a worker has over 65,535 tiles.
fn launches(sheet: &Sheet) -> impl Iterator<Item = (u32, LaunchConfig)> + use<> {
    let (w, h) = (sheet.tile.min(sheet.width), sheet.tile.min(sheet.height));
    let count = sheet.count;
    (0..count)
        .step_by(TILES_PER_LAUNCH as usize)
        .map(move |j0| {
            let tiles = (count - j0).min(TILES_PER_LAUNCH);
            let config = LaunchConfig {
                grid_dim: (w.div_ceil(16), h.div_ceil(16), tiles),
                block_dim: (16, 16, 1),
                shared_mem_bytes: 0,
            };
            (j0, config)
        })
}

/// `sheet.slot()` as the kernels take it, checking the sheet fits `len` pixels.
fn checked_slot(sheet: &Sheet, len: usize) -> Result<u32, Box<dyn Error>> {
    if sheet.count == 0 || sheet.width == 0 || sheet.height == 0 || sheet.tile == 0 {
        return Err("an empty sheet".into());
    }
    if len < sheet.pixels() {
        return Err(format!(
            "sheet buffer too small: {len} pixels for {} tiles of {}",
            sheet.count,
            sheet.slot()
        )
        .into());
    }
    Ok(u32::try_from(sheet.slot()).map_err(|_| "a tile over 2^32 pixels")?)
}

/// Pushes the arguments both kernels take after their pointers, in their order: the sheet
/// from its tile `j0` (`j0, count, first, step, slot, tile, width, height`).
fn sheet_args<'a>(launch: &mut LaunchArgs<'a>, j0: &'a u32, slot: &'a u32, sheet: &'a Sheet) {
    launch
        .arg(j0)
        .arg(&sheet.count)
        .arg(&sheet.first)
        .arg(&sheet.step)
        .arg(slot)
        .arg(&sheet.tile)
        .arg(&sheet.width)
        .arg(&sheet.height);
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
            render: module.load_function("render_sheet")?,
            compose: module.load_function("compose_sheet")?,
            stream: backend.context().new_stream()?,
        })
    }

    /// Renders every tile of `sheet` at time `t` into `out` (at least `sheet.pixels()`
    /// pixels): one launch (see [`launches`]). Asynchronous: the buffer records the write,
    /// so the offer that shares it carries a fence after it.
    pub fn render(
        &self,
        out: &mut Buffer<u32>,
        sheet: &Sheet,
        t: f32,
    ) -> Result<(), Box<dyn Error>> {
        let slot = checked_slot(sheet, out.len())?;
        // Waits once before the first launch; records the write when it drops, after the
        // last.
        let out = DeviceArg::write(out, &self.stream);
        for (j0, config) in launches(sheet) {
            let mut launch = self.stream.launch_builder(&self.render);
            launch.arg(&out);
            sheet_args(&mut launch, &j0, &slot, sheet);
            launch.arg(&t);
            // SAFETY: the arguments match `render_sheet`'s parameters in type and order (a
            // device pointer, eight u32, one f32); the kernel writes, for each tile
            // j < count, only `out[j * slot .. j * slot + tw * th]` with tw * th <= slot
            // (it checks), so below `count * slot`, which `checked_slot` kept inside the
            // buffer; the buffer is freed only after the work recorded on it.
            unsafe { launch.launch(config) }?;
        }
        Ok(())
    }

    /// Copies every tile of `sheet` (a lease on another process's device memory, or a
    /// buffer of ours) into its place in `frame` (device memory of `sheet.width` ×
    /// `sheet.height`): one launch (see [`launches`]). Asynchronous: the launch waits on
    /// the sheet's acquire fence, and the sheet and the frame record their use.
    pub fn compose(
        &self,
        frame: &mut Buffer<u32>,
        tiles: Tiles<'_>,
        sheet: &Sheet,
    ) -> Result<(), Box<dyn Error>> {
        let sheet_pixels = match tiles {
            Tiles::Leased(l) => l.len(),
            Tiles::Own(b) => b.len(),
        };
        let slot = checked_slot(sheet, sheet_pixels)?;
        if frame.len() < sheet.width as usize * sheet.height as usize {
            return Err("the frame buffer is smaller than the sheet's frame".into());
        }
        // Each waits once before the first launch, and records its use after the last.
        let tiles = match tiles {
            Tiles::Leased(l) => DeviceArg::read(l, &self.stream),
            Tiles::Own(b) => DeviceArg::read(b, &self.stream),
        };
        let frame = DeviceArg::write(frame, &self.stream);
        for (j0, config) in launches(sheet) {
            let mut launch = self.stream.launch_builder(&self.compose);
            launch.arg(&frame).arg(&tiles);
            sheet_args(&mut launch, &j0, &slot, sheet);
            // SAFETY: the arguments match `compose_sheet`'s parameters (two device pointers
            // and eight u32); it reads, for each tile j < count, `sheet[j * slot ..
            // j * slot + tw * th]` (tw * th <= slot, checked there), inside the sheet by
            // `checked_slot`, and writes the tile's rect, which its arithmetic keeps inside
            // the width × height frame, checked above to fit the buffer; the sheet's mapping
            // closes only after the lease's release fence, which follows this launch.
            unsafe { launch.launch(config) }?;
        }
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

    /// Waits until this process's kernel stream has run everything queued on it: in the
    /// compositor the composes (and, through the acquire fences they waited on, the
    /// workers' renders), in a worker its render (unless `--overlap-render`).
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

/// A sheet of tiles to compose: leased from a worker, or a buffer of ours (the staged
/// path's).
#[derive(Clone, Copy)]
pub enum Tiles<'a> {
    /// A worker's sheet.
    Leased(&'a Lease<u32>),
    /// Ours.
    Own(&'a Buffer<u32>),
}
