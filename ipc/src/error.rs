use baton_messages::protocol::RefuseReason;
use baton_messages::{AllocationId, BackendKind, DeviceUuid, ExporterId, Generation, ProcessId};
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong in memory and transport mechanics.
///
/// Variants say what happened in terms a caller can act on: a peer that sent something
/// bad ([`Error::Message`], [`Error::UnexpectedMessage`], …) should be disconnected; a
/// handle that cannot be opened ([`Error::SegmentNotFound`], [`Error::StaleHandle`], …)
/// should be refused; nothing here means the process is in trouble.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The peer sent bytes or data that do not decode or do not check.
    #[error(transparent)]
    Message(#[from] baton_messages::Error),
    /// An operating-system call failed.
    #[error("{op} failed: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer closed the link (or died).
    #[error("peer closed the link")]
    Closed,
    /// A wait ran past its deadline.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// What was being waited for.
        op: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The peer's credentials are not allowed by the [`PeerPolicy`](crate::PeerPolicy).
    #[error(
        "peer pid {pid} runs as uid {uid}, which is not allowed: add it to the PeerPolicy to accept it"
    )]
    PeerNotAllowed {
        /// The peer's uid (`SO_PEERCRED`).
        uid: u32,
        /// The peer's pid (`SO_PEERCRED`).
        pid: u32,
    },
    /// The peer could not prove it holds this session's token.
    #[error(
        "peer does not hold this session's token: check that both sides got the same BATON_TOKEN"
    )]
    BadToken,
    /// This process was given no session token: neither a descriptor a Baton spawner
    /// passed it (`BATON_TOKEN_FD`) nor `BATON_TOKEN`.
    #[error(
        "no session token was given to this process{}: pass one (a token, a token file), or start it with a Baton spawner that passes it (BATON_TOKEN_FD)",
        why.as_deref().map(|w| format!(" ({w})")).unwrap_or_default()
    )]
    NoToken {
        /// What was found instead, if anything (a descriptor named in `BATON_TOKEN_FD`
        /// that held no token, a `BATON_TOKEN` that is not one).
        why: Option<String>,
    },
    /// The peer refused the link.
    #[error("peer refused the link: {reason:?}")]
    Refused {
        /// Its reason.
        reason: RefuseReason,
    },
    /// The peer sent a message that is not allowed at this point of the protocol.
    #[error("expected {expected}, peer sent {got}")]
    UnexpectedMessage {
        /// What the protocol allows here.
        expected: &'static str,
        /// What came.
        got: &'static str,
    },
    /// The peer's process lives in another PID namespace than ours (a container of its
    /// own) and this kernel cannot prove and watch it without a pid: Baton proves a peer
    /// of another PID namespace, and sees it die, through a pidfd the kernel gives for the
    /// socket's peer (`SO_PEERPIDFD`, Linux 6.5+) whose inode names the process (pidfs,
    /// Linux 6.9+). Without them the link is refused rather than trusted blind: `/proc`
    /// would answer for another process, and the freeing rule could free memory the peer
    /// still maps.
    #[error(
        "the peer process{} lives in another PID namespace and cannot be proven and watched from here: {why}; run both processes in one PID namespace (containers: share the host's, e.g. `docker run --pid=host`), or on Linux 6.9 or later",
        pid.map(|p| format!(" (pid {p} here)")).unwrap_or_else(|| " (not visible from here)".to_owned())
    )]
    PeerInOtherPidNamespace {
        /// Its pid in our namespace, when we can see it (it is nested below ours).
        pid: Option<u32>,
        /// What this kernel or process lacks.
        why: &'static str,
    },
    /// The identity a peer claims is not the process at the other end of the socket.
    #[error(
        "peer claims to be {claimed} but the socket belongs to {}",
        if *actual_pid == 0 { "another process, of another PID namespace".to_owned() } else { format!("pid {actual_pid}") }
    )]
    PeerIdentityMismatch {
        /// What the peer said.
        claimed: ProcessId,
        /// What the kernel says (`SO_PEERCRED`); 0 for a process with no pid in our PID
        /// namespace.
        actual_pid: u32,
    },
    /// A frame announced more file descriptors than arrived with it.
    #[error("frame announced {need} file descriptors but {have} arrived")]
    MissingFds {
        /// Announced.
        need: usize,
        /// Arrived.
        have: usize,
    },
    /// A peer sent more file descriptors than its frames announce.
    #[error("peer sent file descriptors that no frame announced")]
    UnexpectedFds,
    /// The peer wrote something into a link's shared-memory ring that no Baton writer or
    /// reader would ([`RingError::Corrupt`](crate::ring::RingError::Corrupt)): the ring,
    /// and the link it came with, are unusable.
    #[error("the peer corrupted the link's ring ({reason}): drop the link")]
    RingCorrupt {
        /// What did not check.
        reason: &'static str,
    },
    /// The kernel dropped the descriptors of a frame on its way into this process (it was
    /// at its descriptor limit, `RLIMIT_NOFILE`): a local failure, not the sender's.
    #[error(
        "the descriptor in slot {slot} was dropped on receipt: this process is at its open-file \
         limit (RLIMIT_NOFILE); close descriptors or raise the limit"
    )]
    DescriptorsLost {
        /// The slot asked for.
        slot: u8,
    },
    /// A handle refers to a file descriptor slot the frame did not carry.
    #[error("handle refers to file descriptor slot {slot}, which its frame did not carry")]
    MissingFdSlot {
        /// The slot.
        slot: u8,
    },
    /// A handle that carries no descriptor (the importer was expected to map the
    /// allocation already) names an allocation this process does not map. The offer is
    /// refused; the exporter sends the descriptor again with its next offer.
    #[error(
        "{exporter} offered {alloc} without its descriptor, but this process does not map it: \
         refused (the next offer carries the descriptor again)"
    )]
    NotMapped {
        /// The exporter.
        exporter: ExporterId,
        /// The allocation.
        alloc: AllocationId,
    },
    /// A CUDA pool handle that carries no descriptor (the importer was expected to have
    /// imported the pool already) names a pool this process has not imported from that
    /// exporter. The offer is refused; the exporter sends the pool's descriptor again.
    #[error(
        "{exporter} offered memory of its pool {pool} without the pool's descriptor, but this \
         process has not imported that pool: refused (send the descriptor with the next offer)"
    )]
    PoolNotImported {
        /// The exporter.
        exporter: ExporterId,
        /// The exporter's pool id.
        pool: u64,
    },
    /// The socket directory is reachable by other users or is not ours.
    #[error("socket directory {path} is not private: {reason}")]
    InsecureSocketDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong.
        reason: &'static str,
    },
    /// An allocation of zero bytes was asked for.
    #[error("cannot allocate zero bytes")]
    ZeroSize,
    /// An access outside a buffer.
    #[error("access of {len} bytes at offset {offset} is outside a buffer of {size} bytes")]
    OutOfBounds {
        /// Start of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Size of the buffer.
        size: usize,
    },
    /// The handle names a host segment that does not exist (freed, or never made).
    #[error(
        "{alloc} of {exporter} has no shared-memory segment: the exporter freed it or never made it"
    )]
    SegmentNotFound {
        /// The exporter the handle names.
        exporter: ExporterId,
        /// The allocation the handle names.
        alloc: AllocationId,
    },
    /// The handle names a host segment of an exporter in another PID namespace, and no such
    /// segment is in this process's `/dev/shm`: the two do not share one (containers each
    /// have their own), so named segments cannot cross between them.
    #[error(
        "{alloc} of {exporter} is a named shared-memory segment, and its exporter lives in another PID namespace whose /dev/shm is not ours (containers each have their own): named segments do not cross containers; use memfd host memory (BATON_HOST=memfd, the default on Linux), which crosses the socket as a descriptor"
    )]
    SegmentAcrossPidNamespaces {
        /// The exporter the handle names.
        exporter: ExporterId,
        /// The allocation the handle names.
        alloc: AllocationId,
    },
    /// The exported memory (segment or device allocation) is smaller than the handle says.
    #[error("the exported memory holds {actual} bytes but the handle claims {claimed}")]
    MemoryTooSmall {
        /// Bytes the handle claims.
        claimed: u64,
        /// Bytes the segment has.
        actual: u64,
    },
    /// A host memory descriptor that could change size under its mapping: not a memfd, or
    /// one without the seals against shrinking and growing that every Baton memfd carries.
    /// Mapping it would let its sender make our accesses fault (`SIGBUS`) by truncating it.
    #[error(
        "{exporter} sent host memory that is not a memfd sealed against shrinking and growing: refused"
    )]
    UnsealedMemory {
        /// The exporter the handle names.
        exporter: ExporterId,
    },
    /// A host segment name does not belong to the exporter the handle names.
    #[error("segment name does not belong to exporter {exporter}")]
    SegmentOwnerMismatch {
        /// The exporter the handle names.
        exporter: ExporterId,
    },
    /// The shared-memory layer failed.
    #[error("shared memory: {0}")]
    Shm(String),
    /// No backend in this process opens handles of this kind.
    #[error("no backend here opens {kind:?} handles: create the importer with that backend")]
    UnsupportedBackend {
        /// The handle's backend.
        kind: BackendKind,
    },
    /// The handle is for an allocation or generation the exporter has already freed.
    #[error(
        "handle is for {alloc} {generation:?}, but this process maps it at {current:?}: the \
         exporter reused the allocation for a newer buffer since; ask for a fresh handle"
    )]
    StaleHandle {
        /// The allocation.
        alloc: AllocationId,
        /// The handle's generation.
        generation: Generation,
        /// The newest generation this process has seen of the allocation.
        current: Generation,
    },
    /// [`Imported::host_bytes_mut`](crate::Imported::host_bytes_mut) on a view whose
    /// mapping has other views in this process: a mapping is written in place only through
    /// its only view.
    #[error(
        "{alloc} is mapped here by {views} views: it is written in place only through its only view; drop the other leases on it (or copy with `write`)"
    )]
    SharedMapping {
        /// The allocation.
        alloc: AllocationId,
        /// Views of its mapping in this process, this one included.
        views: usize,
    },
    /// A view of the mapping in this process is being written in place
    /// ([`Imported::host_bytes_mut`](crate::Imported::host_bytes_mut)): no other view of it
    /// is opened until that one drops.
    #[error(
        "{alloc} is written in place here through another lease's view: open it again once that lease is dropped"
    )]
    WrittenInPlace {
        /// The allocation.
        alloc: AllocationId,
    },
    /// The exporter's own allocation is being written in place
    /// ([`Allocation::write_in_place`](crate::Allocation::write_in_place)).
    #[error("{alloc} is being written in place by its owner: try again once that view is dropped")]
    InPlace {
        /// The allocation.
        alloc: AllocationId,
    },
    /// The handle's device is not one this process sees: devices are named by UUID, and
    /// this process's `CUDA_VISIBLE_DEVICES` leaves that one out. Nothing was opened.
    #[error(
        "the memory lies on GPU {device}, which this process (on GPU {here}) does not see: \
         check its CUDA_VISIBLE_DEVICES"
    )]
    DeviceNotFound {
        /// The device the memory lies on.
        device: DeviceUuid,
        /// The device of the backend that was asked to open it.
        here: DeviceUuid,
    },
    /// The handle's device is visible here, but this process's device cannot map its
    /// memory (`cuDeviceCanAccessPeer` says no). Nothing was opened.
    #[error(
        "the memory lies on GPU {device}, which GPU {here} cannot map (no peer access between them)"
    )]
    DeviceUnreachable {
        /// The device the memory lies on.
        device: DeviceUuid,
        /// The device of the backend that was asked to open it.
        here: DeviceUuid,
    },
    /// Stream-ordered pool memory of another GPU: refused before any driver call. Across
    /// GPUs the driver does not keep a pool allocation's pages for its importer once the
    /// exporting process is gone, and work of ours still queued on them would fault and end
    /// this process's CUDA context (`CUDA_ERROR_CONTAINED`). Share VMM or legacy memory
    /// across GPUs (`docs/CUDA.md`, "A peer's death and your GPU").
    #[error(
        "stream-ordered pool memory on GPU {device} is not opened on GPU {here}: a pool \
         allocation mapped across GPUs dies with its exporter and would take this process's \
         CUDA context with it; share VMM (CudaExport::Vmm) or legacy memory across GPUs"
    )]
    PoolAcrossDevices {
        /// The device the memory lies on.
        device: DeviceUuid,
        /// The device of the backend that was asked to open it.
        here: DeviceUuid,
    },
    /// Stream-ordered pool memory larger than the driver imports without crashing: refused
    /// before any driver call, by the exporter (allocating) and by the importer (opening).
    /// Larger buffers go as VMM memory.
    #[error(
        "{size} bytes of stream-ordered pool memory: more than {limit}, the most a pool \
         import survives on this driver (a larger one crashes its importer inside \
         cuMemPoolImportPointer); allocate it as VMM memory (CudaExport::Vmm), or set \
         BATON_CUDA_POOL_LIMIT for a driver measured to import more"
    )]
    PoolTooLarge {
        /// Bytes asked for (the whole allocation).
        size: u64,
        /// The bound: [`POOL_SIZE_LIMIT`](crate::cuda::POOL_SIZE_LIMIT) unless set otherwise.
        limit: u64,
    },
    /// The handle was exported by a process on another machine boot.
    #[error("handle comes from another machine or boot ({exporter})")]
    ForeignHandle {
        /// The exporter.
        exporter: ExporterId,
    },
    /// A CUDA driver call failed.
    #[error("{op} failed: {code}")]
    Cuda {
        /// The driver call (`cuIpcOpenMemHandle_v2`, …).
        op: &'static str,
        /// The driver's result code.
        code: CudaError,
    },
    /// A fence a peer sent does not check against the fence inbox lane this process lent
    /// it (a slab that is not ours, a slot outside its lane, a forged value): the peer's
    /// fault; the link that carried it is dropped.
    #[error("a fence from {producer} is refused: {reason}")]
    FenceRefused {
        /// Who sent it.
        producer: ProcessId,
        /// What is wrong with it.
        reason: crate::inbox::FenceRefusal,
    },
    /// A CUDA interprocess event would cross to or from a process in another PID
    /// namespace (a container of its own): refused before any driver call. The driver
    /// keeps such an event in its exporter's `/dev/shm` (`cuda.shm.*`), which a container
    /// does not share, and an importer that opened one there was killed by a signal
    /// (H200, driver 580), not given an error. Counter fences (the default,
    /// [`FenceKind::Counter`](crate::cuda::FenceKind::Counter)) cross namespaces.
    #[error(
        "a CUDA interprocess event cannot cross to {peer}, which lives in another PID namespace (a container of its own): the driver keeps such events in the exporter's /dev/shm, which containers do not share; use counter fences (FenceKind::Counter, the default where the device has 64-bit stream memory operations) for stream-ordered handoffs across containers (docs/CROSS_HOST.md, \"Containers\")"
    )]
    EventAcrossPidNamespaces {
        /// The process in the other namespace (the waiter, or the event's exporter).
        peer: ProcessId,
    },
    /// Every interprocess event of the pool is lent out.
    #[error(
        "all {limit} interprocess events are in use: release leases (their events return to the pool) or raise the backend's event limit"
    )]
    EventsExhausted {
        /// The pool's limit.
        limit: usize,
    },
    /// Every counter slot of the backend's fence slab is lent out.
    #[error(
        "all {limit} counter fences are in use or their work has not completed: release leases (their fences return once their work completes) or raise the backend's counter slots"
    )]
    FencesExhausted {
        /// The slab's slots.
        limit: usize,
    },
    /// The exporting process opened its own handle, but the allocation is already freed.
    #[error("{alloc} of {exporter} is already freed: ask for a fresh handle")]
    AllocationGone {
        /// The exporter the handle names.
        exporter: ExporterId,
        /// The allocation the handle names.
        alloc: AllocationId,
    },
    /// A slab arena has no free range large enough.
    #[error(
        "slab arena cannot fit {requested} bytes (largest free range: {largest_free} bytes): drop buffers or use a larger slab"
    )]
    SlabFull {
        /// Bytes asked for (after alignment).
        requested: usize,
        /// The largest free range.
        largest_free: usize,
    },
    /// Memory allocated outside Baton that Baton cannot lease (see
    /// [`CudaBackend::borrow`](crate::cuda::CudaBackend::borrow)).
    #[error("memory at {ptr:#x} cannot be leased: {reason}")]
    NotBorrowable {
        /// The address asked for.
        ptr: u64,
        /// Why, and what to do.
        reason: String,
    },
    /// A batched device copy ([`CopyPlan`](crate::cuda::CopyPlan)) was refused: a pointer
    /// outside any allocation of the device, a buffer too short or overlapping the copies.
    #[error("a batched copy was refused: {reason}")]
    CopyRefused {
        /// What is wrong, and with which copy.
        reason: String,
    },
    /// A backend that was asked for is not available here.
    #[error("backend {backend} is unavailable: {reason}")]
    BackendUnavailable {
        /// The backend.
        backend: &'static str,
        /// Why, and what to do.
        reason: String,
    },
    // Hosts (issue 26): the TCP host link and the transfer engines.
    /// A Noise message from a TCP peer failed its authentication check: its bytes were
    /// changed on the way, or it does not come from a holder of this session's token. The
    /// connection is dropped.
    #[error(
        "a {what} from the TCP peer failed its authentication check: its bytes were changed \
         on the way, or the peer is not of this session; the connection is dropped"
    )]
    Tampered {
        /// What failed to check (a handshake message, a transport message).
        what: &'static str,
    },
    /// A TCP peer's static key is not in this side's pinned set
    /// ([`TcpPolicy`](crate::tcp::TcpPolicy)).
    #[error(
        "the TCP peer's static key {key} is not pinned: add it to the TcpPolicy to accept that node"
    )]
    HostKeyNotPinned {
        /// The peer's public key, in hex.
        key: String,
    },
    /// A host link listener already holds its cap of established host links, in all or
    /// from the peer's key ([`TcpConfig::max_links`](crate::tcp::TcpConfig::max_links),
    /// [`TcpConfig::max_links_per_key`](crate::tcp::TcpConfig::max_links_per_key)): the
    /// new link is refused (`Refused { TooManyLinks }` on the peer's side).
    #[error(
        "this listener already holds {limit} host links {scope}: the new one is refused; close \
         links that are not needed, or raise the TcpConfig's caps"
    )]
    TooManyHostLinks {
        /// The cap that was reached.
        limit: usize,
        /// Which cap: "in all", or "from this peer's key".
        scope: &'static str,
    },
    /// A TCP peer's claimed process is not the one its Noise handshake announced.
    #[error(
        "the TCP peer claims to be {claimed} but its authenticated handshake announced {announced}"
    )]
    HostClaimMismatch {
        /// What the Baton handshake claimed.
        claimed: ProcessId,
        /// What the Noise handshake payload said.
        announced: ProcessId,
    },
    /// A TCP engine refused our data connection after its handshake: it takes no more
    /// connections (in all, or from our key), or no host link of its node has our key and
    /// process (a data connection belongs to the host link whose key opened it).
    #[error("the peer's TCP engine refused our data connection: {why}")]
    DataConnectionRefused {
        /// Why.
        why: DataRefusal,
    },
    /// A frame with file descriptors was to be sent over TCP, which cannot carry them.
    #[error(
        "a frame with {nfds} file descriptors cannot cross a TCP link: send host memory through a transfer engine instead"
    )]
    DescriptorsOverTcp {
        /// The descriptors the frame was to carry.
        nfds: usize,
    },
    /// A transfer engine was asked for a transfer it cannot make: memory it cannot move
    /// (device memory to the TCP engine, host memory to the NCCL engine), or a peer that
    /// is this node itself.
    #[error("the {engine} engine cannot make this transfer: {reason}")]
    RegionUnsupported {
        /// The engine.
        engine: &'static str,
        /// What is wrong, and what to do.
        reason: &'static str,
    },
    /// A transfer was aborted ([`Transfer::abort`](crate::transfer::Transfer::abort) or
    /// `abort_peer`) before it landed.
    #[error("transfer {id} was aborted before it landed")]
    TransferAborted {
        /// The transfer.
        id: u64,
    },
    /// The peer of a transfer went away (its connection closed or failed) before the
    /// transfer landed.
    #[error("the peer of transfer {id} went away before it landed: {why}")]
    TransferPeerGone {
        /// The transfer.
        id: u64,
        /// How it went.
        why: String,
    },
    /// A transfer's bytes do not match the MAC the sender computed: they were changed on
    /// the way. The receiving region holds garbage; the data connection is dropped.
    #[error(
        "transfer {id} arrived corrupted (its MAC does not check): the data connection is dropped"
    )]
    TransferCorrupt {
        /// The transfer.
        id: u64,
    },
    /// The sender and receiver of a transfer disagree on its size.
    #[error("transfer {id}: the sender sends {sent} bytes, the receiving region holds {room}")]
    TransferSizeMismatch {
        /// The transfer.
        id: u64,
        /// Bytes sent.
        sent: u64,
        /// Bytes the receiving region holds.
        room: u64,
    },
    /// The channel a transfer ran on failed (an NCCL communicator's asynchronous error, a
    /// rendezvous that timed out, an abort of another transfer on it); the engine no
    /// longer touches its memory. Starting the transfer again makes a fresh channel.
    #[error("transfer {id} failed: {reason}")]
    TransferFailed {
        /// The transfer.
        id: u64,
        /// What failed.
        reason: String,
    },
    /// NCCL cannot be used in this process: no `libnccl`, one too old, a missing entry point.
    #[error("NCCL is unavailable: {reason}")]
    NcclUnavailable {
        /// Why, and what to do.
        reason: String,
    },
    /// An NCCL call failed (the code is kept as NCCL returned it).
    #[error("{op} failed: NCCL error {code}: {message}")]
    Nccl {
        /// The call (`ncclCommInitRankConfig`, …).
        op: &'static str,
        /// `ncclResult_t`, as returned (`-1`: a CUDA call around it failed).
        code: i32,
        /// `ncclGetErrorString`'s text, or the CUDA error.
        message: String,
    },
    /// A peer's rendezvous message (an engine's connection set-up, carried by the control
    /// plane) does not decode: the peer's fault.
    #[error("a rendezvous message from the peer is refused: {reason}")]
    BadRendezvous {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A peer's NCCL rendezvous names a bootstrap socket that is not on the host its link
    /// runs to: joining it would make this node connect wherever the peer says, so it is
    /// refused (the peer's fault). An honest peer whose NCCL listens on another interface
    /// than its host link's: set `NCCL_SOCKET_IFNAME` there to that interface.
    #[error(
        "an NCCL rendezvous from the peer at {link} names a bootstrap socket at {}, not on the peer's host: refused (if the peer is honest, set NCCL_SOCKET_IFNAME on it to the interface its host link runs over)",
        named.map_or_else(|| "no address".to_owned(), |ip| ip.to_string())
    )]
    RendezvousElsewhere {
        /// The address the rendezvous names (`None`: none NCCL would read).
        named: Option<std::net::IpAddr>,
        /// The address of the peer's host link.
        link: std::net::IpAddr,
    },
}

