//! A Python process in a Baton deployment: [`Node`], its links ([`Peer`]), the names it
//! answers ([`Mailbox`], [`Call`]).

use crate::bundle::BundleLayout;
use crate::codec;
use crate::errors::{Failure, OrRaise};
use crate::memory::{self, Buffer, Cuda};
use crate::runtime::{Queue, Waited, lock, runtime};
use actix::prelude::*;
use baton_actors::{
    ActorError, AllocateAny, BufferOwner, Listening, PeerEvent, RawCall, RawMessage, RawReply,
};
use baton_ipc::cuda::{self, CudaBackend};
use baton_ipc::select::BackendChoice;
use baton_ipc::{HostBackend, Session, SharedBackend, SocketDir};
use baton_messages::protocol::CallFault;
use baton_messages::{Layout, SessionToken};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// The default deadline of a remote call, a connection and an allocation.
const DEFAULT_TIMEOUT: f64 = 30.0;

fn seconds(py: Python<'_>, timeout: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(timeout)
        .map_err(|_| {
            Failure::Value(format!(
                "timeout must be a non-negative number of seconds, not {timeout}"
            ))
        })
        .or_raise(py)
}

/// The backend `choice` (or `BATON_BACKEND`) asks for, and the CUDA backend among them.
fn backend(choice: Option<&str>) -> Result<(SharedBackend, Cuda), Failure> {
    let choice = match choice {
        Some(s) => BackendChoice::parse(s).ok_or_else(|| {
            Failure::Value(format!(
                "backend {s:?} is not one of 'auto', 'host', 'cuda'"
            ))
        })?,
        None => BackendChoice::from_env()?,
    };
    let host =
        || -> Result<(SharedBackend, Cuda), Failure> { Ok((Arc::new(HostBackend::new()?), None)) };
    let cuda = |c: CudaBackend| -> (SharedBackend, Cuda) {
        let c = Arc::new(c);
        (Arc::clone(&c) as SharedBackend, Some(c))
    };
    match choice {
        BackendChoice::Host => host(),
        BackendChoice::Cuda => Ok(cuda(CudaBackend::from_env()?)),
        // As `baton_ipc::select::auto`, keeping the CUDA backend's type.
        _ => match cuda::probe() {
            Ok(_) => match CudaBackend::from_env() {
                Ok(c) => Ok(cuda(c)),
                Err(baton_ipc::Error::Cuda { op, code }) => {
                    tracing::warn!(op, %code, "a GPU is present but unusable; using the host backend");
                    host()
                }
                Err(e) => Err(e.into()),
            },
            Err(_) => host(),
        },
    }
}

/// Links that come up, for [`Node::accept`]; links this node initiated are left out.
struct UpSink {
    ups: Arc<Queue<baton_actors::Peer>>,
    initiated: Arc<Mutex<HashSet<u64>>>,
}

impl Actor for UpSink {
    type Context = Context<Self>;
}

impl Handler<PeerEvent> for UpSink {
    type Result = ();
    fn handle(&mut self, event: PeerEvent, _: &mut Context<Self>) {
        if let PeerEvent::Up(peer) = event {
            if !lock(&self.initiated).remove(&peer.link_id().get()) {
                let _ = self.ups.push(peer);
            }
        }
    }
}

/// A call to a name this process registered, on its way to Python.
struct Incoming {
    call: RawCall,
    reply: oneshot::Sender<Result<RawMessage, CallFault>>,
}

/// This process in a Baton deployment.
#[pyclass(frozen, module = "baton._baton", name = "Node")]
pub(crate) struct Node {
    node: baton_actors::Node,
    owner: Addr<BufferOwner>,
    cuda: Cuda,
    backend_name: &'static str,
    listening: Arc<Mutex<Vec<Listening>>>,
    ups: Arc<Queue<baton_actors::Peer>>,
    initiated: Arc<Mutex<HashSet<u64>>>,
    mailboxes: Mutex<Vec<(String, Arc<Queue<Incoming>>)>>,
}

impl Node {
    fn start(py: Python<'_>, session: Session, backend_choice: Option<&str>) -> PyResult<Self> {
        let (backend, cuda) = py.detach(|| backend(backend_choice)).or_raise(py)?;
        let backend_name = backend.name();
        let ups = Arc::new(Queue::new());
        let initiated: Arc<Mutex<HashSet<u64>>> = Arc::default();
        let (sink_ups, sink_initiated) = (Arc::clone(&ups), Arc::clone(&initiated));
        let (node, owner) = runtime()
            .or_raise(py)?
            .run(py, "starting a node", move || {
                let node = baton_actors::Node::new(session, backend);
                let owner = BufferOwner::new(&node).start();
                let sink = UpSink {
                    ups: sink_ups,
                    initiated: sink_initiated,
                }
                .start();
                node.subscribe(sink.recipient());
                (node, owner)
            })?;
        Ok(Self {
            node,
            owner,
            cuda,
            backend_name,
            listening: Arc::default(),
            ups,
            initiated,
            mailboxes: Mutex::new(Vec::new()),
        })
    }

