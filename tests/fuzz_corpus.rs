//! Replays the fuzz corpus as ordinary tests, on the stable toolchain, in CI.
//!
//! Every file in `fuzz/corpus/<target>/` goes through the same function the cargo-fuzz
//! target calls (`baton::messages::fuzzing`, `baton::ipc::fuzzing`), so an input that once
//! crashed a target — kept in the corpus after its fix — stays a regression test. The
//! built-in seeds run too, so a target is exercised even if its directory were emptied.
//!
//! Each target reports how far an input got (`FrameDepth`, `HandleDepth`,
//! `HandshakeDepth`). A replay that stays green while its inputs stop at the first check
//! proves nothing, so: every `regression-*` file must still reach the stage listed for it in
//! [`REGRESSIONS`] (the code it once crashed), and a share of each corpus must get past the
//! first stage ([`DEEP_SHARE`]). A change of the wire or handle format fails here, saying
//! to regenerate the corpus.
//!
//! To refresh the seed files after changing a target's input layout:
//! `BATON_WRITE_SEEDS=1 cargo test --test fuzz_corpus write_seed_files -- --ignored`.

use baton::ipc::fuzzing::{HandleDepth, HandshakeDepth};
use baton::messages::fuzzing::FrameDepth;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

/// How far an input got into a target: the stage's name, and its rank within the target.
type Depth = (&'static str, u8);

fn depth<D: std::fmt::Debug + Copy>(d: D, rank: u8) -> Depth {
    // The names are the variants' own: short, and stable while the enums are.
    let name: &'static str = Box::leak(format!("{d:?}").into_boxed_str());
    (name, rank)
}

fn run_target(target: &str, input: &[u8]) -> Depth {
    match target {
        "frame_decoder" => {
            let d = baton::messages::fuzzing::frame_decoder(input);
            depth(d, d as u8)
        }
        "handle_msg" => {
            let d = baton::ipc::fuzzing::handle_msg(input);
            depth(d, d as u8)
        }
        "handshake" => {
            let d = baton::ipc::fuzzing::handshake(input);
            depth(d, d as u8)
        }
        other => panic!("no fuzz target {other}"),
    }
}

/// Inputs kept because they once crashed a target (`regression-*` in its corpus), and the
/// stage each must still reach to exercise the code it crashed. A file named so but missing
/// here fails the replay: say how deep it must get.
const REGRESSIONS: &[(&str, &str, u8)] = &[(
    "handle_msg",
    "regression-cache-hit-past-mapping",
    HandleDepth::CacheHit as u8,
)];

/// The least share (in %) of each target's corpus that must get past the first stage
/// (`FrameDepth::Payload`, `HandleDepth::Refused`, `HandshakeDepth::FirstStep` or deeper).
/// The minimised corpora reach more (97%, 65% and 39% when this was written; the replay
/// prints its counts); a change of the wire or input format would drop most inputs at the
/// first stage and fail this.
const DEEP_SHARE: &[(&str, u8, u32)] = &[
    ("frame_decoder", FrameDepth::Payload as u8, 80),
    ("handle_msg", HandleDepth::Refused as u8, 40),
    ("handshake", HandshakeDepth::FirstStep as u8, 20),
];

/// Runs every corpus file of `target`; returns how many there were.
fn replay(target: &str) -> usize {
    let dir = corpus(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let mut depths: BTreeMap<Depth, usize> = BTreeMap::new();
    let (_, deep_rank, min_share) = *DEEP_SHARE
        .iter()
        .find(|(t, ..)| *t == target)
        .expect("a share for every target");
    let mut deep = 0;
    for file in &files {
        let input = std::fs::read(file).expect("reading a corpus file");
        let outcome = std::panic::catch_unwind(|| run_target(target, &input));
        let Ok(reached) = outcome else {
            panic!("fuzz target {target} failed on {}", file.display());
        };
        *depths.entry(reached).or_default() += 1;
        if reached.1 >= deep_rank {
            deep += 1;
        }
        let name = file.file_name().unwrap().to_string_lossy();
        if name.starts_with("regression-") {
            let (_, _, want) = REGRESSIONS
                .iter()
                .find(|(t, f, _)| *t == target && *f == name)
                .unwrap_or_else(|| {
                    panic!("{target}/{name} is a regression input: add it to REGRESSIONS")
                });
            assert!(
                reached.1 >= *want,
                "{target}/{name} now stops at {} (rank {}, needs {want}): it no longer reaches \
                 the code it once crashed — the input format changed? Rebuild the input for the \
                 new format (and regenerate the corpus: fuzz again, `cargo fuzz cmin`)",
                reached.0,
                reached.1
            );
        }
    }
    eprintln!(
        "{target}: replayed {} corpus files; stages reached: {depths:?}",
        files.len()
    );
    let share = deep * 100 / files.len().max(1);
    assert!(
        share >= min_share as usize,
        "only {share}% of the {target} corpus gets past the first stage (at least \
         {min_share}% must): the input format changed? Regenerate the seeds \
         (`write_seed_files`) and the corpus (fuzz again, `cargo fuzz cmin`)"
    );
    for (t, f, _) in REGRESSIONS.iter().filter(|(t, ..)| *t == target) {
        assert!(
            files.iter().any(|p| p.file_name().is_some_and(|n| n == *f)),
            "regression input {t}/{f} is missing from the corpus"
        );
    }
    files.len()
}

#[test]
fn frame_decoder_corpus() {
    assert!(replay("frame_decoder") > 0, "the corpus is empty");
}

#[test]
fn handle_msg_corpus() {
    assert!(replay("handle_msg") > 0, "the corpus is empty");
}

#[test]
fn handshake_corpus() {
    assert!(replay("handshake") > 0, "the corpus is empty");
}

/// The built-in seeds are written for the current formats: each gets to the last stage
/// its kind can reach (a change that breaks a seed's construction shows here).
#[test]
fn built_in_seeds() {
    let mut deepest: BTreeMap<&str, Depth> = BTreeMap::new();
    for (target, input) in baton::ipc::fuzzing::seeds() {
        let reached = run_target(target, &input);
        let best = deepest.entry(target).or_insert(reached);
        if reached.1 > best.1 {
            *best = reached;
        }
    }
    assert_eq!(deepest["frame_decoder"].0, "Frames");
    assert_eq!(deepest["handle_msg"].0, "CacheHit");
    assert_eq!(deepest["handshake"].0, "Completed");
}

/// Writes the built-in seeds into the corpus directories (named by content hash).
#[test]
#[ignore = "writes files: run with BATON_WRITE_SEEDS=1 to refresh the seed corpus"]
fn write_seed_files() {
    if std::env::var_os("BATON_WRITE_SEEDS").is_none() {
        eprintln!("BATON_WRITE_SEEDS is not set: nothing written");
        return;
    }
    for (target, input) in baton::ipc::fuzzing::seeds() {
        let dir = corpus(target);
        std::fs::create_dir_all(&dir).expect("creating the corpus directory");
        let name = format!("seed-{}", &blake3::hash(&input).to_hex()[..16]);
        std::fs::write(dir.join(name), &input).expect("writing a seed");
    }
}
