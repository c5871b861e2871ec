//! Stream ordering of a handoff, both ways, proven on a recording test backend (a
//! simulated device that runs queued operations in stream order and logs every driver-level
//! call: `tests/support/recording.rs`), without a GPU:
//!
//! - the exporter records an acquire fence after the work that produced the buffer; the
//!   importer's stream waits on it before its first use; the importer's work runs only
//!   after the exporter's;
//! - a lease dropped while the importer's work is still pending records a release fence
//!   after that work; the exporter's next write waits on it, and so does the free — the
//!   importer's late write never lands over the exporter's new data;
//! - pool-like descriptors cross a link once per (link, pool), and again after an import
//!   failed;
//! - a node keeps answering pings while a deliberately slow "driver" open is in progress
//!   (opens run on the node's driver thread, not on its actors' thread), and a message whose
//!   offers are all cache hits is opened without it, every view intact;
//! - a frame that carries descriptors, queued behind other frames, keeps its descriptors;
//! - a message refused before it leaves (too many descriptors for a frame, or a buffer that
//!   cannot be leased part-way) takes back every lease granted for it.
//!
//! The same properties on a real GPU: `tests/ordering_cuda.rs` (`--features gpu-tests`).

#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;
#[path = "support/recording.rs"]
mod recording;

use actix::prelude::*;
use baton::Session;
use baton::actors::{Allocate, Buffer, BufferOwner, Lease, Listening, Node, Peer};
use baton::ipc::SharedBackend;
use baton::ipc::Stream;
use msgs::Hold;
use recording::{Device, SimBackend, alloc_of};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(30);

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Keeps the leases it is sent where the test can reach them (same process).
struct Keeper(Arc<Mutex<Vec<Lease<u32>>>>);

impl Actor for Keeper {
    type Context = Context<Self>;
}

impl Handler<Hold> for Keeper {
    type Result = usize;
    fn handle(&mut self, msg: Hold, _: &mut Context<Self>) -> usize {
        let mut kept = self.0.lock().unwrap();
        for shared in msg.buffers {
            kept.push(shared.open().expect("a received buffer"));
        }
        kept.len()
    }
}

fn run<F: Future<Output = ()>>(f: F) {
    System::new().block_on(f);
}

/// Two nodes of one session, linked: the importer listens and keeps what it is sent to
/// `"keep"` (in `kept`); the exporter allocates through `owner`. Every field lives as
/// long as the test needs the link.
struct Pair {
    session: Session,
    /// Kept alive for the link (the owner and the link belong to it).
    _exporter: Node,
    importer: Node,
    owner: Addr<BufferOwner>,
    kept: Arc<Mutex<Vec<Lease<u32>>>>,
    to_importer: Peer,
    listening: Listening,
    _tmp: tempfile::TempDir,
}

impl Pair {
    /// A new 8-element buffer of the exporter, held by the importer's keeper.
    async fn lend_one(&self) -> Buffer<u32> {
        let buf: Buffer<u32> = self.owner.send(Allocate::vector(8)).await.unwrap().unwrap();
        self.to_importer
            .remote::<Hold>("keep")
            .send(Hold {
                buffers: vec![buf.share()],
            })
            .await
            .unwrap();
        buf
    }

    async fn link(exp: SharedBackend, imp: SharedBackend) -> Pair {
        let session = Session::generate().unwrap();
        let exporter = Node::new(session.clone(), exp);
        let importer = Node::new(session.clone(), imp);
        let (_tmp, dir) = peer::socket_dir();
        let listening = importer.listen(&dir, "importer.sock").unwrap();
        let kept = Arc::new(Mutex::new(Vec::new()));
        importer.register::<Hold>("keep", Keeper(Arc::clone(&kept)).start().recipient());
        let owner = BufferOwner::new(&exporter).start();
        let to_importer = exporter.connect(listening.path()).await.unwrap();
        Pair {
            session,
            _exporter: exporter,
            importer,
            owner,
            kept,
            to_importer,
            listening,
            _tmp,
        }
    }
}

