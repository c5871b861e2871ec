//! The NCCL calls the engine makes, as a trait: [`Nccl`] is implemented by the library
//! loaded at run time (`super::library`) and, in tests, by a fake that records calls and
//! can hold a transfer forever or raise an asynchronous error.

use crate::transfer::Region;
use crate::{Error, MemPtr, Result};
use std::fmt;

/// The device address of `region`: NCCL moves device memory only.
///
/// # Errors
/// [`Error::RegionUnsupported`] for host memory.
pub fn device_addr(region: &Region) -> Result<u64> {
    match region.ptr {
        MemPtr::Device(addr) => Ok(addr),
        MemPtr::Host(_) => Err(Error::RegionUnsupported {
            engine: "nccl",
            reason: "NCCL moves device memory; use the TCP engine for host memory",
        }),
    }
}

/// A rank in a 2-rank communicator: 0 (the lower identity) or 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank(pub u8);

impl Rank {
    /// The other rank of the pair.
    pub fn other(self) -> Rank {
        Rank(1 - self.0)
    }
}

/// `ncclUniqueId`: the 128 opaque bytes one side makes (`ncclGetUniqueId`) and both pass
/// to their init. It names the maker's bootstrap socket: carry it only over an
/// authenticated control plane.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never logged: it is the way into the maker's bootstrap.
        f.write_str("UniqueId(..)")
    }
}

/// A communicator the implementation made (`ncclComm_t`, or a fake's number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommHandle(pub usize);

/// A send or receive the implementation launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpHandle(pub u64);

/// Where an asynchronous thing is.
#[derive(Debug)]
pub enum Progress {
    /// Still going (`ncclInProgress`, an event not yet reached).
    Pending,
    /// Completed.
    Done,
    /// Failed; the communicator must be aborted.
    Failed(Error),
}

/// The NCCL calls of the engine. Every call returns at once (communicators are made
/// non-blocking): waits are the engine's polls.
pub trait Nccl: Send + Sync + fmt::Debug {
    /// `ncclGetUniqueId`.
    ///
    /// # Errors
    /// [`Error::Nccl`](crate::Error::Nccl).
    fn unique_id(&self) -> Result<UniqueId>;
    /// `ncclCommInitRankConfig` for 2 ranks, non-blocking: returns a communicator whose
    /// init goes on; [`comm_progress`](Self::comm_progress) says when it is ready.
    ///
    /// # Errors
    /// [`Error::Nccl`](crate::Error::Nccl).
    fn init(&self, uid: &UniqueId, rank: Rank) -> Result<CommHandle>;
    /// `ncclCommGetAsyncError`: whether the init (or an enqueue) is in progress, done, or
    /// the communicator failed.
    fn comm_progress(&self, comm: CommHandle) -> Progress;
    /// `ncclSend` of `src` to the other rank, on the communicator's stream.
    ///
    /// # Errors
    /// [`Error::Nccl`](crate::Error::Nccl); the communicator must then be aborted.
    ///
    /// # Safety
    /// `src` is device memory that stays valid until the operation is done or its
    /// communicator aborted.
    unsafe fn send(&self, comm: CommHandle, src: Region, to: Rank) -> Result<OpHandle>;
    /// `ncclRecv` into `dst` from the other rank, on the communicator's stream.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    ///
    /// # Safety
    /// As [`send`](Self::send), for `dst`.
    unsafe fn recv(&self, comm: CommHandle, dst: Region, from: Rank) -> Result<OpHandle>;
    /// Whether the operation completed on the device.
    fn op_progress(&self, op: OpHandle) -> Progress;
    /// Forgets an operation (done, or its communicator aborted).
    fn release_op(&self, op: OpHandle);
    /// `ncclCommAbort`: stops the communicator's operations and frees it. Returns once
    /// its kernels no longer run, so no memory of its operations is touched after.
    /// Never `ncclCommDestroy` on a communicator that may be stuck: that waits for it.
    fn abort(&self, comm: CommHandle);
}
