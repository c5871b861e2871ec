//! The listener findings of issue 45 (see the binary's docs): bounds before and after
//! authentication. A flood of silent connections from one source (and from several)
//! while honest links connect (finding 5); what a client without the token learns from
//! the listener (finding 12); a connect to an address that drops SYNs (finding 13); the
//! cap on established host links, in all and per key (finding 8, the host-link part).

use baton::Session;
use baton::ipc::Error;
use baton::ipc::tcp::{HostLink, HostListener, NodeKey, TcpConfig};
use baton::messages::Message;
use baton::messages::protocol::RefuseReason;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

/// Raises the soft limit on descriptors to the hard one (the flood keeps thousands open).
fn raise_nofile() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        let _ = setrlimit(Resource::Nofile, limit);
    }
}

fn config(session: &Session) -> TcpConfig {
    TcpConfig::new(session.clone(), NodeKey::generate().unwrap())
}

/// A silent connection to `to` from `from` (any loopback address: 127.0.0.0/8): bound
/// first, so the listener sees `from` as its source; the connect is not waited for.
fn silent_from(from: IpAddr, to: SocketAddr) -> Option<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::INET,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )
    .ok()?;
    rustix::net::bind(&fd, &SocketAddr::new(from, 0)).ok()?;
    match rustix::net::connect(&fd, &to) {
        Ok(()) | Err(rustix::io::Errno::INPROGRESS) => Some(fd),
        Err(_) => None,
    }
}

/// Floods `to` with `total` silent connections over `over`, round robin from `sources`,
/// each kept open (silent) for longer than a handshake deadline unless the listener
/// closes it, at most `window` open at once. Returns how many connects were made.
fn flood(
    to: SocketAddr,
    sources: Vec<IpAddr>,
    total: usize,
    over: Duration,
    window: usize,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let batch = 10;
        let pause = over / u32::try_from(total / batch).unwrap();
        let mut open: VecDeque<OwnedFd> = VecDeque::with_capacity(window);
        let mut made = 0;
        let start = Instant::now();
        while made < total && !stop.load(Ordering::Relaxed) {
            for _ in 0..batch {
                let from = sources[made % sources.len()];
                if let Some(fd) = silent_from(from, to) {
                    if open.len() == window {
                        open.pop_front();
                    }
                    open.push_back(fd);
                }
                made += 1;
            }
            // Keep to the pace: `total` connects over `over`.
            let due = start + pause * u32::try_from(made / batch).unwrap();
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        made
    })
}

/// The listener's established links, handed to the test as they come (its refusals of
/// the flood are dropped).
fn accepting(
    listener: Arc<HostListener>,
    stop: Arc<AtomicBool>,
) -> (mpsc::Receiver<HostLink>, Arc<AtomicUsize>) {
    let (tx, rx) = mpsc::channel();
    let refused = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&refused);
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match listener.accept_timeout(Duration::from_millis(100)) {
                Ok(link) => {
                    if tx.send(link).is_err() {
                        return;
                    }
                }
                Err(Error::Timeout {
                    op: "accepting a host link",
                    ..
                }) => {}
                Err(_) => {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    });
    (rx, refused)
}

/// Links `n` honest clients (each its own node key, from 127.0.0.1), one every `every`,
/// while the flood runs: each must be up at its first attempt — `connect` returns within
/// the handshake deadline or fails — and carry a message.
fn honest_links_get_in(
    addr: SocketAddr,
    session: &Session,
    links: &mpsc::Receiver<HostLink>,
    n: usize,
    every: Duration,
) {
    let mut up = Vec::new();
    for i in 0..n {
        let cfg = config(session);
        let mut c = HostLink::connect(addr, &cfg)
            .unwrap_or_else(|e| panic!("honest link {i} of {n} did not get in: {e}"));
        let until = Instant::now() + Duration::from_secs(10);
        let mut s = loop {
            let left = until.saturating_duration_since(Instant::now());
            let s = links
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("the listener never handed honest link {i} over"));
            if s.peer().key == cfg.key.public() {
                break s;
            }
        };
        c.send(&Message::Ping(i as u64), &[]).unwrap();
        assert_eq!(
            s.recv_timeout(Duration::from_secs(10)).unwrap().message,
            Message::Ping(i as u64)
        );
        up.push((c, s));
        std::thread::sleep(every);
    }
}

