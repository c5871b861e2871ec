//! Bridges: the bookkeeping (no I/O) that lets a process wait on another process's
//! interprocess event and still release that wait alone.
//!
//! A stream made to wait on a foreign event (`cuStreamWaitEvent`) waits until that event's
//! record completes — forever when its process died first (H100, driver 580: the liveness
//! suite's event-fence cases, run N in `docs/bench/h100/`). So the CUDA backend never makes a
//! stream wait on another process's event. When such an event has not completed yet, the
//! stream waits instead on a *bridge slot*, a 64-bit word of the waiter's own memory
//! (`cuStreamWaitValue64`, `GEQ`), and a thread of the waiter writes the slot's value when:
//!
//! - the event has completed (polled with `cuEventQuery`);
//! - its producer died or was cut (at once);
//! - the fence deadline passed with the event still pending: the producer is then *missed*
//!   (cut by the node's fence fault hooks), and while it lives, memory guarded by its event
//!   fences is [unsafe to free](Bridges::unsafe_to_free) — our wait was released, its work
//!   may still run.
//!
//! This module decides which slot a wait uses, with which value, and which slots to write
//! when; `cuda/bridge.rs` does the driver calls. A slot carries one pending wait at a time
//! and its values only grow, so a release write of value `v` releases exactly the wait
//! for `v` — never a later wait on the same slot, which names `v + 1` or more.

use baton_messages::ProcessId;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// Write `value` into `slot`: releases the wait on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotWrite {
    /// The bridge slot.
    pub slot: u32,
    /// The value its pending wait names.
    pub value: u64,
}

#[derive(Debug, Clone)]
struct Pending<E> {
    write: SlotWrite,
    producer: ProcessId,
    event: E,
    since: Instant,
    /// Reported in [`Look::late`] already.
    late_reported: bool,
}

/// What one [`look`](Bridges::look) decided.
#[derive(Debug, Default)]
pub(crate) struct Look {
    /// Slots to write: their waits are released.
    pub release: Vec<SlotWrite>,
    /// Live producers whose events missed the deadline (to be cut).
    pub missed: Vec<ProcessId>,
    /// Live producers with a wait pending for a quarter of the deadline, reported once per
    /// wait (for a log line long before the deadline cuts them).
    pub late: Vec<ProcessId>,
}

/// The bridge slots of one backend, and the waits pending on them. `E` is the event a
/// wait follows (an opened foreign event on the GPU, anything in tests).
#[derive(Debug)]
pub(crate) struct Bridges<E> {
    /// Slots with no pending wait.
    free: Vec<u32>,
    /// The last value named per slot.
    values: Vec<u64>,
    pending: Vec<Pending<E>>,
    /// Producers released while alive (cut, or missed the deadline).
    released_alive: HashSet<ProcessId>,
    deadline: Duration,
}

impl<E: Clone> Bridges<E> {
    /// `slots` bridge slots (all zero), waits released after `deadline`.
    pub(crate) fn new(slots: u32, deadline: Duration) -> Self {
        Self {
            free: (0..slots).rev().collect(),
            values: vec![0; slots as usize],
            pending: Vec::new(),
            released_alive: HashSet::new(),
            deadline,
        }
    }

    /// Whether waits on `producer`'s events are released already (it was cut or missed the
    /// deadline and may live): none is queued.
    pub(crate) fn is_released(&self, producer: &ProcessId) -> bool {
        self.released_alive.contains(producer)
    }

    /// A wait on `event` from `producer`: the slot and value the stream must wait for, or
    /// `None` when every slot carries a wait already.
    pub(crate) fn open(
        &mut self,
        producer: ProcessId,
        event: E,
        now: Instant,
    ) -> Option<SlotWrite> {
        let slot = self.free.pop()?;
        let value = &mut self.values[slot as usize];
        *value += 1;
        let write = SlotWrite {
            slot,
            value: *value,
        };
        self.pending.push(Pending {
            write,
            producer,
            event,
            since: now,
            late_reported: false,
        });
        Some(write)
    }

