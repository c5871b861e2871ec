//! Messages shared by `tests/api.rs` and its helper process
//! (`test-peers/src/bin/baton-api-peer.rs` includes this file too).

#![allow(dead_code)]

use actix::Message;
use baton::actors::{RemoteMessage, Shared, SharedBundle, SharedMut};
use serde::{Deserialize, Serialize};

/// Sum the buffer in place (`Lease::as_slice`). Answers the sum and whether the slice
/// starts where the lease is mapped (zero copies).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<(f64, bool), String>")]
pub struct SumInPlace {
    pub data: Shared<f32>,
}

impl RemoteMessage for SumInPlace {
    const NAME: &'static str = "api.SumInPlace";
}

/// Keep the lease until `GiveBack`. Answers how many leases are kept.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
pub struct Keep {
    pub data: Shared<u32>,
}

impl RemoteMessage for Keep {
    const NAME: &'static str = "api.Keep";
}

/// Drop every kept lease. Answers how many were dropped.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
pub struct GiveBack;

impl RemoteMessage for GiveBack {
    const NAME: &'static str = "api.GiveBack";
}

/// Keep the lease until its exporter revokes it: the holding actor awaits
/// `Lease::revoked` itself (no node-level revoke subscription), then drops it.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "()")]
pub struct KeepUntilRevoked {
    pub data: Shared<u32>,
}

impl RemoteMessage for KeepUntilRevoked {
    const NAME: &'static str = "api.KeepUntilRevoked";
}

/// Keep every lease until the exporter revokes the first one (sent as one lease over them
/// all: a revoke of any asks for them all), then drop them all.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "()")]
pub struct KeepAllUntilRevoked {
    pub data: Vec<Shared<u32>>,
}

impl RemoteMessage for KeepAllUntilRevoked {
    const NAME: &'static str = "api.KeepAllUntilRevoked";
}

/// Answers, for each revoke the holding actor handled, how many milliseconds it had left
/// before the deadline when it learned of it.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Vec<u64>")]
pub struct Revocations;

impl RemoteMessage for Revocations {
    const NAME: &'static str = "api.Revocations";
}

/// Write `value` into every element of a writable lease.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<(), String>")]
pub struct Fill {
    pub data: SharedMut<u32>,
    pub value: u32,
}

impl RemoteMessage for Fill {
    const NAME: &'static str = "api.Fill";
}

/// Answers the child's backend name and kind (`{:?}`).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "(String, String)")]
pub struct WhichBackend;

impl RemoteMessage for WhichBackend {
    const NAME: &'static str = "api.WhichBackend";
}

/// Open the bundle and read every tensor: `f32` ones in place (`BundleLease::tensor`),
/// `i64` ones copied out (`BundleLease::read`). Answers each tensor's sum, in layout
/// order, and how many allocations the helper's import cache has opened so far.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<(Vec<f64>, u64), String>")]
pub struct SumBundle {
    pub weights: SharedBundle,
}

impl RemoteMessage for SumBundle {
    const NAME: &'static str = "api.SumBundle";
}

/// What a forging peer can send under `SumBundle`'s name: any list of tensor specs
/// beside a buffer (the same wire form, unchecked).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<(Vec<f64>, u64), String>")]
pub struct ForgedBundle {
    #[serde(rename = "baton.bundle")]
    pub layout: Vec<baton::messages::TensorSpec>,
    pub buffer: Shared<u8>,
}

impl RemoteMessage for ForgedBundle {
    const NAME: &'static str = "api.SumBundle";
}
