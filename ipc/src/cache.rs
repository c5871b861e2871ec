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
    AllocationId, BackendKind, ExporterId, Generation, HandleMsg, Layout, ProcessId,
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
    /// The last handle whose digest verified for this mapping. A handle equal to it, byte
    /// for byte, would verify the same way: a hit with it skips the keyed hash (the
    /// common case: an exporter re-sharing the same buffer).
    verified: HandleMsg,
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
    /// refuses stale generations, then maps the allocation or reuses its live mapping, and
    /// finally, if the handle carries an event, has the backend wait on it
    /// ([`Backend::wait_event`](crate::Backend::wait_event)) so that the buffer is used only
    /// after the exporter's work that produced it.
    /// `fds` are the descriptors that came with the handle's frame.
    ///
    /// # Errors
    /// A check error, [`Error::StaleHandle`], [`Error::UnsupportedBackend`],
    /// [`Error::MissingFdSlot`], [`Error::MemoryTooSmall`] (also on a hit, when the handle
    /// claims more than the live mapping holds), or the backend's open error. Nothing is
    /// opened on error.
    pub fn open(&self, handle: &HandleMsg, fds: &mut FrameFds) -> Result<Imported> {
        let key = (handle.exporter, handle.alloc, handle.generation);
        let known = self
            .shared
            .lock()
            .entries
            .get(&key)
            .is_some_and(|e| e.verified == *handle);
        let mut checked = if known {
            None
        } else {
            Some(self.shared.session.check(handle)?)
        };
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
            // A hit maps nothing new, but this handle may claim more than the mapping
            // holds (a confused or lying exporter): its view must stay inside it, as a
            // miss checks against the memory it opens.
            if (entry.mem.size() as u64) < handle.alloc_size {
                return Err(Error::MemoryTooSmall {
                    claimed: handle.alloc_size,
                    actual: entry.mem.size() as u64,
                });
            }
            entry.users += 1;
            if checked.is_some() {
                entry.verified = handle.clone();
            }
            let mem = Arc::clone(&entry.mem);
            state.stats.hits += 1;
            mem
        } else {
            // The entry seen a moment ago may have closed since: check now if we skipped.
            let checked = match checked.take() {
                Some(c) => c,
                None => self.shared.session.check(handle)?,
            };
            let backend = self.backend_for(handle.backend)?;
            let fd = match handle.raw.fd_slot() {
                Some(slot) => Some(fds.take(slot)?),
                None => None,
            };
            let opened = backend.open(checked, fd)?;
            if (opened.size() as u64) < handle.alloc_size {
                return Err(Error::MemoryTooSmall {
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
                    verified: handle.clone(),
                },
            );
            state.stats.opens += 1;
            tracing::debug!(exporter = %handle.exporter, alloc = %handle.alloc, gen = %handle.generation, "mapped");
            mem
        };
        drop(state);
        let imported = Imported {
            cache: Arc::clone(&self.shared),
            key,
            mem: Some(mem),
            offset: handle.offset as usize,
            len: handle.len as usize,
            layout: handle.layout.clone(),
        };
        if let Some(event) = &handle.event {
            // On a hit too: this handle's data may come from newer work on the same memory.
            // On error `imported` drops, giving its reference back.
            self.backend_for(handle.backend)?
                .wait_event(&handle.exporter, event)?;
        }
        Ok(imported)
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
        for backend in &self.shared.backends {
            backend.forget_process(process);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Allocation, Backend, ExportableMemory, RawMemory};
    use crate::session::CheckedHandle;
    use baton_messages::{
        CudaIpcMemHandle, DeviceUuid, Error as MessageError, IpcEventHandle, RawHandle,
        SessionToken,
    };
    use std::os::fd::OwnedFd;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Plain bytes standing in for device memory.
    #[derive(Debug, Clone)]
    struct Bytes(Arc<Mutex<Vec<u8>>>);

    impl RawMemory for Bytes {
        fn size(&self) -> usize {
            self.0.lock().unwrap().len()
        }
        fn ptr(&self) -> MemPtr {
            MemPtr::Device(0x1000)
        }
        fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
            dst.copy_from_slice(&self.0.lock().unwrap()[offset..offset + dst.len()]);
            Ok(())
        }
        fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
            self.0.lock().unwrap()[offset..offset + src.len()].copy_from_slice(src);
            Ok(())
        }
        fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
            self.0.lock().unwrap()[offset..offset + len].fill(byte);
            Ok(())
        }
    }

    impl ExportableMemory for Bytes {
        fn free_while_mapped(&self) -> crate::FreeWhileMapped {
            crate::FreeWhileMapped::Unsafe
        }
        fn raw_handle(&self, _fd_slot: Option<u8>) -> Result<RawHandle> {
            Ok(RawHandle::CudaIpc(CudaIpcMemHandle([7; 64])))
        }
    }

    /// A backend shaped like CUDA legacy IPC (handles carry events) that counts its calls.
    #[derive(Debug, Default)]
    struct EventBackend {
        mem: Mutex<Option<Bytes>>,
        opens: AtomicU64,
        waits: AtomicU64,
        forgotten: AtomicU64,
    }

    impl Backend for EventBackend {
        fn name(&self) -> &'static str {
            "fake-cuda"
        }
        fn kind(&self) -> BackendKind {
            BackendKind::CudaLegacy
        }
        fn device(&self) -> DeviceUuid {
            DeviceUuid([1; 16])
        }
        fn allocate(&self, size: usize) -> Result<Allocation> {
            let bytes = Bytes(Arc::new(Mutex::new(vec![0; size])));
            *self.mem.lock().unwrap() = Some(bytes.clone());
            Ok(Allocation::new(self.kind(), self.device(), Box::new(bytes)))
        }
        fn open(&self, handle: CheckedHandle<'_>, _fd: Option<OwnedFd>) -> Result<OpenedMem> {
            self.opens.fetch_add(1, Ordering::Relaxed);
            let bytes = self.mem.lock().unwrap().clone().expect("allocated");
            Ok(OpenedMem::new(&handle, Box::new(bytes)))
        }
        fn wait_event(&self, _exporter: &ExporterId, _event: &IpcEventHandle) -> Result<()> {
            self.waits.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn forget_process(&self, _process: &ProcessId) {
            self.forgotten.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn events_are_waited_on_for_misses_and_hits_and_bad_handles_reach_no_backend() {
        let session = Session::new(SessionToken::from_bytes([8; 32]));
        let backend = Arc::new(EventBackend::default());
        let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
        let alloc = backend.allocate(4096).unwrap();
        alloc.fill(0, 4096, 0x42).unwrap();
        let event = IpcEventHandle([9; 64]);
        let handle = alloc.handle(&session).event(event).build().unwrap();
        let mut fds = FrameFds::none();

        // One corrupted byte of the raw handle: refused before any backend call.
        let mut bad = handle.clone();
        let RawHandle::CudaIpc(raw) = &mut bad.raw else {
            unreachable!()
        };
        raw.0[17] ^= 0x01;
        assert!(matches!(
            cache.open(&bad, &mut fds),
            Err(Error::Message(MessageError::DigestMismatch))
        ));
        // Sealed under another token: refused too.
        let other = Session::new(SessionToken::from_bytes([9; 32]));
        let foreign = alloc.handle(&other).build().unwrap();
        assert!(cache.open(&foreign, &mut fds).is_err());
        assert_eq!(backend.opens.load(Ordering::Relaxed), 0);
        assert_eq!(backend.waits.load(Ordering::Relaxed), 0);

        let first = cache.open(&handle, &mut fds).unwrap();
        let second = cache.open(&handle, &mut fds).unwrap();
        assert_eq!(first.to_vec().unwrap(), vec![0x42; 4096]);
        assert_eq!(
            backend.opens.load(Ordering::Relaxed),
            1,
            "the hit made no open"
        );
        assert_eq!(
            backend.waits.load(Ordering::Relaxed),
            2,
            "the event was waited on for the miss and for the hit"
        );
        let stats = cache.stats();
        assert_eq!((stats.opens, stats.hits, stats.live), (1, 1, 1));
        drop((first, second));
        assert_eq!(cache.stats().live, 0);

        // A handle without an event waits on nothing.
        let plain = alloc.handle(&session).build().unwrap();
        drop(cache.open(&plain, &mut fds).unwrap());
        assert_eq!(backend.waits.load(Ordering::Relaxed), 2);

        cache.forget_process(&session.process());
        assert_eq!(backend.forgotten.load(Ordering::Relaxed), 1);
    }

    /// What the counters, the views and the tombstones promise, case by case (written
    /// against the mutants `cargo mutants --file ipc/src/cache.rs` found unchecked).
    #[test]
    fn views_counters_and_tombstones_each_do_their_part() {
        use baton_messages::{DType, Layout, Shape};
        let session = Session::new(SessionToken::from_bytes([8; 32]));
        let backend = Arc::new(EventBackend::default());
        let cache = ImportCache::new(session.clone(), [backend.clone() as SharedBackend]);
        let alloc = backend.allocate(4096).unwrap();
        let mut fds = FrameFds::none();
        let layout = Layout::new(DType::F32, Shape::new([4, 8]).unwrap());
        let typed = alloc
            .handle(&session)
            .range(1024, 128)
            .layout(layout.clone())
            .build()
            .unwrap();
        let whole = alloc.handle(&session).build().unwrap();

        // Views: their own range, layout, and writes that land in the shared memory.
        let view = cache.open(&typed, &mut fds).unwrap();
        assert_eq!((view.len(), view.is_empty()), (128, false));
        assert_eq!(view.layout(), Some(&layout));
        view.write(4, b"abcd").unwrap();
        let mut back = [0u8; 4];
        alloc.read(1024 + 4, &mut back).unwrap();
        assert_eq!(&back, b"abcd", "a view's write lands at its offset");
        assert!(view.write(126, b"abcd").is_err(), "a write past the view");
        assert!(format!("{view:?}").contains("alloc"));

        // A hit whose handle claims no more than the mapping is served; one that claims
        // more is refused; the refused one takes no reference.
        let hit = cache.open(&whole, &mut fds).unwrap();
        let mut bigger = whole.clone();
        bigger.alloc_size = 8192;
        bigger.len = 8192;
        let bigger = bigger.sealed(session.handle_key());
        assert!(matches!(
            cache.open(&bigger, &mut fds),
            Err(Error::MemoryTooSmall {
                claimed: 8192,
                actual: 4096
            })
        ));
        let stats = cache.stats();
        assert_eq!((stats.opens, stats.hits, stats.live), (1, 1, 1));
        assert!(format!("{cache:?}").contains("hits: 1"));

        // The mapping lives until its last view drops, whichever goes first.
        drop(view);
        assert_eq!(cache.stats().live, 1);
        assert_eq!(hit.to_vec().unwrap()[1028..1032], *b"abcd");
        drop(hit);
        let stats = cache.stats();
        assert_eq!((stats.live, stats.closes), (0, 1));

        // Tombstones: a retired generation is stale (and counted); forgetting one process
        // forgets its tombstones only.
        let me = session.process();
        let other = ProcessId {
            pid: me.pid.wrapping_add(1),
            ..me
        };
        let mut foreign = whole.clone();
        foreign.exporter.process = other;
        let foreign = foreign.sealed(session.handle_key());
        cache.retire(me, whole.alloc, whole.generation);
        cache.retire(other, foreign.alloc, foreign.generation);
        assert!(matches!(
            cache.open(&whole, &mut fds),
            Err(Error::StaleHandle { .. })
        ));
        assert_eq!(cache.stats().stale, 1);
        cache.forget_process(&me);
        assert!(
            matches!(
                cache.open(&foreign, &mut fds),
                Err(Error::StaleHandle { .. })
            ),
            "another process's tombstone survives"
        );
        assert_eq!(cache.stats().stale, 2);
        drop(
            cache
                .open(&whole, &mut fds)
                .expect("its tombstone is forgotten"),
        );
    }
}
