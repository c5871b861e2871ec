//! Batched device copies: many copies between one buffer and many device pointers, queued
//! as one kernel launch ([`CopyPlan`]).
//!
//! Loading a model's weights is hundreds to tens of thousands of copies between a bundle
//! and the engine's own tensors. Issued one by one (a torch `copy_` or a
//! `cuMemcpyDtoDAsync` each) the host time to queue them dominates a small model's sync
//! and a many-tensor shard's; `cuMemcpyBatchAsync` (CUDA 12.8+) is no faster to queue or
//! run on driver 580. One launch of a gather kernel that cuts every copy into 64 KiB
//! chunks, one block each, runs within a few percent of one flat copy of the same bytes
//! and queues in microseconds (`bench/probe/batched_copy.py`; `docs/BENCHMARKS.md`).
//!
//! The kernel (`kernels/gather.cu`) ships as PTX for `sm_70` at ISA 7.4, the oldest the
//! drivers Baton supports (CUDA 11.4) compile; the driver compiles it for the device once
//! per backend. Should that fail, a plan falls back to one `cuMemcpyDtoDAsync` per copy.
//!
//! A plan may copy between several buffers ("parts") and the pointers at once
//! ([`CudaBackend::copy_plan_parts`]): a model lent as one allocation per segment of
//! PyTorch's caching allocator loads in one launch, not one per allocation. Its span table
//! then holds absolute addresses of the parts (the kernel's base is 0): it is written at
//! the first run and again whenever a part is at another address than the run before —
//! after the plan's earlier launches complete, with a wait for the run's stream (an
//! importer's cache maps a lent allocation at the same address every sync, so a plan run
//! every sync writes it once).
//!
//! A plan of one copy is one `cuMemcpyDtoDAsync`, not the kernel, and needs no span table:
//! the copy engine moves one range as fast as anything can (across GPUs in one process,
//! 0.98–1.01× torch's peer-to-peer copy where the gather kernel takes 1.055–1.06×:
//! `bench/probe/p2p_copy.py`). So a plan of one buffer run on another GPU's memory mapped
//! here ([`CopyPlan::run_on_peer`]) copies each span of [`PEER_ENGINE_MIN`] bytes or more
//! with the copy engine and launches the kernel for the rest only (a trainer writing an
//! engine's weights on another GPU: 0.93× a peer-to-peer copy's speed with the kernel for
//! 4 GiB, `docs/BENCHMARKS.md`). Within one GPU the kernel stays: copy-engine copies of a
//! model's large tensors, one each, run slower than one launch for all.
//!
//! # Safety
//!
//! A plan's spans are raw device addresses. [`CudaBackend::copy_plan`] checks each one lies
//! inside one allocation of the backend's device when the plan is made; that the memory is
//! still allocated when the plan runs is the caller's promise ([`CopyPlan::run`] is
//! `unsafe`): the Python layer keeps the tensors alive with the plan. The plan's span table
//! is device memory the kernel reads: every launch records an event after it, and the plan
//! waits for those events before it frees the table. The module is unloaded when the last
//! plan and the backend let go of it, with its context pushed.

use super::backend::CudaBackend;
use super::context::ContextGuard;
use super::kernel::Gather;
use super::{SharedContext, result};
use crate::{Error, Result};
use cudarc::driver::{CudaStream, sys};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

/// Bytes per block of the kernel (each block copies one chunk of one span).
const CHUNK: u64 = 64 << 10;
/// Threads per block: 512 ran closest to one flat copy on an H200 (1.7 %, 3.8 % and 3.6 %
/// over it for the Qwen2.5-0.5B and -7B layouts and a 20,000-tensor shard, against 3.6 %,
/// 4.8 % and 4.1 % at 256; `bench/probe/gather_tuning.py`,
/// `docs/bench/h200/2026-11-29-gather-tuning.jsonl`).
const THREADS: u32 = 512;
/// Launches a plan keeps track of before it waits for the oldest (each is one event).
const MAX_PENDING: usize = 64;
/// Bytes from which a span of a run on another GPU's memory goes by the copy engine
/// ([`CopyPlan::run_on_peer`]): where one `cuMemcpyDtoDAsync`'s few microseconds of queueing
/// are a small part of its copy over NVLink (16 MiB: about 45 µs there).
pub const PEER_ENGINE_MIN: u64 = 16 << 20;

/// One copy of a plan: `len` bytes between `ptr` and offset `offset` of the plan's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySpan {
    /// A device address of this process (a tensor's data pointer).
    pub ptr: u64,
    /// Where in the buffer the copy starts.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Which way a plan copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    /// From the buffer to the pointers (a bundle's `copy_into`: loading weights).
    FromBuffer,
    /// From the pointers into the buffer (a bundle's `copy_from`: publishing weights).
    IntoBuffer,
}

/// Many device copies between one buffer and many device pointers of this process, checked
/// once and queued as one kernel launch per [`run`](Self::run) — one copy-engine copy when
/// there is one (see the module docs). Made by [`CudaBackend::copy_plan`].
pub struct CopyPlan {
    ctx: SharedContext,
    /// `None`: the kernel did not load; each span is its own `cuMemcpyDtoDAsync`.
    gather: Option<Arc<Gather>>,
    layout: SpanLayout,
    /// The span table the kernel reads ([`SpanLayout::table`]) in device memory; 0 when
    /// there is none.
    table: sys::CUdeviceptr,
    /// What the launches share: the events recorded after those that may still read the
    /// table, and the part addresses the table was last written for (a plan of several
    /// parts; `None` until its first run).
    pending: Mutex<Pending>,
    /// How a run on another GPU's memory splits the plan ([`run_on_peer`](Self::run_on_peer));
    /// `None` when it would not differ from a plain run.
    peer: Option<PeerRoute>,
}

