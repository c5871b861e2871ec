//! Checks of the ledger's bookkeeping, run by the tests after every event.

use super::{Access, Covers, FreeWhileMapped, Ledger, Phase, overlaps};
use baton_messages::{AllocationId, LeaseId};

impl<M, F, D> Ledger<M, F, D> {
    /// The release fences `alloc` keeps for its free.
    pub(crate) fn fences(&self, alloc: AllocationId) -> Option<&[F]> {
        self.allocs.get(&alloc).map(|e| e.fences.as_slice())
    }

    /// Checks that no allocation keeps a release fence another of its fences covers.
    /// Panics if one does.
    pub(crate) fn check_fences(&self)
    where
        F: Covers + std::fmt::Debug,
    {
        for (alloc, e) in &self.allocs {
            for (i, a) in e.fences.iter().enumerate() {
                for (j, b) in e.fences.iter().enumerate() {
                    assert!(
                        i == j || !a.covers(b),
                        "{alloc:?} keeps {b:?}, which {a:?} covers"
                    );
                }
            }
        }
    }

    /// Checks the bookkeeping: indexes agree, holds and leases name live links, quarantine
    /// only where the rule asks for it. Panics on a broken invariant.
    pub(crate) fn check(&self) {
        for (lease, r) in &self.leases {
            let entry = self
                .allocs
                .get(&r.alloc)
                .expect("a lease's allocation exists");
            assert!(
                entry.leases.all.contains(lease),
                "lease index and entry agree"
            );
            assert_eq!(
                entry.leases.writable.contains(lease),
                r.access.writable,
                "the entry's writable leases are its leases that write"
            );
            assert!(
                self.links.contains_key(&r.link),
                "a lease is on a live link"
            );
        }
        for (alloc, e) in &self.allocs {
            assert_eq!(self.buffers.get(&e.buffer), Some(alloc), "buffer index");
            for lease in e.leases.iter() {
                assert_eq!(self.leases.get(lease).map(|r| r.alloc), Some(*alloc));
            }
            assert!(
                e.leases.writable.is_subset(&e.leases.all),
                "writable leases are leases of the entry"
            );
            for (link, hold) in &e.holds {
                assert!(self.links.contains_key(link), "a hold is on a live link");
                assert!(!hold.is_empty(), "empty holds are removed");
            }
            match e.phase {
                Phase::Live => {}
                Phase::Retired => {
                    // A retired entry with nothing holding it would have been freed.
                    assert!(
                        !e.leases.is_empty() || !e.holds.is_empty() || !e.stranded.is_empty(),
                        "a retired allocation nobody holds is freed"
                    );
                }
                Phase::Quarantined => {
                    assert_eq!(e.rule, FreeWhileMapped::Unsafe);
                    assert!(e.leases.is_empty() && e.holds.is_empty() && e.stranded.is_empty());
                    assert!(!e.cut_holders.is_empty());
                }
            }
            for lease in e.stranded.keys() {
                assert!(
                    !self.leases.contains_key(lease),
                    "a stranded lease is not out"
                );
            }
            // One writer or many readers, per range: a writable lease out overlaps no
            // other lease out or stranded.
            let counted: Vec<(LeaseId, &Access)> = e
                .leases
                .iter()
                .filter_map(|l| self.leases.get(l).map(|r| (*l, &r.access)))
                .collect();
            for (l, a) in counted.iter().filter(|(_, a)| a.writable) {
                assert!(!a.bytes.is_empty(), "{l} covers no byte");
                for (m, b) in &counted {
                    assert!(
                        m == l || !overlaps(&a.bytes, &b.bytes),
                        "writable {l} ({:?}) overlaps {m} ({:?})",
                        a.bytes,
                        b.bytes
                    );
                }
                for (m, s) in &e.stranded {
                    assert!(
                        !overlaps(&a.bytes, &s.bytes),
                        "writable {l} overlaps stranded {m}"
                    );
                }
            }
            if e.phase != Phase::Live && e.leases.is_empty() {
                assert!(
                    e.holds.values().all(|h| !h.current),
                    "every live holder of a retired allocation was asked to unmap"
                );
            }
        }
        assert_eq!(self.buffers.len(), self.allocs.len());
    }
}
