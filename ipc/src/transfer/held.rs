//! [`HeldTransfer`]: the safe form of [`TransferEngine::send`] and
//! [`TransferEngine::recv`] for memory this crate allocated — the transfer keeps its
//! [`Allocation`] alive until the engine no longer touches it, and a dropped transfer is
//! aborted first.

use super::{EnginePeer, Region, Transfer, TransferEngine, TransferId};
use crate::backend::{Allocation, MemPtr};
use crate::cache::Imported;
use crate::{Error, Result};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// What a [`HeldTransfer`] keeps alive: the allocation it sends from (shared with its
/// owner), or the one it receives into (its own until it lands).
enum Kept {
    /// Held only to keep the memory alive.
    #[allow(dead_code)]
    Shared(Arc<Allocation>),
    Owned(Allocation),
    /// A view of another process's memory this process maps (a lease it holds), and what
    /// else must live as long as the engine may read it (the lease's pin).
    #[allow(dead_code)]
    View(Box<Imported>, Box<dyn std::any::Any + Send + Sync>),
}

/// A transfer of part of an [`Allocation`] that holds the allocation until the engine no
/// longer touches it, and aborts it first when dropped unfinished.
pub struct HeldTransfer {
    transfer: Transfer,
    /// `Some` until drop or [`into_allocation`](Self::into_allocation).
    kept: Option<Kept>,
}

impl fmt::Debug for HeldTransfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldTransfer")
            .field("transfer", &self.transfer)
            .finish()
    }
}

/// Bytes `offset..offset + len` of `alloc`, as a region.
fn region_of(alloc: &Allocation, offset: usize, len: usize) -> Result<Region> {
    match offset.checked_add(len) {
        Some(end) if end <= alloc.size() => {}
        _ => {
            return Err(Error::OutOfBounds {
                offset,
                len,
                size: alloc.size(),
            });
        }
    }
    let ptr = alloc.ptr().offset_by(offset);
    Ok(Region {
        ptr,
        len,
        device: match ptr {
            MemPtr::Host(_) => None,
            MemPtr::Device(_) => Some(alloc.device()),
        },
    })
}

/// Declines transfer `id` from `peer`: its bytes, when they come, are read past and
/// dropped, and the sender's transfer fails ([`Error::TransferPeerGone`]: the receiver
/// aborted it). For a receiver
/// that refuses what it was offered, so that the sender's bytes do not hold up the
/// transfers behind them on their connection.
///
/// # Errors
/// The engine's refusal to post a receive.
pub fn decline(engine: &dyn TransferEngine, peer: &EnginePeer, id: TransferId) -> Result<()> {
    let mut byte = [0u8; 1];
    // SAFETY: the receive is aborted before `byte` goes out of scope, and an aborted
    // transfer is never touched again (`abort` returns once no engine thread touches
    // it, and an engine thread starts touching only a transfer that is not aborted).
    let transfer = unsafe { engine.recv(peer, id, Region::of_slice(&mut byte))? };
    transfer.abort();
    Ok(())
}

impl HeldTransfer {
    /// Starts sending bytes `offset..offset + len` of `alloc` to `peer` as transfer `id`,
    /// keeping `alloc` until the transfer has finished or been aborted.
    ///
    /// The bytes should not change meanwhile (Baton's exporters refuse their own writes
    /// while the lease a send serves is out); memory shared with other processes may
    /// still be written by them, as everywhere in this crate (see
    /// [`RawMemory::host_bytes`](crate::RawMemory::host_bytes)).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]; the engine's refusal ([`Error::RegionUnsupported`]: memory
    /// it does not move).
    pub fn send(
        engine: &dyn TransferEngine,
        peer: &EnginePeer,
        id: TransferId,
        alloc: Arc<Allocation>,
        offset: usize,
        len: usize,
    ) -> Result<HeldTransfer> {
        let src = region_of(&alloc, offset, len)?;
        // SAFETY: `src` lies within `alloc` (checked above), which this transfer keeps
        // alive until the engine no longer touches it: `Drop` aborts an unfinished
        // transfer (the abort returns once no engine thread touches the memory) before
        // it lets go of `alloc`.
        let transfer = unsafe { engine.send(peer, id, src)? };
        Ok(HeldTransfer {
            transfer,
            kept: Some(Kept::Shared(alloc)),
        })
    }

