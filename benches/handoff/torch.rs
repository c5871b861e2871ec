//! Item 7, the peer: `bench/peers/torch_mp.py` passes CUDA tensors through
//! `torch.multiprocessing` queues in the same pattern (producer, consumer, ack), on the same
//! GPU in the same run. It prints JSON lines; they are folded into this report so that the
//! ratio against PyTorch is a same-run ratio.

use crate::report::Report;
use crate::{Config, Res};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

pub(crate) fn run(cfg: &Config, report: &mut Report) -> Res<()> {
    let Some(script) = &cfg.torch else {
        report.emit(json!({
            "item": 7, "name": "torch_roundtrip", "backend": "torch", "variant": "not-run",
            "label": "torch.multiprocessing peer: not run (pass --torch bench/peers/torch_mp.py)",
        }));
        return Ok(());
    };
    if report.machine.gpu.is_none() {
        report.emit(json!({
            "item": 7, "name": "torch_roundtrip", "backend": "torch", "variant": "not-run",
            "label": "torch.multiprocessing peer: not run (no GPU)",
        }));
        return Ok(());
    }
    let mut cmd = Command::new(&cfg.python);
    cmd.arg(script)
        .stdout(Stdio::piped())
        .env("PYTHONUNBUFFERED", "1");
    if cfg.quick {
        cmd.arg("--quick");
    }
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut results = 0;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        match serde_json::from_str::<Value>(&line) {
            Ok(Value::Object(mut o)) => {
                o.entry("backend").or_insert_with(|| "torch".into());
                results += usize::from(o.get("item").and_then(Value::as_i64) == Some(7));
                report.emit(Value::Object(o));
            }
            _ => eprintln!("[torch] {line}"),
        }
    }
    let status = child.wait()?;
    match (status.success(), results) {
        (true, _) => Ok(()),
        // Its figures came; only its exit failed (PyTorch has crashed at interpreter
        // shutdown after CUDA IPC): say so beside them.
        (false, n) if n > 0 => {
            report.emit(json!({
                "item": 0, "name": "torch_exit", "status": status.to_string(),
                "note": format!("{} exited with {status} after printing its {n} results", script.display()),
            }));
            Ok(())
        }
        (false, _) => Err(format!("{} exited with {status}", script.display()).into()),
    }
}
