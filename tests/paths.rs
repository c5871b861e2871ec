//! Path truth (issue 51, item 3): every lease says which path its bytes took — on the
//! importer's lease (`Lease::path`), in both nodes' status (`NodeStatus::paths`: granted
//! by the exporter, opened by the importer) and in their metrics (`baton_tx_*`/`baton_rx_*`
//! with a `path` label) — and a downgrade to a slower path is refused unless the node's
//! policy allows it, and is an event, a status entry and a metric when it does.
//!
//! On host (CI), nodes in this process: a memfd and a named segment mapped over a Unix
//! socket; a TCP copy between two "hosts" (told apart by their host ids); a forward of a
//! lease to another host, copied; and the one forced fallback reachable on host, a host
//! link to a peer on this very host (`Downgrade::CopyOnSameHost`), refused by default and
//! taken when allowed. On a GPU (`--features gpu-tests`): the CUDA labels, legacy, VMM and
//! pool, each both ways with a helper process, and `-peer-gpu` with a helper on a second
//! GPU (on one GPU it prints `SKIPPED` and passes, see `support/gpus.rs`).

#[path = "support/actors.rs"]
mod actors;
#[path = "support/gpus.rs"]
mod gpus;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, run};
use baton::actors::{
    ActorError, Downgrade, DowngradePolicy, HostSettings, Lease, LeasePath, Node, NodeConfig,
    Offered, Peer, PeerEvent,
};
use baton::ipc::tcp::HostId;
use baton::ipc::{HostBackend, HostFlavor};
use baton::messages::status::NodeStatus;
use baton::{RemoteMessage, Session, Shared, SocketDir};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// Opens a lease and answers the path its bytes took and its length; keeps the lease when
/// asked (for a forward).
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "Result<(String, usize), String>")]
struct Probe {
    data: Shared<u32>,
    keep: bool,
}

impl RemoteMessage for Probe {
    const NAME: &'static str = "paths.Probe";
}

/// Answers [`Probe`]; the leases it keeps are the test's to forward.
#[derive(Default)]
struct Prober {
    kept: Arc<Mutex<Vec<Lease<u32>>>>,
}

impl Actor for Prober {
    type Context = Context<Self>;
}

impl Handler<Probe> for Prober {
    type Result = Result<(String, usize), String>;
    fn handle(&mut self, msg: Probe, _: &mut Context<Self>) -> Self::Result {
        let lease = msg.data.open().map_err(|e| e.to_string())?;
        let seen = (lease.path().name().to_owned(), lease.len());
        if msg.keep {
            self.kept.lock().unwrap().push(lease);
        }
        Ok(seen)
    }
}

/// Registers a [`Prober`] as "probe"; returns the leases it will keep.
fn serve(node: &Node) -> Arc<Mutex<Vec<Lease<u32>>>> {
    let prober = Prober::default();
    let kept = Arc::clone(&prober.kept);
    node.register::<Probe>("probe", prober.start().recipient());
    kept
}

/// A node on the "host" `host` with `backend` and downgrade policy `policy`.
fn node_on(session: &Session, host: &str, backend: HostBackend, policy: DowngradePolicy) -> Node {
    let config = NodeConfig::new(session.clone())
        .hosts(HostSettings {
            host: HostId::named(host),
            ..HostSettings::default()
        })
        .downgrades(policy);
    Node::with_config(config, Arc::new(backend))
}

fn memfd() -> HostBackend {
    HostBackend::with_flavor(HostFlavor::Memfd, &peer::namespace("paths")).unwrap()
}

/// Sends a buffer of `len` elements to `to`'s prober; answers what it saw.
async fn probe(from: &Node, to: &Peer, len: usize, keep: bool) -> (String, usize) {
    let buf = from.allocate::<u32>(len).unwrap();
    buf.write_at(0, &vec![7u32; len]).unwrap();
    let seen = to
        .remote::<Probe>("probe")
        .send(Probe {
            data: buf.share(),
            keep,
        })
        .await
        .unwrap()
        .unwrap();
    if !keep {
        buf.returned_within(DEADLINE).await.unwrap();
    }
    seen
}

/// The entry of `path` in `status`: `(granted, granted bytes, opened, opened bytes)`.
fn counted(status: &NodeStatus, path: &str) -> (u64, u64, u64, u64) {
    status
        .paths
        .iter()
        .find(|p| p.path == path)
        .map_or((0, 0, 0, 0), |p| {
            (p.granted, p.granted_bytes, p.opened, p.opened_bytes)
        })
}

