//! A hand-written decoder and encoder for the messages of a handoff: [`Message::Call`],
//! [`Message::Reply`] with a payload, and [`Message::Release`] — the frames a pipelined
//! handoff moves, read and written without serde's visitors (through bincode's serde layer
//! decoding an offer cost about 2,700 instructions, a fifth of a consumer's work per
//! handoff, and encoding one a varint call per field).
//!
//! **It never decides anything serde would decide otherwise.** It reads and writes exactly
//! bincode's encoding of those messages (`codec`'s configuration: varints, little endian).
//! The decoder gives up — `None` — at the first thing it does not take: another message, a
//! fault reply, a copy handle, a malformed or truncated field, a length past the payload,
//! trailing bytes. [`decode_payload`](crate::codec::decode_payload) then decodes the
//! payload with serde, which says what is wrong with it. So for every payload this decoder
//! either returns the message serde returns, or nothing; and the encoder writes serde's
//! bytes or nothing (pinned by property tests against serde: encoded messages of every
//! kind; mutated, cut and random bytes; every one-byte change of a few handoffs; variant
//! tags in every longer form). The decoder's checks are the types' own and bincode's:
//! [`SegmentName::new`], a [`Shape`] of at most [`Shape::MAX_RANK`] extents, UTF-8
//! strings, exact byte-array lengths, `Option` tags 0 or 1, variant indices as `u32`s.

use crate::fence::{CounterFence, FenceHandle};
use crate::handle::{HandleDigest, HandleMsg};
use crate::ids::{
    ActorId, AllocationId, BootId, DeviceUuid, ExporterId, Generation, LeaseId, ProcessId,
};
use crate::layout::{DType, Layout, Shape};
use crate::protocol::{Call, CallRef, Message, Offer, Payload, Release, Reply};
use crate::raw::{
    BackendKind, CudaIpcMemHandle, CudaPoolExportData, IpcEventHandle, RawHandle, SegmentName,
};
use std::cell::RefCell;

/// [`Message`]'s variant indices of the messages decoded here (pinned against the derived
/// encoding by a test).
pub(crate) const RELEASE: u64 = 5;
pub(crate) const CALL: u64 = 10;
pub(crate) const REPLY: u64 = 11;

/// [`BackendKind`]'s variants in their declared order (pinned by a test).
const BACKENDS: [BackendKind; 4] = [
    BackendKind::Host,
    BackendKind::CudaLegacy,
    BackendKind::CudaVmm,
    BackendKind::CudaPool,
];

/// [`DType`]'s variants in their declared order (pinned by a test).
const DTYPES: [DType; 12] = [
    DType::U8,
    DType::I8,
    DType::U16,
    DType::I16,
    DType::U32,
    DType::I32,
    DType::U64,
    DType::I64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
];

thread_local! {
    /// The segment name decoded last on this thread: an importer is offered the same
    /// segment again and again, and a name equal to it is the same name, checked already
    /// (no allocation, no check again).
    static LAST_SEGMENT: RefCell<Option<SegmentName>> = const { RefCell::new(None) };
}

/// The message `payload` holds, when it is one this decoder takes; `None` otherwise (the
/// caller decodes it with serde).
pub(crate) fn decode(payload: &[u8]) -> Option<Message> {
    let mut r = Reader(payload);
    // A variant index is a u32 to bincode (as every enum's below).
    let msg = match u64::from(r.varint_u32()?) {
        CALL => Message::Call(Call {
            id: r.varint()?,
            target: r.str()?.to_owned(),
            type_name: r.str()?.to_owned(),
            payload: r.bytes()?.to_vec(),
            offers: r.offers()?,
        }),
        REPLY => {
            let id = r.varint()?;
            // `Ok` (variant 0) only: a fault is rare, and serde reads it.
            if r.varint_u32()? != 0 {
                return None;
            }
            let bytes = r.bytes()?.to_vec();
            Message::Reply(Reply {
                id,
                outcome: Ok(Payload {
                    bytes,
                    offers: r.offers()?,
                }),
            })
        }
        RELEASE => {
            let lease = LeaseId::new(r.varint()?);
            let n = r.len(1)?;
            let mut fences = Vec::with_capacity(n);
            for _ in 0..n {
                fences.push(r.fence()?);
            }
            Message::Release(Release { lease, fences })
        }
        _ => return None,
    };
    // Exactly the payload, as `decode_payload` asks.
    r.0.is_empty().then_some(msg)
}

