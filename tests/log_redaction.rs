//! Raw handle bytes never appear in logs.
//!
//! One test (this binary installs a process-wide subscriber): every event and span at TRACE
//! level is captured while two nodes in this process hand buffers back and forth over a
//! real socket — calls with buffers both ways, reads, releases, a revoke, frees (`Gone`) —
//! and while bad peers are refused: a handle the node cannot open (CUDA bytes at a
//! host-only node), a corrupted handle, a peer with the wrong token. Then the log is searched
//! for every secret in every form a careless `{:?}`, `{:x}` or `{}` would print it: the
//! host segment names (and their random tags), the raw CUDA handle bytes, the session token.

#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use baton::Session;
use baton::actors::{Allocate, Buffer, BufferOwner, Lease, Node, Revoke, RevokeRequested};
use baton::ipc::{Backend, HostBackend, Link, LinkConfig, SharedBackend, host};
use baton::messages::protocol::Offer;
use baton::messages::{CudaIpcMemHandle, LeaseId, Message, RawHandle, SessionToken};
use msgs::*;
use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::spawn_blocking;

const DEADLINE: Duration = Duration::from_secs(30);

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The importer side's actor: keeps leases, gives them back on request or revoke, and
/// makes buffers of its own to share back.
struct Keeper {
    owner: Addr<BufferOwner>,
    held: HashMap<LeaseId, Lease<u32>>,
}

impl Actor for Keeper {
    type Context = Context<Self>;
}

impl Handler<Hold> for Keeper {
    type Result = usize;
    fn handle(&mut self, msg: Hold, _: &mut Context<Self>) -> usize {
        for s in msg.buffers {
            let lease = s.open().unwrap();
            assert_eq!(lease.to_vec().unwrap()[1], 1);
            self.held.insert(lease.id(), lease);
        }
        self.held.len()
    }
}

impl Handler<DropHeld> for Keeper {
    type Result = usize;
    fn handle(&mut self, _: DropHeld, _: &mut Context<Self>) -> usize {
        let n = self.held.len();
        self.held.clear();
        n
    }
}

impl Handler<RevokeRequested> for Keeper {
    type Result = ();
    fn handle(&mut self, msg: RevokeRequested, _: &mut Context<Self>) {
        self.held.remove(&msg.lease);
    }
}

impl Handler<MakeBuffers> for Keeper {
    type Result = ResponseFuture<Made>;
    fn handle(&mut self, msg: MakeBuffers, _: &mut Context<Self>) -> Self::Result {
        let owner = self.owner.clone();
        Box::pin(async move {
            let mut buffers = Vec::new();
            for _ in 0..msg.n {
                let b: Buffer<u32> = owner
                    .send(Allocate::vector(msg.len.into()))
                    .await
                    .unwrap()
                    .unwrap();
                b.write_at(0, &[msg.seed]).unwrap();
                buffers.push(b.share());
            }
            Made { buffers }
        })
    }
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn segment_names(ns: &str) -> Vec<String> {
    host::list_segments(ns)
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect()
}

/// Every way a careless log line could print `bytes`: hex either case, decimal lists
/// (`{:?}` of a slice or array), and the text itself when it is text.
fn printed_forms(bytes: &[u8]) -> Vec<String> {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let window = &bytes[..bytes.len().min(8)];
    let decimal = |sep: &str| {
        window
            .iter()
            .map(u8::to_string)
            .collect::<Vec<_>>()
            .join(sep)
    };
    let mut forms = vec![
        hex.clone(),
        hex.to_uppercase(),
        hex[..16.min(hex.len())].to_owned(),
        hex[..16.min(hex.len())].to_uppercase(),
        decimal(", "),
        decimal(","),
        format!("{window:?}").trim_end_matches(']').to_owned(),
        format!("{window:x?}").trim_end_matches(']').to_owned(),
        format!("{window:X?}").trim_end_matches(']').to_owned(),
        format!("{window:02x?}").trim_end_matches(']').to_owned(),
        format!("{window:02X?}").trim_end_matches(']').to_owned(),
    ];
    if let Ok(text) = std::str::from_utf8(bytes) {
        forms.push(text.to_owned());
        forms.push(format!("{text:?}"));
    }
    forms
}

#[test]
fn no_raw_handle_bytes_segment_names_or_tokens_reach_the_log() {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");

    let (ns_a, ns_b, ns_r) = (
        peer::namespace("loga"),
        peer::namespace("logb"),
        peer::namespace("logr"),
    );
    let session = Session::generate().unwrap();
    let mut secrets: BTreeSet<Vec<u8>> = BTreeSet::new();
    secrets.insert(session.token().as_bytes().to_vec());
    secrets.insert(session.token().to_hex().into_bytes());
    let cuda_bytes: [u8; 64] = std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(11));
    secrets.insert(cuda_bytes.to_vec());

