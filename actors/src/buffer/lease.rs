//! The importer's side and the wire's: [`Shared<T>`] and [`SharedMut<T>`] (a buffer inside a
//! message), [`Lease<T>`] and [`LeaseMut<T>`] (the receiver's guards), and the crate's
//! untyped [`IncomingLease`]/[`HeldLease`]/[`Outgoing`] they are made of. See the
//! [parent module](super) for the rules they keep.

use super::*;
use crate::order::PartFence;
use crate::paths::LeasePath;
use baton_ipc::StreamKey;

/// A message's leases as they arrive, each boxed where it is made (544 bytes: every later
/// move — into the decoder's table, a `Shared`, the user's lease — moves a pointer).
pub(crate) type IncomingLeases = Vec<Box<IncomingLease>>;

/// An importer's lease before it is typed: the mapping, the lease, and the link to release
/// it on.
pub(crate) struct IncomingLease {
    /// `Some` until drop, which unmaps before it sends `Release`.
    pub(crate) imported: Option<Imported>,
    pub(crate) lease: LeaseId,
    pub(crate) link: LinkHandle,
    pub(crate) held: Arc<HeldLease>,
    /// Its uses on streams and the acquire fence they wait on.
    pub(crate) order: LeaseOrder,
    /// A copy of a buffer from another host: our own buffer (the view maps it), whose
    /// lease went back when its bytes landed — nothing to release, never orphaned.
    pub(crate) copy: Option<Arc<BufferCell>>,
    /// How its bytes reached us ([`Lease::path`]).
    pub(crate) path: LeasePath,
    /// A part of a lease over several buffers: the parts' guards share this, and the last
    /// to drop sends the lease's `Release` (see [`LeaseParts`]).
    pub(crate) parts: Option<Arc<LeaseParts>>,
}

/// The parts of a lease over several buffers, gathering what each part's guard leaves as
/// it drops: the release fences (only those no other covers: a counter slot's latest
/// value covers its earlier ones, so at most one per slot) and what must be waited for.
/// The last part to drop — when this drops — sends the lease's one `Release`, with them.
///
/// A part used on one stream only (named with `wait_on`) leaves its uses and its mapping
/// instead of a fence: when the last part drops, one release is recorded on each such
/// stream, after every part's work queued there, and covers every part used on it — one
/// fence write per stream for the whole lease, not one per part. Its mapping stays until
/// then (the exporter frees nothing before the `Release` anyway).
pub(crate) struct LeaseParts {
    lease: LeaseId,
    link: LinkHandle,
    back: std::sync::Mutex<PartsBack>,
}

#[derive(Default)]
struct PartsBack {
    fences: Vec<Arc<dyn ExportedFence>>,
    pending: Option<PendingRelease>,
    /// Parts used on one stream only, by that stream: their release is recorded once the
    /// last part drops.
    on_one_stream: Vec<(StreamKey, LeaseOrder, Option<Imported>)>,
    /// Given back already, unopened (the link refused the frame): nothing to send.
    refused: bool,
}

impl PartsBack {
    /// A part's release fence, kept unless one kept covers it.
    fn fence(&mut self, fence: Arc<dyn ExportedFence>) {
        let handle = fence.handle();
        if !self.fences.iter().any(|f| f.handle().covers(&handle)) {
            self.fences.retain(|f| !handle.covers(&f.handle()));
            self.fences.push(fence);
        }
    }

    /// A part's uses to wait for, when no fence could be made.
    fn pending(&mut self, p: PendingRelease) {
        let all = (self.pending).get_or_insert_with(|| PendingRelease::new(Vec::new(), None));
        all.marks.extend(p.marks);
        all.fences.extend(p.fences);
        all.imported.extend(p.imported);
    }

    /// The release of the parts used on one stream only: per stream, that of the part
    /// dropped last, recorded there now, after every part's work on it, covers them all
    /// (the others' uses go unrecorded: they are before it on the same stream).
    fn finish_on_one_stream(&mut self) {
        let mut left = std::mem::take(&mut self.on_one_stream);
        while let Some((key, mut order, view)) = left.pop() {
            let mut views: Vec<Imported> = view.into_iter().collect();
            let (same, rest): (Vec<_>, Vec<_>) = left.into_iter().partition(|(k, ..)| *k == key);
            left = rest;
            views.extend(same.into_iter().filter_map(|(_, _, view)| view));
            match order.finish() {
                Finished::Idle => drop(views),
                Finished::Fence(fence) => {
                    for view in views {
                        view.release_after(fence.local_handle());
                    }
                    self.fence(fence);
                }
                Finished::Wait(marks) => self.pending(PendingRelease {
                    marks,
                    fences: Vec::new(),
                    imported: views,
                }),
            }
        }
    }
}

