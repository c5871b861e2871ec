//! Frames on a stream socket, with file descriptors out of band (`SCM_RIGHTS`).
//!
//! A sender attaches a frame's descriptors to the `sendmsg` that carries the frame's first
//! byte; the kernel delivers them with that byte, so by the time a frame's bytes have all
//! arrived its descriptors have too. The receiver queues descriptors in arrival order and
//! hands each frame as many as its header announces. Descriptors nobody announced, or more
//! than a frame may carry, are a protocol error.

use crate::{Error, Result};
use baton_messages::Message;
use baton_messages::codec::{FrameDecoder, MAX_FDS_PER_FRAME};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

/// How many bytes one receive asks for.
const RECV_CHUNK: usize = 64 * 1024;

/// The descriptors that came with one frame, by slot. Taking one leaves its slot empty;
/// whatever is not taken is closed on drop.
#[derive(Debug, Default)]
pub struct FrameFds {
    fds: Vec<Option<OwnedFd>>,
    /// The kernel could not give this process the frame's descriptors (it was at its
    /// descriptor limit): every slot reads as lost.
    lost: bool,
}

impl FrameFds {
    /// No descriptors.
    pub fn none() -> Self {
        Self::default()
    }

    /// Descriptors in slot order.
    pub fn new(fds: Vec<OwnedFd>) -> Self {
        Self {
            fds: fds.into_iter().map(Some).collect(),
            lost: false,
        }
    }

    /// A frame whose descriptors the kernel dropped on the way in (`MSG_CTRUNC`): taking
    /// any is [`Error::DescriptorsLost`].
    pub fn lost() -> Self {
        Self {
            fds: Vec::new(),
            lost: true,
        }
    }

    /// How many slots the frame carried.
    pub fn len(&self) -> usize {
        self.fds.len()
    }

    /// Whether the frame carried none.
    pub fn is_empty(&self) -> bool {
        self.fds.is_empty()
    }

    /// Takes the descriptor in `slot`.
    ///
    /// # Errors
    /// [`Error::DescriptorsLost`] if the kernel dropped the frame's descriptors;
    /// [`Error::MissingFdSlot`] if the frame had no such slot or it was taken already.
    pub fn take(&mut self, slot: u8) -> Result<OwnedFd> {
        if self.lost {
            return Err(Error::DescriptorsLost { slot });
        }
        self.fds
            .get_mut(usize::from(slot))
            .and_then(Option::take)
            .ok_or(Error::MissingFdSlot { slot })
    }
}

/// One received frame.
#[derive(Debug)]
pub struct Received {
    /// The message.
    pub message: Message,
    /// The descriptors that came with it.
    pub fds: FrameFds,
}

fn rustix_io(e: rustix::io::Errno) -> io::Error {
    e.into()
}

/// One `sendmsg` of `bytes`, with `fds` attached (pass them only with a frame's first
/// byte). Returns the bytes written; never raises `SIGPIPE`.
///
/// # Errors
/// The OS error (`WouldBlock` on a non-blocking socket that is full).
pub(crate) fn send_some(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_FRAME))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors for one frame",
        ));
    }
    probe!("sock.send");
    loop {
        match rustix::net::sendmsg(
            sock,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            other => {
                probe!("sock.sent");
                return other.map_err(rustix_io);
            }
        }
    }
}

/// Writes all of `bytes` on a blocking socket, `fds` with the first chunk.
///
/// # Errors
/// [`Error::Closed`] if the peer is gone, [`Error::Timeout`] past the socket's send
/// timeout, else [`Error::Io`].
pub(crate) fn send_all(
    sock: BorrowedFd<'_>,
    mut bytes: &[u8],
    mut fds: &[BorrowedFd<'_>],
) -> Result<()> {
    while !bytes.is_empty() {
        let n = send_some(sock, bytes, fds).map_err(|e| io_error("sending a frame", e))?;
        fds = &[];
        bytes = &bytes[n..];
    }
    Ok(())
}

/// Maps socket errors to the protocol's view: a reset or broken pipe is a closed link, a
/// timed-out blocking call is a timeout.
pub(crate) fn io_error(op: &'static str, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted => Error::Closed,
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout {
            op,
            after: std::time::Duration::ZERO,
        },
        _ => Error::Io { op, source: e },
    }
}

