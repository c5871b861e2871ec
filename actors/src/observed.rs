//! [`Observed`]: what a node keeps for its status besides its ledger, cache and links —
//! the leases its links held when they went down (orphaned, until their guards drop), and
//! the tables of children its process supervisors publish ([`ChildBoard`]), and its
//! leases counted by path ([`PathCounters`](crate::paths::PathCounters)).
//!
//! State only, below the node that keeps it; `status` reads it into a node status.

use crate::buffer::HeldLease;
use baton_messages::ProcessId;
use baton_messages::status::ChildEntry;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

/// What a supervisor publishes about its children (see [`Observed::register_children`]).
pub(crate) type ChildBoard = Arc<Mutex<Vec<ChildEntry>>>;

/// Leases held from one exporter whose link went down.
#[derive(Debug)]
pub(crate) struct OrphanGroup {
    pub(crate) exporter: ProcessId,
    pub(crate) since: Instant,
    pub(crate) leases: Vec<(Weak<HeldLease>, u64)>,
}

/// What a node keeps for its status besides its ledger, cache and links.
#[derive(Debug)]
pub(crate) struct Observed {
    pub(crate) created: Instant,
    /// Leases by path, granted and opened, and the downgrades taken.
    pub(crate) paths: crate::paths::PathCounters,
    orphans: Mutex<Vec<OrphanGroup>>,
    boards: Mutex<Vec<Weak<Mutex<Vec<ChildEntry>>>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each guarded value is a list left consistent by every single operation.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Observed {
    pub(crate) fn new() -> Self {
        Self {
            created: Instant::now(),
            paths: crate::paths::PathCounters::default(),
            orphans: Mutex::new(Vec::new()),
            boards: Mutex::new(Vec::new()),
        }
    }

    /// The leases a link held when it went down, still alive in their guards.
    pub(crate) fn record_orphans(&self, exporter: ProcessId, leases: Vec<(Weak<HeldLease>, u64)>) {
        let mut orphans = lock(&self.orphans);
        Self::prune(&mut orphans);
        if !leases.is_empty() {
            orphans.push(OrphanGroup {
                exporter,
                since: Instant::now(),
                leases,
            });
        }
    }

    /// The orphaned leases still alive in their guards, as their links left them.
    pub(crate) fn orphan_groups(&self) -> std::sync::MutexGuard<'_, Vec<OrphanGroup>> {
        let mut groups = lock(&self.orphans);
        Self::prune(&mut groups);
        groups
    }

    fn prune(orphans: &mut Vec<OrphanGroup>) {
        for g in orphans.iter_mut() {
            g.leases.retain(|(h, _)| h.strong_count() > 0);
        }
        orphans.retain(|g| !g.leases.is_empty());
    }

    /// A supervisor's table of children, listed for as long as it lives.
    pub(crate) fn register_children(&self, board: &ChildBoard) {
        let mut boards = lock(&self.boards);
        boards.retain(|b| b.strong_count() > 0);
        boards.push(Arc::downgrade(board));
    }

    pub(crate) fn children(&self) -> Vec<ChildEntry> {
        let mut boards = lock(&self.boards);
        boards.retain(|b| b.strong_count() > 0);
        boards
            .iter()
            .filter_map(Weak::upgrade)
            .flat_map(|b| lock(&b).clone())
            .collect()
    }
}
