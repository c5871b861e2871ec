//! Baton's memory and transport mechanics.
//!
//! - [`Backend`]: make, share and map memory. Two real implementations: [`host`] (sealed
//!   `memfd`s shared by descriptor on Linux, named POSIX shared memory elsewhere or on
//!   request) and [`cuda`] (device memory: legacy IPC handles, VMM file descriptors or
//!   stream-ordered pool memory, with fences; always built, used when a driver and a GPU
//!   are present),
//!   picked at run time by [`select::auto`].
//! - [`SlabArena`]: many buffers carved from one exported allocation, so an importer maps
//!   the slab once.
//! - [`Allocation`] owns exported memory (and its free); [`OpenedMem`] owns an imported
//!   mapping (and its close); [`ImportCache`] maps each allocation once per process and
//!   hands out [`Imported`] views.
//! - [`StreamOrdering`] ([`ordering`]): fences that order GPU work across processes, both
//!   ways (acquire fences in offers, release fences in `Release`), on the streams that use
//!   the buffers. A second trait beside [`Backend`], implemented only by backends with
//!   queued work (CUDA) and reached with [`Backend::ordering`] ([`NoOrdering`] for host).
//! - [`DriverThread`]: where blocking driver calls run for threads that must not block.
//! - [`Session`]: the deployment's token, which authenticates links and seals handles.
//! - [`link`]: framed, authenticated Unix-socket links with descriptors out of band.
//! - [`process`]: process identity and liveness that survive pid reuse.
//! - [`spawn`]: children that die with this process and get the token through a pipe,
//!   never their environment.
//!
//! This crate knows nothing of actors. `unsafe` code lives only in backend modules, in
//! [`spawn`] (`pre_exec` hooks, the inherited token descriptor), and in one block of the
//! import cache ([`Imported::host_bytes_mut`], the only caller that can keep the contract
//! of `RawMemory::host_bytes_mut`), each opening with a `# Safety` overview.

#![deny(unsafe_code)]

mod backend;
mod bridge;
mod cache;
#[allow(unsafe_code)]
pub mod cuda;
mod driver_thread;
mod error;
#[doc(hidden)]
pub mod fuzzing;
#[allow(unsafe_code)]
pub mod host;
pub mod inbox;
pub mod link;
pub mod ordering;
pub mod process;
pub mod select;
mod session;
pub mod slab;
#[allow(unsafe_code)]
pub mod spawn;

pub use backend::{
    Allocation, AsAny, Backend, DescriptorScope, ExportableMemory, FreeWhileMapped, HandleBuilder,
    InPlace, MemPtr, OpenedMem, RawMemory, SharedBackend,
};
pub use cache::{
    CacheKey, CacheStats, Evictor, Executor, HolderId, ImportCache, Imported, OnClosed, WarmBudget,
};
pub use cuda::CudaBackend;
pub use driver_thread::DriverThread;
pub use error::{Error, Result};
pub use host::{HostBackend, HostFlavor};
pub use link::{
    AsyncLink, FrameFds, Link, LinkCloser, LinkConfig, LinkReader, LinkWriter, Listener, PeerCred,
    PeerInfo, PeerPolicy, Received, SocketDir,
};
pub use ordering::{
    ExportedFence, FenceFaultHook, NoOrdering, Stream, StreamKey, StreamOrdering, StreamRef,
    UseMark,
};
pub use session::{CheckedHandle, Session, TOKEN_ENV, random_bytes};
pub use slab::{SlabArena, SlabBuffer};

pub use baton_messages as messages;
