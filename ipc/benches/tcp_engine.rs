//! Host-memory transfer throughput: the TCP engine against a plain TCP socket copy of the
//! same bytes, in the same run, on loopback (issue 26; target ≥ 0.9×).
//!
//! ```text
//! cargo bench -p baton-ipc --bench tcp_engine [-- SIZE_MIB ROUNDS] [--hash-threads N]
//! ```
//!
//! `--hash-threads N` sets each engine's hashing threads (default: the engine's own choice
//! for this machine's cores, see `TcpEngine::hash_threads`). The summary names the cores
//! the process may use (`available_parallelism`, which honours `taskset`): run it under
//! `taskset -c 0-3` to see the engine on four cores. The binary needs no Rust toolchain on
//! the machine it runs on: `cargo bench -p baton-ipc --bench tcp_engine --no-run` prints
//! its path; copy it and run `./tcp_engine-HASH 256 9`.
//!
//! Each round copies SIZE_MIB (default 256) from one buffer into another once through a
//! plain TCP connection (a sender thread writes, a receiver thread reads into its buffer
//! and answers one byte) and once through the engine (one engine sends, another
//! receives; data connection already open, as the engine caches it), alternating so that
//! both see the same machine state. Prints one JSON line per round and a summary line with
//! the medians and their ratio, and the machine it ran on. Not an assertion.
//!
//! The summary also says where the CPU time went, per round, by thread (from
//! `/proc/…/schedstat`): the plain copy's writer and reader; the engine's copying threads
//! (`baton-tcp-send`, `baton-tcp-data`) and hashing threads (`baton-tcp-hash`, both
//! engines together). Where cores are free, the engine's rate is bounded by its busiest
//! copying thread, as the plain copy's is by its own.

use baton_ipc::tcp::{NodeKey, TcpConfig};
use baton_ipc::transfer::TcpEngine;
use baton_ipc::{Region, Session, TransferEngine, TransferId};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn plain_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    c.set_nodelay(true).unwrap();
    s.set_nodelay(true).unwrap();
    (c, s)
}

/// CPU seconds run by a thread, from its `schedstat` (0 where there is none).
fn schedstat_cpu(path: &str) -> f64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0.0, |ns| ns as f64 / 1e9)
}

/// CPU seconds run by each thread of this process: tid → (name, seconds).
fn threads_cpu() -> BTreeMap<String, (String, f64)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return BTreeMap::new();
    };
    dir.filter_map(|e| {
        let path = e.ok()?.path();
        let name = std::fs::read_to_string(path.join("comm")).ok()?;
        let cpu = schedstat_cpu(path.join("schedstat").to_str()?);
        let tid = path.file_name()?.to_string_lossy().into_owned();
        Some((tid, (name.trim().to_owned(), cpu)))
    })
    .collect()
}

/// Adds the CPU seconds each thread name ran between two snapshots to `into`.
fn add_cpu(
    into: &mut BTreeMap<String, f64>,
    before: &BTreeMap<String, (String, f64)>,
    after: &BTreeMap<String, (String, f64)>,
) {
    for (tid, (name, cpu)) in after {
        let was = before.get(tid).map_or(0.0, |(_, c)| *c);
        *into.entry(name.clone()).or_default() += cpu - was;
    }
}

/// `{"name":seconds,…}`, each divided by `rounds`.
fn per_round(cpu: &BTreeMap<String, f64>, rounds: usize) -> String {
    let fields: Vec<String> = cpu
        .iter()
        .filter(|(_, s)| **s > 0.0)
        .map(|(name, s)| format!("\"{name}\":{:.4}", s / rounds as f64))
        .collect();
    format!("{{{}}}", fields.join(","))
}

/// One plain copy of `src` into the receiver's buffer: seconds; adds the writer's and the
/// reader's CPU time to `cpu`.
fn plain_round(
    tx: &mut TcpStream,
    rx: &mut TcpStream,
    src: &[u8],
    dst: &mut [u8],
    cpu: &mut BTreeMap<String, f64>,
) -> f64 {
    let me = "/proc/thread-self/schedstat";
    let start = Instant::now();
    let writer = schedstat_cpu(me);
    let reader = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let cpu = schedstat_cpu(me);
            rx.read_exact(dst).unwrap();
            rx.write_all(&[1]).unwrap();
            schedstat_cpu(me) - cpu
        });
        tx.write_all(src).unwrap();
        let mut ack = [0u8; 1];
        tx.read_exact(&mut ack).unwrap();
        reader.join().unwrap()
    });
    let took = start.elapsed().as_secs_f64();
    *cpu.entry("writer".into()).or_default() += schedstat_cpu(me) - writer;
    *cpu.entry("reader".into()).or_default() += reader;
    took
}

