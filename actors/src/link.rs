//! [`PeerLink`]: one actor per connection — the I/O shell of its protocol, a
//! [`LinkSession`].
//!
//! The session (a state machine without I/O, in the crate's bottom layer) holds what the
//! link knows of the protocol — leases held, mappings kept warm, pending calls, pings,
//! status requests, forwards asked, a host link's copies — says what each frame means
//! (an action to carry out, or the peer's fault), and builds the frames the rest of the
//! node asks the link to send ([`Notice`](crate::link_ref::Notice)). The actor owns everything else: the socket (a reader stream feeds it
//! frames, a writer task drains its outgoing queue — the transport's `Writer::drain` —,
//! and a [`Closer`] shuts the socket down when the link is cut, whatever the writer is
//! doing), the timers, and the calls into the node. It routes the lease protocol both
//! ways:
//!
//! - as exporter (`link/outgoing.rs`, `link/leases.rs`), it grants leases for the buffers
//!   in outgoing messages through the node's [`Exports`](crate::exports::Exports); a
//!   `Release`, `Unmapped` or `Evict` is checked against what was granted over *this*
//!   link (a release of anything else — unknown, replayed, another peer's — drops the
//!   link), and the release fences of the peer's `Release`s go to the exporter's ledger.
//!   The session says how each released lease was lent
//!   ([`ReleaseRoute`](crate::link_session::ReleaseRoute): granted here, passed on, a host
//!   link's copy), so a plain release goes to the ledger without a look at the copy,
//!   forward or relay tables;
//! - as importer (`link/open.rs`), it opens the offers the session checked through the
//!   import cache — on the node's driver thread when the backend's calls block (CUDA),
//!   the link waiting with `ctx.wait` so that its frames keep their order — keeps the
//!   mapping warm for the next offer of the same allocation (a *hold*, until the exporter
//!   sends `Unmap`), and hands out lease guards that send `Release` (with the release
//!   fence after their last use) when dropped;
//! - as relay (`link/forward.rs`), it passes leases on to third processes.
//!
//! It pings the peer on the node's heartbeat interval; a peer that sends nothing within
//! the deadline is *unresponsive* and its link is cut.
//!
//! When the link ends (`link/closing.rs`: end of stream, a protocol fault, a revoke
//! deadline, silence, the peer's process dying, a close), the socket is shut down, the
//! leases it granted stop counting (the ledger decides when their memory may go: see
//! [`ledger`](crate::ledger)), the mappings it kept warm are let go, every lease it holds
//! is orphaned, every pending call fails, and the node's watchers are told why.

use crate::buffer::HeldLease;
use crate::error::ActorError;
use crate::ids::LinkId;
use crate::link_ref::{AskStatus, LinkCommand, LinkLimits, LinkRef, LinkState, SendPing};
use crate::link_session::{Action, Attach, Checks, Ended, LinkSession, SessionLimits, Then};
use crate::node_core::NodeCore;
use crate::remote::{IncomingPayload, OutCall};
use crate::transport::{Closer, FrameQueue, Reader, Transport};
use actix::prelude::*;
use baton_ipc::{CacheKey, FrameFds, HolderId, PeerInfo, Received};
use baton_messages::protocol::{Status, StatusRequest};
use baton_messages::status::STATUS_VERSION;
use baton_messages::{FenceHandle, HandleMsg, Message as Wire, ProcessId};
use futures_util::stream::Stream;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context as TaskContext, Poll};
use std::time::Instant;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio_util::sync::ReusableBoxFuture;

/// Marks a stage of a handoff (`baton_ipc::probe`); expands to nothing without the
/// `stage-probes` feature.
macro_rules! probe {
    ($stage:expr) => {
        #[cfg(feature = "stage-probes")]
        baton_ipc::probe::mark($stage);
    };
}

mod closing;
mod copy;
mod forward;
mod leases;
mod open;
mod outgoing;

/// What this shell attaches to its session's records.
enum Attached {}

impl Attach for Attached {
    type Held = Weak<HeldLease>;
    type Mapping = CacheKey;
    type Relayed = (CacheKey, HolderId);
    type Caller = oneshot::Sender<Result<IncomingPayload, ActorError>>;
    type Handed = copy::Handed;
    type Copy = crate::host_copies::DeviceCopy;
    type Sending = Arc<baton_ipc::transfer::HeldTransfer>;
    type Forward = copy::ForwardWaiter;
    type Asked = forward::Asked;
}

