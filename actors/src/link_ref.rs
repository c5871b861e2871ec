//! What the rest of the crate holds of a link: a [`LinkRef`] — the link's id, the state it
//! shares with the guards that depend on it, and its actor's mailbox — the messages the
//! actor takes from elsewhere ([`LinkCommand`]), and the settings a link runs under
//! ([`Heartbeat`], [`LinkLimits`]).
//!
//! It sits low, under everything that holds a link: lease guards (`buffer`), the exports
//! that revoke and unmap through links, remote addresses, forwarding's tables, the node.
//! It names no actor: the link actor (`link`) sits above the node it serves, and a
//! `LinkRef` reaches it through an actix `Recipient` of [`LinkCommand`] — the same
//! mailbox, in the same order, as its `Addr`. Typed calls carry buffers and go through a
//! `Recipient` of their own (`OutCall`, in `remote`), which a [`Peer`](crate::Peer)
//! holds.

use crate::error::ActorError;
use crate::ids::LinkId;
pub(crate) use crate::link_session::Notice;
use actix::prelude::*;
use baton_ipc::{ExportedFence, HolderId, Imported, UseMark};
use baton_messages::protocol::{Offer, Release};
use baton_messages::{FenceHandle, LeaseId, ProcessId};
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Semaphore, oneshot};

/// Which directions of a link have carried frames through a shared-memory ring instead of
/// the socket ([`Peer::rings`](crate::Peer::rings); on by default for links on one host:
/// [`NodeConfig::ring`](crate::NodeConfig::ring) or `BATON_LINK_RING`). A direction counts
/// once a frame has gone that way through the ring; both stay `false` on a link over TCP
/// or one whose peers did not set up rings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkRings {
    /// The peer's frames come through this side's ring (this side asked for one).
    pub inbound: bool,
    /// Our frames go into the peer's ring (the peer asked for one).
    pub outbound: bool,
}

/// How a link watches its peer's liveness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// How often a link pings its peer (default 1 s).
    pub interval: Duration,
    /// How long a peer may send nothing before its link is cut as unresponsive
    /// (default 10 s). A stopped (SIGSTOP) or deadlocked peer process, or one whose
    /// event loop is blocked, answers nothing.
    pub deadline: Duration,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            deadline: Duration::from_secs(10),
        }
    }
}

/// What one link may hold. Bounds the *peer* controls are protocol faults when exceeded
/// (that link is cut with a typed error); bounds *we* control are backpressure (our own
/// `send` waits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkLimits {
    /// Bytes of our calls queued for the socket at once; a
    /// [`RemoteAddr::send`](crate::RemoteAddr::send) past it waits until the writer has
    /// sent enough (backpressure). Default 8 MiB (eight full frames).
    pub send_window: usize,
    /// Our calls awaiting a reply at once; a `send` past it waits. Default 1024.
    pub pending_calls: usize,
    /// Bytes queued for the socket besides our own calls (which the send window bounds):
    /// our replies to the peer's calls, lease-protocol messages, pongs. A peer that lets
    /// more pile up (it does not read: it sends pings or calls and never reads the answers)
    /// is cut ([`ActorError::PeerNotReading`]). Default 32 MiB.
    pub queued_bytes: usize,
    /// The peer's calls this node runs at once; at the limit the link stops reading its
    /// socket until one finishes, so a peer calling faster than its calls are handled
    /// is slowed by its own socket. Default 256. (A handler that calls back the same peer
    /// and waits can deadlock only when all of them do.)
    pub calls_in_flight: usize,
    /// Buffers in one message (a call, a reply or a bare offer): each is an open (a
    /// `mmap` or a driver call) for the receiver; more is a protocol fault
    /// ([`ActorError::TooManyOffers`]). Default 1024.
    pub offers_per_message: usize,
    /// Leases the peer's offers hold open here at once; more is a protocol fault
    /// ([`ActorError::TooManyLeases`]). Default 65 536.
    pub leases_held: usize,
    /// Bytes of copies a host link's peer may have this node receive at once (each is
    /// memory this node allocates: see `docs/CROSS_HOST.md`); a message past it is
    /// refused — its leases given back, a call answered with
    /// [`CallFault::OfferRefused`](baton_messages::protocol::CallFault) — and the link
    /// stays up. Default 4 GiB.
    pub copy_bytes: usize,
    /// Bytes of copies all of this node's host links may have it receive at once, together
    /// (the node-wide bound beside each link's `copy_bytes`: many links of token holders
    /// cannot add up past it); a message past it is refused as one past `copy_bytes` is,
    /// each link kept. Default 8 GiB.
    pub node_copy_bytes: usize,
    /// Over a host link, the peer's messages (calls, replies, bare offers) that may wait
    /// behind one whose copies have not landed yet — the link hands them on in the order
    /// it read them, as a Unix link does. One more is a protocol fault
    /// ([`ActorError::TooManyHeld`]). Default 1024.
    pub held_messages: usize,
    /// The payload bytes those waiting messages may hold; past it, a protocol fault
    /// ([`ActorError::TooManyHeld`]). Default 64 MiB.
    pub held_bytes: usize,
    /// How long a copy's send may go on once the receiver gave its lease back. A receiver
    /// releases once the bytes landed, and the sending engine usually hears that its send
    /// finished a moment later (an NCCL receive can complete before the send's completion
    /// is seen): the send finishes within this, and the lease ends then. One still sending
    /// after it — the receiver gave the lease back early, faulty or hostile — is stopped
    /// (an NCCL send's stop aborts the link's communicator, which ends the link), and the
    /// lease ends once the engine let go. Default 2 s.
    pub early_release_grace: Duration,
}

