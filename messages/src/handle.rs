//! [`HandleMsg`]: the serialized capability to map one buffer of another process.
//!
//! A handle message is plain data. It names the exporter, the allocation and its
//! generation, the backend and device, the byte range and typed layout of the buffer, and
//! carries the backend's raw handle (a segment name, 64 CUDA IPC bytes, or the slot of a
//! file descriptor sent beside the frame: a CUDA VMM handle or a sealed host `memfd`). Raw handles are capabilities: `Debug` never
//! prints them, and every handle is sealed with a keyed digest over all its fields, which
//! the importer verifies before any driver call. (A CUDA IPC handle with one corrupted byte
//! was seen to open without error on driver 580, so the driver is no judge of integrity.)

use crate::fence::FenceHandle;
use crate::ids::{AllocationId, DeviceUuid, ExporterId, Generation, SessionToken};
use crate::layout::Layout;
use crate::{Error, PROTOCOL_VERSION, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Which backend made a buffer, and so how to open its handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[non_exhaustive]
pub enum BackendKind {
    /// Host memory: a sealed `memfd` shared by descriptor (Linux) or a named POSIX
    /// shared-memory segment ([`RawHandle::HostMemfd`], [`RawHandle::HostSegment`]).
    Host,
    /// CUDA device memory shared with a legacy IPC handle (`cuIpcGetMemHandle`).
    CudaLegacy,
    /// CUDA device memory made with `cuMemCreate`, shared as a POSIX file descriptor.
    CudaVmm,
    /// CUDA device memory from a stream-ordered, exportable memory pool
    /// (`cuMemAllocFromPoolAsync`): the pool shared as a POSIX file descriptor, each
    /// allocation as 64 bytes of `cuMemPoolExportPointer` data.
    CudaPool,
}

/// The name of a host shared-memory segment: `/` then 1 to 200 of `[A-Za-z0-9._-]`.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SegmentName(String);

impl SegmentName {
    /// Longest name accepted, leading `/` excluded.
    pub const MAX_LEN: usize = 200;

    /// Checks and wraps a name.
    pub fn new(name: impl Into<String>) -> Option<Self> {
        let name = name.into();
        let rest = name.strip_prefix('/')?;
        let ok = !rest.is_empty()
            && rest.len() <= Self::MAX_LEN
            && rest != "."
            && rest != ".."
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        ok.then_some(Self(name))
    }

    /// The name, with its leading `/`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SegmentName(<redacted>)")
    }
}

impl TryFrom<String> for SegmentName {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        SegmentName::new(s).ok_or_else(|| "invalid shared-memory segment name".to_owned())
    }
}

impl From<SegmentName> for String {
    fn from(s: SegmentName) -> String {
        s.0
    }
}

macro_rules! secret_bytes64 {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub struct $name(#[serde(with = "crate::serde_bytes64")] pub [u8; 64]);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(concat!(stringify!($name), "(<redacted>)"))
            }
        }

        #[cfg(test)]
        impl proptest::arbitrary::Arbitrary for $name {
            type Parameters = ();
            type Strategy = proptest::strategy::BoxedStrategy<$name>;
            fn arbitrary_with((): ()) -> Self::Strategy {
                use proptest::prelude::*;
                proptest::collection::vec(any::<u8>(), 64)
                    .prop_map(|v| $name(v.try_into().unwrap()))
                    .boxed()
            }
        }
    };
}

secret_bytes64!(
    /// The 64 opaque bytes of a CUDA `CUipcMemHandle`. A capability: never logged.
    CudaIpcMemHandle
);

secret_bytes64!(
    /// The 64 opaque bytes of a CUDA `CUmemPoolPtrExportData` (`cuMemPoolExportPointer`):
    /// names one allocation of an exported memory pool. A capability: never logged.
    CudaPoolExportData
);

secret_bytes64!(
    /// The 64 opaque bytes of a CUDA `CUipcEventHandle`: the event the exporter recorded
    /// after the work that produced the buffer. The importer's stream waits on it before use.
    IpcEventHandle
);

