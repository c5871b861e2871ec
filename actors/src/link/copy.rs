//! Buffers across hosts: over a host link (TCP) a buffer arrives as a copy in memory the
//! receiver's node owns — host memory through the node's TCP engine, device memory
//! through its NCCL engine (made on the first device copy, [`Node::nccl`](crate::Node)).
//!
//! - As exporter ([`grant_copy`](PeerLink::grant_copy)), the link grants the lease as
//!   over a Unix link (the ledger pins the buffer while it is out, and refuses our own
//!   writes meanwhile) and offers a [`RawHandle::Copy`] in place of a handle to map. Host
//!   memory: the TCP engine starts sending the buffer's bytes at once, as the transfer
//!   named by the lease. Device memory: the send starts when the receiver's
//!   [`Pull`](baton_messages::protocol::Pull) says its receive is posted. NCCL pairs a
//!   communicator's sends and receives in the order they start, so the sends start in the
//!   order of the pulls, which the session keeps with each copy's state (offered, pulled,
//!   sending: `link_session/copies.rs`, [`LinkSession::next_pulled`]), each once the
//!   work queued on the buffer before the offer (its acquire fence, kept here: no fence
//!   crosses hosts) has completed. A refused device copy is simply never pulled.
//!   The receiver's `Release` says the bytes landed; the lease then ends as any other.
//! - As importer ([`receive_copies`](PeerLink::receive_copies)), it allocates a buffer of
//!   its own node per offer (of the offer's length: a range lease's copy is the range's
//!   bytes alone, sent from its offset, and its handle names no more of the sender's
//!   buffer), receives the bytes into it, gives the lease back at once
//!   (`Release`, `Unmapped`: the sender's buffer is free again), and hands the message's
//!   handler an ordinary lease on the local copy, opened through its import cache as
//!   `Node::local` opens one. Dropping that lease frees the copy; it is never orphaned
//!   (nothing of the sender's is in it).
//!
//! Failures: a transfer that fails or does not land by its deadline (the heartbeat's,
//! plus a second per [`FLOOR_BYTES_PER_SEC`](crate::forwarding::FLOOR_BYTES_PER_SEC) of its size) frees the partial copy and the
//! message fails with the engine's typed error (a call's caller hears
//! [`CallFault::OfferRefused`](baton_messages::protocol::CallFault)); the lease is given
//! back all the same. A *device* copy that fails also ends the link, on either side
//! ([`reap`]): NCCL pairs sends and receives by order alone, so after a failure the next
//! send could meet a receive posted for another buffer — and the receiver hears of a
//! sender's failure at once instead of at its deadline. When the link ends, every transfer with the peer is aborted
//! (`abort_peer` returns once the engine no longer touches the memory) *before* the
//! ledger takes back the leases the link held — so no buffer is written or freed under
//! a send still reading it — and a receive's partial copy is freed.
//!
//! Over a host link the peer may offer nothing but copies: any other handle names memory
//! of *this* host (a segment name, a CUDA handle) that a process elsewhere has no business
//! naming, and is the peer's fault (the link is cut), as is a copy not sealed with the
//! deployment's key or a pull of a lease not offered as a device copy (the session checks
//! all three, and its model test drives them). Writable leases and relayed offers do not cross hosts, nor does a
//! copy into a node of the other kind of memory (a host-memory node cannot receive
//! device memory, nor a CUDA node host memory): refused with typed errors, the link
//! unharmed.
//!
//! Forwards ([`Peer::forward`](crate::Peer::forward) to a peer on a host link): a lease we
//! hold on another process's buffer is offered as a copy of ours
//! ([`offer_forwarded`](PeerLink::offer_forwarded)), read from our mapping of it through the
//! same engines, its state kept by the session as a copy's is; what pins it is our lease on the original
//! ([`LeasePin`](crate::forwarding::LeasePin)), which the send keeps until its engine lets
//! go. The forward's caller hears when the peer gives the copy's lease back
//! ([`forward_released`](crate::host_copies::forward_released)).
//!
//! Order: a message whose buffers are copies is handed on once they have landed, on the
//! link's arbiter, while the link goes on handling later frames (pings keep it alive during
//! a long copy); the messages read after it wait for their turn ([`LinkSession::hold`]), so
//! the handlers see the order the peer sent, as over a Unix link.
//!
//! What the engines do — post, decline, send, wait, reap, open a landed copy, stop —
//! is [`host_copies`](crate::host_copies)'s, called from here with the node and the peer;
//! this file is the link's part: when each runs, and what the session says of it.
//!
//! [`LinkSession::hold`]: crate::link_session::LinkSession::hold
//! [`LinkSession::next_pulled`]: crate::link_session::LinkSession::next_pulled

