//! Two "hosts" as two network namespaces joined by a veth pair (made here where this
//! process may: as root, or in a user namespace of its own; skipped with the reason
//! printed elsewhere — the loopback tests
//! of `cross_host_procs.rs` always run): the helper `baton-host-peer` runs in each, on
//! its own host id, linked over the veth addresses. Typed messages with host buffers both
//! ways, data checked; SIGKILL of the receiver mid-transfer, the sender's lease back;
//! SIGKILL of the sender mid-transfer (its side of the veth throttled by `tc`), the
//! receiver's partial copy freed while it lives.
//! The namespaces are held by processes (`examples/two_hosts/netns.rs`), not named: they
//! and the veth pair go with them.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/host_peer.rs"]
mod host_peer;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "../examples/two_hosts/netns.rs"]
mod netns;
#[path = "support/peer.rs"]
mod peer;

use actors::{DEADLINE, exited, run};
use baton::Session;
use host_peer::{Lines, host_peer_via};
use std::path::Path;
use std::time::Duration;

/// Makes a run that cannot make network namespaces fail instead of skipping (CI sets it
/// where it runs as root with `ip`; the GPU runs set it too).
const EXPECT_NETNS_ENV: &str = "BATON_EXPECT_NETNS";

/// The two hosts, or `None` after printing why they cannot be made here (a failure if
/// [`EXPECT_NETNS_ENV`] is set).
fn two_hosts(test: &str) -> Option<netns::TwoHosts> {
    match netns::TwoHosts::make() {
        Ok(hosts) => {
            eprintln!(
                "{test}: two network namespaces, made {}, running {:?} after set up",
                hosts.how(),
                hosts.running_after()
            );
            Some(hosts)
        }
        Err(why) => {
            assert!(
                std::env::var_os(EXPECT_NETNS_ENV).is_none(),
                "{test}: {EXPECT_NETNS_ENV} is set, but no network namespaces here: {why}"
            );
            eprintln!("{test}: skipped: no network namespaces here: {why}");
            None
        }
    }
}

/// Kills and reaps the helpers, then the namespaces' holders.
fn no_leftovers(children: Vec<peer::Peer>, hosts: netns::TwoHosts) {
    drop(children);
    let pids = [hosts.pid(0), hosts.pid(1)];
    drop(hosts);
    for pid in pids {
        assert!(peer::reaped(pid), "holder {pid} reaped");
    }
}

/// The size of the copy in flight when a side is killed.
const IN_FLIGHT: usize = 512 << 20;

/// A helper on host `a` in the first namespace, listening at its veth address (with
/// `extra` arguments); its lines, and where it listens.
async fn listener_in(
    hosts: &netns::TwoHosts,
    session: &Session,
    ns: &str,
    extra: &[&str],
) -> (peer::Peer, Lines, String) {
    let (via, args) = hosts.enter(0);
    let listen = format!("{}:0", netns::ADDRS[0]);
    let mut argv = vec!["listen", &listen];
    argv.extend_from_slice(extra);
    let (child, lines) = host_peer_via(Some((via, &args)), session, ns, "a", &argv);
    let addr = lines.expect("listening ", DEADLINE).await;
    (child, lines, addr)
}

/// A helper on host `b` in the second namespace that links to `addr`, and, once `go`
/// exists, sends a copy of [`IN_FLIGHT`] bytes there (`drive-kill`); its lines, after
/// `ready`.
async fn sender_in(
    hosts: &netns::TwoHosts,
    session: &Session,
    ns: &str,
    addr: &str,
    go: &Path,
) -> (peer::Peer, Lines) {
    let (via, args) = hosts.enter(1);
    let len = IN_FLIGHT.to_string();
    let go = go.to_str().unwrap();
    let argv = ["drive-kill", addr, "--len", &len, "--go", go];
    let (child, lines) = host_peer_via(Some((via, &args)), session, ns, "b", &argv);
    lines.expect("ready", DEADLINE).await;
    (child, lines)
}

