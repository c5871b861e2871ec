//! The helper process of Baton's actor tests.
//!
//! `baton-actor-peer serve [SOCKET] [cooperative|stubborn] [linger]`: starts a node
//! (session from the token pipe its parent passed, `BATON_TOKEN_FD`, taken at the top of
//! `main`; host memory in the flavor `BATON_HOST` picks, segments in
//! `BATON_SHM_NAMESPACE`), connects to SOCKET (or to `BATON_CONNECT`, as a supervised
//! child), registers the test actors, and runs until the link to its parent goes down. A
//! `cooperative` holder gives revoked leases back; a `stubborn` one keeps them. With
//! `linger`, when the link goes down it reports on stdout what its held leases read —
//! through the lease (`api=orphaned` once the exporter is gone) and through the raw mapping
//! (`raw=<sum of the u32s>`) — and keeps running (holding them) until killed. Its CUDA
//! device is `BATON_CUDA_DEVICE`'s (0 by default).

#[path = "../../../tests/support/msgs.rs"]
mod msgs;

use actix::prelude::*;
use baton::actors::{
    Allocate, AnyLease, Buffer, BufferOwner, Lease, LeaseTable, Node, PeerEvent, Revoke,
    RevokeRequested, supervisor,
};
use baton::messages::LeaseId;
use msgs::*;
use std::collections::HashMap;

struct TestActor {
    node: Node,
    owner: Addr<BufferOwner>,
    held: HashMap<LeaseId, Lease<u32>>,
    /// Where each held lease is mapped and its length in `u32`s, taken while the link was
    /// up.
    raw: HashMap<LeaseId, (baton::ipc::MemPtr, usize)>,
    lent: HashMap<u32, Buffer<u32>>,
    cooperative: bool,
    linger: bool,
}

impl TestActor {
    /// The CUDA device ordinal of this process's backend (0 on host memory).
    fn ordinal(&self) -> usize {
        self.node.backend().cuda().map_or(0, |c| c.ordinal())
    }

    /// What each held lease reads, one line per lease, on stdout.
    fn report(&self) {
        let mut ids: Vec<&LeaseId> = self.held.keys().collect();
        ids.sort();
        for id in ids {
            let lease = &self.held[id];
            let api = match lease.to_vec() {
                Ok(_) => "readable",
                Err(baton::actors::ActorError::Orphaned { .. }) => "orphaned",
                Err(_) => "error",
            };
            let raw = self
                .raw
                .get(id)
                .map_or(0u64, |&(ptr, len)| raw_sum(ptr, len, self.ordinal()));
            println!("held {} api={api} raw={raw}", id.get());
        }
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
}

/// The sum of the `len` u32s a held lease maps at `ptr`, read past the lease's API (which
/// says orphaned once the exporter is gone): what the mapping itself shows.
fn raw_sum(ptr: baton::ipc::MemPtr, len: usize, ordinal: usize) -> u64 {
    match ptr {
        baton::ipc::MemPtr::Host(addr) => (0..len)
            .map(|i| {
                let word = (addr as *const u32).wrapping_add(i);
                // SAFETY: the lease is alive (held by the caller), so its import-cache view
                // keeps the mapping of `len` u32s at `addr` mapped, and `i < len`; host
                // mappings are page-aligned. The exporter's process may write it: a volatile
                // read of plain integers sees some value, never an invalid one.
                u64::from(unsafe { std::ptr::read_volatile(word) })
            })
            .sum(),
        // Device memory mapped in the context of `ordinal`, the device this binary's
        // backend runs on (`BATON_CUDA_DEVICE`).
        baton::ipc::MemPtr::Device(addr) => {
            let mut bytes = vec![0u8; len * 4];
            // SAFETY: the lease is alive (held by the caller), so the opened handle behind
            // `addr .. addr + len * 4` is not closed.
            match unsafe { baton::ipc::cuda::testing::read_device(ordinal, addr, &mut bytes) } {
                Ok(()) => bytes
                    .chunks_exact(4)
                    .map(|w| u64::from(u32::from_ne_bytes([w[0], w[1], w[2], w[3]])))
                    .sum(),
                Err(e) => {
                    eprintln!("baton-actor-peer: reading the device mapping: {e}");
                    0
                }
            }
        }
    }
}

impl Actor for TestActor {
    type Context = Context<Self>;
}

impl Handler<CheckPair> for TestActor {
    type Result = ResponseFuture<PairChecked>;

