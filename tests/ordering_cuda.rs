//! Stream ordering across processes on a real GPU, on legacy, VMM and pool memory, with
//! counter fences (the default) and IPC-event fences (the same properties as
//! `tests/ordering.rs` proves on a recording backend), with an importer process
//! (`test-peers/src/bin/baton-ordering-peer.rs`) that uses leases on a stream of its own, through
//! cudarc's own API (Baton's `DevicePtr`/`DevicePtrMut` and `DeviceArg`):
//!
//! - **release**: a thousand rounds in which the importer queues a long kernel that writes
//!   the lease and drops the lease at once, and the exporter then writes a new value: no
//!   round shows the importer's late write over the exporter's new value;
//! - **acquire**: the exporter fills a buffer with a long kernel on its own stream and
//!   shares it while the kernel runs; the importer copies it on *its* stream (cudarc
//!   `memcpy_dtod`) and finds only the finished data;
//! - **VMM descriptors**: a VMM allocation's descriptor crosses a link once, however often
//!   the allocation is offered over it (counted by the importer's link);
//! - **fence reuse**: a tight stream-ordered loop (share on a stream, the importer's stream
//!   waits, release fence back; no host synchronisation) of twice the counter slab's size
//!   never runs it dry, and every fence recorded on the way completes; the same with
//!   IPC-event fences, eight times the event pool's size.
//!
//! Needs a GPU and NVRTC: `cargo test --test ordering_cuda --features gpu-tests`. Each test
//! holds the GPU test lock.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/ordering_msgs.rs"]
mod ordering_msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, Parent, eventually, exited};
use baton::actors::{Allocate, Buffer};
use baton::ipc::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use baton::ipc::cuda::cudarc::nvrtc::compile_ptx;
use baton::ipc::cuda::testing::GpuTestLock;
use baton::ipc::cuda::{
    CudaBackend, CudaExport, DEFAULT_COUNTER_SLOTS, DEFAULT_EVENT_LIMIT, DeviceArg, FenceKind,
};
use ordering_msgs::{Check, Count, KERNELS, Round, Touch};
use std::future::Future;
use std::sync::Arc;

fn run<F: Future<Output = ()>>(f: F) {
    System::new().block_on(f);
}

/// A CUDA parent, the GPU test lock, and the importer process linked to it.
async fn setup(
    tag: &str,
    export: CudaExport,
    fence: FenceKind,
) -> (
    Parent,
    Arc<CudaBackend>,
    peer::Peer,
    baton::actors::Peer,
    GpuTestLock,
) {
    let (parent, cuda, gpu) = Parent::start_cuda_fenced(tag, export, fence);
    let socket = parent.socket();
    let (child, link) = parent
        .spawn_linked(peer::exe("baton-ordering-peer"), &[socket.as_str()], false)
        .await;
    (parent, cuda, child, link, gpu)
}

/// The importer queues a long kernel that writes `2r + 1` into element 0 and drops the
/// lease at once; the exporter then writes `2r`. Without release ordering the importer's
/// kernel lands after the exporter's write, and the next round reads `2r + 1`. On odd
/// rounds the importer names its stream with `wait_on`, so that stream writes the release
/// fence itself; on even rounds a release stream writes it after the kernel's mark.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn an_importers_late_write_never_lands_over_the_exporters_next_write() {
    for (export, fence) in cases() {
        eprintln!("release ordering on {export:?} memory, {fence:?} fences");
        late_write_never_lands(export, fence);
    }
}

/// Every export kind the ordering tests run on.
const EXPORTS: [CudaExport; 3] = [CudaExport::Legacy, CudaExport::Vmm, CudaExport::Pool];

/// Every export kind with each fence kind.
fn cases() -> impl Iterator<Item = (CudaExport, FenceKind)> {
    EXPORTS
        .into_iter()
        .flat_map(|e| [FenceKind::Counter, FenceKind::Event].map(|f| (e, f)))
}

