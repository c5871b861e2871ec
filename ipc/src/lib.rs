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
//! - [`ring`]: a shared-memory frame ring per link direction with an adaptive doorbell
//!   (issue 48), which an [`AsyncLink`] uses where [`LinkConfig::with_ring`] asks for it.
//! - [`tcp`]: host links, the same frames between hosts over TCP with Noise.
//! - [`transfer`]: engines that move memory between hosts ([`TransferEngine`]).
//! - [`process`]: process identity and liveness that survive pid reuse.
//! - [`spawn`]: children that die with this process; [`handoff`]: how a child gets the
//!   session token (through a pipe, never its environment).
//!
//! # Layers
//!
//! Each module holds one concept and uses only the modules below it, so none is part of
//! an import cycle. `lib.rs` declares them bottom first, and the workspace's
//! `tests/layers.rs` fails on any use of a module declared later (and on files of one
//! module that use each other around a cycle):
//!
//! 1. fence bookkeeping without I/O, which the CUDA backend drives: `bridge` (waits on
//!    another process's event that this process can still release alone), [`inbox`]
//!    (the consumer's side of counter fences, whose refusals [`Error`] carries);
//! 2. foundations: `error` ([`Error`]), [`process`] (identity and liveness), [`ordering`]
//!    (the vocabulary of cross-process stream ordering: streams, fences, use marks),
//!    `driver_thread` ([`DriverThread`]);
//! 3. the deployment: [`handoff`] (the session token's way to a child process), `session`
//!    ([`Session`]: the token, its keys, the handle check), [`spawn`] (children that die
//!    with this process);
//! 4. the transport: [`ring`] (same-host frames through shared memory, an eventfd
//!    doorbell; uses nothing of the crate), [`link`] (sockets, handshake, frames with
//!    descriptors; an [`AsyncLink`] may carry its frames through a ring), [`tcp`] (host links: TCP with Noise, the same frames without descriptors);
//! 5. memory: `backend` (the [`Backend`] trait, [`Allocation`], [`OpenedMem`]), [`host`]
//!    (the backend every generic test can run on), `cache` ([`ImportCache`],
//!    [`Imported`]: any backend's mappings), [`cuda`] (after the cache, which its GPU tests
//!    open through), [`select`] (which backend, at run time), [`slab`] ([`SlabArena`]);
//! 6. moving bytes between hosts: [`transfer`] (the [`TransferEngine`] trait, its TCP
//!    engine for host memory and [`transfer::nccl`] for device memory over NCCL);
//! 7. `fuzzing`: the logic of the fuzz targets (hidden; not a stable API).
//!
//! No edge points up: [`Error::Cuda`]'s `CudaError` is defined under `error` (the CUDA
//! backend re-exports it), and the downcast from a `dyn Backend` to the CUDA backend lives
//! beside `CudaBackend`, not in the trait.
//!
//! This crate knows nothing of actors. `unsafe` code lives only in backend modules, in
//! [`spawn`] (`pre_exec` hooks), [`ring`] (the ring's shared mapping, reached through
//! atomics and raw copies), [`transfer`] (an engine's threads reading and writing a
//! transfer's memory; NCCL loaded and called through FFI) and [`handoff`] (a `pre_exec`
//! hook, the inherited token descriptor), and in one block of the import cache
//! ([`Imported::host_bytes_mut`], the only caller that can keep the contract of
//! `RawMemory::host_bytes_mut`), each opening with a `# Safety` overview.

#![deny(unsafe_code)]

// The modules, bottom layer first: each uses only the modules declared above it (see
// "Layers" in the crate docs). One comment line per module keeps rustfmt from sorting
// them.

/// Marks a stage of a handoff ([`probe`]); expands to nothing without `stage-probes`.
macro_rules! probe {
    ($stage:expr) => {
        #[cfg(feature = "stage-probes")]
        $crate::probe::mark($stage);
    };
    ($stage:expr, $kind:expr) => {
        #[cfg(feature = "stage-probes")]
        $crate::probe::mark_kind($stage, $kind);
    };
}

// 0. Timestamps of a handoff's stages, for the benchmark (feature `stage-probes`).
#[cfg(feature = "stage-probes")]
pub mod probe;

// 1. Fence bookkeeping without I/O.
// Waits on another process's event, releasable alone.
mod bridge;
// The consumer's side of counter fences.
pub mod inbox;

// 2. Foundations.
// The crate's error type.
mod error;
// Process identity and liveness.
pub mod process;
// The vocabulary of stream ordering across processes.
pub mod ordering;
// Where blocking driver calls run.
mod driver_thread;

// 3. The deployment.
// The session token's way to a child process.
#[allow(unsafe_code)]
pub mod handoff;
// The session: token, keys, handle check.
mod session;
// Children that die with this process.
#[allow(unsafe_code)]
pub mod spawn;

// 4. The transport.
// Who a peer is across hosts (host id, node key), below both transports.
mod identity;
// Same-host frames through a shared-memory ring (below the link, which carries it).
#[allow(unsafe_code)]
pub mod ring;
// Framed, authenticated links.
pub mod link;
// Host links: TCP with Noise, across hosts.
pub mod tcp;

// 5. Memory.
// The backend trait, allocations and mappings.
mod backend;
// Host memory.
#[allow(unsafe_code)]
pub mod host;
// The import cache.
mod cache;
// Device memory.
#[allow(unsafe_code)]
pub mod cuda;
// Choosing a backend at run time.
pub mod select;
// Slabs of many buffers.
pub mod slab;

// 6. Moving bytes between hosts.
// Transfer engines: the trait, the TCP and NCCL engines.
#[allow(unsafe_code)]
pub mod transfer;

// 7. The fuzz targets' logic (the `fuzzing` feature: fuzz/ and the corpus replay).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;

pub use backend::{
    Allocation, AsAny, Backend, DescriptorScope, ExportableMemory, FreeWhileMapped, HandleBuilder,
    InPlace, MemPtr, OpenedMem, RawMemory, SharedBackend, next_allocation_id,
};
pub use cache::{
    CacheKey, CacheStats, Evictor, Executor, HolderId, ImportCache, Imported, OnClosed, WarmBudget,
};
pub use cuda::CudaBackend;
pub use driver_thread::DriverThread;
pub use error::{Error, Fault, Result};
pub use handoff::TOKEN_ENV;
pub use host::{HostBackend, HostFlavor};
pub use link::{
    AsyncLink, FrameFds, Link, LinkCloser, LinkConfig, LinkReader, LinkWriter, Listener, PeerCred,
    PeerInfo, PeerPolicy, Received, SocketDir, Via,
};
pub use ordering::{
    ExportedFence, FenceFaultHook, NoOrdering, Stream, StreamKey, StreamOrdering, StreamRef,
    UseMark,
};
pub use session::{CheckedHandle, Session, random_bytes};
pub use slab::{SlabArena, SlabBuffer};
pub use transfer::{EnginePeer, Region, Transfer, TransferEngine, TransferId};

pub use baton_messages as messages;
