//! End to end: the renderer example, small, on the host backend — with and without
//! `--chaos`. Without chaos the last PNG equals a single-process reference render pixel
//! for pixel and the compositor opens each worker's tile sheet once (one lease per worker
//! and frame); with chaos the run ends and restarts are counted. The sheet's layout (the
//! arithmetic the CUDA kernels share) is checked against the frame's tiling. (`tests/process_tree.rs` SIGKILLs the renderer's root.)
//!
//! Leaks are counted here, not by the renderer: it runs with `--no-sweep`, so the root
//! removes nothing its children left, and the test lists the run's namespace
//! (`renderer-<pid>`) after the run. On named segments, without chaos nothing may be left
//! at all; with chaos the supervisor removes what each killed worker left before
//! restarting it (it sweeps only children that did not exit cleanly), so nothing is left
//! either. On memfd host memory (the default) a dead process's memory goes with it unless a
//! survivor keeps it mapped: the root reports what it still maps, and what the compositor
//! maps of killed workers (from its `/proc/<pid>/maps`, by inode).
//!
//! On two GPUs (`gpu-tests`; issue 27, "Same host, two GPUs"): the renderer on CUDA with
//! `--devices 0,1`, for each export kind: the compositor on device 0, four workers round
//! robin over devices 0 and 1 (each prints the device it uses), so half the tiles cross
//! GPUs through peer access; every tile is composed, the last frame matches the CPU
//! reference, nothing leaks. On one GPU it prints why and passes, unless
//! `BATON_EXPECT_GPUS=2` (`support/gpus.rs`) says the run expects two, and then it fails.

#[path = "support/gpus.rs"]
mod gpus;
#[path = "support/renderer.rs"]
mod renderer;
#[path = "../examples/renderer/scene.rs"]
mod scene;

use baton::ipc::host;
use renderer::renderer;
use std::collections::BTreeSet;
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

/// Sweeps a run's namespace when dropped, so a failed test leaves no segment behind.
struct Namespace(String);

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = host::sweep(&self.0);
    }
}

/// Runs the renderer with `args` and `--no-sweep` on host memory of `flavor`
/// (`BATON_HOST`: `memfd` or `named`), at most `deadline`; returns its stdout and its
/// segment namespace (left unswept by the root).
fn run(flavor: &str, args: &[&str], deadline: Duration) -> (String, Namespace) {
    run_with(flavor, args, &[], deadline)
}

/// As [`run`], with more environment variables.
fn run_with(
    flavor: &str,
    args: &[&str],
    env: &[(&str, &str)],
    deadline: Duration,
) -> (String, Namespace) {
    let child = Command::new(renderer())
        .args(args)
        .arg("--no-sweep")
        .env("BATON_BACKEND", "host")
        .env("BATON_HOST", flavor)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let ns = Namespace(format!("renderer-{}", child.id()));
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
    (stdout, ns)
}

/// The pids of the children the supervisor reported killed by SIGKILL.
fn killed_pids(stdout: &str) -> BTreeSet<u32> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("child exited: "))
        .filter(|l| l.ends_with("killed by signal 9"))
        .map(|l| {
            let pid = l.split(", pid ").nth(1).and_then(|r| r.split(',').next());
            pid.and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("a pid in {l:?}"))
        })
        .collect()
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

