//! [`PeerLink`]: one actor per connection, the I/O shell of its
//! [`LinkSession`](crate::link_session::LinkSession).
//!
//! The session holds the link's protocol (what is held, pending, pinged, checked) and
//! decides what each frame means; the actor carries out its actions. It owns the socket: a reader stream feeds it frames, a writer task drains its outgoing
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

use crate::buffer::HeldLease;
use crate::error::ActorError;
use crate::ids::LinkId;
use crate::link_ref::{
    AskStatus, Close, CutOff, LinkCommand, LinkRef, LinkState, PeerDied, ReleaseLease,
    RequestEvict, SendPing, SendRevoke, SendUnmap,
};
use crate::link_session::{Action, Attach, Checks, Ended, LinkSession, SessionLimits};
use crate::node::Node;
use crate::remote::{IncomingPayload, OutCall};
use actix::prelude::*;
use baton_ipc::{AsyncLink, CacheKey, FrameFds, LinkCloser, LinkReader, PeerInfo, Received};
use baton_messages::protocol::{Evict, Release, Revoke, Status, StatusRequest, Unmap, Unmapped};
use baton_messages::status::STATUS_VERSION;
use baton_messages::{AllocationId, FenceHandle, InboxGrant, LeaseId, Message as Wire, ProcessId};
use futures_util::stream::Stream;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

mod forward;
mod open;
mod outgoing;

use outgoing::{OutFrame, write_loop};

/// What this shell attaches to its session's records.
enum Attached {}

impl Attach for Attached {
    type Held = Weak<HeldLease>;
    type Mapping = CacheKey;
    type Caller = oneshot::Sender<Result<IncomingPayload, ActorError>>;
}

/// What the session asks of the node while it checks a frame.
struct NodeChecks<'a> {
    node: &'a Node,
    state: &'a LinkState,
}

impl Checks for NodeChecks<'_> {
    fn check_fence(&self, exporter: &ProcessId, fence: &FenceHandle) -> Result<(), ActorError> {
        Ok(self.node.backend().check_fence(exporter, fence)?)
    }

    fn call_issued(&self, id: u64) -> bool {
        self.state.issued(id)
    }
}

/// One actor per connection (see the [crate docs](crate)).
pub struct PeerLink {
    pub(crate) node: Node,
    pub(crate) me: LinkRef,
    pub(crate) peer: PeerInfo,
    out: Option<mpsc::UnboundedSender<OutFrame>>,
    closer: LinkCloser,
    /// The link's protocol state.
    session: LinkSession<Attached>,
    pub(crate) limits: crate::link_ref::LinkLimits,
    /// The peer's calls running now: each holds one while it runs.
    calls: Arc<Semaphore>,
    down: Option<Arc<ActorError>>,
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
            .field("session", &self.session)
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
        let me_process = node.session().process();
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
                session: LinkSession::new(
                    peer.process,
                    me_process,
                    SessionLimits {
                        offers_per_message: limits.offers_per_message,
                        leases_held: limits.leases_held,
                    },
                    Instant::now(),
                ),
                limits,
                calls,
                down: None,
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

    /// A frame from the peer: the session says what it means, and the actions are
    /// carried out (the frame's descriptors go to the one that takes them).
    fn on_frame(
        &mut self,
        received: Received,
        slot: OwnedSemaphorePermit,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        let Received { message, fds } = received;
        let checks = NodeChecks {
            node: &self.node,
            state: &self.me.state,
        };
        let actions = self.session.handle(message, Instant::now(), &checks)?;
        let (mut fds, mut slot) = (Some(fds), Some(slot));
        for action in actions {
            self.act(action, &mut fds, &mut slot, ctx)?;
        }
        Ok(())
    }

