//! The host backend's Linux flavor: sealed `memfd`s shared by descriptor.
//!
//! An allocation is an anonymous memory file (`memfd_create` with `MFD_CLOEXEC |
//! MFD_ALLOW_SEALING`), sized with `ftruncate`, then sealed with `F_SEAL_SHRINK |
//! F_SEAL_GROW | F_SEAL_SEAL` so that nobody — not even its creator — can change its size
//! again, and mapped `MAP_SHARED`. Its raw handle is only a slot index
//! ([`RawHandle::HostMemfd`]); the descriptor travels beside the frame (`SCM_RIGHTS`).
//!
//! An importer checks, before it maps anything, that the descriptor carries those seals
//! (`fcntl(F_GET_SEALS)`) and is at least as large as the handle claims (`fstat`): a
//! descriptor that could shrink under its mapping (and so fault with `SIGBUS` on access)
//! is refused with [`Error::UnsealedMemory`], a short one with [`Error::MemoryTooSmall`].
//! It closes the descriptor once mapped; the mapping keeps the pages alive.
//!
//! There is no name: nothing in `/dev/shm` to list, guess, shrink or leave behind. The
//! kernel frees the pages when the last descriptor and the last mapping go, in whichever
//! process, also when every process of a tree is SIGKILLed at once.
//!
//! # Safety
//!
//! The `unsafe` code here maps and unmaps one region per [`MemfdBacking`]:
//! - `mmap` is called with a null address hint, so the kernel picks a fresh range that
//!   overlaps no existing Rust object, for `len` bytes of a descriptor whose size is at
//!   least `len` and is sealed against shrinking: every page of the range stays backed for
//!   the mapping's whole life (no `SIGBUS`), whatever any process does to the file;
//! - the region is unmapped exactly once, by the `Drop` of the [`MemfdMap`] that mapped it,
//!   and no pointer into it outlives that value (the [`Mapping`](super::Mapping) that
//!   hands out its base owns it).

use super::{Backing, Mapping};
use crate::backend::{Allocation, OpenedMem};
use crate::session::CheckedHandle;
use crate::{Error, Result};
use baton_messages::{AllocationId, BackendKind, DeviceUuid, RawHandle};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

/// The seals every Baton memfd carries; an importer refuses a descriptor without all of them.
const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// The prefix of every Baton memfd's name, as `/proc/<pid>/maps` and `/proc/<pid>/fd` show
/// it: `/memfd:baton.<namespace>.<alloc> (deleted)`. A label for accounting, not an identity:
/// nothing opens a memfd by name.
const NAME_PREFIX: &str = "baton.";

fn memfd_name(namespace: &str, alloc: AllocationId) -> String {
    format!("{NAME_PREFIX}{namespace}.{}", alloc.get())
}

/// One `MAP_SHARED` read-write mapping of a memfd; unmapped on drop.
struct MemfdMap {
    base: NonNull<u8>,
    len: usize,
}

impl MemfdMap {
    /// Maps the first `len` bytes of `fd`, which the caller checked is sealed against
    /// shrinking and holds at least `len` bytes.
    fn new(fd: BorrowedFd<'_>, len: usize) -> Result<Self> {
        // SAFETY: null hint, so a fresh range the kernel picks (module overview); `fd` is at
        // least `len` bytes and sealed against shrinking (checked by both callers), so every
        // page stays backed; the range is unmapped only by this value's `Drop`.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| Error::Io {
            op: "mmap(memfd)",
            source: e.into(),
        })?;
        let base = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::Shm("memfd mapped at null".into()))?;
        Ok(Self { base, len })
    }
}

impl Drop for MemfdMap {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is the range `new` mapped, unmapped only here, once; no
        // pointer into it outlives this value (module overview).
        let result = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
        if let Err(e) = result {
            tracing::warn!(error = %e, bytes = self.len, "munmap of a memfd mapping failed");
        }
    }
}

