//! Serde for `[u8; 64]`, which serde does not implement for arrays longer than 32.
//!
//! Encoded as a fixed-size tuple, so bincode writes exactly 64 bytes and no length.

use serde::de::{Error as _, SeqAccess, Visitor};
use serde::ser::SerializeTuple;
use serde::{Deserializer, Serializer};
use std::fmt;

pub(crate) fn serialize<S: Serializer>(bytes: &[u8; 64], s: S) -> Result<S::Ok, S::Error> {
    let mut t = s.serialize_tuple(64)?;
    for b in bytes {
        t.serialize_element(b)?;
    }
    t.end()
}

pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 64], D::Error> {
    struct Bytes64;
    impl<'de> Visitor<'de> for Bytes64 {
        type Value = [u8; 64];
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("64 bytes")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<[u8; 64], A::Error> {
            let mut out = [0u8; 64];
            for (i, slot) in out.iter_mut().enumerate() {
                *slot = seq
                    .next_element()?
                    .ok_or_else(|| A::Error::invalid_length(i, &self))?;
            }
            Ok(out)
        }
    }
    d.deserialize_tuple(64, Bytes64)
}
