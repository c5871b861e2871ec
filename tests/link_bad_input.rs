//! Bad input, one connection at a time, against one live listener: each is refused with
//! a typed error and the listener goes on serving the next good client.

#[path = "support/peer.rs"]
mod peer;

use baton::Session;
use baton::ipc::Error;
use baton::ipc::{Backend, HostBackend, ImportCache, Link, LinkConfig, Listener, PeerPolicy};
use baton::messages::codec::{FrameHeader, HEADER_LEN, frame_bytes};
use baton::messages::protocol::{Auth, AuthProof, Hello, Nonce, Offer, RefuseReason, Release};
use baton::messages::{self as msg, LeaseId, Message, PROTOCOL_VERSION, SessionToken};
use proptest::prelude::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(10);
/// How long a test's listener waits for its next client at most.
const LISTENER_LIFETIME: Duration = Duration::from_secs(600);

/// A listener on a thread. Each accepted connection's outcome comes back on `outcomes`:
/// a refused connection's error, or `Ok` once a good client released the buffer it was
/// offered.
struct Server {
    path: PathBuf,
    session: Session,
    ns: String,
    outcomes: mpsc::Receiver<Result<(), Error>>,
    /// Tells the listener's thread to end.
    stop: Arc<AtomicBool>,
    _tmp: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Server {
    fn start(tag: &str, policy: PeerPolicy) -> Server {
        let ns = peer::namespace(tag);
        let session = Session::generate().unwrap();
        let (tmp, dir) = peer::socket_dir();
        let config = LinkConfig::new(session.clone())
            .policy(policy)
            .handshake_timeout(Duration::from_millis(500));
        let listener = Listener::bind(&dir, "srv.sock", config).unwrap();
        let path = listener.path().to_owned();
        let (tx, outcomes) = mpsc::channel();
        let (s, ns2) = (session.clone(), ns.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        std::thread::spawn(move || {
            let backend = HostBackend::with_namespace(&ns2).unwrap();
            let mut lease = 0;
            // Clients come while the test runs; the thread ends with the `Server`.
            while let Some(accepted) = peer::accept_while(&listener, LISTENER_LIFETIME, || {
                !stopped.load(Ordering::Relaxed)
            }) {
                let outcome = accepted.and_then(|mut link| {
                    lease += 1;
                    serve_one(&mut link, &backend, &s, LeaseId::new(lease))
                });
                if tx.send(outcome).is_err() {
                    return;
                }
            }
        });
        Server {
            path,
            session,
            ns,
            outcomes,
            stop,
            _tmp: tmp,
        }
    }

    fn outcome(&self) -> Result<(), Error> {
        self.outcomes
            .recv_timeout(DEADLINE)
            .expect("the listener answered")
    }

    /// A good client completes a handshake, maps the offered buffer, checks it, releases.
    fn good_client(&self) {
        let mut link = Link::connect(&self.path, &LinkConfig::new(self.session.clone())).unwrap();
        let backend: Arc<dyn Backend> = Arc::new(HostBackend::with_namespace(&self.ns).unwrap());
        let cache = ImportCache::new(self.session.clone(), [backend]);
        let r = link.recv_timeout(DEADLINE).unwrap();
        let Message::Offer(offer) = r.message else {
            panic!("expected an offer")
        };
        let mut fds = r.fds;
        let buf = cache.open(&offer.handle, &mut fds).unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![0x5A; 4096]);
        drop(buf);
        link.send(&Message::Release(Release::now(offer.lease)), &[])
            .unwrap();
        self.outcome().expect("the good client was served");
    }

    fn raw(&self) -> UnixStream {
        let s = UnixStream::connect(&self.path).unwrap();
        s.set_read_timeout(Some(DEADLINE)).unwrap();
        s
    }
}

fn serve_one(
    link: &mut Link,
    backend: &HostBackend,
    session: &Session,
    lease: LeaseId,
) -> Result<(), Error> {
    let alloc = backend.allocate(4096)?;
    alloc.fill(0, 4096, 0x5A)?;
    let handle = alloc.handle(session).build()?;
    link.send(&Message::Offer(Box::new(Offer { lease, handle })), &[])?;
    match link.recv_timeout(DEADLINE)?.message {
        Message::Release(r) if r.lease == lease => Ok(()),
        other => Err(Error::UnexpectedMessage {
            expected: "Release",
            got: other.kind(),
        }),
    }
}

fn header(version: u8, nfds: u8, len: u32) -> [u8; HEADER_LEN] {
    FrameHeader { version, nfds, len }.to_bytes()
}

#[test]
fn each_bad_peer_gets_a_typed_error_and_the_next_good_client_is_served() {
    let server = Server::start("bad", PeerPolicy::same_user());
    server.good_client();

    // A truncated frame: the header promises 100 bytes, 10 arrive, then EOF.
    let mut s = server.raw();
    s.write_all(&header(PROTOCOL_VERSION, 0, 100)).unwrap();
    s.write_all(&[0; 10]).unwrap();
    drop(s);
    assert!(matches!(
        server.outcome(),
        Err(Error::Message(msg::Error::Truncated {
            have: 18,
            need: 108
        }))
    ));
    server.good_client();

    // A length prefix of 4 GiB.
    let mut s = server.raw();
    s.write_all(&header(PROTOCOL_VERSION, 0, u32::MAX)).unwrap();
    assert!(matches!(
        server.outcome(),
        Err(Error::Message(msg::Error::FrameTooLarge { .. }))
    ));
    server.good_client();

    // An unknown protocol version in the frame header.
    let mut s = server.raw();
    s.write_all(&header(99, 0, 4)).unwrap();
    assert!(matches!(
        server.outcome(),
        Err(Error::Message(msg::Error::UnsupportedVersion {
            got: 99,
            ..
        }))
    ));
    server.good_client();

    // Not Baton at all.
    let mut s = server.raw();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(matches!(
        server.outcome(),
        Err(Error::Message(msg::Error::BadMagic { .. }))
    ));
    server.good_client();

    // A Hello with an unknown version inside a well-formed frame: refused with a reason.
    let mut s = server.raw();
    let hello = Message::Hello(Hello {
        version: 7,
        process: baton::ipc::process::current(),
        nonce: Nonce([1; 32]),
    });
    s.write_all(&frame_bytes(&hello, 0).unwrap()).unwrap();
    assert!(matches!(
        server.outcome(),
        Err(Error::Message(msg::Error::UnsupportedVersion {
            got: 7,
            ..
        }))
    ));
    let refusal = read_message(&mut s);
    assert_eq!(
        refusal,
        Some(Message::Refused(msg::protocol::Refused {
            reason: RefuseReason::VersionMismatch {
                supported: PROTOCOL_VERSION
            }
        }))
    );
    server.good_client();

    // A message other than Hello first.
    let mut s = server.raw();
    s.write_all(&frame_bytes(&Message::Ping(3), 0).unwrap())
        .unwrap();
    assert!(matches!(
        server.outcome(),
        Err(Error::UnexpectedMessage {
            expected: "Hello",
            got: "Ping"
        })
    ));
    server.good_client();

    // A client with the wrong token: it refuses the server's proof, the server hears why.
    let wrong = Session::new(SessionToken::from_bytes([0xEE; 32]));
    let client = Link::connect(&server.path, &LinkConfig::new(wrong));
    assert!(matches!(client, Err(Error::BadToken)));
    assert!(matches!(
        server.outcome(),
        Err(Error::Refused {
            reason: RefuseReason::BadToken
        })
    ));
    server.good_client();

    // A client that answers the Welcome with a forged proof.
    let mut s = server.raw();
    s.write_all(&frame_bytes(&hello_from_me(), 0).unwrap())
        .unwrap();
    assert!(matches!(read_message(&mut s), Some(Message::Welcome(_))));
    let forged = Message::Auth(Auth {
        proof: AuthProof([0x42; 32]),
    });
    s.write_all(&frame_bytes(&forged, 0).unwrap()).unwrap();
    assert!(matches!(server.outcome(), Err(Error::BadToken)));
    server.good_client();

    // A stranger who connects and says nothing: cut off at the handshake deadline.
    let s = server.raw();
    assert!(matches!(server.outcome(), Err(Error::Timeout { .. })));
    drop(s);
    server.good_client();

    // A frame that announces descriptors but carries none.
    let mut s = server.raw();
    s.write_all(&frame_bytes(&hello_from_me(), 2).unwrap())
        .unwrap();
    assert!(matches!(
        server.outcome(),
        Err(Error::MissingFds { need: 2, have: 0 })
    ));
    server.good_client();
}

#[test]
fn a_peer_whose_uid_is_not_allowed_is_refused_before_anything_is_read() {
    let me = rustix::process::geteuid().as_raw();
    let session = Session::generate().unwrap();
    let (_tmp, dir) = peer::socket_dir();
    let config = LinkConfig::new(session.clone())
        .policy(PeerPolicy::uids([me.wrapping_add(4242)]))
        .handshake_timeout(DEADLINE);
    let listener = Listener::bind(&dir, "uid.sock", config).unwrap();

    // A raw client connects and sends its Hello before the listener accepts, so the Hello
    // already sits in the server's socket when the server decides. A Unix stream socket
    // closed with bytes unread makes the kernel report a reset to its peer; one closed after
    // reading everything, an end of stream. So the reset after the refusal shows that the
    // server never read the Hello.
    let mut raw = UnixStream::connect(listener.path()).unwrap();
    raw.set_read_timeout(Some(DEADLINE)).unwrap();
    raw.write_all(&frame_bytes(&hello_from_me(), 0).unwrap())
        .unwrap();
    let refused = peer::accept_within(&listener, DEADLINE);
    assert!(
        matches!(refused, Err(Error::PeerNotAllowed { uid, .. }) if uid == me),
        "{refused:?}"
    );
    assert_eq!(
        read_message(&mut raw),
        Some(Message::Refused(msg::protocol::Refused {
            reason: RefuseReason::NotAllowed
        })),
        "the refusal is the first frame"
    );
    assert_eq!(
        stream_end(&mut raw),
        StreamEnd::Reset,
        "the server closed with our Hello unread"
    );

    // The control: a peer the policy allows, whose Hello the server must read to refuse it
    // (an unknown version), ends in a clean end of stream.
    let (_tmp2, dir2) = peer::socket_dir();
    let open = Listener::bind(&dir2, "open.sock", LinkConfig::new(session.clone())).unwrap();
    let mut raw = UnixStream::connect(open.path()).unwrap();
    raw.set_read_timeout(Some(DEADLINE)).unwrap();
    let hello = Message::Hello(Hello {
        version: 7,
        process: baton::ipc::process::current(),
        nonce: Nonce([1; 32]),
    });
    raw.write_all(&frame_bytes(&hello, 0).unwrap()).unwrap();
    assert!(matches!(
        peer::accept_within(&open, DEADLINE),
        Err(Error::Message(msg::Error::UnsupportedVersion {
            got: 7,
            ..
        }))
    ));
    assert!(matches!(
        read_message(&mut raw),
        Some(Message::Refused(msg::protocol::Refused {
            reason: RefuseReason::VersionMismatch { .. }
        }))
    ));
    assert_eq!(stream_end(&mut raw), StreamEnd::Eof, "the Hello was read");

    // A real client is refused the same way, and hears why.
    let path = listener.path().to_owned();
    let client_config = LinkConfig::new(session);
    let client = std::thread::spawn(move || Link::connect(&path, &client_config));
    let refused = peer::accept_within(&listener, DEADLINE);
    assert!(matches!(refused, Err(Error::PeerNotAllowed { uid, .. }) if uid == me));
    let client = client.join().unwrap();
    assert!(
        matches!(
            client,
            Err(Error::Refused {
                reason: RefuseReason::NotAllowed
            })
        ),
        "{client:?}"
    );
}

/// How a raw stream ended after its last frame.
#[derive(Debug, PartialEq, Eq)]
enum StreamEnd {
    /// A clean end of stream: the peer closed having read everything we sent.
    Eof,
    /// `ECONNRESET`: the peer closed with bytes of ours unread.
    Reset,
}

/// Reads to the end of the stream, which must come within the read timeout: bytes after
/// the last frame, or a timeout, fail the test.
fn stream_end(s: &mut UnixStream) -> StreamEnd {
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => StreamEnd::Eof,
        Ok(n) => panic!("{n} more bytes after the last frame: {:02x?}", &buf[..n]),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => StreamEnd::Reset,
        Err(e) => panic!("the stream did not end: {e}"),
    }
}