/// What the session asks of the node while it checks a frame.
struct NodeChecks<'a> {
    node: &'a NodeCore,
    state: &'a LinkState,
}

impl Checks for NodeChecks<'_> {
    fn check_fence(&self, exporter: &ProcessId, fence: &FenceHandle) -> Result<(), ActorError> {
        Ok(self
            .node
            .backend()
            .ordering()
            .check_fence(exporter, fence)?)
    }

    fn call_issued(&self, id: u64) -> bool {
        self.state.issued(id)
    }

    fn check_sealed(&self, handle: &HandleMsg) -> Result<(), ActorError> {
        let key = self.node.session().handle_key();
        Ok(handle.check(key).map_err(baton_ipc::Error::from)?)
    }
}

/// One actor per connection (see the [crate docs](crate)).
pub struct PeerLink {
    pub(crate) node: NodeCore,
    pub(crate) me: LinkRef,
    pub(crate) peer: PeerInfo,
    out: Option<FrameQueue>,
    closer: Closer,
    /// The link's protocol state.
    session: LinkSession<Attached>,
    pub(crate) limits: LinkLimits,
    /// The peer's calls running now: each holds one while it runs.
    calls: Arc<Semaphore>,
    down: Option<Arc<ActorError>>,
    /// The peer's calls whose answers are under way (handed to their handler, not yet
    /// queued): a closing link waits for them.
    answering: usize,
    /// Closing ([`Close`](crate::link_ref::Close)): cut once nothing is owed to the peer, or at this deadline.
    closing: Option<Instant>,
    /// The writer found the socket gone and left the verdict to the reader
    /// ([`LinkFailed`](closing::LinkFailed)): a send that fails meanwhile is that same end, no reason of its own.
    verdict_pending: bool,
    /// The fence of the next pulled device copy is being waited for (on a blocking
    /// thread; see `link/copy.rs`).
    pull_waiting: bool,
    /// The offer and grant lists of the last call sent, emptied: the next call's reuse
    /// them (a call's lists are let go once its frame is queued).
    spare: outgoing::Spare,
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

/// What a read needs, moved into each read's future and back out of it.
struct FrameSource {
    reader: Reader,
    calls: Arc<Semaphore>,
    link: Arc<LinkState>,
}

/// A read's result: the frame, and the source for the next read (none once the link ended).
type Read = Option<(Incoming, Option<Box<FrameSource>>)>;

/// The link's frames. A slot of `calls` is taken before each read, so when every slot is
/// held by a running call, reading pauses (see [`LinkLimits::calls_in_flight`]).
/// The first frame read from a ring marks the link's state ([`LinkRings::inbound`](crate::link_ref::LinkRings::inbound)).
///
/// Each read is one future in a box the stream keeps and reuses: no allocation per frame,
/// and a read's state (hundreds of bytes) is not copied through the stream's layers.
struct Frames {
    /// The read under way; none once the link ended.
    read: Option<ReusableBoxFuture<'static, Read>>,
}

impl Frames {
    fn new(reader: Reader, calls: Arc<Semaphore>, link: Arc<LinkState>) -> Frames {
        let source = Box::new(FrameSource {
            reader,
            calls,
            link,
        });
        Frames {
            read: Some(ReusableBoxFuture::new(Frames::read(source))),
        }
    }

