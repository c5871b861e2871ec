//! Forwarding across three real processes (A → B → C, zero-copy), on host memory of both
//! flavors (named segments, whose count shows the free; `memfd`s, whose descriptor the
//! relay passes on unopened):
//!
//! - A (this test) allocates and sends a buffer to B (`baton-relay-peer relay`), which
//!   forwards it to C (`baton-relay-peer sink`), linked to B only. A's lease table lists C
//!   as a holder, relayed by B; C reads A's data and sees A's later write (same memory).
//! - SIGKILL of C returns C's hold at A; the memory goes only once every holder is gone.
//! - SIGKILL of B while C holds: the lease is stranded, A keeps the memory while C lives,
//!   and frees it once C dies.
//! - C's release goes back to A through B.
//!
//! The first two run on CUDA device memory too (legacy IPC handles, VMM and pool
//! descriptors), with the backend's count of live allocations back to zero at the end:
//! `--features gpu-tests`.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;
#[path = "support/relay_msgs.rs"]
mod relay_msgs;

use actors::{DEADLINE, Lines, Parent, eventually, run};
use baton::actors::{ActorError, Buffer, BufferId, BufferLeases, Peer};
use baton::ipc::cuda::testing::GpuTestLock;
use baton::ipc::cuda::{CudaBackend, CudaExport};
use baton::ipc::host::HostFlavor;
use baton::ipc::{HostBackend, MemPtr};
use msgs::pattern;
use relay_msgs::*;
use std::sync::Arc;
use std::time::Duration;

const LEN: usize = 2048;
fn relay() -> &'static str {
    peer::exe("baton-relay-peer")
}

fn pattern_sum(seed: u32) -> u64 {
    (0..LEN).map(|i| u64::from(pattern(seed, i))).sum()
}

/// A parent on host memory of `flavor`; its children use the same flavor.
fn parent(tag: &str, flavor: HostFlavor) -> Parent {
    let ns = peer::namespace(tag);
    let backend = Arc::new(HostBackend::with_flavor(flavor, &ns).unwrap());
    let mut parent = Parent::start_with(&ns, backend);
    parent
        .child_env
        .push(("BATON_BACKEND".into(), "host".into()));
    parent
        .child_env
        .push((baton::ipc::host::HOST_ENV.into(), flavor.name().into()));
    parent
}

/// Where the buffers live, and what tells that they were freed.
struct Setup {
    parent: Parent,
    /// Host, named segments: their count.
    named: bool,
    /// CUDA: the backend's count of live allocations, and the GPU test lock held meanwhile.
    cuda: Option<(Arc<CudaBackend>, GpuTestLock)>,
}

fn host(tag: &str, flavor: HostFlavor) -> Setup {
    Setup {
        parent: parent(tag, flavor),
        named: flavor == HostFlavor::Named,
        cuda: None,
    }
}

/// A parent on CUDA whose children export the same way, and the GPU test lock.
fn cuda(tag: &str, export: CudaExport) -> Setup {
    let (parent, backend, gpu) = Parent::start_cuda(tag, export);
    Setup {
        parent,
        named: false,
        cuda: Some((backend, gpu)),
    }
}

impl Setup {
    fn segments(&self) -> Option<usize> {
        self.named.then(|| self.parent.segments())
    }

    /// After a free: the backend holds no allocation of ours any more.
    async fn backend_released(&self) {
        if let Some((cuda, _)) = &self.cuda {
            eventually(DEADLINE, "the backend to free the allocation", || {
                cuda.live().exported == 0
            })
            .await;
        }
    }
}

/// The three processes: B linked to us, C linked to B only (its stdout read line by line).
struct Trio {
    b: peer::Peer,
    b_link: Peer,
    c: peer::Peer,
    c_lines: Lines,
    _dir: tempfile::TempDir,
}

