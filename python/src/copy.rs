//! Batched device copies in Python (`baton._baton._CopyPlan`): the Rust
//! [`baton_ipc::cuda::CopyPlan`] between a `Lease` or `Buffer` and many tensors, one kernel
//! launch per run. `baton.CopyPlan` (`baton/bundle.py`) makes its spans from a bundle
//! layout and torch tensors; `BundleLease.copy_into` and `Bundle.copy_from` run it.
//!
//! # Safety
//!
//! A run writes (or reads) the plan's raw device pointers. The plan keeps `keep` — the
//! tensors' storages — for its whole life, so every pointer stays allocated memory while a
//! run may use it (the plan checked each span against its allocation when it was made). The
//! buffer side is held by a view guard for the run, as any view of it is, so it stays
//! mapped; a lease given back later waits for the work queued on the device (or records its
//! release fence on the stream the copies ran on, when opened stream-ordered), as for a
//! torch view of it.

#![allow(unsafe_code)]

use crate::errors::{Failure, OrRaise};
use crate::memory::device_memory;
use baton_ipc::Stream;
use baton_ipc::cuda::{CopyDirection, CopyPlan as Plan, CopySpan, CudaBackend};
use pyo3::prelude::*;
use std::sync::Arc;

/// Copies between one device buffer (a `Lease` or `Buffer`) and many device tensors, by
/// their data pointers: `spans` is a list of `(pointer, offset in the buffer, bytes)`;
/// `memory` picks the device (the plan is checked against its allocations once, here);
/// `keep` is kept alive as long as the plan (the tensors' storages). Made once, run every
/// sync.
#[pyclass(frozen, module = "baton._baton", name = "_CopyPlan")]
pub(crate) struct CopyPlan {
    plan: Plan,
    cuda: Arc<CudaBackend>,
    /// What keeps the pointers allocated.
    _keep: Py<PyAny>,
}

#[pymethods]
impl CopyPlan {
    #[new]
    fn new(
        py: Python<'_>,
        memory: &Bound<'_, PyAny>,
        spans: Vec<(u64, u64, u64)>,
        keep: Py<PyAny>,
    ) -> PyResult<Self> {
        let (_, _, cuda, guard) = device_memory(memory, false).or_raise(py)?;
        drop(guard);
        let spans: Vec<CopySpan> = spans
            .into_iter()
            .map(|(ptr, offset, len)| CopySpan { ptr, offset, len })
            .collect();
        let plan = py
            .detach(|| cuda.copy_plan(&spans))
            .map_err(Failure::from)
            .or_raise(py)?;
        Ok(Self {
            plan,
            cuda,
            _keep: keep,
        })
    }

    /// Queues the copies on `stream` (a `torch.cuda.Stream`, a `cupy.cuda.Stream` or a raw
    /// `CUstream` handle): from `memory` into the tensors, or (`into_memory`) from the
    /// tensors into `memory`, which must then be a writable lease or an unleased buffer.
    #[pyo3(signature = (memory, stream, *, into_memory = false))]
    fn run(
        &self,
        py: Python<'_>,
        memory: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
        into_memory: bool,
    ) -> PyResult<()> {
        let (addr, len, cuda, guard) = device_memory(memory, into_memory).or_raise(py)?;
        if cuda.ordinal() != self.cuda.ordinal() {
            return Err(Failure::Value(format!(
                "this plan copies on device {}; the memory is on device {}",
                self.cuda.ordinal(),
                cuda.ordinal()
            )))
            .or_raise(py);
        }
        let Stream::Cuda(stream) = crate::stream::named(stream, &self.cuda)? else {
            unreachable!("a named stream is a CUDA stream");
        };
        let direction = if into_memory {
            CopyDirection::IntoBuffer
        } else {
            CopyDirection::FromBuffer
        };
        // SAFETY: `addr..addr + len` is the memory's mapping, kept by `guard` while the
        // copies are queued and, after, until the device is synchronised or the release
        // fence recorded on this stream (module docs); the spans' memory is kept by
        // `_keep`; the stream is a live stream of the device's primary context
        // (`stream::named`).
        let queued = unsafe { self.plan.run(addr, len, direction, &stream) };
        drop(guard);
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
            "_CopyPlan({} copies, {} bytes of buffer, device {})",
            self.plan.len(),
            self.plan.end(),
            self.cuda.ordinal()
        )
    }
}
