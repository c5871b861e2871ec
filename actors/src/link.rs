//! [`PeerLink`]: one actor per connection.
//!
//! It owns the socket: a reader stream feeds it frames, a writer task drains its outgoing
//! queue (frames with their descriptors), and a [`LinkCloser`] shuts the socket down when
//! the link is cut, whatever the writer is doing. It routes the lease protocol both ways:
//!
//! - as exporter, it grants leases for the buffers in outgoing messages through the node's
//!   [`Exports`](crate::exports::Exports); a `Release`, `Unmapped` or `Evict` is checked
//!   against what was granted over *this* link (a release of anything else — unknown,
//!   replayed, another peer's — drops the link);
//! - as importer, it checks every incoming handle (digest, consistency, that the peer
//!   offers only its own buffers), opens it through the import cache — on the node's
//!   driver thread when the backend's calls block (CUDA), the link waiting with
//!   `ctx.wait` so that its frames keep their order — keeps the mapping warm for the next
//!   offer of the same allocation (a *hold*, until the exporter sends `Unmap`), and hands
//!   out lease guards that send `Release` (with the release fence after their last use)
//!   when dropped;
//! - it hands the release fences of the peer's `Release`s to the exporter's ledger, and
//!   sends a pool's descriptor once per pool (see [`Exports`](crate::exports::Exports)).
//!
//! It pings the peer on the node's heartbeat interval; a peer that sends nothing within
//! the deadline is *unresponsive* and its link is cut.
//!
//! When the link ends (end of stream, a protocol fault, a revoke deadline, silence, the
//! peer's process dying, a close), the socket is shut down, the leases it granted stop
//! counting (the ledger decides when their memory may go: see
//! [`ledger`](crate::ledger)), the mappings it kept warm are let go, every lease it holds
//! is orphaned, every pending call fails, and the node's watchers are told why.

use crate::buffer::{HeldLease, IncomingLease, Outgoing};
use crate::error::ActorError;
use crate::exports::OfferGrant;
use crate::ids::LinkId;
use crate::link_ref::{
    AskStatus, CancelCall, Close, CutOff, LinkCommand, LinkLimits, LinkRef, LinkState, PeerDied,
    ReleaseLease, RequestEvict, SendPing, SendRevoke, SendUnmap,
};
use crate::node::Node;
use crate::order::LeaseOrder;
use crate::remote::{Encoded, IncomingPayload, OutCall};
use actix::prelude::*;
use baton_ipc::{
    AsyncLink, CacheKey, FrameFds, ImportCache, Imported, LinkCloser, LinkReader, LinkWriter,
    PeerInfo, Received,
};
use baton_messages::codec::{MAX_FDS_PER_FRAME, encode_frame};
use baton_messages::protocol::{
    Call, CallFault, Evict, MAX_RELEASE_FENCES, Offer, Payload, Release, Reply, Revoke, Status,
    StatusRequest, StatusScope, Unmap, Unmapped,
};
use baton_messages::status::STATUS_VERSION;
use baton_messages::{AllocationId, FenceHandle, InboxGrant, LeaseId, Message as Wire};
use futures_util::stream::Stream;
use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

mod forward;

struct OutFrame {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// For a call of ours: its share of the send window, given back once it is written.
    window: Option<OwnedSemaphorePermit>,
}

/// An offer opened, or why it could not be (a local failure: refused, not a fault).
type Opened<T = IncomingLease> = Result<T, baton_ipc::Error>;

/// Leases granted for one frame: its offers, the descriptors that go with them, and what
/// undoing each grant takes.
struct Granted {
    offers: Vec<Offer>,
    fds: Vec<OwnedFd>,
    grants: Vec<OfferGrant>,
}

/// What opening a frame's offers gave: each offer with its view, in order, up to the first
/// failure.
type OpenedViews = (Vec<Offer>, Vec<Result<Imported, baton_ipc::Error>>);

/// Opens `offers` through `cache`, in order, stopping at the first failure: the job the
/// driver thread runs (or the link inline, on a host-only node).
fn open_views(cache: ImportCache, offers: Vec<Offer>, mut fds: FrameFds) -> OpenedViews {
    let mut views = Vec::with_capacity(offers.len());
    for offer in &offers {
        let view = cache.open_unordered(&offer.handle, &mut fds);
        if let (Ok(view), Some(fence)) = (&view, &offer.handle.fence) {
            // Opened here, so that the lease's first wait (on whatever thread uses it)
            // finds the exporter's event open.
            if let Err(e) = view
                .backend()
                .ordering()
                .prepare_fence(&offer.handle.exporter.process, fence)
            {
                tracing::debug!(error = %e, "could not open an offer's fence ahead of its first use");
            }
        }
        let failed = view.is_err();
        views.push(view);
        if failed {
            break;
        }
    }
    // The frame's descriptors no offer took close here.
    drop(fds);
    (offers, views)
}

/// The offers' views if every one is a cache hit whose fence is open already — no driver
/// call that blocks, so fine on an actor's thread — up to the first that fails (as
/// [`open_views`]); `None` (nothing kept open) if any needs the driver thread.
fn open_hits(
    cache: &ImportCache,
    offers: &[Offer],
) -> Option<Vec<Result<Imported, baton_ipc::Error>>> {
    let mut views = Vec::with_capacity(offers.len());
    for offer in offers {
        let view = cache.open_if_mapped(&offer.handle)?;
        if let (Ok(view), Some(fence)) = (&view, &offer.handle.fence) {
            if !view
                .backend()
                .ordering()
                .fence_prepared(&offer.handle.exporter.process, fence)
            {
                return None;
            }
        }
        let failed = view.is_err();
        views.push(view);
        if failed {
            break;
        }
    }
    Some(views)
}

