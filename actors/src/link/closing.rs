//! How a link ends besides a fault: the writer finding the socket gone (the reader's
//! verdict first), a cut asked by the node, a close that flushes what is owed to the peer
//! first, and the peer's process dying.

use super::PeerLink;
use crate::error::ActorError;
use crate::link_ref::{Close, CutOff, PeerDied};
use actix::prelude::*;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The writer failed: the socket is gone.
#[derive(Message)]
#[rtype(result = "()")]
pub(super) struct LinkFailed {
    pub(super) error: baton_ipc::Error,
    /// How many times the verdict was left to the reader already.
    pub(super) deferred: u8,
}

/// How many times (100 ms apart) a writer's "closed" waits for the reader's verdict.
const READER_VERDICT_TRIES: u8 = 10;

impl Handler<LinkFailed> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: LinkFailed, ctx: &mut Self::Context) {
        match msg.error {
            baton_ipc::Error::Closed
                if msg.deferred < READER_VERDICT_TRIES && self.closer.readable_now() =>
            {
                // What the peer sent last (frames, half a frame, the end of stream) is still
                // to be read: the reader's verdict — a clean end, or `Truncated` — says how
                // the link ended, not a write that found the socket gone first.
                let deferred = msg.deferred + 1;
                self.verdict_pending = true;
                ctx.run_later(Duration::from_millis(100), move |_, ctx| {
                    ctx.address().do_send(LinkFailed {
                        error: baton_ipc::Error::Closed,
                        deferred,
                    });
                });
            }
            baton_ipc::Error::Closed => ctx.stop(),
            e => self.cut(ctx, e.into()),
        }
    }
}

impl Handler<CutOff> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: CutOff, ctx: &mut Self::Context) {
        self.cut(ctx, msg.0);
    }
}

/// How often a closing link looks whether what it owes the peer is written.
const CLOSE_POLL: Duration = Duration::from_millis(2);

impl PeerLink {
    /// Cuts a closing link once no answer to the peer's calls is under way and its queued
    /// frames are written (on the socket: the peer reads them before the end of stream), or
    /// once the close's deadline passed; looks again shortly otherwise.
    fn finish_close(&mut self, ctx: &mut Context<Self>) {
        let Some(deadline) = self.closing else {
            return;
        };
        let flushed = self.answering == 0 && self.me.state.queued.load(Ordering::Acquire) == 0;
        if flushed || Instant::now() >= deadline {
            if !flushed {
                tracing::info!(
                    answering = self.answering,
                    "closing before every answer was sent: the flush deadline passed"
                );
            }
            self.cut(ctx, ActorError::link_closed(self.peer.process));
        } else {
            ctx.run_later(CLOSE_POLL, |act, ctx| act.finish_close(ctx));
        }
    }
}

impl Handler<Close> for PeerLink {
    type Result = ();
    fn handle(&mut self, msg: Close, ctx: &mut Self::Context) {
        if self.closing.is_none() {
            self.closing = Some(Instant::now() + msg.flush);
            self.finish_close(ctx);
        }
    }
}

impl Handler<PeerDied> for PeerLink {
    type Result = ();
    fn handle(&mut self, _: PeerDied, ctx: &mut Self::Context) {
        if self.closer.readable_now() {
            // Frames or end of stream are waiting: the reader gets to them first.
            ctx.run_later(Duration::from_millis(100), |_, ctx| {
                ctx.address().do_send(PeerDied);
            });
        } else {
            self.cut(
                ctx,
                ActorError::PeerExited {
                    peer: self.peer.process,
                },
            );
        }
    }
}
