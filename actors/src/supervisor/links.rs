//! The supervisor's side of children that join it ([`ProcessSupervisor::link_children`]):
//! the socket they link to, which link is which child's, and the callers waiting for a
//! child to link or to run ([`ChildPeer`], [`ChildRunning`]).
//!
//! A link is matched to a child by the process it proved in the handshake (pid and start
//! time, [`ProcessId`]) against the processes the supervisor spawned — never by anything
//! the child wrote. A link from any other process is closed.

use super::{ChildStatus, ProcessSupervisor, SupervisorEvent};
use crate::child::PARENT_SOCKET_ENV;
use crate::connect::Listening;
use crate::error::ActorError;
use crate::node_core::Peer;
use actix::prelude::*;
use baton_ipc::SocketDir;
use baton_messages::ProcessId;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;

/// Where the children link to, and who linked.
pub(super) struct ChildLinks {
    /// Until the supervisor starts, which then accepts on it.
    listening: Option<Listening>,
    /// The socket, named to each child in [`PARENT_SOCKET_ENV`].
    path: PathBuf,
    /// The link of each child's current run, once it linked.
    linked: HashMap<String, Peer>,
}

/// A caller waiting for a child's link.
struct PeerWaiter {
    /// The run whose link does not count (one that died), if any.
    replacing: Option<ProcessId>,
    reply: oneshot::Sender<Peer>,
}

/// Callers waiting for a child, by its name.
#[derive(Default)]
pub(super) struct Waiting {
    peer: HashMap<String, Vec<PeerWaiter>>,
    running: HashMap<String, Vec<oneshot::Sender<ChildStatus>>>,
}

impl ProcessSupervisor {
    /// Lets the children join this supervisor in one call, as children of
    /// [`Node::spawn_child`](crate::Node::spawn_child) do: the supervisor listens on a
    /// fresh socket in the private [`SocketDir::default_dir`] (mode 0700), names it to every
    /// child it spawns in [`PARENT_SOCKET_ENV`], and each child calls
    /// [`Node::join`](crate::Node::join) (one call: the session from the token pipe, the
    /// node's backend, the link).
    ///
    /// Each link is matched to its child by the process it proved in the handshake (pid
    /// and start time), never by anything the child sent; a link from a process that is not
    /// a current child is closed (with a warning) — so the program a spec starts must be the
    /// one that joins, not a shell or launcher that forks it (`exec` keeps the process, and
    /// is fine). Subscribers get
    /// [`SupervisorEvent::Linked`]; [`ChildPeer`] waits for a child's link, also after a
    /// restart (a restarted child's link replaces the old one). Must be called inside an
    /// actix system. [`connect_back`](Self::connect_back) still works beside it.
    ///
    /// # Errors
    /// The socket directory cannot be made, or the socket bound.
    pub fn link_children(mut self) -> Result<Self, ActorError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "supervisor-{}-{}.sock",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let dir = SocketDir::default_dir()?;
        let listening = self.node.listen(&dir, &name)?;
        self.links = Some(ChildLinks {
            path: listening.path().to_owned(),
            listening: Some(listening),
            linked: HashMap::new(),
        });
        Ok(self)
    }

    /// The environment naming the children's socket, under `link_children`.
    pub(super) fn link_env(&self) -> Option<(&'static str, std::ffi::OsString)> {
        self.links
            .as_ref()
            .map(|l| (PARENT_SOCKET_ENV, l.path.clone().into_os_string()))
    }

    /// Starts accepting the children's links (under `link_children`).
    pub(super) fn accept_links(&mut self, ctx: &mut Context<Self>) {
        let Some(listening) = self.links.as_mut().and_then(|l| l.listening.take()) else {
            return;
        };
        // Dropped with the supervisor: the socket goes when it stops.
        ctx.add_stream(futures_util::stream::unfold(
            listening,
            |mut listening| async move {
                match listening.accept().await {
                    Ok(peer) => Some((peer, listening)),
                    Err(e) => {
                        tracing::debug!(error = %e, "the supervisor's socket stopped accepting");
                        None
                    }
                }
            },
        ));
    }

    /// A child's run ended: its link is no longer the child's.
    pub(super) fn unlink(&mut self, name: &str) {
        if let Some(links) = &mut self.links {
            links.linked.remove(name);
        }
    }

    /// Tells whoever waits for `name` to run.
    pub(super) fn started_waiters(&mut self, name: &str) {
        let Some(waiting) = self.waiting.running.remove(name) else {
            return;
        };
        let Some(status) = self.status_of(name) else {
            return;
        };
        for waiter in waiting {
            let _ = waiter.send(status.clone());
        }
    }

    /// `name` ended for good: nobody need wait for it any longer.
    pub(super) fn forget_waiters(&mut self, name: &str) {
        self.waiting.peer.remove(name);
        self.waiting.running.remove(name);
    }

    /// `name`'s state, if it is one of the children.
    fn status_of(&self, name: &str) -> Option<ChildStatus> {
        if self.specs.iter().any(|s| s.name == name) {
            Some(ChildStatus {
                name: name.to_owned(),
                pid: self.running.get(name).map(|r| r.pid),
                process: self.running.get(name).map(|r| r.process),
                restarts: self.restarts.get(name).copied().unwrap_or(0),
            })
        } else {
            self.remote_statuses().find(|s| s.name == name)
        }
    }

    /// Why no caller should wait for `name`, if so.
    fn cannot_wait(&self, name: &str) -> Option<ActorError> {
        let no = |reason| {
            Some(ActorError::NoSuchChild {
                name: name.to_owned(),
                reason,
            })
        };
        if self.status_of(name).is_none() {
            no("the supervisor has no child of that name")
        } else if self.stopping {
            no("the supervisor is stopping")
        } else if self.done.contains(name) {
            no("it ended and is not restarted")
        } else {
            None
        }
    }
}

