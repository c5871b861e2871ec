//! A recording test backend: GPU-like memory on a simulated device, so that the order of
//! fence operations can be proven without a GPU.
//!
//! - Memory is bytes; every read, write and fill is a copy queued on the backend's own
//!   stream, then a synchronise of it — as the CUDA backend does.
//! - Streams are queues of operations that the simulated device runs in order: an
//!   operation runs only when those before it on its stream have run, a wait only once the
//!   record it waits for has run, and *work* (a stand-in for a kernel) only once the test
//!   opens its gate. Work may write memory when it runs, so a late write shows.
//! - Fences are interprocess events by default: a record is an operation; a wait names the
//!   event's latest record at the time it is queued, as `cuStreamWaitEvent` does.
//! - In counter mode ([`SimBackend::with_counters`]) fences are counters, as the CUDA
//!   backend's (`ipc/src/cuda/inbox.rs`): each backend owns a *fence inbox* (64-bit words on
//!   the simulated device) laid out like the CUDA slab (local marks, a lend area, then one
//!   lane of `R` slots per peer process, managed by the real `baton_ipc::inbox::Lanes`); a
//!   fence for a peer is a `WriteValue` into the peer's inbox lane (slot = release stream)
//!   queued on a release stream after the marks, with a local twin in its own inbox (written
//!   on that release stream only when the twin is read or waited on); a wait
//!   is a `WaitValue` on the waiter's own inbox, which runs once the word holds at least the
//!   value. A `watch` step (called by the test, with simulated time: [`Device::advance`])
//!   reads the inbox back into `Lanes::observe`, writes the release value into released lanes and
//!   calls the fence fault hooks.
//! - A fence for a peer that lent us no lane we can use — none, an ambiguous one, or one
//!   forgotten at its death — is an interprocess event recorded on the release stream (as
//!   `CudaBackend::fence_on`'s fallback): nothing blocks, and the consumer waits on it like
//!   any event. A peer's lane is ambiguous (as `PeerInbox::Ambiguous`) when one backend
//!   gets two different grants from one process, or when another backend of this process
//!   claimed that lane first. The claims are process-wide in the CUDA backend (`claimed()`
//!   in `ipc/src/cuda/inbox.rs`, outliving their backend); here they are the [`Device`]'s,
//!   shared by the backends of a test (one process), and dropped when a backend forgets a
//!   dead peer.
//! - Liveness is simulated per role ([`Device::kill`]): a dead role's queued operations are
//!   dropped (its queued work died with it) and it queues nothing more; waits on its events'
//!   dropped records pass (`docs/ORDERING.md`: an event wait is resolved by the peer's
//!   context being torn down when it dies); a role's writes into its peers' inboxes can be
//!   held forever ([`Device::hold_writes`]: a producer that does not deliver). Every
//!   process id a backend sees is the test process's own (all roles live in one process),
//!   so a backend resolves a process id to the role whose inbox grant it accepted
//!   ([`SimBackend::set_peer_role`] for raw peers). The CUDA backend's special
//!   cases for its own process (a loopback link lends no lane; a fence from this process is
//!   waited on in its own slots) are not mirrored: here every role is a process of its own.
//! - Safety is checked as it happens: a free of an allocation while a live role still has
//!   queued work that uses it, and work that runs on freed memory, are recorded as
//!   [`Device::violations`]; a blocking wait on a thread marked with
//!   [`forbid_blocking_on_this_thread`] (an actor thread) is recorded too (and not waited).
//! - Every driver-level call is logged, tagged with the backend's role (`exp`, `imp`), so
//!   tests assert on the order of records, waits, copies, opens, closes and frees.
//! - Opens can be made slow on purpose (a gate), and pool-like allocations share one
//!   descriptor, whose import can be made to fail once. A pool-like backend can retire its
//!   pool once no allocation of it is live ([`SimBackend::retire_idle_pools_at_once`]; the
//!   next allocation makes a fresh one), and an importer logs dropping its import.
//!
//! Both roles of a test live in one process and share one [`Device`].

#![allow(dead_code)]

use baton::ipc::inbox::{FenceRefusal, LaneStatus, Lanes, Observation, ReleaseRange};
use baton::ipc::{
    Allocation, Backend, CheckedHandle, DescriptorScope, Error, ExportableMemory, ExportedFence,
    FenceFaultHook, FreeWhileMapped, MemPtr, OpenedMem, RawMemory, Result, Stream, StreamKey,
    StreamOrdering, StreamRef, UseMark,
};
use baton::messages::{
    AllocationId, BackendKind, CounterFence, CudaIpcMemHandle, CudaPoolExportData, DeviceUuid,
    FenceHandle, InboxGrant, IpcEventHandle, ProcessId, RawHandle,
};
use std::any::Any;
use std::cell::Cell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `cuStreamWaitValue64`'s `GEQ`: a *cyclic* comparison, as the driver does it (so
/// `u64::MAX` satisfies no wait for a small value).
fn geq(word: u64, wanted: u64) -> bool {
    (word.wrapping_sub(wanted) as i64) >= 0
}

/// How long a host-side wait on the simulated device may take before the test fails.
pub const DEVICE_DEADLINE: Duration = Duration::from_secs(30);

/// The id the simulated device gives a backend's own stream: 1000 + the backend's number.
fn internal_stream(backend: u64) -> u64 {
    1000 + backend
}

/// The id of a backend's release stream (event mode).
fn release_stream(backend: u64) -> u64 {
    2000 + backend
}

/// The id of a backend's release stream `i` (counter mode).
fn counter_release_stream(backend: u64, i: u32) -> u64 {
    3000 + backend * 16 + u64::from(i)
}

/// Slots of the lend area of a counter-mode inbox (this process's own fences: unused by
/// the actor layer, kept for the layout).
const LEND: u32 = 1;

/// Stream slots (as `STREAM_SLOTS` in `ipc/src/cuda/ordering.rs`): streams that write
/// their fences themselves (`export_fence_on`), after the release streams' slots.
const STREAM_SLOTS: u32 = 4;

