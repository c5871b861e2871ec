//! The two transports a [`PeerLink`](crate::link::PeerLink) runs over, behind one shape:
//! a Unix socket to a process on this host ([`AsyncLink`]) or a host link over TCP to one
//! on another host ([`AsyncHostLink`]). Both carry the same frames under the same bounds
//! and split the same way — a reader, a writer and a closer — so the link's code is one
//! path; only descriptors differ (a host link carries none: a frame with any is refused
//! before it is sent, and buffers cross hosts as copies, see `link/copy.rs`). The writer
//! drains the link's queue in batches ([`Writer::drain`]).

use crate::link_ref::LinkState;
use baton_ipc::tcp::{AsyncHostLink, HostLinkCloser, HostLinkReader, HostLinkWriter};
use baton_ipc::{AsyncLink, LinkCloser, LinkReader, LinkWriter, PeerInfo, Received, Via};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

/// An established link, before the link actor splits it.
#[derive(Debug)]
pub(crate) enum Transport {
    /// A Unix socket on this host.
    Unix(AsyncLink),
    /// A host link over TCP.
    Tcp(AsyncHostLink),
}

impl From<AsyncLink> for Transport {
    fn from(link: AsyncLink) -> Self {
        Transport::Unix(link)
    }
}

impl From<AsyncHostLink> for Transport {
    fn from(link: AsyncHostLink) -> Self {
        Transport::Tcp(link)
    }
}

impl Transport {
    /// Who is at the other end, and how it is reached.
    pub(crate) fn peer(&self) -> PeerInfo {
        match self {
            Transport::Unix(link) => *link.peer(),
            Transport::Tcp(link) => {
                let host = *link.peer();
                PeerInfo {
                    process: host.process,
                    via: Via::Tcp(host),
                }
            }
        }
    }

    /// Its closer, reader and writer.
    pub(crate) fn split(self) -> (Closer, Reader, Writer) {
        match self {
            Transport::Unix(link) => {
                let closer = Closer::Unix(link.closer());
                let (r, w) = link.into_split();
                (closer, Reader::Unix(r), Writer::Unix(w))
            }
            Transport::Tcp(link) => {
                let closer = Closer::Tcp(link.closer());
                let (r, w) = link.into_split();
                (closer, Reader::Tcp(r), Writer::Tcp(w))
            }
        }
    }
}

/// Shuts the link's socket down whatever its halves are doing.
#[derive(Debug, Clone)]
pub(crate) enum Closer {
    Unix(LinkCloser),
    Tcp(HostLinkCloser),
}

impl Closer {
    /// Shuts the socket down. Idempotent.
    pub(crate) fn close(&self) {
        match self {
            Closer::Unix(c) => c.close(),
            Closer::Tcp(c) => c.close(),
        }
    }

    /// Whether a receive would return at once (bytes waiting, end of stream, a failure).
    pub(crate) fn readable_now(&self) -> bool {
        match self {
            Closer::Unix(c) => c.readable_now(),
            Closer::Tcp(c) => c.readable_now(),
        }
    }
}

/// The receiving half.
#[derive(Debug)]
pub(crate) enum Reader {
    Unix(LinkReader),
    Tcp(HostLinkReader),
}

impl Reader {
    /// The next frame and its descriptors (none over TCP).
    pub(crate) async fn recv(&mut self) -> Result<Received, baton_ipc::Error> {
        match self {
            Reader::Unix(r) => r.recv().await,
            Reader::Tcp(r) => r.recv().await,
        }
    }

    /// Whether frames come through this side's shared-memory ring (never over TCP).
    pub(crate) fn uses_ring(&self) -> bool {
        matches!(self, Reader::Unix(r) if r.uses_ring())
    }
}

/// The sending half.
#[derive(Debug)]
pub(crate) enum Writer {
    Unix(LinkWriter),
    Tcp(HostLinkWriter),
}