async fn trio(parent: &Parent, c_args: &[&str]) -> Trio {
    let dir = tempfile::tempdir().unwrap();
    let b_dir = dir.path().join("b");
    let b_dir = b_dir.to_str().unwrap().to_owned();
    let (b, b_link) = parent
        .spawn_linked(relay(), &["relay", &parent.socket(), &b_dir], false)
        .await;
    // B listens before it links to us: its socket is there.
    let b_sock = format!("{b_dir}/relay.sock");
    let env: Vec<(&str, &str)> = parent
        .child_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut args = vec!["sink", b_sock.as_str()];
    args.extend_from_slice(c_args);
    let mut c = peer::Peer::spawn_with(relay(), &parent.session, &parent.ns, &args, &env, true);
    let c_lines = Lines::of(c.take_stdout().unwrap());
    assert_eq!(c_lines.next_line(DEADLINE).await, "ready");
    Trio {
        b,
        b_link,
        c,
        c_lines,
        _dir: dir,
    }
}

/// Sends a pattern buffer to B, which forwards it to C; checks what C read.
async fn forward(parent: &Parent, trio: &Trio, seed: u32) -> Buffer<u32> {
    let buf = parent.pattern_buffer(LEN, seed).await;
    let ids = trio
        .b_link
        .remote::<ForwardTo>("relay")
        .send(ForwardTo {
            buffers: vec![buf.share()],
            to_pid: trio.c.pid(),
        })
        .await
        .unwrap()
        .expect("B forwards the buffer");
    assert_eq!(ids.len(), 1);
    let line = trio.c_lines.next_line(DEADLINE).await;
    let expected = format!(
        "got lease={} exporter={} sum={}",
        ids[0],
        std::process::id(),
        pattern_sum(seed)
    );
    assert_eq!(line, expected, "C reads A's data");
    buf
}

fn row(table: &[BufferLeases], id: BufferId) -> Option<&BufferLeases> {
    table.iter().find(|b| b.buffer == id)
}

/// A's table lists C as a holder, relayed by B, beside B's own lease.
async fn assert_c_holds_via_b(parent: &Parent, trio: &Trio, id: BufferId) {
    let table = parent.table().await;
    let row = row(&table, id).expect("the buffer is listed");
    assert_eq!(row.forwarded.len(), 1, "{row:?}");
    let f = row.forwarded[0];
    assert_eq!(f.holder.pid, trio.c.pid(), "C holds the forwarded lease");
    assert_eq!(f.via.map(|p| p.pid), Some(trio.b.pid()), "B relays it");
    let mut holders: Vec<u32> = row.leases.iter().map(|(_, p)| p.pid).collect();
    holders.sort_unstable();
    let mut expected = vec![trio.b.pid(), trio.c.pid()];
    expected.sort_unstable();
    assert_eq!(holders, expected, "B's lease and C's: {row:?}");
    assert!(row.leases.contains(&(f.lease, f.holder)));
    // The node's table says the same.
    assert!(
        parent
            .node
            .lease_table()
            .iter()
            .any(|b| b.buffer == id && b.forwarded == row.forwarded)
    );
}