/// What is left of a payload.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    /// A `u8`: one byte as it is.
    fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }

    /// bincode's unsigned varint, as a `u64`: a byte below 251, or 251, 252, 253 then
    /// 2, 4, 8 bytes (bincode takes a longer form than needed too, and so does this).
    fn varint(&mut self) -> Option<u64> {
        Some(match self.u8()? {
            b @ 0..=250 => u64::from(b),
            251 => u64::from(u16::from_le_bytes(self.array()?)),
            252 => u64::from(u32::from_le_bytes(self.array()?)),
            253 => u64::from_le_bytes(self.array()?),
            _ => return None,
        })
    }

    /// A `u32` varint (a `u64` form is refused, as bincode refuses it).
    fn varint_u32(&mut self) -> Option<u32> {
        match self.0.first()? {
            253.. => None,
            _ => u32::try_from(self.varint()?).ok(),
        }
    }

    /// A length of items of at least `min` bytes each: no more than the rest could hold,
    /// so that a lying length allocates nothing.
    fn len(&mut self, min: usize) -> Option<usize> {
        let n = usize::try_from(self.varint()?).ok()?;
        (n <= self.0.len() / min).then_some(n)
    }

    /// A byte string: its length, then its bytes.
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.varint()?).ok()?;
        self.take(n)
    }

    fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.bytes()?).ok()
    }

    /// A byte array (`byte_array`): a byte string of exactly `N` bytes.
    fn byte_array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes()?.try_into().ok()
    }

    /// An `Option`'s tag: 0 or 1.
    fn some(&mut self) -> Option<bool> {
        match self.u8()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }

    fn option_u8(&mut self) -> Option<Option<u8>> {
        Some(if self.some()? { Some(self.u8()?) } else { None })
    }

    fn offers(&mut self) -> Option<Vec<Offer>> {
        // An offer takes well over 64 bytes.
        let n = self.len(64)?;
        let mut offers = Vec::with_capacity(n);
        for _ in 0..n {
            offers.push(Offer {
                lease: LeaseId::new(self.varint()?),
                handle: self.handle()?,
            });
        }
        Some(offers)
    }

    fn handle(&mut self) -> Option<HandleMsg> {
        Some(HandleMsg {
            version: self.u8()?,
            exporter: ExporterId {
                process: ProcessId {
                    boot: BootId(self.byte_array()?),
                    pid: self.varint_u32()?,
                    start_ticks: self.varint()?,
                },
                actor: ActorId::new(self.varint()?),
            },
            alloc: AllocationId::new(self.varint()?),
            generation: Generation::new(self.varint()?),
            backend: *BACKENDS.get(usize::try_from(self.varint_u32()?).ok()?)?,
            device: DeviceUuid(self.byte_array()?),
            alloc_size: self.varint()?,
            offset: self.varint()?,
            len: self.varint()?,
            layout: if self.some()? {
                Some(self.layout()?)
            } else {
                None
            },
            raw: self.raw()?,
            fence: if self.some()? {
                Some(self.fence()?)
            } else {
                None
            },
            digest: HandleDigest(self.byte_array()?),
        })
    }

    fn layout(&mut self) -> Option<Layout> {
        let dtype = *DTYPES.get(usize::try_from(self.varint_u32()?).ok()?)?;
        let rank = usize::try_from(self.varint()?).ok()?;
        if rank > Shape::MAX_RANK {
            return None;
        }
        let mut dims = [0u64; Shape::MAX_RANK];
        for d in &mut dims[..rank] {
            *d = self.varint()?;
        }
        Some(Layout::new(dtype, Shape::from_slice(&dims[..rank])?))
    }

    fn raw(&mut self) -> Option<RawHandle> {
        Some(match self.varint_u32()? {
            0 => RawHandle::HostSegment(self.segment_name()?),
            1 => RawHandle::CudaIpc(CudaIpcMemHandle(self.byte_array()?)),
            2 => RawHandle::CudaVmmFd {
                slot: self.option_u8()?,
            },
            3 => RawHandle::CudaPool {
                pool: self.varint()?,
                pool_slot: self.option_u8()?,
                ptr: CudaPoolExportData(self.byte_array()?),
            },
            4 => RawHandle::HostMemfd {
                slot: self.option_u8()?,
            },
            // A copy (across hosts) is rare: serde reads it.
            _ => return None,
        })
    }

    fn segment_name(&mut self) -> Option<SegmentName> {
        let bytes = self.bytes()?;
        LAST_SEGMENT.with(|last| {
            let mut last = last.borrow_mut();
            if let Some(name) = last.as_ref().filter(|n| n.as_str().as_bytes() == bytes) {
                return Some(name.clone());
            }
            let name = SegmentName::new(std::str::from_utf8(bytes).ok()?)?;
            *last = Some(name.clone());
            Some(name)
        })
    }

    fn fence(&mut self) -> Option<FenceHandle> {
        Some(match self.varint_u32()? {
            0 => FenceHandle::Event(IpcEventHandle(self.byte_array()?)),
            1 => FenceHandle::Counter(CounterFence {
                slab: CudaIpcMemHandle(self.byte_array()?),
                slab_id: self.varint()?,
                offset: self.varint()?,
                value: self.varint()?,
            }),
            _ => return None,
        })
    }
}

