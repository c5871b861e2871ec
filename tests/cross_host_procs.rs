//! Nodes on two "hosts" in two processes (the helper `baton-host-peer` runs with its own
//! `BATON_HOST_ID`), linked over loopback TCP: typed messages with host buffers both ways;
//! SIGKILL of either side mid-transfer; a silent partition cut by the heartbeat; a wrong
//! token and rogue clients against `listen_tcp`; a forged offer (a host segment, not a
//! copy) cuts only its link. A transfer is kept in flight
//! deterministically: the receiver is stopped (SIGSTOP) before the send, or a proxy
//! (`support/tcp_proxy.rs`) holds the data connection's bytes after a budget.

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
#[path = "support/tcp_proxy.rs"]
mod tcp_proxy;

use actix::prelude::*;
use actors::{DEADLINE, EventLog, Events, eventually, exited, run};
use baton::Session;
use baton::actors::{
    ActorError, Heartbeat, HostSettings, LinkLimits, Node, NodeConfig, Peer, PeerEvent,
};
use baton::ipc::HostBackend;
use baton::ipc::tcp::HostId;
use host_msgs::*;
use host_peer::{Lines, host_peer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The size of a buffer kept in flight while a side is killed or cut off.
const IN_FLIGHT: usize = 512 << 20;

/// When a test ends, the segments its killed helpers left in its namespace go.
struct Sweep(String);

impl Drop for Sweep {
    fn drop(&mut self) {
        let _ = baton::ipc::host::sweep(&self.0);
    }
}

/// A node of this process on host `host`, its buffers named segments of `ns` (counted).
fn node(session: &Session, host: &str, ns: &str, heartbeat: Option<Heartbeat>) -> Node {
    let mut config = NodeConfig::new(session.clone()).hosts(HostSettings {
        host: HostId::named(host),
        ..HostSettings::default()
    });
    if let Some(hb) = heartbeat {
        config = config.heartbeat(hb);
    }
    Node::with_config(config, Arc::new(HostBackend::with_namespace(ns).unwrap()))
}

/// The segments of `ns` this process owns now.
fn own_segments(ns: &str) -> usize {
    baton::ipc::host::list_segments(ns)
        .unwrap()
        .iter()
        .filter(|s| s.owner_pid == std::process::id())
        .count()
}

/// Records `node`'s peer events.
fn events(node: &Node) -> Events {
    let events = Events::default();
    node.subscribe(EventLog(events.clone()).start().recipient());
    events
}

/// A helper that listens on loopback, and our link to it.
async fn linked_listener(
    node: &Node,
    session: &Session,
    ns: &str,
    extra: &[&str],
) -> (peer::Peer, Lines, Peer) {
    let mut args = vec!["listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let (child, lines) = host_peer(session, ns, "b", &args);
    let addr = lines.expect("listening ", DEADLINE).await;
    let peer = tokio::time::timeout(DEADLINE, node.connect_tcp(addr.as_str()))
        .await
        .expect("connect_tcp within the deadline")
        .expect("linked");
    lines.expect("linked", DEADLINE).await;
    (child, lines, peer)
}

/// Sends `len` bytes of the pattern `seed` to the peer's `echo` and checks its answer.
async fn echo_checked(node: &Node, to: &Peer, len: usize, seed: u8) {
    if let Err(e) = echo_round(node, to, len, seed, DEADLINE).await {
        panic!("{e}");
    }
}

/// Asks the peer to send `len` bytes of the pattern `seed` to our `take`.
async fn push_checked(to: &Peer, len: usize, seed: u8) {
    let took = to
        .remote::<Push>("push")
        .send_timeout(
            Push {
                len: len as u64,
                seed,
            },
            DEADLINE,
        )
        .await
        .expect("the push call")
        .expect("our take checked the bytes");
    assert_eq!(took, len as u64);
}

fn signal(child: &peer::Peer, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(child.pid() as i32).unwrap();
    rustix::process::kill_process(pid, sig).unwrap();
}

/// Where `node`'s TCP engine takes data connections (it listens at `at`): a throwaway
/// node links there and reads the announced address.
async fn data_addr_of(session: &Session, ns: &str, at: SocketAddr) -> SocketAddr {
    let probe = node(session, "probe", ns, None);
    let link = tokio::time::timeout(DEADLINE, probe.connect_tcp(at))
        .await
        .unwrap()
        .unwrap();
    let data = link.info().host().unwrap().data_addr.expect("a data port");
    tokio::time::timeout(DEADLINE, link.close_and_wait())
        .await
        .unwrap();
    data
}

/// Closes our link to a helper; it must then exit with success.
async fn close_and_reap(link: &Peer, child: &mut peer::Peer) {
    tokio::time::timeout(DEADLINE, link.close_and_wait())
        .await
        .expect("closed within the deadline");
    let status = exited(child, DEADLINE).await;
    assert!(status.success(), "the helper: {status}");
}

/// That error is the link's end, not our own deadline.
fn assert_link_failure(e: &ActorError) {
    assert!(
        !matches!(e, ActorError::Timeout { .. }),
        "the call failed by the test's deadline, not the link's end: {e:?}"
    );
}

#[test]
fn typed_messages_with_host_buffers_both_ways_between_two_processes() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-both");
        let _sweep = Sweep(ns.clone());
        let a = node(&session, "a", &ns, None);
        let taken = serve_echo_and_take(&a);
        let (mut child, _lines, to_b) = linked_listener(&a, &session, &ns, &[]).await;
        assert_eq!(to_b.info().host().map(|h| h.host), Some(HostId::named("b")));
        assert_ne!(to_b.process(), a.session().process());
        for (i, len) in [1usize, 4096, (1 << 20) + 3, 64 << 20]
            .into_iter()
            .enumerate()
        {
            let seed = i as u8 + 1;
            echo_checked(&a, &to_b, len, seed).await;
            push_checked(&to_b, len, seed + 50).await;
        }
        assert_eq!(taken.load(Ordering::SeqCst), 4);
        close_and_reap(&to_b, &mut child).await;
        assert_eq!(a.status(0).leases, 0);
        eventually(DEADLINE, "our copies and buffers freed", || {
            own_segments(&ns) == 0
        })
        .await;
    });
}

