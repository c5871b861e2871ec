//! Supervision: a process supervisor restarts a SIGKILLed exporter while the importer's
//! leases turn orphaned; restart limits escalate; one-for-all restarts all; a child that
//! keeps a revoked lease is killed where its owner's `RevokePolicy` says so; actix's own
//! `Supervisor` restarts an actor in process without losing its registration; children of a
//! supervisor that links them join with `Node::join` and are matched by their proven process.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/api_msgs.rs"]
mod api_msgs;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, Parent, eventually, exited, run};
use api_msgs::WhichBackend;
use baton::actors::supervisor::{KillChild, Shutdown};
use baton::actors::{
    ActorError, Allocate, Buffer, BufferOwner, ChildPeer, ChildSpec, Children, Lease, Node,
    PARENT_SOCKET_ENV, ProcessSupervisor, RemoteMessage, RestartPolicy, Revoke, RevokePolicy,
    Strategy, SupervisorEvent,
};
use baton::ipc::{HostBackend, host};
use baton::messages::ProcessId;
use msgs::*;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default, Clone)]
struct SupEvents(Arc<Mutex<Vec<SupervisorEvent>>>);

struct SupLog(SupEvents);

impl Actor for SupLog {
    type Context = Context<Self>;
}

impl Handler<SupervisorEvent> for SupLog {
    type Result = ();
    fn handle(&mut self, msg: SupervisorEvent, _: &mut Context<Self>) {
        self.0.0.lock().unwrap().push(msg);
    }
}

impl SupEvents {
    fn all(&self) -> Vec<SupervisorEvent> {
        self.0.lock().unwrap().clone()
    }

    fn started(&self) -> Vec<(String, u32, u32)> {
        self.all()
            .into_iter()
            .filter_map(|e| match e {
                SupervisorEvent::Started {
                    name,
                    pid,
                    restarts,
                    ..
                } => Some((name, pid, restarts)),
                _ => None,
            })
            .collect()
    }
}

fn peer_spec(parent: &Parent, name: &str, role: &str) -> ChildSpec {
    let spec = ChildSpec::new(name, peer::exe("baton-actor-peer"))
        .arg(role)
        .env(host::NAMESPACE_ENV, &parent.ns);
    // The parent's backend for the children too (a host-only parent cannot map CUDA buffers).
    parent
        .child_env
        .iter()
        .fold(spec, |spec, (k, v)| spec.env(k, v))
}

fn supervise(
    parent: &Parent,
    specs: Vec<ChildSpec>,
    strategy: Strategy,
    policy: RestartPolicy,
) -> (Addr<ProcessSupervisor>, SupEvents) {
    let events = SupEvents::default();
    let sup = ProcessSupervisor::new(parent.node.clone(), specs, strategy, policy)
        .connect_back(parent.listening.path())
        .subscriber(SupLog(events.clone()).start().recipient())
        .start();
    (sup, events)
}