    fn peer(&self, peer: baton_actors::Peer) -> Peer {
        Peer {
            peer,
            cuda: self.cuda.clone(),
        }
    }
}

fn token_from(hex: &str, whence: &str) -> Result<Session, Failure> {
    SessionToken::from_hex(hex.trim())
        .map(Session::new)
        .ok_or_else(|| Failure::Value(format!("{whence} is not a session token (64 hex digits)")))
}

#[pymethods]
impl Node {
    /// Joins a deployment with its session token: `token` (64 hex digits), or the file
    /// `token_file` holds, or else — neither given — the token a Baton supervisor passed
    /// this process (`BATON_TOKEN_FD`, read and closed; `BATON_TOKEN` as a fallback).
    /// `backend`: `"auto"` (CUDA when a GPU is usable, else host), `"host"` or `"cuda"`;
    /// default `BATON_BACKEND`, else `"auto"`.
    #[new]
    #[pyo3(signature = (*, token = None, token_file = None, backend = None))]
    fn new(
        py: Python<'_>,
        token: Option<String>,
        token_file: Option<PathBuf>,
        backend: Option<String>,
    ) -> PyResult<Self> {
        let session = match (token, token_file) {
            (Some(_), Some(_)) => {
                return Err(Failure::Value("give token or token_file, not both".into()))
                    .or_raise(py);
            }
            (Some(hex), None) => token_from(&hex, "token").or_raise(py)?,
            (None, Some(path)) => {
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| {
                        Failure::Value(format!("reading the token file {}: {e}", path.display()))
                    })
                    .or_raise(py)?;
                token_from(&text, &format!("the content of {}", path.display())).or_raise(py)?
            }
            (None, None) => Session::from_env().or_raise(py)?,
        };
        Self::start(py, session, backend.as_deref())
    }

    /// The entry point of a child started with `Node.spawn` (or Rust's
    /// `Node::spawn_child`): the token it was passed, the parent's backend, and the link
    /// to the parent. Returns `(node, parent)`; `parent` is a `Peer`.
    ///
    /// The parent may call as soon as the link is up, and this process's calls are
    /// answered on the extension's own thread: a child that serves names should register
    /// them first — `node = Node()`, `node.register(...)`, then
    /// `parent = node.connect_parent()` — or a call may find no name yet (`NoSuchActor`).
    ///
    /// Raises `baton.NoParent` in a process not started that way.
    #[staticmethod]
    #[pyo3(signature = (*, backend = None, timeout = DEFAULT_TIMEOUT))]
    fn join(py: Python<'_>, backend: Option<String>, timeout: f64) -> PyResult<(Self, Peer)> {
        let node = Self::new(py, None, None, backend)?;
        let parent = node.connect_parent(py, timeout)?;
        Ok((node, parent))
    }

    /// Links to the parent that started this process with `Node.spawn` (or Rust's
    /// `Node::spawn_child`), within `timeout` seconds. Register the names the parent calls
    /// before this.
    ///
    /// Raises `baton.NoParent` in a process not started that way.
    #[pyo3(signature = (*, timeout = DEFAULT_TIMEOUT))]
    fn connect_parent(&self, py: Python<'_>, timeout: f64) -> PyResult<Peer> {
        let Some(socket) = std::env::var_os(baton_actors::PARENT_SOCKET_ENV) else {
            return Err(Failure::Actor(ActorError::NoParent {
                var: baton_actors::PARENT_SOCKET_ENV,
            }))
            .or_raise(py);
        };
        self.connect(py, PathBuf::from(socket), timeout)
    }

    /// Starts `args` (a program and its arguments: `[sys.executable, "worker.py"]`, or a
    /// Rust program that calls `Node::join`) as a child process linked to this node, and
    /// returns once it has linked (within `timeout` seconds): a `baton.Child`, whose
    /// `peer` is the link. The child gets the session token through an inherited pipe
    /// (never its environment) and this node's backend; it calls `baton.Node.join()`.
    /// `env`: variables to set for it (on top of this process's environment).
    ///
    /// The child is SIGKILLed if this process dies, and when the `Child` object is
    /// collected while it still runs: `wait()` for it, or `kill()` it.
    #[pyo3(signature = (args, *, env = None, timeout = DEFAULT_TIMEOUT))]
    fn spawn(
        &self,
        py: Python<'_>,
        args: Vec<PathBuf>,
        env: Option<std::collections::HashMap<String, String>>,
        timeout: f64,
    ) -> PyResult<Child> {
        let deadline = seconds(py, timeout)?;
        let Some((program, rest)) = args.split_first() else {
            return Err(Failure::Value(
                "args needs at least the program to start".into(),
            ))
            .or_raise(py);
        };
        let mut cmd = std::process::Command::new(program);
        cmd.args(rest);
        cmd.envs(env.unwrap_or_default());
        let node = self.node.clone();
        let initiated = Arc::clone(&self.initiated);
        let linked = runtime()
            .or_raise(py)?
            .block_on(py, "starting a child", deadline, move || async move {
                let child = node.spawn_child(cmd).await?;
                // Its link is ours, not one `accept` returns.
                lock(&initiated).insert(child.peer().link_id().get());
                Ok::<_, ActorError>(child)
            })?
            .or_raise(py)?;
        let peer = self.peer(linked.peer().clone());
        let pid = linked.pid();
        Ok(Child {
            peer: Py::new(py, peer)?,
            pid,
            process: Mutex::new(Some(linked.into_child())),
        })
    }

    /// The node of a process a Baton supervisor started (`Node()` with no token).
    #[staticmethod]
    #[pyo3(signature = (*, backend = None))]
    fn from_env(py: Python<'_>, backend: Option<String>) -> PyResult<Self> {
        let session = Session::from_env().or_raise(py)?;
        Self::start(py, session, backend.as_deref())
    }

    /// This process's pid.
    #[getter]
    fn pid(&self) -> u32 {
        self.node.session().process().pid
    }

    /// The backend buffers are allocated with (`"host"`, `"cuda"`).
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend_name
    }

    /// Connects to the node listening at `path`; credentials and token are checked both
    /// ways before any buffer moves.
    #[pyo3(signature = (path, *, timeout = DEFAULT_TIMEOUT))]
    fn connect(&self, py: Python<'_>, path: PathBuf, timeout: f64) -> PyResult<Peer> {
        let deadline = seconds(py, timeout)?;
        let node = self.node.clone();
        let initiated = Arc::clone(&self.initiated);
        let peer = runtime()
            .or_raise(py)?
            .block_on(py, "connecting", deadline, move || async move {
                let peer = node.connect(path).await?;
                lock(&initiated).insert(peer.link_id().get());
                Ok::<_, ActorError>(peer)
            })?
            .or_raise(py)?;
        Ok(self.peer(peer))
    }

    /// Accepts links at `directory/name` (the directory is made private, mode 0700, if it
    /// does not exist; its parent must) until `close()`. Returns the socket's path.
    #[pyo3(signature = (directory, name = "node.sock"))]
    fn listen(&self, py: Python<'_>, directory: PathBuf, name: &str) -> PyResult<PathBuf> {
        let node = self.node.clone();
        let name = name.to_owned();
        let listening = runtime()
            .or_raise(py)?
            .run(py, "listening", move || {
                let dir = SocketDir::create(directory)?;
                node.listen(&dir, &name)
            })?
            .or_raise(py)?;
        let path = listening.path().to_owned();
        lock(&self.listening).push(listening);
        Ok(path)
    }

    /// The next peer that linked to this node's listeners, within `timeout` seconds.
    #[pyo3(signature = (*, timeout = DEFAULT_TIMEOUT))]
    fn accept(&self, py: Python<'_>, timeout: f64) -> PyResult<Peer> {
        let deadline = seconds(py, timeout)?;
        match self.ups.pop_py(py, deadline)? {
            Waited::Done(peer) => Ok(self.peer(peer)),
            Waited::Gone => Err(Failure::Released("the node was closed".into())).or_raise(py),
            Waited::Pending => Err(Failure::timeout("accepting a peer", deadline)).or_raise(py),
        }
    }

    /// The links up now.
    fn peers(&self) -> Vec<Peer> {
        self.node
            .peers()
            .into_iter()
            .map(|p| self.peer(p))
            .collect()
    }

    /// Answers calls to `name` whose wire type name is `type_name` (a call of another type
    /// is refused before it reaches Python). Calls wait in the returned mailbox.
    fn register(&self, name: String, type_name: String) -> Mailbox {
        let queue: Arc<Queue<Incoming>> = Arc::new(Queue::new());
        let handler_queue = Arc::clone(&queue);
        self.node
            .register_raw(&name, &type_name, move |call: RawCall| -> RawReply {
                let (tx, rx) = oneshot::channel();
                if handler_queue.push(Incoming { call, reply: tx }).is_err() {
                    return Box::pin(async { Err(CallFault::ActorGone) });
                }
                Box::pin(async move { rx.await.unwrap_or(Err(CallFault::ActorGone)) })
            });
        lock(&self.mailboxes).push((name.clone(), Arc::clone(&queue)));
        Mailbox {
            name,
            type_name,
            queue,
            node: self.node.clone(),
            listening: Arc::clone(&self.listening),
            cuda: self.cuda.clone(),
        }
    }

    /// Allocates a buffer of `shape` and `dtype` in this process's memory (device memory on
    /// the CUDA backend), to fill through its views and send in messages. Host memory
    /// starts zeroed; device memory is not initialised.
    #[pyo3(signature = (shape, dtype = None, *, timeout = DEFAULT_TIMEOUT))]
    fn allocate(
        &self,
        py: Python<'_>,
        shape: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
        timeout: f64,
    ) -> PyResult<Buffer> {
        let shape = memory::parse_shape(shape, "a shape")?;
        let dtype = match dtype {
            Some(d) => memory::parse_dtype(d)?,
            None => baton_messages::DType::F32,
        };
        let layout = Layout::new(dtype, shape);
        let owner = self.owner.clone();
        let deadline = seconds(py, timeout)?;
        let buffer = runtime()
            .or_raise(py)?
            .block_on(py, "allocating", deadline, move || async move {
                owner.send(AllocateAny { layout }).await?
            })?
            .or_raise(py)?;
        Buffer::new(buffer, self.cuda.clone()).or_raise(py)
    }

    /// Allocates a bundle: one buffer holding many named tensors (see `baton.BundleLayout`:
    /// `spec` is one, or a dict `{name: (shape, dtype)}`, or a list of `(name, shape,
    /// dtype)`). Its `tensors()` are views of the buffer; sent in a message, it is one lease,
    /// and the receiver opens it as one (`baton.SharedBundle.open`). On a GPU it is VMM
    /// memory where the device has it, whatever `BATON_CUDA_EXPORT` says (as Rust's
    /// `Node::allocate_bundle`): importers read it as fast as their own memory.
    #[pyo3(signature = (spec, *, timeout = DEFAULT_TIMEOUT))]
    fn allocate_bundle<'py>(
        &self,
        py: Python<'py>,
        spec: &Bound<'py, PyAny>,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let layout = match spec.cast::<BundleLayout>() {
            Ok(l) => l.clone(),
            Err(_) => Bound::new(py, BundleLayout::new(spec)?)?,
        };
        let buffer = if self.node.backend().cuda().is_some() {
            // The node's own allocation (on this thread, without the GIL: a driver call).
            let (node, inner) = (self.node.clone(), (*layout.get().inner).clone());
            let bundle = py
                .detach(move || node.allocate_bundle(inner))
                .or_raise(py)?;
            Buffer::new(bundle.buffer().clone().into(), self.cuda.clone()).or_raise(py)?
        } else {
            // At least a byte: a bundle of empty tensors is still one allocation.
            let bytes = layout.get().inner.byte_len().max(1).into_pyobject(py)?;
            let uint8 = "uint8".into_pyobject(py)?;
            self.allocate(py, bytes.as_any(), Some(uint8.as_any()), timeout)?
        };
        py.import("baton.bundle")?
            .getattr("Bundle")?
            .call1((buffer, layout))
    }

    /// Leases memory PyTorch allocated, without a copy: `tensors` maps names to CUDA
    /// tensors (a dict, or `(name, tensor)` pairs such as `model.named_parameters()`),
    /// each contiguous, on this node's device. Returns a `baton.BundleGroup` of one
    /// `baton.Bundle` per CUDA allocation the tensors lie in (PyTorch's caching allocator
    /// packs small tensors into shared segments), each naming its tensors where they are:
    /// sent as one message field and one lease over every allocation, the receiver opens
    /// the group in one call and loads it with one `CopyPlan`. The tensors' storages are kept alive until Baton is done
    /// with them (no handle, lease or mapping left, no work pending). A peer a bundle is
    /// leased to can reach its whole allocation, not only the tensors named. Refused
    /// (`baton.NotBorrowable`) for expandable segments and other memory legacy CUDA IPC
    /// cannot share, another device's memory, and an allocation this process lent already
    /// (borrow a model's parameters once and keep the bundles); `ValueError` for a tensor
    /// that is empty, not contiguous, not CUDA, or overlaps another (tied weights: pass one).
    #[allow(
        unsafe_code,
        reason = "borrowing memory: the storages kept stop PyTorch freeing it (see the body)"
    )]
    fn borrow_tensors<'py>(
        &self,
        py: Python<'py>,
        tensors: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        use baton_messages::{BundleLayout as Layout, TensorSpec};
        use std::collections::BTreeMap;
        let value = |m: String| crate::errors::to_py(py, Failure::Value(m));
        let backend = Arc::clone(self.node.backend());
        let Some(cuda) = backend.cuda() else {
            return Err(value(format!(
                "this node's memory is {}, not CUDA: only CUDA tensors can be borrowed",
                backend.name()
            )));
        };
        let items: Vec<(String, Bound<'py, PyAny>)> = match tensors.cast::<PyDict>() {
            Ok(d) => d
                .iter()
                .map(|(k, v)| Ok((k.extract()?, v)))
                .collect::<PyResult<_>>()?,
            Err(_) => tensors
                .try_iter()?
                .map(|i| i?.extract::<(String, Bound<'py, PyAny>)>())
                .collect::<PyResult<_>>()?,
        };
        // Allocation base -> its tensors and the storages that keep it.
        type Group<'py> = (Vec<TensorSpec>, Vec<Py<PyAny>>, Vec<(u64, u64, String)>);
        let mut groups: BTreeMap<u64, Group<'py>> = BTreeMap::new();
        for (name, t) in items {
            let is_cuda: bool = t.getattr("is_cuda")?.extract()?;
            let contiguous: bool = t.call_method0("is_contiguous")?.extract()?;
            let nbytes: u64 = t.call_method0("numel")?.extract::<u64>()?
                * t.call_method0("element_size")?.extract::<u64>()?;
            if !is_cuda || !contiguous || nbytes == 0 {
                return Err(value(format!(
                    "tensor {name:?} cannot be borrowed: it must be a CUDA tensor, \
                     contiguous and not empty"
                )));
            }
            let ptr: u64 = t.call_method0("data_ptr")?.extract()?;
            let dtype = memory::parse_dtype(&t.getattr("dtype")?)?;
            let shape = memory::parse_shape(&t.getattr("shape")?, "a tensor's shape")?;
            let (base, _) = cuda.address_range(ptr).or_raise(py)?;
            let group = groups.entry(base).or_default();
            if let Some((_, _, other)) = group
                .2
                .iter()
                .find(|(p, n, _)| ptr < p + n && *p < ptr + nbytes)
            {
                return Err(value(format!(
                    "tensors {other:?} and {name:?} share memory (tied weights?): pass one of them"
                )));
            }
            group.2.push((ptr, nbytes, name.clone()));
            group.0.push(TensorSpec {
                name,
                dtype,
                shape,
                offset: ptr - base,
            });
            // The storage, not the tensor: a tensor can be pointed at other memory
            // (`set_`); its storage keeps this block, so PyTorch keeps the segment.
            group.1.push(t.call_method0("untyped_storage")?.unbind());
        }
        let bundle_module = py.import("baton.bundle")?;
        let bundle_class = bundle_module.getattr("Bundle")?;
        let out = PyList::empty(py);
        for (base, (specs, keep, _)) in groups {
            let layout = Arc::new(
                Layout::new(specs)
                    .map_err(|e| Failure::Value(e.to_string()))
                    .or_raise(py)?,
            );
            // SAFETY: PyTorch's caching allocator frees a segment (`cudaFree`) only when
            // no block of it is in use, and each storage kept holds a block of this one;
            // `keep` holds them until Baton is done with the memory. (A user who resizes a
            // kept storage to nothing breaks this: the guide says not to.)
            let bundle = unsafe {
                self.node
                    .borrow_bundle(base, Box::new(keep), (*layout).clone())
            }
            .or_raise(py)?;
            let buffer =
                Buffer::new(bundle.buffer().clone().into(), self.cuda.clone()).or_raise(py)?;
            out.append(bundle_class.call1((buffer, BundleLayout::of(layout)))?)?;
        }
        bundle_module.getattr("BundleGroup")?.call1((out,))
    }

    /// The buffers this node exports, with their leases: a list of dicts with `buffer`,
    /// `bytes`, `leases` (`(lease_id, pid)` pairs), `mapped_by` (pids), `retiring`,
    /// `quarantined`.
    fn lease_table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for b in self.node.lease_table() {
            let d = PyDict::new(py);
            d.set_item("buffer", b.buffer.get())?;
            d.set_item("bytes", b.bytes)?;
            let leases: Vec<(u64, u32)> = b.leases.iter().map(|(l, p)| (l.get(), p.pid)).collect();
            d.set_item("leases", leases)?;
            let mapped: Vec<u32> = b.mapped_by.iter().map(|p| p.pid).collect();
            d.set_item("mapped_by", mapped)?;
            d.set_item("retiring", b.retiring)?;
            d.set_item("quarantined", b.quarantined)?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// Counters of the buffers this node exports: `buffers`, `retiring`, `quarantined`,
    /// `leases`, `bytes`, `granted`, `freed`.
    fn export_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.node.export_stats();
        let d = PyDict::new(py);
        d.set_item("buffers", s.buffers)?;
        d.set_item("retiring", s.retiring)?;
        d.set_item("quarantined", s.quarantined)?;
        d.set_item("leases", s.leases)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("granted", s.granted)?;
        d.set_item("freed", s.freed)?;
        Ok(d)
    }

    /// Counters of this node's import cache: `opens` (driver-level opens or `mmap`s:
    /// each first open of an allocation), `hits` (opens served from a mapping already
    /// there), `closes`, `stale`, `evictions`, and now: `live`, `warm`, `warm_bytes`.
    fn import_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.node.cache().stats();
        let d = PyDict::new(py);
        d.set_item("opens", s.opens)?;
        d.set_item("hits", s.hits)?;
        d.set_item("closes", s.closes)?;
        d.set_item("stale", s.stale)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("live", s.live)?;
        d.set_item("warm", s.warm)?;
        d.set_item("warm_bytes", s.warm_bytes)?;
        Ok(d)
    }

    /// This node's leases by the path their bytes took (Rust's `Node::path_counts`):
    /// `paths`, a list of `{path, granted, granted_bytes, opened, opened_bytes}` (granted
    /// on our buffers, opened on others'; only paths taken so far), and `downgrades`, a
    /// list of `{wanted, taken, count}` (slower paths taken, each allowed by
    /// `BATON_ALLOW_DOWNGRADE`).
    fn path_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (paths, downgrades) = self.node.path_counts();
        let rows = PyList::empty(py);
        for p in paths {
            let d = PyDict::new(py);
            d.set_item("path", p.path)?;
            d.set_item("granted", p.granted)?;
            d.set_item("granted_bytes", p.granted_bytes)?;
            d.set_item("opened", p.opened)?;
            d.set_item("opened_bytes", p.opened_bytes)?;
            rows.append(d)?;
        }
        let taken = PyList::empty(py);
        for g in downgrades {
            let d = PyDict::new(py);
            d.set_item("wanted", g.wanted)?;
            d.set_item("taken", g.taken)?;
            d.set_item("count", g.count)?;
            taken.append(d)?;
        }
        let out = PyDict::new(py);
        out.set_item("paths", rows)?;
        out.set_item("downgrades", taken)?;
        Ok(out)
    }

    /// Stops listening, closes every mailbox (calls waiting in them are answered
    /// `ActorGone`) and every link (leases granted over them stop counting, leases held
    /// over them are orphaned), and gives the device back what the backend keeps for reuse
    /// (`Backend::release_idle`). First waits (at most 2 s) until the fences this node
    /// recorded for peers were written, so that peers need not wait out their fence
    /// deadline after we exit; then (at most 3 s) until each link's close has written the
    /// answers under way, so that a reply made just before reaches its caller.
    fn close(&self, py: Python<'_>) {
        let node = self.node.clone();
        py.detach(move || node.flush_fences(Duration::from_secs(2)));
        lock(&self.listening).clear();
        for (name, queue) in lock(&self.mailboxes).drain(..) {
            self.node.unregister(&name); // every type of it
            drop(queue.close());
        }
        let peers = self.node.peers();
        for peer in &peers {
            peer.close();
        }
        // Each link's close writes the answers under way first (at most `CLOSE_FLUSH`):
        // waited for here, so that a reply made just before `close()` reaches its caller
        // even when this process exits right after.
        if !peers.is_empty()
            && let Ok(rt) = runtime()
        {
            let _ = rt.block_on(
                py,
                "closing the node's links",
                baton_actors::CLOSE_FLUSH + Duration::from_secs(1),
                move || async move {
                    for peer in peers {
                        peer.closed().await;
                    }
                },
            );
        }
        drop(self.ups.close());
        // What the backend keeps for reuse goes back to the device (a pool another process
        // imported gives its memory back only when destroyed: once its last buffer is freed).
        self.node.backend().release_idle();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(_exc.py());
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "<baton.Node pid {} on {}, {} links>",
            self.pid(),
            self.backend_name,
            self.node.peers().len()
        )
    }
}