#[test]
fn sigkill_of_the_receiver_mid_transfer_gives_the_senders_lease_back() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-rkill");
        let _sweep = Sweep(ns.clone());
        let a = node(&session, "a", &ns, None);
        let (mut child, _lines, to_b) = linked_listener(&a, &session, &ns, &[]).await;
        // A first copy opens the engine's data connection.
        echo_checked(&a, &to_b, 4096, 3).await;
        // Stopped, the receiver reads nothing: the big copy stays in flight once the
        // socket buffers are full.
        signal(&child, rustix::process::Signal::STOP);
        let big = a.allocate::<u8>(IN_FLIGHT).unwrap();
        let call = actix::spawn(to_b.remote::<Echo>("echo").send_timeout(
            Echo {
                seed: 0,
                data: big.share(),
            },
            Duration::from_secs(120),
        ));
        eventually(DEADLINE, "the copy's lease granted", || {
            a.status(0).leases == 1
        })
        .await;
        assert!(
            big.write_at(0, &[1]).is_err(),
            "the buffer is pinned while its copy is in flight"
        );
        child.kill9();
        let failed = tokio::time::timeout(DEADLINE, call)
            .await
            .expect("the call ends when the receiver dies")
            .unwrap()
            .expect_err("the receiver died before answering");
        // What docs/CROSS_HOST.md promises: the sender hears the link's end.
        assert!(
            matches!(failed, ActorError::LinkClosed { .. }),
            "the call fails with LinkClosed when the receiver dies: {failed:?}"
        );
        big.returned_within(DEADLINE)
            .await
            .expect("the sender's lease comes back");
        big.write_at(0, &[1, 2, 3]).unwrap();
        assert_eq!(a.status(0).leases, 0);
        drop(big);
        // The node keeps working: a second peer links, both ways.
        let (mut second, _l, to_c) = linked_listener(&a, &session, &ns, &[]).await;
        let taken = serve_echo_and_take(&a);
        echo_checked(&a, &to_c, 1 << 20, 4).await;
        push_checked(&to_c, 1 << 20, 5).await;
        assert_eq!(taken.load(Ordering::SeqCst), 1);
        close_and_reap(&to_c, &mut second).await;
        eventually(DEADLINE, "our buffers freed", || own_segments(&ns) == 0).await;
    });
}

