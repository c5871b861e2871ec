//! Buffers across hosts: over a host link (TCP) a buffer arrives as a copy in memory the
//! receiver's node owns.
//!
//! - As exporter ([`grant_copy`](PeerLink::grant_copy)), the link grants the lease as
//!   over a Unix link (the ledger pins the buffer while it is out, and refuses our own
//!   writes meanwhile), offers a [`RawHandle::Copy`] in place of a handle to map, and
//!   starts the TCP engine sending the buffer's bytes as the transfer named by the lease.
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
//! naming, and is the peer's fault (the link is cut). Writable leases, device memory
//! (until the NCCL engine is wired in) and forwarded leases do not cross hosts: refused
//! with typed errors, the link unharmed.
//!
//! Order: a message whose buffers are copies is handed on once they have landed, on the
//! link's arbiter, while the link goes on handling later frames (pings keep it alive
//! during a long copy): a later message without buffers may overtake it.

use super::{Attached, PeerLink};
use crate::buffer::{IncomingLease, Outgoing};
use crate::error::ActorError;
use crate::exports::{BufferCell, OfferGrant};
use crate::link_session::{Open, Then};
use crate::order::LeaseOrder;
use actix::prelude::*;
use baton_ipc::transfer::{EnginePeer, HeldTransfer, TransferId, decline};
use baton_ipc::{Error as IpcError, MemPtr};
use baton_messages::protocol::Offer;
use baton_messages::{CopyEngine, DType, Layout, LeaseId, RawHandle, Shape};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::OwnedSemaphorePermit;

/// The slowest a copy may move and still land by its deadline: a copy of `n` bytes has
/// the heartbeat deadline plus `n / FLOOR_BYTES_PER_SEC` seconds.
pub(crate) const FLOOR_BYTES_PER_SEC: u64 = 16 << 20;

/// The sends of copies a link has started, by lease: aborted if their frame is never
/// sent, and when the link ends.
pub(super) type CopiesOut = std::collections::HashMap<LeaseId, Arc<HeldTransfer>>;

