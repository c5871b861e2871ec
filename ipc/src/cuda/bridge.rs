//! The CUDA side of bridges ([`crate::bridge`] has the rules): a stream of ours never waits
//! on another process's interprocess event. If the event has completed, nothing is queued;
//! otherwise the stream waits on a slot of a small slab of our own
//! (`cuStreamWaitValue64`), which the bridge thread writes (`cuStreamWriteValue64`, on a
//! stream that waits on nothing) once `cuEventQuery` says the event completed, or the
//! producer died, was cut, or missed the fence deadline. The slab and the thread are made
//! at the first bridge; most backends never need one (counter fences are the default).
//!
//! Without 64-bit stream memory operations, or with every slot taken, the wait happens on
//! the calling thread instead: `cuEventQuery` polled, released by the same three causes.
//!
//! A wait is also released when the producer names the same event in a new fence
//! ([`Bridge::renamed`]): it records an event again only after the older record completed,
//! and only for us (`cuda/event.rs`), and the new record — which the event's query now
//! follows — may wait on our own stream.
//!
//! Latency: a bridged wait is released one poll ([`POLL`]) after its event completes at
//! worst — event fences are the fallback, counter fences the fast path.

use super::context::{KeepCurrent, Quiet};
use super::event::OpenedEvent;
use super::fence::CounterSlab;
use super::result::{self, StreamMemOps};
use super::{SharedContext, SharedStream};
use crate::bridge::{Bridges, SlotWrite};
use crate::ordering::FenceFaultHook;
use crate::process::{Liveness, liveness};
use crate::{Error, Result};
use baton_messages::ProcessId;
use cudarc::driver::CudaStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Bridge slots per backend: 8 KiB of device memory, made at the first bridge.
pub(crate) const BRIDGE_SLOTS: u32 = 1024;

/// How often pending events are queried.
const POLL: Duration = Duration::from_micros(50);

/// How often producers' liveness and the deadline are checked while waits are pending.
const LOOK: Duration = Duration::from_millis(20);

/// How long the idle thread sleeps before it looks whether its backend is gone.
const IDLE: Duration = Duration::from_millis(200);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its state consistent before a call that may panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The slab and the stream that writes it, made at the first bridge.
struct Made {
    slab: Arc<CounterSlab>,
    /// Waits on nothing: a release never queues behind anyone.
    stream: SharedStream,
}

struct Shared {
    ctx: SharedContext,
    ops: Option<StreamMemOps>,
    side: SharedStream,
    deadline: Duration,
    state: Mutex<Bridges<Arc<OpenedEvent>>>,
    wake: Condvar,
    hooks: Mutex<Vec<FenceFaultHook>>,
    made: OnceLock<Made>,
    started: OnceLock<()>,
}

impl Shared {
    fn write(&self, writes: &[SlotWrite]) {
        let Some(made) = self.made.get() else {
            return;
        };
        for w in writes {
            if let Err(e) = made.slab.write_on(&made.stream, w.slot, w.value) {
                tracing::warn!(error = %e, slot = w.slot, "releasing a bridged event wait failed");
            }
        }
    }

    fn missed(&self, producers: &[ProcessId]) {
        if producers.is_empty() {
            return;
        }
        let hooks = lock(&self.hooks).clone();
        for producer in producers {
            tracing::warn!(
                %producer,
                "a peer's interprocess event did not complete within the fence deadline: our waits on it are released and the peer is cut"
            );
            for hook in &hooks {
                hook(*producer);
            }
        }
    }

