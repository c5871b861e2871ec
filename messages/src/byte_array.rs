//! Serde for `[u8; N]` as a byte string: `#[serde(with = "crate::byte_array")]`.
//!
//! Serde's own arrays (up to 32) are tuples, which bincode encodes as `N` bytes but
//! decodes one element at a time, each through the visitor: ids, digests and handles made
//! most of a frame's decoding (a `Call` with one host handle took 0.87 µs to decode
//! against 0.14 µs to encode). As bytes, bincode writes a length and the bytes and reads
//! them back in one copy. Self-describing formats (JSON) still see an array of numbers
//! and are read back from one; a length other than `N` is an error.

use serde::de::{Error as _, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};
use std::fmt;

pub(crate) fn serialize<S: Serializer, const N: usize>(
    bytes: &[u8; N],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(bytes)
}

pub(crate) fn deserialize<'de, D: Deserializer<'de>, const N: usize>(
    d: D,
) -> Result<[u8; N], D::Error> {
    struct Bytes<const N: usize>;
    impl<'de, const N: usize> Visitor<'de> for Bytes<N> {
        type Value = [u8; N];
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "{N} bytes")
        }
        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<[u8; N], E> {
            v.try_into().map_err(|_| E::invalid_length(v.len(), &self))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<[u8; N], A::Error> {
            let mut out = [0u8; N];
            for (i, slot) in out.iter_mut().enumerate() {
                *slot = seq
                    .next_element()?
                    .ok_or_else(|| A::Error::invalid_length(i, &self))?;
            }
            if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                return Err(A::Error::invalid_length(N + 1, &self));
            }
            Ok(out)
        }
    }
    d.deserialize_bytes(Bytes::<N>)
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Two {
        #[serde(with = "super")]
        a: [u8; 16],
        #[serde(with = "super")]
        b: [u8; 64],
    }

    const CONFIG: bincode::config::Configuration = bincode::config::standard();

    #[test]
    fn arrays_are_a_length_and_their_bytes_on_the_wire_and_read_back() {
        let two = Two {
            a: std::array::from_fn(|i| i as u8),
            b: std::array::from_fn(|i| 255 - i as u8),
        };
        let wire = bincode::serde::encode_to_vec(&two, CONFIG).unwrap();
        let mut want = vec![16];
        want.extend(two.a);
        want.push(64);
        want.extend(two.b);
        assert_eq!(wire, want);
        let (back, used): (Two, usize) = bincode::serde::decode_from_slice(&wire, CONFIG).unwrap();
        assert_eq!((back, used), (two, wire.len()));
    }

    #[test]
    fn a_wrong_length_is_an_error_not_a_truncation() {
        let mut wire = vec![15];
        wire.extend([0u8; 15]);
        wire.push(64);
        wire.extend([0u8; 64]);
        let short = bincode::serde::decode_from_slice::<Two, _>(&wire, CONFIG).unwrap_err();
        assert!(
            short
                .to_string()
                .contains("invalid length 15, expected 16 bytes"),
            "{short}"
        );
        let mut wire = vec![17];
        wire.extend([0u8; 17]);
        wire.push(64);
        wire.extend([0u8; 64]);
        assert!(bincode::serde::decode_from_slice::<Two, _>(&wire, CONFIG).is_err());
    }

    #[test]
    fn json_sees_arrays_of_numbers_and_reads_them_back() {
        let two = Two {
            a: [1; 16],
            b: [2; 64],
        };
        let json = serde_json::to_string(&two).unwrap();
        assert!(json.starts_with(r#"{"a":[1,1,"#), "{json}");
        assert_eq!(serde_json::from_str::<Two>(&json).unwrap(), two);
        let short = json.replacen("[1,1,", "[1,", 1);
        assert!(serde_json::from_str::<Two>(&short).is_err());
        let long = json.replacen("[1,1,", "[1,1,1,", 1);
        let long = serde_json::from_str::<Two>(&long).unwrap_err().to_string();
        assert!(
            long.contains("invalid length 17, expected 16 bytes"),
            "{long}"
        );
    }
}
