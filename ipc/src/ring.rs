//! A shared-memory frame ring for one direction of a same-host link, with an adaptive
//! doorbell (issue 48, item 1), which an [`AsyncLink`](crate::AsyncLink) uses where its
//! [`LinkConfig::with_ring`](crate::LinkConfig::with_ring) asks for one.
//!
//! A crossing through a Unix socket costs a system call on each side and, when the reader
//! sleeps, the wakeup of a thread (the "socket floor" of `docs/BENCHMARKS.md`). A ring in
//! shared memory costs neither while its reader is polling: the writer copies the frame into
//! the mapping and publishes it with one store. The ring is single-producer,
//! single-consumer: one [`RingWriter`] in one process, one [`RingReader`] in another.
//!
//! # Layout
//!
//! A sealed `memfd` (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`, as the host backend's)
//! holds a header and, after it, a data area of `capacity` bytes (a power of two between
//! [`MIN_CAPACITY`] and [`MAX_CAPACITY`]). The header keeps a magic word, a version, the
//! capacity, a `closed` flag and, each on a cache line of its own, the two counters and the
//! two waiting flags:
//!
//! | word | written by | meaning |
//! |---|---|---|
//! | `head` | reader | bytes consumed since the ring was made |
//! | `tail` | writer | bytes published since the ring was made |
//! | `reader_sleeping` | reader (set, clear), writer (takes it) | ring the doorbell after a publish |
//! | `writer_waiting` | writer (set, clear), reader (takes it) | signal `space` after a consume |
//!
//! The counters only grow and are multiples of 8; a position in the data area is the
//! counter modulo the capacity. An entry is an 8-byte record header (`len: u32`,
//! `kind: u32`, little endian) and `len` bytes, padded to 8, always contiguous: an entry that
//! would straddle the end of the data area is preceded by a *wrap marker*, which tells the
//! reader to skip to position 0. Entries are frames, [`Entry::Socket`] markers (empty: "the
//! next frame is on the socket", where a frame carrying descriptors goes, so the order of
//! ring and socket is kept) and wrap markers. A frame holds at most [`RingReader::max_frame`]
//! = `capacity / 2 - 8` bytes, so that one always fits in an empty ring, wherever its tail is.
//!
//! Two `eventfd`s go with the memory: the *doorbell* (writer → a reader that announced it
//! sleeps) and *space* (reader → a writer waiting for room). [`RingReader::create`] makes all
//! three and hands the peer's copies out as [`RingFds`]; [`RingWriter::open`] takes them.
//!
//! # Ordering: no lost wakeup
//!
//! The doorbell is rung only when the reader asked for it, with the store-fence-load
//! (Dekker) pattern on both sides:
//!
//! - the writer copies the entry, stores `tail` (`Release`), issues a `SeqCst` fence, then
//!   loads `reader_sleeping`; set, it *takes* it (`swap(0)`) and writes 1 to the doorbell;
//! - the reader, before it blocks, stores `reader_sleeping = 1`, issues a `SeqCst` fence,
//!   then loads `tail` again ([`RingReader::prepare_to_sleep`]); a frame there, it clears
//!   the flag and does not block.
//!
//! The two fences are ordered one before the other, so at least one side sees the other's
//! store: either the reader finds the frame, or the writer finds the flag and rings. Taking
//! the flag (rather than reading it) rings once per sleep, not once per frame (the futex
//! variant of the issue-24 experiment also needs it: there, reading lost a wakeup); an
//! eventfd keeps its count, so a ring that lands before the reader blocks is not lost
//! either. A spurious ring (the reader found the frame on its own) costs one extra turn.
//! A writer may hold appends back ([`RingWriter::hold`]) and publish a batch with one store
//! of `tail` and at most one doorbell ([`RingWriter::publish`]); it publishes before it
//! waits for room, since the reader frees only what it saw. A link's writer publishes each
//! send's frames as one batch: rung frame by frame, a reader sharing the writer's only CPU
//! preempted it at each doorbell (`docs/BENCHMARKS.md`, "Rings").
//! `space` works the same way the other round, with `head` and `writer_waiting`.
//!
//! # Adaptive polling
//!
//! Sleeping costs the wakeup the ring is there to avoid, but polling costs a core and is
//! ruinous where the writer needs that core. [`PollWindow`] is how long a reader polls before
//! it sleeps, tuned by what it sees: a frame within the window keeps it, a miss halves it,
//! and from zero a short gap between frames makes it try twice that gap, up to 50 µs or what
//! [`POLL_ENV`] (`BATON_LINK_RING_POLL_US`) asks for. It is zero for good where the process has
//! fewer than two CPUs. [`RingReader::recv`] polls then blocks
//! (`poll(2)` on the doorbell); [`AsyncRingReader`] ([`park`]) does the same on a tokio
//! current-thread runtime: its [`before_park`] hook polls the thread's rings just before the
//! thread would sleep, so the reactor itself waits only on the doorbell.
//!
//! # The peer is not trusted
//!
//! Each side keeps its own copy of the capacity and of its own counter and only reads the
//! other's. Everything the peer writes is checked before it is used: the counters (aligned,
//! monotonic, never more than a ring apart), each record's kind, length and position (a
//! frame within `max_frame`, inside the published bytes, not straddling the end; wrap
//! markers and socket markers empty, a wrap marker not at position 0). A check that fails is
//! [`RingError::Corrupt`], for good (the ring is poisoned), never a panic or a read outside
//! the mapping. A record header is read once into a local and a frame is copied out before
//! anything uses it: the peer can change the shared bytes at any time, so nothing is read
//! twice. [`RingWriter::open`] checks the descriptors it is given (the memory sealed, its
//! size, magic, version and capacity; both bells eventfds) and refuses anything else with
//! [`RingError::NotARing`].
//!
//! A peer killed with SIGKILL runs no `Drop` and so never sets `closed`: the survivor sees
//! whole entries, then nothing (a wait ends at its deadline). Noticing a dead peer is the
//! link's job (its socket's end of file), as is dropping the ring it came with. The memory
//! has no name: nothing is left in `/dev/shm` whoever is killed; the kernel frees the pages
//! with their last descriptor or mapping.
//!
//! # The link integration
//!
//! Built (`link::ringed`, [`AsyncLink`](crate::AsyncLink); on by default):
//!
//! - A side whose [`LinkConfig::ring`](crate::LinkConfig::ring) is set (by
//!   [`LinkConfig::new`](crate::LinkConfig::new) unless `BATON_LINK_RING=0`, or by
//!   [`with_ring`](crate::LinkConfig::with_ring)) creates, right after the handshake, the
//!   ring it will read, and sends its [`RingFds`] over the authenticated Unix socket as
//!   descriptors beside a `RingOffer` frame. No capability bit: a peer accepts an offer
//!   whatever its own setting, so one side asking is enough for the direction towards it,
//!   and each direction has its own ring. Off on both sides, nothing on the wire changes.
//! - The peer checks the descriptors ([`RingWriter::open`]); anything else is logged at
//!   debug and the socket stays. Its next send announces the ring with `RingReady`, its
//!   last frame on the socket alone, and from then on frames without descriptors that fit
//!   go into the ring; a frame with descriptors, or above [`RingWriter::max_frame`], goes on
//!   the socket after a marker ([`RingWriter::try_send_marker`]), under the writers' lock,
//!   so no other clone's frame comes between. The offering reader reads the socket until
//!   `RingReady`, then the ring, and the socket only at [`Entry::Socket`], one frame each:
//!   order holds across the switch.
//! - The reader waits on the ring ([`AsyncRingReader`]) and the socket at once: socket
//!   bytes with no marker before them break the protocol; the socket's end of stream ends
//!   the link, also when the peer was killed without closing its ring.
//!   [`RingError::Corrupt`] ends it as the peer's fault.
//! - A full ring makes the writer wait for room on the `space` bell (announced with
//!   [`RingWriter::announce_waiting`]) until the link is closed or cut: the ring's capacity
//!   bounds what is in flight, nothing grows. The memfds are never named: nothing can
//!   remain in `/dev/shm` after any kill, and a link's ring ends close when it is closed
//!   (or a receive fails) or its halves drop ([`RingCloser`]).
//!
//! Limits:
//!
//! - A reader only polls on a runtime built with `on_thread_park(before_park)`: a node's
//!   links (`NodeConfig::ring` in `baton-actors`, or `BATON_LINK_RING`) poll when the node
//!   runs on `baton_actors::ring_polling_system` (or an arbiter on `ring_polling_runtime`);
//!   on any other runtime every frame costs a doorbell wakeup. (Python's runtime thread is
//!   built that way.) The hook polls in slices of [`park::SLICE`] and lets the runtime turn
//!   between them, so its timers, its other sockets and tasks woken from other threads wait
//!   at most a slice, not the window.
//! - The blocking [`Link`](crate::Link) stays on the socket: it offers no ring, and
//!   declines an offer itself (its caller never sees it; the peer keeps the socket).
//! - An offer a side does not take — descriptors that are no ring, no ring end left in its
//!   budget, a space bell it cannot register, a blocking `Link` — is answered with
//!   `RingDeclined` (before its next frame), and the offering side drops its ring at once
//!   rather than keeping it, unused, until the link closes.
//! - [`LinkConfig::new`](crate::LinkConfig::new) reads `BATON_LINK_RING`, so the variable
//!   (`0`) turns rings off for the actors' links too; on a system built without the park
//!   hook rings are correct, each frame a doorbell wakeup (about a socket crossing:
//!   `docs/BENCHMARKS.md`, the ring experiment).
//! - A process maps at most [`max_ends`] ring ends at once (`BATON_LINK_RINGS_MAX`, 64 by
//!   default): each end — a reader it created, a writer it opened — holds its mapping and
//!   two eventfds. Past that a link keeps the socket ([`RingError::TooMany`]), so memory and
//!   descriptors stay bounded however many links a process has.
//!
//! # Safety
//!
//! This module's `unsafe` code maps and unmaps the shared memory and reaches into it:
//! - a `RingMap` maps a memfd `MAP_SHARED` read-write with a null address hint (a fresh
//!   range the kernel picks) for exactly the file's size, after checking that the file is
//!   sealed against shrinking (or after sealing it itself): every page stays backed for the
//!   mapping's life, whatever the peer does. It is unmapped once, by its `Drop`, and no
//!   pointer into it outlives it (every user holds the map, or an `Arc` of it);
//! - the header is reached through a `&RingHeader` borrowed from the map: its fields are all
//!   atomics (and padding), which another process may change at any time as atomics
//!   allow, and any bit pattern is a valid value of each;
//! - the data area is reached only through `RingMap::read_data` and `RingMap::write_data`,
//!   which check their range against the data area's size and copy with raw pointers into
//!   or out of a local buffer, never forming a Rust reference to the shared bytes. A peer
//!   writing them at the same time yields torn bytes, never an invalid value: only `u8`s
//!   cross, and whatever is read is checked before it is used;
//! - [`park`] registers a duplicate of the doorbell with tokio's reactor
//!   (`AsyncFd::register_with_interest`): the `AsyncFd` owns that `OwnedFd`, so the
//!   descriptor stays open and the same for as long as it is registered.

