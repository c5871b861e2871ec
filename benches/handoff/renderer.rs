//! Item 6, the renderer example at 1920x1080 and 3840x2160: zero-copy fps vs a
//! host-staged pipeline (each tile copied to host shared memory and back, the pipeline
//! zero-copy replaces), both run by the example itself (`--staged`, CUDA only), in this same
//! program run: `renderer --backend cuda --frames N --size WxH [--staged]`, reading the fps
//! from its summary (a JSON line with an `fps` field, or the number next to the word
//! `fps`). The executable is `--renderer PATH`, else `renderer` beside this one (a bundle),
//! else the built example (`target/<profile>/examples/renderer`). Without a GPU only the
//! zero-copy host runs are made (`--staged` is CUDA only).
//!
//! On CUDA the runs export as legacy IPC (`BATON_CUDA_EXPORT=legacy`), and the 3840x2160
//! zero-copy run is made once more on VMM (`zero-copy-vmm`) where the device supports it.
//! From each run's summary the import cache's line (`import cache  N opens in the first
//! frame, M after …`: driver-level opens per frame after the first should be 0) and the
//! leak check's line (`leaked bytes  N (…)`, the renderer's own process tree's device
//! memory, or a labelled fallback) are kept in the record, and so is the first-frame line
//! (`first frame  X ms …; the N after it: Y fps`): the first frame also pays for one-time
//! work (links' set-up, opens, first launches), which in a short run weighs on the fps.

use crate::report::Report;
use crate::{Config, Res};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const SIZES: [&str; 2] = ["1920x1080", "3840x2160"];

fn locate(cfg: &Config) -> Option<PathBuf> {
    if let Some(p) = &cfg.renderer {
        return Some(p.clone());
    }
    let exe = std::env::current_exe().ok()?;
    let here = exe.parent()?;
    // target/<profile>/deps/handoff-… → target/<profile>/examples/renderer
    [
        here.join("renderer"),
        here.parent()?.join("examples").join("renderer"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

fn todo(report: &mut Report, why: &str) {
    for size in SIZES {
        report.emit(json!({
            "item": 6, "name": "renderer", "backend": "-", "size": size, "variant": "todo",
            "label": format!("renderer {size}: not measured"),
            "note": format!("not measured: {why}"),
        }));
    }
}

/// The fps a run printed: a JSON line's `fps`, or a number next to the word "fps".
pub(crate) fn parse_fps(output: &str) -> Option<f64> {
    for line in output.lines().rev() {
        if let Ok(Value::Object(o)) = serde_json::from_str::<Value>(line.trim()) {
            if let Some(f) = o.get("fps").and_then(Value::as_f64) {
                return Some(f);
            }
        }
    }
    for line in output.lines().rev() {
        let words: Vec<&str> = line
            .split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == ':')
            .filter(|w| !w.is_empty())
            .collect();
        for (i, w) in words.iter().enumerate() {
            if w.eq_ignore_ascii_case("fps") {
                let near = [i.checked_sub(1), Some(i + 1)];
                for j in near.into_iter().flatten() {
                    if let Some(v) = words.get(j).and_then(|w| w.parse::<f64>().ok()) {
                        return Some(v);
                    }
                }
            }
        }
    }
    None
}

/// The summary's first-frame line: (the first frame's milliseconds, the fps of the frames
/// after it).
pub(crate) fn parse_first_frame(output: &str) -> Option<(f64, f64)> {
    let line = output
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("first frame"))?;
    let ms = line.split_whitespace().next()?.parse().ok()?;
    let fps = line
        .rsplit(':')
        .next()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((ms, fps))
}

/// The numbers of the summary's import-cache line: (opens in the first frame, opens after).
pub(crate) fn parse_opens(output: &str) -> Option<(u64, u64)> {
    let line = output
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("import cache"))?;
    let (first, rest) = line.split_once("opens in the first frame,")?;
    let after = rest.split_whitespace().next()?;
    Some((first.trim().parse().ok()?, after.parse().ok()?))
}

/// The summary's leak line: (leaked bytes, what the parenthesis says was counted).
pub(crate) fn parse_leaked(output: &str) -> Option<(u64, String)> {
    let line = output
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("leaked bytes"))?
        .trim();
    let (n, how) = line.split_once(' ').unwrap_or((line, ""));
    Some((n.parse().ok()?, how.trim().to_owned()))
}

