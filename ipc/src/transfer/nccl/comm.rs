//! The lifecycle of an engine's NCCL communicators, one per peer node, as a state machine
//! that owns no communicator, thread or clock (the shape of quinn-proto's connection): the
//! engine feeds it events with the time, and performs the [`Action`]s it returns, in order.
//!
//! Per peer, a communicator goes
//!
//! ```text
//!   Idle ──submit──▶ Offered (we made the unique id; our init runs; the peer must join)
//!   Idle ──offer───▶ Joining (the peer's unique id; our init runs)
//!   Offered / Joining ──ready──▶ Ready ──(error, deadline, abort, peer gone, new offer)──▶
//!   Aborting (ncclCommAbort in progress) ──aborted──▶ Idle, or a fresh Offered / Joining
//! ```
//!
//! Each communicator is an [`Attempt`], never reused, so an event about an old
//! communicator (a late "ready", a late error) cannot touch a newer one. Ranks are decided
//! by identity: the lower identity is rank 0, on both sides. Each offer carries its serial
//! and the serial of the newest offer its sender had seen from us ([`Offer`]): when both
//! sides offer at once (crossing offers), the lower identity's offer wins — the lower side
//! ignores an offer that had not seen its own newest one, the higher side aborts its own
//! offer and joins. The control plane must deliver offers in order (a link does).
//!
//! Transfers wait in a queue until their peer's communicator is ready, then are launched
//! on it; every transfer ends exactly once (an [`Action::Finish`]). A communicator cannot
//! cancel one operation, so anything that must stop a running transfer (its deadline, an
//! abort, an error) aborts the whole communicator, and the [`Action::Abort`] always comes
//! before the [`Action::Finish`] of the transfers it stops: the engine reports a transfer
//! failed only once NCCL no longer touches its memory.

use super::api::{Rank, UniqueId};
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

/// One communicator: numbered per engine, never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Attempt(pub u64);

/// One transfer, as the engine numbers them (a [`TransferId`](crate::transfer::TransferId)
/// is unique per sender only, and an engine both sends and receives).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tid(pub u64);

/// Why a transfer ended without landing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Aborted by this node (the transfer's `abort`, the engine's `abort_peer`, its drop).
    Aborted,
    /// The peer node died or left.
    PeerGone,
    /// The transfer ran past its deadline (the communicator was aborted to stop it).
    TimedOut {
        /// The transfer's time limit.
        after: Duration,
    },
    /// The communicator failed or was aborted for another reason (said here).
    Comm(String),
}

/// What the engine must do, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<P> {
    /// Make a unique id, start initialising a communicator with it as `rank`, and give
    /// the unique id to the control plane for `peer`.
    Offer {
        /// The peer.
        peer: P,
        /// The new communicator.
        attempt: Attempt,
        /// Our rank in it.
        rank: Rank,
        /// What the rendezvous message carries besides the unique id.
        offer: Offer,
    },
    /// Start initialising a communicator with the peer's unique id as `rank`.
    Join {
        /// The peer.
        peer: P,
        /// The new communicator.
        attempt: Attempt,
        /// The peer's unique id.
        uid: UniqueId,
        /// Our rank in it.
        rank: Rank,
    },
    /// Launch the transfer on the communicator (ready).
    Launch {
        /// The peer.
        peer: P,
        /// The communicator.
        attempt: Attempt,
        /// The transfer.
        tid: Tid,
    },
    /// Abort the communicator (`ncclCommAbort`, if it was made), then report
    /// [`CommTable::aborted`].
    Abort {
        /// The peer.
        peer: P,
        /// The communicator.
        attempt: Attempt,
    },
    /// End the transfer: landed, or failed.
    Finish {
        /// The transfer.
        tid: Tid,
        /// How.
        outcome: Result<(), Failure>,
    },
}

/// The rendezvous header of an offer: which of its sender's offers it is, and the newest
/// of ours its sender had seen when it made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Offer {
    /// The sender's offers to this peer, counted from 1.
    pub serial: u64,
    /// The serial of the newest offer the sender had received from this peer (0: none).
    pub seen: u64,
}

/// Where a peer's communicator is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// No communicator.
    Idle,
    /// We offered a unique id; our init runs until the peer joins or the deadline.
    Offered(Attempt),
    /// We joined the peer's unique id; our init runs.
    Joining(Attempt),
    /// Transfers run on it.
    Ready(Attempt),
    /// `ncclCommAbort` is in progress; then Idle or a fresh communicator.
    Aborting(Attempt),
}

impl Phase {
    fn attempt(self) -> Option<Attempt> {
        match self {
            Phase::Idle => None,
            Phase::Offered(a) | Phase::Joining(a) | Phase::Ready(a) | Phase::Aborting(a) => Some(a),
        }
    }
}