/// Whose fault an [`Error`] is (or an `ActorError` of `baton-actors`, which shares the
/// kinds): what a node does about it. Every variant says its kind in [`Error::fault`], a
/// `match` with no catch-all arm, so a new variant cannot be added without saying whose
/// fault it is (as rustls nests `PeerMisbehaved` and `InvalidMessage` under its `Error`).
///
/// The two questions a node asks of an error are thin readings of it:
/// [`Error::is_peer_fault`] is [`Fault::Peer`], [`Error::is_local_open_failure`] is
/// [`Fault::Local`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Fault {
    /// The peer broke the protocol or sent data that does not check (bytes that do not
    /// decode, a message out of place, descriptors its frames do not announce, a forged
    /// fence, a wrong token or identity): the link that carried it is dropped, and the
    /// drop is logged as the peer's.
    Peer,
    /// The peer turned down what was asked, within the protocol: a link it refuses, a call
    /// its actor fails, a forward it will not make. Nobody broke a rule.
    Refused,
    /// What a handle (or a received layout) names is not memory that can be used as it
    /// claims: gone, smaller than claimed, another exporter's or another boot's, an older
    /// generation. Sent by a peer, it is the peer's handle that is wrong, not this
    /// process: an open that fails so is no [`Local`](Self::Local) failure.
    Handle,
    /// This process or its environment lacks what the operation needs: an OS call or a
    /// driver call that failed, descriptors or memory, a backend or device it does not
    /// have, a mapping it no longer holds, exhausted driver resources. Not the peer's
    /// doing: an offer that fails to open so is refused (its lease given back) and the
    /// link kept.
    Local,
    /// The caller asked for what cannot be done as asked, or configured this process so:
    /// zero bytes, an access out of bounds, a write while the memory is shared or leased,
    /// a wrong element type, no session token, an insecure socket directory, a slab too
    /// small. Change the call or the configuration.
    Usage,
    /// The link, the peer, an actor or a wait ended before the operation completed: a
    /// closed link, an exited or unresponsive peer, a passed deadline, a stopped mailbox.
    /// No rule the error names was broken by the peer (a holder cut at its revoke
    /// deadline is cut by this node's policy).
    Ended,
}