/// `status` as Prometheus text, through the node's metrics.
fn metrics_of(status: &NodeStatus) -> String {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || baton::actors::metrics::record(status));
    handle.render()
}

fn has_line(rendered: &str, line: &str) {
    assert!(
        rendered.lines().any(|l| l == line),
        "no {line:?} in\n{rendered}"
    );
}

/// Asserts that `exporter` granted, and `importer` opened, exactly `leases` leases of
/// `bytes` bytes in all through `path`, in status and metrics, and that neither took a
/// downgrade unless `downgraded`.
fn assert_counted(exporter: &Node, importer: &Node, path: &str, leases: u64, bytes: u64) {
    let (ex, im) = (exporter.status(0), importer.status(0));
    assert_eq!(
        counted(&ex, path),
        (leases, bytes, 0, 0),
        "exporter: {:?}",
        ex.paths
    );
    assert_eq!(
        counted(&im, path),
        (0, 0, leases, bytes),
        "importer: {:?}",
        im.paths
    );
    let (ex, im) = (metrics_of(&ex), metrics_of(&im));
    has_line(
        &ex,
        &format!("baton_tx_requests_num_total{{path=\"{path}\"}} {leases}"),
    );
    has_line(
        &ex,
        &format!("baton_tx_bytes_total{{path=\"{path}\"}} {bytes}"),
    );
    has_line(
        &im,
        &format!("baton_rx_requests_num_total{{path=\"{path}\"}} {leases}"),
    );
    has_line(
        &im,
        &format!("baton_rx_bytes_total{{path=\"{path}\"}} {bytes}"),
    );
}

/// An importer linked to `exporter` over a Unix socket in this process.
async fn unix_pair(
    exporter: &Node,
    importer: &Node,
) -> (Peer, Peer, (tempfile::TempDir, SocketDir)) {
    let dir = peer::socket_dir();
    let mut listening = importer.listen(&dir.1, "paths.sock").unwrap();
    let to_importer = exporter.connect(listening.path()).await.unwrap();
    let to_exporter = listening.accept_timeout(DEADLINE).await.unwrap();
    (to_importer, to_exporter, dir)
}

/// `a` linked to `b` over loopback TCP: `(a's peer b, b's peer a)`.
async fn tcp_pair(a: &Node, b: &Node) -> Result<(Peer, Peer), ActorError> {
    let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
    let to_b = a.connect_tcp(listening.local_addr()).await?;
    let from_a = listening.accept_timeout(DEADLINE).await.unwrap();
    Ok((to_b, from_a))
}

#[test]
fn a_memfd_lease_says_host_memfd_on_both_sides_in_status_and_metrics() {
    run(async {
        let session = Session::generate().unwrap();
        let a = node_on(&session, "here", memfd(), DowngradePolicy::Refuse);
        let b = node_on(&session, "here", memfd(), DowngradePolicy::Refuse);
        serve(&b);
        let (to_b, _to_a, _dir) = unix_pair(&a, &b).await;
        for len in [1024, 3000] {
            assert_eq!(
                probe(&a, &to_b, len, false).await,
                ("host-memfd".into(), len)
            );
        }
        assert_counted(&a, &b, "host-memfd", 2, 4 * (1024 + 3000));
        assert!(a.status(0).downgrades.is_empty() && b.status(0).downgrades.is_empty());
    });
}

#[test]
fn a_named_segment_lease_says_host_segment() {
    run(async {
        let session = Session::generate().unwrap();
        let named =
            HostBackend::with_flavor(HostFlavor::Named, &peer::namespace("paths-seg")).unwrap();
        let a = node_on(&session, "here", named, DowngradePolicy::Refuse);
        let b = node_on(&session, "here", memfd(), DowngradePolicy::Refuse);
        serve(&b);
        let (to_b, _to_a, _dir) = unix_pair(&a, &b).await;
        assert_eq!(
            probe(&a, &to_b, 512, false).await,
            ("host-segment".into(), 512)
        );
        assert_counted(&a, &b, "host-segment", 1, 4 * 512);
    });
}