thread_local! {
    static NO_BLOCKING: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as one that must never block on the device (an actix arbiter
/// thread): a blocking wait there that has to wait is recorded as a violation, and returns
/// at once (so that the test reports it rather than hangs: the gate it waits for may be
/// opened by this very thread).
pub fn forbid_blocking_on_this_thread() {
    NO_BLOCKING.with(|b| b.set(true));
}

enum Op {
    /// Runs once its gate is open; writes `write` then.
    Work {
        name: String,
        gate: String,
        write: Option<(u64, usize, Vec<u8>)>,
    },
    Record {
        event: u64,
    },
    Wait {
        event: u64,
        on: Option<u64>,
    },
    CopyIn {
        alloc: u64,
        offset: usize,
        bytes: Vec<u8>,
    },
    CopyOut {
        alloc: u64,
        offset: usize,
        len: usize,
        out: Arc<Mutex<Option<Vec<u8>>>>,
    },
    /// `cuStreamWriteValue64`: sets a word of an inbox (`inbox` is its backend's number).
    /// A write into a peer's inbox (`peer`) by a role whose writes are held never runs.
    WriteValue {
        inbox: u64,
        slot: u32,
        value: u64,
        writer: String,
        peer: bool,
    },
    /// `cuStreamWaitValue64` (`GEQ`): runs once the word holds at least `value`.
    WaitValue {
        inbox: u64,
        slot: u32,
        value: u64,
    },
}

impl Op {
    /// The allocation the operation reads or writes, if any.
    fn uses(&self) -> Option<u64> {
        match self {
            Op::Work {
                write: Some((a, ..)),
                ..
            }
            | Op::CopyIn { alloc: a, .. }
            | Op::CopyOut { alloc: a, .. } => Some(*a),
            _ => None,
        }
    }
}

#[derive(Default)]
struct DeviceState {
    streams: HashMap<u64, VecDeque<(u64, Op)>>,
    next_op: u64,
    /// Operations that have run.
    done: HashSet<u64>,
    /// Each event's latest record (an operation id).
    events: HashMap<u64, u64>,
    next_event: u64,
    open_gates: HashSet<String>,
    memory: HashMap<u64, Vec<u8>>,
    next_alloc: u64,
    log: Vec<String>,
    /// Counter-mode inboxes, by backend number.
    inboxes: HashMap<u64, Vec<u64>>,
    /// Each backend's role, by number.
    roles: HashMap<u64, String>,
    /// The role each stream belongs to (the first that queued on it).
    owners: HashMap<u64, String>,
    /// The first lane slot of each inbox: slots below it are the backend's own (local
    /// marks, lend area), waited on for its own work only.
    lane_areas: HashMap<u64, u32>,
    /// Roles whose process is dead.
    dead: HashSet<String>,
    /// Roles whose writes into peers' inboxes never run.
    held: HashSet<String>,
    /// Simulated time since the device was made.
    clock: Duration,
    /// Each stream's head operation and the simulated time it became the head.
    heads: HashMap<u64, (u64, Duration)>,
    /// Allocations freed.
    freed: HashSet<u64>,
    /// Broken safety rules, as they happened.
    violations: Vec<String>,
    /// Lanes of peers' inboxes claimed by a backend of this (test) process, by (owner,
    /// inbox, first slot): the backend's number (as `claimed()` in
    /// `ipc/src/cuda/inbox.rs`, process-wide there).
    claimed: HashMap<(ProcessId, u64, u32), u64>,
}

impl DeviceState {
    fn word(&self, inbox: u64, slot: u32) -> u64 {
        self.inboxes
            .get(&inbox)
            .and_then(|w| w.get(slot as usize))
            .copied()
            .unwrap_or(0)
    }

    fn is_dead(&self, role: &str) -> bool {
        self.dead.contains(role)
    }

    fn ready(&self, op: &Op) -> bool {
        match op {
            Op::Work { gate, .. } => self.open_gates.contains(gate),
            Op::Wait { on, .. } => on.is_none_or(|o| self.done.contains(&o)),
            Op::WriteValue { writer, peer, .. } => !(*peer && self.held.contains(writer)),
            Op::WaitValue { inbox, slot, value } => geq(self.word(*inbox, *slot), *value),
            _ => true,
        }
    }

    /// Runs every operation that can run, in stream order.
    fn pump(&mut self) {
        loop {
            let mut progress = false;
            let ids: Vec<u64> = self.streams.keys().copied().collect();
            for s in ids {
                loop {
                    let ready = match self.streams.get(&s).and_then(|q| q.front()) {
                        None => false,
                        Some((_, op)) => self.ready(op),
                    };
                    if !ready {
                        break;
                    }
                    let (id, op) = self
                        .streams
                        .get_mut(&s)
                        .expect("listed")
                        .pop_front()
                        .expect("ready");
                    if let Some(alloc) = op.uses().filter(|a| self.freed.contains(a)) {
                        let owner = self.owners.get(&s).cloned().unwrap_or_default();
                        self.violations.push(format!(
                            "work of {owner} on s{s} used a{alloc} after it was freed"
                        ));
                    }
                    match op {
                        Op::Work { name, write, .. } => {
                            if let Some((alloc, offset, bytes)) = write {
                                let mem = self.memory.get_mut(&alloc).expect("live memory");
                                mem[offset..offset + bytes.len()].copy_from_slice(&bytes);
                            }
                            self.log.push(format!("ran work {name} on s{s}"));
                        }
                        Op::CopyIn {
                            alloc,
                            offset,
                            bytes,
                        } => {
                            let mem = self.memory.get_mut(&alloc).expect("live memory");
                            mem[offset..offset + bytes.len()].copy_from_slice(&bytes);
                        }
                        Op::CopyOut {
                            alloc,
                            offset,
                            len,
                            out,
                        } => {
                            let mem = &self.memory[&alloc];
                            *out.lock().unwrap() = Some(mem[offset..offset + len].to_vec());
                        }
                        Op::WriteValue {
                            inbox, slot, value, ..
                        } => {
                            if let Some(w) = self
                                .inboxes
                                .get_mut(&inbox)
                                .and_then(|w| w.get_mut(slot as usize))
                            {
                                *w = value;
                            }
                        }
                        Op::Record { .. } | Op::Wait { .. } | Op::WaitValue { .. } => {}
                    }
                    self.done.insert(id);
                    progress = true;
                }
            }
            if !progress {
                break;
            }
        }
        let now = self.clock;
        for (s, q) in &self.streams {
            match q.front() {
                Some((id, _)) => {
                    if self.heads.get(s).is_none_or(|(h, _)| h != id) {
                        self.heads.insert(*s, (*id, now));
                    }
                }
                None => {
                    self.heads.remove(s);
                }
            }
        }
    }
}

/// The simulated device and its log, shared by the backends of a test.
pub struct Device {
    state: Mutex<DeviceState>,
    changed: Condvar,
    next_backend: AtomicU64,
    base: Instant,
    deadline: Duration,
    /// How many of the next waits on a use mark fail (a driver error).
    failing_mark_waits: AtomicUsize,
}

impl Default for Device {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            changed: Condvar::new(),
            next_backend: AtomicU64::new(0),
            base: Instant::now(),
            deadline: DEVICE_DEADLINE,
            failing_mark_waits: AtomicUsize::new(0),
        }
    }
}

impl Device {
    /// The next `n` waits on a use mark (`cuStreamWaitEvent`) fail, as a driver error.
    pub fn fail_mark_waits(&self, n: usize) {
        self.failing_mark_waits.store(n, Ordering::SeqCst);
    }

    pub fn new() -> Arc<Device> {
        Arc::new(Device::default())
    }

    /// A device whose host-side waits fail the test after `deadline` (instead of
    /// [`DEVICE_DEADLINE`]).
    pub fn with_deadline(deadline: Duration) -> Arc<Device> {
        Arc::new(Device {
            deadline,
            ..Device::default()
        })
    }