    let names = System::new().block_on({
        let (session, ns_a, ns_b, ns_r) =
            (session.clone(), ns_a.clone(), ns_b.clone(), ns_r.clone());
        async move {
            let mut names = Vec::new();
            let backend =
                |ns: &str| -> SharedBackend { Arc::new(HostBackend::with_namespace(ns).unwrap()) };
            let a = Node::new(session.clone(), backend(&ns_a));
            let b = Node::new(session.clone(), backend(&ns_b));
            let (_tmp, dir) = peer::socket_dir();
            let listening = b.listen(&dir, "b.sock").unwrap();
            let owner_a = BufferOwner::new(&a).start();
            let owner_b = BufferOwner::new(&b).start();
            let keeper = Keeper {
                owner: owner_b,
                held: HashMap::new(),
            }
            .start();
            b.register::<Hold>("holder", keeper.clone().recipient());
            b.register::<DropHeld>("holder.drop", keeper.clone().recipient());
            b.register::<MakeBuffers>("exporter", keeper.clone().recipient());
            b.on_revoke(keeper.recipient());
            let to_b = a.connect(listening.path()).await.unwrap();

            // A's buffers to B, read there.
            let mut bufs = Vec::new();
            for _ in 0..3 {
                let buf: Buffer<u32> = owner_a.send(Allocate::vector(1024)).await.unwrap().unwrap();
                buf.write_at(0, &[0, 1, 2]).unwrap();
                bufs.push(buf);
            }
            let held = to_b
                .remote::<Hold>("holder")
                .send(Hold {
                    buffers: bufs.iter().map(Buffer::share).collect(),
                })
                .await
                .unwrap();
            assert_eq!(held, 3);
            names.extend(segment_names(&ns_a));

            // A revokes one; B gives it back.
            owner_a
                .send(Revoke {
                    buffer: bufs[0].id(),
                    within: DEADLINE,
                })
                .await
                .unwrap()
                .unwrap();

            // B's buffers to A, read and released here.
            let made = to_b
                .remote::<MakeBuffers>("exporter")
                .send(MakeBuffers {
                    n: 2,
                    len: 64,
                    seed: 9,
                })
                .await
                .unwrap();
            names.extend(segment_names(&ns_b));
            for s in made.buffers {
                assert_eq!(s.open().unwrap().to_vec().unwrap()[0], 9);
            }
            assert_eq!(
                to_b.remote::<DropHeld>("holder.drop")
                    .send(DropHeld)
                    .await
                    .unwrap(),
                2,
                "the revoked lease went back already"
            );
            drop(bufs); // freed: Gone goes to B
            eventually("A's buffers freed", || segment_names(&ns_a).is_empty()).await;

            // Bad peers at B: a CUDA handle B cannot open, and a corrupted host handle.
            let rogue = HostBackend::with_namespace(&ns_r).unwrap();
            let alloc = rogue.allocate(4096).unwrap();
            names.extend(segment_names(&ns_r));
            let mut cuda = alloc.handle(&session).build().unwrap();
            cuda.backend = baton::messages::BackendKind::CudaLegacy;
            cuda.raw = RawHandle::CudaIpc(CudaIpcMemHandle(cuda_bytes));
            let cuda = cuda.sealed(session.handle_key());
            let mut corrupt = alloc.handle(&session).build().unwrap();
            corrupt.len -= 1;
            // A CUDA handle at a host-only node cannot be opened there: refused, the lease
            // given back, the link kept. A corrupted one is the peer's fault: dropped.
            for (handle, refused) in [(cuda, true), (corrupt, false)] {
                let (path, config) = (
                    listening.path().to_owned(),
                    LinkConfig::new(session.clone()),
                );
                spawn_blocking(move || {
                    let mut link = Link::connect(path, &config).unwrap();
                    let offer = Message::Offer(Box::new(Offer {
                        lease: LeaseId::new(1),
                        handle,
                    }));
                    link.send(&offer, &[]).unwrap();
                    // Skipping heartbeat pings, the next thing we read is the answer.
                    let answer = loop {
                        match link.recv_timeout(DEADLINE) {
                            Ok(r) if matches!(r.message, Message::Ping(_)) => continue,
                            other => break other,
                        }
                    };
                    if refused {
                        assert!(
                            matches!(&answer, Ok(r) if r.message == Message::Release(baton::messages::protocol::Release::now(LeaseId::new(1)))),
                            "B gives the lease back: {answer:?}"
                        );
                    } else {
                        // B drops the link at once: the end of the stream (a reset reads the
                        // same), with no frame before it. A timeout would mean B kept it.
                        assert!(
                            matches!(answer, Err(baton::ipc::Error::Closed)),
                            "B did not drop the rogue link: {answer:?}"
                        );
                    }
                })
                .await
                .unwrap();
            }
            drop(alloc);

            // A peer with the wrong token.
            let wrong = Node::new(
                Session::new(SessionToken::from_bytes([0x77; 32])),
                backend(&peer::namespace("logw")),
            );
            assert!(wrong.connect(listening.path()).await.is_err());

            to_b.close();
            eventually("B's buffers freed", || segment_names(&ns_b).is_empty()).await;
            eventually("links down", || {
                a.peers().is_empty() && b.peers().is_empty()
            })
            .await;
            names
        }
    });
    assert!(names.len() >= 6, "saw the segments: {names:?}");
    for name in &names {
        secrets.insert(name.clone().into_bytes());
        secrets.insert(format!("/{name}").into_bytes());
        // The random tag is what makes a name unguessable: it alone must not leak either.
        let tag = name.rsplit('.').next().unwrap();
        assert_eq!(tag.len(), 16);
        secrets.insert(tag.as_bytes().to_vec());
    }

