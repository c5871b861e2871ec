//! The NCCL engine: device memory between nodes on different hosts, over NCCL
//! point-to-point (`ncclSend`/`ncclRecv`), NCCL loaded at run time (builds need no NCCL).
//!
//! - Two 2-rank communicators per peer node, one per direction (the one this node sends
//!   on, the one it receives on), made lazily when a transfer needs one and cached. One
//!   direction per communicator: NCCL runs a communicator's operations in order, so a
//!   large send each way on one communicator would each wait for a receive queued behind
//!   the other's send.
//! - The rendezvous is the caller's: the engine gives the control plane the bytes to carry
//!   to a peer (a [`RendezvousSink`]), and takes the peer's ([`NcclEngine::on_rendezvous`]).
//!   They hold an `ncclUniqueId`, which opens the maker's bootstrap socket: carry them only
//!   over the authenticated link. The sending side of a direction offers its communicator
//!   when its first transfer needs it; the receiving side queues its receives until the
//!   offer comes (or their deadline). The lower node identity is rank 0.
//! - Rendezvous follow the authenticated link, never what the bytes say (issue 45): the
//!   engine keys a peer's communicators by the [`EnginePeer`] its link gives (a remote
//!   process id lives in the namespace of the key the link proved), so a token holder
//!   reaches only its own communicators, whatever it claims. A unique id names the
//!   bootstrap socket that joining it connects to; the engine joins only one on the
//!   peer's own host — the IP address its host link runs to — and refuses any other
//!   ([`Error::RendezvousElsewhere`]) before its state is touched, so a peer cannot make
//!   this node connect to an address of its choosing nor disturb another communicator.
//!   An honest peer must therefore run NCCL's bootstrap on the interface of its host link
//!   (`NCCL_SOCKET_IFNAME`). What the check cannot cover: once joined, the addresses
//!   NCCL's own bootstrap exchanges (the other rank's, its network transport's) come from
//!   the peer's NCCL unchecked — NCCL's bootstrap is not authenticated; keep NCCL's
//!   ports inside the deployment's network.
//! - NCCL matches point-to-point operations by order: per peer and direction, the receiver
//!   must start its receives in the order the sender started the matching sends, with the
//!   same lengths (the engine launches in the order transfers are started).
//! - A watchdog thread polls each communicator's `ncclCommGetAsyncError`, each operation's
//!   completion and each deadline. On an error, a deadline, [`Transfer::abort`] or
//!   [`TransferEngine::abort_peer`] it calls `ncclCommAbort` (never `ncclCommDestroy`, which
//!   waits for a stuck communicator) and only then fails the transfers: a transfer that
//!   finished with an `Err` is one NCCL no longer touches. The next transfer makes a fresh
//!   communicator.
//! - Aborts run concurrently, each on a thread of its own, and all of a peer's (both
//!   directions) start together. `ncclCommAbort` sets its communicator's abort flag, then
//!   frees host memory, which waits for every kernel of the context — also the kernel of
//!   another communicator, which leaves only when *its* abort flag is set. One abort behind
//!   another therefore deadlocks when the second communicator's kernel still runs: the
//!   receiver of a sender killed mid-copy, with a send communicator to that sender as well,
//!   hung so (NVIDIA/nccl #564 describes the same). Concurrent aborts need NCCL 2.19 or
//!   newer (#992), which the engine requires.
//! - A [`Transfer::wait`] that times out leaves the transfer running (the engine's own
//!   per-transfer limit, [`NcclConfig`], stops it); [`Transfer::abort`] stops it at once
//!   and returns once NCCL no longer touches its memory.
//! - NVLink SHARP (multicast) stays off: before NCCL is loaded the process's
//!   `NCCL_NVLS_ENABLE` is set to `0` if unset (a launcher that wants otherwise sets it),
//!   and Baton never calls `cuMulticastCreate`.
//!
//! The lifecycle is the I/O-free state machine of `comm` (property-tested); the NCCL calls
//! go through the `api::Nccl` trait, implemented by the library and by a fake in tests.
//!
//! # Safety
//!
//! The FFI lives in `library` (its own overview). Here, `send`/`recv` are `unsafe` for the
//! memory contract of [`TransferEngine`]: the engine hands a region's address to NCCL only
//! while its transfer is unfinished, and finishes a launched transfer only once its
//! operation completed or its communicator's `ncclCommAbort` returned (the order of the
//! `comm` table's actions, checked by its model test). Its [`TransferSignal`] counts as
//! touching the memory from the start until that finish, so [`Transfer::abort`] returns
//! only after it.

