//! Spawning child processes that die with this process. (How a child gets the session
//! token is [`handoff`](crate::handoff)'s.)
//!
//! **Children die with their root.** [`spawn_tied`] asks the kernel to SIGKILL the child
//! when its parent dies (`prctl(PR_SET_PDEATHSIG, SIGKILL)` between `fork` and `exec`),
//! then checks `getppid()` against the parent it expects and fails the spawn if the
//! parent already died in between. The kernel sends that signal when the *thread* that
//! forked the child exits, not the process: a child spawned from an actix arbiter thread,
//! a test thread or a short-lived worker would be killed when that thread ends. So every
//! tied child is forked by one dedicated thread that lives as long as the process (a
//! process-wide spawner, started on first use, that never returns): the signal then
//! fires exactly when the process dies, however it dies — SIGKILL included. The
//! alternative, a child that watches its parent through a pidfd, needs the child's
//! cooperation (a thread in every child, nothing for a child that is not a Baton program
//! or is stopped), where the kernel's signal needs none.
//!
//! # Safety
//!
//! The `unsafe` code here is a `pre_exec` hook ([`die_with_parent`]), which runs in the
//! child between `fork` and `exec`, where only async-signal-safe operations are allowed:
//! it makes only raw system calls (`prctl`, `getppid`) through `rustix`, which neither
//! allocate nor lock, and builds its error from a raw errno (no allocation).

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// How long [`spawn_tied`] waits for the spawner thread to fork and exec.
const SPAWN_DEADLINE: Duration = Duration::from_secs(30);

/// Makes `cmd`'s child receive SIGKILL when this process dies (`PR_SET_PDEATHSIG`), and
/// fail to start if this process died before the request took effect.
///
/// The kernel ties the signal to the thread that forks the child: spawn such a command
/// with [`spawn_tied`], whose spawner thread lives as long as the process, not from a
/// thread that may exit first.
pub fn die_with_parent(cmd: &mut Command) {
    let parent = rustix::process::getpid();
    let hook = move || -> io::Result<()> {
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
        // The parent may have died between fork and prctl: then nobody will signal us.
        if rustix::process::getppid() != Some(parent) {
            return Err(io::Error::from_raw_os_error(
                rustix::io::Errno::SRCH.raw_os_error(),
            ));
        }
        Ok(())
    };
    // SAFETY: the hook runs between fork and exec and makes two system calls (`prctl`,
    // `getppid`); it neither allocates nor locks, and its errors come from raw errnos.
    unsafe {
        cmd.pre_exec(hook);
    }
}

struct SpawnRequest {
    cmd: Command,
    reply: mpsc::SyncSender<io::Result<Child>>,
}

/// The process-wide spawner thread's queue. The thread never returns, so children it forks
/// get their parent-death signal only when the process dies.
fn spawner() -> io::Result<&'static Mutex<mpsc::Sender<SpawnRequest>>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    static START: Mutex<()> = Mutex::new(());
    if let Some(s) = SPAWNER.get() {
        return Ok(s);
    }
    let _once = START.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = SPAWNER.get() {
        return Ok(s);
    }
    let (tx, rx) = mpsc::channel::<SpawnRequest>();
    std::thread::Builder::new()
        .name("baton-spawner".into())
        .spawn(move || {
            // `SPAWNER` holds the sender forever: `recv` fails only if the process is
            // tearing down, and then the thread may end with it.
            while let Ok(mut req) = rx.recv() {
                let result = req.cmd.spawn();
                if let Err(mpsc::SendError(Ok(mut child))) = req.reply.send(result) {
                    // The caller gave up waiting: do not leave its child running.
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        })?;
    Ok(SPAWNER.get_or_init(|| Mutex::new(tx)))
}

/// Spawns `cmd` so that its child dies with this process: [`die_with_parent`], forked by
/// the process-wide spawner thread (see the [module docs](self) for why a thread that
/// lives as long as the process).
///
/// # Errors
/// The spawn's error; [`io::ErrorKind::TimedOut`] if the spawner did not answer within
/// 30 s (a child it makes later is killed and reaped).
pub fn spawn_tied(mut cmd: Command) -> io::Result<Child> {
    die_with_parent(&mut cmd);
    let (reply, answer) = mpsc::sync_channel(1);
    spawner()?
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send(SpawnRequest { cmd, reply })
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    match answer.recv_timeout(SPAWN_DEADLINE) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the spawner did not start the child within {SPAWN_DEADLINE:?}"),
        )),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Err(io::Error::other("the spawner thread is gone"))
        }
    }
}