/// One actor per connection (see the [crate docs](crate)).
pub struct PeerLink {
    pub(crate) node: Node,
    pub(crate) me: LinkRef,
    pub(crate) peer: PeerInfo,
    out: Option<mpsc::UnboundedSender<OutFrame>>,
    closer: LinkCloser,
    /// The peer's allocations this link keeps mapped (a hold in the import cache).
    mapped: HashMap<AllocationId, CacheKey>,
    /// Leases held from the peer.
    held: HashMap<LeaseId, Weak<HeldLease>>,
    /// The bytes each held lease maps (for status reports of orphaned leases).
    held_bytes: HashMap<LeaseId, u64>,
    /// Status requests of ours awaiting the peer's answer.
    status_waiters: HashMap<u64, oneshot::Sender<Result<String, ActorError>>>,
    /// The next id of a status request of ours.
    next_status: u64,
    /// Status answers being prepared for the peer (at most [`STATUS_ANSWERS`]).
    status_answers: usize,
    pending: HashMap<u64, oneshot::Sender<Result<IncomingPayload, ActorError>>>,
    pub(crate) limits: LinkLimits,
    /// The peer's calls running now: each holds one while it runs.
    calls: Arc<Semaphore>,
    /// Pings in flight: when each was sent, and who waits for its round trip.
    pings: HashMap<u64, (Instant, Option<oneshot::Sender<Duration>>)>,
    next_ping: u64,
    /// When the peer last sent anything.
    last_heard: Instant,
    down: Option<Arc<ActorError>>,
    /// The peer lent us a fence inbox lane over this link already (at most once).
    inbox_received: bool,
    /// The peer's calls whose answers are under way (handed to their handler, not yet
    /// queued): a closing link waits for them.
    answering: usize,
    /// Closing ([`Close`]): cut once nothing is owed to the peer, or at this deadline.
    closing: Option<Instant>,
    /// The writer found the socket gone and left the verdict to the reader
    /// ([`LinkFailed`]): a send that fails meanwhile is that same end, no reason of its own.
    verdict_pending: bool,
    pub(crate) span: tracing::Span,
}

impl fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerLink")
            .field("link", &self.me.id)
            .field("peer", &self.peer.process)
            .field("mapped", &self.mapped.len())
            .field("held", &self.held.len())
            .field("pending", &self.pending.len())
            .finish()
    }
}

/// A frame, with the call slot taken before it was read (kept by a `Call` while it runs).
type Incoming = (Result<Received, baton_ipc::Error>, OwnedSemaphorePermit);

/// The link's frames. A slot of `calls` is taken before each read, so when every slot is
/// held by a running call, reading pauses (see [`LinkLimits::calls_in_flight`]).
fn frames(reader: LinkReader, calls: Arc<Semaphore>) -> impl Stream<Item = Incoming> {
    futures_util::stream::unfold(Some(reader), move |state| {
        let calls = Arc::clone(&calls);
        async move {
            let mut reader = state?;
            let slot = calls.acquire_owned().await.ok()?;
            match reader.recv().await {
                Ok(r) => Some(((Ok(r), slot), Some(reader))),
                Err(e) => Some(((Err(e), slot), None)),
            }
        }
    })
}

/// Status answers a link prepares for its peer at once; one more request is a protocol
/// fault ([`ActorError::TooManyStatusRequests`]).
pub(crate) const STATUS_ANSWERS: usize = 4;

/// The most bytes of frames one `sendmsg` carries when frames are queued back to back.
const MAX_BATCH: usize = 64 * 1024;

/// Drains the outgoing queue onto the socket. Frames queued behind the one being sent go
/// out in the same `sendmsg` (one system call, one wakeup of the peer, instead of one per
/// frame) — up to [`MAX_BATCH`] bytes, and never past a frame that carries descriptors:
/// descriptors travel with their frame's first byte, so such a frame starts a new batch.
async fn write_loop(
    mut writer: LinkWriter,
    mut rx: mpsc::UnboundedReceiver<OutFrame>,
    state: Arc<LinkState>,
    addr: Addr<PeerLink>,
) {
    let mut batch: Vec<u8> = Vec::with_capacity(4096);
    let mut windows: Vec<OwnedSemaphorePermit> = Vec::new();
    let mut next: Option<OutFrame> = None;
    loop {
        let first = match next.take() {
            Some(frame) => frame,
            None => match rx.recv().await {
                Some(frame) => frame,
                None => break,
            },
        };
        batch.clear();
        batch.extend_from_slice(&first.bytes);
        // Bytes of our calls in the batch.
        let mut calls = if first.window.is_some() {
            first.bytes.len()
        } else {
            0
        };
        windows.extend(first.window);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(frame) if frame.fds.is_empty() => {
                    batch.extend_from_slice(&frame.bytes);
                    if frame.window.is_some() {
                        calls += frame.bytes.len();
                    }
                    windows.extend(frame.window);
                }
                Ok(frame) => {
                    next = Some(frame);
                    break;
                }
                Err(_) => break,
            }
        }
        let fds: Vec<BorrowedFd<'_>> = first.fds.iter().map(|fd| fd.as_fd()).collect();
        let sent = writer.send_encoded(&batch, &fds).await;
        state.queued.fetch_sub(batch.len(), Ordering::Relaxed);
        state.queued_calls.fetch_sub(calls, Ordering::Relaxed);
        // The calls' share of the window comes back: waiting senders may queue again.
        windows.clear();
        if let Err(e) = sent {
            addr.do_send(LinkFailed {
                error: e,
                deferred: 0,
            });
            break;
        }
    }
    // The actor dropped its sender (it stopped) or the socket failed: the peer sees the
    // end of the stream, and our reader's pending receive ends.
    writer.shutdown();
}

