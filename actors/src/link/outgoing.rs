//! The link's outgoing side: the queue of frames (drained in batches by the transport's
//! writer, [`Writer::drain`](crate::transport::Writer::drain)), the bound on what the peer
//! lets pile up, and the lease grants that go with our calls
//! and replies (all or none, undone if the frame is never sent).

use super::PeerLink;
use crate::buffer::Outgoing;
use crate::error::ActorError;
use crate::exports::OfferGrant;
use crate::link_ref::CancelCall;
use crate::remote::{Encoded, OutCall};
use crate::transport::OutFrame;
use actix::prelude::*;
use baton_messages::Message as Wire;
use baton_messages::codec::{MAX_FDS_PER_FRAME, encode_call_frame, encode_frame};
use baton_messages::protocol::{CallFault, CallRef, Offer, Payload, Reply};
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use tokio::sync::OwnedSemaphorePermit;

/// Leases granted for one frame: its offers, the descriptors that go with them, and what
/// undoing each grant takes.
struct Granted {
    offers: Vec<Offer>,
    fds: Vec<OwnedFd>,
    grants: Vec<OfferGrant>,
}

/// Emptied offer and grant lists kept for the next call (see `PeerLink::spare`).
#[derive(Default)]
pub(super) struct Spare {
    offers: Vec<Offer>,
    grants: Vec<OfferGrant>,
}

impl Spare {
    /// The most entries a list kept may have room for: a call with more buffers gives its
    /// lists back to the allocator, so one large call does not keep its memory.
    const KEEP: usize = 64;

    /// Keeps `offers` and `grants`, emptied, unless they are larger than [`Self::KEEP`].
    fn keep(&mut self, mut offers: Vec<Offer>, mut grants: Vec<OfferGrant>) {
        if offers.capacity() <= Self::KEEP && grants.capacity() <= Self::KEEP {
            offers.clear();
            grants.clear();
            self.offers = offers;
            self.grants = grants;
        }
    }
}

impl PeerLink {
    /// Queues a frame of ours that answers the peer or runs the protocol (a reply, a
    /// release, a pong…). Fails with [`ActorError::PeerNotReading`] when the queue is past
    /// its bound: the peer makes us write and does not read.
    pub(crate) fn send(&mut self, msg: &Wire, fds: Vec<OwnedFd>) -> Result<(), ActorError> {
        let bytes = self.encode(msg, fds.len())?;
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

    pub(super) fn encode(&self, msg: &Wire, fds: usize) -> Result<Vec<u8>, ActorError> {
        let mut bytes = self.me.state.frames.take();
        encode_frame(msg, fds, &mut bytes).map_err(baton_ipc::Error::from)?;
        Ok(bytes)
    }

    fn enqueue(
        &mut self,
        bytes: Vec<u8>,
        fds: Vec<OwnedFd>,
        window: Option<OwnedSemaphorePermit>,
    ) -> Result<(), ActorError> {
        let closed = || ActorError::link_closed(self.peer.process);
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

    /// Grants the peer a lease on each buffer; all or none.
    fn grant_all(&mut self, cells: &[Outgoing]) -> Result<Granted, ActorError> {
        let mut offers = std::mem::take(&mut self.spare.offers);
        let mut grants = std::mem::take(&mut self.spare.grants);
        offers.reserve(cells.len());
        grants.reserve(cells.len());
        let mut fds = Vec::new();
        let mut failure = None;
        // The fence of the offer before, for a part of its lease to take.
        let mut before = None;
        for (i, out) in cells.iter().enumerate() {
            if self.copies() {
                match self.grant_copy(out) {
                    Ok((offer, grant)) => {
                        offers.push(offer);
                        grants.push(grant);
                        continue;
                    }
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            let cell = &out.cell;
            if fds.len() >= MAX_FDS_PER_FRAME && cell.alloc.export_fd().is_some() {
                failure = Some(ActorError::TooManyDescriptors {
                    count: fds.len() + 1,
                    max: MAX_FDS_PER_FRAME,
                });
                break;
            }
            let granted = out
                .acquire_fence_after(
                    &self.peer.process,
                    &mut before,
                    cells.get(i + 1).is_some_and(|next| next.joins),
                )
                .and_then(|fence| {
                    self.node.exports().grant(
                        cell,
                        out.part.as_ref(),
                        out.writable,
                        &self.me,
                        fds.len() as u8,
                        fence,
                        // A part of the lease of the offer before it: that offer names it.
                        offers.last().map(|o: &Offer| o.lease).filter(|_| out.joins),
                    )
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
            self.copy_unsent(offer.lease);
            self.node.exports().ungrant(*grant, self.me.id);
        }
    }

    pub(super) fn send_reply(
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
        let bytes = match self.encode(&Wire::Reply(Reply { id, outcome }), fds.len()) {
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
        match sent {
            Ok(()) => self.granted_paths(&offers),
            Err(_) => self.ungrant(&offers, &grants),
        }
        sent
    }

    /// Counts the leases of offers that left (see [`paths`](crate::paths)), by the path
    /// each was offered as.
    pub(super) fn granted_paths(&self, offers: &[Offer]) {
        let paths = &self.node.observed().paths;
        for offer in offers {
            paths.granted(
                crate::paths::LeasePath::offered(&offer.handle.raw),
                offer.handle.len,
            );
        }
    }
}

impl Handler<OutCall> for PeerLink {
    type Result = ();

    fn handle(&mut self, msg: OutCall, _ctx: &mut Self::Context) {
        probe!("link.call");
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
        // Encoded from its parts where they are: no copy of the names, payload or offers.
        let call = CallRef {
            id,
            target: &msg.target,
            type_name: &msg.type_name,
            payload: &msg.encoded.bytes,
            offers: &offers,
        };
        let mut bytes = self.me.state.frames.take();
        let queued = encode_call_frame(call, fds.len(), &mut bytes)
            .map_err(|e| ActorError::from(baton_ipc::Error::from(e)))
            .and_then(|()| self.enqueue(bytes, fds, Some(msg.window)));
        match queued {
            Ok(()) => {
                probe!("link.call.queued");
                self.granted_paths(&offers);
                tracing::trace!(call = id, leases = grants.len(), "call sent");
                self.session.call_sent(id, msg.reply);
            }
            Err(e) => {
                self.ungrant(&offers, &grants);
                let _ = msg.reply.send(Err(e));
            }
        }
        self.spare.keep(offers, grants);
    }
}

impl Handler<CancelCall> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: CancelCall, _ctx: &mut Self::Context) {
        self.session.cancel(msg.0);
    }
}
