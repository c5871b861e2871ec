//! [`ChildAgent`]: the actor that starts children on its host for process supervisors on
//! other hosts, and the messages between them over a host link.
//!
//! - **What it may run is its owner's choice, never the peer's.** The agent is built with
//!   a table of [`ChildSpec`]s by name ([`ChildAgent::allow`]); a supervisor names a spec
//!   ([`SpawnRemote::spec`]), never a program, an argument or an environment variable. A
//!   name not in the table is refused ([`AgentRefusal::UnknownSpec`]) and the link is
//!   unharmed.
//! - **Children are spawned as a [`ProcessSupervisor`](super::ProcessSupervisor) spawns
//!   them** (`spawn_tied`: they die with the agent's process; the session token through an
//!   inherited pipe; their name in [`CHILD_NAME_ENV`](super::CHILD_NAME_ENV); the agent
//!   node's backend unless the spec names one), plus the
//!   supervisor's host-link address in [`CONNECT_TCP_ENV`] when it gave one, so that a
//!   child can link back to it (`node.connect_tcp(addr)`).
//! - **Exits go back** to the supervisor that asked, over its link ([`RemoteExit`]).
//! - **A child does not outlive its supervisor's link.** When the last link to a
//!   supervisor's process goes down — the supervisor exited or was killed (end of stream),
//!   or the heartbeat cut a silent partition — the agent SIGKILLs every child it started
//!   for that supervisor and reaps it. There is no grace period: the supervisor counts
//!   those children lost the moment it sees the same link down, and starts new ones
//!   when it reaches the agent again, so a child kept for a reconnect would run twice.
//! - **Rights follow the proven identity, not the claimed process** (issue 45, finding 3).
//!   A caller is what its link proved: over a host link its authenticated static key
//!   ([`HostPeer::key`](baton_ipc::tcp::HostPeer::key)) — whatever process id it announced,
//!   since one key may announce as many as it likes — and over a Unix link its process,
//!   as the kernel's credentials proved it. Only a caller of the same identity as the one
//!   that started a child may kill it ([`KillRemote`]; anyone else hears
//!   [`AgentRefusal::NoSuchChild`], which tells nothing of other callers' children).
//! - **Bounded per identity and in all**: at most [`AgentLimits::children_per_caller`]
//!   children per caller identity (so minting process ids gains a key nothing), and at
//!   most [`AgentLimits::children_total`] in all; names and addresses are checked before
//!   anything is spawned.

use super::{ChildSpec, describe, spawn_process, sweep_dead_child};
use crate::buffer::IncomingLeases;
use crate::error::ActorError;
use crate::node::Node;
use crate::node_core::PeerEvent;
use crate::remote::{Answer, ErasedHandler, RemoteMessage, answer};
use actix::prelude::*;
use baton_ipc::PeerInfo;
use baton_ipc::tcp::NodePublicKey;
use baton_messages::ProcessId;
use baton_messages::protocol::CallFault;
use baton_messages::status::ChildEntry;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::process::ExitStatus;
use std::sync::Arc;

/// The name a [`ChildAgent`] is registered under on its node.
pub const AGENT_NAME: &str = "baton.child-agent";

/// The variable that tells a child started by a [`ChildAgent`] where its supervisor takes
/// host links (`ip:port`, for [`Node::connect_tcp`]); set only when the supervisor gave
/// one ([`ProcessSupervisor::connect_back_tcp`](super::ProcessSupervisor::connect_back_tcp)).
pub const CONNECT_TCP_ENV: &str = "BATON_CONNECT_TCP";

/// The longest child name or inbox name a [`SpawnRemote`] may carry.
pub const MAX_NAME_LEN: usize = 128;

/// Asks a [`ChildAgent`] to start the child of the spec it knows as `spec`.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[rtype(result = "Result<AgentChild, AgentRefusal>")]
pub struct SpawnRemote {
    /// The name of a spec in the agent's table.
    pub spec: String,
    /// The child's name for its supervisor (in the child's [`CHILD_NAME_ENV`](super::CHILD_NAME_ENV)).
    pub name: String,
    /// Where the supervisor takes host links, passed in [`CONNECT_TCP_ENV`].
    pub connect_tcp: Option<String>,
    /// The name the supervisor's exit inbox is registered under on its node: where
    /// [`RemoteExit`] goes.
    pub inbox: String,
}

