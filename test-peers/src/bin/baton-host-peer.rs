//! The helper process of Baton's cross-host tests: a node on another "host" (its own
//! `BATON_HOST_ID`), linked to the test's node over TCP.
//!
//! - `baton-host-peer listen ADDR`: listens for host links at ADDR, prints
//!   `listening <addr>`, accepts one peer (printing `linked`), serves the test actors
//!   until that link goes down, then exits 0. With `--serve N`: N peers, one after the
//!   other, printing after each link's end `down`, `leases <n>` (its node's leases
//!   out) and, on CUDA, `mem <bytes>` (the device's free memory; `mem-start <bytes>`
//!   before the first).
//! - `baton-host-peer connect ADDR`: links to ADDR (printing `linked`), serves until the
//!   link goes down, then exits 0 (with `--stay`: prints `down` and stays until killed).
//! - `baton-host-peer drive ADDR --sizes N,…`: links to ADDR and, per size, sends an
//!   `Echo` of that many pattern bytes (its answer, a buffer of the peer's, checked) and
//!   a `Take` of as many (checked by the peer); prints `ok <size> echo=<s> take=<s>`
//!   per size (the seconds each round took) and `done`, exits 0.
//! - `baton-host-peer drive-kill ADDR --len N --go FILE`: links to ADDR, prints `ready`,
//!   waits for FILE to exist, then sends an `Echo` of N bytes, prints `in-flight` once
//!   its lease is out; the call must fail (the test kills the receiver): prints
//!   `call-failed <error>`, then `lease-back` once the buffer's lease came back and
//!   `leases <n>` (the leases its node still has out); on CUDA, `mem-baseline <bytes>`
//!   before the big buffer and `mem-after <bytes>` once it is dropped (the device's free
//!   memory); with `--then ADDR2`: links to ADDR2 and sends a 1 MiB `Echo` (checked),
//!   printing `after ok`; exits 0.
//! - `baton-host-peer bench ADDR --sizes N,… --reps R`: links to ADDR and, per size,
//!   sends the same buffer R times to the peer's `sink` (which drops it unread), each
//!   time waiting for the answer and the lease's return; prints one JSON line per size
//!   (`{"item":"baton_copy",…}`: median seconds, GB/s), then `done`; exits 0.
//! - `baton-host-peer forge ADDR`: links to ADDR with the blocking `HostLink` client (the
//!   Noise and Baton handshakes, no node), then sends a `Call` to `echo` whose offer is
//!   not a copy but a host segment of this process (a name on *this* host), sealed with
//!   the session's key; prints `cut` once the listener closes the link (`answered <kind>`
//!   for any frame but a ping meanwhile), exits 0. `--forge pull`: sends a `Pull` of a
//!   lease never offered instead; `--forge rendezvous`: an NCCL rendezvous message;
//!   `--forge held`: a `Call` with a TCP copy whose bytes never come, then 63 calls
//!   without buffers (they wait behind it: a node whose `LinkLimits::held_messages` is
//!   lower cuts the link); `--forge release --lease N`: a `Release` of lease N (one granted over another link);
//!   `--forge pull --lease N` names lease N; `--forge device-copy`: the `Call` offers an NCCL copy (device memory) — a host-memory
//!   node refuses it: prints `answered Release`, then `reply <fault>` and exits 0.
//! - `baton-host-peer export SOCKET --len N --seed S`: the exporter A of a forward across
//!   hosts, on the relay's host. Links to the Unix socket SOCKET (printing `linked`),
//!   allocates N bytes of the pattern S and sends them to the relay's `keep` (printing
//!   `kept`; with `--writable`, shared writable to `keep-mut`); its `ledger` answers `LedgerOf` (its node's leases out, whether the buffer
//!   could be written now). Serves until the link goes down, then exits 0.
//! - `baton-host-peer relay DIR --then ADDR --seed S`: the relay B of a forward across
//!   hosts, as a process of its own. Listens on a Unix socket in the socket directory DIR
//!   (made here; printing `relay-at <path>`), keeps the lease an exporter (`export`) sends
//!   to its `keep`, links to ADDR over TCP, forwards the lease there (`forward_to`: a copy
//!   from its mapping), printing `forwarded <lease id>` once the copy landed and `still
//!   <true|false>` (its own lease still reads the pattern S); drops the lease, closes both
//!   links, removes DIR, prints `done`, exits 0.
//! - `listen ADDR --inbox --seed S`: as `listen`, and each buffer that arrives in the
//!   node's inbox is read, checked against the pattern S and dropped: prints
//!   `inbox lease=<id> len=<n> pattern=<true|false>`.
//!
//! Session from the token pipe (`BATON_TOKEN_FD`), taken at the top of `main`; host
//! memory in the flavor `BATON_HOST` picks, or with `--cuda` device memory
//! (`CudaBackend::from_env`: `BATON_CUDA_DEVICE`, `BATON_CUDA_EXPORT`); `--heartbeat-ms D`: a heartbeat deadline of
//! D ms (pings every D/4). Every wait has a deadline.

