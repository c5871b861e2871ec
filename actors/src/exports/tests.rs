//! What no test across processes reaches on purpose: a grant over a link the ledger already
//! knows is down while its actor still handles sends (below), and forwarding's refusals and
//! counters, whose answers reach a relay only as text (the tests after those). The ledger forgets a link when its
//! actor stops (`link_cut`) — after which the actor handles nothing — or when the peer's
//! process is confirmed dead (`process_dead`), which the death watch reports from its own
//! thread and may do between a link actor's start and the node listing the link. A send
//! handled then must fail as the link's end, `LinkClosed`, not as an unknown buffer.

use super::*;
use crate::link_ref::{LinkCommand, LinkState};
use actix::{Actor, AsyncContext, Context, Handler};
use baton_ipc::{HostBackend, HostFlavor};
use baton_messages::{BootId, DType, Shape};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use tokio::sync::Semaphore;

/// A link actor's mailbox nobody reads: a grant sends nothing to it.
struct Unread;

impl Actor for Unread {
    type Context = Context<Self>;
}

impl Handler<LinkCommand> for Unread {
    type Result = ();
    fn handle(&mut self, _: LinkCommand, _: &mut Context<Self>) {}
}

fn process(pid: u32) -> ProcessId {
    ProcessId {
        boot: BootId([3; 16]),
        pid,
        start_ticks: 77,
    }
}

/// A reference to a link to `peer` whose actor runs (as far as the link knows: alive).
fn link_to(peer: ProcessId) -> LinkRef {
    let state = Arc::new(LinkState {
        alive: AtomicBool::new(true),
        peer,
        rtt_ns: AtomicU64::new(0),
        next_call: AtomicU64::new(1),
        send_window: Arc::new(Semaphore::new(1 << 20)),
        window_size: 1 << 20,
        pending_calls: Arc::new(Semaphore::new(16)),
        queued: AtomicUsize::new(0),
        queued_calls: AtomicUsize::new(0),
        held_leases: AtomicUsize::new(0),
        fds_received: AtomicU64::new(0),
        reads_ring: AtomicBool::new(false),
        writes_ring: AtomicBool::new(false),
        turn: Arc::new(tokio::sync::Mutex::new(())),
        stopped: tokio::sync::watch::Sender::new(false),
        pinned: Default::default(),
        frames: Default::default(),
    });
    let mailbox = Context::<Unread>::new().address().recipient();
    LinkRef::new(LinkId::next(), mailbox, state)
}

/// Exports with one live buffer of 4 KiB of memfd host memory (nothing in `/dev/shm`).
fn exports_with_a_buffer() -> (Arc<Exports>, Arc<BufferCell>) {
    let (exports, mut cells) = exports_with_buffers(1);
    (exports, cells.remove(0))
}

/// Exports with `n` live buffers of 4 KiB of memfd host memory.
fn exports_with_buffers(n: usize) -> (Arc<Exports>, Vec<Arc<BufferCell>>) {
    let host: SharedBackend =
        Arc::new(HostBackend::with_flavor(HostFlavor::Memfd, "exports-unit").unwrap());
    let exports = Exports::new(Session::generate().unwrap(), Offload::for_backends([&host]));
    let cells = (0..n)
        .map(|_| {
            exports.insert(
                host.allocate(4096).unwrap(),
                Arc::clone(&host),
                Layout::new(DType::U8, Shape::vector(4096)),
                crate::ids::next_actor(),
                RevokePolicy::Cut,
            )
        })
        .collect();
    (exports, cells)
}

fn assert_link_closed(
    got: Result<(Offer, Option<OwnedFd>, OfferGrant), ActorError>,
    peer: ProcessId,
) {
    match got {
        Err(ActorError::LinkClosed { peer: p, .. }) => assert_eq!(p, peer),
        Err(e) => panic!("a grant over a link that is down failed with {e:?}, not LinkClosed"),
        Ok(_) => panic!("a lease was granted over a link that is down"),
    }
}

#[test]
fn a_grant_over_a_link_whose_peer_was_confirmed_dead_is_link_closed() {
    let (exports, cell) = exports_with_a_buffer();
    let peer = process(4242);
    let link = link_to(peer);
    exports.link_up(&link);
    // Granted while the link is up (and given back): the buffer itself is grantable.
    let (offer, _fd, grant) = exports
        .grant(&cell, None, false, &link, 0, None, None)
        .unwrap();
    assert_eq!(offer.lease, grant.lease);
    exports.ungrant(grant, link.id);

    // The death watch saw the peer die; its link actor has not stopped yet.
    exports.process_dead(peer);
    assert_link_closed(
        exports.grant(&cell, None, false, &link, 0, None, None),
        peer,
    );
    assert_eq!(exports.leases_on(cell.id), 0, "nothing granted");
    assert_eq!(
        exports.stats(None).granted,
        1,
        "only the grant made while it was up"
    );
}

#[test]
fn a_grant_over_a_cut_link_is_link_closed() {
    let (exports, cell) = exports_with_a_buffer();
    let peer = process(4343);
    let link = link_to(peer);
    exports.link_up(&link);
    exports.link_cut(link.id);
    assert_link_closed(
        exports.grant(&cell, None, false, &link, 0, None, None),
        peer,
    );
    assert_eq!(exports.leases_on(cell.id), 0);
}

/// A buffer leased over a link to `relay`, as the lease a relay forwards.
fn leased_to_relay() -> (Arc<Exports>, Arc<BufferCell>, LinkRef, LeaseId) {
    let (exports, cell) = exports_with_a_buffer();
    let link = link_to(process(5000));
    exports.link_up(&link);
    let (offer, _fd, _grant) = exports
        .grant(&cell, None, false, &link, 0, None, None)
        .unwrap();
    (exports, cell, link, offer.lease)
}

