//! Replays the fuzz corpus as ordinary tests, on the stable toolchain, in CI.
//!
//! Every file in `fuzz/corpus/<target>/` goes through the same function the cargo-fuzz
//! target calls (`baton::messages::fuzzing`, `baton::ipc::fuzzing`), so an input that once
//! crashed a target — kept in the corpus after its fix — stays a regression test. The
//! built-in seeds run too, so a target is exercised even if its directory were emptied.
//!
//! To refresh the seed files after changing a target's input layout:
//! `BATON_WRITE_SEEDS=1 cargo test --test fuzz_corpus write_seed_files -- --ignored`.

use std::path::{Path, PathBuf};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn run_target(target: &str, input: &[u8]) {
    match target {
        "frame_decoder" => baton::messages::fuzzing::frame_decoder(input),
        "handle_msg" => baton::ipc::fuzzing::handle_msg(input),
        "handshake" => baton::ipc::fuzzing::handshake(input),
        other => panic!("no fuzz target {other}"),
    }
}

/// Runs every corpus file of `target`; returns how many there were.
fn replay(target: &str) -> usize {
    let dir = corpus(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    for file in &files {
        let input = std::fs::read(file).expect("reading a corpus file");
        let outcome = std::panic::catch_unwind(|| run_target(target, &input));
        assert!(
            outcome.is_ok(),
            "fuzz target {target} failed on {}",
            file.display()
        );
    }
    eprintln!("{target}: replayed {} corpus files", files.len());
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

#[test]
fn built_in_seeds() {
    for (target, input) in baton::ipc::fuzzing::seeds() {
        run_target(target, &input);
    }
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
