//! Load: many importer processes holding many live leases on this process's buffers.
//!
//! This process (the exporter) runs a [`Node`] and a [`BufferOwner`]; it spawns importer
//! processes (this same binary with the role `importer`), and grows the number of live
//! buffers — each leased to one importer, which keeps it mapped — through the points of a
//! curve. At each point it measures:
//!
//! - **memory per lease**: the exporter's and the importers' resident memory (`VmRSS`,
//!   split into anonymous memory — bookkeeping — and shared memory — the buffers' pages,
//!   from `/proc/<pid>/status`) grown since the importers started, divided by the live
//!   leases;
//! - **handoff latency**: the round trip of a typed message carrying one buffer the
//!   importer already maps (grant a lease, send, the importer opens it — an import-cache
//!   hit —, reads it and drops it, `Release`, reply), p50 and p99; and the same for a fresh
//!   buffer it never mapped (a cache miss: one `shm_open` + `mmap`); and the cached round
//!   trip always to the same importer (`hit1`), which separates what the number of
//!   importers costs from what switching between importer processes costs.
//!
//! Each curve (one number of importers) runs in a fresh exporter process, so that memory an
//! earlier curve freed — and the allocator kept — does not hide this one's growth. It
//! prints a table and one JSON line per point. It is a measurement, never an assertion.
//!
//! ```text
//! cargo run --release --example load                   # 1, 4, 16 importers × 100, 1k, 10k buffers
//! cargo run --release --example load -- 16 10000 2000  # importers, live buffers, samples
//! ```
//!
//! Each host buffer is one shared-memory segment: one descriptor and one mapping in the
//! exporter, and one of each in the importer that holds it. The node raises its soft
//! `RLIMIT_NOFILE` to the hard limit; the program says so if the limit is too low.

use actix::prelude::*;
use baton::Session;
use baton::actors::{Allocate, Buffer, BufferOwner, Lease, Node, Shared, Stats};
use baton::ipc::{HostBackend, host};
use serde::{Deserialize, Serialize};
use std::error::Error;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Keep these leases.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
struct Hold {
    buffers: Vec<Shared<u32>>,
}

impl baton::actors::RemoteMessage for Hold {
    const NAME: &'static str = "load.Hold";
}

/// Drop every held lease.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "usize")]
struct DropAll;

impl baton::actors::RemoteMessage for DropAll {
    const NAME: &'static str = "load.DropAll";
}

/// Open one buffer, read its first element, drop it.
#[derive(Serialize, Deserialize, Message)]
#[rtype(result = "u32")]
struct Touch {
    buffer: Shared<u32>,
}

impl baton::actors::RemoteMessage for Touch {
    const NAME: &'static str = "load.Touch";
}

const DEADLINE: Duration = Duration::from_secs(120);
/// Elements of each buffer (4 KiB: one page, the smallest segment).
const ELEMENTS: u64 = 1024;
/// Buffers per `Hold` call (each offer is ~150 bytes of a frame of at most 1 MiB).
const BATCH: usize = 500;

/// Load: many importer processes holding many live leases on this process's buffers;
/// memory per lease and handoff latency along a curve. Without arguments: 1, 4 and 16
/// importers, each at 100, 1 000 and 10 000 live buffers.
#[derive(Debug, clap::Parser)]
#[command(name = "load", args_conflicts_with_subcommands = true)]
struct Cli {
    /// Importer processes (with LIVE: one point instead of the whole curve).
    #[arg(requires = "live")]
    importers: Option<usize>,
    /// Live buffers.
    live: Option<usize>,
    /// Handoffs timed per point.
    #[arg(default_value_t = 2000)]
    samples: usize,
    #[command(subcommand)]
    role: Option<Role>,
}

#[derive(Debug, clap::Subcommand)]
enum Role {
    /// An importer (the exporter starts them).
    #[command(hide = true)]
    Importer,
    /// One curve for one number of importers, in a fresh process (so that memory freed by
    /// an earlier curve and kept by the allocator does not hide this one's growth).
    #[command(hide = true)]
    Curve {
        /// Importer processes.
        importers: usize,
        /// Live buffers at each point, comma-separated.
        live: String,
        /// Handoffs timed per point.
        samples: usize,
    },
}

