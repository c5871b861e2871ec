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
//! fresh lease, the importer [`Release`]s it when its guard drops, and the exporter may ask
//! for it back early with [`Revoke`]. GPU work is ordered both ways by fences
//! ([`crate::fence`]): the offer's handle carries the exporter's acquire fence, the
//! `Release` the importer's release fences.
//!
//! Mappings outlive leases: the importer keeps a mapping warm after its last lease drops,
//! so the next offer of the same allocation maps nothing new (and, for descriptor-shared
//! backends, carries no descriptor). The exporter ends that with [`Unmap`] — before it
//! frees the allocation, or when the importer asks with [`Evict`] to drop an idle mapping —
//! and the importer answers [`Unmapped`] once nothing in it maps the allocation:
//!
//! ```text
//! exporter                                  importer
//!   Offer { lease 1, handle + descriptor } ->   maps it (a mapping hold starts)
//!                                          <-   Release { lease 1 }   (stays mapped: warm)
//!   Offer { lease 2, handle }             ->    hit: no open
//!                                          <-   Release { lease 2 }
//!   (buffer dropped)  Unmap { alloc }     ->    closes when no lease uses it
//!                                          <-   Unmapped { alloc }
//!   (now frees)
//! ```
//!
//! Links ping each other on an interval (`Ping`/`Pong`); a peer that answers nothing
//! within a deadline is cut.
//!
//! A holder may pass a buffer on to a third process it is linked to ([`Forward`]): the
//! exporter grants that process a lease of its own and answers [`Forwarded`] with the
//! offer, which the holder passes on unopened as a [`Relayed`] offer; the third process's
//! `Release` comes back the same way (see `docs/FORWARDING.md`).
//!
//! Either side may ask the other what it holds ([`StatusRequest`], answered by
//! [`Status`]: see [`status`](crate::status)).

use crate::fence::FenceHandle;
use crate::handle::HandleMsg;
use crate::ids::{AllocationId, LeaseId, ProcessId};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A fresh random challenge of one handshake.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Nonce(#[serde(with = "crate::byte_array")] pub [u8; 32]);

impl fmt::Debug for Nonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Nonce({:02x}{:02x}…)", self.0[0], self.0[1])
    }
}

/// A keyed digest proving knowledge of the session token.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct AuthProof(#[serde(with = "crate::byte_array")] pub [u8; 32]);

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
    /// The listener already holds its cap of established host links (in all, or from the
    /// peer's key): try again once links are closed.
    TooManyLinks,
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
///
/// **A lease over several buffers.** Adjacent offers of one frame that name the same
/// `lease` are its *parts*: the receiver holds one lease, gives it back with one
/// [`Release`] (once it is done with every part; its fences follow every part's uses),
/// and a [`Revoke`] of it asks for every part. Each part is still its own handle, checked
/// and opened on its own. A lease named by offers that are not adjacent is a duplicate (a
/// protocol fault), and so are parts in a [`Relayed`] offer or over a link to another
/// host. Since protocol version 3.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Offer {
    /// The new lease.
    pub lease: LeaseId,
    /// How to map the buffer.
    pub handle: HandleMsg,
}

/// The most release fences one [`Release`] may carry; more is a protocol fault.
pub const MAX_RELEASE_FENCES: usize = 8;

/// An importer gives a lease back: it no longer maps the buffer through it, and queues no
/// more work on it.
///
/// Work it queued before may still run: `fences` are recorded after that work (on the
/// streams that used the lease), and the exporter waits on them before it writes the
/// buffer again or frees it. Empty when no queued work uses the buffer (host memory, or
/// leases used only through synchronous copies). At most [`MAX_RELEASE_FENCES`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Release {
    /// The lease given back.
    pub lease: LeaseId,
    /// Fences after the importer's last queued use of the buffer.
    #[cfg_attr(
        test,
        proptest(
            strategy = "proptest::collection::vec(proptest::prelude::any::<FenceHandle>(), 0..3)"
        )
    )]
    pub fences: Vec<FenceHandle>,
}

impl Release {
    /// A release with no fence: nothing the importer queued still uses the buffer.
    pub fn now(lease: LeaseId) -> Self {
        Self {
            lease,
            fences: Vec::new(),
        }
    }
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

/// The exporter asks the importer to close its mapping of an allocation (it is about to
/// free it, or it answers the importer's [`Evict`]) and to answer [`Unmapped`]. Offers of
/// the allocation sent after it carry its descriptor again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Unmap {
    /// The allocation.
    pub alloc: AllocationId,
}

