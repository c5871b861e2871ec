//! Raw handles: what each backend puts in a handle for another process to map its
//! memory — a segment name, 64 opaque CUDA bytes, or the slot of a file descriptor sent
//! beside the frame — and [`BackendKind`], which backend made a buffer.
//!
//! Raw handles are capabilities: `Debug` never prints their bytes. They are plain data,
//! sealed (with everything else a handle says) by [`HandleMsg`](crate::HandleMsg)'s digest.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

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
/// Cloning it (once per offer of the segment) counts a reference, not a copy.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SegmentName(Arc<str>);

/// From a string, checked (as `try_from = "String"` would, without the `String` when the
/// decoder lends the bytes: one allocation, the name's own).
impl<'de> Deserialize<'de> for SegmentName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Name;
        impl serde::de::Visitor<'_> for Name {
            type Value = SegmentName;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a shared-memory segment name")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<SegmentName, E> {
                SegmentName::new(v).ok_or_else(|| E::custom("invalid shared-memory segment name"))
            }
        }
        d.deserialize_str(Name)
    }
}

/// As a string (what `into = "String"` wrote, without the copy).
impl Serialize for SegmentName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl SegmentName {
    /// Longest name accepted, leading `/` excluded.
    pub const MAX_LEN: usize = 200;

    /// Checks and wraps a name.
    pub fn new(name: impl AsRef<str>) -> Option<Self> {
        let name = name.as_ref();
        let rest = name.strip_prefix('/')?;
        let ok = !rest.is_empty()
            && rest.len() <= Self::MAX_LEN
            && rest != "."
            && rest != ".."
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        ok.then(|| Self(Arc::from(name)))
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
    fn try_from(s: String) -> Result<Self, String> {
        SegmentName::new(s).ok_or_else(|| "invalid shared-memory segment name".to_owned())
    }
}

impl From<SegmentName> for String {
    fn from(s: SegmentName) -> String {
        s.0.as_ref().to_owned()
    }
}

macro_rules! secret_bytes64 {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub struct $name(#[serde(with = "crate::byte_array")] pub [u8; 64]);

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
    /// Across hosts: nothing to map. The exporter's transfer engine sends the buffer's
    /// bytes as the transfer named by the offer's lease, and the importer receives them
    /// into memory of its own (see `docs/CROSS_HOST.md`). Valid only on a host link.
    Copy {
        /// The engine that carries the bytes.
        engine: CopyEngine,
    },
}

/// The transfer engine that carries a [`RawHandle::Copy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[non_exhaustive]
pub enum CopyEngine {
    /// The TCP engine: host memory, over the nodes' own authenticated data connections.
    Tcp,
    /// The NCCL engine: device memory, over NCCL point-to-point. The exporter sends only
    /// once the importer asks with a [`Pull`](crate::protocol::Pull) (its receive is
    /// posted), so that both start their operations in the same order.
    Nccl,
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
            RawHandle::Copy { .. } => "copy",
        }
    }

    /// The backend that makes raw handles of this kind (`None` for a
    /// [`Copy`](RawHandle::Copy), which any backend's memory makes).
    pub fn backend(&self) -> Option<BackendKind> {
        match self {
            RawHandle::HostSegment(_) => Some(BackendKind::Host),
            RawHandle::CudaIpc(_) => Some(BackendKind::CudaLegacy),
            RawHandle::CudaVmmFd { .. } => Some(BackendKind::CudaVmm),
            RawHandle::CudaPool { .. } => Some(BackendKind::CudaPool),
            RawHandle::HostMemfd { .. } => Some(BackendKind::Host),
            RawHandle::Copy { .. } => None,
        }
    }

    /// Whether a handle of `backend` may carry this raw handle.
    pub fn fits(&self, backend: BackendKind) -> bool {
        self.backend().is_none_or(|b| b == backend)
    }

    /// Where the descriptor this handle needs sits among its frame's descriptors: `None`
    /// for handles that carry no descriptor, or whose descriptor the importer already has.
    pub fn fd_slot(&self) -> Option<u8> {
        match self {
            RawHandle::CudaVmmFd { slot } | RawHandle::HostMemfd { slot } => *slot,
            RawHandle::CudaPool { pool_slot, .. } => *pool_slot,
            RawHandle::HostSegment(_) | RawHandle::CudaIpc(_) | RawHandle::Copy { .. } => None,
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn segment_name() -> impl Strategy<Value = SegmentName> {
        "/[A-Za-z0-9._-]{1,40}".prop_filter_map("dot names", SegmentName::new)
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

    #[test]
    fn a_decoded_segment_name_is_checked_as_a_made_one() {
        let config = bincode::config::standard();
        let good = SegmentName::new("/baton.1-2_3").unwrap();
        let bytes = bincode::serde::encode_to_vec(&good, config).unwrap();
        let (back, _): (SegmentName, usize) =
            bincode::serde::decode_from_slice(&bytes, config).unwrap();
        assert_eq!(back, good);
        assert_eq!(back.as_str(), "/baton.1-2_3");
        for bad in ["noslash", "/a/b", "/..", "/"] {
            let bytes = bincode::serde::encode_to_vec(bad, config).unwrap();
            let e = bincode::serde::decode_from_slice::<SegmentName, _>(&bytes, config);
            assert!(e.is_err(), "{bad:?} decoded");
        }
        // A clone shares the name: what an offer of the segment copies.
        let clone = good.clone();
        assert!(std::ptr::eq(clone.as_str(), good.as_str()));
    }
}
