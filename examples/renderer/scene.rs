//! The animated scene, the tiling of a frame, and the "missing tile" pattern. Shared by
//! the renderer's workers (CPU path), its compositor, its end-to-end test (the
//! single-process reference render), and — as CUDA C with the same formula — its kernels.

#![allow(dead_code)]

/// A tile of the frame: `w`×`h` pixels at (`x`, `y`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TileRect {
    pub index: u32,
    pub x: u32,
    pub y: u32,
    pub w: u32,
    pub h: u32,
}

/// The tiles of a `width`×`height` frame, `tile`×`tile` pixels each (smaller at the edges).
pub fn tiles(width: u32, height: u32, tile: u32) -> Vec<TileRect> {
    let mut out = Vec::new();
    for y in (0..height).step_by(tile as usize) {
        for x in (0..width).step_by(tile as usize) {
            out.push(TileRect {
                index: out.len() as u32,
                x,
                y,
                w: tile.min(width - x),
                h: tile.min(height - y),
            });
        }
    }
    out
}

/// A worker's tiles of one frame, laid out in one buffer (its "tile sheet"): tiles
/// `first`, `first + step`, `first + 2·step`, … of [`tiles`]`(width, height, tile)`, `count`
/// of them. Tile `j` of the sheet lies at pixel offset `j · slot`, row-major with a row
/// pitch of its own width (`rect.w`); `slot` is the largest tile's pixel count, so edge
/// tiles leave the end of their slot unused. The CUDA kernels find a tile's place in the
/// frame by the same arithmetic as [`rect`](Self::rect), so no table travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Sheet {
    pub width: u32,
    pub height: u32,
    pub tile: u32,
    pub first: u32,
    pub step: u32,
    pub count: u32,
}

impl Sheet {
    /// Worker `worker`'s sheet of `workers`: every tile whose index is `worker` modulo
    /// `workers` (`count` 0 when there are fewer tiles than workers).
    pub fn of_worker(width: u32, height: u32, tile: u32, worker: u32, workers: u32) -> Sheet {
        let total = width.div_ceil(tile) * height.div_ceil(tile);
        Sheet {
            width,
            height,
            tile,
            first: worker,
            step: workers,
            count: total.saturating_sub(worker).div_ceil(workers),
        }
    }

    /// Pixels between tiles in the sheet: the largest tile's count.
    pub fn slot(&self) -> usize {
        self.tile.min(self.width) as usize * self.tile.min(self.height) as usize
    }

    /// The sheet's size in pixels.
    pub fn pixels(&self) -> usize {
        self.count as usize * self.slot()
    }

    /// Where tile `j` of the sheet goes in the frame: the kernels' arithmetic (equal to
    /// `tiles(width, height, tile)[first + j·step]`).
    pub fn rect(&self, j: u32) -> TileRect {
        let index = self.first + j * self.step;
        let across = self.width.div_ceil(self.tile);
        let (x, y) = ((index % across) * self.tile, (index / across) * self.tile);
        TileRect {
            index,
            x,
            y,
            w: self.tile.min(self.width - x),
            h: self.tile.min(self.height - y),
        }
    }

    /// Every tile of the sheet, with its pixel offset in the sheet.
    pub fn rects(&self) -> impl Iterator<Item = (usize, TileRect)> + use<> {
        let sheet = *self;
        (0..self.count).map(move |j| (j as usize * sheet.slot(), sheet.rect(j)))
    }
}

/// Scene time of a frame.
pub fn time_of(frame: u64) -> f32 {
    frame as f32 * 0.06
}

fn pack(r: f32, g: f32, b: f32) -> u32 {
    let q = |c: f32| (c.clamp(0.0, 1.0) * 255.0 + 0.5) as u32;
    q(r) | q(g) << 8 | q(b) << 16 | 0xff << 24
}

