//! Fence inboxes: the consumer's side of counter fences, as a state machine without I/O.
//!
//! A counter fence is a 64-bit word a producer's stream writes and a consumer's stream
//! waits on. The word lives in memory the **consumer** owns — its *inbox* — so that the
//! consumer can always release its own waits, alone, by writing the word itself: when the
//! producer dies, exits with its write still queued, is cut, or names a value it never
//! writes. (NCCL and NVSHMEM keep their flags at the receiver for the same reason.) A
//! producer that dies can then never leave a stream of ours, the free behind it, our
//! driver thread or a user's `torch.cuda.synchronize()` waiting forever, and releasing a
//! wait never touches a word another process waits on.
//!
//! The inbox is cut into **lanes**, one per peer process ([`InboxGrant`](baton_messages::InboxGrant)): a lane has one
//! slot per writer of the producer (its release streams, and streams bound to its stream
//! slots), and a producer writes each slot from one stream at a time, passing it to
//! another only once that stream ran everything, so a slot's values land in increasing
//! order and a wait for a value is satisfied by it or any later one — never early.
//!
//! [`Lanes`] is the bookkeeping: which lane belongs to whom, which values each producer
//! has named (announced) and whether they landed, which producer missed its deadline, and
//! which lanes were released while their producer may still run work. The backend reads
//! the inbox back on a watch thread and feeds [`Lanes::observe`] the values; it performs
//! the writes `observe` asks for. Nothing here touches a device, a clock or a process
//! table: the caller passes `now` and each producer's liveness, so every interleaving can
//! be driven from a test (see the property tests below and `tests/liveness.rs`).
//!
//! **The rules.**
//! - A fence a peer sends must name a slot of the lane lent to *that* peer, with a value at
//!   most [`MAX_VALUE_STEP`] above what the slot holds or was named before: anything else
//!   is [`FenceRefusal`], the peer's fault (the link that carried it is dropped).
//! - A lane with a slot whose named value has not landed, and that slot has shown no
//!   progress for the deadline (each slot has its own: its own release stream), is
//!   **released**: every slot is written with [`Lanes::release_value`] (above every value it held or was named with; `GEQ` is cyclic), which
//!   releases every wait of ours on it, and its producer is reported (the node cuts it).
//!   While that producer lives, the lane is written again at each observation (a late write
//!   of its own could lower a slot under a wait still queued), and fences it had named
//!   guard memory that must not be freed before it dies ([`Lanes::unsafe_to_free`]).
//! - A dead producer's lane is released at once ([`Lanes::producer_died`], or the first
//!   observation that finds it dead with values pending), and nothing is held for it. A
//!   write of its own already on its way when it was seen dead can still land after the
//!   release and lower a slot (seen on the H100): so a dead lane is read back for a
//!   deadline after the death and released again whenever it is found below its release
//!   value ([`Observation::lowered`]). A released lane accepts any value (every wait on it
//!   passes).
//! - A released lane is never lent again: a producer that links again gets a fresh lane.
//!
//! Memory is bounded: one lane per peer process, `slots` words each; lanes are never lent
//! twice, so a process serving more peers over its life than it has lanes falls back to
//! host-synchronised handoffs for the rest ([`Lanes::grant`] returns `None`).

use baton_messages::ProcessId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The most a fence's value may exceed the highest value its slot held or was named with.
/// Honest producers name consecutive values per slot; this bounds how far a forged value
/// can jump (a never-written value within it is caught by the deadline).
pub const MAX_VALUE_STEP: u64 = 1 << 24;

/// The deadline a producer has, by default, to make progress on the values it named
/// before its lane is released and it is cut. Generous: a release fence waits behind the
/// consumer's own kernels, which may be long. `BATON_FENCE_DEADLINE_MS` overrides it.
pub const DEFAULT_FENCE_DEADLINE: Duration = Duration::from_secs(10);

/// How far above the highest value a lane's slots held or were named with a released lane
/// is written. `cuStreamWaitValue64`'s `GEQ` is a *cyclic* comparison — a wait for `v`
/// passes once `(word - v) as i64 >= 0` — so writing `u64::MAX` would satisfy nothing:
/// the release writes `highest + RELEASE_STEP`, which every wait queued on the lane (for at
/// most `highest`) passes, and a wait on a released lane is never queued at all
/// ([`Lanes::is_released`]).
pub const RELEASE_STEP: u64 = 1 << 32;

