//! The host backend's portable flavor: named POSIX shared-memory segments (`/dev/shm`),
//! made and mapped with the `shared_memory` crate.
//!
//! A segment's name carries its owner's identity, `/<namespace>.<pid>.<start ticks>.<alloc>.<random>`,
//! so that:
//! - an importer checks the segment belongs to the exporter the (sealed) handle names;
//! - [`sweep`] and [`sweep_process`] can remove the segments of owners that died without
//!   running `Drop` (SIGKILL), and never those of a live owner, even one that reuses a dead
//!   owner's pid (the start time differs).
//!
//! The owner's [`Allocation`] unlinks the segment on drop; importers' mappings stay valid
//! until they unmap (the kernel frees the pages with the last mapping). What this flavor
//! cannot do, and the `memfd` flavor can: names are listable by every process of the user,
//! a same-user process can shrink a segment under an importer (`SIGBUS` on access), and a
//! name outlives an owner killed before its `Drop` until someone sweeps it.
//!
//! # Safety
//!
//! The only `unsafe` here is `Send`/`Sync` for [`NamedBacking`], which holds a `Shmem`
//! (not `Send` only because it holds a raw pointer). The mapping itself is accessed through
//! [`Mapping`](super::Mapping), whose module states the rules.

use super::{Backing, Mapping};
use crate::backend::{Allocation, OpenedMem};
use crate::process::{self, Liveness};
use crate::session::CheckedHandle;
use crate::{Error, Result};
use baton_messages::{AllocationId, BackendKind, DeviceUuid, ProcessId, RawHandle, SegmentName};
use shared_memory::{Shmem, ShmemConf, ShmemError};
use std::path::Path;
use std::ptr::NonNull;

/// The environment variable that sets the default segment namespace.
pub const NAMESPACE_ENV: &str = "BATON_SHM_NAMESPACE";
/// The namespace used when none is set.
pub const DEFAULT_NAMESPACE: &str = "baton";
const SHM_DIR: &str = "/dev/shm";