/// The colour of pixel (`px`, `py`) of a `width`×`height` frame at time `t`, as RGBA8
/// packed little-endian (R in the low byte). Plasma waves behind three orbiting metaballs.
pub fn shade(px: u32, py: u32, width: u32, height: u32, t: f32) -> u32 {
    let (w, h) = (width as f32, height as f32);
    let u = (2.0 * px as f32 - w) / h;
    let v = (2.0 * py as f32 - h) / h;
    let plasma = (u * 3.0 + t).sin()
        + (v * 4.0 - t * 1.3).sin()
        + ((u + v) * 2.5 + t * 0.7).sin()
        + ((u * u + v * v).sqrt() * 6.0 - t * 2.0).sin();
    let p = plasma * 0.125 + 0.5;
    let tau = std::f32::consts::TAU;
    let (mut r, mut g, mut b) = (
        0.5 + 0.5 * (tau * (p + 0.00)).cos(),
        0.5 + 0.5 * (tau * (p + 0.33)).cos(),
        0.5 + 0.5 * (tau * (p + 0.67)).cos(),
    );
    let mut field = 0.0f32;
    for i in 0..3 {
        let k = i as f32;
        let cx = 0.9 * (t * (0.7 + 0.2 * k) + 2.1 * k).cos();
        let cy = 0.6 * (t * (0.9 + 0.3 * k) + 1.3 * k).sin();
        let (dx, dy) = (u - cx, v - cy);
        field += 0.09 / (dx * dx + dy * dy + 1e-4);
    }
    if field > 1.0 {
        let glow = (1.0 - 1.0 / field).min(1.0);
        r = r * 0.25 + 0.75 * glow;
        g = g * 0.25 + 0.75 * glow;
        b = b * 0.25 + 0.9 * glow;
    }
    pack(r, g, b)
}

/// Renders one tile on the CPU into `out` (at least `rect.w * rect.h` pixels), row-major.
pub fn render_tile_into(out: &mut [u32], rect: &TileRect, width: u32, height: u32, frame: u64) {
    let t = time_of(frame);
    let rows = out.chunks_exact_mut(rect.w as usize).take(rect.h as usize);
    for (row, y) in rows.zip(rect.y..) {
        for (px, x) in row.iter_mut().zip(rect.x..) {
            *px = shade(x, y, width, height, t);
        }
    }
}

/// Renders a whole sheet on the CPU into `out` (its [`pixels`](Sheet::pixels)).
pub fn render_sheet_into(out: &mut [u32], sheet: &Sheet, frame: u64) {
    for (at, rect) in sheet.rects() {
        let n = (rect.w * rect.h) as usize;
        render_tile_into(
            &mut out[at..at + n],
            &rect,
            sheet.width,
            sheet.height,
            frame,
        );
    }
}

/// A whole frame rendered in this process: the reference the multi-process render must equal.
pub fn reference_frame(width: u32, height: u32, frame: u64) -> Vec<u32> {
    let t = time_of(frame);
    (0..height)
        .flat_map(|y| (0..width).map(move |x| shade(x, y, width, height, t)))
        .collect()
}

/// A tile the compositor could not get: magenta and black stripes, so it shows in the PNG.
pub const MISSING_A: u32 = 0xffff_00ff;
/// The other stripe colour.
pub const MISSING_B: u32 = 0xff00_0000;

/// The missing pattern of a tile, row-major.
pub fn missing_tile(rect: &TileRect) -> Vec<u32> {
    (0..rect.h)
        .flat_map(|y| {
            (0..rect.w).map(move |x| {
                if ((x + y) / 16) % 2 == 0 {
                    MISSING_A
                } else {
                    MISSING_B
                }
            })
        })
        .collect()
}

/// The CUDA C of the scene and of the compositor's copy, compiled at run time with NVRTC.
/// `shade` is the formula above, line for line.
pub const CUDA_SOURCE: &str = r#"
__device__ unsigned int pack(float r, float g, float b) {
    unsigned int q0 = (unsigned int)(fminf(fmaxf(r, 0.0f), 1.0f) * 255.0f + 0.5f);
    unsigned int q1 = (unsigned int)(fminf(fmaxf(g, 0.0f), 1.0f) * 255.0f + 0.5f);
    unsigned int q2 = (unsigned int)(fminf(fmaxf(b, 0.0f), 1.0f) * 255.0f + 0.5f);
    return q0 | (q1 << 8) | (q2 << 16) | (0xffu << 24);
}