/// One renderer run's figures.
struct Run {
    fps: f64,
    /// The first frame's ms and the fps of the frames after it, where the summary says.
    first_frame: Option<(f64, f64)>,
    /// What went wrong, when it exited with an error after printing its summary (e.g. its
    /// own leak check).
    trouble: Option<String>,
    opens: Option<(u64, u64)>,
    leaked: Option<(u64, String)>,
}

/// Runs the renderer once, exporting as `export` (CUDA).
fn render(
    exe: &Path,
    size: &str,
    frames: u64,
    backend: &str,
    staged: bool,
    export: &str,
) -> Res<Run> {
    let out_dir = tempfile::tempdir()?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "--frames",
        &frames.to_string(),
        "--size",
        size,
        "--backend",
        backend,
    ])
    .arg("--out")
    .arg(out_dir.path())
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .env(baton::ipc::cuda::EXPORT_ENV, export);
    if staged {
        cmd.arg("--staged");
    }
    let out = cmd.spawn()?.wait_with_output()?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let fps = parse_fps(&text);
    let run = |fps, trouble| Run {
        fps,
        first_frame: parse_first_frame(&text),
        trouble,
        opens: parse_opens(&text),
        leaked: parse_leaked(&text),
    };
    match (fps, out.status.success()) {
        (Some(fps), true) => Ok(run(fps, None)),
        (Some(fps), false) => {
            let why = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim()
                .to_owned();
            Ok(run(
                fps,
                Some(format!("renderer exited with {}: {why}", out.status)),
            ))
        }
        (None, _) => {
            Err(format!("renderer {size} (staged: {staged}) printed no fps: {text}").into())
        }
    }
}

pub(crate) fn run(cfg: &Config, report: &mut Report) -> Res<()> {
    let Some(exe) = locate(cfg) else {
        todo(
            report,
            "the renderer example is not built (cargo build --release --example renderer), \
             or pass --renderer PATH",
        );
        return Ok(());
    };
    let frames = std::env::var("BENCH_RENDERER_FRAMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cfg.quick { 30 } else { 120 });
    let gpu = report.machine.gpu.is_some();
    let vmm = report.machine.gpu.as_ref().is_some_and(|g| g.vmm);
    let backend = if gpu { "cuda" } else { "host" };
    let mut failed = Vec::new();
    for size in SIZES {
        let mut variants = vec![("zero-copy", false, "legacy"), ("staged", true, "legacy")];
        if vmm && size == "3840x2160" {
            variants.push(("zero-copy-vmm", false, "vmm"));
        }
        for (variant, staged, export) in variants {
            if staged && !gpu {
                report.emit(json!({
                    "item": 6, "name": "renderer", "backend": backend, "size": size,
                    "variant": variant, "label": format!("renderer {size}, {variant}"),
                    "note": "not run: --staged is CUDA only",
                }));
                continue;
            }
            // One failed run (e.g. an export the renderer cannot use) does not lose the
            // others: it is recorded, and the part fails at the end.
            let run = match render(&exe, size, frames, backend, staged, export) {
                Ok(run) => run,
                Err(e) => {
                    report.emit(json!({
                        "item": 6, "name": "renderer", "backend": backend, "size": size,
                        "variant": variant, "export": export, "error": e.to_string(),
                        "label": format!("renderer {size}, {variant}: failed"),
                        "note": "failed (see the error field)",
                    }));
                    failed.push(format!("{size} {variant}: {e}"));
                    continue;
                }
            };
            let mut note = String::new();
            if let Some((ms, fps)) = run.first_frame {
                note += &format!("first frame {ms:.1} ms, {fps:.1} fps after it; ");
            }
            if let Some((first, after)) = run.opens {
                note += &format!("opens: {first} first frame, {after} after; ");
            }
            if let Some((n, _)) = &run.leaked {
                note += &format!("leaked {n} bytes; ");
            }
            note += &run.trouble.unwrap_or_default();
            report.emit(json!({
                "item": 6, "name": "renderer", "backend": backend, "size": size,
                "variant": variant, "export": if gpu { export } else { "-" },
                "frames": frames, "fps": run.fps,
                "first_frame_ms": run.first_frame.map(|f| f.0),
                "fps_after_first": run.first_frame.map(|f| f.1),
                "opens_first_frame": run.opens.map(|o| o.0),
                "opens_after": run.opens.map(|o| o.1),
                "leaked_bytes": run.leaked.as_ref().map(|l| l.0),
                "leaked_how": run.leaked.map(|l| l.1),
                "label": format!("renderer {size}, {variant}"),
                "note": note.trim_end_matches("; "),
            }));
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; ").into())
    }
}