/// The backend-specific part of a handle. A capability: `Debug` never prints it.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[non_exhaustive]
pub enum RawHandle {
    /// Host backend: the shared-memory segment to map.
    HostSegment(#[cfg_attr(test, proptest(strategy = "tests::segment_name()"))] SegmentName),
    /// CUDA legacy IPC: the memory handle.
    CudaIpc(CudaIpcMemHandle),
    /// CUDA VMM: the shareable handle is the file descriptor at this index among the
    /// descriptors that travelled beside the frame (`SCM_RIGHTS`).
    CudaVmmFd {
        /// Index into the frame's file descriptors; `None` when the importer already maps
        /// the allocation (the descriptor crossed this link before), so that only a hit in
        /// its import cache can open it.
        slot: Option<u8>,
    },
    /// CUDA stream-ordered pool memory: the allocation's export data, and the pool it comes
    /// from, whose shareable handle is a file descriptor that crosses a link once.
    CudaPool {
        /// The exporting process's id of the pool, unique in that process: the importer
        /// imports each (exporter process, pool) once and finds it again by this id.
        pool: u64,
        /// Index of the pool's descriptor among the frame's file descriptors; `None` when
        /// the importer already imported the pool (the descriptor crossed this link
        /// before).
        pool_slot: Option<u8>,
        /// The `cuMemPoolExportPointer` data of the allocation.
        ptr: CudaPoolExportData,
    },
    /// Host backend, `memfd` flavor (Linux): the sealed memory file is the descriptor at
    /// this index among the descriptors that travelled beside the frame (`SCM_RIGHTS`).
    /// It has no name, so nothing can list, shrink or leave it behind.
    HostMemfd {
        /// Index into the frame's file descriptors; `None` when the importer already maps
        /// the allocation (the descriptor crossed this link before), so that only a hit in
        /// its import cache can open it.
        slot: Option<u8>,
    },
}

impl RawHandle {
    /// What kind of raw handle this is, for messages (never the bytes).
    pub fn kind_name(&self) -> &'static str {
        match self {
            RawHandle::HostSegment(_) => "host segment",
            RawHandle::CudaIpc(_) => "CUDA IPC",
            RawHandle::CudaVmmFd { .. } => "CUDA VMM fd",
            RawHandle::CudaPool { .. } => "CUDA pool pointer",
            RawHandle::HostMemfd { .. } => "host memfd",
        }
    }

    /// The backend that makes raw handles of this kind.
    pub fn backend(&self) -> BackendKind {
        match self {
            RawHandle::HostSegment(_) => BackendKind::Host,
            RawHandle::CudaIpc(_) => BackendKind::CudaLegacy,
            RawHandle::CudaVmmFd { .. } => BackendKind::CudaVmm,
            RawHandle::CudaPool { .. } => BackendKind::CudaPool,
            RawHandle::HostMemfd { .. } => BackendKind::Host,
        }
    }

    /// Where the descriptor this handle needs sits among its frame's descriptors: `None`
    /// for handles that carry no descriptor, or whose descriptor the importer already has.
    pub fn fd_slot(&self) -> Option<u8> {
        match self {
            RawHandle::CudaVmmFd { slot } | RawHandle::HostMemfd { slot } => *slot,
            RawHandle::CudaPool { pool_slot, .. } => *pool_slot,
            RawHandle::HostSegment(_) | RawHandle::CudaIpc(_) => None,
        }
    }
}

impl fmt::Debug for RawHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RawHandle::CudaVmmFd { slot } => write!(f, "CudaVmmFd {{ slot: {slot:?} }}"),
            RawHandle::CudaPool {
                pool, pool_slot, ..
            } => write!(
                f,
                "CudaPool {{ pool: {pool}, pool_slot: {pool_slot:?}, ptr: <redacted> }}"
            ),
            RawHandle::HostMemfd { slot } => write!(f, "HostMemfd {{ slot: {slot:?} }}"),
            other => write!(f, "{}(<redacted>)", other.kind_name()),
        }
    }
}

/// The key that seals handle messages, derived from the [`SessionToken`].
#[derive(Clone)]
pub struct HandleKey([u8; 32]);

impl HandleKey {
    /// Derives the handle key of a session.
    pub fn derive(token: &SessionToken) -> Self {
        Self(blake3::derive_key(
            "baton 2026-11 handle message digest v1",
            token.as_bytes(),
        ))
    }
}

