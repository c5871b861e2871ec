//! The examples, the renderer above all, for the tests that run them as real processes.

#![allow(dead_code)]

// peer.rs, renderer.rs and baton_cli.rs each load it, so that each works alone; a test
// with several of them holds a copy per module, each building its own targets.
#[allow(clippy::duplicate_mod)]
#[path = "built.rs"]
mod built;

pub use built::example;
use std::path::PathBuf;

/// The renderer example binary, built now (a no-op when it is up to date: `cargo test`
/// does not build examples), in the profile of this test.
pub fn renderer() -> PathBuf {
    example("renderer")
}