impl Writer {
    /// Sends encoded frames, `fds` with the first byte.
    ///
    /// # Errors
    /// [`baton_ipc::Error::DescriptorsOverTcp`] for descriptors over a host link; the
    /// socket's failure.
    pub(crate) async fn send_encoded(
        &mut self,
        frames: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), baton_ipc::Error> {
        match self {
            Writer::Unix(w) => w.send_encoded(frames, fds).await,
            Writer::Tcp(_) if !fds.is_empty() => {
                Err(baton_ipc::Error::DescriptorsOverTcp { nfds: fds.len() })
            }
            Writer::Tcp(w) => w.send_encoded(frames).await,
        }
    }

    /// Whether frames go into the peer's shared-memory ring (never over TCP).
    pub(crate) fn uses_ring(&self) -> bool {
        matches!(self, Writer::Unix(w) if w.uses_ring())
    }

    /// Shuts the socket down in both directions.
    pub(crate) fn shutdown(&self) {
        match self {
            Writer::Unix(w) => w.shutdown(),
            Writer::Tcp(w) => w.shutdown(),
        }
    }
}

/// A frame queued for a link's writer ([`Writer::drain`]).
pub(crate) struct OutFrame {
    pub(crate) bytes: Vec<u8>,
    pub(crate) fds: Vec<OwnedFd>,
    /// For a call of ours: its share of the send window, given back once it is written.
    pub(crate) window: Option<OwnedSemaphorePermit>,
}

/// The most bytes of frames one `sendmsg` carries when frames are queued back to back.
const MAX_BATCH: usize = 64 * 1024;

impl Writer {
    /// Drains a link's outgoing queue onto the socket, until the link drops its sender or
    /// the socket fails (the error is returned). Frames queued behind the one being sent
    /// go out in the same `sendmsg` (one system call, one wakeup of the peer, instead of
    /// one per frame) — up to [`MAX_BATCH`] bytes, and never past a frame that carries
    /// descriptors: descriptors travel with their frame's first byte, so such a frame
    /// starts a new batch. What is written leaves `state`'s count of queued bytes, and
    /// calls' shares of the send window come back. The socket is shut down at the end:
    /// the peer sees the end of the stream, and the link's pending receive ends.
    pub(crate) async fn drain(
        mut self,
        mut queue: mpsc::UnboundedReceiver<OutFrame>,
        state: Arc<LinkState>,
    ) -> Option<baton_ipc::Error> {
        let mut batch: Vec<u8> = Vec::with_capacity(4096);
        let mut windows: Vec<OwnedSemaphorePermit> = Vec::new();
        let mut next: Option<OutFrame> = None;
        let failed = loop {
            let first = match next.take() {
                Some(frame) => frame,
                None => match queue.recv().await {
                    Some(frame) => frame,
                    None => break None,
                },
            };
            batch.clear();
            batch.extend_from_slice(&first.bytes);
            // Bytes of our calls in the batch.
            let mut calls = first.window.as_ref().map_or(0, |_| first.bytes.len());
            let OutFrame {
                bytes,
                fds: first_fds,
                window,
            } = first;
            state.frames.give(bytes);
            windows.extend(window);
            while batch.len() < MAX_BATCH {
                match queue.try_recv() {
                    Ok(frame) if frame.fds.is_empty() => {
                        batch.extend_from_slice(&frame.bytes);
                        if frame.window.is_some() {
                            calls += frame.bytes.len();
                        }
                        windows.extend(frame.window);
                        state.frames.give(frame.bytes);
                    }
                    Ok(frame) => {
                        next = Some(frame);
                        break;
                    }
                    Err(_) => break,
                }
            }
            let fds: Vec<BorrowedFd<'_>> = first_fds.iter().map(|fd| fd.as_fd()).collect();
            let sent = self.send_encoded(&batch, &fds).await;
            if self.uses_ring() && !state.writes_ring.load(Ordering::Relaxed) {
                state.writes_ring.store(true, Ordering::Relaxed);
            }
            state.queued.fetch_sub(batch.len(), Ordering::Relaxed);
            state.queued_calls.fetch_sub(calls, Ordering::Relaxed);
            // The calls' share of the window comes back: waiting senders may queue again.
            windows.clear();
            if let Err(e) = sent {
                break Some(e);
            }
        };
        self.shutdown();
        failed
    }
}