fn gone(pid: u32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Issue test 6: exporter SIGKILL orphans the importer's leases; the supervisor restarts
/// the exporter; new exports work; nothing leaks and no zombie is left.
#[test]
fn exporter_sigkill_orphans_leases_and_the_supervisor_restarts_it() {
    run(async {
        let parent = Parent::start("sup6");
        let (sup, events) = supervise(
            &parent,
            vec![peer_spec(&parent, "exporter", "serve")],
            Strategy::OneForOne,
            RestartPolicy {
                max_restarts: 3,
                within: Duration::from_secs(10),
            },
        );
        eventually(DEADLINE, "the exporter's link", || {
            parent.events.ups().len() == 1
        })
        .await;
        let first = parent.events.ups()[0].clone();
        let pid1 = first.process().pid;

        let made = first
            .remote::<MakeBuffers>("exporter")
            .send(MakeBuffers {
                n: 2,
                len: 1024,
                seed: 11,
            })
            .await
            .unwrap();
        let leases: Vec<Lease<u32>> = made
            .buffers
            .into_iter()
            .map(|s| s.open().unwrap())
            .collect();
        for lease in &leases {
            assert_eq!(lease.to_vec().unwrap()[5], pattern(11, 5));
        }
        assert_eq!(parent.segments(), 2, "the exporter's two segments");

        assert_eq!(
            sup.send(KillChild("exporter".into())).await.unwrap(),
            Some(pid1)
        );
        eventually(DEADLINE, "the leases to turn orphaned", || {
            leases.iter().all(Lease::is_orphaned)
        })
        .await;
        assert!(
            matches!(leases[0].to_vec(), Err(ActorError::Orphaned { exporter }) if exporter.pid == pid1)
        );
        assert!(matches!(leases[1].ptr(), Err(ActorError::Orphaned { .. })));

        eventually(DEADLINE, "the restarted exporter's link", || {
            parent.events.ups().iter().any(|p| p.process().pid != pid1)
        })
        .await;
        let second = parent
            .events
            .ups()
            .into_iter()
            .find(|p| p.process().pid != pid1)
            .unwrap();
        let made = second
            .remote::<MakeBuffers>("exporter")
            .send(MakeBuffers {
                n: 1,
                len: 64,
                seed: 12,
            })
            .await
            .unwrap();
        let fresh = made.buffers.into_iter().next().unwrap().open().unwrap();
        assert_eq!(
            fresh.to_vec().unwrap(),
            (0..64).map(|i| pattern(12, i)).collect::<Vec<_>>()
        );

        drop(leases); // orphaned: no Release to send, the mappings just close
        drop(fresh);
        let started = events.started();
        assert_eq!(started.len(), 2);
        assert_eq!(
            (started[1].0.as_str(), started[1].2),
            ("exporter", 1),
            "one restart"
        );
        assert!(events.all().iter().any(|e| matches!(e, SupervisorEvent::Exited { pid, status, .. } if *pid == pid1 && status.contains("signal 9"))));

        sup.send(Shutdown).await.unwrap();
        let pid2 = second.process().pid;
        eventually(DEADLINE, "both children reaped", || {
            gone(pid1) && gone(pid2)
        })
        .await;
        // A reaped child's link may still be ending (its end of stream or its pidfd not
        // handled yet); the warm mapping it kept goes when it has.
        eventually(DEADLINE, "no mapping left in the importer", || {
            parent.node.cache().stats().live == 0
        })
        .await;
        // SIGKILL skipped the children's Drop: the supervisor swept their segments, the
        // first child's before it restarted it (the second's once it has reaped it, which
        // `gone` may see first).
        eventually(DEADLINE, "no segment left", || parent.segments() == 0).await;
        let swept: Vec<(u32, usize)> = events
            .all()
            .into_iter()
            .filter_map(|e| match e {
                SupervisorEvent::Swept { pid, segments, .. } => Some((pid, segments)),
                _ => None,
            })
            .collect();
        assert_eq!(swept[0], (pid1, 2), "the killed exporter's two segments");
        let all = events.all();
        let position = |f: &dyn Fn(&SupervisorEvent) -> bool| all.iter().position(f).unwrap();
        assert!(
            position(&|e| matches!(e, SupervisorEvent::Swept { pid, .. } if *pid == pid1))
                < position(&|e| matches!(e, SupervisorEvent::Started { restarts: 1, .. })),
            "swept before the restart: {all:?}"
        );
        assert_eq!(
            host::sweep(&parent.ns).unwrap().removed.len(),
            0,
            "nothing left to sweep"
        );
    });
}

#[test]
fn too_many_restarts_in_the_window_escalate() {
    run(async {
        let parent = Parent::start("esc");
        let (sup, events) = supervise(
            &parent,
            vec![peer_spec(&parent, "crasher", "no-such-role")],
            Strategy::OneForOne,
            RestartPolicy {
                max_restarts: 2,
                within: Duration::from_secs(30),
            },
        );
        eventually(DEADLINE, "escalation", || {
            events
                .all()
                .iter()
                .any(|e| matches!(e, SupervisorEvent::Escalated { .. }))
        })
        .await;
        assert_eq!(
            events.started().len(),
            3,
            "the first start and two restarts"
        );
        eventually(DEADLINE, "the supervisor to stop", || !sup.connected()).await;
        for (_, pid, _) in events.started() {
            eventually(DEADLINE, "children reaped", || gone(pid)).await;
        }
    });
}

/// The restart limit counts deaths *within the window*: deaths spread over more than the
/// window never escalate, however many. And a killed child that left no segments brings
/// no `Swept` event (the sweep found nothing). Each fails under a mutation
/// `bench/mutants.sh supervisor` left alive (docs/mutants/supervisor).
#[test]
fn restarts_spread_wider_than_the_window_do_not_escalate_and_nothing_swept_is_not_reported() {
    run(async {
        let parent = Parent::start("window");
        let window = Duration::from_millis(300);
        let (sup, events) = supervise(
            &parent,
            vec![peer_spec(&parent, "svc", "serve")],
            Strategy::OneForOne,
            RestartPolicy {
                max_restarts: 1,
                within: window,
            },
        );
        eventually(DEADLINE, "the first start", || events.started().len() == 1).await;
        for n in 1..=3 {
            // Each death comes more than a window after the one before it.
            tokio::time::sleep(window + Duration::from_millis(150)).await;
            assert!(sup.send(KillChild("svc".into())).await.unwrap().is_some());
            eventually(DEADLINE, "the restart", || events.started().len() == n + 1).await;
        }
        let all = events.all();
        assert!(
            !all.iter()
                .any(|e| matches!(e, SupervisorEvent::Escalated { .. })),
            "one death per window never exceeds max_restarts 1: {all:?}"
        );
        assert!(sup.connected(), "the supervisor still runs");
        // `Swept` comes before the restart's `Started` when there is one: none here.
        assert!(
            !all.iter()
                .any(|e| matches!(e, SupervisorEvent::Swept { .. })),
            "a child that made no segments is not reported swept: {all:?}"
        );
        sup.send(Shutdown).await.unwrap();
        for (_, pid, _) in events.started() {
            eventually(DEADLINE, "children reaped", || gone(pid)).await;
        }
    });
}

#[test]
fn one_for_all_restarts_every_child() {
    run(async {
        let parent = Parent::start("ofa");
        let (sup, events) = supervise(
            &parent,
            vec![
                peer_spec(&parent, "a", "serve"),
                peer_spec(&parent, "b", "serve"),
            ],
            Strategy::OneForAll,
            RestartPolicy::default(),
        );
        eventually(DEADLINE, "two links", || parent.events.ups().len() == 2).await;
        let first: Vec<u32> = events.started().iter().map(|s| s.1).collect();
        sup.send(KillChild("a".into())).await.unwrap();
        eventually(DEADLINE, "both restarted", || events.started().len() == 4).await;
        let restarted = &events.started()[2..];
        assert!(
            restarted
                .iter()
                .all(|(_, pid, restarts)| !first.contains(pid) && *restarts == 1)
        );
        eventually(DEADLINE, "four links seen, two up", || {
            parent.events.ups().len() == 4 && parent.node.peers().len() == 2
        })
        .await;
        for pid in first {
            eventually(DEADLINE, "old children reaped", || gone(pid)).await;
        }
        sup.send(Shutdown).await.unwrap();
    });
}

// In-process restarts with actix's Supervisor.

#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "u32")]
struct Incarnation;

impl RemoteMessage for Incarnation {
    const NAME: &'static str = "test.Incarnation";
}

#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "()")]
struct Crash;

impl RemoteMessage for Crash {
    const NAME: &'static str = "test.Crash";
}

struct Flaky {
    incarnation: u32,
}

impl Actor for Flaky {
    type Context = Context<Self>;
}

impl Supervised for Flaky {
    fn restarting(&mut self, _: &mut Context<Self>) {
        self.incarnation += 1;
    }
}

impl Handler<Incarnation> for Flaky {
    type Result = u32;
    fn handle(&mut self, _: Incarnation, _: &mut Context<Self>) -> u32 {
        self.incarnation
    }
}

impl Handler<Crash> for Flaky {
    type Result = ();
    fn handle(&mut self, _: Crash, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

#[test]
fn an_actix_supervisor_restarts_a_registered_actor_in_process() {
    run(async {
        let parent = Parent::start("ipsup");
        let flaky = Supervisor::start(|_| Flaky { incarnation: 0 });
        parent
            .node
            .register::<Incarnation>("flaky", flaky.clone().recipient());
        parent
            .node
            .register::<Crash>("flaky.crash", flaky.recipient());

        // A second node in this process calls it over a real link.
        let caller = Node::new(
            parent.session.clone(),
            Arc::new(HostBackend::with_namespace(&parent.ns).unwrap()),
        );
        let peer = caller.connect(parent.listening.path()).await.unwrap();
        let ask = peer.remote::<Incarnation>("flaky");
        assert_eq!(ask.send(Incarnation).await.unwrap(), 0);
        peer.remote::<Crash>("flaky.crash")
            .send(Crash)
            .await
            .unwrap();
        // The same registration reaches the restarted actor.
        assert_eq!(ask.send(Incarnation).await.unwrap(), 1);
    });
}

/// `Restart::Transient`: a child that crashes (SIGKILL) is restarted; one that exits
/// cleanly (status 0: its work is done) is not.
#[test]
fn a_transient_child_is_restarted_after_a_crash_and_not_after_a_clean_exit() {
    run(async {
        let parent = Parent::start("trans");
        let spec = peer_spec(&parent, "job", "serve").restart(baton::actors::Restart::Transient);
        let (sup, events) = supervise(
            &parent,
            vec![spec],
            Strategy::OneForOne,
            RestartPolicy::default(),
        );
        eventually(DEADLINE, "the child's link", || {
            parent.events.ups().len() == 1
        })
        .await;
        let first = events.started()[0].1;
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(first as i32).expect("a pid"),
            rustix::process::Signal::KILL,
        )
        .expect("SIGKILL");
        eventually(DEADLINE, "the crashed child restarted", || {
            events.started().len() == 2 && parent.events.ups().len() == 2
        })
        .await;
        assert_eq!(events.started()[1].2, 1, "its first restart");
        // Closing its only link makes the helper exit with status 0: its work is done.
        parent.events.ups()[1].close();
        eventually(DEADLINE, "a clean exit", || {
            events.all().iter().any(
                |e| matches!(e, SupervisorEvent::Exited { status, .. } if status == "exit code 0"),
            )
        })
        .await;
        let children = sup.send(Children).await.unwrap();
        assert_eq!(
            (children[0].pid, children[0].restarts),
            (None, 1),
            "done, not restarted again"
        );
        assert_eq!(events.started().len(), 2);
        sup.send(Shutdown).await.unwrap();
    });
}

/// `RevokePolicy::KillSupervisedChild`: a supervised child that keeps a revoked lease past
/// its deadline is cut *and* SIGKILLed by the node (through the pidfd its supervisor
/// registered) — a stubborn holder left alone would exit cleanly once cut, so the signal
/// is the node's — and the buffer's memory is freed, no lease left.
#[test]
fn a_supervised_child_that_keeps_a_revoked_lease_is_killed() {
    run(async {
        let parent = Parent::start("revkill");
        let owner = BufferOwner::new(&parent.node)
            .revoke_policy(RevokePolicy::KillSupervisedChild)
            .start();
        let (sup, events) = supervise(
            &parent,
            vec![
                peer_spec(&parent, "holder", "serve")
                    .arg("stubborn")
                    .restart(baton::actors::Restart::Temporary),
            ],
            Strategy::OneForOne,
            RestartPolicy::default(),
        );
        eventually(DEADLINE, "the child's link", || {
            parent.events.ups().len() == 1
        })
        .await;
        let link = parent.events.ups()[0].clone();
        let pid = link.process().pid;

        let buf: Buffer<u32> = owner.send(Allocate::vector(1024)).await.unwrap().unwrap();
        let data: Vec<u32> = (0..1024).map(|i| pattern(5, i)).collect();
        buf.write_at(0, &data).unwrap();
        let id = buf.id();
        let held = link
            .remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![buf.share()],
            })
            .await
            .unwrap();
        assert_eq!(held, 1);
        drop(buf);
        assert_eq!(parent.node.export_stats().leases, 1);
        assert_eq!(parent.segments(), 1, "the leased buffer's segment");

        let asked = owner
            .send(Revoke {
                buffer: id,
                within: Duration::from_millis(200),
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(asked, 1);
        eventually(DEADLINE, "the holder's exit", || {
            events
                .all()
                .iter()
                .any(|e| matches!(e, SupervisorEvent::Exited { pid: p, .. } if *p == pid))
        })
        .await;
        let status = events
            .all()
            .into_iter()
            .find_map(|e| match e {
                SupervisorEvent::Exited { pid: p, status, .. } if p == pid => Some(status),
                _ => None,
            })
            .unwrap();
        assert!(
            status.contains("signal 9"),
            "the stubborn child was not killed by the node: it ended with {status}"
        );
        let reason = parent.events.down_reason(link.link_id()).unwrap();
        assert!(
            reason
                .as_deref()
                .is_some_and(|r| r.contains("RevokeDeadline")),
            "{reason:?}"
        );
        eventually(DEADLINE, "the buffer freed", || {
            parent.node.lease_table().iter().all(|b| b.buffer != id)
        })
        .await;
        assert_eq!(parent.node.export_stats().leases, 0);
        assert_eq!(parent.segments(), 0, "nothing left in /dev/shm");
        assert_eq!(events.started().len(), 1, "a temporary child: no restart");
        sup.send(Shutdown).await.unwrap();
        eventually(DEADLINE, "the child reaped", || gone(pid)).await;
    });
}

/// A child whose link goes silent (SIGSTOPped: alive, but answering nothing) is cut as
/// `Unresponsive` by the heartbeat, and the supervisor — by default — SIGKILLs it, so the
/// strategy restarts it: a stopped or deadlocked child serves nobody and may pin memory.
#[test]
fn an_unresponsive_child_is_killed_and_restarted() {
    run(async {
        let parent = Parent::start_beating("supbeat");
        let (sup, events) = supervise(
            &parent,
            vec![peer_spec(&parent, "sleeper", "serve")],
            Strategy::OneForOne,
            RestartPolicy {
                max_restarts: 3,
                within: Duration::from_secs(60),
            },
        );
        eventually(DEADLINE, "the child's link", || {
            parent.events.ups().len() == 1
        })
        .await;
        let link = parent.events.ups()[0].clone();
        let pid1 = link.process().pid;
        let stopped = rustix::process::Pid::from_raw(pid1 as i32).expect("a pid");
        rustix::process::kill_process(stopped, rustix::process::Signal::STOP).expect("SIGSTOP");

        eventually(DEADLINE, "the silent child cut", || {
            parent.events.down_reason(link.link_id()).is_some()
        })
        .await;
        let reason = parent.events.down_reason(link.link_id()).unwrap();
        assert!(
            reason
                .as_deref()
                .is_some_and(|r| r.contains("Unresponsive")),
            "{reason:?}"
        );
        // Nobody but the supervisor kills it: the test only stopped it.
        eventually(
            DEADLINE,
            "the stopped child killed by the supervisor",
            || {
                events.all().iter().any(|e| {
                    matches!(e, SupervisorEvent::Exited { pid, status, .. }
                    if *pid == pid1 && status.contains("signal 9"))
                })
            },
        )
        .await;
        eventually(DEADLINE, "its restart", || {
            events
                .started()
                .iter()
                .any(|(name, pid, restarts)| name == "sleeper" && *pid != pid1 && *restarts == 1)
        })
        .await;
        eventually(DEADLINE, "the killed child reaped", || gone(pid1)).await;
        sup.send(Shutdown).await.unwrap();
    });
}

/// A child that joins with `Node::join` (`baton-api-peer`), named segments in the parent's
/// namespace; no backend named: it inherits the supervisor node's.
fn joining_spec(parent: &Parent, name: &str) -> ChildSpec {
    ChildSpec::new(name, peer::exe("baton-api-peer"))
        .env(host::NAMESPACE_ENV, &parent.ns)
        .env(host::HOST_ENV, "named")
}

/// A supervisor of `specs` on the parent's node that links its children, recording events.
fn supervise_linked(
    parent: &Parent,
    specs: Vec<ChildSpec>,
) -> (Addr<ProcessSupervisor>, SupEvents) {
    let events = SupEvents::default();
    let sup = ProcessSupervisor::new(
        parent.node.clone(),
        specs,
        Strategy::OneForOne,
        RestartPolicy {
            max_restarts: 3,
            within: Duration::from_secs(60),
        },
    )
    .link_children()
    .expect("a socket for the children")
    .subscriber(SupLog(events.clone()).start().recipient())
    .start();
    (sup, events)
}

/// The variable `var` in `pid`'s environment.
fn environ_of(pid: u32, var: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ.split(|b| *b == 0).find_map(|entry| {
        let entry = String::from_utf8_lossy(entry);
        entry
            .strip_prefix(var)
            .and_then(|rest| rest.strip_prefix('='))
            .map(str::to_owned)
    })
}

impl SupEvents {
    /// The processes announced as linked for `name`, in order.
    fn linked(&self, name: &str) -> Vec<ProcessId> {
        self.all()
            .into_iter()
            .filter_map(|e| match e {
                SupervisorEvent::Linked {
                    name: n,
                    process,
                    peer,
                } if n == name => {
                    assert_eq!(peer.process(), process);
                    Some(process)
                }
                _ => None,
            })
            .collect()
    }
}

/// Issue 50: a supervised child joins with `Node::join` alone; `ChildPeer` answers with the
/// link of exactly that child (its proven process is the one the supervisor started), and
/// after SIGKILL and restart with the new run's link. The child has the supervisor node's
/// backend, which its spec did not name.
#[test]
fn a_supervised_child_joins_in_one_call_and_child_peer_follows_its_restarts() {
    run(async {
        let parent = Parent::start("supjoin");
        let (sup, events) = supervise_linked(&parent, vec![joining_spec(&parent, "worker")]);
        let first = sup
            .send(ChildPeer::new("worker", DEADLINE))
            .await
            .unwrap()
            .expect("the child's link");
        let children = sup.send(Children).await.unwrap();
        assert_eq!(children[0].process, Some(first.process()));
        assert_eq!(events.linked("worker"), vec![first.process()]);
        let pid1 = first.process().pid;
        // The parent's backend, passed on though the spec named none.
        assert_eq!(environ_of(pid1, "BATON_BACKEND").as_deref(), Some("host"));
        let (name, kind) = first
            .remote::<WhichBackend>("api.backend")
            .send(WhichBackend)
            .await
            .unwrap();
        assert_eq!((name.as_str(), kind.as_str()), ("host", "Host"));

        assert_eq!(
            sup.send(KillChild("worker".into())).await.unwrap(),
            Some(pid1)
        );
        // Asked at once: the killed run's link is never the answer, though the supervisor
        // may not have seen it die yet.
        let second = sup
            .send(ChildPeer::new("worker", DEADLINE).replacing(first.process()))
            .await
            .unwrap()
            .expect("the restarted child's link");
        assert_ne!(second.process(), first.process());
        let children = sup.send(Children).await.unwrap();
        assert_eq!(children[0].process, Some(second.process()));
        assert_eq!(children[0].restarts, 1);
        assert_eq!(
            events.linked("worker"),
            vec![first.process(), second.process()]
        );
        let (name, _) = second
            .remote::<WhichBackend>("api.backend")
            .send(WhichBackend)
            .await
            .unwrap();
        assert_eq!(name, "host");
        // Unknown names are told apart from slow children.
        assert!(matches!(
            sup.send(ChildPeer::new("nobody", DEADLINE)).await.unwrap(),
            Err(ActorError::NoSuchChild { .. })
        ));

        sup.send(Shutdown).await.unwrap();
        let pid2 = second.process().pid;
        eventually(DEADLINE, "both children reaped", || {
            gone(pid1) && gone(pid2)
        })
        .await;
    });
}

/// Issue 50: a process that holds the token but is not a current child, linking to the
/// supervisor's socket, is not matched to any child: its link is closed, and `ChildPeer`
/// still answers with the child's own link.
#[test]
fn a_stranger_on_the_supervisors_socket_is_not_matched_and_is_closed() {
    run(async {
        let parent = Parent::start("supstranger");
        let (sup, events) = supervise_linked(&parent, vec![joining_spec(&parent, "worker")]);
        let child = sup
            .send(ChildPeer::new("worker", DEADLINE))
            .await
            .unwrap()
            .expect("the child's link");
        let socket = environ_of(child.process().pid, PARENT_SOCKET_ENV).expect("the socket");
        // The same program, token and socket: only its process differs.
        let mut stranger = peer::Peer::spawn_with(
            peer::exe("baton-api-peer"),
            &parent.session,
            &parent.ns,
            &[],
            &[(PARENT_SOCKET_ENV, socket.as_str())],
            false,
        );
        let stranger_pid = stranger.pid();
        // The supervisor closes its link; the helper exits when its parent's link ends (or
        // when its join fails, if the close comes first). Were it kept, it would run on.
        exited(&mut stranger, DEADLINE).await;
        assert_eq!(events.linked("worker"), vec![child.process()]);
        assert!(
            !events.all().iter().any(|e| matches!(
                e,
                SupervisorEvent::Linked { process, .. } if process.pid == stranger_pid
            )),
            "{:?}",
            events.all()
        );
        let again = sup
            .send(ChildPeer::new("worker", DEADLINE))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(again.process(), child.process());
        assert!(again.is_connected());
        sup.send(Shutdown).await.unwrap();
        let pid = child.process().pid;
        eventually(DEADLINE, "the child reaped", || gone(pid)).await;
    });
}
