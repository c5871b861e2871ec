//! A fake NCCL for the engine's tests: a fabric shared by the engines of a test, where two
//! inits of one unique id make a communicator, the k-th send on it meets the k-th receive
//! and copies the bytes (the "device" pointers are host addresses), and the test can hold
//! every operation forever or raise an asynchronous error. It records every call. Each
//! engine's fake is a "device": with [`Fabric::frees_wait_for_kernels`] an abort returns
//! only once no operation of another live communicator on its device still runs, as
//! `ncclCommAbort`'s host-memory free waits for every kernel of the context.

use super::api::{CommHandle, Nccl, OpHandle, Progress, Rank, UniqueId};
use crate::transfer::Region;
use crate::{Error, MemPtr, Result};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A recorded call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Call {
    UniqueId,
    Init { comm: usize, rank: u8 },
    Send { comm: usize, len: usize },
    Recv { comm: usize, len: usize },
    Abort { comm: usize },
}

#[derive(Debug)]
struct FakeComm {
    /// The device (the engine's fake) it was made on.
    device: usize,
    uid: UniqueId,
    rank: Rank,
    /// The other rank's communicator, once it joined.
    other: Option<usize>,
    error: Option<String>,
    aborted: bool,
    sends: Vec<u64>,
    recvs: Vec<u64>,
}

#[derive(Debug)]
struct FakeOp {
    comm: usize,
    send: bool,
    /// The host address behind the region's "device" pointer.
    addr: usize,
    len: usize,
    done: bool,
}

impl FakeOp {
    fn comm_aborted(&self, f: &Fabric) -> bool {
        f.comms[&self.comm].aborted
    }
}

/// The fabric's state.
#[derive(Debug, Default)]
pub(super) struct Fabric {
    comms: HashMap<usize, FakeComm>,
    ops: HashMap<u64, FakeOp>,
    next: usize,
    /// No operation completes while set.
    pub(super) hold: bool,
    /// Inits fail while set.
    pub(super) fail_init: bool,
    /// Aborts hang while set (as `ncclCommAbort` can when a peer died mid-transfer).
    pub(super) hang_aborts: bool,
    /// While set, an abort sets its communicator's flag (its operations stop) and then
    /// returns only once no operation of another live communicator of its device runs.
    pub(super) frees_wait_for_kernels: bool,
    pub(super) calls: Vec<Call>,
    /// Aborts called, returned or not (a hung one is counted here, not in `calls`).
    pub(super) aborts_begun: usize,
}

impl Fabric {
    /// Raises an asynchronous error on every live communicator.
    pub(super) fn raise_error(&mut self) {
        for c in self.comms.values_mut().filter(|c| !c.aborted) {
            c.error = Some("remote process exited".into());
        }
    }

    /// Operations whose communicator was aborted, or that completed: none of them touches
    /// memory any more.
    pub(super) fn live_ops(&self) -> usize {
        self.ops
            .values()
            .filter(|o| !o.done && !self.comms[&o.comm].aborted)
            .count()
    }

    /// Operations still running on `device`'s live communicators ("kernels").
    fn kernels_on(&self, device: usize) -> usize {
        (self.ops.values())
            .filter(|o| !o.done && !o.comm_aborted(self) && self.comms[&o.comm].device == device)
            .count()
    }

    pub(super) fn aborts(&self) -> usize {
        (self.calls.iter())
            .filter(|c| matches!(c, Call::Abort { .. }))
            .count()
    }
}

/// One engine's view of the fabric.
#[derive(Debug, Clone)]
pub(super) struct FakeNccl {
    pub(super) fabric: Arc<Mutex<Fabric>>,
    /// Its device, for [`Fabric::frees_wait_for_kernels`].
    pub(super) device: usize,
    /// Where its bootstrap "listens": the address its unique ids name, as NCCL's do.
    pub(super) addr: SocketAddr,
}

impl FakeNccl {
    pub(super) fn fabric(&self) -> std::sync::MutexGuard<'_, Fabric> {
        self.fabric.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn launch(&self, comm: CommHandle, region: Region, send: bool) -> Result<OpHandle> {
        let MemPtr::Device(addr) = region.ptr else {
            panic!("the engine passed host memory to NCCL");
        };
        let mut f = self.fabric();
        let f = &mut *f;
        f.next += 1;
        let id = f.next as u64;
        let c = f.comms.get_mut(&comm.0).expect("a live communicator");
        assert!(
            !c.aborted,
            "an operation launched on an aborted communicator"
        );
        if send {
            c.sends.push(id);
            f.calls.push(Call::Send {
                comm: comm.0,
                len: region.len,
            });
        } else {
            c.recvs.push(id);
            f.calls.push(Call::Recv {
                comm: comm.0,
                len: region.len,
            });
        }
        f.ops.insert(
            id,
            FakeOp {
                comm: comm.0,
                send,
                addr: addr as usize,
                len: region.len,
                done: false,
            },
        );
        Ok(OpHandle(id))
    }
}

