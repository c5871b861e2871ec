//! Who a peer is across hosts: the [`HostId`] of the machine a node runs on, a node's
//! static [`NodePublicKey`], and [`HostPeer`], what a host link's handshake proved about
//! the other end. Below both the Unix links (whose [`PeerInfo`](crate::PeerInfo) names
//! the transport) and the host links of [`tcp`](crate::tcp) that establish it.

use baton_messages::{BootId, ProcessId};
use std::fmt;
use std::net::SocketAddr;

/// The environment variable that names this host (hashed into its [`HostId`]): two
/// network namespaces of one machine given different names count as two hosts.
pub const HOST_ID_ENV: &str = "BATON_HOST_ID";

/// Which host a node runs on: blake3 of [`HOST_ID_ENV`] if set, else of
/// `/etc/machine-id`, else of the boot id. Same host id: the peers use IPC (zero-copy);
/// else the transfer engines.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostId(pub [u8; 32]);

impl HostId {
    /// This host's id (computed once).
    pub fn current() -> HostId {
        static ME: std::sync::OnceLock<HostId> = std::sync::OnceLock::new();
        *ME.get_or_init(|| {
            if let Ok(name) = std::env::var(HOST_ID_ENV) {
                return HostId::named(&name);
            }
            match std::fs::read_to_string("/etc/machine-id") {
                Ok(id) if !id.trim().is_empty() => HostId::named(id.trim()),
                _ => HostId::named(&format!("boot {:?}", crate::process::boot_id())),
            }
        })
    }

    /// The id of a host named `name` (what [`HOST_ID_ENV`] would give).
    pub fn named(name: &str) -> HostId {
        HostId(blake3::derive_key("baton host id v1", name.as_bytes()))
    }
}

impl fmt::Debug for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host:{}", hex(&self.0[..6]))
    }
}

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A node's static public key (X25519), as pinned in a [`TcpPolicy`](crate::tcp::TcpPolicy).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodePublicKey(pub [u8; 32]);

impl fmt::Debug for NodePublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", hex(&self.0))
    }
}

impl fmt::Display for NodePublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The id this node knows a remote process by: the process id it announced, in the
/// namespace of the static key it proved (its boot id replaced by a keyed hash of the key
/// and the announced boot id; its pid and start time kept, for people to read).
///
/// A peer over TCP proves only its key and the session token; what it says of its process
/// is a claim. In the key's namespace a claim can name nothing but that key's own
/// processes: never a process of this host (whose boot id is real, not a hash), of another
/// host, or of another key — so a remote peer that claims a local process's id and then
/// disconnects is no local process's death, and a data connection or rendezvous claiming
/// another peer's process reaches nothing of that peer's. The same key announcing the
/// same process gets the same id again (a reconnect is the same peer).
pub fn remote_process(key: &NodePublicKey, claimed: ProcessId) -> ProcessId {
    let mut material = [0u8; 48];
    material[..32].copy_from_slice(&key.0);
    material[32..].copy_from_slice(&claimed.boot.0);
    let digest = blake3::derive_key("baton remote process id v1", &material);
    let mut boot = [0u8; 16];
    boot.copy_from_slice(&digest[..16]);
    ProcessId {
        boot: BootId(boot),
        ..claimed
    }
}

/// Who is at the other end of an established host link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPeer {
    /// The peer process, as this node knows it: what it announced in its handshake, in its
    /// key's namespace ([`remote_process`]). Every table of this node keys remote peers by
    /// this id.
    pub process: ProcessId,
    /// What the peer announced in its handshake, as it was (its own name for itself):
    /// a claim, for logs and for the peer's own messages, never a key of any table.
    pub claimed: ProcessId,
    /// The host it runs on.
    pub host: HostId,
    /// Its static key.
    pub key: NodePublicKey,
    /// Its address.
    pub addr: SocketAddr,
    /// Where its TCP engine takes data connections: its announced data port at the
    /// link's address; `None` if it announced none.
    pub data_addr: Option<SocketAddr>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(boot: u8, pid: u32) -> ProcessId {
        ProcessId {
            boot: BootId([boot; 16]),
            pid,
            start_ticks: 7,
        }
    }

    #[test]
    fn a_claim_lives_in_its_keys_namespace() {
        let (a, b) = (NodePublicKey([1; 32]), NodePublicKey([2; 32]));
        let local = process(9, 42);
        // Claiming a local process gives an id that is not it, and differs per key.
        assert_ne!(remote_process(&a, local), local);
        assert_ne!(remote_process(&a, local), remote_process(&b, local));
        // The same key and claim: the same id (a reconnect is the same peer); the pid
        // and start time stay readable.
        assert_eq!(remote_process(&a, local), remote_process(&a, local));
        assert_eq!(remote_process(&a, local).pid, 42);
        assert_eq!(remote_process(&a, local).start_ticks, 7);
        // Two processes of one key stay two.
        assert_ne!(
            remote_process(&a, local),
            remote_process(&a, process(9, 43))
        );
    }
}