fn late_write_never_lands(export: CudaExport, fence: FenceKind) {
    run(async {
        const ROUNDS: u32 = 1000;
        let (parent, _cuda, mut child, link, _gpu) = setup("ord-rel", export, fence).await;
        let buf: Buffer<u32> = parent
            .owner
            .send(Allocate::vector(1 << 20))
            .await
            .unwrap()
            .unwrap();
        const START: u32 = u32::MAX;
        buf.write_at(0, &[START]).unwrap();
        let round = link.remote::<Round>("round");
        let mut late = Vec::new();
        for r in 0..=ROUNDS {
            let seen = round
                .send(Round {
                    round: r,
                    buf: buf.share_mut(),
                })
                .await
                .unwrap();
            let want = if r == 0 { START } else { 2 * (r - 1) };
            if seen != want {
                late.push((r, seen, want));
            }
            if r == ROUNDS {
                break;
            }
            eventually(DEADLINE, "the lease back", || buf.leases_out() == 0).await;
            // Waits on the importer's release fence: after its kernel.
            buf.write_at(0, &[2 * r]).unwrap();
        }
        assert!(
            late.is_empty(),
            "{} of {ROUNDS} rounds saw the importer's late write over the new value \
             (round, seen, expected): {:?}",
            late.len(),
            &late[..late.len().min(10)]
        );
        drop(buf);
        link.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// The exporter fills a buffer with a long kernel on its own stream (through cudarc, with
/// `DeviceArg`) and shares it while the kernel still runs; the importer's copy on its own
/// stream waits on the offer's acquire fence and sees only the finished fill.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn an_importers_stream_waits_for_the_exporters_work_before_its_first_use() {
    for (export, fence) in cases() {
        eprintln!("acquire ordering on {export:?} memory, {fence:?} fences");
        first_use_waits(export, fence);
    }
}

fn first_use_waits(export: CudaExport, fence: FenceKind) {
    run(async {
        const N: u32 = 1 << 22;
        const ROUNDS: u32 = 20;
        let (parent, cuda, mut child, link, _gpu) = setup("ord-acq", export, fence).await;
        let module = cuda
            .context()
            .load_module(compile_ptx(KERNELS).expect("NVRTC"))
            .unwrap();
        let fill = module.load_function("spin_then_fill").unwrap();
        let stream = cuda.context().new_stream().unwrap();
        let mut buf: Buffer<u32> = parent
            .owner
            .send(Allocate::vector(u64::from(N)))
            .await
            .unwrap()
            .unwrap();
        let check = link.remote::<Check>("check");
        let cycles: i64 = 200_000_000;
        for r in 1..=ROUNDS {
            let cfg = LaunchConfig {
                grid_dim: (256, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `spin_then_fill(unsigned int*, unsigned int, unsigned int, long long)`;
            // it writes the buffer's N elements.
            unsafe {
                stream
                    .launch_builder(&fill)
                    .arg(&DeviceArg::write(&mut buf, &stream))
                    .arg(&N)
                    .arg(&r)
                    .arg(&cycles)
                    .launch(cfg)
            }
            .unwrap();
            let probe = stream.record_event(None).unwrap();
            assert!(
                !probe.is_complete(),
                "the fill had finished before the offer went out: raise the cycles (else this proves nothing)"
            );
            let shared = buf.share();
            let wrong = check
                .send(Check {
                    expect: r,
                    buf: shared,
                })
                .await
                .unwrap();
            assert_eq!(
                wrong, 0,
                "round {r}: the importer's stream read {wrong} elements before the exporter's fill"
            );
            eventually(DEADLINE, "the lease back", || buf.leases_out() == 0).await;
        }
        drop(buf);
        link.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// A VMM allocation's descriptor crosses a link with its first offer only: two
/// allocations offered eight times in all make two descriptors and two driver imports.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_vmm_descriptor_crosses_a_link_once_per_allocation() {
    run(async {
        let (parent, _cuda, mut child, link, _gpu) =
            setup("ord-vmm", CudaExport::Vmm, FenceKind::default()).await;
        let a: Buffer<u32> = parent
            .owner
            .send(Allocate::vector(1 << 20))
            .await
            .unwrap()
            .unwrap();
        let b: Buffer<u32> = parent
            .owner
            .send(Allocate::vector(1 << 20))
            .await
            .unwrap()
            .unwrap();
        let count = link.remote::<Count>("count");
        let mut last = (0, 0);
        for (i, buf) in [&a, &a, &b, &a, &b, &a, &b, &a].into_iter().enumerate() {
            last = count.send(Count { buf: buf.share() }).await.unwrap();
            if i == 0 {
                assert_eq!(last, (1, 1), "the first offer carried its descriptor");
            }
        }
        assert_eq!(
            last,
            (2, 2),
            "one descriptor and one import per allocation (descriptors, opens)"
        );
        drop((a, b));
        link.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}

/// A tight stream-ordered loop, as the benchmark's `ordered` variant runs it, with counter
/// fences (the default): the exporter's stream waits on the release fences that came back
/// and shares on it, the importer's stream waits on the acquire fence and the lease drops
/// at once, with no host synchronisation anywhere. Twice the counter slab's size in
/// handoffs never runs it dry (each side's slots come back once their value landed), every
/// fence recorded on the way completes (the exporter's stream drains within the deadline),
/// and the importer exits cleanly after the link closes.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn a_tight_ordered_loop_never_runs_the_fences_dry() {
    tight_ordered_loop(FenceKind::Counter, 2 * DEFAULT_COUNTER_SLOTS);
}

/// The same loop with IPC-event fences, 8 times the event pool's size. Each handoff's
/// fences wait, through both processes' bridges, on the one before, and that chain runs
/// far slower than the loop (a bridged hop took ~2 ms on the H200 once a few waits were
/// queued on both sides, run Y): without backpressure the exporter ran its 256 events dry
/// after ~260 handoffs (`EventsExhausted`, runs D to Y). Now a call waits while the peer
/// has its backlog of events in flight (`CudaBackendBuilder::event_backlog`), and every
/// handoff completes.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn event_fences_in_a_tight_ordered_loop() {
    tight_ordered_loop(FenceKind::Event, 8 * DEFAULT_EVENT_LIMIT);
}

fn tight_ordered_loop(fence: FenceKind, handoffs: usize) {
    // RUST_LOG=baton_ipc::cuda=trace shows each side's pooled events and bridged waits.
    actors::log_as_rust_log_says();
    run(async {
        let (parent, cuda, mut child, link, _gpu) =
            setup("ord-loop", CudaExport::Legacy, fence).await;
        let buf: Buffer<u32> = parent
            .owner
            .send(Allocate::vector(1 << 10))
            .await
            .unwrap()
            .unwrap();
        let stream = cuda.context().new_stream().unwrap();
        let touch = link.remote::<Touch>("touch");
        let start = std::time::Instant::now();
        for i in 0..handoffs {
            if i % 256 == 0 {
                let (alive, out) = cuda.fence_counts();
                eprintln!(
                    "handoff {i} at {:?}: {alive} fences alive, {out} out or retired",
                    start.elapsed()
                );
            }
            buf.wait_on(&stream).unwrap();
            let shared = buf
                .share_on(&stream)
                .unwrap_or_else(|e| panic!("handoff {i} of {handoffs}: {e}"));
            let answered = touch.send(Touch { buf: shared }).await;
            assert!(
                matches!(answered, Ok(true)),
                "handoff {i} of {handoffs} ({fence:?} fences): {answered:?}"
            );
            eventually(DEADLINE, "the lease back", || buf.leases_out() == 0).await;
        }
        let (alive, out) = cuda.fence_counts();
        eprintln!(
            "{fence:?} fences after {handoffs} handoffs: {alive} alive, {out} out or retired"
        );
        // Every fence on the way completes: the exporter's stream (which waited on the last
        // release fence) drains, on a thread of its own, within the deadline.
        let (done, drained) = std::sync::mpsc::channel();
        let waiter = Arc::clone(&stream);
        std::thread::spawn(move || {
            let _ = done.send(waiter.synchronize().map_err(|e| e.to_string()));
        });
        match drained.recv_timeout(DEADLINE) {
            Ok(r) => r.unwrap(),
            Err(_) => panic!("the exporter's stream did not drain: a fence never completed"),
        }
        drop(buf);
        link.close();
        assert!(exited(&mut child, DEADLINE).await.success());
    });
}
