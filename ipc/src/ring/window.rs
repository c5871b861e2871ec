//! How long a ring's reader polls before it sleeps: a state machine without a clock.

use std::time::Duration;

/// The environment variable that sets the longest poll window of a ring reader
/// ([`PollWindow::configured_max`]), in microseconds.
pub const POLL_ENV: &str = "BATON_LINK_RING_POLL_US";

/// A reader's self-tuning poll window: how long it polls the ring for the next entry before
/// it announces its sleep and blocks on the doorbell.
///
/// A pure state machine: the caller measures each *gap* (from the start of a wait to the
/// entry that ended it) and feeds it to [`observe`](Self::observe):
/// - a *hit* (the gap within the window) keeps the window;
/// - a *miss* halves it (below [`FLOOR`](Self::FLOOR) it is zero: not worth a spin);
/// - a window of zero that sees a gap within its *exploring limit* explores: the window
///   becomes twice that gap, at most the maximum, so that the next entry after such a gap is
///   caught polling.
///
/// It starts at zero (the first wait sleeps and measures). [`never`](Self::never) stays at
/// zero whatever it sees, which is what [`for_this_machine`](Self::for_this_machine) gives a
/// process with fewer than two CPUs: a spinning reader there holds the very core its writer
/// needs (the issue-24 experiment: 13.5 µs a round trip against 2.5 sleeping).
///
/// **The exploring limit** is the maximum ([`new`](Self::new)) where the process may run on
/// [`EXPLORE_ALL_CPUS`](Self::EXPLORE_ALL_CPUS) CPUs or more, and half of it on two or three
/// ([`with_cpus`](Self::with_cpus)). A cached round trip over rings whose consumer sleeps
/// takes longer than half the default maximum, so a consumer that explored only gaps up to
/// half never learned to poll, and the round trip kept the doorbell's cost about one time in
/// two; exploring every gap within the maximum makes it poll. With many CPUs that is the
/// cheaper round trip every time; with two, the polling consumer holds a core its peer
/// needs, and the round trip gets slower (`docs/BENCHMARKS.md`, "What would close the floor gap").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollWindow {
    current: Duration,
    max: Duration,
    /// The longest gap that a window of zero explores.
    explore: Duration,
}

impl PollWindow {
    /// The largest window [`for_this_machine`](Self::for_this_machine) uses: 50 µs.
    pub const DEFAULT_MAX: Duration = Duration::from_micros(50);

    /// A window halved below this becomes zero.
    pub const FLOOR: Duration = Duration::from_nanos(500);

    /// The fewest CPUs with which [`with_cpus`](Self::with_cpus) explores every gap within
    /// the maximum (fewer, but two or more: gaps up to half of it).
    pub const EXPLORE_ALL_CPUS: usize = 4;

    /// A window that starts at zero, may grow to `max`, and explores every gap within it.
    pub fn new(max: Duration) -> Self {
        Self {
            current: Duration::ZERO,
            max,
            explore: max,
        }
    }

    /// A window that never polls: every wait sleeps at once.
    pub fn never() -> Self {
        Self::new(Duration::ZERO)
    }

    /// [`never`](Self::never) with fewer than 2 CPUs; [`new`](Self::new) with `max` with
    /// [`EXPLORE_ALL_CPUS`](Self::EXPLORE_ALL_CPUS) or more; between, a window of `max`
    /// that explores gaps up to half of it (see the type's docs).
    pub fn with_cpus(cpus: usize, max: Duration) -> Self {
        match cpus {
            0 | 1 => Self::never(),
            n if n < Self::EXPLORE_ALL_CPUS => Self {
                explore: max / 2,
                ..Self::new(max)
            },
            _ => Self::new(max),
        }
    }

    /// [`with_cpus`](Self::with_cpus) with the CPUs this process may run on
    /// (`std::thread::available_parallelism`, which honours affinity and cgroup quotas) and
    /// [`configured_max`](Self::configured_max). Unknown counts as one.
    pub fn for_this_machine() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_cpus(cpus, Self::configured_max())
    }

    /// The largest window of [`for_this_machine`](Self::for_this_machine):
    /// [`POLL_ENV`] (`BATON_LINK_RING_POLL_US`, microseconds, at most
    /// [`LONGEST`](Self::LONGEST)) where it is set to a number, else
    /// [`DEFAULT_MAX`](Self::DEFAULT_MAX). Read once per process.
    ///
    /// A longer window keeps a reader awake across longer gaps between frames — a weight
    /// sync every few milliseconds — at the price of a core polling through each gap it
    /// learns to span (see the type's docs): a latency setting for a host with cores to
    /// spare, never a default.
    pub fn configured_max() -> Duration {
        static MAX: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
        *MAX.get_or_init(|| {
            Self::max_from(std::env::var(POLL_ENV).ok().as_deref()).unwrap_or_else(|bad| {
                tracing::warn!(
                    value = bad,
                    "{POLL_ENV} is not a number of microseconds: ignored"
                );
                Self::DEFAULT_MAX
            })
        })
    }

    /// The maximum a value of [`POLL_ENV`] asks for: unset or empty, the default; a number
    /// of microseconds, that (capped at [`LONGEST`](Self::LONGEST)); anything else, `Err`
    /// with it.
    fn max_from(value: Option<&str>) -> Result<Duration, &str> {
        match value.map(str::trim) {
            None | Some("") => Ok(Self::DEFAULT_MAX),
            Some(v) => v
                .parse::<u64>()
                .map(|us| Duration::from_micros(us).min(Self::LONGEST))
                .map_err(|_| v),
        }
    }

    /// The longest window [`POLL_ENV`] may ask for: 100 ms.
    pub const LONGEST: Duration = Duration::from_millis(100);

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
            if gap <= self.explore {
                self.current = (gap * 2).min(self.max);
            }
        } else {
            self.current /= 2;
            if self.current < Self::FLOOR {
                self.current = Duration::ZERO;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configured_maximum_is_microseconds_capped_or_the_default() {
        assert_eq!(PollWindow::max_from(None), Ok(PollWindow::DEFAULT_MAX));
        assert_eq!(PollWindow::max_from(Some(" ")), Ok(PollWindow::DEFAULT_MAX));
        assert_eq!(
            PollWindow::max_from(Some("5000")),
            Ok(Duration::from_millis(5))
        );
        assert_eq!(PollWindow::max_from(Some("0")), Ok(Duration::ZERO));
        assert_eq!(
            PollWindow::max_from(Some("999999999")),
            Ok(PollWindow::LONGEST)
        );
        assert_eq!(PollWindow::max_from(Some("5ms")), Err("5ms"));
        assert_eq!(PollWindow::max_from(Some("-1")), Err("-1"));
    }
}
