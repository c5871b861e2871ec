//! Typed messages to actors in other processes.
//!
//! A user message type implements actix's `Message` (its `Result` is the reply) and
//! [`RemoteMessage`] (its wire name). The receiving process registers an actor under a name
//! with [`Node::register`](crate::Node::register); the sending process gets a
//! [`RemoteAddr`] from a [`Peer`](crate::Peer) and `send`s to it like to an actix `Addr`.
//!
//! Messages and replies may hold [`Shared<T>`] fields. Encoding writes each as an index
//! into a side table (as ipc-channel does for its OS objects); the sending link turns the
//! table into leases and offers, and the receiving link turns offers back into unopened
//! leases that decoding places in the same fields.
//!
//! Each message type picks its [`Encoding`]: bincode (compact, Rust to Rust, the default)
//! or MessagePack (self-describing, for messages that cross languages: field names travel
//! with the values, and a `Shared` field is a MessagePack extension, see
//! [`MSGPACK_SHARED_EXT`]). Untyped peers (another language's runtime) use the raw API of
//! [`raw`](crate::raw) instead: they send and receive encoded bytes and buffers.

use crate::buffer::{
    Element, IncomingLease, IncomingLeases, Outgoing, Shared, SharedInner, SharedMut,
};
use crate::error::ActorError;
use crate::link_ref::{CancelCall, LinkRef};
use actix::{Message, Recipient};
use baton_messages::ProcessId;
use baton_messages::protocol::CallFault;
use futures_util::FutureExt as _;
use serde::de::{DeserializeOwned, Error as _};
use serde::ser::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, oneshot};

/// A message that can be sent to an actor in another process.
///
/// ```
/// use baton_actors::{RemoteMessage, Shared};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, actix::Message)]
/// #[rtype(result = "u64")]
/// struct Checksum {
///     data: Shared<u8>,
/// }
///
/// impl RemoteMessage for Checksum {
///     const NAME: &'static str = "example.Checksum";
/// }
/// ```
pub trait RemoteMessage: Message + Serialize + DeserializeOwned + Send + 'static {
    /// The type's name on the wire; the receiver checks it matches what it registered.
    const NAME: &'static str;
    /// How the message and its reply are encoded: [`Encoding::Bincode`] unless the type
    /// says otherwise. Both sides must agree (they share the type, or, across languages,
    /// its description: see [`Encoding::MessagePack`]).
    const ENCODING: Encoding = Encoding::Bincode;
}

/// Implements [`RemoteMessage`] for each type, with its wire name, in one line (the
/// default [`Encoding`]; implement the trait by hand for another):
///
/// ```
/// use baton_actors::{Shared, remote_message};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, actix::Message)]
/// #[rtype(result = "u64")]
/// struct Checksum(Shared<u8>);
///
/// #[derive(Serialize, Deserialize, actix::Message)]
/// #[rtype(result = "()")]
/// struct Forget(u64);
///
/// remote_message!(Checksum = "example.Checksum", Forget = "example.Forget");
/// assert_eq!(<Forget as baton_actors::RemoteMessage>::NAME, "example.Forget");
/// ```
#[macro_export]
macro_rules! remote_message {
    ($($t:ty = $name:literal),+ $(,)?) => {
        $(
            impl $crate::RemoteMessage for $t {
                const NAME: &'static str = $name;
            }
        )+
    };
}

/// How a [`RemoteMessage`] and its reply are encoded on the wire.
///
/// ```
/// use baton_actors::{Encoding, RemoteMessage, Shared};
/// use serde::{Deserialize, Serialize};
///
/// /// Sent by Python peers: `{"image": <baton.Buffer>, "gain": 1.5}`.
/// #[derive(Serialize, Deserialize, actix::Message)]
/// #[rtype(result = "f64")]
/// struct Scale {
///     image: Shared<f32>,
///     gain: f64,
/// }
///
/// impl RemoteMessage for Scale {
///     const NAME: &'static str = "example.Scale";
///     const ENCODING: Encoding = Encoding::MessagePack;
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Encoding {
    /// bincode 2 (standard configuration, varint integers, size-limited): compact, not
    /// self-describing; for messages between Rust processes that share the type.
    #[default]
    Bincode,
    /// MessagePack through `rmp-serde`, structs as maps of field names: self-describing,
    /// for messages that cross languages. Integers, floats, strings, `Option`, sequences,
    /// maps, structs and enums map onto MessagePack's types (the Python package's guide
    /// has the table); a [`Shared`] field is the extension [`MSGPACK_SHARED_EXT`] holding
    /// the buffer's index among the message's offers (a big-endian `u32`).
    MessagePack,
}

