//! [`SlabArena`]: many buffers carved from one exported [`Allocation`], for any backend.
//!
//! Every buffer's handle names the slab's allocation and generation with the buffer's own
//! byte range ([`HandleBuilder::range`]), so an importer's [`ImportCache`](crate::ImportCache)
//! maps the slab on the first buffer and serves every later one from that mapping: a new
//! buffer costs no driver open.
//!
//! **Generations.** A handle's generation names the *backing memory* of its allocation,
//! and the import cache keys mappings by it. Carving a range again does not change the
//! backing, so it does not bump the slab's generation (that would make every importer map
//! the slab again). Instead each [`SlabBuffer`] has a [`SlabTicket`]: its range plus how
//! many times that offset has been carved, so the owner (the lease layer) can tell a
//! buffer from an earlier one at the same place.
//!
//! **Reuse.** Dropping a [`SlabBuffer`] returns its range at once. Importers may still use
//! the bytes, so drop a buffer only once its leases are released (the `BufferOwner`
//! defers that, as it defers any free).

use crate::backend::{Allocation, Backend, MemPtr};
use crate::session::Session;
use crate::{Error, HandleBuilder, Result};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, MutexGuard};

/// Where carved buffers start, unless told otherwise: the alignment `cuMemAlloc` gives.
pub const DEFAULT_ALIGN: usize = 256;

struct State {
    /// Free ranges, offset → length; adjacent ranges are always merged.
    free: BTreeMap<usize, usize>,
    /// Buffers carved now.
    live: usize,
    /// How many times each offset has been carved.
    carvings: HashMap<usize, u64>,
}

struct Inner {
    alloc: Allocation,
    align: usize,
    state: Mutex<State>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the free list consistent before it can panic
        // (only map operations), so a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One exported allocation that buffers are carved from. Cheap to clone (shared); the
/// allocation is freed when the arena and all its buffers are gone.
#[derive(Clone)]
pub struct SlabArena {
    inner: Arc<Inner>,
}

impl fmt::Debug for SlabArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlabArena")
            .field("alloc", &self.inner.alloc)
            .field("align", &self.inner.align)
            .field("live", &self.live_buffers())
            .field("free_bytes", &self.free_bytes())
            .finish()
    }
}

/// The identity of one carving: where, how long, and how many times that offset had been
/// carved before (0 for the first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlabTicket {
    /// Start inside the slab.
    pub offset: usize,
    /// Bytes asked for.
    pub len: usize,
    /// How many earlier buffers started at this offset.
    pub reuse: u64,
}

impl SlabArena {
    /// An arena over `alloc`, carving buffers that start at multiples of `align` (a power
    /// of two).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if `align` is not a power of two.
    pub fn new(alloc: Allocation, align: usize) -> Result<Self> {
        if !align.is_power_of_two() {
            return Err(Error::OutOfBounds {
                offset: 0,
                len: align,
                size: alloc.size(),
            });
        }
        let mut free = BTreeMap::new();
        free.insert(0, alloc.size());
        Ok(Self {
            inner: Arc::new(Inner {
                alloc,
                align,
                state: Mutex::new(State {
                    free,
                    live: 0,
                    carvings: HashMap::new(),
                }),
            }),
        })
    }

    /// Allocates a `size`-byte slab with `backend` and wraps it ([`DEFAULT_ALIGN`]).
    ///
    /// # Errors
    /// The backend's allocation error.
    pub fn allocate(backend: &dyn Backend, size: usize) -> Result<Self> {
        Self::new(backend.allocate(size)?, DEFAULT_ALIGN)
    }

    /// The slab's allocation (its id and generation are every buffer's).
    pub fn allocation(&self) -> &Allocation {
        &self.inner.alloc
    }

    /// Bytes not carved.
    pub fn free_bytes(&self) -> usize {
        self.inner.lock().free.values().sum()
    }

    /// Buffers carved now.
    pub fn live_buffers(&self) -> usize {
        self.inner.lock().live
    }

    /// Carves `len` bytes (first fit, at a multiple of the arena's alignment).
    ///
    /// # Errors
    /// [`Error::ZeroSize`]; [`Error::SlabFull`] if no free range fits.
    pub fn carve(&self, len: usize) -> Result<SlabBuffer> {
        if len == 0 {
            return Err(Error::ZeroSize);
        }
        let align = self.inner.align;
        let span = len
            .checked_add(align - 1)
            .map(|l| l / align * align)
            .ok_or(Error::SlabFull {
                requested: len,
                largest_free: 0,
            })?;
        let mut state = self.inner.lock();
        // Free ranges start at multiples of `align` (everything carved is a multiple of
        // it, and the slab starts at 0), so the first range long enough fits.
        let Some((&offset, &free_len)) = state.free.iter().find(|(_, l)| **l >= span) else {
            return Err(Error::SlabFull {
                requested: span,
                largest_free: state.free.values().copied().max().unwrap_or(0),
            });
        };
        state.free.remove(&offset);
        if free_len > span {
            state.free.insert(offset + span, free_len - span);
        }
        state.live += 1;
        let count = state.carvings.entry(offset).or_insert(0);
        let reuse = *count;
        *count += 1;
        drop(state);
        Ok(SlabBuffer {
            arena: Arc::clone(&self.inner),
            ticket: SlabTicket { offset, len, reuse },
            span,
        })
    }
}

/// One buffer carved from a [`SlabArena`]. Dropping it returns its range to the arena.
pub struct SlabBuffer {
    arena: Arc<Inner>,
    ticket: SlabTicket,
    /// Bytes reserved (`len` rounded up to the alignment).
    span: usize,
}

