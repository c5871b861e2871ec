//! Baton actors inside an existing service binary.
//!
//! The "service" already has its own actix actors: a `Camera` that produces frames on a
//! timer and a `Report` that keeps statistics. To move per-frame work into a separate
//! process without copying frames, it adds four things and changes nothing else:
//!
//! 1. a [`Node`] (this process in the deployment) listening on a private socket;
//! 2. a [`BufferOwner`] that allocates the frames (shared memory, or GPU memory on CUDA);
//! 3. a [`ProcessSupervisor`] that runs the worker (this binary, role `worker`) and
//!    restarts it if it dies;
//! 4. a [`RemoteAddr`] the camera sends typed frame messages to.
//!
//! ```text
//! RUST_LOG=info cargo run --example embed_in_service
//! ```
//!
//! With `RUST_LOG=debug` the log shows the `buffer_owner` and `peer_link` spans with the
//! `alloc`, `gen`, `lease` and `peer` of every handoff.
//!
//! Metrics are opt-in: `--prometheus 127.0.0.1:9464` installs a Prometheus exporter (no
//! listener without the flag) and has the node publish its counters and gauges every
//! second (`baton_leases_out`, `baton_pinned_bytes`, `baton_handoffs_total`, …: see
//! `baton::actors::metrics`); `--linger SECS` keeps the service up that long after its
//! frames, to scrape it or point `baton top` at the socket it prints.

use actix::prelude::*;
use baton::actors::supervisor::Shutdown;
use baton::actors::{
    Allocate, BufferOwner, ChildSpec, Node, PeerEvent, ProcessSupervisor, RemoteAddr,
    RemoteMessage, RestartPolicy, Shared, Stats, Strategy,
};
use baton::messages::Shape;
use baton::{Session, SocketDir};
use serde::{Deserialize, Serialize};
use std::error::Error;
use std::time::{Duration, Instant};

const W: u64 = 640;
const H: u64 = 480;
const FRAMES: u64 = 60;

/// One grey frame for the worker to summarise.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Summary")]
struct Frame {
    seq: u64,
    pixels: Shared<u8>,
}

impl RemoteMessage for Frame {
    const NAME: &'static str = "examples.embed.Frame";
}

#[derive(Debug, Serialize, Deserialize)]
struct Summary {
    seq: u64,
    mean: f64,
}

// ---- the worker process -------------------------------------------------------------

struct Summariser;

impl Actor for Summariser {
    type Context = Context<Self>;
}

impl Handler<Frame> for Summariser {
    type Result = MessageResult<Frame>;

    fn handle(&mut self, frame: Frame, _: &mut Context<Self>) -> Self::Result {
        let mean = match frame.pixels.open().and_then(|lease| lease.to_vec()) {
            Ok(px) => px.iter().map(|&p| f64::from(p)).sum::<f64>() / px.len() as f64,
            Err(e) => {
                tracing::warn!(error = %e, "could not read frame");
                f64::NAN
            }
        };
        // The lease is dropped here: the service's owner sees it come back.
        MessageResult(Summary {
            seq: frame.seq,
            mean,
        })
    }
}

struct ExitWhenAlone(Node);

impl Actor for ExitWhenAlone {
    type Context = Context<Self>;
}

impl Handler<PeerEvent> for ExitWhenAlone {
    type Result = ();
    fn handle(&mut self, event: PeerEvent, _: &mut Context<Self>) {
        if matches!(event, PeerEvent::Down { .. }) && self.0.peers().is_empty() {
            System::current().stop();
        }
    }
}

fn worker() -> Result<(), Box<dyn Error>> {
    // A child's entry point: take the token from the pipe the supervisor passed (and close
    // it) first; `Node::from_env` below gets the same session.
    Session::from_env()?;
    let system = System::new();
    system.block_on(async {
        let node = Node::from_env()?;
        node.register::<Frame>("summariser", Summariser.start().recipient());
        node.subscribe(ExitWhenAlone(node.clone()).start().recipient());
        let socket = std::env::var(baton::actors::supervisor::CONNECT_ENV)?;
        node.connect(socket).await?;
        Ok::<_, Box<dyn Error>>(())
    })?;
    system.run()?;
    Ok(())
}

// ---- the existing service -------------------------------------------------------------

/// The service's own statistics actor (it knows nothing of Baton).
#[derive(Default)]
struct Report {
    done: u64,
    latency: Duration,
}