impl LeaseParts {
    pub(crate) fn new(lease: LeaseId, link: LinkHandle) -> Arc<Self> {
        Arc::new(Self {
            lease,
            link,
            back: std::sync::Mutex::new(PartsBack::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PartsBack> {
        self.back.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The link gave the lease back itself (a part could not be opened): the parts
    /// opened already send nothing when they drop.
    pub(crate) fn refused(&self) {
        self.lock().refused = true;
    }

    /// A part dropped, leaving `fence` (after its uses) or `pending` (its uses to wait
    /// for, when no fence could be made).
    fn part_back(&self, fence: Option<Arc<dyn ExportedFence>>, pending: Option<PendingRelease>) {
        let mut back = self.lock();
        if let Some(fence) = fence {
            back.fence(fence);
        }
        if let Some(p) = pending {
            back.pending(p);
        }
    }

    /// A part used on stream `key` only dropped: its release is recorded with the last
    /// part's (see [`LeaseParts`]).
    fn part_on_one_stream(&self, key: StreamKey, order: LeaseOrder, view: Option<Imported>) {
        self.lock().on_one_stream.push((key, order, view));
    }
}

impl Drop for LeaseParts {
    fn drop(&mut self) {
        let mut back = std::mem::take(&mut *self.lock());
        back.finish_on_one_stream();
        let mut pending = back.pending;
        let mut fences = back.fences;
        // More than a `Release` may carry (event fences: none covers another): the
        // oldest are waited for before it goes.
        let over = fences
            .len()
            .saturating_sub(baton_messages::protocol::MAX_RELEASE_FENCES);
        if over > 0 {
            let waited = fences.drain(..over);
            (pending.get_or_insert_with(|| PendingRelease::new(Vec::new(), None)))
                .fences
                .extend(waited);
        }
        if back.refused {
            if let Some(pending) = pending {
                pending.wait();
            }
        } else if self.link.is_alive() {
            self.link.do_send(ReleaseLease {
                lease: self.lease,
                fences: fences.iter().map(|f| f.handle()).collect(),
                pending: pending.map(Box::new),
            });
        } else if let Some(pending) = pending {
            // The exporter is gone; the mappings still must outlive our work on them.
            pending.wait();
        }
    }
}

impl LeasePath {
    /// The path of an offer mapped in place, from its handle, as `imported` opened it.
    pub(crate) fn mapped(raw: &baton_messages::RawHandle, imported: &Imported) -> Self {
        use baton_messages::RawHandle;
        let peer_gpu = imported.device() != imported.backend().device();
        match raw {
            RawHandle::HostMemfd { .. } => LeasePath::HostMemfd,
            RawHandle::HostSegment(_) => LeasePath::HostSegment,
            RawHandle::CudaIpc(_) => LeasePath::CudaLegacy { peer_gpu },
            RawHandle::CudaVmmFd { .. } => LeasePath::CudaVmm { peer_gpu },
            RawHandle::CudaPool { .. } => LeasePath::CudaPool { peer_gpu },
            // A copy is opened as our own buffer (`copied`), never mapped from its offer;
            // a handle kind newer than this match is labelled as such, not guessed.
            _ => LeasePath::Other,
        }
    }

    /// The path of a copy that landed in `cell`, our own buffer.
    pub(crate) fn copied(cell: &BufferCell) -> Self {
        match cell.alloc.backend() {
            baton_messages::BackendKind::Host => LeasePath::TcpCopy,
            _ => LeasePath::NcclCopy,
        }
    }
}

/// What the importer's link knows of a lease it holds: whether the exporter asked for it
/// back, and by when.
#[derive(Debug, Default)]
pub(crate) struct HeldLease {
    /// Milliseconds since `EPOCH` at which the revoke deadline passes (0: not revoked).
    revoke_deadline_ms: AtomicU64,
    /// Woken when the exporter asks for the lease back ([`Lease::revoked`]).
    revoked: tokio::sync::Notify,
    /// Opened writable ([`SharedMut::open`]): a forward to another host refuses it.
    writable: std::sync::atomic::AtomicBool,
}

fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl HeldLease {
    /// Whether it was opened writable (a [`LeaseMut`]).
    pub(crate) fn is_writable(&self) -> bool {
        self.writable.load(Ordering::Relaxed)
    }

    pub(crate) fn request_revoke(&self, within: Duration) {
        let at = Instant::now() + within;
        let ms = at.duration_since(epoch()).as_millis().max(1) as u64;
        self.revoke_deadline_ms.store(ms, Ordering::Release);
        self.revoked.notify_waiters();
    }

    /// Resolves with the revoke deadline once the exporter asks for the lease back.
    pub(crate) fn revoked(self: &Arc<Self>) -> impl Future<Output = Instant> + 'static + use<> {
        let held = Arc::clone(self);
        async move {
            loop {
                let notified = held.revoked.notified();
                let mut notified = std::pin::pin!(notified);
                // Registered before the check, so a revoke between the two wakes us.
                notified.as_mut().enable();
                if let Some(deadline) = held.revoke_deadline() {
                    return deadline;
                }
                notified.await;
            }
        }
    }

    pub(crate) fn revoke_deadline(&self) -> Option<Instant> {
        match self.revoke_deadline_ms.load(Ordering::Acquire) {
            0 => None,
            ms => Some(epoch() + Duration::from_millis(ms)),
        }
    }
}

impl IncomingLease {
    pub(crate) fn imported(&self) -> &Imported {
        // Only `drop` takes it.
        self.imported.as_ref().expect("present until drop")
    }

    pub(crate) fn live(&self) -> Result<&Imported, ActorError> {
        if self.copy.is_some() || self.link.is_alive() {
            Ok(self.imported())
        } else {
            Err(ActorError::Orphaned {
                exporter: self.link.peer(),
            })
        }
    }
}

impl Drop for IncomingLease {
    fn drop(&mut self) {
        // The release fence follows every use queued on a stream; the cache reference goes
        // (its mapping closes — after that fence — if it was the last), then the Release
        // with the fence, queued on the link without blocking.
        let imported = self.imported.take();
        if let Some(parts) = self.parts.take() {
            // A part of a lease over several buffers: the last part sends the `Release`.
            if let Some(key) = self.order.held_stream() {
                parts.part_on_one_stream(key, self.order.take(), imported);
                return;
            }
            let (fence, pending) = match self.order.finish() {
                Finished::Idle => {
                    drop(imported);
                    (None, None)
                }
                Finished::Fence(fence) => {
                    if let Some(imported) = imported {
                        imported.release_after(fence.local_handle());
                    }
                    (Some(fence), None)
                }
                Finished::Wait(marks) => (None, Some(PendingRelease::new(marks, imported))),
            };
            parts.part_back(fence, pending);
            return;
        }
        if let Some(copy) = self.copy.take() {
            // Our own buffer: the view goes after the work queued on it, then the buffer
            // (freed once nothing maps it); its lease went back when it landed.
            match self.order.finish() {
                Finished::Idle => drop(imported),
                Finished::Fence(fence) => {
                    if let Some(imported) = imported {
                        imported.release_after(fence.local_handle());
                    }
                }
                Finished::Wait(marks) => PendingRelease::new(marks, imported).wait(),
            }
            drop(copy);
            return;
        }
        let (fences, pending) = match self.order.finish() {
            Finished::Idle => {
                drop(imported);
                (Vec::new(), None)
            }
            Finished::Fence(fence) => {
                let handle = fence.handle();
                if let Some(imported) = imported {
                    // The mapping closes after our own work: the fence's local twin.
                    imported.release_after(fence.local_handle());
                }
                // Dropped now: a pooled release fence is recorded again only once its work
                // has completed (see `StreamOrdering::export_fence`).
                drop(fence);
                (vec![handle], None)
            }
            Finished::Wait(marks) => (Vec::new(), Some(PendingRelease::new(marks, imported))),
        };
        if self.link.is_alive() {
            self.link.do_send(ReleaseLease {
                lease: self.lease,
                fences,
                pending: pending.map(Box::new),
            });
        } else if let Some(pending) = pending {
            // The exporter is gone; the mapping still must outlive our work on it.
            pending.wait();
        }
    }
}

impl fmt::Debug for IncomingLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IncomingLease")
            .field("lease", &self.lease)
            .field("buffer", &self.imported)
            .field("orphaned", &!self.link.is_alive())
            .finish()
    }
}

/// A buffer on its way out: what the link needs to grant a lease on it.
pub(crate) struct Outgoing {
    pub(crate) cell: Arc<BufferCell>,
    /// A writable lease ([`Buffer::share_mut`]): granted only while no other lease that
    /// overlaps its range is out, and no lease that overlaps it is granted while it is.
    pub(crate) writable: bool,
    /// Recorded after the work that produced the buffer; kept with the lease. `None`: the
    /// buffer's own acquire fence (after its uses on streams), if it needs one.
    pub(crate) fence: Option<Arc<dyn ExportedFence>>,
    /// The part of the buffer a range lease covers ([`Buffer::share_range`]); `None`:
    /// all of it.
    pub(crate) part: Option<Part>,
    /// Leased as a part of the lease of the buffer before it in the message: one lease
    /// over several buffers ([`AnyShared::lease_with_previous`](crate::AnyShared::lease_with_previous)).
    pub(crate) joins: bool,
}

impl Outgoing {
    /// The layout of what the lease covers.
    pub(crate) fn layout(&self) -> &Layout {
        self.cell.layout_of(self.part.as_ref())
    }

    /// The offer's acquire fence, for process `to`: the buffer's own, or one after the
    /// fence the sender recorded itself (passed on into `to`'s inbox).
    pub(crate) fn acquire_fence(
        &self,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>, ActorError> {
        self.acquire_fence_after(to, &mut None, false)
    }

    /// [`acquire_fence`](Self::acquire_fence), `before` the fence of the offer before it in
    /// the frame: a part of the same lease whose fence would be that one's takes it
    /// ([`ExportOrder::acquire_fence_for_part`](crate::order::ExportOrder::acquire_fence_for_part)),
    /// and `before` keeps this one's when the next offer is a part too (`next_joins`).
    pub(crate) fn acquire_fence_after(
        &self,
        to: &ProcessId,
        before: &mut Option<PartFence>,
        next_joins: bool,
    ) -> Result<Option<Arc<dyn ExportedFence>>, ActorError> {
        if !self.joins {
            *before = None;
        }
        match &self.fence {
            Some(f) => {
                *before = None;
                let backend = self.cell.order.backend();
                let me = baton_ipc::process::current();
                Ok(backend.ordering().relay_fence(&me, &f.local_handle(), to)?)
            }
            None => self
                .cell
                .order
                .acquire_fence_for_part(to, before, next_joins),
        }
    }
}

pub(crate) enum SharedInner {
    /// On the sender's side: the buffer to lease out when the message is sent.
    Local(Outgoing),
    /// On the receiver's side: the lease, not yet opened.
    Incoming(Box<IncomingLease>),
}

/// A buffer of `T`s inside a message (see the [crate docs](crate)).
///
/// `Shared<T>` serializes only inside Baton's messages (as an index into the message's
/// leases); serializing it anywhere else is an error.
pub struct Shared<T: Element> {
    pub(crate) inner: SharedInner,
    pub(crate) _t: PhantomData<fn() -> T>,
}

impl<T: Element> fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            SharedInner::Local(out) => write!(f, "Shared(local {:?})", out.cell.id),
            SharedInner::Incoming(l) => write!(f, "Shared(received {:?})", l.lease),
        }
    }
}

