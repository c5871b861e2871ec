//! A multi-process renderer on Baton: the supervisor-tree example.
//!
//! ```text
//! cargo run --release --example renderer                    # 1920x1080, 4 workers
//! cargo run --release --example renderer -- --size 3840x2160 --frames 120 --chaos
//! ```
//!
//! ```text
//! root (this process): Node + ProcessSupervisor (one-for-one)
//!  ├── compositor  (same binary, --role compositor)   listens on compositor.sock
//!  ├── worker-0    (same binary, --role worker)       connects to root and compositor
//!  ├── …
//!  └── worker-N-1
//! ```
//!
//! Every frame the compositor asks each worker for its tiles (`Render`), and each worker
//! answers with ONE lease: all its tiles of the frame live in one buffer its `BufferOwner`
//! owns, its *tile sheet* (`scene::Sheet`). Worker `w` of `n` renders the tiles whose index
//! is `w` modulo `n`; tile `j` of its sheet lies at pixel offset `j · slot` (`slot`: the
//! largest tile's pixel count), row-major with its own width as the row pitch, and the
//! tile's place in the frame follows from `j` by arithmetic (`Sheet::rect`, which the CUDA
//! kernels repeat), so nothing but the sheet's six numbers travels. Per worker and frame:
//!
//! - CUDA: one NVRTC kernel launch renders the whole sheet (a tile per z-slice of the grid;
//!   a few launches only past 65,535 tiles); one offer goes out with one fence; the
//!   compositor opens one lease (an import-cache hit after the first frame), its stream
//!   waits on one fence, one kernel launch composes the sheet into the frame buffer, and
//!   dropping the lease sends one release with its fence.
//! - Host: the worker renders into the sheet's shared pages in place; the compositor
//!   copies each tile's rows from the leased pages into the frame's (no other copy).
//! - `--staged` (CUDA): the same sheet, copied device → host shared memory in one copy by
//!   the worker, and uploaded in one copy by the compositor before the same compose
//!   launch.
//!
//! A worker reuses its sheet while no lease on it is out; when the compositor may still
//! read it (a lease out), the worker renders into a new sheet and the old one is freed
//! once its lease comes back. On CUDA the render also waits on the compositor's release
//! fence of the sheet's last frame. The compositor writes PNGs of the first and last
//! frames (and of the first frame that had to mark a tile missing). The root prints
//! progress, and with `--chaos` SIGKILLs a random worker every K frames; the supervisor
//! restarts it, the compositor marks the tiles of the sheet it could not get, and the
//! summary still shows zero leaked bytes.
//!
//! Options (`--help` lists them): `--size WxH` (default 1920x1080), `--frames N` (60), `--workers N` (4),
//! `--tile N` (256), `--backend auto|host|cuda` (auto), `--devices LIST` (CUDA device
//! ordinals, default 0: the compositor uses the first, the workers take them round robin,
//! and each process prints the device it uses), `--chaos [K]` (kill every K frames,
//! default 10), `--kill-compositor N` (SIGKILL the compositor once, at frame N: the workers
//! join its successor, which renders the run again), `--out DIR` (default target/renderer-out), `--staged` (CUDA only: copy each
//! sheet to host shared memory and back, the pipeline zero-copy replaces), `--verify`
//! (compare the last frame with a single-process CPU render), `--no-sweep` (the root does
//! not sweep at the end, so the caller can check what a run left: the summary counts it,
//! and it does not fail the run; the supervisor still removes what killed children left),
//! `--frame-log FILE` (one JSON line per frame, written after the run: `bench/plot_frames.py`
//! draws fps over frames from such files), `--frames-in-flight N` (CUDA: how many frames the
//! host may queue ahead of the GPU, default 1; 0: no bound), `--overlap-render` (CUDA,
//! zero-copy: a worker answers as soon as its render is queued, not once it finished on
//! the GPU — the compositor's stream then waits on fences not yet written, which on a GPU
//! without MPS makes frames about 2.3× slower: docs/BENCHMARKS.md, "Issue 24").
//!
//! The fps counts the GPU's work too: on CUDA the last frame waits until the compositor's
//! stream has run every frame queued (the host may run ahead of the GPU by many frames).

mod gpu;
mod scene;

use actix::prelude::*;
use baton::actors::supervisor::{CONNECT_ENV, Children, KillChild, Shutdown};
use baton::actors::{
    ActorError, Allocate, Buffer, BufferOwner, ChildSpec, Lease, Node, ProcessSupervisor,
    RemoteMessage, Restart, RestartPolicy, Shared, Strategy, SupervisorEvent,
};
use baton::ipc::cuda::{CudaBackend, CudaExport};
use baton::ipc::{Backend, HostBackend, HostFlavor, SharedBackend, host};
use baton::messages::Shape;
use baton::{Session, SocketDir};
use scene::{Sheet, TileRect};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn Error>>;

// ---- options ------------------------------------------------------------------------------

/// A multi-process renderer on Baton: a supervised tree of worker processes renders
/// tiles into shared buffers (one sheet per worker), a compositor process composes them
/// with zero copies.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "renderer")]
struct Options {
    /// Frame size, WIDTHxHEIGHT.
    #[arg(long = "size", value_name = "WxH", default_value = "1920x1080", value_parser = parse_size)]
    size: (u32, u32),
    /// The frame's width (from `--size`).
    #[arg(skip)]
    width: u32,
    /// The frame's height (from `--size`).
    #[arg(skip)]
    height: u32,
    /// Frames to render.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    frames: u64,
    /// Worker processes.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
    /// Tile edge in pixels.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    tile: u32,
    /// Memory backend: auto (CUDA when present), host or cuda.
    #[arg(long, default_value = "auto", value_parser = ["auto", "host", "cuda"])]
    backend: String,
    /// CUDA devices by ordinal, comma-separated (`0,1`): the compositor uses the first,
    /// worker i the (i mod n)-th — round robin — and each process prints the device it
    /// uses. Tiles then cross GPUs through CUDA peer access.
    #[arg(long, value_name = "LIST", value_delimiter = ',', num_args = 1.., default_value = "0")]
    devices: Vec<usize>,
    /// SIGKILL a random worker every K frames (default K: 10); the supervisor restarts it.
    #[arg(long, value_name = "K", num_args = 0..=1, default_missing_value = "10")]
    chaos: Option<u64>,
    /// SIGKILL the compositor once, at frame N: the supervisor restarts it, the workers
    /// join the new one, and it renders the whole run again.
    #[arg(long, value_name = "N")]
    kill_compositor: Option<u64>,
    /// Where the PNGs go.
    #[arg(long, default_value = "target/renderer-out")]
    out: PathBuf,
    /// CUDA only: copy each sheet through host shared memory (the pipeline zero-copy replaces).
    #[arg(long)]
    staged: bool,
    /// Compare the last frame with a single-process CPU render.
    #[arg(long)]
    verify: bool,
    /// Sweep nothing at the end: the caller counts what the run left.
    #[arg(long)]
    no_sweep: bool,
    /// Write one JSON line per frame to FILE (written after the run, outside the timed
    /// part): the frame's wall time and its phases, tiles, leases, import-cache opens and
    /// hits, and on CUDA the compositor's fence waits, how many frames of GPU work were
    /// still queued, and the GPU time between frames. `bench/plot_frames.py` plots them.
    #[arg(long, value_name = "FILE")]
    frame_log: Option<PathBuf>,
    /// CUDA: ask for frame f only once the GPU has finished composing frame f - N (the
    /// host then runs at most N frames ahead of the GPU); 0: no bound. With the host
    /// further ahead, the five processes' streams each wait on another's fence and the GPU
    /// time-slices between them: 97 fps at 3840x2160 unbounded or at 2, 315 at 1, 307
    /// unbounded under MPS (run N, H200; docs/BENCHMARKS.md).
    #[arg(long, value_name = "N", default_value_t = 1)]
    frames_in_flight: u64,
    /// CUDA, zero-copy: a worker answers as soon as its render is queued (the offer's
    /// fence follows it) instead of once the render finished on the GPU. The compositor's
    /// stream then waits on fences not yet written, and a stream waiting on another
    /// process's unwritten fence holds its time slice: 374–414 fps against 875–896 by
    /// default at 3840x2160 (run T, H200; docs/BENCHMARKS.md, "Issue 24"). Under MPS
    /// either is fast.
    #[arg(long)]
    overlap_render: bool,
    /// The default since the run T experiment (kept so that older command lines work).
    #[arg(long, hide = true, conflicts_with = "overlap_render")]
    sync_render: bool,
    /// The process's role in the tree (the root starts the others).
    #[arg(long, hide = true, default_value = "root", value_parser = ["root", "compositor", "worker"])]
    role: String,
    /// A worker's index.
    #[arg(long, hide = true)]
    index: Option<u32>,
    /// The compositor's socket directory.
    #[arg(long, hide = true)]
    sockets: Option<PathBuf>,
}

