//! Buffers in Python: received ([`Shared`] → [`Lease`]) and allocated here ([`Buffer`]),
//! and the views of them (NumPy, DLPack, `__cuda_array_interface__`).
//!
//! # Soundness of views
//!
//! A view is memory that Python code reads and writes directly, so what maps the memory
//! must outlive every view of it:
//!
//! - Every view holds a [`ViewGuard`]: a NumPy array's base object (`_HostView`) holds one,
//!   a DLPack capsule's managed tensor holds one (its deleter drops it: the consumer calls
//!   it when its last tensor of the memory is gone). A lease's guard counts in the lease;
//!   a buffer's guard is a clone of the buffer handle (the buffer is freed only with its
//!   last handle).
//! - A lease is given back (its mapping dropped, `Release` sent) only when Python is done
//!   with it — `release()`, the end of its `with` block, or the `Lease` object's
//!   collection — **and** no view of it is left. `release()` with views alive *defers*:
//!   the lease object is unusable at once (every method raises `baton.Released`), and the
//!   lease goes back when the last view goes. `release()` returns whether it went back now.
//! - `__cuda_array_interface__` has no deleter: a consumer keeps a reference to the object
//!   that exposes it. Once it has been read, the object itself is counted as a view, so
//!   the lease (or buffer) goes back only when the object is collected.
//! - Orphaned leases (the exporter died) keep their mapping until they go back, so views
//!   taken before never read unmapped memory; new views and accessors raise
//!   `baton.Orphaned`.
//!
//! # Device memory and stream ordering
//!
//! Baton orders device memory with fences (`docs/ORDERING.md`): a lease waits on the
//! exporter's acquire fence on each stream it is used on ([`AnyLease::wait_on`]), a
//! buffer's uses wait on the release fences its importers sent back ([`AnyBuffer::wait_on`]).
//! Python's consumers (torch, cupy) run on streams Baton does not own and cannot keep — a
//! DLPack `stream` argument names a stream only for the call, and the array interface names
//! none — so the Python layer orders what it can with those fences on the backend's own
//! stream and synchronises the rest conservatively, marked `CONSERVATIVE SYNC` where it does:
//! - *acquire*: opening a device lease makes the backend's stream wait on the exporter's
//!   acquire fence and synchronises it (the lease API); views handed out after that see the
//!   exporter's data on any stream;
//! - *our buffers*: before a device view of a buffer of ours is handed out, the backend's
//!   stream waits on the release fences of importers that gave it back, and is synchronised;
//! - *release*: when a device lease (or a buffer handle) is let go after views of it were
//!   handed out, a background thread synchronises the device's primary context (all
//!   streams of this process on it: torch's and cupy's included) before the lease goes back
//!   (or the memory is freed): the consumers' streams are unknown;
//! - *send*: before a message with device buffers of ours leaves, the context is
//!   synchronised, so the receiver reads what Python's streams wrote.

use crate::dlpack;
use crate::errors::{Failure, OrRaise, to_py};
use crate::runtime::{lock, runtime};
use baton_actors::{AnyBuffer, AnyLease, AnyShared};
use baton_ipc::cuda::CudaBackend;
use baton_ipc::{MemPtr, Stream};
use baton_messages::{DType, Layout};
use pyo3::exceptions::PyAttributeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

/// The CUDA backend of the node a buffer belongs to, if it has one.
pub(crate) type Cuda = Option<Arc<CudaBackend>>;

/// Where a buffer's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Device {
    Cpu,
    Cuda(i32),
}

impl Device {
    fn of(ptr: MemPtr, cuda: &Cuda) -> Result<(u64, Device), Failure> {
        match (ptr, cuda) {
            (MemPtr::Host(p), _) => Ok((p as u64, Device::Cpu)),
            (MemPtr::Device(p), Some(c)) => Ok((p, Device::Cuda(c.ordinal() as i32))),
            (MemPtr::Device(_), None) => Err(Failure::Buffer(
                "device memory on a node without a CUDA backend".into(),
            )),
        }
    }

    /// DLPack's `(device_type, device_id)`: `kDLCPU` = 1, `kDLCUDA` = 2.
    pub(crate) fn dlpack(self) -> (i32, i32) {
        match self {
            Device::Cpu => (1, 0),
            Device::Cuda(n) => (2, n),
        }
    }

    fn name(self) -> (&'static str, i32) {
        match self {
            Device::Cpu => ("cpu", 0),
            Device::Cuda(n) => ("cuda", n),
        }
    }
}

/// Element type names, as NumPy spells them.
const DTYPES: [(DType, &str); 12] = [
    (DType::U8, "uint8"),
    (DType::I8, "int8"),
    (DType::U16, "uint16"),
    (DType::I16, "int16"),
    (DType::U32, "uint32"),
    (DType::I32, "int32"),
    (DType::U64, "uint64"),
    (DType::I64, "int64"),
    (DType::F16, "float16"),
    (DType::BF16, "bfloat16"),
    (DType::F32, "float32"),
    (DType::F64, "float64"),
];

pub(crate) fn dtype_name(d: DType) -> &'static str {
    DTYPES
        .iter()
        .find(|(t, _)| *t == d)
        .map_or("unknown", |(_, n)| n)
}

/// A shape from an int or a sequence of ints (at most [`Shape::MAX_RANK`] of them);
/// `what` names it in the error.
pub(crate) fn parse_shape(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<baton_messages::Shape> {
    use baton_messages::Shape;
    let dims: Vec<u64> = match obj.extract::<u64>() {
        Ok(n) => vec![n],
        Err(_) => obj.extract()?,
    };
    let rank = dims.len();
    Shape::new(dims)
        .ok_or_else(|| {
            Failure::Value(format!(
                "{what} has at most {} dimensions, not {rank}",
                Shape::MAX_RANK
            ))
        })
        .or_raise(obj.py())
}

/// An element type from a name (`"float32"`), a NumPy dtype or scalar type, or a torch
/// dtype (`torch.float32`).
pub(crate) fn parse_dtype(obj: &Bound<'_, PyAny>) -> PyResult<DType> {
    let name: String = if let Ok(s) = obj.extract::<String>() {
        s
    } else if let Ok(n) = obj.getattr("name").and_then(|n| n.extract::<String>()) {
        n
    } else if let Ok(n) = obj.getattr("__name__").and_then(|n| n.extract::<String>()) {
        n
    } else {
        obj.str()?.extract::<String>()?
    };
    let name = name.trim().trim_start_matches("torch.");
    DTYPES
        .iter()
        .find(|(_, n)| *n == name)
        .map(|(d, _)| *d)
        .ok_or_else(|| {
            let known: Vec<&str> = DTYPES.iter().map(|(_, n)| *n).collect();
            Failure::Type(format!(
                "unknown element type {name:?}: one of {}",
                known.join(", ")
            ))
        })
        .or_raise(obj.py())
}

/// NumPy's `__array_interface__` type string (little-endian), if NumPy has the type.
fn typestr(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::U16 => "<u2",
        DType::I16 => "<i2",
        DType::U32 => "<u4",
        DType::I32 => "<i4",
        DType::U64 => "<u8",
        DType::I64 => "<i8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        _ => return None,
    })
}