/// A one-buffer plan's spans of [`PEER_ENGINE_MIN`] bytes or more, copied by the copy
/// engine when the buffer is another GPU's, and the kernel's layout and table of the rest.
struct PeerRoute {
    /// Indices into the plan's spans.
    large: Vec<usize>,
    /// The other spans (none, one: a copy-engine copy too, or several: one launch).
    rest: SpanLayout,
    /// `rest`'s span table (offsets within the buffer), 0 when `rest` does not launch.
    table: sys::CUdeviceptr,
}

/// A plan's launches in flight, and the parts its table was written for.
#[derive(Default)]
struct Pending {
    events: Vec<sys::CUevent>,
    written_for: Option<Vec<u64>>,
}

// SAFETY: the raw handles (table, events) are used only with the context pushed, and the
// event list only under its mutex; the driver allows any thread to use them.
unsafe impl Send for CopyPlan {}
// SAFETY: as above.
unsafe impl Sync for CopyPlan {}

impl std::fmt::Debug for CopyPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyPlan")
            .field("spans", &self.layout.spans.len())
            .field("parts", &self.layout.ends.len())
            .field("ends", &self.layout.ends)
            .field("kernel", &self.gather.is_some())
            .field(
                "peer_engine_spans",
                &self.peer.as_ref().map(|r| r.large.len()),
            )
            .finish()
    }
}

/// A plan's spans, checked and laid out for the kernel, with no driver involved.
#[derive(Debug)]
struct SpanLayout {
    /// The non-empty spans, in the order given.
    spans: Vec<CopySpan>,
    /// The part (buffer) of each span.
    parts: Vec<u32>,
    /// Bytes per chunk (one kernel block each).
    chunk: u64,
    /// Chunks in all: the launch's blocks.
    chunks: u32,
    /// The bytes the plan reaches in each part: its spans' largest `offset + len`.
    ends: Vec<u64>,
    /// The spans' pointer ranges sorted by start, each with the largest end so far: where
    /// a buffer must not be (one run would read and write the same bytes).
    by_ptr: Vec<(u64, u64)>,
}

impl SpanLayout {
    /// A layout of one part.
    #[cfg(test)]
    fn new(spans: &[CopySpan], chunk: u64) -> Result<Self> {
        Self::of_parts(&[spans], chunk)
    }

    fn of_parts(parts: &[&[CopySpan]], chunk: u64) -> Result<Self> {
        let part_count = u32::try_from(parts.len())
            .map_err(|_| refused(format!("{} parts: too many", parts.len())))?;
        let mut spans = Vec::new();
        let mut part_of = Vec::new();
        let mut ends = vec![0u64; parts.len()];
        let mut chunks = 0u64;
        let mut by_ptr = Vec::new();
        for (part, list) in (0..part_count).zip(parts) {
            for s in list.iter().filter(|s| s.len > 0) {
                let i = spans.len();
                let (Some(ptr_end), Some(buf_end)) =
                    (s.ptr.checked_add(s.len), s.offset.checked_add(s.len))
                else {
                    return Err(refused(format!("copy {i} reaches past 2^64")));
                };
                ends[part as usize] = ends[part as usize].max(buf_end);
                chunks += s.len.div_ceil(chunk);
                by_ptr.push((s.ptr, ptr_end));
                spans.push(*s);
                part_of.push(part);
            }
        }
        let chunks = u32::try_from(chunks)
            .ok()
            .filter(|&c| c <= i32::MAX as u32)
            .ok_or_else(|| {
                refused(format!(
                    "{chunks} chunks of {chunk} bytes: too many for one launch"
                ))
            })?;
        by_ptr.sort_unstable();
        let mut reach = 0;
        for r in &mut by_ptr {
            reach = reach.max(r.1);
            r.1 = reach;
        }
        Ok(Self {
            spans,
            parts: part_of,
            chunk,
            chunks,
            ends,
            by_ptr,
        })
    }

    /// The indices of the spans of `min` bytes or more and the layout of the others (one
    /// part's), or `None` when there is no such span.
    fn split(&self, min: u64) -> Result<Option<(Vec<usize>, SpanLayout)>> {
        let (large, rest): (Vec<usize>, Vec<usize>) =
            (0..self.spans.len()).partition(|&i| self.spans[i].len >= min);
        if large.is_empty() {
            return Ok(None);
        }
        let rest: Vec<CopySpan> = rest.into_iter().map(|i| self.spans[i]).collect();
        Ok(Some((large, Self::of_parts(&[&rest], self.chunk)?)))
    }

    /// The table the kernel reads: `ptr, offset, len, first chunk` per span, each offset
    /// from `bases[part]` (all 0: offsets within the part, for a kernel given the one
    /// part's address).
    fn table(&self, bases: &[u64]) -> Vec<u64> {
        let mut words = Vec::with_capacity(self.spans.len() * 4);
        let mut first = 0;
        for (s, &part) in self.spans.iter().zip(&self.parts) {
            words.extend_from_slice(&[s.ptr, bases[part as usize] + s.offset, s.len, first]);
            first += s.len.div_ceil(self.chunk);
        }
        words
    }

