//! The copies findings of issue 45 (see the binary's docs): the TCP engine's data
//! connections and the leases of host copies.
//!
//! - Finding 2: a data connection belongs to the host link whose key opened it — a second
//!   node (its own key, the same token) that claims the sender's process cannot land its
//!   bytes in the receive posted for the sender's copy: its connection is refused.
//! - Finding 7: a receiver that gives a host copy's lease back before the bytes landed
//!   does not end it while the sender's engine still reads the buffer: the send is
//!   stopped first.
//! - Finding 8: data connections are capped (in all, per key), idle ones closed, and the
//!   copies in flight of all a node's links bounded together.

use crate::actors::{DEADLINE, run};
use crate::host_msgs::{Take, is_pattern, pattern_bytes};
use crate::peer::poll_until;
use baton::Session;
use baton::actors::{HostSettings, LinkLimits, Node, NodeConfig};
use baton::ipc::tcp::{HostId, HostLink, NodeKey, NodePublicKey, TcpConfig, remote_process};
use baton::ipc::transfer::{
    DataLimits, DataRefusal, EnginePeer, Region, TcpEngine, Transfer, TransferEngine, TransferId,
};
use baton::ipc::{Error as IpcError, HostBackend};
use baton::messages::Message;
use baton::messages::protocol::Release;
use std::sync::Arc;

#[path = "../support/tcp_proxy.rs"]
mod tcp_proxy;
use std::time::Duration;

const STALL: Duration = Duration::from_secs(30);

/// A TCP engine of its own key: the engine, and its key.
fn engine(session: &Session) -> (TcpEngine, NodePublicKey) {
    let key = NodeKey::generate().unwrap();
    let public = key.public();
    let config = TcpConfig::new(session.clone(), key);
    (
        TcpEngine::bind("127.0.0.1:0", config, STALL).unwrap(),
        public,
    )
}

/// `e` (of key `key`) as a host link to it knows it: its claim in its key's namespace.
fn known(e: &TcpEngine, key: &NodePublicKey) -> EnginePeer {
    let peer = e.as_peer();
    assert_eq!(
        peer.process,
        remote_process(key, Session::generate().unwrap().process()),
        "as_peer names the engine in its key's namespace"
    );
    peer
}

/// Sends `src` from `from` to `to` as transfer `id`.
fn send(from: &TcpEngine, to: &EnginePeer, id: u64, src: &mut [u8]) -> Transfer {
    // SAFETY: every caller waits for the transfer before `src` goes.
    unsafe { from.send(to, TransferId(id), Region::of_slice(src)) }.unwrap()
}

/// Receives transfer `id` from `from` into `dst`.
fn recv(on: &TcpEngine, from: &EnginePeer, id: u64, dst: &mut [u8]) -> Transfer {
    // SAFETY: every caller waits for the transfer before `dst` goes.
    unsafe { on.recv(from, TransferId(id), Region::of_slice(dst)) }.unwrap()
}

fn refused(r: Result<(), IpcError>, why: DataRefusal) {
    match r {
        Err(IpcError::DataConnectionRefused { why: got }) if got == why => {}
        other => panic!("refused with {why:?}: {other:?}"),
    }
}

/// Finding 2. The receiver's node has a host link to A (admits A's key and process) and
/// posts the receive of A's copy; M — another node with its own key and the same token —
/// claims A's process and sends forged bytes under the same transfer id, first. M's data
/// connection is refused (typed, `NoHostLink`: no host link has its key), so the real copy
/// lands intact: the receive is matched only by a connection of A's key.
#[test]
fn a_data_connection_claiming_the_senders_process_never_lands_in_its_receive() {
    let session = Session::generate().unwrap();
    let (receiver, r_key) = engine(&session);
    let (a, a_key) = engine(&session);
    let a_claim = a.as_peer().process;
    // M announces A's process (in one test process they are the same anyway).
    let (m, _) = engine(&session.clone().claiming(a_claim));
    receiver.admit(&known(&a, &a_key), a_key);

    let to_r = known(&receiver, &r_key);
    let mut forged = vec![0xEE; 1 << 20];
    let forging = send(&m, &to_r, 7, &mut forged);
    // M's connection is in (handshake done) before the real receive is posted.
    poll_until(DEADLINE, "the forger's data connection", || {
        receiver.data_connections() >= 1
    });
    let mut dst = vec![0u8; 1 << 20];
    let landing = recv(&receiver, &known(&a, &a_key), 7, &mut dst);
    refused(forging.wait(DEADLINE), DataRefusal::NoHostLink);
    assert!(!landing.is_finished(), "nothing of M's reached the receive");

    let mut real = pattern_bytes(3, 1 << 20);
    let sending = send(&a, &to_r, 7, &mut real);
    landing.wait(DEADLINE).expect("the real copy lands");
    sending.wait(DEADLINE).expect("and its sender hears it");
    assert!(is_pattern(3, &dst), "the real bytes, intact");
    poll_until(DEADLINE, "the forger's connection closed", || {
        receiver.data_connections() == 1
    });
}