/// Appends `msg`'s encoding to `out` when it is one this encoder writes (a call, a reply
/// with a payload, a release, with no copy handle); otherwise leaves `out` as it was and
/// returns `false` (the caller encodes it with serde).
pub(crate) fn encode(msg: &Message, out: &mut Vec<u8>) -> bool {
    let start = out.len();
    let mut w = Writer(out);
    let written = match msg {
        Message::Call(c) => w.call(CallRef {
            id: c.id,
            target: &c.target,
            type_name: &c.type_name,
            payload: &c.payload,
            offers: &c.offers,
        }),
        Message::Reply(Reply {
            id,
            outcome: Ok(Payload { bytes, offers }),
        }) => {
            w.varint(REPLY);
            w.varint(*id);
            w.varint(0);
            w.bytes(bytes);
            w.offers(offers)
        }
        Message::Release(Release { lease, fences }) => {
            w.varint(RELEASE);
            w.varint(lease.get());
            w.varint(fences.len() as u64);
            for f in fences {
                w.fence(f);
            }
            Some(())
        }
        _ => None,
    };
    if written.is_none() {
        out.truncate(start);
    }
    written.is_some()
}

/// [`encode`] of a call of borrowed parts.
pub(crate) fn encode_call(call: CallRef<'_>, out: &mut Vec<u8>) -> bool {
    let start = out.len();
    let written = Writer(out).call(call).is_some();
    if !written {
        out.truncate(start);
    }
    written
}

