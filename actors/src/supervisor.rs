//! [`ProcessSupervisor`]: spawns child processes, watches them, restarts them by strategy,
//! and feeds their deaths into the lease protocol.
//!
//! - Children are spawned with `std::process::Command` (never `fork` after CUDA init),
//!   through [`baton_ipc::spawn::spawn_tied`]: the kernel SIGKILLs them when this process
//!   dies, however it dies (`PR_SET_PDEATHSIG`, from a spawner thread that lives as long
//!   as the process). A small reaper thread per child waits for it and reports its exit;
//!   signals go through a pidfd (`pidfd_open`, `pidfd_send_signal`), so a recycled pid can
//!   never be hit.
//! - Each child gets the session token through an inherited pipe
//!   ([`Session::pass_to`](baton_ipc::Session::pass_to): never in its environment; its
//!   `Session::from_env` / `Node::from_env` reads and closes it), its name
//!   ([`CHILD_NAME_ENV`]), the node's backend unless its spec names one (as
//!   [`Node::spawn_child`](crate::Node::spawn_child) does), and, if set, the socket to
//!   connect back to ([`CONNECT_ENV`]).
//! - **Joining in one call** ([`ProcessSupervisor::link_children`]): the supervisor listens
//!   on a fresh private socket and names it in [`PARENT_SOCKET_ENV`](crate::PARENT_SOCKET_ENV);
//!   each child calls [`Node::join`](crate::Node::join). A link is matched to its child by
//!   the process it proved in the handshake (pid and start time), never by what the child
//!   says; links from other processes are closed. [`SupervisorEvent::Linked`] announces
//!   each; [`ChildPeer`] waits for a child's current link (after a restart, the new one).
//! - Children are named by (pid, start time) ([`ProcessId`]), never by pid alone.
//! - When a child dies, every link to it is cut at once (reclaiming the leases it held,
//!   orphaning the ones it granted), even if a descendant inherited its socket, and the
//!   ledger learns it is dead: memory quarantined for it is freed.
//! - A child whose link goes silent past the heartbeat deadline (stopped, deadlocked) is
//!   killed — and so restarted by its strategy — unless
//!   [`kill_unresponsive`](ProcessSupervisor::kill_unresponsive) says otherwise. Owners
//!   whose [`RevokePolicy`](crate::RevokePolicy) says so kill children that keep a revoked
//!   lease past its deadline.
//! - Before it is restarted (and when the supervisor stops), a child that did not exit
//!   cleanly has its named host segments swept ([`host::sweep_process`]: that process's, by pid and start time,
//!   in any namespace), and subscribers get [`SupervisorEvent::Swept`]. Memfd host memory
//!   needs no sweep: the kernel freed it with the child.
//! - Restarts, for [`Restart::Permanent`] children and failed [`Restart::Transient`]
//!   ones: [`Strategy::OneForOne`] restarts the child that died;
//!   [`Strategy::OneForAll`] kills and restarts them all. More than
//!   [`RestartPolicy::max_restarts`] restarts within [`RestartPolicy::within`] escalates:
//!   every child is killed, subscribers get [`SupervisorEvent::Escalated`], and the
//!   supervisor stops.
//! - Stopping the supervisor kills and reaps every child.
//! - **Children on other hosts** ([`RemoteChildSpec`]): a [`ChildAgent`](agent::ChildAgent)
//!   on that host starts a spec of its own table at the supervisor's request, over a host
//!   link, and reports the child's exits back; they drive the same strategies and restart
//!   limit as local children's. When the agent's link goes down (the agent died, or the
//!   heartbeat cut a partition) its children are counted [`SupervisorEvent::Lost`] — the
//!   agent kills them on its side when it sees the same link down — and are restarted by
//!   the strategy, which links to the agent's address again. A start whose agent cannot be
//!   reached (not up yet, or away) is tried again with a backoff *without* counting toward
//!   the restart limit for up to [`RemoteChildSpec::ready_within`] (default 10 s); past
//!   that each failed start counts, so an agent that stays away makes the supervisor
//!   escalate rather than wait without bound. [`ChildRunning`] waits, with a deadline, until
//!   a child runs. See `docs/CROSS_HOST.md`, "Supervising children on another host".