impl<T: Element> Shared<T> {
    /// Whether this is a received buffer (as opposed to one about to be sent).
    pub fn is_received(&self) -> bool {
        matches!(self.inner, SharedInner::Incoming(_))
    }

    /// Sent as a part of the lease of the buffer serialized just before it in the same
    /// message: one lease over several buffers (see
    /// [`AnyShared::lease_with_previous`](crate::AnyShared::lease_with_previous)). Fields
    /// serialize in declaration order, and a `Vec`'s items in theirs:
    ///
    /// ```ignore
    /// Weights { parts: bufs.iter().enumerate().map(|(i, b)| match i {
    ///     0 => b.share(),
    ///     _ => b.share().lease_with_previous(),
    /// }).collect() }
    /// ```
    pub fn lease_with_previous(mut self) -> Self {
        if let SharedInner::Local(out) = &mut self.inner {
            out.joins = true;
        }
        self
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        match &self.inner {
            SharedInner::Local(out) => out.layout(),
            SharedInner::Incoming(l) => l.imported().layout().expect("typed on arrival"),
        }
    }

    /// Opens a received buffer as a typed lease.
    ///
    /// # Errors
    /// [`ActorError::NotReceived`] for a buffer that was not received.
    pub fn open(self) -> Result<Lease<T>, ActorError> {
        match self.inner {
            SharedInner::Incoming(inner) => Ok(Lease {
                inner,
                _t: PhantomData,
            }),
            SharedInner::Local(_) => Err(ActorError::NotReceived),
        }
    }
}