/// A linked process.
#[pyclass(frozen, module = "baton._baton", name = "Peer")]
pub(crate) struct Peer {
    peer: baton_actors::Peer,
    cuda: Cuda,
}

#[pymethods]
impl Peer {
    /// Its pid (as proven in the handshake).
    #[getter]
    fn pid(&self) -> u32 {
        self.peer.process().pid
    }

    /// Its uid (from the kernel's credentials of the socket); `None` for a peer on a TCP
    /// host link, which has none.
    #[getter]
    fn uid(&self) -> Option<u32> {
        self.peer.info().cred().map(|c| c.uid)
    }

    /// Whether the link is up.
    #[getter]
    fn connected(&self) -> bool {
        self.peer.is_connected()
    }

    /// Calls the actor registered as `target` in the peer, as wire type `type_name`, with
    /// `message` (encoded as MessagePack: the receiving type must use
    /// `Encoding::MessagePack`), and returns its reply. `baton.Buffer`s in `message` are
    /// leased to the peer; buffers in the reply arrive as `baton.Shared`.
    ///
    /// Device buffers: without `stream`, the device is synchronised before the message
    /// leaves, so the peer reads what any stream of this process wrote. With `stream` (a
    /// `torch.cuda.Stream`, a `cupy.cuda.Stream` or a raw `CUstream` handle), nothing is
    /// synchronised: each buffer's acquire fence is recorded on that stream, after the work
    /// queued there — write the buffers on it (or order your other streams before it).
    #[pyo3(signature = (target, type_name, message = None, *, timeout = DEFAULT_TIMEOUT, stream = None))]
    fn call(
        &self,
        py: Python<'_>,
        target: String,
        type_name: String,
        message: Option<&Bound<'_, PyAny>>,
        timeout: f64,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let deadline = seconds(py, timeout)?;
        let out = match message {
            Some(m) => codec::encode(m, stream)?,
            None => codec::encode(&py.None().into_bound(py), None)?,
        };
        if let Some(cuda) = &out.device {
            py.detach(|| memory::sync_context(cuda)).or_raise(py)?;
        }
        // Queued on the link from this thread, and the reply waited for here: the runtime
        // thread that receives it wakes this one directly.
        let reply = runtime()
            .or_raise(py)?
            .wait_here(py, "remote call", deadline, || {
                self.peer.call_raw(&target, &type_name, out.message)
            })?
            .or_raise(py)?;
        codec::decode(py, "reply", reply, &self.cuda)
    }