impl Error {
    pub(crate) fn io(op: &'static str) -> impl FnOnce(io::Error) -> Error {
        move |source| Error::Io { op, source }
    }

    /// Whose fault this error is (see [`Fault`]).
    pub fn fault(&self) -> Fault {
        // No catch-all arm: a new variant must say whose fault it is.
        match self {
            Error::Message(_)
            | Error::UnexpectedMessage { .. }
            | Error::PeerIdentityMismatch { .. }
            | Error::MissingFds { .. }
            | Error::UnexpectedFds
            | Error::RingCorrupt { .. }
            | Error::MissingFdSlot { .. }
            | Error::UnsealedMemory { .. }
            | Error::BadToken
            | Error::PeerNotAllowed { .. }
            | Error::FenceRefused { .. }
            | Error::Tampered { .. }
            | Error::HostKeyNotPinned { .. }
            | Error::HostClaimMismatch { .. }
            | Error::TransferCorrupt { .. }
            | Error::TransferSizeMismatch { .. }
            | Error::BadRendezvous { .. }
            | Error::RendezvousElsewhere { .. } => Fault::Peer,
            Error::Refused { .. }
            | Error::DataConnectionRefused { .. }
            | Error::TooManyHostLinks { .. } => Fault::Refused,
            Error::SegmentNotFound { .. }
            | Error::MemoryTooSmall { .. }
            | Error::SegmentOwnerMismatch { .. }
            | Error::StaleHandle { .. }
            | Error::ForeignHandle { .. }
            | Error::AllocationGone { .. } => Fault::Handle,
            Error::Io { .. }
            | Error::Cuda { .. }
            | Error::UnsupportedBackend { .. }
            | Error::NotMapped { .. }
            | Error::WrittenInPlace { .. }
            | Error::PoolNotImported { .. }
            | Error::DescriptorsLost { .. }
            | Error::DeviceNotFound { .. }
            | Error::DeviceUnreachable { .. }
            | Error::PoolAcrossDevices { .. }
            | Error::PoolTooLarge { .. }
            | Error::BackendUnavailable { .. }
            | Error::EventsExhausted { .. }
            | Error::FencesExhausted { .. }
            | Error::NcclUnavailable { .. }
            | Error::Nccl { .. }
            // What this process's namespaces cannot reach (a container's): the offer is
            // refused, the link stays.
            | Error::EventAcrossPidNamespaces { .. }
            | Error::SegmentAcrossPidNamespaces { .. }
            // Mapping a segment that exists failed here (a segment that does not exist
            // is `SegmentNotFound`): descriptors, memory.
            | Error::Shm(_) => Fault::Local,
            Error::NoToken { .. }
            | Error::InsecureSocketDir { .. }
            | Error::ZeroSize
            | Error::OutOfBounds { .. }
            | Error::SharedMapping { .. }
            | Error::InPlace { .. }
            | Error::SlabFull { .. }
            | Error::NotBorrowable { .. }
            | Error::CopyRefused { .. }
            | Error::DescriptorsOverTcp { .. }
            | Error::RegionUnsupported { .. }
            | Error::PeerInOtherPidNamespace { .. } => Fault::Usage,
            Error::Closed
            | Error::Timeout { .. }
            | Error::TransferAborted { .. }
            | Error::TransferPeerGone { .. }
            | Error::TransferFailed { .. } => Fault::Ended,
        }
    }