impl PeerLink {
    /// Starts the actor for an established link on the current arbiter.
    /// Returns its reference and where typed calls to it go.
    pub(crate) fn start(node: Node, link: AsyncLink) -> (LinkRef, Recipient<OutCall>) {
        let peer = *link.peer();
        let id = LinkId::next();
        let limits = node.limits();
        let state = Arc::new(LinkState {
            alive: AtomicBool::new(true),
            peer: peer.process,
            rtt_ns: AtomicU64::new(0),
            next_call: AtomicU64::new(1),
            send_window: Arc::new(Semaphore::new(limits.send_window)),
            window_size: limits.send_window,
            pending_calls: Arc::new(Semaphore::new(limits.pending_calls)),
            queued: AtomicUsize::new(0),
            queued_calls: AtomicUsize::new(0),
            held_leases: AtomicUsize::new(0),
            fds_received: AtomicU64::new(0),
            turn: Arc::new(tokio::sync::Mutex::new(())),
            stopped: tokio::sync::watch::Sender::new(false),
        });
        let calls = Arc::new(Semaphore::new(limits.calls_in_flight));
        let closer = link.closer();
        let (reader, writer) = link.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        let addr = PeerLink::create(|ctx| {
            let me = LinkRef::new(id, ctx.address().recipient(), Arc::clone(&state));
            // Before any frame is handled or any call granted: leases need the link.
            node.exports().link_up(&me);
            node.watch(peer.process);
            ctx.add_stream(frames(reader, Arc::clone(&calls)));
            actix::spawn(write_loop(writer, rx, Arc::clone(&state), ctx.address()));
            PeerLink {
                span: tracing::info_span!("peer_link", link = %id, peer = %peer.process),
                node,
                me,
                peer,
                out: Some(tx),
                closer,
                mapped: HashMap::new(),
                held: HashMap::new(),
                held_bytes: HashMap::new(),
                status_waiters: HashMap::new(),
                next_status: 1,
                status_answers: 0,
                pending: HashMap::new(),
                limits,
                calls,
                pings: HashMap::new(),
                next_ping: 1,
                last_heard: Instant::now(),
                down: None,
                inbox_received: false,
                answering: 0,
                closing: None,
                verdict_pending: false,
            }
        });
        (
            LinkRef::new(id, addr.clone().recipient(), state),
            addr.recipient(),
        )
    }

    /// Queues a frame of ours that answers the peer or runs the protocol (a reply, a
    /// release, a pong…). Fails with [`ActorError::PeerNotReading`] when the queue is past
    /// its bound: the peer makes us write and does not read.
    pub(crate) fn send(&mut self, msg: &Wire, fds: Vec<OwnedFd>) -> Result<(), ActorError> {
        let bytes = Self::encode(msg, fds.len())?;
        self.room_for(bytes.len())?;
        self.enqueue(bytes, fds, None)
    }

    /// Whether `len` more bytes fit the queue's bound (see [`send`](Self::send)).
    fn room_for(&self, len: usize) -> Result<(), ActorError> {
        let state = &self.me.state;
        let queued = state
            .queued
            .load(Ordering::Relaxed)
            .saturating_sub(state.queued_calls.load(Ordering::Relaxed));
        if queued + len > self.limits.queued_bytes {
            return Err(ActorError::PeerNotReading {
                peer: self.peer.process,
                queued,
            });
        }
        Ok(())
    }

    fn encode(msg: &Wire, fds: usize) -> Result<Vec<u8>, ActorError> {
        let mut bytes = Vec::with_capacity(256);
        encode_frame(msg, fds, &mut bytes).map_err(baton_ipc::Error::from)?;
        Ok(bytes)
    }

    fn enqueue(
        &mut self,
        bytes: Vec<u8>,
        fds: Vec<OwnedFd>,
        window: Option<OwnedSemaphorePermit>,
    ) -> Result<(), ActorError> {
        let closed = || ActorError::LinkClosed {
            peer: self.peer.process,
        };
        let out = self.out.as_ref().ok_or_else(closed)?;
        let len = bytes.len();
        let call = window.is_some();
        // Counted before the writer can see it (it subtracts once it is written).
        let state = &self.me.state;
        state.count(len, call, true);
        out.send(OutFrame { bytes, fds, window }).map_err(|_| {
            state.count(len, call, false);
            closed()
        })
    }

    /// Drops the link for a reason (logged once).
    pub(crate) fn cut(&mut self, ctx: &mut Context<Self>, why: ActorError) {
        let span = self.span.clone();
        let _g = span.enter();
        if self.verdict_pending && matches!(why, ActorError::LinkClosed { .. }) {
            // A ping or a reply queued after the writer failed: the reader's verdict (or
            // the writer's last try) ends the link, within `READER_VERDICT_TRIES` × 100 ms.
            tracing::debug!("a send failed while the reader's verdict is awaited");
            return;
        }
        if why.is_peer_fault() {
            tracing::warn!(error = %why, "peer broke the protocol: dropping the link");
        } else {
            tracing::info!(reason = %why, "dropping the link");
        }
        self.down.get_or_insert_with(|| Arc::new(why));
        ctx.stop();
    }

