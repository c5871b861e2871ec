//! The helper process of the GPU liveness tests (`tests/liveness_cuda.rs`): one role per
//! invocation, on a CUDA node (`BATON_BACKEND=cuda`, the export and fence kinds from
//! `BATON_CUDA_EXPORT` and `BATON_CUDA_FENCE`, the fence deadline from
//! `BATON_FENCE_DEADLINE_MS`), with kernels launched on a stream of its own.
//!
//! - `serve SOCKET`: connects to the test and answers `SpinShare` (`spin_share`),
//!   `Scribble` (`scribble`) and `Exit` (`exit`) (`tests/support/liveness_msgs.rs`). Returns
//!   from `main` when told to (`Exit`) or when the link to the test goes down.
//! - `linger SOCKET`: as `serve`, but lives on when the link goes down (a peer the test
//!   cuts while its work still runs), until killed or told to `Exit`.
//! - `holder SOCKET EXIT_FILE`: the holder C of a forwarded lease. Connects to SOCKET (the
//!   relay B's) and takes the buffers forwarded to it from its inbox: for each, queues a
//!   long kernel that copies it on its stream and prints
//!   `got lease=<id> bytes=<n> running=<true|false>`, keeping the lease. When its link goes
//!   down it synchronises its stream and its context, each on a thread of its own under a
//!   deadline, and prints `link-down stream=<how> context=<how>` (`ok(<ms>ms)`,
//!   `timeout(<s>s)` or `error(<why>)`). Once EXIT_FILE exists it drops its leases and
//!   returns from `main`. Prints `ready` once linked.
//! - `exporter RELAY_SOCKET SOCKET`: the exporter A of a forwarded lease. Connects to the
//!   relay B (RELAY_SOCKET) and to the test (SOCKET), and answers `SpinForward`
//!   (`spin_forward`). Returns from `main` when the link to the test goes down.
//! - `forge SOCKET`: a raw link (the protocol spoken by hand, no node, no GPU): keeps the
//!   fence inbox lane the test's node lends it, answers pings and the test's `Keep` call
//!   (with the encoding of `()`), then gives the lease back with a counter fence on its lane
//!   whose value it never writes (the lane's base + 1000, within the node's value step),
//!   and says it no longer maps the allocation. Prints `released value=<v>`, then
//!   `cut` once the node ends the link, then lives on until killed.
//!
//! The session token comes through the pipe named in `BATON_TOKEN_FD`. Exit status 0 when
//! the role ended as it should; 1 with the reason on stderr otherwise.

#[path = "../../../tests/support/liveness_msgs.rs"]
mod msgs;
#[path = "../../../tests/support/relay_msgs.rs"]
mod relay_msgs;

use actix::prelude::*;
use baton::actors::{Buffer, Lease, LeaseMut, Node, Offered, PeerEvent};
use baton::ipc::cuda::DeviceArg;
use baton::ipc::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use baton::ipc::cuda::cudarc::nvrtc::compile_ptx;
use baton::ipc::{Link, LinkConfig, Session};
use baton::messages::protocol::{Payload, Release, Reply, Unmapped};
use baton::messages::{CounterFence, FenceHandle, InboxGrant, Message as Wire};
use msgs::{Exit, KERNELS, Scribble, SpinForward, SpinShare, Spun};
use relay_msgs::ForwardTo;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// How long a synchronisation may take before the holder reports it as hung.
const SYNC_DEADLINE: Duration = Duration::from_secs(30);

/// How far above its lane's base the forger names the value it never writes.
const FORGED_STEP: u64 = 1000;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// A kernel launch over the whole device: every block spins, then fills its share.
fn wide() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (256, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether work queued on `stream` so far is still running.
fn still_running(stream: &CudaStream) -> bool {
    !stream.record_event(None).expect("an event").is_complete()
}

/// The node's CUDA context, a stream of our own and the kernels.
struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    fill: CudaFunction,
    write: CudaFunction,
    copy: CudaFunction,
}

impl Gpu {
    fn of(node: &Node) -> Res<Gpu> {
        let cuda = node
            .backend()
            .cuda()
            .ok_or("baton-liveness-peer needs BATON_BACKEND=cuda")?;
        let ctx = Arc::clone(cuda.context());
        let module = ctx.load_module(compile_ptx(KERNELS)?)?;
        Ok(Gpu {
            stream: ctx.new_stream()?,
            fill: module.load_function("spin_then_fill")?,
            write: module.load_function("spin_then_write")?,
            copy: module.load_function("spin_then_copy")?,
            ctx,
        })
    }

