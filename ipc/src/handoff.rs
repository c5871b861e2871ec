//! The session token's way from a parent process to its child, both ends in one place:
//! the parent prepares the child's command ([`pass_token`], through
//! [`Session::pass_to`](crate::Session::pass_to)), the child takes the token
//! (`inherited_token`, through [`Session::from_env`](crate::Session::from_env)).
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
//! **Nothing else crosses.** The same hook marks every other descriptor above stderr
//! close-on-exec in the child (`close_range(3, ~0, CLOSE_RANGE_CLOEXEC)`, Linux 5.11+), so
//! a child of a Baton spawn inherits its stdio and the token's pipe only — never a
//! descriptor another thread of this process opened without `O_CLOEXEC` and had not yet
//! marked when the fork came (the CUDA driver's export descriptors are such: a child that
//! inherited one held the exported memory for its whole life; `docs/CUDA.md`). Where the
//! kernel lacks `close_range`, descriptors are left as they are.
//!
//! **By hand.** A process started by hand, not by a Baton parent, may be given the token
//! in [`TOKEN_ENV`]: taken with a warning, since the environment keeps it.
//!
//! # Safety
//!
//! The `unsafe` code here is of two kinds:
//! - a `pre_exec` hook ([`pass_token`]), which runs in the child between `fork` and `exec`,
//!   where only async-signal-safe operations are allowed: it makes two raw system calls
//!   (`close_range` through `libc::syscall`, `fcntl` through `rustix`), which neither
//!   allocate nor lock, and builds its error from a raw errno (no allocation);
//! - taking ownership of the inherited token descriptor, by number, in the child
//!   (`take_inherited_token`): done at most once per process (a `OnceLock`), and only
//!   after checking that the number names the very pipe the parent made (a FIFO with the
//!   inode the variable names), which no other code of this process owns — it was
//!   inherited, not opened here.

use crate::{Error, Result};
use baton_messages::SessionToken;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::OnceLock;

/// The environment variable a session token may be given in (64 hex digits) by whoever
/// starts a process by hand. Discouraged: a token there is readable in
/// `/proc/<pid>/environ` for the process's whole life and inherited by all its children.
/// Baton's spawners never set it (they remove it) and pass the token through an inherited
/// pipe instead ([`TOKEN_FD_ENV`], [`Session::pass_to`](crate::Session::pass_to)).
pub const TOKEN_ENV: &str = "BATON_TOKEN";

/// The environment variable that names the inherited descriptor carrying the session
/// token: `<fd>:<inode>` of a pipe holding 64 hex digits. Set by [`pass_token`], read (and
/// the pipe closed) by [`Session::from_env`](crate::Session::from_env).
pub const TOKEN_FD_ENV: &str = "BATON_TOKEN_FD";

/// Hex digits of a token.
const TOKEN_HEX_LEN: usize = 64;

/// Makes `cmd`'s child receive `token` through an inherited pipe named in
/// [`TOKEN_FD_ENV`], and never through its environment (`BATON_TOKEN` is removed from the
/// child's environment, should this process have it).
///
/// The child inherits no other descriptor above stderr: every one is marked close-on-exec
/// in the child before the token's pipe is unmarked (see the [module docs](self)). A
/// descriptor you mean the child to inherit must be unmarked by a `pre_exec` hook of yours
/// added after this call.
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
    cmd.env_remove(TOKEN_ENV)
        .env(TOKEN_FD_ENV, format!("{}:{inode}", read.as_raw_fd()));
    let hook = move || -> io::Result<()> {
        mark_inherited_cloexec();
        // The child's copy of the read end stays open across exec; nothing else does.
        rustix::io::fcntl_setfd(&read, rustix::io::FdFlags::empty())?;
        Ok(())
    };
    // SAFETY: the hook runs between fork and exec and makes two system calls:
    // `close_range` with integer arguments, and `fcntl(F_SETFD)` on a descriptor the
    // closure owns (so it is open in the child's copy of the table); it neither allocates
    // nor locks, and its error comes from a raw errno.
    unsafe {
        cmd.pre_exec(hook);
    }
    Ok(())
}

