//! The lease ledger: who may map each exported allocation, as a state machine without I/O.
//!
//! Like quinn-proto's connection or the link handshake, the ledger owns no socket, thread,
//! timer or driver object. The node feeds it events — a lease granted or released, a link
//! cut, a process confirmed dead, a buffer retired, a revoke, a deadline passed, a mapping
//! closed — and carries out the [`Action`]s it queues: send a revoke or an unmap, cut a
//! link, free memory, report a quarantine. Every interleaving can therefore be driven from
//! a test, and the property tests at the bottom of this file do so against a simple model.
//!
//! # What it tracks, per allocation
//!
//! - **Leases**: one per buffer in a message, from the moment its offer is sent (so one
//!   lost in flight still counts) until the importer's `Release` — which may carry a
//!   *release fence*: the point on the importer's stream after its last use.
//! - **Mapping holds**, per link: the importer's process may map the allocation (its import
//!   cache keeps a mapping warm after its last lease drops). A hold starts with the first
//!   offer over a link — that offer carries the descriptor, later ones do not — and ends
//!   with the importer's `Unmapped`, sent after it closed the mapping, either because we
//!   asked (`Unmap`: we free the allocation, or the importer asked us with `Evict` to let it
//!   drop an idle mapping) or because it could not open the offer.
//! - **Cut holders**: processes whose link was cut while they held a lease or a mapping.
//!   Cutting a link does not stop a live process from mapping memory it has mapped.
//! - **Relayed leases** (forwarding, see [`relay`](crate::relay)): a lease granted at the
//!   request of a holder over `link` for a *third* process, which maps the memory without
//!   a link to us. Its holder is that process, not the link's: the lease is released over
//!   the relaying link, or ends when the holder is confirmed dead. If the relaying link
//!   goes down first, the lease is *stranded*: it keeps the allocation — whatever the
//!   backend's rule — until its holder is confirmed dead, since nobody can carry its
//!   `Release` any more and nothing else tells us it stopped mapping.
//!
//! # The invariant
//!
//! *An allocation's memory is freed only when no `Buffer` handle is left, no lease is out,
//! and no process that may still map it is alive*: every importer that opened it has
//! acknowledged closing its mapping (`Unmapped`), or is confirmed dead (its process id and
//! start time, or its pidfd), or its link was cut and the backend declares that a free does
//! not disturb a process that still maps the memory ([`FreeWhileMapped::Survives`]: host
//! memory, CUDA VMM). Where a free does disturb it ([`FreeWhileMapped::Unsafe`]: CUDA legacy
//! IPC, where `cuMemFree` before the importer's `cuIpcCloseMemHandle` lets the exporter's
//! next allocation reuse pages another process still writes), the allocation is
//! **quarantined** instead: counted, reported, and freed when the last cut holder is
//! confirmed dead. The [`Action::Free`] it emits carries the newest release fence of every
//! counter slot or event the importers sent (a newer one [`Covers`] the older ones), and the
//! node frees only after they complete, so no GPU work that uses the memory can still run
//! either.
//!
//! `check` (tests only) verifies the bookkeeping after every event.

use crate::ids::{BufferId, LinkId};
use baton_ipc::FreeWhileMapped;
use baton_messages::{ActorId, AllocationId, LeaseId, ProcessId};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

/// A release fence that may make another redundant: waiting on `self` also waits for
/// everything `earlier` follows. The ledger keeps only fences no other kept fence covers.
pub(crate) trait Covers {
    /// Whether waiting on `self` also waits for everything `earlier` was recorded after.
    /// Reflexive: a fence covers itself (and an equal one).
    fn covers(&self, earlier: &Self) -> bool;
}

/// What a [`BufferOwner`](crate::BufferOwner) does to a holder that keeps a revoked lease
/// past its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RevokePolicy {
    /// Cut the holder's link (the default). Its leases no longer count, but where the
    /// backend's free is unsafe while a live process maps the memory (CUDA legacy IPC), the
    /// memory stays quarantined until that process is confirmed dead.
    #[default]
    Cut,
    /// Cut the link and, when the holder is a child of this node's
    /// [`ProcessSupervisor`](crate::ProcessSupervisor), SIGKILL it: the quarantine ends when
    /// it is reaped (and the supervisor restarts it by its strategy). Other holders are
    /// only cut.
    KillSupervisedChild,
}

/// Why the ledger refused an event. Each is the peer's or the caller's mistake; the ledger
/// is unchanged by a refused event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The buffer or allocation is not in the ledger (freed, or never recorded).
    UnknownBuffer,
    /// The buffer has no `Buffer` handle left: nothing may lease it any more.
    NotLive,
    /// The link is not up (never registered, or cut).
    LinkDown,
    /// No lease of that id was granted over that link.
    UnknownLease,
    /// The link relays as many leases as it may.
    TooManyRelayed,
}

