//! The host backend: zero-copy CPU buffers between processes, in one of two flavors.
//!
//! | | [`memfd`](HostFlavor::Memfd) (Linux, the default there) | [`named`](HostFlavor::Named) (portable) |
//! |---|---|---|
//! | allocate | `memfd_create`, `ftruncate`, seals against shrinking and growing | a named POSIX segment (`shared_memory`) |
//! | raw handle | [`RawHandle::HostMemfd`]: a descriptor slot; the fd crosses the link by `SCM_RIGHTS` | [`RawHandle::HostSegment`]: the segment's name |
//! | importer checks | seals (`F_GET_SEALS`) and size (`fstat`) before `mmap` | the name's owner is the exporter, size |
//! | another process of the user can | nothing: it has no name to find | list names in `/dev/shm`, shrink a segment under an importer (`SIGBUS`) |
//! | after SIGKILL of every process | nothing left: the kernel frees it with its last holder | names left in `/dev/shm` until [`sweep`]/[`sweep_process`] |
//!
//! The flavor is chosen at run time: [`HOST_ENV`] (`BATON_HOST=memfd|named`) for
//! [`HostBackend::new`], or explicitly with [`HostBackend::with_flavor`].
//! [`HostBackend::with_namespace`] always makes the named flavor (a namespace is what
//! segments are named, counted and swept in).
//!
//! One [`HostBackend`] *opens* host handles of both kinds, whatever flavor it allocates
//! in: a process that allocates named segments (or CUDA memory, whose node adds a host
//! importer) still imports a memfd peer's buffers, and the other way round. Both flavors
//! declare [`FreeWhileMapped::Survives`]: an exporter's free leaves importers' mappings,
//! and the pages under them, in place.
//!
//! # Safety
//!
//! This module holds the `unsafe` code that touches a host mapping's bytes (`Mapping`):
//! - a `Backing` keeps its region mapped `MAP_SHARED` read-write for `size()` bytes from
//!   `base()` for as long as it lives (each flavor's module says how), and the `Mapping`
//!   owns its backing, so the base pointer is valid for `size` bytes for the mapping's life;
//! - every copy is bounds-checked by the caller ([`Allocation`] and [`OpenedMem`] check
//!   `offset + len <= size` before calling in) and done with raw-pointer copies, never
//!   through Rust references to the shared bytes, because other processes may write them
//!   at any time. A racing writer yields torn bytes, never invalid values: only `u8`s
//!   cross the boundary;
//! - the one exception is `RawMemory::host_bytes`, a `&[u8]` of the mapping, borrowed from
//!   it (so it cannot outlive the mapping). It is only handed out under a protocol that
//!   rules writers out while it lives (Baton's typed leases, see that method's docs); a
//!   process that breaks the protocol with `unsafe` code or by writing through a raw
//!   pointer can still change the bytes under it;
//! - `RawMemory::host_bytes_mut` gives a `&mut [u8]` of the mapping, also borrowed from
//!   it. It is an `unsafe fn`: its caller guarantees that nothing else in this process
//!   reaches the bytes while it lives. `Imported::host_bytes_mut` (the import cache) is
//!   the only caller: it hands the slice out for a mapping that has a single view in this
//!   process, borrowed `&mut`, and opens no other view of the mapping until that one
//!   drops. Another process can still write the bytes under it (outside Rust's model, as
//!   above); Baton's protocol rules that out while a writable lease is out;
//! - a named segment shrunk by a hostile process of the same user after we mapped it would
//!   make an access fault (`SIGBUS`); named segments cannot be sealed against that (only
//!   processes of an allowed uid holding the session token can learn their names). A memfd
//!   is mapped only once its seals forbid any size change.

#[cfg(target_os = "linux")]
mod memfd;
mod named;

#[cfg(target_os = "linux")]
pub use memfd::{MemfdFiles, MemfdUsage, memfd_files, memfd_usage};
#[cfg(feature = "fuzzing")]
pub(crate) use named::SegmentOwner;
pub use named::{
    DEFAULT_NAMESPACE, NAMESPACE_ENV, SegmentInfo, SweepReport, list_segments, sweep, sweep_process,
};

use crate::backend::{
    Allocation, Backend, ExportableMemory, FreeWhileMapped, MemPtr, OpenedMem, RawMemory,
};
use crate::session::CheckedHandle;
use crate::{Error, Result};
use baton_messages::{BackendKind, DeviceUuid, RawHandle};
use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable that picks the host flavor [`HostBackend::new`] allocates in:
/// `memfd` or `named` (default: `memfd` on Linux, `named` elsewhere).
pub const HOST_ENV: &str = "BATON_HOST";

