//! Micro-benchmarks (divan) of the two pieces every handoff goes through in-process: the
//! frame codec (a `Call` frame carrying one handle, and one carrying a lease over 43 CUDA
//! allocations, a borrowed 0.5B model's) and the import cache's hit path.
//!
//! ```text
//! cargo bench --bench micro
//! ```

use baton::ipc::{Backend, FrameFds, HostBackend, ImportCache, Session};
use baton::messages::codec::{FrameDecoder, decode_payload, encode_frame, frame_bytes};
use baton::messages::protocol::{Call, Offer, Release};
use baton::messages::{
    ActorId, AllocationId, BackendKind, BootId, CounterFence, CudaIpcMemHandle, DType, DeviceUuid,
    ExporterId, FenceHandle, Generation, HandleDigest, HandleMsg, Layout, LeaseId, Message,
    PROTOCOL_VERSION, ProcessId, RawHandle, SessionToken, Shape,
};
use divan::{Bencher, black_box};

fn main() {
    divan::main();
}

fn session() -> Session {
    Session::new(SessionToken::from_bytes([7; 32]))
}

fn backend() -> HostBackend {
    HostBackend::with_namespace(&format!("micro{}", std::process::id())).expect("namespace")
}

/// A sealed handle of a host segment, as the actor layer builds it.
fn handle(alloc: &baton::ipc::Allocation, session: &Session) -> HandleMsg {
    alloc
        .handle(session)
        .actor(ActorId::new(3))
        .layout(Layout::new(DType::U8, Shape::vector(alloc.size() as u64)))
        .build()
        .expect("handle")
}

/// The frame the actor layer sends for one typed message with one buffer.
fn call(handle: HandleMsg) -> Message {
    Message::Call(Call {
        id: 4242,
        target: "bench.consumer".into(),
        type_name: "bench.Handoff".into(),
        payload: vec![1, 0, 0],
        offers: vec![Offer {
            lease: LeaseId::new(99),
            handle,
        }],
    })
}

/// The frame of a lease over `parts` CUDA IPC allocations, each with a counter fence: what
/// an engine receives when a borrowed model is lent (decoding never checks the seal).
fn cuda_lease(parts: usize) -> Message {
    let offers = (0..parts)
        .map(|i| Offer {
            lease: LeaseId::new(99),
            handle: HandleMsg {
                version: PROTOCOL_VERSION,
                exporter: ExporterId {
                    process: ProcessId {
                        boot: BootId([7; 16]),
                        pid: 4242,
                        start_ticks: 123_456,
                    },
                    actor: ActorId::new(3),
                },
                alloc: AllocationId::new(1000 + i as u64),
                generation: Generation::FIRST,
                backend: BackendKind::CudaLegacy,
                device: DeviceUuid([0xab; 16]),
                alloc_size: 20 << 20,
                offset: 0,
                len: 20 << 20,
                layout: Some(Layout::new(DType::U8, Shape::vector(20 << 20))),
                raw: RawHandle::CudaIpc(CudaIpcMemHandle([0x5a; 64])),
                fence: Some(FenceHandle::Counter(CounterFence {
                    slab: CudaIpcMemHandle([0x11; 64]),
                    slab_id: 2,
                    offset: 256,
                    value: 1 << 20,
                })),
                digest: HandleDigest([0x77; 32]),
            },
        })
        .collect();
    Message::Call(Call {
        id: 4242,
        target: "trainer".into(),
        type_name: "rl.Lend".into(),
        payload: vec![1; 2000],
        offers,
    })
}

mod codec {
    use super::*;

    #[divan::bench]
    fn decode_cuda_lease_of_43_payload(bencher: Bencher<'_, '_>) {
        let wire = frame_bytes(&cuda_lease(43), 0).expect("encode");
        let payload = &wire[baton::messages::codec::HEADER_LEN..];
        bencher.bench_local(|| black_box(decode_payload(black_box(payload)).expect("decode")));
    }

    #[divan::bench]
    fn encode_cuda_lease_of_43_frame(bencher: Bencher<'_, '_>) {
        let msg = cuda_lease(43);
        let mut buf = Vec::with_capacity(16 << 10);
        bencher.bench_local(|| {
            buf.clear();
            encode_frame(black_box(&msg), 0, &mut buf).expect("encode");
            black_box(&buf);
        });
    }

    #[divan::bench]
    fn encode_call_frame(bencher: Bencher<'_, '_>) {
        let b = backend();
        let alloc = b.allocate(4096).expect("alloc");
        let msg = call(handle(&alloc, &session()));
        let mut buf = Vec::with_capacity(512);
        bencher.bench_local(|| {
            buf.clear();
            encode_frame(black_box(&msg), 0, &mut buf).expect("encode");
            black_box(&buf);
        });
    }

    #[divan::bench]
    fn decode_call_frame(bencher: Bencher<'_, '_>) {
        let b = backend();
        let alloc = b.allocate(4096).expect("alloc");
        let wire = frame_bytes(&call(handle(&alloc, &session())), 0).expect("encode");
        let mut decoder = FrameDecoder::new();
        bencher.bench_local(|| {
            decoder.push(black_box(&wire));
            black_box(decoder.next_frame().expect("decode").expect("a frame"));
        });
    }

    #[divan::bench]
    fn decode_call_payload(bencher: Bencher<'_, '_>) {
        let b = backend();
        let alloc = b.allocate(4096).expect("alloc");
        let wire = frame_bytes(&call(handle(&alloc, &session())), 0).expect("encode");
        let payload = &wire[baton::messages::codec::HEADER_LEN..];
        bencher.bench_local(|| black_box(decode_payload(black_box(payload)).expect("decode")));
    }

    #[divan::bench]
    fn encode_release_frame(bencher: Bencher<'_, '_>) {
        let msg = Message::Release(Release::now(LeaseId::new(12345)));
        let mut buf = Vec::with_capacity(64);
        bencher.bench_local(|| {
            buf.clear();
            encode_frame(black_box(&msg), 0, &mut buf).expect("encode");
            black_box(&buf);
        });
    }
}

mod import_cache {
    use super::*;
    use std::sync::Arc;

    /// `ImportCache::open` of a live allocation, then dropping the view: digest check,
    /// stale check, one map lookup, two lock round trips. No driver call, no mmap.
    #[divan::bench]
    fn open_hit_and_drop(bencher: Bencher<'_, '_>) {
        let b = Arc::new(backend());
        let s = session();
        let alloc = b.allocate(4096).expect("alloc");
        let h = handle(&alloc, &s);
        let cache = ImportCache::new(s, [b as baton::ipc::SharedBackend]);
        let _kept = cache.open(&h, &mut FrameFds::none()).expect("first open");
        bencher.bench_local(|| {
            drop(black_box(
                cache
                    .open(black_box(&h), &mut FrameFds::none())
                    .expect("hit"),
            ));
        });
        assert_eq!(cache.stats().opens, 1, "every open but the first was a hit");
    }

    /// The handle check alone (the keyed BLAKE3 digest and consistency checks), the
    /// largest part of a hit.
    #[divan::bench]
    fn check_handle(bencher: Bencher<'_, '_>) {
        let b = backend();
        let s = session();
        let alloc = b.allocate(4096).expect("alloc");
        let h = handle(&alloc, &s);
        bencher.bench_local(|| {
            black_box(s.check(black_box(&h)).expect("valid"));
        });
    }
}