use crate::tcp::HostId;
use crate::transfer::{
    EnginePeer, Region, Transfer, TransferEngine, TransferId, TransferSignal, transfer_pair,
};
use crate::{Error, MemPtr, Result};
use api::{CommHandle, Nccl, OpHandle, Progress, Rank, UniqueId};
use baton_messages::ProcessId;
use comm::{Action, Attempt, CommTable, Failure, Offer, Phase, Tid};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod api;
mod comm;
#[allow(unsafe_code)]
mod library;

pub use library::{NCCL_LIB_ENV, available};

/// Where the engine's rendezvous messages go: the control plane carries each to its peer,
/// which hands it to its engine's [`NcclEngine::on_rendezvous`]. Called with the engine's
/// lock held: queue the message, never block or call the engine from it.
pub type RendezvousSink = Arc<dyn Fn(&EnginePeer, Vec<u8>) + Send + Sync>;

/// The engine's limits.
#[derive(Debug, Clone, Copy)]
pub struct NcclConfig {
    /// How long a transfer may take from its start before its communicator is aborted.
    pub transfer_limit: Duration,
    /// How long a communicator's init may wait for the peer to join.
    pub rendezvous_timeout: Duration,
    /// How often the watchdog polls errors, completions and deadlines.
    pub poll_interval: Duration,
    /// How long [`TransferEngine::abort_peer`] (and the engine's drop) waits for the
    /// aborts of the peer's communicators. `ncclCommAbort` runs on a thread of its own and
    /// can hang (a peer killed mid-transfer can leave NCCL's proxy thread stuck, NVIDIA/nccl
    /// #1013, #1777): past this, the caller goes on, and the transfers of that
    /// communicator keep "touching" their memory — their owners keep it, never freed —
    /// until the abort returns, if it ever does.
    pub abort_wait: Duration,
}

impl Default for NcclConfig {
    fn default() -> Self {
        Self {
            transfer_limit: Duration::from_secs(60),
            rendezvous_timeout: Duration::from_secs(30),
            poll_interval: Duration::from_millis(2),
            abort_wait: Duration::from_secs(10),
        }
    }
}

/// A node as the engine orders them: the lower is rank 0.
type NodeKey = (HostId, ProcessId);

/// Which way a communicator moves bytes, seen from this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Dir {
    /// This node sends on it.
    Out,
    /// This node receives on it.
    In,
}

/// One communicator of the engine: a peer and a direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Key {
    node: NodeKey,
    dir: Dir,
}

fn node_key(peer: &EnginePeer) -> NodeKey {
    (peer.host, peer.process)
}

/// Whether a bootstrap socket at `named` is on the host of a peer whose host link runs to
/// `link`: the same address; or, where the link runs over loopback (the peer is on this
/// machine, and NCCL's bootstrap picks a non-loopback interface by default), any address
/// of this machine — one a socket can bind to, never the unspecified one. Joining then
/// connects to this machine only.
fn bootstrap_on_peers_host(named: IpAddr, link: IpAddr) -> bool {
    let (named, link) = (named.to_canonical(), link.to_canonical());
    named == link
        || (link.is_loopback()
            && !named.is_unspecified()
            && !named.is_multicast()
            && std::net::UdpSocket::bind((named, 0)).is_ok())
}

/// Magic and version of a rendezvous message.
const MAGIC: [u8; 4] = *b"BNC1";
/// Bytes of a rendezvous message: magic, direction, serial, seen, unique id.
const RENDEZVOUS_LEN: usize = 4 + 1 + 8 + 8 + 128;