#[test]
fn typed_messages_with_host_buffers_both_ways_between_two_network_namespaces() {
    let Some(hosts) = two_hosts("typed_messages_between_namespaces") else {
        return;
    };
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-netns");
        let (mut a, _, addr) = listener_in(&hosts, &session, &ns, &[]).await;
        let (b_via, b_args) = hosts.enter(1);
        let (mut b, b_lines) = host_peer_via(
            Some((b_via, &b_args)),
            &session,
            &ns,
            "b",
            &["drive", &addr, "--sizes", "1,4096,1048579,67108864"],
        );
        for size in ["1", "4096", "1048579", "67108864"] {
            b_lines.expect(&format!("ok {size}"), DEADLINE).await;
        }
        b_lines.expect("done", DEADLINE).await;
        assert!(exited(&mut b, DEADLINE).await.success());
        assert!(exited(&mut a, DEADLINE).await.success());
        let _ = baton::ipc::host::sweep(&ns);
        no_leftovers(vec![a, b], hosts);
    });
}

#[test]
fn sigkill_of_the_receiver_mid_transfer_between_network_namespaces() {
    let Some(hosts) = two_hosts("sigkill_between_namespaces") else {
        return;
    };
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-nskill");
        let go = tempfile::tempdir().unwrap();
        let go_file = go.path().join("go");
        let (mut a, _, addr) = listener_in(&hosts, &session, &ns, &[]).await;
        let (mut b, b_lines) = sender_in(&hosts, &session, &ns, &addr, &go_file).await;
        // The receiver, stopped, reads nothing: the copy stays in flight.
        let pid = rustix::process::Pid::from_raw(a.pid() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
        std::fs::write(&go_file, b"go").unwrap();
        b_lines.expect("in-flight", DEADLINE).await;
        a.kill9();
        let failed = b_lines.expect("call-failed ", DEADLINE).await;
        eprintln!("the sender's call failed with {failed}");
        assert!(!failed.starts_with("Timeout"), "{failed}");
        b_lines.expect("lease-back", DEADLINE).await;
        assert_eq!(b_lines.expect("leases ", DEADLINE).await, "0");
        assert!(exited(&mut b, Duration::from_secs(60)).await.success());
        let _ = baton::ipc::host::sweep(&ns);
        no_leftovers(vec![a, b], hosts);
    });
}

#[test]
fn sigkill_of_the_sender_mid_transfer_between_network_namespaces() {
    let Some(hosts) = two_hosts("sender_sigkill_between_namespaces") else {
        return;
    };
    // The sender's side sends slowly: 512 MiB take about 20 s, the copy stays in flight.
    if let Err(why) = hosts.throttle(1, "200mbit") {
        eprintln!("sender_sigkill_between_namespaces: skipped: cannot throttle the veth: {why}");
        return;
    }
    run(async {
        let session = Session::generate().unwrap();
        let ns = peer::namespace("xh-nsskill");
        let go = tempfile::tempdir().unwrap();
        let go_file = go.path().join("go");
        let (mut a, a_lines, addr) = listener_in(&hosts, &session, &ns, &["--stay"]).await;
        let (mut b, b_lines) = sender_in(&hosts, &session, &ns, &addr, &go_file).await;
        std::fs::write(&go_file, b"go").unwrap();
        b_lines.expect("in-flight", DEADLINE).await;
        // The receiver's partial copy: a segment of its own, of the buffer's size.
        let a_pid = a.pid();
        let partial = || {
            baton::ipc::host::list_segments(&ns)
                .unwrap()
                .iter()
                .filter(|s| s.owner_pid == a_pid && s.size >= IN_FLIGHT as u64)
                .count()
        };
        actors::eventually(DEADLINE, "the receiver's partial copy", || partial() == 1).await;
        b.kill9();
        a_lines.expect("down", DEADLINE).await;
        actors::eventually(DEADLINE, "the partial copy freed", || partial() == 0).await;
        assert!(a.try_wait().is_none(), "the receiver lives on");
        a.kill9();
        let _ = baton::ipc::host::sweep(&ns);
        no_leftovers(vec![a, b], hosts);
    });
}