fn unsupported(reason: &'static str) -> ActorError {
    IpcError::RegionUnsupported {
        engine: "tcp",
        reason,
    }
    .into()
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

    /// Grants the peer a lease on `out`'s buffer and starts sending its bytes (see the
    /// [module docs](self)).
    pub(super) fn grant_copy(&mut self, out: &Outgoing) -> Result<(Offer, OfferGrant), ActorError> {
        if out.writable {
            return Err(unsupported(
                "a writable lease does not cross hosts: the receiver gets a copy (send its result back as a buffer of its own)",
            ));
        }
        let cell = &out.cell;
        if !matches!(cell.alloc.ptr(), MemPtr::Host(_)) {
            return Err(unsupported(
                "device memory does not cross hosts yet (the NCCL engine is not wired into links): stage it in host memory",
            ));
        }
        let (plane, peer) = match (self.node.plane(), self.engine_peer()) {
            (Some(plane), Some(peer)) if peer.data_addr.is_some() => (plane, peer),
            _ => {
                return Err(unsupported(
                    "the peer announced no TCP engine to send buffers to",
                ));
            }
        };
        let fence = out.acquire_fence(&self.peer.process)?;
        let (mut offer, fd, grant) = self.node.exports().grant(cell, &self.me, 0, fence, false)?;
        drop(fd);
        offer.handle.raw = RawHandle::Copy {
            engine: CopyEngine::Tcp,
        };
        offer.handle = offer.handle.sealed(self.node.session().handle_key());
        let len = offer.handle.len as usize;
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
                self.copies_out.insert(offer.lease, Arc::clone(&transfer));
                reap(transfer);
                Ok((offer, grant))
            }
            Err(e) => {
                self.node.exports().ungrant(offer.lease, grant, self.me.id);
                Err(e.into())
            }
        }
    }

    /// A copy's lease came back (landed), or its frame was never sent (`abort`).
    pub(super) fn copy_done(&mut self, lease: LeaseId, abort: bool) {
        if let Some(transfer) = self.copies_out.remove(&lease) {
            if abort {
                transfer.abort();
            }
        }
    }

    /// The link ends: every transfer with the peer stops touching memory before the
    /// ledger takes the link's leases back.
    pub(super) fn abort_copies(&mut self) {
        if let (Some(plane), Some(peer)) = (self.node.plane(), self.engine_peer()) {
            use baton_ipc::TransferEngine;
            plane.engine.abort_peer(&peer);
        }
        for (_, transfer) in self.copies_out.drain() {
            transfer.abort();
        }
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
        let received = if relayed {
            Err(IpcError::RegionUnsupported {
                engine: "tcp",
                reason: "a forwarded lease does not cross hosts",
            })
        } else if self.copies_in.saturating_add(len) > self.limits.copy_bytes {
            // Each copy is memory of ours: a peer cannot make us allocate without bound.
            Err(IpcError::RegionUnsupported {
                engine: "tcp",
                reason: "the link's copies in flight would pass LinkLimits::copy_bytes",
            })
        } else {
            self.post_receives(&offers)
        };
        let receiving = match received {
            Ok(receiving) => receiving,
            Err(e) => {
                // The sender sends them all the same: read past them, so that they do
                // not hold up the copies behind them on its connection.
                self.decline(&offers);
                return self.copies_failed(&offers, e, then, slot, ctx);
            }
        };
        self.copies_in += len;
        let by = Instant::now() + deadline_for(self.node.heartbeat().deadline, len);
        let waiting = tokio::task::spawn_blocking(move || {
            let landed = wait_all(&receiving, by);
            (receiving, landed)
        });
        ctx.spawn(waiting.into_actor(self).map(move |joined, act, ctx| {
            let span = act.span.clone();
            let _g = span.enter();
            act.copies_in -= len;
            let done = match joined {
                Ok((receiving, Ok(()))) => act.copies_landed(offers, receiving, then, slot, ctx),
                Ok((receiving, Err(e))) => {
                    drop(receiving);
                    act.copies_failed(&offers, e, then, slot, ctx)
                }
                Err(_) => Ok(()),
            };
            if let Err(e) = done {
                drop(_g);
                act.cut(ctx, e);
            }
        }));
        Ok(())
    }

    /// Declines the offered copies' transfers (a receive of one that was posted is
    /// replaced).
    fn decline(&self, offers: &[Offer]) {
        if let (Some(plane), Some(peer)) = (self.node.plane(), self.engine_peer()) {
            for offer in offers {
                let id = TransferId(offer.lease.get());
                if let Err(e) = decline(&plane.engine, &peer, id) {
                    tracing::debug!(%id, error = %e, "could not decline a copy");
                }
            }
        }
    }

    /// Allocates a local buffer per offer and posts its receive.
    fn post_receives(&self, offers: &[Offer]) -> Result<Vec<HeldTransfer>, IpcError> {
        let (plane, peer) = match (self.node.plane(), self.engine_peer()) {
            (Some(plane), Some(peer)) => (plane, peer),
            _ => {
                return Err(IpcError::RegionUnsupported {
                    engine: "tcp",
                    reason: "this node has no TCP engine",
                });
            }
        };
        let backend = self.node.backend();
        let mut receiving = Vec::with_capacity(offers.len());
        for offer in offers {
            let len = offer.handle.len as usize;
            let alloc = backend.allocate(len)?;
            if !matches!(alloc.ptr(), MemPtr::Host(_)) {
                return Err(IpcError::RegionUnsupported {
                    engine: "tcp",
                    reason: "this node allocates device memory: a copy from another host lands in host memory only (until the NCCL engine is wired into links)",
                });
            }
            let id = TransferId(offer.lease.get());
            receiving.push(HeldTransfer::recv(&plane.engine, &peer, id, alloc, 0, len)?);
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
                .expect("a receive owns its memory");
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
