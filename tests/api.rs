//! The user-facing API of issue 16, across real processes where it matters: children
//! started with `Node::spawn_child` (the helper `baton-api-peer`, which calls
//! `Node::join`), peers waited for with `Listening::accept`, links awaited with
//! `Peer::closed`, leases awaited with `Buffer::returned`, read-only and writable leases,
//! zero-copy reads, revokes received by the holding actor, plain-call allocation.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/api_msgs.rs"]
mod api_msgs;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, run};
use api_msgs::*;
use baton::actors::{
    ActorError, Allocate, BufferOwner, LinkedChild, Node, NodeConfig, Peer, Revoke,
};
use baton::{HostBackend, Session, SocketDir};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// A node on host memory with a fresh session.
fn host_node() -> Node {
    Node::new(
        Session::generate().unwrap(),
        Arc::new(HostBackend::new().unwrap()),
    )
}

/// The helper started with `spawn_child`, linked.
async fn child(node: &Node) -> LinkedChild {
    node.spawn_child(Command::new(peer::exe("baton-api-peer")))
        .await
        .expect("the child links")
}

/// Whether `fut` is still pending after a short while.
async fn still_pending(fut: impl Future) -> bool {
    tokio::time::timeout(Duration::from_millis(200), fut)
        .await
        .is_err()
}

/// Closes the link and waits for the child to exit cleanly (it exits when its parent's
/// link goes down).
async fn finish(child: LinkedChild) {
    child.peer().close_and_wait().await;
    assert!(!child.peer().is_connected());
    let status = tokio::time::timeout(DEADLINE, child.wait())
        .await
        .expect("the child exits once its link is closed")
        .unwrap();
    assert!(status.success(), "child: {status}");
}

#[test]
fn spawn_child_links_an_authenticated_child_that_inherits_the_backend() {
    run(async {
        let node = host_node();
        let child = child(&node).await;
        assert_eq!(child.peer().process().pid, child.pid());
        assert!(child.peer().is_connected());
        assert!(
            node.peers()
                .iter()
                .any(|p| p.link_id() == child.peer().link_id())
        );
        let (name, kind) = child
            .peer()
            .remote::<WhichBackend>("api.backend")
            .send(WhichBackend)
            .await
            .unwrap();
        assert_eq!((name.as_str(), kind.as_str()), ("host", "Host"));
        finish(child).await;
    });
}

#[test]
fn spawn_child_reports_a_child_that_exits_before_linking() {
    run(async {
        let node = host_node();
        let err = node
            .spawn_child(Command::new("false"))
            .await
            .expect_err("`false` never links");
        assert!(
            matches!(err, ActorError::ChildExited { ref status, .. } if !status.success()),
            "{err:?}"
        );
    });
}

#[test]
fn join_outside_a_spawned_child_says_so() {
    run(async {
        let err = Node::join().await.expect_err("no parent");
        assert!(matches!(err, ActorError::NoParent { .. }), "{err:?}");
    });
}

#[test]
fn accept_waits_for_peers_in_order_and_skips_refused_ones() {
    run(async {
        let server = host_node();
        let (_tmp, dir): (tempfile::TempDir, SocketDir) = peer::socket_dir();
        let mut listening = server.listen(&dir, "accept.sock").unwrap();
        let path = listening.path().to_owned();

        // Nobody yet: accept waits.
        assert!(matches!(
            listening.accept_timeout(Duration::from_millis(100)).await,
            Err(ActorError::Timeout { .. })
        ));

        // A node with another token is refused in the handshake: accept does not return it.
        let stranger = host_node();
        assert!(stranger.connect(&path).await.is_err());
        assert!(matches!(
            listening.accept_timeout(Duration::from_millis(200)).await,
            Err(ActorError::Timeout { .. })
        ));

        // Two clients of the session: accepted in order, each already linked.
        let first = Node::with_config(
            NodeConfig::new(server.session().clone()),
            Arc::new(HostBackend::new().unwrap()),
        );
        let second = first.clone();
        let a = first.connect(&path).await.unwrap();
        let b = second.connect(&path).await.unwrap();
        let got_a = listening.accept_timeout(DEADLINE).await.unwrap();
        let got_b = listening.accept_timeout(DEADLINE).await.unwrap();
        assert!(got_a.is_connected() && got_b.is_connected());
        assert_eq!(got_a.process(), a.process());
        assert_ne!(got_a.link_id(), got_b.link_id());
        drop((a, b));
    });
}