/// Keeps a memfd mapped and, for the owner, the descriptor it exports.
pub(super) struct MemfdBacking {
    map: MemfdMap,
    /// The owner's descriptor, sent to importers; importers close theirs once mapped.
    fd: Option<OwnedFd>,
}

// SAFETY: the only field that is not `Send` is the mapping's base pointer. The mapping is
// process-wide (any thread may access or unmap it), and all access goes through
// `Mapping`'s bounds-checked raw copies, so moving the backing to another thread is sound.
unsafe impl Send for MemfdBacking {}
// SAFETY: `&MemfdBacking` gives out only the base address, the size and a borrowed
// descriptor; the bytes are copied by `Mapping` without forming Rust references to them, so
// sharing it between threads adds no hazard.
unsafe impl Sync for MemfdBacking {}

impl Backing for MemfdBacking {
    fn base(&self) -> Result<NonNull<u8>> {
        Ok(self.map.base)
    }

    fn size(&self) -> usize {
        self.map.len
    }

    fn is_owner(&self) -> bool {
        self.fd.is_some()
    }

    fn raw_handle(&self, fd_slot: Option<u8>) -> Result<RawHandle> {
        if self.fd.is_none() {
            return Err(Error::Shm(
                "an imported mapping cannot be exported again".into(),
            ));
        }
        Ok(RawHandle::HostMemfd { slot: fd_slot })
    }

    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(AsFd::as_fd)
    }
}

fn io(op: &'static str) -> impl FnOnce(rustix::io::Errno) -> Error {
    move |e| Error::Io {
        op,
        source: e.into(),
    }
}

/// Creates, sizes, seals and maps a memfd of `size` bytes (zeroed: fresh memfd pages are).
pub(super) fn allocate(namespace: &str, size: usize) -> Result<Allocation> {
    let id = Allocation::reserve_id();
    let fd = rustix::fs::memfd_create(
        memfd_name(namespace, id).as_str(),
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(io("memfd_create"))?;
    rustix::fs::ftruncate(&fd, size as u64).map_err(io("ftruncate(memfd)"))?;
    rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(io("fcntl(F_ADD_SEALS)"))?;
    let map = MemfdMap::new(fd.as_fd(), size)?;
    let mapping = Mapping::new(MemfdBacking { map, fd: Some(fd) })?;
    tracing::debug!(alloc = %id, size, "host memfd created");
    Ok(Allocation::with_id(
        id,
        BackendKind::Host,
        DeviceUuid::HOST,
        Box::new(mapping),
    ))
}

/// Maps the memfd that came with a checked handle, after checking its seals and size.
/// Without a descriptor (`slot: None`: the exporter expects us to map it already, and this
/// is a miss) the handle is refused as [`Error::NotMapped`].
pub(super) fn open(handle: &CheckedHandle<'_>, fd: Option<OwnedFd>) -> Result<OpenedMem> {
    let fd = fd.ok_or(Error::NotMapped {
        exporter: handle.exporter,
        alloc: handle.alloc,
    })?;
    let seals = match rustix::fs::fcntl_get_seals(&fd) {
        Ok(seals) => seals,
        // Not a file that can be sealed (a pipe, a regular file, a tmpfs file made
        // without sealing): it could change size under us.
        Err(rustix::io::Errno::INVAL) => SealFlags::empty(),
        Err(e) => return Err(io("fcntl(F_GET_SEALS)")(e)),
    };
    let stat = rustix::fs::fstat(&fd).map_err(io("fstat(memfd)"))?;
    let is_file =
        rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::RegularFile;
    if !seals.contains(SEALS) || !is_file {
        return Err(Error::UnsealedMemory {
            exporter: handle.exporter,
        });
    }
    let actual = u64::try_from(stat.st_size).unwrap_or(0);
    if actual < handle.alloc_size {
        return Err(Error::MemoryTooSmall {
            claimed: handle.alloc_size,
            actual,
        });
    }
    let len = usize::try_from(actual).map_err(|_| Error::MemoryTooSmall {
        claimed: handle.alloc_size,
        actual: 0,
    })?;
    let map = MemfdMap::new(fd.as_fd(), len)?;
    // The mapping keeps the pages; the descriptor is not needed any more.
    drop(fd);
    let mapping = Box::new(Mapping::new(MemfdBacking { map, fd: None })?);
    Ok(OpenedMem::new(handle, mapping))
}

/// What one process holds of a namespace's memfds, from `/proc/<pid>/maps` and
/// `/proc/<pid>/fd`: while a process holds any, the kernel keeps that memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemfdUsage {
    /// Mappings of the namespace's memfds.
    pub mappings: usize,
    /// Bytes those mappings span.
    pub mapped_bytes: u64,
    /// Open descriptors of the namespace's memfds.
    pub fds: usize,
}