    fn lock(&self) -> MutexGuard<'_, DeviceState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn note(&self, line: String) {
        self.lock().log.push(line);
        self.changed.notify_all();
    }

    /// Queues `op` on stream `s`, logged as `line`; returns its id.
    fn enqueue(&self, s: u64, op: Op, line: Option<String>) -> u64 {
        self.enqueue_as(None, s, op, line)
    }

    /// As [`enqueue`](Self::enqueue), on behalf of `role`, which owns the stream if nobody
    /// did. Operations on a dead role's streams are dropped.
    fn enqueue_as(&self, role: Option<&str>, s: u64, op: Op, line: Option<String>) -> u64 {
        let mut state = self.lock();
        state.next_op += 1;
        let id = state.next_op;
        if let Some(role) = role {
            state.owners.entry(s).or_insert_with(|| role.to_owned());
        }
        let owner = state.owners.get(&s).cloned();
        if owner.as_deref().is_some_and(|o| state.is_dead(o)) {
            if let Some(line) = line {
                state.log.push(format!("dropped (dead): {line}"));
            }
            return id;
        }
        if let Some(line) = line {
            state.log.push(line);
        }
        if let Op::Record { event } = &op {
            state.events.insert(*event, id);
        }
        state.streams.entry(s).or_default().push_back((id, op));
        state.pump();
        drop(state);
        self.changed.notify_all();
        id
    }

    /// Blocks until `cond` holds of the device state (pumping as gates open). A dead
    /// `who` never waits (its process is gone).
    fn block_until(&self, who: Option<&str>, what: &str, cond: impl FnMut(&DeviceState) -> bool) {
        let done = self.block_within(who, what, self.deadline, cond);
        assert!(done, "the simulated device never got to {what}");
    }

    /// As [`block_until`](Self::block_until), giving up after `within`; returns whether
    /// `cond` came to hold.
    fn block_within(
        &self,
        who: Option<&str>,
        what: &str,
        within: Duration,
        mut cond: impl FnMut(&DeviceState) -> bool,
    ) -> bool {
        let start = Instant::now();
        let mut state = self.lock();
        let mut first = true;
        loop {
            state.pump();
            if cond(&state) || who.is_some_and(|w| state.is_dead(w)) {
                return true;
            }
            if first && NO_BLOCKING.with(Cell::get) {
                // Recorded, and not waited for: the test fails on the violation instead of
                // hanging (the thread that would open the gate may be this one).
                let line = format!(
                    "{} blocked on an actor thread waiting for {what}",
                    who.unwrap_or("someone")
                );
                state.violations.push(line);
                return true;
            }
            first = false;
            let left = within.saturating_sub(start.elapsed());
            if left.is_zero() {
                return false;
            }
            state = self
                .changed
                .wait_timeout(state, left.min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn synchronize(&self, s: u64) {
        self.synchronize_as(None, s);
    }

    fn synchronize_as(&self, who: Option<&str>, s: u64) {
        self.block_until(who, &format!("the end of stream {s}"), |st| {
            st.streams.get(&s).is_none_or(VecDeque::is_empty)
        });
    }

    /// Blocks, at most `within`, until stream `s` has run everything queued on it (a host
    /// synchronise, as `cudaStreamSynchronize`); returns whether it has.
    pub fn try_synchronize(&self, s: u64, within: Duration) -> bool {
        self.block_within(None, &format!("the end of stream {s}"), within, |st| {
            st.streams.get(&s).is_none_or(VecDeque::is_empty)
        })
    }

    /// Whether stream `s` has nothing left to run.
    pub fn idle(&self, s: u64) -> bool {
        let mut st = self.lock();
        st.pump();
        st.streams.get(&s).is_none_or(VecDeque::is_empty)
    }

    fn new_event(&self) -> u64 {
        let mut state = self.lock();
        state.next_event += 1;
        state.next_event
    }

    fn latest(&self, event: u64) -> Option<u64> {
        self.lock().events.get(&event).copied()
    }

    fn complete(&self, event: u64) -> bool {
        let state = self.lock();
        state
            .events
            .get(&event)
            .is_none_or(|r| state.done.contains(r))
    }

    /// The role part of a log tag ("exp mark" → "exp").
    fn role_of(who: &str) -> &str {
        who.split(' ').next().unwrap_or(who)
    }

    fn record(&self, who: &str, event: u64, s: u64) {
        self.enqueue_as(
            Some(Self::role_of(who)),
            s,
            Op::Record { event },
            Some(format!("{who} record e{event} on s{s}")),
        );
    }

    fn wait(&self, who: &str, event: u64, s: u64) {
        let on = self.latest(event);
        self.enqueue_as(
            Some(Self::role_of(who)),
            s,
            Op::Wait { event, on },
            Some(format!("{who} wait e{event} on s{s}")),
        );
    }

    /// Queues work named `name` on stream `s`, which runs once gate `gate` opens and then
    /// writes `write` (an allocation of this device, an offset and bytes) if given.
    pub fn work(&self, s: u64, name: &str, gate: &str, write: Option<(u64, usize, Vec<u8>)>) {
        self.work_as(None, s, name, gate, write);
    }

    /// As [`work`](Self::work), queued by `role` (which owns the stream from then on): work
    /// of a process that has no backend here (a raw peer).
    pub fn work_by(
        &self,
        role: &str,
        s: u64,
        name: &str,
        gate: &str,
        write: Option<(u64, usize, Vec<u8>)>,
    ) {
        self.work_as(Some(role), s, name, gate, write);
    }

    fn work_as(
        &self,
        role: Option<&str>,
        s: u64,
        name: &str,
        gate: &str,
        write: Option<(u64, usize, Vec<u8>)>,
    ) {
        self.enqueue_as(
            role,
            s,
            Op::Work {
                name: name.to_owned(),
                gate: gate.to_owned(),
                write,
            },
            Some(format!("queued work {name} on s{s}")),
        );
    }

    /// Opens a gate: the work waiting behind it runs.
    pub fn open_gate(&self, gate: &str) {
        let mut state = self.lock();
        state.open_gates.insert(gate.to_owned());
        state.log.push(format!("opened gate {gate}"));
        state.pump();
        drop(state);
        self.changed.notify_all();
    }

    /// Whether work `name` has run.
    pub fn ran(&self, name: &str) -> bool {
        let line = format!("ran work {name} on ");
        self.lock().log.iter().any(|l| l.starts_with(&line))
    }

    /// The bytes of an allocation now (not through a stream: what the device holds).
    pub fn bytes(&self, alloc: u64) -> Vec<u8> {
        self.lock().memory[&alloc].clone()
    }

    /// The log so far.
    pub fn log(&self) -> Vec<String> {
        self.lock().log.clone()
    }

    /// The index of the first log line that starts with `prefix`, if any.
    pub fn position(&self, prefix: &str) -> Option<usize> {
        self.lock().log.iter().position(|l| l.starts_with(prefix))
    }

    /// The number of log lines so far.
    pub fn log_len(&self) -> usize {
        self.lock().log.len()
    }

    /// The log lines from index `from` on that start with `prefix`.
    pub fn count_from(&self, from: usize, prefix: &str) -> usize {
        self.lock().log[from..]
            .iter()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    /// Waits (polling, with a deadline) until a log line starting with `prefix` appears;
    /// returns its index. For tests on an async runtime.
    pub async fn logged(&self, prefix: &str) -> usize {
        self.logged_from(0, prefix).await
    }

    /// As [`logged`](Self::logged), for lines from index `from` on.
    pub async fn logged_from(&self, from: usize, prefix: &str) -> usize {
        let start = Instant::now();
        loop {
            let found = self.lock().log[from..]
                .iter()
                .position(|l| l.starts_with(prefix))
                .map(|i| i + from);
            if let Some(i) = found {
                return i;
            }
            assert!(
                start.elapsed() < self.deadline,
                "no log line starting with {prefix:?}:\n{}",
                self.log().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    // ---- simulated time, liveness and safety (counter mode) ----

    /// The simulated clock now: real time at the device's making, plus every
    /// [`advance`](Self::advance).
    pub fn now(&self) -> Instant {
        self.base + self.lock().clock
    }

    /// Moves the simulated clock on.
    pub fn advance(&self, by: Duration) {
        let mut st = self.lock();
        st.clock += by;
        st.pump();
    }

    /// `role`'s process dies: its queued operations are dropped (its queued work died with
    /// it), nothing more it queues runs, and its own host waits return at once.
    pub fn kill(&self, role: &str) {
        let mut st = self.lock();
        st.dead.insert(role.to_owned());
        let streams: Vec<u64> = st
            .owners
            .iter()
            .filter(|(_, o)| o.as_str() == role)
            .map(|(s, _)| *s)
            .collect();
        let mut dropped = 0;
        let mut records = Vec::new();
        for s in streams {
            if let Some(q) = st.streams.get_mut(&s) {
                dropped += q.len();
                records.extend(
                    q.drain(..)
                        .filter_map(|(id, op)| matches!(op, Op::Record { .. }).then_some(id)),
                );
            }
        }
        // Its context is torn down: waits of other roles on its events pass.
        st.done.extend(records);
        st.log.push(format!(
            "killed {role} ({dropped} queued operations dropped)"
        ));
        st.pump();
        drop(st);
        self.changed.notify_all();
    }

    /// Whether `role` was killed.
    pub fn is_dead(&self, role: &str) -> bool {
        self.lock().is_dead(role)
    }

    /// `role`'s writes into its peers' inboxes never run from now on (held forever: a
    /// producer that does not deliver), until [`deliver`](Self::deliver).
    pub fn hold_writes(&self, role: &str) {
        let mut st = self.lock();
        st.held.insert(role.to_owned());
        st.log.push(format!("holding {role}'s writes"));
    }

    /// `role`'s held writes run again.
    pub fn deliver(&self, role: &str) {
        let mut st = self.lock();
        st.held.remove(role);
        st.log.push(format!("delivering {role}'s writes"));
        st.pump();
        drop(st);
        self.changed.notify_all();
    }

    /// Word `slot` of backend `inbox`'s fence inbox.
    pub fn inbox_word(&self, inbox: u64, slot: u32) -> u64 {
        self.lock().word(inbox, slot)
    }

    /// Writes word `slot` of backend `inbox`'s fence inbox now (a peer's write landing).
    pub fn write_inbox(&self, inbox: u64, slot: u32, value: u64) {
        let mut st = self.lock();
        if let Some(w) = st
            .inboxes
            .get_mut(&inbox)
            .and_then(|w| w.get_mut(slot as usize))
        {
            *w = value;
        }
        st.pump();
        drop(st);
        self.changed.notify_all();
    }

    /// Waits of live roles' streams on a peer's value (a lane slot of their inbox) that have
    /// been the head of their stream, unsatisfied, for longer than `longer_than` of
    /// simulated time.
    pub fn stuck_waits(&self, longer_than: Duration) -> Vec<String> {
        let mut st = self.lock();
        st.pump();
        let mut out = Vec::new();
        for (s, q) in &st.streams {
            let Some((id, Op::WaitValue { inbox, slot, value })) = q.front() else {
                continue;
            };
            let owner = st.owners.get(s).cloned().unwrap_or_default();
            let own = st.lane_areas.get(inbox).is_some_and(|first| slot < first);
            if own || st.is_dead(&owner) || geq(st.word(*inbox, *slot), *value) {
                continue;
            }
            let since = match st.heads.get(s) {
                Some((h, at)) if h == id => *at,
                _ => st.clock,
            };
            let waited = st.clock.saturating_sub(since);
            if waited > longer_than {
                out.push(format!(
                    "s{s} of {owner} has waited {waited:?} for slot {slot} >= {value} (it holds {})",
                    st.word(*inbox, *slot)
                ));
            }
        }
        out
    }

    /// Broken safety rules so far.
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// Whether allocation `alloc` was freed.
    pub fn freed(&self, alloc: u64) -> bool {
        self.lock().freed.contains(&alloc)
    }

    /// Queued (not yet run) operations of live roles that use `alloc`.
    pub fn queued_uses(&self, alloc: u64) -> usize {
        let st = self.lock();
        st.streams
            .iter()
            .filter(|(s, _)| st.owners.get(*s).is_none_or(|o| !st.is_dead(o)))
            .flat_map(|(_, q)| q.iter())
            .filter(|(_, op)| op.uses() == Some(alloc))
            .count()
    }

    /// A free of `alloc` by `role`: recorded, and checked against the work still queued.
    fn free(&self, role: &str, alloc: u64) {
        let mut st = self.lock();
        let mut broken = Vec::new();
        // A dead exporter frees nothing: the driver keeps its memory while importers map it.
        let streams = if st.is_dead(role) {
            Vec::new()
        } else {
            st.streams.iter().collect()
        };
        for (s, q) in streams {
            let owner = st.owners.get(s).cloned().unwrap_or_default();
            if st.is_dead(&owner) {
                continue;
            }
            for (_, op) in q {
                if op.uses() == Some(alloc) {
                    let what = match op {
                        Op::Work { name, .. } => format!("work {name}"),
                        _ => "a copy".to_owned(),
                    };
                    broken.push(format!(
                        "a{alloc} freed by {role} while {what} of live {owner} on s{s} may still use it"
                    ));
                }
            }
        }
        st.violations.extend(broken);
        st.freed.insert(alloc);
        st.log.push(format!("{role} free a{alloc}"));
        drop(st);
        self.changed.notify_all();
    }
}

/// The allocation id of simulated memory at `ptr` (its fake device address).
pub fn alloc_of(ptr: MemPtr) -> u64 {
    match ptr {
        MemPtr::Device(p) => p >> 32,
        MemPtr::Host(_) => panic!("simulated memory is device memory"),
    }
}

fn encode_event(event: u64) -> FenceHandle {
    let mut bytes = [0u8; 64];
    bytes[..8].copy_from_slice(b"simevent");
    bytes[8..16].copy_from_slice(&event.to_le_bytes());
    FenceHandle::Event(IpcEventHandle(bytes))
}

fn decode_event(fence: &FenceHandle) -> Result<u64> {
    match fence {
        FenceHandle::Event(h) if &h.0[..8] == b"simevent" => {
            Ok(u64::from_le_bytes(h.0[8..16].try_into().expect("8 bytes")))
        }
        _ => Err(Error::UnsupportedBackend {
            kind: BackendKind::CudaLegacy,
        }),
    }
}

fn encode_alloc(alloc: u64) -> [u8; 64] {
    let mut bytes = [0u8; 64];
    bytes[..8].copy_from_slice(b"simalloc");
    bytes[8..16].copy_from_slice(&alloc.to_le_bytes());
    bytes
}

fn decode_alloc(bytes: &[u8; 64]) -> u64 {
    u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"))
}

/// The (simulated) IPC handle of backend `number`'s fence inbox.
pub fn inbox_handle(number: u64) -> CudaIpcMemHandle {
    let mut bytes = [0u8; 64];
    bytes[..8].copy_from_slice(b"siminbox");
    bytes[8..16].copy_from_slice(&number.to_le_bytes());
    CudaIpcMemHandle(bytes)
}

/// A use mark: an event recorded on its stream.
#[derive(Debug)]
struct SimMark {
    device: Arc<SimRef>,
    event: u64,
    stream: StreamKey,
}

/// What marks and memory need of their backend.
struct SimRef {
    device: Arc<Device>,
    role: String,
    number: u64,
}

impl std::fmt::Debug for SimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimRef({})", self.role)
    }
}

impl SimRef {
    fn stream(&self, stream: StreamRef<'_>) -> Result<u64> {
        match stream {
            StreamRef::Internal => Ok(internal_stream(self.number)),
            StreamRef::Id(n) => Ok(n),
            StreamRef::Cuda(_) => Err(Error::UnsupportedBackend {
                kind: BackendKind::CudaLegacy,
            }),
        }
    }
}

impl UseMark for SimMark {
    fn stream(&self) -> StreamKey {
        self.stream
    }
    fn record(&self, stream: StreamRef<'_>) -> Result<()> {
        let s = self.device.stream(stream)?;
        self.device
            .device
            .record(&format!("{} mark", self.device.role), self.event, s);
        Ok(())
    }
    fn order(&self, stream: StreamRef<'_>) -> Result<()> {
        let s = self.device.stream(stream)?;
        let failing = &self.device.device.failing_mark_waits;
        if failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.device.device.note(format!(
                "{} mark wait on s{s} failed (simulated)",
                self.device.role
            ));
            return Err(Error::Io {
                op: "cuStreamWaitEvent (simulated failure)",
                source: std::io::Error::other("simulated driver error"),
            });
        }
        self.device
            .device
            .wait(&format!("{} mark", self.device.role), self.event, s);
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        let event = self.event;
        self.device
            .device
            .block_until(Some(&self.device.role), "a mark", |st| {
                st.events.get(&event).is_none_or(|r| st.done.contains(r))
            });
        Ok(())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An interprocess fence: an event recorded on a release stream.
struct SimFence {
    device: Arc<Device>,
    role: String,
    event: u64,
}

impl std::fmt::Debug for SimFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimFence(e{})", self.event)
    }
}

impl ExportedFence for SimFence {
    fn handle(&self) -> FenceHandle {
        encode_event(self.event)
    }
    fn is_complete(&self) -> Result<bool> {
        Ok(self.device.complete(self.event))
    }
    fn synchronize(&self) -> Result<()> {
        let event = self.event;
        self.device.block_until(Some(&self.role), "a fence", |st| {
            st.events.get(&event).is_none_or(|r| st.done.contains(r))
        });
        Ok(())
    }
}

/// A counter fence recorded for a peer: a value written into the peer's inbox, and its
/// local twin in ours (what we wait on to know our own work has run).
struct SimCounterFence {
    device: Arc<Device>,
    role: String,
    handle: CounterFence,
    local: CounterFence,
    own: u64,
    /// Where `local` is written when read or waited on.
    twins: Arc<SimTwins>,
    live: Arc<AtomicUsize>,
}

impl std::fmt::Debug for SimCounterFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SimCounterFence(inbox{} @{} = {})",
            self.handle.slab_id, self.handle.offset, self.handle.value
        )
    }
}

