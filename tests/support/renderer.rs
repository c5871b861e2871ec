//! The renderer example, for the tests that run it as a real process tree.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The renderer example binary, built now (a no-op when it is up to date: `cargo test`
/// does not rebuild examples by itself), in the profile of this test.
pub fn renderer() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args(["build", "--example", "renderer"])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if release {
        build.arg("--release");
    }
    assert!(
        build.status().unwrap().success(),
        "building the renderer example"
    );
    profile_dir.join("examples").join("renderer")
}