fn parse_size(s: &str) -> Result<(u32, u32), String> {
    let (w, h) = s.split_once('x').ok_or("--size is WIDTHxHEIGHT")?;
    let w: u32 = w.parse().map_err(|e| format!("width: {e}"))?;
    let h: u32 = h.parse().map_err(|e| format!("height: {e}"))?;
    if w == 0 || h == 0 {
        return Err("sizes must be positive".into());
    }
    Ok((w, h))
}

impl Options {
    /// The command line, parsed (exits with a usage message, or the help, if it must).
    fn from_args() -> Options {
        let mut o = <Options as clap::Parser>::parse();
        (o.width, o.height) = o.size;
        o
    }

    /// The options again, as arguments for a child.
    fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--size".into(),
            format!("{}x{}", self.size.0, self.size.1),
            "--frames".into(),
            self.frames.to_string(),
            "--workers".into(),
            self.workers.to_string(),
            "--tile".into(),
            self.tile.to_string(),
            "--backend".into(),
            self.backend.clone(),
            "--devices".into(),
            self.devices
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
            "--out".into(),
            self.out.display().to_string(),
        ];
        if self.staged {
            a.push("--staged".into());
        }
        if self.overlap_render {
            a.push("--overlap-render".into());
        }
        if self.verify {
            a.push("--verify".into());
        }
        if let Some(log) = &self.frame_log {
            a.push("--frame-log".into());
            a.push(log.display().to_string());
        }
        a.push("--frames-in-flight".into());
        a.push(self.frames_in_flight.to_string());
        a
    }

    /// The compositor's CUDA device (and the root's): the first of `--devices`.
    fn compositor_device(&self) -> usize {
        self.devices[0]
    }

    /// Worker `index`'s CUDA device: `--devices` round robin.
    fn worker_device(&self, index: u32) -> usize {
        self.devices[index as usize % self.devices.len()]
    }

    /// `--devices` without repeats, in order.
    fn distinct_devices(&self) -> Vec<usize> {
        let mut seen = Vec::new();
        for &d in &self.devices {
            if !seen.contains(&d) {
                seen.push(d);
            }
        }
        seen
    }
}

/// This process's backend: CUDA on device `ordinal` (with its concrete type, for kernels)
/// or host. `across_gpus`: its buffers go to a process on another GPU, so a pool export
/// becomes VMM — pool memory is not opened across GPUs (it dies with its exporter and would
/// take the importer's context with it: `docs/CUDA.md`).
fn backend(
    choice: &str,
    ordinal: usize,
    across_gpus: bool,
) -> Res<(SharedBackend, Option<Arc<CudaBackend>>)> {
    let export = match CudaExport::from_env()? {
        CudaExport::Pool if across_gpus => CudaExport::Vmm,
        export => export,
    };
    let cuda = match choice {
        "host" => None,
        "cuda" => Some(CudaBackend::new(ordinal, export)?),
        "auto" => CudaBackend::new(ordinal, export).ok(),
        other => return Err(format!("--backend {other}: use auto, host or cuda").into()),
    };
    Ok(match cuda {
        Some(c) => {
            let c = Arc::new(c);
            (c.clone(), Some(c))
        }
        None => (Arc::new(HostBackend::new()?), None),
    })
}

// ---- messages ------------------------------------------------------------------------------

/// Compositor → worker: render this sheet of tiles of this frame.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<Rendered, String>")]
struct Render {
    frame: u64,
    sheet: Sheet,
}

impl RemoteMessage for Render {
    const NAME: &'static str = "renderer.Render";
}

/// The sheet, as one lease on the worker's memory.
#[derive(Debug, Serialize, Deserialize)]
struct Rendered {
    sheet: Shared<u32>,
}

/// Worker → compositor: worker `index` is up (as process `pid`).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "()")]
struct Join {
    index: u32,
    pid: u32,
}

impl RemoteMessage for Join {
    const NAME: &'static str = "renderer.Join";
}

/// Compositor → root, after every frame.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[rtype(result = "()")]
struct Progress {
    frame: u64,
    fps: f64,
    tiles_missing: u64,
    leases_held: u64,
}

impl RemoteMessage for Progress {
    const NAME: &'static str = "renderer.Progress";
}

/// Compositor → root, at the end.
#[derive(Debug, Clone, Default, Serialize, Deserialize, Message)]
#[rtype(result = "()")]
struct Done {
    frames: u64,
    seconds: f64,
    /// Of `seconds`, the first frame's: it also pays for one-time work (links' set-up,
    /// driver-level opens, first launches), so the fps of the frames after it is printed
    /// apart.
    first_frame_seconds: f64,
    tiles_composed: u64,
    tiles_missing: u64,
    /// Leases taken: one per worker's sheet and frame.
    leases: u64,
    /// The compositor's import cache: driver-level opens (or `mmap`s) during the first
    /// frame, and after it; hits.
    opens_first_frame: u64,
    opens_after: u64,
    cache_hits: u64,
    pngs: Vec<String>,
    verify: Option<String>,
}

impl RemoteMessage for Done {
    const NAME: &'static str = "renderer.Done";
}

