//! Rust errors as Python exceptions.
//!
//! Each exception class is named after the Rust error variant it stands for
//! (`ActorError::Orphaned` → `baton.Orphaned`, `baton_ipc::Error::BadToken` →
//! `baton.BadToken`, `CallFault::BadPayload` → `baton.BadPayload`) and carries the Rust
//! error's message unchanged. The classes are defined in `baton/errors.py` (so that they can
//! also derive from the matching builtin: `baton.Timeout` is a `TimeoutError`,
//! `baton.OutOfBounds` an `IndexError`); a variant without a class of its own falls back to
//! its group (`baton.Ipc`, `baton.Remote`), then to `baton.BatonError`.

use baton_actors::ActorError;
use baton_messages::protocol::CallFault;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyType;

/// Something that failed, before it becomes a Python exception (which needs the GIL).
#[derive(Debug)]
pub(crate) enum Failure {
    /// An error of the actor protocol (or, inside it, of the transport).
    Actor(ActorError),
    /// The runtime thread is gone or unresponsive.
    Runtime(String),
    /// A lease, buffer or received buffer used after it was released or opened.
    Released(String),
    /// A bad argument (`ValueError`).
    Value(String),
    /// A value of the wrong type (`TypeError`).
    Type(String),
    /// A view that cannot be made (`BufferError`).
    Buffer(String),
    /// No link is up, and none can come (`baton.LinkClosed`): a mailbox nobody can call.
    NoLinks(String),
}

impl From<ActorError> for Failure {
    fn from(e: ActorError) -> Self {
        Failure::Actor(e)
    }
}

impl From<baton_ipc::Error> for Failure {
    fn from(e: baton_ipc::Error) -> Self {
        Failure::Actor(ActorError::Ipc(e))
    }
}

impl Failure {
    pub(crate) fn timeout(op: &'static str, after: std::time::Duration) -> Self {
        Failure::Actor(ActorError::Timeout { op, after })
    }
}

/// The name of an enum value's variant, from its `Debug` form (`Orphaned { .. }` →
/// `Orphaned`): new variants of the `#[non_exhaustive]` enums get their name too.
fn variant(debug: &str) -> &str {
    let end = debug
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(debug.len());
    &debug[..end]
}

/// The classes to try, most specific first.
fn classes(e: &ActorError) -> Vec<String> {
    match e {
        ActorError::Ipc(inner) => {
            let mut names = Vec::new();
            if let baton_ipc::Error::Message(m) = inner {
                names.push(variant(&format!("{m:?}")).to_owned());
            }
            names.push(variant(&format!("{inner:?}")).to_owned());
            names.push("Ipc".into());
            names
        }
        ActorError::Remote(fault) => {
            let name = match fault {
                // `OfferRefused` is also an `ActorError` (a buffer of *our* reply…).
                CallFault::OfferRefused(_) => "RemoteOfferRefused".to_owned(),
                other => variant(&format!("{other:?}")).to_owned(),
            };
            vec![name, "Remote".into()]
        }
        // The link's end says the peer's process died: its own class, under `LinkClosed`.
        ActorError::LinkClosed {
            cause: baton_actors::LinkEnd::PeerDied,
            ..
        } => vec!["PeerDied".into(), "LinkClosed".into()],
        ActorError::Version(fault) => {
            vec![variant(&format!("{fault:?}")).to_owned(), "Version".into()]
        }
        other => vec![variant(&format!("{other:?}")).to_owned()],
    }
}

fn class<'py>(py: Python<'py>, names: &[String]) -> Option<Bound<'py, PyType>> {
    let module = py.import("baton.errors").ok()?;
    names
        .iter()
        .map(String::as_str)
        .chain(["BatonError"])
        .find_map(|name| module.getattr(name).ok()?.cast_into::<PyType>().ok())
}

fn raise(py: Python<'_>, names: &[String], message: String) -> PyErr {
    match class(py, names) {
        Some(ty) => PyErr::from_type(ty, message),
        // `baton.errors` is part of the package; without it, say what happened anyway.
        None => pyo3::exceptions::PyRuntimeError::new_err(message),
    }
}

/// The Python exception for `failure`.
pub(crate) fn to_py(py: Python<'_>, failure: Failure) -> PyErr {
    match failure {
        Failure::Actor(e) => raise(py, &classes(&e), e.to_string()),
        Failure::Runtime(m) => raise(py, &["RuntimeGone".into()], m),
        Failure::Released(m) => raise(py, &["Released".into()], m),
        Failure::Value(m) => PyValueError::new_err(m),
        Failure::Type(m) => PyTypeError::new_err(m),
        Failure::Buffer(m) => PyBufferError::new_err(m),
        Failure::NoLinks(m) => raise(py, &["LinkClosed".into()], m),
    }
}

/// `?` for results whose error converts into a [`Failure`].
pub(crate) trait OrRaise<T> {
    /// The value, or the Python exception for the error.
    fn or_raise(self, py: Python<'_>) -> PyResult<T>;
}

impl<T, E: Into<Failure>> OrRaise<T> for Result<T, E> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e.into()))
    }
}
