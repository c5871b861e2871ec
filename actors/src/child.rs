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
//!
//! The methods are `Node`'s, in `node/child.rs`; this module, below the node tree, has the
//! child's handle ([`LinkedChild`]) and what the process supervisors share with
//! `spawn_child` (`inherit_backend`, which takes the node's state, a `NodeCore`).
//!
//! [`Node::spawn_child`]: crate::Node::spawn_child
//! [`Node::join`]: crate::Node::join
//! [`SocketDir::default_dir`]: baton_ipc::SocketDir::default_dir
//! [`Session::pass_to`]: baton_ipc::Session::pass_to

use crate::error::ActorError;
use crate::node_core::{NodeCore, Peer};
use baton_messages::BackendKind;
use std::fmt;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// The environment variable in which [`Node::spawn_child`] names the socket its child
/// links to ([`Node::join`] reads it).
///
/// [`Node::spawn_child`]: crate::Node::spawn_child
/// [`Node::join`]: crate::Node::join
pub const PARENT_SOCKET_ENV: &str = "BATON_PARENT_SOCKET";

/// How long [`Node::spawn_child`] waits for its child to link.
///
/// [`Node::spawn_child`]: crate::Node::spawn_child
pub const CHILD_LINK_DEADLINE: Duration = Duration::from_secs(30);

/// A child process started with [`Node::spawn_child`], linked to this node.
///
/// Dropping it without [`wait`](Self::wait) kills the child (SIGKILL) and reaps it on a
/// background thread: a linked child is part of its parent's deployment. To let it run on,
/// take the process out with [`into_child`](Self::into_child).
///
/// [`Node::spawn_child`]: crate::Node::spawn_child
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
///
/// [`Node::spawn_child`]: crate::Node::spawn_child
pub(crate) fn inherit_backend(node: &NodeCore, cmd: &mut Command) {
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

/// Kills and reaps the child if `spawn_child` fails after spawning it.
pub(crate) struct LinkedChildGuard(pub(crate) Option<Child>);

impl LinkedChildGuard {
    /// The child, linked as `peer`: no longer this guard's to kill.
    pub(crate) fn into_linked(mut self, peer: Peer) -> LinkedChild {
        LinkedChild {
            child: self.0.take(),
            peer,
        }
    }
}

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