/// A sheet's tiles, by the arithmetic the CUDA kernels share (`Sheet::rect`), are the
/// frame's tiles of that worker, in order; every tile is in exactly one worker's sheet, and
/// fits its slot.
#[test]
fn a_sheet_holds_its_workers_tiles_at_known_offsets() {
    for (width, height, tile, workers) in [
        (200, 120, 64, 3),
        (160, 96, 48, 3),
        (3840, 2160, 256, 4),
        (1, 1, 256, 4),
        (300, 7, 5, 1),
        (64, 64, 16, 40),
    ] {
        let all = scene::tiles(width, height, tile);
        let mut seen = 0;
        for w in 0..workers {
            let sheet = scene::Sheet::of_worker(width, height, tile, w, workers);
            let want: Vec<scene::TileRect> = all
                .iter()
                .filter(|t| t.index % workers == w)
                .copied()
                .collect();
            let got: Vec<(usize, scene::TileRect)> = sheet.rects().collect();
            assert_eq!(
                got.iter().map(|(_, r)| *r).collect::<Vec<_>>(),
                want,
                "{width}x{height}, tile {tile}, worker {w} of {workers}"
            );
            for (j, (at, r)) in got.iter().enumerate() {
                assert_eq!(*at, j * sheet.slot());
                assert!((r.w * r.h) as usize <= sheet.slot());
            }
            assert_eq!(sheet.pixels(), got.len() * sheet.slot());
            seen += got.len();
        }
        assert_eq!(seen, all.len());
    }
}