/// Finding 8, the cap. A receiver that takes two data connections, one per key: a second
/// connection of a key already in is refused (`FullForKey`), a third key's is refused
/// (`Full`), and the honest connections carry on.
#[test]
fn more_data_connections_than_the_cap_are_refused_and_honest_transfers_still_land() {
    let session = Session::generate().unwrap();
    let (receiver, r_key) = engine(&session);
    receiver.set_data_limits(DataLimits {
        connections: 2,
        per_key: 1,
        ..DataLimits::default()
    });
    let to_r = known(&receiver, &r_key);
    let (s1, k1) = engine(&session);
    let (s2, k2) = engine(&session);
    let (s3, k3) = engine(&session);
    // Another process of s1's key (its own claim).
    let twin_key = NodeKey::generate().unwrap();
    let mut other = s1.as_peer().process;
    other.pid = other.pid.wrapping_add(1);
    let twin_config = TcpConfig::new(session.clone().claiming(other), twin_key.clone());
    let twin = TcpEngine::bind("127.0.0.1:0", twin_config, STALL).unwrap();
    let twin_known = EnginePeer {
        process: remote_process(&twin_key.public(), other),
        ..twin.as_peer()
    };
    // The twin shares s1's key: made from the same key pair.
    let (s1, k1) = {
        drop(s1);
        let config = TcpConfig::new(session.clone(), twin_key.clone());
        let e = TcpEngine::bind("127.0.0.1:0", config, STALL).unwrap();
        let _ = k1;
        (e, twin_key.public())
    };
    for (e, k) in [(&s1, &k1), (&s2, &k2), (&s3, &k3)] {
        receiver.admit(&known(e, k), *k);
    }
    receiver.admit(&twin_known, twin_key.public());

    let lands = |from: &TcpEngine, from_known: &EnginePeer, id: u64| {
        let mut src = pattern_bytes(id as u8, 4096);
        let mut dst = vec![0u8; 4096];
        let r = recv(&receiver, from_known, id, &mut dst);
        let s = send(from, &to_r, id, &mut src);
        r.wait(DEADLINE).expect("lands");
        s.wait(DEADLINE).expect("its sender hears it");
        assert_eq!(src, dst);
    };
    lands(&s1, &known(&s1, &k1), 1);
    let mut src = vec![1u8; 4096];
    refused(
        send(&twin, &to_r, 2, &mut src).wait(DEADLINE),
        DataRefusal::FullForKey,
    );
    lands(&s2, &known(&s2, &k2), 3);
    assert_eq!(receiver.data_connections(), 2);
    let mut src = vec![1u8; 4096];
    refused(
        send(&s3, &to_r, 4, &mut src).wait(DEADLINE),
        DataRefusal::Full,
    );
    // The honest connections carry on.
    lands(&s1, &known(&s1, &k1), 5);
    lands(&s2, &known(&s2, &k2), 6);
    assert_eq!(receiver.data_connections(), 2);
}

/// Finding 8, the idle deadline. A data connection that carries nothing for the
/// receiver's idle deadline is closed (its thread ends); the sender's next transfer
/// connects again and lands.
#[test]
fn an_idle_data_connection_is_closed_after_the_deadline() {
    let session = Session::generate().unwrap();
    let (receiver, r_key) = engine(&session);
    receiver.set_data_limits(DataLimits {
        idle: Duration::from_millis(300),
        ..DataLimits::default()
    });
    let (s, k) = engine(&session);
    receiver.admit(&known(&s, &k), k);
    let to_r = known(&receiver, &r_key);
    for id in 1..=2 {
        let mut src = pattern_bytes(id as u8, 4096);
        let mut dst = vec![0u8; 4096];
        let r = recv(&receiver, &known(&s, &k), id, &mut dst);
        let t = send(&s, &to_r, id, &mut src);
        r.wait(DEADLINE).expect("lands");
        t.wait(DEADLINE).expect("its sender hears it");
        assert_eq!(src, dst);
        assert_eq!(receiver.data_connections(), 1);
        poll_until(DEADLINE, "the idle data connection closed", || {
            receiver.data_connections() == 0
        });
    }
}