/// One frame, as `--frame-log` writes it (a JSON line). Times are µs of wall time on the
/// compositor, PNG writing and `--verify` excluded.
#[derive(Debug, Clone, Default, Serialize)]
struct FrameRecord {
    frame: u64,
    /// The whole frame: from asking the workers to the leases going back (and, for the
    /// last frame, the wait for the GPU to finish every frame queued).
    us: f64,
    /// Asking every worker and awaiting every answer (a round trip per worker, the
    /// workers' rendering queued, the sheets' offers granted).
    ask_us: f64,
    /// Opening each sheet (an import-cache hit after the first frame) and queuing its
    /// compose.
    compose_us: f64,
    /// Dropping the leases (each `Release` with its fence goes out).
    release_us: f64,
    /// Tiles composed.
    tiles: u64,
    tiles_missing: u64,
    /// Leases held at once this frame (one per composed sheet: a worker's tiles).
    leases_held: u64,
    /// Driver-level opens (or `mmap`s) of the import cache during the frame, and hits.
    opens: u64,
    hits: u64,
    /// Mappings the import cache holds at the end of the frame.
    mappings: usize,
    /// CUDA: fence waits the compositor's backend queued during the frame (acquire
    /// fences of the sheets: one per lease and stream).
    fence_waits: Option<u64>,
    /// CUDA: frames (this one included) whose compose work the GPU had not finished when
    /// this frame's host work ended: how far the host runs ahead of the GPU.
    gpu_frames_queued: Option<u64>,
    /// CUDA: GPU time from the end of the previous frame's compose work to the end of this
    /// frame's (timing events on the compose stream, read after the run).
    gpu_us: Option<f64>,
    /// CUDA, last frame only: the wait for the GPU to finish every queued frame (counted
    /// in `us` and in the run's fps).
    drain_us: Option<f64>,
}

fn write_frame_log(path: &Path, frames: &[FrameRecord]) -> Res<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for f in frames {
        serde_json::to_writer(&mut out, f)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}

// ---- worker --------------------------------------------------------------------------------

/// The buffer a worker renders its sheet into, reused while no lease on it is out.
type SheetSlot = Option<Buffer<u32>>;

struct Worker {
    index: u32,
    node: Node,
    sockets: PathBuf,
    /// The root: when its link goes, the run is over.
    root: baton::actors::Peer,
    /// The compositor joined last: when its link goes (it died and is being restarted),
    /// the worker joins the next one.
    compositor: Option<baton::messages::ProcessId>,
    owner: Addr<BufferOwner>,
    /// The sheet: one buffer for all of this worker's tiles, reused when no lease on it
    /// is out (an import-cache hit for the compositor on every frame after the first),
    /// replaced by a new one when a lease is (the compositor may still read the old one).
    sheet: SheetSlot,
    gpu: Option<(Arc<CudaBackend>, gpu::Kernels)>,
    /// `--staged`: host shared memory the device sheet is copied to, and its owner.
    staging: Option<(Addr<BufferOwner>, SheetSlot)>,
    /// Answer only once the render finished on the GPU (all but `--overlap-render`).
    sync_render: bool,
}

impl Actor for Worker {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.join(ctx);
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        // The sheets drop with the actor: every buffer is freed (no lease is out any more).
        System::current().stop();
    }
}

impl Handler<baton::actors::PeerEvent> for Worker {
    type Result = ();
    fn handle(&mut self, e: baton::actors::PeerEvent, ctx: &mut Context<Self>) {
        if let baton::actors::PeerEvent::Down { peer, .. } = e {
            if peer.process == self.root.process() {
                ctx.stop();
            } else if Some(peer.process) == self.compositor {
                // It died: the supervisor restarts it, and we join the new one.
                self.compositor = None;
                self.join(ctx);
            }
        }
    }
}

impl Worker {
    /// Joins the compositor (retrying while it starts, and again after a failed join: the
    /// compositor may have died meanwhile and be restarting). Once the root has let go
    /// there is nothing to join and the worker stops: a clean exit, nothing to restart.
    fn join(&mut self, ctx: &mut Context<Self>) {
        let (node, sockets, root, index) = (
            self.node.clone(),
            self.sockets.clone(),
            self.root.clone(),
            self.index,
        );
        let join = async move { join_compositor(&node, &sockets, &root, index).await };
        ctx.spawn(join.into_actor(self).map(|joined, act, ctx| match joined {
            Ok(Some(compositor)) => act.compositor = Some(compositor),
            Ok(None) => ctx.stop(),
            Err(e) => {
                tracing::warn!(error = %e, "could not join the compositor: trying again");
                ctx.run_later(Duration::from_millis(100), |act, ctx| act.join(ctx));
            }
        }));
    }
}

fn reusable(slot: &SheetSlot, sheet: &Sheet) -> bool {
    slot.as_ref()
        .is_some_and(|b| b.leases_out() == 0 && b.len() == sheet.pixels())
}

/// A new sheet buffer from `owner`, unless the one in `slot` can be reused.
async fn allocate(
    owner: Addr<BufferOwner>,
    need: Option<Sheet>,
) -> Result<Option<Buffer<u32>>, ActorError> {
    match need {
        Some(sheet) => {
            let pixels = Allocate::<u32>::vector(sheet.pixels() as u64);
            Ok(Some(owner.send(pixels).await??))
        }
        None => Ok(None),
    }
}

impl Worker {
    /// Renders the sheet into its buffer and shares it: one lease, one offer.
    fn render(&mut self, msg: &Render) -> Res<Rendered> {
        let sheet = &msg.sheet;
        let buf = self.sheet.as_mut().ok_or("no sheet buffer")?;
        let shared = match &self.gpu {
            None => {
                // In place: the shared pages themselves, no copy.
                scene::render_sheet_into(&mut buf.as_mut_slice()?, sheet, msg.frame);
                buf.share()
            }
            Some((_, kernels)) => {
                // Waits on the compositor's release fence of this buffer's last frame, then
                // records the write: nobody blocks here.
                kernels.render(buf, sheet, scene::time_of(msg.frame))?;
                match &self.staging {
                    // The pipeline zero-copy replaces: device -> host shared memory, one
                    // copy of the whole sheet (it waits for the kernel).
                    Some((_, staged)) => {
                        let host = staged.as_ref().ok_or("no staging sheet")?;
                        buf.read_into(0, &mut host.as_mut_slice()?)?;
                        host.share()
                    }
                    // The render is done before the answer leaves, so the compositor's
                    // stream finds the fence already written (bounded: the kernel's only
                    // wait is on the compositor's release fence, which this process
                    // releases itself if the compositor dies, and within the fence
                    // deadline if it stalls). `--overlap-render` answers at once.
                    None if self.sync_render => {
                        kernels.synchronize()?;
                        buf.share()
                    }
                    // The offer carries a fence after the kernel; the compositor's stream
                    // waits on it before reading.
                    None => buf.share(),
                }
            }
        };
        Ok(Rendered { sheet: shared })
    }
}

impl Handler<Render> for Worker {
    type Result = ResponseActFuture<Self, Result<Rendered, String>>;

