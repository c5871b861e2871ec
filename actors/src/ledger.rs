//! The lease ledger: who may map each exported allocation, as a state machine without I/O.
//!
//! Like quinn-proto's connection or the link handshake, the ledger owns no socket, thread,
//! timer or driver object. The node feeds it events — a lease granted or released, a link
//! cut, a process confirmed dead, a buffer retired, a revoke, a deadline passed, a mapping
//! closed — and carries out the [`Action`]s it queues: send a revoke or an unmap, cut a
//! link, free memory, report a quarantine, let go of what a lease that ended kept
//! ([`Action::LeaseEnded`], with the data the node gave its grant). Every interleaving can
//! therefore be driven from a test, and the property tests in `ledger/tests.rs` do so
//! against a simple model.
//!
//! # What it tracks, per allocation
//!
//! - **Leases**: one per buffer in a message, from the moment its offer is sent (so one
//!   lost in flight still counts) until the importer's `Release` — which may carry a
//!   *release fence*: the point on the importer's stream after its last use. Each lease
//!   covers a byte range of the allocation ([`Access`]: the whole buffer, or the part a
//!   range lease names). One writer or many readers, *per range*: a writable lease is
//!   granted only while no other lease that overlaps its range is out (stranded relayed
//!   leases included), and no lease while a writable one that overlaps it is; leases on
//!   disjoint ranges never conflict, so writable leases of the two halves of a buffer
//!   coexist. Each lease keeps the data the node gave its grant (its acquire fence) and
//!   hands it back in [`Action::LeaseEnded`].
//! - **Mapping holds**, per link: the importer's process may map the allocation (its import
//!   cache keeps a mapping warm after its last lease drops). A hold starts with the first
//!   offer over a link — that offer carries the descriptor, later ones do not — and ends
//!   with the importer's `Unmapped`, sent after it closed the mapping, either because we
//!   asked (`Unmap`: we free the allocation, or the importer asked us with `Evict` to let it
//!   drop an idle mapping) or because it could not open the offer.
//! - **Pool descriptors**, per link: for memory of an exporter's pool, the first offer of
//!   any allocation of the pool over a link carries the pool's descriptor, until the link
//!   goes, the importer says it could not open an offer of the pool, or the backend retires
//!   the pool (then each link that carried its descriptor is told, [`Action::ForgetPool`],
//!   so that the importer drops its import and the device gets the memory back).
//! - **Cut holders**: processes whose link was cut while they held a lease or a mapping.
//!   Cutting a link does not stop a live process from mapping memory it has mapped.
//! - **Relayed leases** (forwarding, see [`relay`](crate::relay)): a lease granted at the
//!   request of a holder over `link` for a *third* process, which maps the memory without
//!   a link to us. Its holder is that process, not the link's: the lease is released over
//!   the relaying link, or ends when the holder is confirmed dead. If the relaying link
//!   goes down first, the lease is *stranded*: it keeps the allocation — whatever the
//!   backend's rule — until its holder is confirmed dead, since nobody can carry its
//!   `Release` any more and nothing else tells us it stopped mapping. A stranded lease
//!   still counts as a lease out on its buffer ([`Ledger::leases_on`]): the owner's
//!   `returned()` waits for it and its writes are refused, as for any reader (issue 45,
//!   finding 6).
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
//! It also counts, per owner and in all, the leases granted and the allocations freed.
//!
//! What the node reports of it — the lease table, the counters, what each process holds —
//! is read in [`tables`]; `check` (tests only, `ledger/check.rs`) verifies the bookkeeping
//! after every event.

use crate::ids::{BufferId, FastMap, LinkId};
use baton_ipc::FreeWhileMapped;
use baton_messages::{ActorId, AllocationId, LeaseId, ProcessId};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::time::Instant;

pub(crate) use tables::{Counts, EntryView, HolderView};

/// A release fence that may make another redundant: waiting on `self` also waits for
/// everything `earlier` follows. The ledger keeps only fences no other kept fence covers.
pub(crate) trait Covers {
    /// Whether waiting on `self` also waits for everything `earlier` was recorded after.
    /// Reflexive: a fence covers itself (and an equal one).
    fn covers(&self, earlier: &Self) -> bool;
}

