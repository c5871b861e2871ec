//! The handoff benchmark (issue 7): one program that measures, in one run on one machine,
//!
//! 1. the floor: a raw Unix-socket ping-pong between two processes, each message as long
//!    as a real handle-carrying `Call` frame;
//! 2. the cached handoff round trip: a typed message with a `Shared<u8>` field sent with
//!    `RemoteAddr::send` to an actor in another process, which opens it (an import-cache
//!    hit) and drops the lease (`Release`) before replying;
//! 3. cold handoffs: a new allocation each time (legacy IPC, VMM, slab arena, host);
//! 4. pipelined throughput: handoffs per second one way, many in flight, releases flowing
//!    back;
//! 5. bandwidth: a device copy from an imported buffer vs from a local one (CUDA events);
//! 6. the renderer example, zero-copy vs host-staged (when the example exists);
//! 7. the PyTorch peer, `bench/peers/torch_mp.py`, when asked to run it (`--torch`);
//! 8. fence costs: each driver call of a stream-ordered handoff timed on its own (record
//!    the acquire fence, build and encode the offer, the importer's open and wait, its
//!    release fence, the exporter's wait), for IPC-event and sequence-counter fences.
//!
//! Items 2 and 4 run over links as a node makes them by default (issue 48): frames go
//! through shared-memory rings both ways, on actix systems that poll them
//! (`baton::actors::ring_polling_system`); their records say `"link_ring": true`. The
//! floor stays the socket's. `--socket` runs them on the socket alone (`"link_ring":
//! false`); `--ring-unpolled` on rings on plain actix systems, whose readers sleep on the
//! doorbell after every frame (`"ring_polled": false`). To compare on one core, run the
//! whole benchmark under `taskset -c N`: its peers inherit it.
//!
//! With `--stages` (issue 24) it measures only the cached handoff — the socket floor, the
//! raw link's, the actor path's, on the socket (its stages are the socket's) — and, in a
//! build with `--features stage-probes`, splits the raw link's and the actor path's round
//! trips into stages (see `stages.rs`).
//!
//! It prints JSON lines as results come (and appends them to `$OUT/bench.jsonl` when `OUT`
//! is set), then a table with the machine's name and the ratios against the issue's
//! targets. Figures are reported, never asserted.
//!
//! ```text
//! cargo bench --bench handoff                       # every item the machine can run
//! cargo bench --bench handoff -- --quick            # fewer samples (a smoke run)
//! cargo bench --bench handoff -- --backends host    # only the host backend
//! cargo bench --bench handoff -- --torch bench/peers/torch_mp.py
//! cargo bench --bench handoff -- --items 2,8 --backends cuda-pool
//! cargo bench --bench handoff -- --quick --backends host --items 2,4 --socket
//! cargo bench --bench handoff --features stage-probes -- --stages --backends host
//! ```
//!
//! Without `--backends` it runs every backend the machine has: host, and on a GPU
//! cuda-legacy, cuda-vmm (where the device maps VMM memory shared as fds) and cuda-pool
//! (where it shares memory pools as fds). Each part's wall time is printed as it ends.
//!
//! The peers are this same executable, re-spawned with `peer ROLE …` (never forked).

mod actor;
mod cold;
mod counting;
mod fence;
mod floor;
mod gpu;
mod machine;
mod peer;
mod renderer;
mod report;
mod stages;
mod stats;
mod torch;

use report::Report;
use std::error::Error;
use std::path::PathBuf;

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

pub(crate) type Res<T> = Result<T, Box<dyn Error>>;

/// Which backends to run the items on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackendName {
    Host,
    CudaLegacy,
    CudaVmm,
    /// Stream-ordered pool memory (`CudaExport::Pool`).
    CudaPool,
}

