//! Buffers across hosts: over a host link (TCP) a buffer arrives as a copy in memory the
//! receiver's node owns — host memory through the node's TCP engine, device memory
//! through its NCCL engine (made on the first device copy, [`Node::nccl`](crate::Node)).
//!
//! - As exporter ([`grant_copy`](PeerLink::grant_copy)), the link grants the lease as
//!   over a Unix link (the ledger pins the buffer while it is out, and refuses our own
//!   writes meanwhile) and offers a [`RawHandle::Copy`] in place of a handle to map. Host
//!   memory: the TCP engine starts sending the buffer's bytes at once, as the transfer
//!   named by the lease. Device memory: the send starts when the receiver's
//!   [`Pull`](baton_messages::protocol::Pull) says its receive is posted
//!   ([`on_pull`](PeerLink::on_pull)) — NCCL pairs a communicator's sends and receives
//!   in the order they start, so the sends start in the order of the pulls, each once the
//!   work queued on the buffer before the offer (its acquire fence, kept here: no fence
//!   crosses hosts) has completed. A refused device copy is simply never pulled.
//!   The receiver's `Release` says the bytes landed; the lease then ends as any other.
//! - As importer ([`receive_copies`](PeerLink::receive_copies)), it allocates a buffer of
//!   its own node per offer, receives the bytes into it, gives the lease back at once
//!   (`Release`, `Unmapped`: the sender's buffer is free again), and hands the message's
//!   handler an ordinary lease on the local copy, opened through its import cache as
//!   `Node::local` opens one. Dropping that lease frees the copy; it is never orphaned
//!   (nothing of the sender's is in it).
//!
//! Failures: a transfer that fails or does not land by its deadline (the heartbeat's,
//! plus a second per [`FLOOR_BYTES_PER_SEC`] of its size) frees the partial copy and the
//! message fails with the engine's typed error (a call's caller hears
//! [`CallFault::OfferRefused`](baton_messages::protocol::CallFault)); the lease is given
//! back all the same. When the link ends, every transfer with the peer is aborted
//! (`abort_peer` returns once the engine no longer touches the memory) *before* the
//! ledger takes back the leases the link held — so no buffer is written or freed under
//! a send still reading it — and a receive's partial copy is freed.
//!
//! Over a host link the peer may offer nothing but copies: any other handle names memory
//! of *this* host (a segment name, a CUDA handle) that a process elsewhere has no business
//! naming, and is the peer's fault (the link is cut), as is a pull of a lease not offered
//! as a device copy. Writable leases and forwarded leases do not cross hosts, nor does a
//! copy into a node of the other kind of memory (a host-memory node cannot receive
//! device memory, nor a CUDA node host memory): refused with typed errors, the link
//! unharmed.
//!
//! Order: a message whose buffers are copies is handed on once they have landed, on the
//! link's arbiter, while the link goes on handling later frames (pings keep it alive
//! during a long copy): a later message without buffers may overtake it.

use super::{Attached, PeerLink};
use crate::buffer::{IncomingLease, Outgoing};
use crate::error::ActorError;
use crate::exports::{BufferCell, OfferGrant};
use crate::link_ref::SendRendezvous;
use crate::link_session::{Open, Then};
use crate::order::LeaseOrder;
use actix::prelude::*;
use baton_ipc::transfer::{EnginePeer, HeldTransfer, TransferEngine, TransferId, decline};
use baton_ipc::{Error as IpcError, ExportedFence, MemPtr};
use baton_messages::protocol::{Offer, Pull, Rendezvous};
use baton_messages::{CopyEngine, DType, Layout, LeaseId, Message as Wire, RawHandle, Shape};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::OwnedSemaphorePermit;

/// The slowest a copy may move and still land by its deadline: a copy of `n` bytes has
/// the heartbeat deadline plus `n / FLOOR_BYTES_PER_SEC` seconds.
pub(crate) const FLOOR_BYTES_PER_SEC: u64 = 16 << 20;

/// The copies a link offered, by lease: forgotten (a send aborted) if their frame is
/// never sent, when their lease comes back, and when the link ends.
pub(super) type CopiesOut = std::collections::HashMap<LeaseId, CopyOut>;

