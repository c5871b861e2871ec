//! The helper process of Baton's forwarding tests (`tests/forwarding.rs`).
//!
//! - `baton-relay-peer relay PARENT_SOCKET DIR`: B. Listens at `DIR/relay.sock` for the
//!   holder, then connects to its parent (A). Its `relay` actor ([`ForwardTo`]) keeps the
//!   leases it receives and forwards each to a linked process; `relay.drop` ([`DropOwn`])
//!   drops its own. Runs until killed.
//! - `baton-relay-peer sink SOCKET [release | drop-on=FILE]`: C. Connects to SOCKET (B's)
//!   and takes the buffers forwarded to it from its inbox. For each it prints
//!   `got lease=<id> exporter=<pid> sum=<sum of the u32s>`; then, with `release`, drops it
//!   at once, else keeps it — printing `first=<value>` whenever the first element changes
//!   (host memory: read through the mapping, so also once its relay is gone; device
//!   memory: through the lease) — until FILE exists. Once
//!   it dropped a lease it pings its relay twice (the second ping travels behind the
//!   `Release`) and prints `released lease=<id> link=up|down`. Prints `ready` once linked.
//!   Runs until killed.
//!
//! The session token comes through the pipe named in `BATON_TOKEN_FD`.

#[path = "../../../tests/support/relay_msgs.rs"]
mod relay_msgs;

use actix::prelude::*;
use baton::actors::{Lease, Node, Offered};
use relay_msgs::*;
use std::io::Write;
use std::time::Duration;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// B's actor.
struct Relay {
    node: Node,
    own: Vec<Lease<u32>>,
}

impl Actor for Relay {
    type Context = Context<Self>;
}

impl Handler<ForwardTo> for Relay {
    type Result = ResponseActFuture<Self, Result<Vec<u64>, String>>;

    fn handle(&mut self, msg: ForwardTo, _ctx: &mut Context<Self>) -> Self::Result {
        let Some(to) = self
            .node
            .peers()
            .into_iter()
            .find(|p| p.process().pid == msg.to_pid)
        else {
            return Box::pin(fut::ready(Err(format!("no link to pid {}", msg.to_pid))));
        };
        let mut leases = Vec::new();
        for shared in msg.buffers {
            match shared.open() {
                Ok(lease) => leases.push(lease),
                Err(e) => return Box::pin(fut::ready(Err(e.to_string()))),
            }
        }
        let forwards: Vec<_> = leases.iter().map(|l| l.forward_to(&to)).collect();
        Box::pin(
            async move {
                let mut ids = Vec::new();
                for f in forwards {
                    ids.push(f.await.map_err(|e| e.to_string())?.get());
                }
                Ok(ids)
            }
            .into_actor(self)
            .map(move |result, act, _| {
                act.own.extend(leases);
                result
            }),
        )
    }
}

impl Handler<DropOwn> for Relay {
    type Result = usize;

    fn handle(&mut self, _: DropOwn, _ctx: &mut Context<Self>) -> usize {
        let n = self.own.len();
        self.own.clear();
        n
    }
}

/// C's actor.
struct Sink {
    node: Node,
    release: bool,
    /// Drop the kept leases once this file exists.
    drop_on: Option<std::path::PathBuf>,
    /// Kept leases, with where each is mapped in host memory (`None`: device memory, read
    /// through the lease) and its first value last printed.
    kept: Vec<(Lease<u8>, Option<usize>, u32)>,
}

impl Sink {
    /// Drops `lease`, then reports whether the link to the relay survived its release.
    fn release(&mut self, lease: Lease<u8>, ctx: &mut Context<Self>) {
        let id = lease.id().get();
        drop(lease);
        let relay = self.node.peers().into_iter().next();
        ctx.spawn(
            async move {
                let up = match relay {
                    // The first pong comes back after the `Release` was queued: the second
                    // ping follows it on the link.
                    Some(p) => p.ping().await.is_ok() && p.ping().await.is_ok(),
                    None => false,
                };
                say(&format!(
                    "released lease={id} link={}",
                    if up { "up" } else { "down" }
                ));
            }
            .into_actor(self),
        );
    }
}