/// A rendezvous message: `dir` is the direction seen from its maker.
fn encode_rendezvous(dir: Dir, offer: Offer, uid: &UniqueId) -> Vec<u8> {
    let mut out = Vec::with_capacity(RENDEZVOUS_LEN);
    out.extend_from_slice(&MAGIC);
    out.push(match dir {
        Dir::Out => 0,
        Dir::In => 1,
    });
    out.extend_from_slice(&offer.serial.to_le_bytes());
    out.extend_from_slice(&offer.seen.to_le_bytes());
    out.extend_from_slice(&uid.0);
    out
}

/// Decodes a peer's rendezvous message; the direction is returned as seen from here.
fn decode_rendezvous(bytes: &[u8]) -> Result<(Dir, Offer, UniqueId)> {
    let refuse = |reason| Error::BadRendezvous { reason };
    if bytes.len() != RENDEZVOUS_LEN {
        return Err(refuse("wrong length"));
    }
    if bytes[..4] != MAGIC {
        return Err(refuse("not an NCCL rendezvous message of this version"));
    }
    let dir = match bytes[4] {
        // The maker sends on it: we receive.
        0 => Dir::In,
        1 => Dir::Out,
        _ => return Err(refuse("unknown direction")),
    };
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let offer = Offer {
        serial: word(5),
        seen: word(13),
    };
    if offer.serial == 0 {
        return Err(refuse("offer serial 0"));
    }
    let uid = UniqueId(bytes[21..].try_into().expect("128 bytes"));
    Ok((dir, offer, uid))
}

/// A transfer the table knows, until its Finish.
#[derive(Debug)]
struct Pending {
    id: TransferId,
    /// The region's device address (the engine takes no host memory).
    addr: u64,
    len: usize,
    /// Touching from the start until the Finish; the Finish reports the outcome.
    signal: TransferSignal,
}

impl Pending {
    fn region(&self) -> Region {
        Region {
            ptr: MemPtr::Device(self.addr),
            len: self.len,
            device: None,
        }
    }
}

struct State {
    table: CommTable<Key>,
    /// The communicators made, by attempt.
    comms: HashMap<Attempt, (Key, CommHandle)>,
    /// The operations launched, by transfer.
    ops: HashMap<Tid, (Key, Attempt, OpHandle)>,
    transfers: HashMap<Tid, Pending>,
    /// What the sink is called with, per node.
    peers: HashMap<NodeKey, EnginePeer>,
    next_tid: u64,
    stop: bool,
}

struct Shared {
    /// Itself, for the threads that abort communicators.
    this: Weak<Shared>,
    nccl: Arc<dyn Nccl>,
    me: NodeKey,
    config: NcclConfig,
    sink: RendezvousSink,
    state: Mutex<State>,
    /// Signalled when an abort completes, and to stop the watchdog.
    changed: Condvar,
}

/// Device memory between nodes on different hosts, over NCCL (module docs).
pub struct NcclEngine {
    shared: Arc<Shared>,
    watchdog: Option<JoinHandle<()>>,
}