impl fmt::Debug for HandleKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HandleKey(<redacted>)")
    }
}

/// A keyed BLAKE3 digest over every other field of a [`HandleMsg`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct HandleDigest(pub [u8; 32]);

impl fmt::Debug for HandleDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "digest:{:02x}{:02x}…", self.0[0], self.0[1])
    }
}

/// Everything another process needs to map one buffer, sealed by a keyed digest.
///
/// Build one with every field set and `digest: HandleDigest::default()`, then
/// [`seal`](Self::seal) it. The importer calls [`check`](Self::check) (which validates and
/// verifies) before it touches a driver.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct HandleMsg {
    /// Protocol version the handle was made under.
    pub version: u8,
    /// The process and actor that own the buffer.
    pub exporter: ExporterId,
    /// The exported allocation (a whole buffer, or a slab the buffer is carved from).
    pub alloc: AllocationId,
    /// Which backing of `alloc` this is.
    pub generation: Generation,
    /// How to open it.
    pub backend: BackendKind,
    /// The device the memory lives on ([`DeviceUuid::HOST`] for host memory).
    pub device: DeviceUuid,
    /// Bytes of the whole exported allocation.
    pub alloc_size: u64,
    /// Where the buffer starts inside the allocation.
    pub offset: u64,
    /// Bytes of the buffer.
    pub len: u64,
    /// Element type and shape, for typed buffers.
    pub layout: Option<Layout>,
    /// The backend's raw handle.
    pub raw: RawHandle,
    /// The acquire fence: recorded by the exporter after the work that produced the
    /// buffer; the importer's work waits on it, on the stream it uses (device backends
    /// only).
    pub fence: Option<FenceHandle>,
    /// Keyed digest over all fields above.
    pub digest: HandleDigest,
}

impl fmt::Debug for HandleMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandleMsg")
            .field("exporter", &self.exporter)
            .field("alloc", &self.alloc)
            .field("gen", &self.generation)
            .field("backend", &self.backend)
            .field("device", &self.device)
            .field(
                "range",
                &format_args!("{}..+{} of {}", self.offset, self.len, self.alloc_size),
            )
            .field("layout", &self.layout)
            .field("raw", &self.raw)
            .field("fence", &self.fence.as_ref().map(FenceHandle::kind))
            .finish_non_exhaustive()
    }
}

impl HandleMsg {
    fn compute_digest(&self, key: &HandleKey) -> HandleDigest {
        let body = (
            &self.version,
            &self.exporter,
            &self.alloc,
            &self.generation,
            &self.backend,
            &self.device,
            &self.alloc_size,
            &self.offset,
            &self.len,
            &self.layout,
            &self.raw,
            &self.fence,
        );
        // Encoding plain data into a Vec cannot fail; an empty body would still be keyed.
        let bytes = bincode::serde::encode_to_vec(body, crate::codec::config()).unwrap_or_default();
        HandleDigest(*blake3::keyed_hash(&key.0, &bytes).as_bytes())
    }

    /// Computes and stores the digest over all other fields.
    pub fn seal(&mut self, key: &HandleKey) {
        self.digest = self.compute_digest(key);
    }

    /// The handle with its digest computed.
    pub fn sealed(mut self, key: &HandleKey) -> Self {
        self.seal(key);
        self
    }

    /// Checks the handle's internal consistency: version, a non-empty byte range inside
    /// the allocation, a layout that covers exactly that range, a raw handle of its
    /// backend's kind.
    ///
    /// # Errors
    /// [`Error::UnsupportedVersion`], [`Error::HandleOutOfBounds`],
    /// [`Error::LayoutMismatch`] or [`Error::BackendMismatch`].
    pub fn validate(&self) -> Result<()> {
        if self.version != PROTOCOL_VERSION {
            return Err(Error::UnsupportedVersion {
                got: self.version,
                supported: PROTOCOL_VERSION,
            });
        }
        let in_bounds = self
            .offset
            .checked_add(self.len)
            .is_some_and(|end| end <= self.alloc_size);
        if self.len == 0 || !in_bounds {
            return Err(Error::HandleOutOfBounds {
                offset: self.offset,
                len: self.len,
                alloc_size: self.alloc_size,
            });
        }
        if let Some(layout) = &self.layout {
            let layout_bytes = layout.byte_len();
            if layout_bytes != Some(self.len) {
                return Err(Error::LayoutMismatch {
                    layout_bytes,
                    len: self.len,
                });
            }
        }
        let fence_allowed = self.backend != BackendKind::Host || self.fence.is_none();
        if self.raw.backend() != self.backend || !fence_allowed {
            return Err(Error::BackendMismatch {
                backend: self.backend,
                raw: self.raw.kind_name(),
            });
        }
        Ok(())
    }

