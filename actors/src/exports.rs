//! [`Exports`]: this node's exported buffers — the [`Ledger`] behind a mutex, and the I/O
//! that carries out its actions.
//!
//! One per node, shared by every [`BufferOwner`](crate::BufferOwner), link and buffer
//! handle of it: leases are granted and returned on the hot path of every handoff by the
//! link actors, and a few map operations under a mutex cost far less than a mailbox round
//! trip. Events go in under the lock; the actions they queue are carried out after it is
//! released: messages to link actors (`do_send`, never blocking), frees (on the node's
//! driver thread: every release fence and every use of the buffer on a stream is waited
//! for, then the backend allocation is dropped), kills of supervised children that hold
//! revoked leases, and acquire fences of ended leases going back to their pools.
//!
//! Everything about leases — who holds what, one writer or many readers, which pool
//! descriptors went over which link, each lease's acquire fence, the counters per owner —
//! is the ledger's; beside it this node keeps only what reaches outside the process: each
//! link's actor (to send it what the ledger asks) and the pidfds of supervised children
//! (to kill one that keeps a revoked lease).
//!
//! Each exported buffer's state is a [`BufferCell`] (made by [`Exports::insert`]): the
//! typed and untyped handles (`Buffer<T>`, `AnyBuffer`) share it, and dropping the last
//! one retires the buffer here.

use crate::error::ActorError;
use crate::ids::{BufferId, FastMap, LinkId};
use crate::ledger::{
    Access, Action, Counts, EntryView, Grant, HolderView, Ledger, NewAllocation, Refusal,
    RevokePolicy, Totals,
};
use crate::link_ref::{CutOff, LinkRef, Notice};
use crate::offload::Offload;
use crate::order::{ExportOrder, FreeVerdict, ReleaseFence};
use baton_ipc::{Allocation, DescriptorScope, ExportedFence, Session, SharedBackend};
use baton_messages::protocol::Offer;
use baton_messages::{
    ActorId, AllocationId, BackendKind, DeviceUuid, FenceHandle, Layout, LeaseId, ProcessId, Shape,
};
use std::cell::Cell;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

/// What the ledger keeps of an allocation to free it.
#[derive(Debug)]
pub(crate) struct Owned {
    pub(crate) alloc: Arc<Allocation>,
    pub(crate) owner: ActorId,
    /// The buffer's stream ordering: the free waits for its uses.
    pub(crate) order: Arc<ExportOrder>,
    /// The buffer's layout (for offers made without its handle: forwarding).
    pub(crate) layout: Layout,
}

/// Release fences: importers' fences after their last use of a lease (none for host
/// memory, written synchronously).
pub(crate) type Fence = ReleaseFence;

/// What the ledger keeps with a lease: its acquire fence, when that is a pooled event
/// that must not be reused until the lease is back (see [`keeps_until_back`]).
pub(crate) type Acquire = Option<Arc<dyn ExportedFence>>;

/// A lease granted for an offer, and what undoing it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OfferGrant {
    /// The ledger's lease: the offer's own, or, for a part of a lease over several
    /// buffers, the part's (the offer names the lease's first part).
    pub(crate) lease: LeaseId,
    pub(crate) ledger: Grant,
    /// The offer carries the descriptor of this pool (once per link and pool).
    pub(crate) pool: Option<u64>,
}

#[derive(Debug, Default)]
struct State {
    ledger: Ledger<Owned, Fence, Acquire>,
    /// The actor of each link the ledger knows, to carry out what it asks of the link.
    links: FastMap<LinkId, LinkRef>,
    /// Children of this node's supervisor, which a [`RevokePolicy`] may kill.
    supervised: FastMap<ProcessId, Arc<OwnedFd>>,
    /// Leases over several buffers.
    groups: LeaseGroups,
}

/// Leases over several buffers (offers of one frame that name one lease: see
/// [`Offer`]): the ledger keeps a lease per buffer — its *parts* — and the peer names
/// them all by the first part's, which its one `Release` gives back and our `Revoke` of
/// any part asks back. Every entry is a part the ledger has out (an entry goes when its
/// part ends), so these maps are bounded as the ledger's leases are.
#[derive(Debug, Default)]
struct LeaseGroups {
    /// A lease's first part → its other parts still out.
    parts: FastMap<LeaseId, Vec<LeaseId>>,
    /// A part after the first → the lease's first part.
    first: FastMap<LeaseId, LeaseId>,
}

impl LeaseGroups {
    fn join(&mut self, first: LeaseId, part: LeaseId) {
        self.parts.entry(first).or_default().push(part);
        self.first.insert(part, first);
    }

    /// The lease the peer knows `part` by.
    fn named(&self, part: LeaseId) -> LeaseId {
        self.first.get(&part).copied().unwrap_or(part)
    }

    /// `part` ended (released, ungranted, or its holder gone): forgotten, and so is a
    /// group whose parts all ended.
    fn ended(&mut self, part: LeaseId, still_out: impl Fn(LeaseId) -> bool) {
        let first = match self.first.remove(&part) {
            Some(first) => {
                if let Some(parts) = self.parts.get_mut(&first) {
                    parts.retain(|p| *p != part);
                }
                first
            }
            None => part,
        };
        if self.parts.get(&first).is_some_and(Vec::is_empty) && !still_out(first) {
            self.parts.remove(&first);
        }
    }
}

