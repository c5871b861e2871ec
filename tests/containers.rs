//! Processes in namespaces of their own, as containers are (issue 51, item 1): what links
//! and what is refused, with the reason. Each test starts its peer under `unshare(1)`, so
//! it needs root (and util-linux): `#[ignore]`d otherwise — CI runs them as root.
//!
//! - A peer in a network namespace of its own (`unshare -n`), sharing only the socket's
//!   directory, links over that Unix socket and maps our host memory (memfd descriptors
//!   over the socket need no shared network, PID or IPC namespace): the typed round trip
//!   of two buffers, read and answered exactly.
//! - A peer in a PID namespace of its own (`unshare -p -f`) is refused, typed, with the
//!   reason, on both sides: from inside, our pid is invisible (the kernel says 0); from
//!   here, its pid is one of a nested namespace, so its claim cannot be checked and its
//!   death not seen by pid. The listener serves the next peer as before.
//!
//! `docs/CROSS_HOST.md`, "Containers", says what works across namespaces and why.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actors::{DEADLINE, Parent, run};
use baton::ipc::host::{HOST_ENV, NAMESPACE_ENV};
use baton::ipc::{Error as IpcError, HostBackend, PeerCred};
use baton::messages::ProcessId;
use msgs::{CheckPair, pattern};
use std::io::Read;
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
        const N: usize = 100_000;
        let a = parent.pattern_buffer(N, 7).await;
        let b: baton::Buffer<f32> = parent
            .owner
            .send(baton::actors::Allocate::vector(N as u64))
            .await
            .unwrap()
            .unwrap();
        b.write_at(0, &(0..N).map(|i| i as f32 * 0.5).collect::<Vec<_>>())
            .unwrap();
        let reply = link
            .remote::<CheckPair>("checker")
            .send(CheckPair {
                seed: 7,
                a: a.share(),
                b: b.share(),
            })
            .await
            .unwrap();
        assert!(
            reply.ok,
            "the peer in its own network namespace read our memory"
        );
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
                .all(|(i, v)| *v == pattern(7, i) as f32 + i as f32 * 0.5),
            "and its answer, in its memory, reads back here"
        );
        link.close_and_wait().await;
        assert!(child.wait(DEADLINE).success());
    });
}

#[test]
#[ignore = "needs root (unshare: a PID namespace)"]
fn a_peer_in_another_pid_namespace_is_refused_with_the_reason_and_the_listener_serves_on() {
    run(async {
        let parent = memfd_parent("ct-pid");
        let sock = parent.socket();
        let exe = peer::exe("baton-actor-peer");
        let ups = parent.events.ups().len();
        let mut cmd = Command::new("unshare");
        cmd.args(["-p", "-f", exe, "serve", &sock])
            .env(NAMESPACE_ENV, &parent.ns)
            .env(HOST_ENV, "memfd")
            .env("BATON_BACKEND", "host")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        parent.session.pass_to(&mut cmd).unwrap();
        let mut child = cmd.spawn().unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let read = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let start = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(start.elapsed() < DEADLINE, "the peer never gave up");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let said = read.join().unwrap();
        assert!(!status.success(), "refused: {said}");
        assert!(
            said.contains("lives in another PID namespace"),
            "the peer says why: {said}"
        );
        assert_eq!(parent.events.ups().len(), ups, "no link came up");

        // The listener serves the next peer, from our own namespace, as before.
        let (mut next, link) = parent.child(&[]).await;
        link.close_and_wait().await;
        assert!(next.wait(DEADLINE).success());
    });
}

/// From our side: a process in a PID namespace nested below ours has a pid here, but
/// claims its own namespace's (1, 2, …): the claim is refused as a PID-namespace peer, not
/// as a liar.
#[test]
#[ignore = "needs root (unshare: a PID namespace)"]
fn a_claim_from_a_nested_pid_namespace_is_refused_as_such() {
    let mut unshare = Command::new("unshare")
        .args(["-p", "-f", "sleep", "30"])
        .spawn()
        .unwrap();
    // `unshare -f` forks `sleep`: find it among its children.
    let start = Instant::now();
    let inner: u32 = loop {
        let children =
            std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", unshare.id()))
                .unwrap_or_default();
        if let Some(pid) = children.split_whitespace().next() {
            break pid.parse().unwrap();
        }
        assert!(start.elapsed() < DEADLINE, "unshare forked nothing");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(baton::ipc::process::in_nested_pid_namespace(inner));
    assert!(!baton::ipc::process::in_nested_pid_namespace(
        std::process::id()
    ));
    let cred = PeerCred {
        pid: inner,
        uid: 0,
        gid: 0,
    };
    // What it would claim: pid 1 of its namespace.
    let claim = ProcessId {
        boot: baton::ipc::process::boot_id(),
        pid: 1,
        start_ticks: baton::ipc::process::start_ticks(inner).unwrap(),
    };
    match cred.verify_claim(&claim) {
        Err(IpcError::PeerInOtherPidNamespace { pid: Some(pid) }) => assert_eq!(pid, inner),
        other => panic!("refused as a PID-namespace peer: {other:?}"),
    }
    // `sleep` is its namespace's init: killed from here, and `unshare` exits with it.
    let pid = rustix::process::Pid::from_raw(inner as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    let _ = unshare.wait();
}
