//! The ledger against a simple model: random sequences of every event, for both kinds of
//! backend rule, checking after each event that nothing is freed while a live process may
//! map it (the invariant), that everything the model says is free-able is freed (no leak),
//! that quarantines, unmaps and cuts happen exactly when the model says, and that an
//! allocation keeps only the newest release fence of each counter slot or event. The model
//! also holds the rules the node used to keep beside the ledger: one writer or many
//! readers per byte range (leases of parts of an allocation: disjoint writers coexist,
//! overlapping ones do not), a pool's descriptor once per link, each lease's data handed
//! back once when the lease ends (which lease, on which allocation, with what data), the
//! counters per owner.

use super::*;
use baton_messages::{BootId, CounterFence, CudaIpcMemHandle, FenceHandle};
use proptest::prelude::*;
use std::time::Duration;

fn process(n: u32) -> ProcessId {
    ProcessId {
        boot: BootId([7; 16]),
        pid: 1000 + n,
        start_ticks: 50 + u64::from(n),
    }
}

/// What a release fence marks: a value of one of its producer's counter slots, or one of
/// its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Point {
    Slot { slot: u32, value: u64 },
    Event(u32),
}

/// A release fence in the model: what process `producer` recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Fence {
    producer: u32,
    at: Point,
}

impl Fence {
    /// The slot or event it is a record of: a ledger keeps at most one fence per key.
    fn key(&self) -> (u32, Option<u32>, Option<u32>) {
        match self.at {
            Point::Slot { slot, .. } => (self.producer, Some(slot), None),
            Point::Event(e) => (self.producer, None, Some(e)),
        }
    }
}

impl Covers for Fence {
    fn covers(&self, earlier: &Self) -> bool {
        self.producer == earlier.producer
            && match (self.at, earlier.at) {
                (Point::Slot { slot, value }, Point::Slot { slot: s, value: v }) => {
                    slot == s && value >= v
                }
                (Point::Event(a), Point::Event(b)) => a == b,
                _ => false,
            }
    }
}

/// The newest fence of each slot or event in `released`, in order: what the ledger must
/// keep of them (computed without [`Covers`]).
fn newest(released: &[Fence]) -> Vec<Fence> {
    let mut by_key: BTreeMap<(u32, Option<u32>, Option<u32>), Fence> = BTreeMap::new();
    for f in released {
        by_key
            .entry(f.key())
            .and_modify(|kept| *kept = (*kept).max(*f))
            .or_insert(*f);
    }
    let mut out: Vec<Fence> = by_key.into_values().collect();
    out.sort();
    out
}

/// One event, with indexes that pick among what exists (taken modulo the counts).
#[derive(Debug, Clone)]
enum Ev {
    Insert {
        unsafe_free: bool,
        kill: bool,
        /// The exporter's pool it comes from.
        pool: Option<u64>,
    },
    LinkUp {
        process: u32,
    },
    Grant {
        alloc: usize,
        link: usize,
        writable: bool,
        /// The part of the allocation asked for, in quarters: `first..end` (never empty).
        quarters: (u64, u64),
    },
    /// Fences recorded by the lease's holder.
    Release {
        lease: usize,
        wrong_link: bool,
        fences: Vec<Point>,
    },
    Ungrant {
        lease: usize,
    },
    /// The node replaces the data kept with a lease (a forward's acquire fence, made after
    /// its grant).
    SetData {
        lease: usize,
    },
    /// The holder of `via` asks to forward its buffer to process `to`.
    GrantRelayed {
        via: usize,
        to: u32,
    },
    Retire {
        alloc: usize,
    },
    Revoke {
        alloc: usize,
    },
    Tick {
        advance_ms: u64,
    },
    Evict {
        link: usize,
        alloc: usize,
    },
    AnswerUnmap {
        pending: usize,
    },
    SpuriousUnmapped {
        link: usize,
        alloc: usize,
    },
    LinkCut {
        link: usize,
    },
    ProcessDead {
        process: u32,
    },
    /// The backend retired a pool.
    PoolRetired {
        pool: u64,
    },
}

/// Few slots, events and values, so that fences often cover each other (equal ones too),
/// in either order.
fn point() -> impl Strategy<Value = Point> {
    prop_oneof![
        3 => (0u32..3, 0u64..6).prop_map(|(slot, value)| Point::Slot { slot, value }),
        1 => (0u32..2).prop_map(Point::Event),
    ]
}

/// A part of an allocation of [`BYTES`], in quarters: the whole of it half the time, else
/// any non-empty run of quarters (so that parts often overlap, often do not, and often
/// touch end to start).
fn quarters() -> impl Strategy<Value = (u64, u64)> {
    prop_oneof![
        1 => Just((0, 4)),
        1 => (0u64..4, 1u64..=4).prop_map(|(first, n)| (first, (first + n).min(4))),
    ]
}

/// Bytes of every allocation in the model runs.
const BYTES: u64 = 4096;

/// The bytes of a part given in quarters.
fn bytes_of((first, end): (u64, u64)) -> Range<u64> {
    first * (BYTES / 4)..end * (BYTES / 4)
}

/// Whether two leases' bytes share one, computed apart from the ledger's `overlaps`:
/// the bytes are counted one quarter at a time.
fn share_a_byte(a: &Range<u64>, b: &Range<u64>) -> bool {
    (0..4).any(|q| {
        let quarter = q * (BYTES / 4)..(q + 1) * (BYTES / 4);
        let within = |r: &Range<u64>| r.start <= quarter.start && quarter.end <= r.end;
        within(a) && within(b)
    })
}

fn event() -> impl Strategy<Value = Ev> {
    prop_oneof![
        2 => (any::<bool>(), any::<bool>(), prop::option::weighted(0.4, 0u64..2))
            .prop_map(|(unsafe_free, kill, pool)| Ev::Insert { unsafe_free, kill, pool }),
        2 => (0u32..4).prop_map(|process| Ev::LinkUp { process }),
        6 => (any::<usize>(), any::<usize>(), prop::bool::weighted(0.25), quarters())
            .prop_map(|(alloc, link, writable, quarters)| {
                Ev::Grant { alloc, link, writable, quarters }
            }),
        5 => (any::<usize>(), prop::bool::weighted(0.1), prop::collection::vec(point(), 0..4))
            .prop_map(|(lease, wrong_link, fences)| Ev::Release { lease, wrong_link, fences }),
        1 => any::<usize>().prop_map(|lease| Ev::Ungrant { lease }),
        1 => any::<usize>().prop_map(|lease| Ev::SetData { lease }),
        3 => (any::<usize>(), 0u32..4).prop_map(|(via, to)| Ev::GrantRelayed { via, to }),
        3 => any::<usize>().prop_map(|alloc| Ev::Retire { alloc }),
        1 => any::<usize>().prop_map(|alloc| Ev::Revoke { alloc }),
        1 => (0u64..200).prop_map(|advance_ms| Ev::Tick { advance_ms }),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(link, alloc)| Ev::Evict { link, alloc }),
        4 => any::<usize>().prop_map(|pending| Ev::AnswerUnmap { pending }),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(link, alloc)| Ev::SpuriousUnmapped { link, alloc }),
        1 => any::<usize>().prop_map(|link| Ev::LinkCut { link }),
        1 => (0u32..4).prop_map(|process| Ev::ProcessDead { process }),
        1 => (0u64..2).prop_map(|pool| Ev::PoolRetired { pool }),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    /// Offers may omit the descriptor.
    Current,
    /// An `Unmap` is in flight.
    Draining,
}

