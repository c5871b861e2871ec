//! One-call child wiring: [`Node::spawn_child`] starts a process already linked to this
//! node, [`Node::join`] is the child's side.
//!
//! What `spawn_child` does, in order — the same steps a program would otherwise write by
//! hand (and the [`ProcessSupervisor`](crate::ProcessSupervisor) does for its children):
//!
//! 1. listens on a fresh socket in the private [`SocketDir::default_dir`] (mode 0700);
//! 2. names it in the child's environment ([`PARENT_SOCKET_ENV`]), and names the node's
//!    backend there too (`BATON_BACKEND`, and `BATON_CUDA_DEVICE`/`BATON_CUDA_EXPORT` for
//!    CUDA) unless the command sets them itself, so the child allocates where the parent
//!    does;
//! 3. passes the session token through an inherited pipe ([`Session::pass_to`]), never
//!    through the environment, and ties the child's life to this process (it receives
//!    SIGKILL when this process dies: [`spawn_tied`](baton_ipc::spawn::spawn_tied));
//! 4. waits — without blocking the thread — for the child to link, and checks that the peer
//!    that linked is that child (pid, proven in the handshake); then stops listening.
//!
//! The child calls [`Node::join`] at the top of its `main` (inside an actix system).

use crate::error::ActorError;
use crate::node::{Node, Peer};
use baton_ipc::{Session, SocketDir};
use baton_messages::BackendKind;
use std::fmt;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The environment variable in which [`Node::spawn_child`] names the socket its child
/// links to ([`Node::join`] reads it).
pub const PARENT_SOCKET_ENV: &str = "BATON_PARENT_SOCKET";

/// How long [`Node::spawn_child`] waits for its child to link.
pub const CHILD_LINK_DEADLINE: Duration = Duration::from_secs(30);

/// A child process started with [`Node::spawn_child`], linked to this node.
///
/// Dropping it without [`wait`](Self::wait) kills the child (SIGKILL) and reaps it on a
/// background thread: a linked child is part of its parent's deployment. To let it run on,
/// take the process out with [`into_child`](Self::into_child).
pub struct LinkedChild {
    /// `Some` until `wait`, `into_child` or drop.
    child: Option<Child>,
    peer: Peer,
}

impl fmt::Debug for LinkedChild {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkedChild")
            .field("pid", &self.child.as_ref().map(Child::id))
            .field("peer", &self.peer)
            .finish()
    }
}

impl LinkedChild {
    /// The link to the child.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.peer.process().pid
    }

    /// Waits for the child to exit, without blocking the calling thread (the wait runs
    /// on a thread of its own), and returns how it exited. The child usually exits when
    /// its link to us ends: [`Peer::close_and_wait`] first, then this.
    ///
    /// Never call `std::process::Child::wait` (or anything else that blocks) on the
    /// thread of the node's actix system instead: the link actors run there, so a close
    /// requested before would never reach the child, which then never exits.
    ///
    /// # Errors
    /// [`ActorError::Spawn`] if waiting fails.
    pub fn wait(mut self) -> impl Future<Output = Result<ExitStatus, ActorError>> + 'static {
        let child = self.child.take();
        let pid = self.pid();
        let (tx, rx) = tokio::sync::oneshot::channel();
        if let Some(mut child) = child {
            let spawned = std::thread::Builder::new()
                .name("baton-child-wait".into())
                .spawn(move || {
                    let _ = tx.send(child.wait());
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, pid, "no thread to wait for the child on");
            }
        }
        let wait_err = move |source| ActorError::Spawn {
            name: format!("pid {pid} (waiting for it)"),
            source,
        };
        async move {
            match rx.await {
                Ok(status) => status.map_err(wait_err),
                Err(_) => Err(wait_err(std::io::Error::other("the waiting thread failed"))),
            }
        }
    }

    /// Sends SIGKILL to the child (it is still reaped by [`wait`](Self::wait) or drop).
    ///
    /// # Errors
    /// [`ActorError::Spawn`] if the signal cannot be sent.
    pub fn kill(&mut self) -> Result<(), ActorError> {
        match &mut self.child {
            Some(child) => child.kill().map_err(|source| ActorError::Spawn {
                name: format!("pid {} (killing it)", child.id()),
                source,
            }),
            None => Ok(()),
        }
    }

    /// The process, to manage yourself (it is no longer killed when this handle drops;
    /// it still receives SIGKILL when this process dies).
    pub fn into_child(mut self) -> Child {
        self.child
            .take()
            .expect("present until wait, into_child or drop")
    }
}