fn hello_from_me() -> Message {
    Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        process: baton::ipc::process::current(),
        nonce: Nonce([9; 32]),
    })
}

/// Reads one frame from a raw stream (None at end of stream).
fn read_message(s: &mut UnixStream) -> Option<Message> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).ok()?;
    let header = FrameHeader::parse(&h).unwrap();
    let mut payload = vec![0; header.len as usize];
    s.read_exact(&mut payload).unwrap();
    Some(msg::codec::decode_payload(&payload).unwrap())
}

#[test]
fn handles_that_name_nothing_or_too_much_are_refused_before_mapping() {
    let ns = peer::namespace("hdl");
    let session = Session::generate().unwrap();
    let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
    let cache = ImportCache::new(session.clone(), [backend.clone() as Arc<dyn Backend>]);
    let mut no_fds = baton::ipc::FrameFds::none();

    // A segment that does not exist (the exporter freed it).
    let alloc = backend.allocate(8192).unwrap();
    let handle = alloc.handle(&session).build().unwrap();
    drop(alloc);
    assert!(matches!(
        cache.open(&handle, &mut no_fds),
        Err(Error::SegmentNotFound { .. })
    ));

    // A size larger than the segment, sealed by a confused (or lying) exporter.
    let alloc = backend.allocate(8192).unwrap();
    let mut big = alloc.handle(&session).build().unwrap();
    big.alloc_size = 1 << 30;
    big.len = 1 << 30;
    let big = big.sealed(session.handle_key());
    assert!(matches!(
        cache.open(&big, &mut no_fds),
        Err(Error::MemoryTooSmall {
            claimed: 1073741824,
            actual: 8192
        })
    ));

    // One corrupted byte: refused by the digest, before any open.
    let good = alloc.handle(&session).build().unwrap();
    let mut corrupt = good.clone();
    corrupt.offset ^= 1;
    let opens = backend.opens();
    assert!(matches!(
        cache.open(&corrupt, &mut no_fds),
        Err(Error::Message(msg::Error::DigestMismatch))
    ));
    assert_eq!(backend.opens(), opens, "no open was attempted");

    // A handle sealed under another session's token.
    let other = Session::generate().unwrap();
    let foreign = alloc.handle(&other).build().unwrap();
    assert!(matches!(
        cache.open(&foreign, &mut no_fds),
        Err(Error::Message(msg::Error::DigestMismatch))
    ));

    // A stale generation: the exporter reused the allocation for a newer buffer, and this
    // process has opened that one.
    let mut alloc = alloc;
    let newer = alloc.renew();
    let fresh = cache
        .open(&alloc.handle(&session).build().unwrap(), &mut no_fds)
        .unwrap();
    let opens = backend.opens();
    assert!(matches!(
        cache.open(&good, &mut no_fds),
        Err(Error::StaleHandle { generation, current, .. }) if generation == good.generation && current == newer
    ));
    assert_eq!(backend.opens(), opens, "no open was attempted");
    drop(fresh);
    assert_eq!(cache.stats().live, 0);
}