    async fn read(mut source: Box<FrameSource>) -> Read {
        let slot = Arc::clone(&source.calls).acquire_owned().await.ok()?;
        match source.reader.recv().await {
            Ok(r) => {
                if source.reader.uses_ring() && !source.link.reads_ring.load(Ordering::Relaxed) {
                    source.link.reads_ring.store(true, Ordering::Relaxed);
                }
                Some(((Ok(r), slot), Some(source)))
            }
            Err(e) => Some(((Err(e), slot), None)),
        }
    }
}

impl Stream for Frames {
    type Item = Incoming;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Incoming>> {
        let Some(read) = self.read.as_mut() else {
            return Poll::Ready(None);
        };
        match std::task::ready!(read.poll(cx)) {
            Some((item, Some(source))) => {
                read.set(Frames::read(source));
                Poll::Ready(Some(item))
            }
            Some((item, None)) => {
                self.read = None;
                Poll::Ready(Some(item))
            }
            None => {
                self.read = None;
                Poll::Ready(None)
            }
        }
    }
}

impl PeerLink {
    /// Starts the actor for an established link on the current arbiter.
    /// Returns its reference and where typed calls to it go.
    pub(crate) fn start(node: NodeCore, link: Transport) -> (LinkRef, Recipient<OutCall>) {
        let peer = link.peer();
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
            reads_ring: AtomicBool::new(false),
            writes_ring: AtomicBool::new(false),
            turn: Arc::new(tokio::sync::Mutex::new(())),
            stopped: tokio::sync::watch::Sender::new(false),
            pinned: Default::default(),
            frames: Default::default(),
        });
        let calls = Arc::new(Semaphore::new(limits.calls_in_flight));
        let ours = node.session().process();
        let (closer, reader, writer) = link.split();
        let (tx, rx) = crate::transport::frame_queue();
        let addr = PeerLink::create(|ctx| {
            let me = LinkRef::new(id, ctx.address().recipient(), Arc::clone(&state));
            // Before any frame is handled or any call granted: leases need the link.
            node.exports().link_up(&me);
            if peer.host().is_none() {
                // A process of this host: its death is seen at once. A peer on another
                // host is watched by its link alone (end of stream, the heartbeat).
                node.watch(peer.process);
            }
            ctx.add_stream(Frames::new(reader, Arc::clone(&calls), Arc::clone(&state)));
            let (state, addr) = (Arc::clone(&state), ctx.address());
            actix::spawn(async move {
                if let Some(error) = writer.drain(rx, state).await {
                    addr.do_send(closing::LinkFailed { error, deferred: 0 });
                }
            });
            PeerLink {
                span: tracing::info_span!("peer_link", link = %id, peer = %peer.process),
                node,
                me,
                peer,
                out: Some(tx),
                closer,
                session: {
                    let session = LinkSession::new(
                        peer.process,
                        ours,
                        SessionLimits {
                            offers_per_message: limits.offers_per_message,
                            leases_held: limits.leases_held,
                            held_messages: limits.held_messages,
                            held_bytes: limits.held_bytes,
                            copy_bytes: limits.copy_bytes,
                        },
                        Instant::now(),
                    );
                    match peer.host() {
                        Some(host) => session.across_hosts(host.claimed),
                        None => session,
                    }
                },
                limits,
                calls,
                down: None,
                answering: 0,
                closing: None,
                verdict_pending: false,
                pull_waiting: false,
                spare: outgoing::Spare::default(),
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
        probe!("link.session");
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
                // Only the peer's call keeps its slot while it runs; the others' frees now.
                let slot = match open.then {
                    Then::Call { .. } => slot.take(),
                    _ => None,
                };
                self.open(open, fds, slot, ctx)
            }
            Action::Released {
                lease,
                fences,
                route,
            } => self.on_release(lease, fences, route),
            Action::Revoke {
                lease,
                deadline_ms,
                held,
            } => {
                self.on_revoke(lease, deadline_ms, held);
                Ok(())
            }
            Action::Unhold { alloc, mapping } => {
                self.unhold(alloc, &mapping, ctx);
                Ok(())
            }
            Action::Unmapped(alloc) => {
                self.on_unmapped(alloc);
                Ok(())
            }
            Action::Evict(alloc) => {
                self.node.exports().evict(self.me.id, alloc);
                Ok(())
            }
            Action::ForgetPool(pool) => {
                // A driver call: on the driver thread, behind the closes of the pool's
                // last mappings that may still be queued there.
                let (cache, peer) = (self.node.cache().clone(), self.peer.process);
                self.node
                    .offload()
                    .submit(move || cache.forget_pool(&peer, pool));
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
            Action::SendPulled => self.send_pulled(ctx),
            Action::Rendezvous(bytes) => self.on_rendezvous(&bytes),
            Action::Forward(forward) => self.on_forward(forward),
            Action::Forwarded { asked, answer } => {
                self.on_forwarded(asked, answer.outcome, fds.take().unwrap_or_default());
                Ok(())
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
            return;
        }
        // Pools of ours idle for a while go back to the device: the backend retires them
        // (driver calls: on the driver thread), and the links that carried their
        // descriptors tell the importers to drop their imports (`PoolRetired`).
        let (backend, exports) = (
            Arc::clone(self.node.backend()),
            Arc::clone(self.node.exports()),
        );
        self.node
            .offload()
            .submit(move || exports.pools_retired(&backend.retire_idle_pools()));
    }
}

impl Actor for PeerLink {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let span = self.span.clone();
        let _g = span.enter();
        tracing::debug!(via = ?self.peer.via, "link up");
        // Fences the peer records for us are written into our memory: lend it a lane
        // first, before anything of ours can ask it for a fence. (No fence crosses hosts:
        // a peer on another host gets copies.)
        let inbox = match self.copies() {
            true => None,
            false => self
                .node
                .backend()
                .ordering()
                .inbox_grant(&self.peer.process),
        };
        if let Some(grant) = inbox {
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
        // No transfer touches our buffers once their leases are taken back: the copies'
        // engines let go first, then the rest of the link's end runs (`LinkEnd`).
        let nccl_abort = crate::host_copies::abort_peer(&self.node, &self.peer);
        let end = LinkEnd {
            node: self.node.clone(),
            me: self.me.clone(),
            peer: self.peer,
            down: self.down.take(),
            ended: Some(self.session.end()),
            span: self.span.clone(),
        };
        match nccl_abort {
            None => end.finish(),
            Some((nccl, peer)) => {
                // `ncclCommAbort` can hang (a peer killed mid-copy): never on the thread
                // every link of the node shares, where it would hold all of them up past
                // their heartbeat deadline (issue 45). The engine's `abort_peer` returns
                // once the peer's communicators are aborted, or after its `abort_wait` —
                // then the transfers of a hung abort keep their memory (never freed) for
                // as long as it has not returned (`HeldTransfer`, the NCCL engine's docs).
                let aborted = tokio::task::spawn_blocking(move || {
                    baton_ipc::TransferEngine::abort_peer(&*nccl, &peer);
                });
                // `end` finishes once the abort returned or was given up on — or when it
                // is dropped, should the runtime stop first.
                actix::spawn(async move {
                    let _ = aborted.await;
                    end.finish();
                });
            }
        }
    }
}

/// The end of a link, after its copies' engines let go of the memory they moved: the
/// ledger takes back the leases the link granted, the mappings it kept warm and the
/// forwards through it go, its callers fail, what its guards hold is orphaned, and the
/// node hears that it is down. Runs from [`PeerLink::stopped`] at once, or off the
/// links' thread after the NCCL aborts of its peer (`finish`, or its drop).
struct LinkEnd {
    node: NodeCore,
    me: LinkRef,
    peer: PeerInfo,
    down: Option<Arc<ActorError>>,
    /// `Some` until finished.
    ended: Option<Ended<Attached>>,
    span: tracing::Span,
}

impl LinkEnd {
    fn finish(mut self) {
        self.run();
    }

    fn run(&mut self) {
        let Some(Ended {
            callers,
            orphans,
            forwards,
            asked,
            relayed,
        }) = self.ended.take()
        else {
            return;
        };
        let span = self.span.clone();
        let _g = span.enter();
        let exports = self.node.exports();
        let before = exports.stats(None).leases;
        exports.link_cut(self.me.id);
        let reclaimed = before.saturating_sub(exports.stats(None).leases);
        // The mappings this link kept warm go (now, or with the last orphaned lease).
        self.node.cache().drop_holder(self.me.holder());
        // Forwards through this link: see `relay`. The relayed leases' own holds go (their
        // mappings close with their last use).
        self.node.relays().link_stopped(self.me.id);
        for (_, holder) in relayed {
            self.node.cache().drop_holder(holder);
        }
        let closed = || ActorError::link_closed(self.peer.process);
        for tx in callers {
            let _ = tx.send(Err(closed()));
        }
        for asked in asked {
            let _ = asked.reply.send(Err(closed()));
        }
        // Forwards sent over this link as copies: their sends stopped with the link.
        for tx in forwards {
            let _ = tx.send(Err(closed()));
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

impl Drop for LinkEnd {
    fn drop(&mut self) {
        self.run();
    }
}

impl StreamHandler<Incoming> for PeerLink {
    fn handle(&mut self, (item, slot): Incoming, ctx: &mut Self::Context) {
        match item {
            Ok(received) => {
                probe!("link.frame");
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

impl Handler<LinkCommand> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: LinkCommand, ctx: &mut Self::Context) {
        msg.dispatch(self, ctx);
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
                let _ = msg
                    .reply
                    .send(Err(ActorError::link_closed(self.peer.process)));
                self.cut(ctx, e);
            }
        }
    }
}