fn main() -> Result<(), Box<dyn Error>> {
    let cli = <Cli as clap::Parser>::parse();
    match cli.role {
        Some(Role::Importer) => importer(),
        Some(Role::Curve {
            importers,
            live,
            samples,
        }) => {
            let live: Vec<usize> = live.split(',').filter_map(|v| v.parse().ok()).collect();
            exporter(importers, &live, samples)
        }
        None => {
            let (importers, live, samples) = match (cli.importers, cli.live) {
                (Some(i), Some(l)) => (vec![i], vec![l], cli.samples),
                _ => (vec![1, 4, 16], vec![100, 1_000, 10_000], cli.samples),
            };
            report_header(&live);
            let live: Vec<String> = live.iter().map(usize::to_string).collect();
            for n in importers {
                let status = Command::new(std::env::current_exe()?)
                    .args([
                        "curve",
                        &n.to_string(),
                        &live.join(","),
                        &samples.to_string(),
                    ])
                    .stdin(Stdio::null())
                    .status()?;
                if !status.success() {
                    return Err(format!("the curve for {n} importers failed: {status}").into());
                }
            }
            Ok(())
        }
    }
}

// ---------------------------------------------------------------------------------------
// The importer.

struct Holder {
    held: Vec<Lease<u32>>,
}

impl Actor for Holder {
    type Context = Context<Self>;
}

impl Handler<Hold> for Holder {
    type Result = usize;
    fn handle(&mut self, msg: Hold, _: &mut Context<Self>) -> usize {
        for s in msg.buffers {
            self.held.push(s.open().expect("a received buffer"));
        }
        self.held.len()
    }
}

impl Handler<DropAll> for Holder {
    type Result = usize;
    fn handle(&mut self, _: DropAll, _: &mut Context<Self>) -> usize {
        let n = self.held.len();
        self.held.clear();
        n
    }
}

impl Handler<Touch> for Holder {
    type Result = u32;
    fn handle(&mut self, msg: Touch, _: &mut Context<Self>) -> u32 {
        let lease = msg.buffer.open().expect("a received buffer");
        let mut first = [0u32];
        lease.read_into(0, &mut first).expect("readable");
        first[0]
    }
}

fn importer() -> Result<(), Box<dyn Error>> {
    System::new().block_on(async {
        // A child's entry point: the session (from the token pipe the parent passed), the
        // parent's host backend and segment namespace, and the link to the parent.
        let (node, parent) = Node::join().await?;
        let holder = Holder { held: Vec::new() }.start();
        node.register::<Hold>("hold", holder.clone().recipient());
        node.register::<DropAll>("drop", holder.clone().recipient());
        node.register::<Touch>("touch", holder.recipient());
        // Serve until the exporter hangs up.
        parent.closed().await;
        Ok::<_, Box<dyn Error>>(())
    })
}

// ---------------------------------------------------------------------------------------
// The exporter.

/// Resident memory of a process, in KiB (`/proc/<pid>/status`).
#[derive(Debug, Clone, Copy, Default)]
struct Rss {
    total: i64,
    anon: i64,
    shmem: i64,
}

impl Rss {
    fn of(pid: u32) -> Rss {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Rss {
            total: field("VmRSS:"),
            anon: field("RssAnon:"),
            shmem: field("RssShmem:"),
        }
    }

    fn minus(self, base: Rss) -> Rss {
        Rss {
            total: self.total - base.total,
            anon: self.anon - base.anon,
            shmem: self.shmem - base.shmem,
        }
    }

