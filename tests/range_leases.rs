//! Leases of a part of a buffer (issue 50): `Buffer::share_range` and `share_range_mut`.
//! Nodes in one process, linked over a Unix socket (the exporter and two workers, each
//! with its own import cache) or over loopback TCP (two "hosts"):
//!
//! - each worker's read lease of one half sees exactly that half (length, shape, in place,
//!   copied, from an index);
//! - a range outside the buffer, or an empty one, is refused with `OutOfBounds`;
//! - one writer or many readers holds per range: writable leases of the two halves are
//!   both granted and each worker writes its half in place, the owner sees both once they
//!   are back; a lease that overlaps a writable one is refused with `LeaseConflict`, as is
//!   a writable lease that overlaps a reader;
//! - over a host link only the range's bytes are copied.
//!
//! A forwarded range lease needs three processes (a node refuses to forward to its own
//! process): `forwarding.rs`.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, run};
use baton::actors::{ActorError, Buffer, HostSettings, Lease, LeaseMut, Node, NodeConfig, Peer};
use baton::ipc::tcp::HostId;
use baton::{HostBackend, RemoteMessage, Session, Shared, SharedMut, SocketDir};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What a worker saw of a read lease.
#[derive(Debug, Serialize, Deserialize)]
struct Seen {
    len: usize,
    dims: Vec<u64>,
    /// `as_slice`: the elements in place.
    in_place: Vec<u32>,
    /// `to_vec`.
    copied: Vec<u32>,
    /// `read_into` of 3 elements from index 2.
    from_two: Vec<u32>,
    /// `read_into` of 1 element at index `len` (one past the end): refused?
    past_end_refused: bool,
    /// Bytes of the memory the lease maps in the worker's process.
    mapped: usize,
    /// How the bytes reached the worker (`LeasePath::name`).
    path: String,
}

/// Reads a lease and reports what it saw.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "Result<Seen, String>")]
struct Read(Shared<u32>);
impl RemoteMessage for Read {
    const NAME: &'static str = "range.Read";
}

/// Fills a writable lease with `value` in place and keeps it until `LetGo`.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "Result<usize, String>")]
struct Fill {
    data: SharedMut<u32>,
    value: u32,
}
impl RemoteMessage for Fill {
    const NAME: &'static str = "range.Fill";
}

/// Keeps a read lease until `LetGo`.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "Result<usize, String>")]
struct Keep(Shared<u32>);
impl RemoteMessage for Keep {
    const NAME: &'static str = "range.Keep";
}

/// Drops the leases kept; returns how many.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
struct LetGo;
impl RemoteMessage for LetGo {
    const NAME: &'static str = "range.LetGo";
}

#[derive(Default)]
struct Worker {
    writable: Vec<LeaseMut<u32>>,
    read: Vec<Lease<u32>>,
}
impl Actor for Worker {
    type Context = Context<Self>;
}
impl Handler<Read> for Worker {
    type Result = Result<Seen, String>;
    fn handle(&mut self, Read(data): Read, _: &mut Context<Self>) -> Self::Result {
        let lease = data.open().map_err(|e| e.to_string())?;
        let mut from_two = vec![0; 3];
        lease
            .read_into(2, &mut from_two)
            .map_err(|e| e.to_string())?;
        let past_end_refused = matches!(
            lease.read_into(lease.len(), &mut [0]),
            Err(ActorError::OutOfBounds { .. })
        );
        Ok(Seen {
            len: lease.len(),
            dims: lease.shape().dims().to_vec(),
            in_place: lease.as_slice().map_err(|e| e.to_string())?.to_vec(),
            copied: lease.to_vec().map_err(|e| e.to_string())?,
            from_two,
            past_end_refused,
            mapped: lease
                .imported()
                .map_err(|e| e.to_string())?
                .mapping()
                .raw()
                .size(),
            path: lease.path().name().to_owned(),
        })
    }
}
impl Handler<Fill> for Worker {
    type Result = Result<usize, String>;
    fn handle(&mut self, msg: Fill, _: &mut Context<Self>) -> Self::Result {
        let mut lease = msg.data.open().map_err(|e| e.to_string())?;
        let slice = lease.as_mut_slice().map_err(|e| e.to_string())?;
        slice.fill(msg.value);
        let len = slice.len();
        self.writable.push(lease);
        Ok(len)
    }
}
impl Handler<Keep> for Worker {
    type Result = Result<usize, String>;
    fn handle(&mut self, Keep(data): Keep, _: &mut Context<Self>) -> Self::Result {
        let lease = data.open().map_err(|e| e.to_string())?;
        let len = lease.len();
        self.read.push(lease);
        Ok(len)
    }
}
impl Handler<LetGo> for Worker {
    type Result = usize;
    fn handle(&mut self, _: LetGo, _: &mut Context<Self>) -> usize {
        self.writable.drain(..).count() + self.read.drain(..).count()
    }
}

