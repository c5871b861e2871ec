//! Batched device copies in Python (`baton._baton._CopyPlan`): the Rust
//! [`baton_ipc::cuda::CopyPlan`] between one or several `Lease`s or `Buffer`s and many
//! tensors, one kernel launch per run. `baton.CopyPlan` (`baton/bundle.py`) makes its
//! spans from a bundle layout (or a bundle group's layouts) and torch tensors;
//! `BundleLease.copy_into`, `BundleGroupLease.copy_into` and `Bundle.copy_from` run it.
//!
//! # Safety
//!
//! A run writes (or reads) the plan's raw device pointers. The plan keeps `keep` — the
//! tensors' storages — for its whole life, so every pointer stays allocated memory while a
//! run may use it (the plan checked each span against its allocation when it was made). The
//! buffer side — each buffer of a plan of several — is held by a view guard for the run,
//! as any view of it is, so it stays mapped; a lease given back later waits for the work queued on the device (or records its
//! release fence on the stream the copies ran on, when opened stream-ordered), as for a
//! torch view of it.

#![allow(unsafe_code)]

use crate::errors::{Failure, OrRaise};
use crate::memory::device_memory;
use baton_ipc::Stream;
use baton_ipc::cuda::{CopyDirection, CopyPlan as Plan, CopySpan, CudaBackend};
use pyo3::prelude::*;
use pyo3::types::PyList;
use std::sync::Arc;

/// Copies between device buffers (`Lease`s or `Buffer`s) and many device tensors, by their
/// data pointers: `memory` is one buffer and `spans` a list of `(pointer, offset in the
/// buffer, bytes)`, or `memory` is a list of buffers (its *parts*) and `spans` a list of
/// such lists, one per part; `memory` picks the device (the plan is checked against its
/// allocations once, here); `keep` is kept alive as long as the plan (the tensors'
/// storages). Made once, run every sync, on buffers of the same number and sizes.
#[pyclass(frozen, module = "baton._baton", name = "_CopyPlan")]
pub(crate) struct CopyPlan {
    plan: Plan,
    cuda: Arc<CudaBackend>,
    /// Whether it runs on a list of buffers.
    parts: bool,
    /// What keeps the pointers allocated.
    _keep: Py<PyAny>,
}

/// One buffer or the list of them, as `_CopyPlan` takes them.
fn memories<'py>(memory: &Bound<'py, PyAny>) -> PyResult<(Vec<Bound<'py, PyAny>>, bool)> {
    match memory.cast::<PyList>() {
        Ok(list) => Ok((list.iter().collect(), true)),
        Err(_) => Ok((vec![memory.clone()], false)),
    }
}

fn spans_of(list: Vec<(u64, u64, u64)>) -> Vec<CopySpan> {
    list.into_iter()
        .map(|(ptr, offset, len)| CopySpan { ptr, offset, len })
        .collect()
}

#[pymethods]
impl CopyPlan {
    #[new]
    fn new(
        py: Python<'_>,
        memory: &Bound<'_, PyAny>,
        spans: &Bound<'_, PyAny>,
        keep: Py<PyAny>,
    ) -> PyResult<Self> {
        let (memory, parts) = memories(memory)?;
        let Some(first) = memory.first() else {
            return Err(Failure::Value(
                "a plan copies between one buffer or more and its tensors".into(),
            ))
            .or_raise(py);
        };
        let lists: Vec<Vec<CopySpan>> = if parts {
            spans
                .extract::<Vec<Vec<(u64, u64, u64)>>>()?
                .into_iter()
                .map(spans_of)
                .collect()
        } else {
            vec![spans_of(spans.extract()?)]
        };
        if lists.len() != memory.len() {
            return Err(Failure::Value(format!(
                "{} buffers and {} lists of spans: one list per buffer",
                memory.len(),
                lists.len()
            )))
            .or_raise(py);
        }
        let (_, _, cuda, guard) = device_memory(first, false).or_raise(py)?;
        drop(guard);
        let slices: Vec<&[CopySpan]> = lists.iter().map(Vec::as_slice).collect();
        let plan = py
            .detach(|| cuda.copy_plan_parts(&slices))
            .map_err(Failure::from)
            .or_raise(py)?;
        Ok(Self {
            plan,
            cuda,
            parts,
            _keep: keep,
        })
    }

    /// Queues the copies on `stream` (a `torch.cuda.Stream`, a `cupy.cuda.Stream` or a raw
    /// `CUstream` handle): from `memory` (the plan's one buffer, or its list of them) into
    /// the tensors, or (`into_memory`) from the tensors into `memory`, which must then be
    /// writable leases or unleased buffers.
    #[pyo3(signature = (memory, stream, *, into_memory = false))]
    fn run(
        &self,
        py: Python<'_>,
        memory: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
        into_memory: bool,
    ) -> PyResult<()> {
        let (memory, parts) = memories(memory)?;
        if parts != self.parts {
            return Err(Failure::Value(if self.parts {
                "this plan runs on a list of buffers, one per part".to_string()
            } else {
                "this plan runs on one buffer, not a list".to_string()
            }))
            .or_raise(py);
        }
        let mut bufs = Vec::with_capacity(memory.len());
        let mut guards = Vec::with_capacity(memory.len());
        // Another GPU's memory mapped here: its large copies go by the copy engine.
        let on_peer = match memory.as_slice() {
            [one] => one
                .cast::<crate::memory::Lease>()
                .is_ok_and(|l| l.get().on_peer_gpu()),
            _ => false,
        };
        for m in &memory {
            let (addr, len, cuda, guard) = device_memory(m, into_memory).or_raise(py)?;
            if cuda.ordinal() != self.cuda.ordinal() {
                return Err(Failure::Value(format!(
                    "this plan copies on device {}; the memory is on device {}",
                    self.cuda.ordinal(),
                    cuda.ordinal()
                )))
                .or_raise(py);
            }
            bufs.push((addr, len));
            guards.push(guard);
        }
        let Stream::Cuda(stream) = crate::stream::named(stream, &self.cuda)? else {
            unreachable!("a named stream is a CUDA stream");
        };
        let direction = if into_memory {
            CopyDirection::IntoBuffer
        } else {
            CopyDirection::FromBuffer
        };
        // SAFETY: each `addr..addr + len` is a buffer's mapping, kept by its guard while the
        // copies are queued and, after, until the device is synchronised or the release
        // fence recorded on this stream (module docs); the spans' memory is kept by
        // `_keep`; the stream is a live stream of the device's primary context
        // (`stream::named`).
        let queued = if on_peer {
            let (addr, len) = bufs[0];
            // SAFETY: as above.
            unsafe { self.plan.run_on_peer(addr, len, direction, &stream) }
        } else {
            // SAFETY: as above.
            unsafe { self.plan.run_parts(&bufs, direction, &stream) }
        };
        drop(guards);
        queued.map_err(Failure::from).or_raise(py)
    }

    /// The buffer bytes the plan reaches.
    #[getter]
    fn end(&self) -> u64 {
        self.plan.end()
    }

    /// Whether a run is one kernel launch (`False`: the kernel did not load, and each copy
    /// is queued on its own).
    #[getter]
    fn batched(&self) -> bool {
        self.plan.batched()
    }

    fn __len__(&self) -> usize {
        self.plan.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "_CopyPlan({} copies, {:?} bytes of {} buffer(s), device {})",
            self.plan.len(),
            self.plan.ends(),
            self.plan.ends().len(),
            self.cuda.ordinal()
        )
    }
}