/// A buffer inside a message that its receiver may write: the sender puts
/// [`buffer.share_mut()`](Buffer::share_mut) in a field of this type, and the receiver
/// [`open`](Self::open)s a [`LeaseMut<T>`]. The write grant is in the message's type,
/// which both sides share: nothing about it crosses the wire, and a [`Shared<T>`] field
/// only ever opens read-only.
///
/// The exporter enforces one writer or many readers per byte range (see
/// [`Buffer::share_mut`] and [`Buffer::share_range_mut`]).
pub struct SharedMut<T: Element>(pub(crate) Shared<T>);

impl<T: Element> fmt::Debug for SharedMut<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedMut({:?})", self.0)
    }
}

impl<T: Element> SharedMut<T> {
    /// Whether this is a received buffer (as opposed to one about to be sent).
    pub fn is_received(&self) -> bool {
        self.0.is_received()
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        self.0.layout()
    }

    /// Opens a received buffer as a writable lease.
    ///
    /// # Errors
    /// [`ActorError::NotReceived`] for a buffer that was not received.
    pub fn open(self) -> Result<LeaseMut<T>, ActorError> {
        let lease = self.0.open()?;
        lease.inner.held.writable.store(true, Ordering::Relaxed);
        Ok(LeaseMut { lease })
    }
}

