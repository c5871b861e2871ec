//! A host link's copies through the node's transfer engines, without the link actor:
//! which engine carries a buffer and whether this node and the peer can use it, the peer
//! as the engines name it, receives posted or declined, sends started, transfers waited
//! for within a deadline and reaped once finished, a landed copy opened as a lease on our
//! own memory, and the links' engines stopped when one ends.
//!
//! The link decides *when* each runs — its session keeps each copy's state, the order the
//! pulls start sends in, and where a `Release` goes (`link_session/copies.rs`); its shell
//! carries that out (`link/copy.rs`, whose module docs tell the whole protocol). What is
//! here holds no link state: it is called with the node, the peer and the copy.

use crate::buffer::IncomingLease;
use crate::error::ActorError;
use crate::exports::BufferCell;
use crate::link_ref::{CutOff, LinkRef};
use crate::link_session::{copy_engine, order_lost};
use crate::node_core::{HostPlane, NodeCore};
use crate::order::LeaseOrder;
use crate::paths::LeasePath;
use baton_ipc::transfer::nccl::NcclEngine;
use baton_ipc::transfer::{EnginePeer, HeldTransfer, TransferEngine, TransferId, decline};
use baton_ipc::{Error as IpcError, ExportedFence, Imported, MemPtr, PeerInfo};
use baton_messages::protocol::Offer;
use baton_messages::{CopyEngine, LeaseId};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// A copy refused by `engine` for `reason` (a typed error: the link is kept).
pub(crate) fn unsupported(engine: &'static str, reason: &'static str) -> IpcError {
    IpcError::RegionUnsupported { engine, reason }
}

/// An engine's name, for errors.
pub(crate) fn engine_name(engine: CopyEngine) -> &'static str {
    match engine {
        CopyEngine::Nccl => "nccl",
        _ => "tcp",
    }
}

/// The engine that carries a copy of memory at `ptr`.
pub(crate) fn engine_for(ptr: MemPtr) -> CopyEngine {
    match ptr {
        MemPtr::Host(_) => CopyEngine::Tcp,
        MemPtr::Device(_) => CopyEngine::Nccl,
    }
}

/// The peer as the transfer engines name it (a host link's peer only).
pub(crate) fn engine_peer(peer: &PeerInfo) -> Option<EnginePeer> {
    let host = peer.host()?;
    Some(EnginePeer {
        process: peer.process,
        host: host.host,
        data_addr: host.data_addr,
    })
}

/// The peer and our engines, for a copy by `engine`: refused (typed, the link kept)
/// where the peer announced no TCP engine, or this node cannot send it.
pub(crate) fn copy_plane(
    node: &NodeCore,
    peer: &PeerInfo,
    engine: CopyEngine,
) -> Result<(EnginePeer, Arc<HostPlane>), ActorError> {
    let name = engine_name(engine);
    let peer = engine_peer(peer)
        .filter(|p| p.data_addr.is_some())
        .ok_or_else(|| unsupported(name, "the peer announced no TCP engine"))?;
    let plane = node
        .plane()
        .ok_or_else(|| unsupported(name, "this node has no host link"))?;
    if engine == CopyEngine::Nccl {
        // Made now, so that a node without NCCL refuses the offer, not its pull.
        node.nccl()?;
    }
    Ok((peer, plane))
}

/// A device copy not sent yet: its bytes (pinned by their lease) and the work before the
/// offer that its send must follow.
pub(crate) struct DeviceCopy {
    source: CopySource,
    /// Where its bytes start in the source (a range lease's first byte; 0 for a forward,
    /// whose view starts there already).
    offset: usize,
    len: usize,
    fence: Option<Arc<dyn ExportedFence>>,
}

/// Where a copy's bytes are read from.
enum CopySource {
    /// A buffer of ours, pinned by the lease offered on it.
    Own(Arc<BufferCell>),
    /// A lease of ours on another process's buffer (a forward): our view of its mapping,
    /// and what pins the lease ([`LeasePin`](crate::forwarding::LeasePin)).
    Forwarded(Box<Imported>, Box<dyn std::any::Any + Send + Sync>),
}

impl DeviceCopy {
    /// `len` bytes of our own buffer from `offset`, after `fence`.
    pub(crate) fn own(
        cell: Arc<BufferCell>,
        offset: usize,
        len: usize,
        fence: Option<Arc<dyn ExportedFence>>,
    ) -> Self {
        let source = CopySource::Own(cell);
        Self {
            source,
            offset,
            len,
            fence,
        }
    }

