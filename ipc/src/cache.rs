//! [`ImportCache`]: each exported allocation is mapped once per process and shared.
//!
//! Keyed by (exporter, allocation, generation). A hit makes no driver call; the mapping is
//! closed when the last [`Imported`] guard of it drops. Opening and closing happen under
//! the cache's lock, so a mapping is never closed while the same allocation is being
//! reopened (CUDA returns the same address for a second open of a handle in one process,
//! and an unlucky interleaving would otherwise close the new user's mapping).
//!
//! The cache also remembers, per exporter allocation, the newest generation the exporter
//! said is [`Gone`](baton_messages::protocol::Gone): a handle of that generation or older
//! is refused as [`Error::StaleHandle`] without touching a driver.

use crate::backend::{MemPtr, OpenedMem, SharedBackend};
use crate::link::FrameFds;
use crate::session::Session;
use crate::{Error, Result};
use baton_messages::{
    AllocationId, BackendKind, ExporterId, Generation, HandleMsg, Layout, ProcessId, RawHandle,
};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

type Key = (ExporterId, AllocationId, Generation);

/// Counters of an [`ImportCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Opens served from a live mapping (no driver call).
    pub hits: u64,
    /// Opens that mapped memory (one driver-level open each).
    pub opens: u64,
    /// Mappings closed after their last user dropped.
    pub closes: u64,
    /// Handles refused as stale.
    pub stale: u64,
    /// Mappings open now.
    pub live: usize,
}

struct Entry {
    mem: Arc<OpenedMem>,
    users: usize,
}

struct State {
    entries: HashMap<Key, Entry>,
    /// Allocation ids are unique per process, so a process and an id name an allocation.
    retired: HashMap<(ProcessId, AllocationId), Generation>,
    stats: CacheStats,
}

struct Shared {
    session: Session,
    backends: Vec<SharedBackend>,
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the maps consistent (every mutation is a
        // single insert/remove), so a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The per-process import cache. Cheap to clone (shared).
#[derive(Clone)]
pub struct ImportCache {
    shared: Arc<Shared>,
}

impl fmt::Debug for ImportCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImportCache")
            .field("stats", &self.stats())
            .finish()
    }
}

impl ImportCache {
    /// A cache that opens handles with the first of `backends` that takes their kind.
    pub fn new(session: Session, backends: impl IntoIterator<Item = SharedBackend>) -> Self {
        Self {
            shared: Arc::new(Shared {
                session,
                backends: backends.into_iter().collect(),
                state: Mutex::new(State {
                    entries: HashMap::new(),
                    retired: HashMap::new(),
                    stats: CacheStats::default(),
                }),
            }),
        }
    }

    /// The session whose key checks handles.
    pub fn session(&self) -> &Session {
        &self.shared.session
    }

    /// Opens the buffer a handle names: checks the handle (digest, consistency, boot),
    /// refuses stale generations, then maps the allocation or reuses its live mapping.
    /// `fds` are the descriptors that came with the handle's frame.
    ///
    /// # Errors
    /// A check error, [`Error::StaleHandle`], [`Error::UnsupportedBackend`],
    /// [`Error::MissingFdSlot`], or the backend's open error. Nothing is opened on error.
    pub fn open(&self, handle: &HandleMsg, fds: &mut FrameFds) -> Result<Imported> {
        let checked = self.shared.session.check(handle)?;
        let key = (handle.exporter, handle.alloc, handle.generation);
        let mut state = self.shared.lock();
        if let Some(&retired) = state.retired.get(&(handle.exporter.process, handle.alloc)) {
            if handle.generation <= retired {
                state.stats.stale += 1;
                return Err(Error::StaleHandle {
                    alloc: handle.alloc,
                    generation: handle.generation,
                    retired,
                });
            }
        }
        let mem = if let Some(entry) = state.entries.get_mut(&key) {
            entry.users += 1;
            let mem = Arc::clone(&entry.mem);
            state.stats.hits += 1;
            mem
        } else {
            let backend = self.backend_for(handle.backend)?;
            let fd = match handle.raw {
                RawHandle::CudaVmmFd { slot } => Some(fds.take(slot)?),
                _ => None,
            };
            let opened = backend.open(checked, fd)?;
            if (opened.size() as u64) < handle.alloc_size {
                return Err(Error::SegmentTooSmall {
                    claimed: handle.alloc_size,
                    actual: opened.size() as u64,
                });
            }
            let mem = Arc::new(opened);
            state.entries.insert(
                key,
                Entry {
                    mem: Arc::clone(&mem),
                    users: 1,
                },
            );
            state.stats.opens += 1;
            tracing::debug!(exporter = %handle.exporter, alloc = %handle.alloc, gen = %handle.generation, "mapped");
            mem
        };
        drop(state);
        Ok(Imported {
            cache: Arc::clone(&self.shared),
            key,
            mem: Some(mem),
            offset: handle.offset as usize,
            len: handle.len as usize,
            layout: handle.layout.clone(),
        })
    }