    fn handle(&mut self, msg: CheckPair, _ctx: &mut Context<Self>) -> Self::Result {
        let owner = self.owner.clone();
        Box::pin(async move {
            let a = msg
                .a
                .open()
                .expect("a is received")
                .to_vec()
                .expect("read a");
            let b = msg
                .b
                .open()
                .expect("b is received")
                .to_vec()
                .expect("read b");
            let ok = a.len() == b.len()
                && a.iter()
                    .enumerate()
                    .all(|(i, &v)| v == pattern(msg.seed, i))
                && b.iter().enumerate().all(|(i, &v)| v == i as f32 * 0.5);
            let sum: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| x as f32 + y).collect();
            let out = owner
                .send(Allocate::<f32>::vector(sum.len() as u64))
                .await
                .expect("owner alive")
                .expect("allocate");
            out.write_at(0, &sum).expect("write sum");
            // The leases on `a` and `b` are released here, when the guards drop.
            PairChecked {
                ok,
                sum: out.share(),
            }
        })
    }
}

impl Handler<Overwrite> for TestActor {
    type Result = MessageResult<Overwrite>;

    fn handle(&mut self, msg: Overwrite, _ctx: &mut Context<Self>) -> Self::Result {
        let lease = msg.buf.open().expect("a received buffer");
        let wrong = lease
            .to_vec()
            .expect("read the lease")
            .iter()
            .enumerate()
            .filter(|&(i, &v)| v != pattern(msg.expect, i))
            .count() as u64;
        let data: Vec<u32> = (0..lease.len()).map(|i| pattern(msg.write, i)).collect();
        lease.write_at(0, &data).expect("write the lease");
        // The lease goes back here, its release after the write.
        drop(lease);
        let backend = self.node.backend();
        MessageResult(Overwritten {
            wrong,
            ordinal: backend.cuda().map(|c| c.ordinal() as u32),
            device: backend.device(),
        })
    }
}

impl Handler<Hold> for TestActor {
    type Result = usize;

    fn handle(&mut self, msg: Hold, _ctx: &mut Context<Self>) -> usize {
        for shared in msg.buffers {
            let lease = shared.open().expect("received");
            if let Ok(ptr) = lease.ptr() {
                self.raw.insert(lease.id(), (ptr, lease.len()));
            }
            self.held.insert(lease.id(), lease);
        }
        self.held.len()
    }
}

impl Handler<PeekHeld> for TestActor {
    type Result = MessageResult<PeekHeld>;

    fn handle(&mut self, _: PeekHeld, _ctx: &mut Context<Self>) -> Self::Result {
        let mut first = [0u32];
        MessageResult(
            self.held
                .values()
                .map(|l| {
                    l.read_into(0, &mut first)
                        .map(|()| first[0])
                        .unwrap_or(u32::MAX)
                })
                .collect(),
        )
    }
}

impl Handler<DropHeld> for TestActor {
    type Result = usize;

    fn handle(&mut self, _: DropHeld, _ctx: &mut Context<Self>) -> usize {
        let n = self.held.len();
        self.held.clear();
        n
    }
}

impl Handler<UseAndRelease> for TestActor {
    type Result = usize;

    fn handle(&mut self, msg: UseAndRelease, _ctx: &mut Context<Self>) -> usize {
        let leases: Vec<AnyLease> = msg
            .buffers
            .into_iter()
            .map(|shared| {
                let lease = shared.open().expect("received");
                lease
                    .wait_on(baton::ipc::Stream::Internal)
                    .expect("waited on");
                AnyLease::from(lease)
            })
            .collect();
        let n = leases.len();
        if msg.synchronized {
            AnyLease::release_synchronized(leases).expect("synchronised");
        } else {
            drop(leases);
        }
        n
    }
}

impl Handler<MakeBuffers> for TestActor {
    type Result = ResponseFuture<Made>;

    fn handle(&mut self, msg: MakeBuffers, _ctx: &mut Context<Self>) -> Self::Result {
        let owner = self.owner.clone();
        Box::pin(async move {
            let mut buffers = Vec::new();
            for _ in 0..msg.n {
                let buf = owner
                    .send(Allocate::<u32>::vector(msg.len.into()))
                    .await
                    .expect("owner alive")
                    .expect("allocate");
                let data: Vec<u32> = (0..msg.len as usize)
                    .map(|i| pattern(msg.seed, i))
                    .collect();
                buf.write_at(0, &data).expect("write");
                buffers.push(buf.share());
            }
            Made { buffers }
        })
    }
}