/// Waits until `id` is freed, and checks that it was freed once.
async fn assert_freed(parent: &Parent, id: BufferId, freed_before: u64, segments: Option<usize>) {
    let start = std::time::Instant::now();
    loop {
        let gone = row(&parent.table().await, id).is_none();
        if gone {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the buffer was not freed within {DEADLINE:?}: {:?}",
            parent.table().await
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(parent.stats().await.freed, freed_before + 1);
    if let Some(before) = segments {
        eventually(DEADLINE, "the segment to be unlinked", || {
            parent.segments() == before
        })
        .await;
    }
}

/// Holds for a while (the time A would take to react to anything), checking that the
/// buffer is still there. Not a sleep that a test relies on to pass: it can only fail.
async fn assert_kept(parent: &Parent, id: BufferId, freed_before: u64) {
    for _ in 0..20 {
        let table = parent.table().await;
        let row = row(&table, id).expect("kept while C may map it");
        assert!(row.retiring && !row.leases.is_empty(), "{row:?}");
        assert_eq!(parent.stats().await.freed, freed_before);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn flavors() -> [HostFlavor; 2] {
    [HostFlavor::Named, HostFlavor::Memfd]
}

fn segments(parent: &Parent, flavor: HostFlavor) -> Option<usize> {
    (flavor == HostFlavor::Named).then(|| parent.segments())
}

/// Writes `value` into the first element of `buf` through its raw pointer, below Baton's
/// lease rules.
fn poke(buf: &Buffer<u32>, value: u32) {
    match buf.ptr() {
        // SAFETY: the buffer's host mapping, at least one element long and aligned, alive
        // while `buf` is; nothing else writes it now.
        MemPtr::Host(p) => unsafe { p.cast::<u32>().write_volatile(value) },
        MemPtr::Device(d) => {
            // SAFETY: the buffer's device memory, mapped in this process while `buf` lives.
            unsafe { baton::ipc::cuda::testing::write_device(0, d, &value.to_ne_bytes()) }.unwrap()
        }
    }
}

/// A → B → C; B and A let go; C's SIGKILL frees the buffer.
async fn holder_killed(setup: &Setup) {
    let parent = &setup.parent;
    let mut trio = trio(parent, &[]).await;
    let segments_before = setup.segments();
    let buf = forward(parent, &trio, 7).await;
    let id = buf.id();
    assert_c_holds_via_b(parent, &trio, id).await;

    // Zero-copy: C sees A's write to the same memory. (`Buffer::write_at` refuses while a
    // lease is out; a write through the raw pointer, as unsafe code could, reaches it.)
    poke(&buf, 0xDEAD_BEEF);
    assert_eq!(trio.c_lines.next_line(DEADLINE).await, "first=3735928559");

    // B lets its own lease go and A drops the buffer: C alone keeps it.
    let dropped = trio
        .b_link
        .remote::<DropOwn>("relay.drop")
        .send(DropOwn)
        .await
        .unwrap();
    assert_eq!(dropped, 1);
    drop(buf);
    let freed_before = parent.stats().await.freed;
    eventually(DEADLINE, "B's release", || {
        parent
            .node
            .lease_table()
            .iter()
            .any(|b| b.buffer == id && b.leases.len() == 1)
    })
    .await;
    let table = parent.table().await;
    let row = row(&table, id).expect("C holds it");
    assert_eq!(row.leases[0].1.pid, trio.c.pid());
    assert!(row.retiring);
    assert_kept(parent, id, freed_before).await;
    if let Some(before) = segments_before {
        assert_eq!(parent.segments(), before + 1, "the segment is still there");
    }
    if let Some((cuda, _)) = &setup.cuda {
        assert_eq!(cuda.live().exported, 1, "still allocated");
    }

    trio.c.kill9();
    assert_freed(parent, id, freed_before, segments_before).await;
    setup.backend_released().await;
    assert!(trio.b_link.is_connected(), "B is not blamed for C's death");
}

/// A → B → C; A drops the buffer; B's SIGKILL strands C's lease; C's SIGKILL frees it.
async fn relay_killed(setup: &Setup) {
    let parent = &setup.parent;
    let mut trio = trio(parent, &[]).await;
    let segments_before = setup.segments();
    let buf = forward(parent, &trio, 9).await;
    let id = buf.id();
    assert_c_holds_via_b(parent, &trio, id).await;

    trio.b.kill9();
    eventually(DEADLINE, "B's link to go down", || {
        parent.events.down_reason(trio.b_link.link_id()).is_some()
    })
    .await;
    // B's lease went with it; C's is stranded: kept while C lives.
    eventually(DEADLINE, "B's lease to be reclaimed", || {
        parent
            .node
            .lease_table()
            .iter()
            .any(|b| b.buffer == id && b.leases.len() == 1)
    })
    .await;
    // A stranded lease still pins the buffer (issue 45, finding 6): C may still read
    // it, so its owner may not write it, and it is not returned.
    assert_eq!(buf.leases_out(), 1, "C's stranded lease is out");
    assert!(
        matches!(buf.write_at(0, &[0]), Err(ActorError::BufferLeased { .. })),
        "no write under C's stranded lease"
    );
    drop(buf);
    let freed_before = parent.stats().await.freed;
    let table = parent.table().await;
    let row = row(&table, id).expect("kept while C lives");
    assert_eq!(row.forwarded.len(), 1);
    assert_eq!(row.forwarded[0].holder.pid, trio.c.pid());
    assert_eq!(row.forwarded[0].via, None, "stranded: its relay is gone");
    assert_kept(parent, id, freed_before).await;
    assert!(trio.c.try_wait().is_none(), "C lives on");
    if let Some(before) = segments_before {
        assert_eq!(parent.segments(), before + 1, "the segment is still there");
    }
    if let Some((cuda, _)) = &setup.cuda {
        assert_eq!(cuda.live().exported, 1, "still allocated");
    }

    trio.c.kill9();
    assert_freed(parent, id, freed_before, segments_before).await;
    setup.backend_released().await;
}

#[test]
fn a_forwarded_holder_is_counted_at_the_exporter_and_its_death_returns_its_hold() {
    for flavor in flavors() {
        run(async { holder_killed(&host("fwd-kill-c", flavor)).await });
    }
}

#[test]
fn the_relays_death_strands_the_lease_until_the_holder_dies() {
    for flavor in flavors() {
        run(async { relay_killed(&host("fwd-kill-b", flavor)).await });
    }
}

fn exports() -> [CudaExport; 3] {
    [CudaExport::Legacy, CudaExport::Vmm, CudaExport::Pool]
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU (--features gpu-tests)"
)]
fn cuda_a_forwarded_holders_death_returns_its_hold() {
    for export in exports() {
        run(async { holder_killed(&cuda("fwd-cuda-kill-c", export)).await });
    }
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU (--features gpu-tests)"
)]
fn cuda_the_relays_death_strands_the_lease_until_the_holder_dies() {
    for export in exports() {
        run(async { relay_killed(&cuda("fwd-cuda-kill-b", export)).await });
    }
}

/// A range lease forwarded (A → B → C) is the range at C: C sums the range's elements
/// alone, and its first element is A's element at the range's start (a write there,
/// below the lease rules, is what C sees change).
#[test]
fn a_forwarded_range_lease_is_the_range() {
    run(async {
        let parent = parent("fwd-range", HostFlavor::Memfd);
        let trio = trio(&parent, &[]).await;
        let (seed, range) = (17, 500..1500);
        let buf = parent.pattern_buffer(LEN, seed).await;
        let ids = trio
            .b_link
            .remote::<ForwardTo>("relay")
            .send(ForwardTo {
                buffers: vec![buf.share_range(range.clone()).unwrap()],
                to_pid: trio.c.pid(),
            })
            .await
            .unwrap()
            .expect("B forwards the range");
        let sum: u64 = range.clone().map(|i| u64::from(pattern(seed, i))).sum();
        let expected = format!(
            "got lease={} exporter={} sum={sum}",
            ids[0],
            std::process::id()
        );
        assert_eq!(trio.c_lines.next_line(DEADLINE).await, expected);
        assert_c_holds_via_b(&parent, &trio, buf.id()).await;
        let at = match buf.ptr() {
            MemPtr::Host(p) => p.wrapping_add(range.start * 4),
            MemPtr::Device(_) => unreachable!("host memory"),
        };
        // SAFETY: element `range.start` of the buffer's host mapping, aligned, alive while
        // `buf` is; nothing else writes it now.
        unsafe { at.cast::<u32>().write_volatile(0xC0FF_EE00) };
        assert_eq!(trio.c_lines.next_line(DEADLINE).await, "first=3237998080");
    });
}

#[test]
fn the_holders_release_goes_back_through_the_relay() {
    for flavor in flavors() {
        run(async {
            let parent = parent("fwd-release", flavor);
            let trio = trio(&parent, &["release"]).await;
            let segments_before = segments(&parent, flavor);
            let buf = forward(&parent, &trio, 11).await;
            let id = buf.id();
            let line = trio.c_lines.next_line(DEADLINE).await;
            assert!(line.starts_with("released lease="), "{line}");
            assert!(line.ends_with("link=up"), "B took C's release: {line}");
            eventually(DEADLINE, "C's release to reach A through B", || {
                parent
                    .node
                    .lease_table()
                    .iter()
                    .any(|b| b.buffer == id && b.forwarded.is_empty() && b.leases.len() == 1)
            })
            .await;
            let table = parent.table().await;
            assert_eq!(row(&table, id).unwrap().leases[0].1.pid, trio.b.pid());

            let freed_before = parent.stats().await.freed;
            drop(buf);
            trio.b_link
                .remote::<DropOwn>("relay.drop")
                .send(DropOwn)
                .await
                .unwrap();
            assert_freed(&parent, id, freed_before, segments_before).await;
            assert!(trio.b_link.is_connected());
        });
    }
}

/// A closes its link to B while C holds: C's lease is stranded at A. C's later release
/// reaches B, which passed the offer on: no fault, B keeps its link to C (and A keeps the
/// memory until C dies — the release has no way back to it).
#[test]
fn a_release_after_the_exporters_link_is_gone_is_no_fault() {
    run(async {
        let parent = parent("fwd-late-release", HostFlavor::Memfd);
        let flag = tempfile::tempdir().unwrap();
        let drop_file = flag.path().join("drop");
        let drop_arg = format!("drop-on={}", drop_file.display());
        let mut trio = trio(&parent, &[drop_arg.as_str()]).await;
        let buf = forward(&parent, &trio, 13).await;
        let id = buf.id();
        drop(buf);
        let freed_before = parent.stats().await.freed;
        trio.b_link.close();
        eventually(DEADLINE, "the link to B to go down", || {
            parent.events.down_reason(trio.b_link.link_id()).is_some()
        })
        .await;
        eventually(DEADLINE, "C's lease to be stranded", || {
            parent
                .node
                .lease_table()
                .iter()
                .any(|b| b.buffer == id && b.forwarded.len() == 1 && b.forwarded[0].via.is_none())
        })
        .await;

        std::fs::write(&drop_file, b"").unwrap();
        let line = trio.c_lines.next_line(DEADLINE).await;
        assert!(line.starts_with("released lease="), "{line}");
        assert!(line.ends_with("link=up"), "B cut C for its release: {line}");
        assert_kept(&parent, id, freed_before).await;
        trio.c.kill9();
        assert_freed(&parent, id, freed_before, None).await;
    });
}

#[test]
fn forwarding_to_the_exporter_itself_is_refused() {
    run(async {
        let parent = parent("fwd-refused", HostFlavor::Memfd);
        let trio = trio(&parent, &[]).await;
        let buf = parent.pattern_buffer(LEN, 3).await;
        let refused = trio
            .b_link
            .remote::<ForwardTo>("relay")
            .send(ForwardTo {
                buffers: vec![buf.share()],
                to_pid: std::process::id(),
            })
            .await
            .unwrap()
            .expect_err("A has the buffer");
        assert!(refused.contains("refused"), "{refused}");
        let table = parent.table().await;
        assert!(row(&table, buf.id()).unwrap().forwarded.is_empty());
    });
}

/// A lease over several buffers (`lease_with_previous`) is one lease of its holder's (a part
/// per buffer in A's ledger), and it is never forwarded: A refuses B's forward, naming why;
/// nothing is forwarded, B keeps its link and its lease, and both buffers come back when B
/// lets go.
#[test]
fn a_lease_over_several_buffers_is_not_forwarded() {
    run(async {
        let parent = parent("fwd-group", HostFlavor::Memfd);
        let trio = trio(&parent, &[]).await;
        let a = parent.pattern_buffer(LEN, 5).await;
        let b = parent.pattern_buffer(LEN, 6).await;
        let refused = trio
            .b_link
            .remote::<ForwardTo>("relay")
            .send(ForwardTo {
                buffers: vec![a.share(), b.share().lease_with_previous()],
                to_pid: trio.c.pid(),
            })
            .await
            .unwrap()
            .expect_err("a lease over two buffers is not forwarded");
        assert!(refused.contains("several buffers"), "{refused}");
        let table = parent.table().await;
        let held: Vec<_> = [a.id(), b.id()]
            .iter()
            .map(|&id| row(&table, id).unwrap())
            .collect();
        assert!(
            held.iter().all(|r| r.forwarded.is_empty()
                && r.leases.len() == 1
                && r.leases[0].1.pid == trio.b.pid()),
            "B holds both parts, nothing forwarded: {held:?}"
        );
        assert!(trio.b_link.is_connected());
        trio.b_link
            .remote::<DropOwn>("relay.drop")
            .send(DropOwn)
            .await
            .unwrap();
        eventually(DEADLINE, "both parts back from B", || {
            a.leases_out() == 0 && b.leases_out() == 0
        })
        .await;
    });
}