#[derive(Debug)]
struct MAlloc {
    id: AllocationId,
    buffer: BufferId,
    unsafe_free: bool,
    kill: bool,
    retired: bool,
    freed: bool,
    quarantine_reported: bool,
    /// Every release fence that came back for it (the ledger keeps the [`newest`]).
    released: Vec<Fence>,
    pool: Option<u64>,
}

#[derive(Debug)]
struct MLink {
    id: LinkId,
    process: u32,
    up: bool,
    cut_asked: bool,
    /// The pools whose descriptor went over it (and no failed open of the pool since).
    pools: BTreeSet<u64>,
}

#[derive(Debug, Clone)]
struct MLease {
    id: LeaseId,
    alloc: usize,
    link: usize,
    out: bool,
    new_hold: bool,
    revoke_by: Option<Instant>,
    granted_at: Instant,
    /// A relayed lease: the process it was forwarded to.
    relayed_to: Option<u32>,
    /// A relayed lease whose link went down: kept until its holder dies.
    stranded: bool,
    writable: bool,
    /// The bytes of its allocation it covers.
    bytes: Range<u64>,
    /// The pool whose descriptor its offer carried.
    pool: Option<u64>,
    /// What the node keeps with it (handed back when it ends).
    data: u64,
}

impl MLease {
    /// Whether it keeps its allocation: out, or stranded.
    fn counts(&self) -> bool {
        self.out || self.stranded
    }
}

/// Relayed leases one link may carry in the tests.
const MAX_RELAYED: usize = 3;

/// The reference model: flat lists, recomputed predicates.
#[derive(Debug, Default)]
struct Model {
    allocs: Vec<MAlloc>,
    links: Vec<MLink>,
    leases: Vec<MLease>,
    /// (alloc, link, token): an importer's mapping hold.
    holds: Vec<(usize, usize, Token)>,
    /// (alloc, process): a process whose link was cut while it held the allocation.
    cut: Vec<(usize, u32)>,
    dead: Vec<u32>,
    /// `Unmap`s the importers have not answered: (link, alloc).
    pending_unmaps: Vec<(usize, usize)>,
    next: u64,
}

impl Model {
    fn fresh(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Whether a writable lease on `alloc` that shares a byte with `bytes` is out.
    fn writer_over(&self, alloc: usize, bytes: &Range<u64>) -> bool {
        self.leases
            .iter()
            .any(|l| l.out && l.writable && l.alloc == alloc && share_a_byte(&l.bytes, bytes))
    }

    fn lease_out_on(&self, alloc: usize) -> bool {
        self.leases.iter().any(|l| l.counts() && l.alloc == alloc)
    }

    /// The process that holds a lease.
    fn holder(&self, l: &MLease) -> u32 {
        l.relayed_to.unwrap_or(self.links[l.link].process)
    }

    fn held_on_live_link(&self, alloc: usize) -> bool {
        self.holds
            .iter()
            .any(|&(a, l, _)| a == alloc && self.links[l].up)
    }

    fn cut_alive(&self, alloc: usize) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .cut
            .iter()
            .filter(|&&(a, p)| a == alloc && !self.dead.contains(&p))
            .map(|&(_, p)| p)
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// The invariant, in the model's terms: may this allocation be freed now?
    fn may_free(&self, alloc: usize) -> bool {
        let a = &self.allocs[alloc];
        a.retired
            && !a.freed
            && !self.lease_out_on(alloc)
            && !self.held_on_live_link(alloc)
            && (!a.unsafe_free || self.cut_alive(alloc).is_empty())
    }

    fn cut_link(&mut self, link: usize, record_cut: bool) {
        if !self.links[link].up {
            return;
        }
        self.links[link].up = false;
        self.links[link].pools.clear();
        let process = self.links[link].process;
        let mut touched = Vec::new();
        for l in &mut self.leases {
            if l.out && l.link == link {
                l.out = false;
                if l.relayed_to.is_some() {
                    // Its holder may still map it; the relay never did.
                    l.stranded = true;
                } else {
                    touched.push(l.alloc);
                }
            }
        }
        self.holds.retain(|&(a, l, _)| {
            if l == link {
                touched.push(a);
                false
            } else {
                true
            }
        });
        self.pending_unmaps.retain(|&(l, _)| l != link);
        if record_cut {
            for a in touched {
                if !self.allocs[a].freed {
                    self.cut.push((a, process));
                }
            }
        }
    }
}

struct Run {
    ledger: Ledger<u64, Fence, u64>,
    model: Model,
    now: Instant,
    /// Which leases kept their allocation before the event (out or stranded).
    counted_before: Vec<bool>,
    /// The links the event's pool retirement must tell, with the pool.
    expected_forgets: Vec<(usize, u64)>,
}

impl Run {
    fn new() -> Self {
        Self {
            ledger: Ledger::default(),
            model: Model::default(),
            now: Instant::now(),
            counted_before: Vec::new(),
            expected_forgets: Vec::new(),
        }
    }