    /// Measures a round trip to the peer, in seconds.
    #[pyo3(signature = (*, timeout = DEFAULT_TIMEOUT))]
    fn ping(&self, py: Python<'_>, timeout: f64) -> PyResult<f64> {
        let deadline = seconds(py, timeout)?;
        let peer = self.peer.clone();
        let rtt = runtime()
            .or_raise(py)?
            .block_on(
                py,
                "ping",
                deadline,
                move || async move { peer.ping().await },
            )?
            .or_raise(py)?;
        Ok(rtt.as_secs_f64())
    }

    /// Closes the link: leases granted over it stop counting, leases held over it are
    /// orphaned.
    fn close(&self) {
        self.peer.close();
    }

    fn __repr__(&self) -> String {
        format!(
            "<baton.Peer pid {}{}>",
            self.pid(),
            if self.connected() { "" } else { ", closed" }
        )
    }
}

/// A child process started with `Node.spawn`, linked to its parent.
#[pyclass(frozen, module = "baton._baton", name = "Child")]
pub(crate) struct Child {
    peer: Py<Peer>,
    pid: u32,
    /// `None` once reaped.
    process: Mutex<Option<std::process::Child>>,
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Some(mut child) = lock(&self.process).take() {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = std::thread::Builder::new()
                .name("baton-child-reap".into())
                .spawn(move || child.wait());
        }
    }
}

