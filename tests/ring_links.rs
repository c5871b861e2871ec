//! A node's links on shared-memory rings (issue 48): with rings asked for on both sides
//! (`NodeConfig::ring` here, `BATON_LINK_RING` in the child) and both systems polling
//! (`ring_polling_system`), a typed message with buffer leases goes to another process and
//! back, and the link says that frames went through the rings both ways; a child that may
//! map no ring end (`BATON_LINK_RINGS_MAX=0`) keeps the socket both ways, and works.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actors::{DEADLINE, Parent, TEST_DEADLINE, eventually_async, exited};
use baton::HostBackend;
use baton::actors::{Buffer, LinkRings, ring_polling_system};
use msgs::*;
use std::sync::Arc;

/// A parent node asking for rings, on a polling system, and a child of the test peer with
/// `child_env` besides the host backend and `BATON_LINK_RING=1`.
async fn parent_and_child(
    name: &str,
    child_env: &[(&str, &str)],
) -> (Parent, peer::Peer, baton::actors::Peer) {
    let ns = peer::namespace(name);
    let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
    let mut parent = Parent::start_configured(&ns, backend, |c| {
        c.ring(Some(baton::ipc::ring::DEFAULT_CAPACITY))
    });
    for (k, v) in [
        ("BATON_BACKEND", "host"),
        (baton::ipc::host::HOST_ENV, "named"),
        (baton::ipc::link::RING_ENV, "1"),
    ]
    .iter()
    .chain(child_env)
    {
        parent.child_env.push(((*k).into(), (*v).into()));
    }
    let (child, peer) = parent.child(&[]).await;
    (parent, child, peer)
}

/// Sends the child `a` (pattern `seed`) and `b` (`i * 0.5`) to check, and checks the sum it
/// answers with.
async fn check_pair(
    parent: &Parent,
    peer: &baton::actors::Peer,
    a: &Buffer<u32>,
    b: &Buffer<f32>,
    seed: u32,
) {
    let reply = peer
        .remote::<CheckPair>("checker")
        .send(CheckPair {
            seed,
            a: a.share(),
            b: b.share(),
        })
        .await
        .unwrap_or_else(|e| panic!("{e}; link events: {:?}", parent.events.all()));
    assert!(reply.ok, "the child saw exactly the bytes we wrote");
    let sum = reply.sum.open().unwrap().to_vec().unwrap();
    for (i, v) in sum.iter().enumerate() {
        assert_eq!(*v, pattern(seed, i) as f32 + i as f32 * 0.5, "element {i}");
    }
}

/// A buffer of `n` halves (`i * 0.5`), as the checker expects `b`.
async fn halves(parent: &Parent, n: usize) -> Buffer<f32> {
    let b: Buffer<f32> = parent
        .owner
        .send(baton::actors::Allocate::vector(n as u64))
        .await
        .unwrap()
        .unwrap();
    let halves: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    b.write_at(0, &halves).unwrap();
    b
}

/// Once every lease is back, closes the link; the child exits cleanly.
async fn finish(parent: &Parent, mut child: peer::Peer, peer: baton::actors::Peer) {
    eventually_async(DEADLINE, "leases returned", || async {
        parent.table().await.iter().all(|b| b.leases.is_empty())
    })
    .await;
    peer.close();
    assert!(exited(&mut child, DEADLINE).await.success());
}

/// Runs `test` on a polling system under the test deadline.
fn run(test: impl Future<Output = ()>) {
    ring_polling_system().unwrap().block_on(async {
        if tokio::time::timeout(TEST_DEADLINE, test).await.is_err() {
            panic!("the test did not finish within {TEST_DEADLINE:?}");
        }
    });
}

#[test]
fn a_typed_round_trip_with_leases_goes_through_rings_both_ways() {
    run(async {
        let (parent, child, peer) = parent_and_child("ring", &[]).await;
        const N: usize = 1 << 12;
        let a = parent.pattern_buffer(N, 3).await;
        let b = halves(&parent, N).await;
        check_pair(&parent, &peer, &a, &b, 3).await;
        // Pings both ways until each direction has carried a frame through its ring
        // (the switch happens at each side's first send after the peer's offer).
        eventually_async(DEADLINE, "frames through the rings both ways", || async {
            peer.ping().await.unwrap();
            peer.rings()
                == LinkRings {
                    inbound: true,
                    outbound: true,
                }
        })
        .await;
        drop((a, b));
        finish(&parent, child, peer).await;
    });
}

/// A process that may map no more ring ends (`BATON_LINK_RINGS_MAX`; 0 here) neither
/// creates a ring nor opens ours: the link keeps the socket both ways, and typed round
/// trips with leases still work. (Our side offers a ring, as every node does by default.)
#[test]
fn a_child_out_of_ring_budget_keeps_the_socket_both_ways() {
    run(async {
        let (parent, child, peer) =
            parent_and_child("ringbudget", &[(baton::ipc::ring::MAX_ENDS_ENV, "0")]).await;
        const N: usize = 1 << 10;
        let a = parent.pattern_buffer(N, 5).await;
        let b = halves(&parent, N).await;
        for _ in 0..3 {
            check_pair(&parent, &peer, &a, &b, 5).await;
            peer.ping().await.unwrap();
        }
        assert_eq!(
            peer.rings(),
            LinkRings::default(),
            "no frame went through a ring either way"
        );
        drop((a, b));
        finish(&parent, child, peer).await;
    });
}