use super::{Attached, PeerLink};
use crate::buffer::{IncomingLeases, Outgoing};
use crate::error::ActorError;
use crate::exports::OfferGrant;
use crate::forwarding::copy_deadline;
use crate::host_copies::{
    DeviceCopy, copy_plane, decline_copies, engine_for, engine_name, engine_peer, open_copy,
    post_receives, reap, unsupported, wait_all,
};
use crate::link_ref::ForwardCopy;
use crate::link_session::{Open, Then, Turn, copy_engine, copy_handle, order_lost};
use crate::paths::LeasePath;
use actix::prelude::*;
use baton_ipc::Error as IpcError;
use baton_ipc::transfer::{HeldTransfer, TransferId};
use baton_messages::protocol::Offer;
use baton_messages::{
    ActorId, CopyEngine, DType, ExporterId, Generation, HandleDigest, HandleMsg, Layout, LeaseId,
    Message as Wire, PROTOCOL_VERSION, RawHandle, Shape,
};
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, oneshot};

/// A host link's message ready to hand on (see [`hand_on`](PeerLink::hand_on)).
pub(super) struct Handed {
    then: Then<Attached>,
    opened: Result<IncomingLeases, IpcError>,
    slot: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for Handed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handed")
            .field("opened", &self.opened.as_ref().map(Vec::len))
            .finish_non_exhaustive()
    }
}

/// Who waits for a forward sent over this link as a copy to land.
pub(super) type ForwardWaiter = oneshot::Sender<Result<LeaseId, ActorError>>;

impl PeerLink {
    /// Whether buffers cross this link as copies (a host link).
    pub(super) fn copies(&self) -> bool {
        self.peer.host().is_some()
    }

    /// Grants the peer a lease on `out`'s buffer and offers it as a copy: host memory
    /// starts sending at once, device memory when the peer pulls it (see the
    /// [module docs](self)).
    pub(super) fn grant_copy(&mut self, out: &Outgoing) -> Result<(Offer, OfferGrant), ActorError> {
        let cell = &out.cell;
        let engine = engine_for(cell.alloc.ptr());
        let name = engine_name(engine);
        if out.writable {
            return Err(unsupported(
                name,
                "a writable lease does not cross hosts: the receiver gets a copy (send its result back as a buffer of its own)",
            )
            .into());
        }
        let (peer, plane) = copy_plane(&self.node, &self.peer, engine)?;
        let fence = out.acquire_fence(&self.peer.process)?;
        let (mut offer, fd, grant) = (self.node.exports()).grant(
            cell,
            out.part.as_ref(),
            false,
            &self.me,
            0,
            fence.clone(),
            None,
        )?;
        drop(fd);
        // The bytes the lease covers are what is sent.
        let (offset, len) = (offer.handle.offset as usize, offer.handle.len as usize);
        let key = self.node.session().handle_key();
        offer.handle = copy_handle(offer.handle, engine, key);
        if engine == CopyEngine::Nccl {
            let copy = DeviceCopy::own(Arc::clone(cell), offset, len, fence);
            self.session.copy_offered(offer.lease, copy);
            return Ok((offer, grant));
        }
        let sent = HeldTransfer::send(
            &plane.engine,
            &peer,
            TransferId(offer.lease.get()),
            Arc::clone(&cell.alloc),
            offset,
            len,
        );
        match sent {
            Ok(transfer) => {
                let transfer = Arc::new(transfer);
                (self.session).copy_sending(offer.lease, Arc::clone(&transfer));
                reap(transfer, None);
                Ok((offer, grant))
            }
            Err(e) => {
                self.node.exports().ungrant(grant, self.me.id);
                Err(e.into())
            }
        }
    }

