//! Versioned, all-or-nothing syncs: the two sides' bookkeeping, without I/O (like the
//! ledger): [`SyncSender`] stamps the parts of a sync, [`SyncState`] decides for a
//! receiver which part to stage and when a version is whole. The caller feeds them the
//! time; [`SyncReceiver`](crate::SyncReceiver) (and Python's `baton.SyncReceiver`) copy
//! the bytes and flip the buffers.

use crate::error::ActorError;
use baton_messages::{SyncCancel, SyncStamp, VersionFault};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The sender's side of versioned syncs: which version its receivers have, which sync is
/// under way, and the stamps of its parts.
///
/// ```
/// use baton_actors::SyncSender;
/// use std::time::{Duration, Instant};
/// let mut sender = SyncSender::new(0); // receivers have nothing yet
/// let version = sender.begin(2, Instant::now() + Duration::from_secs(5)).unwrap();
/// assert_eq!(version, 1);
/// let first = sender.stamp(0).unwrap(); // put on a bundle: Bundle::share_stamped
/// let second = sender.stamp(1).unwrap();
/// assert_eq!((first.parts, second.part), (2, 1));
/// assert_eq!(sender.finish().unwrap(), 1); // every part shared: the next sync makes 2
/// ```
///
/// A deadline that cannot be met is refused up front
/// ([`ActorError::InfeasibleDeadline`]); past its deadline a sync stamps nothing more
/// ([`ActorError::SyncOver`]) and receivers drop what they staged of it.
/// [`cancel`](Self::cancel) gives a sync up at once, and gives the [`SyncCancel`] to send
/// receivers so that they drop it before its deadline.
#[derive(Debug)]
pub struct SyncSender {
    /// The version the last finished sync made (what receivers have).
    version: u64,
    /// The last sync id used.
    last_sync: u64,
    /// The shortest deadline `begin` takes.
    min_deadline: Duration,
    current: Option<Outgoing>,
}

#[derive(Debug)]
struct Outgoing {
    sync: u64,
    parts: u32,
    stamped: Vec<bool>,
    deadline: Instant,
}

impl SyncSender {
    /// The shortest deadline [`begin`](Self::begin) takes unless told another
    /// ([`with_min_deadline`](Self::with_min_deadline)).
    pub const MIN_DEADLINE: Duration = Duration::from_millis(1);
    /// The longest deadline a stamp carries.
    pub const MAX_DEADLINE: Duration = Duration::from_millis(SyncStamp::MAX_TTL_MS);

    /// A sender whose receivers have `version` (0: nothing yet; a restarted sender gives
    /// the version its receivers report, or the one it last knew).
    pub fn new(version: u64) -> Self {
        Self {
            version,
            last_sync: 0,
            min_deadline: Self::MIN_DEADLINE,
            current: None,
        }
    }

    /// States the shortest deadline this sender's syncs can meet (what a sync of this
    /// model takes, say): [`begin`](Self::begin) refuses nearer ones.
    pub fn with_min_deadline(mut self, min: Duration) -> Self {
        self.min_deadline = min.clamp(Self::MIN_DEADLINE, Self::MAX_DEADLINE);
        self
    }

    /// The version the last finished sync made.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The version the sync under way makes, if one is.
    pub fn pending(&self) -> Option<u64> {
        self.current.as_ref().map(|_| self.version + 1)
    }

    /// Begins the sync of the next version in `parts` parts, to be done by `deadline`;
    /// returns that version. An unfinished sync is given up (receivers drop it when a part
    /// of this one reaches them).
    ///
    /// # Errors
    /// [`ActorError::InfeasibleDeadline`] when `deadline` is past, nearer than the
    /// minimum, or beyond [`MAX_DEADLINE`](Self::MAX_DEADLINE);
    /// [`ActorError::Version`] ([`VersionFault::Malformed`]) for 0 parts or more than
    /// [`SyncStamp::MAX_PARTS`], or when the version would overflow.
    pub fn begin(&mut self, parts: u32, deadline: Instant) -> Result<u64, ActorError> {
        self.begin_at(parts, deadline, Instant::now())
    }

    fn begin_at(&mut self, parts: u32, deadline: Instant, now: Instant) -> Result<u64, ActorError> {
        let left = deadline.saturating_duration_since(now);
        if left < self.min_deadline || left > Self::MAX_DEADLINE {
            return Err(ActorError::InfeasibleDeadline {
                left,
                min: self.min_deadline,
                max: Self::MAX_DEADLINE,
            });
        }
        if parts == 0 || parts > SyncStamp::MAX_PARTS {
            return Err(VersionFault::Malformed {
                why: "a number of parts outside 1..=4096",
            }
            .into());
        }
        if self.version == u64::MAX {
            return Err(VersionFault::Malformed {
                why: "the version would overflow",
            }
            .into());
        }
        // Later than any sync this sender (or, by its clock, an earlier run of it) began.
        let clock = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        self.last_sync = clock.max(self.last_sync.saturating_add(1));
        self.current = Some(Outgoing {
            sync: self.last_sync,
            parts,
            stamped: vec![false; parts as usize],
            deadline,
        });
        Ok(self.version + 1)
    }

