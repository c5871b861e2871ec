//! The rights findings of issue 45 (see the binary's docs): what a token holder may do to
//! what others started or hold — the remote agent's kill and spawn rights (finding 3),
//! a zero-copy forward asked over a host link (finding 4).
//!
//! Every node here lives in this process, on a host of its own name (`BATON_HOST_ID` is
//! per node through [`HostSettings`]), linked over loopback TCP; the agent's children and
//! the forward's third process are real helper processes.

use crate::actors::{DEADLINE, eventually, run};
use crate::host_msgs::Take;
use crate::peer;
use baton::Session;
use baton::actors::supervisor::agent::{
    AGENT_NAME, AgentChild, AgentLimits, AgentRefusal, ChildAgent, KillRemote, SpawnRemote,
};
use baton::actors::{ChildSpec, HostSettings, Node, NodeConfig, Peer};
use baton::ipc::HostBackend;
use baton::ipc::tcp::{HostId, NodeKey};
use baton::messages::ProcessId;
use std::net::SocketAddr;
use std::sync::Arc;

/// When a test ends, the segments its nodes and helpers left in its namespace go.
struct Sweep(String);

impl Drop for Sweep {
    fn drop(&mut self) {
        let _ = baton::ipc::host::sweep(&self.0);
    }
}

/// A node of this process on host `host`, with static key `key` (`None`: its own).
fn node(session: &Session, host: &str, ns: &str, key: Option<NodeKey>) -> Node {
    let config = NodeConfig::new(session.clone()).hosts(HostSettings {
        host: HostId::named(host),
        key,
        ..HostSettings::default()
    });
    Node::with_config(config, Arc::new(HostBackend::with_namespace(ns).unwrap()))
}

/// Whether `pid` runs (not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

/// An agent on host `b` (a node of this process) that runs `sleeper` (a helper that stays
/// until killed), with `limits`; the node (kept: the agent serves while it lives) and
/// where it takes host links.
fn agent(session: &Session, ns: &str, limits: AgentLimits) -> (Node, SocketAddr) {
    let b = node(session, "b", ns, None);
    let sleeper = ChildSpec::new("sleeper", peer::exe("baton-agent-peer")).arg("child");
    ChildAgent::new(b.clone())
        .allow("sleeper", sleeper)
        .limits(limits)
        .serve();
    let listening = b.listen_tcp("127.0.0.1:0").unwrap();
    let at = listening.local_addr();
    // The listener serves as long as the test's system runs.
    std::mem::forget(listening);
    (b, at)
}

/// Asks the agent over `link` to start a `sleeper` named `name`.
async fn spawn(link: &Peer, name: &str) -> Result<AgentChild, AgentRefusal> {
    link.remote::<SpawnRemote>(AGENT_NAME)
        .send_timeout(
            SpawnRemote {
                spec: "sleeper".to_owned(),
                name: name.to_owned(),
                connect_tcp: None,
                inbox: "nobody".to_owned(),
            },
            DEADLINE,
        )
        .await
        .expect("the agent answers")
}

async fn kill(link: &Peer, id: u64) -> Result<(), AgentRefusal> {
    link.remote::<KillRemote>(AGENT_NAME)
        .send_timeout(KillRemote { id }, DEADLINE)
        .await
        .expect("the agent answers")
}

async fn connect(node: &Node, at: SocketAddr) -> Peer {
    tokio::time::timeout(DEADLINE, node.connect_tcp(at))
        .await
        .expect("linked in time")
        .expect("linked")
}

