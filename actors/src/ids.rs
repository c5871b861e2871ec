//! Identifiers local to this process.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! local_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(u64);

        impl $name {
            /// The raw value.
            pub const fn get(self) -> u64 {
                self.0
            }

            /// A fresh id, never handed out before in this process.
            pub(crate) fn next() -> Self {
                static NEXT: AtomicU64 = AtomicU64::new(1);
                Self(NEXT.fetch_add(1, Ordering::Relaxed))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

local_id!(
    /// A buffer of a [`BufferOwner`](crate::BufferOwner).
    BufferId,
    "buf#"
);

local_id!(
    /// One link (connection) of this process.
    LinkId,
    "link#"
);

/// A fresh lease id: unique in this process, never reused (a replayed release of an old
/// lease can never match a new one).
pub(crate) fn next_lease() -> baton_messages::LeaseId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    baton_messages::LeaseId::new(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A fresh actor id for a buffer owner.
pub(crate) fn next_actor() -> baton_messages::ActorId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    baton_messages::ActorId::new(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A map for the tables a handoff touches (the ledger, a link's session, the node's
/// registry): hashed with foldhash, seeded per map, several times cheaper than the standard
/// library's SipHash on an id, and still unpredictable to a peer that picks keys (its lease
/// and call ids), whose tables are bounded besides.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A set hashed as [`FastMap`]'s keys.
pub(crate) type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;