/// What a lease may touch: bytes of its allocation, and whether it writes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Access {
    /// The bytes of the allocation the lease covers (never empty: the node refuses empty
    /// ranges before it asks).
    pub(crate) bytes: Range<u64>,
    /// A writable lease: no other lease that overlaps `bytes` is out while it is.
    pub(crate) writable: bool,
}

impl Access {
    /// A read-only lease of `bytes`.
    pub(crate) fn read(bytes: Range<u64>) -> Self {
        Self {
            bytes,
            writable: false,
        }
    }

    /// A writable lease of `bytes`.
    pub(crate) fn write(bytes: Range<u64>) -> Self {
        Self {
            bytes,
            writable: true,
        }
    }
}

/// Whether two byte ranges share a byte (empty ranges share none).
pub(crate) fn overlaps(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end && a.start < a.end && b.start < b.end
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
    /// A writable lease that overlaps the range asked for is out: no lease on those bytes
    /// is granted (nor is the writable lease forwarded) until it is back.
    WriterOut,
    /// A writable lease was asked for while other leases that overlap its range are out.
    ReadersOut,
}

/// Something the node must do for the ledger. `D` is the data the node gave each grant.
#[derive(Debug)]
pub(crate) enum Action<M, F, D = ()> {
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
    /// Tell the importer over `link` that `pool`, whose descriptor went over it, is
    /// retired: it drops its import. Emitted once per link that carried the descriptor.
    ForgetPool { link: LinkId, pool: u64 },
    /// `lease` on `alloc` is over: released, taken back unsent, its link gone (a relayed
    /// lease's: its holder confirmed dead; until then it is stranded), or its relayed
    /// holder confirmed dead. `data` is what the node gave its grant, handed back once.
    LeaseEnded {
        lease: LeaseId,
        alloc: AllocationId,
        data: D,
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
    /// The exporter's pool it comes from, whose descriptor an offer carries once per link
    /// (`None`: the allocation's own descriptor, or none).
    pub(crate) pool: Option<u64>,
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
struct Entry<M, F, D> {
    buffer: BufferId,
    owner: ActorId,
    bytes: u64,
    rule: FreeWhileMapped,
    policy: RevokePolicy,
    pool: Option<u64>,
    meta: M,
    phase: Phase,
    leases: EntryLeases,
    holds: BTreeMap<LinkId, Hold>,
    cut_holders: BTreeSet<ProcessId>,
    /// Relayed leases whose relaying link went down, and their holders: kept until the
    /// holder is confirmed dead.
    stranded: BTreeMap<LeaseId, Stranded<D>>,
    /// The release fences the free waits for: none covers another (see [`keep_newest`]),
    /// so there is at most one per (producer, counter slot) and one per event. A counter
    /// fence's slot is one of the lane we lent its producer (checked on arrival,
    /// `StreamOrdering::check_fence`), so however often the buffer is leased and released, this
    /// holds at most a lane's slots per producer, plus the distinct events sent.
    fences: Vec<F>,
}

/// The leases out on one allocation, and which of them are writable: a read-only grant
/// while no writable lease is out (a handoff's common case) looks at no other lease, where
/// looking at each would cost a lookup per lease out (256 in a pipeline of 256).
#[derive(Debug, Default)]
struct EntryLeases {
    all: BTreeSet<LeaseId>,
    /// Those of `all` that are writable.
    writable: BTreeSet<LeaseId>,
}

impl EntryLeases {
    fn insert(&mut self, lease: LeaseId, writable: bool) {
        self.all.insert(lease);
        if writable {
            self.writable.insert(lease);
        }
    }

    fn remove(&mut self, lease: &LeaseId) {
        self.writable.remove(lease);
        self.all.remove(lease);
    }

    /// Keeps the leases for which `keep` says so (it sees each once).
    fn retain(&mut self, keep: impl FnMut(&LeaseId) -> bool) {
        self.all.retain(keep);
        let all = &self.all;
        self.writable.retain(|lease| all.contains(lease));
    }

    fn iter(&self) -> std::collections::btree_set::Iter<'_, LeaseId> {
        self.all.iter()
    }

    fn len(&self) -> usize {
        self.all.len()
    }

    fn is_empty(&self) -> bool {
        self.all.is_empty()
    }
}

/// Adds `fence` to `kept` unless a kept fence covers it, and drops the kept fences it covers.
fn keep_newest<F: Covers>(kept: &mut Vec<F>, fence: F) {
    if kept.iter().any(|k| k.covers(&fence)) {
        return;
    }
    kept.retain(|k| !fence.covers(k));
    kept.push(fence);
}

/// A relayed lease whose relaying link went down (see the module docs).
#[derive(Debug)]
struct Stranded<D> {
    holder: ProcessId,
    /// The bytes it covers: a reader of them until its holder is confirmed dead.
    bytes: Range<u64>,
    data: D,
}

#[derive(Debug)]
struct LeaseRecord<D> {
    alloc: AllocationId,
    link: LinkId,
    revoke_by: Option<Instant>,
    /// When it was granted (the caller's clock, as given to [`Ledger::grant`]).
    granted_at: Instant,
    /// A relayed lease: the third process that holds it (not the link's peer).
    relayed_to: Option<ProcessId>,
    /// The bytes it covers, and whether it writes them (then no other lease out overlaps
    /// them).
    access: Access,
    /// Its grant started the link's mapping hold (undone with it, see [`Ledger::ungrant`]).
    new_hold: bool,
    /// The pool whose descriptor its offer carries (given back with an ungrant).
    pool: Option<u64>,
    /// What the node gave the grant: handed back in [`Action::LeaseEnded`].
    data: D,
}

#[derive(Debug)]
struct LinkRecord {
    process: ProcessId,
    /// A `Cut` action was emitted for it already.
    cut_asked: bool,
    /// The pools whose descriptor went over it, and that its importer has not failed to
    /// open an offer of since.
    pools: BTreeSet<u64>,
}

/// Leases granted and allocations freed so far, of one owner or all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    /// Leases granted (with those whose offer never went out, and relayed ones).
    pub(crate) granted: u64,
    /// Allocations freed.
    pub(crate) freed: u64,
}

