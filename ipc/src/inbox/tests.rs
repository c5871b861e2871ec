//! The lanes of a fence inbox: one unit test per rule of the module docs, then the whole
//! state machine against a simple model of producers, their device writes and a clock,
//! checking after every step that no wait outlives its deadline (liveness), that no lane is
//! released while each of its slots with a value pending makes progress (safety; each slot
//! has its own deadline), that a dead producer's lane with values pending is released at
//! the first observation that finds it dead, that memory behind a lane released under a
//! live producer is kept (`unsafe_to_free`), and that lanes stay inside their area.
//!
//! Time is a base `Instant` plus offsets; nothing sleeps.

use super::*;
use baton_messages::BootId;
use proptest::prelude::*;

/// The first slot of the lane area (the slots before it are the consumer's own marks).
const AREA_FIRST: u32 = 3;
/// Slots per lane.
const SLOTS: u32 = 2;
const DEADLINE: Duration = Duration::from_millis(100);

fn peer(n: u32) -> ProcessId {
    ProcessId {
        boot: BootId([7; 16]),
        pid: 1000 + n,
        start_ticks: 50 + u64::from(n),
    }
}

fn lanes(capacity: u32) -> Lanes {
    Lanes::new(AREA_FIRST, capacity, SLOTS, DEADLINE)
}

