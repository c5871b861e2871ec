//! Nodes on two "hosts" (told apart by their host ids) linked over TCP: typed messages
//! with host buffers both ways arrive as copies, data checked.

use actix::prelude::*;
use baton::Session;
use baton::actors::{HostSettings, Node, NodeConfig, RemoteMessage, Shared};
use baton::ipc::HostBackend;
use baton::ipc::tcp::HostId;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// Sums a buffer and answers with a buffer of its own: each byte plus one.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<Echoed, String>")]
struct Echo {
    data: Shared<u8>,
}

impl RemoteMessage for Echo {
    const NAME: &'static str = "tests.cross_host.Echo";
}

#[derive(Debug, Serialize, Deserialize)]
struct Echoed {
    sum: u64,
    plus_one: Shared<u8>,
}

struct Echoer {
    node: Node,
}

impl Actor for Echoer {
    type Context = Context<Self>;
}

impl Handler<Echo> for Echoer {
    type Result = Result<Echoed, String>;
    fn handle(&mut self, msg: Echo, _: &mut Context<Self>) -> Self::Result {
        let lease = msg.data.open().map_err(|e| e.to_string())?;
        let bytes = lease.to_vec().map_err(|e| e.to_string())?;
        let sum = bytes.iter().map(|&b| u64::from(b)).sum();
        let out = self
            .node
            .allocate::<u8>(bytes.len())
            .map_err(|e| e.to_string())?;
        let plus: Vec<u8> = bytes.iter().map(|b| b.wrapping_add(1)).collect();
        out.write_at(0, &plus).map_err(|e| e.to_string())?;
        Ok(Echoed {
            sum,
            plus_one: out.share(),
        })
    }
}

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

        for len in [1usize, 4096, 3 << 20] {
            let buf = a.allocate::<u8>(len).unwrap();
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            buf.write_at(0, &data).unwrap();
            let reply = to_b
                .remote::<Echo>("echo")
                .send(Echo { data: buf.share() })
                .await
                .unwrap()
                .unwrap();
            let want: u64 = data.iter().map(|&b| u64::from(b)).sum();
            assert_eq!(reply.sum, want, "{len} bytes arrived whole");
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
