//! End to end: the renderer example, small, on the host backend — with and without
//! `--chaos`. Without chaos the last PNG equals a single-process reference render pixel
//! for pixel; with chaos the run ends, restarts are counted and nothing leaks: on memfd
//! host memory (the default) nothing can, on named segments the supervisor sweeps what
//! each killed worker left before restarting it. (`tests/process_tree.rs` SIGKILLs the
//! renderer's root.)

#[path = "support/renderer.rs"]
mod renderer;
#[path = "../examples/renderer/scene.rs"]
mod scene;

use renderer::renderer;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills the run if the test fails before it ends.
struct Run(Option<Child>);

impl Drop for Run {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs the renderer with `args` on memfd host memory, at most `deadline`; returns its
/// stdout.
fn run(args: &[&str], deadline: Duration) -> String {
    run_on("memfd", args, deadline)
}

/// Runs the renderer with `args` on host memory of `flavor` (`BATON_HOST`), at most
/// `deadline`; returns its stdout.
fn run_on(flavor: &str, args: &[&str], deadline: Duration) -> String {
    let child = Command::new(renderer())
        .args(args)
        .env("BATON_BACKEND", "host")
        .env("BATON_HOST", flavor)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut run = Run(Some(child));
    let start = Instant::now();
    loop {
        let child = run.0.as_mut().unwrap();
        if child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(
            start.elapsed() < deadline,
            "the renderer did not finish within {deadline:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = run.0.take().unwrap().wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "renderer failed: {}\n{stdout}",
        output.status
    );
    stdout
}

fn decode(path: &Path) -> (u32, u32, Vec<u32>) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgba);
    let pixels = buf[..info.buffer_size()]
        .chunks_exact(4)
        .map(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]]))
        .collect();
    (info.width, info.height, pixels)
}

fn field<'a>(stdout: &'a str, name: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .unwrap_or_else(|| panic!("no {name:?} line in:\n{stdout}"))
        .trim()
}

#[test]
fn the_renderer_matches_a_single_process_render_and_leaks_nothing() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let stdout = run(
        &[
            "--size",
            "200x120",
            "--frames",
            "4",
            "--workers",
            "3",
            "--tile",
            "64",
            "--backend",
            "host",
            "--out",
            dir,
        ],
        Duration::from_secs(120),
    );
    assert!(
        field(&stdout, "leaked bytes").starts_with("0 (memfd host memory"),
        "{stdout}"
    );
    assert_eq!(field(&stdout, "restarts"), "0");
    assert!(
        field(&stdout, "handoffs/s").contains("(32 tiles composed, 0 missing)"),
        "{stdout}"
    );
    // The workers reuse their tile buffers, and the compositor keeps their mappings warm:
    // one open per tile in the first frame, none after, a hit for every later tile.
    assert_eq!(
        field(&stdout, "import cache"),
        "8 opens in the first frame, 0 after (0.00 per frame), 24 hits",
        "{stdout}"
    );
    for frame in [0, 3] {
        let (w, h, pixels) = decode(&out.path().join(format!("frame-{frame:04}.png")));
        assert_eq!((w, h), (200, 120));
        let reference = scene::reference_frame(200, 120, frame);
        let differing = pixels
            .iter()
            .zip(&reference)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(
            differing, 0,
            "frame {frame}: {differing} pixels differ from the reference"
        );
    }
}

#[test]
fn the_renderer_survives_chaos_and_still_leaks_nothing() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let stdout = run(
        &[
            "--size",
            "160x96",
            "--frames",
            "24",
            "--workers",
            "3",
            "--tile",
            "48",
            "--backend",
            "host",
            "--chaos",
            "4",
            "--out",
            dir,
        ],
        Duration::from_secs(180),
    );
    let restarts: u32 = field(&stdout, "restarts").parse().unwrap();
    assert!(
        restarts >= 1,
        "chaos killed and the supervisor restarted workers:\n{stdout}"
    );
    assert!(field(&stdout, "leaked bytes").starts_with("0 "), "{stdout}");
    assert!(
        field(&stdout, "frames").starts_with("24 at 160x96"),
        "{stdout}"
    );
    let (w, h, _) = decode(&out.path().join("frame-0023.png"));
    assert_eq!((w, h), (160, 96));
    // A killed worker's tiles are marked, and the frame that first shows it was written.
    if field(&stdout, "handoffs/s").contains(" 0 missing") {
        println!("every kill landed between frames: no tile was missing");
    } else {
        let marked = std::fs::read_dir(out.path())
            .unwrap()
            .filter_map(Result::ok)
            .find(|e| e.file_name().to_string_lossy().ends_with("-missing.png"))
            .expect("a PNG of the first frame with missing tiles");
        let (_, _, pixels) = decode(&marked.path());
        assert!(pixels.contains(&scene::MISSING_A) && pixels.contains(&scene::MISSING_B));
    }
}

/// Chaos on named segments: every worker SIGKILLed in the middle of a run leaves its
/// segments in /dev/shm, and the supervisor removes them before restarting it, so the run
/// ends with none left (the root's own final sweep finds nothing).
#[test]
fn on_named_segments_the_supervisor_sweeps_what_killed_workers_left() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let stdout = run_on(
        "named",
        &[
            "--size",
            "160x96",
            "--frames",
            "24",
            "--workers",
            "3",
            "--tile",
            "48",
            "--backend",
            "host",
            "--chaos",
            "4",
            "--out",
            dir,
        ],
        Duration::from_secs(180),
    );
    let restarts: u32 = field(&stdout, "restarts").parse().unwrap();
    assert!(restarts >= 1, "chaos killed workers:\n{stdout}");
    let leaked = field(&stdout, "leaked bytes");
    assert!(
        leaked.starts_with("0 (named host memory: 0 segments left"),
        "{stdout}"
    );
    // "…; the supervisor swept N segments (B bytes) of killed children, the final sweep M)"
    let count = |label: &str| -> usize {
        leaked
            .split_once(label)
            .and_then(|(_, tail)| tail.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {label:?} count in {leaked:?}"))
    };
    assert_eq!(
        count("the final sweep "),
        0,
        "the supervisor left nothing: {leaked}"
    );
    let swept = count("the supervisor swept ");
    // The first kill (frame 4) hits a worker that has rendered since frame 0 and holds a
    // segment per tile.
    assert!(
        swept >= 1,
        "the supervisor swept the killed workers' segments: {leaked}"
    );
}
