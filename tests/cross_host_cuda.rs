//! Device memory across two emulated hosts (issues 26 and 27): helper processes
//! (`baton-host-peer --cuda`), one GPU each, whose nodes say they run on different hosts
//! (`BATON_HOST_ID`), each host a network namespace of its own joined to the other by a
//! veth pair (`examples/two_hosts/netns.rs`, made where this process may: as root or in a
//! user namespace) — else, with the reason printed, both on loopback TCP in this
//! namespace. Their device buffers cross as copies through the NCCL engine, and NCCL is
//! told the same (`NCCL_HOSTID` per host) and forced onto its socket transport
//! (`NCCL_NET=Socket`, `NCCL_SOCKET_IFNAME` on the veth or `lo`, peer-to-peer and shared
//! memory off), as between two machines. Each test checks from NCCL's own log
//! (`NCCL_DEBUG=INFO`) that the bytes went "via NET/Socket", on the veth where there is one.
//! `BATON_EXPECT_NETNS=1` makes a run that cannot make the namespaces fail instead.
//!
//! - Typed messages with device buffers from 1 B to 1 GiB both ways, data checked; each
//!   round's time is printed (the figures of `docs/CROSS_HOST.md`).
//! - SIGKILL of the receiver during a 3 GiB copy: the sender's call fails, its lease
//!   comes back, its device memory returns to where it was before the buffer, and a new
//!   communicator (with a new peer) works afterwards.
//! - SIGKILL of the sender during a 3 GiB copy: the receiver frees its partial copy (its
//!   device memory back to where it started), holds no lease, and a new peer's copies
//!   land afterwards.
//! - A device lease forwarded across hosts: an exporter's buffer on GPU 0, leased over a
//!   Unix link to a relay on the same host, forwarded by the relay to a third process on
//!   the other host (GPU 1), lands there as a copy.
//!
//! Needs two GPUs and NCCL (`BATON_NCCL_LIB` or `libnccl.so.2` on the loader's path):
//! `gpu-tests` only; with one GPU it skips (see `support/gpus.rs`). The test process
//! itself touches no GPU: it runs the helpers and reads what they print.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/gpus.rs"]
mod gpus;
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
use host_peer::{Lines, host_peer_env};
use std::path::PathBuf;
use std::time::Duration;

/// The size of the copy in flight when a side is killed.
const BIG: usize = 3 << 30;
/// How long a round of the largest sizes may take.
const LONG: Duration = Duration::from_secs(180);
/// Device memory the survivor may have below its baseline afterwards (the driver's own
/// bookkeeping; a leaked copy would be gigabytes).
const SLACK: u64 = 64 << 20;
/// Device memory a process keeps once it made its first NCCL communicator, whatever
/// becomes of it (NCCL's kernels loaded into the context, its per-device state): 442 MiB
/// on an H200 (run R). A receiver's baseline taken before its first copy sits this much
/// higher; the partial copy a leak would keep is 3 GiB.
const NCCL_RESIDENT: u64 = 1 << 30;

/// Makes the run that cannot make network namespaces fail instead of using loopback.
const EXPECT_NETNS_ENV: &str = "BATON_EXPECT_NETNS";

/// The two emulated hosts: network namespaces joined by a veth pair, or (where this
/// process may not make them) loopback in this namespace.
enum Hosts {
    Netns(netns::TwoHosts),
    Loopback,
}

impl Hosts {
    /// The namespaces, or loopback after printing why not (a failure if
    /// [`EXPECT_NETNS_ENV`] is set).
    fn make(test: &str) -> Self {
        match netns::TwoHosts::make() {
            Ok(hosts) => {
                eprintln!(
                    "{test}: two network namespaces joined by a veth pair, made {}, running {:?} after it was set up",
                    hosts.how(),
                    hosts.running_after()
                );
                Hosts::Netns(hosts)
            }
            Err(why) => {
                assert!(
                    std::env::var_os(EXPECT_NETNS_ENV).is_none(),
                    "{test}: {EXPECT_NETNS_ENV} is set, but no network namespaces here: {why}"
                );
                eprintln!("{test}: no network namespaces here ({why}): both hosts on loopback");
                Hosts::Loopback
            }
        }
    }

    /// Where a helper on host `i` (0 or 1) listens.
    fn listen(&self, i: usize) -> String {
        match self {
            Hosts::Netns(_) => format!("{}:0", netns::ADDRS[i]),
            Hosts::Loopback => "127.0.0.1:0".to_owned(),
        }
    }

