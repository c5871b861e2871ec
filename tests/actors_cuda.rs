//! The actor protocol on CUDA device memory (legacy IPC handles, VMM descriptors and
//! stream-ordered pool memory): the same scenarios as `actors_protocol.rs` and
//! `actors_supervision.rs`, with leaks measured twice: exactly, as the backend's count of
//! live allocations and mappings back to zero, and device-wide, as free memory back to its
//! baseline (within 1 MiB, with every buffer at least 2 MiB, so that one leaked buffer
//! shows). Each test holds the GPU test lock, so no other Baton test shares the device
//! meanwhile. Needs a GPU: run with `--features gpu-tests`.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;
#[path = "support/stubborn.rs"]
mod stubborn;

use actix::prelude::*;
use actors::{DEADLINE, Parent, eventually, eventually_async, exited};
use baton::actors::{ActorError, Allocate, Buffer, Lease};
use baton::ipc::MemPtr;
use baton::ipc::cuda::testing::GpuTestLock;
use baton::ipc::cuda::{CudaBackend, CudaExport};
use msgs::*;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn run<F: Future<Output = ()>>(f: F) {
    System::new().block_on(f);
}

const MIB: usize = 1 << 20;
/// `u32`s in the smallest buffer these tests make: 2 MiB, above the 1 MiB tolerance of the
/// device-wide measure.
const MIN_ELEMS: usize = 2 * MIB / 4;

/// A parent on CUDA whose children use the same export kind, and the GPU test lock, held
/// for the test's run.
fn cuda_parent(tag: &str, export: CudaExport) -> (Parent, Arc<CudaBackend>, GpuTestLock) {
    Parent::start_cuda(tag, export)
}

/// Device free memory now, after the backend's pool gave back what it keeps for reuse
/// (kept memory is no leak).
fn device_free(cuda: &CudaBackend) -> usize {
    cuda.synchronize().unwrap();
    cuda.trim_pool(0).unwrap();
    cuda.mem_get_info().unwrap().0
}

/// Polls until the backend holds no allocation or mapping, and device free memory is back
/// within 1 MiB of `baseline`.
async fn device_back_to(cuda: &CudaBackend, baseline: usize) {
    eventually(DEADLINE, "the backend to hold nothing", || {
        cuda.live().is_empty()
    })
    .await;
    let start = Instant::now();
    loop {
        let free = device_free(cuda);
        if free + MIB >= baseline {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "device free memory stayed {} bytes under its baseline",
            baseline - free
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn pattern_buffer(parent: &Parent, len: usize, seed: u32) -> Buffer<u32> {
    let buf = parent.pattern_buffer(len, seed).await;
    assert!(matches!(buf.ptr(), MemPtr::Device(_)), "device memory");
    buf
}

async fn typed_round_trip(export: CudaExport) {
    let tag = match export {
        CudaExport::Legacy => "cl-rt",
        CudaExport::Vmm => "cv-rt",
        CudaExport::Pool => "cp-rt",
    };
    let (parent, cuda, _gpu) = cuda_parent(tag, export);
    let baseline = device_free(&cuda);
    let (mut child, peer) = parent.child(&[]).await;
    // Not a multiple of the 2 MiB VMM granularity: the handle must name the layout's bytes,
    // not the rounded-up allocation.
    const N: usize = 1920 * 1080;
    let a = pattern_buffer(&parent, N, 21).await;
    assert_eq!(cuda.live().exported, 1);
    let b: Buffer<f32> = parent
        .owner
        .send(Allocate::vector(N as u64))
        .await
        .unwrap()
        .unwrap();
    b.write_at(0, &(0..N).map(|i| i as f32 * 0.5).collect::<Vec<_>>())
        .unwrap();
    let reply = peer
        .remote::<CheckPair>("checker")
        .send(CheckPair {
            seed: 21,
            a: a.share(),
            b: b.share(),
        })
        .await
        .unwrap();
    assert!(reply.ok, "the child read our device memory exactly");
    let sum = reply.sum.open().unwrap();
    assert!(matches!(sum.ptr().unwrap(), MemPtr::Device(_)));
    assert_eq!(
        sum.imported().unwrap().mapping().backend(),
        export.kind(),
        "the child exported with the same kind"
    );
    let got = sum.to_vec().unwrap();
    assert!(
        got.iter()
            .enumerate()
            .all(|(i, v)| *v == pattern(21, i) as f32 + i as f32 * 0.5)
    );
    drop(sum);
    eventually_async(DEADLINE, "leases back", || async {
        parent.table().await.iter().all(|b| b.leases.is_empty())
    })
    .await;
    drop((a, b));
    peer.close();
    assert!(exited(&mut child, DEADLINE).await.success());
    // Closes run on the node's driver thread, after the leases' release fences.
    eventually(DEADLINE, "the import cache to close every mapping", || {
        parent.node.cache().stats().live == 0
    })
    .await;
    device_back_to(&cuda, baseline).await;
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU (--features gpu-tests)"
)]
fn legacy_typed_message_with_two_device_buffers_there_and_back() {
    run(typed_round_trip(CudaExport::Legacy));
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU (--features gpu-tests)"
)]
fn vmm_typed_message_with_two_device_buffers_there_and_back() {
    run(typed_round_trip(CudaExport::Vmm));
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU (--features gpu-tests)"
)]
fn pool_typed_message_with_two_device_buffers_there_and_back() {
    run(typed_round_trip(CudaExport::Pool));
}

