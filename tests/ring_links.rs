//! A node's links on shared-memory rings (issue 48): with rings asked for on both sides
//! (`NodeConfig::ring` here, `BATON_LINK_RING` in the child) and both systems polling
//! (`ring_polling_system`), a typed message with buffer leases goes to another process and
//! back, and the link says that frames went through the rings both ways.

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

#[test]
fn a_typed_round_trip_with_leases_goes_through_rings_both_ways() {
    let system = ring_polling_system().unwrap();
    system.block_on(async {
        let test = async {
            let ns = peer::namespace("ring");
            let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
            let mut parent = Parent::start_configured(&ns, backend, |c| {
                c.ring(Some(baton::ipc::ring::DEFAULT_CAPACITY))
            });
            for (k, v) in [
                ("BATON_BACKEND", "host"),
                (baton::ipc::host::HOST_ENV, "named"),
                (baton::ipc::link::RING_ENV, "1"),
            ] {
                parent.child_env.push((k.into(), v.into()));
            }
            let (mut child, peer) = parent.child(&[]).await;
            const N: usize = 1 << 12;
            let a = parent.pattern_buffer(N, 3).await;
            let b: Buffer<f32> = parent
                .owner
                .send(baton::actors::Allocate::vector(N as u64))
                .await
                .unwrap()
                .unwrap();
            let halves: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
            b.write_at(0, &halves).unwrap();
            let reply = peer
                .remote::<CheckPair>("checker")
                .send(CheckPair {
                    seed: 3,
                    a: a.share(),
                    b: b.share(),
                })
                .await
                .unwrap_or_else(|e| panic!("{e}; link events: {:?}", parent.events.all()));
            assert!(reply.ok, "the child saw exactly the bytes we wrote");
            let sum = reply.sum.open().unwrap().to_vec().unwrap();
            for (i, v) in sum.iter().enumerate() {
                assert_eq!(*v, pattern(3, i) as f32 + i as f32 * 0.5, "element {i}");
            }
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
            eventually_async(DEADLINE, "leases on a and b returned", || async {
                parent.table().await.iter().all(|b| b.leases.is_empty())
            })
            .await;
            drop((a, b));
            peer.close();
            assert!(exited(&mut child, DEADLINE).await.success());
        };
        if tokio::time::timeout(TEST_DEADLINE, test).await.is_err() {
            panic!("the test did not finish within {TEST_DEADLINE:?}");
        }
    });
}
