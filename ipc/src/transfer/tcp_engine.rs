//! The TCP engine: host memory between hosts, over the engine's own TCP connections — the
//! data plane beside host links' control plane ([`crate::tcp`]).
//!
//! Each (this engine, peer process) pair gets one data connection per direction, opened
//! lazily by the sender to the receiver's [`data_addr`](TcpEngine::data_addr) and
//! authenticated by the Noise handshake of host links (the session's pre-shared key, the
//! pinned keys of the [`TcpPolicy`](crate::tcp::TcpPolicy)): only session members
//! connect. On it, one transfer after another:
//!
//! ```text
//! receiver → sender   record [4, verdict]    (once, after the handshake: 0 welcome, else
//!                                             why it refuses the connection, then closes)
//! sender → receiver   record [1, id, len]    (Noise: encrypted, authenticated)
//!                     len bytes of payload   (in clear, for speed: as NCCL's sockets)
//!                     record [2, mac]        (keyed blake3 of the payload, under a key
//!                                             bound to the connection, id and len)
//! receiver → sender   record [3, id, status, room]
//! sender → receiver   record [5]             (goodbye: an idle sender closes; receives
//!                                             posted for it wait for its next connection)
//! ```
//!
//! **Whose connection it is.** A data connection belongs to the host link whose key opened
//! it: the receiver's node [`admit`](TcpEngine::admit)s each host-link peer (its process
//! as this node knows it, in its key's namespace, and its static key) before it posts a
//! receive for it, and a data connection is welcomed only from a static key and process
//! admitted together (it waits a handshake deadline for the admission, which the offer
//! that names its first transfer brings). A receive posted for a peer is matched only by
//! a connection of that key; another token holder — its own key, any claim — has no host
//! link under that key, so its connection is refused ([`DataRefusal::NoHostLink`]) and
//! never reaches the receive. The MAC key is bound to both static keys as well as to the
//! handshake (which binds them already: Noise XX hashes both).
//!
//! **Bounds** ([`DataLimits`]): at most `connections` data connections come in at once
//! (each holds a thread), at most `per_key` of them from one static key: the others are
//! refused after their handshake ([`DataRefusal::Full`], [`DataRefusal::FullForKey`]).
//! A connection that carries no transfer for `idle` is closed by the receiver (its thread
//! ends); a sender lets go of its idle connection after half that (with a goodbye, so
//! that the receiver does not fail receives posted for it) and connects again for its
//! next transfer, and checks before each transfer that the receiver has not closed it.
//! A node-wide [`CopyBudget`] ([`copy_budget`](TcpEngine::copy_budget)) bounds the bytes
//! of copies all the node's links receive at once.
//!
//! The MAC (version 3, key label `baton tcp transfer mac v3`) is
//! `keyed_blake3(keyed_blake3(K, id ‖ len), payload)`, K derived from the session's
//! pre-shared key, the connection's handshake hash and both static keys (the sender's
//! first). Versions 2 and 3 differ only in K. Version 1 hashed `id ‖ len ‖
//! payload` under K, which puts the payload off BLAKE3's chunk grid; version 2 keeps it on
//! the grid, so that the payload's 1 MiB pieces are subtrees that hashing threads hash
//! while the copy goes on (`tcp/mac.rs`): the copying threads only copy, and the transfer
//! runs at the speed of a plain socket copy where cores are free. The two versions do not
//! interoperate (a transfer between them fails as corrupt).
//!
//! Threat model: the payload crosses in clear, so an observer of the network between the
//! hosts reads it (as it reads NCCL's traffic); nobody outside the session can send or
//! change it unnoticed: the MAC key is derived from the session's pre-shared key and the
//! connection's handshake hash, and the MAC travels in an authenticated record, so a
//! changed byte fails the transfer ([`Error::TransferCorrupt`], on both sides) before
//! `wait` can say it landed. Use a network you would run NCCL on.
//!
//! Every wait has a deadline: a connection stalled longer than the engine's stall timeout
//! fails its transfer; [`Transfer::wait`] takes its own. `abort_peer` shuts the peer's
//! connections down and returns once no engine thread touches the memory of its
//! transfers.
//!
//! # Safety
//! Byte slices over a transfer's region are made only by the engine thread that holds the
//! transfer's touch ([`TransferSignal::begin_touch`] to `end_touch`), one chunk at a time,
//! within the region's bounds, and by hashing threads on its behalf, which read only bytes
//! already copied (or, on the sender, the source) and are waited out before the touch
//! ends (`tcp/mac.rs`); the `unsafe` contract of `send`/`recv` keeps the memory valid
//! until the transfer is finished or aborted, and an abort waits the touch out.

use super::{CopyBudget, EnginePeer, Region, Transfer, TransferEngine, TransferId, TransferSignal};
pub use crate::error::DataRefusal;
use crate::tcp::{self as host, Deadline, NodePublicKey, Opener, Sealer, TcpConfig};
use crate::{Error, MemPtr, Result};
use baton_messages::ProcessId;
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod mac;

use mac::{Hashers, PayloadMac};

/// Payload bytes written, or asked of one read, at once (between checks for an abort).
const CHUNK: usize = 4 << 20;

/// How far ahead of the copy a sender's hashing threads may hash its source.
const HASH_AHEAD: usize = 32 << 20;

const HEADER: u8 = 1;
const MAC: u8 = 2;
const ACK: u8 = 3;
const VERDICT: u8 = 4;
const BYE: u8 = 5;