/// Where the first line starting with `needle` is in the log; panics with the log if there
/// is none.
fn at(device: &Device, needle: &str) -> usize {
    after(device, 0, needle)
}

/// As [`at`], looking only at lines from index `from` on.
fn after(device: &Device, from: usize, needle: &str) -> usize {
    let lines = device.log();
    lines[from..]
        .iter()
        .position(|l| l.starts_with(needle))
        .map(|i| i + from)
        .unwrap_or_else(|| {
            panic!(
                "no {needle:?} from line {from} in the log:\n{}",
                lines.join("\n")
            )
        })
}

#[test]
fn a_handoff_and_its_release_are_ordered_on_the_streams_that_use_the_buffer() {
    run(async {
        let device = Device::new();
        let exp = SimBackend::new(&device, "exp");
        let imp = SimBackend::new(&device, "imp");
        let pair = Pair::link(exp.clone(), imp.clone()).await;
        let Pair {
            owner,
            kept,
            to_importer,
            ..
        } = &pair;

        let buf: Buffer<u32> = owner.send(Allocate::vector(4)).await.unwrap().unwrap();
        let alloc = alloc_of(buf.ptr());
        buf.write_at(0, &[1, 1, 1, 1]).unwrap();

        // The exporter produces the data on its stream 100 (work still pending), and shares
        // the buffer after that work: the offer carries an acquire fence after it.
        const PRODUCER: u64 = 100;
        buf.wait_on(Stream::Id(PRODUCER)).unwrap();
        device.work(
            PRODUCER,
            "produce",
            "produce",
            Some((alloc, 0, vec![7; 16])),
        );
        let shared = buf.share_on(Stream::Id(PRODUCER)).unwrap();
        let held = to_importer
            .remote::<Hold>("keep")
            .send(Hold {
                buffers: vec![shared],
            })
            .await
            .unwrap();
        assert_eq!(held, 1);
        let lease = kept.lock().unwrap().pop().expect("kept");

        // The importer uses the lease on its stream 200: the stream waits on the acquire
        // fence first; its work (which overwrites the buffer: a late write) stays behind
        // the producer's.
        const CONSUMER: u64 = 200;
        lease.wait_on(Stream::Id(CONSUMER)).unwrap();
        device.work(
            CONSUMER,
            "consume",
            "consume",
            Some((alloc, 0, vec![9; 16])),
        );
        device.open_gate("consume");
        assert!(
            !device.ran("consume") && !device.ran("produce"),
            "the importer's work ran before the exporter's work it waits on:\n{}",
            device.log().join("\n")
        );
        device.open_gate("produce");
        assert!(device.ran("produce") && device.ran("consume"));
        // The consumer's late write is in; close its gate's twin for the next round: a
        // second piece of importer work that stays pending while the lease is dropped.
        device.work(CONSUMER, "late", "late", Some((alloc, 0, vec![8; 16])));

        // Dropped while "late" is pending: the release fence follows it.
        drop(lease);
        let back = Instant::now();
        while buf.leases_out() > 0 {
            assert!(back.elapsed() < DEADLINE, "the release never came");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }

        // The exporter reuses the buffer: its write waits on the release fence, so it cannot
        // run while the importer's late work is pending.
        let before_reuse = device.log_len();
        let writer = {
            let buf = buf.clone();
            std::thread::spawn(move || buf.write_at(0, &[5, 5, 5, 5]))
        };
        // The copy is queued (behind the wait), and the writer blocks in its synchronise.
        device
            .logged_from(before_reuse, &format!("exp sync s{}", exp.internal()))
            .await;
        assert_eq!(
            device.bytes(alloc),
            vec![9; 16],
            "the exporter's write ran before the importer's pending work"
        );
        device.open_gate("late");
        writer.join().unwrap().unwrap();
        assert_eq!(
            buf.to_vec().unwrap(),
            vec![5; 4],
            "the importer's late write landed over the exporter's new data"
        );

        // The order of fence operations, from the log.
        let record_acquire = at(&device, "exp mark record");
        let import_wait = at(&device, "imp wait ");
        let consume_queued = at(&device, &format!("queued work consume on s{CONSUMER}"));
        let release_mark = at(&device, "imp mark record");
        let late_queued = at(&device, &format!("queued work late on s{CONSUMER}"));
        let release_fence = at(&device, "imp record e");
        let exporter_wait = after(&device, release_fence, "exp wait ");
        let exporter_copy = after(
            &device,
            release_fence,
            &format!("exp copy-in a{alloc} on s{}", exp.internal()),
        );
        assert!(
            record_acquire < import_wait,
            "acquire: record before the import's wait"
        );
        assert!(
            import_wait < consume_queued,
            "acquire: wait before the first use"
        );
        assert!(
            late_queued < release_mark,
            "release: recorded after the last use"
        );
        assert!(
            release_mark < release_fence,
            "release: the fence follows the mark"
        );
        assert!(
            release_fence < exporter_wait,
            "release: the fence travels to the exporter"
        );
        assert!(
            exporter_wait < exporter_copy,
            "reuse: waited before the write"
        );
        let lines = device.log();
        assert!(
            lines[import_wait].ends_with(&format!("on s{CONSUMER}")),
            "the acquire wait is on the importer's own stream, not a node-wide one: {}",
            lines[import_wait]
        );
        assert!(
            lines[exporter_wait].ends_with(&format!("on s{}", exp.internal())),
            "{}",
            lines[exporter_wait]
        );

        // The free waits for every release fence and for the buffer's own uses.
        let frees_before = device.position(&format!("exp free a{alloc}"));
        assert!(frees_before.is_none());
        drop(buf);
        device.logged(&format!("exp free a{alloc}")).await;
        let lines = device.log();
        let free = at(&device, &format!("exp free a{alloc}"));
        let last_sync = lines[..free]
            .iter()
            .rposition(|l| l == &format!("exp sync s{}", exp.internal()))
            .expect("a synchronise before the free");
        let fence_wait = lines[..free]
            .iter()
            .rposition(|l| {
                l.starts_with("exp wait ") && l.ends_with(&format!("on s{}", exp.internal()))
            })
            .expect("a wait on the release fence before the free");
        assert!(
            fence_wait < last_sync && last_sync < free,
            "{}",
            lines.join("\n")
        );
        // The importer's mapping closed only after waiting for its own release fence.
        let close = device.logged(&format!("imp close a{alloc}")).await;
        let lines = device.log();
        let release_event = lines[release_fence]
            .split_whitespace()
            .nth(2)
            .expect("\"imp record eN on sM\"")
            .to_owned();
        // Polled on the host: no wait queued on the importer's own stream, which could
        // order it after work queued later (a cycle within the process).
        let close_wait = lines[..close]
            .iter()
            .rposition(|l| *l == format!("imp landed {release_event}"))
            .expect("the importer waited for its release fence before closing");
        assert!(
            !lines[close_wait..close]
                .iter()
                .any(|l| l.starts_with(&format!("imp wait {release_event} "))),
            "{}",
            lines.join("\n")
        );
        drop(pair);
    });
}

