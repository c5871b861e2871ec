//! The supervisor's side of children on other hosts: each started through the
//! [`ChildAgent`](super::agent::ChildAgent) at an address, over a host link.

use super::agent::{
    AGENT_NAME, AgentChild, AgentRefusal, ByCaller, FromPeer, KillRemote, RemoteExit, SpawnRemote,
};
use super::{ChildStatus, ProcessSupervisor, Restart, SupervisorEvent};
use crate::error::ActorError;
use crate::node_core::Peer;
use actix::prelude::*;
use baton_ipc::PeerInfo;
use baton_messages::ProcessId;
use baton_messages::status::ChildEntry;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a failed remote start waits before it is tried again (and counted).
const RETRY_AFTER: Duration = Duration::from_millis(200);

/// The first wait before a start whose agent was unreachable is tried again (uncounted);
/// each later wait doubles, up to [`UNREACHABLE_RETRY_MAX`].
const UNREACHABLE_RETRY_FIRST: Duration = Duration::from_millis(100);

/// The longest wait between two tries of an unreachable agent within its readiness window.
const UNREACHABLE_RETRY_MAX: Duration = Duration::from_secs(1);

/// How long a remote child's agent may stay unreachable before failed starts count toward
/// the restart limit, unless its spec says ([`RemoteChildSpec::ready_within`]).
pub const DEFAULT_READY_WITHIN: Duration = Duration::from_secs(10);

/// How to start one child on another host: the spec `spec` of the
/// [`ChildAgent`](super::agent::ChildAgent) that takes host links at `agent`.
///
/// The supervisor links to `agent` (`Node::connect_tcp`, under the heartbeat deadline)
/// when it starts the child, and again on each restart if that link is down; children of
/// one agent share its link.
///
/// **An agent that is not reachable yet** (no link could be made: refused, or no answer
/// within the heartbeat deadline) does not use up the restart limit at once: the start is
/// tried again, uncounted, with a backoff (100 ms doubling to 1 s), for up to
/// [`ready_within`](Self::ready_within) from the first such failure (default
/// [`DEFAULT_READY_WITHIN`], 10 s). Past that, each failed start counts toward
/// [`RestartPolicy`](super::RestartPolicy) as any other failed start does, so an agent
/// that stays away makes the supervisor escalate: never a wait without bound. Every
/// failed try is still reported ([`SupervisorEvent::StartFailed`]). An agent that answers
/// and refuses (an unknown spec, its limits, a wrong token) counts at once. To wait until
/// the child runs, send the supervisor [`ChildRunning`](super::ChildRunning).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteChildSpec {
    /// Its name (unique among the supervisor's children, local ones included).
    pub name: String,
    /// Where the agent takes host links.
    pub agent: SocketAddr,
    /// The name of a spec in the agent's table.
    pub spec: String,
    /// When to restart it (a lost child counts as failed).
    pub restart: Restart,
    /// How long its agent may stay unreachable before failed starts count toward the
    /// restart limit (see above).
    pub ready_within: Duration,
}

impl RemoteChildSpec {
    /// The child `name`, the agent's spec `spec` at `agent`; restarted always.
    pub fn new(name: impl Into<String>, agent: SocketAddr, spec: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            agent,
            spec: spec.into(),
            restart: Restart::Permanent,
            ready_within: DEFAULT_READY_WITHIN,
        }
    }

    /// Sets when it is restarted.
    pub fn restart(mut self, restart: Restart) -> Self {
        self.restart = restart;
        self
    }

    /// Sets how long its agent may stay unreachable before failed starts count toward the
    /// restart limit (`Duration::ZERO`: they count at once).
    pub fn ready_within(mut self, within: Duration) -> Self {
        self.ready_within = within;
        self
    }
}

/// A remote child that runs.
struct RemoteRunning {
    agent: Peer,
    child: AgentChild,
}

