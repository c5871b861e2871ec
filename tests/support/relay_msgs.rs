//! Message types of the forwarding tests and their helper process
//! (`test-peers/src/bin/baton-relay-peer.rs` includes this file too).

#![allow(dead_code)]

use actix::Message;
use baton::actors::{RemoteMessage, Shared};
use serde::{Deserialize, Serialize};

/// Keep these leases, and forward each to the linked process whose pid is `to_pid`.
/// Answers the lease ids the holder sees, or why forwarding failed.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<Vec<u64>, String>")]
pub struct ForwardTo {
    pub buffers: Vec<Shared<u32>>,
    pub to_pid: u32,
}

impl RemoteMessage for ForwardTo {
    const NAME: &'static str = "relay.ForwardTo";
}

/// Drop the leases kept; answers how many there were.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
pub struct DropOwn;

impl RemoteMessage for DropOwn {
    const NAME: &'static str = "relay.DropOwn";
}
