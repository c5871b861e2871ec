//! Nodes on two "hosts" (told apart by their host ids) in one process, linked over
//! loopback TCP: typed messages with host buffers both ways arrive as copies, data
//! checked, and each sender's lease comes back once its copy landed. The same across
//! processes and network namespaces: `cross_host_procs.rs`, `cross_host_netns.rs`.

#[path = "support/host_msgs.rs"]
mod host_msgs;

use actix::prelude::*;
use baton::Session;
use baton::actors::{HostSettings, Node, NodeConfig};
use baton::ipc::HostBackend;
use baton::ipc::tcp::HostId;
use host_msgs::*;
use std::sync::Arc;
use std::time::Duration;

fn node(session: &Session, host: &str) -> Node {
    let config = NodeConfig::new(session.clone()).hosts(HostSettings {
        host: HostId::named(host),
        ..HostSettings::default()
    });
    Node::with_config(config, Arc::new(HostBackend::new().unwrap()))
}

#[test]
fn typed_messages_with_host_buffers_cross_hosts_as_copies_both_ways() {
    System::new().block_on(async {
        let session = Session::generate().unwrap();
        let a = node(&session, "a");
        let b = node(&session, "b");
        b.register::<Echo>("echo", Echoer { node: b.clone() }.start().recipient());
        let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
        let to_b = a.connect_tcp(listening.local_addr()).await.unwrap();
        let from_a = listening
            .accept_timeout(Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(from_a.process(), a.session().process());
        assert_eq!(to_b.info().host().map(|h| h.host), Some(HostId::named("b")));
        assert!(
            to_b.info().cred().is_none(),
            "no kernel credentials over TCP"
        );

        for (seed, len) in [(1u8, 1usize), (2, 4096), (3, 3 << 20)] {
            let buf = a.allocate::<u8>(len).unwrap();
            let data = pattern_bytes(seed, len);
            buf.write_at(0, &data).unwrap();
            let reply = to_b
                .remote::<Echo>("echo")
                .send(Echo {
                    seed,
                    data: buf.share(),
                })
                .await
                .unwrap()
                .unwrap();
            assert_eq!(reply.len, len as u64);
            assert!(reply.pattern_ok, "{len} bytes arrived whole");
            let back = reply.plus_one.open().unwrap();
            let got = back.to_vec().unwrap();
            assert!(
                got.iter().zip(&data).all(|(g, d)| *g == d.wrapping_add(1)),
                "{len} bytes came back whole"
            );
            drop(back);
            // The sender's buffer is free again: its lease went back when the copy landed.
            buf.returned_within(Duration::from_secs(10))
                .await
                .expect("the lease comes back");
            buf.write_at(0, &data).unwrap();
        }
        to_b.close_and_wait().await;
    });
}
