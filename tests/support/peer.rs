//! Spawning and reaping helper processes in tests: every child is killed and reaped when
//! its guard drops, also when a test fails.

#![allow(dead_code)]

// peer.rs, renderer.rs and baton_cli.rs each load it, so that each works alone; a test
// with several of them holds a copy per module, each building its own targets.
#[allow(clippy::duplicate_mod)]
#[path = "built.rs"]
mod built;

use baton::Session;
use baton::ipc::{Link, Listener, host};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The test helper binary `name` (`baton-actor-peer`, …; package `baton-test-peers`), built
/// on first use.
pub fn exe(name: &str) -> &'static str {
    built::peer(name)
}

/// Where a helper process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Beside the test, in its namespaces.
    Here,
    /// In namespaces of its own, as a container's process is: PID, network, IPC and mount,
    /// with a `/dev/shm` of its own (a fresh tmpfs), through
    /// `unshare -p -n -i -f --mount-proc --kill-child` (root only). `/proc` there is its
    /// namespace's, so it names itself by its namespace's pid (1); it shares with the test
    /// only the filesystem (the socket's directory) and the devices.
    OwnNamespaces,
}

/// A helper process that is SIGKILLed and reaped when dropped.
pub struct Peer {
    /// The process spawned: the helper itself, or `unshare` around it.
    child: Option<Child>,
    /// Under `unshare -f` ([`Placement::OwnNamespaces`]): the helper's pid here, the init
    /// of its namespace (`unshare` forked it and waits for it).
    inner: Option<u32>,
    what: String,
}

impl Peer {
    /// Runs `exe args…` with the session's token (through an inherited pipe) and the segment
    /// namespace in its environment, allocating named host segments.
    pub fn spawn_exe(exe: &str, session: &Session, namespace: &str, args: &[&str]) -> Peer {
        Self::spawn_with(exe, session, namespace, args, &[], false)
    }

    /// Runs the test helper binary in a role.
    pub fn spawn(session: &Session, namespace: &str, args: &[&str]) -> Peer {
        Self::spawn_exe(exe("baton-test-peer"), session, namespace, args)
    }

    /// The helper's pid here (also under `unshare`: the helper's, not `unshare`'s).
    pub fn pid(&self) -> u32 {
        self.inner
            .unwrap_or_else(|| self.child.as_ref().expect("running").id())
    }

