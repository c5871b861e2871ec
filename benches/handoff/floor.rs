//! Item 1, the floor: a raw Unix-socket ping-pong between two processes, blocking reads
//! and writes, each message as long as a real `Call` frame that carries one handle.

use crate::peer::{DEADLINE, PeerProcess};
use crate::report::Report;
use crate::stats::Summary;
use crate::{Config, Res};
use baton::Session;
use baton::ipc::Backend;
use baton::messages::codec::encode_frame;
use baton::messages::protocol::{Call, Offer};
use baton::messages::{ActorId, DType, Layout, LeaseId, Message, Shape};
use serde_json::json;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

/// The length of a `Call` frame carrying one offer of a buffer of `backend`, as the actor
/// layer sends it for the benchmark's `Handoff` message.
pub(crate) fn handle_frame_len(backend: &dyn Backend, session: &Session) -> Res<usize> {
    let alloc = backend.allocate(4096)?;
    let handle = alloc
        .handle(session)
        .actor(ActorId::new(1))
        .layout(Layout::new(DType::U8, Shape::vector(alloc.size() as u64)))
        .fd_slot(Some(0))
        .build()?;
    let call = Message::Call(Call {
        id: 1 << 20,
        target: crate::actor::CONSUMER.to_owned(),
        type_name: <crate::actor::Handoff as baton::actors::RemoteMessage>::NAME.to_owned(),
        // A `Handoff`: sequence number, flag, buffer index (varints).
        payload: vec![0x55; 6],
        offers: vec![Offer {
            lease: LeaseId::new(1 << 20),
            handle,
        }],
    });
    let mut frame = Vec::new();
    encode_frame(&call, usize::from(alloc.export_fd().is_some()), &mut frame)?;
    Ok(frame.len())
}

/// Accepts one connection, polling so that a peer that died cannot hang the run.
pub(crate) fn accept_from(listener: &UnixListener, peer: &mut PeerProcess) -> Res<UnixStream> {
    listener.set_nonblocking(true)?;
    let start = Instant::now();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                return Ok(stream);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if peer.exited() {
                    return Err("the peer exited before connecting".into());
                }
                if start.elapsed() > DEADLINE {
                    return Err("the peer did not connect".into());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

pub(crate) fn run(cfg: &Config, report: &mut Report) -> Res<()> {
    let session = Session::generate()?;
    // As long as the longest handle frame among the backends of this run.
    let mut size = 0;
    for &b in &cfg.backends {
        let backend = crate::actor::backend(b, "benchfloor")?;
        size = size.max(handle_frame_len(&*backend, &session)?);
    }
    let tmp = tempfile::tempdir()?;
    let path = tmp.path().join("floor.sock");
    let listener = UnixListener::bind(&path)?;
    let path_str = path.to_str().ok_or("path")?;
    let mut peer = PeerProcess::spawn(&session, "echo", &[path_str, &size.to_string()], &[])?;
    let mut sock = accept_from(&listener, &mut peer)?;
    let ping = vec![0xA5u8; size];
    let mut pong = vec![0u8; size];
    let (warm, n) = (cfg.samples(5_000), cfg.samples(50_000));
    let mut samples = Vec::with_capacity(n);
    for i in 0..warm + n {
        let t = Instant::now();
        sock.write_all(&ping)?;
        sock.read_exact(&mut pong)?;
        if i >= warm {
            samples.push(t.elapsed());
        }
    }
    drop(sock);
    peer.wait(DEADLINE)?;
    let s = Summary::of(&samples);
    report.emit_with(
        json!({
            "item": 1, "name": "floor", "backend": "-", "bytes": size,
            "label": format!("socket floor: blocking ping-pong, {size}-byte messages"),
        }),
        s.json(),
    );
    Ok(())
}

/// The echo peer: reads `size` bytes, writes them back, until end of stream.
pub(crate) fn echo(socket: &str, size: usize) -> Res<()> {
    let mut sock = UnixStream::connect(socket)?;
    let mut buf = vec![0u8; size];
    loop {
        match sock.read_exact(&mut buf) {
            Ok(()) => sock.write_all(&buf)?,
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
}