/// The importer no longer maps an allocation through this link: the answer to an
/// [`Unmap`], sent once the mapping is closed (or another link of the process holds it),
/// or after an offer the importer could not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Unmapped {
    /// The allocation.
    pub alloc: AllocationId,
}

/// The importer asks to drop an idle mapping (its budget of warm mappings is exceeded);
/// the exporter answers with [`Unmap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Evict {
    /// The allocation.
    pub alloc: AllocationId,
}

/// The exporter retired one of its memory pools: it had no allocation left for a while.
/// Memory of a pool another process imported goes back to the device only once the pool
/// is destroyed and every importer dropped its import, so the importer drops its import
/// of the pool (mappings from it keep theirs; none should be left, since every allocation
/// of the pool was unmapped before it was freed). Later offers of the exporter's memory
/// come from a fresh pool, with its descriptor. One for a pool the importer never imported
/// changes nothing; the pool is the sender's own (the importer keys its imports by the
/// process the handshake proved), so no peer can make us drop another's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct PoolRetired {
    /// The pool, as handles of its memory name it (`RawHandle::CudaPool::pool`).
    pub pool: u64,
}

/// The sender made a shared-memory ring for the frames the receiver sends it (issue 48,
/// item 1; `baton_ipc::ring`) and passes its three descriptors beside this frame: slot 0
/// the sealed memory, slot 1 the doorbell, slot 2 the space bell. Sent at most once per
/// link, right after the handshake, only on a link within one host. The receiver checks
/// the descriptors; if they are a ring it answers [`Message::RingReady`] as its last frame
/// on the socket alone and writes every later frame into the ring (a frame with
/// descriptors, or too large for the ring, goes on the socket after a marker in the ring).
/// If it does not take the ring (the descriptors are not a ring, it may map no more ring
/// ends, it reads only its socket), it answers [`Message::RingDeclined`] and keeps writing
/// on the socket, and the sender lets its ring go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct RingOffer {
    /// The ring's data bytes, as its creator made it (the receiver checks it against the
    /// memory, which is what counts).
    pub capacity: u64,
}

/// A typed message for a named actor in the receiving process.
///
/// `payload` is the user's message, bincode-encoded; each `Shared<T>` field in it was
/// encoded as an index into `offers`, whose leases the sender created for this receiver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Call {
    /// Chosen by the caller; the [`Reply`] names it. Unique per link and direction.
    pub id: u64,
    /// The name the receiving actor was registered under.
    pub target: String,
    /// The message type's wire name, checked against what the target accepts.
    pub type_name: String,
    /// The encoded message.
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
    /// The buffers the message carries, each under a fresh lease for the receiver.
    pub offers: Vec<Offer>,
}

/// A [`Call`] whose parts are borrowed: it encodes as [`Message::Call`] of the same parts,
/// byte for byte, without copying them into an owned `Call` first (a sender's hot path:
/// [`codec::encode_call_frame`](crate::codec::encode_call_frame)). Decoding gives a
/// [`Message::Call`].
#[derive(Debug, Clone, Copy)]
pub struct CallRef<'a> {
    /// As [`Call::id`].
    pub id: u64,
    /// As [`Call::target`].
    pub target: &'a str,
    /// As [`Call::type_name`].
    pub type_name: &'a str,
    /// As [`Call::payload`].
    pub payload: &'a [u8],
    /// As [`Call::offers`].
    pub offers: &'a [Offer],
}

/// [`Message::Call`]'s variant index (the order of [`Message`]'s variants; a test pins it
/// against the derived encoding).
const CALL_VARIANT: u32 = 10;

impl Serialize for CallRef<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        /// [`Call`]'s fields, in its order, borrowed.
        #[derive(Serialize)]
        #[serde(rename = "Call")]
        struct Body<'a> {
            id: u64,
            target: &'a str,
            type_name: &'a str,
            #[serde(with = "serde_bytes")]
            payload: &'a [u8],
            offers: &'a [Offer],
        }
        let body = Body {
            id: self.id,
            target: self.target,
            type_name: self.type_name,
            payload: self.payload,
            offers: self.offers,
        };
        s.serialize_newtype_variant("Message", CALL_VARIANT, "Call", &body)
    }
}

