//! Authentication, at the actor level: who may link with a [`Node`], and what a refused
//! peer gets — the refusal and nothing else: no `Welcome` before its credentials pass, never
//! an `Offer` or a `Call` (the frames that carry handles).
//!
//! - a peer whose uid the policy does not allow is refused before the node reads a byte;
//! - a peer without the session token is refused, in either direction;
//! - the socket and its directory cannot be reached by another user, and another uid that
//!   reaches the socket is refused: these two spawn a probe as uid/gid 65534, which needs
//!   root, so they are `#[ignore = "needs root …"]`; `.ci/run` runs them with `--ignored`
//!   as root and fails if they did not run.
//!
//! A refused peer's link must end: at an end of stream or a reset. A read that times out
//! means the node kept the link, and fails the test.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, EventLog, Events, eventually, run};
use baton::actors::{Allocate, Buffer, BufferOwner, Node, PeerEvent};
use baton::ipc::{HostBackend, LinkConfig, PeerPolicy};
use baton::messages::codec::{FrameDecoder, frame_bytes};
use baton::messages::protocol::{Auth, AuthProof, Hello, Nonce, RefuseReason};
use baton::messages::{Message, PROTOCOL_VERSION, SessionToken};
use baton::{Session, SocketDir};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::spawn_blocking;

fn me() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// A node with a buffer owner and a buffer ready to share, listening in a private directory.
struct Server {
    node: Node,
    events: Events,
    listening: baton::actors::Listening,
    _owner: Addr<BufferOwner>,
    _buffer: Buffer<u32>,
    tmp: tempfile::TempDir,
    dir: SocketDir,
}

impl Server {
    async fn start(tag: &str, session: Session, policy: PeerPolicy) -> Server {
        let ns = peer::namespace(tag);
        let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
        let node = Node::with_config(
            LinkConfig::new(session)
                .policy(policy)
                .handshake_timeout(Duration::from_secs(5)),
            backend,
        );
        let events = Events::default();
        node.subscribe(EventLog(events.clone()).start().recipient());
        let (tmp, dir) = peer::socket_dir();
        let listening = node.listen(&dir, "auth.sock").unwrap();
        let owner = BufferOwner::new(&node).start();
        let buffer: Buffer<u32> = owner.send(Allocate::vector(64)).await.unwrap().unwrap();
        Server {
            node,
            events,
            listening,
            _owner: owner,
            _buffer: buffer,
            tmp,
            dir,
        }
    }

    fn path(&self) -> PathBuf {
        self.listening.path().to_owned()
    }

    /// Waits for one refusal and returns it (Debug form).
    async fn refusal(&self) -> String {
        eventually(DEADLINE, "the node to report a refusal", || {
            self.refusals().next().is_some()
        })
        .await;
        self.refusals().next().unwrap()
    }

    fn refusals(&self) -> impl Iterator<Item = String> {
        self.events.all().into_iter().filter_map(|e| match e {
            PeerEvent::Refused(why) => Some(format!("{why:?}")),
            _ => None,
        })
    }

    fn assert_never_linked(&self) {
        assert!(self.events.ups().is_empty(), "a refused peer got a link");
        assert!(self.node.peers().is_empty());
    }
}

fn hello() -> Message {
    Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        process: baton::ipc::process::current(),
        nonce: Nonce([3; 32]),
    })
}

/// How a raw client's stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// A clean end of stream: the node closed having read everything we sent.
    Eof,
    /// `ECONNRESET`: the node closed with bytes of ours unread.
    Reset,
}

/// What a raw client saw.
#[derive(Debug)]
struct RawSession {
    /// Every message received, in order.
    got: Vec<Message>,
    /// How the stream ended.
    end: End,
}

/// A raw client connects and sends `first`. Called on the event loop's thread, it blocks
/// that loop meanwhile, so `first` is in the node's socket before the node can accept the
/// connection: whatever the node does next, it does with `first` waiting there.
fn raw_connect(path: &Path, first: &Message) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    s.write_all(&frame_bytes(first, 0).unwrap())
        .expect("the Hello goes into the socket before the node accepts");
    s
}

/// The raw client goes on: sends `then` after a `Welcome`, and reads until the node drops
/// the link. Only an end of stream or a reset counts as dropped: a read that times out
/// (the node kept the link open) fails the test. Blocking: call from `spawn_blocking`.
fn raw_client(mut s: UnixStream, then: Option<Message>) -> RawSession {
    let mut then = then;
    let mut decoder = FrameDecoder::new();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let end = loop {
        let n = match s.read(&mut buf) {
            Ok(0) => break End::Eof,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break End::Reset,
            Err(e) => panic!("the node did not drop the link ({e}); received {got:?}"),
            Ok(n) => n,
        };
        decoder.push(&buf[..n]);
        while let Some(frame) = decoder.next_frame().unwrap() {
            if matches!(frame.message, Message::Welcome(_)) {
                if let Some(next) = then.take() {
                    let _ = s.write_all(&frame_bytes(&next, 0).unwrap());
                }
            }
            got.push(frame.message);
        }
    };
    RawSession { got, end }
}

