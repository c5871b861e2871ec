//! The extension module of Baton's Python package (`baton._baton`): Python processes as
//! peers of a Baton deployment. See `python/README.md` for the guide.
//!
//! Everything protocol-related is `baton-actors` and `baton-ipc` (the same links,
//! credential and token checks, lease ledger and import cache as Rust peers): this crate
//! only runs them on a thread of its own (`runtime`), converts values to and from
//! MessagePack (`codec`), and hands buffers to Python as views whose lifetime keeps the
//! memory mapped (`memory`, `dlpack`).
//!
//! `unsafe` code lives only in `dlpack` (the capsule handed to DLPack consumers), `stream`
//! (wrapping a stream Python names) and `copy` (batched copies to tensors' raw pointers),
//! which each open with a `# Safety` overview.

#![deny(unsafe_code)]

mod bundle;
mod codec;
mod copy;
mod dlpack;
mod errors;
mod memory;
mod node;
mod runtime;
mod stream;
mod versions;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _baton(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MSGPACK_SHARED_EXT", baton_actors::MSGPACK_SHARED_EXT)?;
    m.add_class::<node::Node>()?;
    m.add_class::<node::Peer>()?;
    m.add_class::<node::Mailbox>()?;
    m.add_class::<node::Call>()?;
    m.add_class::<node::Child>()?;
    m.add_class::<memory::Shared>()?;
    m.add_class::<memory::Lease>()?;
    m.add_class::<memory::Buffer>()?;
    m.add_class::<memory::WritableShare>()?;
    m.add_class::<memory::HostView>()?;
    m.add_class::<bundle::BundleLayout>()?;
    m.add_class::<copy::CopyPlan>()?;
    m.add_class::<versions::SyncStamp>()?;
    m.add_class::<versions::SyncSender>()?;
    m.add_class::<versions::SyncState>()?;
    m.add_function(wrap_pyfunction!(memory::open_all, m)?)?;
    m.add_function(wrap_pyfunction!(memory::release_all, m)?)?;
    m.add_function(wrap_pyfunction!(memory::wait_all_on, m)?)?;
    m.add_function(wrap_pyfunction!(node::generate_token, m)?)?;
    m.add_function(wrap_pyfunction!(node::log_to_stderr, m)?)?;
    Ok(())
}
