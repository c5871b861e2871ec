//! Introspection: what a node holds and who holds what of it, as a
//! [`NodeStatus`].
//!
//! [`Node::status`] takes a snapshot in process; any authenticated peer may ask for one
//! over its link ([`Peer::status`](crate::Peer::status), or the `baton` command through a
//! short-lived link of its own: `StatusRequest`, answered `Status`). With
//! [`StatusScope::Tree`] the node also asks every other linked peer for its own status —
//! a supervision root answers for its whole tree — each within [`TREE_DEADLINE`].
//!
//! Every list is capped (the request's limit, at most
//! [`MAX_STATUS_ENTRIES`]) and says how many
//! entries it left out; the whole answer stays under
//! [`MAX_STATUS_BYTES`](baton_messages::status::MAX_STATUS_BYTES) (peers' statuses are
//! left out, last first, until it does).
//!
//! `Node`'s methods (`status`, `tree_status`, `path_counts`) are in `node/status.rs`; this
//! module, below `link` (whose actor answers a peer's `StatusRequest` with [`answer`]),
//! builds the answer from the node's state, a `NodeCore`.
//!
//! [`Node::status`]: crate::Node::status

use crate::ids::LinkId;
use crate::link_ref::AskStatus;
use crate::node_core::{NodeCore, Peer};
use baton_messages::ProcessId;
use baton_messages::protocol::{StatusRequest, StatusScope};
use baton_messages::status::{
    BufferEntry, CacheEntry, DEFAULT_STATUS_ENTRIES, LinkEntry, MAX_STATUS_ENTRIES, NodeStatus,
    Omitted, OrphanedLeases, PeerLeases, STATUS_VERSION, truncate,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a node waits for each linked peer's status when asked for the tree.
pub const TREE_DEADLINE: Duration = Duration::from_secs(2);

/// The variable that tells a child its name.
pub const CHILD_NAME_ENV: &str = "BATON_CHILD_NAME";

fn age_ms(since: Instant, now: Instant) -> u64 {
    now.saturating_duration_since(since).as_millis() as u64
}

/// A snapshot of `node` (the body of [`Node::status`](crate::Node::status)), its link
/// `requester`'s entry marked as the one that asked.
pub(crate) fn status_for(node: &NodeCore, limit: u32, requester: Option<LinkId>) -> NodeStatus {
    let limit = match limit {
        0 => DEFAULT_STATUS_ENTRIES,
        n => n.min(MAX_STATUS_ENTRIES),
    };
    let now = Instant::now();
    let observed = node.observed();
    let exports = node.exports().snapshot();
    let session = node.session().process();
    let children = observed.children();
    let names: HashMap<u32, &str> = children
        .iter()
        .filter_map(|c| Some((c.pid?, c.name.as_str())))
        .collect();
    let name_of = |pid: u32| names.get(&pid).map(|n| (*n).to_owned());

    let mut peers: Vec<PeerLeases> = exports
        .holders
        .iter()
        .map(|h| PeerLeases {
            pid: h.process.pid,
            start_ticks: h.process.start_ticks,
            name: name_of(h.process.pid),
            linked: h.linked,
            leases: h.leases as u64,
            pinned_bytes: h.pinned_bytes,
            mapped_bytes: h.mapped_bytes,
            oldest_lease_ms: h.oldest_grant.map(|t| age_ms(t, now)),
            cut: h.cut,
            quarantined_bytes: h.quarantined_bytes,
        })
        .collect();
    peers.sort_by(|a, b| {
        (b.pinned_bytes + b.quarantined_bytes, b.mapped_bytes, a.pid).cmp(&(
            a.pinned_bytes + a.quarantined_bytes,
            a.mapped_bytes,
            b.pid,
        ))
    });

    let mut buffer_table: Vec<BufferEntry> = exports
        .table
        .iter()
        .map(|(v, kind, device)| BufferEntry {
            id: v.buffer.get(),
            alloc: v.alloc.get(),
            bytes: v.bytes,
            backend: kind.map(|k| format!("{k:?}")).unwrap_or_default(),
            device: device.to_string(),
            leases: v.leases.len() as u64,
            holders: {
                let mut pids: Vec<u32> = v
                    .leases
                    .iter()
                    .map(|(_, p)| p.pid)
                    .chain(v.mapped_by.iter().map(|p| p.pid))
                    .collect();
                pids.sort_unstable();
                pids.dedup();
                pids
            },
            cut_holders: v.cut_holders.iter().map(|p| p.pid).collect(),
            retiring: v.retiring,
            quarantined: v.quarantined,
        })
        .collect();

    let mut orphaned = (0u64, 0u64);
    let mut orphaned_leases: Vec<OrphanedLeases> = {
        let groups = observed.orphan_groups();
        let mut by: HashMap<ProcessId, OrphanedLeases> = HashMap::new();
        for g in groups.iter() {
            let e = by.entry(g.exporter).or_insert_with(|| OrphanedLeases {
                pid: g.exporter.pid,
                start_ticks: g.exporter.start_ticks,
                since_ms: age_ms(g.since, now),
                ..Default::default()
            });
            e.since_ms = e.since_ms.max(age_ms(g.since, now));
            for (_, bytes) in &g.leases {
                e.leases += 1;
                e.bytes += bytes;
                orphaned.0 += 1;
                orphaned.1 += bytes;
            }
        }
        let mut v: Vec<OrphanedLeases> = by.into_values().collect();
        v.sort_by_key(|o| (std::cmp::Reverse(o.bytes), o.pid));
        v
    };

    let c = node.cache().stats();
    let cache = CacheEntry {
        entries: c.live as u64,
        warm: c.warm as u64,
        warm_bytes: c.warm_bytes,
        opens: c.opens,
        hits: c.hits,
        closes: c.closes,
        evictions: c.evictions,
        stale: c.stale,
    };

    let mut links: Vec<LinkEntry> = node
        .peers()
        .iter()
        .map(|p| LinkEntry {
            id: p.link_id().get(),
            pid: p.process().pid,
            start_ticks: p.process().start_ticks,
            // A remote pid names no child of ours, whatever its number.
            name: match p.info().host() {
                None => name_of(p.process().pid),
                Some(_) => None,
            },
            host: p.info().host().map(|h| h.host.to_string()),
            addr: p.info().host().map(|h| h.addr.to_string()),
            round_trip_us: p.round_trip().map(|d| d.as_micros() as u64),
            queued_bytes: p.queued_bytes() as u64,
            leases_held: p.link.state().held_leases() as u64,
            requester: Some(p.link_id()) == requester,
            status: None,
            status_error: None,
        })
        .collect();
    links.sort_by_key(|l| l.id);

    let mut children = children;
    let omitted = Omitted {
        peers: truncate(&mut peers, limit),
        buffer_table: truncate(&mut buffer_table, limit),
        orphaned_leases: truncate(&mut orphaned_leases, limit),
        links: truncate(&mut links, limit),
        children: truncate(&mut children, limit),
    };
    let counts = exports.counts;
    let (paths, downgrades) = observed.paths.snapshot();
    NodeStatus {
        version: STATUS_VERSION,
        pid: session.pid,
        start_ticks: session.start_ticks,
        name: std::env::var(CHILD_NAME_ENV).ok(),
        backend: node.backend().name().to_owned(),
        device: node.backend().device().to_string(),
        uptime_ms: age_ms(observed.created, now),
        buffers: counts.buffers as u64,
        bytes: counts.bytes,
        retiring: counts.retiring as u64,
        quarantined: counts.quarantined as u64,
        quarantined_bytes: counts.quarantined_bytes,
        leases: counts.leases as u64,
        pinned_bytes: counts.pinned_bytes,
        granted: exports.granted,
        freed: exports.freed,
        orphaned: orphaned.0,
        orphaned_bytes: orphaned.1,
        peers,
        buffer_table,
        orphaned_leases,
        cache,
        links,
        children,
        omitted,
        paths,
        downgrades,
    }
}

impl Peer {
    /// Asks the peer for its [`NodeStatus`] over this link.
    ///
    /// # Errors
    /// [`ActorError::LinkClosed`](crate::ActorError::LinkClosed) if the link goes down
    /// first; [`ActorError::Timeout`](crate::ActorError::Timeout) after `within`;
    /// [`ActorError::Decode`](crate::ActorError::Decode) if the answer is not a status.
    pub fn status(
        &self,
        limit: u32,
        within: Duration,
    ) -> impl Future<Output = Result<NodeStatus, crate::ActorError>> + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.link.do_send(AskStatus { limit, reply: tx });
        let peer = self.process();
        async move {
            let json = match tokio::time::timeout(within, rx).await {
                Ok(Ok(answer)) => answer?,
                Ok(Err(_)) => return Err(crate::ActorError::link_closed(peer)),
                Err(_) => {
                    return Err(crate::ActorError::Timeout {
                        op: "a peer's status",
                        after: within,
                    });
                }
            };
            NodeStatus::from_json(&json).map_err(|e| crate::ActorError::Decode {
                what: "a node status",
                reason: e.to_string(),
            })
        }
    }
}