use crate::error::ActorError;
use crate::node::Node;
use crate::node_core::{Peer, PeerEvent};
use actix::prelude::*;
use baton_ipc::{host, process};
use baton_messages::ProcessId;
use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub mod agent;
mod links;
mod remote;

pub use links::{ChildPeer, ChildRunning};
pub use remote::{DEFAULT_READY_WITHIN, RemoteChildSpec};

// A child's status reports its name: the constant sits with the status, below the node.
pub use crate::status::CHILD_NAME_ENV;
/// The variable that tells a child which socket to connect back to.
pub const CONNECT_ENV: &str = "BATON_CONNECT";

/// When a child that exited is restarted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Restart {
    /// Always.
    #[default]
    Permanent,
    /// Only if it failed (killed by a signal, or a non-zero exit code); a clean exit means
    /// its work is done.
    Transient,
    /// Never.
    Temporary,
}

/// How to start one child.
///
/// Besides `env`, the child gets its name ([`CHILD_NAME_ENV`]), the session token through
/// an inherited pipe, the supervisor's socket when it links its children
/// ([`ProcessSupervisor::link_children`]) or names one ([`CONNECT_ENV`]), and the
/// supervisor node's backend — `BATON_BACKEND`, and `BATON_CUDA_DEVICE` and
/// `BATON_CUDA_EXPORT` for CUDA — unless `env` sets `BATON_BACKEND` (then none of them is
/// added) or the CUDA variable itself.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    /// Its name (unique among the supervisor's children).
    pub name: String,
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// When to restart it.
    pub restart: Restart,
}

impl ChildSpec {
    /// A child running `program`.
    pub fn new(name: impl Into<String>, program: impl Into<PathBuf>) -> Self {
        Self {
            name: name.into(),
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            restart: Restart::Permanent,
        }
    }

    /// The same binary as this process (`std::env::current_exe`), as most examples do
    /// with a role argument.
    ///
    /// # Errors
    /// [`ActorError::Spawn`] if the running executable cannot be found.
    pub fn this_exe(name: impl Into<String>) -> Result<Self, ActorError> {
        let name = name.into();
        let exe = std::env::current_exe().map_err(|source| ActorError::Spawn {
            name: name.clone(),
            source,
        })?;
        Ok(Self::new(name, exe))
    }

    /// Adds an argument.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Sets when it is restarted.
    pub fn restart(mut self, restart: Restart) -> Self {
        self.restart = restart;
        self
    }

    /// Adds an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
}

/// Which children to restart when one dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Only the one that died.
    OneForOne,
    /// All of them (for children that only make sense together).
    OneForAll,
}

/// How many restarts are tolerated before the supervisor gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// At most this many restarts…
    pub max_restarts: u32,
    /// …within this window.
    pub within: Duration,
}

impl Default for RestartPolicy {
    /// 5 restarts in 10 s.
    fn default() -> Self {
        Self {
            max_restarts: 5,
            within: Duration::from_secs(10),
        }
    }
}