/// The supervisor's remote children.
#[derive(Default)]
pub(super) struct RemoteChildren {
    pub(super) specs: Vec<RemoteChildSpec>,
    /// Where children are told to link back to (`CONNECT_TCP_ENV`).
    connect_tcp: Option<SocketAddr>,
    /// The links to agents, by address.
    agents: HashMap<SocketAddr, Peer>,
    running: HashMap<String, RemoteRunning>,
    /// Starts under way: the incarnation whose answer counts.
    starting: HashMap<String, u64>,
    /// The name exits are reported to on our node.
    inbox: String,
    /// Children whose agent was unreachable at their last start: since when, and the
    /// next wait before an uncounted retry.
    unreachable: HashMap<String, (Instant, Duration)>,
}

impl ProcessSupervisor {
    /// Adds children on other hosts, each started by the agent at its address.
    pub fn remote_children(mut self, children: Vec<RemoteChildSpec>) -> Self {
        self.remote.specs.extend(children);
        self
    }

    /// Tells children on other hosts to link back to this address
    /// ([`CONNECT_TCP_ENV`](super::agent::CONNECT_TCP_ENV)): where this supervisor's node
    /// takes host links ([`TcpListening::local_addr`](crate::TcpListening::local_addr)).
    pub fn connect_back_tcp(mut self, addr: SocketAddr) -> Self {
        self.remote.connect_tcp = Some(addr);
        self
    }

    /// Registers the exit inbox and starts every remote child.
    pub(super) fn start_remotes(&mut self, ctx: &mut Context<Self>) {
        if self.remote.specs.is_empty() {
            return;
        }
        static NEXT: AtomicU64 = AtomicU64::new(1);
        self.remote.inbox = format!("baton.supervisor.{}", NEXT.fetch_add(1, Ordering::Relaxed));
        self.node.core().insert_handler(
            &self.remote.inbox,
            Arc::new(ByCaller::<RemoteExit> {
                recipient: ctx.address().recipient(),
            }),
        );
        for spec in self.remote.specs.clone() {
            self.start_remote(spec, ctx);
        }
    }

    /// Asks the agent to start `spec`'s child (linking to it first if need be); the
    /// answer comes back as [`RemoteStarted`].
    pub(super) fn start_remote(&mut self, spec: RemoteChildSpec, ctx: &mut Context<Self>) {
        self.incarnation += 1;
        let incarnation = self.incarnation;
        self.remote.starting.insert(spec.name.clone(), incarnation);
        let linked = self
            .remote
            .agents
            .get(&spec.agent)
            .filter(|p| p.is_connected())
            .cloned();
        let node = self.node.clone();
        let deadline = node.config().heartbeat.deadline;
        let request = SpawnRemote {
            spec: spec.spec.clone(),
            name: spec.name.clone(),
            connect_tcp: self.remote.connect_tcp.map(|a| a.to_string()),
            inbox: self.remote.inbox.clone(),
        };
        let addr = ctx.address();
        let span = self.span.clone();
        actix::spawn(async move {
            let agent = match linked {
                Some(peer) => Ok(peer),
                None => match tokio::time::timeout(deadline, node.connect_tcp(spec.agent)).await {
                    Ok(linked) => linked,
                    Err(_) => Err(ActorError::Timeout {
                        op: "linking to a child agent",
                        after: deadline,
                    }),
                },
            };
            let counted = |error: String| StartFailure {
                error,
                unreachable: false,
            };
            let outcome = match agent {
                // No link: refused by the OS or no answer (not there yet, or gone). An agent
                // that answered and refused (a wrong token) is no unreachable one.
                Err(e) => Err(StartFailure {
                    unreachable: matches!(
                        e.fault(),
                        baton_ipc::Fault::Local | baton_ipc::Fault::Ended
                    ),
                    error: e.to_string(),
                }),
                Ok(agent) => {
                    let reply = agent
                        .remote::<SpawnRemote>(AGENT_NAME)
                        .send_timeout(request, deadline)
                        .await;
                    match reply {
                        Ok(Ok(child)) => Ok((agent, child)),
                        Ok(Err(refusal)) => Err(counted(refusal.to_string())),
                        Err(e) => Err(counted(e.to_string())),
                    }
                }
            };
            let started = RemoteStarted {
                name: spec.name,
                incarnation,
                outcome,
            };
            // The supervisor stopped meanwhile: what it started must not run on.
            if let Err(SendError::Closed(started) | SendError::Full(started)) =
                addr.try_send(started)
                && let Ok((agent, child)) = started.outcome
            {
                let _g = span.entered();
                tracing::info!(child = %started.name, "started after the supervisor stopped: killing it");
                kill_on(&agent, child.id, deadline);
            }
        });
    }