    /// One poll: queries the pending events (no lock held), releases those complete, and
    /// — when `look` — those of dead producers and past the deadline.
    fn poll(&self, look: bool) {
        let pending = lock(&self.state).pending();
        let queried = Instant::now();
        let landed: Vec<u32> = pending
            .iter()
            .filter(|(_, ev)| match ev.is_complete() {
                Ok(done) => done,
                // A failed query says nothing of the work: the deadline or a death decides.
                Err(e) => {
                    tracing::debug!(error = %e, "querying a bridged event failed");
                    false
                }
            })
            .map(|(slot, _)| *slot)
            .collect();
        let query_us = queried.elapsed().as_micros();
        let (writes, missed) = {
            let mut state = lock(&self.state);
            let oldest_us = landed
                .iter()
                .filter_map(|slot| state.since(*slot))
                .map(|since| since.elapsed().as_micros())
                .max();
            if let Some(oldest_us) = oldest_us {
                tracing::trace!(
                    landed = landed.len(),
                    polled = pending.len(),
                    query_us,
                    oldest_us,
                    "bridged events completed"
                );
            }
            let mut writes = state.landed(&landed);
            let mut missed = Vec::new();
            if look {
                let seen = state.look(Instant::now(), |p| liveness(p) != Liveness::Dead);
                writes.extend(seen.release);
                missed = seen.missed;
                for producer in &seen.late {
                    tracing::warn!(%producer, "a peer's event fence is late: pending for a quarter of the fence deadline");
                }
            }
            (writes, missed)
        };
        let wrote = Instant::now();
        self.write(&writes);
        if !writes.is_empty() {
            tracing::trace!(
                released = writes.len(),
                write_us = wrote.elapsed().as_micros(),
                "bridged event waits released"
            );
        }
        self.missed(&missed);
    }
}

fn run(shared: Weak<Shared>) {
    let mut last_look = Instant::now();
    loop {
        let Some(s) = shared.upgrade() else {
            return;
        };
        {
            let state = lock(&s.state);
            if state.pending_count() == 0 {
                drop(s.wake.wait_timeout(state, IDLE));
                continue;
            }
        }
        let look = last_look.elapsed() >= LOOK;
        if look {
            last_look = Instant::now();
        }
        s.poll(look);
        drop(s);
        std::thread::sleep(POLL);
    }
}

/// A backend's bridges (see the module docs).
pub(crate) struct Bridge {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge")
            .field("pending", &lock(&self.shared.state).pending_count())
            .finish()
    }
}