#[test]
fn sigkill_of_the_sender_mid_transfer_frees_the_receivers_partial_copy() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-skill");
        let _sweep = Sweep(ns.clone());
        let a = node(&session, "a", &ns, None);
        let taken = serve_echo_and_take(&a);
        let mut listening = a.listen_tcp("127.0.0.1:0").unwrap();
        let link_at = listening.local_addr();
        let data_at = data_addr_of(&session, &ns, link_at).await;
        let _probe = listening.accept_timeout(DEADLINE).await.unwrap();
        // The helper reaches us through the proxy on 127.0.0.2: its link, and (at the
        // address the link reached) our data port, throttled.
        let proxy = tcp_proxy::Proxy::new();
        let ip2 = "127.0.0.2".parse().unwrap();
        let via = proxy.route(SocketAddr::new(ip2, 0), link_at, false);
        proxy.route(SocketAddr::new(ip2, data_at.port()), data_at, true);
        proxy.hold_after(16 << 20);
        let (mut child, lines) = host_peer(&session, &ns, "b", &["connect", &via.to_string()]);
        let to_b = listening.accept_timeout(DEADLINE).await.unwrap();
        lines.expect("linked", DEADLINE).await;
        assert_eq!(own_segments(&ns), 0);
        let push = actix::spawn(to_b.remote::<Push>("push").send_timeout(
            Push {
                len: IN_FLIGHT as u64,
                seed: 0,
            },
            Duration::from_secs(120),
        ));
        eventually(
            DEADLINE,
            "the partial copy allocated and bytes in flight",
            || own_segments(&ns) == 1 && proxy.forwarded() >= 16 << 20,
        )
        .await;
        child.kill9();
        let failed = tokio::time::timeout(DEADLINE, push)
            .await
            .expect("the call ends when the sender dies")
            .unwrap()
            .expect_err("the sender died before answering");
        assert_link_failure(&failed);
        eprintln!("the call failed with {failed:?}");
        eventually(DEADLINE, "the partial copy freed", || {
            own_segments(&ns) == 0
        })
        .await;
        assert_eq!(
            taken.load(Ordering::SeqCst),
            0,
            "no half copy was handed on"
        );
        let status = a.status(0);
        assert_eq!((status.buffers, status.leases), (0, 0));
        drop(proxy);
        // The node keeps working: a second peer links (directly), both ways.
        let (mut second, lines) = host_peer(&session, &ns, "c", &["connect", &link_at.to_string()]);
        let to_c = listening.accept_timeout(DEADLINE).await.unwrap();
        lines.expect("linked", DEADLINE).await;
        push_checked(&to_c, 1 << 20, 7).await;
        echo_checked(&a, &to_c, 1 << 20, 8).await;
        close_and_reap(&to_c, &mut second).await;
        eventually(DEADLINE, "our buffers freed", || own_segments(&ns) == 0).await;
    });
}