/// Element type and shape, and the bytes they take. An untyped buffer (offered without a
/// layout) is a vector of bytes.
#[derive(Debug, Clone)]
pub(crate) struct Geometry {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
    pub(crate) nbytes: usize,
}

impl Geometry {
    pub(crate) fn of(layout: Option<&Layout>, nbytes: usize) -> Self {
        match layout {
            Some(l) => Self {
                dtype: l.dtype,
                shape: l.shape.dims().to_vec(),
                nbytes,
            },
            None => Self {
                dtype: DType::U8,
                shape: vec![nbytes as u64],
                nbytes,
            },
        }
    }

    fn shape_tuple<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    fn spec(&self, addr: u64, device: Device, read_only: bool) -> dlpack::TensorSpec {
        dlpack::TensorSpec {
            data: addr,
            device: device.dlpack(),
            dtype: self.dtype,
            shape: self.shape.iter().map(|&d| d as i64).collect(),
            read_only,
        }
    }

    /// `__array_interface__` / `__cuda_array_interface__` without its stream.
    fn interface<'py>(
        &self,
        py: Python<'py>,
        addr: u64,
        read_only: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let typestr = typestr(self.dtype).ok_or_else(|| {
            to_py(
                py,
                Failure::Type(format!(
                    "NumPy and the array interfaces have no {}: use __dlpack__ (torch.from_dlpack)",
                    dtype_name(self.dtype)
                )),
            )
        })?;
        let d = PyDict::new(py);
        d.set_item("shape", self.shape_tuple(py)?)?;
        d.set_item("typestr", typestr)?;
        d.set_item("data", (addr, read_only))?;
        d.set_item("strides", py.None())?;
        d.set_item("version", 3)?;
        Ok(d)
    }
}

// ---------------------------------------------------------------------------------------
// Letting go of device memory after the streams that used it are done.

/// What the device-release thread lets go of.
enum Deferred {
    /// A lease, given back without a release fence once its context is synchronised
    /// ([`AnyLease::release_synchronized`]).
    Lease(Box<AnyLease>),
    /// Leases given back together ([`release_all`]): one item, so that the thread takes
    /// them in one batch (one synchronisation, and a lease over several buffers' parts
    /// back at once).
    Leases(Vec<AnyLease>),
    /// Anything else (a buffer handle views used), dropped after its backend's context is
    /// synchronised.
    Other {
        cuda: Arc<CudaBackend>,
        what: Box<dyn Send>,
    },
}

/// The most items the device-release thread lets go of after one synchronisation.
const RELEASE_BATCH: usize = 1024;

/// Lets go of a batch: one synchronisation of each context for all of it.
fn let_go(batch: Vec<Deferred>) {
    let mut leases = Vec::new();
    let mut others = Vec::new();
    for d in batch {
        match d {
            Deferred::Lease(lease) => leases.push(*lease),
            Deferred::Leases(more) => leases.extend(more),
            Deferred::Other { cuda, what } => others.push((cuda, what)),
        }
    }
    if !leases.is_empty() {
        if let Err(e) = AnyLease::release_synchronized(leases) {
            tracing::warn!(error = %e, "synchronising before a device release failed");
        }
    }
    let mut synced: Vec<Arc<CudaBackend>> = Vec::new();
    for (cuda, what) in others {
        if !synced
            .iter()
            .any(|c| Arc::ptr_eq(c.context(), cuda.context()))
        {
            if let Err(e) = cuda.synchronize_context() {
                tracing::warn!(error = %e, "synchronising before a device release failed");
            }
            synced.push(cuda);
        }
        drop(what);
    }
}

/// CONSERVATIVE SYNC (release): lets go of a lease or a buffer handle whose device memory
/// views used on a background thread, after synchronising the device's primary context,
/// so that no queued kernel of this process still uses the memory when the lease goes back
/// or the memory is freed. Never blocks the caller (a DLPack deleter, a garbage
/// collection). The thread takes everything queued by then after one synchronisation: a
/// group of leases released together costs one host wait, and their `Release`s carry no
/// release fence (the work they would order after is complete).
fn drop_after_sync(deferred: Deferred) {
    static WORKER: OnceLock<Option<Mutex<mpsc::Sender<Deferred>>>> = OnceLock::new();
    let worker = WORKER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Deferred>();
        std::thread::Builder::new()
            .name("baton-device-release".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut batch = vec![first];
                    while batch.len() < RELEASE_BATCH {
                        match rx.try_recv() {
                            Ok(more) => batch.push(more),
                            Err(_) => break,
                        }
                    }
                    let_go(batch);
                }
            })
            .ok()
            .map(|_| Mutex::new(tx))
    });
    let unsent = match worker {
        Some(tx) => lock(tx).send(deferred).err().map(|e| e.0),
        None => Some(deferred),
    };
    if let Some(d) = unsent {
        // No worker thread: synchronise here rather than release early.
        let_go(vec![d]);
    }
}

/// [`drop_after_sync`] of a buffer handle (or what else views of `cuda`'s memory used).
pub(crate) fn drop_buffer_after_sync(cuda: &Arc<CudaBackend>, what: Box<dyn Send>) {
    drop_after_sync(Deferred::Other {
        cuda: Arc::clone(cuda),
        what,
    });
}