    /// Asks every remote child's agent to kill it and forgets them (their exits arrive
    /// for ids no longer running: not restarted). Starts under way are dropped too: what
    /// they start is killed when their answer comes.
    pub(super) fn kill_all_remote(&mut self) {
        let deadline = self.node.config().heartbeat.deadline;
        for running in self.remote.running.values() {
            kill_on(&running.agent, running.child.id, deadline);
        }
        self.remote.running.clear();
        self.remote.starting.clear();
    }

    /// The supervisor stops: its remote children are killed, its inbox closed.
    pub(super) fn stop_remotes(&mut self) {
        self.kill_all_remote();
        if !self.remote.inbox.is_empty() {
            self.node.unregister(&self.remote.inbox);
        }
    }

    /// Kills the remote child `name` through its agent; its pid there, if it runs.
    pub(super) fn kill_remote_named(&self, name: &str) -> Option<u32> {
        let running = self.remote.running.get(name)?;
        tracing::info!(child = %name, pid = running.child.pid, "killing a remote child");
        kill_on(
            &running.agent,
            running.child.id,
            self.node.config().heartbeat.deadline,
        );
        Some(running.child.pid)
    }

    /// `peer`'s link went silent past the heartbeat deadline: if it is a remote child
    /// (one that linked back over TCP), its agent is asked to kill it; its exit restarts
    /// it.
    ///
    /// A child that links back over TCP is known here by its claim in its key's
    /// namespace, and its agent reports the id it has on its own host: the two meet in
    /// the claim (`HostPeer::claimed`) from the agent's host. That is a claim, not a
    /// proof: a token holder claiming a remote child's id that goes silent gets that
    /// child restarted (docs/CROSS_HOST.md, threat model). It gains no other right: the
    /// kill goes to the child's own agent, for the child's own id.
    pub(super) fn kill_unresponsive_remote(&self, peer: &PeerInfo) {
        let Some(host) = peer.host() else {
            return;
        };
        let deadline = self.node.config().heartbeat.deadline;
        for (name, running) in &self.remote.running {
            let from_its_agents_host = running
                .agent
                .info()
                .host()
                .is_some_and(|agent| agent.host == host.host);
            if running.child.process == host.claimed && from_its_agents_host {
                tracing::warn!(child = %name, pid = running.child.pid, "remote child unresponsive: killing it");
                kill_on(&running.agent, running.child.id, deadline);
            }
        }
    }

    /// The last link to `process` went down: if it was an agent, its children are lost.
    pub(super) fn agent_down(
        &mut self,
        process: ProcessId,
        reason: Option<&ActorError>,
        ctx: &mut Context<Self>,
    ) {
        let lost: Vec<String> = self
            .remote
            .running
            .iter()
            .filter(|(_, r)| r.agent.process() == process)
            .map(|(name, _)| name.clone())
            .collect();
        self.remote.agents.retain(|_, p| p.process() != process);
        if lost.is_empty() {
            return;
        }
        let _g = self.span.clone().entered();
        let reason = reason.map(ToString::to_string);
        let mut restart = Vec::new();
        for name in lost {
            let Some(running) = self.remote.running.remove(&name) else {
                continue;
            };
            tracing::warn!(child = %name, pid = running.child.pid, agent = %process, reason = ?reason, "remote child lost with its agent's link");
            self.last_exit
                .insert(name.clone(), "lost with its agent's link".to_owned());
            self.emit(SupervisorEvent::Lost {
                name: name.clone(),
                pid: running.child.pid,
                process: running.child.process,
                agent: process,
                reason: reason.clone(),
            });
            if self.remote_restart(&name) == Restart::Temporary {
                self.forget_waiters(&name);
                self.done.insert(name);
            } else {
                restart.push(name);
            }
        }
        self.on_death(&restart, ctx);
        self.publish();
    }