#[test]
fn a_relayed_grant_over_a_link_whose_peer_was_confirmed_dead_is_link_closed() {
    let (exports, _cell, link, via) = leased_to_relay();
    exports.process_dead(link.peer());
    match exports.grant_relayed(via, &link, process(5001), 4) {
        Err(ActorError::LinkClosed { peer, .. }) => assert_eq!(peer, link.peer()),
        Err(e) => panic!("a forward over a link that is down failed with {e:?}, not LinkClosed"),
        Ok(_) => panic!("a lease was forwarded over a link that is down"),
    }
}

#[test]
fn relayed_grants_past_the_bound_are_too_many_leases_and_are_counted_for_their_owner() {
    let (exports, cell, link, via) = leased_to_relay();
    let owner_granted = |e: &Exports| e.stats(Some(cell.owner)).granted;
    assert_eq!(owner_granted(&exports), 1, "the relay's own lease");
    let max = 3;
    for n in 0..max {
        exports
            .grant_relayed(via, &link, process(6000 + n as u32), max)
            .unwrap();
    }
    assert_eq!(owner_granted(&exports), 1 + max as u64);
    assert_eq!(exports.stats(None).granted, 1 + max as u64);
    assert_eq!(exports.leases_on(cell.id), 1 + max);
    match exports.grant_relayed(via, &link, process(6100), max) {
        Err(ActorError::TooManyLeases { max: m }) => assert_eq!(m, max),
        Err(e) => panic!("a forward past the bound failed with {e:?}, not TooManyLeases"),
        Ok(_) => panic!("a forward past the bound of {max} was granted"),
    }
    assert_eq!(
        owner_granted(&exports),
        1 + max as u64,
        "a refusal grants nothing"
    );
    assert_eq!(exports.leases_on(cell.id), 1 + max);
}

#[test]
fn a_release_that_crossed_its_relayed_holders_death_is_no_fault_but_an_unknown_one_is() {
    let (exports, cell, link, via) = leased_to_relay();
    let holder = process(7000);
    let (offer, _fd) = exports.grant_relayed(via, &link, holder, 4).unwrap();
    let forwarded = offer.lease;
    // The holder dies; its release, passed on by the relay, was already on the way.
    exports.process_dead(holder);
    assert_eq!(
        exports.leases_on(cell.id),
        1,
        "the relay's own lease is left"
    );
    exports
        .release(forwarded, link.id, Vec::new())
        .expect("a release that crossed its holder's death");
    // Once: a second release of it is a lease the link does not hold.
    match exports.release(forwarded, link.id, Vec::new()) {
        Err(ActorError::UnknownLease { lease }) => assert_eq!(lease, forwarded),
        other => panic!("a second release of an ended relay gave {other:?}"),
    }
    // A lease never granted is refused the same way.
    let never = crate::ids::next_lease();
    match exports.release(never, link.id, Vec::new()) {
        Err(ActorError::UnknownLease { lease }) => assert_eq!(lease, never),
        other => panic!("the release of a lease never granted gave {other:?}"),
    }
    exports.release(via, link.id, Vec::new()).unwrap();
    assert_eq!(exports.leases_on(cell.id), 0);
}

/// A lease over several buffers: each part is a lease of the ledger, and the peer names
/// them all by the first. Its one release gives every part back with the fences it
/// carried; a forward of it is refused; parts taken back unsent, or ended with their
/// link, leave nothing in the maps that name them.
#[test]
fn a_lease_over_several_buffers_is_released_whole_and_never_forwarded() {
    let (exports, cells) = exports_with_buffers(3);
    let link = link_to(process(6000));
    exports.link_up(&link);
    let grant_parts = || {
        let mut first = None;
        let mut grants = Vec::new();
        for (i, cell) in cells.iter().enumerate() {
            let (offer, _fd, grant) = exports
                .grant(cell, None, false, &link, 0, None, first)
                .unwrap();
            first.get_or_insert(offer.lease);
            assert_eq!(offer.lease, first.unwrap(), "every part names the first");
            assert_eq!(
                grant.lease == offer.lease,
                i == 0,
                "each part its own ledger lease"
            );
            grants.push(grant);
        }
        (first.unwrap(), grants)
    };
    let (lease, _) = grant_parts();
    assert!(cells.iter().all(|c| exports.leases_on(c.id) == 1));
    match exports.grant_relayed(lease, &link, process(6001), 8) {
        Err(ActorError::ForwardRefused { reason }) => assert!(reason.contains("several")),
        other => panic!(
            "a lease over several buffers was forwarded: {:?}",
            other.map(|_| ())
        ),
    }
    exports.release(lease, link.id, Vec::new()).unwrap();
    assert!(
        cells.iter().all(|c| exports.leases_on(c.id) == 0),
        "every part back"
    );
    assert!(
        matches!(
            exports.release(lease, link.id, Vec::new()),
            Err(ActorError::UnknownLease { .. })
        ),
        "released once"
    );
    let groups = |e: &Exports| {
        let s = e.lock();
        (s.groups.parts.len(), s.groups.first.len())
    };
    assert_eq!(groups(&exports), (0, 0));
    // Taken back unsent, newest first, as a frame that could not be sent is.
    let (_, grants) = grant_parts();
    for grant in grants.into_iter().rev() {
        exports.ungrant(grant, link.id);
    }
    assert_eq!(groups(&exports), (0, 0), "ungranted parts forgotten");
    // Ended with their link.
    grant_parts();
    exports.link_cut(link.id);
    assert!(cells.iter().all(|c| exports.leases_on(c.id) == 0));
    assert_eq!(
        groups(&exports),
        (0, 0),
        "parts ended with the link forgotten"
    );
}
