//! The logic of Baton's fuzz targets that need transport internals: handle checking on
//! the importer side and the link handshake. Kept in the library so that the cargo-fuzz
//! targets (`fuzz/fuzz_targets/`) and the ordinary test that replays their corpus
//! (`tests/fuzz_corpus.rs`) run the same code, and so that the sans-I/O handshake state
//! machines need not be made public.
//!
//! Not a stable API: hidden from the docs, and only for fuzzing and its replay. Each
//! function takes arbitrary bytes and panics only when an invariant of the code under test
//! is broken. Nothing here maps memory, opens a socket or touches `/dev/shm`.

use crate::backend::{Allocation, Backend, MemPtr, OpenedMem, RawMemory};
use crate::link::{ClientHandshake, FrameFds, KernelPeer, PeerCred, Refusal, ServerHandshake};
use crate::session::{CheckedHandle, Role, Session};
use crate::{Error, ImportCache, Result, SharedBackend};
use baton_messages::codec::{FrameDecoder, frame_bytes};
use baton_messages::protocol::{Auth, Hello, Welcome};
use baton_messages::{BackendKind, DeviceUuid, HandleMsg, Message, RawHandle, SessionToken};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Memory that is never touched: it only reports a size and ignores copies.
#[derive(Debug)]
struct NoMemory(usize);

impl RawMemory for NoMemory {
    fn size(&self) -> usize {
        self.0
    }
    fn ptr(&self) -> MemPtr {
        MemPtr::Device(0)
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        assert!(
            offset + dst.len() <= self.0,
            "a read past the mapping reached the backend"
        );
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        assert!(
            offset + src.len() <= self.0,
            "a write past the mapping reached the backend"
        );
        Ok(())
    }
    fn fill(&self, offset: usize, len: usize, _byte: u8) -> Result<()> {
        assert!(
            offset + len <= self.0,
            "a fill past the mapping reached the backend"
        );
        Ok(())
    }
}

/// A backend that "opens" every handle kind by recording the call and returning memory of
/// exactly the size the handle claims (or, when asked, one byte less).
#[derive(Debug, Default)]
struct RecordingBackend {
    opens: AtomicU64,
    short: std::sync::atomic::AtomicBool,
}

impl Backend for RecordingBackend {
    fn name(&self) -> &'static str {
        "fuzz"
    }
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }
    fn device(&self) -> DeviceUuid {
        DeviceUuid::HOST
    }
    fn can_open(&self, _kind: BackendKind) -> bool {
        true
    }
    fn allocate(&self, _size: usize) -> Result<Allocation> {
        Err(Error::ZeroSize)
    }
    fn open(&self, handle: CheckedHandle<'_>, fd: Option<OwnedFd>) -> Result<OpenedMem> {
        assert!(fd.is_none(), "no descriptor travelled with a fuzzed handle");
        self.opens.fetch_add(1, Ordering::Relaxed);
        let short = u64::from(self.short.load(Ordering::Relaxed));
        let size =
            usize::try_from(handle.alloc_size.saturating_sub(short)).expect("64-bit targets only");
        Ok(OpenedMem::new(&handle, Box::new(NoMemory(size))))
    }
}

/// Where an imported view starts in its mapping (the fuzz memory sits at address 0).
fn view_offset(imported: &crate::Imported) -> u64 {
    match imported.ptr() {
        MemPtr::Device(at) => at,
        MemPtr::Host(p) => p as u64,
    }
}

fn fuzz_session() -> Session {
    Session::new(SessionToken::from_bytes([0x5E; 32]))
}

/// How far an input got into the `handle_msg` target (see
/// [`baton_messages::fuzzing::FrameDepth`] for why the corpus replay asks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HandleDepth {
    /// Not even a flags byte.
    Empty,
    /// The first handle did not decode.
    Undecoded,
    /// Decoded; every open was refused before reaching the backend (digest, consistency,
    /// origin, staleness).
    Refused,
    /// An open reached the backend (a mapping was made, or its size refused).
    Backend,
    /// A checked handle of a live mapping reached the import cache's hit path (handed a
    /// view, or refused there): where the fixed past-the-mapping bug lived.
    CacheHit,
}

