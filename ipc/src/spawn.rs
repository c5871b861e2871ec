//! Spawning child processes that die with this process and receive the session token
//! privately; and, on the child's side, taking that token.
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
//! **The token never sits in an environment.** [`pass_token`] writes the session token
//! into a fresh pipe, closes the write end, and lets the child inherit only the read end,
//! whose number (and inode) it names in [`TOKEN_FD_ENV`]. The child's
//! [`Session::from_env`](crate::Session::from_env) reads the 64 hex digits and closes the
//! pipe: the token is then in no environment (`/proc/<pid>/environ` shows only the
//! descriptor number), in no descriptor, and grandchildren inherit neither. A stale
//! `BATON_TOKEN_FD` that a grandchild inherits names a descriptor it does not have, or
//! another file (the inode differs): it is ignored.
//!
//! # Safety
//!
//! The `unsafe` code here is of two kinds:
//! - `pre_exec` hooks, which run in the child between `fork` and `exec`, where only
//!   async-signal-safe operations are allowed: each hook makes only raw system calls
//!   (`prctl`, `getppid`, `fcntl`) through `rustix`, which neither allocate nor lock, and
//!   builds its error from a raw errno (no allocation);
//! - taking ownership of the inherited token descriptor, by number, in the child
//!   (`take_inherited_token`): done at most once per process (a `OnceLock`), and only
//!   after checking that the number names the very pipe the parent made (a FIFO with the
//!   inode the variable names), which no other code of this process owns — it was
//!   inherited, not opened here.

use baton_messages::SessionToken;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The environment variable that names the inherited descriptor carrying the session
/// token: `<fd>:<inode>` of a pipe holding 64 hex digits. Set by [`pass_token`], read (and
/// the pipe closed) by [`Session::from_env`](crate::Session::from_env).
pub const TOKEN_FD_ENV: &str = "BATON_TOKEN_FD";

/// How long [`spawn_tied`] waits for the spawner thread to fork and exec.
const SPAWN_DEADLINE: Duration = Duration::from_secs(30);

/// Hex digits of a token.
const TOKEN_HEX_LEN: usize = 64;

/// Makes `cmd`'s child receive `token` through an inherited pipe named in
/// [`TOKEN_FD_ENV`], and never through its environment (`BATON_TOKEN` is removed from the
/// child's environment, should this process have it).
///
/// One `Command`, one child: the pipe holds one copy of the token, which the first child
/// spawned from `cmd` reads. The pipe's read end is closed in this process when `cmd`
/// drops. A child that is not a Baton program never reads it, and its own children
/// inherit the descriptor: hand the token only to Baton programs.
///
/// # Errors
/// The pipe cannot be made or written.
pub fn pass_token(cmd: &mut Command, token: &SessionToken) -> io::Result<()> {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    // 64 bytes into an empty pipe: below PIPE_BUF, so one write that never blocks.
    let hex = token.to_hex();
    let written = rustix::io::write(&write, hex.as_bytes())?;
    if written != hex.len() {
        return Err(io::Error::other("short write of the session token"));
    }
    drop(write);
    // Keep clear of 0-2, which the spawn redirects onto stdio before the hook runs.
    let read = if read.as_raw_fd() < 3 {
        rustix::io::fcntl_dupfd_cloexec(&read, 3)?
    } else {
        read
    };
    let inode = rustix::fs::fstat(&read)?.st_ino;
    cmd.env_remove(crate::session::TOKEN_ENV)
        .env(TOKEN_FD_ENV, format!("{}:{inode}", read.as_raw_fd()));
    let hook = move || -> io::Result<()> {
        // The child's copy of the read end stays open across exec; nothing else does.
        rustix::io::fcntl_setfd(&read, rustix::io::FdFlags::empty())?;
        Ok(())
    };
    // SAFETY: the hook runs between fork and exec and makes one `fcntl(F_SETFD)` system
    // call on a descriptor the closure owns (so it is open in the child's copy of the
    // table); it neither allocates nor locks, and its error comes from a raw errno.
    unsafe {
        cmd.pre_exec(hook);
    }
    Ok(())
}

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

/// Why an inherited token could not be taken (logged once by the caller).
#[derive(Debug)]
pub(crate) enum TokenFdError {
    /// The variable is not `<fd>:<inode>`.
    Malformed,
    /// The descriptor is not open here, or is another file (a stale variable).
    NotOurs,
    /// The pipe did not hold 64 hex digits.
    BadContents(String),
}