impl Drop for SimCounterFence {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ExportedFence for SimCounterFence {
    fn handle(&self) -> FenceHandle {
        FenceHandle::Counter(self.handle)
    }
    fn local_handle(&self) -> FenceHandle {
        FenceHandle::Counter(self.local)
    }
    fn is_complete(&self) -> Result<bool> {
        self.twins.settle(self.local.offset / 8, self.local.value);
        Ok(self
            .device
            .inbox_word(self.own, (self.local.offset / 8) as u32)
            >= self.local.value)
    }
    fn synchronize(&self) -> Result<()> {
        let (own, slot, value) = (self.own, (self.local.offset / 8) as u32, self.local.value);
        self.twins.settle(u64::from(slot), value);
        self.device
            .block_until(Some(&self.role), "a counter fence", |st| {
                geq(st.word(own, slot), value)
            });
        Ok(())
    }
}

/// Simulated memory: the exporter's (which frees it when dropped) or an importer's view.
#[derive(Debug)]
struct SimMem {
    sim: Arc<SimRef>,
    alloc: u64,
    size: usize,
    owner: bool,
    /// Pool-like: the pool it comes from (exporter side).
    pool: Option<Arc<SimPool>>,
}

/// A pool-like backend's pool: one descriptor for all its allocations.
#[derive(Debug)]
struct SimPool {
    id: u64,
    fd: OwnedFd,
    /// Live allocations, and whether it ever had one.
    live: AtomicUsize,
    used: AtomicBool,
}

impl SimPool {
    fn new(id: u64) -> Arc<SimPool> {
        let fd = rustix::fs::memfd_create("sim-pool", rustix::fs::MemfdFlags::CLOEXEC)
            .expect("memfd_create");
        Arc::new(SimPool {
            id,
            fd,
            live: AtomicUsize::new(0),
            used: AtomicBool::new(false),
        })
    }
}

impl SimMem {
    fn internal(&self) -> u64 {
        internal_stream(self.sim.number)
    }
}

impl RawMemory for SimMem {
    fn size(&self) -> usize {
        self.size
    }
    fn ptr(&self) -> MemPtr {
        MemPtr::Device(self.alloc << 32)
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let out = Arc::new(Mutex::new(None));
        let s = self.internal();
        self.sim.device.enqueue_as(
            Some(&self.sim.role),
            s,
            Op::CopyOut {
                alloc: self.alloc,
                offset,
                len: dst.len(),
                out: Arc::clone(&out),
            },
            Some(format!(
                "{} copy-out a{} on s{s}",
                self.sim.role, self.alloc
            )),
        );
        self.sim.device.synchronize_as(Some(&self.sim.role), s);
        match out.lock().unwrap().take() {
            Some(bytes) => dst.copy_from_slice(&bytes),
            // Only a dead role's copy never runs.
            None => dst.fill(0),
        }
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let s = self.internal();
        self.sim.device.enqueue_as(
            Some(&self.sim.role),
            s,
            Op::CopyIn {
                alloc: self.alloc,
                offset,
                bytes: src.to_vec(),
            },
            Some(format!("{} copy-in a{} on s{s}", self.sim.role, self.alloc)),
        );
        self.sim.device.note(format!("{} sync s{s}", self.sim.role));
        self.sim.device.synchronize_as(Some(&self.sim.role), s);
        Ok(())
    }
    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.write(offset, &vec![byte; len])
    }
}

