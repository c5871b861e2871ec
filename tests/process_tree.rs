//! Process trees: a SIGKILLed root takes its whole tree with it and leaves no host memory
//! behind; a child's environment never holds the session token, nor do its children's.
//!
//! This test process makes itself a child subreaper (`PR_SET_CHILD_SUBREAPER`), so that
//! the orphans of a killed root are reparented to it and reaped here: "no process left"
//! then means exited *and* reaped, and their exit statuses are ours to check. The tests
//! of this binary run one at a time (they measure the machine's `Shmem`).

#[path = "support/peer.rs"]
mod peer;
#[path = "support/renderer.rs"]
mod renderer;

use baton::ipc::process::{self, Liveness};
use baton::ipc::{LinkConfig, Listener, Session, host};
use rustix::process::{Pid, WaitOptions, WaitStatus};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);
/// How long a killed tree may take to be gone and its memory back.
const GONE_WITHIN: Duration = Duration::from_secs(10);
const MIB: u64 = 1 << 20;

/// One test at a time: `Shmem` is a machine-wide figure.
fn serial() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|p| p.into_inner())
}

fn become_subreaper() {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .expect("PR_SET_CHILD_SUBREAPER");
}

/// `Shmem` from `/proc/meminfo`, in bytes: every shared-memory page of the machine, memfds
/// and `/dev/shm` alike.
fn shmem() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("Shmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a Shmem line");
    kib * 1024
}

/// A process we saw, by identity (a pid alone may be reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    pid: u32,
    start_ticks: u64,
}

impl Seen {
    fn of(pid: u32) -> Option<Seen> {
        process::start_ticks(pid).map(|start_ticks| Seen { pid, start_ticks })
    }

    fn alive(self) -> bool {
        process::liveness_of(self.pid, self.start_ticks) == Liveness::Alive
    }
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// Every live descendant of `root`, from `/proc`.
fn descendants(root: u32) -> Vec<Seen> {
    let all: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, parent_of(pid)?)))
        .collect();
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for &(pid, ppid) in &all {
            if ppid == parent {
                if let Some(seen) = Seen::of(pid) {
                    out.push(seen);
                    frontier.push(pid);
                }
            }
        }
    }
    out
}

/// Reaps `seen` if it is our (adopted) child and has exited: its wait status, once.
fn reap(seen: Seen) -> Option<WaitStatus> {
    let pid = Pid::from_raw(seen.pid as i32)?;
    match rustix::process::waitpid(Some(pid), WaitOptions::NOHANG) {
        Ok(Some((_, status))) => Some(status),
        _ => None,
    }
}

/// A process tree under test: SIGKILLs and reaps the root and every descendant seen,
/// also when the test fails.
struct Tree {
    root: Option<Child>,
    seen: Vec<Seen>,
}