impl std::fmt::Display for TokenFdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Malformed => f.write_str("not <fd>:<inode> of a descriptor above 2"),
            Self::NotOurs => f.write_str(
                "names no token pipe of this process (a variable inherited from a parent?)",
            ),
            Self::BadContents(why) => write!(f, "the pipe held no token: {why}"),
        }
    }
}

/// The token from the pipe [`TOKEN_FD_ENV`] names, read once per process (the pipe is
/// closed after the first read; later calls get the same answer). `None` when the variable
/// is unset.
pub(crate) fn take_inherited_token() -> Option<Result<SessionToken, String>> {
    static TAKEN: OnceLock<Option<Result<SessionToken, String>>> = OnceLock::new();
    TAKEN
        .get_or_init(|| {
            let var = std::env::var(TOKEN_FD_ENV).ok()?;
            Some(read_token_fd(&var).map_err(|e| format!("{TOKEN_FD_ENV}={var:?}: {e}")))
        })
        .clone()
}

fn read_token_fd(var: &str) -> Result<SessionToken, TokenFdError> {
    let (fd, inode) = var.split_once(':').ok_or(TokenFdError::Malformed)?;
    let fd: RawFd = fd.parse().map_err(|_| TokenFdError::Malformed)?;
    let inode: u64 = inode.parse().map_err(|_| TokenFdError::Malformed)?;
    if fd < 3 {
        return Err(TokenFdError::Malformed);
    }
    // Look before claiming: the number must name the pipe our parent made.
    let meta =
        std::fs::metadata(format!("/proc/self/fd/{fd}")).map_err(|_| TokenFdError::NotOurs)?;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    if !meta.file_type().is_fifo() || meta.ino() != inode {
        return Err(TokenFdError::NotOurs);
    }
    // SAFETY: `fd` is open (just looked at) and is the inherited token pipe: no code of
    // this process opened it, so nothing else owns it; `TAKEN` makes this the only claim.
    let pipe = unsafe { OwnedFd::from_raw_fd(fd) };
    read_token(&pipe)
    // `pipe` closes here: the token is gone from every descriptor table of this process.
}

/// Reads exactly 64 hex digits, without blocking (the parent wrote them before the spawn).
fn read_token(pipe: &OwnedFd) -> Result<SessionToken, TokenFdError> {
    rustix::fs::fcntl_setfl(pipe.as_fd(), rustix::fs::OFlags::NONBLOCK)
        .map_err(|e| TokenFdError::BadContents(e.to_string()))?;
    let mut buf = [0u8; TOKEN_HEX_LEN];
    let mut got = 0;
    while got < buf.len() {
        match rustix::io::read(pipe, &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(TokenFdError::BadContents(e.to_string())),
        }
    }
    let hex = std::str::from_utf8(&buf[..got])
        .map_err(|_| TokenFdError::BadContents("not text".into()))?;
    SessionToken::from_hex(hex).ok_or_else(|| {
        TokenFdError::BadContents(format!("{got} bytes, not {TOKEN_HEX_LEN} hex digits"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_token_pipe_reads_back_once() {
        let token = SessionToken::from_bytes([0x3c; 32]);
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        rustix::io::write(&write, token.to_hex().as_bytes()).unwrap();
        drop(write);
        assert_eq!(read_token(&read).unwrap().to_hex(), token.to_hex());
        assert!(
            matches!(read_token(&read), Err(TokenFdError::BadContents(_))),
            "drained"
        );
    }

    #[test]
    fn stale_or_foreign_descriptors_are_not_claimed() {
        assert!(matches!(read_token_fd("7"), Err(TokenFdError::Malformed)));
        assert!(matches!(read_token_fd("1:5"), Err(TokenFdError::Malformed)));
        // A descriptor that is open here, but is not the pipe the variable names.
        let file = tempfile::tempfile().unwrap();
        let var = format!("{}:1", file.as_raw_fd());
        assert!(matches!(read_token_fd(&var), Err(TokenFdError::NotOurs)));
        let (read, _write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let wrong_inode = rustix::fs::fstat(&read).unwrap().st_ino + 1;
        let var = format!("{}:{wrong_inode}", read.as_raw_fd());
        assert!(matches!(read_token_fd(&var), Err(TokenFdError::NotOurs)));
        // A number nothing has open.
        assert!(matches!(
            read_token_fd("100000:1"),
            Err(TokenFdError::NotOurs)
        ));
        // Both stayed open: nothing was claimed.
        rustix::fs::fstat(&file).unwrap();
        rustix::fs::fstat(&read).unwrap();
    }
}
