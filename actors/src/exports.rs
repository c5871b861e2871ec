//! [`Exports`]: this node's exported buffers — the [`Ledger`] behind a mutex, and the I/O
//! that carries out its actions.
//!
//! One per node, shared by every [`BufferOwner`](crate::BufferOwner), link and buffer
//! handle of it: leases are granted and returned on the hot path of every handoff by the
//! link actors, and a few map operations under a mutex cost far less than a mailbox round
//! trip. Events go in under the lock; the actions they queue are carried out after it is
//! released: messages to link actors (`do_send`, never blocking), frees (dropping the
//! backend allocation), and kills of supervised children that hold revoked leases.

use crate::buffer::BufferCell;
use crate::error::ActorError;
use crate::ids::{BufferId, LinkId};
use crate::ledger::{
    Action, Counts, EntryView, Grant, HolderView, Ledger, NewAllocation, Refusal, RevokePolicy,
};
use crate::link::{CutOff, LinkRef, SendRevoke, SendUnmap};
use baton_ipc::{Allocation, Session};
use baton_messages::protocol::Offer;
use baton_messages::{ActorId, AllocationId, BackendKind, DeviceUuid, Layout, LeaseId, ProcessId};
use std::collections::HashMap;
use std::convert::Infallible;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// What the ledger keeps of an allocation to free it.
#[derive(Debug)]
pub(crate) struct Owned {
    pub(crate) alloc: Arc<Allocation>,
    pub(crate) owner: ActorId,
}

/// Release fences: none yet on the backends this node speaks (host memory is written
/// synchronously); the CUDA stream-ordered path adds them.
pub(crate) type Fence = Infallible;

#[derive(Debug, Default)]
struct State {
    ledger: Ledger<Owned, Fence>,
    links: HashMap<LinkId, LinkRef>,
    supervised: HashMap<ProcessId, Arc<OwnedFd>>,
    per_owner: HashMap<ActorId, OwnerCounters>,
}

#[derive(Debug, Default, Clone, Copy)]
struct OwnerCounters {
    granted: u64,
    freed: u64,
}