/// A lease only read through host copies is ordered on the importer backend's own stream,
/// and its release carries no fence (nothing of it is queued).
#[test]
fn host_copies_wait_on_the_backends_own_stream_and_release_without_a_fence() {
    run(async {
        let device = Device::new();
        let exp = SimBackend::new(&device, "exp");
        let imp = SimBackend::new(&device, "imp");
        let pair = Pair::link(exp.clone(), imp.clone()).await;
        let Pair {
            owner,
            kept,
            to_importer,
            ..
        } = &pair;

        let buf: Buffer<u32> = owner.send(Allocate::vector(4)).await.unwrap().unwrap();
        let alloc = alloc_of(buf.ptr());
        buf.wait_on(Stream::Id(7)).unwrap();
        device.work(7, "produce", "go", Some((alloc, 0, vec![3; 16])));
        let shared = buf.share_on(Stream::Id(7)).unwrap();
        to_importer
            .remote::<Hold>("keep")
            .send(Hold {
                buffers: vec![shared],
            })
            .await
            .unwrap();
        let lease = kept.lock().unwrap().pop().unwrap();
        let reader = std::thread::spawn(move || {
            let v = lease.to_vec().unwrap();
            (v, lease)
        });
        device
            .logged(&format!("imp copy-out a{alloc} on s{}", imp.internal()))
            .await;
        device.open_gate("go");
        let (v, lease) = reader.join().unwrap();
        assert_eq!(v, vec![0x0303_0303; 4], "read after the producer's work");
        let wait = at(&device, "imp wait ");
        assert!(device.log()[wait].ends_with(&format!("on s{}", imp.internal())));
        let releases_before = device
            .log()
            .iter()
            .filter(|l| l.starts_with("imp record"))
            .count();
        drop(lease);
        eventually("the release", || buf.leases_out() == 0).await;
        let releases_after = device
            .log()
            .iter()
            .filter(|l| l.starts_with("imp record"))
            .count();
        assert_eq!(
            releases_before, releases_after,
            "a lease used only through host copies records no release fence"
        );
        drop(pair);
    });
}