    /// Queues `spin_then_fill` over `buf`.
    fn spin_then_fill(&self, buf: &mut Buffer<u32>, value: u32, cycles: i64) {
        let n = buf.len() as u32;
        // SAFETY: `spin_then_fill(unsigned int*, unsigned int, unsigned int, long long)`;
        // it writes the buffer's `n` elements.
        unsafe {
            self.stream
                .launch_builder(&self.fill)
                .arg(&DeviceArg::write(buf, &self.stream))
                .arg(&n)
                .arg(&value)
                .arg(&cycles)
                .launch(wide())
        }
        .expect("launch spin_then_fill");
    }
}

// ---------------------------------------------------------------------------------------
// serve
// ---------------------------------------------------------------------------------------

struct Server {
    node: Node,
    gpu: Gpu,
    /// Buffers shared by `SpinShare`.
    kept: Vec<Buffer<u32>>,
    /// Leases kept by `Scribble { keep: true }`.
    held: Vec<LeaseMut<u32>>,
    /// Live on when the link goes down (`linger`).
    linger: bool,
}

impl Actor for Server {
    type Context = Context<Self>;
}

impl Handler<PeerEvent> for Server {
    type Result = ();
    fn handle(&mut self, e: PeerEvent, _: &mut Context<Self>) {
        if let PeerEvent::Down { .. } = e
            && !self.linger
        {
            System::current().stop();
        }
    }
}

impl Handler<SpinShare> for Server {
    type Result = MessageResult<SpinShare>;

    fn handle(&mut self, msg: SpinShare, _: &mut Context<Self>) -> Self::Result {
        let mut buf = self
            .node
            .allocate::<u32>(msg.len as usize)
            .expect("allocate");
        self.gpu.spin_then_fill(&mut buf, msg.value, msg.cycles);
        let running = still_running(&self.gpu.stream);
        // The offer's acquire fence follows the kernel.
        let shared = buf.share();
        self.kept.push(buf);
        MessageResult(Spun {
            buf: shared,
            running,
        })
    }
}

impl Handler<Scribble> for Server {
    type Result = bool;

    fn handle(&mut self, msg: Scribble, _: &mut Context<Self>) -> bool {
        let mut lease = msg.buf.open().expect("a received buffer");
        // SAFETY: `spin_then_write(unsigned int*, unsigned int, long long)`; it writes one
        // element of the (writable) lease, which is at least one element long.
        unsafe {
            self.gpu
                .stream
                .launch_builder(&self.gpu.write)
                .arg(&DeviceArg::write(&mut lease, &self.gpu.stream))
                .arg(&msg.value)
                .arg(&msg.cycles)
                .launch(LaunchConfig::for_num_elems(1))
        }
        .expect("launch spin_then_write");
        let running = still_running(&self.gpu.stream);
        if msg.keep {
            self.held.push(lease);
        } else {
            // At once, while the kernel runs: the release fence follows it.
            drop(lease);
        }
        running
    }
}

impl Handler<Exit> for Server {
    type Result = ();

    fn handle(&mut self, msg: Exit, _: &mut Context<Self>) {
        if msg.flush_ms > 0 {
            let within = Duration::from_millis(u64::from(msg.flush_ms));
            if !self.node.flush_fences(within) {
                eprintln!("baton-liveness-peer: fences not all written within {within:?}");
            }
        }
        System::current().stop();
    }
}

async fn serve(socket: String, linger: bool) -> Res<()> {
    let node = Node::from_env()?;
    let server = Server {
        gpu: Gpu::of(&node)?,
        node: node.clone(),
        kept: Vec::new(),
        held: Vec::new(),
        linger,
    }
    .start();
    node.register::<SpinShare>("spin_share", server.clone().recipient());
    node.register::<Scribble>("scribble", server.clone().recipient());
    node.register::<Exit>("exit", server.clone().recipient());
    node.subscribe(server.recipient());
    node.connect(&socket).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// holder
// ---------------------------------------------------------------------------------------

struct Holder {
    gpu: Gpu,
    exit_file: PathBuf,
    kept: Vec<(Lease<u8>, CudaSlice<u8>)>,
}

impl Actor for Holder {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(Duration::from_millis(10), |act, _| {
            if act.exit_file.exists() {
                act.kept.clear();
                System::current().stop();
            }
        });
    }
}

impl Handler<Offered> for Holder {
    type Result = ();

