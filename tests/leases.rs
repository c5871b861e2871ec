//! Memory is never freed while a live process may map it — the lease guarantees in the
//! GPU's terms, proven on host memory across real processes:
//!
//! - a stubborn *live* holder (SIGSTOPped past a revoke deadline) is cut and its socket
//!   shut down; where a free would be unsafe while it maps the memory (the legacy-like rule
//!   of CUDA IPC, declared by a test backend) the memory stays quarantined until it dies,
//!   and it reads its own data or an orphaned error meanwhile; with host rules the memory
//!   goes at the cut;
//! - warm mappings: the same buffer handed over a thousand times is opened once, and its
//!   free waits for every importer's `Unmapped` (or its death);
//! - the heartbeat cuts a stopped peer.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;
#[path = "support/stubborn.rs"]
mod stubborn;

use actix::prelude::*;
use actors::{DEADLINE, LegacyLike, Parent, eventually, eventually_async, exited};
use baton::actors::{Buffer, PeerEvent};
use baton::ipc::{HostBackend, WarmBudget};
use msgs::*;
use rustix::process::Signal;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use stubborn::{signal, stubborn_live_holder};

fn run<F: Future<Output = ()>>(f: F) {
    System::new().block_on(f);
}

#[test]
fn a_stubborn_live_holder_of_legacy_like_memory_is_cut_and_the_memory_quarantined_until_it_dies() {
    run(async {
        let ns = peer::namespace("quar");
        let backend = Arc::new(LegacyLike(HostBackend::with_namespace(&ns).unwrap()));
        let mut parent = Parent::start_with(&ns, backend);
        parent
            .child_env
            .push(("BATON_BACKEND".into(), "host".into()));
        stubborn_live_holder(&parent, true, 4096, &|| None).await;
        assert_eq!(parent.segments(), 0, "nothing left after the holder died");
    });
}

#[test]
fn a_stubborn_live_holder_of_host_memory_is_cut_and_the_memory_freed_at_the_cut() {
    run(async {
        let parent = Parent::start("cutfree");
        stubborn_live_holder(&parent, false, 4096, &|| None).await;
        assert_eq!(parent.segments(), 0);
    });
}

/// An importer SIGKILLed while it holds legacy-like memory: its link ends, and its death —
/// seen through its pidfd, before or after the end of stream — frees the memory.
#[test]
fn a_killed_holder_of_legacy_like_memory_frees_it() {
    run(async {
        let ns = peer::namespace("killq");
        let backend = Arc::new(LegacyLike(HostBackend::with_namespace(&ns).unwrap()));
        let mut parent = Parent::start_with(&ns, backend);
        parent
            .child_env
            .push(("BATON_BACKEND".into(), "host".into()));
        for round in 0..5 {
            let (mut child, link) = parent.child(&["stubborn"]).await;
            let buf = parent.pattern_buffer(1024, round).await;
            let id = buf.id();
            link.remote::<Hold>("holder")
                .send(Hold {
                    buffers: vec![buf.share()],
                })
                .await
                .unwrap();
            drop(buf);
            assert!(parent.table().await.iter().any(|b| b.buffer == id));
            child.kill9();
            eventually_async(DEADLINE, "the dead holder's memory freed", || async {
                parent.table().await.iter().all(|b| b.buffer != id)
            })
            .await;
            assert_eq!(parent.stats().await.quarantined, 0);
        }
        assert_eq!(parent.segments(), 0);
    });
}

/// A buffer reused for every message is a warm mapping in the importer: one open.
#[test]
fn the_same_buffer_handed_to_the_same_importer_a_thousand_times_is_opened_once() {
    run(async {
        let parent = Parent::start("warm");
        let (mut child, link) = parent.child(&[]).await;
        let cache = parent.node.cache();
        let before = cache.stats();
        let lender = link.remote::<Lend>("lender");
        for round in 0..1000u32 {
            let made = lender
                .send(Lend {
                    index: 0,
                    len: 256,
                    seed: 4,
                })
                .await
                .unwrap();
            let lease = made.buffers.into_iter().next().unwrap().open().unwrap();
            if round % 250 == 0 {
                let got = lease.to_vec().unwrap();
                assert!(got.iter().enumerate().all(|(i, &v)| v == pattern(4, i)));
            }
        }
        let after = cache.stats();
        assert_eq!(after.opens - before.opens, 1, "{after:?}");
        assert_eq!(after.hits - before.hits, 999, "{after:?}");
        assert_eq!((after.live, after.warm), (1, 1), "kept warm between leases");
        link.close();
        assert!(exited(&mut child, DEADLINE).await.success());
        eventually(DEADLINE, "the mapping closed with its link", || {
            cache.stats().live == 0
        })
        .await;
    });
}