/// Where an encoding is appended.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn call(&mut self, call: CallRef<'_>) -> Option<()> {
        self.varint(CALL);
        self.varint(call.id);
        self.bytes(call.target.as_bytes());
        self.bytes(call.type_name.as_bytes());
        self.bytes(call.payload);
        self.offers(call.offers)
    }

    /// bincode's unsigned varint, in its shortest form (as bincode writes it).
    fn varint(&mut self, v: u64) {
        if v <= 250 {
            self.0.push(v as u8);
        } else if let Ok(v) = u16::try_from(v) {
            self.0.push(251);
            self.0.extend_from_slice(&v.to_le_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            self.0.push(252);
            self.0.extend_from_slice(&v.to_le_bytes());
        } else {
            self.0.push(253);
            self.0.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// A byte string or array: its length, then its bytes.
    fn bytes(&mut self, bytes: &[u8]) {
        self.varint(bytes.len() as u64);
        self.0.extend_from_slice(bytes);
    }

    fn option_u8(&mut self, v: Option<u8>) {
        match v {
            Some(b) => self.0.extend_from_slice(&[1, b]),
            None => self.0.push(0),
        }
    }

    /// `None` at a handle this encoder does not write.
    fn offers(&mut self, offers: &[Offer]) -> Option<()> {
        self.varint(offers.len() as u64);
        for o in offers {
            self.varint(o.lease.get());
            self.handle(&o.handle)?;
        }
        Some(())
    }

    /// `None` for a copy handle (rare, across hosts: serde writes it).
    fn handle(&mut self, h: &HandleMsg) -> Option<()> {
        self.0.push(h.version);
        self.bytes(&h.exporter.process.boot.0);
        self.varint(u64::from(h.exporter.process.pid));
        self.varint(h.exporter.process.start_ticks);
        self.varint(h.exporter.actor.get());
        self.varint(h.alloc.get());
        self.varint(h.generation.get());
        self.varint(BACKENDS.iter().position(|b| *b == h.backend)? as u64);
        self.bytes(&h.device.0);
        self.varint(h.alloc_size);
        self.varint(h.offset);
        self.varint(h.len);
        match &h.layout {
            Some(layout) => {
                self.0.push(1);
                self.varint(DTYPES.iter().position(|d| *d == layout.dtype)? as u64);
                let dims = layout.shape.dims();
                self.varint(dims.len() as u64);
                for d in dims {
                    self.varint(*d);
                }
            }
            None => self.0.push(0),
        }
        match &h.raw {
            RawHandle::HostSegment(name) => {
                self.varint(0);
                self.bytes(name.as_str().as_bytes());
            }
            RawHandle::CudaIpc(handle) => {
                self.varint(1);
                self.bytes(&handle.0);
            }
            RawHandle::CudaVmmFd { slot } => {
                self.varint(2);
                self.option_u8(*slot);
            }
            RawHandle::CudaPool {
                pool,
                pool_slot,
                ptr,
            } => {
                self.varint(3);
                self.varint(*pool);
                self.option_u8(*pool_slot);
                self.bytes(&ptr.0);
            }
            RawHandle::HostMemfd { slot } => {
                self.varint(4);
                self.option_u8(*slot);
            }
            RawHandle::Copy { .. } => return None,
        }
        match &h.fence {
            Some(f) => {
                self.0.push(1);
                self.fence(f);
            }
            None => self.0.push(0),
        }
        self.bytes(&h.digest.0);
        Some(())
    }

    fn fence(&mut self, f: &FenceHandle) {
        match f {
            FenceHandle::Event(e) => {
                self.varint(0);
                self.bytes(&e.0);
            }
            FenceHandle::Counter(c) => {
                self.varint(1);
                self.bytes(&c.slab.0);
                self.varint(c.slab_id);
                self.varint(c.offset);
                self.varint(c.value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variant_tables_are_the_declared_orders() {
        let config = bincode::config::standard();
        let variant = |bytes: Vec<u8>| u64::from(bytes[0]);
        for (i, b) in BACKENDS.iter().enumerate() {
            assert_eq!(
                variant(bincode::serde::encode_to_vec(b, config).unwrap()),
                i as u64
            );
        }
        for (i, d) in DTYPES.iter().enumerate() {
            assert_eq!(
                variant(bincode::serde::encode_to_vec(d, config).unwrap()),
                i as u64
            );
        }
        let call = Message::Call(Call {
            id: 0,
            target: String::new(),
            type_name: String::new(),
            payload: Vec::new(),
            offers: Vec::new(),
        });
        assert_eq!(
            variant(bincode::serde::encode_to_vec(&call, config).unwrap()),
            CALL
        );
        let reply = Message::Reply(Reply {
            id: 0,
            outcome: Ok(Payload {
                bytes: Vec::new(),
                offers: Vec::new(),
            }),
        });
        assert_eq!(
            variant(bincode::serde::encode_to_vec(&reply, config).unwrap()),
            REPLY
        );
        let release = Message::Release(Release::now(LeaseId::new(0)));
        assert_eq!(
            variant(bincode::serde::encode_to_vec(&release, config).unwrap()),
            RELEASE
        );
    }

    #[test]
    fn a_segment_name_decoded_again_is_the_same_name_and_a_bad_one_is_refused() {
        let name = SegmentName::new("/baton.hot-1").unwrap();
        let first = Reader(b"\x0c/baton.hot-1").segment_name().unwrap();
        let again = Reader(b"\x0c/baton.hot-1").segment_name().unwrap();
        assert_eq!(first, name);
        assert!(std::ptr::eq(first.as_str(), again.as_str()));
        for bad in [
            &b"\x05/a/bc"[..],
            b"\x03/..",
            b"\x01/",
            b"\x03/\xff\xfe",
            b"\x0d/baton.hot-1",
        ] {
            assert!(Reader(bad).segment_name().is_none(), "{bad:?}");
        }
    }

    /// Values at and around each of bincode's varint forms.
    const VARINT_EDGES: [u64; 12] = [
        0,
        1,
        249,
        250,
        251,
        255,
        256,
        65_535,
        65_536,
        u32::MAX as u64,
        u32::MAX as u64 + 1,
        u64::MAX,
    ];

    #[test]
    fn varints_are_read_as_bincode_reads_them() {
        let config = bincode::config::standard();
        let mut cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![254],
            vec![255],
            vec![251, 1],
            vec![252, 1, 2, 3],
        ];
        for v in VARINT_EDGES {
            cases.push(bincode::encode_to_vec(v, config).unwrap());
            // Longer forms than needed, which bincode takes too.
            let mut long = vec![253];
            long.extend(v.to_le_bytes());
            cases.push(long);
            if let Ok(v) = u32::try_from(v) {
                let mut long = vec![252];
                long.extend(v.to_le_bytes());
                cases.push(long);
            }
            let mut u128_form = vec![254];
            u128_form.extend(u128::from(v).to_le_bytes());
            cases.push(u128_form);
        }
        for case in &cases {
            let ours = {
                let mut r = Reader(case);
                r.varint().map(|v| (v, case.len() - r.0.len()))
            };
            let theirs = bincode::decode_from_slice::<u64, _>(case, config).ok();
            assert_eq!(ours, theirs, "u64 {case:?}");
            let ours = {
                let mut r = Reader(case);
                r.varint_u32().map(|v| (v, case.len() - r.0.len()))
            };
            let theirs = bincode::decode_from_slice::<u32, _>(case, config).ok();
            assert_eq!(ours, theirs, "u32 {case:?}");
        }
    }

    #[test]
    fn varints_are_written_as_bincode_writes_them() {
        let config = bincode::config::standard();
        for v in VARINT_EDGES {
            let mut ours = Vec::new();
            Writer(&mut ours).varint(v);
            assert_eq!(ours, bincode::encode_to_vec(v, config).unwrap(), "{v}");
            if let Ok(v32) = u32::try_from(v) {
                assert_eq!(
                    ours,
                    bincode::encode_to_vec(v32, config).unwrap(),
                    "{v} as u32"
                );
            }
        }
    }
}
