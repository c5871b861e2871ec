//! The NCCL findings of issue 45 (see the binary's docs): a rendezvous follows the link
//! that carried it and joins only a bootstrap on that peer's own host (finding 10), and a
//! link's end aborts the peer's communicators off the thread its node's links share
//! (finding 11).
//!
//! The node under attack runs on the host backend with the fake NCCL of `baton-ipc`'s
//! `testing` feature serving its host id (`FakeFabric::serve`): its NCCL engine is real,
//! only the NCCL calls are the fake's, so a rendezvous and an abort that hangs can be
//! played on a machine without a GPU. It runs on a thread and actix system of its own (its
//! links share that system's thread, as a node's always do), so that a test's own waits
//! are not held up by what holds it up.

use crate::actors::{DEADLINE, EventLog, Events, eventually, run};
use actix::prelude::*;
use baton::Session;
use baton::actors::{Heartbeat, HostSettings, Node, NodeConfig, PeerEvent};
use baton::ipc::HostBackend;
use baton::ipc::tcp::{HostId, HostLink, NodeKey, TcpConfig};
use baton::ipc::transfer::nccl::NcclConfig;
use baton::ipc::transfer::nccl::testing::{FakeFabric, rendezvous};
use baton::messages::Message;
use baton::messages::protocol::Rendezvous;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Where the fake says a node's NCCL bootstrap listens (nothing does: no test connects).
fn bootstrap(ip: [u8; 4]) -> SocketAddr {
    SocketAddr::from((ip, 40_000))
}

