//! The peer processes: this executable re-spawned with `peer ROLE …` (never forked), and
//! the guard that kills and reaps one when it drops, also when a part fails.

use crate::Res;
use baton::Session;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long any wait on a peer (its link, its result, its exit) lasts at most.
pub(crate) const DEADLINE: Duration = Duration::from_secs(60);

/// Names a command that runs each peer outside namespaces (its words, then the peer's
/// command line): a profiler that `exec`s the peer, since the parent checks that the peer
/// that links is its own child (a wrapper that forks is refused: "did not link"). E.g.
/// heaptrack's preload, whose raw output `heaptrack_interpret` reads afterwards:
/// `BENCH_PEER_WRAPPER="env LD_PRELOAD=/usr/lib/heaptrack/libheaptrack_preload.so
/// DUMP_HEAPTRACK_OUTPUT=/tmp/ht-raw"`.
pub(crate) const WRAPPER_ENV: &str = "BENCH_PEER_WRAPPER";

/// The words of [`WRAPPER_ENV`], if it names a command.
fn wrapper() -> Option<Vec<String>> {
    let words: Vec<String> = std::env::var(WRAPPER_ENV)
        .ok()?
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    (!words.is_empty()).then_some(words)
}

/// A peer: killed and reaped on drop. Its stdout is read on a thread; a line starting
/// with `RESULT ` carries its JSON result.
pub(crate) struct PeerProcess {
    child: Option<Child>,
    lines: mpsc::Receiver<String>,
    role: String,
}

impl PeerProcess {
    /// Spawns `peer ROLE args…` with the session's token and `env`.
    pub(crate) fn spawn(
        session: &Session,
        role: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Res<PeerProcess> {
        Self::spawn_placed(session, role, args, env, false)
    }

    /// As [`spawn`](Self::spawn); with `own_namespaces`, as a container's process: in PID,
    /// network, IPC and mount namespaces of its own with a `/dev/shm` of its own
    /// (`unshare -p -n -i -f --mount-proc --kill-child`, a tmpfs mounted on `/dev/shm`;
    /// root only; dropped, `unshare` is killed and its child with it).
    pub(crate) fn spawn_placed(
        session: &Session,
        role: &str,
        args: &[&str],
        env: &[(&str, &str)],
        own_namespaces: bool,
    ) -> Res<PeerProcess> {
        let exe = std::env::current_exe()?;
        let mut cmd = if own_namespaces {
            let mut cmd = Command::new("unshare");
            cmd.args([
                "-p",
                "-n",
                "-i",
                "-f",
                "--mount-proc",
                "--kill-child",
                "sh",
                "-c",
            ])
            .arg("mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec \"$0\" \"$@\"")
            .arg(exe);
            cmd
        } else {
            match wrapper() {
                Some(words) => {
                    let mut cmd = Command::new(&words[0]);
                    cmd.args(&words[1..]).arg(exe);
                    cmd
                }
                None => Command::new(exe),
            }
        };
        cmd.arg("peer")
            .arg(role)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        session.pass_to(&mut cmd)?;
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(PeerProcess {
            child: Some(child),
            lines,
            role: role.to_owned(),
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Waits for the `RESULT` line, then for the peer to exit.
    pub(crate) fn result(&mut self, deadline: Duration) -> Res<Value> {
        let start = std::time::Instant::now();
        loop {
            let left = deadline.saturating_sub(start.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(json) = line.strip_prefix("RESULT ") {
                        let value: Value = serde_json::from_str(json)?;
                        self.wait(deadline.saturating_sub(start.elapsed()))?;
                        return Ok(value);
                    }
                    eprintln!("[{}] {line}", self.role);
                }
                Err(_) => {
                    return Err(
                        format!("peer {} gave no result within {deadline:?}", self.role).into(),
                    );
                }
            }
        }
    }

    /// Waits for the peer to exit successfully.
    pub(crate) fn wait(&mut self, deadline: Duration) -> Res<()> {
        let start = std::time::Instant::now();
        let Some(child) = self.child.as_mut() else {
            return Ok(());
        };
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("peer {} exited with {status}", self.role).into())
                };
            }
            if start.elapsed() > deadline {
                return Err(format!("peer {} did not exit within {deadline:?}", self.role).into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Whether the peer has exited (reaping it), without blocking.
    pub(crate) fn exited(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(_))) | None => {
                self.child = None;
                true
            }
            _ => false,
        }
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Prints a peer's result for its parent.
pub(crate) fn result_line(value: &Value) {
    println!("RESULT {value}");
}
