//! The helper process of Baton's multi-process tests: one role per invocation.
//!
//! Tests spawn it (`peer::exe("baton-test-peer")`) with the session token in an inherited
//! pipe (`BATON_TOKEN_FD`, taken at the top of `main`) and a segment namespace in
//! `BATON_SHM_NAMESPACE`, never by `fork`. It speaks through the public API only, as a real
//! peer would. Exit status: 0 when the role did what it should, 1 with a message on stderr
//! otherwise.
//!
//! Roles:
//! - `import SOCKET EXPECT_HEX PAYLOAD_LEN`: connect, take one `Offer`, check the BLAKE3 of
//!   the first PAYLOAD_LEN bytes, write `ok:` + that digest right after them (the reply
//!   region), drop the mapping, send `Release`, wait for the listener to close.
//! - `import-hold SOCKET`: connect, open the offered buffer, answer `Ping(1)`, then hold the
//!   mapping until killed.
//! - `export-hold SOCKET SIZE`: connect, allocate SIZE bytes filled with 0xAB, offer them,
//!   then hold until killed.
//! - `half-frame-import SOCKET`: connect to an actor node, answer its first `Call` (open
//!   every offered buffer, reply with their count, as a `Hold` answer), then write the
//!   first half of a `Release` frame, print `half` on stdout, and hold until killed.
//! - `probe SOCKET`: connect to SOCKET with no credentials to speak of (tests run it as
//!   another uid), send a `Hello`, and print what happened — `connect-error: KIND`, or one
//!   `frame: KIND` (`refused: REASON` for a refusal) per frame received until the end of
//!   the stream. Exit status 0 whatever the outcome: the test judges it.
//! - `list DIR`: try to list DIR and print `listed: N` or `list-error: KIND`.
//! - `half-frame-export SOCKET`: connect, offer a 4096-byte segment in a bare `Offer`,
//!   write the first half of a second `Offer` frame, print `half`, and hold until killed.
//! - `token-hold SOCKET`: connect (proving the token arrived), spawn `token-probe` as a
//!   grandchild that dies with us, given nothing but what it inherits (environment and
//!   descriptors), print `grandchild PID WHAT` with the probe's answer, hold until killed.
//! - `token-probe`: print `probe no-token` if `Session::from_env` finds no token, else
//!   `probe token-found`; hold until killed.
//! - `import-silent SOCKET`: connect to an actor node, then never read a byte: whatever
//!   the node sends stays in flight. Holds the link open until killed.
//!
//! Lines this helper "prints" go to stdout, or, when `BATON_PEER_STATUS` names a file, are
//! appended to that file instead (for a supervisor's children, whose stdout is inherited).

use baton::ipc::link::Received;
use baton::ipc::{FrameFds, HostBackend, ImportCache, Link, LinkConfig, Session};
use baton::messages::codec::frame_bytes;
use baton::messages::protocol::{Offer, Payload, Release, Reply};
use baton::messages::{LeaseId, Message};
use std::io::Write;
use std::os::unix::net::UnixStream;
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

/// The next message within 30 s, but the fence inbox lane a CUDA node lends at the link's
/// start (this raw peer records no fences, so it needs none and writes none).
fn recv(link: &mut Link) -> baton::ipc::Result<Received> {
    loop {
        let received = link.recv_timeout(Duration::from_secs(30))?;
        if !matches!(received.message, Message::FenceInbox(_)) {
            return Ok(received);
        }
    }
}

