//! Versioned syncs: the stamp a sender puts on each bundle of a sync, the cancel it sends
//! when it gives one up, and what can be wrong with a stamp a peer wrote.
//!
//! A *sync* moves version N+1 of a whole (a model's weights) from a sender to its
//! receivers in one or more *parts* (bundles). Each part's stamp names the version, the
//! sync (an attempt: a sender that gives a sync up and tries the same version again starts
//! a new one, with a larger id), the part's index and the number of parts, and how long
//! the sync had left when the part was shared. A receiver commits N+1 only when every part
//! of one sync has landed; until then it stays on N.
//!
//! Every field is peer-written data: [`SyncStamp::check`] bounds it before anything acts on
//! it, and a receiver refuses a version that does not follow its own ([`VersionFault`]).

use serde::{Deserialize, Serialize};
use std::fmt;

/// The stamp of one part of a versioned sync (the `"baton.sync"` field of a bundle on the
/// wire). Plain data: [`check`](Self::check) it before use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SyncStamp {
    /// The version this part belongs to (at least 1; a receiver starts at 0, "none yet").
    pub version: u64,
    /// The sync (attempt) this part belongs to: larger for a later attempt, also across a
    /// restart of the sender (its clock in microseconds, or one more than its last).
    pub sync: u64,
    /// This part's index, below [`parts`](Self::parts).
    pub part: u32,
    /// How many parts the version has, 1 to [`MAX_PARTS`](Self::MAX_PARTS).
    pub parts: u32,
    /// Milliseconds the sync had left when this part was shared, 1 to
    /// [`MAX_TTL_MS`](Self::MAX_TTL_MS): a receiver gives the sync up that long after the
    /// part lands (its own clock; the sender's is never compared with it).
    pub ttl_ms: u64,
}

impl SyncStamp {
    /// The most parts one version may have.
    pub const MAX_PARTS: u32 = 4096;
    /// The longest a sync may last: a day.
    pub const MAX_TTL_MS: u64 = 24 * 60 * 60 * 1000;

    /// Whether the stamp is well formed: a version of at least 1, 1 to
    /// [`MAX_PARTS`](Self::MAX_PARTS) parts, a part index below them, a time to live of 1
    /// ms to [`MAX_TTL_MS`](Self::MAX_TTL_MS).
    ///
    /// # Errors
    /// [`VersionFault::Malformed`], saying which field.
    pub fn check(&self) -> Result<(), VersionFault> {
        let bad = |why: &'static str| Err(VersionFault::Malformed { why });
        if self.version == 0 {
            return bad("version 0 (versions start at 1)");
        }
        if self.parts == 0 || self.parts > Self::MAX_PARTS {
            return bad("a number of parts outside 1..=4096");
        }
        if self.part >= self.parts {
            return bad("a part index not below the number of parts");
        }
        if self.ttl_ms == 0 || self.ttl_ms > Self::MAX_TTL_MS {
            return bad("a time to live outside 1 ms..=1 day");
        }
        Ok(())
    }
}

impl fmt::Display for SyncStamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "version {} (sync {}), part {} of {}",
            self.version,
            self.sync,
            self.part + 1,
            self.parts
        )
    }
}

/// What a sender sends its receivers when it gives a sync up before its deadline: each
/// drops what it staged of that sync (and of any earlier one of the same version) and stays
/// on the version it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SyncCancel {
    /// The version the sync was to make.
    pub version: u64,
    /// The sync given up.
    pub sync: u64,
}

/// Why a receiver refused a part of a versioned sync. The part's lease goes back, the
/// receiver stays on the version it has (and keeps what it staged of the sync under way,
/// unless the refusal says otherwise), and the link carries on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VersionFault {
    /// The bundle carries no stamp: it was shared with `share`, not as part of a sync.
    #[error("the bundle is not part of a versioned sync (no stamp): share it with a SyncSender")]
    Unversioned,
    /// The stamp does not check.
    #[error("a malformed sync stamp: {why}")]
    Malformed {
        /// Which field is wrong.
        why: &'static str,
    },
    /// The version is not newer than the receiver's: a resend, or a sender behind.
    #[error("version {got} is stale: this receiver has version {committed} already")]
    Stale {
        /// The receiver's version.
        committed: u64,
        /// The version sent.
        got: u64,
    },
    /// The version skips one: the receiver has N and takes only N+1.
    #[error(
        "version {got} skips ahead: this receiver has version {committed} and takes only {}",
        committed.saturating_add(1)
    )]
    Skipped {
        /// The receiver's version.
        committed: u64,
        /// The version sent.
        got: u64,
    },
    /// A part of an older sync of the version being staged, which a later sync replaced,
    /// or of a sync that was cancelled or ran out of time.
    #[error("sync {sync} of version {version} is over (cancelled, expired or replaced)")]
    SyncClosed {
        /// The version.
        version: u64,
        /// The sync.
        sync: u64,
    },
    /// A part that disagrees with the parts of its sync that landed before it: another
    /// number of parts, or a part index that landed already.
    #[error("a part of sync {sync} that disagrees with its sync: {why}")]
    Inconsistent {
        /// The sync.
        sync: u64,
        /// What disagrees.
        why: &'static str,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp() -> SyncStamp {
        SyncStamp {
            version: 1,
            sync: 7,
            part: 0,
            parts: 2,
            ttl_ms: 1000,
        }
    }

    #[test]
    fn a_stamp_out_of_bounds_is_malformed() {
        assert_eq!(stamp().check(), Ok(()));
        for bad in [
            SyncStamp {
                version: 0,
                ..stamp()
            },
            SyncStamp {
                parts: 0,
                part: 0,
                ..stamp()
            },
            SyncStamp {
                parts: SyncStamp::MAX_PARTS + 1,
                ..stamp()
            },
            SyncStamp { part: 2, ..stamp() },
            SyncStamp {
                ttl_ms: 0,
                ..stamp()
            },
            SyncStamp {
                ttl_ms: u64::MAX,
                ..stamp()
            },
        ] {
            assert!(
                matches!(bad.check(), Err(VersionFault::Malformed { .. })),
                "{bad:?}"
            );
        }
        assert_eq!(stamp().to_string(), "version 1 (sync 7), part 1 of 2");
    }
}