/// An importer's typed, read-only guard on another process's buffer (see the
/// [crate docs](crate)). A writable lease is a [`LeaseMut<T>`].
///
/// # Reading in place
///
/// [`as_slice`](Self::as_slice) gives a `&[T]` of host memory without a copy. It is sound
/// in safe code because nothing can write the memory through Baton's safe API while the
/// lease is out: a read-only lease has no write method, the exporter's
/// [`Buffer::write_at`] is refused while any lease on the buffer is out, and no writable
/// lease is granted on bytes a read-only one covers (nor the other way round: the rule
/// holds per byte range, and a range lease's slice is its range alone). What the API
/// cannot stop: `unsafe` code — or a raw pointer ([`Buffer::ptr`], [`Lease::ptr`],
/// `Imported::ptr`) dereferenced in `unsafe` code — in the exporter's process or another
/// importer's, which writes the shared pages directly (on one host an importer maps the
/// whole allocation, so a range lease's holder could reach past its range that way: see
/// [`Buffer::share_range`]); and another process of the same user that maps the memory
/// by itself. Baton authenticates its peers (same uid and the
/// session token) but does not sandbox them: a peer that writes under a reader breaks the
/// protocol, and the reader may see torn values (the memory never goes away under the
/// slice: the mapping lives as long as the lease).
///
/// A read-only lease has no write method, nor a writable view:
///
/// ```compile_fail
/// fn write(lease: &baton_actors::Lease<u32>) {
///     lease.write_at(0, &[1]).unwrap(); // only a LeaseMut writes
/// }
/// ```
///
/// ```compile_fail
/// fn write(mut lease: baton_actors::Lease<u32>) {
///     lease.as_mut_slice().unwrap()[0] = 1; // only a LeaseMut writes in place
/// }
/// ```
pub struct Lease<T: Element> {
    /// Boxed as it arrived (in [`Shared`]): a lease is 500-odd bytes, and a borrowed
    /// model's tens of parts each sync were copied whole at every move.
    inner: Box<IncomingLease>,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> Lease<T> {
    /// The untyped lease (for [`AnyLease`](crate::AnyLease)).
    pub(crate) fn into_inner(self) -> Box<IncomingLease> {
        self.inner
    }
}

/// The accessors of an importer's lease, typed ([`Lease<T>`]) or not
/// ([`AnyLease`](crate::AnyLease)), written once: each type has an `inner: IncomingLease`
/// field. The argument is the precise-capture list of the futures (`use<T>`, `use<>`).
macro_rules! lease_accessors {
    ($($capture:tt)*) => {
        /// The lease id (the exporter's).
        pub fn id(&self) -> ::baton_messages::LeaseId {
            self.inner.lease
        }

        /// Who exported the buffer.
        pub fn exporter(&self) -> ::baton_messages::ExporterId {
            self.inner.imported().exporter()
        }

        /// Whether the exporter is gone (its accessors then fail).
        pub fn is_orphaned(&self) -> bool {
            !self.inner.link.is_alive()
        }

        /// The deadline by which the exporter asked to have this lease back, if it did.
        /// Drop the lease before then, or the link is cut.
        pub fn revoke_deadline(&self) -> Option<::std::time::Instant> {
            self.inner.held.revoke_deadline()
        }

        /// Resolves with the deadline once the exporter asks for this lease back
        /// ([`Revoke`](crate::Revoke)); drop the lease before it, or the link is cut.
        /// Resolves at once if it already has; never, if it never does. The future borrows
        /// nothing, so the actor that holds the lease can handle its revoke itself:
        ///
        /// ```
        /// use actix::prelude::*;
        /// use baton_actors::Lease;
        /// use std::collections::HashMap;
        ///
        /// struct Holder {
        ///     leases: HashMap<u64, Lease<f32>>,
        /// }
        /// impl Actor for Holder {
        ///     type Context = Context<Self>;
        /// }
        /// impl Holder {
        ///     fn keep(&mut self, key: u64, lease: Lease<f32>, ctx: &mut Context<Self>) {
        ///         ctx.spawn(lease.revoked().into_actor(self).map(move |_deadline, act, _| {
        ///             act.leases.remove(&key); // dropping it gives it back
        ///         }));
        ///         self.leases.insert(key, lease);
        ///     }
        /// }
        /// ```
        ///
        /// [`Node::on_revoke`](crate::Node::on_revoke) reports every revoke of the node,
        /// by lease id, instead.
        pub fn revoked(
            &self,
        ) -> impl ::std::future::Future<Output = ::std::time::Instant> + 'static + $($capture)* {
            self.inner.held.revoked()
        }

        /// Where it is mapped in this process. The address stays valid while the lease
        /// lives (an orphaned lease included: its mapping closes when it drops). Before
        /// queuing work that uses it on a stream, call [`wait_on`](Self::wait_on) with that
        /// stream (cudarc's API does it for you for typed leases: `DevicePtr`).
        ///
        /// # Errors
        /// [`ActorError::Orphaned`](crate::ActorError::Orphaned).
        pub fn ptr(&self) -> Result<::baton_ipc::MemPtr, $crate::ActorError> {
            Ok(self.inner.live()?.ptr())
        }

        /// Orders the work you queue on `stream` from now on after the exporter's work that
        /// produced the buffer (the stream waits on the offer's acquire fence, once per
        /// stream), and keeps `stream`: dropping the lease records its release fence there,
        /// after everything queued by then.
        ///
        /// # Errors
        /// [`ActorError::Orphaned`](crate::ActorError::Orphaned); a backend error (the
        /// fence cannot be opened, the stream is not of the backend's device);
        /// [`ActorError::TooManyStreams`](crate::ActorError::TooManyStreams).
        pub fn wait_on(
            &self,
            stream: impl Into<::baton_ipc::Stream>,
        ) -> Result<(), $crate::ActorError> {
            self.inner.live()?;
            self.inner.order.wait_on(stream.into())
        }

        /// Whether it is device memory of a CUDA backend (cudarc's traits apply).
        pub fn is_device(&self) -> bool {
            matches!(self.inner.imported().ptr(), ::baton_ipc::MemPtr::Device(_))
                && self.inner.imported().backend().cuda().is_some()
        }

        /// The import view, for backend-specific work (e.g. a kernel reading it).
        ///
        /// # Errors
        /// [`ActorError::Orphaned`](crate::ActorError::Orphaned).
        pub fn imported(&self) -> Result<&::baton_ipc::Imported, $crate::ActorError> {
            self.inner.live()
        }

        /// How its bytes reached this process (see [`LeasePath`](crate::LeasePath)).
        pub fn path(&self) -> $crate::LeasePath {
            self.inner.path
        }

        /// Gives the lease back now (the same as dropping it).
        pub fn release(self) {}
    };
}
pub(crate) use lease_accessors;