/// Something the node must do for the ledger.
#[derive(Debug)]
pub(crate) enum Action<M, F> {
    /// Ask the holder of `lease` (over `link`) to give it back by `deadline`.
    Revoke {
        link: LinkId,
        lease: LeaseId,
        deadline: Instant,
    },
    /// Ask the importer over `link` to close its mapping of `alloc` and answer `Unmapped`.
    Unmap { link: LinkId, alloc: AllocationId },
    /// Cut `link`: its peer kept `lease` past the revoke deadline. `kill`: the owner's
    /// policy asks to SIGKILL the holder if it is a supervised child.
    Cut {
        link: LinkId,
        lease: LeaseId,
        kill: bool,
    },
    /// Free the allocation once every fence has completed. Emitted once.
    Free {
        alloc: AllocationId,
        meta: M,
        fences: Vec<F>,
    },
    /// The allocation cannot be freed while these processes, whose links were cut, live.
    /// Emitted once per allocation, when it enters quarantine.
    Quarantine {
        alloc: AllocationId,
        bytes: u64,
        holders: Vec<ProcessId>,
    },
}

/// A new allocation, as [`Ledger::insert`] records it.
#[derive(Debug)]
pub(crate) struct NewAllocation<M> {
    pub(crate) alloc: AllocationId,
    pub(crate) buffer: BufferId,
    pub(crate) owner: ActorId,
    pub(crate) bytes: u64,
    pub(crate) rule: FreeWhileMapped,
    pub(crate) policy: RevokePolicy,
    /// What the node needs to free it (the backend allocation); handed back in
    /// [`Action::Free`].
    pub(crate) meta: M,
}

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    /// This offer starts a mapping hold: it must carry the allocation's descriptor (for
    /// descriptor-shared backends). Later offers over the same link name the allocation and
    /// the importer uses its mapping.
    pub(crate) new_hold: bool,
}

/// One importer's mapping hold over one link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Hold {
    /// Offers over this link may omit the descriptor.
    current: bool,
    /// `Unmap`s sent and not yet answered by `Unmapped`.
    draining: u32,
}

impl Hold {
    fn is_empty(&self) -> bool {
        !self.current && self.draining == 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// `Buffer` handles exist.
    Live,
    /// No handle is left: freed as soon as the invariant allows.
    Retired,
    /// Retired, no lease out, no live link holds it, but a cut holder may still map it and
    /// the backend's free is unsafe while it does.
    Quarantined,
}

#[derive(Debug)]
struct Entry<M, F> {
    buffer: BufferId,
    owner: ActorId,
    bytes: u64,
    rule: FreeWhileMapped,
    policy: RevokePolicy,
    meta: M,
    phase: Phase,
    leases: BTreeSet<LeaseId>,
    holds: BTreeMap<LinkId, Hold>,
    cut_holders: BTreeSet<ProcessId>,
    /// Relayed leases whose relaying link went down, and their holders: kept until the
    /// holder is confirmed dead.
    stranded: BTreeMap<LeaseId, ProcessId>,
    /// The release fences the free waits for: none covers another (see [`keep_newest`]),
    /// so there is at most one per (producer, counter slot) and one per event. A counter
    /// fence's slot is one of the lane we lent its producer (checked on arrival,
    /// `Backend::check_fence`), so however often the buffer is leased and released, this
    /// holds at most a lane's slots per producer, plus the distinct events sent.
    fences: Vec<F>,
}

/// Adds `fence` to `kept` unless a kept fence covers it, and drops the kept fences it covers.
fn keep_newest<F: Covers>(kept: &mut Vec<F>, fence: F) {
    if kept.iter().any(|k| k.covers(&fence)) {
        return;
    }
    kept.retain(|k| !fence.covers(k));
    kept.push(fence);
}

#[derive(Debug, Clone, Copy)]
struct LeaseRecord {
    alloc: AllocationId,
    link: LinkId,
    revoke_by: Option<Instant>,
    /// When it was granted (the caller's clock, as given to [`Ledger::grant`]).
    granted_at: Instant,
    /// A relayed lease: the third process that holds it (not the link's peer).
    relayed_to: Option<ProcessId>,
}

#[derive(Debug, Clone, Copy)]
struct LinkRecord {
    process: ProcessId,
    /// A `Cut` action was emitted for it already.
    cut_asked: bool,
}

/// One buffer's leases, for tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryView {
    pub(crate) buffer: BufferId,
    pub(crate) alloc: AllocationId,
    pub(crate) bytes: u64,
    pub(crate) leases: Vec<(LeaseId, ProcessId)>,
    pub(crate) relayed: Vec<RelayedView>,
    pub(crate) mapped_by: Vec<ProcessId>,
    pub(crate) cut_holders: Vec<ProcessId>,
    pub(crate) retiring: bool,
    pub(crate) quarantined: bool,
}