/// Pool-like memory: the pool's descriptor crosses a link with the first offer of any of
/// its allocations, and not again — until the importer could not import it, when the next
/// offer carries it again.
#[test]
fn pool_descriptors_cross_a_link_once_per_pool_and_again_after_a_failed_import() {
    run(async {
        let device = Device::new();
        let exp = SimBackend::pooled(&device, "exp");
        let imp = SimBackend::new(&device, "imp");
        let pair = Pair::link(exp.clone(), imp.clone()).await;
        let Pair {
            importer,
            owner,
            kept,
            to_importer,
            ..
        } = &pair;
        let from_exporter = {
            let start = Instant::now();
            loop {
                if let Some(p) = importer.peers().into_iter().next() {
                    break p;
                }
                assert!(start.elapsed() < DEADLINE);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };

        // The first import fails (a local failure): refused, and given back.
        imp.fail_next_pool_import();
        let a: Buffer<u32> = owner.send(Allocate::vector(8)).await.unwrap().unwrap();
        let refused = to_importer
            .remote::<Hold>("keep")
            .send(Hold {
                buffers: vec![a.share()],
            })
            .await;
        assert!(refused.is_err(), "the offer was refused: {refused:?}");
        assert_eq!(from_exporter.descriptors_received(), 1);
        eventually("the refused lease back", || a.leases_out() == 0).await;

        // Three allocations of the pool, over four offers: the descriptor comes once more
        // (the importer never imported the pool), then never again.
        let b: Buffer<u32> = owner.send(Allocate::vector(8)).await.unwrap().unwrap();
        let c: Buffer<u32> = owner.send(Allocate::vector(8)).await.unwrap().unwrap();
        for bufs in [vec![a.share(), b.share()], vec![c.share()], vec![a.share()]] {
            to_importer
                .remote::<Hold>("keep")
                .send(Hold { buffers: bufs })
                .await
                .unwrap();
        }
        assert_eq!(kept.lock().unwrap().len(), 4);
        assert_eq!(
            from_exporter.descriptors_received(),
            2,
            "one descriptor for the pool after the failed import, none for later offers"
        );
        assert_eq!(imp.fds_opened.load(std::sync::atomic::Ordering::Relaxed), 2);
        kept.lock().unwrap().clear();
        drop(pair);
    });
}

/// Pool memory an importer mapped goes back to the device once the pool is idle, with the
/// importer alive (issue 46): the exporter's backend retires its idle pool on a heartbeat,
/// the link that carried the pool's descriptor tells the importer (`PoolRetired`), and the
/// importer drops its import of that pool. The next allocation comes from a fresh pool,
/// whose descriptor crosses the link again, and its offer opens.
#[test]
fn a_retired_pool_is_forgotten_by_its_importer_and_the_next_pool_crosses_again() {
    run(async {
        let device = Device::new();
        let exp = SimBackend::pooled(&device, "exp");
        exp.retire_idle_pools_at_once();
        let imp = SimBackend::new(&device, "imp");
        let pair = Pair::link(exp.clone(), imp.clone()).await;
        let kept = &pair.kept;
        let logged = |line: &str| device.log().iter().any(|l| l == line);
        let a = pair.lend_one().await;
        assert!(logged("imp pool imported p1"));
        kept.lock().unwrap().clear(); // the lease goes back; the mapping stays warm
        drop(a); // unmapped by the importer, then freed: the pool is idle
        eventually("the importer drops its import of the retired pool", || {
            logged("imp pool forgotten p1")
        })
        .await;
        assert!(logged("exp pool retired p1"));

        let _b = pair.lend_one().await;
        assert!(
            logged("imp pool imported p2"),
            "the fresh pool's descriptor crossed the link"
        );
        assert_eq!(imp.fds_opened.load(std::sync::atomic::Ordering::Relaxed), 2);
        kept.lock().unwrap().clear();
        drop(pair);
    });
}

/// A node that goes gives its backend's idle memory back without being asked (issue 46:
/// a closed node keeps no pool another process imported): once the exporter node is
/// dropped — its buffer freed, its pool imported by a peer that lives on — its backend's
/// pool is released, and only then.
#[test]
fn a_dropped_node_releases_its_backends_idle_pool() {
    run(async {
        let device = Device::new();
        let exp = SimBackend::pooled(&device, "exp");
        let imp = SimBackend::new(&device, "imp");
        let logged = |line: &str| device.log().iter().any(|l| l == line);
        let pair = Pair::link(exp.clone(), imp.clone()).await;
        let a = pair.lend_one().await;
        assert!(logged("imp pool imported p1"));
        pair.kept.lock().unwrap().clear();
        drop(a);
        device.logged("exp free a1").await;
        assert!(
            !logged("exp pool released p1"),
            "a live node keeps its pool for the next allocation"
        );
        let Pair {
            _exporter,
            importer,
            owner,
            to_importer,
            ..
        } = pair;
        to_importer.close();
        drop((to_importer, owner, _exporter));
        eventually("the dropped node releases its pool", || {
            logged("exp pool released p1")
        })
        .await;
        drop(importer);
    });
}

/// While a deliberately slow open (the recording backend's, blocked on a gate) runs on the
/// importer node's driver thread, the node answers pings from another peer; the offer is
/// delivered once the open finishes.
#[test]
fn a_node_answers_pings_while_a_slow_driver_open_is_in_progress() {
    run(async {
        let device = Device::new();
        let exp = SimBackend::new(&device, "exp");
        let imp = SimBackend::new(&device, "imp");
        imp.slow_opens("open");
        let pair = Pair::link(exp.clone(), imp.clone()).await;
        let Pair {
            session,
            owner,
            kept,
            to_importer,
            listening,
            ..
        } = &pair;
        let third = Node::new(session.clone(), SimBackend::new(&device, "third"));
        let pinger = third.connect(listening.path()).await.unwrap();

        let buf: Buffer<u32> = owner.send(Allocate::vector(4)).await.unwrap().unwrap();
        let sending = actix::spawn(to_importer.remote::<Hold>("keep").send(Hold {
            buffers: vec![buf.share()],
        }));
        device.logged("imp open started").await;
        for _ in 0..3 {
            let rtt = pinger
                .ping()
                .await
                .expect("a pong while the open is blocked");
            assert!(rtt < DEADLINE);
        }
        assert!(kept.lock().unwrap().is_empty(), "the open is still blocked");
        device.open_gate("open");
        let held = sending.await.unwrap().unwrap();
        assert_eq!(held, 1);
        assert_eq!(kept.lock().unwrap().len(), 1);
        kept.lock().unwrap().clear();
        drop((pair, pinger));
    });
}

/// Two linked nodes on host `memfd` memory (a descriptor per allocation, as for VMM).
async fn memfd_pair(tag: &str) -> Pair {
    use baton::ipc::{HostBackend, HostFlavor};
    let ns = peer::namespace(tag);
    let host =
        || -> SharedBackend { Arc::new(HostBackend::with_flavor(HostFlavor::Memfd, &ns).unwrap()) };
    Pair::link(host(), host()).await
}

/// Host `memfd` memory, whose descriptor is per allocation like a CUDA VMM allocation's:
/// it crosses a link with the first offer of each allocation only (counted by the
/// importer's link), however often the allocation is offered.
#[test]
fn a_per_allocation_descriptor_crosses_a_link_once_per_allocation() {
    run(async {
        let pair = memfd_pair("ord-fd").await;
        let Pair {
            importer,
            owner,
            kept,
            to_importer,
            ..
        } = &pair;
        let a: Buffer<u32> = owner.send(Allocate::vector(1024)).await.unwrap().unwrap();
        let b: Buffer<u32> = owner.send(Allocate::vector(1024)).await.unwrap().unwrap();
        for bufs in [
            vec![a.share()],
            vec![a.share(), b.share()],
            vec![b.share()],
            vec![a.share()],
        ] {
            to_importer
                .remote::<Hold>("keep")
                .send(Hold { buffers: bufs })
                .await
                .unwrap();
            kept.lock().unwrap().clear();
        }
        let from_exporter = importer.peers().pop().expect("the exporter's link");
        assert_eq!(from_exporter.descriptors_received(), 2);
        drop(pair);
    });
}

/// Frames queued back to back leave in one `sendmsg`, but a frame that carries descriptors
/// starts a batch of its own (descriptors travel with their frame's first byte). Calls
/// without buffers, each run followed at once by a call whose buffer crosses the link for
/// the first time (its memfd goes with it), all queued before the link's writer runs: every
/// descriptor arrives, and every buffer reads what the exporter wrote.
#[test]
fn offers_with_descriptors_queued_behind_other_frames_arrive_intact() {
    run(async {
        let pair = memfd_pair("ord-batch").await;
        let Pair {
            importer,
            owner,
            kept,
            to_importer,
            ..
        } = &pair;
        let keep = to_importer.remote::<Hold>("keep");
        let mut bufs = Vec::new();
        for seed in 0..4 {
            let buf: Buffer<u32> = owner.send(Allocate::vector(256)).await.unwrap().unwrap();
            buf.write_at(0, &patterned(seed, 256)).unwrap();
            bufs.push(buf);
        }
        // `send` queues its call before it returns: nothing runs the link's writer until
        // all 36 are queued.
        let mut sends = Vec::new();
        for buf in &bufs {
            for _ in 0..8 {
                sends.push(keep.send_timeout(
                    Hold {
                        buffers: Vec::new(),
                    },
                    DEADLINE,
                ));
            }
            sends.push(keep.send_timeout(
                Hold {
                    buffers: vec![buf.share()],
                },
                DEADLINE,
            ));
        }
        for (i, send) in sends.into_iter().enumerate() {
            send.await
                .unwrap_or_else(|e| panic!("call {i} of the batch failed: {e}"));
        }
        let from_exporter = importer.peers().pop().expect("the exporter's link");
        assert_eq!(
            from_exporter.descriptors_received(),
            4,
            "one memfd per buffer"
        );
        let leases = std::mem::take(&mut *kept.lock().unwrap());
        assert_eq!(leases.len(), 4);
        for (seed, lease) in (0..).zip(&leases) {
            assert_eq!(
                lease.to_vec().unwrap(),
                patterned(seed, 256),
                "buffer {seed}"
            );
        }
        drop(leases);
        for buf in &bufs {
            eventually("the leases back", || buf.leases_out() == 0).await;
        }
        drop(pair);
    });
}

/// `len` pattern values (see `msgs::pattern`).
fn patterned(seed: u32, len: usize) -> Vec<u32> {
    (0..len).map(|i| msgs::pattern(seed, i)).collect()
}

/// A message that offers more descriptor-shared allocations than a frame carries is refused
/// before it leaves, with the count it needed, and every lease granted for it on the way
/// (253 of them) is taken back: the buffers are unleased, and the link still works.
#[test]
fn a_message_past_the_descriptors_per_frame_is_refused_and_its_grants_undone() {
    use baton::actors::ActorError;
    use baton::messages::MAX_FDS_PER_FRAME;
    run(async {
        let pair = memfd_pair("ord-fds").await;
        let Pair {
            owner,
            kept,
            to_importer,
            ..
        } = &pair;
        let mut bufs: Vec<Buffer<u32>> = Vec::new();
        for _ in 0..=MAX_FDS_PER_FRAME {
            bufs.push(owner.send(Allocate::vector(16)).await.unwrap().unwrap());
        }
        let keep = to_importer.remote::<Hold>("keep");
        let err = keep
            .send_timeout(
                Hold {
                    buffers: bufs.iter().map(|b| b.share()).collect(),
                },
                DEADLINE,
            )
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                ActorError::TooManyDescriptors { count, max: MAX_FDS_PER_FRAME }
                    if count == MAX_FDS_PER_FRAME + 1
            ),
            "{err:?}"
        );
        let leased = bufs.iter().filter(|b| b.leases_out() > 0).count();
        assert_eq!(leased, 0, "buffers still leased after the refused message");
        // Nothing reached the importer, and the link carries the next message.
        assert!(kept.lock().unwrap().is_empty());
        let held = keep
            .send_timeout(
                Hold {
                    buffers: vec![bufs[MAX_FDS_PER_FRAME].share()],
                },
                DEADLINE,
            )
            .await
            .unwrap();
        assert_eq!(held, 1);
        drop(pair);
    });
}

