//! Stream ordering of one buffer on either side of a handoff: which streams used it, what
//! each must wait for, and the fences that go to the other process (see
//! `docs/ORDERING.md`).
//!
//! - [`LeaseOrder`] (importer): each stream the lease is used on waits once for the
//!   exporter's acquire fence before its first use; each use is followed by a mark on its
//!   stream; dropping the lease turns the marks into one release fence.
//! - [`ExportOrder`] (exporter): release fences from importers wait in line until the
//!   buffer's next use on some stream, which waits on them; the buffer's own uses on
//!   streams are marked, so that an offer carries an acquire fence after them, other streams
//!   and host copies wait for them, and the free waits for them and for every release
//!   fence.
//!
//! Everything here is the backend's fence operations ([`StreamOrdering::order_after`],
//! [`StreamOrdering::use_mark`], [`StreamOrdering::export_fence`]): CUDA queues waits and records on
//! streams (no blocking call but the free's synchronise, which runs on the driver thread);
//! host memory has none and costs nothing.
//!
//! [`StreamOrdering::order_after`]: baton_ipc::StreamOrdering::order_after
//! [`StreamOrdering::use_mark`]: baton_ipc::StreamOrdering::use_mark
//! [`StreamOrdering::export_fence`]: baton_ipc::StreamOrdering::export_fence

use crate::error::ActorError;
use baton_ipc::{ExportedFence, SharedBackend, Stream, StreamKey, StreamRef, UseMark};
use baton_messages::{FenceHandle, ProcessId};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The most streams whose uses of one buffer are tracked. A use on one more stream is
/// still ordered, and made complete before it returns (cudarc) or refused (`wait_on`).
pub const MAX_STREAMS: usize = 16;

/// A release fence an exporter waits on, recorded by `producer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReleaseFence {
    pub(crate) producer: ProcessId,
    pub(crate) fence: FenceHandle,
}

/// Same producer, and the same event or a value at least as high of the same counter slot
/// ([`FenceHandle::covers`]). Another producer's fence never covers: a slot of one lane has
/// one writer.
impl crate::ledger::Covers for ReleaseFence {
    fn covers(&self, earlier: &Self) -> bool {
        self.producer == earlier.producer && self.fence.covers(&earlier.fence)
    }
}

/// One stream's uses.
struct StreamUse {
    key: StreamKey,
    /// Shared by the buffers of one [`ExportOrder::mark_all_on`] on this stream: a mark
    /// is only ever recorded later on its one stream, after every earlier use there of
    /// any buffer, so one record serves them all.
    mark: Arc<dyn UseMark>,
    /// The stream itself, for streams named with `wait_on`: the mark is recorded there
    /// again when the lease drops.
    held: OnceLock<Stream>,
}

/// The streams that used a buffer, each with its mark.
pub(crate) struct StreamUses {
    backend: SharedBackend,
    /// Made at the first mark: a lease no stream uses (every host lease, an unordered
    /// handoff's) allocates none.
    slots: OnceLock<Box<[OnceLock<StreamUse>; MAX_STREAMS]>>,
}

impl fmt::Debug for StreamUses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.marks().map(|u| u.key)).finish()
    }
}

