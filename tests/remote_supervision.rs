//! Supervisors watching children on another host: a `ChildAgent` in a helper process
//! (`baton-agent-peer agent`, host `b`) starts children for a `ProcessSupervisor` (in this
//! process, host `a`, or in a helper, host `c`) over a loopback TCP host link. SIGKILL of
//! a child, of the agent, of the supervisor; refusals of what the agent does not know.
//! Every wait has a deadline; children are checked reaped (`/proc`), not just signalled.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/host_peer.rs"]
mod host_peer;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;
#[path = "support/tcp_proxy.rs"]
mod tcp_proxy;

use actix::prelude::*;
use actors::{DEADLINE, eventually, run};
use baton::Session;
use baton::actors::supervisor::agent::{
    AGENT_NAME, AgentRefusal, KillRemote, RemoteExit, SpawnRemote,
};
use baton::actors::{
    ChildRunning, Children, Heartbeat, HostSettings, Node, NodeConfig, ProcessSupervisor,
    RemoteChildSpec, RestartPolicy, Shutdown, Strategy, SupervisorEvent, TcpListening,
};
use baton::ipc::HostBackend;
use baton::ipc::tcp::HostId;
use host_peer::{Lines, read_lines};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The heartbeat deadline of every node here (helpers too): short enough for the tests
/// that wait for it, long enough that a loaded 2-core machine does not cut a link.
const HEARTBEAT: Duration = Duration::from_secs(3);

/// When a test ends, the segments its killed helpers left in its namespace go.
struct Sweep(String);

impl Drop for Sweep {
    fn drop(&mut self) {
        let _ = baton::ipc::host::sweep(&self.0);
    }
}

fn heartbeat() -> Heartbeat {
    Heartbeat {
        interval: HEARTBEAT / 4,
        deadline: HEARTBEAT,
    }
}

/// A node of this process on host `host`.
fn node(session: &Session, host: &str, ns: &str) -> Node {
    let config = NodeConfig::new(session.clone())
        .hosts(HostSettings {
            host: HostId::named(host),
            ..HostSettings::default()
        })
        .heartbeat(heartbeat());
    Node::with_config(config, Arc::new(HostBackend::with_namespace(ns).unwrap()))
}

/// `baton-agent-peer ARGS` on host `host`; its stdout's lines.
fn helper(session: &Session, ns: &str, host: &str, args: &[&str]) -> (peer::Peer, Lines) {
    let heartbeat_ms = HEARTBEAT.as_millis().to_string();
    let mut argv = args.to_vec();
    argv.extend(["--heartbeat-ms", heartbeat_ms.as_str()]);
    let mut child = peer::Peer::spawn_with(
        peer::exe("baton-agent-peer"),
        session,
        ns,
        &argv,
        &[(baton::ipc::tcp::HOST_ID_ENV, host)],
        true,
    );
    let lines = read_lines(&mut child, format!("baton-agent-peer {args:?}"));
    (child, lines)
}

/// An agent on host `b` listening at `at` (port 0: any); its address.
async fn agent(
    session: &Session,
    ns: &str,
    at: &str,
    extra: &[&str],
) -> (peer::Peer, Lines, SocketAddr) {
    let mut args = vec!["agent", at];
    args.extend_from_slice(extra);
    let (child, lines) = helper(session, ns, "b", &args);
    let addr = lines.expect("listening ", DEADLINE).await;
    (child, lines, addr.parse().expect("an address"))
}

/// What each test starts with: a session, a segment namespace swept at the end, an agent
/// (host `b`) and a node of this process (host `a`).
struct Setup {
    session: Session,
    ns: String,
    _sweep: Sweep,
    agent: peer::Peer,
    _lines: Lines,
    at: SocketAddr,
    a: Node,
}

async fn setup(test: &str, agent_args: &[&str]) -> Setup {
    let session = Session::generate().unwrap();
    let ns = peer::namespace(test);
    let _sweep = Sweep(ns.clone());
    let (agent, _lines, at) = agent(&session, &ns, "127.0.0.1:0", agent_args).await;
    let a = node(&session, "a", &ns);
    Setup {
        session,
        ns,
        _sweep,
        agent,
        _lines,
        at,
        a,
    }
}

/// Records a supervisor's events.
#[derive(Clone, Default)]
struct Recorded(Arc<Mutex<Vec<SupervisorEvent>>>);

/// Keeps every message of type `T` it gets (a supervisor's events, an inbox's exits).
struct Collect<T>(Arc<Mutex<Vec<T>>>);

