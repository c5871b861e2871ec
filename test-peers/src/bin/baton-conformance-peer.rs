//! The helper process of the backend conformance tests (`tests/conformance.rs`): one role
//! per invocation, on the backend named by the first argument (`host-memfd`, `host-named`,
//! `host` (the flavor `BATON_HOST` picks), `cuda-legacy`, `cuda-vmm`, `cuda-pool`).
//!
//! Tests spawn it (`peer::exe("baton-conformance-peer")`), never fork, with the
//! session token in an inherited pipe (`BATON_TOKEN_FD`, read by `Session::from_env` at the
//! top of `main`) and a segment namespace in `BATON_SHM_NAMESPACE`. It uses
//! the public API only, as a real peer would. Exit status 0 when the role did what it
//! should; 1 with the reason on stderr otherwise.
//!
//! Roles (`BACKEND ROLE SOCKET ARGS…`):
//! - `import-check SOCKET EXPECT_HEX REPLY_OFFSET REPLY_LEN REPLY_SEED`: the first offer
//!   carries a corrupted handle, which must be refused with no driver open; the second is
//!   good: open it, check the BLAKE3 of the whole buffer, open it three more times (cache
//!   hits, no driver open), write the reply pattern, release. On CUDA, the thread's current
//!   context must be none before and after all that (Baton pushes and pops its own).
//! - `import-expect SOCKET EXPECT_HEX`: open the offer (waiting on its event), check the
//!   BLAKE3 of the whole buffer (fails on stale data), release. An event of an exporter in
//!   another PID namespace is refused, typed, before any driver call: the lease is given
//!   back and the exit status is 3.
//! - `import-fence SOCKET KIND EXPECT_HEX` (CUDA): a `Call` whose payload is a fence of
//!   KIND (`event`: the 64-byte IPC event handle; `counter`: `CounterFence::to_bytes`) and
//!   whose offer is a handle without an event: open it, make the backend stream wait on the
//!   fence (one wait), check the BLAKE3 of the whole buffer (fails on stale data), release.
//! - `import-slab SOCKET N`: take N offers of buffers carved from one slab, each filled with
//!   its index + 1; they must cost one driver open in all; release each.
//! - `import-hold SOCKET`: open the offer, read a byte, answer `Ping(1)`, hold until killed.
//! - `export-hold SOCKET SIZE`: allocate SIZE bytes filled with 0xAB, offer them (fd beside
//!   the frame for VMM and memfd), hold until killed.

use baton::ipc::cuda::{CounterFence, CudaBackend, CudaExport, FenceHandle};
use baton::ipc::{
    FrameFds, HostBackend, ImportCache, Imported, Link, LinkConfig, Session, SharedBackend, host,
};
use baton::messages::protocol::{Offer, Release};
use baton::messages::{Error as MessageError, IpcEventHandle, LeaseId, Message};
use std::sync::Arc;
use std::time::Duration;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const DEADLINE: Duration = Duration::from_secs(60);

/// The exit status of a role that refused an exporter's event as one across PID
/// namespaces (`Error::EventAcrossPidNamespaces`), its lease given back.
const EVENT_REFUSED_ACROSS: i32 = 3;

/// The backend under test, with its driver-open counter.
enum Subject {
    Host(Arc<HostBackend>),
    Cuda(Arc<CudaBackend>),
}

impl Subject {
    fn new(name: &str) -> Res<Self> {
        Ok(match name {
            "host" => Self::Host(Arc::new(HostBackend::new()?)),
            "host-memfd" => Self::Host(Arc::new(HostBackend::memfd()?)),
            "host-named" => Self::Host(Arc::new(HostBackend::with_namespace(
                &std::env::var(host::NAMESPACE_ENV)
                    .unwrap_or_else(|_| host::DEFAULT_NAMESPACE.to_owned()),
            )?)),
            "cuda-legacy" => Self::Cuda(Arc::new(CudaBackend::new(0, CudaExport::Legacy)?)),
            "cuda-vmm" => Self::Cuda(Arc::new(CudaBackend::new(0, CudaExport::Vmm)?)),
            "cuda-pool" => Self::Cuda(Arc::new(CudaBackend::new(0, CudaExport::Pool)?)),
            other => return Err(format!("unknown backend {other:?}").into()),
        })
    }