    /// Carries out one of the session's actions.
    fn act(
        &mut self,
        action: Action<Attached>,
        fds: &mut Option<FrameFds>,
        slot: &mut Option<OwnedSemaphorePermit>,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        match action {
            Action::Send(frame) => self.send(&frame, Vec::new()),
            Action::Open(open) => {
                let fds = fds.take().unwrap_or_default();
                self.open(open, fds, slot.take(), ctx)
            }
            Action::Released { lease, fences } => self.on_release(lease, fences),
            Action::Revoke {
                lease,
                deadline_ms,
                held,
            } => {
                if let Some(held) = held.as_ref().and_then(Weak::upgrade) {
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
            Action::Unhold { alloc, mapping } => {
                // Answered once no lease of ours uses the mapping (at once if none does).
                let addr = ctx.address();
                self.node.cache().unhold(
                    &mapping,
                    self.me.holder(),
                    Box::new(move || addr.do_send(SendUnmapped { alloc })),
                );
                Ok(())
            }
            Action::Unmapped(alloc) => {
                // One that matches no hold crossed a failed open: harmless.
                if !self.node.exports().unmapped(self.me.id, alloc) {
                    tracing::debug!(%alloc, "Unmapped for no hold");
                }
                Ok(())
            }
            Action::Evict(alloc) => {
                self.node.exports().evict(self.me.id, alloc);
                Ok(())
            }
            Action::AnswerStatus(request) => {
                self.answer_status(request, ctx);
                Ok(())
            }
            Action::AcceptInbox(grant) => {
                self.accept_inbox(grant);
                Ok(())
            }
            Action::Forward(forward) => self.on_forward(forward),
            Action::Forwarded(forwarded) => {
                self.on_forwarded(forwarded, fds.take().unwrap_or_default())
            }
            Action::CallFailed { caller, fault } => {
                let _ = caller.send(Err(ActorError::Remote(fault)));
                Ok(())
            }
            Action::Pong { rtt, reply } => {
                self.me.state.rtt_ns.store(
                    rtt.as_nanos().clamp(1, u64::MAX.into()) as u64,
                    Ordering::Relaxed,
                );
                if let Some(reply) = reply {
                    let _ = reply.send(rtt);
                }
                Ok(())
            }
        }
    }

    /// The peer released a lease we granted: one we passed on goes to its exporter, else
    /// the ledger checks it and takes its release fences (each checked first).
    fn on_release(&mut self, lease: LeaseId, fences: Vec<FenceHandle>) -> Result<(), ActorError> {
        tracing::trace!(%lease, fences = fences.len(), "released");
        if self.release_passed(lease) {
            // A lease we forwarded: handed on to its exporter (see `relay`).
            return Ok(());
        }
        for fence in &fences {
            self.node.backend().check_fence(&self.peer.process, fence)?;
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
                    if let Err(e) = backend.prepare_fence(&peer, fence) {
                        tracing::debug!(error = %e, "could not open a release fence ahead of its wait");
                    }
                }
            });
        }
        self.node.exports().release(lease, self.me.id, fences)
    }

    /// Every heartbeat interval: cut a silent peer, else ping it.
    fn heartbeat(&mut self, ctx: &mut Context<Self>) {
        let deadline = self.node.heartbeat().deadline;
        // Every call slot busy: we stopped reading, so the silence is ours.
        let paused = self.calls.available_permits() == 0;
        let pinged = self
            .session
            .tick(Instant::now(), deadline, paused)
            .and_then(|ping| self.send(&ping, Vec::new()));
        if let Err(e) = pinged {
            self.cut(ctx, e);
        }
    }

    /// The peer lends us a lane of its fence inbox: fences we record for it go there. Its
    /// inbox is mapped on the driver thread (a fence recorded before that maps it then).
    fn accept_inbox(&mut self, grant: InboxGrant) {
        let (backend, peer) = (Arc::clone(self.node.backend()), self.peer.process);
        let accept = move || {
            if let Err(e) = backend.accept_inbox(&peer, &grant) {
                tracing::warn!(error = %e, %peer, "the peer's fence inbox could not be mapped: fences for it are made complete before they are sent");
            }
        };
        let offload = self.node.offload();
        if offload.is_inline() {
            accept();
        } else {
            offload.submit(accept);
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
        if let Some(grant) = self.node.backend().inbox_grant(&self.peer.process) {
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
        let Ended { callers, orphans } = self.session.end();
        for tx in callers {
            let _ = tx.send(Err(ActorError::LinkClosed {
                peer: self.peer.process,
            }));
        }
        // What our guards still hold of the peer's is orphaned: the node's status lists it
        // until the guards drop.
        let orphaned = orphans.len();
        self.node.record_orphans(self.peer.process, orphans);
        tracing::info!(reclaimed, orphaned, reason = ?self.down.as_deref().map(ToString::to_string), "link down");
        self.node.link_down(self.me.id, self.peer, self.down.take());
        self.me.state.stopped.send_replace(true);
    }
}

impl StreamHandler<Incoming> for PeerLink {
    fn handle(&mut self, (item, slot): Incoming, ctx: &mut Self::Context) {
        match item {
            Ok(received) => {
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
        self.session.released(lease);
        self.me
            .state
            .held_leases
            .store(self.session.held(), Ordering::Relaxed);
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
        if !self.session.maps(msg.alloc) {
            return;
        }
        if let Err(e) = self.send(&Wire::Evict(Evict { alloc: msg.alloc }), Vec::new()) {
            self.cut(ctx, e);
        }
    }
}

impl Handler<SendPing> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: SendPing, ctx: &mut Self::Context) {
        let ping = self.session.ping(Instant::now(), Some(msg.0));
        if let Err(e) = self.send(&ping, Vec::new()) {
            self.cut(ctx, e);
        }
    }
}

impl PeerLink {
    /// The peer asks what this node holds (the session bounds how many at once): answer
    /// with its status (and, for the tree scope, every other linked peer's, asked now,
    /// each within a deadline).
    fn answer_status(&mut self, request: StatusRequest, ctx: &mut Context<Self>) {
        let node = self.node.clone();
        let me = self.me.id;
        let answer = async move { crate::status::answer(&node, request, me).await };
        ctx.spawn(answer.into_actor(self).map(move |json, act, ctx| {
            act.session.status_answered();
            let status = Wire::Status(Status {
                id: request.id,
                version: STATUS_VERSION,
                json,
            });
            if let Err(e) = act.send(&status, Vec::new()) {
                act.cut(ctx, e);
            }
        }));
    }
}

impl Handler<AskStatus> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: AskStatus, ctx: &mut Self::Context) {
        let (id, request) = self.session.status_request(msg.limit);
        match self.send(&request, Vec::new()) {
            Ok(()) => self.session.await_status(id, msg.reply),
            Err(e) => {
                let _ = msg.reply.send(Err(ActorError::LinkClosed {
                    peer: self.peer.process,
                }));
                self.cut(ctx, e);
            }
        }
    }
}
