//! What no test across processes reaches on purpose: a grant over a link the ledger already
//! knows is down while its actor still handles sends. The ledger forgets a link when its
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
        turn: Arc::new(tokio::sync::Mutex::new(())),
        stopped: tokio::sync::watch::Sender::new(false),
    });
    let mailbox = Context::<Unread>::new().address().recipient();
    LinkRef::new(LinkId::next(), mailbox, state)
}

/// Exports with one live buffer of 4 KiB of memfd host memory (nothing in `/dev/shm`).
fn exports_with_a_buffer() -> (Arc<Exports>, Arc<BufferCell>) {
    let host: SharedBackend =
        Arc::new(HostBackend::with_flavor(HostFlavor::Memfd, "exports-unit").unwrap());
    let exports = Exports::new(Session::generate().unwrap(), Offload::for_backends([&host]));
    let alloc = host.allocate(4096).unwrap();
    let cell = exports.insert(
        alloc,
        Arc::clone(&host),
        Layout::new(DType::U8, Shape::vector(4096)),
        crate::ids::next_actor(),
        RevokePolicy::Cut,
    );
    (exports, cell)
}

fn assert_link_closed(
    got: Result<(Offer, Option<OwnedFd>, OfferGrant), ActorError>,
    peer: ProcessId,
) {
    match got {
        Err(ActorError::LinkClosed { peer: p }) => assert_eq!(p, peer),
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
    let (offer, _fd, grant) = exports.grant(&cell, &link, 0, None, false).unwrap();
    exports.ungrant(offer.lease, grant, link.id);

    // The death watch saw the peer die; its link actor has not stopped yet.
    exports.process_dead(peer);
    assert_link_closed(exports.grant(&cell, &link, 0, None, false), peer);
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
    assert_link_closed(exports.grant(&cell, &link, 0, None, false), peer);
    assert_eq!(exports.leases_on(cell.id), 0);
}