mod budget;
pub mod park;
#[cfg(test)]
mod tests;
mod window;

pub use budget::{DEFAULT_MAX_ENDS, MAX_ENDS_ENV, live_ends, max_ends};
pub use park::{AsyncRingReader, before_park};
pub use window::{POLL_ENV, PollWindow};

use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::fs::{MemfdFlags, OFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

/// The smallest data area a ring may have: 4 KiB.
pub const MIN_CAPACITY: usize = 4 << 10;
/// The data area of a link's ring unless told otherwise: 256 KiB (frames up to 128 KiB - 8
/// go through it; a handoff's frame is about 250 bytes, so 256 of them in flight take a
/// quarter of it).
pub const DEFAULT_CAPACITY: usize = 256 << 10;
/// The largest data area a ring may have: 64 MiB.
pub const MAX_CAPACITY: usize = 64 << 20;

/// "batnring" as a little-endian word: the first word of every ring's memory.
const MAGIC: u64 = u64::from_le_bytes(*b"batnring");
/// The layout's version; a ring of another version is not opened.
const VERSION: u32 = 1;
/// Where the data area starts in the memfd (the header takes less; see the assert below).
const HEADER_SIZE: usize = 1024;
/// A record header: `len: u32`, `kind: u32`.
const RECORD: usize = 8;

const KIND_FRAME: u32 = 1;
const KIND_SOCKET: u32 = 2;
const KIND_WRAP: u32 = 3;

/// The seals a ring's memory must carry.
const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// What can go wrong with a ring.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    /// No room for the entry: the reader has not consumed enough yet.
    #[error("the ring is full: wait for the reader to consume, or apply the link's queue bound")]
    Full,
    /// The frame is larger than the ring can ever hold.
    #[error(
        "a frame of {len} bytes is larger than the ring's maximum of {max}: send it on the socket"
    )]
    TooLarge {
        /// The frame's length.
        len: usize,
        /// [`RingWriter::max_frame`].
        max: usize,
    },
    /// The other end dropped the ring (a reader: after every entry was read).
    #[error("the other end closed the ring")]
    Closed,
    /// The peer wrote something into the shared memory that no writer or reader of this
    /// module would: the ring is unusable for good.
    #[error("the peer corrupted the ring ({0}): drop it and the link it came with")]
    Corrupt(&'static str),
    /// The descriptors given to [`RingWriter::open`] are not a ring made by
    /// [`RingReader::create`] (unsealed or wrongly sized memory, a bad header, a bell that is
    /// not an eventfd).
    #[error("the descriptors are not a Baton ring: the peer sent something else")]
    NotARing,
    /// This process maps as many ring ends as it may ([`max_ends`]): the link keeps the
    /// socket.
    #[error(
        "this process maps {limit} ring ends already ({MAX_ENDS_ENV}): the link keeps the socket"
    )]
    TooMany {
        /// [`max_ends`].
        limit: usize,
    },
    /// A capacity that is not a power of two in `MIN_CAPACITY..=MAX_CAPACITY`.
    #[error(
        "ring capacity {0} is not a power of two between {MIN_CAPACITY} and {MAX_CAPACITY} bytes"
    )]
    BadCapacity(usize),
    /// A system call failed.
    #[error("ring system call failed: {0}")]
    Io(#[from] std::io::Error),
}

