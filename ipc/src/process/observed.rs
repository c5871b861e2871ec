//! Processes that cannot be named or watched by pid from here — link peers in another PID
//! namespace, as a process in another container is — known instead by a pidfd the kernel
//! gave for them.
//!
//! A peer in a PID namespace nested below ours has a pid here that differs from the one it
//! claims (its own namespace's); a peer in a namespace we are nested in, or beside ours, has
//! no pid here at all (`SO_PEERCRED` says 0). Either way `/proc/<claimed pid>` is not the
//! peer, so the `/proc` checks of [`liveness`](super::liveness) and
//! [`DeathWatch`](super::DeathWatch) would answer for the wrong process: the freeing rule
//! could free memory that the peer still maps. Once a link's handshake has proven such a
//! peer ([`PeerCred::verify_claim`](crate::link::PeerCred::verify_claim)), its claimed
//! identity is registered here with a pidfd on it; from then on every liveness question
//! about that identity is answered by the pidfd (readable once the process has exited), in
//! this process, whoever asks.
//!
//! **One name per process, one process per name.** A pidfd's inode on pidfs (Linux 6.9+)
//! names its process for the whole boot, so the registry can tell that two pidfds are the
//! same process (a second link from the same peer: accepted) or two processes (a second
//! process claiming a registered name, or one process claiming a second name: refused).
//! Without pidfs, pidfds are anonymous inodes that cannot be told apart, and nothing is
//! registered: the link is refused as [`Error::PeerInOtherPidNamespace`] — never linked
//! with a liveness check that could answer for the wrong process.
//!
//! The registry holds at most [`MAX_OBSERVED`] processes; an identity whose process has
//! exited is kept (as dead, without its pidfd) until room is needed, so that a later
//! question about it still gets "dead" rather than a `/proc` answer about another process.

use super::Liveness;
use crate::Error;
use baton_messages::ProcessId;
use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// The most processes of other PID namespaces registered at once (live and remembered
/// dead). A link to one more, while all are alive, is refused.
pub const MAX_OBSERVED: usize = 4096;

/// `statfs(2)`'s `f_type` for pidfs, where pidfds live since Linux 6.9.
const PIDFS_MAGIC: u64 = 0x5049_4446;

/// `SO_PEERPIDFD` (Linux 6.5+): the generic value of `asm-generic/socket.h`, which every
/// architecture Baton builds for uses.
#[cfg(not(any(target_arch = "sparc", target_arch = "sparc64")))]
const SO_PEERPIDFD: libc::c_int = 77;

#[derive(Debug)]
struct Entry {
    /// The pidfd's inode on pidfs: the process, for the boot.
    inode: u64,
    /// The pidfd while the process lives; `None` once it has been seen dead.
    pidfd: Option<OwnedFd>,
    /// Registration order, to forget the oldest dead first.
    since: u64,
}

#[derive(Debug, Default)]
struct Registry {
    entries: HashMap<ProcessId, Entry>,
    next: u64,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);
/// Whether anything was ever registered: the common process (no peer in another PID
/// namespace) answers liveness without taking the lock.
static ANY: AtomicBool = AtomicBool::new(false);

fn with<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    let mut guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(Registry::default))
}

/// Why a process could not be registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Another process is registered under this identity.
    NameTaken,
    /// This process is registered under another identity.
    TwoNames,
    /// The descriptor is not a pidfd on pidfs (a kernel before 6.9): processes cannot be
    /// told apart.
    NoPidfs,
    /// [`MAX_OBSERVED`] live processes are registered already.
    Full,
}

impl Refused {
    /// The error a link refused for this reason reports.
    pub(crate) fn into_error(self, claimed: ProcessId, visible_pid: Option<u32>) -> Error {
        match self {
            Refused::NameTaken | Refused::TwoNames => Error::PeerIdentityMismatch {
                claimed,
                actual_pid: visible_pid.unwrap_or(0),
            },
            Refused::NoPidfs => Error::PeerInOtherPidNamespace {
                pid: visible_pid,
                why: "this kernel's pidfds cannot tell processes apart (pidfs: Linux 6.9+)",
            },
            Refused::Full => Error::PeerInOtherPidNamespace {
                pid: visible_pid,
                why: "this process already watches as many processes of other PID namespaces as it may",
            },
        }
    }
}

