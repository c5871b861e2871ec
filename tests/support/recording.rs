//! A recording test backend: GPU-like memory on a simulated device, so that the order of
//! fence operations can be proven without a GPU.
//!
//! - Memory is bytes; every read, write and fill is a copy queued on the backend's own
//!   stream, then a synchronise of it — as the CUDA backend does.
//! - Streams are queues of operations that the simulated device runs in order: an
//!   operation runs only when those before it on its stream have run, a wait only once the
//!   record it waits for has run, and *work* (a stand-in for a kernel) only once the test
//!   opens its gate. Work may write memory when it runs, so a late write shows.
//! - Fences are interprocess events: a record is an operation; a wait names the event's
//!   latest record at the time it is queued, as `cuStreamWaitEvent` does.
//! - Every driver-level call is logged, tagged with the backend's role (`exp`, `imp`), so
//!   tests assert on the order of records, waits, copies, opens, closes and frees.
//! - Opens can be made slow on purpose (a gate), and pool-like allocations share one
//!   descriptor, whose import can be made to fail once.
//!
//! Both roles of a test live in one process and share one [`Device`].

#![allow(dead_code)]

use baton::ipc::{
    Allocation, Backend, CheckedHandle, DescriptorScope, Error, ExportableMemory, ExportedFence,
    FreeWhileMapped, MemPtr, OpenedMem, RawMemory, Result, StreamKey, StreamRef, UseMark,
};
use baton::messages::{
    AllocationId, BackendKind, CudaIpcMemHandle, CudaPoolExportData, DeviceUuid, FenceHandle,
    IpcEventHandle, ProcessId, RawHandle,
};
use std::any::Any;
use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a host-side wait on the simulated device may take before the test fails.
pub const DEVICE_DEADLINE: Duration = Duration::from_secs(30);

/// The id the simulated device gives a backend's own stream: 1000 + the backend's number.
fn internal_stream(backend: u64) -> u64 {
    1000 + backend
}

/// The id of a backend's release stream.
fn release_stream(backend: u64) -> u64 {
    2000 + backend
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
}

impl DeviceState {
    /// Runs every operation that can run, in stream order.
    fn pump(&mut self) {
        loop {
            let mut progress = false;
            let ids: Vec<u64> = self.streams.keys().copied().collect();
            for s in ids {
                loop {
                    let ready = match self.streams.get(&s).and_then(|q| q.front()) {
                        None => false,
                        Some((_, Op::Work { gate, .. })) => self.open_gates.contains(gate),
                        Some((_, Op::Wait { on, .. })) => on.is_none_or(|o| self.done.contains(&o)),
                        Some(_) => true,
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
                        Op::Record { .. } | Op::Wait { .. } => {}
                    }
                    self.done.insert(id);
                    progress = true;
                }
            }
            if !progress {
                return;
            }
        }
    }
}

/// The simulated device and its log, shared by the backends of a test.
#[derive(Default)]
pub struct Device {
    state: Mutex<DeviceState>,
    changed: Condvar,
    next_backend: AtomicU64,
}