/// A copy the link offered.
pub(super) enum CopyOut {
    /// A device copy, until the receiver pulls it.
    Offered(DeviceCopy),
    /// A device copy pulled, waiting in [`Pulls`] for its turn.
    Pulled(DeviceCopy),
    /// Its send, under way.
    Sending(Arc<HeldTransfer>),
}

/// A device copy not sent yet: the buffer (pinned by its lease) and the work before the
/// offer that its send must follow.
pub(super) struct DeviceCopy {
    cell: Arc<BufferCell>,
    len: usize,
    fence: Option<Arc<dyn ExportedFence>>,
}

/// The device copies pulled and not sent yet, in the order of their pulls (the order
/// their sends must start in).
#[derive(Default)]
pub(super) struct Pulls {
    queue: VecDeque<LeaseId>,
    /// The first one's fence is being waited for (on a blocking thread).
    waiting: bool,
}

fn unsupported(engine: &'static str, reason: &'static str) -> IpcError {
    IpcError::RegionUnsupported { engine, reason }
}

/// The engine an offered copy names (checked: the offer is a copy).
fn copy_engine(offer: &Offer) -> CopyEngine {
    match offer.handle.raw {
        RawHandle::Copy { engine } => engine,
        _ => CopyEngine::Tcp,
    }
}

/// An engine's name, for errors.
fn engine_name(engine: CopyEngine) -> &'static str {
    match engine {
        CopyEngine::Nccl => "nccl",
        _ => "tcp",
    }
}

/// The engine that carries a copy of memory at `ptr`.
fn engine_for(ptr: MemPtr) -> CopyEngine {
    match ptr {
        MemPtr::Host(_) => CopyEngine::Tcp,
        MemPtr::Device(_) => CopyEngine::Nccl,
    }
}

/// How long a copy of `len` bytes may take (see [`FLOOR_BYTES_PER_SEC`]).
fn deadline_for(heartbeat: Duration, len: usize) -> Duration {
    heartbeat + Duration::from_secs(len as u64 / FLOOR_BYTES_PER_SEC)
}