/// Before a device view of a buffer of ours is handed out: the backend's stream waits on
/// the release fences of importers that gave the buffer back (and on its other uses), and
/// is synchronised (CONSERVATIVE SYNC: the consumer's stream is not ours to keep).
fn ordered_for_views(buffer: &AnyBuffer, cuda: &Arc<CudaBackend>) -> Result<(), Failure> {
    buffer.wait_on(Stream::Internal)?;
    Ok(cuda.synchronize()?)
}

/// CONSERVATIVE SYNC (send): waits until every stream of this process on the device is
/// idle. Call without the GIL.
pub(crate) fn sync_context(cuda: &Arc<CudaBackend>) -> Result<(), Failure> {
    cuda.context().synchronize().map_err(|e| {
        Failure::Actor(baton_actors::ActorError::Ipc(baton_ipc::Error::Cuda {
            op: "cuCtxSynchronize",
            code: e.into(),
        }))
    })
}

// ---------------------------------------------------------------------------------------
// Views.

/// Keeps the memory of one view mapped (see the module docs).
pub(crate) enum ViewGuard {
    Lease(Arc<LeaseCell>),
    Buffer { buffer: AnyBuffer, cuda: Cuda },
}

impl Drop for ViewGuard {
    fn drop(&mut self) {
        match self {
            ViewGuard::Lease(cell) => cell.view_dropped(),
            ViewGuard::Buffer {
                buffer,
                cuda: Some(cuda),
            } => drop_buffer_after_sync(cuda, Box::new(buffer.clone())),
            ViewGuard::Buffer { cuda: None, .. } => {}
        }
    }
}

/// The base object of a NumPy view of host memory: its `__array_interface__`, and the
/// guard that keeps the memory mapped while the array (and every view of it) lives.
#[pyclass(frozen, module = "baton._baton", name = "_HostView")]
pub(crate) struct HostView {
    _guard: ViewGuard,
    geometry: Geometry,
    addr: u64,
    read_only: bool,
}

#[pymethods]
impl HostView {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.geometry.interface(py, self.addr, self.read_only)
    }
}

fn numpy_view<'py>(
    py: Python<'py>,
    guard: impl FnOnce() -> Result<ViewGuard, Failure>,
    geometry: &Geometry,
    addr: u64,
    device: Device,
    read_only: bool,
) -> PyResult<Bound<'py, PyAny>> {
    if device != Device::Cpu {
        return Err(to_py(
            py,
            Failure::Buffer(
                "device memory has no NumPy view: use torch.from_dlpack(x) or cupy.from_dlpack(x)"
                    .into(),
            ),
        ));
    }
    // The type and NumPy are checked before a view is made.
    geometry.interface(py, addr, read_only)?;
    let np = py.import("numpy")?;
    let view = Bound::new(
        py,
        HostView {
            _guard: guard().or_raise(py)?,
            geometry: geometry.clone(),
            addr,
            read_only,
        },
    )?;
    np.call_method1("asarray", (view,))
}

/// `__dlpack__` for a lease or a buffer.
#[allow(clippy::too_many_arguments)]
fn dlpack_capsule<'py>(
    py: Python<'py>,
    guard: impl FnOnce() -> Result<ViewGuard, Failure> + Send,
    spec: dlpack::TensorSpec,
    device: Device,
    stream: Option<&Bound<'py, PyAny>>,
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    if copy == Some(true) {
        return Err(to_py(
            py,
            Failure::Buffer(
                "copy=True: a Baton buffer is shared memory, and __dlpack__ gives it only as is"
                    .into(),
            ),
        ));
    }
    if let Some(want) = dl_device {
        if want != device.dlpack() {
            return Err(to_py(
                py,
                Failure::Buffer(format!(
                    "the buffer is on device {:?}, not {want:?}, and Baton does not copy",
                    device.dlpack()
                )),
            ));
        }
    }
    if device == Device::Cpu {
        if let Some(s) = stream {
            if !s.is_none() {
                return Err(to_py(
                    py,
                    Failure::Buffer("stream must be None for host memory".into()),
                ));
            }
        }
    }
    // For device memory, any consumer stream may use the data at once: a lease waited on
    // its acquire fence when opened, and a buffer of ours waits on its importers' release
    // fences when the view is made (`guard`) — each followed by a host wait (CONSERVATIVE
    // SYNC).
    let versioned = max_version.is_some_and(|(major, _)| major >= 1);
    if !versioned && spec.read_only {
        return Err(to_py(
            py,
            Failure::Buffer(
                "this lease is read-only, and the consumer asked for a DLPack capsule without a \
                 read-only flag (DLPack before 1.0): open it with open(writable=True), or use a \
                 consumer that supports DLPack 1.0"
                    .into(),
            ),
        ));
    }
    // Making the view may wait for the device (our buffers: see `ordered_for_views`).
    let guard = py.detach(guard).or_raise(py)?;
    dlpack::capsule(py, spec, guard, versioned)
}

// ---------------------------------------------------------------------------------------
// Leases.

struct LeaseState {
    /// `Some` until the lease goes back.
    lease: Option<AnyLease>,
    /// Python is done with it: `release()`, `with`, or the object's collection.
    released: bool,
    /// The `Lease` object is still alive.
    object_alive: bool,
    /// `__cuda_array_interface__` was read: the object counts as a view.
    cai: bool,
    /// Views alive (NumPy bases, DLPack capsules and tensors).
    views: usize,
}

/// A lease and what Python did with it (see the module docs).
pub(crate) struct LeaseCell {
    state: Mutex<LeaseState>,
    geometry: Geometry,
    /// Host address or device pointer: valid while `state.lease` is `Some`.
    addr: u64,
    device: Device,
    writable: bool,
    id: u64,
    exporter_pid: u32,
    /// `LeasePath::name` of the lease.
    path: &'static str,
    cuda: Cuda,
    /// Opened on a stream the caller named: the release fence is recorded on it when the
    /// lease goes back, instead of synchronising the device first.
    ordered: bool,
}

impl LeaseCell {
    fn released(&self) -> Failure {
        Failure::Released(format!(
            "lease {} was released (release() or the end of its with block): it can no longer be used",
            self.id
        ))
    }

    /// Fails if Python released the lease or its exporter is gone.
    fn usable(&self, state: &LeaseState) -> Result<(), Failure> {
        if state.released {
            return Err(self.released());
        }
        match &state.lease {
            Some(lease) => lease.ptr().map(drop).map_err(Failure::from),
            None => Err(self.released()),
        }
    }

