//! Two processes share host memory over an authenticated link: a full round trip, and
//! SIGKILL on either side.

#[path = "support/peer.rs"]
mod peer;

use baton::Session;
use baton::ipc::Error;
use baton::ipc::{Backend, HostBackend, ImportCache, LinkConfig, Listener, Received, host};
use baton::messages::protocol::{Offer, Release};
use baton::messages::{ActorId, LeaseId, Message};
use peer::{Peer, accept_from, namespace, segments, socket_dir};
use std::sync::Arc;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(30);

/// Bytes that differ everywhere, so a checksum catches any misplaced page.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

#[test]
fn a_64_mib_buffer_goes_to_another_process_and_a_reply_comes_back() {
    let ns = namespace("rt");
    let before = segments(&ns);
    let session = Session::generate().unwrap();
    let (_tmp, dir) = socket_dir();
    let listener = Listener::bind(&dir, "exporter.sock", LinkConfig::new(session.clone())).unwrap();
    let backend = HostBackend::with_namespace(&ns).unwrap();

    const SIZE: usize = 64 << 20;
    const REPLY: usize = 4096;
    let payload_len = SIZE - REPLY;
    let alloc = backend.allocate(SIZE).unwrap();
    let payload = pattern(payload_len, 0x5eed);
    alloc.write(0, &payload).unwrap();
    let digest = blake3::hash(&payload);

    let sock = listener.path().to_str().unwrap().to_owned();
    let mut child = Peer::spawn(
        &session,
        &ns,
        &[
            "import",
            &sock,
            digest.to_hex().as_str(),
            &payload_len.to_string(),
        ],
    );
    let mut link = accept_from(&listener, &mut child, DEADLINE).unwrap();
    assert_eq!(
        link.peer().process.pid,
        child.pid(),
        "the link is authenticated as the child"
    );

    let handle = alloc
        .handle(&session)
        .actor(ActorId::new(1))
        .build()
        .unwrap();
    let lease = LeaseId::new(1);
    link.send(&Message::Offer(Box::new(Offer { lease, handle })), &[])
        .unwrap();

    let Received { message, .. } = link.recv_timeout(DEADLINE).unwrap();
    assert_eq!(message, Message::Release(Release::now(lease)));
    let mut reply = [0u8; 35];
    alloc.read(payload_len, &mut reply).unwrap();
    assert_eq!(&reply[..3], b"ok:");
    assert_eq!(
        &reply[3..],
        digest.as_bytes(),
        "the importer saw every byte we wrote"
    );

    drop(link);
    assert!(child.wait(DEADLINE).success());
    assert_eq!(segments(&ns), before + 1);
    drop(alloc);
    assert_eq!(
        segments(&ns),
        before,
        "the exporter's drop removed its segment"
    );
}

/// Lines of `/proc/<pid>/maps` that map a segment of `ns` (also once unlinked: "(deleted)").
fn mappings_of(pid: &str, ns: &str) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&format!("/dev/shm/{ns}.")))
        .count()
}

/// The importer is SIGKILLed while it maps our segment: we see the link end as a clean close
/// (`Closed`: not a timeout, not a cut-off frame), and our free then leaves nothing — no name
/// in `/dev/shm`, no mapping in this process. (At this level nothing tracks importers: the
/// free would unlink the name just the same with the importer alive. That the exporter's
/// free waits for the importer is the lease ledger's promise, tested in `actors_protocol`.)
#[test]
fn importer_sigkill_while_mapped_ends_the_link_cleanly_and_our_free_leaves_nothing() {
    let ns = namespace("ik");
    let before = segments(&ns);
    let session = Session::generate().unwrap();
    let (_tmp, dir) = socket_dir();
    let listener = Listener::bind(&dir, "x.sock", LinkConfig::new(session.clone())).unwrap();
    let backend = HostBackend::with_namespace(&ns).unwrap();
    let alloc = backend.allocate(1 << 20).unwrap();

    let sock = listener.path().to_str().unwrap().to_owned();
    let mut child = Peer::spawn(&session, &ns, &["import-hold", &sock]);
    let mut link = accept_from(&listener, &mut child, DEADLINE).unwrap();
    let handle = alloc.handle(&session).build().unwrap();
    link.send(
        &Message::Offer(Box::new(Offer {
            lease: LeaseId::new(7),
            handle,
        })),
        &[],
    )
    .unwrap();
    assert_eq!(
        link.recv_timeout(DEADLINE).unwrap().message,
        Message::Ping(1)
    );

    // The child really maps the segment, and so do we.
    assert_eq!(
        mappings_of(&child.pid().to_string(), &ns),
        1,
        "child maps the segment"
    );
    assert_eq!(mappings_of("self", &ns), 1, "we map our allocation");

    child.kill9();
    assert!(matches!(link.recv_timeout(DEADLINE), Err(Error::Closed)));
    drop(alloc);
    assert_eq!(
        segments(&ns),
        before,
        "nothing left after the exporter freed"
    );
    assert_eq!(
        mappings_of("self", &ns),
        0,
        "the free unmapped our allocation"
    );
}

#[test]
fn exporter_sigkill_closes_the_link_and_the_sweep_removes_its_segment() {
    let ns = namespace("ek");
    let before = segments(&ns);
    let session = Session::generate().unwrap();
    let (_tmp, dir) = socket_dir();
    let listener = Listener::bind(&dir, "importer.sock", LinkConfig::new(session.clone())).unwrap();
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::with_namespace(&ns).unwrap());
    let cache = ImportCache::new(session.clone(), [backend]);

    let sock = listener.path().to_str().unwrap().to_owned();
    let mut child = Peer::spawn(&session, &ns, &["export-hold", &sock, "1048576"]);
    let mut link = accept_from(&listener, &mut child, DEADLINE).unwrap();
    let Received { message, mut fds } = link.recv_timeout(DEADLINE).unwrap();
    let Message::Offer(offer) = message else {
        panic!("expected an offer, got {message:?}")
    };
    let buffer = cache.open(&offer.handle, &mut fds).unwrap();
    assert_eq!(buffer.to_vec().unwrap(), vec![0xAB; 1 << 20]);

    // A live owner's segment survives a sweep.
    assert_eq!(host::sweep(&ns).unwrap().removed.len(), 0);
    assert_eq!(segments(&ns), before + 1);

    child.kill9();
    assert!(
        matches!(link.recv_timeout(DEADLINE), Err(Error::Closed)),
        "the importer sees the link close"
    );
    // The mapping stays readable after the exporter's death; drop it.
    let mut first = [0u8; 4];
    buffer.read(0, &mut first).unwrap();
    assert_eq!(first, [0xAB; 4]);
    drop(buffer);
    assert_eq!(cache.stats().live, 0);

    // SIGKILL skipped the owner's Drop: its segment is left behind until swept.
    let left = host::list_segments(&ns).unwrap();
    assert_eq!(left.len(), before + 1);
    assert_eq!(left[0].owner, baton::ipc::process::Liveness::Dead);
    let report = host::sweep(&ns).unwrap();
    assert_eq!(report.removed.len(), 1);
    assert_eq!(report.removed_bytes, 1 << 20);
    assert_eq!(
        segments(&ns),
        before,
        "no segment of the dead owner is left"
    );
}