/// One relayed lease, for tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RelayedView {
    pub(crate) lease: LeaseId,
    pub(crate) holder: ProcessId,
    /// The process that relays it; `None` once its link is down (stranded).
    pub(crate) via: Option<ProcessId>,
}

/// Counters, for one owner or all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) buffers: usize,
    pub(crate) retiring: usize,
    pub(crate) quarantined: usize,
    pub(crate) quarantined_bytes: u64,
    pub(crate) leases: usize,
    pub(crate) bytes: u64,
    /// Bytes of the allocations at least one lease is out on.
    pub(crate) pinned_bytes: u64,
}

/// What one process holds of the ledger's allocations, for tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HolderView {
    pub(crate) process: ProcessId,
    /// A link to it is up.
    pub(crate) linked: bool,
    /// Leases it holds (over any of its links).
    pub(crate) leases: usize,
    /// Bytes of the allocations it holds at least one lease on.
    pub(crate) pinned_bytes: u64,
    /// Bytes of the allocations it holds a mapping hold on (warm or leased).
    pub(crate) mapped_bytes: u64,
    /// When its oldest lease was granted.
    pub(crate) oldest_grant: Option<Instant>,
    /// It is a cut holder of some allocation: it may map it until confirmed dead.
    pub(crate) cut: bool,
    /// Bytes of the quarantined allocations it is a cut holder of.
    pub(crate) quarantined_bytes: u64,
}

/// The lease ledger (see the module docs). `M` is what the node needs to free an
/// allocation; `F` a release fence.
#[derive(Debug)]
pub(crate) struct Ledger<M, F> {
    allocs: HashMap<AllocationId, Entry<M, F>>,
    buffers: HashMap<BufferId, AllocationId>,
    leases: HashMap<LeaseId, LeaseRecord>,
    links: HashMap<LinkId, LinkRecord>,
    actions: Vec<Action<M, F>>,
    /// Relayed leases that ended with their holder's death, by the link that relays them:
    /// the relay's `Release` of one may still be on its way (at most [`MAX_TOMBSTONES`]).
    ended_relays: HashMap<LeaseId, LinkId>,
    granted: u64,
    freed: u64,
}

/// Relayed leases ended by a death whose late `Release` is still accepted.
const MAX_TOMBSTONES: usize = 65_536;

impl<M, F> Default for Ledger<M, F> {
    fn default() -> Self {
        Self {
            allocs: HashMap::new(),
            buffers: HashMap::new(),
            leases: HashMap::new(),
            links: HashMap::new(),
            ended_relays: HashMap::new(),
            actions: Vec::new(),
            granted: 0,
            freed: 0,
        }
    }
}

impl<M, F> Ledger<M, F> {
    /// The actions queued by the events so far, oldest first.
    pub(crate) fn take_actions(&mut self) -> Vec<Action<M, F>> {
        std::mem::take(&mut self.actions)
    }

    /// Records a new allocation, live (its first `Buffer` handle exists).
    pub(crate) fn insert(&mut self, new: NewAllocation<M>) {
        self.buffers.insert(new.buffer, new.alloc);
        self.allocs.insert(
            new.alloc,
            Entry {
                buffer: new.buffer,
                owner: new.owner,
                bytes: new.bytes,
                rule: new.rule,
                policy: new.policy,
                meta: new.meta,
                phase: Phase::Live,
                leases: BTreeSet::new(),
                holds: BTreeMap::new(),
                cut_holders: BTreeSet::new(),
                stranded: BTreeMap::new(),
                fences: Vec::new(),
            },
        );
    }

    /// A link to `process` is up.
    pub(crate) fn link_up(&mut self, link: LinkId, process: ProcessId) {
        self.links.insert(
            link,
            LinkRecord {
                process,
                cut_asked: false,
            },
        );
    }