/// Asks a [`ChildAgent`] to SIGKILL a child it started for the caller.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Message)]
#[rtype(result = "Result<(), AgentRefusal>")]
pub struct KillRemote {
    /// The child, as [`AgentChild::id`] named it.
    pub id: u64,
}

/// Sent by a [`ChildAgent`] to its supervisor's inbox when a child it started exited
/// (and was reaped).
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[rtype(result = "()")]
pub struct RemoteExit {
    /// The child, as [`AgentChild::id`] named it.
    pub id: u64,
    /// How it ended: `exit code N`, `killed by signal N`.
    pub status: String,
    /// Whether it exited with code 0.
    pub clean: bool,
}

crate::remote_message!(
    SpawnRemote = "baton.agent.SpawnRemote",
    KillRemote = "baton.agent.KillRemote",
    RemoteExit = "baton.agent.RemoteExit",
);

/// A child a [`ChildAgent`] started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentChild {
    /// The agent's name for it (never reused by that agent).
    pub id: u64,
    /// Its pid on the agent's host.
    pub pid: u32,
    /// The process (the agent host's boot id, pid, start time).
    pub process: ProcessId,
}

/// Why a [`ChildAgent`] refused a request; the link is unharmed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum AgentRefusal {
    /// The agent's owner configured no spec of that name.
    #[error("the agent knows no child spec {spec:?} (it knows {known:?}): name one of its own")]
    UnknownSpec {
        /// The name asked for.
        spec: String,
        /// The names it knows.
        known: Vec<String>,
    },
    /// The caller (its key over a host link, its process on the agent's host) already
    /// has as many children there as the agent allows.
    #[error(
        "the agent runs {limit} children for this caller's key already, its limit per caller: kill or wait for one first"
    )]
    TooManyChildren {
        /// The limit ([`AgentLimits::children_per_caller`]).
        limit: usize,
    },
    /// The agent runs as many children, for all callers together, as it allows.
    #[error(
        "the agent runs {limit} children in all already, its limit: try again when one has exited, or another agent"
    )]
    AgentFull {
        /// The limit ([`AgentLimits::children_total`]).
        limit: usize,
    },
    /// A name or address in the request is malformed.
    #[error("bad request: {reason}")]
    BadRequest {
        /// What is wrong.
        reason: String,
    },
    /// The program of the spec could not be started.
    #[error("could not start spec {spec:?}: {reason}")]
    SpawnFailed {
        /// The spec.
        spec: String,
        /// Why.
        reason: String,
    },
    /// No child of that id runs for the caller (its key, or its process on the agent's
    /// host): it never ran, it exited, or another caller started it.
    #[error("no child {id} runs for this caller: name one its own key started")]
    NoSuchChild {
        /// The id asked for.
        id: u64,
    },
    /// The caller's link went down while the request was handled.
    #[error("the supervisor's link is down")]
    NotLinked,
}

/// A [`ChildAgent`]'s bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AgentLimits {
    /// How many children one caller may have running through this agent (default 16): a
    /// caller is its authenticated key over a host link (all the processes it announces
    /// together), its process over a Unix link.
    pub children_per_caller: usize,
    /// How many children the agent runs in all, for every caller together (default 64).
    pub children_total: usize,
}

impl Default for AgentLimits {
    fn default() -> Self {
        Self {
            children_per_caller: 16,
            children_total: 64,
        }
    }
}

/// Who called the agent, as its link proved it (see the [module docs](self)): rights and
/// limits follow this, never the process id a host link's peer announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Caller {
    /// A peer over a host link: its authenticated static key.
    Key(NodePublicKey),
    /// A peer over a Unix link: its process, as the kernel's credentials proved it.
    Local(ProcessId),
}

impl Caller {
    fn of(info: &PeerInfo) -> Self {
        match info.host() {
            Some(host) => Caller::Key(host.key),
            None => Caller::Local(info.process),
        }
    }
}