/// Registers a `Worker` as "worker" on `node`.
fn serve(node: &Node) {
    let worker = Worker::default().start();
    node.register::<Read>("worker", worker.clone().recipient());
    node.register::<Fill>("worker", worker.clone().recipient());
    node.register::<Keep>("worker", worker.clone().recipient());
    node.register::<LetGo>("worker", worker.recipient());
}

fn host_node(session: &Session) -> Node {
    Node::new(session.clone(), Arc::new(HostBackend::new().unwrap()))
}

/// An exporter and `n` worker nodes in this process, each linked to it over its socket.
struct Workers {
    exporter: Node,
    /// The exporter's link to each worker.
    to: Vec<Peer>,
    _nodes: Vec<(Node, Peer)>,
    _dir: (tempfile::TempDir, SocketDir),
}

async fn workers(n: usize) -> Workers {
    let exporter = host_node(&Session::generate().unwrap());
    let dir: (tempfile::TempDir, SocketDir) = peer::socket_dir();
    let mut listening = exporter.listen(&dir.1, "range.sock").unwrap();
    let (mut to, mut nodes) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let node = host_node(exporter.session());
        serve(&node);
        let to_exporter = node.connect(listening.path()).await.unwrap();
        to.push(listening.accept_timeout(DEADLINE).await.unwrap());
        nodes.push((node, to_exporter));
    }
    Workers {
        exporter,
        to,
        _nodes: nodes,
        _dir: dir,
    }
}

/// Element `i` of the test pattern.
fn pattern(i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ 0x5eed
}

/// A buffer of `len` elements of the pattern.
fn pattern_buffer(node: &Node, len: usize) -> Buffer<u32> {
    let buf = node.allocate::<u32>(len).unwrap();
    let data: Vec<u32> = (0..len).map(pattern).collect();
    buf.write_at(0, &data).unwrap();
    buf
}

async fn read(to: &Peer, data: Shared<u32>) -> Seen {
    let seen = to.remote::<Read>("worker").send(Read(data));
    tokio::time::timeout(DEADLINE, seen)
        .await
        .expect("the worker answers")
        .unwrap()
        .unwrap()
}

/// `f`'s output, which must come within the deadline.
async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, f)
        .await
        .expect("answered within the deadline")
}

async fn let_go(to: &Peer) -> usize {
    let done = to.remote::<LetGo>("worker").send(LetGo);
    tokio::time::timeout(DEADLINE, done)
        .await
        .expect("the worker answers")
        .unwrap()
}

/// Asserts that `seen` is exactly elements `range` of the pattern.
fn assert_is(seen: &Seen, range: std::ops::Range<usize>) {
    let want: Vec<u32> = range.clone().map(pattern).collect();
    assert_eq!(seen.len, range.len(), "length of {range:?}");
    assert_eq!(seen.dims, vec![range.len() as u64], "a vector of {range:?}");
    assert!(seen.in_place == want, "as_slice is {range:?}");
    assert!(seen.copied == want, "to_vec is {range:?}");
    assert_eq!(
        seen.from_two,
        want[2..5],
        "read_into counts from {range:?}'s start"
    );
    assert!(seen.past_end_refused, "read_into stops at {range:?}'s end");
}