    /// Grants the peer over `link` a lease on `alloc`, before its offer is sent; `now` is
    /// the caller's clock (the lease's age in [`holders`](Self::holders) counts from it).
    pub(crate) fn grant(
        &mut self,
        alloc: AllocationId,
        link: LinkId,
        lease: LeaseId,
        now: Instant,
    ) -> Result<Grant, Refusal> {
        if !self.links.contains_key(&link) {
            return Err(Refusal::LinkDown);
        }
        let entry = self.allocs.get_mut(&alloc).ok_or(Refusal::UnknownBuffer)?;
        if entry.phase != Phase::Live {
            return Err(Refusal::NotLive);
        }
        entry.leases.insert(lease);
        let hold = entry.holds.entry(link).or_default();
        let new_hold = !hold.current;
        hold.current = true;
        self.leases.insert(
            lease,
            LeaseRecord {
                alloc,
                link,
                revoke_by: None,
                granted_at: now,
                relayed_to: None,
            },
        );
        self.granted += 1;
        Ok(Grant { new_hold })
    }

    /// Grants `holder`, a process with no link to us, a lease on the allocation of `via`
    /// — a lease out over `link`, whose peer asked to forward it — before the offer goes
    /// out through that peer. Starts no mapping hold: the holder keeps no warm mapping of
    /// a relayed offer. Allowed on a retired allocation (`via` keeps it allocated).
    /// Refused for a `via` not out over `link` (or itself relayed: forwards are one hop),
    /// a link that is down, and a holder already at `max` relayed leases over `link`.
    pub(crate) fn grant_relayed(
        &mut self,
        via: LeaseId,
        link: LinkId,
        lease: LeaseId,
        holder: ProcessId,
        max: usize,
        now: Instant,
    ) -> Result<AllocationId, Refusal> {
        if !self.links.contains_key(&link) {
            return Err(Refusal::LinkDown);
        }
        let alloc = match self.leases.get(&via) {
            Some(r) if r.link == link && r.relayed_to.is_none() => r.alloc,
            _ => return Err(Refusal::UnknownLease),
        };
        let relayed = self
            .leases
            .values()
            .filter(|r| r.link == link && r.relayed_to.is_some())
            .count();
        if relayed >= max {
            return Err(Refusal::TooManyRelayed);
        }
        let entry = self.allocs.get_mut(&alloc).expect("a lease's entry exists");
        entry.leases.insert(lease);
        self.leases.insert(
            lease,
            LeaseRecord {
                alloc,
                link,
                revoke_by: None,
                granted_at: now,
                relayed_to: Some(holder),
            },
        );
        self.granted += 1;
        Ok(alloc)
    }

    /// Whether `lease` was relayed over `link` and ended with its holder's death (then a
    /// `Release` of it that crossed the death is harmless); forgets it.
    pub(crate) fn forget_ended_relay(&mut self, lease: LeaseId, link: LinkId) -> bool {
        if self.ended_relays.get(&lease) == Some(&link) {
            self.ended_relays.remove(&lease);
            true
        } else {
            false
        }
    }

    /// Takes back a lease whose offer was never sent. `grant` is what [`grant`](Self::grant)
    /// returned: a hold it started is undone too, so the next offer carries the descriptor.
    pub(crate) fn ungrant(&mut self, lease: LeaseId, grant: Grant) {
        let Some(record) = self.leases.remove(&lease) else {
            return;
        };
        if let Some(entry) = self.allocs.get_mut(&record.alloc) {
            entry.leases.remove(&lease);
            if grant.new_hold {
                if let Some(hold) = entry.holds.get_mut(&record.link) {
                    hold.current = false;
                    if hold.is_empty() {
                        entry.holds.remove(&record.link);
                    }
                }
            }
        }
        self.settle(record.alloc);
    }

    /// The peer over `link` gave `lease` back, after the work its `fences` mark. The
    /// allocation keeps them until it is freed ([`Action::Free`]), but only the newest per
    /// counter slot or event: a fence a kept one [`Covers`] is dropped, and kept fences the
    /// new one covers are replaced by it.
    pub(crate) fn release(
        &mut self,
        lease: LeaseId,
        link: LinkId,
        fences: impl IntoIterator<Item = F>,
    ) -> Result<AllocationId, Refusal>
    where
        F: Covers,
    {
        match self.leases.get(&lease) {
            Some(record) if record.link == link => {}
            _ => return Err(Refusal::UnknownLease),
        }
        let record = self.leases.remove(&lease).expect("checked above");
        let entry = self
            .allocs
            .get_mut(&record.alloc)
            .expect("a recorded lease has its entry");
        entry.leases.remove(&lease);
        for fence in fences {
            keep_newest(&mut entry.fences, fence);
        }
        self.settle(record.alloc);
        Ok(record.alloc)
    }

    /// Whether the importer over `link` was asked to unmap `alloc` (an `Unmapped` from it
    /// answers that, rather than an offer it could not open).
    pub(crate) fn unmap_asked(&self, link: LinkId, alloc: AllocationId) -> bool {
        self.allocs
            .get(&alloc)
            .and_then(|e| e.holds.get(&link))
            .is_some_and(|h| h.draining > 0)
    }