impl StreamHandler<Peer> for ProcessSupervisor {
    /// A process linked to the children's socket: the current child whose process it
    /// proved to be, or closed.
    fn handle(&mut self, peer: Peer, _ctx: &mut Context<Self>) {
        let _g = self.span.clone().entered();
        let process = peer.process();
        let child = self
            .running
            .iter()
            .find(|(_, r)| r.process == process)
            .map(|(name, _)| name.clone());
        let (Some(name), Some(links)) = (child, self.links.as_mut()) else {
            tracing::warn!(pid = process.pid, %process, "a process that is not a current child linked to the supervisor's socket: closed");
            peer.close();
            return;
        };
        tracing::info!(child = %name, pid = process.pid, "child linked");
        links.linked.insert(name.clone(), peer.clone());
        if let Some(waiting) = self.waiting.peer.remove(&name) {
            let (answered, still): (Vec<_>, Vec<_>) = waiting
                .into_iter()
                .partition(|w| w.replacing != Some(process));
            for waiter in answered {
                let _ = waiter.reply.send(peer.clone());
            }
            if !still.is_empty() {
                self.waiting.peer.insert(name.clone(), still);
            }
        }
        self.emit(SupervisorEvent::Linked {
            name,
            process,
            peer: Box::new(peer),
        });
    }

    /// The accept loop ended (its actix system stops): the supervisor goes on.
    fn finished(&mut self, _ctx: &mut Context<Self>) {}
}

/// Replies with the live link of the child `name`'s current run once it has linked (under
/// [`ProcessSupervisor::link_children`]): at once if it has, else when it does, waiting at
/// most `within`. Right after the supervisor starts, or after a restart, this is how a
/// caller gets the new run's link; with [`replacing`](Self::replacing) the run that died is
/// never the answer, even before the supervisor has seen it die.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<Peer, ActorError>")]
pub struct ChildPeer {
    /// The child's name.
    pub name: String,
    /// How long to wait for it to link.
    pub within: Duration,
    /// A run whose link is not wanted (one that was killed): wait for another's.
    pub replacing: Option<ProcessId>,
}

impl ChildPeer {
    /// The link of `name`, waiting at most `within`.
    pub fn new(name: impl Into<String>, within: Duration) -> Self {
        Self {
            name: name.into(),
            within,
            replacing: None,
        }
    }

    /// Waits for the link of a run other than `process` (the one that died: its
    /// [`Peer::process`]).
    pub fn replacing(mut self, process: ProcessId) -> Self {
        self.replacing = Some(process);
        self
    }
}

