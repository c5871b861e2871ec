//! [`HandleMsg`]: the serialized capability to map one buffer of another process, and its
//! seal.
//!
//! A handle message is plain data. It names the exporter, the allocation and its
//! generation, the backend and device, the byte range and typed layout of the buffer, and
//! carries the backend's raw handle ([`RawHandle`]: a segment name, 64 CUDA IPC bytes, or
//! the slot of a file descriptor sent beside the frame: a CUDA VMM handle or a sealed host
//! `memfd`). Raw handles are capabilities: `Debug` never prints them, and every handle is
//! sealed with a keyed digest over all its fields, which the importer verifies before any
//! driver call. (A CUDA IPC handle with one corrupted byte was seen to open without error
//! on driver 580, so the driver is no judge of integrity.)
//!
//! # The seal
//!
//! [`HandleMsg::seal`] computes BLAKE3, keyed with the session's [`HandleKey`], over every
//! field of the handle but the digest, in the order the struct declares them (`version`,
//! `exporter`, `alloc`, `generation`, `backend`, `device`, `alloc_size`, `offset`, `len`,
//! `layout`, `raw`, `fence`), taken as one tuple in their serde representation and
//! written by bincode 2 in its standard configuration: little-endian; integers of
//! variable length (below 251 one byte, else a marker byte 251, 252 or 253 then 2, 4 or 8
//! bytes); enum variants as their index; `Option` as a 0 or 1 byte, then the value;
//! sequences length first; byte arrays (ids, the 64-byte raw handles) as byte strings,
//! their length first (since protocol version 4; 3 wrote them with no length); no size
//! limit.
//!
//! That encoding is the seal's own, not the framing codec's ([`codec`](crate::codec), a
//! layer above): frames have a size limit, seals need none, and either may change without
//! the other. It writes the same bytes as the framing configuration, which differs only
//! by its decode limit, and a test pins the digests of a set of handles: a change to
//! what is sealed shows there.

use crate::fence::FenceHandle;
use crate::ids::{AllocationId, DeviceUuid, ExporterId, Generation, SessionToken};
use crate::layout::Layout;
use crate::{Error, PROTOCOL_VERSION, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

// The raw handles were first defined here: their paths under `handle` stay.
pub use crate::raw::{
    BackendKind, CudaIpcMemHandle, CudaPoolExportData, IpcEventHandle, RawHandle, SegmentName,
};

/// The key that seals handle messages, derived from the [`SessionToken`].
#[derive(Clone, PartialEq, Eq)]
pub struct HandleKey([u8; 32]);

impl HandleKey {
    /// Derives the handle key of a session.
    pub fn derive(token: &SessionToken) -> Self {
        Self(blake3::derive_key(
            "baton 2026-11 handle message digest v1",
            token.as_bytes(),
        ))
    }
}

impl fmt::Debug for HandleKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HandleKey(<redacted>)")
    }
}

/// A keyed BLAKE3 digest over every other field of a [`HandleMsg`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct HandleDigest(#[serde(with = "crate::byte_array")] pub [u8; 32]);

impl fmt::Debug for HandleDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "digest:{:02x}{:02x}…", self.0[0], self.0[1])
    }
}

/// Everything another process needs to map one buffer, sealed by a keyed digest.
///
/// Build one with every field set and `digest: HandleDigest::default()`, then
/// [`seal`](Self::seal) it. The importer calls [`check`](Self::check) (which validates and
/// verifies) before it touches a driver.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct HandleMsg {
    /// Protocol version the handle was made under.
    pub version: u8,
    /// The process and actor that own the buffer.
    pub exporter: ExporterId,
    /// The exported allocation (a whole buffer, or a slab the buffer is carved from).
    pub alloc: AllocationId,
    /// Which backing of `alloc` this is.
    pub generation: Generation,
    /// How to open it.
    pub backend: BackendKind,
    /// The device the memory lives on ([`DeviceUuid::HOST`] for host memory).
    pub device: DeviceUuid,
    /// Bytes of the whole exported allocation.
    pub alloc_size: u64,
    /// Where the buffer starts inside the allocation.
    pub offset: u64,
    /// Bytes of the buffer.
    pub len: u64,
    /// Element type and shape, for typed buffers.
    pub layout: Option<Layout>,
    /// The backend's raw handle.
    pub raw: RawHandle,
    /// The acquire fence: recorded by the exporter after the work that produced the
    /// buffer; the importer's work waits on it, on the stream it uses (device backends
    /// only).
    pub fence: Option<FenceHandle>,
    /// Keyed digest over all fields above.
    pub digest: HandleDigest,
}

