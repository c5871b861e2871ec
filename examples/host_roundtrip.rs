//! Two processes share 64 MiB of host memory with zero copies.
//!
//! The exporter (this process) allocates a shared buffer, fills it, and offers its sealed
//! handle over an authenticated Unix-socket link to an importer (this same binary,
//! re-spawned with the role `importer`). The importer maps the buffer, checks every byte,
//! writes a reply into it, drops its mapping and sends `Release`. The exporter reads the
//! reply from its own memory, frees the buffer, and checks nothing is left: no memfd of
//! ours mapped or open here, no segment of ours in /dev/shm.
//!
//! On Linux the buffer is a sealed memfd whose descriptor travels beside the offer
//! (`BATON_HOST=named` makes it a named segment in /dev/shm instead).
//!
//! ```text
//! cargo run --example host_roundtrip
//! ```

use baton::Session;
use baton::ipc::{
    Backend, FrameFds, HostBackend, ImportCache, Link, LinkConfig, Listener, SocketDir, host,
};
use baton::messages::protocol::{Offer, Release};
use baton::messages::{LeaseId, Message};
use std::error::Error;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SIZE: usize = 64 << 20;
const REPLY_AT: usize = SIZE - 4096;

/// Two processes share 64 MiB of host memory with zero copies: this one exports a
/// buffer, a second one (this binary, role `importer`) maps it, checks it and answers in it.
#[derive(Debug, clap::Parser)]
#[command(name = "host_roundtrip")]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
}

#[derive(Debug, clap::Subcommand)]
enum Role {
    /// The importer (the exporter starts it): link to SOCKET, map the offered buffer.
    #[command(hide = true)]
    Importer {
        /// The exporter's socket.
        socket: String,
    },
}

fn main() -> Result<(), Box<dyn Error>> {
    use std::io::IsTerminal;
    let cli = <Cli as clap::Parser>::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match cli.role {
        Some(Role::Importer { socket }) => importer(&socket),
        None => exporter(),
    }
}

fn exporter() -> Result<(), Box<dyn Error>> {
    let session = Session::generate()?;
    let tmp = std::env::temp_dir().join(format!("baton-example-{}", std::process::id()));
    let dir = SocketDir::create(&tmp)?;
    let listener = Listener::bind(&dir, "exporter.sock", LinkConfig::new(session.clone()))?;
    let backend = HostBackend::new()?;

    let alloc = backend.allocate(SIZE)?;
    let payload: Vec<u8> = (0..REPLY_AT).map(|i| (i % 251) as u8).collect();
    alloc.write(0, &payload)?;
    let digest = blake3::hash(&payload);
    println!(
        "exporter: {} MiB host buffer {:?} filled, digest {}",
        SIZE >> 20,
        alloc.id(),
        &digest.to_hex()[..16]
    );

    let mut importer = Command::new(std::env::current_exe()?);
    importer.args([
        "importer",
        listener.path().to_str().ok_or("socket path is not UTF-8")?,
    ]);
    session.pass_to(&mut importer)?;
    let mut child = importer.spawn()?;
    let mut link = listener.accept()?;
    println!(
        "exporter: link up with pid {} (same uid, token proven)",
        link.peer().process.pid
    );

    let start = Instant::now();
    let handle = alloc.handle(&session).build()?;
    let lease = LeaseId::new(1);
    // A memfd's descriptor goes beside the frame (slot 0); a named segment needs none.
    let fds: Vec<_> = alloc.export_fd().into_iter().collect();
    link.send(&Message::Offer(Box::new(Offer { lease, handle })), &fds)?;
    let answer = link.recv_timeout(Duration::from_secs(30))?.message;
    let elapsed = start.elapsed();
    if answer != Message::Release(Release::now(lease)) {
        return Err(format!("expected Release, got {}", answer.kind()).into());
    }
    let mut reply = [0u8; 35];
    alloc.read(REPLY_AT, &mut reply)?;
    if &reply[..3] != b"ok:" || reply[3..] != *digest.as_bytes() {
        return Err("the importer's reply does not match".into());
    }
    println!(
        "exporter: importer verified all {} MiB and replied in {elapsed:.2?} (offer -> release)",
        SIZE >> 20
    );

    drop(link);
    let status = child.wait()?;
    drop(alloc);
    let me = std::process::id();
    let segments = host::list_segments(backend.namespace())?
        .into_iter()
        .filter(|s| s.owner_pid == me)
        .count();
    let memfds = host::memfd_usage(me, backend.namespace())?;
    let left = segments + memfds.mappings + memfds.fds;
    println!(
        "exporter: importer exited with {status}; {} host memory; left here: {segments} segments, {} memfd mappings, {} memfd descriptors",
        backend.flavor().name(),
        memfds.mappings,
        memfds.fds
    );
    // The socket goes with its listener; then the directory is empty and goes too.
    drop(listener);
    std::fs::remove_dir(&tmp)?;
    if !status.success() || left != 0 {
        return Err("round trip failed".into());
    }
    println!("host round trip: OK");
    Ok(())
}

fn importer(socket: &str) -> Result<(), Box<dyn Error>> {
    let session = Session::from_env()?;
    let mut link = Link::connect(socket, &LinkConfig::new(session.clone()))?;
    let cache = ImportCache::new(session, [Arc::new(HostBackend::new()?) as Arc<dyn Backend>]);
    let received = link.recv_timeout(Duration::from_secs(30))?;
    let Message::Offer(offer) = received.message else {
        return Err("expected an offer".into());
    };
    let mut fds: FrameFds = received.fds;
    let buffer = cache.open(&offer.handle, &mut fds)?;
    let mut payload = vec![0u8; REPLY_AT];
    buffer.read(0, &mut payload)?;
    let digest = blake3::hash(&payload);
    println!(
        "importer: mapped {:?}, {} MiB, digest {}",
        offer.handle.alloc,
        buffer.len() >> 20,
        &digest.to_hex()[..16]
    );
    let mut reply = b"ok:".to_vec();
    reply.extend_from_slice(digest.as_bytes());
    buffer.write(REPLY_AT, &reply)?;
    drop(buffer);
    link.send(&Message::Release(Release::now(offer.lease)), &[])?;
    // Stay until the exporter hangs up, so our Release arrives before our EOF.
    let _ = link.recv_timeout(Duration::from_secs(30));
    Ok(())
}