impl<T: Unpin + 'static> Actor for Collect<T> {
    type Context = Context<Self>;
}

impl<T: Message<Result = ()> + Unpin + 'static> Handler<T> for Collect<T> {
    type Result = ();
    fn handle(&mut self, msg: T, _: &mut Context<Self>) {
        self.0.lock().unwrap().push(msg);
    }
}

impl Recorded {
    fn all(&self) -> Vec<SupervisorEvent> {
        self.0.lock().unwrap().clone()
    }

    /// Waits for the `n`th event (from 1) that `pick` takes; its value.
    async fn nth<T>(
        &self,
        n: usize,
        deadline: Duration,
        what: &str,
        pick: impl Fn(&SupervisorEvent) -> Option<T>,
    ) -> T {
        let start = Instant::now();
        loop {
            if let Some(found) = self.all().iter().filter_map(&pick).nth(n - 1) {
                return found;
            }
            assert!(
                start.elapsed() < deadline,
                "no {what} (#{n}) within {deadline:?}; events: {:?}",
                self.all()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The `n`th start of `name`: its pid and restarts.
    async fn started(&self, n: usize, name: &str) -> (u32, u32) {
        self.nth(n, DEADLINE, &format!("start of {name}"), |e| match e {
            SupervisorEvent::Started {
                name: started,
                pid,
                restarts,
                ..
            } if started == name => Some((*pid, *restarts)),
            _ => None,
        })
        .await
    }
}

fn signal(pid: u32, signal: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(pid, signal).unwrap();
}

fn sigkill(pid: u32) {
    signal(pid, rustix::process::Signal::KILL);
}

fn sigstop(pid: u32) {
    signal(pid, rustix::process::Signal::STOP);
}

/// The children the agent's node lists (name, pid, supervisor), asked over our link.
async fn agent_children(a: &Node) -> Vec<(String, Option<u32>, Option<String>)> {
    let tree = a.tree_status(0).await;
    tree.links
        .iter()
        .filter_map(|l| l.status.as_ref())
        .flat_map(|s| s.children.iter())
        .map(|c| (c.name.clone(), c.pid, c.supervisor.clone()))
        .collect()
}

/// Whether `pid` runs (not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

/// Whether `pid` is gone, reaped (no zombie left); the tests run no long enough for a
/// pid to be reused.
fn gone(pid: u32) -> bool {
    std::fs::metadata(format!("/proc/{pid}")).is_err()
}

/// A supervisor of `children` on `node`, recording its events.
fn supervisor(
    node: &Node,
    children: Vec<RemoteChildSpec>,
    policy: RestartPolicy,
    connect_back: Option<SocketAddr>,
) -> (Addr<ProcessSupervisor>, Recorded) {
    let recorded = Recorded::default();
    let mut sup = ProcessSupervisor::new(node.clone(), Vec::new(), Strategy::OneForOne, policy)
        .remote_children(children)
        .subscriber(Collect(Arc::clone(&recorded.0)).start().recipient());
    if let Some(addr) = connect_back {
        sup = sup.connect_back_tcp(addr);
    }
    (sup.start(), recorded)
}

/// A supervisor on `a` of one child `worker`, the agent's `sleeper` at `at`, told to link
/// back to `a`; once it has: where `a` listens, the supervisor, its events, the child's pid.
async fn linked_worker(
    a: &Node,
    at: SocketAddr,
) -> (TcpListening, Addr<ProcessSupervisor>, Recorded, u32) {
    let listening = a.listen_tcp("127.0.0.1:0").unwrap();
    let (sup, events) = supervisor(
        a,
        vec![RemoteChildSpec::new("worker", at, "sleeper")],
        RestartPolicy::default(),
        Some(listening.local_addr()),
    );
    let (first, restarts) = events.started(1, "worker").await;
    assert_eq!(restarts, 0);
    // It runs on the agent's "host" and linked back to us over TCP.
    eventually(DEADLINE, "the child linked back", || {
        a.peers().iter().any(|p| {
            p.process().pid == first && p.info().host().map(|h| h.host) == Some(HostId::named("b"))
        })
    })
    .await;
    (listening, sup, events, first)
}

#[test]
fn a_remote_child_sigkilled_is_reported_and_restarted_by_its_supervisor() {
    run(async {
        let t = setup("rs-kill", &[]).await;
        let (a, at) = (t.a.clone(), t.at);
        let (_listening, sup, events, first) = linked_worker(&a, at).await;
        sigkill(first);
        let status = events
            .nth(1, DEADLINE, "exit of worker", |e| match e {
                SupervisorEvent::Exited {
                    name, pid, status, ..
                } if name == "worker" => Some((*pid, status.clone())),
                _ => None,
            })
            .await;
        assert_eq!(status, (first, "killed by signal 9".to_owned()));
        let (second, restarts) = events.started(2, "worker").await;
        assert_eq!(restarts, 1);
        assert_ne!(second, first);
        eventually(DEADLINE, "the killed child reaped by the agent", || {
            gone(first)
        })
        .await;
        let children = sup.send(Children).await.unwrap();
        assert_eq!(children.len(), 1);
        assert_eq!((children[0].pid, children[0].restarts), (Some(second), 1));
        // The node's status lists it with its agent's address.
        let status = a.status(0);
        let listed: Vec<_> = status
            .children
            .iter()
            .filter(|c| c.name == "worker")
            .collect();
        assert_eq!(listed.len(), 1, "{:?}", status.children);
        assert_eq!(listed[0].state, "running");
        assert_eq!(listed[0].pid, Some(second));
        assert_eq!(listed[0].host, Some(at.to_string()));
        assert_eq!(listed[0].last_exit.as_deref(), Some("killed by signal 9"));
        // Stopping the supervisor kills its remote children too.
        sup.send(Shutdown).await.unwrap();
        eventually(DEADLINE, "the child killed with its supervisor", || {
            gone(second)
        })
        .await;
        assert!(
            !events
                .all()
                .iter()
                .any(|e| matches!(e, SupervisorEvent::Escalated { .. })),
            "{:?}",
            events.all()
        );
    });
}

#[test]
fn an_agent_refuses_what_it_does_not_know_typed_and_the_link_is_unharmed() {
    run(async {
        let t = setup("rs-refuse", &["--limit", "1"]).await;
        let (a, at) = (t.a.clone(), t.at);
        let exits = Arc::new(Mutex::new(Vec::new()));
        a.register::<RemoteExit>(
            "test.inbox",
            Collect::<RemoteExit>(Arc::clone(&exits))
                .start()
                .recipient(),
        );
        let link = tokio::time::timeout(DEADLINE, a.connect_tcp(at))
            .await
            .unwrap()
            .unwrap();
        let spawn = |spec: &str, name: &str, connect_tcp: Option<&str>| {
            let agent = link.remote::<SpawnRemote>(AGENT_NAME);
            let request = SpawnRemote {
                spec: spec.to_owned(),
                name: name.to_owned(),
                connect_tcp: connect_tcp.map(str::to_owned),
                inbox: "test.inbox".to_owned(),
            };
            async move { agent.send_timeout(request, DEADLINE).await }
        };
        // A program path is not a spec name: the agent runs only what its owner listed.
        for spec in ["/bin/sh", "sleeper --evil", ""] {
            let refused = spawn(spec, "w", None).await.expect("an answer");
            assert_eq!(
                refused,
                Err(AgentRefusal::UnknownSpec {
                    spec: spec.to_owned(),
                    known: vec!["exit3".to_owned(), "sleeper".to_owned()],
                })
            );
        }
        let bad_addr = spawn("sleeper", "w", Some("not an address")).await.unwrap();
        assert!(
            matches!(bad_addr, Err(AgentRefusal::BadRequest { .. })),
            "{bad_addr:?}"
        );
        let long = "x".repeat(1000);
        let bad_name = spawn("sleeper", &long, None).await.unwrap();
        assert!(
            matches!(bad_name, Err(AgentRefusal::BadRequest { .. })),
            "{bad_name:?}"
        );
        let no_child = link
            .remote::<KillRemote>(AGENT_NAME)
            .send_timeout(KillRemote { id: 999 }, DEADLINE)
            .await
            .unwrap();
        assert_eq!(no_child, Err(AgentRefusal::NoSuchChild { id: 999 }));
        // The link is unharmed: a good request works, up to the limit.
        let child = spawn("sleeper", "w", None).await.unwrap().expect("started");
        assert!(alive(child.pid));
        // The agent's node lists it, with the supervisor it runs for.
        let listed = agent_children(&a).await;
        assert_eq!(
            listed,
            vec![(
                "w".to_owned(),
                Some(child.pid),
                Some(a.session().process().to_string())
            )]
        );
        let over = spawn("sleeper", "w2", None).await.unwrap();
        assert_eq!(over, Err(AgentRefusal::TooManyChildren { limit: 1 }));
        assert!(alive(child.pid));
        assert!(link.is_connected());
        tokio::time::timeout(DEADLINE, link.ping())
            .await
            .unwrap()
            .expect("the link answers");
        // Ours may: its exit comes back to our inbox.
        link.remote::<KillRemote>(AGENT_NAME)
            .send_timeout(KillRemote { id: child.id }, DEADLINE)
            .await
            .unwrap()
            .expect("killed");
        eventually(DEADLINE, "the exit reported", || {
            !exits.lock().unwrap().is_empty()
        })
        .await;
        {
            let exits = exits.lock().unwrap();
            assert_eq!(exits.len(), 1);
            assert_eq!(exits[0].id, child.id);
            assert_eq!(exits[0].status, "killed by signal 9");
            assert!(!exits[0].clean);
        }
        eventually(DEADLINE, "the child reaped", || gone(child.pid)).await;
        assert_eq!(agent_children(&a).await, Vec::new());
        // A child that exits on its own is reported with its code.
        let exit3 = spawn("exit3", "w3", None).await.unwrap().expect("started");
        eventually(DEADLINE, "the second exit reported", || {
            exits.lock().unwrap().len() == 2
        })
        .await;
        let second = exits.lock().unwrap()[1].clone();
        assert_eq!(
            (second.id, second.status.as_str()),
            (exit3.id, "exit code 3")
        );
    });
}

#[test]
fn sigkill_of_the_agent_counts_its_children_lost_and_they_restart_when_it_is_back() {
    run(async {
        let mut t = setup("rs-agent", &[]).await;
        let (a, at) = (t.a.clone(), t.at);
        let (sup, events) = supervisor(
            &a,
            vec![
                RemoteChildSpec::new("w0", at, "sleeper"),
                RemoteChildSpec::new("w1", at, "sleeper"),
            ],
            // Enough for the attempts while the agent is away (one per 200 ms).
            RestartPolicy {
                max_restarts: 500,
                within: Duration::from_secs(60),
            },
            None,
        );
        let (p0, _) = events.started(1, "w0").await;
        let (p1, _) = events.started(1, "w1").await;
        t.agent.kill9();
        // Each lost, by its own pid, as a clean end of stream (the kernel ends it at once;
        // the deadline leaves a loaded machine room, the heartbeat is not what tells).
        for (name, pid) in [("w0", p0), ("w1", p1)] {
            let lost = events
                .nth(1, HEARTBEAT + DEADLINE, "lost", |e| match e {
                    SupervisorEvent::Lost {
                        name: n,
                        pid,
                        reason,
                        ..
                    } if n == name => Some((*pid, reason.clone())),
                    _ => None,
                })
                .await;
            assert_eq!(lost, (pid, None), "{name}");
        }
        // The agent's children died with it (PR_SET_PDEATHSIG); orphans now, whoever
        // adopted them reaps them.
        eventually(DEADLINE, "the agent's children dead", || {
            !alive(p0) && !alive(p1)
        })
        .await;
        // While it is away, each restart fails and is tried again.
        events
            .nth(1, DEADLINE, "a failed start", |e| {
                matches!(e, SupervisorEvent::StartFailed { .. }).then_some(())
            })
            .await;
        // Back at the same address: both are started there again.
        let (_agent2, _lines2, again) = agent(&t.session, &t.ns, &at.to_string(), &[]).await;
        assert_eq!(again, at);
        let (q0, r0) = events.started(2, "w0").await;
        let (q1, r1) = events.started(2, "w1").await;
        assert!(r0 >= 1 && r1 >= 1);
        assert!(alive(q0) && alive(q1));
        sup.send(Shutdown).await.unwrap();
        eventually(
            DEADLINE,
            "the new children killed with the supervisor",
            || gone(q0) && gone(q1),
        )
        .await;
    });
}

#[test]
fn an_agent_that_stays_away_makes_the_supervisor_escalate() {
    run(async {
        let mut t = setup("rs-escalate", &[]).await;
        let (a, at) = (t.a.clone(), t.at);
        let (sup, events) = supervisor(
            &a,
            vec![RemoteChildSpec::new("w0", at, "sleeper")],
            RestartPolicy {
                max_restarts: 3,
                within: Duration::from_secs(60),
            },
            None,
        );
        let (p0, _) = events.started(1, "w0").await;
        t.agent.kill9();
        events
            .nth(1, HEARTBEAT + DEADLINE, "escalation", |e| match e {
                SupervisorEvent::Escalated { restarts } => Some(*restarts),
                _ => None,
            })
            .await;
        eventually(DEADLINE, "the supervisor stopped", || !sup.connected()).await;
        // Lost once, its own pid, by the end of the agent's stream.
        let all = events.all();
        let lost: Vec<_> = all
            .iter()
            .filter_map(|e| match e {
                SupervisorEvent::Lost {
                    name, pid, reason, ..
                } => Some((name.as_str(), *pid, reason.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(lost, vec![("w0", p0, None)], "{all:?}");
    });
}

#[test]
fn sigkill_of_the_supervisor_makes_the_agent_kill_and_reap_its_children() {
    run(async {
        let t = setup("rs-sup", &[]).await;
        let (a, at) = (t.a.clone(), t.at);
        let at_s = at.to_string();
        let (mut sup, sup_lines) = helper(
            &t.session,
            &t.ns,
            "c",
            &["supervise", at_s.as_str(), "--count", "2"],
        );
        let mut pids = Vec::new();
        for _ in 0..2 {
            let line = sup_lines.expect("started ", DEADLINE).await;
            let (_, pid) = line.split_once(' ').expect("name pid");
            pids.push(pid.parse::<u32>().expect("a pid"));
        }
        for pid in &pids {
            assert!(alive(*pid), "child {pid} runs");
        }
        sup.kill9();
        eventually(
            HEARTBEAT + DEADLINE,
            "the agent killed and reaped its children",
            || pids.iter().all(|p| gone(*p)),
        )
        .await;
        // The agent goes on serving others.
        let link = tokio::time::timeout(DEADLINE, a.connect_tcp(at))
            .await
            .unwrap()
            .unwrap();
        let child = link
            .remote::<SpawnRemote>(AGENT_NAME)
            .send_timeout(
                SpawnRemote {
                    spec: "sleeper".to_owned(),
                    name: "after".to_owned(),
                    connect_tcp: None,
                    inbox: "nobody".to_owned(),
                },
                DEADLINE,
            )
            .await
            .unwrap()
            .expect("started");
        // Closing our link kills it as well.
        tokio::time::timeout(DEADLINE, link.close_and_wait())
            .await
            .unwrap();
        eventually(DEADLINE, "the child killed with our link", || {
            gone(child.pid)
        })
        .await;
    });
}

#[test]
fn a_silent_partition_loses_the_children_on_both_sides_by_the_heartbeat() {
    run(async {
        let t = setup("rs-part", &[]).await;
        let (a, at) = (t.a.clone(), t.at);
        // Our link to the agent goes through a proxy on 127.0.0.2.
        let proxy = tcp_proxy::Proxy::new();
        let via = proxy.route(SocketAddr::new("127.0.0.2".parse().unwrap(), 0), at, false);
        let (sup, events) = supervisor(
            &a,
            vec![RemoteChildSpec::new("w0", via, "sleeper")],
            RestartPolicy {
                max_restarts: 100,
                within: Duration::from_secs(60),
            },
            None,
        );
        let (pid, _) = events.started(1, "w0").await;
        // Silence, both ends open: only the heartbeats can tell.
        proxy.partition();
        let (lost, agent, reason) = events
            .nth(1, 2 * HEARTBEAT + DEADLINE, "lost", |e| match e {
                SupervisorEvent::Lost {
                    name,
                    pid,
                    agent,
                    reason,
                    ..
                } if name == "w0" => Some((*pid, *agent, reason.clone())),
                _ => None,
            })
            .await;
        assert_eq!(lost, pid);
        // Cut by our heartbeat: the agent, silent past the deadline (`Unresponsive`).
        let reason = reason.expect("cut, not a clean close");
        let (silent, rest) = reason
            .strip_prefix(&format!("{agent} sent nothing for "))
            .and_then(|r| r.split_once(": "))
            .unwrap_or_else(|| panic!("not the heartbeat's cut: {reason}"));
        assert_eq!(rest, "cut as unresponsive", "{reason}");
        assert!(silent.ends_with('s'), "a duration: {reason}");
        // The agent's heartbeat cut its end too: it killed and reaped the child.
        eventually(
            2 * HEARTBEAT + DEADLINE,
            "the agent killed the partitioned supervisor's child",
            || gone(pid),
        )
        .await;
        sup.send(Shutdown).await.unwrap();
    });
}

#[test]
fn a_remote_child_that_stops_answering_is_killed_through_its_agent_and_restarted() {
    run(async {
        let t = setup("rs-stop", &[]).await;
        let (a, at) = (t.a.clone(), t.at);
        let (_listening, sup, events, first) = linked_worker(&a, at).await;
        // Stopped, it answers no ping: our heartbeat cuts its link, and the supervisor has
        // its agent kill it (a stopped process dies of SIGKILL).
        sigstop(first);
        let status = events
            .nth(1, 2 * HEARTBEAT + DEADLINE, "exit of worker", |e| match e {
                SupervisorEvent::Exited { name, status, .. } if name == "worker" => {
                    Some(status.clone())
                }
                _ => None,
            })
            .await;
        assert_eq!(status, "killed by signal 9");
        let (second, restarts) = events.started(2, "worker").await;
        assert_eq!(restarts, 1);
        assert_ne!(second, first);
        eventually(DEADLINE, "the stopped child reaped", || gone(first)).await;
        sup.send(Shutdown).await.unwrap();
        eventually(DEADLINE, "the child killed with its supervisor", || {
            gone(second)
        })
        .await;
    });
}

/// A loopback address no one listens at now (the port of a listener just closed).
fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// Issue 50: an agent that comes up after its supervisor started does not use up the
/// restart limit: the start is retried, uncounted, within the spec's readiness window, and
/// `ChildRunning` answers once the child runs there.
#[test]
fn an_agent_that_comes_up_late_gets_its_child_started_without_counting_restarts() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("rs-late");
        let _sweep = Sweep(ns.clone());
        let a = node(&session, "a", &ns);
        let at = free_addr();
        let (sup, events) = supervisor(
            &a,
            vec![RemoteChildSpec::new("late", at, "sleeper").ready_within(DEADLINE)],
            // Not one restart: the tries before the agent is up must not count.
            RestartPolicy {
                max_restarts: 0,
                within: Duration::from_secs(60),
            },
            None,
        );
        // Tried before the agent is there.
        events
            .nth(2, DEADLINE, "failed starts", |e| {
                matches!(e, SupervisorEvent::StartFailed { .. }).then_some(())
            })
            .await;
        let (_agent, _lines, up) = agent(&session, &ns, &at.to_string(), &[]).await;
        assert_eq!(up, at);
        let running = sup
            .send(ChildRunning::new("late", DEADLINE))
            .await
            .unwrap()
            .expect("the child runs once its agent is up");
        let pid = running.pid.expect("a pid");
        assert_eq!(running.restarts, 0, "uncounted tries are no restarts");
        assert_eq!(events.started(1, "late").await, (pid, 0));
        assert!(
            !events
                .all()
                .iter()
                .any(|e| matches!(e, SupervisorEvent::Escalated { .. })),
            "{:?}",
            events.all()
        );
        sup.send(Shutdown).await.unwrap();
        eventually(DEADLINE, "the child killed with its supervisor", || {
            gone(pid)
        })
        .await;
    });
}

/// Issue 50: an agent that never comes up ends in an error within the stated bound: past
/// its readiness window the failed starts count, the supervisor escalates, and a caller
/// waiting for the child hears it will not run.
#[test]
fn an_agent_that_never_comes_up_ends_in_escalation_and_an_error_for_who_waits() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("rs-never");
        let _sweep = Sweep(ns.clone());
        let a = node(&session, "a", &ns);
        let at = free_addr();
        let (sup, events) = supervisor(
            &a,
            vec![RemoteChildSpec::new("never", at, "sleeper").ready_within(Duration::from_secs(1))],
            RestartPolicy {
                max_restarts: 2,
                within: Duration::from_secs(60),
            },
            None,
        );
        let waited = sup.send(ChildRunning::new("never", DEADLINE)).await;
        assert!(!matches!(waited, Ok(Ok(_))), "{waited:?}");
        let restarts = events
            .nth(1, DEADLINE, "escalation", |e| match e {
                SupervisorEvent::Escalated { restarts } => Some(*restarts),
                _ => None,
            })
            .await;
        assert_eq!(restarts, 3);
        eventually(DEADLINE, "the supervisor stopped", || !sup.connected()).await;
        assert!(
            !events
                .all()
                .iter()
                .any(|e| matches!(e, SupervisorEvent::Started { .. }))
        );
    });
}