/// The lease ledger (see the module docs). `M` is what the node needs to free an
/// allocation; `F` a release fence; `D` what the node keeps with each lease until it ends.
#[derive(Debug)]
pub(crate) struct Ledger<M, F, D = ()> {
    allocs: FastMap<AllocationId, Entry<M, F, D>>,
    buffers: FastMap<BufferId, AllocationId>,
    leases: FastMap<LeaseId, LeaseRecord<D>>,
    links: FastMap<LinkId, LinkRecord>,
    actions: Vec<Action<M, F, D>>,
    /// Relayed leases that ended with their holder's death, by the link that relays them:
    /// the relay's `Release` of one may still be on its way (at most [`MAX_TOMBSTONES`]).
    ended_relays: FastMap<LeaseId, LinkId>,
    totals: Totals,
    /// Per owner (an owner's entry stays once it has one).
    owners: FastMap<ActorId, Totals>,
}

/// Relayed leases ended by a death whose late `Release` is still accepted.
const MAX_TOMBSTONES: usize = 65_536;

impl<M, F, D> Default for Ledger<M, F, D> {
    fn default() -> Self {
        Self {
            allocs: FastMap::default(),
            buffers: FastMap::default(),
            leases: FastMap::default(),
            links: FastMap::default(),
            ended_relays: FastMap::default(),
            actions: Vec::new(),
            totals: Totals::default(),
            owners: FastMap::default(),
        }
    }
}

impl<M, F, D> Ledger<M, F, D> {
    /// The actions queued by the events so far, oldest first.
    #[cfg(test)]
    pub(crate) fn take_actions(&mut self) -> Vec<Action<M, F, D>> {
        self.swap_actions(Vec::new())
    }