/// Marks every descriptor above stderr close-on-exec: `close_range(3, ~0,
/// CLOSE_RANGE_CLOEXEC)`. A kernel without it (before 5.11: `ENOSYS`, `EINVAL`) leaves them
/// as they are, which is what a spawn did before. Async-signal-safe: one system call.
fn mark_inherited_cloexec() {
    // SAFETY: a raw system call with integer arguments; it touches no memory of ours.
    // Its result is deliberately not checked (see above).
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
    }
}

/// The token a parent handed this process: from the pipe [`TOKEN_FD_ENV`] names (see the
/// [module docs](self)), else from [`TOKEN_ENV`], with a warning. What
/// [`Session::from_env`](crate::Session::from_env) does.
///
/// # Errors
/// [`Error::NoToken`] if neither gives a token (also when [`TOKEN_ENV`] is set but is not
/// one: 64 hex digits).
pub(crate) fn inherited_token() -> Result<SessionToken> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let mut inherited = None;
    match take_inherited_token() {
        Some(Ok(token)) => return Ok(token),
        Some(Err(why)) => {
            WARNED
                .call_once(|| tracing::warn!(%why, "no session token in the inherited descriptor"));
            inherited = Some(format!("the inherited descriptor: {why}"));
        }
        None => {}
    }
    let hex = std::env::var(TOKEN_ENV).map_err(|_| Error::NoToken { why: inherited })?;
    let token = SessionToken::from_hex(&hex).ok_or_else(|| Error::NoToken {
        why: Some(format!(
            "{TOKEN_ENV} is set but is not a token (64 hex digits)"
        )),
    })?;
    static LEGACY: std::sync::Once = std::sync::Once::new();
    LEGACY.call_once(|| {
        tracing::warn!(
        "session token taken from {TOKEN_ENV}: it stays readable in /proc/<pid>/environ and is inherited by children; spawn with Session::pass_to instead"
        );
    });
    Ok(token)
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

    /// A child spawned with the token inherits the token's pipe and no other descriptor
    /// above stderr — here one left inheritable, as the CUDA driver leaves its export
    /// descriptors — while the same spawn without the token inherits it (so the check can
    /// fail).
    #[test]
    fn a_child_inherits_the_token_pipe_and_nothing_else() {
        let (read, _write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let leaky = rustix::io::fcntl_dupfd_cloexec(&read, 200).unwrap();
        rustix::io::fcntl_setfd(&leaky, rustix::io::FdFlags::empty()).unwrap();
        let n = leaky.as_raw_fd();
        let probe = |pass: bool| -> Vec<String> {
            let mut cmd = Command::new("sh");
            cmd.arg("-c").arg(format!(
                "for f in {n} ${{{TOKEN_FD_ENV}%%:*}}; do \
                   if [ -e /proc/$$/fd/$f ]; then echo \"$f open\"; else echo \"$f closed\"; fi; \
                 done"
            ));
            if pass {
                pass_token(&mut cmd, &SessionToken::from_bytes([7; 32])).unwrap();
            } else {
                cmd.env_remove(TOKEN_FD_ENV);
            }
            let out = cmd.output().unwrap();
            assert!(out.status.success(), "the probe ran: {out:?}");
            String::from_utf8(out.stdout)
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(
            probe(false),
            [format!("{n} open")],
            "inheritable without the hook"
        );
        let got = probe(true);
        assert_eq!(got.len(), 2, "the descriptor and the token's pipe: {got:?}");
        assert_eq!(got[0], format!("{n} closed"), "not inherited: {got:?}");
        assert!(
            got[1].ends_with(" open") && got[1] != got[0],
            "the token's pipe is inherited: {got:?}"
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