    /// The stamp of part `part` of the sync under way: put it on that part's bundle
    /// ([`Bundle::share_stamped`](crate::Bundle::share_stamped)). A part may be stamped
    /// again (sent to another receiver).
    ///
    /// # Errors
    /// [`ActorError::SyncOver`] when no sync is under way or its deadline passed (the sync
    /// is then given up); [`ActorError::OutOfBounds`] for a part index not below the
    /// number of parts.
    pub fn stamp(&mut self, part: u32) -> Result<SyncStamp, ActorError> {
        self.stamp_at(part, Instant::now())
    }

    fn stamp_at(&mut self, part: u32, now: Instant) -> Result<SyncStamp, ActorError> {
        let version = self.version + 1;
        let Some(out) = self.current.as_mut() else {
            return Err(ActorError::SyncOver {
                version,
                why: "no sync is under way (begin one)",
            });
        };
        let left = out.deadline.saturating_duration_since(now);
        if left.is_zero() {
            self.current = None;
            return Err(ActorError::SyncOver {
                version,
                why: "its deadline passed",
            });
        }
        if part >= out.parts {
            return Err(ActorError::OutOfBounds {
                index: part as usize,
                len: 1,
                size: out.parts as usize,
            });
        }
        out.stamped[part as usize] = true;
        Ok(SyncStamp {
            version,
            sync: out.sync,
            part,
            parts: out.parts,
            // Rounded up: a part shared with 0.4 ms left still has a deadline.
            ttl_ms: u64::try_from(left.as_micros().div_ceil(1000))
                .unwrap_or(u64::MAX)
                .clamp(1, SyncStamp::MAX_TTL_MS),
        })
    }

    /// Ends the sync under way once every part was stamped (and sent): its version is now
    /// the sender's, and the next sync makes the one after. Returns it.
    ///
    /// # Errors
    /// [`ActorError::SyncOver`] when no sync is under way, a part was never stamped (the
    /// sync stays under way), or the deadline passed (the sync is given up).
    pub fn finish(&mut self) -> Result<u64, ActorError> {
        let version = self.version + 1;
        let Some(out) = self.current.as_ref() else {
            return Err(ActorError::SyncOver {
                version,
                why: "no sync is under way (begin one)",
            });
        };
        if out.stamped.iter().any(|s| !s) {
            return Err(ActorError::SyncOver {
                version,
                why: "a part was never stamped",
            });
        }
        if out.deadline <= Instant::now() {
            self.current = None;
            return Err(ActorError::SyncOver {
                version,
                why: "its deadline passed",
            });
        }
        self.current = None;
        self.version = version;
        Ok(version)
    }

    /// Gives the sync under way up: its version stays unmade. Returns what to send the
    /// receivers (each drops what it staged of it), or `None` when no sync was under way.
    pub fn cancel(&mut self) -> Option<SyncCancel> {
        self.current.take().map(|out| SyncCancel {
            version: self.version + 1,
            sync: out.sync,
        })
    }
}

/// A receiver's side of versioned syncs, without I/O: the version it has committed and
/// the sync it stages. For each part that arrives, [`admit`](Self::admit) says whether to
/// stage it (and in which slot); once it is copied there, [`landed`](Self::landed) says
/// whether the version is now whole, and then the caller makes its staged copy the
/// committed one, at once and whole. A version can only go up by one, from one sync.
#[derive(Debug, Default)]
pub struct SyncState {
    committed: u64,
    staging: Option<Staging>,
    /// The last sync given up (cancelled, expired or replaced): `(version, sync)`. A part
    /// of it, or of an earlier sync of that version, is refused.
    closed: Option<(u64, u64)>,
}

#[derive(Debug)]
struct Staging {
    version: u64,
    sync: u64,
    parts: u32,
    landed: Vec<bool>,
    count: u32,
    deadline: Instant,
}

/// Where a sync under way stands at a receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staged {
    /// The version it makes.
    pub version: u64,
    /// The sync.
    pub sync: u64,
    /// Parts landed.
    pub landed: u32,
    /// Parts in all.
    pub parts: u32,
}

/// What a part that landed did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SyncProgress {
    /// It is staged; the version is not whole yet: the receiver stays on the one it had.
    Staged(Staged),
    /// It was the last: the receiver has this version now, every part of it.
    Committed {
        /// The new version.
        version: u64,
    },
}