    /// Whether a run on the buffers `parts` (`(address, bytes)`, one per part of the
    /// plan) may go ahead.
    fn check(&self, parts: &[(u64, usize)], direction: CopyDirection) -> Result<()> {
        if parts.len() != self.ends.len() {
            return Err(refused(format!(
                "the plan copies between {} buffers and its tensors; {} were given",
                self.ends.len(),
                parts.len()
            )));
        }
        for (&(base, len), &end) in parts.iter().zip(&self.ends) {
            self.check_part(base, len, end, direction)?;
        }
        Ok(())
    }

    /// Whether one part at `base` (`len` bytes) holds the plan's `end` bytes of it and
    /// overlaps no span's pointer range.
    fn check_part(&self, base: u64, len: usize, end: u64, direction: CopyDirection) -> Result<()> {
        if end > len as u64 {
            return Err(Error::OutOfBounds {
                offset: 0,
                len: usize::try_from(end).unwrap_or(usize::MAX),
                size: len,
            });
        }
        let Some(buf_end) = base.checked_add(end) else {
            return Err(refused(format!(
                "a buffer at {base:#x} of {end} bytes reaches past 2^64"
            )));
        };
        // Ranges starting before the buffer's end; the last of them reaches furthest.
        let before = self.by_ptr.partition_point(|r| r.0 < buf_end);
        if before > 0 && self.by_ptr[before - 1].1 > base {
            return Err(refused(format!(
                "the buffer at {base:#x} overlaps memory the plan copies {}",
                match direction {
                    CopyDirection::FromBuffer => "into",
                    CopyDirection::IntoBuffer => "from",
                }
            )));
        }
        Ok(())
    }
}

fn refused(reason: String) -> Error {
    Error::CopyRefused { reason }
}

impl CudaBackend {
    /// A plan of `spans` between a buffer and device pointers of this process: each
    /// span's `ptr..ptr + len` must lie inside one allocation on this backend's device
    /// (checked here, once: `cuMemGetAddressRange` and the pointer's device). Spans of
    /// zero bytes are dropped. The kernel is loaded on the backend's first plan.
    ///
    /// # Errors
    /// [`Error::CopyRefused`] for a span outside any allocation, on another device, or
    /// past `u64`; [`Error::Cuda`].
    pub fn copy_plan(&self, spans: &[CopySpan]) -> Result<CopyPlan> {
        self.copy_plan_parts(&[spans])
    }

