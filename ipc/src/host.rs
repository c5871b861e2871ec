//! The host backend: zero-copy CPU buffers between processes, in named POSIX
//! shared-memory segments (`/dev/shm`), made and mapped with the `shared_memory` crate.
//!
//! A segment's name carries its owner's identity, `/<namespace>.<pid>.<start ticks>.<alloc>.<random>`,
//! so that:
//! - an importer checks the segment belongs to the exporter the (sealed) handle names;
//! - [`sweep`] can remove the segments of owners that died without running `Drop`
//!   (SIGKILL), and never those of a live owner, even one that reuses a dead owner's pid
//!   (the start time differs).
//!
//! The owner's [`Allocation`] unlinks the segment on drop; importers' mappings stay valid
//! until they unmap (the kernel frees the pages with the last mapping).
//!
//! # Safety
//!
//! This module holds the host backend's `unsafe` code, all of it about one mapping:
//! - a segment is mapped `MAP_SHARED` read-write for its whole size by `shared_memory`,
//!   and stays mapped until the `Shmem` that mapped it drops; the `Mapping` owns that
//!   `Shmem`, so its base pointer is valid for `size` bytes for the mapping's lifetime;
//! - every copy is bounds-checked by the caller ([`Allocation`] and [`OpenedMem`] check
//!   `offset + len <= size` before calling in) and done with raw-pointer copies, never
//!   through Rust references to the shared bytes, because other processes may write them
//!   at any time. A racing writer yields torn bytes, never invalid values: only `u8`s
//!   cross the boundary.
//! - a segment shrunk by a hostile process of the same user after we mapped it would make
//!   an access fault (`SIGBUS`); named segments cannot be sealed against that. Only
//!   processes of an allowed uid holding the session token can learn segment names.

use crate::backend::{
    Allocation, Backend, ExportableMemory, FreeWhileMapped, MemPtr, OpenedMem, RawMemory,
};
use crate::process::{self, Liveness};
use crate::session::CheckedHandle;
use crate::{Error, Result};
use baton_messages::{AllocationId, BackendKind, DeviceUuid, RawHandle, SegmentName};
use shared_memory::{Shmem, ShmemConf, ShmemError};
use std::fmt;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable that sets the default segment namespace.
pub const NAMESPACE_ENV: &str = "BATON_SHM_NAMESPACE";
/// The namespace used when none is set.
pub const DEFAULT_NAMESPACE: &str = "baton";
const SHM_DIR: &str = "/dev/shm";

