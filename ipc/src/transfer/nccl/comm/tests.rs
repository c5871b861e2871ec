//! The communicator table against a model: random events (transfers, offers, inits that
//! complete or fail, acknowledged aborts, deadlines, aborts, peer deaths) and the
//! invariants every action stream must keep.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const ME: u8 = 5;
const PEERS: [u8; 2] = [3, 7];

fn rank_of(peer: &u8) -> Rank {
    if ME < *peer { Rank(0) } else { Rank(1) }
}

fn uid(byte: u8) -> UniqueId {
    UniqueId([byte; 128])
}

#[derive(Debug, Clone)]
enum Event {
    Submit {
        peer: usize,
        limit_ms: u64,
        offers: bool,
    },
    Offer {
        peer: usize,
        byte: u8,
        seen: u64,
        stale: bool,
    },
    Ready {
        peer: usize,
    },
    Fail {
        peer: usize,
    },
    AckAbort {
        pick: usize,
    },
    Done {
        pick: usize,
    },
    AbortTransfer {
        pick: usize,
    },
    AbortPeer {
        peer: usize,
    },
    PeerGone {
        peer: usize,
    },
    Advance {
        ms: u64,
    },
}

fn event() -> impl Strategy<Value = Event> {
    let peer = 0..PEERS.len();
    prop_oneof![
        3 => (peer.clone(), 1..60u64, proptest::bool::weighted(0.8))
            .prop_map(|(peer, limit_ms, offers)| Event::Submit { peer, limit_ms, offers }),
        2 => (peer.clone(), any::<u8>(), any::<u64>(), proptest::bool::weighted(0.1))
            .prop_map(|(peer, byte, seen, stale)| Event::Offer { peer, byte, seen, stale }),
        3 => peer.clone().prop_map(|peer| Event::Ready { peer }),
        1 => peer.clone().prop_map(|peer| Event::Fail { peer }),
        2 => any::<usize>().prop_map(|pick| Event::AckAbort { pick }),
        3 => any::<usize>().prop_map(|pick| Event::Done { pick }),
        1 => any::<usize>().prop_map(|pick| Event::AbortTransfer { pick }),
        1 => peer.clone().prop_map(|peer| Event::AbortPeer { peer }),
        1 => peer.prop_map(|peer| Event::PeerGone { peer }),
        2 => (1..40u64).prop_map(|ms| Event::Advance { ms }),
    ]
}

/// What the engine would know, checked against every action the table returns.
#[derive(Default)]
struct Model {
    /// Communicators whose init was started (Offer / Join), with their peer.
    inits: BTreeMap<Attempt, u8>,
    /// Communicators the model made ready.
    ready: BTreeSet<Attempt>,
    /// Communicators whose Abort was issued, and whether the engine acknowledged it.
    aborts: BTreeMap<Attempt, bool>,
    submitted: BTreeSet<Tid>,
    /// Launched transfers and their communicator.
    launched: BTreeMap<Tid, Attempt>,
    finished: BTreeSet<Tid>,
    last_attempt: u64,
}

impl Model {
    fn live_attempts(&self, peer: u8) -> Vec<Attempt> {
        self.inits
            .iter()
            .filter(|(a, p)| **p == peer && !self.aborts.contains_key(a))
            .map(|(a, _)| *a)
            .collect()
    }

    fn check(&mut self, table: &CommTable<u8>, actions: &[Action<u8>]) {
        for action in actions {
            match action {
                Action::Offer {
                    peer,
                    attempt,
                    rank,
                    ..
                }
                | Action::Join {
                    peer,
                    attempt,
                    rank,
                    ..
                } => {
                    assert!(attempt.0 > self.last_attempt, "attempts are never reused");
                    self.last_attempt = attempt.0;
                    assert_eq!(*rank, if ME < *peer { Rank(0) } else { Rank(1) });
                    assert!(
                        self.live_attempts(*peer).is_empty(),
                        "one live communicator per peer: {:?}",
                        self.live_attempts(*peer)
                    );
                    self.inits.insert(*attempt, *peer);
                }
                Action::Launch { attempt, tid, .. } => {
                    assert!(self.ready.contains(attempt), "launch on a comm not ready");
                    assert!(
                        !self.aborts.contains_key(attempt),
                        "launch on an aborted comm"
                    );
                    assert!(self.submitted.contains(tid) && !self.finished.contains(tid));
                    assert!(
                        self.launched.insert(*tid, *attempt).is_none(),
                        "launched twice"
                    );
                }
                Action::Abort { attempt, .. } => {
                    assert!(self.inits.contains_key(attempt), "abort of an unknown comm");
                    assert!(
                        self.aborts.insert(*attempt, false).is_none(),
                        "aborted twice"
                    );
                }
                Action::Finish { tid, outcome } => {
                    assert!(
                        self.submitted.contains(tid),
                        "finish of an unknown transfer"
                    );
                    assert!(
                        self.finished.insert(*tid),
                        "transfer {tid:?} finished twice"
                    );
                    if let Some(a) = self.launched.get(tid) {
                        match outcome {
                            Ok(()) => assert!(!self.aborts.contains_key(a)),
                            // A launched transfer fails only after its comm's Abort.
                            Err(_) => assert!(self.aborts.contains_key(a), "failed before abort"),
                        }
                    } else {
                        assert!(outcome.is_err(), "landed without being launched");
                    }
                }
            }
        }
        // After an abort, nothing of that comm is running.
        for (tid, a) in &self.launched {
            if self.aborts.contains_key(a) {
                assert!(
                    self.finished.contains(tid),
                    "{tid:?} still runs on aborted {a:?}"
                );
            }
        }
        assert_eq!(
            table.unfinished(),
            self.submitted.len() - self.finished.len(),
            "the table and the model agree on what is unfinished"
        );
    }
}

