//! A compositor on one host, workers on another, linked over TCP.
//!
//! The workers render tiles of an image into host buffers of their own and send each to the
//! compositor as a typed message (`Tile`, with a `Shared<u8>` field); the buffer crosses
//! hosts as a copy through the TCP transfer engine, into memory the compositor's node owns,
//! and the worker's buffer is free again once the bytes landed. The compositor checks
//! every pixel and assembles the image.
//!
//! ```text
//! cargo run --release --example two_hosts
//! ```
//!
//! The two "hosts" are two network namespaces joined by a veth pair where this process may
//! make them (as root, or in a user namespace of its own; with `ip`, `unshare` and
//! `nsenter`), else loopback TCP; each side has
//! its own host id (`BATON_HOST_ID`), so Baton treats them as two machines either way
//! (`--loopback` takes loopback TCP where namespaces could be made).
//! This binary re-runs itself for each role; the session's token goes to each child
//! through an inherited pipe (`Session::pass_to`, `Session::from_env`).

mod netns;

use actix::prelude::*;
use baton::Session;
use baton::actors::{Node, NodeConfig, RemoteMessage, Shared};
use baton::ipc::HostBackend;
use serde::{Deserialize, Serialize};
use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The image: `SIDE` × `SIDE` RGBA pixels, in tiles of `TILE` × `TILE`.
const SIDE: usize = 4096;
const TILE: usize = 512;
const TILES: usize = (SIDE / TILE) * (SIDE / TILE);
const WORKERS: usize = 2;
/// The longest any wait of this example may take.
const DEADLINE: Duration = Duration::from_secs(60);

/// The pixel at (x, y), as a worker renders it and the compositor checks it.
fn pixel(x: usize, y: usize) -> [u8; 4] {
    let (xf, yf) = (x as f32 / SIDE as f32, y as f32 / SIDE as f32);
    let r = (255.0 * xf) as u8;
    let g = (255.0 * yf) as u8;
    let b = ((x ^ y) & 0xff) as u8;
    [r, g, b, 255]
}

/// Tile `index`'s origin.
fn origin(index: usize) -> (usize, usize) {
    let per_row = SIDE / TILE;
    ((index % per_row) * TILE, (index / per_row) * TILE)
}

/// One rendered tile.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<(), String>")]
struct Tile {
    index: u32,
    worker: u32,
    pixels: Shared<u8>,
}

impl RemoteMessage for Tile {
    const NAME: &'static str = "examples.two_hosts.Tile";
}

/// What the compositor has so far.
#[derive(Default)]
struct Canvas {
    image: Vec<u8>,
    tiles: usize,
    bytes: u64,
    first: Option<Instant>,
    last: Option<Instant>,
}

struct Compositor {
    canvas: Arc<Mutex<Canvas>>,
}

impl Actor for Compositor {
    type Context = Context<Self>;
}

impl Handler<Tile> for Compositor {
    type Result = Result<(), String>;

    fn handle(&mut self, tile: Tile, _: &mut Context<Self>) -> Self::Result {
        let arrived = Instant::now();
        let lease = tile.pixels.open().map_err(|e| e.to_string())?;
        let bytes = lease.to_vec().map_err(|e| e.to_string())?;
        if bytes.len() != TILE * TILE * 4 {
            return Err(format!("tile {}: {} bytes", tile.index, bytes.len()));
        }
        let (x0, y0) = origin(tile.index as usize);
        let mut canvas = self.canvas.lock().unwrap();
        canvas.image.resize(SIDE * SIDE * 4, 0);
        for row in 0..TILE {
            let src = &bytes[row * TILE * 4..(row + 1) * TILE * 4];
            for (col, px) in src.chunks_exact(4).enumerate() {
                if px != pixel(x0 + col, y0 + row) {
                    return Err(format!(
                        "tile {} from worker {}: pixel ({}, {}) is wrong",
                        tile.index,
                        tile.worker,
                        x0 + col,
                        y0 + row
                    ));
                }
            }
            let at = ((y0 + row) * SIDE + x0) * 4;
            canvas.image[at..at + TILE * 4].copy_from_slice(src);
        }
        canvas.tiles += 1;
        canvas.bytes += bytes.len() as u64;
        canvas.first.get_or_insert(arrived);
        canvas.last = Some(Instant::now());
        Ok(())
    }
}

