//! Crash soak: hundreds of cycles in which a helper process — an importer of our buffers or
//! an exporter of its own — is SIGKILLed at a random point of the lease protocol:
//!
//! | kind | the child | killed |
//! |---|---|---|
//! | `importer-mid-open` | actor importer | while it maps the buffers of a `Hold` call |
//! | `importer-mid-release` | actor importer | while it drops its leases (`Release`s in flight) |
//! | `importer-mid-revoke` | actor importer, cooperative or stubborn | during a `Revoke` deadline |
//! | `importer-mid-frame` | raw link importer | after writing half a `Release` frame |
//! | `exporter-mid-open` | actor exporter | while it makes and offers buffers we map |
//! | `exporter-mid-release` | actor exporter | while our `Release`s travel to it |
//! | `exporter-mid-revoke` | actor exporter | during the deadline of its `Revoke` of our leases |
//! | `exporter-mid-frame` | raw link exporter | after writing half an `Offer` frame |
//!
//! Every child is spawned by a [`ProcessSupervisor`] of its own (one-child, never
//! restarted), which also kills it. The supervisor runs on a node of its own that holds no
//! link, so the child's death reaches our node through its socket alone, as a crash would.
//!
//! After every cycle: the supervisor reaped the child (`/proc/<pid>` gone or not a zombie
//! when it reports the exit — the test never waits for the child itself), its link is down,
//! every wait had a deadline, our owner has no buffer and no lease left once our handles
//! drop, our import cache maps nothing, none of our segments is left (without a sweep), and
//! after `host::sweep` no segment of the dead child is left either. An importer killed while
//! its offers travel or it maps them held every buffer by its lease until then (checked after
//! our own handles dropped). The CUDA variant also checks, after every cycle, that the
//! backend holds no allocation or mapping (an exact count), and at the end that the device's
//! free memory returned to its baseline (within 1 MiB; its buffers are 2 MiB each, so one
//! leaked buffer shows). It holds the GPU test lock for its run, so no other Baton test
//! shares the device meanwhile.
//!
//! `BATON_SOAK_SEED` replays a run (the seed is printed); `BATON_SOAK_CYCLES` sets the
//! number of cycles (default 200).

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{Events, Parent, eventually, eventually_async};
use baton::actors::supervisor::{KillChild, Shutdown};
use baton::actors::{
    Allocate, Buffer, ChildSpec, Lease, Node, Peer, ProcessSupervisor, Restart, RestartPolicy,
    Revoke, Strategy, SupervisorEvent,
};
use baton::ipc::{HostBackend, SharedBackend, host};
use msgs::*;
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Every wait of the soak ends by this deadline, or the test fails saying what it waited for.
const DEADLINE: Duration = Duration::from_secs(30);
/// The revoke deadline of the revoke cycles.
const REVOKE_WITHIN: Duration = Duration::from_millis(150);

/// SplitMix64: small, seedable, good enough to pick kill points.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn micros(&mut self, max: u64) -> Duration {
        Duration::from_micros(self.below(max + 1))
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    ImporterMidOpen,
    ImporterMidRelease,
    ImporterMidRevoke,
    ImporterMidFrame,
    ExporterMidOpen,
    ExporterMidRelease,
    ExporterMidRevoke,
    ExporterMidFrame,
}

const KINDS: [Kind; 8] = [
    Kind::ImporterMidOpen,
    Kind::ImporterMidRelease,
    Kind::ImporterMidRevoke,
    Kind::ImporterMidFrame,
    Kind::ExporterMidOpen,
    Kind::ExporterMidRelease,
    Kind::ExporterMidRevoke,
    Kind::ExporterMidFrame,
];

/// Which memory the soak runs on.
#[derive(Clone)]
enum Device {
    Host,
    Cuda(Arc<baton::ipc::cuda::CudaBackend>),
}

