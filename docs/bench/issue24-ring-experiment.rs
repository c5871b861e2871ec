//! Issue 24 experiment (not Baton code): what one same-host crossing costs through a
//! shared-memory ring with a futex doorbell, against a blocking Unix-socket ping-pong of the
//! same message size (the benchmark's "socket floor"). Two processes (the second is this
//! executable re-spawned), one 215-byte message each way per round trip.
//!
//! Variants: `socket` (blocking `write`/`read` on a socketpair), `futex` (an SPSC ring per
//! direction in a memfd; the waiter sets a `sleeping` word, re-checks, `FUTEX_WAIT`s; the
//! writer `FUTEX_WAKE`s only when that word is set), `spin-N` (the same, spinning N µs on the
//! ring before sleeping), `eventfd` (the ring, with an eventfd doorbell read blocking — what
//! an fd a runtime can poll costs).
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

const MSG: usize = 215;
const SLOTS: usize = 64;
const SLOT: usize = 256;

#[repr(C)]
struct Ring {
    head: AtomicU64,
    _p0: [u64; 7],
    tail: AtomicU64,
    _p1: [u64; 7],
    sleeping: AtomicU32,
    _p2: [u32; 15],
    slots: [[u8; SLOT]; SLOTS],
}

struct Side<'a> {
    tx: &'a Ring,
    rx: &'a Ring,
    spin: Duration,
    efd_tx: Option<RawFd>,
    efd_rx: Option<RawFd>,
}

fn futex(word: &AtomicU32, op: i32, val: u32) {
    unsafe {
        libc::syscall(libc::SYS_futex, word as *const AtomicU32, op, val, std::ptr::null::<libc::timespec>(), 0, 0);
    }
}

impl Side<'_> {
    fn send(&self, msg: &[u8; MSG]) {
        let h = self.tx.head.load(Relaxed);
        while h - self.tx.tail.load(Acquire) >= SLOTS as u64 {
            std::hint::spin_loop();
        }
        let slot = &self.tx.slots[(h % SLOTS as u64) as usize] as *const _ as *mut u8;
        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), slot, MSG) };
        self.tx.head.store(h + 1, Release);
        std::sync::atomic::fence(SeqCst);
        // Taken, not read: a waiter between its last check and its FUTEX_WAIT then finds the
        // word changed and does not sleep (reading it loses that wakeup: the first version
        // of this experiment hung so on the 32-core host).
        if self.tx.sleeping.swap(0, SeqCst) != 0 {
            match self.efd_tx {
                Some(fd) => unsafe {
                    let one: u64 = 1;
                    libc::write(fd, &one as *const u64 as *const _, 8);
                },
                None => futex(&self.tx.sleeping, libc::FUTEX_WAKE, 1),
            }
        }
    }

    fn recv(&self, out: &mut [u8; MSG]) {
        let t = self.rx.tail.load(Relaxed);
        let ready = || self.rx.head.load(Acquire) > t;
        if !ready() {
            let start = Instant::now();
            while !ready() && start.elapsed() < self.spin {
                std::hint::spin_loop();
            }
            while !ready() {
                self.rx.sleeping.store(1, SeqCst);
                std::sync::atomic::fence(SeqCst);
                if ready() {
                    self.rx.sleeping.store(0, SeqCst);
                    break;
                }
                match self.efd_rx {
                    Some(fd) => unsafe {
                        let mut v: u64 = 0;
                        libc::read(fd, &mut v as *mut u64 as *mut _, 8);
                    },
                    None => futex(&self.rx.sleeping, libc::FUTEX_WAIT, 1),
                }
                self.rx.sleeping.store(0, SeqCst);
            }
        }
        let slot = &self.rx.slots[(t % SLOTS as u64) as usize];
        out.copy_from_slice(&slot[..MSG]);
        self.rx.tail.store(t + 1, Release);
    }
}

fn map(fd: RawFd) -> (&'static Ring, &'static Ring) {
    let len = 2 * std::mem::size_of::<Ring>();
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    assert_ne!(p, libc::MAP_FAILED);
    let a = unsafe { &*(p as *const Ring) };
    let b = unsafe { &*((p as *const Ring).add(1)) };
    (a, b)
}