    /// `name`'s agent was unreachable: the wait before an uncounted retry, while its
    /// readiness window ([`RemoteChildSpec::ready_within`]) lasts; `None` once it is over
    /// (the failure counts).
    fn uncounted_retry(&mut self, name: &str) -> Option<Duration> {
        let ready_within = self
            .remote
            .specs
            .iter()
            .find(|s| s.name == name)
            .map_or(Duration::ZERO, |s| s.ready_within);
        let now = Instant::now();
        let (since, next) = self
            .remote
            .unreachable
            .entry(name.to_owned())
            .or_insert((now, UNREACHABLE_RETRY_FIRST));
        let left = ready_within.checked_sub(now.duration_since(*since))?;
        if left.is_zero() {
            return None;
        }
        let wait = (*next).min(left);
        *next = (*next * 2).min(UNREACHABLE_RETRY_MAX);
        Some(wait)
    }

    /// Tries an unreachable agent's child again, uncounted, unless it was started or given
    /// up meanwhile (a one-for-all restart, the supervisor stopping).
    fn retry_remote(&mut self, name: &str, ctx: &mut Context<Self>) {
        let wanted = !self.stopping
            && !self.done.contains(name)
            && !self.remote.running.contains_key(name)
            && !self.remote.starting.contains_key(name);
        let Some(spec) = self.remote.specs.iter().find(|s| s.name == name).cloned() else {
            return;
        };
        if wanted {
            self.start_remote(spec, ctx);
        }
    }

    fn remote_restart(&self, name: &str) -> Restart {
        self.remote
            .specs
            .iter()
            .find(|s| s.name == name)
            .map_or(Restart::Permanent, |s| s.restart)
    }

    /// The remote children's entries for the node's status, with their agent's address.
    pub(super) fn remote_entries(&self) -> impl Iterator<Item = ChildEntry> + '_ {
        self.remote.specs.iter().map(|s| {
            let running = self.remote.running.get(&s.name);
            ChildEntry {
                name: s.name.clone(),
                state: self.state_of(&s.name, running.is_some()).to_owned(),
                pid: running.map(|r| r.child.pid),
                start_ticks: running.map(|r| r.child.process.start_ticks),
                restarts: self.restarts.get(&s.name).copied().unwrap_or(0),
                last_exit: self.last_exit.get(&s.name).cloned(),
                host: Some(s.agent.to_string()),
                supervisor: None,
            }
        })
    }

    /// The remote children's states, for [`Children`](super::Children).
    pub(super) fn remote_statuses(&self) -> impl Iterator<Item = ChildStatus> + '_ {
        self.remote.specs.iter().map(|s| {
            let running = self.remote.running.get(&s.name);
            ChildStatus {
                name: s.name.clone(),
                pid: running.map(|r| r.child.pid),
                process: running.map(|r| r.child.process),
                restarts: self.restarts.get(&s.name).copied().unwrap_or(0),
            }
        })
    }
}

/// Asks `agent` to kill its child `id`, on a task of its own, under `deadline`.
fn kill_on(agent: &Peer, id: u64, deadline: Duration) {
    let call = agent
        .remote::<KillRemote>(AGENT_NAME)
        .send_timeout(KillRemote { id }, deadline);
    actix::spawn(async move {
        match call.await {
            Ok(Ok(())) => {}
            // It had exited already.
            Ok(Err(AgentRefusal::NoSuchChild { .. })) => {}
            // A link that is down: the agent kills it on its side.
            Ok(Err(e)) => tracing::warn!(id, error = %e, "the agent refused to kill a child"),
            Err(e) => tracing::debug!(id, error = %e, "no answer to a kill"),
        }
    });
}

/// The answer to a remote start.
#[derive(Message)]
#[rtype(result = "()")]
pub(super) struct RemoteStarted {
    name: String,
    incarnation: u64,
    outcome: Result<(Peer, AgentChild), StartFailure>,
}

/// Why a remote start failed.
pub(super) struct StartFailure {
    error: String,
    /// No link to the agent could be made (it may not be up yet).
    unreachable: bool,
}

