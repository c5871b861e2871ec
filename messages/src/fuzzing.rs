//! The logic of Baton's fuzz targets that need only the wire vocabulary, kept in the
//! library so that the cargo-fuzz targets (`fuzz/fuzz_targets/`) and the ordinary test
//! that replays their corpus (`tests/fuzz_corpus.rs`) run exactly the same code.
//!
//! Not a stable API: hidden from the docs, and only for fuzzing and its replay.
//!
//! Each function takes arbitrary bytes, never panics on any input unless an invariant of
//! the code under test is broken (that panic is the bug the fuzzer reports), and allocates
//! no more than a small multiple of its input.

use crate::codec::{self, FrameDecoder, FrameHeader, HEADER_LEN, MAX_FDS_PER_FRAME, MAX_FRAME_LEN};
use crate::handle::{HandleDigest, HandleKey, HandleMsg, RawHandle};
use crate::ids::SessionToken;
use crate::{Message, PROTOCOL_VERSION};

/// What the frame decoder made of one byte stream: every frame (with its header's
/// descriptor count) until the first error, the error's text, and whether the stream ended
/// cleanly.
#[derive(Debug, PartialEq, Eq)]
struct Decoded {
    frames: Vec<(u8, Message)>,
    error: Option<String>,
    clean_end: bool,
}

/// A tiny deterministic generator, so that chunk boundaries depend only on the input.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Feeds `stream` to a fresh decoder in chunks of the sizes `chunk` picks, the way a socket
/// would deliver it; `in_place` receives through `spare`/`commit` instead of `push`.
fn decode_stream(stream: &[u8], mut chunk: impl FnMut() -> usize, in_place: bool) -> Decoded {
    let mut decoder = FrameDecoder::new();
    let mut frames = Vec::new();
    let mut rest = stream;
    loop {
        loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => {
                    let h = frame.header;
                    assert!(
                        usize::from(h.nfds) <= MAX_FDS_PER_FRAME,
                        "nfds over the limit"
                    );
                    assert!(h.len as usize <= MAX_FRAME_LEN, "length over the limit");
                    frames.push((h.nfds, frame.message));
                }
                Ok(None) => break,
                Err(e) => {
                    return Decoded {
                        frames,
                        error: Some(e.to_string()),
                        clean_end: false,
                    };
                }
            }
        }
        if rest.is_empty() {
            break;
        }
        let n = chunk().clamp(1, rest.len());
        if in_place {
            let spare = decoder.spare(n);
            assert!(spare.len() >= n, "spare() returned less room than asked");
            spare[..n].copy_from_slice(&rest[..n]);
            decoder.commit(n);
        } else {
            decoder.push(&rest[..n]);
        }
        rest = &rest[n..];
        // Buffered bytes never exceed what was fed.
        assert!(decoder.buffered() <= stream.len() - rest.len());
    }
    let clean_end = decoder.finish().is_ok();
    Decoded {
        frames,
        error: None,
        clean_end,
    }
}

/// How far an input got into the `frame_decoder` target: the corpus replay checks that
/// inputs kept as regressions still get as far as they once did, so that a change of the
/// frame format, which would stop them at the header, fails the replay instead of leaving
/// it quietly shallow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FrameDepth {
    /// No stream at all.
    Empty,
    /// Stopped at the first frame's header: too short, or refused (magic, version, limits).
    Header,
    /// Past the first header; stopped in its payload (cut off or malformed).
    Payload,
    /// At least one whole frame decoded (and round-tripped).
    Frames,
}

