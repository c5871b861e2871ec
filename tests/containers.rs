//! Processes in namespaces of their own, as containers are (issue 51, item 1): what links
//! and what is refused, with the reason. Each test starts its peer under `unshare(1)`, so
//! it needs root (and util-linux): `#[ignore]`d otherwise — CI runs them as root.
//!
//! - A peer in a network namespace of its own (`unshare -n`), sharing only the socket's
//!   directory, links over that Unix socket and maps our host memory (memfd descriptors
//!   over the socket need no shared network, PID or IPC namespace): the typed round trip
//!   of two buffers, read and answered exactly.
//! - A peer in a PID namespace of its own as well (`unshare -p -n -f`) links the same way:
//!   we prove it by the pid `/proc` translates for it (`NSpid`) and its start time; it
//!   cannot see us at all and binds our claim to the kernel's pidfd for the socket's peer
//!   (`SO_PEERPIDFD`). Both watch the other die through that pidfd.
//! - The freeing rule across PID namespaces: memory that must not be freed while a live
//!   process maps it stays quarantined while a cut holder in another PID namespace lives
//!   (its claimed pid names another process here), and is freed once it dies.
//! - A claim from a nested PID namespace is checked against what `/proc` says of the
//!   process: its own namespace's pid and its start time, nothing else.
//! - Named host segments of a peer in another PID namespace sharing our `/dev/shm`: the
//!   segment names its owner's namespace beside its pid, and our sweep judges that owner
//!   through its pidfd (kept while it lives, removed once it died), never by a pid that
//!   is another process here.
//!
//! On a kernel without `SO_PEERPIDFD` (Linux 6.5) or pidfs (6.9) such a peer is refused,
//! typed, with the reason (`Error::PeerInOtherPidNamespace`); the unit tests of
//! `baton_ipc::link::creds` cover that branch. `docs/CROSS_HOST.md`, "Containers", says
//! what works across namespaces and why.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actors::{DEADLINE, LegacyLike, Parent, eventually, eventually_async, run};
use baton::actors::{Peer, Revoke};
use baton::ipc::host::{HOST_ENV, NAMESPACE_ENV};
use baton::ipc::{Error as IpcError, HostBackend, PeerCred};
use baton::messages::ProcessId;
use msgs::{CheckPair, Hold, pattern};
use rustix::process::{Pid, Signal, kill_process};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A parent whose host memory is memfds (what crosses namespaces: no named segment in a
/// shared `/dev/shm`), and whose children allocate the same.
fn memfd_parent(tag: &str) -> Parent {
    let ns = peer::namespace(tag);
    let mut parent = Parent::start_with(&ns, Arc::new(HostBackend::memfd().unwrap()));
    parent
        .child_env
        .push(("BATON_BACKEND".into(), "host".into()));
    parent.child_env.push((HOST_ENV.into(), "memfd".into()));
    parent
}

/// The peer reads two of our buffers (a pattern, and `i * 0.5`), checks them, and answers
/// with their sum in a buffer of its own.
async fn send_check_pair(
    parent: &Parent,
    link: &Peer,
    n: usize,
    seed: u32,
) -> Result<msgs::PairChecked, baton::actors::ActorError> {
    let a = parent.pattern_buffer(n, seed).await;
    let b: baton::Buffer<f32> = parent
        .owner
        .send(baton::actors::Allocate::vector(n as u64))
        .await
        .unwrap()
        .unwrap();
    b.write_at(0, &(0..n).map(|i| i as f32 * 0.5).collect::<Vec<_>>())
        .unwrap();
    link.remote::<CheckPair>("checker")
        .send(CheckPair {
            seed,
            a: a.share(),
            b: b.share(),
        })
        .await
}

/// [`send_check_pair`], which must succeed, the peer reading our memory right.
async fn check_pair(parent: &Parent, link: &Peer, n: usize, seed: u32) -> msgs::PairChecked {
    let reply = send_check_pair(parent, link, n, seed).await.unwrap();
    assert!(reply.ok, "the peer in its own namespaces read our memory");
    reply
}

/// The typed round trip across namespaces ([`check_pair`]): the peer's answer must come as
/// a memfd over the socket and read back here.
async fn maps_our_memory_and_answers_in_its_own(parent: &Parent, link: &Peer, n: usize, seed: u32) {
    let reply = check_pair(parent, link, n, seed).await;
    let sum = reply.sum.open().unwrap();
    assert_eq!(
        sum.path(),
        baton::actors::LeasePath::HostMemfd,
        "its memory came as a memfd over the socket"
    );
    let sum = sum.to_vec().unwrap();
    assert!(
        sum.iter()
            .enumerate()
            .all(|(i, v)| *v == pattern(seed, i) as f32 + i as f32 * 0.5),
        "and its answer, in its memory, reads back here"
    );
}

#[test]
#[ignore = "needs root (unshare: a network namespace)"]
fn a_peer_in_its_own_network_namespace_links_and_maps_our_host_memory() {
    run(async {
        let parent = memfd_parent("ct-net");
        let sock = parent.socket();
        let exe = peer::exe("baton-actor-peer");
        // `unshare -n` execs the peer (no fork): the pid we see is the peer's.
        let (mut child, link) = parent
            .spawn_linked("unshare", &["-n", exe, "serve", &sock], false)
            .await;
        maps_our_memory_and_answers_in_its_own(&parent, &link, 100_000, 7).await;
        link.close_and_wait().await;
        assert!(child.wait(DEADLINE).success());
    });
}

/// A peer under `unshare ARGS… baton-actor-peer serve SOCKET EXTRA…` (memfd host memory,
/// our session), and its link.
/// A PID namespace goes with `--mount-proc`, as a container's does: a process reads its own
/// identity from `/proc/self`, which must be its namespace's.
async fn spawn_in_namespaces(
    parent: &Parent,
    unshare: &[&str],
    extra: &[&str],
) -> (Namespaced, Peer) {
    spawn_in_namespaces_with(parent, unshare, extra, &[]).await
}

/// [`spawn_in_namespaces`], with more environment variables (after the defaults: they win).
async fn spawn_in_namespaces_with(
    parent: &Parent,
    unshare: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Namespaced, Peer) {
    let sock = parent.socket();
    let ups = parent.events.ups().len();
    let mut cmd = Command::new("unshare");
    cmd.args(unshare)
        .args([peer::exe("baton-actor-peer"), "serve", &sock])
        .args(extra)
        .env(NAMESPACE_ENV, &parent.ns)
        .env(HOST_ENV, "memfd")
        .env("BATON_BACKEND", "host")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    parent.session.pass_to(&mut cmd).unwrap();
    let ns = Namespaced::start(&mut cmd);
    eventually(DEADLINE, "the namespaced peer's link", || {
        parent.events.ups().len() > ups
    })
    .await;
    let link = parent.events.ups().swap_remove(ups);
    (ns, link)
}

/// `unshare -f …` and the one child it forked, the init of the new PID namespace. Dropped
/// (a test that failed half-way), it kills that init, and with it the namespace, so no
/// process outlives the test.
struct Namespaced {
    unshare: std::process::Child,
    /// The forked child's pid here.
    inner: u32,
}

impl Namespaced {
    /// Starts `cmd` once the init of the namespace started before it (by any test of this
    /// file, which run in parallel) is two clock ticks old. An init claims pid 1 of its own
    /// namespace, and a process is named by its boot, pid and start time in clock ticks
    /// (10 ms): two inits started within one tick claim one name, and a process that
    /// already knows one of them refuses the other (`PeerIdentityMismatch`) — its link
    /// never comes up. (Containers started that close together, linking to one process, meet
    /// the same refusal: docs/CROSS_HOST.md.)
    fn start(cmd: &mut Command) -> Namespaced {
        static SPACED: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _spaced = SPACED.lock().unwrap_or_else(|p| p.into_inner());
        let mut unshare = cmd.spawn().unwrap();
        let inner = peer::forked_child(&mut unshare, "unshare");
        std::thread::sleep(Duration::from_millis(20));
        Namespaced { unshare, inner }
    }

    fn signal(&self, sig: Signal) {
        kill_process(Pid::from_raw(self.inner as i32).unwrap(), sig).unwrap();
    }

    /// `unshare`'s exit, once its child has ended.
    fn reaped(&mut self) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.unshare.try_wait().unwrap() {
                return status;
            }
            assert!(start.elapsed() < DEADLINE, "unshare never exited");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Namespaced {
    fn drop(&mut self) {
        if self.unshare.try_wait().ok().flatten().is_none() {
            let _ = kill_process(Pid::from_raw(self.inner as i32).unwrap(), Signal::KILL);
            let _ = self.unshare.kill();
            let _ = self.unshare.wait();
        }
    }
}

#[test]
#[ignore = "needs root (unshare: a PID namespace)"]
fn a_peer_in_its_own_pid_and_network_namespaces_links_and_maps_our_host_memory() {
    run(async {
        let parent = memfd_parent("ct-pid");
        let (mut ns, link) =
            spawn_in_namespaces(&parent, &["-p", "-n", "-f", "--mount-proc"], &[]).await;
        // It names itself as its namespace does: pid 1, its init.
        let claimed = link.process();
        assert_eq!(claimed.pid, 1, "{claimed}");
        assert_eq!(
            baton::ipc::process::pid_in_nested_namespace(ns.inner),
            Some(1)
        );
        assert!(
            baton::ipc::process::is_observed(&claimed),
            "watched through a pidfd, not by the pid it claims"
        );
        maps_our_memory_and_answers_in_its_own(&parent, &link, 50_000, 3).await;
        link.close_and_wait().await;
        assert!(ns.reaped().success());
        eventually(DEADLINE, "its death seen through the pidfd", || {
            baton::ipc::process::liveness(&claimed) == baton::ipc::process::Liveness::Dead
        })
        .await;
        // The listener serves the next peer, from our own namespace, as before.
        let (mut next, link) = parent.child(&[]).await;
        link.close_and_wait().await;
        assert!(next.wait(DEADLINE).success());
    });
}

/// The freeing rule across PID namespaces. The holder claims pid 1, which here is our own
/// init: `/proc` would call the holder dead at once (another start time) and let memory it
/// still maps be freed. Watched through its pidfd, its memory stays quarantined while it
/// lives, stopped and cut, and is freed once it dies.
#[test]
#[ignore = "needs root (unshare: a PID namespace)"]
fn legacy_like_memory_held_across_pid_namespaces_is_quarantined_until_the_holder_dies() {
    run(async {
        let ns = peer::namespace("ct-quar");
        let backend = Arc::new(LegacyLike(HostBackend::memfd().unwrap()));
        let parent = Parent::start_with(&ns, backend);
        let (mut ns, link) = spawn_in_namespaces(
            &parent,
            &["-p", "-f", "--mount-proc"],
            &["stubborn", "linger"],
        )
        .await;
        let holder = link.process();
        const LEN: usize = 4096;
        let buf = parent.pattern_buffer(LEN, 5).await;
        let id = buf.id();
        link.remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![buf.share()],
            })
            .await
            .unwrap();
        drop(buf);

        ns.signal(Signal::STOP);
        let asked = parent
            .owner
            .send(Revoke {
                buffer: id,
                within: Duration::from_millis(300),
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(asked, 1);
        eventually(DEADLINE, "the stopped holder cut off", || {
            parent.events.down_reason(link.link_id()).is_some()
        })
        .await;
        let quarantined = || async {
            parent
                .table()
                .await
                .iter()
                .any(|b| b.buffer == id && b.quarantined && b.cut_holders == [holder])
        };
        assert!(quarantined().await, "{:?}", parent.table().await);
        // Long enough for a death watch by pid to have freed it (it reports at once).
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            quarantined().await,
            "still quarantined while the holder lives: {:?}",
            parent.table().await
        );
        assert_eq!(parent.stats().await.quarantined_bytes, (LEN * 4) as u64);

        // The holder is its namespace's init: killed, the namespace goes with it.
        ns.signal(Signal::KILL);
        ns.reaped();
        eventually_async(
            DEADLINE,
            "the memory freed after the holder died",
            || async { parent.table().await.iter().all(|b| b.buffer != id) },
        )
        .await;
        assert_eq!(parent.stats().await.quarantined, 0);
    });
}

/// From our side: a process in a PID namespace nested below ours has a pid here, but
/// claims its own namespace's (1, 2, …). The claim holds when it is the pid `/proc`
/// translates for it (`NSpid`) with its start time; any other is refused as a mismatch.
/// (A claim of the pid we see, with its start time, names it as well as `/proc` can: it
/// holds, and is watched by that pid.)
#[test]
#[ignore = "needs root (unshare: a PID namespace)"]
fn a_claim_from_a_nested_pid_namespace_is_checked_by_its_namespace_pid_and_start_time() {
    let mut ns = Namespaced::start(Command::new("unshare").args(["-p", "-f", "sleep", "30"]));
    let inner = ns.inner;
    assert!(baton::ipc::process::in_nested_pid_namespace(inner));
    assert!(!baton::ipc::process::in_nested_pid_namespace(
        std::process::id()
    ));
    let cred = PeerCred {
        pid: inner,
        uid: 0,
        gid: 0,
    };
    let started = baton::ipc::process::start_ticks(inner).unwrap();
    let claim = |pid, start_ticks| ProcessId {
        boot: baton::ipc::process::boot_id(),
        pid,
        start_ticks,
    };
    for lie in [claim(2, started), claim(1, started + 1)] {
        assert!(
            matches!(
                cred.verify_claim(&lie, None),
                Err(IpcError::PeerIdentityMismatch { .. })
            ),
            "{lie} refused"
        );
    }
    let truth = claim(1, started);
    cred.verify_claim(&truth, None).unwrap();
    assert!(baton::ipc::process::is_observed(&truth));
    assert_eq!(
        baton::ipc::process::liveness(&truth),
        baton::ipc::process::Liveness::Alive
    );
    // `sleep` is its namespace's init: killed from here, and `unshare` exits with it.
    ns.signal(Signal::KILL);
    ns.reaped();
    assert_eq!(
        baton::ipc::process::liveness(&truth),
        baton::ipc::process::Liveness::Dead
    );
}

/// Named host segments across PID namespaces that share one `/dev/shm` (containers run with
/// `--ipc=host`). A segment names its owner by its pid in its own namespace (1 here: our
/// own init) and that namespace: our sweep keeps a live peer's segment — `/proc` would call
/// pid 1 with another start time dead — and removes it once the peer's pidfd says it died.
#[test]
#[ignore = "needs root (unshare: a PID namespace)"]
fn named_segments_of_a_peer_in_another_pid_namespace_are_swept_only_once_it_died() {
    run(async {
        let parent = memfd_parent("ct-named");
        let (mut ns, link) = spawn_in_namespaces_with(
            &parent,
            &["-p", "-f", "--mount-proc"],
            &[],
            &[(HOST_ENV, "named")],
        )
        .await;
        let reply = check_pair(&parent, &link, 4096, 9).await;
        let sum = reply.sum.open().unwrap();
        assert_eq!(sum.path(), baton::actors::LeasePath::HostSegment);
        let theirs = || baton::ipc::host::list_segments(&parent.ns).unwrap();
        let listed = theirs();
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(
            (listed[0].owner_pid, listed[0].owner),
            (1, baton::ipc::process::Liveness::Alive),
            "named by its namespace's pid, judged through its pidfd"
        );
        let kept = baton::ipc::host::sweep(&parent.ns).unwrap();
        assert_eq!((kept.removed.len(), kept.kept), (0, 1), "a live owner's");
        drop(sum);

        // Killed, it cannot unlink its segment: the sweep from here can, now.
        ns.signal(Signal::KILL);
        ns.reaped();
        eventually(DEADLINE, "its death seen through the pidfd", || {
            theirs()
                .iter()
                .all(|s| s.owner == baton::ipc::process::Liveness::Dead)
        })
        .await;
        let swept = baton::ipc::host::sweep(&parent.ns).unwrap();
        assert_eq!((swept.removed.len(), swept.kept), (1, 0));
        assert!(theirs().is_empty());
    });
}

/// Containers that do not share `/dev/shm` (each has its own, as by default): a named
/// segment of a peer in another PID namespace is not in ours, and its offer is refused,
/// typed, with the reason (not "freed or never made", and not the peer's fault): the lease
/// goes back and the link goes on.
#[test]
#[ignore = "needs root (unshare: a PID namespace)"]
fn a_named_segment_of_a_container_with_its_own_dev_shm_is_refused_saying_why() {
    run(async {
        let parent = memfd_parent("ct-shm");
        let (mut ns, link) =
            spawn_in_namespaces_with(&parent, peer::UNSHARE, &[], &[(HOST_ENV, "named")]).await;
        // The peer answers with the sum in a named segment of its own `/dev/shm`.
        let refused = send_check_pair(&parent, &link, 1024, 4)
            .await
            .expect_err("its segment is not in our /dev/shm");
        assert!(
            matches!(
                refused,
                baton::actors::ActorError::OfferRefused(
                    IpcError::SegmentAcrossPidNamespaces { .. }
                )
            ),
            "{refused}"
        );
        assert!(refused.to_string().contains("/dev/shm"), "{refused}");
        // The link goes on: the peer still maps our (memfd) memory.
        let a = parent.pattern_buffer(1024, 4).await;
        let summed = link
            .remote::<msgs::Sum>("sink")
            .send(msgs::Sum {
                buffers: vec![a.share()],
            })
            .await
            .unwrap();
        let want: u64 = (0..1024).map(|i| u64::from(pattern(4, i))).sum();
        assert_eq!(summed, want);
        link.close_and_wait().await;
        assert!(ns.reaped().success());
    });
}