    /// The pending waits' slots and events, to poll.
    pub(crate) fn pending(&self) -> Vec<(u32, E)> {
        self.pending
            .iter()
            .map(|p| (p.write.slot, p.event.clone()))
            .collect()
    }

    /// When the wait pending on `slot` was opened.
    pub(crate) fn since(&self, slot: u32) -> Option<Instant> {
        self.pending
            .iter()
            .find(|p| p.write.slot == slot)
            .map(|p| p.since)
    }

    /// How many waits are pending.
    pub(crate) fn pending_count(&self) -> usize {
        self.pending.len()
    }

    fn take(&mut self, mut which: impl FnMut(&Pending<E>) -> bool) -> Vec<(SlotWrite, ProcessId)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            if which(&self.pending[i]) {
                let p = self.pending.swap_remove(i);
                self.free.push(p.write.slot);
                out.push((p.write, p.producer));
            } else {
                i += 1;
            }
        }
        out
    }

    /// The events on `slots` have completed: their waits are released.
    pub(crate) fn landed(&mut self, slots: &[u32]) -> Vec<SlotWrite> {
        self.take(|p| slots.contains(&p.write.slot))
            .into_iter()
            .map(|(w, _)| w)
            .collect()
    }

    /// Releases the waits of dead producers and of those past the deadline (whose live
    /// producers are then missed).
    pub(crate) fn look(&mut self, now: Instant, alive: impl Fn(&ProcessId) -> bool) -> Look {
        let deadline = self.deadline;
        let mut dead = HashSet::new();
        let mut late = HashSet::new();
        let mut slow = HashSet::new();
        for p in &mut self.pending {
            let waited = now.saturating_duration_since(p.since);
            if !alive(&p.producer) {
                dead.insert(p.producer);
            } else if waited >= deadline {
                late.insert(p.producer);
            } else if waited >= deadline / 4 && !p.late_reported {
                p.late_reported = true;
                slow.insert(p.producer);
            }
        }
        let mut look = Look {
            late: slow.into_iter().collect(),
            ..Look::default()
        };
        for p in dead {
            look.release.extend(self.died(&p));
        }
        for p in late {
            look.release.extend(self.cut(&p));
            look.missed.push(p);
        }
        look
    }

    /// `producer` named an event in a fence again: it records an event anew only once the
    /// older records completed, and only for the process that had them (`cuda/event.rs`),
    /// so our waits on that event (`is` picks them) are over — released now, whatever the
    /// event's current record says (it may be the new one, which a poll would follow).
    pub(crate) fn renamed(
        &mut self,
        producer: &ProcessId,
        is: impl Fn(&E) -> bool,
    ) -> Vec<SlotWrite> {
        self.take(|p| p.producer == *producer && is(&p.event))
            .into_iter()
            .map(|(w, _)| w)
            .collect()
    }

    /// `producer` is dead: its waits are released, and its work died with it.
    pub(crate) fn died(&mut self, producer: &ProcessId) -> Vec<SlotWrite> {
        self.released_alive.remove(producer);
        self.take(|p| p.producer == *producer)
            .into_iter()
            .map(|(w, _)| w)
            .collect()
    }

    /// `producer` is cut while it may live: its waits are released, and stay so.
    pub(crate) fn cut(&mut self, producer: &ProcessId) -> Vec<SlotWrite> {
        self.released_alive.insert(*producer);
        self.take(|p| p.producer == *producer)
            .into_iter()
            .map(|(w, _)| w)
            .collect()
    }

    /// Whether memory guarded by `producer`'s event fences must not be freed yet: our waits
    /// on them were released while it may live (the caller checks it is not dead).
    pub(crate) fn unsafe_to_free(&self, producer: &ProcessId) -> bool {
        self.released_alive.contains(producer)
    }

    /// Every pending wait, released (the backend goes away).
    pub(crate) fn drain(&mut self) -> Vec<SlotWrite> {
        self.take(|_| true).into_iter().map(|(w, _)| w).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn pid(n: u32) -> ProcessId {
        ProcessId {
            boot: baton_messages::BootId([7; 16]),
            pid: n,
            start_ticks: u64::from(n),
        }
    }

    const DEADLINE: Duration = Duration::from_secs(10);

    #[test]
    fn a_wait_is_released_by_its_event_and_its_slot_reused_with_a_higher_value() {
        let t = Instant::now();
        let mut b = Bridges::new(1, DEADLINE);
        let w = b.open(pid(1), "e1", t).unwrap();
        assert_eq!(w, SlotWrite { slot: 0, value: 1 });
        assert!(b.open(pid(1), "e2", t).is_none(), "one slot, one wait");
        assert_eq!(b.pending(), vec![(0, "e1")]);
        assert_eq!(b.landed(&[0]), vec![w]);
        assert_eq!(
            b.open(pid(1), "e2", t).unwrap(),
            SlotWrite { slot: 0, value: 2 }
        );
    }

    #[test]
    fn a_dead_producers_waits_are_released_and_its_memory_is_safe_to_free() {
        let t = Instant::now();
        let mut b = Bridges::new(4, DEADLINE);
        let a = b.open(pid(1), (), t).unwrap();
        let other = b.open(pid(2), (), t).unwrap();
        let look = b.look(t, |p| *p != pid(1));
        assert_eq!(look.release, vec![a]);
        assert!(look.missed.is_empty());
        assert!(!b.unsafe_to_free(&pid(1)));
        assert_eq!(b.pending_count(), 1);
        assert_eq!(b.drain(), vec![other]);
    }

    #[test]
    fn a_producer_past_the_deadline_is_missed_and_its_memory_held_until_it_dies() {
        let t = Instant::now();
        let mut b = Bridges::new(4, DEADLINE);
        let a = b.open(pid(1), (), t).unwrap();
        let young = b.open(pid(2), (), t + DEADLINE / 2).unwrap();
        let look = b.look(t + DEADLINE / 2, |_| true);
        assert!(look.release.is_empty());
        // Late by a quarter of the deadline: reported (for a log line), once.
        assert_eq!(look.late, vec![pid(1)]);
        assert_eq!(b.look(t + DEADLINE * 3 / 4, |_| true).late, vec![pid(2)]);
        let look = b.look(t + DEADLINE, |_| true);
        assert!(look.late.is_empty());
        assert_eq!(look.release, vec![a]);
        assert_eq!(look.missed, vec![pid(1)]);
        assert!(b.unsafe_to_free(&pid(1)) && b.is_released(&pid(1)));
        assert!(!b.unsafe_to_free(&pid(2)));
        assert!(b.died(&pid(1)).is_empty());
        assert!(!b.unsafe_to_free(&pid(1)));
        assert_eq!(b.cut(&pid(2)), vec![young]);
        assert!(b.unsafe_to_free(&pid(2)));
    }

    #[test]
    fn naming_an_event_again_releases_only_that_producers_waits_on_it() {
        let t = Instant::now();
        let mut b = Bridges::new(4, DEADLINE);
        let old = b.open(pid(1), "e", t).unwrap();
        let other_event = b.open(pid(1), "f", t).unwrap();
        let other_producer = b.open(pid(2), "e", t).unwrap();
        assert_eq!(b.renamed(&pid(1), |e| *e == "e"), vec![old]);
        assert!(b.renamed(&pid(1), |e| *e == "e").is_empty());
        // Not a release while alive: the old record completed.
        assert!(!b.unsafe_to_free(&pid(1)) && !b.is_released(&pid(1)));
        let mut rest = b.drain();
        rest.sort_by_key(|w| w.slot);
        assert_eq!(rest, vec![other_event, other_producer]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Open(u32),
        Land(usize),
        Look(u64),
        Died(u32),
        Cut(u32),
        Renamed(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u32..3).prop_map(Op::Open),
            2 => (0usize..8).prop_map(Op::Land),
            1 => (0u64..15).prop_map(Op::Look),
            1 => (0u32..3).prop_map(Op::Died),
            1 => (0u32..3).prop_map(Op::Cut),
            1 => (0u32..3).prop_map(Op::Renamed),
        ]
    }

    proptest! {
        /// Against a model of the slots' words: a release write never releases a wait other
        /// than its own; every wait is released exactly once, by its event, its producer's
        /// death or cut, its event named again, or the deadline; a producer released while alive is unsafe to free
        /// until it dies; nothing grows past the slots.
        #[test]
        fn writes_release_exactly_their_own_wait(ops in proptest::collection::vec(op(), 1..200)) {
            let t0 = Instant::now();
            let mut now = t0;
            let mut b: Bridges<u32> = Bridges::new(4, DEADLINE);
            let mut word: HashMap<u32, u64> = HashMap::new();
            // (slot, value) -> (producer, when opened) of each wait not yet released.
            let mut waiting: HashMap<(u32, u64), (u32, Instant)> = HashMap::new();
            let mut dead: HashSet<u32> = HashSet::new();
            let mut released_alive: HashSet<u32> = HashSet::new();
            let apply = |w: &SlotWrite, word: &mut HashMap<u32, u64>, waiting: &mut HashMap<(u32, u64), (u32, Instant)>| {
                let before = *word.get(&w.slot).unwrap_or(&0);
                prop_assert!(w.value > before, "a slot's writes grow");
                word.insert(w.slot, w.value);
                prop_assert!(waiting.remove(&(w.slot, w.value)).is_some(), "a write releases its own wait");
                // No other wait on this slot is released by it (there is none pending).
                prop_assert!(!waiting.keys().any(|(s, v)| *s == w.slot && *v <= w.value));
                Ok(())
            };
            for op in ops {
                match op {
                    Op::Open(p) => {
                        if dead.contains(&p) { continue; }
                        match b.open(pid(p), p, now) {
                            Some(w) => {
                                prop_assert!(w.value > *word.get(&w.slot).unwrap_or(&0));
                                prop_assert!(waiting.insert((w.slot, w.value), (p, now)).is_none());
                            }
                            None => prop_assert_eq!(waiting.len(), 4),
                        }
                    }
                    Op::Land(i) => {
                        let pending = b.pending();
                        if let Some((slot, _)) = pending.get(i) {
                            for w in b.landed(&[*slot]) { apply(&w, &mut word, &mut waiting)?; }
                        }
                    }
                    Op::Look(secs) => {
                        now += Duration::from_secs(secs);
                        let look = b.look(now, |p| !dead.contains(&p.pid));
                        for w in &look.release { apply(w, &mut word, &mut waiting)?; }
                        for p in look.missed { released_alive.insert(p.pid); }
                        // Nothing pending past the deadline, or of a dead producer.
                        let overdue = waiting.values().any(|(p, since)| {
                            dead.contains(p) || now.duration_since(*since) >= DEADLINE
                        });
                        prop_assert!(!overdue, "a wait outlived its producer or the deadline");
                    }
                    Op::Died(p) => {
                        dead.insert(p);
                        released_alive.remove(&p);
                        for w in b.died(&pid(p)) { apply(&w, &mut word, &mut waiting)?; }
                    }
                    Op::Cut(p) => {
                        released_alive.insert(p);
                        for w in b.cut(&pid(p)) { apply(&w, &mut word, &mut waiting)?; }
                    }
                    Op::Renamed(p) => {
                        // Each producer's waits here follow its one event (`p` itself).
                        let writes = b.renamed(&pid(p), |e| *e == p);
                        prop_assert_eq!(writes.len(), waiting.values().filter(|(q, _)| *q == p).count());
                        for w in writes { apply(&w, &mut word, &mut waiting)?; }
                    }
                }
                prop_assert_eq!(b.pending_count(), waiting.len());
                prop_assert!(b.pending_count() <= 4);
                for p in 0..3 {
                    prop_assert_eq!(b.unsafe_to_free(&pid(p)), released_alive.contains(&p));
                }
            }
            for w in b.drain() { apply(&w, &mut word, &mut waiting)?; }
            prop_assert!(waiting.is_empty(), "every wait is released");
        }
    }
}
