//! Length-prefixed frames.
//!
//! ```text
//! offset  size  field
//! 0       2     magic "Bt"
//! 2       1     protocol version
//! 3       1     number of file descriptors sent beside this frame (SCM_RIGHTS)
//! 4       4     payload length, little endian, at most MAX_FRAME_LEN
//! 8       len   payload: one bincode-encoded Message
//! ```
//!
//! The header is checked as soon as its 8 bytes arrive, so a bad magic, an unknown version
//! or a length of 4 GiB is refused before any payload is buffered. Payloads are decoded
//! with bincode under a byte limit of [`MAX_FRAME_LEN`], so a lying length inside the
//! payload cannot make the decoder allocate more than that, and a payload must be consumed
//! exactly. After any error the stream is out of sync: drop the connection.
//!
//! A handoff's messages (a call, a reply with a payload, a release) are encoded and
//! decoded by a hand-written codec first (`hot`): the same bytes and the same messages as
//! serde's, or nothing, and then serde does it.

use crate::protocol::{CallRef, Message};
use crate::{Error, PROTOCOL_VERSION, Result};
use serde::Serialize;

/// Bytes of a frame header.
pub const HEADER_LEN: usize = 8;
/// The first two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"Bt";
/// The largest payload a frame may carry (1 MiB). Handle messages are a few hundred bytes;
/// bulk data belongs in shared buffers, not inline.
pub const MAX_FRAME_LEN: usize = 1 << 20;
/// The most file descriptors one frame may carry: Linux's limit for one `SCM_RIGHTS`
/// message (`SCM_MAX_FD`). A message sharing many VMM buffers needs one per buffer (a
/// renderer worker's reply carries one per tile).
pub const MAX_FDS_PER_FRAME: usize = 253;

type Config = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<MAX_FRAME_LEN>,
>;

/// The bincode configuration of every Baton payload.
pub(crate) const fn config() -> Config {
    bincode::config::standard().with_limit::<MAX_FRAME_LEN>()
}

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Protocol version of the payload.
    pub version: u8,
    /// File descriptors sent beside the frame.
    pub nfds: u8,
    /// Payload bytes.
    pub len: u32,
}

impl FrameHeader {
    /// Parses and checks a header.
    ///
    /// # Errors
    /// [`Error::BadMagic`], [`Error::UnsupportedVersion`], [`Error::TooManyFds`] or
    /// [`Error::FrameTooLarge`].
    pub fn parse(bytes: &[u8; HEADER_LEN]) -> Result<Self> {
        if bytes[..2] != MAGIC {
            return Err(Error::BadMagic {
                got: [bytes[0], bytes[1]],
            });
        }
        let header = FrameHeader {
            version: bytes[2],
            nfds: bytes[3],
            len: u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
        };
        if header.version != PROTOCOL_VERSION {
            return Err(Error::UnsupportedVersion {
                got: header.version,
                supported: PROTOCOL_VERSION,
            });
        }
        if usize::from(header.nfds) > MAX_FDS_PER_FRAME {
            return Err(Error::TooManyFds {
                nfds: header.nfds,
                max: MAX_FDS_PER_FRAME,
            });
        }
        if header.len as usize > MAX_FRAME_LEN {
            return Err(Error::FrameTooLarge {
                len: header.len.into(),
                max: MAX_FRAME_LEN,
            });
        }
        Ok(header)
    }

    /// The header's bytes.
    pub fn to_bytes(self) -> [u8; HEADER_LEN] {
        let len = self.len.to_le_bytes();
        [
            MAGIC[0],
            MAGIC[1],
            self.version,
            self.nfds,
            len[0],
            len[1],
            len[2],
            len[3],
        ]
    }
}

/// Appends one frame holding `msg`, announcing `nfds` file descriptors, to `out`.
///
/// # Errors
/// [`Error::TooManyFds`], [`Error::FrameTooLarge`] or [`Error::Encode`]; `out` is left as
/// it was.
pub fn encode_frame(msg: &Message, nfds: usize, out: &mut Vec<u8>) -> Result<()> {
    encode_frame_of(msg, |out| crate::hot::encode(msg, out), nfds, out)
}

/// Appends one frame holding a [`Message::Call`] of borrowed parts to `out`: the same
/// bytes as [`encode_frame`] of the owned call, without copying the parts first.
///
/// # Errors
/// As [`encode_frame`].
pub fn encode_call_frame(call: CallRef<'_>, nfds: usize, out: &mut Vec<u8>) -> Result<()> {
    encode_frame_of(&call, |out| crate::hot::encode_call(call, out), nfds, out)
}

