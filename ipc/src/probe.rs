//! Timestamps of the stages of one handoff (issue 24), for the handoff benchmark's
//! `--stages` mode. Built only with the `stage-probes` feature; without it the probes in
//! the link code expand to nothing.
//!
//! A probe records its stage's name (and the frame's kind where it has one) with the time
//! on `CLOCK_MONOTONIC`, which the processes of one host share, so that the marks of both
//! ends of a link can be merged into one timeline. Nothing is recorded until
//! [`record`]`(true)`; a mark then costs one clock read and one uncontended lock.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// One stage passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// The stage, as the probe names it (`"sock.sent"`, `"link.call"`…).
    pub stage: &'static str,
    /// The frame's kind (`"Call"`, `"Release"`…) where the probe sees a frame, else `""`.
    pub kind: &'static str,
    /// When, in nanoseconds of `CLOCK_MONOTONIC`.
    pub ns: u64,
}

/// The most marks kept; later ones are dropped.
pub const CAPACITY: usize = 1 << 20;

static ON: AtomicBool = AtomicBool::new(false);
static MARKS: Mutex<Vec<Mark>> = Mutex::new(Vec::new());

/// Now, in nanoseconds of `CLOCK_MONOTONIC` (`clock_gettime`).
pub fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64) * 1_000_000_000 + t.tv_nsec as u64
}

/// Starts (room for [`CAPACITY`] marks is made first) or stops recording.
pub fn record(on: bool) {
    if on {
        let mut marks = MARKS.lock().unwrap_or_else(|e| e.into_inner());
        let room = CAPACITY.saturating_sub(marks.len());
        marks.reserve(room);
    }
    ON.store(on, Ordering::Release);
}

/// Records `stage` now, if recording.
pub fn mark(stage: &'static str) {
    mark_kind(stage, "");
}

/// Records `stage` of a frame of `kind` now, if recording.
pub fn mark_kind(stage: &'static str, kind: &'static str) {
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    let ns = now_ns();
    let mut marks = MARKS.lock().unwrap_or_else(|e| e.into_inner());
    if marks.len() < CAPACITY {
        marks.push(Mark { stage, kind, ns });
    }
}

/// The marks recorded so far, oldest first; the record is emptied.
pub fn take() -> Vec<Mark> {
    std::mem::take(&mut *MARKS.lock().unwrap_or_else(|e| e.into_inner()))
}
