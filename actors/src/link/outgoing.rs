//! The link's outgoing side: the queue of frames and the task that writes them (batched),
//! the bound on what the peer lets pile up, and the lease grants that go with our calls
//! and replies (all or none, undone if the frame is never sent).
//!
//! A frame is written straight from the actor's turn (one non-blocking `sendmsg`) when
//! nothing is queued before it; only what the socket does not take at once goes to the
//! writer task. That saves a task wakeup per frame on each side (issue 24) and keeps the
//! order of frames: nothing is queued ahead of a direct write, and once anything is queued,
//! every later frame queues behind it until the writer has written it all.
//!
//! Where frames come in bursts the writer's batching is worth more than the saved wakeup
//! (one `sendmsg` and one wakeup of the peer for many frames): a call of ours goes through
//! the queue while other calls of ours await replies, and a reply while other calls of
//! the peer's are being answered (measured: pipelined handoffs, 256 in flight, fell from
//! about 106k/s to 88k/s on one core when every frame was written directly).
//!
//! A `Release` is queued too ([`send_queued`](PeerLink::send_queued)): it is queued
//! even when the queue is empty, because the reply to the call that carried the lease
//! usually follows it within the same burst of the actor's turns; queued, both leave in
//! one `sendmsg` and wake the peer once, where written directly they would take two of
//! each (measured: 3.0 `sendmsg`s and 3.8 `epoll_wait`s per cached round trip instead of
//! 2.0 and 3.0).

use super::PeerLink;
use crate::buffer::Outgoing;
use crate::error::ActorError;
use crate::exports::OfferGrant;
use crate::link_ref::{CancelCall, LinkState};
use crate::remote::{Encoded, OutCall};
use crate::transport::Writer;
use actix::prelude::*;
use baton_messages::Message as Wire;
use baton_messages::codec::{MAX_FDS_PER_FRAME, encode_frame};
use baton_messages::protocol::{Call, CallFault, Offer, Payload, Reply};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

/// A frame queued for the writer.
pub(super) struct OutFrame {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// For a call of ours: its share of the send window, given back once it is written.
    window: Option<OwnedSemaphorePermit>,
}

/// Leases granted for one frame: its offers, the descriptors that go with them, and what
/// undoing each grant takes.
struct Granted {
    offers: Vec<Offer>,
    fds: Vec<OwnedFd>,
    grants: Vec<OfferGrant>,
}

/// How a frame leaves (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    /// From this turn if nothing is queued before it.
    Now,
    /// Through the writer task, with what follows it.
    Queued,
}

/// The most bytes of frames one `sendmsg` carries when frames are queued back to back.
const MAX_BATCH: usize = 64 * 1024;

/// Drains the outgoing queue onto the socket. Frames queued behind the one being sent go
/// out in the same `sendmsg` (one system call, one wakeup of the peer, instead of one per
/// frame) — up to [`MAX_BATCH`] bytes, and never past a frame that carries descriptors:
/// descriptors travel with their frame's first byte, so such a frame starts a new batch.
pub(super) async fn write_loop(
    mut writer: Writer,
    mut rx: mpsc::UnboundedReceiver<OutFrame>,
    state: Arc<LinkState>,
    addr: Addr<PeerLink>,
) {
    let mut batch: Vec<u8> = Vec::with_capacity(4096);
    let mut windows: Vec<OwnedSemaphorePermit> = Vec::new();
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
        // Bytes of our calls in the batch.
        let mut calls = if first.window.is_some() {
            first.bytes.len()
        } else {
            0
        };
        windows.extend(first.window);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(frame) if frame.fds.is_empty() => {
                    batch.extend_from_slice(&frame.bytes);
                    if frame.window.is_some() {
                        calls += frame.bytes.len();
                    }
                    windows.extend(frame.window);
                }
                Ok(frame) => {
                    next = Some(frame);
                    break;
                }
                Err(_) => break,
            }
        }
        let fds: Vec<BorrowedFd<'_>> = first.fds.iter().map(|fd| fd.as_fd()).collect();
        let sent = writer.send_encoded(&batch, &fds).await;
        state.queued.fetch_sub(batch.len(), Ordering::Relaxed);
        state.queued_calls.fetch_sub(calls, Ordering::Relaxed);
        // The calls' share of the window comes back: waiting senders may queue again.
        windows.clear();
        if let Err(e) = sent {
            addr.do_send(super::closing::LinkFailed {
                error: e,
                deferred: 0,
            });
            break;
        }
    }
    // The actor dropped its sender (it stopped) or the socket failed: the peer sees the
    // end of the stream, and our reader's pending receive ends.
    writer.shutdown();
}

impl PeerLink {
    /// Queues a frame of ours that answers the peer or runs the protocol (a reply, a
    /// release, a pong…). Fails with [`ActorError::PeerNotReading`] when the queue is past
    /// its bound: the peer makes us write and does not read.
    pub(crate) fn send(&mut self, msg: &Wire, fds: Vec<OwnedFd>) -> Result<(), ActorError> {
        let bytes = Self::encode(msg, fds.len())?;
        self.room_for(bytes.len())?;
        self.enqueue(bytes, fds, None, Write::Now)
    }

