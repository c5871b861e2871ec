//! What a node tells an authenticated peer about itself: [`NodeStatus`].
//!
//! A linked peer (or a short-lived admin connection, such as the `baton` command's: the
//! link handshake proves it holds the session token) sends
//! [`StatusRequest`](crate::protocol::StatusRequest); the node answers
//! [`Status`](crate::protocol::Status), whose body is a [`NodeStatus`] encoded as JSON.
//!
//! JSON, not bincode, because the status is read by tools and other languages and must
//! survive version skew: a reader ignores fields it does not know, and fields it expects
//! but the writer did not send take their defaults (every struct here is
//! `#[serde(default)]`). [`STATUS_VERSION`] changes only when the meaning of an existing
//! field changes; adding fields does not change it.
//!
//! Every list is bounded: the request names how many entries it wants per list (at most
//! [`MAX_STATUS_ENTRIES`]), and [`Omitted`] says how many were left out of each. The
//! totals (`buffers`, `leases`, `pinned_bytes`, …) always count everything.

use serde::{Deserialize, Serialize};

/// The version of the status schema this build writes.
pub const STATUS_VERSION: u16 = 1;

/// The most entries of one list a node puts in a status.
pub const MAX_STATUS_ENTRIES: u32 = 256;

/// The entries per list a node answers with when the request does not say.
pub const DEFAULT_STATUS_ENTRIES: u32 = 64;

/// The most bytes of JSON a status may take: well inside a frame
/// ([`MAX_FRAME_LEN`](crate::MAX_FRAME_LEN)), with room for the envelope.
pub const MAX_STATUS_BYTES: usize = 768 * 1024;

/// A node's state: its exported buffers and who holds them, the leases it holds from
/// others, its import cache, its links and its supervised children.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeStatus {
    /// The schema version ([`STATUS_VERSION`]).
    pub version: u16,
    /// The node's process id.
    pub pid: u32,
    /// Its start time (clock ticks since boot): with `pid`, names the process.
    pub start_ticks: u64,
    /// Its name as a supervised child (`BATON_CHILD_NAME`), if it is one.
    pub name: Option<String>,
    /// The backend it allocates with (its name, e.g. `host (memfd)`).
    pub backend: String,
    /// The device it allocates on (a GPU UUID, or `host`).
    pub device: String,
    /// Milliseconds since the node was created.
    pub uptime_ms: u64,
    /// Buffers this node exports that are alive (handles, leases or mappings out).
    pub buffers: u64,
    /// Bytes of those buffers.
    pub bytes: u64,
    /// Of those, buffers with no handle left, waiting to be freed.
    pub retiring: u64,
    /// Of those, buffers quarantined: a cut holder may still map them and the backend's
    /// free is unsafe while it does.
    pub quarantined: u64,
    /// Bytes quarantined.
    pub quarantined_bytes: u64,
    /// Leases out on this node's buffers.
    pub leases: u64,
    /// Bytes of the buffers at least one lease is out on.
    pub pinned_bytes: u64,
    /// Leases granted so far (every buffer handed to another process is one).
    pub granted: u64,
    /// Buffers freed so far.
    pub freed: u64,
    /// Leases this node holds on other processes' buffers whose exporter is gone
    /// (orphaned: their accessors fail; the mapping closes when they drop).
    pub orphaned: u64,
    /// Bytes of those leases.
    pub orphaned_bytes: u64,
    /// Every process holding something of this node's: leases, warm mappings, or (cut
    /// holders) a mapping it may still have. Sorted by pinned bytes, largest first.
    pub peers: Vec<PeerLeases>,
    /// This node's buffers, in creation order.
    pub buffer_table: Vec<BufferEntry>,
    /// The orphaned leases this node holds, grouped by the exporter that is gone.
    pub orphaned_leases: Vec<OrphanedLeases>,
    /// The import cache.
    pub cache: CacheEntry,
    /// The links up now.
    pub links: Vec<LinkEntry>,
    /// The children of the process supervisors registered with this node.
    pub children: Vec<ChildEntry>,
    /// How many entries each list left out.
    pub omitted: Omitted,
    /// Leases by the path their bytes took, as this node granted them (exporter) and
    /// opened them (importer): one entry per path seen, in the order of its label. A
    /// handful of labels at most, never capped.
    pub paths: Vec<PathEntry>,
    /// Downgrades to a slower path this node took (each one allowed by its policy), by
    /// the path wanted and the one taken. Never capped: a handful of pairs at most.
    pub downgrades: Vec<DowngradeEntry>,
}