/// The MessagePack extension type of a [`Shared`] field under [`Encoding::MessagePack`]:
/// its data is the buffer's index among the message's offers, a big-endian `u32`.
pub const MSGPACK_SHARED_EXT: i8 = 66;

/// An encoded value and the buffers it shares.
pub(crate) struct Encoded {
    pub(crate) bytes: Vec<u8>,
    pub(crate) cells: Vec<Outgoing>,
}

/// A received value not yet decoded, with its leases.
pub(crate) struct IncomingPayload {
    pub(crate) bytes: Vec<u8>,
    pub(crate) leases: IncomingLeases,
}

/// A typed call from a [`RemoteAddr`].
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct OutCall {
    /// Chosen by the caller ([`LinkState::next_call_id`](crate::link_ref::LinkState::next_call_id)), so that it can cancel.
    pub(crate) id: u64,
    pub(crate) target: Arc<str>,
    pub(crate) type_name: Arc<str>,
    pub(crate) encoded: Encoded,
    pub(crate) reply: oneshot::Sender<Result<IncomingPayload, ActorError>>,
    /// Its share of the send window, held until it is written.
    pub(crate) window: OwnedSemaphorePermit,
}

thread_local! {
    static OUTGOING: RefCell<Option<Vec<Outgoing>>> = const { RefCell::new(None) };
    static INCOMING: RefCell<Option<Vec<Option<Box<IncomingLease>>>>> = const { RefCell::new(None) };
    /// The encoding of the value being encoded or decoded on this thread (for `Shared`).
    static CODEC: Cell<Encoding> = const { Cell::new(Encoding::Bincode) };
}

/// Sets the thread's codec for one encode or decode, and puts the previous one back.
struct CodecScope(Encoding);

impl CodecScope {
    fn enter(encoding: Encoding) -> Self {
        Self(CODEC.with(|c| c.replace(encoding)))
    }
}

impl Drop for CodecScope {
    fn drop(&mut self) {
        CODEC.with(|c| c.set(self.0));
    }
}

/// A `Shared` field under MessagePack: the extension `(MSGPACK_SHARED_EXT, index)`.
#[derive(Deserialize)]
#[serde(rename = "_ExtStruct")]
struct SharedExt((i8, serde_bytes::ByteBuf));

type Config = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<{ baton_messages::MAX_FRAME_LEN }>,
>;

fn config() -> Config {
    bincode::config::standard().with_limit::<{ baton_messages::MAX_FRAME_LEN }>()
}

/// Encodes `value`, collecting the buffers of its `Shared` fields.
pub(crate) fn encode<V: Serialize>(
    what: &'static str,
    value: &V,
    encoding: Encoding,
) -> Result<Encoded, ActorError> {
    let previous = OUTGOING.with(|t| t.replace(Some(Vec::new())));
    let bytes = {
        let _codec = CodecScope::enter(encoding);
        match encoding {
            Encoding::Bincode => {
                bincode::serde::encode_to_vec(value, config()).map_err(|e| e.to_string())
            }
            Encoding::MessagePack => {
                let mut bytes = Vec::new();
                let mut ser = rmp_serde::Serializer::new(&mut bytes).with_struct_map();
                value
                    .serialize(&mut ser)
                    .map(|()| bytes)
                    .map_err(|e| e.to_string())
            }
        }
    };
    let cells = OUTGOING.with(|t| t.replace(previous)).unwrap_or_default();
    let bytes = bytes.map_err(|reason| ActorError::Encode { what, reason })?;
    Ok(Encoded { bytes, cells })
}