#[pymethods]
impl Child {
    /// The link to the child.
    #[getter]
    fn peer(&self, py: Python<'_>) -> Py<Peer> {
        self.peer.clone_ref(py)
    }

    /// Its pid.
    #[getter]
    fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits at most `timeout` seconds for the child to exit (the GIL is released) and
    /// returns its exit code, or `-signal` if a signal ended it, as `subprocess` does.
    /// Raises `baton.Timeout` if it still runs (it keeps running).
    #[pyo3(signature = (timeout = DEFAULT_TIMEOUT))]
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<i32> {
        use std::os::unix::process::ExitStatusExt;
        let after = seconds(py, timeout)?;
        let start = std::time::Instant::now();
        loop {
            let status = {
                let mut process = lock(&self.process);
                let Some(child) = process.as_mut() else {
                    return Err(Failure::Released(format!(
                        "child {} was reaped already",
                        self.pid
                    )))
                    .or_raise(py);
                };
                child
                    .try_wait()
                    .map_err(|e| Failure::Value(format!("waiting for child {}: {e}", self.pid)))
                    .or_raise(py)?
            };
            if let Some(status) = status {
                lock(&self.process).take();
                return Ok(status
                    .code()
                    .unwrap_or_else(|| -status.signal().unwrap_or(0)));
            }
            if start.elapsed() >= after {
                return Err(Failure::timeout("waiting for a child to exit", after)).or_raise(py);
            }
            py.detach(|| std::thread::sleep(Duration::from_millis(5)));
            py.check_signals()?;
        }
    }