impl Default for LinkLimits {
    fn default() -> Self {
        Self {
            send_window: 8 << 20,
            pending_calls: 1024,
            queued_bytes: 32 << 20,
            calls_in_flight: 256,
            offers_per_message: 1024,
            leases_held: 65_536,
            copy_bytes: 4 << 30,
            node_copy_bytes: 8 << 30,
            held_messages: 1024,
            held_bytes: 64 << 20,
            early_release_grace: Duration::from_secs(2),
        }
    }
}

/// Frame buffers the writer has copied out, kept for the link to encode its next frames
/// into, so that a frame costs no allocation on either side of the queue (a pipelined
/// sender's frames outnumber what the allocator keeps at hand for a size, and each would
/// otherwise take its slow path). Bounded: buffers of at most [`LARGEST`](Self::LARGEST)
/// bytes, [`KEEP_BYTES`](Self::KEEP_BYTES) of them in all (128 KiB a link: a burst of 256
/// calls and their releases, at 256 bytes each); others are freed.
#[derive(Debug, Default)]
pub(crate) struct FramePool(std::sync::Mutex<Kept>);

/// [`FramePool`]'s buffers, and their capacities' sum.
#[derive(Debug, Default)]
pub(crate) struct Kept {
    buffers: Vec<Vec<u8>>,
    bytes: usize,
}

impl FramePool {
    /// The most bytes of buffers kept.
    const KEEP_BYTES: usize = 128 * 1024;
    /// The largest buffer kept, in bytes (a call or reply with a few offers).
    const LARGEST: usize = 1024;
    /// A new buffer's capacity.
    const FIRST: usize = 256;

    /// An empty buffer to encode a frame into.
    pub(crate) fn take(&self) -> Vec<u8> {
        let mut kept = self.lock();
        match kept.buffers.pop() {
            Some(bytes) => {
                kept.bytes -= bytes.capacity();
                bytes
            }
            None => Vec::with_capacity(Self::FIRST),
        }
    }