/// What the supervisor did; supervision events are data, for subscribers.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
#[non_exhaustive]
pub enum SupervisorEvent {
    /// A child started.
    Started {
        /// Its name.
        name: String,
        /// Its pid (of the agent's host, for a child on another host).
        pid: u32,
        /// The process (pid and start time; the agent host's boot id, for a child on
        /// another host).
        process: ProcessId,
        /// How many times it was restarted before this start.
        restarts: u32,
    },
    /// A child exited (or was killed).
    Exited {
        /// Its name.
        name: String,
        /// Its pid.
        pid: u32,
        /// The process (pid and start time).
        process: ProcessId,
        /// How it ended: an exit code, or the signal that killed it.
        status: String,
    },
    /// A dead child's named host segments were removed (it was killed before its `Drop`
    /// could unlink them). Sent only when something was removed, before any restart.
    Swept {
        /// Its name.
        name: String,
        /// Its pid.
        pid: u32,
        /// Segments removed.
        segments: usize,
        /// Bytes they held.
        bytes: u64,
    },
    /// A child linked to the supervisor's socket (under
    /// [`ProcessSupervisor::link_children`]), matched by the process it proved in the
    /// handshake. A restarted child's link replaces its last run's.
    Linked {
        /// Its name.
        name: String,
        /// The process (pid and start time) that linked: the child's current run.
        process: ProcessId,
        /// The link to it (boxed: a link is larger than the other events).
        peer: Box<Peer>,
    },
    /// A child on another host was lost with its agent's link (the agent died, or the link
    /// was cut); the agent kills it on its side. It is restarted by the strategy, like a
    /// child that died.
    Lost {
        /// Its name.
        name: String,
        /// Its pid on the agent's host.
        pid: u32,
        /// The process (the agent host's boot id, pid, start time).
        process: ProcessId,
        /// The agent's process.
        agent: ProcessId,
        /// Why the link went down (`None`: a clean end of stream, as when the agent's
        /// process died).
        reason: Option<String>,
    },
    /// A child on another host could not be started: its agent was unreachable or refused
    /// (an unknown spec, its limit). It is tried again: like a child that died, or — its
    /// agent unreachable, within [`RemoteChildSpec::ready_within`] — uncounted.
    StartFailed {
        /// Its name.
        name: String,
        /// Why.
        error: String,
    },
    /// The restart limit was exceeded: all children were killed and the supervisor stops.
    Escalated {
        /// Restarts seen within the window.
        restarts: usize,
    },
}

/// The state of one child, for [`Children`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildStatus {
    /// Its name.
    pub name: String,
    /// Its pid, if running.
    pub pid: Option<u32>,
    /// The process (pid and start time), if running.
    pub process: Option<ProcessId>,
    /// Times restarted so far.
    pub restarts: u32,
}

struct Running {
    pid: u32,
    /// Its identity (pid and start time): for the ledger, kills and the sweep after its death.
    process: ProcessId,
    incarnation: u64,
    pidfd: Arc<OwnedFd>,
    /// Waits for the child, reaps it, reports the exit, and returns the status.
    reaper: Option<JoinHandle<Option<ExitStatus>>>,
}

/// Removes a dead child's named host segments and tells `watchers` if there were any.
fn sweep_dead_child(watchers: &[Recipient<SupervisorEvent>], name: &str, child: &ProcessId) {
    match host::sweep_process(child) {
        Ok(report) if !report.removed.is_empty() => {
            tracing::info!(child = %name, pid = child.pid, segments = report.removed.len(), bytes = report.removed_bytes, "swept a dead child's segments");
            let event = SupervisorEvent::Swept {
                name: name.to_owned(),
                pid: child.pid,
                segments: report.removed.len(),
                bytes: report.removed_bytes,
            };
            for w in watchers {
                w.do_send(event.clone());
            }
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(child = %name, pid = child.pid, error = %e, "could not sweep a dead child's segments");
        }
    }
}

/// A child process just spawned by [`spawn_process`], not yet reaped.
pub(crate) struct Spawned {
    pub(crate) child: Child,
    pub(crate) pid: u32,
    /// Its identity (pid and start time).
    pub(crate) process: ProcessId,
    /// Signals go through it, so a recycled pid is never hit.
    pub(crate) pidfd: Arc<OwnedFd>,
}

