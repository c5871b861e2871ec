//! Fences: a producer records one on a stream after the work that produced a buffer; a
//! consumer in another process makes *its* stream wait on it before touching the buffer.
//! One type ([`RecordedFence`] on the producer's side, [`FenceHandle`] on the wire), two
//! implementations, chosen per backend ([`FenceKind`], [`FENCE_ENV`]):
//!
//! - **Sequence counters** ([`FenceKind::Counter`], the default): the producer owns a small
//!   slab of 64-bit counters in device memory, shared as a legacy IPC handle; recording
//!   lends a slot, bumps its value and has the stream write it (`cuStreamWriteValue64`,
//!   after a memory barrier that makes the earlier work's writes visible); the consumer
//!   maps the slab once per exporter process and has its stream wait until the slot holds
//!   at least that value (`cuStreamWaitValue64` with `CU_STREAM_WAIT_VALUE_GEQ`), as NCCL
//!   does. No event object, no `cuIpcOpenEventHandle`. The device must support 64-bit
//!   stream memory operations (`CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`),
//!   otherwise the backend falls back to events.
//! - **IPC events** ([`FenceKind::Event`]): the producer records a pooled interprocess event
//!   (`cuEventRecord`); the consumer opens each event handle once per exporter process
//!   (`cuIpcOpenEventHandle`) and makes its stream wait on it (`cuStreamWaitEvent`). See
//!   [`RecordedEvent`] for the reuse contract.
//!
//! Counters are far cheaper (H100: about 1.5 µs per write against about 120 µs per
//! interprocess-event record; docs/BENCHMARKS.md, item 8), hence the default.
//!
//! **Reuse.** A wait on a counter fence names its value, so it cannot be moved by a later
//! record: a slot is lent again only once its last value has landed (a dropped fence's slot
//! is *retired* until the slab, read back in one copy when no slot is free, shows the
//! value), so the values of one slot land in increasing order and a late wait for an old
//! value is satisfied by any later one — never early, and never by work that waits on the
//! waiter. An event, whose wait follows its latest record, needs more: it is lent until its
//! [`RecordedFence`] drops, which must wait until every consumer that got its handle has
//! waited (the lease that carried it was released); see [`RecordedEvent`].
//!
//! **Counter fences and dead producers.** A stream waiting for a value that never comes
//! waits forever, and unlike an event a counter has no owner the driver could tear down.
//! When the consumer learns that the producer died
//! ([`Backend::forget_process`](crate::Backend::forget_process)), it writes the largest
//! value into every slot of that producer's slab it maps, which releases every stream still
//! waiting there; the mapping itself stays open until the backend drops, since such a
//! stream may not have read the value yet.
//!
//! # Safety
//!
//! A [`CounterSlab`] owns one `cuMemAlloc_v2` allocation (through a [`DeviceAlloc`]) that
//! lives as long as the slab, which every lent slot and the process-local registry (a
//! `Weak`) refer to. An [`OpenedSlab`] owns one `cuIpcOpenMemHandle_v2` mapping (an
//! [`IpcMapping`]) and checks every offset it is asked to wait on against the mapped size,
//! so a stream only ever reads inside the mapping. Every driver call runs with a context
//! pushed ([`ContextGuard`]).

use super::context::ContextGuard;
use super::event::RecordedEvent;
use super::legacy::{DeviceAlloc, IpcMapping};
use super::result::{self, StreamMemOps};
use super::{SharedContext, SharedStream};
use crate::{Error, Result};
use baton_messages::CudaIpcMemHandle;
pub use baton_messages::{CounterFence, FenceHandle, FenceKind};
use cudarc::driver::CudaStream;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// How many counter fences a backend's slab holds unless told otherwise
/// ([`super::CudaBackendBuilder::counter_slots`]): 32 KiB of device memory.
pub const DEFAULT_COUNTER_SLOTS: usize = 4096;

/// The environment variable that picks a CUDA backend's fence kind: `counter` (the
/// default) or `event`.
pub const FENCE_ENV: &str = "BATON_CUDA_FENCE";

/// The fence kind [`FENCE_ENV`] asks for, `Counter` if unset.
///
/// # Errors
/// [`Error::BackendUnavailable`] if it holds something else.
pub fn fence_kind_from_env() -> Result<FenceKind> {
    match std::env::var(FENCE_ENV) {
        Err(_) => Ok(FenceKind::Counter),
        Ok(v) => FenceKind::parse(&v).ok_or_else(|| Error::BackendUnavailable {
            backend: "cuda",
            reason: format!("{FENCE_ENV}={v:?} is not one of event, counter"),
        }),
    }
}

enum Recorded {
    Event(RecordedEvent),
    Counter(LentSlot),
}