    /// Keeps `bytes`, emptied, for a later frame (or frees it, past the bounds).
    pub(crate) fn give(&self, mut bytes: Vec<u8>) {
        let size = bytes.capacity();
        if size > Self::LARGEST {
            return;
        }
        bytes.clear();
        let mut kept = self.lock();
        if kept.bytes + size <= Self::KEEP_BYTES {
            kept.bytes += size;
            kept.buffers.push(bytes);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        // A buffer list and its sum are consistent between any two statements but the
        // two updates of `take` and `give`, which cannot panic: nothing to repair.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Shared between a link actor and the guards that depend on it.
#[derive(Debug)]
pub(crate) struct LinkState {
    pub(crate) alive: AtomicBool,
    pub(crate) peer: ProcessId,
    /// The last measured round trip in nanoseconds (0: none yet).
    pub(crate) rtt_ns: AtomicU64,
    /// The next id of a call of ours (ids are chosen by the sender, so that a caller that
    /// gives up can name its call).
    pub(crate) next_call: AtomicU64,
    /// Bytes our calls may queue for the socket ([`LinkLimits::send_window`]).
    pub(crate) send_window: Arc<Semaphore>,
    /// The size of the send window in bytes.
    pub(crate) window_size: usize,
    /// Calls of ours awaiting replies ([`LinkLimits::pending_calls`]).
    pub(crate) pending_calls: Arc<Semaphore>,
    /// Bytes queued for the socket, of every kind of frame.
    pub(crate) queued: AtomicUsize,
    /// Of those, bytes of our own calls (bounded by the send window, not by
    /// [`LinkLimits::queued_bytes`]).
    pub(crate) queued_calls: AtomicUsize,
    /// Leases held from the peer over this link (for status reports).
    pub(crate) held_leases: AtomicUsize,
    /// File descriptors received from the peer beside its frames.
    pub(crate) fds_received: AtomicU64,
    /// The peer's frames have come through this side's shared-memory ring (see
    /// [`LinkRings`]); set by the reader, never cleared.
    pub(crate) reads_ring: AtomicBool,
    /// Our frames have gone into the peer's ring; set by the writer, never cleared.
    pub(crate) writes_ring: AtomicBool,
    /// Held by a call while it is queued: a call that has to wait (for room on the link or
    /// for fences to spare) holds it meanwhile, so later calls wait behind it and calls
    /// leave in the order they were made.
    pub(crate) turn: Arc<tokio::sync::Mutex<()>>,
    /// `true` once the link actor has stopped and the node has processed the link's end
    /// (leases reclaimed, `PeerEvent::Down` sent): what [`LinkRef::closed`] waits for.
    pub(crate) stopped: tokio::sync::watch::Sender<bool>,
    /// Leases held over this link that copies to another host read from (by lease): a
    /// dropped guard's `Release` waits for them (see [`LeasePin`](crate::forwarding::LeasePin)).
    pub(crate) pinned: std::sync::Mutex<std::collections::HashMap<LeaseId, Pinned>>,
    /// Frame buffers the writer gave back, for the link's next frames.
    pub(crate) frames: FramePool,
}

/// A held lease that copies to another host read from: how many, and its guard's
/// `Release` once it dropped meanwhile.
#[derive(Default)]
pub(crate) struct Pinned {
    copies: usize,
    release: Option<ReleaseLease>,
}

impl fmt::Debug for Pinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pinned")
            .field("copies", &self.copies)
            .field("released", &self.release.is_some())
            .finish()
    }
}

/// A reference to a link: its actor's mailbox, and whether it is still up.
///
/// Cloned on every handoff (each lease guard holds one, so does each call waiting for its
/// reply): the mailbox sits behind an `Arc`, so a clone allocates nothing (a clone of an
/// actix `Recipient` allocates its sender's parking slot and a box).
#[derive(Clone)]
pub(crate) struct LinkRef {
    pub(crate) id: LinkId,
    mailbox: Arc<Recipient<LinkCommand>>,
    pub(crate) state: Arc<LinkState>,
}

impl LinkRef {
    /// The reference to link `id`, whose actor takes [`LinkCommand`]s at `mailbox`.
    pub(crate) fn new(id: LinkId, mailbox: Recipient<LinkCommand>, state: Arc<LinkState>) -> Self {
        Self {
            id,
            mailbox: Arc::new(mailbox),
            state,
        }
    }

    /// Queues `msg` for the link's actor without waiting (dropped if it has stopped).
    pub(crate) fn do_send(&self, msg: impl Into<LinkCommand>) {
        self.mailbox.do_send(msg.into());
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.state.alive.load(Ordering::Acquire)
    }

    pub(crate) fn peer(&self) -> ProcessId {
        self.state.peer
    }