impl Bridge {
    /// Bridges of a backend on `ctx`; `ops` if the device has 64-bit stream memory
    /// operations (else every wait is made on the host); `side` for the slab's first fill.
    pub(crate) fn new(
        ctx: &SharedContext,
        ops: Option<StreamMemOps>,
        side: SharedStream,
        deadline: Duration,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                ctx: Arc::clone(ctx),
                ops,
                side,
                deadline,
                state: Mutex::new(Bridges::new(BRIDGE_SLOTS, deadline)),
                wake: Condvar::new(),
                hooks: Mutex::new(Vec::new()),
                made: OnceLock::new(),
                started: OnceLock::new(),
            }),
        }
    }

    fn made(&self) -> Result<Option<&Made>> {
        let Some(ops) = self.shared.ops else {
            return Ok(None);
        };
        if let Some(m) = self.shared.made.get() {
            return Ok(Some(m));
        }
        let keep = KeepCurrent::new()?;
        let stream = self
            .shared
            .ctx
            .new_stream()
            .map_err(result::from_driver("cuStreamCreate"))?;
        drop(keep);
        let slab = CounterSlab::new(
            &self.shared.ctx,
            BRIDGE_SLOTS as usize,
            (0, 0),
            ops,
            Arc::clone(&self.shared.side),
        )?;
        // A stream may still wait on a slot when the backend goes: the slab is never freed
        // (8 KiB per backend that ever bridged).
        slab.keep_for_peers();
        // Another thread may have made one meanwhile: then ours is dropped unused.
        let _ = self.shared.made.set(Made {
            slab,
            stream: Arc::new(Quiet::new(stream)),
        });
        if self.shared.started.set(()).is_ok() {
            let weak = Arc::downgrade(&self.shared);
            std::thread::Builder::new()
                .name("baton-event-bridge".into())
                .spawn(move || run(weak))
                .map_err(Error::io("spawning the event bridge thread"))?;
        }
        Ok(self.shared.made.get())
    }

    /// Makes `stream` wait for `event`, `producer`'s, without ever waiting on the event
    /// itself (see the module docs).
    ///
    /// # Errors
    /// [`Error::Cuda`] from the driver calls.
    pub(crate) fn wait(
        &self,
        producer: &ProcessId,
        event: &Arc<OpenedEvent>,
        stream: &CudaStream,
    ) -> Result<()> {
        if lock(&self.shared.state).is_released(producer) || event.is_complete()? {
            tracing::trace!(%producer, "an event wait needs no bridge");
            return Ok(());
        }
        if liveness(producer) == Liveness::Dead {
            // Its work died with it.
            return Ok(());
        }
        let Some(made) = self.made()? else {
            return self.wait_here(producer, event);
        };
        let opened = {
            let mut state = lock(&self.shared.state);
            if state.is_released(producer) {
                // Cut meanwhile.
                return Ok(());
            }
            state.open(*producer, Arc::clone(event), Instant::now())
        };
        let Some(write) = opened else {
            tracing::debug!(
                slots = BRIDGE_SLOTS,
                "every bridge slot carries a wait: this one is made on the host"
            );
            return self.wait_here(producer, event);
        };
        if let Err(e) = made
            .slab
            .wait(u64::from(write.slot) * 8, write.value, stream)
        {
            // Nothing waits on it: write the value so the slot is free again in order.
            let released = lock(&self.shared.state).landed(&[write.slot]);
            self.shared.write(&released);
            return Err(e);
        }
        tracing::trace!(%producer, slot = write.slot, value = write.value, "bridged an event wait");
        self.shared.wake.notify_one();
        Ok(())
    }

    /// The host form: polls the event until it completes, its producer dies or is cut, or
    /// the deadline passes (the producer is then missed).
    fn wait_here(&self, producer: &ProcessId, event: &OpenedEvent) -> Result<()> {
        let start = Instant::now();
        let mut last_look = start;
        let named = event.named();
        loop {
            if event.named() != named
                || event.is_complete()?
                || lock(&self.shared.state).is_released(producer)
            {
                return Ok(());
            }
            if last_look.elapsed() >= LOOK {
                last_look = Instant::now();
                if liveness(producer) == Liveness::Dead {
                    return Ok(());
                }
                if start.elapsed() >= self.shared.deadline {
                    drop(lock(&self.shared.state).cut(producer));
                    self.shared.missed(&[*producer]);
                    return Ok(());
                }
            }
            std::thread::sleep(POLL);
        }
    }

    /// `producer` named the event with `handle` in a fence again: our waits on its older
    /// records are released ([`Bridges::renamed`]).
    pub(crate) fn renamed(&self, producer: &ProcessId, handle: &[u8; 64]) {
        let writes = lock(&self.shared.state).renamed(producer, |e| e.handle() == handle);
        if !writes.is_empty() {
            tracing::trace!(%producer, released = writes.len(), "an event named again released our waits on it");
        }
        self.shared.write(&writes);
    }

    /// `producer` is dead: our waits on its events are released.
    pub(crate) fn died(&self, producer: &ProcessId) {
        let writes = lock(&self.shared.state).died(producer);
        self.shared.write(&writes);
    }

    /// `producer` is cut while it may live: our waits on its events are released, and no
    /// new one is queued.
    pub(crate) fn cut(&self, producer: &ProcessId) {
        let writes = lock(&self.shared.state).cut(producer);
        self.shared.write(&writes);
    }

    /// Whether memory guarded by `producer`'s event fences must be kept: our waits on them
    /// were released while it lives.
    pub(crate) fn unsafe_to_free(&self, producer: &ProcessId) -> bool {
        lock(&self.shared.state).unsafe_to_free(producer) && liveness(producer) != Liveness::Dead
    }

    pub(crate) fn add_hook(&self, hook: FenceFaultHook) {
        lock(&self.shared.hooks).push(hook);
    }
}

impl Drop for Bridge {
    /// Releases every pending wait: no stream of ours is left waiting on a slot nobody
    /// will write.
    fn drop(&mut self) {
        let writes = lock(&self.shared.state).drain();
        self.shared.write(&writes);
        self.shared.wake.notify_one();
    }
}