impl MemfdUsage {
    /// Whether the process holds nothing of the namespace.
    pub fn is_empty(&self) -> bool {
        self.mappings == 0 && self.fds == 0
    }
}

/// What process `pid` holds of the memfds Baton made in `namespace` (their names, not
/// their identities: a label for accounting and tests).
///
/// # Errors
/// [`Error::Io`] if `/proc/<pid>/maps` or `/proc/<pid>/fd` cannot be read (the process is
/// gone, or belongs to another user).
pub fn memfd_usage(pid: u32, namespace: &str) -> Result<MemfdUsage> {
    let label = format!("/memfd:{NAME_PREFIX}{namespace}.");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(Error::io("reading /proc/<pid>/maps"))?;
    let mut usage = parse_maps(&maps, &label);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map_err(Error::io("reading /proc/<pid>/fd"))?;
    for entry in fds.flatten() {
        // A descriptor closed meanwhile has no link to read: skip it.
        if let Ok(target) = std::fs::read_link(entry.path()) {
            if memfd_label_matches(&target.to_string_lossy(), &label) {
                usage.fds += 1;
            }
        }
    }
    Ok(usage)
}

/// Whether `/memfd:<name> (deleted)` is one of the label's memfds (`label` ends with `.`,
/// and the allocation number follows it).
fn memfd_label_matches(path: &str, label: &str) -> bool {
    path.strip_prefix(label)
        .map(|rest| rest.trim_end_matches(" (deleted)"))
        .is_some_and(|alloc| !alloc.is_empty() && alloc.bytes().all(|b| b.is_ascii_digit()))
}

fn parse_maps(maps: &str, label: &str) -> MemfdUsage {
    let mut usage = MemfdUsage::default();
    for (_, bytes) in label_mappings(maps, label) {
        usage.mappings += 1;
        usage.mapped_bytes += bytes;
    }
    usage
}

/// The label's mappings in a `/proc/<pid>/maps` text: (inode, bytes spanned) per line.
fn label_mappings<'a>(maps: &'a str, label: &'a str) -> impl Iterator<Item = (u64, u64)> + 'a {
    maps.lines().filter_map(move |line| {
        // `start-end perms offset dev inode path`; the path may hold spaces.
        let mut fields = line.splitn(6, ' ');
        let range = fields.next()?;
        let inode = fields.nth(3)?.parse().ok()?;
        let path = fields.next().unwrap_or("").trim_start();
        if !memfd_label_matches(path, label) {
            return None;
        }
        let (start, end) = range.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
        );
        Some((inode, end.saturating_sub(start)))
    })
}

/// A namespace's memfds one process maps or holds, by identity (inode): what tells one
/// process's memory from another's, where the names (namespace and allocation number,
/// shared by every process of a tree) cannot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemfdFiles {
    /// Inodes of the memfds it maps, with the bytes its mappings of each span.
    pub mapped: std::collections::BTreeMap<u64, u64>,
    /// Inodes of the memfds it holds a descriptor of (an exporter holds its allocations').
    pub held: std::collections::BTreeSet<u64>,
}