#[test]
fn a_silent_partition_is_cut_by_the_heartbeat_and_the_survivors_lease_comes_back() {
    run(async {
        let heartbeat = Heartbeat {
            interval: Duration::from_millis(250),
            deadline: Duration::from_secs(2),
        };
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-part");
        let _sweep = Sweep(ns.clone());
        let a = node(&session, "a", &ns, Some(heartbeat));
        let events = events(&a);
        let (mut child, lines) = host_peer(
            &session,
            &ns,
            "b",
            &["listen", "127.0.0.1:0", "--heartbeat-ms", "2000"],
        );
        let at: SocketAddr = lines.expect("listening ", DEADLINE).await.parse().unwrap();
        // Our link, and our copies' bytes, go through the proxy on 127.0.0.2.
        let proxy = tcp_proxy::Proxy::new();
        let ip2 = "127.0.0.2".parse().unwrap();
        let via = proxy.route(SocketAddr::new(ip2, 0), at, false);
        let to_b = tokio::time::timeout(DEADLINE, a.connect_tcp(via))
            .await
            .unwrap()
            .unwrap();
        lines.expect("linked", DEADLINE).await;
        let data = to_b.info().host().unwrap().data_addr.unwrap();
        assert_eq!(data.ip(), ip2);
        proxy.route(data, SocketAddr::new(at.ip(), data.port()), true);
        echo_checked(&a, &to_b, 4096, 1).await;
        proxy.hold_after(16 << 20);
        let big = a.allocate::<u8>(256 << 20).unwrap();
        let call = actix::spawn(to_b.remote::<Echo>("echo").send_timeout(
            Echo {
                seed: 0,
                data: big.share(),
            },
            Duration::from_secs(120),
        ));
        eventually(DEADLINE, "the copy in flight", || {
            a.status(0).leases == 1 && proxy.forwarded() >= 16 << 20
        })
        .await;
        // Silence, both ends open.
        proxy.partition();
        let cut_from = Instant::now();
        tokio::time::timeout(DEADLINE, to_b.closed())
            .await
            .expect("the heartbeat cuts the silent link");
        let took = cut_from.elapsed();
        eprintln!(
            "the partitioned link was cut {took:?} after the partition (deadline {:?})",
            heartbeat.deadline
        );
        let reason = events
            .down_reason(to_b.link_id())
            .expect("a Down event")
            .expect("not a clean close");
        assert!(
            reason.contains("Unresponsive"),
            "cut by the heartbeat: {reason}"
        );
        let failed = tokio::time::timeout(DEADLINE, call)
            .await
            .unwrap()
            .unwrap()
            .expect_err("the call over a cut link fails");
        assert_link_failure(&failed);
        big.returned_within(DEADLINE)
            .await
            .expect("the survivor's lease comes back");
        big.write_at(0, &[9]).unwrap();
        assert_eq!(a.status(0).leases, 0);
        // The helper's own heartbeat cuts its end too: it exits.
        assert!(exited(&mut child, DEADLINE).await.success());
        drop(big);
        drop(proxy);
        eventually(DEADLINE, "our buffers freed", || own_segments(&ns) == 0).await;
    });
}

#[test]
fn a_wrong_token_is_refused_before_any_message() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-token");
        let _sweep = Sweep(ns.clone());
        let b = node(&session, "b", &ns, None);
        let b_events = events(&b);
        let taken = serve_echo_and_take(&b);
        let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
        let stranger = node(&Session::generate().unwrap(), "a", &ns, None);
        let refused = tokio::time::timeout(DEADLINE, stranger.connect_tcp(listening.local_addr()))
            .await
            .expect("refused within the deadline")
            .expect_err("another session's token is refused");
        assert!(
            matches!(
                refused,
                ActorError::Ipc(baton::ipc::Error::Refused {
                    reason: baton::messages::protocol::RefuseReason::BadToken
                })
            ),
            "{refused:?}"
        );
        eprintln!("connect_tcp with another token: {refused:?}");
        eventually(DEADLINE, "the listener's Refused event", || {
            b_events
                .all()
                .iter()
                .any(|e| matches!(e, PeerEvent::Refused(_)))
        })
        .await;
        assert!(b.peers().is_empty(), "no link was made");
        assert!(stranger.peers().is_empty());
        assert_eq!(taken.load(Ordering::SeqCst), 0);
        // An honest peer (another process, on another host) links afterwards.
        let (mut child, lines) = host_peer(
            &session,
            &ns,
            "c",
            &[
                "drive",
                &listening.local_addr().to_string(),
                "--sizes",
                "4096",
            ],
        );
        let _c = listening.accept_timeout(DEADLINE).await.unwrap();
        lines.expect("done", DEADLINE).await;
        assert!(exited(&mut child, DEADLINE).await.success());
        assert_eq!(taken.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn rogue_clients_against_listen_tcp_leave_honest_peers_unharmed() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-rogue");
        let _sweep = Sweep(ns.clone());
        let b = node(&session, "b", &ns, None);
        let b_events = events(&b);
        let taken = serve_echo_and_take(&b);
        let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
        let at = listening.local_addr();
        // Rogues, on threads: random bytes, a huge length prefix, a truncated record, a
        // refusal record out of turn, and a thousand connections that say nothing.
        let rogues = std::thread::spawn(move || {
            use std::io::Write;
            let mut held = Vec::new();
            let mut random = vec![0u8; 64 << 10];
            rustix::rand::getrandom(&mut random, rustix::rand::GetRandomFlags::empty()).unwrap();
            let sends: [&[u8]; 5] = [
                &random,
                &[0xff, 0xff, 1, 2, 3],
                &[0, 48, 1, 2, 3, 4, 5],
                &[0, 0, 0xff, 0xff],
                &[0, 0],
            ];
            for _ in 0..4 {
                for bytes in sends {
                    if let Ok(mut s) = std::net::TcpStream::connect(at) {
                        let _ = s.write_all(bytes);
                        held.push(s);
                    }
                }
            }
            for _ in 0..1000 {
                if let Ok(s) = std::net::TcpStream::connect(at) {
                    held.push(s);
                }
            }
            held
        });
        // Honest peers in other processes, while the rogues come: each links and works
        // (its connect retried while the rogues fill the listener's handshake slots).
        let mut honest = Vec::new();
        for host in ["c", "d"] {
            honest.push(host_peer(
                &session,
                &ns,
                host,
                &["drive", &at.to_string(), "--sizes", "4096,1048576"],
            ));
        }
        let held = tokio::task::spawn_blocking(move || rogues.join().unwrap())
            .await
            .unwrap();
        for (child, lines) in &mut honest {
            lines.expect("done", Duration::from_secs(120)).await;
            assert!(exited(child, DEADLINE).await.success());
        }
        eprintln!(
            "{} rogue connections held; {} refusals reported",
            held.len(),
            b_events
                .all()
                .iter()
                .filter(|e| matches!(e, PeerEvent::Refused(_)))
                .count()
        );
        assert!(held.len() >= 1000);
        assert_eq!(
            taken.load(Ordering::SeqCst),
            2 * 2,
            "each honest peer's buffers were taken"
        );
        // Nothing but the honest peers ever linked.
        let ups = b_events.ups();
        assert_eq!(ups.len(), 2, "only the honest peers linked");
        drop(held);
        // And a third honest peer links after the rogues are gone.
        let (mut child, lines) = host_peer(
            &session,
            &ns,
            "e",
            &["drive", &at.to_string(), "--sizes", "4096"],
        );
        lines.expect("done", DEADLINE).await;
        assert!(exited(&mut child, DEADLINE).await.success());
        while listening
            .accept_timeout(Duration::from_millis(10))
            .await
            .is_ok()
        {}
    });
}

