//! Tests that need two GPUs of one host (issue 27, "Same host, two GPUs"): whether they
//! run here.
//!
//! The convention: a two-GPU test on a machine with one GPU prints why and returns (it
//! passes: a one-GPU run of the GPU set is not a failure), unless
//! [`EXPECT_GPUS_ENV`] says the run expects two or more GPUs — then it fails, saying so.
//! A two-GPU run sets it: `BATON_EXPECT_GPUS=2 bash .gpu/run.sh 'another_gpu|two_gpus'`.

#![allow(dead_code)]

/// The number of GPUs the run expects this machine to have. A two-GPU test fails where it
/// finds fewer than two and this says two or more; otherwise it skips with a message.
pub const EXPECT_GPUS_ENV: &str = "BATON_EXPECT_GPUS";

/// The GPUs the run expects ([`EXPECT_GPUS_ENV`]; 0 when unset or not a number).
fn expected() -> usize {
    std::env::var(EXPECT_GPUS_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether `test` can run: this process sees at least two CUDA devices. With fewer it
/// prints why and answers `false`, or panics if [`EXPECT_GPUS_ENV`] expects two or more.
/// Panics if there is no CUDA driver or device at all (a `gpu-tests` build expects one).
pub fn two_gpus(test: &str) -> bool {
    let n = baton::ipc::cuda::probe().unwrap_or_else(|e| panic!("{test}: a CUDA device: {e}"));
    if n >= 2 {
        eprintln!("{test}: this process sees {n} GPUs: it runs across devices 0 and 1");
        return true;
    }
    let want = expected();
    assert!(
        want < 2,
        "{test} needs two GPUs and this process sees {n}, but {EXPECT_GPUS_ENV}={want} says \
         the run expects {want} (check CUDA_VISIBLE_DEVICES)"
    );
    skipped(
        test,
        &format!(
            "it needs two GPUs and this process sees {n} (set {EXPECT_GPUS_ENV}=2 to make that a failure)"
        ),
    );
    false
}

/// Says that `test` (or a case of it) did not run, and why, where a reader of the run's log
/// sees it: on the process's standard error itself, past the test harness's capture (which
/// keeps a passing test's output to itself), as a line starting `SKIPPED`.
pub fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let line = format!("SKIPPED {test}: {why}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}