/// This process's side: the actor tests' [`Parent`] (a node listening in a private
/// directory, a buffer owner, a log of link events), with the soak's own spawning.
struct Rig {
    parent: Parent,
    /// The node the children's supervisors run on: same session, no links.
    spawner: Node,
    /// Where raw children write their status lines.
    status_dir: tempfile::TempDir,
    spawned: std::cell::Cell<u32>,
    /// Whether our buffers are host segments (else device memory).
    on_host: bool,
    /// `u32`s per buffer, ours and the children's: 1 KiB on host, 2 MiB on CUDA (above the
    /// 1 MiB tolerance of the device-wide measure).
    elems: u32,
    cuda: Option<Arc<baton::ipc::cuda::CudaBackend>>,
}

impl std::ops::Deref for Rig {
    type Target = Parent;
    fn deref(&self) -> &Parent {
        &self.parent
    }
}

/// Records a supervisor's events.
struct SupervisorLog(Arc<Mutex<Vec<SupervisorEvent>>>);

impl Actor for SupervisorLog {
    type Context = Context<Self>;
}

impl Handler<SupervisorEvent> for SupervisorLog {
    type Result = ();
    fn handle(&mut self, e: SupervisorEvent, _: &mut Context<Self>) {
        self.0.lock().unwrap().push(e);
    }
}

/// One child under a supervisor of its own. SIGKILLed (through a pidfd, so never a
/// recycled pid) if the test fails before the supervisor reaped it.
struct Child {
    supervisor: Addr<ProcessSupervisor>,
    events: Arc<Mutex<Vec<SupervisorEvent>>>,
    name: String,
    pid: u32,
    pidfd: OwnedFd,
    /// The raw child's status file (see `baton-test-peer`), if any.
    status: Option<PathBuf>,
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = rustix::process::pidfd_send_signal(&self.pidfd, rustix::process::Signal::KILL);
        self.supervisor.do_send(Shutdown);
    }
}

impl Child {
    /// Has the supervisor SIGKILL the child, now (without waiting).
    fn kill(&self) {
        self.supervisor.do_send(KillChild(self.name.clone()));
    }

    /// How the child ended, once the supervisor reported it.
    fn exit_status(&self) -> Option<String> {
        self.events.lock().unwrap().iter().find_map(|e| match e {
            SupervisorEvent::Exited { pid, status, .. } if *pid == self.pid => Some(status.clone()),
            _ => None,
        })
    }

    /// Waits for the supervisor to report the child's exit, then checks that it reaped it.
    async fn reaped(&self) -> String {
        eventually(
            DEADLINE,
            "the supervisor to report the child's exit",
            || self.exit_status().is_some(),
        )
        .await;
        assert!(
            peer::reaped(self.pid),
            "the supervisor reported child {} gone but left a zombie",
            self.pid
        );
        self.exit_status().expect("just seen")
    }
}

impl Rig {
    fn start(tag: &str, device: &Device) -> Rig {
        let ns = peer::namespace(tag);
        let (backend, kind, elems, cuda): (SharedBackend, _, _, _) = match device {
            Device::Host => (
                Arc::new(HostBackend::with_namespace(&ns).unwrap()),
                "host",
                256,
                None,
            ),
            Device::Cuda(cuda) => (
                Arc::clone(cuda) as SharedBackend,
                "cuda",
                (2 << 20) / 4,
                Some(Arc::clone(cuda)),
            ),
        };
        let mut parent = Parent::start_with(&ns, Arc::clone(&backend));
        parent.child_env.push(("BATON_BACKEND".into(), kind.into()));
        if let Some(cuda) = &cuda {
            // Children export device memory the way we do.
            parent
                .child_env
                .push(("BATON_CUDA_EXPORT".into(), cuda.export().name().into()));
        }
        let spawner = Node::new(parent.session.clone(), backend);
        Rig {
            parent,
            spawner,
            status_dir: tempfile::tempdir().unwrap(),
            spawned: std::cell::Cell::new(0),
            on_host: kind == "host",
            elems,
            cuda,
        }
    }