fn host_node(session: &Session, host: &str, limits: LinkLimits) -> Node {
    let config = NodeConfig::new(session.clone())
        .hosts(HostSettings {
            host: HostId::named(host),
            ..HostSettings::default()
        })
        .limits(limits);
    Node::with_config(config, Arc::new(HostBackend::new().unwrap()))
}

/// A copy whose receiver gave its lease back while the sender's engine still wrote it: a
/// raw host-link peer (it speaks the wire protocol itself) takes a copy of a 64 MiB buffer;
/// its engine (behind a proxy that holds the bytes after 2 MiB) admits the sender's data
/// connection but posts no receive, so the sender's engine is still writing the buffer's
/// bytes when the peer sends `Release` of the copy's lease, then a ping: the pong says the
/// link took the release without a cut.
struct ReleasedMidSend {
    ours: Node,
    peer: baton::actors::Peer,
    buf: baton::actors::Buffer<u8>,
    engine: TcpEngine,
    us: EnginePeer,
    link: HostLink,
    proxy: tcp_proxy::Proxy,
    lease: baton::messages::LeaseId,
    len: usize,
}

impl ReleasedMidSend {
    /// The scene, on a node whose links give an early-released send `grace` to finish.
    async fn new(tag: &str, grace: Duration) -> Self {
        let session = Session::generate().unwrap();
        let limits = LinkLimits {
            early_release_grace: grace,
            ..LinkLimits::default()
        };
        let ours = host_node(&session, &format!("{tag}-a"), limits);
        let mut listening = ours.listen_tcp("127.0.0.1:0").unwrap();
        let addr = listening.local_addr();

        let key = NodeKey::generate().unwrap();
        let config =
            TcpConfig::new(session.clone(), key.clone()).host(HostId::named(&format!("{tag}-m")));
        // Its data port is a proxy's, which holds the bytes after 2 MiB: once 1 MiB has
        // passed, the sender's engine is surely mid-payload, reading the buffer.
        let proxy = tcp_proxy::Proxy::new();
        proxy.hold_after(2 << 20);
        let (engine, us, link) = tokio::task::spawn_blocking(move || {
            let e =
                TcpEngine::bind("127.0.0.1:0", config.clone(), Duration::from_secs(120)).unwrap();
            let via = proxy.route("127.0.0.1:0".parse().unwrap(), e.data_addr(), true);
            let config = config.data_port(via.port());
            let link = HostLink::connect(addr, &config).unwrap();
            // It welcomes our data connection, and posts no receive (yet).
            let peer = link.peer();
            let us = EnginePeer {
                process: peer.process,
                host: peer.host,
                data_addr: None,
            };
            e.admit(&us, peer.key);
            (e, us, (link, proxy))
        })
        .await
        .unwrap();
        let peer = listening.accept_timeout(DEADLINE).await.unwrap();

        let len = 64 << 20;
        let buf = ours.allocate::<u8>(len).unwrap();
        buf.write_at(0, &pattern_bytes(5, len)).unwrap();
        let take = peer.remote::<Take>("take");
        let share = buf.share();
        actix::spawn(async move {
            let _ = take
                .send(Take {
                    seed: 5,
                    data: share,
                })
                .await;
        });

        // The peer reads the call, gives the copy's lease back once the bytes flow, and
        // pings: the pong says the link took the early release without a cut.
        let (link, proxy) = link;
        let (link, proxy, lease) = tokio::task::spawn_blocking(move || {
            let mut link = link;
            let lease = loop {
                let got = link.recv_timeout(DEADLINE).unwrap();
                if let Message::Call(call) = got.message {
                    break call.offers[0].lease;
                }
            };
            poll_until(DEADLINE, "the copy's bytes flowing", || {
                proxy.forwarded() >= 1 << 20
            });
            link.send(
                &Message::Release(Release {
                    lease,
                    fences: Vec::new(),
                }),
                &[],
            )
            .unwrap();
            link.send(&Message::Ping(4545), &[]).unwrap();
            loop {
                if let Message::Pong(4545) = link.recv_timeout(DEADLINE).unwrap().message {
                    break (link, proxy, lease);
                }
            }
        })
        .await
        .unwrap();
        Self {
            ours,
            peer,
            buf,
            engine,
            us,
            link,
            proxy,
            lease,
            len,
        }
    }