impl Actor for Sink {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(Duration::from_millis(10), |act, ctx| {
            if act.drop_on.as_ref().is_some_and(|f| f.exists()) {
                act.drop_on = None;
                for (lease, ..) in std::mem::take(&mut act.kept) {
                    act.release(lease, ctx);
                }
            }
            for (lease, addr, last) in &mut act.kept {
                let now = match addr {
                    // SAFETY: the lease is kept (its import-cache view keeps the host
                    // mapping at `addr`, at least 4 bytes long, page-aligned), also once
                    // orphaned. The exporter may write it: a volatile read of a plain
                    // integer sees some value.
                    Some(addr) => unsafe { std::ptr::read_volatile(*addr as *const u32) },
                    None => {
                        let mut first = [0u8; 4];
                        match lease.read_into(0, &mut first) {
                            Ok(()) => u32::from_ne_bytes(first),
                            // Orphaned: nothing new to read.
                            Err(_) => *last,
                        }
                    }
                };
                if now != *last {
                    *last = now;
                    say(&format!("first={now}"));
                }
            }
        });
    }
}

impl Handler<Offered> for Sink {
    type Result = ();

    fn handle(&mut self, msg: Offered, ctx: &mut Context<Self>) {
        let lease = msg.buffer.open().expect("received");
        let bytes = lease.to_vec().expect("read the forwarded buffer");
        let sum: u64 = bytes
            .chunks_exact(4)
            .map(|w| u64::from(u32::from_ne_bytes(w.try_into().expect("4 bytes"))))
            .sum();
        say(&format!(
            "got lease={} exporter={} sum={sum}",
            lease.id().get(),
            lease.exporter().process.pid
        ));
        if self.release {
            self.release(lease, ctx);
            return;
        }
        let addr = match lease.ptr() {
            Ok(baton::ipc::MemPtr::Host(addr)) => Some(addr as usize),
            _ => None,
        };
        let first = u32::from_ne_bytes(bytes[..4].try_into().expect("4 bytes"));
        self.kept.push((lease, addr, first));
    }
}

/// The command line.
#[derive(Debug, clap::Parser)]
#[command(
    name = "baton-relay-peer",
    about = "The helper process of Baton's forwarding tests: a relay (B) or a holder (C)",
    after_help = "Usage: baton-relay-peer relay PARENT_SOCKET DIR | baton-relay-peer sink SOCKET [release]. The session token comes through the pipe named in BATON_TOKEN_FD."
)]
struct Cli {
    /// `relay` or `sink`.
    #[arg(value_parser = ["relay", "sink"])]
    role: String,
    /// The socket to connect to.
    socket: String,
    /// `relay`: the directory to listen in; `sink`: `release` to give buffers back at once,
    /// `drop-on=FILE` to give them back once FILE exists.
    extra: Option<String>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    if let Err(e) = baton::Session::from_env() {
        eprintln!("baton-relay-peer: {e}");
        std::process::exit(1);
    }
    let system = System::new();
    let result = system.block_on(async move {
        let node = Node::from_env()?;
        match cli.role.as_str() {
            "relay" => {
                let dir = cli.extra.expect("a directory to listen in");
                let dir = baton::SocketDir::create(dir)?;
                let listening = node.listen(&dir, "relay.sock")?;
                // Kept for the life of the process.
                std::mem::forget(listening);
                let relay = Relay {
                    node: node.clone(),
                    own: Vec::new(),
                }
                .start();
                node.register::<ForwardTo>("relay", relay.clone().recipient());
                node.register::<DropOwn>("relay.drop", relay.recipient());
                node.connect(&cli.socket).await?;
            }
            _ => {
                let sink = Sink {
                    node: node.clone(),
                    release: cli.extra.as_deref() == Some("release"),
                    drop_on: cli
                        .extra
                        .as_deref()
                        .and_then(|e| e.strip_prefix("drop-on="))
                        .map(Into::into),
                    kept: Vec::new(),
                }
                .start();
                node.set_inbox(sink.recipient());
                node.connect(&cli.socket).await?;
                say("ready");
            }
        }
        Ok::<_, baton::actors::ActorError>(())
    });
    if let Err(e) = result {
        eprintln!("baton-relay-peer: {e}");
        std::process::exit(1);
    }
    if let Err(e) = system.run() {
        eprintln!("baton-relay-peer: {e}");
        std::process::exit(1);
    }
}