/// Finding 5: 10,000 silent connections from one source (127.0.0.9) over 30 s, each kept
/// open past the handshake deadline, while 100 honest links connect from 127.0.0.1: every
/// one is up at its first attempt, within its handshake deadline. (Before: the flood held
/// every handshake slot, and 0–1 of 100 honest connects got in.)
#[test]
fn a_flood_of_silent_connections_from_one_source_starves_no_honest_link() {
    let source = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 9));
    let flooded = honest_links_through_a_flood(vec![source], 10_000, Duration::from_secs(30), 100);
    assert!(flooded > 1_000, "the flood ran alongside");
}

/// Finding 5, fair accepting: eight flooding sources together want twice the listener's
/// handshake slots; a newcomer from a ninth source still gets in (the heaviest source's
/// oldest handshake makes room for it).
#[test]
fn a_flood_from_many_sources_leaves_room_for_a_newcomer() {
    let sources = (10..18)
        .map(|b| IpAddr::V4(Ipv4Addr::new(127, 0, 0, b)))
        .collect();
    honest_links_through_a_flood(sources, 3_000, Duration::from_secs(10), 20);
}

/// A listener flooded with `connections` silent connections from `sources` over `over`
/// (at most 2,000 held open at once) takes `honest` links that each must get in at their
/// first try; the flood's connections made.
fn honest_links_through_a_flood(
    sources: Vec<IpAddr>,
    connections: usize,
    over: Duration,
    honest: usize,
) -> usize {
    raise_nofile();
    let session = Session::generate().unwrap();
    let listener = Arc::new(HostListener::bind("127.0.0.1:0", config(&session)).unwrap());
    let addr = listener.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let (links, refused) = accepting(Arc::clone(&listener), Arc::clone(&stop));
    let flooder = flood(addr, sources, connections, over, 2_000, Arc::clone(&stop));
    // Let the flood fill what it can first.
    let until = Instant::now() + Duration::from_secs(30);
    while refused.load(Ordering::Relaxed) < 16 {
        assert!(
            Instant::now() < until,
            "the flood never reached the listener"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    honest_links_get_in(addr, &session, &links, honest, Duration::from_millis(250));
    stop.store(true, Ordering::Relaxed);
    flooder.join().unwrap()
}

/// The first handshake record `client` sends, caught by a plain socket.
fn first_record(client: TcpConfig) -> Vec<u8> {
    let catcher = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = catcher.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let _ = HostLink::connect(addr, &client.handshake_timeout(Duration::from_secs(2)));
    });
    let (mut s, _) = catcher.accept().unwrap();
    let mut len = [0u8; 2];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut body).unwrap();
    drop(s);
    t.join().unwrap();
    [&len[..], &body].concat()
}

