//! Forwarding across hosts (issue 26): a lease this node holds on a buffer of a process of
//! its own host (A, over a Unix link) sent on to a peer on another host (C, over a TCP
//! host link, its own `BATON_HOST_ID`) arrives there as a copy, read from our mapping of
//! the lease, while our lease on the original stays pinned.
//!
//! This process is the relay B; A is `baton-host-peer export` (it sends its buffer to our
//! `keep`, and answers `LedgerOf` about its ledger), C is `baton-host-peer listen --inbox`
//! (it checks what lands in its inbox). A copy is kept in flight deterministically by
//! stopping C (SIGSTOP) before it starts. Cases: the copy lands; a writable lease is
//! refused; C killed mid-copy (our lease pinned until the send stops); A killed mid-copy
//! (the copy completes from our mapping); forged frames on other links cut only those.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/host_msgs.rs"]
mod host_msgs;
#[path = "support/host_peer.rs"]
mod host_peer;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, exited, run};
use baton::Session;
use baton::actors::{ActorError, HostSettings, Lease, LeaseMut, Node, NodeConfig, Peer};
use baton::ipc::HostBackend;
use baton::ipc::tcp::HostId;
use host_msgs::*;
use host_peer::{Lines, host_peer};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The size of a buffer kept in flight while its receiver is killed.
const IN_FLIGHT: usize = 128 << 20;

/// When a test ends, the segments its killed helpers left in its namespace go.
struct Sweep(String);

impl Drop for Sweep {
    fn drop(&mut self) {
        let _ = baton::ipc::host::sweep(&self.0);
    }
}

/// The relay B: our node on host "a" (A's host), with named segments of `ns`.
fn relay_node(session: &Session, ns: &str) -> Node {
    let config = NodeConfig::new(session.clone()).hosts(HostSettings {
        host: HostId::named("a"),
        ..HostSettings::default()
    });
    Node::with_config(config, Arc::new(HostBackend::with_namespace(ns).unwrap()))
}

/// The three processes, linked: A to us over a Unix link (its lease kept in `kept`), C
/// to us over TCP.
struct Trio {
    b: Node,
    a: peer::Peer,
    to_a: Peer,
    c: peer::Peer,
    c_lines: Lines,
    to_c: Peer,
    kept: Arc<Mutex<Vec<Lease<u8>>>>,
    kept_mut: Arc<Mutex<Vec<LeaseMut<u8>>>>,
    _listening: baton::actors::Listening,
    _dir: tempfile::TempDir,
}

async fn trio(session: &Session, ns: &str, len: usize, seed: u8) -> Trio {
    trio_with(session, ns, len, seed, false).await
}

/// As [`trio`]; with `writable`, A shares its buffer writable (our lease is a `LeaseMut`).
async fn trio_with(session: &Session, ns: &str, len: usize, seed: u8, writable: bool) -> Trio {
    let b = relay_node(session, ns);
    let keeper = Keeper::default();
    let (kept, kept_mut) = (Arc::clone(&keeper.kept), Arc::clone(&keeper.kept_mut));
    let keeper = keeper.start();
    b.register::<Keep>("keep", keeper.clone().recipient());
    b.register::<KeepMut>("keep-mut", keeper.recipient());
    // C, on another host.
    let seed_arg = seed.to_string();
    let (c, c_lines) = host_peer(
        session,
        ns,
        "c",
        &["listen", "127.0.0.1:0", "--inbox", "--seed", &seed_arg],
    );
    let addr = c_lines.expect("listening ", DEADLINE).await;
    let to_c = tokio::time::timeout(DEADLINE, b.connect_tcp(addr.as_str()))
        .await
        .expect("connect_tcp within the deadline")
        .expect("linked to C");
    c_lines.expect("linked", DEADLINE).await;
    assert_eq!(to_c.info().host().map(|h| h.host), Some(HostId::named("c")));
    // A, on our host, over a Unix link.
    let dir = tempfile::tempdir().unwrap();
    let sockets = baton::SocketDir::create(dir.path().join("sock")).unwrap();
    let mut listening = b.listen(&sockets, "relay").unwrap();
    let path = listening.path().to_str().unwrap().to_owned();
    let len_arg = len.to_string();
    let mut args = vec!["export", &path, "--len", &len_arg, "--seed", &seed_arg];
    if writable {
        args.push("--writable");
    }
    let (a, a_lines) = host_peer(session, ns, "a", &args);
    let to_a = listening
        .accept_timeout(DEADLINE)
        .await
        .expect("A links to us");
    assert!(to_a.info().host().is_none(), "A is on our host");
    a_lines.expect("kept", DEADLINE).await;
    Trio {
        b,
        a,
        to_a,
        c,
        c_lines,
        to_c,
        kept,
        kept_mut,
        _listening: listening,
        _dir: dir,
    }
}