#[test]
fn cache_hits_share_one_mapping_and_the_last_drop_closes_it() {
    let ns = peer::namespace("hit");
    let session = Session::generate().unwrap();
    let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
    let cache = ImportCache::new(session.clone(), [backend.clone() as Arc<dyn Backend>]);
    let alloc = backend.allocate(1 << 16).unwrap();
    alloc.write(4096, b"slab").unwrap();
    let mut fds = baton::ipc::FrameFds::none();

    let whole = cache
        .open(&alloc.handle(&session).build().unwrap(), &mut fds)
        .unwrap();
    let part = cache
        .open(
            &alloc.handle(&session).range(4096, 4).build().unwrap(),
            &mut fds,
        )
        .unwrap();
    assert_eq!(part.to_vec().unwrap(), b"slab");
    let stats = cache.stats();
    assert_eq!((stats.opens, stats.hits, stats.live), (1, 1, 1));
    assert_eq!(
        backend.opens(),
        1,
        "one driver-level open for two buffers of one allocation"
    );
    drop(whole);
    assert_eq!(cache.stats().live, 1);
    drop(part);
    assert_eq!(cache.stats().live, 0);
    assert_eq!(cache.stats().closes, 1);
}

/// What the server must report for a client that wrote `bytes` and hung up, worked out
/// from the frame decoder and the handshake's rules: the decoder's own error for a bad or
/// cut-off first frame, `MissingFds` for a frame announcing descriptors, `UnexpectedMessage`
/// for anything but a `Hello` first, the handshake's refusal for a wrong `Hello`, and a
/// clean close after a good `Hello` (the server waits for the `Auth` that never comes).
fn expected_outcome(bytes: &[u8]) -> String {
    let mut decoder = msg::codec::FrameDecoder::new();
    decoder.push(bytes);
    let error = match decoder.next_frame() {
        Err(e) => Error::Message(e),
        Ok(None) => match decoder.finish() {
            Err(e) => Error::Message(e),
            Ok(()) => Error::Closed,
        },
        Ok(Some(frame)) if frame.header.nfds > 0 => Error::MissingFds {
            need: usize::from(frame.header.nfds),
            have: 0,
        },
        Ok(Some(frame)) => match frame.message {
            Message::Hello(h) if h.version != PROTOCOL_VERSION => {
                Error::Message(msg::Error::UnsupportedVersion {
                    got: h.version,
                    supported: PROTOCOL_VERSION,
                })
            }
            Message::Hello(h) if h.process != baton::ipc::process::current() => {
                Error::PeerIdentityMismatch {
                    claimed: h.process,
                    actual_pid: std::process::id(),
                }
            }
            Message::Hello(_) => Error::Closed,
            Message::Refused(r) => Error::Refused { reason: r.reason },
            other => Error::UnexpectedMessage {
                expected: "Hello",
                got: other.kind(),
            },
        },
    };
    format!("{error:?}")
}

