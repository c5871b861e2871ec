//! A supervised service: a `ProcessSupervisor` keeps two worker processes running, each
//! joins with one call (`Node::join`), and each checksums its half of one buffer through a
//! read-only lease of that half (`Buffer::share_range`: zero-copy). Then one worker is SIGKILLed while it holds a lease: the
//! lease comes back, the supervisor restarts the worker, and the new run gets the work
//! again. `cargo run --example supervised_service` (CI runs it).
use actix::prelude::*;
use baton::actors::supervisor::{KillChild, Shutdown};
use baton::actors::{ChildPeer, ChildSpec, ProcessSupervisor, RestartPolicy, Strategy};
use baton::{HostBackend, Lease, Node, Peer, Session, Shared, remote_message};
use serde::{Deserialize, Serialize};
use std::{error::Error, ops::Range, sync::Arc, time::Duration};

const N: usize = 1 << 20;
/// Every wait here is bounded.
const WITHIN: Duration = Duration::from_secs(10);
const WORKERS: [&str; 2] = ["w0", "w1"];

/// Checksum `part`, a lease of elements `start..` of the owner's buffer.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "Result<u64, String>")]
struct Checksum {
    part: Shared<u32>,
    start: usize,
}
/// Keep a lease of the buffer until this process dies.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "()")]
struct Hold(Shared<u32>);
remote_message!(Checksum = "service.Checksum", Hold = "service.Hold");

/// The checksum both sides compute: position-weighted, so a shifted range shows.
fn checksum(xs: &[u32], start: usize) -> u64 {
    xs.iter().zip(start..).fold(0u64, |acc, (&x, i)| {
        acc.wrapping_add(u64::from(x).wrapping_mul(i as u64 + 1))
    })
}

struct Worker(Vec<Lease<u32>>);
impl Actor for Worker {
    type Context = Context<Self>;
}
impl Handler<Checksum> for Worker {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: Checksum, _: &mut Context<Self>) -> Self::Result {
        let lease = msg.part.open().map_err(|e| e.to_string())?; // read-only, zero-copy
        let xs = lease.as_slice().map_err(|e| e.to_string())?; // exactly our half
        Ok(checksum(xs, msg.start))
    } // the lease goes back here
}
impl Handler<Hold> for Worker {
    type Result = ();
    fn handle(&mut self, Hold(data): Hold, _: &mut Context<Self>) {
        self.0.push(data.open().expect("a received buffer")); // kept until we die
    }
}

/// The half of the buffer worker `i` checksums.
fn part(i: usize) -> Range<usize> {
    i * N / WORKERS.len()..(i + 1) * N / WORKERS.len()
}

/// Sends worker `i` its part of `data` and checks the answer against `expected`.
async fn work(
    peer: &Peer,
    data: &baton::Buffer<u32>,
    i: usize,
    expected: u64,
) -> Result<(), Box<dyn Error>> {
    let msg = Checksum {
        part: data.share_range(part(i))?,
        start: part(i).start,
    };
    let got = peer.remote::<Checksum>("worker").send(msg).await??;
    assert_eq!(got, expected, "{}'s checksum", WORKERS[i]);
    println!(
        "{} (pid {}): checksum {got:#x}",
        WORKERS[i],
        peer.process().pid
    );
    Ok(())
}

#[actix::main]
async fn main() -> Result<(), Box<dyn Error>> {
    if Node::is_child() {
        // A supervised worker: the token, the backend and the link come from the supervisor.
        let (node, parent) = Node::join().await?;
        let worker = Worker(Vec::new()).start();
        node.register::<Checksum>("worker", worker.clone().recipient());
        node.register::<Hold>("holder", worker.recipient());
        parent.closed().await;
        return Ok(());
    }
    let node = Node::new(Session::generate()?, Arc::new(HostBackend::new()?));
    let specs = WORKERS
        .iter()
        .map(|name| ChildSpec::this_exe(*name))
        .collect::<Result<Vec<_>, _>>()?;
    let policy = RestartPolicy::default();
    let sup = ProcessSupervisor::new(node.clone(), specs, Strategy::OneForOne, policy)
        .link_children()? // each child joins with Node::join
        .start();

    let data = node.allocate::<u32>(N)?;
    for (i, x) in data.as_mut_slice()?.iter_mut().enumerate() {
        *x = (i as u32).wrapping_mul(2_654_435_761);
    }
    let all = data.to_vec()?;
    let expected: Vec<u64> = (0..WORKERS.len())
        .map(|i| checksum(&all[part(i)], part(i).start))
        .collect();
    let mut peers = Vec::new();
    for (i, name) in WORKERS.iter().enumerate() {
        let peer = sup.send(ChildPeer::new(*name, WITHIN)).await??; // once it has joined
        work(&peer, &data, i, expected[i]).await?;
        peers.push(peer);
    }
    data.returned_within(WITHIN).await?; // every lease back

    // w1 holds a lease and is SIGKILLed: its lease comes back, and the supervisor restarts it.
    let killed = peers[1].process();
    peers[1]
        .remote::<Hold>("holder")
        .send(Hold(data.share()))
        .await?;
    assert_eq!(data.leases_out(), 1, "w1 holds a lease");
    sup.send(KillChild(WORKERS[1].into())).await?;
    data.returned_within(WITHIN).await?;
    println!(
        "w1 (pid {}) killed holding a lease: the lease is back",
        killed.pid
    );
    let again = ChildPeer::new(WORKERS[1], WITHIN).replacing(killed);
    let restarted = sup.send(again).await??;
    assert_ne!(restarted.process(), killed);
    work(&restarted, &data, 1, expected[1]).await?; // the restarted worker gets the work again

    sup.send(Shutdown).await?; // kills and reaps the workers
    println!("supervised_service: OK");
    Ok(())
}