/// Everything the listener sends to a raw client that sends `bytes`, until it closes.
fn reply_to(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(bytes).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Finding 12: a client without the token gets the refusal record and nothing else — not
/// the listener's static key, host id, boot id, pid, start time or data port (before, the
/// listener's second message carried them, readable by any initiator). A raw client
/// replaying an honest client's first message gets only bytes keyed by that client's
/// ephemeral key and the token: no identifying byte in clear.
#[test]
fn a_client_without_the_token_learns_nothing_identifying() {
    let session = Session::generate().unwrap();
    let server = config(&session).data_port(4242);
    let listener = HostListener::bind("127.0.0.1:0", server).unwrap();
    let addr = listener.local_addr();
    let stranger = first_record(config(&Session::generate().unwrap()));
    let got = reply_to(addr, &stranger);
    assert_eq!(
        got,
        [0, 0, 1],
        "a token-less client got more than its refusal"
    );
    assert!(matches!(
        listener.accept_timeout(Duration::from_secs(10)),
        Err(Error::BadToken)
    ));
    // The wrong-token client through the public API: refused as before.
    let e = HostLink::connect(addr, &config(&Session::generate().unwrap())).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Refused {
                reason: RefuseReason::BadToken
            }
        ),
        "{e}"
    );
    // A replayed first message of a token holder: the second message comes back, but
    // nothing of the listener's identity appears in it in clear.
    let replayed = first_record(config(&session));
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&replayed).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut len = [0u8; 2];
    s.read_exact(&mut len).unwrap();
    let mut second = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut second).unwrap();
    let me = session.process();
    let host = baton::ipc::tcp::HostId::current();
    for (what, needle) in [
        ("host id", &host.0[..]),
        ("boot id", &me.boot.0[..]),
        ("start time", &me.start_ticks.to_le_bytes()[..]),
    ] {
        assert!(
            !second.windows(needle.len()).any(|w| w == needle),
            "the {what} crossed in clear"
        );
    }
}

/// Finding 13: a connect to an address that drops SYNs (a listener whose accept queue is
/// full) fails with a `Timeout` within the handshake deadline, not after the kernel's
/// minutes of retries.
#[test]
fn a_connect_to_a_blackholed_address_times_out_within_the_handshake_deadline() {
    use rustix::net::{AddressFamily, SocketType};
    let hole = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    rustix::net::bind(&hole, &SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    rustix::net::listen(&hole, 0).unwrap();
    let addr = match rustix::net::getsockname(&hole).unwrap().try_into() {
        Ok(SocketAddr::V4(a)) => SocketAddr::V4(a),
        other => panic!("not an IPv4 address: {other:?}"),
    };
    // Fill the accept queue (never accepted): the kernel drops every later SYN.
    let _queued = TcpStream::connect(addr).unwrap();
    let session = Session::generate().unwrap();
    let cfg = config(&session).handshake_timeout(Duration::from_secs(1));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(HostLink::connect(addr, &cfg).map(|_| ()));
    });
    // Bounded generously: the kernel's SYN retries take about two minutes.
    let r = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the connect was still waiting 30 s on, past its 1 s deadline");
    assert!(
        matches!(
            r,
            Err(Error::Timeout {
                after,
                ..
            }) if after == Duration::from_secs(1)
        ),
        "{r:?}"
    );
}

/// Finding 8 (host links): a listener holds at most its cap of established links from one
/// key, and in all; beyond, the link is refused with a typed reason on both sides; a link
/// that ends gives its place back.
#[test]
fn established_host_links_are_capped_per_key_and_in_all() {
    let session = Session::generate().unwrap();
    let listener = HostListener::bind("127.0.0.1:0", config(&session).max_links(3, 2)).unwrap();
    let addr = listener.local_addr();
    let accept = || listener.accept_timeout(Duration::from_secs(10));
    let one = config(&session);
    let a1 = (HostLink::connect(addr, &one).unwrap(), accept().unwrap());
    let _a2 = (HostLink::connect(addr, &one).unwrap(), accept().unwrap());
    // A third link from the same key.
    let e = HostLink::connect(addr, &one).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Refused {
                reason: RefuseReason::TooManyLinks
            }
        ),
        "{e}"
    );
    let s = accept().unwrap_err();
    assert!(matches!(s, Error::TooManyHostLinks { limit: 2, .. }), "{s}");
    // Another key: one more fits, then the listener is full for every key.
    let _b1 = (
        HostLink::connect(addr, &config(&session)).unwrap(),
        accept().unwrap(),
    );
    let e = HostLink::connect(addr, &config(&session)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Refused {
                reason: RefuseReason::TooManyLinks
            }
        ),
        "{e}"
    );
    assert!(matches!(
        accept(),
        Err(Error::TooManyHostLinks { limit: 3, .. })
    ));
    // A link that ends gives its place back.
    drop(a1);
    let _a3 = (HostLink::connect(addr, &one).unwrap(), accept().unwrap());
}
