//! The newcomer fixes of issue 29 (part 2), in one process (links to the node itself, or
//! between two nodes of this process): one name serving several message types, the
//! owner's in-place writes, `Buffer::returned_within`, and a reply that goes out before
//! the `close()` that follows it.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, run};
use baton::actors::raw::{RawCall, RawMessage, RawReply};
use baton::actors::{ActorError, Buffer, LeaseMut, Node, Peer};
use baton::messages::protocol::CallFault;
use baton::{HostBackend, RemoteMessage, Session, Shared, SharedMut, SocketDir};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

fn host_node() -> Node {
    Node::new(
        Session::generate().unwrap(),
        Arc::new(HostBackend::new().unwrap()),
    )
}

/// Sums a buffer.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "Result<f64, String>")]
struct Sum(Shared<u32>);
impl RemoteMessage for Sum {
    const NAME: &'static str = "ergo.Sum";
}

/// Keeps a writable lease until `LetGo` comes.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "Result<(), String>")]
struct Hold(SharedMut<u32>);
impl RemoteMessage for Hold {
    const NAME: &'static str = "ergo.Hold";
}

/// Drops the leases held.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
struct LetGo;
impl RemoteMessage for LetGo {
    const NAME: &'static str = "ergo.LetGo";
}

/// A type nobody registers.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "()")]
struct Unknown;
impl RemoteMessage for Unknown {
    const NAME: &'static str = "ergo.Unknown";
}

/// One actor, three message types.
#[derive(Default)]
struct Worker(Vec<LeaseMut<u32>>);
impl Actor for Worker {
    type Context = Context<Self>;
}
impl Handler<Sum> for Worker {
    type Result = Result<f64, String>;
    fn handle(&mut self, Sum(data): Sum, _: &mut Context<Self>) -> Self::Result {
        let lease = data.open().map_err(|e| e.to_string())?;
        let xs = lease.as_slice().map_err(|e| e.to_string())?;
        Ok(xs.iter().map(|&x| f64::from(x)).sum())
    }
}
impl Handler<Hold> for Worker {
    type Result = Result<(), String>;
    fn handle(&mut self, Hold(data): Hold, _: &mut Context<Self>) -> Self::Result {
        self.0.push(data.open().map_err(|e| e.to_string())?);
        Ok(())
    }
}
impl Handler<LetGo> for Worker {
    type Result = usize;
    fn handle(&mut self, _: LetGo, _: &mut Context<Self>) -> usize {
        self.0.drain(..).count()
    }
}

/// A node whose actor "worker" serves `Sum`, `Hold` and `LetGo` under one name.
fn worker_node() -> Node {
    let node = host_node();
    let worker = Worker::default().start();
    node.register::<Sum>("worker", worker.clone().recipient());
    node.register::<Hold>("worker", worker.clone().recipient());
    node.register::<LetGo>("worker", worker.recipient());
    node
}

/// Has "worker" hold a writable lease on `buf` (held once this returns).
async fn hold(local: &Peer, buf: &Buffer<u32>) {
    let held = local.remote::<Hold>("worker").send(Hold(buf.share_mut()));
    held.await.unwrap().unwrap();
}

/// Has "worker" drop the leases it holds; returns how many.
async fn let_go(local: &Peer) -> usize {
    local.remote::<LetGo>("worker").send(LetGo).await.unwrap()
}

#[test]
fn one_name_serves_every_message_type_registered_under_it() {
    run(async {
        let node = worker_node();
        let local = node.local().await.unwrap();
        let buf = node.allocate::<u32>(1000).unwrap();
        buf.write_at(0, &[3; 1000]).unwrap();
        let sum = local
            .remote::<Sum>("worker")
            .send(Sum(buf.share()))
            .await
            .unwrap();
        assert_eq!(
            sum,
            Ok(3000.0),
            "the first type registered still reaches it"
        );
        hold(&local, &buf).await;
        assert_eq!(let_go(&local).await, 1);

        let err = local
            .remote::<Unknown>("worker")
            .send(Unknown)
            .await
            .unwrap_err();
        match err {
            ActorError::Remote(CallFault::WrongType { expected }) => {
                for name in ["ergo.Sum", "ergo.Hold", "ergo.LetGo"] {
                    assert!(expected.contains(name), "{expected} names {name}");
                }
            }
            other => panic!("expected WrongType, got {other:?}"),
        }
        // Unregistering one type leaves the others.
        node.unregister_type("worker", Hold::NAME);
        let sum = local.remote::<Sum>("worker").send(Sum(buf.share())).await;
        assert_eq!(sum.unwrap(), Ok(3000.0));
        let err = local
            .remote::<Hold>("worker")
            .send(Hold(buf.share_mut()))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ActorError::Remote(CallFault::WrongType { .. })),
            "{err:?}"
        );
        local.close_and_wait().await;
    });
}