/// Finding 3: another node (its own key, the same token) that claims the very process of
/// the supervisor that started a child — two nodes of this process announce the same
/// process — cannot kill that child: the agent answers `NoSuchChild`, the child runs on.
#[test]
fn a_second_key_cannot_kill_the_first_supervisors_child() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("hi-kill");
        let _sweep = Sweep(ns.clone());
        let (_b, at) = agent(&session, &ns, AgentLimits::default());
        let first = node(&session, "a", &ns, None);
        let second = node(&session, "c", &ns, None);
        assert_eq!(
            first.session().process(),
            second.session().process(),
            "the second claims the first supervisor's process"
        );
        let first_link = connect(&first, at).await;
        let second_link = connect(&second, at).await;
        let child = spawn(&first_link, "w").await.expect("started");
        assert!(alive(child.pid));
        assert_eq!(
            kill(&second_link, child.id).await,
            Err(AgentRefusal::NoSuchChild { id: child.id })
        );
        assert!(alive(child.pid), "another key's kill did nothing");
        assert!(second_link.is_connected(), "a refusal, not a fault");
        // Its own supervisor's key may.
        assert_eq!(kill(&first_link, child.id).await, Ok(()));
        eventually(DEADLINE, "the child killed by its own supervisor", || {
            !alive(child.pid)
        })
        .await;
    });
}

/// Finding 3: one key that announces a new process id on each link (pid 1, 2, 3, ...)
/// gets no fresh limit for each: the agent counts its children per key, and in all.
#[test]
fn one_key_minting_process_ids_cannot_exceed_its_spawn_limit() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("hi-mint");
        let _sweep = Sweep(ns.clone());
        let mut limits = AgentLimits::default();
        limits.children_per_caller = 2;
        limits.children_total = 3;
        let (_b, at) = agent(&session, &ns, limits);
        let key = NodeKey::generate().unwrap();
        let me = session.process();
        let mut links = Vec::new();
        let mut outcomes = Vec::new();
        for i in 0..3u32 {
            let minted = ProcessId {
                pid: 4_000_000 + i,
                ..me
            };
            let liar = node(
                &session.clone().claiming(minted),
                "a",
                &ns,
                Some(key.clone()),
            );
            let link = connect(&liar, at).await;
            outcomes.push(spawn(&link, &format!("w{i}")).await.map(|_| ()));
            links.push((liar, link));
        }
        assert_eq!(
            outcomes,
            vec![
                Ok(()),
                Ok(()),
                Err(AgentRefusal::TooManyChildren { limit: 2 })
            ],
            "three processes of one key share its limit"
        );
        assert!(links.iter().all(|(_, l)| l.is_connected()));
        // Another key has a limit of its own, but the agent's total bounds them all.
        let other = node(&session, "c", &ns, None);
        let other_link = connect(&other, at).await;
        assert!(spawn(&other_link, "x0").await.is_ok());
        assert_eq!(
            spawn(&other_link, "x1").await.map(|_| ()),
            Err(AgentRefusal::AgentFull { limit: 3 })
        );
    });
}

/// Why the exporter refuses a `Forward` over a host link (`link/forward.rs`); on the wire
/// as its `ActorError::ForwardRefused`'s message.
const HOST_LINK_FORWARD: &str = "a forward is zero-copy on one host only: the exporter sends no handle over a host link (a copy received from another host is this node's own memory: send it as a buffer)";

