//! The fair, capped acceptor of host links and data connections, and the cap on
//! established host links.
//!
//! **Before authentication.** A connection costs a handshake slot (a thread, a socket) from
//! its accept until its handshake ends, at most the handshake deadline. Slots are capped in
//! total ([`TcpConfig::max_handshakes`](super::TcpConfig::max_handshakes)) and per source
//! ([`TcpConfig::max_handshakes_per_source`](super::TcpConfig::max_handshakes_per_source)):
//! a source is an IPv4 address, or an IPv6 /64 (one host is given a /64, so counting its
//! addresses one by one would cap nothing). A connection from a source at its cap is
//! closed at once. When every slot is taken, a newcomer is still admitted if some source
//! holds more slots than the newcomer's would then hold: that source's oldest handshake is
//! cut (its socket shut down) to make room. So one source, however fast it connects and
//! however long it stays silent, holds at most its own cap, and the sources that hold the
//! fewest slots are never the ones turned away. The acceptor itself drains the kernel's
//! queue at every wake-up, so an honest connection does not wait behind a flood there.
//!
//! **After authentication.** A [`HostListener`](super::HostListener) counts the host links
//! it established and that are still up ([`LinkPermit`]), in total
//! ([`TcpConfig::max_links`](super::TcpConfig::max_links)) and per authenticated static key
//! ([`TcpConfig::max_links_per_key`](super::TcpConfig::max_links_per_key)); beyond either,
//! the Noise handshake is refused before its last record is answered
//! ([`Error::TooManyHostLinks`] here, `Refused { TooManyLinks }` on the client's side).
//! A link that stops answering is cut by the actors' heartbeat, which gives its permit back.

use crate::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where a connection comes from, for the per-source caps: an IPv4 address (an
/// IPv4-mapped IPv6 one too), or an IPv6 /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    V4([u8; 4]),
    V6([u8; 8]),
}

impl Source {
    pub(crate) fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(v4) => Source::V4(v4.octets()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source::V4(v4.octets()),
                None => {
                    let mut prefix = [0u8; 8];
                    prefix.copy_from_slice(&v6.octets()[..8]);
                    Source::V6(prefix)
                }
            },
        }
    }
}

/// The caps of an acceptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    /// Handshakes in progress, in all.
    pub(crate) total: usize,
    /// Handshakes in progress from one source.
    pub(crate) per_source: usize,
}

/// The handshakes in progress, by source, oldest first; each with a handle on its socket
/// (to cut it if its source must make room).
#[derive(Debug, Default)]
struct Table {
    by_source: HashMap<Source, VecDeque<(u64, TcpStream)>>,
    total: usize,
    next: u64,
}

/// What [`Table::admit`] decided.
#[derive(Debug, PartialEq, Eq)]
enum Admission {
    /// Admitted, with this id.
    In(u64),
    /// The source is at its cap.
    SourceFull,
    /// Every slot is taken, by sources that hold no more than the newcomer would.
    Full,
}

impl Table {
    fn count(&self, source: &Source) -> usize {
        self.by_source.get(source).map_or(0, VecDeque::len)
    }

    /// Admits a connection from `source` under `caps`, cutting the oldest handshake of the
    /// source that holds the most slots if every slot is taken and that source holds more
    /// than the newcomer would.
    fn admit(&mut self, source: Source, stream: &TcpStream, caps: Caps) -> Admission {
        let mine = self.count(&source);
        if mine >= caps.per_source {
            return Admission::SourceFull;
        }
        if self.total >= caps.total {
            let heaviest = self
                .by_source
                .iter()
                .max_by_key(|(_, q)| q.len())
                .map(|(s, q)| (*s, q.len()));
            match heaviest {
                Some((victim, held)) if held > mine + 1 => {
                    let queue = self.by_source.get_mut(&victim).expect("a held source");
                    if let Some((_, cut)) = queue.pop_front() {
                        let _ = cut.shutdown(Shutdown::Both);
                        self.total -= 1;
                    }
                    if queue.is_empty() {
                        self.by_source.remove(&victim);
                    }
                    tracing::debug!("TCP handshakes at their cap: a heavier source's oldest cut");
                }
                _ => return Admission::Full,
            }
        }
        let Ok(handle) = stream.try_clone() else {
            return Admission::Full;
        };
        let id = self.next;
        self.next += 1;
        self.by_source
            .entry(source)
            .or_default()
            .push_back((id, handle));
        self.total += 1;
        Admission::In(id)
    }