#[test]
fn the_owner_writes_in_place_only_while_no_lease_is_out() {
    run(async {
        let node = worker_node();
        let local = node.local().await.unwrap();
        let buf = node.allocate::<u32>(1024).unwrap();
        {
            let mut slice = buf.as_mut_slice().unwrap();
            assert_eq!(slice.len(), 1024);
            for (i, x) in slice.iter_mut().enumerate() {
                *x = i as u32;
            }
            // While the guard lives: no second guard, no copies (through any clone), and no
            // lease is granted.
            let other = buf.clone();
            let second = other.as_mut_slice().unwrap_err();
            assert!(
                matches!(second, ActorError::Ipc(baton::ipc::Error::InPlace { .. })),
                "{second:?}"
            );
            let copy = other.write_at(0, &[1]).unwrap_err();
            assert!(
                matches!(copy, ActorError::Ipc(baton::ipc::Error::InPlace { .. })),
                "{copy:?}"
            );
            assert!(other.to_vec().is_err(), "reads are refused too");
            let refused = local
                .remote::<Sum>("worker")
                .send(Sum(other.share()))
                .await
                .unwrap_err();
            assert!(
                matches!(refused, ActorError::LeaseConflict { .. }),
                "{refused:?}"
            );
            assert_eq!(buf.leases_out(), 0);
        }
        // The slice wrote the shared pages: the receiver reads them.
        let sum = local
            .remote::<Sum>("worker")
            .send(Sum(buf.share()))
            .await
            .unwrap();
        assert_eq!(sum, Ok((0..1024u32).map(f64::from).sum()));
        buf.returned_within(DEADLINE).await.unwrap();

        // A lease out: refused, and the buffer stays usable.
        hold(&local, &buf).await;
        let leased = buf.as_mut_slice().unwrap_err();
        assert!(
            matches!(leased, ActorError::BufferLeased { leases: 1, .. }),
            "{leased:?}"
        );
        assert_eq!(let_go(&local).await, 1);
        buf.returned_within(DEADLINE).await.unwrap();
        buf.as_mut_slice().unwrap()[0] = 7;
        assert_eq!(buf.to_vec().unwrap()[0], 7);
        local.close_and_wait().await;
    });
}

#[test]
fn returned_within_says_how_many_leases_are_still_out() {
    run(async {
        let node = worker_node();
        let local = node.local().await.unwrap();
        let buf = node.allocate::<u32>(16).unwrap();
        buf.returned_within(Duration::ZERO)
            .await
            .expect("no lease out: at once");
        hold(&local, &buf).await;
        // The reply came after the receiver mapped the lease: it holds it now.
        assert_eq!(buf.leases_out(), 1);
        let err = buf
            .returned_within(Duration::from_millis(20))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ActorError::NotReturned { leases: 1, .. }),
            "{err:?}"
        );
        // It names the lease and the process that keeps it.
        let ActorError::NotReturned { holders, .. } = &err else {
            unreachable!()
        };
        assert_eq!(holders.len(), 1, "{err}");
        assert_eq!(holders[0].1, local.process(), "{err}");
        assert!(
            err.to_string().contains(&format!(
                "held by lease {} ({})",
                holders[0].0, holders[0].1
            )),
            "{err}"
        );
        let waiting = buf.returned_within(DEADLINE);
        assert_eq!(let_go(&local).await, 1);
        waiting.await.expect("back once dropped");
        local.close_and_wait().await;
    });
}

#[test]
fn a_reply_given_just_before_close_reaches_the_caller() {
    run(async {
        let tmp = tempfile::tempdir().unwrap(); // removed when it drops
        let dir = SocketDir::create(tmp.path().join("sockets")).unwrap();
        let session = Session::generate().unwrap();
        let backend = Arc::new(HostBackend::new().unwrap());
        let server = Node::new(session.clone(), backend.clone());
        let client = Node::new(session, backend);
        // Each call's reply channel goes to the test, which answers it.
        let (calls_tx, mut calls) = mpsc::unbounded_channel();
        server.register_raw("svc", "ergo.Echo", move |call: RawCall| -> RawReply {
            let (tx, rx) = oneshot::channel();
            let _ = calls_tx.send((call, tx));
            Box::pin(async move { rx.await.unwrap_or(Err(CallFault::ActorGone)) })
        });
        let mut listening = server.listen(&dir, "svc.sock").unwrap();
        let to_server = client.connect(listening.path()).await.unwrap();
        let to_client = tokio::time::timeout(DEADLINE, listening.accept())
            .await
            .unwrap()
            .unwrap();

        let reply = to_server.call_raw(
            "svc",
            "ergo.Echo",
            RawMessage::new(b"ping".to_vec(), vec![]),
        );
        let reply = tokio::spawn(reply);
        let (call, answer) = tokio::time::timeout(DEADLINE, calls.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(call.message.bytes, b"ping");
        // The answer, then at once the close (no await between them).
        answer
            .send(Ok(RawMessage::new(b"pong".to_vec(), vec![])))
            .unwrap_or_else(|_| panic!("the call is waiting"));
        to_client.close();
        let got = tokio::time::timeout(DEADLINE, reply)
            .await
            .expect("the caller hears back")
            .unwrap()
            .expect("the reply was sent before the link closed");
        assert_eq!(got.bytes, b"pong");
        tokio::time::timeout(DEADLINE, to_client.closed())
            .await
            .unwrap();
        tokio::time::timeout(DEADLINE, to_server.closed())
            .await
            .expect("the caller sees the close after the reply");
    });
}
