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

pub use baton_ipc::{
    Allocation, Backend, Error, HostBackend, ImportCache, Imported, Link, LinkConfig, Listener,
    OpenedMem, Session, SharedBackend, SocketDir,
};
pub use baton_messages::{HandleMsg, Message};

/// The Rust code blocks of `docs/GUIDE.md` (the README's examples that moved there), compiled
/// as doctests like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/GUIDE.md")]
pub struct GuideDoctests;
