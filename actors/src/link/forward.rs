//! The link's side of forwarding (see [`relay`](crate::relay) for the design): B asks
//! its exporter for a lease on a third process's behalf and passes the offer on; A grants
//! it; C checks a relayed offer, and gives it back only once its mapping is closed. The
//! calls that start a forward ([`Peer::forward`](crate::Peer::forward)) are
//! [`forwarding`](crate::forwarding)'s.
//!
//! **No local handle crosses a host link** (issue 45, finding 4). A zero-copy forward
//! hands the holder the exporter's real handle (a segment name, a descriptor, a CUDA IPC
//! handle), which only means something on the exporter's host, and pins the buffer until
//! the named holder — a process of the exporter's host, named by the asker — dies. So:
//!
//! - A `Forward` that arrives over a host link is refused before anything is looked up
//!   (by the session: [`HOST_LINK_FORWARD`], answered as a `Forwarded` refusal, which the asker sees as
//!   [`ActorError::ForwardRefused`]): nothing is granted, watched or pinned, and the link
//!   stays (an honest node sends one when it forwards a *copy* it received from another
//!   host to a peer of its own host; the copy is its own memory: send it as a buffer).
//! - A `Forwarded` offer that arrives over a host link is that link's fault
//!   ([`ActorError::Unexpected`], the session's check): no node sends one, and its handle
//!   would name memory of another host.
//! - A relayed offer is never passed on over a host link ([`PassOn`] refuses it): a
//!   forward *to* another host is a copy (`Peer::forward` → `forward_copy`).
//!
//! The other paths that carry handles were checked for the same rule: a link's own offers
//! to a host-link peer are always copies (`grant_all` → `grant_copy`, which replaces the
//! handle with [`RawHandle::Copy`](baton_messages::RawHandle::Copy) and drops the
//! descriptor); `Revoke`, `Unmap`, `Release` and the copy protocol's frames carry lease ids
//! only.

use super::PeerLink;
use crate::error::ActorError;
use crate::link_ref::{AskForward, GiveBack, LinkRef, Notice, PassOn};
use crate::link_session::HOST_LINK_FORWARD;
use actix::prelude::*;
use baton_ipc::{CacheKey, FrameFds, HolderId};
use baton_messages::protocol::{Forward, Forwarded, Offer, Relayed, Release};
use baton_messages::{FenceHandle, LeaseId, Message as Wire};
use std::time::Duration;
use tokio::sync::oneshot;

/// B: a forward we asked the exporter for, awaiting its answer (kept by the session).
pub(crate) struct Asked {
    /// The link to the process the offer is for.
    downstream: LinkRef,
    /// Who waits for the lease id it gets there.
    pub(super) reply: oneshot::Sender<Result<LeaseId, ActorError>>,
}

impl Handler<AskForward> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: AskForward, ctx: &mut Self::Context) {
        let (id, forward) = self.session.ask_forward(msg.lease, msg.to);
        tracing::debug!(parent: &self.span, lease = %msg.lease, to = %msg.to, "asking to forward");
        match self.send(&forward, Vec::new()) {
            Ok(()) => {
                let asked = Asked {
                    downstream: msg.downstream,
                    reply: msg.reply,
                };
                self.session.await_forward(id, asked);
            }
            Err(e) => {
                let _ = msg
                    .reply
                    .send(Err(ActorError::link_closed(self.peer.process)));
                self.cut(ctx, e);
            }
        }
    }
}

impl Handler<PassOn> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: PassOn, ctx: &mut Self::Context) {
        let PassOn {
            offer,
            fd,
            give_back,
            reply,
        } = msg;
        if self.peer.host().is_some() {
            // A relayed offer carries a local handle: never onto a host link (a forward
            // there is a copy). `give_back` returns the lease.
            let _ = reply.send(Err(ActorError::ForwardRefused {
                reason: HOST_LINK_FORWARD.to_owned(),
            }));
            return;
        }
        let ours = crate::ids::next_lease();
        let theirs = give_back.lease;
        self.node
            .relays()
            .lock()
            .passed
            .insert((self.me.id, ours), (give_back.upstream.clone(), theirs));
        self.session.passed_on(ours);
        let relayed = Wire::Relayed(Box::new(Relayed {
            offer: Offer {
                lease: ours,
                handle: offer.handle,
            },
        }));
        match self.send(&relayed, fd.into_iter().collect()) {
            Ok(()) => {
                // Passed on: it comes back with the holder's `Release`, or ends with it.
                std::mem::forget(give_back);
                tracing::debug!(parent: &self.span, lease = %ours, exporter_lease = %theirs, "forwarded");
                let _ = reply.send(Ok(ours));
            }
            Err(e) => {
                self.node.relays().take_passed(self.me.id, ours);
                self.session.pass_failed(ours);
                drop(give_back);
                let _ = reply.send(Err(ActorError::link_closed(self.peer.process)));
                self.cut(ctx, e);
            }
        }
    }
}