    /// Starts sending the bytes of `view` (memory of another process that this one maps)
    /// to `peer` as transfer `id`, keeping the view — so the mapping — and `also` until
    /// the transfer has finished or been aborted. What `also` is for: whatever keeps the
    /// bytes from changing meanwhile (the lease the view belongs to, which its exporter
    /// counts until it comes back).
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub fn send_view(
        engine: &dyn TransferEngine,
        peer: &EnginePeer,
        id: TransferId,
        view: Imported,
        also: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<HeldTransfer> {
        let ptr = view.ptr();
        let src = Region {
            ptr,
            len: view.len(),
            device: match ptr {
                MemPtr::Host(_) => None,
                MemPtr::Device(_) => Some(view.device()),
            },
        };
        // SAFETY: `src` is the view's bytes, inside the mapping the view keeps open;
        // this transfer keeps the view until the engine no longer touches it: `Drop`
        // aborts an unfinished transfer (the abort returns once no engine thread touches
        // the memory) before it lets go of the view, or hands the view to a keeper thread
        // that waits for the engine to let go.
        let transfer = unsafe { engine.send(peer, id, src)? };
        Ok(HeldTransfer {
            transfer,
            kept: Some(Kept::View(Box::new(view), also)),
        })
    }

    /// Starts receiving transfer `id` from `peer` into bytes `offset..offset + len` of
    /// `alloc`, which it owns until it lands ([`into_allocation`](Self::into_allocation)).
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub fn recv(
        engine: &dyn TransferEngine,
        peer: &EnginePeer,
        id: TransferId,
        alloc: Allocation,
        offset: usize,
        len: usize,
    ) -> Result<HeldTransfer> {
        let dst = region_of(&alloc, offset, len)?;
        // SAFETY: `dst` lies within `alloc`, which this transfer owns, so nothing else
        // reads or writes it through this process's allocation until it is handed back
        // (`into_allocation` aborts an unfinished transfer first, as `Drop` does); the
        // allocation is fresh memory of this process, exported to nobody yet.
        let transfer = unsafe { engine.recv(peer, id, dst)? };
        Ok(HeldTransfer {
            transfer,
            kept: Some(Kept::Owned(alloc)),
        })
    }

    /// Its id.
    pub fn id(&self) -> TransferId {
        self.transfer.id()
    }

    /// Waits at most `timeout` for it to finish (see [`Transfer::wait`]).
    ///
    /// # Errors
    /// As [`Transfer::wait`].
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        self.transfer.wait(timeout)
    }

    /// Whether it has finished (landed or failed).
    pub fn is_finished(&self) -> bool {
        self.transfer.is_finished()
    }

    /// Stops it (see [`Transfer::abort`]): whether the engine no longer touches the memory.
    pub fn abort(&self) -> bool {
        self.transfer.abort()
    }

    /// Waits at most `timeout` until no engine thread touches its memory: whether none does
    /// (see [`Transfer::wait_untouched`]).
    pub fn wait_untouched(&self, timeout: Duration) -> bool {
        self.transfer.wait_untouched(timeout)
    }

    /// The allocation a receive filled — after aborting the transfer if it has not
    /// finished, so nothing touches it any more. `None` for a send (the owner has it), and
    /// for a receive the engine still touches after its abort (then kept, as on drop).
    pub fn into_allocation(mut self) -> Option<Allocation> {
        if !self.transfer.abort() {
            return None;
        }
        match self.kept.take() {
            Some(Kept::Owned(alloc)) => Some(alloc),
            _ => None,
        }
    }
}

impl Drop for HeldTransfer {
    fn drop(&mut self) {
        // Unfinished: the engine stops touching the memory before it may go.
        if self.transfer.abort() {
            drop(self.kept.take());
            return;
        }
        // The engine's own abort hangs: the memory is kept (the freeing rule) until the
        // engine lets go of it, by a thread of its own (the liveness rule: the caller
        // goes on). Never freed if it never does.
        let (Some(kept), id) = (self.kept.take(), self.transfer.id()) else {
            return;
        };
        let bytes = match &kept {
            Kept::Shared(a) => a.size(),
            Kept::Owned(a) => a.size(),
            Kept::View(v, _) => v.len(),
        };
        tracing::warn!(transfer = %id, bytes, "an engine still touches an aborted transfer's memory: kept until it lets go");
        let transfer = self.transfer.clone_handle();
        let (tx, rx) = std::sync::mpsc::channel::<Kept>();
        let keeper = std::thread::Builder::new()
            .name("baton-transfer-keep".into())
            .spawn(move || {
                let Ok(kept) = rx.recv() else { return };
                while !transfer.wait_untouched(Duration::from_secs(60)) {}
                tracing::info!(transfer = %id, "the engine let go of an aborted transfer's memory: freed");
                drop(kept);
            });
        let unkept = match keeper {
            Ok(_) => tx.send(kept).err().map(|back| back.0),
            Err(e) => {
                tracing::warn!(error = %e, "no thread to keep a transfer's memory");
                Some(kept)
            }
        };
        if let Some(kept) = unkept {
            // Kept for the life of the process rather than freed under the engine.
            std::mem::forget(kept);
        }
    }
}