    /// Offers the peer a copy of a lease we hold on another process's buffer (a forward
    /// to another host), read from our own mapping of it: as a copy of a buffer of ours
    /// (`grant_copy`), except that no ledger of ours counts the lease — the table of
    /// forwards does, until the peer gives it back — and that what pins the bytes is our
    /// lease on the original ([`LeasePin`](crate::forwarding::LeasePin)), kept by the send until its engine lets go.
    fn offer_forwarded(
        &mut self,
        msg: ForwardCopy,
        ctx: &mut Context<Self>,
    ) -> Result<LeaseId, ActorError> {
        let ForwardCopy {
            view,
            keep,
            fence,
            reply: _,
        } = msg;
        let engine = engine_for(view.ptr());
        let name = engine_name(engine);
        let (peer, plane) = copy_plane(&self.node, &self.peer, engine)?;
        let len = view.len();
        let lease = crate::ids::next_lease();
        let handle = HandleMsg {
            version: PROTOCOL_VERSION,
            exporter: ExporterId {
                process: self.node.session().process(),
                actor: ActorId::new(0),
            },
            alloc: baton_ipc::next_allocation_id(),
            generation: Generation::FIRST,
            backend: view.mapping().backend(),
            device: view.device(),
            alloc_size: len as u64,
            offset: 0,
            len: len as u64,
            layout: view.layout().cloned(),
            raw: RawHandle::Copy { engine },
            fence: None,
            digest: HandleDigest::default(),
        }
        .sealed(self.node.session().handle_key());
        let _span = tracing::debug_span!(parent: &self.span, "forward_copy", %lease, bytes = len, engine = name, exporter = %view.exporter()).entered();
        if engine == CopyEngine::Nccl {
            let copy = DeviceCopy::forwarded(view, keep, fence);
            self.session.copy_offered(lease, copy);
        } else {
            let id = TransferId(lease.get());
            let transfer = HeldTransfer::send_view(&plane.engine, &peer, id, view, keep)?;
            let transfer = Arc::new(transfer);
            self.session.copy_sending(lease, Arc::clone(&transfer));
            reap(transfer, None);
        }
        let path = LeasePath::offered(&handle.raw);
        let bytes = handle.len;
        if let Err(e) = self.send(&Wire::Offer(Box::new(Offer { lease, handle })), Vec::new()) {
            // Never offered: its send stops (and lets go of the pin) at once.
            self.copy_unsent(lease);
            self.cut(ctx, e);
            return Err(ActorError::link_closed(self.peer.process));
        }
        self.node.observed().paths.granted(path, bytes);
        tracing::debug!("forwarded as a copy");
        Ok(lease)
    }

    /// The frame that offered the copy of `lease` was never sent: its send, if one
    /// started, stops.
    pub(super) fn copy_unsent(&mut self, lease: LeaseId) {
        if let Some(transfer) = self.session.copy_unsent(lease) {
            transfer.abort();
        }
    }

    /// Starts the pulled sends in their order, each once its fence has completed (waited
    /// for on a blocking thread: it is our own work on the buffer).
    pub(super) fn send_pulled(&mut self, ctx: &mut Context<Self>) -> Result<(), ActorError> {
        while let Some(copy) = self.session.next_pulled() {
            let ready = copy.fence().map(Arc::clone);
            if let Some(fence) = ready.filter(|f| !matches!(f.is_complete(), Ok(true))) {
                if !self.pull_waiting {
                    self.pull_waiting = true;
                    let waited = tokio::task::spawn_blocking(move || fence.synchronize());
                    ctx.spawn(waited.into_actor(self).map(|waited, act, ctx| {
                        act.pull_waiting = false;
                        let sent = match waited {
                            Ok(Ok(())) => act.send_pulled(ctx),
                            Ok(Err(e)) => Err(e.into()),
                            Err(_) => Ok(()),
                        };
                        if let Err(e) = sent {
                            act.cut(ctx, e);
                        }
                    }));
                }
                return Ok(());
            }
            let (lease, copy) = self.session.take_pulled().expect("one is next");
            // A send that cannot start would leave the peer's receive unmatched, and the
            // next send matched to it: the link ends (and with it the communicators).
            let transfer = Arc::new(copy.start(&self.node, &self.peer, lease)?);
            self.session.copy_sending(lease, Arc::clone(&transfer));
            reap(transfer, Some(self.me.clone()));
        }
        Ok(())
    }

