//! Issue test 8: bad input from a peer at the protocol level. Each misbehaving link gets a
//! typed error and is dropped; an honest peer connected all along, and the owner's lease
//! table, are unharmed.
//!
//! The misbehaving peers are raw, authenticated links (`baton::ipc::Link`) driven from
//! blocking tasks: they pass the handshake and then break the lease protocol.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, Parent, eventually, eventually_async, exited, run};
use baton::actors::{Allocate, Buffer, LinkId};
use baton::ipc::Error;
use baton::ipc::{Backend, HostBackend, Link};
use baton::messages::protocol::{Offer, Payload, Release, Reply};
use baton::messages::{LeaseId, Message as Wire};
use msgs::*;
use tokio::task::spawn_blocking;

/// A raw link, connected and authenticated, and the id the parent gave it.
async fn raw(parent: &Parent) -> (Link, LinkId) {
    let (link, peer) = parent.raw_link().await;
    (link, peer.link_id())
}

/// The next frame that is not a heartbeat (the parent's links ping every second).
fn recv_skipping_pings(link: &mut Link) -> baton::ipc::Result<baton::ipc::Received> {
    loop {
        let received = link.recv_timeout(DEADLINE)?;
        if !matches!(received.message, Wire::Ping(_)) {
            return Ok(received);
        }
    }
}

/// Sends `msg` on a raw link, then waits (blocking task) for the parent to drop it.
async fn send_and_expect_drop(mut link: Link, msg: Wire) {
    spawn_blocking(move || {
        link.send(&msg, &[]).unwrap();
        let got = recv_skipping_pings(&mut link);
        assert!(
            matches!(got, Err(Error::Closed)),
            "the parent dropped the link: {got:?}"
        );
    })
    .await
    .unwrap();
}

async fn dropped_because(parent: &Parent, link: LinkId, needle: &str) {
    eventually(DEADLINE, "the bad link to be dropped", || {
        parent.events.down_reason(link).is_some()
    })
    .await;
    let reason = parent.events.down_reason(link).unwrap().unwrap_or_default();
    assert!(
        reason.contains(needle),
        "dropped for {reason:?}, expected {needle}"
    );
}

