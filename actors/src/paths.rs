//! Path truth: which path each lease's bytes took, counted per node, and the downgrades to
//! a slower path — opt-in, and visible when taken.
//!
//! Every lease has a [`LeasePath`] on both sides: the exporter counts its grants by the
//! handle it offered ([`LeasePath::offered`]), the importer its opens by how it mapped or
//! received the bytes ([`Lease::path`](crate::Lease::path)). A node counts both, per
//! path; its status lists them
//! ([`NodeStatus::paths`](baton_messages::status::NodeStatus::paths)) and the metrics
//! publish them with a `path` label ([`metrics`](crate::metrics)).
//!
//! A **downgrade** is a slower path than the one wanted, taken because the wanted one is
//! not there ([`Downgrade`] names each kind Baton knows). A node refuses one unless its
//! [`DowngradePolicy`] allows it ([`NodeConfig::downgrades`](crate::NodeConfig::downgrades),
//! or [`ALLOW_DOWNGRADE_ENV`]): the refusal is [`ActorError::PathDowngrade`](crate::ActorError::PathDowngrade), naming the
//! path wanted and the one available. Allowed, the downgrade is counted, logged at warn and
//! told to the node's subscribers as a [`PathDowngraded`] event
//! ([`Node::on_downgrade`](crate::Node::on_downgrade)).

use baton_messages::ProcessId;
use baton_messages::status::{DowngradeEntry, PathEntry};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The way a lease's bytes reached this process: mapped in place, and through which kind
/// of handle, or copied here by a transfer engine. [`Lease::path`](crate::Lease::path) says it for every lease,
/// so that a slower path is never taken silently. [`name`](Self::name) is its label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LeasePath {
    /// Host memory mapped in place: a sealed memfd passed over the Unix socket.
    HostMemfd,
    /// Host memory mapped in place: a named POSIX shared-memory segment.
    HostSegment,
    /// Device memory mapped through a legacy CUDA IPC handle; `peer_gpu`: memory of
    /// another GPU than this backend's, reached peer-to-peer.
    CudaLegacy {
        /// Another GPU's memory.
        peer_gpu: bool,
    },
    /// Device memory mapped from a VMM allocation's descriptor.
    CudaVmm {
        /// Another GPU's memory.
        peer_gpu: bool,
    },
    /// Device memory mapped from a stream-ordered pool's descriptor.
    CudaPool {
        /// Another GPU's memory.
        peer_gpu: bool,
    },
    /// Copied from another host into our host memory by the TCP engine.
    TcpCopy,
    /// Copied from another host into our device memory by the NCCL engine.
    NcclCopy,
    /// A kind of handle this label does not know yet.
    Other,
}

impl LeasePath {
    /// The path of an offer as its exporter sent it, from its handle: a mapping's kind of
    /// handle (never `peer_gpu`: which GPU maps it is the importer's to know), or the
    /// engine that copies it.
    pub fn offered(raw: &baton_messages::RawHandle) -> Self {
        use baton_messages::{CopyEngine, RawHandle};
        match raw {
            RawHandle::HostMemfd { .. } => LeasePath::HostMemfd,
            RawHandle::HostSegment(_) => LeasePath::HostSegment,
            RawHandle::CudaIpc(_) => LeasePath::CudaLegacy { peer_gpu: false },
            RawHandle::CudaVmmFd { .. } => LeasePath::CudaVmm { peer_gpu: false },
            RawHandle::CudaPool { .. } => LeasePath::CudaPool { peer_gpu: false },
            RawHandle::Copy {
                engine: CopyEngine::Tcp,
            } => LeasePath::TcpCopy,
            RawHandle::Copy {
                engine: CopyEngine::Nccl,
            } => LeasePath::NcclCopy,
            _ => LeasePath::Other,
        }
    }

    /// The path a buffer of `backend`'s takes to a peer of this host: mapped in place
    /// through the handle it exports.
    pub fn exported_by(backend: &dyn baton_ipc::Backend) -> Self {
        use baton_messages::BackendKind;
        match backend.kind() {
            BackendKind::Host => {
                let host = backend.as_any().downcast_ref::<baton_ipc::HostBackend>();
                match host.map(baton_ipc::HostBackend::flavor) {
                    Some(baton_ipc::HostFlavor::Named) => LeasePath::HostSegment,
                    _ => LeasePath::HostMemfd,
                }
            }
            BackendKind::CudaLegacy => LeasePath::CudaLegacy { peer_gpu: false },
            BackendKind::CudaVmm => LeasePath::CudaVmm { peer_gpu: false },
            BackendKind::CudaPool => LeasePath::CudaPool { peer_gpu: false },
            _ => LeasePath::Other,
        }
    }

