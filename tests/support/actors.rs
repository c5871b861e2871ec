//! Helpers for actor tests: a parent node with a listener, an event recorder, polling.

#![allow(dead_code)]

use super::peer;
use actix::prelude::*;
use baton::actors::{BufferOwner, Listening, Node, NodeConfig, Peer, PeerEvent};
use baton::ipc::{Backend, FreeWhileMapped, HostBackend};
use baton::{Session, SocketDir};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const DEADLINE: Duration = Duration::from_secs(30);
/// How long a whole test may take: the last resort for any wait without its own deadline.
pub const TEST_DEADLINE: Duration = Duration::from_secs(300);

/// Runs an async test in a fresh actix system under [`TEST_DEADLINE`]: an await that never
/// ends (a remote call to a child that hangs) fails the test instead of hanging it; the
/// test's child guards drop with the future, killing and reaping the children.
pub fn run<F: Future<Output = ()>>(test: F) {
    System::new().block_on(async move {
        if tokio::time::timeout(TEST_DEADLINE, test).await.is_err() {
            panic!("the test did not finish within {TEST_DEADLINE:?}");
        }
    });
}

/// Logs to standard error as `RUST_LOG` says, without colour codes, when it is set (a
/// GPU run's way to see what both sides of a test did: helpers log the same way).
pub fn log_as_rust_log_says() {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init();
    }
}

