//! Message types shared by the cross-host tests and their helper process
//! (`test-peers/src/bin/baton-host-peer.rs` includes this file too).

#![allow(dead_code)]

use actix::Message;
use baton::actors::{RemoteMessage, Shared};
use serde::{Deserialize, Serialize};

/// The byte at index `i` of the pattern `seed` (seed 0: zeros).
pub fn pattern(seed: u8, i: usize) -> u8 {
    if seed == 0 {
        return 0;
    }
    (i as u64)
        .wrapping_mul(0x9E37_79B1)
        .wrapping_add(i as u64 >> 13)
        .wrapping_add(u64::from(seed)) as u8
}

/// `len` bytes of the pattern `seed`.
pub fn pattern_bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| pattern(seed, i)).collect()
}

/// Whether `bytes` are the pattern `seed`.
pub fn is_pattern(seed: u8, bytes: &[u8]) -> bool {
    bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b == pattern(seed, i))
}

/// Checks a buffer of the pattern `seed`; answers with a buffer of its own: each byte
/// plus one.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<Echoed, String>")]
pub struct Echo {
    pub seed: u8,
    pub data: Shared<u8>,
}

impl RemoteMessage for Echo {
    const NAME: &'static str = "tests.cross_host.Echo";
}

/// What [`Echo`] answers: whether the bytes were the pattern, and the bytes plus one.
#[derive(Debug, Serialize, Deserialize)]
pub struct Echoed {
    pub len: u64,
    pub pattern_ok: bool,
    pub plus_one: Shared<u8>,
}

/// Asks the helper to send a buffer of `len` bytes of the pattern `seed` back to the
/// caller's `take` actor (a call of its own over the same link); answers what `take`
/// answered.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct Push {
    pub len: u64,
    pub seed: u8,
}

impl RemoteMessage for Push {
    const NAME: &'static str = "tests.cross_host.Push";
}

/// A buffer of the pattern `seed`: the taker checks it and answers its length.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct Take {
    pub seed: u8,
    pub data: Shared<u8>,
}

impl RemoteMessage for Take {
    const NAME: &'static str = "tests.cross_host.Take";
}

/// A buffer to land and drop unread: the receiver answers its length (the benchmark's
/// message: what a copy across hosts costs, and nothing else).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct Sink {
    pub data: Shared<u8>,
}

impl RemoteMessage for Sink {
    const NAME: &'static str = "tests.cross_host.Sink";
}

/// Answers [`Sink`].
pub struct Sinker;

impl actix::Actor for Sinker {
    type Context = actix::Context<Self>;
}

impl actix::Handler<Sink> for Sinker {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: Sink, _: &mut actix::Context<Self>) -> Self::Result {
        let lease = msg.data.open().map_err(|e| e.to_string())?;
        Ok(lease.len() as u64)
    }
}

/// Answers [`Echo`]: checks the pattern, answers the bytes plus one in a buffer of its
/// node.
pub struct Echoer {
    pub node: baton::actors::Node,
}

impl actix::Actor for Echoer {
    type Context = actix::Context<Self>;
}

impl actix::Handler<Echo> for Echoer {
    type Result = Result<Echoed, String>;
    fn handle(&mut self, msg: Echo, _: &mut actix::Context<Self>) -> Self::Result {
        let bytes = msg
            .data
            .open()
            .and_then(|l| l.to_vec())
            .map_err(|e| e.to_string())?;
        let out = self
            .node
            .allocate::<u8>(bytes.len())
            .map_err(|e| e.to_string())?;
        let plus: Vec<u8> = bytes.iter().map(|b| b.wrapping_add(1)).collect();
        out.write_at(0, &plus).map_err(|e| e.to_string())?;
        Ok(Echoed {
            len: bytes.len() as u64,
            pattern_ok: is_pattern(msg.seed, &bytes),
            plus_one: out.share(),
        })
    }
}

/// Answers [`Take`]: checks the pattern; counts what it took.
pub struct Taker {
    pub taken: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl actix::Actor for Taker {
    type Context = actix::Context<Self>;
}

impl actix::Handler<Take> for Taker {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: Take, _: &mut actix::Context<Self>) -> Self::Result {
        self.taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let bytes = msg
            .data
            .open()
            .and_then(|l| l.to_vec())
            .map_err(|e| e.to_string())?;
        if is_pattern(msg.seed, &bytes) {
            Ok(bytes.len() as u64)
        } else {
            Err(format!(
                "{} bytes, not the pattern {}",
                bytes.len(),
                msg.seed
            ))
        }
    }
}

/// Registers `echo` and `take` on `node`; returns how many buffers `take` took.
pub fn serve_echo_and_take(
    node: &baton::actors::Node,
) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    use actix::Actor;
    let taken = std::sync::Arc::default();
    node.register::<Echo>("echo", Echoer { node: node.clone() }.start().recipient());
    let taker = Taker {
        taken: std::sync::Arc::clone(&taken),
    };
    node.register::<Take>("take", taker.start().recipient());
    taken
}