/// Past its warm budget, an importer asks the exporter to let it drop its least recently
/// used idle mapping (`Evict`); the exporter answers `Unmap`, the importer closes it and
/// answers `Unmapped`. An evicted buffer offered again is simply mapped again.
#[test]
fn past_the_warm_budget_the_importer_evicts_through_the_exporter() {
    run(async {
        let ns = peer::namespace("evict");
        let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
        let mut parent = Parent::start_configured(&ns, backend, |c| {
            c.warm(WarmBudget {
                max_entries: 1,
                max_bytes: 1 << 30,
            })
        });
        parent
            .child_env
            .push(("BATON_BACKEND".into(), "host".into()));
        let (mut child, link) = parent.child(&[]).await;
        let cache = parent.node.cache();
        let lender = link.remote::<Lend>("lender");
        let lend = |index| {
            lender.send(Lend {
                index,
                len: 128,
                seed: index,
            })
        };
        for index in 0..3 {
            let lease = lend(index).await.unwrap().buffers.remove(0).open().unwrap();
            assert_eq!(lease.to_vec().unwrap()[1], pattern(index, 1));
        }
        eventually(
            DEADLINE,
            "two mappings evicted through the exporter",
            || {
                let s = cache.stats();
                (s.live, s.warm, s.evictions, s.closes) == (1, 1, 2, 2)
            },
        )
        .await;
        assert_eq!(cache.stats().opens, 3);
        // The first buffer again: mapped anew.
        let lease = lend(0).await.unwrap().buffers.remove(0).open().unwrap();
        assert_eq!(lease.to_vec().unwrap()[5], pattern(0, 5));
        assert_eq!(cache.stats().opens, 4);
        drop(lease);
        link.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// `AnyLease::release_synchronized` on host memory (no device context to synchronise)
/// gives every lease back as dropping them would, both ways the holder can let go.
#[test]
fn leases_released_synchronized_on_host_memory_go_back() {
    run(async {
        let parent = Parent::start("relsync");
        let (mut child, link) = parent.child(&[]).await;
        let mut bufs = Vec::new();
        for seed in 0..3 {
            bufs.push(parent.pattern_buffer(256, seed).await);
        }
        for synchronized in [true, false, true] {
            let n = link
                .remote::<UseAndRelease>("holder.use")
                .send(UseAndRelease {
                    buffers: bufs.iter().map(Buffer::share).collect(),
                    synchronized,
                })
                .await
                .unwrap();
            assert_eq!(n, 3);
            for b in &bufs {
                tokio::time::timeout(DEADLINE, b.returned())
                    .await
                    .expect("every lease back");
            }
        }
        link.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// Two importers keep the buffer mapped after their leases went back: its free waits for
/// both `Unmapped` answers — and a stopped importer's death ends the wait too.
#[test]
fn a_free_waits_for_every_warm_mapping_or_its_holders_death() {
    run(async {
        let parent = Parent::start("unmap");
        let (mut a, link_a) = parent.child(&[]).await;
        let (mut b, link_b) = parent.child(&[]).await;
        let buf = parent.pattern_buffer(1024, 2).await;
        let id = buf.id();
        for link in [&link_a, &link_b] {
            let held = link
                .remote::<Hold>("holder")
                .send(Hold {
                    buffers: vec![buf.share()],
                })
                .await
                .unwrap();
            assert_eq!(held, 1);
            let dropped = link.remote::<DropHeld>("holder.drop").send(DropHeld).await;
            assert_eq!(dropped.unwrap(), 1);
        }
        // The leases are back; both importers still map it (warm).
        let row = parent
            .table()
            .await
            .into_iter()
            .find(|r| r.buffer == id)
            .unwrap();
        assert!(row.leases.is_empty());
        let mut pids: Vec<u32> = row.mapped_by.iter().map(|p| p.pid).collect();
        pids.sort();
        let mut want = vec![a.pid(), b.pid()];
        want.sort();
        assert_eq!(pids, want, "both importers hold a warm mapping");

        // B cannot answer; A can. Dropping the buffer asks both to unmap.
        signal(&b, Signal::STOP);
        let freed_before = parent.stats().await.freed;
        drop(buf);
        eventually_async(DEADLINE, "A's Unmapped", || async {
            parent
                .table()
                .await
                .iter()
                .any(|r| r.buffer == id && r.mapped_by.iter().map(|p| p.pid).eq([b.pid()]))
        })
        .await;
        // Not freed while B (alive, stopped) may map it — well past A's answer.
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let row = parent.table().await;
            assert!(
                row.iter().any(|r| r.buffer == id && r.retiring),
                "freed while a live importer maps it: {row:?}"
            );
        }
        assert_eq!(parent.stats().await.freed, freed_before);
        assert_eq!(parent.segments(), 1);

        // B dies instead of answering: the wait ends.
        b.kill9();
        eventually_async(DEADLINE, "the free after B's death", || async {
            parent.table().await.iter().all(|r| r.buffer != id)
        })
        .await;
        assert_eq!(parent.stats().await.freed, freed_before + 1);
        assert_eq!(parent.segments(), 0);

        // With both answering, a free needs nothing else.
        let buf = parent.pattern_buffer(64, 3).await;
        let id = buf.id();
        link_a
            .remote::<Sum>("sink")
            .send(Sum {
                buffers: vec![buf.share()],
            })
            .await
            .unwrap();
        drop(buf);
        eventually_async(DEADLINE, "the free after A's Unmapped", || async {
            parent.table().await.iter().all(|r| r.buffer != id)
        })
        .await;
        link_a.close();
        assert!(exited(&mut a, DEADLINE).await.success());
    });
}

/// A stopped peer answers no ping: its link is cut as unresponsive within the deadline.
#[test]
fn a_stopped_peer_is_declared_unresponsive_and_cut() {
    run(async {
        let parent = Parent::start_beating("beat");
        let (mut child, link) = parent.child(&[]).await;
        let rtt = link.ping().await.expect("a live peer answers");
        assert!(rtt > Duration::ZERO);
        eventually(DEADLINE, "a heartbeat round trip", || {
            link.round_trip().is_some()
        })
        .await;

        signal(&child, Signal::STOP);
        eventually(DEADLINE, "the stopped peer cut", || {
            parent.events.down_reason(link.link_id()).is_some()
        })
        .await;
        let reason = parent.events.down_reason(link.link_id()).unwrap().unwrap();
        assert!(reason.contains("Unresponsive"), "{reason}");
        assert!(!link.is_connected());
        assert!(matches!(
            parent.events.all().last(),
            Some(PeerEvent::Down { .. })
        ));
        signal(&child, Signal::CONT);
        // Awake, it finds its link shut down and exits.
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// A peer whose socket outlives it — a subprocess it started inherited the descriptor —
/// sends no end of stream when it dies: its death, seen through its pidfd, ends the link as
/// `PeerExited` (not the heartbeat's silence, seconds later).
#[test]
fn a_peer_whose_socket_outlives_it_is_cut_when_it_dies() {
    run(async {
        let parent = Parent::start("outlive");
        let sock = parent.socket();
        let (mut child, link) = parent
            .spawn_linked(peer::exe("baton-test-peer"), &["inherit-hold", &sock], true)
            .await;
        let lines = actors::Lines::of(child.take_stdout().expect("piped"));
        let line = lines.next_line(DEADLINE).await;
        let holder: i32 = line
            .strip_prefix("holder ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("unexpected line {line:?}"));
        let holder = rustix::process::Pid::from_raw(holder).expect("a pid");
        child.kill9();
        eventually(DEADLINE, "the link cut for the death", || {
            parent.events.down_reason(link.link_id()).is_some()
        })
        .await;
        let reason = parent.events.down_reason(link.link_id()).unwrap();
        let _ = rustix::process::kill_process(holder, Signal::KILL);
        assert!(
            reason.as_deref().is_some_and(|r| r.contains("PeerExited")),
            "{reason:?}"
        );
    });
}