impl Trio {
    /// The lease A sent us.
    fn lease(&self) -> Lease<u8> {
        self.kept.lock().unwrap().pop().expect("A's lease kept")
    }

    /// What A's ledger says now.
    async fn ledger(&self) -> LedgerState {
        self.to_a
            .remote::<LedgerOf>("ledger")
            .send_timeout(LedgerOf, DEADLINE)
            .await
            .expect("A answers")
            .expect("A's ledger")
    }

    /// Waits until A's ledger says `want`.
    async fn ledger_comes_to(&self, want: LedgerState, what: &str) {
        let start = Instant::now();
        loop {
            let now = self.ledger().await;
            if now == want {
                return;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{what}: A's ledger is {now:?}, not {want:?}, after {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Ends the helpers: C is closed (it exits by itself), A is killed.
    async fn end(mut self) {
        tokio::time::timeout(DEADLINE, self.to_c.close_and_wait())
            .await
            .expect("closed within the deadline");
        let status = exited(&mut self.c, DEADLINE).await;
        assert!(status.success(), "C: {status}");
        self.a.kill9();
    }
}

fn signal(child: &peer::Peer, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(child.pid() as i32).unwrap();
    rustix::process::kill_process(pid, sig).unwrap();
}

const HELD: LedgerState = LedgerState {
    leases: 1,
    writable: false,
};
const FREE: LedgerState = LedgerState {
    leases: 0,
    writable: true,
};

#[test]
fn a_lease_from_this_host_forwarded_to_another_host_arrives_there_as_a_copy() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("fwh-copy");
        let _sweep = Sweep(ns.clone());
        let len = (4 << 20) + 3;
        let trio = trio(&session, &ns, len, 7).await;
        let lease = trio.lease();
        assert_eq!(lease.len(), len);
        assert_eq!(trio.ledger().await, HELD, "our lease on A's buffer");
        // `forward_to` resolves once the bytes landed at C.
        let id = tokio::time::timeout(DEADLINE, lease.forward_to(&trio.to_c))
            .await
            .expect("within the deadline")
            .expect("forwarded as a copy");
        let line = trio.c_lines.expect("inbox ", DEADLINE).await;
        assert_eq!(
            line,
            format!("lease={id} len={len} pattern=true"),
            "C's copy"
        );
        // Our lease stays ours: A still counts it, and we still read it.
        assert_eq!(trio.ledger().await, HELD);
        assert_eq!(lease.to_vec().unwrap(), pattern_bytes(7, len));
        // Forwarded again while we hold it: a second copy.
        let again = tokio::time::timeout(DEADLINE, trio.to_c.forward(&lease))
            .await
            .expect("within the deadline")
            .expect("a second copy");
        assert_ne!(again, id);
        let line = trio.c_lines.expect("inbox ", DEADLINE).await;
        assert_eq!(line, format!("lease={again} len={len} pattern=true"));
        drop(lease);
        trio.ledger_comes_to(FREE, "our lease dropped").await;
        assert!(trio.to_a.is_connected() && trio.to_c.is_connected());
        assert_eq!(trio.b.status(0).leases, 0, "no lease of ours is out");
        trio.end().await;
    });
}

#[test]
fn a_writable_lease_is_refused_typed_and_the_link_stays() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("fwh-mut");
        let _sweep = Sweep(ns.clone());
        let trio = trio_with(&session, &ns, 4096, 5, true).await;
        let lease = trio
            .kept_mut
            .lock()
            .unwrap()
            .pop()
            .expect("A's writable lease");
        // A `LeaseMut` is a `Lease` too (it derefs to one): refused all the same.
        let refused = tokio::time::timeout(DEADLINE, trio.to_c.forward(&lease))
            .await
            .expect("within the deadline")
            .expect_err("a writable lease does not cross hosts");
        assert!(
            matches!(&refused, ActorError::ForwardRefused { reason } if reason.contains("writable")),
            "{refused:?}"
        );
        // Nothing was offered: the link works on.
        assert!(trio.to_c.is_connected());
        echo_round(&trio.b, &trio.to_c, 4096, 3, DEADLINE)
            .await
            .unwrap();
        drop(lease);
        trio.ledger_comes_to(FREE, "our lease dropped").await;
        trio.end().await;
    });
}

