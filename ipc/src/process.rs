//! Process identity and liveness, from `/proc`.
//!
//! A pid alone does not name a process: pids are reused. Baton names a process by
//! (boot id, pid, start time in clock ticks since boot), which no later process can share.

use baton_messages::{BootId, ProcessId};
use std::sync::OnceLock;

mod observed;

pub use observed::{MAX_OBSERVED, is_observed, peer_pidfd, pidfd_inode};
pub(crate) use observed::{open_pidfd, peer_ucred, register as observe};

/// The calling process's identity (computed once).
pub fn current() -> ProcessId {
    static ME: OnceLock<ProcessId> = OnceLock::new();
    *ME.get_or_init(|| {
        let pid = std::process::id();
        ProcessId {
            boot: boot_id(),
            pid,
            // Reading our own stat cannot fail on Linux; 0 still names us within this boot.
            start_ticks: start_ticks(pid).unwrap_or(0),
        }
    })
}

/// This process's PID namespace: the low 32 bits of its nsfs inode (`/proc/self/ns/pid`;
/// the host's initial namespace is `0xEFFF_FFFC`), 0 if that cannot be read. A pid means
/// something only within its namespace; names that carry a pid (named host segments) carry
/// this beside it, so that a process of another namespace does not judge them by a pid that
/// names another process there.
pub(crate) fn pid_namespace() -> u32 {
    use std::os::unix::fs::MetadataExt;
    static NS: OnceLock<u32> = OnceLock::new();
    *NS.get_or_init(|| std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino() as u32))
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`); all zeros where unreadable.
pub fn boot_id() -> BootId {
    static BOOT: OnceLock<BootId> = OnceLock::new();
    *BOOT.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .and_then(|s| parse_uuid(&s))
            .map(BootId)
            .unwrap_or(BootId([0; 16]))
    })
}

fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.trim().bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// What `/proc/<pid>/stat` says of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    state: char,
    start_ticks: u64,
}

fn stat(pid: u32) -> std::io::Result<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&text).ok_or_else(|| std::io::Error::other("unparsable /proc/<pid>/stat"))
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) may hold spaces and parentheses,
/// so fields are counted from the last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // `rest` starts at field 3 (state); start time is field 22.
    let start_ticks = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start_ticks })
}

/// The pids of `status`'s process (the text of `/proc/<pid>/status`), one per PID
/// namespace it is in, ours first: its `NSpid` line, if it has one.
fn namespace_pids(status: &str) -> Option<Vec<u32>> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_ascii_whitespace()
        .map(|p| p.parse().ok())
        .collect()
}

fn namespace_pids_of(who: &str) -> Option<Vec<u32>> {
    std::fs::read_to_string(format!("/proc/{who}/status"))
        .ok()
        .as_deref()
        .and_then(namespace_pids)
}

/// The pid that process `pid` (as we see it) has in its own PID namespace, if that
/// namespace is nested below ours: the last of its `NSpid` entries, when it has more than
/// our own. `None` when it is in our namespace or `/proc` cannot tell.
pub fn pid_in_nested_namespace(pid: u32) -> Option<u32> {
    let theirs = namespace_pids_of(&pid.to_string())?;
    let ours = namespace_pids_of("self")?;
    if theirs.len() > ours.len() {
        theirs.last().copied()
    } else {
        None
    }
}

/// Whether process `pid` (as we see it) lives in a PID namespace nested below ours: its
/// `NSpid` has more entries than our own. `false` when `/proc` cannot tell.
pub fn in_nested_pid_namespace(pid: u32) -> bool {
    pid_in_nested_namespace(pid).is_some()
}

/// A process's start time in clock ticks since boot, if it exists.
pub fn start_ticks(pid: u32) -> Option<u64> {
    stat(pid).ok().map(|s| s.start_ticks)
}

/// Whether a process is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// It runs (or is stopped), and is the same process (same start time).
    Alive,
    /// It exited, is a zombie, or its pid now belongs to another process.
    Dead,
    /// `/proc` could not tell (e.g. mounted with `hidepid`): treat as alive.
    Unknown,
}

/// Whether `process` is alive. A process of another boot is dead by definition; a link
/// peer of another PID namespace is asked through its pidfd (see [`is_observed`]), every
/// other process through `/proc`.
pub fn liveness(process: &ProcessId) -> Liveness {
    if process.boot != boot_id() {
        return Liveness::Dead;
    }
    if let Some(known) = observed::liveness(process) {
        return known;
    }
    liveness_of(process.pid, process.start_ticks)
}

/// Whether the process that had `pid` and started at `start_ticks` is alive.
pub fn liveness_of(pid: u32, start_ticks: u64) -> Liveness {
    match stat(pid) {
        Ok(s) if s.start_ticks != start_ticks || s.state == 'Z' || s.state == 'X' => Liveness::Dead,
        Ok(_) => Liveness::Alive,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Liveness::Dead,
        Err(_) => Liveness::Unknown,
    }
}

/// Tells when processes die.
///
/// A thread of its own polls a pidfd per watched process (`pidfd_open`: readable once the
/// process has exited; its pid cannot be reused while we hold it) and calls `on_death` once
/// per process. Where pidfds are unavailable it checks `/proc` every second instead. A
/// process is checked against its start time when it is first watched, so one that died
/// (and whose pid was reused) before the watch began is reported dead at once.
///
/// A zombie counts as dead: by then the kernel has released its memory mappings and
/// closed its descriptors, driver ones included.
///
/// Dropping the watch stops the thread (within a second); callbacks still running finish.
#[derive(Debug)]
pub struct DeathWatch {
    shared: std::sync::Arc<WatchShared>,
}

#[derive(Debug)]
struct WatchShared {
    pending: std::sync::Mutex<Vec<ProcessId>>,
    wake: std::os::fd::OwnedFd,
    stop: std::sync::atomic::AtomicBool,
}

impl WatchShared {
    fn wake(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }
}

impl DeathWatch {
    /// Starts the watching thread, named `name`.
    ///
    /// # Errors
    /// [`crate::Error::Io`] if the eventfd or the thread cannot be made.
    pub fn spawn(
        name: &str,
        on_death: impl Fn(ProcessId) + Send + 'static,
    ) -> crate::Result<DeathWatch> {
        use rustix::event::{EventfdFlags, eventfd};
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(|e| {
            crate::Error::Io {
                op: "eventfd",
                source: e.into(),
            }
        })?;
        let shared = std::sync::Arc::new(WatchShared {
            pending: std::sync::Mutex::new(Vec::new()),
            wake,
            stop: std::sync::atomic::AtomicBool::new(false),
        });
        let thread_shared = std::sync::Arc::clone(&shared);
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || watch_loop(&thread_shared, &on_death))
            .map_err(crate::Error::io("spawning the death-watch thread"))?;
        Ok(DeathWatch { shared })
    }

    /// Watches `process` (again is harmless); `on_death` is called once it has died.
    pub fn watch(&self, process: ProcessId) {
        self.shared
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(process);
        self.shared.wake();
    }
}

impl Drop for DeathWatch {
    fn drop(&mut self) {
        self.shared
            .stop
            .store(true, std::sync::atomic::Ordering::Release);
        self.shared.wake();
    }
}

/// How a watched process is observed.
enum Observed {
    Pidfd(std::os::fd::OwnedFd),
    /// No pidfd (old kernel, or not permitted): `/proc` is polled.
    Proc,
}

fn start_watching(process: &ProcessId) -> Option<Observed> {
    if process.boot != boot_id() {
        return None;
    }
    // A peer of another PID namespace: its pid here is not its own; its pidfd is.
    if let Some(pidfd) = observed::watch(process) {
        return pidfd.map(Observed::Pidfd);
    }
    let pid = rustix::process::Pid::from_raw(process.pid as i32)?;
    let observed = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => Observed::Pidfd(fd),
        Err(rustix::io::Errno::SRCH) => return None,
        Err(_) => Observed::Proc,
    };
    // The pid may have been reused before the pidfd was opened: the start time tells.
    (liveness_of(process.pid, process.start_ticks) != Liveness::Dead).then_some(observed)
}

fn watch_loop(shared: &WatchShared, on_death: &dyn Fn(ProcessId)) {
    use rustix::event::{PollFd, PollFlags, poll};
    use std::sync::atomic::Ordering;
    let mut watched: Vec<(ProcessId, Observed)> = Vec::new();
    let second = rustix::fs::Timespec {
        tv_sec: 1,
        tv_nsec: 0,
    };
    while !shared.stop.load(Ordering::Acquire) {
        let mut dead: Vec<ProcessId> = Vec::new();
        let new = std::mem::take(&mut *shared.pending.lock().unwrap_or_else(|p| p.into_inner()));
        for process in new {
            if watched.iter().any(|(p, _)| *p == process) || dead.contains(&process) {
                continue;
            }
            match start_watching(&process) {
                Some(observed) => watched.push((process, observed)),
                None => dead.push(process),
            }
        }
        if dead.is_empty() {
            let mut fds = vec![PollFd::new(&shared.wake, PollFlags::IN)];
            fds.extend(watched.iter().filter_map(|(_, o)| match o {
                Observed::Pidfd(fd) => Some(PollFd::new(fd, PollFlags::IN)),
                Observed::Proc => None,
            }));
            let _ = poll(&mut fds, Some(&second));
            let ready: Vec<bool> = fds
                .iter()
                .skip(1)
                .map(|f| !f.revents().is_empty())
                .collect();
            drop(fds);
            let mut buf = [0u8; 8];
            let _ = rustix::io::read(&shared.wake, &mut buf);
            let mut ready = ready.into_iter();
            watched.retain(|(process, observed)| {
                let gone = match observed {
                    Observed::Pidfd(_) => ready.next().unwrap_or(false),
                    Observed::Proc => {
                        liveness_of(process.pid, process.start_ticks) == Liveness::Dead
                    }
                };
                if gone {
                    dead.push(*process);
                }
                !gone
            });
        }
        for process in dead {
            tracing::debug!(%process, "watched process died");
            on_death(process);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_namespace_pids_are_the_nspid_entries() {
        let status = |nspid: &str| format!("Name:\tx\nTgid:\t7\nNSpid:{nspid}\nPPid:\t1\n");
        assert_eq!(namespace_pids(&status("\t4021")), Some(vec![4021]));
        assert_eq!(namespace_pids(&status("\t4021\t1")), Some(vec![4021, 1]));
        assert_eq!(
            namespace_pids(&status("\t4021\t7\t1")),
            Some(vec![4021, 7, 1])
        );
        assert_eq!(namespace_pids("Name:\tx\n"), None, "an old kernel");
        assert_eq!(namespace_pids(&status("\t4021\tx")), None, "garbage");
        assert_eq!(pid_in_nested_namespace(std::process::id()), None);
        // This process is no deeper than itself.
        assert!(!in_nested_pid_namespace(std::process::id()));
    }

    #[test]
    fn parses_stat_with_hostile_command_names() {
        let line = "1234 (a) b) (c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                state: 'S',
                start_ticks: 987654
            })
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn we_are_alive_and_a_changed_start_time_is_dead() {
        let me = current();
        assert_eq!(me.pid, std::process::id());
        assert_eq!(liveness(&me), Liveness::Alive);
        assert_eq!(liveness_of(me.pid, me.start_ticks + 1), Liveness::Dead);
        assert_eq!(liveness_of(u32::MAX - 7, 0), Liveness::Dead);
        let other_boot = ProcessId {
            boot: BootId([0xff; 16]),
            ..me
        };
        assert_eq!(liveness(&other_boot), Liveness::Dead);
    }

    #[test]
    fn the_death_watch_reports_a_child_once_it_exits_and_a_dead_pid_at_once() {
        use std::sync::mpsc;
        use std::time::Duration;
        let (tx, rx) = mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let watch = DeathWatch::spawn("test-watch", move |p| {
            let _ = tx.lock().unwrap().send(p);
        })
        .unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let process = ProcessId {
            boot: boot_id(),
            pid: child.id(),
            start_ticks: start_ticks(child.id()).unwrap(),
        };
        watch.watch(process);
        watch.watch(process);
        // A process that is not the one named (its start time differs) is dead already.
        let impostor = ProcessId {
            start_ticks: process.start_ticks + 1,
            ..process
        };
        watch.watch(impostor);
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(impostor));
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "a live process is not reported"
        );
        child.kill().unwrap();
        // Not reaped yet: a zombie counts as dead.
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(process));
        child.wait().unwrap();
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "reported once"
        );
    }

    #[test]
    fn boot_id_parses() {
        assert_eq!(
            parse_uuid("01234567-89ab-cdef-0123-456789abcdef\n"),
            Some([
                0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
                0xcd, 0xef
            ])
        );
        assert_ne!(boot_id(), BootId([0; 16]));
    }
}