/// Spawns `spec`'s program tied to this process (`spawn_tied`: SIGKILLed when this
/// process dies), with its name ([`CHILD_NAME_ENV`]), `env`, the spec's own environment,
/// `node`'s backend unless the spec names one (as [`Node::spawn_child`] does), and last the session token through an inherited pipe (never in its environment). The
/// supervisor and the [`ChildAgent`](agent::ChildAgent) both start children here.
///
/// # Errors
/// [`ActorError::Spawn`]: the program cannot be started, or no pidfd can be opened for it
/// (then it is killed and reaped before this returns).
pub(crate) fn spawn_process(
    node: &Node,
    spec: &ChildSpec,
    env: &[(&str, std::ffi::OsString)],
) -> Result<Spawned, ActorError> {
    let spawn_err = |source| ActorError::Spawn {
        name: spec.name.clone(),
        source,
    };
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args).env(CHILD_NAME_ENV, &spec.name);
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    cmd.envs(spec.env.iter().map(|(k, v)| (k, v)));
    // The node's backend, unless the spec names one.
    crate::child::inherit_backend(node.core(), &mut cmd);
    // Last, so that no spec puts the token in the environment.
    node.session()
        .pass_to(&mut cmd)
        .map_err(|e| spawn_err(std::io::Error::other(e)))?;
    let mut child: Child = baton_ipc::spawn::spawn_tied(cmd).map_err(spawn_err)?;
    let pid = child.id();
    // Not reaped yet (only its reaper waits for it), so its stat is readable.
    let start_ticks = process::start_ticks(pid).unwrap_or_else(|| {
        tracing::warn!(child = %spec.name, pid, "no start time: its segments will not be swept");
        0
    });
    let child_process = ProcessId {
        boot: process::boot_id(),
        pid,
        start_ticks,
    };
    let pidfd = rustix::process::Pid::from_raw(pid as i32)
        .ok_or_else(|| spawn_err(std::io::Error::other("pid 0")))
        .and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty())
                .map_err(|e| spawn_err(e.into()))
        });
    match pidfd {
        Ok(fd) => Ok(Spawned {
            child,
            pid,
            process: child_process,
            pidfd: Arc::new(fd),
        }),
        Err(e) => {
            // Without a pidfd it cannot be signalled safely: do not leave it running.
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

fn describe(status: Option<ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exit code {code}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => format!("{s}"),
        },
        None => "unknown".to_owned(),
    }
}

/// An actor that spawns child processes, watches them and restarts them by strategy,
/// feeding their deaths into the lease protocol (the [module docs](self) have the detail).
///
/// - **Starting:** each [`ChildSpec`] is spawned with `std::process::Command`, tied to this
///   process (it is SIGKILLed when this process dies), with the session token through an
///   inherited pipe, its name in [`CHILD_NAME_ENV`] and this node's backend
///   (`BATON_BACKEND`, and `BATON_CUDA_DEVICE`/`BATON_CUDA_EXPORT` for CUDA) unless the
///   spec sets it — as [`Node::spawn_child`] does.
/// - **Linking:** with [`link_children`](Self::link_children) each child joins in one
///   call, [`Node::join`]; the supervisor matches the link to the child by the process it
///   proved (pid and start time), announces it ([`SupervisorEvent::Linked`]) and hands it
///   out ([`ChildPeer`]). Or name a socket of your own with
///   [`connect_back`](Self::connect_back) ([`CONNECT_ENV`]) and match peers yourself.
/// - **Deaths:** a dead child's links are cut at once (leases it held reclaimed, leases it
///   granted orphaned), its named host segments swept ([`SupervisorEvent::Swept`]), and it
///   is restarted by its [`Restart`] and the [`Strategy`]; more than
///   [`RestartPolicy::max_restarts`] restarts within [`RestartPolicy::within`] escalate:
///   every child is killed and the supervisor stops ([`SupervisorEvent::Escalated`]).
///   A child whose link goes silent past the heartbeat deadline is killed
///   ([`kill_unresponsive`](Self::kill_unresponsive)).
/// - **Other hosts:** [`RemoteChildSpec`]s are started by a
///   [`ChildAgent`](agent::ChildAgent) there ([`remote_children`](Self::remote_children));
///   [`ChildRunning`] waits until one runs.
/// - **Stopping** ([`Shutdown`], or dropping every address) kills and reaps every child.
///
/// Subscribers ([`subscriber`](Self::subscriber)) get every [`SupervisorEvent`];
/// [`Children`] lists the children's states, [`KillChild`] kills one.
pub struct ProcessSupervisor {
    specs: Vec<ChildSpec>,
    strategy: Strategy,
    policy: RestartPolicy,
    node: Node,
    connect: Option<PathBuf>,
    running: HashMap<String, Running>,
    restarts: HashMap<String, u32>,
    recent: VecDeque<Instant>,
    incarnation: u64,
    watchers: Vec<Recipient<SupervisorEvent>>,
    stopping: bool,
    kill_unresponsive: bool,
    /// How each child's last run ended.
    last_exit: HashMap<String, String>,
    /// Children that ended and are not restarted (done).
    done: std::collections::HashSet<String>,
    /// The children's states as the node's status lists them (see [`publish`](Self::publish)).
    board: crate::observed::ChildBoard,
    /// Children on other hosts, and what runs of them.
    remote: remote::RemoteChildren,
    /// The children's socket and links, under `link_children`.
    links: Option<links::ChildLinks>,
    /// Callers waiting for a child to link or to run.
    waiting: links::Waiting,
    span: tracing::Span,
}

