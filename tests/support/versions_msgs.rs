//! Messages shared by `tests/versions.rs` and its helper process
//! (`test-peers/src/bin/baton-sync-peer.rs` includes this file too), and the contents every
//! part of a version has.

#![allow(dead_code)]

use actix::Message;
use baton::actors::{RemoteMessage, SharedBundle};
use serde::{Deserialize, Serialize};

/// One part of a versioned sync. Answers the receiver's version after it, or why the part
/// was refused.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct SyncPart {
    pub part: SharedBundle,
}

impl RemoteMessage for SyncPart {
    const NAME: &'static str = "versions.SyncPart";
}

/// Elements of the one tensor (`"w"`, `u64`) of each part.
pub const ELEMENTS: usize = 2048;

/// What every element of part `part` of version `version` holds: a receiver whose parts
/// do not all hold their version's value has a mix.
pub fn value(version: u64, part: u32) -> u64 {
    (version << 16) | u64::from(part)
}

/// The receivers' names in the test process.
pub const RECEIVERS: [&str; 2] = ["versions.a", "versions.b"];