/// [`encode_frame`] of anything that serializes as a [`Message`]: written by `hot` (the
/// hand-written encoder of a handoff's messages, which writes serde's bytes or nothing),
/// else by serde.
fn encode_frame_of<M: Serialize + ?Sized>(
    msg: &M,
    hot: impl FnOnce(&mut Vec<u8>) -> bool,
    nfds: usize,
    out: &mut Vec<u8>,
) -> Result<()> {
    let nfds_u8 = u8::try_from(nfds)
        .ok()
        .filter(|&n| usize::from(n) <= MAX_FDS_PER_FRAME)
        .ok_or(Error::TooManyFds {
            nfds: nfds.min(255) as u8,
            max: MAX_FDS_PER_FRAME,
        })?;
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_LEN]);
    let encoded = if hot(out) {
        Ok(())
    } else {
        bincode::serde::encode_into_writer(msg, VecWriter(out), config())
    };
    let len = out.len() - start - HEADER_LEN;
    match encoded {
        Ok(_) if len <= MAX_FRAME_LEN => {
            let header = FrameHeader {
                version: PROTOCOL_VERSION,
                nfds: nfds_u8,
                len: len as u32,
            };
            out[start..start + HEADER_LEN].copy_from_slice(&header.to_bytes());
            Ok(())
        }
        Ok(_) => {
            out.truncate(start);
            Err(Error::FrameTooLarge {
                len: len as u64,
                max: MAX_FRAME_LEN,
            })
        }
        Err(e) => {
            out.truncate(start);
            Err(Error::Encode(e.to_string()))
        }
    }
}

/// bincode's writer into a `Vec`: serde hands bincode a frame a field, and a byte array a
/// byte, at a time (a handle's 64-byte raw handle and fence are 64 writes each), so a write
/// of a byte or a few is pushed in place rather than through `io::Write` and a `memcpy`.
struct VecWriter<'a>(&'a mut Vec<u8>);

impl bincode::enc::write::Writer for VecWriter<'_> {
    #[inline]
    fn write(&mut self, bytes: &[u8]) -> std::result::Result<(), bincode::error::EncodeError> {
        match *bytes {
            [b] => self.0.push(b),
            _ => self.0.extend_from_slice(bytes),
        }
        Ok(())
    }
}

/// Encodes one frame into a new buffer. See [`encode_frame`].
///
/// # Errors
/// As [`encode_frame`].
pub fn frame_bytes(msg: &Message, nfds: usize) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(256);
    encode_frame(msg, nfds, &mut out)?;
    Ok(out)
}

/// Decodes one payload, which must hold exactly one message.
///
/// A handoff's messages (a call, a reply with a payload, a release) are read by a
/// hand-written decoder (`hot`), which returns what serde would or nothing; everything
/// else, and anything it does not take, is decoded with serde.
///
/// # Errors
/// [`Error::FrameTooLarge`], [`Error::Decode`] or [`Error::TrailingBytes`].
pub fn decode_payload(payload: &[u8]) -> Result<Message> {
    if payload.len() > MAX_FRAME_LEN {
        return Err(Error::FrameTooLarge {
            len: payload.len() as u64,
            max: MAX_FRAME_LEN,
        });
    }
    match crate::hot::decode(payload) {
        Some(msg) => Ok(msg),
        None => decode_with_serde(payload),
    }
}

/// [`decode_payload`] through serde alone.
fn decode_with_serde(payload: &[u8]) -> Result<Message> {
    let (msg, used) = bincode::serde::decode_from_slice::<Message, _>(payload, config())
        .map_err(|e| Error::Decode(e.to_string()))?;
    match payload.len() - used {
        0 => Ok(msg),
        extra => Err(Error::TrailingBytes(extra)),
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Its header (for the number of file descriptors that came with it).
    pub header: FrameHeader,
    /// Its message.
    pub message: Message,
}

/// Turns a byte stream into frames. Sans I/O: feed it what the socket returned.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    /// Received bytes live in `buf[start..end]`; `buf[end..]` is zeroed spare room that
    /// only grows, so receiving in place never re-zeroes memory.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    header: Option<FrameHeader>,
}