#[test]
fn protocol_abuse_drops_only_the_abusive_link() {
    run(async {
        let parent = Parent::start("abuse");
        let (mut honest, honest_peer) = parent.child(&[]).await;

        // A raw peer that holds a lease honestly (it answers the Hold call).
        let buf: Buffer<u32> = parent
            .owner
            .send(Allocate::vector(64))
            .await
            .unwrap()
            .unwrap();
        let (holder, holder_id) = raw(&parent).await;
        let holder_peer = parent
            .node
            .peers()
            .into_iter()
            .find(|p| p.link_id() == holder_id)
            .unwrap();
        let call = holder_peer.remote::<Hold>("holder").send(Hold {
            buffers: vec![buf.share()],
        });
        let (mut holder, lease) = spawn_blocking(move || {
            let mut holder = holder;
            let received = recv_skipping_pings(&mut holder).unwrap();
            let Wire::Call(call) = received.message else {
                panic!("expected a call")
            };
            let lease = call.offers[0].lease;
            let bytes = bincode::serde::encode_to_vec(1usize, bincode::config::standard()).unwrap();
            let reply = Reply {
                id: call.id,
                outcome: Ok(Payload {
                    bytes,
                    offers: vec![],
                }),
            };
            holder.send(&Wire::Reply(reply), &[]).unwrap();
            (holder, lease)
        })
        .await
        .unwrap();
        assert_eq!(call.await.unwrap(), 1);
        assert_eq!(parent.table().await[0].leases.len(), 1);

        // 1. A release of a lease nobody was ever granted.
        let (link, id) = raw(&parent).await;
        send_and_expect_drop(
            link,
            Wire::Release(Release::now(LeaseId::new(u64::MAX - 1))),
        )
        .await;
        dropped_because(&parent, id, "UnknownLease").await;

        // 2. A release of someone else's lease: refused, and the holder keeps it.
        let (link, id) = raw(&parent).await;
        send_and_expect_drop(link, Wire::Release(Release::now(lease))).await;
        dropped_because(&parent, id, "UnknownLease").await;
        assert_eq!(
            parent.table().await[0].leases.len(),
            1,
            "the real holder's lease stands"
        );

        // 3. A lease id replay: the holder releases honestly, then again.
        holder = spawn_blocking(move || {
            holder
                .send(&Wire::Release(Release::now(lease)), &[])
                .unwrap();
            holder
        })
        .await
        .unwrap();
        eventually_async(DEADLINE, "the honest release", || async {
            parent.table().await[0].leases.is_empty()
        })
        .await;
        send_and_expect_drop(holder, Wire::Release(Release::now(lease))).await;
        dropped_because(&parent, holder_id, "UnknownLease").await;

        // 4. An offer for an allocation that does not exist.
        let (link, id) = raw(&parent).await;
        let backend = HostBackend::with_namespace(&parent.ns).unwrap();
        let ghost = backend.allocate(4096).unwrap();
        let handle = ghost.handle(&parent.session).build().unwrap();
        drop(ghost);
        send_and_expect_drop(
            link,
            Wire::Offer(Box::new(Offer {
                lease: LeaseId::new(1),
                handle,
            })),
        )
        .await;
        dropped_because(&parent, id, "SegmentNotFound").await;

        // 5. An offer of a buffer the peer does not own (another process's identity).
        let (link, id) = raw(&parent).await;
        let real = backend.allocate(4096).unwrap();
        let mut handle = real.handle(&parent.session).build().unwrap();
        handle.exporter.process.pid = 1;
        let handle = handle.sealed(parent.session.handle_key());
        send_and_expect_drop(
            link,
            Wire::Offer(Box::new(Offer {
                lease: LeaseId::new(2),
                handle,
            })),
        )
        .await;
        dropped_because(&parent, id, "ForeignOffer").await;
        drop(real);

        // 6. A corrupted handle (one byte flipped after sealing).
        let (link, id) = raw(&parent).await;
        let real = backend.allocate(4096).unwrap();
        let mut handle = real.handle(&parent.session).build().unwrap();
        handle.len -= 1;
        send_and_expect_drop(
            link,
            Wire::Offer(Box::new(Offer {
                lease: LeaseId::new(3),
                handle,
            })),
        )
        .await;
        dropped_because(&parent, id, "DigestMismatch").await;
        drop(real);

        // Everyone else is fine: the honest peer never lost its link and still works.
        assert!(honest_peer.is_connected());
        assert!(parent.events.down_reason(honest_peer.link_id()).is_none());
        let a: Buffer<u32> = parent
            .owner
            .send(Allocate::vector(1024))
            .await
            .unwrap()
            .unwrap();
        a.write_at(0, &(0..1024).map(|i| pattern(4, i)).collect::<Vec<_>>())
            .unwrap();
        let b: Buffer<f32> = parent
            .owner
            .send(Allocate::vector(1024))
            .await
            .unwrap()
            .unwrap();
        b.write_at(0, &(0..1024).map(|i| i as f32 * 0.5).collect::<Vec<_>>())
            .unwrap();
        let reply = honest_peer
            .remote::<CheckPair>("checker")
            .send(CheckPair {
                seed: 4,
                a: a.share(),
                b: b.share(),
            })
            .await
            .unwrap();
        assert!(reply.ok);
        drop(reply);
        drop((a, b, buf));
        eventually_async(DEADLINE, "every buffer freed", || async {
            parent.stats().await.buffers == 0
        })
        .await;
        // The checker's reply buffer is freed by the child once our release reaches it.
        eventually(DEADLINE, "no segment left", || parent.segments() == 0).await;
        honest_peer.close();
        assert!(exited(&mut honest, DEADLINE).await.success());
    });
}