impl From<rustix::io::Errno> for RingError {
    fn from(e: rustix::io::Errno) -> Self {
        Self::Io(e.into())
    }
}

/// What [`RingReader::try_recv`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// A frame, whose `len` bytes were appended to the caller's buffer.
    Frame {
        /// The frame's length.
        len: usize,
    },
    /// A socket marker: the next frame is on the socket (it carries descriptors).
    Socket,
}

/// The descriptors of one ring, for the process that will write it: the memory and both
/// bells. Made by [`RingReader::create`], taken by [`RingWriter::open`]; in between they
/// travel to the peer (over the Unix link, as descriptors beside a frame).
#[derive(Debug)]
pub struct RingFds {
    /// The sealed memfd: header and data area.
    pub memory: OwnedFd,
    /// The eventfd the writer rings when the reader announced it sleeps.
    pub doorbell: OwnedFd,
    /// The eventfd the reader rings when the writer waits for room.
    pub space: OwnedFd,
}

/// A line of its own for each word both sides write (no false sharing between them).
#[repr(C, align(128))]
struct Line<T>(T);

/// The words both sides read and nobody writes after creation, but `closed`.
#[repr(C)]
struct Ident {
    magic: AtomicU64,
    capacity: AtomicU64,
    version: AtomicU32,
    closed: AtomicU32,
}

/// The start of a ring's memory (see "Layout" in the module docs).
#[repr(C)]
struct RingHeader {
    ident: Line<Ident>,
    head: Line<AtomicU64>,
    tail: Line<AtomicU64>,
    reader_sleeping: Line<AtomicU32>,
    writer_waiting: Line<AtomicU32>,
}

const _: () = assert!(size_of::<RingHeader>() <= HEADER_SIZE);
const _: () = assert!(align_of::<RingHeader>() <= 4096);

/// One `MAP_SHARED` read-write mapping of a ring's memfd; unmapped on drop. It holds a slot
/// of the process's budget of ring ends ([`max_ends`]) while it lives.
struct RingMap {
    base: NonNull<u8>,
    len: usize,
    _slot: budget::Slot,
}

// SAFETY: the base pointer points into a process-wide shared mapping that this value owns
// and unmaps once; the header is reached only through atomics and the data area only through
// bounds-checked raw copies (module overview), so moving the map to another thread is sound.
unsafe impl Send for RingMap {}
// SAFETY: `&RingMap` gives out `&RingHeader` (atomics only) and raw copies into and out of
// the data area, which other processes write concurrently anyway; no Rust reference to the
// data bytes is ever formed, so use from several threads at once adds no hazard.
unsafe impl Sync for RingMap {}

