//! Fences: a producer records one on a stream after the work that produced a buffer; a
//! consumer in another process makes *its* stream wait on it before touching the buffer.
//! One type ([`RecordedFence`] on the producer's side, [`FenceHandle`] on the wire), two
//! implementations, chosen per backend ([`FenceKind`], [`FENCE_ENV`]):
//!
//! - **Sequence counters** ([`FenceKind::Counter`], the default): 64-bit words in device
//!   memory, written by the producer's stream (`cuStreamWriteValue64`, whose default
//!   memory barrier makes the earlier work's writes visible) and waited on by the
//!   consumer's stream until the word holds at least the fence's value
//!   (`cuStreamWaitValue64` with `CU_STREAM_WAIT_VALUE_GEQ`), as NCCL does. The words live
//!   in the **consumer's** memory: each backend owns an *inbox* slab ([`CounterSlab`],
//!   shared as a legacy IPC handle) and lends each peer process a lane of it
//!   ([`crate::inbox`]); a producer maps the consumer's inbox once ([`OpenedSlab`]) and
//!   writes there. So a consumer only ever waits on its own memory, and can release its
//!   own waits alone — by writing the words itself — when a producer dies or does not
//!   deliver (the backend's watch thread, `super::inbox`). The device must support 64-bit
//!   stream memory operations (`CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`),
//!   otherwise the backend falls back to events.
//! - **IPC events** ([`FenceKind::Event`]): the producer records a pooled interprocess event
//!   (`cuEventRecord`); the consumer opens each event handle once per exporter process
//!   (`cuIpcOpenEventHandle`) and never makes a stream wait on it: if it has not completed,
//!   the stream waits on a *bridge* slot of the consumer's own, written once the event
//!   completes or its producer dies, is cut or misses the fence deadline (`super::bridge`).
//!   See [`RecordedEvent`] for the reuse contract.
//!
//! Counters are far cheaper (H100: about 1.5 µs per write against about 120 µs per
//! interprocess-event record; docs/BENCHMARKS.md, item 8), hence the default.
//!
//! **Order of one slot's values.** A wait names its value, and a slot's values must land in
//! increasing order, or a later wait could be released by an earlier record. A lane slot is
//! written by one release stream of the producer only, under that stream's lock, so its
//! values land in the order they were taken. The slots this process lends to its own
//! fences ([`CounterSlab::record`], waited on in this process) are written from any
//! stream: such a slot is lent again only once its last value has landed (a dropped
//! fence's slot is *retired* until the slab, read back in one copy when no slot is free,
//! shows the value).
//!
//! # Safety
//!
//! A [`CounterSlab`] owns one `cuMemAlloc_v2` allocation (through a [`DeviceAlloc`]) that
//! lives as long as the slab, which every lent slot and the process-local registry (a
//! `Weak`) refer to — or longer: once lent to a peer, it is never freed while this
//! process runs ([`CounterSlab::keep_for_peers`]), since a peer may map it and write into
//! it at any time. An [`OpenedSlab`] owns one `cuIpcOpenMemHandle_v2` mapping (an
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
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

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
    /// Slots lent by `record`.
    lendable: usize,
    free: Vec<u32>,
    /// Slots whose fence dropped, with the value recorded last: free again once the slab
    /// shows it (see the module docs).
    retired: Vec<(u32, u64)>,
    /// The last value recorded in each slot.
    values: Vec<u64>,
}

/// A backend's counters: `slots` 64-bit words of device memory, shared as a legacy IPC
/// handle. Part of it is lent out one slot per fence this process records for itself
/// ([`record`](Self::record)); the rest is the inbox that peers write into (its layout is
/// the backend's, `super::inbox`).
pub(crate) struct CounterSlab {
    ctx: SharedContext,
    alloc: ManuallyDrop<DeviceAlloc>,
    /// Lent to a peer: never freed (see the module's `# Safety`).
    keep: AtomicBool,
    ipc: CudaIpcMemHandle,
    id: u64,
    ops: StreamMemOps,
    /// A stream of the slab's own, for reads that must not queue behind anyone's work.
    side: SharedStream,
    state: Mutex<SlabState>,
    /// The local marks, slots `0..lend.0`: one per writer (release streams, stream slots).
    twins: Box<[Twin]>,
}

/// A local mark's slot (see [`CounterSlab::promise`]), locked by its release stream while
/// it queues a fence.
pub(crate) struct TwinState {
    /// The highest value queued for writing.
    written: u64,
    /// The highest value promised to a fence: written at the next [`CounterSlab::settle`].
    promised: u64,
    /// The stream that writes the slot (the only one): a release stream, or the stream a
    /// stream slot is bound to ([`CounterSlab::bind`]).
    pub(crate) stream: Option<SharedStream>,
}