    fn view(self: &Arc<Self>) -> Result<ViewGuard, Failure> {
        let mut state = lock(&self.state);
        self.usable(&state)?;
        state.views += 1;
        Ok(ViewGuard::Lease(Arc::clone(self)))
    }

    /// The lease, if nothing holds it any more.
    fn done(state: &mut LeaseState) -> Option<AnyLease> {
        if state.released && state.views == 0 && !(state.cai && state.object_alive) {
            state.lease.take()
        } else {
            None
        }
    }

    /// Device leases go back after the context is synchronised: a kernel that used a
    /// view may still be queued even after the view itself is gone. A stream-ordered one
    /// goes back at once: dropping it records its release fence on the caller's stream,
    /// after the work queued there.
    fn give_back(&self, lease: AnyLease) {
        if self.after_sync() {
            drop_after_sync(Deferred::Lease(Box::new(lease)));
        } else {
            drop(lease);
        }
    }

    fn view_dropped(&self) {
        let lease = {
            let mut state = lock(&self.state);
            state.views = state.views.saturating_sub(1);
            Self::done(&mut state)
        };
        if let Some(lease) = lease {
            self.give_back(lease);
        }
    }

    /// Python is done with the lease; returns whether it went back now.
    fn release(&self, object_dropped: bool) -> bool {
        match self.take_released(object_dropped) {
            Some(lease) => {
                self.give_back(lease);
                true
            }
            None => false,
        }
    }

    /// Python is done with the lease: the lease, if nothing else holds it (then it goes
    /// back as [`give_back`](Self::give_back) would give it).
    fn take_released(&self, object_dropped: bool) -> Option<AnyLease> {
        let mut state = lock(&self.state);
        state.released = true;
        if object_dropped {
            state.object_alive = false;
        }
        Self::done(&mut state)
    }

    /// Whether [`give_back`](Self::give_back) hands the lease to the device-release thread.
    fn after_sync(&self) -> bool {
        self.cuda.is_some() && matches!(self.device, Device::Cuda(_)) && !self.ordered
    }

    fn with_lease<T>(&self, f: impl FnOnce(&AnyLease) -> Result<T, Failure>) -> Result<T, Failure> {
        let state = lock(&self.state);
        self.usable(&state)?;
        f(state.lease.as_ref().expect("checked by usable"))
    }
}

/// A buffer received in a message, not opened yet (Python's `baton.Shared`).
#[pyclass(frozen, module = "baton._baton", name = "Shared")]
pub(crate) struct Shared {
    inner: Mutex<SharedState>,
    geometry: Geometry,
    id: u64,
    cuda: Cuda,
}

enum SharedState {
    Unopened(AnyShared),
    Opened,
    Released,
}

impl Shared {
    /// What `open` opens, taken once: a second open, or an open after `release`, is
    /// refused.
    fn take_unopened(&self, py: Python<'_>) -> PyResult<AnyShared> {
        let mut inner = lock(&self.inner);
        match std::mem::replace(&mut *inner, SharedState::Opened) {
            SharedState::Unopened(s) => Ok(s),
            SharedState::Opened => Err(to_py(
                py,
                Failure::Released(format!(
                    "buffer {} was opened already: use the Lease that open() returned",
                    self.id
                )),
            )),
            SharedState::Released => {
                *inner = SharedState::Released;
                Err(to_py(
                    py,
                    Failure::Released(format!("buffer {} was released", self.id)),
                ))
            }
        }
    }

    /// Opens the taken lease: it, its address and its device. An orphaned lease fails
    /// here, and goes back as it drops.
    fn opened(&self, py: Python<'_>, shared: AnyShared) -> PyResult<(AnyLease, u64, Device)> {
        let lease = shared.open().or_raise(py)?;
        let (addr, device) = lease
            .ptr()
            .map_err(Failure::from)
            .and_then(|ptr| Device::of(ptr, &self.cuda))
            .or_raise(py)?;
        Ok((lease, addr, device))
    }

    /// The Python object of an opened lease.
    fn lease_object(
        &self,
        lease: AnyLease,
        addr: u64,
        device: Device,
        writable: bool,
        ordered: bool,
    ) -> Lease {
        let exporter_pid = lease.exporter().process.pid;
        let path = lease.path().name();
        Lease {
            cell: Arc::new(LeaseCell {
                state: Mutex::new(LeaseState {
                    lease: Some(lease),
                    released: false,
                    object_alive: true,
                    cai: false,
                    views: 0,
                }),
                geometry: self.geometry.clone(),
                addr,
                device,
                writable,
                id: self.id,
                exporter_pid,
                path,
                cuda: self.cuda.clone(),
                ordered,
            }),
        }
    }

    pub(crate) fn new(shared: AnyShared, cuda: Cuda) -> Self {
        // A received buffer's layout and size come from its checked handle.
        let (geometry, id) = {
            let layout = shared.layout().cloned();
            let nbytes = layout
                .as_ref()
                .and_then(Layout::byte_len)
                .map_or(0, |b| b as usize);
            (
                Geometry::of(layout.as_ref(), nbytes),
                shared.lease_id().map_or(0, |l| l.get()),
            )
        };
        Self {
            inner: Mutex::new(SharedState::Unopened(shared)),
            geometry,
            id,
            cuda,
        }
    }
}