    fn apply(&mut self, ev: &Ev) {
        self.counted_before = self.model.leases.iter().map(MLease::counts).collect();
        let m = &mut self.model;
        match *ev {
            Ev::Insert {
                unsafe_free,
                kill,
                pool,
            } => {
                let n = m.fresh();
                let (id, buffer) = (AllocationId::new(n), BufferId::next());
                m.allocs.push(MAlloc {
                    id,
                    buffer,
                    unsafe_free,
                    kill,
                    retired: false,
                    freed: false,
                    quarantine_reported: false,
                    released: Vec::new(),
                    pool,
                });
                self.ledger.insert(NewAllocation {
                    alloc: id,
                    buffer,
                    owner: ActorId::new(1),
                    bytes: 4096,
                    rule: if unsafe_free {
                        FreeWhileMapped::Unsafe
                    } else {
                        FreeWhileMapped::Survives
                    },
                    policy: if kill {
                        RevokePolicy::KillSupervisedChild
                    } else {
                        RevokePolicy::Cut
                    },
                    pool,
                    meta: n,
                });
            }
            Ev::LinkUp { process: p } => {
                if m.dead.contains(&p) {
                    return;
                }
                let id = LinkId::next();
                m.links.push(MLink {
                    id,
                    process: p,
                    up: true,
                    cut_asked: false,
                    pools: BTreeSet::new(),
                });
                self.ledger.link_up(id, process(p));
            }
            Ev::Grant {
                alloc,
                link,
                writable,
                quarters,
            } => {
                if m.allocs.is_empty() || m.links.is_empty() {
                    return;
                }
                let (a, l) = (alloc % m.allocs.len(), link % m.links.len());
                let lease = LeaseId::new(m.fresh());
                let data = m.fresh();
                let bytes = bytes_of(quarters);
                let access = Access {
                    bytes: bytes.clone(),
                    writable,
                };
                let got =
                    self.ledger
                        .grant(m.allocs[a].id, m.links[l].id, lease, self.now, access, data);
                // A stranded relayed lease is a reader still (its holder may map it).
                let readers = m
                    .leases
                    .iter()
                    .any(|x| x.counts() && x.alloc == a && share_a_byte(&x.bytes, &bytes));
                let pool = m.allocs[a]
                    .pool
                    .filter(|p| m.links[l].up && !m.links[l].pools.contains(p));
                // One writer or many readers comes first: a lease out keeps the entry.
                let expect = if m.writer_over(a, &bytes) {
                    Err(Refusal::WriterOut)
                } else if writable && readers {
                    Err(Refusal::ReadersOut)
                } else if !m.links[l].up {
                    Err(Refusal::LinkDown)
                } else if m.allocs[a].freed {
                    Err(Refusal::UnknownBuffer)
                } else if m.allocs[a].retired {
                    Err(Refusal::NotLive)
                } else {
                    let current = m.holds.contains(&(a, l, Token::Current));
                    Ok((Grant { new_hold: !current }, pool))
                };
                assert_eq!(
                    got, expect,
                    "grant of {bytes:?} of {a} over {l} (writable: {writable})"
                );
                if let Ok((g, pool)) = got {
                    if let Some(pool) = pool {
                        m.links[l].pools.insert(pool);
                    }
                    if g.new_hold {
                        m.holds.push((a, l, Token::Current));
                    }
                    m.leases.push(MLease {
                        id: lease,
                        alloc: a,
                        link: l,
                        out: true,
                        new_hold: g.new_hold,
                        revoke_by: None,
                        granted_at: self.now,
                        relayed_to: None,
                        stranded: false,
                        writable,
                        bytes,
                        pool,
                        data,
                    });
                }
            }
            Ev::GrantRelayed { via, to } => {
                // The node never forwards to a process it saw dead: its watch would end
                // the lease at once.
                if m.leases.is_empty() || m.dead.contains(&to) {
                    return;
                }
                let v = m.leases[via % m.leases.len()].clone();
                let lease = LeaseId::new(m.fresh());
                let data = m.fresh();
                let got = self.ledger.grant_relayed(
                    v.id,
                    m.links[v.link].id,
                    lease,
                    process(to),
                    MAX_RELAYED,
                    self.now,
                    data,
                );
                let relayed = m
                    .leases
                    .iter()
                    .filter(|l| l.out && l.link == v.link && l.relayed_to.is_some())
                    .count();
                let expect = if v.out && v.writable {
                    Err(Refusal::WriterOut)
                } else if !m.links[v.link].up {
                    Err(Refusal::LinkDown)
                } else if !v.out || v.relayed_to.is_some() {
                    Err(Refusal::UnknownLease)
                } else if relayed >= MAX_RELAYED {
                    Err(Refusal::TooManyRelayed)
                } else {
                    // A forward covers what its `via` covers.
                    Ok((m.allocs[v.alloc].id, v.bytes.clone()))
                };
                assert_eq!(got, expect, "relayed grant of {v:?} to {to}");
                if got.is_ok() {
                    m.leases.push(MLease {
                        id: lease,
                        alloc: v.alloc,
                        link: v.link,
                        out: true,
                        new_hold: false,
                        revoke_by: None,
                        granted_at: self.now,
                        relayed_to: Some(to),
                        stranded: false,
                        writable: false,
                        bytes: v.bytes.clone(),
                        pool: None,
                        data,
                    });
                }
            }
            Ev::Release {
                lease,
                wrong_link,
                ref fences,
            } => {
                if m.leases.is_empty() || m.links.is_empty() {
                    return;
                }
                let i = lease % m.leases.len();
                let l = m.leases[i].clone();
                let link = if wrong_link {
                    (l.link + 1) % m.links.len()
                } else {
                    l.link
                };
                let producer = m.holder(&l);
                let fences: Vec<Fence> = fences.iter().map(|&at| Fence { producer, at }).collect();
                let got = self
                    .ledger
                    .release(l.id, m.links[link].id, fences.iter().copied());
                let accepted = l.out && link == l.link;
                assert_eq!(got.is_ok(), accepted, "release of {i} over {link}: {got:?}");
                if accepted {
                    assert_eq!(got, Ok(m.allocs[l.alloc].id));
                    m.leases[i].out = false;
                    m.allocs[l.alloc].released.extend(fences);
                } else {
                    assert_eq!(got, Err(Refusal::UnknownLease));
                }
            }
            Ev::Ungrant { lease } => {
                // Only the newest lease can be "never sent": the link ungrants right after
                // granting, before anything else happens.
                let Some(l) = m.leases.last().cloned() else {
                    return;
                };
                if !l.out || lease % 2 == 0 {
                    return;
                }
                // The ledger remembers what the grant did, and says what it undid.
                let undone = self.ledger.ungrant(l.id);
                assert_eq!(
                    undone,
                    Some((
                        m.links[l.link].id,
                        Grant {
                            new_hold: l.new_hold,
                        },
                        l.pool
                    )),
                    "ungrant of {l:?}"
                );
                assert_eq!(self.ledger.ungrant(l.id), None, "a lease is ungranted once");
                if let Some(pool) = l.pool {
                    m.links[l.link].pools.remove(&pool);
                }
                let i = m.leases.len() - 1;
                m.leases[i].out = false;
                if l.new_hold {
                    if let Some(pos) = m
                        .holds
                        .iter()
                        .position(|&t| t == (l.alloc, l.link, Token::Current))
                    {
                        m.holds.remove(pos);
                    }
                }
            }
            Ev::SetData { lease } => {
                if m.leases.is_empty() {
                    return;
                }
                let i = lease % m.leases.len();
                let data = m.fresh();
                let got = self.ledger.lease_data_mut(m.leases[i].id);
                assert_eq!(
                    got.as_deref().copied(),
                    m.leases[i].counts().then_some(m.leases[i].data),
                    "the data kept with {:?}",
                    m.leases[i]
                );
                if let Some(kept) = got {
                    *kept = data;
                    m.leases[i].data = data;
                }
            }
            Ev::Retire { alloc } => {
                if m.allocs.is_empty() {
                    return;
                }
                let a = alloc % m.allocs.len();
                m.allocs[a].retired = true;
                self.ledger.retire(m.allocs[a].buffer);
            }
            Ev::Revoke { alloc } => {
                if m.allocs.is_empty() {
                    return;
                }
                let a = alloc % m.allocs.len();
                let deadline = self.now + Duration::from_millis(100);
                let got = self.ledger.revoke(m.allocs[a].buffer, deadline);
                if m.allocs[a].freed {
                    assert_eq!(got, Err(Refusal::UnknownBuffer));
                } else {
                    let mut asked = 0;
                    for l in m.leases.iter_mut().filter(|l| l.out && l.alloc == a) {
                        l.revoke_by = Some(l.revoke_by.map_or(deadline, |d| d.min(deadline)));
                        asked += 1;
                    }
                    assert_eq!(got, Ok(asked));
                }
            }
            Ev::Tick { advance_ms } => {
                self.now += Duration::from_millis(advance_ms);
                self.ledger.tick(self.now);
            }
            Ev::Evict { link, alloc } => {
                if m.allocs.is_empty() || m.links.is_empty() {
                    return;
                }
                let (a, l) = (alloc % m.allocs.len(), link % m.links.len());
                self.ledger.evict(m.links[l].id, m.allocs[a].id);
                if let Some(t) = m.holds.iter_mut().find(|t| **t == (a, l, Token::Current)) {
                    t.2 = Token::Draining;
                    m.pending_unmaps.push((l, a));
                }
            }
            Ev::AnswerUnmap { pending } => {
                if m.pending_unmaps.is_empty() {
                    return;
                }
                let (l, a) = m.pending_unmaps.remove(pending % m.pending_unmaps.len());
                let held = self.ledger.unmapped(m.links[l].id, m.allocs[a].id);
                assert!(held, "an answered Unmap matches a hold");
                let pos = m
                    .holds
                    .iter()
                    .position(|&t| t == (a, l, Token::Draining))
                    .expect("the model drains what it unmapped");
                m.holds.remove(pos);
            }
            Ev::SpuriousUnmapped { link, alloc } => {
                // An importer that could not open an offer says it does not map it.
                if m.allocs.is_empty() || m.links.is_empty() {
                    return;
                }
                let (a, l) = (alloc % m.allocs.len(), link % m.links.len());
                let held = self.ledger.unmapped(m.links[l].id, m.allocs[a].id);
                // Not an answer to an `Unmap`: the importer could not open an offer, so the
                // pool's descriptor goes with the next offer again.
                let asked = m.holds.contains(&(a, l, Token::Draining));
                if let (false, false, Some(pool)) = (asked, m.allocs[a].freed, m.allocs[a].pool) {
                    m.links[l].pools.remove(&pool);
                }
                // The ledger drains an unanswered `Unmap` first, else ends the hold.
                let pos = m
                    .holds
                    .iter()
                    .position(|&t| t == (a, l, Token::Draining))
                    .or_else(|| m.holds.iter().position(|&t| t == (a, l, Token::Current)));
                assert_eq!(held, pos.is_some(), "unmapped {a} over {l}");
                if let Some(pos) = pos {
                    if m.holds.remove(pos).2 == Token::Draining {
                        let i = m
                            .pending_unmaps
                            .iter()
                            .position(|&p| p == (l, a))
                            .expect("a draining hold has its pending Unmap");
                        m.pending_unmaps.remove(i);
                    }
                }
            }
            Ev::LinkCut { link } => {
                if m.links.is_empty() {
                    return;
                }
                let l = link % m.links.len();
                m.cut_link(l, true);
                self.ledger.link_cut(m.links[l].id);
            }
            Ev::ProcessDead { process: p } => {
                if m.dead.contains(&p) {
                    return;
                }
                m.dead.push(p);
                for l in 0..m.links.len() {
                    if m.links[l].process == p {
                        m.cut_link(l, false);
                    }
                }
                // Its relayed leases end, out or stranded.
                for l in m.leases.iter_mut().filter(|l| l.relayed_to == Some(p)) {
                    l.out = false;
                    l.stranded = false;
                }
                self.ledger.process_dead(process(p));
            }
            Ev::PoolRetired { pool } => {
                // Each live link that carried the pool's descriptor is told once, and the
                // next offer of the pool over it would carry the descriptor again.
                for (l, link) in m.links.iter_mut().enumerate() {
                    if link.up && link.pools.remove(&pool) {
                        self.expected_forgets.push((l, pool));
                    }
                }
                self.ledger.pool_retired(pool);
            }
        }
        self.settle_model_and_compare();
    }

