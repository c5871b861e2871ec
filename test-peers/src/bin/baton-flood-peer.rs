//! A peer that floods a node, for the bound tests (`tests/bounds.rs`). It holds the session
//! token and speaks the link protocol correctly, frame by frame, but abuses what the
//! protocol lets a peer control. One role per invocation; it prints one line saying how far
//! it got (`sent N`) once the node cuts it off (a write fails or the stream ends), and exits
//! 0; 1 with the reason on stderr if it could not start.
//!
//! - `pings SOCKET N`: send up to N `Ping`s without ever reading the `Pong`s.
//! - `calls SOCKET`: send `test.Nap` calls (10 ms each, 4 KiB replies) to `nap` as fast as
//!   the socket takes them, never reading the replies.
//! - `burst SOCKET N MS`: send N `test.Nap` calls (MS each, 16-byte replies) to `nap` at
//!   once, then read until all N replies came (at most a minute); `sent M` counts the replies.
//! - `offers SOCKET N`: send one call to `holder` (`test.Hold`) carrying N buffers (one
//!   host allocation of ours under N leases), then read until the stream ends.
//! - `leases SOCKET`: send bare `Offer`s of one buffer under fresh leases until cut off.

use baton::ipc::{Backend, HostBackend, Link, LinkConfig, Session};
use baton::messages::protocol::{Call, Offer};
use baton::messages::{DType, HandleMsg, Layout, LeaseId, Message, Shape};
use std::time::Duration;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn connect(socket: &str) -> Res<(Session, Link)> {
    let session = Session::from_env()?;
    let link = Link::connect(socket, &LinkConfig::new(session.clone()))?;
    Ok((session, link))
}

/// Appends `v` as the payload encoding (bincode's standard configuration) writes an
/// unsigned integer: one byte below 251, else a marker and the little-endian value.
fn varint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=250 => out.push(v as u8),
        251..=0xFFFF => {
            out.push(251);
            out.extend((v as u16).to_le_bytes());
        }
        0x1_0000..=0xFFFF_FFFF => {
            out.push(252);
            out.extend((v as u32).to_le_bytes());
        }
        _ => {
            out.push(253);
            out.extend(v.to_le_bytes());
        }
    }
}

fn call(id: u64, target: &str, type_name: &str, payload: Vec<u8>, offers: Vec<Offer>) -> Message {
    Message::Call(Call {
        id,
        target: target.into(),
        type_name: type_name.into(),
        payload,
        offers,
    })
}

/// A typed host buffer of ours (256 `u32`s) and its sealed handle.
fn buffer(session: &Session) -> Res<(baton::ipc::Allocation, HandleMsg)> {
    let backend = HostBackend::new()?;
    let alloc = backend.allocate(1024)?;
    let handle = alloc
        .handle(session)
        .layout(Layout::new(DType::U32, Shape::vector(256)))
        .build()?;
    Ok((alloc, handle))
}

/// Reads (and drops) frames until the stream ends, at most a minute.
fn drain(link: &mut Link) {
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        match link.recv_timeout(Duration::from_secs(60)) {
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

/// The command line: a role and its arguments.
#[derive(Debug, clap::Parser)]
#[command(
    name = "baton-flood-peer",
    about = "A peer that floods a node, for the bound tests: one role per invocation",
    after_help = "Roles: pings SOCKET N | calls SOCKET | burst SOCKET N MS | offers SOCKET N | leases SOCKET. The session token comes through the pipe named in BATON_TOKEN_FD."
)]
struct Cli {
    /// The role.
    role: String,
    /// Its arguments.
    args: Vec<String>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    let _ = Session::from_env();
    let args: Vec<String> = std::iter::once(cli.role).chain(cli.args).collect();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let result: Res<u64> = (|| match argv.as_slice() {
        ["pings", socket, n] => {
            let (_, mut link) = connect(socket)?;
            let n: u64 = n.parse()?;
            let mut sent = 0;
            while sent < n && link.send(&Message::Ping(sent), &[]).is_ok() {
                sent += 1;
            }
            drain(&mut link);
            Ok(sent)
        }
        ["calls", socket] => {
            let (_, mut link) = connect(socket)?;
            // `test.Nap { ms: 10, reply_bytes: 4096 }`.
            let mut payload = Vec::new();
            varint(&mut payload, 10);
            varint(&mut payload, 4096);
            let mut sent = 0;
            while link
                .send(
                    &call(sent + 1, "nap", "test.Nap", payload.clone(), vec![]),
                    &[],
                )
                .is_ok()
            {
                sent += 1;
            }
            Ok(sent)
        }
        ["burst", socket, n, ms] => {
            let (_, mut link) = connect(socket)?;
            let (n, ms): (u64, u64) = (n.parse()?, ms.parse()?);
            let mut payload = Vec::new();
            varint(&mut payload, ms);
            varint(&mut payload, 16);
            for id in 1..=n {
                link.send(&call(id, "nap", "test.Nap", payload.clone(), vec![]), &[])?;
            }
            let start = std::time::Instant::now();
            let mut answered = 0;
            while answered < n && start.elapsed() < Duration::from_secs(60) {
                match link.recv_timeout(Duration::from_secs(60)) {
                    Ok(received) if matches!(received.message, Message::Reply(_)) => answered += 1,
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            Ok(answered)
        }
        ["offers", socket, n] => {
            let (session, mut link) = connect(socket)?;
            let (_alloc, handle) = buffer(&session)?;
            let n: u64 = n.parse()?;
            let offers = (1..=n)
                .map(|i| Offer {
                    lease: LeaseId::new(i),
                    handle: handle.clone(),
                })
                .collect();
            // `test.Hold { buffers }`: a `Vec` of n buffers, each an index into the offers.
            let mut payload = Vec::new();
            varint(&mut payload, n);
            for i in 0..n {
                varint(&mut payload, i);
            }
            link.send(&call(1, "holder", "test.Hold", payload, offers), &[])?;
            drain(&mut link);
            Ok(n)
        }
        ["leases", socket] => {
            let (session, mut link) = connect(socket)?;
            let (_alloc, handle) = buffer(&session)?;
            let mut sent = 0;
            while link
                .send(
                    &Message::Offer(Box::new(Offer {
                        lease: LeaseId::new(sent + 1),
                        handle: handle.clone(),
                    })),
                    &[],
                )
                .is_ok()
            {
                sent += 1;
                if sent % 64 == 0 {
                    // Let the node's answers (releases of what it gives back, pings) not
                    // pile up on our side: read what is there, without waiting long.
                    while let Ok(r) = link.recv_timeout(Duration::from_millis(1)) {
                        drop(r);
                    }
                }
            }
            Ok(sent)
        }
        _ => Err(format!("unknown role {argv:?}").into()),
    })();
    match result {
        Ok(sent) => println!("sent {sent}"),
        Err(e) => {
            eprintln!("baton-flood-peer: {e}");
            std::process::exit(1);
        }
    }
}
