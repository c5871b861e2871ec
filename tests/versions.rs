//! Versioned, all-or-nothing syncs (issue 51, item 2): a sender stamps each bundle of
//! version N+1 (`SyncSender`, `Bundle::share_stamped`); a receiver (`SyncReceiver`) stages
//! the parts and commits N+1 only when every part has landed, so it is always on exactly N
//! or N+1 and every byte it holds is that version's.
//!
//! - The kill test: a sender child (`baton-sync-peer`) syncs version after version, each in
//!   three bundles, to two receivers of this process, one part after another and one
//!   receiver after the other, and is SIGKILLed at a random moment of a sync (a random
//!   delay after its first part reached a receiver, up to several syncs long, so the kills
//!   land at every point of one).
//!   One child per kill, [`KILLS`] kills (`BATON_VERSION_KILLS` sets another number;
//!   `BATON_VERSION_SEED` replays a run's delays). After each kill: each receiver is on the
//!   version it had or the next, the two are at most one apart, every element of every part
//!   encodes the receiver's version, the dead child's mappings are closed, and it left
//!   nothing in `/dev/shm`. The next child starts from the lower of the two versions (the
//!   receiver ahead refuses that version as stale, and takes the next).
//! - Parts landing one by one, refused versions (stale, skipping, duplicate, inconsistent,
//!   malformed, unstamped) with the link and another lease surviving, a sync past its
//!   deadline or cancelled, infeasible deadlines refused up front: over a loopback link
//!   (`Node::local`: a real socket pair, real leases).
//! - With `gpu-tests`: the kill test on CUDA memory, 100 kills.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;
#[path = "support/versions_msgs.rs"]
mod versions_msgs;

use actix::prelude::*;
use actors::{DEADLINE, eventually, run};
use baton::actors::{
    ActorError, Bundle, Lease, Node, RemoteMessage, Shared, SyncReceiver, SyncSender,
};
use baton::messages::{BundleLayout, DType, Shape, SyncStamp, VersionFault};
use baton::{HostBackend, Session};
use std::cell::{Cell, RefCell};
use std::process::Command;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use versions_msgs::*;

/// Kills of the host kill test.
const KILLS: usize = 1000;

/// A node on host memory with a fresh session.
fn host_node() -> Node {
    Node::new(
        Session::generate().unwrap(),
        Arc::new(HostBackend::new().unwrap()),
    )
}

/// A receiver of this process, registered under a name, and what it saw.
#[derive(Clone)]
struct Receiving {
    receiver: Rc<RefCell<SyncReceiver>>,
    /// Every refusal, typed.
    faults: Rc<RefCell<Vec<VersionFault>>>,
    /// Parts that reached it.
    parts: Rc<Cell<u64>>,
}

impl Actor for Receiving {
    type Context = Context<Self>;
}

