#![doc = include_str!("../README.md")]
#![deny(unsafe_code)]

pub use baton_actors as actors;
pub use baton_ipc as ipc;
pub use baton_messages as messages;

pub use baton_ipc::{
    Allocation, Backend, Error, HostBackend, ImportCache, Imported, Link, LinkConfig, Listener,
    OpenedMem, Session, SharedBackend, SocketDir,
};
pub use baton_messages::{HandleMsg, Message};
