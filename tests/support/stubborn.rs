//! The stubborn live holder, shared by `leases.rs` (host and legacy-like host memory) and
//! `actors_cuda.rs` (legacy CUDA IPC): a holder keeps a lease, is SIGSTOPped, misses a revoke
//! deadline and is cut; where the backend cannot free memory a live process maps, the
//! memory stays quarantined until the holder dies.

#![allow(dead_code)]

use super::actors::{DEADLINE, Lines, Parent, eventually, eventually_async, exited};
use super::msgs::*;
use super::peer;
use baton::actors::Revoke;
use rustix::process::{Pid, Signal, kill_process};
use std::time::Duration;

pub fn signal(child: &peer::Peer, sig: Signal) {
    kill_process(Pid::from_raw(child.pid() as i32).expect("a pid"), sig).expect("signal");
}

/// The sum of a pattern buffer's values, as the holder reports it.
pub fn pattern_sum(seed: u32, len: usize) -> u64 {
    (0..len).map(|i| u64::from(pattern(seed, i))).sum()
}

/// A holder keeps a lease, is stopped, misses a revoke deadline and is cut. Returns what
/// the parent saw: the buffer's row of the lease table after the cut.
///
/// `len` is the buffer's length in `u32`s; `allocations` counts the exporter backend's live
/// allocations where the test can see them (CUDA), so that "not freed" is checked on the
/// allocation itself, not only in the ledger.
pub async fn stubborn_live_holder(
    parent: &Parent,
    legacy_like: bool,
    len: usize,
    allocations: &dyn Fn() -> Option<usize>,
) {
    let (mut child, link) = parent
        .spawn_linked(
            peer::exe("baton-actor-peer"),
            &["serve", &parent.socket(), "stubborn", "linger"],
            true,
        )
        .await;
    let lines = Lines::of(child.take_stdout().expect("piped"));
    let buf = parent.pattern_buffer(len, 11).await;
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
    let allocated = allocations();

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
        assert_eq!(stats.quarantined_bytes, (len * 4) as u64);
        assert_eq!(parent.node.export_stats().quarantined, 1);
        assert_eq!(allocations(), allocated, "the allocation itself is kept");
    } else {
        // A host mapping survives the exporter's free: freed at the cut.
        assert!(table.iter().all(|b| b.buffer != id), "{table:?}");
        assert_eq!(parent.stats().await.freed, freed_before + 1);
    }

    // Another buffer of the same size, with other data, made while the holder is cut: had
    // the quarantined memory been freed, this is where its pages would go next.
    let other = parent.pattern_buffer(len, 12).await;

    // Awake again, the holder finds its link closed (the socket was shut down while it
    // was stopped), and reads its lease without a crash: the lease says orphaned, the
    // mapping still holds its own data — never the other buffer's.
    signal(&child, Signal::CONT);
    let line = lines.next_line(DEADLINE).await;
    let expected = format!("api=orphaned raw={}", pattern_sum(11, len));
    assert!(line.ends_with(&expected), "{line:?}, not …{expected}");
    assert!(child.try_wait().is_none(), "the holder lives on");
    if legacy_like {
        let row = parent.table().await;
        assert!(
            row.iter().any(|b| b.buffer == id && b.quarantined),
            "still quarantined while the holder lives"
        );
    }
    drop(other);

    // Its death ends the quarantine.
    child.signal_kill();
    exited(&mut child, DEADLINE).await;
    eventually_async(
        DEADLINE,
        "the buffer freed after the holder died",
        || async { parent.table().await.iter().all(|b| b.buffer != id) },
    )
    .await;
    // Both buffers freed (the other one as soon as its last handle dropped).
    eventually_async(DEADLINE, "both buffers freed", || async {
        let stats = parent.stats().await;
        (stats.quarantined, stats.freed) == (0, freed_before + 2)
    })
    .await;
    if let Some(before) = allocated {
        eventually(DEADLINE, "the backend's allocations to go", || {
            allocations() == Some(before - 1)
        })
        .await;
    }
}