/// A buffer's leases, as a [`BufferOwner`](crate::BufferOwner) reports them for its own
/// buffers (the [`LeaseTable`](crate::LeaseTable) message) and [`Node::lease_table`](crate::Node::lease_table)
/// for every buffer of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferLeases {
    /// The buffer.
    pub buffer: BufferId,
    /// Its allocation.
    pub alloc: AllocationId,
    /// Bytes allocated.
    pub bytes: u64,
    /// Outstanding leases and the process holding each (for a forwarded lease: the
    /// process it was forwarded to, which has no link to us).
    pub leases: Vec<(LeaseId, ProcessId)>,
    /// Of those, the leases forwarded to a third process (see `docs/FORWARDING.md`).
    pub forwarded: Vec<ForwardedLease>,
    /// Processes that may map it over a live link (a lease, or a warm mapping).
    pub mapped_by: Vec<ProcessId>,
    /// Processes whose link was cut while they held it, not yet confirmed dead.
    pub cut_holders: Vec<ProcessId>,
    /// No `Buffer` handle is left: it is freed as soon as nobody may map it.
    pub retiring: bool,
    /// Retiring, but a cut holder may still map it and the backend's free is unsafe while
    /// it does (CUDA legacy IPC): kept allocated until that process is confirmed dead.
    pub quarantined: bool,
}

impl From<EntryView> for BufferLeases {
    fn from(v: EntryView) -> Self {
        Self {
            buffer: v.buffer,
            alloc: v.alloc,
            bytes: v.bytes,
            leases: v.leases,
            forwarded: v
                .relayed
                .into_iter()
                .map(|r| ForwardedLease {
                    lease: r.lease,
                    holder: r.holder,
                    via: r.via,
                })
                .collect(),
            mapped_by: v.mapped_by,
            cut_holders: v.cut_holders,
            retiring: v.retiring,
            quarantined: v.quarantined,
        }
    }
}

/// A lease forwarded to a third process: granted at the request of one of our importers,
/// which passed the offer on (A → B → C). The holder maps the memory with no link to us;
/// the lease ends with its `Release` (carried back by `via`) or its death.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardedLease {
    /// The lease.
    pub lease: LeaseId,
    /// The process it was forwarded to (C).
    pub holder: ProcessId,
    /// The process that relays it (B); `None` once that link is down: the lease is then
    /// kept until `holder` is confirmed dead.
    pub via: Option<ProcessId>,
}

/// Counters of one owner (or of the whole node: [`Node::export_stats`](crate::Node::export_stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OwnerStats {
    /// Buffers alive (handles, leases or mappings out).
    pub buffers: usize,
    /// Of those, buffers no handle is left of, waiting to be freed.
    pub retiring: usize,
    /// Of those, buffers quarantined (see [`BufferLeases::quarantined`]).
    pub quarantined: usize,
    /// Bytes quarantined.
    pub quarantined_bytes: u64,
    /// Leases out.
    pub leases: usize,
    /// Bytes alive.
    pub bytes: u64,
    /// Bytes of the buffers at least one lease is out on.
    pub pinned_bytes: u64,
    /// Leases granted so far.
    pub granted: u64,
    /// Buffers freed so far.
    pub freed: u64,
}

impl OwnerStats {
    fn new(c: Counts, o: Totals) -> Self {
        Self {
            buffers: c.buffers,
            retiring: c.retiring,
            quarantined: c.quarantined,
            quarantined_bytes: c.quarantined_bytes,
            leases: c.leases,
            bytes: c.bytes,
            pinned_bytes: c.pinned_bytes,
            granted: o.granted,
            freed: o.freed,
        }
    }
}

/// What a node's status reports of its exports ([`Exports::snapshot`]).
#[derive(Debug)]
pub(crate) struct ExportSnapshot {
    pub(crate) counts: Counts,
    pub(crate) granted: u64,
    pub(crate) freed: u64,
    pub(crate) holders: Vec<HolderView>,
    /// Every buffer, with its allocation's backend kind and device.
    pub(crate) table: Vec<(EntryView, Option<BackendKind>, DeviceUuid)>,
}

/// The exporter-side state of one buffer: its memory and the node's exports. Dropping the
/// last reference *retires* the buffer in the ledger, which frees it once no process may
/// map it.
pub(crate) struct BufferCell {
    pub(crate) id: BufferId,
    pub(crate) owner: ActorId,
    pub(crate) alloc: Arc<Allocation>,
    pub(crate) layout: Layout,
    /// Its uses on streams and the release fences it waits on.
    pub(crate) order: Arc<ExportOrder>,
    pub(crate) exports: Arc<Exports>,
    /// Declared last, so that it drops after `alloc`: the ledger's free then holds the
    /// allocation's last reference and frees it where it runs (the driver thread), after
    /// the waits it needs.
    pub(crate) _retire: Retire,
}

/// The part of a buffer a range lease covers ([`Buffer::share_range`](crate::Buffer::share_range)):
/// checked in bounds and non-empty when made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Part {
    /// Its bytes, from the buffer's first (which is its allocation's first).
    pub(crate) bytes: Range<u64>,
    /// A vector of its elements ([`layout_of`]).
    pub(crate) layout: Layout,
}

