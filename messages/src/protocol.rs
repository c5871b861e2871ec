//! The messages of the link and of the lease protocol.
//!
//! A link opens with a three-message handshake in which both sides prove they know the
//! session token without sending it:
//!
//! ```text
//! client                                   server
//!   Hello   { version, process, nonce_c }  ->
//!        <-  Welcome { version, process, nonce_s, proof_s }
//!   Auth    { proof_c }                    ->
//! ```
//!
//! (`proof_s` and `proof_c` are keyed digests of both nonces under the token, with distinct
//! labels.) A side that refuses says why with [`Refused`] and closes. No handle is sent
//! before the handshake completes.
//!
//! The lease protocol then runs in both directions: an exporter [`Offer`]s a handle under a
//! fresh lease, the importer [`Release`]s it when its guard drops, the exporter may ask for
//! it back early with [`Revoke`], and says [`Gone`] when an allocation is freed.

use crate::handle::HandleMsg;
use crate::ids::{AllocationId, Generation, LeaseId, ProcessId};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A fresh random challenge of one handshake.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Nonce(pub [u8; 32]);

impl fmt::Debug for Nonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Nonce({:02x}{:02x}…)", self.0[0], self.0[1])
    }
}

/// A keyed digest proving knowledge of the session token.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct AuthProof(pub [u8; 32]);

impl fmt::Debug for AuthProof {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthProof(..)")
    }
}

/// First message of a link, from the connecting side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Hello {
    /// The protocol version the client speaks.
    pub version: u8,
    /// Who the client is.
    pub process: ProcessId,
    /// The client's challenge.
    pub nonce: Nonce,
}

/// The accepting side's answer to [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Welcome {
    /// The protocol version the server speaks.
    pub version: u8,
    /// Who the server is.
    pub process: ProcessId,
    /// The server's challenge.
    pub nonce: Nonce,
    /// The server's proof over both nonces.
    pub proof: AuthProof,
}

/// The client's proof, completing the handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Auth {
    /// The client's proof over both nonces.
    pub proof: AuthProof,
}

/// Why a side refused a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[non_exhaustive]
pub enum RefuseReason {
    /// The versions differ; this side speaks `supported`.
    VersionMismatch {
        /// The version the refusing side speaks.
        supported: u8,
    },
    /// The proof did not verify: the peer does not hold this session's token.
    BadToken,
    /// The peer's credentials are not allowed.
    NotAllowed,
    /// The peer broke the protocol (an unexpected message).
    ProtocolViolation,
}

/// A refusal, sent before closing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Refused {
    /// Why.
    pub reason: RefuseReason,
}

/// An exporter grants the receiver a lease on a buffer.
///
/// The lease exists from the moment the offer is sent, so an offer lost in flight still
/// holds the buffer until the link closes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Offer {
    /// The new lease.
    pub lease: LeaseId,
    /// How to map the buffer.
    pub handle: HandleMsg,
}

/// An importer gives a lease back: it no longer maps the buffer through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Release {
    /// The lease given back.
    pub lease: LeaseId,
}

/// An exporter asks for a lease back by a deadline; after it, the link is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Revoke {
    /// The lease asked back.
    pub lease: LeaseId,
    /// Milliseconds the holder has to release it.
    pub deadline_ms: u32,
}

/// An exporter says an allocation (up to and including `generation`) is freed: handles
/// naming it are stale from now on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Gone {
    /// The freed allocation.
    pub alloc: AllocationId,
    /// Its last generation.
    pub generation: Generation,
}

/// Every message a link carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[non_exhaustive]
#[expect(
    clippy::large_enum_variant,
    reason = "Offer is the common message; boxing it would add an allocation per handoff"
)]
pub enum Message {
    /// Handshake, client: [`Hello`].
    Hello(Hello),
    /// Handshake, server: [`Welcome`].
    Welcome(Welcome),
    /// Handshake, client: [`Auth`].
    Auth(Auth),
    /// Either side refuses the link: [`Refused`].
    Refused(Refused),
    /// [`Offer`].
    Offer(Offer),
    /// [`Release`].
    Release(Release),
    /// [`Revoke`].
    Revoke(Revoke),
    /// [`Gone`].
    Gone(Gone),
    /// Liveness probe; answered with `Pong` of the same value.
    Ping(u64),
    /// Answer to `Ping`.
    Pong(u64),
}

impl Message {
    /// The message's name, for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello(_) => "Hello",
            Message::Welcome(_) => "Welcome",
            Message::Auth(_) => "Auth",
            Message::Refused(_) => "Refused",
            Message::Offer(_) => "Offer",
            Message::Release(_) => "Release",
            Message::Revoke(_) => "Revoke",
            Message::Gone(_) => "Gone",
            Message::Ping(_) => "Ping",
            Message::Pong(_) => "Pong",
        }
    }
}