/// The messages a client might open with, to mutate.
fn first_message(which: u8, n: u64) -> Message {
    let me = baton::ipc::process::current();
    match which % 6 {
        0 | 1 => hello_from_me(),
        2 => Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            process: baton::messages::ProcessId { pid: 1, ..me },
            nonce: Nonce([2; 32]),
        }),
        3 => Message::Ping(n),
        4 => Message::Release(Release::now(LeaseId::new(n))),
        _ => Message::Auth(Auth {
            proof: AuthProof([n as u8; 32]),
        }),
    }
}

/// Bytes a bad client might send, in three families, so that most cases get past the frame
/// header: any bytes at all (mostly not Baton: `BadMagic`); a valid header before random
/// payload bytes (cut off, malformed, or a message out of place); a real first frame with
/// a few payload bytes changed and perhaps cut short (a wrong version or identity, a
/// descriptor count, a payload that no longer decodes).
fn bad_client_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 1..512),
        (0u32..600, proptest::collection::vec(any::<u8>(), 0..700)).prop_map(|(len, payload)| {
            let mut b = header(PROTOCOL_VERSION, 0, len).to_vec();
            b.extend(payload);
            b
        }),
        (
            any::<u8>(),
            any::<u64>(),
            proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
            any::<bool>(),
            any::<usize>(),
            0u8..3,
        )
            .prop_map(|(which, n, flips, cut, at, nfds)| {
                let mut b = frame_bytes(&first_message(which, n), 0).unwrap();
                if nfds == 2 {
                    b[3] = 1; // announces a descriptor that never comes
                }
                let payload = b.len() - HEADER_LEN;
                for (i, x) in flips {
                    if payload > 0 {
                        b[HEADER_LEN + i % payload] ^= x;
                    }
                }
                if cut {
                    b.truncate(1 + at % b.len());
                }
                b
            }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn bad_bytes_on_the_socket_get_the_typed_error_they_deserve_and_the_listener_survives(
        bytes in bad_client_bytes()
    ) {
        thread_local! {
            static SERVER: Server = Server::start("rnd", PeerPolicy::same_user());
        }
        let want = expected_outcome(&bytes);
        SERVER.with(|server| {
            let mut s = server.raw();
            let _ = s.write_all(&bytes);
            drop(s);
            let got = server.outcome();
            prop_assert!(got.is_err(), "a bad client was served");
            prop_assert_eq!(format!("{:?}", got.unwrap_err()), want);
            server.good_client();
            Ok(())
        })?;
    }
}