    /// The peer's engine's rendezvous message, for ours: keyed by this link's peer, its
    /// bootstrap socket checked to be on the host this link runs to (issue 45).
    pub(super) fn on_rendezvous(&mut self, bytes: &[u8]) -> Result<(), ActorError> {
        let (Some(peer), Some(host)) = (engine_peer(&self.peer), self.peer.host()) else {
            return Err(unsupported("nccl", "not a host link").into());
        };
        let nccl = self.node.nccl().map_err(|_| ActorError::Unexpected {
            got: "a Rendezvous for an engine this node does not run",
        })?;
        Ok(nccl.on_rendezvous(&peer, host.addr.ip(), bytes)?)
    }

    /// Receives a frame's offered copies, then carries on with what they were for (see
    /// the [module docs](self)). `slot` is a call's (kept while it runs).
    pub(super) fn receive_copies(
        &mut self,
        open: Open<Attached>,
        slot: Option<OwnedSemaphorePermit>,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        let Open {
            offers,
            relayed,
            then,
        } = open;
        // Its turn in the link's order, before anything can hand it on.
        let bytes = match &then {
            Then::Call { payload, .. } => payload.len(),
            Then::Reply { bytes, .. } => bytes.len(),
            Then::Deliver => 0,
        };
        let turn = self.session.hold(bytes)?;
        if offers.is_empty() {
            return self.hand_on(turn, then, Ok(Vec::new()), slot, ctx);
        }
        let name = engine_name(copy_engine(&offers[0]));
        // The peer's data connections are welcome from its host link's key (and only
        // from it: see `baton_ipc::transfer::tcp_engine`), before any receive or decline is posted.
        if let (Some(plane), Some(peer), Some(host)) =
            (self.node.plane(), engine_peer(&self.peer), self.peer.host())
        {
            plane.engine.admit(&peer, host.key);
        }
        let mut budget = None;
        let received = match self.session.receive_copies(&offers, relayed) {
            Err(reason) => Err(unsupported(name, reason)),
            Ok(copies) => {
                // Nor can many links together make us allocate without bound: the node's
                // budget, kept by its TCP engine.
                let taken = self.node.plane().and_then(|plane| {
                    plane
                        .engine
                        .copy_budget()
                        .try_take(copies.bytes, self.limits.node_copy_bytes)
                });
                let posted = match taken {
                    None => Err(unsupported(
                        name,
                        "the node's copies in flight, over all its links, would pass LinkLimits::node_copy_bytes",
                    )),
                    Some(taken) => {
                        budget = Some(taken);
                        post_receives(&self.node, &self.peer, &offers)
                    }
                };
                if posted.is_err() {
                    self.session.copies_in_done(copies.bytes);
                }
                posted.map(|receiving| (copies, receiving))
            }
        };
        let (copies, receiving) = match received {
            Ok(received) => received,
            Err(e) => {
                // The sender sends host copies all the same: read past them, so that they
                // do not hold up the copies behind them on its connection. (Device copies
                // are sent only once pulled.)
                decline_copies(&self.node, &self.peer, &offers);
                return self.copies_failed(&offers, e, turn, then, slot, ctx);
            }
        };
        // Device copies: their receives are posted, so the sender may start them.
        for pull in &copies.pulls {
            self.send(pull, Vec::new())?;
        }
        let mut allowance = self.node.heartbeat().deadline;
        if copies.device() {
            // The first device copy with a peer makes its communicator.
            allowance += self.node.hosts().nccl.rendezvous_timeout;
        }
        let (len, device) = (copies.bytes, copies.device());
        let allowed = copy_deadline(allowance, len);
        let waiting = tokio::task::spawn_blocking(move || {
            let waited = match wait_all(&receiving, allowed) {
                Ok(()) => Ok(receiving),
                Err(e) => {
                    // Aborted here, off the link's thread (an engine's abort may take its
                    // time; the partial copies are freed once it no longer touches them).
                    drop(receiving);
                    Err(e)
                }
            };
            // In flight no more: the node's budget has the bytes back.
            drop(budget);
            waited
        });
        ctx.spawn(waiting.into_actor(self).map(move |joined, act, ctx| {
            let span = act.span.clone();
            let _g = span.enter();
            act.session.copies_in_done(len);
            let done = match joined {
                Ok(Ok(receiving)) => act.copies_landed(offers, receiving, turn, then, slot, ctx),
                Ok(Err(e)) if device => {
                    // A device copy failed: the link ends, as the sender's does (`reap`:
                    // the communicators' order of sends and receives is lost), after the
                    // message has failed with the engine's error.
                    let cut = order_lost(offers[0].lease, &e);
                    act.copies_failed(&offers, e, turn, then, slot, ctx)
                        .and(Err(cut))
                }
                Ok(Err(e)) => act.copies_failed(&offers, e, turn, then, slot, ctx),
                // The waiting task ended early (the runtime stops): its turn ends too, so
                // nothing waits behind it for ever.
                Err(_) => {
                    let why = unsupported(name, "the wait for the copies ended early");
                    act.copies_failed(&offers, why, turn, then, slot, ctx)
                }
            };
            if let Err(e) = done {
                drop(_g);
                act.cut(ctx, e);
            }
        }));
        Ok(())
    }