impl PeerLink {
    /// A: the peer asks us to lease the buffer of its `lease` to a third process (one the
    /// session did not refuse on sight). A refusal is answered, not a fault: the lease may
    /// have crossed a revoke.
    pub(crate) fn on_forward(&mut self, forward: Forward) -> Result<(), ActorError> {
        let Forward { id, lease, to } = forward;
        let granted =
            self.node
                .exports()
                .grant_relayed(lease, &self.me, to, self.limits.leases_held);
        match granted {
            Ok((offer, fd)) => {
                let new = offer.lease;
                let (path, bytes) = (
                    crate::paths::LeasePath::offered(&offer.handle.raw),
                    offer.handle.len,
                );
                // Before the offer leaves: a holder already dead is reported at once, and
                // its lease ends then.
                self.node.watch(to);
                tracing::debug!(%lease, forwarded = %new, %to, "forwarding");
                let answer = Wire::Forwarded(Box::new(Forwarded {
                    id,
                    outcome: Ok(offer),
                }));
                let sent = self.send(&answer, fd.into_iter().collect());
                if sent.is_ok() {
                    self.node.observed().paths.granted(path, bytes);
                }
                if sent.is_err() {
                    self.node.exports().ungrant(
                        crate::exports::OfferGrant {
                            lease: new,
                            ledger: crate::ledger::Grant { new_hold: false },
                            pool: None,
                        },
                        self.me.id,
                    );
                }
                sent
            }
            Err(e) => {
                tracing::debug!(%lease, %to, error = %e, "refused to forward");
                let answer = Wire::Forwarded(Box::new(Forwarded {
                    id,
                    outcome: Err(e.to_string()),
                }));
                self.send(&answer, Vec::new())
            }
        }
    }

    /// B: the exporter's answer to a forward of ours, checked by the session (asked, and
    /// an offer of the peer's own buffer): the offer goes on to the process it is for, or
    /// back at once when nobody waits for it any more.
    pub(crate) fn on_forwarded(
        &mut self,
        pending: Asked,
        outcome: Result<Offer, String>,
        mut fds: FrameFds,
    ) {
        let offer = match outcome {
            Ok(offer) => offer,
            Err(reason) => {
                let _ = pending
                    .reply
                    .send(Err(ActorError::ForwardRefused { reason }));
                return;
            }
        };
        let give_back = GiveBack {
            upstream: self.me.clone(),
            lease: offer.lease,
        };
        let fd = match offer.handle.raw.fd_slot() {
            Some(slot) => match fds.take(slot) {
                Ok(fd) => Some(fd),
                Err(e) => {
                    let _ = pending.reply.send(Err(e.into()));
                    // `give_back` returns the lease.
                    return;
                }
            },
            None => None,
        };
        if pending.reply.is_closed() || !pending.downstream.is_alive() {
            let _ = pending
                .reply
                .send(Err(ActorError::link_closed(pending.downstream.peer())));
            return;
        }
        pending.downstream.do_send(PassOn {
            offer,
            fd,
            give_back,
            reply: pending.reply,
        });
    }

    /// B: a `Release` over this link of a lease we passed on: hand it on to the exporter,
    /// without fences. The holder sends it only once its mapping is closed, after its own
    /// work on it completed (see `docs/FORWARDING.md`), so nothing is left to wait for —
    /// and its fences lie in *our* inbox, where the exporter could not wait on them.
    /// Returns whether it was one.
    pub(crate) fn release_passed(&mut self, lease: LeaseId) -> bool {
        let Some((upstream, theirs)) = self.node.relays().take_passed(self.me.id, lease) else {
            return false;
        };
        if upstream.is_alive() {
            upstream.do_send(Notice::Release(Release::now(theirs)));
        }
        true
    }

    /// B: the exporter asks back a lease we passed on: ask its holder (nothing if it is
    /// not one).
    pub(crate) fn revoke_passed(&mut self, lease: LeaseId, deadline_ms: u32) {
        let node = self.node.clone();
        let relays = node.relays();
        let found = {
            let state = relays.lock();
            state
                .passed
                .iter()
                .find(|(_, (up, theirs))| up.id == self.me.id && *theirs == lease)
                .map(|((down, ours), _)| (*down, *ours))
        };
        let Some((down, ours)) = found else {
            return;
        };
        if let Some(peer) = self.node.peers().into_iter().find(|p| p.link.id == down) {
            peer.link.do_send(Notice::Revoke {
                lease: ours,
                within: Duration::from_millis(deadline_ms.into()),
            });
        }
    }

    /// C: a relayed lease's guard dropped: its own hold on the mapping is let go, and
    /// its `Release` goes once the mapping is closed.
    pub(crate) fn release_relayed(
        &mut self,
        lease: LeaseId,
        fences: Vec<FenceHandle>,
        (key, holder): (CacheKey, HolderId),
    ) {
        let me = self.me.clone();
        self.node.cache().unhold(
            &key,
            holder,
            Box::new(move || me.do_send(Notice::Release(Release { lease, fences }))),
        );
    }
}