    /// Every path, in the order of the status's list.
    pub const ALL: [LeasePath; 11] = [
        LeasePath::HostMemfd,
        LeasePath::HostSegment,
        LeasePath::CudaLegacy { peer_gpu: false },
        LeasePath::CudaLegacy { peer_gpu: true },
        LeasePath::CudaVmm { peer_gpu: false },
        LeasePath::CudaVmm { peer_gpu: true },
        LeasePath::CudaPool { peer_gpu: false },
        LeasePath::CudaPool { peer_gpu: true },
        LeasePath::TcpCopy,
        LeasePath::NcclCopy,
        LeasePath::Other,
    ];

    /// Its place in [`ALL`](Self::ALL).
    pub(crate) fn index(self) -> usize {
        match self {
            LeasePath::HostMemfd => 0,
            LeasePath::HostSegment => 1,
            LeasePath::CudaLegacy { peer_gpu } => 2 + usize::from(peer_gpu),
            LeasePath::CudaVmm { peer_gpu } => 4 + usize::from(peer_gpu),
            LeasePath::CudaPool { peer_gpu } => 6 + usize::from(peer_gpu),
            LeasePath::TcpCopy => 8,
            LeasePath::NcclCopy => 9,
            LeasePath::Other => 10,
        }
    }

    /// Its label: `host-memfd`, `host-segment`, `cuda-legacy`, `cuda-vmm`, `cuda-pool`
    /// (with `-peer-gpu` for another GPU's memory), `tcp-copy`, `nccl-copy`, `other`.
    pub fn name(self) -> &'static str {
        match self {
            LeasePath::HostMemfd => "host-memfd",
            LeasePath::HostSegment => "host-segment",
            LeasePath::CudaLegacy { peer_gpu: false } => "cuda-legacy",
            LeasePath::CudaLegacy { peer_gpu: true } => "cuda-legacy-peer-gpu",
            LeasePath::CudaVmm { peer_gpu: false } => "cuda-vmm",
            LeasePath::CudaVmm { peer_gpu: true } => "cuda-vmm-peer-gpu",
            LeasePath::CudaPool { peer_gpu: false } => "cuda-pool",
            LeasePath::CudaPool { peer_gpu: true } => "cuda-pool-peer-gpu",
            LeasePath::TcpCopy => "tcp-copy",
            LeasePath::NcclCopy => "nccl-copy",
            LeasePath::Other => "other",
        }
    }

    /// Whether the bytes were copied here (not mapped in place).
    pub fn is_copy(self) -> bool {
        matches!(self, LeasePath::TcpCopy | LeasePath::NcclCopy)
    }
}

impl std::fmt::Display for LeasePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The variable that allows downgrades to a slower path when the node's configuration does
/// not say: `1`, `true`, `yes` or `allow` allow them; unset, or anything else, refuses.
pub const ALLOW_DOWNGRADE_ENV: &str = "BATON_ALLOW_DOWNGRADE";

/// Whether a node takes a slower path than the one wanted (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DowngradePolicy {
    /// Refuse with [`ActorError::PathDowngrade`](crate::ActorError::PathDowngrade) (the default).
    #[default]
    Refuse,
    /// Take it, and tell: a [`PathDowngraded`] event, a warning, a counter.
    Allow,
}

impl DowngradePolicy {
    /// The policy [`ALLOW_DOWNGRADE_ENV`] asks for: [`Allow`](Self::Allow) for `1`,
    /// `true`, `yes` or `allow` (any case), else [`Refuse`](Self::Refuse).
    pub fn from_env() -> Self {
        match std::env::var(ALLOW_DOWNGRADE_ENV) {
            Ok(v) => Self::parse(&v),
            Err(_) => Self::Refuse,
        }
    }

    fn parse(v: &str) -> Self {
        match v.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "allow" => Self::Allow,
            _ => Self::Refuse,
        }
    }

    /// Whether downgrades are taken.
    pub fn allows(self) -> bool {
        self == Self::Allow
    }
}

/// The kinds of downgrade to a slower path Baton can take, each opt-in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Downgrade {
    /// A host link (TCP) to a peer that says it runs on this node's host: every buffer
    /// crosses it as a copy by the TCP or NCCL engine, where a Unix socket link would have
    /// mapped it in place. Link over a socket in a directory both processes share (see
    /// `docs/CROSS_HOST.md`, *Containers*), or give each its own `BATON_HOST_ID` if they
    /// are two hosts.
    CopyOnSameHost,
    /// A bundle's allocation wanted VMM memory (read by importers at full bandwidth) on a
    /// device that cannot share VMM memory as a descriptor: the backend's own export
    /// (legacy IPC, about 25 % slower to read) instead.
    BundleWithoutVmm,
}

impl std::fmt::Display for Downgrade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Downgrade {
    /// Its label: `copy-on-same-host`, `bundle-without-vmm`.
    pub fn name(self) -> &'static str {
        match self {
            Downgrade::CopyOnSameHost => "copy-on-same-host",
            Downgrade::BundleWithoutVmm => "bundle-without-vmm",
        }
    }

    /// Why the wanted path is not there, for messages.
    pub fn why(self) -> &'static str {
        match self {
            Downgrade::CopyOnSameHost => {
                "the peer is linked over TCP but says it runs on this host: its buffers would be copied, not mapped"
            }
            Downgrade::BundleWithoutVmm => {
                "the device cannot share VMM memory as a file descriptor"
            }
        }
    }
}

