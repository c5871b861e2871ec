//! [`Imported`]: one buffer opened through the [`ImportCache`](super::ImportCache), a view
//! of part of a shared mapping that keeps the mapping open while it lives.
//!
//! # Safety
//!
//! One `unsafe` block, in [`Imported::host_bytes_mut`]: it calls the backend's
//! `RawMemory::host_bytes_mut`, whose contract (nothing else in this process reaches the
//! bytes while the `&mut [u8]` lives) only the cache can keep, because only the cache
//! knows how many views of a mapping exist. It hands the slice out for a mapping's only
//! view, borrowed `&mut`, and opens no other view of that mapping until that view drops.

use super::CacheKey;
use super::shared::Shared;
use crate::backend::{MemPtr, OpenedMem, SharedBackend};
use crate::{Error, Result};
use baton_messages::{AllocationId, DeviceUuid, ExporterId, FenceHandle, Generation, Layout};
use std::fmt;
use std::sync::Arc;

/// One buffer opened through the [`ImportCache`](super::ImportCache): a view of `len` bytes at `offset` of a
/// shared mapping. The mapping stays open while a view of it or a holder is left.
pub struct Imported {
    pub(super) cache: Arc<Shared>,
    pub(super) key: CacheKey,
    pub(super) generation: Generation,
    /// Always `Some` until `drop`, which takes it to release it under the cache lock.
    pub(super) mem: Option<Arc<OpenedMem>>,
    pub(super) backend: SharedBackend,
    pub(super) offset: usize,
    pub(super) len: usize,
    pub(super) layout: Option<Layout>,
    /// The device the memory lives on ([`DeviceUuid::HOST`] for host memory).
    pub(super) device: DeviceUuid,
    /// A release fence of this process after the work queued on the view
    /// ([`release_after`](Self::release_after)).
    pub(super) release: Option<FenceHandle>,
    /// It handed out a `&mut` of the mapping ([`host_bytes_mut`](Self::host_bytes_mut)),
    /// so its entry refuses new views until it drops.
    pub(super) written_in_place: bool,
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

    /// Which mapping it is a view of.
    pub fn key(&self) -> CacheKey {
        self.key
    }

    /// Who exported it.
    pub fn exporter(&self) -> ExporterId {
        self.key.exporter
    }

    /// The exported allocation.
    pub fn alloc(&self) -> AllocationId {
        self.key.alloc
    }

    /// The generation of the handle it was opened with.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Where the buffer's first byte is.
    pub fn ptr(&self) -> MemPtr {
        self.mem().ptr().offset_by(self.offset)
    }

    /// The device the memory lives on ([`DeviceUuid::HOST`] for host memory).
    pub fn device(&self) -> DeviceUuid {
        self.device
    }

    /// One more view of the same bytes, counted by the cache as any view is: the mapping
    /// stays open while either lives (a send that reads it keeps one, whatever the
    /// other's owner does meanwhile).
    ///
    /// # Errors
    /// [`Error::WrittenInPlace`] while a view of the mapping hands out its bytes
    /// writable ([`host_bytes_mut`](Self::host_bytes_mut)).
    pub fn another_view(&self) -> Result<Imported> {
        self.cache.lock().add_view(&self.key, self.key.alloc)?;
        Ok(Imported {
            cache: Arc::clone(&self.cache),
            key: self.key,
            generation: self.generation,
            mem: self.mem.clone(),
            backend: Arc::clone(&self.backend),
            offset: self.offset,
            len: self.len,
            layout: self.layout.clone(),
            device: self.device,
            release: None,
            written_in_place: false,
        })
    }

    /// The whole mapping this buffer is part of.
    pub fn mapping(&self) -> &OpenedMem {
        self.mem()
    }

    /// The backend that opened it: the one that orders work on it.
    pub fn backend(&self) -> &SharedBackend {
        &self.backend
    }

    /// Drops the view after queued work that uses it, which `fence` (recorded by this
    /// process) follows: the mapping is not closed before that work has completed.
    pub fn release_after(mut self, fence: FenceHandle) {
        self.release = Some(fence);
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

    /// The buffer's bytes in place, if the CPU can address them (host memory; `None` for
    /// device memory). The memory is shared: see [`RawMemory::host_bytes`](crate::RawMemory::host_bytes)
    /// for who may change it while the slice is borrowed.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let all = self.mem().raw().host_bytes()?;
        all.get(self.offset..self.offset.checked_add(self.len)?)
    }

    /// The buffer's bytes in place, writable, if the CPU can address them (`Ok(None)` for
    /// device memory). Given only while this is the mapping's only view in this process;
    /// from then until this view drops, the cache opens no other view of the mapping (an
    /// open of it fails with [`Error::WrittenInPlace`]). So while the slice lives nothing
    /// else in this process reaches the bytes through this crate's safe API: the slice
    /// borrows this view mutably, and no other view exists. Another process may still
    /// write them (see [`RawMemory::host_bytes`](crate::RawMemory::host_bytes)), as may
    /// `unsafe` code here through a raw pointer ([`ptr`](Self::ptr)) taken earlier.
    ///
    /// # Errors
    /// [`Error::SharedMapping`] when the mapping has other views in this process (another
    /// lease on the allocation in this process: drop it, or copy with
    /// [`write`](Self::write)).
    pub fn host_bytes_mut(&mut self) -> Result<Option<&mut [u8]>> {
        if self.mem().raw().host_bytes().is_none() {
            return Ok(None);
        }
        let range = self.offset..self.offset + self.len;
        self.cache.lock().write_in_place(&self.key)?;
        self.written_in_place = true;
        let mem = self.mem.as_deref().expect("present until drop");
        #[allow(unsafe_code)]
        // SAFETY: this view is the mapping's only one in this process (`users == 1`, checked
        // under the cache lock), and its entry now refuses new views until this view drops
        // (`State::hit`; a miss cannot happen while the entry exists). Views hand out
        // `&OpenedMem`/`&[u8]` only borrowed from themselves, and the slice returned here
        // borrows `self` mutably, so no other reference to these bytes, and no copy
        // through this crate, exists in this process while it lives. The bytes are the
        // host mapping's, which `mem` keeps mapped for as long as `self` lives.
        let all = unsafe { mem.raw().host_bytes_mut() };
        match all {
            None => Ok(None),
            Some(all) => Ok(all.get_mut(range)),
        }
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
            .field("exporter", &self.key.exporter)
            .field("alloc", &self.key.alloc)
            .field("gen", &self.generation)
            .field("range", &format_args!("{}..+{}", self.offset, self.len))
            .finish()
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        let (closing, victims) = {
            let mut state = self.cache.lock();
            // Our reference goes while the lock is held, so that a close below sees the
            // cache's as the last one.
            drop(self.mem.take());
            state.view_dropped(
                &self.key,
                self.release.take(),
                self.written_in_place,
                &self.cache.budget,
            )
        };
        self.cache.dispatch(closing);
        self.cache.evict(victims);
    }
}