/// The memfds of `namespace` that process `pid` maps or holds, by inode (from
/// `/proc/<pid>/maps` and `stat` of `/proc/<pid>/fd/*`).
///
/// # Errors
/// [`Error::Io`] if `/proc/<pid>/maps` or `/proc/<pid>/fd` cannot be read (the process is
/// gone, or belongs to another user).
pub fn memfd_files(pid: u32, namespace: &str) -> Result<MemfdFiles> {
    use std::os::unix::fs::MetadataExt;
    let label = format!("/memfd:{NAME_PREFIX}{namespace}.");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(Error::io("reading /proc/<pid>/maps"))?;
    let mut files = MemfdFiles::default();
    for (inode, bytes) in label_mappings(&maps, &label) {
        *files.mapped.entry(inode).or_default() += bytes;
    }
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map_err(Error::io("reading /proc/<pid>/fd"))?;
    for entry in fds.flatten() {
        // A descriptor closed meanwhile has no link to read: skip it.
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if memfd_label_matches(&target.to_string_lossy(), &label) {
            if let Ok(meta) = std::fs::metadata(entry.path()) {
                files.held.insert(meta.ino());
            }
        }
    }
    Ok(files)
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

    fn session() -> Session {
        Session::new(SessionToken::from_bytes([5; 32]))
    }

    fn dup(fd: Option<BorrowedFd<'_>>) -> Option<OwnedFd> {
        fd.map(|fd| fd.try_clone_to_owned().unwrap())
    }

    #[test]
    fn allocate_share_open_and_the_pages_outlive_the_owner() {
        let ns = ns("mfd");
        let b = HostBackend::with_flavor(HostFlavor::Memfd, &ns).unwrap();
        let session = session();
        let a = b.allocate(3 * 4096 + 5).unwrap();
        assert_eq!(a.to_vec().unwrap(), vec![0; 3 * 4096 + 5], "zeroed");
        a.write(10, b"memfd").unwrap();
        let h = a.handle(&session).fd_slot(Some(0)).build().unwrap();
        assert_eq!(h.raw, RawHandle::HostMemfd { slot: Some(0) });
        let seals = rustix::fs::fcntl_get_seals(a.export_fd().unwrap()).unwrap();
        assert!(seals.contains(SEALS), "{seals:?}");
        assert!(
            rustix::fs::ftruncate(a.export_fd().unwrap(), 1).is_err(),
            "not even the owner can shrink it"
        );

        let opened = b
            .open(session.check(&h).unwrap(), dup(a.export_fd()))
            .unwrap();
        assert_eq!(b.opens(), 1);
        let mut got = [0u8; 5];
        opened.read(10, &mut got).unwrap();
        assert_eq!(&got, b"memfd");
        opened.write(0, b"back").unwrap();
        let mut back = [0u8; 4];
        a.read(0, &mut back).unwrap();
        assert_eq!(&back, b"back");
        let me = std::process::id();
        let held = memfd_usage(me, &ns).unwrap();
        assert_eq!(held.mappings, 2, "{held:?}");
        assert_eq!(held.fds, 1, "the importer closed its descriptor: {held:?}");
        assert!(held.mapped_bytes >= 2 * (3 * 4096 + 5) as u64);
        // By identity: one memfd, mapped twice (owner and importer), its descriptor held.
        let files = memfd_files(me, &ns).unwrap();
        let inode = {
            use std::os::unix::fs::MetadataExt;
            let fd = a.export_fd().unwrap().try_clone_to_owned().unwrap();
            std::fs::File::from(fd).metadata().unwrap().ino()
        };
        assert_eq!(files.mapped.keys().copied().collect::<Vec<_>>(), [inode]);
        assert_eq!(files.mapped[&inode], held.mapped_bytes);
        assert_eq!(files.held.iter().copied().collect::<Vec<_>>(), [inode]);
        drop(a);
        // The owner's free leaves the importer's mapping valid.
        opened.read(0, &mut back).unwrap();
        assert_eq!(&back, b"back");
        assert_eq!(memfd_usage(me, &ns).unwrap().fds, 0);
        drop(opened);
        assert!(memfd_usage(me, &ns).unwrap().is_empty());
        assert_eq!(memfd_files(me, &ns).unwrap(), MemfdFiles::default());
        assert!(
            crate::host::list_segments(&ns).unwrap().is_empty(),
            "no name anywhere"
        );
    }

    #[test]
    fn a_handle_without_its_descriptor_is_not_mapped() {
        let b = HostBackend::with_flavor(HostFlavor::Memfd, &ns("nomap")).unwrap();
        let session = session();
        let a = b.allocate(4096).unwrap();
        let h = a.handle(&session).fd_slot(None).build().unwrap();
        assert!(matches!(
            b.open(session.check(&h).unwrap(), None),
            Err(Error::NotMapped { .. })
        ));
        assert_eq!(b.opens(), 0);
    }

    #[test]
    fn unsealed_or_short_descriptors_are_refused() {
        let b = HostBackend::with_flavor(HostFlavor::Memfd, &ns("seal")).unwrap();
        let session = session();
        let a = b.allocate(8192).unwrap();
        let h = a.handle(&session).build().unwrap();
        let checked = || session.check(&h).unwrap();

        // A memfd that can still shrink: sealed for growth only.
        let loose =
            rustix::fs::memfd_create("loose", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .unwrap();
        rustix::fs::ftruncate(&loose, 8192).unwrap();
        rustix::fs::fcntl_add_seals(&loose, SealFlags::GROW).unwrap();
        assert!(matches!(
            b.open(checked(), Some(loose)),
            Err(Error::UnsealedMemory { .. })
        ));
        // A memfd made without sealing (its only seal is F_SEAL_SEAL).
        let plain = rustix::fs::memfd_create("plain", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, 8192).unwrap();
        assert!(matches!(
            b.open(checked(), Some(plain)),
            Err(Error::UnsealedMemory { .. })
        ));
        // Not a memory file at all.
        let (pipe, _w) = rustix::pipe::pipe().unwrap();
        assert!(matches!(
            b.open(checked(), Some(pipe)),
            Err(Error::UnsealedMemory { .. })
        ));
        // Sealed, but smaller than the handle claims.
        let small =
            rustix::fs::memfd_create("small", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .unwrap();
        rustix::fs::ftruncate(&small, 4096).unwrap();
        rustix::fs::fcntl_add_seals(&small, SEALS).unwrap();
        assert!(matches!(
            b.open(checked(), Some(small)),
            Err(Error::MemoryTooSmall {
                claimed: 8192,
                actual: 4096
            })
        ));
        assert_eq!(b.opens(), 0, "nothing was mapped");
        // The real one opens.
        b.open(checked(), dup(a.export_fd())).unwrap();
        assert_eq!(b.opens(), 1);
    }

    #[test]
    fn maps_lines_are_counted_by_label() {
        let maps = "\
7f0000000000-7f0000002000 rw-s 00000000 00:01 1234                       /memfd:baton.ns.7 (deleted)
7f0000002000-7f0000003000 rw-s 00000000 00:01 1235                       /memfd:baton.ns.70 (deleted)
7f0000003000-7f0000004000 rw-s 00000000 00:01 1236                       /memfd:baton.ns2.7 (deleted)
7f0000004000-7f0000005000 rw-p 00000000 00:00 0                          [heap]
7f0000005000-7f0000006000 rw-s 00000000 00:01 1237                       /memfd:baton.ns.x (deleted)
";
        let usage = parse_maps(maps, "/memfd:baton.ns.");
        assert_eq!(usage.mappings, 2);
        assert_eq!(usage.mapped_bytes, 0x3000);
    }
}
