//! The exporter's lease table: for each buffer, who holds it under which lease.
//!
//! A [`BufferOwner`](crate::BufferOwner)'s state lives here, behind a mutex, because leases
//! are granted and returned on the hot path of every handoff by the peer links, and a
//! mutex held for a few hash-map operations costs far less than a mailbox round trip. The
//! owner actor keeps the lifecycle that needs time: revoke deadlines, tracing, stats.
//!
//! Invariants:
//! - a lease is recorded *before* its offer is sent, so one lost in flight still holds
//!   the buffer until its link closes;
//! - a buffer's memory is dropped only when it is retired (no [`Buffer`](crate::Buffer)
//!   handle left) *and* has no lease out;
//! - a release is accepted only from the link the lease was granted on.

use crate::buffer::BufferCell;
use crate::error::ActorError;
use crate::ids::{BufferId, LinkId};
use crate::link::{LinkRef, SendGone};
use baton_ipc::cuda::RecordedEvent;
use baton_ipc::{Allocation, Session};
use baton_messages::protocol::Offer;
use baton_messages::{ActorId, AllocationId, LeaseId, ProcessId};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// One lease, as its exporter records it.
#[derive(Debug, Clone)]
struct LeaseRecord {
    link: LinkRef,
    revoke_by: Option<Instant>,
    /// The event the offer carried, kept out of the pool until the lease returns.
    _event: Option<Arc<RecordedEvent>>,
}

#[derive(Debug)]
struct Entry {
    alloc: Arc<Allocation>,
    layout: baton_messages::Layout,
    leases: HashMap<LeaseId, LeaseRecord>,
    /// No `Buffer` handle is left: free when the last lease returns.
    retiring: bool,
    /// Links that ever held a lease on it: told `Gone` when it is freed.
    holders: HashMap<LinkId, LinkRef>,
}

/// A buffer's leases, as [`BufferOwner::lease_table`](crate::BufferOwner) reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferLeases {
    /// The buffer.
    pub buffer: BufferId,
    /// Its allocation.
    pub alloc: AllocationId,
    /// Outstanding leases and the process holding each.
    pub leases: Vec<(LeaseId, ProcessId)>,
    /// Whether the buffer waits for its leases to be freed.
    pub retiring: bool,
}

/// Counters of one owner.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OwnerStats {
    /// Buffers alive (handles or leases out).
    pub buffers: usize,
    /// Of those, buffers waiting for leases to come back before they are freed.
    pub retiring: usize,
    /// Leases out.
    pub leases: usize,
    /// Bytes alive.
    pub bytes: u64,
    /// Leases granted so far.
    pub granted: u64,
    /// Buffers freed so far.
    pub freed: u64,
}

#[derive(Default, Debug)]
struct State {
    buffers: HashMap<BufferId, Entry>,
    lease_index: HashMap<LeaseId, BufferId>,
    granted: u64,
    freed: u64,
}

/// What a final free leaves to do outside the lock.
struct Freed {
    alloc: Arc<Allocation>,
    holders: Vec<LinkRef>,
}

impl Freed {
    fn finish(self, owner: ActorId) {
        let (alloc, generation) = (self.alloc.id(), self.alloc.generation());
        drop(self.alloc);
        tracing::debug!(actor = %owner, %alloc, %generation, "buffer freed");
        for link in self.holders {
            link.addr.do_send(SendGone { alloc, generation });
        }
    }
}

/// A buffer owner's lease table (see the [crate docs](crate)).
#[derive(Debug)]
pub(crate) struct Ledger {
    pub(crate) owner: ActorId,
    pub(crate) session: Session,
    state: Mutex<State>,
}