/// How the host backend makes shareable memory (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostFlavor {
    /// Sealed `memfd`s shared by descriptor (Linux): nothing to list, shrink or leak.
    Memfd,
    /// Named POSIX shared-memory segments: portable, but listable, shrinkable by the same
    /// user, and left in `/dev/shm` by owners killed before their `Drop` until swept.
    Named,
}

impl HostFlavor {
    /// `memfd` on Linux, `named` elsewhere.
    pub const fn platform_default() -> Self {
        if cfg!(target_os = "linux") {
            Self::Memfd
        } else {
            Self::Named
        }
    }

    /// Parses `memfd` or `named` (any case); empty means the platform default.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" => Some(Self::platform_default()),
            "memfd" => Some(Self::Memfd),
            "named" => Some(Self::Named),
            _ => None,
        }
    }

    /// The flavor in [`HOST_ENV`], the platform default if unset.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] if the variable holds something else.
    pub fn from_env() -> Result<Self> {
        match std::env::var(HOST_ENV) {
            Err(_) => Ok(Self::platform_default()),
            Ok(v) => Self::parse(&v).ok_or_else(|| Error::BackendUnavailable {
                backend: "host",
                reason: format!("{HOST_ENV}={v:?} is not one of memfd, named"),
            }),
        }
    }

    /// `"memfd"` or `"named"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Memfd => "memfd",
            Self::Named => "named",
        }
    }
}

/// The host shared-memory backend: allocates in its [`HostFlavor`], opens host handles of
/// both flavors.
#[derive(Debug)]
pub struct HostBackend {
    flavor: HostFlavor,
    namespace: String,
    opens: AtomicU64,
}

impl HostBackend {
    /// A host backend in the flavor from [`HOST_ENV`] (default: memfd on Linux) and the
    /// namespace from [`NAMESPACE_ENV`], else [`DEFAULT_NAMESPACE`].
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] if either variable holds an invalid value.
    pub fn new() -> Result<Self> {
        let ns = std::env::var(NAMESPACE_ENV).unwrap_or_else(|_| DEFAULT_NAMESPACE.to_owned());
        Self::with_flavor(HostFlavor::from_env()?, &ns)
    }

    /// A host backend of the named flavor whose segments are named in `namespace` (1 to 32
    /// of `[A-Za-z0-9_-]`), whatever [`HOST_ENV`] says. Separate namespaces keep
    /// deployments (and tests) from counting or sweeping each other's segments.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] for an invalid namespace.
    pub fn with_namespace(namespace: &str) -> Result<Self> {
        Self::with_flavor(HostFlavor::Named, namespace)
    }

    /// A host backend of the memfd flavor, labelled with the namespace from
    /// [`NAMESPACE_ENV`] (see [`memfd_usage`]).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] off Linux, or for an invalid namespace.
    pub fn memfd() -> Result<Self> {
        let ns = std::env::var(NAMESPACE_ENV).unwrap_or_else(|_| DEFAULT_NAMESPACE.to_owned());
        Self::with_flavor(HostFlavor::Memfd, &ns)
    }

    /// A host backend of `flavor` in `namespace`: the segments' namespace (named), or the
    /// label in the memfds' names that [`memfd_usage`] counts by (memfd).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] for an invalid namespace, or for memfd off Linux.
    pub fn with_flavor(flavor: HostFlavor, namespace: &str) -> Result<Self> {
        if !named::valid_namespace(namespace) {
            return Err(Error::BackendUnavailable {
                backend: "host",
                reason: format!(
                    "invalid segment namespace {namespace:?}: use 1-32 of [A-Za-z0-9_-]"
                ),
            });
        }
        if flavor == HostFlavor::Memfd && !cfg!(target_os = "linux") {
            return Err(Error::BackendUnavailable {
                backend: "host",
                reason: format!("memfd host memory needs Linux: set {HOST_ENV}=named"),
            });
        }
        Ok(Self {
            flavor,
            namespace: namespace.to_owned(),
            opens: AtomicU64::new(0),
        })
    }

    /// The flavor it allocates in.
    pub fn flavor(&self) -> HostFlavor {
        self.flavor
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// How many mappings this backend has made for importers, of either flavor (each is one
    /// `mmap`; the import cache makes repeats free).
    pub fn opens(&self) -> u64 {
        self.opens.load(Ordering::Relaxed)
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
        match self.flavor {
            HostFlavor::Named => named::allocate(&self.namespace, size),
            #[cfg(target_os = "linux")]
            HostFlavor::Memfd => memfd::allocate(&self.namespace, size),
            #[cfg(not(target_os = "linux"))]
            HostFlavor::Memfd => unreachable!("with_flavor refuses memfd off Linux"),
        }
    }

    fn open(&self, handle: CheckedHandle<'_>, fd: Option<OwnedFd>) -> Result<OpenedMem> {
        let opened = match &handle.raw {
            RawHandle::HostSegment(name) => named::open(&handle, name)?,
            #[cfg(target_os = "linux")]
            RawHandle::HostMemfd { .. } => memfd::open(&handle, fd)?,
            _ => {
                return Err(Error::UnsupportedBackend {
                    kind: handle.backend,
                });
            }
        };
        self.opens.fetch_add(1, Ordering::Relaxed);
        Ok(opened)
    }
}