    /// Grants the peer a lease on each buffer; all or none.
    fn grant_all(&mut self, cells: &[Outgoing]) -> Result<Granted, ActorError> {
        let mut offers = Vec::with_capacity(cells.len());
        let mut grants = Vec::with_capacity(cells.len());
        let mut fds = Vec::new();
        let mut failure = None;
        for out in cells {
            let cell = &out.cell;
            if fds.len() >= MAX_FDS_PER_FRAME && cell.alloc.export_fd().is_some() {
                failure = Some(ActorError::TooManyDescriptors {
                    count: fds.len() + 1,
                    max: MAX_FDS_PER_FRAME,
                });
                break;
            }
            let granted = out.acquire_fence(&self.peer.process).and_then(|fence| {
                self.node
                    .exports()
                    .grant(cell, &self.me, fds.len() as u8, fence, out.writable)
            });
            match granted {
                Ok((offer, fd, grant)) => {
                    fds.extend(fd);
                    offers.push(offer);
                    grants.push(grant);
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        match failure {
            None => Ok(Granted {
                offers,
                fds,
                grants,
            }),
            Some(e) => {
                self.ungrant(&offers, &grants);
                Err(e)
            }
        }
    }

    /// Takes back leases granted for a frame that was never sent.
    fn ungrant(&mut self, offers: &[Offer], grants: &[OfferGrant]) {
        // Newest first, so that the grant that started a hold is undone last.
        for (offer, grant) in offers.iter().zip(grants).rev() {
            self.node.exports().ungrant(offer.lease, *grant, self.me.id);
        }
    }

    /// Checks a frame's offers before anything is opened: each is the peer's own, offered
    /// once, and the leases fit the limits. An error is the peer's fault.
    fn check_offers(&self, offers: &[Offer], relayed: bool) -> Result<(), ActorError> {
        if offers.len() > self.limits.offers_per_message {
            return Err(ActorError::TooManyOffers {
                count: offers.len(),
                max: self.limits.offers_per_message,
            });
        }
        for (i, offer) in offers.iter().enumerate() {
            if relayed {
                self.check_relayed(offer)?;
            } else if offer.handle.exporter.process != self.peer.process {
                return Err(ActorError::ForeignOffer {
                    claimed: offer.handle.exporter,
                });
            }
            if let Some(fence) = &offer.handle.fence {
                // Before anything waits on it: it must name our inbox, in its producer's
                // lane, with a sane value (forged fences are the peer's fault).
                self.node
                    .backend()
                    .ordering()
                    .check_fence(&offer.handle.exporter.process, fence)?;
            }
            let held = self
                .held
                .get(&offer.lease)
                .is_some_and(|h| h.strong_count() > 0);
            if held || offers[..i].iter().any(|o| o.lease == offer.lease) {
                return Err(ActorError::DuplicateLease { lease: offer.lease });
            }
        }
        if self.held.len() + offers.len() > self.limits.leases_held {
            return Err(ActorError::TooManyLeases {
                max: self.limits.leases_held,
            });
        }
        Ok(())
    }

    /// Checks and opens a frame's offers, all or none, then runs `then` on this actor with
    /// the lease guards. Opens are driver calls: on a node whose backend makes blocking
    /// calls they run on the node's driver thread while this link waits (`ctx.wait`: no
    /// other frame of this link is handled meanwhile, so frames keep their order; other
    /// links and actors run on). An error of the peer's (a check, or an open that failed
    /// through the peer's fault) cuts the link; `Ok(Err(..))` given to `then` is a local
    /// failure: nothing is kept — the leases opened are released as their guards drop,
    /// the others are released now, and the exporter hears that we do not map what we
    /// could not open, so that its next offer of it carries the descriptor again.
    fn with_opened(
        &mut self,
        offers: Vec<Offer>,
        fds: FrameFds,
        relayed: bool,
        ctx: &mut Context<Self>,
        then: impl FnOnce(
            &mut Self,
            Opened<Vec<IncomingLease>>,
            &mut Context<Self>,
        ) -> Result<(), ActorError>
        + 'static,
    ) -> Result<(), ActorError> {
        self.check_offers(&offers, relayed)?;
        self.me
            .state
            .fds_received
            .fetch_add(fds.len() as u64, Ordering::Relaxed);
        if offers.is_empty() {
            return then(self, Ok(Vec::new()), ctx);
        }
        let cache = self.node.cache().clone();
        let offload = self.node.offload();
        if offload.is_inline() {
            let (offers, views) = open_views(cache, offers, fds);
            let opened = self.finish_open(offers, views, relayed)?;
            return then(self, opened, ctx);
        }
        // Mapped already, fences open: nothing that blocks, so no trip to the driver thread
        // (the cached handoff's common case).
        if let Some(views) = open_hits(&cache, &offers) {
            drop(fds);
            let opened = self.finish_open(offers, views, relayed)?;
            return then(self, opened, ctx);
        }
        let opening = offload.run(move || open_views(cache, offers, fds));
        ctx.wait(opening.into_actor(self).map(move |views, act, ctx| {
            let span = act.span.clone();
            let _g = span.enter();
            let done = views
                .and_then(|(offers, views)| act.finish_open(offers, views, relayed))
                .and_then(|opened| then(act, opened, ctx));
            if let Err(e) = done {
                drop(_g);
                act.cut(ctx, e);
            }
        }));
        Ok(())
    }

    /// Turns opened views into lease guards (see [`with_opened`](Self::with_opened)).
    fn finish_open(
        &mut self,
        offers: Vec<Offer>,
        views: Vec<Result<Imported, baton_ipc::Error>>,
        relayed: bool,
    ) -> Result<Opened<Vec<IncomingLease>>, ActorError> {
        let mut leases = Vec::with_capacity(offers.len());
        for (i, (offer, view)) in offers.iter().zip(views).enumerate() {
            let imported = match view {
                Ok(imported) => imported,
                Err(e) if e.is_local_open_failure() => {
                    tracing::warn!(lease = %offer.lease, alloc = %offer.handle.alloc, error = %e, "could not open an offer: refused");
                    drop(leases);
                    self.give_back(&offers[i..], relayed)?;
                    return Ok(Err(e));
                }
                Err(e) => return Err(e.into()),
            };
            // The first offer of an allocation over this link starts a hold: the mapping
            // stays warm for the next offer until the exporter says `Unmap`. (A hold that
            // was letting go while leases used the mapping is superseded: the cache answers
            // its `Unmapped`.)
            let key = imported.key();
            if relayed {
                // A third process's memory: no warm mapping (its exporter cannot ask us to
                // unmap it); this lease's own hold keeps it until its `Release` may go.
                let holder = self.node.relays().new_holder();
                self.node.cache().hold(&key, holder);
                self.node
                    .relays()
                    .hold(self.me.id, offer.lease, key, holder);
            } else if self.mapped.insert(offer.handle.alloc, key).is_none() {
                self.node.cache().hold(&key, self.me.holder());
            }
            let held = Arc::new(HeldLease::default());
            self.held.insert(offer.lease, Arc::downgrade(&held));
            self.held_bytes.insert(offer.lease, offer.handle.len);
            self.me
                .state
                .held_leases
                .store(self.held.len(), Ordering::Relaxed);
            let order = LeaseOrder::new(
                Arc::clone(imported.backend()),
                offer.handle.exporter.process,
                offer.handle.fence,
            );
            leases.push(IncomingLease {
                imported: Some(imported),
                lease: offer.lease,
                link: self.me.clone(),
                held,
                order,
            });
        }
        Ok(Ok(leases))
    }

    /// Gives back offers we did not open: `Release` for each lease, and `Unmapped` for
    /// each allocation we do not map, since the exporter counts a mapping hold from the
    /// moment it offers.
    fn give_back(&mut self, offers: &[Offer], relayed: bool) -> Result<(), ActorError> {
        let mut unmapped: Vec<AllocationId> = Vec::new();
        for offer in offers {
            self.send(&Wire::Release(Release::now(offer.lease)), Vec::new())?;
            let alloc = offer.handle.alloc;
            // A relayed offer starts no hold at its exporter: nothing to unmap.
            if !relayed && !self.mapped.contains_key(&alloc) && !unmapped.contains(&alloc) {
                unmapped.push(alloc);
            }
        }
        for alloc in unmapped {
            self.send(&Wire::Unmapped(Unmapped { alloc }), Vec::new())?;
        }
        Ok(())
    }

    /// The exporter asks us to close our mapping of `alloc`: answer `Unmapped` once no
    /// lease of ours uses it (at once if none does, or if we hold none).
    fn on_unmap(&mut self, alloc: AllocationId, ctx: &mut Context<Self>) -> Result<(), ActorError> {
        let Some(key) = self.mapped.remove(&alloc) else {
            return self.send(&Wire::Unmapped(Unmapped { alloc }), Vec::new());
        };
        let addr = ctx.address();
        self.node.cache().unhold(
            &key,
            self.me.holder(),
            Box::new(move || addr.do_send(SendUnmapped { alloc })),
        );
        Ok(())
    }

    /// Sends a ping; `reply` gets the round trip when its pong comes back.
    fn ping(&mut self, reply: Option<oneshot::Sender<Duration>>) -> Result<(), ActorError> {
        let n = self.next_ping;
        self.next_ping += 1;
        self.pings.insert(n, (Instant::now(), reply));
        self.send(&Wire::Ping(n), Vec::new())
    }

    fn on_pong(&mut self, n: u64) {
        // A pong we did not ask for is harmless: nothing is recorded for it.
        if let Some((sent, reply)) = self.pings.remove(&n) {
            let rtt = sent.elapsed();
            self.me.state.rtt_ns.store(
                rtt.as_nanos().clamp(1, u64::MAX.into()) as u64,
                Ordering::Relaxed,
            );
            if let Some(reply) = reply {
                let _ = reply.send(rtt);
            }
        }
    }

    /// Every heartbeat interval: cut a silent peer, else ping it.
    fn heartbeat(&mut self, ctx: &mut Context<Self>) {
        let deadline = self.node.heartbeat().deadline;
        if self.calls.available_permits() == 0 {
            // We stopped reading (every call slot is busy): the silence is ours.
            self.last_heard = Instant::now();
        }
        let silent_for = self.last_heard.elapsed();
        if silent_for >= deadline {
            self.cut(
                ctx,
                ActorError::Unresponsive {
                    peer: self.peer.process,
                    silent_for,
                },
            );
            return;
        }
        // Pings never answered are dropped once the deadline has passed for them.
        self.pings.retain(|_, (sent, _)| sent.elapsed() < deadline);
        if let Err(e) = self.ping(None) {
            self.cut(ctx, e);
        }
    }

    fn on_frame(
        &mut self,
        received: Received,
        slot: OwnedSemaphorePermit,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        let Received { message, fds } = received;
        match message {
            Wire::Call(call) => self.on_call(call, fds, slot, ctx),
            Wire::Reply(reply) => self.on_reply(reply, fds, ctx),
            Wire::Release(Release { lease, fences }) => {
                tracing::trace!(%lease, fences = fences.len(), "released");
                if fences.len() > MAX_RELEASE_FENCES {
                    return Err(ActorError::TooManyFences {
                        count: fences.len(),
                        max: MAX_RELEASE_FENCES,
                    });
                }
                if self.release_passed(lease) {
                    // A lease we forwarded: handed on to its exporter (see `relay`).
                    return Ok(());
                }
                for fence in &fences {
                    self.node
                        .backend()
                        .ordering()
                        .check_fence(&self.peer.process, fence)?;
                }
                if !fences.is_empty() && !self.node.offload().is_inline() {
                    // Opened on the driver thread now, so that the buffer's next use (on
                    // whatever thread) finds the importer's events open.
                    let (backend, peer, ahead) = (
                        Arc::clone(self.node.backend()),
                        self.peer.process,
                        fences.clone(),
                    );
                    self.node.offload().submit(move || {
                        for fence in &ahead {
                            if let Err(e) = backend.ordering().prepare_fence(&peer, fence) {
                                tracing::debug!(error = %e, "could not open a release fence ahead of its wait");
                            }
                        }
                    });
                }
                self.node.exports().release(lease, self.me.id, fences)
            }
            Wire::Revoke(Revoke { lease, deadline_ms }) => {
                if let Some(held) = self.held.get(&lease).and_then(Weak::upgrade) {
                    let within = Duration::from_millis(deadline_ms.into());
                    held.request_revoke(within);
                    self.node.notify_revoke(crate::node::RevokeRequested {
                        peer: self.peer.process,
                        lease,
                        within,
                    });
                } else {
                    // A lease we forwarded: its holder is asked (see `relay`). Else a
                    // revoke of a lease we already released crossed our Release: nothing
                    // to do.
                    self.revoke_passed(lease, deadline_ms);
                }
                Ok(())
            }
            Wire::Unmap(Unmap { alloc }) => self.on_unmap(alloc, ctx),
            Wire::Unmapped(Unmapped { alloc }) => {
                // One that matches no hold crossed a failed open: harmless.
                if !self.node.exports().unmapped(self.me.id, alloc) {
                    tracing::debug!(%alloc, "Unmapped for no hold");
                }
                Ok(())
            }
            Wire::Evict(Evict { alloc }) => {
                self.node.exports().evict(self.me.id, alloc);
                Ok(())
            }
            Wire::Offer(offer) => {
                self.with_opened(vec![offer], fds, false, ctx, |act, opened, _| {
                    // A refusal was logged and given back already.
                    if let Ok(leases) = opened {
                        for lease in leases {
                            act.node.deliver_offer(act.peer.process, lease);
                        }
                    }
                    Ok(())
                })
            }
            Wire::Ping(n) => self.send(&Wire::Pong(n), Vec::new()),
            Wire::Pong(n) => {
                self.on_pong(n);
                Ok(())
            }
            Wire::StatusRequest(request) => self.on_status_request(request, ctx),
            Wire::Status(status) => self.on_status(status),
            Wire::Forward(forward) => self.on_forward(forward),
            Wire::Forwarded(forwarded) => self.on_forwarded(forwarded, fds),
            Wire::FenceInbox(grant) => self.on_fence_inbox(grant),
            Wire::Relayed(relayed) => {
                self.with_opened(vec![relayed.offer], fds, true, ctx, |act, opened, _| {
                    // A refusal was logged and given back already.
                    if let Ok(leases) = opened {
                        for lease in leases {
                            act.node.deliver_offer(act.peer.process, lease);
                        }
                    }
                    Ok(())
                })
            }
            other => Err(ActorError::Unexpected { got: other.kind() }),
        }
    }

    /// The peer lends us a lane of its fence inbox: fences we record for it go there. Its
    /// inbox is mapped on the driver thread (a fence recorded before that maps it then).
    fn on_fence_inbox(&mut self, grant: InboxGrant) -> Result<(), ActorError> {
        if std::mem::replace(&mut self.inbox_received, true) {
            return Err(ActorError::Unexpected {
                got: "a second FenceInbox",
            });
        }
        let (backend, peer) = (Arc::clone(self.node.backend()), self.peer.process);
        let accept = move || {
            if let Err(e) = backend.ordering().accept_inbox(&peer, &grant) {
                tracing::warn!(error = %e, %peer, "the peer's fence inbox could not be mapped: fences for it are made complete before they are sent");
            }
        };
        let offload = self.node.offload();
        if offload.is_inline() {
            accept();
        } else {
            offload.submit(accept);
        }
        Ok(())
    }

    fn on_call(
        &mut self,
        call: Call,
        fds: FrameFds,
        slot: OwnedSemaphorePermit,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        let Call {
            id,
            target,
            type_name,
            payload,
            offers,
        } = call;
        self.with_opened(offers, fds, false, ctx, move |act, opened, ctx| {
            act.run_call(id, &target, &type_name, &payload, opened, slot, ctx)
        })
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "the parts of one call, handed on from with_opened's continuation"
    )]
    fn run_call(
        &mut self,
        id: u64,
        target: &str,
        type_name: &str,
        payload: &[u8],
        opened: Opened<Vec<IncomingLease>>,
        slot: OwnedSemaphorePermit,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        let leases = match opened {
            Ok(leases) => leases,
            Err(e) => return self.send_reply(id, Err(CallFault::OfferRefused(e.to_string()))),
        };
        let handler = match self.node.handler(target, type_name) {
            Ok(handler) => handler,
            Err(fault) => return self.send_reply(id, Err(fault)),
        };
        match handler.invoke(self.peer.process, payload, leases) {
            Err(fault) => self.send_reply(id, Err(fault)),
            Ok(answer) => {
                // The call keeps its slot until it is answered: at the limit, reading pauses.
                self.answering += 1;
                ctx.spawn(answer.into_actor(self).map(move |res, act, ctx| {
                    act.answering -= 1;
                    let sent = act.send_reply(id, res);
                    drop(slot);
                    if let Err(e) = sent {
                        act.cut(ctx, e);
                    }
                }));
                Ok(())
            }
        }
    }

    fn send_reply(
        &mut self,
        id: u64,
        result: Result<Encoded, CallFault>,
    ) -> Result<(), ActorError> {
        let (outcome, fds, grants) = match result {
            Ok(encoded) => match self.grant_all(&encoded.cells) {
                Ok(Granted {
                    offers,
                    fds,
                    grants,
                }) => (
                    Ok(Payload {
                        bytes: encoded.bytes,
                        offers,
                    }),
                    fds,
                    grants,
                ),
                Err(e) => (
                    Err(CallFault::ReplyFailed(e.to_string())),
                    Vec::new(),
                    Vec::new(),
                ),
            },
            Err(fault) => (Err(fault), Vec::new(), Vec::new()),
        };
        let offers: Vec<Offer> = match &outcome {
            Ok(p) => p.offers.clone(),
            Err(_) => Vec::new(),
        };
        let bytes = match Self::encode(&Wire::Reply(Reply { id, outcome }), fds.len()) {
            Ok(bytes) => bytes,
            Err(e) => {
                // Too large for a frame: the caller hears why, and the link stays up.
                self.ungrant(&offers, &grants);
                let fault = CallFault::ReplyFailed(format!("the reply could not be sent: {e}"));
                return self.send(
                    &Wire::Reply(Reply {
                        id,
                        outcome: Err(fault),
                    }),
                    Vec::new(),
                );
            }
        };
        let sent = self
            .room_for(bytes.len())
            .and_then(|()| self.enqueue(bytes, fds, None));
        if sent.is_err() {
            self.ungrant(&offers, &grants);
        }
        sent
    }

    fn on_reply(
        &mut self,
        reply: Reply,
        fds: FrameFds,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        let Some(tx) = self.pending.remove(&reply.id) else {
            if !self.me.state.issued(reply.id) {
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
                    self.give_back(&payload.offers, false)
                }
                Err(_) => Ok(()),
            };
        };
        match reply.outcome {
            Ok(Payload { bytes, offers }) => {
                self.with_opened(offers, fds, false, ctx, move |_, opened, _| {
                    let result = match opened {
                        Ok(leases) => Ok(IncomingPayload { bytes, leases }),
                        Err(e) => Err(ActorError::OfferRefused(e)),
                    };
                    // The caller may have given up waiting; its leases are then released on drop.
                    let _ = tx.send(result);
                    Ok(())
                })
            }
            Err(fault) => {
                let _ = tx.send(Err(ActorError::Remote(fault)));
                Ok(())
            }
        }
    }
}

impl Actor for PeerLink {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let span = self.span.clone();
        let _g = span.enter();
        tracing::debug!(uid = self.peer.cred.uid, "link up");
        // Fences the peer records for us are written into our memory: lend it a lane
        // first, before anything of ours can ask it for a fence.
        if let Some(grant) = self
            .node
            .backend()
            .ordering()
            .inbox_grant(&self.peer.process)
        {
            if let Err(e) = self.send(&Wire::FenceInbox(grant), Vec::new()) {
                self.cut(ctx, e);
                return;
            }
        }
        ctx.run_interval(self.node.heartbeat().interval, |act, ctx| {
            act.heartbeat(ctx)
        });
    }

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        let span = self.span.clone();
        let _g = span.enter();
        self.me.state.alive.store(false, Ordering::Release);
        // Senders waiting for room on the link learn it is closed.
        self.me.state.send_window.close();
        self.me.state.pending_calls.close();
        // The peer sees end of stream now, even if our writer is parked on a full socket
        // or the peer never reads what we queued.
        self.closer.close();
        self.out = None;
        let exports = self.node.exports();
        let before = exports.stats(None).leases;
        exports.link_cut(self.me.id);
        let reclaimed = before.saturating_sub(exports.stats(None).leases);
        // The mappings this link kept warm go (now, or with the last orphaned lease).
        self.node.cache().drop_holder(self.me.holder());
        // Forwards through this link: see `relay`.
        self.node
            .relays()
            .link_stopped(self.me.id, self.peer.process, self.node.cache());
        for (_, tx) in self.pending.drain() {
            let _ = tx.send(Err(ActorError::LinkClosed {
                peer: self.peer.process,
            }));
        }
        let orphaned = self.held.values().filter(|h| h.strong_count() > 0).count();
        // What our guards still hold of the peer's is orphaned: the node's status lists it
        // until the guards drop.
        let leases: Vec<(Weak<HeldLease>, u64)> = self
            .held
            .drain()
            .filter(|(_, h)| h.strong_count() > 0)
            .map(|(id, h)| (h, self.held_bytes.get(&id).copied().unwrap_or(0)))
            .collect();
        self.node.record_orphans(self.peer.process, leases);
        tracing::info!(reclaimed, orphaned, reason = ?self.down.as_deref().map(ToString::to_string), "link down");
        self.node.link_down(self.me.id, self.peer, self.down.take());
        self.me.state.stopped.send_replace(true);
    }
}