impl fmt::Debug for NcclEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclEngine")
            .field("nccl", &self.shared.nccl)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl NcclEngine {
    /// An engine for the CUDA device `ordinal`, for the node `me`, loading NCCL (the
    /// first load sets `NCCL_NVLS_ENABLE=0` in the process environment if unset).
    ///
    /// # Errors
    /// [`Error::NcclUnavailable`] (checked first: no NCCL, or one older than 2.19);
    /// [`Error::Nccl`] if the device's context cannot be made.
    pub fn new(
        ordinal: usize,
        me: &EnginePeer,
        config: NcclConfig,
        sink: RendezvousSink,
    ) -> Result<Self> {
        available()?;
        let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| Error::Nccl {
            op: "cuDevicePrimaryCtxRetain",
            code: -1,
            message: e.to_string(),
        })?;
        let nccl = library::LibraryNccl::new(ctx)?;
        Ok(Self::with_nccl(Arc::new(nccl), me, config, sink))
    }

    fn with_nccl(
        nccl: Arc<dyn Nccl>,
        me: &EnginePeer,
        config: NcclConfig,
        sink: RendezvousSink,
    ) -> Self {
        let me = node_key(me);
        let table = CommTable::new(
            move |k: &Key| if me < k.node { Rank(0) } else { Rank(1) },
            config.rendezvous_timeout,
        );
        let shared = Arc::new_cyclic(|this| Shared {
            this: this.clone(),
            nccl,
            me,
            config,
            sink,
            state: Mutex::new(State {
                table,
                comms: HashMap::new(),
                ops: HashMap::new(),
                transfers: HashMap::new(),
                peers: HashMap::new(),
                next_tid: 0,
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let watched = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name("baton-nccl-watchdog".into())
            .spawn(move || watched.watch())
            .expect("spawning the NCCL watchdog thread");
        Self {
            shared,
            watchdog: Some(watchdog),
        }
    }

    /// A rendezvous message from `peer`, carried by the control plane over the link that
    /// authenticated it, whose other end is at `host` (the IP address the host link runs
    /// to): joins (or declines, for crossing offers) the communicator it offers, keyed by
    /// `peer` as the link knows it — nothing in the bytes names a peer.
    ///
    /// Joining connects to the bootstrap socket its unique id names, so that address must
    /// be on the peer's own host (`host`): a rendezvous that names any other is refused
    /// before the engine's state is touched, so it cannot make this node connect
    /// elsewhere, nor disturb any communicator (module docs).
    ///
    /// # Errors
    /// [`Error::BadRendezvous`]: the bytes are not a rendezvous message;
    /// [`Error::RendezvousElsewhere`]: its bootstrap socket is not at `host` (both the
    /// peer's fault).
    pub fn on_rendezvous(&self, peer: &EnginePeer, host: IpAddr, bytes: &[u8]) -> Result<()> {
        let (dir, offer, uid) = decode_rendezvous(bytes)?;
        let named = uid.bootstrap_addr().map(|a| a.ip());
        if !named.is_some_and(|ip| bootstrap_on_peers_host(ip, host)) {
            return Err(Error::RendezvousElsewhere { named, link: host });
        }
        let key = self.shared.key(peer, dir)?;
        let mut st = self.shared.lock();
        st.peers.insert(key.node, *peer);
        let mut out = Vec::new();
        st.table
            .on_offer(&key, uid, offer, Instant::now(), &mut out);
        drop(self.shared.execute(st, out));
        Ok(())
    }

    /// The peer died or left: its transfers fail ([`Error::TransferPeerGone`]) and its
    /// communicators are aborted; returns once none touches memory.
    pub fn peer_gone(&self, peer: &EnginePeer) {
        self.shared.stop_peers(&[*peer], Failure::PeerGone);
    }

    /// Starts a transfer (`send`: `dir` Out).
    ///
    /// # Safety
    /// As [`TransferEngine::send`].
    unsafe fn start(
        &self,
        peer: &EnginePeer,
        id: TransferId,
        region: Region,
        dir: Dir,
    ) -> Result<Transfer> {
        let addr = api::device_addr(&region)?;
        let key = self.shared.key(peer, dir)?;
        let mut st = self.shared.lock();
        st.peers.insert(key.node, *peer);
        st.next_tid += 1;
        let tid = Tid(st.next_tid);
        // An abort stops the transfer through the table (aborting its communicator if it
        // runs) and waits for its Finish, which ends the touch.
        let engine = Arc::downgrade(&self.shared);
        let (transfer, signal) = transfer_pair(id, move || {
            if let Some(engine) = Weak::upgrade(&engine) {
                engine.abort_transfer(tid);
            }
        });
        let touching = signal.begin_touch();
        debug_assert!(touching, "a new transfer is neither finished nor aborted");
        st.transfers.insert(
            tid,
            Pending {
                id,
                addr,
                len: region.len,
                signal,
            },
        );
        let mut out = Vec::new();
        let limit = self.shared.config.transfer_limit;
        // The sender offers its direction's communicator; the receiver waits for the offer.
        (st.table).submit(&key, tid, limit, dir == Dir::Out, Instant::now(), &mut out);
        drop(self.shared.execute(st, out));
        Ok(transfer)
    }

    /// Where the communicator this node sends to `peer` on is, for tests and status.
    #[cfg(test)]
    fn phase(&self, peer: &EnginePeer, dir: Dir) -> Phase {
        let st = self.shared.lock();
        (st.table).phase(&Key {
            node: node_key(peer),
            dir,
        })
    }
}

impl TransferEngine for NcclEngine {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn moves_device_memory(&self) -> bool {
        true
    }

    unsafe fn send(&self, peer: &EnginePeer, id: TransferId, src: Region) -> Result<Transfer> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.start(peer, id, src, Dir::Out) }
    }

    unsafe fn recv(&self, peer: &EnginePeer, id: TransferId, dst: Region) -> Result<Transfer> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.start(peer, id, dst, Dir::In) }
    }

    fn abort_peer(&self, peer: &EnginePeer) {
        self.shared.stop_peers(&[*peer], Failure::Aborted);
    }
}