/// Leases of one path (see [`NodeStatus::paths`]). The label is Rust's
/// `LeasePath::name`: `host-memfd`, `host-segment`, `cuda-legacy`, `cuda-vmm`, `cuda-pool`
/// (each with `-peer-gpu` when the importer mapped another GPU's memory), `tcp-copy`,
/// `nccl-copy`, `other`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PathEntry {
    /// The path's label.
    pub path: String,
    /// Leases this node granted on its buffers that took it (offers sent). The exporter
    /// does not know which GPU the importer maps from: its grants of device memory carry
    /// the label without `-peer-gpu`.
    pub granted: u64,
    /// Bytes of those leases.
    pub granted_bytes: u64,
    /// Leases this node opened on other processes' buffers that took it.
    pub opened: u64,
    /// Bytes of those leases.
    pub opened_bytes: u64,
}

/// Downgrades of one kind (see [`NodeStatus::downgrades`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DowngradeEntry {
    /// The path wanted (a path label, as in [`PathEntry::path`]).
    pub wanted: String,
    /// The slower path taken instead.
    pub taken: String,
    /// Times it was taken.
    pub count: u64,
}

/// One process holding something of a node's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PeerLeases {
    /// Its process id.
    pub pid: u32,
    /// Its start time (clock ticks since boot).
    pub start_ticks: u64,
    /// Its name, if it is a child of this node's supervisor.
    pub name: Option<String>,
    /// Whether a link to it is up.
    pub linked: bool,
    /// Leases it holds.
    pub leases: u64,
    /// Bytes of the buffers it holds at least one lease on.
    pub pinned_bytes: u64,
    /// Bytes of the buffers it keeps mapped (warm mappings and leased ones).
    pub mapped_bytes: u64,
    /// How long ago its oldest lease was granted, in milliseconds.
    pub oldest_lease_ms: Option<u64>,
    /// Its link was cut while it held buffers: it may still map them until it is
    /// confirmed dead.
    pub cut: bool,
    /// Bytes quarantined because of it.
    pub quarantined_bytes: u64,
}

/// One exported buffer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BufferEntry {
    /// The buffer's id in its node.
    pub id: u64,
    /// Its allocation id.
    pub alloc: u64,
    /// Bytes allocated.
    pub bytes: u64,
    /// The backend kind (`Host`, `CudaLegacy`, `CudaVmm`, `CudaPool`).
    pub backend: String,
    /// The device (a GPU UUID, or `host`).
    pub device: String,
    /// Leases out on it.
    pub leases: u64,
    /// Processes that hold a lease on it or keep it mapped over a live link.
    pub holders: Vec<u32>,
    /// Processes whose link was cut while they held it.
    pub cut_holders: Vec<u32>,
    /// No handle is left: freed as soon as nobody may map it.
    pub retiring: bool,
    /// Retiring, but kept allocated until its cut holders are confirmed dead.
    pub quarantined: bool,
}

/// Leases a node holds from one exporter that is gone.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct OrphanedLeases {
    /// The exporter's process id.
    pub pid: u32,
    /// Its start time.
    pub start_ticks: u64,
    /// Leases still held.
    pub leases: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Milliseconds since the link to the exporter went down.
    pub since_ms: u64,
}

/// The import cache of a node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CacheEntry {
    /// Mappings open now (in use or warm).
    pub entries: u64,
    /// Of those, warm: mapped, with no lease using them.
    pub warm: u64,
    /// Bytes of the warm mappings.
    pub warm_bytes: u64,
    /// Opens that mapped memory: one driver-level open (or `mmap`) each.
    pub opens: u64,
    /// Opens served from a live or warm mapping, with no driver call.
    pub hits: u64,
    /// Mappings closed.
    pub closes: u64,
    /// Warm mappings given up because the budget was exceeded.
    pub evictions: u64,
    /// Handles refused as stale.
    pub stale: u64,
}

/// One link of a node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LinkEntry {
    /// The link's id in its node.
    pub id: u64,
    /// The peer's process id.
    pub pid: u32,
    /// Its start time.
    pub start_ticks: u64,
    /// Its name, if it is a child of this node's supervisor.
    pub name: Option<String>,
    /// For a peer on another host (a TCP host link): its host id, as shown in logs.
    pub host: Option<String>,
    /// For a peer on another host: the address of its end of the link.
    pub addr: Option<String>,
    /// The last round trip measured (heartbeat or ping), in microseconds.
    pub round_trip_us: Option<u64>,
    /// Bytes queued for the peer's socket.
    pub queued_bytes: u64,
    /// Leases this node holds from the peer over the link.
    pub leases_held: u64,
    /// This is the link the request came over.
    pub requester: bool,
    /// The peer's own status, when the request asked for the tree
    /// ([`StatusScope::Tree`](crate::protocol::StatusScope::Tree)) and the peer answered
    /// in time.
    pub status: Option<Box<NodeStatus>>,
    /// Why the peer's status is missing, when it was asked for and is.
    pub status_error: Option<String>,
}