fn no_cloexec(fd: RawFd) {
    unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() > 1 && args[1] == "peer" {
        let variant = &args[2];
        let n: usize = args[3].parse().unwrap();
        let fd: RawFd = args[4].parse().unwrap();
        let mut msg = [0u8; MSG];
        if variant == "socket" {
            for _ in 0..n {
                read_exact(fd, &mut msg);
                write_all(fd, &msg);
            }
            return;
        }
        let (ab, ba) = map(fd);
        let (e1, e2): (Option<RawFd>, Option<RawFd>) = if variant == "eventfd" {
            (Some(args[5].parse().unwrap()), Some(args[6].parse().unwrap()))
        } else {
            (None, None)
        };
        let side = Side { tx: ba, rx: ab, spin: spin_of(variant), efd_tx: e2, efd_rx: e1 };
        for _ in 0..n {
            side.recv(&mut msg);
            side.send(&msg);
        }
        return;
    }
    let n: usize = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(50_000);
    let rounds: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(5);
    let variants = ["socket", "futex", "eventfd", "spin-5", "spin-50"];
    println!("{{\"n\":{n},\"rounds\":{rounds},\"msg_bytes\":{MSG}}}");
    for round in 0..rounds {
        for v in variants {
            let p50 = run(v, n);
            println!("{{\"round\":{round},\"variant\":\"{v}\",\"p50_us\":{:.3}}}", p50);
        }
    }
}

fn spin_of(v: &str) -> Duration {
    v.strip_prefix("spin-").map(|n| Duration::from_micros(n.parse().unwrap())).unwrap_or_default()
}

fn read_exact(fd: RawFd, buf: &mut [u8]) {
    let mut got = 0;
    while got < buf.len() {
        let r = unsafe { libc::read(fd, buf[got..].as_mut_ptr() as *mut _, buf.len() - got) };
        assert!(r > 0);
        got += r as usize;
    }
}

fn write_all(fd: RawFd, buf: &[u8]) {
    let mut put = 0;
    while put < buf.len() {
        let r = unsafe { libc::write(fd, buf[put..].as_ptr() as *const _, buf.len() - put) };
        assert!(r > 0);
        put += r as usize;
    }
}

fn run(variant: &str, n: usize) -> f64 {
    let exe = std::env::current_exe().unwrap();
    let warm = n / 10;
    let total = n + warm;
    let mut samples = Vec::with_capacity(n);
    let mut msg = [7u8; MSG];
    if variant == "socket" {
        let mut fds = [0; 2];
        unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) };
        no_cloexec(fds[1]);
        let mut child = std::process::Command::new(&exe)
            .args(["peer", variant, &total.to_string(), &fds[1].to_string()])
            .spawn()
            .unwrap();
        let _theirs = unsafe { OwnedFd::from_raw_fd(fds[1]) };
        for i in 0..total {
            let t = Instant::now();
            write_all(fds[0], &msg);
            read_exact(fds[0], &mut msg);
            if i >= warm {
                samples.push(t.elapsed());
            }
        }
        child.wait().unwrap();
        unsafe { libc::close(fds[0]) };
    } else {
        let fd = unsafe { libc::memfd_create(c"ring".as_ptr(), 0) };
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        unsafe { libc::ftruncate(fd, (2 * std::mem::size_of::<Ring>()) as i64) };
        let (ab, ba) = map(fd);
        let mut extra = Vec::new();
        let mut efds = (None, None);
        if variant == "eventfd" {
            let e1 = unsafe { libc::eventfd(0, 0) };
            let e2 = unsafe { libc::eventfd(0, 0) };
            no_cloexec(e1);
            no_cloexec(e2);
            extra = vec![e1.to_string(), e2.to_string()];
            efds = (Some(e1), Some(e2));
        }
        let mut child = std::process::Command::new(&exe)
            .args(["peer", variant, &total.to_string(), &owned.as_raw_fd().to_string()])
            .args(&extra)
            .spawn()
            .unwrap();
        let side = Side { tx: ab, rx: ba, spin: spin_of(variant), efd_tx: efds.0, efd_rx: efds.1 };
        for i in 0..total {
            let t = Instant::now();
            side.send(&msg);
            side.recv(&mut msg);
            if i >= warm {
                samples.push(t.elapsed());
            }
        }
        child.wait().unwrap();
    }
    samples.sort();
    samples[samples.len() / 2].as_secs_f64() * 1e6
}