/// What a lookup found.
enum Found<'a> {
    /// The stream has a mark already.
    Known(&'a StreamUse),
    /// A first use on it: made now.
    New(&'a StreamUse),
    /// The backend has no marks (host memory: nothing is ever queued).
    Unmarked,
    /// Every slot is taken.
    Full,
}

impl StreamUses {
    pub(crate) fn new(backend: SharedBackend) -> Self {
        Self {
            backend,
            slots: OnceLock::new(),
        }
    }

    pub(crate) fn backend(&self) -> &SharedBackend {
        &self.backend
    }

    fn find(&self, key: StreamKey) -> Option<&StreamUse> {
        self.marks().find(|u| u.key == key)
    }

    /// The stream's use, made (with `first`, run before the mark exists) if it has none.
    fn get_or_add(
        &self,
        stream: StreamRef<'_>,
        first: impl FnOnce() -> Result<(), ActorError>,
    ) -> Result<Found<'_>, ActorError> {
        self.get_or_adopt(stream, first, None)
    }

    /// [`get_or_add`](Self::get_or_add), a new use taking `adopt` (a mark of the same
    /// stream) rather than a mark of its own.
    fn get_or_adopt(
        &self,
        stream: StreamRef<'_>,
        first: impl FnOnce() -> Result<(), ActorError>,
        adopt: Option<&Arc<dyn UseMark>>,
    ) -> Result<Found<'_>, ActorError> {
        let key = stream.key();
        if let Some(u) = self.find(key) {
            return Ok(Found::Known(u));
        }
        first()?;
        let mark = match adopt {
            Some(mark) => Arc::clone(mark),
            None => match self.backend.ordering().use_mark(stream)? {
                Some(mark) => Arc::from(mark),
                None => return Ok(Found::Unmarked),
            },
        };
        let mut new = Some(StreamUse {
            key,
            mark,
            held: OnceLock::new(),
        });
        let slots = self
            .slots
            .get_or_init(|| Box::new(std::array::from_fn(|_| OnceLock::new())));
        for slot in slots.iter() {
            if slot.get().is_some() {
                continue;
            }
            // Another thread may fill this slot first: then try the next.
            match slot.set(new.take().expect("kept until placed")) {
                Ok(()) => return Ok(Found::New(slot.get().expect("just set"))),
                Err(back) => new = Some(back),
            }
        }
        tracing::debug!(?key, max = MAX_STREAMS, "no room to track one more stream");
        Ok(Found::Full)
    }

    /// Who its marks are (their addresses, sorted: a mark lives as long as a use keeps it),
    /// to tell whether two buffers' fences would follow the same records.
    fn mark_ids(&self) -> Vec<usize> {
        let mut ids: Vec<usize> = self
            .marks()
            .map(|u| Arc::as_ptr(&u.mark).cast::<()>() as usize)
            .collect();
        ids.sort_unstable();
        ids
    }

    fn marks(&self) -> impl Iterator<Item = &StreamUse> {
        self.slots
            .get()
            .into_iter()
            .flat_map(|slots| slots.iter())
            .filter_map(OnceLock::get)
    }

    /// Makes `stream` wait for the latest record of every mark but its own.
    fn order_after_others(&self, stream: StreamRef<'_>) -> Result<(), ActorError> {
        let key = stream.key();
        for u in self.marks().filter(|u| u.key != key) {
            u.mark.order(stream)?;
        }
        Ok(())
    }

    /// One fence for process `to` after the latest record of every mark (`None` without
    /// marks).
    fn export(&self, to: &ProcessId) -> Result<Option<Arc<dyn ExportedFence>>, ActorError> {
        let marks: Vec<&dyn UseMark> = self.marks().map(|u| &*u.mark).collect();
        if marks.is_empty() {
            return Ok(None);
        }
        Ok(self.backend.ordering().export_fence(&marks, to)?)
    }
}

/// Marks, each once.
type Marks = Vec<Arc<dyn UseMark>>;

/// The importer's side (see the module docs).
#[derive(Debug)]
pub(crate) struct LeaseOrder {
    uses: StreamUses,
    /// Who recorded the acquire fence.
    producer: ProcessId,
    /// The exporter's acquire fence, if its offer carried one.
    acquire: Option<FenceHandle>,
    /// The backend's own stream waited for the acquire fence already.
    internal_ordered: AtomicBool,
    /// A part of a lease over several buffers: the acquire side its parts share.
    group: Option<Arc<GroupAcquire>>,
}

/// What the parts of one lease over several buffers share of their acquire side: the
/// exporter's acquire fences of every part, reduced (none covers another: a counter slot's
/// latest value stands for its earlier ones), and the streams that waited for all of them
/// already. A stream waits once for the whole lease, not once per part — its later work on
/// any part is queued after that wait — so a model lent as one lease over its 43 or 155
/// allocations costs one fence wait per stream, not one per allocation. Streams are known
/// by their [`StreamKey`] for the lease's life, as a lease's own uses are.
#[derive(Debug)]
pub(crate) struct GroupAcquire {
    producer: ProcessId,
    fences: Vec<FenceHandle>,
    waited: Mutex<Vec<StreamKey>>,
}

impl GroupAcquire {
    /// The shared acquire side of parts whose offers came from `producer` with `fences`.
    pub(crate) fn new(producer: ProcessId, fences: impl IntoIterator<Item = FenceHandle>) -> Self {
        let mut kept: Vec<FenceHandle> = Vec::new();
        for f in fences {
            if kept.iter().any(|k| k.covers(&f)) {
                continue;
            }
            kept.retain(|k| !f.covers(k));
            kept.push(f);
        }
        Self {
            producer,
            fences: kept,
            waited: Mutex::new(Vec::new()),
        }
    }

