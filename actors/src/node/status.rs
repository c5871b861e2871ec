//! A [`Node`]'s status (see [`status`](crate::status) for what it holds and how it is
//! capped).

use super::Node;
use crate::status::{fill_tree, fit, status_for};
use baton_messages::status::{DowngradeEntry, NodeStatus, PathEntry};

impl Node {
    /// A snapshot of this node: its buffers and who holds what of them (leases, bytes
    /// pinned, oldest lease age), quarantines, the orphaned leases it holds, its import
    /// cache, its links (round trip, queued bytes) and the children of the process
    /// supervisors started with it. Each list keeps at most `limit` entries (0: the
    /// default, 64; at most 256) and says how many it left out.
    pub fn status(&self, limit: u32) -> NodeStatus {
        status_for(&self.core, limit, None)
    }

    /// This node's leases by path — granted on its buffers, opened on others' — and the
    /// downgrades it took: [`NodeStatus::paths`] and [`NodeStatus::downgrades`] alone,
    /// without the rest of a status (see [`paths`](crate::paths)).
    pub fn path_counts(&self) -> (Vec<PathEntry>, Vec<DowngradeEntry>) {
        self.core.observed().paths.snapshot()
    }

    /// As [`status`](Self::status), and every linked peer's own status in its link's
    /// entry (asked now, each within [`TREE_DEADLINE`]): a supervision root answers for
    /// its tree. Must be called inside an actix system.
    ///
    /// [`TREE_DEADLINE`]: crate::TREE_DEADLINE
    pub async fn tree_status(&self, limit: u32) -> NodeStatus {
        let mut status = status_for(&self.core, limit, None);
        fill_tree(&self.core, &mut status, limit, None).await;
        fit(&mut status);
        status
    }
}
