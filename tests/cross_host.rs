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
use baton::ipc::tcp::{HostId, remote_process};
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
        // b knows a by what a announced, in the namespace of the key a proved: never
        // as a process of b's own host (issue 45).
        let a_seen = from_a.info().host().expect("a host link");
        assert_eq!(a_seen.claimed, a.session().process());
        assert_eq!(
            from_a.process(),
            remote_process(&a_seen.key, a.session().process())
        );
        assert_ne!(from_a.process(), a.session().process());
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

/// A message without buffers.
#[derive(Debug, serde::Serialize, serde::Deserialize, Message)]
#[rtype(result = "()")]
struct Note;

impl baton::actors::RemoteMessage for Note {
    const NAME: &'static str = "tests.cross_host.Note";
}

/// Records the order in which its messages reach it.
struct Recorder(Arc<std::sync::Mutex<Vec<&'static str>>>);

impl Actor for Recorder {
    type Context = Context<Self>;
}

impl Handler<Take> for Recorder {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: Take, _: &mut Context<Self>) -> Self::Result {
        self.0.lock().unwrap().push("big");
        let bytes = msg.data.open().and_then(|l| l.to_vec());
        let bytes = bytes.map_err(|e| e.to_string())?;
        match is_pattern(msg.seed, &bytes) {
            true => Ok(bytes.len() as u64),
            false => Err("not the pattern".into()),
        }
    }
}

impl Handler<Note> for Recorder {
    type Result = ();
    fn handle(&mut self, _: Note, _: &mut Context<Self>) {
        self.0.lock().unwrap().push("small");
    }
}

/// A host link keeps the order of its messages, as a Unix link does: a call without
/// buffers sent after one whose 64 MiB copy is still under way reaches the handler after
/// it (it is read first, and waits).
#[test]
fn a_message_after_a_big_copy_reaches_the_handler_after_it() {
    System::new().block_on(async {
        let deadline = Duration::from_secs(60);
        let session = Session::generate().unwrap();
        let a = node(&session, "a");
        let b = node(&session, "b");
        let seen = Arc::default();
        let recorder = Recorder(Arc::clone(&seen)).start();
        b.register::<Take>("take", recorder.clone().recipient());
        b.register::<Note>("note", recorder.recipient());
        let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
        let to_b = a.connect_tcp(listening.local_addr()).await.unwrap();
        let _from_a = listening.accept_timeout(deadline).await.unwrap();
        for round in 0..3u8 {
            let len = 64 << 20;
            let buf = a.allocate::<u8>(len).unwrap();
            buf.write_at(0, &pattern_bytes(round + 1, len)).unwrap();
            let big = actix::spawn(to_b.remote::<Take>("take").send_timeout(
                Take {
                    seed: round + 1,
                    data: buf.share(),
                },
                deadline,
            ));
            // Its lease is granted as its frame is queued: the note leaves after it.
            let start = std::time::Instant::now();
            while a.status(0).leases == 0 {
                assert!(start.elapsed() < deadline, "the big call never left");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            to_b.remote::<Note>("note")
                .send_timeout(Note, deadline)
                .await
                .expect("the note is answered");
            let took = big.await.unwrap().expect("the big call").expect("whole");
            assert_eq!(took, len as u64);
            let order = std::mem::take(&mut *seen.lock().unwrap());
            assert_eq!(order, ["big", "small"], "round {round}: in the order sent");
            buf.returned_within(deadline).await.unwrap();
        }
        to_b.close_and_wait().await;
    });
}