/// One engine transfer of `src` into `dst`: seconds.
fn engine_round(a: &TcpEngine, b: &TcpEngine, id: u64, src: &mut [u8], dst: &mut [u8]) -> f64 {
    let wait = Duration::from_secs(120);
    let start = Instant::now();
    // SAFETY: both buffers outlive the transfers, which are waited for before returning.
    let recv = unsafe { b.recv(&a.as_peer(), TransferId(id), Region::of_slice(dst)) }.unwrap();
    // SAFETY: as above.
    let send = unsafe { a.send(&b.as_peer(), TransferId(id), Region::of_slice(src)) }.unwrap();
    recv.wait(wait).unwrap();
    send.wait(wait).unwrap();
    start.elapsed().as_secs_f64()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    format!("{cpu}, {} cores usable, loopback", cores())
}

fn main() {
    let all: Vec<String> = std::env::args().skip(1).collect();
    let hash_threads: Option<usize> = all.iter().position(|a| a == "--hash-threads").map(|i| {
        all.get(i + 1)
            .and_then(|n| n.parse().ok())
            .expect("--hash-threads takes a number")
    });
    let args: Vec<&String> = all
        .iter()
        .enumerate()
        .filter(|(i, a)| !a.starts_with('-') && (*i == 0 || all[i - 1] != "--hash-threads"))
        .map(|(_, a)| a)
        .collect();
    let mib: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(256);
    let rounds: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(7);
    let len = mib << 20;
    let mut src: Vec<u8> = (0..len).map(|i| (i * 7 + (i >> 12)) as u8).collect();
    let mut dst = vec![0u8; len];

    let session = Session::generate().unwrap();
    let engine = || {
        let key = NodeKey::generate().unwrap();
        let public = key.public();
        let config = TcpConfig::new(session.clone(), key);
        let engine = TcpEngine::bind("127.0.0.1:0", config, Duration::from_secs(30)).unwrap();
        (engine, public)
    };
    let main_name = std::fs::read_to_string("/proc/thread-self/comm")
        .map(|n| n.trim().to_owned())
        .unwrap_or_default();
    let ((a, a_key), (b, _)) = (engine(), engine());
    // b takes a's data connections as a node does for a host link's peer.
    b.admit(&a.as_peer(), a_key);
    if let Some(n) = hash_threads {
        a.set_hash_threads(n);
        b.set_hash_threads(n);
    }
    let (mut tx, mut rx) = plain_pair();
    // Warm up both: connections open, pages touched.
    plain_round(&mut tx, &mut rx, &src, &mut dst, &mut BTreeMap::new());
    engine_round(&a, &b, 0, &mut src, &mut dst);
    assert!(src == dst, "the engine's copy differs");

    let (mut plain, mut eng) = (Vec::new(), Vec::new());
    let (mut plain_cpu, mut engine_cpu) = (BTreeMap::new(), BTreeMap::new());
    for round in 0..rounds {
        let p = plain_round(&mut tx, &mut rx, &src, &mut dst, &mut plain_cpu);
        let before = threads_cpu();
        let e = engine_round(&a, &b, round as u64 + 1, &mut src, &mut dst);
        add_cpu(&mut engine_cpu, &before, &threads_cpu());
        let gbps = |s: f64| len as f64 / s / 1e9;
        println!(
            "{{\"item\":\"tcp_engine\",\"round\":{round},\"bytes\":{len},\"plain_gbps\":{:.3},\"engine_gbps\":{:.3}}}",
            gbps(p),
            gbps(e)
        );
        plain.push(gbps(p));
        eng.push(gbps(e));
    }
    // What bounds the engine on a machine whose cores are all busy: its MAC (keyed
    // blake3) beside the copy, on one thread.
    let mut hash = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        let mut h = blake3::Hasher::new_keyed(&[7; 32]);
        for chunk in src.chunks(1 << 20) {
            h.update(chunk);
        }
        std::hint::black_box(h.finalize());
        hash.push(len as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    let h = median(&mut hash);
    // The main thread only waits for the engine's transfers.
    engine_cpu.remove(&main_name);
    let (p, e) = (median(&mut plain), median(&mut eng));
    println!(
        "{{\"item\":\"tcp_engine_summary\",\"bytes\":{len},\"rounds\":{rounds},\"plain_gbps_median\":{p:.3},\"engine_gbps_median\":{e:.3},\"ratio\":{:.3},\"blake3_keyed_gbps_one_thread\":{h:.3},\"cores\":{},\"hash_threads\":{},\"plain_cpu_s_per_round\":{},\"engine_cpu_s_per_round\":{},\"machine\":\"{}\"}}",
        e / p,
        cores(),
        a.hash_threads(),
        per_round(&plain_cpu, rounds),
        per_round(&engine_cpu, rounds),
        machine()
    );
}
