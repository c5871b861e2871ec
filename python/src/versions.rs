//! Versioned syncs in Python: the Rust bookkeeping of both sides
//! ([`baton_actors::SyncSender`], [`baton_actors::SyncState`]) and the stamp
//! ([`baton_messages::SyncStamp`]), wrapped. The classes users call (`baton.SyncSender`,
//! `baton.SyncReceiver`) are Python, in `baton/bundle.py`: they stamp and stage
//! `baton.Bundle`s with these.
//!
//! On the wire a stamp is the `"baton.sync"` field of a bundle's map: the MessagePack map
//! Rust's serde writes for [`SyncStamp`](baton_messages::SyncStamp) (or nil).

use crate::errors::{Failure, OrRaise};
use baton_actors::{ActorError, SyncProgress};
use baton_messages::{SyncCancel, SyncStamp as Stamp};
use pyo3::prelude::*;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The stamp of one part of a versioned sync (read-only): `version`, `sync`, `part`,
/// `parts`, `ttl_ms`.
#[pyclass(frozen, module = "baton._baton", name = "SyncStamp")]
pub(crate) struct SyncStamp {
    pub(crate) inner: Stamp,
}

#[pymethods]
impl SyncStamp {
    /// The version this part belongs to.
    #[getter]
    fn version(&self) -> u64 {
        self.inner.version
    }

    /// The sync (attempt) it belongs to.
    #[getter]
    fn sync(&self) -> u64 {
        self.inner.sync
    }

    /// Its index.
    #[getter]
    fn part(&self) -> u32 {
        self.inner.part
    }

    /// Parts of the version.
    #[getter]
    fn parts(&self) -> u32 {
        self.inner.parts
    }

    /// Milliseconds the sync had left when the part was shared.
    #[getter]
    fn ttl_ms(&self) -> u64 {
        self.inner.ttl_ms
    }

    /// Raises ``Malformed`` unless the stamp is well formed.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.inner
            .check()
            .map_err(ActorError::from)
            .map_err(Failure::from)
            .or_raise(py)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<SyncStamp>()
            .is_ok_and(|o| o.get().inner == self.inner)
    }

    fn __repr__(&self) -> String {
        format!("SyncStamp({})", self.inner)
    }
}

/// A received stamp, from its MessagePack value (nil: none).
pub(crate) fn decode_stamp(value: rmpv::Value) -> Result<Option<Stamp>, String> {
    if value.is_nil() {
        return Ok(None);
    }
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &value).map_err(|e| format!("a sync stamp: {e}"))?;
    rmp_serde::from_slice(&bytes)
        .map(Some)
        .map_err(|e| format!("a sync stamp: {e}"))
}

/// A received stamp, from its MessagePack bytes (nil: none).
pub(crate) fn decode_stamp_bytes(bytes: &[u8]) -> Result<Option<Stamp>, String> {
    if bytes == [rmp::Marker::Null.to_u8()] {
        return Ok(None);
    }
    rmp_serde::from_slice(bytes)
        .map(Some)
        .map_err(|e| format!("a sync stamp: {e}"))
}

/// A stamp's MessagePack value.
pub(crate) fn encode_stamp(stamp: &Stamp) -> Result<rmpv::Value, String> {
    let bytes = rmp_serde::to_vec_named(stamp).map_err(|e| e.to_string())?;
    rmpv::decode::read_value(&mut bytes.as_slice()).map_err(|e| e.to_string())
}

fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s.max(0.0))
        .map_err(|_| pyo3::exceptions::PyValueError::new_err(format!("{what}: {s} seconds")))
}

/// The sender's bookkeeping (`baton.SyncSender` holds one).
#[pyclass(module = "baton._baton", name = "_SyncSender")]
pub(crate) struct SyncSender {
    inner: Mutex<baton_actors::SyncSender>,
}

