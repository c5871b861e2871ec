#![doc = include_str!("../README.md")]
#![deny(unsafe_code)]

#[doc(inline)]
pub use baton_actors as actors;
#[doc(inline)]
pub use baton_ipc as ipc;
#[doc(inline)]
pub use baton_messages as messages;

/// What a program that shares buffers between processes uses first (the README's
/// examples): also under [`actors`].
#[doc(inline)]
pub use baton_actors::{
    ActorError, Buffer, BufferMut, Lease, LeaseMut, LinkedChild, Node, Peer, RemoteMessage, Shared,
    SharedMut, remote_message,
};

/// The error of everything at the root: [`ActorError`] (whose `Ipc` variant carries the
/// transport's and memory's [`ipc::Error`]).
pub type Error = ActorError;

/// What a node is made from: the session (its token) and the host backend, and the
/// directory its sockets live in. The low-level API — links, allocations, the import
/// cache, the wire messages — is under [`ipc`] and [`messages`].
#[doc(inline)]
pub use baton_ipc::{HostBackend, Session, SocketDir};

/// The Rust code blocks of `docs/GUIDE.md` (the README's examples that moved there), compiled
/// as doctests like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/GUIDE.md")]
pub struct GuideDoctests;