impl Handler<MakeBuffersLate> for TestActor {
    type Result = ResponseFuture<Made>;

    fn handle(&mut self, msg: MakeBuffersLate, ctx: &mut Context<Self>) -> Self::Result {
        let me = ctx.address();
        Box::pin(async move {
            actix::clock::sleep(std::time::Duration::from_millis(msg.ms.into())).await;
            me.send(MakeBuffers {
                n: msg.n,
                len: msg.len,
                seed: msg.seed,
            })
            .await
            .expect("the actor is alive")
        })
    }
}

impl Handler<Lend> for TestActor {
    type Result = ResponseFuture<Made>;

    fn handle(&mut self, msg: Lend, ctx: &mut Context<Self>) -> Self::Result {
        if let Some(buf) = self.lent.get(&msg.index) {
            let buffers = vec![buf.share()];
            return Box::pin(async move { Made { buffers } });
        }
        let owner = self.owner.clone();
        let me = ctx.address();
        Box::pin(async move {
            let buf = owner
                .send(Allocate::<u32>::vector(msg.len.into()))
                .await
                .expect("owner alive")
                .expect("allocate");
            let data: Vec<u32> = (0..msg.len as usize)
                .map(|i| pattern(msg.seed, i))
                .collect();
            buf.write_at(0, &data).expect("write");
            let buffers = vec![buf.share()];
            me.do_send(Keep(msg.index, buf));
            Made { buffers }
        })
    }
}

/// Keeps a lent buffer.
#[derive(Message)]
#[rtype(result = "()")]
struct Keep(u32, Buffer<u32>);

impl Handler<Keep> for TestActor {
    type Result = ();

    fn handle(&mut self, msg: Keep, _ctx: &mut Context<Self>) {
        self.lent.entry(msg.0).or_insert(msg.1);
    }
}

impl Handler<Blob> for TestActor {
    type Result = usize;

    fn handle(&mut self, msg: Blob, _ctx: &mut Context<Self>) -> usize {
        msg.data.len()
    }
}

impl Handler<LimitFds> for TestActor {
    type Result = u64;

    fn handle(&mut self, msg: LimitFds, _ctx: &mut Context<Self>) -> u64 {
        use rustix::process::{Resource, getrlimit, setrlimit};
        // The kernel gives a new descriptor the lowest free number, and refuses numbers at
        // or past the limit: a limit at the lowest free number (plus `spare`) leaves exactly
        // `spare` new descriptors. `dup` returns that number.
        let free = {
            use std::os::fd::AsRawFd;
            let probe = rustix::io::dup(std::io::stderr()).expect("dup");
            probe.as_raw_fd() as u64
        };
        let mut limit = getrlimit(Resource::Nofile);
        limit.current = Some(free + msg.spare);
        setrlimit(Resource::Nofile, limit).expect("lowering RLIMIT_NOFILE");
        free + msg.spare
    }
}

impl Handler<Sum> for TestActor {
    type Result = u64;

    fn handle(&mut self, msg: Sum, _ctx: &mut Context<Self>) -> u64 {
        msg.buffers
            .into_iter()
            .map(|s| {
                let lease = s.open().expect("received");
                lease
                    .to_vec()
                    .expect("read")
                    .iter()
                    .map(|&v| u64::from(v))
                    .sum::<u64>()
            })
            .sum()
    }
}

impl Handler<RevokeAll> for TestActor {
    type Result = ResponseFuture<usize>;

    fn handle(&mut self, msg: RevokeAll, _ctx: &mut Context<Self>) -> Self::Result {
        let owner = self.owner.clone();
        Box::pin(async move {
            let within = std::time::Duration::from_millis(msg.within_ms.into());
            let table = owner.send(LeaseTable).await.expect("owner alive");
            let mut asked = 0;
            for buffer in table.iter().filter(|b| !b.leases.is_empty()) {
                asked += owner
                    .send(Revoke {
                        buffer: buffer.buffer,
                        within,
                    })
                    .await
                    .expect("owner alive")
                    .unwrap_or(0);
            }
            asked
        })
    }
}

impl Handler<RevokeRequested> for TestActor {
    type Result = ();

