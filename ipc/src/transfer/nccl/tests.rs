//! The engine against the fake NCCL: two engines whose rendezvous messages travel through
//! a pump thread (the control plane), data checked both ways; the watchdog and the abort
//! paths: deadlines, asynchronous errors, `abort_peer`, peer deaths — nothing hangs.

use super::fake::{Call, Fabric, FakeNccl};
use super::*;
use baton_messages::BootId;
use std::net::SocketAddr;
use std::sync::mpsc;

pub(super) fn peer(n: u8) -> EnginePeer {
    EnginePeer {
        process: ProcessId {
            boot: BootId([n; 16]),
            pid: u32::from(n),
            start_ticks: 1,
        },
        host: HostId([n; 32]),
        data_addr: None,
    }
}

/// Where node `n`'s host is (its host link's address, and its NCCL bootstrap's).
pub(super) fn addr_of(n: u8) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, n], 40_000 + u16::from(n)))
}

/// A host buffer posing as device memory for the fake.
fn region(buf: &mut [u8]) -> Region {
    Region {
        ptr: MemPtr::Device(buf.as_mut_ptr() as u64),
        len: buf.len(),
        device: None,
    }
}

/// Moves `src` from node 1 to node 2's `dst` as transfer `id`, and checks it landed.
fn move_checked(pair: &Pair, id: u64, src: &mut [u8], dst: &mut [u8]) {
    // SAFETY: the buffers outlive the waits, which end the transfers.
    let s = unsafe { pair.a.send(&peer(2), TransferId(id), region(src)) }.unwrap();
    // SAFETY: as above.
    let r = unsafe { pair.b.recv(&peer(1), TransferId(id), region(dst)) }.unwrap();
    ended(&s, soon()).unwrap();
    ended(&r, soon()).unwrap();
    assert_eq!(dst, src);
}

/// How long a test waits for a transfer that must end.
fn soon() -> Duration {
    Duration::from_secs(10)
}

/// Waits at most `within` for `t` to end; one still running then is aborted before this
/// returns (a wait that times out leaves a transfer running), so a test that fails here
/// never lets go of memory NCCL may still touch.
pub(super) fn ended(t: &Transfer, within: Duration) -> Result<()> {
    let r = t.wait(within);
    if !t.is_finished() {
        t.abort();
    }
    r
}

struct Pair {
    a: Arc<NcclEngine>,
    b: Arc<NcclEngine>,
    fabric: Arc<Mutex<Fabric>>,
}

impl Pair {
    /// Engines for nodes 1 (`a`, rank 0) and 2 (`b`) on one fake fabric, their rendezvous
    /// carried by a pump thread.
    fn new(config: NcclConfig) -> Self {
        let fabric = Arc::new(Mutex::new(Fabric::default()));
        let (tx, rx) = mpsc::channel::<(EnginePeer, Vec<u8>)>();
        let sink = |from: EnginePeer| -> RendezvousSink {
            let tx = tx.clone();
            Arc::new(move |to: &EnginePeer, bytes: Vec<u8>| {
                let _ = tx.send((*to, [from_bytes(&from), bytes].concat()));
            })
        };
        let fake = |device| {
            Arc::new(FakeNccl {
                fabric: fabric.clone(),
                device,
                addr: addr_of(device as u8),
            })
        };
        let a = Arc::new(NcclEngine::with_nccl(
            fake(1),
            &peer(1),
            config,
            sink(peer(1)),
        ));
        let b = Arc::new(NcclEngine::with_nccl(
            fake(2),
            &peer(2),
            config,
            sink(peer(2)),
        ));
        drop(tx);
        let (pa, pb) = (Arc::downgrade(&a), Arc::downgrade(&b));
        // Ends when both engines (and their sinks) are dropped.
        std::thread::spawn(move || {
            for (to, msg) in rx {
                let from = if msg[0] == 1 { peer(1) } else { peer(2) };
                let engine = if to == peer(1) {
                    pa.upgrade()
                } else {
                    pb.upgrade()
                };
                if let Some(e) = engine {
                    e.on_rendezvous(&from, addr_of(msg[0]).ip(), &msg[1..])
                        .expect("a good rendezvous");
                }
            }
        });
        Self { a, b, fabric }
    }

