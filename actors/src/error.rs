use crate::ids::BufferId;
use baton_messages::protocol::CallFault;
use baton_messages::{DType, ExporterId, LeaseId, ProcessId};
use std::time::Duration;

/// Everything that can go wrong in the actor protocol.
///
/// Whose fault each variant is, [`fault`](Self::fault) says (the kinds of
/// [`baton_ipc::Fault`], an [`Ipc`](Self::Ipc) error having the kind of the error it
/// wraps). Those of kind [`Peer`](baton_ipc::Fault::Peer) — [`UnknownLease`](Self::UnknownLease),
/// [`Unexpected`](Self::Unexpected), [`TooManyOffers`](Self::TooManyOffers), … — are a peer
/// breaking the protocol: the link that carried it is dropped (see
/// [`PeerEvent::Down`](crate::PeerEvent::Down)), and every other link and lease carries on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ActorError {
    /// Memory or transport mechanics failed.
    #[error(transparent)]
    Ipc(#[from] baton_ipc::Error),
    /// A message or reply could not be encoded.
    #[error("could not encode {what}: {reason}")]
    Encode {
        /// What was being encoded.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// A message or reply could not be decoded.
    #[error("could not decode {what}: {reason}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// The remote side answered a call with a fault.
    #[error("the remote actor refused the call: {0:?}")]
    Remote(CallFault),
    /// The link to the peer closed before the operation completed. `cause` says whether
    /// the peer's process is known to be gone (build it with
    /// [`link_closed`](Self::link_closed), which looks).
    #[error("the link to {peer} is closed{cause}")]
    LinkClosed {
        /// The peer.
        peer: ProcessId,
        /// What this process knows of why.
        cause: LinkEnd,
    },
    /// The buffer's exporter is gone (its process died or its link closed): the data may
    /// be incomplete. Drop the lease; the mapping is closed when the last one goes.
    #[error("the exporter {exporter} is gone: this lease is orphaned, drop it")]
    Orphaned {
        /// The exporting process.
        exporter: ProcessId,
    },
    /// A buffer's element type is not the one asked for.
    #[error("buffer holds {got:?} elements, not {expected:?}")]
    WrongElementType {
        /// The element type asked for.
        expected: DType,
        /// The element type the buffer has (`None`: untyped).
        got: Option<DType>,
    },
    /// An element index or count outside the buffer.
    #[error("{len} elements at index {index} do not fit a buffer of {size} elements")]
    OutOfBounds {
        /// First element.
        index: usize,
        /// Elements accessed.
        len: usize,
        /// Elements in the buffer.
        size: usize,
    },
    /// The buffer is not (or no longer) owned here.
    #[error("{0:?} is not owned by this buffer owner (freed, or never allocated here)")]
    UnknownBuffer(BufferId),
    /// A buffer received from another process was put in an outgoing message: only its
    /// owner can share it.
    /// ([`Peer::forward`](crate::Peer::forward) passes a received buffer on to a third
    /// process instead.)
    #[error("a received buffer cannot be forwarded: ask its owner to share it")]
    NotOwned,
    /// The exporter refused to lease one of its buffers to a third process
    /// ([`Peer::forward`](crate::Peer::forward)): the lease is no longer out, the link to
    /// the exporter went down, the lease is writable (its holder's alone), or the relay is
    /// at its limit of forwarded leases.
    #[error("the exporter refused to forward the buffer: {reason}")]
    ForwardRefused {
        /// Why, as the exporter said it.
        reason: String,
    },
    /// `open()` was called on a buffer that was never received.
    #[error("this Shared buffer was not received from another process: use the Buffer itself")]
    NotReceived,
    /// A message carries more descriptor-shared buffers than a frame may carry.
    #[error(
        "a message carries {count} descriptor-shared allocations; a frame carries at most {max}"
    )]
    TooManyDescriptors {
        /// Descriptors needed.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The peer released a lease this link never granted it: unknown, released twice, or
    /// granted to another peer.
    #[error(
        "peer released {lease:?}, which this link never granted it (unknown, replayed, or another peer's)"
    )]
    UnknownLease {
        /// The lease.
        lease: LeaseId,
    },
    /// The peer offered a buffer it does not own.
    #[error("peer offered a buffer of {claimed}, not one of its own")]
    ForeignOffer {
        /// The exporter the handle names.
        claimed: ExporterId,
    },
    /// The peer offered the same lease twice.
    #[error("peer offered {lease:?} twice")]
    DuplicateLease {
        /// The lease.
        lease: LeaseId,
    },
    /// The peer answered a call that is not pending.
    #[error("peer answered call {id}, which is not pending")]
    UnknownCall {
        /// The call id.
        id: u64,
    },
    /// The peer sent a message that makes no sense on an established link.
    #[error("peer sent {got} on an established link")]
    Unexpected {
        /// The message kind.
        got: &'static str,
    },
    /// The peer sent more buffers in one message than [`LinkLimits::offers_per_message`](crate::LinkLimits::offers_per_message).
    #[error("peer sent {count} buffers in one message; at most {max} are accepted")]
    TooManyOffers {
        /// Buffers in the message.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The peer's offers would hold more leases open here than
    /// [`LinkLimits::leases_held`](crate::LinkLimits::leases_held).
    #[error("peer offered more than {max} leases to hold at once")]
    TooManyLeases {
        /// The limit.
        max: usize,
    },
    /// Over a host link, the peer's messages waiting behind one whose copies have not
    /// landed yet (their order is kept) would pass
    /// [`LinkLimits::held_messages`](crate::LinkLimits::held_messages) or
    /// [`LinkLimits::held_bytes`](crate::LinkLimits::held_bytes).
    #[error(
        "peer sent more than the link holds back in order: {messages} messages ({bytes} bytes) wait already; at most {max_messages} messages and {max_bytes} bytes may"
    )]
    TooManyHeld {
        /// Messages waiting when it was cut.
        messages: usize,
        /// Their payload bytes.
        bytes: usize,
        /// The limit in messages.
        max_messages: usize,
        /// The limit in bytes.
        max_bytes: usize,
    },
    /// The peer does not read what it makes us write (its pings' pongs, its calls'
    /// replies): more than [`LinkLimits::queued_bytes`](crate::LinkLimits::queued_bytes)
    /// would be queued for it.
    #[error("peer {peer} does not read: {queued} bytes are queued for it already")]
    PeerNotReading {
        /// The peer.
        peer: ProcessId,
        /// Bytes queued when it was cut.
        queued: usize,
    },
    /// A buffer of a reply could not be opened in this process (a descriptor limit, memory,
    /// an unsupported backend): the reply's leases were given back, the link stays up.
    #[error("a buffer of the reply could not be opened here: {0}")]
    OfferRefused(#[source] baton_ipc::Error),
    /// The peer held a revoked lease past its deadline and was cut off.
    #[error("peer held {lease:?} past its revoke deadline")]
    RevokeDeadline {
        /// The lease.
        lease: LeaseId,
    },
    /// The peer sent nothing (not even a pong) within the heartbeat deadline: stopped,
    /// deadlocked, or its event loop blocked. Its link was cut.
    #[error("{peer} sent nothing for {silent_for:?}: cut as unresponsive")]
    Unresponsive {
        /// The peer.
        peer: ProcessId,
        /// How long it had been silent.
        silent_for: Duration,
    },
    /// The link was cut because the peer's process exited (seen through its pidfd, or
    /// reaped by its supervisor) while the link was still up — as when a descendant
    /// inherited its socket, so that no end of stream came. A call pending when a peer
    /// dies usually fails with [`LinkClosed`](Self::LinkClosed) and
    /// [`LinkEnd::PeerDied`] instead: the end of stream comes first.
    #[error("{peer} exited (or was killed) while its link was up: the link was cut")]
    PeerExited {
        /// The peer.
        peer: ProcessId,
    },
    /// An actor's mailbox is closed.
    #[error("actor mailbox: {0}")]
    Mailbox(#[from] actix::MailboxError),
    /// A wait ran past its deadline.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        op: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// Leases on a buffer were still out when a deadline passed
    /// ([`Buffer::returned_within`](crate::Buffer::returned_within)): their holders keep
    /// them. Wait longer, or ask for them back ([`Revoke`](crate::Revoke)).
    #[error(
        "{buffer:?} still has {leases} leases out after {after:?}, held by {}: their holders keep them (a view or lease object still alive there; wait longer, or Revoke them)",
        holders_of(.holders)
    )]
    NotReturned {
        /// The buffer.
        buffer: BufferId,
        /// Leases still out when the deadline passed.
        leases: usize,
        /// Each lease still out and the process holding it (for a forwarded lease, the
        /// process it was forwarded to).
        holders: Vec<(LeaseId, ProcessId)>,
        /// The deadline.
        after: Duration,
    },
    /// A buffer was used on more streams than Baton tracks the uses of
    /// ([`MAX_STREAMS`](crate::MAX_STREAMS)).
    #[error("a buffer is used on more than {max} streams; synchronise one and use it there")]
    TooManyStreams {
        /// The limit.
        max: usize,
    },
    /// The peer's `Release` carried more fences than
    /// [`MAX_RELEASE_FENCES`](baton_messages::protocol::MAX_RELEASE_FENCES).
    #[error("peer released a lease with {count} fences; at most {max} are accepted")]
    TooManyFences {
        /// Fences in the release.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A child process could not be spawned.
    #[error("spawning child {name}: {source}")]
    Spawn {
        /// The child's name.
        name: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The peer asked for this node's status again while more answers than allowed were
    /// still being prepared for it (each costs a table of the node's buffers, and for the
    /// tree scope a request to every linked peer).
    #[error("peer asked for more than {max} statuses at once")]
    TooManyStatusRequests {
        /// The limit.
        max: usize,
    },
    /// [`Listening::accept`](crate::Listening::accept): the accept loop has ended (its
    /// actix system is stopping); no more peers will arrive.
    #[error("the listener stopped accepting: its actix system is stopping")]
    NotListening,
    /// A child started with [`Node::spawn_child`](crate::Node::spawn_child) exited before
    /// it linked to this node (it did not call `Node::join`, or failed before).
    #[error("child {pid} exited with {status} before it linked to this node")]
    ChildExited {
        /// Its pid.
        pid: u32,
        /// How it exited.
        status: std::process::ExitStatus,
    },
    /// A [`ProcessSupervisor`](crate::ProcessSupervisor) was asked for a child it cannot
    /// give ([`ChildPeer`](crate::supervisor::ChildPeer),
    /// [`ChildRunning`](crate::supervisor::ChildRunning)): see `reason`.
    #[error("supervised child {name:?} is not available: {reason}")]
    NoSuchChild {
        /// The name asked for.
        name: String,
        /// Why: no child of that name, it ended for good, the supervisor stops, or it
        /// does not link its children.
        reason: &'static str,
    },
    /// `Node::join` was called in a process that [`Node::spawn_child`](crate::Node::spawn_child)
    /// did not start (the socket variable is missing).
    #[error("no parent to join: {var} is not set (start this process with Node::spawn_child)")]
    NoParent {
        /// The environment variable that names the parent's socket.
        var: &'static str,
    },
    /// The exporter wrote to a buffer while leases on it were out: refused, since the
    /// holders may be reading it (a read-only lease gives them a `&[T]` of it). Await
    /// [`Buffer::returned`](crate::Buffer::returned) first.
    #[error("{buffer:?} has {leases} leases out: wait for them (Buffer::returned) before writing")]
    BufferLeased {
        /// The buffer.
        buffer: BufferId,
        /// Leases out on it.
        leases: usize,
    },
    /// A lease could not be granted without breaking the one-writer rule, which holds per
    /// byte range: a writable lease ([`Buffer::share_mut`](crate::Buffer::share_mut),
    /// [`Buffer::share_range_mut`](crate::Buffer::share_range_mut)) needs no other lease
    /// that overlaps its range to be out, and no lease is granted on a range while a
    /// writable one that overlaps it is out.
    #[error("{buffer:?} cannot be leased {wanted} now: {reason}")]
    LeaseConflict {
        /// The buffer.
        buffer: BufferId,
        /// `"writable"` or `"read-only"`.
        wanted: &'static str,
        /// What stands in the way.
        reason: &'static str,
    },
    /// A slice view ([`Lease::as_slice`](crate::Lease::as_slice)) was asked of memory the
    /// CPU cannot address (device memory): copy it (`to_vec`, `read_into`) or use it on a
    /// stream.
    #[error(
        "device memory has no CPU slice view: copy it (to_vec, read_into) or use it on a stream"
    )]
    NotHostMemory,
    /// A bundle has no tensor of this name.
    #[error("the bundle has no tensor named {name:?}")]
    NoSuchTensor {
        /// The name asked for.
        name: String,
    },
    /// A slower path than the one wanted would be taken, and this node's
    /// [`DowngradePolicy`](crate::DowngradePolicy) refuses downgrades (the default): allow
    /// them with [`NodeConfig::downgrades`](crate::NodeConfig::downgrades) or
    /// `BATON_ALLOW_DOWNGRADE=1`, or give the wanted path what it needs.
    #[error(
        "refused a downgrade ({kind}): {reason}; wanted {wanted}, only {available} is available. Allow it with BATON_ALLOW_DOWNGRADE=1 (or NodeConfig::downgrades), or fix what the wanted path needs"
    )]
    PathDowngrade {
        /// Which downgrade.
        kind: crate::paths::Downgrade,
        /// The path wanted.
        wanted: crate::paths::LeasePath,
        /// The slower path that is available.
        available: crate::paths::LeasePath,
        /// Why the wanted path is not there.
        reason: &'static str,
    },
    /// A received bundle's layout reaches past its buffer: it is refused when opened (and
    /// the lease given back).
    #[error("the bundle's tensors need {needs} bytes; its buffer has {len}")]
    BundleTooLarge {
        /// Bytes the layout needs.
        needs: u64,
        /// Bytes in the buffer.
        len: u64,
    },
    /// A receiver refused a part of a versioned sync (see
    /// [`SyncReceiver`](crate::SyncReceiver)): stale, skipping ahead, of a sync that is
    /// over, disagreeing with its sync, malformed, or not stamped. The part's lease goes
    /// back; the receiver keeps its version and the link carries on.
    #[error(transparent)]
    Version(#[from] baton_messages::VersionFault),
    /// A sync's deadline cannot be met (see [`SyncSender::begin`](crate::SyncSender::begin)):
    /// it is past, nearer than the sender's stated minimum, or further than a stamp can
    /// carry. Refused before anything is stamped.
    #[error(
        "a sync deadline {left:?} away cannot be met: it must be between {min:?} and {max:?} from now"
    )]
    InfeasibleDeadline {
        /// Time left to the deadline when it was asked for (zero: already past).
        left: Duration,
        /// The sender's minimum.
        min: Duration,
        /// The longest a stamp carries.
        max: Duration,
    },
    /// The sender's sync is over: its deadline passed, it was cancelled or replaced by a
    /// later one, or it never began. Nothing more of it can be stamped; receivers drop what
    /// they staged of it.
    #[error("sync of version {version} is over: {why}")]
    SyncOver {
        /// The version the sync was to make (the sender's next one).
        version: u64,
        /// Why.
        why: &'static str,
    },
}