    /// The last round trip the heartbeat or a ping measured.
    pub(crate) fn round_trip(&self) -> Option<Duration> {
        match self.state.rtt_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    pub(crate) fn holder(&self) -> HolderId {
        HolderId(self.id.get())
    }

    pub(crate) fn state(&self) -> &LinkState {
        &self.state
    }

    /// File descriptors received from the peer so far.
    pub(crate) fn descriptors_received(&self) -> u64 {
        self.state.fds_received.load(Ordering::Relaxed)
    }

    /// Which directions of the link have used a shared-memory ring.
    pub(crate) fn rings(&self) -> LinkRings {
        LinkRings {
            inbound: self.state.reads_ring.load(Ordering::Relaxed),
            outbound: self.state.writes_ring.load(Ordering::Relaxed),
        }
    }

    /// Resolves once the link actor has stopped and the node has processed the end of the
    /// link (at once if it already has). Borrows nothing.
    pub(crate) fn closed(&self) -> impl Future<Output = ()> + 'static + use<> {
        let mut stopped = self.state.stopped.subscribe();
        async move {
            // The sender lives in the state this receiver's channel shares: it cannot drop
            // before the value turns `true`, or while we wait.
            let _ = stopped.wait_for(|s| *s).await;
        }
    }
}

impl LinkState {
    fn pins(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<LeaseId, Pinned>> {
        // Every operation leaves the map consistent.
        self.pinned.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One more copy reads from `lease`, held over this link (its guard is alive).
    pub(crate) fn pin(&self, lease: LeaseId) {
        self.pins().entry(lease).or_default().copies += 1;
    }

    /// One copy fewer reads from `lease`: its guard's `Release`, if the guard dropped
    /// meanwhile and no other copy reads from it.
    pub(crate) fn unpin(&self, lease: LeaseId) -> Option<ReleaseLease> {
        let mut pins = self.pins();
        match pins.get_mut(&lease) {
            Some(p) if p.copies > 1 => {
                p.copies -= 1;
                None
            }
            Some(_) => pins.remove(&lease).and_then(|p| p.release),
            None => None,
        }
    }

    /// A dropped guard's `Release`: kept back while its lease is pinned (`None`: it goes
    /// when the last pin drops), else handed back.
    pub(crate) fn defer_release(&self, release: ReleaseLease) -> Option<ReleaseLease> {
        match self.pins().get_mut(&release.lease) {
            Some(pinned) => {
                pinned.release = Some(release);
                None
            }
            None => Some(release),
        }
    }

    /// A fresh id for a call of ours.
    pub(crate) fn next_call_id(&self) -> u64 {
        self.next_call.fetch_add(1, Ordering::Relaxed)
    }

    /// Counts `len` bytes into (`add`) or out of the queue; `call`: a call of ours.
    pub(crate) fn count(&self, len: usize, call: bool, add: bool) {
        let counters: &[&AtomicUsize] = if call {
            &[&self.queued, &self.queued_calls]
        } else {
            &[&self.queued]
        };
        for c in counters {
            if add {
                c.fetch_add(len, Ordering::Relaxed);
            } else {
                c.fetch_sub(len, Ordering::Relaxed);
            }
        }
    }

    /// Bytes queued for the socket now.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Leases held from the peer over this link now.
    pub(crate) fn held_leases(&self) -> usize {
        self.held_leases.load(Ordering::Relaxed)
    }

    /// Whether `id` was handed out already (a reply to it that is not pending answers a
    /// call its caller gave up on).
    pub(crate) fn issued(&self, id: u64) -> bool {
        id < self.next_call.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for LinkRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LinkRef({:?} to {}, alive: {})",
            self.id,
            self.state.peer,
            self.is_alive()
        )
    }
}

/// The guards' name for it.
pub(crate) type LinkHandle = LinkRef;

/// Declares [`LinkCommand`]: one variant per message, each also a message of its own.
/// The messages after `boxed:` are large and rare (forwarding); their variants hold them
/// boxed, so that every command — a lease's release on each handoff among them — moves
/// and allocates the size of the common ones, not of the largest.
macro_rules! link_commands {
    ($($message:ident),* ; boxed: $($boxed:ident),* $(,)?) => {
        /// What the rest of the crate may ask of a link actor, through a [`LinkRef`]: one
        /// variant per message, each handled by the message's own handler
        /// ([`dispatch`](Self::dispatch)).
        pub(crate) enum LinkCommand {
            $(
                #[doc = concat!("A [`", stringify!($message), "`].")]
                $message($message),
            )*
            $(
                #[doc = concat!("A [`", stringify!($boxed), "`], boxed.")]
                $boxed(Box<$boxed>),
            )*
        }

        impl Message for LinkCommand {
            type Result = ();
        }

        $(
            impl From<$message> for LinkCommand {
                fn from(msg: $message) -> Self {
                    Self::$message(msg)
                }
            }
        )*
        $(
            impl From<$boxed> for LinkCommand {
                fn from(msg: $boxed) -> Self {
                    Self::$boxed(Box::new(msg))
                }
            }
        )*

        impl LinkCommand {
            /// Hands the message to `actor`'s handler of its own type.
            pub(crate) fn dispatch<A>(self, actor: &mut A, ctx: &mut A::Context)
            where
                A: Actor $(+ Handler<$message, Result = ()>)* $(+ Handler<$boxed, Result = ()>)*,
            {
                match self {
                    $(Self::$message(msg) => <A as Handler<$message>>::handle(actor, msg, ctx),)*
                    $(Self::$boxed(msg) => <A as Handler<$boxed>>::handle(actor, *msg, ctx),)*
                }
            }
        }
    };
}

link_commands!(
    Close,
    PeerDied,
    ReleaseLease,
    Notice,
    CancelCall,
    SendPing,
    AskStatus,
    AskForward;
    boxed: CutOff,
    PassOn,
    ForwardCopy,
);

/// A frame for the peer (see [`Notice`]).
impl Message for Notice {
    type Result = ();
}

/// Send a copy of a lease this node holds to the peer (on another host): offered as a
/// copy of our own, its bytes read from `view`; answered once the peer gave its lease
/// back (see `link/copy.rs`).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct ForwardCopy {
    /// Our view of the lease's bytes (kept mapped until the engine lets go of it).
    pub(crate) view: Imported,
    /// What keeps the bytes from changing while they are read (the lease's pin).
    pub(crate) keep: Box<dyn std::any::Any + Send + Sync>,
    /// A device copy's send waits for this first (the exporter's acquire fence, passed
    /// on as ours).
    pub(crate) fence: Option<Arc<dyn ExportedFence>>,
    /// The lease id the peer sees once the bytes landed, or why not.
    pub(crate) reply: oneshot::Sender<Result<LeaseId, ActorError>>,
}

/// Cut the link off (a revoke deadline passed, the peer's process died, or the user closed it).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct CutOff(pub(crate) ActorError);

/// How long a closing link ([`Peer::close`](crate::Peer::close)) waits for the answers
/// to the peer's calls that are under way and the frames queued for the peer to be
/// written, before it closes anyway.
pub const CLOSE_FLUSH: Duration = Duration::from_secs(2);

/// Close the link once what is owed to the peer is sent (answers to its calls under way,
/// frames queued), or at `flush` from now, whichever comes first (the user closed it).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Close {
    pub(crate) flush: Duration,
}