    fn fabric(&self) -> MutexGuard<'_, Fabric> {
        self.fabric.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The pump's envelope: which node a message is from.
fn from_bytes(from: &EnginePeer) -> Vec<u8> {
    vec![from.host.0[0]]
}

fn fast() -> NcclConfig {
    NcclConfig {
        transfer_limit: Duration::from_secs(10),
        rendezvous_timeout: Duration::from_secs(10),
        poll_interval: Duration::from_millis(1),
        abort_wait: Duration::from_secs(10),
    }
}

#[test]
fn without_nccl_every_entry_point_is_typed_unavailable() {
    match available() {
        // A machine with NCCL: it loaded and is new enough.
        Ok(version) => assert!(version >= 21900),
        Err(e) => {
            assert!(matches!(e, Error::NcclUnavailable { .. }), "{e}");
            assert!(e.to_string().contains("NCCL"), "{e}");
            let made = NcclEngine::new(0, &peer(1), NcclConfig::default(), Arc::new(|_, _| {}));
            assert!(matches!(made, Err(Error::NcclUnavailable { .. })));
        }
    }
}

#[test]
fn rendezvous_messages_decode_or_are_refused() {
    let uid = UniqueId([7; 128]);
    let offer = Offer { serial: 3, seen: 2 };
    let bytes = encode_rendezvous(Dir::Out, offer, &uid);
    let (dir, o, u) = decode_rendezvous(&bytes).unwrap();
    assert_eq!((dir, o, u), (Dir::In, offer, uid));
    for bad in [
        &bytes[..10],
        &[bytes.as_slice(), &[0]].concat()[..],
        &[b"XXXX".as_slice(), &bytes[4..]].concat()[..],
    ] {
        assert!(matches!(
            decode_rendezvous(bad),
            Err(Error::BadRendezvous { .. })
        ));
    }
    let mut bad_dir = bytes.clone();
    bad_dir[4] = 9;
    assert!(decode_rendezvous(&bad_dir).is_err());
}

#[test]
fn buffers_move_both_ways_on_one_communicator_per_direction() {
    let pair = Pair::new(fast());
    let (a, b) = (&pair.a, &pair.b);
    for (i, len) in [1usize, 7, 4096, 1 << 20].into_iter().enumerate() {
        let id = TransferId(i as u64);
        let mut src: Vec<u8> = (0..len).map(|x| (x * 31 + i) as u8).collect();
        let mut reply: Vec<u8> = src.iter().map(|x| !x).collect();
        let mut dst = vec![0u8; len];
        let mut back = vec![0u8; len];
        // SAFETY: the buffers outlive the waits below, which end every transfer.
        let s = unsafe { a.send(&peer(2), id, region(&mut src)) }.unwrap();
        // SAFETY: as above.
        let r = unsafe { b.recv(&peer(1), id, region(&mut dst)) }.unwrap();
        // SAFETY: as above.
        let s2 = unsafe { b.send(&peer(1), id, region(&mut reply)) }.unwrap();
        // SAFETY: as above.
        let r2 = unsafe { a.recv(&peer(2), id, region(&mut back)) }.unwrap();
        for t in [&s, &r, &s2, &r2] {
            ended(t, soon()).unwrap();
        }
        assert_eq!(dst, src);
        assert_eq!(back, reply);
        assert!(s.is_finished() && r2.is_finished());
    }
    assert_eq!(a.phase(&peer(2), Dir::Out), Phase::Ready(Attempt(1)));
    let f = pair.fabric();
    let inits = f
        .calls
        .iter()
        .filter(|c| matches!(c, Call::Init { .. }))
        .count();
    assert_eq!(inits, 4, "two communicators, two ranks each, made once");
    assert_eq!(f.aborts(), 0);
    let ranks: Vec<u8> = (f.calls.iter())
        .filter_map(|c| match c {
            Call::Init { rank, .. } => Some(*rank),
            _ => None,
        })
        .collect();
    assert_eq!(ranks.iter().filter(|r| **r == 0).count(), 2);
}

#[test]
fn a_stuck_transfer_is_aborted_at_its_deadline_and_a_fresh_comm_follows() {
    let mut config = fast();
    // Short enough for the held transfer, long enough for the fresh one on a loaded
    // 2-core CI machine (100 ms ran out there once, with the engine well).
    config.transfer_limit = Duration::from_secs(1);
    let pair = Pair::new(config);
    let mut src = vec![1u8; 64];
    let mut dst = vec![0u8; 64];
    pair.fabric().hold = true;
    // SAFETY: the buffers outlive the waits, which end the transfers.
    let s = unsafe { pair.a.send(&peer(2), TransferId(1), region(&mut src)) }.unwrap();
    // SAFETY: as above.
    let r = unsafe { pair.b.recv(&peer(1), TransferId(1), region(&mut dst)) }.unwrap();
    // Whichever side's deadline came first aborted its communicator; the other side's
    // then failed (or timed out too).
    let errors = [
        ended(&s, soon()).unwrap_err(),
        ended(&r, soon()).unwrap_err(),
    ];
    assert!(
        (errors.iter()).any(|e| matches!(
            e,
            Error::Timeout {
                op: "NCCL transfer",
                ..
            }
        )),
        "{errors:?}"
    );
    assert!(
        (errors.iter()).all(|e| matches!(e, Error::Timeout { .. } | Error::TransferFailed { .. })),
        "{errors:?}"
    );
    assert_eq!(
        pair.fabric().live_ops(),
        0,
        "nothing touches memory after the abort"
    );
    assert!(pair.fabric().aborts() >= 1);
    // Released: the next transfer makes a new communicator and lands.
    pair.fabric().hold = false;
    move_checked(&pair, 2, &mut src, &mut dst);
}

#[test]
fn an_async_error_fails_the_comms_transfers_and_aborts_it() {
    let pair = Pair::new(fast());
    let mut src = vec![1u8; 64];
    let mut dst = vec![0u8; 64];
    pair.fabric().hold = true;
    // SAFETY: the buffers outlive the waits.
    let s = unsafe { pair.a.send(&peer(2), TransferId(1), region(&mut src)) }.unwrap();
    // SAFETY: as above.
    let r = unsafe { pair.b.recv(&peer(1), TransferId(1), region(&mut dst)) }.unwrap();
    // Wait until both ran on a ready communicator, then break it.
    let deadline = Instant::now() + soon();
    while (pair.fabric().calls.iter())
        .filter(|c| matches!(c, Call::Send { .. } | Call::Recv { .. }))
        .count()
        < 2
    {
        assert!(Instant::now() < deadline, "the transfers never launched");
        std::thread::sleep(Duration::from_millis(1));
    }
    pair.fabric().raise_error();
    for t in [&s, &r] {
        let e = ended(t, soon()).unwrap_err();
        assert!(matches!(e, Error::TransferFailed { .. }), "{e}");
    }
    assert_eq!(pair.fabric().live_ops(), 0);
    assert_eq!(
        pair.fabric().aborts(),
        2,
        "each side aborted its communicator"
    );
    assert_eq!(
        pair.fabric()
            .calls
            .iter()
            .filter(|c| **c == Call::UniqueId)
            .count(),
        1
    );
}

#[test]
fn abort_peer_returns_once_nothing_touches_memory() {
    let pair = Pair::new(fast());
    pair.fabric().hold = true;
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 256]).collect();
    let transfers: Vec<Transfer> = bufs
        .iter_mut()
        .enumerate()
        // SAFETY: the buffers outlive abort_peer, which ends every transfer.
        .map(|(i, b)| unsafe { pair.a.send(&peer(2), TransferId(i as u64), region(b)) }.unwrap())
        .collect();
    let a = pair.a.clone();
    std::thread::spawn(move || a.abort_peer(&peer(2)))
        .join()
        .unwrap();
    assert!(transfers.iter().all(Transfer::is_finished));
    for t in &transfers {
        assert!(matches!(
            ended(t, soon()),
            Err(Error::TransferAborted { .. })
        ));
    }
    let f = pair.fabric();
    let a_ops_live = f.live_ops();
    drop(f);
    // Only a's side is aborted; b's receive side never launched anything.
    assert_eq!(
        a_ops_live, 0,
        "abort_peer returned while an operation could still run"
    );
}