/// A fence recorded on a stream after the work queued there so far, lent from the
/// backend's pool of counter slots or events. Send [`handle`](Self::handle) to the
/// consumers.
///
/// **Reuse.** A counter slot whose fence dropped is lent again only once its value has
/// landed, and a wait names its value, so the guard may drop as soon as the handle is sent.
/// An event's wait follows its latest record: keep an event's guard until every consumer
/// has waited on it, since dropping it returns the event to the pool, where it may be
/// recorded again (the actor layer keeps it with the lease that carried it). See the
/// module docs of `baton_ipc::cuda` and `docs/ORDERING.md`.
pub struct RecordedFence(Recorded);

impl RecordedFence {
    /// What consumers wait on. A capability.
    pub fn handle(&self) -> FenceHandle {
        match &self.0 {
            Recorded::Event(e) => FenceHandle::Event(e.ipc_handle()),
            Recorded::Counter(s) => FenceHandle::Counter(s.fence()),
        }
    }

    /// Its kind.
    pub fn kind(&self) -> FenceKind {
        self.handle().kind()
    }

    /// Whether the work before the fence has completed (events: `cuEventQuery`; counters:
    /// the slot read back from device memory on a side stream).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn is_complete(&self) -> Result<bool> {
        match &self.0 {
            Recorded::Event(e) => e.is_complete(),
            Recorded::Counter(s) => Ok(s.slab.read(s.slot)? >= s.value),
        }
    }

    /// Blocks until the work before the fence has completed (events:
    /// `cuEventSynchronize`; counters: a side stream waits for the value, then is
    /// synchronised).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn synchronize(&self) -> Result<()> {
        match &self.0 {
            Recorded::Event(e) => e.synchronize(),
            Recorded::Counter(s) => s.slab.synchronize(s.slot, s.value),
        }
    }

    pub(crate) fn from_event(event: RecordedEvent) -> Self {
        Self(Recorded::Event(event))
    }
}

impl crate::ordering::ExportedFence for RecordedFence {
    fn handle(&self) -> FenceHandle {
        RecordedFence::handle(self)
    }

    fn is_complete(&self) -> Result<bool> {
        RecordedFence::is_complete(self)
    }

    fn synchronize(&self) -> Result<()> {
        RecordedFence::synchronize(self)
    }
}

impl fmt::Debug for RecordedFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RecordedFence")
            .field(&self.handle())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a push, a pop or an increment: a poisoned lock is
    // consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Slab ids, unique in this process.
fn next_slab_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// This process's counter slabs, by id, so that a fence waited on in the process that
/// recorded it uses the slab itself (the driver refuses to open one's own IPC handle).
fn local_slabs() -> &'static Mutex<HashMap<u64, Weak<CounterSlab>>> {
    static LOCAL: OnceLock<Mutex<HashMap<u64, Weak<CounterSlab>>>> = OnceLock::new();
    LOCAL.get_or_init(Default::default)
}

/// This process's own slab with that id, if it is alive.
pub(crate) fn local_slab(id: u64) -> Option<Arc<CounterSlab>> {
    lock(local_slabs()).get(&id).and_then(Weak::upgrade)
}

struct SlabState {
    free: Vec<u32>,
    /// Slots whose fence dropped, with the value recorded last: free again once the slab
    /// shows it (see the module docs).
    retired: Vec<(u32, u64)>,
    /// The last value recorded in each slot.
    values: Vec<u64>,
}

/// The producer's counters: `slots` 64-bit words of device memory, shared as a legacy IPC
/// handle, lent out one slot per recorded fence.
pub(crate) struct CounterSlab {
    ctx: SharedContext,
    alloc: DeviceAlloc,
    ipc: CudaIpcMemHandle,
    id: u64,
    ops: StreamMemOps,
    /// A stream of the slab's own, for reads that must not queue behind anyone's work.
    side: SharedStream,
    state: Mutex<SlabState>,
}

impl fmt::Debug for CounterSlab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("CounterSlab")
            .field("id", &self.id)
            .field("slots", &state.values.len())
            .field("free", &state.free.len())
            .finish()
    }
}