impl ExportableMemory for SimMem {
    fn free_while_mapped(&self) -> FreeWhileMapped {
        FreeWhileMapped::Unsafe
    }
    fn raw_handle(&self, fd_slot: Option<u8>) -> Result<RawHandle> {
        Ok(match &self.pool {
            None => RawHandle::CudaIpc(CudaIpcMemHandle(encode_alloc(self.alloc))),
            Some(pool) => RawHandle::CudaPool {
                pool: pool.id,
                pool_slot: fd_slot,
                ptr: CudaPoolExportData(encode_alloc(self.alloc)),
            },
        })
    }
    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        self.pool.as_ref().map(|p| p.fd.as_fd())
    }
    fn descriptor_scope(&self) -> DescriptorScope {
        match &self.pool {
            Some(pool) => DescriptorScope::Pool(pool.id),
            None => DescriptorScope::Allocation,
        }
    }
}

impl Drop for SimMem {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.live.fetch_sub(1, Ordering::SeqCst);
        }
        if self.owner {
            self.sim.device.free(&self.sim.role, self.alloc);
        } else {
            self.sim
                .device
                .note(format!("{} close a{}", self.sim.role, self.alloc));
        }
    }
}

/// Counter-fence mode: how a backend's fence inbox is laid out, and the fence deadline
/// (simulated time: see [`Device::advance`]).
#[derive(Debug, Clone, Copy)]
pub struct CounterMode {
    /// Release streams, and so slots per lane (R).
    pub release_streams: u32,
    /// Lanes the inbox lends, one per peer process over the backend's life.
    pub lanes: u32,
    /// How long a producer may name values without progress.
    pub deadline: Duration,
}

impl Default for CounterMode {
    fn default() -> Self {
        Self {
            release_streams: 4,
            lanes: 8,
            deadline: Duration::from_secs(10),
        }
    }
}

/// A lane of a peer's inbox this backend writes its fences into.
#[derive(Debug)]
struct PeerLane {
    grant: InboxGrant,
    /// The last value taken per slot.
    values: Vec<u64>,
}

/// What a backend knows of a peer process's inbox (as `PeerInbox` in
/// `ipc/src/cuda/inbox.rs`).
#[derive(Debug)]
enum PeerInbox {
    /// One lane lent to us: our fences for it go there.
    Lane(PeerLane),
    /// Two different lanes from one process, or a lane another backend of this process
    /// claimed first: fences for that process are events.
    Ambiguous,
}

/// A backend's counter-fence state (mirrors `ipc/src/cuda/inbox.rs`).
struct CounterState {
    mode: CounterMode,
    lanes: Mutex<Lanes>,
    /// The local marks; one's lock is held while its release stream queues a fence.
    marks: Arc<SimTwins>,
    peers: Mutex<HashMap<ProcessId, PeerInbox>>,
    /// The stream each stream slot was last bound to, and where a claim starts looking.
    stream_slots: Mutex<([Option<u64>; STREAM_SLOTS as usize], usize)>,
    hooks: Mutex<Vec<FenceFaultHook>>,
    /// Which role each process id stands for (learned from the grants accepted).
    peer_roles: Mutex<HashMap<ProcessId, String>>,
    /// Accepts wait until this gate opens (a slow `cuIpcOpenMemHandle`).
    slow_accept: Mutex<Option<String>>,
    /// Counter fences of ours alive now.
    live: Arc<AtomicUsize>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A local mark's values (as `TwinState` in `ipc/src/cuda/fence.rs`).
#[derive(Default)]
struct SimTwin {
    written: u64,
    promised: u64,
    /// A stream slot's mark: the stream bound to it (else release stream `i` writes it).
    stream: Option<u64>,
}

/// A backend's local marks, slot `i` written by release stream `i` only when a twin is
/// read or waited on (as `CounterSlab::promise` and `settle`).
struct SimTwins {
    device: Arc<Device>,
    role: String,
    number: u64,
    slots: Vec<Mutex<SimTwin>>,
    /// Each slot's `written`, read without its lock.
    written: Vec<AtomicU64>,
}

impl SimTwins {
    fn len(&self) -> usize {
        self.slots.len()
    }

    fn lock(&self, i: u32) -> MutexGuard<'_, SimTwin> {
        lock(&self.slots[i as usize])
    }

    /// The twin of a fence release stream `i` just queued: promised, not written.
    fn promise(held: &mut SimTwin) -> u64 {
        if held.promised <= held.written {
            held.promised = held.written + 1;
        }
        held.promised
    }

    /// Queues the write of mark `slot`'s promised value on its release stream, unless one
    /// of at least `value` is queued already (nothing for other slots). No mark's lock
    /// held.
    fn settle(&self, slot: u64, value: u64) {
        let (Some(m), Some(written)) = (
            self.slots.get(slot as usize),
            self.written.get(slot as usize),
        ) else {
            return;
        };
        if written.load(Ordering::Acquire) >= value {
            return;
        }
        let mut t = lock(m);
        if t.written >= value || t.promised <= t.written {
            return;
        }
        let role = self.role.as_str();
        let s = t
            .stream
            .unwrap_or_else(|| counter_release_stream(self.number, slot as u32));
        self.device.enqueue_as(
            Some(role),
            s,
            Op::WriteValue {
                inbox: self.number,
                slot: slot as u32,
                value: t.promised,
                writer: role.to_owned(),
                peer: false,
            },
            Some(format!(
                "{role} write mark slot{slot} = {} on s{s}",
                t.promised
            )),
        );
        t.written = t.promised;
        written.store(t.written, Ordering::Release);
    }
}

/// The recording backend (see the module docs).
pub struct SimBackend {
    sim: Arc<SimRef>,
    /// Pool-like: its pool now (`None` until the first allocation and after a retirement).
    pool: Option<Mutex<Option<Arc<SimPool>>>>,
    /// The last pool id used.
    pool_ids: AtomicU64,
    /// Pool-like: retire the pool as soon as it has no live allocation.
    retire_idle: AtomicBool,
    /// Pools imported: exporter process, pool id.
    imported_pools: Mutex<HashSet<(ProcessId, u64)>>,
    fail_pool_import: AtomicBool,
    /// Opens wait until this gate opens (a deliberately slow driver call).
    slow_open: Mutex<Option<String>>,
    /// File descriptors the opens were given.
    pub fds_opened: AtomicU64,
    /// Counter mode, if on.
    counters: Option<CounterState>,
}

impl std::fmt::Debug for SimBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimBackend({})", self.sim.role)
    }
}

impl SimBackend {
    /// A backend called `role` in the log, allocating legacy-like memory.
    pub fn new(device: &Arc<Device>, role: &str) -> Arc<SimBackend> {
        Self::make(device, role, false, None)
    }

    /// As [`new`](Self::new), allocating pool-like memory: every allocation shares one
    /// descriptor (a memfd), shared once per link.
    pub fn pooled(device: &Arc<Device>, role: &str) -> Arc<SimBackend> {
        Self::make(device, role, true, None)
    }

    /// Pool-like: [`retire_idle_pools`](Backend::retire_idle_pools) retires the pool as
    /// soon as it has no live allocation (the CUDA backend waits `POOL_IDLE_RETIRE`), and
    /// logs `"{role} pool retired p{id}"`.
    pub fn retire_idle_pools_at_once(&self) {
        self.retire_idle.store(true, Ordering::SeqCst);
    }

    /// As [`new`](Self::new), with counter fences in fence inboxes (see the module docs).
    pub fn with_counters(device: &Arc<Device>, role: &str, mode: CounterMode) -> Arc<SimBackend> {
        Self::make(device, role, false, Some(mode))
    }

    fn make(
        device: &Arc<Device>,
        role: &str,
        pooled: bool,
        mode: Option<CounterMode>,
    ) -> Arc<SimBackend> {
        let number = device.next_backend.fetch_add(1, Ordering::Relaxed) + 1;
        let counters = mode.map(|mode| {
            let r = mode.release_streams.max(1) + STREAM_SLOTS;
            let words = (r + LEND + mode.lanes * r) as usize;
            let mut st = device.lock();
            st.inboxes.insert(number, vec![0; words]);
            st.lane_areas.insert(number, r + LEND);
            drop(st);
            CounterState {
                mode,
                lanes: Mutex::new(Lanes::new(r + LEND, mode.lanes, r, mode.deadline)),
                marks: Arc::new(SimTwins {
                    device: Arc::clone(device),
                    role: role.to_owned(),
                    number,
                    slots: (0..r).map(|_| Mutex::default()).collect(),
                    written: (0..r).map(|_| AtomicU64::new(0)).collect(),
                }),
                peers: Mutex::new(HashMap::new()),
                stream_slots: Mutex::new(([None; STREAM_SLOTS as usize], 0)),
                hooks: Mutex::new(Vec::new()),
                peer_roles: Mutex::new(HashMap::new()),
                slow_accept: Mutex::new(None),
                live: Arc::new(AtomicUsize::new(0)),
            }
        });
        device.lock().roles.insert(number, role.to_owned());
        Arc::new(SimBackend {
            sim: Arc::new(SimRef {
                device: Arc::clone(device),
                role: role.to_owned(),
                number,
            }),
            pool: pooled.then(|| Mutex::new(None)),
            pool_ids: AtomicU64::new(0),
            retire_idle: AtomicBool::new(false),
            imported_pools: Mutex::new(HashSet::new()),
            fail_pool_import: AtomicBool::new(false),
            slow_open: Mutex::new(None),
            fds_opened: AtomicU64::new(0),
            counters,
        })
    }