#[test]
fn a_peer_that_dies_mid_frame_with_our_bytes_unread_reads_as_truncated() {
    // A peer that dies with data we sent still unread makes the kernel report a reset
    // (ECONNRESET) instead of an end of stream; the frame it cut off must still be named.
    let session = Session::generate().unwrap();
    let config = LinkConfig::new(session);
    let (a, b) = UnixStream::pair().unwrap();
    let client_config = config.clone();
    let client = std::thread::spawn(move || Link::client(b, &client_config).unwrap());
    let mut server = Link::server(a, &config).unwrap();
    let client = client.join().unwrap();
    server.send(&Message::Ping(1), &[]).unwrap(); // never read by the client
    let frame = frame_bytes(&Message::Ping(2), 0).unwrap();
    let mut raw = UnixStream::from(client.as_fd().try_clone_to_owned().unwrap());
    raw.write_all(&frame[..frame.len() / 2]).unwrap();
    drop(raw);
    drop(client);
    assert!(
        matches!(
            server.recv_timeout(DEADLINE),
            Err(Error::Message(msg::Error::Truncated { .. }))
        ),
        "a cut-off frame is reported as truncated, not as a clean close"
    );
}

#[test]
fn a_cache_hit_that_claims_more_than_the_live_mapping_is_refused() {
    // Found by the `handle_msg` fuzz target: a second handle of an allocation already mapped
    // claimed a larger allocation and a range past the mapping; the hit handed out a view
    // (and a pointer) outside the mapped memory.
    let ns = peer::namespace("hit2");
    let session = Session::generate().unwrap();
    let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
    let cache = ImportCache::new(session.clone(), [backend.clone() as Arc<dyn Backend>]);
    let alloc = backend.allocate(8192).unwrap();
    let mut fds = baton::ipc::FrameFds::none();
    let first = cache
        .open(&alloc.handle(&session).build().unwrap(), &mut fds)
        .unwrap();
    let mut liar = alloc.handle(&session).build().unwrap();
    liar.alloc_size = 1 << 40;
    liar.offset = 1 << 30;
    liar.len = 4096;
    let liar = liar.sealed(session.handle_key());
    assert!(matches!(
        cache.open(&liar, &mut fds),
        Err(Error::MemoryTooSmall {
            claimed: 1099511627776,
            actual: 8192
        })
    ));
    assert_eq!(cache.stats().hits, 0, "the refused hit took no reference");
    drop(first);
    assert_eq!(cache.stats().live, 0);
}