    fn handle(&mut self, msg: Render, _: &mut Context<Self>) -> Self::Result {
        let need = (!reusable(&self.sheet, &msg.sheet)).then_some(msg.sheet);
        let need_staged = match &self.staging {
            Some((_, slot)) => (!reusable(slot, &msg.sheet)).then_some(msg.sheet),
            None => None,
        };
        let owner = self.owner.clone();
        let staging_owner = self.staging.as_ref().map(|(o, _)| o.clone());
        let fresh = async move {
            let device = allocate(owner, need).await?;
            let host = match staging_owner {
                Some(o) => allocate(o, need_staged).await?,
                None => None,
            };
            Ok::<_, ActorError>((device, host))
        };
        Box::pin(fresh.into_actor(self).map(move |fresh, act, _| {
            let (device, host) = fresh.map_err(|e| e.to_string())?;
            // A replaced buffer drops here; its owner frees it once its lease is back.
            if device.is_some() {
                act.sheet = device;
            }
            if let (Some((_, slot)), Some(h)) = (&mut act.staging, host) {
                *slot = Some(h);
            }
            act.render(&msg).map_err(|e| e.to_string())
        }))
    }
}

/// Connects to `path`, retrying while it is not there yet — as long as `root` is linked:
/// once the root has let go (the run is winding down), there is nothing to join: `None`.
async fn connect_retrying(
    node: &Node,
    path: &Path,
    root: &baton::actors::Peer,
) -> Res<Option<baton::actors::Peer>> {
    let start = Instant::now();
    loop {
        if !root.is_connected() {
            return Ok(None);
        }
        match node.connect(path).await {
            Ok(p) => return Ok(Some(p)),
            Err(e) if start.elapsed() > Duration::from_secs(30) => return Err(e.into()),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Connects to the compositor and tells it which worker this process is; `None` once the
/// root has let go.
async fn join_compositor(
    node: &Node,
    sockets: &Path,
    root: &baton::actors::Peer,
    index: u32,
) -> Res<Option<baton::messages::ProcessId>> {
    let Some(compositor) = connect_retrying(node, &sockets.join("compositor.sock"), root).await?
    else {
        return Ok(None);
    };
    compositor
        .remote::<Join>("join")
        .send(Join {
            index,
            pid: std::process::id(),
        })
        .await?;
    Ok(Some(compositor.process()))
}

/// Says on stdout which CUDA device `who` uses (nothing on host memory).
fn say_device(who: &str, cuda: Option<&Arc<CudaBackend>>) {
    if let Some(c) = cuda {
        println!(
            "{who} uses CUDA device {} ({}), pid {}",
            c.ordinal(),
            c.device(),
            std::process::id()
        );
    }
}

fn worker(session: Session, opts: Options, index: u32, sockets: PathBuf) -> Res<()> {
    let system = System::new();
    system.block_on(async move {
        let device = opts.worker_device(index);
        let (backend, cuda) = backend(&opts.backend, device, device != opts.compositor_device())?;
        say_device(&format!("worker {index}"), cuda.as_ref());
        let node = Node::new(session, backend);
        let owner = BufferOwner::new(&node).start();
        let staging = match (&cuda, opts.staged) {
            (Some(_), true) => {
                let host: SharedBackend = Arc::new(HostBackend::new()?);
                Some((BufferOwner::with_backend(&node, host).start(), None))
            }
            _ => None,
        };
        let gpu = match cuda {
            Some(c) => {
                let k = gpu::Kernels::load(&c)?;
                Some((c, k))
            }
            None => None,
        };
        let root = node.connect(std::env::var(CONNECT_ENV)?).await?;
        // Registered before it joins the compositor, which asks for tiles once all joined.
        let actor = Worker {
            index,
            node: node.clone(),
            sockets,
            root,
            compositor: None,
            owner,
            sheet: None,
            gpu,
            staging,
            sync_render: !opts.overlap_render,
        }
        .start();
        node.register::<Render>("render", actor.clone().recipient());
        node.subscribe(actor.recipient());
        Ok::<_, Box<dyn Error>>(())
    })?;
    system.run()?;
    Ok(())
}

// ---- compositor ----------------------------------------------------------------------------

/// Who is worker `index` now.
#[derive(Default, Clone)]
struct Roster(Arc<Mutex<HashMap<u32, u32>>>);

struct Joins(Roster);

impl Actor for Joins {
    type Context = Context<Self>;
}

impl Handler<Join> for Joins {
    type Result = ();
    fn handle(&mut self, j: Join, _: &mut Context<Self>) {
        self.0.0.lock().expect("roster").insert(j.index, j.pid);
    }
}

fn write_png(path: &Path, width: u32, height: u32, pixels: &[u32]) -> Res<()> {
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut encoder = png::Encoder::new(file, width, height);
    encoder.set_color(png::ColorType::Rgba);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Fast);
    encoder
        .write_header()?
        .write_image_data(bytemuck::cast_slice(pixels))?;
    Ok(())
}

/// The compositor's frame: its own buffer, and how tiles get into it.
struct Canvas {
    opts: Options,
    frame: Buffer<u32>,
    gpu: Option<(Arc<CudaBackend>, gpu::Kernels)>,
    /// `--staged` on CUDA: a device buffer (as large as the largest sheet) to upload a
    /// host sheet into before composing.
    scratch: Option<Buffer<u32>>,
}

/// Copies `rect`'s rows from `tile` (row-major, `rect.w` a row) into `frame` (the whole
/// frame, `frame_w` a row).
fn put_rows(frame: &mut [u32], frame_w: u32, rect: &TileRect, tile: &[u32]) {
    let (fw, w) = (frame_w as usize, rect.w as usize);
    for (row, src) in tile.chunks_exact(w).take(rect.h as usize).enumerate() {
        let at = (rect.y as usize + row) * fw + rect.x as usize;
        frame[at..at + w].copy_from_slice(src);
    }
}

impl Canvas {
    /// Writes `rect`'s pixels from `tile` into the frame (a host copy, or an upload on
    /// CUDA: the missing-tile pattern).
    fn put_tile(&self, rect: &TileRect, tile: &[u32]) -> Res<()> {
        let fw = self.opts.width as usize;
        if self.gpu.is_none() {
            put_rows(&mut self.frame.as_mut_slice()?, self.opts.width, rect, tile);
            return Ok(());
        }
        for (row, src) in tile.chunks_exact(rect.w as usize).enumerate() {
            let at = (rect.y as usize + row) * fw + rect.x as usize;
            self.frame.write_at(at, src)?;
        }
        Ok(())
    }

    /// Composes a worker's whole sheet into the frame. On CUDA one kernel launch, queued on
    /// the compositor's stream, ordered by the lease (its first use waits on the worker's
    /// fence; dropping it records the release after the kernel): no synchronise here, and
    /// none before the lease goes back. On host memory, a copy of each tile's rows from the
    /// leased pages straight into the frame's.
    fn compose(&self, sheet: &Sheet, lease: &Lease<u32>) -> Res<()> {
        if lease.len() < sheet.pixels() {
            return Err("the sheet is smaller than its tiles".into());
        }
        // A second handle of the frame buffer, for the `&mut` of cudarc's `DevicePtrMut`.
        let mut frame = self.frame.clone();
        match &self.gpu {
            Some((_, k)) if lease.is_device() => {
                k.compose(&mut frame, gpu::Tiles::Leased(lease), sheet)
            }
            Some((_, k)) => {
                // Staged: host sheet -> device scratch -> frame, one upload. The upload
                // waits for the kernel that last read the scratch buffer.
                let scratch = self.scratch.as_ref().ok_or("no scratch buffer")?;
                scratch.write_at(0, lease.as_slice()?)?;
                k.compose(&mut frame, gpu::Tiles::Own(scratch), sheet)
            }
            None => {
                let (tiles, mut dst) = (lease.as_slice()?, frame.as_mut_slice()?);
                for (at, rect) in sheet.rects() {
                    put_rows(&mut dst, self.opts.width, &rect, &tiles[at..]);
                }
                Ok(())
            }
        }
    }
}

fn compositor(session: Session, opts: Options, sockets: PathBuf) -> Res<()> {
    System::new().block_on(async move {
        let (backend, cuda) = backend(&opts.backend, opts.compositor_device(), false)?;
        say_device("compositor", cuda.as_ref());
        let node = Node::new(session, backend);
        let owner = BufferOwner::new(&node).start();
        let roster = Roster::default();
        node.register::<Join>("join", Joins(roster.clone()).start().recipient());
        let _listening = node.listen(&SocketDir::create(&sockets)?, "compositor.sock")?;
        let root = node.connect(std::env::var(CONNECT_ENV)?).await?;
        let (progress, done) = (root.remote::<Progress>("progress"), root.remote::<Done>("done"));

        let shape = Shape::new([u64::from(opts.height), u64::from(opts.width)]).expect("rank 2");
        let frame = owner.send(Allocate::<u32>::new(shape)).await??;
        // Each worker's sheet, asked for every frame (a worker with no tile is not asked).
        let sheets: Vec<Sheet> = (0..opts.workers).map(|w| Sheet::of_worker(opts.width, opts.height, opts.tile, w, opts.workers)).collect();
        let largest = sheets.iter().map(Sheet::pixels).max().unwrap_or(0);
        let scratch = match (&cuda, opts.staged) {
            (Some(_), true) => Some(owner.send(Allocate::<u32>::vector(largest as u64)).await??),
            _ => None,
        };
        let gpu = match cuda {
            Some(c) => {
                let k = gpu::Kernels::load(&c)?;
                Some((c, k))
            }
            None => None,
        };
        let canvas = Canvas { opts: opts.clone(), frame, gpu, scratch };
        std::fs::create_dir_all(&opts.out)?;

        // Wait for the workers to join (those that do not will show as missing tiles).
        let start = Instant::now();
        while roster.0.lock().expect("roster").len() < opts.workers as usize && start.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        let mut summary = Done::default();
        let mut wrote_missing = false;
        let mut io = Duration::ZERO;
        let us = |d: Duration| (d.as_secs_f64() * 1e7).round() / 10.0;
        let cuda_waits = || canvas.gpu.as_ref().map(|(c, _)| c.waits());
        let mut log: Vec<FrameRecord> = Vec::with_capacity(if opts.frame_log.is_some() { opts.frames as usize } else { 0 });
        let mut marks = gpu::FrameMarks::default();
        let start = Instant::now();
        for f in 0..opts.frames {
            let frame_start = Instant::now();
            if let (n @ 1.., Some(_)) = (opts.frames_in_flight, &canvas.gpu) {
                if let Some(done) = f.checked_sub(n) {
                    marks.wait_for(done)?;
                }
            }
            let (cache_before, waits_before) = (node.cache().stats(), cuda_waits());
            // Ask every worker for its sheet at once.
            let mut asks = Vec::new();
            let mut missing: Vec<TileRect> = Vec::new();
            for (w, sheet) in (0..opts.workers).zip(&sheets).filter(|(_, s)| s.count > 0) {
                let pid = roster.0.lock().expect("roster").get(&w).copied();
                match pid.and_then(|pid| node.peers().into_iter().find(|p| p.process().pid == pid && p.is_connected())) {
                    Some(peer) => {
                        let ask = peer.remote::<Render>("render").send_timeout(Render { frame: f, sheet: *sheet }, Duration::from_secs(60));
                        asks.push((sheet, ask));
                    }
                    None => missing.extend(sheet.rects().map(|(_, r)| r)),
                }
            }
            let (asked, futures): (Vec<_>, Vec<_>) = asks.into_iter().unzip();
            let answers = futures_util::future::join_all(futures).await;
            let answered = Instant::now();
            // One lease per worker: its whole sheet, composed at once.
            let mut held = Vec::new();
            let mut tiles = 0;
            for (sheet, answer) in asked.into_iter().zip(answers) {
                let composed = match answer {
                    Ok(Ok(rendered)) => rendered
                        .sheet
                        .open()
                        .map_err(|e| format!("sheet not opened: {e}"))
                        .and_then(|l| canvas.compose(sheet, &l).map(|()| l).map_err(|e| format!("sheet not composed: {e}"))),
                    Ok(Err(e)) => Err(format!("a worker could not render: {e}")),
                    Err(e) => Err(format!("no answer from a worker: {e}")),
                };
                match composed {
                    Ok(lease) => {
                        held.push(lease);
                        tiles += u64::from(sheet.count);
                    }
                    Err(why) => {
                        tracing::warn!(frame = f, first_tile = sheet.first, "{why}: its tiles are missing");
                        missing.extend(sheet.rects().map(|(_, r)| r));
                    }
                }
            }
            // The leases go back in plain scope order: each release carries a fence after the
            // kernel that read its sheet, and the worker waits on it before rendering there
            // again. Host copies of the frame below wait for the compose kernels.
            let leases_held = held.len() as u64;
            summary.tiles_composed += tiles;
            summary.leases += leases_held;
            let composed = Instant::now();
            drop(held);
            let released = Instant::now();
            for rect in &missing {
                canvas.put_tile(rect, &scene::missing_tile(rect))?;
            }
            summary.tiles_missing += missing.len() as u64;
            if f == 0 {
                summary.opens_first_frame = node.cache().stats().opens;
            }

            let last = f + 1 == opts.frames;
            // The run's time includes the GPU's: at the end, wait for every frame still
            // queued (the host can run ahead of the GPU by many frames; before this wait was
            // here, that backlog drained inside the PNG writing below and was not counted).
            let mut drain = None;
            let mut queued = None;
            if let Some((_, k)) = &canvas.gpu {
                queued = Some(marks.frame_queued(k)?);
                if last {
                    let t = Instant::now();
                    k.synchronize()?;
                    drain = Some(us(t.elapsed()));
                }
            }
            if opts.frame_log.is_some() {
                let cache = node.cache().stats();
                log.push(FrameRecord {
                    frame: f,
                    us: us(frame_start.elapsed()),
                    ask_us: us(answered - frame_start),
                    compose_us: us(composed - answered),
                    release_us: us(released - composed),
                    tiles,
                    tiles_missing: missing.len() as u64,
                    leases_held,
                    opens: cache.opens - cache_before.opens,
                    hits: cache.hits - cache_before.hits,
                    mappings: cache.live,
                    fence_waits: cuda_waits().zip(waits_before).map(|(a, b)| a - b),
                    gpu_frames_queued: queued,
                    gpu_us: None,
                    drain_us: drain,
                });
            }
            let first_missing = !missing.is_empty() && !wrote_missing;
            let io_start = Instant::now();
            if f == 0 || last || first_missing {
                let name = if first_missing { format!("frame-{f:04}-missing.png") } else { format!("frame-{f:04}.png") };
                let path = opts.out.join(name);
                write_png(&path, opts.width, opts.height, &canvas.frame.to_vec()?)?;
                summary.pngs.push(path.display().to_string());
                wrote_missing |= first_missing;
            }
            if last && opts.verify {
                let got = canvas.frame.to_vec()?;
                let want = scene::reference_frame(opts.width, opts.height, f);
                let diff = |a: u32, b: u32| (0..3).map(|c| ((a >> (8 * c)) & 0xff).abs_diff((b >> (8 * c)) & 0xff)).max().unwrap_or(0);
                let exact = got.iter().zip(&want).filter(|(a, b)| a == b).count();
                let close = got.iter().zip(&want).filter(|(a, b)| diff(**a, **b) <= 2).count();
                let worst = got.iter().zip(&want).map(|(a, b)| diff(*a, *b)).max().unwrap_or(0);
                summary.verify = Some(format!(
                    "last frame vs single-process CPU render: {:.4}% exact, {:.4}% within 2/255, worst channel diff {worst}",
                    100.0 * exact as f64 / want.len() as f64,
                    100.0 * close as f64 / want.len() as f64
                ));
            }
            // PNG encoding and --verify are output, not rendering: keep them out of the fps.
            io += io_start.elapsed();
            if f == 0 {
                summary.first_frame_seconds = (start.elapsed() - io).as_secs_f64();
            }
            let fps = (f + 1) as f64 / (start.elapsed() - io).as_secs_f64();
            actix::spawn(progress.send(Progress { frame: f + 1, fps, tiles_missing: summary.tiles_missing, leases_held }));
        }
        summary.frames = opts.frames;
        summary.seconds = (start.elapsed() - io).as_secs_f64();
        if let Some(path) = &opts.frame_log {
            if canvas.gpu.is_some() {
                for (record, gpu_us) in log.iter_mut().zip(marks.intervals_us()?) {
                    record.gpu_us = gpu_us;
                }
            }
            write_frame_log(path, &log)?;
        }
        let cache = node.cache().stats();
        summary.opens_after = cache.opens - summary.opens_first_frame;
        summary.cache_hits = cache.hits;
        done.send(summary).await?;
        Ok::<_, Box<dyn Error>>(())
    })
}

// ---- root ----------------------------------------------------------------------------------

/// Where the root's progress goes: a bar on a terminal, plain lines otherwise (a log, a
/// test reading stdout).
#[derive(Clone)]
enum Output {
    Bar(indicatif::ProgressBar),
    Lines,
}

impl Output {
    fn for_stdout(frames: u64) -> Output {
        use std::io::IsTerminal;
        if !std::io::stdout().is_terminal() {
            return Output::Lines;
        }
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(frames),
            indicatif::ProgressDrawTarget::stdout(),
        );
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos:>5}/{len} frames {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Output::Bar(bar)
    }

    /// A line of its own (above the bar, if there is one).
    fn line(&self, line: &str) {
        match self {
            Output::Bar(bar) => bar.println(line),
            Output::Lines => println!("{line}"),
        }
    }

    /// Progress: the bar moves, or (at most twice a second) a line.
    fn progress(&self, frame: u64, detail: &str, line: impl FnOnce() -> Option<String>) {
        match self {
            Output::Bar(bar) => {
                bar.set_position(frame);
                bar.set_message(detail.to_owned());
            }
            Output::Lines => {
                if let Some(l) = line() {
                    println!("{l}");
                }
            }
        }
    }

    /// The run is over: the bar goes (the summary follows as lines).
    fn finish(&self) {
        if let Output::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}

struct Root {
    out: Output,
    opts: Options,
    supervisor: Option<Addr<ProcessSupervisor>>,
    restarts: u64,
    last_print: Instant,
    rng: u64,
    /// The summary goes to the root's main flow with a sender that answers the compositor's
    /// `Done` call: the compositor stays as it is until the root has looked at it.
    done: Option<tokio::sync::oneshot::Sender<(Done, tokio::sync::oneshot::Sender<()>)>>,
    /// Segments of killed children the supervisor removed, and their bytes.
    swept: (usize, u64),
    /// Every child process started, restarts included: the device-memory leak check counts
    /// these and the root.
    pids: Arc<Mutex<Vec<u32>>>,
}

impl Actor for Root {
    type Context = Context<Self>;
}

impl Handler<Progress> for Root {
    type Result = ();
    fn handle(&mut self, p: Progress, _: &mut Context<Self>) {
        if let (Some(f), Some(sup)) = (self.opts.kill_compositor.take(), &self.supervisor) {
            if p.frame >= f {
                self.out
                    .line(&format!("chaos: frame {} — SIGKILL compositor", p.frame));
                sup.do_send(KillChild("compositor".into()));
            } else {
                self.opts.kill_compositor = Some(f);
            }
        }
        if let (Some(k), Some(sup)) = (self.opts.chaos, &self.supervisor) {
            if p.frame % k == 0 && p.frame < self.opts.frames {
                self.rng ^= self.rng << 13;
                self.rng ^= self.rng >> 7;
                self.rng ^= self.rng << 17;
                let victim = format!("worker-{}", self.rng % u64::from(self.opts.workers));
                self.out
                    .line(&format!("chaos: frame {} — SIGKILL {victim}", p.frame));
                sup.do_send(KillChild(victim));
            }
        }
        let detail = format!(
            "| {:>7.1} fps | live leases {:>4} | restarts {} | missing tiles {}",
            p.fps, p.leases_held, self.restarts, p.tiles_missing
        );
        let due =
            self.last_print.elapsed() > Duration::from_millis(500) || p.frame == self.opts.frames;
        self.out.progress(p.frame, &detail, || {
            due.then(|| format!("frame {:>5}/{} {detail}", p.frame, self.opts.frames))
        });
        if due {
            self.last_print = Instant::now();
        }
    }
}

impl Handler<Done> for Root {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, d: Done, _: &mut Context<Self>) -> Self::Result {
        let (looked, after) = tokio::sync::oneshot::channel();
        if let Some(tx) = self.done.take() {
            let _ = tx.send((d, looked));
        }
        Box::pin(async move {
            let _ = tokio::time::timeout(Duration::from_secs(30), after).await;
        })
    }
}

impl Handler<SupervisorEvent> for Root {
    type Result = ();
    fn handle(&mut self, e: SupervisorEvent, _: &mut Context<Self>) {
        match e {
            SupervisorEvent::Started { restarts, pid, .. } => {
                self.pids.lock().expect("pids").push(pid);
                if restarts > 0 {
                    self.restarts += 1;
                }
            }
            // A killed child could not unlink its named segments: the supervisor removed
            // them before restarting it. (Memfd memory needs no sweep.)
            SupervisorEvent::Swept {
                segments, bytes, ..
            } => {
                self.swept.0 += segments;
                self.swept.1 += bytes;
            }
            SupervisorEvent::Exited {
                name, pid, status, ..
            } => {
                self.out
                    .line(&format!("child exited: {name}, pid {pid}, {status}"));
            }
            _ => {}
        }
    }
}

/// The device memory `pids` use, summed (over every GPU they use), by the driver's per-process accounting (NVML,
/// through `nvidia-smi --query-compute-apps`), in bytes (MiB resolution); `None` where that
/// cannot be read or does not list this process (no `nvidia-smi`, or a PID namespace that
/// hides our pids from the driver). Unlike device-wide free memory, other processes on the
/// GPU do not count.
fn tree_device_bytes(pids: &[u32]) -> Option<u64> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let mut me_listed = false;
    let mut mib = 0u64;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut fields = line.split(',').map(str::trim);
        let (Some(pid), Some(used)) = (fields.next(), fields.next()) else {
            continue;
        };
        let (Ok(pid), Ok(used)) = (pid.parse::<u32>(), used.parse::<u64>()) else {
            continue;
        };
        if pid == std::process::id() {
            me_listed = true;
        }
        if pids.contains(&pid) {
            mib += used;
        }
    }
    me_listed.then_some(mib << 20)
}