    /// The role.
    pub fn role(&self) -> &str {
        &self.sim.role
    }

    /// The backend's number (its inbox's id).
    pub fn number(&self) -> u64 {
        self.sim.number
    }

    /// The id of this backend's own stream.
    pub fn internal(&self) -> u64 {
        internal_stream(self.sim.number)
    }

    /// The id of this backend's release stream (event mode).
    pub fn release_stream(&self) -> u64 {
        release_stream(self.sim.number)
    }

    /// The id of release stream `i` (counter mode).
    pub fn counter_release_stream(&self, i: u32) -> u64 {
        counter_release_stream(self.sim.number, i)
    }

    /// Opens wait for gate `gate` from now on.
    pub fn slow_opens(&self, gate: &str) {
        *self.slow_open.lock().unwrap() = Some(gate.to_owned());
    }

    /// The next pool import fails (a local failure: descriptors, memory).
    pub fn fail_next_pool_import(&self) {
        self.fail_pool_import.store(true, Ordering::SeqCst);
    }

    /// Queues work of this backend's role on stream `s` (which it owns from then on), as
    /// [`Device::work`].
    pub fn work(&self, s: u64, name: &str, gate: &str, write: Option<(u64, usize, Vec<u8>)>) {
        self.sim
            .device
            .work_as(Some(&self.sim.role), s, name, gate, write);
    }

    fn counters(&self) -> &CounterState {
        self.counters.as_ref().expect("a counter-mode backend")
    }

    /// Counter mode: whether a peer's inbox grant was accepted (a usable lane or not).
    pub fn has_peer_inbox(&self) -> bool {
        !lock(&self.counters().peers).is_empty()
    }

    /// Counter mode: whether our fences for `peer` go into a lane of its inbox (else they
    /// are events).
    pub fn has_lane_for(&self, peer: &ProcessId) -> bool {
        matches!(
            lock(&self.counters().peers).get(peer),
            Some(PeerInbox::Lane(_))
        )
    }

    /// Counter mode: whether `peer`'s inbox is ambiguous to us (two grants from its
    /// process, or a lane another backend claimed first).
    pub fn ambiguous(&self, peer: &ProcessId) -> bool {
        matches!(
            lock(&self.counters().peers).get(peer),
            Some(PeerInbox::Ambiguous)
        )
    }

    /// Counter mode: the process id the test process has stands, for this backend, for
    /// `role` (a raw peer, which lends no inbox).
    pub fn set_peer_role(&self, role: &str) {
        lock(&self.counters().peer_roles).insert(baton::ipc::process::current(), role.to_owned());
    }

    /// Counter mode: accepts wait for gate `gate` from now on.
    pub fn slow_accepts(&self, gate: &str) {
        *lock(&self.counters().slow_accept) = Some(gate.to_owned());
    }

    /// Counter mode: counter fences of ours alive now (recorded, not yet dropped).
    pub fn live_fences(&self) -> usize {
        self.counters().live.load(Ordering::Relaxed)
    }

    /// Counter mode: the status of the lane we lent to `peer`.
    pub fn lane_status(&self, peer: &ProcessId) -> Option<LaneStatus> {
        lock(&self.counters().lanes).status(peer)
    }

    /// Counter mode: lanes lent so far, of the capacity.
    pub fn lanes_lent(&self) -> (u32, u32) {
        lock(&self.counters().lanes).lent()
    }

    /// Counter mode: the fence deadline.
    pub fn deadline(&self) -> Duration {
        self.counters().mode.deadline
    }

    /// Whether the process `p` stands for may still run work (simulated liveness).
    fn alive(&self, p: &ProcessId) -> bool {
        let role = self
            .counters
            .as_ref()
            .and_then(|c| lock(&c.peer_roles).get(p).cloned());
        role.is_none_or(|r| !self.sim.device.is_dead(&r))
    }

    /// Writes each range's release value ([`Lanes::release_value`]) into `ranges` of our
    /// inbox (writes on a stream that waits on nothing, waited for).
    fn release(&self, ranges: &[ReleaseRange]) {
        let values: Vec<u64> = {
            let lanes = lock(&self.counters().lanes);
            ranges
                .iter()
                .map(|r| lanes.release_value(r.first))
                .collect()
        };
        let mut st = self.sim.device.lock();
        for (r, &value) in ranges.iter().zip(&values) {
            if let Some(words) = st.inboxes.get_mut(&self.sim.number) {
                for w in words
                    .iter_mut()
                    .skip(r.first as usize)
                    .take(r.slots as usize)
                {
                    *w = value;
                }
            }
            st.log.push(format!(
                "{} release slots {}..{}",
                self.sim.role,
                r.first,
                r.first + r.slots
            ));
        }
        st.pump();
        drop(st);
        self.sim.device.changed.notify_all();
    }

    /// One look of the watch thread (`ipc/src/cuda/inbox.rs`, `Watched::observe`), at the
    /// device's simulated time: the inbox is read back into the lanes, released lanes are
    /// written, and producers that missed the deadline are reported to the hooks.
    pub fn watch(&self) -> Observation {
        let Some(c) = &self.counters else {
            return Observation::default();
        };
        if self.sim.device.is_dead(&self.sim.role) || !lock(&c.lanes).needs_observing() {
            return Observation::default();
        }
        let values = self
            .sim
            .device
            .lock()
            .inboxes
            .get(&self.sim.number)
            .cloned()
            .unwrap_or_default();
        let now = self.sim.device.now();
        let seen = lock(&c.lanes).observe(&values, now, |p| self.alive(p));
        self.release(&seen.release);
        if !seen.missed.is_empty() {
            self.sim.device.note(format!(
                "{} missed deadline: {:?}",
                self.sim.role, seen.missed
            ));
            let hooks = lock(&c.hooks).clone();
            for producer in &seen.missed {
                for hook in &hooks {
                    hook(*producer);
                }
            }
        }
        seen
    }

    /// The release stream a fence after uses on `stream` is recorded on.
    fn pick(&self, stream: StreamKey) -> u32 {
        let r = self.counters().mode.release_streams.max(1);
        match stream {
            StreamKey::Id(n) => (n % u64::from(r)) as u32,
            _ => 0,
        }
    }