/// The inbox as the device holds it: every slot, zeroed.
fn inbox(capacity: u32) -> Vec<u64> {
    vec![0; (AREA_FIRST + capacity * SLOTS) as usize]
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The byte offset of inbox slot `slot`.
fn offset(slot: u32) -> u64 {
    u64::from(slot) * 8
}

fn range(first: u32) -> ReleaseRange {
    ReleaseRange {
        first,
        slots: SLOTS,
    }
}

/// Performs release writes on `mem` as the device would (the subject's release value).
fn write_releases(l: &Lanes, mem: &mut [u64], ranges: &[ReleaseRange]) {
    for r in ranges {
        let value = l.release_value(r.first);
        for s in r.first..r.first + r.slots {
            mem[s as usize] = value;
        }
    }
}

/// What an observation decided (releases, cuts), without the late reports (a log line's
/// worth; checked on their own).
fn decided(o: Observation) -> Observation {
    Observation { late: vec![], ..o }
}

fn all_alive(_: &ProcessId) -> bool {
    true
}

fn all_dead(_: &ProcessId) -> bool {
    false
}

/// Grants `peer` a lane and returns its first slot.
fn first_slot(lanes: &mut Lanes, peer: &ProcessId, now: Instant) -> u32 {
    let (first, slots, base) = lanes.grant(peer, now).expect("a lane is free");
    assert_eq!((slots, base), (SLOTS, 0));
    first
}

/// A lane of `a` whose named value 1 never lands, released at the deadline while `a` lives.
/// Returns the lanes, the lane's first slot and the time of the release.
fn missed_lane(a: &ProcessId, t0: Instant) -> (Lanes, u32, Instant) {
    let mut l = lanes(4);
    let first = first_slot(&mut l, a, t0);
    l.announce(a, offset(first), 1, t0).unwrap();
    let out = l.observe(&inbox(4), t0 + DEADLINE, all_alive);
    assert_eq!(out.missed, vec![*a]);
    assert_eq!(l.status(a), Some(LaneStatus::Released));
    // What the missed deadline reports: the slot, the value named, the value seen.
    assert_eq!(
        l.pending_slots(a),
        vec![PendingSlot {
            slot: first,
            named: 1,
            seen: 0
        }]
    );
    (l, first, t0 + DEADLINE)
}

// ---- Refusals -------------------------------------------------------------------------

#[test]
fn a_fence_outside_the_senders_lane_is_refused_and_changes_nothing() {
    let t0 = Instant::now();
    let (a, b) = (peer(1), peer(2));
    let mut l = lanes(4);
    let a_first = first_slot(&mut l, &a, t0);
    let b_first = first_slot(&mut l, &b, t0);
    let area_end = AREA_FIRST + 4 * SLOTS;
    let outside = [
        offset(b_first), // another peer's lane
        offset(b_first + 1),
        offset(AREA_FIRST - 1), // the consumer's own marks, before the area
        offset(0),
        offset(a_first + SLOTS), // just past the sender's lane
        offset(area_end),        // past the whole inbox
        offset(a_first) + 4,     // inside the sender's lane, but not a slot
        offset(a_first + 1) + 1,
        u64::MAX,
        offset(a_first) + (1 << 40), // far away
    ];
    for &off in &outside {
        assert_eq!(
            l.announce(&a, off, 1, t0),
            Err(FenceRefusal::OutsideLane { offset: off }),
            "offset {off}"
        );
        assert!(!l.may_wait(&a, off), "offset {off}");
    }
    assert_eq!(l.status(&a), Some(LaneStatus::Live));
    assert_eq!(l.status(&b), Some(LaneStatus::Live));
    assert!(!l.needs_observing(), "a refused fence names no value");
    let out = l.observe(&inbox(4), t0 + DEADLINE * 10, all_alive);
    assert_eq!(
        decided(out),
        Observation::default(),
        "a refused fence starts no deadline"
    );

    // With a value pending, a refused fence neither clears nor restarts its deadline.
    let t1 = t0 + DEADLINE * 20;
    l.announce(&a, offset(a_first), 1, t1).unwrap();
    assert!(l.needs_observing());
    for &off in &outside {
        let _ = l.announce(&a, off, 2, t1 + ms(60));
    }
    assert!(l.needs_observing());
    assert_eq!(l.status(&a), Some(LaneStatus::Live));
    let out = l.observe(&inbox(4), t1 + DEADLINE, all_alive);
    assert_eq!(
        out.missed,
        vec![a],
        "the deadline still runs from the named value"
    );
    assert_eq!(out.release, vec![range(a_first)]);
}

#[test]
fn a_fence_from_a_peer_with_no_lane_is_refused_and_changes_nothing() {
    let t0 = Instant::now();
    let (a, stranger) = (peer(1), peer(2));
    let mut l = lanes(4);
    let a_first = first_slot(&mut l, &a, t0);
    for off in [
        offset(a_first),
        offset(a_first + 1),
        offset(AREA_FIRST + 2 * SLOTS),
    ] {
        assert_eq!(l.announce(&stranger, off, 1, t0), Err(FenceRefusal::NoLane));
        assert!(!l.may_wait(&stranger, off));
    }
    assert_eq!(l.status(&stranger), None);
    assert_eq!(l.status(&a), Some(LaneStatus::Live));
    assert_eq!(l.lent(), (1, 4), "a refused fence lends no lane");
    assert!(!l.needs_observing());
    let out = l.observe(&inbox(4), t0 + DEADLINE * 10, all_alive);
    assert_eq!(decided(out), Observation::default());
}

#[test]
fn a_fence_more_than_max_value_step_above_its_slots_floor_is_refused_and_changes_nothing() {
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(4);
    let first = first_slot(&mut l, &a, t0);
    let (s0, s1) = (offset(first), offset(first + 1));

    // From a fresh slot (floor 0): exactly the step is accepted, one more is not.
    assert_eq!(l.announce(&a, s0, MAX_VALUE_STEP, t0), Ok(()));
    assert_eq!(
        l.announce(&a, s1, MAX_VALUE_STEP + 1, t0),
        Err(FenceRefusal::ValueTooFar {
            value: MAX_VALUE_STEP + 1,
            floor: 0
        })
    );
    // The floor follows the highest value named on the slot.
    assert_eq!(
        l.announce(&a, s0, 2 * MAX_VALUE_STEP + 1, t0),
        Err(FenceRefusal::ValueTooFar {
            value: 2 * MAX_VALUE_STEP + 1,
            floor: MAX_VALUE_STEP
        })
    );
    assert_eq!(l.announce(&a, s0, 2 * MAX_VALUE_STEP, t0), Ok(()));

    // Slot 0 lands what was named; slot 1 holds 500 that nobody named.
    let mut mem = inbox(4);
    mem[first as usize] = 2 * MAX_VALUE_STEP;
    mem[first as usize + 1] = 500;
    assert_eq!(
        l.observe(&mem, t0 + ms(10), all_alive),
        Observation::default()
    );
    assert!(
        !l.needs_observing(),
        "the refused value on slot 1 was not recorded as named"
    );

    // ... and the floor follows what the slot held too.
    assert_eq!(
        l.announce(&a, s1, 500 + MAX_VALUE_STEP + 1, t0 + ms(10)),
        Err(FenceRefusal::ValueTooFar {
            value: 500 + MAX_VALUE_STEP + 1,
            floor: 500
        })
    );
    assert!(!l.needs_observing());
    assert_eq!(l.status(&a), Some(LaneStatus::Live));
    let out = l.observe(&mem, t0 + DEADLINE * 10, all_alive);
    assert_eq!(
        decided(out),
        Observation::default(),
        "no refused value is waited for"
    );

    // With a value pending, a refused fence neither clears nor restarts its deadline.
    let t1 = t0 + DEADLINE * 20;
    assert_eq!(l.announce(&a, s1, 500 + MAX_VALUE_STEP, t1), Ok(()));
    let too_far = 500 + 2 * MAX_VALUE_STEP + 1;
    assert!(l.announce(&a, s1, too_far, t1 + ms(60)).is_err());
    assert!(l.needs_observing());
    assert_eq!(l.status(&a), Some(LaneStatus::Live));
    let out = l.observe(&mem, t1 + DEADLINE, all_alive);
    assert_eq!(
        out.missed,
        vec![a],
        "the deadline still runs from the named value"
    );
}

// ---- Deadlines --------------------------------------------------------------------------

#[test]
fn a_lane_whose_producer_keeps_making_progress_is_never_released_however_long_the_run() {
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(4);
    let first = first_slot(&mut l, &a, t0);
    // Named far ahead, written one by one, each a hair inside the deadline: a slow but
    // honest producer, for a thousand deadlines.
    l.announce(&a, offset(first), 1_000_000, t0).unwrap();
    let mut mem = inbox(4);
    let step = DEADLINE - ms(1);
    for n in 1..=1000u32 {
        mem[first as usize] = u64::from(n);
        let out = l.observe(&mem, t0 + step * n, all_alive);
        assert_eq!(decided(out), Observation::default(), "observation {n}");
        assert_eq!(l.status(&a), Some(LaneStatus::Live));
        assert!(l.needs_observing());
    }
    assert!(!l.unsafe_to_free(&a, offset(first)));
}

#[test]
fn a_lane_late_by_a_quarter_of_the_deadline_is_reported_once_per_stall_and_not_released() {
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(4);
    let first = first_slot(&mut l, &a, t0);
    l.announce(&a, offset(first), 3, t0).unwrap();
    let mut mem = inbox(4);
    let quarter = DEADLINE / 4;
    assert_eq!(
        l.observe(&mem, t0 + quarter - ms(1), all_alive),
        Observation::default()
    );
    let out = l.observe(&mem, t0 + quarter, all_alive);
    assert_eq!(
        (out.late, out.missed, out.release),
        (vec![a], vec![], vec![])
    );
    // Once per stall: not again while it makes no progress.
    assert_eq!(
        l.observe(&mem, t0 + DEADLINE / 2, all_alive),
        Observation::default()
    );
    // Progress (1 of 3 landed) ends the stall; the next one is reported again.
    mem[first as usize] = 1;
    let t1 = t0 + DEADLINE * 3 / 4;
    assert_eq!(l.observe(&mem, t1, all_alive), Observation::default());
    assert_eq!(l.observe(&mem, t1 + quarter, all_alive).late, vec![a]);
    assert_eq!(l.status(&a), Some(LaneStatus::Live));
    // Nothing pending is never late, however long it is silent.
    mem[first as usize] = 3;
    for n in 1..=10u32 {
        assert_eq!(
            l.observe(&mem, t1 + DEADLINE * n, all_alive),
            Observation::default()
        );
    }
}

#[test]
fn a_lane_with_nothing_pending_is_never_released_however_long_it_is_silent() {
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(4);
    let first = first_slot(&mut l, &a, t0);
    l.announce(&a, offset(first), 3, t0).unwrap();
    let mut mem = inbox(4);
    mem[first as usize] = 3;
    assert_eq!(
        l.observe(&mem, t0 + ms(5), all_alive),
        Observation::default()
    );
    assert!(!l.needs_observing());
    for n in 1..=100u32 {
        let out = l.observe(&mem, t0 + DEADLINE * n * 10, all_alive);
        assert_eq!(decided(out), Observation::default());
    }
    assert_eq!(l.status(&a), Some(LaneStatus::Live));
}

#[test]
fn the_deadline_starts_when_a_value_is_named_not_when_the_lane_was_granted() {
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(4);
    let first = first_slot(&mut l, &a, t0);
    let mut mem = inbox(4);
    // Named long after the grant.
    let t1 = t0 + DEADLINE * 50;
    l.announce(&a, offset(first), 1, t1).unwrap();
    let out = l.observe(&mem, t1 + DEADLINE - ms(1), all_alive);
    assert_eq!(decided(out), Observation::default());
    // It lands; a quiet spell; the next value starts a fresh deadline.
    mem[first as usize] = 1;
    assert_eq!(
        l.observe(&mem, t1 + DEADLINE, all_alive),
        Observation::default()
    );
    let t2 = t1 + DEADLINE * 50;
    l.announce(&a, offset(first + 1), 1, t2).unwrap();
    let out = l.observe(&mem, t2 + DEADLINE - ms(1), all_alive);
    assert_eq!(decided(out), Observation::default());
    let out = l.observe(&mem, t2 + DEADLINE, all_alive);
    assert_eq!(out.missed, vec![a]);
}

#[test]
fn a_lane_without_progress_for_the_deadline_is_released_at_the_first_observation_at_or_after_it() {
    for late in [ms(0), ms(1), DEADLINE * 3] {
        let t0 = Instant::now();
        let (a, b) = (peer(1), peer(2));
        let mut l = lanes(4);
        let a_first = first_slot(&mut l, &a, t0);
        let b_first = first_slot(&mut l, &b, t0);
        l.announce(&a, offset(a_first + 1), 2, t0).unwrap();
        // `b` names values too, and writes them.
        l.announce(&b, offset(b_first), 1, t0).unwrap();
        let mut mem = inbox(4);
        mem[b_first as usize] = 1;
        for n in [1, 10, 50, 99] {
            let out = l.observe(&mem, t0 + ms(n), all_alive);
            assert_eq!(
                decided(out),
                Observation::default(),
                "before the deadline, at {n} ms"
            );
            assert_eq!(l.status(&a), Some(LaneStatus::Live));
        }
        let out = l.observe(&mem, t0 + DEADLINE + late, all_alive);
        assert_eq!(out.missed, vec![a], "late by {late:?}");
        assert_eq!(out.release, vec![range(a_first)], "exactly the lane of `a`");
        assert_eq!(l.status(&a), Some(LaneStatus::Released));
        assert_eq!(l.status(&b), Some(LaneStatus::Live));
    }
}

#[test]
fn naming_more_values_does_not_restart_the_deadline() {
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(4);
    let first = first_slot(&mut l, &a, t0);
    // A producer that keeps naming values and writes none.
    for (v, at) in [(1, 0), (2, 50), (3, 90), (4, 99)] {
        let slot = first + (v % 2) as u32;
        l.announce(&a, offset(slot), v, t0 + ms(at)).unwrap();
        let out = l.observe(&inbox(4), t0 + ms(at), all_alive);
        assert_eq!(decided(out), Observation::default());
    }
    let out = l.observe(&inbox(4), t0 + DEADLINE, all_alive);
    assert_eq!(
        out.missed,
        vec![a],
        "the deadline runs from the first value named"
    );
}

#[test]
fn progress_restarts_the_deadline() {
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(4);
    let first = first_slot(&mut l, &a, t0);
    l.announce(&a, offset(first), 5, t0).unwrap();
    let mut mem = inbox(4);
    mem[first as usize] = 2;
    let t1 = t0 + ms(60);
    assert_eq!(l.observe(&mem, t1, all_alive), Observation::default());
    let out = l.observe(&mem, t1 + DEADLINE - ms(1), all_alive);
    assert_eq!(
        decided(out),
        Observation::default(),
        "progress at {t1:?} restarted it"
    );
    let out = l.observe(&mem, t1 + DEADLINE, all_alive);
    assert_eq!(out.missed, vec![a]);
    assert_eq!(out.release, vec![range(first)]);
}

#[test]
fn a_stuck_slot_is_released_even_while_another_slot_of_its_lane_makes_progress() {
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(4);
    let first = first_slot(&mut l, &a, t0);
    // Slot 0: value 1 is named and never lands.
    l.announce(&a, offset(first), 1, t0).unwrap();
    // Slot 1, another release stream of `a`: every half deadline a value is named and the
    // one before it written, a fresh rise each time.
    let mut mem = inbox(4);
    let half = DEADLINE / 2;
    let rise = |l: &mut Lanes, mem: &mut [u64], n: u32| {
        let now = t0 + half * n;
        l.announce(&a, offset(first + 1), u64::from(n) + 1, now)
            .unwrap();
        mem[first as usize + 1] = u64::from(n);
        l.observe(mem, now, all_alive)
    };
    assert_eq!(decided(rise(&mut l, &mut mem, 1)), Observation::default());
    let out = l.observe(&mem, t0 + DEADLINE - ms(1), all_alive);
    assert_eq!(
        decided(out),
        Observation::default(),
        "just before the deadline"
    );
    assert_eq!(l.status(&a), Some(LaneStatus::Live));
    // The first observation at the deadline from the naming of slot 0: released, though
    // slot 1 rose in this very observation.
    let out = rise(&mut l, &mut mem, 2);
    assert_eq!(
        out.missed,
        vec![a],
        "slot 0 made no progress for the deadline"
    );
    assert_eq!(out.release, vec![range(first)], "the whole lane");
    assert_eq!(l.status(&a), Some(LaneStatus::Released));
    for s in 0..SLOTS {
        assert!(l.unsafe_to_free(&a, offset(first + s)), "slot {s}");
    }
    // Kept released while `a` lives (its late writes go on), reported once.
    let out = rise(&mut l, &mut mem, 3);
    assert_eq!(out.release, vec![range(first)]);
    assert!(out.missed.is_empty());
}

// ---- Released lanes ---------------------------------------------------------------------

#[test]
fn a_released_lane_of_a_live_producer_is_released_at_every_observation_then_once_after_its_death() {
    let t0 = Instant::now();
    let a = peer(1);
    let (mut l, first, t1) = missed_lane(&a, t0);
    let mut mem = inbox(4);
    for n in 1..=5u32 {
        // A late write of its own lowers a slot under a wait still queued.
        mem[first as usize] = u64::from(n);
        let out = l.observe(&mem, t1 + ms(10) * n, all_alive);
        assert_eq!(out.release, vec![range(first)], "observation {n}");
        assert!(out.missed.is_empty(), "reported once only");
        assert!(l.needs_observing());
        assert_eq!(l.status(&a), Some(LaneStatus::Released));
    }
    // It dies: one last release; then read back for a deadline, and released again only
    // if a write of its own in flight at its death lowers a slot.
    let out = l.observe(&mem, t1 + ms(100), all_dead);
    assert_eq!(out.release, vec![range(first)]);
    assert!(out.missed.is_empty());
    assert_eq!(l.status(&a), Some(LaneStatus::Dead));
    write_releases(&l, &mut mem, &out.release);
    let died = t1 + ms(200);
    assert_eq!(l.observe(&mem, died, all_dead), Observation::default());
    assert!(
        l.needs_observing(),
        "watched for a deadline after its death"
    );
    mem[first as usize] = 9;
    let out = l.observe(&mem, died + ms(10), all_dead);
    assert_eq!((out.release, out.lowered), (vec![range(first)], vec![a]));
    write_releases(&l, &mut mem, &[range(first)]);
    assert_eq!(
        l.observe(&mem, died + DEADLINE, all_dead),
        Observation::default()
    );
    assert!(!l.needs_observing(), "settled a deadline after its death");
    for alive in [all_dead, all_alive] {
        mem[first as usize] = 10;
        let out = l.observe(&mem, died + DEADLINE * 2, alive);
        assert_eq!(out, Observation::default());
    }
    assert!(l.producer_died(&a).is_empty());
}

#[test]
fn a_released_lane_is_released_one_last_time_when_its_producer_is_reported_dead() {
    let t0 = Instant::now();
    let a = peer(1);
    let (mut l, first, t1) = missed_lane(&a, t0);
    let mut mem = inbox(4);
    assert_eq!(l.producer_died(&a), vec![range(first)]);
    write_releases(&l, &mut mem, &[range(first)]);
    assert_eq!(l.status(&a), Some(LaneStatus::Dead));
    assert!(
        l.needs_observing(),
        "watched for a deadline after its death"
    );
    assert!(l.producer_died(&a).is_empty(), "released once");
    for (n, alive) in [all_alive, all_dead].into_iter().enumerate() {
        let out = l.observe(&mem, t1 + DEADLINE * n as u32, alive);
        assert_eq!(out, Observation::default());
    }
    assert!(!l.needs_observing());
    assert!(
        l.producer_cut(&a).is_empty(),
        "a dead lane is not revived by a cut"
    );
}

#[test]
fn producer_died_releases_every_lane_of_that_producer_once() {
    let t0 = Instant::now();
    let (a, b) = (peer(1), peer(2));
    let mut l = lanes(4);
    let old = first_slot(&mut l, &a, t0);
    assert_eq!(l.producer_cut(&a), vec![range(old)]);
    let new = first_slot(&mut l, &a, t0);
    assert_ne!(new, old);
    l.announce(&a, offset(new), 1, t0).unwrap();
    let b_first = first_slot(&mut l, &b, t0);
    l.announce(&b, offset(b_first), 1, t0).unwrap();

    // Released at once, well before the deadline, whatever state each lane was in.
    let mut got = l.producer_died(&a);
    got.sort_by_key(|r| r.first);
    let mut want = vec![range(old), range(new)];
    want.sort_by_key(|r| r.first);
    assert_eq!(got, want);
    assert_eq!(l.status(&a), Some(LaneStatus::Dead));
    assert_eq!(
        l.status(&b),
        Some(LaneStatus::Live),
        "another producer's lane is kept"
    );
    assert!(l.producer_died(&a).is_empty(), "once");
    let mut mem = inbox(4);
    write_releases(&l, &mut mem, &got);
    let alive = |p: &ProcessId| *p == b;
    let out = l.observe(&mem, t0 + ms(1), alive);
    assert_eq!(decided(out), Observation::default());
    assert!(l.needs_observing(), "`b`'s value is pending");
    let out = l.observe(&mem, t0 + DEADLINE, alive);
    assert_eq!(out.missed, vec![b]);
    assert_eq!(out.release, vec![range(b_first)], "never `a`'s lanes again");
}

#[test]
fn a_dead_producers_pending_lane_is_released_at_the_first_observation() {
    // Found dead at once, or only long past its deadline: released in that observation,
    // never reported as having missed it.
    for late in [ms(0), ms(1), DEADLINE * 3] {
        let t0 = Instant::now();
        let (a, b, c) = (peer(1), peer(2), peer(3));
        let mut l = lanes(4);
        let a_first = first_slot(&mut l, &a, t0);
        let b_first = first_slot(&mut l, &b, t0);
        let c_first = first_slot(&mut l, &c, t0);
        let mut mem = inbox(4);
        // `a` named a value on slot 1 and died before writing it.
        l.announce(&a, offset(a_first + 1), 1, t0).unwrap();
        // `b` named a value and wrote it before dying: nothing pending.
        l.announce(&b, offset(b_first), 1, t0).unwrap();
        mem[b_first as usize] = 1;
        // `c` lives, with a value pending, named just now.
        l.announce(&c, offset(c_first), 1, t0 + late).unwrap();
        let alive = |p: &ProcessId| *p == c;
        let out = l.observe(&mem, t0 + late, alive);
        write_releases(&l, &mut mem, &out.release);
        assert_eq!(out.release, vec![range(a_first)], "late by {late:?}");
        assert!(out.missed.is_empty(), "late by {late:?}: {out:?}");
        assert_eq!(l.status(&a), Some(LaneStatus::Dead));
        for s in 0..SLOTS {
            assert!(!l.unsafe_to_free(&a, offset(a_first + s)), "slot {s}");
        }
        assert_eq!(
            l.status(&b),
            Some(LaneStatus::Live),
            "a dead producer's lane with nothing pending is left alone"
        );
        assert_eq!(l.status(&c), Some(LaneStatus::Live));
        // Never released again; `b`'s lane still is when it is reported dead.
        let out = l.observe(&mem, t0 + late + ms(1), alive);
        assert!(!out.release.contains(&range(a_first)), "{out:?}");
        assert!(l.producer_died(&a).is_empty());
        assert_eq!(l.producer_died(&b), vec![range(b_first)]);
        assert_eq!(l.status(&b), Some(LaneStatus::Dead));
    }
}

#[test]
fn memory_behind_a_lane_released_while_its_producer_lives_is_unsafe_to_free() {
    let t0 = Instant::now();
    let (a, b, c) = (peer(1), peer(2), peer(3));
    let (mut l, a_first, t1) = missed_lane(&a, t0);
    let b_first = first_slot(&mut l, &b, t1);
    let c_first = first_slot(&mut l, &c, t1);
    assert_eq!(l.producer_cut(&b), vec![range(b_first)]);
    for s in 0..SLOTS {
        assert!(
            l.unsafe_to_free(&a, offset(a_first + s)),
            "missed, slot {s}"
        );
        assert!(l.unsafe_to_free(&b, offset(b_first + s)), "cut, slot {s}");
        assert!(!l.unsafe_to_free(&c, offset(c_first + s)), "live, slot {s}");
        // Only for the producer it was lent to.
        assert!(!l.unsafe_to_free(&c, offset(a_first + s)));
        assert!(!l.unsafe_to_free(&a, offset(b_first + s)));
    }
    // Still so after they link again and get fresh lanes, while they live.
    let a_new = first_slot(&mut l, &a, t1);
    let out = l.observe(&inbox(4), t1 + ms(10), all_alive);
    assert_eq!(out.release.len(), 2);
    assert!(l.unsafe_to_free(&a, offset(a_first)));
    assert!(l.unsafe_to_free(&b, offset(b_first)));
    assert!(!l.unsafe_to_free(&a, offset(a_new)));
}

#[test]
fn memory_behind_a_live_lane_or_a_dead_producers_lane_is_safe_to_free() {
    let t0 = Instant::now();
    let (a, b, c, d) = (peer(1), peer(2), peer(3), peer(4));
    let mut l = lanes(4);
    let firsts: Vec<u32> = [a, b, c, d]
        .iter()
        .map(|p| {
            let first = first_slot(&mut l, p, t0);
            l.announce(p, offset(first), 1, t0).unwrap();
            first
        })
        .collect();
    // `a` is reported dead while live; `b` dies unreported with its value pending; `c` is
    // cut, then reported dead; `d` stays live and misses its deadline.
    let mut mem = inbox(4);
    let died = l.producer_died(&a);
    write_releases(&l, &mut mem, &died);
    let cut = l.producer_cut(&c);
    write_releases(&l, &mut mem, &cut);
    assert!(l.unsafe_to_free(&c, offset(firsts[2])));
    l.producer_died(&c);
    let alive = |p: &ProcessId| *p == d;
    // `b`'s lane is released at the first observation that finds it dead, well before its
    // deadline, and `b` is not reported as having missed it.
    let out = l.observe(&mem, t0 + ms(1), alive);
    write_releases(&l, &mut mem, &out.release);
    assert_eq!(
        out,
        Observation {
            missed: vec![],
            release: vec![range(firsts[1])],
            late: vec![],
            lowered: vec![],
        }
    );
    let out = l.observe(&mem, t0 + DEADLINE - ms(1), alive);
    assert_eq!(out.release, vec![], "`b` is released once");
    assert_eq!(out.late, vec![d], "`d` is late, not yet missed");
    let out = l.observe(&mem, t0 + DEADLINE, alive);
    assert_eq!(out.missed, vec![d], "only `d` missed");
    assert_eq!(out.release, vec![range(firsts[3])]);
    // `d`'s lane is released while it lives: the one unsafe case.
    for (p, first) in [a, b, c].iter().zip(&firsts) {
        assert_eq!(l.status(p), Some(LaneStatus::Dead), "{p}");
        for s in 0..SLOTS {
            assert!(!l.unsafe_to_free(p, offset(first + s)), "{p} slot {s}");
        }
    }
    assert!(l.unsafe_to_free(&d, offset(firsts[3])));
    l.producer_died(&d);
    assert!(!l.unsafe_to_free(&d, offset(firsts[3])));
}

// ---- Grants -----------------------------------------------------------------------------

#[test]
fn a_live_producer_asking_again_gets_the_same_lane() {
    let t0 = Instant::now();
    let (a, b) = (peer(1), peer(2));
    let mut l = lanes(4);
    let first = l.grant(&a, t0).unwrap();
    l.grant(&b, t0).unwrap();
    l.announce(&a, offset(first.0), 1, t0).unwrap();
    for n in 1..=5 {
        assert_eq!(l.grant(&a, t0 + ms(n)), Some(first));
    }
    assert_eq!(l.lent(), (2, 4));
    assert!(l.needs_observing(), "asking again forgets no named value");
}

#[test]
fn a_producer_whose_lane_was_released_gets_a_fresh_different_lane() {
    let t0 = Instant::now();
    let (a, b) = (peer(1), peer(2));
    let (mut l, missed, t1) = missed_lane(&a, t0);
    let b_old = first_slot(&mut l, &b, t1);
    l.producer_cut(&b);
    for (p, old) in [(a, missed), (b, b_old)] {
        let fresh = first_slot(&mut l, &p, t1);
        assert_ne!(fresh, old, "{p}");
        assert_eq!(l.status(&p), Some(LaneStatus::Live));
        // Its new fences name the fresh lane; one still queued from the released lane
        // passes (its wait was released with the lane), whatever its value.
        assert_eq!(l.announce(&p, offset(fresh), 1, t1), Ok(()));
        assert!(l.may_wait(&p, offset(fresh)));
        assert_eq!(l.announce(&p, offset(old), u64::MAX, t1), Ok(()));
        assert!(l.may_wait(&p, offset(old)));
        assert_eq!(
            l.status(&p),
            Some(LaneStatus::Live),
            "the fresh lane is current"
        );
        assert_eq!(l.grant(&p, t1), Some((fresh, SLOTS, 0)), "and keeps it");
    }
    assert_eq!(l.lent(), (4, 4));
}

#[test]
fn grants_stop_at_capacity_and_lanes_never_overlap() {
    let t0 = Instant::now();
    let capacity = 5;
    let mut l = lanes(capacity);
    let mut firsts = Vec::new();
    for n in 0..capacity {
        firsts.push(first_slot(&mut l, &peer(n), t0));
    }
    assert_eq!(l.lent(), (capacity, capacity));
    assert_eq!(l.grant(&peer(99), t0), None, "every lane is lent");
    // A producer released at capacity gets none either, and nothing is lent twice.
    l.producer_cut(&peer(0));
    assert_eq!(l.grant(&peer(0), t0), None);
    assert_eq!(l.lent(), (capacity, capacity));
    // The others still have theirs.
    for n in 1..capacity {
        assert_eq!(l.grant(&peer(n), t0), Some((firsts[n as usize], SLOTS, 0)));
    }
    let end = AREA_FIRST + capacity * SLOTS;
    for (i, &f) in firsts.iter().enumerate() {
        assert!(f >= AREA_FIRST && f + SLOTS <= end, "lane {i} at {f}");
        for &g in &firsts[i + 1..] {
            assert!(
                f + SLOTS <= g || g + SLOTS <= f,
                "lanes at {f} and {g} overlap"
            );
        }
    }
}

#[test]
fn a_flood_of_fences_from_an_honest_producer_keeps_one_live_lane() {
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(4);
    let first = first_slot(&mut l, &a, t0);
    let mut mem = inbox(4);
    for v in 1..=100_000u64 {
        let now = t0 + ms(v);
        assert_eq!(l.announce(&a, offset(first), v, now), Ok(()));
        // Its writes follow one behind.
        mem[first as usize] = v - 1;
        if v % 50 == 0 {
            let out = l.observe(&mem, now, all_alive);
            assert_eq!(decided(out), Observation::default(), "value {v}");
            assert_eq!(l.status(&a), Some(LaneStatus::Live));
        }
        if v % 10_000 == 0 {
            assert_eq!(l.grant(&a, now), Some((first, SLOTS, 0)));
        }
    }
    assert_eq!(l.lent(), (1, 4));
    assert_eq!(l.lanes.len(), 1);
    assert_eq!(l.current.len(), 1);
    for (_, lane) in &l.lanes {
        assert_eq!(lane.announced.len(), SLOTS as usize);
        assert_eq!(lane.seen.len(), SLOTS as usize);
    }
    mem[first as usize] = 100_000;
    let out = l.observe(&mem, t0 + ms(100_001), all_alive);
    assert_eq!(decided(out), Observation::default());
    assert!(!l.needs_observing());
}

// ---- The model --------------------------------------------------------------------------

/// Peers in the property test.
const PEERS: usize = 4;
/// Lanes in the property test: fewer than the peers' grants over a run, so grants run out.
const CAPACITY: u32 = 6;
/// The longest step between two observations, in milliseconds.
const MAX_STEP_MS: u64 = 40;
const DEADLINE_MS: u64 = 100;

/// Which offset a fence names.
#[derive(Debug, Clone)]
enum Target {
    /// This slot of the sender's current lane.
    Own(u32),
    /// Any inbox slot, or one past the inbox.
    Anywhere(u32),
    /// A byte inside the sender's lane that starts no slot.
    Misaligned(u64),
}

/// Which value a fence names, from its slot's floor.
#[derive(Debug, Clone)]
enum Named {
    /// `floor + k`: what an honest producer names.
    Next(u64),
    /// `floor + MAX_VALUE_STEP`: the furthest allowed (and likely never written).
    AtStep,
    /// `floor + MAX_VALUE_STEP + k`: forged, refused.
    PastStep(u64),
    /// `floor - k`: already named or landed.
    Old(u64),
}

/// One step. Peer indexes pick among `PEERS`; a dead peer does nothing.
#[derive(Debug, Clone)]
enum Op {
    Grant(usize),
    Announce {
        peer: usize,
        target: Target,
        value: Named,
    },
    /// The peer's stream writes slot `slot` of one of its lanes (`lane` taken modulo its
    /// lanes): up to `amount` values further (all it named if `None`).
    Land {
        peer: usize,
        lane: usize,
        slot: u32,
        amount: Option<u64>,
    },
    /// A stalled peer names values but writes nothing.
    Stall(usize, bool),
    /// The watch thread reads the inbox back, `ms` later.
    Observe(u64),
    /// The peer dies; `notify`: the node learns it and calls `producer_died`.
    Die {
        peer: usize,
        notify: bool,
    },
    Cut(usize),
    /// A dead peer's write that was in flight when it died lands in one of its lanes
    /// (`lane` taken modulo its lanes), below the release written there.
    LateWrite {
        peer: usize,
        lane: usize,
        slot: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let target = prop_oneof![
        8 => (0..SLOTS).prop_map(Target::Own),
        1 => (0..AREA_FIRST + CAPACITY * SLOTS + 2).prop_map(Target::Anywhere),
        1 => (1u64..8 * u64::from(SLOTS)).prop_map(Target::Misaligned),
    ];
    let named = prop_oneof![
        8 => (1u64..4).prop_map(Named::Next),
        1 => Just(Named::AtStep),
        1 => (1u64..4).prop_map(Named::PastStep),
        1 => (0u64..4).prop_map(Named::Old),
    ];
    prop_oneof![
        8 => (0..PEERS).prop_map(Op::Grant),
        30 => (0..PEERS, target, named)
            .prop_map(|(peer, target, value)| Op::Announce { peer, target, value }),
        25 => (0..PEERS, 0usize..3, 0..SLOTS, prop::option::weighted(0.7, 1u64..4))
            .prop_map(|(peer, lane, slot, amount)| Op::Land { peer, lane, slot, amount }),
        4 => (0..PEERS, any::<bool>()).prop_map(|(p, s)| Op::Stall(p, s)),
        28 => (1..=MAX_STEP_MS).prop_map(Op::Observe),
        2 => (0..PEERS, any::<bool>()).prop_map(|(peer, notify)| Op::Die { peer, notify }),
        3 => (0..PEERS).prop_map(Op::Cut),
        3 => (0..PEERS, 0usize..3, 0..SLOTS)
            .prop_map(|(peer, lane, slot)| Op::LateWrite { peer, lane, slot }),
    ]
}

/// A lane as the model sees it.
#[derive(Debug)]
struct MLane {
    owner: usize,
    first: u32,
    /// What the subject's status must be.
    status: LaneStatus,
    /// Highest value named per slot while the lane was live.
    announced: Vec<u64>,
    /// Highest value accepted per slot (live or not): what its producer will write.
    wanted: Vec<u64>,
    /// What its producer's writes put there so far.
    landed: Vec<u64>,
    /// `landed` at the last observation while live.
    seen: Vec<u64>,
    /// Per slot: when a named value last went unlanded after everything named on that slot
    /// had landed (ms).
    pending_since: Vec<u64>,
    /// Per slot: when its producer's writes last raised it while live (ms).
    last_landing: Vec<u64>,
    /// Released (missed or cut) while its producer was alive.
    released_while_alive: bool,
    /// Dead: when an observation first saw it dead (ms).
    died_at: Option<u64>,
    /// Dead, and not found below its release value for a deadline since.
    settled: bool,
}

impl MLane {
    /// Named values not yet written, in truth.
    fn pending(&self) -> bool {
        (0..SLOTS as usize).any(|s| self.slot_pending(s))
    }

    /// A named value of slot `s` not yet written, in truth.
    fn slot_pending(&self, s: usize) -> bool {
        self.announced[s] > self.landed[s]
    }

    /// The longest any slot with a named value pending has gone without progress at `now`
    /// (ms), or `None` when nothing is pending. Each slot has its own deadline.
    fn stuck_for(&self, now: u64) -> Option<u64> {
        (0..SLOTS as usize)
            .filter(|&s| self.slot_pending(s))
            .map(|s| now - self.pending_since[s].max(self.last_landing[s]))
            .max()
    }

    /// Named values not yet seen written by the last observation.
    fn seen_pending(&self) -> bool {
        self.announced.iter().zip(&self.seen).any(|(a, s)| a > s)
    }

    fn slot(&self, offset: u64) -> Option<usize> {
        let slot = offset / 8;
        let first = u64::from(self.first);
        (offset % 8 == 0 && slot >= first && slot < first + u64::from(SLOTS))
            .then(|| (slot - first) as usize)
    }
}

struct Run {
    lanes: Lanes,
    base: Instant,
    /// Model time, ms since `base`.
    now: u64,
    /// The inbox as the device holds it.
    mem: Vec<u64>,
    pids: Vec<ProcessId>,
    alive: Vec<bool>,
    stalled: Vec<bool>,
    /// Each peer's current lane (index into `model`).
    current: Vec<Option<usize>>,
    model: Vec<MLane>,
}

impl Run {
    fn new() -> Self {
        Self {
            lanes: Lanes::new(AREA_FIRST, CAPACITY, SLOTS, ms(DEADLINE_MS)),
            base: Instant::now(),
            now: 0,
            mem: inbox(CAPACITY),
            pids: (0..PEERS as u32).map(peer).collect(),
            alive: vec![true; PEERS],
            stalled: vec![false; PEERS],
            current: vec![None; PEERS],
            model: Vec::new(),
        }
    }

    fn at(&self) -> Instant {
        self.base + ms(self.now)
    }

    /// Performs the release writes `ranges` asks for, with the subject's release value.
    fn write_max(&mut self, ranges: &[ReleaseRange]) {
        for r in ranges {
            let value = self.lanes.release_value(r.first);
            for s in r.first..r.first + r.slots {
                self.mem[s as usize] = value;
            }
        }
    }

    fn late_write(&mut self, p: usize, lane: usize, s: u32) {
        if self.alive[p] {
            return;
        }
        let owned: Vec<usize> = (0..self.model.len())
            .filter(|&i| self.model[i].owner == p)
            .collect();
        if owned.is_empty() {
            return;
        }
        let l = &self.model[owned[lane % owned.len()]];
        // In flight when it died: it lands soon after, not after a whole deadline of the
        // lane being read back (the bound the subject assumes; docs/ORDERING.md).
        if !l.settled {
            self.mem[(l.first + s) as usize] = l.landed[s as usize];
        }
    }

    /// Checks `got` names exactly the lanes `want` (model indexes), in any order.
    fn same_lanes(&self, got: &[ReleaseRange], want: &[usize], what: &str) {
        let mut got: Vec<u32> = got
            .iter()
            .map(|r| {
                assert_eq!(r.slots, SLOTS, "{what}: {r:?}");
                r.first
            })
            .collect();
        let mut want: Vec<u32> = want.iter().map(|&i| self.model[i].first).collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want, "{what}");
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Grant(p) => self.grant(p),
            Op::Announce {
                peer,
                ref target,
                ref value,
            } => self.announce(peer, target, value),
            Op::Land {
                peer,
                lane,
                slot,
                amount,
            } => self.land(peer, lane, slot, amount),
            Op::Stall(p, stalled) => self.stalled[p] = stalled,
            Op::Observe(step) => self.observe(step),
            Op::Die { peer, notify } => self.die(peer, notify),
            Op::Cut(p) => self.cut(p),
            Op::LateWrite { peer, lane, slot } => self.late_write(peer, lane, slot),
        }
        self.check();
    }

    fn grant(&mut self, p: usize) {
        if !self.alive[p] {
            return;
        }
        let got = self.lanes.grant(&self.pids[p], self.at());
        if let Some(i) = self.current[p].filter(|&i| self.model[i].status == LaneStatus::Live) {
            assert_eq!(got, Some((self.model[i].first, SLOTS, 0)), "the same lane");
            return;
        }
        if self.model.len() as u32 == CAPACITY {
            assert_eq!(got, None, "grants stop at capacity");
            return;
        }
        let (first, slots, base) = got.expect("a lane is free");
        assert_eq!((slots, base), (SLOTS, 0));
        assert!(
            first >= AREA_FIRST && first + SLOTS <= AREA_FIRST + CAPACITY * SLOTS,
            "lane at {first} outside the area"
        );
        for l in &self.model {
            assert!(
                first + SLOTS <= l.first || l.first + SLOTS <= first,
                "lane at {first} overlaps the lane at {}",
                l.first
            );
        }
        let zeros = vec![0; SLOTS as usize];
        self.model.push(MLane {
            owner: p,
            first,
            status: LaneStatus::Live,
            announced: zeros.clone(),
            wanted: zeros.clone(),
            landed: zeros.clone(),
            seen: zeros,
            pending_since: vec![self.now; SLOTS as usize],
            last_landing: vec![self.now; SLOTS as usize],
            released_while_alive: false,
            died_at: None,
            settled: false,
        });
        self.current[p] = Some(self.model.len() - 1);
    }

    fn announce(&mut self, p: usize, target: &Target, named: &Named) {
        if !self.alive[p] {
            return;
        }
        let cur = self.current[p];
        let lane_first = cur.map_or(AREA_FIRST, |i| self.model[i].first);
        let offset = match *target {
            Target::Own(s) => offset(lane_first + s),
            Target::Anywhere(slot) => offset(slot),
            Target::Misaligned(b) => offset(lane_first) + b + u64::from(b % 8 == 0),
        };
        // The current lane first, then any older (released) lane of the same peer.
        let in_lane = cur.and_then(|i| {
            self.model[i].slot(offset).map(|s| (i, s)).or_else(|| {
                self.model
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.owner == p)
                    .find_map(|(j, l)| l.slot(offset).map(|s| (j, s)))
            })
        });
        let floor = in_lane.map_or(0, |(i, s)| {
            self.model[i].announced[s].max(self.model[i].seen[s])
        });
        let value = match *named {
            Named::Next(k) => floor + k,
            Named::AtStep => floor + MAX_VALUE_STEP,
            Named::PastStep(k) => floor + MAX_VALUE_STEP + k,
            Named::Old(k) => floor.saturating_sub(k),
        };
        let pid = self.pids[p];
        assert_eq!(
            self.lanes.may_wait(&pid, offset),
            in_lane.is_some(),
            "may_wait at {offset}"
        );
        let got = self.lanes.announce(&pid, offset, value, self.at());
        let too_far = value > floor + MAX_VALUE_STEP;
        let Some((i, s)) = in_lane else {
            let want = if cur.is_none() {
                FenceRefusal::NoLane
            } else {
                FenceRefusal::OutsideLane { offset }
            };
            assert_eq!(got, Err(want));
            return;
        };
        let now = self.now;
        let lane = &mut self.model[i];
        if lane.status == LaneStatus::Live {
            if too_far {
                assert_eq!(got, Err(FenceRefusal::ValueTooFar { value, floor }));
                return;
            }
            assert_eq!(got, Ok(()));
            let was_pending = lane.slot_pending(s);
            lane.announced[s] = lane.announced[s].max(value);
            lane.wanted[s] = lane.wanted[s].max(value);
            if !was_pending && lane.slot_pending(s) {
                lane.pending_since[s] = now;
            }
        } else {
            // Released: every wait on it passes. A value too far may be refused or let
            // through (the subject lets it through: nothing is tracked any more).
            if too_far {
                assert!(
                    matches!(got, Ok(()) | Err(FenceRefusal::ValueTooFar { .. })),
                    "{got:?}"
                );
            } else {
                assert_eq!(got, Ok(()));
            }
            if got.is_ok() {
                lane.wanted[s] = lane.wanted[s].max(value);
            }
        }
    }

    fn land(&mut self, p: usize, lane: usize, s: u32, amount: Option<u64>) {
        if !self.alive[p] || self.stalled[p] {
            return;
        }
        let owned: Vec<usize> = (0..self.model.len())
            .filter(|&i| self.model[i].owner == p)
            .collect();
        if owned.is_empty() {
            return;
        }
        let now = self.now;
        let l = &mut self.model[owned[lane % owned.len()]];
        let s = s as usize;
        let target = l.wanted[s];
        if l.landed[s] >= target {
            return;
        }
        let to = amount.map_or(target, |k| target.min(l.landed[s] + k));
        l.landed[s] = to;
        // On a released lane this is the late write that lowers a slot.
        self.mem[l.first as usize + s] = to;
        if l.status == LaneStatus::Live {
            l.last_landing[s] = now;
        }
    }

    fn observe(&mut self, step: u64) {
        self.now += step;
        let at = self.at();
        let values = self.mem.clone();
        let (pids, alive) = (&self.pids, &self.alive);
        let out = self.lanes.observe(&values, at, |q| {
            alive[pids.iter().position(|p| p == q).expect("a known peer")]
        });
        let now = self.now;
        let mut newly = Vec::new();
        let mut released = Vec::new();
        for (i, l) in self.model.iter_mut().enumerate() {
            let in_release = out.release.contains(&range(l.first));
            match l.status {
                LaneStatus::Dead if l.settled => {
                    assert!(!in_release, "lane {i}: a settled dead lane released again");
                }
                LaneStatus::Dead => {
                    // Read back for a deadline after the death, released again whenever a
                    // late write of the dead producer's lowered it.
                    let died_at = *l.died_at.get_or_insert(now);
                    let release = self.lanes.release_value(l.first);
                    let lowered = (0..SLOTS).any(|s| values[(l.first + s) as usize] < release);
                    assert_eq!(
                        in_release, lowered,
                        "lane {i} at {now} ms: a dead lane is released again exactly when \
                         found below its release value"
                    );
                    if lowered {
                        assert!(out.lowered.contains(&self.pids[l.owner]), "lane {i}");
                        released.push(i);
                    } else if now - died_at >= DEADLINE_MS {
                        l.settled = true;
                    }
                }
                LaneStatus::Released => {
                    assert!(
                        in_release,
                        "lane {i}: a released lane is released at every observation"
                    );
                    released.push(i);
                    if !self.alive[l.owner] {
                        l.status = LaneStatus::Dead;
                    }
                }
                LaneStatus::Live => {
                    l.seen.clone_from(&l.landed);
                    let stuck_for = l.stuck_for(now);
                    if !self.alive[l.owner] {
                        // (e) A dead producer: released at once if it has values pending
                        // (its queued writes died with it), without being reported as
                        // missing a deadline; left alone if it has none.
                        assert_eq!(
                            in_release,
                            l.pending(),
                            "lane {i} at {now} ms: a dead producer's lane is released at \
                             once exactly when it has values pending: {l:?}"
                        );
                        if in_release {
                            released.push(i);
                            l.status = LaneStatus::Dead;
                            l.died_at = Some(now);
                        }
                    } else if in_release {
                        // (b) Safety: some slot with a value pending made no progress for
                        // the deadline.
                        assert!(
                            stuck_for.is_some_and(|q| q >= DEADLINE_MS),
                            "lane {i} released at {now} ms though its producer named \
                             nothing pending or each pending slot showed progress within \
                             the deadline ({stuck_for:?} ms at most): {l:?}"
                        );
                        released.push(i);
                        newly.push(self.pids[l.owner]);
                        l.status = LaneStatus::Released;
                        l.released_while_alive = true;
                    } else if let Some(quiet) = stuck_for {
                        // (a) Liveness, per slot.
                        assert!(
                            quiet < DEADLINE_MS + MAX_STEP_MS,
                            "lane {i} at {now} ms: a named value has waited without \
                             progress on its slot for {quiet} ms and is not released: {l:?}"
                        );
                    }
                }
            }
        }
        self.same_lanes(&out.release, &released, "released by observe");
        let mut missed = out.missed.clone();
        missed.sort_unstable();
        newly.sort_unstable();
        assert_eq!(
            missed, newly,
            "missed names the newly released lanes' producers"
        );
        self.write_max(&out.release);
        // Every wait is satisfied but the pending ones of live lanes (bounded above). Waits
        // are queued only for values named while the lane was live (`is_released`).
        for (i, l) in self.model.iter().enumerate() {
            for s in 0..SLOTS as usize {
                let held = self.mem[l.first as usize + s];
                assert!(
                    held >= l.announced[s] || (l.status == LaneStatus::Live && l.pending()),
                    "lane {i} slot {s} holds {held} under a wait for {}",
                    l.announced[s]
                );
            }
        }
    }

    fn die(&mut self, p: usize, notify: bool) {
        self.alive[p] = false;
        if !notify {
            return;
        }
        let got = self.lanes.producer_died(&self.pids[p]);
        let want: Vec<usize> = (0..self.model.len())
            .filter(|&i| self.model[i].owner == p && self.model[i].status != LaneStatus::Dead)
            .collect();
        self.same_lanes(&got, &want, "released by producer_died");
        for &i in &want {
            self.model[i].status = LaneStatus::Dead;
        }
        self.write_max(&got);
    }

    fn cut(&mut self, p: usize) {
        let got = self.lanes.producer_cut(&self.pids[p]);
        let want: Vec<usize> = (0..self.model.len())
            .filter(|&i| self.model[i].owner == p && self.model[i].status == LaneStatus::Live)
            .collect();
        self.same_lanes(&got, &want, "released by producer_cut");
        for &i in &want {
            self.model[i].status = LaneStatus::Released;
            self.model[i].released_while_alive = self.alive[p];
        }
        self.write_max(&got);
    }

    fn check(&self) {
        // (d) Bounds.
        let (lent, capacity) = self.lanes.lent();
        assert_eq!(capacity, CAPACITY);
        assert!(lent <= capacity);
        assert_eq!(lent as usize, self.model.len());
        for (i, l) in self.model.iter().enumerate() {
            assert!(l.first >= AREA_FIRST && l.first + SLOTS <= AREA_FIRST + CAPACITY * SLOTS);
            for m in &self.model[i + 1..] {
                assert!(l.first + SLOTS <= m.first || m.first + SLOTS <= l.first);
            }
        }
        for p in 0..PEERS {
            let want = self.current[p].map(|i| self.model[i].status);
            assert_eq!(self.lanes.status(&self.pids[p]), want, "peer {p}");
        }
        let want = self.model.iter().any(|l| match l.status {
            LaneStatus::Live => l.seen_pending(),
            LaneStatus::Released => true,
            LaneStatus::Dead => !l.settled,
        });
        assert_eq!(self.lanes.needs_observing(), want, "needs_observing");
        // (c) unsafe_to_free.
        for (i, l) in self.model.iter().enumerate() {
            for s in 0..SLOTS {
                let off = offset(l.first + s);
                if l.released_while_alive && self.alive[l.owner] {
                    assert!(
                        self.lanes.unsafe_to_free(&self.pids[l.owner], off),
                        "lane {i} was released while its producer lives"
                    );
                }
                for q in 0..PEERS {
                    let want = q == l.owner && l.status == LaneStatus::Released;
                    assert_eq!(
                        self.lanes.unsafe_to_free(&self.pids[q], off),
                        want,
                        "peer {q}, lane {i} ({:?}) slot {s}",
                        l.status
                    );
                }
            }
        }
    }

    /// Nobody writes any more: within the deadline and a step every wait is released; once
    /// everyone is reported dead, nothing needs observing.
    fn finish(&mut self) {
        for _ in 0..=(DEADLINE_MS + MAX_STEP_MS) / MAX_STEP_MS {
            self.apply(&Op::Observe(MAX_STEP_MS));
        }
        for l in &self.model {
            assert!(!l.pending() || l.status != LaneStatus::Live, "{l:?}");
        }
        for p in 0..PEERS {
            self.apply(&Op::Die {
                peer: p,
                notify: true,
            });
        }
        // Dead lanes are read back for a deadline after the death, then left alone.
        for _ in 0..=(DEADLINE_MS + MAX_STEP_MS) / MAX_STEP_MS {
            self.apply(&Op::Observe(MAX_STEP_MS));
        }
        assert!(!self.lanes.needs_observing());
        assert!(self.model.iter().all(|l| l.status == LaneStatus::Dead));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn lanes_release_every_stuck_wait_in_time_and_no_lane_making_progress(
        ops in prop::collection::vec(op(), 1..200)
    ) {
        let mut run = Run::new();
        for op in &ops {
            run.apply(op);
        }
        run.finish();
    }
}