    /// Spawns `exe args…` under a supervisor of its own, with our session, namespace and
    /// `child_env` (and a status file, for raw children), and waits for its link.
    async fn spawn(&self, exe: &str, args: &[&str], raw: bool) -> (Child, Peer) {
        self.spawned.set(self.spawned.get() + 1);
        let name = format!("child-{}", self.spawned.get());
        let mut spec = ChildSpec::new(name.clone(), exe)
            .restart(Restart::Temporary)
            .env(host::NAMESPACE_ENV, &self.ns);
        for a in args {
            spec = spec.arg(*a);
        }
        for (k, v) in &self.child_env {
            spec = spec.env(k, v);
        }
        let status = raw.then(|| self.status_dir.path().join(&name));
        if let Some(path) = &status {
            spec = spec.env("BATON_PEER_STATUS", path.to_str().unwrap());
        }
        let events = Arc::new(Mutex::new(Vec::new()));
        let before = self.events.ups().len();
        let supervisor = ProcessSupervisor::new(
            self.spawner.clone(),
            vec![spec],
            Strategy::OneForOne,
            RestartPolicy::default(),
        )
        .subscriber(SupervisorLog(Arc::clone(&events)).start().recipient())
        .start();
        let started = || {
            events.lock().unwrap().iter().find_map(|e| match e {
                SupervisorEvent::Started { pid, .. } => Some(*pid),
                _ => None,
            })
        };
        eventually(DEADLINE, "the supervisor to start the child", || {
            started().is_some()
        })
        .await;
        let pid = started().expect("just seen");
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(pid as i32).expect("a pid"),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap_or_else(|e| {
            panic!(
                "child {pid} is gone already ({e}): {:?}",
                events.lock().unwrap()
            )
        });
        let child = Child {
            supervisor,
            events,
            name,
            pid,
            pidfd,
            status,
        };
        let find = || {
            self.events
                .ups()
                .into_iter()
                .skip(before)
                .find(|p| p.process().pid == pid)
        };
        eventually(DEADLINE, "the child's link", || {
            assert!(
                child.exit_status().is_none(),
                "the child exited before its link came up: {:?}",
                child.exit_status()
            );
            find().is_some()
        })
        .await;
        let link = find().expect("just seen");
        (child, link)
    }

    /// An actor helper (`baton-actor-peer serve`).
    async fn actor_child(&self, stubborn: bool) -> (Child, Peer) {
        let sock = self.listening.path().to_str().unwrap().to_owned();
        let mode = if stubborn { "stubborn" } else { "cooperative" };
        self.spawn(
            peer::exe("baton-actor-peer"),
            &["serve", &sock, mode],
            false,
        )
        .await
    }

    /// A raw link helper (`baton-test-peer ROLE`), whose status lines go to a file.
    async fn raw_child(&self, role: &str) -> (Child, Peer) {
        let sock = self.listening.path().to_str().unwrap().to_owned();
        self.spawn(peer::exe("baton-test-peer"), &[role, &sock], true)
            .await
    }

    async fn buffers(&self, n: u64, seed: u32) -> Vec<Buffer<u32>> {
        let mut out = Vec::new();
        for i in 0..n {
            let b: Buffer<u32> = self
                .owner
                .send(Allocate::vector(self.elems.into()))
                .await
                .unwrap()
                .unwrap();
            b.write_at(0, &[pattern(seed, i as usize)]).unwrap();
            out.push(b);
        }
        out
    }
}

/// Lets the event loop run for `d`, to the microsecond (tokio's timers tick in
/// milliseconds): this picks a kill point, it synchronises nothing.
async fn pause(d: Duration) {
    let until = Instant::now() + d;
    if d > Duration::from_millis(2) {
        tokio::time::sleep(d - Duration::from_millis(2)).await;
    }
    while Instant::now() < until {
        tokio::task::yield_now().await;
    }
}