impl StreamHandler<Incoming> for PeerLink {
    fn handle(&mut self, (item, slot): Incoming, ctx: &mut Self::Context) {
        match item {
            Ok(received) => {
                self.last_heard = Instant::now();
                let span = self.span.clone();
                let _g = span.enter();
                if let Err(e) = self.on_frame(received, slot, ctx) {
                    drop(_g);
                    self.cut(ctx, e);
                }
            }
            Err(baton_ipc::Error::Closed) => ctx.stop(),
            Err(e) => self.cut(ctx, e.into()),
        }
    }

    fn finished(&mut self, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

/// The writer failed: the socket is gone.
#[derive(Message)]
#[rtype(result = "()")]
struct LinkFailed {
    error: baton_ipc::Error,
    /// How many times the verdict was left to the reader already.
    deferred: u8,
}

/// How many times (100 ms apart) a writer's "closed" waits for the reader's verdict.
const READER_VERDICT_TRIES: u8 = 10;

impl Handler<LinkFailed> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: LinkFailed, ctx: &mut Self::Context) {
        match msg.error {
            baton_ipc::Error::Closed
                if msg.deferred < READER_VERDICT_TRIES && self.closer.readable_now() =>
            {
                // What the peer sent last (frames, half a frame, the end of stream) is still
                // to be read: the reader's verdict — a clean end, or `Truncated` — says how
                // the link ended, not a write that found the socket gone first.
                let deferred = msg.deferred + 1;
                self.verdict_pending = true;
                ctx.run_later(Duration::from_millis(100), move |_, ctx| {
                    ctx.address().do_send(LinkFailed {
                        error: baton_ipc::Error::Closed,
                        deferred,
                    });
                });
            }
            baton_ipc::Error::Closed => ctx.stop(),
            e => self.cut(ctx, e.into()),
        }
    }
}