/// The environment variable that sets the fence deadline, in milliseconds.
pub const FENCE_DEADLINE_ENV: &str = "BATON_FENCE_DEADLINE_MS";

/// The fence deadline [`FENCE_DEADLINE_ENV`] asks for, [`DEFAULT_FENCE_DEADLINE`] if unset
/// or unparsable (which is logged).
pub fn fence_deadline_from_env() -> Duration {
    match std::env::var(FENCE_DEADLINE_ENV) {
        Err(_) => DEFAULT_FENCE_DEADLINE,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Duration::from_millis(ms),
            _ => {
                tracing::warn!(value = %v, "{FENCE_DEADLINE_ENV} is not a positive number of milliseconds: using the default");
                DEFAULT_FENCE_DEADLINE
            }
        },
    }
}

/// Why a fence a peer sent is refused. The peer's fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FenceRefusal {
    /// The fence names a slab that is not this process's inbox.
    #[error("the fence names a counter slab that is not this process's fence inbox")]
    ForeignSlab,
    /// No lane was lent to the sender.
    #[error("no fence inbox lane was lent to this peer")]
    NoLane,
    /// The slot lies outside the sender's lane.
    #[error("the fence names slot offset {offset}, outside the sender's lane")]
    OutsideLane {
        /// The byte offset named.
        offset: u64,
    },
    /// The value jumps too far ahead of the slot.
    #[error(
        "the fence names value {value}, more than {MAX_VALUE_STEP} above {floor}, the highest its slot held or was named with"
    )]
    ValueTooFar {
        /// The value named.
        value: u64,
        /// The highest value the slot held or was named with.
        floor: u64,
    },
}

/// The state of one lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneStatus {
    /// Its producer's writes order our waits.
    Live,
    /// Released while its producer was alive (it missed its deadline, or was cut): written
    /// with its release value again at every observation while it lives.
    Released,
    /// Released because its producer died: nothing more to do.
    Dead,
}

#[derive(Debug, Clone)]
struct Lane {
    first: u32,
    status: LaneStatus,
    /// Highest value named per slot.
    announced: Vec<u64>,
    /// Value per slot at the last observation.
    seen: Vec<u64>,
    /// Per slot: when it last made progress, or was first named a value while it had none
    /// pending. Each slot has its own deadline: progress on one slot (another release
    /// stream of the producer) says nothing of another.
    progress_at: Vec<Instant>,
    /// Reported late ([`Observation::late`]) since its last progress.
    late_reported: bool,
    /// Dead: when an observation first found it so (see [`LaneStatus::Dead`] in
    /// [`Lanes::observe`]).
    died_at: Option<Instant>,
    /// Dead, and seen at or above its release value for a whole deadline since.
    settled: bool,
}

impl Lane {
    /// Above every value it held or was named with (`GEQ` is cyclic: see
    /// [`Lanes::release_value`]).
    fn release_value(&self) -> u64 {
        let highest = self
            .announced
            .iter()
            .chain(&self.seen)
            .copied()
            .max()
            .unwrap_or(0);
        // A late write of a released producer can only be lower: `seen` never follows a
        // value at or above the release.
        highest.min(u64::MAX / 4) + RELEASE_STEP
    }

    fn slot_pending(&self, s: usize) -> bool {
        self.announced[s] > self.seen[s]
    }

    fn pending(&self) -> bool {
        (0..self.seen.len()).any(|s| self.slot_pending(s))
    }
}

/// A slot whose named value has not landed ([`Lanes::pending_slots`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingSlot {
    /// The slot's number in the inbox.
    pub slot: u32,
    /// The highest value its producer named.
    pub named: u64,
    /// The highest value seen in it.
    pub seen: u64,
}

/// A range of slots to release (write with [`Lanes::release_value`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReleaseRange {
    /// First slot.
    pub first: u32,
    /// Slots.
    pub slots: u32,
}