/// Waits for a raw child to say `want` (a line of its status file).
async fn wait_line(child: &Child, want: &str) {
    let path = child.status.as_ref().expect("a raw child");
    eventually(DEADLINE, &format!("the child to say {want:?}"), || {
        std::fs::read_to_string(path).is_ok_and(|text| text.lines().any(|l| l == want))
    })
    .await;
}

/// What the cycles of one kind saw, for the summary, and where to aim their kills.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    cycles: u32,
    /// Kills aimed at an operation we could time (a call).
    aimed: u32,
    /// Of those, operations that finished before the kill landed.
    finished_first: u32,
    /// Links we (not the kill) cut first: a stubborn holder past its revoke deadline.
    cut_by_us: u32,
    /// Segments of dead children removed by the sweep.
    swept: u32,
    /// How long the operation takes when nothing kills it (a running average).
    window: Duration,
}

impl Tally {
    /// A kill point: uniform over the operation's usual duration and a quarter beyond.
    fn kill_point(&mut self, rng: &mut Rng) -> Duration {
        self.aimed += 1;
        let window = if self.window.is_zero() {
            Duration::from_millis(2)
        } else {
            self.window
        };
        rng.micros(window.as_micros() as u64 * 5 / 4)
    }

    /// The operation finished before the kill, after `took`.
    fn finished(&mut self, took: Duration) {
        self.finished_first += 1;
        self.window = if self.window.is_zero() {
            took
        } else {
            (self.window * 3 + took) / 4
        };
    }
}

/// One cycle: spawn, work, SIGKILL at a random point, then check that everything is back.
async fn cycle(rig: &Rig, kind: Kind, rng: &mut Rng, tally: &mut Tally) {
    let seed = rng.next() as u32;
    let k = 1 + rng.below(24);
    let links_before = rig.node.peers().len();
    let (child, link) = match kind {
        Kind::ImporterMidFrame | Kind::ExporterMidFrame => {
            let role = if kind == Kind::ImporterMidFrame {
                "half-frame-import"
            } else {
                "half-frame-export"
            };
            let (child, link) = rig.raw_child(role).await;
            mid_frame(rig, kind, &link, &child, k, seed).await;
            (child, link)
        }
        _ => {
            let stubborn = kind == Kind::ImporterMidRevoke && rng.coin();
            let (child, link) = rig.actor_child(stubborn).await;
            match kind {
                Kind::ImporterMidOpen | Kind::ImporterMidRelease | Kind::ImporterMidRevoke => {
                    as_exporter(rig, kind, &child, &link, rng, k, seed, tally).await
                }
                _ => as_importer(kind, &child, &link, rng, k, seed, rig.elems, tally).await,
            }
            (child, link)
        }
    };
    assert_eq!(link.process().pid, child.pid, "the link is the child's");
    // The supervisor kills the child (if the cycle did not have it killed already) and reaps
    // it; we only look at /proc.
    child.kill();
    child.reaped().await;

    // Its link is down, and everything it held of ours came back.
    eventually(DEADLINE, "the dead child's link to go down", || {
        !link.is_connected() && rig.node.peers().len() == links_before
    })
    .await;
    eventually_async(DEADLINE, "our owner to have nothing left", || async {
        let s = rig.stats().await;
        s.buffers == 0 && s.leases == 0
    })
    .await;
    eventually(DEADLINE, "our import cache to map nothing", || {
        rig.node.cache().stats().live == 0
    })
    .await;
    if let Some(cuda) = &rig.cuda {
        eventually(DEADLINE, "our CUDA backend to hold nothing", || {
            cuda.live().is_empty()
        })
        .await;
    }
    // Our own segments went without a sweep; the dead child's are swept.
    let me = std::process::id();
    let ours: Vec<_> = host::list_segments(&rig.ns)
        .unwrap()
        .into_iter()
        .filter(|s| s.owner_pid == me)
        .collect();
    assert!(
        ours.is_empty(),
        "our segments outlived their buffers: {ours:?}"
    );
    let report = host::sweep(&rig.ns).unwrap();
    tally.swept += report.removed.len() as u32;
    assert_eq!(report.kept, 0, "a segment of a live owner is left");
    assert!(
        host::list_segments(&rig.ns).unwrap().is_empty(),
        "segments left after the sweep"
    );
    drop(child);
    tally.cycles += 1;
}