impl SyncState {
    /// A receiver that has `committed` (0: nothing yet).
    pub fn new(committed: u64) -> Self {
        Self {
            committed,
            ..Self::default()
        }
    }

    /// The committed version.
    pub fn version(&self) -> u64 {
        self.committed
    }

    /// The sync being staged, if one is (and its deadline has not passed by `now`).
    pub fn staging(&self, now: Instant) -> Option<Staged> {
        self.staging
            .as_ref()
            .filter(|s| s.deadline > now)
            .map(|s| Staged {
                version: s.version,
                sync: s.sync,
                landed: s.count,
                parts: s.parts,
            })
    }

    /// Checks a part's stamp (`None`: the bundle carried none) at time `now`; returns the
    /// stamp to stage it under: copy the part into slot `part` of `parts`, then call
    /// [`landed`](Self::landed). A part of a later sync of the staged version replaces it
    /// (its slots are to be written again); a staged sync whose deadline passed is
    /// dropped.
    ///
    /// # Errors
    /// The [`VersionFault`] that refuses it; what was staged stays staged.
    pub fn admit(
        &mut self,
        stamp: Option<&SyncStamp>,
        now: Instant,
    ) -> Result<SyncStamp, VersionFault> {
        let stamp = *stamp.ok_or(VersionFault::Unversioned)?;
        stamp.check()?;
        if let Some(s) = self.staging.take_if(|s| s.deadline <= now) {
            self.closed = Some((s.version, s.sync));
        }
        let next = self.committed.saturating_add(1);
        if stamp.version <= self.committed {
            return Err(VersionFault::Stale {
                committed: self.committed,
                got: stamp.version,
            });
        }
        if stamp.version > next {
            return Err(VersionFault::Skipped {
                committed: self.committed,
                got: stamp.version,
            });
        }
        let over = VersionFault::SyncClosed {
            version: stamp.version,
            sync: stamp.sync,
        };
        if self
            .closed
            .is_some_and(|(v, sync)| v == stamp.version && stamp.sync <= sync)
        {
            return Err(over);
        }
        let ttl = Duration::from_millis(stamp.ttl_ms);
        match &mut self.staging {
            Some(s) if s.sync > stamp.sync => return Err(over),
            Some(s) if s.sync == stamp.sync => {
                if s.parts != stamp.parts {
                    return Err(VersionFault::Inconsistent {
                        sync: stamp.sync,
                        why: "another number of parts",
                    });
                }
                if s.landed[stamp.part as usize] {
                    return Err(VersionFault::Inconsistent {
                        sync: stamp.sync,
                        why: "a part that landed already",
                    });
                }
                s.deadline = s.deadline.min(now + ttl);
            }
            replaced => {
                if let Some(s) = replaced {
                    self.closed = Some((s.version, s.sync));
                }
                *replaced = Some(Staging {
                    version: stamp.version,
                    sync: stamp.sync,
                    parts: stamp.parts,
                    landed: vec![false; stamp.parts as usize],
                    count: 0,
                    deadline: now + ttl,
                });
            }
        }
        Ok(stamp)
    }

    /// Part `stamp.part` of the staged sync is copied into its slot: returns whether the
    /// version is whole. When it is, the state has committed it: make the staged copy the
    /// committed one now, whole (a swap that cannot fail). A stamp that is not the staged
    /// sync's (it was given up meanwhile) changes nothing.
    pub fn landed(&mut self, stamp: &SyncStamp) -> Option<SyncProgress> {
        let s = self.staging.as_mut().filter(|s| s.sync == stamp.sync)?;
        let slot = s.landed.get_mut(stamp.part as usize)?;
        if !*slot {
            *slot = true;
            s.count += 1;
        }
        if s.count < s.parts {
            return Some(SyncProgress::Staged(Staged {
                version: s.version,
                sync: s.sync,
                landed: s.count,
                parts: s.parts,
            }));
        }
        self.committed = s.version;
        self.staging = None;
        Some(SyncProgress::Committed {
            version: self.committed,
        })
    }

    /// Drops the staged sync when `cancel` names it (or a later sync of its version);
    /// returns whether it did. A later part of that sync is refused.
    pub fn cancel(&mut self, cancel: &SyncCancel) -> bool {
        if cancel.version != self.committed.saturating_add(1) {
            return false;
        }
        if self
            .closed
            .is_none_or(|(v, sync)| v != cancel.version || sync < cancel.sync)
        {
            self.closed = Some((cancel.version, cancel.sync));
        }
        match &self.staging {
            Some(s) if s.sync <= cancel.sync => {
                self.staging = None;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests;