    /// As [`send`](Self::send), but through the writer task even when nothing is queued:
    /// for a frame that frames sent in the next turns usually follow (a `Release`, then
    /// the reply to the call that carried the lease), so that they leave together.
    pub(crate) fn send_queued(&mut self, msg: &Wire, fds: Vec<OwnedFd>) -> Result<(), ActorError> {
        let bytes = Self::encode(msg, fds.len())?;
        self.room_for(bytes.len())?;
        self.enqueue(bytes, fds, None, Write::Queued)
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

    pub(super) fn encode(msg: &Wire, fds: usize) -> Result<Vec<u8>, ActorError> {
        let mut bytes = Vec::with_capacity(256);
        encode_frame(msg, fds, &mut bytes).map_err(baton_ipc::Error::from)?;
        Ok(bytes)
    }

    /// Sends a frame: written at once if nothing is queued before it and the socket takes
    /// it, else (what the socket did not take) queued for the writer task.
    fn enqueue(
        &mut self,
        mut bytes: Vec<u8>,
        mut fds: Vec<OwnedFd>,
        window: Option<OwnedSemaphorePermit>,
        write: Write,
    ) -> Result<(), ActorError> {
        let closed = || ActorError::LinkClosed {
            peer: self.peer.process,
        };
        let out = self.out.as_ref().ok_or_else(closed)?;
        let now = match write {
            Write::Now => self.write_now(&bytes, &fds),
            Write::Queued => None,
        };
        if let Some(taken) = now {
            if taken == bytes.len() {
                // Written: a call's share of the send window comes back now (`window`
                // drops), as the writer gives it back once it has written a frame.
                return Ok(());
            }
            // The socket took the start (and the descriptors, which go with the first
            // byte): the rest goes first in the queue, without them.
            bytes.drain(..taken);
            fds.clear();
        }
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

    /// Writes `bytes` (`fds` with the first byte) from this turn if nothing is queued or
    /// half written before them: returns how many bytes the socket took (`0` if it is
    /// full), `None` if the frame must queue (something is queued, a host link, or the
    /// write failed: the writer meets the failure too and reports it the usual way, see
    /// [`LinkFailed`](super::closing::LinkFailed)).
    ///
    /// `queued` is zero only once the writer has written every frame queued so far: it
    /// counts a frame in before the frame is queued and out only after it is written
    /// whole, and the writer task runs on this actor's thread, between its turns.
    fn write_now(&self, bytes: &[u8], fds: &[OwnedFd]) -> Option<usize> {
        let direct = self.direct.as_ref()?;
        if self.me.state.queued_bytes() != 0 {
            return None;
        }
        let fds: Vec<BorrowedFd<'_>> = fds.iter().map(|fd| fd.as_fd()).collect();
        match direct.try_send_encoded(bytes, &fds) {
            Ok(taken) => Some(taken),
            Err(e) => {
                tracing::debug!(error = %e, "a direct write failed: the writer will tell");
                None
            }
        }
    }

    /// Grants the peer a lease on each buffer; all or none.
    fn grant_all(&mut self, cells: &[Outgoing]) -> Result<Granted, ActorError> {
        let mut offers = Vec::with_capacity(cells.len());
        let mut grants = Vec::with_capacity(cells.len());
        let mut fds = Vec::new();
        let mut failure = None;
        for out in cells {
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
            let granted = out.acquire_fence(&self.peer.process).and_then(|fence| {
                self.node
                    .exports()
                    .grant(cell, &self.me, fds.len() as u8, fence, out.writable)
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
            self.copy_done(offer.lease, true);
            self.node.exports().ungrant(offer.lease, *grant, self.me.id);
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
        let bytes = match Self::encode(&Wire::Reply(Reply { id, outcome }), fds.len()) {
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
        // Other answers under way: a burst, batched by the writer.
        let write = if self.answering > 0 {
            Write::Queued
        } else {
            Write::Now
        };
        let sent = self
            .room_for(bytes.len())
            .and_then(|()| self.enqueue(bytes, fds, None, write));
        if sent.is_err() {
            self.ungrant(&offers, &grants);
        }
        sent
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
        let call = Wire::Call(Call {
            id,
            target: msg.target.to_string(),
            type_name: msg.type_name.to_string(),
            payload: msg.encoded.bytes,
            offers,
        });
        // Other calls of ours awaiting replies (each caller holds a slot of
        // `pending_calls` until its reply): a burst, batched by the writer.
        let others = self
            .limits
            .pending_calls
            .saturating_sub(self.me.state.pending_calls.available_permits() + 1);
        let write = if others > 0 {
            Write::Queued
        } else {
            Write::Now
        };
        let queued = Self::encode(&call, fds.len()).and_then(|bytes| {
            // Before the frame is written (directly, from here, or by the writer).
            probe!("link.call.queued");
            self.enqueue(bytes, fds, Some(msg.window), write)
        });
        match queued {
            Ok(()) => {
                tracing::trace!(call = id, leases = grants.len(), "call sent");
                self.session.call_sent(id, msg.reply);
            }
            Err(e) => {
                let Wire::Call(call) = call else {
                    unreachable!("built just above")
                };
                self.ungrant(&call.offers, &grants);
                let _ = msg.reply.send(Err(e));
            }
        }
    }
}

impl Handler<CancelCall> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: CancelCall, _ctx: &mut Self::Context) {
        self.session.cancel(msg.0);
    }
}