impl Handler<LinkCommand> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: LinkCommand, ctx: &mut Self::Context) {
        msg.dispatch(self, ctx);
    }
}

impl Handler<CutOff> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: CutOff, ctx: &mut Self::Context) {
        self.cut(ctx, msg.0);
    }
}

/// How often a closing link looks whether what it owes the peer is written.
const CLOSE_POLL: Duration = Duration::from_millis(2);

impl PeerLink {
    /// Cuts a closing link once no answer to the peer's calls is under way and its queued
    /// frames are written (on the socket: the peer reads them before the end of stream), or
    /// once the close's deadline passed; looks again shortly otherwise.
    fn finish_close(&mut self, ctx: &mut Context<Self>) {
        let Some(deadline) = self.closing else {
            return;
        };
        let flushed = self.answering == 0 && self.me.state.queued.load(Ordering::Acquire) == 0;
        if flushed || Instant::now() >= deadline {
            if !flushed {
                tracing::info!(
                    answering = self.answering,
                    "closing before every answer was sent: the flush deadline passed"
                );
            }
            self.cut(
                ctx,
                ActorError::LinkClosed {
                    peer: self.peer.process,
                },
            );
        } else {
            ctx.run_later(CLOSE_POLL, |act, ctx| act.finish_close(ctx));
        }
    }
}