/// Polls `cond` until it holds; panics past `deadline`. Never a bare sleep.
pub async fn eventually(deadline: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Like [`eventually`], for conditions that need to await.
pub async fn eventually_async<F: Future<Output = bool>>(
    deadline: Duration,
    what: &str,
    mut cond: impl FnMut() -> F,
) {
    let start = Instant::now();
    while !cond().await {
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (without blocking the event loop) for a child to exit; kills it and panics past
/// `deadline`.
pub async fn exited(child: &mut peer::Peer, deadline: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait() {
            return status;
        }
        if start.elapsed() > deadline {
            child.kill9();
            panic!("child did not exit within {deadline:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Records every peer event.
#[derive(Default, Clone)]
pub struct Events(pub Arc<Mutex<Vec<PeerEvent>>>);

impl Actor for EventLog {
    type Context = Context<Self>;
}

pub struct EventLog(pub Events);

impl Handler<PeerEvent> for EventLog {
    type Result = ();
    fn handle(&mut self, msg: PeerEvent, _: &mut Context<Self>) {
        self.0.0.lock().unwrap().push(msg);
    }
}

impl Events {
    pub fn all(&self) -> Vec<PeerEvent> {
        self.0.lock().unwrap().clone()
    }

    /// The `Up` peers so far, in order.
    pub fn ups(&self) -> Vec<Peer> {
        self.all()
            .into_iter()
            .filter_map(|e| match e {
                PeerEvent::Up(p) => Some(p),
                _ => None,
            })
            .collect()
    }

    /// The reason a link went down, once it has (`Some(None)`: a clean close).
    pub fn down_reason(&self, link: baton::actors::LinkId) -> Option<Option<String>> {
        self.all().into_iter().find_map(|e| match e {
            PeerEvent::Down {
                link: l, reason, ..
            } if l == link => Some(reason.map(|r| format!("{r:?}"))),
            _ => None,
        })
    }
}

/// A node listening in a private directory, with a buffer owner and an event log.
pub struct Parent {
    pub session: Session,
    pub ns: String,
    pub node: Node,
    pub owner: Addr<BufferOwner>,
    pub events: Events,
    pub listening: Listening,
    /// Extra environment for children (e.g. `BATON_BACKEND=cuda`).
    pub child_env: Vec<(String, String)>,
    _tmp: tempfile::TempDir,
}

/// When a test ends (passed or failed), the named segments of its processes that died
/// without unlinking them (SIGKILLed children) go: the suite leaves /dev/shm as it found it.
/// A live owner's segments are never touched; tests that count leaks do so before this.
impl Drop for Parent {
    fn drop(&mut self) {
        let _ = baton::ipc::host::sweep(&self.ns);
    }
}

impl Parent {
    /// Call inside an actix system. Host backend, named segments (the tests count them);
    /// children use it too.
    pub fn start(tag: &str) -> Parent {
        let ns = peer::namespace(tag);
        let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
        let mut parent = Self::start_with(&ns, backend);
        parent
            .child_env
            .push(("BATON_BACKEND".into(), "host".into()));
        parent
            .child_env
            .push((baton::ipc::host::HOST_ENV.into(), "named".into()));
        parent
    }

    /// Call inside an actix system, with any backend for the parent's node.
    pub fn start_with(ns: &str, backend: baton::ipc::SharedBackend) -> Parent {
        Self::start_configured(ns, backend, |c| c)
    }

    /// Call inside an actix system. A parent on CUDA device 0 exporting as `export`, whose
    /// children export the same way, with the GPU test lock, held while the test runs.
    pub fn start_cuda(
        tag: &str,
        export: baton::ipc::cuda::CudaExport,
    ) -> (
        Parent,
        Arc<baton::ipc::cuda::CudaBackend>,
        baton::ipc::cuda::testing::GpuTestLock,
    ) {
        Self::start_cuda_fenced(tag, export, baton::ipc::cuda::FenceKind::default())
    }

    /// As [`start_cuda`](Self::start_cuda), with `fence` fences on both sides (the children
    /// get `BATON_CUDA_FENCE`).
    pub fn start_cuda_fenced(
        tag: &str,
        export: baton::ipc::cuda::CudaExport,
        fence: baton::ipc::cuda::FenceKind,
    ) -> (
        Parent,
        Arc<baton::ipc::cuda::CudaBackend>,
        baton::ipc::cuda::testing::GpuTestLock,
    ) {
        let gpu = baton::ipc::cuda::testing::exclusive_gpu(Duration::from_secs(1800))
            .expect("the GPU test lock");
        let cuda = baton::ipc::cuda::CudaBackend::builder(0)
            .export(export)
            .fence(fence)
            .build()
            .expect("a CUDA device");
        assert_eq!(
            cuda.fence_kind(),
            fence,
            "this GPU cannot use {fence:?} fences"
        );
        let cuda = Arc::new(cuda);
        let mut parent = Parent::start_with(&peer::namespace(tag), cuda.clone());
        parent
            .child_env
            .push((baton::ipc::cuda::FENCE_ENV.into(), fence.name().into()));
        parent
            .child_env
            .push(("BATON_BACKEND".into(), "cuda".into()));
        parent
            .child_env
            .push(("BATON_CUDA_EXPORT".into(), export.name().into()));
        (parent, cuda, gpu)
    }

    /// Call inside an actix system, with any backend and a node configuration of its own
    /// (`configure` gets the default one; children use host memory).
    pub fn start_configured(
        ns: &str,
        backend: baton::ipc::SharedBackend,
        configure: impl FnOnce(NodeConfig) -> NodeConfig,
    ) -> Parent {
        let ns = ns.to_owned();
        let session = Session::generate().unwrap();
        let node = Node::with_config(configure(NodeConfig::new(session.clone())), backend);
        let events = Events::default();
        node.subscribe(EventLog(events.clone()).start().recipient());
        let (tmp, dir): (tempfile::TempDir, SocketDir) = peer::socket_dir();
        let listening = node.listen(&dir, "parent.sock").unwrap();
        let owner = BufferOwner::new(&node).start();
        Parent {
            session,
            ns,
            node,
            owner,
            events,
            listening,
            child_env: Vec::new(),
            _tmp: tmp,
        }
    }

    /// Call inside an actix system. Host memory (children too), and a heartbeat fast
    /// enough for tests: a ping every 50 ms, a peer silent for 500 ms is cut.
    pub fn start_beating(tag: &str) -> Parent {
        let ns = peer::namespace(tag);
        let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
        let mut parent = Parent::start_configured(&ns, backend, |c| {
            c.heartbeat(baton::actors::Heartbeat {
                interval: Duration::from_millis(50),
                deadline: Duration::from_millis(500),
            })
        });
        parent
            .child_env
            .push(("BATON_BACKEND".into(), "host".into()));
        parent
    }

    /// A raw link of this process connected to the parent (a peer driven frame by frame
    /// from blocking tasks: `baton::ipc::Link`), connected and authenticated, with the
    /// node's side of it.
    pub async fn raw_link(&self) -> (baton::ipc::Link, Peer) {
        let before = self.events.ups().len();
        let (path, config) = (
            self.listening.path().to_owned(),
            baton::ipc::LinkConfig::new(self.session.clone()),
        );
        let raw = tokio::task::spawn_blocking(move || baton::ipc::Link::connect(path, &config))
            .await
            .unwrap()
            .unwrap();
        eventually(DEADLINE, "the raw link", || {
            self.events.ups().len() > before
        })
        .await;
        let link = self.events.ups()[before].clone();
        (raw, link)
    }

    pub fn socket(&self) -> String {
        self.listening.path().to_str().unwrap().to_owned()
    }

    /// Spawns the actor helper process, connected back to us; waits for its link.
    pub async fn child(&self, extra: &[&str]) -> (peer::Peer, Peer) {
        let sock = self.socket();
        let mut args = vec!["serve", sock.as_str()];
        args.extend_from_slice(extra);
        self.spawn_linked(peer::exe("baton-actor-peer"), &args, false)
            .await
    }

    /// Spawns `exe args…` with our session, namespace and `child_env` (stdout piped when
    /// `piped`), and waits for its link to come up.
    pub async fn spawn_linked(&self, exe: &str, args: &[&str], piped: bool) -> (peer::Peer, Peer) {
        let before = self.events.ups().len();
        let env: Vec<(&str, &str)> = self
            .child_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let child = peer::Peer::spawn_with(exe, &self.session, &self.ns, args, &env, piped);
        let pid = child.pid();
        let find = || {
            self.events
                .ups()
                .into_iter()
                .skip(before)
                .find(|p| p.process().pid == pid)
        };
        eventually(DEADLINE, "the child's link", || find().is_some()).await;
        let link = find().expect("just seen");
        (child, link)
    }

    /// A buffer of `len` pattern values (see `msgs::pattern`) from our owner.
    pub async fn pattern_buffer(&self, len: usize, seed: u32) -> baton::actors::Buffer<u32> {
        let buf = self
            .owner
            .send(baton::actors::Allocate::<u32>::vector(len as u64))
            .await
            .unwrap()
            .unwrap();
        let data: Vec<u32> = (0..len).map(|i| super::msgs::pattern(seed, i)).collect();
        buf.write_at(0, &data).unwrap();
        buf
    }

    pub async fn table(&self) -> Vec<baton::actors::BufferLeases> {
        self.owner.send(baton::actors::LeaseTable).await.unwrap()
    }

    pub async fn stats(&self) -> baton::actors::OwnerStats {
        self.owner.send(baton::actors::Stats).await.unwrap()
    }

    pub fn segments(&self) -> usize {
        peer::segments(&self.ns)
    }
}

/// Host memory whose allocations declare CUDA legacy IPC's rule — a free while another
/// process maps the memory is unsafe — so that the ledger's quarantine runs, and is tested,
/// without a GPU. Everything else is the host backend's.
#[derive(Debug)]
pub struct LegacyLike(pub HostBackend);

impl Backend for LegacyLike {
    fn name(&self) -> &'static str {
        "host (legacy-like free rule)"
    }
    fn kind(&self) -> baton::messages::BackendKind {
        self.0.kind()
    }
    fn device(&self) -> baton::messages::DeviceUuid {
        self.0.device()
    }
    fn allocate(&self, size: usize) -> baton::ipc::Result<baton::ipc::Allocation> {
        Ok(self
            .0
            .allocate(size)?
            .declare_free_while_mapped(FreeWhileMapped::Unsafe))
    }
    fn open(
        &self,
        handle: baton::ipc::CheckedHandle<'_>,
        fd: Option<std::os::fd::OwnedFd>,
    ) -> baton::ipc::Result<baton::ipc::OpenedMem> {
        self.0.open(handle, fd)
    }
}

/// Reads lines from a child's stdout on a thread; `next_line` waits with a deadline.
pub struct Lines(std::sync::mpsc::Receiver<String>);

impl Lines {
    pub fn of(stdout: std::process::ChildStdout) -> Lines {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Lines(rx)
    }

    /// The next line; panics after `deadline`.
    pub async fn next_line(&self, deadline: Duration) -> String {
        let start = Instant::now();
        loop {
            match self.0.try_recv() {
                Ok(line) => return line,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    panic!("the child's stdout closed")
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
            }
            assert!(
                start.elapsed() < deadline,
                "no line from the child within {deadline:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
