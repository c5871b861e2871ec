//! Counters and gauges of a node, through the [`metrics`] facade.
//!
//! Nothing is recorded unless the application installs a recorder (for instance
//! `metrics-exporter-prometheus`, as `examples/embed_in_service.rs --prometheus ADDR`
//! does) and starts [`Node::publish_metrics`]: the node then samples its status on an
//! interval, so the hot path of a handoff pays nothing for metrics.
//!
//! | name | kind | what |
//! |---|---|---|
//! | `baton_buffers` | gauge | exported buffers alive |
//! | `baton_buffer_bytes` | gauge | their bytes |
//! | `baton_leases_out` | gauge | leases out on them |
//! | `baton_pinned_bytes` | gauge | bytes of the buffers at least one lease is out on |
//! | `baton_quarantined_buffers` | gauge | buffers quarantined (a cut holder may still map them) |
//! | `baton_quarantined_bytes` | gauge | their bytes |
//! | `baton_orphaned_leases` | gauge | leases held here whose exporter is gone |
//! | `baton_links` | gauge | links up |
//! | `baton_cache_entries` | gauge | mappings open in the import cache |
//! | `baton_cache_warm_bytes` | gauge | bytes of its warm mappings |
//! | `baton_handoffs_total` | counter | leases granted (buffers handed to another process) |
//! | `baton_buffers_freed_total` | counter | buffers freed |
//! | `baton_cache_opens_total` | counter | driver-level opens (or `mmap`s) of the import cache |
//! | `baton_cache_hits_total` | counter | opens served from a mapping, with no driver call |
//! | `baton_link_round_trip_seconds{peer}` | gauge | last heartbeat round trip, per linked pid |
//! | `baton_link_queued_bytes{peer}` | gauge | bytes queued for the peer's socket |
//! | `baton_tx_requests_num_total{path}` | counter | leases this node granted, by the path each was offered as |
//! | `baton_tx_bytes_total{path}` | counter | their bytes |
//! | `baton_rx_requests_num_total{path}` | counter | leases this node opened, by the path their bytes took |
//! | `baton_rx_bytes_total{path}` | counter | their bytes |
//! | `baton_path_downgrades_total{wanted,taken}` | counter | downgrades to a slower path taken (each allowed by the node's policy) |
//!
//! `path` is a [`LeasePath`](crate::LeasePath) label: `host-memfd`, `host-segment`,
//! `cuda-legacy`, `cuda-vmm`, `cuda-pool` (importers add `-peer-gpu` for another GPU's
//! memory), `tcp-copy`, `nccl-copy`, `other`; a path no lease took yet has no series.
//!
//! **Names shared with NIXL.** Where a metric means what one of NIXL's telemetry does, it
//! has NIXL's name with Baton's prefix in place of NIXL's `agent_` (NIXL's Prometheus
//! exporter adds `_total` to its counters, as here):
//!
//! | Baton | NIXL | the same except |
//! |---|---|---|
//! | `baton_tx_bytes_total` | `agent_tx_bytes_total` | a lease mapped in place moves no bytes: its bytes are those the peer may read (its length); a copy's are the bytes sent |
//! | `baton_rx_bytes_total` | `agent_rx_bytes_total` | as above, on the receiving side |
//! | `baton_tx_requests_num_total` | `agent_tx_requests_num_total` | one request is one lease |
//! | `baton_rx_requests_num_total` | `agent_rx_requests_num_total` | as above |
//!
//! NIXL labels by agent and host; Baton's series carry `path` instead (the recorder adds
//! the process's own labels). NIXL's `agent_xfer_time`, memory registration and error
//! events have no Baton counterpart here.
//!
//! [`Node::publish_metrics`] is `Node`'s, in `node/metrics.rs`; this module, below the node
//! tree, has what it records and its guard.
//!
//! [`Node::publish_metrics`]: crate::Node::publish_metrics

use baton_messages::status::NodeStatus;
use metrics::{counter, gauge};
use std::fmt;

/// Records `status` through the `metrics` facade (see the [module docs](self) for the
/// names). A no-op without an installed recorder.
pub fn record(status: &NodeStatus) {
    gauge!("baton_buffers").set(status.buffers as f64);
    gauge!("baton_buffer_bytes").set(status.bytes as f64);
    gauge!("baton_leases_out").set(status.leases as f64);
    gauge!("baton_pinned_bytes").set(status.pinned_bytes as f64);
    gauge!("baton_quarantined_buffers").set(status.quarantined as f64);
    gauge!("baton_quarantined_bytes").set(status.quarantined_bytes as f64);
    gauge!("baton_orphaned_leases").set(status.orphaned as f64);
    gauge!("baton_links").set((status.links.len() as u64 + status.omitted.links) as f64);
    gauge!("baton_cache_entries").set(status.cache.entries as f64);
    gauge!("baton_cache_warm_bytes").set(status.cache.warm_bytes as f64);
    counter!("baton_handoffs_total").absolute(status.granted);
    counter!("baton_buffers_freed_total").absolute(status.freed);
    counter!("baton_cache_opens_total").absolute(status.cache.opens);
    counter!("baton_cache_hits_total").absolute(status.cache.hits);
    for p in &status.paths {
        let path = p.path.clone();
        counter!("baton_tx_requests_num_total", "path" => path.clone()).absolute(p.granted);
        counter!("baton_tx_bytes_total", "path" => path.clone()).absolute(p.granted_bytes);
        counter!("baton_rx_requests_num_total", "path" => path.clone()).absolute(p.opened);
        counter!("baton_rx_bytes_total", "path" => path).absolute(p.opened_bytes);
    }
    for d in &status.downgrades {
        counter!("baton_path_downgrades_total", "wanted" => d.wanted.clone(), "taken" => d.taken.clone())
            .absolute(d.count);
    }
    for link in &status.links {
        let peer = link.pid.to_string();
        if let Some(us) = link.round_trip_us {
            gauge!("baton_link_round_trip_seconds", "peer" => peer.clone()).set(us as f64 / 1e6);
        }
        gauge!("baton_link_queued_bytes", "peer" => peer).set(link.queued_bytes as f64);
    }
}

/// Samples a node's status into the `metrics` facade on an interval, until dropped (see
/// [`Node::publish_metrics`]).
///
/// [`Node::publish_metrics`]: crate::Node::publish_metrics
pub struct MetricsPublisher {
    task: tokio::task::JoinHandle<()>,
}

impl fmt::Debug for MetricsPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetricsPublisher").finish_non_exhaustive()
    }
}

impl MetricsPublisher {
    /// The guard of the sampling `task`: aborted when dropped.
    pub(crate) fn new(task: tokio::task::JoinHandle<()>) -> Self {
        Self { task }
    }
}

impl Drop for MetricsPublisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}