    /// Sends SIGKILL to the child (reap it with `wait`).
    fn kill(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(child) = lock(&self.process).as_mut() {
            child
                .kill()
                .map_err(|e| Failure::Value(format!("killing child {}: {e}", self.pid)))
                .or_raise(py)?;
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("<baton.Child pid {}>", self.pid)
    }
}

/// Calls to a registered name, waiting to be received.
#[pyclass(frozen, module = "baton._baton", name = "Mailbox")]
pub(crate) struct Mailbox {
    name: String,
    type_name: String,
    queue: Arc<Queue<Incoming>>,
    node: baton_actors::Node,
    /// The node's listeners: while it listens, a caller may still come.
    listening: Arc<Mutex<Vec<Listening>>>,
    cuda: Cuda,
}

/// How often a waiting `Mailbox.recv` looks whether any caller is left.
const LINK_CHECK: Duration = Duration::from_millis(50);

impl Mailbox {
    /// Whether nobody can call this mailbox any more: no link is up and the node does not
    /// listen.
    fn unreachable(&self) -> bool {
        self.node.peers().is_empty() && lock(&self.listening).is_empty()
    }
}

#[pymethods]
impl Mailbox {
    /// The registered name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The wire type name calls must have.
    #[getter]
    fn type_name(&self) -> &str {
        &self.type_name
    }

