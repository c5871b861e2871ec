//! A [`Node`]'s child processes: [`Node::spawn_child`] starts one already linked to it,
//! [`Node::join`] is the child's side (see [`child`](crate::child) for the steps).

use super::Node;
use crate::child::{
    CHILD_LINK_DEADLINE, LinkedChild, LinkedChildGuard, PARENT_SOCKET_ENV, inherit_backend,
};
use crate::error::ActorError;
use crate::node_core::Peer;
use baton_ipc::{Session, SocketDir};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
        inherit_backend(&self.core, &mut cmd);
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
                        return Ok(child.into_linked(peer));
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