/// Checks a namespace: 1 to 32 of `[A-Za-z0-9_-]` (no dots: they separate name fields).
pub(crate) fn valid_namespace(ns: &str) -> bool {
    (1..=32).contains(&ns.len())
        && ns
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The name of a new segment of `alloc`, owned by this process:
/// `/<namespace>.<pid>.<start ticks>.<alloc>.<tag>`, whose 16-hex-digit tag is this
/// process's PID namespace ([`process::pid_namespace`]) in its high 32 bits, random bits
/// in its low 32.
pub(super) fn segment_name(namespace: &str, alloc: AllocationId) -> Result<SegmentName> {
    let me = process::current();
    let random = u64::from(u32::from_le_bytes(crate::session::random_bytes()?));
    let tag = (u64::from(process::pid_namespace()) << 32) | random;
    let name = format!(
        "/{namespace}.{}.{}.{}.{tag:016x}",
        me.pid,
        me.start_ticks,
        alloc.get()
    );
    Ok(SegmentName::new(name).expect("namespace and numbers make a valid segment name"))
}

/// Keeps a named segment mapped (and, for the owner, its name alive).
pub(super) struct NamedBacking {
    /// Unmaps on drop, and unlinks the name for the owner.
    shmem: Shmem,
    /// The segment's name, for the owner (importers never need it again).
    name: Option<SegmentName>,
}

// SAFETY: `Shmem` is `!Send` only because it holds a raw pointer. The mapping it owns is
// process-wide (any thread may access or unmap it), and all access goes through
// `Mapping`'s bounds-checked raw copies, so moving the owner to another thread is sound.
unsafe impl Send for NamedBacking {}
// SAFETY: `&NamedBacking` gives out only the base address and the name; the bytes are
// copied by `Mapping` without forming Rust references to them, so sharing it between
// threads adds no hazard.
unsafe impl Sync for NamedBacking {}

impl Backing for NamedBacking {
    fn base(&self) -> Result<NonNull<u8>> {
        NonNull::new(self.shmem.as_ptr()).ok_or_else(|| Error::Shm("segment mapped at null".into()))
    }

    fn size(&self) -> usize {
        self.shmem.len()
    }

    fn is_owner(&self) -> bool {
        self.name.is_some()
    }

    fn raw_handle(&self, _fd_slot: Option<u8>) -> Result<RawHandle> {
        self.name
            .clone()
            .map(RawHandle::HostSegment)
            .ok_or_else(|| Error::Shm("an imported mapping cannot be exported again".into()))
    }
}

/// Creates and maps a segment of `size` bytes in `namespace`.
pub(super) fn allocate(namespace: &str, size: usize) -> Result<Allocation> {
    let id = Allocation::reserve_id();
    let name = segment_name(namespace, id)?;
    let shmem = ShmemConf::new()
        .os_id(name.as_str())
        .size(size)
        .create()
        .map_err(|e| Error::Shm(format!("creating a {size}-byte segment: {e}")))?;
    let mapping = Mapping::new(NamedBacking {
        shmem,
        name: Some(name),
    })?;
    tracing::debug!(alloc = %id, size, "host segment created");
    Ok(Allocation::with_id(
        id,
        BackendKind::Host,
        DeviceUuid::HOST,
        Box::new(mapping),
    ))
}

/// Maps the segment a checked handle names, after checking that the name belongs to the
/// exporter the handle names and that the segment is as large as the handle claims.
pub(super) fn open(handle: &CheckedHandle<'_>, name: &SegmentName) -> Result<OpenedMem> {
    let owner = SegmentOwner::parse(name.as_str().trim_start_matches('/'));
    let expected = handle.exporter.process;
    let Some(owner) =
        owner.filter(|o| o.pid == expected.pid && o.start_ticks == expected.start_ticks)
    else {
        return Err(Error::SegmentOwnerMismatch {
            exporter: handle.exporter,
        });
    };
    let shmem = ShmemConf::new()
        .os_id(name.as_str())
        .open()
        .map_err(|e| match e {
            ShmemError::MapOpenFailed(code)
                if code == rustix::io::Errno::NOENT.raw_os_error() as u32 =>
            {
                if owner.pid_namespace == process::pid_namespace() {
                    Error::SegmentNotFound {
                        exporter: handle.exporter,
                        alloc: handle.alloc,
                    }
                } else {
                    Error::SegmentAcrossPidNamespaces {
                        exporter: handle.exporter,
                        alloc: handle.alloc,
                    }
                }
            }
            other => Error::Shm(format!("opening a segment: {other}")),
        })?;
    if (shmem.len() as u64) < handle.alloc_size {
        return Err(Error::MemoryTooSmall {
            claimed: handle.alloc_size,
            actual: shmem.len() as u64,
        });
    }
    let mapping = Box::new(Mapping::new(NamedBacking { shmem, name: None })?);
    Ok(OpenedMem::new(handle, mapping))
}

/// The owner a segment name records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegmentOwner {
    pid: u32,
    start_ticks: u64,
    /// The owner's PID namespace (the tag's high 32 bits): its pid means something only
    /// there.
    pid_namespace: u32,
}

impl SegmentOwner {
    /// Parses `<namespace>.<pid>.<start>.<alloc>.<tag>` (no leading slash).
    pub(crate) fn parse(name: &str) -> Option<Self> {
        Self::parse_with_namespace(name).map(|(_, owner)| owner)
    }

    fn parse_with_namespace(name: &str) -> Option<(&str, Self)> {
        let mut parts = name.split('.');
        let ns = parts.next()?;
        let pid = parts.next()?.parse().ok()?;
        let start_ticks = parts.next()?.parse().ok()?;
        let _alloc: u64 = parts.next()?.parse().ok()?;
        let tag = parts.next()?;
        let ok = valid_namespace(ns) && tag.len() == 16 && parts.next().is_none();
        let tag = u64::from_str_radix(tag, 16).ok().filter(|_| ok)?;
        let pid_namespace = (tag >> 32) as u32;
        Some((
            ns,
            Self {
                pid,
                start_ticks,
                pid_namespace,
            },
        ))
    }

