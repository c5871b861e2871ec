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

/// Renders one tile on the CPU, row-major.
pub fn render_tile(rect: &TileRect, width: u32, height: u32, frame: u64) -> Vec<u32> {
    let t = time_of(frame);
    let mut out = Vec::with_capacity((rect.w * rect.h) as usize);
    for y in rect.y..rect.y + rect.h {
        for x in rect.x..rect.x + rect.w {
            out.push(shade(x, y, width, height, t));
        }
    }
    out
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

extern "C" __global__ void render_tile(unsigned int* out, unsigned int x0, unsigned int y0,
                                       unsigned int tw, unsigned int th,
                                       unsigned int width, unsigned int height, float t) {
    unsigned int x = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < tw && y < th) out[y * tw + x] = shade(x0 + x, y0 + y, width, height, t);
}

extern "C" __global__ void compose_tile(unsigned int* frame, unsigned int frame_w,
                                        const unsigned int* tile, unsigned int x0, unsigned int y0,
                                        unsigned int tw, unsigned int th) {
    unsigned int x = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < tw && y < th) frame[(y0 + y) * frame_w + x0 + x] = tile[y * tw + x];
}
"#;