/// A message whose second buffer cannot be leased (its owner is writing it in place) fails
/// with `LeaseConflict`, and the lease already granted on its first buffer is taken back at
/// once: the first buffer is unleased and its owner may write it in place.
#[test]
fn a_message_refused_part_way_gives_back_the_leases_it_granted() {
    use baton::actors::ActorError;
    run(async {
        let pair = memfd_pair("ord-part").await;
        let Pair {
            owner,
            kept,
            to_importer,
            ..
        } = &pair;
        let first: Buffer<u32> = owner.send(Allocate::vector(64)).await.unwrap().unwrap();
        let second: Buffer<u32> = owner.send(Allocate::vector(64)).await.unwrap().unwrap();
        let writing = second.as_mut_slice().unwrap();
        let err = to_importer
            .remote::<Hold>("keep")
            .send_timeout(
                Hold {
                    buffers: vec![first.share(), second.share()],
                },
                DEADLINE,
            )
            .await
            .unwrap_err();
        assert!(matches!(err, ActorError::LeaseConflict { .. }), "{err:?}");
        assert_eq!(first.leases_out(), 0, "the first buffer's lease was kept");
        first.as_mut_slice().expect("the first buffer is unleased")[0] = 1;
        drop(writing);
        assert!(kept.lock().unwrap().is_empty());
        drop(pair);
    });
}