#[test]
fn the_renderer_matches_a_single_process_render_and_leaks_nothing() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let (stdout, ns) = run(
        "named",
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
            "--frame-log",
            &format!("{dir}/frames.jsonl"),
        ],
        Duration::from_secs(120),
    );
    // The frame log: a line per frame, in order; 8 tiles in 3 sheets (one lease per
    // worker): one open per sheet in the first frame, a hit per sheet after; no GPU fields
    // on host memory.
    let log = std::fs::read_to_string(out.path().join("frames.jsonl")).unwrap();
    let frames: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(frames.len(), 4, "{log}");
    for (i, f) in frames.iter().enumerate() {
        let (opens, hits) = if i == 0 { (3, 0) } else { (0, 3) };
        assert_eq!(f["frame"], i as u64, "{log}");
        assert_eq!(
            (f["tiles"].as_u64(), f["tiles_missing"].as_u64()),
            (Some(8), Some(0))
        );
        assert_eq!(f["leases_held"].as_u64(), Some(3), "{log}");
        assert_eq!(
            (f["opens"].as_u64(), f["hits"].as_u64()),
            (Some(opens), Some(hits))
        );
        assert!(f["us"].as_f64().is_some_and(|us| us > 0.0), "{log}");
        assert!(f["gpu_us"].is_null() && f["fence_waits"].is_null(), "{log}");
    }
    // Every child exited cleanly and freed what it owned: no segment is left, though
    // nothing swept.
    let left = host::list_segments(&ns.0).unwrap();
    assert!(left.is_empty(), "segments left: {left:?}\n{stdout}");
    assert!(field(&stdout, "leaked bytes").starts_with("0 "), "{stdout}");
    assert!(killed_pids(&stdout).is_empty(), "{stdout}");
    assert_eq!(field(&stdout, "restarts"), "0");
    assert!(
        field(&stdout, "handoffs/s").contains("(32 tiles composed, 0 missing)"),
        "{stdout}"
    );
    // The workers reuse their sheets, and the compositor keeps their mappings warm: one
    // open per sheet in the first frame, none after, a hit for every later sheet.
    assert_eq!(
        field(&stdout, "import cache"),
        "3 opens in the first frame, 0 after (0.00 per frame), 9 hits",
        "{stdout}"
    );
    assert!(
        field(&stdout, "leases").starts_with("12 (3.00 per frame"),
        "{stdout}"
    );
    // The first frame apart (it also pays for the links' set-up), before the run's fps line,
    // which a reader takes as the last number next to "fps".
    let first = field(&stdout, "first frame");
    let ms: f64 = first
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no first-frame time in {first:?}"));
    let (after, fps) = first
        .rsplit_once("; the ")
        .and_then(|(_, rest)| rest.split_once(" after it: "))
        .unwrap_or_else(|| panic!("no fps after the first frame in {first:?}"));
    assert_eq!(after, "3", "{first}");
    let fps: f64 = fps.trim_end_matches(" fps").parse().unwrap();
    assert!(ms > 0.0 && fps > 0.0, "{first}");
    let line = |prefix: &str| stdout.lines().position(|l| l.starts_with(prefix));
    assert!(line("first frame") < line("fps "), "{stdout}");
    assert!(
        field(&stdout, "fps").parse::<f64>().is_ok_and(|f| f > 0.0),
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
    let (stdout, ns) = run(
        "memfd",
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
    assert!(!killed_pids(&stdout).is_empty(), "{stdout}");
    // Memfds have no names: nothing can be left in /dev/shm, and the root maps none of
    // its children's memory any more.
    assert!(host::list_segments(&ns.0).unwrap().is_empty());
    assert!(
        field(&stdout, "leaked bytes").starts_with("0 (memfd host memory"),
        "{stdout}"
    );
    // The compositor held the killed workers' leases and warm mappings: it let them go.
    // Seen from outside it (its /proc maps against the descriptors and mappings of the
    // live processes of the tree, by inode), with a worker just killed and restarted.
    assert!(
        field(&stdout, "dead tiles mapped").starts_with("0 bytes"),
        "{stdout}"
    );
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

/// The compositor SIGKILLed mid-run: the supervisor restarts it, every worker (still
/// running, its link to the dead compositor gone) joins the new one, which renders the
/// run again with every tile — its last frame equals the single-process reference — and
/// nothing leaks.
#[test]
fn workers_join_a_restarted_compositor() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let (stdout, _ns) = run(
        "memfd",
        &[
            "--size",
            "160x96",
            "--frames",
            "12",
            "--workers",
            "3",
            "--tile",
            "48",
            "--backend",
            "host",
            "--kill-compositor",
            "5",
            "--out",
            dir,
        ],
        Duration::from_secs(120),
    );
    assert!(stdout.contains("SIGKILL compositor"), "{stdout}");
    assert_eq!(killed_pids(&stdout).len(), 1, "{stdout}");
    assert!(
        field(&stdout, "handoffs/s").contains("(96 tiles composed, 0 missing)"),
        "{stdout}"
    );
    assert!(field(&stdout, "leaked bytes").starts_with("0 "), "{stdout}");
    let (w, h, pixels) = decode(&out.path().join("frame-0011.png"));
    assert_eq!((w, h), (160, 96));
    assert!(pixels == scene::reference_frame(160, 96, 11), "{stdout}");
}

/// Chaos on named segments: every worker SIGKILLed in the middle of a run leaves its
/// segments in /dev/shm (its `Drop` never ran), and the supervisor removes them before
/// restarting it — so, though the root sweeps nothing, the run ends with none left, and
/// nothing of a child that exited cleanly was ever left to sweep.
#[test]
fn on_named_segments_the_supervisor_sweeps_what_killed_workers_left() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let (stdout, ns) = run(
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
    assert!(!killed_pids(&stdout).is_empty(), "{stdout}");
    let left = host::list_segments(&ns.0).unwrap();
    assert!(
        left.is_empty(),
        "the supervisor left segments of killed workers, or a child leaked: {left:?}\n{stdout}"
    );
    let leaked = field(&stdout, "leaked bytes");
    assert!(
        leaked.starts_with("0 (named host memory: 0 segments left"),
        "{stdout}"
    );
    // "…; the supervisor swept N segments (B bytes) of killed children, …"
    let swept: usize = leaked
        .split_once("the supervisor swept ")
        .and_then(|(_, tail)| tail.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no swept count in {leaked:?}"));
    // The first kill (frame 4) hits a worker that has rendered since frame 0 and holds a
    // segment for its sheet.
    assert!(
        swept >= 1,
        "the supervisor swept the killed workers' segments: {leaked}"
    );
}

/// The renderer on CUDA with `--devices 0,1`, for each export kind: the compositor on
/// device 0, four workers round robin over devices 0 and 1, so that the tiles of workers 1
/// and 3 cross GPUs (peer access) into the compositor's frame. Each process says which
/// device it uses; every tile is composed, the last frame matches the CPU reference
/// (within the GPU's float rounding, as `--verify` measures it), and nothing leaks.
#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs two CUDA GPUs: --features gpu-tests"
)]
fn the_renderer_spreads_its_workers_over_two_gpus() {
    const TEST: &str = "the_renderer_spreads_its_workers_over_two_gpus";
    if !gpus::two_gpus(TEST) {
        return;
    }
    // No other Baton test on the GPUs meanwhile: the leak check reads device memory.
    let _gpu = baton::ipc::cuda::testing::exclusive_gpu(Duration::from_secs(1800))
        .expect("the GPU test lock");
    let mut failed = Vec::new();
    for export in ["legacy", "vmm", "pool"] {
        eprintln!("{TEST}: {export} memory");
        if std::panic::catch_unwind(|| renderer_on_two_gpus(export)).is_err() {
            eprintln!("{TEST}: {export} FAILED (its panic is above)");
            failed.push(export);
        }
    }
    assert!(failed.is_empty(), "{TEST} failed on {failed:?} memory");
}