#[test]
fn a_hit_skips_no_check_a_changed_handle_needs() {
    let ns = peer::namespace("hitchk");
    let session = Session::generate().unwrap();
    let backend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
    let cache = ImportCache::new(session.clone(), [backend.clone() as Arc<dyn Backend>]);
    let alloc = backend.allocate(1 << 16).unwrap();
    let mut fds = baton::ipc::FrameFds::none();
    let good = alloc.handle(&session).range(0, 4096).build().unwrap();
    let live = cache.open(&good, &mut fds).unwrap();
    // The very same handle again: a hit (its digest verified before).
    let again = cache.open(&good, &mut fds).unwrap();
    // Any changed byte of a verified handle is checked again, and refused, on a hit too.
    let mut bigger = good.clone();
    bigger.len = 8192;
    assert!(matches!(
        cache.open(&bigger, &mut fds),
        Err(Error::Message(msg::Error::DigestMismatch))
    ));
    let mut forged = good.clone();
    forged.digest.0[0] ^= 1;
    assert!(matches!(
        cache.open(&forged, &mut fds),
        Err(Error::Message(msg::Error::DigestMismatch))
    ));
    // A different, properly sealed view of the same mapping is a hit after its check.
    let other = alloc.handle(&session).range(4096, 4096).build().unwrap();
    let view = cache.open(&other, &mut fds).unwrap();
    assert_eq!(cache.stats().opens, 1);
    assert_eq!(cache.stats().hits, 2);
    drop((live, again, view));
    assert_eq!(cache.stats().live, 0);
}
