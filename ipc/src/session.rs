//! [`Session`]: this process's membership in one deployment of cooperating processes: the
//! token, the keys derived from it (link proofs, handle seals), and the handle check.
//! How the token reaches a child process is [`handoff`](crate::handoff)'s.

use crate::{Error, Result};
use baton_messages::protocol::{AuthProof, Nonce};
use baton_messages::{HandleKey, ProcessId, SessionToken};
use std::fmt;

/// This process in one deployment: the shared token, the keys derived from it, and who we are.
///
/// The token authenticates links (each side proves it holds it, without sending it) and
/// keys the digest that seals handle messages. Give every process of a deployment the same
/// token, by spawning children with a command prepared by [`Session::pass_to`] (the
/// `baton_actors::supervisor::ProcessSupervisor` does; not a link: `baton-ipc` does not
/// depend on it).
#[derive(Clone)]
pub struct Session {
    token: SessionToken,
    handle_key: HandleKey,
    auth_key: [u8; 32],
    process: ProcessId,
}

impl Session {
    /// A session with a given token.
    pub fn new(token: SessionToken) -> Self {
        let auth_key = blake3::derive_key("baton 2026-11 link authentication v1", token.as_bytes());
        Self {
            handle_key: HandleKey::derive(&token),
            token,
            auth_key,
            process: crate::process::current(),
        }
    }

    /// A session with a fresh random token: for the root of a deployment.
    ///
    /// # Errors
    /// [`Error::Io`] if the kernel's random source fails.
    pub fn generate() -> Result<Self> {
        Ok(Self::new(SessionToken::from_bytes(random_bytes()?)))
    }

    /// The session a parent handed this process: the child's entry point, called at the
    /// top of `main` (or through `Node::from_env`).
    ///
    /// The token comes from the pipe named in
    /// [`TOKEN_FD_ENV`](crate::handoff::TOKEN_FD_ENV) (set by [`pass_to`](Self::pass_to)): it
    /// is read and the pipe closed on the first call, so the token never sits in this
    /// process's environment or descriptors, and children inherit neither; later calls
    /// return the same session. Without that variable (or if it names no token pipe of
    /// ours: a stale variable inherited from a parent), the token is taken from
    /// [`TOKEN_ENV`](crate::TOKEN_ENV), for processes started by hand — with a warning,
    /// since the environment keeps it.
    ///
    /// # Errors
    /// [`Error::NoToken`] if neither gives a token (also when [`TOKEN_ENV`](crate::TOKEN_ENV)
    /// is set but is not one: 64 hex digits).
    pub fn from_env() -> Result<Self> {
        Ok(Self::new(crate::handoff::inherited_token()?))
    }

    /// Prepares `cmd` so that its child's [`from_env`](Self::from_env) finds this session:
    /// the token goes through a pipe the child inherits (named in
    /// [`TOKEN_FD_ENV`](crate::handoff::TOKEN_FD_ENV)), never through its environment, and
    /// [`TOKEN_ENV`](crate::TOKEN_ENV) is removed from the child's environment. One command,
    /// one child. The child inherits no other descriptor above stderr (see
    /// [`pass_token`](crate::handoff::pass_token)): one you mean it to have must be unmarked
    /// by a `pre_exec` hook of yours added after this call.
    ///
    /// # Errors
    /// [`Error::Io`] if the pipe cannot be made.
    pub fn pass_to(&self, cmd: &mut std::process::Command) -> Result<()> {
        crate::handoff::pass_token(cmd, &self.token).map_err(Error::io("passing the session token"))
    }

    /// The session token.
    pub fn token(&self) -> &SessionToken {
        &self.token
    }

    /// The key that seals and verifies handle messages.
    pub fn handle_key(&self) -> &HandleKey {
        &self.handle_key
    }

    /// This process.
    pub fn process(&self) -> ProcessId {
        self.process
    }

    /// The same session, announcing `process` as its own: what a token holder that lies
    /// about who it is can do (it only needs to change its code). For the tests that
    /// play such an attacker; a process's rights never follow this claim.
    #[cfg(feature = "testing")]
    pub fn claiming(mut self, process: ProcessId) -> Self {
        self.process = process;
        self
    }

    /// The proof that the side `role` holds the token, bound to both nonces and to the
    /// prover's identity.
    pub(crate) fn proof(
        &self,
        role: Role,
        client: &Nonce,
        server: &Nonce,
        prover: &ProcessId,
    ) -> AuthProof {
        let mut h = blake3::Hasher::new_keyed(&self.auth_key);
        h.update(match role {
            Role::Client => b"client",
            Role::Server => b"server",
        });
        h.update(&client.0);
        h.update(&server.0);
        h.update(&prover.boot.0);
        h.update(&prover.pid.to_le_bytes());
        h.update(&prover.start_ticks.to_le_bytes());
        AuthProof(*h.finalize().as_bytes())
    }

    /// Checks a proof in constant time.
    pub(crate) fn check_proof(
        &self,
        role: Role,
        client: &Nonce,
        server: &Nonce,
        prover: &ProcessId,
        proof: &AuthProof,
    ) -> bool {
        let expected = blake3::Hash::from_bytes(self.proof(role, client, server, prover).0);
        expected == blake3::Hash::from_bytes(proof.0)
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("process", &self.process)
            .finish_non_exhaustive()
    }
}

/// Which side of a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Client,
    Server,
}

/// `N` bytes from the kernel's random source (`getrandom`).
///
/// # Errors
/// [`Error::Io`] if the call fails.
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    let mut filled = 0;
    while filled < N {
        let n = rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty())
            .map_err(|e| Error::Io {
                op: "getrandom",
                source: e.into(),
            })?;
        filled += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_role_nonces_and_token() {
        let s = Session::new(SessionToken::from_bytes([3; 32]));
        let other = Session::new(SessionToken::from_bytes([4; 32]));
        let (c, sv) = (Nonce([1; 32]), Nonce([2; 32]));
        let me = s.process();
        let p = s.proof(Role::Client, &c, &sv, &me);
        assert!(s.check_proof(Role::Client, &c, &sv, &me, &p));
        assert!(!s.check_proof(Role::Server, &c, &sv, &me, &p));
        assert!(!s.check_proof(Role::Client, &sv, &c, &me, &p));
        assert!(!other.check_proof(Role::Client, &c, &sv, &me, &p));
    }

    #[test]
    fn random_bytes_differ() {
        assert_ne!(random_bytes::<32>().unwrap(), random_bytes::<32>().unwrap());
    }
}

/// A handle whose digest verified under this session's key, whose fields are
/// consistent, and whose exporter runs on this machine boot. Only [`Session::check`] makes
/// one, so a backend's `open` cannot be handed an unchecked handle.
#[derive(Debug, Clone, Copy)]
pub struct CheckedHandle<'a>(&'a baton_messages::HandleMsg);

impl std::ops::Deref for CheckedHandle<'_> {
    type Target = baton_messages::HandleMsg;
    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Session {
    /// Verifies a handle's digest, then its consistency, then that it comes from this boot.
    ///
    /// # Errors
    /// [`Error::Message`] with `DigestMismatch` (corrupted, or sealed under another
    /// token), a validation error, or [`Error::ForeignHandle`].
    pub fn check<'a>(&self, handle: &'a baton_messages::HandleMsg) -> Result<CheckedHandle<'a>> {
        handle.check(&self.handle_key)?;
        if handle.exporter.process.boot != self.process.boot {
            return Err(Error::ForeignHandle {
                exporter: handle.exporter,
            });
        }
        Ok(CheckedHandle(handle))
    }
}