impl CounterSlab {
    /// `cuMemAlloc_v2` of `slots` counters, zeroed, and their `cuIpcGetMemHandle`.
    pub(crate) fn new(
        ctx: &SharedContext,
        slots: usize,
        ops: StreamMemOps,
        side: SharedStream,
    ) -> Result<Arc<Self>> {
        let slots = slots.clamp(1, u32::MAX as usize);
        let alloc = DeviceAlloc::new(ctx, slots * 8)?;
        {
            let _pushed = ContextGuard::push(ctx)?;
            // SAFETY: the side stream is live in the current context (the backend's);
            // `alloc` is `slots * 8` bytes of our live device memory.
            unsafe { result::memset_d8_async(alloc.ptr(), 0, slots * 8, side.cu_stream()) }?;
            // SAFETY: as above.
            unsafe { result::stream_synchronize(side.cu_stream()) }?;
        }
        let ipc = CudaIpcMemHandle(alloc.ipc_handle()?);
        let slab = Arc::new(Self {
            ctx: Arc::clone(ctx),
            alloc,
            ipc,
            id: next_slab_id(),
            ops,
            side,
            state: Mutex::new(SlabState {
                free: (0..slots as u32).rev().collect(),
                retired: Vec::new(),
                values: vec![0; slots],
            }),
        });
        lock(local_slabs()).insert(slab.id, Arc::downgrade(&slab));
        Ok(slab)
    }

    /// (slots, lent out or retired).
    pub(crate) fn counts(&self) -> (usize, usize) {
        let state = lock(&self.state);
        (state.values.len(), state.values.len() - state.free.len())
    }

    /// Frees the retired slots whose value has landed: the whole slab read back in one
    /// copy, with no lock held.
    pub(crate) fn sweep(&self) -> Result<()> {
        if lock(&self.state).retired.is_empty() {
            return Ok(());
        }
        let landed = self.read_all()?;
        let mut state = lock(&self.state);
        let SlabState { free, retired, .. } = &mut *state;
        retired.retain(|&(slot, value)| {
            let done = landed[slot as usize] >= value;
            if done {
                free.push(slot);
            }
            !done
        });
        Ok(())
    }

    /// Lends a slot, bumps its value and has `stream` write it after the work queued there
    /// so far.
    pub(crate) fn record(self: &Arc<Self>, stream: &CudaStream) -> Result<RecordedFence> {
        if lock(&self.state).free.is_empty() {
            self.sweep()?;
        }
        let (slot, value) = {
            let mut state = lock(&self.state);
            let limit = state.values.len();
            let slot = state.free.pop().ok_or(Error::FencesExhausted { limit })?;
            let v = &mut state.values[slot as usize];
            *v += 1;
            (slot, *v)
        };
        let lent = LentSlot {
            slab: Arc::clone(self),
            slot,
            value,
        };
        let _pushed = ContextGuard::push(stream.context())?;
        // SAFETY: the stream is live in its current context; the slot is 8-byte aligned
        // inside our allocation, which `lent` keeps alive; the slot is lent to us alone, so
        // no other write to it is queued concurrently.
        unsafe {
            result::stream_write_value64(self.ops, stream.cu_stream(), self.addr(slot), value)
        }?;
        Ok(RecordedFence(Recorded::Counter(lent)))
    }

    fn addr(&self, slot: u32) -> u64 {
        self.alloc.ptr() + u64::from(slot) * 8
    }

    fn offset_slot(&self, offset: u64) -> Result<u32> {
        let slots = lock(&self.state).values.len() as u64;
        if offset % 8 != 0 || offset / 8 >= slots {
            return Err(Error::Cuda {
                op: "cuStreamWaitValue64",
                code: super::CudaError::INVALID_VALUE,
            });
        }
        Ok((offset / 8) as u32)
    }

    /// Makes `stream` wait until the slot at `offset` holds `value` or more (a fence of
    /// this process, waited on in it).
    pub(crate) fn wait(&self, offset: u64, value: u64, stream: &CudaStream) -> Result<()> {
        let slot = self.offset_slot(offset)?;
        let _pushed = ContextGuard::push(stream.context())?;
        // SAFETY: the slot lies inside our live allocation (checked above); the stream is
        // live in its current context.
        unsafe { result::stream_wait_value64(self.ops, stream.cu_stream(), self.addr(slot), value) }
    }

