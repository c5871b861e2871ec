//! 4 Mi `f32`s to a child's actor, a writable lease, the child SIGKILLed holding it.
use actix::prelude::*;
use baton::{HostBackend, LeaseMut, Node, Session, Shared, SharedMut, remote_message};
use serde::{Deserialize, Serialize};
use std::{env::current_exe, error::Error, process::Command, sync::Arc, time::Duration};

#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "Result<(f32, f32), String>")]
struct Stats(Shared<f32>); // read-only: mean and max back
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "()")]
struct Keep(SharedMut<f32>); // writable: the worker writes, then keeps it
remote_message!(Stats = "crash.Stats", Keep = "crash.Keep"); // their names on the wire

struct Worker(Vec<LeaseMut<f32>>);
impl Actor for Worker {
    type Context = Context<Self>;
}
impl Handler<Stats> for Worker {
    type Result = Result<(f32, f32), String>;
    fn handle(&mut self, Stats(data): Stats, _: &mut Context<Self>) -> Self::Result {
        let lease = data.open().map_err(|e| e.to_string())?;
        let xs = lease.as_slice().map_err(|e| e.to_string())?; // zero-copy
        let mean = xs.iter().map(|&x| f64::from(x)).sum::<f64>() / xs.len() as f64;
        Ok((mean as f32, xs.iter().copied().fold(f32::MIN, f32::max)))
    }
}
impl Handler<Keep> for Worker {
    type Result = ();
    fn handle(&mut self, Keep(data): Keep, _: &mut Context<Self>) {
        let mut lease = data.open().expect("a received buffer");
        lease.as_mut_slice().expect("host memory")[0] = -1.0; // the owner's memory
        self.0.push(lease); // kept: the reply tells the owner it is held
    }
}

#[actix::main]
async fn main() -> Result<(), Box<dyn Error>> {
    if Node::is_child() {
        let (node, parent) = Node::join().await?;
        let worker = Worker(Vec::new()).start();
        node.register::<Stats>("worker", worker.clone().recipient()); // one name serves
        node.register::<Keep>("worker", worker.recipient()); // both message types
        parent.closed().await; // serves until the parent goes
        return Ok(());
    }
    let node = Node::new(Session::generate()?, Arc::new(HostBackend::new()?));
    let mut child = node.spawn_child(Command::new(current_exe()?)).await?; // this program, linked
    let data = node.allocate::<f32>(4 << 20)?;
    let fill = |(i, x): (usize, &mut f32)| *x = (i % 64) as f32; // in place: no copy
    data.as_mut_slice()?.iter_mut().enumerate().for_each(fill);
    let stats = child.peer().remote::<Stats>("worker");
    let (mean, max) = stats.send(Stats(data.share())).await??;
    assert_eq!((mean, max), (31.5, 63.0), "mean and max");
    data.returned_within(Duration::from_secs(10)).await?;
    let keep = Keep(data.share_mut()); // answered once the worker holds the lease:
    child.peer().remote::<Keep>("worker").send(keep).await?;
    child.kill()?; // SIGKILL, with the writable lease out
    data.returned_within(Duration::from_secs(10)).await?; // reclaimed: ours again
    assert_eq!(data.as_mut_slice()?[0], -1.0, "the worker's write");
    println!("lease_crash: OK (mean {mean}, max {max}; lease reclaimed after SIGKILL)");
    Ok(())
}