impl BufferCell {
    /// The bytes of the allocation a lease of `part` covers (`None`: all of the buffer).
    pub(crate) fn bytes_of(&self, part: Option<&Part>) -> Range<u64> {
        match part {
            Some(part) => part.bytes.clone(),
            None => 0..self.layout.byte_len().unwrap_or(0),
        }
    }

    /// The layout of what a lease of `part` covers (`None`: the buffer's own).
    pub(crate) fn layout_of<'a>(&'a self, part: Option<&'a Part>) -> &'a Layout {
        part.map_or(&self.layout, |p| &p.layout)
    }

    /// Refuses a write while leases on the buffer are out (see [`Buffer::write_at`](crate::Buffer::write_at)).
    pub(crate) fn check_unleased(&self) -> Result<(), ActorError> {
        match self.exports.leases_on(self.id) {
            0 => Ok(()),
            leases => Err(ActorError::BufferLeased {
                buffer: self.id,
                leases,
            }),
        }
    }
}

impl BufferCell {
    /// Resolves once no lease on the buffer is out, or with
    /// [`ActorError::NotReturned`] after `timeout` (see
    /// [`Buffer::returned_within`](crate::Buffer::returned_within)).
    pub(crate) fn returned_within(
        &self,
        timeout: std::time::Duration,
    ) -> impl Future<Output = Result<(), ActorError>> + 'static + use<> {
        let returned = self.exports.returned(self.id);
        let (exports, buffer) = (Arc::clone(&self.exports), self.id);
        async move {
            tokio::time::timeout(timeout, returned).await.map_err(|_| {
                let holders = exports.holders_of(buffer);
                ActorError::NotReturned {
                    buffer,
                    leases: holders.len(),
                    holders,
                    after: timeout,
                }
            })
        }
    }
}

/// Retires a buffer when its cell drops.
pub(crate) struct Retire {
    pub(crate) id: BufferId,
    pub(crate) exports: Arc<Exports>,
}

impl Drop for Retire {
    fn drop(&mut self) {
        self.exports.retire(self.id);
    }
}

/// This node's exported buffers (see the module docs).
#[derive(Debug)]
pub(crate) struct Exports {
    pub(crate) session: Session,
    offload: Offload,
    /// Itself, for free jobs that must come back (see [`Parked`]).
    me: Weak<Exports>,
    state: Mutex<State>,
    /// Frees held until processes die: our waits on their release fences were released
    /// while they lived, so their work may still use the memory.
    parked: Mutex<Vec<Parked>>,
    /// Woken after every event (leases may have come back): what
    /// [`Exports::returned`] waits on.
    changed: tokio::sync::Notify,
}

/// A free held until every process in `until` is dead (see
/// [`ExportOrder::before_free`]): kept allocated meanwhile, and counted as quarantined.
#[derive(Debug)]
struct Parked {
    alloc: AllocationId,
    meta: Owned,
    fences: Vec<Fence>,
    until: Vec<ProcessId>,
}

/// The driver-thread job of a free: wait for the work on the memory, then free it — or
/// park it until the processes whose work may still run are dead.
fn free_job(exports: Weak<Exports>, alloc: AllocationId, meta: Owned, fences: Vec<Fence>) {
    let verdict = meta.order.before_free(&fences);
    match verdict {
        FreeVerdict::Free => {
            let Owned {
                alloc: memory,
                owner,
                order,
                ..
            } = meta;
            let generation = memory.generation();
            drop(order);
            drop(memory);
            tracing::debug!(actor = %owner, %alloc, %generation, "buffer freed");
        }
        FreeVerdict::Hold(until) => {
            tracing::warn!(
                %alloc,
                holders = ?until,
                "quarantined: a producer whose release fence we stopped waiting for is alive, so its work may still use this memory; freed when it is confirmed dead"
            );
            match exports.upgrade() {
                Some(exports) => exports.park(Parked {
                    alloc,
                    meta,
                    fences,
                    until,
                }),
                // The node is gone: nothing can learn of the deaths any more. Keep it.
                None => std::mem::forget(meta),
            }
        }
        FreeVerdict::Failed(e) => {
            // Whether work still uses the memory is unknown: keeping it is the only
            // choice the freeing rule allows.
            tracing::error!(actor = %meta.owner, %alloc, error = %e, "waiting for the work on a buffer before freeing it failed: the memory is kept (leaked) rather than freed under work that may still run");
            std::mem::forget(meta);
        }
    }
}

/// Whether an acquire fence must be kept until its lease is back: a pooled event (a wait
/// follows its latest record). A counter fence names its value and lends nothing.
fn keeps_until_back(fence: &dyn ExportedFence) -> bool {
    fence.handle().kind() == baton_messages::FenceKind::Event
}

/// What an offer is built from.
struct OfferParts<'a> {
    alloc: &'a Allocation,
    owner: ActorId,
    /// The bytes of the allocation the offer names: the buffer's, or a range lease's.
    bytes: Range<u64>,
    /// Their layout.
    layout: &'a Layout,
}

