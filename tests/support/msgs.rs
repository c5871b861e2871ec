//! Message types shared by the actor tests and their helper process
//! (`test-peers/src/bin/baton-actor-peer.rs` includes this file too).

#![allow(dead_code)]

use actix::Message;
use baton::actors::{RemoteMessage, Shared, SharedMut};
use serde::{Deserialize, Serialize};

/// The value at index `i` of a pattern buffer.
pub fn pattern(seed: u32, i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed)
}

/// Two buffers to check; the checker answers with a buffer of its own.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "PairChecked")]
pub struct CheckPair {
    pub seed: u32,
    pub a: Shared<u32>,
    pub b: Shared<f32>,
}

impl RemoteMessage for CheckPair {
    const NAME: &'static str = "test.CheckPair";
}

/// `sum[i] = a[i] as f32 + b[i]`, in a buffer the checker owns.
#[derive(Debug, Serialize, Deserialize)]
pub struct PairChecked {
    pub ok: bool,
    pub sum: Shared<f32>,
}

/// Open the (writable) buffer, check that it holds `pattern(expect, _)`, write
/// `pattern(write, _)` over it (a host copy through the helper's own backend), and give the
/// lease back.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Overwritten")]
pub struct Overwrite {
    pub buf: SharedMut<u32>,
    pub expect: u32,
    pub write: u32,
}

impl RemoteMessage for Overwrite {
    const NAME: &'static str = "test.Overwrite";
}

/// The answer to [`Overwrite`].
#[derive(Debug, Serialize, Deserialize)]
pub struct Overwritten {
    /// How many elements did not hold the expected pattern (0: the read was exact).
    pub wrong: u64,
    /// The helper's CUDA device ordinal (`None` on host memory).
    pub ordinal: Option<u32>,
    /// The device the helper's backend allocates on.
    pub device: baton::messages::DeviceUuid,
}

/// Keep these leases until told otherwise.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
pub struct Hold {
    pub buffers: Vec<Shared<u32>>,
}

impl RemoteMessage for Hold {
    const NAME: &'static str = "test.Hold";
}

/// Read the first element of every held lease (errors count as `u32::MAX`).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Vec<u32>")]
pub struct PeekHeld;

impl RemoteMessage for PeekHeld {
    const NAME: &'static str = "test.PeekHeld";
}

/// Drop every held lease; answers how many.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
pub struct DropHeld;

impl RemoteMessage for DropHeld {
    const NAME: &'static str = "test.DropHeld";
}

/// Open `buffers`, each waited on the backend's own stream (a use, as Python's leases
/// opened without a stream make), and give them back at once: dropped one by one
/// (`synchronized: false`), or with `AnyLease::release_synchronized`. Answers how many.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
pub struct UseAndRelease {
    pub buffers: Vec<Shared<u32>>,
    pub synchronized: bool,
}

impl RemoteMessage for UseAndRelease {
    const NAME: &'static str = "test.UseAndRelease";
}

/// Make `n` buffers of `len` pattern values and share them back.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Made")]
pub struct MakeBuffers {
    pub n: u32,
    pub len: u32,
    pub seed: u32,
}

impl RemoteMessage for MakeBuffers {
    const NAME: &'static str = "test.MakeBuffers";
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Made {
    pub buffers: Vec<Shared<u32>>,
}

/// Sum every element of every buffer, then drop them.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "u64")]
pub struct Sum {
    pub buffers: Vec<Shared<u32>>,
}

impl RemoteMessage for Sum {
    const NAME: &'static str = "test.Sum";
}

/// Revoke every lease out on the helper's own buffers, with this deadline; answers how
/// many leases were asked back.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
pub struct RevokeAll {
    pub within_ms: u32,
}

impl RemoteMessage for RevokeAll {
    const NAME: &'static str = "test.RevokeAll";
}

/// Sleep `ms`, then make `n` buffers of `len` pattern values and share them back (a reply
/// that can come after its caller gave up).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Made")]
pub struct MakeBuffersLate {
    pub ms: u32,
    pub n: u32,
    pub len: u32,
    pub seed: u32,
}

impl RemoteMessage for MakeBuffersLate {
    const NAME: &'static str = "test.MakeBuffersLate";
}

/// Share the helper's lent buffer number `index` (allocated and filled with
/// `pattern(seed, _)` on the first call for that index, the same buffer every time after).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Made")]
pub struct Lend {
    pub index: u32,
    pub len: u32,
    pub seed: u32,
}

impl RemoteMessage for Lend {
    const NAME: &'static str = "test.Lend";
}

/// Sleep `ms`, then answer `reply_bytes` bytes (a slow handler with a sizeable reply).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Vec<u8>")]
pub struct Nap {
    pub ms: u32,
    pub reply_bytes: u32,
}

impl RemoteMessage for Nap {
    const NAME: &'static str = "test.Nap";
}

/// Bytes to swallow; answers how many arrived.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
pub struct Blob {
    pub data: Vec<u8>,
}

impl RemoteMessage for Blob {
    const NAME: &'static str = "test.Blob";
}

/// Lower this process's open-file limit so that only `spare` more descriptors can be
/// opened: those the kernel would hand it beyond that (a memfd over `SCM_RIGHTS`, a
/// segment's `shm_open`) fail. Answers the new limit.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "u64")]
pub struct LimitFds {
    pub spare: u64,
}

impl RemoteMessage for LimitFds {
    const NAME: &'static str = "test.LimitFds";
}
