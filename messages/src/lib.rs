//! Baton's wire vocabulary.
//!
//! Everything two Baton processes say to each other is defined here, as plain data.
//!
//! # Layers
//!
//! Each module holds one concept and uses only the modules below it, so none is part of
//! an import cycle. `lib.rs` declares them bottom first, and the workspace's
//! `tests/layers.rs` fails on any use of a module declared later (and on files of one
//! module that use each other around a cycle):
//!
//! 1. `byte_array`: serde for the byte arrays of ids, digests and raw handles (a byte
//!    string on the wire, read in one copy);
//! 2. [`ids`]: newtype identifiers ([`AllocationId`], [`Generation`], [`LeaseId`],
//!    [`DeviceUuid`], [`ExporterId`], …) so that a lease id can never be passed where an
//!    allocation id is expected, and the [`SessionToken`];
//! 3. [`layout`]: element types and shapes of typed buffers, and the layouts of bundles
//!    (many named tensors in one buffer);
//! 4. [`sync`]: versioned syncs of bundles — the [`SyncStamp`] on each part, the
//!    [`SyncCancel`] a sender sends, what a receiver refuses ([`VersionFault`]);
//! 5. `raw`: what each backend puts in a handle ([`RawHandle`]: a segment name, 64 CUDA
//!    bytes or a descriptor's slot) and which backend made a buffer ([`BackendKind`]);
//!    re-exported from [`handle`], where they were first defined;
//! 6. `error`: [`Error`], everything that can be wrong with what a peer sent;
//! 7. [`fence`]: [`FenceHandle`], what orders GPU work across processes (acquire fences
//!    in handles, release fences in `Release`);
//! 8. [`handle`]: [`HandleMsg`], the serialized capability that lets another process map
//!    a buffer, sealed with a keyed digest (whose encoding is the seal's own: see "The
//!    seal" there) so that a corrupted or forged handle is refused before any driver
//!    call;
//! 9. [`protocol`]: the [`Message`]s of the link and lease protocol;
//! 10. `hot`: a hand-written decoder of a handoff's messages (a call, a reply, a
//!     release), which returns exactly what serde would, or nothing (then serde decodes);
//! 11. [`codec`]: length-prefixed frames of messages with a hard size limit, decoded with
//!     bincode under a byte limit, so that arbitrary input can never panic or allocate
//!     without bound;
//! 12. [`status`]: [`NodeStatus`](status::NodeStatus), what a node tells an
//!     authenticated peer about its buffers, leases, cache, links and children (the JSON
//!     body of a `Status` message);
//! 13. `fuzzing`: the logic of the fuzz targets (hidden; not a stable API).
//!
//! This crate knows nothing of CUDA, sockets or actors, and has no `unsafe` code.

#![forbid(unsafe_code)]

// The modules, bottom layer first: each uses only the modules declared above it (see
// "Layers" in the crate docs). One comment line per module keeps rustfmt from sorting
// them.

// Serde for byte arrays.
mod byte_array;
// Identifiers.
pub mod ids;
// Element types, shapes, bundle layouts.
pub mod layout;
// Versioned syncs of bundles: stamps, cancels, refusals.
pub mod sync;
// Raw handles and backend kinds.
mod raw;
// What can be wrong with what a peer sent.
mod error;
// Fences as they travel.
pub mod fence;
// Handle messages and their seal.
pub mod handle;
// The messages of the protocol.
pub mod protocol;
// A hand-written decoder of a handoff's messages.
mod hot;
// Frames.
pub mod codec;
// Node status.
pub mod status;
// The fuzz targets' logic (the `fuzzing` feature: fuzz/ and the corpus replay).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;

pub use codec::{FrameDecoder, FrameHeader, MAX_FDS_PER_FRAME, MAX_FRAME_LEN};
pub use error::Error;
pub use fence::{CounterFence, FenceHandle, FenceKind, InboxGrant};
pub use handle::{HandleDigest, HandleKey, HandleMsg, SealPrefix};
pub use ids::{
    ActorId, AllocationId, BootId, DeviceUuid, ExporterId, Generation, LeaseId, ProcessId,
    SessionToken,
};
pub use layout::{BundleLayout, DType, Layout, LayoutError, Shape, TensorSpec};
pub use protocol::Message;
pub use raw::{
    BackendKind, CopyEngine, CudaIpcMemHandle, CudaPoolExportData, IpcEventHandle, RawHandle,
    SegmentName,
};
pub use sync::{SyncCancel, SyncStamp, VersionFault};

/// The protocol version this build speaks. Every frame header carries it, so a peer
/// speaking another version is refused before its payload is decoded.
pub const PROTOCOL_VERSION: u8 = 4;

/// Result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
