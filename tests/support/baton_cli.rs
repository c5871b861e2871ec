//! The `baton` command (package `baton-cli`), for the tests that run it.

#![allow(dead_code)]

// peer.rs, renderer.rs and baton_cli.rs each load it, so that each works alone; a test
// with several of them holds a copy per module, each building its own targets.
#[allow(clippy::duplicate_mod)]
#[path = "built.rs"]
mod built;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The `baton` binary, built now (a no-op when it is up to date: `cargo test` builds only
/// the binaries of the package under test), in the profile of this test.
pub fn baton() -> PathBuf {
    built::bin("baton-cli", "baton")
}

/// Runs `exe args…` to its end, killing it past `deadline`. Blocking.
pub fn run(exe: &Path, args: &[&str], deadline: Duration) -> Output {
    let mut child = Command::new(exe)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Drain the pipes on threads, so a large output cannot block the child.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut v).map(|_| v)
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut err, &mut v).map(|_| v)
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{} {args:?} did not finish within {deadline:?}",
                exe.display()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: out.join().unwrap().unwrap(),
        stderr: err.join().unwrap().unwrap(),
    }
}
