//! Who a peer is across hosts: the [`HostId`] of the machine a node runs on, a node's
//! static [`NodePublicKey`], and [`HostPeer`], what a host link's handshake proved about
//! the other end. Below both the Unix links (whose [`PeerInfo`](crate::PeerInfo) names
//! the transport) and the host links of [`tcp`](crate::tcp) that establish it.

use baton_messages::ProcessId;
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

/// Who is at the other end of an established host link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPeer {
    /// The peer process, as it proved in the handshake.
    pub process: ProcessId,
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