/// Bounds on a TCP engine's data connections (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataLimits {
    /// Data connections that come in at once, in all (default 256).
    pub connections: usize,
    /// Data connections that come in at once from one static key (default 8: an honest
    /// node opens one per process it sends to).
    pub per_key: usize,
    /// How long an incoming data connection may carry no transfer before it is closed
    /// (default 5 minutes); a sender lets go of an idle connection after half of its own.
    pub idle: Duration,
}

impl Default for DataLimits {
    fn default() -> Self {
        DataLimits {
            connections: 256,
            per_key: 8,
            idle: Duration::from_secs(300),
        }
    }
}

impl DataRefusal {
    fn code(self) -> u8 {
        match self {
            DataRefusal::Full => 1,
            DataRefusal::FullForKey => 2,
            DataRefusal::NoHostLink => 3,
        }
    }

    fn of(code: u8) -> Option<DataRefusal> {
        match code {
            1 => Some(DataRefusal::Full),
            2 => Some(DataRefusal::FullForKey),
            3 => Some(DataRefusal::NoHostLink),
            _ => None,
        }
    }
}

/// What the receiver says of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Status {
    Landed = 0,
    Corrupt = 1,
    NotPosted = 2,
    SizeMismatch = 3,
    Aborted = 4,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Host memory an engine thread may touch while it holds the transfer's touch.
#[derive(Debug, Clone, Copy)]
struct Mem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `Mem` is an address the `send`/`recv` contract keeps valid (and, for `recv`,
// untouched by others) until the transfer is finished or aborted; the one engine thread
// that holds the transfer's touch is the only one that dereferences it.
unsafe impl Send for Mem {}

impl Mem {
    fn of(engine: &'static str, region: Region) -> Result<Mem> {
        match (region.ptr, region.device) {
            (MemPtr::Host(ptr), None) => Ok(Mem {
                ptr,
                len: region.len,
            }),
            _ => Err(Error::RegionUnsupported {
                engine,
                reason: "it moves host memory only: send device memory with the NCCL engine, or stage it in host memory",
            }),
        }
    }

    /// The bytes at `offset..offset + len`.
    ///
    /// # Safety
    /// The caller holds the transfer's touch; the range is within the region.
    unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        debug_assert!(offset + len <= self.len);
        let at = self.ptr.wrapping_add(offset);
        // SAFETY: the `send` contract keeps the region valid for reads while the caller
        // holds the touch, and the range is within it.
        unsafe { std::slice::from_raw_parts(at, len) }
    }

    /// The bytes at `offset..offset + len`, to write.
    ///
    /// # Safety
    /// The caller holds the transfer's touch; the range is within the region.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(offset + len <= self.len);
        let at = self.ptr.wrapping_add(offset);
        // SAFETY: the `recv` contract keeps the region valid for writes, and untouched by
        // anyone else, while the caller holds the touch; the range is within it.
        unsafe { std::slice::from_raw_parts_mut(at, len) }
    }
}

/// The connection that carries a transfer now, so that an abort can shut it down.
type Wire = Mutex<Option<Arc<TcpStream>>>;

fn cut(wire: &Wire) {
    if let Some(s) = lock(wire).as_ref() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

fn gone(id: TransferId, why: impl std::fmt::Display) -> Error {
    Error::TransferPeerGone {
        id: id.0,
        why: why.to_string(),
    }
}

/// A transfer's failure when its connection failed: a refusal (the receiver refused our
/// handshake: wrong token, unpinned key) or changed bytes as they are; else the peer is
/// gone.
fn failed(e: &Error, id: TransferId) -> Error {
    match e {
        Error::Refused { .. }
        | Error::BadToken
        | Error::HostKeyNotPinned { .. }
        | Error::Tampered { .. }
        | Error::HostClaimMismatch { .. }
        | Error::DataConnectionRefused { .. } => super::again(e, id),
        other => gone(id, other),
    }
}

/// One send waiting for its connection.
#[derive(Debug)]
struct Job {
    signal: TransferSignal,
    mem: Mem,
}

#[derive(Debug, Default)]
struct Queue {
    jobs: VecDeque<Job>,
    active: Option<TransferSignal>,
    closed: bool,
}

/// The sending connection to one peer.
#[derive(Debug)]
struct Outgoing {
    peer: EnginePeer,
    queue: Mutex<Queue>,
    more: Condvar,
    wire: Arc<Wire>,
}

impl Outgoing {
    /// Fails every queued transfer and the active one; no more are taken.
    fn close(&self, why: &Error) {
        let (jobs, active) = {
            let mut q = lock(&self.queue);
            q.closed = true;
            (std::mem::take(&mut q.jobs), q.active.take())
        };
        self.more.notify_all();
        for job in jobs {
            job.signal.finish(Err(failed(why, job.signal.id())));
        }
        if let Some(active) = active {
            active.abort(|| cut(&self.wire));
        }
        cut(&self.wire);
    }
}

/// A receive waiting for its bytes.
#[derive(Debug)]
struct Posted {
    signal: TransferSignal,
    mem: Mem,
    wire: Arc<Wire>,
    /// When it was posted: a receive aborted before its bytes came is dropped a stall
    /// timeout later (its sender never sent them), so aborted receives cannot pile up.
    since: Instant,
}

#[derive(Debug)]
struct Inner {
    config: TcpConfig,
    stall: Duration,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    outgoing: Mutex<HashMap<ProcessId, Arc<Outgoing>>>,
    posted: Mutex<HashMap<(ProcessId, u64), Posted>>,
    posted_changed: Condvar,
    incoming: Mutex<HashMap<ProcessId, Vec<Arc<TcpStream>>>>,
    /// Receives whose bytes are coming in now (taken from `posted`).
    active: Mutex<Vec<(ProcessId, TransferSignal, Arc<Wire>)>>,
    /// The threads that hash payloads beside their copy (see `mac`).
    hashers: Arc<Hashers>,
    limits: Mutex<DataLimits>,
    /// The host-link peers whose data connections are welcome, with their static keys.
    admitted: Mutex<HashMap<ProcessId, NodePublicKey>>,
    admitted_changed: Condvar,
    /// Incoming data connections now, in all and by static key.
    conns: Mutex<Conns>,
    budget: Arc<CopyBudget>,
}

#[derive(Debug, Default)]
struct Conns {
    total: usize,
    per_key: HashMap<[u8; 32], usize>,
}

/// One incoming data connection counted in [`Conns`], until dropped.
struct Counted<'a> {
    inner: &'a Inner,
    key: [u8; 32],
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        let mut c = lock(&self.inner.conns);
        c.total -= 1;
        if let Some(n) = c.per_key.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                c.per_key.remove(&self.key);
            }
        }
    }
}