/// A message of type `M` and the process that sent it over a link (as its handshake
/// proved, not as the message says).
pub(crate) struct FromPeer<M> {
    pub(crate) from: ProcessId,
    pub(crate) msg: M,
}

impl<M: Message> Message for FromPeer<M> {
    type Result = M::Result;
}

/// A registration that hands the actor the caller's process with each message.
pub(crate) struct ByCaller<M: RemoteMessage>
where
    M::Result: Send,
{
    pub(crate) recipient: Recipient<FromPeer<M>>,
}

impl<M> ErasedHandler for ByCaller<M>
where
    M: RemoteMessage,
    M::Result: Serialize + Send,
{
    fn type_name(&self) -> &str {
        M::NAME
    }

    fn invoke(
        &self,
        peer: ProcessId,
        payload: &[u8],
        leases: IncomingLeases,
    ) -> Result<Answer, CallFault> {
        answer(payload, leases, |msg: M| {
            self.recipient.send(FromPeer { from: peer, msg })
        })
    }
}

struct AgentRunning {
    /// The process it was started for (its exits go there; it dies with that process's
    /// last link).
    supervisor: ProcessId,
    /// Who started it: only the same identity may kill it, and it counts against that
    /// identity's limit.
    caller: Caller,
    name: String,
    inbox: String,
    pid: u32,
    process: ProcessId,
    pidfd: Arc<OwnedFd>,
}

fn sigkill(pidfd: &OwnedFd) {
    let _ = rustix::process::pidfd_send_signal(pidfd, rustix::process::Signal::KILL);
}

/// Starts children on this host for process supervisors on other hosts (see the
/// [module docs](self)). Build it with the specs it may run, then
/// [`serve`](Self::serve) it on the node whose host links the supervisors reach.
///
/// ```no_run
/// # use baton_actors::{Node, supervisor::{ChildSpec, agent::ChildAgent}};
/// # async fn run(node: Node) -> Result<(), baton_actors::ActorError> {
/// let _agent = ChildAgent::new(node.clone())
///     .allow("worker", ChildSpec::new("worker", "/usr/bin/my-worker").arg("--serve"))
///     .serve();
/// let _listening = node.listen_tcp("0.0.0.0:7701")?;
/// # Ok(()) }
/// ```
pub struct ChildAgent {
    node: Node,
    specs: HashMap<String, ChildSpec>,
    limits: AgentLimits,
    children: HashMap<u64, AgentRunning>,
    next_id: u64,
    /// The children it runs, as its node's status lists them.
    board: crate::observed::ChildBoard,
    span: tracing::Span,
}

impl std::fmt::Debug for ChildAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildAgent")
            .field("specs", &self.specs.keys().collect::<Vec<_>>())
            .field("limits", &self.limits)
            .field("children", &self.children.len())
            .finish()
    }
}

impl ChildAgent {
    /// An agent of `node` that runs nothing yet.
    pub fn new(node: Node) -> Self {
        Self {
            node,
            specs: HashMap::new(),
            limits: AgentLimits::default(),
            children: HashMap::new(),
            next_id: 0,
            board: Arc::default(),
            span: tracing::info_span!("child_agent"),
        }
    }

    /// Lets supervisors start `spec` by the name `name` (its `name` and `restart` are
    /// replaced by the supervisor's: a supervisor names its children and decides their
    /// restarts).
    pub fn allow(mut self, name: impl Into<String>, spec: ChildSpec) -> Self {
        self.specs.insert(name.into(), spec);
        self
    }