    /// Calls waiting now.
    #[getter]
    fn pending(&self) -> usize {
        self.queue.len()
    }

    /// The next call, within `timeout` seconds (`None`: until one comes or the mailbox is
    /// closed; Ctrl-C interrupts). A call whose payload is not MessagePack is answered
    /// `BadPayload` here and never returned.
    #[pyo3(signature = (*, timeout = None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Call> {
        let deadline = match timeout {
            Some(t) => seconds(py, t)?,
            None => Duration::MAX,
        };
        let start = std::time::Instant::now();
        loop {
            let left = deadline.saturating_sub(start.elapsed());
            let incoming = match self.queue.pop_py(py, left.min(LINK_CHECK))? {
                Waited::Done(incoming) => incoming,
                Waited::Gone => {
                    return Err(Failure::Released(format!(
                        "mailbox {:?} was closed",
                        self.name
                    )))
                    .or_raise(py);
                }
                Waited::Pending if self.unreachable() => {
                    return Err(Failure::NoLinks(format!(
                        "mailbox {:?}: no link is up and the node does not listen, so no call can come",
                        self.name
                    )))
                    .or_raise(py);
                }
                Waited::Pending if left > LINK_CHECK => continue,
                Waited::Pending => {
                    return Err(Failure::timeout("receiving a call", deadline)).or_raise(py);
                }
            };
            let Incoming { call, reply } = incoming;
            let peer_pid = call.peer.pid;
            match codec::decode(py, "message", call.message, &self.cuda) {
                Ok(message) => {
                    return Ok(Call {
                        message,
                        peer_pid,
                        type_name: self.type_name.clone(),
                        reply: Mutex::new(Some(reply)),
                    });
                }
                Err(e) => {
                    tracing::warn!(peer = peer_pid, error = %e, "a call's payload did not decode: refused");
                    let _ = reply.send(Err(CallFault::BadPayload(e.to_string())));
                }
            }
        }
    }