    fn plus(self, other: Rss) -> Rss {
        Rss {
            total: self.total + other.total,
            anon: self.anon + other.anon,
            shmem: self.shmem + other.shmem,
        }
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The machine, for the report.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    format!(
        "{cores} cores ({cpu}), Linux {}, {profile} build",
        kernel.trim()
    )
}

async fn poll(what: &str, mut cond: impl FnMut() -> bool) -> Result<(), Box<dyn Error>> {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > DEADLINE {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

fn report_header(live: &[usize]) {
    let machine = machine();
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    println!("load: {machine}");
    println!(
        "load: RLIMIT_NOFILE hard limit {:?}; each live host buffer holds a descriptor in the exporter and in its importer",
        limit.maximum
    );
    if let Some(max) = limit.maximum {
        let need = live.iter().max().copied().unwrap_or(0) as u64 + 256;
        if max < need {
            println!(
                "load: WARNING: the hard limit {max} is below the {need} descriptors the largest point needs"
            );
        }
    }
    println!(
        "{:>9} {:>7} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}",
        "importers",
        "live",
        "exp B/lease",
        "exp anon B",
        "imp B/lease",
        "imp anon B",
        "hit p50",
        "hit p99",
        "hit1 p50",
        "miss p50",
        "miss p99",
        "fds"
    );
}

fn exporter(n: usize, live: &[usize], samples: usize) -> Result<(), Box<dyn Error>> {
    let machine = machine();
    let system = System::new();
    system.block_on(async {
        let ns = format!("load-{}", std::process::id());
        let session = Session::generate()?;
        let node = Node::new(session, Arc::new(HostBackend::with_namespace(&ns)?));
        let owner = BufferOwner::new(&node).start();
        let me = std::process::id();
        let exe = std::env::current_exe()?;

        {
            // Spawn the importers and wait for their links.
            let mut children = Vec::new();
            for _ in 0..n {
                let mut importer = Command::new(&exe);
                importer
                    .arg("importer")
                    .env(host::NAMESPACE_ENV, &ns)
                    .stdin(Stdio::null());
                // Started with our token (through a pipe) and backend, and linked.
                children.push(node.spawn_child(importer).await?);
            }
            let exp_base = Rss::of(me);
            let imp_base: Vec<Rss> = children.iter().map(|c| Rss::of(c.pid())).collect();

            let mut buffers: Vec<Buffer<u32>> = Vec::new();
            for &target in live {
                // Grow to `target` live buffers, dealt round-robin to the importers.
                let mut fresh = Vec::new();
                while buffers.len() + fresh.len() < target {
                    let b: Buffer<u32> = owner.send(Allocate::vector(ELEMENTS)).await??;
                    b.write_at(0, &[(buffers.len() + fresh.len()) as u32])?;
                    fresh.push(b);
                }
                let start = buffers.len();
                buffers.extend(fresh);
                for (i, c) in children.iter().enumerate() {
                    let mine: Vec<usize> = (start..buffers.len()).filter(|j| j % n == i).collect();
                    for chunk in mine.chunks(BATCH) {
                        c.peer()
                            .remote::<Hold>("hold")
                            .send_timeout(
                                Hold {
                                    buffers: chunk.iter().map(|&j| buffers[j].share()).collect(),
                                },
                                DEADLINE,
                            )
                            .await?;
                    }
                }
                let stats = owner.send(Stats).await?;
                assert_eq!(stats.leases, buffers.len(), "every buffer is leased once");

                let exp = Rss::of(me).minus(exp_base);
                let imp = children
                    .iter()
                    .zip(&imp_base)
                    .map(|(c, b)| Rss::of(c.pid()).minus(*b))
                    .fold(Rss::default(), Rss::plus);
                let per = |kib: i64| kib as f64 * 1024.0 / buffers.len() as f64;

                // Cached handoffs: a buffer its importer already maps. The first tenth
                // warms caches and code paths up and is not counted.
                let mut hits = Vec::with_capacity(samples);
                let mut x = 0x9E37_79B9_7F4A_7C15u64;
                for round in 0..samples + samples / 10 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let j = (x % buffers.len() as u64) as usize;
                    let c = &children[j % n];
                    let t = Instant::now();
                    let got = c
                        .peer()
                        .remote::<Touch>("touch")
                        .send_timeout(Touch { buffer: buffers[j].share() }, DEADLINE)
                        .await?;
                    if round >= samples / 10 {
                        hits.push(t.elapsed());
                    }
                    assert_eq!(got, j as u32);
                }
                // The same, always to the first importer: tells what the number of
                // importers costs from what alternating between processes costs.
                let mut one = Vec::with_capacity(samples / 4);
                for round in 0..(samples / 4 + samples / 40) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let j = (x % buffers.len().div_ceil(n) as u64) as usize * n;
                    let t = Instant::now();
                    let got = children[0]
                        .peer()
                        .remote::<Touch>("touch")
                        .send_timeout(Touch { buffer: buffers[j].share() }, DEADLINE)
                        .await?;
                    if round >= samples / 40 {
                        one.push(t.elapsed());
                    }
                    assert_eq!(got, j as u32);
                }
                one.sort();
                // Uncached handoffs: a fresh buffer each time (the first map in the importer).
                let mut misses = Vec::with_capacity(samples / 10);
                for k in 0..(samples / 10).max(1) {
                    let b: Buffer<u32> = owner.send(Allocate::vector(ELEMENTS)).await??;
                    b.write_at(0, &[7])?;
                    let c = &children[k % n];
                    let t = Instant::now();
                    let got = c
                        .peer()
                        .remote::<Touch>("touch")
                        .send_timeout(Touch { buffer: b.share() }, DEADLINE)
                        .await?;
                    misses.push(t.elapsed());
                    assert_eq!(got, 7);
                }
                hits.sort();
                misses.sort();
                let fds = open_fds(me);
                println!(
                    "{:>9} {:>7} {:>12.0} {:>12.0} {:>12.0} {:>12.0} {:>8.1}µs {:>8.1}µs {:>8.1}µs {:>8.1}µs {:>8.1}µs {:>7}",
                    n,
                    buffers.len(),
                    per(exp.total),
                    per(exp.anon),
                    per(imp.total),
                    per(imp.anon),
                    us(percentile(&hits, 0.5)),
                    us(percentile(&hits, 0.99)),
                    us(percentile(&one, 0.5)),
                    us(percentile(&misses, 0.5)),
                    us(percentile(&misses, 0.99)),
                    fds,
                );
                println!(
                    "{{\"importers\":{n},\"live\":{},\"exporter_rss_bytes_per_lease\":{:.0},\"exporter_anon_bytes_per_lease\":{:.0},\"exporter_shmem_bytes_per_lease\":{:.0},\"importers_rss_bytes_per_lease\":{:.0},\"importers_anon_bytes_per_lease\":{:.0},\"importers_shmem_bytes_per_lease\":{:.0},\"hit_p50_us\":{:.1},\"hit_p99_us\":{:.1},\"hit_samples\":{},\"hit_one_importer_p50_us\":{:.1},\"miss_p50_us\":{:.1},\"miss_p99_us\":{:.1},\"miss_samples\":{},\"exporter_fds\":{fds},\"machine\":{:?}}}",
                    buffers.len(),
                    per(exp.total),
                    per(exp.anon),
                    per(exp.shmem),
                    per(imp.total),
                    per(imp.anon),
                    per(imp.shmem),
                    us(percentile(&hits, 0.5)),
                    us(percentile(&hits, 0.99)),
                    hits.len(),
                    us(percentile(&one, 0.5)),
                    us(percentile(&misses, 0.5)),
                    us(percentile(&misses, 0.99)),
                    misses.len(),
                    machine,
                );
            }

            // Give everything back and check nothing is left.
            for c in &children {
                c.peer().remote::<DropAll>("drop").send_timeout(DropAll, DEADLINE).await?;
            }
            drop(buffers);
            poll("every lease back and every buffer freed", || {
                host::list_segments(&ns).map(|s| s.is_empty()).unwrap_or(false)
            })
            .await?;
            // Each importer stops when its link goes down; reap them without blocking.
            for c in children {
                c.peer().close_and_wait().await;
                c.wait().await?;
            }
        }
        let left = owner.send(Stats).await?;
        println!(
            "load: {n} importers done; owner has {} buffers and {} leases left, {} segments in /dev/shm",
            left.buffers,
            left.leases,
            host::list_segments(&ns)?.len()
        );
        Ok::<_, Box<dyn Error>>(())
    })
}