#[derive(Debug)]
struct Slot {
    phase: Phase,
    /// When an Offered / Joining init gives up.
    init_deadline: Option<Instant>,
    /// A peer's offer that came while aborting: joined once the abort is done.
    next_offer: Option<UniqueId>,
    /// Waiting for the communicator, in submission order, with deadlines and limits.
    queued: VecDeque<(Tid, Instant, Duration)>,
    /// Launched on the Ready communicator.
    running: BTreeMap<Tid, (Instant, Duration)>,
    /// Whether this side offers the communicator when a transfer needs one (else it
    /// waits for the peer's offer).
    offers: bool,
}

impl Slot {
    fn new() -> Self {
        Self {
            phase: Phase::Idle,
            init_deadline: None,
            next_offer: None,
            queued: VecDeque::new(),
            running: BTreeMap::new(),
            offers: false,
        }
    }
}

/// The communicators of one engine, keyed by `P` (a peer, or a peer and a direction),
/// with our rank in each decided by identity.
pub struct CommTable<P> {
    /// Our rank in the communicator of a key: 0 where our identity is the lower.
    rank_of: Box<dyn Fn(&P) -> Rank + Send + Sync>,
    /// How long an init may take before the communicator is given up.
    rendezvous_timeout: Duration,
    next_attempt: u64,
    slots: BTreeMap<P, Slot>,
    /// Which peer each unfinished transfer belongs to.
    owner: BTreeMap<Tid, P>,
    /// Per peer: the serial of our newest offer to it, and of its newest offer to us (kept
    /// while the peer lives, also with no communicator).
    serials: BTreeMap<P, Offer>,
}

impl<P: fmt::Debug> fmt::Debug for CommTable<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommTable")
            .field("peers", &self.slots.len())
            .field("transfers", &self.owner.len())
            .finish()
    }
}

impl<P: Ord + Clone + fmt::Debug> CommTable<P> {
    /// A table whose communicator for `key` has us as rank `rank_of(key)`.
    pub fn new(
        rank_of: impl Fn(&P) -> Rank + Send + Sync + 'static,
        rendezvous_timeout: Duration,
    ) -> Self {
        Self {
            rank_of: Box::new(rank_of),
            rendezvous_timeout,
            next_attempt: 0,
            slots: BTreeMap::new(),
            owner: BTreeMap::new(),
            serials: BTreeMap::new(),
        }
    }

    /// Our rank in the communicator of `peer`: 0 for the lower identity.
    pub fn rank(&self, peer: &P) -> Rank {
        (self.rank_of)(peer)
    }

    /// Where `peer`'s communicator is.
    pub fn phase(&self, peer: &P) -> Phase {
        self.slots.get(peer).map_or(Phase::Idle, |s| s.phase)
    }

    /// Whether the transfer is launched on `attempt` (and not finished).
    pub fn is_running(&self, tid: Tid, attempt: Attempt) -> bool {
        self.owner.get(&tid).is_some_and(|p| {
            let slot = &self.slots[p];
            slot.phase == Phase::Ready(attempt) && slot.running.contains_key(&tid)
        })
    }

    /// Transfers not yet finished.
    #[cfg(test)]
    pub fn unfinished(&self) -> usize {
        self.owner.len()
    }

    fn fresh(&mut self) -> Attempt {
        self.next_attempt += 1;
        Attempt(self.next_attempt)
    }

    fn slot(&mut self, peer: &P) -> &mut Slot {
        self.slots.entry(peer.clone()).or_insert_with(Slot::new)
    }

    /// A fresh communicator: offered by us (`uid` None: the engine makes the unique id),
    /// or joining the peer's `uid`.
    fn start(&mut self, peer: &P, uid: Option<UniqueId>, now: Instant, out: &mut Vec<Action<P>>) {
        let attempt = self.fresh();
        let rank = self.rank(peer);
        let deadline = now + self.rendezvous_timeout;
        let action = match uid {
            None => {
                let serials = self.serials.entry(peer.clone()).or_default();
                serials.serial += 1;
                let offer = *serials;
                Action::Offer {
                    peer: peer.clone(),
                    attempt,
                    rank,
                    offer,
                }
            }
            Some(uid) => Action::Join {
                peer: peer.clone(),
                attempt,
                uid,
                rank,
            },
        };
        let slot = self.slot(peer);
        slot.phase = match uid {
            None => Phase::Offered(attempt),
            Some(_) => Phase::Joining(attempt),
        };
        slot.init_deadline = Some(deadline);
        out.push(action);
    }

    fn finish(&mut self, tid: Tid, outcome: Result<(), Failure>, out: &mut Vec<Action<P>>) {
        self.owner.remove(&tid);
        out.push(Action::Finish { tid, outcome });
    }