    /// The peer posts the receive and the proxy lets the held bytes through: the
    /// receive's outcome, and the bytes.
    async fn receive(self) -> (Result<(), IpcError>, Vec<u8>, Self) {
        tokio::task::spawn_blocking(move || {
            let mut dst = vec![0u8; self.len];
            let r = recv(&self.engine, &self.us, self.lease.get(), &mut dst);
            self.proxy.hold_after(u64::MAX);
            let landed = r.wait(DEADLINE);
            drop(r);
            (landed, dst, self)
        })
        .await
        .unwrap()
    }
}

/// Finding 7. A receiver that gives a copy's lease back while the sender's engine still
/// writes it, and then lets the send hang past the grace, has the send stopped: the lease
/// must not simply be dropped from the books while the engine reads on. The send is
/// stopped first (an abort, which returns once no engine thread touches the buffer — the
/// ordering `abort_waits_until_no_thread_touches_the_memory` in `baton-ipc` proves), and
/// only then does the lease end. Seen from outside: the link lives on, the lease ends
/// without the peer's engine going, and a receive the peer posts afterwards (the proxy
/// letting the held bytes through) fails short of the payload — the send was cut, not
/// forgotten.
#[test]
fn an_early_release_of_a_host_copy_stops_the_send_before_the_lease_ends() {
    run(async {
        let grace = Duration::from_millis(200);
        let scene = ReleasedMidSend::new("copies-early", grace).await;
        // The lease ends with the peer's engine and the proxy still holding the bytes: the
        // send was stopped (nothing else could end it).
        scene
            .buf
            .returned_within(DEADLINE)
            .await
            .expect("the lease ends once the send is stopped");
        assert_eq!(scene.buf.leases_out(), 0);
        let (landed, _, scene) = scene.receive().await;
        assert!(
            matches!(landed, Err(IpcError::TransferPeerGone { .. })),
            "the stopped send delivers no whole payload: {landed:?}"
        );
        let ReleasedMidSend { peer, link, .. } = scene;
        drop(link);
        peer.close_and_wait().await;
    });
}

/// A receiver's `Release` can come before the sender heard that its send finished (an
/// NCCL receive completes before the send's completion is seen; on two H200s every copy
/// of 4 KiB raced so, and stopping the send aborted the link's communicator). Within
/// `LinkLimits::early_release_grace` the send goes on: here the peer releases while the
/// bytes are held, then posts its receive — the whole payload lands, exactly, and the
/// lease ends after, the link unharmed.
#[test]
fn a_release_that_comes_before_the_send_is_seen_finished_lets_the_send_finish() {
    run(async {
        let scene = ReleasedMidSend::new("copies-grace", Duration::from_secs(120)).await;
        // Released, and still out: the send goes on within the grace.
        assert_eq!(scene.buf.leases_out(), 1, "the send was not stopped");
        let (landed, bytes, scene) = scene.receive().await;
        landed.expect("the whole payload lands");
        assert!(is_pattern(5, &bytes), "the payload lands exactly");
        scene
            .buf
            .returned_within(DEADLINE)
            .await
            .expect("the lease ends once the send finished");
        assert_eq!(scene.buf.leases_out(), 0);
        let ReleasedMidSend {
            ours,
            peer,
            mut link,
            ..
        } = scene;
        // The link took all of it without a cut.
        tokio::task::spawn_blocking(move || {
            link.send(&Message::Ping(4646), &[]).unwrap();
            loop {
                if let Message::Pong(4646) = link.recv_timeout(DEADLINE).unwrap().message {
                    break;
                }
            }
            drop(link);
        })
        .await
        .unwrap();
        peer.close_and_wait().await;
        drop(ours);
    });
}