    /// The interface NCCL's sockets use on host `i`.
    fn interface(&self, i: usize) -> &'static str {
        match self {
            Hosts::Netns(_) => ["baton-a", "baton-b"][i],
            Hosts::Loopback => "lo",
        }
    }
}

/// The environment of helper `name` on GPU `device`, on emulated host `host` to NCCL,
/// its sockets on `interface`; NCCL logs into a file per process under `log`.
fn env_for(
    device: &str,
    host: &str,
    name: &str,
    interface: &str,
    log: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("BATON_CUDA_DEVICE", device.to_owned()),
        ("NCCL_HOSTID", format!("baton-{host}")),
        ("NCCL_NET", "Socket".to_owned()),
        // A prefix (each namespace has one `baton-` link). NCCL skips an interface that
        // is not yet RUNNING: `netns::TwoHosts::make` waits for it (runs H-L found none).
        ("NCCL_SOCKET_IFNAME", interface.to_owned()),
        ("NCCL_P2P_DISABLE", "1".to_owned()),
        ("NCCL_SHM_DISABLE", "1".to_owned()),
        ("NCCL_NVLS_ENABLE", "0".to_owned()),
        ("NCCL_DEBUG", "INFO".to_owned()),
        ("NCCL_DEBUG_SUBSYS", "INIT,NET".to_owned()),
        ("NCCL_DEBUG_FILE", format!("{log}/nccl.{name}.%p.log")),
    ]
}

/// One test's two hosts, session, shared-memory namespace and NCCL logs.
struct Scene {
    hosts: Hosts,
    session: Session,
    ns: String,
    logs: Logs,
}

impl Scene {
    fn new(test: &str, tag: &str) -> Self {
        Scene {
            hosts: Hosts::make(test),
            session: Session::generate().unwrap(),
            ns: peer::namespace(&format!("xc-{tag}")),
            logs: Logs::new(tag),
        }
    }

    /// Where a helper on host `on` listens.
    fn listen(&self, on: usize) -> String {
        self.hosts.listen(on)
    }

    /// A helper named `name` on emulated host `on` (0 or 1) and GPU `device`.
    fn helper(&self, on: usize, name: &str, device: &str, args: &[&str]) -> (peer::Peer, Lines) {
        self.helper_env(on, name, device, args, &[])
    }

    /// As [`Scene::helper`], with `extra` added to (or replacing in) its environment.
    fn helper_env(
        &self,
        on: usize,
        name: &str,
        device: &str,
        args: &[&str],
        extra: &[(&str, &str)],
    ) -> (peer::Peer, Lines) {
        // NCCL's host id names the emulated host, so that two helpers of one host are one
        // host to NCCL too; Baton's host id is the helper's own name.
        let interface = self.hosts.interface(on);
        let env = env_for(device, ["x", "y"][on], name, interface, self.logs.path());
        let env: Vec<(&str, &str)> = (env.iter().map(|(k, v)| (*k, v.as_str())))
            .chain(extra.iter().copied())
            .collect();
        let mut args = args.to_vec();
        args.push("--cuda");
        let enter = match &self.hosts {
            Hosts::Netns(two) => Some(two.enter(on)),
            Hosts::Loopback => None,
        };
        let enter = enter
            .as_ref()
            .map(|(via, before)| (*via, before.as_slice()));
        host_peer_env(enter, &self.session, &self.ns, name, &args, &env)
    }

    /// See [`Logs::assert_socket_transport`].
    fn assert_socket_transport(&self) {
        self.logs.assert_socket_transport(&self.hosts);
    }
}

/// A directory for NCCL's logs, removed when the test ends.
struct Logs(PathBuf);