impl BackendName {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::CudaLegacy => "cuda-legacy",
            Self::CudaVmm => "cuda-vmm",
            Self::CudaPool => "cuda-pool",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "host" => Some(Self::Host),
            "cuda-legacy" | "legacy" => Some(Self::CudaLegacy),
            "cuda-vmm" | "vmm" => Some(Self::CudaVmm),
            "cuda-pool" | "pool" => Some(Self::CudaPool),
            _ => None,
        }
    }

    pub(crate) fn is_cuda(self) -> bool {
        self != Self::Host
    }

    /// How a CUDA backend of this name exports (`Legacy` for host, unused there).
    pub(crate) fn export(self) -> baton::ipc::cuda::CudaExport {
        use baton::ipc::cuda::CudaExport;
        match self {
            Self::CudaVmm => CudaExport::Vmm,
            Self::CudaPool => CudaExport::Pool,
            Self::Host | Self::CudaLegacy => CudaExport::Legacy,
        }
    }
}

/// How much to measure.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) quick: bool,
    pub(crate) backends: Vec<BackendName>,
    pub(crate) items: Vec<u8>,
    pub(crate) torch: Option<PathBuf>,
    pub(crate) python: String,
    pub(crate) renderer: Option<PathBuf>,
    /// Parts that would start after this much wall time are skipped (and said so), so that
    /// a run under a per-command limit still prints its table.
    pub(crate) budget: Option<std::time::Duration>,
    /// `--stages`: the cached handoff alone, split into stages (issue 24).
    pub(crate) stages: bool,
    /// The actor items' links (items 2 and 4) carry frames through shared-memory rings both
    /// ways (issue 48), on systems whose threads poll them, as a node's links do by default;
    /// `--socket` (or `--stages`): on the socket alone, whatever `BATON_LINK_RING` says.
    pub(crate) ring: bool,
    /// `--ring-unpolled`: as the default, on plain actix systems (no park hook): each frame
    /// costs a doorbell wakeup, what a node gets that runs on `actix::System::new()`.
    pub(crate) ring_unpolled: bool,
    /// `--across-namespaces`: the bandwidth item (5) also runs its importer in PID and
    /// network namespaces of its own, as a container's process (issue 51; root only), and
    /// compares its imported bandwidth with the same-namespace importer's.
    pub(crate) across_namespaces: bool,
}

impl Config {
    /// `full` samples normally, about a tenth with `--quick`.
    pub(crate) fn samples(&self, full: usize) -> usize {
        if self.quick {
            (full / 10).max(20)
        } else {
            full
        }
    }

    pub(crate) fn wants(&self, item: u8) -> bool {
        self.items.is_empty() || self.items.contains(&item)
    }
}

const USAGE: &str = "usage: handoff [--quick] [--backends host,cuda-legacy,cuda-vmm,cuda-pool] \
[--items 1,2,3,4,5,6,7,8] [--stages] [--socket | --ring-unpolled] [--across-namespaces] [--torch bench/peers/torch_mp.py] [--python python3] [--renderer PATH] [--budget SECONDS]";

fn parse_args(args: &[String]) -> Res<Config> {
    let mut cfg = Config {
        quick: false,
        backends: Vec::new(),
        items: Vec::new(),
        torch: None,
        python: "python3".to_owned(),
        renderer: None,
        budget: None,
        stages: false,
        ring: true,
        ring_unpolled: false,
        across_namespaces: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            // cargo bench passes `--bench`; libtest-style filters are not used here.
            "--bench" => {}
            "--quick" => cfg.quick = true,
            "--stages" => (cfg.stages, cfg.ring) = (true, false),
            "--socket" => cfg.ring = false,
            // The default; accepted for the command lines of earlier records.
            "--ring" => cfg.ring = true,
            "--ring-unpolled" => (cfg.ring, cfg.ring_unpolled) = (true, true),
            "--across-namespaces" => cfg.across_namespaces = true,
            "--backends" => {
                for b in value()?.split(',') {
                    cfg.backends
                        .push(BackendName::parse(b).ok_or(format!("unknown backend {b:?}"))?);
                }
            }
            "--items" => {
                for i in value()?.split(',') {
                    cfg.items
                        .push(i.parse().map_err(|_| format!("bad item {i:?}"))?);
                }
            }
            "--torch" => cfg.torch = Some(value()?.into()),
            "--python" => cfg.python = value()?,
            "--renderer" => cfg.renderer = Some(value()?.into()),
            "--budget" => {
                let v = value()?;
                let secs: f64 = v.parse().map_err(|_| format!("bad --budget {v:?}"))?;
                cfg.budget = Some(std::time::Duration::from_secs_f64(secs));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}").into()),
        }
    }
    Ok(cfg)
}