    fn backend(&self) -> SharedBackend {
        match self {
            Self::Host(b) => b.clone(),
            Self::Cuda(b) => b.clone(),
        }
    }

    /// CUDA: fails unless no context is current on this thread (the main thread never
    /// binds one: only Baton's calls could have left one behind).
    fn check_no_current_context(&self, when: &str) -> Res<()> {
        if let Self::Cuda(_) = self {
            let ctx = baton::ipc::cuda::current_context()?;
            ensure(ctx.is_null(), || {
                format!("{when}: Baton left a CUDA context current on the thread")
            })?;
        }
        Ok(())
    }

    /// Driver-level opens so far.
    fn opens(&self) -> u64 {
        match self {
            Self::Host(b) => b.opens(),
            Self::Cuda(b) => b.opens(),
        }
    }
}

/// The reply pattern the importer writes: byte `i` is `(i * 31 + seed) mod 256`.
fn reply_pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed)) as u8)
        .collect()
}

fn connect(socket: &str) -> Res<(Session, Link)> {
    // Taken at the top of `main` already; this is the same session.
    let session = Session::from_env()?;
    let link = Link::connect(socket, &LinkConfig::new(session.clone()))?;
    Ok((session, link))
}

fn take_offer(link: &mut Link) -> Res<(Offer, FrameFds)> {
    let received = link.recv_timeout(DEADLINE)?;
    match received.message {
        Message::Offer(offer) => Ok((*offer, received.fds)),
        other => Err(format!("expected an Offer, got {}", other.kind()).into()),
    }
}

fn digest_of(buffer: &Imported) -> Res<blake3::Hash> {
    Ok(blake3::hash(&buffer.to_vec()?))
}

fn release_and_wait_close(link: &mut Link, leases: &[LeaseId]) -> Res<()> {
    for &lease in leases {
        link.send(&Message::Release(Release::now(lease)), &[])?;
    }
    // Wait for the exporter to hang up, so it sees the releases before our EOF.
    match link.recv_timeout(DEADLINE) {
        Err(baton::ipc::Error::Closed) => Ok(()),
        Err(e) => Err(e.into()),
        Ok(r) => Err(format!("unexpected {}", r.message.kind()).into()),
    }
}

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Res<()> {
    if cond { Ok(()) } else { Err(what().into()) }
}

fn import_check(
    subject: &Subject,
    socket: &str,
    expect: &str,
    reply_offset: usize,
    reply_len: usize,
    seed: u64,
) -> Res<()> {
    subject.check_no_current_context("after making the backend")?;
    let (session, mut link) = connect(socket)?;
    let cache = ImportCache::new(session, [subject.backend()]);

    let (bad, mut fds) = take_offer(&mut link)?;
    match cache.open(&bad.handle, &mut fds) {
        Err(baton::ipc::Error::Message(MessageError::DigestMismatch)) => {}
        Err(e) => return Err(format!("corrupted handle refused, but as {e}").into()),
        Ok(_) => return Err("a corrupted handle was opened".into()),
    }
    ensure(subject.opens() == 0 && cache.stats().opens == 0, || {
        format!(
            "the corrupted handle reached the driver ({} opens)",
            subject.opens()
        )
    })?;
    drop(fds);
    link.send(&Message::Ping(1), &[])?;

    let (offer, mut fds) = take_offer(&mut link)?;
    let buffer = cache.open(&offer.handle, &mut fds)?;
    ensure(subject.opens() == 1, || {
        format!("{} driver opens for one handle", subject.opens())
    })?;
    let digest = digest_of(&buffer)?;
    ensure(digest.to_hex().as_str() == expect, || {
        format!("checksum mismatch: got {}", digest.to_hex())
    })?;
    let again: Vec<Imported> = (0..3)
        .map(|_| cache.open(&offer.handle, &mut fds))
        .collect::<Result<_, _>>()?;
    let stats = cache.stats();
    ensure(
        subject.opens() == 1 && stats.hits == 3 && stats.opens == 1,
        || {
            format!(
                "cache hits opened again: driver opens {}, {stats:?}",
                subject.opens()
            )
        },
    )?;
    drop(again);
    buffer.write(reply_offset, &reply_pattern(reply_len, seed))?;
    drop(buffer);
    ensure(cache.stats().live == 0, || {
        "mapping still open after the guards dropped".into()
    })?;
    subject.check_no_current_context("after opening, reading, writing and closing")?;
    eprintln!(
        "baton-conformance-peer: import-check ok: driver opens {}, {:?}",
        subject.opens(),
        cache.stats()
    );
    release_and_wait_close(&mut link, &[offer.lease])
}