impl RingMap {
    /// Maps the first `len` bytes of `fd`, which the caller checked is a regular file sealed
    /// against shrinking and exactly `len` bytes long, with `len > HEADER_SIZE`.
    ///
    /// [`RingError::TooMany`] when the process's budget of ring ends is spent.
    fn map(fd: BorrowedFd<'_>, len: usize) -> Result<Self, RingError> {
        debug_assert!(len > HEADER_SIZE);
        let limit = max_ends();
        let slot = budget::ENDS
            .take(limit)
            .ok_or(RingError::TooMany { limit })?;
        // SAFETY: a null hint, so a fresh range the kernel picks, overlapping no Rust object;
        // `fd` is `len` bytes and sealed against shrinking (checked by both callers), so every
        // page stays backed; unmapped only by this value's `Drop` (module overview).
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        let base = NonNull::new(ptr.cast::<u8>()).ok_or(RingError::NotARing)?;
        Ok(Self {
            base,
            len,
            _slot: slot,
        })
    }

    fn header(&self) -> &RingHeader {
        // SAFETY: the mapping is at least `HEADER_SIZE >= size_of::<RingHeader>()` bytes and
        // page-aligned (more than `RingHeader`'s alignment); the header's fields are atomics
        // (and padding), valid for any bits and meant to be changed by other processes; the
        // reference borrows `self`, so it cannot outlive the mapping (module overview).
        unsafe { self.base.cast::<RingHeader>().as_ref() }
    }

    /// The data area's size.
    fn data_len(&self) -> usize {
        self.len - HEADER_SIZE
    }

    /// Copies `dst.len()` bytes from the data area at `at` into `dst`.
    ///
    /// # Panics
    ///
    /// If the range is not inside the data area (callers check first: a bug, never input).
    fn read_data(&self, at: usize, dst: &mut [u8]) {
        assert!(at <= self.data_len() && dst.len() <= self.data_len() - at);
        let src = self.base.as_ptr().wrapping_add(HEADER_SIZE + at);
        // SAFETY: `HEADER_SIZE + at + dst.len() <= len` (asserted above), inside the mapping,
        // which lives while `self` does; `dst` is a distinct local buffer, so the ranges do
        // not overlap. Only `u8`s are copied: a racing peer yields torn bytes (overview).
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
    }