/// The compositor process: listens at `addr`, takes every tile from `WORKERS` workers,
/// checks them, prints what moved.
fn compositor(addr: String, path: String) -> Result<(), Box<dyn Error>> {
    let session = Session::from_env()?;
    System::new().block_on(async move {
        let node = Node::with_config(NodeConfig::new(session), Arc::new(HostBackend::new()?));
        let canvas = Arc::new(Mutex::new(Canvas::default()));
        let actor = Compositor {
            canvas: Arc::clone(&canvas),
        };
        node.register::<Tile>("compositor", actor.start().recipient());
        let mut listening = node.listen_tcp(addr.as_str())?;
        println!("listening {}", listening.local_addr());
        let start = Instant::now();
        let mut workers = Vec::new();
        for _ in 0..WORKERS {
            workers.push(listening.accept_timeout(DEADLINE).await?);
        }
        let mut hosts: Vec<String> = workers
            .iter()
            .filter_map(|w| w.info().host().map(|h| h.host.to_string()))
            .collect();
        while canvas.lock().unwrap().tiles < TILES {
            if start.elapsed() > DEADLINE {
                return Err(format!("not every tile came within {DEADLINE:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for worker in &workers {
            tokio::time::timeout(DEADLINE, worker.closed()).await?;
        }
        let canvas = canvas.lock().unwrap();
        let secs = canvas
            .last
            .zip(canvas.first)
            .map_or(0.0, |(l, f)| l.duration_since(f).as_secs_f64());
        let mib = canvas.bytes as f64 / f64::from(1 << 20);
        println!("compositor: path {path}");
        hosts.dedup();
        println!(
            "compositor: on {} ({}), workers on {}; control: Noise host links; data: the TCP transfer engine (copies)",
            std::env::var(baton::ipc::tcp::HOST_ID_ENV).unwrap_or_default(),
            node.config().hosts.host,
            hosts.join(", ")
        );
        println!(
            "compositor: {TILES} tiles of {TILE}x{TILE} RGBA checked, {mib:.0} MiB moved in {secs:.2} s ({:.0} MiB/s, tiles checked on arrival)",
            mib / secs.max(1e-9)
        );
        println!(
            "compositor: image digest {}",
            blake3::hash(&canvas.image).to_hex()
        );
        Ok(())
    })
}

/// A worker process: links to the compositor at `addr`, renders its share of the tiles
/// into buffers of its own and sends each.
fn worker(addr: String, id: usize) -> Result<(), Box<dyn Error>> {
    let session = Session::from_env()?;
    System::new().block_on(async move {
        let node = Node::with_config(NodeConfig::new(session), Arc::new(HostBackend::new()?));
        let peer = tokio::time::timeout(DEADLINE, node.connect_tcp(addr.as_str())).await??;
        let to = peer.remote::<Tile>("compositor");
        for index in (id..TILES).step_by(WORKERS) {
            let (x0, y0) = origin(index);
            let buf = node.allocate::<u8>(TILE * TILE * 4)?;
            let mut pixels = Vec::with_capacity(TILE * TILE * 4);
            for y in y0..y0 + TILE {
                for x in x0..x0 + TILE {
                    pixels.extend_from_slice(&pixel(x, y));
                }
            }
            buf.write_at(0, &pixels)?;
            let tile = Tile {
                index: index as u32,
                worker: id as u32,
                pixels: buf.share(),
            };
            to.send_timeout(tile, DEADLINE).await??;
            // The copy landed: our buffer's lease is back.
            buf.returned_within(DEADLINE).await?;
        }
        tokio::time::timeout(DEADLINE, peer.close_and_wait()).await?;
        Ok(())
    })
}

/// A child that is killed and reaped if it is still running when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Reaped {
    /// Waits for it to exit, at most `DEADLINE`.
    fn wait(&mut self, what: &str) -> Result<(), Box<dyn Error>> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.0.try_wait()? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("{what} exited with {status}").into())
                };
            }
            if start.elapsed() > DEADLINE {
                return Err(format!("{what} did not finish within {DEADLINE:?}").into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The launcher: makes the two hosts (or takes loopback), starts the compositor on the
/// first and the workers on the second, each with the session's token and its host id.
fn launcher(loopback: bool) -> Result<(), Box<dyn Error>> {
    let exe = std::env::current_exe()?;
    let session = Session::generate()?;
    let made = match loopback {
        true => Err("--loopback".to_owned()),
        false => netns::TwoHosts::make(),
    };
    let hosts = match made {
        Ok(hosts) => Some(hosts),
        Err(why) => {
            println!("two_hosts: no network namespaces ({why}): loopback TCP");
            None
        }
    };
    let (listen, path) = match &hosts {
        Some(h) => (
            format!("{}:0", netns::ADDRS[0]),
            format!(
                "network namespaces (made {}) joined by a veth pair ({} <-> {})",
                h.how(),
                netns::ADDRS[0],
                netns::ADDRS[1]
            ),
        ),
        None => ("127.0.0.1:0".to_owned(), "loopback TCP".to_owned()),
    };
    let command = |ns: usize| match &hosts {
        Some(h) => h.command(ns, &exe),
        None => Command::new(&exe),
    };
    let mut cmd = command(0);
    cmd.args(["compositor", &listen, &path])
        .env(baton::ipc::tcp::HOST_ID_ENV, "compositor-host")
        .stdout(Stdio::piped());
    session.pass_to(&mut cmd)?;
    let mut compositor = Reaped(cmd.spawn()?);
    let mut lines = BufReader::new(compositor.0.stdout.take().expect("piped")).lines();
    let addr = match lines.next() {
        Some(Ok(line)) if line.starts_with("listening ") => line["listening ".len()..].to_owned(),
        other => return Err(format!("the compositor did not start: {other:?}").into()),
    };
    let mut workers = Vec::new();
    for id in 0..WORKERS {
        let mut cmd = command(1);
        cmd.args(["worker", &addr, &id.to_string()])
            .env(baton::ipc::tcp::HOST_ID_ENV, "worker-host");
        session.pass_to(&mut cmd)?;
        workers.push(Reaped(cmd.spawn()?));
    }
    // The compositor's report, as it comes (it ends when the compositor exits).
    let report = std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            println!("{line}");
        }
    });
    for (id, w) in workers.iter_mut().enumerate() {
        w.wait(&format!("worker {id}"))?;
    }
    compositor.wait("the compositor")?;
    let _ = report.join();
    drop(hosts);
    println!("two_hosts: OK");
    Ok(())
}

/// A compositor and workers on two hosts (see the module docs). Roles other than the
/// launcher's are this binary re-run by the launcher.
#[derive(Debug, clap::Parser)]
#[command(name = "two_hosts")]
struct Cli {
    /// Link over loopback TCP even where network namespaces could be made.
    #[arg(long)]
    loopback: bool,
    #[command(subcommand)]
    role: Option<Role>,
}

#[derive(Debug, clap::Subcommand)]
enum Role {
    /// Listen at ADDR and composite the workers' tiles.
    #[command(hide = true)]
    Compositor { addr: String, path: String },
    /// Link to the compositor at ADDR and render tiles ID, ID + WORKERS, ….
    #[command(hide = true)]
    Worker { addr: String, id: usize },
}

fn main() -> Result<(), Box<dyn Error>> {
    let cli = <Cli as clap::Parser>::parse();
    match cli.role {
        Some(Role::Compositor { addr, path }) => compositor(addr, path),
        Some(Role::Worker { addr, id }) => worker(addr, id),
        None => launcher(cli.loopback),
    }
}
