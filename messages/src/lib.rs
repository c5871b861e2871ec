//! Baton's wire vocabulary.
//!
//! Everything two Baton processes say to each other is defined here, as plain data:
//!
//! - [`ids`]: newtype identifiers ([`AllocationId`], [`Generation`], [`LeaseId`],
//!   [`DeviceUuid`], [`ExporterId`], …) so that a lease id can never be passed where an
//!   allocation id is expected;
//! - [`layout`]: element types and shapes of typed buffers, and the layouts of bundles
//!   (many named tensors in one buffer);
//! - [`handle`]: [`HandleMsg`], the serialized capability that lets another process map a
//!   buffer, sealed with a keyed digest so that a corrupted or forged handle is refused
//!   before any driver call;
//! - [`fence`]: [`FenceHandle`], what orders GPU work across processes (acquire fences in
//!   handles, release fences in `Release`);
//! - [`protocol`]: the [`Message`]s of the link and lease protocol;
//! - [`status`]: [`NodeStatus`](status::NodeStatus), what a node tells an authenticated
//!   peer about its buffers, leases, cache, links and children;
//! - [`codec`]: length-prefixed frames with a hard size limit, decoded with bincode under a
//!   byte limit, so that arbitrary input can never panic or allocate without bound.
//!
//! This crate knows nothing of CUDA, sockets or actors, and has no `unsafe` code.

#![forbid(unsafe_code)]

pub mod codec;
mod error;
pub mod fence;
#[doc(hidden)]
pub mod fuzzing;
pub mod handle;
pub mod ids;
pub mod layout;
pub mod protocol;
mod serde_bytes64;
pub mod status;

pub use codec::{FrameDecoder, FrameHeader, MAX_FDS_PER_FRAME, MAX_FRAME_LEN};
pub use error::Error;
pub use fence::{CounterFence, FenceHandle, FenceKind, InboxGrant};
pub use handle::{
    BackendKind, CudaIpcMemHandle, CudaPoolExportData, HandleDigest, HandleKey, HandleMsg,
    IpcEventHandle, RawHandle, SegmentName,
};
pub use ids::{
    ActorId, AllocationId, BootId, DeviceUuid, ExporterId, Generation, LeaseId, ProcessId,
    SessionToken,
};
pub use layout::{BundleLayout, DType, Layout, LayoutError, Shape, TensorSpec};
pub use protocol::Message;

/// The protocol version this build speaks. Every frame header carries it, so a peer
/// speaking another version is refused before its payload is decoded.
pub const PROTOCOL_VERSION: u8 = 2;

/// Result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