    /// All of `view`, a lease of ours on another process's buffer that `keep` pins, after
    /// `fence`.
    pub(crate) fn forwarded(
        view: Imported,
        keep: Box<dyn std::any::Any + Send + Sync>,
        fence: Option<Arc<dyn ExportedFence>>,
    ) -> Self {
        let len = view.len();
        let source = CopySource::Forwarded(Box::new(view), keep);
        Self {
            source,
            offset: 0,
            len,
            fence,
        }
    }

    /// The work its send must follow.
    pub(crate) fn fence(&self) -> Option<&Arc<dyn ExportedFence>> {
        self.fence.as_ref()
    }

    /// Starts its send to `peer` through the node's NCCL engine, as the transfer of
    /// `lease`.
    pub(crate) fn start(
        self,
        node: &NodeCore,
        peer: &PeerInfo,
        lease: LeaseId,
    ) -> Result<HeldTransfer, ActorError> {
        let peer = engine_peer(peer).ok_or_else(|| unsupported("nccl", "not a host link"))?;
        let nccl = node.nccl()?;
        let id = TransferId(lease.get());
        Ok(match self.source {
            CopySource::Own(cell) => {
                HeldTransfer::send(&*nccl, &peer, id, cell.alloc.clone(), self.offset, self.len)?
            }
            CopySource::Forwarded(view, keep) => {
                HeldTransfer::send_view(&*nccl, &peer, id, *view, keep)?
            }
        })
    }
}