/// Decodes a value whose `Shared` fields index into `leases`. Leases no field claimed are
/// released (dropped).
pub(crate) fn decode<V: DeserializeOwned>(
    what: &'static str,
    bytes: &[u8],
    leases: IncomingLeases,
    encoding: Encoding,
) -> Result<V, ActorError> {
    let table = leases.into_iter().map(Some).collect();
    let previous = INCOMING.with(|t| t.replace(Some(table)));
    let decoded = {
        let _codec = CodecScope::enter(encoding);
        match encoding {
            Encoding::Bincode => bincode::serde::decode_from_slice::<V, _>(bytes, config())
                .map_err(|e| e.to_string()),
            Encoding::MessagePack => {
                // Bounded: the input is one frame at most, rmp-serde limits nesting depth,
                // and serde caps preallocations whatever length the input claims.
                let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(bytes));
                V::deserialize(&mut de)
                    .map(|v| (v, de.position() as usize))
                    .map_err(|e| e.to_string())
            }
        }
    };
    drop(INCOMING.with(|t| t.replace(previous)));
    let fail = |reason: String| ActorError::Decode { what, reason };
    match decoded {
        Ok((v, used)) if used == bytes.len() => Ok(v),
        Ok((_, used)) => Err(fail(format!(
            "{} bytes after the value",
            bytes.len() - used
        ))),
        Err(e) => Err(fail(e)),
    }
}

impl<T: Element> Serialize for Shared<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let SharedInner::Local(out) = &self.inner else {
            return Err(S::Error::custom(ActorError::NotOwned));
        };
        let index = OUTGOING.with(|t| {
            t.borrow_mut().as_mut().map(|cells| {
                cells.push(Outgoing {
                    cell: Arc::clone(&out.cell),
                    fence: out.fence.clone(),
                    writable: out.writable,
                    part: out.part.clone(),
                    joins: out.joins,
                });
                cells.len() - 1
            })
        });
        match (index, CODEC.with(Cell::get)) {
            (Some(i), Encoding::Bincode) => s.serialize_u32(i as u32),
            (Some(i), Encoding::MessagePack) => s.serialize_newtype_struct(
                rmp_serde::MSGPACK_EXT_STRUCT_NAME,
                &(
                    MSGPACK_SHARED_EXT,
                    serde_bytes::Bytes::new(&(i as u32).to_be_bytes()),
                ),
            ),
            (None, _) => Err(S::Error::custom(
                "Shared<T> can only be sent in a Baton message",
            )),
        }
    }
}

impl<'de, T: Element> Deserialize<'de> for Shared<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let index = match CODEC.with(Cell::get) {
            Encoding::Bincode => u32::deserialize(d)? as usize,
            Encoding::MessagePack => {
                let SharedExt((tag, data)) = SharedExt::deserialize(d)?;
                match <[u8; 4]>::try_from(data.as_slice()) {
                    Ok(be) if tag == MSGPACK_SHARED_EXT => u32::from_be_bytes(be) as usize,
                    _ => {
                        return Err(D::Error::custom(format!(
                            "MessagePack extension {tag} of {} bytes is not a buffer (extension {MSGPACK_SHARED_EXT}, 4 bytes)",
                            data.len()
                        )));
                    }
                }
            }
        };
        let lease = INCOMING.with(|t| {
            let mut t = t.borrow_mut();
            let table = t.as_mut().ok_or_else(|| {
                D::Error::custom("Shared<T> can only be received in a Baton message")
            })?;
            table
                .get_mut(index)
                .ok_or_else(|| D::Error::custom(format!("buffer index {index} out of range")))?
                .take()
                .ok_or_else(|| D::Error::custom(format!("buffer index {index} used twice")))
        })?;
        let got = lease
            .imported
            .as_ref()
            .and_then(|i| i.layout())
            .map(|l| l.dtype);
        if got != Some(T::DTYPE) {
            return Err(D::Error::custom(ActorError::WrongElementType {
                expected: T::DTYPE,
                got,
            }));
        }
        Ok(Shared {
            inner: SharedInner::Incoming(lease),
            _t: PhantomData,
        })
    }
}

pub(crate) type Answer = Pin<Box<dyn Future<Output = Result<Encoded, CallFault>>>>;

impl<T: Element> Serialize for SharedMut<T> {
    /// As [`Shared`]: the write grant is in the field's type, not on the wire.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, T: Element> Deserialize<'de> for SharedMut<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Shared::deserialize(d).map(SharedMut)
    }
}

/// A registered receiver, with its message type erased.
pub(crate) trait ErasedHandler: Send + Sync {
    fn type_name(&self) -> &str;
    /// Decodes the message, enqueues it to the actor, and returns the encoded answer to come.
    fn invoke(
        &self,
        peer: ProcessId,
        payload: &[u8],
        leases: IncomingLeases,
    ) -> Result<Answer, CallFault>;
}