impl Ledger {
    pub(crate) fn new(owner: ActorId, session: Session) -> Arc<Self> {
        Arc::new(Self {
            owner,
            session,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation is a few map operations that leave the maps consistent, so a
        // panic elsewhere while the lock was held leaves nothing to repair.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a new buffer and returns its cell (the first handle).
    pub(crate) fn insert(
        self: &Arc<Self>,
        alloc: Allocation,
        layout: baton_messages::Layout,
    ) -> Arc<BufferCell> {
        let id = BufferId::next();
        let alloc = Arc::new(alloc);
        self.lock().buffers.insert(
            id,
            Entry {
                alloc: Arc::clone(&alloc),
                layout: layout.clone(),
                leases: HashMap::new(),
                retiring: false,
                holders: HashMap::new(),
            },
        );
        Arc::new(BufferCell {
            id,
            alloc,
            layout,
            ledger: Arc::clone(self),
        })
    }

    /// Grants `link`'s peer a lease on `buffer` and builds the offer. `fd_slot` is where
    /// the descriptor (returned for descriptor-shared backends) sits in the frame.
    pub(crate) fn grant(
        &self,
        buffer: BufferId,
        link: &LinkRef,
        fd_slot: u8,
        event: Option<Arc<RecordedEvent>>,
    ) -> Result<(Offer, Option<OwnedFd>), ActorError> {
        let mut state = self.lock();
        let entry = state
            .buffers
            .get_mut(&buffer)
            .ok_or(ActorError::UnknownBuffer(buffer))?;
        // The buffer is the layout's bytes; the allocation may be larger (VMM rounds it up
        // to the granularity), so the handle names exactly that range.
        let len = entry.layout.byte_len().unwrap_or(0);
        let mut builder = entry
            .alloc
            .handle(&self.session)
            .actor(self.owner)
            .range(0, len)
            .layout(entry.layout.clone())
            .fd_slot(Some(fd_slot));
        if let Some(event) = &event {
            builder = builder.event(event.ipc_handle());
        }
        let handle = builder.build()?;
        let fd = match entry.alloc.export_fd() {
            Some(fd) => Some(fd.try_clone_to_owned().map_err(|e| baton_ipc::Error::Io {
                op: "dup(export fd)",
                source: e,
            })?),
            None => None,
        };
        let lease = crate::ids::next_lease();
        entry.leases.insert(
            lease,
            LeaseRecord {
                link: link.clone(),
                revoke_by: None,
                _event: event,
            },
        );
        entry.holders.entry(link.id).or_insert_with(|| link.clone());
        state.lease_index.insert(lease, buffer);
        state.granted += 1;
        Ok((Offer { lease, handle }, fd))
    }

    /// Takes back a lease returned over `link`. Frees the buffer if it was the last lease
    /// of a retired buffer.
    pub(crate) fn release(&self, lease: LeaseId, link: LinkId) -> Result<(), ActorError> {
        let freed = {
            let mut state = self.lock();
            let unknown = ActorError::UnknownLease { lease };
            let buffer = *state.lease_index.get(&lease).ok_or(unknown)?;
            let entry = state
                .buffers
                .get_mut(&buffer)
                .expect("indexed leases have entries");
            if entry.leases.get(&lease).map(|r| r.link.id) != Some(link) {
                return Err(ActorError::UnknownLease { lease });
            }
            entry.leases.remove(&lease);
            state.lease_index.remove(&lease);
            Self::take_if_done(&mut state, buffer)
        };
        if let Some(f) = freed {
            f.finish(self.owner);
        }
        Ok(())
    }

    /// Reclaims every lease granted over a link that closed. Returns how many.
    pub(crate) fn link_gone(&self, link: LinkId) -> usize {
        let (count, freed) = {
            let mut state = self.lock();
            let mut count = 0;
            let mut emptied = Vec::new();
            let state_ref = &mut *state;
            for (id, entry) in &mut state_ref.buffers {
                let before = entry.leases.len();
                entry.leases.retain(|lease, r| {
                    let keep = r.link.id != link;
                    if !keep {
                        state_ref.lease_index.remove(lease);
                    }
                    keep
                });
                entry.holders.remove(&link);
                count += before - entry.leases.len();
                if before != entry.leases.len() {
                    emptied.push(*id);
                }
            }
            let freed: Vec<Freed> = emptied
                .into_iter()
                .filter_map(|id| Self::take_if_done(&mut state, id))
                .collect();
            (count, freed)
        };
        for f in freed {
            f.finish(self.owner);
        }
        count
    }

    /// The last handle of `buffer` dropped: free it now, or when its last lease returns.
    pub(crate) fn retire(&self, buffer: BufferId) {
        let freed = {
            let mut state = self.lock();
            if let Some(entry) = state.buffers.get_mut(&buffer) {
                entry.retiring = true;
                if !entry.leases.is_empty() {
                    tracing::debug!(actor = %self.owner, alloc = %entry.alloc.id(), leases = entry.leases.len(), "free deferred until leases return");
                }
            }
            Self::take_if_done(&mut state, buffer)
        };
        if let Some(f) = freed {
            f.finish(self.owner);
        }
    }

    fn take_if_done(state: &mut State, buffer: BufferId) -> Option<Freed> {
        let done = state
            .buffers
            .get(&buffer)
            .is_some_and(|e| e.retiring && e.leases.is_empty());
        if !done {
            return None;
        }
        let entry = state.buffers.remove(&buffer)?;
        state.freed += 1;
        Some(Freed {
            alloc: entry.alloc,
            holders: entry.holders.into_values().collect(),
        })
    }

    /// Marks every lease on `buffer` as revoked by `deadline`; returns them and their links.
    pub(crate) fn revoke(
        &self,
        buffer: BufferId,
        deadline: Instant,
    ) -> Result<Vec<(LeaseId, LinkRef)>, ActorError> {
        let mut state = self.lock();
        let entry = state
            .buffers
            .get_mut(&buffer)
            .ok_or(ActorError::UnknownBuffer(buffer))?;
        Ok(entry
            .leases
            .iter_mut()
            .map(|(lease, r)| {
                r.revoke_by = Some(r.revoke_by.map_or(deadline, |d| d.min(deadline)));
                (*lease, r.link.clone())
            })
            .collect())
    }

    /// Leases still out past their revoke deadline, and their links.
    pub(crate) fn overdue(&self, now: Instant) -> Vec<(LeaseId, LinkRef)> {
        let state = self.lock();
        state
            .buffers
            .values()
            .flat_map(|e| e.leases.iter())
            .filter(|(_, r)| r.revoke_by.is_some_and(|d| d <= now))
            .map(|(lease, r)| (*lease, r.link.clone()))
            .collect()
    }

    /// Leases out on one buffer.
    pub(crate) fn leases_on(&self, buffer: BufferId) -> usize {
        self.lock()
            .buffers
            .get(&buffer)
            .map_or(0, |e| e.leases.len())
    }

    /// The lease table.
    pub(crate) fn table(&self) -> Vec<BufferLeases> {
        let state = self.lock();
        let mut out: Vec<BufferLeases> = state
            .buffers
            .iter()
            .map(|(id, e)| {
                let mut leases: Vec<_> =
                    e.leases.iter().map(|(l, r)| (*l, r.link.peer())).collect();
                leases.sort();
                BufferLeases {
                    buffer: *id,
                    alloc: e.alloc.id(),
                    leases,
                    retiring: e.retiring,
                }
            })
            .collect();
        out.sort_by_key(|b| b.buffer);
        out
    }

    /// Counters.
    pub(crate) fn stats(&self) -> OwnerStats {
        let state = self.lock();
        OwnerStats {
            buffers: state.buffers.len(),
            retiring: state.buffers.values().filter(|e| e.retiring).count(),
            leases: state.lease_index.len(),
            bytes: state.buffers.values().map(|e| e.alloc.size() as u64).sum(),
            granted: state.granted,
            freed: state.freed,
        }
    }
}