    /// The copies landed: the leases go back, and the local copies are handed on.
    fn copies_landed(
        &mut self,
        offers: Vec<Offer>,
        receiving: Vec<HeldTransfer>,
        turn: Turn,
        then: Then<Attached>,
        slot: Option<OwnedSemaphorePermit>,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        for frame in self.session.refused(&offers, false) {
            self.send(&frame, Vec::new())?;
        }
        let mut leases = Vec::with_capacity(offers.len());
        for (offer, transfer) in offers.iter().zip(receiving) {
            let alloc = transfer
                .into_allocation()
                .expect("a landed receive owns its memory");
            let layout = offer
                .handle
                .layout
                .clone()
                .unwrap_or_else(|| Layout::new(DType::U8, Shape::vector(offer.handle.len)));
            let cell = self.node.adopt_allocation(alloc, layout);
            match open_copy(&self.node, &self.me, offer.lease, cell) {
                Ok(lease) => leases.push(Box::new(lease)),
                Err(e) => return self.hand_on(turn, then, Err(e), slot, ctx),
            }
        }
        tracing::debug!(copies = leases.len(), "copies landed");
        self.hand_on(turn, then, Ok(leases), slot, ctx)
    }

    /// The copies could not be received: what landed is freed, the leases go back, and
    /// the message fails with `why`.
    fn copies_failed(
        &mut self,
        offers: &[Offer],
        why: IpcError,
        turn: Turn,
        then: Then<Attached>,
        slot: Option<OwnedSemaphorePermit>,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        tracing::warn!(offers = offers.len(), error = %why, "could not receive copies");
        for frame in self.session.refused(offers, false) {
            self.send(&frame, Vec::new())?;
        }
        self.hand_on(turn, then, Err(why), slot, ctx)
    }

    /// The message of `turn` is ready: it is handed on once those read before it are —
    /// now, with those behind it that were waiting for it (see [`LinkSession::hold`](crate::link_session::LinkSession::hold)).
    fn hand_on(
        &mut self,
        turn: Turn,
        then: Then<Attached>,
        opened: Result<IncomingLeases, IpcError>,
        slot: Option<OwnedSemaphorePermit>,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        let item = Handed { then, opened, slot };
        let now = self.session.held_ready(turn, item);
        if now.is_empty() {
            tracing::trace!(
                waiting = self.session.held_back(),
                "a message waits for those read before it"
            );
        }
        for Handed { then, opened, slot } in now {
            self.then(then, opened, slot, ctx)?;
        }
        Ok(())
    }
}

impl Handler<ForwardCopy> for PeerLink {
    type Result = ();
    fn handle(&mut self, mut msg: ForwardCopy, ctx: &mut Self::Context) {
        let (tx, _) = oneshot::channel();
        let reply = std::mem::replace(&mut msg.reply, tx);
        if reply.is_closed() {
            // Its caller gave up before it started.
            return;
        }
        match self.offer_forwarded(msg, ctx) {
            Ok(lease) => {
                self.session.forward_offered(lease, reply);
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }
}