    fn handle(&mut self, msg: Offered, _: &mut Context<Self>) {
        let lease = msg.buffer.open().expect("a forwarded buffer");
        let n = lease.len();
        let stream = &self.gpu.stream;
        let mut copy = stream.alloc_zeros::<u8>(n).expect("alloc");
        let bytes = n as u64;
        let cycles = msgs::SPIN_CYCLES;
        // SAFETY: `spin_then_copy(const unsigned char*, unsigned char*, unsigned long
        // long, long long)`; it reads the lease's `n` bytes and writes as many of `copy`.
        unsafe {
            stream
                .launch_builder(&self.gpu.copy)
                .arg(&DeviceArg::read(&lease, stream))
                .arg(&mut copy)
                .arg(&bytes)
                .arg(&cycles)
                .launch(wide())
        }
        .expect("launch spin_then_copy");
        say(&format!(
            "got lease={} bytes={n} running={}",
            lease.id().get(),
            still_running(stream)
        ));
        self.kept.push((lease, copy));
    }
}

impl Handler<PeerEvent> for Holder {
    type Result = ();
    fn handle(&mut self, e: PeerEvent, _: &mut Context<Self>) {
        if let PeerEvent::Down { .. } = e {
            let stream = Arc::clone(&self.gpu.stream);
            let ctx = Arc::clone(&self.gpu.ctx);
            std::thread::spawn(move || {
                let stream = synchronised(move || stream.synchronize());
                let context = synchronised(move || ctx.synchronize());
                say(&format!("link-down stream={stream} context={context}"));
            });
        }
    }
}

/// Runs `sync` on a thread of its own and says how it went, waiting at most
/// [`SYNC_DEADLINE`] for it.
fn synchronised<E: std::fmt::Debug + Send + 'static>(
    sync: impl FnOnce() -> Result<(), E> + Send + 'static,
) -> String {
    let (done, result) = std::sync::mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        let _ = done.send(sync());
    });
    match result.recv_timeout(SYNC_DEADLINE) {
        Ok(Ok(())) => format!("ok({}ms)", start.elapsed().as_millis()),
        Ok(Err(e)) => format!("error({e:?})"),
        Err(_) => format!("timeout({}s)", SYNC_DEADLINE.as_secs()),
    }
}