/// A message whose offers are all warm mappings of the importer's (opened for an earlier
/// message, kept after its leases went back) is opened on the link's own thread, with no
/// trip to the driver thread: every offer still arrives as a view of its own buffer.
#[test]
fn a_message_whose_offers_are_all_cache_hits_arrives_with_every_view() {
    run(async {
        let device = Device::new();
        let exp = SimBackend::new(&device, "exp");
        let imp = SimBackend::new(&device, "imp");
        let pair = Pair::link(exp.clone(), imp.clone()).await;
        let Pair {
            importer,
            owner,
            kept,
            to_importer,
            ..
        } = &pair;
        let keep = to_importer.remote::<Hold>("keep");
        let mut bufs = Vec::new();
        for seed in 0..3 {
            let buf: Buffer<u32> = owner.send(Allocate::vector(64)).await.unwrap().unwrap();
            buf.write_at(0, &patterned(seed, 64)).unwrap();
            bufs.push(buf);
        }
        let cache = importer.cache();
        for round in ["first: three opens", "again: three cache hits"] {
            let before = cache.stats();
            let held = keep
                .send_timeout(
                    Hold {
                        buffers: bufs.iter().map(|b| b.share()).collect(),
                    },
                    DEADLINE,
                )
                .await
                .unwrap_or_else(|e| panic!("{round}: {e}"));
            assert_eq!(held, 3, "{round}");
            let after = cache.stats();
            let (opens, hits) = (after.opens - before.opens, after.hits - before.hits);
            if round.starts_with("first") {
                assert_eq!((opens, hits), (3, 0), "{round}: {after:?}");
            } else {
                assert_eq!((opens, hits), (0, 3), "{round}: {after:?}");
            }
            let leases = std::mem::take(&mut *kept.lock().unwrap());
            for (seed, lease) in (0..).zip(&leases) {
                assert_eq!(
                    lease.to_vec().unwrap(),
                    patterned(seed, 64),
                    "{round}: buffer {seed}"
                );
            }
            drop(leases);
            for buf in &bufs {
                eventually("the leases back", || buf.leases_out() == 0).await;
            }
            assert_eq!(cache.stats().warm, 3, "{round}: kept warm");
        }
        drop(pair);
    });
}