    fn backend_for(&self, kind: BackendKind) -> Result<&SharedBackend> {
        self.shared
            .backends
            .iter()
            .find(|b| b.can_open(kind))
            .ok_or(Error::UnsupportedBackend { kind })
    }

    /// Records that the exporting process freed `alloc` up to `generation` (it said
    /// `Gone`): handles of those generations are refused from now on. Live mappings are
    /// untouched: their users' leases keep them valid until they drop.
    pub fn retire(&self, exporter: ProcessId, alloc: AllocationId, generation: Generation) {
        let mut state = self.shared.lock();
        let slot = state.retired.entry((exporter, alloc)).or_insert(generation);
        *slot = (*slot).max(generation);
    }

    /// Forgets what is recorded about a dead exporter process (its tombstones). Its live
    /// mappings stay until their guards drop.
    pub fn forget_process(&self, process: &ProcessId) {
        self.shared.lock().retired.retain(|(p, _), _| p != process);
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        let state = self.shared.lock();
        CacheStats {
            live: state.entries.len(),
            ..state.stats
        }
    }
}

/// One buffer opened through the [`ImportCache`]: a view of `len` bytes at `offset` of a
/// shared mapping. Dropping the last view of a mapping closes it.
pub struct Imported {
    cache: Arc<Shared>,
    key: Key,
    /// Always `Some` until `drop`, which takes it to release it under the cache lock.
    mem: Option<Arc<OpenedMem>>,
    offset: usize,
    len: usize,
    layout: Option<Layout>,
}

impl Imported {
    fn mem(&self) -> &OpenedMem {
        self.mem.as_ref().expect("present until drop")
    }

    /// Bytes in this buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never, for a valid handle).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element type and shape, for typed buffers.
    pub fn layout(&self) -> Option<&Layout> {
        self.layout.as_ref()
    }

    /// Who exported it.
    pub fn exporter(&self) -> ExporterId {
        self.key.0
    }

    /// The exported allocation.
    pub fn alloc(&self) -> AllocationId {
        self.key.1
    }

    /// Its generation.
    pub fn generation(&self) -> Generation {
        self.key.2
    }

    /// Where the buffer's first byte is.
    pub fn ptr(&self) -> MemPtr {
        self.mem().ptr().offset_by(self.offset)
    }

    /// The whole mapping this buffer is part of.
    pub fn mapping(&self) -> &OpenedMem {
        self.mem()
    }

    fn check(&self, offset: usize, len: usize) -> Result<usize> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.offset + offset),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies bytes from the buffer, starting `offset` bytes in.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or a backend error.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let at = self.check(offset, dst.len())?;
        self.mem().read(at, dst)
    }

    /// Copies bytes into the buffer, starting `offset` bytes in.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or a backend error.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let at = self.check(offset, src.len())?;
        self.mem().write(at, src)
    }

    /// The buffer's bytes, copied.
    ///
    /// # Errors
    /// A backend error.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len];
        self.read(0, &mut v)?;
        Ok(v)
    }
}

impl fmt::Debug for Imported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Imported")
            .field("exporter", &self.key.0)
            .field("alloc", &self.key.1)
            .field("gen", &self.key.2)
            .field("range", &format_args!("{}..+{}", self.offset, self.len))
            .finish()
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        let mut state = self.cache.lock();
        let Some(entry) = state.entries.get_mut(&self.key) else {
            return;
        };
        entry.users -= 1;
        if entry.users == 0 {
            let entry = state.entries.remove(&self.key).expect("present");
            state.stats.closes += 1;
            // Both references go while the lock is held, so the close cannot interleave
            // with a reopen of the same allocation.
            drop(self.mem.take());
            // The cache and the guards hold the only references (guards hand out
            // `&OpenedMem`, never the `Arc`), so this is the last one.
            if let Ok(mem) = Arc::try_unwrap(entry.mem) {
                if let Err(e) = mem.close() {
                    tracing::warn!(alloc = %self.key.1, error = %e, "closing an imported mapping failed");
                }
            }
        }
    }
}
