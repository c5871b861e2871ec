//! A fault-injecting TCP proxy for tests: forwards both ways, and from the connecting
//! side may flip one byte or stop forwarding (holding both ends open: a silent peer).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Which byte from the connecting side to flip.
#[derive(Debug, Clone)]
pub(crate) enum Flip {
    /// None.
    Never,
    /// The byte at this offset of the stream.
    At(usize),
    /// The 7th byte of the first chunk read once the flag is set (it is cleared then).
    WhenArmed(Arc<AtomicBool>),
}

/// Proxies one connection to `to`; returns the address to connect to instead, and the
/// count of bytes forwarded from the connecting side. After `stall_after` bytes from the
/// connecting side, forwards nothing more: both ends stay open (what comes in is read
/// and dropped) until the connecting side closes, then the other end is closed too.
pub(crate) fn proxy(
    to: SocketAddr,
    flip: Flip,
    stall_after: Option<usize>,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let front = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = front.local_addr().unwrap();
    let forwarded = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&forwarded);
    std::thread::spawn(move || {
        let (client, _) = front.accept().unwrap();
        let server = TcpStream::connect(to).unwrap();
        let (mut c_r, mut s_w) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let (mut s_r, mut c_w) = (server, client);
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut s_r, &mut c_w);
            let _ = c_w.shutdown(Shutdown::Both);
        });
        let mut buf = vec![0u8; 1 << 16];
        let mut seen = 0usize;
        loop {
            let n = match c_r.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            match &flip {
                Flip::At(at) if (seen..seen + n).contains(at) => buf[at - seen] ^= 0x01,
                Flip::WhenArmed(armed) if n > 8 && armed.swap(false, Ordering::SeqCst) => {
                    buf[6] ^= 0x20;
                }
                _ => {}
            }
            if let Some(limit) = stall_after.filter(|limit| seen + n >= *limit) {
                let _ = s_w.write_all(&buf[..limit - seen]);
                count.store(limit, Ordering::SeqCst);
                while matches!(c_r.read(&mut buf), Ok(n) if n > 0) {}
                break;
            }
            if s_w.write_all(&buf[..n]).is_err() {
                break;
            }
            seen += n;
            count.store(seen, Ordering::SeqCst);
        }
        let _ = s_w.shutdown(Shutdown::Both);
    });
    (addr, forwarded)
}