/// What keeps a host mapping mapped: one per flavor. Implementors guarantee that
/// `base()..base()+size()` stays mapped read-write, `MAP_SHARED`, while they live (see
/// the module's `# Safety`).
trait Backing: Send + Sync + 'static {
    /// The mapping's first byte.
    fn base(&self) -> Result<NonNull<u8>>;
    /// Bytes mapped.
    fn size(&self) -> usize;
    /// Whether this is the exporter's mapping (which can make raw handles).
    fn is_owner(&self) -> bool;
    /// The raw handle importers open (owner only).
    fn raw_handle(&self, fd_slot: Option<u8>) -> Result<RawHandle>;
    /// The descriptor to send beside the frame (memfd owner only).
    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

/// One mapped region of host shared memory, the owner's or an importer's.
struct Mapping<B: Backing> {
    base: NonNull<u8>,
    size: usize,
    backing: B,
}

// SAFETY: the base pointer points into a process-wide shared mapping that `backing` (which
// is `Send`) keeps alive; every access is a bounds-checked raw copy, so moving the mapping
// to another thread is sound.
unsafe impl<B: Backing> Send for Mapping<B> {}
// SAFETY: `&Mapping` only allows raw copies into and out of the shared bytes, which are
// plain `u8`s that other processes write concurrently anyway; no Rust reference to them
// is ever formed, so concurrent use from several threads adds no hazard.
unsafe impl<B: Backing> Sync for Mapping<B> {}

impl<B: Backing> Mapping<B> {
    fn new(backing: B) -> Result<Self> {
        Ok(Self {
            base: backing.base()?,
            size: backing.size(),
            backing,
        })
    }
}

impl<B: Backing> fmt::Debug for Mapping<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMapping")
            .field("size", &self.size)
            .field("owner", &self.backing.is_owner())
            .finish()
    }
}

impl<B: Backing> RawMemory for Mapping<B> {
    fn size(&self) -> usize {
        self.size
    }

    fn ptr(&self) -> MemPtr {
        MemPtr::Host(self.base.as_ptr())
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        debug_assert!(offset + dst.len() <= self.size);
        // SAFETY: the caller checked `offset + dst.len() <= size`; the mapping is valid for
        // `size` bytes while `self.backing` lives (module overview); `dst` is a distinct
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

    fn host_bytes(&self) -> Option<&[u8]> {
        // SAFETY: the mapping is readable and valid for `size` bytes while `self.backing`
        // lives, and the slice borrows `self`, so it cannot outlive it (module overview).
        // The bytes are plain `u8`s: any value is valid. Writers while it is borrowed are
        // ruled out by the caller's protocol (see `RawMemory::host_bytes`).
        Some(unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.size) })
    }

    #[allow(clippy::mut_from_ref)] // the `# Safety` contract of `RawMemory::host_bytes_mut`
    unsafe fn host_bytes_mut(&self) -> Option<&mut [u8]> {
        // SAFETY: the mapping is readable, writable (`MAP_SHARED` read-write, see `Backing`)
        // and valid for `size` bytes while `self.backing` lives, and the slice borrows
        // `self`, so it cannot outlive it. Any byte value is valid. That nothing else in
        // this process reaches the bytes while it lives is the caller's contract
        // (`RawMemory::host_bytes_mut`); `Imported::host_bytes_mut` keeps it by handing it
        // out only for the mapping's single view, borrowed `&mut`, and refusing new views
        // until that view drops.
        Some(unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr(), self.size) })
    }

    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        debug_assert!(offset + len <= self.size);
        // SAFETY: the caller checked `offset + len <= size`; the mapping is writable and
        // valid for `size` bytes while `self.backing` lives.
        unsafe {
            std::ptr::write_bytes(self.base.as_ptr().wrapping_add(offset), byte, len);
        }
        Ok(())
    }
}