#[test]
fn a_buffer_sent_to_another_host_says_tcp_copy() {
    run(async {
        let session = Session::generate().unwrap();
        let a = node_on(&session, "paths-a", memfd(), DowngradePolicy::Refuse);
        let b = node_on(&session, "paths-b", memfd(), DowngradePolicy::Refuse);
        serve(&b);
        let (to_b, _from_a) = tcp_pair(&a, &b).await.unwrap();
        assert_eq!(
            probe(&a, &to_b, 4096, false).await,
            ("tcp-copy".into(), 4096)
        );
        assert_counted(&a, &b, "tcp-copy", 1, 4 * 4096);
        // Two hosts: no downgrade on either side.
        assert!(a.status(0).downgrades.is_empty() && b.status(0).downgrades.is_empty());
    });
}

/// Where a forwarded offer lands: opened, and its path and length told.
struct Inbox(tokio::sync::mpsc::UnboundedSender<(String, usize)>);

impl Actor for Inbox {
    type Context = Context<Self>;
}

impl Handler<Offered> for Inbox {
    type Result = ();
    fn handle(&mut self, msg: Offered, _: &mut Context<Self>) {
        let lease = msg.buffer.open().unwrap();
        let _ = self.0.send((lease.path().name().to_owned(), lease.len()));
    }
}

#[test]
fn a_lease_forwarded_to_another_host_says_tcp_copy_at_the_forwarder_and_the_receiver() {
    run(async {
        let session = Session::generate().unwrap();
        let a = node_on(&session, "paths-fa", memfd(), DowngradePolicy::Refuse);
        let b = node_on(&session, "paths-fa", memfd(), DowngradePolicy::Refuse);
        let c = node_on(&session, "paths-fc", memfd(), DowngradePolicy::Refuse);
        let kept = serve(&b);
        let (tx, mut landed) = tokio::sync::mpsc::unbounded_channel();
        c.set_inbox(Inbox(tx).start().recipient());
        let (a_to_b, _b_to_a, _dir) = unix_pair(&a, &b).await;
        let (b_to_c, _c_to_b) = tcp_pair(&b, &c).await.unwrap();

        assert_eq!(
            probe(&a, &a_to_b, 2048, true).await,
            ("host-memfd".into(), 2048)
        );
        let lease = kept.lock().unwrap().pop().expect("the prober kept it");
        b_to_c.forward(&lease).await.unwrap();
        let seen = tokio::time::timeout(DEADLINE, landed.recv()).await.unwrap();
        assert_eq!(seen, Some(("tcp-copy".into(), 2048 * 4)));
        // A granted one memfd lease (to B); B opened it, and granted C a copy of it.
        assert_eq!(counted(&a.status(0), "host-memfd"), (1, 8192, 0, 0));
        let at_b = b.status(0);
        assert_eq!(counted(&at_b, "host-memfd"), (0, 0, 1, 8192));
        assert_eq!(counted(&at_b, "tcp-copy"), (1, 8192, 0, 0));
        assert_eq!(counted(&c.status(0), "tcp-copy"), (0, 0, 1, 8192));
        has_line(
            &metrics_of(&at_b),
            "baton_tx_requests_num_total{path=\"tcp-copy\"} 1",
        );
    });
}

/// Collects what a node tells (its downgrades, its link events).
struct Collector<M>(Arc<Mutex<Vec<M>>>);

impl<M: 'static + Unpin> Actor for Collector<M> {
    type Context = Context<Self>;
}

impl<M: Message<Result = ()> + Send + Unpin + 'static> Handler<M> for Collector<M> {
    type Result = ();
    fn handle(&mut self, msg: M, _: &mut Context<Self>) {
        self.0.lock().unwrap().push(msg);
    }
}

