//! The link's protocol as a state machine without I/O: [`LinkSession`].
//!
//! Like quinn-proto's connection under quinn's driver (and the [`ledger`](crate::ledger)
//! beside it), a session owns no socket, task, timer or driver object. Its shell, the
//! [`PeerLink`](crate::PeerLink) actor, feeds it what happens — a frame read
//! ([`handle`](LinkSession::handle)), an offer opened or refused
//! ([`opened`](LinkSession::opened), [`refused`](LinkSession::refused)), a lease guard
//! dropped ([`released`](LinkSession::released)), a call sent, a heartbeat
//! ([`tick`](LinkSession::tick)), with the time it happened — and carries out the
//! [`Action`]s it returns: send a frame, open offers, hand a release to the ledger… A
//! frame that breaks the protocol is an `Err` with the typed fault ([`ActorError`], whose
//! [`is_peer_fault`](ActorError::is_peer_fault) is true), and the shell cuts the link with
//! it. Every interleaving can therefore be driven from a test (`link_session/tests.rs`:
//! every fault, and random frame sequences against a model).
//!
//! What a session tracks, for one link:
//!
//! - as **importer**: the leases held from the peer (each with its guard's liveness, and
//!   its bytes for the status of orphans), the peer's allocations this link keeps mapped,
//!   and the checks on every offer (the peer's own buffer, offered once, within the
//!   limits, its fence sane);
//! - as **caller**: our calls awaiting a reply (a reply to a call never made is a fault,
//!   a late one's leases go back);
//! - **liveness**: pings in flight and when the peer was last heard;
//! - **status**: our requests awaiting an answer, and the peer's being answered (bounded);
//! - **notices**: the frames the rest of the node asks the link to send ([`Notice`]: a
//!   revoke, an unmap, an eviction — only of a mapping the link keeps —, a release…);
//! - **forwarding**: the forwards we asked the peer for, awaiting its answer (an answer to
//!   one never asked, or an offer of a buffer not the peer's, is a fault), and which of the
//!   peer's forward requests are refused before anything is looked up (over a host link,
//!   or naming the relay or us);
//! - over a **host link**, the order of the user-visible messages read while their copies
//!   land ([`hold`](LinkSession::hold), [`held_ready`](LinkSession::held_ready)): handed
//!   on in the order read, and what waits bounded in messages and bytes;
//! - over a **host link**, the copies we lent (offered, pulled, sending; and the forwards
//!   among them), the order their pulls start them in ([`next_pulled`]), the route a
//!   `Release` of one takes ([`CopyReleased`]), the checks on the peer's offers (sealed
//!   copies only) and the bytes of its copies coming in ([`admit_copies_in`]).
//!
//! What it leaves to the shell, and why: the lease *grants* (the node's ledger, shared by
//! every link, decides them and a release's validity), the import cache and the driver
//! calls that open offers, the transfer engines and the waits on their transfers and on
//! fences, forwarding's relay tables (shared by the links a forward crosses), the outgoing queue
//! and its bounds, and the calls running now (their slots bound reading).
//!
//! [`next_pulled`]: LinkSession::next_pulled
//! [`admit_copies_in`]: LinkSession::admit_copies_in
//!
//! The types the shell attaches to the records (a lease's guard, a mapping's cache key,
//! a call's waiter) are the session's parameters ([`Attach`]), so a test attaches plain
//! values.

use crate::error::ActorError;
use crate::ids::{FastMap, FastSet};
use baton_messages::protocol::{
    Call, CallFault, Evict, Forward, Forwarded, MAX_RELEASE_FENCES, MAX_RENDEZVOUS_BYTES, Offer,
    Payload, PoolRetired, Pull, Release, Rendezvous, Reply, Revoke, Status, StatusRequest,
    StatusScope, Unmap, Unmapped,
};
use baton_messages::{
    AllocationId, CopyEngine, FenceHandle, HandleKey, HandleMsg, InboxGrant, LeaseId,
    Message as Wire, ProcessId, RawHandle,
};
use std::collections::BTreeSet;
use std::fmt;
use std::sync::Weak;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

mod copies;
mod held;
#[cfg(test)]
mod tests;

use copies::CopiesOut;
pub(crate) use copies::CopyReleased;
use held::HeldBack;
pub(crate) use held::Turn;

/// The leases a frame's offers name, once each: adjacent offers that name one lease are
/// its parts (see [`LinkSession::opened`]).
pub(crate) fn leases_of(offers: &[Offer]) -> impl Iterator<Item = LeaseId> + '_ {
    offers
        .iter()
        .enumerate()
        .filter(|(i, o)| *i == 0 || offers[i - 1].lease != o.lease)
        .map(|(_, o)| o.lease)
}

/// Status answers a link prepares for its peer at once; one more request is a protocol
/// fault ([`ActorError::TooManyStatusRequests`]).
pub(crate) const STATUS_ANSWERS: usize = 4;

/// Why a `Forward` over a host link is refused (the [`ActorError::ForwardRefused`] reason
/// its asker gets): a zero-copy forward would send the exporter's local handle to another
/// host (see `link/forward.rs`).
pub(crate) const HOST_LINK_FORWARD: &str = "a forward is zero-copy on one host only: the exporter sends no handle over a host link (a copy received from another host is this node's own memory: send it as a buffer)";

/// What the shell attaches to a session's records; the session only stores and hands
/// them back.
pub(crate) trait Attach {
    /// A lease held from the peer, as its guard is seen from the link: held while
    /// [`Held::is_held`].
    type Held: Held + Clone;
    /// A mapping of the peer's allocation that this link keeps warm (the import cache's
    /// key).
    type Mapping;
    /// A relayed lease's own hold on its mapping (a third process's memory), let go once
    /// its guard drops ([`LinkSession::released`]) or the link ends.
    type Relayed;
    /// Who waits for the reply to one of our calls.
    type Caller;
    /// A host link's message read and ready to hand on, waiting for those read before it
    /// ([`LinkSession::hold`]).
    type Handed;
    /// A device copy this host link offered and has not started sending: its bytes
    /// (pinned) and the work its send must follow.
    type Copy;
    /// A copy's send under way.
    type Sending;
    /// Who waits for a forward's copy to land.
    type Forward;
    /// Who waits for the exporter's answer to a forward we asked for
    /// ([`LinkSession::ask_forward`]).
    type Asked;
}