    /// Gives back slot `id` of `source`, unless it was cut already.
    fn release(&mut self, source: &Source, id: u64) {
        if let Some(queue) = self.by_source.get_mut(source) {
            if let Some(at) = queue.iter().position(|(i, _)| *i == id) {
                queue.remove(at);
                self.total -= 1;
            }
            if queue.is_empty() {
                self.by_source.remove(source);
            }
        }
    }
}

/// A slot among the handshakes in progress, given back on drop.
#[derive(Debug)]
pub(crate) struct Slot {
    table: Arc<Mutex<Table>>,
    source: Source,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.table).release(&self.source, self.id);
    }
}

/// Accepts connections on `listener` until `stop`, each handed with its [`Slot`] to
/// `handle` on a thread of its own, under `caps` (see the module's docs): a connection
/// that gets no slot is closed at once. The handler gives its slot back (drops it) once
/// its handshake is done.
pub(crate) fn serve(
    listener: TcpListener,
    caps: Caps,
    stop: Arc<AtomicBool>,
    name: &'static str,
    handle: impl Fn(TcpStream, Slot) + Send + Sync + 'static,
) {
    let handle = Arc::new(handle);
    let table = Arc::new(Mutex::new(Table::default()));
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::warn!(error = %e, "a TCP listener cannot be made non-blocking");
        return;
    }
    let tick = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 50_000_000,
    };
    while !stop.load(Ordering::Relaxed) {
        let mut fds = [rustix::event::PollFd::new(
            &listener,
            rustix::event::PollFlags::IN,
        )];
        match rustix::event::poll(&mut fds, Some(&tick)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "a TCP listener failed");
                return;
            }
        }
        // Drain the kernel's queue: a flood must not leave honest connections in it.
        loop {
            let (stream, from) = match listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!(error = %e, "accept failed");
                    break;
                }
            };
            let source = Source::of(from.ip());
            let admitted = lock(&table).admit(source, &stream, caps);
            let id = match admitted {
                Admission::In(id) => id,
                Admission::SourceFull => {
                    tracing::debug!(%from, "TCP handshakes from this source at their cap: connection closed");
                    continue;
                }
                Admission::Full => {
                    tracing::debug!(%from, "TCP handshakes at their cap: connection closed");
                    continue;
                }
            };
            let slot = Slot {
                table: Arc::clone(&table),
                source,
                id,
            };
            if let Err(e) = stream.set_nonblocking(false) {
                tracing::debug!(error = %e, "an accepted connection cannot block");
                continue;
            }
            let handle = Arc::clone(&handle);
            let spawned = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || handle(stream, slot));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "no thread for a TCP handshake");
            }
        }
    }
}

/// The host links a listener established that are still up, in total and per key.
#[derive(Debug, Default)]
struct Held {
    total: usize,
    by_key: HashMap<[u8; 32], usize>,
}

/// The caps on a listener's established host links.
#[derive(Debug, Clone)]
pub(crate) struct LinkCaps {
    held: Arc<Mutex<Held>>,
    total: usize,
    per_key: usize,
}

impl LinkCaps {
    pub(crate) fn new(total: usize, per_key: usize) -> Self {
        Self {
            held: Arc::default(),
            total,
            per_key,
        }
    }

