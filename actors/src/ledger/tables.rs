//! What the node reports of the ledger: the lease table (per buffer: its leases and who
//! holds them, forwards, mappings, cut holders), the counters, and what each process holds.
//! Read-only views of the [`Ledger`]'s state, made under the node's lock.

use super::{Ledger, Phase};
use crate::ids::BufferId;
use baton_messages::{ActorId, AllocationId, LeaseId, ProcessId};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// One buffer's leases, for tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryView {
    pub(crate) buffer: BufferId,
    pub(crate) alloc: AllocationId,
    pub(crate) bytes: u64,
    pub(crate) leases: Vec<(LeaseId, ProcessId)>,
    pub(crate) relayed: Vec<RelayedView>,
    pub(crate) mapped_by: Vec<ProcessId>,
    pub(crate) cut_holders: Vec<ProcessId>,
    pub(crate) retiring: bool,
    pub(crate) quarantined: bool,
}

/// One relayed lease, for tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RelayedView {
    pub(crate) lease: LeaseId,
    pub(crate) holder: ProcessId,
    /// The process that relays it; `None` once its link is down (stranded).
    pub(crate) via: Option<ProcessId>,
}

/// Counters, for one owner or all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) buffers: usize,
    pub(crate) retiring: usize,
    pub(crate) quarantined: usize,
    pub(crate) quarantined_bytes: u64,
    pub(crate) leases: usize,
    pub(crate) bytes: u64,
    /// Bytes of the allocations at least one lease is out on.
    pub(crate) pinned_bytes: u64,
}

/// What one process holds of the ledger's allocations, for tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HolderView {
    pub(crate) process: ProcessId,
    /// A link to it is up.
    pub(crate) linked: bool,
    /// Leases it holds (over any of its links).
    pub(crate) leases: usize,
    /// Bytes of the allocations it holds at least one lease on.
    pub(crate) pinned_bytes: u64,
    /// Bytes of the allocations it holds a mapping hold on (warm or leased).
    pub(crate) mapped_bytes: u64,
    /// When its oldest lease was granted.
    pub(crate) oldest_grant: Option<Instant>,
    /// It is a cut holder of some allocation: it may map it until confirmed dead.
    pub(crate) cut: bool,
    /// Bytes of the quarantined allocations it is a cut holder of.
    pub(crate) quarantined_bytes: u64,
}

impl<M, F, D> Ledger<M, F, D> {
    /// Every allocation of `owner` (all owners: `None`), in buffer order.
    pub(crate) fn view(&self, owner: Option<ActorId>) -> Vec<EntryView> {
        let mut out: Vec<EntryView> = self
            .allocs
            .iter()
            .filter(|(_, e)| owner.is_none_or(|o| e.owner == o))
            .map(|(alloc, e)| {
                let mut relayed: Vec<RelayedView> = Vec::new();
                let mut leases: Vec<(LeaseId, ProcessId)> = e
                    .leases
                    .iter()
                    .filter_map(|l| {
                        let r = self.leases.get(l)?;
                        let via = self.links.get(&r.link)?.process;
                        match r.relayed_to {
                            Some(holder) => {
                                relayed.push(RelayedView {
                                    lease: *l,
                                    holder,
                                    via: Some(via),
                                });
                                Some((*l, holder))
                            }
                            None => Some((*l, via)),
                        }
                    })
                    .collect();
                for (lease, s) in &e.stranded {
                    leases.push((*lease, s.holder));
                    relayed.push(RelayedView {
                        lease: *lease,
                        holder: s.holder,
                        via: None,
                    });
                }
                leases.sort();
                relayed.sort_by_key(|r| r.lease);
                let mut mapped_by: Vec<ProcessId> = e
                    .holds
                    .keys()
                    .filter_map(|l| self.links.get(l).map(|r| r.process))
                    .collect();
                mapped_by.sort();
                mapped_by.dedup();
                EntryView {
                    buffer: e.buffer,
                    alloc: *alloc,
                    bytes: e.bytes,
                    leases,
                    relayed,
                    mapped_by,
                    cut_holders: e.cut_holders.iter().copied().collect(),
                    retiring: e.phase != Phase::Live,
                    quarantined: e.phase == Phase::Quarantined,
                }
            })
            .collect();
        out.sort_by_key(|v| v.buffer);
        out
    }

    /// Counters of `owner` (all owners: `None`).
    pub(crate) fn counts(&self, owner: Option<ActorId>) -> Counts {
        let mut c = Counts::default();
        for e in self
            .allocs
            .values()
            .filter(|e| owner.is_none_or(|o| e.owner == o))
        {
            c.buffers += 1;
            c.bytes += e.bytes;
            c.leases += e.leases.len() + e.stranded.len();
            if !e.leases.is_empty() || !e.stranded.is_empty() {
                c.pinned_bytes += e.bytes;
            }
            match e.phase {
                Phase::Live => {}
                Phase::Retired => c.retiring += 1,
                Phase::Quarantined => {
                    c.retiring += 1;
                    c.quarantined += 1;
                    c.quarantined_bytes += e.bytes;
                }
            }
        }
        c
    }

    /// Every process that holds a lease or a mapping hold on an allocation, or is a cut
    /// holder of one, in process order.
    pub(crate) fn holders(&self) -> Vec<HolderView> {
        let mut by: BTreeMap<ProcessId, HolderView> = BTreeMap::new();
        let view = |by: &mut BTreeMap<ProcessId, HolderView>, process: ProcessId| {
            by.entry(process).or_insert_with(|| HolderView {
                process,
                linked: false,
                leases: 0,
                pinned_bytes: 0,
                mapped_bytes: 0,
                oldest_grant: None,
                cut: false,
                quarantined_bytes: 0,
            });
        };
        for e in self.allocs.values() {
            // Per process: whether it leases this allocation, whether it maps it.
            let mut leasing: BTreeSet<ProcessId> = BTreeSet::new();
            for lease in e.leases.iter() {
                let Some(r) = self.leases.get(lease) else {
                    continue;
                };
                let Some(link) = self.links.get(&r.link) else {
                    continue;
                };
                let process = r.relayed_to.unwrap_or(link.process);
                view(&mut by, process);
                let h = by.get_mut(&process).expect("just inserted");
                h.leases += 1;
                h.oldest_grant = Some(h.oldest_grant.map_or(r.granted_at, |t| t.min(r.granted_at)));
                if leasing.insert(process) {
                    h.pinned_bytes += e.bytes;
                }
            }
            for process in e.stranded.values().map(|s| s.holder) {
                view(&mut by, process);
                let h = by.get_mut(&process).expect("just inserted");
                h.leases += 1;
                h.cut = true;
                if leasing.insert(process) {
                    h.pinned_bytes += e.bytes;
                }
            }
            let mapping: BTreeSet<ProcessId> = e
                .holds
                .keys()
                .filter_map(|l| self.links.get(l).map(|r| r.process))
                .collect();
            for process in mapping {
                view(&mut by, process);
                by.get_mut(&process).expect("just inserted").mapped_bytes += e.bytes;
            }
            for &process in &e.cut_holders {
                view(&mut by, process);
                let h = by.get_mut(&process).expect("just inserted");
                h.cut = true;
                if e.phase == Phase::Quarantined {
                    h.quarantined_bytes += e.bytes;
                }
            }
        }
        for link in self.links.values() {
            if let Some(h) = by.get_mut(&link.process) {
                h.linked = true;
            }
        }
        by.into_values().collect()
    }
}