    /// Copies `src` into the data area at `at`.
    ///
    /// # Panics
    ///
    /// As [`read_data`](Self::read_data).
    fn write_data(&self, at: usize, src: &[u8]) {
        assert!(at <= self.data_len() && src.len() <= self.data_len() - at);
        let dst = self.base.as_ptr().wrapping_add(HEADER_SIZE + at);
        // SAFETY: as in `read_data`, with the roles of the two ranges swapped; the mapping is
        // writable (`PROT_WRITE`).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    }

    fn is_closed(&self) -> bool {
        self.header().ident.0.closed.load(Ordering::Acquire) != 0
    }

    /// Whether a reader whose head is `head` has something to do: an entry, or a close.
    fn ready_after(&self, head: u64) -> bool {
        self.header().tail.0.load(Ordering::Acquire) != head || self.is_closed()
    }

    /// The reader's half of the doorbell protocol: flag, then fence (module docs).
    fn announce_sleep(&self) {
        self.header().reader_sleeping.0.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    fn woke(&self) {
        self.header().reader_sleeping.0.store(0, Ordering::Relaxed);
    }

    /// Marks the ring closed (both sides' `Drop`) and rings both bells, so that a wait on
    /// either ends.
    fn close(&self, doorbell: BorrowedFd<'_>, space: BorrowedFd<'_>) {
        self.header().ident.0.closed.store(1, Ordering::SeqCst);
        ring(doorbell);
        ring(space);
    }
}

impl Drop for RingMap {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is the range `map` mapped, unmapped only here, once; no
        // pointer into it outlives this value (module overview).
        let result = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
        if let Err(e) = result {
            tracing::warn!(error = %e, bytes = self.len, "munmap of a ring failed");
        }
    }
}

/// Writes 1 to an eventfd. A failure (only a count at its maximum, which only a peer writing
/// the eventfd itself can cause) is ignored: the peer then misses its own wakeups.
fn ring(bell: BorrowedFd<'_>) {
    let _ = rustix::io::write(bell, &1u64.to_ne_bytes());
}

/// Reads an eventfd's count back to zero; `true` if it was not zero. Never blocks: both
/// bells are non-blocking.
fn drain(bell: BorrowedFd<'_>) -> bool {
    let mut count = [0u8; 8];
    matches!(rustix::io::read(bell, &mut count), Ok(8))
}

/// Blocks in `poll(2)` until `bell` is readable or `until` passes (an interrupted call
/// returns early; callers loop).
fn wait_readable(bell: BorrowedFd<'_>, until: Instant) -> Result<(), RingError> {
    let left = until.saturating_duration_since(Instant::now());
    let timeout = Timespec {
        tv_sec: left.as_secs().try_into().unwrap_or(i64::MAX),
        tv_nsec: left.subsec_nanos().into(),
    };
    let mut fds = [PollFd::from_borrowed_fd(bell, PollFlags::IN)];
    match rustix::event::poll(&mut fds, Some(&timeout)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// An entry's size in the ring: its record header and its bytes, padded to 8.
fn entry_size(len: usize) -> usize {
    RECORD + len.next_multiple_of(8)
}

fn max_frame_of(capacity: usize) -> usize {
    capacity / 2 - RECORD
}

fn check_capacity(capacity: usize) -> Result<(), RingError> {
    if capacity.is_power_of_two() && (MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
        Ok(())
    } else {
        Err(RingError::BadCapacity(capacity))
    }
}

fn record(len: u32, kind: u32) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[..4].copy_from_slice(&len.to_le_bytes());
    r[4..].copy_from_slice(&kind.to_le_bytes());
    r
}

/// The reading end of a ring, in the process that created it.
pub struct RingReader {
    map: Arc<RingMap>,
    capacity: u64,
    /// Bytes consumed: ours, trusted (the shared `head` is its published copy).
    head: u64,
    /// The largest `tail` seen: a smaller one later is corruption.
    seen_tail: u64,
    doorbell: OwnedFd,
    space: OwnedFd,
    window: PollWindow,
    poisoned: Option<&'static str>,
}

impl fmt::Debug for RingReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingReader")
            .field("capacity", &self.capacity)
            .field("head", &self.head)
            .field("window", &self.window)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

impl RingReader {
    /// Creates a ring of `capacity` data bytes: a sealed memfd (`memfd_create`, `ftruncate`,
    /// `F_ADD_SEALS`) with its header written, and two non-blocking eventfds. Returns this
    /// process's reading end and the descriptors for the writer's process.
    ///
    /// `window` is how this reader polls before it sleeps: [`PollWindow::for_this_machine`]
    /// unless a test or a benchmark wants otherwise.
    ///
    /// # Errors
    ///
    /// [`RingError::BadCapacity`] for a capacity that is not a power of two in
    /// [`MIN_CAPACITY`]`..=`[`MAX_CAPACITY`]; [`RingError::Io`] when a system call fails.
    #[doc(alias = "memfd_create")]
    #[doc(alias = "eventfd")]
    pub fn create(capacity: usize, window: PollWindow) -> Result<(Self, RingFds), RingError> {
        check_capacity(capacity)?;
        let memory = rustix::fs::memfd_create(
            "baton.ring",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        let len = HEADER_SIZE + capacity;
        rustix::fs::ftruncate(&memory, len as u64)?;
        rustix::fs::fcntl_add_seals(&memory, SEALS)?;
        let map = RingMap::map(memory.as_fd(), len)?;
        let ident = &map.header().ident.0;
        ident.capacity.store(capacity as u64, Ordering::Relaxed);
        ident.version.store(VERSION, Ordering::Relaxed);
        ident.magic.store(MAGIC, Ordering::Release);
        let bell = || rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK);
        let (doorbell, space) = (bell()?, bell()?);
        let fds = RingFds {
            memory,
            doorbell: doorbell.try_clone()?,
            space: space.try_clone()?,
        };
        tracing::debug!(capacity, "ring created");
        let reader = Self {
            map: Arc::new(map),
            capacity: capacity as u64,
            head: 0,
            seen_tail: 0,
            doorbell,
            space,
            window,
            poisoned: None,
        };
        Ok((reader, fds))
    }

    /// The size of the data area.
    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// The largest frame this ring carries: `capacity / 2 - 8`.
    pub fn max_frame(&self) -> usize {
        max_frame_of(self.capacity())
    }

    /// How long this reader polls before it sleeps, as it stands.
    pub fn window(&self) -> PollWindow {
        self.window
    }

    fn window_mut(&mut self) -> &mut PollWindow {
        &mut self.window
    }

    /// The doorbell, for a caller that waits on it itself (an event loop): readable after
    /// the writer rang it, which it does only after [`announce_sleep`](Self::announce_sleep).
    /// Read it back to zero (8 bytes) before waiting on it again.
    pub fn doorbell_fd(&self) -> BorrowedFd<'_> {
        self.doorbell.as_fd()
    }

    /// Whether an entry is waiting (a hint: [`try_recv`](Self::try_recv) checks it).
    pub fn has_frame(&self) -> bool {
        self.map.header().tail.0.load(Ordering::Acquire) != self.head
    }

    /// Whether the writer dropped its end.
    pub fn is_closed(&self) -> bool {
        self.map.is_closed()
    }

    /// Tells the writer to ring the doorbell after its next publish: sets the sleeping flag,
    /// then a `SeqCst` fence. The caller must look at the ring again before it blocks (or
    /// use [`prepare_to_sleep`](Self::prepare_to_sleep), which does both).
    pub fn announce_sleep(&self) {
        self.map.announce_sleep();
    }

    /// Takes the announcement back (after waking, or on finding an entry after announcing).
    pub fn woke(&self) {
        self.map.woke();
    }

    /// [`announce_sleep`](Self::announce_sleep), then a look at the ring: `true` if the
    /// caller may block on the doorbell now (nothing came; a frame published from here on
    /// rings it), `false` if an entry or a close is already there (the flag is cleared).
    pub fn prepare_to_sleep(&self) -> bool {
        self.map.announce_sleep();
        if self.map.ready_after(self.head) {
            self.map.woke();
            false
        } else {
            true
        }
    }

    fn corrupt(&mut self, why: &'static str) -> RingError {
        poison(&mut self.poisoned, why, "writer")
    }

    /// Checks a `tail` the writer published against what this reader knows.
    fn check_tail(&mut self, tail: u64) -> Result<(), RingError> {
        if tail % 8 != 0 {
            return Err(self.corrupt("tail not a multiple of 8"));
        }
        if tail < self.seen_tail {
            return Err(self.corrupt("tail moved backwards"));
        }
        if tail - self.head > self.capacity {
            return Err(self.corrupt("tail more than a ring ahead of head"));
        }
        self.seen_tail = tail;
        Ok(())
    }

    /// Takes the next entry without waiting: a frame's bytes are appended to `out`.
    /// `Ok(None)`: nothing there yet.
    ///
    /// # Errors
    ///
    /// [`RingError::Closed`] once the writer dropped its end and every entry was read;
    /// [`RingError::Corrupt`] when the writer's words or records are impossible (and from
    /// then on).
    pub fn try_recv(&mut self, out: &mut Vec<u8>) -> Result<Option<Entry>, RingError> {
        if let Some(why) = self.poisoned {
            return Err(RingError::Corrupt(why));
        }
        let mut tail = self.map.header().tail.0.load(Ordering::Acquire);
        if tail < self.seen_tail {
            return Err(self.corrupt("tail moved backwards"));
        }
        if tail == self.head {
            if !self.map.is_closed() {
                return Ok(None);
            }
            // Closed after its last publish: look once more, then it is over.
            tail = self.map.header().tail.0.load(Ordering::Acquire);
            if tail == self.head {
                return Err(RingError::Closed);
            }
        }
        self.check_tail(tail)?;
        let (map, poisoned) = (&*self.map, &mut self.poisoned);
        let corrupt = |poisoned: &mut Option<&'static str>, why| poison(poisoned, why, "writer");
        let capacity = self.capacity as usize;
        let max_frame = max_frame_of(capacity);
        // Bytes to consume with this entry: a wrap marker's skip, then the entry.
        let mut skipped = 0usize;
        let (entry, size) = loop {
            let at = self.head + skipped as u64;
            let available = (tail - at) as usize;
            let idx = (at & (self.capacity - 1)) as usize;
            if available < RECORD {
                return Err(corrupt(poisoned, "tail inside a record header"));
            }
            // Read once: the writer could change it under us.
            let mut rec = [0u8; RECORD];
            map.read_data(idx, &mut rec);
            let len = u32::from_le_bytes([rec[0], rec[1], rec[2], rec[3]]) as usize;
            let kind = u32::from_le_bytes([rec[4], rec[5], rec[6], rec[7]]);
            match kind {
                KIND_WRAP => {
                    if skipped != 0 || idx == 0 {
                        return Err(corrupt(poisoned, "wrap marker at the start of the ring"));
                    }
                    if len != 0 {
                        return Err(corrupt(poisoned, "wrap marker with a length"));
                    }
                    let skip = capacity - idx;
                    if skip >= available {
                        return Err(corrupt(poisoned, "wrap marker with no entry after it"));
                    }
                    skipped = skip;
                }
                KIND_SOCKET => {
                    if len != 0 {
                        return Err(corrupt(poisoned, "socket marker with a length"));
                    }
                    break (Entry::Socket, RECORD);
                }
                KIND_FRAME => {
                    if len > max_frame {
                        return Err(corrupt(poisoned, "frame longer than the ring's maximum"));
                    }
                    let size = entry_size(len);
                    if size > available {
                        return Err(corrupt(poisoned, "frame runs past tail"));
                    }
                    if size > capacity - idx {
                        return Err(corrupt(poisoned, "frame straddles the end of the ring"));
                    }
                    let start = out.len();
                    out.resize(start + len, 0);
                    map.read_data(idx + RECORD, &mut out[start..]);
                    break (Entry::Frame { len }, size);
                }
                _ => return Err(corrupt(poisoned, "unknown entry kind")),
            }
        };
        self.consume(skipped + size);
        Ok(Some(entry))
    }

    /// Publishes `bytes` more consumed, and signals `space` if the writer waits for room.
    fn consume(&mut self, bytes: usize) {
        self.head += bytes as u64;
        let h = self.map.header();
        h.head.0.store(self.head, Ordering::Release);
        fence(Ordering::SeqCst);
        if h.writer_waiting.0.load(Ordering::Relaxed) != 0
            && h.writer_waiting.0.swap(0, Ordering::AcqRel) != 0
        {
            ring(self.space.as_fd());
        }
    }

    /// Waits for the next entry until `until`: polls the ring for the [`PollWindow`], then
    /// announces its sleep and blocks on the doorbell (`poll(2)`). `Ok(None)` at the
    /// deadline. Each frame's wait teaches the window.
    ///
    /// # Errors
    ///
    /// As [`try_recv`](Self::try_recv), and [`RingError::Io`] if `poll` fails.
    pub fn recv(&mut self, out: &mut Vec<u8>, until: Instant) -> Result<Option<Entry>, RingError> {
        let started = Instant::now();
        if let Some(e) = self.try_recv(out)? {
            self.window.observe(Duration::ZERO);
            return Ok(Some(e));
        }
        let spin_until = (started + self.window.current()).min(until);
        while !self.map.ready_after(self.head) && Instant::now() < spin_until {
            std::hint::spin_loop();
        }
        loop {
            if let Some(e) = self.try_recv(out)? {
                self.window.observe(started.elapsed());
                return Ok(Some(e));
            }
            if Instant::now() >= until {
                self.window.observe(started.elapsed());
                return Ok(None);
            }
            if self.prepare_to_sleep() {
                let waited = wait_readable(self.doorbell.as_fd(), until);
                drain(self.doorbell.as_fd());
                self.map.woke();
                waited?;
            }
        }
    }
}

impl Drop for RingReader {
    fn drop(&mut self) {
        self.map.close(self.doorbell.as_fd(), self.space.as_fd());
    }
}

impl RingReader {
    /// A handle that closes this ring from elsewhere (a link's closer), as dropping the
    /// reader does: the writer's next send fails with [`RingError::Closed`] and a writer
    /// waiting for room wakes.
    ///
    /// # Errors
    ///
    /// [`RingError::Io`] if the bells cannot be duplicated.
    pub fn closer(&self) -> Result<RingCloser, RingError> {
        Ok(RingCloser {
            map: Arc::clone(&self.map),
            doorbell: self.doorbell.try_clone()?,
            space: self.space.try_clone()?,
        })
    }
}

/// Closes a ring from elsewhere than its reader ([`RingReader::closer`]).
pub struct RingCloser {
    map: Arc<RingMap>,
    doorbell: OwnedFd,
    space: OwnedFd,
}

impl fmt::Debug for RingCloser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingCloser")
            .field("closed", &self.map.is_closed())
            .finish_non_exhaustive()
    }
}