fn import_expect(subject: &Subject, socket: &str, expect: &str) -> Res<()> {
    let (session, mut link) = connect(socket)?;
    let cache = ImportCache::new(session, [subject.backend()]);
    let (offer, mut fds) = take_offer(&mut link)?;
    ensure(
        offer.handle.fence.is_some() || !matches!(subject, Subject::Cuda(_)),
        || "a CUDA handle came without an event".into(),
    )?;
    let buffer = match cache.open(&offer.handle, &mut fds) {
        // An exporter in another PID namespace: its event is refused before any driver
        // call; the lease goes back, and the refusal is our exit status.
        Err(e @ baton::ipc::Error::EventAcrossPidNamespaces { .. }) => {
            release_and_wait_close(&mut link, &[offer.lease])?;
            return Err(e.into());
        }
        other => other?,
    };
    let digest = digest_of(&buffer)?;
    ensure(digest.to_hex().as_str() == expect, || {
        format!(
            "stale data: the buffer read before the exporter's work finished (got {})",
            digest.to_hex()
        )
    })?;
    drop(buffer);
    release_and_wait_close(&mut link, &[offer.lease])
}

fn import_fence(subject: &Subject, socket: &str, kind: &str, expect: &str) -> Res<()> {
    let Subject::Cuda(cuda) = subject else {
        return Err("fences are a CUDA matter".into());
    };
    let (session, mut link) = connect(socket)?;
    let exporter = link.peer().process;
    // Counter fences for us are written into our inbox: lend the exporter a lane first.
    if kind == "counter" {
        let grant = subject
            .backend()
            .ordering()
            .inbox_grant(&exporter)
            .ok_or("a counter-fence backend lends an inbox lane")?;
        link.send(&Message::FenceInbox(grant), &[])?;
    }
    let cache = ImportCache::new(session, [subject.backend()]);
    let received = link.recv_timeout(DEADLINE)?;
    let Message::Call(call) = received.message else {
        return Err(format!("expected a Call, got {}", received.message.kind()).into());
    };
    let mut fds = received.fds;
    ensure(call.type_name == kind, || {
        format!("a {} fence, expected {kind}", call.type_name)
    })?;
    let fence = match kind {
        "event" => FenceHandle::Event(IpcEventHandle(
            call.payload
                .as_slice()
                .try_into()
                .map_err(|_| "an event handle is 64 bytes")?,
        )),
        "counter" => FenceHandle::Counter(
            CounterFence::from_bytes(&call.payload).ok_or("a malformed counter fence")?,
        ),
        other => return Err(format!("unknown fence kind {other:?}").into()),
    };
    let [offer] = <[Offer; 1]>::try_from(call.offers).map_err(|_| "one offer expected")?;
    ensure(offer.handle.fence.is_none(), || {
        "the handle carries an event: the fence would not be what orders the read".into()
    })?;
    let buffer = cache.open(&offer.handle, &mut fds)?;
    subject
        .backend()
        .ordering()
        .check_fence(&offer.handle.exporter.process, &fence)?;
    cuda.wait_fence(&offer.handle.exporter.process, &fence)?;
    ensure(cuda.waits() == 1, || {
        format!("{} fence waits queued, expected 1", cuda.waits())
    })?;
    let digest = digest_of(&buffer)?;
    ensure(digest.to_hex().as_str() == expect, || {
        format!(
            "stale data: the buffer read before the exporter's work finished (got {})",
            digest.to_hex()
        )
    })?;
    drop(buffer);
    release_and_wait_close(&mut link, &[offer.lease])
}