/// Whether a lease's guard still holds it (its last handle may drop before the shell
/// reports the lease [`released`](LinkSession::released)).
pub(crate) trait Held {
    /// Whether the lease is held still.
    fn is_held(&self) -> bool;
}

impl<T> Held for Weak<T> {
    fn is_held(&self) -> bool {
        self.strong_count() > 0
    }
}

/// What the session asks of the node while it checks a frame (the few calls that leave
/// it, in one place).
pub(crate) trait Checks {
    /// Whether `fence`, on an offer of `exporter`'s buffer, may be waited on: it names
    /// our inbox, in its producer's lane, with a sane value. An error is the peer's fault.
    fn check_fence(&self, exporter: &ProcessId, fence: &FenceHandle) -> Result<(), ActorError>;
    /// Whether our call `id` was handed out already (a reply to it that is not pending
    /// answers a call its caller gave up on).
    fn call_issued(&self, id: u64) -> bool;
    /// Whether a copy offered over a host link is sealed with the deployment's handle key
    /// (its digest). An error is the peer's fault.
    fn check_sealed(&self, handle: &HandleMsg) -> Result<(), ActorError>;
}

/// The limits of a session that the peer controls: past them is a protocol fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SessionLimits {
    /// Offers in one frame ([`ActorError::TooManyOffers`]).
    pub(crate) offers_per_message: usize,
    /// Leases held from the peer at once ([`ActorError::TooManyLeases`]).
    pub(crate) leases_held: usize,
    /// A host link's messages read and not handed on yet, at most
    /// ([`ActorError::TooManyHeld`]).
    pub(crate) held_messages: usize,
    /// Their payload bytes, at most.
    pub(crate) held_bytes: usize,
    /// Bytes of the peer's copies being received at once over a host link, at most: an
    /// offer past it is refused (the link kept), not a fault.
    pub(crate) copy_bytes: usize,
}

/// How a lease the peer releases was lent over this link — the one place a `Release` is
/// routed from, so that the shell does not probe its copy, forward and relay tables for
/// every release.
pub(crate) enum ReleaseRoute<A: Attach> {
    /// Granted by this node over this same-host link: the ledger's alone.
    Local,
    /// An offer of a third process we passed on over this link ([`passed_on`]): the
    /// `Release` goes to its exporter.
    ///
    /// [`passed_on`]: LinkSession::passed_on
    Passed,
    /// Lent over a host link: a copy, or a forward's copy, with what of it still runs.
    Copy(CopyReleased<A>),
}

impl<A: Attach> ReleaseRoute<A> {
    /// The route's name, for traces.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Passed => "passed",
            Self::Copy(CopyReleased::Copy { .. }) => "copy",
            Self::Copy(CopyReleased::Forward { .. }) => "forward copy",
        }
    }
}

/// What one frame asks of the shell, in order: most frames ask one thing, held without
/// an allocation; a few ask none or several.
pub(crate) enum Actions<A: Attach> {
    /// Exactly one action.
    One(Action<A>),
    /// Any number (none: an empty `Vec`, which allocates nothing).
    Many(Vec<Action<A>>),
}

impl<A: Attach> Actions<A> {
    fn none() -> Self {
        Self::Many(Vec::new())
    }

    fn one(action: Action<A>) -> Self {
        Self::One(action)
    }
}

impl<A: Attach> std::ops::Deref for Actions<A> {
    type Target = [Action<A>];

    fn deref(&self) -> &[Action<A>] {
        match self {
            Self::One(one) => std::slice::from_ref(one),
            Self::Many(many) => many,
        }
    }
}

impl<A: Attach> IntoIterator for Actions<A> {
    type Item = Action<A>;
    type IntoIter =
        std::iter::Chain<std::option::IntoIter<Action<A>>, std::vec::IntoIter<Action<A>>>;

    fn into_iter(self) -> Self::IntoIter {
        let (one, many) = match self {
            Self::One(one) => (Some(one), Vec::new()),
            Self::Many(many) => (None, many),
        };
        one.into_iter().chain(many)
    }
}

/// What the shell does next, for the session.
pub(crate) enum Action<A: Attach> {
    /// Send this frame of ours (it carries no descriptors).
    Send(Wire),
    /// Open these checked offers — the frame's descriptors go with them — all or none,
    /// reporting each through [`opened`](LinkSession::opened) or the rest through
    /// [`refused`](LinkSession::refused); then carry on with `then`.
    Open(Open<A>),
    /// The peer released a lease, by the route it was lent on ([`ReleaseRoute`]): one we
    /// passed on goes to its exporter (forwarding); else the ledger checks it was granted
    /// over this link, and takes its fences (their count is checked; each fence is checked
    /// by the shell).
    Released {
        /// The lease.
        lease: LeaseId,
        /// Its release fences.
        fences: Vec<FenceHandle>,
        /// How it was lent.
        route: ReleaseRoute<A>,
    },
    /// The exporter asks for a lease back by `deadline_ms`: one we hold (`held`), else one
    /// we forwarded (its holder is asked), else one whose `Release` crossed the revoke
    /// (nothing to do).
    Revoke {
        /// The lease.
        lease: LeaseId,
        /// Its deadline, as sent.
        deadline_ms: u32,
        /// Its guard, if we hold it.
        held: Option<A::Held>,
    },
    /// Let go of this link's warm mapping of `alloc`; send `Unmapped` once it is closed.
    Unhold {
        /// The allocation.
        alloc: AllocationId,
        /// Our mapping of it.
        mapping: A::Mapping,
    },
    /// The peer closed its mapping of our `alloc` (the ledger's hold ends).
    Unmapped(AllocationId),
    /// The peer asks us to let it drop its idle mapping of our `alloc`.
    Evict(AllocationId),
    /// The peer retired one of its memory pools: drop our import of it.
    ForgetPool(u64),
    /// Answer the peer's status request (then report [`status_answered`](LinkSession::status_answered)).
    AnswerStatus(StatusRequest),
    /// The peer lends us a lane of its fence inbox.
    AcceptInbox(InboxGrant),
    /// Across hosts: the peer posted its receive of an NCCL copy of ours: start the pulled
    /// copies' sends, in order ([`next_pulled`](LinkSession::next_pulled)).
    SendPulled,
    /// Across hosts: the peer's transfer engine's rendezvous message, for ours.
    Rendezvous(Vec<u8>),
    /// The peer asks us to lease a buffer to a third process (forwarding); the session
    /// answered the requests it refuses on sight.
    Forward(Forward),
    /// The exporter's answer to a forward we asked for: an offer of its buffer (its
    /// descriptor travels with the frame), or why it refused.
    Forwarded {
        /// Who asked.
        asked: A::Asked,
        /// The answer as it came (boxed, as on the wire: rare, and as large as the rest of
        /// the actions together): the offer, or the exporter's reason.
        answer: Box<Forwarded>,
    },
    /// A call of ours failed at the peer.
    CallFailed {
        /// Who waits for its reply.
        caller: A::Caller,
        /// Why.
        fault: CallFault,
    },
    /// A ping of ours came back.
    Pong {
        /// Its round trip.
        rtt: Duration,
        /// Who waits for it, if anyone.
        reply: Option<oneshot::Sender<Duration>>,
    },
}