    /// `recv` for asyncio: an awaitable of the next call. Cancelling it loses no call: a
    /// call is taken from the mailbox only on the event loop's thread, never by a helper
    /// thread that could outlive the cancellation (one of the loop's default executor
    /// waits at most half a second meanwhile, taking nothing).
    #[pyo3(signature = (*, timeout = None))]
    fn recv_async<'py>(
        slf: &Bound<'py, Self>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        if let Some(t) = timeout {
            seconds(py, t)?;
        }
        py.import("baton._aio")?
            .call_method1("recv", (slf, timeout))
    }

    /// Waits (without the GIL) at most `timeout` seconds until a call is waiting or the
    /// mailbox closed; takes nothing. For `recv_async`.
    fn _wait_ready(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let after = seconds(py, timeout)?;
        let queue = Arc::clone(&self.queue);
        Ok(py.detach(move || queue.wait_ready(after)))
    }

    /// Unregisters the name (for this wire type); calls waiting are answered `ActorGone`.
    fn close(&self) {
        self.node.unregister_type(&self.name, &self.type_name);
        drop(self.queue.close());
    }

    /// Whether it was closed.
    #[getter]
    fn closed(&self) -> bool {
        self.queue.is_closed()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close();
        false
    }
}

/// A received call; answer it with `reply` or `reject`. A call dropped unanswered is
/// answered `ActorGone`.
#[pyclass(frozen, module = "baton._baton", name = "Call")]
pub(crate) struct Call {
    message: Py<PyAny>,
    peer_pid: u32,
    type_name: String,
    reply: Mutex<Option<oneshot::Sender<Result<RawMessage, CallFault>>>>,
}

impl Call {
    fn answer(&self, py: Python<'_>, answer: Result<RawMessage, CallFault>) -> PyResult<bool> {
        let Some(tx) = lock(&self.reply).take() else {
            return Err(Failure::Released("this call was answered already".into())).or_raise(py);
        };
        Ok(tx.send(answer).is_ok())
    }
}

#[pymethods]
impl Call {
    /// The decoded message (buffers in it are `baton.Shared`).
    #[getter]
    fn message(&self, py: Python<'_>) -> Py<PyAny> {
        self.message.clone_ref(py)
    }

    /// The caller's pid.
    #[getter]
    fn peer_pid(&self) -> u32 {
        self.peer_pid
    }

    /// The call's wire type name.
    #[getter]
    fn type_name(&self) -> &str {
        &self.type_name
    }

    /// Answers with `value` (`baton.Buffer`s in it are leased to the caller). Returns
    /// whether the answer reached the link (`False`: the caller's link went down first).
    /// `stream`: as for `Peer.call`.
    #[pyo3(signature = (value = None, *, stream = None))]
    fn reply(
        &self,
        py: Python<'_>,
        value: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if lock(&self.reply).is_none() {
            return Err(Failure::Released("this call was answered already".into())).or_raise(py);
        }
        let out = match value {
            Some(v) => codec::encode(v, stream)?,
            None => codec::encode(&py.None().into_bound(py), None)?,
        };
        if let Some(cuda) = &out.device {
            py.detach(|| memory::sync_context(cuda)).or_raise(py)?;
        }
        self.answer(py, Ok(out.message))
    }

    /// Refuses the call: the caller gets `baton.BadPayload` with `reason`.
    fn reject(&self, py: Python<'_>, reason: String) -> PyResult<bool> {
        self.answer(py, Err(CallFault::BadPayload(reason)))
    }

    fn __repr__(&self) -> String {
        format!("<baton.Call {} from pid {}>", self.type_name, self.peer_pid)
    }
}

/// A fresh random session token (64 hex digits), for a Python process that starts a
/// deployment: hand it to the other processes (a file only they can read, or a pipe).
#[pyfunction]
pub(crate) fn generate_token(py: Python<'_>) -> PyResult<String> {
    Ok(Session::generate().or_raise(py)?.token().to_hex())
}

/// Sends Baton's `tracing` events to stderr, filtered by `filter` (`"info"`,
/// `"baton_actors=debug"`, …). Returns whether logging was set up (it can be only once).
#[pyfunction]
#[pyo3(signature = (filter = "info"))]
pub(crate) fn log_to_stderr(filter: &str) -> bool {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init()
        .is_ok()
}