impl fmt::Debug for SlabBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlabBuffer")
            .field("alloc", &self.arena.alloc.id())
            .field("ticket", &self.ticket)
            .finish()
    }
}

impl SlabBuffer {
    /// Which carving this is.
    pub fn ticket(&self) -> SlabTicket {
        self.ticket
    }

    /// Start inside the slab.
    pub fn offset(&self) -> usize {
        self.ticket.offset
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.ticket.len
    }

    /// Whether the buffer is empty (never: carving zero bytes is refused).
    pub fn is_empty(&self) -> bool {
        self.ticket.len == 0
    }

    /// The slab's allocation.
    pub fn allocation(&self) -> &Allocation {
        &self.arena.alloc
    }

    /// Where the buffer's first byte is.
    pub fn ptr(&self) -> MemPtr {
        self.arena.alloc.ptr().offset_by(self.ticket.offset)
    }

    fn at(&self, offset: usize, len: usize) -> Result<usize> {
        match offset.checked_add(len) {
            Some(end) if end <= self.ticket.len => Ok(self.ticket.offset + offset),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                size: self.ticket.len,
            }),
        }
    }

    /// Copies bytes out of the buffer, from `offset` bytes in.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or a backend error.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.arena.alloc.read(self.at(offset, dst.len())?, dst)
    }

    /// Copies bytes into the buffer, from `offset` bytes in.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or a backend error.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.arena.alloc.write(self.at(offset, src.len())?, src)
    }

    /// Sets `len` bytes from `offset` to `byte`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or a backend error.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.arena.alloc.fill(self.at(offset, len)?, len, byte)
    }

    /// Starts a sealed handle for this buffer: the slab's allocation, this buffer's range.
    pub fn handle<'a>(&'a self, session: &'a Session) -> HandleBuilder<'a> {
        self.arena
            .alloc
            .handle(session)
            .range(self.ticket.offset as u64, self.ticket.len as u64)
    }

    /// The descriptor to send beside the handle's frame (VMM slabs), if any.
    pub fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        self.arena.alloc.export_fd()
    }
}

impl Drop for SlabBuffer {
    fn drop(&mut self) {
        let mut state = self.arena.lock();
        state.live -= 1;
        let mut start = self.ticket.offset;
        let mut len = self.span;
        // Merge with the free range just before…
        if let Some((&prev, &prev_len)) = state.free.range(..start).next_back() {
            if prev + prev_len == start {
                state.free.remove(&prev);
                start = prev;
                len += prev_len;
            }
        }
        // …and just after.
        if let Some(next_len) = state.free.remove(&(start + len)) {
            len += next_len;
        }
        state.free.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostBackend;
    use crate::{ImportCache, SharedBackend};
    use baton_messages::SessionToken;

    fn backend(tag: &str) -> Arc<HostBackend> {
        Arc::new(
            HostBackend::with_namespace(&format!("slab-{tag}-{}", std::process::id())).unwrap(),
        )
    }

    #[test]
    fn carves_aligned_ranges_and_merges_them_back() {
        let b = backend("carve");
        let arena = SlabArena::new(b.allocate(4096).unwrap(), 256).unwrap();
        let a = arena.carve(100).unwrap();
        let c = arena.carve(256).unwrap();
        let d = arena.carve(1000).unwrap();
        assert_eq!((a.offset(), c.offset(), d.offset()), (0, 256, 512));
        assert_eq!(arena.free_bytes(), 4096 - 256 - 256 - 1024);
        assert!(matches!(
            arena.carve(4096),
            Err(Error::SlabFull {
                requested: 4096,
                largest_free: 2560
            })
        ));
        drop(c);
        let e = arena.carve(200).unwrap();
        assert_eq!(e.offset(), 256, "first fit reuses the hole");
        assert_eq!(e.ticket().reuse, 1, "the offset was carved once before");
        drop((a, d, e));
        assert_eq!(arena.free_bytes(), 4096);
        assert_eq!(arena.live_buffers(), 0);
        assert_eq!(
            arena.carve(4096).unwrap().offset(),
            0,
            "all merged into one"
        );
        assert!(matches!(arena.carve(0), Err(Error::ZeroSize)));
        assert!(SlabArena::new(b.allocate(64).unwrap(), 3).is_err());
    }

    #[test]
    fn buffers_are_bounded_and_their_handles_share_one_mapping() {
        let b = backend("share");
        let session = Session::new(SessionToken::from_bytes([5; 32]));
        let arena = SlabArena::allocate(&*b, 1 << 16).unwrap();
        let bufs: Vec<SlabBuffer> = (0..3).map(|_| arena.carve(1000).unwrap()).collect();
        for (i, buf) in bufs.iter().enumerate() {
            buf.fill(0, 1000, i as u8 + 1).unwrap();
        }
        assert!(matches!(
            bufs[0].write(999, b"xy"),
            Err(Error::OutOfBounds { .. })
        ));
        let cache = ImportCache::new(session.clone(), [b.clone() as SharedBackend]);
        let mut fds = crate::FrameFds::none();
        let opened: Vec<_> = bufs
            .iter()
            .map(|buf| {
                let h = buf.handle(&session).build().unwrap();
                cache.open(&h, &mut fds).unwrap()
            })
            .collect();
        for (i, o) in opened.iter().enumerate() {
            assert_eq!(o.len(), 1000);
            assert_eq!(o.to_vec().unwrap(), vec![i as u8 + 1; 1000]);
        }
        let stats = cache.stats();
        assert_eq!((stats.opens, stats.hits, stats.live), (1, 2, 1));
        assert_eq!(b.opens(), 1, "one mapping of the slab");
    }
}