#[pymethods]
impl Shared {
    /// The shape (outermost dimension first).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        self.geometry.shape_tuple(py)
    }

    /// The element type's name (`"float32"`, …).
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.geometry.dtype)
    }

    /// Bytes in the buffer.
    #[getter]
    fn nbytes(&self) -> usize {
        self.geometry.nbytes
    }

    /// The lease id (the exporter's).
    #[getter]
    fn lease_id(&self) -> u64 {
        self.id
    }

    /// Opens the buffer: the same memory the exporter wrote, mapped here. `writable`: whether
    /// views of it may write (NumPy views and DLPack capsules are read-only otherwise).
    ///
    /// `stream` (device memory: a `torch.cuda.Stream`, a `cupy.cuda.Stream` or a raw
    /// `CUstream` handle): stream-ordered. The stream waits on the exporter's acquire fence
    /// — no host synchronisation — and the lease's release fence is recorded on it when
    /// the lease goes back, after the work queued there by then. Use the views on that
    /// stream (or order your other streams after it). Without `stream`, opening waits on
    /// the host until the data is there, and giving the lease back synchronises the
    /// device first. Ignored for host memory.
    #[pyo3(signature = (*, writable = false, stream = None))]
    fn open(
        &self,
        py: Python<'_>,
        writable: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Lease> {
        let shared = self.take_unopened(py)?;
        let (lease, addr, device) = self.opened(py, shared)?;
        let ordered = match (device, &self.cuda, stream) {
            (Device::Cuda(_), Some(cuda), Some(stream)) => {
                // Acquire, stream-ordered: the caller's stream waits on the fence.
                let stream = crate::stream::named(stream, cuda)?;
                lease.wait_on(stream).or_raise(py)?;
                true
            }
            (Device::Cuda(_), Some(cuda), None) => {
                // Acquire: the backend's stream waits on the exporter's fence; once it is
                // idle, every stream sees the data (CONSERVATIVE SYNC: a host wait, since
                // the consumers' streams are not ours to keep).
                let cuda = Arc::clone(cuda);
                let lease = &lease;
                py.detach(move || -> Result<(), Failure> {
                    lease.wait_on(Stream::Internal)?;
                    Ok(cuda.synchronize()?)
                })
                .or_raise(py)?;
                false
            }
            _ => false,
        };
        Ok(self.lease_object(lease, addr, device, writable, ordered))
    }

    /// Gives the lease back without opening it. Returns whether it was still unopened.
    fn release(&self) -> bool {
        let old = std::mem::replace(&mut *lock(&self.inner), SharedState::Released);
        matches!(old, SharedState::Unopened(_))
    }

    fn __repr__(&self) -> String {
        format!(
            "<baton.Shared lease {} {} {:?}>",
            self.id,
            dtype_name(self.geometry.dtype),
            self.geometry.shape
        )
    }
}

/// Opens every buffer of `shared` (a list of `baton.Shared`) as `Shared.open` does, in
/// one call: a received bundle group's leases (`SharedBundleGroup.open`). Without `stream`
/// the host waits once, for all of their acquire fences, not once per lease. All or
/// nothing: if one cannot be opened, every lease of the list goes back (those opened
/// already as they drop, the others unopened) and the error says which. `layouts` (one
/// `BundleLayout` per buffer) are checked first: a buffer smaller than its layout's
/// tensors is a `ValueError`, and nothing is opened.
#[pyfunction]
#[pyo3(signature = (shared, *, writable = false, stream = None, layouts = None))]
pub(crate) fn open_all(
    py: Python<'_>,
    shared: Vec<PyRef<'_, Shared>>,
    writable: bool,
    stream: Option<&Bound<'_, PyAny>>,
    layouts: Option<Vec<PyRef<'_, crate::bundle::BundleLayout>>>,
) -> PyResult<Vec<Lease>> {
    if let Some(layouts) = &layouts {
        if layouts.len() != shared.len() {
            return Err(Failure::Value(format!(
                "{} layouts for {} buffers",
                layouts.len(),
                shared.len()
            )))
            .or_raise(py);
        }
        for (s, layout) in shared.iter().zip(layouts) {
            let need = layout.inner.byte_len();
            if need > s.geometry.nbytes as u64 {
                return Err(Failure::Value(format!(
                    "a bundle's tensors need {need} bytes; its buffer has {}",
                    s.geometry.nbytes
                )))
                .or_raise(py);
            }
        }
    }
    let mut taken = Vec::with_capacity(shared.len());
    for s in &shared {
        // Taken before anything opens: whatever fails, the rest of the list is not left
        // half open. Those taken so far go back as `taken` drops.
        taken.push(s.take_unopened(py)?);
    }
    let mut opened = Vec::with_capacity(shared.len());
    let mut backend: Option<Arc<CudaBackend>> = None;
    // The caller's stream, named once for every lease (each device buffer's backend is
    // the node's).
    let mut named: Option<Stream> = None;
    for (s, inner) in shared.iter().zip(taken) {
        let (lease, addr, device) = s.opened(py, inner)?;
        if let (Device::Cuda(_), Some(cuda)) = (device, &s.cuda) {
            match stream {
                Some(stream) => {
                    let stream = match &named {
                        Some(n) => n.clone(),
                        None => named.insert(crate::stream::named(stream, cuda)?).clone(),
                    };
                    lease.wait_on(stream).or_raise(py)?;
                }
                None => {
                    lease.wait_on(Stream::Internal).or_raise(py)?;
                    backend.get_or_insert_with(|| Arc::clone(cuda));
                }
            }
        }
        let ordered = stream.is_some() && matches!(device, Device::Cuda(_));
        opened.push(s.lease_object(lease, addr, device, writable, ordered));
    }
    if let Some(cuda) = backend {
        // CONSERVATIVE SYNC, as in `Shared.open`: once the backend's stream is idle every
        // stream sees the data.
        py.detach(|| cuda.synchronize())
            .map_err(Failure::from)
            .or_raise(py)?;
    }
    Ok(opened)
}

/// `Buffer.wait_on` for every buffer of `buffers` (a list of `baton.Buffer`), in one call:
/// the work queued on `stream` from now on waits once for the release fences of all of
/// them (a lease over several buffers comes back with one), not once per buffer
/// (`BundleGroup.wait_on`). Host buffers have nothing to wait for.
#[pyfunction]
pub(crate) fn wait_all_on(
    py: Python<'_>,
    buffers: Vec<PyRef<'_, Buffer>>,
    stream: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut handles = Vec::with_capacity(buffers.len());
    let mut named: Option<Stream> = None;
    for b in &buffers {
        let handle = b.handle().or_raise(py)?;
        if let (Device::Cuda(_), Some(cuda)) = (b.device, &b.cuda) {
            if named.is_none() {
                named = Some(crate::stream::named(stream, cuda)?);
            }
            handles.push(handle);
        }
    }
    match named {
        Some(stream) => AnyBuffer::wait_all_on(&handles, stream)
            .map_err(Failure::from)
            .or_raise(py),
        None => Ok(()),
    }
}

