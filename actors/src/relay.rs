//! Forwarding: a process passes a buffer it leased on to a third process, zero-copy
//! (A → B → C), and the exporter's ledger counts the third process as a holder.
//!
//! Design choice: *relay through the exporter's ledger*. B does not re-export A's memory
//! (it could not: an imported CUDA IPC mapping cannot be exported again, and B closed the
//! `memfd` descriptor once it mapped it). B asks A, over the A–B link, to lease the buffer
//! of one of B's leases to C; A records a new lease whose holder is C, builds an offer for
//! it (with the allocation's descriptor), and sends it to B, which passes it on to C
//! unopened — descriptor included — under a lease id of its own:
//!
//! ```text
//!  A (exporter)                    B (holds lease 1)                 C (no link to A)
//!    <── Forward { id, lease 1, to: C } ──   Peer::forward(&lease)
//!    records lease 2, holder C; watches C's pid
//!    ── Forwarded { id, Offer lease 2 + fd } ──>
//!                                     ── Relayed { Offer lease 7 + fd } ──>  opens it
//!                                                                          (no warm hold)
//!                                     <── Release { lease 7 } ──  after its mapping closed
//!    <── Release { lease 2 } ──  (B hands it on)
//! ```
//!
//! What each side keeps:
//!
//! - **A** (the [`Ledger`](crate::ledger)): the relayed lease, over the A–B link, with C
//!   as its holder ([`BufferLeases::forwarded`](crate::BufferLeases::forwarded)). A
//!   watches C's process itself (pidfd, with the start time against pid reuse), so C's
//!   death ends the lease whatever B does. If B's link goes down first, the lease is
//!   *stranded*: it keeps the memory allocated — whatever the backend's rule — until C is
//!   confirmed dead, since nothing can carry C's `Release` any more.
//! - **B** (this module's [`Relays`]): which of its lease ids stands for which of A's, so
//!   that C's `Release` (and A's `Revoke`) are handed on. B's own lease is independent: B
//!   may drop it while C holds the forwarded one. The forwards B asked A for and awaits
//!   are the A–B link's session's (`LinkSession::ask_forward`): per link, checked there.
//! - **C**: a lease like any other (the node's inbox receives it, see
//!   [`Node::set_inbox`](crate::Node::set_inbox)), but no warm mapping: the lease holds
//!   its mapping under a holder of its own ([`Relays::new_holder`], kept by the link's
//!   session with the lease), and its `Release` leaves only after the mapping is closed,
//!   so A never needs to ask C to `Unmap`.
//!
//! The limits are in `docs/FORWARDING.md`.
//!
//! This module is the node's part: the tables, below the node that keeps them and the
//! links that use them. The links' part — the messages' handlers, what A, B and C do with
//! each frame, and [`Peer::forward`](crate::Peer::forward) — is `link/forward.rs`; the
//! messages themselves are in `link_ref`.

use crate::ids::LinkId;
use crate::link_ref::LinkRef;
use baton_ipc::HolderId;
use baton_messages::LeaseId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Import-cache holders of relayed mappings are numbered apart from links' (a link's
/// holder id is its link id).
const RELAY_HOLDER: u64 = 1 << 63;

/// What a node knows of the forwards it takes part in: as relay (B), the offers passed
/// on; as final holder (C), the numbering of its relayed leases' holds.
#[derive(Debug, Default)]
pub(crate) struct Relays {
    next: AtomicU64,
    state: Mutex<RelayState>,
}

#[derive(Debug, Default)]
pub(crate) struct RelayState {
    /// B: offers passed on, by (downstream link, our lease id): the upstream link and the
    /// exporter's lease id.
    pub(crate) passed: HashMap<(LinkId, LeaseId), (LinkRef, LeaseId)>,
}

impl Relays {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, RelayState> {
        // Every operation leaves the maps consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// C: a fresh cache holder for one relayed lease.
    pub(crate) fn new_holder(&self) -> HolderId {
        HolderId(RELAY_HOLDER | (self.next.fetch_add(1, Ordering::Relaxed) + 1))
    }

    /// B: the exporter's lease that `lease`, passed on over `link`, stands for; forgotten.
    pub(crate) fn take_passed(&self, link: LinkId, lease: LeaseId) -> Option<(LinkRef, LeaseId)> {
        self.lock().passed.remove(&(link, lease))
    }

    /// `link` is down: offers passed over it are forgotten (their holder's death ends
    /// them at the exporter, which watches it). Offers passed on *from* it (its peer was
    /// their exporter) are kept until their holder gives them back, so that its `Release`
    /// is not taken for a lease we never granted; it then goes nowhere.
    pub(crate) fn link_stopped(&self, link: LinkId) {
        self.lock().passed.retain(|(down, _), _| *down != link);
    }
}