#[test]
fn two_workers_each_read_exactly_their_half() {
    run(async {
        let w = workers(2).await;
        let buf = pattern_buffer(&w.exporter, 1000);
        let first = buf.share_range(..500).unwrap();
        let second = buf.share_range(500..).unwrap();
        assert_eq!(
            first.layout().shape.dims(),
            [500],
            "the local handle says so too"
        );
        let (a, b) =
            futures_util::future::join(read(&w.to[0], first), read(&w.to[1], second)).await;
        assert_is(&a, 0..500);
        assert_is(&b, 500..1000);
        // Mapped in place, from the memfd the exporter's host backend allocates on Linux.
        assert_eq!(
            (a.path.as_str(), b.path.as_str()),
            ("host-memfd", "host-memfd")
        );
        // An inner range, given inclusively, and the whole buffer as a range.
        assert_is(
            &read(&w.to[0], buf.share_range(123..=456).unwrap()).await,
            123..457,
        );
        assert_is(&read(&w.to[1], buf.share_range(..).unwrap()).await, 0..1000);
        buf.returned_within(DEADLINE).await.unwrap();
    });
}

#[test]
fn a_range_outside_the_buffer_or_an_empty_one_is_out_of_bounds() {
    run(async {
        let node = host_node(&Session::generate().unwrap());
        let buf = node.allocate::<u32>(100).unwrap();
        let refused = |r: Result<(), ActorError>, index: usize, len: usize, what: &str| match r {
            Err(ActorError::OutOfBounds {
                index: i,
                len: l,
                size: 100,
            }) => assert_eq!((i, l), (index, len), "{what}"),
            other => panic!("{what}: {other:?}"),
        };
        let shared = |r: std::ops::Range<usize>| buf.share_range(r).map(drop);
        let shared_mut = |r: std::ops::Range<usize>| buf.share_range_mut(r).map(drop);
        refused(shared(0..101), 0, 101, "one past the end");
        refused(shared(100..101), 100, 1, "wholly past the end");
        refused(shared_mut(90..200), 90, 110, "writable, past the end");
        refused(shared(5..5), 5, 0, "empty");
        refused(shared_mut(0..0), 0, 0, "empty, writable");
        refused(buf.share_range(..=100).map(drop), 0, 101, "inclusive end");
        refused(
            buf.share_range(..=usize::MAX).map(drop),
            0,
            usize::MAX,
            "an end that overflows",
        );
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = shared(7..3);
        refused(backwards, 7, 0, "backwards");
        assert!(buf.share_range(99..100).is_ok() && buf.share_range_mut(0..100).is_ok());
        assert_eq!(buf.leases_out(), 0, "nothing is leased before it is sent");
    });
}

#[test]
fn writable_leases_of_disjoint_halves_are_both_granted_and_each_writes_its_half() {
    run(async {
        let w = workers(2).await;
        let buf = pattern_buffer(&w.exporter, 1000);
        for (to, range, value) in [(&w.to[0], 0..500, 7), (&w.to[1], 500..1000, 9)] {
            let fill = Fill {
                data: buf.share_range_mut(range).unwrap(),
                value,
            };
            let filled = to.remote::<Fill>("worker").send(fill);
            let filled = tokio::time::timeout(DEADLINE, filled).await.unwrap();
            assert_eq!(filled.unwrap(), Ok(500), "each writer's slice is its half");
        }
        assert_eq!(buf.leases_out(), 2, "both writers are out at once");
        // The owner's own writes wait for every lease on the buffer, whatever its range.
        assert!(matches!(
            buf.write_at(999, &[1]),
            Err(ActorError::BufferLeased { leases: 2, .. })
        ));
        assert!(matches!(
            buf.as_mut_slice(),
            Err(ActorError::BufferLeased { leases: 2, .. })
        ));
        assert_eq!(let_go(&w.to[0]).await, 1);
        assert_eq!(let_go(&w.to[1]).await, 1);
        buf.returned_within(DEADLINE).await.unwrap();
        let got = buf.to_vec().unwrap();
        assert!(
            got[..500].iter().all(|&v| v == 7),
            "the first half is the first writer's"
        );
        assert!(
            got[500..].iter().all(|&v| v == 9),
            "the second half is the second's"
        );
    });
}