    /// Whether this error means the peer misbehaved (sent bad data or broke the
    /// protocol), as opposed to a local or environmental failure: [`Fault::Peer`].
    pub fn is_peer_fault(&self) -> bool {
        self.fault() == Fault::Peer
    }

    /// Whether an open that failed with this error failed for reasons of this process, not
    /// of the handle the peer sent: a descriptor or memory limit, a backend or device this
    /// process does not have, a mapping it no longer holds, exhausted driver resources
    /// ([`Fault::Local`]). A node refuses such an offer (its lease given back) and keeps
    /// the link; any other open failure is the peer's (a handle that does not check, names
    /// memory that does not exist or is smaller than claimed, an old generation) and drops
    /// its link.
    pub fn is_local_open_failure(&self) -> bool {
        self.fault() == Fault::Local
    }
}

/// Result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a TCP engine refused a data connection after its handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DataRefusal {
    /// It holds [`DataLimits::connections`](crate::transfer::DataLimits::connections) data connections already.
    Full,
    /// It holds [`DataLimits::per_key`](crate::transfer::DataLimits::per_key) data connections from our key already.
    FullForKey,
    /// No host link of its node has our static key and process (or none asked for our
    /// transfers within its handshake deadline): a data connection belongs to the host
    /// link whose key opened it.
    NoHostLink,
}

impl std::fmt::Display for DataRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataRefusal::Full => "it holds as many data connections as its limits allow: retry once transfers end, or raise its DataLimits::connections",
            DataRefusal::FullForKey => "it holds as many data connections from this key as its limits allow: retry once transfers end, or raise its DataLimits::per_key",
            DataRefusal::NoHostLink => "no host link of its node has this key and process: send over a host link to it, whose key opens the data connection",
        })
    }
}

mod cuda_code;
pub use cuda_code::CudaError;

#[cfg(test)]
mod tests;