    /// Starts aborting `peer`'s communicator (which has one: not Idle, not Aborting):
    /// the Abort, then the Finish of each running transfer (`tid` with `why_tid`, the
    /// others with `why`), and of each queued one too if `drop_queue`.
    fn abort_comm(
        &mut self,
        peer: &P,
        special: Option<(Tid, Failure)>,
        why: Failure,
        drop_queue: bool,
        out: &mut Vec<Action<P>>,
    ) {
        let slot = self.slot(peer);
        let Some(attempt) = slot.phase.attempt() else {
            return;
        };
        if matches!(slot.phase, Phase::Aborting(_)) {
            return;
        }
        slot.phase = Phase::Aborting(attempt);
        slot.init_deadline = None;
        let running = std::mem::take(&mut slot.running);
        let queued = if drop_queue {
            std::mem::take(&mut slot.queued)
        } else {
            VecDeque::new()
        };
        out.push(Action::Abort {
            peer: peer.clone(),
            attempt,
        });
        for tid in running.into_keys().chain(queued.into_iter().map(|q| q.0)) {
            let failure = match &special {
                Some((t, f)) if *t == tid => f.clone(),
                _ => why.clone(),
            };
            self.finish(tid, Err(failure), out);
        }
    }

    /// A new transfer with `peer`, to end by `now + limit`: launched at once on a ready
    /// communicator, else queued; with no communicator, one is offered if `offers` (the
    /// engine's sending side offers, its receiving side waits for the sender's offer).
    pub fn submit(
        &mut self,
        peer: &P,
        tid: Tid,
        limit: Duration,
        offers: bool,
        now: Instant,
        out: &mut Vec<Action<P>>,
    ) {
        self.owner.insert(tid, peer.clone());
        let deadline = now + limit;
        let slot = self.slot(peer);
        slot.offers = offers;
        match slot.phase {
            Phase::Idle if !offers => slot.queued.push_back((tid, deadline, limit)),
            Phase::Ready(attempt) => {
                slot.running.insert(tid, (deadline, limit));
                out.push(Action::Launch {
                    peer: peer.clone(),
                    attempt,
                    tid,
                });
            }
            Phase::Idle => {
                slot.queued.push_back((tid, deadline, limit));
                self.start(peer, None, now, out);
            }
            Phase::Offered(_) | Phase::Joining(_) | Phase::Aborting(_) => {
                slot.queued.push_back((tid, deadline, limit));
            }
        }
    }

    /// Our newest offer's serial to `peer`, and the newest we had from it.
    #[cfg(test)]
    pub fn serials(&self, peer: &P) -> Offer {
        self.serials.get(peer).copied().unwrap_or_default()
    }

    /// The peer's unique id, carried by the control plane: join it, unless it is an old
    /// offer or one that crossed ours and loses (module docs). A new offer on a live
    /// communicator means the peer gave that one up, so it is aborted first.
    pub fn on_offer(
        &mut self,
        peer: &P,
        uid: UniqueId,
        offer: Offer,
        now: Instant,
        out: &mut Vec<Action<P>>,
    ) {
        let me_lower = self.rank(peer) == Rank(0);
        let serials = self.serials.entry(peer.clone()).or_default();
        if offer.serial <= serials.seen {
            return;
        }
        serials.seen = offer.serial;
        if me_lower && offer.seen < serials.serial {
            return;
        }
        let slot = self.slot(peer);
        match slot.phase {
            Phase::Idle => self.start(peer, Some(uid), now, out),
            Phase::Aborting(_) => slot.next_offer = Some(uid),
            Phase::Offered(_) | Phase::Joining(_) | Phase::Ready(_) => {
                let why = Failure::Comm("the peer started a new communicator".into());
                self.abort_comm(peer, None, why, false, out);
                self.slot(peer).next_offer = Some(uid);
            }
        }
    }

    /// The communicator's init completed.
    pub fn comm_ready(&mut self, peer: &P, attempt: Attempt, out: &mut Vec<Action<P>>) {
        let Some(slot) = self.slots.get_mut(peer) else {
            return;
        };
        if !matches!(slot.phase, Phase::Offered(a) | Phase::Joining(a) if a == attempt) {
            return;
        }
        slot.phase = Phase::Ready(attempt);
        slot.init_deadline = None;
        for (tid, deadline, limit) in std::mem::take(&mut slot.queued) {
            slot.running.insert(tid, (deadline, limit));
            out.push(Action::Launch {
                peer: peer.clone(),
                attempt,
                tid,
            });
        }
    }

    /// The communicator failed (an init or launch call failed, an asynchronous error):
    /// it is aborted, and its transfers, running and queued, fail.
    pub fn comm_failed(
        &mut self,
        peer: &P,
        attempt: Attempt,
        why: String,
        out: &mut Vec<Action<P>>,
    ) {
        let live = self.slots.get(peer).is_some_and(|s| {
            s.phase.attempt() == Some(attempt) && !matches!(s.phase, Phase::Aborting(_))
        });
        if live {
            self.abort_comm(peer, None, Failure::Comm(why), true, out);
        }
    }