    /// With other bounds.
    pub fn limits(mut self, limits: AgentLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Puts the children it runs where its node's status reads them, each with the
    /// supervisor it runs for.
    fn publish(&self) {
        let mut entries: Vec<ChildEntry> = self
            .children
            .values()
            .map(|c| ChildEntry {
                name: c.name.clone(),
                state: "running".to_owned(),
                pid: Some(c.pid),
                start_ticks: Some(c.process.start_ticks),
                supervisor: Some(c.supervisor.to_string()),
                ..ChildEntry::default()
            })
            .collect();
        entries.sort_by_key(|e| e.pid);
        *self.board.lock().unwrap_or_else(|p| p.into_inner()) = entries;
    }

    /// Starts the agent and registers it on its node as [`AGENT_NAME`]. Must be called
    /// inside an actix system.
    pub fn serve(self) -> Addr<ChildAgent> {
        self.start()
    }

    /// Who `from` is, as the link it called over proved it; `None` once no link to it is
    /// up (a remote process id names its key's namespace, so any link of that id is one
    /// of the same key).
    fn caller(&self, from: &ProcessId) -> Option<Caller> {
        self.node.peer(from).map(|peer| Caller::of(peer.info()))
    }

    fn spawn(
        &mut self,
        from: ProcessId,
        req: SpawnRemote,
        ctx: &mut Context<Self>,
    ) -> Result<AgentChild, AgentRefusal> {
        let Some(spec) = self.specs.get(&req.spec) else {
            let mut known: Vec<String> = self.specs.keys().cloned().collect();
            known.sort();
            return Err(AgentRefusal::UnknownSpec {
                spec: req.spec,
                known,
            });
        };
        for (what, name) in [("child name", &req.name), ("inbox name", &req.inbox)] {
            if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
                return Err(AgentRefusal::BadRequest {
                    reason: format!(
                        "a {what} must be 1 to {MAX_NAME_LEN} bytes without NUL, not {} bytes",
                        name.len()
                    ),
                });
            }
        }
        let connect = match &req.connect_tcp {
            None => None,
            Some(addr) => {
                Some(
                    addr.parse::<SocketAddr>()
                        .map_err(|e| AgentRefusal::BadRequest {
                            reason: format!("connect_tcp is not an ip:port ({e})"),
                        })?,
                )
            }
        };
        // It called over a link that may have gone down meanwhile: a child started now
        // would have nobody to be killed with.
        let Some(caller) = self.caller(&from) else {
            return Err(AgentRefusal::NotLinked);
        };
        let limit = self.limits.children_per_caller;
        if self
            .children
            .values()
            .filter(|c| c.caller == caller)
            .count()
            >= limit
        {
            return Err(AgentRefusal::TooManyChildren { limit });
        }
        let limit = self.limits.children_total;
        if self.children.len() >= limit {
            return Err(AgentRefusal::AgentFull { limit });
        }
        let mut spec = spec.clone();
        spec.name.clone_from(&req.name);
        let env: Vec<(&str, std::ffi::OsString)> = connect
            .iter()
            .map(|a| (CONNECT_TCP_ENV, a.to_string().into()))
            .collect();
        let spawned = spawn_process(&self.node, &spec, &env).map_err(|e| {
            tracing::error!(spec = %req.spec, child = %req.name, error = %e, "could not start a child for a remote supervisor");
            AgentRefusal::SpawnFailed {
                spec: req.spec.clone(),
                reason: e.to_string(),
            }
        })?;
        self.node
            .core()
            .exports()
            .supervise(spawned.process, Arc::clone(&spawned.pidfd));
        self.next_id += 1;
        let id = self.next_id;
        let addr = ctx.address();
        let mut child = spawned.child;
        let reaper = std::thread::Builder::new()
            .name(format!("agent-reap-{id}"))
            .spawn(move || {
                let status = child.wait().ok();
                addr.do_send(AgentChildExited { id, status });
            });
        if let Err(e) = reaper {
            sigkill(&spawned.pidfd);
            return Err(AgentRefusal::SpawnFailed {
                spec: req.spec,
                reason: format!("no reaper thread: {e}"),
            });
        }
        tracing::info!(spec = %req.spec, child = %req.name, id, pid = spawned.pid, supervisor = %from, "child started for a remote supervisor");
        self.children.insert(
            id,
            AgentRunning {
                supervisor: from,
                caller,
                name: req.name,
                inbox: req.inbox,
                pid: spawned.pid,
                process: spawned.process,
                pidfd: spawned.pidfd,
            },
        );
        self.publish();
        Ok(AgentChild {
            id,
            pid: spawned.pid,
            process: spawned.process,
        })
    }
}