/// Records what the node's inbox receives: the layout of each bare offer.
struct Inbox(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Actor for Inbox {
    type Context = Context<Self>;
}

impl Handler<baton::actors::Offered> for Inbox {
    type Result = ();
    fn handle(&mut self, msg: baton::actors::Offered, _: &mut Context<Self>) {
        let layout = format!("{:?}", msg.buffer.layout());
        let lease = msg.buffer.open().unwrap();
        assert_eq!(lease.len(), 4096);
        self.0.lock().unwrap().push(layout);
    }
}

#[test]
fn a_bare_offer_without_element_type_is_released_not_delivered() {
    run(async {
        let parent = Parent::start("bare");
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        parent
            .node
            .set_inbox(Inbox(std::sync::Arc::clone(&got)).start().recipient());
        let (link, id) = raw(&parent).await;
        let backend = HostBackend::with_namespace(&parent.ns).unwrap();
        let alloc = backend.allocate(4096).unwrap();
        let untyped = alloc.handle(&parent.session).build().unwrap();
        let typed = alloc
            .handle(&parent.session)
            .layout(baton::messages::Layout::new(
                baton::messages::DType::U8,
                baton::messages::Shape::vector(4096),
            ))
            .build()
            .unwrap();
        let link = spawn_blocking(move || {
            let mut link = link;
            // Untyped: the actor layer deals in typed buffers only; it gives it back.
            let offer = Wire::Offer(Box::new(Offer {
                lease: LeaseId::new(1),
                handle: untyped,
            }));
            link.send(&offer, &[]).unwrap();
            let back = recv_skipping_pings(&mut link).unwrap().message;
            assert_eq!(back, Wire::Release(Release::now(LeaseId::new(1))));
            // Typed: delivered to the inbox.
            let offer = Wire::Offer(Box::new(Offer {
                lease: LeaseId::new(2),
                handle: typed,
            }));
            link.send(&offer, &[]).unwrap();
            link
        })
        .await
        .unwrap();
        eventually(DEADLINE, "the typed offer in the inbox", || {
            got.lock().unwrap().len() == 1
        })
        .await;
        assert!(got.lock().unwrap()[0].contains("U8"));
        assert!(parent.events.down_reason(id).is_none(), "the link stays up");
        drop(link);
        drop(alloc);
    });
}

/// Keeps every bare offer it is given, unopened (each a lease held).
struct Hoarder(std::sync::Arc<std::sync::Mutex<Vec<baton::actors::Shared<u8>>>>);

impl Actor for Hoarder {
    type Context = Context<Self>;
}

impl Handler<baton::actors::Offered> for Hoarder {
    type Result = ();
    fn handle(&mut self, msg: baton::actors::Offered, _: &mut Context<Self>) {
        self.0.lock().unwrap().push(msg.buffer);
    }
}

/// The bounds a peer's offers meet are exact, and a lease id is offered once: a call with
/// exactly `offers_per_message` offers is no fault (it is answered); holding exactly
/// `leases_held` leases is no fault, one more is `TooManyLeases`; a lease offered twice in
/// one call, or offered again while held, is `DuplicateLease` — each fault drops only its
/// link.
#[test]
fn the_offer_and_lease_bounds_are_exact_and_a_lease_is_offered_once() {
    use baton::actors::LinkLimits;
    use baton::messages::protocol::Call;
    use baton::messages::{DType, Layout, Shape};
    run(async {
        let ns = peer::namespace("exact");
        let backend: baton::ipc::SharedBackend =
            std::sync::Arc::new(HostBackend::with_namespace(&ns).unwrap());
        let limits = LinkLimits {
            offers_per_message: 3,
            leases_held: 5,
            ..LinkLimits::default()
        };
        let parent = Parent::start_configured(&ns, backend, |c| c.limits(limits));
        let kept = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        parent
            .node
            .set_inbox(Hoarder(std::sync::Arc::clone(&kept)).start().recipient());
        let exporter = HostBackend::with_namespace(&parent.ns).unwrap();
        let mem = exporter.allocate(4096).unwrap();
        let handle = mem
            .handle(&parent.session)
            .layout(Layout::new(DType::U8, Shape::vector(4096)))
            .build()
            .unwrap();
        let offer = {
            let handle = handle.clone();
            move |lease: u64| Offer {
                lease: LeaseId::new(lease),
                handle: handle.clone(),
            }
        };
        let call = |offers: Vec<Offer>| {
            Wire::Call(Call {
                id: 1,
                target: "nobody".into(),
                type_name: "test.Nothing".into(),
                payload: Vec::new(),
                offers,
            })
        };

        // Exactly offers_per_message offers: checked, opened, and answered (no such actor).
        let (mut link, id) = raw(&parent).await;
        let msg = call((10..13).map(&offer).collect());
        link = spawn_blocking(move || {
            link.send(&msg, &[]).unwrap();
            let got = recv_skipping_pings(&mut link).unwrap();
            assert!(matches!(got.message, Wire::Reply(_)), "{:?}", got.message);
            link
        })
        .await
        .unwrap();
        assert!(parent.events.down_reason(id).is_none());
        drop(link);

        // The same lease twice in one call.
        let (link, id) = raw(&parent).await;
        send_and_expect_drop(link, call(vec![offer(20), offer(21), offer(20)])).await;
        dropped_because(&parent, id, "DuplicateLease").await;

        // Exactly leases_held bare offers are held; a lease offered again while held is a
        // duplicate; one lease more than the bound is too many.
        let (mut link, id) = raw(&parent).await;
        let offers = offer.clone();
        link = spawn_blocking(move || {
            for lease in 30..35 {
                let offer = &offers;
                link.send(&Wire::Offer(Box::new(offer(lease))), &[])
                    .unwrap();
            }
            link
        })
        .await
        .unwrap();
        eventually(DEADLINE, "five leases held", || {
            kept.lock().unwrap().len() == 5
        })
        .await;
        assert!(
            parent.events.down_reason(id).is_none(),
            "at the bound is no fault"
        );
        send_and_expect_drop(link, Wire::Offer(Box::new(offer(31)))).await;
        dropped_because(&parent, id, "DuplicateLease").await;

        kept.lock().unwrap().clear();
        let (mut link, id) = raw(&parent).await;
        let offers = offer.clone();
        link = spawn_blocking(move || {
            for lease in 40..45 {
                let offer = &offers;
                link.send(&Wire::Offer(Box::new(offer(lease))), &[])
                    .unwrap();
            }
            link
        })
        .await
        .unwrap();
        eventually(DEADLINE, "five more leases held", || {
            kept.lock().unwrap().len() == 5
        })
        .await;
        assert!(parent.events.down_reason(id).is_none());
        send_and_expect_drop(link, Wire::Offer(Box::new(offer(45)))).await;
        dropped_because(&parent, id, "TooManyLeases").await;
        drop(mem);
    });
}

/// A reply that comes after its call timed out is held to the offer bound too, exactly:
/// with `offers_per_message` offers its leases are given back (a `Release` each) and the
/// link stays up; with one more it is `TooManyOffers`, and only that link drops.
#[test]
fn a_late_replys_offers_meet_the_offer_bound_exactly() {
    use baton::actors::LinkLimits;
    use baton::messages::{DType, Layout, Shape};
    use std::time::Duration;
    run(async {
        let ns = peer::namespace("late-bound");
        let backend: baton::ipc::SharedBackend =
            std::sync::Arc::new(HostBackend::with_namespace(&ns).unwrap());
        let limits = LinkLimits {
            offers_per_message: 3,
            ..LinkLimits::default()
        };
        let parent = Parent::start_configured(&ns, backend, |c| c.limits(limits));
        let exporter = HostBackend::with_namespace(&parent.ns).unwrap();
        let mem = exporter.allocate(4096).unwrap();
        let handle = mem
            .handle(&parent.session)
            .layout(Layout::new(DType::U32, Shape::vector(1024)))
            .build()
            .unwrap();
        for (offers, cut) in [(3_u64, false), (4, true)] {
            let (mut link, peer) = parent.raw_link().await;
            let id = peer.link_id();
            // Our call to the raw peer, which it answers only after the caller gave up.
            let call = peer
                .remote::<Hold>("holder")
                .send_timeout(Hold { buffers: vec![] }, Duration::from_millis(50));
            let asked = spawn_blocking(move || {
                let got = recv_skipping_pings(&mut link).unwrap();
                let Wire::Call(call) = got.message else {
                    panic!("expected our call, got {:?}", got.message)
                };
                (link, call.id)
            });
            assert!(matches!(call.await, Err(baton::ActorError::Timeout { .. })));
            let (link, call_id) = asked.await.unwrap();
            let handle = handle.clone();
            let released = spawn_blocking(move || {
                let mut link = link;
                let reply = Wire::Reply(Reply {
                    id: call_id,
                    outcome: Ok(Payload {
                        bytes: Vec::new(),
                        offers: (0..offers)
                            .map(|n| Offer {
                                lease: LeaseId::new(100 + n),
                                handle: handle.clone(),
                            })
                            .collect(),
                    }),
                });
                link.send(&reply, &[]).unwrap();
                // Until the link drops (cut), or every lease came back.
                let mut released = Vec::new();
                while cut || released.len() < offers as usize {
                    let Ok(got) = link.recv_timeout(DEADLINE) else {
                        break;
                    };
                    if let Wire::Release(r) = got.message {
                        released.push(r.lease.get());
                    }
                }
                (link, released)
            });
            if cut {
                eventually(DEADLINE, "the late reply's link dropped", || {
                    parent.events.down_reason(id).is_some()
                })
                .await;
                let why = parent.events.down_reason(id).unwrap().unwrap_or_default();
                assert!(why.contains("TooManyOffers"), "{why}");
                assert!(released.await.unwrap().1.is_empty(), "nothing was taken");
            } else {
                // The link is kept (dropping it would end it) until the checks are done.
                let (_link, mut released) = released.await.unwrap();
                released.sort_unstable();
                assert_eq!(released, [100, 101, 102], "each lease given back");
                assert!(
                    parent.events.down_reason(id).is_none(),
                    "a late reply within the bound is no fault: {:?}",
                    parent.events.down_reason(id)
                );
                assert!(peer.is_connected());
            }
        }
    });
}

/// Status answers: each request has its own id; an answer still awaited is delivered
/// though other requests were made and given up meanwhile; one that comes after its asker
/// gave up (a timeout) is no fault, whether or not a later request already forgot its
/// asker — the link carries on; one to a request never made is `Unexpected`, and drops
/// only its link.
#[test]
fn late_status_answers_are_no_fault_and_an_unasked_one_is_unexpected() {
    use baton::messages::protocol::Status;
    use baton::messages::status::STATUS_VERSION;
    use std::time::Duration;
    run(async {
        let parent = Parent::start("status-answers");
        let (link, peer) = parent.raw_link().await;
        let id = peer.link_id();
        let mut link = Some(link);
        let mut next_request = async || {
            let mut l = link.take().unwrap();
            let (l, asked) = spawn_blocking(move || {
                let got = recv_skipping_pings(&mut l).unwrap();
                let Wire::StatusRequest(request) = got.message else {
                    panic!("expected a status request, got {:?}", got.message)
                };
                (l, request.id)
            })
            .await
            .unwrap();
            link = Some(l);
            asked
        };
        // One asker waits on; two more give up (each request forgets askers that gave up).
        let waiting = actix::spawn(peer.status(4, DEADLINE));
        let a = next_request().await;
        for _ in 0..2 {
            assert!(peer.status(4, Duration::from_millis(50)).await.is_err());
        }
        let b = next_request().await;
        let c = next_request().await;
        assert!(a < b && b < c, "each request its own id: {a}, {b}, {c}");
        let mut link = link.take().unwrap();
        let json = parent.node.status(4).to_json().unwrap();
        let answer = move |id: u64| {
            Wire::Status(Status {
                id,
                version: STATUS_VERSION,
                json: json.clone(),
            })
        };
        // Late answers (b's asker forgotten, c's not yet), then the one still awaited, then
        // a call: its answer (frames are handled in order) shows the link carried on.
        let call = Wire::Call(baton::messages::protocol::Call {
            id: 1,
            target: "nobody".into(),
            type_name: "test.Nothing".into(),
            payload: Vec::new(),
            offers: Vec::new(),
        });
        let unasked = answer(c + 1);
        let frames = [answer(b), answer(c), answer(a), call];
        let link = spawn_blocking(move || {
            for frame in &frames {
                link.send(frame, &[]).unwrap();
            }
            let got = recv_skipping_pings(&mut link).unwrap();
            assert!(matches!(got.message, Wire::Reply(_)), "{:?}", got.message);
            link
        })
        .await
        .unwrap();
        assert!(
            parent.events.down_reason(id).is_none(),
            "late answers are no fault"
        );
        waiting
            .await
            .unwrap()
            .expect("the answer still awaited is delivered");
        // An answer to a request never made.
        send_and_expect_drop(link, unasked).await;
        dropped_because(&parent, id, "Unexpected").await;
    });
}