/// Why a [`Call`] produced no reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[non_exhaustive]
pub enum CallFault {
    /// No actor is registered under the target name.
    NoSuchActor,
    /// The target accepts other message types.
    WrongType {
        /// The types the target accepts (`"a.X or b.Y"`).
        expected: String,
    },
    /// The payload did not decode as the target's message type.
    BadPayload(String),
    /// The target actor stopped before it answered.
    ActorGone,
    /// The reply could not be encoded or its buffers could not be shared.
    ReplyFailed(String),
    /// A buffer of the call could not be opened by the receiver (a local failure there: a
    /// descriptor limit, memory, an unsupported backend); every lease of the call was
    /// given back.
    OfferRefused(String),
}

/// The answer to a [`Call`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Reply {
    /// The call answered.
    pub id: u64,
    /// The encoded reply and the buffers it carries, or why there is none.
    pub outcome: Result<Payload, CallFault>,
}

/// An encoded message with the buffers it carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Payload {
    /// The encoded value.
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
    /// Its buffers, under fresh leases.
    pub offers: Vec<Offer>,
}

/// How far a [`StatusRequest`] reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[non_exhaustive]
pub enum StatusScope {
    /// The node that receives the request.
    Node,
    /// That node and, one level down, every peer linked to it (a supervision root and its
    /// children): each peer is asked for its own status, and its answer is put in its
    /// link's entry. Peers that do not answer within a deadline are named, without one.
    Tree,
}

/// Asks a node for its [`NodeStatus`](crate::status::NodeStatus). Any authenticated
/// peer may ask; the handshake refuses an unauthenticated connection before any frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct StatusRequest {
    /// Chosen by the asker; the [`Status`] names it.
    pub id: u64,
    /// This node only, or its linked peers too.
    pub scope: StatusScope,
    /// Entries wanted per list (capped at
    /// [`MAX_STATUS_ENTRIES`](crate::status::MAX_STATUS_ENTRIES); 0: the node's default).
    pub limit: u32,
}

/// The answer to a [`StatusRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Status {
    /// The request answered.
    pub id: u64,
    /// The schema version of the body ([`STATUS_VERSION`](crate::status::STATUS_VERSION)).
    pub version: u16,
    /// A [`NodeStatus`](crate::status::NodeStatus) as JSON (self-describing, so that
    /// tools and other languages read it and versions may differ), at most
    /// [`MAX_STATUS_BYTES`](crate::status::MAX_STATUS_BYTES).
    pub json: String,
}

/// A holder asks the exporter to lease the buffer of one of its leases to a third process
/// (forwarding, A → B → C, zero-copy): the exporter records a new lease whose holder is
/// `to`, and answers [`Forwarded`] with the offer, which the asker passes on unopened as a
/// [`Relayed`]. The new lease is the exporter's like any other: it counts `to` as a holder
/// until the holder's `Release` comes back through the asker, or `to` is seen dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Forward {
    /// Chosen by the asker; the [`Forwarded`] names it.
    pub id: u64,
    /// A lease the asker holds over this link: the buffer to forward.
    pub lease: LeaseId,
    /// The process that will hold the new lease.
    pub to: ProcessId,
}

/// The exporter's answer to a [`Forward`]: the offer of a new lease for the third process
/// (its descriptor, if any, beside the frame), or why there is none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Forwarded {
    /// The request answered.
    pub id: u64,
    /// The offer for the third process, or why the exporter refused.
    #[cfg_attr(
        test,
        proptest(
            strategy = "proptest::strategy::Strategy::boxed(proptest::prelude::any::<Result<Offer, String>>())"
        )
    )]
    pub outcome: Result<Offer, String>,
}

/// An offer of a third process's buffer, passed on by the sender of this frame: the handle
/// names its exporter, which granted the lease for the receiver (see [`Forward`]). The
/// `lease` is the sender's own name for it: the receiver's `Release` of it goes to the
/// sender, which hands it on to the exporter. The receiver keeps no warm mapping of it: it
/// closes the mapping before it sends that `Release`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Relayed {
    /// The offer; its lease id is the sender's.
    #[cfg_attr(
        test,
        proptest(
            strategy = "proptest::strategy::Strategy::boxed(proptest::prelude::any::<Offer>())"
        )
    )]
    pub offer: Offer,
}

/// Across hosts, the importer of an NCCL [`Copy`](crate::RawHandle::Copy) has posted its
/// receive: the exporter may start sending the lease's bytes now. NCCL pairs a
/// communicator's sends and receives in the order they start, so the exporter starts its
/// sends in the order of the pulls. Only on a host link, once per lease offered as such a
/// copy; anything else is a protocol fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Pull {
    /// The lease whose copy to send.
    pub lease: LeaseId,
}