#[test]
fn closed_resolves_on_both_sides_when_one_closes() {
    run(async {
        let server = host_node();
        let (_tmp, dir): (tempfile::TempDir, SocketDir) = peer::socket_dir();
        let mut listening = server.listen(&dir, "closed.sock").unwrap();
        let client = Node::new(
            server.session().clone(),
            Arc::new(HostBackend::new().unwrap()),
        );
        let to_server: Peer = client.connect(listening.path()).await.unwrap();
        let to_client = listening.accept_timeout(DEADLINE).await.unwrap();

        assert!(
            still_pending(to_client.closed()).await,
            "nothing closed yet"
        );
        tokio::time::timeout(DEADLINE, to_server.close_and_wait())
            .await
            .expect("close_and_wait resolves");
        assert!(!to_server.is_connected());
        assert!(client.peer(&to_server.process()).is_none());
        tokio::time::timeout(DEADLINE, to_client.closed())
            .await
            .expect("the other side sees the end too");
        assert!(!to_client.is_connected());
        // Resolves at once when already down.
        tokio::time::timeout(Duration::from_millis(100), to_client.closed())
            .await
            .unwrap();
    });
}

#[test]
fn returned_waits_for_the_holder_and_write_at_is_refused_meanwhile() {
    run(async {
        let node = host_node();
        let child = child(&node).await;
        let buf = node.allocate::<u32>(1024).unwrap();
        buf.write_at(0, &[7; 1024]).unwrap();
        // Nothing out: resolves at once.
        tokio::time::timeout(Duration::from_millis(100), buf.returned())
            .await
            .unwrap();

        let kept = child
            .peer()
            .remote::<Keep>("api.keep")
            .send(Keep { data: buf.share() })
            .await
            .unwrap();
        assert_eq!(kept, 1);
        assert_eq!(buf.leases_out(), 1);
        assert!(still_pending(buf.returned()).await, "the child holds it");
        // The holder may be reading it in place: the exporter's write is refused.
        let err = buf.write_at(0, &[8]).unwrap_err();
        assert!(
            matches!(err, ActorError::BufferLeased { leases: 1, .. }),
            "{err:?}"
        );

        let returned = buf.returned();
        let given = child
            .peer()
            .remote::<GiveBack>("api.give")
            .send(GiveBack)
            .await
            .unwrap();
        assert_eq!(given, 1);
        tokio::time::timeout(DEADLINE, returned)
            .await
            .expect("the lease comes back");
        assert_eq!(buf.leases_out(), 0);
        buf.write_at(0, &[8]).unwrap();
        assert_eq!(buf.to_vec().unwrap()[..2], [8, 7]);
        finish(child).await;
    });
}

#[test]
fn returned_resolves_when_the_holder_goes_away() {
    run(async {
        let node = host_node();
        let mut child = child(&node).await;
        let buf = node.allocate::<u32>(64).unwrap();
        child
            .peer()
            .remote::<Keep>("api.keep")
            .send(Keep { data: buf.share() })
            .await
            .unwrap();
        let returned = buf.returned();
        child.kill().unwrap();
        tokio::time::timeout(DEADLINE, returned)
            .await
            .expect("a dead holder's leases are reclaimed");
        tokio::time::timeout(DEADLINE, child.peer().closed())
            .await
            .unwrap();
        assert!(!child.wait().await.unwrap().success());
    });
}

