//! A user message type with two buffers, across two processes.
//!
//! The parent owns an image and a mask; it sends both in one typed message to a blender
//! actor in a child process (this binary, re-spawned with the role `blender`). The child
//! opens the two leases — the same memory the parent wrote, no copies — blends them into
//! a buffer of its own and replies with *that* buffer, which the parent opens in turn.
//!
//! ```text
//! cargo run --example typed_messages
//! ```
//!
//! It runs on CUDA device memory when a GPU is present, on host shared memory otherwise
//! (`BATON_BACKEND=host|cuda` forces one).

use actix::prelude::*;
use baton::actors::{Allocate, BufferOwner, Node, RemoteMessage, Shared};
use baton::messages::Shape;
use serde::{Deserialize, Serialize};
use std::error::Error;
use std::process::Command;
use std::time::Instant;

const W: u64 = 1920;
const H: u64 = 1080;

/// Blend `image` by `mask`, pixel by pixel.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Blended")]
struct Blend {
    image: Shared<f32>,
    mask: Shared<f32>,
}

impl RemoteMessage for Blend {
    const NAME: &'static str = "examples.Blend";
}

/// The blended image, in the blender's memory, and its mean.
#[derive(Debug, Serialize, Deserialize)]
struct Blended {
    out: Shared<f32>,
    mean: f32,
}

struct Blender {
    owner: Addr<BufferOwner>,
}

impl Actor for Blender {
    type Context = Context<Self>;
}

impl Handler<Blend> for Blender {
    type Result = ResponseFuture<Blended>;

    fn handle(&mut self, msg: Blend, _: &mut Context<Self>) -> Self::Result {
        let owner = self.owner.clone();
        Box::pin(async move {
            // Errors would surface as a failed call on the parent's side; keep it simple here.
            let image = msg
                .image
                .open()
                .expect("received")
                .to_vec()
                .expect("read image");
            let mask = msg
                .mask
                .open()
                .expect("received")
                .to_vec()
                .expect("read mask");
            let blended: Vec<f32> = image.iter().zip(&mask).map(|(i, m)| i * m).collect();
            let mean = blended.iter().sum::<f32>() / blended.len() as f32;
            let out = owner
                .send(Allocate::<f32>::new(Shape::new([H, W]).expect("rank 2")))
                .await
                .expect("owner alive")
                .expect("allocate");
            out.write_at(0, &blended).expect("write");
            println!("blender: blended {}x{} pixels, mean {mean:.4}", W, H);
            Blended {
                out: out.share(),
                mean,
            }
        })
    }
}

fn blender() -> Result<(), Box<dyn Error>> {
    System::new().block_on(async move {
        // A child's entry point: the session (from the token pipe the parent passed), the
        // parent's backend, and the link to the parent, in one call.
        let (node, parent) = Node::join().await?;
        let owner = BufferOwner::new(&node).start();
        node.register::<Blend>("blender", Blender { owner }.start().recipient());
        println!(
            "blender: linked to pid {} on the {} backend",
            parent.process().pid,
            node.backend().name()
        );
        // Serve until the parent hangs up.
        parent.closed().await;
        Ok::<_, Box<dyn Error>>(())
    })
}

fn parent() -> Result<(), Box<dyn Error>> {
    System::new().block_on(async {
        let node = Node::root()?;
        let mut blender = Command::new(std::env::current_exe()?);
        blender.arg("blender");
        // Started with the session's token (through a pipe) and our backend, and linked.
        let child = node.spawn_child(blender).await?;
        let owner = BufferOwner::new(&node).start();

        let shape = Shape::new([H, W]).ok_or("rank")?;
        let image = owner.send(Allocate::<f32>::new(shape.clone())).await??;
        let mask = owner.send(Allocate::<f32>::new(shape)).await??;
        let pixels = (W * H) as usize;
        image.write_at(0, &(0..pixels).map(|i| (i % 256) as f32 / 255.0).collect::<Vec<_>>())?;
        mask.write_at(0, &(0..pixels).map(|i| if (i / W as usize) % 2 == 0 { 1.0 } else { 0.5 }).collect::<Vec<_>>())?;
        println!("parent: {} backend, two {}x{} f32 buffers ({} MiB each)", node.backend().name(), W, H, (pixels * 4) >> 20);

        let peer = child.peer().clone();
        let blender = peer.remote::<Blend>("blender");
        let start = Instant::now();
        let reply = blender.send(Blend { image: image.share(), mask: mask.share() }).await?;
        let elapsed = start.elapsed();
        let out = reply.out.open()?;
        let got = out.to_vec()?;
        let mean = got.iter().sum::<f32>() / got.len() as f32;
        println!(
            "parent: got the blender's {:?} buffer back (lease {:?}), mean {mean:.4} (blender said {:.4}), round trip {elapsed:.2?}",
            out.shape(),
            out.id(),
            reply.mean
        );
        if (mean - reply.mean).abs() > 1e-3 {
            return Err("means differ".into());
        }
        drop(out);
        // Both awaited: blocking the actix thread here would keep the close from going out.
        peer.close_and_wait().await;
        let status = child.wait().await?;
        println!("parent: blender exited with {status}; typed messages: OK");
        Ok(())
    })
}

/// A typed message carrying two buffers goes to an actor in another process (this binary,
/// role `blender`), which reads them in place and answers with a buffer of its own.
#[derive(Debug, clap::Parser)]
#[command(name = "typed_messages")]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
}

#[derive(Debug, clap::Subcommand)]
enum Role {
    /// The blender process (the parent starts it): join the parent and serve `Blend`.
    #[command(hide = true)]
    Blender,
}

fn main() -> Result<(), Box<dyn Error>> {
    match <Cli as clap::Parser>::parse().role {
        Some(Role::Blender) => blender(),
        None => parent(),
    }
}