#[test]
fn a_released_lane_is_written_above_every_value_it_held_or_was_named_with_and_takes_no_more_waits()
{
    // `cuStreamWaitValue64`'s GEQ is cyclic: `u64::MAX` would release nothing, so the
    // release value must lie above every wait's value by less than 2^63.
    let t0 = Instant::now();
    let a = peer(1);
    let mut l = lanes(2);
    let first = first_slot(&mut l, &a, t0);
    l.announce(&a, offset(first), 41, t0).unwrap();
    l.announce(&a, offset(first + 1), 7, t0).unwrap();
    let mut words = inbox(2);
    words[first as usize + 1] = 9;
    assert!(!l.is_released(&a, offset(first)));
    let out = l.observe(&words, t0 + DEADLINE, |_| true);
    assert_eq!(out.missed, vec![a]);
    let v = l.release_value(first);
    assert_eq!(v, 41 + RELEASE_STEP);
    for wanted in [0u64, 7, 9, 41] {
        assert!(
            (v.wrapping_sub(wanted) as i64) >= 0,
            "a queued wait for {wanted} passes"
        );
    }
    assert!(
        (u64::MAX.wrapping_sub(41) as i64) < 0,
        "the old release value satisfied nothing"
    );
    assert!(l.is_released(&a, offset(first)), "no wait is queued on it");
    assert!(l.is_released(&a, offset(first + 1)));
}
