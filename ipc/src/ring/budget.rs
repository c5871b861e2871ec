//! How many ring ends a process maps at once: a bound on the memory and descriptors that
//! rings take, so that a process of many links keeps the links past it on the socket.
//!
//! Every end — a reader this process created, a writer it opened from a peer's offer —
//! holds a [`Slot`] of the process-wide budget for as long as its mapping lives. When none
//! is left, [`RingReader::create`](super::RingReader::create) and
//! [`RingWriter::open`](super::RingWriter::open) fail with
//! [`RingError::TooMany`](super::RingError::TooMany), and a link that wanted the ring stays
//! on the socket (it offers none, or declines the peer's: `RingDeclined`, at which the peer
//! drops the ring it offered, and with it that ring's slot of its own budget).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The environment variable that sets [`max_ends`]: a number of ring ends (`0`: no rings).
pub const MAX_ENDS_ENV: &str = "BATON_LINK_RINGS_MAX";

/// The ring ends a process maps at most unless [`MAX_ENDS_ENV`] says otherwise: 64, that is
/// 32 links with a ring each way — at the default capacity 16 MiB of mapped memory and
/// 128 eventfds.
pub const DEFAULT_MAX_ENDS: usize = 64;

/// A count of live ring ends.
pub(super) struct Budget {
    live: AtomicUsize,
}

/// One live ring end's share of a [`Budget`]; given back on drop.
pub(super) struct Slot(&'static Budget);

impl Budget {
    pub(super) const fn new() -> Self {
        Self {
            live: AtomicUsize::new(0),
        }
    }

    /// A slot, if fewer than `limit` are taken.
    pub(super) fn take(&'static self, limit: usize) -> Option<Slot> {
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |live| {
                (live < limit).then_some(live + 1)
            })
            .ok()
            .map(|_| Slot(self))
    }

    fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// This process's budget of ring ends.
pub(super) static ENDS: Budget = Budget::new();

/// The most ring ends this process maps at once: [`MAX_ENDS_ENV`] where it is a number,
/// else [`DEFAULT_MAX_ENDS`]. Read once per process.
pub fn max_ends() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        max_from(std::env::var(MAX_ENDS_ENV).ok().as_deref()).unwrap_or_else(|bad| {
            tracing::warn!(
                value = bad,
                "{MAX_ENDS_ENV} is not a number of ring ends: ignored"
            );
            DEFAULT_MAX_ENDS
        })
    })
}

/// The ring ends this process maps now.
pub fn live_ends() -> usize {
    ENDS.live()
}

/// The limit a value of [`MAX_ENDS_ENV`] asks for: unset or empty, the default; a number,
/// that; anything else, `Err` with it.
fn max_from(value: Option<&str>) -> Result<usize, &str> {
    match value.map(str::trim) {
        None | Some("") => Ok(DEFAULT_MAX_ENDS),
        Some(v) => v.parse().map_err(|_| v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_and_given_back() {
        static B: Budget = Budget::new();
        let a = B.take(2).expect("the first of two");
        let b = B.take(2).expect("the second of two");
        assert!(B.take(2).is_none(), "no third");
        assert_eq!(B.live(), 2);
        drop(a);
        let c = B.take(2).expect("one given back");
        assert!(B.take(2).is_none());
        drop((b, c));
        assert_eq!(B.live(), 0);
        assert!(B.take(0).is_none(), "a limit of 0: none");
    }

    #[test]
    fn the_limit_of_the_environment() {
        assert_eq!(max_from(None), Ok(DEFAULT_MAX_ENDS));
        assert_eq!(max_from(Some(" ")), Ok(DEFAULT_MAX_ENDS));
        assert_eq!(max_from(Some("8")), Ok(8));
        assert_eq!(max_from(Some("0")), Ok(0));
        assert_eq!(max_from(Some("lots")), Err("lots"));
        assert_eq!(max_from(Some("-1")), Err("-1"));
    }
}