/// A buffer's leases, as [`LeaseTable`](crate::LeaseTable) reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferLeases {
    /// The buffer.
    pub buffer: BufferId,
    /// Its allocation.
    pub alloc: AllocationId,
    /// Bytes allocated.
    pub bytes: u64,
    /// Outstanding leases and the process holding each.
    pub leases: Vec<(LeaseId, ProcessId)>,
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
            mapped_by: v.mapped_by,
            cut_holders: v.cut_holders,
            retiring: v.retiring,
            quarantined: v.quarantined,
        }
    }
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
    fn new(c: Counts, o: OwnerCounters) -> Self {
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

/// This node's exported buffers (see the module docs).
#[derive(Debug)]
pub(crate) struct Exports {
    pub(crate) session: Session,
    state: Mutex<State>,
}

/// Carries out actions after the lock is released.
#[derive(Default)]
struct Todo {
    actions: Vec<Action<Owned, Fence>>,
    links: HashMap<LinkId, LinkRef>,
    kill: HashMap<LinkId, Arc<OwnedFd>>,
}

impl Todo {
    fn run(self) {
        for action in self.actions {
            match action {
                Action::Revoke {
                    link,
                    lease,
                    deadline,
                } => {
                    if let Some(l) = self.links.get(&link) {
                        let within = deadline.saturating_duration_since(Instant::now());
                        tracing::info!(%lease, peer = %l.peer(), ?within, "revoking");
                        l.addr.do_send(SendRevoke { lease, within });
                    }
                }
                Action::Unmap { link, alloc } => {
                    if let Some(l) = self.links.get(&link) {
                        tracing::debug!(%alloc, peer = %l.peer(), "asking to unmap");
                        l.addr.do_send(SendUnmap { alloc });
                    }
                }
                Action::Cut { link, lease, kill } => {
                    let Some(l) = self.links.get(&link) else {
                        continue;
                    };
                    tracing::warn!(%lease, peer = %l.peer(), "revoke deadline passed: cutting the holder off");
                    l.addr.do_send(CutOff(ActorError::RevokeDeadline { lease }));
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
                    let _: Vec<Fence> = fences;
                    let generation = meta.alloc.generation();
                    drop(meta.alloc);
                    tracing::debug!(actor = %meta.owner, %alloc, %generation, "buffer freed");
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
    }
}

impl Exports {
    pub(crate) fn new(session: Session) -> Arc<Self> {
        Arc::new(Self {
            session,
            state: Mutex::new(State::default()),
        })
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
            let actions = state.ledger.take_actions();
            let mut todo = Todo::default();
            for action in &actions {
                match action {
                    Action::Free { meta, .. } => {
                        state.per_owner.entry(meta.owner).or_default().freed += 1;
                    }
                    Action::Revoke { link, .. }
                    | Action::Unmap { link, .. }
                    | Action::Cut { link, .. } => {
                        if let Some(l) = state.links.get(link) {
                            todo.links.insert(*link, l.clone());
                        }
                        if let Action::Cut { kill: true, .. } = action {
                            let pidfd = state
                                .ledger
                                .link_process(*link)
                                .and_then(|p| state.supervised.get(&p));
                            if let Some(fd) = pidfd {
                                todo.kill.insert(*link, Arc::clone(fd));
                            }
                        }
                    }
                    Action::Quarantine { .. } => {}
                }
            }
            todo.actions = actions;
            (result, todo)
        };
        todo.run();
        result
    }

    /// Records a new buffer and returns its first handle's cell.
    pub(crate) fn insert(
        self: &Arc<Self>,
        alloc: Allocation,
        layout: Layout,
        owner: ActorId,
        policy: RevokePolicy,
    ) -> Arc<BufferCell> {
        let id = BufferId::next();
        let alloc = Arc::new(alloc);
        self.lock().ledger.insert(NewAllocation {
            alloc: alloc.id(),
            buffer: id,
            owner,
            bytes: alloc.size() as u64,
            rule: alloc.free_while_mapped(),
            policy,
            meta: Owned {
                alloc: Arc::clone(&alloc),
                owner,
            },
        });
        Arc::new(BufferCell {
            id,
            owner,
            alloc,
            layout,
            exports: Arc::clone(self),
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
    }

    /// A child of this node's supervisor, which the owners' [`RevokePolicy`] may kill.
    pub(crate) fn supervise(&self, process: ProcessId, pidfd: Arc<OwnedFd>) {
        self.lock().supervised.insert(process, pidfd);
    }

    /// Grants the peer over `link` a lease on `cell`'s buffer and builds the offer.
    /// `fd_slot` is where a descriptor would sit among the frame's descriptors: the
    /// allocation's descriptor comes back only when this offer starts a mapping hold.
    pub(crate) fn grant(
        &self,
        cell: &BufferCell,
        link: &LinkRef,
        fd_slot: u8,
        event: Option<baton_messages::IpcEventHandle>,
    ) -> Result<(Offer, Option<OwnedFd>, Grant), ActorError> {
        let lease = crate::ids::next_lease();
        let grant = {
            let mut state = self.lock();
            let grant = state
                .ledger
                .grant(cell.alloc.id(), link.id, lease, Instant::now())
                .map_err(|r| match r {
                    Refusal::LinkDown => ActorError::LinkClosed { peer: link.peer() },
                    _ => ActorError::UnknownBuffer(cell.id),
                })?;
            state.per_owner.entry(cell.owner).or_default().granted += 1;
            grant
        };
        let built = self.build_offer(cell, lease, grant, fd_slot, event);
        if built.is_err() {
            self.ungrant(lease, grant);
        }
        let (offer, fd) = built?;
        Ok((offer, fd, grant))
    }

    fn build_offer(
        &self,
        cell: &BufferCell,
        lease: LeaseId,
        grant: Grant,
        fd_slot: u8,
        event: Option<baton_messages::IpcEventHandle>,
    ) -> Result<(Offer, Option<OwnedFd>), ActorError> {
        let fd = match cell.alloc.export_fd().filter(|_| grant.new_hold) {
            Some(fd) => Some(fd.try_clone_to_owned().map_err(|e| baton_ipc::Error::Io {
                op: "dup(export fd)",
                source: e,
            })?),
            None => None,
        };
        // The buffer is the layout's bytes; the allocation may be larger (VMM rounds it up
        // to the granularity), so the handle names exactly that range.
        let len = cell.layout.byte_len().unwrap_or(0);
        let mut builder = cell
            .alloc
            .handle(&self.session)
            .actor(cell.owner)
            .range(0, len)
            .layout(cell.layout.clone())
            .fd_slot(fd.as_ref().map(|_| fd_slot));
        if let Some(event) = event {
            builder = builder.event(event);
        }
        Ok((
            Offer {
                lease,
                handle: builder.build()?,
            },
            fd,
        ))
    }

    /// Takes back a lease whose offer was never sent.
    pub(crate) fn ungrant(&self, lease: LeaseId, grant: Grant) {
        self.apply(|s| s.ledger.ungrant(lease, grant));
    }

    /// The peer over `link` gave `lease` back.
    pub(crate) fn release(&self, lease: LeaseId, link: LinkId) -> Result<(), ActorError> {
        self.apply(|s| s.ledger.release(lease, link, None))
            .map_err(|_| ActorError::UnknownLease { lease })
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

    /// The importer over `link` asks to drop its idle mapping of `alloc`.
    pub(crate) fn evict(&self, link: LinkId, alloc: AllocationId) {
        self.apply(|s| s.ledger.evict(link, alloc));
    }

    /// The importer over `link` closed its mapping of `alloc`.
    pub(crate) fn unmapped(&self, link: LinkId, alloc: AllocationId) -> bool {
        self.apply(|s| s.ledger.unmapped(link, alloc))
    }

    /// Leases out on `buffer`.
    pub(crate) fn leases_on(&self, buffer: BufferId) -> usize {
        self.lock().ledger.leases_on(buffer)
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
        let counters = match owner {
            Some(o) => state.per_owner.get(&o).copied().unwrap_or_default(),
            None => OwnerCounters {
                granted: state.ledger.granted(),
                freed: state.ledger.freed(),
            },
        };
        OwnerStats::new(state.ledger.counts(owner), counters)
    }
}