/// We export, the child imports; it dies at a random point.
#[allow(clippy::too_many_arguments)]
async fn as_exporter(
    rig: &Rig,
    kind: Kind,
    child: &Child,
    link: &Peer,
    rng: &mut Rng,
    k: u64,
    seed: u32,
    tally: &mut Tally,
) {
    let buffers = rig.buffers(k, seed).await;
    let hold = link.remote::<Hold>("holder");
    let shares = || Hold {
        buffers: buffers.iter().map(Buffer::share).collect(),
    };
    match kind {
        Kind::ImporterMidOpen => {
            // The call is queued now; the child maps the buffers when it arrives. Our
            // handles go at once: from the moment the offers are sent, every buffer is held
            // by its lease (retiring, not freed), whether they still travel or are mapped.
            let call = hold.send_timeout(shares(), DEADLINE);
            drop(buffers);
            eventually_async(DEADLINE, "every buffer held by its lease", || async {
                let s = rig.stats().await;
                (s.buffers, s.retiring, s.leases) == (k as usize, k as usize, k as usize)
            })
            .await;
            if rig.on_host {
                assert_eq!(rig.segments(), k as usize, "the memory is still there");
            }
            let start = Instant::now();
            pause(tally.kill_point(rng)).await;
            child.kill();
            if call.await.is_ok() {
                tally.finished(start.elapsed());
            }
        }
        Kind::ImporterMidRelease => {
            assert_eq!(
                hold.send_timeout(shares(), DEADLINE).await.unwrap(),
                k as usize
            );
            let free_first = rng.coin();
            let buffers = if free_first {
                drop(buffers); // retiring: freed when the last lease returns
                Vec::new()
            } else {
                buffers
            };
            let start = Instant::now();
            let call = link
                .remote::<DropHeld>("holder.drop")
                .send_timeout(DropHeld, DEADLINE);
            pause(tally.kill_point(rng)).await;
            child.kill();
            if call.await.is_ok() {
                tally.finished(start.elapsed());
            }
            drop(buffers);
        }
        Kind::ImporterMidRevoke => {
            assert_eq!(
                hold.send_timeout(shares(), DEADLINE).await.unwrap(),
                k as usize
            );
            for b in &buffers {
                let asked = rig
                    .owner
                    .send(Revoke {
                        buffer: b.id(),
                        within: REVOKE_WITHIN,
                    })
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(asked, 1);
            }
            let at = rng.micros(REVOKE_WITHIN.as_micros() as u64 * 5 / 4);
            pause(at).await;
            if !link.is_connected() {
                tally.cut_by_us += 1;
            }
            child.kill();
            drop(buffers);
        }
        _ => unreachable!(),
    }
}