/// Checks a namespace: 1 to 32 of `[A-Za-z0-9_-]` (no dots: they separate name fields).
fn valid_namespace(ns: &str) -> bool {
    (1..=32).contains(&ns.len())
        && ns
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The host shared-memory backend.
#[derive(Debug)]
pub struct HostBackend {
    namespace: String,
    opens: AtomicU64,
}

impl HostBackend {
    /// A host backend in the namespace from [`NAMESPACE_ENV`], else [`DEFAULT_NAMESPACE`].
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] if the variable holds an invalid namespace.
    pub fn new() -> Result<Self> {
        let ns = std::env::var(NAMESPACE_ENV).unwrap_or_else(|_| DEFAULT_NAMESPACE.to_owned());
        Self::with_namespace(&ns)
    }

    /// A host backend whose segments are named in `namespace` (1 to 32 of
    /// `[A-Za-z0-9_-]`). Separate namespaces keep deployments (and tests) from counting
    /// or sweeping each other's segments.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] for an invalid namespace.
    pub fn with_namespace(namespace: &str) -> Result<Self> {
        if !valid_namespace(namespace) {
            return Err(Error::BackendUnavailable {
                backend: "host",
                reason: format!(
                    "invalid segment namespace {namespace:?}: use 1-32 of [A-Za-z0-9_-]"
                ),
            });
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            opens: AtomicU64::new(0),
        })
    }

    /// The segment namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// How many segments this backend has mapped for importers (each is one `shm_open` +
    /// `mmap`; the import cache makes repeats free).
    pub fn opens(&self) -> u64 {
        self.opens.load(Ordering::Relaxed)
    }

    fn segment_name(&self, alloc: AllocationId) -> Result<SegmentName> {
        let me = process::current();
        let tag = u64::from_le_bytes(crate::session::random_bytes()?);
        let name = format!(
            "/{}.{}.{}.{}.{tag:016x}",
            self.namespace,
            me.pid,
            me.start_ticks,
            alloc.get()
        );
        Ok(SegmentName::new(name).expect("namespace and numbers make a valid segment name"))
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn device(&self) -> DeviceUuid {
        DeviceUuid::HOST
    }

    fn allocate(&self, size: usize) -> Result<Allocation> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let id = Allocation::reserve_id();
        let name = self.segment_name(id)?;
        let shmem = ShmemConf::new()
            .os_id(name.as_str())
            .size(size)
            .create()
            .map_err(|e| Error::Shm(format!("creating a {size}-byte segment: {e}")))?;
        let mapping = Mapping::new(shmem, Some(name))?;
        tracing::debug!(alloc = %id, size, "host segment created");
        Ok(Allocation::with_id(
            id,
            BackendKind::Host,
            DeviceUuid::HOST,
            Box::new(mapping),
        ))
    }

    fn open(&self, handle: CheckedHandle<'_>, _fd: Option<OwnedFd>) -> Result<OpenedMem> {
        let RawHandle::HostSegment(name) = &handle.raw else {
            return Err(Error::UnsupportedBackend {
                kind: handle.backend,
            });
        };
        let owner = SegmentOwner::parse(name.as_str().trim_start_matches('/'));
        let expected = handle.exporter.process;
        if !owner.is_some_and(|o| o.pid == expected.pid && o.start_ticks == expected.start_ticks) {
            return Err(Error::SegmentOwnerMismatch {
                exporter: handle.exporter,
            });
        }
        let shmem = ShmemConf::new()
            .os_id(name.as_str())
            .open()
            .map_err(|e| match e {
                ShmemError::MapOpenFailed(code)
                    if code == rustix::io::Errno::NOENT.raw_os_error() as u32 =>
                {
                    Error::SegmentNotFound {
                        exporter: handle.exporter,
                        alloc: handle.alloc,
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
        self.opens.fetch_add(1, Ordering::Relaxed);
        let mapping = Mapping::new(shmem, None)?;
        Ok(OpenedMem::new(&handle, Box::new(mapping)))
    }
}

/// One mapped segment: the owner's (which unlinks on drop) or an importer's.
struct Mapping {
    /// Keeps the mapping (and, for the owner, the name) alive; unmaps and unlinks on drop.
    #[expect(
        dead_code,
        reason = "held for its Drop: munmap, and shm_unlink for the owner"
    )]
    shmem: Shmem,
    base: NonNull<u8>,
    size: usize,
    /// The segment's name, for the owner (importers never need it again).
    name: Option<SegmentName>,
}

// SAFETY: `Shmem` is `!Send` only because it holds a raw pointer. The mapping it owns is
// process-wide (any thread may access or unmap it), and every access goes through
// bounds-checked raw copies, so moving the owner to another thread is sound.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` only allows raw copies into and out of the shared bytes, which are
// plain `u8`s that other processes write concurrently anyway; no Rust reference to them
// is ever formed, so concurrent use from several threads adds no hazard.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(shmem: Shmem, name: Option<SegmentName>) -> Result<Self> {
        let base = NonNull::new(shmem.as_ptr())
            .ok_or_else(|| Error::Shm("segment mapped at null".into()))?;
        let size = shmem.len();
        Ok(Self {
            shmem,
            base,
            size,
            name,
        })
    }
}

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMapping")
            .field("size", &self.size)
            .field("owner", &self.name.is_some())
            .finish()
    }
}

impl RawMemory for Mapping {
    fn size(&self) -> usize {
        self.size
    }

    fn ptr(&self) -> MemPtr {
        MemPtr::Host(self.base.as_ptr())
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        debug_assert!(offset + dst.len() <= self.size);
        // SAFETY: the caller checked `offset + dst.len() <= size`; the mapping is valid for
        // `size` bytes while `self.shmem` lives (module overview); `dst` is a distinct
        // local buffer, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.as_ptr().wrapping_add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        debug_assert!(offset + src.len() <= self.size);
        // SAFETY: as in `read`, with the roles of the two ranges swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.base.as_ptr().wrapping_add(offset),
                src.len(),
            );
        }
        Ok(())
    }

    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        debug_assert!(offset + len <= self.size);
        // SAFETY: the caller checked `offset + len <= size`; the mapping is writable and
        // valid for `size` bytes while `self.shmem` lives.
        unsafe {
            std::ptr::write_bytes(self.base.as_ptr().wrapping_add(offset), byte, len);
        }
        Ok(())
    }
}

impl ExportableMemory for Mapping {
    /// Unlinking and unmapping the owner's segment leaves importers' mappings (and the
    /// pages under them) in place.
    fn free_while_mapped(&self) -> FreeWhileMapped {
        FreeWhileMapped::Survives
    }

    fn raw_handle(&self, _fd_slot: Option<u8>) -> Result<RawHandle> {
        self.name
            .clone()
            .map(RawHandle::HostSegment)
            .ok_or_else(|| Error::Shm("an imported mapping cannot be exported again".into()))
    }
}

/// The owner a segment name records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegmentOwner {
    pid: u32,
    start_ticks: u64,
}