    /// The engine finished aborting `attempt`: the next communicator may start (the
    /// peer's pending offer is joined, or queued transfers get a fresh offer).
    pub fn aborted(&mut self, peer: &P, attempt: Attempt, now: Instant, out: &mut Vec<Action<P>>) {
        let Some(slot) = self.slots.get_mut(peer) else {
            return;
        };
        if slot.phase != Phase::Aborting(attempt) {
            return;
        }
        slot.phase = Phase::Idle;
        if let Some(uid) = slot.next_offer.take() {
            self.start(peer, Some(uid), now, out);
        } else if !slot.queued.is_empty() {
            if slot.offers {
                self.start(peer, None, now, out);
            }
        } else {
            self.slots.remove(peer);
        }
    }

    /// The transfer's operation completed on the device.
    pub fn transfer_done(&mut self, tid: Tid, out: &mut Vec<Action<P>>) {
        let Some(peer) = self.owner.get(&tid) else {
            return;
        };
        let slot = self
            .slots
            .get_mut(peer)
            .expect("an owned transfer has a slot");
        if slot.running.remove(&tid).is_some() {
            self.finish(tid, Ok(()), out);
        }
    }

    /// This node aborts one transfer: a queued one ends alone; a running one can only be
    /// stopped with its whole communicator.
    pub fn abort_transfer(&mut self, tid: Tid, out: &mut Vec<Action<P>>) {
        let Some(peer) = self.owner.get(&tid).cloned() else {
            return;
        };
        let slot = self.slot(&peer);
        if let Some(i) = slot.queued.iter().position(|q| q.0 == tid) {
            slot.queued.remove(i);
            self.finish(tid, Err(Failure::Aborted), out);
        } else if slot.running.contains_key(&tid) {
            let why = Failure::Comm(format!("aborted with transfer {}", tid.0));
            self.abort_comm(&peer, Some((tid, Failure::Aborted)), why, false, out);
        }
    }

    /// Fails every transfer with `peer` (`why`: [`Failure::Aborted`] for this node's
    /// `abort_peer`, [`Failure::PeerGone`] when the peer died) and aborts its communicator.
    pub fn abort_peer(&mut self, peer: &P, why: Failure, out: &mut Vec<Action<P>>) {
        if why == Failure::PeerGone {
            // A restarted peer is a new identity; its serials start again.
            self.serials.remove(peer);
        }
        let Some(slot) = self.slots.get_mut(peer) else {
            return;
        };
        slot.next_offer = None;
        match slot.phase {
            Phase::Idle | Phase::Aborting(_) => {
                let queued: Vec<Tid> = slot.queued.drain(..).map(|q| q.0).collect();
                for tid in queued {
                    self.finish(tid, Err(why.clone()), out);
                }
            }
            Phase::Offered(_) | Phase::Joining(_) | Phase::Ready(_) => {
                self.abort_comm(peer, None, why, true, out);
            }
        }
    }

    /// Deadlines at `now`: an init that took too long fails its communicator; a queued
    /// transfer past its deadline ends alone; a running one aborts its communicator.
    pub fn poll_timeout(&mut self, now: Instant, out: &mut Vec<Action<P>>) {
        let peers: Vec<P> = self.slots.keys().cloned().collect();
        for peer in peers {
            let slot = self.slot(&peer);
            let mut late = Vec::new();
            slot.queued.retain(|&(tid, deadline, after)| {
                let keep = deadline > now;
                if !keep {
                    late.push((tid, after));
                }
                keep
            });
            for (tid, after) in late {
                self.finish(tid, Err(Failure::TimedOut { after }), out);
            }
            let slot = self.slot(&peer);
            if let Some(a) = slot.phase.attempt()
                && slot.init_deadline.is_some_and(|d| d <= now)
            {
                let why = format!("the peer did not join communicator {} in time", a.0);
                self.comm_failed(&peer, a, why, out);
                continue;
            }
            let slot = self.slot(&peer);
            let expired = slot
                .running
                .iter()
                .find(|(_, (deadline, _))| *deadline <= now)
                .map(|(tid, (_, after))| (*tid, *after));
            if slot.phase == Phase::Idle && slot.queued.is_empty() && slot.next_offer.is_none() {
                self.slots.remove(&peer);
                continue;
            }
            if let Some((tid, after)) = expired {
                let why =
                    Failure::Comm(format!("aborted: transfer {} ran past its deadline", tid.0));
                self.abort_comm(
                    &peer,
                    Some((tid, Failure::TimedOut { after })),
                    why,
                    false,
                    out,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests;
