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

/// A helper process that is SIGKILLed and reaped when dropped.
pub struct Peer {
    child: Option<Child>,
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

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
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
        let mut cmd = Command::new(exe);
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
        Peer {
            child: Some(child),
            what: format!("{exe} {args:?}"),
        }
    }

    /// The child's stdout, if it was spawned with a pipe and not taken yet.
    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.as_mut()?.stdout.take()
    }

    /// Sends SIGKILL without waiting: reap it with `try_wait` (or `actors::exited`), which
    /// never blocks an event loop.
    pub fn signal_kill(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
        }
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