fn renderer_on_two_gpus(export: &str) {
    const WORKERS: u32 = 4;
    const FRAMES: u64 = 6;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let (stdout, ns) = run_with(
        "memfd",
        &[
            "--size",
            "320x192",
            "--frames",
            &FRAMES.to_string(),
            "--workers",
            &WORKERS.to_string(),
            "--tile",
            "64",
            "--backend",
            "cuda",
            "--devices",
            "0,1",
            "--verify",
            "--out",
            dir,
        ],
        &[(baton::ipc::cuda::EXPORT_ENV, export)],
        // Three runs inside the GPU bundle's per-test limit (240 s): a hung run fails
        // here, naming its export kind, rather than timing the whole test out.
        Duration::from_secs(70),
    );
    println!("{stdout}");
    // Who used which device: "worker 3 uses CUDA device 1 (GPU-…), pid 1234".
    let uses = |who: &str| -> Vec<usize> {
        stdout
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{who} uses CUDA device ")))
            .map(|rest| {
                rest.split(' ')
                    .next()
                    .and_then(|d| d.parse().ok())
                    .unwrap_or_else(|| panic!("a device ordinal in {rest:?}"))
            })
            .collect()
    };
    assert_eq!(
        uses("compositor"),
        [0],
        "the compositor on device 0:\n{stdout}"
    );
    for w in 0..WORKERS {
        assert_eq!(
            uses(&format!("worker {w}")),
            [w as usize % 2],
            "worker {w} round robin over devices 0 and 1:\n{stdout}"
        );
    }
    assert!(
        field(&stdout, "device").contains("workers round robin over devices 0, 1"),
        "{stdout}"
    );
    assert!(killed_pids(&stdout).is_empty(), "{stdout}");
    assert_eq!(field(&stdout, "restarts"), "0", "{stdout}");
    // 5 × 3 tiles of 64 px, every frame.
    let tiles = 15 * FRAMES;
    assert!(
        field(&stdout, "handoffs/s").contains(&format!("({tiles} tiles composed, 0 missing)")),
        "{stdout}"
    );
    assert!(field(&stdout, "leaked bytes").starts_with("0 "), "{stdout}");
    assert!(host::list_segments(&ns.0).unwrap().is_empty());
    // "last frame vs single-process CPU render: 99.9778% exact, 100.0000% within 2/255, …"
    let verify = field(&stdout, "verify");
    let within: f64 = verify
        .split_once("% exact, ")
        .and_then(|(_, rest)| rest.split('%').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no \"within 2/255\" share in {verify:?}"));
    assert!(
        within >= 99.9,
        "the last frame, its tiles rendered on two GPUs, differs from the CPU reference: {verify}"
    );
    let (w, h, _) = decode(&out.path().join(format!("frame-{:04}.png", FRAMES - 1)));
    assert_eq!((w, h), (320, 192));
}