/// The refusals among `events`.
fn refusals(events: &Mutex<Vec<PeerEvent>>) -> Vec<Arc<ActorError>> {
    let events = events.lock().unwrap();
    events
        .iter()
        .filter_map(|e| match e {
            PeerEvent::Refused(e) => Some(Arc::clone(e)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_host_link_to_a_peer_on_this_host_is_refused_by_default_naming_both_paths() {
    run(async {
        let session = Session::generate().unwrap();
        let a = node_on(&session, "paths-same", memfd(), DowngradePolicy::Refuse);
        let b = node_on(&session, "paths-same", memfd(), DowngradePolicy::Refuse);
        let events = Arc::new(Mutex::new(Vec::new()));
        b.subscribe(Collector(Arc::clone(&events)).start().recipient());
        let mut listening = b.listen_tcp("127.0.0.1:0").unwrap();
        let err = a.connect_tcp(listening.local_addr()).await.unwrap_err();
        match &err {
            ActorError::PathDowngrade {
                kind: Downgrade::CopyOnSameHost,
                wanted: LeasePath::HostMemfd,
                available: LeasePath::TcpCopy,
                ..
            } => {}
            other => panic!("not a refused downgrade: {other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("host-memfd") && msg.contains("tcp-copy"),
            "{msg}"
        );
        assert!(msg.contains(baton::actors::ALLOW_DOWNGRADE_ENV), "{msg}");
        assert_eq!(err.fault(), baton::ipc::Fault::Usage);
        // The listener refuses it too (its own policy), and links nothing.
        actors::eventually(DEADLINE, "the listener to refuse the link", || {
            !refusals(&events).is_empty()
        })
        .await;
        assert!(matches!(
            &*refusals(&events)[0],
            ActorError::PathDowngrade {
                kind: Downgrade::CopyOnSameHost,
                ..
            }
        ));
        assert!(
            listening
                .accept_timeout(std::time::Duration::from_millis(200))
                .await
                .is_err()
        );
        assert!(a.peers().is_empty() && b.peers().is_empty());
        assert!(
            a.status(0).downgrades.is_empty(),
            "a refusal is no downgrade"
        );
    });
}

#[test]
fn an_allowed_same_host_copy_is_an_event_a_status_entry_and_a_metric() {
    run(async {
        let session = Session::generate().unwrap();
        let a = node_on(&session, "paths-same2", memfd(), DowngradePolicy::Allow);
        let b = node_on(&session, "paths-same2", memfd(), DowngradePolicy::Allow);
        let told = Arc::new(Mutex::new(Vec::new()));
        a.on_downgrade(Collector(Arc::clone(&told)).start().recipient());
        serve(&b);
        let (to_b, from_a) = tcp_pair(&a, &b).await.unwrap();
        actors::eventually(DEADLINE, "the downgrade event", || {
            !told.lock().unwrap().is_empty()
        })
        .await;
        let event = told.lock().unwrap()[0];
        assert_eq!(event.kind, Downgrade::CopyOnSameHost);
        assert_eq!(
            (event.wanted.name(), event.taken.name()),
            ("host-memfd", "tcp-copy")
        );
        assert_eq!(event.peer, Some(to_b.process()));

        // The bytes take the slower path, and say so.
        assert_eq!(
            probe(&a, &to_b, 1000, false).await,
            ("tcp-copy".into(), 1000)
        );
        assert_counted(&a, &b, "tcp-copy", 1, 4000);
        for (node, peer) in [(&a, &to_b), (&b, &from_a)] {
            let status = node.status(0);
            assert_eq!(status.downgrades.len(), 1, "{:?}", status.downgrades);
            let d = &status.downgrades[0];
            assert_eq!(
                (d.wanted.as_str(), d.taken.as_str(), d.count),
                ("host-memfd", "tcp-copy", 1),
                "{}",
                peer.process()
            );
            has_line(
                &metrics_of(&status),
                "baton_path_downgrades_total{wanted=\"host-memfd\",taken=\"tcp-copy\"} 1",
            );
        }
    });
}

#[test]
fn the_env_policy_allows_downgrades_only_when_it_says_so() {
    // Read in a child process of this test binary, whose environment is its own.
    if let Ok(want) = std::env::var("BATON_PATHS_ENV_CHILD") {
        let policy = DowngradePolicy::from_env();
        assert_eq!(policy.allows(), want == "allow", "{policy:?}");
        return;
    }
    for (value, want) in [
        (Some("1"), "allow"),
        (Some("no"), "refuse"),
        (None, "refuse"),
    ] {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "the_env_policy_allows_downgrades_only_when_it_says_so",
            "--nocapture",
        ])
        .env("BATON_PATHS_ENV_CHILD", want)
        // Its harness's lines would read as this binary's; a failure says why on stderr.
        .stdout(std::process::Stdio::null());
        match value {
            Some(v) => cmd.env(baton::actors::ALLOW_DOWNGRADE_ENV, v),
            None => cmd.env_remove(baton::actors::ALLOW_DOWNGRADE_ENV),
        };
        let status = cmd.status().unwrap();
        assert!(status.success(), "{value:?}: {status}");
    }
}

/// The CUDA labels, with a helper process (a legacy IPC handle cannot be opened by the
/// process that made it): our two buffers go to its checker, its answer comes back.
#[cfg(feature = "gpu-tests")]
mod gpu {
    use super::*;
    use baton::ipc::cuda::{CudaExport, DEVICE_ENV};
    use msgs::{CheckPair, pattern};

    /// Sends the helper two buffers of ours and opens its answer; asserts the labels on
    /// both sides: ours on its answer, and in both statuses. `peer_gpu`: the helper runs on
    /// device 1.
    async fn both_ways(test: &str, tag: &str, export: CudaExport, peer_gpu: bool) {
        if peer_gpu && !gpus::two_gpus(test) {
            return;
        }
        let (mut parent, _cuda, _gpu) = actors::Parent::start_cuda(tag, export);
        if peer_gpu {
            parent.child_env.push((DEVICE_ENV.into(), "1".into()));
        }
        let (mut child, peer) = parent.child(&[]).await;
        const N: usize = 1 << 19;
        let a = parent.node.allocate::<u32>(N).unwrap();
        let data: Vec<u32> = (0..N).map(|i| pattern(5, i)).collect();
        a.write_at(0, &data).unwrap();
        let b = parent.node.allocate::<f32>(N).unwrap();
        let halves: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
        b.write_at(0, &halves).unwrap();
        let reply = peer
            .remote::<CheckPair>("checker")
            .send(CheckPair {
                seed: 5,
                a: a.share(),
                b: b.share(),
            })
            .await
            .unwrap();
        assert!(reply.ok);
        let sum = reply.sum.open().unwrap();
        let label = match (export, peer_gpu) {
            (CudaExport::Legacy, false) => "cuda-legacy",
            (CudaExport::Legacy, true) => "cuda-legacy-peer-gpu",
            (CudaExport::Vmm, false) => "cuda-vmm",
            (CudaExport::Vmm, true) => "cuda-vmm-peer-gpu",
            (CudaExport::Pool, false) => "cuda-pool",
            (CudaExport::Pool, true) => "cuda-pool-peer-gpu",
        };
        assert_eq!(sum.path().name(), label);
        drop(sum);
        let granted = parent.node.status(0);
        // Our grants carry the kind of handle, never `-peer-gpu` (the importer's to know).
        let offered = label.trim_end_matches("-peer-gpu");
        assert_eq!(counted(&granted, offered).0, 2, "{:?}", granted.paths);
        assert_eq!(counted(&granted, label).2, 1, "{:?}", granted.paths);
        let theirs = peer.status(0, DEADLINE).await.unwrap();
        assert_eq!(counted(&theirs, label).2, 2, "{:?}", theirs.paths);
        assert_eq!(counted(&theirs, offered).0, 1, "{:?}", theirs.paths);
        drop((a, b));
        peer.close();
        assert!(actors::exited(&mut child, DEADLINE).await.success());
    }

    #[test]
    fn cuda_legacy_leases_say_cuda_legacy() {
        run(both_ways(
            "cuda_legacy_leases_say_cuda_legacy",
            "pa-cl",
            CudaExport::Legacy,
            false,
        ));
    }

    #[test]
    fn cuda_vmm_leases_say_cuda_vmm() {
        run(both_ways(
            "cuda_vmm_leases_say_cuda_vmm",
            "pa-cv",
            CudaExport::Vmm,
            false,
        ));
    }

    #[test]
    fn cuda_pool_leases_say_cuda_pool() {
        run(both_ways(
            "cuda_pool_leases_say_cuda_pool",
            "pa-cp",
            CudaExport::Pool,
            false,
        ));
    }

    #[test]
    fn cuda_legacy_leases_of_another_gpu_say_peer_gpu() {
        run(both_ways(
            "cuda_legacy_leases_of_another_gpu_say_peer_gpu",
            "pa-cl2",
            CudaExport::Legacy,
            true,
        ));
    }

    #[test]
    fn cuda_vmm_leases_of_another_gpu_say_peer_gpu() {
        run(both_ways(
            "cuda_vmm_leases_of_another_gpu_say_peer_gpu",
            "pa-cv2",
            CudaExport::Vmm,
            true,
        ));
    }
}