/// Offers to open, checked, and what they came with.
pub(crate) struct Open<A: Attach> {
    /// The offers, in order.
    pub(crate) offers: Vec<Offer>,
    /// Whether they are relayed (a third process's buffers, passed on by the peer).
    pub(crate) relayed: bool,
    /// What to do with the leases once opened.
    pub(crate) then: Then<A>,
}

/// A frame the rest of the node asks a link to send its peer (through its `LinkRef`):
/// the session builds it, or finds it is not needed ([`LinkSession::notice`]).
#[derive(Debug)]
pub(crate) enum Notice {
    /// Ask the peer to give `lease` back within `within` (one of ours, or — as a relay —
    /// one we passed on to it, on its exporter's behalf).
    Revoke {
        /// The lease.
        lease: LeaseId,
        /// Its deadline, from now.
        within: Duration,
    },
    /// Ask the peer to close its mapping of our allocation.
    Unmap(AllocationId),
    /// One of our memory pools, whose descriptor went over this link, is retired.
    PoolRetired(u64),
    /// Our import cache's warm budget is exceeded: ask the peer to let us drop our
    /// mapping of its allocation (none is sent if this link no longer maps it).
    Evict(AllocationId),
    /// Our mapping of the peer's allocation is closed: its `Unmap` is answered.
    Unmapped(AllocationId),
    /// Give a lease back: a relayed lease once its mapping is closed, or — as a relay —
    /// a passed-on lease its holder gave back.
    Release(Release),
    /// Our transfer engine's rendezvous message, for the peer's (a host link's).
    Rendezvous(Vec<u8>),
}

/// A frame's copies coming in over a host link, admitted
/// ([`LinkSession::receive_copies`]).
#[derive(Debug)]
pub(crate) struct CopiesIn {
    /// Their bytes in all: they count against [`SessionLimits::copy_bytes`] until
    /// [`copies_in_done`](LinkSession::copies_in_done).
    pub(crate) bytes: usize,
    /// The `Pull`s that let the sender start the device copies, in the offers' order (the
    /// order NCCL pairs sends and receives in): sent once their receives are posted.
    pub(crate) pulls: Vec<Wire>,
}

impl CopiesIn {
    /// Whether one is a device copy: then the first with a peer makes the communicator,
    /// and a failure ends the link ([`order_lost`]).
    pub(crate) fn device(&self) -> bool {
        !self.pulls.is_empty()
    }
}

/// The engine an offered copy names (over a host link the session let only copies in).
pub(crate) fn copy_engine(offer: &Offer) -> CopyEngine {
    match offer.handle.raw {
        RawHandle::Copy { engine } => engine,
        _ => CopyEngine::Tcp,
    }
}

/// The handle of a copy we offer over a host link, from the handle `granted` for its
/// lease: the shape the peer's session checks for. It names the bytes the lease covers
/// alone (all of the buffer, or a range lease's part: the receiver's copy is an
/// allocation of exactly them), the engine that carries them, and no fence (we wait
/// before we send; no fence crosses hosts); sealed with the deployment's `key`.
pub(crate) fn copy_handle(
    mut granted: HandleMsg,
    engine: CopyEngine,
    key: &HandleKey,
) -> HandleMsg {
    granted.raw = RawHandle::Copy { engine };
    granted.alloc_size = granted.len;
    granted.offset = 0;
    granted.fence = None;
    granted.sealed(key)
}

/// Why a host link ends after its device copy of `lease` failed with `e`: NCCL pairs a
/// communicator's sends and receives by their order alone, so after a failure the next
/// send could meet a receive posted for another buffer (the sender's side cuts too,
/// which tells the receiver at once instead of at its deadline).
pub(crate) fn order_lost(lease: LeaseId, e: &baton_ipc::Error) -> ActorError {
    ActorError::Ipc(baton_ipc::Error::TransferFailed {
        id: lease.get(),
        reason: format!(
            "a device copy failed, so the order of NCCL's sends and receives with this peer is lost: {e}"
        ),
    })
}

/// How an opened lease's mapping is kept ([`LinkSession::opened`]).
pub(crate) enum Kept<A: Attach> {
    /// The peer's own allocation: this link keeps it warm (a hold, until the peer's
    /// `Unmap`).
    Warm(A::Mapping),
    /// A third process's memory, relayed: by the lease's own hold.
    Own(A::Relayed),
}

/// What opened offers are for.
pub(crate) enum Then<A: Attach> {
    /// Bare offers (or a relayed one): delivered to the node's inbox.
    Deliver,
    /// The peer's call: run its handler with them.
    Call {
        /// The call's id (its reply names it).
        id: u64,
        /// The registered actor called.
        target: String,
        /// The message type.
        type_name: String,
        /// The encoded message.
        payload: Vec<u8>,
    },
    /// The reply to a call of ours: its caller gets them.
    Reply {
        /// Who waits for the reply.
        caller: A::Caller,
        /// The encoded reply.
        bytes: Vec<u8>,
    },
}

/// What an ended session leaves to the shell.
pub(crate) struct Ended<A: Attach> {
    /// Our calls that were awaiting a reply: they fail.
    pub(crate) callers: Vec<A::Caller>,
    /// The leases still held, with their bytes: orphaned.
    pub(crate) orphans: Vec<(A::Held, u64)>,
    /// Who waits for a forward's copy over this host link: it fails.
    pub(crate) forwards: Vec<A::Forward>,
    /// Who waits for the peer's answer to a forward we asked for: it fails.
    pub(crate) asked: Vec<A::Asked>,
    /// The holds of the relayed leases still recorded: let go (their mappings close with
    /// their last use).
    pub(crate) relayed: Vec<A::Relayed>,
}

