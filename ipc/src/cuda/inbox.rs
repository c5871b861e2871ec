//! The CUDA backend's fence inbox (see [`crate::inbox`] for the rules): its own counter
//! slab, the watch thread that releases waits on producers that died or do not deliver,
//! and the lanes of peers' inboxes this backend writes its fences into.
//!
//! Layout of the slab, in 64-bit slots:
//!
//! ```text
//! [0, W)                 local marks: slot i is written by writer i only, after fences
//!                        it recorded for peers (their local twins), when a twin is read
//!                        or waited on (`CounterSlab::promise`)
//! [W, W + lend)          slots lent one per fence this process records for itself
//! [W + lend, ...)        lanes of W slots, one per peer process: that peer's writer i
//!                        writes slot i of its lane
//! ```
//!
//! (W = the backend's writers: its release streams, then its stream slots — a stream of
//! the user's bound to slot i while it writes fences there itself, `Fences::export_fence_on`.)
//! Only the slab's own process waits on it; peers
//! write into it. The watch thread reads it back (one copy, on a stream of its own that
//! waits on nothing) whenever a lane has values pending, at most every [`WATCH_TICK`].

use super::fence::{CounterSlab, LocalMark, TwinState};
use super::{SharedContext, SharedStream};
use crate::inbox::{FenceRefusal, Lanes, ReleaseRange};
use crate::ordering::FenceFaultHook;
use crate::process::{Liveness, liveness};
use crate::{Error, Result};
use baton_messages::{CounterFence, DeviceUuid, InboxGrant, ProcessId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use super::result::StreamMemOps;

/// How often the watch thread looks at lanes with values pending.
pub(crate) const WATCH_TICK: Duration = Duration::from_millis(20);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its state consistent before a call that may panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the watch thread shares with the backend.
struct Watched {
    slab: Arc<CounterSlab>,
    lanes: Mutex<Lanes>,
    /// A stream that waits on nothing: reads and releases never queue behind anyone.
    stream: SharedStream,
    hooks: Mutex<Vec<FenceFaultHook>>,
}

impl Watched {
    fn release(&self, ranges: &[ReleaseRange]) {
        for r in ranges {
            let value = lock(&self.lanes).release_value(r.first);
            if let Err(e) = self.slab.release(r.first, r.slots, value, &self.stream) {
                tracing::warn!(error = %e, first = r.first, "releasing a fence inbox lane failed");
            }
        }
    }

    /// One look: read the slab back if a lane needs it, release what the lanes decide.
    fn observe(&self) -> Result<()> {
        if !lock(&self.lanes).needs_observing() {
            return Ok(());
        }
        let values = self.slab.read_all_on(&self.stream)?;
        let seen =
            lock(&self.lanes).observe(&values, Instant::now(), |p| liveness(p) != Liveness::Dead);
        self.release(&seen.release);
        for producer in &seen.lowered {
            tracing::warn!(
                %producer,
                "a dead peer's write landed in its fence inbox lane after the lane was released: released again"
            );
        }
        for producer in &seen.late {
            let pending = lock(&self.lanes).pending_slots(producer);
            tracing::warn!(
                %producer,
                ?pending,
                "a peer's fences are late: no progress for a quarter of the fence deadline"
            );
        }
        if !seen.missed.is_empty() {
            let hooks = lock(&self.hooks).clone();
            for producer in seen.missed {
                let pending = lock(&self.lanes).pending_slots(&producer);
                tracing::warn!(
                    %producer,
                    ?pending,
                    "a peer's fences did not land within the fence deadline: our waits on them are released and the peer is cut"
                );
                for hook in &hooks {
                    hook(producer);
                }
            }
        }
        Ok(())
    }
}

fn watch(watched: Weak<Watched>) {
    loop {
        std::thread::sleep(WATCH_TICK);
        let Some(w) = watched.upgrade() else {
            return;
        };
        if let Err(e) = w.observe() {
            tracing::warn!(error = %e, "reading the fence inbox back failed");
        }
    }
}

/// A lane of a peer's inbox that this backend writes into.
#[derive(Debug)]
struct PeerLane {
    grant: InboxGrant,
    /// The last value taken per slot.
    values: Vec<u64>,
}

/// What we know of a peer process's inbox.
#[derive(Debug)]
enum PeerInbox {
    /// One lane lent to us: our fences for it go there.
    Lane(PeerLane),
    /// Two different lanes from one process (two nodes there), or a lane another backend of
    /// ours writes already: which one a fence is for cannot be told, so fences for that
    /// process are interprocess events.
    Ambiguous,
}

/// Lanes of other processes' inboxes claimed by a backend of this process, by (owner, slab,
/// first slot): a lane has one writer — two backends of one process counting values in it
/// would satisfy each other's waits. A claim outlives its backend (a later backend counting
/// from zero again would be satisfied by the old one's values): another backend of this
/// process gets event fences for that peer.
fn claimed() -> &'static Mutex<HashMap<LaneKey, u64>> {
    static CLAIMED: std::sync::OnceLock<Mutex<HashMap<LaneKey, u64>>> = std::sync::OnceLock::new();
    CLAIMED.get_or_init(Default::default)
}