fn take_offer(link: &mut Link) -> Res<(Offer, FrameFds)> {
    let received = recv(link)?;
    match received.message {
        Message::Offer(offer) => Ok((*offer, received.fds)),
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
    link.send(&Message::Release(Release::now(offer.lease)), &[])?;
    // Wait for the exporter to hang up, so it sees the Release before our EOF.
    match recv(&mut link) {
        Err(baton::ipc::Error::Closed) => Ok(()),
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
    let fds: Vec<_> = alloc.export_fd().into_iter().collect();
    link.send(
        &Message::Offer(Box::new(Offer {
            lease: LeaseId::new(1),
            handle,
        })),
        &fds,
    )?;
    loop {
        std::thread::sleep(Duration::from_secs(60));
        let _ = &alloc;
    }
}

/// The variable that sends [`say`]'s lines to a file instead of stdout.
const STATUS_ENV: &str = "BATON_PEER_STATUS";

/// Says `line`: on stdout, or appended to the file `BATON_PEER_STATUS` names.
fn say(line: &str) -> Res<()> {
    match std::env::var_os(STATUS_ENV) {
        Some(path) => {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?;
            file.write_all(format!("{line}\n").as_bytes())?;
        }
        None => {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{line}")?;
            out.flush()?;
        }
    }
    Ok(())
}

/// Writes the first half of `msg`'s frame straight to the socket (a peer killed in the
/// middle of a frame), then says so.
fn write_half_frame(link: &Link, msg: &Message) -> Res<()> {
    let frame = frame_bytes(msg, 0)?;
    let mut socket = UnixStream::from(link.as_fd().try_clone_to_owned()?);
    socket.write_all(&frame[..frame.len() / 2])?;
    say("half")
}

fn import_silent(socket: &str) -> Res<()> {
    let (_session, _link) = connect(socket)?;
    hold_forever()
}

/// Connects, then starts a subprocess (`sleep 600`) that inherits the link's socket — as a
/// process that starts workers without closing its descriptors does — and says
/// `holder <pid>`. Killed, this peer leaves its socket open in the holder: no end of
/// stream reaches the node, only its death.
fn inherit_hold(socket: &str) -> Res<()> {
    let (_session, link) = connect(socket)?;
    rustix::io::fcntl_setfd(link.as_fd(), rustix::io::FdFlags::empty())?;
    let holder = std::process::Command::new("sleep").arg("600").spawn()?;
    say(&format!("holder {}", holder.id()))?;
    hold_forever()
}

fn hold_forever() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

fn half_frame_import(socket: &str) -> Res<()> {
    let (session, mut link) = connect(socket)?;
    // The buffers may be device memory (the CUDA soak): open with the backend
    // `BATON_BACKEND` picks, and host segments too.
    let chosen = baton::ipc::select::auto()?;
    let mut backends = vec![chosen.clone()];
    if baton::ipc::Backend::kind(&*chosen) != baton::messages::BackendKind::Host {
        backends.push(Arc::new(HostBackend::new()?) as _);
    }
    let cache = ImportCache::new(session.clone(), backends);
    let received = recv(&mut link)?;
    let Message::Call(call) = received.message else {
        return Err(format!("expected a Call, got {}", received.message.kind()).into());
    };
    let mut fds = received.fds;
    let mut held = Vec::new();
    for offer in &call.offers {
        held.push(cache.open(&offer.handle, &mut fds)?);
    }
    // The answer to `Hold` is a usize: bincode's varint of a count below 251 is one byte.
    let count = u8::try_from(held.len())
        .ok()
        .filter(|&n| n < 251)
        .ok_or("too many offers")?;
    let reply = Message::Reply(Reply {
        id: call.id,
        outcome: Ok(Payload {
            bytes: vec![count],
            offers: Vec::new(),
        }),
    });
    link.send(&reply, &[])?;
    let first = call.offers.first().ok_or("a Call without offers")?.lease;
    write_half_frame(&link, &Message::Release(Release::now(first)))?;
    let _keep = held;
    hold_forever()
}

fn half_frame_export(socket: &str) -> Res<()> {
    let (session, mut link) = connect(socket)?;
    let backend = HostBackend::new()?;
    let alloc = baton::ipc::Backend::allocate(&backend, 4096)?;
    alloc.fill(0, 4096, 0xCD)?;
    let offer = |lease| -> Res<Message> {
        Ok(Message::Offer(Box::new(Offer {
            lease: LeaseId::new(lease),
            handle: alloc.handle(&session).build()?,
        })))
    };
    let fds: Vec<_> = alloc.export_fd().into_iter().collect();
    link.send(&offer(1)?, &fds)?;
    write_half_frame(&link, &offer(2)?)?;
    let _keep = alloc;
    hold_forever()
}

fn probe(socket: &str) -> Res<()> {
    use std::io::Read;
    let mut out = std::io::stdout().lock();
    let mut stream = match UnixStream::connect(socket) {
        Ok(s) => s,
        Err(e) => {
            writeln!(out, "connect-error: {:?}", e.kind())?;
            return Ok(());
        }
    };
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let hello = Message::Hello(baton::messages::protocol::Hello {
        version: baton::messages::PROTOCOL_VERSION,
        process: baton::ipc::process::current(),
        nonce: baton::messages::protocol::Nonce([7; 32]),
    });
    // The server may refuse before reading: a failed write is part of the story.
    if let Err(e) = stream.write_all(&frame_bytes(&hello, 0)?) {
        writeln!(out, "write-error: {:?}", e.kind())?;
    }
    let mut decoder = baton::messages::FrameDecoder::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                writeln!(out, "read-error: {:?}", e.kind())?;
                break;
            }
        };
        decoder.push(&buf[..n]);
        while let Some(frame) = decoder.next_frame()? {
            match frame.message {
                Message::Refused(r) => writeln!(out, "refused: {:?}", r.reason)?,
                other => writeln!(out, "frame: {}", other.kind())?,
            }
        }
    }
    writeln!(out, "end")?;
    Ok(())
}