/// `baton-host-peer forge ARGS…` links to `listening` (at `at`) and is cut: the reason
/// `b`'s events give for its link's end.
async fn forger_cut(
    listening: &mut baton::actors::TcpListening,
    b_events: &Events,
    session: &Session,
    ns: &str,
    at: &str,
    forge: &[&str],
) -> String {
    let mut args = vec!["forge", at];
    args.extend_from_slice(forge);
    let (mut forger, lines) = host_peer(session, ns, "d", &args);
    let forged = listening.accept_timeout(DEADLINE).await.unwrap();
    lines.expect("cut", DEADLINE).await;
    assert!(exited(&mut forger, DEADLINE).await.success());
    eventually(DEADLINE, "the forged link's Down event", || {
        b_events.down_reason(forged.link_id()).is_some()
    })
    .await;
    b_events
        .down_reason(forged.link_id())
        .unwrap()
        .expect("cut with an error, not closed")
}

/// With an honest peer linked to `b` all along, `baton-host-peer forge` with `forge`
/// links to `listening` and is cut with an error naming `fault`; nothing of it reached
/// `take`, and the honest peer is unharmed (a push and an echo, then closed).
async fn a_forger_is_cut_alone(
    b: &Node,
    listening: &mut baton::actors::TcpListening,
    session: &Session,
    ns: &str,
    forge: &[&str],
    fault: &str,
    taken: &std::sync::atomic::AtomicUsize,
) {
    let b_events = events(b);
    let at = listening.local_addr().to_string();
    let (mut honest, honest_lines) = host_peer(session, ns, "c", &["connect", &at]);
    let to_honest = listening.accept_timeout(DEADLINE).await.unwrap();
    honest_lines.expect("linked", DEADLINE).await;
    let reason = forger_cut(listening, &b_events, session, ns, &at, forge).await;
    eprintln!("the forged link was cut: {reason}");
    assert!(reason.contains(fault), "{reason}");
    assert_eq!(taken.load(Ordering::SeqCst), 0);
    // Everyone else is unharmed.
    assert!(to_honest.is_connected());
    assert!(b_events.down_reason(to_honest.link_id()).is_none());
    push_checked(&to_honest, 1 << 20, 3).await;
    echo_checked(b, &to_honest, 1 << 20, 4).await;
    close_and_reap(&to_honest, &mut honest).await;
    eventually(DEADLINE, "our buffers freed", || own_segments(ns) == 0).await;
}