impl Device {
    pub fn new() -> Arc<Device> {
        Arc::new(Device::default())
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
        let mut state = self.lock();
        state.next_op += 1;
        let id = state.next_op;
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

    /// Blocks until `cond` holds of the device state (pumping as gates open).
    fn block_until(&self, what: &str, mut cond: impl FnMut(&DeviceState) -> bool) {
        let start = Instant::now();
        let mut state = self.lock();
        loop {
            state.pump();
            if cond(&state) {
                return;
            }
            let left = DEVICE_DEADLINE.saturating_sub(start.elapsed());
            assert!(!left.is_zero(), "the simulated device never got to {what}");
            state = self
                .changed
                .wait_timeout(state, left.min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn synchronize(&self, s: u64) {
        self.block_until(&format!("the end of stream {s}"), |st| {
            st.streams.get(&s).is_none_or(VecDeque::is_empty)
        });
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

    fn record(&self, who: &str, event: u64, s: u64) {
        self.enqueue(
            s,
            Op::Record { event },
            Some(format!("{who} record e{event} on s{s}")),
        );
    }

    fn wait(&self, who: &str, event: u64, s: u64) {
        let on = self.latest(event);
        self.enqueue(
            s,
            Op::Wait { event, on },
            Some(format!("{who} wait e{event} on s{s}")),
        );
    }

    /// Queues work named `name` on stream `s`, which runs once gate `gate` opens and then
    /// writes `write` (an allocation of this device, an offset and bytes) if given.
    pub fn work(&self, s: u64, name: &str, gate: &str, write: Option<(u64, usize, Vec<u8>)>) {
        self.enqueue(
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
                start.elapsed() < DEVICE_DEADLINE,
                "no log line starting with {prefix:?}:\n{}",
                self.log().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
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
        self.device
            .device
            .wait(&format!("{} mark", self.device.role), self.event, s);
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        let event = self.event;
        self.device.device.block_until("a mark", |st| {
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
        self.device.block_until("a fence", |st| {
            st.events.get(&event).is_none_or(|r| st.done.contains(r))
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
    /// Pool-like: the shared descriptor (exporter side).
    pool_fd: Option<Arc<OwnedFd>>,
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
        self.sim.device.enqueue(
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
        self.sim.device.synchronize(s);
        dst.copy_from_slice(&out.lock().unwrap().take().expect("the copy ran"));
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let s = self.internal();
        self.sim.device.enqueue(
            s,
            Op::CopyIn {
                alloc: self.alloc,
                offset,
                bytes: src.to_vec(),
            },
            Some(format!("{} copy-in a{} on s{s}", self.sim.role, self.alloc)),
        );
        self.sim.device.note(format!("{} sync s{s}", self.sim.role));
        self.sim.device.synchronize(s);
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
        Ok(match &self.pool_fd {
            None => RawHandle::CudaIpc(CudaIpcMemHandle(encode_alloc(self.alloc))),
            Some(_) => RawHandle::CudaPool {
                pool: 1,
                pool_slot: fd_slot,
                ptr: CudaPoolExportData(encode_alloc(self.alloc)),
            },
        })
    }
    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        self.pool_fd.as_ref().map(|fd| fd.as_fd())
    }
    fn descriptor_scope(&self) -> DescriptorScope {
        match self.pool_fd {
            Some(_) => DescriptorScope::Pool(1),
            None => DescriptorScope::Allocation,
        }
    }
}

impl Drop for SimMem {
    fn drop(&mut self) {
        let what = if self.owner { "free" } else { "close" };
        self.sim
            .device
            .note(format!("{} {what} a{}", self.sim.role, self.alloc));
    }
}

/// The recording backend (see the module docs).
pub struct SimBackend {
    sim: Arc<SimRef>,
    pool_fd: Option<Arc<OwnedFd>>,
    /// Pools imported, by exporter process.
    imported_pools: Mutex<HashSet<ProcessId>>,
    fail_pool_import: AtomicBool,
    /// Opens wait until this gate opens (a deliberately slow driver call).
    slow_open: Mutex<Option<String>>,
    /// File descriptors the opens were given.
    pub fds_opened: AtomicU64,
}

impl std::fmt::Debug for SimBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimBackend({})", self.sim.role)
    }
}

impl SimBackend {
    /// A backend called `role` in the log, allocating legacy-like memory.
    pub fn new(device: &Arc<Device>, role: &str) -> Arc<SimBackend> {
        Self::make(device, role, None)
    }

    /// As [`new`](Self::new), allocating pool-like memory: every allocation shares one
    /// descriptor (a memfd), shared once per link.
    pub fn pooled(device: &Arc<Device>, role: &str) -> Arc<SimBackend> {
        let fd = rustix::fs::memfd_create("sim-pool", rustix::fs::MemfdFlags::CLOEXEC)
            .expect("memfd_create");
        Self::make(device, role, Some(Arc::new(fd)))
    }

    fn make(device: &Arc<Device>, role: &str, pool_fd: Option<Arc<OwnedFd>>) -> Arc<SimBackend> {
        let number = device.next_backend.fetch_add(1, Ordering::Relaxed) + 1;
        Arc::new(SimBackend {
            sim: Arc::new(SimRef {
                device: Arc::clone(device),
                role: role.to_owned(),
                number,
            }),
            pool_fd,
            imported_pools: Mutex::new(HashSet::new()),
            fail_pool_import: AtomicBool::new(false),
            slow_open: Mutex::new(None),
            fds_opened: AtomicU64::new(0),
        })
    }

    /// The id of this backend's own stream.
    pub fn internal(&self) -> u64 {
        internal_stream(self.sim.number)
    }

    /// The id of this backend's release stream.
    pub fn release_stream(&self) -> u64 {
        release_stream(self.sim.number)
    }

    /// Opens wait for gate `gate` from now on.
    pub fn slow_opens(&self, gate: &str) {
        *self.slow_open.lock().unwrap() = Some(gate.to_owned());
    }

    /// The next pool import fails (a local failure: descriptors, memory).
    pub fn fail_next_pool_import(&self) {
        self.fail_pool_import.store(true, Ordering::SeqCst);
    }
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn kind(&self) -> BackendKind {
        match self.pool_fd {
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
            pool_fd: self.pool_fd.clone(),
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
                .block_until(&format!("gate {gate}"), |st| st.open_gates.contains(&gate));
        }
        if fd.is_some() {
            self.fds_opened.fetch_add(1, Ordering::Relaxed);
        }
        let alloc = match &handle.raw {
            RawHandle::CudaIpc(raw) => decode_alloc(&raw.0),
            RawHandle::CudaPool { pool_slot, ptr, .. } => {
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
                    self.imported_pools.lock().unwrap().insert(exporter);
                    self.sim.device.note(format!("{role} pool imported"));
                } else if !self.imported_pools.lock().unwrap().contains(&exporter) {
                    return Err(Error::PoolNotImported {
                        exporter: handle.exporter,
                        pool: 1,
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
                pool_fd: None,
            }),
        ))
    }
    fn order_after(
        &self,
        stream: StreamRef<'_>,
        _producer: &ProcessId,
        fence: &FenceHandle,
    ) -> Result<()> {
        let s = self.sim.stream(stream)?;
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
        _to: &ProcessId,
    ) -> Result<Option<Arc<dyn ExportedFence>>> {
        if after.is_empty() {
            return Ok(None);
        }
        let s = self.release_stream();
        for mark in after {
            mark.order(StreamRef::Id(s))?;
        }
        let event = self.sim.device.new_event();
        self.sim.device.record(&self.sim.role, event, s);
        Ok(Some(Arc::new(SimFence {
            device: Arc::clone(&self.sim.device),
            event,
        })))
    }
    fn synchronize(&self) -> Result<()> {
        let s = self.internal();
        self.sim.device.note(format!("{} sync s{s}", self.sim.role));
        self.sim.device.synchronize(s);
        Ok(())
    }
    fn blocking_calls(&self) -> bool {
        true
    }
}
