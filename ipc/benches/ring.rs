//! Same-host round trips: the shared-memory ring (`baton_ipc::ring`) against a Unix socket
//! pair, the same 215-byte frame (a real `Call` frame's size) each way (issue 48, item 1).
//!
//! ```text
//! cargo bench -p baton-ipc --bench ring [-- [link] ROUND_TRIPS BATCHES]
//! ```
//!
//! Two processes: this one and a child forked per transport (before either makes a thread
//! or a runtime), which echoes every frame back. Four modes, each transport in each:
//!
//! - `blocking`: blocking calls ([`RingReader::recv`], which polls for its window then
//!   sleeps on the doorbell; `read`/`write` on the socket);
//! - `tokio`: a current-thread tokio runtime in each process, built with
//!   `on_thread_park(before_park)`; the ring's reader an [`AsyncRingReader`], the socket a
//!   `tokio::net::UnixStream`;
//! - `one-core-blocking`, `one-core-tokio`: the same with both processes pinned to one core
//!   (`sched_setaffinity`), where the readers' windows are zero (`PollWindow::for_this_machine`
//!   sees one CPU).
//!
//! With `link`, one mode alone instead, `link-tokio`: [`AsyncLink`]s both ways (handshake,
//! codec, a `Call` frame of the same size), on the same runtimes, one link offering rings
//! both ways ([`LinkConfig::with_ring`]) against one on the socket alone: what the ring
//! saves once the link's own work is paid.
//!
//! Each mode runs 2,000 round trips of warm-up, then BATCHES (default 5) batches of
//! ROUND_TRIPS (default 20,000), ring and socket alternating batch by batch, and prints a
//! JSON line per batch (`p50_us`, `mean_us`, `p99_us` of that batch's round trips) and one
//! per mode: the medians of the batches' figures and the ratio ring / socket. Figures, not
//! assertions (docs/BENCHMARKS.md).

use baton_ipc::messages::protocol::Call;
use baton_ipc::messages::{Message, SessionToken};
use baton_ipc::ring::{
    AsyncRingReader, DEFAULT_CAPACITY, PollWindow, RingReader, RingWriter, before_park,
};
use baton_ipc::{AsyncLink, LinkConfig, LinkReader, LinkWriter, Session};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

const MSG: usize = 215;
const WARMUP: usize = 2_000;
/// Any single wait's deadline: a stuck peer ends the benchmark instead of hanging it.
const WAIT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Drive {
    Blocking,
    Tokio,
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .on_thread_park(before_park)
        .build()
        .expect("a runtime")
}

/// Forks: `None` in the child, the child's pid in the parent.
fn fork() -> Option<libc::pid_t> {
    // SAFETY: one system call; this process has only its main thread here (no runtime, no
    // other thread: each mode's runtime is made after its children), so the child may run
    // anything.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    (pid != 0).then_some(pid)
}

/// Ends a child without running the parent's exit handlers or flushing its buffers again.
fn exit_child() -> ! {
    // SAFETY: `_exit` is always sound to call; nothing runs after it.
    unsafe { libc::_exit(0) }
}

fn reap(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: one system call on our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "a peer failed"
    );
}

/// The parent's reader: blocking, or (in the tokio modes) async.
enum Reader {
    Blocking(RingReader),
    Async(AsyncRingReader),
}

/// The parent's ends of a ring per direction.
struct RingEnds {
    reader: Reader,
    writer: RingWriter,
}