impl Handler<Close> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: Close, ctx: &mut Self::Context) {
        if self.closing.is_none() {
            self.closing = Some(Instant::now() + msg.flush);
            self.finish_close(ctx);
        }
    }
}

impl Handler<PeerDied> for PeerLink {
    type Result = ();
    fn handle(&mut self, _: PeerDied, ctx: &mut Self::Context) {
        if self.closer.readable_now() {
            // Frames or end of stream are waiting: the reader gets to them first.
            ctx.run_later(Duration::from_millis(100), |_, ctx| {
                ctx.address().do_send(PeerDied);
            });
        } else {
            self.cut(
                ctx,
                ActorError::PeerExited {
                    peer: self.peer.process,
                },
            );
        }
    }
}

impl Handler<ReleaseLease> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: ReleaseLease, ctx: &mut Self::Context) {
        let ReleaseLease {
            lease,
            fences,
            pending,
        } = msg;
        self.held.remove(&lease);
        self.held_bytes.remove(&lease);
        self.me
            .state
            .held_leases
            .store(self.held.len(), Ordering::Relaxed);
        match pending {
            None => self.release_now(lease, fences, ctx),
            Some(pending) => {
                let waited = self.node.offload().run(move || pending.wait());
                ctx.spawn(waited.into_actor(self).map(move |_, act, ctx| {
                    act.release_now(lease, fences, ctx);
                }));
            }
        }
    }
}