#[test]
fn an_abort_that_hangs_holds_no_caller_and_keeps_its_transfers_memory_until_it_returns() {
    let pair = Pair::new(NcclConfig {
        abort_wait: Duration::from_millis(200),
        ..fast()
    });
    pair.fabric().hold = true;
    let mut buf = vec![0u8; 64];
    // SAFETY: the buffer outlives the transfer: the test waits until nothing touches it.
    let t = unsafe { pair.a.send(&peer(2), TransferId(1), region(&mut buf)) }.unwrap();
    // Launched: its communicator is up and its operation runs (held).
    let start = Instant::now();
    while pair.fabric().live_ops() == 0 {
        assert!(start.elapsed() < soon(), "the send never launched");
        std::thread::sleep(Duration::from_millis(1));
    }
    pair.fabric().hang_aborts = true;
    // The caller goes on after abort_wait, though NCCL's abort has not returned…
    let a = pair.a.clone();
    let start = Instant::now();
    std::thread::spawn(move || a.abort_peer(&peer(2)))
        .join()
        .unwrap();
    assert!(
        start.elapsed() < soon(),
        "abort_peer waited on a hanging abort"
    );
    // …and the transfer still counts as touching its memory: its owner keeps it.
    assert!(!t.is_finished());
    assert!(t.is_touching());
    assert!(!t.wait_untouched(Duration::from_millis(50)));
    // Once the abort returns, the transfer ends and lets go of the memory.
    pair.fabric().hang_aborts = false;
    assert!(t.wait_untouched(soon()));
    assert!(matches!(
        ended(&t, soon()),
        Err(Error::TransferAborted { .. })
    ));
    assert_eq!(pair.fabric().live_ops(), 0);
}

