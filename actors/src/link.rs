//! [`PeerLink`]: one actor per connection.
//!
//! It owns the socket: a reader stream feeds it frames, a writer task drains its outgoing
//! queue (frames with their descriptors). It routes the lease protocol both ways:
//!
//! - as exporter, it grants leases for the buffers in outgoing messages and remembers
//!   which owner's table each belongs to; a `Release` is accepted only for a lease it
//!   granted (anything else — unknown, replayed, another peer's — drops the link);
//! - as importer, it checks every incoming handle (digest, consistency, that the peer
//!   offers only its own buffers), opens it through the import cache, and hands out lease
//!   guards that send `Release` when dropped.
//!
//! When the link ends (end of stream, a protocol fault, a revoke deadline, the peer's
//! process dying), every lease it granted is reclaimed, every lease it holds is orphaned,
//! every pending call fails, and the node's watchers are told why.

use crate::buffer::{HeldLease, IncomingLease, Outgoing};
use crate::error::ActorError;
use crate::ids::LinkId;
use crate::ledger::Ledger;
use crate::node::Node;
use crate::remote::{Encoded, IncomingPayload};
use actix::prelude::*;
use baton_ipc::{AsyncLink, FrameFds, LinkReader, LinkWriter, PeerInfo, Received};
use baton_messages::codec::{MAX_FDS_PER_FRAME, encode_frame};
use baton_messages::protocol::{Call, CallFault, Gone, Offer, Payload, Release, Reply, Revoke};
use baton_messages::{AllocationId, Generation, LeaseId, Message as Wire, ProcessId};
use futures_util::stream::Stream;
use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Shared between a link actor and the guards that depend on it.
#[derive(Debug)]
pub(crate) struct LinkState {
    alive: AtomicBool,
    peer: ProcessId,
}

/// A reference to a link: its actor, and whether it is still up.
#[derive(Clone)]
pub(crate) struct LinkRef {
    pub(crate) id: LinkId,
    pub(crate) addr: Addr<PeerLink>,
    state: Arc<LinkState>,
}

impl LinkRef {
    pub(crate) fn is_alive(&self) -> bool {
        self.state.alive.load(Ordering::Acquire)
    }

    pub(crate) fn peer(&self) -> ProcessId {
        self.state.peer
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

struct OutFrame {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
}

/// One actor per connection (see the [crate docs](crate)).
pub struct PeerLink {
    node: Node,
    me: LinkRef,
    peer: PeerInfo,
    out: Option<mpsc::UnboundedSender<OutFrame>>,
    /// Leases granted over this link, and the table each belongs to.
    offered: HashMap<LeaseId, Arc<Ledger>>,
    /// Leases held from the peer.
    held: HashMap<LeaseId, Weak<HeldLease>>,
    pending: HashMap<u64, oneshot::Sender<Result<IncomingPayload, ActorError>>>,
    next_call: u64,
    down: Option<Arc<ActorError>>,
    span: tracing::Span,
}

impl fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerLink")
            .field("link", &self.me.id)
            .field("peer", &self.peer.process)
            .field("offered", &self.offered.len())
            .field("held", &self.held.len())
            .field("pending", &self.pending.len())
            .finish()
    }
}

fn frames(reader: LinkReader) -> impl Stream<Item = Result<Received, baton_ipc::Error>> {
    futures_util::stream::unfold(Some(reader), |state| async move {
        let mut reader = state?;
        match reader.recv().await {
            Ok(r) => Some((Ok(r), Some(reader))),
            Err(e) => Some((Err(e), None)),
        }
    })
}

/// The most bytes of frames one `sendmsg` carries when frames are queued back to back.
const MAX_BATCH: usize = 64 * 1024;

/// Drains the outgoing queue onto the socket. Frames queued behind the one being sent go
/// out in the same `sendmsg` (one system call, one wakeup of the peer, instead of one per
/// frame) — up to [`MAX_BATCH`] bytes, and never past a frame that carries descriptors:
/// descriptors travel with their frame's first byte, so such a frame starts a new batch.
async fn write_loop(
    mut writer: LinkWriter,
    mut rx: mpsc::UnboundedReceiver<OutFrame>,
    addr: Addr<PeerLink>,
) {
    let mut batch: Vec<u8> = Vec::with_capacity(4096);
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
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(frame) if frame.fds.is_empty() => batch.extend_from_slice(&frame.bytes),
                Ok(frame) => {
                    next = Some(frame);
                    break;
                }
                Err(_) => break,
            }
        }
        let fds: Vec<BorrowedFd<'_>> = first.fds.iter().map(|fd| fd.as_fd()).collect();
        if let Err(e) = writer.send_encoded(&batch, &fds).await {
            addr.do_send(LinkFailed(e));
            break;
        }
    }
    // The actor dropped its sender (it stopped) or the socket failed: the peer sees the
    // end of the stream, and our reader's pending receive ends.
    writer.shutdown();
}