struct Harness {
    table: CommTable<u8>,
    model: Model,
    now: Instant,
    next_tid: u64,
}

impl Harness {
    fn new() -> Self {
        Self {
            table: CommTable::new(rank_of, Duration::from_millis(100)),
            model: Model::default(),
            now: Instant::now(),
            next_tid: 0,
        }
    }

    fn run(&mut self, f: impl FnOnce(&mut CommTable<u8>, Instant, &mut Vec<Action<u8>>)) {
        let mut out = Vec::new();
        f(&mut self.table, self.now, &mut out);
        self.model.check(&self.table, &out);
    }

    fn unfinished_launched(&self) -> Vec<Tid> {
        let m = &self.model;
        m.launched
            .keys()
            .filter(|t| !m.finished.contains(t))
            .copied()
            .collect()
    }

    fn apply(&mut self, e: Event) {
        match e {
            Event::Submit {
                peer,
                limit_ms,
                offers,
            } => {
                self.next_tid += 1;
                let tid = Tid(self.next_tid);
                self.model.submitted.insert(tid);
                let limit = Duration::from_millis(limit_ms);
                self.run(|t, now, out| t.submit(&PEERS[peer], tid, limit, offers, now, out));
            }
            Event::Offer {
                peer,
                byte,
                seen,
                stale,
            } => {
                let ours = self.table.serials(&PEERS[peer]);
                let offer = Offer {
                    serial: if stale { ours.seen } else { ours.seen + 1 },
                    seen: seen % (ours.serial + 1),
                };
                self.run(|t, now, out| t.on_offer(&PEERS[peer], uid(byte), offer, now, out))
            }
            Event::Ready { peer } => {
                if let Some(a) = self.model.live_attempts(PEERS[peer]).pop() {
                    self.model.ready.insert(a);
                    self.run(|t, _, out| t.comm_ready(&PEERS[peer], a, out));
                    if !matches!(self.table.phase(&PEERS[peer]), Phase::Ready(x) if x == a) {
                        self.model.ready.remove(&a);
                    }
                }
            }
            Event::Fail { peer } => {
                if let Some(a) = self.model.live_attempts(PEERS[peer]).pop() {
                    self.run(|t, _, out| t.comm_failed(&PEERS[peer], a, "async error".into(), out));
                }
            }
            Event::AckAbort { pick } => {
                let pending: Vec<Attempt> = (self.model.aborts.iter())
                    .filter(|(_, acked)| !**acked)
                    .map(|(a, _)| *a)
                    .collect();
                if !pending.is_empty() {
                    let a = pending[pick % pending.len()];
                    self.model.aborts.insert(a, true);
                    let peer = self.model.inits[&a];
                    self.run(|t, now, out| t.aborted(&peer, a, now, out));
                }
            }
            Event::Done { pick } => {
                let running = self.unfinished_launched();
                if !running.is_empty() {
                    let tid = running[pick % running.len()];
                    self.run(|t, _, out| t.transfer_done(tid, out));
                }
            }
            Event::AbortTransfer { pick } => {
                let open: Vec<Tid> = (self.model.submitted.iter())
                    .filter(|t| !self.model.finished.contains(t))
                    .copied()
                    .collect();
                if !open.is_empty() {
                    let tid = open[pick % open.len()];
                    self.run(|t, _, out| t.abort_transfer(tid, out));
                    assert!(
                        self.model.finished.contains(&tid),
                        "abort ends the transfer"
                    );
                }
            }
            Event::AbortPeer { peer } => {
                self.run(|t, _, out| t.abort_peer(&PEERS[peer], Failure::Aborted, out))
            }
            Event::PeerGone { peer } => {
                self.run(|t, _, out| t.abort_peer(&PEERS[peer], Failure::PeerGone, out))
            }
            Event::Advance { ms } => {
                self.now += Duration::from_millis(ms);
                self.run(|t, now, out| t.poll_timeout(now, out));
            }
        }
    }