impl RingCloser {
    /// Whether the ring holds an entry its reader has not taken yet: the published counters
    /// differ (a hint, from words the writer could forge; the reader checks every entry).
    pub fn has_entry(&self) -> bool {
        let h = self.map.header();
        h.tail.0.load(Ordering::Acquire) != h.head.0.load(Ordering::Acquire)
    }

    /// Marks the ring closed and rings both bells. Idempotent.
    pub fn close(&self) {
        self.map.close(self.doorbell.as_fd(), self.space.as_fd());
    }
}

/// The writing end of a ring, in the process that did not create it.
pub struct RingWriter {
    map: RingMap,
    capacity: u64,
    /// Bytes appended: ours, trusted.
    tail: u64,
    /// Bytes published (`tail` as the reader sees it): `tail` except while
    /// [`hold`](Self::hold) keeps appends back.
    published: u64,
    /// Appends wait for [`flush`](Self::flush) or [`publish`](Self::publish).
    held: bool,
    /// The largest `head` seen: a smaller one later is corruption.
    seen_head: u64,
    doorbell: OwnedFd,
    space: OwnedFd,
    poisoned: Option<&'static str>,
}

impl fmt::Debug for RingWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingWriter")
            .field("capacity", &self.capacity)
            .field("tail", &self.tail)
            .field("published", &self.published)
            .field("held", &self.held)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