/// Asks every linked peer but `requester` for its status and puts each answer (or why
/// there is none) in its link's entry.
pub(crate) async fn fill_tree(
    node: &NodeCore,
    status: &mut NodeStatus,
    limit: u32,
    requester: Option<LinkId>,
) {
    let peers: HashMap<u64, Peer> = node
        .peers()
        .into_iter()
        .map(|p| (p.link_id().get(), p))
        .collect();
    let asks: Vec<_> = status
        .links
        .iter()
        .filter(|l| Some(l.id) != requester.map(LinkId::get))
        .filter_map(|l| {
            let peer = peers.get(&l.id)?;
            Some((l.id, peer.status(limit, TREE_DEADLINE)))
        })
        .collect();
    let (ids, futures): (Vec<u64>, Vec<_>) = asks.into_iter().unzip();
    let answers = futures_util::future::join_all(futures).await;
    for (id, answer) in ids.into_iter().zip(answers) {
        if let Some(entry) = status.links.iter_mut().find(|l| l.id == id) {
            match answer {
                Ok(s) => entry.status = Some(Box::new(s)),
                Err(e) => entry.status_error = Some(e.to_string()),
            }
        }
    }
}

/// Leaves peers' statuses out, last first, until the whole status encodes within
/// `MAX_STATUS_BYTES`.
pub(crate) fn fit(status: &mut NodeStatus) -> String {
    loop {
        match status.to_json() {
            Ok(json) => return json,
            Err(e) => {
                let Some(entry) = status.links.iter_mut().rev().find(|l| l.status.is_some()) else {
                    // Only this node's own lists are left, and they are capped: this
                    // cannot happen with the caps as they are, but say so if it does.
                    tracing::warn!(error = %e, "a node status does not fit a frame");
                    return format!(
                        "{{\"version\":{STATUS_VERSION},\"pid\":{},\"status_error\":\"too large\"}}",
                        status.pid
                    );
                };
                entry.status = None;
                entry.status_error = Some("left out: the answer would not fit a frame".to_owned());
            }
        }
    }
}

/// The body of the answer to `request`, which came over `requester`.
pub(crate) async fn answer(node: &NodeCore, request: StatusRequest, requester: LinkId) -> String {
    let mut status = status_for(node, request.limit, Some(requester));
    if request.scope == StatusScope::Tree {
        fill_tree(node, &mut status, request.limit, Some(requester)).await;
    }
    fit(&mut status)
}
