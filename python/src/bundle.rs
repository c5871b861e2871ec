//! Bundle layouts in Python: the Rust [`baton_messages::BundleLayout`] (its packing, its
//! checks and its wire form), wrapped. The bundle classes themselves (`baton.Bundle`,
//! `baton.SharedBundle`, `baton.BundleLease`) are Python, in `baton/bundle.py`: they hold
//! a `Buffer`, `Shared` or `Lease` of bytes and cut views of it by this layout.
//!
//! On the wire a bundle is the map `{"baton.bundle": layout, "buffer": Shared<u8>}` that
//! Rust's `SharedBundle` is; the codec turns a received one into a `baton.SharedBundle`
//! after checking its layout here ([`decode_layout`]).

use crate::errors::{Failure, OrRaise};
use crate::memory::{dtype_name, parse_dtype, parse_shape};
use crate::runtime::lock;
use baton_messages::{BundleLayout as Layout, Shape};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The key of a bundle's layout in its wire map.
pub(crate) const LAYOUT_KEY: &str = "baton.bundle";

/// Where many named tensors are in one buffer: names, element types, shapes and byte
/// offsets, each tensor at a multiple of 256 bytes. Made from a spec — a dict
/// `{name: (shape, dtype)}` or a list of `(name, shape, dtype)` — in the order given; a
/// received bundle's layout was checked on arrival (unique names, aligned and disjoint
/// tensors) and against its buffer when opened.
#[pyclass(frozen, module = "baton._baton", name = "BundleLayout")]
pub(crate) struct BundleLayout {
    pub(crate) inner: Arc<Layout>,
    /// Its wire form (MessagePack bytes), made at the first send (a bundle is sent every
    /// sync).
    wire: OnceLock<Vec<u8>>,
}

impl BundleLayout {
    pub(crate) fn of(inner: Arc<Layout>) -> Self {
        Self {
            inner,
            wire: OnceLock::new(),
        }
    }

    /// Its wire form: the MessagePack byte string Rust's serde writes
    /// ([`Layout::to_wire`]'s bytes, as `bin`).
    pub(crate) fn wire(&self) -> Result<&[u8], String> {
        if let Some(v) = self.wire.get() {
            return Ok(v);
        }
        let bytes = rmp_serde::to_vec_named(&*self.inner).map_err(|e| e.to_string())?;
        Ok(self.wire.get_or_init(|| bytes))
    }
}

fn spec_entry(
    name: Bound<'_, PyAny>,
    shape: Bound<'_, PyAny>,
    dtype: Bound<'_, PyAny>,
) -> PyResult<(String, baton_messages::DType, Shape)> {
    let name: String = name.extract()?;
    let shape = parse_shape(&shape, &format!("tensor {name:?}'s shape"))?;
    Ok((name, parse_dtype(&dtype)?, shape))
}

#[pymethods]
impl BundleLayout {
    #[new]
    pub(crate) fn new(spec: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = spec.py();
        let mut entries = Vec::new();
        if let Ok(d) = spec.cast::<PyDict>() {
            for (name, v) in d.iter() {
                let (shape, dtype) = v.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>()?;
                entries.push(spec_entry(name, shape, dtype)?);
            }
        } else {
            for item in spec.try_iter()? {
                let (name, shape, dtype) =
                    item?.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>)>()?;
                entries.push(spec_entry(name, shape, dtype)?);
            }
        }
        let inner = Layout::packed(entries)
            .map_err(|e| Failure::Value(e.to_string()))
            .or_raise(py)?;
        Ok(Self::of(Arc::new(inner)))
    }

    /// The tensors, in order: `(name, dtype, shape, offset)` tuples.
    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for t in self.inner.tensors() {
            list.append((
                t.name.as_str(),
                dtype_name(t.dtype),
                PyTuple::new(py, t.shape.dims())?,
                t.offset,
            ))?;
        }
        Ok(list)
    }

    /// The bytes a buffer needs to hold every tensor.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.byte_len()
    }

    /// `(dtype, shape, offset)` of the tensor `name` (`KeyError` if there is none).
    fn __getitem__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyTuple>> {
        let t = self
            .inner
            .get(name)
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_owned()))?;
        PyTuple::new(
            py,
            [
                dtype_name(t.dtype).into_pyobject(py)?.into_any(),
                PyTuple::new(py, t.shape.dims())?.into_any(),
                t.offset.into_pyobject(py)?.into_any(),
            ],
        )
    }

    fn __contains__(&self, name: &str) -> bool {
        self.inner.get(name).is_some()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<BundleLayout>()
            .is_ok_and(|o| *o.get().inner == *self.inner)
    }

    fn __repr__(&self) -> String {
        format!(
            "BundleLayout({} tensors, {} bytes)",
            self.inner.len(),
            self.inner.byte_len()
        )
    }
}

/// The layouts received last, by their wire bytes: a bundle sent every sync carries the
/// same layout every time, and is decoded (and checked) once — also a borrowed model's
/// tens of bundles, one per allocation. At most this many, and [`RECENT_BYTES`] of wire.
const RECENT: usize = 256;
/// The most wire bytes of the layouts kept (a 20,000-tensor layout is ~0.6 MB).
const RECENT_BYTES: usize = 16 << 20;

/// The layouts received last ([`decode_layout`]), by their wire bytes, each with the tick
/// of its last use.
#[derive(Default)]
struct Recent {
    /// Hashed with foldhash, not SipHash: a lookup hashes a layout's wire bytes (hundreds
    /// of bytes; tens of lookups a sync), and the map is bounded, so a peer that aims at its
    /// buckets slows only its own lookups among at most [`RECENT`] layouts.
    layouts: HashMap<Box<[u8]>, (Py<BundleLayout>, u64), foldhash::fast::RandomState>,
    /// Wire bytes of the layouts kept.
    bytes: usize,
    tick: u64,
}

/// A received layout (its wire bytes), checked — the same checks as Rust's decoding — or
/// the `BundleLayout` made the last time these bytes came. A lookup is one hash of the
/// bytes (a borrowed model's group looks up tens of layouts each sync); past [`RECENT`]
/// layouts or [`RECENT_BYTES`], the least recently used go (never the one just made).
pub(crate) fn decode_layout(py: Python<'_>, bytes: &[u8]) -> Result<Py<BundleLayout>, String> {
    static SEEN: Mutex<Option<Recent>> = Mutex::new(None);
    let mut seen = lock(&SEEN);
    let seen = seen.get_or_insert_with(Recent::default);
    seen.tick += 1;
    let tick = seen.tick;
    if let Some((layout, used)) = seen.layouts.get_mut(bytes) {
        *used = tick;
        return Ok(layout.clone_ref(py));
    }
    let layout: Layout =
        rmp_serde::from_slice(bytes).map_err(|e| format!("a bundle layout: {e}"))?;
    let layout = Py::new(py, BundleLayout::of(Arc::new(layout))).map_err(|e| e.to_string())?;
    seen.layouts
        .insert(bytes.into(), (layout.clone_ref(py), tick));
    seen.bytes += bytes.len();
    while seen.layouts.len() > 1 && (seen.layouts.len() > RECENT || seen.bytes > RECENT_BYTES) {
        let oldest = seen
            .layouts
            .iter()
            .filter(|(_, (_, used))| *used != tick)
            .min_by_key(|(_, (_, used))| *used)
            .map(|(k, _)| k.clone());
        let Some(oldest) = oldest else { break };
        seen.layouts.remove(&oldest);
        seen.bytes -= oldest.len();
    }
    Ok(layout)
}