/// Releases every lease of `leases` (a list of `baton.Lease`) as `Lease.release` does, in
/// one call: those that go back after a device synchronisation go in one batch (one
/// synchronisation for all; the parts of a lease over several buffers back together, so
/// that its `Release` leaves at once). Returns whether every one went back now (none is
/// held by a view).
#[pyfunction]
pub(crate) fn release_all(leases: Vec<PyRef<'_, Lease>>) -> bool {
    let mut all = true;
    let mut batch = Vec::new();
    for lease in &leases {
        let cell = &lease.cell;
        match cell.take_released(false) {
            Some(l) if cell.after_sync() => batch.push(l),
            Some(l) => drop(l),
            None => all = false,
        }
    }
    if !batch.is_empty() {
        drop_after_sync(Deferred::Leases(batch));
    }
    all
}

/// An opened lease on another process's buffer (Python's `baton.Lease`).
#[pyclass(frozen, module = "baton._baton", name = "Lease")]
pub(crate) struct Lease {
    cell: Arc<LeaseCell>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.cell.release(true);
    }
}

impl Lease {
    /// Whether it is another GPU's memory, mapped on this process's.
    pub(crate) fn on_peer_gpu(&self) -> bool {
        self.cell.path.ends_with("-peer-gpu")
    }
}

#[pymethods]
impl Lease {
    /// The shape (outermost dimension first).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        self.cell.geometry.shape_tuple(py)
    }

    /// The element type's name.
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.cell.geometry.dtype)
    }

    /// Bytes in the buffer.
    #[getter]
    fn nbytes(&self) -> usize {
        self.cell.geometry.nbytes
    }

    /// `("cpu", 0)` or `("cuda", ordinal)`.
    #[getter]
    fn device(&self) -> (&'static str, i32) {
        self.cell.device.name()
    }

    /// Whether views may write.
    #[getter]
    fn writable(&self) -> bool {
        self.cell.writable
    }

    /// The lease id (the exporter's).
    #[getter]
    fn lease_id(&self) -> u64 {
        self.cell.id
    }

    /// The exporting process's pid.
    #[getter]
    fn exporter_pid(&self) -> u32 {
        self.cell.exporter_pid
    }

    /// Whether Python released it (it may still be out while views of it live).
    #[getter]
    fn released(&self) -> bool {
        lock(&self.cell.state).released
    }

    /// How its bytes reached this process: `"host-memfd"`, `"host-segment"`,
    /// `"cuda-legacy"`, `"cuda-vmm"`, `"cuda-pool"` (with `"-peer-gpu"` for another GPU's
    /// memory), `"tcp-copy"`, `"nccl-copy"` (Rust's `LeasePath::name`). Readable after
    /// release too.
    #[getter]
    fn path(&self) -> &'static str {
        self.cell.path
    }

    /// Whether the exporter is gone (accessors then raise `baton.Orphaned`).
    #[getter]
    fn orphaned(&self) -> bool {
        lock(&self.cell.state)
            .lease
            .as_ref()
            .is_some_and(AnyLease::is_orphaned)
    }

    /// Views alive (NumPy arrays' bases, DLPack capsules and the tensors made of them).
    #[getter]
    fn views(&self) -> usize {
        lock(&self.cell.state).views
    }

    /// A zero-copy NumPy view of host memory (read-only unless opened writable). The lease
    /// stays out while the array, or any view of it, lives.
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = &self.cell;
        numpy_view(py, || c.view(), &c.geometry, c.addr, c.device, !c.writable)
    }

    /// The buffer's bytes, copied (host or device).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut out = vec![0u8; self.cell.geometry.nbytes];
        let cell = Arc::clone(&self.cell);
        let out = py
            .detach(move || cell.with_lease(|l| Ok(l.read(0, &mut out)?)).map(|()| out))
            .or_raise(py)?;
        Ok(PyBytes::new(py, &out))
    }

    /// A DLPack capsule of the memory (zero-copy), for `numpy.from_dlpack`,
    /// `torch.from_dlpack`, `cupy.from_dlpack`.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let c = &self.cell;
        // Released or orphaned: say so before anything about the arguments.
        c.with_lease(|_| Ok(())).or_raise(py)?;
        let spec = c.geometry.spec(c.addr, c.device, !c.writable);
        dlpack_capsule(
            py,
            || c.view(),
            spec,
            c.device,
            stream.as_ref(),
            max_version,
            dl_device,
            copy,
        )
    }

    /// `(device_type, device_id)` as DLPack numbers them.
    fn __dlpack_device__(&self) -> (i32, i32) {
        self.cell.device.dlpack()
    }

    /// CUDA Array Interface v3, for device memory (an `AttributeError` for host memory).
    /// Reading it makes the lease stay out until this object is collected.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.cell;
        let Some(cuda) = c.cuda.as_ref().filter(|_| c.device != Device::Cpu) else {
            return Err(PyAttributeError::new_err(
                "__cuda_array_interface__: host memory (use numpy() or __dlpack__)",
            ));
        };
        {
            let mut state = lock(&c.state);
            c.usable(&state).or_raise(py)?;
            state.cai = true;
        }
        let d = c.geometry.interface(py, c.addr, !c.writable)?;
        d.set_item("stream", cuda.stream().cu_stream() as usize)?;
        Ok(d)
    }

    /// Gives the lease back: at once if no view of it is alive, else when the last one
    /// goes (the lease is unusable from now on either way). Returns whether it went back
    /// now.
    fn release(&self) -> bool {
        self.cell.release(false)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
        self.cell.release(false);
        false
    }

    fn __repr__(&self) -> String {
        let state = lock(&self.cell.state);
        format!(
            "<baton.Lease {} {} {:?} on {:?}{}{}>",
            self.cell.id,
            dtype_name(self.cell.geometry.dtype),
            self.cell.geometry.shape,
            self.cell.device.name(),
            if state.released { ", released" } else { "" },
            if state.lease.as_ref().is_some_and(AnyLease::is_orphaned) {
                ", orphaned"
            } else {
                ""
            },
        )
    }
}

// ---------------------------------------------------------------------------------------
// Buffers allocated here.

struct BufferState {
    /// Python's handle: `Some` until released (or collected, with `cai`).
    buffer: Option<AnyBuffer>,
    released: bool,
    /// `__cuda_array_interface__` was read: the handle stays until the object goes.
    cai: bool,
}

