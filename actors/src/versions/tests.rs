use super::*;

fn stamp(version: u64, sync: u64, part: u32, parts: u32) -> SyncStamp {
    SyncStamp {
        version,
        sync,
        part,
        parts,
        ttl_ms: 1000,
    }
}

/// Admits and lands a part; the progress it made.
fn land(state: &mut SyncState, s: SyncStamp, now: Instant) -> Result<SyncProgress, VersionFault> {
    let s = state.admit(Some(&s), now)?;
    Ok(state.landed(&s).expect("the staged sync"))
}

#[test]
fn a_version_commits_once_every_part_of_one_sync_landed() {
    let now = Instant::now();
    let mut state = SyncState::new(0);
    assert!(matches!(
        land(&mut state, stamp(1, 10, 1, 3), now),
        Ok(SyncProgress::Staged(Staged {
            landed: 1,
            parts: 3,
            ..
        }))
    ));
    land(&mut state, stamp(1, 10, 0, 3), now).unwrap();
    assert_eq!(state.version(), 0, "two parts of three: still version 0");
    assert_eq!(
        land(&mut state, stamp(1, 10, 2, 3), now),
        Ok(SyncProgress::Committed { version: 1 })
    );
    assert_eq!(state.version(), 1);
    assert_eq!(state.staging(now), None);
}

#[test]
fn stale_skipping_duplicate_and_inconsistent_parts_are_refused_and_staging_survives() {
    let now = Instant::now();
    let mut state = SyncState::new(4);
    land(&mut state, stamp(5, 10, 0, 2), now).unwrap();
    for (s, expect) in [
        (
            stamp(4, 11, 0, 2),
            VersionFault::Stale {
                committed: 4,
                got: 4,
            },
        ),
        (
            stamp(1, 11, 0, 2),
            VersionFault::Stale {
                committed: 4,
                got: 1,
            },
        ),
        (
            stamp(7, 11, 0, 2),
            VersionFault::Skipped {
                committed: 4,
                got: 7,
            },
        ),
        (
            stamp(5, 10, 0, 2),
            VersionFault::Inconsistent {
                sync: 10,
                why: "a part that landed already",
            },
        ),
        (
            stamp(5, 10, 1, 3),
            VersionFault::Inconsistent {
                sync: 10,
                why: "another number of parts",
            },
        ),
        (
            stamp(5, 9, 1, 2),
            VersionFault::SyncClosed {
                version: 5,
                sync: 9,
            },
        ),
    ] {
        assert_eq!(state.admit(Some(&s), now), Err(expect), "{s}");
    }
    assert_eq!(state.admit(None, now), Err(VersionFault::Unversioned));
    let malformed = SyncStamp {
        ttl_ms: 0,
        ..stamp(5, 10, 1, 2)
    };
    assert!(matches!(
        state.admit(Some(&malformed), now),
        Err(VersionFault::Malformed { .. })
    ));
    assert_eq!(
        state.staging(now).map(|s| (s.version, s.landed)),
        Some((5, 1)),
        "refusals leave the staged sync as it was"
    );
    assert_eq!(
        land(&mut state, stamp(5, 10, 1, 2), now),
        Ok(SyncProgress::Committed { version: 5 })
    );
}

#[test]
fn a_later_sync_replaces_the_staged_one_and_its_parts_are_refused_after() {
    let now = Instant::now();
    let mut state = SyncState::new(0);
    land(&mut state, stamp(1, 10, 0, 2), now).unwrap();
    land(&mut state, stamp(1, 20, 0, 2), now).unwrap();
    assert_eq!(
        state.admit(Some(&stamp(1, 10, 1, 2)), now),
        Err(VersionFault::SyncClosed {
            version: 1,
            sync: 10
        }),
        "the replaced sync's last part would make a mix"
    );
    assert_eq!(
        land(&mut state, stamp(1, 20, 1, 2), now),
        Ok(SyncProgress::Committed { version: 1 })
    );
}