    /// The last `Buffer` handle of `buffer` dropped: free it as soon as the invariant allows.
    pub(crate) fn retire(&mut self, buffer: BufferId) {
        let Some(&alloc) = self.buffers.get(&buffer) else {
            return;
        };
        if let Some(entry) = self.allocs.get_mut(&alloc) {
            if entry.phase == Phase::Live {
                entry.phase = Phase::Retired;
            }
        }
        self.settle(alloc);
    }

    /// Asks every holder of `buffer` to give its lease back by `deadline` (an earlier
    /// deadline of an earlier revoke stands). Returns how many leases were asked back.
    pub(crate) fn revoke(&mut self, buffer: BufferId, deadline: Instant) -> Result<usize, Refusal> {
        let alloc = *self.buffers.get(&buffer).ok_or(Refusal::UnknownBuffer)?;
        let entry = self.allocs.get(&alloc).ok_or(Refusal::UnknownBuffer)?;
        for lease in &entry.leases {
            let record = self.leases.get_mut(lease).expect("indexed");
            let by = record.revoke_by.map_or(deadline, |d| d.min(deadline));
            record.revoke_by = Some(by);
            self.actions.push(Action::Revoke {
                link: record.link,
                lease: *lease,
                deadline: by,
            });
        }
        Ok(entry.leases.len())
    }

    /// Time passed: cuts the links of holders past a revoke deadline (once per link).
    pub(crate) fn tick(&mut self, now: Instant) {
        let mut overdue: Vec<(LinkId, LeaseId, AllocationId)> = self
            .leases
            .iter()
            // A relayed lease's holder has no link to cut, and cutting its relay would
            // punish the wrong process: it stays counted until released or its holder dies.
            .filter(|(_, r)| r.relayed_to.is_none() && r.revoke_by.is_some_and(|d| d <= now))
            .map(|(lease, r)| (r.link, *lease, r.alloc))
            .collect();
        overdue.sort();
        for (link, lease, alloc) in overdue {
            let Some(record) = self.links.get_mut(&link) else {
                continue;
            };
            if record.cut_asked {
                continue;
            }
            record.cut_asked = true;
            let kill = self.allocs.get(&alloc).map(|e| e.policy)
                == Some(RevokePolicy::KillSupervisedChild);
            self.actions.push(Action::Cut { link, lease, kill });
        }
    }

    /// The importer over `link` asks to drop its idle mapping of `alloc`: answer with
    /// `Unmap` (after which offers carry the descriptor again).
    pub(crate) fn evict(&mut self, link: LinkId, alloc: AllocationId) {
        let Some(hold) = self
            .allocs
            .get_mut(&alloc)
            .and_then(|e| e.holds.get_mut(&link))
        else {
            return;
        };
        if hold.current {
            hold.current = false;
            hold.draining += 1;
            self.actions.push(Action::Unmap { link, alloc });
        }
    }

    /// The importer over `link` closed its mapping of `alloc` (the answer to an `Unmap`, or
    /// after an offer it could not open). Returns whether it held one; an unmatched
    /// `Unmapped` is harmless (an `Unmap` and a failed open can cross) and changes nothing.
    pub(crate) fn unmapped(&mut self, link: LinkId, alloc: AllocationId) -> bool {
        let Some(entry) = self.allocs.get_mut(&alloc) else {
            return false;
        };
        let Some(hold) = entry.holds.get_mut(&link) else {
            return false;
        };
        if hold.draining > 0 {
            hold.draining -= 1;
        } else {
            hold.current = false;
        }
        if hold.is_empty() {
            entry.holds.remove(&link);
        }
        self.settle(alloc);
        true
    }

    /// `link` is down (end of stream, a fault, a revoke deadline, a close). Its leases no
    /// longer count, and its peer no longer answers `Unmap`; until that process is
    /// confirmed dead it may still map what it held, which only matters where the
    /// backend's free is unsafe while mapped.
    pub(crate) fn link_cut(&mut self, link: LinkId) {
        let Some(record) = self.links.remove(&link) else {
            return;
        };
        self.drop_links(&[link], Some(record.process));
    }