/// The receiving half's state: bytes not yet framed, descriptors not yet claimed.
#[derive(Debug, Default)]
pub(crate) struct Receiver {
    decoder: FrameDecoder,
    fds: VecDeque<OwnedFd>,
    /// The kernel dropped descriptors that did not fit (`MSG_CTRUNC`).
    fds_truncated: bool,
}

impl Receiver {
    /// The next complete frame with its descriptors, `Ok(None)` if more bytes are needed.
    pub(crate) fn next(&mut self) -> Result<Option<Received>> {
        let Some(frame) = self.decoder.next_frame()? else {
            return Ok(None);
        };
        probe!("frame.decoded", frame.message.kind());
        let need = usize::from(frame.header.nfds);
        if self.fds.len() < need && self.fds_truncated {
            // The kernel dropped descriptors it could not give us (our descriptor limit):
            // this frame's are gone. Our failure, not the peer's: the frame is delivered,
            // and whatever needs its descriptors fails on its own.
            self.fds.clear();
            self.fds_truncated = false;
            return Ok(Some(Received {
                message: frame.message,
                fds: FrameFds::lost(),
            }));
        }
        if self.fds.len() < need {
            return Err(Error::MissingFds {
                need,
                have: self.fds.len(),
            });
        }
        let fds = FrameFds::new(self.fds.drain(..need).collect());
        Ok(Some(Received {
            message: frame.message,
            fds,
        }))
    }

    /// One `recvmsg` into the buffer. Returns the bytes received; 0 means end of stream.
    ///
    /// # Errors
    /// The OS error (`WouldBlock` on a non-blocking socket with nothing to read).
    pub(crate) fn recv_some(&mut self, sock: BorrowedFd<'_>) -> io::Result<usize> {
        self.recv_drained(sock).map(|(n, _)| n)
    }