impl std::fmt::Debug for ProcessSupervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessSupervisor")
            .field("strategy", &self.strategy)
            .field("policy", &self.policy)
            .field("running", &self.running.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl ProcessSupervisor {
    /// A supervisor of `children` whose deaths are fed into `node`'s links.
    pub fn new(
        node: Node,
        children: Vec<ChildSpec>,
        strategy: Strategy,
        policy: RestartPolicy,
    ) -> Self {
        Self {
            specs: children,
            strategy,
            policy,
            node,
            connect: None,
            running: HashMap::new(),
            restarts: HashMap::new(),
            recent: VecDeque::new(),
            incarnation: 0,
            watchers: Vec::new(),
            stopping: false,
            kill_unresponsive: true,
            last_exit: HashMap::new(),
            done: std::collections::HashSet::new(),
            board: Arc::default(),
            remote: remote::RemoteChildren::default(),
            links: None,
            waiting: links::Waiting::default(),
            span: tracing::info_span!("process_supervisor"),
        }
    }

    /// Whether a child whose link goes silent past the heartbeat deadline is killed (and
    /// so restarted by the strategy). Default: yes — a stopped or deadlocked child serves
    /// nobody, and may pin memory until it dies.
    pub fn kill_unresponsive(mut self, kill: bool) -> Self {
        self.kill_unresponsive = kill;
        self
    }

    /// Tells children to connect back to this socket ([`CONNECT_ENV`]).
    pub fn connect_back(mut self, socket: impl Into<PathBuf>) -> Self {
        self.connect = Some(socket.into());
        self
    }

    /// Sends events to `recipient` from the start.
    pub fn subscriber(mut self, recipient: Recipient<SupervisorEvent>) -> Self {
        self.watchers.push(recipient);
        self
    }

    /// Puts the children's states where the node's status reads them.
    fn publish(&self) {
        let entries = self
            .specs
            .iter()
            .map(|s| {
                let running = self.running.get(&s.name);
                baton_messages::status::ChildEntry {
                    name: s.name.clone(),
                    state: self.state_of(&s.name, running.is_some()).to_owned(),
                    pid: running.map(|r| r.pid),
                    start_ticks: running.map(|r| r.process.start_ticks),
                    restarts: self.restarts.get(&s.name).copied().unwrap_or(0),
                    last_exit: self.last_exit.get(&s.name).cloned(),
                    host: None,
                    supervisor: None,
                }
            })
            .chain(self.remote_entries())
            .collect();
        *self.board.lock().unwrap_or_else(|p| p.into_inner()) = entries;
    }

    /// A child's state as the node's status lists it.
    fn state_of(&self, name: &str, running: bool) -> &'static str {
        if running {
            "running"
        } else if self.stopping {
            "stopped"
        } else if self.done.contains(name) {
            "exited"
        } else {
            "restarting"
        }
    }

    fn emit(&self, event: SupervisorEvent) {
        for w in &self.watchers {
            w.do_send(event.clone());
        }
    }

    fn spawn_child(&mut self, spec: &ChildSpec, ctx: &mut Context<Self>) -> Result<(), ActorError> {
        let spawn_err = |source| ActorError::Spawn {
            name: spec.name.clone(),
            source,
        };
        let env: Vec<(&str, std::ffi::OsString)> = self
            .connect
            .iter()
            .map(|path| (CONNECT_ENV, path.clone().into_os_string()))
            .chain(self.link_env())
            .collect();
        let Spawned {
            mut child,
            pid,
            process: child_process,
            pidfd,
        } = spawn_process(&self.node, spec, &env)?;
        self.node
            .core()
            .exports()
            .supervise(child_process, Arc::clone(&pidfd));
        self.incarnation += 1;
        let incarnation = self.incarnation;
        let addr = ctx.address();
        let name = spec.name.clone();
        let reaper = std::thread::Builder::new()
            .name(format!("reap-{name}"))
            .spawn(move || {
                let status = child.wait().ok();
                addr.do_send(ChildExited {
                    name,
                    process: child_process,
                    incarnation,
                    status,
                });
                status
            })
            .map_err(spawn_err)?;
        let restarts = self.restarts.get(&spec.name).copied().unwrap_or(0);
        tracing::info!(child = %spec.name, pid, restarts, "child started");
        self.running.insert(
            spec.name.clone(),
            Running {
                pid,
                process: child_process,
                incarnation,
                pidfd,
                reaper: Some(reaper),
            },
        );
        self.emit(SupervisorEvent::Started {
            name: spec.name.clone(),
            pid,
            process: child_process,
            restarts,
        });
        self.started_waiters(&spec.name);
        Ok(())
    }

    fn start_child(&mut self, spec: ChildSpec, ctx: &mut Context<Self>) {
        if let Err(e) = self.spawn_child(&spec, ctx) {
            tracing::error!(child = %spec.name, error = %e, "could not start child; retrying");
            // A failed start counts like a death: retry later, within the restart limit.
            ctx.run_later(Duration::from_millis(100), move |act, ctx| {
                act.on_death(&[spec.name], ctx);
            });
        }
    }

    /// Removes a dead child's named host segments (its `Drop` never ran), before any
    /// restart; tells subscribers if there were any.
    fn sweep(&self, name: &str, child: &ProcessId) {
        sweep_dead_child(&self.watchers, name, child);
    }

    fn kill(running: &Running) {
        let _ = rustix::process::pidfd_send_signal(&*running.pidfd, rustix::process::Signal::KILL);
    }

    /// Children died (or failed to start, or were lost with their agent): restart by
    /// strategy, or escalate. Each counts as one restart.
    fn on_death(&mut self, names: &[String], ctx: &mut Context<Self>) {
        if self.stopping || names.is_empty() {
            return;
        }
        let now = Instant::now();
        self.recent.extend(names.iter().map(|_| now));
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > self.policy.within)
        {
            self.recent.pop_front();
        }
        if self.recent.len() > self.policy.max_restarts as usize {
            tracing::error!(restarts = self.recent.len(), window = ?self.policy.within, "restart limit exceeded: escalating");
            self.emit(SupervisorEvent::Escalated {
                restarts: self.recent.len(),
            });
            ctx.stop();
            return;
        }
        let (to_restart, remote): (Vec<ChildSpec>, Vec<RemoteChildSpec>) = match self.strategy {
            Strategy::OneForOne => (
                self.specs
                    .iter()
                    .filter(|s| names.contains(&s.name))
                    .cloned()
                    .collect(),
                self.remote
                    .specs
                    .iter()
                    .filter(|s| names.contains(&s.name))
                    .cloned()
                    .collect(),
            ),
            Strategy::OneForAll => {
                for running in self.running.values() {
                    Self::kill(running);
                }
                // Their exits arrive later, as an older incarnation: reaped, not restarted.
                self.running.clear();
                // The same for the remote ones (their exits name ids no longer running).
                self.kill_all_remote();
                (self.specs.clone(), self.remote.specs.clone())
            }
        };
        for spec in to_restart {
            *self.restarts.entry(spec.name.clone()).or_insert(0) += 1;
            self.start_child(spec, ctx);
        }
        for spec in remote {
            *self.restarts.entry(spec.name.clone()).or_insert(0) += 1;
            self.start_remote(spec, ctx);
        }
        self.publish();
    }
}