/// Target `frame_decoder`: the byte stream after the first byte is decoded three ways —
/// whole, in chunks chosen by the first byte, and in place through `spare`/`commit` — and
/// every way must yield the same frames and the same error. Each decoded message must
/// encode again, and decode to itself. Returns how far the stream got.
pub fn frame_decoder(data: &[u8]) -> FrameDepth {
    let Some((&seed, stream)) = data.split_first() else {
        return FrameDepth::Empty;
    };
    let whole = decode_stream(stream, || usize::MAX, false);
    let mut rng = SplitMix(u64::from(seed));
    // Mostly small chunks (a slow socket), sometimes large ones.
    let chunked = decode_stream(
        stream,
        || {
            let r = rng.next();
            if r & 3 == 0 {
                (r >> 8) as usize % 4096 + 1
            } else {
                (r >> 8) as usize % 16 + 1
            }
        },
        false,
    );
    assert_eq!(
        whole, chunked,
        "decoding depends on how the bytes were split"
    );
    let mut rng = SplitMix(u64::from(seed) ^ 0xA5A5);
    let in_place = decode_stream(stream, || (rng.next() % 64) as usize + 1, true);
    assert_eq!(whole, in_place, "spare/commit decode differently from push");

    for (nfds, message) in &whole.frames {
        let wire = codec::frame_bytes(message, usize::from(*nfds))
            .expect("a decoded message encodes again");
        let again = codec::decode_payload(&wire[HEADER_LEN..]).expect("and decodes again");
        assert_eq!(&again, message, "a message did not survive a round trip");
    }
    let header_passes = stream
        .first_chunk::<HEADER_LEN>()
        .is_some_and(|h| FrameHeader::parse(h).is_ok());
    match (whole.frames.is_empty(), header_passes) {
        (false, _) => FrameDepth::Frames,
        (true, true) => FrameDepth::Payload,
        (true, false) if stream.is_empty() => FrameDepth::Empty,
        (true, false) => FrameDepth::Header,
    }
}

/// The key the `handle_msg` target seals with.
pub fn fuzz_handle_key() -> HandleKey {
    HandleKey::derive(&SessionToken::from_bytes([0x5E; 32]))
}

/// Decodes a handle message the way a payload is decoded (bincode under the frame limit).
pub fn decode_handle(bytes: &[u8]) -> Option<HandleMsg> {
    bincode::serde::decode_from_slice::<HandleMsg, _>(bytes, codec::config())
        .ok()
        .map(|(h, _)| h)
}