impl Handler<RemoteStarted> for ProcessSupervisor {
    type Result = ();

    fn handle(&mut self, msg: RemoteStarted, ctx: &mut Self::Context) {
        let _g = self.span.clone().entered();
        let current =
            !self.stopping && self.remote.starting.get(&msg.name) == Some(&msg.incarnation);
        if !current {
            // Given up meanwhile (one-for-all restarted them all, the supervisor stops).
            if let Ok((agent, child)) = msg.outcome {
                kill_on(&agent, child.id, self.node.config().heartbeat.deadline);
            }
            return;
        }
        self.remote.starting.remove(&msg.name);
        match msg.outcome {
            Ok((agent, child)) => {
                let restarts = self.restarts.get(&msg.name).copied().unwrap_or(0);
                let addr = self
                    .remote
                    .specs
                    .iter()
                    .find(|s| s.name == msg.name)
                    .map(|s| s.agent);
                if !agent.is_connected() {
                    // Its link went down before we heard: lost at once.
                    self.remote.running.insert(
                        msg.name.clone(),
                        RemoteRunning {
                            agent: agent.clone(),
                            child,
                        },
                    );
                    self.agent_down(agent.process(), None, ctx);
                    return;
                }
                self.remote.unreachable.remove(&msg.name);
                tracing::info!(child = %msg.name, pid = child.pid, agent = %agent.process(), restarts, "remote child started");
                if let Some(addr) = addr {
                    self.remote.agents.insert(addr, agent.clone());
                }
                self.remote
                    .running
                    .insert(msg.name.clone(), RemoteRunning { agent, child });
                self.done.remove(&msg.name);
                self.emit(SupervisorEvent::Started {
                    name: msg.name.clone(),
                    pid: child.pid,
                    process: child.process,
                    restarts,
                });
                self.started_waiters(&msg.name);
            }
            Err(StartFailure { error, unreachable }) => {
                self.emit(SupervisorEvent::StartFailed {
                    name: msg.name.clone(),
                    error: error.clone(),
                });
                if unreachable && let Some(wait) = self.uncounted_retry(&msg.name) {
                    tracing::warn!(child = %msg.name, %error, ?wait, "the child's agent is not reachable (yet); retrying, not counted");
                    let name = msg.name;
                    ctx.run_later(wait, move |act, ctx| act.retry_remote(&name, ctx));
                } else {
                    tracing::error!(child = %msg.name, %error, "could not start a remote child; retrying");
                    let name = msg.name;
                    ctx.run_later(RETRY_AFTER, move |act, ctx| {
                        act.on_death(&[name], ctx);
                    });
                }
            }
        }
        self.publish();
    }
}

impl Handler<FromPeer<RemoteExit>> for ProcessSupervisor {
    type Result = ();

    /// An agent reports a child's exit; only the agent that runs it is heard.
    fn handle(&mut self, msg: FromPeer<RemoteExit>, ctx: &mut Self::Context) {
        let _g = self.span.clone().entered();
        let FromPeer { from, msg } = msg;
        let Some(name) = self
            .remote
            .running
            .iter()
            .find(|(_, r)| r.agent.process() == from && r.child.id == msg.id)
            .map(|(name, _)| name.clone())
        else {
            tracing::debug!(agent = %from, id = msg.id, status = %msg.status, "exit of a remote child no longer supervised");
            return;
        };
        let Some(running) = self.remote.running.remove(&name) else {
            return;
        };
        if msg.clean {
            tracing::info!(child = %name, pid = running.child.pid, status = %msg.status, "remote child exited");
        } else {
            tracing::warn!(child = %name, pid = running.child.pid, status = %msg.status, "remote child exited");
        }
        self.last_exit.insert(name.clone(), msg.status.clone());
        self.emit(SupervisorEvent::Exited {
            name: name.clone(),
            pid: running.child.pid,
            process: running.child.process,
            status: msg.status,
        });
        let restart = self.remote_restart(&name);
        self.after_exit(&name, restart, msg.clean, ctx);
        self.publish();
    }
}
