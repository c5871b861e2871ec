//! Messages and kernels shared by the GPU ordering tests (`tests/ordering_cuda.rs`) and
//! their helper process (`test-peers/src/bin/baton-ordering-peer.rs` includes this file too).

#![allow(dead_code)]

use actix::Message;
use baton::actors::{RemoteMessage, Shared, SharedMut};
use serde::{Deserialize, Serialize};

/// CUDA C for NVRTC: kernels that spin for a number of clock cycles (so that they are
/// still running when the other process acts), then write.
pub const KERNELS: &str = r#"
extern "C" __global__ void spin_then_write(unsigned int* p, unsigned int v, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    if (blockIdx.x == 0 && threadIdx.x == 0) { p[0] = v; }
}

extern "C" __global__ void spin_then_fill(unsigned int* p, unsigned int n, unsigned int v, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        p[i] = v;
    }
}
"#;

/// Cycles the importer's late writer spins: a few milliseconds, far longer than a
/// `Release` takes to reach the exporter.
pub const LATE_WRITE_CYCLES: i64 = 5_000_000;

/// Round `round` of the release test: read element 0 (after the previous round's kernel has
/// finished), then queue a long kernel that writes `2 * round + 1` there, and drop the lease
/// at once. Answers the value read.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "u32")]
pub struct Round {
    pub round: u32,
    /// Written by the importer's kernel: a writable grant.
    pub buf: SharedMut<u32>,
}

impl RemoteMessage for Round {
    const NAME: &'static str = "ordering.Round";
}

/// Copy the buffer on the importer's own stream (cudarc `memcpy_dtod`, ordered by the
/// lease) and count the elements that are not `expect`.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "u64")]
pub struct Check {
    pub expect: u32,
    pub buf: Shared<u32>,
}

impl RemoteMessage for Check {
    const NAME: &'static str = "ordering.Check";
}

/// Open the buffer and drop it; answer how many descriptors the link to the sender has
/// received so far, and how many driver-level opens the importer's backend made.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "(u64, u64)")]
pub struct Count {
    pub buf: Shared<u32>,
}

impl RemoteMessage for Count {
    const NAME: &'static str = "ordering.Count";
}

/// Open the buffer, make the importer's stream wait on the offer's acquire fence
/// (`Lease::wait_on`) and drop the lease at once: its release fence follows that stream.
/// Answers `true`. No host synchronisation on either side: a stream-ordered handoff's own
/// cost, as the benchmark's `ordered` variant measures it.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "bool")]
pub struct Touch {
    pub buf: Shared<u32>,
}

impl RemoteMessage for Touch {
    const NAME: &'static str = "ordering.Touch";
}