    /// [`take_actions`](Self::take_actions), leaving `spare` (empty) for the next events
    /// to fill: a caller that keeps its emptied lists allocates none per event.
    pub(crate) fn swap_actions(&mut self, spare: Vec<Action<M, F, D>>) -> Vec<Action<M, F, D>> {
        debug_assert!(spare.is_empty(), "a spare actions list is empty");
        std::mem::replace(&mut self.actions, spare)
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
                pool: new.pool,
                meta: new.meta,
                phase: Phase::Live,
                leases: EntryLeases::default(),
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
                pools: BTreeSet::new(),
            },
        );
    }

    /// Grants the peer over `link` a lease on `access.bytes` of `alloc`
    /// (`access.writable`: those bytes are its holder's alone), before its offer is sent;
    /// `now` is the caller's clock (the lease's age in [`holders`](Self::holders) counts
    /// from it); `data` is kept with the lease until [`Action::LeaseEnded`] hands it back.
    /// Returns whether the offer starts a mapping hold, and the pool whose descriptor it
    /// must carry (once per link and pool).
    ///
    /// One writer or many readers, per range: refused while a writable lease that overlaps
    /// `access.bytes` is out, and a writable one while any lease that overlaps them is
    /// (both before the link and the allocation are looked at).
    pub(crate) fn grant(
        &mut self,
        alloc: AllocationId,
        link: LinkId,
        lease: LeaseId,
        now: Instant,
        access: Access,
        data: D,
    ) -> Result<(Grant, Option<u64>), Refusal> {
        if let Some(entry) = self.allocs.get(&alloc) {
            if self.writer_over(entry, &access.bytes) {
                return Err(Refusal::WriterOut);
            }
            if access.writable && self.reader_over(entry, &access.bytes) {
                return Err(Refusal::ReadersOut);
            }
        }
        let Some(record) = self.links.get_mut(&link) else {
            return Err(Refusal::LinkDown);
        };
        let entry = self.allocs.get_mut(&alloc).ok_or(Refusal::UnknownBuffer)?;
        if entry.phase != Phase::Live {
            return Err(Refusal::NotLive);
        }
        entry.leases.insert(lease, access.writable);
        let hold = entry.holds.entry(link).or_default();
        let new_hold = !hold.current;
        hold.current = true;
        let pool = entry.pool.filter(|pool| record.pools.insert(*pool));
        let owner = entry.owner;
        self.leases.insert(
            lease,
            LeaseRecord {
                alloc,
                link,
                revoke_by: None,
                granted_at: now,
                relayed_to: None,
                access,
                new_hold,
                pool,
                data,
            },
        );
        self.count_grant(owner);
        Ok((Grant { new_hold }, pool))
    }

    /// Whether a writable lease on `entry` that overlaps `bytes` is out.
    fn writer_over(&self, entry: &Entry<M, F, D>, bytes: &Range<u64>) -> bool {
        entry
            .leases
            .writable
            .iter()
            .filter_map(|l| self.leases.get(l))
            .any(|r| r.access.writable && overlaps(&r.access.bytes, bytes))
    }

    /// Whether any lease on `entry` that overlaps `bytes` is out — a stranded relayed
    /// lease too: its holder may still map it.
    fn reader_over(&self, entry: &Entry<M, F, D>, bytes: &Range<u64>) -> bool {
        let out = entry
            .leases
            .iter()
            .filter_map(|l| self.leases.get(l))
            .any(|r| overlaps(&r.access.bytes, bytes));
        out || entry.stranded.values().any(|s| overlaps(&s.bytes, bytes))
    }

    fn count_grant(&mut self, owner: ActorId) {
        self.totals.granted += 1;
        self.owners.entry(owner).or_default().granted += 1;
    }

    /// Grants `holder`, a process with no link to us, a lease on the allocation of `via`
    /// — a lease out over `link`, whose peer asked to forward it — before the offer goes
    /// out through that peer. Starts no mapping hold: the holder keeps no warm mapping of
    /// a relayed offer. Allowed on a retired allocation (`via` keeps it allocated).
    /// Refused for a writable `via` (its holder's alone, checked first), a `via` not out
    /// over `link` (or itself relayed: forwards are one hop), a link that is down, and a
    /// holder already at `max` relayed leases over `link`. `data` as for
    /// [`grant`](Self::grant). The relayed lease covers the bytes `via` covers, read-only;
    /// returns its allocation and those bytes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn grant_relayed(
        &mut self,
        via: LeaseId,
        link: LinkId,
        lease: LeaseId,
        holder: ProcessId,
        max: usize,
        now: Instant,
        data: D,
    ) -> Result<(AllocationId, Range<u64>), Refusal> {
        if self.leases.get(&via).is_some_and(|r| r.access.writable) {
            return Err(Refusal::WriterOut);
        }
        if !self.links.contains_key(&link) {
            return Err(Refusal::LinkDown);
        }
        let (alloc, bytes) = match self.leases.get(&via) {
            Some(r) if r.link == link && r.relayed_to.is_none() => {
                (r.alloc, r.access.bytes.clone())
            }
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
        entry.leases.insert(lease, false);
        let owner = entry.owner;
        self.leases.insert(
            lease,
            LeaseRecord {
                alloc,
                link,
                revoke_by: None,
                granted_at: now,
                relayed_to: Some(holder),
                access: Access::read(bytes.clone()),
                new_hold: false,
                pool: None,
                data,
            },
        );
        self.count_grant(owner);
        Ok((alloc, bytes))
    }

    /// The data kept with `lease` (out, or stranded), to replace what its grant was given.
    pub(crate) fn lease_data_mut(&mut self, lease: LeaseId) -> Option<&mut D> {
        if let Some(record) = self.leases.get_mut(&lease) {
            return Some(&mut record.data);
        }
        self.allocs
            .values_mut()
            .find_map(|e| e.stranded.get_mut(&lease))
            .map(|s| &mut s.data)
    }

    /// What the node keeps to free the allocation `lease` is on, while the lease is out.
    pub(crate) fn lease_meta(&self, lease: LeaseId) -> Option<&M> {
        let record = self.leases.get(&lease)?;
        self.allocs.get(&record.alloc).map(|e| &e.meta)
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

    /// Takes back a lease whose offer was never sent: a hold its grant started is undone
    /// too, so the next offer carries the descriptor (a pool's likewise). Returns what was
    /// undone — the link, what [`grant`](Self::grant) returned — or `None` for a lease
    /// not out.
    pub(crate) fn ungrant(&mut self, lease: LeaseId) -> Option<(LinkId, Grant, Option<u64>)> {
        let record = self.leases.remove(&lease)?;
        if let Some(entry) = self.allocs.get_mut(&record.alloc) {
            entry.leases.remove(&lease);
            if record.new_hold {
                if let Some(hold) = entry.holds.get_mut(&record.link) {
                    hold.current = false;
                    if hold.is_empty() {
                        entry.holds.remove(&record.link);
                    }
                }
            }
        }
        if let (Some(pool), Some(link)) = (record.pool, self.links.get_mut(&record.link)) {
            link.pools.remove(&pool);
        }
        let undone = (
            record.link,
            Grant {
                new_hold: record.new_hold,
            },
            record.pool,
        );
        let alloc = record.alloc;
        self.end(lease, record);
        self.settle(alloc);
        Some(undone)
    }

    /// Queues the end of a lease no longer recorded as out (nor stranded).
    fn end(&mut self, lease: LeaseId, record: LeaseRecord<D>) {
        self.actions.push(Action::LeaseEnded {
            lease,
            alloc: record.alloc,
            data: record.data,
        });
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
        let alloc = record.alloc;
        let entry = self
            .allocs
            .get_mut(&alloc)
            .expect("a recorded lease has its entry");
        entry.leases.remove(&lease);
        for fence in fences {
            keep_newest(&mut entry.fences, fence);
        }
        self.end(lease, record);
        self.settle(alloc);
        Ok(alloc)
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
        for lease in entry.leases.iter() {
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
    /// `Unmapped` is harmless (an `Unmap` and a failed open can cross) and changes nothing
    /// of the holds. One we had not asked for (it could not open our offer) also means it
    /// may not have the allocation's pool: the next offer of the pool carries its
    /// descriptor again.
    pub(crate) fn unmapped(&mut self, link: LinkId, alloc: AllocationId) -> bool {
        let asked = self.unmap_asked(link, alloc);
        let Some(entry) = self.allocs.get_mut(&alloc) else {
            return false;
        };
        if let (false, Some(pool), Some(record)) = (asked, entry.pool, self.links.get_mut(&link)) {
            record.pools.remove(&pool);
        }
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

    /// The backend retired `pool` (it has no allocation left): every live link that carried
    /// its descriptor is told ([`Action::ForgetPool`]) and forgets it, so that an offer of a
    /// later allocation of the pool — none is expected: a retired pool makes none — would
    /// carry the descriptor again.
    pub(crate) fn pool_retired(&mut self, pool: u64) {
        for (link, record) in &mut self.links {
            if record.pools.remove(&pool) {
                self.actions.push(Action::ForgetPool { link: *link, pool });
            }
        }
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
            self.end(*lease, record);
        }
        // Forget it as a cut holder (and its stranded leases, which end) first, so that
        // settling below sees it gone.
        let mut touched: Vec<AllocationId> = Vec::new();
        for (id, e) in &mut self.allocs {
            let theirs: Vec<LeaseId> = e
                .stranded
                .iter()
                .filter(|(_, s)| s.holder == process)
                .map(|(l, _)| *l)
                .collect();
            for lease in &theirs {
                let stranded = e.stranded.remove(lease).expect("listed");
                self.actions.push(Action::LeaseEnded {
                    lease: *lease,
                    alloc: *id,
                    data: stranded.data,
                });
            }
            if e.cut_holders.remove(&process) || !theirs.is_empty() {
                touched.push(*id);
            }
        }
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
        // Their leases end, but relayed ones are stranded: their holders may still map the
        // memory.
        let mut gone: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, r)| links.contains(&r.link))
            .map(|(l, _)| *l)
            .collect();
        gone.sort_unstable();
        let mut stranded_now: BTreeSet<LeaseId> = BTreeSet::new();
        for lease in gone {
            let record = self.leases.remove(&lease).expect("listed");
            match record.relayed_to {
                Some(holder) => {
                    stranded_now.insert(lease);
                    if let Some(entry) = self.allocs.get_mut(&record.alloc) {
                        let (bytes, data) = (record.access.bytes, record.data);
                        let stranded = Stranded {
                            holder,
                            bytes,
                            data,
                        };
                        entry.stranded.insert(lease, stranded);
                    }
                }
                None => self.end(lease, record),
            }
        }
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
        self.totals.freed += 1;
        self.owners.entry(entry.owner).or_default().freed += 1;
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

    /// Leases out on `buffer`, stranded relayed ones included: a stranded lease's holder
    /// may still map the buffer until it is confirmed dead, so the owner must not write it
    /// nor hear that it is back ([`returned`](crate::Buffer::returned)) before then.
    pub(crate) fn leases_on(&self, buffer: BufferId) -> usize {
        self.buffers
            .get(&buffer)
            .and_then(|a| self.allocs.get(a))
            .map_or(0, |e| e.leases.len() + e.stranded.len())
    }

    /// Whether `lease` is out (granted, not yet back).
    pub(crate) fn is_out(&self, lease: LeaseId) -> bool {
        self.leases.contains_key(&lease)
    }

    /// The stranded relayed leases (see the module docs).
    #[cfg(test)]
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

    /// What the node keeps of `alloc` to free it.
    pub(crate) fn meta(&self, alloc: AllocationId) -> Option<&M> {
        self.allocs.get(&alloc).map(|e| &e.meta)
    }

    /// Leases granted so far (with those whose offer never went out).
    pub(crate) fn granted(&self) -> u64 {
        self.totals.granted
    }

    /// Allocations freed so far.
    pub(crate) fn freed(&self) -> u64 {
        self.totals.freed
    }

    /// Leases granted and allocations freed so far, of `owner` (all owners: `None`).
    pub(crate) fn totals(&self, owner: Option<ActorId>) -> Totals {
        match owner {
            Some(o) => self.owners.get(&o).copied().unwrap_or_default(),
            None => self.totals,
        }
    }
}

#[cfg(test)]
mod check;
mod tables;
#[cfg(test)]
mod tests;
