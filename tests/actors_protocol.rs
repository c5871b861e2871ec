//! The actor protocol across processes, on the host backend: typed buffer messages, the
//! lease table, deferred frees, revokes, importer death, scale.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actors::{DEADLINE, Parent, eventually, eventually_async, exited, run};
use baton::actors::{ActorError, Allocate, Buffer, LinkEnd, Revoke};
use msgs::*;
use std::time::Duration;

async fn pattern_buffer(parent: &Parent, len: usize, seed: u32) -> Buffer<u32> {
    parent.pattern_buffer(len, seed).await
}

/// Issue test 1: a typed message with two buffers goes to another process and back.
#[test]
fn a_typed_message_with_two_buffers_goes_to_another_process_and_back() {
    run(async {
        let parent = Parent::start("pair");
        let (mut child, peer) = parent.child(&[]).await;
        const N: usize = 1 << 18;
        let a = pattern_buffer(&parent, N, 7).await;
        let b: Buffer<f32> = parent
            .owner
            .send(Allocate::vector(N as u64))
            .await
            .unwrap()
            .unwrap();
        let halves: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
        b.write_at(0, &halves).unwrap();

        let checker = peer.remote::<CheckPair>("checker");
        let reply = checker
            .send(CheckPair {
                seed: 7,
                a: a.share(),
                b: b.share(),
            })
            .await
            .unwrap_or_else(|e| panic!("{e}; link events: {:?}", parent.events.all()));
        assert!(reply.ok, "the child saw exactly the bytes we wrote");
        let sum = reply.sum.open().unwrap();
        assert_eq!(
            sum.exporter().process.pid,
            child.pid(),
            "the reply buffer is the child's"
        );
        assert_eq!(
            sum.path(),
            baton::actors::LeasePath::HostSegment,
            "mapped from the child's named segment (the tests' helpers allocate named ones)"
        );
        let got = sum.to_vec().unwrap();
        for (i, v) in got.iter().enumerate() {
            assert_eq!(*v, pattern(7, i) as f32 + i as f32 * 0.5, "element {i}");
        }
        drop(sum);
        // The child dropped its leases on a and b after answering.
        eventually_async(DEADLINE, "leases on a and b returned", || async {
            parent.table().await.iter().all(|b| b.leases.is_empty())
        })
        .await;
        drop((a, b));
        // Ours go at once; the child's `sum` goes when our release reaches it.
        eventually(DEADLINE, "no segment left", || parent.segments() == 0).await;
        peer.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// Issue test 2: dropping a lease shows up in the owner's lease table.
#[test]
fn dropping_a_lease_shows_up_in_the_owners_lease_table() {
    run(async {
        let parent = Parent::start("table");
        let (mut child, peer) = parent.child(&[]).await;
        let buf = pattern_buffer(&parent, 1024, 1).await;
        let held = peer
            .remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![buf.share(), buf.share()],
            })
            .await
            .unwrap();
        assert_eq!(held, 2);
        let table = parent.table().await;
        assert_eq!(table.len(), 1);
        assert_eq!(table[0].leases.len(), 2);
        assert!(
            table[0].leases.iter().all(|(_, p)| p.pid == child.pid()),
            "held by the child"
        );

        assert_eq!(
            peer.remote::<DropHeld>("holder.drop")
                .send(DropHeld)
                .await
                .unwrap(),
            2
        );
        eventually_async(DEADLINE, "the lease table to empty", || async {
            parent.table().await[0].leases.is_empty()
        })
        .await;
        peer.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// Issue test 3: freeing while an importer holds defers the free until its release.
#[test]
fn a_free_while_leased_is_deferred_until_the_release() {
    run(async {
        let parent = Parent::start("defer");
        let (mut child, peer) = parent.child(&[]).await;
        let buf = pattern_buffer(&parent, 4096, 99).await;
        peer.remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![buf.share()],
            })
            .await
            .unwrap();
        drop(buf); // the exporter frees: its last handle goes
        let stats = parent.stats().await;
        assert_eq!(
            (stats.buffers, stats.retiring, stats.leases),
            (1, 1, 1),
            "retiring, not freed"
        );
        assert_eq!(parent.segments(), 1, "the memory is still there");
        let seen = peer
            .remote::<PeekHeld>("holder.peek")
            .send(PeekHeld)
            .await
            .unwrap();
        assert_eq!(
            seen,
            vec![pattern(99, 0)],
            "the importer still reads the right data"
        );

        peer.remote::<DropHeld>("holder.drop")
            .send(DropHeld)
            .await
            .unwrap();
        eventually(DEADLINE, "the segment to go after the release", || {
            parent.segments() == 0
        })
        .await;
        let stats = parent.stats().await;
        assert_eq!((stats.buffers, stats.leases, stats.freed), (0, 0, 1));
        peer.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// A lease exists from the moment its offer is sent: an importer that never reads its
/// socket (a raw link client, `baton-test-peer import-silent`) leaves our `Hold` call and
/// its offer in flight. The lease is counted, and the buffer — whose last handle we drop —
/// is held, for as long as the link is up; it is freed only when the link closes: by us
/// while the importer lives on, or by the importer's death.
#[test]
fn an_offer_in_flight_holds_the_buffer_until_the_link_closes() {
    run(async {
        let parent = Parent::start("flight");
        let sock = parent.socket();
        for closed_by_us in [true, false] {
            let (mut child, peer) = parent
                .spawn_linked(
                    peer::exe("baton-test-peer"),
                    &["import-silent", &sock],
                    false,
                )
                .await;
            let freed = parent.stats().await.freed;
            let buf = pattern_buffer(&parent, 1024, 11).await;
            // Sent now; never read, never answered.
            let call = peer.remote::<Hold>("holder").send(Hold {
                buffers: vec![buf.share()],
            });
            eventually_async(DEADLINE, "the lease of the offer in flight", || async {
                parent.table().await.iter().any(|b| b.leases.len() == 1)
            })
            .await;
            let table = parent.table().await;
            assert_eq!(table.len(), 1);
            assert_eq!(table[0].leases.len(), 1);
            assert_eq!(
                table[0].leases[0].1.pid,
                child.pid(),
                "held by the importer"
            );
            drop(buf); // our last handle: the free must wait for the lease
            let stats = parent.stats().await;
            assert_eq!(
                (stats.buffers, stats.retiring, stats.leases, stats.freed),
                (1, 1, 1, freed),
                "the buffer is held, not freed, while its offer is in flight"
            );
            assert_eq!(parent.segments(), 1, "the memory is still there");
            assert!(peer.is_connected());

            if closed_by_us {
                peer.close();
            } else {
                child.kill9();
            }
            let ended = call.await;
            assert!(
                matches!(ended, Err(ActorError::LinkClosed { .. })),
                "the call ends with the link"
            );
            // And says whether the peer died: the killed importer's call says so.
            let died = if closed_by_us {
                LinkEnd::Closed
            } else {
                LinkEnd::PeerDied
            };
            assert!(
                matches!(ended, Err(ActorError::LinkClosed { cause, .. }) if cause == died),
                "closed by us: {closed_by_us}; {ended:?}"
            );
            eventually_async(DEADLINE, "the buffer to be freed", || async {
                let s = parent.stats().await;
                s.buffers == 0 && s.leases == 0
            })
            .await;
            assert_eq!(parent.stats().await.freed, freed + 1);
            assert_eq!(parent.segments(), 0, "no segment left");
            if closed_by_us {
                assert!(
                    child.try_wait().is_none(),
                    "the importer lives on: closing the link alone freed the buffer"
                );
            }
        }
    });
}

/// A reply that comes after its caller gave up (a timeout) still carries leases: the
/// exporter granted them when it sent the reply. We give them back at once, without
/// opening them, so the exporter frees the buffers while the link stays up (a lease kept
/// until the link closes would pin them for as long as the peers live).
#[test]
fn the_leases_of_a_reply_after_its_call_timed_out_are_given_back() {
    run(async {
        let parent = Parent::start("late");
        let (mut child, peer) = parent.child(&[]).await;
        let status = || async {
            peer.status(16, DEADLINE)
                .await
                .expect("the exporter's status")
        };
        let before = status().await;
        assert_eq!((before.buffers, before.leases), (0, 0));
        let opens = parent.node.cache().stats().opens;
        let late = peer.remote::<MakeBuffersLate>("late-exporter");
        let call = late.send_timeout(
            MakeBuffersLate {
                ms: 500,
                n: 2,
                len: 1024,
                seed: 5,
            },
            Duration::from_millis(50),
        );
        assert!(
            matches!(call.await, Err(ActorError::Timeout { .. })),
            "the call times out before its reply"
        );
        // The exporter replies later, granting a lease per buffer …
        eventually_async(DEADLINE, "the late reply's leases granted", || async {
            status().await.granted >= before.granted + 2
        })
        .await;
        // … and both come back: the exporter frees the buffers, the link stays up.
        eventually_async(DEADLINE, "the late reply's leases given back", || async {
            let s = status().await;
            s.leases == 0 && s.buffers == 0 && s.freed >= before.freed + 2
        })
        .await;
        assert!(peer.is_connected(), "a late reply is no fault");
        assert_eq!(
            parent.node.cache().stats().opens,
            opens,
            "given back unopened: the call was cancelled when its caller gave up"
        );
        // The link still works.
        let made = peer
            .remote::<MakeBuffers>("exporter")
            .send(MakeBuffers {
                n: 1,
                len: 16,
                seed: 6,
            })
            .await
            .unwrap();
        assert_eq!(made.buffers.len(), 1);
        drop(made);
        peer.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// Issue test 4: a cooperative holder returns a revoked lease; a stubborn one is cut off.
#[test]
fn revoke_with_a_deadline_cuts_off_only_the_holder_that_keeps_it() {
    run(async {
        let parent = Parent::start("revoke");
        let (mut good, good_peer) = parent.child(&["cooperative"]).await;
        let (mut stubborn, stubborn_peer) = parent.child(&["stubborn"]).await;
        let buf = pattern_buffer(&parent, 1024, 3).await;
        good_peer
            .remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![buf.share()],
            })
            .await
            .unwrap();
        stubborn_peer
            .remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![buf.share()],
            })
            .await
            .unwrap();
        assert_eq!(parent.table().await[0].leases.len(), 2);

        let asked = parent
            .owner
            .send(Revoke {
                buffer: buf.id(),
                within: Duration::from_millis(400),
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(asked, 2);
        eventually_async(
            DEADLINE,
            "the cooperative holder to give it back",
            || async {
                parent.table().await[0]
                    .leases
                    .iter()
                    .all(|(_, p)| p.pid != good.pid())
            },
        )
        .await;
        eventually(DEADLINE, "the stubborn holder to be cut off", || {
            parent.events.down_reason(stubborn_peer.link_id()).is_some()
        })
        .await;
        let reason = parent
            .events
            .down_reason(stubborn_peer.link_id())
            .unwrap()
            .unwrap();
        assert!(reason.contains("RevokeDeadline"), "{reason}");
        eventually_async(DEADLINE, "every lease back", || async {
            parent.table().await[0].leases.is_empty()
        })
        .await;
        assert!(
            exited(&mut stubborn, DEADLINE).await.success(),
            "the stubborn child saw its link close and exited"
        );

        // The cooperative one is unaffected.
        assert!(good_peer.is_connected());
        let data = pattern_buffer(&parent, 16, 5).await;
        let sum = good_peer
            .remote::<Sum>("sink")
            .send(Sum {
                buffers: vec![data.share()],
            })
            .await
            .unwrap();
        assert_eq!(sum, (0..16).map(|i| u64::from(pattern(5, i))).sum::<u64>());
        good_peer.close();
        assert!(exited(&mut good, DEADLINE).await.success());
    });
}

/// Issue test 5: an importer's SIGKILL reclaims its leases and completes pending frees.
#[test]
fn importer_sigkill_reclaims_its_leases_and_pending_frees_complete() {
    run(async {
        let parent = Parent::start("ikill");
        let (mut child, peer) = parent.child(&[]).await;
        let bufs = vec![
            pattern_buffer(&parent, 1024, 1).await,
            pattern_buffer(&parent, 2048, 2).await,
            pattern_buffer(&parent, 4096, 3).await,
        ];
        let shares = bufs.iter().map(Buffer::share).collect();
        assert_eq!(
            peer.remote::<Hold>("holder")
                .send(Hold { buffers: shares })
                .await
                .unwrap(),
            3
        );
        drop(bufs);
        assert_eq!(parent.stats().await.retiring, 3, "three frees pending");
        assert_eq!(parent.segments(), 3);

        child.kill9();
        eventually(DEADLINE, "the link to go down", || {
            parent.events.down_reason(peer.link_id()).is_some()
        })
        .await;
        eventually_async(DEADLINE, "the pending frees to complete", || async {
            let s = parent.stats().await;
            s.buffers == 0 && s.leases == 0
        })
        .await;
        assert_eq!(parent.segments(), 0, "no segment left");
    });
}

/// Lines of `/proc/<pid>/maps` that map the segment whose name ends in `tag` (its random
/// part), also once unlinked.
fn mappings_of(pid: u32, tag: &str) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(tag))
        .count()
}

/// The exporter frees a buffer only once no live process may map it: when the free lands,
/// the importer that held it has unmapped it (it lives on) or is dead.
///
/// Written ahead of the ledger's mapping holds (DESIGN.md, *to build*). Today it passes
/// because dropping a lease closes the importer's mapping before its `Release` leaves. Once
/// the import cache keeps mappings warm after the last lease, it must still pass: the free
/// then has to wait for the importer's `Unmapped` (or its death), never just the `Release`.
#[test]
fn a_buffer_is_freed_only_once_no_live_process_maps_it() {
    run(async {
        let parent = Parent::start("unmap");
        let (mut child, peer) = parent.child(&[]).await;
        let buf = pattern_buffer(&parent, 4096, 21).await;
        let segments = baton::ipc::host::list_segments(&parent.ns).unwrap();
        assert_eq!(segments.len(), 1);
        let tag = segments[0].name.rsplit('.').next().unwrap().to_owned();
        peer.remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![buf.share()],
            })
            .await
            .unwrap();
        assert_eq!(mappings_of(child.pid(), &tag), 1, "the importer maps it");
        drop(buf);
        assert_eq!(parent.stats().await.freed, 0, "held by the lease");

        peer.remote::<DropHeld>("holder.drop")
            .send(DropHeld)
            .await
            .unwrap();
        eventually_async(DEADLINE, "the free", || async {
            parent.stats().await.freed == 1
        })
        .await;
        assert!(child.try_wait().is_none(), "the importer lives");
        assert_eq!(
            mappings_of(child.pid(), &tag),
            0,
            "the buffer was freed while a live importer still maps it"
        );
        assert_eq!(parent.segments(), 0);
        peer.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// Issue test 7: 1000 buffers to 4 importer processes and back, nothing left over.
#[test]
fn a_thousand_buffers_to_four_importers_and_back_leave_nothing() {
    run(async {
        let parent = Parent::start("k1000");
        let mut children = Vec::new();
        for _ in 0..4 {
            children.push(parent.child(&[]).await);
        }
        const ROUNDS: usize = 10;
        const PER_CALL: usize = 25;
        let mut expected = 0u64;
        let mut sent = 0;
        for round in 0..ROUNDS {
            let mut calls = Vec::new();
            for (c, (_, peer)) in children.iter().enumerate() {
                let mut shares = Vec::new();
                for k in 0..PER_CALL {
                    let seed = (round * 1000 + c * 100 + k) as u32;
                    let buf = pattern_buffer(&parent, 256, seed).await;
                    expected += (0..256).map(|i| u64::from(pattern(seed, i))).sum::<u64>();
                    shares.push(buf.share());
                    sent += 1;
                }
                calls.push(peer.remote::<Sum>("sink").send(Sum { buffers: shares }));
            }
            // Buffer handles went into the messages: each is freed when its lease returns.
            let sums = futures_util::future::join_all(calls).await;
            expected -= sums.into_iter().map(Result::unwrap).sum::<u64>();
        }
        assert_eq!(sent, 1000);
        assert_eq!(expected, 0, "every importer saw every byte");
        eventually_async(
            DEADLINE,
            "every lease back and every buffer freed",
            || async {
                let s = parent.stats().await;
                s.leases == 0 && s.buffers == 0
            },
        )
        .await;
        let stats = parent.stats().await;
        assert_eq!((stats.granted, stats.freed), (1000, 1000));
        assert_eq!(parent.segments(), 0, "no segment left over");
        for (mut child, peer) in children {
            peer.close();
            assert!(exited(&mut child, DEADLINE).await.success());
        }
    });
}

/// Pings are told apart: eight `Peer::ping`s at once, beside the links' own heartbeat,
/// are each answered with their own round trip; one answered late survives heartbeats.
#[test]
fn concurrent_pings_are_each_answered() {
    run(async {
        let parent = Parent::start("pings");
        let (mut child, peer) = parent.child(&[]).await;
        let pings: Vec<_> = (0..8).map(|_| actix::spawn(peer.ping())).collect();
        for ping in pings {
            let rtt = ping.await.unwrap().expect("every ping is answered");
            assert!(rtt < DEADLINE);
        }
        // A ping the peer answers late — it is stopped for a few heartbeat intervals (1 s
        // each), well within the 10 s deadline — is still waited for, not dropped with the
        // stale ones at a heartbeat.
        let pid = rustix::process::Pid::from_raw(child.pid() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
        let late = actix::spawn(peer.ping());
        tokio::time::sleep(Duration::from_millis(2500)).await;
        rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
        let rtt = late.await.unwrap().expect("the late ping is answered");
        assert!(rtt >= Duration::from_secs(2), "{rtt:?}");
        peer.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}