impl Handler<ChildPeer> for ProcessSupervisor {
    type Result = ResponseFuture<Result<Peer, ActorError>>;

    /// # Errors
    /// [`ActorError::NoSuchChild`] if the supervisor does not link its children, has no
    /// local child of that name, or that child ended for good; [`ActorError::Timeout`] if it did
    /// not link within `within`.
    fn handle(&mut self, msg: ChildPeer, _ctx: &mut Context<Self>) -> Self::Result {
        let ChildPeer {
            name,
            within,
            replacing,
        } = msg;
        let Some(links) = &self.links else {
            return Box::pin(std::future::ready(Err(ActorError::NoSuchChild {
                name,
                reason: "the supervisor does not link its children (ProcessSupervisor::link_children)",
            })));
        };
        if self.remote.specs.iter().any(|s| s.name == name) {
            return Box::pin(std::future::ready(Err(ActorError::NoSuchChild {
                name,
                reason: "a child on another host links back over TCP (connect_back_tcp), not to this socket",
            })));
        }
        let current = self.running.get(&name).map(|r| r.process);
        if let Some(peer) = links.linked.get(&name)
            && Some(peer.process()) == current
            && Some(peer.process()) != replacing
            && peer.is_connected()
        {
            return Box::pin(std::future::ready(Ok(peer.clone())));
        }
        if let Some(error) = self.cannot_wait(&name) {
            return Box::pin(std::future::ready(Err(error)));
        }
        let (tx, rx) = oneshot::channel();
        let name_of_waited = name.clone();
        let waiting = self.waiting.peer.entry(name).or_default();
        waiting.retain(|w| !w.reply.is_closed());
        waiting.push(PeerWaiter {
            replacing,
            reply: tx,
        });
        Box::pin(wait_for(
            rx,
            within,
            "waiting for a supervised child to link",
            name_of_waited,
        ))
    }
}

/// Replies with the state of the child `name` (local or on another host) once it runs:
/// at once if it does, else when it starts, waiting at most `within`. For a child on
/// another host this is how to await its agent's readiness: the start succeeds once the
/// agent is reachable.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<ChildStatus, ActorError>")]
pub struct ChildRunning {
    /// The child's name.
    pub name: String,
    /// How long to wait for it to run.
    pub within: Duration,
}

impl ChildRunning {
    /// The state of `name` once it runs, waiting at most `within`.
    pub fn new(name: impl Into<String>, within: Duration) -> Self {
        Self {
            name: name.into(),
            within,
        }
    }
}

impl Handler<ChildRunning> for ProcessSupervisor {
    type Result = ResponseFuture<Result<ChildStatus, ActorError>>;

    /// # Errors
    /// [`ActorError::NoSuchChild`] if the supervisor has no child of that name, or it
    /// ended for good; [`ActorError::Timeout`] if it did not run within `within`.
    fn handle(&mut self, msg: ChildRunning, _ctx: &mut Context<Self>) -> Self::Result {
        let ChildRunning { name, within } = msg;
        if let Some(status) = self.status_of(&name)
            && status.pid.is_some()
        {
            return Box::pin(std::future::ready(Ok(status)));
        }
        if let Some(error) = self.cannot_wait(&name) {
            return Box::pin(std::future::ready(Err(error)));
        }
        let (tx, rx) = oneshot::channel();
        let name_of_waited = name.clone();
        let waiting = self.waiting.running.entry(name).or_default();
        waiting.retain(|w| !w.is_closed());
        waiting.push(tx);
        Box::pin(wait_for(
            rx,
            within,
            "waiting for a supervised child to run",
            name_of_waited,
        ))
    }
}

/// What `rx` brings within `within`.
async fn wait_for<T>(
    rx: oneshot::Receiver<T>,
    within: Duration,
    op: &'static str,
    name: String,
) -> Result<T, ActorError> {
    match tokio::time::timeout(within, rx).await {
        Ok(Ok(found)) => Ok(found),
        // The waiter was dropped: the child ended for good, or the supervisor stopped.
        Ok(Err(_)) => Err(ActorError::NoSuchChild {
            name,
            reason: "it ended and is not restarted, or the supervisor stopped",
        }),
        Err(_) => Err(ActorError::Timeout { op, after: within }),
    }
}