/// Bytes of memfds of `namespace` the compositor maps that no live process of the tree holds
/// a descriptor or mapping of: the tiles of workers that died, which it should have let go
/// when their links ended. Read from `/proc` by inode (names are shared by the whole tree),
/// not from the compositor's own account; polled up to 10 s, since a worker killed just
/// before the end is seen dead by the compositor a moment later.
async fn mapped_of_the_dead(supervisor: &Addr<ProcessSupervisor>, namespace: &str) -> Res<u64> {
    let start = Instant::now();
    loop {
        let children = supervisor.send(Children).await?;
        let Some(compositor) = children
            .iter()
            .find(|c| c.name == "compositor")
            .and_then(|c| c.pid)
        else {
            return Ok(0);
        };
        let mine = host::memfd_files(compositor, namespace)?;
        let mut live = mine.held.clone();
        for worker in children
            .iter()
            .filter(|c| c.name != "compositor")
            .filter_map(|c| c.pid)
        {
            // A worker that died meanwhile holds nothing.
            if let Ok(files) = host::memfd_files(worker, namespace) {
                live.extend(files.held);
                live.extend(files.mapped.into_keys());
            }
        }
        let dead: u64 = mine
            .mapped
            .iter()
            .filter(|(inode, _)| !live.contains(inode))
            .map(|(_, bytes)| bytes)
            .sum();
        if dead == 0 || start.elapsed() > Duration::from_secs(10) {
            return Ok(dead);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn root(opts: Options) -> Res<()> {
    let namespace = format!("renderer-{}", std::process::id());
    // Children get the namespace through their specs (their segments are ours to count).
    System::new().block_on(async move {
        let (resolved, cuda) = backend(&opts.backend, opts.compositor_device(), false)?;
        let mut opts = opts;
        opts.backend = resolved.name().to_owned();
        // The compositor writes the frame log: give it a path that does not depend on its
        // working directory.
        if let Some(log) = opts.frame_log.take() {
            opts.frame_log = Some(if log.is_relative() { std::env::current_dir()?.join(log) } else { log });
        }
        // A backend on each of `--devices`: a device that is not there fails the run here,
        // before any child starts; the leak check's fallback measures each one.
        let mut meters = Vec::new();
        if let Some(c) = &cuda {
            meters.push(Arc::clone(c));
            for d in opts.distinct_devices().into_iter().skip(1) {
                meters.push(Arc::new(CudaBackend::new(d, CudaExport::Legacy)?));
            }
        }
        let free_on_devices = || -> Res<usize> {
            Ok(meters.iter().map(|m| m.mem_get_info().map(|(free, _)| free)).sum::<baton::ipc::Result<usize>>()?)
        };
        let device = match &cuda {
            Some(c) if meters.len() > 1 => format!(
                "{} (CUDA, {:?} export), the compositor's; workers round robin over devices {}",
                c.device(),
                c.export(),
                opts.distinct_devices().iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
            ),
            Some(c) => format!("{} (CUDA, {:?} export)", c.device(), c.export()),
            None => "host shared memory".to_owned(),
        };
        // The device-memory leak check: what this process tree uses by the driver's
        // per-process accounting when it can be read here, else device-wide free memory
        // (of every device in `--devices`).
        let baseline = match &cuda {
            Some(_) => Some((free_on_devices()?, tree_device_bytes(&[std::process::id()]))),
            None => None,
        };
        let pids = Arc::new(Mutex::new(vec![std::process::id()]));
        let session = Session::generate()?;
        let host_flavor = HostFlavor::from_env()?;
        let node = Node::new(session, Arc::new(HostBackend::with_flavor(host_flavor, &namespace)?));
        let tmp = std::env::temp_dir().join(format!("baton-renderer-{}", std::process::id()));
        let dir = SocketDir::create(&tmp)?;
        let listening = node.listen(&dir, "root.sock")?;
        let sockets = tmp.join("compositor");

        let child = |name: String, role: &[&str]| -> Res<ChildSpec> {
            let mut spec = ChildSpec::this_exe(name)?.restart(Restart::Transient).env(host::NAMESPACE_ENV, &namespace);
            for a in opts.to_args().into_iter().chain(role.iter().map(|s| s.to_string())) {
                spec = spec.arg(a);
            }
            Ok(spec.arg("--sockets").arg(sockets.display().to_string()))
        };
        let mut specs = vec![child("compositor".into(), &["--role", "compositor"])?];
        for i in 0..opts.workers {
            specs.push(child(format!("worker-{i}"), &["--role", "worker", "--index", &i.to_string()])?);
        }

        let (tx, rx) = tokio::sync::oneshot::channel();
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64 | 1;
        let out = Output::for_stdout(opts.frames);
        let root = Root { out: out.clone(), opts: opts.clone(), supervisor: None, restarts: 0, last_print: Instant::now(), rng: seed, done: Some(tx), swept: (0, 0), pids: pids.clone() }.start();
        node.register::<Progress>("progress", root.clone().recipient());
        node.register::<Done>("done", root.clone().recipient());
        let budget = (opts.frames / opts.chaos.unwrap_or(u64::MAX).max(1)) as u32 + 5;
        let supervisor = ProcessSupervisor::new(node.clone(), specs, Strategy::OneForOne, RestartPolicy { max_restarts: budget, within: Duration::from_secs(60) })
            .connect_back(listening.path())
            .subscriber(root.clone().recipient())
            .start();
        root.send(SetSupervisor(supervisor.clone())).await?;
        println!(
            "renderer: {}x{}, {} frames, {} workers + 1 compositor, tiles {}px, {}{}{}",
            opts.width,
            opts.height,
            opts.frames,
            opts.workers,
            opts.tile,
            device,
            if opts.staged { ", host-staged" } else { ", zero-copy" },
            opts.chaos.map(|k| format!(", chaos every {k} frames")).unwrap_or_default()
        );
        // Who pins what, while it runs: `baton status --tree <socket>` or `baton top <socket>`.
        println!("socket            {}", listening.path().display());

        let (summary, looked) = tokio::time::timeout(Duration::from_secs(1800), rx).await.map_err(|_| "the run did not finish in 30 minutes")??;
        let (restarts, swept_during) = root.send(Restarts).await?;
        out.finish();
        // Before the wind down, while the compositor waits for the answer to its `Done`:
        // does it still map a killed worker's tiles?
        let dead_mapped = mapped_of_the_dead(&supervisor, &namespace).await?;
        let _ = looked.send(());
        // The compositor ends by itself once that answer reaches it: let it, before closing
        // the links (a close could overtake the answer).
        let start = Instant::now();
        while supervisor.send(Children).await?.iter().any(|c| c.name == "compositor" && c.pid.is_some()) && start.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // Wind down: closing the links ends the children cleanly (their Drop frees what
        // they own); whatever is still running after a deadline is killed.
        for peer in node.peers() {
            peer.close();
        }
        let start = Instant::now();
        while supervisor.send(Children).await?.iter().any(|c| c.pid.is_some()) && start.elapsed() < Duration::from_secs(30) {
            // A worker restarted just before the end may link after the close above.
            for peer in node.peers() {
                peer.close();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        supervisor.send(Shutdown).await?;
        drop(listening);
        let _ = std::fs::remove_dir_all(&tmp);

        // Every child is reaped: what is left is named segments nobody unlinked, and memfds
        // this process still maps or holds (the children's went with them). With
        // --no-sweep the root removes nothing: the caller counts what is left.
        let swept = if opts.no_sweep {
            host::SweepReport::default()
        } else {
            host::sweep(&namespace)?
        };
        let left = host::list_segments(&namespace)?;
        let held = host::memfd_usage(std::process::id(), &namespace)?;
        let leaked_host: u64 = left.iter().map(|s| s.size).sum::<u64>() + held.mapped_bytes;
        // The driver frees a dead process's memory asynchronously: poll a while.
        let leaked_device = match (&cuda, baseline) {
            (Some(_), Some((_, Some(root_before)))) => {
                let pids = pids.lock().expect("pids").clone();
                let start = Instant::now();
                let mut used = tree_device_bytes(&pids).unwrap_or(u64::MAX);
                while used > root_before && start.elapsed() < Duration::from_secs(10) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    used = tree_device_bytes(&pids).unwrap_or(u64::MAX);
                }
                Some((used.saturating_sub(root_before), "device memory of this process tree, per process, vs the root's at start"))
            }
            (Some(_), Some((free_before, None))) => {
                let start = Instant::now();
                let mut free = free_on_devices()?;
                while free < free_before && start.elapsed() < Duration::from_secs(10) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    free = free_on_devices()?;
                }
                Some((free_before.saturating_sub(free) as u64, "device-wide free memory vs baseline: per-process accounting is not readable here, so other processes on the GPU count too"))
            }
            _ => None,
        };

        let fps = summary.frames as f64 / summary.seconds;
        println!();
        println!("== renderer summary ==");
        println!("device            {device}");
        println!(
            "frames            {} at {}x{} in {:.2} s (PNG writing and --verify excluded)",
            summary.frames, opts.width, opts.height, summary.seconds
        );
        // Before the fps line: a reader that takes the number next to the last "fps" gets the
        // whole run's.
        let after = summary.frames.saturating_sub(1);
        let after_seconds = summary.seconds - summary.first_frame_seconds;
        if after > 0 && after_seconds > 0.0 {
            println!(
                "first frame       {:.2} ms (one-time work: links, opens, first launches); the {after} after it: {:.1} fps",
                summary.first_frame_seconds * 1e3,
                after as f64 / after_seconds
            );
        }
        println!("fps               {fps:.1}");
        println!("handoffs/s        {:.0} ({} tiles composed, {} missing)", summary.tiles_composed as f64 / summary.seconds, summary.tiles_composed, summary.tiles_missing);
        println!(
            "leases            {} ({:.2} per frame: one per worker's tile sheet)",
            summary.leases,
            summary.leases as f64 / summary.frames.max(1) as f64
        );
        println!("restarts          {restarts}");
        let later = summary.frames.saturating_sub(1).max(1);
        println!(
            "import cache      {} opens in the first frame, {} after ({:.2} per frame), {} hits",
            summary.opens_first_frame,
            summary.opens_after,
            summary.opens_after as f64 / later as f64,
            summary.cache_hits
        );
        match leaked_device {
            Some((d, how)) => println!("leaked bytes      {} ({d} device: {how}; {leaked_host} host memory)", d + leaked_host),
            None => println!(
                "leaked bytes      {leaked_host} ({} host memory: {} segments left, {} memfd bytes still mapped here; the supervisor swept {} segments ({} bytes) of killed children, the final sweep {})",
                host_flavor.name(),
                left.len(),
                held.mapped_bytes,
                swept_during.0,
                swept_during.1,
                swept.removed.len()
            ),
        }
        println!(
            "dead tiles mapped {} bytes (memfds the compositor maps that neither it nor a live worker holds: a killed worker's tiles it kept)",
            dead_mapped
        );
        if let Some(v) = &summary.verify {
            println!("verify            {v}");
        }
        println!("pngs              {}", opts.out.display());
        for p in &summary.pngs {
            println!("                  {p}");
        }
        let leaked = leaked_host + leaked_device.map_or(0, |(d, _)| d);
        if leaked > 0 && !opts.no_sweep {
            return Err(format!("{leaked} bytes leaked").into());
        }
        Ok::<_, Box<dyn Error>>(())
    })
}

#[derive(Message)]
#[rtype(result = "()")]
struct SetSupervisor(Addr<ProcessSupervisor>);

impl Handler<SetSupervisor> for Root {
    type Result = ();
    fn handle(&mut self, m: SetSupervisor, _: &mut Context<Self>) {
        self.supervisor = Some(m.0);
    }
}

#[derive(Message)]
#[rtype(result = "(u64, (usize, u64))")]
struct Restarts;

impl Handler<Restarts> for Root {
    type Result = MessageResult<Restarts>;
    fn handle(&mut self, _: Restarts, _: &mut Context<Self>) -> Self::Result {
        MessageResult((self.restarts, self.swept))
    }
}

fn main() {
    use std::io::IsTerminal;
    // Colours only for a person at a terminal: a redirected log is plain text.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let opts = Options::from_args();
    let role = opts.role.clone();
    // A child's entry point: take the session token from the pipe the supervisor passed
    // (and close it) before anything else.
    let child_session = || Session::from_env().map_err(|e| -> Box<dyn Error> { e.into() });
    let sockets = opts.sockets.clone().ok_or("--sockets");
    let result = match role.as_str() {
        "compositor" => (|| compositor(child_session()?, opts, sockets?))(),
        "worker" => (|| {
            let session = child_session()?;
            let index = opts.index.ok_or("--index")?;
            worker(session, opts, index, sockets?)
        })(),
        _ => root(opts),
    };
    if let Err(e) = result {
        eprintln!("renderer ({role}): {e}");
        std::process::exit(1);
    }
}