fn no_handles(got: &[Message]) {
    assert!(
        !got.iter()
            .any(|m| matches!(m, Message::Offer(_) | Message::Call(_) | Message::Reply(_))),
        "a refused peer received a handle: {got:?}"
    );
}

#[test]
fn a_uid_the_policy_does_not_allow_is_refused_before_any_handle_is_sent() {
    run(async {
        let session = Session::generate().unwrap();
        let server = Server::start(
            "uid",
            session.clone(),
            PeerPolicy::uids([me().wrapping_add(4242)]),
        )
        .await;

        // A raw client of our uid (not allowed here) gets the refusal and nothing else:
        // not even a Welcome, so it learns nothing of the server.
        let stream = raw_connect(&server.path(), &hello());
        let raw = spawn_blocking(move || raw_client(stream, None))
            .await
            .unwrap();
        assert_eq!(
            raw.got,
            vec![Message::Refused(baton::messages::protocol::Refused {
                reason: RefuseReason::NotAllowed
            })]
        );
        // Our Hello was in the node's socket before it accepted; a socket closed with bytes
        // unread resets its peer, one whose bytes were all read ends cleanly.
        assert_eq!(
            raw.end,
            End::Reset,
            "the node read the Hello of a peer it refuses"
        );
        let why = server.refusal().await;
        assert!(
            why.contains("PeerNotAllowed") && why.contains(&format!("uid: {}", me())),
            "{why}"
        );

        // A node holding the right token is refused the same way.
        let client = Node::new(
            session.clone(),
            Arc::new(HostBackend::with_namespace(&peer::namespace("uidc")).unwrap()),
        );
        let err = client.connect(server.path()).await.unwrap_err();
        assert!(format!("{err:?}").contains("NotAllowed"), "{err:?}");
        assert!(client.peers().is_empty());
        server.assert_never_linked();

        // And a node whose policy refuses the server never sends its Hello.
        let picky = Node::with_config(
            LinkConfig::new(session.clone()).policy(PeerPolicy::uids([me().wrapping_add(1)])),
            Arc::new(HostBackend::with_namespace(&peer::namespace("uidp")).unwrap()),
        );
        let open = Server::start("uido", session, PeerPolicy::same_user()).await;
        let err = picky.connect(open.path()).await.unwrap_err();
        assert!(format!("{err:?}").contains("PeerNotAllowed"), "{err:?}");
        let why = open.refusal().await;
        assert!(
            why.contains("Closed"),
            "the server saw the client hang up: {why}"
        );
        open.assert_never_linked();
    });
}

#[test]
fn a_peer_without_the_token_is_refused_in_either_direction() {
    run(async {
        let session = Session::generate().unwrap();
        let server = Server::start("tok", session.clone(), PeerPolicy::same_user()).await;
        let stranger = Session::new(SessionToken::from_bytes([0xEE; 32]));

        // A node with another token refuses the server's proof; the server hears why.
        let client = Node::new(
            stranger.clone(),
            Arc::new(HostBackend::with_namespace(&peer::namespace("tokc")).unwrap()),
        );
        let err = client.connect(server.path()).await.unwrap_err();
        assert!(format!("{err:?}").contains("BadToken"), "{err:?}");
        let why = server.refusal().await;
        assert!(why.contains("BadToken"), "{why}");

        // A raw client that answers the Welcome with a forged proof: refused, and the
        // only frames it ever got are the Welcome and the refusal.
        let forged = Message::Auth(Auth {
            proof: AuthProof([0x42; 32]),
        });
        let stream = raw_connect(&server.path(), &hello());
        let raw = spawn_blocking(move || raw_client(stream, Some(forged)))
            .await
            .unwrap();
        let got = raw.got;
        assert!(matches!(got.first(), Some(Message::Welcome(_))), "{got:?}");
        assert_eq!(
            got.get(1),
            Some(&Message::Refused(baton::messages::protocol::Refused {
                reason: RefuseReason::BadToken
            }))
        );
        assert_eq!(got.len(), 2, "{got:?}");
        no_handles(&got);
        eventually(DEADLINE, "both refusals", || server.refusals().count() == 2).await;
        assert!(server.refusals().nth(1).unwrap().contains("BadToken"));
        server.assert_never_linked();

        // The other direction: a server with another token is refused by an honest client.
        let impostor = Server::start("toki", stranger, PeerPolicy::same_user()).await;
        let honest = Node::new(
            session,
            Arc::new(HostBackend::with_namespace(&peer::namespace("tokh")).unwrap()),
        );
        let err = honest.connect(impostor.path()).await.unwrap_err();
        assert!(format!("{err:?}").contains("BadToken"), "{err:?}");
        assert!(honest.peers().is_empty());
        impostor.assert_never_linked();
    });
}