impl Actor for Report {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
struct Done(Summary, Duration);

impl Handler<Done> for Report {
    type Result = ();
    fn handle(&mut self, Done(summary, took): Done, _: &mut Context<Self>) {
        self.done += 1;
        self.latency += took;
        if summary.seq % 20 == 0 {
            tracing::info!(
                seq = summary.seq,
                mean = summary.mean,
                ?took,
                "frame summarised"
            );
        }
    }
}

#[derive(Message)]
#[rtype(result = "(u64, Duration)")]
struct Totals;

impl Handler<Totals> for Report {
    type Result = MessageResult<Totals>;
    fn handle(&mut self, _: Totals, _: &mut Context<Self>) -> Self::Result {
        MessageResult((self.done, self.latency))
    }
}

/// The service's frame source, now handing frames to the worker through Baton.
struct Camera {
    owner: Addr<BufferOwner>,
    worker: RemoteAddr<Frame>,
    report: Addr<Report>,
    seq: u64,
}

impl Actor for Camera {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(Duration::from_millis(10), |camera, ctx| {
            if camera.seq == FRAMES {
                return;
            }
            camera.seq += 1;
            let (seq, owner, worker, report) = (
                camera.seq,
                camera.owner.clone(),
                camera.worker.clone(),
                camera.report.clone(),
            );
            ctx.spawn(
                async move {
                    let frame = owner
                        .send(Allocate::<u8>::new(Shape::new([H, W]).expect("rank 2")))
                        .await??;
                    let level = (seq * 4 % 256) as u8;
                    frame.write_at(0, &vec![level; (W * H) as usize])?;
                    let start = Instant::now();
                    // `frame` (our handle) drops after the send: the buffer is freed as
                    // soon as the worker releases its lease.
                    let summary = worker
                        .send(Frame {
                            seq,
                            pixels: frame.share(),
                        })
                        .await?;
                    report.do_send(Done(summary, start.elapsed()));
                    Ok::<_, baton::actors::ActorError>(())
                }
                .into_actor(camera)
                .map(|r, _, _| {
                    if let Err(e) = r {
                        tracing::warn!(error = %e, "frame lost");
                    }
                }),
            );
        });
    }
}

fn service(cli: &Cli) -> Result<(), Box<dyn Error>> {
    System::new().block_on(async {
        let node = Node::new(Session::generate()?, baton::ipc::select::auto()?);
        let dir = std::env::temp_dir().join(format!("baton-embed-{}", std::process::id()));
        let mut listening = node.listen(&SocketDir::create(&dir)?, "service.sock")?;
        println!("service: listening on {} (baton status / baton top)", listening.path().display());
        // Counters and gauges for the exporter installed by `--prometheus`; without a
        // recorder this records nothing.
        let _metrics = cli.prometheus.map(|_| node.publish_metrics(Duration::from_secs(1)));
        let supervisor = ProcessSupervisor::new(
            node.clone(),
            vec![ChildSpec::this_exe("summariser")?.arg("worker")],
            Strategy::OneForOne,
            RestartPolicy::default(),
        )
        .connect_back(listening.path())
        .start();
        // The supervised worker connects back to our socket: wait for it there.
        let peer = listening.accept_timeout(Duration::from_secs(30)).await?;
        tracing::info!(worker = peer.process().pid, backend = node.backend().name(), "worker linked");

        let owner = BufferOwner::new(&node).start();
        let report = Report::default().start();
        Camera { owner: owner.clone(), worker: peer.remote("summariser"), report: report.clone(), seq: 0 }.start();

        let start = Instant::now();
        while report.send(Totals).await?.0 < FRAMES && start.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (done, latency) = report.send(Totals).await?;
        // Leases come back asynchronously; give the last releases a moment to land.
        let mut stats = owner.send(Stats).await?;
        while stats.buffers > 0 && start.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(5)).await;
            stats = owner.send(Stats).await?;
        }
        println!(
            "service: {done} frames of {W}x{H} handed to pid {} with zero copies, mean round trip {:.2?}; buffers alive {}, leases out {}, freed {}",
            peer.process().pid,
            latency / done.max(1) as u32,
            stats.buffers,
            stats.leases,
            stats.freed
        );
        if let Some(secs) = cli.linger {
            println!("service: lingering {secs} s");
            tokio::time::sleep(Duration::from_secs(secs)).await;
        }
        supervisor.send(Shutdown).await?;
        drop(listening);
        let _ = std::fs::remove_dir(&dir);
        if done != FRAMES || stats.buffers != 0 {
            return Err("frames were lost or buffers leaked".into());
        }
        println!("embed_in_service: OK");
        Ok(())
    })
}

/// Baton actors inside an existing actix service: its camera hands frames to a worker
/// process with zero copies.
#[derive(Debug, clap::Parser)]
#[command(name = "embed_in_service")]
struct Cli {
    /// Serve Prometheus metrics at this address (e.g. 127.0.0.1:9464); off by default.
    #[arg(long, value_name = "ADDR")]
    prometheus: Option<std::net::SocketAddr>,
    /// Stay up this many seconds after the last frame (to scrape the metrics, or to run
    /// `baton status` on the socket).
    #[arg(long, value_name = "SECS")]
    linger: Option<u64>,
    #[command(subcommand)]
    role: Option<Role>,
}

#[derive(Debug, clap::Subcommand)]
enum Role {
    /// The worker process (the service's supervisor starts it).
    #[command(hide = true)]
    Worker,
}

fn main() -> Result<(), Box<dyn Error>> {
    use std::io::IsTerminal;
    let cli = <Cli as clap::Parser>::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if let Some(addr) = cli.prometheus {
        // Before any runtime exists: the exporter runs its listener on a thread of its own.
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()?;
        println!("service: Prometheus metrics at http://{addr}/metrics");
    }
    match cli.role {
        Some(Role::Worker) => worker(),
        None => service(&cli),
    }
}