#[pymethods]
impl SyncSender {
    #[new]
    #[pyo3(signature = (version = 0, min_deadline = None))]
    fn new(version: u64, min_deadline: Option<f64>) -> PyResult<Self> {
        let mut inner = baton_actors::SyncSender::new(version);
        if let Some(min) = min_deadline {
            inner = inner.with_min_deadline(seconds("min_deadline", min)?);
        }
        Ok(Self {
            inner: Mutex::new(inner),
        })
    }

    #[getter]
    fn version(&self) -> u64 {
        crate::runtime::lock(&self.inner).version()
    }

    #[getter]
    fn pending(&self) -> Option<u64> {
        crate::runtime::lock(&self.inner).pending()
    }

    /// Begins the next version's sync in `parts` parts, due `deadline` seconds from now.
    fn begin(&self, py: Python<'_>, parts: u32, deadline: f64) -> PyResult<u64> {
        let left = if deadline > 0.0 {
            seconds("deadline", deadline)?
        } else {
            Duration::ZERO
        };
        let due = Instant::now()
            .checked_add(left)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(u32::MAX.into()));
        crate::runtime::lock(&self.inner)
            .begin(parts, due)
            .or_raise(py)
    }

    fn stamp(&self, py: Python<'_>, part: u32) -> PyResult<SyncStamp> {
        let inner = crate::runtime::lock(&self.inner).stamp(part).or_raise(py)?;
        Ok(SyncStamp { inner })
    }

    fn finish(&self, py: Python<'_>) -> PyResult<u64> {
        crate::runtime::lock(&self.inner).finish().or_raise(py)
    }

    /// `(version, sync)` to send the receivers, or None.
    fn cancel(&self) -> Option<(u64, u64)> {
        crate::runtime::lock(&self.inner)
            .cancel()
            .map(|c| (c.version, c.sync))
    }
}

/// A receiver's bookkeeping (`baton.SyncReceiver` holds one).
#[pyclass(module = "baton._baton", name = "_SyncState")]
pub(crate) struct SyncState {
    inner: Mutex<baton_actors::SyncState>,
}

#[pymethods]
impl SyncState {
    #[new]
    fn new() -> Self {
        Self {
            inner: Mutex::new(baton_actors::SyncState::new(0)),
        }
    }

    #[getter]
    fn version(&self) -> u64 {
        crate::runtime::lock(&self.inner).version()
    }

    /// `(version, sync, landed, parts)` of the sync staged, or None.
    #[getter]
    fn staging(&self) -> Option<(u64, u64, u32, u32)> {
        crate::runtime::lock(&self.inner)
            .staging(Instant::now())
            .map(|s| (s.version, s.sync, s.landed, s.parts))
    }

    /// The stamp to stage a part under; raises the ``Version`` error that refuses it.
    #[pyo3(signature = (stamp))]
    fn admit(&self, py: Python<'_>, stamp: Option<PyRef<'_, SyncStamp>>) -> PyResult<SyncStamp> {
        let inner = crate::runtime::lock(&self.inner)
            .admit(stamp.as_ref().map(|s| &s.inner), Instant::now())
            .map_err(ActorError::from)
            .or_raise(py)?;
        Ok(SyncStamp { inner })
    }

    /// The part is copied: the version committed by it, or None while parts are missing
    /// (raises ``SyncOver`` when the sync was given up meanwhile).
    fn landed(&self, py: Python<'_>, stamp: PyRef<'_, SyncStamp>) -> PyResult<Option<u64>> {
        match crate::runtime::lock(&self.inner).landed(&stamp.inner) {
            Some(SyncProgress::Committed { version }) => Ok(Some(version)),
            Some(_) => Ok(None),
            None => Err(ActorError::SyncOver {
                version: stamp.inner.version,
                why: "it was given up while the part was copied",
            })
            .or_raise(py),
        }
    }

    fn cancel(&self, version: u64, sync: u64) -> bool {
        crate::runtime::lock(&self.inner).cancel(&SyncCancel { version, sync })
    }
}