/// The peer's process died. Whatever it sent before is still read; if nothing is left to
/// read and its end of the socket is still open (a descendant inherited it), cut now.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct PeerDied;

/// What a dropped lease could not turn into a release fence (every pooled event was in
/// use): its uses to wait for, and its view, closed after them.
pub(crate) struct PendingRelease {
    pub(crate) marks: Vec<Arc<dyn UseMark>>,
    /// Release fences a lease over several buffers could not carry (more than
    /// [`MAX_RELEASE_FENCES`](baton_messages::protocol::MAX_RELEASE_FENCES) that no other
    /// covers): waited for here instead.
    pub(crate) fences: Vec<Arc<dyn ExportedFence>>,
    pub(crate) imported: Vec<Imported>,
}

impl PendingRelease {
    /// A lease's uses to wait for (`marks`), then its view to let go.
    pub(crate) fn new(marks: Vec<Arc<dyn UseMark>>, imported: Option<Imported>) -> Self {
        Self {
            marks,
            fences: Vec::new(),
            imported: imported.into_iter().collect(),
        }
    }

    /// Blocks until the lease's uses have completed, then lets its views go.
    pub(crate) fn wait(self) {
        for mark in &self.marks {
            if let Err(e) = mark.synchronize() {
                tracing::warn!(error = %e, "waiting for a lease's work failed");
            }
        }
        for fence in &self.fences {
            if let Err(e) = fence.synchronize() {
                tracing::warn!(error = %e, "waiting for a lease's release fence failed");
            }
        }
        drop(self.imported);
    }
}

