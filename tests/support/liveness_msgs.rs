//! Messages, kernels and constants shared by the GPU liveness tests
//! (`tests/liveness_cuda.rs`) and their helper process
//! (`test-peers/src/bin/baton-liveness-peer.rs` includes this file too).

#![allow(dead_code)]

use actix::Message;
use baton::actors::{RemoteMessage, Shared, SharedMut};
use serde::{Deserialize, Serialize};

/// The fence deadline every process of these tests runs with (`BATON_FENCE_DEADLINE_MS`,
/// `CudaBackendBuilder::fence_deadline`), in milliseconds: short, so that a producer that
/// does not deliver is found out in a test's time.
pub const FENCE_DEADLINE_MS: u64 = 1500;

/// Cycles a long kernel spins before it writes: about 1.5 to 2 s at an H100's or H200's
/// clock, so that it is still running when the other process acts.
pub const SPIN_CYCLES: i64 = 3_000_000_000;

/// Cycles a flood round's kernel spins: a few microseconds.
pub const SHORT_CYCLES: i64 = 10_000;

/// CUDA C for NVRTC: kernels that spin for a number of clock cycles, then write.
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

extern "C" __global__ void spin_then_copy(const unsigned char* src, unsigned char* dst, unsigned long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (unsigned long long)blockDim.x * gridDim.x) {
        dst[i] = src[i];
    }
}
"#;

/// Allocate `len` `u32`s, queue a kernel that spins `cycles` then fills them with `value`
/// on the helper's own stream, and share the buffer at once (the offer's acquire fence
/// follows the kernel). The helper keeps the buffer.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Spun")]
pub struct SpinShare {
    pub len: u32,
    pub value: u32,
    pub cycles: i64,
}

impl RemoteMessage for SpinShare {
    const NAME: &'static str = "liveness.SpinShare";
}

/// The answer to [`SpinShare`].
#[derive(Debug, Serialize, Deserialize)]
pub struct Spun {
    pub buf: Shared<u32>,
    /// Whether the kernel was still running when the buffer was shared (if not, the test
    /// proves nothing: raise the cycles).
    pub running: bool,
}

/// Open the (writable) lease, queue a kernel that spins `cycles` then writes `value` into
/// element 0 on the helper's own stream, then keep the lease (`keep`) or drop it at once
/// (its `Release` carries a fence after the kernel). Answers whether the kernel was still
/// running when the lease was kept or dropped.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "bool")]
pub struct Scribble {
    pub buf: SharedMut<u32>,
    pub value: u32,
    pub cycles: i64,
    pub keep: bool,
}

impl RemoteMessage for Scribble {
    const NAME: &'static str = "liveness.Scribble";
}

/// Return from `main`: stop the helper's actor system, after waiting at most `flush_ms`
/// for the fences it recorded for peers to be written (`Node::flush_fences`; 0: not at
/// all, as a process that exits with work queued). The reply may never come: the process
/// may be gone first.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "()")]
pub struct Exit {
    pub flush_ms: u32,
}

impl RemoteMessage for Exit {
    const NAME: &'static str = "liveness.Exit";
}

/// Keep the buffer. The forging helper answers it by hand, with an empty reply (the
/// encoding of `()`), and gives the lease back with a fence it never writes.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "()")]
pub struct Keep {
    pub buf: SharedMut<u32>,
}

impl RemoteMessage for Keep {
    const NAME: &'static str = "liveness.Keep";
}

/// The exporter of the forwarding scenario: allocate `len` `u32`s, queue a kernel that
/// spins `cycles` then fills them with `value`, and send the buffer to the relay whose pid
/// is `relay_pid` (`relay.ForwardTo`), to be forwarded to the process whose pid is
/// `to_pid`. Answers the lease ids the holder sees and whether the kernel was still
/// running when the relay had forwarded it, or why forwarding failed.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<(Vec<u64>, bool), String>")]
pub struct SpinForward {
    pub len: u32,
    pub value: u32,
    pub cycles: i64,
    pub relay_pid: u32,
    pub to_pid: u32,
}

impl RemoteMessage for SpinForward {
    const NAME: &'static str = "liveness.SpinForward";
}