__device__ unsigned int shade(unsigned int px, unsigned int py, unsigned int width, unsigned int height, float t) {
    float w = (float)width, h = (float)height;
    float u = (2.0f * (float)px - w) / h;
    float v = (2.0f * (float)py - h) / h;
    float plasma = sinf(u * 3.0f + t) + sinf(v * 4.0f - t * 1.3f) + sinf((u + v) * 2.5f + t * 0.7f)
                 + sinf(sqrtf(u * u + v * v) * 6.0f - t * 2.0f);
    float p = plasma * 0.125f + 0.5f;
    const float tau = 6.28318530717958647692f;
    float r = 0.5f + 0.5f * cosf(tau * (p + 0.00f));
    float g = 0.5f + 0.5f * cosf(tau * (p + 0.33f));
    float b = 0.5f + 0.5f * cosf(tau * (p + 0.67f));
    float field = 0.0f;
    for (int i = 0; i < 3; ++i) {
        float k = (float)i;
        float cx = 0.9f * cosf(t * (0.7f + 0.2f * k) + 2.1f * k);
        float cy = 0.6f * sinf(t * (0.9f + 0.3f * k) + 1.3f * k);
        float dx = u - cx, dy = v - cy;
        field += 0.09f / (dx * dx + dy * dy + 1e-4f);
    }
    if (field > 1.0f) {
        float glow = fminf(1.0f - 1.0f / field, 1.0f);
        r = r * 0.25f + 0.75f * glow;
        g = g * 0.25f + 0.75f * glow;
        b = b * 0.25f + 0.9f * glow;
    }
    return pack(r, g, b);
}

// Tile j of a sheet (`Sheet::rect` in Rust, the same arithmetic): false when it lies
// outside the frame's grid of tiles.
__device__ bool sheet_rect(unsigned int j, unsigned int first, unsigned int step,
                           unsigned int tile, unsigned int width, unsigned int height,
                           unsigned int* x0, unsigned int* y0, unsigned int* tw, unsigned int* th) {
    unsigned int across = (width - 1u) / tile + 1u;
    unsigned int down = (height - 1u) / tile + 1u;
    unsigned long long index = (unsigned long long)first + (unsigned long long)j * step;
    if (index >= (unsigned long long)across * down) return false;
    unsigned int tx = (unsigned int)(index % across), ty = (unsigned int)(index / across);
    *x0 = tx * tile;
    *y0 = ty * tile;
    *tw = tile < width - *x0 ? tile : width - *x0;
    *th = tile < height - *y0 ? tile : height - *y0;
    return true;
}

// One launch renders a sheet's tiles j0 .. j0 + gridDim.z: blockIdx.z picks the tile,
// x and y its pixel. Tile j's pixels lie at sheet[j * slot ..], row-major, pitch tw.
extern "C" __global__ void render_sheet(unsigned int* sheet, unsigned int j0, unsigned int count,
                                        unsigned int first, unsigned int step, unsigned int slot,
                                        unsigned int tile, unsigned int width, unsigned int height,
                                        float t) {
    unsigned int j = j0 + blockIdx.z;
    unsigned int x0, y0, tw, th;
    if (j >= count || !sheet_rect(j, first, step, tile, width, height, &x0, &y0, &tw, &th)) return;
    unsigned int x = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < tw && y < th && (unsigned long long)tw * th <= slot)
        sheet[(unsigned long long)j * slot + (unsigned long long)y * tw + x] = shade(x0 + x, y0 + y, width, height, t);
}

// One launch copies a sheet's tiles j0 .. j0 + gridDim.z into their places in the frame
// (width x height pixels, row-major).
extern "C" __global__ void compose_sheet(unsigned int* frame, const unsigned int* sheet,
                                         unsigned int j0, unsigned int count, unsigned int first,
                                         unsigned int step, unsigned int slot, unsigned int tile,
                                         unsigned int width, unsigned int height) {
    unsigned int j = j0 + blockIdx.z;
    unsigned int x0, y0, tw, th;
    if (j >= count || !sheet_rect(j, first, step, tile, width, height, &x0, &y0, &tw, &th)) return;
    unsigned int x = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < tw && y < th && (unsigned long long)tw * th <= slot)
        frame[(unsigned long long)(y0 + y) * width + x0 + x] = sheet[(unsigned long long)j * slot + (unsigned long long)y * tw + x];
}
"#;