/// A raw host-link peer of its own key on host `host` that offers the node at `addr` a host
/// copy of `len` bytes in a call to "take" and never sends the bytes: the copy stays in
/// flight until its deadline. Returns once the node has handled the call (a ping sent after
/// it came back), with the link (keep it: dropping it ends the link), the call id and what
/// the node sent before that pong (a refusal of the call comes at once).
fn copy_never_sent(
    session: &Session,
    host: &str,
    addr: std::net::SocketAddr,
    len: u64,
) -> (HostLink, u64, Vec<Message>) {
    use baton::messages::protocol::{Call, Offer};
    use baton::messages::{
        ActorId, AllocationId, BackendKind, CopyEngine, DType, DeviceUuid, ExporterId, Generation,
        HandleDigest, HandleMsg, Layout, LeaseId, PROTOCOL_VERSION, RawHandle, Shape,
    };
    let config = TcpConfig::new(session.clone(), NodeKey::generate().unwrap())
        .host(HostId::named(host))
        .data_port(9);
    let mut link = HostLink::connect(addr, &config).unwrap();
    let handle = HandleMsg {
        version: PROTOCOL_VERSION,
        exporter: ExporterId {
            process: session.process(),
            actor: ActorId::new(0),
        },
        alloc: AllocationId::new(1),
        generation: Generation::FIRST,
        backend: BackendKind::Host,
        device: DeviceUuid::HOST,
        alloc_size: len,
        offset: 0,
        len,
        layout: Some(Layout::new(DType::U8, Shape::new([len]).unwrap())),
        raw: RawHandle::Copy {
            engine: CopyEngine::Tcp,
        },
        fence: None,
        digest: HandleDigest::default(),
    }
    .sealed(session.handle_key());
    let id = 1;
    link.send(
        &Message::Call(Call {
            id,
            target: "take".into(),
            type_name: <Take as baton::actors::RemoteMessage>::NAME.into(),
            payload: Vec::new(),
            offers: vec![Offer {
                lease: LeaseId::new(1),
                handle,
            }],
        }),
        &[],
    )
    .unwrap();
    // The link handles its frames in order: once the pong is back, the call was.
    link.send(&Message::Ping(77), &[]).unwrap();
    let mut before = Vec::new();
    loop {
        match link.recv_timeout(DEADLINE).unwrap().message {
            Message::Pong(77) => break,
            Message::Ping(n) => link.send(&Message::Pong(n), &[]).unwrap(),
            other => before.push(other),
        }
    }
    (link, id, before)
}

/// Finding 8, the node's part: the copies a node receives at once are bounded across all
/// its links together, not only per link. Two token holders of their own keys each offer
/// a copy within the per-link budget and never send its bytes: the first is taken (its
/// receive posted, its bytes in flight), the second would pass the node's budget and is
/// refused, typed, its link kept — while the first is still in flight.
#[test]
fn two_links_together_cannot_pass_the_nodes_copy_budget() {
    use baton::messages::protocol::{CallFault, Reply};
    run(async {
        let session = Session::generate().unwrap();
        let ours = host_node(
            &session,
            "copies-budget-a",
            LinkLimits {
                copy_bytes: 3 << 20,
                node_copy_bytes: 4 << 20,
                ..LinkLimits::default()
            },
        );
        let mut listening = ours.listen_tcp("127.0.0.1:0").unwrap();
        let addr = listening.local_addr();
        let (s1, s2) = (session.clone(), session.clone());
        let (first, _, _) = tokio::task::spawn_blocking(move || {
            copy_never_sent(&s1, "copies-budget-m1", addr, 3 << 20)
        })
        .await
        .unwrap();
        let first_seen = listening.accept_timeout(DEADLINE).await.unwrap();
        let (mut second, id, before) = tokio::task::spawn_blocking(move || {
            copy_never_sent(&s2, "copies-budget-m2", addr, 2 << 20)
        })
        .await
        .unwrap();
        let second_seen = listening.accept_timeout(DEADLINE).await.unwrap();
        let early = before.into_iter().find_map(|m| match m {
            Message::Reply(r) => Some(r),
            _ => None,
        });
        let reply = tokio::task::spawn_blocking(move || {
            if let Some(r) = early {
                return (r, second);
            }
            loop {
                match second.recv_timeout(DEADLINE).unwrap().message {
                    Message::Reply(r) => return (r, second),
                    Message::Ping(n) => second.send(&Message::Pong(n), &[]).unwrap(),
                    _ => {}
                }
            }
        })
        .await
        .unwrap();
        let (
            Reply {
                id: answered,
                outcome,
            },
            second,
        ) = reply;
        assert_eq!(answered, id);
        match outcome {
            Err(CallFault::OfferRefused(why)) => {
                assert!(why.contains("node_copy_bytes"), "{why}")
            }
            other => panic!("refused past the node's budget, typed: {other:?}"),
        }
        assert!(second_seen.is_connected(), "the refused link is kept");
        assert!(
            first_seen.is_connected(),
            "and so is the one whose copy is in flight"
        );
        drop((first, second));
    });
}
