//! Item 6, the renderer example at 1920x1080 and 3840x2160: zero-copy fps vs a
//! host-staged pipeline (copy to host, shared memory, copy back), both run by the example
//! itself (`--staged`), in this same program run.
//!
//! TODO(issue 7, item 6): `examples/renderer.rs` is being written alongside this benchmark.
//! Until it exists with a `--staged` mode, this part reports itself as not measured. When
//! it does, this runs `renderer --frames N --size WxH [--staged]` (the built example next
//! to this executable, or `--renderer PATH`) and reads the fps from its summary: a JSON
//! line with an `fps` field, or the number before (or after) the word `fps`.

use crate::report::Report;
use crate::{Config, Res};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

const SIZES: [&str; 2] = ["1920x1080", "3840x2160"];

fn locate(cfg: &Config) -> Option<PathBuf> {
    if let Some(p) = &cfg.renderer {
        return Some(p.clone());
    }
    // target/<profile>/deps/handoff-… → target/<profile>/examples/renderer
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?;
    let p = dir.join("examples").join("renderer");
    p.exists().then_some(p)
}

fn todo(report: &mut Report, why: &str) {
    for size in SIZES {
        report.emit(json!({
            "item": 6, "name": "renderer", "backend": "-", "size": size, "variant": "todo",
            "label": format!("renderer {size}: not measured"),
            "note": format!("TODO: {why}"),
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

pub(crate) fn run(cfg: &Config, report: &mut Report) -> Res<()> {
    let Some(exe) = locate(cfg) else {
        todo(
            report,
            "examples/renderer is not built in this tree yet (issue 6); rerun with --renderer PATH",
        );
        return Ok(());
    };
    let help = Command::new(&exe).arg("--help").output()?;
    let help =
        String::from_utf8_lossy(&help.stdout).into_owned() + &String::from_utf8_lossy(&help.stderr);
    if !help.contains("--staged") {
        todo(
            report,
            "the renderer has no --staged (host-staged) mode yet",
        );
        return Ok(());
    }
    let frames = std::env::var("BENCH_RENDERER_FRAMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cfg.quick { 60 } else { 300 });
    for size in SIZES {
        for (variant, staged) in [("zero-copy", false), ("staged", true)] {
            let mut cmd = Command::new(&exe);
            cmd.args(["--frames", &frames.to_string(), "--size", size]);
            if staged {
                cmd.arg("--staged");
            }
            let out = cmd.output()?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            if !out.status.success() {
                return Err(format!("renderer {size} {variant} failed: {text}").into());
            }
            let fps = parse_fps(&text).ok_or_else(|| format!("no fps in: {text}"))?;
            report.emit(json!({
                "item": 6, "name": "renderer", "backend": "-", "size": size,
                "variant": variant, "frames": frames, "fps": fps,
                "label": format!("renderer {size}, {variant}"),
            }));
        }
    }
    Ok(())
}