/// A lease held from the peer.
struct HeldFrom<A: Attach> {
    /// Its guard.
    guard: A::Held,
    /// The bytes it maps.
    bytes: u64,
    /// A relayed lease's own hold on its mapping (a third process's memory: see
    /// [`released`](LinkSession::released)).
    own: Option<A::Relayed>,
}

/// The link's protocol state (see the [module docs](self)).
pub(crate) struct LinkSession<A: Attach> {
    /// The peer's process.
    peer: ProcessId,
    /// What the peer calls itself in its own handles: `peer` over a Unix link (the kernel
    /// proved it); over a host link, the process it announced, which this node knows by
    /// that claim in its key's namespace (`peer`, see `baton_ipc::tcp::remote_process`).
    names_itself: ProcessId,
    /// Our own process.
    me: ProcessId,
    limits: SessionLimits,
    /// The peer's allocations this link keeps mapped.
    mapped: FastMap<AllocationId, A::Mapping>,
    /// Leases held from the peer.
    held: FastMap<LeaseId, HeldFrom<A>>,
    /// Offers of third processes we passed on to the peer, until it releases them
    /// ([`ReleaseRoute::Passed`]). Ours, not peer-fed: one per forward this node made.
    passed: FastSet<LeaseId>,
    /// Our calls awaiting the peer's reply.
    pending: FastMap<u64, A::Caller>,
    /// A host link's messages read and not handed on yet, in the order read (see
    /// [`hold`](Self::hold)).
    held_back: HeldBack<A::Handed>,
    /// Pings in flight: when each was sent, and who waits for its round trip.
    pings: FastMap<u64, (Instant, Option<oneshot::Sender<Duration>>)>,
    next_ping: u64,
    /// When the peer last sent anything.
    last_heard: Instant,
    /// Status requests of ours awaiting the peer's answer.
    status_waiters: FastMap<u64, oneshot::Sender<Result<String, ActorError>>>,
    /// The next id of a status request of ours.
    next_status: u64,
    /// Status answers being prepared for the peer (at most [`STATUS_ANSWERS`]).
    status_answers: usize,
    /// Forwards we asked the peer for, awaiting its answer. Ours, not peer-fed: one per
    /// forward this node asks for.
    asked: FastMap<u64, A::Asked>,
    /// The id of the next forward we ask for.
    next_forward: u64,
    /// The peer lent us a fence inbox lane already (at most once).
    inbox_received: bool,
    /// The peer runs on another host: buffers cross as copies, engines exchange
    /// rendezvous messages, and no fence crosses.
    across_hosts: bool,
    /// Over a host link, the copies we lent and those coming in.
    copies: CopiesOut<A>,
    /// The peer's memory pools whose descriptor came with an offer over this link (at most
    /// [`POOLS_REMEMBERED`]): a `PoolRetired` that names one drops our import of it, once;
    /// one that names another changes nothing (so a flood of them costs the driver
    /// thread nothing).
    pools: BTreeSet<u64>,
}

/// The most pools of the peer a session remembers for its `PoolRetired`s. An exporter has
/// one pool at a time (and retires it when idle), so a peer past this bound sends
/// descriptors of pools it never uses; the pools past it are dropped with the link.
const POOLS_REMEMBERED: usize = 64;