impl Logs {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("baton-nccl-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temp dir")
    }

    /// How many communicator aborts host `host`'s NCCL log started and completed.
    fn aborts(&self, host: &str) -> (usize, usize) {
        let (mut started, mut completed) = (0, 0);
        for entry in std::fs::read_dir(&self.0).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if !name.starts_with(&format!("nccl.{host}.")) {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            started += text.matches("Abort START").count();
            completed += text.matches("Abort COMPLETE").count();
        }
        (started, completed)
    }

    /// Asserts NCCL moved bytes over its socket transport, on the interfaces of `hosts`
    /// only, and names the lines.
    fn assert_socket_transport(&self, hosts: &Hosts) {
        let (mut lines, mut using) = (Vec::new(), Vec::new());
        for entry in std::fs::read_dir(&self.0).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap_or_default();
            lines.extend(
                text.lines()
                    .filter(|l| l.contains(" via "))
                    .map(str::to_owned),
            );
            // "NET/Socket : Using [0]baton-a:10.77.0.1<0>": the interfaces it bound.
            using.extend(
                text.lines()
                    .filter(|l| l.contains("NET/Socket : Using"))
                    .map(str::to_owned),
            );
        }
        for line in lines.iter().take(4).chain(using.iter().take(2)) {
            eprintln!("NCCL: {line}");
        }
        let ours = [hosts.interface(0), hosts.interface(1)];
        assert!(
            !using.is_empty()
                && using.iter().all(|l| {
                    ours.iter()
                        .any(|i| l.contains(&format!("]{i}:")) || l.contains(&format!("]{i}<")))
                }),
            "NCCL's sockets were not (only) on {ours:?}: {using:?}"
        );
        assert!(
            lines.iter().any(|l| l.contains("via NET/Socket")),
            "NCCL's log says no channel went via NET/Socket: {lines:?}"
        );
        assert!(
            lines
                .iter()
                .all(|l| !l.contains("via P2P") && !l.contains("via SHM")),
            "a channel went peer to peer or through shared memory: {lines:?}"
        );
    }
}

impl Drop for Logs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn number(s: &str) -> u64 {
    s.trim()
        .parse()
        .unwrap_or_else(|_| panic!("a number, not {s:?}"))
}