    /// A plan of copies between several buffers — `parts[i]`'s spans have offsets in
    /// buffer `i` — and device pointers of this process, queued as one launch per run
    /// ([`run_parts`](CopyPlan::run_parts)); checked as [`copy_plan`](Self::copy_plan)'s.
    ///
    /// # Errors
    /// As [`copy_plan`](Self::copy_plan).
    pub fn copy_plan_parts(&self, parts: &[&[CopySpan]]) -> Result<CopyPlan> {
        let layout = SpanLayout::of_parts(parts, CHUNK)?;
        let ordinal = self.ordinal() as i32;
        {
            let _pushed = ContextGuard::push(&self.access.ctx)?;
            for (i, s) in layout.spans.iter().enumerate() {
                // SAFETY: a context is current.
                let (base, size) =
                    unsafe { result::mem_get_address_range(s.ptr) }.map_err(|e| {
                        refused(format!(
                            "copy {i}: {:#x} is not device memory of this process ({e})",
                            s.ptr
                        ))
                    })?;
                if s.ptr + s.len > base.saturating_add(size as u64) {
                    return Err(refused(format!(
                        "copy {i}: {} bytes at {:#x} reach past the allocation that holds it ({size} bytes at {base:#x})",
                        s.len, s.ptr
                    )));
                }
                // SAFETY: the driver is initialised.
                let device = unsafe { result::pointer_device_ordinal(s.ptr) }?;
                if device != ordinal {
                    return Err(refused(format!(
                        "copy {i}: {:#x} is memory of device {device}; this backend's is {ordinal}",
                        s.ptr
                    )));
                }
            }
        }
        let gather = match self.gather() {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::warn!(error = %e, "Baton's copy kernel did not load: copies are queued one by one");
                None
            }
        };
        let mut plan = CopyPlan {
            ctx: Arc::clone(&self.access.ctx),
            gather,
            layout,
            table: 0,
            pending: Mutex::default(),
            peer: None,
        };
        let stream = self.access.stream.cu_stream();
        if plan.launches() {
            plan.table = plan.allocate_table(plan.layout.spans.len())?;
            if plan.layout.ends.len() == 1 {
                // Offsets within the one part: written once, for every buffer it runs on.
                plan.write_table(plan.table, &plan.layout, &[0], stream)?;
            }
            plan.peer = plan.peer_route(stream)?;
        }
        Ok(plan)
    }

    /// The kernel of this backend's context, loaded on first use.
    fn gather(&self) -> std::result::Result<Arc<Gather>, String> {
        self.gather
            .get_or_init(|| {
                Gather::load(&self.access.ctx)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
    }
}

impl CopyPlan {
    /// The buffer bytes the plan reaches (a buffer it runs on must have at least these;
    /// the most of any part, for a plan of several).
    pub fn end(&self) -> u64 {
        self.layout.ends.iter().copied().max().unwrap_or(0)
    }

    /// The bytes the plan reaches in each of its buffers.
    pub fn ends(&self) -> &[u64] {
        &self.layout.ends
    }

    /// How many copies (of one byte or more) the plan makes.
    pub fn len(&self) -> usize {
        self.layout.spans.len()
    }

    /// Whether the plan copies nothing.
    pub fn is_empty(&self) -> bool {
        self.layout.spans.is_empty()
    }

    /// Whether a run is one driver operation: one kernel launch, or the one copy of a plan
    /// of one (`false`: the kernel did not load, and each of several copies is queued on
    /// its own).
    pub fn batched(&self) -> bool {
        self.gather.is_some() || self.layout.spans.len() <= 1
    }

    /// Whether runs launch the kernel: it loaded and there are two copies or more (one is
    /// a copy-engine copy).
    fn launches(&self) -> bool {
        self.gather.is_some() && self.layout.spans.len() > 1
    }

    /// Allocates a span table of `spans` entries (freed in `Drop`).
    fn allocate_table(&self, spans: usize) -> Result<sys::CUdeviceptr> {
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: a context is current; the table is freed once, in `Drop`.
        unsafe { result::mem_alloc(spans * 32) }
    }

    /// The split of a one-buffer plan that has spans of [`PEER_ENGINE_MIN`] bytes or more,
    /// its table of the rest written; `None` for any other plan.
    fn peer_route(&self, stream: sys::CUstream) -> Result<Option<PeerRoute>> {
        if self.layout.ends.len() != 1 {
            return Ok(None);
        }
        let Some((large, rest)) = self.layout.split(PEER_ENGINE_MIN)? else {
            return Ok(None);
        };
        let mut route = PeerRoute {
            large,
            rest,
            table: 0,
        };
        if route.rest.spans.len() > 1 {
            route.table = self.allocate_table(route.rest.spans.len())?;
            if let Err(e) = self.write_table(route.table, &route.rest, &[0], stream) {
                self.free_table(route.table);
                return Err(e);
            }
        }
        Ok(Some(route))
    }

    /// Writes `layout`'s span table for parts at `bases` into `table`, on `stream`, and
    /// waits for it. The caller has the context pushed or pushes it here, and no launch
    /// that reads the table is pending.
    fn write_table(
        &self,
        table: sys::CUdeviceptr,
        layout: &SpanLayout,
        bases: &[u64],
        stream: sys::CUstream,
    ) -> Result<()> {
        let bytes: Vec<u8> = layout
            .table(bases)
            .iter()
            .flat_map(|w| w.to_ne_bytes())
            .collect();
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: `table` holds one 32-byte entry per span; `stream` is live in this
        // context; synchronised below, before `bytes` goes.
        unsafe { result::memcpy_htod_async(table, &bytes, stream) }?;
        // SAFETY: as above.
        unsafe { result::stream_synchronize(stream) }
    }

    /// Queues the plan's copies on `stream`, between the buffer at `base` (`len` bytes)
    /// and the plan's pointers, in `direction`: [`run_parts`](Self::run_parts) for a
    /// plan of one part.
    ///
    /// # Errors
    /// As [`run_parts`](Self::run_parts).
    ///
    /// # Safety
    /// As [`run_parts`](Self::run_parts).
    pub unsafe fn run(
        &self,
        base: u64,
        len: usize,
        direction: CopyDirection,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: the caller's promise.
        unsafe { self.run_parts(&[(base, len)], direction, stream) }
    }

    /// Queues the plan's copies on `stream`, between its buffers — `parts[i]` the address
    /// and bytes of part `i` — and the plan's pointers, in `direction`. A plan of several
    /// parts writes its span table at its first run and when a part moved since the run
    /// before (see the module docs).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when a buffer is shorter than the plan reaches in it;
    /// [`Error::CopyRefused`] when the number of buffers is not the plan's, a buffer
    /// overlaps a span's pointer range, or (into buffers) two buffers overlap;
    /// [`Error::Cuda`].
    ///
    /// # Safety
    /// Each `base..base + len` is device memory this process may read (and, for
    /// [`CopyDirection::IntoBuffer`], write), and every span's pointer range is still
    /// allocated memory that may be written (read, for `IntoBuffer`), both until the
    /// copies complete; `stream` is a live stream of the backend's context. Work on other
    /// streams that uses either side is the caller's to order.
    pub unsafe fn run_parts(
        &self,
        parts: &[(u64, usize)],
        direction: CopyDirection,
        stream: &CudaStream,
    ) -> Result<()> {
        self.layout.check(parts, direction)?;
        if direction == CopyDirection::IntoBuffer {
            disjoint(parts, &self.layout.ends)?;
        }
        if self.layout.spans.is_empty() {
            return Ok(());
        }
        let raw = stream.cu_stream();
        let _pushed = ContextGuard::push(&self.ctx)?;
        let Some(gather) = self.gather.as_ref().filter(|_| self.launches()) else {
            for (s, &part) in self.layout.spans.iter().zip(&self.layout.parts) {
                let base = parts[part as usize].0;
                let (src, dst) = match direction {
                    CopyDirection::FromBuffer => (base + s.offset, s.ptr),
                    CopyDirection::IntoBuffer => (s.ptr, base + s.offset),
                };
                // SAFETY: both ranges are valid device memory (the caller's promise and the
                // bounds checked above); the stream is live in this context.
                unsafe { result::memcpy_dtod_async(dst, src, s.len as usize, raw) }?;
            }
            return Ok(());
        };
        let mut pending = self.lock_pending();
        // One part: offsets within it, the kernel given its address. Several: the table
        // holds their addresses, the kernel's base is 0.
        let base_arg = if parts.len() == 1 {
            parts[0].0
        } else {
            let bases: Vec<u64> = parts.iter().map(|p| p.0).collect();
            if pending.written_for.as_ref() != Some(&bases) {
                self.retire(&mut pending.events, 0)?;
                self.write_table(self.table, &self.layout, &bases, raw)?;
                pending.written_for = Some(bases);
            }
            0
        };
        // SAFETY: the caller's promise; the table is this layout's.
        unsafe {
            self.launch(
                gather,
                &mut pending,
                (base_arg, self.table, &self.layout),
                direction,
                raw,
            )
        }
    }

    /// Queues the plan's copies on `stream` between its one buffer at `base` (`len` bytes),
    /// which is another GPU's memory mapped here, and its pointers: each span of
    /// [`PEER_ENGINE_MIN`] bytes or more as a copy-engine copy, one launch for the rest (see
    /// the module docs). A plan with no such span, or of several buffers, runs as
    /// [`run`](Self::run).
    ///
    /// # Errors
    /// As [`run_parts`](Self::run_parts).
    ///
    /// # Safety
    /// As [`run_parts`](Self::run_parts).
    pub unsafe fn run_on_peer(
        &self,
        base: u64,
        len: usize,
        direction: CopyDirection,
        stream: &CudaStream,
    ) -> Result<()> {
        let Some(route) = self.peer.as_ref() else {
            // SAFETY: the caller's promise.
            return unsafe { self.run(base, len, direction, stream) };
        };
        self.layout.check(&[(base, len)], direction)?;
        let raw = stream.cu_stream();
        let _pushed = ContextGuard::push(&self.ctx)?;
        let one = |s: &CopySpan| {
            let (src, dst) = match direction {
                CopyDirection::FromBuffer => (base + s.offset, s.ptr),
                CopyDirection::IntoBuffer => (s.ptr, base + s.offset),
            };
            // SAFETY: both ranges are valid device memory (the caller's promise and the
            // bounds checked above); the stream is live in this context.
            unsafe { result::memcpy_dtod_async(dst, src, s.len as usize, raw) }
        };
        for &i in &route.large {
            one(&self.layout.spans[i])?;
        }
        match (route.rest.spans.as_slice(), self.gather.as_ref()) {
            ([], _) => Ok(()),
            ([s], _) => one(s),
            (_, Some(gather)) => {
                let mut pending = self.lock_pending();
                // SAFETY: the caller's promise; the table is `rest`'s.
                unsafe {
                    self.launch(
                        gather,
                        &mut pending,
                        (base, route.table, &route.rest),
                        direction,
                        raw,
                    )
                }
            }
            (spans, None) => spans.iter().try_for_each(one),
        }
    }

    /// Launches the kernel over `layout`'s spans, its table at `table`, the buffer's
    /// address `base` (0 for a table of absolute addresses), and records the launch's
    /// event. The caller pushed the context.
    ///
    /// # Safety
    /// As [`run_parts`](Self::run_parts); `table` holds `layout`'s spans.
    unsafe fn launch(
        &self,
        gather: &Gather,
        pending: &mut Pending,
        (base, table, layout): (u64, sys::CUdeviceptr, &SpanLayout),
        direction: CopyDirection,
        raw: sys::CUstream,
    ) -> Result<()> {
        let mut base_arg = base;
        let mut table = table;
        let mut n = layout.spans.len() as u32;
        let mut chunk = layout.chunk;
        let mut into: i32 = (direction == CopyDirection::FromBuffer).into();
        let mut params: [*mut c_void; 5] = [
            (&mut base_arg as *mut u64).cast(),
            (&mut table as *mut sys::CUdeviceptr).cast(),
            (&mut n as *mut u32).cast(),
            (&mut chunk as *mut u64).cast(),
            (&mut into as *mut i32).cast(),
        ];
        self.retire(&mut pending.events, MAX_PENDING - 1)?;
        // SAFETY: the parameters match `baton_gather(u64, const Span*, u32, u64, i32)`; the
        // table lives until the event recorded below completes (`Drop`); the memory the
        // spans and the buffers name is valid (the caller's promise, bounds checked above).
        unsafe {
            result::launch_kernel(gather.function(), layout.chunks, THREADS, raw, &mut params)
        }?;
        // SAFETY: a context is current; the event is destroyed once (`retire`, `Drop`).
        let event = unsafe { result::event_create() }?;
        pending.events.push(event);
        // SAFETY: the event and the stream are live in this context.
        unsafe { result::event_record(event, raw) }
    }

    /// Frees a span table (0: none) once no launch can read it.
    fn free_table(&self, table: sys::CUdeviceptr) {
        if table == 0 {
            return;
        }
        let Ok(_pushed) = ContextGuard::push(&self.ctx) else {
            tracing::warn!("a copy plan's context could not be pushed: its span table stays");
            return;
        };
        // SAFETY: allocated in `allocate_table`, freed once, after every launch that read
        // it (the caller's promise).
        if let Err(e) = unsafe { result::mem_free(table) } {
            tracing::warn!(error = %e, "freeing a copy plan's span table failed");
        }
    }

    fn lock_pending(&self) -> MutexGuard<'_, Pending> {
        // Each critical section leaves the events and the parts written for consistent.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Destroys the events of completed launches; waits for the oldest while more than
    /// `keep` are pending. The caller pushed the context.
    fn retire(&self, pending: &mut Vec<sys::CUevent>, keep: usize) -> Result<()> {
        let mut kept = Vec::with_capacity(pending.len());
        for &ev in pending.iter() {
            // SAFETY: a live event of this context.
            if unsafe { result::event_query(ev) }? {
                // SAFETY: completed, destroyed once.
                unsafe { result::event_destroy(ev) }?;
            } else {
                kept.push(ev);
            }
        }
        while kept.len() > keep {
            let ev = kept.remove(0);
            // SAFETY: a live event of this context.
            unsafe { result::event_synchronize(ev) }?;
            // SAFETY: completed, destroyed once.
            unsafe { result::event_destroy(ev) }?;
        }
        *pending = kept;
        Ok(())
    }
}

/// Refuses buffers to be written that overlap each other (`ends[i]` bytes of each).
fn disjoint(parts: &[(u64, usize)], ends: &[u64]) -> Result<()> {
    let mut ranges: Vec<(u64, u64)> = parts
        .iter()
        .zip(ends)
        .filter(|&(_, &end)| end > 0)
        .map(|(&(base, _), &end)| (base, base.saturating_add(end)))
        .collect();
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(refused(
            "two buffers the plan copies into overlap".to_string(),
        ));
    }
    Ok(())
}