impl<A: Attach> fmt::Debug for LinkSession<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkSession")
            .field("peer", &self.peer)
            .field("mapped", &self.mapped.len())
            .field("held", &self.held.len())
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl<A: Attach> LinkSession<A> {
    /// A session with `peer`, for our process `me`, started at `now`.
    pub(crate) fn new(peer: ProcessId, me: ProcessId, limits: SessionLimits, now: Instant) -> Self {
        Self {
            peer,
            names_itself: peer,
            me,
            limits,
            mapped: FastMap::default(),
            held: FastMap::default(),
            passed: FastSet::default(),
            pending: FastMap::default(),
            held_back: HeldBack::default(),
            pings: FastMap::default(),
            next_ping: 1,
            last_heard: now,
            status_waiters: FastMap::default(),
            next_status: 1,
            status_answers: 0,
            asked: FastMap::default(),
            next_forward: 1,
            inbox_received: false,
            across_hosts: false,
            copies: CopiesOut::default(),
            pools: BTreeSet::new(),
        }
    }

    /// The same session, with a peer on another host (a host link): it takes
    /// [`Pull`](Wire::Pull) and [`Rendezvous`](Wire::Rendezvous) frames, and refuses a
    /// [`FenceInbox`](Wire::FenceInbox) or an offer with a fence (no fence crosses hosts).
    /// `claimed` is the process the peer announced (its handles name it so), a claim:
    /// nothing is keyed by it.
    pub(crate) fn across_hosts(mut self, claimed: ProcessId) -> Self {
        self.across_hosts = true;
        self.names_itself = claimed;
        self
    }

    /// A frame from the peer, read at `now`: what to do about it, or the peer's fault.
    /// The frame's descriptors stay with the shell, for the [`Action::Open`] or
    /// [`Action::Forwarded`] it may return (they close otherwise).
    ///
    /// # Errors
    /// The protocol fault the frame commits (the link is cut with it).
    pub(crate) fn handle(
        &mut self,
        frame: Wire,
        now: Instant,
        checks: &impl Checks,
    ) -> Result<Actions<A>, ActorError> {
        self.last_heard = now;
        let action = match frame {
            Wire::Call(Call {
                id,
                target,
                type_name,
                payload,
                offers,
            }) => self.open(
                offers,
                false,
                Then::Call {
                    id,
                    target,
                    type_name,
                    payload,
                },
                checks,
            )?,
            Wire::Reply(reply) => return self.on_reply(reply, checks),
            Wire::Release(Release { lease, fences }) => {
                if fences.len() > MAX_RELEASE_FENCES {
                    return Err(ActorError::TooManyFences {
                        count: fences.len(),
                        max: MAX_RELEASE_FENCES,
                    });
                }
                let route = if self.across_hosts {
                    ReleaseRoute::Copy(self.copies.released(lease))
                } else if self.passed.remove(&lease) {
                    ReleaseRoute::Passed
                } else {
                    ReleaseRoute::Local
                };
                Action::Released {
                    lease,
                    fences,
                    route,
                }
            }
            Wire::Revoke(Revoke { lease, deadline_ms }) => Action::Revoke {
                lease,
                deadline_ms,
                held: self
                    .held
                    .get(&lease)
                    .map(|h| &h.guard)
                    .filter(|h| h.is_held())
                    .cloned(),
            },
            Wire::Unmap(Unmap { alloc }) => match self.mapped.remove(&alloc) {
                Some(mapping) => Action::Unhold { alloc, mapping },
                // Not mapped (never, or no more): nothing to close.
                None => Action::Send(Wire::Unmapped(Unmapped { alloc })),
            },
            Wire::Unmapped(Unmapped { alloc }) => Action::Unmapped(alloc),
            Wire::Evict(Evict { alloc }) => Action::Evict(alloc),
            Wire::Offer(offer) => self.open(vec![*offer], false, Then::Deliver, checks)?,
            Wire::Relayed(relayed) => {
                self.open(vec![relayed.offer], true, Then::Deliver, checks)?
            }
            Wire::Ping(n) => Action::Send(Wire::Pong(n)),
            Wire::Pong(n) => match self.pings.remove(&n) {
                Some((sent, reply)) => Action::Pong {
                    rtt: now.saturating_duration_since(sent),
                    reply,
                },
                // A pong we did not ask for is harmless: nothing is recorded for it.
                None => return Ok(Actions::none()),
            },
            Wire::StatusRequest(request) => {
                if self.status_answers >= STATUS_ANSWERS {
                    return Err(ActorError::TooManyStatusRequests {
                        max: STATUS_ANSWERS,
                    });
                }
                self.status_answers += 1;
                Action::AnswerStatus(request)
            }
            Wire::Status(status) => {
                self.on_status(status)?;
                return Ok(Actions::none());
            }
            Wire::Forward(forward) => self.on_forward(forward),
            Wire::Forwarded(forwarded) => return self.on_forwarded(forwarded),
            Wire::FenceInbox(_) if self.across_hosts => {
                return Err(ActorError::Unexpected {
                    got: "a FenceInbox on a host link",
                });
            }
            Wire::PoolRetired(_) if self.across_hosts => {
                return Err(ActorError::Unexpected {
                    got: "a PoolRetired on a host link",
                });
            }
            Wire::PoolRetired(PoolRetired { pool }) => match self.pools.remove(&pool) {
                true => Action::ForgetPool(pool),
                // Not a pool whose descriptor came over this link: nothing of ours to drop.
                false => return Ok(Actions::none()),
            },
            Wire::Pull(_) | Wire::Rendezvous(_) if !self.across_hosts => {
                return Err(ActorError::Unexpected {
                    got: "a message for transfer engines on a link within one host",
                });
            }
            Wire::Pull(Pull { lease }) => {
                if !self.copies.pull(lease) {
                    return Err(ActorError::Unexpected {
                        got: "a Pull of a lease not offered as a device copy, or pulled twice",
                    });
                }
                Action::SendPulled
            }
            Wire::Rendezvous(Rendezvous { bytes }) => {
                if bytes.len() > MAX_RENDEZVOUS_BYTES {
                    return Err(ActorError::Unexpected {
                        got: "an oversized Rendezvous",
                    });
                }
                Action::Rendezvous(bytes)
            }
            Wire::FenceInbox(grant) => {
                if std::mem::replace(&mut self.inbox_received, true) {
                    return Err(ActorError::Unexpected {
                        got: "a second FenceInbox",
                    });
                }
                Action::AcceptInbox(grant)
            }
            other => return Err(ActorError::Unexpected { got: other.kind() }),
        };
        Ok(Actions::one(action))
    }

    /// Checks offers and asks the shell to open them; remembers the pools whose
    /// descriptors came with the peer's own offers.
    fn open(
        &mut self,
        offers: Vec<Offer>,
        relayed: bool,
        then: Then<A>,
        checks: &impl Checks,
    ) -> Result<Action<A>, ActorError> {
        self.check_offers(&offers, relayed, checks)?;
        if !relayed {
            for offer in &offers {
                if let RawHandle::CudaPool {
                    pool,
                    pool_slot: Some(_),
                    ..
                } = offer.handle.raw
                {
                    if self.pools.len() < POOLS_REMEMBERED {
                        self.pools.insert(pool);
                    }
                }
            }
        }
        Ok(Action::Open(Open {
            offers,
            relayed,
            then,
        }))
    }

    /// Checks a frame's offers before anything is opened: each is the peer's own (a
    /// relayed one: a third process's), offered once, its fence sane, and the leases fit
    /// the limits. Adjacent offers that name one lease are its parts (a lease over
    /// several buffers: never relayed, never over a host link); a lease named apart
    /// twice is a duplicate. An error is the peer's fault.
    fn check_offers(
        &self,
        offers: &[Offer],
        relayed: bool,
        checks: &impl Checks,
    ) -> Result<(), ActorError> {
        if offers.len() > self.limits.offers_per_message {
            return Err(ActorError::TooManyOffers {
                count: offers.len(),
                max: self.limits.offers_per_message,
            });
        }
        for (i, offer) in offers.iter().enumerate() {
            let exporter = offer.handle.exporter.process;
            if relayed {
                if exporter == self.names_itself || exporter == self.me {
                    return Err(ActorError::Unexpected {
                        got: "Relayed offer of the relay's or our own buffer",
                    });
                }
            } else if exporter != self.names_itself {
                return Err(ActorError::ForeignOffer {
                    claimed: offer.handle.exporter,
                });
            }
            if self.across_hosts {
                if offer.handle.fence.is_some() {
                    // A copy waits on nothing of the sender's (it waits before it sends); a
                    // fence's exporter over a host link is a claim, never checked or opened.
                    return Err(ActorError::Unexpected {
                        got: "an offer with a fence over a host link",
                    });
                }
                // Only copies cross hosts: any other handle names memory of *this* host (a
                // segment name, a CUDA handle) that a process elsewhere has no business
                // naming.
                if !matches!(offer.handle.raw, RawHandle::Copy { .. }) {
                    return Err(
                        baton_ipc::Error::from(baton_messages::Error::BackendMismatch {
                            backend: offer.handle.backend,
                            raw: offer.handle.raw.kind_name(),
                        })
                        .into(),
                    );
                }
                checks.check_sealed(&offer.handle)?;
            }
            if let Some(fence) = &offer.handle.fence {
                // Before anything waits on it (forged fences are the peer's fault).
                checks.check_fence(&exporter, fence)?;
            }
            // A part of the lease of the offer before it.
            if i > 0 && offers[i - 1].lease == offer.lease {
                if relayed || self.across_hosts {
                    return Err(ActorError::Unexpected {
                        got: "a lease over several buffers relayed or over a host link",
                    });
                }
                continue;
            }
            // Held still — or relayed and not given back yet: its own hold on the mapping
            // would be lost under a second one.
            let held = self
                .held
                .get(&offer.lease)
                .is_some_and(|h| h.guard.is_held() || h.own.is_some());
            if held || offers[..i].iter().any(|o| o.lease == offer.lease) {
                return Err(ActorError::DuplicateLease { lease: offer.lease });
            }
        }
        let leases = leases_of(offers).count();
        if self.held.len() + leases > self.limits.leases_held {
            return Err(ActorError::TooManyLeases {
                max: self.limits.leases_held,
            });
        }
        Ok(())
    }

    fn on_reply(&mut self, reply: Reply, checks: &impl Checks) -> Result<Actions<A>, ActorError> {
        let Some(caller) = self.pending.remove(&reply.id) else {
            if !checks.call_issued(reply.id) {
                return Err(ActorError::UnknownCall { id: reply.id });
            }
            // A call its caller gave up on (a timeout): give back what the reply carries.
            tracing::debug!(call = reply.id, "late reply dropped");
            return match reply.outcome {
                Ok(payload) => {
                    if payload.offers.len() > self.limits.offers_per_message {
                        return Err(ActorError::TooManyOffers {
                            count: payload.offers.len(),
                            max: self.limits.offers_per_message,
                        });
                    }
                    Ok(Actions::Many(
                        self.refused(&payload.offers, false)
                            .into_iter()
                            .map(Action::Send)
                            .collect(),
                    ))
                }
                Err(_) => Ok(Actions::none()),
            };
        };
        let action = match reply.outcome {
            Ok(Payload { bytes, offers }) => {
                self.open(offers, false, Then::Reply { caller, bytes }, checks)?
            }
            Err(fault) => Action::CallFailed { caller, fault },
        };
        Ok(Actions::one(action))
    }

    /// The peer's answer to a status request of ours. One to a request we never made is
    /// a protocol fault; one to a request whose asker gave up is dropped.
    /// The peer asks us to lease a buffer to a third process: refused at once over a host
    /// link (nothing is looked up: its `to` names a process of its key's choosing, and the
    /// offer would carry our local handle over TCP), or when it names the relay or us. A
    /// refusal is an answer, not a fault.
    fn on_forward(&self, forward: Forward) -> Action<A> {
        let reason = if self.across_hosts {
            tracing::warn!(lease = %forward.lease, "refused a forward over a host link");
            HOST_LINK_FORWARD.to_owned()
        } else if forward.to == self.peer || forward.to == self.me {
            format!("{} is the relay or the exporter itself", forward.to)
        } else {
            return Action::Forward(forward);
        };
        let refused = ActorError::ForwardRefused { reason };
        tracing::debug!(lease = %forward.lease, to = %forward.to, error = %refused, "refused to forward");
        Action::Send(Wire::Forwarded(Box::new(Forwarded {
            id: forward.id,
            outcome: Err(refused.to_string()),
        })))
    }

    /// The exporter's answer to a forward: one we asked for, answered once, with an offer
    /// of the peer's own buffer. An answer to a forward answered already is stale: its
    /// offer goes back. Over a host link no offer comes (it would carry a local handle of
    /// another host, and we ask no forward there).
    fn on_forwarded(&mut self, answer: Box<Forwarded>) -> Result<Actions<A>, ActorError> {
        let id = answer.id;
        if self.across_hosts && answer.outcome.is_ok() {
            return Err(ActorError::Unexpected {
                got: "a Forwarded offer on a host link",
            });
        }
        let Some(asked) = self.asked.remove(&id) else {
            if id == 0 || id >= self.next_forward {
                return Err(ActorError::Unexpected {
                    got: "a Forwarded answering no forward of ours",
                });
            }
            return Ok(match &answer.outcome {
                Ok(offer) => Actions::one(Action::Send(Wire::Release(Release::now(offer.lease)))),
                Err(_) => Actions::none(),
            });
        };
        if let Ok(offer) = &answer.outcome {
            if offer.handle.exporter.process != self.names_itself {
                // Its asker fails with the link (`Ended::asked`).
                self.asked.insert(id, asked);
                return Err(ActorError::ForeignOffer {
                    claimed: offer.handle.exporter,
                });
            }
        }
        Ok(Actions::one(Action::Forwarded { asked, answer }))
    }

    fn on_status(&mut self, status: Status) -> Result<(), ActorError> {
        match self.status_waiters.remove(&status.id) {
            Some(tx) => {
                let _ = tx.send(Ok(status.json));
                Ok(())
            }
            None if status.id < self.next_status => Ok(()),
            None => Err(ActorError::Unexpected { got: "Status" }),
        }
    }

    /// An offer of an [`Action::Open`] opened: its lease is held (through `held`), its
    /// mapping `kept`. For an offer of the peer's own buffer, returns whether it is the
    /// first over this link — a *hold* starts, that keeps the mapping warm for the next
    /// offer until the peer says `Unmap`. `part`: the offer is a part of the lease of the
    /// offer opened before it (a lease over several buffers), held already through that
    /// one's guard; its bytes count with it.
    pub(crate) fn opened(
        &mut self,
        offer: &Offer,
        guard: A::Held,
        kept: Kept<A>,
        part: bool,
    ) -> bool {
        let (new_hold, own) = match kept {
            Kept::Warm(m) => (self.mapped.insert(offer.handle.alloc, m).is_none(), None),
            Kept::Own(own) => (false, Some(own)),
        };
        let bytes = offer.handle.len;
        match self.held.get_mut(&offer.lease).filter(|_| part) {
            Some(held) => held.bytes = held.bytes.saturating_add(bytes),
            None => {
                self.held
                    .insert(offer.lease, HeldFrom { guard, bytes, own });
            }
        }
        new_hold
    }

    /// Offers of an [`Action::Open`] that were not opened (a local failure, or the
    /// peer's call a late reply carries): the frames that give them back — `Release` for
    /// each lease, and `Unmapped` for each allocation we do not map, since the exporter
    /// counts a mapping hold from the moment it offers (a relayed offer starts none).
    pub(crate) fn refused(&self, offers: &[Offer], relayed: bool) -> Vec<Wire> {
        let mut frames = Vec::with_capacity(offers.len() + 1);
        let mut unmapped: Vec<AllocationId> = Vec::new();
        frames.extend(leases_of(offers).map(|lease| Wire::Release(Release::now(lease))));
        for offer in offers {
            let alloc = offer.handle.alloc;
            if !relayed && !self.mapped.contains_key(&alloc) && !unmapped.contains(&alloc) {
                unmapped.push(alloc);
            }
        }
        frames.extend(
            unmapped
                .into_iter()
                .map(|alloc| Wire::Unmapped(Unmapped { alloc })),
        );
        frames
    }

    /// The guard of a lease we held dropped: it is no longer held. Returns a relayed
    /// lease's own hold (its `Release` waits for its mapping to close).
    pub(crate) fn released(&mut self, lease: LeaseId) -> Option<A::Relayed> {
        self.held.remove(&lease).and_then(|h| h.own)
    }

    /// We passed a third process's offer on to the peer as `lease` (forwarding): its
    /// `Release` is routed to that offer's exporter ([`ReleaseRoute::Passed`]).
    pub(crate) fn passed_on(&mut self, lease: LeaseId) {
        self.passed.insert(lease);
    }

    /// The frame that passed `lease` on was never sent.
    pub(crate) fn pass_failed(&mut self, lease: LeaseId) {
        self.passed.remove(&lease);
    }

    /// Leases held from the peer now.
    pub(crate) fn held(&self) -> usize {
        self.held.len()
    }

    /// The bytes a lease held from the peer maps (every part's, for a lease over several
    /// buffers).
    #[cfg(test)]
    pub(crate) fn held_bytes(&self, lease: LeaseId) -> Option<u64> {
        self.held.get(&lease).map(|h| h.bytes)
    }

    /// Whether this link keeps the peer's `alloc` mapped.
    #[cfg(test)]
    pub(crate) fn maps(&self, alloc: AllocationId) -> bool {
        self.mapped.contains_key(&alloc)
    }

    /// A host link read a user-visible message (a call, a reply, a bare offer) of
    /// `bytes` payload bytes, whose buffers arrive as copies while the link reads on: its
    /// turn in the order read. The message is handed on only once those read before it
    /// are ([`held_ready`](Self::held_ready)), as over a Unix link.
    ///
    /// # Errors
    /// [`ActorError::TooManyHeld`]: more messages or payload bytes would wait behind one
    /// not handed on yet than [`SessionLimits`] allow — the peer's fault (its link is cut).
    pub(crate) fn hold(&mut self, bytes: usize) -> Result<Turn, ActorError> {
        self.held_back
            .admit(bytes, self.limits.held_messages, self.limits.held_bytes)
    }

    /// The message of `turn` is ready to hand on (its copies landed or failed, or it had
    /// none): what may be handed on now, in the order read — nothing while one read before
    /// it is not ready.
    pub(crate) fn held_ready(&mut self, turn: Turn, item: A::Handed) -> Vec<A::Handed> {
        self.held_back.ready(turn, item)
    }

    /// A host link's messages read and not handed on now.
    pub(crate) fn held_back(&self) -> usize {
        self.held_back.waiting()
    }

    /// Copies of ours over a host link that are offered, pulled or sending now.
    #[cfg(test)]
    pub(crate) fn copies_out(&self) -> usize {
        self.copies.len()
    }

    /// Bytes of the peer's copies being received now.
    #[cfg(test)]
    pub(crate) fn copies_in(&self) -> usize {
        self.copies.bytes_in()
    }

    /// Our calls awaiting a reply now.
    #[cfg(test)]
    pub(crate) fn calls_pending(&self) -> usize {
        self.pending.len()
    }

    /// A call of ours was queued: `caller` waits for its reply.
    pub(crate) fn call_sent(&mut self, id: u64, caller: A::Caller) {
        self.pending.insert(id, caller);
    }

    /// The caller of our call `id` gave up: a reply to it is late.
    pub(crate) fn cancel(&mut self, id: u64) {
        self.pending.remove(&id);
    }

    /// A ping to send at `now`; `reply` gets the round trip when its pong comes back.
    pub(crate) fn ping(&mut self, now: Instant, reply: Option<oneshot::Sender<Duration>>) -> Wire {
        let n = self.next_ping;
        self.next_ping += 1;
        self.pings.insert(n, (now, reply));
        Wire::Ping(n)
    }

    /// A heartbeat at `now`: the ping to send, or [`ActorError::Unresponsive`] if the
    /// peer sent nothing within `deadline`. While `reading_paused` (every call slot is
    /// busy, so we do not read) the silence is ours. Pings never answered are forgotten
    /// once the deadline passed for them.
    ///
    /// # Errors
    /// [`ActorError::Unresponsive`].
    pub(crate) fn tick(
        &mut self,
        now: Instant,
        deadline: Duration,
        reading_paused: bool,
    ) -> Result<Wire, ActorError> {
        if reading_paused {
            self.last_heard = now;
        }
        let silent_for = now.saturating_duration_since(self.last_heard);
        if silent_for >= deadline {
            return Err(ActorError::Unresponsive {
                peer: self.peer,
                silent_for,
            });
        }
        self.pings
            .retain(|_, (sent, _)| now.saturating_duration_since(*sent) < deadline);
        Ok(self.ping(now, None))
    }

    /// Pings awaiting their pong.
    #[cfg(test)]
    pub(crate) fn pings(&self) -> usize {
        self.pings.len()
    }

    /// A status request of ours, for at most `limit` entries: its id and frame. Once it
    /// is sent, [`await_status`](Self::await_status) registers who waits for the answer.
    pub(crate) fn status_request(&mut self, limit: u32) -> (u64, Wire) {
        let id = self.next_status;
        self.next_status += 1;
        // Answers nobody waits for any more are forgotten as requests are made.
        self.status_waiters.retain(|_, tx| !tx.is_closed());
        let request = Wire::StatusRequest(StatusRequest {
            id,
            scope: StatusScope::Node,
            limit,
        });
        (id, request)
    }

    /// `reply` waits for the answer to our status request `id`.
    pub(crate) fn await_status(
        &mut self,
        id: u64,
        reply: oneshot::Sender<Result<String, ActorError>>,
    ) {
        self.status_waiters.insert(id, reply);
    }

    /// A forward we ask the peer for: of the buffer of our `lease` to the process `to`. Its
    /// id and frame; once it is sent, [`await_forward`](Self::await_forward) registers who
    /// waits for the answer ([`Action::Forwarded`]).
    pub(crate) fn ask_forward(&mut self, lease: LeaseId, to: ProcessId) -> (u64, Wire) {
        let id = self.next_forward;
        self.next_forward += 1;
        (id, Wire::Forward(Forward { id, lease, to }))
    }

    /// `asked` waits for the peer's answer to our forward `id`.
    pub(crate) fn await_forward(&mut self, id: u64, asked: A::Asked) {
        self.asked.insert(id, asked);
    }

    /// The frame that carries `notice` to the peer, if one is needed.
    pub(crate) fn notice(&self, notice: Notice) -> Option<Wire> {
        tracing::trace!(?notice, "notice");
        Some(match notice {
            Notice::Revoke { lease, within } => Wire::Revoke(Revoke {
                lease,
                deadline_ms: u32::try_from(within.as_millis()).unwrap_or(u32::MAX),
            }),
            Notice::Unmap(alloc) => Wire::Unmap(Unmap { alloc }),
            Notice::PoolRetired(pool) => Wire::PoolRetired(PoolRetired { pool }),
            Notice::Evict(alloc) if self.mapped.contains_key(&alloc) => {
                Wire::Evict(Evict { alloc })
            }
            Notice::Evict(_) => return None,
            Notice::Unmapped(alloc) => Wire::Unmapped(Unmapped { alloc }),
            Notice::Release(release) => Wire::Release(release),
            Notice::Rendezvous(bytes) => Wire::Rendezvous(Rendezvous { bytes }),
        })
    }

    /// Forwards we asked for whose answer has not come.
    #[cfg(test)]
    pub(crate) fn forwards_asked(&self) -> usize {
        self.asked.len()
    }

    /// One of the peer's status requests ([`Action::AnswerStatus`]) was answered.
    pub(crate) fn status_answered(&mut self) {
        self.status_answers = self.status_answers.saturating_sub(1);
    }

    /// Over a host link, we offered a device copy of `lease`: its send starts once the
    /// peer pulls it, in the order of the pulls.
    pub(crate) fn copy_offered(&mut self, lease: LeaseId, copy: A::Copy) {
        self.copies.offered(lease, copy);
    }

    /// The send of our copy of `lease` started (a host copy's at its offer, a device
    /// copy's once pulled and taken by [`take_pulled`](Self::take_pulled)).
    pub(crate) fn copy_sending(&mut self, lease: LeaseId, sending: A::Sending) {
        self.copies.sending(lease, sending);
    }

    /// The copy of `lease` is a forward's: `waiter` hears how it ends, when the peer
    /// releases it ([`CopyReleased::Forward`]) or the link ends ([`Ended::forwards`]).
    pub(crate) fn forward_offered(&mut self, lease: LeaseId, waiter: A::Forward) {
        self.copies.forwarded(lease, waiter);
    }

    /// The pulled device copy whose send must start next, if any.
    pub(crate) fn next_pulled(&mut self) -> Option<&A::Copy> {
        self.copies.next_pulled()
    }

    /// Takes the [`next_pulled`](Self::next_pulled) copy, to start its send (then
    /// reported by [`copy_sending`](Self::copy_sending)).
    pub(crate) fn take_pulled(&mut self) -> Option<(LeaseId, A::Copy)> {
        self.copies.take_pulled()
    }

    /// The frame that offered our copy of `lease` was never sent: it is forgotten, and its
    /// send, if one started, is handed back to be stopped.
    pub(crate) fn copy_unsent(&mut self, lease: LeaseId) -> Option<A::Sending> {
        self.copies.forget(lease)
    }

    /// Copies of `bytes` in all are to be received: whether they fit the link's bound
    /// ([`SessionLimits::copy_bytes`]; then they count until [`copies_in_done`]).
    ///
    /// [`copies_in_done`]: Self::copies_in_done
    pub(crate) fn admit_copies_in(&mut self, bytes: usize) -> bool {
        self.copies.admit_in(bytes, self.limits.copy_bytes)
    }

    /// A frame's offered copies (of an [`Action::Open`] over a host link), to be received
    /// now: admitted ([`CopiesIn`]), or refused with the reason — the link kept, their
    /// leases given back — when they are relayed (a relay forwards to another host as a
    /// copy of its own, never a third process's handle) or would pass the link's bound on
    /// copies in flight (each is memory of ours: a peer cannot make us allocate without
    /// bound).
    pub(crate) fn receive_copies(
        &mut self,
        offers: &[Offer],
        relayed: bool,
    ) -> Result<CopiesIn, &'static str> {
        if relayed {
            return Err("a relayed offer does not cross hosts");
        }
        let bytes = offers
            .iter()
            .fold(0usize, |n, o| n.saturating_add(o.handle.len as usize));
        if !self.admit_copies_in(bytes) {
            return Err("the link's copies in flight would pass LinkLimits::copy_bytes");
        }
        let pulls = offers
            .iter()
            .filter(|o| copy_engine(o) == CopyEngine::Nccl)
            .map(|o| Wire::Pull(Pull { lease: o.lease }))
            .collect();
        Ok(CopiesIn { bytes, pulls })
    }

    /// Copies of `bytes` admitted by [`admit_copies_in`](Self::admit_copies_in) landed or
    /// failed.
    pub(crate) fn copies_in_done(&mut self, bytes: usize) {
        self.copies.landed_in(bytes);
    }

    /// The link ended: what the session held that others wait on.
    pub(crate) fn end(&mut self) -> Ended<A> {
        let (mut orphans, mut relayed) = (Vec::new(), Vec::new());
        for (_, HeldFrom { guard, bytes, own }) in self.held.drain() {
            relayed.extend(own);
            if guard.is_held() {
                orphans.push((guard, bytes));
            }
        }
        Ended {
            forwards: self.copies.end(),
            asked: self.asked.drain().map(|(_, asked)| asked).collect(),
            callers: self.pending.drain().map(|(_, caller)| caller).collect(),
            orphans,
            relayed,
        }
    }
}
