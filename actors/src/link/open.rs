//! The link's importer side: opening the offers its session checked (through the import
//! cache, on the node's driver thread when the backend's calls block), turning them into
//! lease guards, and what the leases were for — a delivery, the peer's call, the reply to
//! ours.

use super::{Attached, PeerLink};
use crate::buffer::{HeldLease, IncomingLease, IncomingLeases, LeaseParts};
use crate::error::ActorError;
use crate::link_session::{Kept, Open, Then};
use crate::order::{GroupAcquire, LeaseOrder};
use crate::paths::LeasePath;
use crate::remote::IncomingPayload;
use actix::prelude::*;
use baton_ipc::{FrameFds, ImportCache, Imported};
use baton_messages::protocol::{CallFault, Offer};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::OwnedSemaphorePermit;

/// An offer opened, or why it could not be (a local failure: refused, not a fault).
type Opened<T = IncomingLease> = Result<T, baton_ipc::Error>;

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

/// A lease over several buffers being opened: its parts' shared guard, its hold, and the
/// acquire side its parts share.
struct Opening {
    parts: Arc<LeaseParts>,
    held: Arc<HeldLease>,
    group: Option<Arc<GroupAcquire>>,
}

impl PeerLink {
    /// Opens a frame's offers, checked by the session, all or none, then carries on with
    /// what they are for ([`then`](Self::then)). Opens are driver calls: on a node whose
    /// backend makes blocking calls they run on the node's driver thread while this link
    /// waits (`ctx.wait`: no other frame of this link is handled meanwhile, so frames keep
    /// their order; other links and actors run on). An open that failed through the
    /// peer's fault cuts the link; a local failure is given to `then`: nothing is kept —
    /// the leases opened are released as their guards drop, the others are released now,
    /// and the exporter hears that we do not map what we could not open, so that its next
    /// offer of it carries the descriptor again. `slot` is a call's (kept while it runs).
    pub(super) fn open(
        &mut self,
        open: Open<Attached>,
        fds: FrameFds,
        slot: Option<OwnedSemaphorePermit>,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        if self.copies() {
            // A host link: the offers are copies, received through the engines.
            drop(fds);
            return self.receive_copies(open, slot, ctx);
        }
        let Open {
            offers,
            relayed,
            then,
        } = open;
        self.me
            .state
            .fds_received
            .fetch_add(fds.len() as u64, Ordering::Relaxed);
        if offers.is_empty() {
            return self.then(then, Ok(Vec::new()), slot, ctx);
        }
        let cache = self.node.cache().clone();
        let offload = self.node.offload();
        if offload.is_inline() {
            let (offers, views) = open_views(cache, offers, fds);
            let opened = self.finish_open(offers, views, relayed)?;
            return self.then(then, opened, slot, ctx);
        }
        // Mapped already, fences open: nothing that blocks, so no trip to the driver thread
        // (the cached handoff's common case).
        if let Some(views) = cache.open_all_if_ready(offers.iter().map(|o| &o.handle)) {
            drop(fds);
            let opened = self.finish_open(offers, views, relayed)?;
            return self.then(then, opened, slot, ctx);
        }
        let opening = offload.run(move || open_views(cache, offers, fds));
        ctx.wait(opening.into_actor(self).map(move |views, act, ctx| {
            let span = act.span.clone();
            let _g = span.enter();
            let done = views
                .and_then(|(offers, views)| act.finish_open(offers, views, relayed))
                .and_then(|opened| act.then(then, opened, slot, ctx));
            if let Err(e) = done {
                drop(_g);
                act.cut(ctx, e);
            }
        }));
        Ok(())
    }