    /// `stream` waits for every part's acquire fence, unless it did already.
    fn wait(&self, backend: &SharedBackend, stream: StreamRef<'_>) -> Result<(), ActorError> {
        let key = stream.key();
        let mut waited = lock(&self.waited);
        if waited.contains(&key) {
            return Ok(());
        }
        for fence in &self.fences {
            backend
                .ordering()
                .order_after(stream, &self.producer, fence)?;
        }
        waited.push(key);
        Ok(())
    }
}

/// What is left of a dropped lease: the fence its `Release` carries, or the marks to wait
/// for (on a driver thread) before it is sent, when no fence could be made.
pub(crate) enum Finished {
    /// Nothing queued uses the buffer.
    Idle,
    /// A release fence after every use.
    Fence(Arc<dyn ExportedFence>),
    /// No fence could be made (every pooled event is in use): wait for these first.
    Wait(Vec<Arc<dyn UseMark>>),
}

impl LeaseOrder {
    pub(crate) fn new(
        backend: SharedBackend,
        producer: ProcessId,
        acquire: Option<FenceHandle>,
    ) -> Self {
        Self {
            uses: StreamUses::new(backend),
            producer,
            acquire,
            internal_ordered: AtomicBool::new(false),
            group: None,
        }
    }

    /// A part of a lease over several buffers: its streams wait for the fences of every
    /// part, once per stream for all the parts (see [`GroupAcquire`]). `group` must cover
    /// this part's own acquire fence.
    pub(crate) fn in_group(mut self, group: Arc<GroupAcquire>) -> Self {
        self.group = Some(group);
        self
    }

    /// The one stream it was used on, when it was used on one only and was told about it
    /// with `wait_on` (its release can then be recorded there by another part's, later).
    pub(crate) fn held_stream(&self) -> Option<StreamKey> {
        let mut uses = self.uses.marks();
        match (uses.next(), uses.next()) {
            (Some(only), None) => only.held.get().map(|_| only.key),
            _ => None,
        }
    }

    /// Takes its uses and fences out, leaving one with none (for a guard that hands its
    /// release over before it drops).
    pub(crate) fn take(&mut self) -> LeaseOrder {
        let empty = LeaseOrder::new(self.uses.backend.clone(), self.producer, None);
        std::mem::replace(self, empty)
    }

    /// The exporter's acquire fence, and who recorded it.
    pub(crate) fn acquire(&self) -> Option<(&ProcessId, &FenceHandle)> {
        self.acquire.as_ref().map(|f| (&self.producer, f))
    }

    fn wait_acquire(&self, stream: StreamRef<'_>) -> Result<(), ActorError> {
        let Some(fence) = &self.acquire else {
            return Ok(());
        };
        match &self.group {
            Some(group) => group.wait(&self.uses.backend, stream),
            None => Ok(self
                .uses
                .backend
                .ordering()
                .order_after(stream, &self.producer, fence)?),
        }
    }

    /// Before a host copy (on the backend's own stream, synchronised before it returns):
    /// that stream waits for the acquire fence (once) and for the lease's uses on other
    /// streams (so a copy sees what a kernel of ours wrote).
    pub(crate) fn before_host_copy(&self) -> Result<(), ActorError> {
        if self.acquire.is_some() && !self.internal_ordered.load(Ordering::Acquire) {
            self.wait_acquire(StreamRef::Internal)?;
            self.internal_ordered.store(true, Ordering::Release);
        }
        self.uses.order_after_others(StreamRef::Internal)
    }

    /// Before a use on `stream`: on the first, it waits for the acquire fence; returns the
    /// mark to record after the use (`None`: no mark; make the use complete instead).
    pub(crate) fn use_on(&self, stream: StreamRef<'_>) -> Result<Option<&dyn UseMark>, ActorError> {
        Ok(
            match self.uses.get_or_add(stream, || self.wait_acquire(stream))? {
                Found::Known(u) | Found::New(u) => Some(&*u.mark),
                Found::Unmarked | Found::Full => None,
            },
        )
    }

    /// `stream` waits for the acquire fence (once), and the lease records its release mark
    /// there when it drops, after everything queued there by then.
    pub(crate) fn wait_on(&self, stream: Stream) -> Result<(), ActorError> {
        match self
            .uses
            .get_or_add(stream.as_ref(), || self.wait_acquire(stream.as_ref()))?
        {
            Found::Known(u) | Found::New(u) => {
                // A stream named twice keeps the first name (the same stream).
                let _ = u.held.set(stream);
                Ok(())
            }
            Found::Unmarked => Ok(()),
            Found::Full => Err(ActorError::TooManyStreams { max: MAX_STREAMS }),
        }
    }