/// The pidfs inode of `pidfd`, or `None` if it is no pidfd on pidfs.
fn pidfs_inode(pidfd: BorrowedFd<'_>) -> Option<u64> {
    let fs = rustix::fs::fstatfs(pidfd).ok()?;
    // `f_type` is signed on some targets; pidfs's magic is positive everywhere.
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
    let kind = fs.f_type as u64;
    if kind != PIDFS_MAGIC {
        return None;
    }
    Some(rustix::fs::fstat(pidfd).ok()?.st_ino)
}

/// Registers `process` as the process `pidfd` refers to (a duplicate is kept). Registering
/// the same process under the same identity again is harmless.
pub(crate) fn register(process: ProcessId, pidfd: BorrowedFd<'_>) -> Result<(), Refused> {
    let inode = pidfs_inode(pidfd).ok_or(Refused::NoPidfs)?;
    with(|r| r.add(process, inode, pidfd, MAX_OBSERVED))?;
    ANY.store(true, Ordering::Release);
    Ok(())
}

/// Whether the process behind `pidfd` has exited (the pidfd polls readable).
fn exited(pidfd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = rustix::fs::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
}

impl Registry {
    /// Adds `process`, the process of `pidfd` (pidfs inode `inode`), keeping at most `max`.
    fn add(
        &mut self,
        process: ProcessId,
        inode: u64,
        pidfd: BorrowedFd<'_>,
        max: usize,
    ) -> Result<(), Refused> {
        if let Some(e) = self.entries.get(&process) {
            return if e.inode == inode {
                Ok(())
            } else {
                Err(Refused::NameTaken)
            };
        }
        if self.entries.values().any(|e| e.inode == inode) {
            return Err(Refused::TwoNames);
        }
        if self.entries.len() >= max {
            self.refresh();
            self.forget_oldest_dead(max);
            if self.entries.len() >= max {
                return Err(Refused::Full);
            }
        }
        let pidfd = pidfd.try_clone_to_owned().map_err(|_| Refused::Full)?;
        let since = self.next;
        self.next += 1;
        self.entries.insert(
            process,
            Entry {
                inode,
                pidfd: Some(pidfd),
                since,
            },
        );
        Ok(())
    }

    /// Marks the processes that have exited as dead (closing their pidfds).
    fn refresh(&mut self) {
        for e in self.entries.values_mut() {
            if e.pidfd.as_ref().is_some_and(exited) {
                e.pidfd = None;
            }
        }
    }

    /// Forgets the dead entries registered first, down to three quarters of `max`.
    fn forget_oldest_dead(&mut self, max: usize) {
        let mut dead: Vec<(u64, ProcessId)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.pidfd.is_none())
            .map(|(p, e)| (e.since, *p))
            .collect();
        dead.sort_unstable();
        let excess = self.entries.len().saturating_sub(max * 3 / 4);
        for (_, process) in dead.into_iter().take(excess) {
            self.entries.remove(&process);
        }
    }
}

/// The liveness of a registered process, by its pidfd; `None` if `process` is not
/// registered (ask `/proc`).
pub(crate) fn liveness(process: &ProcessId) -> Option<Liveness> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    with(|r| {
        let e = r.entries.get_mut(process)?;
        if e.pidfd.as_ref().is_some_and(exited) {
            e.pidfd = None;
        }
        Some(if e.pidfd.is_some() {
            Liveness::Alive
        } else {
            Liveness::Dead
        })
    })
}

/// How to watch a registered process: `None` if `process` is not registered (use its pid),
/// `Some(None)` if it is known dead, else a duplicate of its pidfd.
pub(crate) fn watch(process: &ProcessId) -> Option<Option<OwnedFd>> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    with(|r| {
        let e = r.entries.get(process)?;
        Some(e.pidfd.as_ref().and_then(|fd| fd.try_clone().ok()))
    })
}

