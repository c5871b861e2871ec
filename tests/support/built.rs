//! Executables of other workspace targets that tests run: the test helper binaries (package
//! `baton-test-peers`), the examples, the `baton` command.
//!
//! `cargo test` builds only the binaries of the package under test, and never its examples,
//! so each is built here with `cargo build`, once per test process, in this test's profile,
//! target directory and `gpu-tests` feature: a no-op when it is up to date. Run outside
//! cargo (no `CARGO` in the environment: a test binary started by hand, or the GPU bundle of
//! `gpu-bundle` on a machine without a Rust toolchain, whose `cargo build --workspace --bins
//! --examples` put them at the same paths), an executable that is already there is used as
//! it is.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// The package of the test helper binaries.
pub const PEERS: &str = "baton-test-peers";

/// The test helper binary `name` (`baton-actor-peer`, …), as the `&str` the spawning
/// helpers take. The first call builds all of them.
pub fn peer(name: &str) -> &'static str {
    static PATHS: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let exe = built(&["-p", PEERS, "--bins"], &profile_dir().join(name));
    assert!(exe.exists(), "{}: not a binary of {PEERS}", exe.display());
    let exe = exe.to_str().expect("a UTF-8 target directory");
    let mut paths = PATHS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(known) = paths.iter().find(|p| **p == exe) {
        return known;
    }
    let leaked: &'static str = Box::leak(exe.into());
    paths.push(leaked);
    leaked
}

/// The example `name` of the facade.
pub fn example(name: &str) -> PathBuf {
    built(
        &["-p", "baton", "--example", name],
        &profile_dir().join("examples").join(name),
    )
}

/// The binary `name` of `package`, built without features (`package` need not have
/// `gpu-tests`).
pub fn bin(package: &str, name: &str) -> PathBuf {
    built_with(
        &["-p", package, "--bin", name],
        &profile_dir().join(name),
        false,
    )
}

/// `target/<profile>`: where cargo put this test binary's profile (it runs from `deps/`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("a test binary in target/<profile>/deps")
        .to_owned()
}

/// `exe`, after `cargo build ARGS` (with this test's `gpu-tests` feature).
fn built(args: &[&str], exe: &Path) -> PathBuf {
    built_with(args, exe, cfg!(feature = "gpu-tests"))
}

/// `exe`, after `cargo build ARGS [--features gpu-tests]` has run once in this process.
fn built_with(args: &[&str], exe: &Path, gpu_tests: bool) -> PathBuf {
    let profile_dir = profile_dir();
    let mut argv: Vec<&str> = args.to_vec();
    match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => {}
        Some(profile) => argv.extend(["--profile", profile]),
        None => panic!("no profile in {}", profile_dir.display()),
    }
    if gpu_tests {
        argv.extend(["--features", "gpu-tests"]);
    }
    let command = format!("cargo build {}", argv.join(" "));
    // Held while building: one cargo at a time, and each build once.
    static DONE: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if done.contains(&command) {
        return exe.to_owned();
    }
    let cargo = std::env::var_os("CARGO");
    if cargo.is_none() && exe.exists() {
        // Outside cargo, with the executable in place (a prebuilt bundle): use it.
        done.push(command);
        return exe.to_owned();
    }
    let status = Command::new(cargo.unwrap_or_else(|| "cargo".into()))
        .arg("build")
        .args(&argv)
        .arg("--target-dir")
        .arg(profile_dir.parent().expect("target/<profile>"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "{} is missing and cargo did not start ({e}): run `{command}` first",
                exe.display()
            )
        });
    assert!(status.success(), "`{command}`: {status}");
    assert!(exe.exists(), "`{command}` did not make {}", exe.display());
    done.push(command);
    exe.to_owned()
}