    /// Every use of the lease has completed (its holder synchronised the device after
    /// them): forgets them, so that [`finish`](Self::finish) finds nothing to fence.
    pub(crate) fn settle(&mut self) {
        drop(std::mem::take(&mut self.uses.slots));
    }

    /// A lease used on one stream only, named with `wait_on`: the release fence written on
    /// that stream itself, after everything queued there by now — where its mark would be
    /// recorded — with no mark and no release stream
    /// ([`StreamOrdering::export_fence_on`](baton_ipc::StreamOrdering::export_fence_on)).
    /// `None` (then the marks make it) if the lease used other streams or the backend has
    /// no such fence now.
    fn fence_on_held_stream(&self) -> Option<Arc<dyn ExportedFence>> {
        let mut uses = self.uses.marks();
        let (only, None) = (uses.next()?, uses.next()) else {
            return None;
        };
        let stream = only.held.get()?;
        match self
            .uses
            .backend
            .ordering()
            .export_fence_on(stream, &self.producer)
        {
            Ok(fence) => fence,
            Err(e) => {
                tracing::debug!(error = %e, "no release fence on the lease's stream: its mark makes one");
                None
            }
        }
    }

    /// The lease drops: marks are recorded on the streams named with `wait_on`, then turned
    /// into one release fence (on a release stream of the backend), unless the lease used
    /// one stream only, which then writes it itself.
    pub(crate) fn finish(&mut self) -> Finished {
        if let Some(fence) = self.fence_on_held_stream() {
            return Finished::Fence(fence);
        }
        let mut any = false;
        for u in self.uses.marks() {
            any = true;
            if let Some(stream) = u.held.get() {
                if let Err(e) = u.mark.record(stream.as_ref()) {
                    tracing::warn!(error = %e, "recording a lease's release mark failed");
                }
            }
        }
        if !any {
            return Finished::Idle;
        }
        match self.uses.export(&self.producer) {
            Ok(Some(fence)) => Finished::Fence(fence),
            Ok(None) => Finished::Idle,
            Err(e) => {
                tracing::warn!(error = %e, "no release fence: the release waits for the lease's work first");
                let slots = std::mem::take(&mut self.uses.slots).into_inner();
                Finished::Wait(
                    slots
                        .into_iter()
                        .flat_map(|slots| *slots)
                        .filter_map(OnceLock::into_inner)
                        .map(|u| u.mark)
                        .collect(),
                )
            }
        }
    }
}