/// The receiver of a sender killed mid-copy, with a communicator each way to it (an echo
/// came back before): one abort behind the other deadlocked on two H200s, the first's free
/// waiting for the second's kernel, which leaves only once the second's abort begins.
#[test]
fn a_peers_communicators_abort_together_when_a_free_waits_for_every_kernel() {
    let pair = Pair::new(NcclConfig {
        abort_wait: Duration::from_secs(5),
        ..fast()
    });
    pair.fabric().hold = true;
    pair.fabric().frees_wait_for_kernels = true;
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 64]).collect();
    let [s, r, s2, r2] = &mut bufs[..] else {
        unreachable!()
    };
    // The buffers outlive both abort_peer calls below, which end every transfer.
    // SAFETY: as said.
    let ab = unsafe { pair.a.send(&peer(2), TransferId(1), region(s)) }.unwrap();
    // SAFETY: as above.
    let ba = unsafe { pair.b.recv(&peer(1), TransferId(1), region(r)) }.unwrap();
    // SAFETY: as above.
    let back = unsafe { pair.b.send(&peer(1), TransferId(2), region(s2)) }.unwrap();
    // SAFETY: as above.
    let recv_back = unsafe { pair.a.recv(&peer(2), TransferId(2), region(r2)) }.unwrap();
    let start = Instant::now();
    while pair.fabric().live_ops() < 4 {
        assert!(
            start.elapsed() < soon(),
            "the four operations never launched"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let a = pair.a.clone();
    std::thread::spawn(move || a.abort_peer(&peer(2)))
        .join()
        .unwrap();
    // Both of a's aborts returned (not one left behind the other past abort_wait).
    for t in [&ab, &recv_back] {
        assert!(
            t.is_finished(),
            "an abort of a's waited on the other's kernel"
        );
        assert!(!t.is_touching());
        assert!(matches!(
            ended(t, soon()),
            Err(Error::TransferAborted { .. })
        ));
    }
    let b = pair.b.clone();
    std::thread::spawn(move || b.abort_peer(&peer(1)))
        .join()
        .unwrap();
    for t in [&ba, &back] {
        assert!(t.is_finished());
    }
    assert_eq!(pair.fabric().live_ops(), 0);
    assert_eq!(pair.fabric().aborts(), 4);
}

#[test]
fn a_peer_death_fails_its_transfers_typed_and_queued_ones_too() {
    let pair = Pair::new(fast());
    pair.fabric().fail_init = false;
    let mut buf = vec![0u8; 16];
    pair.fabric().hold = true;
    // SAFETY: the buffer outlives peer_gone, which ends the transfer.
    let t = unsafe { pair.a.recv(&peer(2), TransferId(5), region(&mut buf)) }.unwrap();
    pair.a.peer_gone(&peer(2));
    assert!(matches!(
        ended(&t, soon()),
        Err(Error::TransferPeerGone { id: 5, .. })
    ));
    assert_eq!(pair.a.phase(&peer(2), Dir::In), Phase::Idle);
}

#[test]
fn a_failed_init_fails_the_queued_transfer_and_the_next_one_retries() {
    let pair = Pair::new(fast());
    pair.fabric().fail_init = true;
    let mut src = vec![3u8; 8];
    let mut dst = vec![0u8; 8];
    // SAFETY: the buffer outlives the wait.
    let t = unsafe { pair.a.send(&peer(2), TransferId(1), region(&mut src)) }.unwrap();
    assert!(matches!(
        ended(&t, soon()),
        Err(Error::TransferFailed { .. })
    ));
    pair.fabric().fail_init = false;
    move_checked(&pair, 2, &mut src, &mut dst);
}

#[test]
fn a_wait_that_gives_up_leaves_it_to_an_abort_and_host_memory_is_refused() {
    let pair = Pair::new(fast());
    pair.fabric().hold = true;
    let mut buf = vec![0u8; 16];
    // SAFETY: the buffer outlives the abort, which ends the transfer.
    let t = unsafe { pair.a.send(&peer(2), TransferId(1), region(&mut buf)) }.unwrap();
    let e = t.wait(Duration::from_millis(20)).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    // A wait that gives up does not stop the transfer (`Transfer::wait`); an abort does,
    // and returns once NCCL no longer touches the memory.
    assert!(!t.is_finished());
    t.abort();
    assert!(t.is_finished());
    assert_eq!(pair.fabric().live_ops(), 0);
    assert!(matches!(
        t.wait(Duration::ZERO),
        Err(Error::TransferAborted { id: 1 })
    ));
    let host = Region {
        ptr: MemPtr::Host(buf.as_mut_ptr()),
        len: buf.len(),
        device: None,
    };
    // SAFETY: refused before any use.
    let refused = unsafe { pair.a.send(&peer(2), TransferId(2), host) };
    assert!(matches!(
        refused,
        Err(Error::RegionUnsupported { engine: "nccl", .. })
    ));
    // SAFETY: refused before any use.
    let to_self = unsafe { pair.a.send(&peer(1), TransferId(3), region(&mut buf)) };
    assert!(matches!(
        to_self,
        Err(Error::RegionUnsupported { engine: "nccl", .. })
    ));
}

#[test]
fn dropping_an_engine_aborts_what_runs() {
    let pair = Pair::new(fast());
    pair.fabric().hold = true;
    let mut buf = vec![0u8; 16];
    let engine = NcclEngine::with_nccl(
        Arc::new(FakeNccl {
            fabric: pair.fabric.clone(),
            device: 3,
            addr: addr_of(3),
        }),
        &peer(3),
        fast(),
        Arc::new(|_, _| {}),
    );
    // SAFETY: the buffer outlives the engine's drop, which ends the transfer.
    let t = unsafe { engine.send(&peer(2), TransferId(1), region(&mut buf)) }.unwrap();
    drop(engine);
    assert!(matches!(
        ended(&t, soon()),
        Err(Error::TransferAborted { .. })
    ));
}

/// The communicator `b` receives from node 1 on, once a copy landed (issue 45's attacks
/// below start from it).
fn ready_pair() -> (Pair, Attempt) {
    let pair = Pair::new(fast());
    let (mut src, mut dst) = (vec![5u8; 64], vec![0u8; 64]);
    move_checked(&pair, 1, &mut src, &mut dst);
    let Phase::Ready(attempt) = pair.b.phase(&peer(1), Dir::In) else {
        panic!("no ready communicator after a copy");
    };
    (pair, attempt)
}

/// Issue 45, finding 10: a rendezvous whose unique id names a bootstrap socket anywhere
/// but on the host its link runs to would make this node connect there. It is refused,
/// typed, before the engine's state is touched: no init, and the real peer's
/// communicator (the same link's, here) stays as it was and carries the next copy.
#[test]
fn a_rendezvous_naming_a_bootstrap_off_the_peers_host_is_refused_and_disturbs_nothing() {
    let (pair, attempt) = ready_pair();
    let calls = pair.fabric().calls.len();
    let elsewhere = SocketAddr::from(([10, 9, 9, 9], 1234));
    // An id naming no address at all is refused too.
    let nowhere = encode_rendezvous(Dir::Out, Offer { serial: 7, seen: 0 }, &UniqueId([0; 128]));
    for (bytes, named) in [
        (
            encode_rendezvous(
                Dir::Out,
                Offer { serial: 5, seen: 0 },
                &UniqueId::naming(99, elsewhere),
            ),
            Some(elsewhere.ip()),
        ),
        (nowhere, None),
    ] {
        let refused = pair.b.on_rendezvous(&peer(1), addr_of(1).ip(), &bytes);
        match refused {
            Err(Error::RendezvousElsewhere { named: n, link }) => {
                assert_eq!((n, link), (named, addr_of(1).ip()));
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(pair.b.phase(&peer(1), Dir::In), Phase::Ready(attempt));
    assert_eq!(
        pair.fabric().calls.len(),
        calls,
        "a refused rendezvous made an NCCL call"
    );
    let (mut src, mut dst) = (vec![6u8; 64], vec![0u8; 64]);
    move_checked(&pair, 2, &mut src, &mut dst);
    assert_eq!(pair.b.phase(&peer(1), Dir::In), Phase::Ready(attempt));
    assert_eq!(pair.fabric().aborts(), 0);
}

/// Issue 45, finding 10: a token holder that claims node 1's process reaches, through
/// its own link, only the communicators of the peer that link proved (its claim in its
/// key's namespace): its offer — with a bootstrap on its own host, as checked — is joined
/// as its own, and node 1's communicator is neither aborted nor replaced.
#[test]
fn a_rendezvous_claiming_another_peer_reaches_only_its_own_links_communicators() {
    let (pair, attempt) = ready_pair();
    let liar = EnginePeer {
        process: crate::tcp::remote_process(&crate::tcp::NodePublicKey([66; 32]), peer(1).process),
        ..peer(1)
    };
    let liar_host = SocketAddr::from(([10, 0, 0, 66], 5000));
    let bytes = encode_rendezvous(
        Dir::Out,
        Offer { serial: 9, seen: 0 },
        &UniqueId::naming(99, liar_host),
    );
    pair.b.on_rendezvous(&liar, liar_host.ip(), &bytes).unwrap();
    assert!(matches!(pair.b.phase(&liar, Dir::In), Phase::Joining(_)));
    assert_eq!(pair.b.phase(&peer(1), Dir::In), Phase::Ready(attempt));
    let (mut src, mut dst) = (vec![7u8; 64], vec![0u8; 64]);
    move_checked(&pair, 2, &mut src, &mut dst);
    assert_eq!(pair.b.phase(&peer(1), Dir::In), Phase::Ready(attempt));
    assert_eq!(
        pair.fabric().aborts(),
        0,
        "node 1's communicator was aborted"
    );
}

#[test]
fn a_unique_id_names_its_bootstrap_as_nccl_lays_it_out() {
    for addr in [
        SocketAddr::from(([192, 168, 7, 3], 45_123)),
        "[fe80::1%3]:50000".parse().unwrap(),
    ] {
        assert_eq!(UniqueId::naming(1, addr).bootstrap_addr(), Some(addr));
    }
    // struct ncclBootstrapHandle { uint64_t magic; sockaddr_in addr; }, by hand.
    let mut raw = [0u8; 128];
    raw[8..10].copy_from_slice(&2u16.to_ne_bytes());
    raw[10..12].copy_from_slice(&[0x9c, 0x40]);
    raw[12..16].copy_from_slice(&[10, 1, 2, 3]);
    assert_eq!(
        UniqueId(raw).bootstrap_addr(),
        Some(SocketAddr::from(([10, 1, 2, 3], 40_000)))
    );
    assert_eq!(UniqueId([0; 128]).bootstrap_addr(), None);
}

/// Issue 45, finding 10: where a peer's bootstrap may be. On its host link's address;
/// over a loopback link (a peer on this machine, whose NCCL picks a non-loopback interface
/// by default) at an address of this machine; never the unspecified address, another
/// machine's, or — from a peer on another host — this machine's loopback.
#[test]
fn a_bootstrap_is_accepted_only_on_the_peers_own_host() {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let remote = IpAddr::V4(Ipv4Addr::new(10, 9, 9, 9));
    assert!(bootstrap_on_peers_host(remote, remote));
    assert!(bootstrap_on_peers_host(lo, lo));
    // The same address written as IPv4-mapped IPv6.
    assert!(bootstrap_on_peers_host(
        IpAddr::V6(Ipv4Addr::new(10, 9, 9, 9).to_ipv6_mapped()),
        remote
    ));
    assert!(bootstrap_on_peers_host(
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)),
        lo
    ));
    assert!(!bootstrap_on_peers_host(remote, lo), "not this machine");
    assert!(!bootstrap_on_peers_host(
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        lo
    ));
    assert!(!bootstrap_on_peers_host(
        IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        lo
    ));
    assert!(
        !bootstrap_on_peers_host(lo, remote),
        "our loopback, from afar"
    );
}