pub(crate) struct Registered<M: RemoteMessage>
where
    M::Result: Send,
{
    pub(crate) recipient: Recipient<M>,
}

impl<M> ErasedHandler for Registered<M>
where
    M: RemoteMessage,
    M::Result: Serialize + Send,
{
    fn type_name(&self) -> &str {
        M::NAME
    }

    fn invoke(
        &self,
        _peer: ProcessId,
        payload: &[u8],
        leases: IncomingLeases,
    ) -> Result<Answer, CallFault> {
        // `send` enqueues now, so calls reach the actor in the order they arrived.
        answer(payload, leases, |msg: M| self.recipient.send(msg))
    }
}

/// Decodes a call's `payload` as `M`, hands it to `deliver` (which enqueues it to the
/// actor at once), and returns the encoded answer to come.
pub(crate) fn answer<M, F>(
    payload: &[u8],
    leases: IncomingLeases,
    deliver: impl FnOnce(M) -> F,
) -> Result<Answer, CallFault>
where
    M: RemoteMessage,
    M::Result: Serialize,
    F: Future<Output = Result<M::Result, actix::MailboxError>> + 'static,
{
    let msg: M = decode("message", payload, leases, M::ENCODING)
        .map_err(|e| CallFault::BadPayload(e.to_string()))?;
    // A combinator, not an `async` block, which would keep the request twice in the box.
    Ok(Box::pin(deliver(msg).map(|answered| match answered {
        Ok(reply) => {
            encode("reply", &reply, M::ENCODING).map_err(|e| CallFault::ReplyFailed(e.to_string()))
        }
        Err(_) => Err(CallFault::ActorGone),
    })))
}

/// The address of a named actor in another process, for one message type.
pub struct RemoteAddr<M: RemoteMessage> {
    pub(crate) link: LinkRef,
    pub(crate) calls: Recipient<OutCall>,
    pub(crate) target: Arc<str>,
    /// `M::NAME`, made once (each call's `OutCall` shares it).
    pub(crate) type_name: Arc<str>,
    pub(crate) _m: PhantomData<fn(M)>,
}

impl<M: RemoteMessage> Clone for RemoteAddr<M> {
    fn clone(&self) -> Self {
        Self {
            link: self.link.clone(),
            calls: self.calls.clone(),
            target: Arc::clone(&self.target),
            type_name: Arc::clone(&self.type_name),
            _m: PhantomData,
        }
    }
}

impl<M: RemoteMessage> fmt::Debug for RemoteAddr<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RemoteAddr<{}>({} on {:?})",
            M::NAME,
            self.target,
            self.link
        )
    }
}

impl<M> RemoteAddr<M>
where
    M: RemoteMessage,
    M::Result: DeserializeOwned,
{
    /// Whether the link to the actor's process is still up.
    pub fn connected(&self) -> bool {
        self.link.is_alive()
    }

    /// Sends `msg` and waits for the typed reply. The buffers in `msg` are leased to the
    /// receiving process before the message leaves.
    ///
    /// The message is encoded when `send` is called, and queued on the link at once when
    /// the link has room, so calls leave in the order they were made. When it has none —
    /// [`LinkLimits::send_window`](crate::LinkLimits::send_window) bytes of calls wait for
    /// the socket, or [`LinkLimits::pending_calls`](crate::LinkLimits::pending_calls) calls
    /// wait for replies — the returned future waits for room first (backpressure: a sender
    /// faster than its link waits; memory does not grow). The future borrows nothing;
    /// dropping it gives the call up (a reply that comes later is given back).
    ///
    /// The reply also tells you where the leases stand: the receiving process maps a
    /// call's buffers before its handler runs (a buffer it cannot open fails the call with
    /// [`CallFault::OfferRefused`]), so
    /// once `send` resolves `Ok`, each lease of `msg` is either held by the receiver —
    /// mapped, in its handler's hands — or already given back ([`Buffer::leases_out`]
    /// says which; [`Buffer::returned`] waits for the rest). No protocol message is needed
    /// for "the receiver opened it": answer the call after opening.
    ///
    /// [`Buffer::leases_out`]: crate::Buffer::leases_out
    /// [`Buffer::returned`]: crate::Buffer::returned
    ///
    /// # Errors
    /// [`ActorError::Encode`], [`ActorError::LinkClosed`] if the link goes down first,
    /// [`ActorError::Remote`] if the receiver refused the call,
    /// [`ActorError::OfferRefused`] if a buffer of the reply could not be opened here,
    /// [`ActorError::Decode`].
    pub fn send(&self, msg: M) -> impl Future<Output = Result<M::Result, ActorError>> + 'static {
        let encoded = encode("message", &msg, M::ENCODING);
        drop(msg);
        let reply = call_encoded(
            &self.link,
            &self.calls,
            &self.target,
            &self.type_name,
            encoded,
        );
        // A combinator, not an `async` block: a block would keep `reply` twice (captured,
        // then pinned at its `await`), doubling the future every caller stores.
        reply.map(|payload| {
            let payload = payload?;
            decode("reply", &payload.bytes, payload.leases, M::ENCODING)
        })
    }

    /// [`send`](Self::send) with a deadline.
    ///
    /// # Errors
    /// As `send`, and [`ActorError::Timeout`]. A reply that comes after the deadline is
    /// dropped (its leases are released).
    pub fn send_timeout(
        &self,
        msg: M,
        after: Duration,
    ) -> impl Future<Output = Result<M::Result, ActorError>> + 'static {
        tokio::time::timeout(after, self.send(msg)).map(move |res| {
            res.map_err(|_| ActorError::Timeout {
                op: "remote call",
                after,
            })?
        })
    }
}