impl Drop for LinkedChild {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            // Reaped off the caller's thread: Drop never blocks.
            let _ = std::thread::Builder::new()
                .name("baton-child-reap".into())
                .spawn(move || child.wait());
        }
    }
}

/// Names `node`'s backend in `cmd`'s environment so that the child allocates where the
/// parent does: `BATON_BACKEND`, and for CUDA `BATON_CUDA_EXPORT` and `BATON_CUDA_DEVICE`,
/// each unless `cmd` sets it already (nothing at all if it sets `BATON_BACKEND`).
/// [`Node::spawn_child`], the [`ProcessSupervisor`](crate::ProcessSupervisor) and the
/// [`ChildAgent`](crate::supervisor::agent::ChildAgent) all start children through it.
pub(crate) fn inherit_backend(node: &Node, cmd: &mut Command) {
    let set = |cmd: &Command, var: &str| cmd.get_envs().any(|(k, _)| k == var);
    if set(cmd, baton_ipc::select::BACKEND_ENV) {
        return;
    }
    let backend = node.backend();
    match backend.kind() {
        BackendKind::Host => {
            cmd.env(baton_ipc::select::BACKEND_ENV, "host");
        }
        kind => {
            cmd.env(baton_ipc::select::BACKEND_ENV, "cuda");
            let mode = match kind {
                BackendKind::CudaVmm => "vmm",
                BackendKind::CudaPool => "pool",
                _ => "legacy",
            };
            if !set(cmd, baton_ipc::cuda::EXPORT_ENV) {
                cmd.env(baton_ipc::cuda::EXPORT_ENV, mode);
            }
            if let Some(cuda) = backend.cuda() {
                if !set(cmd, baton_ipc::cuda::DEVICE_ENV) {
                    cmd.env(baton_ipc::cuda::DEVICE_ENV, cuda.ordinal().to_string());
                }
            }
        }
    }
}

