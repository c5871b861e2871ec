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
use futures_util::task::AtomicWaker;
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use tokio::sync::OwnedSemaphorePermit;

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

/// A link's queue of frames for its writer: one link queues, one writer drains.
///
/// A `VecDeque` that keeps its room, where tokio's unbounded channel allocated a block per
/// 32 frames (2 KiB, more than glibc serves from its per-size caches: each such block
/// also consolidated the allocator's fast bins, so the small allocations after it took the
/// slow path — 6 % of a pipelined consumer's instructions). It is bounded by what the link
/// counts as queued ([`LinkState`]'s bytes and calls), as the channel was; room beyond
/// [`FrameQueue::KEEP`] frames is given back once the queue empties.
pub(crate) fn frame_queue() -> (FrameQueue, FrameQueueReader) {
    let shared = Arc::new(QueueShared {
        queue: Mutex::new(Queue {
            frames: VecDeque::new(),
            link_gone: false,
            writer_gone: false,
        }),
        writer: AtomicWaker::new(),
    });
    (FrameQueue(Arc::clone(&shared)), FrameQueueReader(shared))
}

struct QueueShared {
    queue: Mutex<Queue>,
    /// The writer, waiting for a frame.
    writer: AtomicWaker,
}

struct Queue {
    frames: VecDeque<OutFrame>,
    /// The link dropped its end: once the frames are written, the writer ends.
    link_gone: bool,
    /// The writer ended: frames are refused.
    writer_gone: bool,
}

impl QueueShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // Nothing panics while the lock is held; a poisoned queue is still consistent.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The link's end of [`frame_queue`].
pub(crate) struct FrameQueue(Arc<QueueShared>);

impl FrameQueue {
    /// Frames of queued room kept once the queue empties (a pipelined burst of 256 calls
    /// and their releases).
    const KEEP: usize = 1024;

    /// Queues a frame for the writer; gives it back when the writer has ended.
    pub(crate) fn send(&self, frame: OutFrame) -> Result<(), OutFrame> {
        {
            let mut q = self.0.lock();
            if q.writer_gone {
                return Err(frame);
            }
            q.frames.push_back(frame);
        }
        self.0.writer.wake();
        Ok(())
    }
}

impl Drop for FrameQueue {
    fn drop(&mut self) {
        self.0.lock().link_gone = true;
        self.0.writer.wake();
    }
}

/// The writer's end of [`frame_queue`].
pub(crate) struct FrameQueueReader(Arc<QueueShared>);

impl FrameQueueReader {
    /// The next frame, without waiting.
    fn try_recv(&self) -> Option<OutFrame> {
        let mut q = self.0.lock();
        let frame = q.frames.pop_front();
        if q.frames.is_empty() && q.frames.capacity() > FrameQueue::KEEP {
            q.frames.shrink_to(FrameQueue::KEEP);
        }
        frame
    }

    /// The next frame; `None` once the link dropped its end and every frame is taken.
    async fn recv(&self) -> Option<OutFrame> {
        std::future::poll_fn(|cx| {
            if let Some(frame) = self.try_recv() {
                return Poll::Ready(Some(frame));
            }
            self.0.writer.register(cx.waker());
            // Again after registering: a frame queued in between woke no one.
            let mut q = self.0.lock();
            match q.frames.pop_front() {
                Some(frame) => Poll::Ready(Some(frame)),
                None if q.link_gone => Poll::Ready(None),
                None => Poll::Pending,
            }
        })
        .await
    }
}

impl Drop for FrameQueueReader {
    fn drop(&mut self) {
        // The frames left go now (their descriptors closed, their window shares given
        // back), not when the link drops its end.
        let left = {
            let mut q = self.0.lock();
            q.writer_gone = true;
            std::mem::take(&mut q.frames)
        };
        drop(left);
    }
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
        queue: FrameQueueReader,
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
                    Some(frame) if frame.fds.is_empty() => {
                        batch.extend_from_slice(&frame.bytes);
                        if frame.window.is_some() {
                            calls += frame.bytes.len();
                        }
                        windows.extend(frame.window);
                        state.frames.give(frame.bytes);
                    }
                    Some(frame) => {
                        next = Some(frame);
                        break;
                    }
                    None => break,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(byte: u8) -> OutFrame {
        OutFrame {
            bytes: vec![byte],
            fds: Vec::new(),
            window: None,
        }
    }

    #[tokio::test]
    async fn the_frame_queue_keeps_order_ends_after_the_link_and_refuses_past_the_writer() {
        let (link, writer) = frame_queue();
        for b in 0..3 {
            assert!(link.send(frame(b)).is_ok());
        }
        // The writer, waiting, is woken by the next frame.
        let waiting = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(f) = writer.recv().await {
                got.push(f.bytes[0]);
            }
            got
        });
        tokio::task::yield_now().await;
        assert!(link.send(frame(3)).is_ok());
        drop(link);
        // Every frame queued before the link dropped its end, in order, then the end.
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
            .await
            .expect("the writer saw the end")
            .unwrap();
        assert_eq!(got, [0, 1, 2, 3]);

        let (link, writer) = frame_queue();
        let fd = rustix::fs::memfd_create("baton-queue-test", rustix::fs::MemfdFlags::CLOEXEC)
            .expect("memfd");
        let mut queued = frame(9);
        queued.fds.push(fd);
        assert!(link.send(queued).is_ok());
        drop(writer);
        // The writer's end dropped its frames (their descriptors closed), and a frame
        // queued after is handed back.
        assert!(link.0.lock().frames.is_empty());
        assert_eq!(link.send(frame(4)).err().map(|f| f.bytes), Some(vec![4]));
    }

    #[test]
    fn the_frame_queue_gives_back_its_room_past_a_burst() {
        let (link, writer) = frame_queue();
        for _ in 0..FrameQueue::KEEP * 4 {
            assert!(link.send(frame(0)).is_ok());
        }
        assert!(link.0.lock().frames.capacity() >= FrameQueue::KEEP * 4);
        while writer.try_recv().is_some() {}
        assert!(link.0.lock().frames.capacity() <= FrameQueue::KEEP);
    }
}