/// A lane of another process's inbox: (owner, slab id, first slot).
type LaneKey = (ProcessId, u64, u32);

/// The backend's inbox (see the module docs).
pub(crate) struct Inbox {
    device: DeviceUuid,
    watched: Arc<Watched>,
    peers: Mutex<HashMap<ProcessId, PeerInbox>>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("slab", &self.watched.slab)
            .field("lanes", &lock(&self.watched.lanes).lent())
            .finish()
    }
}

impl Inbox {
    /// A slab of `writers` local marks, `lend` slots for this process's own fences and
    /// `lanes` peer lanes of `writers` slots, and its watch thread.
    #[allow(
        clippy::too_many_arguments,
        reason = "called once, by the backend's build, with its own fields"
    )]
    pub(crate) fn new(
        ctx: &SharedContext,
        device: DeviceUuid,
        ops: StreamMemOps,
        side: SharedStream,
        stream: SharedStream,
        writers: usize,
        lend: usize,
        lanes: usize,
        deadline: Duration,
    ) -> Result<Self> {
        let r = writers as u32;
        let lend = lend.clamp(1, 1 << 20) as u32;
        let lanes = lanes.min(1 << 16) as u32;
        let total = r as usize + lend as usize + lanes as usize * r as usize;
        let slab = CounterSlab::new(ctx, total, (r, lend), ops, side)?;
        let watched = Arc::new(Watched {
            lanes: Mutex::new(Lanes::new(r + lend, lanes, r, deadline)),
            slab,
            stream,
            hooks: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&watched);
        std::thread::Builder::new()
            .name("baton-fence-watch".into())
            .spawn(move || watch(weak))
            .map_err(Error::io("spawning the fence watch thread"))?;
        Ok(Self {
            device,
            watched,
            peers: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn slab(&self) -> &Arc<CounterSlab> {
        &self.watched.slab
    }

    /// The lane lent to `peer` (see [`Lanes::grant`]).
    pub(crate) fn grant(&self, peer: &ProcessId) -> Option<InboxGrant> {
        let (first, slots, base) = lock(&self.watched.lanes).grant(peer, Instant::now())?;
        let slab = self.slab();
        slab.keep_for_peers();
        Some(InboxGrant {
            device: self.device,
            slab: slab.ipc(),
            slab_id: slab.id(),
            first,
            slots,
            base,
        })
    }

    /// `peer` lent us `grant`. A second, different grant from the same process, or a lane
    /// another backend of this process writes already, makes it ambiguous (see
    /// [`PeerInbox::Ambiguous`]).
    pub(crate) fn accept(&self, peer: &ProcessId, grant: &InboxGrant) {
        let mut peers = lock(&self.peers);
        match peers.get(peer) {
            Some(PeerInbox::Lane(l)) if l.grant == *grant => return,
            Some(PeerInbox::Lane(_) | PeerInbox::Ambiguous) => {
                tracing::debug!(%peer, "two fence inbox lanes from one process: its fences are events");
                peers.insert(*peer, PeerInbox::Ambiguous);
                return;
            }
            None => {}
        }
        let me = self.slab().id();
        let owner = *lock(claimed())
            .entry((*peer, grant.slab_id, grant.first))
            .or_insert(me);
        let entry = if owner == me {
            PeerInbox::Lane(PeerLane {
                grant: *grant,
                values: vec![grant.base; grant.slots as usize],
            })
        } else {
            tracing::debug!(%peer, "another backend of this process writes this fence inbox lane: fences for it are events");
            PeerInbox::Ambiguous
        };
        peers.insert(*peer, entry);
    }

    /// `peer` is dead: we write no more fences for it.
    pub(crate) fn forget_peer(&self, peer: &ProcessId) {
        if let Some(PeerInbox::Lane(l)) = lock(&self.peers).remove(peer) {
            lock(claimed()).remove(&(*peer, l.grant.slab_id, l.grant.first));
        }
    }

    /// `peer`'s grant to us, if it lent us exactly one lane.
    pub(crate) fn peer_grant(&self, peer: &ProcessId) -> Option<InboxGrant> {
        match lock(&self.peers).get(peer)? {
            PeerInbox::Lane(l) => Some(l.grant),
            PeerInbox::Ambiguous => None,
        }
    }

    /// Takes the next value of `peer`'s lane slot for writer `i` (call with that writer's
    /// mark lock held, and queue the write before letting it go); `None` if the lane has no
    /// slot `i`.
    pub(crate) fn next_peer_value(&self, peer: &ProcessId, i: usize) -> Option<CounterFence> {
        let mut peers = lock(&self.peers);
        let PeerInbox::Lane(lane) = peers.get_mut(peer)? else {
            return None;
        };
        let slot = u32::try_from(i).ok().filter(|&s| s < lane.grant.slots)?;
        let offset = lane.grant.offset_of(slot)?;
        let v = &mut lane.values[slot as usize];
        *v += 1;
        Some(CounterFence {
            slab: lane.grant.slab,
            slab_id: lane.grant.slab_id,
            offset,
            value: *v,
        })
    }

    /// The lock of writer `i`'s local mark.
    pub(crate) fn mark_lock(&self, i: usize) -> MutexGuard<'_, TwinState> {
        self.slab().twin(i)
    }

    /// Writer `i`'s (`stream`'s) local mark after the fence it just queued (the
    /// guard from [`mark_lock`](Self::mark_lock) held): promised, written only when read
    /// or waited on ([`CounterSlab::promise`]).
    pub(crate) fn write_mark(
        &self,
        held: &mut MutexGuard<'_, TwinState>,
        i: usize,
        stream: &SharedStream,
    ) -> LocalMark {
        self.slab().promise(held, i, stream)
    }

    fn refused(producer: &ProcessId, reason: FenceRefusal) -> Error {
        Error::FenceRefused {
            producer: *producer,
            reason,
        }
    }

    /// Checks a fence `producer` sent us, and notes its value.
    pub(crate) fn check(&self, producer: &ProcessId, fence: &CounterFence) -> Result<()> {
        if fence.slab_id != self.slab().id() || fence.slab != self.slab().ipc() {
            return Err(Self::refused(producer, FenceRefusal::ForeignSlab));
        }
        lock(&self.watched.lanes)
            .announce(producer, fence.offset, fence.value, Instant::now())
            .map_err(|r| Self::refused(producer, r))
    }

    /// Whether `fence` names our slab.
    pub(crate) fn is_ours(&self, fence: &CounterFence) -> bool {
        fence.slab_id == self.slab().id()
    }

    /// Whether a wait on `fence` (from `producer`, in our slab) would be on a released
    /// lane: then none is queued.
    pub(crate) fn is_released(&self, producer: &ProcessId, fence: &CounterFence) -> bool {
        lock(&self.watched.lanes).is_released(producer, fence.offset)
    }

    /// `producer` may make our streams wait on `fence` (in our slab).
    pub(crate) fn may_wait(&self, producer: &ProcessId, fence: &CounterFence) -> Result<()> {
        if lock(&self.watched.lanes).may_wait(producer, fence.offset) {
            Ok(())
        } else {
            Err(Self::refused(
                producer,
                FenceRefusal::OutsideLane {
                    offset: fence.offset,
                },
            ))
        }
    }

    /// `process` is dead: its lanes are released.
    pub(crate) fn died(&self, process: &ProcessId) {
        let ranges = lock(&self.watched.lanes).producer_died(process);
        if !ranges.is_empty() {
            tracing::info!(producer = %process, lanes = ranges.len(), "a dead peer's fence inbox lanes released");
        }
        self.watched.release(&ranges);
    }

    /// `process` is cut while it may live: its lanes are released and stay so.
    pub(crate) fn cut(&self, process: &ProcessId) {
        let ranges = lock(&self.watched.lanes).producer_cut(process);
        if !ranges.is_empty() {
            tracing::info!(producer = %process, lanes = ranges.len(), "a cut peer's fence inbox lanes released");
        }
        self.watched.release(&ranges);
    }

    /// See [`Lanes::unsafe_to_free`]; a dead producer's fences never are.
    pub(crate) fn unsafe_to_free(&self, producer: &ProcessId, fence: &CounterFence) -> bool {
        self.is_ours(fence)
            && lock(&self.watched.lanes).unsafe_to_free(producer, fence.offset)
            && liveness(producer) != Liveness::Dead
    }

    pub(crate) fn add_hook(&self, hook: FenceFaultHook) {
        lock(&self.watched.hooks).push(hook);
    }
}
