//! Fences as they travel: what one process records on a GPU stream after some work, and
//! another process makes its own stream wait on.
//!
//! Two kinds ([`FenceKind`]): an interprocess event (its 64-byte IPC handle), or a slot of
//! a sequence-counter slab in device memory that both processes map (the slab's legacy IPC
//! handle, the slot and the value to wait for). Both appear in two places of the protocol:
//!
//! - an offer's handle carries the **acquire** fence ([`HandleMsg::fence`](crate::HandleMsg::fence)),
//!   recorded by the exporter after the work that produced the buffer: the importer's work
//!   waits on it, on the stream the importer uses;
//! - a [`Release`](crate::protocol::Release) carries **release** fences, recorded by the
//!   importer after its last use of the lease: the exporter waits on them before it writes
//!   the buffer again or frees it.
//!
//! Fence handles are capabilities: `Debug` never prints their bytes.

use crate::raw::{CudaIpcMemHandle, IpcEventHandle};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The kinds of fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FenceKind {
    /// A pooled interprocess event (`cuEventRecord`, `cuIpcOpenEventHandle`,
    /// `cuStreamWaitEvent`): the fallback where a device has no 64-bit stream memory
    /// operations.
    Event,
    /// A sequence counter in device memory both processes map, written and waited on by
    /// the streams (`cuStreamWriteValue64`, `cuStreamWaitValue64`). The default: a record
    /// costs about 1.5 µs against about 120 µs for an interprocess event (H100).
    #[default]
    Counter,
}

impl FenceKind {
    /// Parses `event` or `counter` (case-insensitive; empty is the default, `counter`).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "event" | "events" => Some(Self::Event),
            "counter" | "counters" | "" => Some(Self::Counter),
            _ => None,
        }
    }

    /// The name [`parse`](Self::parse) takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Event => "event",
            Self::Counter => "counter",
        }
    }
}

/// A counter fence: which slot of which slab, and the value to wait for. The slab is the
/// **consumer's** fence inbox (see [`InboxGrant`]): the producer's stream writes the value
/// into the consumer's memory, and the consumer's stream waits on its own memory, so the
/// consumer can always release its own waits (by writing the slot itself) when the
/// producer dies or does not deliver. The slab handle is a capability: `Debug` never
/// prints it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct CounterFence {
    /// The legacy IPC handle of the slab the slot lies in (the consumer's inbox).
    pub slab: CudaIpcMemHandle,
    /// The slab owner's id of the slab (unique in that process).
    pub slab_id: u64,
    /// Byte offset of the slot in the slab (a multiple of 8).
    pub offset: u64,
    /// The value the consumer's stream waits for (at least).
    pub value: u64,
}

impl CounterFence {
    /// Bytes of [`to_bytes`](Self::to_bytes).
    pub const ENCODED_LEN: usize = 64 + 3 * 8;

    /// The slab handle, then id, offset and value as little-endian `u64`s (for payloads
    /// outside the protocol, such as test peers' arguments).
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..64].copy_from_slice(&self.slab.0);
        out[64..72].copy_from_slice(&self.slab_id.to_le_bytes());
        out[72..80].copy_from_slice(&self.offset.to_le_bytes());
        out[80..88].copy_from_slice(&self.value.to_le_bytes());
        out
    }

    /// The inverse of [`to_bytes`](Self::to_bytes); `None` for any other length.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::ENCODED_LEN {
            return None;
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let mut slab = [0u8; 64];
        slab.copy_from_slice(&bytes[..64]);
        Some(Self {
            slab: CudaIpcMemHandle(slab),
            slab_id: word(64),
            offset: word(72),
            value: word(80),
        })
    }
}

impl fmt::Debug for CounterFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CounterFence")
            .field("slab", &"<redacted>")
            .field("slab_id", &self.slab_id)
            .field("offset", &self.offset)
            .field("value", &self.value)
            .finish()
    }
}

/// What a process lends one peer process of its fence inbox: a *lane* of `slots` 64-bit
/// counters starting at `first`, in the device memory of its CUDA backend, shared as a
/// legacy IPC handle. The peer's streams write the values of the fences they record for
/// this process there (one slot per writer of the peer — its release streams and stream
/// slots — each written in order); this process's streams wait on them in its own memory. Sent once per link, right after
/// the handshake ([`Message::FenceInbox`](crate::protocol::Message::FenceInbox)). The
/// handle is a capability: `Debug` never prints it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct InboxGrant {
    /// The device the inbox lies on.
    pub device: crate::DeviceUuid,
    /// The legacy IPC handle of the inbox slab.
    pub slab: CudaIpcMemHandle,
    /// The owner's id of the slab.
    pub slab_id: u64,
    /// The lane's first slot.
    pub first: u32,
    /// The lane's slots.
    pub slots: u32,
    /// The value every slot of the lane holds now: the peer's first fence on a slot takes
    /// the next value up (a lane lent again continues where it stood).
    pub base: u64,
}

impl InboxGrant {
    /// Byte offset of the lane's slot `i`, if it lies in the lane.
    pub fn offset_of(&self, i: u32) -> Option<u64> {
        (i < self.slots).then(|| (u64::from(self.first) + u64::from(i)) * 8)
    }