/// The peer side: `ROLE ARGS…`, dispatched here, at the root, so that the modules of the
/// items and `peer` (which spawns them) do not use each other.
fn run_peer(args: &[String]) -> Res<()> {
    let arg = |i: usize| -> Res<&str> {
        args.get(i)
            .map(String::as_str)
            .ok_or_else(|| format!("peer {:?}: missing argument {i}", args.first()).into())
    };
    match arg(0)? {
        "echo" => floor::echo(arg(1)?, arg(2)?.parse()?),
        "consumer" => actor::consumer(arg(1)?),
        "cold-importer" => cold::importer(arg(1)?, arg(2)? == "pin", arg(3)?),
        "bw-importer" => gpu::importer(arg(1)?, arg(2)?.parse()?),
        "fence-importer" => fence::importer(arg(1)?, arg(2)?.parse()?),
        other => Err(format!("unknown peer role {other:?}").into()),
    }
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("peer") {
        return run_peer(&args[1..]);
    }
    let mut cfg = parse_args(&args)?;
    let machine = machine::Machine::detect();
    if cfg.backends.is_empty() {
        cfg.backends.push(BackendName::Host);
        if let Some(gpu) = &machine.gpu {
            cfg.backends.push(BackendName::CudaLegacy);
            if gpu.vmm {
                cfg.backends.push(BackendName::CudaVmm);
            }
            if gpu.pools {
                cfg.backends.push(BackendName::CudaPool);
            }
        }
    }
    let mut report = Report::new(machine, cfg.budget)?;
    report.header(&cfg);
    if cfg.stages {
        stages(&mut cfg, report);
        return Ok(());
    }

    // Item 1 first: every later ratio is against it.
    if cfg.wants(1) || cfg.wants(2) {
        report.attempt("socket floor", |r| floor::run(&cfg, r));
    }
    for &backend in &cfg.backends {
        if cfg.wants(2) || cfg.wants(4) {
            report.attempt(&format!("actor items on {}", backend.as_str()), |r| {
                actor::run(&cfg, backend, r)
            });
        }
        if cfg.wants(3) {
            report.attempt(&format!("cold handoffs on {}", backend.as_str()), |r| {
                cold::run(&cfg, backend, r)
            });
        }
        if cfg.wants(5) && backend.is_cuda() {
            report.attempt(&format!("bandwidth on {}", backend.as_str()), |r| {
                gpu::run(&cfg, backend, r)
            });
        }
    }
    if cfg.wants(6) {
        report.attempt("renderer", |r| renderer::run(&cfg, r));
    }
    if cfg.wants(7) {
        report.attempt("torch peer", |r| torch::run(&cfg, r));
    }
    if cfg.wants(8) {
        if report.machine.gpu.is_some() {
            report.attempt("fence costs", |r| fence::run(&cfg, r));
        } else {
            fence::not_run(&mut report, "no GPU");
        }
    }
    report.finish();
    Ok(())
}

/// `--stages` (issue 24): the floor, the raw link's and the actor path's cached round
/// trips, each path again with its probes recording, then the comparison.
fn stages(cfg: &mut Config, mut report: Report) {
    // Items 1-3 unless `--items` picks some (1 floor, 3 raw link, 2 actor path); never 4.
    if cfg.items.is_empty() {
        cfg.items = vec![1, 2, 3];
    }
    cfg.items.retain(|i| [1, 2, 3].contains(i));
    report.stages_only = true;
    if cfg.wants(1) {
        report.attempt("socket floor", |r| floor::run(cfg, r));
    }
    for &backend in &cfg.backends {
        let name = backend.as_str();
        if cfg.wants(3) {
            report.attempt(&format!("raw link cached handoff on {name}"), |r| {
                cold::run(cfg, backend, r)
            });
        }
        if cfg.wants(2) {
            report.attempt(&format!("actor path cached handoff on {name}"), |r| {
                actor::run(cfg, backend, r)
            });
        }
        stages::summary(&mut report, name);
    }
    if !stages::PROBES {
        stages::no_probes(&mut report);
    }
    report.finish();
}
