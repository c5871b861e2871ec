//! The importer of the GPU ordering tests (`tests/ordering_cuda.rs`): connects to the
//! socket given as its first argument and answers `Round`, `Check`, `Count` and `Touch`
//! (`tests/support/ordering_msgs.rs`) on a CUDA node (`BATON_BACKEND=cuda`), with kernels
//! launched on a stream of its own. Exits when the link to the test goes down.

#[path = "../../../tests/support/ordering_msgs.rs"]
mod msgs;

use actix::prelude::*;
use baton::actors::{Node, PeerEvent};
use baton::ipc::cuda::DeviceArg;
use baton::ipc::cuda::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use baton::ipc::cuda::cudarc::nvrtc::compile_ptx;
use msgs::{Check, Count, KERNELS, LATE_WRITE_CYCLES, Round, Touch};
use std::sync::Arc;

struct Importer {
    node: Node,
    stream: Arc<CudaStream>,
    spin_then_write: CudaFunction,
}

impl Actor for Importer {
    type Context = Context<Self>;
}

impl Handler<PeerEvent> for Importer {
    type Result = ();
    fn handle(&mut self, e: PeerEvent, _: &mut Context<Self>) {
        if let PeerEvent::Down { .. } = e {
            System::current().stop();
        }
    }
}

impl Handler<Round> for Importer {
    type Result = u32;

    fn handle(&mut self, msg: Round, _: &mut Context<Self>) -> u32 {
        let mut lease = msg.buf.open().expect("a received buffer");
        // The previous round's kernel has finished: what we read is what came after it.
        self.stream.synchronize().expect("synchronise");
        let mut seen = [0u32];
        lease.read_into(0, &mut seen).expect("read");
        let value = 2 * msg.round + 1;
        // Odd rounds name the stream first: the lease's release fence is then written on
        // it when the lease drops, with no mark. Even rounds leave it to cudarc's marks.
        if msg.round % 2 == 1 {
            lease
                .wait_on(&self.stream)
                .expect("wait on the acquire fence");
        }
        // SAFETY: `spin_then_write(unsigned int*, unsigned int, long long)`; it writes one
        // element of the (writable) lease, which is at least one element long.
        unsafe {
            self.stream
                .launch_builder(&self.spin_then_write)
                .arg(&DeviceArg::write(&mut lease, &self.stream))
                .arg(&value)
                .arg(&LATE_WRITE_CYCLES)
                .launch(LaunchConfig::for_num_elems(1))
        }
        .expect("launch");
        // At once, while the kernel runs: the release fence follows it.
        drop(lease);
        seen[0]
    }
}

impl Handler<Check> for Importer {
    type Result = u64;

    fn handle(&mut self, msg: Check, _: &mut Context<Self>) -> u64 {
        let lease = msg.buf.open().expect("a received buffer");
        let mut copy = self.stream.alloc_zeros::<u32>(lease.len()).expect("alloc");
        // The copy's first use of the lease on this stream waits on the exporter's fence.
        self.stream.memcpy_dtod(&lease, &mut copy).expect("copy");
        drop(lease);
        let host = self.stream.clone_dtoh(&copy).expect("copy back");
        host.iter().filter(|&&v| v != msg.expect).count() as u64
    }
}

impl Handler<Count> for Importer {
    type Result = MessageResult<Count>;

    fn handle(&mut self, msg: Count, _: &mut Context<Self>) -> Self::Result {
        drop(msg.buf.open().expect("a received buffer"));
        let descriptors = self
            .node
            .peers()
            .iter()
            .map(|p| p.descriptors_received())
            .sum();
        let opens = self.node.backend().cuda().map_or(0, |c| c.opens());
        MessageResult((descriptors, opens))
    }
}

impl Handler<Touch> for Importer {
    type Result = bool;

    fn handle(&mut self, msg: Touch, _: &mut Context<Self>) -> bool {
        let lease = msg.buf.open().expect("a received buffer");
        lease
            .wait_on(&self.stream)
            .expect("wait on the acquire fence");
        // Dropped at once: the release fence follows the stream's wait.
        drop(lease);
        true
    }
}

/// The command line.
#[derive(Debug, clap::Parser)]
#[command(
    name = "baton-ordering-peer",
    about = "The importer of the CUDA ordering tests (tests/ordering_cuda.rs): connects to SOCKET and answers Round, Check, Count and Touch calls on a stream of its own. Needs BATON_BACKEND=cuda; the session token comes through the pipe named in BATON_TOKEN_FD."
)]
struct Cli {
    /// The test's socket.
    socket: String,
}

fn main() {
    let socket = <Cli as clap::Parser>::parse().socket;
    // The child's entry point: take the token (and close its pipe) before anything else.
    if let Err(e) = baton::Session::from_env() {
        eprintln!("baton-ordering-peer: {e}");
        std::process::exit(1);
    }
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .init();
    }
    let system = System::new();
    let result = system.block_on(async move {
        let node = Node::from_env()?;
        let cuda = node
            .backend()
            .cuda()
            .ok_or("baton-ordering-peer needs BATON_BACKEND=cuda")?;
        let ptx = compile_ptx(KERNELS)?;
        let module = cuda.context().load_module(ptx)?;
        let actor = Importer {
            node: node.clone(),
            stream: cuda.context().new_stream()?,
            spin_then_write: module.load_function("spin_then_write")?,
        }
        .start();
        node.register::<Round>("round", actor.clone().recipient());
        node.register::<Check>("check", actor.clone().recipient());
        node.register::<Count>("count", actor.clone().recipient());
        node.register::<Touch>("touch", actor.clone().recipient());
        node.subscribe(actor.recipient());
        node.connect(&socket).await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    });
    if let Err(e) = result {
        eprintln!("baton-ordering-peer: {e}");
        std::process::exit(1);
    }
    if let Err(e) = system.run() {
        eprintln!("baton-ordering-peer: {e}");
        std::process::exit(1);
    }
}