    /// The lane's slot index of a byte offset, if it is one of the lane's slots.
    pub fn slot_of(&self, offset: u64) -> Option<u32> {
        if offset % 8 != 0 {
            return None;
        }
        let slot = offset / 8;
        let first = u64::from(self.first);
        (slot >= first && slot < first + u64::from(self.slots)).then(|| (slot - first) as u32)
    }
}

impl fmt::Debug for InboxGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboxGrant")
            .field("device", &self.device)
            .field("slab", &"<redacted>")
            .field("slab_id", &self.slab_id)
            .field("first", &self.first)
            .field("slots", &self.slots)
            .field("base", &self.base)
            .finish()
    }
}

/// What a consumer needs to wait on a fence another process recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum FenceHandle {
    /// An interprocess event (redacted in `Debug`).
    Event(IpcEventHandle),
    /// A slot of a counter slab.
    Counter(CounterFence),
}

impl FenceHandle {
    /// Its kind.
    pub fn kind(&self) -> FenceKind {
        match self {
            FenceHandle::Event(_) => FenceKind::Event,
            FenceHandle::Counter(_) => FenceKind::Counter,
        }
    }

    /// Whether waiting on `self` also waits for everything `earlier` was recorded after,
    /// given that a producer records a slot or event again only once its last record
    /// completed (Baton's backends do): the same event, or the same counter slot with a
    /// value at least as high. Lets a consumer keep one fence per slot or event instead of
    /// one per record.
    pub fn covers(&self, earlier: &FenceHandle) -> bool {
        match (self, earlier) {
            (FenceHandle::Event(a), FenceHandle::Event(b)) => a == b,
            (FenceHandle::Counter(a), FenceHandle::Counter(b)) => {
                a.slab_id == b.slab_id
                    && a.slab == b.slab
                    && a.offset == b.offset
                    && a.value >= b.value
            }
            _ => false,
        }
    }
}

impl From<IpcEventHandle> for FenceHandle {
    fn from(e: IpcEventHandle) -> Self {
        FenceHandle::Event(e)
    }
}

impl From<CounterFence> for FenceHandle {
    fn from(c: CounterFence) -> Self {
        FenceHandle::Counter(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_kinds_parse_and_name_themselves() {
        assert_eq!(FenceKind::parse("counter"), Some(FenceKind::Counter));
        assert_eq!(FenceKind::parse(" Event "), Some(FenceKind::Event));
        assert_eq!(FenceKind::parse(""), Some(FenceKind::Counter));
        assert_eq!(FenceKind::parse("semaphore"), None);
        assert_eq!(FenceKind::default(), FenceKind::Counter);
        for k in [FenceKind::Event, FenceKind::Counter] {
            assert_eq!(FenceKind::parse(k.name()), Some(k));
        }
    }

    #[test]
    fn counter_fences_round_trip_through_bytes_and_hide_the_slab() {
        let fence = CounterFence {
            slab: CudaIpcMemHandle([0xee; 64]),
            slab_id: 3,
            offset: 8 * 17,
            value: u64::MAX - 1,
        };
        let bytes = fence.to_bytes();
        assert_eq!(CounterFence::from_bytes(&bytes), Some(fence));
        assert_eq!(CounterFence::from_bytes(&bytes[1..]), None);
        let shown = format!("{:?}", FenceHandle::Counter(fence));
        assert!(
            shown.contains("redacted") && shown.contains("offset: 136"),
            "{shown}"
        );
        assert!(
            !shown.contains("238") && !shown.to_lowercase().contains("ee, "),
            "{shown}"
        );
        let shown = format!("{:?}", FenceHandle::Event(IpcEventHandle([0xee; 64])));
        assert!(!shown.contains("238"), "{shown}");
        assert_eq!(FenceHandle::Counter(fence).kind(), FenceKind::Counter);
    }

    #[test]
    fn a_later_value_of_the_same_slot_covers_an_earlier_one_and_nothing_else() {
        let at = |slab_id, offset, value| {
            FenceHandle::Counter(CounterFence {
                slab: CudaIpcMemHandle([1; 64]),
                slab_id,
                offset,
                value,
            })
        };
        assert!(at(1, 8, 5).covers(&at(1, 8, 4)));
        assert!(at(1, 8, 5).covers(&at(1, 8, 5)));
        assert!(!at(1, 8, 4).covers(&at(1, 8, 5)), "an older value");
        assert!(!at(1, 16, 5).covers(&at(1, 8, 4)), "another slot");
        assert!(!at(2, 8, 5).covers(&at(1, 8, 4)), "another slab");
        let mut other_handle = at(1, 8, 5);
        if let FenceHandle::Counter(c) = &mut other_handle {
            c.slab = CudaIpcMemHandle([2; 64]);
        }
        assert!(!other_handle.covers(&at(1, 8, 4)), "another slab handle");
        let (e1, e2) = (
            FenceHandle::Event(IpcEventHandle([1; 64])),
            FenceHandle::Event(IpcEventHandle([2; 64])),
        );
        assert!(e1.covers(&e1) && !e1.covers(&e2));
        assert!(!e1.covers(&at(1, 8, 1)) && !at(1, 8, 1).covers(&e1));
    }
}