    /// The slot's value now, read on the side stream.
    fn read(&self, slot: u32) -> Result<u64> {
        let mut bytes = [0u8; 8];
        self.copy_out(slot, &mut bytes)?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// Every slot's value now, read on the side stream in one copy.
    fn read_all(&self) -> Result<Vec<u64>> {
        let slots = lock(&self.state).values.len();
        let mut bytes = vec![0u8; slots * 8];
        self.copy_out(0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }

    /// Copies `dst.len()` bytes from slot `slot` on, on the side stream, and waits for it.
    fn copy_out(&self, slot: u32, dst: &mut [u8]) -> Result<()> {
        let slots = lock(&self.state).values.len();
        assert!(
            slot as usize * 8 + dst.len() <= slots * 8,
            "a read inside the slab"
        );
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the range lies inside our live allocation (asserted above); the side
        // stream is live in the current context; `dst` is not read before the synchronise
        // below.
        unsafe { result::memcpy_dtoh_async(dst, self.addr(slot), self.side.cu_stream()) }?;
        // SAFETY: as above.
        unsafe { result::stream_synchronize(self.side.cu_stream()) }
    }

    /// Blocks until the slot holds `value` or more.
    fn synchronize(&self, slot: u32, value: u64) -> Result<()> {
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the slot lies inside our live allocation; the side stream is live in the
        // current context. The value comes: the slot is lent to the caller, whose record
        // queued its write.
        unsafe {
            result::stream_wait_value64(self.ops, self.side.cu_stream(), self.addr(slot), value)
        }?;
        // SAFETY: as above.
        unsafe { result::stream_synchronize(self.side.cu_stream()) }
    }
}

impl Drop for CounterSlab {
    fn drop(&mut self) {
        let mut local = lock(local_slabs());
        if local.get(&self.id).is_some_and(|w| w.strong_count() == 0) {
            local.remove(&self.id);
        }
        // `alloc` frees the memory (its context pushed) when the fields drop.
    }
}

/// A slot lent to one recorded fence.
struct LentSlot {
    slab: Arc<CounterSlab>,
    slot: u32,
    value: u64,
}

impl LentSlot {
    fn fence(&self) -> CounterFence {
        CounterFence {
            slab: self.slab.ipc,
            slab_id: self.slab.id,
            offset: u64::from(self.slot) * 8,
            value: self.value,
        }
    }
}

impl Drop for LentSlot {
    /// Retires the slot: it is lent again once its value has landed (see the module docs).
    fn drop(&mut self) {
        lock(&self.slab.state).retired.push((self.slot, self.value));
    }
}

/// Another process's counter slab, mapped in this one.
pub(crate) struct OpenedSlab {
    ctx: SharedContext,
    mapping: IpcMapping,
    size: u64,
    ops: StreamMemOps,
}

impl fmt::Debug for OpenedSlab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenedSlab")
            .field("size", &self.size)
            .finish()
    }
}

impl OpenedSlab {
    /// `cuIpcOpenMemHandle_v2` of the slab, and its size.
    pub(crate) fn open(
        ctx: &SharedContext,
        slab: &CudaIpcMemHandle,
        ops: StreamMemOps,
    ) -> Result<Self> {
        let mut mapping = IpcMapping::open(ctx, &slab.0)?;
        let size = match mapping.mapped_size() {
            Ok(size) => size as u64,
            Err(e) => {
                mapping.close()?;
                return Err(e);
            }
        };
        Ok(Self {
            ctx: Arc::clone(ctx),
            mapping,
            size,
            ops,
        })
    }

    /// Makes `stream` wait until the counter at `offset` holds `value` or more.
    pub(crate) fn wait(&self, offset: u64, value: u64, stream: &CudaStream) -> Result<()> {
        let inside = offset % 8 == 0 && offset.checked_add(8).is_some_and(|end| end <= self.size);
        if !inside {
            return Err(Error::Cuda {
                op: "cuStreamWaitValue64",
                code: super::CudaError::INVALID_VALUE,
            });
        }
        let _pushed = ContextGuard::push(stream.context())?;
        // SAFETY: `offset..offset + 8` lies inside our live mapping (checked above), which
        // stays open until the backend drops; the stream is live in its current context.
        unsafe {
            result::stream_wait_value64(
                self.ops,
                stream.cu_stream(),
                self.mapping.ptr() + offset,
                value,
            )
        }
    }

    /// Writes the largest value into every counter of the slab, on `side`, and waits for
    /// that write: every stream waiting on this slab is released. For a producer that died.
    pub(crate) fn release_waiters(&self, side: &SharedStream) -> Result<()> {
        let _pushed = ContextGuard::push(&self.ctx)?;
        // SAFETY: the whole mapping, `size` bytes, is ours and live; the side stream is
        // live in the current context (the backend's, which opened the mapping).
        unsafe {
            result::memset_d8_async(
                self.mapping.ptr(),
                0xFF,
                self.size as usize,
                side.cu_stream(),
            )
        }?;
        // SAFETY: as above.
        unsafe { result::stream_synchronize(side.cu_stream()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_kind_comes_from_the_environment_or_is_refused() {
        // Only the parse path: the variable itself is process-wide and shared by tests.
        assert_eq!(FenceKind::parse("counter"), Some(FenceKind::Counter));
        assert!(FenceKind::parse("semaphore").is_none());
        if std::env::var_os(FENCE_ENV).is_none() {
            assert_eq!(fence_kind_from_env().unwrap(), FenceKind::Counter);
        }
    }
}