/// An importer gives a buffer back while its work on it is pending, and the exporter offers
/// the buffer again without touching it: the next importer's stream still waits for the
/// first importer's work (the new offer's acquire fence follows the release fence).
#[test]
fn a_reoffer_waits_for_the_previous_importers_pending_work() {
    run(async {
        let device = Device::new();
        let exp = SimBackend::new(&device, "exp");
        let imp = SimBackend::new(&device, "imp");
        let pair = Pair::link(exp.clone(), imp.clone()).await;
        let Pair {
            owner,
            kept,
            to_importer,
            ..
        } = &pair;
        let keep = to_importer.remote::<Hold>("keep");

        let buf: Buffer<u32> = owner.send(Allocate::vector(4)).await.unwrap().unwrap();
        let alloc = alloc_of(buf.ptr());
        keep.send(Hold {
            buffers: vec![buf.share()],
        })
        .await
        .unwrap();
        let first = kept.lock().unwrap().pop().unwrap();
        first.wait_on(Stream::Id(300)).unwrap();
        device.work(300, "first", "first", Some((alloc, 0, vec![4; 16])));
        drop(first);
        eventually("the first lease back", || buf.leases_out() == 0).await;

        keep.send(Hold {
            buffers: vec![buf.share()],
        })
        .await
        .unwrap();
        let second = kept.lock().unwrap().pop().unwrap();
        second.wait_on(Stream::Id(400)).unwrap();
        device.work(400, "second", "second", None);
        device.open_gate("second");
        assert!(
            !device.ran("second"),
            "the second importer's work ran before the first one's:\n{}",
            device.log().join("\n")
        );
        device.open_gate("first");
        assert!(device.ran("first") && device.ran("second"));
        drop(second);
        drop(pair);
    });
}