/// How long after its lease is out a copy is surely under way (the receiver allocates
/// and pulls within milliseconds; 3 GiB take NCCL's sockets a second or more).
const UNDER_WAY: Duration = Duration::from_millis(300);

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs and NCCL (--features gpu-tests)"
)]
fn device_buffers_from_1_byte_to_1_gib_both_ways_between_two_emulated_hosts_over_nccl_sockets() {
    let test = "device_buffers_both_ways_over_nccl_sockets";
    if !gpus::two_gpus(test) {
        return;
    }
    let sc = Scene::new(test, "both");
    run(async {
        let (mut a, a_lines) = sc.helper(0, "a", "0", &["listen", &sc.listen(0)]);
        let at = a_lines.expect("listening ", DEADLINE).await;
        let sizes = [1usize, 4096, (1 << 20) + 3, 64 << 20, 1 << 30];
        let list = sizes.map(|s| s.to_string()).join(",");
        let (mut b, b_lines) = sc.helper(1, "b", "1", &["drive", &at, "--sizes", &list]);
        for len in sizes {
            let line = b_lines.expect(&format!("ok {len} "), LONG).await;
            // `echo=` is our buffer there and theirs back; `take=` ours there once more.
            eprintln!("{test}: {len} bytes: {line}");
        }
        b_lines.expect("done", DEADLINE).await;
        assert!(exited(&mut b, DEADLINE).await.success(), "the driver");
        assert!(exited(&mut a, DEADLINE).await.success(), "the listener");
        sc.assert_socket_transport();
    });
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs and NCCL (--features gpu-tests)"
)]
fn sigkill_of_the_receiver_during_a_3_gib_device_copy_gives_the_sender_its_lease_and_memory_back() {
    let test = "sigkill_of_the_receiver_during_a_device_copy";
    if !gpus::two_gpus(test) {
        return;
    }
    let sc = Scene::new(test, "rkill");
    run(async {
        let go = std::env::temp_dir().join(format!("baton-xc-go-{}", std::process::id()));
        let _ = std::fs::remove_file(&go);
        let (mut a, a_lines) = sc.helper(0, "a", "0", &["listen", &sc.listen(0)]);
        let at = a_lines.expect("listening ", DEADLINE).await;
        // The peer the sender links to afterwards: a new communicator.
        let (mut c, c_lines) = sc.helper(0, "c", "0", &["listen", &sc.listen(0)]);
        let then = c_lines.expect("listening ", DEADLINE).await;
        let len = BIG.to_string();
        let (mut b, b_lines) = sc.helper(
            1,
            "b",
            "1",
            &[
                "drive-kill",
                &at,
                "--len",
                &len,
                "--go",
                go.to_str().unwrap(),
                "--then",
                &then,
            ],
        );
        b_lines.expect("ready", LONG).await;
        std::fs::write(&go, b"go").unwrap();
        let baseline = number(&b_lines.expect("mem-baseline ", LONG).await);
        b_lines.expect("in-flight", LONG).await;
        // The receiver has pulled by now, and NCCL is moving the bytes.
        tokio::time::sleep(UNDER_WAY).await;
        a.kill9();
        let _ = std::fs::remove_file(&go);
        let failed = b_lines.expect("call-failed ", LONG).await;
        eprintln!("{test}: the sender's call failed with {failed}");
        b_lines.expect("lease-back", LONG).await;
        assert_eq!(number(&b_lines.expect("leases ", DEADLINE).await), 0);
        let after = number(&b_lines.expect("mem-after ", DEADLINE).await);
        eprintln!(
            "{test}: the sender's device memory: {} MiB free before the buffer, {} MiB after",
            baseline >> 20,
            after >> 20
        );
        // As for the receiver (the other test): held while NCCL's abort has not returned,
        // else freed.
        let (started, completed) = sc.logs.aborts("b");
        eprintln!("{test}: the sender's NCCL aborts: {started} started, {completed} completed");
        if completed < started {
            assert!(
                after + (BIG as u64) / 2 < baseline,
                "the buffer was freed while NCCL's abort had not returned: {baseline} free before, {after} after"
            );
        } else {
            assert!(
                after + SLACK >= baseline,
                "the sender's device memory did not come back: {baseline} free before, {after} after"
            );
        }
        b_lines.expect("after ok", LONG).await;
        assert!(exited(&mut b, DEADLINE).await.success(), "the sender");
        assert!(exited(&mut c, DEADLINE).await.success(), "the new peer");
        sc.assert_socket_transport();
    });
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs and NCCL (--features gpu-tests)"
)]
fn sigkill_of_the_sender_during_a_3_gib_device_copy_frees_the_receivers_partial_copy() {
    let test = "sigkill_of_the_sender_during_a_device_copy";
    if !gpus::two_gpus(test) {
        return;
    }
    let sc = Scene::new(test, "skill");
    run(async {
        let go = std::env::temp_dir().join(format!("baton-xc-go-{}", std::process::id()));
        std::fs::write(&go, b"go").unwrap();
        // The receiver serves two peers: the sender killed mid-copy, then a new one.
        let (mut a, a_lines) = sc.helper(0, "a", "0", &["listen", &sc.listen(0), "--serve", "2"]);
        let at = a_lines.expect("listening ", DEADLINE).await;
        let start = number(&a_lines.expect("mem-start ", DEADLINE).await);
        let len = BIG.to_string();
        let (mut b, b_lines) = sc.helper(
            1,
            "b",
            "1",
            &[
                "drive-kill",
                &at,
                "--len",
                &len,
                "--go",
                go.to_str().unwrap(),
            ],
        );
        b_lines.expect("in-flight", LONG).await;
        tokio::time::sleep(UNDER_WAY).await;
        b.kill9();
        let _ = std::fs::remove_file(&go);
        a_lines.expect("down", LONG).await;
        assert_eq!(number(&a_lines.expect("leases ", DEADLINE).await), 0);
        let after = number(&a_lines.expect("mem ", LONG).await);
        eprintln!(
            "{test}: the receiver's device memory: {} MiB free at its start, {} MiB after the sender died",
            start >> 20,
            after >> 20
        );
        // Both of the receiver's communicators with the sender (the warm-up echo made the
        // one back) are aborted, and every abort returns: they start together, so neither
        // one's free waits on the other's kernel (`ipc/src/transfer/nccl.rs`). The partial
        // copy is then freed.
        let (started, completed) = sc.logs.aborts("a");
        eprintln!("{test}: the receiver's NCCL aborts: {started} started, {completed} completed");
        assert!(started >= 1, "the receiver aborted no NCCL communicator");
        assert_eq!(
            completed, started,
            "an NCCL abort in the receiver did not return (its log: Abort START without COMPLETE)"
        );
        // The baseline was taken before NCCL's first communicator in this process.
        assert!(
            after + NCCL_RESIDENT >= start,
            "the receiver's partial copy was not freed: {start} free at its start, {after} after"
        );
        // A new peer: a new communicator, both ways.
        let (mut c, c_lines) = sc.helper(1, "c", "1", &["drive", &at, "--sizes", "1048576"]);
        c_lines.expect("linked", LONG).await;
        c_lines.expect("ok 1048576 ", LONG).await;
        c_lines.expect("done", DEADLINE).await;
        assert!(exited(&mut c, DEADLINE).await.success(), "the new peer");
        a_lines.expect("down", DEADLINE).await;
        assert_eq!(number(&a_lines.expect("leases ", DEADLINE).await), 0);
        // NCCL resident since the first: a second communicator's life leaves nothing.
        let again = number(&a_lines.expect("mem ", LONG).await);
        eprintln!(
            "{test}: the receiver's device memory after the new peer: {} MiB free",
            again >> 20
        );
        assert!(
            again + SLACK >= after,
            "the new peer's copies left device memory behind: {after} free before it, {again} after"
        );
        a.kill9();
        sc.assert_socket_transport();
    });
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs and NCCL (--features gpu-tests)"
)]
fn a_sender_that_cannot_make_its_communicator_ends_the_link_and_the_receiver_hears_at_once() {
    let test = "a_sender_that_cannot_make_its_communicator";
    if !gpus::two_gpus(test) {
        return;
    }
    let sc = Scene::new(test, "nocomm");
    run(async {
        // `--serve 2`: it reports its device memory (`mem-start`, and `mem` after each peer).
        let (mut a, a_lines) = sc.helper(0, "a", "0", &["listen", &sc.listen(0), "--serve", "2"]);
        let at = a_lines.expect("listening ", DEADLINE).await;
        let start = number(&a_lines.expect("mem-start ", DEADLINE).await);
        // No such interface: the sender's `ncclGetUniqueId` fails, so its first device
        // send fails before NCCL ever sees it, while the receiver's receive is posted.
        let (mut b, b_lines) = sc.helper_env(
            1,
            "b",
            "1",
            &["drive", &at, "--sizes", "4096"],
            &[("NCCL_SOCKET_IFNAME", "=baton-none")],
        );
        b_lines.expect("linked", LONG).await;
        let failed = b_lines.expect("failed ", LONG).await;
        eprintln!("{test}: the sender's call failed with {failed}");
        // Before: the receiver waited for its copy's whole allowance (the heartbeat's
        // deadline and NCCL's rendezvous timeout, 40 s), then refused the offer, and the
        // sender's call failed with that timeout. Now the sender's engine failure ends the
        // link at once (the order of sends and receives is lost), and so the call.
        assert!(
            !failed.contains("timed out"),
            "the call waited for the receiver's allowance: {failed}"
        );
        assert!(!exited(&mut b, DEADLINE).await.success(), "the sender");
        a_lines.expect("down", DEADLINE).await;
        assert_eq!(number(&a_lines.expect("leases ", DEADLINE).await), 0);
        let after = number(&a_lines.expect("mem ", DEADLINE).await);
        assert!(
            after + SLACK >= start,
            "the receiver's copy was not freed: {start} free at its start, {after} after"
        );
        // (It would wait for a second peer.)
        a.kill9();
    });
}