/// Deferred free and importer SIGKILL on device memory: the frees complete and the
/// device's free memory returns to its baseline.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU (--features gpu-tests)"
)]
fn importer_sigkill_on_device_memory_reclaims_everything() {
    run(async {
        let (parent, cuda, _gpu) = cuda_parent("c-ik", CudaExport::Legacy);
        let baseline = device_free(&cuda);
        let (mut child, peer) = parent.child(&[]).await;
        let bufs = vec![
            pattern_buffer(&parent, 16 * MIB, 1).await,
            pattern_buffer(&parent, 16 * MIB, 2).await,
        ];
        let held = peer
            .remote::<Hold>("holder")
            .send(Hold {
                buffers: bufs.iter().map(Buffer::share).collect(),
            })
            .await
            .unwrap();
        assert_eq!(held, 2);
        let seen = peer
            .remote::<PeekHeld>("holder.peek")
            .send(PeekHeld)
            .await
            .unwrap();
        assert!(seen.contains(&pattern(1, 0)) && seen.contains(&pattern(2, 0)));
        drop(bufs);
        assert_eq!(
            parent.stats().await.retiring,
            2,
            "frees deferred while the importer holds them"
        );
        child.kill9();
        eventually_async(DEADLINE, "frees to complete", || async {
            let s = parent.stats().await;
            s.buffers == 0 && s.leases == 0
        })
        .await;
        drop(peer);
        device_back_to(&cuda, baseline).await;
    });
}

/// Exporter SIGKILL on device memory: the importer's leases turn orphaned, dropping them
/// is clean, and the context stays usable.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU (--features gpu-tests)"
)]
fn exporter_sigkill_on_device_memory_orphans_leases() {
    run(async {
        let (parent, cuda, _gpu) = cuda_parent("c-ek", CudaExport::Legacy);
        let baseline = device_free(&cuda);
        let (mut child, peer) = parent.child(&[]).await;
        let made = peer
            .remote::<MakeBuffers>("exporter")
            .send(MakeBuffers {
                n: 2,
                len: 1 << 20,
                seed: 5,
            })
            .await
            .unwrap();
        let leases: Vec<Lease<u32>> = made
            .buffers
            .into_iter()
            .map(|s| s.open().unwrap())
            .collect();
        assert_eq!(leases[0].to_vec().unwrap()[77], pattern(5, 77));
        assert_eq!(cuda.live().imported, 2, "both buffers mapped here");
        child.kill9();
        eventually(DEADLINE, "orphaned", || {
            leases.iter().all(Lease::is_orphaned)
        })
        .await;
        assert!(matches!(
            leases[1].to_vec(),
            Err(ActorError::Orphaned { .. })
        ));
        drop(leases);
        // Closes run on the node's driver thread, after the leases' release fences.
        eventually(DEADLINE, "the orphaned mappings to close", || {
            parent.node.cache().stats().live == 0 && cuda.live().imported == 0
        })
        .await;
        // The context still works: a fresh allocation and copy.
        let again = pattern_buffer(&parent, MIN_ELEMS, 9).await;
        assert_eq!(again.to_vec().unwrap()[3], pattern(9, 3));
        drop(again);
        device_back_to(&cuda, baseline).await;
    });
}

/// The stubborn live holder on legacy CUDA IPC, where `cuMemFree` under a live importer's
/// mapping would let the next allocation hand those pages to another buffer: SIGSTOPped past
/// a revoke deadline, the holder is cut, and the allocation stays (quarantined) while it
/// lives; another buffer made meanwhile does not take its memory (the holder, SIGCONTed,
/// reads its own data through the raw mapping and "orphaned" through the lease); its
/// SIGKILL frees the memory, and device free memory comes back to its baseline.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU (--features gpu-tests)"
)]
fn legacy_stubborn_live_holder_keeps_the_memory_quarantined_until_it_dies() {
    run(async {
        let (parent, cuda, _gpu) = cuda_parent("c-stub", CudaExport::Legacy);
        let baseline = device_free(&cuda);
        let allocations = || Some(cuda.live().exported);
        stubborn::stubborn_live_holder(&parent, true, MIN_ELEMS, &allocations).await;
        device_back_to(&cuda, baseline).await;
    });
}