/// Whether `process` is registered (watched through a pidfd).
pub fn is_observed(process: &ProcessId) -> bool {
    ANY.load(Ordering::Acquire) && with(|r| r.entries.contains_key(process))
}

/// Reads a `SOL_SOCKET` option whose value is a plain C struct or integer.
///
/// # Safety
/// `T` must be the option's value type: plain data that any bytes the kernel writes make
/// valid (`c_int`, `ucred`).
#[allow(unsafe_code)]
unsafe fn socket_option<T: Copy>(
    socket: BorrowedFd<'_>,
    option: libc::c_int,
    mut value: T,
) -> std::io::Result<T> {
    use std::os::fd::AsRawFd;
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `socket` is a live descriptor for the call; the kernel writes at most `len`
    // bytes into `value`, which is a `T` that outlives the call.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&raw mut value).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != size_of::<T>() {
        return Err(std::io::Error::other(
            "a socket option of an unexpected size",
        ));
    }
    Ok(value)
}

/// The kernel's credentials of a connected Unix socket's peer (`SO_PEERCRED`): pid (0 when
/// the peer has no pid in our PID namespace), uid and gid. rustix's reader refuses pid 0
/// and with it the uid and gid a peer policy decides on.
///
/// # Errors
/// The `getsockopt(2)` error (`ENOTSOCK`, …).
#[allow(unsafe_code)]
pub(crate) fn peer_ucred(socket: BorrowedFd<'_>) -> std::io::Result<(u32, u32, u32)> {
    let zero = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    // SAFETY: `SO_PEERCRED`'s value is a `struct ucred`, plain integers.
    let c = unsafe { socket_option(socket, libc::SO_PEERCRED, zero) }?;
    Ok((u32::try_from(c.pid).unwrap_or(0), c.uid, c.gid))
}

/// A pidfd on the process at the other end of a connected Unix socket, as the kernel
/// recorded it at `connect(2)` (`SO_PEERPIDFD`, Linux 6.5+) — also for a process that has no
/// pid in our PID namespace.
///
/// # Errors
/// The `getsockopt(2)` error: `ENOPROTOOPT` on older kernels, `ESRCH` if the peer has
/// exited, `ENOTSOCK`/`EINVAL` for a descriptor that is no connected Unix socket.
#[cfg(not(any(target_arch = "sparc", target_arch = "sparc64")))]
#[allow(unsafe_code)]
pub fn peer_pidfd(socket: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: `SO_PEERPIDFD`'s value is an `int`, a descriptor number.
    let raw: libc::c_int = unsafe { socket_option(socket, SO_PEERPIDFD, -1) }?;
    if raw < 0 {
        return Err(std::io::Error::other("SO_PEERPIDFD returned no descriptor"));
    }
    // SAFETY: on success the kernel installed a new descriptor (close-on-exec) in this
    // process and gave it to us alone: owning it is sound.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// A pidfd on the peer of a connected Unix socket: not on this architecture.
///
/// # Errors
/// Always `Unsupported`.
#[cfg(any(target_arch = "sparc", target_arch = "sparc64"))]
pub fn peer_pidfd(_socket: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    Err(std::io::ErrorKind::Unsupported.into())
}

/// A pidfd on process `pid` of our namespace (`pidfd_open(2)`).
pub(crate) fn open_pidfd(pid: u32) -> std::io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid as i32)
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    Ok(rustix::process::pidfd_open(
        pid,
        rustix::process::PidfdFlags::empty(),
    )?)
}

