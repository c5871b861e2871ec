//! A fault-injecting TCP proxy for the cross-host tests: routes from addresses it listens on
//! to targets, forwarding bytes both ways until told to hold them. A *throttled* route
//! forwards, in all, at most the budget [`hold_after`](Proxy::hold_after) sets, then stops
//! reading (the sender's bytes stay in flight); [`partition`](Proxy::partition) stops every
//! route. Stopping never closes a socket: both ends stay open, as in a silent partition.
//! Dropped, it closes everything and joins its threads.

#![allow(dead_code)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    partitioned: AtomicBool,
    /// What throttled routes may still forward.
    budget: AtomicU64,
    /// What throttled routes have forwarded.
    forwarded: AtomicU64,
    sockets: Mutex<Vec<TcpStream>>,
}

/// See the [module docs](self).
pub struct Proxy {
    shared: Arc<Shared>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    /// A proxy with no routes; throttled routes forward without limit until
    /// [`hold_after`](Self::hold_after).
    pub fn new() -> Proxy {
        let shared = Shared::default();
        shared.budget.store(u64::MAX, Ordering::SeqCst);
        Proxy {
            shared: Arc::new(shared),
            threads: Arc::default(),
        }
    }

    /// Listens at `listen` (port 0: any) and forwards each connection to `target`;
    /// returns where it listens.
    pub fn route(&self, listen: SocketAddr, target: SocketAddr, throttled: bool) -> SocketAddr {
        let listener =
            TcpListener::bind(listen).unwrap_or_else(|e| panic!("binding {listen}: {e}"));
        listener.set_nonblocking(true).unwrap();
        let at = listener.local_addr().unwrap();
        let shared = Arc::clone(&self.shared);
        let threads = Arc::clone(&self.threads);
        let accept = std::thread::spawn(move || {
            while !shared.stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let Ok(server) = TcpStream::connect(target) else {
                            continue;
                        };
                        for (from, to) in [(&client, &server), (&server, &client)] {
                            let (from, to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
                            let shared2 = Arc::clone(&shared);
                            let pump =
                                std::thread::spawn(move || pump(&shared2, from, to, throttled));
                            threads.lock().unwrap().push(pump);
                        }
                        let mut sockets = shared.sockets.lock().unwrap();
                        sockets.push(client);
                        sockets.push(server);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        self.threads.lock().unwrap().push(accept);
        at
    }

    /// From now on, throttled routes forward at most `bytes` more in all, then hold.
    pub fn hold_after(&self, bytes: u64) {
        self.shared.budget.store(bytes, Ordering::SeqCst);
    }

    /// Every route stops forwarding (sockets stay open).
    pub fn partition(&self) {
        self.shared.partitioned.store(true, Ordering::SeqCst);
    }

    /// Bytes throttled routes have forwarded.
    pub fn forwarded(&self) -> u64 {
        self.shared.forwarded.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to` while allowed; at the end of `from`, shuts `to`'s write side.
fn pump(shared: &Shared, mut from: TcpStream, mut to: TcpStream, throttled: bool) {
    from.set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let mut room = buf.len();
        if throttled {
            room = room.min(shared.budget.load(Ordering::SeqCst) as usize);
        }
        if shared.partitioned.load(Ordering::SeqCst) || room == 0 {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        match from.read(&mut buf[..room]) {
            Ok(0) => {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => {
                if throttled {
                    let _ = shared
                        .budget
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
                            Some(b.saturating_sub(n as u64))
                        });
                    shared.forwarded.fetch_add(n as u64, Ordering::SeqCst);
                }
                if to.write_all(&buf[..n]).is_err() {
                    let _ = from.shutdown(Shutdown::Both);
                    return;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => {
                let _ = to.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for s in self.shared.sockets.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        let threads: Vec<_> = self.threads.lock().unwrap().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}