    /// Mirrors `settle` in the model (unmaps owed to live holders of retired, unleased
    /// allocations), then checks the ledger's actions and state against it.
    fn settle_model_and_compare(&mut self) {
        let actions = self.ledger.take_actions();
        let m = &mut self.model;
        let mut expected_unmaps = Vec::new();
        for a in 0..m.allocs.len() {
            let out = m.leases.iter().any(|l| l.out && l.alloc == a);
            if m.allocs[a].retired && !m.allocs[a].freed && !out {
                for t in m.holds.iter_mut() {
                    if t.0 == a && t.2 == Token::Current && m.links[t.1].up {
                        t.2 = Token::Draining;
                        expected_unmaps.push((t.1, a));
                    }
                }
            }
        }
        let mut expected_cuts = Vec::new();
        let now = self.now;
        for l in &m.leases {
            let link = &m.links[l.link];
            if l.out
                && l.relayed_to.is_none()
                && link.up
                && !link.cut_asked
                && l.revoke_by.is_some_and(|d| d <= now)
            {
                expected_cuts.push(l.link);
            }
        }
        expected_cuts.sort();
        expected_cuts.dedup();

        let mut unmaps = Vec::new();
        let mut cuts = Vec::new();
        let mut ended = Vec::new();
        let mut forgets = Vec::new();
        for action in actions {
            match action {
                Action::ForgetPool { link, pool } => {
                    let l = m.links.iter().position(|x| x.id == link).expect("known");
                    forgets.push((l, pool));
                }
                Action::LeaseEnded { lease, alloc, data } => {
                    let r = m.leases.iter().find(|x| x.id == lease).expect("known");
                    assert_eq!(
                        alloc, m.allocs[r.alloc].id,
                        "{lease:?} ends on its allocation"
                    );
                    assert_eq!(data, r.data, "{lease:?} hands back the data kept with it");
                    ended.push(lease);
                }
                Action::Free {
                    alloc,
                    meta,
                    mut fences,
                } => {
                    let a = m.allocs.iter().position(|x| x.id == alloc).expect("known");
                    assert_eq!(meta, alloc.get(), "the allocation's own meta comes back");
                    assert!(
                        m.may_free(a),
                        "freed {alloc:?} while the model says it may be mapped: {m:#?}"
                    );
                    fences.sort();
                    assert_eq!(
                        fences,
                        newest(&m.allocs[a].released),
                        "the newest release fence of each slot or event goes with the free"
                    );
                    m.allocs[a].freed = true;
                }
                Action::Quarantine {
                    alloc,
                    holders,
                    bytes,
                } => {
                    let a = m.allocs.iter().position(|x| x.id == alloc).expect("known");
                    let x = &m.allocs[a];
                    assert!(x.unsafe_free && x.retired && !x.freed && !x.quarantine_reported);
                    assert_eq!(bytes, 4096);
                    let want: Vec<ProcessId> = m.cut_alive(a).into_iter().map(process).collect();
                    assert_eq!(holders, want);
                    m.allocs[a].quarantine_reported = true;
                }
                Action::Unmap { link, alloc } => {
                    let l = m.links.iter().position(|x| x.id == link).expect("known");
                    let a = m.allocs.iter().position(|x| x.id == alloc).expect("known");
                    unmaps.push((l, a));
                }
                Action::Cut { link, lease, kill } => {
                    let l = m.links.iter().position(|x| x.id == link).expect("known");
                    let r = m.leases.iter().find(|x| x.id == lease).expect("known");
                    assert_eq!(r.link, l);
                    assert_eq!(kill, m.allocs[r.alloc].kill);
                    m.links[l].cut_asked = true;
                    cuts.push(l);
                }
                Action::Revoke { link, lease, .. } => {
                    let l = m.links.iter().position(|x| x.id == link).expect("known");
                    let r = m.leases.iter().find(|x| x.id == lease).expect("known");
                    assert!(r.out && r.link == l);
                }
            }
        }
        // Unmaps from `evict` were recorded when the event was applied; the rest come from
        // settling and must match the model's exactly.
        let evicted: Vec<(usize, usize)> = unmaps
            .iter()
            .filter(|u| !expected_unmaps.contains(u))
            .copied()
            .collect();
        for u in &evicted {
            assert!(
                m.pending_unmaps.contains(u),
                "an unexpected Unmap {u:?}: {m:#?}"
            );
        }
        unmaps.retain(|u| !evicted.contains(u));
        unmaps.sort();
        expected_unmaps.sort();
        assert_eq!(unmaps, expected_unmaps, "Unmap to every live holder, once");
        m.pending_unmaps.extend(expected_unmaps);
        cuts.sort();
        assert_eq!(cuts, expected_cuts, "one cut per overdue holder's link");
        forgets.sort();
        let mut expected_forgets = std::mem::take(&mut self.expected_forgets);
        expected_forgets.sort();
        assert_eq!(
            forgets, expected_forgets,
            "a retired pool is forgotten by each live link that carried its descriptor, once"
        );
        // A lease ends exactly when it stops keeping its allocation (released, ungranted,
        // its link gone unless relayed, its relayed holder dead), once.
        let mut expected_ended: Vec<LeaseId> = m
            .leases
            .iter()
            .zip(&self.counted_before)
            .filter(|(l, before)| **before && !l.counts())
            .map(|(l, _)| l.id)
            .collect();
        expected_ended.sort();
        ended.sort();
        assert_eq!(ended, expected_ended, "the leases that ended");

        // No leak: whatever may be freed was freed; quarantines are reported.
        for a in 0..m.allocs.len() {
            if m.may_free(a) {
                panic!("{:?} may be freed but was not: {m:#?}", m.allocs[a].id);
            }
            let x = &m.allocs[a];
            let quarantined = x.retired
                && !x.freed
                && !m.lease_out_on(a)
                && !m.held_on_live_link(a)
                && x.unsafe_free
                && !m.cut_alive(a).is_empty();
            assert_eq!(
                quarantined,
                x.quarantine_reported && !x.freed,
                "quarantine of {:?}",
                x.id
            );
        }
        self.ledger.check();
        self.ledger.check_fences();
        // The kept fences are bounded: the newest of each slot or event, no more.
        for x in m.allocs.iter().filter(|x| !x.freed) {
            let mut kept = self.ledger.fences(x.id).expect("not freed").to_vec();
            let keys: BTreeSet<_> = x.released.iter().map(Fence::key).collect();
            assert!(
                kept.len() <= keys.len(),
                "{:?} keeps {} fences of {} slots or events",
                x.id,
                kept.len(),
                keys.len()
            );
            kept.sort();
            assert_eq!(kept, newest(&x.released), "fences kept for {:?}", x.id);
        }
        let c = self.ledger.counts(None);
        let live = m.allocs.iter().filter(|x| !x.freed).count();
        assert_eq!(c.buffers, live);
        let out = m.leases.iter().filter(|l| l.counts()).count();
        assert_eq!(c.leases, out);
        // What the export table asks of the ledger: leases on each buffer (stranded ones
        // count: their holders may still map it, so the owner's `returned()` must wait and
        // its writes be refused — issue 45, finding 6), whether a lease is out, the
        // stranded ones.
        for (a, x) in m.allocs.iter().enumerate().filter(|(_, x)| !x.freed) {
            let on = m
                .leases
                .iter()
                .filter(|l| l.counts() && l.alloc == a)
                .count();
            assert_eq!(self.ledger.leases_on(x.buffer), on, "leases on {a}");
        }
        for l in &m.leases {
            assert_eq!(self.ledger.is_out(l.id), l.out, "{l:?} out");
        }
        let stranded: BTreeSet<LeaseId> = m
            .leases
            .iter()
            .filter(|l| l.stranded)
            .map(|l| l.id)
            .collect();
        assert_eq!(self.ledger.stranded(), stranded, "stranded leases");
        // The lease table and the counters the status reports, per allocation.
        let view = self.ledger.view(None);
        let live: Vec<(usize, &MAlloc)> = m
            .allocs
            .iter()
            .enumerate()
            .filter(|(_, x)| !x.freed)
            .collect();
        assert_eq!(view.len(), live.len());
        let quarantined = |a: usize| m.allocs[a].quarantine_reported;
        for ((a, x), v) in live.iter().zip(&view) {
            assert_eq!((v.alloc, v.buffer), (x.id, x.buffer), "view of {a}");
            let mut leases: Vec<(LeaseId, ProcessId)> = m
                .leases
                .iter()
                .filter(|l| l.counts() && l.alloc == *a)
                .map(|l| (l.id, process(m.holder(l))))
                .collect();
            leases.sort();
            assert_eq!(v.leases, leases, "leases of {a} and their holders");
            assert_eq!(v.retiring, x.retired, "{a} retiring");
            assert_eq!(v.quarantined, quarantined(*a), "{a} quarantined");
        }
        let pinned = live
            .iter()
            .filter(|(a, _)| m.leases.iter().any(|l| l.counts() && l.alloc == *a));
        let (q, retired) = (
            live.iter().filter(|(a, _)| quarantined(*a)).count(),
            live.iter().filter(|(_, x)| x.retired).count(),
        );
        assert_eq!(
            (
                c.bytes,
                c.pinned_bytes,
                c.retiring,
                c.quarantined,
                c.quarantined_bytes
            ),
            (
                4096 * live.len() as u64,
                4096 * pinned.count() as u64,
                retired,
                q,
                4096 * q as u64
            ),
            "bytes, pinned bytes, retiring, quarantined"
        );
        // By owner: every allocation here is owner 1's, none another's.
        assert_eq!(self.ledger.view(Some(ActorId::new(1))), view);
        assert!(self.ledger.view(Some(ActorId::new(2))).is_empty());
        assert_eq!(
            self.ledger.counts(Some(ActorId::new(1))).buffers,
            live.len()
        );
        assert_eq!(self.ledger.counts(Some(ActorId::new(2))).buffers, 0);
        for link in m.links.iter() {
            let expect = link.up.then(|| process(link.process));
            assert_eq!(self.ledger.link_process(link.id), expect, "{link:?}");
        }
        // Every grant is counted, relayed ones too (the status's `granted`).
        assert_eq!(
            self.ledger.granted(),
            m.leases.len() as u64,
            "leases granted"
        );
        // The same counters per owner: every allocation here is owner 1's.
        let totals = Totals {
            granted: self.ledger.granted(),
            freed: self.ledger.freed(),
        };
        assert_eq!(self.ledger.totals(None), totals);
        assert_eq!(self.ledger.totals(Some(ActorId::new(1))), totals);
        assert_eq!(self.ledger.totals(Some(ActorId::new(2))), Totals::default());
        // An `Unmapped` answers an `Unmap` exactly where one is owed.
        for (l, link) in m.links.iter().enumerate() {
            for (a, x) in m.allocs.iter().enumerate() {
                assert_eq!(
                    self.ledger.unmap_asked(link.id, x.id),
                    m.holds.contains(&(a, l, Token::Draining)),
                    "Unmap of {a} asked over {l}"
                );
            }
        }
        // Who holds what, per process: leases, their oldest grant, the bytes they pin.
        let holders = self.ledger.holders();
        for p in 0..4u32 {
            let mine: Vec<&MLease> = m
                .leases
                .iter()
                .filter(|l| l.counts() && m.holder(l) == p)
                .collect();
            let mut pinned: Vec<usize> = mine.iter().map(|l| l.alloc).collect();
            pinned.sort();
            pinned.dedup();
            let row = holders.iter().find(|h| h.process == process(p));
            assert_eq!(
                row.map_or(0, |h| h.leases),
                mine.len(),
                "leases of process {p}"
            );
            assert_eq!(
                row.and_then(|h| h.oldest_grant),
                mine.iter().filter(|l| l.out).map(|l| l.granted_at).min(),
                "oldest lease of process {p}"
            );
            assert_eq!(
                row.map_or(0, |h| h.pinned_bytes),
                4096 * pinned.len() as u64,
                "bytes pinned by process {p}"
            );
            let cut = m
                .cut
                .iter()
                .any(|&(a, q)| q == p && !m.dead.contains(&q) && !m.allocs[a].freed)
                || mine.iter().any(|l| l.stranded);
            assert_eq!(row.is_some_and(|h| h.cut), cut, "process {p} a cut holder");
            let live = |a: &usize| !m.allocs[*a].freed;
            let mapped: BTreeSet<usize> = m
                .holds
                .iter()
                .filter(|&&(_, l, _)| m.links[l].up && m.links[l].process == p)
                .map(|&(a, ..)| a)
                .filter(live)
                .collect();
            assert_eq!(
                row.map_or(0, |h| h.mapped_bytes),
                4096 * mapped.len() as u64,
                "bytes mapped by process {p}"
            );
            let quarantined = (0..m.allocs.len())
                .filter(live)
                .filter(|&a| m.allocs[a].quarantine_reported && m.cut_alive(a).contains(&p))
                .count();
            assert_eq!(
                row.map_or(0, |h| h.quarantined_bytes),
                4096 * quarantined as u64,
                "bytes quarantined for process {p}"
            );
        }
        // Who owns each buffer, and what the node keeps to free it.
        for x in m.allocs.iter().filter(|x| !x.freed) {
            assert_eq!(self.ledger.owner_of(x.buffer), Some(ActorId::new(1)));
            assert!(self.ledger.meta(x.id).is_some(), "{:?} has its meta", x.id);
        }
        let pinned_allocs = (0..m.allocs.len()).filter(|&a| m.lease_out_on(a)).count();
        assert_eq!(c.pinned_bytes, 4096 * pinned_allocs as u64);
        assert_eq!(
            self.ledger.freed(),
            m.allocs.iter().filter(|x| x.freed).count() as u64
        );
    }