#[test]
fn an_expired_or_cancelled_sync_is_dropped_and_its_parts_refused() {
    let now = Instant::now();
    let mut state = SyncState::new(0);
    land(&mut state, stamp(1, 10, 0, 2), now).unwrap();
    let later = now + Duration::from_millis(1001);
    assert_eq!(state.staging(later), None, "past its deadline");
    assert_eq!(
        state.admit(Some(&stamp(1, 10, 1, 2)), later),
        Err(VersionFault::SyncClosed {
            version: 1,
            sync: 10
        })
    );
    land(&mut state, stamp(1, 11, 0, 2), later).unwrap();
    assert!(
        !state.cancel(&SyncCancel {
            version: 2,
            sync: 11
        }),
        "not its version"
    );
    assert!(state.cancel(&SyncCancel {
        version: 1,
        sync: 11
    }));
    assert_eq!(state.staging(later), None);
    assert_eq!(
        state.admit(Some(&stamp(1, 11, 1, 2)), later),
        Err(VersionFault::SyncClosed {
            version: 1,
            sync: 11
        })
    );
    assert_eq!(state.version(), 0);
    land(&mut state, stamp(1, 12, 0, 1), later).unwrap();
    assert_eq!(state.version(), 1);
}

#[test]
fn the_sender_refuses_infeasible_deadlines_up_front() {
    let now = Instant::now();
    let mut sender = SyncSender::new(0).with_min_deadline(Duration::from_millis(50));
    for deadline in [
        now.checked_sub(Duration::from_millis(1)).unwrap_or(now),
        now,
        now + Duration::from_millis(10),
        now + SyncSender::MAX_DEADLINE + Duration::from_secs(1),
    ] {
        assert!(matches!(
            sender.begin_at(1, deadline, now),
            Err(ActorError::InfeasibleDeadline { .. })
        ));
    }
    assert!(matches!(
        sender.begin_at(0, now + Duration::from_secs(1), now),
        Err(ActorError::Version(VersionFault::Malformed { .. }))
    ));
    assert_eq!(sender.pending(), None, "nothing began");
    assert!(matches!(sender.stamp(0), Err(ActorError::SyncOver { .. })));
}

#[test]
fn the_sender_stamps_until_its_deadline_and_finishes_only_whole_syncs() {
    let now = Instant::now();
    let mut sender = SyncSender::new(7);
    assert_eq!(
        sender
            .begin_at(2, now + Duration::from_secs(2), now)
            .unwrap(),
        8
    );
    let first = sender.stamp_at(0, now).unwrap();
    assert_eq!(
        (first.version, first.part, first.parts, first.ttl_ms),
        (8, 0, 2, 2000)
    );
    assert!(
        matches!(sender.finish(), Err(ActorError::SyncOver { .. })),
        "part 1 unstamped"
    );
    assert!(matches!(
        sender.stamp_at(2, now),
        Err(ActorError::OutOfBounds { .. })
    ));
    let second = sender.stamp_at(1, now).unwrap();
    assert_eq!(second.sync, first.sync);
    assert_eq!(sender.finish().unwrap(), 8);
    assert_eq!(sender.version(), 8);

    sender
        .begin_at(1, now + Duration::from_secs(2), now)
        .unwrap();
    let cancel = sender.cancel().unwrap();
    assert_eq!(cancel.version, 9);
    assert!(cancel.sync > first.sync, "a later sync has a larger id");
    assert_eq!(sender.version(), 8, "a cancelled sync makes no version");

    sender
        .begin_at(1, now + Duration::from_secs(1), now)
        .unwrap();
    assert!(matches!(
        sender.stamp_at(0, now + Duration::from_secs(1)),
        Err(ActorError::SyncOver {
            why: "its deadline passed",
            ..
        })
    ));
    assert_eq!(sender.pending(), None, "given up at its deadline");
}