/// The pidfs inode of `pidfd` (for tests and diagnostics), if the kernel has pidfs.
pub fn pidfd_inode(pidfd: impl AsFd) -> Option<u64> {
    pidfs_inode(pidfd.as_fd())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::{boot_id, liveness};

    fn sleeper() -> (std::process::Child, OwnedFd) {
        let child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let fd = open_pidfd(child.id()).unwrap();
        (child, fd)
    }

    fn name(pid: u32, start_ticks: u64) -> ProcessId {
        ProcessId {
            boot: boot_id(),
            pid,
            start_ticks,
        }
    }

    #[test]
    fn a_registered_process_lives_and_dies_by_its_pidfd_not_by_its_pid() {
        let (mut child, fd) = sleeper();
        if pidfd_inode(&fd).is_none() {
            eprintln!("SKIPPED: this kernel has no pidfs (Linux 6.9+)");
            return;
        }
        // A name that `/proc` would call dead (no such start time for our own pid).
        let claimed = name(std::process::id(), u64::MAX - 1);
        assert_eq!(
            super::super::liveness_of(claimed.pid, claimed.start_ticks),
            Liveness::Dead
        );
        register(claimed, fd.as_fd()).unwrap();
        assert!(is_observed(&claimed));
        assert_eq!(liveness(&claimed), Liveness::Alive, "by its pidfd");
        register(claimed, fd.as_fd()).expect("the same process again");
        let watch_fd = watch(&claimed).unwrap().expect("alive: a pidfd to watch");
        assert_eq!(pidfd_inode(&watch_fd), pidfd_inode(&fd));

        // The same name for another process, and another name for the same process.
        let (mut other, other_fd) = sleeper();
        assert_eq!(register(claimed, other_fd.as_fd()), Err(Refused::NameTaken));
        let second = name(std::process::id(), u64::MAX - 2);
        assert_eq!(register(second, fd.as_fd()), Err(Refused::TwoNames));
        assert!(!is_observed(&second));

        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(liveness(&claimed), Liveness::Dead);
        assert!(watch(&claimed).unwrap().is_none(), "dead: nothing to watch");
        assert_eq!(
            register(claimed, other_fd.as_fd()),
            Err(Refused::NameTaken),
            "a dead name is not handed to another process"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }

    #[test]
    fn the_registry_is_bounded_and_forgets_the_dead_first() {
        let (mut children, fds): (Vec<_>, Vec<_>) = (0..3).map(|_| sleeper()).unzip();
        let Some(inodes) = fds.iter().map(pidfd_inode).collect::<Option<Vec<u64>>>() else {
            eprintln!("SKIPPED: this kernel has no pidfs (Linux 6.9+)");
            return;
        };
        let mut r = Registry::default();
        let add = |r: &mut Registry, i: usize| {
            r.add(name(100 + i as u32, 7), inodes[i], fds[i].as_fd(), 2)
        };
        add(&mut r, 0).unwrap();
        add(&mut r, 1).unwrap();
        assert_eq!(add(&mut r, 2), Err(Refused::Full), "two live: no room");
        children[0].kill().unwrap();
        children[0].wait().unwrap();
        add(&mut r, 2).expect("the dead one is forgotten to make room");
        assert!(!r.entries.contains_key(&name(100, 7)));
        assert_eq!(r.entries.len(), 2);
        for child in &mut children[1..] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    #[test]
    fn a_descriptor_that_is_no_pidfd_is_not_registered() {
        let file = tempfile::tempfile().unwrap();
        assert_eq!(
            register(name(1, u64::MAX - 3), file.as_fd()),
            Err(Refused::NoPidfs)
        );
        assert!(!is_observed(&name(1, u64::MAX - 3)));
    }

    #[test]
    fn the_peer_of_a_socket_pair_is_this_process() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let Ok(peer) = peer_pidfd(a.as_fd()) else {
            eprintln!("SKIPPED: this kernel has no SO_PEERPIDFD (Linux 6.5+)");
            return;
        };
        let own = open_pidfd(std::process::id()).unwrap();
        if let Some(inode) = pidfd_inode(&peer) {
            assert_eq!(Some(inode), pidfd_inode(&own));
        }
        let file = tempfile::tempfile().unwrap();
        assert!(peer_pidfd(file.as_fd()).is_err(), "no socket, no pidfd");
    }
}