/// Sends `len` bytes of the pattern `seed` to `to`'s `echo` and checks the answer: the
/// pattern arrived, and its bytes plus one came back in a buffer of the peer's; then
/// waits for our buffer's lease to come back (the copy landed). Every wait within
/// `deadline`.
pub async fn echo_round(
    node: &baton::actors::Node,
    to: &baton::actors::Peer,
    len: usize,
    seed: u8,
    deadline: std::time::Duration,
) -> Result<(), String> {
    let buf = node.allocate::<u8>(len).map_err(|e| e.to_string())?;
    let data = pattern_bytes(seed, len);
    buf.write_at(0, &data).map_err(|e| e.to_string())?;
    let msg = Echo {
        seed,
        data: buf.share(),
    };
    let echoed = to
        .remote::<Echo>("echo")
        .send_timeout(msg, deadline)
        .await
        .map_err(|e| format!("the echo call: {e:?}"))??;
    let back = echoed
        .plus_one
        .open()
        .and_then(|l| l.to_vec())
        .map_err(|e| e.to_string())?;
    let whole = echoed.pattern_ok
        && echoed.len == len as u64
        && back.len() == len
        && back.iter().zip(&data).all(|(b, d)| *b == d.wrapping_add(1));
    if !whole {
        return Err(format!("an echo of {len} bytes came back wrong"));
    }
    buf.returned_within(deadline)
        .await
        .map_err(|e| format!("the lease of {len} bytes: {e:?}"))
}

/// Sends `len` bytes of the pattern `seed` (0: zeros, not written) to `to`'s `take`;
/// answers what it took, once our buffer's lease came back. Every wait within `deadline`.
pub async fn take_round(
    node: &baton::actors::Node,
    to: &baton::actors::Peer,
    len: usize,
    seed: u8,
    deadline: std::time::Duration,
) -> Result<u64, String> {
    let buf = node.allocate::<u8>(len).map_err(|e| e.to_string())?;
    if seed != 0 {
        buf.write_at(0, &pattern_bytes(seed, len))
            .map_err(|e| e.to_string())?;
    }
    let msg = Take {
        seed,
        data: buf.share(),
    };
    let took = to
        .remote::<Take>("take")
        .send_timeout(msg, deadline)
        .await
        .map_err(|e| format!("the take call: {e:?}"))??;
    buf.returned_within(deadline)
        .await
        .map_err(|e| format!("the lease of {len} bytes: {e:?}"))?;
    Ok(took)
}

/// A buffer for the relay to keep (forwarding across hosts): a lease of its exporter's,
/// over a Unix link; answered with its length once kept.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct Keep {
    pub data: Shared<u8>,
}

impl RemoteMessage for Keep {
    const NAME: &'static str = "tests.cross_host.Keep";
}

/// As [`Keep`], shared writable.
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct KeepMut {
    pub data: baton::actors::SharedMut<u8>,
}

impl RemoteMessage for KeepMut {
    const NAME: &'static str = "tests.cross_host.KeepMut";
}

/// Asks an exporter about its ledger: answers the leases its node has out, and whether
/// its buffer could be written now (refused while any lease on it is out).
#[derive(Debug, Serialize, Deserialize, Message)]
#[rtype(result = "Result<LedgerState, String>")]
pub struct LedgerOf;

impl RemoteMessage for LedgerOf {
    const NAME: &'static str = "tests.cross_host.LedgerOf";
}

/// What [`LedgerOf`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerState {
    pub leases: u64,
    pub writable: bool,
}

/// Answers [`Keep`] and [`KeepMut`]: keeps the leases in `kept` and `kept_mut`.
#[derive(Default)]
pub struct Keeper {
    pub kept: std::sync::Arc<std::sync::Mutex<Vec<baton::actors::Lease<u8>>>>,
    pub kept_mut: std::sync::Arc<std::sync::Mutex<Vec<baton::actors::LeaseMut<u8>>>>,
}

impl actix::Handler<KeepMut> for Keeper {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: KeepMut, _: &mut actix::Context<Self>) -> Self::Result {
        let lease = msg.data.open().map_err(|e| e.to_string())?;
        let len = lease.len() as u64;
        self.kept_mut.lock().unwrap().push(lease);
        Ok(len)
    }
}

impl actix::Actor for Keeper {
    type Context = actix::Context<Self>;
}

impl actix::Handler<Keep> for Keeper {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: Keep, _: &mut actix::Context<Self>) -> Self::Result {
        let lease = msg.data.open().map_err(|e| e.to_string())?;
        let len = lease.len() as u64;
        self.kept.lock().unwrap().push(lease);
        Ok(len)
    }
}

/// Answers [`LedgerOf`] for the buffer it owns, of the pattern `seed`.
pub struct Ledger {
    pub node: baton::actors::Node,
    pub buffer: baton::actors::Buffer<u8>,
    pub seed: u8,
}

impl actix::Actor for Ledger {
    type Context = actix::Context<Self>;
}

impl actix::Handler<LedgerOf> for Ledger {
    type Result = Result<LedgerState, String>;
    fn handle(&mut self, _: LedgerOf, _: &mut actix::Context<Self>) -> Self::Result {
        // The same byte again: the pattern stays whole.
        let writable = self.buffer.write_at(0, &[pattern(self.seed, 0)]).is_ok();
        Ok(LedgerState {
            leases: self.node.status(0).leases,
            writable,
        })
    }
}