    /// As [`recv_some`](Self::recv_some), and whether the read drained the socket: it
    /// came back short of the space offered and brought no descriptors.
    ///
    /// On a Unix stream socket a read that copied something stops before the buffer is
    /// full only when the receive queue is empty, right after a message that carried
    /// descriptors (it hands those over and stops), or where the queue changes writer
    /// (another process's credentials) or meets an out-of-band mark. The second case is
    /// told by the descriptors that came, so it does not count as drained. The last two
    /// never happen between two Baton peers (one process writes each end, no `MSG_OOB`); a
    /// peer that does either only delays its own frames until its next one arrives (its
    /// heartbeat at the latest).
    ///
    /// # Errors
    /// As [`recv_some`](Self::recv_some).
    pub(crate) fn recv_drained(&mut self, sock: BorrowedFd<'_>) -> io::Result<(usize, bool)> {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_FRAME))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let (msg, offered) = loop {
            let spare = self.decoder.spare(RECV_CHUNK);
            let offered = spare.len();
            match rustix::net::recvmsg(
                sock,
                &mut [IoSliceMut::new(spare)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Err(rustix::io::Errno::INTR) => continue,
                other => break (other.map_err(rustix_io)?, offered),
            }
        };
        probe!("sock.read");
        self.decoder.commit(msg.bytes);
        let mut descriptors = false;
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = m {
                descriptors = true;
                self.fds.extend(fds);
            }
        }
        let truncated = msg.flags.contains(ReturnFlags::CTRUNC);
        self.fds_truncated |= truncated;
        let drained = msg.bytes < offered && !descriptors && !truncated;
        Ok((msg.bytes, drained))
    }

    /// Whether bytes of a frame not yet returned are buffered.
    pub(crate) fn has_bytes(&self) -> bool {
        self.decoder.finish().is_err()
    }

    /// After draining complete frames: descriptors left over beyond what one partial frame
    /// may carry were never announced, and more than one `sendmsg` may carry is abuse.
    pub(crate) fn check_fds(&self) -> Result<()> {
        if self.fds.len() > MAX_FDS_PER_FRAME {
            Err(Error::UnexpectedFds)
        } else {
            Ok(())
        }
    }

    /// A receive failed: a reset (the peer died with our bytes unread in its socket; the
    /// kernel then reports `ECONNRESET` instead of end of stream) ends the stream like an
    /// end of stream, so a frame it cut off is reported as truncated, not as a clean close.
    pub(crate) fn recv_error(&self, e: io::Error) -> Error {
        match io_error("receiving a frame", e) {
            Error::Closed => self.at_eof(),
            other => other,
        }
    }

    /// At end of stream: a cut-off frame is an error, a clean end is [`Error::Closed`].
    pub(crate) fn at_eof(&self) -> Error {
        match self.decoder.finish() {
            Ok(()) => Error::Closed,
            Err(e) => Error::Message(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_fds_say_how_many_came_and_whether_the_kernel_dropped_them() {
        let file = tempfile::tempfile().unwrap();
        let mut fds = FrameFds::new(vec![file.into()]);
        assert!(!fds.is_empty() && fds.len() == 1);
        assert!(fds.take(0).is_ok());
        assert!(matches!(fds.take(0), Err(Error::MissingFdSlot { slot: 0 })));
        let mut none = FrameFds::none();
        assert!(none.is_empty());
        assert!(matches!(
            none.take(0),
            Err(Error::MissingFdSlot { slot: 0 })
        ));
        let mut lost = FrameFds::lost();
        assert!(matches!(
            lost.take(3),
            Err(Error::DescriptorsLost { slot: 3 })
        ));
    }

    fn descriptors(n: usize) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| tempfile::tempfile().unwrap().into())
            .collect()
    }

    /// A frame that announces more descriptors than came is the peer's fault
    /// (`MissingFds`) — unless the kernel dropped some on the way in (our descriptor
    /// limit, `MSG_CTRUNC`): then the frame is delivered with its descriptors lost, and the
    /// next frame starts afresh.
    #[test]
    fn a_frame_short_of_descriptors_is_missing_them_unless_the_kernel_dropped_them() {
        let frame = baton_messages::codec::frame_bytes(&Message::Ping(1), 2).unwrap();
        let mut rx = Receiver::default();
        rx.decoder.push(&frame);
        rx.fds.extend(descriptors(1));
        assert!(matches!(
            rx.next(),
            Err(Error::MissingFds { need: 2, have: 1 })
        ));

        let mut rx = Receiver::default();
        rx.decoder.push(&frame);
        rx.fds.extend(descriptors(1));
        rx.fds_truncated = true;
        let mut got = rx.next().unwrap().expect("a frame");
        assert_eq!(got.message, Message::Ping(1));
        assert!(matches!(
            got.fds.take(0),
            Err(Error::DescriptorsLost { slot: 0 })
        ));
        assert!(rx.fds.is_empty() && !rx.fds_truncated);

        // Enough descriptors: the truncation was another frame's.
        let mut rx = Receiver::default();
        rx.decoder.push(&frame);
        rx.fds.extend(descriptors(2));
        rx.fds_truncated = true;
        let mut got = rx.next().unwrap().expect("a frame");
        assert!(got.fds.take(0).is_ok() && got.fds.take(1).is_ok());
    }

    /// Descriptors left over once the complete frames are drained: up to what one partial
    /// frame may carry is fine; more were never announced.
    #[test]
    fn more_unclaimed_descriptors_than_a_frame_carries_are_unexpected() {
        let mut rx = Receiver::default();
        rx.fds.extend(descriptors(MAX_FDS_PER_FRAME));
        assert!(rx.check_fds().is_ok());
        rx.fds.extend(descriptors(1));
        assert!(matches!(rx.check_fds(), Err(Error::UnexpectedFds)));
    }
}