/// What an observation decided.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Observation {
    /// Producers that named values and made no progress for the deadline: their lanes are
    /// released (in `release`), and they should be cut.
    pub missed: Vec<ProcessId>,
    /// Ranges to release now.
    pub release: Vec<ReleaseRange>,
    /// Live producers with a named value that has not landed and no progress for a
    /// quarter of the deadline: reported once until their lane makes progress (a log
    /// line that says which waits are stuck long before the deadline cuts them).
    pub late: Vec<ProcessId>,
    /// Dead producers whose released lane was found below its release value (a write of
    /// theirs landed after the release): written again (in `release`).
    pub lowered: Vec<ProcessId>,
}

/// The lanes of one inbox (see the module docs).
#[derive(Debug)]
pub struct Lanes {
    /// The first slot of the lane area.
    area_first: u32,
    /// Lanes the area holds.
    capacity: u32,
    /// Slots per lane.
    lane_slots: u32,
    /// Lanes lent so far (lane `n` starts at `area_first + n * lane_slots`).
    lent: u32,
    deadline: Duration,
    /// The current lane of each peer process.
    current: HashMap<ProcessId, usize>,
    /// Every lane lent, by index; a peer's older lanes stay (released) until it dies.
    lanes: Vec<(ProcessId, Lane)>,
}

impl Lanes {
    /// Lanes of `lane_slots` slots from slot `area_first` on, `capacity` of them; a
    /// producer that names values and makes no progress for `deadline` is released.
    pub fn new(area_first: u32, capacity: u32, lane_slots: u32, deadline: Duration) -> Self {
        Self {
            area_first,
            capacity,
            lane_slots: lane_slots.max(1),
            lent: 0,
            deadline,
            current: HashMap::new(),
            lanes: Vec::new(),
        }
    }

    /// Slots per lane.
    pub fn lane_slots(&self) -> u32 {
        self.lane_slots
    }

    /// The deadline.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The lane lent to `peer`: its live lane if it has one, else a fresh one (`None` when
    /// every lane was lent). Returns (first slot, slots, base value).
    pub fn grant(&mut self, peer: &ProcessId, now: Instant) -> Option<(u32, u32, u64)> {
        if let Some(&i) = self.current.get(peer) {
            let lane = &self.lanes[i].1;
            if lane.status == LaneStatus::Live {
                return Some((lane.first, self.lane_slots, 0));
            }
        }
        if self.lent >= self.capacity {
            return None;
        }
        let first = self.area_first + self.lent * self.lane_slots;
        self.lent += 1;
        let n = self.lane_slots as usize;
        self.lanes.push((
            *peer,
            Lane {
                first,
                status: LaneStatus::Live,
                announced: vec![0; n],
                seen: vec![0; n],
                progress_at: vec![now; n],
                late_reported: false,
                died_at: None,
                settled: false,
            },
        ));
        self.current.insert(*peer, self.lanes.len() - 1);
        Some((first, self.lane_slots, 0))
    }

    fn lane_of(&self, peer: &ProcessId) -> Option<&Lane> {
        self.current.get(peer).map(|&i| &self.lanes[i].1)
    }

    /// The lane slot of `offset` in a lane lent to `peer`: its current lane, or an older
    /// one (released when it was replaced, so a fence queued from it still passes).
    fn slot(&self, peer: &ProcessId, offset: u64) -> Result<(usize, usize), FenceRefusal> {
        let &current = self.current.get(peer).ok_or(FenceRefusal::NoLane)?;
        let slot = offset / 8;
        let within = |lane: &Lane| {
            let first = u64::from(lane.first);
            (offset % 8 == 0 && slot >= first && slot < first + u64::from(self.lane_slots))
                .then(|| (slot - first) as usize)
        };
        if let Some(s) = within(&self.lanes[current].1) {
            return Ok((current, s));
        }
        self.lanes
            .iter()
            .enumerate()
            .filter(|(_, (p, _))| p == peer)
            .find_map(|(i, (_, lane))| within(lane).map(|s| (i, s)))
            .ok_or(FenceRefusal::OutsideLane { offset })
    }