impl Node {
    /// Starts `cmd` as a child process linked to this node, and returns once it has
    /// linked (see the [module docs](crate::child) for the steps). The child calls
    /// [`Node::join`]. Must be called inside an actix system.
    ///
    /// The token travels the safe way (an inherited pipe the child reads and closes); the
    /// child gets this node's backend unless `cmd` sets `BATON_BACKEND`; it is SIGKILLed
    /// when this process dies. The process started must be the one that links (its pid is
    /// checked): start the Baton program itself, not a shell or launcher that runs it.
    ///
    /// # Errors
    /// [`ActorError::Spawn`] if it cannot start; [`ActorError::ChildExited`] if it exits
    /// before linking; [`ActorError::Timeout`] if it does not link within
    /// [`CHILD_LINK_DEADLINE`] (it is killed); a socket error.
    pub async fn spawn_child(&self, mut cmd: Command) -> Result<LinkedChild, ActorError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "child-{}-{}.sock",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let program = cmd.get_program().to_string_lossy().into_owned();
        let spawn_err = |source| ActorError::Spawn {
            name: program.clone(),
            source,
        };
        let dir = SocketDir::default_dir()?;
        let mut listening = self.listen(&dir, &name)?;
        cmd.env(PARENT_SOCKET_ENV, listening.path());
        inherit_backend(self, &mut cmd);
        self.session().pass_to(&mut cmd)?;
        let child = baton_ipc::spawn::spawn_tied(cmd).map_err(spawn_err)?;
        let pid = child.id();
        let mut child = LinkedChildGuard(Some(child));
        let deadline = tokio::time::Instant::now() + CHILD_LINK_DEADLINE;
        loop {
            // Short waits, so that a child that dies before it links (a bad command line,
            // a panic) is noticed: no peer would come then.
            match tokio::time::timeout(Duration::from_millis(20), listening.accept()).await {
                Ok(accepted) => {
                    let peer = accepted?;
                    if peer.process().pid == pid {
                        tracing::debug!(pid, "child linked");
                        return Ok(LinkedChild {
                            child: child.0.take(),
                            peer,
                        });
                    }
                    // Another process of this uid holding the token found the socket: not
                    // ours to hand out as the child.
                    tracing::warn!(
                        pid,
                        other = peer.process().pid,
                        "a process other than the child linked to its socket: closed"
                    );
                    peer.close();
                }
                Err(_) => {
                    let exited = match child.0.as_mut() {
                        Some(c) => c.try_wait().map_err(spawn_err)?,
                        None => None,
                    };
                    if let Some(status) = exited {
                        child.0 = None;
                        return Err(ActorError::ChildExited { pid, status });
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return Err(ActorError::Timeout {
                            op: "waiting for the child to link",
                            after: CHILD_LINK_DEADLINE,
                        });
                    }
                }
            }
        }
    }

    /// Whether this process was started by [`spawn_child`](Self::spawn_child) (its
    /// [`PARENT_SOCKET_ENV`] is set): what a program that spawns itself checks first,
    /// before it [`join`](Self::join)s.
    pub fn is_child() -> bool {
        std::env::var_os(PARENT_SOCKET_ENV).is_some()
    }

    /// A child's entry point: the node of a process started by
    /// [`spawn_child`](Self::spawn_child) ([`Node::from_env`]: the session from the
    /// inherited token pipe, the parent's backend) and its link to the parent. Must be
    /// called inside an actix system.
    ///
    /// Register the child's actors right after, before the next `.await`: the parent may
    /// call them as soon as its `spawn_child` returns, but the link's frames are handled
    /// on this thread, so none is handled before this task yields. Then, usually,
    /// `parent.closed().await` and return.
    ///
    /// # Errors
    /// [`ActorError::NoParent`] outside a child of `spawn_child`; as [`Node::from_env`];
    /// a connection or handshake error.
    pub async fn join() -> Result<(Node, Peer), ActorError> {
        let socket = std::env::var_os(PARENT_SOCKET_ENV).ok_or(ActorError::NoParent {
            var: PARENT_SOCKET_ENV,
        })?;
        // The variable stays in the environment (removing it is `unsafe` in edition 2024:
        // other threads may read the environment); `spawn_child` overwrites it for every
        // grandchild it starts.
        let node = Node::from_env()?;
        let parent = node.connect(&socket).await?;
        Ok((node, parent))
    }

    /// A root node: a fresh session ([`Session::generate`]) and the backend
    /// [`baton_ipc::select::auto`] picks (CUDA when a GPU is usable, else host;
    /// `BATON_BACKEND` forces one). Its children ([`spawn_child`](Self::spawn_child)) share
    /// both.
    ///
    /// # Errors
    /// The kernel's random source fails; a backend error.
    pub fn root() -> Result<Node, ActorError> {
        Ok(Node::new(Session::generate()?, baton_ipc::select::auto()?))
    }
}

/// Kills and reaps the child if `spawn_child` fails after spawning it.
struct LinkedChildGuard(Option<Child>);

impl Drop for LinkedChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = std::thread::Builder::new()
                .name("baton-child-reap".into())
                .spawn(move || child.wait());
        }
    }
}