impl<T: Element> fmt::Debug for Lease<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Lease").field(&self.inner).finish()
    }
}

impl<T: Element> Lease<T> {
    lease_accessors!(use<T>);

    /// Elements leased: the buffer's, or a range lease's (its element 0 is the range's
    /// first).
    pub fn len(&self) -> usize {
        self.inner.imported().len() / size_of::<T>()
    }

    /// Whether it has no elements (never, for a valid handle).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its shape.
    pub fn shape(&self) -> &Shape {
        &self.layout().shape
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        self.inner.imported().layout().expect("typed on arrival")
    }

    /// Reads elements starting at `index` into `out` (on the backend's own stream, after
    /// the exporter's work that produced the buffer; done when it returns).
    ///
    /// # Errors
    /// [`ActorError::Orphaned`], [`ActorError::OutOfBounds`], or a backend error.
    pub fn read_into(&self, index: usize, out: &mut [T]) -> Result<(), ActorError> {
        let imported = self.inner.live()?;
        let at = byte_range::<T>(index, out.len(), self.len())?;
        self.inner.order.before_host_copy()?;
        Ok(imported.read(at, bytemuck::cast_slice_mut(out))?)
    }

    /// All elements, copied out.
    ///
    /// # Errors
    /// As [`read_into`](Self::read_into).
    pub fn to_vec(&self) -> Result<Vec<T>, ActorError> {
        let mut v = vec![T::zeroed(); self.len()];
        self.read_into(0, &mut v)?;
        Ok(v)
    }