/// A buffer to be leased writable: what `Buffer.share_mut()` returns, for a message field.
#[pyclass(frozen, module = "baton._baton", name = "WritableShare")]
pub(crate) struct WritableShare {
    pub(crate) buffer: Py<Buffer>,
}

#[pymethods]
impl WritableShare {
    /// The buffer it leases.
    #[getter]
    fn buffer(&self, py: Python<'_>) -> Py<Buffer> {
        self.buffer.clone_ref(py)
    }

    fn __repr__(&self) -> String {
        format!("WritableShare(buffer {})", self.buffer.get().id)
    }
}

/// A buffer this process owns (Python's `baton.Buffer`), from `Node.allocate`.
#[pyclass(frozen, module = "baton._baton", name = "Buffer")]
pub(crate) struct Buffer {
    state: Mutex<BufferState>,
    geometry: Geometry,
    addr: u64,
    device: Device,
    id: u64,
    cuda: Cuda,
}

impl Buffer {
    pub(crate) fn new(buffer: AnyBuffer, cuda: Cuda) -> Result<Self, Failure> {
        let (addr, device) = Device::of(buffer.ptr(), &cuda)?;
        Ok(Self {
            geometry: Geometry::of(Some(buffer.layout()), buffer.byte_len()),
            addr,
            device,
            id: buffer.id().get(),
            cuda,
            state: Mutex::new(BufferState {
                buffer: Some(buffer),
                released: false,
                cai: false,
            }),
        })
    }

    fn released_error(&self) -> Failure {
        Failure::Released(format!(
            "buffer {} was released (release() or the end of its with block): it can no longer be used",
            self.id
        ))
    }

    pub(crate) fn handle(&self) -> Result<AnyBuffer, Failure> {
        let state = lock(&self.state);
        match (&state.buffer, state.released) {
            (Some(b), false) => Ok(b.clone()),
            _ => Err(self.released_error()),
        }
    }

    /// Its CUDA backend, if it is device memory.
    pub(crate) fn cuda_of_device(&self) -> Option<Arc<CudaBackend>> {
        match self.device {
            Device::Cpu => None,
            Device::Cuda(_) => self.cuda.clone(),
        }
    }

    /// A share of it for an outgoing message, and whether it is device memory. With a
    /// `stream` (device memory), the share's acquire fence follows the work queued there.
    /// `writable`: the share grants a writable lease (`Buffer.share_mut()`).
    pub(crate) fn share(
        &self,
        stream: Option<&Stream>,
        writable: bool,
    ) -> Result<(AnyShared, Option<Arc<CudaBackend>>), Failure> {
        let handle = self.handle()?;
        let cuda = self.cuda_of_device();
        let shared = match (stream, &cuda, writable) {
            (Some(stream), Some(_), false) => handle.share_on(stream.clone())?,
            (Some(stream), Some(_), true) => handle.share_mut_on(stream.clone())?,
            (_, _, false) => handle.share(),
            (_, _, true) => handle.share_mut(),
        };
        Ok((shared, cuda))
    }

    fn view(&self) -> Result<ViewGuard, Failure> {
        let buffer = self.handle()?;
        let cuda = match self.device {
            Device::Cpu => None,
            Device::Cuda(_) => self.cuda.clone(),
        };
        if let Some(cuda) = &cuda {
            ordered_for_views(&buffer, cuda)?;
        }
        Ok(ViewGuard::Buffer { buffer, cuda })
    }

    fn let_go(&self, object_dropped: bool) -> bool {
        let handle = {
            let mut state = lock(&self.state);
            let was = !state.released;
            state.released = true;
            if state.cai && !object_dropped {
                return was;
            }
            state.buffer.take()
        };
        match (handle, &self.cuda, self.device) {
            (Some(b), Some(cuda), Device::Cuda(_)) => {
                drop_buffer_after_sync(cuda, Box::new(b));
                true
            }
            (Some(b), _, _) => {
                drop(b);
                true
            }
            (None, _, _) => false,
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.let_go(true);
    }
}

#[pymethods]
impl Buffer {
    /// The shape (outermost dimension first).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        self.geometry.shape_tuple(py)
    }