#[path = "../../../tests/support/host_msgs.rs"]
mod host_msgs;

use actix::prelude::*;
use baton::actors::{Heartbeat, Node, NodeConfig, Peer};
use baton::ipc::HostBackend;
use host_msgs::*;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long any wait of this helper may take.
const DEADLINE: Duration = Duration::from_secs(120);

#[derive(clap::Parser)]
#[command(about = "The helper process of Baton's cross-host tests")]
struct Cli {
    /// listen | connect | drive | drive-kill | bench | forge | export | relay
    role: String,
    /// Where to listen, or to connect to.
    addr: String,
    /// The heartbeat deadline in milliseconds (pings every quarter of it).
    #[arg(long)]
    heartbeat_ms: Option<u64>,
    /// drive: the sizes to send, comma-separated.
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    /// drive-kill: the size of the buffer in flight when the receiver dies.
    #[arg(long, default_value_t = 512 << 20)]
    len: usize,
    /// listen, connect: once the link is down, say `down` and stay (until killed, at most
    /// 10 minutes), so that the test sees what this node freed while it lives.
    #[arg(long)]
    stay: bool,
    /// drive-kill: send once this file exists.
    #[arg(long)]
    go: Option<std::path::PathBuf>,
    /// Device memory (`CudaBackend::from_env`) instead of host memory.
    #[arg(long)]
    cuda: bool,
    /// listen: how many peers to serve, one after the other.
    #[arg(long, default_value_t = 1)]
    serve: usize,
    /// bench: how many copies per size.
    #[arg(long, default_value_t = 9)]
    reps: usize,
    /// forge: what to forge (segment, pull, rendezvous, device-copy, release, held).
    #[arg(long, default_value = "segment")]
    forge: String,
    /// forge pull, forge release: the lease they name.
    #[arg(long, default_value_t = 1)]
    lease: u64,
    /// drive-kill: once the lease is back, link here and send a 1 MiB `Echo`; relay: the
    /// peer to forward to.
    #[arg(long)]
    then: Option<String>,
    /// listen: check and drop what arrives in the node's inbox.
    #[arg(long)]
    inbox: bool,
    /// export: share the buffer writable (to the relay's `keep-mut`).
    #[arg(long)]
    writable: bool,
    /// export, listen --inbox: the pattern's seed.
    #[arg(long, default_value_t = 7)]
    seed: u8,
}

/// Reads what arrives in the inbox, checks it against the pattern `seed`, drops it.
struct Inbox {
    seed: u8,
}

impl Actor for Inbox {
    type Context = Context<Self>;
}

impl Handler<baton::actors::Offered> for Inbox {
    type Result = ();
    fn handle(&mut self, msg: baton::actors::Offered, _: &mut Context<Self>) {
        match msg.buffer.open().and_then(|l| Ok((l.id(), l.to_vec()?))) {
            Ok((id, bytes)) => say(&format!(
                "inbox lease={id} len={} pattern={}",
                bytes.len(),
                is_pattern(self.seed, &bytes)
            )),
            Err(e) => say(&format!("inbox-failed {e:?}")),
        }
    }
}

/// `forge held`: the calls without buffers sent behind the copy that never lands.
const LEASE_HELD_CALLS: u64 = 64;