    /// Checks a fence `peer` sent (byte `offset` in our inbox, `value`), and records its
    /// value as named. `now` starts the deadline if the lane had nothing pending.
    ///
    /// # Errors
    /// [`FenceRefusal`]: the peer's fault.
    pub fn announce(
        &mut self,
        peer: &ProcessId,
        offset: u64,
        value: u64,
        now: Instant,
    ) -> Result<(), FenceRefusal> {
        let (i, s) = self.slot(peer, offset)?;
        let lane = &mut self.lanes[i].1;
        if lane.status != LaneStatus::Live {
            // Released: every wait on it passes whatever the value; nothing to track.
            return Ok(());
        }
        let floor = lane.announced[s].max(lane.seen[s]);
        if value > floor.saturating_add(MAX_VALUE_STEP) {
            return Err(FenceRefusal::ValueTooFar { value, floor });
        }
        if !lane.slot_pending(s) {
            lane.progress_at[s] = now;
        }
        lane.announced[s] = lane.announced[s].max(value);
        Ok(())
    }

    /// The value to write into every slot of the lane starting at slot `first` to release
    /// it: above everything it held or was named with (see [`RELEASE_STEP`]).
    pub fn release_value(&self, first: u32) -> u64 {
        self.lanes
            .iter()
            .find(|(_, l)| l.first == first)
            .map_or(RELEASE_STEP, |(_, l)| l.release_value())
    }

    /// Whether byte `offset` lies in a lane of `peer` that was released: a wait there would
    /// pass at once (or, for a value named after the release, not at all), so none is
    /// queued.
    pub fn is_released(&self, peer: &ProcessId, offset: u64) -> bool {
        self.slot(peer, offset)
            .is_ok_and(|(i, _)| self.lanes[i].1.status != LaneStatus::Live)
    }

    /// Whether `peer` may make our streams wait on byte `offset` of our inbox (a slot of
    /// its current lane).
    pub fn may_wait(&self, peer: &ProcessId, offset: u64) -> bool {
        self.slot(peer, offset).is_ok()
    }

    /// Whether anything needs the inbox read back: a lane with values pending, or a lane
    /// released while its producer lives.
    pub fn needs_observing(&self) -> bool {
        self.lanes.iter().any(|(_, l)| match l.status {
            LaneStatus::Live => l.pending(),
            LaneStatus::Released => true,
            LaneStatus::Dead => !l.settled,
        })
    }

    /// Feeds the inbox as read back (`values[slot]` for every slot of the inbox) at `now`;
    /// `alive` says whether a producer may still run work. Decides which lanes to release
    /// (again) and which producers missed their deadline.
    pub fn observe(
        &mut self,
        values: &[u64],
        now: Instant,
        mut alive: impl FnMut(&ProcessId) -> bool,
    ) -> Observation {
        let mut out = Observation::default();
        let lane_slots = self.lane_slots;
        for (peer, lane) in &mut self.lanes {
            let range = ReleaseRange {
                first: lane.first,
                slots: lane_slots,
            };
            match lane.status {
                LaneStatus::Dead if lane.settled => {}
                LaneStatus::Dead => {
                    // A process seen dead (a zombie, its socket closed) may still have
                    // writes of its own in flight on the device for a while: one landing
                    // after our release lowers a slot under a wait still queued, which
                    // then never passes (the renderer's chaos runs on the H100). So a dead
                    // lane is read back for a deadline after its death, and written again
                    // whenever it is found below its release value.
                    let died_at = *lane.died_at.get_or_insert(now);
                    let release = lane.release_value();
                    let lowered = (0..lane_slots as usize).any(|s| {
                        values
                            .get(lane.first as usize + s)
                            .is_some_and(|&v| (v.wrapping_sub(release) as i64) < 0)
                    });
                    if lowered {
                        out.release.push(range);
                        out.lowered.push(*peer);
                    } else if now.saturating_duration_since(died_at) >= self.deadline {
                        lane.settled = true;
                    }
                }
                LaneStatus::Released => {
                    if !alive(peer) {
                        lane.status = LaneStatus::Dead;
                    }
                    // Once more after a death too: a write of its own queued before it
                    // died may have landed since the last release.
                    out.release.push(range);
                }
                LaneStatus::Live => {
                    let mut stuck = false;
                    let mut late = false;
                    for s in 0..lane.seen.len() {
                        let v = values
                            .get(lane.first as usize + s)
                            .copied()
                            .unwrap_or(lane.seen[s])
                            // A word of a lane released before it was lent again is not
                            // progress of this producer's.
                            .min(u64::MAX / 4);
                        if v > lane.seen[s] {
                            lane.seen[s] = v;
                            lane.progress_at[s] = now;
                            lane.late_reported = false;
                        }
                        let waited = now.saturating_duration_since(lane.progress_at[s]);
                        stuck |= lane.slot_pending(s) && waited >= self.deadline;
                        late |= lane.slot_pending(s) && waited >= self.deadline / 4;
                    }
                    if !lane.pending() {
                        continue;
                    }
                    if !alive(peer) {
                        // Dead: release at once, hold nothing (its work cannot outlive its
                        // context); watched a while longer for a late write (above).
                        lane.status = LaneStatus::Dead;
                        lane.died_at = Some(now);
                        out.release.push(range);
                    } else if stuck {
                        lane.status = LaneStatus::Released;
                        out.missed.push(*peer);
                        out.release.push(range);
                    } else if late && !lane.late_reported {
                        lane.late_reported = true;
                        out.late.push(*peer);
                    }
                }
            }
        }
        out
    }