/// The forger (blocking, on its own thread): links to `addr` with the `HostLink` client,
/// announcing a data port nobody serves; waits for A's call and its copy's offer, then —
/// holding that lease — sends a raw `Forward` of it to `to`. Sends back A's answer
/// (`Ok(whether the offer was a copy)` or the refusal), gives the lease back, and keeps the
/// link until `done`.
fn forger(
    session: Session,
    addr: SocketAddr,
    to: ProcessId,
    answer: std::sync::mpsc::Sender<Result<bool, String>>,
    done: std::sync::mpsc::Receiver<()>,
) {
    use baton::ipc::tcp::{HostLink, TcpConfig};
    use baton::messages::Message;
    use baton::messages::RawHandle;
    use baton::messages::protocol::{Forward, Release};
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config = TcpConfig::new(session, NodeKey::generate().unwrap())
        .host(HostId::named("d"))
        .data_port(silent.local_addr().unwrap().port());
    let mut link = HostLink::connect(addr, &config).expect("the forger links");
    let recv = |link: &mut HostLink| loop {
        let got = link.recv_timeout(DEADLINE).expect("a frame");
        match got.message {
            Message::Ping(seq) => link.send(&Message::Pong(seq), &[]).unwrap(),
            other => return other,
        }
    };
    let lease = loop {
        if let Message::Call(call) = recv(&mut link) {
            let offer = call.offers.first().expect("the call offers the buffer");
            assert!(matches!(offer.handle.raw, RawHandle::Copy { .. }), "a copy");
            break offer.lease;
        }
    };
    let forward = Forward { id: 1, lease, to };
    link.send(&Message::Forward(forward), &[]).unwrap();
    let outcome = loop {
        if let Message::Forwarded(forwarded) = recv(&mut link) {
            break forwarded
                .outcome
                .map(|offer| matches!(offer.handle.raw, RawHandle::Copy { .. }));
        }
    };
    let _ = answer.send(outcome);
    link.send(&Message::Release(Release::now(lease)), &[])
        .unwrap();
    let _ = done.recv_timeout(DEADLINE);
}

/// Finding 4: a token holder over TCP that holds a lease on A's buffer (the lease of a
/// copy A sends it) sends a raw `Forward` of it naming a live process of A's host. A
/// refuses (a `Forwarded` refusal, [`HOST_LINK_FORWARD`], the link kept): no handle of A's
/// crosses TCP, nothing is granted to that process, and A's buffer is back as soon as the
/// forger gives its lease back, while the named process still runs. (Before, A granted it
/// a lease, sent the segment's real handle over TCP, and kept the buffer pinned until that
/// unrelated local process died.)
#[test]
fn a_raw_forward_over_a_host_link_is_refused_and_pins_nothing() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("hi-fwd");
        let _sweep = Sweep(ns.clone());
        let a = node(&session, "a", &ns, None);
        // A live process of this host, unrelated to the forger.
        let mut bystander = std::process::Command::new("sleep")
            .arg("120")
            .spawn()
            .unwrap();
        let pid = bystander.id();
        let to = ProcessId {
            boot: baton::ipc::process::boot_id(),
            pid,
            start_ticks: baton::ipc::process::start_ticks(pid).expect("it runs"),
        };
        let mut listening = a.listen_tcp("127.0.0.1:0").unwrap();
        let addr = listening.local_addr();
        let (answer_tx, answer) = std::sync::mpsc::channel();
        let (done, done_rx) = std::sync::mpsc::channel();
        let thread_session = session.clone();
        let forger =
            std::thread::spawn(move || forger(thread_session, addr, to, answer_tx, done_rx));
        let to_forger = listening
            .accept_timeout(DEADLINE)
            .await
            .expect("the forger links");
        let data = a.allocate::<u8>(4096).unwrap();
        let call = to_forger.remote::<Take>("keep").send_timeout(
            Take {
                seed: 5,
                data: data.share(),
            },
            DEADLINE,
        );
        let _call = actix::spawn(call);
        let mut outcome = None;
        eventually(DEADLINE, "A's answer to the forward", || {
            outcome = answer.try_recv().ok();
            outcome.is_some()
        })
        .await;
        assert_eq!(
            outcome.unwrap(),
            Err(format!(
                "the exporter refused to forward the buffer: {HOST_LINK_FORWARD}"
            )),
            "no offer, no handle"
        );
        // The forger gave its lease back: the buffer is back, the bystander alive.
        data.returned_within(DEADLINE)
            .await
            .expect("back once the forger's lease is");
        assert_eq!(data.leases_out(), 0);
        assert!(
            bystander.try_wait().unwrap().is_none(),
            "the bystander runs"
        );
        assert!(to_forger.is_connected(), "a refusal, not a fault");
        let _ = done.send(());
        forger.join().expect("the forger ran");
        let _ = bystander.kill();
        let _ = bystander.wait();
    });
}