/// A ring per direction and a child echoing `total` frames on them.
fn ring_peer(drive: Drive, total: usize) -> (RingEnds, libc::pid_t) {
    let window = PollWindow::for_this_machine();
    let (ours, to_us) = RingReader::create(DEFAULT_CAPACITY, window).expect("a ring");
    let (theirs, to_them) = RingReader::create(DEFAULT_CAPACITY, window).expect("a ring");
    let Some(pid) = fork() else {
        // The parent's reader is the parent's: its copy here must not close it on drop.
        std::mem::forget(ours);
        drop(to_them);
        let mut writer = RingWriter::open(to_us).expect("the parent's ring");
        let mut out = Vec::with_capacity(MSG);
        match drive {
            Drive::Blocking => {
                let mut reader = theirs;
                for _ in 0..total {
                    out.clear();
                    let until = Instant::now() + WAIT;
                    reader.recv(&mut out, until).unwrap().expect("a ping");
                    writer.send(&out, until).unwrap();
                }
            }
            Drive::Tokio => runtime().block_on(async {
                let mut reader = AsyncRingReader::new(theirs).unwrap();
                for _ in 0..total {
                    out.clear();
                    reader.recv(&mut out).await.unwrap();
                    writer.send(&out, Instant::now() + WAIT).unwrap();
                }
            }),
        }
        exit_child();
    };
    // As in the child, the other way round.
    std::mem::forget(theirs);
    drop(to_us);
    let writer = RingWriter::open(to_them).expect("the child's ring");
    let ends = RingEnds {
        reader: Reader::Blocking(ours),
        writer,
    };
    (ends, pid)
}

/// A socket pair and a child echoing `total` frames on it.
fn socket_peer(drive: Drive, total: usize) -> (UnixStream, libc::pid_t) {
    let (ours, theirs) = UnixStream::pair().expect("a socket pair");
    let Some(pid) = fork() else {
        drop(ours);
        let mut s = theirs;
        let mut buf = [0u8; MSG];
        match drive {
            Drive::Blocking => {
                for _ in 0..total {
                    s.read_exact(&mut buf).unwrap();
                    s.write_all(&buf).unwrap();
                }
            }
            Drive::Tokio => runtime().block_on(async {
                s.set_nonblocking(true).unwrap();
                let s = tokio::net::UnixStream::from_std(s).unwrap();
                for _ in 0..total {
                    read_async(&s, &mut buf).await;
                    write_async(&s, &buf).await;
                }
            }),
        }
        exit_child();
    };
    drop(theirs);
    (ours, pid)
}

async fn read_async(s: &tokio::net::UnixStream, buf: &mut [u8]) {
    let mut got = 0;
    while got < buf.len() {
        match s.try_read(&mut buf[got..]) {
            Ok(0) => panic!("the peer closed the socket"),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => s.readable().await.unwrap(),
            Err(e) => panic!("read: {e}"),
        }
    }
}

async fn write_async(s: &tokio::net::UnixStream, buf: &[u8]) {
    let mut put = 0;
    while put < buf.len() {
        match s.try_write(&buf[put..]) {
            Ok(n) => put += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => s.writable().await.unwrap(),
            Err(e) => panic!("write: {e}"),
        }
    }
}

/// One round trip's time in µs each.
type Samples = Vec<f64>;