impl fmt::Debug for HandleMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandleMsg")
            .field("exporter", &self.exporter)
            .field("alloc", &self.alloc)
            .field("gen", &self.generation)
            .field("backend", &self.backend)
            .field("device", &self.device)
            .field(
                "range",
                &format_args!("{}..+{} of {}", self.offset, self.len, self.alloc_size),
            )
            .field("layout", &self.layout)
            .field("raw", &self.raw)
            .field("fence", &self.fence.as_ref().map(FenceHandle::kind))
            .finish_non_exhaustive()
    }
}

/// The seal's encoding: see "The seal" in the module docs.
const SEAL_ENCODING: bincode::config::Configuration = bincode::config::standard();

/// The seal's keyed BLAKE3 hasher, fed by bincode as it encodes: the encoding is gathered
/// in a buffer on the stack (a handle's fits whole) and hashed in as few updates as it
/// takes, the same bytes as hashing the encoded `Vec` would, without the `Vec` (and
/// without an update per field, each of which costs the hasher a call).
struct SealHasher {
    hasher: blake3::Hasher,
    buf: [u8; SEAL_BUF],
    len: usize,
}

/// Bytes [`SealHasher`] gathers before it hashes them.
const SEAL_BUF: usize = 512;

impl SealHasher {
    fn new(key: &HandleKey) -> Self {
        Self {
            hasher: blake3::Hasher::new_keyed(&key.0),
            buf: [0; SEAL_BUF],
            len: 0,
        }
    }

    /// Hashes in what is gathered.
    fn flush(&mut self) {
        self.hasher.update(&self.buf[..self.len]);
        self.len = 0;
    }

    fn finalize(mut self) -> blake3::Hash {
        self.flush();
        self.hasher.finalize()
    }
}

/// A handle's seal up to its fence, kept to seal the next handles of the same buffer.
///
/// A buffer shared again gives the same handle but for its fence (a new acquire fence
/// each time, or none). The digest is over the fields' encoding in order, the fence last,
/// so the keyed hasher with every field but the fence absorbed, cloned, seals such a
/// handle by hashing its fence alone: the digest [`HandleMsg::seal`] computes, without
/// encoding and hashing the rest again (most of a cached handoff's sealing work).
#[derive(Clone)]
pub struct SealPrefix {
    key: HandleKey,
    /// The handle it was made from (its fence and digest are not compared).
    fields: HandleMsg,
    /// The keyed hasher with every field but the fence absorbed.
    hasher: blake3::Hasher,
    /// The last fence sealed, and the digest it gave (a buffer shared again without a
    /// fence, or with the same one, takes it as it is).
    last: Option<(Option<FenceHandle>, HandleDigest)>,
}

impl fmt::Debug for SealPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealPrefix")
            .field("fields", &self.fields)
            .finish_non_exhaustive()
    }
}

impl SealPrefix {
    /// The seal of `handle` up to its fence, under `key`.
    pub fn new(handle: &HandleMsg, key: &HandleKey) -> Self {
        let mut hasher = SealHasher::new(key);
        // Encoding plain data cannot fail (as in `compute_digest`).
        let _ = bincode::serde::encode_into_writer(handle.prefix(), &mut hasher, SEAL_ENCODING);
        hasher.flush();
        Self {
            key: key.clone(),
            fields: handle.clone(),
            hasher: hasher.hasher,
            last: None,
        }
    }

    /// Seals `handle` when it is this one's handle but for its fence (and digest), under
    /// the same key; returns whether it did (else `handle` is left as it was).
    pub fn seal(&mut self, handle: &mut HandleMsg, key: &HandleKey) -> bool {
        if self.key != *key || !self.fields.same_but_fence(handle) {
            return false;
        }
        if let Some((fence, digest)) = &self.last {
            if *fence == handle.fence {
                handle.digest = *digest;
                return true;
            }
        }
        let mut hasher = SealHasher {
            hasher: self.hasher.clone(),
            buf: [0; SEAL_BUF],
            len: 0,
        };
        let _ = bincode::serde::encode_into_writer(handle.fence, &mut hasher, SEAL_ENCODING);
        handle.digest = HandleDigest(*hasher.finalize().as_bytes());
        self.last = Some((handle.fence, handle.digest));
        true
    }
}