impl Drop for Tree {
    fn drop(&mut self) {
        if let Some(mut root) = self.root.take() {
            let _ = root.kill();
            let _ = root.wait();
        }
        for &s in &self.seen {
            if s.alive() {
                if let Some(pid) = Pid::from_raw(s.pid as i32) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
        }
        let start = Instant::now();
        while self.seen.iter().any(|&s| s.alive()) && start.elapsed() < GONE_WITHIN {
            for &s in &self.seen {
                reap(s);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Lines of a child's stdout, read on a thread, so that waiting for one has a deadline.
fn lines(stdout: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn wait_for_line(rx: &mpsc::Receiver<String>, what: &str, want: impl Fn(&str) -> bool) -> String {
    let start = Instant::now();
    loop {
        let left = DEADLINE.saturating_sub(start.elapsed());
        match rx.recv_timeout(left) {
            Ok(line) if want(&line) => return line,
            Ok(_) => {}
            Err(e) => panic!("no {what} within {DEADLINE:?} ({e})"),
        }
    }
}

/// What `/proc/<pid>/environ` and `/proc/<pid>/fd` show of the session token: whether the
/// token (or `BATON_TOKEN=`) is in the environment, and whether a descriptor still points
/// at the token pipe that `BATON_TOKEN_FD` names.
#[derive(Debug, PartialEq, Eq)]
struct TokenTrace {
    token_in_environ: bool,
    token_var: bool,
    token_fd_var: Option<String>,
    pipe_open: bool,
}

fn token_trace(pid: u32, token_hex: Option<&str>) -> TokenTrace {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let vars: Vec<String> = environ
        .split(|&b| b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    let text = vars.join("\n").to_ascii_lowercase();
    let token_fd_var = vars
        .iter()
        .find_map(|v| v.strip_prefix("BATON_TOKEN_FD="))
        .map(str::to_owned);
    let pipe_open = token_fd_var
        .as_deref()
        .and_then(|v| v.split_once(':'))
        .is_some_and(|(_, inode)| {
            let target = format!("pipe:[{inode}]");
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .unwrap()
                .filter_map(Result::ok)
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .any(|link| link.to_string_lossy() == target)
        });
    TokenTrace {
        token_in_environ: token_hex.is_some_and(|t| text.contains(&t.to_ascii_lowercase())),
        token_var: vars.iter().any(|v| v.starts_with("BATON_TOKEN=")),
        token_fd_var,
        pipe_open,
    }
}

/// The renderer's tree — root, compositor, three workers — is SIGKILLed root first in the
/// middle of a run. The kernel kills every child with it (`PR_SET_PDEATHSIG`); within a
/// few seconds no process of the tree is left, `/dev/shm` holds nothing of it, and `Shmem`
/// is back to where it was before the run: its memfds went with their last holder, with
/// nobody to sweep anything. Before the kill, every child's environment is checked for
/// the session token (it came through a pipe, which the child closed).
#[test]
fn a_sigkilled_renderer_root_takes_its_tree_and_its_host_memory_with_it() {
    let _one = serial();
    become_subreaper();
    let exe = renderer::renderer();
    let out = tempfile::tempdir().unwrap();
    // The root's socket directory, which its SIGKILL leaves behind, goes with this one.
    let tmp = tempfile::tempdir().unwrap();
    let before = shmem();

    let mut root = Command::new(exe)
        .args([
            "--size",
            "1280x720",
            "--frames",
            "1000000",
            "--workers",
            "3",
            "--tile",
            "128",
            "--backend",
            "host",
            "--out",
        ])
        .arg(out.path())
        .env("BATON_BACKEND", "host")
        .env(host::HOST_ENV, "memfd")
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let root_pid = root.id();
    let stdout = lines(root.stdout.take().unwrap());
    let mut tree = Tree {
        root: Some(root),
        seen: Vec::new(),
    };
    // In the middle of the run: every worker has joined and frames are being composed.
    let progress = wait_for_line(&stdout, "progress line", |l| l.starts_with("frame "));
    tree.seen = descendants(root_pid);
    let during = shmem();
    eprintln!(
        "process_tree: root {root_pid}, {} children {:?}; {progress}",
        tree.seen.len(),
        tree.seen.iter().map(|s| s.pid).collect::<Vec<_>>()
    );
    assert_eq!(tree.seen.len(), 4, "a compositor and three workers");
    for &child in &tree.seen {
        let trace = token_trace(child.pid, None);
        assert!(!trace.token_var, "BATON_TOKEN in a child's environment");
        assert!(
            trace.token_fd_var.is_some(),
            "the token came through a pipe: {trace:?}"
        );
        assert!(!trace.pipe_open, "the child closed the token pipe");
    }
    // The tree's memory is visible in the measure (a 3.5 MiB frame in the compositor and
    // as much in the workers' tiles), else its return proves nothing.
    assert!(
        during >= before + 4 * MIB,
        "Shmem before {before} B, during {during} B"
    );

    let mut root = tree.root.take().unwrap();
    root.kill().unwrap(); // SIGKILL
    let root_status = root.wait().unwrap();
    let start = Instant::now();
    let mut statuses = Vec::new();
    // Gone means reaped, not even a zombie: by the dying root's reaper threads, or here,
    // where its orphans are reparented.
    while tree.seen.iter().any(|&s| Seen::of(s.pid) == Some(s)) {
        for &s in &tree.seen {
            if let Some(status) = reap(s) {
                statuses.push((s.pid, status));
            }
        }
        assert!(
            start.elapsed() < GONE_WITHIN,
            "still there {GONE_WITHIN:?} after the root's SIGKILL: {:?}",
            tree.seen
                .iter()
                .filter(|&&s| Seen::of(s.pid) == Some(s))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let gone_after = start.elapsed();
    let namespace = format!("renderer-{root_pid}");
    assert!(
        host::list_segments(&namespace).unwrap().is_empty(),
        "nothing of the tree in /dev/shm"
    );
    let leftovers: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{namespace}.")))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let mut after = shmem();
    while after.abs_diff(before) > MIB && start.elapsed() < GONE_WITHIN {
        std::thread::sleep(Duration::from_millis(20));
        after = shmem();
    }
    eprintln!(
        "process_tree: root {root_status}; children gone {gone_after:.2?} after the kill; reaped here (the rest by the dying root): {statuses:?}"
    );
    eprintln!(
        "process_tree: Shmem before the run {} KiB, during {} KiB, after {} KiB",
        before / 1024,
        during / 1024,
        after / 1024
    );
    assert!(
        after.abs_diff(before) <= MIB,
        "Shmem back within 1 MiB of its value before the run: before {before} B, after {after} B"
    );
}

/// A child gets the token through a pipe: its environment holds neither the token nor
/// `BATON_TOKEN` (not even when the parent had it in its own: the spawner removes it), the
/// pipe is closed once read, and a grandchild it spawns inherits nothing that leads to the
/// token. SIGKILLing the child then takes the grandchild with it (`spawn_tied`), though
/// the grandchild never exits by itself.
#[test]
fn the_token_is_in_no_childs_environment_and_no_grandchild_inherits_it() {
    let _one = serial();
    become_subreaper();
    let session = Session::generate().unwrap();
    let token = session.token().to_hex();
    let (_tmp, dir) = peer::socket_dir();
    let listener = Listener::bind(&dir, "t.sock", LinkConfig::new(session.clone())).unwrap();
    listener.listener().set_nonblocking(true).unwrap();
    let sock = listener.path().to_str().unwrap().to_owned();
    let mut child = peer::Peer::spawn_with(
        peer::exe("baton-test-peer"),
        &session,
        &peer::namespace("tok"),
        &["token-hold", &sock],
        // As if the parent had been started with the token in its environment.
        &[("BATON_TOKEN", token.as_str())],
        true,
    );
    let child_pid = child.pid();
    let stdout = lines(child.take_stdout().unwrap());

    // The child proves it holds the token: its link's handshake passes.
    let start = Instant::now();
    let _link = loop {
        match listener.accept() {
            Ok(link) => break link,
            Err(baton::ipc::Error::Io { source, .. })
                if source.kind() == std::io::ErrorKind::WouldBlock =>
            {
                assert!(start.elapsed() < DEADLINE, "the child did not connect");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("the child's link failed: {e}"),
        }
    };
    assert_eq!(_link.peer().process.pid, child_pid);

    let line = wait_for_line(&stdout, "the grandchild's answer", |l| {
        l.starts_with("grandchild ")
    });
    let mut words = line.split_whitespace().skip(1);
    let grandchild: u32 = words.next().unwrap().parse().unwrap();
    let grandchild = Seen::of(grandchild).expect("the grandchild runs");
    // Killed and reaped here should the test fail before its parent's death does it.
    let _guard = Tree {
        root: None,
        seen: vec![grandchild],
    };
    assert_eq!(
        words.next(),
        Some("no-token"),
        "the grandchild found a token"
    );

    let theirs = token_trace(child_pid, Some(&token));
    eprintln!("process_tree: child {child_pid}: {theirs:?}");
    assert!(!theirs.token_in_environ && !theirs.token_var, "{theirs:?}");
    assert!(theirs.token_fd_var.is_some(), "{theirs:?}");
    assert!(!theirs.pipe_open, "the child closed the token pipe");
    let inherited = token_trace(grandchild.pid, Some(&token));
    eprintln!("process_tree: grandchild {}: {inherited:?}", grandchild.pid);
    assert!(
        !inherited.token_in_environ && !inherited.token_var && !inherited.pipe_open,
        "{inherited:?}"
    );

    // The grandchild holds until killed: only its parent's death ends it.
    child.kill9();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = reap(grandchild) {
            break status;
        }
        assert!(
            start.elapsed() < GONE_WITHIN,
            "the grandchild outlived its SIGKILLed parent by {GONE_WITHIN:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    eprintln!("process_tree: grandchild ended: {status:?}");
    assert_eq!(
        status.terminating_signal(),
        Some(rustix::process::Signal::KILL.as_raw()),
        "killed by its parent-death signal"
    );
}