    /// `peer`'s slots (inbox slot numbers) whose value named last has not been seen, each
    /// with that value and the value seen last: what a missed deadline reports, so that a
    /// log says which fences did not land, not only whose.
    pub fn pending_slots(&self, peer: &ProcessId) -> Vec<PendingSlot> {
        self.lanes
            .iter()
            .filter(|(p, _)| p == peer)
            .flat_map(|(_, l)| {
                (0..l.seen.len())
                    .filter(|&s| l.slot_pending(s))
                    .map(move |s| PendingSlot {
                        slot: l.first + s as u32,
                        named: l.announced[s],
                        seen: l.seen[s],
                    })
            })
            .collect()
    }

    /// `peer` is dead: its lanes are released (ranges to release).
    pub fn producer_died(&mut self, peer: &ProcessId) -> Vec<ReleaseRange> {
        let lane_slots = self.lane_slots;
        let mut out = Vec::new();
        for (p, lane) in &mut self.lanes {
            if p == peer && lane.status != LaneStatus::Dead {
                lane.status = LaneStatus::Dead;
                out.push(ReleaseRange {
                    first: lane.first,
                    slots: lane_slots,
                });
            }
        }
        out
    }

    /// `peer` is cut while it may be alive: its lanes are released now and kept released
    /// (see the module docs); ranges to release.
    pub fn producer_cut(&mut self, peer: &ProcessId) -> Vec<ReleaseRange> {
        let lane_slots = self.lane_slots;
        let mut out = Vec::new();
        for (p, lane) in &mut self.lanes {
            if p == peer && lane.status == LaneStatus::Live {
                lane.status = LaneStatus::Released;
                out.push(ReleaseRange {
                    first: lane.first,
                    slots: lane_slots,
                });
            }
        }
        out
    }

    /// Whether memory guarded by a fence `peer` named at byte `offset` must not be freed
    /// yet: the slot's lane was released while `peer` was alive, so work of its own that
    /// the fence stood for may still run. (Dead producers' work died with them; a live
    /// lane's fence was waited on for real.)
    pub fn unsafe_to_free(&self, peer: &ProcessId, offset: u64) -> bool {
        let slot = offset / 8;
        self.lanes.iter().any(|(p, l)| {
            p == peer
                && l.status == LaneStatus::Released
                && slot >= u64::from(l.first)
                && slot < u64::from(l.first) + u64::from(self.lane_slots)
        })
    }

    /// The status of `peer`'s current lane.
    pub fn status(&self, peer: &ProcessId) -> Option<LaneStatus> {
        self.lane_of(peer).map(|l| l.status)
    }

    /// Lanes lent so far, of the capacity.
    pub fn lent(&self) -> (u32, u32) {
        (self.lent, self.capacity)
    }
}

#[cfg(test)]
mod tests;
