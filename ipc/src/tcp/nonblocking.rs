//! The asynchronous form of host links, on tokio: the reader, writer and closer halves of
//! the Unix [`AsyncLink`](crate::AsyncLink), over an established [`HostLink`].
//!
//! The handshakes run on tokio's blocking pool under their deadline (they are short, and
//! one blocking driver keeps one copy of them); the established link's halves are async.

use super::{HostLink, HostPeer, LinkPermit, Opener, Sealer, TcpConfig, io_error};
use crate::link::Received;
use crate::{Error, FrameFds, Result};
use baton_messages::Message;
use baton_messages::codec::{FrameDecoder, encode_frame};
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use tokio::net::TcpStream;

/// An established, authenticated host link driven by tokio. Split it into a reader and a
/// writer to receive and send from different tasks.
#[derive(Debug)]
pub struct AsyncHostLink {
    stream: Arc<TcpStream>,
    sealer: Sealer,
    opener: Opener,
    decoder: FrameDecoder,
    peer: HostPeer,
    /// Its place among its listener's established links, held by both halves.
    permit: Option<Arc<LinkPermit>>,
}

impl AsyncHostLink {
    /// Connects to a [`HostListener`](super::HostListener) at `addr` and completes both
    /// handshakes as the client (on the blocking pool, under the handshake deadline).
    ///
    /// # Errors
    /// As [`HostLink::connect`].
    pub async fn connect(addr: SocketAddr, config: &TcpConfig) -> Result<AsyncHostLink> {
        let config = config.clone();
        let link = tokio::task::spawn_blocking(move || HostLink::connect(addr, &config))
            .await
            .map_err(|e| Error::Io {
                op: "running a host link handshake",
                source: std::io::Error::other(e),
            })??;
        Self::from_blocking(link)
    }

    /// Drives an established blocking link (one a [`HostListener`](super::HostListener)
    /// accepted) on tokio. Call within a tokio runtime.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket cannot be registered with tokio.
    pub fn from_blocking(link: HostLink) -> Result<AsyncHostLink> {
        let (stream, sealer, opener, decoder, peer, permit) = link.into_parts();
        stream
            .set_nonblocking(true)
            .map_err(Error::io("making a host link non-blocking"))?;
        let stream = TcpStream::from_std(stream).map_err(Error::io("registering a host link"))?;
        Ok(AsyncHostLink {
            stream: Arc::new(stream),
            sealer,
            opener,
            decoder,
            peer,
            permit: permit.map(Arc::new),
        })
    }

    /// Who is at the other end.
    pub fn peer(&self) -> &HostPeer {
        &self.peer
    }

    /// A handle that shuts the socket down, whatever the halves are doing.
    pub fn closer(&self) -> HostLinkCloser {
        HostLinkCloser(Arc::clone(&self.stream))
    }

    /// Splits into a receiving and a sending half, usable from different tasks.
    pub fn into_split(self) -> (HostLinkReader, HostLinkWriter) {
        (
            HostLinkReader {
                stream: Arc::clone(&self.stream),
                opener: self.opener,
                decoder: self.decoder,
                _permit: self.permit.clone(),
            },
            HostLinkWriter {
                stream: self.stream,
                sealer: self.sealer,
                buf: Vec::with_capacity(512),
                wire: Vec::with_capacity(1024),
                _permit: self.permit,
            },
        )
    }
}

/// Shuts an [`AsyncHostLink`]'s socket down in both directions, whatever its reader and
/// writer are doing (as [`LinkCloser`](crate::LinkCloser)).
#[derive(Debug, Clone)]
pub struct HostLinkCloser(Arc<TcpStream>);

impl HostLinkCloser {
    /// Shuts the socket down. Idempotent.
    pub fn close(&self) {
        let _ = rustix::net::shutdown(self.0.as_fd(), rustix::net::Shutdown::Both);
    }

    /// Whether a receive would return at once: bytes are waiting, or the peer's end is
    /// closed, or the socket failed.
    pub fn readable_now(&self) -> bool {
        use rustix::net::RecvFlags;
        let mut byte = [0u8; 1];
        !matches!(
            rustix::net::recv(
                self.0.as_fd(),
                &mut byte,
                RecvFlags::PEEK | RecvFlags::DONTWAIT
            ),
            Err(rustix::io::Errno::AGAIN)
        )
    }
}

/// The receiving half of an [`AsyncHostLink`].
#[derive(Debug)]
pub struct HostLinkReader {
    stream: Arc<TcpStream>,
    opener: Opener,
    decoder: FrameDecoder,
    _permit: Option<Arc<LinkPermit>>,
}

impl HostLinkReader {
    /// Receives the next message (its [`FrameFds`] are always empty).
    ///
    /// # Errors
    /// As [`HostLink::recv`]; after an error, drop the link.
    pub async fn recv(&mut self) -> Result<Received> {
        loop {
            if let Some(message) = self.opener.next_message(&mut self.decoder)? {
                return Ok(Received {
                    message,
                    fds: FrameFds::none(),
                });
            }
            self.stream
                .readable()
                .await
                .map_err(|e| io_error("receiving a frame", e))?;
            match self.stream.try_read(self.opener.spare()) {
                Ok(0) => return Err(self.opener.at_eof(&self.decoder)),
                Ok(n) => self.opener.commit(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    return Err(match io_error("receiving a frame", e) {
                        Error::Closed => self.opener.at_eof(&self.decoder),
                        other => other,
                    });
                }
            }
        }
    }
}

/// The sending half of an [`AsyncHostLink`].
#[derive(Debug)]
pub struct HostLinkWriter {
    stream: Arc<TcpStream>,
    sealer: Sealer,
    buf: Vec<u8>,
    wire: Vec<u8>,
    _permit: Option<Arc<LinkPermit>>,
}

impl HostLinkWriter {
    /// Sends one message; `fds` must be empty (the signature is
    /// [`LinkWriter::send`](crate::LinkWriter::send)'s).
    ///
    /// # Errors
    /// [`Error::DescriptorsOverTcp`]; [`Error::Closed`] if the peer is gone; an encoding
    /// error.
    pub async fn send(&mut self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<()> {
        if !fds.is_empty() {
            return Err(Error::DescriptorsOverTcp { nfds: fds.len() });
        }
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        encode_frame(msg, 0, &mut buf)?;
        let r = self.send_encoded(&buf).await;
        self.buf = buf;
        r
    }

    /// Sends already encoded frames.
    ///
    /// # Errors
    /// [`Error::Closed`] if the peer is gone.
    pub async fn send_encoded(&mut self, frames: &[u8]) -> Result<()> {
        self.wire.clear();
        self.sealer.seal(frames, &mut self.wire)?;
        let mut bytes = &self.wire[..];
        while !bytes.is_empty() {
            self.stream
                .writable()
                .await
                .map_err(|e| io_error("sending a frame", e))?;
            match self.stream.try_write(bytes) {
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(io_error("sending a frame", e)),
            }
        }
        Ok(())
    }

    /// Shuts the socket down in both directions.
    pub fn shutdown(&self) {
        let _ = rustix::net::shutdown(self.stream.as_fd(), rustix::net::Shutdown::Both);
    }
}