/// A downgrade a node took, its policy allowing it: told to the node's subscribers
/// ([`Node::on_downgrade`](crate::Node::on_downgrade)), logged at warn and counted
/// ([`NodeStatus::downgrades`](baton_messages::status::NodeStatus::downgrades),
/// `baton_path_downgrades_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, actix::Message)]
#[rtype(result = "()")]
pub struct PathDowngraded {
    /// Which downgrade.
    pub kind: Downgrade,
    /// The path wanted.
    pub wanted: LeasePath,
    /// The slower path taken instead.
    pub taken: LeasePath,
    /// The peer it concerns, for a downgrade of a link.
    pub peer: Option<ProcessId>,
}

/// Leases of one path, counted on both sides.
#[derive(Debug, Default)]
struct PathCell {
    granted: AtomicU64,
    granted_bytes: AtomicU64,
    opened: AtomicU64,
    opened_bytes: AtomicU64,
}

/// A node's leases by path, as exporter (granted) and importer (opened), and the
/// downgrades it took. Counting is a pair of relaxed atomic adds: it stays on the hot path.
#[derive(Debug, Default)]
pub(crate) struct PathCounters {
    cells: [PathCell; LeasePath::ALL.len()],
    downgrades: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

impl PathCounters {
    /// A lease granted on one of our buffers, offered as `path`, of `bytes`.
    pub(crate) fn granted(&self, path: LeasePath, bytes: u64) {
        let cell = &self.cells[path.index()];
        cell.granted.fetch_add(1, Ordering::Relaxed);
        cell.granted_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A lease on another process's buffer opened here through `path`, of `bytes`.
    pub(crate) fn opened(&self, path: LeasePath, bytes: u64) {
        let cell = &self.cells[path.index()];
        cell.opened.fetch_add(1, Ordering::Relaxed);
        cell.opened_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A downgrade taken.
    pub(crate) fn downgraded(&self, event: &PathDowngraded) {
        let mut downgrades = self.downgrades.lock().unwrap_or_else(|p| p.into_inner());
        *downgrades
            .entry((event.wanted.name(), event.taken.name()))
            .or_default() += 1;
    }

    /// The paths seen so far (in the order of [`LeasePath::ALL`]) and the downgrades taken.
    pub(crate) fn snapshot(&self) -> (Vec<PathEntry>, Vec<DowngradeEntry>) {
        let paths = LeasePath::ALL
            .iter()
            .zip(&self.cells)
            .filter_map(|(path, cell)| {
                let entry = PathEntry {
                    path: path.name().to_owned(),
                    granted: cell.granted.load(Ordering::Relaxed),
                    granted_bytes: cell.granted_bytes.load(Ordering::Relaxed),
                    opened: cell.opened.load(Ordering::Relaxed),
                    opened_bytes: cell.opened_bytes.load(Ordering::Relaxed),
                };
                (entry.granted + entry.opened > 0).then_some(entry)
            })
            .collect();
        let downgrades = self
            .downgrades
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|((wanted, taken), count)| DowngradeEntry {
                wanted: (*wanted).to_owned(),
                taken: (*taken).to_owned(),
                count: *count,
            })
            .collect();
        (paths, downgrades)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_parses_and_refuses_by_default() {
        assert_eq!(DowngradePolicy::default(), DowngradePolicy::Refuse);
        for allow in ["1", "true", "YES", " allow "] {
            assert!(DowngradePolicy::parse(allow).allows(), "{allow}");
        }
        for refuse in ["", "0", "no", "maybe"] {
            assert!(!DowngradePolicy::parse(refuse).allows(), "{refuse}");
        }
    }

    #[test]
    fn counters_list_the_paths_seen_and_the_downgrades_taken() {
        let c = PathCounters::default();
        assert_eq!(c.snapshot(), (Vec::new(), Vec::new()));
        c.granted(LeasePath::TcpCopy, 10);
        c.granted(LeasePath::TcpCopy, 5);
        c.opened(LeasePath::HostMemfd, 7);
        let event = PathDowngraded {
            kind: Downgrade::CopyOnSameHost,
            wanted: LeasePath::HostMemfd,
            taken: LeasePath::TcpCopy,
            peer: None,
        };
        c.downgraded(&event);
        c.downgraded(&event);
        let (paths, downgrades) = c.snapshot();
        let row = |p: &str| paths.iter().find(|e| e.path == p).cloned().unwrap();
        assert_eq!(paths.len(), 2);
        assert_eq!(
            (row("tcp-copy").granted, row("tcp-copy").granted_bytes),
            (2, 15)
        );
        assert_eq!(
            (row("host-memfd").opened, row("host-memfd").opened_bytes),
            (1, 7)
        );
        assert_eq!(
            downgrades,
            [DowngradeEntry {
                wanted: "host-memfd".into(),
                taken: "tcp-copy".into(),
                count: 2
            }]
        );
    }
}