impl Actor for ChildAgent {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let _g = self.span.clone().entered();
        self.node.subscribe(ctx.address().recipient());
        // The node's status lists the children it runs for as long as it lives.
        self.node.core().observed().register_children(&self.board);
        self.node.core().insert_handler(
            AGENT_NAME,
            Arc::new(ByCaller::<SpawnRemote> {
                recipient: ctx.address().recipient(),
            }),
        );
        self.node.core().insert_handler(
            AGENT_NAME,
            Arc::new(ByCaller::<KillRemote> {
                recipient: ctx.address().recipient(),
            }),
        );
        tracing::info!(specs = self.specs.len(), "child agent serving");
    }

    /// Kills every child it started (their reapers reap them).
    fn stopped(&mut self, _ctx: &mut Self::Context) {
        let _g = self.span.clone().entered();
        self.node.unregister(AGENT_NAME);
        for child in self.children.values() {
            sigkill(&child.pidfd);
        }
    }
}

impl Handler<FromPeer<SpawnRemote>> for ChildAgent {
    type Result = Result<AgentChild, AgentRefusal>;

    fn handle(&mut self, msg: FromPeer<SpawnRemote>, ctx: &mut Self::Context) -> Self::Result {
        let _g = self.span.clone().entered();
        let result = self.spawn(msg.from, msg.msg, ctx);
        if let Err(refusal) = &result {
            tracing::warn!(supervisor = %msg.from, %refusal, "refused a spawn");
        }
        result
    }
}

impl Handler<FromPeer<KillRemote>> for ChildAgent {
    type Result = Result<(), AgentRefusal>;

    fn handle(&mut self, msg: FromPeer<KillRemote>, _ctx: &mut Self::Context) -> Self::Result {
        let _g = self.span.clone().entered();
        let id = msg.msg.id;
        let caller = self.caller(&msg.from);
        match self.children.get(&id) {
            Some(child) if Some(child.caller) == caller => {
                tracing::info!(child = %child.name, id, pid = child.pid, "killing a child at its supervisor's request");
                sigkill(&child.pidfd);
                Ok(())
            }
            _ => Err(AgentRefusal::NoSuchChild { id }),
        }
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct AgentChildExited {
    id: u64,
    status: Option<ExitStatus>,
}

impl Handler<AgentChildExited> for ChildAgent {
    type Result = ();

    fn handle(&mut self, msg: AgentChildExited, _ctx: &mut Self::Context) {
        let _g = self.span.clone().entered();
        let Some(child) = self.children.remove(&msg.id) else {
            return;
        };
        self.publish();
        self.node.process_exited(child.process);
        let clean = msg.status.is_some_and(|s| s.success());
        let status = describe(msg.status);
        if !clean {
            sweep_dead_child(&[], &child.name, &child.process);
        }
        tracing::info!(child = %child.name, id = msg.id, pid = child.pid, %status, "a remote supervisor's child exited");
        let Some(peer) = self.node.peer(&child.supervisor) else {
            tracing::debug!(child = %child.name, "its supervisor's link is down: the exit is not reported");
            return;
        };
        let deadline = self.node.config().heartbeat.deadline;
        let report = peer.remote::<RemoteExit>(&child.inbox).send_timeout(
            RemoteExit {
                id: msg.id,
                status,
                clean,
            },
            deadline,
        );
        let name = child.name;
        actix::spawn(async move {
            if let Err(e) = report.await {
                tracing::warn!(child = %name, error = %e, "could not report a child's exit to its supervisor");
            }
        });
    }
}

impl Handler<PeerEvent> for ChildAgent {
    type Result = ();

    /// A supervisor's last link went down: its children are killed (and reaped).
    fn handle(&mut self, event: PeerEvent, _ctx: &mut Self::Context) {
        let PeerEvent::Down { peer, reason, .. } = event else {
            return;
        };
        if self.node.peer(&peer.process).is_some() {
            return;
        }
        let _g = self.span.clone().entered();
        for (id, child) in &self.children {
            if child.supervisor == peer.process {
                tracing::warn!(child = %child.name, id, pid = child.pid, supervisor = %peer.process, reason = ?reason.as_deref().map(ActorError::to_string), "its supervisor's link is down: killing the child");
                sigkill(&child.pidfd);
            }
        }
    }
}
