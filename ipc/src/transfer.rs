//! The data plane between nodes on different hosts: a [`TransferEngine`] moves the bytes of
//! one buffer from a sender's memory into a receiver's, and each engine is one backend of
//! that concept ([`nccl`]: device memory over NCCL).
//!
//! Provisional: the coordinator replaces this file with helper e's (the trait, the TCP
//! engine). It holds exactly the trait and types of the issue 26 design note, so that the
//! NCCL engine compiles and is tested against them; the `mod nccl;` line is what stays.

use crate::{MemPtr, Result};
use baton_messages::{DeviceUuid, ProcessId};
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

pub mod nccl;

/// Where a transfer's bytes are: host memory or one device's memory.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    /// The first byte.
    pub ptr: MemPtr,
    /// How many bytes.
    pub len: usize,
    /// The device that holds them (`None`: host memory).
    pub device: Option<DeviceUuid>,
}

/// Names one transfer between two nodes (unique per sender node).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TransferId(pub u64);

/// A host, as the control plane names it (provisional: helper e's link defines it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostId(pub [u8; 32]);

/// The remote node of a transfer: who it is, and what an engine needs to reach it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EnginePeer {
    /// The remote node's process.
    pub process: ProcessId,
    /// The remote node's host.
    pub host: HostId,
}

/// Moves bytes between this node and nodes on other hosts. Blocking API; engines do their
/// own threading; the caller keeps the memory alive.
pub trait TransferEngine: Send + Sync + fmt::Debug {
    /// `"tcp"`, `"nccl"`.
    fn name(&self) -> &'static str;
    /// Whether regions may be device memory.
    fn moves_device_memory(&self) -> bool;
    /// Starts sending `src` to `peer`.
    ///
    /// # Errors
    /// The engine cannot start the transfer (typed by the engine).
    ///
    /// # Safety
    /// `src` stays valid and unchanged until the returned [`Transfer`] is done, failed or
    /// aborted (abort returns only once the engine no longer touches it).
    unsafe fn send(&self, peer: &EnginePeer, id: TransferId, src: Region) -> Result<Transfer>;
    /// Starts receiving `peer`'s transfer `id` into `dst`.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    ///
    /// # Safety
    /// `dst` stays valid and is not otherwise accessed until the returned [`Transfer`] is
    /// done, failed or aborted.
    unsafe fn recv(&self, peer: &EnginePeer, id: TransferId, dst: Region) -> Result<Transfer>;
    /// Fails and stops every transfer with `peer`; returns once none touches memory any more.
    fn abort_peer(&self, peer: &EnginePeer);
}

/// What an engine keeps of one transfer in flight, behind a [`Transfer`].
pub trait InFlight: Send + Sync + fmt::Debug {
    /// Waits until the transfer ends or `deadline` passes.
    ///
    /// # Errors
    /// The transfer failed, was aborted, or the deadline passed.
    fn wait(&self, deadline: Instant) -> Result<()>;
    /// Fails and stops the transfer; returns once the engine no longer touches its memory.
    fn abort(&self);
    /// Whether the transfer has ended (landed, failed or aborted).
    fn is_finished(&self) -> bool;
}

/// One transfer in flight.
#[derive(Debug, Clone)]
pub struct Transfer {
    inner: Arc<dyn InFlight>,
}

impl Transfer {
    /// Wraps an engine's transfer.
    pub fn new(inner: Arc<dyn InFlight>) -> Self {
        Self { inner }
    }

    /// `Ok(())` once the bytes landed.
    ///
    /// # Errors
    /// Typed by the engine: aborted, peer gone, timed out, corrupt.
    pub fn wait(&self, deadline: Instant) -> Result<()> {
        self.inner.wait(deadline)
    }

    /// Fails and stops the transfer; returns once the engine no longer touches its memory.
    pub fn abort(&self) {
        self.inner.abort()
    }

    /// Whether the transfer has ended.
    pub fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }
}