    /// Verifies the digest under `key`, in constant time.
    ///
    /// # Errors
    /// [`Error::DigestMismatch`] if any field differs from what was sealed, or the handle
    /// was sealed under another key.
    pub fn verify(&self, key: &HandleKey) -> Result<()> {
        let expected = blake3::Hash::from_bytes(self.compute_digest(key).0);
        if expected == blake3::Hash::from_bytes(self.digest.0) {
            Ok(())
        } else {
            Err(Error::DigestMismatch)
        }
    }

    /// [`verify`](Self::verify) then [`validate`](Self::validate): what an importer does
    /// with every handle before it opens it.
    ///
    /// # Errors
    /// As those two.
    pub fn check(&self, key: &HandleKey) -> Result<()> {
        self.verify(key)?;
        self.validate()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ids::{ActorId, BootId, ProcessId};
    use crate::layout::{DType, Shape};
    use proptest::prelude::*;

    pub(crate) fn segment_name() -> impl Strategy<Value = SegmentName> {
        "/[A-Za-z0-9._-]{1,40}".prop_filter_map("dot names", SegmentName::new)
    }

    pub(crate) fn sample(raw: RawHandle) -> HandleMsg {
        HandleMsg {
            version: PROTOCOL_VERSION,
            exporter: ExporterId {
                process: ProcessId {
                    boot: BootId([7; 16]),
                    pid: 4242,
                    start_ticks: 99,
                },
                actor: ActorId::new(3),
            },
            alloc: AllocationId::new(17),
            generation: Generation::FIRST,
            backend: raw.backend(),
            device: DeviceUuid::HOST,
            alloc_size: 4096,
            offset: 1024,
            len: 2048,
            layout: Some(Layout::new(DType::F32, Shape::new([16, 32]).unwrap())),
            raw,
            fence: None,
            digest: HandleDigest::default(),
        }
    }

    fn key() -> HandleKey {
        HandleKey::derive(&SessionToken::from_bytes([1; 32]))
    }

    #[test]
    fn sealed_handle_checks() {
        let h = sample(RawHandle::HostSegment(
            SegmentName::new("/baton.x").unwrap(),
        ))
        .sealed(&key());
        h.check(&key()).unwrap();
        let other = HandleKey::derive(&SessionToken::from_bytes([2; 32]));
        assert!(matches!(h.verify(&other), Err(Error::DigestMismatch)));
    }

    #[test]
    fn every_single_byte_flip_of_a_cuda_handle_is_caught() {
        let h = sample(RawHandle::CudaIpc(CudaIpcMemHandle([0x5a; 64]))).sealed(&key());
        for i in 0..64 {
            let mut bad = h.clone();
            let RawHandle::CudaIpc(raw) = &mut bad.raw else {
                unreachable!()
            };
            raw.0[i] ^= 0x01;
            assert!(
                matches!(bad.verify(&key()), Err(Error::DigestMismatch)),
                "byte {i}"
            );
        }
    }

    #[test]
    fn validation_refuses_inconsistent_handles() {
        let seg = || RawHandle::HostSegment(SegmentName::new("/baton.x").unwrap());
        let mut h = sample(seg());
        h.offset = 4000;
        assert!(matches!(h.validate(), Err(Error::HandleOutOfBounds { .. })));
        let mut h = sample(seg());
        h.offset = u64::MAX;
        assert!(matches!(h.validate(), Err(Error::HandleOutOfBounds { .. })));
        let mut h = sample(seg());
        h.len = 1000;
        assert!(matches!(h.validate(), Err(Error::LayoutMismatch { .. })));
        let mut h = sample(seg());
        h.backend = BackendKind::CudaLegacy;
        assert!(matches!(h.validate(), Err(Error::BackendMismatch { .. })));
        let mut h = sample(seg());
        h.fence = Some(FenceHandle::Event(IpcEventHandle([0; 64])));
        assert!(matches!(h.validate(), Err(Error::BackendMismatch { .. })));
        let mut h = sample(seg());
        h.version = 9;
        assert!(matches!(
            h.validate(),
            Err(Error::UnsupportedVersion { .. })
        ));
    }

    #[test]
    fn a_memfd_handle_is_host_memory_with_a_sealed_slot() {
        let raw = RawHandle::HostMemfd { slot: Some(2) };
        assert_eq!(raw.backend(), BackendKind::Host);
        assert_eq!(raw.fd_slot(), Some(2));
        assert_eq!(raw.kind_name(), "host memfd");
        assert_eq!(format!("{raw:?}"), "HostMemfd { slot: Some(2) }");
        assert_eq!(RawHandle::HostMemfd { slot: None }.fd_slot(), None);
        let h = sample(raw).sealed(&key());
        h.check(&key()).unwrap();
        // The slot is sealed: a relay cannot point the importer at another descriptor.
        let mut moved = h.clone();
        moved.raw = RawHandle::HostMemfd { slot: Some(0) };
        assert!(matches!(moved.verify(&key()), Err(Error::DigestMismatch)));
        let mut cuda = sample(RawHandle::HostMemfd { slot: None });
        cuda.backend = BackendKind::CudaVmm;
        assert!(matches!(
            cuda.validate(),
            Err(Error::BackendMismatch { .. })
        ));
    }

    #[test]
    fn debug_never_prints_raw_bytes() {
        let h = sample(RawHandle::CudaIpc(CudaIpcMemHandle([0xee; 64])));
        let s = format!("{h:?}");
        assert!(
            !s.contains("238") && !s.to_lowercase().contains("ee, "),
            "{s}"
        );
        assert!(s.contains("redacted"));
        let s = format!("{:?}", SegmentName::new("/baton.secret").unwrap());
        assert!(!s.contains("secret"));
    }

    #[test]
    fn pool_handles_name_their_kind_and_slot_and_hide_their_bytes() {
        let raw = RawHandle::CudaPool {
            pool: 7,
            pool_slot: Some(2),
            ptr: CudaPoolExportData([0xee; 64]),
        };
        assert_eq!(raw.backend(), BackendKind::CudaPool);
        assert_eq!(raw.fd_slot(), Some(2));
        assert_eq!(raw.kind_name(), "CUDA pool pointer");
        let h = sample(raw).sealed(&key());
        h.check(&key()).unwrap();
        let s = format!("{h:?}");
        assert!(
            s.contains("pool: 7") && s.contains("pool_slot: Some(2)"),
            "{s}"
        );
        assert!(
            !s.contains("238") && !s.to_lowercase().contains("ee, "),
            "{s}"
        );
        let none = RawHandle::CudaPool {
            pool: 7,
            pool_slot: None,
            ptr: CudaPoolExportData([0; 64]),
        };
        assert_eq!(none.fd_slot(), None);
        // Each byte of the export data is sealed.
        for i in [0, 31, 63] {
            let mut bad = h.clone();
            let RawHandle::CudaPool { ptr, .. } = &mut bad.raw else {
                unreachable!()
            };
            ptr.0[i] ^= 1;
            assert!(matches!(bad.verify(&key()), Err(Error::DigestMismatch)));
        }
        let mut other_pool = h.clone();
        let RawHandle::CudaPool { pool, .. } = &mut other_pool.raw else {
            unreachable!()
        };
        *pool += 1;
        assert!(matches!(
            other_pool.verify(&key()),
            Err(Error::DigestMismatch)
        ));
    }

    #[test]
    fn segment_names_are_checked() {
        assert!(SegmentName::new("/ok.name-1_2").is_some());
        for bad in [
            "",
            "/",
            "noslash",
            "/a/b",
            "/..",
            "/sp ace",
            &format!("/{}", "a".repeat(201)),
        ] {
            assert!(SegmentName::new(bad).is_none(), "{bad:?}");
        }
    }
}