/// How far an input got into the `handshake` target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HandshakeDepth {
    /// Not even a mode byte.
    Empty,
    /// No message decoded from the input (the attacker scenarios then run an honest
    /// handshake, with nothing of the input in it).
    NoMessage,
    /// The first step ran (it answered or refused).
    FirstStep,
    /// A later step ran.
    LaterStep,
    /// A side completed the handshake.
    Completed,
}

/// Target `handle_msg`: the message-level checks of
/// [`baton_messages::fuzzing::handle_msg`], then the importer's: a handle reaches a backend
/// only after its digest, consistency and origin checked, never when stale, and every view
/// the import cache hands out lies inside the mapping it shares — also when a second
/// handle of the same allocation claims another size (a cache hit).
///
/// Layout of `data`: one flags byte, a two-byte length, a first handle of that length, a
/// second handle after it. Returns how far the input got.
pub fn handle_msg(data: &[u8]) -> HandleDepth {
    let Some((&flags, rest)) = data.split_first() else {
        return HandleDepth::Empty;
    };
    let (first, second) = match rest {
        [a, b, tail @ ..] => {
            let n = usize::from(u16::from_le_bytes([*a, *b])).min(tail.len());
            tail.split_at(n)
        }
        _ => (rest, &[][..]),
    };
    let Some(mut h1) = baton_messages::fuzzing::handle_msg(first) else {
        return HandleDepth::Undecoded;
    };
    let mut depth = HandleDepth::Refused;
    let session = fuzz_session();
    let backend = Arc::new(RecordingBackend::default());
    backend.short.store(flags & 0x40 != 0, Ordering::Relaxed);
    let cache = ImportCache::new(session.clone(), [Arc::clone(&backend) as SharedBackend]);

    // As received: only a handle that checks may reach the backend.
    let checked = session.check(&h1).is_ok();
    let opened = cache.open(&h1, &mut FrameFds::none());
    if !checked {
        assert!(opened.is_err(), "an unchecked handle was opened");
        assert_eq!(
            backend.opens.load(Ordering::Relaxed),
            0,
            "an unchecked handle reached the backend"
        );
    }
    drop(opened);

    // Resealed by this session, from this boot (bit 0): the deeper checks run.
    if flags & 1 != 0 {
        h1.exporter.process.boot = session.process().boot;
        h1 = h1.sealed(session.handle_key());
    }
    let mut h2 = baton_messages::fuzzing::decode_handle(second).unwrap_or_else(|| h1.clone());
    if flags & 2 != 0 {
        // Another view of the same allocation, as a cache hit sees it.
        h2.exporter = h1.exporter;
        h2.alloc = h1.alloc;
        h2.generation = h1.generation;
        h2.backend = h1.backend;
        h2.raw = h1.raw.clone();
        h2 = h2.sealed(session.handle_key());
    }
    let mut views = Vec::new();
    for (i, h) in [&h1, &h2].into_iter().enumerate() {
        let before = backend.opens.load(Ordering::Relaxed);
        let stats = cache.stats();
        let outcome = cache.open(h, &mut FrameFds::none());
        // The second handle, checked, of the allocation the first mapped, with no backend
        // call: the cache looked it up and decided on the live mapping.
        let same_allocation = (h.exporter.process, h.alloc, h.generation)
            == (h1.exporter.process, h1.alloc, h1.generation);
        if i == 1
            && !views.is_empty()
            && same_allocation
            && session.check(h).is_ok()
            && backend.opens.load(Ordering::Relaxed) == before
        {
            depth = HandleDepth::CacheHit;
        } else if backend.opens.load(Ordering::Relaxed) > before || outcome.is_ok() {
            depth = depth.max(HandleDepth::Backend);
        }
        match outcome {
            Ok(view) => {
                session.check(h).expect("only checked handles open");
                assert!(
                    h.raw.fd_slot().is_none(),
                    "a descriptor handle opened without its descriptor"
                );
                let mapping = view.mapping().size() as u64;
                let end = view_offset(&view).checked_add(view.len() as u64);
                assert!(
                    end.is_some_and(|e| e <= mapping),
                    "a view of {} bytes at {} lies outside its {mapping}-byte mapping",
                    view.len(),
                    view_offset(&view)
                );
                let mut byte = [0u8; 1];
                view.read(view.len() - 1, &mut byte)
                    .expect("the last byte reads");
                assert!(
                    view.read(view.len(), &mut byte).is_err(),
                    "a read past the view"
                );
                views.push(view);
            }
            Err(_) => {
                let after = backend.opens.load(Ordering::Relaxed);
                let s = cache.stats();
                assert_eq!(s.live, stats.live, "a failed open left a mapping");
                if session.check(h).is_err() {
                    assert_eq!(after, before, "an unchecked handle reached the backend");
                }
            }
        }
    }
    // Once a newer generation of a mapped allocation was opened (the exporter reused it),
    // the older handle is stale: refused, with no backend call.
    if let Some(view) = views.first() {
        let key = view.key();
        let mut newer = h1.clone();
        newer.exporter = key.exporter;
        newer.alloc = key.alloc;
        newer.generation = view.generation().next();
        let newer = newer.sealed(session.handle_key());
        if let Ok(v) = cache.open(&newer, &mut FrameFds::none()) {
            let mut older = newer.clone();
            older.generation = view.generation();
            let older = older.sealed(session.handle_key());
            let before = backend.opens.load(Ordering::Relaxed);
            assert!(
                matches!(
                    cache.open(&older, &mut FrameFds::none()),
                    Err(Error::StaleHandle { .. })
                ),
                "an older generation opened"
            );
            assert_eq!(
                backend.opens.load(Ordering::Relaxed),
                before,
                "a stale handle reached the backend"
            );
            views.push(v);
        }
    }
    drop(views);
    assert_eq!(cache.stats().live, 0, "mappings outlived their views");

    if let RawHandle::HostSegment(name) = &h1.raw {
        let _ = crate::host::SegmentOwner::parse(name.as_str().trim_start_matches('/'));
    }
    depth
}