/// Whether `fd` is an eventfd: `/proc/self/fd/N` names it `anon_inode:[eventfd]`.
fn is_eventfd(fd: BorrowedFd<'_>) -> Result<bool, RingError> {
    let link = rustix::fs::readlink(format!("/proc/self/fd/{}", fd.as_raw_fd()), Vec::new())?;
    Ok(link.as_bytes() == b"anon_inode:[eventfd]")
}

/// Checks that `bell` is an eventfd and makes it non-blocking (a peer's blocking eventfd
/// would make a drain block).
fn check_bell(bell: &OwnedFd, which: &'static str) -> Result<(), RingError> {
    if !is_eventfd(bell.as_fd())? {
        tracing::debug!(bell = which, "ring refused: a bell is not an eventfd");
        return Err(RingError::NotARing);
    }
    let flags = rustix::fs::fcntl_getfl(bell)?;
    if !flags.contains(OFlags::NONBLOCK) {
        rustix::fs::fcntl_setfl(bell, flags | OFlags::NONBLOCK)?;
    }
    Ok(())
}

/// Marks a ring unusable for good (`poisoned`) and says why, once, naming the side whose
/// words were impossible.
fn poison(poisoned: &mut Option<&'static str>, why: &'static str, by: &'static str) -> RingError {
    if poisoned.is_none() {
        tracing::warn!(reason = why, peer = by, "ring corrupted by its peer");
    }
    *poisoned = Some(why);
    RingError::Corrupt(why)
}

fn refuse(why: &'static str) -> RingError {
    tracing::debug!(reason = why, "ring refused");
    RingError::NotARing
}