impl Actor for ProcessSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let _g = self.span.clone().entered();
        self.node.subscribe(ctx.address().recipient());
        // The node's status lists the children for as long as this supervisor lives.
        self.node.core().observed().register_children(&self.board);
        self.accept_links(ctx);
        for spec in self.specs.clone() {
            self.start_child(spec, ctx);
        }
        self.start_remotes(ctx);
        self.publish();
    }

    /// SIGKILLs every child; a thread of its own waits for their reapers (never the
    /// arbiter), then feeds their deaths into the lease protocol and sweeps them.
    fn stopped(&mut self, _ctx: &mut Self::Context) {
        let _g = self.span.clone().entered();
        self.stopping = true;
        self.stop_remotes();
        let running: Vec<(String, Running)> = self.running.drain().collect();
        // The node's status lists them as stopped from now on.
        self.publish();
        if running.is_empty() {
            return;
        }
        for (_, running) in &running {
            Self::kill(running);
        }
        let (node, watchers, span) = (self.node.clone(), self.watchers.clone(), self.span.clone());
        let reap = move || {
            let _g = span.entered();
            for (name, mut running) in running {
                let status = running.reaper.take().and_then(|r| r.join().ok()).flatten();
                node.process_exited(running.process);
                sweep_dead_child(&watchers, &name, &running.process);
                tracing::info!(child = %name, pid = running.pid, status = %describe(status), "child stopped with the supervisor");
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("baton-supervisor-stop".to_owned())
            .spawn(reap)
        {
            tracing::warn!(error = %e, "no thread to reap the stopped children: they are reaped by their own reapers only");
        }
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct ChildExited {
    name: String,
    /// The child (reaped by now).
    process: ProcessId,
    incarnation: u64,
    status: Option<ExitStatus>,
}

impl Handler<ChildExited> for ProcessSupervisor {
    type Result = ();

    fn handle(&mut self, msg: ChildExited, ctx: &mut Self::Context) {
        let _g = self.span.clone().entered();
        // Feed the death into the lease protocol first.
        self.node.process_exited(msg.process);
        let status = describe(msg.status);
        let pid = msg.process.pid;
        self.last_exit.insert(msg.name.clone(), status.clone());
        if msg.status.is_some_and(|s| s.success()) {
            tracing::info!(child = %msg.name, pid, %status, "child exited");
        } else {
            tracing::warn!(child = %msg.name, pid, %status, "child exited");
        }
        self.emit(SupervisorEvent::Exited {
            name: msg.name.clone(),
            pid,
            process: msg.process,
            status,
        });
        // Before any restart: what a killed child left in /dev/shm goes now. A child that
        // exited cleanly ran its `Drop`s: sweeping after it could only hide a leak.
        if !msg.status.is_some_and(|s| s.success()) {
            self.sweep(&msg.name, &msg.process);
        }
        let current = self
            .running
            .get(&msg.name)
            .is_some_and(|r| r.incarnation == msg.incarnation);
        if current {
            self.running.remove(&msg.name);
            self.unlink(&msg.name);
            let restart = self
                .specs
                .iter()
                .find(|s| s.name == msg.name)
                .map_or(Restart::Permanent, |s| s.restart);
            let clean = msg.status.is_some_and(|s| s.success());
            self.after_exit(&msg.name, restart, clean, ctx);
        }
        self.publish();
    }
}

impl Handler<PeerEvent> for ProcessSupervisor {
    type Result = ();

    /// A child's link went silent: kill it (it is restarted when its exit is seen). An
    /// agent's last link went down: its children are lost.
    fn handle(&mut self, event: PeerEvent, ctx: &mut Self::Context) {
        let PeerEvent::Down { peer, reason, .. } = event else {
            return;
        };
        if self.node.peer(&peer.process).is_none() {
            self.agent_down(peer.process, reason.as_deref(), ctx);
        }
        let Some(reason) = reason else {
            return;
        };
        if !self.kill_unresponsive || !matches!(*reason, ActorError::Unresponsive { .. }) {
            return;
        }
        let _g = self.span.clone().entered();
        for (name, running) in &self.running {
            if running.process == peer.process {
                tracing::warn!(child = %name, pid = running.pid, "child unresponsive: killing it");
                Self::kill(running);
            }
        }
        // A child on another host that linked back: its agent kills it.
        self.kill_unresponsive_remote(&peer);
    }
}

impl ProcessSupervisor {
    /// A current child ended: restart it by `restart` and the strategy, or mark it done.
    fn after_exit(&mut self, name: &str, restart: Restart, clean: bool, ctx: &mut Context<Self>) {
        match restart {
            Restart::Permanent => self.on_death(&[name.to_owned()], ctx),
            Restart::Transient if !clean => self.on_death(&[name.to_owned()], ctx),
            Restart::Transient | Restart::Temporary => {
                tracing::info!(child = %name, "child done; not restarted");
                self.done.insert(name.to_owned());
                self.forget_waiters(name);
            }
        }
    }
}

/// SIGKILLs a child by name (chaos testing). Replies with the pid killed.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Option<u32>")]
pub struct KillChild(pub String);

impl Handler<KillChild> for ProcessSupervisor {
    type Result = Option<u32>;

    fn handle(&mut self, msg: KillChild, _ctx: &mut Self::Context) -> Option<u32> {
        if let Some(pid) = self.kill_remote_named(&msg.0) {
            return Some(pid);
        }
        let running = self.running.get(&msg.0)?;
        tracing::info!(child = %msg.0, pid = running.pid, "killing child");
        Self::kill(running);
        Some(running.pid)
    }
}

/// Replies with every child's state.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Vec<ChildStatus>")]
pub struct Children;

impl Handler<Children> for ProcessSupervisor {
    type Result = MessageResult<Children>;

    fn handle(&mut self, _: Children, _ctx: &mut Self::Context) -> Self::Result {
        MessageResult(
            self.specs
                .iter()
                .map(|s| ChildStatus {
                    name: s.name.clone(),
                    pid: self.running.get(&s.name).map(|r| r.pid),
                    process: self.running.get(&s.name).map(|r| r.process),
                    restarts: self.restarts.get(&s.name).copied().unwrap_or(0),
                })
                .chain(self.remote_statuses())
                .collect(),
        )
    }
}

/// Kills and reaps every child, then stops the supervisor.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Shutdown;

impl Handler<Shutdown> for ProcessSupervisor {
    type Result = ();

    fn handle(&mut self, _: Shutdown, ctx: &mut Self::Context) {
        self.stopping = true;
        ctx.stop();
    }
}