async fn holder(socket: String, exit_file: PathBuf) -> Res<()> {
    let node = Node::from_env()?;
    let holder = Holder {
        gpu: Gpu::of(&node)?,
        exit_file,
        kept: Vec::new(),
    }
    .start();
    node.set_inbox(holder.clone().recipient());
    node.subscribe(holder.recipient());
    node.connect(&socket).await?;
    say("ready");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// exporter
// ---------------------------------------------------------------------------------------

struct Exporter {
    node: Node,
    gpu: Gpu,
    kept: Vec<Buffer<u32>>,
}

impl Actor for Exporter {
    type Context = Context<Self>;
}

impl Handler<PeerEvent> for Exporter {
    type Result = ();
    fn handle(&mut self, e: PeerEvent, _: &mut Context<Self>) {
        if let PeerEvent::Down { peer, .. } = e
            && peer.process.pid == std::os::unix::process::parent_id()
        {
            System::current().stop();
        }
    }
}

impl Handler<SpinForward> for Exporter {
    type Result = ResponseActFuture<Self, Result<(Vec<u64>, bool), String>>;

    fn handle(&mut self, msg: SpinForward, _: &mut Context<Self>) -> Self::Result {
        let Some(relay) = self
            .node
            .peers()
            .into_iter()
            .find(|p| p.process().pid == msg.relay_pid)
        else {
            return Box::pin(fut::ready(Err(format!(
                "no link to the relay (pid {})",
                msg.relay_pid
            ))));
        };
        let mut buf = match self.node.allocate::<u32>(msg.len as usize) {
            Ok(b) => b,
            Err(e) => return Box::pin(fut::ready(Err(e.to_string()))),
        };
        self.gpu.spin_then_fill(&mut buf, msg.value, msg.cycles);
        let probe = self.gpu.stream.record_event(None).expect("an event");
        let forwarded = relay.remote::<ForwardTo>("relay").send(ForwardTo {
            buffers: vec![buf.share()],
            to_pid: msg.to_pid,
        });
        self.kept.push(buf);
        Box::pin(
            async move {
                let ids = forwarded.await.map_err(|e| e.to_string())??;
                Ok((ids, !probe.is_complete()))
            }
            .into_actor(self),
        )
    }
}

async fn exporter(relay_socket: String, socket: String) -> Res<()> {
    let node = Node::from_env()?;
    let exporter = Exporter {
        gpu: Gpu::of(&node)?,
        node: node.clone(),
        kept: Vec::new(),
    }
    .start();
    node.register::<SpinForward>("spin_forward", exporter.clone().recipient());
    node.subscribe(exporter.recipient());
    node.connect(&relay_socket).await?;
    node.connect(&socket).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// forge
// ---------------------------------------------------------------------------------------

fn forge(socket: &str) -> Res<()> {
    // Taken at the top of `main` already; this is the same session.
    let session = Session::from_env()?;
    let mut link = Link::connect(socket, &LinkConfig::new(session))?;
    let mut grant: Option<InboxGrant> = None;
    let call = loop {
        let received = link.recv_timeout(SYNC_DEADLINE)?;
        match received.message {
            Wire::FenceInbox(g) => grant = Some(g),
            Wire::Ping(v) => link.send(&Wire::Pong(v), &[])?,
            Wire::Call(call) => break call,
            _ => {}
        }
    };
    let grant = grant.ok_or("the node lent no fence inbox lane (counter fences only)")?;
    let offer = call
        .offers
        .first()
        .ok_or("the call carried no buffer")?
        .clone();
    // `()`: nothing to encode.
    link.send(
        &Wire::Reply(Reply {
            id: call.id,
            outcome: Ok(Payload {
                bytes: Vec::new(),
                offers: Vec::new(),
            }),
        }),
        &[],
    )?;
    let value = grant.base + FORGED_STEP;
    let fence = FenceHandle::Counter(CounterFence {
        slab: grant.slab,
        slab_id: grant.slab_id,
        offset: grant.offset_of(0).ok_or("a lane of no slots")?,
        value,
    });
    link.send(
        &Wire::Release(Release {
            lease: offer.lease,
            fences: vec![fence],
        }),
        &[],
    )?;
    link.send(
        &Wire::Unmapped(Unmapped {
            alloc: offer.handle.alloc,
        }),
        &[],
    )?;
    say(&format!("released value={value}"));
    // Answer pings (a missed heartbeat must not be why we are cut) until the node ends the
    // link.
    while let Ok(received) = link.recv_timeout(Duration::from_secs(3600)) {
        if let Wire::Ping(v) = received.message
            && link.send(&Wire::Pong(v), &[]).is_err()
        {
            break;
        }
    }
    say("cut");
    // A producer that lives on: the test kills it.
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

// ---------------------------------------------------------------------------------------

/// The command line: a role and its arguments.
#[derive(Debug, clap::Parser)]
#[command(
    name = "baton-liveness-peer",
    about = "The helper process of the GPU liveness tests (tests/liveness_cuda.rs): one role per invocation",
    after_help = "Roles: serve SOCKET | linger SOCKET | holder SOCKET EXIT_FILE | exporter RELAY_SOCKET SOCKET | forge SOCKET. Needs BATON_BACKEND=cuda (forge: no GPU); the session token comes through the pipe named in BATON_TOKEN_FD."
)]
struct Cli {
    /// The role.
    #[arg(value_parser = ["serve", "linger", "holder", "exporter", "forge"])]
    role: String,
    /// Its arguments.
    args: Vec<String>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    // The child's entry point: take the token (and close its pipe) before anything else.
    if let Err(e) = Session::from_env() {
        eprintln!("baton-liveness-peer: {e}");
        std::process::exit(1);
    }
    let args: Vec<&str> = cli.args.iter().map(String::as_str).collect();
    if cli.role == "forge" {
        let result = match args.as_slice() {
            [socket] => forge(socket),
            _ => Err("usage: forge SOCKET".into()),
        };
        if let Err(e) = result {
            eprintln!("baton-liveness-peer: {e}");
            std::process::exit(1);
        }
        return;
    }
    let system = System::new();
    let started: Res<()> = system.block_on(async {
        match (cli.role.as_str(), args.as_slice()) {
            ("serve", [socket]) => serve(socket.to_string(), false).await,
            ("linger", [socket]) => serve(socket.to_string(), true).await,
            ("holder", [socket, exit_file]) => holder(socket.to_string(), exit_file.into()).await,
            ("exporter", [relay, socket]) => exporter(relay.to_string(), socket.to_string()).await,
            (role, args) => Err(format!("bad arguments for {role}: {args:?}").into()),
        }
    });
    if let Err(e) = started {
        eprintln!("baton-liveness-peer: {e}");
        std::process::exit(1);
    }
    if let Err(e) = system.run() {
        eprintln!("baton-liveness-peer: {e}");
        std::process::exit(1);
    }
}