impl RingWriter {
    /// Opens the writing end of a ring from the descriptors its reader's process sent,
    /// checking each: the memory a regular file sealed against any size change
    /// (`F_GET_SEALS`), its size (`fstat`) the header's capacity plus the header, the magic
    /// word, version and capacity right; both bells eventfds (`/proc/self/fd`).
    ///
    /// # Errors
    ///
    /// [`RingError::NotARing`] for anything else; [`RingError::Io`] when a system call
    /// fails.
    pub fn open(fds: RingFds) -> Result<Self, RingError> {
        let RingFds {
            memory,
            doorbell,
            space,
        } = fds;
        let seals = match rustix::fs::fcntl_get_seals(&memory) {
            Ok(seals) => seals,
            // Not a file that can be sealed (a pipe, a regular file on disk).
            Err(rustix::io::Errno::INVAL) => SealFlags::empty(),
            Err(e) => return Err(e.into()),
        };
        if !seals.contains(SEALS) {
            return Err(refuse("memory not sealed against size changes"));
        }
        if seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE) {
            return Err(refuse("memory sealed against writes"));
        }
        let stat = rustix::fs::fstat(&memory)?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(refuse("memory not a regular file"));
        }
        let len = usize::try_from(stat.st_size).unwrap_or(0);
        if !(HEADER_SIZE + MIN_CAPACITY..=HEADER_SIZE + MAX_CAPACITY).contains(&len) {
            return Err(refuse("memory of no ring's size"));
        }
        check_bell(&doorbell, "doorbell")?;
        check_bell(&space, "space")?;
        let map = RingMap::map(memory.as_fd(), len)?;
        let ident = &map.header().ident.0;
        if ident.magic.load(Ordering::Acquire) != MAGIC {
            return Err(refuse("bad magic"));
        }
        if ident.version.load(Ordering::Relaxed) != VERSION {
            return Err(refuse("another version"));
        }
        // Read once: the copy is ours from here on.
        let capacity = ident.capacity.load(Ordering::Relaxed);
        let capacity = usize::try_from(capacity).unwrap_or(0);
        if check_capacity(capacity).is_err() || HEADER_SIZE + capacity != len {
            return Err(refuse("capacity does not match the memory"));
        }
        let h = map.header();
        let (head, tail) = (
            h.head.0.load(Ordering::Acquire),
            h.tail.0.load(Ordering::Acquire),
        );
        if head != tail || tail % 8 != 0 {
            return Err(refuse("a ring already written"));
        }
        tracing::debug!(capacity, "ring opened for writing");
        Ok(Self {
            map,
            capacity: capacity as u64,
            tail,
            published: tail,
            held: false,
            seen_head: head,
            doorbell,
            space,
            poisoned: None,
        })
    }

    /// The size of the data area.
    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// The largest frame this ring carries: `capacity / 2 - 8`.
    pub fn max_frame(&self) -> usize {
        max_frame_of(self.capacity())
    }

    /// Whether the reader dropped its end.
    pub fn is_closed(&self) -> bool {
        self.map.is_closed()
    }

    /// The space bell, for a caller that waits for room itself (an event loop): readable
    /// after the reader made room, which it signals only after
    /// [`announce_waiting`](Self::announce_waiting). Read it back to zero (8 bytes) before
    /// waiting on it again.
    pub fn space_fd(&self) -> BorrowedFd<'_> {
        self.space.as_fd()
    }

    /// Tells the reader to signal `space` after its next consume: sets the waiting flag,
    /// then a `SeqCst` fence. The caller must try its send again before it blocks (module
    /// docs, "Ordering"), and call [`stop_waiting`](Self::stop_waiting) once it stops
    /// waiting.
    pub fn announce_waiting(&self) {
        self.map
            .header()
            .writer_waiting
            .0
            .store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Takes the announcement of [`announce_waiting`](Self::announce_waiting) back.
    pub fn stop_waiting(&self) {
        self.map
            .header()
            .writer_waiting
            .0
            .store(0, Ordering::Relaxed);
    }

    fn corrupt(&mut self, why: &'static str) -> RingError {
        poison(&mut self.poisoned, why, "reader")
    }

    /// The reader's published `head`, checked.
    fn head(&mut self) -> Result<u64, RingError> {
        let head = self.map.header().head.0.load(Ordering::Acquire);
        if head % 8 != 0 {
            return Err(self.corrupt("head not a multiple of 8"));
        }
        if head < self.seen_head {
            return Err(self.corrupt("head moved backwards"));
        }
        if head > self.published {
            return Err(self.corrupt("head passed tail"));
        }
        self.seen_head = head;
        Ok(head)
    }

    /// Appends a frame without waiting.
    ///
    /// # Errors
    ///
    /// [`RingError::TooLarge`] above [`max_frame`](Self::max_frame) (send it on the socket);
    /// [`RingError::Full`] when the reader has not made room yet; [`RingError::Closed`] once
    /// the reader dropped its end; [`RingError::Corrupt`] when the reader's `head` is
    /// impossible (and from then on).
    pub fn try_send(&mut self, frame: &[u8]) -> Result<(), RingError> {
        self.push(KIND_FRAME, frame)
    }

    /// Appends a socket marker: the next frame is on the socket (it carries descriptors).
    ///
    /// # Errors
    ///
    /// As [`try_send`](Self::try_send).
    pub fn try_send_marker(&mut self) -> Result<(), RingError> {
        self.push(KIND_SOCKET, &[])
    }

    fn push(&mut self, kind: u32, bytes: &[u8]) -> Result<(), RingError> {
        if let Some(why) = self.poisoned {
            return Err(RingError::Corrupt(why));
        }
        if self.map.is_closed() {
            return Err(RingError::Closed);
        }
        let max = self.max_frame();
        if bytes.len() > max {
            return Err(RingError::TooLarge {
                len: bytes.len(),
                max,
            });
        }
        let capacity = self.capacity as usize;
        let size = entry_size(bytes.len());
        let idx = (self.tail & (self.capacity - 1)) as usize;
        let to_end = capacity - idx;
        // An entry that ends exactly at the end fits: only a longer one wraps.
        let wraps = size > to_end;
        let total = if wraps { to_end + size } else { size };
        let head = self.head()?;
        let free = capacity - (self.tail - head) as usize;
        if total > free {
            return Err(RingError::Full);
        }
        let at = if wraps {
            self.map.write_data(idx, &record(0, KIND_WRAP));
            0
        } else {
            idx
        };
        self.map.write_data(at + RECORD, bytes);
        self.map.write_data(at, &record(bytes.len() as u32, kind));
        self.tail += total as u64;
        if !self.held {
            self.flush();
        }
        Ok(())
    }

    /// Holds later appends back from the reader until [`flush`](Self::flush) or
    /// [`publish`](Self::publish): a batch of frames becomes visible, and rings the
    /// doorbell, once. (One doorbell per frame makes a reader sharing the writer's only CPU
    /// preempt it frame after frame: `docs/BENCHMARKS.md`, "Rings".) A held append still
    /// takes room, and [`send`](Self::send) flushes before it waits for room.
    pub fn hold(&mut self) {
        self.held = true;
    }

    /// Whether appends are held back ([`hold`](Self::hold)): for the model test.
    #[cfg(test)]
    pub(crate) fn is_held(&self) -> bool {
        self.held
    }

    /// Publishes what was appended and not yet published (a store of `tail`), ringing the
    /// doorbell if the reader announced it sleeps; appends stay held if they were. Nothing
    /// to publish, it does nothing.
    pub fn flush(&mut self) {
        if self.published == self.tail {
            return;
        }
        self.published = self.tail;
        let h = self.map.header();
        h.tail.0.store(self.tail, Ordering::Release);
        fence(Ordering::SeqCst);
        if h.reader_sleeping.0.load(Ordering::Relaxed) != 0
            && h.reader_sleeping.0.swap(0, Ordering::AcqRel) != 0
        {
            ring(self.doorbell.as_fd());
        }
    }

    /// Ends a [`hold`](Self::hold): publishes what was appended, and publishes each later
    /// append at once.
    pub fn publish(&mut self) {
        self.held = false;
        self.flush();
    }

    /// Appends a frame, waiting for room until `until` (blocked in `poll(2)` on `space`
    /// after announcing it waits).
    ///
    /// # Errors
    ///
    /// [`RingError::Full`] at the deadline; otherwise as [`try_send`](Self::try_send), and
    /// [`RingError::Io`] if `poll` fails.
    pub fn send(&mut self, frame: &[u8], until: Instant) -> Result<(), RingError> {
        loop {
            match self.try_send(frame) {
                Err(RingError::Full) => {}
                other => return other,
            }
            if Instant::now() >= until {
                return Err(RingError::Full);
            }
            // The reader makes room only from what it sees.
            self.flush();
            let waiting = &self.map.header().writer_waiting.0;
            waiting.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            // Look again after announcing (module docs, "Ordering").
            match self.try_send(frame) {
                Err(RingError::Full) => {}
                other => {
                    self.map
                        .header()
                        .writer_waiting
                        .0
                        .store(0, Ordering::Relaxed);
                    return other;
                }
            }
            let waited = wait_readable(self.space.as_fd(), until);
            drain(self.space.as_fd());
            self.map
                .header()
                .writer_waiting
                .0
                .store(0, Ordering::Relaxed);
            waited?;
        }
    }
}

impl Drop for RingWriter {
    fn drop(&mut self) {
        self.map.close(self.doorbell.as_fd(), self.space.as_fd());
    }
}
