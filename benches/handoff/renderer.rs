//! Item 6, the renderer example at 1920x1080 and 3840x2160: zero-copy fps vs a
//! host-staged pipeline (each tile copied to host shared memory and back, the pipeline
//! zero-copy replaces), both run by the example itself (`--staged`, CUDA only), in this same
//! program run: `renderer --backend cuda --frames N --size WxH [--staged]`, reading the fps
//! from its summary (a JSON line with an `fps` field, or the number next to the word
//! `fps`). The executable is `--renderer PATH`, else `renderer` beside this one (a bundle),
//! else the built example (`target/<profile>/examples/renderer`). Without a GPU only the
//! zero-copy host runs are made (`--staged` is CUDA only).

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

/// Runs the renderer once: its fps, and what went wrong if it exited with an error after
/// printing its summary (e.g. its own leak check).
fn render(
    exe: &Path,
    size: &str,
    frames: u64,
    backend: &str,
    staged: bool,
) -> Res<(f64, Option<String>)> {
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
    .stderr(Stdio::piped());
    if staged {
        cmd.arg("--staged");
    }
    let out = cmd.spawn()?.wait_with_output()?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let fps = parse_fps(&text);
    match (fps, out.status.success()) {
        (Some(fps), true) => Ok((fps, None)),
        (Some(fps), false) => {
            let why = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim()
                .to_owned();
            Ok((
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
    let backend = if gpu { "cuda" } else { "host" };
    for size in SIZES {
        for (variant, staged) in [("zero-copy", false), ("staged", true)] {
            if staged && !gpu {
                report.emit(json!({
                    "item": 6, "name": "renderer", "backend": backend, "size": size,
                    "variant": variant, "label": format!("renderer {size}, {variant}"),
                    "note": "not run: --staged is CUDA only",
                }));
                continue;
            }
            let (fps, trouble) = render(&exe, size, frames, backend, staged)?;
            report.emit(json!({
                "item": 6, "name": "renderer", "backend": backend, "size": size,
                "variant": variant, "frames": frames, "fps": fps,
                "label": format!("renderer {size}, {variant}"),
                "note": trouble.unwrap_or_default(),
            }));
        }
    }
    Ok(())
}