/// The exporter's side (see the module docs).
#[derive(Debug)]
pub(crate) struct ExportOrder {
    uses: StreamUses,
    /// Importers' release fences not yet waited for by any stream of ours.
    released: Mutex<Vec<ReleaseFence>>,
    /// Release fences a stream waited for ([`wait_on`](Self::wait_on)) whose mark has not
    /// been recorded since: other streams, host copies and offers wait for them as well,
    /// until a [`mark_on`](Self::mark_on) covers them.
    unrecorded: Mutex<Vec<(StreamKey, ReleaseFence)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ExportOrder {
    pub(crate) fn new(backend: SharedBackend) -> Self {
        Self {
            uses: StreamUses::new(backend),
            released: Mutex::new(Vec::new()),
            unrecorded: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn backend(&self) -> &SharedBackend {
        self.uses.backend()
    }

    /// An importer gave a lease back after `fences`. A fence covered by one in line is
    /// dropped, and one in line that the new one covers goes: the line holds at most one
    /// fence per (producer, counter slot or event), however many releases come between
    /// two uses.
    pub(crate) fn released(&self, fences: impl IntoIterator<Item = ReleaseFence>) {
        use crate::ledger::Covers;
        let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        for f in fences {
            if released.iter().any(|kept| kept.covers(&f)) {
                continue;
            }
            released.retain(|kept| !f.covers(kept));
            released.push(f);
        }
    }

    fn take_released(&self) -> Vec<ReleaseFence> {
        std::mem::take(&mut *lock(&self.released))
    }

    /// Makes `stream` wait for the latest mark of every other stream and for the release
    /// fences other streams waited for without a mark since; returns those fences.
    fn order_after_others(&self, stream: StreamRef<'_>) -> Result<Vec<ReleaseFence>, ActorError> {
        self.uses.order_after_others(stream)?;
        let key = stream.key();
        let others: Vec<ReleaseFence> = lock(&self.unrecorded)
            .iter()
            .filter(|(k, _)| *k != key)
            .map(|(_, f)| f.clone())
            .collect();
        for f in &others {
            self.backend()
                .ordering()
                .order_after(stream, &f.producer, &f.fence)?;
        }
        Ok(others)
    }

    /// A mark just recorded on `stream` follows `covered` (fences it waited for) and every
    /// fence `stream` itself waited for before `own` was taken: they leave the list.
    fn recorded(&self, key: StreamKey, own: &[ReleaseFence], covered: &[ReleaseFence]) {
        lock(&self.unrecorded).retain(|(k, f)| {
            let mine = *k == key && own.contains(f);
            !(mine || covered.contains(f))
        });
    }

    /// Makes `stream` wait for `fences`, taken from the line.
    fn order_released(
        &self,
        stream: StreamRef<'_>,
        fences: &[ReleaseFence],
    ) -> Result<bool, ActorError> {
        for f in fences {
            self.backend()
                .ordering()
                .order_after(stream, &f.producer, &f.fence)?;
        }
        Ok(!fences.is_empty())
    }

    /// Runs `step` with fences taken from the line (waited for by a stream whose mark may
    /// not be recorded yet); on its error they go back in line, so that the next use, an
    /// offer and the free still wait for them (waiting twice is harmless).
    fn with_released<R>(
        &self,
        step: impl FnOnce(&[ReleaseFence]) -> Result<R, ActorError>,
    ) -> Result<R, ActorError> {
        let taken = self.take_released();
        let done = step(&taken);
        if done.is_err() {
            self.released(taken);
        }
        done
    }

    /// Before a host copy (on the backend's own stream, synchronised before it returns):
    /// it waits for the importers' release fences and the buffer's uses on other streams.
    pub(crate) fn before_host_copy(&self) -> Result<(), ActorError> {
        self.with_released(|taken| {
            self.order_released(StreamRef::Internal, taken)?;
            self.order_after_others(StreamRef::Internal).map(drop)
        })
    }

    /// Before a use on `stream`: it waits for the importers' release fences and the
    /// buffer's uses on other streams; returns the mark to record after the use.
    pub(crate) fn use_on(&self, stream: StreamRef<'_>) -> Result<Option<&dyn UseMark>, ActorError> {
        self.with_released(|taken| {
            let waited = self.order_released(stream, taken)?;
            self.order_after_others(stream)?;
            let mark = match self.uses.get_or_add(stream, || Ok(()))? {
                Found::Known(u) | Found::New(u) => &*u.mark,
                Found::Unmarked | Found::Full => return Ok(None),
            };
            if waited {
                // Other streams order after this one's mark: record it now, so that they
                // wait for the release fences too even before this use is recorded.
                mark.record(stream)?;
            }
            Ok(Some(mark))
        })
    }

    /// [`Buffer::wait_on`](crate::Buffer::wait_on): as [`use_on`](Self::use_on), but on a
    /// stream of the caller's the mark is not recorded now — its
    /// [`mark_on`](Self::mark_on) (`share_on`) records it after its work. Until then the
    /// release fences `stream` waited for stay listed, and other streams, host copies and
    /// offers wait for them too. (One driver call less per stream-ordered handoff than
    /// recording twice; a `wait_on` followed by cudarc uses and a plain `share` costs two
    /// more instead, the offer's: the backend's own stream takes the fences in.)
    pub(crate) fn wait_on(&self, stream: StreamRef<'_>) -> Result<(), ActorError> {
        if matches!(stream, StreamRef::Internal) {
            // The backend's own stream (host copies, Python's conservative views): no
            // `share_on` follows to record it.
            return self.use_on(stream).map(drop);
        }
        let kept = self.with_released(|taken| {
            let waited = self.order_released(stream, taken)?;
            self.order_after_others(stream)?;
            match self.uses.get_or_add(stream, || Ok(()))? {
                Found::Known(_) | Found::New(_) => Ok(waited.then(|| taken.to_vec())),
                Found::Unmarked => Ok(None),
                // Not tracked: its work is never followed by a mark. The fences go back
                // in line for the next tracked use.
                Found::Full => Err(ActorError::TooManyStreams { max: MAX_STREAMS }),
            }
        })?;
        if let Some(kept) = kept {
            self.unrecorded_on(stream.key(), kept);
        }
        Ok(())
    }

    /// `stream` (keyed `key`) waited for `fences` and its mark is not recorded yet: they
    /// stay listed until it is (a fence covered by one listed for the same stream is not
    /// listed twice).
    fn unrecorded_on(&self, key: StreamKey, fences: Vec<ReleaseFence>) {
        use crate::ledger::Covers;
        let mut unrecorded = lock(&self.unrecorded);
        for f in fences {
            if unrecorded
                .iter()
                .any(|(k, old)| *k == key && old.covers(&f))
            {
                continue;
            }
            unrecorded.retain(|(k, old)| !(*k == key && f.covers(old)));
            unrecorded.push((key, f));
        }
    }

    /// Whether `orders` can be ordered on a stream together: two or more, one backend.
    fn together(orders: &[&ExportOrder], stream: StreamRef<'_>) -> bool {
        orders.len() > 1
            && !matches!(stream, StreamRef::Internal)
            && orders
                .iter()
                .all(|o| Arc::ptr_eq(o.backend(), orders[0].backend()))
    }

    /// Runs `step` with the release fences taken from every order's line and the stream
    /// made to wait once for all of them (reduced: a fence another covers is waited for
    /// through that one); on its error, or the wait's, each order's go back in line.
    fn with_released_all<R>(
        orders: &[&ExportOrder],
        stream: StreamRef<'_>,
        step: impl FnOnce(&[Vec<ReleaseFence>]) -> Result<R, ActorError>,
    ) -> Result<R, ActorError> {
        use crate::ledger::Covers;
        let taken: Vec<Vec<ReleaseFence>> = orders.iter().map(|o| o.take_released()).collect();
        let mut all: Vec<&ReleaseFence> = Vec::new();
        for f in taken.iter().flatten() {
            if all.iter().any(|kept| kept.covers(f)) {
                continue;
            }
            all.retain(|kept| !f.covers(kept));
            all.push(f);
        }
        let backend = orders[0].backend();
        let done = all
            .iter()
            .try_for_each(|f| {
                backend
                    .ordering()
                    .order_after(stream, &f.producer, &f.fence)
            })
            .map_err(ActorError::from)
            .and_then(|()| step(&taken));
        if done.is_err() {
            for (o, fences) in orders.iter().zip(taken) {
                o.released(fences);
            }
        }
        done
    }

    /// [`wait_on`](Self::wait_on) for several buffers (`AnyBuffer::wait_all_on`): `stream`
    /// waits once for the release fences of all of them — a lease over several buffers
    /// comes back with one fence, which each buffer's line holds — not once per buffer.
    pub(crate) fn wait_all_on(
        orders: &[&ExportOrder],
        stream: StreamRef<'_>,
    ) -> Result<(), ActorError> {
        if !Self::together(orders, stream) {
            return orders.iter().try_for_each(|o| o.wait_on(stream));
        }
        let kept = Self::with_released_all(orders, stream, |taken| {
            for o in orders {
                o.order_after_others(stream)?;
            }
            let (tracked, _) = Self::uses_together(orders, stream)?;
            // Each buffer's own fences stay listed until its mark is recorded (as
            // `wait_on` keeps them).
            Ok(taken
                .iter()
                .zip(tracked)
                .map(|(own, tracked)| if tracked { own.clone() } else { Vec::new() })
                .collect::<Vec<_>>())
        })?;
        let key = stream.key();
        for (o, kept) in orders.iter().zip(kept) {
            o.unrecorded_on(key, kept);
        }
        Ok(())
    }

    /// Each order's use of `stream`, a new one taking the first mark found there (one
    /// mark for buffers first used together: see [`StreamUse::mark`]): whether each is
    /// tracked there, and the distinct marks.
    fn uses_together(
        orders: &[&ExportOrder],
        stream: StreamRef<'_>,
    ) -> Result<(Vec<bool>, Marks), ActorError> {
        let mut tracked = Vec::with_capacity(orders.len());
        let mut marks: Marks = Vec::new();
        for o in orders {
            let mark = match o.uses.get_or_adopt(stream, || Ok(()), marks.first())? {
                Found::Known(u) | Found::New(u) => &u.mark,
                Found::Unmarked => {
                    tracked.push(false);
                    continue;
                }
                Found::Full => return Err(ActorError::TooManyStreams { max: MAX_STREAMS }),
            };
            tracked.push(true);
            if !marks.iter().any(|m| Arc::ptr_eq(m, mark)) {
                marks.push(Arc::clone(mark));
            }
        }
        Ok((tracked, marks))
    }

    /// [`mark_on`](Self::mark_on) for several buffers (`AnyBuffer::share_all_on`): `stream`
    /// waits once for all their release fences, and one mark, shared by every buffer that
    /// has none of its own there yet, is recorded once, after everything queued there so
    /// far — one wait and one record for a lease over many buffers, and one acquire fence
    /// for all of them at the send ([`acquire_fence_for_part`](Self::acquire_fence_for_part)).
    pub(crate) fn mark_all_on(
        orders: &[&ExportOrder],
        stream: StreamRef<'_>,
    ) -> Result<(), ActorError> {
        if !Self::together(orders, stream) {
            return orders.iter().try_for_each(|o| o.mark_on(stream));
        }
        let key = stream.key();
        Self::with_released_all(orders, stream, |_| {
            let covered = orders
                .iter()
                .map(|o| o.order_after_others(stream))
                .collect::<Result<Vec<_>, _>>()?;
            let (_, marks) = Self::uses_together(orders, stream)?;
            let own: Vec<Vec<ReleaseFence>> = orders
                .iter()
                .map(|o| {
                    lock(&o.unrecorded)
                        .iter()
                        .filter(|(k, _)| *k == key)
                        .map(|(_, f)| f.clone())
                        .collect()
                })
                .collect();
            for mark in &marks {
                mark.record(stream)?;
            }
            for ((o, own), covered) in orders.iter().zip(&own).zip(&covered) {
                o.recorded(key, own, covered);
            }
            Ok(())
        })
    }

    /// [`Buffer::share_on`](crate::Buffer::share_on): `stream` waits as for a use, and the
    /// buffer's mark is recorded there now, after everything queued there so far.
    pub(crate) fn mark_on(&self, stream: StreamRef<'_>) -> Result<(), ActorError> {
        self.with_released(|taken| {
            self.order_released(stream, taken)?;
            let covered = self.order_after_others(stream)?;
            let key = stream.key();
            let own: Vec<ReleaseFence> = lock(&self.unrecorded)
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, f)| f.clone())
                .collect();
            let mark = match self.uses.get_or_add(stream, || Ok(()))? {
                Found::Known(u) | Found::New(u) => &*u.mark,
                Found::Unmarked => return Ok(()),
                Found::Full => return Err(ActorError::TooManyStreams { max: MAX_STREAMS }),
            };
            mark.record(stream)?;
            self.recorded(key, &own, &covered);
            Ok(())
        })
    }

    /// The acquire fence for an offer to process `to`: after the buffer's uses on streams
    /// and after the work of importers that gave it back since its last use here (`None`
    /// if there is none: host copies complete before they return, and without a fence
    /// inbox from `to` the work is waited for here). One per offer: an event fence's lease
    /// keeps it until it is back, as the pooled events' reuse contract asks.
    pub(crate) fn acquire_fence(
        &self,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>, ActorError> {
        self.acquire_fence_for_part(to, &mut None, false)
    }

    /// [`acquire_fence`](Self::acquire_fence) of a part of a lease over several buffers,
    /// `before` the fence of the part before it: a part with nothing in line whose fence
    /// would follow exactly the marks that one followed (a lease's buffers marked together
    /// by [`mark_all_on`](Self::mark_all_on)) takes that fence as it is — one acquire fence
    /// per stream for the whole lease, not one per buffer. It follows those marks' records
    /// up to the earlier part's send, which is after this part's `share_on`: all the
    /// offer promises. `before` then holds this part's when the next offer is a part of
    /// the same lease (`next_joins`); otherwise nothing is kept, and an offer of one buffer
    /// (no `before`, no next part) lists no marks.
    pub(crate) fn acquire_fence_for_part(
        &self,
        to: &ProcessId,
        before: &mut Option<PartFence>,
        next_joins: bool,
    ) -> Result<Option<Arc<dyn ExportedFence>>, ActorError> {
        let quiet = lock(&self.released).is_empty() && lock(&self.unrecorded).is_empty();
        if !quiet {
            *before = None;
            return self.acquire_fence_in_line(to);
        }
        if !next_joins && before.as_ref().is_none_or(|b| b.to != *to) {
            *before = None;
            return self.uses.export(to);
        }
        let marks = self.uses.mark_ids();
        if let Some(kept) = before.as_ref().filter(|b| b.to == *to && b.marks == marks) {
            let fence = kept.fence.clone();
            if !next_joins {
                *before = None;
            }
            return Ok(fence);
        }
        let fence = self.uses.export(to)?;
        *before = next_joins.then(|| PartFence {
            to: *to,
            marks,
            fence: fence.clone(),
        });
        Ok(fence)
    }

    fn acquire_fence_in_line(
        &self,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>, ActorError> {
        let mut released = self.take_released();
        // Fences a stream waited for with no mark since (a `wait_on` not followed by a
        // `share_on`): the backend's own stream takes them in as well.
        let unrecorded: Vec<ReleaseFence> = lock(&self.unrecorded)
            .iter()
            .map(|(_, f)| f.clone())
            .collect();
        released.extend(unrecorded.iter().cloned());
        if !released.is_empty() {
            // The next importer must not see the buffer before the last one's work ends:
            // the backend's own stream takes the release fences in, and its mark (recorded
            // at once) goes into the acquire fence. (On failure the fences go back in line:
            // waiting on them twice is harmless.)
            let marked = self
                .order_released(StreamRef::Internal, &released)
                .and_then(|_| self.uses.get_or_add(StreamRef::Internal, || Ok(())))
                .and_then(|found| match found {
                    Found::Known(u) | Found::New(u) => Ok(u.mark.record(StreamRef::Internal)?),
                    Found::Unmarked => Ok(()),
                    Found::Full => Err(ActorError::TooManyStreams { max: MAX_STREAMS }),
                });
            if let Err(e) = marked {
                self.released(released);
                return Err(e);
            }
            self.recorded(StreamKey::Internal, &[], &unrecorded);
        }
        self.uses.export(to)
    }

    /// Before the free (on a driver thread): whether the memory may be freed, once every
    /// release fence and every use of the buffer on a stream has completed (waited for
    /// here). Every wait is on this process's own fence inbox, which the backend releases
    /// within the fence deadline if a producer dies or does not deliver — so this returns
    /// within it. A fence whose wait was released while its producer lives guards work that
    /// may still run: the free must wait for those producers' deaths (nothing is waited
    /// for then). The fences stay in line for a later call.
    pub(crate) fn before_free(&self, fences: &[ReleaseFence]) -> FreeVerdict {
        let mut all = self.take_released();
        let unrecorded: Vec<ReleaseFence> = lock(&self.unrecorded)
            .iter()
            .map(|(_, f)| f.clone())
            .collect();
        for f in unrecorded.iter().chain(fences) {
            if !all.iter().any(|kept| kept == f) {
                all.push(f.clone());
            }
        }
        let backend = Arc::clone(self.backend());
        let mut alive: Vec<ProcessId> = all
            .iter()
            .filter(|f| backend.ordering().unsafe_to_free(&f.producer, &f.fence))
            .map(|f| f.producer)
            .collect();
        alive.sort_unstable_by_key(|p| (p.pid, p.start_ticks));
        alive.dedup();
        if !alive.is_empty() {
            self.released(all);
            return FreeVerdict::Hold(alive);
        }
        let any = !all.is_empty() || self.uses.marks().next().is_some();
        let waited = || -> Result<(), ActorError> {
            self.order_released(StreamRef::Internal, &all)?;
            self.uses.order_after_others(StreamRef::Internal)?;
            if any {
                backend.ordering().synchronize()?;
            }
            Ok(())
        };
        if let Err(e) = waited() {
            return FreeVerdict::Failed(e);
        }
        let checked = all;
        // The deadline may have released a wait while we waited: then it guards work
        // that may still run after all.
        let mut alive: Vec<ProcessId> = checked
            .iter()
            .filter(|f| backend.ordering().unsafe_to_free(&f.producer, &f.fence))
            .map(|f| f.producer)
            .collect();
        if alive.is_empty() {
            return FreeVerdict::Free;
        }
        alive.sort_unstable_by_key(|p| (p.pid, p.start_ticks));
        alive.dedup();
        self.released(checked);
        FreeVerdict::Hold(alive)
    }
}

/// The acquire fence a part of a lease over several buffers got, for the next part (see
/// [`ExportOrder::acquire_fence_for_part`]).
pub(crate) struct PartFence {
    to: ProcessId,
    /// The marks it follows ([`StreamUses::mark_ids`]).
    marks: Vec<usize>,
    fence: Option<Arc<dyn ExportedFence>>,
}

/// What [`ExportOrder::before_free`] found.
#[derive(Debug)]
pub(crate) enum FreeVerdict {
    /// Nothing queued uses the memory any more: free it.
    Free,
    /// Work of these live processes may still use it (our waits on their fences were
    /// released early): keep it until they are dead, then ask again.
    Hold(Vec<ProcessId>),
    /// Waiting failed: whether work still uses the memory is unknown, so it is kept.
    Failed(ActorError),
}