/// The `export` role (see the module docs).
async fn export(node: &Node, cli: &Cli) -> Result<(), String> {
    // Written before linking: a large pattern takes this (single) thread a while, and a
    // link would go unanswered meanwhile.
    let buffer = node.allocate::<u8>(cli.len).map_err(|e| e.to_string())?;
    buffer
        .write_at(0, &pattern_bytes(cli.seed, cli.len))
        .map_err(|e| e.to_string())?;
    let start = std::time::Instant::now();
    let peer = loop {
        match tokio::time::timeout(DEADLINE, node.connect(&cli.addr)).await {
            Ok(Ok(peer)) => break peer,
            Ok(Err(e)) if start.elapsed() < DEADLINE => {
                eprintln!("baton-host-peer: connect: {e} (retrying)");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(Err(e)) => return Err(format!("{e:?}")),
            Err(_) => return Err("connect timed out".to_owned()),
        }
    };
    say("linked");
    let (data, data_mut) = match cli.writable {
        false => (Some(buffer.share()), None),
        true => (None, Some(buffer.share_mut())),
    };
    let ledger = Ledger {
        node: node.clone(),
        buffer,
        seed: cli.seed,
    };
    node.register::<LedgerOf>("ledger", ledger.start().recipient());
    let kept = match (data, data_mut) {
        (Some(data), _) => {
            peer.remote::<Keep>("keep")
                .send_timeout(Keep { data }, DEADLINE)
                .await
        }
        (_, Some(data)) => {
            peer.remote::<KeepMut>("keep-mut")
                .send_timeout(KeepMut { data }, DEADLINE)
                .await
        }
        _ => unreachable!("one of the two"),
    };
    kept.map_err(|e| format!("the keep call: {e:?}"))??;
    say("kept");
    let _ = tokio::time::timeout(Duration::from_secs(600), peer.closed()).await;
    Ok(())
}

/// The `relay` role (see the module docs).
async fn relay(node: &Node, cli: &Cli) -> Result<(), String> {
    let fail = |e: &dyn std::fmt::Debug| format!("{e:?}");
    let keeper = Keeper::default();
    let kept = Arc::clone(&keeper.kept);
    node.register::<Keep>("keep", keeper.start().recipient());
    let dir = std::path::PathBuf::from(&cli.addr);
    let sockets = baton::SocketDir::create(&dir).map_err(|e| fail(&e))?;
    let result = async {
        let mut listening = node.listen(&sockets, "relay").map_err(|e| fail(&e))?;
        say(&format!("relay-at {}", listening.path().display()));
        let to_a = (listening.accept_timeout(DEADLINE).await).map_err(|e| fail(&e))?;
        let start = std::time::Instant::now();
        let lease = loop {
            if let Some(lease) = kept.lock().unwrap().pop() {
                break lease;
            }
            if start.elapsed() > DEADLINE {
                return Err("the exporter's lease never came".to_owned());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let then = cli.then.as_deref().ok_or("relay needs --then ADDR")?;
        let to_c = connect(node, then).await?;
        let id = tokio::time::timeout(DEADLINE, lease.forward_to(&to_c))
            .await
            .map_err(|e| fail(&e))?
            .map_err(|e| fail(&e))?;
        say(&format!("forwarded {id}"));
        let bytes = lease.to_vec().map_err(|e| fail(&e))?;
        say(&format!("still {}", is_pattern(cli.seed, &bytes)));
        drop(lease);
        for link in [to_c, to_a] {
            tokio::time::timeout(DEADLINE, link.close_and_wait())
                .await
                .map_err(|_| "closing timed out".to_owned())?;
        }
        Ok(())
    }
    .await;
    drop(sockets);
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    say("done");
    Ok(())
}

/// The device's free memory, once the backend holds at most `live` allocations (its
/// frees run on its driver thread: waited for, at most 30 s) and its pool gave back
/// what it keeps (CUDA).
async fn device_free(cuda: Option<&baton::ipc::CudaBackend>, live: usize) -> Option<usize> {
    let cuda = cuda?;
    let start = std::time::Instant::now();
    while cuda.live().exported > live && start.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cuda.synchronize().ok()?;
    cuda.trim_pool(0).ok()?;
    Some(cuda.mem_get_info().ok()?.0)
}

/// Links to `addr`, retried while the listener is busy (rogue clients may hold every
/// handshake slot for a handshake deadline); an error past the deadline is final.
async fn connect(node: &Node, addr: &str) -> Result<Peer, String> {
    let start = std::time::Instant::now();
    loop {
        match tokio::time::timeout(DEADLINE, node.connect_tcp(addr)).await {
            Ok(Ok(peer)) => break Ok(peer),
            Ok(Err(e)) if start.elapsed() < DEADLINE => {
                eprintln!("baton-host-peer: connect_tcp: {e} (retrying)");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok(Err(e)) => break Err(format!("{e:?}")),
            Err(_) => break Err("connect_tcp timed out".to_owned()),
        }
    }
}

/// Answers `push` (to the one linked peer).
struct Pusher {
    node: Node,
    peer: Arc<Mutex<Option<Peer>>>,
}

impl Actor for Pusher {
    type Context = Context<Self>;
}

impl Handler<Push> for Pusher {
    type Result = ResponseFuture<Result<u64, String>>;
    fn handle(&mut self, msg: Push, _: &mut Context<Self>) -> Self::Result {
        let node = self.node.clone();
        let peer = self.peer.lock().unwrap().clone();
        Box::pin(async move {
            let peer = peer.ok_or("not linked")?;
            take_round(&node, &peer, msg.len as usize, msg.seed, DEADLINE).await
        })
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The `forge` role (see the module docs); blocking.
fn forge(addr: &str, session: &baton::Session, what: &str, lease: u64) -> Result<(), String> {
    use baton::ipc::Backend;
    use baton::ipc::tcp::{HostId, HostLink, NodeKey, TcpConfig};
    use baton::messages::protocol::{Call, Offer, Pull, Release, Rendezvous};
    use baton::messages::{CopyEngine, LeaseId, Message, RawHandle};
    let key = NodeKey::generate().map_err(|e| e.to_string())?;
    let config = TcpConfig::new(session.clone(), key).host(HostId::current());
    let mut link = HostLink::connect(addr, &config).map_err(|e| format!("{e:?}"))?;
    say("linked");
    let backend = HostBackend::new().map_err(|e| e.to_string())?;
    let segment = backend.allocate(4096).map_err(|e| e.to_string())?;
    let mut handle = segment.handle(session).build().map_err(|e| e.to_string())?;
    if what == "device-copy" || what == "held" {
        handle.raw = RawHandle::Copy {
            engine: match what {
                "held" => CopyEngine::Tcp,
                _ => CopyEngine::Nccl,
            },
        };
        handle = handle.sealed(session.handle_key());
    }
    let call = Message::Call(Call {
        id: 1,
        target: "echo".into(),
        type_name: <Echo as baton::actors::RemoteMessage>::NAME.into(),
        payload: Vec::new(),
        offers: vec![Offer {
            lease: LeaseId::new(1),
            handle,
        }],
    });
    let frame = match what {
        "segment" | "device-copy" | "held" => call,
        "pull" => Message::Pull(Pull {
            lease: LeaseId::new(lease),
        }),
        "release" => Message::Release(Release::now(LeaseId::new(lease))),
        "rendezvous" => Message::Rendezvous(Rendezvous {
            bytes: vec![0; 149],
        }),
        other => return Err(format!("cannot forge {other}")),
    };
    link.send(&frame, &[]).map_err(|e| format!("{e:?}"))?;
    if what == "held" {
        // Its bytes never come: calls without buffers pile up behind it.
        for id in 2..=LEASE_HELD_CALLS {
            let plain = Message::Call(Call {
                id,
                target: "echo".into(),
                type_name: <Echo as baton::actors::RemoteMessage>::NAME.into(),
                payload: Vec::new(),
                offers: Vec::new(),
            });
            if link.send(&plain, &[]).is_err() {
                break;
            }
        }
    }
    let start = std::time::Instant::now();
    while start.elapsed() < DEADLINE {
        match link.recv_timeout(DEADLINE) {
            Ok(r) if matches!(r.message, Message::Ping(_)) => {}
            Ok(r) if what == "device-copy" && matches!(r.message, Message::Reply(_)) => {
                let Message::Reply(reply) = r.message else {
                    unreachable!()
                };
                say(&format!("reply {:?}", reply.outcome.err()));
                return Ok(());
            }
            Ok(r) => say(&format!("answered {}", r.message.kind())),
            Err(baton::ipc::Error::Closed) => {
                say("cut");
                return Ok(());
            }
            Err(e) => return Err(format!("{e:?}")),
        }
    }
    Err("the forged offer did not cut the link".into())
}

async fn run(cli: Cli, session: baton::Session) -> Result<(), String> {
    let mut config = NodeConfig::new(session);
    if let Some(ms) = cli.heartbeat_ms {
        config = config.heartbeat(Heartbeat {
            interval: Duration::from_millis(ms / 4),
            deadline: Duration::from_millis(ms),
        });
    }
    let cuda = match cli.cuda {
        true => Some(Arc::new(
            baton::ipc::CudaBackend::from_env().map_err(|e| e.to_string())?,
        )),
        false => None,
    };
    let node = match &cuda {
        Some(cuda) => Node::with_config(config, cuda.clone()),
        None => Node::with_config(
            config,
            Arc::new(HostBackend::new().map_err(|e| e.to_string())?),
        ),
    };
    let live = || cuda.as_deref().map_or(0, |c| c.live().exported);
    let linked = Arc::new(Mutex::new(None));
    serve_echo_and_take(&node);
    node.register::<Sink>("sink", Sinker.start().recipient());
    let pusher = Pusher {
        node: node.clone(),
        peer: Arc::clone(&linked),
    };
    node.register::<Push>("push", pusher.start().recipient());
    if cli.inbox {
        node.set_inbox(Inbox { seed: cli.seed }.start().recipient());
    }
    if cli.role == "export" {
        return export(&node, &cli).await;
    }
    if cli.role == "relay" {
        return relay(&node, &cli).await;
    }
    let timeout = |e| format!("{e:?}");
    if cli.role == "listen" && cli.serve > 1 {
        let mut listening = node.listen_tcp(&*cli.addr).map_err(timeout)?;
        say(&format!("listening {}", listening.local_addr()));
        let start_live = live();
        if let Some(bytes) = device_free(cuda.as_deref(), start_live).await {
            say(&format!("mem-start {bytes}"));
        }
        for _ in 0..cli.serve {
            let peer = listening.accept_timeout(DEADLINE).await.map_err(timeout)?;
            *linked.lock().unwrap() = Some(peer.clone());
            say("linked");
            let _ = tokio::time::timeout(Duration::from_secs(600), peer.closed()).await;
            say("down");
            let start = std::time::Instant::now();
            while node.status(0).leases > 0 && start.elapsed() < DEADLINE {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            say(&format!("leases {}", node.status(0).leases));
            if let Some(bytes) = device_free(cuda.as_deref(), start_live).await {
                say(&format!("mem {bytes}"));
            }
        }
        return Ok(());
    }
    let peer = match cli.role.as_str() {
        "listen" => {
            let mut listening = node.listen_tcp(&*cli.addr).map_err(timeout)?;
            say(&format!("listening {}", listening.local_addr()));
            listening.accept_timeout(DEADLINE).await.map_err(timeout)?
        }
        _ => connect(&node, &cli.addr).await?,
    };
    *linked.lock().unwrap() = Some(peer.clone());
    say("linked");
    match cli.role.as_str() {
        "listen" | "connect" => {
            let _ = tokio::time::timeout(Duration::from_secs(600), peer.closed()).await;
            if cli.stay {
                say("down");
                tokio::time::sleep(Duration::from_secs(600)).await;
            }
            Ok(())
        }
        "drive" => {
            for (i, &len) in cli.sizes.iter().enumerate() {
                let seed = i as u8 + 1;
                let start = std::time::Instant::now();
                echo_round(&node, &peer, len, seed, DEADLINE).await?;
                let echo = start.elapsed().as_secs_f64();
                // And a buffer of ours for the peer's `take` to check.
                let start = std::time::Instant::now();
                let took = take_round(&node, &peer, len, seed.wrapping_add(100), DEADLINE).await?;
                let take = start.elapsed().as_secs_f64();
                if took != len as u64 {
                    return Err(format!("take of {len} bytes: took {took}"));
                }
                say(&format!("ok {len} echo={echo:.6} take={take:.6}"));
            }
            say("done");
            tokio::time::timeout(DEADLINE, peer.close_and_wait())
                .await
                .map_err(|_| "closing timed out".to_owned())?;
            Ok(())
        }
        "bench" => {
            for &len in &cli.sizes {
                let buf = node.allocate::<u8>(len).map_err(|e| e.to_string())?;
                buf.write_at(0, &pattern_bytes(5, len))
                    .map_err(|e| e.to_string())?;
                let mut secs = Vec::with_capacity(cli.reps);
                // One unmeasured round first: the communicators, the allocator.
                for rep in 0..=cli.reps {
                    let start = std::time::Instant::now();
                    let got = peer
                        .remote::<Sink>("sink")
                        .send_timeout(Sink { data: buf.share() }, DEADLINE)
                        .await
                        .map_err(timeout)??;
                    buf.returned_within(DEADLINE).await.map_err(timeout)?;
                    if got != len as u64 {
                        return Err(format!("sink of {len} bytes answered {got}"));
                    }
                    if rep > 0 {
                        secs.push(start.elapsed().as_secs_f64());
                    }
                }
                secs.sort_by(f64::total_cmp);
                let median = secs[secs.len() / 2];
                say(&format!(
                    "{{\"item\":\"baton_copy\",\"bytes\":{len},\"reps\":{},\"median_s\":{median:.6},\"gbps\":{:.3},\"memory\":\"{}\"}}",
                    cli.reps,
                    len as f64 / median / 1e9,
                    if cli.cuda { "device" } else { "host" }
                ));
            }
            say("done");
            tokio::time::timeout(DEADLINE, peer.close_and_wait())
                .await
                .map_err(|_| "closing timed out".to_owned())?;
            Ok(())
        }
        "drive-kill" => {
            let buf = node.allocate::<u8>(4096).map_err(|e| e.to_string())?;
            buf.write_at(0, &pattern_bytes(1, 4096))
                .map_err(|e| e.to_string())?;
            // A first copy opens the engine's data connection.
            let warm = peer
                .remote::<Echo>("echo")
                .send_timeout(
                    Echo {
                        seed: 1,
                        data: buf.share(),
                    },
                    DEADLINE,
                )
                .await
                .map_err(timeout)??;
            drop(warm);
            say("ready");
            let go = cli.go.ok_or("drive-kill needs --go FILE")?;
            let start = std::time::Instant::now();
            while !go.exists() {
                if start.elapsed() > DEADLINE {
                    return Err(format!("no {} within {DEADLINE:?}", go.display()));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let before = live();
            if let Some(bytes) = device_free(cuda.as_deref(), before).await {
                say(&format!("mem-baseline {bytes}"));
            }
            let big = node.allocate::<u8>(cli.len).map_err(|e| e.to_string())?;
            let call = actix::spawn(peer.remote::<Echo>("echo").send_timeout(
                Echo {
                    seed: 0,
                    data: big.share(),
                },
                DEADLINE,
            ));
            while node.status(0).leases == 0 {
                if start.elapsed() > DEADLINE {
                    return Err("the copy's lease was never granted".into());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            say("in-flight");
            match call.await.map_err(|e| e.to_string())? {
                Ok(_) => return Err("the call to a killed receiver succeeded".into()),
                Err(e) => say(&format!("call-failed {e:?}")),
            }
            big.returned_within(DEADLINE).await.map_err(timeout)?;
            say("lease-back");
            big.write_at(0, &[1, 2, 3]).map_err(|e| e.to_string())?;
            let leases = node.status(0).leases;
            say(&format!("leases {leases}"));
            drop(big);
            if let Some(bytes) = device_free(cuda.as_deref(), before).await {
                say(&format!("mem-after {bytes}"));
            }
            if let Some(then) = &cli.then {
                let next = connect(&node, then).await?;
                echo_round(&node, &next, 1 << 20, 9, DEADLINE).await?;
                say("after ok");
                tokio::time::timeout(DEADLINE, next.close_and_wait())
                    .await
                    .map_err(|_| "closing timed out".to_owned())?;
            }
            Ok(())
        }
        other => Err(format!("unknown role {other}")),
    }
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    // The child's entry point: the token first (its pipe closed), then logging.
    let session = baton_test_peers::start("baton-host-peer");
    let result = match cli.role.as_str() {
        "forge" => forge(&cli.addr, &session, &cli.forge, cli.lease),
        _ => System::new().block_on(run(cli, session)),
    };
    if let Err(e) = result {
        // On stdout too: the tests read it.
        say(&format!("failed {e}"));
        eprintln!("baton-host-peer: {e}");
        std::process::exit(2);
    }
}
