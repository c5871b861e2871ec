//! Who is at the other end of a socket (`SO_PEERCRED`), and whether we accept them.

use crate::process::{self, Liveness};
use crate::{Error, Result};
use baton_messages::ProcessId;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// The credentials the kernel records for a socket's peer (`SO_PEERCRED`): what the peer
/// process was when it connected, not what it claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// The peer's pid in our PID namespace; 0 when the peer's process has none (it lives in
    /// a PID namespace that is not ours and not nested below ours).
    pub pid: u32,
    /// The peer's effective uid.
    pub uid: u32,
    /// The peer's effective gid.
    pub gid: u32,
}

impl PeerCred {
    /// Reads the peer credentials of a connected Unix socket (`getsockopt(SO_PEERCRED)`).
    /// A peer that has no pid in our PID namespace gets pid 0: whether it can link is for
    /// [`verify_claim`](Self::verify_claim) to decide.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket is not a connected Unix socket.
    pub fn of(socket: impl AsFd) -> Result<Self> {
        let (pid, uid, gid) = process::peer_ucred(socket.as_fd()).map_err(|source| Error::Io {
            op: "getsockopt(SO_PEERCRED)",
            source,
        })?;
        Ok(Self { pid, uid, gid })
    }

    /// Checks that the identity a peer claims in its handshake is the process the kernel
    /// says is connected, and makes sure this process can watch it die.
    ///
    /// - A peer of our PID namespace: the same pid, start time and boot (`/proc`).
    /// - A peer in a PID namespace nested below ours (a container started from here): it
    ///   names itself by its own namespace's pid, which `/proc` translates (`NSpid`); its
    ///   start time and boot must match too. It is then watched through a pidfd
    ///   ([`process::is_observed`](crate::process::is_observed)).
    /// - A peer with no pid here (pid 0: we are the container): nothing of its claim can
    ///   be read from `/proc`, so the claim is only a name, bound to the process behind
    ///   `pidfd` — the kernel's pidfd for the socket's peer
    ///   ([`process::peer_pidfd`](crate::process::peer_pidfd)). The name must be of this
    ///   boot, must not be a process we can see, and must not already name another
    ///   process (nor that process another name). Every liveness check on it then asks
    ///   the pidfd.
    ///
    /// # Errors
    /// [`Error::PeerIdentityMismatch`] if the claim does not hold;
    /// [`Error::PeerInOtherPidNamespace`] if the peer is in another PID namespace and this
    /// kernel cannot prove and watch it without a pid (no `SO_PEERPIDFD`, Linux 6.5+, or
    /// no pidfs, Linux 6.9+).
    pub fn verify_claim(&self, claimed: &ProcessId, pidfd: Option<BorrowedFd<'_>>) -> Result<()> {
        let mismatch = || Error::PeerIdentityMismatch {
            claimed: *claimed,
            actual_pid: self.pid,
        };
        if claimed.boot != process::boot_id() {
            return Err(mismatch());
        }
        if self.pid == 0 {
            let Some(pidfd) = pidfd else {
                return Err(Error::PeerInOtherPidNamespace {
                    pid: None,
                    why: NO_PIDFD,
                });
            };
            // A process we can see would have its pid in `SO_PEERCRED`.
            if process::liveness_of(claimed.pid, claimed.start_ticks) == Liveness::Alive {
                return Err(mismatch());
            }
            return process::observe(*claimed, pidfd).map_err(|r| r.into_error(*claimed, None));
        }
        let started = process::start_ticks(self.pid);
        if claimed.pid == self.pid && started == Some(claimed.start_ticks) {
            return Ok(());
        }
        if process::pid_in_nested_namespace(self.pid) != Some(claimed.pid)
            || started != Some(claimed.start_ticks)
        {
            return Err(mismatch());
        }
        // Nested below ours: a pidfd on the pid we see, still the claimed process once
        // it is open (the pid cannot change hands unseen while the start time matches).
        let own;
        let pidfd = match pidfd {
            Some(fd) => fd,
            None => {
                own = process::open_pidfd(self.pid).map_err(|_| mismatch())?;
                own.as_fd()
            }
        };
        if process::start_ticks(self.pid) != Some(claimed.start_ticks) {
            return Err(mismatch());
        }
        process::observe(*claimed, pidfd).map_err(|r| r.into_error(*claimed, Some(self.pid)))
    }
}