/// Our own credentials, as `SO_PEERCRED` would report them for a socket pair (no pidfd:
/// the peer is visible).
fn own_cred() -> KernelPeer {
    KernelPeer {
        cred: PeerCred {
            pid: std::process::id(),
            uid: rustix::process::geteuid().as_raw(),
            gid: rustix::process::getegid().as_raw(),
        },
        pidfd: None,
    }
}

/// The messages in a byte stream, up to the first that does not decode.
fn messages(stream: &[u8]) -> Vec<Message> {
    let mut decoder = FrameDecoder::new();
    decoder.push(stream);
    let mut out = Vec::new();
    while let Ok(Some(frame)) = decoder.next_frame() {
        out.push(frame.message);
    }
    out
}

/// Checks what every refusal must be: a typed error, and a reason that encodes.
fn check_refusal(refusal: &Refusal, got: &Message) {
    if let Some(reply) = refusal.reply() {
        frame_bytes(&reply, 0).expect("a refusal encodes");
    }
    match got {
        // A peer's own refusal is reported, not answered.
        Message::Refused(_) => assert!(refusal.reply().is_none()),
        _ => assert!(
            refusal.reply().is_some(),
            "a refusal without a reason: {}",
            refusal.error
        ),
    }
}

/// Target `handshake`: drives the sans-I/O `ServerHandshake` and `ClientHandshake`
/// with messages decoded from the input, optionally repaired so that the fuzzer reaches
/// the later steps. Whatever comes, a side completes only if the peer proved it holds the
/// same token — bound to both nonces and to the identity the socket vouches for — and
/// every refusal is typed and, unless the peer itself refused, tells the peer why.
///
/// Layout of `data`: a mode byte, then frames (the messages "the peer" sends).
///
/// Mode bits: 0–1 the scenario (server, client, both with an attacker in the middle, or a
/// server fed every message in turn); 2 make a `Hello`/`Welcome`'s claimed identity ours;
/// 3 put a correctly computed proof in an `Auth`/`Welcome`; 4 compute that proof with the
/// wrong token; 5 make the version current.
pub fn handshake(data: &[u8]) -> HandshakeDepth {
    let Some((&mode, stream)) = data.split_first() else {
        return HandshakeDepth::Empty;
    };
    let msgs = messages(stream);
    let good = fuzz_session();
    let bad = Session::new(SessionToken::from_bytes([0x5F; 32]));
    let prover = if mode & 0x10 != 0 { &bad } else { &good };
    let cred = own_cred();
    let me = good.process();
    let fix_claim = mode & 0x04 != 0;
    let fix_proof = mode & 0x08 != 0;
    let fix_version = mode & 0x20 != 0;

    match mode & 3 {
        // Server: the peer's first message is its Hello, the second its Auth.
        0 => {
            let Some(mut hello) = msgs.first().cloned() else {
                return HandshakeDepth::NoMessage;
            };
            if let Message::Hello(h) = &mut hello {
                if fix_claim {
                    h.process = me;
                }
                if fix_version {
                    h.version = baton_messages::PROTOCOL_VERSION;
                }
            }
            let (state, welcome) = match ServerHandshake::on_hello(&good, &cred, hello.clone()) {
                Ok(ok) => ok,
                Err(r) => {
                    check_refusal(&r, &hello);
                    return HandshakeDepth::FirstStep;
                }
            };
            let Message::Hello(h) = &hello else {
                panic!("the server answered a {} with a Welcome", hello.kind());
            };
            assert_eq!(h.version, baton_messages::PROTOCOL_VERSION);
            assert_eq!(
                h.process, me,
                "a claim the socket does not vouch for passed"
            );
            let Message::Welcome(w) = welcome else {
                panic!("the server's answer is not a Welcome");
            };
            assert!(good.check_proof(Role::Server, &h.nonce, &w.nonce, &w.process, &w.proof));
            let expected = prover.proof(Role::Client, &h.nonce, &w.nonce, &h.process);
            let mut auth = msgs.get(1).cloned().unwrap_or(Message::Ping(0));
            if fix_proof {
                auth = Message::Auth(Auth { proof: expected });
            }
            match state.on_auth(&good, auth.clone()) {
                Ok(client) => {
                    assert_eq!(client, h.process);
                    let right = good.proof(Role::Client, &h.nonce, &w.nonce, &h.process);
                    assert_eq!(
                        auth,
                        Message::Auth(Auth { proof: right }),
                        "a wrong proof passed"
                    );
                    HandshakeDepth::Completed
                }
                Err(r) => {
                    check_refusal(&r, &auth);
                    HandshakeDepth::LaterStep
                }
            }
        }
        // Client: the peer's first message is the server's Welcome.
        1 => {
            let (state, hello) = ClientHandshake::start(&good).expect("getrandom works");
            let Message::Hello(h) = hello else {
                panic!("a client starts with a Hello");
            };
            let Some(mut welcome) = msgs.first().cloned() else {
                return HandshakeDepth::NoMessage;
            };
            if let Message::Welcome(w) = &mut welcome {
                if fix_claim {
                    w.process = me;
                }
                if fix_version {
                    w.version = baton_messages::PROTOCOL_VERSION;
                }
                if fix_proof {
                    w.proof = prover.proof(Role::Server, &h.nonce, &w.nonce, &w.process);
                }
            }
            match state.on_welcome(&good, &cred, welcome.clone()) {
                Ok((auth, server)) => {
                    let Message::Welcome(w) = &welcome else {
                        panic!("a client completed on a {}", welcome.kind());
                    };
                    assert_eq!(server, w.process);
                    assert_eq!(
                        w.process, me,
                        "a claim the socket does not vouch for passed"
                    );
                    let right = good.proof(Role::Server, &h.nonce, &w.nonce, &w.process);
                    assert_eq!(w.proof, right, "a wrong server proof passed");
                    let mine = good.proof(Role::Client, &h.nonce, &w.nonce, &me);
                    assert_eq!(auth, Message::Auth(Auth { proof: mine }));
                    HandshakeDepth::Completed
                }
                Err(r) => {
                    check_refusal(&r, &welcome);
                    HandshakeDepth::FirstStep
                }
            }
        }
        // Both sides, with an attacker in the middle who replaces the i-th message of the
        // exchange (Hello, Welcome, Auth) with the i-th input message, unless that one is a
        // `Ping` (pass the real one on). Mode 2: the client may hold the wrong token; mode
        // 3: the server may.
        _ => {
            let (client_session, server_session) = if mode & 3 == 2 {
                (prover, &good)
            } else {
                (&good, prover)
            };
            let same_token = client_session.token() == server_session.token();
            let mut forged_any = false;
            let mut pass = |i: usize, real: Message| -> Message {
                match msgs.get(i) {
                    None | Some(Message::Ping(_)) => real,
                    Some(forged) => {
                        forged_any = true;
                        forged.clone()
                    }
                }
            };
            let (client, hello) = ClientHandshake::start(client_session).expect("getrandom works");
            let hello = pass(0, hello);
            let mut reached = HandshakeDepth::FirstStep;
            let outcome = ServerHandshake::on_hello(server_session, &cred, hello).and_then(
                |(server, welcome)| {
                    reached = HandshakeDepth::LaterStep;
                    let welcome = pass(1, welcome);
                    let (auth, _) = client.on_welcome(client_session, &cred, welcome)?;
                    server.on_auth(server_session, pass(2, auth))
                },
            );
            if outcome.is_ok() {
                assert!(
                    same_token,
                    "a peer with the wrong token completed the handshake"
                );
                reached = HandshakeDepth::Completed;
            } else if !forged_any {
                assert!(
                    !same_token,
                    "an honest handshake failed: {:?}",
                    outcome.err()
                );
            }
            if msgs.is_empty() {
                // An honest handshake: nothing of the input took part.
                HandshakeDepth::NoMessage
            } else {
                reached
            }
        }
    }
}

