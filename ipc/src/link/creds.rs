//! Who is at the other end of a socket (`SO_PEERCRED`), and whether we accept them.

use crate::{Error, Result};
use baton_messages::ProcessId;
use std::os::fd::AsFd;

/// The credentials the kernel records for a socket's peer (`SO_PEERCRED`): what the peer
/// process was when it connected, not what it claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// The peer's pid (in our pid namespace).
    pub pid: u32,
    /// The peer's effective uid.
    pub uid: u32,
    /// The peer's effective gid.
    pub gid: u32,
}

impl PeerCred {
    /// Reads the peer credentials of a connected Unix socket (`getsockopt(SO_PEERCRED)`).
    ///
    /// # Errors
    /// [`Error::PeerInOtherPidNamespace`] if the peer's process is not visible from our
    /// PID namespace (the kernel gives its pid as 0); [`Error::Io`] if the socket is not a
    /// connected Unix socket.
    pub fn of(socket: impl AsFd) -> Result<Self> {
        let c = match rustix::net::sockopt::socket_peercred(socket) {
            Ok(c) => c,
            // The kernel's pid 0 (a process our PID namespace cannot see) is no valid
            // `Pid`: rustix reports it as an error without an errno.
            Err(e) if e.raw_os_error() == 0 => {
                return Err(Error::PeerInOtherPidNamespace { pid: None });
            }
            Err(e) => {
                return Err(Error::Io {
                    op: "getsockopt(SO_PEERCRED)",
                    source: e.into(),
                });
            }
        };
        Ok(Self {
            pid: c.pid.as_raw_nonzero().get() as u32,
            uid: c.uid.as_raw(),
            gid: c.gid.as_raw(),
        })
    }

    /// Checks that the identity a peer claims in its handshake is the process the kernel
    /// says is connected: same pid, same start time, same boot.
    ///
    /// # Errors
    /// [`Error::PeerInOtherPidNamespace`] if the claim does not hold because the peer lives
    /// in a PID namespace nested below ours (it names itself by a pid of its own
    /// namespace); else [`Error::PeerIdentityMismatch`].
    pub fn verify_claim(&self, claimed: &ProcessId) -> Result<()> {
        let same = claimed.pid == self.pid
            && claimed.boot == crate::process::boot_id()
            && crate::process::start_ticks(self.pid) == Some(claimed.start_ticks);
        if same {
            Ok(())
        } else if crate::process::in_nested_pid_namespace(self.pid) {
            Err(Error::PeerInOtherPidNamespace {
                pid: Some(self.pid),
            })
        } else {
            Err(Error::PeerIdentityMismatch {
                claimed: *claimed,
                actual_pid: self.pid,
            })
        }
    }
}

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
        cred.verify_claim(&crate::process::current()).unwrap();
        let mut lie = crate::process::current();
        lie.start_ticks += 1;
        assert!(matches!(
            cred.verify_claim(&lie),
            Err(Error::PeerIdentityMismatch { .. })
        ));
    }
}