#[test]
fn sigkill_of_the_receiver_mid_forward_keeps_our_lease_pinned_until_the_send_stops() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("fwh-kill");
        let _sweep = Sweep(ns.clone());
        let mut trio = trio(&session, &ns, IN_FLIGHT, 9).await;
        // A first copy of ours opens the engine's data connection to C.
        echo_round(&trio.b, &trio.to_c, 4096, 3, DEADLINE)
            .await
            .unwrap();
        let lease = trio.lease();
        // Stopped, C reads nothing: the copy stays in flight once the socket buffers
        // are full.
        signal(&trio.c, rustix::process::Signal::STOP);
        let forward = actix::spawn(trio.to_c.forward(&lease));
        // Dropped while its copy is under way: its release waits for the send. (Our
        // call below is queued on A's link behind that release, were it sent.)
        drop(lease);
        assert_eq!(
            trio.ledger().await,
            HELD,
            "A still counts the lease a copy reads from"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            trio.ledger().await,
            HELD,
            "and keeps it while the copy is stalled"
        );
        trio.c.kill9();
        let failed = tokio::time::timeout(DEADLINE, forward)
            .await
            .expect("the forward ends when the receiver dies")
            .unwrap()
            .expect_err("the receiver died before the bytes landed");
        assert!(
            matches!(failed, ActorError::LinkClosed { .. }),
            "the link's end, not a deadline: {failed:?}"
        );
        // The send stopped: our lease goes back, and A may write its buffer again.
        trio.ledger_comes_to(FREE, "the send aborted").await;
        assert!(trio.to_a.is_connected(), "A's link is unharmed");
        assert!(!trio.to_c.is_connected());
        assert_eq!(trio.b.status(0).leases, 0);
        trio.a.kill9();
    });
}

#[test]
fn forged_frames_about_a_forward_in_flight_cut_only_their_own_link() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("fwh-forge");
        let _sweep = Sweep(ns.clone());
        let len = 32 << 20;
        let trio = trio(&session, &ns, len, 11).await;
        echo_round(&trio.b, &trio.to_c, 4096, 3, DEADLINE)
            .await
            .unwrap();
        let mut listening = trio.b.listen_tcp("127.0.0.1:0").unwrap();
        let addr = listening.local_addr().to_string();
        let lease = trio.lease();
        let ours = lease.id().get().to_string();
        // The copy to C is held in flight.
        signal(&trio.c, rustix::process::Signal::STOP);
        let forward = actix::spawn(trio.to_c.forward(&lease));
        // Peers on other links name our lease on A's buffer (a Release of it, a Pull of
        // it): each is that link's fault, and only its link is cut.
        for what in ["release", "pull"] {
            let (mut forger, lines) = host_peer(
                &session,
                &ns,
                "d",
                &["forge", &addr, "--forge", what, "--lease", &ours],
            );
            let link = listening
                .accept_timeout(DEADLINE)
                .await
                .expect("the forger links");
            lines.expect("cut", DEADLINE).await;
            let _ = tokio::time::timeout(DEADLINE, link.closed()).await;
            assert!(!link.is_connected(), "{what}: the forger's link is cut");
            let status = exited(&mut forger, DEADLINE).await;
            assert!(status.success(), "the forger ({what}): {status}");
        }
        assert!(trio.to_a.is_connected() && trio.to_c.is_connected());
        assert_eq!(trio.ledger().await, HELD, "our lease is still out");
        signal(&trio.c, rustix::process::Signal::CONT);
        let id = tokio::time::timeout(DEADLINE, forward)
            .await
            .expect("the forward ends")
            .unwrap()
            .expect("the copy landed");
        let line = trio.c_lines.expect("inbox ", DEADLINE).await;
        assert_eq!(line, format!("lease={id} len={len} pattern=true"));
        drop(lease);
        trio.ledger_comes_to(FREE, "our lease dropped").await;
        trio.end().await;
    });
}

/// The exporter SIGKILLed while a forward reads our mapping of its buffer: the copy
/// completes from the still-mapped memory (nobody can reuse the memory of a dead owner,
/// and a host mapping outlives the process that made it), and lands whole.
#[test]
fn sigkill_of_the_exporter_mid_forward_lets_the_copy_complete_from_our_mapping() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("fwh-akill");
        let _sweep = Sweep(ns.clone());
        let len = 32 << 20;
        let mut trio = trio(&session, &ns, len, 13).await;
        echo_round(&trio.b, &trio.to_c, 4096, 3, DEADLINE)
            .await
            .unwrap();
        let lease = trio.lease();
        signal(&trio.c, rustix::process::Signal::STOP);
        // Our view of the lease is taken as the forward starts.
        let forward = actix::spawn(trio.to_c.forward(&lease));
        trio.a.kill9();
        let start = Instant::now();
        while trio.to_a.is_connected() {
            assert!(start.elapsed() < DEADLINE, "A's link never ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            matches!(lease.to_vec(), Err(ActorError::Orphaned { .. })),
            "our lease is orphaned"
        );
        drop(lease);
        signal(&trio.c, rustix::process::Signal::CONT);
        let id = tokio::time::timeout(DEADLINE, forward)
            .await
            .expect("the forward ends")
            .unwrap()
            .expect("the copy completes from our mapping");
        let line = trio.c_lines.expect("inbox ", DEADLINE).await;
        assert_eq!(line, format!("lease={id} len={len} pattern=true"));
        assert!(trio.to_c.is_connected());
        trio.end().await;
    });
}