/// Waits for each transfer for at most `allowed` from now: the first failure, or a
/// timeout that names the whole allowance.
pub(crate) fn wait_all(transfers: &[HeldTransfer], allowed: Duration) -> Result<(), IpcError> {
    let by = Instant::now() + allowed;
    for t in transfers {
        loop {
            let left = by.saturating_duration_since(Instant::now());
            match t.wait(left.min(Duration::from_millis(500))) {
                Ok(()) => break,
                Err(IpcError::Timeout { .. }) if !left.is_zero() => {}
                Err(IpcError::Timeout { .. }) => {
                    return Err(IpcError::Timeout {
                        op: "waiting for a copy to land",
                        after: allowed,
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Holds a finished send until the engine reports it (bounded by the engine's stall
/// timeout), so that its memory is kept until then; started sends are reaped here.
///
/// A device send that fails cuts `link`: NCCL pairs a communicator's sends and receives
/// by their order only, and after a failure the two sides no longer agree which of the
/// peer's receives the next send would meet (a send that failed before NCCL saw it — its
/// communicator could not be made — leaves the peer's receive waiting for the next one,
/// with the next buffer's bytes). The cut also tells the receiver at once, which would
/// otherwise wait for its copy's whole allowance. Host copies are named by their lease on
/// the wire and need no such cut (`link` is `None`).
pub(crate) fn reap(transfer: Arc<HeldTransfer>, link: Option<LinkRef>) {
    tokio::task::spawn_blocking(move || {
        while !transfer.is_finished() {
            match transfer.wait(Duration::from_secs(1)) {
                Ok(()) | Err(IpcError::Timeout { .. }) => {}
                Err(e) => {
                    tracing::debug!(transfer = %transfer.id(), error = %e, "a copy's send failed");
                    if let Some(link) = &link {
                        let lease = LeaseId::new(transfer.id().0);
                        link.do_send(CutOff(order_lost(lease, &e)));
                    }
                }
            }
        }
    });
}

/// Allocates a buffer of ours per offer and posts its receive from `peer` on its engine.
pub(crate) fn post_receives(
    node: &NodeCore,
    peer: &PeerInfo,
    offers: &[Offer],
) -> Result<Vec<HeldTransfer>, IpcError> {
    let (plane, peer) = match (node.plane(), engine_peer(peer)) {
        (Some(plane), Some(peer)) => (plane, peer),
        _ => return Err(unsupported("tcp", "this node has no host link")),
    };
    let backend = node.backend();
    let mut receiving = Vec::with_capacity(offers.len());
    for offer in offers {
        let len = offer.handle.len as usize;
        let engine = copy_engine(offer);
        let nccl = match engine {
            CopyEngine::Nccl => Some(node.nccl()?),
            _ => None,
        };
        let alloc = backend.allocate(len)?;
        if engine_for(alloc.ptr()) != engine {
            return Err(unsupported(
                engine_name(engine),
                "a copy lands in memory of the kind it was sent from: this node allocates the other kind (host memory crosses between host-memory nodes, device memory between CUDA nodes)",
            ));
        }
        let id = TransferId(offer.lease.get());
        let posted = match &nccl {
            Some(nccl) => HeldTransfer::recv(&**nccl, &peer, id, alloc, 0, len)?,
            None => HeldTransfer::recv(&plane.engine, &peer, id, alloc, 0, len)?,
        };
        receiving.push(posted);
    }
    Ok(receiving)
}

/// Declines the offered host copies' transfers from `peer` (a receive of one that was
/// posted is replaced): the sender sends them all the same, and they must not hold up the
/// copies behind them on its connection.
pub(crate) fn decline_copies(node: &NodeCore, peer: &PeerInfo, offers: &[Offer]) {
    if let (Some(plane), Some(peer)) = (node.plane(), engine_peer(peer)) {
        for offer in offers.iter().filter(|o| copy_engine(o) == CopyEngine::Tcp) {
            let id = TransferId(offer.lease.get());
            if let Err(e) = decline(&plane.engine, &peer, id) {
                tracing::debug!(%id, error = %e, "could not decline a copy");
            }
        }
    }
}

/// A lease on our own copy `cell` that landed for the peer's `lease` over `link`, opened
/// through the import cache as `Node::local` opens one.
pub(crate) fn open_copy(
    node: &NodeCore,
    link: &LinkRef,
    lease: LeaseId,
    cell: Arc<BufferCell>,
) -> Result<IncomingLease, IpcError> {
    let (handle, mut fds) = node.exports().own_handle(&cell)?;
    let imported = node.cache().open_unordered(&handle, &mut fds)?;
    let order = LeaseOrder::new(
        Arc::clone(imported.backend()),
        node.session().process(),
        None,
    );
    let path = LeasePath::copied(&cell);
    node.observed().paths.opened(path, handle.len);
    Ok(IncomingLease {
        imported: Some(imported),
        lease,
        link: link.clone(),
        held: Arc::default(),
        order,
        path,
        copy: Some(cell),
        parts: None,
    })
}

/// A copy's send if the engine may still read the buffer after its lease came back — a
/// `Release` before the bytes landed, which an honest receiver never sends (it releases
/// once they landed, or declines them) — else `None`. The lease ends only once that send
/// has let go (`PeerLink::on_release`): until then the owner may not write the buffer the
/// engine reads.
pub(crate) fn still_sending(sending: Option<Arc<HeldTransfer>>) -> Option<Arc<HeldTransfer>> {
    // Finished: its abort returns at once, and says whether the engine let go.
    sending.filter(|transfer| !(transfer.is_finished() && transfer.abort()))
}

/// The peer gave back the lease of a forward's copy: `reply` hears that it landed if its
/// send finished without error within `within` (on a blocking thread: the engine reports
/// a send's end a moment after the receiver's), else that the receiver refused it
/// (`sending` is `None`: never pulled, or pulled and not started).
pub(crate) fn forward_released(
    lease: LeaseId,
    reply: oneshot::Sender<Result<LeaseId, ActorError>>,
    sending: Option<Arc<HeldTransfer>>,
    within: Duration,
) {
    let Some(transfer) = sending else {
        let _ = reply.send(Err(ActorError::ForwardRefused {
            reason: "the peer refused the copy".into(),
        }));
        return;
    };
    tokio::task::spawn_blocking(move || {
        let outcome = match transfer.wait(within) {
            Ok(()) => Ok(lease),
            Err(e) => Err(ActorError::ForwardRefused {
                reason: format!("the copy did not land: {e}"),
            }),
        };
        // Dropped first: the lease it reads from is let go of before the forward's caller
        // hears that it is done.
        drop(transfer);
        let _ = reply.send(outcome);
    });
}

/// A link to `peer` ends: every transfer with it stops touching memory before the ledger
/// takes the link's leases back. The TCP engine's transfers stop here (a socket
/// shutdown): each ends in its reaper, which keeps its memory until the engine lets go of
/// it. The NCCL engine's abort, which can hang, is returned for the caller to run off the
/// links' shared thread before it lets the leases go (`PeerLink::stopped`, issue 45).
pub(crate) fn abort_peer(
    node: &NodeCore,
    peer: &PeerInfo,
) -> Option<(Arc<NcclEngine>, EnginePeer)> {
    let (plane, peer) = (node.plane()?, engine_peer(peer)?);
    plane.engine.abort_peer(&peer);
    plane.nccl().map(|nccl| (nccl, peer))
}