/// The layout of `bytes` of a buffer laid out as `whole` (which starts at byte 0): `whole`
/// itself for all of it, else a vector of the elements `bytes` hold (a range lease is a
/// 1-D shape of the range's length).
pub(crate) fn layout_of(whole: &Layout, bytes: &Range<u64>) -> Layout {
    if bytes.start == 0 && Some(bytes.end) == whole.byte_len() {
        return whole.clone();
    }
    let size = (whole.dtype.size() as u64).max(1);
    let elements = (bytes.end.saturating_sub(bytes.start)) / size;
    Layout::new(whole.dtype, Shape::vector(elements))
}

/// Carries out actions after the lock is released.
#[derive(Default)]
struct Todo {
    actions: Vec<Action<Owned, Fence, Acquire>>,
    links: FastMap<LinkId, LinkRef>,
    kill: FastMap<LinkId, Arc<OwnedFd>>,
}

/// An event's actions, in the order they are carried out.
type Actions = Vec<Action<Owned, Fence, Acquire>>;

thread_local! {
    /// This thread's emptied actions list, handed to the ledger at its next event so that
    /// an event (a release on every handoff) allocates no list of its own.
    static SPARE_ACTIONS: Cell<Actions> = const { Cell::new(Vec::new()) };
}

impl Todo {
    /// The most actions a kept list may hold room for (a larger one is freed).
    const KEEP_ACTIONS: usize = 16;

    fn run(mut self, offload: &Offload, exports: &Weak<Exports>) {
        for action in self.actions.drain(..) {
            match action {
                Action::LeaseEnded { lease, alloc, data } => {
                    // Its acquire fence (a pooled event) goes back to its pool.
                    tracing::trace!(%lease, %alloc, fence = data.is_some(), "lease ended");
                    drop(data);
                }
                Action::Revoke {
                    link,
                    lease,
                    deadline,
                } => {
                    if let Some(l) = self.links.get(&link) {
                        let within = deadline.saturating_duration_since(Instant::now());
                        tracing::info!(%lease, peer = %l.peer(), ?within, "revoking");
                        l.do_send(Notice::Revoke { lease, within });
                    }
                }
                Action::Unmap { link, alloc } => {
                    if let Some(l) = self.links.get(&link) {
                        tracing::debug!(%alloc, peer = %l.peer(), "asking to unmap");
                        l.do_send(Notice::Unmap(alloc));
                    }
                }
                Action::ForgetPool { link, pool } => {
                    if let Some(l) = self.links.get(&link) {
                        l.do_send(Notice::PoolRetired(pool));
                    }
                }
                Action::Cut { link, lease, kill } => {
                    let Some(l) = self.links.get(&link) else {
                        continue;
                    };
                    tracing::warn!(%lease, peer = %l.peer(), "revoke deadline passed: cutting the holder off");
                    l.do_send(CutOff(ActorError::RevokeDeadline { lease }));
                    if kill {
                        match self.kill.get(&link) {
                            Some(pidfd) => {
                                tracing::warn!(peer = %l.peer(), "killing the supervised child that kept a revoked lease");
                                let _ = rustix::process::pidfd_send_signal(
                                    &**pidfd,
                                    rustix::process::Signal::KILL,
                                );
                            }
                            None => {
                                tracing::info!(peer = %l.peer(), "the holder is not a supervised child: only cut")
                            }
                        }
                    }
                }
                Action::Free {
                    alloc,
                    meta,
                    fences,
                } => {
                    // No GPU work that uses the memory may still run: wait for the
                    // importers' release fences and the buffer's own uses, on the driver
                    // thread, then free (or hold it: see `free_job`).
                    let exports = exports.clone();
                    offload.submit(move || free_job(exports, alloc, meta, fences));
                }
                Action::Quarantine {
                    alloc,
                    bytes,
                    holders,
                } => {
                    tracing::warn!(
                        %alloc,
                        bytes,
                        holders = ?holders,
                        "quarantined: a cut holder may still map this memory and the backend's \
                         free is unsafe while it does; freed when it is confirmed dead"
                    );
                }
            }
        }
        if self.actions.capacity() <= Self::KEEP_ACTIONS {
            // (Not after the thread's locals are gone: a buffer dropped as a thread ends.)
            let _ = SPARE_ACTIONS.try_with(|spare| spare.set(self.actions));
        }
    }
}