    /// Whether the owner still runs. Within our PID namespace, `/proc` says. The pid of an
    /// owner of another PID namespace names another process here (pid 1 is our init), so
    /// `/proc` cannot say: its pidfd does if it is a link peer of ours
    /// ([`process::is_observed`]), and otherwise it is [`Liveness::Unknown`] — never
    /// swept from here (a sweeper in its own namespace can).
    fn liveness(self) -> Liveness {
        if self.pid_namespace == process::pid_namespace() {
            return process::liveness_of(self.pid, self.start_ticks);
        }
        let id = ProcessId {
            boot: process::boot_id(),
            pid: self.pid,
            start_ticks: self.start_ticks,
        };
        if process::is_observed(&id) {
            process::liveness(&id)
        } else {
            Liveness::Unknown
        }
    }
}

/// A Baton segment present in `/dev/shm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// The segment's name (without the leading `/`).
    pub name: String,
    /// Its owner's pid.
    pub owner_pid: u32,
    /// Whether the owner still runs ([`Liveness::Unknown`] for an owner of another PID
    /// namespace that is not a link peer of this process: kept by [`sweep`]).
    pub owner: Liveness,
    /// Size in bytes.
    pub size: u64,
}

/// The Baton segments of `namespace` present now.
///
/// # Errors
/// [`Error::Io`] if `/dev/shm` cannot be read.
pub fn list_segments(namespace: &str) -> Result<Vec<SegmentInfo>> {
    list_segments_in(Path::new(SHM_DIR), |ns, _| ns == namespace)
}