    /// `process` is confirmed dead: nothing of ours is mapped there any more.
    pub(crate) fn process_dead(&mut self, process: ProcessId) {
        let links: Vec<LinkId> = self
            .links
            .iter()
            .filter(|(_, r)| r.process == process)
            .map(|(l, _)| *l)
            .collect();
        for link in &links {
            self.links.remove(link);
        }
        // Its relayed leases end: nothing of ours is mapped there any more.
        let relayed: Vec<(LeaseId, AllocationId)> = self
            .leases
            .iter()
            .filter(|(_, r)| r.relayed_to == Some(process))
            .map(|(l, r)| (*l, r.alloc))
            .collect();
        for (lease, alloc) in &relayed {
            let record = self.leases.remove(lease).expect("listed");
            if self.ended_relays.len() < MAX_TOMBSTONES {
                self.ended_relays.insert(*lease, record.link);
            }
            if let Some(entry) = self.allocs.get_mut(alloc) {
                entry.leases.remove(lease);
            }
        }
        // Forget it as a cut holder (and its stranded leases) first, so that settling
        // below sees it gone.
        let mut touched: Vec<AllocationId> = self
            .allocs
            .iter_mut()
            .filter_map(|(id, e)| {
                let stranded = e.stranded.len();
                e.stranded.retain(|_, holder| *holder != process);
                (e.cut_holders.remove(&process) || e.stranded.len() != stranded).then_some(*id)
            })
            .collect();
        touched.extend(relayed.into_iter().map(|(_, alloc)| alloc));
        self.drop_links(&links, None);
        for alloc in touched {
            self.settle(alloc);
        }
    }

    /// Removes the leases and holds of `links` (all of them before anything settles, so
    /// no `Unmap` goes to a link about to go); `cut_holder` is recorded where they held any.
    fn drop_links(&mut self, links: &[LinkId], cut_holder: Option<ProcessId>) {
        if links.is_empty() {
            return;
        }
        // Relayed leases over them are stranded: their holders may still map the memory.
        let stranded: Vec<(LeaseId, AllocationId, ProcessId)> = self
            .leases
            .iter()
            .filter(|(_, r)| links.contains(&r.link))
            .filter_map(|(l, r)| r.relayed_to.map(|holder| (*l, r.alloc, holder)))
            .collect();
        let stranded_now: BTreeSet<LeaseId> = stranded.iter().map(|(l, ..)| *l).collect();
        for (lease, alloc, holder) in stranded {
            if let Some(entry) = self.allocs.get_mut(&alloc) {
                entry.stranded.insert(lease, holder);
            }
        }
        self.leases.retain(|_, r| !links.contains(&r.link));
        self.ended_relays.retain(|_, link| !links.contains(link));
        let mut touched = Vec::new();
        for (id, entry) in &mut self.allocs {
            let before = entry.leases.len();
            // The relay of a stranded lease never mapped the memory through it: only its
            // own leases and holds make the link's process a cut holder.
            let mut own = false;
            entry.leases.retain(|lease| {
                let keep = self.leases.contains_key(lease);
                own |= !keep && !stranded_now.contains(lease);
                keep
            });
            let holds = entry.holds.len();
            entry.holds.retain(|link, _| !links.contains(link));
            if entry.holds.len() != holds || own {
                if let Some(process) = cut_holder {
                    entry.cut_holders.insert(process);
                }
            }
            if entry.holds.len() != holds || entry.leases.len() != before {
                touched.push(*id);
            }
        }
        for alloc in touched {
            self.settle(alloc);
        }
    }

    /// Moves a retired allocation on: `Unmap` to live holders, then free, or quarantine.
    fn settle(&mut self, alloc: AllocationId) {
        let Some(entry) = self.allocs.get_mut(&alloc) else {
            return;
        };
        if entry.phase == Phase::Live || !entry.leases.is_empty() {
            return;
        }
        for (link, hold) in &mut entry.holds {
            if hold.current {
                hold.current = false;
                hold.draining += 1;
                self.actions.push(Action::Unmap { link: *link, alloc });
            }
        }
        // A stranded lease's holder may map it until it is confirmed dead, whatever the
        // backend's rule: nobody can carry its `Release` any more.
        if !entry.holds.is_empty() || !entry.stranded.is_empty() {
            return;
        }
        if entry.rule == FreeWhileMapped::Unsafe && !entry.cut_holders.is_empty() {
            if entry.phase != Phase::Quarantined {
                entry.phase = Phase::Quarantined;
                self.actions.push(Action::Quarantine {
                    alloc,
                    bytes: entry.bytes,
                    holders: entry.cut_holders.iter().copied().collect(),
                });
            }
            return;
        }
        let entry = self.allocs.remove(&alloc).expect("present");
        self.buffers.remove(&entry.buffer);
        self.freed += 1;
        self.actions.push(Action::Free {
            alloc,
            meta: entry.meta,
            fences: entry.fences,
        });
    }

    /// The owner of `buffer`.
    pub(crate) fn owner_of(&self, buffer: BufferId) -> Option<ActorId> {
        let alloc = self.buffers.get(&buffer)?;
        self.allocs.get(alloc).map(|e| e.owner)
    }