fn token_hold(socket: &str) -> Res<()> {
    use std::io::BufRead;
    let (_session, _link) = connect(socket)?;
    // What a careless child does: spawn a helper with everything inherited.
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.arg("token-probe")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped());
    let mut probe = baton::ipc::spawn::spawn_tied(cmd)?;
    let stdout = probe.stdout.take().ok_or("no stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let answer = rx
        .recv_timeout(Duration::from_secs(30))
        .map_err(|_| "the probe did not answer within 30 s")?;
    let what = answer
        .trim()
        .strip_prefix("probe ")
        .ok_or("a garbled probe answer")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "grandchild {} {what}", probe.id())?;
    out.flush()?;
    drop(out);
    let _keep = probe;
    hold_forever()
}

fn token_probe() -> Res<()> {
    let what = match Session::from_env() {
        Ok(_) => "token-found",
        Err(_) => "no-token",
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "probe {what}")?;
    out.flush()?;
    drop(out);
    hold_forever()
}

fn list(dir: &str) -> Res<()> {
    match std::fs::read_dir(dir) {
        Ok(entries) => println!("listed: {}", entries.count()),
        Err(e) => println!("list-error: {:?}", e.kind()),
    }
    Ok(())
}

/// The command line: a role and its arguments, as the tests pass them.
#[derive(Debug, clap::Parser)]
#[command(
    name = "baton-test-peer",
    about = "The helper process of Baton's multi-process tests: one role per invocation",
    after_help = "Roles: import SOCKET EXPECT_HEX PAYLOAD_LEN | import-hold SOCKET | export-hold SOCKET SIZE | probe SOCKET | list DIR | half-frame-import SOCKET | half-frame-export SOCKET | token-hold SOCKET | token-probe | import-silent SOCKET (see the source's module docs). The session token comes through the pipe named in BATON_TOKEN_FD."
)]
struct Cli {
    /// The role.
    role: String,
    /// Its arguments.
    args: Vec<String>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    // The child's entry point: take the token (and close its pipe) before anything else.
    // Roles without a token (`probe`, `list`, `token-probe`) see the same answer later.
    let _ = Session::from_env();
    let args: Vec<String> = std::iter::once(cli.role).chain(cli.args).collect();
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
        ["probe", socket] => probe(socket),
        ["list", dir] => list(dir),
        ["half-frame-import", socket] => half_frame_import(socket),
        ["half-frame-export", socket] => half_frame_export(socket),
        ["token-hold", socket] => token_hold(socket),
        ["token-probe"] => token_probe(),
        ["import-silent", socket] => import_silent(socket),
        ["inherit-hold", socket] => inherit_hold(socket),
        _ => Err(format!("unknown role {argv:?}").into()),
    };
    if let Err(e) = result {
        eprintln!("baton-test-peer: {e}");
        std::process::exit(1);
    }
}