/// What the kernel says of a socket's peer: its credentials and, for a peer that has no
/// pid in our PID namespace, a pidfd on it (`None` where the kernel gives none).
#[derive(Debug)]
pub(crate) struct KernelPeer {
    pub(crate) cred: PeerCred,
    pub(crate) pidfd: Option<OwnedFd>,
}

impl KernelPeer {
    /// Reads them off a connected Unix socket.
    ///
    /// # Errors
    /// As [`PeerCred::of`].
    pub(crate) fn of(socket: impl AsFd) -> Result<Self> {
        let cred = PeerCred::of(socket.as_fd())?;
        let pidfd = if cred.pid == 0 {
            process::peer_pidfd(socket.as_fd()).ok()
        } else {
            None
        };
        Ok(Self { cred, pidfd })
    }

    /// [`PeerCred::verify_claim`] with the kernel's pidfd.
    pub(crate) fn verify_claim(&self, claimed: &ProcessId) -> Result<()> {
        self.cred
            .verify_claim(claimed, self.pidfd.as_ref().map(AsFd::as_fd))
    }
}

/// Why a peer without a pid here is refused on a kernel that gives no pidfd for it.
const NO_PIDFD: &str = "this kernel gives no pidfd for a socket's peer (SO_PEERPIDFD: Linux 6.5+)";

/// Which peers a link accepts, decided from [`PeerCred`] before anything is read.
///
/// The default accepts only processes of our own effective uid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPolicy {
    allowed_uids: Vec<u32>,
}

impl Default for PeerPolicy {
    fn default() -> Self {
        Self::same_user()
    }
}

impl PeerPolicy {
    /// Only processes running as our effective uid.
    pub fn same_user() -> Self {
        Self {
            allowed_uids: vec![rustix::process::geteuid().as_raw()],
        }
    }

    /// Exactly these uids (our own is not implied).
    pub fn uids(uids: impl IntoIterator<Item = u32>) -> Self {
        Self {
            allowed_uids: uids.into_iter().collect(),
        }
    }

    /// Also accepts `uid`.
    pub fn allow_uid(mut self, uid: u32) -> Self {
        if !self.allowed_uids.contains(&uid) {
            self.allowed_uids.push(uid);
        }
        self
    }

    /// The accepted uids.
    pub fn allowed_uids(&self) -> &[u32] {
        &self.allowed_uids
    }