    /// Leases out on `buffer`.
    pub(crate) fn leases_on(&self, buffer: BufferId) -> usize {
        self.buffers
            .get(&buffer)
            .and_then(|a| self.allocs.get(a))
            .map_or(0, |e| e.leases.len())
    }

    /// Whether `lease` is out (granted, not yet back).
    pub(crate) fn is_out(&self, lease: LeaseId) -> bool {
        self.leases.contains_key(&lease)
    }

    /// The stranded relayed leases (see the module docs).
    pub(crate) fn stranded(&self) -> BTreeSet<LeaseId> {
        self.allocs
            .values()
            .flat_map(|e| e.stranded.keys().copied())
            .collect()
    }

    /// The process at the other end of a live link.
    pub(crate) fn link_process(&self, link: LinkId) -> Option<ProcessId> {
        self.links.get(&link).map(|r| r.process)
    }

    /// Every allocation of `owner` (all owners: `None`), in buffer order.
    pub(crate) fn view(&self, owner: Option<ActorId>) -> Vec<EntryView> {
        let mut out: Vec<EntryView> = self
            .allocs
            .iter()
            .filter(|(_, e)| owner.is_none_or(|o| e.owner == o))
            .map(|(alloc, e)| {
                let mut relayed: Vec<RelayedView> = Vec::new();
                let mut leases: Vec<(LeaseId, ProcessId)> = e
                    .leases
                    .iter()
                    .filter_map(|l| {
                        let r = self.leases.get(l)?;
                        let via = self.links.get(&r.link)?.process;
                        match r.relayed_to {
                            Some(holder) => {
                                relayed.push(RelayedView {
                                    lease: *l,
                                    holder,
                                    via: Some(via),
                                });
                                Some((*l, holder))
                            }
                            None => Some((*l, via)),
                        }
                    })
                    .collect();
                for (lease, holder) in &e.stranded {
                    leases.push((*lease, *holder));
                    relayed.push(RelayedView {
                        lease: *lease,
                        holder: *holder,
                        via: None,
                    });
                }
                leases.sort();
                relayed.sort_by_key(|r| r.lease);
                let mut mapped_by: Vec<ProcessId> = e
                    .holds
                    .keys()
                    .filter_map(|l| self.links.get(l).map(|r| r.process))
                    .collect();
                mapped_by.sort();
                mapped_by.dedup();
                EntryView {
                    buffer: e.buffer,
                    alloc: *alloc,
                    bytes: e.bytes,
                    leases,
                    relayed,
                    mapped_by,
                    cut_holders: e.cut_holders.iter().copied().collect(),
                    retiring: e.phase != Phase::Live,
                    quarantined: e.phase == Phase::Quarantined,
                }
            })
            .collect();
        out.sort_by_key(|v| v.buffer);
        out
    }

    /// Counters of `owner` (all owners: `None`).
    pub(crate) fn counts(&self, owner: Option<ActorId>) -> Counts {
        let mut c = Counts::default();
        for e in self
            .allocs
            .values()
            .filter(|e| owner.is_none_or(|o| e.owner == o))
        {
            c.buffers += 1;
            c.bytes += e.bytes;
            c.leases += e.leases.len() + e.stranded.len();
            if !e.leases.is_empty() || !e.stranded.is_empty() {
                c.pinned_bytes += e.bytes;
            }
            match e.phase {
                Phase::Live => {}
                Phase::Retired => c.retiring += 1,
                Phase::Quarantined => {
                    c.retiring += 1;
                    c.quarantined += 1;
                    c.quarantined_bytes += e.bytes;
                }
            }
        }
        c
    }