    fn handle(&mut self, msg: RevokeRequested, _ctx: &mut Context<Self>) {
        if self.cooperative {
            self.held.remove(&msg.lease);
        }
    }
}

/// Stops the system when the link to the parent goes down.
impl Handler<PeerEvent> for TestActor {
    type Result = ();

    fn handle(&mut self, msg: PeerEvent, _ctx: &mut Context<Self>) {
        if let PeerEvent::Down {
            reason: Some(reason),
            ..
        } = &msg
        {
            eprintln!("baton-actor-peer: link dropped: {reason}");
        }
        if let PeerEvent::Down { .. } = msg {
            if self.linger {
                self.report();
            } else if self.node.peers().is_empty() {
                System::current().stop();
            }
        }
    }
}

/// The command line: `serve`, then the socket and the holder's manners.
#[derive(Debug, clap::Parser)]
#[command(
    name = "baton-actor-peer",
    about = "The helper process of Baton's actor tests: a node with the test actors, linked to its parent",
    after_help = "Usage as the tests run it: baton-actor-peer serve [SOCKET] [cooperative|stubborn] [linger]. Without SOCKET it connects to BATON_CONNECT (a supervised child). The session token comes through the pipe named in BATON_TOKEN_FD."
)]
struct Cli {
    /// What to do (only `serve`).
    #[arg(value_parser = ["serve"])]
    command: String,
    /// SOCKET, `cooperative` or `stubborn`, `linger`.
    #[arg(value_name = "ARG")]
    args: Vec<String>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    // The child's entry point: take the token (and close its pipe) before anything else,
    // then log as `RUST_LOG` asks; `Node::from_env` below gets the same session.
    baton_test_peers::start("baton-actor-peer");
    let args: Vec<String> = std::iter::once(cli.command).chain(cli.args).collect();
    let socket = args
        .get(1)
        .filter(|a| !matches!(a.as_str(), "cooperative" | "stubborn" | "linger"))
        .cloned()
        .or_else(|| std::env::var(supervisor::CONNECT_ENV).ok())
        .expect("a socket to connect to");
    let cooperative = !args.iter().any(|a| a == "stubborn");
    let linger = args.iter().any(|a| a == "linger");
    // Asked for rings by name (`BATON_LINK_RING`, which `Node::from_env` reads), the
    // links' readers poll them: a system with the rings' park hook. Otherwise a plain
    // system: its links still use rings by default, each frame a doorbell wakeup.
    let system = if std::env::var_os(baton::ipc::link::RING_ENV).is_some() {
        baton::actors::ring_polling_system().expect("a runtime")
    } else {
        System::new()
    };
    let result = system.block_on(async move {
        let node = Node::from_env()?;
        let owner = BufferOwner::new(&node).start();
        let actor = TestActor {
            node: node.clone(),
            owner,
            held: HashMap::new(),
            raw: HashMap::new(),
            lent: HashMap::new(),
            cooperative,
            linger,
        }
        .start();
        node.register::<CheckPair>("checker", actor.clone().recipient());
        node.register::<Overwrite>("overwriter", actor.clone().recipient());
        node.register::<Hold>("holder", actor.clone().recipient());
        node.register::<PeekHeld>("holder.peek", actor.clone().recipient());
        node.register::<DropHeld>("holder.drop", actor.clone().recipient());
        node.register::<UseAndRelease>("holder.use", actor.clone().recipient());
        node.register::<MakeBuffers>("exporter", actor.clone().recipient());
        node.register::<MakeBuffersLate>("late-exporter", actor.clone().recipient());
        node.register::<Sum>("sink", actor.clone().recipient());
        node.register::<Lend>("lender", actor.clone().recipient());
        node.register::<Blob>("blob", actor.clone().recipient());
        node.register::<LimitFds>("fd-limit", actor.clone().recipient());
        node.register::<RevokeAll>("revoker", actor.clone().recipient());
        node.on_revoke(actor.clone().recipient());
        node.subscribe(actor.recipient());
        node.connect(&socket).await?;
        Ok::<_, baton::actors::ActorError>(())
    });
    if let Err(e) = result {
        eprintln!("baton-actor-peer: {e}");
        std::process::exit(1);
    }
    // Run until the parent's link goes down.
    if let Err(e) = system.run() {
        eprintln!("baton-actor-peer: {e}");
        std::process::exit(1);
    }
}