impl Nccl for FakeNccl {
    fn unique_id(&self) -> Result<UniqueId> {
        let mut f = self.fabric();
        f.next += 1;
        f.calls.push(Call::UniqueId);
        Ok(UniqueId::naming(f.next as u64, self.addr))
    }

    fn init(&self, uid: &UniqueId, rank: Rank) -> Result<CommHandle> {
        let mut f = self.fabric();
        if f.fail_init {
            return Err(Error::Nccl {
                op: "ncclCommInitRankConfig",
                code: 2,
                message: "fake init failure".into(),
            });
        }
        f.next += 1;
        let id = f.next;
        f.calls.push(Call::Init {
            comm: id,
            rank: rank.0,
        });
        let other = (f.comms.iter())
            .find(|(_, c)| c.uid == *uid && c.rank != rank && !c.aborted && c.other.is_none())
            .map(|(k, _)| *k);
        if let Some(o) = other {
            f.comms.get_mut(&o).expect("found").other = Some(id);
        }
        f.comms.insert(
            id,
            FakeComm {
                device: self.device,
                uid: *uid,
                rank,
                other,
                error: None,
                aborted: false,
                sends: Vec::new(),
                recvs: Vec::new(),
            },
        );
        Ok(CommHandle(id))
    }

    fn comm_progress(&self, comm: CommHandle) -> Progress {
        let f = self.fabric();
        let c = &f.comms[&comm.0];
        let other_dead = c.other.is_some_and(|o| f.comms[&o].aborted);
        match (&c.error, c.other) {
            (Some(e), _) => Progress::Failed(Error::Nccl {
                op: "ncclCommGetAsyncError",
                code: 6,
                message: e.clone(),
            }),
            (None, Some(_)) if other_dead => Progress::Failed(Error::Nccl {
                op: "ncclCommGetAsyncError",
                code: 6,
                message: "the other rank aborted".into(),
            }),
            (None, Some(_)) => Progress::Done,
            (None, None) => Progress::Pending,
        }
    }

    unsafe fn send(&self, comm: CommHandle, src: Region, _to: Rank) -> Result<OpHandle> {
        self.launch(comm, src, true)
    }

    unsafe fn recv(&self, comm: CommHandle, dst: Region, _from: Rank) -> Result<OpHandle> {
        self.launch(comm, dst, false)
    }

    fn op_progress(&self, op: OpHandle) -> Progress {
        let mut f = self.fabric();
        let o = &f.ops[&op.0];
        if o.done {
            return Progress::Done;
        }
        if f.hold {
            return Progress::Pending;
        }
        let c = &f.comms[&o.comm];
        let Some(other) = c.other.map(|k| &f.comms[&k]) else {
            return Progress::Pending;
        };
        // The k-th send meets the k-th receive of the other rank.
        let (mine, theirs) = if o.send {
            (&c.sends, &other.recvs)
        } else {
            (&c.recvs, &other.sends)
        };
        let k = mine.iter().position(|x| *x == op.0).expect("launched here");
        let Some(&peer_op) = theirs.get(k) else {
            return Progress::Pending;
        };
        let p = &f.ops[&peer_op];
        if p.len != o.len {
            return Progress::Failed(Error::Nccl {
                op: "ncclSend",
                code: 5,
                message: "send and receive lengths differ".into(),
            });
        }
        let (src, dst) = if o.send {
            (o.addr, p.addr)
        } else {
            (p.addr, o.addr)
        };
        // SAFETY: both are host buffers the test keeps alive while their transfers run
        // (the engine's contract), of `len` bytes, distinct.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, o.len) };
        f.ops.get_mut(&op.0).expect("present").done = true;
        f.ops.get_mut(&peer_op).expect("present").done = true;
        Progress::Done
    }

    fn release_op(&self, op: OpHandle) {
        self.fabric().ops.remove(&op.0);
    }

    fn abort(&self, comm: CommHandle) {
        self.fabric().aborts_begun += 1;
        while self.fabric().hang_aborts {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut f = self.fabric();
        f.calls.push(Call::Abort { comm: comm.0 });
        let c = f.comms.get_mut(&comm.0).expect("known");
        assert!(!c.aborted, "aborted twice");
        c.aborted = true;
        let device = c.device;
        if !f.frees_wait_for_kernels {
            return;
        }
        drop(f);
        // The free waits for the device's other kernels (bounded here so that a test the
        // engine deadlocks fails by its own checks instead of hanging).
        let start = Instant::now();
        while self.fabric().kernels_on(device) > 0 && start.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
