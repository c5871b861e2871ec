//! Across hosts, a peer's identity is proven, not claimed (issue 45): every finding of the
//! host-link review written as the attack it describes — a token holder that claims
//! another process, forges a boot id, floods the listener, forwards a handle over TCP,
//! releases early — each checked to fail the way `docs/CROSS_HOST.md`'s threat model
//! says. Host backend, loopback TCP, runs in CI; the NCCL findings also run on a GPU
//! machine (`gpu-tests`).
//!
//! One module per part of the host link: `claims` (who a peer is), `listener` (bounds
//! before and after authentication), `copies` (the transfer engines' data and leases),
//! `rights` (the agent, forwards, stranded leases), `nccl` (rendezvous and aborts).

#[path = "support/actors.rs"]
mod actors;
#[path = "support/host_msgs.rs"]
mod host_msgs;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

#[path = "host_identity/claims.rs"]
mod claims;
#[path = "host_identity/copies.rs"]
mod copies;
#[path = "host_identity/listener.rs"]
mod listener;
#[path = "host_identity/nccl.rs"]
mod nccl;
#[path = "host_identity/rights.rs"]
mod rights;