impl ActorError {
    /// Whose fault this error is (see [`Fault`](baton_ipc::Fault)); an
    /// [`Ipc`](Self::Ipc) error has the kind of the error it wraps.
    pub fn fault(&self) -> baton_ipc::Fault {
        use baton_ipc::Fault;
        // No catch-all arm: a new variant must say whose fault it is.
        match self {
            ActorError::Ipc(e) => e.fault(),
            ActorError::UnknownLease { .. }
            | ActorError::ForeignOffer { .. }
            | ActorError::DuplicateLease { .. }
            | ActorError::UnknownCall { .. }
            | ActorError::Unexpected { .. }
            | ActorError::TooManyOffers { .. }
            | ActorError::TooManyLeases { .. }
            | ActorError::TooManyHeld { .. }
            | ActorError::TooManyFences { .. }
            | ActorError::PeerNotReading { .. }
            | ActorError::TooManyStatusRequests { .. } => Fault::Peer,
            ActorError::Remote(_) | ActorError::ForwardRefused { .. } => Fault::Refused,
            // A received bundle's layout names more memory than its buffer has: refused
            // when opened, its lease given back.
            ActorError::BundleTooLarge { .. } => Fault::Handle,
            // A part's stamp, as the peer wrote it, does not follow this receiver's version:
            // refused, its lease given back, the link kept.
            ActorError::Version(_) => Fault::Refused,
            // By construction a local failure to open a reply's buffer (see
            // `is_local_open_failure`): the link stays up.
            ActorError::OfferRefused(_) | ActorError::Spawn { .. } => Fault::Local,
            ActorError::Encode { .. }
            | ActorError::Decode { .. }
            | ActorError::WrongElementType { .. }
            | ActorError::OutOfBounds { .. }
            | ActorError::UnknownBuffer(_)
            | ActorError::NotOwned
            | ActorError::NotReceived
            | ActorError::TooManyDescriptors { .. }
            | ActorError::TooManyStreams { .. }
            | ActorError::NoParent { .. }
            | ActorError::NoSuchChild { .. }
            | ActorError::BufferLeased { .. }
            | ActorError::LeaseConflict { .. }
            | ActorError::NotHostMemory
            | ActorError::NoSuchTensor { .. }
            | ActorError::InfeasibleDeadline { .. }
            | ActorError::PathDowngrade { .. } => Fault::Usage,
            ActorError::LinkClosed { .. }
            | ActorError::Orphaned { .. }
            | ActorError::RevokeDeadline { .. }
            | ActorError::Unresponsive { .. }
            | ActorError::PeerExited { .. }
            | ActorError::Mailbox(_)
            | ActorError::Timeout { .. }
            | ActorError::NotReturned { .. }
            | ActorError::NotListening
            | ActorError::ChildExited { .. }
            | ActorError::SyncOver { .. } => Fault::Ended,
        }
    }