impl Exports {
    pub(crate) fn new(session: Session, offload: Offload) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            session,
            offload,
            me: me.clone(),
            state: Mutex::new(State::default()),
            parked: Mutex::new(Vec::new()),
            changed: tokio::sync::Notify::new(),
        })
    }

    fn park(&self, mut parked: Parked) {
        {
            let mut all = self.parked.lock().unwrap_or_else(|p| p.into_inner());
            // A process may have died between the verdict and now, its `process_dead`
            // already run: nothing would ever wake this free for it. (Checked under the
            // lock, so a death reported after this is seen by `unpark`.)
            parked
                .until
                .retain(|p| baton_ipc::process::liveness(p) != baton_ipc::process::Liveness::Dead);
            if !parked.until.is_empty() {
                all.push(parked);
                return;
            }
        }
        let exports = self.me.clone();
        self.offload
            .submit(move || free_job(exports, parked.alloc, parked.meta, parked.fences));
    }

    /// Frees held for `process` (see [`Parked`]) go ahead once no other live process
    /// holds them.
    fn unpark(&self, process: ProcessId) {
        let ready: Vec<Parked> = {
            let mut all = self.parked.lock().unwrap_or_else(|p| p.into_inner());
            for p in all.iter_mut() {
                p.until.retain(|q| *q != process);
            }
            let (ready, held) = std::mem::take(&mut *all)
                .into_iter()
                .partition(|p| p.until.is_empty());
            *all = held;
            ready
        };
        for p in ready {
            let exports = self.me.clone();
            self.offload
                .submit(move || free_job(exports, p.alloc, p.meta, p.fences));
        }
    }

    /// Allocations whose free is held until a producer dies (see [`Parked`]), and their
    /// bytes.
    pub(crate) fn held_frees(&self) -> (usize, u64) {
        let all = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        (
            all.len(),
            all.iter().map(|p| p.meta.alloc.raw().size() as u64).sum(),
        )
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every event leaves the ledger consistent before it returns (the property tests
        // check it after each), so a panic elsewhere while the lock was held leaves nothing
        // to repair.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `event` to the ledger, then carries out what it asked for, unlocked.
    fn apply<R>(&self, event: impl FnOnce(&mut State) -> R) -> R {
        let (result, todo) = {
            let mut state = self.lock();
            let result = event(&mut state);
            let spare = SPARE_ACTIONS.try_with(Cell::take).unwrap_or_default();
            let mut actions = state.ledger.swap_actions(spare);
            let state = &mut *state;
            for action in &mut actions {
                match action {
                    // The peer knows a part of a lease over several buffers by its first.
                    Action::Revoke { lease, .. } | Action::Cut { lease, .. } => {
                        *lease = state.groups.named(*lease);
                    }
                    Action::LeaseEnded { lease, .. } => {
                        let ledger = &state.ledger;
                        state.groups.ended(*lease, |l| ledger.is_out(l));
                    }
                    _ => {}
                }
            }
            let mut todo = Todo::default();
            // The links (and supervised children) the actions reach, looked up under the lock.
            for action in &actions {
                let link = match action {
                    Action::Revoke { link, .. }
                    | Action::Unmap { link, .. }
                    | Action::ForgetPool { link, .. }
                    | Action::Cut { link, .. } => *link,
                    Action::Free { .. } | Action::Quarantine { .. } | Action::LeaseEnded { .. } => {
                        continue;
                    }
                };
                if let Some(l) = state.links.get(&link) {
                    todo.links.insert(link, l.clone());
                }
                if let Action::Cut { kill: true, .. } = action {
                    let pidfd = state
                        .ledger
                        .link_process(link)
                        .and_then(|p| state.supervised.get(&p));
                    if let Some(fd) = pidfd {
                        todo.kill.insert(link, Arc::clone(fd));
                    }
                }
            }
            todo.actions = actions;
            (result, todo)
        };
        todo.run(&self.offload, &self.me);
        self.changed.notify_waiters();
        result
    }

    /// Resolves once no lease on `buffer` is out (at once if none is; also once the
    /// buffer is gone).
    pub(crate) fn returned(
        self: &Arc<Self>,
        buffer: BufferId,
    ) -> impl Future<Output = ()> + 'static + use<> {
        let exports = Arc::clone(self);
        async move {
            loop {
                let notified = exports.changed.notified();
                let mut notified = std::pin::pin!(notified);
                // Registered before the check, so a release between the two wakes us.
                notified.as_mut().enable();
                if exports.leases_on(buffer) == 0 {
                    return;
                }
                notified.await;
            }
        }
    }

    /// Records a new buffer, allocated with `backend`, and returns its first handle's
    /// cell.
    pub(crate) fn insert(
        self: &Arc<Self>,
        alloc: Allocation,
        backend: SharedBackend,
        layout: Layout,
        owner: ActorId,
        policy: RevokePolicy,
    ) -> Arc<BufferCell> {
        let id = BufferId::next();
        let alloc = Arc::new(alloc);
        let order = Arc::new(ExportOrder::new(backend));
        {
            let mut state = self.lock();
            state.ledger.insert(NewAllocation {
                alloc: alloc.id(),
                buffer: id,
                owner,
                bytes: alloc.size() as u64,
                rule: alloc.free_while_mapped(),
                policy,
                pool: match alloc.descriptor_scope() {
                    DescriptorScope::Pool(pool) => Some(pool),
                    DescriptorScope::Allocation => None,
                },
                meta: Owned {
                    alloc: Arc::clone(&alloc),
                    owner,
                    order: Arc::clone(&order),
                    layout: layout.clone(),
                },
            });
        }
        Arc::new(BufferCell {
            id,
            owner,
            alloc,
            layout,
            order,
            exports: Arc::clone(self),
            _retire: Retire {
                id,
                exports: Arc::clone(self),
            },
        })
    }

    /// A link is up: leases may be granted over it.
    pub(crate) fn link_up(&self, link: &LinkRef) {
        let mut state = self.lock();
        state.ledger.link_up(link.id, link.peer());
        state.links.insert(link.id, link.clone());
    }

    /// A link is down (see [`Ledger::link_cut`]).
    pub(crate) fn link_cut(&self, link: LinkId) {
        self.apply(|s| {
            s.links.remove(&link);
            s.ledger.link_cut(link);
        });
    }

    /// A process is confirmed dead.
    pub(crate) fn process_dead(&self, process: ProcessId) {
        self.apply(|s| {
            s.supervised.remove(&process);
            s.ledger.process_dead(process);
        });
        self.unpark(process);
    }

    /// A child of this node's supervisor, which the owners' [`RevokePolicy`] may kill.
    pub(crate) fn supervise(&self, process: ProcessId, pidfd: Arc<OwnedFd>) {
        self.lock().supervised.insert(process, pidfd);
    }

    /// Grants the peer over `link` a lease on `cell`'s buffer (all of it, or `part` of
    /// it: the offer's handle names those bytes, with their layout; `writable`: its
    /// holder's alone) and builds the offer, with `fence` (recorded after the work that
    /// produced the buffer) as its acquire fence. `fd_slot` is where a descriptor would
    /// sit among the frame's descriptors: the allocation's descriptor comes back only when
    /// this offer starts a mapping hold (a pool's: when its descriptor has not crossed this
    /// link yet). `with`: the offer is a part of that lease (granted over the same link
    /// for the same frame), the lease over several buffers the offer names.
    ///
    /// One writer or many readers, per range: a writable lease is refused while any other
    /// lease that overlaps its range is out, and any lease while a writable one that
    /// overlaps it is, or while the owner writes the buffer in place (the flag is read
    /// under the lock, after which `Buffer::as_mut_slice` counts the leases under the same
    /// lock: one of the two sees the other).
    #[expect(
        clippy::too_many_arguments,
        reason = "what one offer of a frame is: the buffer, its part and access, the link, its place among the frame's descriptors and offers, its fence"
    )]
    pub(crate) fn grant(
        &self,
        cell: &BufferCell,
        part: Option<&Part>,
        writable: bool,
        link: &LinkRef,
        fd_slot: u8,
        fence: Option<Arc<dyn ExportedFence>>,
        with: Option<LeaseId>,
    ) -> Result<(Offer, Option<OwnedFd>, OfferGrant), ActorError> {
        let bytes = cell.bytes_of(part);
        let lease = crate::ids::next_lease();
        let grant = {
            let mut state = self.lock();
            let alloc = cell.alloc.id();
            let conflict = |wanted, reason| ActorError::LeaseConflict {
                buffer: cell.id,
                wanted,
                reason,
            };
            let wanted = if writable { "writable" } else { "read-only" };
            if cell.alloc.is_in_place() {
                return Err(conflict(
                    wanted,
                    "its owner is writing it in place (Buffer::as_mut_slice)",
                ));
            }
            let kept = fence
                .as_ref()
                .filter(|f| keeps_until_back(f.as_ref()))
                .map(Arc::clone);
            let access = match writable {
                true => Access::write(bytes.clone()),
                false => Access::read(bytes.clone()),
            };
            let (ledger, pool) = state
                .ledger
                .grant(alloc, link.id, lease, Instant::now(), access, kept)
                .map_err(|r| match r {
                    Refusal::WriterOut => conflict(
                        wanted,
                        "a writable lease on it (or on a range that overlaps this one) is out",
                    ),
                    Refusal::ReadersOut => conflict(
                        "writable",
                        "other leases on it (or on ranges that overlap this one) are out",
                    ),
                    Refusal::LinkDown => ActorError::link_closed(link.peer()),
                    _ => ActorError::UnknownBuffer(cell.id),
                })?;
            if let Some(first) = with {
                state.groups.join(first, lease);
            }
            OfferGrant {
                lease,
                ledger,
                pool,
            }
        };
        let handle = fence.as_ref().map(|f| f.handle());
        let send_fd = match cell.alloc.descriptor_scope() {
            DescriptorScope::Allocation => grant.ledger.new_hold,
            DescriptorScope::Pool(_) => grant.pool.is_some(),
        };
        let parts = OfferParts {
            alloc: &cell.alloc,
            owner: cell.owner,
            bytes,
            layout: cell.layout_of(part),
        };
        let built = self.build_offer(parts, with.unwrap_or(lease), send_fd, fd_slot, handle);
        if built.is_err() {
            self.ungrant(grant, link.id);
        }
        let (offer, fd) = built?;
        Ok((offer, fd, grant))
    }

    /// Grants `holder` — a process with no link to us — a lease on the buffer of `via`, a
    /// lease out over `link` whose peer forwards it, and builds the offer that peer passes
    /// on: always with the allocation's (or pool's) descriptor, since the holder maps it
    /// through no link of ours; with the buffer's acquire fence after its uses so far. A
    /// forward of a range lease covers that range: the offer names its bytes alone.
    pub(crate) fn grant_relayed(
        &self,
        via: LeaseId,
        link: &LinkRef,
        holder: ProcessId,
        max: usize,
    ) -> Result<(Offer, Option<OwnedFd>), ActorError> {
        let lease = crate::ids::next_lease();
        let (alloc, owner, bytes, layout, order) = {
            let mut state = self.lock();
            // One writer or many readers holds for forwarded leases too: a writable lease
            // is its holder's alone (its `as_mut_slice` relies on it). The acquire fence is
            // made below, unlocked, and kept with the lease then.
            if state.groups.parts.contains_key(&via) {
                return Err(ActorError::ForwardRefused {
                    reason: format!("{via} is a lease over several buffers: it is not forwarded"),
                });
            }
            let (alloc, bytes) = state
                .ledger
                .grant_relayed(via, link.id, lease, holder, max, Instant::now(), None)
                .map_err(|r| match r {
                    Refusal::WriterOut => ActorError::ForwardRefused {
                        reason: format!("{via} is a writable lease: it is not forwarded"),
                    },
                    Refusal::LinkDown => ActorError::link_closed(link.peer()),
                    Refusal::TooManyRelayed => ActorError::TooManyLeases { max },
                    _ => ActorError::UnknownLease { lease: via },
                })?;
            let meta = state.ledger.meta(alloc).expect("granted just now");
            (
                Arc::clone(&meta.alloc),
                meta.owner,
                bytes.clone(),
                layout_of(&meta.layout, &bytes),
                Arc::clone(&meta.order),
            )
        };
        let undo = || {
            self.ungrant(
                OfferGrant {
                    lease,
                    ledger: Grant { new_hold: false },
                    pool: None,
                },
                link.id,
            )
        };
        let fence = match order.acquire_fence(&holder) {
            Ok(fence) => fence,
            Err(e) => {
                undo();
                return Err(e);
            }
        };
        if let Some(fence) = fence.as_ref().filter(|f| keeps_until_back(f.as_ref())) {
            // A lease that ended meanwhile (its holder died) keeps nothing.
            if let Some(kept) = self.lock().ledger.lease_data_mut(lease) {
                *kept = Some(Arc::clone(fence));
            }
        }
        let parts = OfferParts {
            alloc: &alloc,
            owner,
            bytes,
            layout: &layout,
        };
        let built = self.build_offer(parts, lease, true, 0, fence.as_ref().map(|f| f.handle()));
        if built.is_err() {
            undo();
        }
        Ok(built?)
    }

    fn build_offer(
        &self,
        parts: OfferParts<'_>,
        lease: LeaseId,
        send_fd: bool,
        fd_slot: u8,
        fence: Option<FenceHandle>,
    ) -> Result<(Offer, Option<OwnedFd>), baton_ipc::Error> {
        let OfferParts {
            alloc,
            owner,
            bytes,
            layout,
        } = parts;
        let fd = match alloc.export_fd().filter(|_| send_fd) {
            Some(fd) => Some(fd.try_clone_to_owned().map_err(|e| baton_ipc::Error::Io {
                op: "dup(export fd)",
                source: e,
            })?),
            None => None,
        };
        // The buffer is the layout's bytes; the allocation may be larger (VMM rounds it up
        // to the granularity), so the handle names exactly that range — or the part of it
        // a range lease covers (the importer's view starts and ends there).
        let len = bytes.end.saturating_sub(bytes.start);
        let mut builder = alloc
            .handle(&self.session)
            .actor(owner)
            .range(bytes.start, len)
            .layout(layout.clone())
            .fd_slot(fd.as_ref().map(|_| fd_slot));
        if let Some(fence) = fence {
            builder = builder.fence(fence);
        }
        Ok((
            Offer {
                lease,
                handle: builder.build()?,
            },
            fd,
        ))
    }

    /// A handle of one of our own buffers, with its descriptor, for our own import cache
    /// (a copy that landed from another host is opened so: see `link/copy.rs`). No lease.
    pub(crate) fn own_handle(
        &self,
        cell: &BufferCell,
    ) -> Result<(baton_messages::HandleMsg, baton_ipc::FrameFds), baton_ipc::Error> {
        let parts = OfferParts {
            alloc: &cell.alloc,
            owner: cell.owner,
            bytes: 0..cell.layout.byte_len().unwrap_or(0),
            layout: &cell.layout,
        };
        let (offer, fd) = self.build_offer(parts, LeaseId::new(0), true, 0, None)?;
        Ok((
            offer.handle,
            baton_ipc::FrameFds::new(fd.into_iter().collect()),
        ))
    }

    /// Takes back a lease whose offer (over `link`) was never sent. `grant` is what
    /// [`grant`](Self::grant) returned (for a relayed lease: no hold, no pool); the ledger
    /// remembers both, and undoes what it recorded.
    pub(crate) fn ungrant(&self, grant: OfferGrant, link: LinkId) {
        let lease = grant.lease;
        self.apply(|s| {
            let undone = s.ledger.ungrant(lease);
            debug_assert!(
                undone.is_none_or(|u| u == (link, grant.ledger, grant.pool)),
                "{lease} was granted as {undone:?}, not {grant:?} over {link:?}"
            );
        });
    }

    /// The peer over `link` gave `lease` back, after the work its `fences` follow — every
    /// part of it, for a lease over several buffers (each part's buffer waits for all the
    /// fences: the importer sends one set for the lease).
    pub(crate) fn release(
        &self,
        lease: LeaseId,
        link: LinkId,
        fences: Vec<FenceHandle>,
    ) -> Result<(), ActorError> {
        self.apply(|s| {
            // The fences were checked against the lane we lent the link's peer: it wrote
            // them. (A relay passes a forwarded lease's release on without fences, since
            // its holder closed its mapping after its own work; fences a faulty relay adds
            // are its own, waited on — and released, if it dies — as such.)
            let producer = s.ledger.link_process(link);
            let fences: Vec<ReleaseFence> = match producer {
                Some(producer) => fences
                    .into_iter()
                    .map(|fence| ReleaseFence { producer, fence })
                    .collect(),
                None => Vec::new(),
            };
            // The buffer's stream ordering takes the fences in too (read before the release,
            // which may free the buffer).
            let order = s.ledger.lease_meta(lease).map(|m| Arc::clone(&m.order));
            match s.ledger.release(lease, link, fences.iter().cloned()) {
                Ok(_) => {}
                // A forwarded lease whose holder died while its release was on the way.
                Err(_) if s.ledger.forget_ended_relay(lease, link) => return Ok(()),
                Err(e) => return Err(e),
            }
            if let Some(order) = order {
                order.released(fences.clone());
            }
            for part in s.groups.parts.remove(&lease).unwrap_or_default() {
                s.groups.first.remove(&part);
                let order = s.ledger.lease_meta(part).map(|m| Arc::clone(&m.order));
                // A part granted with the lease over the same link; one that ended
                // already (never, while its first part was out) is no fault of the peer.
                if s.ledger.release(part, link, fences.iter().cloned()).is_ok() {
                    if let Some(order) = order {
                        order.released(fences.clone());
                    }
                }
            }
            Ok(())
        })
        .map_err(|_: Refusal| ActorError::UnknownLease { lease })
    }

    /// The last handle of `buffer` dropped.
    pub(crate) fn retire(&self, buffer: BufferId) {
        self.apply(|s| s.ledger.retire(buffer));
    }

    /// Asks the holders of `owner`'s `buffer` for their leases back by `deadline`.
    pub(crate) fn revoke(
        &self,
        owner: ActorId,
        buffer: BufferId,
        deadline: Instant,
    ) -> Result<usize, ActorError> {
        self.apply(|s| {
            if s.ledger.owner_of(buffer) != Some(owner) {
                return Err(Refusal::UnknownBuffer);
            }
            s.ledger.revoke(buffer, deadline)
        })
        .map_err(|_| ActorError::UnknownBuffer(buffer))
    }

    /// Cuts the holders past their revoke deadlines.
    pub(crate) fn tick(&self, now: Instant) {
        self.apply(|s| s.ledger.tick(now));
    }

    /// The backend retired these pools of ours: the links that carried their descriptors
    /// tell their importers, which drop their imports.
    pub(crate) fn pools_retired(&self, pools: &[u64]) {
        if pools.is_empty() {
            return;
        }
        self.apply(|s| {
            for &pool in pools {
                s.ledger.pool_retired(pool);
            }
        });
    }

    /// The importer over `link` asks to drop its idle mapping of `alloc`.
    pub(crate) fn evict(&self, link: LinkId, alloc: AllocationId) {
        self.apply(|s| s.ledger.evict(link, alloc));
    }

    /// The importer over `link` closed its mapping of `alloc`. If we had not asked (it
    /// could not open our offer), a pool's descriptor goes with the next offer again.
    pub(crate) fn unmapped(&self, link: LinkId, alloc: AllocationId) -> bool {
        self.apply(|s| s.ledger.unmapped(link, alloc))
    }

    /// Leases out on `buffer`.
    pub(crate) fn leases_on(&self, buffer: BufferId) -> usize {
        self.lock().ledger.leases_on(buffer)
    }

    /// The leases out on `buffer` and the process holding each.
    pub(crate) fn holders_of(&self, buffer: BufferId) -> Vec<(LeaseId, ProcessId)> {
        self.lock()
            .ledger
            .view(None)
            .into_iter()
            .find(|v| v.buffer == buffer)
            .map(|v| v.leases)
            .unwrap_or_default()
    }

    /// The buffers of `owner` (all: `None`) with their leases and holders.
    pub(crate) fn table(&self, owner: Option<ActorId>) -> Vec<BufferLeases> {
        self.lock()
            .ledger
            .view(owner)
            .into_iter()
            .map(BufferLeases::from)
            .collect()
    }

    /// Everything the node's status reports of its exports, taken under one lock.
    pub(crate) fn snapshot(&self) -> ExportSnapshot {
        let state = self.lock();
        let table = state
            .ledger
            .view(None)
            .into_iter()
            .map(|v| {
                let (kind, device) = state
                    .ledger
                    .meta(v.alloc)
                    .map(|m| (Some(m.alloc.backend()), m.alloc.device()))
                    .unwrap_or((None, DeviceUuid::HOST));
                (v, kind, device)
            })
            .collect();
        ExportSnapshot {
            counts: state.ledger.counts(None),
            granted: state.ledger.granted(),
            freed: state.ledger.freed(),
            holders: state.ledger.holders(),
            table,
        }
    }

    /// Counters of `owner` (all: `None`).
    pub(crate) fn stats(&self, owner: Option<ActorId>) -> OwnerStats {
        let state = self.lock();
        OwnerStats::new(state.ledger.counts(owner), state.ledger.totals(owner))
    }
}

#[cfg(test)]
mod tests;