    /// Every process that holds a lease or a mapping hold on an allocation, or is a cut
    /// holder of one, in process order.
    pub(crate) fn holders(&self) -> Vec<HolderView> {
        let mut by: BTreeMap<ProcessId, HolderView> = BTreeMap::new();
        let view = |by: &mut BTreeMap<ProcessId, HolderView>, process: ProcessId| {
            by.entry(process).or_insert_with(|| HolderView {
                process,
                linked: false,
                leases: 0,
                pinned_bytes: 0,
                mapped_bytes: 0,
                oldest_grant: None,
                cut: false,
                quarantined_bytes: 0,
            });
        };
        for e in self.allocs.values() {
            // Per process: whether it leases this allocation, whether it maps it.
            let mut leasing: BTreeSet<ProcessId> = BTreeSet::new();
            for lease in &e.leases {
                let Some(r) = self.leases.get(lease) else {
                    continue;
                };
                let Some(link) = self.links.get(&r.link) else {
                    continue;
                };
                let process = r.relayed_to.unwrap_or(link.process);
                view(&mut by, process);
                let h = by.get_mut(&process).expect("just inserted");
                h.leases += 1;
                h.oldest_grant = Some(h.oldest_grant.map_or(r.granted_at, |t| t.min(r.granted_at)));
                if leasing.insert(process) {
                    h.pinned_bytes += e.bytes;
                }
            }
            for &process in e.stranded.values() {
                view(&mut by, process);
                let h = by.get_mut(&process).expect("just inserted");
                h.leases += 1;
                h.cut = true;
                if leasing.insert(process) {
                    h.pinned_bytes += e.bytes;
                }
            }
            let mapping: BTreeSet<ProcessId> = e
                .holds
                .keys()
                .filter_map(|l| self.links.get(l).map(|r| r.process))
                .collect();
            for process in mapping {
                view(&mut by, process);
                by.get_mut(&process).expect("just inserted").mapped_bytes += e.bytes;
            }
            for &process in &e.cut_holders {
                view(&mut by, process);
                let h = by.get_mut(&process).expect("just inserted");
                h.cut = true;
                if e.phase == Phase::Quarantined {
                    h.quarantined_bytes += e.bytes;
                }
            }
        }
        for link in self.links.values() {
            if let Some(h) = by.get_mut(&link.process) {
                h.linked = true;
            }
        }
        by.into_values().collect()
    }

    /// What the node keeps of `alloc` to free it.
    pub(crate) fn meta(&self, alloc: AllocationId) -> Option<&M> {
        self.allocs.get(&alloc).map(|e| &e.meta)
    }

    /// Leases granted so far (with those whose offer never went out).
    pub(crate) fn granted(&self) -> u64 {
        self.granted
    }

    /// Allocations freed so far.
    pub(crate) fn freed(&self) -> u64 {
        self.freed
    }

    /// The release fences `alloc` keeps for its free.
    #[cfg(test)]
    pub(crate) fn fences(&self, alloc: AllocationId) -> Option<&[F]> {
        self.allocs.get(&alloc).map(|e| e.fences.as_slice())
    }

    /// Checks that no allocation keeps a release fence another of its fences covers.
    /// Panics if one does.
    #[cfg(test)]
    pub(crate) fn check_fences(&self)
    where
        F: Covers + std::fmt::Debug,
    {
        for (alloc, e) in &self.allocs {
            for (i, a) in e.fences.iter().enumerate() {
                for (j, b) in e.fences.iter().enumerate() {
                    assert!(
                        i == j || !a.covers(b),
                        "{alloc:?} keeps {b:?}, which {a:?} covers"
                    );
                }
            }
        }
    }

    /// Checks the bookkeeping: indexes agree, holds and leases name live links, quarantine
    /// only where the rule asks for it. Panics on a broken invariant.
    #[cfg(test)]
    pub(crate) fn check(&self) {
        for (lease, r) in &self.leases {
            let entry = self
                .allocs
                .get(&r.alloc)
                .expect("a lease's allocation exists");
            assert!(entry.leases.contains(lease), "lease index and entry agree");
            assert!(
                self.links.contains_key(&r.link),
                "a lease is on a live link"
            );
        }
        for (alloc, e) in &self.allocs {
            assert_eq!(self.buffers.get(&e.buffer), Some(alloc), "buffer index");
            for lease in &e.leases {
                assert_eq!(self.leases.get(lease).map(|r| r.alloc), Some(*alloc));
            }
            for (link, hold) in &e.holds {
                assert!(self.links.contains_key(link), "a hold is on a live link");
                assert!(!hold.is_empty(), "empty holds are removed");
            }
            match e.phase {
                Phase::Live => {}
                Phase::Retired => {
                    // A retired entry with nothing holding it would have been freed.
                    assert!(
                        !e.leases.is_empty() || !e.holds.is_empty() || !e.stranded.is_empty(),
                        "a retired allocation nobody holds is freed"
                    );
                }
                Phase::Quarantined => {
                    assert_eq!(e.rule, FreeWhileMapped::Unsafe);
                    assert!(e.leases.is_empty() && e.holds.is_empty() && e.stranded.is_empty());
                    assert!(!e.cut_holders.is_empty());
                }
            }
            for lease in e.stranded.keys() {
                assert!(
                    !self.leases.contains_key(lease),
                    "a stranded lease is not out"
                );
            }
            if e.phase != Phase::Live && e.leases.is_empty() {
                assert!(
                    e.holds.values().all(|h| !h.current),
                    "every live holder of a retired allocation was asked to unmap"
                );
            }
        }
        assert_eq!(self.buffers.len(), self.allocs.len());
    }
}

#[cfg(test)]
mod tests;