    /// The elements in place, without a copy: host memory only (see
    /// [Reading in place](Self#reading-in-place) for why this is sound, and what it
    /// cannot stop).
    ///
    /// # Errors
    /// [`ActorError::Orphaned`]; [`ActorError::NotHostMemory`] for device memory (copy it
    /// with [`to_vec`](Self::to_vec), or use it on a stream), or host memory not aligned
    /// for `T`.
    pub fn as_slice(&self) -> Result<&[T], ActorError> {
        let imported = self.inner.live()?;
        self.inner.order.before_host_copy()?;
        let bytes = imported
            .host_bytes()
            .and_then(|b| b.get(..self.len() * size_of::<T>()))
            .ok_or(ActorError::NotHostMemory)?;
        bytemuck::try_cast_slice(bytes).map_err(|_| ActorError::NotHostMemory)
    }

    /// The untyped lease (its id, its link).
    pub(crate) fn incoming(&self) -> &IncomingLease {
        &self.inner
    }
}

impl<T: Element> DeviceSlice<T> for Lease<T> {
    fn len(&self) -> usize {
        Lease::len(self)
    }

    /// The importing backend's own stream (host copies run there).
    ///
    /// # Panics
    /// For host memory.
    fn stream(&self) -> &Arc<CudaStream> {
        cuda_stream(self.inner.imported().backend())
    }
}

impl<T: Element> DevicePtr<T> for Lease<T> {
    /// On the lease's first use on `stream`, the stream waits on the exporter's acquire
    /// fence; the use is recorded on `stream` when the `SyncOnDrop` drops, and the
    /// lease's release fence follows it. (An orphaned lease's memory stays mapped until the
    /// lease drops: the pointer is valid, its data may be incomplete.)
    ///
    /// # Panics
    /// For host memory.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let ptr = device_address(self.inner.imported().ptr());
        let used = self.inner.order.use_on(StreamRef::Cuda(stream));
        (ptr, after_use(used, stream))
    }
}

/// An importer's writable guard on another process's buffer: a [`Lease<T>`] (every read
/// accessor, through `Deref`) that may also write. Opened from a [`SharedMut<T>`] field,
/// which the sender filled with [`Buffer::share_mut`] (or [`Buffer::share_range_mut`]:
/// then the lease is that range alone); while it is out, the exporter grants no other
/// lease that overlaps it and refuses its own `write_at`, so this is the only writer of
/// those bytes its safe API allows.
///
/// # Writing in place
///
/// [`as_mut_slice`](Self::as_mut_slice) gives a `&mut [T]` of host memory without a copy.
/// It extends the argument of [Reading in place](Lease#reading-in-place): while a
/// writable lease is out, the exporter grants no other lease that overlaps its range —
/// writable or read-only, to any process, this one included — and refuses its own
/// [`Buffer::write_at`], so no other holder's view of those bytes exists (a writable
/// lease of a disjoint range of the same buffer may be out: its slice is other bytes).
/// In this process the import cache backs that up: it hands the slice out only while the
/// lease's view is the mapping's only one here, and opens no other view of it until the
/// lease drops (an offer of it fails meanwhile — of any range of the allocation: a
/// process that writes one range in place receives no other lease on that buffer until it
/// drops this one, and one that holds two leases on a buffer writes them with
/// [`write_at`](Self::write_at)). The slice borrows the lease mutably, so neither this
/// lease's own copies ([`write_at`](Self::write_at), [`read_into`](Lease::read_into)) nor
/// its `&[T]` ([`as_slice`](Lease::as_slice)) can be used while it lives.
///
/// What the API cannot stop is what it cannot stop for readers: `unsafe` code, or a raw
/// pointer ([`Buffer::ptr`], [`Lease::ptr`], `Imported::ptr`) dereferenced in `unsafe`
/// code, in the exporter's process or another one, that writes or reads the shared pages
/// directly; and another process of the same user that maps the memory by itself. One
/// more: a lease whose link is cut (its revoke deadline passed, or the link failed) no
/// longer counts for the exporter, which may then write the buffer or lease it again
/// while a slice taken before the cut still lives. Drop the slice (and the lease) before
/// the revoke deadline ([`revoked`](Lease::revoked)); the memory never goes away under
/// the slice either way.
pub struct LeaseMut<T: Element> {
    lease: Lease<T>,
}