/// One child of a process supervisor.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ChildEntry {
    /// Its name.
    pub name: String,
    /// `running`, `restarting` (dead, to be started again), `exited` (done, not
    /// restarted) or `stopped` (the supervisor stopped).
    pub state: String,
    /// Its pid, while running.
    pub pid: Option<u32>,
    /// Its start time, while running.
    pub start_ticks: Option<u64>,
    /// Times restarted so far.
    pub restarts: u32,
    /// How its last run ended (`exit code 0`, `killed by signal 9`), if one did.
    pub last_exit: Option<String>,
    /// For a child on another host, the address of the agent that runs it (its `pid` is
    /// a pid of that host); `None` for a local child.
    pub host: Option<String>,
    /// For a child that a child agent of this node runs for a supervisor on another host,
    /// that supervisor's process; `None` for a child of this node's own supervisors.
    pub supervisor: Option<String>,
}

/// How many entries each list of a [`NodeStatus`] left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Omitted {
    /// Of `peers`.
    pub peers: u64,
    /// Of `buffer_table`.
    pub buffer_table: u64,
    /// Of `orphaned_leases`.
    pub orphaned_leases: u64,
    /// Of `links`.
    pub links: u64,
    /// Of `children`.
    pub children: u64,
}

impl Omitted {
    /// Whether any list left something out.
    pub fn any(&self) -> bool {
        self.peers + self.buffer_table + self.orphaned_leases + self.links + self.children > 0
    }
}

/// Keeps the first `limit` entries of `list` and returns how many it dropped.
pub fn truncate<T>(list: &mut Vec<T>, limit: u32) -> u64 {
    let limit = limit as usize;
    let dropped = list.len().saturating_sub(limit);
    list.truncate(limit);
    dropped as u64
}

impl NodeStatus {
    /// The JSON body of a [`Status`](crate::protocol::Status) message.
    ///
    /// # Errors
    /// [`Error::Status`](crate::Error::Status) if it does not encode, or takes more than
    /// [`MAX_STATUS_BYTES`].
    pub fn to_json(&self) -> crate::Result<String> {
        let json = serde_json::to_string(self).map_err(|e| crate::Error::Status(e.to_string()))?;
        if json.len() > MAX_STATUS_BYTES {
            return Err(crate::Error::Status(format!(
                "{} bytes of JSON, more than {MAX_STATUS_BYTES}",
                json.len()
            )));
        }
        Ok(json)
    }

    /// Decodes a [`Status`](crate::protocol::Status) message's body.
    ///
    /// # Errors
    /// [`Error::Status`](crate::Error::Status) if it is larger than [`MAX_STATUS_BYTES`]
    /// or is not a status.
    pub fn from_json(json: &str) -> crate::Result<NodeStatus> {
        if json.len() > MAX_STATUS_BYTES {
            return Err(crate::Error::Status(format!(
                "{} bytes of JSON, more than {MAX_STATUS_BYTES}",
                json.len()
            )));
        }
        serde_json::from_str(json).map_err(|e| crate::Error::Status(e.to_string()))
    }

    /// Every status in the tree rooted here: this one, then those of its links (depth
    /// first).
    pub fn tree(&self) -> Vec<&NodeStatus> {
        let mut out = vec![self];
        for link in &self.links {
            if let Some(s) = &link.status {
                out.extend(s.tree());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_round_trips_and_unknown_or_missing_fields_are_tolerated() {
        let status = NodeStatus {
            version: STATUS_VERSION,
            pid: 7,
            buffers: 2,
            peers: vec![PeerLeases {
                pid: 9,
                leases: 3,
                oldest_lease_ms: Some(12),
                ..Default::default()
            }],
            links: vec![LinkEntry {
                pid: 9,
                status: Some(Box::new(NodeStatus {
                    pid: 9,
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        };
        let json = status.to_json().unwrap();
        assert_eq!(NodeStatus::from_json(&json).unwrap(), status);
        assert_eq!(
            status.tree().iter().map(|s| s.pid).collect::<Vec<_>>(),
            [7, 9]
        );
        // A newer writer's extra field, and an older writer's missing ones.
        let skewed =
            NodeStatus::from_json(r#"{"pid": 3, "leases": 4, "from_the_future": [1]}"#).unwrap();
        assert_eq!((skewed.pid, skewed.leases, skewed.buffers), (3, 4, 0));
        // A writer from before paths were counted: no paths, no downgrades.
        assert!(skewed.paths.is_empty() && skewed.downgrades.is_empty());
        assert!(NodeStatus::from_json("\"a string\"").is_err());
        let huge = format!("{{\"name\": \"{}\"}}", "x".repeat(MAX_STATUS_BYTES));
        assert!(NodeStatus::from_json(&huge).is_err());
    }

    #[test]
    fn truncate_counts_what_it_drops() {
        let mut v: Vec<u32> = (0..10).collect();
        assert_eq!(truncate(&mut v, 4), 6);
        assert_eq!(v, [0, 1, 2, 3]);
        assert_eq!(truncate(&mut v, 8), 0);
        assert!(!Omitted::default().any());
        assert!(
            Omitted {
                links: 1,
                ..Default::default()
            }
            .any()
        );
    }
}
