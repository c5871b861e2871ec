//! The helper process of Baton's multi-process tests: one role per invocation.
//!
//! Tests spawn it (`env!("CARGO_BIN_EXE_baton-test-peer")`) with the session token in
//! `BATON_TOKEN` and a segment namespace in `BATON_SHM_NAMESPACE`, never by `fork`. It
//! speaks through the public API only, as a real peer would. Exit status: 0 when the role
//! did what it should, 1 with a message on stderr otherwise.
//!
//! Roles:
//! - `import SOCKET EXPECT_HEX PAYLOAD_LEN`: connect, take one `Offer`, check the BLAKE3 of
//!   the first PAYLOAD_LEN bytes, write `ok:` + that digest right after them (the reply
//!   region), drop the mapping, send `Release`, wait for the listener to close.
//! - `import-hold SOCKET`: connect, open the offered buffer, answer `Ping(1)`, then hold the
//!   mapping until killed.
//! - `export-hold SOCKET SIZE`: connect, allocate SIZE bytes filled with 0xAB, offer them,
//!   then hold until killed.

use baton::ipc::{FrameFds, HostBackend, ImportCache, Link, LinkConfig, Session};
use baton::messages::protocol::{Offer, Release};
use baton::messages::{LeaseId, Message};
use std::sync::Arc;
use std::time::Duration;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn connect(socket: &str) -> Res<(Session, Link)> {
    let session = Session::from_env()?;
    let link = Link::connect(socket, &LinkConfig::new(session.clone()))?;
    Ok((session, link))
}

fn cache(session: &Session) -> Res<ImportCache> {
    Ok(ImportCache::new(
        session.clone(),
        [Arc::new(HostBackend::new()?) as _],
    ))
}

fn take_offer(link: &mut Link) -> Res<(Offer, FrameFds)> {
    let received = link.recv_timeout(Duration::from_secs(30))?;
    match received.message {
        Message::Offer(offer) => Ok((offer, received.fds)),
        other => Err(format!("expected an Offer, got {}", other.kind()).into()),
    }
}

fn import(socket: &str, expect_hex: &str, payload_len: usize) -> Res<()> {
    let (session, mut link) = connect(socket)?;
    let cache = cache(&session)?;
    let (offer, mut fds) = take_offer(&mut link)?;
    let buffer = cache.open(&offer.handle, &mut fds)?;
    let mut bytes = vec![0u8; payload_len];
    buffer.read(0, &mut bytes)?;
    let digest = blake3::hash(&bytes);
    if digest.to_hex().as_str() != expect_hex {
        return Err(format!("checksum mismatch: got {}", digest.to_hex()).into());
    }
    let mut reply = b"ok:".to_vec();
    reply.extend_from_slice(digest.as_bytes());
    buffer.write(payload_len, &reply)?;
    drop(buffer);
    if cache.stats().live != 0 {
        return Err("mapping still open after the guard dropped".into());
    }
    link.send(&Message::Release(Release { lease: offer.lease }), &[])?;
    // Wait for the exporter to hang up, so it sees the Release before our EOF.
    match link.recv_timeout(Duration::from_secs(30)) {
        Err(baton::Error::Closed) => Ok(()),
        Err(e) => Err(e.into()),
        Ok(r) => Err(format!("unexpected {}", r.message.kind()).into()),
    }
}

fn import_hold(socket: &str) -> Res<()> {
    let (session, mut link) = connect(socket)?;
    let cache = cache(&session)?;
    let (offer, mut fds) = take_offer(&mut link)?;
    let buffer = cache.open(&offer.handle, &mut fds)?;
    let mut first = [0u8; 1];
    buffer.read(0, &mut first)?;
    link.send(&Message::Ping(1), &[])?;
    loop {
        std::thread::sleep(Duration::from_secs(60));
        let _ = &buffer;
    }
}

fn export_hold(socket: &str, size: usize) -> Res<()> {
    let (session, mut link) = connect(socket)?;
    let backend = HostBackend::new()?;
    let alloc = baton::ipc::Backend::allocate(&backend, size)?;
    alloc.fill(0, size, 0xAB)?;
    let handle = alloc.handle(&session).build()?;
    link.send(
        &Message::Offer(Offer {
            lease: LeaseId::new(1),
            handle,
        }),
        &[],
    )?;
    loop {
        std::thread::sleep(Duration::from_secs(60));
        let _ = &alloc;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match argv.as_slice() {
        ["import", socket, expect, len] => len
            .parse()
            .map_err(|e| format!("bad length: {e}").into())
            .and_then(|len| import(socket, expect, len)),
        ["import-hold", socket] => import_hold(socket),
        ["export-hold", socket, size] => size
            .parse()
            .map_err(|e| format!("bad size: {e}").into())
            .and_then(|size| export_hold(socket, size)),
        _ => Err(format!("unknown role {argv:?}").into()),
    };
    if let Err(e) = result {
        eprintln!("baton-test-peer: {e}");
        std::process::exit(1);
    }
}