impl Handler<SyncPart> for Receiving {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: SyncPart, _: &mut Context<Self>) -> Self::Result {
        self.parts.set(self.parts.get() + 1);
        let mut receiver = self.receiver.borrow_mut();
        match receiver.receive(msg.part) {
            Ok(_) => Ok(receiver.version()),
            Err(ActorError::Version(fault)) => {
                let said = fault.to_string();
                self.faults.borrow_mut().push(fault);
                Err(said)
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

fn receiving(node: &Node, name: &str) -> Receiving {
    let r = Receiving {
        receiver: Rc::new(RefCell::new(SyncReceiver::new(node))),
        faults: Rc::default(),
        parts: Rc::default(),
    };
    node.register::<SyncPart>(name, r.clone().start().recipient());
    r
}

/// The layout of every part: one `u64` tensor.
fn layout() -> BundleLayout {
    BundleLayout::packed([("w", DType::U64, Shape::vector(ELEMENTS as u64))]).unwrap()
}

/// Panics unless every element of every committed part encodes the receiver's version.
fn assert_whole(what: &str, receiver: &SyncReceiver) {
    let version = receiver.version();
    for (part, bundle) in (0..).zip(receiver.parts()) {
        let w = bundle.read::<u64>("w").unwrap();
        let expect = value(version, part);
        if let Some(i) = w.iter().position(|&x| x != expect) {
            panic!(
                "{what}: version {version}, part {part}: element {i} holds {:#x} \
                 (version {}, part {}), not {expect:#x}: a mix",
                w[i],
                w[i] >> 16,
                w[i] & 0xffff
            );
        }
    }
}

/// The seed of this run's random delays (`BATON_VERSION_SEED`, or the clock), printed.
fn seed() -> u64 {
    let seed = std::env::var("BATON_VERSION_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
        | 1;
    println!("BATON_VERSION_SEED={seed}");
    seed
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Names in `/dev/shm` of process `pid`'s segments.
fn shm_of(pid: u32) -> Vec<String> {
    let tag = format!(".{pid}.");
    std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.contains(&tag))
                .collect()
        })
        .unwrap_or_default()
}

/// The kill test on `node`'s memory: `kills` sender children SIGKILLed at random moments
/// of their syncs (see the file's docs).
async fn syncs_survive_kills(node: Node, kills: usize) {
    let started = Instant::now();
    let receivers = RECEIVERS.map(|name| receiving(&node, name));
    let mut rng = seed();
    let (mut split, mut staged_at_kill) = (0, 0);
    for kill in 0..kills {
        let before: Vec<u64> = receivers
            .iter()
            .map(|r| r.receiver.borrow().version())
            .collect();
        let from = *before.iter().min().unwrap();
        let mut cmd = Command::new(peer::exe("baton-sync-peer"));
        cmd.args(["--from", &from.to_string(), "--parts", "3"]);
        let mut child = node.spawn_child(cmd).await.expect("the sender links");
        let seen: u64 = receivers.iter().map(|r| r.parts.get()).sum();
        eventually(DEADLINE, "the sender's first part", || {
            receivers.iter().map(|r| r.parts.get()).sum::<u64>() > seen
        })
        .await;
        // A random moment of its syncs: up to several of them (a sync takes a few hundred
        // microseconds to a few milliseconds here), to the microsecond.
        let delay = Duration::from_micros(xorshift(&mut rng) % 4000);
        tokio::time::sleep(delay).await;
        let pid = child.pid();
        child.kill().expect("SIGKILL");
        tokio::time::timeout(DEADLINE, child.peer().closed())
            .await
            .expect("the dead sender's link closes");
        let status = tokio::time::timeout(DEADLINE, child.wait())
            .await
            .expect("the sender is reaped")
            .unwrap();
        {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(
                status.signal(),
                Some(9),
                "kill {kill}: the sender ended by itself ({status}): see its stderr"
            );
        }
        let after: Vec<u64> = receivers
            .iter()
            .map(|r| r.receiver.borrow().version())
            .collect();
        for (i, r) in receivers.iter().enumerate() {
            let r = r.receiver.borrow();
            assert!(
                after[i] >= before[i],
                "kill {kill}: receiver {i} went back from {} to {}",
                before[i],
                after[i]
            );
            assert_whole(&format!("kill {kill}, receiver {i}"), &r);
            staged_at_kill += usize::from(r.staging().is_some());
        }
        // The sender began version N+1 only once every receiver had N: killed during its
        // sync, it leaves each on N or N+1.
        let (lo, hi) = (after.iter().min().unwrap(), after.iter().max().unwrap());
        assert!(hi - lo <= 1, "kill {kill}: receivers on {after:?}");
        split += usize::from(lo != hi);
        for r in &receivers {
            let faults = r.faults.borrow();
            assert!(
                faults
                    .iter()
                    .all(|f| matches!(f, VersionFault::Stale { .. })),
                "kill {kill}: refusals other than a restarted sender's stale version: {faults:?}"
            );
        }
        eventually(DEADLINE, "the dead sender's mappings closed", || {
            node.cache().stats().live == 0
        })
        .await;
        assert_eq!(shm_of(pid), Vec::<String>::new(), "kill {kill}: /dev/shm");
    }
    let versions: Vec<u64> = receivers
        .iter()
        .map(|r| r.receiver.borrow().version())
        .collect();
    println!(
        "{kills} kills in {:.1?}: receivers on versions {versions:?}; a kill left them on \
         different versions {split} times, and a receiver with a sync staged {staged_at_kill} \
         times",
        started.elapsed()
    );
    assert!(
        versions.iter().all(|&v| v as usize >= kills / 4),
        "the senders made too little progress to test anything: {versions:?}"
    );
    assert!(
        kills < 50 || (split > 0 && staged_at_kill > 0),
        "no kill landed inside a sync"
    );
}

/// The kill test on host memory: [`KILLS`] kills (`BATON_VERSION_KILLS`), 0 mixed versions.
#[test]
fn a_sender_killed_at_any_moment_of_a_sync_leaves_every_receiver_on_n_or_n_plus_1() {
    let kills = std::env::var("BATON_VERSION_KILLS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(KILLS);
    run(async move { syncs_survive_kills(host_node(), kills).await });
}

/// The kill test on CUDA device memory: 100 kills (`BATON_VERSION_KILLS`).
#[cfg(feature = "gpu-tests")]
#[test]
fn a_sender_killed_at_any_moment_of_a_device_sync_leaves_every_receiver_on_n_or_n_plus_1() {
    let kills = std::env::var("BATON_VERSION_KILLS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(100);
    let _gpu = baton::ipc::cuda::testing::exclusive_gpu(Duration::from_secs(1800))
        .expect("the GPU test lock");
    let cuda = baton::ipc::cuda::CudaBackend::builder(0)
        .build()
        .expect("a CUDA device");
    let node = Node::new(Session::generate().unwrap(), Arc::new(cuda));
    run(async move {
        let device = node.allocate::<u8>(1).unwrap();
        assert!(device.is_device(), "the node allocates device memory");
        drop(device);
        syncs_survive_kills(node, kills).await
    });
}

/// Keep a lease (until the test drops it).
#[derive(Debug, serde::Serialize, serde::Deserialize, Message)]
#[rtype(result = "()")]
struct KeepIt {
    data: Shared<u32>,
}

impl RemoteMessage for KeepIt {
    const NAME: &'static str = "versions.KeepIt";
}

struct Keeper(Rc<RefCell<Vec<Lease<u32>>>>);

impl Actor for Keeper {
    type Context = Context<Self>;
}

impl Handler<KeepIt> for Keeper {
    type Result = ();
    fn handle(&mut self, msg: KeepIt, _: &mut Context<Self>) {
        self.0.borrow_mut().push(msg.data.open().unwrap());
    }
}

/// A sender over a loopback link to a receiver of this process, and its bundles.
struct Loopback {
    node: Node,
    to: baton::actors::RemoteAddr<SyncPart>,
    receiving: Receiving,
    bundles: Vec<Bundle>,
}

impl Loopback {
    async fn new(parts: u32) -> Self {
        let node = host_node();
        let receiving = receiving(&node, "versions.r");
        let to = node.local().await.unwrap().remote::<SyncPart>("versions.r");
        let bundles = (0..parts)
            .map(|_| node.allocate_bundle(layout()).unwrap())
            .collect();
        Self {
            node,
            to,
            receiving,
            bundles,
        }
    }

    /// Writes version `version`'s contents into every part.
    async fn write(&self, version: u64) {
        for (part, b) in (0..).zip(&self.bundles) {
            tokio::time::timeout(DEADLINE, b.buffer().returned())
                .await
                .expect("the part's lease came back");
            b.write("w", &vec![value(version, part); ELEMENTS]).unwrap();
        }
    }

    /// Sends part `part` stamped `stamp` (or unstamped); the receiver's answer.
    async fn send(&self, part: usize, stamp: Option<SyncStamp>) -> Result<u64, String> {
        let bundle = &self.bundles[part];
        let shared = match stamp {
            Some(s) => bundle.share_stamped(s),
            None => bundle.share(),
        };
        let answer = self.to.send(SyncPart { part: shared }).await.unwrap();
        tokio::time::timeout(DEADLINE, bundle.buffer().returned())
            .await
            .expect("the part's lease comes back, taken or refused");
        answer
    }

    fn version(&self) -> u64 {
        self.receiving.receiver.borrow().version()
    }

    fn last_fault(&self) -> VersionFault {
        self.receiving
            .faults
            .borrow()
            .last()
            .cloned()
            .expect("a refusal")
    }
}

#[test]
fn a_version_in_several_parts_commits_only_once_every_part_has_landed() {
    run(async {
        let lo = Loopback::new(3).await;
        let mut sender = SyncSender::new(0);
        for version in 1..=3 {
            assert_eq!(
                sender
                    .begin(3, Instant::now() + Duration::from_secs(30))
                    .unwrap(),
                version
            );
            lo.write(version).await;
            for part in [2, 0, 1] {
                assert_eq!(lo.version(), version - 1, "part {part} not landed yet");
                assert_whole("before the last part", &lo.receiving.receiver.borrow());
                let stamp = sender.stamp(part).unwrap();
                assert_eq!(lo.send(part as usize, Some(stamp)).await, Ok(lo.version()));
            }
            assert_eq!(sender.finish().unwrap(), version);
            assert_eq!(lo.version(), version);
            assert_whole("committed", &lo.receiving.receiver.borrow());
            assert_eq!(lo.receiving.receiver.borrow().parts().len(), 3);
        }
        // The committed copy is the receiver's own: the sender's bundles are free to write.
        lo.write(99).await;
        assert_whole("after the sender wrote on", &lo.receiving.receiver.borrow());
        assert!(lo.receiving.faults.borrow().is_empty());
        drop(lo.node);
    });
}

#[test]
fn stale_skipping_forged_and_unstamped_parts_are_refused_and_the_link_carries_on() {
    run(async {
        let lo = Loopback::new(3).await;
        // Another lease, held by an actor of the receiving side all along.
        let other = lo.node.allocate::<u32>(16).unwrap();
        let kept: Rc<RefCell<Vec<Lease<u32>>>> = Rc::default();
        lo.node
            .register::<KeepIt>("versions.keep", Keeper(kept.clone()).start().recipient());
        let keeper = lo.node.local().await.unwrap();
        keeper
            .remote::<KeepIt>("versions.keep")
            .send(KeepIt {
                data: other.share(),
            })
            .await
            .unwrap();
        let mut sender = SyncSender::new(0);
        sender
            .begin(2, Instant::now() + Duration::from_secs(30))
            .unwrap();
        lo.write(1).await;
        let first = sender.stamp(0).unwrap();
        let second = sender.stamp(1).unwrap();
        // Skipping ahead, and a malformed stamp, before anything is staged.
        let skip = SyncStamp {
            version: 2,
            ..first
        };
        assert!(lo.send(0, Some(skip)).await.unwrap_err().contains("skips"));
        assert_eq!(
            lo.last_fault(),
            VersionFault::Skipped {
                committed: 0,
                got: 2
            }
        );
        for forged in [
            SyncStamp { parts: 0, ..first },
            SyncStamp {
                parts: SyncStamp::MAX_PARTS + 1,
                ..first
            },
            SyncStamp { part: 7, ..first },
            SyncStamp { ttl_ms: 0, ..first },
            SyncStamp {
                ttl_ms: u64::MAX,
                ..first
            },
            SyncStamp {
                version: 0,
                ..first
            },
        ] {
            assert!(lo.send(0, Some(forged)).await.is_err(), "{forged:?}");
            assert!(
                matches!(lo.last_fault(), VersionFault::Malformed { .. }),
                "{forged:?}: {:?}",
                lo.last_fault()
            );
        }
        assert!(lo.send(0, None).await.is_err());
        assert_eq!(lo.last_fault(), VersionFault::Unversioned);
        // Part 0 lands; a duplicate and a part that disagrees are refused, staging stays.
        assert_eq!(lo.send(0, Some(first)).await, Ok(0));
        assert!(lo.send(0, Some(first)).await.is_err());
        assert!(matches!(lo.last_fault(), VersionFault::Inconsistent { .. }));
        assert!(
            lo.send(1, Some(SyncStamp { parts: 3, ..second }))
                .await
                .is_err()
        );
        assert!(matches!(lo.last_fault(), VersionFault::Inconsistent { .. }));
        let staged = lo.receiving.receiver.borrow().staging().unwrap();
        assert_eq!((staged.version, staged.landed, staged.parts), (1, 1, 2));
        assert_eq!(lo.send(1, Some(second)).await, Ok(1));
        assert_eq!(sender.finish().unwrap(), 1);
        assert_whole("committed", &lo.receiving.receiver.borrow());
        // The same version again (a resend, or a restarted sender behind): stale.
        let mut behind = SyncSender::new(0);
        behind
            .begin(2, Instant::now() + Duration::from_secs(30))
            .unwrap();
        let again = behind.stamp(0).unwrap();
        assert!(lo.send(0, Some(again)).await.unwrap_err().contains("stale"));
        assert_eq!(
            lo.last_fault(),
            VersionFault::Stale {
                committed: 1,
                got: 1
            }
        );
        assert_eq!(lo.version(), 1);
        // The link and the other lease survived every refusal; the next sync commits.
        assert_eq!(other.leases_out(), 1, "the other lease is still out");
        assert!(!kept.borrow()[0].is_orphaned());
        kept.borrow_mut().clear();
        sender
            .begin(2, Instant::now() + Duration::from_secs(30))
            .unwrap();
        lo.write(2).await;
        for part in 0..2 {
            let stamp = sender.stamp(part).unwrap();
            lo.send(part as usize, Some(stamp)).await.unwrap();
        }
        assert_eq!(lo.version(), 2);
        assert_whole("after the refusals", &lo.receiving.receiver.borrow());
        drop(keeper);
    });
}

#[test]
fn a_sync_past_its_deadline_or_cancelled_leaves_the_receiver_on_its_version() {
    run(async {
        let lo = Loopback::new(2).await;
        let mut sender = SyncSender::new(0);
        // Past its deadline: the sender stamps no more, the receiver drops what it staged
        // and refuses the part that comes late.
        sender
            .begin(2, Instant::now() + Duration::from_millis(300))
            .unwrap();
        lo.write(1).await;
        let first = sender.stamp(0).unwrap();
        let late = sender.stamp(1).unwrap();
        assert_eq!(lo.send(0, Some(first)).await, Ok(0));
        assert!(lo.receiving.receiver.borrow().staging().is_some());
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(matches!(
            sender.stamp(1),
            Err(ActorError::SyncOver {
                why: "its deadline passed",
                ..
            })
        ));
        assert!(lo.receiving.receiver.borrow().staging().is_none());
        assert!(lo.send(1, Some(late)).await.is_err());
        assert!(matches!(lo.last_fault(), VersionFault::SyncClosed { .. }));
        assert_eq!(lo.version(), 0);

        // Cancelled: the receiver drops it on the cancel, and refuses the rest of it.
        sender
            .begin(2, Instant::now() + Duration::from_secs(30))
            .unwrap();
        let first = sender.stamp(0).unwrap();
        let rest = sender.stamp(1).unwrap();
        assert_eq!(lo.send(0, Some(first)).await, Ok(0));
        let cancel = sender.cancel().expect("a sync under way");
        assert_eq!(cancel.version, 1);
        assert!(lo.receiving.receiver.borrow_mut().cancel(&cancel));
        assert!(lo.receiving.receiver.borrow().staging().is_none());
        assert!(lo.send(1, Some(rest)).await.is_err());
        assert!(matches!(lo.last_fault(), VersionFault::SyncClosed { .. }));
        assert_eq!((lo.version(), sender.version()), (0, 0));

        // The next sync of the same version commits.
        sender
            .begin(2, Instant::now() + Duration::from_secs(30))
            .unwrap();
        for part in 0..2 {
            let stamp = sender.stamp(part).unwrap();
            lo.send(part as usize, Some(stamp)).await.unwrap();
        }
        assert_eq!(sender.finish().unwrap(), 1);
        assert_eq!(lo.version(), 1);
        assert_whole("after the cancels", &lo.receiving.receiver.borrow());
    });
}

#[test]
fn an_infeasible_deadline_is_refused_up_front() {
    let now = Instant::now();
    let mut sender = SyncSender::new(5).with_min_deadline(Duration::from_millis(100));
    for (what, deadline) in [
        (
            "past",
            now.checked_sub(Duration::from_secs(1)).unwrap_or(now),
        ),
        ("now", now),
        ("under the minimum", now + Duration::from_millis(20)),
        (
            "beyond a day",
            now + SyncSender::MAX_DEADLINE + Duration::from_secs(60),
        ),
    ] {
        match sender.begin(1, deadline) {
            Err(ActorError::InfeasibleDeadline { min, .. }) => {
                assert_eq!(min, Duration::from_millis(100), "{what}")
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    assert_eq!(sender.pending(), None, "nothing began");
    assert!(matches!(sender.stamp(0), Err(ActorError::SyncOver { .. })));
    assert_eq!(sender.begin(1, now + Duration::from_secs(5)).unwrap(), 6);
}
