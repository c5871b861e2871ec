//! A Rust service that Python peers talk to: the partner process of the Python package's
//! tests (`python/tests`), and an example of messages that cross languages.
//!
//! Its message types use `Encoding::MessagePack`, so that a Python process (`import
//! baton`) can send them as dicts and read their replies as dicts; their `Shared` fields
//! are buffers both ways.
//!
//! ```text
//! py_partner serve --dir DIR [--token-file FILE]     # listen at DIR/partner.sock
//! py_partner connect SOCKET [--token-file FILE]      # link to a listening Python node
//! ```
//!
//! The session token comes from `--token-file` (64 hex digits), else from the environment
//! a Baton supervisor gives its children (`BATON_TOKEN_FD`, `BATON_TOKEN`). The backend is
//! `BATON_BACKEND`'s (CUDA when present, else host). It prints `ready <socket> <pid>` once
//! it is up, and exits when its standard input closes (so that it never outlives the test
//! that started it) — or when it is killed.
//!
//! Actors (name: wire type):
//! - `checker`: `py.CheckPair { seed, a: Shared<u32>, b: Shared<f32> }` — checks `a` holds
//!   the pattern of `seed`, answers `{ ok, sum: Shared<f32>, doubled: Shared<u32> }` with
//!   `sum[i] = a[i] + b[i]`, `doubled[i] = 2 a[i]`, in buffers of its own;
//! - `lender`: `py.Lend { index, len, seed }` — shares its buffer number `index`
//!   (allocated and filled with the pattern of `seed` on first use), `{ buffer: Shared<u32> }`;
//!   `py.Inspect { index }` (name `inspector`) reads it back: `{ sum, head, leases }`;
//!   `py.Forget { index }` (name `forgetter`) drops the partner's handle of it;
//! - `table`: `py.Table` — the partner's lease table: `{ buffers, leases, holders }`;
//! - `sink`: `py.Sink { data: Shared<f32> }` — sums a buffer a Python process allocated:
//!   `{ sum, len, head }`;
//! - `bundles`: `py.SumBundle { weights: SharedBundle }` — opens a bundle a Python process
//!   allocated and sums each tensor (`f32`/`i64` as numbers, 2-byte types as their raw
//!   `u16` bits): `{ names, sums }`, in layout order;
//! - `bundler`: `py.MakeBundle { tensors, seed }` — a bundle of its own of `tensors` `f32`
//!   tensors (`t0` of shape `[1]`, `t1` of `[2]`, …; `ti` filled with `seed + i`), kept
//!   by the partner: `{ weights: SharedBundle }`;
//! - `caller`: `py.CallBack { pid, target, seed, len }` — calls the Python process `pid`
//!   back at `target` (wire type `py.Scale`) with two buffers `{ seed, a: Shared<u32>, b:
//!   Shared<f32> }`, expects `{ x: Shared<f32>, y: Shared<i64> }` with `x[i] = 2 b[i]` and
//!   `y[i] = a[i] - 1` in the Python process's memory, checks them: `{ ok, detail }`;
//! - `echo`: `py.Types { .. }` — a field of every kind in the type table, decoded and
//!   encoded back.

use actix::prelude::*;
use baton::actors::{
    Allocate, Buffer, BufferOwner, Bundle, Encoding, Node, RemoteMessage, Shared, SharedBundle,
    Stats,
};
use baton::messages::SessionToken;
use baton::{Session, SocketDir};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The value at index `i` of a pattern buffer (as in the Python tests).
fn pattern(seed: u32, i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8
}

macro_rules! msgpack {
    ($t:ty, $name:literal) => {
        impl RemoteMessage for $t {
            const NAME: &'static str = $name;
            const ENCODING: Encoding = Encoding::MessagePack;
        }
    };
}

#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "PairChecked")]
struct CheckPair {
    seed: u32,
    a: Shared<u32>,
    b: Shared<f32>,
}
msgpack!(CheckPair, "py.CheckPair");

#[derive(Debug, Serialize, Deserialize)]
struct PairChecked {
    ok: bool,
    detail: String,
    sum: Option<Shared<f32>>,
    doubled: Option<Shared<u32>>,
}

#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Lent")]
struct Lend {
    index: u32,
    len: u32,
    seed: u32,
}
msgpack!(Lend, "py.Lend");