impl PeerLink {
    /// Sends `Release` of a lease whose uses are over — for a relayed lease, once its
    /// mapping is closed (see `relay`).
    fn release_now(&mut self, lease: LeaseId, fences: Vec<FenceHandle>, ctx: &mut Context<Self>) {
        let Err((lease, fences)) = self.release_relayed(lease, fences) else {
            return;
        };
        if let Err(e) = self.send(&Wire::Release(Release { lease, fences }), Vec::new()) {
            self.cut(ctx, e);
        }
    }
}

impl Handler<SendRevoke> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: SendRevoke, ctx: &mut Self::Context) {
        let deadline_ms = u32::try_from(msg.within.as_millis()).unwrap_or(u32::MAX);
        let revoke = Wire::Revoke(Revoke {
            lease: msg.lease,
            deadline_ms,
        });
        if let Err(e) = self.send(&revoke, Vec::new()) {
            self.cut(ctx, e);
        }
    }
}

impl Handler<SendUnmap> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: SendUnmap, ctx: &mut Self::Context) {
        if let Err(e) = self.send(&Wire::Unmap(Unmap { alloc: msg.alloc }), Vec::new()) {
            self.cut(ctx, e);
        }
    }
}

/// Our mapping of one of the peer's allocations is closed (an `Unmap` answered).
#[derive(Message)]
#[rtype(result = "()")]
struct SendUnmapped {
    alloc: AllocationId,
}

impl Handler<SendUnmapped> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: SendUnmapped, ctx: &mut Self::Context) {
        tracing::trace!(parent: &self.span, alloc = %msg.alloc, "unmapped");
        if let Err(e) = self.send(&Wire::Unmapped(Unmapped { alloc: msg.alloc }), Vec::new()) {
            self.cut(ctx, e);
        }
    }
}

impl Handler<RequestEvict> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: RequestEvict, ctx: &mut Self::Context) {
        if !self.mapped.contains_key(&msg.alloc) {
            return;
        }
        if let Err(e) = self.send(&Wire::Evict(Evict { alloc: msg.alloc }), Vec::new()) {
            self.cut(ctx, e);
        }
    }
}

impl Handler<OutCall> for PeerLink {
    type Result = ();

    fn handle(&mut self, msg: OutCall, _ctx: &mut Self::Context) {
        let span = self.span.clone();
        let _g = span.enter();
        let Granted {
            offers,
            fds,
            grants,
        } = match self.grant_all(&msg.encoded.cells) {
            Ok(granted) => granted,
            Err(e) => {
                let _ = msg.reply.send(Err(e));
                return;
            }
        };
        let id = msg.id;
        let call = Wire::Call(Call {
            id,
            target: msg.target.to_string(),
            type_name: msg.type_name.to_string(),
            payload: msg.encoded.bytes,
            offers,
        });
        let queued = Self::encode(&call, fds.len())
            .and_then(|bytes| self.enqueue(bytes, fds, Some(msg.window)));
        match queued {
            Ok(()) => {
                tracing::trace!(call = id, leases = grants.len(), "call sent");
                self.pending.insert(id, msg.reply);
            }
            Err(e) => {
                let Wire::Call(call) = call else {
                    unreachable!("built just above")
                };
                self.ungrant(&call.offers, &grants);
                let _ = msg.reply.send(Err(e));
            }
        }
    }
}

impl Handler<CancelCall> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: CancelCall, _ctx: &mut Self::Context) {
        self.pending.remove(&msg.0);
    }
}

impl Handler<SendPing> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: SendPing, ctx: &mut Self::Context) {
        if let Err(e) = self.ping(Some(msg.0)) {
            self.cut(ctx, e);
        }
    }
}

impl PeerLink {
    /// The peer asks what this node holds: answer with its status (and, for the tree
    /// scope, every other linked peer's, asked now, each within a deadline).
    fn on_status_request(
        &mut self,
        request: StatusRequest,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        if self.status_answers >= STATUS_ANSWERS {
            return Err(ActorError::TooManyStatusRequests {
                max: STATUS_ANSWERS,
            });
        }
        self.status_answers += 1;
        let node = self.node.clone();
        let me = self.me.id;
        let answer = async move { crate::status::answer(&node, request, me).await };
        ctx.spawn(answer.into_actor(self).map(move |json, act, ctx| {
            act.status_answers -= 1;
            let status = Wire::Status(Status {
                id: request.id,
                version: STATUS_VERSION,
                json,
            });
            if let Err(e) = act.send(&status, Vec::new()) {
                act.cut(ctx, e);
            }
        }));
        Ok(())
    }

    /// The peer's answer to a status request of ours. One to a request we never made is
    /// a protocol fault; one to a request whose asker gave up is dropped.
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
}

impl Handler<AskStatus> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: AskStatus, ctx: &mut Self::Context) {
        let id = self.next_status;
        self.next_status += 1;
        // Answers nobody waits for any more are forgotten as requests are made.
        self.status_waiters.retain(|_, tx| !tx.is_closed());
        let request = Wire::StatusRequest(StatusRequest {
            id,
            scope: StatusScope::Node,
            limit: msg.limit,
        });
        match self.send(&request, Vec::new()) {
            Ok(()) => {
                self.status_waiters.insert(id, msg.reply);
            }
            Err(e) => {
                let _ = msg.reply.send(Err(ActorError::LinkClosed {
                    peer: self.peer.process,
                }));
                self.cut(ctx, e);
            }
        }
    }
}