impl<T: Element> fmt::Debug for LeaseMut<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("LeaseMut").field(&self.lease.inner).finish()
    }
}

impl<T: Element> std::ops::Deref for LeaseMut<T> {
    type Target = Lease<T>;
    fn deref(&self) -> &Lease<T> {
        &self.lease
    }
}

impl<T: Element> LeaseMut<T> {
    /// Writes `data` starting at element `index` (the exporter sees it: same memory, on
    /// the backend's own stream, done when it returns).
    ///
    /// # Errors
    /// [`ActorError::Orphaned`], [`ActorError::OutOfBounds`], or a backend error.
    pub fn write_at(&self, index: usize, data: &[T]) -> Result<(), ActorError> {
        let imported = self.lease.inner.live()?;
        let at = byte_range::<T>(index, data.len(), self.lease.len())?;
        self.lease.inner.order.before_host_copy()?;
        Ok(imported.write(at, bytemuck::cast_slice(data))?)
    }

    /// The elements in place, writable, without a copy: host memory only (see
    /// [Writing in place](Self#writing-in-place) for why this is sound, and what it cannot
    /// stop). The exporter sees what was written: it is the same memory, and the
    /// exporter reads it once the lease is back.
    ///
    /// # Errors
    /// [`ActorError::Orphaned`]; [`ActorError::NotHostMemory`] for device memory (write it
    /// with [`write_at`](Self::write_at), or on a stream), or host memory not aligned for
    /// `T`; [`ActorError::Ipc`] with [`SharedMapping`](baton_ipc::Error::SharedMapping)
    /// if another lease of this process maps the same allocation (which the exporter
    /// grants only once this lease's link was cut).
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], ActorError> {
        let len = self.lease.len() * size_of::<T>();
        let inner = &mut self.lease.inner;
        if !inner.link.is_alive() {
            return Err(ActorError::Orphaned {
                exporter: inner.link.peer(),
            });
        }
        inner.order.before_host_copy()?;
        let bytes = inner
            .imported
            .as_mut()
            .expect("present until drop")
            .host_bytes_mut()?
            .and_then(|b| b.get_mut(..len))
            .ok_or(ActorError::NotHostMemory)?;
        bytemuck::try_cast_slice_mut(bytes).map_err(|_| ActorError::NotHostMemory)
    }

    /// Gives the lease back now (the same as dropping it).
    pub fn release(self) {}
}

impl<T: Element> DeviceSlice<T> for LeaseMut<T> {
    fn len(&self) -> usize {
        Lease::len(&self.lease)
    }

    /// The importing backend's own stream (host copies run there).
    ///
    /// # Panics
    /// For host memory.
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::stream(&self.lease)
    }
}

impl<T: Element> DevicePtr<T> for LeaseMut<T> {
    /// As for [`Lease`].
    ///
    /// # Panics
    /// For host memory.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.lease.device_ptr(stream)
    }
}

impl<T: Element> DevicePtrMut<T> for LeaseMut<T> {
    /// As [`device_ptr`](DevicePtr::device_ptr): the exporter sees what was written once
    /// the lease is back (its uses wait for the lease's release fence).
    ///
    /// # Panics
    /// For host memory.
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.lease.device_ptr(stream)
    }
}