/// The node under attack, on a thread of its own, listening on loopback TCP.
struct Target {
    addr: SocketAddr,
    /// Its peer events.
    events: Events,
    /// Its NCCL: aborts are let go of at the end, so that a failing test cannot hang.
    fabric: FakeFabric,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Target {
    /// A node of host `host`, whose NCCL engine runs on `fabric`, gives up on a hung
    /// abort after `abort_wait`, and cuts no peer for silence while a test runs.
    fn start(session: &Session, host: &str, fabric: &FakeFabric, abort_wait: Duration) -> Self {
        let host = HostId::named(host);
        fabric.serve(host, 0, bootstrap([127, 0, 0, 1]));
        let config = NodeConfig::new(session.clone())
            .hosts(HostSettings {
                host,
                nccl: NcclConfig {
                    abort_wait,
                    ..NcclConfig::default()
                },
                ..HostSettings::default()
            })
            .heartbeat(Heartbeat {
                interval: Duration::from_secs(1),
                deadline: Duration::from_secs(600),
            });
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            System::new().block_on(async move {
                let node = Node::with_config(config, Arc::new(HostBackend::new().unwrap()));
                let events = Events::default();
                node.subscribe(EventLog(events.clone()).start().recipient());
                let mut listening = node.listen_tcp("127.0.0.1:0").unwrap();
                tx.send((listening.local_addr(), events)).unwrap();
                actix::spawn(async move {
                    let mut peers = Vec::new();
                    while let Ok(peer) = listening.accept().await {
                        peers.push(peer);
                    }
                });
                while !stopping.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                drop(node);
            });
        });
        let (addr, events) = rx.recv_timeout(DEADLINE).expect("the target node started");
        Self {
            addr,
            events,
            fabric: fabric.clone(),
            stop,
            thread: Some(thread),
        }
    }

    /// Its links that went down, with their reasons.
    fn downs(&self) -> Vec<Option<String>> {
        (self.events.all().into_iter())
            .filter_map(|e| match e {
                PeerEvent::Down { reason, .. } => Some(reason.map(|r| format!("{r:?}"))),
                _ => None,
            })
            .collect()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.fabric.hang_aborts(false);
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A raw host link to `to` with a key of its own, announcing what `session` says.
fn raw_link(to: SocketAddr, session: &Session, host: &str) -> HostLink {
    let key = NodeKey::generate().unwrap();
    let config = TcpConfig::new(session.clone(), key).host(HostId::named(host));
    HostLink::connect(to, &config).expect("a host link")
}

/// Sends a Rendezvous frame carrying `bytes`.
fn send_rendezvous(link: &mut HostLink, bytes: Vec<u8>) {
    link.send(&Message::Rendezvous(Rendezvous { bytes }), &[])
        .expect("the rendezvous sent");
}

/// Whether the link is still answered: a ping of ours gets its pong (the target's own
/// pings on the way are passed over).
fn answered(link: &mut HostLink, n: u64) -> bool {
    if link.send(&Message::Ping(n), &[]).is_err() {
        return false;
    }
    let start = std::time::Instant::now();
    while start.elapsed() < DEADLINE {
        match link.recv_timeout(DEADLINE) {
            Ok(r) if r.message == Message::Pong(n) => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
    false
}

/// Issue 45, finding 10. A token holder claims the process id of an honest peer and
/// sends a rendezvous whose unique id names a bootstrap socket on another host: joining
/// it would make the node connect wherever the attacker says. The node refuses it — its
/// link is cut for `RendezvousElsewhere` — without an NCCL call: no communicator joined,
/// and the honest peer's communicator (joined from its own rendezvous) neither aborted
/// nor replaced, its link still answered. A second liar with the same claim and a
/// bootstrap on its own host gets a communicator of its own, keyed by its link (its
/// claim in its own key's namespace), and the honest peer's is still untouched.
#[test]
fn a_rendezvous_naming_another_host_or_claiming_a_peer_joins_nothing_and_disturbs_no_one() {
    let session = Session::generate().unwrap();
    let fabric = FakeFabric::new();
    let target = Target::start(&session, "h45-nccl-10-target", &fabric, DEADLINE);
    let loopback = [127, 0, 0, 1];

    let mut honest = raw_link(target.addr, &session, "h45-nccl-10-honest");
    send_rendezvous(&mut honest, rendezvous(1, bootstrap(loopback)));
    run(eventually(
        DEADLINE,
        "the honest peer's communicator joined",
        || fabric.inits() == 1,
    ));

    let claimed = session.process();
    let liar_session = session.clone().claiming(claimed);
    let mut liar = raw_link(target.addr, &liar_session, "h45-nccl-10-honest");
    send_rendezvous(&mut liar, rendezvous(1, bootstrap([10, 9, 9, 9])));
    run(eventually(DEADLINE, "the liar's link cut", || {
        !target.downs().is_empty()
    }));
    let downs = target.downs();
    assert_eq!(downs.len(), 1, "{downs:?}");
    let reason = downs[0].clone().unwrap_or_default();
    assert!(
        reason.contains("RendezvousElsewhere") && reason.contains("10.9.9.9"),
        "cut for the rendezvous it sent: {reason}"
    );
    assert_eq!(fabric.inits(), 1, "the node joined the liar's bootstrap");
    assert_eq!(
        fabric.aborts_begun(),
        0,
        "the honest communicator was aborted"
    );
    assert!(
        answered(&mut honest, 1),
        "the honest peer's link was harmed"
    );

    // The same claim with a bootstrap on its own host: a communicator of its own.
    let mut second = raw_link(target.addr, &liar_session, "h45-nccl-10-honest");
    send_rendezvous(&mut second, rendezvous(1, bootstrap(loopback)));
    run(eventually(
        DEADLINE,
        "the second liar's own communicator",
        || fabric.inits() == 2,
    ));
    assert!(answered(&mut second, 2));
    assert_eq!(
        fabric.aborts_begun(),
        0,
        "a claim of the honest peer's id replaced its communicator"
    );
    assert!(answered(&mut honest, 3));
    assert_eq!(target.downs().len(), 1, "{:?}", target.downs());
}

/// Issue 45, finding 11. A peer whose node has a communicator with it goes away, and the
/// `ncclCommAbort` its link's end runs hangs (as NCCL's can after a peer died
/// mid-copy). The node's other links share one thread: while that abort hangs, an
/// unrelated peer's pings are still answered — the abort runs off that thread — and
/// the link's end finishes (its `Down`) once the abort returns.
#[test]
fn while_one_peers_nccl_abort_hangs_an_unrelated_links_pings_are_answered() {
    let session = Session::generate().unwrap();
    let fabric = FakeFabric::new();
    // Far longer than any wait below: a link end that waited for it on the links'
    // thread would leave the unrelated ping unanswered past its deadline.
    let abort_wait = Duration::from_secs(600);
    let target = Target::start(&session, "h45-nccl-11-target", &fabric, abort_wait);

    run(async {
        let other = Node::with_config(
            NodeConfig::new(session.clone()).hosts(HostSettings {
                host: HostId::named("h45-nccl-11-other"),
                ..HostSettings::default()
            }),
            Arc::new(HostBackend::new().unwrap()),
        );
        let to_target = other.connect_tcp(target.addr).await.unwrap();
        to_target.ping().await.expect("answered before");

        let mut going = raw_link(target.addr, &session, "h45-nccl-11-going");
        send_rendezvous(&mut going, rendezvous(1, bootstrap([127, 0, 0, 1])));
        eventually(DEADLINE, "a communicator with the going peer", || {
            fabric.inits() == 1
        })
        .await;
        fabric.hang_aborts(true);
        drop(going);
        eventually(DEADLINE, "the going peer's abort under way", || {
            fabric.aborts_begun() == 1
        })
        .await;

        let pong = tokio::time::timeout(DEADLINE, to_target.ping()).await;
        assert!(
            matches!(pong, Ok(Ok(_))),
            "the unrelated link's ping was not answered while the abort hung: {pong:?}"
        );
        assert_eq!(
            fabric.aborts_returned(),
            0,
            "the abort was to hang meanwhile"
        );
        assert!(to_target.is_connected());
        assert!(target.downs().is_empty(), "{:?}", target.downs());

        // The abort returns: the going peer's link end finishes.
        fabric.hang_aborts(false);
        eventually(DEADLINE, "the going peer's link down", || {
            target.downs().len() == 1
        })
        .await;
        assert_eq!(fabric.aborts_returned(), 1);
        to_target.ping().await.expect("answered after");
        to_target.close_and_wait().await;
    });
}
