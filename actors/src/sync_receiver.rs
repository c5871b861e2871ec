//! The receiving end of versioned syncs: [`SyncReceiver`] stages each part of version
//! N+1 in memory of its own and makes it the committed copy only when every part has
//! landed — double-buffered, so that what it holds is always exactly N or N+1.

use crate::bundle::{Bundle, SharedBundle};
use crate::error::ActorError;
use crate::node::Node;
use crate::versions::{Staged, SyncProgress, SyncState};
use baton_messages::SyncCancel;
use std::time::Instant;
use tracing::{debug, warn};

/// A receiver of versioned syncs (a trainer's weights, in one or more bundles, arriving
/// at an inference engine): it is always on exactly one version, whole.
///
/// Each part that arrives ([`receive`](Self::receive)) is checked against the receiver's
/// version — only parts of N+1 are taken, stale, skipping, replaced, cancelled, expired
/// and malformed ones are refused with [`ActorError::Version`] — then copied into a
/// *staging* bundle of this node and its lease given back at once. When the last part of
/// the sync lands, the staging bundles become the committed ones in one swap that cannot
/// fail, and the old committed ones become the next staging. Nothing half-received is ever
/// committed: a sender killed between parts, a part whose exporter died while it was
/// copied, a sync cancelled or past its deadline all leave the receiver on N, with N's
/// bytes, readable after the sender is gone (they are this process's memory).
///
/// The cost is a second copy of the model in this process's memory (host or device, the
/// node's backend). [`parts`](Self::parts) are the committed bundles: read them
/// ([`Bundle::read`], [`Bundle::tensor_ptr`]), copy them into parameters of your own, or
/// share them on. A committed bundle that is still leased out when it comes round as
/// staging is not written: a fresh one is allocated in its place.
#[derive(Debug)]
pub struct SyncReceiver {
    node: Node,
    state: SyncState,
    /// The committed version's parts, in order (empty at version 0).
    front: Vec<Bundle>,
    /// Staging: one slot per part of the sync under way (reused from the version before).
    back: Vec<Option<Bundle>>,
}

impl SyncReceiver {
    /// A receiver on version 0 (nothing yet), staging in `node`'s memory.
    pub fn new(node: &Node) -> Self {
        Self {
            node: node.clone(),
            state: SyncState::new(0),
            front: Vec::new(),
            back: Vec::new(),
        }
    }

    /// The committed version (0: none yet).
    pub fn version(&self) -> u64 {
        self.state.version()
    }

    /// The committed version's bundles, by part index (empty at version 0).
    pub fn parts(&self) -> &[Bundle] {
        &self.front
    }

    /// The sync being staged, if one is.
    pub fn staging(&self) -> Option<Staged> {
        self.state.staging(Instant::now())
    }

    /// Takes a part of a sync: checks its stamp, copies it into staging and gives its lease
    /// back; commits the version when it was the last part.
    ///
    /// # Errors
    /// [`ActorError::Version`] when the stamp refuses it (stale, skipping ahead, of a sync
    /// that is over, disagreeing with its sync, malformed, none); as
    /// [`SharedBundle::open`], [`Node::allocate_bundle`] and [`Bundle::write`] when it
    /// cannot be copied (an [`Orphaned`](ActorError::Orphaned) lease: its sender died
    /// before the part was whole here). The part is then not staged; the version stays.
    pub fn receive(&mut self, part: SharedBundle) -> Result<SyncProgress, ActorError> {
        let stamp = match self.state.admit(part.stamp(), Instant::now()) {
            Ok(stamp) => stamp,
            Err(fault) => {
                debug!(version = self.version(), %fault, "sync part refused");
                return Err(fault.into());
            }
        };
        let lease = part.open()?;
        let slot = stamp.part as usize;
        self.back.resize_with(stamp.parts as usize, || None);
        let reusable = self.back[slot]
            .as_ref()
            .is_some_and(|b| b.layout() == lease.layout() && b.buffer().leases_out() == 0);
        if !reusable {
            self.back[slot] = Some(self.node.allocate_bundle(lease.layout().clone())?);
        }
        let staged = self.back[slot].as_ref().expect("allocated above");
        let len = lease.layout().byte_len() as usize;
        // Host memory is copied from the mapping in place; device memory through host
        // memory (one read and one write of the part's bytes).
        let copied = match lease.lease().as_slice() {
            Ok(bytes) => staged.buffer().write_at(0, &bytes[..len]),
            Err(ActorError::NotHostMemory) => {
                let mut bytes = vec![0u8; len];
                lease
                    .lease()
                    .read_into(0, &mut bytes)
                    .and_then(|()| staged.buffer().write_at(0, &bytes))
            }
            Err(e) => Err(e),
        };
        drop(lease);
        if let Err(e) = copied {
            warn!(%stamp, error = %e, "a sync part could not be staged");
            return Err(e);
        }
        let progress = self.state.landed(&stamp).ok_or(ActorError::SyncOver {
            version: stamp.version,
            why: "it was given up while the part was copied",
        })?;
        if let SyncProgress::Committed { version } = progress {
            let staged: Vec<Bundle> = self.back.drain(..).map(|b| b.expect("landed")).collect();
            let old = std::mem::replace(&mut self.front, staged);
            self.back = old.into_iter().map(Some).collect();
            debug!(version, parts = self.front.len(), "sync committed");
        }
        Ok(progress)
    }

    /// Drops the staged sync when `cancel` names it; returns whether it did.
    pub fn cancel(&mut self, cancel: &SyncCancel) -> bool {
        self.state.cancel(cancel)
    }
}