impl<B: Backing> ExportableMemory for Mapping<B> {
    /// Freeing the owner's memory (unlinking and unmapping a segment, closing and
    /// unmapping a memfd) leaves importers' mappings, and the pages under them, in place.
    fn free_while_mapped(&self) -> FreeWhileMapped {
        FreeWhileMapped::Survives
    }

    fn raw_handle(&self, fd_slot: Option<u8>) -> Result<RawHandle> {
        self.backing.raw_handle(fd_slot)
    }

    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        self.backing.export_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::Session;
    use baton_messages::SessionToken;

    /// An `InPlace` and a copy never overlap: a copy running refuses the `InPlace`, an
    /// `InPlace` living refuses every copy, and each is possible again once the other ends.
    #[test]
    fn an_in_place_write_and_a_copy_never_overlap() {
        let backend = HostBackend::new().unwrap();
        let alloc = backend.allocate(4096).unwrap();
        {
            let _copying = alloc.check_copy().unwrap();
            assert!(matches!(alloc.write_in_place(), Err(Error::InPlace { .. })));
        }
        let mut in_place = alloc.write_in_place().unwrap().expect("host memory");
        in_place[0] = 7;
        assert!(alloc.is_in_place());
        assert!(matches!(alloc.to_vec(), Err(Error::InPlace { .. })));
        assert!(matches!(alloc.write(0, &[1]), Err(Error::InPlace { .. })));
        assert!(matches!(alloc.write_in_place(), Err(Error::InPlace { .. })));
        drop(in_place);
        assert!(!alloc.is_in_place());
        assert_eq!(alloc.to_vec().unwrap()[0], 7);
    }

    #[test]
    fn flavors_parse_and_default_by_platform() {
        assert_eq!(HostFlavor::parse("MEMFD"), Some(HostFlavor::Memfd));
        assert_eq!(HostFlavor::parse(" named "), Some(HostFlavor::Named));
        assert_eq!(HostFlavor::parse(""), Some(HostFlavor::platform_default()));
        assert_eq!(HostFlavor::parse("posix"), None);
        #[cfg(target_os = "linux")]
        assert_eq!(HostFlavor::platform_default(), HostFlavor::Memfd);
        assert_eq!(
            HostBackend::with_namespace("n").unwrap().flavor(),
            HostFlavor::Named
        );
    }

    #[test]
    fn zero_size_is_refused() {
        for flavor in [HostFlavor::Memfd, HostFlavor::Named] {
            let b = HostBackend::with_flavor(flavor, "unit-zero").unwrap();
            assert!(matches!(b.allocate(0), Err(Error::ZeroSize)));
        }
    }

    /// One backend opens both kinds of host handle, whatever it allocates in.
    #[cfg(target_os = "linux")]
    #[test]
    fn either_flavor_opens_the_other() {
        let ns = format!("unit-both-{}", std::process::id());
        let session = Session::new(SessionToken::from_bytes([6; 32]));
        let memfd = HostBackend::with_flavor(HostFlavor::Memfd, &ns).unwrap();
        let named = HostBackend::with_namespace(&ns).unwrap();
        let (m, n) = (memfd.allocate(4096).unwrap(), named.allocate(4096).unwrap());
        m.fill(0, 4096, 1).unwrap();
        n.fill(0, 4096, 2).unwrap();
        let hm = m.handle(&session).build().unwrap();
        let hn = n.handle(&session).build().unwrap();
        let fd = m.export_fd().map(|fd| fd.try_clone_to_owned().unwrap());
        let from_memfd = named.open(session.check(&hm).unwrap(), fd).unwrap();
        let from_named = memfd.open(session.check(&hn).unwrap(), None).unwrap();
        assert_eq!(from_memfd.to_vec().unwrap(), vec![1; 4096]);
        assert_eq!(from_named.to_vec().unwrap(), vec![2; 4096]);
        assert_eq!(m.free_while_mapped(), FreeWhileMapped::Survives);
        assert_eq!(n.free_while_mapped(), FreeWhileMapped::Survives);
        assert!(n.export_fd().is_none(), "a named segment travels by name");
    }
}