#[test]
fn an_overlapping_lease_of_a_written_range_is_refused_and_a_writer_of_a_read_one_too() {
    run(async {
        // Three workers: a process that writes a lease in place opens no other view of
        // the allocation meanwhile (see `LeaseMut::as_mut_slice`), so the reader is a
        // third one.
        let w = workers(3).await;
        let buf = pattern_buffer(&w.exporter, 1000);
        let fill = |range: std::ops::Range<usize>, value| Fill {
            data: buf.share_range_mut(range).unwrap(),
            value,
        };
        let (first, second) = (
            w.to[0].remote::<Fill>("worker"),
            w.to[1].remote::<Fill>("worker"),
        );
        let conflict =
            |r: Result<Result<usize, String>, ActorError>, wanted: &str, what: &str| match r {
                Err(ActorError::LeaseConflict { wanted: w, .. }) => assert_eq!(w, wanted, "{what}"),
                other => panic!("{what}: {other:?}"),
            };

        // A writer of 0..500 is out.
        assert_eq!(within(first.send(fill(0..500, 1))).await.unwrap(), Ok(500));
        // Whatever overlaps it is refused, read-only or writable, from any worker.
        conflict(
            within(second.send(fill(499..501, 2))).await,
            "writable",
            "a writer over its end",
        );
        conflict(
            within(second.send(fill(0..1000, 2))).await,
            "writable",
            "a writer of the whole",
        );
        let keep = w.to[2].remote::<Keep>("worker");
        let kept = within(keep.send(Keep(buf.share_range(250..260).unwrap()))).await;
        conflict(kept, "read-only", "a reader inside it");
        let kept = within(keep.send(Keep(buf.share()))).await;
        conflict(kept, "read-only", "a reader of the whole buffer");
        assert_eq!(buf.leases_out(), 1, "nothing refused was leased");

        // A reader of 500..600 beside it is granted; then a writer over the reader is
        // refused, and one beside both granted.
        let kept = within(keep.send(Keep(buf.share_range(500..600).unwrap()))).await;
        assert_eq!(kept.unwrap(), Ok(100));
        conflict(
            within(second.send(fill(550..700, 3))).await,
            "writable",
            "a writer over a reader",
        );
        assert_eq!(
            within(second.send(fill(600..1000, 4))).await.unwrap(),
            Ok(400)
        );
        assert_eq!(buf.leases_out(), 3);

        assert_eq!(let_go(&w.to[0]).await, 1);
        assert_eq!(let_go(&w.to[1]).await, 1);
        assert_eq!(let_go(&w.to[2]).await, 1);
        buf.returned_within(DEADLINE).await.unwrap();
        let got = buf.to_vec().unwrap();
        assert!(got[..500].iter().all(|&v| v == 1));
        assert!(
            (500..600).all(|i| got[i] == pattern(i)),
            "the read range is untouched"
        );
        assert!(got[600..].iter().all(|&v| v == 4));
    });
}

fn host_linked_node(session: &Session, host: &str) -> Node {
    let config = NodeConfig::new(session.clone()).hosts(HostSettings {
        host: HostId::named(host),
        ..HostSettings::default()
    });
    Node::with_config(config, Arc::new(HostBackend::new().unwrap()))
}

#[test]
fn a_range_lease_over_a_host_link_copies_only_the_range() {
    run(async {
        let session = Session::generate().unwrap();
        let a = host_linked_node(&session, "a");
        let b = host_linked_node(&session, "b");
        serve(&b);
        let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
        let to_b = a.connect_tcp(listening.local_addr()).await.unwrap();
        let _from_a = listening.accept_timeout(DEADLINE).await.unwrap();

        const LEN: usize = 1 << 20; // 4 MiB of u32
        let buf = pattern_buffer(&a, LEN);
        let range = 300_001..301_001;
        let seen = read(&to_b, buf.share_range(range.clone()).unwrap()).await;
        assert_is(&seen, range.clone());
        assert_eq!(
            seen.path, "tcp-copy",
            "copied by the TCP engine, and labelled so"
        );
        assert!(
            seen.mapped < LEN * 4 / 2,
            "the copy is of the range ({} bytes), not of the buffer ({} bytes)",
            seen.mapped,
            LEN * 4
        );
        buf.returned_within(DEADLINE).await.unwrap();

        // A writable range does not cross hosts either: refused, nothing leased.
        let fill = Fill {
            data: buf.share_range_mut(range).unwrap(),
            value: 1,
        };
        let refused = to_b.remote::<Fill>("worker").send(fill);
        let refused = tokio::time::timeout(DEADLINE, refused).await.unwrap();
        assert!(refused.is_err(), "{refused:?}");
        buf.returned_within(DEADLINE).await.unwrap();
        to_b.close_and_wait().await;
    });
}