struct Twin {
    state: Mutex<TwinState>,
    /// `state.written`, read without the lock.
    written: AtomicU64,
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
    /// `cuMemAlloc_v2` of `slots` counters, zeroed, and their `cuIpcGetMemHandle`; slots
    /// `lend.0 .. lend.0 + lend.1` are lent by [`record`](Self::record).
    pub(crate) fn new(
        ctx: &SharedContext,
        slots: usize,
        lend: (u32, u32),
        ops: StreamMemOps,
        side: SharedStream,
    ) -> Result<Arc<Self>> {
        let slots = slots.clamp(1, u32::MAX as usize);
        let lend_end = (u64::from(lend.0) + u64::from(lend.1)).min(slots as u64) as u32;
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
            alloc: ManuallyDrop::new(alloc),
            keep: AtomicBool::new(false),
            ipc,
            id: next_slab_id(),
            ops,
            side,
            state: Mutex::new(SlabState {
                lendable: lend_end.saturating_sub(lend.0) as usize,
                free: (lend.0.min(lend_end)..lend_end).rev().collect(),
                retired: Vec::new(),
                values: vec![0; slots],
            }),
            twins: (0..lend.0.min(slots as u32))
                .map(|_| Twin {
                    state: Mutex::new(TwinState {
                        written: 0,
                        promised: 0,
                        stream: None,
                    }),
                    written: AtomicU64::new(0),
                })
                .collect(),
        });
        lock(local_slabs()).insert(slab.id, Arc::downgrade(&slab));
        Ok(slab)
    }

    /// (slots lent by [`record`](Self::record), of those lent out or retired).
    pub(crate) fn counts(&self) -> (usize, usize) {
        let state = lock(&self.state);
        (state.lendable, state.lendable - state.free.len())
    }

    /// The slab's id (unique in this process).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Its legacy IPC handle.
    pub(crate) fn ipc(&self) -> CudaIpcMemHandle {
        self.ipc
    }

    /// Its slots.
    pub(crate) fn slots(&self) -> usize {
        lock(&self.state).values.len()
    }

    /// From now on the memory is never freed: a peer may map it.
    pub(crate) fn keep_for_peers(&self) {
        self.keep.store(true, Ordering::Relaxed);
    }

    /// Local mark `i`'s lock, held by release stream `i` while it queues a fence (which
    /// keeps each lane slot's values in order) and promises the mark.
    pub(crate) fn twin(&self, i: usize) -> MutexGuard<'_, TwinState> {
        lock(&self.twins[i % self.twins.len()].state)
    }

    /// The local twin of a fence release stream `i` (`stream`) just queued, its lock
    /// `held`: a value of local mark `i` that lands after that fence's work. Nothing is
    /// written now: the value is written on `stream` when something reads or waits on it
    /// ([`settle`](Self::settle), which every read and wait here does first), then
    /// covering every fence queued on `stream` before. So a fence costs one write, not
    /// two, and the twin is paid for only by the rare reader (a mapping's close, a relay).
    pub(crate) fn promise(
        self: &Arc<Self>,
        held: &mut MutexGuard<'_, TwinState>,
        i: usize,
        stream: &SharedStream,
    ) -> LocalMark {
        if held.promised <= held.written {
            held.promised = held.written + 1;
        }
        if held.stream.is_none() {
            held.stream = Some(Arc::clone(stream));
        }
        LocalMark {
            slab: Arc::clone(self),
            slot: (i % self.twins.len()) as u32,
            value: held.promised,
        }
    }

    /// Binds local mark `i` (its lock `held`) to `stream` (`cu` its handle), the only stream
    /// that writes it and its lane slots from then on, unless it is bound to another
    /// stream with work not yet run (`cuStreamQuery`, which never blocks): a write of that
    /// stream could land after the new one's and lower the slot under a wait. A value
    /// promised and not yet written stays promised: true already (the old stream ran
    /// everything), it is written on the new stream when read. `make` gives the stream to
    /// keep.
    pub(crate) fn bind(
        &self,
        held: &mut MutexGuard<'_, TwinState>,
        cu: cudarc::driver::sys::CUstream,
        make: impl FnOnce() -> SharedStream,
    ) -> Result<bool> {
        if let Some(old) = &held.stream {
            if old.cu_stream() == cu {
                return Ok(true);
            }
            let _pushed = ContextGuard::push(&self.ctx)?;
            // SAFETY: a live stream (we keep it) of the slab's context, which is current.
            if !unsafe { result::stream_query(old.cu_stream()) }? {
                return Ok(false);
            }
        }
        held.stream = Some(make());
        Ok(true)
    }

    /// Whether local mark `i` (its lock `held`) is bound to the stream `cu`.
    pub(crate) fn bound_to(held: &TwinState, cu: cudarc::driver::sys::CUstream) -> bool {
        held.stream.as_ref().is_some_and(|s| s.cu_stream() == cu)
    }

    /// The streams local marks `range` are bound to.
    pub(crate) fn bound_streams(&self, range: std::ops::Range<usize>) -> Vec<SharedStream> {
        self.twins
            .get(range)
            .unwrap_or_default()
            .iter()
            .filter_map(|t| lock(&t.state).stream.clone())
            .collect()
    }

    /// Queues the write of the local mark at `offset` up to `value` (see
    /// [`settle_slot`](Self::settle_slot)); nothing for other slots.
    pub(crate) fn settle(&self, offset: u64, value: u64) -> Result<()> {
        self.settle_slot(self.offset_slot(offset)?, value)
    }

    /// Queues the write of local mark `slot`'s promised value on its release stream,
    /// unless a value of at least `value` is queued already (or `slot` is not a local
    /// mark). Call with no local mark's lock held.
    fn settle_slot(&self, slot: u32, value: u64) -> Result<()> {
        let Some(twin) = self.twins.get(slot as usize) else {
            return Ok(());
        };
        if twin.written.load(Ordering::Acquire) >= value {
            return Ok(());
        }
        let mut held = lock(&twin.state);
        if held.written >= value || held.promised <= held.written {
            return Ok(());
        }
        let Some(stream) = held.stream.clone() else {
            return Ok(());
        };
        self.write_on(&stream, slot, held.promised)?;
        held.written = held.promised;
        twin.written.store(held.written, Ordering::Release);
        Ok(())
    }

    /// Has `stream` write `value` into `slot` after the work queued there so far. The
    /// caller keeps one slot's writes in increasing order (see the module docs).
    pub(crate) fn write_on(&self, stream: &CudaStream, slot: u32, value: u64) -> Result<()> {
        self.check_slot(slot)?;
        let _pushed = ContextGuard::push(stream.context())?;
        // SAFETY: the stream is live in its current context; the slot is 8-byte aligned
        // inside our live allocation (checked above).
        unsafe {
            result::stream_write_value64(self.ops, stream.cu_stream(), self.addr(slot), value)
        }
    }

    /// Writes `value` into `slots` slots from `first` on, on `stream` (a stream that waits
    /// on nothing), and waits for that write: every wait on them for a value up to `value`
    /// is released. (`GEQ` compares cyclically, `(word - wanted) as i64 >= 0`: the value
    /// must be chosen just above the waits', never `u64::MAX`.)
    pub(crate) fn release(
        &self,
        first: u32,
        slots: u32,
        value: u64,
        stream: &SharedStream,
    ) -> Result<()> {
        let end = u64::from(first) + u64::from(slots);
        if end > self.slots() as u64 {
            return Err(Error::Cuda {
                op: "cuStreamWriteValue64",
                code: super::CudaError::INVALID_VALUE,
            });
        }
        let _pushed = ContextGuard::push(&self.ctx)?;
        for slot in first..first + slots {
            // SAFETY: the slot lies inside our live allocation (checked above); the stream
            // is live in the current context (the slab's).
            unsafe {
                result::stream_write_value64(self.ops, stream.cu_stream(), self.addr(slot), value)
            }?;
        }
        // SAFETY: as above.
        unsafe { result::stream_synchronize(stream.cu_stream()) }
    }

    /// Every slot's value now, read on `stream` (a stream that waits on nothing) in one
    /// copy.
    pub(crate) fn read_all_on(&self, stream: &SharedStream) -> Result<Vec<u64>> {
        let slots = self.slots();
        let mut bytes = vec![0u8; slots * 8];
        {
            let _pushed = ContextGuard::push(&self.ctx)?;
            // SAFETY: the whole allocation is ours and live; the stream is live in the
            // current context; `bytes` is not read before the synchronise below.
            unsafe { result::memcpy_dtoh_async(&mut bytes, self.addr(0), stream.cu_stream()) }?;
            // SAFETY: as above.
            unsafe { result::stream_synchronize(stream.cu_stream()) }?;
        }
        Ok(words(&bytes))
    }

    fn check_slot(&self, slot: u32) -> Result<()> {
        if slot as usize >= self.slots() {
            return Err(Error::Cuda {
                op: "cuStreamWriteValue64",
                code: super::CudaError::INVALID_VALUE,
            });
        }
        Ok(())
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
            let limit = state.lendable;
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
        self.settle_slot(slot, value)?;
        let _pushed = ContextGuard::push(stream.context())?;
        // SAFETY: the slot lies inside our live allocation (checked above); the stream is
        // live in its current context.
        unsafe { result::stream_wait_value64(self.ops, stream.cu_stream(), self.addr(slot), value) }
    }

    /// Whether the slot at `offset` holds `value` or more now (read on the side stream).
    pub(crate) fn holds(&self, offset: u64, value: u64) -> Result<bool> {
        let slot = self.offset_slot(offset)?;
        self.settle_slot(slot, value)?;
        Ok(self.read(slot)? >= value)
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
        Ok(words(&bytes))
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

    /// Blocks until the slot holds `value` or more: the slot read back on the side stream
    /// (never a wait queued there, which could hold up every later read), more and more
    /// rarely. The value comes: the slot's writes are this process's own, behind work
    /// whose waits on peers are released within the fence deadline.
    fn synchronize(&self, slot: u32, value: u64) -> Result<()> {
        self.settle_slot(slot, value)?;
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            if self.read(slot)? >= value {
                return Ok(());
            }
            std::thread::sleep(pause);
            if start.elapsed() > Duration::from_millis(2) {
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
    }
}

/// Little-endian 64-bit words.
fn words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

impl Drop for CounterSlab {
    fn drop(&mut self) {
        let mut local = lock(local_slabs());
        if local.get(&self.id).is_some_and(|w| w.strong_count() == 0) {
            local.remove(&self.id);
        }
        drop(local);
        if self.keep.load(Ordering::Relaxed) {
            tracing::debug!(
                slab = self.id,
                "a fence inbox lent to peers stays allocated until the process exits"
            );
            return;
        }
        // SAFETY: dropped once, here; nothing uses the field afterwards.
        unsafe { ManuallyDrop::drop(&mut self.alloc) };
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
        Ok(Self { mapping, size, ops })
    }

    fn check(&self, offset: u64, op: &'static str) -> Result<()> {
        let inside = offset % 8 == 0 && offset.checked_add(8).is_some_and(|end| end <= self.size);
        if inside {
            Ok(())
        } else {
            Err(Error::Cuda {
                op,
                code: super::CudaError::INVALID_VALUE,
            })
        }
    }

    /// Has `stream` write `value` into the counter at `offset` of the peer's inbox, after
    /// the work queued there so far. The caller keeps one slot's writes in increasing
    /// order.
    pub(crate) fn write_on(&self, offset: u64, value: u64, stream: &CudaStream) -> Result<()> {
        self.check(offset, "cuStreamWriteValue64")?;
        let _pushed = ContextGuard::push(stream.context())?;
        // SAFETY: `offset..offset + 8` lies inside our live mapping (checked above), which
        // stays open until the backend drops; the stream is live in its current context.
        unsafe {
            result::stream_write_value64(
                self.ops,
                stream.cu_stream(),
                self.mapping.ptr() + offset,
                value,
            )
        }
    }
}

/// A fence this process recorded for itself in a slot of its inbox that only one release
/// stream writes (see [`CounterSlab::promise`]): the local twin of a fence recorded for a
/// peer, complete once the same work is (or later work of the same release stream).
pub(crate) struct LocalMark {
    pub(crate) slab: Arc<CounterSlab>,
    pub(crate) slot: u32,
    pub(crate) value: u64,
}

impl LocalMark {
    fn handle(&self) -> FenceHandle {
        FenceHandle::Counter(CounterFence {
            slab: self.slab.ipc,
            slab_id: self.slab.id,
            offset: u64::from(self.slot) * 8,
            value: self.value,
        })
    }
}

/// A counter fence recorded for a peer: the value written into the peer's inbox, and its
/// local twin in ours.
pub(crate) struct PeerFence {
    pub(crate) handle: CounterFence,
    pub(crate) local: LocalMark,
}

impl fmt::Debug for PeerFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerFence")
            .field("fence", &self.handle)
            .field("local_slot", &self.local.slot)
            .finish()
    }
}

impl crate::ordering::ExportedFence for PeerFence {
    fn handle(&self) -> FenceHandle {
        FenceHandle::Counter(self.handle)
    }

    fn local_handle(&self) -> FenceHandle {
        self.local.handle()
    }

    fn is_complete(&self) -> Result<bool> {
        self.local
            .slab
            .holds(u64::from(self.local.slot) * 8, self.local.value)
    }

    fn synchronize(&self) -> Result<()> {
        self.local
            .slab
            .synchronize(self.local.slot, self.local.value)
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