impl Drop for NcclEngine {
    /// Stops the watchdog, then aborts every communicator (failing what still runs).
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        let peers: Vec<EnginePeer> = self.shared.lock().peers.values().copied().collect();
        // All at once: an abort's free can wait for another communicator's kernel, which
        // leaves only once that communicator's abort has begun (module docs).
        self.shared.stop_peers(&peers, Failure::Aborted);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn key(&self, peer: &EnginePeer, dir: Dir) -> Result<Key> {
        let node = node_key(peer);
        if node == self.me {
            return Err(Error::RegionUnsupported {
                engine: "nccl",
                reason: "a transfer needs a peer node other than this one",
            });
        }
        Ok(Key { node, dir })
    }

    /// Fails and stops everything with `peers`, aborting all their communicators at once;
    /// returns once no abort of them is in progress, or after [`NcclConfig::abort_wait`]
    /// (an abort that hangs keeps its transfers' memory: their touch ends only when it
    /// returns).
    fn stop_peers(&self, peers: &[EnginePeer], why: Failure) {
        let keys: Vec<Key> = (peers.iter())
            .flat_map(|p| {
                [Dir::Out, Dir::In].map(|dir| Key {
                    node: node_key(p),
                    dir,
                })
            })
            .collect();
        let mut st = self.lock();
        let mut out = Vec::new();
        for key in &keys {
            st.table.abort_peer(key, why.clone(), &mut out);
        }
        st = self.execute(st, out);
        let by = Instant::now() + self.config.abort_wait;
        while keys
            .iter()
            .any(|k| matches!(st.table.phase(k), Phase::Aborting(_)))
        {
            let left = by.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(peers = peers.len(), after = ?self.config.abort_wait, "an NCCL abort has not returned: going on; the memory of its transfers stays held until it does");
                break;
            }
            st = (self.changed)
                .wait_timeout(st, left.min(Duration::from_millis(50)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Performs `actions` in order (and those they lead to). Only `ncclCommAbort` runs
    /// without the lock; what follows an Abort runs after it returned.
    fn execute<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        actions: Vec<Action<Key>>,
    ) -> MutexGuard<'a, State> {
        let mut work: VecDeque<Action<Key>> = actions.into();
        while let Some(action) = work.pop_front() {
            let mut out = Vec::new();
            match action {
                Action::Offer {
                    peer,
                    attempt,
                    rank,
                    offer,
                } => {
                    let made = (self.nccl.unique_id())
                        .and_then(|uid| Ok((uid, self.nccl.init(&uid, rank)?)));
                    match made {
                        Ok((uid, comm)) => {
                            st.comms.insert(attempt, (peer, comm));
                            let bytes = encode_rendezvous(peer.dir, offer, &uid);
                            if let Some(to) = st.peers.get(&peer.node) {
                                (self.sink)(to, bytes);
                            }
                        }
                        Err(e) => st
                            .table
                            .comm_failed(&peer, attempt, e.to_string(), &mut out),
                    }
                }
                Action::Join {
                    peer,
                    attempt,
                    uid,
                    rank,
                } => match self.nccl.init(&uid, rank) {
                    Ok(comm) => {
                        st.comms.insert(attempt, (peer, comm));
                    }
                    Err(e) => st
                        .table
                        .comm_failed(&peer, attempt, e.to_string(), &mut out),
                },
                Action::Launch { peer, attempt, tid } => {
                    let st = &mut *st;
                    let (Some((_, comm)), Some(t)) =
                        (st.comms.get(&attempt), st.transfers.get(&tid))
                    else {
                        continue;
                    };
                    if !st.table.is_running(tid, attempt) {
                        continue;
                    }
                    let to = st.table.rank(&peer).other();
                    // SAFETY: the region stays valid until the transfer ends (the promise
                    // of `send`/`recv`), and it ends only after its operation completed or
                    // its communicator was aborted (`comm` module docs).
                    let launched = match peer.dir {
                        // SAFETY: as above.
                        Dir::Out => unsafe { self.nccl.send(*comm, t.region(), to) },
                        // SAFETY: as above.
                        Dir::In => unsafe { self.nccl.recv(*comm, t.region(), to) },
                    };
                    match launched {
                        Ok(op) => {
                            st.ops.insert(tid, (peer, attempt, op));
                        }
                        Err(e) => st
                            .table
                            .comm_failed(&peer, attempt, e.to_string(), &mut out),
                    }
                }
                Action::Abort { peer, attempt } => {
                    let comm = st.comms.remove(&attempt).map(|(_, c)| c);
                    // The Finish of each operation launched on it follows the abort's
                    // return (only then does NCCL no longer touch its memory).
                    let (deferred, rest): (Vec<_>, Vec<_>) =
                        work.drain(..).partition(|a| match a {
                            Action::Finish { tid, .. } => {
                                st.ops.get(tid).is_some_and(|(_, a, _)| *a == attempt)
                            }
                            _ => false,
                        });
                    work.extend(rest);
                    match (comm, self.this.upgrade()) {
                        (Some(comm), Some(engine)) => {
                            // On a thread of its own: ncclCommAbort can hang, and nothing
                            // of the node may wait on it without bound (`abort_wait`). Never
                            // one abort behind another: its free may wait for the other's
                            // kernel, which leaves only once that abort has begun.
                            tracing::debug!(?attempt, "aborting an NCCL communicator");
                            let spawned = std::thread::Builder::new()
                                .name("baton-nccl-abort".into())
                                .spawn(move || {
                                    drop(engine.aborted_comm(peer, attempt, Some(comm), deferred))
                                });
                            if let Err(e) = spawned {
                                tracing::warn!(error = %e, "no thread for an NCCL abort: aborting here");
                                drop(st);
                                st = self.aborted_comm(peer, attempt, Some(comm), Vec::new());
                            }
                        }
                        // Never made (or the engine is going): nothing of NCCL's to stop.
                        _ => {
                            drop(st);
                            st = self.aborted_comm(peer, attempt, comm, deferred);
                        }
                    }
                }
                Action::Finish { tid, outcome } => {
                    if let Some((_, _, op)) = st.ops.remove(&tid) {
                        self.nccl.release_op(op);
                    }
                    if let Some(t) = st.transfers.remove(&tid) {
                        if let Err(f) = &outcome {
                            tracing::debug!(transfer = t.id.0, failure = ?f, "NCCL transfer failed");
                        }
                        // NCCL no longer touches the region: its operation completed, or
                        // its communicator's abort returned, or it never launched.
                        t.signal.end_touch();
                        t.signal.finish(outcome.map_err(|f| failure_error(t.id, f)));
                    }
                }
            }
            work.extend(out);
        }
        st
    }

    /// Aborts `comm` (if any), then releases its operations, finishes their transfers
    /// (`deferred`: NCCL no longer touches their memory) and tells the table. Aborts of
    /// different communicators run concurrently, each on its own thread.
    fn aborted_comm(
        &self,
        peer: Key,
        attempt: Attempt,
        comm: Option<CommHandle>,
        deferred: Vec<Action<Key>>,
    ) -> MutexGuard<'_, State> {
        if let Some(comm) = comm {
            self.nccl.abort(comm);
            tracing::debug!(?attempt, "an NCCL communicator aborted");
        }
        let mut st = self.lock();
        let dead: Vec<Tid> = (st.ops.iter())
            .filter(|(_, (_, a, _))| *a == attempt)
            .map(|(t, _)| *t)
            .collect();
        for tid in dead {
            if let Some((_, _, op)) = st.ops.remove(&tid) {
                self.nccl.release_op(op);
            }
        }
        let mut out = deferred;
        st.table.aborted(&peer, attempt, Instant::now(), &mut out);
        self.changed.notify_all();
        self.execute(st, out)
    }