    /// Whether this error is a peer breaking the protocol (its link is dropped for it):
    /// [`Fault::Peer`](baton_ipc::Fault::Peer).
    pub fn is_peer_fault(&self) -> bool {
        self.fault() == baton_ipc::Fault::Peer
    }
}

/// `lease 3 (pid:123@456), ...` for [`ActorError::NotReturned`]'s message.
fn holders_of(holders: &[(LeaseId, ProcessId)]) -> String {
    if holders.is_empty() {
        return "nobody it can name".to_owned();
    }
    let named: Vec<String> = holders
        .iter()
        .map(|(lease, process)| format!("lease {lease} ({process})"))
        .collect();
    named.join(", ")
}

/// Why a link is closed, as far as this process can tell (see
/// [`ActorError::LinkClosed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LinkEnd {
    /// Closed by either side, or cut for a fault (the node's log and
    /// [`PeerEvent::Down`](crate::PeerEvent::Down) say which); the peer's process may live
    /// on, or is on another host (its life cannot be seen from here).
    Closed,
    /// The peer's process on this host is gone: it exited, or was killed.
    PeerDied,
}

impl std::fmt::Display for LinkEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkEnd::Closed => Ok(()),
            LinkEnd::PeerDied => f.write_str(": the peer process died (it exited or was killed)"),
        }
    }
}