    /// Turns opened views into lease guards, recording each lease (and each first
    /// mapping of an allocation) in the session (see [`open`](Self::open)).
    fn finish_open(
        &mut self,
        offers: Vec<Offer>,
        views: Vec<Result<Imported, baton_ipc::Error>>,
        relayed: bool,
    ) -> Result<Opened<IncomingLeases>, ActorError> {
        let mut leases: IncomingLeases = Vec::with_capacity(offers.len());
        // The lease over several buffers being opened, if any.
        let mut parts: Option<Opening> = None;
        for (i, (offer, view)) in offers.iter().zip(views).enumerate() {
            let part = i > 0 && offers[i - 1].lease == offer.lease;
            if !part {
                parts = None;
            }
            let imported = match view {
                Ok(imported) => imported,
                Err(e) if e.is_local_open_failure() => {
                    tracing::warn!(lease = %offer.lease, alloc = %offer.handle.alloc, error = %e, "could not open an offer: refused");
                    // A lease over several buffers goes back whole: its parts opened
                    // already send nothing, and the lease is given back with the rest.
                    let mut from = i;
                    if part {
                        from = offers[..i]
                            .iter()
                            .rposition(|o| o.lease != offer.lease)
                            .map_or(0, |p| p + 1);
                        if let Some(opening) = &parts {
                            opening.parts.refused();
                        }
                        self.session.released(offer.lease);
                    }
                    drop(leases);
                    for frame in self.session.refused(&offers[from..], relayed) {
                        self.send(&frame, Vec::new())?;
                    }
                    return Ok(Err(e));
                }
                Err(e) => return Err(e.into()),
            };
            let key = imported.key();
            let kept = if relayed {
                // A third process's memory: no warm mapping (its exporter cannot ask us to
                // unmap it); this lease's own hold keeps it until its `Release` may go.
                let holder = self.node.relays().new_holder();
                self.node.cache().hold(&key, holder);
                Kept::Own((key, holder))
            } else {
                Kept::Warm(key)
            };
            // A lease over several buffers: its parts share one guard and one release.
            if !part
                && offers
                    .get(i + 1)
                    .is_some_and(|next| next.lease == offer.lease)
            {
                let first = LeaseParts::new(offer.lease, self.me.clone());
                let all = || offers[i..].iter().take_while(|o| o.lease == offer.lease);
                let producer = offer.handle.exporter.process;
                // One exporter's fences (a lease over several buffers comes over one
                // link, never relayed): its streams wait once for them all.
                let group = all()
                    .all(|o| o.handle.exporter.process == producer)
                    .then(|| {
                        Arc::new(GroupAcquire::new(
                            producer,
                            all().filter_map(|o| o.handle.fence),
                        ))
                    });
                parts = Some(Opening {
                    parts: first,
                    held: Arc::new(HeldLease::default()),
                    group,
                });
            }
            let (lease_parts, held, group) = match &parts {
                Some(o) => (
                    Some(Arc::clone(&o.parts)),
                    Arc::clone(&o.held),
                    o.group.clone(),
                ),
                None => (None, Arc::new(HeldLease::default()), None),
            };
            // The first offer of an allocation over this link starts a hold: the mapping
            // stays warm for the next offer until the exporter says `Unmap`. (A hold that
            // was letting go while leases used the mapping is superseded: the cache answers
            // its `Unmapped`.)
            if self
                .session
                .opened(offer, Arc::downgrade(&held), kept, part)
            {
                self.node.cache().hold(&key, self.me.holder());
            }
            self.me
                .state
                .held_leases
                .store(self.session.held(), Ordering::Relaxed);
            let mut order = LeaseOrder::new(
                Arc::clone(imported.backend()),
                offer.handle.exporter.process,
                offer.handle.fence,
            );
            if let Some(group) = group {
                order = order.in_group(group);
            }
            let path = LeasePath::mapped(&offer.handle.raw, &imported);
            self.node.observed().paths.opened(path, offer.handle.len);
            // Boxed where it is made (see `IncomingLeases`).
            leases.push(Box::new(IncomingLease {
                imported: Some(imported),
                lease: offer.lease,
                link: self.me.clone(),
                held,
                order,
                copy: None,
                path,
                parts: lease_parts,
            }));
        }
        Ok(Ok(leases))
    }

    /// What opened offers were for: delivered to the node's inbox, the peer's call run,
    /// or the reply to our call handed to its caller.
    pub(super) fn then(
        &mut self,
        then: Then<Attached>,
        opened: Opened<IncomingLeases>,
        slot: Option<OwnedSemaphorePermit>,
        ctx: &mut Context<Self>,
    ) -> Result<(), ActorError> {
        probe!("link.opened");
        match then {
            Then::Deliver => {
                // A refusal was logged and given back already.
                if let Ok(leases) = opened {
                    for lease in leases {
                        self.node.deliver_offer(self.peer.process, lease);
                    }
                }
                Ok(())
            }
            Then::Call {
                id,
                target,
                type_name,
                payload,
            } => self.run_call(id, &target, &type_name, &payload, opened, slot, ctx),
            Then::Reply { caller, bytes } => {
                probe!("link.reply");
                let result = match opened {
                    Ok(leases) => Ok(IncomingPayload { bytes, leases }),
                    Err(e) => Err(ActorError::OfferRefused(e)),
                };
                // The caller may have given up waiting; its leases are then released on drop.
                let _ = caller.send(result);
                Ok(())
            }
        }
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "the parts of one call, handed on from the open that preceded it"
    )]
    fn run_call(
        &mut self,
        id: u64,
        target: &str,
        type_name: &str,
        payload: &[u8],
        opened: Opened<IncomingLeases>,
        slot: Option<OwnedSemaphorePermit>,
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
                probe!("link.invoked");
                // The call keeps its slot until it is answered: at the limit, reading pauses.
                self.answering += 1;
                ctx.spawn(answer.into_actor(self).map(move |res, act, ctx| {
                    probe!("link.answer");
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
}