/// Queues an encoded call on `link` (at once when the link has room, so calls leave in
/// the order they were made; else the future waits for room first) and returns its reply,
/// undecoded. The call goes to `calls`, the link actor's. Dropping the future gives the
/// call up.
pub(crate) fn call_encoded(
    link: &LinkRef,
    calls: &Recipient<OutCall>,
    target: &Arc<str>,
    type_name: &Arc<str>,
    encoded: Result<Encoded, ActorError>,
) -> impl Future<Output = Result<IncomingPayload, ActorError>> + 'static + use<> {
    let peer = link.peer();
    // The fast path, taken now: no call waits before this one (the turn), room on the
    // link and fences to spare, so the call is queued in order. Only a call that waits
    // keeps the link's addresses and names (the queued one's `OutCall` has them).
    let started = match encoded {
        Err(e) => Err(e),
        Ok(encoded) => {
            let cost = window_cost(&encoded, link);
            let state = link.state();
            let fast = Arc::clone(&state.turn)
                .try_lock_owned()
                .ok()
                .filter(|_| fence_room(&encoded, peer));
            match (
                fast,
                Arc::clone(&state.pending_calls).try_acquire_owned(),
                Arc::clone(&state.send_window).try_acquire_many_owned(cost),
            ) {
                (Some(_turn), Ok(slot), Ok(window)) => Ok(Started::Queued(queue(
                    link, calls, target, type_name, encoded, window, slot,
                ))),
                _ => Ok(Started::Waiting(Box::new(Waiting {
                    encoded,
                    cost,
                    link: link.clone(),
                    calls: calls.clone(),
                    target: Arc::clone(target),
                    type_name: Arc::clone(type_name),
                }))),
            }
        }
    };
    async move {
        // The paths that wait for room or settle a closed link's cause are boxed: the
        // fast path's future (which every caller stores) stays small.
        let queued = match started? {
            Started::Queued(q) => q,
            Started::Waiting(waiting) => (*waiting).queue_boxed().await?,
        };
        let Queued {
            reply,
            mut cancel,
            slot,
        } = queued;
        let payload = match reply.await {
            Ok(answer) => answer?,
            Err(_) => return Err(settled_boxed(peer).await),
        };
        cancel.disarm();
        drop(slot);
        Ok(payload)
    }
}

/// Whether every buffer of the call can carry a fence to `peer` now
/// ([`StreamOrdering::fence_room`](baton_ipc::StreamOrdering::fence_room)).
fn fence_room(encoded: &Encoded, peer: ProcessId) -> bool {
    encoded
        .cells
        .iter()
        .all(|out| out.cell.order.backend().ordering().fence_room(&peer))
}

/// How long a call waits for fences to spare before it goes anyway (and its offer may
/// fail with `EventsExhausted`): the fence deadline's default, past which the other side's
/// waits are released and its fences come back.
const FENCE_PATIENCE: Duration = Duration::from_secs(10);