fn list_segments_in(
    dir: &Path,
    mut wanted: impl FnMut(&str, SegmentOwner) -> bool,
) -> Result<Vec<SegmentInfo>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(Error::io("reading /dev/shm"))? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some((ns, owner)) = SegmentOwner::parse_with_namespace(name) else {
            continue;
        };
        if !wanted(ns, owner) {
            continue;
        }
        out.push(SegmentInfo {
            name: name.to_owned(),
            owner_pid: owner.pid,
            owner: owner.liveness(),
            size: entry.metadata().map(|m| m.len()).unwrap_or(0),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// What a [`sweep`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Segments of dead owners that were removed.
    pub removed: Vec<String>,
    /// Bytes those segments held.
    pub removed_bytes: u64,
    /// Segments left because their owner lives (or liveness is unknown).
    pub kept: usize,
}

/// Removes the segments of `namespace` whose owner is dead (it was killed before its
/// `Drop` could unlink them). A live owner's segments are never touched, even if its pid
/// was once a dead owner's: the start time tells them apart. Nor are those of an owner in
/// another PID namespace (a container sharing this `/dev/shm`), whose pid names another
/// process here: unless it is a link peer of this process, watched through its pidfd, its
/// liveness is unknown and its segments stay. Importers that still map a removed segment
/// keep their mapping; only the name goes.
///
/// Only the named flavor leaves anything to sweep: `memfd` memory has no name and is freed
/// by the kernel with its last holder.
///
/// # Errors
/// [`Error::Io`] if `/dev/shm` cannot be read. Segments that vanish meanwhile are fine.
pub fn sweep(namespace: &str) -> Result<SweepReport> {
    remove_dead(list_segments(namespace)?)
}

/// Removes the segments of one process, in every namespace, if that process is dead: what
/// a supervisor does for a child that died before its `Drop` could unlink them (the
/// `baton_actors::supervisor::ProcessSupervisor`
/// does it before restarting the child). A live process's segments are never touched, nor
/// those of another process that reuses its pid (the start time differs).
///
/// # Errors
/// [`Error::Io`] if `/dev/shm` cannot be read. Segments that vanish meanwhile are fine.
pub fn sweep_process(process: &ProcessId) -> Result<SweepReport> {
    if process.boot != process::boot_id() {
        // Its segments, if any, went with that boot's tmpfs.
        return Ok(SweepReport::default());
    }
    let segments = list_segments_in(Path::new(SHM_DIR), |_, owner| {
        owner.pid == process.pid && owner.start_ticks == process.start_ticks
    })?;
    remove_dead(segments)
}

fn remove_dead(segments: Vec<SegmentInfo>) -> Result<SweepReport> {
    let mut report = SweepReport::default();
    for seg in segments {
        if seg.owner != Liveness::Dead {
            report.kept += 1;
            continue;
        }
        match rustix::shm::unlink(format!("/{}", seg.name).as_str()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => {
                tracing::info!(
                    segment_owner = seg.owner_pid,
                    bytes = seg.size,
                    "swept segment of a dead owner"
                );
                report.removed_bytes += seg.size;
                report.removed.push(seg.name);
            }
            Err(e) => {
                tracing::warn!(segment_owner = seg.owner_pid, error = %e, "could not sweep segment");
                report.kept += 1;
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::host::{HostBackend, HostFlavor};
    use crate::session::Session;
    use baton_messages::SessionToken;

    fn ns(tag: &str) -> String {
        format!("unit-{tag}-{}", std::process::id())
    }

    /// A segment tag of this PID namespace (as `segment_name` makes them).
    fn tag() -> String {
        format!("{:08x}89abcdef", process::pid_namespace())
    }

    #[test]
    fn segment_names_round_trip_their_owner() {
        let name = segment_name("ns_1-x", AllocationId::new(9)).unwrap();
        let me = process::current();
        assert_eq!(
            SegmentOwner::parse(name.as_str().trim_start_matches('/')),
            Some(SegmentOwner {
                pid: me.pid,
                start_ticks: me.start_ticks,
                pid_namespace: process::pid_namespace(),
            })
        );
        assert_ne!(process::pid_namespace(), 0, "/proc/self/ns/pid is readable");
        assert_eq!(SegmentOwner::parse("ns.1.2.3"), None);
        assert_eq!(SegmentOwner::parse("ns.x.2.3.0123456789abcdef"), None);
        assert!(HostBackend::with_namespace("has.dot").is_err());
        assert!(HostBackend::with_namespace("").is_err());
    }

    /// A segment whose owner is dead by `/proc` is swept when the owner was of our PID
    /// namespace, and kept when it was of another (its pid names another process here, and
    /// it is no link peer of ours).
    #[test]
    fn sweep_judges_only_owners_of_its_own_pid_namespace() {
        let ns = ns("pidns");
        // Our init, with a start time that is not its own: dead by `/proc`, as pid 1 of a
        // container is seen from the host.
        let start = process::start_ticks(1).unwrap_or(0) + 12_345;
        let ours = u64::from(process::pid_namespace()) << 32;
        let theirs = u64::from(process::pid_namespace() ^ 0x5a5a) << 32;
        let name = |tag: u64| format!("{ns}.1.{start}.7.{tag:016x}");
        let (mine, foreign) = (name(ours | 1), name(theirs | 1));
        for n in [&mine, &foreign] {
            std::fs::write(Path::new(SHM_DIR).join(n), b"x").unwrap();
        }
        let listed = list_segments(&ns).unwrap();
        let owner_of = |n: &str| listed.iter().find(|s| s.name == n).map(|s| s.owner);
        assert_eq!(owner_of(&mine), Some(Liveness::Dead));
        assert_eq!(owner_of(&foreign), Some(Liveness::Unknown));
        let report = sweep(&ns).unwrap();
        assert_eq!((report.removed, report.kept), (vec![mine], 1));
        std::fs::remove_file(Path::new(SHM_DIR).join(&foreign)).unwrap();
        assert!(list_segments(&ns).unwrap().is_empty());
    }

    #[test]
    fn allocate_write_open_read_and_unlink_on_drop() {
        let ns = ns("rw");
        let b = HostBackend::with_namespace(&ns).unwrap();
        assert_eq!(b.flavor(), HostFlavor::Named);
        let session = Session::new(SessionToken::from_bytes([9; 32]));
        let a = b.allocate(8192).unwrap();
        a.write(100, b"hello").unwrap();
        assert!(matches!(
            a.write(8190, b"xyz"),
            Err(Error::OutOfBounds { .. })
        ));
        let h = a.handle(&session).range(100, 5).build().unwrap();
        assert!(matches!(h.raw, RawHandle::HostSegment(_)));
        let opened = b.open(session.check(&h).unwrap(), None).unwrap();
        let mut got = [0; 5];
        opened.read(100, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        opened.write(0, b"reply").unwrap();
        let mut back = [0; 5];
        a.read(0, &mut back).unwrap();
        assert_eq!(&back, b"reply");
        assert_eq!(list_segments(&ns).unwrap().len(), 1);
        drop(a);
        assert_eq!(list_segments(&ns).unwrap().len(), 0);
        // The importer's mapping outlives the name.
        opened.read(0, &mut back).unwrap();
        assert_eq!(&back, b"reply");
        assert_eq!(b.opens(), 1);
    }

    #[test]
    fn sweep_keeps_live_owners() {
        let ns = ns("sweep");
        let b = HostBackend::with_namespace(&ns).unwrap();
        let a = b.allocate(4096).unwrap();
        let report = sweep(&ns).unwrap();
        assert_eq!(report.removed.len(), 0);
        assert_eq!(report.kept, 1);
        let mine = sweep_process(&process::current()).unwrap();
        assert_eq!(mine.removed.len(), 0, "a live process's segments stay");
        assert!(mine.kept >= 1);
        drop(a);
    }

    /// A dead child's segments go, in every namespace; a segment of another process that
    /// had the same pid (another start time) stays.
    #[test]
    fn sweep_process_removes_exactly_one_dead_processes_segments() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let start = process::start_ticks(pid).unwrap();
        let make = |name: &str| {
            let fd = rustix::shm::open(
                name,
                rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR,
                rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
            )
            .unwrap();
            rustix::fs::ftruncate(&fd, 4096).unwrap();
        };
        let me = std::process::id();
        let tag = tag();
        let theirs = [
            format!("/unit-spa-{me}.{pid}.{start}.1.{tag}"),
            format!("/unit-spb-{me}.{pid}.{start}.2.{tag}"),
        ];
        let other = format!("/unit-spa-{me}.{pid}.{}.3.{tag}", start + 1);
        for name in theirs.iter().chain([&other]) {
            make(name);
        }
        let child_id = ProcessId {
            boot: process::boot_id(),
            pid,
            start_ticks: start,
        };
        let alive = sweep_process(&child_id).unwrap();
        assert_eq!((alive.removed.len(), alive.kept), (0, 2), "it still runs");
        child.kill().unwrap();
        child.wait().unwrap();
        let report = sweep_process(&child_id).unwrap();
        let mut removed = report.removed.clone();
        removed.sort();
        let want: Vec<String> = theirs.iter().map(|n| n[1..].to_owned()).collect();
        assert_eq!(removed, want);
        assert_eq!(report.removed_bytes, 2 * 4096);
        assert_eq!(list_segments(&format!("unit-spa-{me}")).unwrap().len(), 1);
        rustix::shm::unlink(other.as_str()).unwrap();
    }

    #[test]
    fn listing_ignores_foreign_names() {
        let dir = tempfile::tempdir().unwrap();
        let tag = tag();
        std::fs::write(dir.path().join(format!("ns.1.987654321.3.{tag}")), b"").unwrap();
        std::fs::write(dir.path().join("ns.notours"), b"").unwrap();
        std::fs::write(dir.path().join(format!("other.1.2.3.{tag}")), b"").unwrap();
        let segs = list_segments_in(dir.path(), |ns, _| ns == "ns").unwrap();
        assert_eq!(segs.len(), 1);
        assert_eq!(segs[0].owner_pid, 1);
        assert_eq!(
            segs[0].owner,
            Liveness::Dead,
            "pid 1 did not start at tick 987654321"
        );
        // By owner, across namespaces.
        let by_owner =
            list_segments_in(dir.path(), |_, o| o.pid == 1 && o.start_ticks == 2).unwrap();
        assert_eq!(by_owner.len(), 1);
        assert_eq!(by_owner[0].name, format!("other.1.2.3.{tag}"));
    }
}
