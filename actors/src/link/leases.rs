//! The lease protocol's messages besides the frames the session checks: a release of the
//! peer's handed to the ledger (with its fences opened ahead), our guards' releases, the
//! revokes, unmaps and evictions the ledger and the cache ask for, and the fence inbox
//! lane the peer lends us.

use super::PeerLink;
use crate::buffer::HeldLease;
use crate::error::ActorError;
use crate::link_ref::{LinkCommand, Notice, ReleaseLease};
use crate::link_session::{CopyReleased, ReleaseRoute};
use actix::prelude::*;
use baton_ipc::{CacheKey, HolderId};
use baton_messages::protocol::Release;
use baton_messages::{AllocationId, FenceHandle, InboxGrant, LeaseId, Message as Wire};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

impl PeerLink {
    /// The peer released a lease we granted: one we passed on goes to its exporter, else
    /// the ledger checks it and takes its release fences (each checked first).
    pub(super) fn on_release(
        &mut self,
        lease: LeaseId,
        fences: Vec<FenceHandle>,
        route: ReleaseRoute<super::Attached>,
    ) -> Result<(), ActorError> {
        probe!("link.release.in");
        tracing::trace!(%lease, fences = fences.len(), route = route.name(), "released");
        let sending = match route {
            ReleaseRoute::Local => None,
            // A lease we forwarded: handed on to its exporter (see `relay`).
            ReleaseRoute::Passed if self.release_passed(lease) => return Ok(()),
            ReleaseRoute::Passed => None,
            // A forward's copy: its caller hears whether it landed (no ledger of ours
            // counts it).
            ReleaseRoute::Copy(CopyReleased::Forward { waiter, sending }) => {
                let within = self.node.heartbeat().deadline;
                crate::host_copies::forward_released(lease, waiter, sending, within);
                return Ok(());
            }
            // A copy's lease comes back once its bytes landed — or early, from a faulty or
            // hostile receiver, while the engine still reads the buffer: then it ends only
            // once the send stopped and the engine let go (below).
            ReleaseRoute::Copy(CopyReleased::Copy { sending }) => {
                crate::host_copies::still_sending(sending)
            }
        };
        for fence in &fences {
            self.node
                .backend()
                .ordering()
                .check_fence(&self.peer.process, fence)?;
        }
        // Opened on the driver thread now, so that the buffer's next use (on whatever
        // thread) finds the importer's events open. Counter fences and events open
        // already need nothing: no job, no wakeup of the driver thread.
        let ordering = self.node.backend().ordering();
        let ahead: Vec<FenceHandle> = fences
            .iter()
            .filter(|fence| !ordering.fence_prepared(&self.peer.process, fence))
            .cloned()
            .collect();
        if !ahead.is_empty() && !self.node.offload().is_inline() {
            let (backend, peer) = (Arc::clone(self.node.backend()), self.peer.process);
            self.node.offload().submit(move || {
                for fence in &ahead {
                    if let Err(e) = backend.ordering().prepare_fence(&peer, fence) {
                        tracing::debug!(error = %e, "could not open a release fence ahead of its wait");
                    }
                }
            });
        }
        let Some(sending) = sending else {
            return self.node.exports().release(lease, self.me.id, fences);
        };
        tracing::debug!(%lease, "a copy's lease came back before its send finished: it ends once the engine lets go");
        let (exports, me) = (Arc::clone(self.node.exports()), self.me.clone());
        let grace = self.limits.early_release_grace;
        tokio::task::spawn_blocking(move || {
            // A receiver whose bytes landed releases before we may have heard that our
            // send finished: it finishes within the grace. Else the receiver wants no more
            // of it and the send stops (an abort returns once no engine thread touches the
            // buffer, or says it still does after its bound; a finished send's returns at
            // once, stopping nothing).
            if sending.wait(grace).is_err() && !sending.is_finished() {
                tracing::debug!(%lease, ?grace, "a copy released early is still sending after the grace: stopped");
            }
            if !sending.abort() {
                while !sending.wait_untouched(Duration::from_secs(60)) {}
            }
            drop(sending);
            if let Err(e) = exports.release(lease, me.id, fences) {
                // The link may have ended meanwhile (its leases are back already): the
                // cut then goes nowhere.
                me.do_send(crate::link_ref::CutOff(e));
            }
        });
        Ok(())
    }