impl PeerLink {
    /// Starts the actor for an established link on the current arbiter.
    pub(crate) fn start(node: Node, link: AsyncLink) -> LinkRef {
        let peer = *link.peer();
        let id = LinkId::next();
        let state = Arc::new(LinkState {
            alive: AtomicBool::new(true),
            peer: peer.process,
        });
        let (reader, writer) = link.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        let addr = PeerLink::create(|ctx| {
            let me = LinkRef {
                id,
                addr: ctx.address(),
                state: Arc::clone(&state),
            };
            ctx.add_stream(frames(reader));
            actix::spawn(write_loop(writer, rx, ctx.address()));
            PeerLink {
                span: tracing::info_span!("peer_link", link = %id, peer = %peer.process),
                node,
                me,
                peer,
                out: Some(tx),
                offered: HashMap::new(),
                held: HashMap::new(),
                pending: HashMap::new(),
                next_call: 1,
                down: None,
            }
        });
        LinkRef { id, addr, state }
    }

    fn send(&mut self, msg: &Wire, fds: Vec<OwnedFd>) -> Result<(), ActorError> {
        let closed = || ActorError::LinkClosed {
            peer: self.peer.process,
        };
        let out = self.out.as_ref().ok_or_else(closed)?;
        let mut bytes = Vec::with_capacity(256);
        encode_frame(msg, fds.len(), &mut bytes).map_err(baton_ipc::Error::from)?;
        out.send(OutFrame { bytes, fds }).map_err(|_| closed())
    }

    /// Drops the link for a reason (logged once).
    fn cut(&mut self, ctx: &mut Context<Self>, why: ActorError) {
        let span = self.span.clone();
        let _g = span.enter();
        if why.is_peer_fault() {
            tracing::warn!(error = %why, "peer broke the protocol: dropping the link");
        } else {
            tracing::info!(reason = %why, "dropping the link");
        }
        self.down.get_or_insert_with(|| Arc::new(why));
        ctx.stop();
    }

