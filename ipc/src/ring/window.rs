//! How long a ring's reader polls before it sleeps: a state machine without a clock.

use std::time::Duration;

/// A reader's self-tuning poll window: how long it polls the ring for the next entry before
/// it announces its sleep and blocks on the doorbell.
///
/// A pure state machine: the caller measures each *gap* (from the start of a wait to the
/// entry that ended it) and feeds it to [`observe`](Self::observe):
/// - a *hit* (the gap within the window) keeps the window;
/// - a *miss* halves it (below [`FLOOR`](Self::FLOOR) it is zero: not worth a spin);
/// - a window of zero that sees a gap of at most half its maximum *explores*: the window
///   becomes twice that gap, so that the next entry after such a gap is caught polling.
///
/// It starts at zero (the first wait sleeps and measures). [`never`](Self::never) stays at
/// zero whatever it sees, which is what [`for_this_machine`](Self::for_this_machine) gives a
/// process with fewer than two CPUs: a spinning reader there holds the very core its writer
/// needs (the issue-24 experiment: 13.5 µs a round trip against 2.5 sleeping).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollWindow {
    current: Duration,
    max: Duration,
}

impl PollWindow {
    /// The largest window [`for_this_machine`](Self::for_this_machine) uses: 50 µs.
    pub const DEFAULT_MAX: Duration = Duration::from_micros(50);

    /// A window halved below this becomes zero.
    pub const FLOOR: Duration = Duration::from_nanos(500);

    /// A window that starts at zero and may grow to `max`.
    pub fn new(max: Duration) -> Self {
        Self {
            current: Duration::ZERO,
            max,
        }
    }

    /// A window that never polls: every wait sleeps at once.
    pub fn never() -> Self {
        Self::new(Duration::ZERO)
    }

    /// [`never`](Self::never) with fewer than 2 CPUs, else [`new`](Self::new) with `max`.
    pub fn with_cpus(cpus: usize, max: Duration) -> Self {
        if cpus < 2 {
            Self::never()
        } else {
            Self::new(max)
        }
    }

    /// [`with_cpus`](Self::with_cpus) with the CPUs this process may run on
    /// (`std::thread::available_parallelism`, which honours affinity and cgroup quotas) and
    /// [`DEFAULT_MAX`](Self::DEFAULT_MAX). Unknown counts as one.
    pub fn for_this_machine() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_cpus(cpus, Self::DEFAULT_MAX)
    }

    /// How long to poll now.
    pub fn current(&self) -> Duration {
        self.current
    }

    /// The largest window it may reach.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// Learns from one wait that ended after `gap`: keeps the window on a hit, halves it on
    /// a miss, explores from zero (see the type's docs).
    pub fn observe(&mut self, gap: Duration) {
        if gap <= self.current {
            return;
        }
        if self.current.is_zero() {
            if gap <= self.max / 2 {
                self.current = gap * 2;
            }
        } else {
            self.current /= 2;
            if self.current < Self::FLOOR {
                self.current = Duration::ZERO;
            }
        }
    }
}