    /// One round of the watchdog: inits that completed or failed, asynchronous errors,
    /// completed operations, deadlines.
    fn poll<'a>(&'a self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        let mut out = Vec::new();
        let comms: Vec<(Attempt, Key, CommHandle)> =
            st.comms.iter().map(|(a, (k, c))| (*a, *k, *c)).collect();
        for (attempt, key, comm) in comms {
            let phase = st.table.phase(&key);
            let initialising =
                matches!(phase, Phase::Offered(a) | Phase::Joining(a) if a == attempt);
            match self.nccl.comm_progress(comm) {
                Progress::Done if initialising => st.table.comm_ready(&key, attempt, &mut out),
                Progress::Failed(e) => st.table.comm_failed(&key, attempt, e.to_string(), &mut out),
                Progress::Done | Progress::Pending => {}
            }
        }
        let ops: Vec<(Tid, Key, Attempt, OpHandle)> = st
            .ops
            .iter()
            .map(|(t, (k, a, o))| (*t, *k, *a, *o))
            .collect();
        for (tid, key, attempt, op) in ops {
            match self.nccl.op_progress(op) {
                Progress::Done => st.table.transfer_done(tid, &mut out),
                Progress::Failed(e) => st.table.comm_failed(&key, attempt, e.to_string(), &mut out),
                Progress::Pending => {}
            }
        }
        st.table.poll_timeout(Instant::now(), &mut out);
        self.execute(st, out)
    }

    /// The watchdog thread: polls until the engine stops.
    fn watch(&self) {
        let mut st = self.lock();
        while !st.stop {
            st = self.poll(st);
            if st.stop {
                break;
            }
            st = (self.changed)
                .wait_timeout(st, self.config.poll_interval)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Aborts one transfer (and, if it runs, its communicator).
    fn abort_transfer(&self, tid: Tid) {
        let mut st = self.lock();
        let mut out = Vec::new();
        st.table.abort_transfer(tid, &mut out);
        drop(self.execute(st, out));
    }
}

/// The typed error of a failed transfer.
fn failure_error(id: TransferId, f: Failure) -> Error {
    let id = id.0;
    match f {
        Failure::Aborted => Error::TransferAborted { id },
        Failure::PeerGone => Error::TransferPeerGone {
            id,
            why: "the peer died or left".into(),
        },
        Failure::TimedOut { after } => Error::Timeout {
            op: "NCCL transfer",
            after,
        },
        Failure::Comm(reason) => Error::TransferFailed { id, reason },
    }
}

#[cfg(any(test, feature = "testing"))]
#[cfg_attr(not(test), allow(dead_code))]
mod fake;
#[cfg(all(test, feature = "gpu-tests"))]
mod gpu_tests;
#[cfg(test)]
mod tests;

/// An engine on the fake NCCL for a node whose host is served by a [`testing::FakeFabric`]
/// (with the `testing` feature; else, and for every other host, `None`): how the layers
/// above test what they do with an engine — a rendezvous, an abort that hangs — on
/// machines without NCCL. Not a stable API.
#[doc(hidden)]
pub fn testing_engine(
    me: &EnginePeer,
    config: NcclConfig,
    sink: RendezvousSink,
) -> Option<NcclEngine> {
    #[cfg(feature = "testing")]
    {
        let (fabric, device, addr) = testing::served(me.host)?;
        let nccl = fake::FakeNccl {
            fabric,
            device,
            addr,
        };
        Some(NcclEngine::with_nccl(Arc::new(nccl), me, config, sink))
    }
    #[cfg(not(feature = "testing"))]
    {
        let _ = (me, config, sink);
        None
    }
}

/// The fake NCCL for the tests of the layers above (the `testing` feature; not a stable
/// API): a [`FakeFabric`](testing::FakeFabric) serves the nodes of a host (their
/// [`HostId`]), whose engines then run on it ([`testing_engine`]).
#[cfg(feature = "testing")]
pub mod testing {
    use super::fake::{Call, Fabric};
    use super::{Dir, HostId, Mutex, Offer, encode_rendezvous};
    use crate::transfer::nccl::api::UniqueId;
    use std::net::SocketAddr;
    use std::sync::Arc;

    /// The hosts served, with their fabric, device and bootstrap address.
    type Served = Vec<(HostId, Arc<Mutex<Fabric>>, usize, SocketAddr)>;
    static SERVED: Mutex<Served> = Mutex::new(Vec::new());

    pub(super) fn served(host: HostId) -> Option<(Arc<Mutex<Fabric>>, usize, SocketAddr)> {
        let served = SERVED.lock().unwrap_or_else(|e| e.into_inner());
        (served.iter())
            .find(|(h, ..)| *h == host)
            .map(|(_, f, d, a)| (Arc::clone(f), *d, *a))
    }

    /// A fake NCCL fabric: communicators of one unique id meet, operations never complete
    /// on their own here (nothing sends), and aborts can be made to hang.
    #[derive(Debug, Clone, Default)]
    pub struct FakeFabric {
        fabric: Arc<Mutex<Fabric>>,
    }

    impl FakeFabric {
        /// A fabric serving no host yet.
        pub fn new() -> Self {
            Self::default()
        }

        fn lock(&self) -> std::sync::MutexGuard<'_, Fabric> {
            self.fabric.lock().unwrap_or_else(|e| e.into_inner())
        }

        /// Makes every node of `host` run its NCCL engine on this fabric (as device
        /// `device`), its unique ids naming `bootstrap`.
        pub fn serve(&self, host: HostId, device: usize, bootstrap: SocketAddr) {
            let mut served = SERVED.lock().unwrap_or_else(|e| e.into_inner());
            served.retain(|(h, ..)| *h != host);
            served.push((host, Arc::clone(&self.fabric), device, bootstrap));
        }

        /// While `on`, every `ncclCommAbort` hangs (as NCCL's can when a peer died
        /// mid-transfer); set it off and they return.
        pub fn hang_aborts(&self, on: bool) {
            self.lock().hang_aborts = on;
        }

        /// Communicators initialised (`ncclCommInitRankConfig` calls).
        pub fn inits(&self) -> usize {
            (self.lock().calls.iter())
                .filter(|c| matches!(c, Call::Init { .. }))
                .count()
        }

        /// Aborts called, whether or not they returned.
        pub fn aborts_begun(&self) -> usize {
            self.lock().aborts_begun
        }

        /// Aborts that returned.
        pub fn aborts_returned(&self) -> usize {
            self.lock().aborts()
        }
    }

    /// A rendezvous message as a peer's engine sends it: an offer (number `serial`) of the
    /// communicator it sends on, its unique id naming `bootstrap`.
    pub fn rendezvous(serial: u64, bootstrap: SocketAddr) -> Vec<u8> {
        let offer = Offer { serial, seen: 0 };
        encode_rendezvous(Dir::Out, offer, &UniqueId::naming(serial, bootstrap))
    }
}