    /// Acknowledges every pending abort, aborts every peer, acknowledges again: nothing
    /// is left unfinished.
    fn drain(&mut self) {
        for _ in 0..4 {
            for pick in 0..self.model.aborts.len() {
                self.apply(Event::AckAbort { pick });
            }
            for peer in 0..PEERS.len() {
                self.apply(Event::AbortPeer { peer });
            }
        }
        assert_eq!(self.table.unfinished(), 0);
        assert_eq!(
            self.model.finished, self.model.submitted,
            "every transfer ends"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_event_stream_keeps_the_invariants(events in proptest::collection::vec(event(), 1..120)) {
        let mut h = Harness::new();
        for e in events {
            h.apply(e);
        }
        h.drain();
    }
}

/// A transfer with peer `peer` that offers its communicator.
fn submit(peer: usize, limit_ms: u64) -> Event {
    Event::Submit {
        peer,
        limit_ms,
        offers: true,
    }
}

/// A first offer from `peer`, which had seen none of ours.
fn offer(peer: usize) -> Event {
    Event::Offer {
        peer,
        byte: 9,
        seen: 0,
        stale: false,
    }
}

#[test]
fn a_fresh_comm_follows_an_aborted_one() {
    let mut h = Harness::new();
    h.apply(submit(1, 50));
    h.apply(Event::Ready { peer: 1 });
    assert_eq!(h.unfinished_launched().len(), 1);
    h.apply(Event::Fail { peer: 1 });
    assert!(matches!(h.table.phase(&7), Phase::Aborting(Attempt(1))));
    // Transfers submitted while aborting wait for the next communicator.
    h.apply(submit(1, 50));
    h.apply(Event::AckAbort { pick: 0 });
    assert_eq!(h.table.phase(&7), Phase::Offered(Attempt(2)));
    h.apply(Event::Ready { peer: 1 });
    assert_eq!(h.table.phase(&7), Phase::Ready(Attempt(2)));
    assert_eq!(h.model.launched.get(&Tid(2)), Some(&Attempt(2)));
    h.apply(Event::Done { pick: 0 });
    assert!(h.model.finished.contains(&Tid(2)));
}

#[test]
fn a_running_transfer_past_its_deadline_aborts_its_comm() {
    let mut h = Harness::new();
    h.apply(submit(0, 10));
    h.apply(Event::Ready { peer: 0 });
    let mut out = Vec::new();
    h.now += Duration::from_millis(11);
    h.table.poll_timeout(h.now, &mut out);
    assert!(matches!(
        out[0],
        Action::Abort {
            attempt: Attempt(1),
            ..
        }
    ));
    assert!(matches!(
        out[1],
        Action::Finish {
            tid: Tid(1),
            outcome: Err(Failure::TimedOut { .. })
        }
    ));
}

#[test]
fn crossing_offers_resolve_to_the_lower_identity() {
    // We (5) offered; the lower peer (3) offered too: ours is aborted and theirs joined.
    let mut h = Harness::new();
    h.apply(submit(0, 50));
    assert_eq!(h.table.phase(&3), Phase::Offered(Attempt(1)));
    h.apply(offer(0));
    assert_eq!(h.table.phase(&3), Phase::Aborting(Attempt(1)));
    h.apply(Event::AckAbort { pick: 0 });
    assert_eq!(h.table.phase(&3), Phase::Joining(Attempt(2)));
    // The higher peer (7) offering while we offered is ignored: it joins ours.
    h.apply(submit(1, 50));
    h.apply(offer(1));
    assert_eq!(h.table.phase(&7), Phase::Offered(Attempt(3)));
}

/// Two tables (identities 1 and 2) whose offers cross through a control plane that
/// delivers in random order; a simulated NCCL makes a communicator ready once both sides
/// run inits of the same unique id. Whatever the interleaving, once every message is
/// delivered both sides are ready on one communicator with ranks 0 and 1, and every
/// transfer was launched.
#[derive(Debug, Clone)]
enum Step {
    Submit(usize),
    Deliver(usize),
}

proptest! {
    #[test]
    fn two_sides_agree(steps in proptest::collection::vec(
        prop_oneof![(0..2usize).prop_map(Step::Submit), (0..2usize).prop_map(Step::Deliver)],
        1..40,
    )) {
        let ids = [1u8, 2u8];
        let mut tables = [
            CommTable::new(|p: &u8| if 1 < *p { Rank(0) } else { Rank(1) }, Duration::from_secs(60)),
            CommTable::new(|p: &u8| if 2 < *p { Rank(0) } else { Rank(1) }, Duration::from_secs(60)),
        ];
        let now = Instant::now();
        // Messages in flight to side i.
        let mut inbox: [VecDeque<(UniqueId, Offer)>; 2] = [VecDeque::new(), VecDeque::new()];
        // Each side's live init: (attempt, uid, rank).
        let mut inits: [Option<(Attempt, UniqueId, Rank)>; 2] = [None, None];
        let mut next_tid = 0;
        let mut launched = 0;
        let mut submitted = 0;
        let mut uid_serial = 0u8;
        let mut process = |side: usize,
                           actions: Vec<Action<u8>>,
                           tables: &mut [CommTable<u8>; 2],
                           inbox: &mut [VecDeque<(UniqueId, Offer)>; 2],
                           inits: &mut [Option<(Attempt, UniqueId, Rank)>; 2],
                           launched: &mut usize| {
            let mut work: VecDeque<(usize, Action<u8>)> =
                actions.into_iter().map(|a| (side, a)).collect();
            while let Some((s, a)) = work.pop_front() {
                let mut out = Vec::new();
                match a {
                    Action::Offer { attempt, rank, offer, .. } => {
                        uid_serial += 1;
                        let u = UniqueId([uid_serial; 128]);
                        inits[s] = Some((attempt, u, rank));
                        inbox[1 - s].push_back((u, offer));
                    }
                    Action::Join { attempt, uid, rank, .. } => inits[s] = Some((attempt, uid, rank)),
                    Action::Abort { attempt, .. } => {
                        inits[s] = None;
                        tables[s].aborted(&ids[1 - s], attempt, now, &mut out);
                    }
                    Action::Launch { .. } => *launched += 1,
                    Action::Finish { outcome, .. } => assert_eq!(outcome, Ok(()), "nothing fails here"),
                }
                work.extend(out.into_iter().map(|a| (s, a)));
                // Both inits on one unique id: the simulated NCCL completes them.
                if let (Some((a0, u0, _)), Some((a1, u1, _))) = (inits[0], inits[1])
                    && u0 == u1
                {
                    for (side, a) in [(0, a0), (1, a1)] {
                        let mut out = Vec::new();
                        tables[side].comm_ready(&ids[1 - side], a, &mut out);
                        work.extend(out.into_iter().map(|a| (side, a)));
                    }
                }
            }
        };
        for step in steps {
            match step {
                Step::Submit(s) => {
                    next_tid += 1;
                    submitted += 1;
                    let mut out = Vec::new();
                    tables[s].submit(&ids[1 - s], Tid(next_tid), Duration::from_secs(60), true, now, &mut out);
                    process(s, out, &mut tables, &mut inbox, &mut inits, &mut launched);
                }
                Step::Deliver(s) => {
                    if let Some((u, o)) = inbox[s].pop_front() {
                        let mut out = Vec::new();
                        tables[s].on_offer(&ids[1 - s], u, o, now, &mut out);
                        process(s, out, &mut tables, &mut inbox, &mut inits, &mut launched);
                    }
                }
            }
        }
        // Deliver everything left.
        while inbox.iter().any(|q| !q.is_empty()) {
            for s in 0..2 {
                if let Some((u, o)) = inbox[s].pop_front() {
                    let mut out = Vec::new();
                    tables[s].on_offer(&ids[1 - s], u, o, now, &mut out);
                    process(s, out, &mut tables, &mut inbox, &mut inits, &mut launched);
                }
            }
        }
        prop_assert_eq!(launched, submitted, "every transfer launched");
        if submitted > 0 {
            let (Some((_, u0, r0)), Some((_, u1, r1))) = (inits[0], inits[1]) else {
                return Err(TestCaseError::fail("both sides have a communicator"));
            };
            prop_assert_eq!(u0, u1);
            prop_assert_eq!((r0, r1), (Rank(0), Rank(1)));
            prop_assert!(matches!(tables[0].phase(&2), Phase::Ready(_)));
            prop_assert!(matches!(tables[1].phase(&1), Phase::Ready(_)));
        }
    }
}