    /// The element type's name.
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.geometry.dtype)
    }

    /// Bytes in the buffer.
    #[getter]
    fn nbytes(&self) -> usize {
        self.geometry.nbytes
    }

    /// `("cpu", 0)` or `("cuda", ordinal)`.
    #[getter]
    fn device(&self) -> (&'static str, i32) {
        self.device.name()
    }

    /// Its id in this node.
    #[getter]
    fn buffer_id(&self) -> u64 {
        self.id
    }

    /// Whether Python released its handle.
    #[getter]
    fn released(&self) -> bool {
        lock(&self.state).released
    }

    /// Leases on it out now (a lease counts from the moment its message is sent until the
    /// receiver gives it back). Writing while leases are out races their holders' reads.
    #[getter]
    fn leases_out(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.handle().or_raise(py)?.leases_out())
    }

    /// The buffer, to put in a message in its place when its receiver is to write it:
    /// the lease it grants is the one writable lease on the buffer (Rust's
    /// `Buffer::share_mut`). Sending it raises `LeaseConflict` while any other lease on
    /// the buffer is out, and while it is out no other lease is granted.
    fn share_mut(slf: Bound<'_, Self>) -> WritableShare {
        WritableShare {
            buffer: slf.unbind(),
        }
    }

    /// Stream-ordered writes (device memory): the work queued on `stream` from now on
    /// (a `torch.cuda.Stream`, a `cupy.cuda.Stream` or a raw `CUstream` handle) waits for
    /// the work of importers that gave the buffer back — their release fences — with no
    /// host synchronisation. Call it after `returned()` and before writing the buffer on
    /// that stream again, when importers opened it stream-ordered. Nothing to do for host
    /// memory.
    fn wait_on(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let handle = self.handle().or_raise(py)?;
        if let (Device::Cuda(_), Some(cuda)) = (self.device, &self.cuda) {
            let stream = crate::stream::named(stream, cuda)?;
            handle.wait_on(stream).map_err(Failure::from).or_raise(py)?;
        }
        Ok(())
    }

    /// Waits until every lease on it is back (released by its holder, or reclaimed because
    /// the holder's link went down), at most `timeout` seconds; returns at once if none is
    /// out. The GIL is released while it waits.
    ///
    /// Raises `baton.NotReturned` (a `baton.Timeout`) if leases are still out then.
    #[pyo3(signature = (timeout = 30.0))]
    fn returned(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let after = std::time::Duration::try_from_secs_f64(timeout)
            .map_err(|_| {
                Failure::Value(format!(
                    "timeout must be a non-negative number of seconds, not {timeout}"
                ))
            })
            .or_raise(py)?;
        let handle = self.handle().or_raise(py)?;
        // Back already (a sync's leases are, once its reply is in): no wait to set up, no
        // timer on the runtime — a borrowed model asks this of every allocation each sync.
        if handle.leases_out() == 0 {
            return Ok(());
        }
        // The inner deadline answers first (naming the holders); the wait's own is a backstop.
        runtime()
            .or_raise(py)?
            .wait_here(
                py,
                "waiting for leases to come back",
                after.saturating_add(std::time::Duration::from_secs(1)),
                || handle.returned_within(after),
            )?
            .or_raise(py)
    }

    /// `returned(timeout)` for asyncio: an awaitable that resolves once every lease is
    /// back (it waits on the running loop's default executor, so the loop keeps running).
    #[pyo3(signature = (timeout = 30.0))]
    fn returned_async<'py>(slf: &Bound<'py, Self>, timeout: f64) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let asyncio = py.import("asyncio")?;
        let wait = slf.getattr("returned")?;
        asyncio
            .call_method0("get_running_loop")?
            .call_method1("run_in_executor", (py.None(), wait, timeout))
    }

    /// A zero-copy NumPy view of host memory: writable while no lease on the buffer is
    /// out, read-only while one is (the holders read it; writing would race them — wait
    /// for `returned()`, then ask again). A view taken before a lease went out stays
    /// writable: writing through it then is the caller's race. The memory stays allocated
    /// while the array, or any view of it, lives.
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let leased = self.handle().or_raise(py)?.leases_out() > 0;
        numpy_view(
            py,
            || self.view(),
            &self.geometry,
            self.addr,
            self.device,
            leased,
        )
    }

    /// The buffer's bytes, copied (host or device).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let handle = self.handle().or_raise(py)?;
        let mut out = vec![0u8; self.geometry.nbytes];
        let out = py
            .detach(move || handle.read(0, &mut out).map(|()| out))
            .or_raise(py)?;
        Ok(PyBytes::new(py, &out))
    }

    /// A DLPack capsule of the memory (zero-copy, writable).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.handle().or_raise(py)?;
        let spec = self.geometry.spec(self.addr, self.device, false);
        dlpack_capsule(
            py,
            || self.view(),
            spec,
            self.device,
            stream.as_ref(),
            max_version,
            dl_device,
            copy,
        )
    }

    /// `(device_type, device_id)` as DLPack numbers them.
    fn __dlpack_device__(&self) -> (i32, i32) {
        self.device.dlpack()
    }

    /// CUDA Array Interface v3, for device memory (an `AttributeError` for host memory).
    /// Reading it keeps the memory allocated until this object is collected.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let Some(cuda) = self.cuda.as_ref().filter(|_| self.device != Device::Cpu) else {
            return Err(PyAttributeError::new_err(
                "__cuda_array_interface__: host memory (use numpy() or __dlpack__)",
            ));
        };
        let buffer = self.handle().or_raise(py)?;
        let ordered = Arc::clone(cuda);
        py.detach(move || ordered_for_views(&buffer, &ordered))
            .or_raise(py)?;
        {
            let mut state = lock(&self.state);
            if state.released || state.buffer.is_none() {
                return Err(to_py(py, self.released_error()));
            }
            state.cai = true;
        }
        let d = self.geometry.interface(py, self.addr, false)?;
        // Python's own streams wrote it; the backend stream is idle for it.
        d.set_item("stream", cuda.stream().cu_stream() as usize)?;
        Ok(d)
    }

    /// Drops Python's handle. The memory is freed once no view, no lease and no handle of
    /// it is left. Returns whether the handle was still held.
    fn release(&self) -> bool {
        self.let_go(false)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
        self.let_go(false);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "<baton.Buffer {} {} {:?} on {:?}{}>",
            self.id,
            dtype_name(self.geometry.dtype),
            self.geometry.shape,
            self.device.name(),
            if lock(&self.state).released {
                ", released"
            } else {
                ""
            }
        )
    }
}

// ---------------------------------------------------------------------------------------
// Batched copies (`copy.rs`).

/// Device memory of a `Lease` or `Buffer` for a batched copy: its address, bytes and
/// backend, and a view guard that keeps it mapped — and, for a buffer of ours, ordered
/// after its importers' release fences, as any view of it is — while the copies are
/// queued. `write`: the copies write it (a lease must be writable, a buffer unleased).
pub(crate) fn device_memory(
    obj: &Bound<'_, PyAny>,
    write: bool,
) -> Result<(u64, usize, Arc<CudaBackend>, ViewGuard), Failure> {
    if let Ok(lease) = obj.cast::<Lease>() {
        let c = &lease.get().cell;
        let Some(cuda) = c.cuda.clone().filter(|_| c.device != Device::Cpu) else {
            return Err(Failure::Type(
                "a batched copy needs device memory; this lease is host memory".into(),
            ));
        };
        if write && !c.writable {
            return Err(Failure::Buffer(format!(
                "lease {} was opened read-only: open it writable to copy into it",
                c.id
            )));
        }
        return Ok((c.addr, c.geometry.nbytes, cuda, c.view()?));
    }
    if let Ok(buffer) = obj.cast::<Buffer>() {
        let b = buffer.get();
        let Some(cuda) = b.cuda_of_device() else {
            return Err(Failure::Type(
                "a batched copy needs device memory; this buffer is host memory".into(),
            ));
        };
        if write {
            let out = b.handle()?.leases_out();
            if out > 0 {
                return Err(Failure::Buffer(format!(
                    "buffer {} has {out} lease(s) out: writing it would race their holders \
                     (wait for returned() first)",
                    b.id
                )));
            }
        }
        return Ok((b.addr, b.geometry.nbytes, cuda, b.view()?));
    }
    Err(Failure::Type(format!(
        "a batched copy runs on a baton.Lease or baton.Buffer, not a {}",
        obj.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}