    /// Grants the peer a lease on each buffer; all or none.
    fn grant_all(&mut self, cells: &[Outgoing]) -> Result<(Vec<Offer>, Vec<OwnedFd>), ActorError> {
        let mut offers = Vec::with_capacity(cells.len());
        let mut fds = Vec::new();
        let mut failure = None;
        for Outgoing { cell, event } in cells {
            if fds.len() > MAX_FDS_PER_FRAME {
                failure = Some(ActorError::TooManyDescriptors {
                    count: fds.len(),
                    max: MAX_FDS_PER_FRAME,
                });
                break;
            }
            match cell
                .ledger
                .grant(cell.id, &self.me, fds.len() as u8, event.clone())
            {
                Ok((offer, fd)) => {
                    fds.extend(fd);
                    self.offered.insert(offer.lease, Arc::clone(&cell.ledger));
                    offers.push(offer);
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_none() && fds.len() > MAX_FDS_PER_FRAME {
            failure = Some(ActorError::TooManyDescriptors {
                count: fds.len(),
                max: MAX_FDS_PER_FRAME,
            });
        }
        match failure {
            None => Ok((offers, fds)),
            Some(e) => {
                self.ungrant(offers.iter().map(|o| o.lease));
                Err(e)
            }
        }
    }

    /// Takes back leases granted for a frame that was never sent.
    fn ungrant(&mut self, leases: impl IntoIterator<Item = LeaseId>) {
        for lease in leases {
            if let Some(ledger) = self.offered.remove(&lease) {
                let _ = ledger.release(lease, self.me.id);
            }
        }
    }

    /// Checks and opens an offered buffer, and returns the lease guard.
    fn accept_offer(
        &mut self,
        offer: Offer,
        fds: &mut FrameFds,
    ) -> Result<IncomingLease, ActorError> {
        if offer.handle.exporter.process != self.peer.process {
            return Err(ActorError::ForeignOffer {
                claimed: offer.handle.exporter,
            });
        }
        if self
            .held
            .get(&offer.lease)
            .is_some_and(|h| h.strong_count() > 0)
        {
            return Err(ActorError::DuplicateLease { lease: offer.lease });
        }
        let imported = self.node.cache().open(&offer.handle, fds)?;
        let held = Arc::new(HeldLease::default());
        self.held.insert(offer.lease, Arc::downgrade(&held));
        Ok(IncomingLease {
            imported: Some(imported),
            lease: offer.lease,
            link: self.me.clone(),
            held,
        })
    }

    fn accept_offers(
        &mut self,
        offers: Vec<Offer>,
        fds: &mut FrameFds,
    ) -> Result<Vec<IncomingLease>, ActorError> {
        offers
            .into_iter()
            .map(|o| self.accept_offer(o, fds))
            .collect()
    }

    fn on_frame(&mut self, received: Received, ctx: &mut Context<Self>) -> Result<(), ActorError> {
        let Received { message, mut fds } = received;
        match message {
            Wire::Call(call) => self.on_call(call, &mut fds, ctx),
            Wire::Reply(reply) => self.on_reply(reply, &mut fds),
            Wire::Release(Release { lease }) => {
                let ledger = self
                    .offered
                    .remove(&lease)
                    .ok_or(ActorError::UnknownLease { lease })?;
                tracing::trace!(%lease, "released");
                ledger.release(lease, self.me.id)
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
                }
                // A revoke of a lease we already released crossed our Release: nothing to do.
                Ok(())
            }
            Wire::Gone(Gone { alloc, generation }) => {
                self.node
                    .cache()
                    .retire(self.peer.process, alloc, generation);
                Ok(())
            }
            Wire::Offer(offer) => {
                let lease = self.accept_offer(offer, &mut fds)?;
                self.node.deliver_offer(self.peer.process, lease);
                Ok(())
            }
            Wire::Ping(n) => self.send(&Wire::Pong(n), Vec::new()),
            Wire::Pong(_) => Ok(()),
            other => Err(ActorError::Unexpected { got: other.kind() }),
        }
    }

    fn on_call(
        &mut self,
        call: Call,
        fds: &mut FrameFds,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        let leases = self.accept_offers(call.offers, fds)?;
        let id = call.id;
        let Some(handler) = self.node.handler(&call.target) else {
            return self.send_reply(id, Err(CallFault::NoSuchActor));
        };
        if handler.type_name() != call.type_name {
            return self.send_reply(
                id,
                Err(CallFault::WrongType {
                    expected: handler.type_name().to_owned(),
                }),
            );
        }
        match handler.invoke(&call.payload, leases) {
            Err(fault) => self.send_reply(id, Err(fault)),
            Ok(answer) => {
                ctx.spawn(answer.into_actor(self).map(move |res, act, ctx| {
                    if let Err(e) = act.send_reply(id, res) {
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
        let (outcome, fds) = match result {
            Ok(encoded) => match self.grant_all(&encoded.cells) {
                Ok((offers, fds)) => (
                    Ok(Payload {
                        bytes: encoded.bytes,
                        offers,
                    }),
                    fds,
                ),
                Err(e) => (Err(CallFault::ReplyFailed(e.to_string())), Vec::new()),
            },
            Err(fault) => (Err(fault), Vec::new()),
        };
        let leases: Vec<LeaseId> = match &outcome {
            Ok(p) => p.offers.iter().map(|o| o.lease).collect(),
            Err(_) => Vec::new(),
        };
        let sent = self.send(&Wire::Reply(Reply { id, outcome }), fds);
        if sent.is_err() {
            self.ungrant(leases);
        }
        sent
    }

    fn on_reply(&mut self, reply: Reply, fds: &mut FrameFds) -> Result<(), ActorError> {
        let tx = self
            .pending
            .remove(&reply.id)
            .ok_or(ActorError::UnknownCall { id: reply.id })?;
        let result = match reply.outcome {
            Ok(payload) => Ok(IncomingPayload {
                bytes: payload.bytes,
                leases: self.accept_offers(payload.offers, fds)?,
            }),
            Err(fault) => Err(ActorError::Remote(fault)),
        };
        // The caller may have given up waiting; its leases are then released on drop.
        let _ = tx.send(result);
        Ok(())
    }
}

impl Actor for PeerLink {
    type Context = Context<Self>;

    fn started(&mut self, _ctx: &mut Self::Context) {
        let span = self.span.clone();
        let _g = span.enter();
        tracing::debug!(uid = self.peer.cred.uid, "link up");
    }

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        let span = self.span.clone();
        let _g = span.enter();
        self.me.state.alive.store(false, Ordering::Release);
        self.out = None;
        // Reclaim every lease granted over this link, once per owner table.
        let mut ledgers: Vec<Arc<Ledger>> = Vec::new();
        for ledger in self.offered.values() {
            if !ledgers.iter().any(|l| Arc::ptr_eq(l, ledger)) {
                ledgers.push(Arc::clone(ledger));
            }
        }
        let reclaimed: usize = ledgers.iter().map(|l| l.link_gone(self.me.id)).sum();
        for (_, tx) in self.pending.drain() {
            let _ = tx.send(Err(ActorError::LinkClosed {
                peer: self.peer.process,
            }));
        }
        let orphaned = self.held.values().filter(|h| h.strong_count() > 0).count();
        tracing::info!(reclaimed, orphaned, reason = ?self.down.as_deref().map(ToString::to_string), "link down");
        self.node.link_down(self.me.id, self.peer, self.down.take());
    }
}

impl StreamHandler<Result<Received, baton_ipc::Error>> for PeerLink {
    fn handle(&mut self, item: Result<Received, baton_ipc::Error>, ctx: &mut Self::Context) {
        match item {
            Ok(received) => {
                let span = self.span.clone();
                let _g = span.enter();
                if let Err(e) = self.on_frame(received, ctx) {
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
struct LinkFailed(baton_ipc::Error);

impl Handler<LinkFailed> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: LinkFailed, ctx: &mut Self::Context) {
        match msg.0 {
            baton_ipc::Error::Closed => ctx.stop(),
            e => self.cut(ctx, e.into()),
        }
    }
}

/// Cut the link off (a revoke deadline passed, the peer's process died, or the user closed it).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct CutOff(pub(crate) ActorError);

impl Handler<CutOff> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: CutOff, ctx: &mut Self::Context) {
        self.cut(ctx, msg.0);
    }
}

/// A lease guard dropped: give the lease back.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct ReleaseLease(pub(crate) LeaseId);

impl Handler<ReleaseLease> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: ReleaseLease, ctx: &mut Self::Context) {
        self.held.remove(&msg.0);
        if let Err(e) = self.send(&Wire::Release(Release { lease: msg.0 }), Vec::new()) {
            self.cut(ctx, e);
        }
    }
}

/// Ask the peer to give a lease back within a deadline.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct SendRevoke {
    pub(crate) lease: LeaseId,
    pub(crate) within: Duration,
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

/// Tell the peer an allocation it held is freed.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct SendGone {
    pub(crate) alloc: AllocationId,
    pub(crate) generation: Generation,
}

impl Handler<SendGone> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: SendGone, _ctx: &mut Self::Context) {
        // Best effort: a peer that misses it just cannot tell a stale handle early.
        let _ = self.send(
            &Wire::Gone(Gone {
                alloc: msg.alloc,
                generation: msg.generation,
            }),
            Vec::new(),
        );
    }
}

/// A typed call from a [`RemoteAddr`](crate::RemoteAddr).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct OutCall {
    pub(crate) target: Arc<str>,
    pub(crate) type_name: &'static str,
    pub(crate) encoded: Encoded,
    pub(crate) reply: oneshot::Sender<Result<IncomingPayload, ActorError>>,
}

impl Handler<OutCall> for PeerLink {
    type Result = ();

    fn handle(&mut self, msg: OutCall, _ctx: &mut Self::Context) {
        let span = self.span.clone();
        let _g = span.enter();
        let (offers, fds) = match self.grant_all(&msg.encoded.cells) {
            Ok(granted) => granted,
            Err(e) => {
                let _ = msg.reply.send(Err(e));
                return;
            }
        };
        let id = self.next_call;
        self.next_call += 1;
        let leases: Vec<LeaseId> = offers.iter().map(|o| o.lease).collect();
        let call = Wire::Call(Call {
            id,
            target: msg.target.to_string(),
            type_name: msg.type_name.to_owned(),
            payload: msg.encoded.bytes,
            offers,
        });
        match self.send(&call, fds) {
            Ok(()) => {
                tracing::trace!(call = id, leases = leases.len(), "call sent");
                self.pending.insert(id, msg.reply);
            }
            Err(e) => {
                self.ungrant(leases);
                let _ = msg.reply.send(Err(e));
            }
        }
    }
}

/// Probe the peer.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct SendPing(pub(crate) u64);

impl Handler<SendPing> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: SendPing, ctx: &mut Self::Context) {
        if let Err(e) = self.send(&Wire::Ping(msg.0), Vec::new()) {
            self.cut(ctx, e);
        }
    }
}
