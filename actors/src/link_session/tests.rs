//! The link's protocol without sockets: every fault a peer can commit, one test each, and
//! random frame sequences against a simple model (leases held = opened − released, calls
//! pending = sent − answered − cancelled, every bound kept, every fault the one the model
//! expects).

use super::*;
use baton_ipc::inbox::FenceRefusal;
use baton_messages::protocol::{Pull, RefuseReason, Refused, Relayed};
use baton_messages::{
    ActorId, BootId, CounterFence, CudaIpcMemHandle, DeviceUuid, ExporterId, Generation,
    HandleDigest, HandleKey, HandleMsg, RawHandle, SegmentName, SessionToken,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Plain values for what the shell attaches: a guard is an `Arc<()>` the test keeps, a
/// mapping is its allocation's number, a caller is its call id; a copy, its send and a
/// forward's waiter are their lease's number, as is a relayed lease's own hold; who
/// asked for a forward is its id.
enum Plain {}

impl Attach for Plain {
    type Held = Weak<()>;
    type Mapping = u64;
    type Relayed = u64;
    type Caller = u64;
    type Handed = u32;
    type Copy = u64;
    type Sending = u64;
    type Forward = u64;
    type Asked = u64;
}

fn process(n: u32) -> ProcessId {
    ProcessId {
        boot: BootId([7; 16]),
        pid: 1000 + n,
        start_ticks: 50 + u64::from(n),
    }
}

/// Us, the peer, and a third process.
fn me() -> ProcessId {
    process(0)
}
fn peer() -> ProcessId {
    process(1)
}
fn third() -> ProcessId {
    process(2)
}

/// What the node answers: calls issued below `issued`; fences refused if `refuse_fences`;
/// a copy's seal checked with [`key`].
#[derive(Default)]
struct Node {
    issued: u64,
    refuse_fences: bool,
}

impl Checks for Node {
    fn check_fence(&self, exporter: &ProcessId, _: &FenceHandle) -> Result<(), ActorError> {
        if self.refuse_fences {
            return Err(baton_ipc::Error::FenceRefused {
                producer: *exporter,
                reason: FenceRefusal::NoLane,
            }
            .into());
        }
        Ok(())
    }

    fn call_issued(&self, id: u64) -> bool {
        id < self.issued
    }

    fn check_sealed(&self, handle: &HandleMsg) -> Result<(), ActorError> {
        Ok(handle.check(&key()).map_err(baton_ipc::Error::from)?)
    }
}

const LIMITS: SessionLimits = SessionLimits {
    offers_per_message: 4,
    leases_held: 6,
    held_messages: 3,
    held_bytes: 100,
    copy_bytes: 1000,
};

fn session() -> LinkSession<Plain> {
    LinkSession::new(peer(), me(), LIMITS, Instant::now())
}

fn offer_of(exporter: ProcessId, lease: u64, alloc: u64) -> Offer {
    Offer {
        lease: LeaseId::new(lease),
        handle: HandleMsg {
            version: baton_messages::PROTOCOL_VERSION,
            exporter: ExporterId {
                process: exporter,
                actor: ActorId::new(1),
            },
            alloc: AllocationId::new(alloc),
            generation: Generation::FIRST,
            backend: baton_messages::BackendKind::Host,
            device: DeviceUuid::HOST,
            alloc_size: 4096,
            offset: 0,
            len: 4096,
            layout: None,
            raw: RawHandle::HostSegment(SegmentName::new("/baton.test").expect("a name")),
            fence: None,
            digest: HandleDigest::default(),
        },
    }
}

/// An offer of the peer's own buffer.
fn offer(lease: u64, alloc: u64) -> Offer {
    offer_of(peer(), lease, alloc)
}

/// The deployment's handle key, which seals copies.
fn key() -> HandleKey {
    HandleKey::derive(&SessionToken::from_bytes([3; 32]))
}

/// An offer of a copy of `exporter`'s buffer, sealed, as a host link carries them.
fn copy_of(exporter: ProcessId, lease: u64, alloc: u64) -> Offer {
    let mut offer = offer_of(exporter, lease, alloc);
    offer.handle = copy_handle(offer.handle, CopyEngine::Tcp, &key());
    offer
}

/// A copy's handle names the bytes its lease covers alone, and no fence; sealed, it is
/// what the peer's session takes over a host link.
#[test]
fn a_copy_handle_names_the_leased_bytes_alone_and_passes_the_peers_checks() {
    let mut granted = offer_of(peer(), 7, 1);
    (granted.handle.offset, granted.handle.len) = (4096, 100);
    granted.handle.alloc_size = 1 << 20;
    granted.handle.fence = Some(fence());
    let copy = copy_handle(granted.handle, CopyEngine::Nccl, &key());
    assert_eq!((copy.offset, copy.len, copy.alloc_size), (0, 100, 100));
    assert!(copy.fence.is_none());
    assert!(matches!(
        copy.raw,
        RawHandle::Copy {
            engine: CopyEngine::Nccl
        }
    ));
    let mut s = session().across_hosts(peer());
    let offer = Offer {
        lease: LeaseId::new(7),
        handle: copy,
    };
    let actions = handle(&mut s, Wire::Offer(Box::new(offer)));
    assert!(matches!(&actions[..], [Action::Open(_)]));
}

fn call(id: u64, offers: Vec<Offer>) -> Wire {
    Wire::Call(Call {
        id,
        target: "echo".into(),
        type_name: "t".into(),
        payload: vec![1, 2, 3],
        offers,
    })
}

fn reply(id: u64, offers: Vec<Offer>) -> Wire {
    Wire::Reply(Reply {
        id,
        outcome: Ok(Payload {
            bytes: vec![9],
            offers,
        }),
    })
}

fn fence() -> FenceHandle {
    FenceHandle::Counter(CounterFence {
        slab: CudaIpcMemHandle([1; 64]),
        slab_id: 1,
        offset: 0,
        value: 1,
    })
}

/// Feeds `frame`; the fault it must be (and that it is the peer's).
fn fault(s: &mut LinkSession<Plain>, frame: Wire, node: &Node) -> ActorError {
    match s.handle(frame, Instant::now(), node) {
        Ok(_) => panic!("the frame should have been a fault"),
        Err(e) => {
            assert!(e.is_peer_fault(), "{e} should be the peer's fault");
            e
        }
    }
}

/// Feeds `frame`, which must be no fault.
fn handle(s: &mut LinkSession<Plain>, frame: Wire) -> Vec<Action<Plain>> {
    s.handle(frame, Instant::now(), &Node::default())
        .unwrap_or_else(|e| panic!("no fault expected: {e}"))
        .into_iter()
        .collect()
}

/// How the shell keeps an opened offer's mapping: the allocation's, or the relayed
/// lease's own.
fn kept(offer: &Offer, relayed: bool) -> Kept<Plain> {
    match relayed {
        true => Kept::Own(offer.lease.get()),
        false => Kept::Warm(offer.handle.alloc.get()),
    }
}

/// Does what the shell does with an [`Action::Open`]: every offer opens; returns the
/// guards (the leases' holders).
fn open_all(s: &mut LinkSession<Plain>, actions: Vec<Action<Plain>>) -> Vec<(LeaseId, Arc<()>)> {
    let mut guards = Vec::new();
    for action in actions {
        let Action::Open(open) = action else {
            panic!("an open was expected")
        };
        for (i, offer) in open.offers.iter().enumerate() {
            let guard = Arc::new(());
            let part = i > 0 && open.offers[i - 1].lease == offer.lease;
            s.opened(
                offer,
                Arc::downgrade(&guard),
                kept(offer, open.relayed),
                part,
            );
            guards.push((offer.lease, guard));
        }
    }
    guards
}

/// Holds `leases` (of allocation `alloc`), offered bare.
fn hold(s: &mut LinkSession<Plain>, leases: &[u64], alloc: u64) -> Vec<(LeaseId, Arc<()>)> {
    let mut guards = Vec::new();
    for &lease in leases {
        let actions = handle(s, Wire::Offer(Box::new(offer(lease, alloc))));
        guards.extend(open_all(s, actions));
    }
    guards
}

fn sent(actions: &[Action<Plain>]) -> Vec<&Wire> {
    actions
        .iter()
        .map(|a| match a {
            Action::Send(frame) => frame,
            _ => panic!("only frames to send were expected"),
        })
        .collect()
}

// Faults, one test each.

#[test]
fn too_many_offers_in_one_frame_is_a_fault() {
    let mut s = session();
    let offers: Vec<Offer> = (1..=5).map(|l| offer(l, 1)).collect();
    let e = fault(&mut s, call(1, offers), &Node::default());
    assert!(
        matches!(e, ActorError::TooManyOffers { count: 5, max: 4 }),
        "{e}"
    );
    // Exactly at the limit is fine.
    let offers: Vec<Offer> = (1..=4).map(|l| offer(l, 1)).collect();
    handle(&mut s, call(2, offers));
}

#[test]
fn too_many_offers_in_a_late_reply_is_a_fault() {
    let mut s = session();
    let node = Node {
        issued: 10,
        ..Node::default()
    };
    let offers: Vec<Offer> = (1..=5).map(|l| offer(l, 1)).collect();
    let e = fault(&mut s, reply(3, offers), &node);
    assert!(
        matches!(e, ActorError::TooManyOffers { count: 5, .. }),
        "{e}"
    );
}

#[test]
fn an_offer_of_someone_elses_buffer_is_a_fault() {
    let mut s = session();
    for frame in [
        Wire::Offer(Box::new(offer_of(third(), 1, 1))),
        call(1, vec![offer(2, 1), offer_of(me(), 3, 1)]),
    ] {
        let e = fault(&mut s, frame, &Node::default());
        assert!(matches!(e, ActorError::ForeignOffer { .. }), "{e}");
    }
    assert_eq!(s.held(), 0, "nothing of a faulty frame is held");
}

#[test]
fn over_a_host_link_offers_are_sealed_copies_that_name_the_peers_claim_and_carry_no_fence() {
    // This node knows the remote peer by its claim in its key's namespace (`peer()` here);
    // its handles name it by its claim. Only the claim's offers are its own.
    let claimed = third();
    let mut s = session().across_hosts(claimed);
    assert!(matches!(
        &handle(&mut s, Wire::Offer(Box::new(copy_of(claimed, 1, 1))))[..],
        [Action::Open(_)]
    ));
    let across = |frame| {
        fault(
            &mut session().across_hosts(claimed),
            frame,
            &Node::default(),
        )
    };
    for frame in [
        Wire::Offer(Box::new(copy_of(peer(), 2, 1))),
        Wire::Offer(Box::new(copy_of(me(), 3, 1))),
    ] {
        let e = across(frame);
        assert!(matches!(e, ActorError::ForeignOffer { .. }), "{e}");
    }
    // No fence crosses hosts: its exporter there is a claim, never checked or opened.
    let mut fenced = copy_of(claimed, 4, 1);
    fenced.handle.fence = Some(fence());
    let e = across(Wire::Offer(Box::new(fenced)));
    assert!(
        matches!(e, ActorError::Unexpected { got } if got.contains("fence over a host link")),
        "{e}"
    );
    // Only copies cross hosts: a handle to map names memory of the peer's host.
    let e = across(call(
        1,
        vec![copy_of(claimed, 5, 1), offer_of(claimed, 6, 1)],
    ));
    assert!(
        matches!(
            e,
            ActorError::Ipc(baton_ipc::Error::Message(
                baton_messages::Error::BackendMismatch { .. }
            ))
        ),
        "{e}"
    );
    // A copy not sealed with the deployment's key is forged.
    let mut forged = copy_of(claimed, 7, 1);
    forged.handle.len -= 1;
    let e = across(Wire::Offer(Box::new(forged)));
    assert!(
        matches!(
            e,
            ActorError::Ipc(baton_ipc::Error::Message(
                baton_messages::Error::DigestMismatch
            ))
        ),
        "{e}"
    );
}

#[test]
fn a_relayed_offer_of_the_relays_or_our_own_buffer_is_a_fault() {
    let mut s = session();
    for exporter in [peer(), me()] {
        let e = fault(
            &mut s,
            Wire::Relayed(Box::new(Relayed {
                offer: offer_of(exporter, 1, 1),
            })),
            &Node::default(),
        );
        assert!(matches!(e, ActorError::Unexpected { .. }), "{e}");
    }
    // A third process's buffer is what a relay passes on: opened, with no warm mapping.
    let actions = handle(
        &mut s,
        Wire::Relayed(Box::new(Relayed {
            offer: offer_of(third(), 1, 1),
        })),
    );
    let _guards = open_all(&mut s, actions);
    assert_eq!(s.held(), 1);
    assert!(!s.maps(AllocationId::new(1)));
}

/// How a `Release` was routed, plainly: the route's name, and the copy's send and the
/// forward's waiter it hands back.
fn route(s: &mut LinkSession<Plain>, lease: u64) -> (&'static str, Option<u64>, Option<u64>) {
    let release = Wire::Release(Release::now(LeaseId::new(lease)));
    match handle(s, release).pop() {
        Some(Action::Released { route, .. }) => {
            let name = route.name();
            match route {
                ReleaseRoute::Copy(CopyReleased::Copy { sending }) => (name, sending, None),
                ReleaseRoute::Copy(CopyReleased::Forward { waiter, sending }) => {
                    (name, sending, Some(waiter))
                }
                _ => (name, None, None),
            }
        }
        _ => panic!("one release was expected"),
    }
}

/// The route of a peer's `Release`: what the session knows of how the lease was lent, so
/// that a same-host release touches neither the copy nor the relay tables.
#[test]
fn a_release_is_routed_by_how_its_lease_was_lent() {
    let mut s = session();
    assert_eq!(route(&mut s, 1), ("local", None, None), "granted by us");
    s.passed_on(LeaseId::new(2));
    s.passed_on(LeaseId::new(3));
    assert_eq!(route(&mut s, 2), ("passed", None, None), "passed on");
    assert_eq!(
        route(&mut s, 2),
        ("local", None, None),
        "once: a second release of it is the ledger's to refuse"
    );
    s.pass_failed(LeaseId::new(3));
    assert_eq!(
        route(&mut s, 3),
        ("local", None, None),
        "its frame never left"
    );
    // A host link lends copies: a release hands back the send still under way, and a
    // forward's waiter.
    let mut across = session().across_hosts(peer());
    across.passed_on(LeaseId::new(4));
    assert_eq!(route(&mut across, 4), ("copy", None, None));
    across.copy_sending(LeaseId::new(5), 50);
    across.copy_offered(LeaseId::new(6), 60);
    across.copy_sending(LeaseId::new(7), 70);
    across.forward_offered(LeaseId::new(7), 700);
    across.copy_offered(LeaseId::new(8), 80);
    across.forward_offered(LeaseId::new(8), 800);
    assert_eq!(route(&mut across, 5), ("copy", Some(50), None), "sending");
    assert_eq!(route(&mut across, 6), ("copy", None, None), "never pulled");
    assert_eq!(route(&mut across, 7), ("forward copy", Some(70), Some(700)));
    assert_eq!(
        route(&mut across, 8),
        ("forward copy", None, Some(800)),
        "a forward refused unpulled"
    );
    assert_eq!(
        route(&mut across, 5),
        ("copy", None, None),
        "once: a second release of it is the ledger's to refuse"
    );
    assert_eq!(across.copies_out(), 0);
}

/// The device copies of a host link start in the order the peer pulls them (the order
/// NCCL pairs sends and receives in), each pulled once; a copy whose lease came back, or
/// whose frame was never sent, is skipped; the waiters of forwards fail with the link.
#[test]
fn copies_start_in_the_order_pulled_and_end_with_their_lease_or_the_link() {
    let pull = |lease| {
        Wire::Pull(Pull {
            lease: LeaseId::new(lease),
        })
    };
    let mut s = session().across_hosts(peer());
    for lease in 1..=5 {
        s.copy_offered(LeaseId::new(lease), lease * 10);
    }
    s.copy_sending(LeaseId::new(6), 60);
    for lease in [3, 1, 4, 2] {
        assert!(matches!(
            &handle(&mut s, pull(lease))[..],
            [Action::SendPulled]
        ));
    }
    for (lease, what) in [
        (3, "pulled twice"),
        (6, "a host copy"),
        (9, "never offered"),
    ] {
        let e = fault(&mut s, pull(lease), &Node::default());
        assert!(
            matches!(e, ActorError::Unexpected { got } if got.contains("Pull")),
            "{what}: {e}"
        );
    }
    let mut s = session().across_hosts(peer());
    for lease in 1..=5 {
        s.copy_offered(LeaseId::new(lease), lease * 10);
    }
    for lease in [3, 1, 4, 2] {
        handle(&mut s, pull(lease));
    }
    assert_eq!(s.next_pulled(), Some(&30));
    assert_eq!(s.take_pulled(), Some((LeaseId::new(3), 30)));
    s.copy_sending(LeaseId::new(3), 31);
    // Lease 1's comes back before its send starts (the receiver gave up); lease 4's
    // frame was never sent.
    assert_eq!(route(&mut s, 1), ("copy", None, None));
    assert_eq!(s.copy_unsent(LeaseId::new(4)), None);
    assert_eq!(s.take_pulled(), Some((LeaseId::new(2), 20)));
    assert_eq!(s.take_pulled(), None);
    assert_eq!(s.copy_unsent(LeaseId::new(3)), Some(31));
    s.forward_offered(LeaseId::new(5), 500);
    let ended = s.end();
    assert_eq!(ended.forwards, [500]);
    assert_eq!(s.copies_out(), 0);
    // Copies coming in are bounded in bytes.
    assert!(s.admit_copies_in(600));
    assert!(!s.admit_copies_in(401), "past copy_bytes");
    assert!(s.admit_copies_in(400));
    s.copies_in_done(600);
    assert_eq!(s.copies_in(), 400);
}

/// A frame's copies coming in: refused when relayed or past the link's bound in bytes
/// (the link kept); admitted ones count until done, and their device copies are pulled in
/// the offers' order.
#[test]
fn copies_in_are_bounded_and_their_device_copies_pulled_in_order() {
    let mut s = session().across_hosts(peer());
    let sized = |lease: u64, len: u64, engine| {
        let mut offer = offer_of(peer(), lease, lease);
        offer.handle.len = len;
        offer.handle.raw = RawHandle::Copy { engine };
        offer
    };
    let (tcp, nccl) = (CopyEngine::Tcp, CopyEngine::Nccl);
    let offers = [sized(1, 100, nccl), sized(2, 200, tcp), sized(3, 300, nccl)];
    let reason = s.receive_copies(&offers, true).expect_err("relayed");
    assert!(reason.contains("relayed"), "{reason}");
    let copies = s.receive_copies(&offers, false).expect("within the bound");
    assert_eq!(copies.bytes, 600);
    assert!(copies.device());
    let pulled: Vec<u64> = (copies.pulls.iter())
        .map(|w| match w {
            Wire::Pull(Pull { lease }) => lease.get(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(pulled, [1, 3]);
    let past = s.receive_copies(&[sized(4, 401, tcp)], false);
    assert!(past.expect_err("past copy_bytes").contains("copy_bytes"));
    let host = s
        .receive_copies(&[sized(4, 400, tcp)], false)
        .expect("fits");
    assert!(!host.device() && host.pulls.is_empty());
    s.copies_in_done(copies.bytes);
    assert_eq!(s.copies_in(), 400);
}

/// Our own release of a held lease hands back a relayed one's own hold (its `Release`
/// then waits for its mapping to close); until then its id offered again is a duplicate,
/// even once its guard dropped (a second hold would replace the first).
#[test]
fn a_held_lease_released_hands_back_a_relayed_ones_hold() {
    let mut s = session();
    let mut guards = hold(&mut s, &[1], 1);
    let actions = handle(
        &mut s,
        Wire::Relayed(Box::new(Relayed {
            offer: offer_of(third(), 2, 2),
        })),
    );
    guards.extend(open_all(&mut s, actions));
    assert_eq!(s.held(), 2);
    guards.retain(|(lease, _)| lease.get() != 2);
    let again = Wire::Relayed(Box::new(Relayed {
        offer: offer_of(third(), 2, 3),
    }));
    let e = fault(&mut s, again.clone(), &Node::default());
    assert!(matches!(e, ActorError::DuplicateLease { .. }), "{e}");
    let mut s = session();
    let mut guards = hold(&mut s, &[1], 1);
    let actions = handle(&mut s, again);
    guards.extend(open_all(&mut s, actions));
    assert_eq!(s.released(LeaseId::new(2)), Some(2), "relayed");
    assert_eq!(s.released(LeaseId::new(1)), None, "the peer's own buffer");
    assert_eq!(s.released(LeaseId::new(1)), None, "no longer held");
    assert_eq!(s.held(), 0);
    drop(guards);
}

#[test]
fn a_forged_fence_is_a_fault() {
    let mut s = session();
    let mut forged = offer(1, 1);
    forged.handle.fence = Some(fence());
    let node = Node {
        refuse_fences: true,
        ..Node::default()
    };
    let e = fault(&mut s, Wire::Offer(Box::new(forged.clone())), &node);
    assert!(matches!(e, ActorError::Ipc(_)), "{e}");
    // The same offer with a fence the node accepts opens.
    handle(&mut s, Wire::Offer(Box::new(forged)));
}

#[test]
fn a_lease_offered_twice_in_one_frame_is_a_fault() {
    let mut s = session();
    let e = fault(
        &mut s,
        call(1, vec![offer(7, 1), offer(8, 1), offer(7, 2)]),
        &Node::default(),
    );
    assert!(
        matches!(e, ActorError::DuplicateLease { lease } if lease == LeaseId::new(7)),
        "{e}"
    );
}

/// Adjacent offers that name one lease are its parts: one lease over several buffers,
/// held (and counted against the limit) once, its bytes summed, given back with one
/// `Release` if refused; never relayed, and never over a host link.
#[test]
fn adjacent_offers_of_one_lease_are_its_parts() {
    let mut s = session();
    let actions = handle(&mut s, call(1, vec![offer(7, 1), offer(7, 2), offer(8, 3)]));
    let Action::Open(open) = &actions[0] else {
        panic!("an open was expected")
    };
    assert_eq!(
        s.refused(&open.offers, false).len(),
        2 + 3,
        "two releases, three unmaps"
    );
    let guards = open_all(&mut s, actions);
    assert_eq!(s.held(), 2);
    assert_eq!(
        s.held_bytes(LeaseId::new(7)),
        Some(2 * offer(7, 1).handle.len)
    );
    // The limit (6) counts leases, not parts: four more fit, in eight offers.
    let actions = handle(
        &mut s,
        call(
            2,
            vec![offer(9, 4), offer(9, 5), offer(10, 4), offer(11, 4)],
        ),
    );
    let mut more = open_all(&mut s, actions);
    let actions = handle(&mut s, call(3, vec![offer(12, 4); 4]));
    more.extend(open_all(&mut s, actions));
    assert_eq!(s.held(), 6);
    let e = fault(
        &mut s,
        call(4, vec![offer(13, 4), offer(13, 5)]),
        &Node::default(),
    );
    assert!(matches!(e, ActorError::TooManyLeases { .. }), "{e}");
    drop(guards);
    let mut host = session().across_hosts(peer());
    let e = fault(
        &mut host,
        call(1, vec![copy_of(peer(), 7, 1), copy_of(peer(), 7, 2)]),
        &Node::default(),
    );
    assert!(matches!(e, ActorError::Unexpected { .. }), "{e}");
}

#[test]
fn a_lease_offered_while_it_is_held_is_a_fault() {
    let mut s = session();
    let mut guards = hold(&mut s, &[7], 1);
    let e = fault(&mut s, Wire::Offer(Box::new(offer(7, 1))), &Node::default());
    assert!(matches!(e, ActorError::DuplicateLease { .. }), "{e}");
    // Once its guard dropped (its `Release` under way), the id is no longer held.
    guards.clear();
    handle(&mut s, Wire::Offer(Box::new(offer(7, 1))));
}

#[test]
fn more_leases_than_the_limit_is_a_fault() {
    let mut s = session();
    let _guards = hold(&mut s, &[1, 2, 3, 4], 1);
    let e = fault(
        &mut s,
        call(1, vec![offer(5, 1), offer(6, 1), offer(7, 1)]),
        &Node::default(),
    );
    assert!(matches!(e, ActorError::TooManyLeases { max: 6 }), "{e}");
    // Up to the limit is fine.
    handle(&mut s, call(2, vec![offer(5, 1), offer(6, 1)]));
}

#[test]
fn a_release_with_too_many_fences_is_a_fault() {
    let mut s = session();
    let fences = vec![fence(); MAX_RELEASE_FENCES + 1];
    let e = fault(
        &mut s,
        Wire::Release(Release {
            lease: LeaseId::new(1),
            fences,
        }),
        &Node::default(),
    );
    assert!(matches!(e, ActorError::TooManyFences { .. }), "{e}");
    // At the limit, the release goes to the ledger (which knows what was granted).
    let actions = handle(
        &mut s,
        Wire::Release(Release {
            lease: LeaseId::new(1),
            fences: vec![fence(); MAX_RELEASE_FENCES],
        }),
    );
    assert!(matches!(
        &actions[..],
        [Action::Released { fences, .. }] if fences.len() == MAX_RELEASE_FENCES
    ));
}

#[test]
fn a_reply_to_a_call_never_made_is_a_fault() {
    let mut s = session();
    let node = Node {
        issued: 5,
        ..Node::default()
    };
    let e = fault(&mut s, reply(5, Vec::new()), &node);
    assert!(matches!(e, ActorError::UnknownCall { id: 5 }), "{e}");
}

#[test]
fn a_late_replys_leases_go_back() {
    let mut s = session();
    // Allocation 1 is mapped over this link already; 2 and 3 are not.
    let _guards = hold(&mut s, &[1], 1);
    let node = Node {
        issued: 10,
        ..Node::default()
    };
    let actions = s
        .handle(
            reply(4, vec![offer(2, 1), offer(3, 2), offer(4, 2), offer(5, 3)]),
            Instant::now(),
            &node,
        )
        .expect("a late reply is no fault");
    let frames = sent(&actions);
    let expected: Vec<Wire> = vec![
        Wire::Release(Release::now(LeaseId::new(2))),
        Wire::Release(Release::now(LeaseId::new(3))),
        Wire::Release(Release::now(LeaseId::new(4))),
        Wire::Release(Release::now(LeaseId::new(5))),
        Wire::Unmapped(Unmapped {
            alloc: AllocationId::new(2),
        }),
        Wire::Unmapped(Unmapped {
            alloc: AllocationId::new(3),
        }),
    ];
    assert_eq!(frames, expected.iter().collect::<Vec<_>>());
    assert_eq!(s.held(), 1, "a late reply's leases are never held");
    // A late failure carries nothing.
    let actions = s
        .handle(
            Wire::Reply(Reply {
                id: 5,
                outcome: Err(CallFault::ActorGone),
            }),
            Instant::now(),
            &node,
        )
        .expect("no fault");
    assert!(actions.is_empty());
}

#[test]
fn a_status_answer_to_a_request_never_made_is_a_fault() {
    let mut s = session();
    let status = |id| {
        Wire::Status(Status {
            id,
            version: 1,
            json: "{}".into(),
        })
    };
    let (id, _) = s.status_request(0);
    let (tx, mut rx) = oneshot::channel();
    s.await_status(id, tx);
    assert!(handle(&mut s, status(id)).is_empty());
    assert_eq!(rx.try_recv().expect("answered").expect("ok"), "{}");
    // Answered already (or its asker gave up): dropped.
    assert!(handle(&mut s, status(id)).is_empty());
    let e = fault(&mut s, status(id + 1), &Node::default());
    assert!(matches!(e, ActorError::Unexpected { got: "Status" }), "{e}");
}

#[test]
fn too_many_status_requests_at_once_is_a_fault() {
    let mut s = session();
    let request = |id| {
        Wire::StatusRequest(StatusRequest {
            id,
            scope: StatusScope::Node,
            limit: 0,
        })
    };
    for id in 0..STATUS_ANSWERS as u64 {
        assert!(matches!(
            &handle(&mut s, request(id))[..],
            [Action::AnswerStatus(_)]
        ));
    }
    let e = fault(&mut s, request(9), &Node::default());
    assert!(matches!(e, ActorError::TooManyStatusRequests { .. }), "{e}");
    // One answered: room for one more.
    s.status_answered();
    handle(&mut s, request(10));
}

#[test]
fn a_second_fence_inbox_is_a_fault() {
    let mut s = session();
    let grant = InboxGrant {
        device: DeviceUuid::HOST,
        slab: CudaIpcMemHandle([2; 64]),
        slab_id: 1,
        first: 0,
        slots: 4,
        base: 0,
    };
    assert!(matches!(
        &handle(&mut s, Wire::FenceInbox(grant))[..],
        [Action::AcceptInbox(_)]
    ));
    let e = fault(&mut s, Wire::FenceInbox(grant), &Node::default());
    assert!(
        matches!(
            e,
            ActorError::Unexpected {
                got: "a second FenceInbox"
            }
        ),
        "{e}"
    );
}

#[test]
fn transfer_engine_frames_are_taken_only_on_a_host_link_and_fences_only_within_a_host() {
    use baton_messages::protocol::{MAX_RENDEZVOUS_BYTES, Rendezvous};
    let pull = || {
        Wire::Pull(Pull {
            lease: LeaseId::new(7),
        })
    };
    let rendezvous = |len| {
        Wire::Rendezvous(Rendezvous {
            bytes: vec![1; len],
        })
    };
    let grant = InboxGrant {
        device: DeviceUuid::HOST,
        slab: CudaIpcMemHandle([2; 64]),
        slab_id: 1,
        first: 0,
        slots: 4,
        base: 0,
    };
    let unexpected = |e: ActorError, what: &str| {
        assert!(
            matches!(e, ActorError::Unexpected { got } if got.contains(what)),
            "{e}"
        );
    };
    // Within one host: no engine messages.
    unexpected(
        fault(&mut session(), pull(), &Node::default()),
        "transfer engines",
    );
    unexpected(
        fault(&mut session(), rendezvous(149), &Node::default()),
        "transfer engines",
    );
    // Across hosts: pulls (of our device copies) and rendezvous messages, bounded; no
    // fence inbox.
    let mut s = session().across_hosts(peer());
    s.copy_offered(LeaseId::new(7), 7);
    assert!(matches!(&handle(&mut s, pull())[..], [Action::SendPulled]));
    assert!(matches!(
        &handle(&mut s, rendezvous(MAX_RENDEZVOUS_BYTES))[..],
        [Action::Rendezvous(bytes)] if bytes.len() == MAX_RENDEZVOUS_BYTES
    ));
    unexpected(
        fault(
            &mut s,
            rendezvous(MAX_RENDEZVOUS_BYTES + 1),
            &Node::default(),
        ),
        "oversized",
    );
    unexpected(
        fault(
            &mut session().across_hosts(peer()),
            Wire::FenceInbox(grant),
            &Node::default(),
        ),
        "host link",
    );
}

/// The exporter's answer to one of our forwards: it finds who asked, once; a second
/// answer's offer goes back; an answer to a forward never asked, an offer of a buffer not
/// the peer's, or any offer over a host link is a fault, and who asked hears at the end.
#[test]
fn a_forwards_answer_finds_who_asked_once() {
    let node = Node::default();
    let forwarded = |id: u64, outcome: Result<Offer, String>| {
        Wire::Forwarded(Box::new(Forwarded { id, outcome }))
    };
    let mut s = session();
    let (id, frame) = s.ask_forward(LeaseId::new(5), third());
    assert!(
        matches!(frame, Wire::Forward(Forward { id: i, lease, to }) if i == id && lease.get() == 5 && to == third())
    );
    s.await_forward(id, id);
    let actions = handle(&mut s, forwarded(id, Ok(offer(40, 1))));
    let [Action::Forwarded { asked, answer }] = &actions[..] else {
        panic!("the offer goes to who asked");
    };
    let Ok(o) = &answer.outcome else {
        panic!("the offer goes to who asked");
    };
    assert_eq!((*asked, o.lease.get()), (id, 40));
    assert_eq!(s.forwards_asked(), 0);
    // Answered again: the offer goes back; a refusal changes nothing.
    let actions = handle(&mut s, forwarded(id, Ok(offer(41, 1))));
    assert!(matches!(sent(&actions)[..], [Wire::Release(r)] if r.lease.get() == 41));
    assert!(handle(&mut s, forwarded(id, Err("no".into()))).is_empty());
    // A refusal reaches who asked.
    let (id, _) = s.ask_forward(LeaseId::new(6), third());
    s.await_forward(id, id);
    let actions = handle(&mut s, forwarded(id, Err("revoked".into())));
    assert!(
        matches!(&actions[..], [Action::Forwarded { asked, answer }] if *asked == id && answer.outcome.as_ref().err().is_some_and(|r| r == "revoked"))
    );
    // Never asked.
    for never in [0, id + 1] {
        let e = fault(&mut s, forwarded(never, Err("no".into())), &node);
        assert!(
            matches!(e, ActorError::Unexpected { got } if got.contains("no forward of ours")),
            "{e}"
        );
    }
    // Someone else's buffer: a fault, and who asked fails with the link.
    let mut s = session();
    let (id, _) = s.ask_forward(LeaseId::new(5), third());
    s.await_forward(id, id);
    let e = fault(&mut s, forwarded(id, Ok(offer_of(third(), 40, 1))), &node);
    assert!(matches!(e, ActorError::ForeignOffer { .. }), "{e}");
    assert_eq!(s.end().asked, [id]);
    // Over a host link: no offer, even one asked for; a refusal is an answer.
    let mut s = session().across_hosts(peer());
    let (id, _) = s.ask_forward(LeaseId::new(5), third());
    s.await_forward(id, id);
    let e = fault(&mut s, forwarded(id, Ok(copy_of(peer(), 40, 1))), &node);
    assert!(
        matches!(e, ActorError::Unexpected { got } if got.contains("host link")),
        "{e}"
    );
    let mut s = session().across_hosts(peer());
    let (id, _) = s.ask_forward(LeaseId::new(5), third());
    s.await_forward(id, id);
    let actions = handle(&mut s, forwarded(id, Err("no".into())));
    assert!(matches!(
        &actions[..],
        [Action::Forwarded { answer, .. }] if answer.outcome.is_err()
    ));
}

/// The peer's forward requests: refused on sight over a host link, or naming the relay or
/// us (an answer, not a fault); the others go to the ledger.
#[test]
fn a_forward_request_is_refused_on_sight_across_hosts_or_naming_the_relay_or_us() {
    let ask = |to: ProcessId| {
        Wire::Forward(Forward {
            id: 7,
            lease: LeaseId::new(3),
            to,
        })
    };
    let refusal = |actions: &[Action<Plain>]| match sent(actions)[..] {
        [Wire::Forwarded(f)] if f.id == 7 => f.outcome.as_ref().err().cloned(),
        _ => None,
    };
    let mut s = session();
    assert!(matches!(&handle(&mut s, ask(third()))[..], [Action::Forward(f)] if f.to == third()));
    for to in [peer(), me()] {
        let reason = refusal(&handle(&mut s, ask(to))).expect("refused");
        assert!(
            reason.contains("is the relay or the exporter itself"),
            "{reason}"
        );
    }
    let mut s = session().across_hosts(peer());
    let reason = refusal(&handle(&mut s, ask(third()))).expect("refused");
    assert_eq!(
        reason,
        ActorError::ForwardRefused {
            reason: HOST_LINK_FORWARD.into()
        }
        .to_string()
    );
}

/// A peer's retired pool: within one host, our import of it is dropped — once, and only
/// for a pool whose descriptor came with one of the peer's offers over this link (the
/// import is keyed by the process the handshake proved, so no peer names another's; an
/// unknown pool, or a flood of retirements, costs nothing); across hosts, where no pool
/// is imported, the frame is a fault.
#[test]
fn a_retired_pool_is_forgotten_within_a_host_and_a_fault_across_hosts() {
    use baton_messages::protocol::PoolRetired;
    use baton_messages::{CudaPoolExportData, RawHandle};
    let retired = |pool| Wire::PoolRetired(PoolRetired { pool });
    let pool_offer = |lease, pool, descriptor: bool| {
        let mut o = offer(lease, lease);
        o.handle.raw = RawHandle::CudaPool {
            pool,
            pool_slot: descriptor.then_some(0),
            ptr: CudaPoolExportData([0; 64]),
        };
        o
    };
    let mut s = session();
    // Unknown pools: nothing to do.
    for pool in [3, u64::MAX] {
        assert!(handle(&mut s, retired(pool)).is_empty());
    }
    // Pool 3's descriptor comes with an offer; pool 4's offer carries none.
    for (lease, pool, descriptor) in [(1, 3, true), (2, 4, false)] {
        let opens = handle(
            &mut s,
            Wire::Offer(Box::new(pool_offer(lease, pool, descriptor))),
        );
        open_all(&mut s, opens);
    }
    assert!(matches!(
        &handle(&mut s, retired(3))[..],
        [Action::ForgetPool(3)]
    ));
    assert!(handle(&mut s, retired(3)).is_empty(), "once");
    assert!(handle(&mut s, retired(4)).is_empty());
    let e = fault(
        &mut session().across_hosts(peer()),
        retired(3),
        &Node::default(),
    );
    assert!(
        matches!(e, ActorError::Unexpected { got } if got.contains("PoolRetired")),
        "{e}"
    );
}

#[test]
fn a_handshake_frame_on_a_link_is_a_fault() {
    let mut s = session();
    let e = fault(
        &mut s,
        Wire::Refused(Refused {
            reason: RefuseReason::BadToken,
        }),
        &Node::default(),
    );
    assert!(
        matches!(e, ActorError::Unexpected { got: "Refused" }),
        "{e}"
    );
}

#[test]
fn a_silent_peer_is_unresponsive() {
    let t0 = Instant::now();
    let mut s: LinkSession<Plain> = LinkSession::new(peer(), me(), LIMITS, t0);
    let deadline = Duration::from_secs(10);
    let s1 = Duration::from_secs(1);
    assert!(matches!(
        s.tick(t0 + s1, deadline, false),
        Ok(Wire::Ping(1))
    ));
    // Heard at 5 s: silent for 9 s at 14 s, pinged.
    handle_at(&mut s, Wire::Pong(99), t0 + 5 * s1);
    assert!(matches!(
        s.tick(t0 + 14 * s1, deadline, false),
        Ok(Wire::Ping(2))
    ));
    // A paused reader's silence is ours.
    assert!(s.tick(t0 + 30 * s1, deadline, true).is_ok());
    match s.tick(t0 + 40 * s1, deadline, false) {
        Err(ActorError::Unresponsive { silent_for, .. }) => assert_eq!(silent_for, deadline),
        other => panic!("expected Unresponsive, got {:?}", other.map(|w| w.kind())),
    }
}

fn handle_at(s: &mut LinkSession<Plain>, frame: Wire, at: Instant) -> Vec<Action<Plain>> {
    s.handle(frame, at, &Node::default())
        .expect("no fault")
        .into_iter()
        .collect()
}

// What is no fault.

#[test]
fn pongs_give_their_round_trip_once() {
    let t0 = Instant::now();
    let mut s: LinkSession<Plain> = LinkSession::new(peer(), me(), LIMITS, t0);
    let (tx, mut rx) = oneshot::channel();
    let Wire::Ping(n) = s.ping(t0, Some(tx)) else {
        panic!("a ping")
    };
    let actions = handle_at(&mut s, Wire::Pong(n), t0 + Duration::from_millis(3));
    let [Action::Pong { rtt, reply }] = &actions[..] else {
        panic!("a pong")
    };
    assert_eq!(*rtt, Duration::from_millis(3));
    assert!(reply.is_some());
    drop(actions);
    assert!(rx.try_recv().is_err(), "the shell sends the round trip");
    // The same pong again, or one never asked for: nothing.
    assert!(handle(&mut s, Wire::Pong(n)).is_empty());
    assert!(handle(&mut s, Wire::Pong(77)).is_empty());
    // Pings never answered are forgotten once past the deadline.
    s.ping(t0, None);
    assert_eq!(s.pings(), 1);
    s.tick(t0 + Duration::from_secs(2), Duration::from_secs(10), true)
        .expect("alive");
    assert_eq!(s.pings(), 2);
    s.tick(t0 + Duration::from_secs(10), Duration::from_secs(10), true)
        .expect("alive");
    assert_eq!(s.pings(), 2, "the first is forgotten, the tick's own added");
}

#[test]
fn unmap_lets_go_of_a_mapping_or_answers_at_once() {
    let mut s = session();
    let _guards = hold(&mut s, &[1], 1);
    let unmap = |alloc| {
        Wire::Unmap(Unmap {
            alloc: AllocationId::new(alloc),
        })
    };
    assert!(matches!(
        &handle(&mut s, unmap(1))[..],
        [Action::Unhold { mapping: 1, .. }]
    ));
    assert!(!s.maps(AllocationId::new(1)));
    for alloc in [1, 2] {
        let actions = handle(&mut s, unmap(alloc));
        assert_eq!(
            sent(&actions),
            [&Wire::Unmapped(Unmapped {
                alloc: AllocationId::new(alloc)
            })]
        );
    }
}

/// What the rest of the node asks a link to tell its peer becomes one frame; an eviction
/// is asked only of an allocation this link still maps.
#[test]
fn a_notice_becomes_its_frame_and_an_eviction_needs_a_mapping() {
    let mut s = session();
    let alloc = AllocationId::new(1);
    let frame = |s: &LinkSession<Plain>, n| s.notice(n).map(|w| format!("{w:?}"));
    assert_eq!(frame(&s, Notice::Evict(alloc)), None, "not mapped");
    let _guards = hold(&mut s, &[1], 1);
    let notices = [
        (Notice::Evict(alloc), Wire::Evict(Evict { alloc })),
        (Notice::Unmap(alloc), Wire::Unmap(Unmap { alloc })),
        (Notice::Unmapped(alloc), Wire::Unmapped(Unmapped { alloc })),
        (
            Notice::PoolRetired(7),
            Wire::PoolRetired(PoolRetired { pool: 7 }),
        ),
        (
            Notice::Release(Release::now(LeaseId::new(4))),
            Wire::Release(Release::now(LeaseId::new(4))),
        ),
        (
            Notice::Revoke {
                lease: LeaseId::new(4),
                within: Duration::from_millis(1500),
            },
            Wire::Revoke(Revoke {
                lease: LeaseId::new(4),
                deadline_ms: 1500,
            }),
        ),
        (
            Notice::Revoke {
                lease: LeaseId::new(4),
                within: Duration::MAX,
            },
            Wire::Revoke(Revoke {
                lease: LeaseId::new(4),
                deadline_ms: u32::MAX,
            }),
        ),
        (
            Notice::Rendezvous(vec![1, 2]),
            Wire::Rendezvous(Rendezvous { bytes: vec![1, 2] }),
        ),
    ];
    for (notice, want) in notices {
        assert_eq!(frame(&s, notice), Some(format!("{want:?}")));
    }
}

#[test]
fn the_first_offer_of_an_allocation_starts_a_hold() {
    let mut s = session();
    let a = offer(1, 1);
    let b = offer(2, 1);
    let (ga, gb) = (Arc::new(()), Arc::new(()));
    assert!(s.opened(&a, Arc::downgrade(&ga), Kept::Warm(1), false));
    assert!(!s.opened(&b, Arc::downgrade(&gb), Kept::Warm(1), false));
    assert!(
        !s.opened(&offer(3, 2), Arc::downgrade(&gb), Kept::Own(3), false),
        "relayed"
    );
    assert_eq!(s.held(), 3);
}

#[test]
fn a_revoke_names_the_guard_of_a_lease_held() {
    let mut s = session();
    let mut guards = hold(&mut s, &[1], 1);
    let revoke = Wire::Revoke(Revoke {
        lease: LeaseId::new(1),
        deadline_ms: 50,
    });
    assert!(matches!(
        &handle(&mut s, revoke.clone())[..],
        [Action::Revoke {
            held: Some(_),
            deadline_ms: 50,
            ..
        }]
    ));
    guards.clear();
    assert!(matches!(
        &handle(&mut s, revoke)[..],
        [Action::Revoke { held: None, .. }]
    ));
}

#[test]
fn refused_offers_go_back() {
    let s = session();
    let offers = [offer(1, 1), offer(2, 1), offer(3, 2)];
    assert_eq!(
        s.refused(&offers, false),
        [
            Wire::Release(Release::now(LeaseId::new(1))),
            Wire::Release(Release::now(LeaseId::new(2))),
            Wire::Release(Release::now(LeaseId::new(3))),
            Wire::Unmapped(Unmapped {
                alloc: AllocationId::new(1)
            }),
            Wire::Unmapped(Unmapped {
                alloc: AllocationId::new(2)
            }),
        ]
    );
    // A relayed offer starts no hold at its exporter: no `Unmapped`.
    assert_eq!(s.refused(&offers[..1], true).len(), 1);
}

#[test]
fn replies_find_their_callers() {
    let mut s = session();
    s.call_sent(1, 1);
    s.call_sent(2, 2);
    s.call_sent(3, 3);
    assert!(matches!(
        &handle(&mut s, reply(1, vec![offer(1, 1)]))[..],
        [Action::Open(Open {
            then: Then::Reply { caller: 1, .. },
            ..
        })]
    ));
    let failed = Wire::Reply(Reply {
        id: 2,
        outcome: Err(CallFault::NoSuchActor),
    });
    assert!(matches!(
        &handle(&mut s, failed)[..],
        [Action::CallFailed { caller: 2, .. }]
    ));
    s.cancel(3);
    assert_eq!(s.calls_pending(), 0);
}

#[test]
fn an_ended_session_hands_back_its_callers_and_orphans() {
    let mut s = session();
    let mut guards = hold(&mut s, &[1, 2], 1);
    s.call_sent(4, 4);
    guards.truncate(1);
    let ended = s.end();
    assert_eq!(ended.callers, [4]);
    assert_eq!(
        ended.orphans.len(),
        1,
        "only leases still held are orphaned"
    );
    assert_eq!(ended.orphans[0].1, 4096);
    assert_eq!((s.held(), s.calls_pending()), (0, 0));
}

// The model.

/// One step of a random run: a frame from the peer, or something the shell reports.
#[derive(Debug, Clone)]
enum Step {
    /// The peer offers leases (bare, relayed, in a call, or in a reply).
    Offers {
        how: How,
        /// (lease — `None`: one never offered before —, allocation, whose buffer)
        offers: Vec<(Option<u64>, u64, Whose)>,
        /// The shell's open fails at this offer (a local failure).
        fails_at: Option<usize>,
    },
    /// The peer releases a lease of ours with this many fences: lease 1, or one lent as a
    /// copy over a host link (picked).
    Release {
        fences: usize,
        pick: Option<usize>,
    },
    /// Our lease guard drops, and the shell reports it (or not yet).
    Drop {
        index: usize,
        reported: bool,
    },
    /// The peer asks us to unmap an allocation.
    Unmap(u64),
    /// We send call `id` (ids are issued in order; this one may be skipped).
    Send,
    /// Our caller gives up on the call with this index.
    Cancel(usize),
    /// The peer's status request, or the end of one of our answers.
    StatusRequest,
    StatusAnswered,
    /// A ping of ours, and the peer's pong to ping `n`.
    Ping,
    Pong(u64),
    /// A heartbeat `ms` after the last.
    Tick {
        ms: u64,
        paused: bool,
    },
    /// A host link reads a user-visible message of this many payload bytes (its copies
    /// still to land).
    Hold(usize),
    /// The shell reports ready (its copies landed or failed) the message with this index
    /// among those not ready yet.
    HeldReady(usize),
    /// Over a host link, the shell lent a copy: a device copy (offered until pulled) or a
    /// host copy (sending at once), perhaps a forward's.
    CopyLent {
        device: bool,
        forward: bool,
    },
    /// The peer pulls a copy of ours (picked: among those offered and not pulled if
    /// `honest`, else among all), or a lease it was never offered.
    Pull(Option<(usize, bool)>),
    /// The shell starts the next pulled copy's send.
    StartPulled,
    /// The frame of a copy (picked) was never sent.
    CopyUnsent(usize),
    /// The peer's copies of this many bytes are to be received, or those with this index
    /// among the admitted landed.
    CopiesIn(usize),
    CopiesInDone(usize),
    /// We ask the peer to forward a lease of ours (the shell sent the request).
    AskForward,
    /// The peer answers a forward (picked) with an offer — of its own buffer, or of a third
    /// process's (`foreign`) — or a refusal.
    Forwarded {
        pick: usize,
        to: AnswerTo,
        offer: Option<bool>,
    },
    /// The peer asks us to forward a lease of its to the process of `whose`.
    Forward(Whose),
}

/// Which forward an answer names.
#[derive(Debug, Clone, Copy)]
enum AnswerTo {
    /// One we asked for and await.
    Asked,
    /// One answered already.
    Answered,
    /// One we never asked for.
    Never,
}

#[derive(Debug, Clone, Copy)]
enum How {
    Bare,
    Call,
    /// A reply: to a pending call, a call given up on (late), or one never made.
    Reply {
        pick: usize,
        to: ReplyTo,
    },
    Relayed,
}

#[derive(Debug, Clone, Copy)]
enum ReplyTo {
    Pending,
    Late,
    NeverMade,
}

/// Whose buffer an offer names: the one it should (the peer's; a third process's when
/// relayed), or another.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Whose {
    Right,
    Ours,
    Third,
    Peer,
    /// The right exporter's, but a handle to map: a fault over a host link, where only
    /// copies cross.
    Local,
}

fn step() -> impl Strategy<Value = Step> {
    let whose = prop_oneof![
        60 => Just(Whose::Right),
        1 => Just(Whose::Ours),
        1 => Just(Whose::Third),
        1 => Just(Whose::Peer),
        1 => Just(Whose::Local),
    ];
    let lease = prop::option::weighted(0.1, 0..12u64).prop_map(|l| l.map(|l| l + 1));
    let offer = (lease, 0..4u64, whose);
    let offers = prop_oneof![
        30 => prop::collection::vec(offer.clone(), 0..=LIMITS.offers_per_message),
        1 => prop::collection::vec(offer, LIMITS.offers_per_message + 1..=LIMITS.offers_per_message + 2),
    ];
    let to = prop_oneof![
        10 => Just(ReplyTo::Pending),
        3 => Just(ReplyTo::Late),
        1 => Just(ReplyTo::NeverMade),
    ];
    let how = prop_oneof![
        2 => Just(How::Bare),
        2 => Just(How::Call),
        2 => (0..8usize, to).prop_map(|(pick, to)| How::Reply { pick, to }),
        1 => Just(How::Relayed),
    ];
    let fences = prop_oneof![
        20 => 0..=MAX_RELEASE_FENCES,
        1 => Just(MAX_RELEASE_FENCES + 1),
    ];
    prop_oneof![
        8 => (how, offers, prop::option::weighted(0.1, 0..6usize)).prop_map(
            |(how, offers, fails_at)| Step::Offers { how, offers, fails_at }
        ),
        2 => (fences, prop::option::weighted(0.7, 0..8usize)).prop_map(|(fences, pick)| Step::Release { fences, pick }),
        6 => (0..8usize, prop::bool::weighted(0.8)).prop_map(|(index, reported)| Step::Drop { index, reported }),
        1 => (0..4u64).prop_map(Step::Unmap),
        3 => Just(Step::Send),
        1 => (0..8usize).prop_map(Step::Cancel),
        2 => Just(Step::StatusRequest),
        1 => Just(Step::StatusAnswered),
        1 => Just(Step::Ping),
        1 => (0..6u64).prop_map(Step::Pong),
        2 => (0..6000u64, prop::bool::weighted(0.2)).prop_map(|(ms, paused)| Step::Tick { ms, paused }),
        2 => prop_oneof![4 => 0..40usize, 1 => 40..120usize].prop_map(Step::Hold),
        3 => (0..8usize).prop_map(Step::HeldReady),
        3 => (prop::bool::weighted(0.7), prop::bool::weighted(0.3)).prop_map(|(device, forward)| Step::CopyLent { device, forward }),
        3 => prop::option::weighted(0.97, (0..8usize, prop::bool::weighted(0.9))).prop_map(Step::Pull),
        3 => Just(Step::StartPulled),
        1 => (0..8usize).prop_map(Step::CopyUnsent),
        1 => prop_oneof![4 => 0..400usize, 1 => 400..1200usize].prop_map(Step::CopiesIn),
        1 => (0..8usize).prop_map(Step::CopiesInDone),
        2 => Just(Step::AskForward),
        2 => (
            0..8usize,
            prop_oneof![8 => Just(AnswerTo::Asked), 2 => Just(AnswerTo::Answered), 1 => Just(AnswerTo::Never)],
            prop::option::weighted(0.7, prop::bool::weighted(0.05)),
        )
            .prop_map(|(pick, to, offer)| Step::Forwarded { pick, to, offer }),
        1 => prop_oneof![4 => Just(Whose::Right), 1 => Just(Whose::Peer), 1 => Just(Whose::Ours)].prop_map(Step::Forward),
    ]
}

/// A copy of ours over a host link, as the model keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyState {
    Offered,
    Pulled,
    Sending,
}

/// The fault the model expects, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    TooManyOffers,
    Foreign,
    Duplicate,
    TooManyLeases,
    TooManyFences,
    UnknownCall,
    TooManyStatusRequests,
    Unresponsive,
    TooManyHeld,
    /// A `Pull` of a lease not offered as a device copy (or on a Unix link).
    BadPull,
    /// Over a host link, an offer that is not a copy.
    NotACopy,
    /// An answer to a forward never asked for, or a forward's offer over a host link.
    BadForwarded,
}

fn kind(e: &ActorError) -> Option<Fault> {
    Some(match e {
        ActorError::TooManyOffers { .. } => Fault::TooManyOffers,
        ActorError::Unexpected { got } if got.contains("Pull") || got.contains("engines") => {
            Fault::BadPull
        }
        ActorError::Unexpected { got } if got.contains("Forwarded") => Fault::BadForwarded,
        ActorError::ForeignOffer { .. } | ActorError::Unexpected { .. } => Fault::Foreign,
        ActorError::DuplicateLease { .. } => Fault::Duplicate,
        ActorError::TooManyLeases { .. } => Fault::TooManyLeases,
        ActorError::TooManyFences { .. } => Fault::TooManyFences,
        ActorError::UnknownCall { .. } => Fault::UnknownCall,
        ActorError::TooManyStatusRequests { .. } => Fault::TooManyStatusRequests,
        ActorError::Unresponsive { .. } => Fault::Unresponsive,
        ActorError::TooManyHeld { .. } => Fault::TooManyHeld,
        ActorError::Ipc(baton_ipc::Error::Message(baton_messages::Error::BackendMismatch {
            ..
        })) => Fault::NotACopy,
        _ => return None,
    })
}

/// What the session should hold, kept the plain way.
#[derive(Default)]
struct Model {
    /// Leases held (opened, not reported released), and whether the guard is alive.
    held: BTreeMap<u64, bool>,
    /// The guards alive, by lease (the test's side of the shell).
    guards: Vec<(u64, Arc<()>)>,
    /// Allocations mapped over the link.
    mapped: BTreeSet<u64>,
    /// Calls issued (ids 0..issued), and those pending.
    issued: u64,
    pending: BTreeSet<u64>,
    status_answers: usize,
    /// Pings sent and not yet answered or forgotten: when each was sent (ms).
    pings: BTreeMap<u64, u64>,
    next_ping: u64,
    /// The last fresh lease id handed out (fresh ones start above the ones reused).
    fresh: u64,
    /// Time (ms since start), and when the peer was last heard.
    now: u64,
    heard: u64,
    /// A host link's messages read: the next one's place in the order, the next to hand
    /// on, those not ready yet (their turn, place and bytes), those ready and waiting for
    /// an earlier one, and the payload bytes of all not handed on.
    next_in: u32,
    next_out: u32,
    not_ready: Vec<(Turn, u32, usize)>,
    ready: BTreeMap<u32, usize>,
    held_bytes: usize,
    /// Over a host link: our copies by lease, the forwards among them, the pulled ones in
    /// order (stale ones included, as the session skips them), the next lease we lend, and
    /// the copies coming in (their bytes).
    copies: BTreeMap<u64, CopyState>,
    forwards: BTreeSet<u64>,
    pulls: std::collections::VecDeque<u64>,
    next_lent: u64,
    copies_in: Vec<usize>,
    /// Relayed leases recorded (opened, not reported released): their own holds.
    relayed: BTreeSet<u64>,
    /// Forwards we asked for and await, and the next one's id.
    asked: BTreeSet<u64>,
    next_forward: u64,
}

const DEADLINE_MS: u64 = 10_000;

impl Model {
    fn live(&self, lease: u64) -> bool {
        self.held.get(&lease).copied().unwrap_or(false)
    }

    /// The fault a frame of these offers is, checked in the session's order.
    fn offers_fault(&self, offers: &[ModelOffer], relayed: bool, across: bool) -> Option<Fault> {
        if offers.len() > LIMITS.offers_per_message {
            return Some(Fault::TooManyOffers);
        }
        for (i, &(lease, _, exporter, local)) in offers.iter().enumerate() {
            let foreign = if relayed {
                exporter == peer() || exporter == me()
            } else {
                exporter != peer()
            };
            if foreign {
                return Some(Fault::Foreign);
            }
            if across && local {
                return Some(Fault::NotACopy);
            }
            // A part of the lease before it: one lease over several buffers, never
            // relayed or across hosts.
            if i > 0 && offers[i - 1].0 == lease {
                if relayed || across {
                    return Some(Fault::Foreign);
                }
                continue;
            }
            let live = self.live(lease) || self.relayed.contains(&lease);
            if live || offers[..i].iter().any(|o| o.0 == lease) {
                return Some(Fault::Duplicate);
            }
        }
        if self.held.len() + runs(offers.iter().map(|o| o.0)) > LIMITS.leases_held {
            return Some(Fault::TooManyLeases);
        }
        None
    }
}

/// How many leases offers name, adjacent offers of one lease being its parts.
fn runs(leases: impl IntoIterator<Item = u64>) -> usize {
    let mut last = None;
    leases
        .into_iter()
        .filter(|&l| last.replace(l) != Some(l))
        .count()
}

/// An offer as the model sees it: lease, allocation, exporter, and whether it is a handle
/// to map rather than a copy (over a host link; within one host every offer is one).
type ModelOffer = (u64, u64, ProcessId, bool);

/// The exporter of an offer: the right one (the peer's; a third process's, relayed), or
/// the one named.
fn exporter(whose: Whose, relayed: bool) -> ProcessId {
    match whose {
        Whose::Right | Whose::Local if relayed => third(),
        Whose::Right | Whose::Local | Whose::Peer => peer(),
        Whose::Ours => me(),
        Whose::Third => third(),
    }
}

/// How a run ended.
#[derive(Default)]
struct Outcome {
    /// The fault that ended it, if one did.
    fault: Option<Fault>,
    /// The most leases held at once.
    most_held: usize,
    /// Pulled copies started, and copies released while sending.
    started: usize,
    released_sending: usize,
    /// Forwards answered to who asked.
    forwards_answered: usize,
}

/// Runs `steps` against a session and the model; stops at the first fault, which must be
/// the one the model expects.
fn run(across: bool, steps: Vec<Step>) -> Result<Outcome, TestCaseError> {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut s: LinkSession<Plain> = LinkSession::new(peer(), me(), LIMITS, t0);
    if across {
        s = s.across_hosts(peer());
    }
    let mut outcome = Outcome::default();
    let mut m = Model {
        next_ping: 1,
        fresh: 100,
        next_lent: 1000,
        next_forward: 1,
        ..Model::default()
    };
    // A copy of ours, picked.
    let pick_copy =
        |m: &Model, pick: usize| m.copies.keys().nth(pick % m.copies.len().max(1)).copied();
    for step in steps {
        let node = Node {
            issued: m.issued,
            refuse_fences: false,
        };
        // A frame from the peer: the fault the model expects, and the result.
        let (expected, result) = match step {
            Step::Offers {
                how,
                offers,
                fails_at,
            } => {
                let relayed = matches!(how, How::Relayed);
                // Leases never offered before get fresh ids; the buffers' exporters.
                let offers: Vec<ModelOffer> = offers
                    .into_iter()
                    .map(|(lease, alloc, whose)| {
                        let lease = lease.unwrap_or_else(|| {
                            m.fresh += 1;
                            m.fresh
                        });
                        (
                            lease,
                            alloc,
                            exporter(whose, relayed),
                            whose == Whose::Local,
                        )
                    })
                    .collect();
                let mut offers = offers;
                if matches!(how, How::Bare | How::Relayed) {
                    offers.truncate(1);
                }
                let wire: Vec<Offer> = offers
                    .iter()
                    .map(|&(lease, alloc, exporter, local)| match across && !local {
                        true => copy_of(exporter, lease, alloc),
                        false => offer_of(exporter, lease, alloc),
                    })
                    .collect();
                let (frame, mut expected, late) = match how {
                    // A bare or relayed offer is one.
                    How::Bare | How::Relayed if wire.is_empty() => continue,
                    How::Bare => (Wire::Offer(Box::new(wire[0].clone())), None, false),
                    How::Relayed => (
                        Wire::Relayed(Box::new(Relayed {
                            offer: wire[0].clone(),
                        })),
                        None,
                        false,
                    ),
                    How::Call => (call(1, wire), None, false),
                    How::Reply { pick, to } => {
                        let late: Vec<u64> =
                            (0..m.issued).filter(|id| !m.pending.contains(id)).collect();
                        let pending: Vec<u64> = m.pending.iter().copied().collect();
                        let (id, expected, late) = match to {
                            ReplyTo::Pending if !pending.is_empty() => {
                                let id = pending[pick % pending.len()];
                                m.pending.remove(&id);
                                (id, None, false)
                            }
                            ReplyTo::Late if !late.is_empty() => {
                                let too_many = offers.len() > LIMITS.offers_per_message;
                                let expected = too_many.then_some(Fault::TooManyOffers);
                                (late[pick % late.len()], expected, true)
                            }
                            ReplyTo::NeverMade => {
                                (m.issued + pick as u64, Some(Fault::UnknownCall), false)
                            }
                            _ => continue,
                        };
                        (reply(id, wire), expected, late)
                    }
                };
                if expected.is_none() && !late {
                    expected = m.offers_fault(&offers, relayed, across);
                }
                m.heard = m.now;
                let result = s.handle(frame, at(m.now), &node);
                if let (None, Ok(actions)) = (&expected, &result) {
                    if late {
                        // Every lease goes back; nothing is held.
                        let releases = sent(actions)
                            .iter()
                            .filter(|w| matches!(w, Wire::Release(_)))
                            .count();
                        prop_assert_eq!(releases, runs(offers.iter().map(|o| o.0)));
                    } else {
                        prop_assert_eq!(actions.len(), 1);
                        let Action::Open(open) = &actions[0] else {
                            return Err(TestCaseError::fail("an open was expected"));
                        };
                        let upto = fails_at.unwrap_or(usize::MAX).min(open.offers.len());
                        for (i, o) in open.offers[..upto].iter().enumerate() {
                            let guard = Arc::new(());
                            let part = i > 0 && open.offers[i - 1].lease == o.lease;
                            let new_hold =
                                s.opened(o, Arc::downgrade(&guard), kept(o, relayed), part);
                            let alloc = o.handle.alloc.get();
                            prop_assert_eq!(new_hold, !relayed && m.mapped.insert(alloc));
                            m.held.insert(o.lease.get(), true);
                            if !part {
                                // A part is held through its lease's first part's guard.
                                m.guards.push((o.lease.get(), guard));
                            }
                            match relayed {
                                true => m.relayed.insert(o.lease.get()),
                                false => m.relayed.remove(&o.lease.get()),
                            };
                        }
                        if upto < open.offers.len() {
                            let back = s.refused(&open.offers[upto..], relayed);
                            let unmapped: BTreeSet<u64> = if relayed {
                                BTreeSet::new()
                            } else {
                                open.offers[upto..]
                                    .iter()
                                    .map(|o| o.handle.alloc.get())
                                    .filter(|a| !m.mapped.contains(a))
                                    .collect()
                            };
                            let leases = runs(open.offers[upto..].iter().map(|o| o.lease.get()));
                            prop_assert_eq!(back.len(), leases + unmapped.len());
                        }
                    }
                }
                (expected, result.map(|_| ()))
            }
            Step::Release { fences, pick } => {
                m.heard = m.now;
                let lease = pick.and_then(|p| pick_copy(&m, p)).unwrap_or(1);
                let frame = Wire::Release(Release {
                    lease: LeaseId::new(lease),
                    fences: vec![fence(); fences],
                });
                let expected = (fences > MAX_RELEASE_FENCES).then_some(Fault::TooManyFences);
                let result = s.handle(frame, at(m.now), &node);
                if let (None, Ok(actions)) = (expected, &result) {
                    let [Action::Released { route, .. }] = &actions[..] else {
                        return Err(TestCaseError::fail("one release was expected"));
                    };
                    // Routed by how the lease was lent, handing back what still runs.
                    let state = m.copies.remove(&lease);
                    let sending = (state == Some(CopyState::Sending)).then_some(lease);
                    outcome.released_sending += usize::from(across && sending.is_some());
                    let forward = m.forwards.remove(&lease).then_some(lease);
                    let got = match route {
                        ReleaseRoute::Copy(CopyReleased::Copy { sending }) => {
                            Some((*sending, None))
                        }
                        ReleaseRoute::Copy(CopyReleased::Forward { waiter, sending }) => {
                            Some((*sending, Some(*waiter)))
                        }
                        _ => None,
                    };
                    prop_assert_eq!(got, across.then_some((sending, forward)));
                }
                (expected, result.map(|_| ()))
            }
            // Within one host every pull is a fault: rarely tried, so runs go on.
            Step::Pull(Some(_)) if !across => continue,
            Step::Pull(pick) => {
                m.heard = m.now;
                let offered: Vec<u64> = (m.copies.iter())
                    .filter(|(_, state)| **state == CopyState::Offered)
                    .map(|(lease, _)| *lease)
                    .collect();
                let lease = match pick {
                    Some((p, true)) if !offered.is_empty() => Some(offered[p % offered.len()]),
                    Some((p, _)) => pick_copy(&m, p),
                    None => None,
                }
                .unwrap_or(9999);
                let frame = Wire::Pull(Pull {
                    lease: LeaseId::new(lease),
                });
                let expected = match m.copies.get_mut(&lease) {
                    Some(state) if across && *state == CopyState::Offered => {
                        *state = CopyState::Pulled;
                        m.pulls.push_back(lease);
                        None
                    }
                    _ => Some(Fault::BadPull),
                };
                (expected, s.handle(frame, at(m.now), &node).map(|_| ()))
            }
            Step::Unmap(alloc) => {
                m.heard = m.now;
                let frame = Wire::Unmap(Unmap {
                    alloc: AllocationId::new(alloc),
                });
                let actions = s.handle(frame, at(m.now), &node).expect("no fault");
                let was = m.mapped.remove(&alloc);
                prop_assert_eq!(
                    matches!(&actions[..], [Action::Unhold { mapping, .. }] if *mapping == alloc),
                    was
                );
                continue;
            }
            Step::StatusRequest => {
                m.heard = m.now;
                let frame = Wire::StatusRequest(StatusRequest {
                    id: 1,
                    scope: StatusScope::Node,
                    limit: 0,
                });
                let expected = if m.status_answers >= STATUS_ANSWERS {
                    Some(Fault::TooManyStatusRequests)
                } else {
                    m.status_answers += 1;
                    None
                };
                (expected, s.handle(frame, at(m.now), &node).map(|_| ()))
            }
            Step::Pong(n) => {
                m.heard = m.now;
                let actions = s.handle(Wire::Pong(n), at(m.now), &node).expect("no fault");
                match m.pings.remove(&n) {
                    Some(sent) => {
                        let rtt = Duration::from_millis(m.now - sent);
                        let pong =
                            matches!(&actions[..], [Action::Pong { rtt: r, .. }] if *r == rtt);
                        prop_assert!(pong, "a pong of {:?}", rtt);
                    }
                    None => prop_assert!(actions.is_empty()),
                }
                continue;
            }
            Step::Tick { ms, paused } => {
                m.now += ms;
                if paused {
                    m.heard = m.now;
                }
                let result = s.tick(at(m.now), Duration::from_millis(DEADLINE_MS), paused);
                let expected = (m.now - m.heard >= DEADLINE_MS).then_some(Fault::Unresponsive);
                if expected.is_none() {
                    let now = m.now;
                    m.pings.retain(|_, sent| now - *sent < DEADLINE_MS);
                    m.pings.insert(m.next_ping, m.now);
                    m.next_ping += 1;
                }
                (expected, result.map(|_| ()))
            }
            Step::Hold(bytes) => {
                let waiting = (m.next_in - m.next_out) as usize;
                let expected = (waiting > 0
                    && (waiting >= LIMITS.held_messages
                        || m.held_bytes + bytes > LIMITS.held_bytes))
                    .then_some(Fault::TooManyHeld);
                let result = s.hold(bytes).map(|turn| {
                    m.not_ready.push((turn, m.next_in, bytes));
                    m.next_in += 1;
                    m.held_bytes += bytes;
                });
                (expected, result)
            }
            Step::HeldReady(index) => {
                if !m.not_ready.is_empty() {
                    let (turn, seq, bytes) = m.not_ready.remove(index % m.not_ready.len());
                    m.ready.insert(seq, bytes);
                    let mut want = Vec::new();
                    while let Some(bytes) = m.ready.remove(&m.next_out) {
                        want.push(m.next_out);
                        m.held_bytes -= bytes;
                        m.next_out += 1;
                    }
                    prop_assert_eq!(s.held_ready(turn, seq), want, "handed on in the order read");
                }
                continue;
            }
            // What the shell reports.
            Step::CopyLent { device, forward } => {
                if across {
                    m.next_lent += 1;
                    let lease = LeaseId::new(m.next_lent);
                    if device {
                        s.copy_offered(lease, m.next_lent);
                        m.copies.insert(m.next_lent, CopyState::Offered);
                    } else {
                        s.copy_sending(lease, m.next_lent);
                        m.copies.insert(m.next_lent, CopyState::Sending);
                    }
                    if forward {
                        s.forward_offered(lease, m.next_lent);
                        m.forwards.insert(m.next_lent);
                    }
                }
                continue;
            }
            Step::StartPulled => {
                while let Some(front) = m.pulls.front() {
                    if m.copies.get(front) == Some(&CopyState::Pulled) {
                        break;
                    }
                    m.pulls.pop_front();
                }
                let want = m.pulls.pop_front();
                let got = s.take_pulled();
                prop_assert_eq!(
                    got,
                    want.map(|l| (LeaseId::new(l), l)),
                    "started in the order pulled"
                );
                if let Some(lease) = want {
                    outcome.started += 1;
                    s.copy_sending(LeaseId::new(lease), lease);
                    m.copies.insert(lease, CopyState::Sending);
                }
                continue;
            }
            Step::CopyUnsent(pick) => {
                if let Some(lease) = pick_copy(&m, pick) {
                    let sending = m.copies.remove(&lease) == Some(CopyState::Sending);
                    prop_assert_eq!(s.copy_unsent(LeaseId::new(lease)), sending.then_some(lease));
                }
                continue;
            }
            Step::CopiesIn(bytes) => {
                let fits = m.copies_in.iter().sum::<usize>() + bytes <= LIMITS.copy_bytes;
                prop_assert_eq!(s.admit_copies_in(bytes), fits);
                if fits {
                    m.copies_in.push(bytes);
                }
                continue;
            }
            Step::CopiesInDone(index) => {
                if !m.copies_in.is_empty() {
                    let bytes = m.copies_in.remove(index % m.copies_in.len());
                    s.copies_in_done(bytes);
                }
                continue;
            }
            Step::AskForward => {
                let (id, frame) = s.ask_forward(LeaseId::new(1), third());
                prop_assert_eq!(id, m.next_forward);
                let asks = matches!(frame, Wire::Forward(Forward { id: i, .. }) if i == id);
                prop_assert!(asks, "the request names forward {}", id);
                s.await_forward(id, id);
                m.asked.insert(id);
                m.next_forward += 1;
                continue;
            }
            Step::Forwarded { pick, to, offer } => {
                // Over a host link an offer is a fault: rarely tried, so runs go on.
                let offer = offer.filter(|_| !across || pick % 8 == 0);
                let answered: Vec<u64> = (1..m.next_forward)
                    .filter(|id| !m.asked.contains(id))
                    .collect();
                let id = match to {
                    AnswerTo::Asked if !m.asked.is_empty() => {
                        *m.asked.iter().nth(pick % m.asked.len()).unwrap()
                    }
                    AnswerTo::Answered if !answered.is_empty() => answered[pick % answered.len()],
                    AnswerTo::Never if pick % 4 == 0 => 0,
                    AnswerTo::Never => m.next_forward + pick as u64,
                    _ => continue,
                };
                m.heard = m.now;
                m.fresh += 1;
                let lease = m.fresh;
                let answer = match offer {
                    Some(foreign) => {
                        let exporter = if foreign { third() } else { peer() };
                        Ok(match across {
                            true => copy_of(exporter, lease, 0),
                            false => offer_of(exporter, lease, 0),
                        })
                    }
                    None => Err("refused".to_owned()),
                };
                let frame = Wire::Forwarded(Box::new(Forwarded {
                    id,
                    outcome: answer,
                }));
                let waits = m.asked.contains(&id);
                let never = !waits && (id == 0 || id >= m.next_forward);
                let expected = if (across && offer.is_some()) || never {
                    Some(Fault::BadForwarded)
                } else if waits && offer == Some(true) {
                    Some(Fault::Foreign)
                } else {
                    None
                };
                let result = s.handle(frame, at(m.now), &node);
                if let (None, Ok(actions)) = (expected, &result) {
                    if waits {
                        // Handed to who asked, once.
                        m.asked.remove(&id);
                        outcome.forwards_answered += 1;
                        let handed = matches!(
                            &actions[..],
                            [Action::Forwarded { asked, answer }]
                                if *asked == id && answer.outcome.as_ref().map(|o| o.lease.get()).ok() == offer.map(|_| lease)
                        );
                        prop_assert!(handed, "the answer to forward {} goes to who asked", id);
                    } else {
                        // Answered already: its offer goes back.
                        let back: Vec<u64> = sent(actions)
                            .iter()
                            .filter_map(|w| match w {
                                Wire::Release(r) => Some(r.lease.get()),
                                _ => None,
                            })
                            .collect();
                        prop_assert_eq!(actions.len(), usize::from(offer.is_some()));
                        prop_assert_eq!(back, offer.map(|_| lease).into_iter().collect::<Vec<_>>());
                    }
                }
                (expected, result.map(|_| ()))
            }
            Step::Forward(whose) => {
                m.heard = m.now;
                let to = match whose {
                    Whose::Peer => peer(),
                    Whose::Ours => me(),
                    _ => third(),
                };
                let frame = Wire::Forward(Forward {
                    id: 3,
                    lease: LeaseId::new(1),
                    to,
                });
                let actions = s.handle(frame, at(m.now), &node).expect("never a fault");
                let refused = across || to != third();
                let got = match &actions[..] {
                    [Action::Forward(f)] if f.to == to => Some(false),
                    [Action::Send(Wire::Forwarded(f))] if f.id == 3 && f.outcome.is_err() => {
                        Some(true)
                    }
                    _ => None,
                };
                prop_assert_eq!(got, Some(refused), "refused on sight: {}", refused);
                continue;
            }
            Step::Drop { index, reported } => {
                if !m.guards.is_empty() {
                    let (lease, guard) = m.guards.remove(index % m.guards.len());
                    drop(guard);
                    m.held.insert(lease, false);
                    if reported {
                        let own = m.relayed.remove(&lease).then_some(lease);
                        prop_assert_eq!(s.released(LeaseId::new(lease)), own);
                        m.held.remove(&lease);
                    }
                }
                continue;
            }
            Step::Send => {
                s.call_sent(m.issued, m.issued);
                m.pending.insert(m.issued);
                m.issued += 1;
                continue;
            }
            Step::Cancel(i) => {
                s.cancel(i as u64);
                m.pending.remove(&(i as u64));
                continue;
            }
            Step::StatusAnswered => {
                s.status_answered();
                m.status_answers = m.status_answers.saturating_sub(1);
                continue;
            }
            Step::Ping => {
                s.ping(at(m.now), None);
                m.pings.insert(m.next_ping, m.now);
                m.next_ping += 1;
                continue;
            }
        };
        match (expected, result) {
            (None, Ok(())) => {}
            (Some(fault), Err(e)) => {
                prop_assert_eq!(Some(fault), kind(&e), "{}", e);
                // The session is over: what it held is handed back, as the model says.
                let ended = s.end();
                prop_assert_eq!(ended.orphans.len(), m.guards.len());
                prop_assert_eq!(ended.callers.len(), m.pending.len());
                prop_assert_eq!(ended.forwards.len(), m.forwards.len());
                prop_assert_eq!(ended.asked.len(), m.asked.len());
                let mut relayed = ended.relayed;
                relayed.sort_unstable();
                prop_assert_eq!(relayed, m.relayed.iter().copied().collect::<Vec<_>>());
                outcome.fault = Some(fault);
                return Ok(outcome);
            }
            (expected, result) => {
                return Err(TestCaseError::fail(format!(
                    "expected {expected:?}, the session said {:?}",
                    result.err().map(|e| e.to_string())
                )));
            }
        }
        // After every step: the session holds what the model does, within the bounds.
        prop_assert_eq!(s.held(), m.held.len());
        outcome.most_held = outcome.most_held.max(s.held());
        prop_assert!(s.held() <= LIMITS.leases_held);
        prop_assert_eq!(s.calls_pending(), m.pending.len());
        prop_assert!(s.status_answers <= STATUS_ANSWERS);
        prop_assert_eq!(s.status_answers, m.status_answers);
        prop_assert_eq!(s.pings(), m.pings.len());
        prop_assert_eq!(s.held_back(), (m.next_in - m.next_out) as usize);
        prop_assert_eq!(s.copies_out(), m.copies.len());
        prop_assert_eq!(s.copies_in(), m.copies_in.iter().sum::<usize>());
        prop_assert_eq!(s.forwards_asked(), m.asked.len());
        prop_assert!(s.held_back() <= LIMITS.held_messages);
        for alloc in 0..4 {
            prop_assert_eq!(s.maps(AllocationId::new(alloc)), m.mapped.contains(&alloc));
        }
    }
    Ok(outcome)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_frames_against_the_model(
        across in any::<bool>(),
        steps in prop::collection::vec(step(), 1..80),
    ) {
        run(across, steps)?;
    }
}

/// The model's runs reach every fault, and the lease limit: the property above is not
/// vacuous.
#[test]
fn the_random_runs_reach_every_fault() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let steps = (any::<bool>(), prop::collection::vec(step(), 1..80));
    let mut faults = BTreeSet::new();
    let mut most_held = 0;
    let (mut started, mut released_sending, mut answered) = (0, 0, 0);
    for _ in 0..2000 {
        let tree = steps.new_tree(&mut runner).expect("a run");
        let (across, steps) = tree.current();
        let outcome = run(across, steps).expect("the model agrees");
        faults.extend(outcome.fault);
        most_held = most_held.max(outcome.most_held);
        started += outcome.started;
        released_sending += outcome.released_sending;
        answered += outcome.forwards_answered;
    }
    assert!(
        started > 30 && released_sending > 30 && answered > 30,
        "{started} {released_sending} {answered}"
    );
    assert_eq!(
        faults.into_iter().collect::<Vec<_>>(),
        [
            Fault::TooManyOffers,
            Fault::Foreign,
            Fault::Duplicate,
            Fault::TooManyLeases,
            Fault::TooManyFences,
            Fault::UnknownCall,
            Fault::TooManyStatusRequests,
            Fault::Unresponsive,
            Fault::TooManyHeld,
            Fault::BadPull,
            Fault::NotACopy,
            Fault::BadForwarded,
        ]
    );
    assert_eq!(most_held, LIMITS.leases_held);
}