#[test]
fn a_read_only_lease_reads_the_same_memory_in_place() {
    run(async {
        let node = host_node();
        let child = child(&node).await;
        const N: usize = 1 << 20;
        let buf = node.allocate::<f32>(N).unwrap();
        let data: Vec<f32> = (0..N).map(|i| (i % 7) as f32).collect();
        buf.write_at(0, &data).unwrap();
        let (sum, in_place) = child
            .peer()
            .remote::<SumInPlace>("api.sum")
            .send(SumInPlace { data: buf.share() })
            .await
            .unwrap()
            .unwrap();
        let expect: f64 = data.iter().map(|&x| f64::from(x)).sum();
        assert_eq!(sum, expect);
        assert!(in_place, "the slice is the mapping, not a copy");
        tokio::time::timeout(DEADLINE, buf.returned())
            .await
            .unwrap();
        finish(child).await;
    });
}

#[test]
fn a_writable_lease_writes_and_excludes_every_other_lease() {
    run(async {
        let node = host_node();
        let child = child(&node).await;
        let buf = node.allocate::<u32>(256).unwrap();
        let peer = child.peer();

        // One writer: it writes, the exporter reads it once the lease is back.
        peer.remote::<Fill>("api.fill")
            .send(Fill {
                data: buf.share_mut(),
                value: 42,
            })
            .await
            .unwrap()
            .unwrap();
        tokio::time::timeout(DEADLINE, buf.returned())
            .await
            .unwrap();
        assert!(buf.to_vec().unwrap().iter().all(|&v| v == 42));

        // A reader is out: no writer is granted (the call fails, nothing is leased).
        peer.remote::<Keep>("api.keep")
            .send(Keep { data: buf.share() })
            .await
            .unwrap();
        let err = peer
            .remote::<Fill>("api.fill")
            .send(Fill {
                data: buf.share_mut(),
                value: 1,
            })
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                ActorError::LeaseConflict {
                    wanted: "writable",
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(buf.leases_out(), 1);
        peer.remote::<GiveBack>("api.give")
            .send(GiveBack)
            .await
            .unwrap();
        tokio::time::timeout(DEADLINE, buf.returned())
            .await
            .unwrap();
        assert!(buf.to_vec().unwrap().iter().all(|&v| v == 42));
        finish(child).await;
    });
}

#[test]
fn a_writer_out_excludes_readers() {
    // The reverse of the rule: while a writable lease is out, neither another writable
    // one nor a read-only one is granted. The holder is a second node in this process,
    // linked through the first one's socket, whose actor keeps the writable lease.
    run(async {
        let node = host_node();
        let (_tmp, dir): (tempfile::TempDir, SocketDir) = peer::socket_dir();
        let mut listening = node.listen(&dir, "self.sock").unwrap();
        let other = Node::new(
            node.session().clone(),
            Arc::new(HostBackend::new().unwrap()),
        );
        let held: Arc<std::sync::Mutex<Vec<baton::actors::LeaseMut<u32>>>> = Arc::default();
        let holder = HoldWritable(Arc::clone(&held)).start();
        other.register::<Fill>("hold-writable", holder.clone().recipient());
        other.register::<Keep>("keep", holder.recipient());
        let _to_node = other.connect(listening.path()).await.unwrap();
        let to_other = listening.accept_timeout(DEADLINE).await.unwrap();

        let buf = node.allocate::<u32>(16).unwrap();
        to_other
            .remote::<Fill>("hold-writable")
            .send(Fill {
                data: buf.share_mut(),
                value: 5,
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(buf.leases_out(), 1);
        let err = to_other
            .remote::<Fill>("hold-writable")
            .send(Fill {
                data: buf.share_mut(),
                value: 6,
            })
            .await
            .unwrap_err();
        assert!(matches!(err, ActorError::LeaseConflict { .. }), "{err:?}");
        let err = to_other
            .remote::<Keep>("keep")
            .send(Keep { data: buf.share() })
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                ActorError::LeaseConflict {
                    wanted: "read-only",
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(buf.leases_out(), 1);
        assert!(matches!(
            buf.write_at(0, &[1]),
            Err(ActorError::BufferLeased { .. })
        ));
        held.lock().unwrap().clear();
        tokio::time::timeout(DEADLINE, buf.returned())
            .await
            .unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![5; 16]);
    });
}

/// Keeps the writable leases it is sent (after writing `value`), in a list the test drops.
struct HoldWritable(Arc<std::sync::Mutex<Vec<baton::actors::LeaseMut<u32>>>>);

impl Actor for HoldWritable {
    type Context = Context<Self>;
}

impl Handler<Fill> for HoldWritable {
    type Result = Result<(), String>;
    fn handle(&mut self, msg: Fill, _: &mut Context<Self>) -> Self::Result {
        let lease = msg.data.open().map_err(|e| e.to_string())?;
        lease
            .write_at(0, &vec![msg.value; lease.len()])
            .map_err(|e| e.to_string())?;
        self.0.lock().unwrap().push(lease);
        Ok(())
    }
}

impl Handler<Keep> for HoldWritable {
    type Result = usize;
    fn handle(&mut self, _: Keep, _: &mut Context<Self>) -> usize {
        unreachable!("never granted while a writable lease is out")
    }
}

#[test]
fn the_holding_actor_receives_the_revoke_and_its_deadline() {
    run(async {
        let node = host_node();
        let owner = BufferOwner::new(&node).start();
        let child = child(&node).await;
        let buf = owner
            .send(Allocate::<u32>::vector(128))
            .await
            .unwrap()
            .unwrap();
        child
            .peer()
            .remote::<KeepUntilRevoked>("api.revocable")
            .send(KeepUntilRevoked { data: buf.share() })
            .await
            .unwrap();
        assert_eq!(buf.leases_out(), 1);
        assert!(still_pending(buf.returned()).await, "kept until revoked");

        // A long deadline: the lease must come back well before it, from the holder itself
        // (a cut at the deadline would also end the link, which must stay up).
        let within = Duration::from_secs(60);
        let asked = owner
            .send(Revoke {
                buffer: buf.id(),
                within,
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(asked, 1);
        tokio::time::timeout(Duration::from_secs(20), buf.returned())
            .await
            .expect("the holder gave the lease back on its revoke");
        assert!(child.peer().is_connected(), "not cut: it cooperated");
        let seen = child
            .peer()
            .remote::<Revocations>("api.revocations")
            .send(Revocations)
            .await
            .unwrap();
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert!(
            seen[0] > 30_000 && seen[0] <= 60_000,
            "the deadline it saw: {} ms left",
            seen[0]
        );
        finish(child).await;
    });
}

/// Three buffers sent as one lease over them all (`Shared::lease_with_previous`): each is
/// out (the ledger keeps a part per buffer), a revoke of the last buffer reaches the guard
/// of the first — the holder knows one lease — and every buffer comes back when the holder
/// drops its leases; the link stays up.
#[test]
fn a_lease_over_several_buffers_is_revoked_and_given_back_whole() {
    run(async {
        let node = host_node();
        let owner = BufferOwner::new(&node).start();
        let child = child(&node).await;
        let mut bufs = Vec::new();
        for _ in 0..3 {
            let buf = owner.send(Allocate::<u32>::vector(64)).await.unwrap();
            bufs.push(buf.unwrap());
        }
        let data = (bufs.iter().enumerate())
            .map(|(i, b)| match i {
                0 => b.share(),
                _ => b.share().lease_with_previous(),
            })
            .collect();
        child
            .peer()
            .remote::<KeepAllUntilRevoked>("api.revocable_all")
            .send(KeepAllUntilRevoked { data })
            .await
            .unwrap();
        let leases: Vec<_> = (node.lease_table().into_iter())
            .flat_map(|b| b.leases.into_iter().map(|(lease, _)| lease))
            .collect();
        assert_eq!(leases.len(), 3, "a part per buffer: {leases:?}");
        assert!(bufs.iter().all(|b| b.leases_out() == 1));
        assert!(
            still_pending(bufs[0].returned()).await,
            "kept until revoked"
        );
        let within = Duration::from_secs(60);
        let asked = owner
            .send(Revoke {
                buffer: bufs[2].id(),
                within,
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(asked, 1);
        for b in &bufs {
            tokio::time::timeout(Duration::from_secs(20), b.returned())
                .await
                .expect("the holder gave the whole lease back on the revoke of a part");
        }
        assert!(child.peer().is_connected(), "not cut: it cooperated");
        finish(child).await;
    });
}

#[test]
fn node_allocate_is_a_plain_call_counted_in_the_ledger() {
    run(async {
        let node = host_node();
        let before = node.export_stats();
        let buf = node.allocate::<u16>(1000).unwrap();
        assert_eq!(buf.len(), 1000);
        assert!(buf.to_vec().unwrap().iter().all(|&v| v == 0), "zeroed");
        let after = node.export_stats();
        assert_eq!(after.buffers, before.buffers + 1);
        assert!(after.bytes >= before.bytes + 2000);
        assert!(node.lease_table().iter().any(|row| row.buffer == buf.id()));
        drop(buf);
        actors::eventually(DEADLINE, "the buffer freed", || {
            node.export_stats().buffers == before.buffers
        })
        .await;
    });
}

#[test]
fn the_readme_opens_with_the_whole_hello_buffer_example() {
    let readme = include_str!("../README.md");
    let example = include_str!("../examples/hello_buffer.rs");
    let first = readme
        .split("```")
        .nth(1)
        .expect("the README has a code block");
    let body = first
        .strip_prefix("rust,no_run\n")
        .expect("the first code block is Rust (compiled as a doctest of the facade)");
    assert_eq!(
        body, example,
        "README's first code block is examples/hello_buffer.rs"
    );
    let lines = example.lines().count();
    assert!(
        lines <= 60,
        "hello_buffer has {lines} lines; the issue allows 60"
    );
}

/// Sum a buffer in place and say what the ledger and the import cache see meanwhile.
#[derive(Debug, serde::Serialize, serde::Deserialize, Message)]
#[rtype(result = "Result<Inspected, String>")]
struct Inspect {
    data: baton::actors::Shared<f32>,
}

impl baton::actors::RemoteMessage for Inspect {
    const NAME: &'static str = "api.Inspect";
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Inspected {
    sum: f64,
    /// The allocation the lease maps.
    alloc: u64,
    /// Leases the node's ledger records as held by this process while the handler runs.
    held_here: usize,
}

/// An actor of the test's own process.
struct Inspector(Node);

impl Actor for Inspector {
    type Context = Context<Self>;
}

impl Handler<Inspect> for Inspector {
    type Result = Result<Inspected, String>;
    fn handle(&mut self, msg: Inspect, _: &mut Context<Self>) -> Self::Result {
        let lease = msg.data.open().map_err(|e| e.to_string())?;
        let me = self.0.session().process();
        let held_here = self
            .0
            .lease_table()
            .iter()
            .flat_map(|row| &row.leases)
            .filter(|(id, holder)| *id == lease.id() && *holder == me)
            .count();
        let alloc = lease.imported().map_err(|e| e.to_string())?.alloc().get();
        let sum = lease
            .as_slice()
            .map_err(|e| e.to_string())?
            .iter()
            .map(|&x| f64::from(x))
            .sum();
        Ok(Inspected {
            sum,
            alloc,
            held_here,
        })
    }
}

#[test]
fn a_message_to_an_actor_of_this_process_leases_the_same_memory() {
    run(async {
        let node = host_node();
        node.register::<Inspect>("inspector", Inspector(node.clone()).start().recipient());
        let local = node.local().await.unwrap();
        assert_eq!(local.process(), node.session().process());
        let again = node.local().await.unwrap();
        assert_eq!(again.link_id(), local.link_id(), "made once, then kept");

        let buf = node.allocate::<f32>(4096).unwrap();
        buf.write_at(0, &vec![0.25; 4096]).unwrap();
        let granted = node.export_stats().granted;
        let seen = local
            .remote::<Inspect>("inspector")
            .send(Inspect { data: buf.share() })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(seen.sum, 1024.0);
        assert_eq!(seen.alloc, buf.allocation_id().get(), "the same allocation");
        assert_eq!(seen.held_here, 1, "the ledger counted the local lease");
        assert_eq!(node.export_stats().granted, granted + 1);
        tokio::time::timeout(DEADLINE, buf.returned())
            .await
            .expect("the local lease comes back on drop");
        buf.write_at(0, &[1.0]).unwrap();
        local.close_and_wait().await;
    });
}

/// Writes `value + i` to element `i` of a writable buffer, in place.
#[derive(Debug, serde::Serialize, serde::Deserialize, Message)]
#[rtype(result = "Result<(), String>")]
struct FillInPlace {
    data: baton::actors::SharedMut<u32>,
    value: u32,
}

impl baton::actors::RemoteMessage for FillInPlace {
    const NAME: &'static str = "api.FillInPlace";
}

/// An actor of the test's own process that writes through `as_mut_slice`.
struct InPlaceFiller;

impl Actor for InPlaceFiller {
    type Context = Context<Self>;
}

impl Handler<FillInPlace> for InPlaceFiller {
    type Result = Result<(), String>;
    fn handle(&mut self, msg: FillInPlace, _: &mut Context<Self>) -> Self::Result {
        let mut lease = msg.data.open().map_err(|e| e.to_string())?;
        let mapped = lease.ptr().map_err(|e| e.to_string())?;
        let slice = lease.as_mut_slice().map_err(|e| e.to_string())?;
        if baton::ipc::MemPtr::Host(slice.as_mut_ptr().cast()) != mapped {
            return Err("the slice is not the mapping".into());
        }
        for (i, x) in slice.iter_mut().enumerate() {
            *x = msg.value + i as u32;
        }
        Ok(())
    }
}

#[test]
fn a_writable_lease_writes_host_memory_in_place() {
    run(async {
        let node = host_node();
        node.register::<FillInPlace>("filler", InPlaceFiller.start().recipient());
        let local = node.local().await.unwrap();
        let buf = node.allocate::<u32>(1024).unwrap();
        buf.write_at(0, &vec![0; 1024]).unwrap();
        local
            .remote::<FillInPlace>("filler")
            .send(FillInPlace {
                data: buf.share_mut(),
                value: 7,
            })
            .await
            .unwrap()
            .unwrap();
        tokio::time::timeout(DEADLINE, buf.returned())
            .await
            .expect("the lease comes back on drop");
        let expect: Vec<u32> = (0..1024).map(|i| 7 + i).collect();
        assert_eq!(
            buf.to_vec().unwrap(),
            expect,
            "the exporter reads what was written"
        );
        local.close_and_wait().await;
    });
}

/// 200 named tensors (`f32` matrices and norms, an `i64` step) in one bundle, synced to a
/// child three times: each sync is one lease, every tensor arrives (its sum checked), the
/// lease comes back, and from the second sync on the child opens nothing (its import cache
/// keeps the allocation mapped).
#[test]
fn a_bundle_of_many_tensors_is_one_lease_and_its_next_sync_opens_nothing() {
    use baton::messages::{BundleLayout, DType, Shape};
    run(async {
        let node = host_node();
        let child = child(&node).await;
        let mut specs: Vec<(String, DType, Shape)> = (0..199)
            .map(|i| {
                let (what, shape) = if i % 2 == 0 {
                    ("weight", Shape::new([48, 40]).unwrap())
                } else {
                    ("norm", Shape::vector(40))
                };
                (format!("layers.{i}.{what}"), DType::F32, shape)
            })
            .collect();
        specs.push(("step".into(), DType::I64, Shape::vector(1)));
        let bundle = node
            .allocate_bundle(BundleLayout::packed(specs.clone()).unwrap())
            .unwrap();
        assert_eq!(bundle.layout().len(), 200);
        let sync = child.peer().remote::<SumBundle>("api.bundle");
        let mut opened = Vec::new();
        for step in 0..3i64 {
            let mut expect = Vec::new();
            for (i, (name, dtype, shape)) in specs.iter().enumerate() {
                let n = shape.elements().unwrap() as usize;
                if *dtype == DType::I64 {
                    bundle.write(name, &[step]).unwrap();
                    expect.push(step as f64);
                } else {
                    let v = step as f32 + i as f32 / 256.0;
                    bundle.write(name, &vec![v; n]).unwrap();
                    expect.push(f64::from(v) * n as f64);
                }
            }
            let (sums, opens) = sync
                .send(SumBundle {
                    weights: bundle.share(),
                })
                .await
                .unwrap()
                .unwrap();
            assert_eq!(sums, expect, "sync {step}");
            tokio::time::timeout(DEADLINE, bundle.buffer().returned())
                .await
                .expect("the bundle's one lease comes back");
            opened.push(opens);
        }
        assert_eq!(opened, [1, 1, 1], "the child's opens after each sync");
        assert_eq!(bundle.read::<i64>("step").unwrap(), [2]);
        assert!(matches!(
            bundle.read::<f32>("step"),
            Err(ActorError::WrongElementType { .. })
        ));
        assert!(matches!(
            bundle.write("nope", &[0f32]),
            Err(ActorError::NoSuchTensor { .. })
        ));
        finish(child).await;
    });
}

/// A peer's bundle layout is input: tensors that overlap or reach past the buffer are
/// refused (a typed error back to the caller), the lease comes back, and the link carries
/// the next, honest bundle.
#[test]
fn a_forged_bundle_layout_is_refused_and_the_link_carries_on() {
    use baton::messages::{BundleLayout, DType, Shape, TensorSpec};
    run(async {
        let node = host_node();
        let child = child(&node).await;
        let buf = node.allocate::<u8>(64).unwrap();
        let spec = |name: &str, len: u64, offset: u64| TensorSpec {
            name: name.into(),
            dtype: DType::F32,
            shape: Shape::vector(len),
            offset,
        };
        let forged = child.peer().remote::<ForgedBundle>("api.bundle");
        for (what, layout) in [
            ("overlapping", vec![spec("a", 8, 0), spec("b", 8, 16)]),
            (
                "past the buffer",
                vec![spec("a", 8, 0), spec("b", 1 << 20, 32)],
            ),
        ] {
            let got = forged
                .send(ForgedBundle {
                    layout,
                    buffer: buf.share(),
                })
                .await;
            match got {
                Err(ActorError::Remote(fault)) => println!("{what}: refused: {fault:?}"),
                Ok(Err(reason)) => {
                    assert!(reason.contains("need"), "{what}: {reason}");
                    println!("{what}: refused: {reason}");
                }
                other => panic!("{what}: {other:?}"),
            }
            tokio::time::timeout(DEADLINE, buf.returned())
                .await
                .expect("the forged bundle's lease comes back");
        }
        let bundle = node
            .allocate_bundle(BundleLayout::packed([("x", DType::F32, Shape::vector(4))]).unwrap())
            .unwrap();
        bundle.write("x", &[1f32, 2., 3., 4.]).unwrap();
        let (sums, _) = child
            .peer()
            .remote::<SumBundle>("api.bundle")
            .send(SumBundle {
                weights: bundle.share(),
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(sums, [10.0]);
        assert!(child.peer().is_connected());
        finish(child).await;
    });
}