/// Encodes a handle message as [`decode_handle`] reads it.
pub fn encode_handle(handle: &HandleMsg) -> Vec<u8> {
    bincode::serde::encode_to_vec(handle, codec::config()).expect("plain data encodes")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Target `handle_msg`, message level: decodes a [`HandleMsg`] from `data` and checks what
/// validation and sealing promise. Returns the handle for the transport-level checks.
///
/// - `validate` accepts only a handle of this version whose range is non-empty and inside
///   its allocation, whose layout covers exactly that range, and whose raw handle is of
///   its backend's kind;
/// - an unsealed (or foreign-sealed) handle does not verify; once sealed it does, and any
///   change to a field or to the digest makes it fail again;
/// - `Debug` never prints the raw handle.
pub fn handle_msg(data: &[u8]) -> Option<HandleMsg> {
    let handle = decode_handle(data)?;
    assert_eq!(
        decode_handle(&encode_handle(&handle)).as_ref(),
        Some(&handle),
        "a handle did not survive a round trip"
    );

    if handle.validate().is_ok() {
        assert_eq!(handle.version, PROTOCOL_VERSION);
        assert!(handle.len > 0, "an empty range validated");
        let end = handle.offset.checked_add(handle.len);
        assert!(
            end.is_some_and(|e| e <= handle.alloc_size),
            "an out-of-bounds range validated"
        );
        if let Some(layout) = &handle.layout {
            assert_eq!(
                layout.byte_len(),
                Some(handle.len),
                "a wrong layout validated"
            );
        }
        assert!(
            handle.raw.fits(handle.backend),
            "a raw handle of another backend"
        );
    }

    let key = fuzz_handle_key();
    let sealed = handle.clone().sealed(&key);
    sealed
        .verify(&key)
        .expect("a freshly sealed handle verifies");
    assert_eq!(sealed.check(&key).is_ok(), handle.validate().is_ok());
    if handle.digest != sealed.digest {
        assert!(handle.verify(&key).is_err(), "a wrong digest verified");
    }
    let mut tampered = sealed.clone();
    tampered.digest.0[usize::from(data[0] % 32)] ^= 1;
    assert!(
        tampered.verify(&key).is_err(),
        "a flipped digest bit verified"
    );
    let mut tampered = sealed.clone();
    tampered.offset ^= 1;
    assert!(tampered.verify(&key).is_err(), "a changed offset verified");
    let other = HandleKey::derive(&SessionToken::from_bytes([0x5F; 32]));
    assert!(
        sealed.verify(&other).is_err(),
        "another session's key verified"
    );
    let mut zeroed = sealed.clone();
    zeroed.digest = HandleDigest::default();
    assert!(zeroed.verify(&key).is_err(), "an unsealed handle verified");

    let shown = format!("{handle:?}");
    match &handle.raw {
        RawHandle::CudaIpc(raw) => {
            assert!(
                !shown.contains(&hex(&raw.0[..8])),
                "Debug printed raw bytes"
            );
        }
        RawHandle::CudaPool {
            pool, pool_slot, ..
        } => {
            // Compared whole: the export data's hex could be a run of decimal digits that
            // the pool id happens to contain.
            assert_eq!(
                format!("{:?}", handle.raw),
                format!("CudaPool {{ pool: {pool}, pool_slot: {pool_slot:?}, ptr: <redacted> }}"),
                "Debug printed pool export data"
            );
        }
        RawHandle::HostSegment(name) if name.as_str().len() > 12 => {
            assert!(
                !shown.contains(name.as_str()),
                "Debug printed a segment name"
            );
        }
        _ => {}
    }
    match &handle.fence {
        Some(crate::FenceHandle::Event(event)) => assert!(
            !shown.contains(&hex(&event.0[..8])),
            "Debug printed an event handle"
        ),
        Some(crate::FenceHandle::Counter(counter)) => assert!(
            !shown.contains(&hex(&counter.slab.0[..8])),
            "Debug printed a counter slab handle"
        ),
        None => {}
    }
    Some(handle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle::tests::sample;
    use crate::handle::{CudaIpcMemHandle, CudaPoolExportData, SegmentName};

    #[test]
    fn valid_streams_and_handles_pass() {
        let mut wire = vec![7u8];
        for m in [Message::Ping(1), Message::Pong(2)] {
            codec::encode_frame(&m, 0, &mut wire).unwrap();
        }
        assert_eq!(frame_decoder(&wire), FrameDepth::Frames);
        assert_eq!(frame_decoder(&[]), FrameDepth::Empty);
        assert_eq!(frame_decoder(&[9]), FrameDepth::Empty);
        let huge = [0, b'B', b't', PROTOCOL_VERSION, 0, 0xff, 0xff, 0xff, 0x7f];
        assert_eq!(frame_decoder(&huge), FrameDepth::Header);
        assert_eq!(frame_decoder(&wire[..wire.len() - 1]), FrameDepth::Frames);
        assert_eq!(frame_decoder(&wire[..HEADER_LEN + 2]), FrameDepth::Payload);
        assert_eq!(frame_decoder(b"xGET / HTTP/1.1"), FrameDepth::Header);
        for raw in [
            RawHandle::HostSegment(SegmentName::new("/baton.1.2.3.0123456789abcdef").unwrap()),
            RawHandle::CudaIpc(CudaIpcMemHandle([0x77; 64])),
            RawHandle::CudaPool {
                pool: 3,
                pool_slot: Some(0),
                ptr: CudaPoolExportData([0x66; 64]),
            },
        ] {
            let h = sample(raw).sealed(&fuzz_handle_key());
            assert!(handle_msg(&encode_handle(&h)).is_some());
        }
    }
}