impl ActorError {
    /// [`LinkClosed`](Self::LinkClosed) for `peer`, with [`LinkEnd::PeerDied`] if `peer` is
    /// a process of this host that is no longer alive (a zombie counts as dead).
    pub fn link_closed(peer: ProcessId) -> Self {
        let cause = if peer.boot == baton_ipc::process::boot_id()
            && baton_ipc::process::liveness(&peer) == baton_ipc::process::Liveness::Dead
        {
            LinkEnd::PeerDied
        } else {
            LinkEnd::Closed
        };
        ActorError::LinkClosed { peer, cause }
    }

    /// [`link_closed`](Self::link_closed), once the process's death had time to show: a
    /// killed peer's end of stream comes as the kernel closes its descriptors, a moment
    /// before it becomes a zombie. Looks again for up to 50 ms while the process seems
    /// alive (on the error path only).
    pub(crate) async fn link_closed_settled(peer: ProcessId) -> Self {
        for _ in 0..10 {
            let e = Self::link_closed(peer);
            if peer.boot != baton_ipc::process::boot_id()
                || matches!(
                    e,
                    ActorError::LinkClosed {
                        cause: LinkEnd::PeerDied,
                        ..
                    }
                )
            {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Self::link_closed(peer)
    }
}

#[cfg(test)]
mod tests;