    /// SIGKILL, then reap. Under `unshare`, the helper is the init of its PID namespace:
    /// killed, every process of the namespace goes with it, and `unshare` reaps it and
    /// exits; so when this returns the helper is gone, as a helper spawned here would be.
    pub fn kill9(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if self.kill_inner() {
            let start = Instant::now();
            while child.try_wait().ok().flatten().is_none() {
                if start.elapsed() > Duration::from_secs(10) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGKILLs the helper under `unshare`, if it runs under one (whether it does).
    fn kill_inner(&self) -> bool {
        let Some(pid) = self
            .inner
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        else {
            return false;
        };
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        true
    }

    /// The exit status, if the child has exited (reaping it).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().expect("try_wait")?;
        self.child = None;
        Some(status)
    }

    /// Waits for the child to exit, at most `deadline`; kills it and panics past that.
    /// Blocks the thread: inside an actix system use `actors::exited` instead.
    pub fn wait(&mut self, deadline: Duration) -> ExitStatus {
        let start = Instant::now();
        let child = self.child.as_mut().expect("running");
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            if start.elapsed() > deadline {
                self.kill9();
                panic!("{} did not exit within {deadline:?}", self.what);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// As [`spawn_exe`](Self::spawn_exe), with more environment variables, and with its
    /// stdout on a pipe (see [`take_stdout`](Self::take_stdout)) when `piped`.
    pub fn spawn_with(
        exe: &str,
        session: &Session,
        namespace: &str,
        args: &[&str],
        env: &[(&str, &str)],
        piped: bool,
    ) -> Peer {
        Self::spawn_placed(Placement::Here, exe, session, namespace, args, env, piped)
    }

    /// As [`spawn_with`](Self::spawn_with), where `placement` says.
    pub fn spawn_placed(
        placement: Placement,
        exe: &str,
        session: &Session,
        namespace: &str,
        args: &[&str],
        env: &[(&str, &str)],
        piped: bool,
    ) -> Peer {
        let mut cmd = match placement {
            Placement::Here => Command::new(exe),
            Placement::OwnNamespaces => {
                let mut cmd = Command::new("unshare");
                cmd.args(UNSHARE).arg(exe);
                cmd
            }
        };
        cmd.args(args)
            .env(host::NAMESPACE_ENV, namespace)
            // The tests count and sweep segments: helpers allocate named ones unless a
            // test asks for memfds (`env` comes after, and wins).
            .env(host::HOST_ENV, "named")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(if piped {
                Stdio::piped()
            } else {
                Stdio::inherit()
            });
        session.pass_to(&mut cmd).expect("passing the token");
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {exe}: {e}"));
        let mut peer = Peer {
            inner: None,
            what: format!("{exe} {args:?} ({placement:?})"),
            child: Some(child),
        };
        if placement == Placement::OwnNamespaces {
            peer.inner = Some(forked_child(
                peer.child.as_mut().expect("spawned"),
                &peer.what,
            ));
        }
        peer
    }

    /// The child's stdout, if it was spawned with a pipe and not taken yet.
    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.as_mut()?.stdout.take()
    }

    /// Sends SIGKILL without waiting: reap it with `try_wait` (or `actors::exited`), which
    /// never blocks an event loop.
    pub fn signal_kill(&mut self) {
        if self.child.is_some() && !self.kill_inner() {
            let _ = self.child.as_mut().map(Child::kill);
        }
    }
}

/// `unshare` arguments that run a command as a container's process
/// ([`Placement::OwnNamespaces`]): PID, network, IPC and mount namespaces of its own, and
/// a `/dev/shm` of its own; its pid (the namespace's init) stays the forked child's, as
/// `sh` execs the command.
pub const UNSHARE: &[&str] = &[
    "-p",
    "-n",
    "-i",
    "-f",
    "--mount-proc",
    "--kill-child",
    "sh",
    "-c",
    "mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec \"$0\" \"$@\"",
];

/// The one child `unshare -f` (spawned as `unshare`) forked: the init of the new PID
/// namespace, by its pid here. Panics if `unshare` exits first or forks nothing within a
/// deadline.
pub fn forked_child(unshare: &mut Child, what: &str) -> u32 {
    let pid = unshare.id();
    let start = Instant::now();
    loop {
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        if let Some(child) = children.split_whitespace().next() {
            return child.parse().expect("a pid");
        }
        if let Some(status) = unshare.try_wait().expect("try_wait") {
            panic!("{what}: unshare exited ({status}) before it forked");
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{what}: unshare forked nothing"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A segment namespace of this test process alone (at most 32 characters).
pub fn namespace(test: &str) -> String {
    let ns = format!("t{}-{test}", std::process::id());
    assert!(ns.len() <= 32, "namespace {ns} too long");
    ns
}

/// Whether `pid` is neither running nor a zombie: `/proc/<pid>` is gone, or (pid reused)
/// its state is not `Z`.
pub fn reaped(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
    }
}

/// How many segments of `namespace` exist now.
pub fn segments(namespace: &str) -> usize {
    host::list_segments(namespace)
        .expect("listing /dev/shm")
        .len()
}

/// Polls `cond` every few milliseconds until it holds; panics after `deadline`.
pub fn poll_until(deadline: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Accepts one connection on `listener` and establishes its link (server side), waiting at
/// most `deadline` for a peer to connect; panics past it, so a peer that never connects
/// fails the test instead of hanging it. The handshake that follows has its own deadline
/// (the listener's `handshake_timeout`).
///
/// The listening socket is switched to non-blocking; accepted sockets are not affected.
pub fn accept_within(listener: &Listener, deadline: Duration) -> Result<Link, baton::ipc::Error> {
    accept_while(listener, deadline, || true).expect("waited")
}

/// [`accept_within`], for the connection of `child`: panics at once if the child exits
/// before anyone connects (it died before connecting).
pub fn accept_from(
    listener: &Listener,
    child: &mut Peer,
    deadline: Duration,
) -> Result<Link, baton::ipc::Error> {
    let what = child.what.clone();
    accept_while(listener, deadline, || {
        if let Some(status) = child.try_wait() {
            panic!("{what} exited ({status}) before it connected");
        }
        true
    })
    .expect("waited")
}

/// [`accept_within`], asking `keep_waiting` every few milliseconds while nobody connects;
/// `None` once it says no.
pub fn accept_while(
    listener: &Listener,
    deadline: Duration,
    mut keep_waiting: impl FnMut() -> bool,
) -> Option<Result<Link, baton::ipc::Error>> {
    listener
        .listener()
        .set_nonblocking(true)
        .expect("a non-blocking listener");
    let start = Instant::now();
    loop {
        match listener.accept() {
            Err(baton::ipc::Error::Io { source, .. })
                if source.kind() == std::io::ErrorKind::WouldBlock =>
            {
                if !keep_waiting() {
                    return None;
                }
                assert!(
                    start.elapsed() < deadline,
                    "nobody connected to {} within {deadline:?}",
                    listener.path().display()
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            other => return Some(other),
        }
    }
}

/// A private socket directory in a fresh temporary directory.
pub fn socket_dir() -> (tempfile::TempDir, baton::SocketDir) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = baton::SocketDir::create(tmp.path().join("sock")).expect("socket dir");
    (tmp, dir)
}