/// The reason the tests that switch users are ignored by default. `.ci/run` runs them
/// (`--ignored`) when it runs as root, and fails if they did not run.
const NEEDS_ROOT: &str =
    "needs root (runs a helper as uid 65534): .ci/run runs it with --ignored as root";

/// Root may run a helper as another user; these tests are asked for explicitly, so anyone
/// else fails them, saying why.
fn assert_root() {
    assert_eq!(
        me(),
        0,
        "{NEEDS_ROOT}; this test runs as uid {}: leave it ignored",
        me()
    );
}

/// The test helper, copied where uid 65534 may run it (the build directory may sit under
/// a home directory it cannot enter).
fn stranger_exe() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = dir.path().join("baton-test-peer");
    std::fs::copy(peer::exe("baton-test-peer"), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    (dir, exe)
}

/// Runs the helper as uid/gid 65534 (blocking: call from `spawn_blocking`); returns its
/// stdout. Killed and reaped past the deadline.
fn run_as_stranger(exe: &Path, args: &[&str]) -> String {
    use std::os::unix::process::CommandExt;
    let start = Instant::now();
    let mut child = loop {
        let spawned = std::process::Command::new(exe)
            .args(args)
            .uid(65534)
            .gid(65534)
            .current_dir("/")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn();
        match spawned {
            // Another test's child, forked while our copy of the helper was still open for
            // writing, holds that descriptor until it execs: retry until it has.
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                assert!(start.elapsed() < DEADLINE, "the helper stayed busy: {e}");
                std::thread::sleep(Duration::from_millis(5));
            }
            other => break other.expect("spawning the helper as uid 65534"),
        }
    };
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the helper did not finish within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(status.success(), "helper failed ({status}): {out}");
    out
}

#[test]
#[ignore = "needs root (runs a helper as uid 65534): .ci/run runs it with --ignored as root"]
fn the_socket_and_its_directory_are_not_reachable_by_other_users() {
    assert_root();
    run(async {
        let server = Server::start(
            "priv",
            Session::generate().unwrap(),
            PeerPolicy::same_user(),
        )
        .await;
        let meta = std::fs::metadata(server.dir.path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o700);
        assert_eq!(meta.uid(), me());

        let (_bin, exe) = stranger_exe();
        let (sock, dir) = (
            server.path().to_str().unwrap().to_owned(),
            server.dir.path().to_str().unwrap().to_owned(),
        );
        let exe2 = exe.clone();
        let (probe, listing) = spawn_blocking(move || {
            (
                run_as_stranger(&exe2, &["probe", &sock]),
                run_as_stranger(&exe2, &["list", &dir]),
            )
        })
        .await
        .unwrap();
        assert_eq!(probe.trim(), "connect-error: PermissionDenied");
        assert_eq!(listing.trim(), "list-error: PermissionDenied");

        // Even a socket file open to everyone stays out of reach inside the directory.
        std::fs::set_permissions(server.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let sock = server.path().to_str().unwrap().to_owned();
        let probe = spawn_blocking(move || run_as_stranger(&exe, &["probe", &sock]))
            .await
            .unwrap();
        assert_eq!(probe.trim(), "connect-error: PermissionDenied");
        assert_eq!(
            server.refusals().count(),
            0,
            "the stranger never reached the node"
        );
        server.assert_never_linked();
        drop(server.tmp);
    });
}

#[test]
#[ignore = "needs root (runs a helper as uid 65534): .ci/run runs it with --ignored as root"]
fn another_uid_that_reaches_the_socket_is_refused_before_any_handle_is_sent() {
    assert_root();
    run(async {
        let server = Server::start(
            "uid2",
            Session::generate().unwrap(),
            PeerPolicy::same_user(),
        )
        .await;
        // Deliberately open the way to the socket, as a misconfigured deployment might:
        // the credentials check must still refuse the stranger.
        for p in [server.tmp.path(), server.dir.path()] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::set_permissions(server.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let (_bin, exe) = stranger_exe();
        let sock = server.path().to_str().unwrap().to_owned();
        let probe = spawn_blocking(move || run_as_stranger(&exe, &["probe", &sock]))
            .await
            .unwrap();
        // The node refuses before reading a byte, so the probe's Hello stays unread: either
        // the node had closed the socket already (the write fails), or the Hello sat in it
        // unread and the kernel reports a reset after the refusal. A clean end after a
        // written Hello would mean the node read it; a timeout, that it kept the link.
        let lines: Vec<&str> = probe.lines().collect();
        match lines.as_slice() {
            [written, "refused: NotAllowed", "end"] if written.starts_with("write-error") => {}
            ["refused: NotAllowed", "read-error: ConnectionReset", "end"] => {}
            _ => panic!("the stranger saw more than a refusal of an unread Hello:\n{probe}"),
        }
        let why = server.refusal().await;
        assert!(
            why.contains("PeerNotAllowed") && why.contains("uid: 65534"),
            "{why}"
        );
        server.assert_never_linked();
    });
}