fn import_slab(subject: &Subject, socket: &str, n: usize) -> Res<()> {
    let (session, mut link) = connect(socket)?;
    let cache = ImportCache::new(session, [subject.backend()]);
    let mut held = Vec::new();
    for i in 0..n {
        let (offer, mut fds) = take_offer(&mut link)?;
        let buffer = cache.open(&offer.handle, &mut fds)?;
        let want = vec![i as u8 + 1; buffer.len()];
        ensure(buffer.to_vec()? == want, || {
            format!("buffer {i} has wrong bytes")
        })?;
        held.push((offer.lease, buffer));
    }
    let stats = cache.stats();
    ensure(
        subject.opens() == 1 && stats.opens == 1 && stats.hits == n as u64 - 1,
        || {
            format!(
                "{n} slab buffers cost {} driver opens ({stats:?})",
                subject.opens()
            )
        },
    )?;
    let leases: Vec<LeaseId> = held.iter().map(|(l, _)| *l).collect();
    drop(held);
    release_and_wait_close(&mut link, &leases)
}

fn import_hold(subject: &Subject, socket: &str) -> Res<()> {
    let (session, mut link) = connect(socket)?;
    let cache = ImportCache::new(session, [subject.backend()]);
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

fn export_hold(subject: &Subject, socket: &str, size: usize) -> Res<()> {
    let (session, mut link) = connect(socket)?;
    let alloc = subject.backend().allocate(size)?;
    alloc.fill(0, alloc.size(), 0xAB)?;
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

fn parse<T: std::str::FromStr>(what: &str, s: &str) -> Res<T> {
    s.parse().map_err(|_| format!("bad {what}: {s:?}").into())
}

fn run(argv: &[&str]) -> Res<()> {
    let [backend, role, rest @ ..] = argv else {
        return Err("usage: BACKEND ROLE SOCKET ARGS…".into());
    };
    let subject = Subject::new(backend)?;
    match (*role, rest) {
        ("import-check", [socket, expect, offset, len, seed]) => import_check(
            &subject,
            socket,
            expect,
            parse("offset", offset)?,
            parse("length", len)?,
            parse("seed", seed)?,
        ),
        ("import-expect", [socket, expect]) => import_expect(&subject, socket, expect),
        ("import-fence", [socket, kind, expect]) => import_fence(&subject, socket, kind, expect),
        ("import-slab", [socket, n]) => import_slab(&subject, socket, parse("count", n)?),
        ("import-hold", [socket]) => import_hold(&subject, socket),
        ("export-hold", [socket, size]) => export_hold(&subject, socket, parse("size", size)?),
        _ => Err(format!("unknown role {argv:?}").into()),
    }
}

/// The command line: a backend, a role and the role's arguments.
#[derive(Debug, clap::Parser)]
#[command(
    name = "baton-conformance-peer",
    about = "The helper process of the backend conformance tests: one role per invocation, on one backend",
    after_help = "Backends: host-memfd, host-named, host, cuda-legacy, cuda-vmm, cuda-pool. Roles: import-check SOCKET EXPECT_HEX REPLY_OFFSET REPLY_LEN REPLY_SEED | import-expect SOCKET EXPECT_HEX | import-fence SOCKET KIND EXPECT_HEX | import-slab SOCKET N | import-hold SOCKET | export-hold SOCKET SIZE. The session token comes through the pipe named in BATON_TOKEN_FD."
)]
struct Cli {
    /// The backend.
    backend: String,
    /// The role.
    role: String,
    /// Its arguments.
    args: Vec<String>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    // The child's entry point: take the token (and close its pipe) before anything else.
    if let Err(e) = Session::from_env() {
        eprintln!("baton-conformance-peer: {e}");
        std::process::exit(1);
    }
    let args: Vec<String> = [cli.backend, cli.role]
        .into_iter()
        .chain(cli.args)
        .collect();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    if let Err(e) = run(&argv) {
        eprintln!("baton-conformance-peer: {e}");
        let across = matches!(
            e.downcast_ref::<baton::ipc::Error>(),
            Some(baton::ipc::Error::EventAcrossPidNamespaces { .. })
        );
        std::process::exit(if across { EVENT_REFUSED_ACROSS } else { 1 });
    }
}