/// Counts an incoming data connection from `key`, or refuses it past the limits.
fn count(inner: &Inner, key: [u8; 32]) -> std::result::Result<Counted<'_>, DataRefusal> {
    let limits = *lock(&inner.limits);
    let mut c = lock(&inner.conns);
    if c.total >= limits.connections {
        return Err(DataRefusal::Full);
    }
    let mine = c.per_key.entry(key).or_default();
    if *mine >= limits.per_key {
        return Err(DataRefusal::FullForKey);
    }
    *mine += 1;
    c.total += 1;
    Ok(Counted { inner, key })
}

/// Waits at most `within` until `peer` is admitted with `key`.
fn admission(
    inner: &Inner,
    peer: ProcessId,
    key: &[u8; 32],
    within: Duration,
) -> std::result::Result<(), DataRefusal> {
    let until = Instant::now() + within;
    let mut map = lock(&inner.admitted);
    loop {
        match map.get(&peer) {
            Some(k) if k.0 == *key => return Ok(()),
            // In its key's namespace a process names one key only; a match of another
            // key is refused all the same.
            Some(_) => return Err(DataRefusal::NoHostLink),
            None => {}
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || inner.stop.load(Ordering::Relaxed) {
            return Err(DataRefusal::NoHostLink);
        }
        map = inner
            .admitted_changed
            .wait_timeout(map, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// The TCP transfer engine (host memory). See the module docs for the wire and the
/// threat model.
#[derive(Debug)]
pub struct TcpEngine {
    inner: Arc<Inner>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl TcpEngine {
    /// An engine whose data connections come in at `addr` (port 0: any free port), with
    /// `config`'s session, key and policy, failing a transfer whose connection stalls for
    /// longer than `stall`.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn bind(addr: impl ToSocketAddrs, config: TcpConfig, stall: Duration) -> Result<Self> {
        let listener =
            TcpListener::bind(addr).map_err(Error::io("binding the TCP engine's listener"))?;
        let addr = listener
            .local_addr()
            .map_err(Error::io("reading a listener address"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let inner = Arc::new(Inner {
            config,
            stall,
            addr,
            stop: Arc::clone(&stop),
            outgoing: Mutex::new(HashMap::new()),
            posted: Mutex::new(HashMap::new()),
            posted_changed: Condvar::new(),
            incoming: Mutex::new(HashMap::new()),
            active: Mutex::new(Vec::new()),
            hashers: Hashers::new(Hashers::default_threads(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )),
            limits: Mutex::new(DataLimits::default()),
            admitted: Mutex::new(HashMap::new()),
            admitted_changed: Condvar::new(),
            conns: Mutex::new(Conns::default()),
            budget: Arc::new(CopyBudget::default()),
        });
        let acceptor = {
            let weak = Arc::downgrade(&inner);
            let caps = inner.config.caps();
            std::thread::Builder::new()
                .name("baton-tcp-engine".into())
                .spawn(move || {
                    host::serve(
                        listener,
                        caps,
                        stop,
                        "baton-tcp-data",
                        move |stream, slot| {
                            if let Some(inner) = weak.upgrade() {
                                incoming(&inner, stream, slot);
                            }
                        },
                    );
                })
                .map_err(Error::io("spawning the TCP engine's acceptor"))?
        };
        Ok(TcpEngine {
            inner,
            acceptor: Some(acceptor),
        })
    }

    /// Where its data connections come in.
    pub fn data_addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// How many threads hash payloads beside their copy: by default one per core beyond
    /// the two copying threads, at least two and at most four; none (the copying threads
    /// hash) on one core.
    pub fn hash_threads(&self) -> usize {
        self.inner.hashers.threads()
    }

    /// Sets [`hash_threads`](Self::hash_threads); threads already started stay, so a
    /// smaller count takes effect only before the first payload of more than 1 MiB.
    pub fn set_hash_threads(&self, threads: usize) {
        self.inner.hashers.set_threads(threads);
    }

    /// Welcomes data connections from `peer` (its process as this node knows it: the
    /// claim of its host link in its key's namespace) made with `key`, the static key of
    /// its host link, until [`abort_peer`](TransferEngine::abort_peer). A data connection
    /// of any other key or process is refused ([`DataRefusal::NoHostLink`]). Call it before
    /// posting the peer's receives.
    pub fn admit(&self, peer: &EnginePeer, key: NodePublicKey) {
        lock(&self.inner.admitted).insert(peer.process, key);
        self.inner.admitted_changed.notify_all();
    }

    /// Its bounds on data connections.
    pub fn data_limits(&self) -> DataLimits {
        *lock(&self.inner.limits)
    }

    /// Sets its bounds on data connections (for connections made from now on; an idle
    /// deadline also for those waiting for their next transfer, from that wait on).
    pub fn set_data_limits(&self, limits: DataLimits) {
        *lock(&self.inner.limits) = limits;
    }

    /// Incoming data connections now (counted from their handshake until they close).
    pub fn data_connections(&self) -> usize {
        lock(&self.inner.conns).total
    }

    /// The node-wide budget of copies received at once: one per engine, so one per node.
    pub fn copy_budget(&self) -> &Arc<CopyBudget> {
        &self.inner.budget
    }

    /// This engine as its peers name it: its process in the namespace of its key
    /// ([`remote_process`](crate::tcp::remote_process)), as a host link to it names it.
    pub fn as_peer(&self) -> EnginePeer {
        let config = &self.inner.config;
        EnginePeer {
            process: host::remote_process(&config.key.public(), config.session.process()),
            host: self.inner.config.host,
            data_addr: Some(self.inner.addr),
        }
    }

    /// The sending connection to `peer`, made if there is none (`map` is the locked
    /// `outgoing` map: a sender closes for idleness only under that lock, so a job queued
    /// under it is never left on a closed connection).
    fn outgoing(
        &self,
        map: &mut HashMap<ProcessId, Arc<Outgoing>>,
        peer: &EnginePeer,
    ) -> Result<Arc<Outgoing>> {
        if let Some(out) = map.get(&peer.process) {
            if !lock(&out.queue).closed {
                return Ok(Arc::clone(out));
            }
        }
        let out = Arc::new(Outgoing {
            peer: *peer,
            queue: Mutex::new(Queue::default()),
            more: Condvar::new(),
            wire: Arc::new(Mutex::new(None)),
        });
        let inner = Arc::clone(&self.inner);
        let thread_out = Arc::clone(&out);
        std::thread::Builder::new()
            .name("baton-tcp-send".into())
            .spawn(move || sending(&inner, &thread_out))
            .map_err(Error::io("spawning a TCP engine sender"))?;
        map.insert(peer.process, Arc::clone(&out));
        Ok(out)
    }
}

impl TransferEngine for TcpEngine {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn moves_device_memory(&self) -> bool {
        false
    }

    unsafe fn send(&self, peer: &EnginePeer, id: TransferId, src: Region) -> Result<Transfer> {
        let mem = Mem::of("tcp", src)?;
        if peer.data_addr.is_none() {
            return Err(Error::RegionUnsupported {
                engine: "tcp",
                reason: "the peer has no TCP data address: give its EnginePeer one",
            });
        }
        let mut map = lock(&self.inner.outgoing);
        let out = self.outgoing(&mut map, peer)?;
        let wire = Arc::clone(&out.wire);
        let (transfer, signal) = super::transfer_pair(id, move || cut(&wire));
        {
            let mut q = lock(&out.queue);
            if q.closed {
                signal.finish(Err(gone(id, "its connection closed")));
            } else {
                q.jobs.push_back(Job { signal, mem });
            }
        }
        drop(map);
        out.more.notify_all();
        Ok(transfer)
    }

    unsafe fn recv(&self, peer: &EnginePeer, id: TransferId, dst: Region) -> Result<Transfer> {
        let mem = Mem::of("tcp", dst)?;
        let wire: Arc<Wire> = Arc::new(Mutex::new(None));
        let (transfer, signal) = super::transfer_pair(id, {
            let wire = Arc::clone(&wire);
            move || cut(&wire)
        });
        let old = {
            let mut posted = lock(&self.inner.posted);
            let stall = self.inner.stall;
            posted.retain(|_, p| !(p.signal.is_finished() && p.since.elapsed() > stall));
            let since = Instant::now();
            posted.insert(
                (peer.process, id.0),
                Posted {
                    signal,
                    mem,
                    wire,
                    since,
                },
            )
        };
        if let Some(old) = old {
            old.signal.abort(|| cut(&old.wire));
        }
        self.inner.posted_changed.notify_all();
        Ok(transfer)
    }

    fn abort_peer(&self, peer: &EnginePeer) {
        abort_peer(&self.inner, peer.process);
    }
}

fn abort_peer(inner: &Inner, peer: ProcessId) {
    lock(&inner.admitted).remove(&peer);
    if let Some(out) = lock(&inner.outgoing).remove(&peer) {
        out.close(&Error::Closed);
    }
    for p in take_posted(inner, peer) {
        p.signal.abort(|| cut(&p.wire));
    }
    let active: Vec<_> = lock(&inner.active)
        .iter()
        .filter(|(p, ..)| *p == peer)
        .map(|(_, signal, wire)| (signal.clone(), Arc::clone(wire)))
        .collect();
    for (signal, wire) in active {
        signal.abort(|| cut(&wire));
    }
    if let Some(streams) = lock(&inner.incoming).remove(&peer) {
        for s in streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for TcpEngine {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        self.inner.admitted_changed.notify_all();
        self.inner.posted_changed.notify_all();
        let mut peers: Vec<ProcessId> = lock(&self.inner.outgoing).keys().copied().collect();
        peers.extend(lock(&self.inner.posted).keys().map(|(p, _)| *p));
        peers.extend(lock(&self.inner.incoming).keys().copied());
        peers.extend(lock(&self.inner.active).iter().map(|(p, ..)| *p));
        for p in peers {
            abort_peer(&self.inner, p);
        }
        self.inner.hashers.close();
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

/// The MAC key of one data connection: the session's pre-shared key, bound to the
/// connection's handshake and to both static keys, the sender's (`from`) first.
fn mac_key(config: &TcpConfig, hash: &[u8; 32], from: &[u8; 32], to: &[u8; 32]) -> [u8; 32] {
    let mut material = host::psk(&config.session).to_vec();
    material.extend_from_slice(hash);
    material.extend_from_slice(from);
    material.extend_from_slice(to);
    blake3::derive_key("baton tcp transfer mac v3", &material)
}

/// A data connection's state after its handshake.
struct Channel {
    stream: Arc<TcpStream>,
    sealer: Sealer,
    opener: Opener,
    key: [u8; 32],
    record: Vec<u8>,
    wire: Vec<u8>,
}

impl Channel {
    /// The channel of an established data connection; `sender`: we opened it.
    fn new(stream: TcpStream, est: host::Established, config: &TcpConfig, sender: bool) -> Channel {
        let (mine, theirs) = (config.key.public().0, est.remote_key);
        let (from, to) = if sender {
            (&mine, &theirs)
        } else {
            (&theirs, &mine)
        };
        Channel {
            key: mac_key(config, &est.hash, from, to),
            sealer: Sealer::new(Arc::clone(&est.transport)),
            opener: Opener::new(est.transport),
            stream: Arc::new(stream),
            record: vec![0u8; host::MAX_RECORD],
            wire: Vec::with_capacity(128),
        }
    }

    fn write_record(&mut self, plain: &[u8]) -> Result<()> {
        self.wire.clear();
        self.sealer.seal(plain, &mut self.wire)?;
        (&*self.stream)
            .write_all(&self.wire)
            .map_err(|e| host::io_error("sending a transfer", e))
    }

    /// The next record's plaintext (in `self.record`), its length.
    fn read_record(&mut self) -> Result<usize> {
        loop {
            if let Some(n) = self.opener.open(&mut self.record)? {
                return Ok(n);
            }
            let n = read_some(&self.stream, self.opener.spare())?;
            self.opener.commit(n);
        }
    }

    /// Reads exactly `out.len()` payload bytes (those buffered first).
    fn read_payload(&mut self, out: &mut [u8]) -> Result<()> {
        let mut got = 0;
        while got < out.len() {
            got += self.read_payload_some(&mut out[got..])?;
        }
        Ok(())
    }

    /// Reads some payload bytes into `out`, those buffered first: how many.
    fn read_payload_some(&mut self, out: &mut [u8]) -> Result<usize> {
        match self.opener.take_raw(out) {
            0 => read_some(&self.stream, out),
            n => Ok(n),
        }
    }
}

/// One read; end of stream is [`Error::Closed`].
fn read_some(mut stream: &TcpStream, out: &mut [u8]) -> Result<usize> {
    loop {
        match stream.read(out) {
            Ok(0) => return Err(Error::Closed),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(host::io_error("receiving a transfer", e)),
        }
    }
}

fn set_stall(stream: &TcpStream, stall: Option<Duration>) -> Result<()> {
    stream
        .set_read_timeout(stall)
        .and_then(|()| stream.set_write_timeout(stall))
        .map_err(Error::io("setting a socket timeout"))
}

/// Whether the receiver closed `stream` (checked without blocking before a transfer on a
/// connection that waited for it: a receiver closes a connection idle past its deadline).
fn closed_by_peer(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let r = stream.peek(&mut [0u8; 1]);
    let back = stream.set_nonblocking(false);
    match r {
        Ok(0) => true,
        // A record before our header: nothing the receiver sends unasked.
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock || back.is_err(),
    }
}

/// What the sender thread's wait for its next job gave.
enum Next {
    Job(Job),
    Closed,
    /// Idle past half its deadline: the connection was let go of (under the map lock).
    Idle,
}

/// Waits for `out`'s next job; after `idle` of none, lets the connection go.
fn next_job(inner: &Inner, out: &Outgoing, idle: Duration) -> (Next, bool) {
    let mut waited = false;
    let mut q = lock(&out.queue);
    loop {
        if q.closed {
            return (Next::Closed, waited);
        }
        if let Some(job) = q.jobs.pop_front() {
            q.active = Some(job.signal.clone());
            return (Next::Job(job), waited);
        }
        waited = true;
        let (back, timeout) = out
            .more
            .wait_timeout(q, idle)
            .unwrap_or_else(|p| p.into_inner());
        q = back;
        if timeout.timed_out() && q.jobs.is_empty() {
            // In the lock order of `send` (the map, then the queue), so that no job is
            // queued on a connection that is going.
            drop(q);
            let mut map = lock(&inner.outgoing);
            q = lock(&out.queue);
            if q.jobs.is_empty() && !q.closed {
                q.closed = true;
                if map
                    .get(&out.peer.process)
                    .is_some_and(|o| std::ptr::eq(Arc::as_ptr(o), out))
                {
                    map.remove(&out.peer.process);
                }
                return (Next::Idle, waited);
            }
        }
    }
}

/// The sender thread of one outgoing connection: connects, then sends its queue's jobs
/// one after another until closed, idle, or its connection fails. A connection the
/// receiver closed while it waited is made again before the next job.
fn sending(inner: &Inner, out: &Outgoing) {
    let why = 'conn: loop {
        let mut ch = match connect(inner, out) {
            Ok(ch) => ch,
            Err(e) => break e,
        };
        *lock(&out.wire) = Some(Arc::clone(&ch.stream));
        loop {
            let idle = lock(&inner.limits).idle / 2;
            let (next, waited) = next_job(inner, out, idle);
            let job = match next {
                Next::Job(job) => job,
                Next::Closed => break 'conn Error::Closed,
                Next::Idle => {
                    tracing::debug!(peer = %out.peer.process, "an idle data connection let go of");
                    let _ = ch.write_record(&[BYE]);
                    break 'conn Error::Closed;
                }
            };
            if waited && closed_by_peer(&ch.stream) {
                // The receiver let it go (idle): the job goes first on a new one.
                let mut q = lock(&out.queue);
                q.active = None;
                q.jobs.push_front(job);
                drop(q);
                let _ = ch.stream.shutdown(std::net::Shutdown::Both);
                continue 'conn;
            }
            let r = send_one(&mut ch, &job, &inner.hashers);
            lock(&out.queue).active = None;
            match r {
                Ok(outcome) => job.signal.finish(outcome),
                Err(e) => {
                    job.signal.finish(Err(failed(&e, job.signal.id())));
                    break 'conn Error::TransferPeerGone {
                        id: job.signal.id().0,
                        why: format!("an earlier transfer's connection failed: {e}"),
                    };
                }
            }
        }
    };
    let mut map = lock(&inner.outgoing);
    if map
        .get(&out.peer.process)
        .is_some_and(|o| std::ptr::eq(Arc::as_ptr(o), out))
    {
        map.remove(&out.peer.process);
    }
    drop(map);
    out.close(&why);
    // Transfers keep the wire (to cut it): the connection must not live on in it.
    if let Some(stream) = lock(&out.wire).take() {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
}

fn connect(inner: &Inner, out: &Outgoing) -> Result<Channel> {
    let config = &inner.config;
    let addr = out.peer.data_addr.ok_or(Error::Closed)?;
    let stream = TcpStream::connect_timeout(&addr, config.handshake_timeout)
        .map_err(Error::io("connecting to a TCP engine"))?;
    config.keepalive.apply(stream.as_fd())?;
    let deadline = Deadline::after(config.handshake_timeout, "TCP engine handshake");
    let est = host::noise_client(&stream, config, &deadline)?;
    if est.process() != out.peer.process {
        return Err(Error::HostClaimMismatch {
            claimed: out.peer.process,
            announced: est.process(),
        });
    }
    // The receiver's verdict: it may wait a handshake deadline of its own for the host
    // link that admits us.
    set_stall(&stream, Some(config.handshake_timeout * 2 + inner.stall))?;
    let mut ch = Channel::new(stream, est, config, true);
    let n = ch.read_record()?;
    match ch.record[..n] {
        [VERDICT, 0] => {}
        [VERDICT, code] => {
            return Err(Error::DataConnectionRefused {
                why: DataRefusal::of(code).ok_or(Error::Refused {
                    reason: baton_messages::protocol::RefuseReason::ProtocolViolation,
                })?,
            });
        }
        _ => {
            return Err(Error::Refused {
                reason: baton_messages::protocol::RefuseReason::ProtocolViolation,
            });
        }
    }
    set_stall(&ch.stream, Some(inner.stall))?;
    Ok(ch)
}

/// Sends one transfer and reads the receiver's verdict. `Err` is the connection's failure.
fn send_one(ch: &mut Channel, job: &Job, hashers: &Arc<Hashers>) -> Result<Result<()>> {
    let id = job.signal.id();
    if !job.signal.begin_touch() {
        return Ok(Err(Error::TransferAborted { id: id.0 }));
    }
    let len = job.mem.len;
    let sent = (|| {
        let mut header = [0u8; 17];
        header[0] = HEADER;
        header[1..9].copy_from_slice(&id.0.to_le_bytes());
        header[9..].copy_from_slice(&(len as u64).to_le_bytes());
        ch.write_record(&header)?;
        let key = mac::transfer_key(&ch.key, id.0, len as u64);
        // SAFETY: we hold the touch until `mac` is dropped (below, before `end_touch`), and
        // the `send` contract keeps the region valid and unchanged meanwhile.
        let mut mac = unsafe { PayloadMac::new(Some(hashers), key, job.mem.ptr, len) };
        // The whole source is there: hashing threads may run ahead of the copy (a bounded
        // way, so that a large send does not hold up the hashing of a receive).
        let ahead = if hashers.threads() > 0 { HASH_AHEAD } else { 0 };
        let mut offset = 0;
        while offset < len {
            if job.signal.is_aborted() {
                return Err(Error::TransferAborted { id: id.0 });
            }
            let n = CHUNK.min(len - offset);
            mac.landed((offset + n).saturating_add(ahead));
            // SAFETY: we hold the touch, and `offset + n <= len`.
            let chunk = unsafe { job.mem.bytes(offset, n) };
            (&*ch.stream)
                .write_all(chunk)
                .map_err(|e| host::io_error("sending a transfer", e))?;
            offset += n;
        }
        Ok(mac.finish())
    })();
    job.signal.end_touch();
    let mac = sent?;
    let mut trailer = [0u8; 33];
    trailer[0] = MAC;
    trailer[1..].copy_from_slice(mac.as_bytes());
    ch.write_record(&trailer)?;
    let n = ch.read_record()?;
    let ack = &ch.record[..n];
    if n != 18 || ack[0] != ACK || ack[1..9] != id.0.to_le_bytes() {
        return Err(Error::Refused {
            reason: baton_messages::protocol::RefuseReason::ProtocolViolation,
        });
    }
    let room = u64::from_le_bytes(ack[10..18].try_into().expect("8 bytes"));
    Ok(match ack[9] {
        s if s == Status::Landed as u8 => Ok(()),
        s if s == Status::Corrupt as u8 => Err(Error::TransferCorrupt { id: id.0 }),
        s if s == Status::SizeMismatch as u8 => Err(Error::TransferSizeMismatch {
            id: id.0,
            sent: len as u64,
            room,
        }),
        s if s == Status::Aborted as u8 => Err(gone(id, "the receiver aborted it")),
        _ => Err(gone(id, "the receiver posted no buffer for it in time")),
    })
}

/// An incoming data connection: its handshake, its verdict (counted within the limits,
/// admitted), then one transfer after another.
fn incoming(inner: &Arc<Inner>, stream: TcpStream, slot: host::Slot) {
    let config = &inner.config;
    let est = (|| {
        config.keepalive.apply(stream.as_fd())?;
        let deadline = Deadline::after(config.handshake_timeout, "TCP engine handshake");
        host::noise_server(&stream, config, &deadline)
    })();
    drop(slot);
    let est = match est {
        Ok(est) => est,
        Err(e) => {
            tracing::warn!(error = %e, "refused a TCP engine connection");
            return;
        }
    };
    let peer = est.process();
    let key = est.remote_key;
    let counted = count(inner, key)
        .and_then(|c| admission(inner, peer, &key, config.handshake_timeout).map(|()| c));
    let mut ch = Channel::new(stream, est, config, false);
    let verdict = match &counted {
        Ok(_) => 0,
        Err(why) => why.code(),
    };
    let told = set_stall(&ch.stream, Some(config.handshake_timeout))
        .and_then(|()| ch.write_record(&[VERDICT, verdict]));
    let _counted = match (counted, told) {
        (Ok(c), Ok(())) => c,
        (Err(why), _) => {
            tracing::warn!(%peer, key = %NodePublicKey(key), %why, "refused a TCP engine connection");
            let _ = ch.stream.shutdown(std::net::Shutdown::Both);
            return;
        }
        (Ok(_), Err(e)) => {
            tracing::debug!(%peer, error = %e, "a TCP engine connection ended before its verdict");
            return;
        }
    };
    lock(&inner.incoming)
        .entry(peer)
        .or_default()
        .push(Arc::clone(&ch.stream));
    let r = receiving(inner, peer, &mut ch);
    if let Err(e) = &r {
        tracing::debug!(error = %e, %peer, "a TCP engine connection ended");
    }
    let _ = ch.stream.shutdown(std::net::Shutdown::Both);
    let last = {
        let mut incoming = lock(&inner.incoming);
        // Not registered any more: `abort_peer` took it, and failed the peer's receives.
        incoming.get_mut(&peer).is_some_and(|list| {
            let before = list.len();
            list.retain(|s| !Arc::ptr_eq(s, &ch.stream));
            list.len() < before && list.is_empty()
        })
    };
    let why = match &r {
        // Let go of for idleness: the peer's next transfer comes on a new connection.
        Ok(Ended::Quiet) => None,
        Ok(Ended::Closed) => Some(Error::Closed),
        Err(e) => Some(super::again(e, TransferId(0))),
    };
    if let (true, Some(why)) = (last, why) {
        // The peer's data connection ended: receives posted for it will get no bytes.
        for p in take_posted(inner, peer) {
            p.signal.finish(Err(gone(p.signal.id(), &why)));
        }
    }
}

/// How a data connection ended without a failure.
enum Ended {
    /// The sender closed it, or the engine stops.
    Closed,
    /// Idle: the sender said goodbye, or it carried nothing for the idle deadline.
    Quiet,
}

/// Takes the receives posted for `peer`.
fn take_posted(inner: &Inner, peer: ProcessId) -> Vec<Posted> {
    let mut map = lock(&inner.posted);
    let keys: Vec<_> = map.keys().filter(|(p, _)| *p == peer).copied().collect();
    keys.into_iter().filter_map(|k| map.remove(&k)).collect()
}

fn receiving(inner: &Inner, peer: ProcessId, ch: &mut Channel) -> Result<Ended> {
    loop {
        if inner.stop.load(Ordering::Relaxed) {
            return Ok(Ended::Closed);
        }
        let idle = lock(&inner.limits).idle;
        set_stall(&ch.stream, Some(idle))?;
        let n = match ch.read_record() {
            Ok(n) => n,
            Err(Error::Closed) if ch.opener.buffered() == 0 => return Ok(Ended::Closed),
            Err(Error::Timeout { .. }) if ch.opener.buffered() == 0 => {
                tracing::debug!(%peer, ?idle, "closed an idle data connection");
                return Ok(Ended::Quiet);
            }
            Err(e) => return Err(e),
        };
        set_stall(&ch.stream, Some(inner.stall))?;
        if ch.record[..n] == [BYE] {
            return Ok(Ended::Quiet);
        }
        let header = &ch.record[..n];
        if n != 17 || header[0] != HEADER {
            return Err(Error::Refused {
                reason: baton_messages::protocol::RefuseReason::ProtocolViolation,
            });
        }
        let id = TransferId(u64::from_le_bytes(header[1..9].try_into().expect("8")));
        let len = u64::from_le_bytes(header[9..17].try_into().expect("8"));
        let posted = wait_posted(inner, peer, id);
        if let Some(p) = &posted {
            lock(&inner.active).push((peer, p.signal.clone(), Arc::clone(&p.wire)));
        }
        let r = receive_one(ch, id, len, posted.as_ref(), &inner.hashers);
        if let Some(p) = &posted {
            lock(&inner.active).retain(|(_, s, _)| !s.same(&p.signal));
        }
        let (status, room, corrupt) = r?;
        let mut ack = [0u8; 18];
        ack[0] = ACK;
        ack[1..9].copy_from_slice(&id.0.to_le_bytes());
        ack[9] = status as u8;
        ack[10..].copy_from_slice(&room.to_le_bytes());
        ch.write_record(&ack)?;
        if corrupt {
            return Err(Error::TransferCorrupt { id: id.0 });
        }
    }
}

/// The receive posted for `id`, waiting up to the stall timeout for it.
fn wait_posted(inner: &Inner, peer: ProcessId, id: TransferId) -> Option<Posted> {
    let until = Instant::now() + inner.stall;
    let mut map = lock(&inner.posted);
    loop {
        if let Some(p) = map.remove(&(peer, id.0)) {
            return Some(p);
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || inner.stop.load(Ordering::Relaxed) {
            return None;
        }
        map = inner
            .posted_changed
            .wait_timeout(map, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Receives one transfer's payload and MAC. Returns the status to acknowledge, the room
/// of the receiving region, and whether the bytes were corrupt; `Err` is the connection's
/// failure (the posted receive fails with it).
fn receive_one(
    ch: &mut Channel,
    id: TransferId,
    len: u64,
    posted: Option<&Posted>,
    hashers: &Arc<Hashers>,
) -> Result<(Status, u64, bool)> {
    let Some(posted) = posted else {
        discard(ch, len)?;
        return Ok((Status::NotPosted, 0, false));
    };
    let signal = &posted.signal;
    let room = posted.mem.len as u64;
    if signal.is_aborted() {
        // Aborted or declined before its bytes came.
        discard(ch, len)?;
        return Ok((Status::Aborted, room, false));
    }
    if len != room {
        discard(ch, len)?;
        signal.finish(Err(Error::TransferSizeMismatch {
            id: id.0,
            sent: len,
            room,
        }));
        return Ok((Status::SizeMismatch, room, false));
    }
    *lock(&posted.wire) = Some(Arc::clone(&ch.stream));
    if !signal.begin_touch() {
        discard(ch, len)?;
        return Ok((Status::Aborted, room, false));
    }
    let landed = (|| {
        let mem = posted.mem;
        let key = mac::transfer_key(&ch.key, id.0, len);
        // SAFETY: we hold the touch until `mac` is dropped (at the end of this closure,
        // before `end_touch`), the `recv` contract keeps the region valid and ours
        // meanwhile, and this thread writes only bytes past those it says have landed.
        let mut mac = unsafe { PayloadMac::new(Some(hashers), key, mem.ptr, mem.len) };
        let mut offset = 0;
        while offset < mem.len {
            if signal.is_aborted() {
                return Ok(None);
            }
            let n = CHUNK.min(mem.len - offset);
            // SAFETY: we hold the touch, and `offset + n <= len`; the hashing threads read
            // only bytes before `offset`.
            let chunk = unsafe { mem.bytes_mut(offset, n) };
            offset += ch.read_payload_some(chunk)?;
            mac.landed(offset);
        }
        Ok(Some(mac.finish()))
    })();
    signal.end_touch();
    let mac = match landed {
        Ok(Some(mac)) => mac,
        Ok(None) => {
            // Aborted halfway (its connection is being shut down): the connection ends.
            return Err(Error::TransferAborted { id: id.0 });
        }
        Err(e) => {
            signal.finish(Err(gone(id, &e)));
            return Err(e);
        }
    };
    let n = match ch.read_record() {
        Ok(n) => n,
        Err(e) => {
            signal.finish(Err(gone(id, &e)));
            return Err(e);
        }
    };
    let trailer = &ch.record[..n];
    let ok = n == 33
        && trailer[0] == MAC
        && blake3::Hash::from_bytes(trailer[1..].try_into().expect("32 bytes")) == mac;
    if ok {
        signal.finish(Ok(()));
        Ok((Status::Landed, room, false))
    } else {
        signal.finish(Err(Error::TransferCorrupt { id: id.0 }));
        Ok((Status::Corrupt, room, true))
    }
}

/// Reads past a payload nobody receives, and its MAC record.
fn discard(ch: &mut Channel, len: u64) -> Result<()> {
    let mut scratch = vec![0u8; CHUNK.min(usize::try_from(len).unwrap_or(CHUNK)).max(1)];
    let mut left = len;
    while left > 0 {
        let n = scratch
            .len()
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        ch.read_payload(&mut scratch[..n])?;
        left -= n as u64;
    }
    ch.read_record().map(drop)
}

#[cfg(test)]
mod tests;
