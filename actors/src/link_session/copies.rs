//! A host link's copies out: the state of each buffer this link lent as a copy (offered,
//! pulled, sending), the order the pulled device copies must start in, the forwards
//! waiting for their copy to land, and the bytes of copies coming in.
//!
//! Everything here is the session's because the peer drives it: a `Pull` moves a copy
//! (or is a fault), a `Release` ends one (and is routed by it). The shell (`link/copy.rs`)
//! owns the engines and the waits on fences; it reports what it started and asks what to
//! start next.

use super::Attach;
use baton_messages::LeaseId;
use std::collections::{HashMap, VecDeque};

/// The copies a link lent, by lease (see the [module docs](self)). Ours, not peer-fed:
/// one entry per offer this node made, forgotten when its lease comes back, when its frame
/// is never sent, and with the link.
pub(super) struct CopiesOut<A: Attach> {
    by_lease: HashMap<LeaseId, CopyOut<A>>,
    /// Device copies pulled and not started, in the order of their pulls (the order their
    /// sends must start in: NCCL pairs a communicator's sends and receives by order).
    /// A lease whose copy went meanwhile is skipped.
    pulls: VecDeque<LeaseId>,
    /// Forwards sent as copies, by the lease the peer sees: who waits for them to land.
    forwards: HashMap<LeaseId, A::Forward>,
    /// Bytes of the peer's copies being received now.
    bytes_in: usize,
}

/// A copy the link offered.
enum CopyOut<A: Attach> {
    /// A device copy, until the receiver pulls it.
    Offered(A::Copy),
    /// A device copy pulled, waiting for its turn.
    Pulled(A::Copy),
    /// Its send, under way.
    Sending(A::Sending),
}

impl<A: Attach> Default for CopiesOut<A> {
    fn default() -> Self {
        Self {
            by_lease: HashMap::new(),
            pulls: VecDeque::new(),
            forwards: HashMap::new(),
            bytes_in: 0,
        }
    }
}

/// How a lease released over a host link was lent: what of it is still going on.
pub(crate) enum CopyReleased<A: Attach> {
    /// A copy of a buffer of ours (the ledger counts its lease).
    Copy {
        /// Its send, if one started (it may still read the buffer).
        sending: Option<A::Sending>,
    },
    /// A forward's copy (no ledger of ours counts it): its waiter hears how it ended.
    Forward {
        /// Who waits for it.
        waiter: A::Forward,
        /// Its send, if one started (none: the receiver refused it unpulled).
        sending: Option<A::Sending>,
    },
}

impl<A: Attach> CopiesOut<A> {
    pub(super) fn offered(&mut self, lease: LeaseId, copy: A::Copy) {
        self.by_lease.insert(lease, CopyOut::Offered(copy));
    }

    pub(super) fn sending(&mut self, lease: LeaseId, sending: A::Sending) {
        self.by_lease.insert(lease, CopyOut::Sending(sending));
    }

    pub(super) fn forwarded(&mut self, lease: LeaseId, waiter: A::Forward) {
        self.forwards.insert(lease, waiter);
    }

    /// The peer pulled `lease`: `false` unless it is a device copy offered and not pulled.
    pub(super) fn pull(&mut self, lease: LeaseId) -> bool {
        match self.by_lease.remove(&lease) {
            Some(CopyOut::Offered(copy)) => {
                self.by_lease.insert(lease, CopyOut::Pulled(copy));
                self.pulls.push_back(lease);
                true
            }
            Some(other) => {
                self.by_lease.insert(lease, other);
                false
            }
            None => false,
        }
    }

    /// The pulled copy whose send is next, if any (those whose lease went are skipped).
    pub(super) fn next_pulled(&mut self) -> Option<&A::Copy> {
        while let Some(lease) = self.pulls.front() {
            if let Some(CopyOut::Pulled(_)) = self.by_lease.get(lease) {
                break;
            }
            self.pulls.pop_front();
        }
        let lease = self.pulls.front()?;
        match self.by_lease.get(lease) {
            Some(CopyOut::Pulled(copy)) => Some(copy),
            _ => None,
        }
    }

    /// Takes the next pulled copy to start its send ([`next_pulled`](Self::next_pulled)).
    pub(super) fn take_pulled(&mut self) -> Option<(LeaseId, A::Copy)> {
        self.next_pulled()?;
        let lease = self.pulls.pop_front()?;
        match self.by_lease.remove(&lease) {
            Some(CopyOut::Pulled(copy)) => Some((lease, copy)),
            _ => None,
        }
    }

    /// The send of `lease`, if one started; its entry is forgotten.
    pub(super) fn forget(&mut self, lease: LeaseId) -> Option<A::Sending> {
        match self.by_lease.remove(&lease) {
            Some(CopyOut::Sending(sending)) => Some(sending),
            _ => None,
        }
    }

    /// The peer released `lease` (see [`CopyReleased`]).
    pub(super) fn released(&mut self, lease: LeaseId) -> CopyReleased<A> {
        let sending = self.forget(lease);
        match self.forwards.remove(&lease) {
            Some(waiter) => CopyReleased::Forward { waiter, sending },
            None => CopyReleased::Copy { sending },
        }
    }

    /// Whether `bytes` more of copies coming in stay within `limit` (then they count).
    pub(super) fn admit_in(&mut self, bytes: usize, limit: usize) -> bool {
        match self.bytes_in.checked_add(bytes) {
            Some(total) if total <= limit => {
                self.bytes_in = total;
                true
            }
            _ => false,
        }
    }

    /// Copies coming in of `bytes` landed or failed.
    pub(super) fn landed_in(&mut self, bytes: usize) {
        self.bytes_in = self.bytes_in.saturating_sub(bytes);
    }

    #[cfg(test)]
    pub(super) fn bytes_in(&self) -> usize {
        self.bytes_in
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_lease.len()
    }

    /// The link ended: the waiters of its forwards; every copy is forgotten.
    pub(super) fn end(&mut self) -> Vec<A::Forward> {
        self.by_lease.clear();
        self.pulls.clear();
        self.forwards.drain().map(|(_, waiter)| waiter).collect()
    }
}