/// A lease guard dropped: give the lease back, with the fence after its last use.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct ReleaseLease {
    pub(crate) lease: LeaseId,
    pub(crate) fences: Vec<FenceHandle>,
    /// Waited for (on the driver thread) before the `Release` goes. Boxed: rare, and the
    /// command goes through the link's mailbox on every handoff.
    pub(crate) pending: Option<Box<PendingRelease>>,
}

/// The caller of a pending call gave up (it dropped the future: a timeout): forget the
/// call at once. A reply that comes later is given back (its leases released).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct CancelCall(pub(crate) u64);

/// Probe the peer; the reply carries the round trip, when its pong comes back.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct SendPing(pub(crate) oneshot::Sender<Duration>);

/// Ask the peer for its status; the reply carries its JSON body.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct AskStatus {
    pub(crate) limit: u32,
    pub(crate) reply: oneshot::Sender<Result<String, ActorError>>,
}

// Forwarding (see `relay`).

/// B: ask the exporter (this link's peer) to lease one of our leases' buffer to `to`.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct AskForward {
    pub(crate) lease: LeaseId,
    pub(crate) to: ProcessId,
    pub(crate) downstream: LinkRef,
    pub(crate) reply: oneshot::Sender<Result<LeaseId, ActorError>>,
}

/// Gives an exporter's forwarded lease back through the upstream link if it was never
/// passed on (dropped unused).
pub(crate) struct GiveBack {
    pub(crate) upstream: LinkRef,
    pub(crate) lease: LeaseId,
}

impl Drop for GiveBack {
    fn drop(&mut self) {
        if self.upstream.is_alive() {
            self.upstream
                .do_send(Notice::Release(Release::now(self.lease)));
        }
    }
}

/// B: pass an exporter's offer on to this link's peer.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct PassOn {
    pub(crate) offer: Offer,
    pub(crate) fd: Option<OwnedFd>,
    pub(crate) give_back: GiveBack,
    pub(crate) reply: oneshot::Sender<Result<LeaseId, ActorError>>,
}

#[cfg(test)]
mod tests {
    /// A lease's release goes through the link's mailbox on every handoff, boxed by actix
    /// with the command's whole size: the large, rare commands are boxed themselves (at
    /// 448 bytes, every release's envelope was too big for the allocator's fast bins).
    #[test]
    fn a_link_command_stays_small() {
        let size = size_of::<super::LinkCommand>();
        assert!(size <= 96, "LinkCommand is {size} bytes");
    }

    /// The pool hands back what the writer gave it, emptied, and keeps at most `KEEP`
    /// buffers of at most `LARGEST` bytes: a burst of frames or one large frame leaves no
    /// more memory with the link than that.
    #[test]
    fn the_frame_pool_reuses_buffers_and_keeps_a_bounded_few() {
        let pool = super::FramePool::default();
        let first = pool.take();
        assert!(first.is_empty() && first.capacity() >= super::FramePool::FIRST);
        let mut written = first;
        written.extend_from_slice(b"a frame");
        let at = written.as_ptr();
        pool.give(written);
        let again = pool.take();
        assert_eq!(
            again.as_ptr(),
            at,
            "the buffer given back is the one taken next"
        );
        assert!(again.is_empty(), "and it comes back empty");

        // A large frame's buffer is freed, not kept.
        pool.give(Vec::with_capacity(super::FramePool::LARGEST + 1));
        assert_eq!(pool.0.lock().unwrap().buffers.len(), 0);

        // A burst: every buffer given back past `KEEP_BYTES` is freed, of any size.
        let fit = super::FramePool::KEEP_BYTES / super::FramePool::FIRST;
        for _ in 0..fit + 50 {
            pool.give(Vec::with_capacity(super::FramePool::FIRST));
        }
        pool.give(Vec::with_capacity(super::FramePool::LARGEST));
        let kept = pool.0.lock().unwrap();
        assert_eq!(kept.buffers.len(), fit);
        let sum: usize = kept.buffers.iter().map(Vec::capacity).sum();
        assert_eq!(sum, kept.bytes);
        assert!(sum <= super::FramePool::KEEP_BYTES);
        drop(kept);
        // Taking gives the room back.
        drop(pool.take());
        pool.give(Vec::with_capacity(super::FramePool::FIRST));
        assert_eq!(pool.0.lock().unwrap().buffers.len(), fit);
    }
}