/// Waits for each transfer until `by`: the first failure, or a timeout at `by`.
fn wait_all(transfers: &[HeldTransfer], by: Instant) -> Result<(), IpcError> {
    for t in transfers {
        loop {
            let left = by.saturating_duration_since(Instant::now());
            match t.wait(left.min(Duration::from_millis(500))) {
                Ok(()) => break,
                Err(IpcError::Timeout { .. }) if !left.is_zero() => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Holds a finished send until the engine reports it (bounded by the engine's stall
/// timeout), so that its memory is kept until then; started sends are reaped here.
fn reap(transfer: Arc<HeldTransfer>) {
    tokio::task::spawn_blocking(move || {
        while !transfer.is_finished() {
            if let Err(e) = transfer.wait(Duration::from_secs(1)) {
                if !matches!(e, IpcError::Timeout { .. }) {
                    tracing::debug!(transfer = %transfer.id(), error = %e, "a copy's send failed");
                }
            }
        }
    });
}

impl PeerLink {
    /// The peer as the transfer engines name it (a host link's peer only).
    fn engine_peer(&self) -> Option<EnginePeer> {
        let host = self.peer.host()?;
        Some(EnginePeer {
            process: self.peer.process,
            host: host.host,
            data_addr: host.data_addr,
        })
    }

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
        let peer = self
            .engine_peer()
            .filter(|p| p.data_addr.is_some())
            .ok_or_else(|| unsupported(name, "the peer announced no TCP engine"))?;
        let plane = self
            .node
            .plane()
            .ok_or_else(|| unsupported(name, "this node has no host link"))?;
        if engine == CopyEngine::Nccl {
            // Made now, so that a node without NCCL refuses the offer, not its pull.
            self.node.nccl()?;
        }
        let fence = out.acquire_fence(&self.peer.process)?;
        let (mut offer, fd, grant) =
            (self.node.exports()).grant(cell, &self.me, 0, fence.clone(), false)?;
        drop(fd);
        offer.handle.raw = RawHandle::Copy { engine };
        // The receiver waits on nothing of ours: we wait before we send.
        offer.handle.fence = None;
        offer.handle = offer.handle.sealed(self.node.session().handle_key());
        let len = offer.handle.len as usize;
        if engine == CopyEngine::Nccl {
            let copy = DeviceCopy {
                cell: Arc::clone(cell),
                len,
                fence,
            };
            self.copies_out.insert(offer.lease, CopyOut::Offered(copy));
            return Ok((offer, grant));
        }
        let sent = HeldTransfer::send(
            &plane.engine,
            &peer,
            TransferId(offer.lease.get()),
            Arc::clone(&cell.alloc),
            0,
            len,
        );
        match sent {
            Ok(transfer) => {
                let transfer = Arc::new(transfer);
                self.copies_out
                    .insert(offer.lease, CopyOut::Sending(Arc::clone(&transfer)));
                reap(transfer);
                Ok((offer, grant))
            }
            Err(e) => {
                self.node.exports().ungrant(offer.lease, grant, self.me.id);
                Err(e.into())
            }
        }
    }

    /// A copy's lease came back (landed, or refused unpulled), or its frame was never
    /// sent (`abort`). A pulled copy not sent yet is dropped from its turn.
    pub(super) fn copy_done(&mut self, lease: LeaseId, abort: bool) {
        if let Some(CopyOut::Sending(transfer)) = self.copies_out.remove(&lease) {
            if abort {
                transfer.abort();
            }
        }
    }

    /// The link ends: every transfer with the peer stops touching memory before the
    /// ledger takes the link's leases back.
    pub(super) fn abort_copies(&mut self) {
        if let (Some(plane), Some(peer)) = (self.node.plane(), self.engine_peer()) {
            plane.engine.abort_peer(&peer);
            if let Some(nccl) = plane.nccl() {
                nccl.abort_peer(&peer);
            }
        }
        // `abort_peer` stopped every send with the peer (within its bound): each ends in
        // its reaper, which keeps its memory until the engine lets go of it.
        self.pulls.queue.clear();
        self.copies_out.clear();
    }

    /// The peer posted its receive of the device copy of `lease`: its send takes its turn.
    pub(super) fn on_pull(
        &mut self,
        lease: LeaseId,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        match self.copies_out.remove(&lease) {
            Some(CopyOut::Offered(copy)) => {
                self.copies_out.insert(lease, CopyOut::Pulled(copy));
                self.pulls.queue.push_back(lease);
                self.send_pulled(ctx)
            }
            other => {
                if let Some(copy) = other {
                    self.copies_out.insert(lease, copy);
                }
                Err(ActorError::Unexpected {
                    got: "a Pull of a lease not offered as a device copy, or pulled twice",
                })
            }
        }
    }

    /// Starts the pulled sends in their order, each once its fence has completed (waited
    /// for on a blocking thread: it is our own work on the buffer).
    fn send_pulled(&mut self, ctx: &mut Context<Self>) -> Result<(), ActorError> {
        while let Some(&lease) = self.pulls.queue.front() {
            let ready = match self.copies_out.get(&lease) {
                Some(CopyOut::Pulled(copy)) => copy.fence.as_ref().map(Arc::clone),
                // Its lease came back meanwhile: the receiver gave up on it.
                _ => {
                    self.pulls.queue.pop_front();
                    continue;
                }
            };
            if let Some(fence) = ready.filter(|f| !matches!(f.is_complete(), Ok(true))) {
                if !self.pulls.waiting {
                    self.pulls.waiting = true;
                    let waited = tokio::task::spawn_blocking(move || fence.synchronize());
                    ctx.spawn(waited.into_actor(self).map(|waited, act, ctx| {
                        act.pulls.waiting = false;
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
            self.pulls.queue.pop_front();
            let Some(CopyOut::Pulled(copy)) = self.copies_out.remove(&lease) else {
                unreachable!("checked above");
            };
            // A send that cannot start would leave the peer's receive unmatched, and the
            // next send matched to it: the link ends (and with it the communicators).
            let transfer = Arc::new(self.start_device_send(lease, copy)?);
            self.copies_out
                .insert(lease, CopyOut::Sending(Arc::clone(&transfer)));
            reap(transfer);
        }
        Ok(())
    }

    fn start_device_send(
        &self,
        lease: LeaseId,
        copy: DeviceCopy,
    ) -> Result<HeldTransfer, ActorError> {
        let peer = self
            .engine_peer()
            .ok_or_else(|| unsupported("nccl", "not a host link"))?;
        let nccl = self.node.nccl()?;
        let id = TransferId(lease.get());
        Ok(HeldTransfer::send(
            &*nccl,
            &peer,
            id,
            copy.cell.alloc.clone(),
            0,
            copy.len,
        )?)
    }

    /// The peer's engine's rendezvous message, for ours.
    pub(super) fn on_rendezvous(&mut self, bytes: &[u8]) -> Result<(), ActorError> {
        let peer = self
            .engine_peer()
            .ok_or_else(|| unsupported("nccl", "not a host link"))?;
        let nccl = self.node.nccl().map_err(|_| ActorError::Unexpected {
            got: "a Rendezvous for an engine this node does not run",
        })?;
        Ok(nccl.on_rendezvous(&peer, bytes)?)
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
        let key = self.node.session().handle_key();
        for offer in &offers {
            if !matches!(offer.handle.raw, RawHandle::Copy { .. }) {
                return Err(IpcError::from(baton_messages::Error::BackendMismatch {
                    backend: offer.handle.backend,
                    raw: offer.handle.raw.kind_name(),
                })
                .into());
            }
            offer.handle.check(key).map_err(IpcError::from)?;
        }
        let len = offers
            .iter()
            .fold(0usize, |n, o| n.saturating_add(o.handle.len as usize));
        let name = offers
            .first()
            .map_or("tcp", |o| engine_name(copy_engine(o)));
        let received = if relayed {
            Err(unsupported(name, "a forwarded lease does not cross hosts"))
        } else if self.copies_in.saturating_add(len) > self.limits.copy_bytes {
            // Each copy is memory of ours: a peer cannot make us allocate without bound.
            Err(unsupported(
                name,
                "the link's copies in flight would pass LinkLimits::copy_bytes",
            ))
        } else {
            self.post_receives(&offers)
        };
        let receiving = match received {
            Ok(receiving) => receiving,
            Err(e) => {
                // The sender sends host copies all the same: read past them, so that they
                // do not hold up the copies behind them on its connection. (Device copies
                // are sent only once pulled.)
                self.decline(&offers);
                return self.copies_failed(&offers, e, then, slot, ctx);
            }
        };
        // Device copies: their receives are posted, so the sender may start them (in
        // this order: the order NCCL pairs them in).
        for offer in &offers {
            if copy_engine(offer) == CopyEngine::Nccl {
                self.send(&Wire::Pull(Pull { lease: offer.lease }), Vec::new())?;
            }
        }
        self.copies_in += len;
        let mut allowance = self.node.heartbeat().deadline;
        if offers.iter().any(|o| copy_engine(o) == CopyEngine::Nccl) {
            // The first device copy with a peer makes its communicator.
            allowance += self.node.hosts().nccl.rendezvous_timeout;
        }
        let by = Instant::now() + deadline_for(allowance, len);
        let waiting = tokio::task::spawn_blocking(move || match wait_all(&receiving, by) {
            Ok(()) => Ok(receiving),
            Err(e) => {
                // Aborted here, off the link's thread (an engine's abort may take its
                // time; the partial copies are freed once it no longer touches them).
                drop(receiving);
                Err(e)
            }
        });
        ctx.spawn(waiting.into_actor(self).map(move |joined, act, ctx| {
            let span = act.span.clone();
            let _g = span.enter();
            act.copies_in -= len;
            let done = match joined {
                Ok(Ok(receiving)) => act.copies_landed(offers, receiving, then, slot, ctx),
                Ok(Err(e)) => act.copies_failed(&offers, e, then, slot, ctx),
                Err(_) => Ok(()),
            };
            if let Err(e) = done {
                drop(_g);
                act.cut(ctx, e);
            }
        }));
        Ok(())
    }

    /// Declines the offered host copies' transfers (a receive of one that was posted is
    /// replaced).
    fn decline(&self, offers: &[Offer]) {
        if let (Some(plane), Some(peer)) = (self.node.plane(), self.engine_peer()) {
            for offer in offers.iter().filter(|o| copy_engine(o) == CopyEngine::Tcp) {
                let id = TransferId(offer.lease.get());
                if let Err(e) = decline(&plane.engine, &peer, id) {
                    tracing::debug!(%id, error = %e, "could not decline a copy");
                }
            }
        }
    }

    /// Allocates a local buffer per offer and posts its receive on its engine.
    fn post_receives(&self, offers: &[Offer]) -> Result<Vec<HeldTransfer>, IpcError> {
        let (plane, peer) = match (self.node.plane(), self.engine_peer()) {
            (Some(plane), Some(peer)) => (plane, peer),
            _ => return Err(unsupported("tcp", "this node has no host link")),
        };
        let backend = self.node.backend();
        let mut receiving = Vec::with_capacity(offers.len());
        for offer in offers {
            let len = offer.handle.len as usize;
            let engine = copy_engine(offer);
            let nccl = match engine {
                CopyEngine::Nccl => Some(self.node.nccl()?),
                _ => None,
            };
            let alloc = backend.allocate(len)?;
            if engine_for(alloc.ptr()) != engine {
                return Err(unsupported(
                    engine_name(engine),
                    "a copy lands in memory of the kind it was sent from: this node allocates the other kind (host memory crosses between host-memory nodes, device memory between CUDA nodes)",
                ));
            }
            let id = TransferId(offer.lease.get());
            let posted = match &nccl {
                Some(nccl) => HeldTransfer::recv(&**nccl, &peer, id, alloc, 0, len)?,
                None => HeldTransfer::recv(&plane.engine, &peer, id, alloc, 0, len)?,
            };
            receiving.push(posted);
        }
        Ok(receiving)
    }

    /// The copies landed: the leases go back, and the local copies are handed on.
    fn copies_landed(
        &mut self,
        offers: Vec<Offer>,
        receiving: Vec<HeldTransfer>,
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
            match self.open_copy(offer.lease, cell) {
                Ok(lease) => leases.push(lease),
                Err(e) => return self.then(then, Err(e), slot, ctx),
            }
        }
        tracing::debug!(copies = leases.len(), "copies landed");
        self.then(then, Ok(leases), slot, ctx)
    }

    /// A lease on our own copy, opened through the import cache.
    fn open_copy(&self, lease: LeaseId, cell: Arc<BufferCell>) -> Result<IncomingLease, IpcError> {
        let (handle, mut fds) = self.node.exports().own_handle(&cell)?;
        let imported = self.node.cache().open_unordered(&handle, &mut fds)?;
        let order = LeaseOrder::new(
            Arc::clone(imported.backend()),
            self.node.session().process(),
            None,
        );
        Ok(IncomingLease {
            imported: Some(imported),
            lease,
            link: self.me.clone(),
            held: Arc::default(),
            order,
            copy: Some(cell),
        })
    }

    /// The copies could not be received: what landed is freed, the leases go back, and
    /// the message fails with `why`.
    fn copies_failed(
        &mut self,
        offers: &[Offer],
        why: IpcError,
        then: Then<Attached>,
        slot: Option<OwnedSemaphorePermit>,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        tracing::warn!(offers = offers.len(), error = %why, "could not receive copies");
        for frame in self.session.refused(offers, false) {
            self.send(&frame, Vec::new())?;
        }
        self.then(then, Err(why), slot, ctx)
    }
}

impl Handler<SendRendezvous> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: SendRendezvous, ctx: &mut Self::Context) {
        let rendezvous = Wire::Rendezvous(Rendezvous { bytes: msg.bytes });
        if let Err(e) = self.send(&rendezvous, Vec::new()) {
            self.cut(ctx, e);
        }
    }
}