impl bincode::enc::write::Writer for SealHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) -> std::result::Result<(), bincode::error::EncodeError> {
        // Most writes are one byte (a tag, a small integer): no `memcpy`.
        if let ([b], Some(slot)) = (bytes, self.buf.get_mut(self.len)) {
            *slot = *b;
            self.len += 1;
            return Ok(());
        }
        if self.len + bytes.len() > SEAL_BUF {
            self.hasher.update(&self.buf[..self.len]);
            self.len = 0;
        }
        if bytes.len() > SEAL_BUF {
            self.hasher.update(bytes);
        } else {
            self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
            self.len += bytes.len();
        }
        Ok(())
    }
}

impl HandleMsg {
    /// The fields the digest covers before the fence, in order.
    #[expect(
        clippy::type_complexity,
        reason = "the sealed fields, borrowed as a tuple to encode"
    )]
    fn prefix(
        &self,
    ) -> (
        &u8,
        &ExporterId,
        &AllocationId,
        &Generation,
        &BackendKind,
        &DeviceUuid,
        &u64,
        &u64,
        &u64,
        &Option<Layout>,
        &RawHandle,
    ) {
        (
            &self.version,
            &self.exporter,
            &self.alloc,
            &self.generation,
            &self.backend,
            &self.device,
            &self.alloc_size,
            &self.offset,
            &self.len,
            &self.layout,
            &self.raw,
        )
    }

    /// Whether every field before the fence is `other`'s.
    fn same_but_fence(&self, other: &HandleMsg) -> bool {
        // Destructured: a field added to the handle must be added here.
        let HandleMsg {
            version,
            exporter,
            alloc,
            generation,
            backend,
            device,
            alloc_size,
            offset,
            len,
            layout,
            raw,
            fence: _,
            digest: _,
        } = self;
        *version == other.version
            && *exporter == other.exporter
            && *alloc == other.alloc
            && *generation == other.generation
            && *backend == other.backend
            && *device == other.device
            && *alloc_size == other.alloc_size
            && *offset == other.offset
            && *len == other.len
            && *layout == other.layout
            && *raw == other.raw
    }

    fn compute_digest(&self, key: &HandleKey) -> HandleDigest {
        // A tuple encodes as its fields one after the other, nested or not: the same
        // bytes as the flat tuple of every field, the fence last.
        let body = (self.prefix(), &self.fence);
        // The encoding goes into the keyed hasher as it is written (`SealHasher`: the
        // digest is the one over the encoded bytes, and sealing allocates nothing).
        // Encoding plain data cannot fail; had it, the bytes written so far are keyed.
        let mut hasher = SealHasher::new(key);
        let _ = bincode::serde::encode_into_writer(body, &mut hasher, SEAL_ENCODING);
        HandleDigest(*hasher.finalize().as_bytes())
    }

    /// Computes and stores the digest over all other fields.
    pub fn seal(&mut self, key: &HandleKey) {
        self.digest = self.compute_digest(key);
    }

    /// The handle with its digest computed.
    pub fn sealed(mut self, key: &HandleKey) -> Self {
        self.seal(key);
        self
    }

    /// Checks the handle's internal consistency: version, a non-empty byte range inside
    /// the allocation, a layout that covers exactly that range, a raw handle of its
    /// backend's kind.
    ///
    /// # Errors
    /// [`Error::UnsupportedVersion`], [`Error::HandleOutOfBounds`],
    /// [`Error::LayoutMismatch`] or [`Error::BackendMismatch`].
    pub fn validate(&self) -> Result<()> {
        if self.version != PROTOCOL_VERSION {
            return Err(Error::UnsupportedVersion {
                got: self.version,
                supported: PROTOCOL_VERSION,
            });
        }
        let in_bounds = self
            .offset
            .checked_add(self.len)
            .is_some_and(|end| end <= self.alloc_size);
        if self.len == 0 || !in_bounds {
            return Err(Error::HandleOutOfBounds {
                offset: self.offset,
                len: self.len,
                alloc_size: self.alloc_size,
            });
        }
        if let Some(layout) = &self.layout {
            let layout_bytes = layout.byte_len();
            if layout_bytes != Some(self.len) {
                return Err(Error::LayoutMismatch {
                    layout_bytes,
                    len: self.len,
                });
            }
        }
        let fence_allowed = self.backend != BackendKind::Host || self.fence.is_none();
        if !self.raw.fits(self.backend) || !fence_allowed {
            return Err(Error::BackendMismatch {
                backend: self.backend,
                raw: self.raw.kind_name(),
            });
        }
        Ok(())
    }

    /// Verifies the digest under `key`, in constant time.
    ///
    /// # Errors
    /// [`Error::DigestMismatch`] if any field differs from what was sealed, or the handle
    /// was sealed under another key.
    pub fn verify(&self, key: &HandleKey) -> Result<()> {
        let expected = blake3::Hash::from_bytes(self.compute_digest(key).0);
        if expected == blake3::Hash::from_bytes(self.digest.0) {
            Ok(())
        } else {
            Err(Error::DigestMismatch)
        }
    }

    /// [`verify`](Self::verify) then [`validate`](Self::validate): what an importer does
    /// with every handle before it opens it.
    ///
    /// # Errors
    /// As those two.
    pub fn check(&self, key: &HandleKey) -> Result<()> {
        self.verify(key)?;
        self.validate()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ids::{ActorId, BootId, ProcessId};
    use crate::layout::{DType, Shape};

    pub(crate) fn sample(raw: RawHandle) -> HandleMsg {
        HandleMsg {
            version: PROTOCOL_VERSION,
            exporter: ExporterId {
                process: ProcessId {
                    boot: BootId([7; 16]),
                    pid: 4242,
                    start_ticks: 99,
                },
                actor: ActorId::new(3),
            },
            alloc: AllocationId::new(17),
            generation: Generation::FIRST,
            backend: raw.backend().unwrap_or(BackendKind::Host),
            device: DeviceUuid::HOST,
            alloc_size: 4096,
            offset: 1024,
            len: 2048,
            layout: Some(Layout::new(DType::F32, Shape::new([16, 32]).unwrap())),
            raw,
            fence: None,
            digest: HandleDigest::default(),
        }
    }

    fn key() -> HandleKey {
        HandleKey::derive(&SessionToken::from_bytes([1; 32]))
    }

    #[test]
    fn the_seal_hasher_hashes_what_was_written_however_it_is_cut() {
        use bincode::enc::write::Writer;
        let key = key();
        let mut all = Vec::new();
        let mut hasher = SealHasher::new(&key);
        for (i, n) in [1, 511, 2, 600, 3, 512, 0, 5, 509, 4]
            .into_iter()
            .enumerate()
        {
            let bytes: Vec<u8> = (0..n).map(|b| (b * 7 + i) as u8).collect();
            hasher.write(&bytes).unwrap();
            all.extend_from_slice(&bytes);
        }
        assert_eq!(hasher.finalize(), blake3::keyed_hash(&key.0, &all));
    }

    #[test]
    fn sealed_handle_checks() {
        let h = sample(RawHandle::HostSegment(
            SegmentName::new("/baton.x").unwrap(),
        ))
        .sealed(&key());
        h.check(&key()).unwrap();
        let other = HandleKey::derive(&SessionToken::from_bytes([2; 32]));
        assert!(matches!(h.verify(&other), Err(Error::DigestMismatch)));
    }

    #[test]
    fn every_single_byte_flip_of_a_cuda_handle_is_caught() {
        let h = sample(RawHandle::CudaIpc(CudaIpcMemHandle([0x5a; 64]))).sealed(&key());
        for i in 0..64 {
            let mut bad = h.clone();
            let RawHandle::CudaIpc(raw) = &mut bad.raw else {
                unreachable!()
            };
            raw.0[i] ^= 0x01;
            assert!(
                matches!(bad.verify(&key()), Err(Error::DigestMismatch)),
                "byte {i}"
            );
        }
    }

    #[test]
    fn validation_refuses_inconsistent_handles() {
        let seg = || RawHandle::HostSegment(SegmentName::new("/baton.x").unwrap());
        let mut h = sample(seg());
        h.offset = 4000;
        assert!(matches!(h.validate(), Err(Error::HandleOutOfBounds { .. })));
        let mut h = sample(seg());
        h.offset = u64::MAX;
        assert!(matches!(h.validate(), Err(Error::HandleOutOfBounds { .. })));
        let mut h = sample(seg());
        h.len = 1000;
        assert!(matches!(h.validate(), Err(Error::LayoutMismatch { .. })));
        let mut h = sample(seg());
        h.backend = BackendKind::CudaLegacy;
        assert!(matches!(h.validate(), Err(Error::BackendMismatch { .. })));
        let mut h = sample(seg());
        h.fence = Some(FenceHandle::Event(IpcEventHandle([0; 64])));
        assert!(matches!(h.validate(), Err(Error::BackendMismatch { .. })));
        let mut h = sample(seg());
        h.version = 9;
        assert!(matches!(
            h.validate(),
            Err(Error::UnsupportedVersion { .. })
        ));
    }

    #[test]
    fn a_memfd_handle_is_host_memory_with_a_sealed_slot() {
        let raw = RawHandle::HostMemfd { slot: Some(2) };
        assert_eq!(raw.backend(), Some(BackendKind::Host));
        assert_eq!(raw.fd_slot(), Some(2));
        assert_eq!(raw.kind_name(), "host memfd");
        assert_eq!(format!("{raw:?}"), "HostMemfd { slot: Some(2) }");
        assert_eq!(RawHandle::HostMemfd { slot: None }.fd_slot(), None);
        let h = sample(raw).sealed(&key());
        h.check(&key()).unwrap();
        // The slot is sealed: a relay cannot point the importer at another descriptor.
        let mut moved = h.clone();
        moved.raw = RawHandle::HostMemfd { slot: Some(0) };
        assert!(matches!(moved.verify(&key()), Err(Error::DigestMismatch)));
        let mut cuda = sample(RawHandle::HostMemfd { slot: None });
        cuda.backend = BackendKind::CudaVmm;
        assert!(matches!(
            cuda.validate(),
            Err(Error::BackendMismatch { .. })
        ));
    }

    #[test]
    fn debug_never_prints_raw_bytes() {
        let h = sample(RawHandle::CudaIpc(CudaIpcMemHandle([0xee; 64])));
        let s = format!("{h:?}");
        assert!(
            !s.contains("238") && !s.to_lowercase().contains("ee, "),
            "{s}"
        );
        assert!(s.contains("redacted"));
        let s = format!("{:?}", SegmentName::new("/baton.secret").unwrap());
        assert!(!s.contains("secret"));
    }

    #[test]
    fn pool_handles_name_their_kind_and_slot_and_hide_their_bytes() {
        let raw = RawHandle::CudaPool {
            pool: 7,
            pool_slot: Some(2),
            ptr: CudaPoolExportData([0xee; 64]),
        };
        assert_eq!(raw.backend(), Some(BackendKind::CudaPool));
        assert_eq!(raw.fd_slot(), Some(2));
        assert_eq!(raw.kind_name(), "CUDA pool pointer");
        let h = sample(raw).sealed(&key());
        h.check(&key()).unwrap();
        let s = format!("{h:?}");
        assert!(
            s.contains("pool: 7") && s.contains("pool_slot: Some(2)"),
            "{s}"
        );
        assert!(
            !s.contains("238") && !s.to_lowercase().contains("ee, "),
            "{s}"
        );
        let none = RawHandle::CudaPool {
            pool: 7,
            pool_slot: None,
            ptr: CudaPoolExportData([0; 64]),
        };
        assert_eq!(none.fd_slot(), None);
        // Each byte of the export data is sealed.
        for i in [0, 31, 63] {
            let mut bad = h.clone();
            let RawHandle::CudaPool { ptr, .. } = &mut bad.raw else {
                unreachable!()
            };
            ptr.0[i] ^= 1;
            assert!(matches!(bad.verify(&key()), Err(Error::DigestMismatch)));
        }
        let mut other_pool = h.clone();
        let RawHandle::CudaPool { pool, .. } = &mut other_pool.raw else {
            unreachable!()
        };
        *pool += 1;
        assert!(matches!(
            other_pool.verify(&key()),
            Err(Error::DigestMismatch)
        ));
    }

    /// Handles whose seals are pinned by [`seals_are_pinned`]: every kind of field, large
    /// integers (multi-byte varints), a layout, both kinds of fence.
    fn pinned_handles() -> Vec<HandleMsg> {
        let mut pool = sample(RawHandle::CudaPool {
            pool: 300,
            pool_slot: Some(2),
            ptr: CudaPoolExportData(std::array::from_fn(|i| i as u8)),
        });
        pool.device = DeviceUuid([0xab; 16]);
        pool.alloc_size = 1 << 40;
        pool.offset = 70_000;
        pool.len = (1 << 40) - 70_000;
        pool.layout = None;
        pool.fence = Some(FenceHandle::Counter(crate::fence::CounterFence {
            slab: CudaIpcMemHandle([0x11; 64]),
            slab_id: u64::MAX,
            offset: 256,
            value: 1 << 33,
        }));
        let mut ipc = sample(RawHandle::CudaIpc(CudaIpcMemHandle([0x5a; 64])));
        ipc.generation = Generation::FIRST.next().next();
        ipc.fence = Some(FenceHandle::Event(IpcEventHandle([0xc3; 64])));
        vec![
            sample(RawHandle::HostSegment(
                SegmentName::new("/baton.pinned-1").unwrap(),
            )),
            sample(RawHandle::HostMemfd { slot: Some(4) }),
            sample(RawHandle::CudaVmmFd { slot: None }),
            pool,
            ipc,
        ]
    }

    /// The seal's encoding is pinned: the digest input, and so every handle on the wire, is
    /// byte for byte what it was (the handle's protocol version is part of it: these are
    /// version 4's, whose byte arrays are byte strings; version 2's were computed before
    /// the seal had an encoding of its own).
    /// A change here changes what peers of another build accept.
    #[test]
    fn seals_are_pinned() {
        let pinned = [
            "f71420a6905ecf4a8a4d91ac32dfa9fdae972d75ee4d1752605c5bc54135960c",
            "78317c051c55eb3d48b6211026e36ddb881f65446f70bb082eff8b418271f566",
            "c3d765f16747bc1786b81ef812a368e759d3dd43a26baebdf2b222fed9e43f25",
            "b9d422463b2548b88f09019401907b45a58dfab1ba10f69b3cff0a20ec64194e",
            "2538e2479756400f818a3a787cadf055e6c5f222e963cfb90622a5b63582422b",
        ];
        let got: Vec<String> = pinned_handles()
            .into_iter()
            .map(|h| {
                let digest = h.sealed(&key()).digest.0;
                digest.iter().map(|b| format!("{b:02x}")).collect()
            })
            .collect();
        assert_eq!(got, pinned);
    }

    proptest::proptest! {
        /// A seal prefix seals a handle of the same buffer (any fence, or none) with the
        /// digest `seal` computes, and leaves any other handle, or another key's, alone.
        #[test]
        fn a_seal_prefix_seals_as_seal_does_and_only_its_own_buffer(
            handle: HandleMsg,
            fence: Option<FenceHandle>,
            other: HandleMsg,
        ) {
            let key = key();
            let mut prefix = SealPrefix::new(&handle, &key);
            // Twice each (the second takes the last digest): with the fence, without one,
            // with the fence again.
            for fence in [fence, fence, None, None, fence] {
                let mut again = handle.clone();
                again.fence = fence;
                again.digest = HandleDigest::default();
                proptest::prop_assert!(prefix.seal(&mut again, &key));
                proptest::prop_assert_eq!(again.digest, again.clone().sealed(&key).digest);
                proptest::prop_assert!(again.verify(&key).is_ok());
            }
            let mut theirs = other.clone();
            let same = handle.same_but_fence(&other);
            proptest::prop_assert_eq!(prefix.seal(&mut theirs, &key), same);
            if !same {
                proptest::prop_assert_eq!(&theirs, &other);
            }
            let stranger = HandleKey::derive(&SessionToken::from_bytes([3; 32]));
            let mut keyed = handle.clone();
            proptest::prop_assert!(!prefix.seal(&mut keyed, &stranger));
        }
    }

    #[test]
    fn a_seal_prefix_refuses_a_handle_that_differs_in_any_field_before_the_fence() {
        let key = key();
        let handle = sample(RawHandle::HostSegment(
            SegmentName::new("/baton.x").unwrap(),
        ));
        let mut prefix = SealPrefix::new(&handle, &key);
        let changes: [fn(&mut HandleMsg); 11] = [
            |h| h.version += 1,
            |h| h.exporter.actor = ActorId::new(h.exporter.actor.get() + 1),
            |h| h.alloc = AllocationId::new(h.alloc.get() + 1),
            |h| h.generation = h.generation.next(),
            |h| h.backend = BackendKind::CudaLegacy,
            |h| h.device = DeviceUuid([9; 16]),
            |h| h.alloc_size += 1,
            |h| h.offset += 1,
            |h| h.len += 1,
            |h| h.layout = None,
            |h| h.raw = RawHandle::HostSegment(SegmentName::new("/baton.y").unwrap()),
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut changed = handle.clone();
            change(&mut changed);
            assert!(!prefix.seal(&mut changed, &key), "field {i}");
        }
    }
}
