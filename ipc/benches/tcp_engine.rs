//! Host-memory transfer throughput: the TCP engine against a plain TCP socket copy of the
//! same bytes, in the same run, on loopback (issue 26; target ≥ 0.9×).
//!
//! ```text
//! cargo bench -p baton-ipc --bench tcp_engine [-- SIZE_MIB ROUNDS]
//! ```
//!
//! Each round copies SIZE_MIB (default 256) from one buffer into another once through a
//! plain TCP connection (a sender thread writes, a receiver thread reads into its buffer
//! and answers one byte) and once through the engine (one engine sends, another
//! receives; data connection already open, as the engine caches it), alternating so that
//! both see the same machine state. Prints one JSON line per round and a summary line with
//! the medians and their ratio, and the machine it ran on. Not an assertion.

use baton_ipc::tcp::{NodeKey, TcpConfig};
use baton_ipc::transfer::TcpEngine;
use baton_ipc::{Region, Session, TransferEngine, TransferId};
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

/// One plain copy of `src` into the receiver's buffer: seconds.
fn plain_round(tx: &mut TcpStream, rx: &mut TcpStream, src: &[u8], dst: &mut [u8]) -> f64 {
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            rx.read_exact(dst).unwrap();
            rx.write_all(&[1]).unwrap();
        });
        tx.write_all(src).unwrap();
        let mut ack = [0u8; 1];
        tx.read_exact(&mut ack).unwrap();
    });
    start.elapsed().as_secs_f64()
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
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {cores} cores, loopback")
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mib: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(256);
    let rounds: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(7);
    let len = mib << 20;
    let mut src: Vec<u8> = (0..len).map(|i| (i * 7 + (i >> 12)) as u8).collect();
    let mut dst = vec![0u8; len];

    let session = Session::generate().unwrap();
    let engine = || {
        let config = TcpConfig::new(session.clone(), NodeKey::generate().unwrap());
        TcpEngine::bind("127.0.0.1:0", config, Duration::from_secs(30)).unwrap()
    };
    let (a, b) = (engine(), engine());
    let (mut tx, mut rx) = plain_pair();
    // Warm up both: connections open, pages touched.
    plain_round(&mut tx, &mut rx, &src, &mut dst);
    engine_round(&a, &b, 0, &mut src, &mut dst);
    assert!(src == dst, "the engine's copy differs");

    let (mut plain, mut eng) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let p = plain_round(&mut tx, &mut rx, &src, &mut dst);
        let e = engine_round(&a, &b, round as u64 + 1, &mut src, &mut dst);
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
    // blake3, one thread per side) beside the copy.
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
    let (p, e) = (median(&mut plain), median(&mut eng));
    println!(
        "{{\"item\":\"tcp_engine_summary\",\"bytes\":{len},\"rounds\":{rounds},\"plain_gbps_median\":{p:.3},\"engine_gbps_median\":{e:.3},\"ratio\":{:.3},\"blake3_keyed_gbps_one_thread\":{h:.3},\"machine\":\"{}\"}}",
        e / p,
        machine()
    );
}