    /// Release stream `i` (its mark lock held, waited on what the fence must follow)
    /// records a fence for `to` (as `CudaBackend::fence_on`).
    fn fence_on(
        &self,
        i: u32,
        s: u64,
        held: &mut SimTwin,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let c = self.counters();
        let role = self.sim.role.as_str();
        let taken = {
            let mut peers = lock(&c.peers);
            match peers.get_mut(to) {
                Some(PeerInbox::Lane(lane)) if i < lane.grant.slots => {
                    let v = &mut lane.values[i as usize];
                    *v += 1;
                    Some((lane.grant, i, *v))
                }
                Some(PeerInbox::Lane(_) | PeerInbox::Ambiguous) | None => None,
            }
        };
        let Some((grant, slot, value)) = taken else {
            // `to` lent us no lane we can use (none, several, or it is gone): an
            // interprocess event, which any process can wait on; nothing blocks here.
            self.sim.device.note(format!(
                "{role} event fence on s{s} (no usable inbox lane from the peer)"
            ));
            let event = self.sim.device.new_event();
            self.sim.device.record(role, event, s);
            return Ok(Some(Arc::new(SimFence {
                device: Arc::clone(&self.sim.device),
                role: role.to_owned(),
                event,
            })));
        };
        let device = &self.sim.device;
        device.enqueue_as(
            Some(role),
            s,
            Op::WriteValue {
                inbox: grant.slab_id,
                slot: grant.first + slot,
                value,
                writer: role.to_owned(),
                peer: true,
            },
            Some(format!(
                "{role} write inbox{} slot{} = {value} on s{s}",
                grant.slab_id,
                grant.first + slot
            )),
        );
        let twin = SimTwins::promise(held);
        c.live.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Arc::new(SimCounterFence {
            device: Arc::clone(device),
            role: role.to_owned(),
            handle: CounterFence {
                slab: grant.slab,
                slab_id: grant.slab_id,
                offset: grant.offset_of(slot).expect("a slot of the lane"),
                value,
            },
            local: CounterFence {
                slab: inbox_handle(self.sim.number),
                slab_id: self.sim.number,
                offset: u64::from(i) * 8,
                value: twin,
            },
            own: self.sim.number,
            twins: Arc::clone(&c.marks),
            live: Arc::clone(&c.live),
        })))
    }

    fn refused(producer: &ProcessId, reason: FenceRefusal) -> Error {
        Error::FenceRefused {
            producer: *producer,
            reason,
        }
    }

    /// `stream` waits on a counter fence in our inbox (as `CudaBackend::wait_fence_on`):
    /// a fence in a lane only if it lies in `producer`'s lane; our own (local marks, lend
    /// area) always.
    fn wait_counter(&self, s: u64, producer: &ProcessId, fence: &CounterFence) -> Result<()> {
        let c = self.counters();
        let n = self.sim.number;
        if fence.slab_id != n || fence.slab != inbox_handle(n) {
            return Err(Self::refused(producer, FenceRefusal::ForeignSlab));
        }
        let r = c.marks.len() as u64;
        let slot = fence.offset / 8;
        let words = self.sim.device.lock().inboxes[&n].len() as u64;
        if fence.offset % 8 != 0 || slot >= words {
            return Err(Self::refused(
                producer,
                FenceRefusal::OutsideLane {
                    offset: fence.offset,
                },
            ));
        }
        if slot >= r + u64::from(LEND) && !lock(&c.lanes).may_wait(producer, fence.offset) {
            return Err(Self::refused(
                producer,
                FenceRefusal::OutsideLane {
                    offset: fence.offset,
                },
            ));
        }
        // A local mark is written when waited on.
        c.marks.settle(slot, fence.value);
        let role = &self.sim.role;
        self.sim.device.enqueue_as(
            Some(role),
            s,
            Op::WaitValue {
                inbox: n,
                slot: slot as u32,
                value: fence.value,
            },
            Some(format!(
                "{role} wait-value slot{slot} >= {} on s{s}",
                fence.value
            )),
        );
        Ok(())
    }
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn kind(&self) -> BackendKind {
        match self.pool {
            Some(_) => BackendKind::CudaPool,
            None => BackendKind::CudaLegacy,
        }
    }
    fn device(&self) -> DeviceUuid {
        DeviceUuid([0x51; 16])
    }
    fn can_open(&self, kind: BackendKind) -> bool {
        matches!(kind, BackendKind::CudaLegacy | BackendKind::CudaPool)
    }
    fn retire_idle_pools(&self) -> Vec<u64> {
        let Some(current) = &self.pool else {
            return Vec::new();
        };
        if !self.retire_idle.load(Ordering::SeqCst) {
            return Vec::new();
        }
        let mut current = lock(current);
        let idle = current
            .as_ref()
            .is_some_and(|p| p.used.load(Ordering::SeqCst) && p.live.load(Ordering::SeqCst) == 0);
        if !idle {
            return Vec::new();
        }
        let id = current.take().expect("idle").id;
        self.sim
            .device
            .note(format!("{} pool retired p{id}", self.sim.role));
        vec![id]
    }
    /// Pool-like: the pool is given up (a later allocation makes a fresh one), logged as
    /// `"{role} pool released p{id}"`, as a CUDA backend retires its export pool.
    fn release_idle(&self) {
        let Some(current) = &self.pool else { return };
        if let Some(pool) = lock(current).take() {
            self.sim
                .device
                .note(format!("{} pool released p{}", self.sim.role, pool.id));
        }
    }
    fn forget_pool(&self, exporter: &ProcessId, pool: u64) {
        if self
            .imported_pools
            .lock()
            .unwrap()
            .remove(&(*exporter, pool))
        {
            self.sim
                .device
                .note(format!("{} pool forgotten p{pool}", self.sim.role));
        }
    }
    fn allocate(&self, size: usize) -> Result<Allocation> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let alloc = {
            let mut state = self.sim.device.lock();
            state.next_alloc += 1;
            let alloc = state.next_alloc;
            state.memory.insert(alloc, vec![0; size]);
            state
                .log
                .push(format!("{} allocate a{alloc}", self.sim.role));
            alloc
        };
        let mem = SimMem {
            sim: Arc::clone(&self.sim),
            alloc,
            size,
            owner: true,
            pool: self.pool.as_ref().map(|current| {
                let pool = Arc::clone(lock(current).get_or_insert_with(|| {
                    SimPool::new(self.pool_ids.fetch_add(1, Ordering::SeqCst) + 1)
                }));
                pool.live.fetch_add(1, Ordering::SeqCst);
                pool.used.store(true, Ordering::SeqCst);
                pool
            }),
        };
        Ok(Allocation::with_id(
            AllocationId::new(alloc),
            self.kind(),
            self.device(),
            Box::new(mem),
        ))
    }
    fn open(&self, handle: CheckedHandle<'_>, fd: Option<OwnedFd>) -> Result<OpenedMem> {
        let role = &self.sim.role;
        self.sim
            .device
            .note(format!("{role} open started a{}", handle.alloc.get()));
        let gate = self.slow_open.lock().unwrap().clone();
        if let Some(gate) = gate {
            self.sim
                .device
                .block_until(None, &format!("gate {gate}"), |st| {
                    st.open_gates.contains(&gate)
                });
        }
        if fd.is_some() {
            self.fds_opened.fetch_add(1, Ordering::Relaxed);
        }
        let alloc = match &handle.raw {
            RawHandle::CudaIpc(raw) => decode_alloc(&raw.0),
            RawHandle::CudaPool {
                pool,
                pool_slot,
                ptr,
            } => {
                let exporter = handle.exporter.process;
                if pool_slot.is_some() {
                    let fd = fd.ok_or(Error::MissingFdSlot { slot: 0 })?;
                    if self.fail_pool_import.swap(false, Ordering::SeqCst) {
                        self.sim.device.note(format!("{role} pool import failed"));
                        drop(fd);
                        return Err(Error::Io {
                            op: "importing a pool (simulated failure)",
                            source: std::io::Error::from_raw_os_error(24),
                        });
                    }
                    self.imported_pools
                        .lock()
                        .unwrap()
                        .insert((exporter, *pool));
                    self.sim
                        .device
                        .note(format!("{role} pool imported p{pool}"));
                } else if !self
                    .imported_pools
                    .lock()
                    .unwrap()
                    .contains(&(exporter, *pool))
                {
                    return Err(Error::PoolNotImported {
                        exporter: handle.exporter,
                        pool: *pool,
                    });
                }
                decode_alloc(&ptr.0)
            }
            _ => {
                return Err(Error::UnsupportedBackend {
                    kind: handle.backend,
                });
            }
        };
        let size = self.sim.device.lock().memory[&alloc].len();
        self.sim.device.note(format!("{role} opened a{alloc}"));
        Ok(OpenedMem::new(
            &handle,
            Box::new(SimMem {
                sim: Arc::clone(&self.sim),
                alloc,
                size,
                owner: false,
                pool: None,
            }),
        ))
    }
    fn ordering(&self) -> &dyn StreamOrdering {
        self
    }
    fn blocking_calls(&self) -> bool {
        true
    }
    fn forget_process(&self, process: &ProcessId) {
        self.release_dead(process);
        if let Some(c) = &self.counters {
            if !self.alive(process) {
                // We write no more fences for it, and its lane is no longer claimed (as
                // `Inbox::forget_peer`).
                let forgotten = lock(&c.peers).remove(process);
                if let Some(PeerInbox::Lane(l)) = forgotten {
                    self.sim.device.lock().claimed.remove(&(
                        *process,
                        l.grant.slab_id,
                        l.grant.first,
                    ));
                }
            }
        }
    }
}