/// The child exports, we import; it dies at a random point.
#[allow(clippy::too_many_arguments)]
async fn as_importer(
    kind: Kind,
    child: &Child,
    link: &Peer,
    rng: &mut Rng,
    k: u64,
    seed: u32,
    elems: u32,
    tally: &mut Tally,
) {
    let make = link.remote::<MakeBuffers>("exporter");
    let request = MakeBuffers {
        n: k as u32,
        len: elems,
        seed,
    };
    match kind {
        Kind::ExporterMidOpen => {
            let start = Instant::now();
            let call = make.send_timeout(request, DEADLINE);
            pause(tally.kill_point(rng)).await;
            child.kill();
            if let Ok(made) = call.await {
                tally.finished(start.elapsed());
                // Opened or orphaned: either way the mapping closes when the guard drops.
                let leases: Vec<Lease<u32>> = made
                    .buffers
                    .into_iter()
                    .map(|s| s.open().unwrap())
                    .collect();
                drop(leases);
            }
        }
        Kind::ExporterMidRelease => {
            let made = make.send_timeout(request, DEADLINE).await.unwrap();
            let mut leases: Vec<Lease<u32>> = made
                .buffers
                .into_iter()
                .map(|s| s.open().unwrap())
                .collect();
            for (i, l) in leases.iter().enumerate() {
                assert_eq!(l.to_vec().unwrap()[0], pattern(seed, 0), "lease {i}");
            }
            // Drop some, let their Releases travel, kill, drop the rest (orphaned by then,
            // or not yet: either way nothing may leak).
            let keep = leases.split_off(rng.below(k + 1) as usize);
            drop(leases);
            pause(rng.micros(1_000)).await;
            child.kill();
            drop(keep);
        }
        Kind::ExporterMidRevoke => {
            let made = make.send_timeout(request, DEADLINE).await.unwrap();
            let mut leases: Vec<Lease<u32>> = made
                .buffers
                .into_iter()
                .map(|s| s.open().unwrap())
                .collect();
            let asked = link
                .remote::<RevokeAll>("revoker")
                .send_timeout(
                    RevokeAll {
                        within_ms: REVOKE_WITHIN.as_millis() as u32,
                    },
                    DEADLINE,
                )
                .await
                .unwrap();
            assert_eq!(asked, k as usize);
            // Give some back in time, keep the rest; the exporter dies during the deadline.
            let keep = leases.split_off(rng.below(k + 1) as usize);
            drop(leases);
            pause(rng.micros(REVOKE_WITHIN.as_micros() as u64)).await;
            child.kill();
            drop(keep);
        }
        _ => unreachable!(),
    }
}

/// A raw link peer writes half a frame; it is killed then.
async fn mid_frame(rig: &Rig, kind: Kind, link: &Peer, child: &Child, k: u64, seed: u32) {
    let buffers = if kind == Kind::ImporterMidFrame {
        let buffers = rig.buffers(k, seed).await;
        let held = link
            .remote::<Hold>("holder")
            .send_timeout(
                Hold {
                    buffers: buffers.iter().map(Buffer::share).collect(),
                },
                DEADLINE,
            )
            .await
            .unwrap();
        assert_eq!(held, k as usize);
        buffers
    } else {
        Vec::new()
    };
    wait_line(child, "half").await;
    // The caller kills now; the half frame must read as a truncated frame, not a clean end.
    drop(buffers);
}

fn gone_reason(events: &Events, link: &Peer) -> Option<String> {
    events.down_reason(link.link_id()).flatten()
}