    /// A permit for one more link from `key`.
    ///
    /// # Errors
    /// [`Error::TooManyHostLinks`] if the listener holds its cap of links in total, or
    /// from that key.
    pub(crate) fn admit(&self, key: [u8; 32]) -> Result<LinkPermit> {
        let mut held = lock(&self.held);
        if held.total >= self.total {
            return Err(Error::TooManyHostLinks {
                limit: self.total,
                scope: "in all",
            });
        }
        let mine = held.by_key.entry(key).or_default();
        if *mine >= self.per_key {
            return Err(Error::TooManyHostLinks {
                limit: self.per_key,
                scope: "from this peer's key",
            });
        }
        *mine += 1;
        held.total += 1;
        Ok(LinkPermit {
            held: Arc::clone(&self.held),
            key,
        })
    }
}

/// One established host link counted against its listener's caps, until dropped (with the
/// link's last half).
#[derive(Debug)]
pub(crate) struct LinkPermit {
    held: Arc<Mutex<Held>>,
    key: [u8; 32],
}

impl Drop for LinkPermit {
    fn drop(&mut self) {
        let mut held = lock(&self.held);
        held.total = held.total.saturating_sub(1);
        if let Some(n) = held.by_key.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.by_key.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv6Addr;

    fn streams(n: usize) -> (TcpListener, Vec<TcpStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let v = (0..n)
            .map(|_| TcpStream::connect(l.local_addr().unwrap()).unwrap())
            .collect();
        (l, v)
    }

    #[test]
    fn sources_are_v4_addresses_and_v6_prefixes() {
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let mapped = IpAddr::V6(Ipv6Addr::from(0xffff_0a00_0001u128));
        assert_eq!(Source::of(a), Source::of(mapped));
        let x: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let y: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let z: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::of(x), Source::of(y));
        assert_ne!(Source::of(x), Source::of(z));
    }

    #[test]
    fn one_source_holds_its_cap_and_a_full_table_makes_room_from_the_heaviest() {
        let (_l, s) = streams(8);
        let caps = Caps {
            total: 4,
            per_source: 3,
        };
        let (flood, other, third) = (Source::V4([9; 4]), Source::V4([1; 4]), Source::V4([2; 4]));
        let mut t = Table::default();
        for s in &s[..3] {
            assert!(matches!(t.admit(flood, s, caps), Admission::In(_)));
        }
        assert_eq!(t.admit(flood, &s[3], caps), Admission::SourceFull);
        let Admission::In(first_other) = t.admit(other, &s[3], caps) else {
            panic!("a fresh source was turned away");
        };
        // Full: the flooder (3) holds more than a newcomer would (1): its oldest is cut.
        assert!(matches!(t.admit(third, &s[4], caps), Admission::In(_)));
        assert_eq!(t.count(&flood), 2);
        assert_eq!(t.total, 4);
        // The cut socket is shut down: its peer reads the end at once.
        let mut buf = [0u8; 1];
        assert!(matches!(
            std::io::Read::read(&mut &s[0], &mut buf),
            Ok(0) | Err(_)
        ));
        // Full, and nobody holds more than `other` would with a second slot (2): refused.
        assert_eq!(t.admit(other, &s[5], caps), Admission::Full);
        t.release(&other, first_other);
        assert_eq!(t.total, 3);
        assert!(matches!(t.admit(other, &s[5], caps), Admission::In(_)));
    }

    #[test]
    fn link_caps_count_per_key_and_in_all_and_permits_give_back() {
        let caps = LinkCaps::new(3, 2);
        let a = caps.admit([1; 32]).unwrap();
        let _b = caps.admit([1; 32]).unwrap();
        assert!(matches!(
            caps.admit([1; 32]),
            Err(Error::TooManyHostLinks { limit: 2, .. })
        ));
        let _c = caps.admit([2; 32]).unwrap();
        assert!(matches!(
            caps.admit([3; 32]),
            Err(Error::TooManyHostLinks { limit: 3, .. })
        ));
        drop(a);
        assert!(caps.admit([1; 32]).is_ok());
    }
}