impl SegmentOwner {
    /// Parses `<namespace>.<pid>.<start>.<alloc>.<tag>` (no leading slash).
    pub(crate) fn parse(name: &str) -> Option<Self> {
        let mut parts = name.split('.');
        let ns = parts.next()?;
        let pid = parts.next()?.parse().ok()?;
        let start_ticks = parts.next()?.parse().ok()?;
        let _alloc: u64 = parts.next()?.parse().ok()?;
        let tag = parts.next()?;
        let ok = valid_namespace(ns) && tag.len() == 16 && parts.next().is_none();
        ok.then_some(Self { pid, start_ticks })
    }
}

/// A Baton segment present in `/dev/shm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// The segment's name (without the leading `/`).
    pub name: String,
    /// Its owner's pid.
    pub owner_pid: u32,
    /// Whether the owner still runs.
    pub owner: Liveness,
    /// Size in bytes.
    pub size: u64,
}

/// The Baton segments of `namespace` present now.
///
/// # Errors
/// [`Error::Io`] if `/dev/shm` cannot be read.
pub fn list_segments(namespace: &str) -> Result<Vec<SegmentInfo>> {
    list_segments_in(Path::new(SHM_DIR), namespace)
}

fn list_segments_in(dir: &Path, namespace: &str) -> Result<Vec<SegmentInfo>> {
    let prefix = format!("{namespace}.");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(Error::io("reading /dev/shm"))? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(&prefix) {
            continue;
        }
        let Some(owner) = SegmentOwner::parse(name) else {
            continue;
        };
        out.push(SegmentInfo {
            name: name.to_owned(),
            owner_pid: owner.pid,
            owner: process::liveness_of(owner.pid, owner.start_ticks),
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
/// was once a dead owner's: the start time tells them apart. Importers that still map a
/// removed segment keep their mapping; only the name goes.
///
/// # Errors
/// [`Error::Io`] if `/dev/shm` cannot be read. Segments that vanish meanwhile are fine.
pub fn sweep(namespace: &str) -> Result<SweepReport> {
    let mut report = SweepReport::default();
    for seg in list_segments(namespace)? {
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
    use crate::session::Session;
    use baton_messages::SessionToken;

    fn ns(tag: &str) -> String {
        format!("unit-{tag}-{}", std::process::id())
    }

    #[test]
    fn segment_names_round_trip_their_owner() {
        let b = HostBackend::with_namespace("ns_1-x").unwrap();
        let name = b.segment_name(AllocationId::new(9)).unwrap();
        let me = process::current();
        assert_eq!(
            SegmentOwner::parse(name.as_str().trim_start_matches('/')),
            Some(SegmentOwner {
                pid: me.pid,
                start_ticks: me.start_ticks
            })
        );
        assert_eq!(SegmentOwner::parse("ns.1.2.3"), None);
        assert_eq!(SegmentOwner::parse("ns.x.2.3.0123456789abcdef"), None);
        assert!(HostBackend::with_namespace("has.dot").is_err());
        assert!(HostBackend::with_namespace("").is_err());
    }

    #[test]
    fn allocate_write_open_read_and_unlink_on_drop() {
        let ns = ns("rw");
        let b = HostBackend::with_namespace(&ns).unwrap();
        let session = Session::new(SessionToken::from_bytes([9; 32]));
        let a = b.allocate(8192).unwrap();
        a.write(100, b"hello").unwrap();
        assert!(matches!(
            a.write(8190, b"xyz"),
            Err(Error::OutOfBounds { .. })
        ));
        let h = a.handle(&session).range(100, 5).build().unwrap();
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
    fn zero_size_is_refused() {
        let b = HostBackend::with_namespace(&ns("zero")).unwrap();
        assert!(matches!(b.allocate(0), Err(Error::ZeroSize)));
    }

    #[test]
    fn sweep_keeps_live_owners() {
        let ns = ns("sweep");
        let b = HostBackend::with_namespace(&ns).unwrap();
        let a = b.allocate(4096).unwrap();
        let report = sweep(&ns).unwrap();
        assert_eq!(report.removed.len(), 0);
        assert_eq!(report.kept, 1);
        drop(a);
    }

    #[test]
    fn listing_ignores_foreign_names() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ns.1.987654321.3.0123456789abcdef"), b"").unwrap();
        std::fs::write(dir.path().join("ns.notours"), b"").unwrap();
        std::fs::write(dir.path().join("other.1.2.3.0123456789abcdef"), b"").unwrap();
        let segs = list_segments_in(dir.path(), "ns").unwrap();
        assert_eq!(segs.len(), 1);
        assert_eq!(segs[0].owner_pid, 1);
        assert_eq!(
            segs[0].owner,
            Liveness::Dead,
            "pid 1 did not start at tick 987654321"
        );
    }
}