fn cycles() -> u32 {
    std::env::var("BATON_SOAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

fn seed() -> u64 {
    std::env::var("BATON_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        })
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn soak(device: Device, tag: &str) {
    let seed = seed();
    let n = cycles();
    eprintln!("soak[{tag}]: seed {seed} ({n} cycles; replay with BATON_SOAK_SEED={seed})");
    System::new().block_on(async move {
        let rig = Rig::start(tag, &device);
        let mut rng = Rng(seed);
        let mut tallies: BTreeMap<Kind, Tally> = BTreeMap::new();
        let mut truncated = 0u32;

        // A warm-up cycle of each kind: first uses allocate what later ones reuse (runtime
        // descriptors, the driver's per-process state), so baselines are taken after it.
        for kind in KINDS {
            let mut t = Tally::default();
            cycle(&rig, kind, &mut rng, &mut t).await;
        }
        let fds = open_fds();
        let free = device_free(&device);

        let start = Instant::now();
        let mut order = KINDS;
        for i in 0..n as usize {
            if i % KINDS.len() == 0 {
                // A fresh random order of the kinds for each round.
                for j in (1..order.len()).rev() {
                    order.swap(j, rng.below(j as u64 + 1) as usize);
                }
            }
            let kind = order[i % KINDS.len()];
            let ups = rig.events.ups().len();
            let tally = tallies.entry(kind).or_default();
            cycle(&rig, kind, &mut rng, tally).await;
            if matches!(kind, Kind::ImporterMidFrame | Kind::ExporterMidFrame) {
                let link = rig.events.ups()[ups].clone();
                // The event log hears of the link's end a moment after the link ends.
                eventually(DEADLINE, "the link's Down event", || {
                    rig.events.down_reason(link.link_id()).is_some()
                })
                .await;
                let why = gone_reason(&rig.events, &link).unwrap_or_default();
                assert!(
                    why.contains("Truncated"),
                    "{kind:?}: a half frame must end the link as truncated, not {why:?}"
                );
                truncated += 1;
            }
        }
        let elapsed = start.elapsed();

        // Nothing accumulated over the run.
        eventually(DEADLINE, "descriptors back to the baseline", || {
            open_fds() <= fds
        })
        .await;
        if let (Some(baseline), Device::Cuda(cuda)) = (free, &device) {
            let mut last = 0;
            eventually(DEADLINE, "device free memory back to its baseline", || {
                last = cuda.mem_get_info().unwrap().0;
                last.abs_diff(baseline) <= 1 << 20
            })
            .await;
            eprintln!(
                "soak[{tag}]: device free memory {baseline} -> {last} bytes (|diff| {} bytes)",
                last.abs_diff(baseline)
            );
        }
        let total: u32 = tallies.values().map(|t| t.cycles).sum();
        eprintln!(
            "soak[{tag}]: {total} cycles in {:.1} s ({:.0} ms/cycle), seed {seed}; \
             half frames seen as truncated: {truncated}; open fds {} (baseline {fds})",
            elapsed.as_secs_f64(),
            elapsed.as_secs_f64() * 1e3 / f64::from(total.max(1)),
            open_fds()
        );
        for (kind, t) in &tallies {
            eprintln!(
                "soak[{tag}]:   {kind:?}: {} cycles; {}/{} timed operations finished before \
                 the kill (usual duration {:?}); {} links cut by us first; {} segments swept",
                t.cycles, t.finished_first, t.aimed, t.window, t.cut_by_us, t.swept
            );
        }
        assert_eq!(total, n);
        drop(rig);
    });
}

fn device_free(device: &Device) -> Option<usize> {
    match device {
        Device::Host => None,
        Device::Cuda(cuda) => {
            cuda.synchronize().unwrap();
            // What the pool keeps for reuse is no leak.
            cuda.trim_pool(0).unwrap();
            Some(cuda.mem_get_info().unwrap().0)
        }
    }
}

#[test]
fn host_crash_soak() {
    soak(Device::Host, "soak");
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: --features gpu-tests"
)]
fn cuda_crash_soak() {
    use baton::ipc::cuda::{CudaBackend, CudaExport};
    let _gpu = baton::ipc::cuda::testing::exclusive_gpu(Duration::from_secs(1800))
        .expect("the GPU test lock");
    // Every export kind, unless `BATON_SOAK_EXPORTS` names some (`legacy,vmm,pool`).
    let kinds = std::env::var("BATON_SOAK_EXPORTS").unwrap_or_else(|_| "legacy,vmm,pool".into());
    for name in kinds.split(',').map(str::trim).filter(|k| !k.is_empty()) {
        let export = CudaExport::parse(name).unwrap_or_else(|| panic!("no export kind {name:?}"));
        let cuda = CudaBackend::new(0, export)
            .unwrap_or_else(|e| panic!("the CUDA backend is unavailable: {e}"));
        eprintln!("soak[cuda {name}]: {cuda:?}");
        soak(Device::Cuda(Arc::new(cuda)), &format!("soakcu{name}"));
    }
}
