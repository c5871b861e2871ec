//! The order of a host link's messages: [`HeldBack`], without I/O (the session's: see
//! [`LinkSession::hold`](super::LinkSession::hold)).
//!
//! Over a host link a message's buffers are copies, received through the engines while the
//! link goes on reading (its pings, releases, pulls and rendezvous must keep flowing, or a
//! copy waiting for its own `Pull` — or the heartbeat — could wait forever). The
//! user-visible messages — calls, replies, bare offers — are nevertheless handed on in the
//! order they were read, as over a Unix link: each takes a turn as it is read
//! ([`admit`](HeldBack::admit)), and one that is ready (its copies landed or failed, or it
//! had none) waits for the turns before it ([`ready`](HeldBack::ready)).
//!
//! What waits is the peer's doing, so it is bounded: at most
//! [`LinkLimits::held_messages`](crate::LinkLimits::held_messages) messages and
//! [`LinkLimits::held_bytes`](crate::LinkLimits::held_bytes) bytes of their payloads may wait
//! behind one not handed on yet; one more is the peer's fault
//! ([`ActorError::TooManyHeld`]), and its link is cut. (Copies in flight are bounded apart,
//! by `LinkLimits::copy_bytes`; calls also by the call slots they hold while they wait.)

use crate::error::ActorError;
use std::collections::BTreeMap;

/// A message's turn: its place in the link's order, and the payload bytes it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Turn {
    seq: u64,
    bytes: usize,
}

/// The user-visible messages of a link read and not handed on yet (see the module docs);
/// `T` is what handing one on takes.
#[derive(Debug)]
pub(crate) struct HeldBack<T> {
    /// The turn of the next message read.
    next_in: u64,
    /// The turn of the next message to hand on.
    next_out: u64,
    /// Messages ready, waiting for the turns before theirs.
    ready: BTreeMap<u64, (T, usize)>,
    /// Payload bytes of the messages read and not handed on.
    bytes: usize,
}

impl<T> Default for HeldBack<T> {
    fn default() -> Self {
        Self {
            next_in: 0,
            next_out: 0,
            ready: BTreeMap::new(),
            bytes: 0,
        }
    }
}

impl<T> HeldBack<T> {
    /// A message of `bytes` payload bytes was read: its turn. One that would wait behind
    /// others past the bounds is refused.
    ///
    /// # Errors
    /// [`ActorError::TooManyHeld`]: the peer's fault.
    pub(crate) fn admit(
        &mut self,
        bytes: usize,
        max_messages: usize,
        max_bytes: usize,
    ) -> Result<Turn, ActorError> {
        let waiting = (self.next_in - self.next_out) as usize;
        if waiting > 0 && (waiting >= max_messages || self.bytes.saturating_add(bytes) > max_bytes)
        {
            return Err(ActorError::TooManyHeld {
                messages: waiting,
                bytes: self.bytes,
                max_messages,
                max_bytes,
            });
        }
        let turn = Turn {
            seq: self.next_in,
            bytes,
        };
        self.next_in += 1;
        self.bytes += bytes;
        Ok(turn)
    }

    /// The message of `turn` is ready to hand on as `item`: what may be handed on now, in
    /// order (nothing while a turn before it is not ready).
    pub(crate) fn ready(&mut self, turn: Turn, item: T) -> Vec<T> {
        self.ready.insert(turn.seq, (item, turn.bytes));
        let mut out = Vec::new();
        while let Some((item, bytes)) = self.ready.remove(&self.next_out) {
            self.next_out += 1;
            self.bytes -= bytes;
            out.push(item);
        }
        out
    }

    /// Messages read and not handed on now.
    pub(crate) fn waiting(&self) -> usize {
        (self.next_in - self.next_out) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_ready_early_waits_for_the_ones_read_before_it() {
        let mut held = HeldBack::default();
        let big = held.admit(10, 8, 1 << 20).unwrap();
        let small = held.admit(3, 8, 1 << 20).unwrap();
        let third = held.admit(0, 8, 1 << 20).unwrap();
        assert!(held.ready(small, "small").is_empty(), "behind the big one");
        assert!(held.ready(third, "third").is_empty());
        assert_eq!(held.waiting(), 3);
        assert_eq!(held.ready(big, "big"), vec!["big", "small", "third"]);
        assert_eq!(held.waiting(), 0);
        // Nothing ahead: at once.
        let next = held.admit(5, 8, 1 << 20).unwrap();
        assert_eq!(held.ready(next, "next"), vec!["next"]);
    }

    #[test]
    fn what_waits_is_bounded_in_messages_and_bytes() {
        let mut held = HeldBack::default();
        let first = held.admit(100, 3, 1000).unwrap();
        let _second = held.admit(100, 3, 1000).unwrap();
        let _third = held.admit(100, 3, 1000).unwrap();
        let e = held.admit(0, 3, 1000).unwrap_err();
        assert!(
            matches!(e, ActorError::TooManyHeld { messages: 3, .. }),
            "{e:?}"
        );
        assert!(e.is_peer_fault());
        assert_eq!(held.ready(first, ()), vec![()]);
        // Bytes: 200 wait; 801 more would pass 1000.
        let e = held.admit(801, 8, 1000).unwrap_err();
        assert!(
            matches!(e, ActorError::TooManyHeld { bytes: 200, .. }),
            "{e:?}"
        );
        held.admit(800, 8, 1000).unwrap();
        // The first message never waits, whatever its size (copies are bounded apart).
        let mut fresh = HeldBack::<()>::default();
        fresh.admit(1 << 30, 1, 1).unwrap();
    }
}