impl Drop for CopyPlan {
    fn drop(&mut self) {
        let Ok(_pushed) = ContextGuard::push(&self.ctx) else {
            tracing::warn!("a copy plan's context could not be pushed: its span table stays");
            return;
        };
        let mut synced = true;
        for ev in std::mem::take(&mut self.lock_pending().events) {
            // SAFETY: a live event of this context.
            if let Err(e) = unsafe { result::event_synchronize(ev) } {
                tracing::warn!(error = %e, "waiting for a batched copy failed");
                synced = false;
            }
            // SAFETY: destroyed once (the driver frees a pending one when it completes).
            let _ = unsafe { result::event_destroy(ev) };
        }
        let tables = [self.table, self.peer.as_ref().map_or(0, |r| r.table)];
        if tables.iter().any(|&t| t != 0) && !synced {
            // Freeing memory a launch may still read would break the freeing rule: keep
            // it (the context's error makes further launches fail anyway).
            tracing::warn!("a batched copy did not complete: its span table is not freed");
            return;
        }
        for table in tables {
            self.free_table(table);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The kernel's arithmetic — which span a block copies, the head, words and tail of its
    //! chunk — emulated on host bytes, against plain copies; and the checks a run makes.
    //! The PTX itself runs in the GPU tests (`tests/actors_cuda.rs`, Python's
    //! `test_cuda.py`).
    use super::*;
    use proptest::prelude::*;

    /// What `baton_gather` does, block by block, with addresses as indices into `mem`.
    fn emulate(layout: &SpanLayout, base: u64, direction: CopyDirection, mem: &mut [u8]) {
        emulate_table(layout, &layout.table(&[0]), base, direction, mem);
    }

    /// What `baton_gather` does with `table`, given `base`.
    fn emulate_table(
        layout: &SpanLayout,
        table: &[u64],
        base: u64,
        direction: CopyDirection,
        mem: &mut [u8],
    ) {
        let n = table.len() / 4;
        let into = direction == CopyDirection::FromBuffer;
        for c in 0..u64::from(layout.chunks) {
            let (mut lo, mut hi) = (0, n);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if table[mid * 4 + 3] <= c {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            let (ptr, off, len, first) = (
                table[lo * 4],
                table[lo * 4 + 1],
                table[lo * 4 + 2],
                table[lo * 4 + 3],
            );
            let at = (c - first) * layout.chunk;
            assert!(
                at < len,
                "block {c} has no bytes: the grid counts chunks exactly"
            );
            let len = (len - at).min(layout.chunk);
            let (src, dst) = if into {
                (base + off + at, ptr + at)
            } else {
                (ptr + at, base + off + at)
            };
            let (head, words) = if (src ^ dst) & 15 == 0 {
                let head = ((16 - (src & 15)) & 15).min(len);
                (head, (len - head) / 16)
            } else {
                (len, 0)
            };
            let tail = head + words * 16;
            // Head, words and tail cover the chunk exactly once.
            assert!(tail <= len && (words == 0 || (src + head) % 16 == 0));
            for k in 0..len {
                mem[(dst + k) as usize] = mem[(src + k) as usize];
            }
        }
    }

    fn model(spans: &[CopySpan], base: u64, direction: CopyDirection, mem: &mut [u8]) {
        for s in spans {
            let (src, dst) = match direction {
                CopyDirection::FromBuffer => (base + s.offset, s.ptr),
                CopyDirection::IntoBuffer => (s.ptr, base + s.offset),
            };
            let bytes = mem[src as usize..(src + s.len) as usize].to_vec();
            mem[dst as usize..(dst + s.len) as usize].copy_from_slice(&bytes);
        }
    }

    /// Spans of `sizes` bytes at `gaps` apart, after a buffer of `buffer` bytes at 0, each
    /// at an offset of the buffer given by `offsets` (disjoint in the buffer too).
    fn spans_of(sizes: &[u64], gaps: &[u64]) -> (Vec<CopySpan>, u64) {
        let buffer: u64 = sizes.iter().zip(gaps).map(|(s, g)| s + g).sum();
        let (mut ptr, mut offset) = (buffer + 7, 3);
        let mut spans = Vec::new();
        for (&len, &gap) in sizes.iter().zip(gaps) {
            spans.push(CopySpan { ptr, offset, len });
            ptr += len + gap;
            offset += len + gap;
        }
        (spans, ptr)
    }

    fn check_both_ways(spans: &[CopySpan], top: u64, chunk: u64) {
        let layout = SpanLayout::new(spans, chunk).expect("a valid plan");
        for direction in [CopyDirection::FromBuffer, CopyDirection::IntoBuffer] {
            let mut mem: Vec<u8> = (0..top + 64).map(|i| (i * 7 + 1) as u8).collect();
            let mut want = mem.clone();
            layout
                .check(&[(0, layout.ends[0] as usize)], direction)
                .expect("no overlap");
            emulate(&layout, 0, direction, &mut mem);
            model(spans, 0, direction, &mut want);
            assert_eq!(mem, want, "{direction:?} of {} spans", spans.len());
        }
    }

    #[test]
    fn an_empty_plan_copies_nothing_and_needs_no_buffer() {
        let layout = SpanLayout::new(&[], CHUNK).unwrap();
        assert_eq!((layout.chunks, layout.ends.as_slice()), (0, &[0][..]));
        assert!(layout.table(&[0]).is_empty());
        layout
            .check(&[(0x1000, 0)], CopyDirection::FromBuffer)
            .unwrap();
        let zero = [CopySpan {
            ptr: 64,
            offset: 0,
            len: 0,
        }];
        let layout = SpanLayout::new(&zero, CHUNK).unwrap();
        assert!(layout.spans.is_empty(), "spans of zero bytes are dropped");
    }

    #[test]
    fn one_tensor_mixed_sizes_and_unaligned_sizes_copy_exactly() {
        // One tensor; bf16 and f32 and int64 sizes; odd sizes; a scalar; across chunks.
        for sizes in [
            vec![4096],
            vec![2, 1792, 8, 4, 3, 1, 4097, 256 * 3 + 5],
            vec![1, 1, 1, 1],
            vec![100_000, 17, 65_536, 65_537],
        ] {
            let gaps: Vec<u64> = sizes.iter().map(|s| s % 13 + 1).collect();
            let (spans, top) = spans_of(&sizes, &gaps);
            for chunk in [16, 256, 4096, CHUNK] {
                check_both_ways(&spans, top, chunk);
            }
        }
    }

    #[test]
    fn a_buffer_too_short_or_overlapping_the_tensors_is_refused() {
        let spans = [
            CopySpan {
                ptr: 10_000,
                offset: 0,
                len: 100,
            },
            CopySpan {
                ptr: 20_000,
                offset: 512,
                len: 100,
            },
        ];
        let layout = SpanLayout::new(&spans, CHUNK).unwrap();
        assert_eq!(layout.ends, [612]);
        assert!(matches!(
            layout.check(&[(0, 611)], CopyDirection::FromBuffer),
            Err(Error::OutOfBounds { size: 611, .. })
        ));
        layout
            .check(&[(0, 612)], CopyDirection::FromBuffer)
            .unwrap();
        // Overlapping the first tensor, the second, or lying between them.
        for base in [9_500, 9_900, 10_099, 19_400, 20_099] {
            assert!(
                matches!(
                    layout.check(&[(base, 612)], CopyDirection::IntoBuffer),
                    Err(Error::CopyRefused { .. })
                ),
                "a buffer at {base} overlaps a tensor"
            );
        }
        for base in [9_388, 10_100, 19_388 - 612 + 600, 20_100] {
            layout
                .check(&[(base, 612)], CopyDirection::FromBuffer)
                .unwrap();
        }
        assert!(matches!(
            SpanLayout::new(
                &[CopySpan {
                    ptr: u64::MAX - 2,
                    offset: 0,
                    len: 4
                }],
                CHUNK
            ),
            Err(Error::CopyRefused { .. })
        ));
        assert!(matches!(
            layout.check(&[(u64::MAX - 100, 612)], CopyDirection::FromBuffer),
            Err(Error::CopyRefused { .. })
        ));
    }

    /// Spans of `sizes` bytes spread over `parts` buffers (span `i` in part `i % parts`),
    /// each buffer and the pointers laid out apart in one address space: the parts' spans,
    /// their buffers' `(address, bytes)` and the top address.
    fn parts_of(sizes: &[u64], parts: usize) -> (Vec<Vec<CopySpan>>, Vec<(u64, usize)>, u64) {
        let mut lists = vec![Vec::new(); parts];
        let mut offsets = vec![5u64; parts];
        let mut ptr = 0;
        for (i, &len) in sizes.iter().enumerate() {
            let part = i % parts;
            lists[part].push(CopySpan {
                ptr,
                offset: offsets[part],
                len,
            });
            offsets[part] += len + (i as u64 % 7);
            ptr += len + 3;
        }
        let mut bufs = Vec::new();
        let mut at = ptr + 64;
        for &size in &offsets {
            bufs.push((at, size as usize));
            at += size + 33;
        }
        (lists, bufs, at)
    }

    fn check_parts_both_ways(sizes: &[u64], parts: usize, chunk: u64) {
        let (lists, bufs, top) = parts_of(sizes, parts);
        let slices: Vec<&[CopySpan]> = lists.iter().map(Vec::as_slice).collect();
        let layout = SpanLayout::of_parts(&slices, chunk).expect("a valid plan");
        let bases: Vec<u64> = bufs.iter().map(|b| b.0).collect();
        for direction in [CopyDirection::FromBuffer, CopyDirection::IntoBuffer] {
            layout.check(&bufs, direction).expect("no overlap");
            disjoint(&bufs, &layout.ends).expect("apart");
            let mut mem: Vec<u8> = (0..top).map(|i| (i * 11 + 3) as u8).collect();
            let mut want = mem.clone();
            emulate_table(&layout, &layout.table(&bases), 0, direction, &mut mem);
            for (list, &(base, _)) in lists.iter().zip(&bufs) {
                model(list, base, direction, &mut want);
            }
            assert_eq!(mem, want, "{direction:?} of {sizes:?} over {parts} parts");
        }
    }

    #[test]
    fn a_plan_of_several_parts_copies_each_part_at_its_own_address() {
        for (sizes, parts) in [
            (vec![100, 7, 4096, 1, 70_000], 3),
            (vec![5, 9], 2),
            (vec![256; 12], 5),
            (vec![1], 4), // parts with no copy
            (vec![], 2),
        ] {
            for chunk in [16, 4096, CHUNK] {
                check_parts_both_ways(&sizes, parts, chunk);
            }
        }
    }

    #[test]
    fn a_run_of_several_parts_checks_each_part() {
        let (lists, bufs, _) = parts_of(&[100, 200, 300, 400], 2);
        let slices: Vec<&[CopySpan]> = lists.iter().map(Vec::as_slice).collect();
        let layout = SpanLayout::of_parts(&slices, CHUNK).unwrap();
        assert_eq!(layout.ends.len(), 2);
        // Too few or too many buffers.
        for wrong in [&bufs[..1], &[bufs[0], bufs[1], bufs[1]][..]] {
            assert!(matches!(
                layout.check(wrong, CopyDirection::FromBuffer),
                Err(Error::CopyRefused { .. })
            ));
        }
        // The second part too short for its spans.
        let short = [bufs[0], (bufs[1].0, layout.ends[1] as usize - 1)];
        assert!(matches!(
            layout.check(&short, CopyDirection::FromBuffer),
            Err(Error::OutOfBounds { .. })
        ));
        // The second part over the tensors' memory (pointers start at 0).
        let over = [bufs[0], (50, bufs[1].1)];
        assert!(matches!(
            layout.check(&over, CopyDirection::IntoBuffer),
            Err(Error::CopyRefused { .. })
        ));
        // Two buffers written that overlap each other.
        let twice = [bufs[0], (bufs[0].0 + 1, bufs[1].1)];
        layout.check(&twice, CopyDirection::IntoBuffer).unwrap();
        assert!(matches!(
            disjoint(&twice, &layout.ends),
            Err(Error::CopyRefused { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn the_kernels_chunks_copy_what_plain_copies_do(
            sizes in prop::collection::vec(0u64..3_000, 0..40),
            chunk_pow in 4u32..13,
        ) {
            let gaps: Vec<u64> = sizes.iter().enumerate().map(|(i, _)| (i as u64 * 5) % 19).collect();
            let (spans, top) = spans_of(&sizes, &gaps);
            check_both_ways(&spans, top, 1 << chunk_pow);
        }

        #[test]
        fn a_run_on_another_gpus_memory_copies_what_plain_copies_do(
            sizes in prop::collection::vec(0u64..3_000, 0..40),
            min in 1u64..3_000,
            chunk_pow in 4u32..13,
        ) {
            // `run_on_peer`: the spans of `min` bytes or more one copy each, the kernel for
            // the rest, together what plain copies of every span do.
            let gaps: Vec<u64> = sizes.iter().enumerate().map(|(i, _)| (i as u64 * 3) % 17).collect();
            let (spans, top) = spans_of(&sizes, &gaps);
            let layout = SpanLayout::new(&spans, 1 << chunk_pow).unwrap();
            let Some((large, rest)) = layout.split(min).unwrap() else {
                prop_assert!(layout.spans.iter().all(|s| s.len < min));
                return Ok(());
            };
            prop_assert!(large.iter().all(|&i| layout.spans[i].len >= min));
            prop_assert!(rest.spans.iter().all(|s| s.len < min));
            prop_assert_eq!(large.len() + rest.spans.len(), layout.spans.len());
            for direction in [CopyDirection::FromBuffer, CopyDirection::IntoBuffer] {
                let mut mem: Vec<u8> = (0..top + 64).map(|i| (i * 5 + 2) as u8).collect();
                let mut want = mem.clone();
                let engine: Vec<CopySpan> = large.iter().map(|&i| layout.spans[i]).collect();
                model(&engine, 0, direction, &mut mem);
                emulate(&rest, 0, direction, &mut mem);
                model(&spans, 0, direction, &mut want);
                prop_assert_eq!(&mem, &want, "{:?}", direction);
            }
        }

        #[test]
        fn a_plan_of_parts_copies_what_plain_copies_do(
            sizes in prop::collection::vec(0u64..3_000, 0..40),
            parts in 1usize..6,
            chunk_pow in 4u32..13,
        ) {
            check_parts_both_ways(&sizes, parts, 1 << chunk_pow);
        }
    }
}