    /// The decision: is a peer with these credentials allowed?
    ///
    /// # Errors
    /// [`Error::PeerNotAllowed`].
    pub fn check(&self, cred: &PeerCred) -> Result<()> {
        if self.allowed_uids.contains(&cred.uid) {
            Ok(())
        } else {
            Err(Error::PeerNotAllowed {
                uid: cred.uid,
                pid: cred.pid,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_lists_the_uids_it_accepts_once_each() {
        let me = rustix::process::geteuid().as_raw();
        let other = me.wrapping_add(1000);
        let policy = PeerPolicy::same_user().allow_uid(other).allow_uid(other);
        assert_eq!(policy.allowed_uids(), [me, other]);
    }

    #[test]
    fn policy_decides_by_uid() {
        let me = rustix::process::geteuid().as_raw();
        let cred = |uid| PeerCred {
            pid: 1,
            uid,
            gid: 0,
        };
        assert!(PeerPolicy::same_user().check(&cred(me)).is_ok());
        let stranger = me.wrapping_add(1000);
        assert!(matches!(
            PeerPolicy::same_user().check(&cred(stranger)),
            Err(Error::PeerNotAllowed { uid, .. }) if uid == stranger
        ));
        assert!(
            PeerPolicy::same_user()
                .allow_uid(stranger)
                .check(&cred(stranger))
                .is_ok()
        );
        assert!(PeerPolicy::uids([stranger]).check(&cred(me)).is_err());
    }

    #[test]
    fn peer_credentials_of_a_socketpair_are_ours() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let cred = PeerCred::of(&a).unwrap();
        assert_eq!(cred.pid, std::process::id());
        assert_eq!(cred.uid, rustix::process::geteuid().as_raw());
        cred.verify_claim(&process::current(), None).unwrap();
        let mut lie = process::current();
        lie.start_ticks += 1;
        assert!(matches!(
            cred.verify_claim(&lie, None),
            Err(Error::PeerIdentityMismatch { .. })
        ));
        let peer = KernelPeer::of(&a).unwrap();
        assert!(peer.pidfd.is_none(), "a peer we can see needs no pidfd");
        peer.verify_claim(&process::current()).unwrap();
    }

    fn sleeper() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    }

    /// A child and a pidfd on it, where pidfds live on pidfs; `None` (the test skipped,
    /// said on stderr) on an older kernel.
    fn sleeper_with_pidfd() -> Option<(std::process::Child, OwnedFd)> {
        let mut child = sleeper();
        let pidfd = process::open_pidfd(child.id()).unwrap();
        if process::pidfd_inode(&pidfd).is_none() {
            eprintln!("SKIPPED: this kernel has no pidfs (Linux 6.9+)");
            child.kill().unwrap();
            child.wait().unwrap();
            return None;
        }
        Some((child, pidfd))
    }

    /// The side of a link that cannot see its peer (`SO_PEERCRED` pid 0: we are the
    /// container) binds the claim to the kernel's pidfd. A child stands in for the peer:
    /// its pidfd is what `SO_PEERPIDFD` would give.
    #[test]
    fn a_peer_without_a_pid_here_is_known_by_its_pidfd() {
        let Some((mut child, pidfd)) = sleeper_with_pidfd() else {
            return;
        };
        let invisible = PeerCred {
            pid: 0,
            ..PeerCred::of(std::os::unix::net::UnixStream::pair().unwrap().0).unwrap()
        };
        // A name of another namespace: a pid that is no process of ours at that time.
        let claim = ProcessId {
            boot: process::boot_id(),
            pid: 1,
            start_ticks: u64::MAX - 11,
        };
        assert!(
            matches!(
                invisible.verify_claim(&claim, None),
                Err(Error::PeerInOtherPidNamespace { pid: None, why }) if why.contains("SO_PEERPIDFD")
            ),
            "no pidfd from the kernel: refused, with the reason"
        );
        // A claim of a process we can see is a lie: it would have a pid here.
        assert!(matches!(
            invisible.verify_claim(&process::current(), Some(pidfd.as_fd())),
            Err(Error::PeerIdentityMismatch { actual_pid: 0, .. })
        ));
        let other_boot = ProcessId {
            boot: baton_messages::BootId([0xee; 16]),
            ..claim
        };
        assert!(matches!(
            invisible.verify_claim(&other_boot, Some(pidfd.as_fd())),
            Err(Error::PeerIdentityMismatch { .. })
        ));
        invisible.verify_claim(&claim, Some(pidfd.as_fd())).unwrap();
        assert!(process::is_observed(&claim));
        assert_eq!(process::liveness(&claim), Liveness::Alive);
        // The same process links again: the same name, accepted.
        invisible.verify_claim(&claim, Some(pidfd.as_fd())).unwrap();
        // Another process under its name, or it under a second name: refused.
        let mut impostor = sleeper();
        let impostor_fd = process::open_pidfd(impostor.id()).unwrap();
        assert!(matches!(
            invisible.verify_claim(&claim, Some(impostor_fd.as_fd())),
            Err(Error::PeerIdentityMismatch { .. })
        ));
        let second = ProcessId {
            start_ticks: u64::MAX - 12,
            ..claim
        };
        assert!(matches!(
            invisible.verify_claim(&second, Some(pidfd.as_fd())),
            Err(Error::PeerIdentityMismatch { .. })
        ));
        // Its death is seen through the pidfd, whatever `/proc/1` is.
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(process::liveness(&claim), Liveness::Dead);
        impostor.kill().unwrap();
        impostor.wait().unwrap();
    }

    /// The death watch of an identity bound to a pidfd reports the process's death.
    #[test]
    fn the_death_watch_follows_a_pidfd_bound_identity() {
        use std::sync::mpsc;
        let Some((mut child, pidfd)) = sleeper_with_pidfd() else {
            return;
        };
        let claim = ProcessId {
            boot: process::boot_id(),
            pid: 1,
            start_ticks: u64::MAX - 21,
        };
        let invisible = PeerCred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        invisible.verify_claim(&claim, Some(pidfd.as_fd())).unwrap();
        let (tx, rx) = mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let watch = process::DeathWatch::spawn("test-observed", move |p| {
            let _ = tx.lock().unwrap().send(p);
        })
        .unwrap();
        watch.watch(claim);
        let quiet = std::time::Duration::from_millis(200);
        assert!(rx.recv_timeout(quiet).is_err(), "alive: not reported");
        child.kill().unwrap();
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)),
            Ok(claim)
        );
        child.wait().unwrap();
    }
}