impl StreamOrdering for SimBackend {
    fn order_after(
        &self,
        stream: StreamRef<'_>,
        producer: &ProcessId,
        fence: &FenceHandle,
    ) -> Result<()> {
        let s = self.sim.stream(stream)?;
        if let (FenceHandle::Counter(counter), Some(_)) = (fence, &self.counters) {
            return self.wait_counter(s, producer, counter);
        }
        let event = decode_event(fence)?;
        self.sim.device.wait(&self.sim.role, event, s);
        Ok(())
    }
    fn use_mark(&self, stream: StreamRef<'_>) -> Result<Option<Box<dyn UseMark>>> {
        self.sim.stream(stream)?;
        Ok(Some(Box::new(SimMark {
            device: Arc::clone(&self.sim),
            event: self.sim.device.new_event(),
            stream: stream.key(),
        })))
    }
    fn export_fence(
        &self,
        after: &[&dyn UseMark],
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let Some(first) = after.first() else {
            return Ok(None);
        };
        if let Some(c) = &self.counters {
            let i = self.pick(first.stream());
            let s = self.counter_release_stream(i);
            let mut held = c.marks.lock(i);
            for mark in after {
                mark.order(StreamRef::Id(s))?;
            }
            return self.fence_on(i, s, &mut held, to);
        }
        let s = self.release_stream();
        for mark in after {
            mark.order(StreamRef::Id(s))?;
        }
        let event = self.sim.device.new_event();
        self.sim.device.record(&self.sim.role, event, s);
        Ok(Some(Arc::new(SimFence {
            device: Arc::clone(&self.sim.device),
            role: self.sim.role.clone(),
            event,
        })))
    }
    /// As `Fences::export_fence_on`: the stream writes the fence itself, from the stream
    /// slot bound to it (bound now if one is free, or held by an idle stream whose mark is
    /// written).
    fn export_fence_on(
        &self,
        stream: &Stream,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let Some(c) = &self.counters else {
            return Ok(None);
        };
        if !self.has_lane_for(to) {
            return Ok(None);
        }
        let Ok(s) = self.sim.stream(stream.as_ref()) else {
            return Ok(None);
        };
        let r = c.mode.release_streams.max(1);
        let known = lock(&c.stream_slots).0.iter().position(|k| *k == Some(s));
        if let Some(k) = known {
            let i = r + k as u32;
            let mut held = c.marks.lock(i);
            if held.stream == Some(s) {
                return self.fence_on(i, s, &mut held, to);
            }
        }
        let mut slots = lock(&c.stream_slots);
        let start = slots.1;
        for n in 0..STREAM_SLOTS as usize {
            let k = (start + n) % STREAM_SLOTS as usize;
            let i = r + k as u32;
            let mut held = c.marks.lock(i);
            let free = match held.stream {
                None => true,
                Some(old) => old == s || self.sim.device.idle(old),
            };
            if free {
                held.stream = Some(s);
                slots.0[k] = Some(s);
                slots.1 = (k + 1) % STREAM_SLOTS as usize;
                drop(slots);
                return self.fence_on(i, s, &mut held, to);
            }
        }
        Ok(None)
    }
    fn relay_fence(
        &self,
        producer: &ProcessId,
        fence: &FenceHandle,
        to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        let Some(c) = &self.counters else {
            return Ok(None);
        };
        let s = self.counter_release_stream(0);
        if let FenceHandle::Counter(f) = fence
            && f.slab_id == self.sim.number
        {
            // Our own twin: written when waited on, under its lock (maybe this one).
            c.marks.settle(f.offset / 8, f.value);
        }
        let mut held = c.marks.lock(0);
        self.order_after(StreamRef::Id(s), producer, fence)?;
        self.fence_on(0, s, &mut held, to)
    }
    fn inbox_grant(&self, peer: &ProcessId) -> Option<InboxGrant> {
        let c = self.counters.as_ref()?;
        let (first, slots, base) = lock(&c.lanes).grant(peer, self.sim.device.now())?;
        self.sim.device.note(format!(
            "{} grant lane {first}..{}",
            self.sim.role,
            first + slots
        ));
        Some(InboxGrant {
            device: self.device(),
            slab: inbox_handle(self.sim.number),
            slab_id: self.sim.number,
            first,
            slots,
            base,
        })
    }
    fn accept_inbox(&self, peer: &ProcessId, grant: &InboxGrant) -> Result<()> {
        let Some(c) = &self.counters else {
            return Ok(());
        };
        let gate = lock(&c.slow_accept).clone();
        if let Some(gate) = gate {
            self.sim
                .device
                .block_until(None, &format!("gate {gate}"), |st| {
                    st.open_gates.contains(&gate)
                });
        }
        let granter = {
            let st = self.sim.device.lock();
            let fits = st
                .inboxes
                .get(&grant.slab_id)
                .is_some_and(|w| u64::from(grant.first) + u64::from(grant.slots) <= w.len() as u64);
            (fits && grant.slab == inbox_handle(grant.slab_id))
                .then(|| st.roles.get(&grant.slab_id).cloned().unwrap_or_default())
        };
        let Some(granter) = granter else {
            return Err(Error::Io {
                op: "opening a peer's fence inbox (simulated)",
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        };
        // As `Inbox::accept`: a second, different grant from one process, or a lane another
        // backend of this process claimed first, makes the peer ambiguous.
        let accepted = {
            let mut peers = lock(&c.peers);
            match peers.get(peer) {
                Some(PeerInbox::Lane(l)) if l.grant == *grant => "accepted",
                Some(PeerInbox::Lane(_) | PeerInbox::Ambiguous) => {
                    peers.insert(*peer, PeerInbox::Ambiguous);
                    "ambiguous (two lanes from one process)"
                }
                None => {
                    let me = self.sim.number;
                    let owner = *self
                        .sim
                        .device
                        .lock()
                        .claimed
                        .entry((*peer, grant.slab_id, grant.first))
                        .or_insert(me);
                    if owner == me {
                        peers.insert(
                            *peer,
                            PeerInbox::Lane(PeerLane {
                                grant: *grant,
                                values: vec![grant.base; grant.slots as usize],
                            }),
                        );
                        "accepted"
                    } else {
                        peers.insert(*peer, PeerInbox::Ambiguous);
                        "ambiguous (claimed by another backend)"
                    }
                }
            }
        };
        lock(&c.peer_roles).insert(*peer, granter.clone());
        self.sim.device.note(format!(
            "{} {accepted} lane {}..{} of {granter}",
            self.sim.role,
            grant.first,
            grant.first + grant.slots
        ));
        Ok(())
    }
    fn check_fence(&self, producer: &ProcessId, fence: &FenceHandle) -> Result<()> {
        let (Some(c), FenceHandle::Counter(counter)) = (&self.counters, fence) else {
            return Ok(());
        };
        let n = self.sim.number;
        if counter.slab_id != n || counter.slab != inbox_handle(n) {
            return Err(Self::refused(producer, FenceRefusal::ForeignSlab));
        }
        let now = self.sim.device.now();
        lock(&c.lanes)
            .announce(producer, counter.offset, counter.value, now)
            .map_err(|r| Self::refused(producer, r))
    }
    fn add_fence_fault_hook(&self, hook: FenceFaultHook) {
        if let Some(c) = &self.counters {
            lock(&c.hooks).push(hook);
        }
    }
    fn producer_cut(&self, process: &ProcessId) {
        let Some(c) = &self.counters else { return };
        let ranges = lock(&c.lanes).producer_cut(process);
        self.sim
            .device
            .note(format!("{} cut producer {process}", self.sim.role));
        self.release(&ranges);
    }
    fn unsafe_to_free(&self, producer: &ProcessId, fence: &FenceHandle) -> bool {
        match (fence, &self.counters) {
            (FenceHandle::Counter(counter), Some(c)) => {
                counter.slab_id == self.sim.number
                    && lock(&c.lanes).unsafe_to_free(producer, counter.offset)
                    && self.alive(producer)
            }
            _ => false,
        }
    }
    fn flush_fences(&self, within: Duration) -> Result<bool> {
        let Some(c) = &self.counters else {
            return Ok(true);
        };
        let r = c.mode.release_streams.max(1);
        let mut streams: Vec<u64> = (0..r).map(|i| self.counter_release_stream(i)).collect();
        // Streams that wrote fences themselves.
        streams.extend((r..c.marks.len() as u32).filter_map(|i| c.marks.lock(i).stream));
        Ok(self.sim.device.block_within(
            Some(&self.sim.role),
            "the release streams",
            within,
            |st| {
                streams
                    .iter()
                    .all(|s| st.streams.get(s).is_none_or(VecDeque::is_empty))
            },
        ))
    }
    /// Logs "ROLE landed F..." (`eN` for an event, `iN@O=V` for a counter), then waits in
    /// the simulation, at most the device's deadline, until they all hold.
    fn own_fences_landed(&self, fences: &[FenceHandle], all: bool) -> Result<bool> {
        let within = self.sim.device.deadline;
        if all {
            self.sim
                .device
                .note(format!("{} landed all", self.sim.role));
            if self.counters.is_none() {
                let s = self.release_stream();
                return Ok(self.sim.device.try_synchronize(s, within));
            }
            return self.flush_fences(within);
        }
        let mut names = Vec::new();
        let mut wanted = Vec::new();
        for f in fences {
            match f {
                FenceHandle::Counter(c) => {
                    if let Some(counters) = self
                        .counters
                        .as_ref()
                        .filter(|_| c.slab_id == self.sim.number)
                    {
                        counters.marks.settle(c.offset / 8, c.value);
                    }
                    names.push(format!("i{}@{}={}", c.slab_id, c.offset, c.value));
                    wanted.push((None, Some((c.slab_id, (c.offset / 8) as u32, c.value))));
                }
                FenceHandle::Event(_) => {
                    let event = decode_event(f)?;
                    names.push(format!("e{event}"));
                    wanted.push((Some(event), None));
                }
            }
        }
        self.sim
            .device
            .note(format!("{} landed {}", self.sim.role, names.join(" ")));
        Ok(self
            .sim
            .device
            .block_within(Some(&self.sim.role), "its own fences", within, |st| {
                wanted.iter().all(|w| match w {
                    (Some(event), _) => st.events.get(event).is_none_or(|r| st.done.contains(r)),
                    (None, Some((inbox, slot, value))) => geq(st.word(*inbox, *slot), *value),
                    (None, None) => true,
                })
            }))
    }
    fn synchronize(&self) -> Result<()> {
        let s = self.internal();
        self.sim.device.note(format!("{} sync s{s}", self.sim.role));
        self.sim.device.synchronize_as(Some(&self.sim.role), s);
        Ok(())
    }
    fn release_dead(&self, process: &ProcessId) {
        let Some(c) = &self.counters else { return };
        if self.alive(process) {
            return;
        }
        let ranges = lock(&c.lanes).producer_died(process);
        if !ranges.is_empty() {
            self.sim
                .device
                .note(format!("{} producer died {process}", self.sim.role));
        }
        self.release(&ranges);
    }
}