fn ring_batch(ends: &mut RingEnds, rt: Option<&tokio::runtime::Runtime>, n: usize) -> Samples {
    let msg = [7u8; MSG];
    let mut out = Vec::with_capacity(MSG);
    let mut samples = Vec::with_capacity(n);
    let writer = &mut ends.writer;
    match (&mut ends.reader, rt) {
        (Reader::Async(reader), Some(rt)) => rt.block_on(async {
            for _ in 0..n {
                let t = Instant::now();
                writer.send(&msg, t + WAIT).unwrap();
                out.clear();
                reader.recv(&mut out).await.unwrap();
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }),
        (Reader::Blocking(reader), None) => {
            for _ in 0..n {
                let t = Instant::now();
                writer.send(&msg, t + WAIT).unwrap();
                out.clear();
                reader.recv(&mut out, t + WAIT).unwrap().expect("a pong");
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        _ => unreachable!("an async reader with a runtime, a blocking one without"),
    }
    assert_eq!(out, msg, "the echo differs");
    samples
}

fn socket_batch(
    s: &mut UnixStream,
    async_socket: Option<&tokio::net::UnixStream>,
    rt: Option<&tokio::runtime::Runtime>,
    n: usize,
) -> Samples {
    let msg = [7u8; MSG];
    let mut buf = [0u8; MSG];
    let mut samples = Vec::with_capacity(n);
    match (async_socket, rt) {
        (Some(a), Some(rt)) => rt.block_on(async {
            for _ in 0..n {
                let t = Instant::now();
                write_async(a, &msg).await;
                read_async(a, &mut buf).await;
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }),
        _ => {
            for _ in 0..n {
                let t = Instant::now();
                s.write_all(&msg).unwrap();
                s.read_exact(&mut buf).unwrap();
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    assert_eq!(buf, msg, "the echo differs");
    samples
}

/// As [`runtime`], with timers (the link's handshake has a deadline).
fn link_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(before_park)
        .build()
        .expect("a runtime")
}

fn link_config(ring: bool) -> LinkConfig {
    let config = LinkConfig::new(Session::new(SessionToken::from_bytes([1; 32])));
    if ring {
        config.with_ring(DEFAULT_CAPACITY)
    } else {
        config.without_ring()
    }
}

/// A `Call` whose frame is `MSG` bytes or a few more.
fn link_message() -> Message {
    Message::Call(Call {
        id: 1,
        target: "bench".into(),
        type_name: "pingpong".into(),
        payload: vec![7; MSG - 30],
        offers: Vec::new(),
    })
}

/// A link (with rings both ways, or not) and a child echoing `total` messages on it. The
/// child connects to a listener (a socket pair made before the fork would carry the
/// parent's credentials on both ends, which the handshake refuses); the handshake is done
/// later, on the parent's runtime (`link_open`).
fn link_peer(ring: bool, total: usize) -> (UnixStream, libc::pid_t) {
    let dir = std::env::temp_dir().join(format!("baton-ring-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a socket directory");
    let path = dir.join(if ring { "ring.sock" } else { "plain.sock" });
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).expect("a listener");
    let Some(pid) = fork() else {
        drop(listener);
        let theirs = UnixStream::connect(&path).expect("the parent's listener");
        link_runtime().block_on(async {
            theirs.set_nonblocking(true).unwrap();
            let s = tokio::net::UnixStream::from_std(theirs).unwrap();
            let link = AsyncLink::client(s, &link_config(ring)).await.unwrap();
            let (mut rx, mut wx) = link.into_split();
            for _ in 0..total {
                let got = rx.recv().await.unwrap();
                wx.send(&got.message, &[]).await.unwrap();
            }
            assert_eq!(wx.uses_ring(), ring, "the child's writer");
        });
        exit_child();
    };
    let (ours, _) = listener.accept().expect("the child connects");
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir(&dir);
    (ours, pid)
}

async fn link_open(s: UnixStream, ring: bool) -> (LinkReader, LinkWriter) {
    s.set_nonblocking(true).unwrap();
    let s = tokio::net::UnixStream::from_std(s).unwrap();
    let link = AsyncLink::server(s, &link_config(ring)).await.unwrap();
    link.into_split()
}

async fn link_batch(link: &mut (LinkReader, LinkWriter), msg: &Message, n: usize) -> Samples {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        link.1.send(msg, &[]).await.unwrap();
        let got = link.0.recv().await.unwrap();
        samples.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(&got.message, msg, "the echo differs");
    }
    samples
}

/// The `link-tokio` mode: ping-pong over `AsyncLink`s, with rings and without.
fn link_mode(round_trips: usize, batches: usize) {
    let total = WARMUP + round_trips * batches;
    let (ring_sock, ring_pid) = link_peer(true, total);
    let (plain_sock, plain_pid) = link_peer(false, total);
    let rt = link_runtime();
    let msg = link_message();
    let frame = baton_ipc::messages::codec::frame_bytes(&msg, 0)
        .unwrap()
        .len();
    let (mut ring_figs, mut socket_figs) = (Vec::new(), Vec::new());
    rt.block_on(async {
        let mut ringed = link_open(ring_sock, true).await;
        let mut plain = link_open(plain_sock, false).await;
        link_batch(&mut ringed, &msg, WARMUP).await;
        link_batch(&mut plain, &msg, WARMUP).await;
        assert!(
            ringed.0.uses_ring() && ringed.1.uses_ring(),
            "rings both ways"
        );
        assert!(!plain.0.uses_ring() && !plain.1.uses_ring());
        for batch in 0..batches {
            let r = figures(link_batch(&mut ringed, &msg, round_trips).await);
            let s = figures(link_batch(&mut plain, &msg, round_trips).await);
            for (transport, (p50, mean, p99)) in [("ring", r), ("socket", s)] {
                println!(
                    "{{\"mode\":\"link-tokio\",\"transport\":\"{transport}\",\"batch\":{batch},\
                      \"frame_bytes\":{frame},\"p50_us\":{p50:.3},\"mean_us\":{mean:.3},\
                      \"p99_us\":{p99:.3}}}"
                );
            }
            ring_figs.push(r);
            socket_figs.push(s);
        }
    });
    drop(rt);
    reap(ring_pid);
    reap(plain_pid);
    let med =
        |v: &[(f64, f64, f64)], f: fn(&(f64, f64, f64)) -> f64| median(v.iter().map(f).collect());
    let (rp, sp) = (med(&ring_figs, |f| f.0), med(&socket_figs, |f| f.0));
    let (rm, sm) = (med(&ring_figs, |f| f.1), med(&socket_figs, |f| f.1));
    let (r99, s99) = (med(&ring_figs, |f| f.2), med(&socket_figs, |f| f.2));
    println!(
        "{{\"mode\":\"link-tokio\",\"summary\":true,\"frame_bytes\":{frame},\
          \"window_max_us\":{:.1},\"ring_p50_us\":{rp:.3},\"socket_p50_us\":{sp:.3},\
          \"ratio_p50\":{:.3},\"ring_mean_us\":{rm:.3},\"socket_mean_us\":{sm:.3},\
          \"ratio_mean\":{:.3},\"ring_p99_us\":{r99:.3},\"socket_p99_us\":{s99:.3}}}",
        PollWindow::for_this_machine().max().as_secs_f64() * 1e6,
        rp / sp,
        rm / sm,
    );
}

/// (p50, mean, p99) of a batch.
fn figures(mut s: Samples) -> (f64, f64, f64) {
    s.sort_by(|a, b| a.total_cmp(b));
    let mean = s.iter().sum::<f64>() / s.len() as f64;
    (s[s.len() / 2], mean, s[s.len() * 99 / 100])
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn cpu_set() -> libc::cpu_set_t {
    // SAFETY: `cpu_set_t` is plain bits; all zeros is the empty set.
    unsafe { std::mem::zeroed() }
}

fn affinity() -> libc::cpu_set_t {
    let mut set = cpu_set();
    // SAFETY: one system call writing at most `size_of::<cpu_set_t>()` bytes into `set`.
    let r = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    assert_eq!(r, 0, "sched_getaffinity");
    set
}

fn set_affinity(set: &libc::cpu_set_t) {
    // SAFETY: one system call reading `size_of::<cpu_set_t>()` bytes of `set`.
    let r = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set) };
    assert_eq!(r, 0, "sched_setaffinity");
}

/// Pins this process (and the children it forks next) to the first core it may use; the
/// core.
fn pin_to_one_core() -> usize {
    let allowed = affinity();
    let core = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below `CPU_SETSIZE`, within the set.
        .find(|&cpu| unsafe { libc::CPU_ISSET(cpu, &allowed) })
        .expect("a core");
    let mut one = cpu_set();
    // SAFETY: as above.
    unsafe { libc::CPU_SET(core, &mut one) };
    set_affinity(&one);
    core
}

fn machine() -> (String, String) {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_owned())
        .unwrap_or_default();
    (cpu, kernel)
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let round_trips = args.first().copied().unwrap_or(20_000);
    let batches = args.get(1).copied().unwrap_or(5);
    let (cpu, kernel) = machine();
    println!(
        "{{\"bench\":\"ring_pingpong\",\"cpu\":\"{cpu}\",\"cores\":{},\"kernel\":\"{kernel}\",\
         \"msg_bytes\":{MSG},\"round_trips\":{round_trips},\"batches\":{batches},\
         \"warmup\":{WARMUP},\"capacity\":{DEFAULT_CAPACITY},\"window_max_us\":{}}}",
        cores(),
        PollWindow::DEFAULT_MAX.as_micros()
    );
    if std::env::args().any(|a| a == "link") {
        link_mode(round_trips, batches);
        return;
    }
    let total = WARMUP + round_trips * batches;
    let modes = [
        ("blocking", Drive::Blocking, false),
        ("tokio", Drive::Tokio, false),
        ("one-core-blocking", Drive::Blocking, true),
        ("one-core-tokio", Drive::Tokio, true),
    ];
    for (mode, drive, one_core) in modes {
        let saved = affinity();
        let core = one_core.then(pin_to_one_core);
        let window = PollWindow::for_this_machine().max();
        // Children first, while this process has one thread; then this side's runtime.
        let (mut ring, ring_pid) = ring_peer(drive, total);
        let (mut socket, socket_pid) = socket_peer(drive, total);
        let rt = (drive == Drive::Tokio).then(runtime);
        let mut async_socket = None;
        if let Some(rt) = &rt {
            let _in = rt.enter();
            let Reader::Blocking(reader) = ring.reader else {
                unreachable!("made blocking")
            };
            ring.reader = Reader::Async(AsyncRingReader::new(reader).unwrap());
            let s = socket.try_clone().unwrap();
            s.set_nonblocking(true).unwrap();
            async_socket = Some(tokio::net::UnixStream::from_std(s).unwrap());
        }
        ring_batch(&mut ring, rt.as_ref(), WARMUP);
        socket_batch(&mut socket, async_socket.as_ref(), rt.as_ref(), WARMUP);
        let (mut ring_figs, mut socket_figs) = (Vec::new(), Vec::new());
        for batch in 0..batches {
            let r = figures(ring_batch(&mut ring, rt.as_ref(), round_trips));
            let s = figures(socket_batch(
                &mut socket,
                async_socket.as_ref(),
                rt.as_ref(),
                round_trips,
            ));
            for (transport, (p50, mean, p99)) in [("ring", r), ("socket", s)] {
                println!(
                    "{{\"mode\":\"{mode}\",\"transport\":\"{transport}\",\"batch\":{batch},\
                     \"p50_us\":{p50:.3},\"mean_us\":{mean:.3},\"p99_us\":{p99:.3}}}"
                );
            }
            ring_figs.push(r);
            socket_figs.push(s);
        }
        reap(ring_pid);
        reap(socket_pid);
        let med = |v: &[(f64, f64, f64)], f: fn(&(f64, f64, f64)) -> f64| {
            median(v.iter().map(f).collect())
        };
        let (rp, sp) = (med(&ring_figs, |f| f.0), med(&socket_figs, |f| f.0));
        let (rm, sm) = (med(&ring_figs, |f| f.1), med(&socket_figs, |f| f.1));
        let (r99, s99) = (med(&ring_figs, |f| f.2), med(&socket_figs, |f| f.2));
        let pinned = core.map_or("null".to_owned(), |c| c.to_string());
        println!(
            "{{\"mode\":\"{mode}\",\"summary\":true,\"pinned_core\":{pinned},\
             \"window_max_us\":{:.1},\"ring_p50_us\":{rp:.3},\"socket_p50_us\":{sp:.3},\
             \"ratio_p50\":{:.3},\"ring_mean_us\":{rm:.3},\"socket_mean_us\":{sm:.3},\
             \"ratio_mean\":{:.3},\"ring_p99_us\":{r99:.3},\"socket_p99_us\":{s99:.3}}}",
            window.as_secs_f64() * 1e6,
            rp / sp,
            rm / sm,
        );
        drop(ring);
        drop(async_socket);
        drop(rt);
        set_affinity(&saved);
    }
}