/// Across hosts, a transfer engine's rendezvous message for its peer (the NCCL engine's
/// communicator offers: they hold the `ncclUniqueId` that opens the offerer's bootstrap
/// socket, so they travel only over the authenticated host link). At most
/// [`MAX_RENDEZVOUS_BYTES`]; the engine checks the rest.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Rendezvous {
    /// The engine's bytes (never logged).
    #[cfg_attr(
        test,
        proptest(strategy = "proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)")
    )]
    pub bytes: Vec<u8>,
}

impl fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendezvous")
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

/// The most bytes a [`Rendezvous`] carries; a larger one is a protocol fault.
pub const MAX_RENDEZVOUS_BYTES: usize = 1024;

/// Every message a link carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[non_exhaustive]
pub enum Message {
    /// Handshake, client: [`Hello`].
    Hello(Hello),
    /// Handshake, server: [`Welcome`].
    Welcome(Welcome),
    /// Handshake, client: [`Auth`].
    Auth(Auth),
    /// Either side refuses the link: [`Refused`].
    Refused(Refused),
    /// [`Offer`], boxed: a bare offer is rare (a handoff's offers travel inside its
    /// [`Call`] or [`Reply`]), and unboxed its 400 bytes made every message as large, each
    /// frame moved through a link's stream, its queue and its handler.
    Offer(Box<Offer>),
    /// [`Release`].
    Release(Release),
    /// [`Revoke`].
    Revoke(Revoke),
    /// [`Unmap`].
    Unmap(Unmap),
    /// [`Unmapped`].
    Unmapped(Unmapped),
    /// [`Evict`].
    Evict(Evict),
    /// [`Call`].
    Call(Call),
    /// [`Reply`].
    Reply(Reply),
    /// Liveness probe; answered with `Pong` of the same value.
    Ping(u64),
    /// Answer to `Ping`.
    Pong(u64),
    /// [`StatusRequest`].
    StatusRequest(StatusRequest),
    /// [`Status`].
    Status(Status),
    /// [`Forward`].
    Forward(Forward),
    /// [`Forwarded`] (boxed, as [`Message::Offer`]).
    Forwarded(Box<Forwarded>),
    /// [`Relayed`] (boxed, as [`Message::Offer`]).
    Relayed(Box<Relayed>),
    /// The sender's fence inbox lane for the receiver ([`InboxGrant`](crate::InboxGrant)): counter fences the
    /// receiver records for the sender are written there. At most once per link, right
    /// after the handshake; a second is a protocol fault.
    FenceInbox(crate::fence::InboxGrant),
    /// [`Pull`] (host links only).
    Pull(Pull),
    /// [`Rendezvous`] (host links only).
    Rendezvous(Rendezvous),
    /// [`PoolRetired`] (links within one host only).
    PoolRetired(PoolRetired),
    /// [`RingOffer`] (links within one host only; three descriptors beside it).
    RingOffer(RingOffer),
    /// The answer to a [`RingOffer`]: the sender's last frame on the socket alone; every
    /// later frame of the sender is in the ring, or on the socket after a marker in the
    /// ring. At most once per link, and only after the receiver's offer.
    RingReady,
    /// The answer to a [`RingOffer`] the sender does not take: it keeps writing on the
    /// socket, and the receiver drops the ring it offered (its memory and descriptors, and
    /// its slot in the process's budget of ring ends). Instead of [`Message::RingReady`];
    /// one that comes when no offer waits is ignored.
    RingDeclined,
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
            Message::Unmap(_) => "Unmap",
            Message::Unmapped(_) => "Unmapped",
            Message::Evict(_) => "Evict",
            Message::Call(_) => "Call",
            Message::Reply(_) => "Reply",
            Message::Ping(_) => "Ping",
            Message::Pong(_) => "Pong",
            Message::StatusRequest(_) => "StatusRequest",
            Message::Status(_) => "Status",
            Message::Forward(_) => "Forward",
            Message::Forwarded(_) => "Forwarded",
            Message::Relayed(_) => "Relayed",
            Message::FenceInbox(_) => "FenceInbox",
            Message::Pull(_) => "Pull",
            Message::Rendezvous(_) => "Rendezvous",
            Message::PoolRetired(_) => "PoolRetired",
            Message::RingOffer(_) => "RingOffer",
            Message::RingReady => "RingReady",
            Message::RingDeclined => "RingDeclined",
        }
    }
}