impl FrameDecoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.spare(bytes.len())[..bytes.len()].copy_from_slice(bytes);
        self.commit(bytes.len());
    }

    /// A writable tail of at least `min` bytes to receive into; then call
    /// [`commit`](Self::commit) with the count actually written.
    pub fn spare(&mut self, min: usize) -> &mut [u8] {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > 0 && self.buf.len() - self.end < min {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.buf.len() - self.end < min {
            self.buf.resize(self.end + min, 0);
        }
        &mut self.buf[self.end..]
    }

    /// Marks `n` bytes of the tail from [`spare`](Self::spare) as received.
    pub fn commit(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }

    /// Bytes received but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed.
    ///
    /// # Errors
    /// Any header or payload error; the stream cannot be resynchronised after one.
    pub fn next_frame(&mut self) -> Result<Option<Frame>> {
        let header = match self.header {
            Some(h) => h,
            None => {
                if self.buffered() < HEADER_LEN {
                    return Ok(None);
                }
                let mut bytes = [0u8; HEADER_LEN];
                bytes.copy_from_slice(&self.buf[self.start..self.start + HEADER_LEN]);
                let header = FrameHeader::parse(&bytes)?;
                self.start += HEADER_LEN;
                self.header = Some(header);
                header
            }
        };
        let end = self.start + header.len as usize;
        if end > self.end {
            return Ok(None);
        }
        let message = decode_payload(&self.buf[self.start..end])?;
        self.start = end;
        self.header = None;
        Ok(Some(Frame { header, message }))
    }

    /// Call at end of stream: fails if a frame was cut off.
    ///
    /// # Errors
    /// [`Error::Truncated`].
    pub fn finish(&self) -> Result<()> {
        let have = self.buffered();
        match self.header {
            Some(h) => Err(Error::Truncated {
                have: have + HEADER_LEN,
                need: h.len as usize + HEADER_LEN,
            }),
            None if have > 0 => Err(Error::Truncated {
                have,
                need: HEADER_LEN,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LeaseId;
    use crate::handle::{RawHandle, SegmentName};

    #[test]
    fn a_layout_may_take_a_whole_frame_and_no_more() {
        assert_eq!(crate::BundleLayout::MAX_WIRE, MAX_FRAME_LEN);
    }
    use crate::protocol::{Call, Offer, Payload, Release, Reply};
    use proptest::prelude::*;

    #[test]
    fn a_borrowed_call_encodes_as_the_owned_one() {
        let Message::Offer(offer) = offer() else {
            unreachable!()
        };
        for (offers, nfds) in [(vec![], 0), (vec![(*offer).clone(), *offer], 2)] {
            let call = Call {
                id: 300,
                target: "bench.consumer".into(),
                type_name: "bench.Handoff".into(),
                payload: vec![1, 2, 3, 250, 251],
                offers,
            };
            let mut owned = Vec::new();
            encode_frame(&Message::Call(call.clone()), nfds, &mut owned).unwrap();
            let mut borrowed = vec![9];
            let parts = CallRef {
                id: call.id,
                target: &call.target,
                type_name: &call.type_name,
                payload: &call.payload,
                offers: &call.offers,
            };
            encode_call_frame(parts, nfds, &mut borrowed).unwrap();
            assert_eq!(borrowed[1..], owned[..]);
            let mut dec = FrameDecoder::new();
            dec.push(&borrowed[1..]);
            let back = dec.next_frame().unwrap().unwrap();
            assert_eq!(usize::from(back.header.nfds), nfds);
            assert_eq!(back.message, Message::Call(call));
        }
    }

    fn offer() -> Message {
        Message::Offer(Box::new(Offer {
            lease: LeaseId::new(5),
            handle: crate::handle::tests::sample(RawHandle::HostSegment(
                SegmentName::new("/baton.t").unwrap(),
            )),
        }))
    }

    #[test]
    fn frames_split_at_every_byte_decode_the_same() {
        let msgs = [
            offer(),
            Message::Ping(7),
            Message::Release(Release {
                lease: LeaseId::new(9),
                fences: vec![crate::FenceHandle::Event(crate::IpcEventHandle([3; 64]))],
            }),
        ];
        let mut wire = Vec::new();
        for m in &msgs {
            encode_frame(m, 0, &mut wire).unwrap();
        }
        for cut in 0..wire.len() {
            let mut d = FrameDecoder::new();
            let mut got = Vec::new();
            for part in [&wire[..cut], &wire[cut..]] {
                d.push(part);
                while let Some(f) = d.next_frame().unwrap() {
                    got.push(f.message);
                }
            }
            assert_eq!(got, msgs, "cut at {cut}");
            d.finish().unwrap();
        }
    }

    #[test]
    fn header_faults_are_typed() {
        let good = frame_bytes(&Message::Ping(1), 0).unwrap();
        let mut h: [u8; 8] = good[..8].try_into().unwrap();
        h[0] = b'X';
        assert!(matches!(
            FrameHeader::parse(&h),
            Err(Error::BadMagic { .. })
        ));
        let mut h: [u8; 8] = good[..8].try_into().unwrap();
        h[2] = 99;
        assert!(matches!(
            FrameHeader::parse(&h),
            Err(Error::UnsupportedVersion { got: 99, .. })
        ));
        let mut h: [u8; 8] = good[..8].try_into().unwrap();
        h[4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            matches!(FrameHeader::parse(&h), Err(Error::FrameTooLarge { len, .. }) if len == u64::from(u32::MAX))
        );
        let mut h: [u8; 8] = good[..8].try_into().unwrap();
        h[3] = 254;
        assert!(matches!(
            FrameHeader::parse(&h),
            Err(Error::TooManyFds { .. })
        ));
    }

    #[test]
    fn a_4_gib_prefix_is_refused_before_the_payload_arrives() {
        let mut d = FrameDecoder::new();
        let mut h = frame_bytes(&Message::Ping(1), 0).unwrap()[..8].to_vec();
        h[4..].copy_from_slice(&u32::MAX.to_le_bytes());
        d.push(&h);
        assert!(matches!(d.next_frame(), Err(Error::FrameTooLarge { .. })));
    }

    #[test]
    fn truncation_and_trailing_bytes_are_typed() {
        let wire = frame_bytes(&offer(), 0).unwrap();
        let mut d = FrameDecoder::new();
        d.push(&wire[..wire.len() - 3]);
        assert!(d.next_frame().unwrap().is_none());
        assert!(matches!(d.finish(), Err(Error::Truncated { .. })));

        let mut payload = wire[HEADER_LEN..].to_vec();
        payload.push(0);
        assert!(matches!(
            decode_payload(&payload),
            Err(Error::TrailingBytes(1))
        ));
    }

    #[test]
    fn a_lying_inner_length_is_refused_without_allocating_it() {
        // Take a valid Offer and make the segment name's length prefix claim 2^60 bytes.
        let wire = frame_bytes(&offer(), 0).unwrap();
        let payload = &wire[HEADER_LEN..];
        let name = b"\x08/baton.t";
        let at = payload.windows(name.len()).position(|w| w == name).unwrap();
        let mut lying = payload[..at].to_vec();
        lying.push(0xfd); // bincode varint: a u64 follows
        lying.extend_from_slice(&(1u64 << 60).to_le_bytes());
        lying.extend_from_slice(&payload[at + 1..]);
        assert!(matches!(decode_payload(&lying), Err(Error::Decode(_))));
    }

    #[test]
    fn a_byte_array_of_another_length_is_refused() {
        // The handle's boot id (16 bytes of 7) travels as a length and its bytes. As 15
        // or 17 bytes, the rest of the payload intact (only the length check can refuse
        // it), or claiming 2^60: a decode error, never a short or padded id.
        let wire = frame_bytes(&offer(), 0).unwrap();
        let payload = &wire[HEADER_LEN..];
        let mut boot = vec![16u8];
        boot.extend([7u8; 16]);
        let at = payload.windows(boot.len()).position(|w| w == boot).unwrap();
        let rest = &payload[at + boot.len()..];
        let mut huge = vec![0xfd];
        huge.extend_from_slice(&(1u64 << 60).to_le_bytes());
        huge.extend([7u8; 16]);
        for id in [
            [&[15u8][..], &[7; 15]].concat(),
            [&[17u8][..], &[7; 17]].concat(),
            huge,
        ] {
            let lying = [&payload[..at], &id, rest].concat();
            assert!(
                matches!(decode_payload(&lying), Err(Error::Decode(_))),
                "a boot id written as {id:?} decoded"
            );
        }
        assert_eq!(decode_payload(payload).unwrap(), offer());
    }

    #[test]
    fn spare_and_commit_receive_in_place() {
        let wire = frame_bytes(&Message::Pong(3), 0).unwrap();
        let mut d = FrameDecoder::new();
        let spare = d.spare(64);
        assert!(spare.len() >= 64);
        spare[..wire.len()].copy_from_slice(&wire);
        d.commit(wire.len());
        assert_eq!(d.next_frame().unwrap().unwrap().message, Message::Pong(3));
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn encoding_too_many_fds_is_refused() {
        let mut out = vec![1, 2, 3];
        assert!(matches!(
            encode_frame(&Message::Ping(0), MAX_FDS_PER_FRAME + 1, &mut out),
            Err(Error::TooManyFds { .. })
        ));
        assert_eq!(out, [1, 2, 3]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn every_message_round_trips(msg in any::<Message>(), nfds in 0usize..=MAX_FDS_PER_FRAME) {
            let wire = frame_bytes(&msg, nfds).unwrap();
            let mut d = FrameDecoder::new();
            d.push(&wire);
            let frame = d.next_frame().unwrap().unwrap();
            prop_assert_eq!(frame.message, msg);
            prop_assert_eq!(usize::from(frame.header.nfds), nfds);
            prop_assert!(d.next_frame().unwrap().is_none());
        }

        #[test]
        fn random_payloads_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode_payload(&bytes);
        }

        #[test]
        fn random_streams_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let mut d = FrameDecoder::new();
            d.push(&bytes);
            while let Ok(Some(_)) = d.next_frame() {}
            let _ = d.finish();
        }

        #[test]
        fn valid_header_with_random_payload_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
            let mut wire = FrameHeader { version: PROTOCOL_VERSION, nfds: 0, len: bytes.len() as u32 }.to_bytes().to_vec();
            wire.extend_from_slice(&bytes);
            let mut d = FrameDecoder::new();
            d.push(&wire);
            let _ = d.next_frame();
        }
    }

    // The hand-written decoder of a handoff's messages against serde's (see `hot`).

    fn hot_encode(msg: &Message) -> Vec<u8> {
        bincode::serde::encode_to_vec(msg, config()).unwrap()
    }

    /// Whether `decode` agrees with serde on `payload`: the same message, or nothing.
    fn hot_agrees(payload: &[u8]) -> Result<(), TestCaseError> {
        if let Some(fast) = crate::hot::decode(payload) {
            let serde = decode_with_serde(payload);
            prop_assert!(
                serde.is_ok(),
                "serde refused what the hot decoder took: {serde:?}"
            );
            prop_assert_eq!(fast, serde.unwrap());
        }
        Ok(())
    }

    /// A handoff's messages: a call or a reply with offers, a release with fences.
    fn handoff_message() -> impl Strategy<Value = Message> {
        let offers = proptest::collection::vec(any::<Offer>(), 0..4);
        prop_oneof![
            (any::<Call>(), offers.clone()).prop_map(|(mut call, offers)| {
                call.offers = offers;
                Message::Call(call)
            }),
            (any::<u64>(), any::<Vec<u8>>(), offers).prop_map(|(id, bytes, offers)| {
                Message::Reply(Reply {
                    id,
                    outcome: Ok(Payload { bytes, offers }),
                })
            }),
            any::<Release>().prop_map(Message::Release),
        ]
    }

    proptest! {
        #[test]
        fn every_message_decodes_as_serde_decodes_it(msg in any::<Message>()) {
            let payload = hot_encode(&msg);
            hot_agrees(&payload)?;
            if let Some(fast) = crate::hot::decode(&payload) {
                prop_assert_eq!(fast, msg);
            }
        }

        #[test]
        fn a_handoffs_messages_are_all_decoded_here(msg in handoff_message()) {
            let payload = hot_encode(&msg);
            // Unless they carry a copy handle (serde's, by design).
            let copies = match &msg {
                Message::Call(c) => c.offers.iter().any(|o| matches!(o.handle.raw, RawHandle::Copy { .. })),
                Message::Reply(r) => r.outcome.as_ref().is_ok_and(|p| p.offers.iter().any(|o| matches!(o.handle.raw, RawHandle::Copy { .. }))),
                _ => false,
            };
            let fast = crate::hot::decode(&payload);
            prop_assert_eq!(fast.is_some(), !copies);
            if let Some(fast) = fast {
                prop_assert_eq!(fast, msg);
            }
        }

        #[test]
        fn mutated_messages_decode_as_serde_decodes_them(
            msg in handoff_message(),
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
            cut in any::<prop::sample::Index>(),
            grow in proptest::collection::vec(any::<u8>(), 0..3),
        ) {
            let mut payload = hot_encode(&msg);
            for (at, byte) in &edits {
                let i = at.index(payload.len());
                payload[i] = *byte;
            }
            hot_agrees(&payload)?;
            hot_agrees(&payload[..cut.index(payload.len())])?;
            payload.extend(grow);
            hot_agrees(&payload)?;
        }

        #[test]
        fn random_bytes_decode_as_serde_decodes_them(
            head in prop_oneof![Just(crate::hot::CALL as u8), Just(crate::hot::REPLY as u8), Just(crate::hot::RELEASE as u8), any::<u8>()],
            rest in proptest::collection::vec(any::<u8>(), 0..512),
        ) {
            let mut payload = vec![head];
            payload.extend(rest);
            hot_agrees(&payload)?;
        }
    }

    #[test]
    fn every_one_byte_change_of_a_handoffs_message_decodes_as_serde_decodes_it() {
        // Exhaustive where random edits are thin: each byte of a few messages, every value
        // (an `Option` tag of 2, a variant past the last, a length one off, …).
        use proptest::strategy::ValueTree;
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let strategy = handoff_message();
        let mut messages = Vec::new();
        while messages.len() < 6 {
            let msg = strategy.new_tree(&mut runner).unwrap().current();
            // Those the hot decoder takes (no copy handle), each kind twice.
            let payload = hot_encode(&msg);
            let kind = payload[0];
            if crate::hot::decode(&payload).is_some()
                && messages.iter().filter(|(k, _)| *k == kind).count() < 2
            {
                messages.push((kind, payload));
            }
        }
        for (_, payload) in &messages {
            for i in 0..payload.len() {
                let mut changed = payload.clone();
                for byte in 0..=u8::MAX {
                    changed[i] = byte;
                    hot_agrees(&changed).unwrap();
                }
            }
        }
    }

    proptest! {
        #[test]
        fn the_hot_encoder_writes_serdes_bytes(msg in any::<Message>()) {
            let serde = hot_encode(&msg);
            let mut out = vec![7];
            if crate::hot::encode(&msg, &mut out) {
                prop_assert_eq!(&out[1..], &serde[..]);
            } else {
                prop_assert_eq!(out, [7], "nothing written");
            }
        }

        #[test]
        fn the_hot_encoder_writes_every_handoff_message(msg in handoff_message()) {
            let serde = hot_encode(&msg);
            let copies = |offers: &[Offer]| offers.iter().any(|o| matches!(o.handle.raw, RawHandle::Copy { .. }));
            let (hot, borrowed) = match &msg {
                Message::Call(c) => {
                    let mut out = Vec::new();
                    let call = CallRef { id: c.id, target: &c.target, type_name: &c.type_name, payload: &c.payload, offers: &c.offers };
                    let written = crate::hot::encode_call(call, &mut out);
                    prop_assert_eq!(written, !copies(&c.offers));
                    (!copies(&c.offers), Some((written, out)))
                }
                Message::Reply(r) => (r.outcome.as_ref().is_ok_and(|p| !copies(&p.offers)), None),
                _ => (true, None),
            };
            let mut out = Vec::new();
            prop_assert_eq!(crate::hot::encode(&msg, &mut out), hot);
            if hot {
                prop_assert_eq!(&out, &serde);
            } else {
                prop_assert!(out.is_empty());
            }
            if let Some((true, borrowed)) = borrowed {
                prop_assert_eq!(borrowed, serde);
            }
        }
    }

    proptest! {
        #[test]
        fn variant_tags_in_longer_forms_decode_as_serde_decodes_them(msg in handoff_message()) {
            // bincode reads an enum's variant as a u32: the 2- and 4-byte forms are taken,
            // the 8-byte one is refused. The message's tag, and a reply's `Ok`.
            let payload = hot_encode(&msg);
            let forms = |v: u8| -> [Vec<u8>; 3] {
                [vec![251, v, 0], vec![252, v, 0, 0, 0], vec![253, v, 0, 0, 0, 0, 0, 0, 0]]
            };
            for form in forms(payload[0]) {
                let mut longer = form;
                longer.extend_from_slice(&payload[1..]);
                hot_agrees(&longer)?;
            }
            if let Message::Reply(r) = &msg {
                let mut id = Vec::new();
                bincode::serde::encode_into_std_write(r.id, &mut id, config()).unwrap();
                let at = 1 + id.len();
                for form in forms(payload[at]) {
                    let mut longer = payload[..at].to_vec();
                    longer.extend(form);
                    longer.extend_from_slice(&payload[at + 1..]);
                    hot_agrees(&longer)?;
                }
            }
        }
    }
}