/// Waits (polling, asynchronously) until the call's buffers can carry fences to the link's
/// peer, the link goes down, or [`FENCE_PATIENCE`] has passed.
async fn wait_for_fences(encoded: &Encoded, link: &LinkRef) {
    let peer = link.peer();
    let start = std::time::Instant::now();
    let mut waited = false;
    while !fence_room(encoded, peer) && link.is_alive() && start.elapsed() < FENCE_PATIENCE {
        if !waited {
            tracing::debug!(%peer, "no fence to spare for the peer: the call waits for its fences' work");
            waited = true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// [`ActorError::link_closed_settled`], boxed (see [`Waiting::queue_boxed`]).
fn settled_boxed(peer: ProcessId) -> Pin<Box<dyn Future<Output = ActorError> + Send>> {
    Box::pin(ActorError::link_closed_settled(peer))
}

/// How far a call got when `send` returned.
enum Started {
    Queued(Queued),
    /// No room on the link yet.
    Waiting(Box<Waiting>),
}

/// A call that waits for room on its link: what queueing it later takes.
struct Waiting {
    encoded: Encoded,
    /// Its window cost.
    cost: u32,
    link: LinkRef,
    calls: Recipient<OutCall>,
    target: Arc<str>,
    type_name: Arc<str>,
}

impl Waiting {
    /// [`queue`](Self::queue), boxed (built outside the caller's future, which would
    /// otherwise keep room for it).
    fn queue_boxed(self) -> Pin<Box<dyn Future<Output = Result<Queued, ActorError>> + Send>> {
        Box::pin(self.queue())
    }

    /// Waits for the call's turn, fences to spare, a pending-call slot and its window,
    /// then queues it.
    async fn queue(self) -> Result<Queued, ActorError> {
        let Self {
            encoded,
            cost,
            link,
            calls,
            target,
            type_name,
        } = self;
        let state = link.state();
        let peer = link.peer();
        // Calls that wait go in the order they were made.
        let _turn = Arc::clone(&state.turn).lock_owned().await;
        wait_for_fences(&encoded, &link).await;
        let closed = |_| ActorError::link_closed(peer);
        let slot = Arc::clone(&state.pending_calls)
            .acquire_owned()
            .await
            .map_err(closed)?;
        let window = Arc::clone(&state.send_window)
            .acquire_many_owned(cost)
            .await
            .map_err(closed)?;
        Ok(queue(
            &link, &calls, &target, &type_name, encoded, window, slot,
        ))
    }
}

/// A call queued on its link.
struct Queued {
    reply: oneshot::Receiver<Result<IncomingPayload, ActorError>>,
    cancel: CancelOnDrop,
    /// The call's pending-call slot, held until its reply comes.
    slot: OwnedSemaphorePermit,
}

/// What a call counts against the link's send window: its bytes and a frame's share per
/// buffer, at most the whole window (so that any call can go when the link is idle; one
/// larger than a frame fails with a typed error when it is framed).
fn window_cost(encoded: &Encoded, link: &LinkRef) -> u32 {
    let bytes = encoded.bytes.len() + 512 * encoded.cells.len() + 256;
    let window = link.state().window_size;
    u32::try_from(bytes.min(window).max(1)).unwrap_or(u32::MAX)
}

fn queue(
    link: &LinkRef,
    calls: &Recipient<OutCall>,
    target: &Arc<str>,
    type_name: &Arc<str>,
    encoded: Encoded,
    window: OwnedSemaphorePermit,
    slot: OwnedSemaphorePermit,
) -> Queued {
    let id = link.state().next_call_id();
    let (tx, rx) = oneshot::channel();
    calls.do_send(OutCall {
        id,
        target: Arc::clone(target),
        type_name: Arc::clone(type_name),
        encoded,
        reply: tx,
        window,
    });
    Queued {
        reply: rx,
        cancel: CancelOnDrop {
            link: Some(link.clone()),
            id,
        },
        slot,
    }
}

/// Tells the link a call was given up if the caller drops it before its reply.
struct CancelOnDrop {
    link: Option<LinkRef>,
    id: u64,
}

impl CancelOnDrop {
    fn disarm(&mut self) {
        self.link = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(link) = self.link.take() {
            link.do_send(CancelCall(self.id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Sample {
        count: u32,
        name: String,
        values: Vec<i64>,
        maybe: Option<u8>,
    }

    /// What another language writes for a message with a buffer field.
    #[derive(Serialize)]
    struct WithRef {
        data: ExtOut,
    }

    #[derive(Serialize)]
    #[serde(rename = "_ExtStruct")]
    struct ExtOut((i8, serde_bytes::ByteBuf));

    #[derive(Debug, Deserialize)]
    struct WithBuffer {
        #[allow(dead_code)]
        data: Shared<u32>,
    }

    fn ext(tag: i8, data: &[u8]) -> Vec<u8> {
        rmp_serde::to_vec_named(&WithRef {
            data: ExtOut((tag, serde_bytes::ByteBuf::from(data.to_vec()))),
        })
        .unwrap()
    }

    #[test]
    fn messagepack_carries_field_names_and_round_trips() {
        let sample = Sample {
            count: 3,
            name: "three".into(),
            values: vec![-1, 2],
            maybe: None,
        };
        let encoded = encode("message", &sample, Encoding::MessagePack).unwrap();
        assert!(encoded.cells.is_empty());
        // Self-describing: a map whose keys are the field names (fixmap of 4, "count"…).
        assert_eq!(encoded.bytes[0], 0x84);
        assert_eq!(&encoded.bytes[1..7], b"\xa5count");
        let back: Sample =
            decode("message", &encoded.bytes, Vec::new(), Encoding::MessagePack).unwrap();
        assert_eq!(back, sample);
        // Bincode is not self-describing, and is still the default.
        let bin = encode("message", &sample, Encoding::default()).unwrap();
        assert!(!bin.bytes.windows(5).any(|w| w == b"count"));
    }

    #[test]
    fn messagepack_decoding_refuses_what_does_not_fit() {
        let sample = Sample {
            count: 1,
            name: String::new(),
            values: Vec::new(),
            maybe: Some(2),
        };
        let mut bytes = encode("message", &sample, Encoding::MessagePack)
            .unwrap()
            .bytes;
        bytes.push(0xc0);
        let err = decode::<Sample>("message", &bytes, Vec::new(), Encoding::MessagePack)
            .unwrap_err()
            .to_string();
        assert!(err.contains("1 bytes after the value"), "{err}");

        let refuse = |bytes: Vec<u8>| {
            decode::<WithBuffer>("message", &bytes, Vec::new(), Encoding::MessagePack)
                .unwrap_err()
                .to_string()
        };
        let err = refuse(ext(MSGPACK_SHARED_EXT, &0u32.to_be_bytes()));
        assert!(err.contains("buffer index 0 out of range"), "{err}");
        let err = refuse(ext(5, &0u32.to_be_bytes()));
        assert!(
            err.contains("extension 5 of 4 bytes is not a buffer"),
            "{err}"
        );
        let err = refuse(ext(MSGPACK_SHARED_EXT, &[0, 0]));
        assert!(err.contains("is not a buffer"), "{err}");
        // A plain integer where a buffer belongs is no buffer either.
        #[derive(Serialize)]
        struct Plain {
            data: u32,
        }
        let err = refuse(rmp_serde::to_vec_named(&Plain { data: 0 }).unwrap());
        assert!(err.contains("could not decode message"), "{err}");
    }

    /// The future of a call is what every caller stores (a pipelined sender keeps hundreds
    /// in a `FuturesUnordered`, each moved there whole): its fast path's future must not
    /// carry room for the paths that wait. Written as `async` blocks around the queued
    /// call, `send`'s future was 1,896 bytes: the inner call's twice, and room for the wait
    /// for room and the settling of a closed link's cause.
    #[test]
    fn a_calls_future_stays_small_and_sendable() {
        // (`Peer::call_raw`'s: `raw::tests`.)
        fn size_of_future<A, B, F: Future + Send>(_: fn(A, B) -> F) -> usize {
            size_of::<F>()
        }
        #[derive(Serialize, Deserialize, actix::Message)]
        #[rtype(result = "u64")]
        struct Probe(u64);
        crate::remote_message!(Probe = "test.Probe");
        let send = size_of_future(RemoteAddr::<Probe>::send);
        assert!(send <= 512, "RemoteAddr::send's future is {send} bytes");
    }
}
