//! Identifiers. Each is a newtype so that one kind of id can never stand in for another.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! u64_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        pub struct $name(u64);

        impl $name {
            /// Wraps a raw value.
            pub const fn new(raw: u64) -> Self {
                Self(raw)
            }

            /// The raw value.
            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

u64_id!(
    /// One exported memory object (a whole buffer or a slab) of one exporter process.
    ///
    /// Allocation ids are handed out by a process-wide counter and never reused for a new
    /// allocation, so a handle that names a freed allocation can be recognised as stale.
    AllocationId,
    "alloc#"
);

u64_id!(
    /// Which backing of an [`AllocationId`] a handle refers to.
    ///
    /// Starts at 1. An owner that replaces the memory behind a long-lived allocation id
    /// (a resize, a re-carved slab range) bumps the generation, and importers refuse
    /// handles of an older generation than one they have already seen as stale.
    Generation,
    "gen#"
);

u64_id!(
    /// One lease: the right of one peer to map one buffer until it sends `Release`.
    ///
    /// Chosen by the exporter, unique per exporter process, never reused.
    LeaseId,
    "lease#"
);

u64_id!(
    /// An actor inside a process, as the process numbers them.
    ActorId,
    "actor#"
);

impl Generation {
    /// The generation of a freshly made allocation.
    pub const FIRST: Generation = Generation(1);

    /// The next generation.
    pub const fn next(self) -> Generation {
        Generation(self.0 + 1)
    }
}

/// One boot of one Linux machine (`/proc/sys/kernel/random/boot_id`).
///
/// With a pid and a process start time it names a process uniquely, even across pid reuse.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct BootId(#[serde(with = "crate::byte_array")] pub [u8; 16]);

impl fmt::Debug for BootId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "boot:")?;
        for b in &self.0[..4] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A process, named so that a reused pid is never mistaken for the original.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct ProcessId {
    /// The machine boot the process lives in.
    pub boot: BootId,
    /// The kernel's process id.
    pub pid: u32,
    /// The process start time in clock ticks since boot (`/proc/<pid>/stat`, field 22).
    pub start_ticks: u64,
}

impl fmt::Debug for ProcessId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid:{}@{}", self.pid, self.start_ticks)
    }
}

impl fmt::Display for ProcessId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Who exported a buffer: a process and the actor in it that owns the buffer.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct ExporterId {
    /// The exporting process.
    pub process: ProcessId,
    /// The owning actor in that process.
    pub actor: ActorId,
}

impl fmt::Debug for ExporterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}/{:?}", self.process, self.actor)
    }
}

impl fmt::Display for ExporterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A device, by UUID: ordinals differ between processes (`CUDA_VISIBLE_DEVICES`), UUIDs do not.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct DeviceUuid(#[serde(with = "crate::byte_array")] pub [u8; 16]);

impl DeviceUuid {
    /// The "device" of the host backend: the machine's own memory.
    pub const HOST: DeviceUuid = DeviceUuid([0; 16]);
}

impl fmt::Debug for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::HOST {
            return f.write_str("host");
        }
        // The form nvidia-smi prints: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
        write!(f, "GPU-")?;
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Display for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The shared secret of one deployment of cooperating processes.
///
/// Peers prove they know it during the handshake (it never travels itself), and it keys
/// the digest that seals every [`HandleMsg`](crate::HandleMsg). `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionToken([u8; 32]);

impl SessionToken {
    /// Wraps 32 secret bytes (use a random source, e.g. `getrandom`).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The secret bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Parses the 64-hex-digit form that [`to_hex`](Self::to_hex) writes (used to hand
    /// the token to child processes through their environment).
    pub fn from_hex(hex: &str) -> Option<Self> {
        let hex = hex.trim().as_bytes();
        if hex.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in hex.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Some(Self(out))
    }

    /// The 64-hex-digit form.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for SessionToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionToken(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_hex_round_trip_and_redacted_debug() {
        let t = SessionToken::from_bytes(std::array::from_fn(|i| (i * 7) as u8));
        let hex = t.to_hex();
        assert_eq!(SessionToken::from_hex(&hex), Some(t.clone()));
        assert!(!format!("{t:?}").contains(&hex[..8]));
        assert_eq!(SessionToken::from_hex("zz"), None);
        assert_eq!(SessionToken::from_hex(&"g".repeat(64)), None);
    }

    #[test]
    fn device_uuid_prints_like_nvidia_smi() {
        let u = DeviceUuid([0xab; 16]);
        assert_eq!(u.to_string(), "GPU-abababab-abab-abab-abab-abababababab");
        assert_eq!(DeviceUuid::HOST.to_string(), "host");
    }
}