    /// The exporter asks for a lease back: the holder of one we hold hears it (and the
    /// node's watchers); one we forwarded is asked of its holder (see `relay`). Else a
    /// revoke of a lease we already released crossed our `Release`: nothing to do.
    pub(super) fn on_revoke(
        &mut self,
        lease: LeaseId,
        deadline_ms: u32,
        held: Option<Weak<HeldLease>>,
    ) {
        if let Some(held) = held.as_ref().and_then(Weak::upgrade) {
            let within = Duration::from_millis(deadline_ms.into());
            held.request_revoke(within);
            self.node.notify_revoke(crate::node_core::RevokeRequested {
                peer: self.peer.process,
                lease,
                within,
            });
        } else {
            self.revoke_passed(lease, deadline_ms);
        }
    }

    /// The exporter asks us to close our mapping of `alloc`: answer `Unmapped` once no
    /// lease of ours uses it (at once if none does).
    pub(super) fn unhold(
        &mut self,
        alloc: AllocationId,
        mapping: &CacheKey,
        ctx: &mut Context<Self>,
    ) {
        let addr = ctx.address();
        self.node.cache().unhold(
            mapping,
            self.me.holder(),
            Box::new(move || addr.do_send(LinkCommand::from(Notice::Unmapped(alloc)))),
        );
    }

    /// The peer closed its mapping of our `alloc`.
    pub(super) fn on_unmapped(&mut self, alloc: AllocationId) {
        // One that matches no hold crossed a failed open: harmless.
        if !self.node.exports().unmapped(self.me.id, alloc) {
            tracing::debug!(%alloc, "Unmapped for no hold");
        }
    }

    /// The peer lends us a lane of its fence inbox: fences we record for it go there. Its
    /// inbox is mapped on the driver thread (a fence recorded before that maps it then).
    pub(super) fn accept_inbox(&mut self, grant: InboxGrant) {
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
    }
}

impl Handler<ReleaseLease> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: ReleaseLease, ctx: &mut Self::Context) {
        probe!("link.release");
        // A copy to another host still reads the buffer: its `Release` waits for it.
        let Some(msg) = self.me.state.defer_release(msg) else {
            tracing::debug!(parent: &self.span, "a lease's release waits for the copies that read it");
            return;
        };
        let ReleaseLease {
            lease,
            fences,
            pending,
        } = msg;
        let relayed = self.session.released(lease);
        self.me
            .state
            .held_leases
            .store(self.session.held(), Ordering::Relaxed);
        match pending {
            None => self.release_now(lease, fences, relayed, ctx),
            Some(pending) => {
                let waited = self.node.offload().run(move || pending.wait());
                ctx.spawn(waited.into_actor(self).map(move |_, act, ctx| {
                    act.release_now(lease, fences, relayed, ctx);
                }));
            }
        }
    }
}

impl PeerLink {
    /// Sends `Release` of a lease whose uses are over — for a relayed lease, once its
    /// mapping is closed (see `relay`).
    fn release_now(
        &mut self,
        lease: LeaseId,
        fences: Vec<FenceHandle>,
        relayed: Option<(CacheKey, HolderId)>,
        ctx: &mut Context<Self>,
    ) {
        if let Some(own) = relayed {
            return self.release_relayed(lease, fences, own);
        }
        if let Err(e) = self.send(&Wire::Release(Release { lease, fences }), Vec::new()) {
            self.cut(ctx, e);
        }
    }
}

impl Handler<Notice> for PeerLink {
    type Result = ();
    fn handle(&mut self, notice: Notice, ctx: &mut Self::Context) {
        let _g = self.span.clone().entered();
        let Some(frame) = self.session.notice(notice) else {
            return;
        };
        if let Err(e) = self.send(&frame, Vec::new()) {
            drop(_g);
            self.cut(ctx, e);
        }
    }
}