#[test]
fn an_offer_that_is_not_a_copy_cuts_only_that_host_link() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-forge");
        let _sweep = Sweep(ns.clone());
        let b = node(&session, "b", &ns, None);
        let taken = serve_echo_and_take(&b);
        let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
        // The forger offers a host segment's name (memory of *its* host) over a host link.
        a_forger_is_cut_alone(
            &b,
            &mut listening,
            &session,
            &ns,
            &[],
            "BackendMismatch",
            &taken,
        )
        .await;
    });
}

#[test]
fn messages_held_back_behind_a_copy_are_bounded_and_a_peer_past_the_bound_is_cut_alone() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-held");
        let _sweep = Sweep(ns.clone());
        let config = NodeConfig::new(session.clone())
            .hosts(HostSettings {
                host: HostId::named("b"),
                ..HostSettings::default()
            })
            .limits(LinkLimits {
                held_messages: 8,
                ..LinkLimits::default()
            });
        let b = Node::with_config(config, Arc::new(HostBackend::with_namespace(&ns).unwrap()));
        let taken = serve_echo_and_take(&b);
        let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
        // The forger's copy never lands; its calls without buffers wait behind it, in
        // order, until the ninth passes the bound.
        let held = ["--forge", "held"];
        a_forger_is_cut_alone(
            &b,
            &mut listening,
            &session,
            &ns,
            &held,
            "TooManyHeld",
            &taken,
        )
        .await;
    });
}

#[test]
fn engine_frames_a_host_memory_node_never_asked_for_cut_their_link_and_a_device_copy_is_refused() {
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-engine");
        let _sweep = Sweep(ns.clone());
        let b = node(&session, "b", &ns, None);
        let b_events = events(&b);
        let taken = serve_echo_and_take(&b);
        let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
        let at = listening.local_addr().to_string();
        let (mut honest, honest_lines) = host_peer(&session, &ns, "c", &["connect", &at]);
        let to_honest = listening.accept_timeout(DEADLINE).await.unwrap();
        honest_lines.expect("linked", DEADLINE).await;
        // A pull of a lease we never offered, and a rendezvous for an NCCL engine this
        // host-memory node does not run: each is the peer's fault, and cuts its link.
        for what in ["pull", "rendezvous"] {
            let forge = ["--forge", what];
            let reason = forger_cut(&mut listening, &b_events, &session, &ns, &at, &forge).await;
            eprintln!("a forged {what} cut its link: {reason}");
            assert!(reason.contains("Unexpected"), "{reason}");
        }
        // A device copy offered to a node of host memory: refused with a typed error (the
        // call fails, the lease goes back), the link unharmed.
        let (mut forger, lines) = host_peer(
            &session,
            &ns,
            "d",
            &["forge", &at, "--forge", "device-copy"],
        );
        let forged = listening.accept_timeout(DEADLINE).await.unwrap();
        lines.expect("answered Release", DEADLINE).await;
        let fault = lines.expect("reply ", DEADLINE).await;
        eprintln!("a device copy to a host-memory node: {fault}");
        assert!(
            fault.contains("OfferRefused") && fault.contains("nccl"),
            "{fault}"
        );
        assert!(exited(&mut forger, DEADLINE).await.success());
        eventually(DEADLINE, "the refusing link's end", || {
            b_events.down_reason(forged.link_id()).is_some()
        })
        .await;
        assert!(
            b_events.down_reason(forged.link_id()).unwrap().is_none(),
            "a refused device copy is no fault of the link"
        );
        assert_eq!(taken.load(Ordering::SeqCst), 0);
        // Everyone else is unharmed.
        assert!(to_honest.is_connected());
        push_checked(&to_honest, 1 << 20, 3).await;
        echo_checked(&b, &to_honest, 1 << 20, 4).await;
        close_and_reap(&to_honest, &mut honest).await;
        eventually(DEADLINE, "our buffers freed", || own_segments(&ns) == 0).await;
    });
}