/// Inputs that reach deep into each target, for a starting corpus and for the replay
/// test: valid streams, valid and resealed handles, complete handshakes.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use baton_messages::fuzzing::{encode_handle, fuzz_handle_key};
    use baton_messages::protocol::{AuthProof, Nonce, Offer, Release};
    use baton_messages::{
        ActorId, AllocationId, CudaIpcMemHandle, CudaPoolExportData, DType, ExporterId, Generation,
        HandleDigest, Layout, LeaseId, PROTOCOL_VERSION, SegmentName, Shape,
    };
    let me = crate::process::current();
    let handle = |raw: RawHandle, offset: u64, len: u64, layout: Option<Layout>| HandleMsg {
        version: PROTOCOL_VERSION,
        exporter: ExporterId {
            process: me,
            actor: ActorId::new(3),
        },
        alloc: AllocationId::new(17),
        generation: Generation::FIRST,
        backend: raw.backend().unwrap_or(BackendKind::Host),
        device: DeviceUuid::HOST,
        alloc_size: 8192,
        offset,
        len,
        layout,
        raw,
        fence: None,
        digest: HandleDigest::default(),
    };
    let host = RawHandle::HostSegment(
        SegmentName::new(format!(
            "/baton.{}.{}.17.0123456789abcdef",
            me.pid, me.start_ticks
        ))
        .expect("a valid name"),
    );
    let f32s = Layout::new(DType::F32, Shape::new([16, 32]).expect("rank 2"));
    let handles = [
        handle(host.clone(), 0, 8192, None),
        handle(host.clone(), 4096, 2048, Some(f32s.clone())),
        handle(
            RawHandle::CudaIpc(CudaIpcMemHandle([0x11; 64])),
            0,
            2048,
            Some(f32s.clone()),
        ),
        handle(RawHandle::CudaVmmFd { slot: Some(0) }, 0, 8192, None),
        // A pool allocation with the pool's descriptor, and one whose pool the importer
        // imported before.
        handle(
            RawHandle::CudaPool {
                pool: 2,
                pool_slot: Some(0),
                ptr: CudaPoolExportData([0x9c; 64]),
            },
            4096,
            4096,
            None,
        ),
        handle(
            RawHandle::CudaPool {
                pool: 2,
                pool_slot: None,
                ptr: CudaPoolExportData([0x9c; 64]),
            },
            0,
            2048,
            Some(f32s),
        ),
    ];
    let mut out = Vec::new();

    // frame_decoder: a seed byte, then frames.
    let mut stream = vec![3u8];
    for m in [
        Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            process: me,
            nonce: Nonce([1; 32]),
        }),
        Message::Offer(Box::new(Offer {
            lease: LeaseId::new(5),
            handle: handles[1].clone().sealed(&fuzz_handle_key()),
        })),
        Message::Release(Release {
            lease: LeaseId::new(5),
            fences: vec![baton_messages::FenceHandle::Event(
                baton_messages::IpcEventHandle([4; 64]),
            )],
        }),
        Message::Unmap(baton_messages::protocol::Unmap {
            alloc: AllocationId::new(5),
        }),
        Message::Unmapped(baton_messages::protocol::Unmapped {
            alloc: AllocationId::new(5),
        }),
        Message::Evict(baton_messages::protocol::Evict {
            alloc: AllocationId::new(6),
        }),
        Message::StatusRequest(baton_messages::protocol::StatusRequest {
            id: 1,
            scope: baton_messages::protocol::StatusScope::Tree,
            limit: 16,
        }),
        Message::Status(baton_messages::protocol::Status {
            id: 1,
            version: 1,
            json: "{}".into(),
        }),
        Message::Ping(7),
    ] {
        baton_messages::codec::encode_frame(&m, 0, &mut stream).expect("encodes");
    }
    out.push(("frame_decoder", stream));

    // frame_decoder: the forwarding messages (a relay's request, the exporter's answers,
    // the relayed offer).
    let mut stream = vec![5u8];
    for m in [
        Message::Forward(baton_messages::protocol::Forward {
            id: 1,
            lease: LeaseId::new(5),
            to: me,
        }),
        Message::Forwarded(Box::new(baton_messages::protocol::Forwarded {
            id: 1,
            outcome: Ok(Offer {
                lease: LeaseId::new(6),
                handle: handles[3].clone().sealed(&fuzz_handle_key()),
            }),
        })),
        Message::Forwarded(Box::new(baton_messages::protocol::Forwarded {
            id: 2,
            outcome: Err("the lease is back".into()),
        })),
        Message::Relayed(Box::new(baton_messages::protocol::Relayed {
            offer: Offer {
                lease: LeaseId::new(7),
                handle: handles[1].clone().sealed(&fuzz_handle_key()),
            },
        })),
    ] {
        baton_messages::codec::encode_frame(&m, 0, &mut stream).expect("encodes");
    }
    out.push(("frame_decoder", stream));

    // handle_msg: flags, length, first handle, second handle.
    for (i, h) in handles.iter().enumerate() {
        let first = encode_handle(&h.clone().sealed(&fuzz_handle_key()));
        let second = encode_handle(&handles[(i + 1) % handles.len()]);
        for flags in [0u8, 1, 3, 0x43] {
            let mut input = vec![flags];
            input.extend_from_slice(&(first.len() as u16).to_le_bytes());
            input.extend_from_slice(&first);
            input.extend_from_slice(&second);
            out.push(("handle_msg", input));
        }
    }

    // handshake: a mode, then the peer's messages.
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        process: me,
        nonce: Nonce([2; 32]),
    });
    let welcome = Message::Welcome(Welcome {
        version: PROTOCOL_VERSION,
        process: me,
        nonce: Nonce([3; 32]),
        proof: AuthProof([4; 32]),
    });
    let auth = Message::Auth(Auth {
        proof: AuthProof([5; 32]),
    });
    for (mode, msgs) in [
        (0x13u8, vec![]),
        (0x0cu8, vec![hello.clone(), auth.clone()]),
        (0x1c, vec![hello.clone(), auth.clone()]),
        (0x00, vec![hello.clone(), Message::Ping(1)]),
        (0x0d, vec![welcome.clone()]),
        (0x1d, vec![welcome.clone()]),
        (0x02, vec![]),
        (0x12, vec![]),
        (0x02, vec![Message::Ping(0), welcome]),
        (0x03, vec![hello, Message::Ping(0), auth]),
    ] {
        let mut input = vec![mode];
        for m in &msgs {
            baton_messages::codec::encode_frame(m, 0, &mut input).expect("encodes");
        }
        out.push(("handshake", input));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_pass_their_targets() {
        for (target, input) in seeds() {
            match target {
                "frame_decoder" => {
                    baton_messages::fuzzing::frame_decoder(&input);
                }
                "handle_msg" => {
                    handle_msg(&input);
                }
                "handshake" => {
                    handshake(&input);
                }
                other => panic!("unknown target {other}"),
            }
        }
    }
}
