//! Results: JSON lines as they come, then a table and the ratios against the targets.

use crate::machine::Machine;
use crate::{Config, Res};
use serde_json::{Map, Value, json};
use std::fs::File;
use std::io::Write;
use std::time::Instant;

pub(crate) struct Report {
    pub(crate) machine: Machine,
    records: Vec<Value>,
    file: Option<File>,
    errors: Vec<String>,
    /// `--stages`: no table of the targets.
    pub(crate) stages_only: bool,
    started: Instant,
    /// Parts are skipped once the run has taken this long.
    budget: Option<std::time::Duration>,
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

fn text<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

impl Report {
    pub(crate) fn new(machine: Machine, budget: Option<std::time::Duration>) -> Res<Report> {
        let file = match std::env::var_os("OUT") {
            Some(dir) => Some(
                File::options()
                    .create(true)
                    .append(true)
                    .open(std::path::Path::new(&dir).join("bench.jsonl"))?,
            ),
            None => None,
        };
        Ok(Report {
            machine,
            records: Vec::new(),
            file,
            errors: Vec::new(),
            stages_only: false,
            started: Instant::now(),
            budget,
        })
    }

    pub(crate) fn header(&mut self, cfg: &Config) {
        println!("# Baton handoff benchmark");
        println!("# machine: {}", self.machine.describe());
        if let Some(why) = &self.machine.no_gpu {
            println!("# no CUDA items: {why}");
        }
        println!(
            "# backends: {}; {}",
            cfg.backends
                .iter()
                .map(|b| b.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            if cfg.quick {
                "quick run (fewer samples)"
            } else {
                "full run"
            }
        );
        let m = self.machine.json();
        self.emit(json!({"item": 0, "name": "machine", "machine": m, "quick": cfg.quick}));
    }

    /// Prints and stores one result (an object with at least `item` and `name`).
    pub(crate) fn emit(&mut self, mut record: Value) {
        if let Some(obj) = record.as_object_mut() {
            obj.insert("bench".into(), "baton-handoff".into());
        }
        let line = record.to_string();
        println!("{line}");
        if let Some(f) = &mut self.file {
            let _ = writeln!(f, "{line}");
        }
        self.records.push(record);
    }

    /// A record with the fields of `extra` merged in.
    pub(crate) fn emit_with(&mut self, base: Value, extra: Value) {
        let mut obj: Map<String, Value> = base.as_object().cloned().unwrap_or_default();
        if let Some(e) = extra.as_object() {
            obj.extend(e.clone());
        }
        self.emit(Value::Object(obj));
    }

    /// Runs one part; a failure is reported and the run goes on. Its wall time is printed
    /// (an `elapsed` record), so that a run's budget can be checked part by part.
    /// Past the `--budget`, the part is skipped and a `skipped` record says so.
    pub(crate) fn attempt(&mut self, what: &str, f: impl FnOnce(&mut Report) -> Res<()>) {
        let so_far = self.started.elapsed();
        if let Some(budget) = self.budget.filter(|b| so_far > *b) {
            eprintln!(
                "!! {what} skipped: the run has taken {so_far:.0?}, over its budget of {budget:?}"
            );
            self.errors
                .push(format!("{what}: skipped (over the --budget of {budget:?})"));
            self.emit(json!({"item": -1, "name": "skipped", "what": what,
                             "seconds_so_far": so_far.as_secs_f64(), "budget_s": budget.as_secs_f64()}));
            return;
        }
        eprintln!("== {what}");
        let start = Instant::now();
        let outcome = f(self);
        let seconds = start.elapsed().as_secs_f64();
        if let Err(e) = outcome {
            self.failed(what, &e.to_string());
        }
        eprintln!(
            "== {what}: {seconds:.1} s (run so far {:.1} s)",
            self.started.elapsed().as_secs_f64()
        );
        self.emit(json!({
            "item": 0, "name": "elapsed", "what": what, "seconds": (seconds * 10.0).round() / 10.0,
        }));
    }

    /// Records that `what` failed with `error` (listed again after the table).
    pub(crate) fn failed(&mut self, what: &str, error: &str) {
        eprintln!("!! {what} failed: {error}");
        self.errors.push(format!("{what}: {error}"));
        self.emit(json!({"item": -1, "name": "error", "what": what, "error": error}));
    }

    /// The p50 of the first record named `name` of `backend` and `variant`.
    pub(crate) fn p50_of(&self, name: &str, backend: &str, variant: &str) -> Option<f64> {
        self.find(|r| {
            text(r, "name") == name
                && text(r, "backend") == backend
                && text(r, "variant") == variant
        })
        .and_then(|r| num(r, "p50_us"))
    }

    fn find(&self, pred: impl Fn(&Value) -> bool) -> Option<&Value> {
        self.records.iter().find(|r| pred(r))
    }

    /// Prints the table, then the targets.
    pub(crate) fn finish(mut self) {
        println!();
        println!("## Results on {}", self.machine.describe());
        println!();
        println!(
            "| item | what | backend | p50 | p99 | rate | note |\n|---|---|---|---:|---:|---:|---|"
        );
        for r in &self.records {
            let Some(item) = r.get("item").and_then(Value::as_i64) else {
                continue;
            };
            if item <= 0 || item == 24 || text(r, "name") == "target" {
                continue;
            }
            let us = |k: &str| num(r, k).map_or(String::new(), |v| format!("{v:.1} µs"));
            let rate = if let Some(v) = num(r, "per_s") {
                format!("{v:.0}/s")
            } else if let Some(v) = num(r, "gbps") {
                format!("{v:.0} GB/s")
            } else if let Some(v) = num(r, "fps") {
                format!("{v:.1} fps")
            } else {
                String::new()
            };
            println!(
                "| {item} | {} | {} | {} | {} | {rate} | {} |",
                text(r, "label"),
                text(r, "backend"),
                us("p50_us"),
                us("p99_us"),
                text(r, "note"),
            );
        }
        if self.stages_only {
            return self.tail();
        }
        let targets = self.targets();
        println!();
        println!(
            "## Targets of issue 48, and the renderer's and bandwidth's (ratios within this run)"
        );
        println!();
        println!("| target | measured | ratio | met |\n|---|---|---:|---|");
        for t in &targets {
            println!(
                "| {} | {} | {} | {} |",
                text(t, "target"),
                text(t, "measured"),
                num(t, "ratio").map_or(String::new(), |r| format!("{r:.2}")),
                match t.get("met").and_then(Value::as_bool) {
                    Some(true) => "yes",
                    Some(false) => "**no**",
                    None => "n/a",
                }
            );
        }
        for t in targets {
            self.emit(t);
        }
        self.tail();
    }

    /// The run's wall time and the parts that failed.
    fn tail(&self) {
        println!();
        println!("# whole run: {:.1} s", self.started.elapsed().as_secs_f64());
        if !self.errors.is_empty() {
            println!();
            println!("## Parts that failed");
            for e in &self.errors {
                println!("- {e}");
            }
        }
    }

    fn targets(&self) -> Vec<Value> {
        let mut out = Vec::new();
        let target = |what: &str, measured: String, met: Option<bool>, ratio: Option<f64>| {
            json!({"item": 0, "name": "target", "target": what, "measured": measured,
                   "met": met, "ratio": ratio.map(crate::stats::round)})
        };
        let not_measured = |what: &str, why: &str| target(what, why.to_owned(), None, None);
        let p50 = |name: &str, backend: &str, variant: &str| {
            self.find(|r| {
                text(r, "name") == name
                    && text(r, "backend") == backend
                    && text(r, "variant") == variant
            })
            .and_then(|r| num(r, "p50_us"))
        };
        let cuda: Vec<&str> = {
            let mut b: Vec<&str> = self
                .records
                .iter()
                .filter(|r| text(r, "name") == "cached_roundtrip")
                .map(|r| text(r, "backend"))
                .filter(|b| b.starts_with("cuda"))
                .collect();
            b.dedup();
            b
        };

        // 1. Stream ordering costs at most 20% over the unordered round trip.
        let what = "stream-ordered cached round trip ≤ 1.2× the unordered one";
        for &b in &cuda {
            match (
                p50("cached_roundtrip", b, "ordered"),
                p50("cached_roundtrip", b, "share"),
            ) {
                (Some(o), Some(u)) => out.push(target(
                    &format!("{what} ({b})"),
                    format!("{o:.1} µs / {u:.1} µs"),
                    Some(o / u <= 1.2),
                    Some(o / u),
                )),
                _ => out.push(not_measured(&format!("{what} ({b})"), "see item 2")),
            }
        }
        if cuda.is_empty() {
            out.push(not_measured(what, "no CUDA backend ran item 2"));
        }

        // 2. Against PyTorch, same run, its consumer keeping the tensor.
        let what = "Baton stream-ordered round trip ≥ 4× faster than torch.multiprocessing (consumer keeps the tensor)";
        let torch = p50("torch_roundtrip", "torch", "cached");
        for &b in &cuda {
            match (torch, p50("cached_roundtrip", b, "ordered")) {
                (Some(t), Some(o)) => out.push(target(
                    &format!("{what} ({b})"),
                    format!("torch {t:.1} µs / Baton {o:.1} µs"),
                    Some(t / o >= 4.0),
                    Some(t / o),
                )),
                (None, _) => out.push(not_measured(
                    &format!("{what} ({b})"),
                    "torch peer not run (item 7, --torch)",
                )),
                (_, None) => out.push(not_measured(&format!("{what} ({b})"), "see item 2")),
            }
        }
        if cuda.is_empty() {
            out.push(not_measured(what, "no CUDA backend ran item 2"));
        }

        // 3–5. The renderer.
        let fps = |variant: &str| {
            self.find(|r| {
                text(r, "name") == "renderer"
                    && text(r, "size") == "3840x2160"
                    && text(r, "variant") == variant
            })
            .and_then(|r| num(r, "fps"))
        };
        let what = "renderer zero-copy ≥ 10× host-staged fps at 3840x2160, legacy";
        match (fps("zero-copy"), fps("staged")) {
            (Some(z), Some(s)) => out.push(target(
                what,
                format!("{z:.1} fps / {s:.1} fps"),
                Some(z / s >= 10.0),
                Some(z / s),
            )),
            _ => out.push(not_measured(what, "not measured (see item 6)")),
        }
        let what = "renderer VMM ≥ 0.9× renderer legacy fps (3840x2160, zero-copy)";
        match (fps("zero-copy-vmm"), fps("zero-copy")) {
            (Some(v), Some(l)) => out.push(target(
                what,
                format!("{v:.1} fps / {l:.1} fps"),
                Some(v / l >= 0.9),
                Some(v / l),
            )),
            _ => out.push(not_measured(what, "not measured (see item 6)")),
        }
        let what = "driver-level opens per frame after the first frame: 0 (renderer)";
        let runs: Vec<(String, u64)> = self
            .records
            .iter()
            .filter(|r| text(r, "name") == "renderer")
            .filter_map(|r| {
                let after = r.get("opens_after")?.as_u64()?;
                Some((format!("{} {}", text(r, "size"), text(r, "variant")), after))
            })
            .collect();
        if runs.is_empty() {
            out.push(not_measured(what, "no renderer summary read (see item 6)"));
        } else {
            let total: u64 = runs.iter().map(|(_, n)| n).sum();
            let detail: Vec<String> = runs.iter().map(|(r, n)| format!("{r}: {n}")).collect();
            out.push(target(
                what,
                format!(
                    "{total} opens after the first frame ({})",
                    detail.join(", ")
                ),
                Some(total == 0),
                None,
            ));
        }

        // 6. A cold handoff of a new allocation costs at most twice a cached one, on every
        // export kind that ran item 3: with the synchronous `Backend::allocate` (`new`) and
        // stream-ordered (`new-on-stream`).
        let what = "cold handoff with a new allocation ≤ 2× the cached round trip";
        let mut cold: Vec<&str> = self
            .records
            .iter()
            .filter(|r| text(r, "name") == "cold_handoff" && text(r, "variant") == "same")
            .map(|r| text(r, "backend"))
            .collect();
        cold.dedup();
        for &b in &cold {
            let cached = p50("cold_handoff", b, "same");
            for (variant, how) in [
                ("new", "allocate, synchronous"),
                ("new-on-stream", "allocate_on a stream"),
            ] {
                let what = format!("{what} ({b}, {how})");
                match (p50("cold_handoff", b, variant), cached) {
                    (Some(c), Some(h)) => out.push(target(
                        &what,
                        format!("{c:.1} µs / {h:.1} µs, both on one ipc link"),
                        Some(c / h <= 2.0),
                        Some(c / h),
                    )),
                    _ => out.push(not_measured(&what, "not run (item 3)")),
                }
            }
        }
        if cold.is_empty() {
            out.push(not_measured(what, "no backend ran item 3"));
        }

        // 7. Pipelined handoffs, every backend.
        let pipelined: Vec<&Value> = self
            .records
            .iter()
            .filter(|r| text(r, "name") == "pipelined")
            .collect();
        for r in &pipelined {
            let per_s = num(r, "per_s").unwrap_or(0.0);
            out.push(target(
                &format!("pipelined handoffs ≥ 400,000/s ({})", text(r, "backend")),
                format!("{per_s:.0}/s"),
                Some(per_s >= 400_000.0),
                Some(per_s / 400_000.0),
            ));
        }
        if pipelined.is_empty() {
            out.push(not_measured(
                "pipelined handoffs ≥ 400,000/s",
                "no backend ran item 4",
            ));
        }

        // 8. Imported bandwidth.
        let bandwidth: Vec<&Value> = self
            .records
            .iter()
            .filter(|r| text(r, "name") == "bandwidth_ratio")
            .collect();
        for r in &bandwidth {
            let ratio = num(r, "ratio").unwrap_or(0.0);
            out.push(target(
                &format!(
                    "imported bandwidth ≥ 99% of local ({}, {})",
                    text(r, "backend"),
                    text(r, "variant")
                ),
                format!("{:.1}%", ratio * 100.0),
                Some(ratio >= 0.99),
                Some(ratio),
            ));
        }
        if bandwidth.is_empty() {
            out.push(not_measured(
                "imported bandwidth ≥ 99% of local, both directions",
                "no CUDA backend ran item 5",
            ));
        }
        // Across namespaces (issue 51, `--across-namespaces`): the importer in PID and
        // network namespaces of its own against one in ours; a refused path says why.
        for r in self.records.iter().filter(|r| {
            let name = text(r, "name");
            name == "bandwidth_across_namespaces_ratio"
                || name == "bandwidth_across_namespaces_refused"
        }) {
            let what = format!(
                "device bandwidth across PID and network namespaces ≥ 99% of within ({}, {})",
                text(r, "backend"),
                text(r, "variant")
            );
            match num(r, "ratio") {
                Some(ratio) => out.push(target(
                    &what,
                    format!("{:.1}%", ratio * 100.0),
                    Some(ratio >= 0.99),
                    Some(ratio),
                )),
                None => out.push(target(
                    &what,
                    format!("refused: {}", text(r, "error")),
                    None,
                    None,
                )),
            }
        }

        // 9. The cached round trip against the socket floor, every backend: p50 at most
        // half the floor's, p99 at most twice the floor's p50.
        let floor = self
            .find(|r| text(r, "name") == "floor")
            .and_then(|r| num(r, "p50_us"));
        for r in self
            .records
            .iter()
            .filter(|r| text(r, "name") == "cached_roundtrip" && text(r, "variant") == "share")
        {
            let b = text(r, "backend");
            let Some(f) = floor else { continue };
            if let Some(p) = num(r, "p50_us") {
                out.push(target(
                    &format!("cached round trip p50 ≤ 0.5× the socket floor ({b})"),
                    format!("{p:.1} µs / {f:.1} µs"),
                    Some(p / f <= 0.5),
                    Some(p / f),
                ));
            }
            if let Some(p) = num(r, "p99_us") {
                out.push(target(
                    &format!("cached round trip p99 ≤ 2× the socket floor ({b})"),
                    format!("p99 {p:.1} µs / floor {f:.1} µs"),
                    Some(p / f <= 2.0),
                    Some(p / f),
                ));
            }
        }
        if floor.is_none() {
            out.push(not_measured(
                "cached round trip ≤ 0.5× the socket floor",
                "the floor was not measured (item 1)",
            ));
        }
        if let Some(r) = self.find(|r| text(r, "name") == "fence_compare") {
            out.push(target(
                "(item 8) cheaper fence per handoff, driver calls (event vs counter)",
                text(r, "note").to_owned(),
                None,
                num(r, "ratio"),
            ));
        }
        out
    }
}

/// Adds the fields of `extra` (an object) to `base` (an object).
pub(crate) fn merge(base: &mut Value, extra: Value) {
    if let (Some(b), Value::Object(e)) = (base.as_object_mut(), extra) {
        b.extend(e);
    }
}