/// Forwarding across hosts on GPUs (issue 26's forward, issue 27's run): A exports a
/// device buffer on GPU 0 to the relay B over a Unix link (both on host 0, one GPU), B
/// forwards its lease to C on host 1 (GPU 1), where it lands as a copy NCCL moved from B's
/// mapping of A's memory, over its socket transport; B's own lease still reads the data.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs and NCCL (--features gpu-tests)"
)]
fn a_device_lease_forwarded_to_another_host_arrives_there_as_a_copy() {
    let test = "device_lease_forwarded_to_another_host";
    if !gpus::two_gpus(test) {
        return;
    }
    let sc = Scene::new(test, "fwd");
    run(async {
        let len = ((64 << 20) + 3).to_string();
        let seed = "9";
        // A and B are one host to Baton as well as to NCCL.
        let same_host = [(baton::ipc::tcp::HOST_ID_ENV, "fwd-x")];
        let (mut c, c_lines) = sc.helper(
            1,
            "c",
            "1",
            &["listen", &sc.listen(1), "--inbox", "--seed", seed],
        );
        let at = c_lines.expect("listening ", DEADLINE).await;
        let dir = format!("{}/sock", sc.logs.path());
        let (mut b, b_lines) = sc.helper_env(
            0,
            "b",
            "0",
            &["relay", &dir, "--then", &at, "--seed", seed],
            &same_host,
        );
        let path = b_lines.expect("relay-at ", DEADLINE).await;
        let (mut a, a_lines) = sc.helper_env(
            0,
            "a",
            "0",
            &["export", &path, "--len", &len, "--seed", seed],
            &same_host,
        );
        a_lines.expect("kept", DEADLINE).await;
        let id = b_lines.expect("forwarded ", LONG).await;
        assert_eq!(
            c_lines.expect("inbox ", LONG).await,
            format!("lease={id} len={len} pattern=true"),
            "C's copy"
        );
        assert_eq!(b_lines.expect("still ", DEADLINE).await, "true");
        b_lines.expect("done", DEADLINE).await;
        assert!(exited(&mut b, DEADLINE).await.success(), "the relay");
        assert!(exited(&mut c, DEADLINE).await.success(), "the receiver");
        assert!(exited(&mut a, DEADLINE).await.success(), "the exporter");
        sc.assert_socket_transport();
    });
}
