//! Two processes, one buffer: send 1 Mi `f32`s to a worker actor in a child process,
//! get their sum back, and wait for the lease to come back. `cargo run --example hello_buffer`
use actix::prelude::*;
use baton::{HostBackend, Node, RemoteMessage, Session, Shared};
use serde::{Deserialize, Serialize};
use std::{error::Error, process::Command, sync::Arc};

const N: usize = 1 << 20;

/// The message: a buffer of the sender's, leased to the receiver. Its reply is the sum.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "Result<f32, String>")]
struct Sum(Shared<f32>);

impl RemoteMessage for Sum {
    const NAME: &'static str = "hello.Sum";
}

struct Worker;

impl Actor for Worker {
    type Context = Context<Self>;
}

impl Handler<Sum> for Worker {
    type Result = Result<f32, String>;
    fn handle(&mut self, Sum(data): Sum, _: &mut Context<Self>) -> Self::Result {
        let lease = data.open().map_err(|e| e.to_string())?; // read-only, zero-copy
        Ok(lease.as_slice().map_err(|e| e.to_string())?.iter().sum())
    } // the lease drops here: it goes back to the sender
}

#[actix::main]
async fn main() -> Result<(), Box<dyn Error>> {
    if std::env::args().nth(1).as_deref() == Some("worker") {
        let (node, parent) = Node::join().await?; // the token and backend come from the parent
        node.register::<Sum>("worker", Worker.start().recipient());
        parent.closed().await; // serve until the parent closes the link
        return Ok(());
    }
    let node = Node::new(Session::generate()?, Arc::new(HostBackend::new()?));
    let mut worker = Command::new(std::env::current_exe()?);
    worker.arg("worker");
    let child = node.spawn_child(worker).await?; // started, linked, authenticated
    let data = node.allocate::<f32>(N)?;
    data.as_mut_slice()?.fill(0.5); // filled in place: the shared pages, no copy
    let worker = child.peer().remote::<Sum>("worker");
    let sum = worker.send(Sum(data.share())).await??; // leased to the worker, not copied
    data.returned().await; // the worker's lease is back: the buffer is ours alone again
    println!("sum of {N} halves: {sum}");
    assert_eq!(sum, N as f32 / 2.0);
    child.peer().close_and_wait().await;
    let status = child.wait().await?;
    assert!(status.success(), "worker: {status}");
    println!("hello_buffer: OK");
    Ok(())
}