    let log = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    if std::env::var_os("BATON_SHOW_LOG").is_some() {
        eprintln!("{log}");
    }
    // The search finds what a careless line would print.
    for careless in [
        format!("{cuda_bytes:?}"),
        format!("{:x?}", &cuda_bytes[..]),
        format!("{:02X?}", &cuda_bytes[..]),
        format!("{:?}", session.token().as_bytes()),
        format!("raw={}", session.token().to_hex()),
        format!("segment={:?}", names[0]),
    ] {
        let found = secrets
            .iter()
            .flat_map(|s| printed_forms(s))
            .any(|f| f.len() >= 8 && careless.contains(&f));
        assert!(found, "the search would miss {careless}");
    }
    // The capture worked, at TRACE, through the whole handoff and the refusals.
    for expected in [
        "link established",
        "mapped",
        "released",
        "revoking",
        "buffer freed",
        "host segment created",
        "no backend here opens CudaLegacy",
        "digest does not verify",
        "refused a connection",
    ] {
        assert!(log.contains(expected), "the log lacks {expected:?}:\n{log}");
    }
    let mut leaks = Vec::new();
    for secret in &secrets {
        for form in printed_forms(secret) {
            if form.len() >= 8 && log.contains(&form) {
                leaks.push(form);
            }
        }
    }
    assert!(leaks.is_empty(), "secrets in the log: {leaks:?}");
    eprintln!(
        "log_redaction: {} log lines, {} bytes, {} secrets in {} forms each: none found",
        log.lines().count(),
        log.len(),
        secrets.len(),
        printed_forms(b"abcdefgh").len()
    );
}
