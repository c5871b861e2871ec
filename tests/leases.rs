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

use actix::prelude::*;
use actors::{DEADLINE, LegacyLike, Lines, Parent, eventually, eventually_async, exited};
use baton::actors::{Heartbeat, PeerEvent, Revoke};
use baton::ipc::{HostBackend, WarmBudget};
use msgs::*;
use rustix::process::{Pid, Signal, kill_process};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

fn run<F: Future<Output = ()>>(f: F) {
    System::new().block_on(f);
}

fn signal(child: &peer::Peer, sig: Signal) {
    kill_process(Pid::from_raw(child.pid() as i32).expect("a pid"), sig).expect("signal");
}

/// The sum of a pattern buffer's values, as the holder reports it.
fn pattern_sum(seed: u32, len: usize) -> u64 {
    (0..len).map(|i| u64::from(pattern(seed, i))).sum()
}

/// A holder keeps a lease, is stopped, misses a revoke deadline and is cut. Returns what
/// the parent saw: the buffer's row of the lease table after the cut.
async fn stubborn_live_holder(parent: &Parent, legacy_like: bool) {
    const LEN: usize = 4096;
    let (mut child, link) = parent
        .spawn_linked(
            env!("CARGO_BIN_EXE_baton-actor-peer"),
            &["serve", &parent.socket(), "stubborn", "linger"],
            true,
        )
        .await;
    let lines = Lines::of(child.take_stdout().expect("piped"));
    let buf = parent.pattern_buffer(LEN, 11).await;
    let id = buf.id();
    link.remote::<Hold>("holder")
        .send(Hold {
            buffers: vec![buf.share()],
        })
        .await
        .unwrap();
    // The owner lets go of the buffer: it is freed once nobody may map it.
    drop(buf);
    let freed_before = parent.stats().await.freed;

    signal(&child, Signal::STOP);
    let asked = parent
        .owner
        .send(Revoke {
            buffer: id,
            within: Duration::from_millis(300),
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(asked, 1);
    eventually(DEADLINE, "the stopped holder to be cut off", || {
        parent.events.down_reason(link.link_id()).is_some()
    })
    .await;
    let reason = parent.events.down_reason(link.link_id()).unwrap().unwrap();
    assert!(reason.contains("RevokeDeadline"), "{reason}");

    let table = parent.table().await;
    if legacy_like {
        // The holder lives and may map the memory: quarantined, not freed.
        let row = table.iter().find(|b| b.buffer == id).expect("still there");
        assert!(row.quarantined && row.retiring, "{row:?}");
        assert!(
            row.leases.is_empty(),
            "the cut holder's lease no longer counts"
        );
        assert_eq!(row.cut_holders.len(), 1);
        assert_eq!(row.cut_holders[0].pid, child.pid());
        let stats = parent.stats().await;
        assert_eq!((stats.quarantined, stats.freed), (1, freed_before));
        assert_eq!(stats.quarantined_bytes, (LEN * 4) as u64);
        assert_eq!(parent.node.export_stats().quarantined, 1);
    } else {
        // A host mapping survives the exporter's free: freed at the cut.
        assert!(table.iter().all(|b| b.buffer != id), "{table:?}");
        assert_eq!(parent.stats().await.freed, freed_before + 1);
    }

    // Awake again, the holder finds its link closed (the socket was shut down while it
    // was stopped), and reads its lease without a crash: the lease says orphaned, the
    // mapping still holds its own data.
    signal(&child, Signal::CONT);
    let line = lines.next_line(DEADLINE).await;
    let expected = format!("api=orphaned raw={}", pattern_sum(11, LEN));
    assert!(line.ends_with(&expected), "{line:?}, not …{expected}");
    assert!(child.try_wait().is_none(), "the holder lives on");
    if legacy_like {
        let row = parent.table().await;
        assert!(
            row.iter().any(|b| b.buffer == id && b.quarantined),
            "still quarantined while the holder lives"
        );
    }

    // Its death ends the quarantine.
    child.signal_kill();
    exited(&mut child, DEADLINE).await;
    eventually_async(
        DEADLINE,
        "the buffer freed after the holder died",
        || async { parent.table().await.iter().all(|b| b.buffer != id) },
    )
    .await;
    let stats = parent.stats().await;
    assert_eq!((stats.quarantined, stats.freed), (0, freed_before + 1));
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
        stubborn_live_holder(&parent, true).await;
        assert_eq!(parent.segments(), 0, "nothing left after the holder died");
    });
}

#[test]
fn a_stubborn_live_holder_of_host_memory_is_cut_and_the_memory_freed_at_the_cut() {
    run(async {
        let parent = Parent::start("cutfree");
        stubborn_live_holder(&parent, false).await;
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
        let ns = peer::namespace("beat");
        let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
        let mut parent = Parent::start_configured(&ns, backend, |c| {
            c.heartbeat(Heartbeat {
                interval: Duration::from_millis(50),
                deadline: Duration::from_millis(500),
            })
        });
        parent
            .child_env
            .push(("BATON_BACKEND".into(), "host".into()));
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