    /// Ends every link and process, answers nothing: all that was retired must then be
    /// freed (no quarantine outlives its holders).
    fn finish(&mut self) {
        for p in 0..4 {
            self.apply(&Ev::ProcessDead { process: p });
        }
        for a in 0..self.model.allocs.len() {
            self.apply(&Ev::Retire { alloc: a });
        }
        for x in &self.model.allocs {
            assert!(x.freed, "{:?} leaked after every holder died", x.id);
        }
        assert_eq!(self.ledger.counts(None), Counts::default());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn the_ledger_frees_exactly_when_no_live_process_may_map(events in prop::collection::vec(event(), 1..120)) {
        let mut run = Run::new();
        for ev in &events {
            run.apply(ev);
        }
        run.finish();
    }
}

/// The scenario of the stubborn live holder, step by step, with both rules.
#[test]
fn a_cut_live_holder_quarantines_unsafe_memory_until_it_dies() {
    for unsafe_free in [true, false] {
        let mut run = Run::new();
        run.apply(&Ev::Insert {
            unsafe_free,
            kill: false,
            pool: None,
        });
        run.apply(&Ev::LinkUp { process: 0 });
        run.apply(&Ev::Grant {
            alloc: 0,
            link: 0,
            writable: false,
            quarters: (0, 4),
        });
        run.apply(&Ev::Retire { alloc: 0 });
        run.apply(&Ev::Revoke { alloc: 0 });
        run.apply(&Ev::Tick { advance_ms: 150 });
        assert!(
            run.model.links[0].cut_asked,
            "the holder is cut at its deadline"
        );
        run.apply(&Ev::LinkCut { link: 0 });
        assert_eq!(
            run.model.allocs[0].freed, !unsafe_free,
            "unsafe memory waits for the holder's death; the rest is freed at the cut"
        );
        assert_eq!(
            run.ledger.counts(None).quarantined,
            usize::from(unsafe_free)
        );
        run.apply(&Ev::ProcessDead { process: 0 });
        assert!(run.model.allocs[0].freed);
    }
}

/// Two importers with warm mappings: the free waits for both `Unmapped`, or a death.
#[test]
fn a_free_waits_for_every_warm_mapping() {
    let mut run = Run::new();
    run.apply(&Ev::Insert {
        unsafe_free: true,
        kill: false,
        pool: None,
    });
    run.apply(&Ev::LinkUp { process: 0 });
    run.apply(&Ev::LinkUp { process: 1 });
    run.apply(&Ev::Grant {
        alloc: 0,
        link: 0,
        writable: false,
        quarters: (0, 4),
    });
    run.apply(&Ev::Grant {
        alloc: 0,
        link: 1,
        writable: false,
        quarters: (0, 4),
    });
    run.apply(&Ev::Release {
        lease: 0,
        wrong_link: false,
        fences: vec![Point::Slot { slot: 0, value: 1 }],
    });
    run.apply(&Ev::Release {
        lease: 1,
        wrong_link: false,
        fences: Vec::new(),
    });
    run.apply(&Ev::Retire { alloc: 0 });
    assert_eq!(
        run.model.pending_unmaps.len(),
        2,
        "both importers asked to unmap"
    );
    run.apply(&Ev::AnswerUnmap { pending: 0 });
    assert!(!run.model.allocs[0].freed, "one answer is not enough");
    run.apply(&Ev::ProcessDead { process: 1 });
    assert!(run.model.allocs[0].freed, "the other's death ends the wait");
}

/// A forward: process 0 holds a lease and forwards it to process 1, which has no link.
/// The relay's death strands process 1's lease: kept, whatever the rule, until 1 dies —
/// and the relay, which never mapped through it, is no cut holder of it.
#[test]
fn a_stranded_forward_keeps_the_memory_until_its_holder_dies() {
    for unsafe_free in [true, false] {
        let mut run = Run::new();
        run.apply(&Ev::Insert {
            unsafe_free,
            kill: false,
            pool: None,
        });
        run.apply(&Ev::LinkUp { process: 0 });
        run.apply(&Ev::Grant {
            alloc: 0,
            link: 0,
            writable: false,
            quarters: (0, 4),
        });
        run.apply(&Ev::GrantRelayed { via: 0, to: 1 });
        assert!(run.model.leases[1].out, "the forward is granted");
        let view = run.ledger.view(None);
        assert_eq!(view[0].relayed.len(), 1);
        assert_eq!(view[0].relayed[0].holder, process(1));
        assert_eq!(view[0].relayed[0].via, Some(process(0)));
        // Forwards are one hop: a relayed lease cannot be forwarded again.
        run.apply(&Ev::GrantRelayed { via: 1, to: 2 });
        assert_eq!(run.model.leases.len(), 2);
        run.apply(&Ev::Release {
            lease: 0,
            wrong_link: false,
            fences: Vec::new(),
        });
        run.apply(&Ev::Retire { alloc: 0 });
        run.apply(&Ev::ProcessDead { process: 0 });
        assert!(!run.model.allocs[0].freed, "process 1 may still map it");
        let view = run.ledger.view(None);
        assert_eq!(view[0].relayed[0].via, None, "stranded");
        assert!(view[0].cut_holders.is_empty(), "the relay is no cut holder");
        assert_eq!(run.ledger.counts(None).quarantined, 0);
        run.apply(&Ev::ProcessDead { process: 1 });
        assert!(run.model.allocs[0].freed, "freed once its holder is dead");
    }
}

/// A stranded forward on a live buffer still counts as a lease on it (issue 45, finding
/// 6): the owner's `returned()` (which waits for `leases_on` to reach 0) does not resolve
/// and a writable lease (or the owner's own write) is refused until its holder is dead.
#[test]
fn a_stranded_forward_counts_as_a_lease_until_its_holder_dies() {
    let mut run = Run::new();
    run.apply(&Ev::Insert {
        unsafe_free: false,
        kill: false,
        pool: None,
    });
    run.apply(&Ev::LinkUp { process: 0 });
    run.apply(&Ev::LinkUp { process: 2 });
    run.apply(&Ev::Grant {
        alloc: 0,
        link: 0,
        writable: false,
        quarters: (0, 4),
    });
    run.apply(&Ev::GrantRelayed { via: 0, to: 1 });
    run.apply(&Ev::Release {
        lease: 0,
        wrong_link: false,
        fences: Vec::new(),
    });
    // The relay's link goes down: the forward is stranded, its holder may still map it.
    run.apply(&Ev::LinkCut { link: 0 });
    let buffer = run.model.allocs[0].buffer;
    assert_eq!(run.ledger.stranded().len(), 1);
    assert_eq!(
        run.ledger.leases_on(buffer),
        1,
        "the stranded lease pins it"
    );
    // No writer while a stranded reader may map it (the model checks the refusal).
    run.apply(&Ev::Grant {
        alloc: 0,
        link: 1,
        writable: true,
        quarters: (0, 4),
    });
    assert_eq!(run.model.leases.len(), 2, "the writable grant was refused");
    run.apply(&Ev::ProcessDead { process: 1 });
    assert_eq!(
        run.ledger.leases_on(buffer),
        0,
        "back once its holder is dead"
    );
}

/// A forwarded lease whose holder died: the relay's late `Release` of it is recognised
/// once (also after another link went down), not taken for a lease the link never had.
#[test]
fn a_release_that_crosses_the_holders_death_is_recognised() {
    let mut ledger: Ledger<u64, Fence> = Ledger::default();
    let (alloc, buffer, link) = (AllocationId::new(1), BufferId::next(), LinkId::next());
    ledger.insert(NewAllocation {
        alloc,
        buffer,
        owner: ActorId::new(1),
        bytes: 4096,
        rule: FreeWhileMapped::Unsafe,
        policy: RevokePolicy::Cut,
        pool: None,
        meta: 1,
    });
    ledger.link_up(link, process(0));
    let now = Instant::now();
    let (own, fwd) = (LeaseId::new(1), LeaseId::new(2));
    ledger
        .grant(alloc, link, own, now, Access::read(0..BYTES), ())
        .unwrap();
    assert_eq!(
        ledger.grant_relayed(own, link, fwd, process(1), 4, now, ()),
        Ok((alloc, 0..BYTES))
    );
    assert_eq!(ledger.stranded().len(), 0);
    ledger.process_dead(process(1));
    ledger.check();
    assert!(!ledger.is_out(fwd));
    assert_eq!(ledger.release(fwd, link, None), Err(Refusal::UnknownLease));
    // Another link going down forgets only its own ended relays, not this one's.
    let other = LinkId::next();
    ledger.link_up(other, process(2));
    ledger.link_cut(other);
    ledger.check();
    assert!(ledger.forget_ended_relay(fwd, link));
    assert!(!ledger.forget_ended_relay(fwd, link), "once");
}

/// A release fence as the node hands it to the ledger — the fence and the process that
/// recorded it — with the same rule as `order::ReleaseFence` (which this layer may not
/// name).
#[derive(Debug, Clone, PartialEq, Eq)]
struct PeerFence {
    producer: ProcessId,
    fence: FenceHandle,
}

impl Covers for PeerFence {
    fn covers(&self, earlier: &Self) -> bool {
        self.producer == earlier.producer && self.fence.covers(&earlier.fence)
    }
}

/// One peer leases and releases one reused buffer 10,000 times, each release after a
/// counter fence of one of two slots of its lane, values rising: the allocation keeps the
/// newest fence of each slot, so the free waits for two fences, not 10,000.
#[test]
fn a_flood_of_releases_of_one_reused_buffer_keeps_one_fence_per_slot() {
    let slot = |offset: u64, value: u64| PeerFence {
        producer: process(0),
        fence: FenceHandle::Counter(CounterFence {
            slab: CudaIpcMemHandle([3; 64]),
            slab_id: 9,
            offset,
            value,
        }),
    };
    let mut ledger: Ledger<u64, PeerFence> = Ledger::default();
    let (alloc, buffer, link) = (AllocationId::new(1), BufferId::next(), LinkId::next());
    ledger.insert(NewAllocation {
        alloc,
        buffer,
        owner: ActorId::new(1),
        bytes: 4096,
        rule: FreeWhileMapped::Unsafe,
        policy: RevokePolicy::Cut,
        pool: None,
        meta: 1,
    });
    ledger.link_up(link, process(0));
    let now = Instant::now();
    const CYCLES: u64 = 10_000;
    for n in 1..=CYCLES {
        let lease = LeaseId::new(n);
        ledger
            .grant(alloc, link, lease, now, Access::read(0..BYTES), ())
            .unwrap();
        // Slots 0 and 1 of the lane take turns; each value is higher than the last.
        let fence = slot(8 * (n % 2), 100 + n);
        assert_eq!(ledger.release(lease, link, [fence]), Ok(alloc));
        // The lease's end is all there is to do.
        let ended = ledger.take_actions();
        assert!(
            matches!(ended[..], [Action::LeaseEnded { lease: l, alloc: a, data: () }] if l == lease && a == alloc),
            "{ended:?}"
        );
    }
    ledger.check();
    ledger.check_fences();
    assert_eq!(ledger.fences(alloc).map(<[_]>::len), Some(2));
    assert!(ledger.take_actions().is_empty(), "nothing to do while live");
    ledger.retire(buffer);
    ledger.unmapped(link, alloc);
    let actions = ledger.take_actions();
    let fences = actions
        .into_iter()
        .find_map(|a| match a {
            Action::Free { fences, .. } => Some(fences),
            _ => None,
        })
        .expect("freed once the importer unmapped");
    assert_eq!(fences.len(), 2, "one fence per slot, not one per release");
    assert!(fences.contains(&slot(0, 100 + CYCLES)), "slot 0's newest");
    assert!(
        fences.contains(&slot(8, 100 + CYCLES - 1)),
        "slot 1's newest"
    );
}

/// Grants (forwarded ones too) and frees are counted for the owner of their allocation;
/// the totals are the sums.
#[test]
fn grants_and_frees_are_counted_per_owner() {
    let mut ledger: Ledger<u64, Fence> = Ledger::default();
    let link = LinkId::next();
    ledger.link_up(link, process(0));
    let now = Instant::now();
    let mut buffers = Vec::new();
    for (n, owner) in [(1, 1), (2, 2), (3, 2)] {
        let (alloc, buffer) = (AllocationId::new(n), BufferId::next());
        ledger.insert(NewAllocation {
            alloc,
            buffer,
            owner: ActorId::new(owner),
            bytes: 4096,
            rule: FreeWhileMapped::Survives,
            policy: RevokePolicy::Cut,
            pool: None,
            meta: n,
        });
        buffers.push((alloc, buffer));
    }
    // Owner 1: a lease and its forward; owner 2: a lease on each of its two buffers.
    let lease = LeaseId::new;
    ledger
        .grant(
            buffers[0].0,
            link,
            lease(1),
            now,
            Access::read(0..BYTES),
            (),
        )
        .unwrap();
    ledger
        .grant_relayed(lease(1), link, lease(2), process(1), 4, now, ())
        .unwrap();
    ledger
        .grant(
            buffers[1].0,
            link,
            lease(3),
            now,
            Access::read(0..BYTES),
            (),
        )
        .unwrap();
    ledger
        .grant(
            buffers[2].0,
            link,
            lease(4),
            now,
            Access::read(0..BYTES),
            (),
        )
        .unwrap();
    // Owner 2's buffers go: released, retired, unmapped.
    for (l, (alloc, buffer)) in [(3, buffers[1]), (4, buffers[2])] {
        assert_eq!(ledger.release(lease(l), link, None), Ok(alloc));
        ledger.retire(buffer);
        assert!(ledger.unmapped(link, alloc));
    }
    ledger.check();
    let totals = |granted, freed| Totals { granted, freed };
    assert_eq!(ledger.totals(Some(ActorId::new(1))), totals(2, 0));
    assert_eq!(ledger.totals(Some(ActorId::new(2))), totals(2, 2));
    assert_eq!(ledger.totals(Some(ActorId::new(3))), Totals::default());
    assert_eq!(ledger.totals(None), totals(4, 2));
    assert_eq!((ledger.granted(), ledger.freed()), (4, 2));
}

/// The leases whose end the ledger queued, with their data, in lease order.
fn ended<M, F, D: Ord>(ledger: &mut Ledger<M, F, D>) -> Vec<(LeaseId, D)> {
    let mut ended: Vec<(LeaseId, D)> = ledger
        .take_actions()
        .into_iter()
        .filter_map(|a| match a {
            Action::LeaseEnded { lease, data, .. } => Some((lease, data)),
            _ => None,
        })
        .collect();
    ended.sort();
    ended
}

/// A pool's descriptor crosses a link once for all the pool's allocations: again after the
/// offer that carried it was taken back unsent, after the importer could not open an offer
/// of the pool (an `Unmapped` nobody asked for), and over a new link. Each lease's data
/// comes back when it ends.
#[test]
fn a_pools_descriptor_goes_once_per_link_until_an_open_fails() {
    let mut ledger: Ledger<u64, Fence, &'static str> = Ledger::default();
    let (a, b) = (AllocationId::new(1), AllocationId::new(2));
    for (alloc, meta) in [(a, 1), (b, 2)] {
        ledger.insert(NewAllocation {
            alloc,
            buffer: BufferId::next(),
            owner: ActorId::new(1),
            bytes: 4096,
            rule: FreeWhileMapped::Survives,
            policy: RevokePolicy::Cut,
            pool: Some(7),
            meta,
        });
    }
    let link = LinkId::next();
    ledger.link_up(link, process(0));
    let now = Instant::now();
    let lease = LeaseId::new;
    let hold = |new_hold| Grant { new_hold };
    assert_eq!(
        ledger.grant(a, link, lease(1), now, Access::read(0..BYTES), "one"),
        Ok((hold(true), Some(7)))
    );
    assert_eq!(
        ledger.grant(b, link, lease(2), now, Access::read(0..BYTES), "two"),
        Ok((hold(true), None)),
        "the pool's descriptor went with the first offer"
    );
    // The first offer never went out: the next one carries the descriptor.
    assert_eq!(ledger.ungrant(lease(1)), Some((link, hold(true), Some(7))));
    assert_eq!(
        ledger.grant(a, link, lease(3), now, Access::read(0..BYTES), "three"),
        Ok((hold(true), Some(7)))
    );
    // The importer could not open `b`'s offer: the pool goes again.
    assert!(ledger.unmapped(link, b));
    assert_eq!(
        ledger.grant(b, link, lease(4), now, Access::read(0..BYTES), "four"),
        Ok((hold(true), Some(7)))
    );
    // A writable lease waits for the others; none is granted while one is out.
    assert_eq!(
        ledger.grant(a, link, lease(5), now, Access::write(0..BYTES), "five"),
        Err(Refusal::ReadersOut)
    );
    // A new link gets the descriptor with its first offer.
    let other = LinkId::next();
    ledger.link_up(other, process(1));
    assert_eq!(
        ledger.grant(b, other, lease(6), now, Access::read(0..BYTES), "six"),
        Ok((hold(true), Some(7)))
    );
    ledger.check();
    assert_eq!(
        ended(&mut ledger),
        [(lease(1), "one")],
        "only the ungranted lease ended"
    );
    ledger.link_cut(link);
    assert_eq!(
        ended(&mut ledger),
        [(lease(2), "two"), (lease(3), "three"), (lease(4), "four")],
        "the cut link's leases end, each with its data"
    );
    // `a`'s leases went with the link: a writable lease may go out now (the pool's
    // descriptor already crossed `other`), and then no other lease on `a`.
    assert_eq!(
        ledger.grant(a, other, lease(7), now, Access::write(0..BYTES), "seven"),
        Ok((hold(true), None))
    );
    assert_eq!(
        ledger.grant(a, other, lease(8), now, Access::read(0..BYTES), "eight"),
        Err(Refusal::WriterOut)
    );
    ledger.check();
}

/// One writer or many readers holds per byte range: writable leases of the two halves of
/// an allocation coexist; a lease that overlaps a writable one is refused, and a writable
/// one that overlaps any lease out (a stranded forward included); a forward covers the
/// bytes of the lease it forwards.
#[test]
fn writable_leases_of_disjoint_ranges_coexist_and_overlapping_ones_are_refused() {
    let mut ledger: Ledger<u64, Fence, ()> = Ledger::default();
    let alloc = AllocationId::new(1);
    ledger.insert(NewAllocation {
        alloc,
        buffer: BufferId::next(),
        owner: ActorId::new(1),
        bytes: BYTES,
        rule: FreeWhileMapped::Survives,
        policy: RevokePolicy::Cut,
        pool: None,
        meta: 1,
    });
    let (link, other) = (LinkId::next(), LinkId::next());
    ledger.link_up(link, process(0));
    ledger.link_up(other, process(1));
    let now = Instant::now();
    let lease = LeaseId::new;
    let half = BYTES / 2;
    let grant = |ledger: &mut Ledger<u64, Fence, ()>, n, link, access| {
        let got = ledger.grant(alloc, link, lease(n), now, access, ());
        ledger.check();
        got.map(|_| ())
    };

    // The two halves, writable, to two importers.
    assert_eq!(grant(&mut ledger, 1, link, Access::write(0..half)), Ok(()));
    assert_eq!(
        grant(&mut ledger, 2, other, Access::write(half..BYTES)),
        Ok(())
    );
    // Anything that overlaps either is refused; the whole buffer overlaps both.
    for (n, access) in [
        (3, Access::read(0..1)),
        (4, Access::read(half - 1..half + 1)),
        (5, Access::write(half..half + 8)),
        (6, Access::read(0..BYTES)),
    ] {
        assert_eq!(
            grant(&mut ledger, n, link, access.clone()),
            Err(Refusal::WriterOut),
            "{access:?}"
        );
    }
    assert_eq!(ledger.leases_on(ledger_buffer(&ledger, alloc)), 2);
    // The first half comes back: readers of it are granted, and forwarded (a forward
    // covers its lease's bytes); a writer of it is refused while they are out.
    ledger.release(lease(1), link, []).unwrap();
    assert_eq!(grant(&mut ledger, 7, link, Access::read(0..half)), Ok(()));
    assert_eq!(grant(&mut ledger, 8, other, Access::read(8..16)), Ok(()));
    assert_eq!(
        ledger.grant_relayed(lease(7), link, lease(9), process(2), 4, now, ()),
        Ok((alloc, 0..half))
    );
    assert_eq!(
        grant(&mut ledger, 10, other, Access::write(0..8)),
        Err(Refusal::ReadersOut)
    );
    // The relaying link goes: its forward is stranded, a reader of its bytes still.
    ledger.link_cut(link);
    ledger.release(lease(8), other, []).unwrap();
    assert_eq!(ledger.stranded(), BTreeSet::from([lease(9)]));
    assert_eq!(
        grant(&mut ledger, 11, other, Access::write(half - 8..half)),
        Err(Refusal::ReadersOut),
        "the stranded forward covers the first half"
    );
    // Its holder dies: the first half is free for a writer; the second is still written.
    ledger.process_dead(process(2));
    assert_eq!(
        grant(&mut ledger, 12, other, Access::write(0..half)),
        Ok(())
    );
    assert_eq!(
        grant(&mut ledger, 13, other, Access::write(half..BYTES)),
        Err(Refusal::WriterOut)
    );
}

/// The buffer of an allocation, for [`Ledger::leases_on`].
fn ledger_buffer<M, F, D>(ledger: &Ledger<M, F, D>, alloc: AllocationId) -> BufferId {
    ledger.allocs[&alloc].buffer
}