#[derive(Debug, Serialize, Deserialize)]
struct Lent {
    buffer: Option<Shared<u32>>,
    error: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Inspected")]
struct Inspect {
    index: u32,
}
msgpack!(Inspect, "py.Inspect");

#[derive(Debug, Serialize, Deserialize)]
struct Inspected {
    sum: u64,
    head: Vec<u32>,
    leases: u32,
}

#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "bool")]
struct Forget {
    index: u32,
}
msgpack!(Forget, "py.Forget");

#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "TableReply")]
struct Table;
msgpack!(Table, "py.Table");

#[derive(Debug, Serialize, Deserialize)]
struct TableReply {
    buffers: u32,
    leases: u32,
    /// The pid holding each lease.
    holders: Vec<u32>,
}

#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "SinkReply")]
struct Sink {
    data: Shared<f32>,
}
msgpack!(Sink, "py.Sink");

#[derive(Debug, Serialize, Deserialize)]
struct SinkReply {
    sum: f64,
    len: u64,
    head: Vec<f32>,
}

#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "CallBackDone")]
struct CallBack {
    pid: u32,
    target: String,
    seed: u32,
    len: u32,
}
msgpack!(CallBack, "py.CallBack");

#[derive(Debug, Serialize, Deserialize)]
struct CallBackDone {
    ok: bool,
    detail: String,
}

/// What the partner sends to the Python process.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Scaled")]
struct Scale {
    seed: u32,
    a: Shared<u32>,
    b: Shared<f32>,
}
msgpack!(Scale, "py.Scale");

/// What the Python process answers.
#[derive(Debug, Serialize, Deserialize)]
struct Scaled {
    x: Shared<f32>,
    y: Shared<i64>,
}

/// Every kind of field the MessagePack type table names, echoed back as decoded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[rtype(result = "Types")]
struct Types {
    flag: bool,
    small: u8,
    signed: i32,
    big: u64,
    negative: i64,
    single: f32,
    double: f64,
    text: String,
    #[serde(with = "serde_bytes")]
    bytes: Vec<u8>,
    numbers: Vec<u32>,
    pair: (u16, String),
    maybe: Option<u32>,
    nothing: Option<u32>,
    map: std::collections::BTreeMap<String, i64>,
    kind: Kind,
    shape: Kind,
    point: Point,
    unit: (),
}
msgpack!(Types, "py.Types");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Kind {
    Empty,
    Circle(f64),
    Rect { w: u32, h: u32 },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Point(i32, i32);

/// The partner's actors, in one: its buffer owner and what it lent.
struct Partner {
    node: Node,
    owner: Addr<BufferOwner>,
    lent: HashMap<u32, Buffer<u32>>,
    bundles: Vec<Bundle>,
}

#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "SummedBundle")]
struct SumBundle {
    weights: SharedBundle,
}
msgpack!(SumBundle, "py.SumBundle");

#[derive(Debug, Default, Serialize, Deserialize)]
struct SummedBundle {
    names: Vec<String>,
    sums: Vec<f64>,
    error: Option<String>,
}

impl Handler<SumBundle> for Partner {
    type Result = MessageResult<SumBundle>;

    fn handle(&mut self, msg: SumBundle, _: &mut Context<Self>) -> Self::Result {
        MessageResult(Self::sum_bundle(msg).unwrap_or_else(|e| SummedBundle {
            error: Some(e),
            ..SummedBundle::default()
        }))
    }
}

impl Partner {
    fn sum_bundle(msg: SumBundle) -> Result<SummedBundle, String> {
        use baton::messages::DType;
        let lease = msg.weights.open().map_err(|e| e.to_string())?;
        let (mut names, mut sums) = (Vec::new(), Vec::new());
        for t in lease.layout().tensors() {
            let sum = match t.dtype {
                DType::F32 => lease
                    .read::<f32>(&t.name)
                    .map(|v| v.iter().map(|&x| f64::from(x)).sum()),
                DType::I64 => lease
                    .read::<i64>(&t.name)
                    .map(|v| v.iter().map(|&x| x as f64).sum()),
                d if d.size() == 2 => {
                    // F16, BF16 (no Rust element type here): their raw bits, from the bytes.
                    let (at, len) = (t.offset as usize, t.byte_len().unwrap_or(0) as usize);
                    let mut raw = vec![0u8; len];
                    lease
                        .lease()
                        .read_into(at, &mut raw)
                        .map_err(|e| e.to_string())?;
                    Ok(raw
                        .chunks_exact(2)
                        .map(|b| f64::from(u16::from_le_bytes([b[0], b[1]])))
                        .sum())
                }
                other => return Err(format!("the partner does not sum {other:?}")),
            };
            names.push(t.name.clone());
            sums.push(sum.map_err(|e| e.to_string())?);
        }
        Ok(SummedBundle {
            names,
            sums,
            error: None,
        })
    }
}

#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "MadeBundle")]
struct MakeBundle {
    tensors: u32,
    seed: u32,
}
msgpack!(MakeBundle, "py.MakeBundle");

#[derive(Debug, Serialize, Deserialize)]
struct MadeBundle {
    weights: Option<SharedBundle>,
    error: Option<String>,
}

impl Handler<MakeBundle> for Partner {
    type Result = MessageResult<MakeBundle>;

    fn handle(&mut self, msg: MakeBundle, _: &mut Context<Self>) -> Self::Result {
        MessageResult(match self.make_bundle(msg) {
            Ok(weights) => MadeBundle {
                weights: Some(weights),
                error: None,
            },
            Err(e) => MadeBundle {
                weights: None,
                error: Some(e),
            },
        })
    }
}

impl Partner {
    fn make_bundle(&mut self, msg: MakeBundle) -> Result<SharedBundle, String> {
        use baton::messages::{BundleLayout, DType, Shape};
        let layout = BundleLayout::packed(
            (0..u64::from(msg.tensors))
                .map(|i| (format!("t{i}"), DType::F32, Shape::vector(i + 1))),
        )
        .map_err(|e| e.to_string())?;
        let bundle = self
            .node
            .allocate_bundle(layout)
            .map_err(|e| e.to_string())?;
        for i in 0..msg.tensors {
            let value = (msg.seed + i) as f32;
            bundle
                .write(&format!("t{i}"), &vec![value; i as usize + 1])
                .map_err(|e| e.to_string())?;
        }
        let weights = bundle.share();
        self.bundles.push(bundle);
        Ok(weights)
    }
}

impl Actor for Partner {
    type Context = Context<Self>;
}

async fn pattern_buffer(
    owner: &Addr<BufferOwner>,
    len: usize,
    seed: u32,
) -> Result<Buffer<u32>, Box<dyn Error>> {
    let buf = owner.send(Allocate::<u32>::vector(len as u64)).await??;
    let data: Vec<u32> = (0..len).map(|i| pattern(seed, i)).collect();
    buf.write_at(0, &data)?;
    Ok(buf)
}

impl Handler<CheckPair> for Partner {
    type Result = ResponseFuture<PairChecked>;

    fn handle(&mut self, msg: CheckPair, _: &mut Context<Self>) -> Self::Result {
        let owner = self.owner.clone();
        Box::pin(async move {
            let result = async {
                let a = msg.a.open()?.to_vec()?;
                let b = msg.b.open()?.to_vec()?;
                if a.len() != b.len() {
                    return Ok::<_, Box<dyn Error>>((
                        false,
                        format!("{} vs {} elements", a.len(), b.len()),
                        None,
                        None,
                    ));
                }
                if let Some(i) = (0..a.len()).find(|&i| a[i] != pattern(msg.seed, i)) {
                    return Ok((
                        false,
                        format!("a[{i}] = {}, not {}", a[i], pattern(msg.seed, i)),
                        None,
                        None,
                    ));
                }
                let sum = owner
                    .send(Allocate::<f32>::vector(a.len() as u64))
                    .await??;
                sum.write_at(
                    0,
                    &a.iter()
                        .zip(&b)
                        .map(|(x, y)| *x as f32 + y)
                        .collect::<Vec<_>>(),
                )?;
                let doubled = owner
                    .send(Allocate::<u32>::vector(a.len() as u64))
                    .await??;
                doubled.write_at(0, &a.iter().map(|x| x.wrapping_mul(2)).collect::<Vec<_>>())?;
                Ok((
                    true,
                    format!("{} elements checked", a.len()),
                    Some(sum.share()),
                    Some(doubled.share()),
                ))
            };
            match result.await {
                Ok((ok, detail, sum, doubled)) => PairChecked {
                    ok,
                    detail,
                    sum,
                    doubled,
                },
                Err(e) => PairChecked {
                    ok: false,
                    detail: e.to_string(),
                    sum: None,
                    doubled: None,
                },
            }
        })
    }
}

impl Handler<Lend> for Partner {
    type Result = ResponseActFuture<Self, Lent>;

    fn handle(&mut self, msg: Lend, _: &mut Context<Self>) -> Self::Result {
        let owner = self.owner.clone();
        let existing = self.lent.get(&msg.index).cloned();
        Box::pin(
            async move {
                match existing {
                    Some(buf) => Ok(buf),
                    None => pattern_buffer(&owner, msg.len as usize, msg.seed)
                        .await
                        .map_err(|e| e.to_string()),
                }
            }
            .into_actor(self)
            .map(move |made, act, _| match made {
                Ok(buf) => {
                    let shared = buf.share();
                    act.lent.insert(msg.index, buf);
                    Lent {
                        buffer: Some(shared),
                        error: None,
                    }
                }
                Err(e) => Lent {
                    buffer: None,
                    error: Some(e),
                },
            }),
        )
    }
}

impl Handler<Inspect> for Partner {
    type Result = MessageResult<Inspect>;

    fn handle(&mut self, msg: Inspect, _: &mut Context<Self>) -> Self::Result {
        let Some(buf) = self.lent.get(&msg.index) else {
            return MessageResult(Inspected {
                sum: 0,
                head: Vec::new(),
                leases: 0,
            });
        };
        let data = buf.to_vec().unwrap_or_default();
        MessageResult(Inspected {
            sum: data.iter().map(|&v| u64::from(v)).sum(),
            head: data.iter().take(8).copied().collect(),
            leases: buf.leases_out() as u32,
        })
    }
}

impl Handler<Forget> for Partner {
    type Result = bool;

    fn handle(&mut self, msg: Forget, _: &mut Context<Self>) -> bool {
        self.lent.remove(&msg.index).is_some()
    }
}

impl Handler<Table> for Partner {
    type Result = MessageResult<Table>;

    fn handle(&mut self, _: Table, _: &mut Context<Self>) -> Self::Result {
        let table = self.node.lease_table();
        MessageResult(TableReply {
            buffers: table.len() as u32,
            leases: table.iter().map(|b| b.leases.len() as u32).sum(),
            holders: table
                .iter()
                .flat_map(|b| b.leases.iter().map(|(_, p)| p.pid))
                .collect(),
        })
    }
}

impl Handler<Sink> for Partner {
    type Result = MessageResult<Sink>;

    fn handle(&mut self, msg: Sink, _: &mut Context<Self>) -> Self::Result {
        let data = msg.data.open().and_then(|l| l.to_vec()).unwrap_or_default();
        MessageResult(SinkReply {
            sum: data.iter().map(|&v| f64::from(v)).sum(),
            len: data.len() as u64,
            head: data.iter().take(8).copied().collect(),
        })
    }
}

impl Handler<CallBack> for Partner {
    type Result = ResponseFuture<CallBackDone>;

    fn handle(&mut self, msg: CallBack, _: &mut Context<Self>) -> Self::Result {
        let (node, owner) = (self.node.clone(), self.owner.clone());
        Box::pin(async move {
            let run = async {
                let peer = node
                    .peers()
                    .into_iter()
                    .find(|p| p.process().pid == msg.pid)
                    .ok_or("no link to that pid")?;
                let len = msg.len as usize;
                let a = pattern_buffer(&owner, len, msg.seed).await?;
                let b = owner.send(Allocate::<f32>::vector(len as u64)).await??;
                b.write_at(0, &(0..len).map(|i| i as f32 * 0.25).collect::<Vec<_>>())?;
                let reply = peer
                    .remote::<Scale>(&msg.target)
                    .send_timeout(
                        Scale {
                            seed: msg.seed,
                            a: a.share(),
                            b: b.share(),
                        },
                        Duration::from_secs(30),
                    )
                    .await?;
                let x = reply.x.open()?;
                let y = reply.y.open()?;
                if x.exporter().process.pid != msg.pid || y.exporter().process.pid != msg.pid {
                    return Err("the reply's buffers are not the Python process's".into());
                }
                let (x, y) = (x.to_vec()?, y.to_vec()?);
                if x.len() != len || y.len() != len {
                    return Err(format!("{} and {} elements, not {len}", x.len(), y.len()).into());
                }
                for i in 0..len {
                    let (want_x, want_y) = (i as f32 * 0.5, i64::from(pattern(msg.seed, i)) - 1);
                    if x[i] != want_x || y[i] != want_y {
                        return Err(format!(
                            "element {i}: x = {}, y = {} (want {want_x}, {want_y})",
                            x[i], y[i]
                        )
                        .into());
                    }
                }
                Ok::<_, Box<dyn Error>>(format!("{len} elements checked"))
            };
            match run.await {
                Ok(detail) => CallBackDone { ok: true, detail },
                Err(e) => CallBackDone {
                    ok: false,
                    detail: e.to_string(),
                },
            }
        })
    }
}

impl Handler<Types> for Partner {
    type Result = MessageResult<Types>;

    fn handle(&mut self, msg: Types, _: &mut Context<Self>) -> Self::Result {
        MessageResult(msg)
    }
}

/// A Rust service for Python peers (the partner of the Python package's tests).
#[derive(Debug, clap::Parser)]
#[command(name = "py_partner")]
struct Cli {
    #[command(subcommand)]
    role: Role,
    /// A file holding the session token (64 hex digits); default: the token a Baton
    /// supervisor passed (`BATON_TOKEN_FD`, then `BATON_TOKEN`).
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
}

#[derive(Debug, clap::Subcommand)]
enum Role {
    /// Listen at DIR/partner.sock.
    Serve {
        /// A private directory for the socket (made if missing).
        #[arg(long)]
        dir: PathBuf,
    },
    /// Link to a listening node.
    Connect {
        /// Its socket.
        socket: PathBuf,
    },
}

fn session(token_file: Option<&Path>) -> Result<Session, Box<dyn Error>> {
    match token_file {
        Some(path) => {
            let hex = std::fs::read_to_string(path)?;
            let token =
                SessionToken::from_hex(hex.trim()).ok_or("the token file holds no token")?;
            Ok(Session::new(token))
        }
        None => Ok(Session::from_env()?),
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let cli = <Cli as clap::Parser>::parse();
    let session = session(cli.token_file.as_deref())?;
    // Never outlive the process that started us: exit when our stdin closes.
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    let system = System::new();
    let kept = system.block_on(async move {
        let node = Node::new(session, baton::ipc::select::auto()?);
        let owner = BufferOwner::new(&node).start();
        let partner = Partner {
            node: node.clone(),
            owner: owner.clone(),
            lent: HashMap::new(),
            bundles: Vec::new(),
        }
        .start();
        node.register::<CheckPair>("checker", partner.clone().recipient());
        node.register::<Lend>("lender", partner.clone().recipient());
        node.register::<Inspect>("inspector", partner.clone().recipient());
        node.register::<Forget>("forgetter", partner.clone().recipient());
        node.register::<Table>("table", partner.clone().recipient());
        node.register::<Sink>("sink", partner.clone().recipient());
        node.register::<SumBundle>("bundles", partner.clone().recipient());
        node.register::<MakeBundle>("bundler", partner.clone().recipient());
        node.register::<CallBack>("caller", partner.clone().recipient());
        node.register::<Types>("echo", partner.clone().recipient());
        let socket = match cli.role {
            Role::Serve { dir } => {
                let listening = node.listen(&SocketDir::create(dir)?, "partner.sock")?;
                let path = listening.path().display().to_string();
                (Some(listening), path)
            }
            Role::Connect { socket } => {
                node.connect(&socket).await?;
                (None, socket.display().to_string())
            }
        };
        println!(
            "ready {} {} {}",
            socket.1,
            std::process::id(),
            node.backend().name()
        );
        std::io::stdout().flush()?;
        // Statistics of the owner, so that it stays referenced for the program's life.
        let _ = owner.send(Stats).await;
        Ok::<_, Box<dyn Error>>((socket.0, node, owner, partner))
    })?;
    system.run()?;
    drop(kept);
    Ok(())
}
