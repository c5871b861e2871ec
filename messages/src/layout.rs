//! Element types and shapes of typed buffers.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// The element type of a typed buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[non_exhaustive]
pub enum DType {
    /// `u8`
    U8,
    /// `i8`
    I8,
    /// `u16`
    U16,
    /// `i16`
    I16,
    /// `u32`
    U32,
    /// `i32`
    I32,
    /// `u64`
    U64,
    /// `i64`
    I64,
    /// IEEE 754 half precision
    F16,
    /// bfloat16
    BF16,
    /// `f32`
    F32,
    /// `f64`
    F64,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }
}

/// The extents of a typed buffer, outermost first. At most [`Shape::MAX_RANK`] dimensions.
///
/// Held inline (no allocation): a shape is cloned into every handle, offer and import of a
/// typed buffer. On the wire it is a sequence of extents, as a `Vec<u64>` is.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    rank: u8,
    /// The extents, then zeros (so that equality and hashing see the extents alone).
    dims: [u64; Shape::MAX_RANK],
}

impl Serialize for Shape {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.dims().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Extents;

        impl<'de> serde::de::Visitor<'de> for Extents {
            type Value = Shape;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "at most {} extents", Shape::MAX_RANK)
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Shape, A::Error> {
                let mut shape = Shape::scalar();
                while let Some(d) = seq.next_element::<u64>()? {
                    let Some(slot) = shape.dims.get_mut(usize::from(shape.rank)) else {
                        // Read no further: a peer's length is not trusted.
                        let rank = seq
                            .size_hint()
                            .map_or(Shape::MAX_RANK + 1, |more| Shape::MAX_RANK + 1 + more);
                        return Err(serde::de::Error::custom(format!(
                            "shape of rank {rank} exceeds {}",
                            Shape::MAX_RANK
                        )));
                    };
                    *slot = d;
                    shape.rank += 1;
                }
                Ok(shape)
            }
        }

        d.deserialize_seq(Extents)
    }
}

impl Shape {
    /// The most dimensions a shape may have; decoding refuses more.
    pub const MAX_RANK: usize = 8;

    /// Rank zero (one element).
    fn scalar() -> Self {
        Self {
            rank: 0,
            dims: [0; Self::MAX_RANK],
        }
    }

    /// A shape from its extents, or `None` with more than [`MAX_RANK`](Self::MAX_RANK) of them.
    pub fn new(dims: impl Into<Vec<u64>>) -> Option<Self> {
        Self::from_slice(&dims.into())
    }

    pub(crate) fn from_slice(dims: &[u64]) -> Option<Self> {
        let mut shape = Self::scalar();
        shape.dims.get_mut(..dims.len())?.copy_from_slice(dims);
        shape.rank = dims.len() as u8;
        Some(shape)
    }

    /// A one-dimensional shape.
    pub fn vector(len: u64) -> Self {
        let mut shape = Self::scalar();
        shape.dims[0] = len;
        shape.rank = 1;
        shape
    }

    /// The extents.
    pub fn dims(&self) -> &[u64] {
        &self.dims[..usize::from(self.rank)]
    }

    /// The number of elements, or `None` if it overflows `u64`.
    pub fn elements(&self) -> Option<u64> {
        self.dims()
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.dims().iter().map(u64::to_string).collect();
        write!(f, "[{}]", dims.join("x"))
    }
}

impl TryFrom<Vec<u64>> for Shape {
    type Error = String;
    fn try_from(dims: Vec<u64>) -> Result<Self, String> {
        let rank = dims.len();
        Shape::from_slice(&dims)
            .ok_or_else(|| format!("shape of rank {rank} exceeds {}", Shape::MAX_RANK))
    }
}

impl From<Shape> for Vec<u64> {
    fn from(s: Shape) -> Vec<u64> {
        s.dims().to_vec()
    }
}

#[cfg(test)]
impl proptest::arbitrary::Arbitrary for Shape {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Shape>;
    fn arbitrary_with((): ()) -> Self::Strategy {
        use proptest::prelude::*;
        proptest::collection::vec(any::<u64>(), 0..=Shape::MAX_RANK)
            .prop_map(|dims| Shape::new(dims).expect("at most MAX_RANK"))
            .boxed()
    }
}

/// Element type and shape of a typed buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Layout {
    /// The element type.
    pub dtype: DType,
    /// The shape, outermost dimension first.
    pub shape: Shape,
}

impl Layout {
    /// A layout.
    pub fn new(dtype: DType, shape: Shape) -> Self {
        Self { dtype, shape }
    }

    /// The bytes the elements take, or `None` if that overflows `u64`.
    pub fn byte_len(&self) -> Option<u64> {
        self.shape.elements()?.checked_mul(self.dtype.size() as u64)
    }
}

/// One named tensor of a bundle: its element type, shape, and where its bytes start in the
/// bundle's buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Its name, unique in the bundle (1 to [`BundleLayout::MAX_NAME`] bytes).
    pub name: String,
    /// The element type.
    pub dtype: DType,
    /// The shape, outermost dimension first.
    pub shape: Shape,
    /// Where its first byte is in the bundle's buffer (a multiple of the element size).
    pub offset: u64,
}

impl TensorSpec {
    /// The bytes its elements take, or `None` if that overflows `u64`.
    pub fn byte_len(&self) -> Option<u64> {
        Layout::new(self.dtype, self.shape.clone()).byte_len()
    }
}

/// Why a bundle layout was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// More tensors than [`BundleLayout::MAX_TENSORS`].
    #[error("a bundle of {0} tensors: at most {max}", max = BundleLayout::MAX_TENSORS)]
    TooManyTensors(usize),
    /// A name that is empty or longer than [`BundleLayout::MAX_NAME`] bytes.
    #[error("a tensor name of {0} bytes: 1 to {max} allowed", max = BundleLayout::MAX_NAME)]
    BadName(usize),
    /// Two tensors of one name.
    #[error("two tensors are named {0:?}")]
    DuplicateName(String),
    /// An offset that is not a multiple of the element size.
    #[error("tensor {name:?} starts at byte {offset}, not a multiple of its element size")]
    Misaligned {
        /// The tensor.
        name: String,
        /// Its offset.
        offset: u64,
    },
    /// A tensor whose end overflows `u64`.
    #[error("tensor {0:?} ends past u64::MAX")]
    TooLarge(String),
    /// Two tensors share bytes.
    #[error("tensors {0:?} and {1:?} overlap")]
    Overlap(String, String),
    /// Wire bytes that are not a list of tensors.
    #[error("a bundle layout's bytes do not decode: {0}")]
    Malformed(String),
}

/// The tensors of a bundle — many named, typed tensors in one buffer, leased and opened as
/// one — checked: at most [`MAX_TENSORS`](Self::MAX_TENSORS) of them, names unique and
/// 1 to [`MAX_NAME`](Self::MAX_NAME) bytes, each offset a multiple of its element size,
/// no two tensors sharing a byte. Decoding checks the same (a peer's layout is input); the
/// receiver checks that it fits the buffer when it opens it.
///
/// On the wire a layout is one byte string ([`to_wire`](Self::to_wire)): the bincode
/// encoding (standard configuration) of its tensors in order — a name and at most 20 more
/// bytes per tensor — so that a mixture-of-experts shard of 20,000 tensors fits one frame, and a
/// receiver steps over a layout in one read and recognises one it has seen by its bytes.
///
/// [`packed`](Self::packed) lays tensors out one after another, each at a multiple of
/// [`ALIGN`](Self::ALIGN) bytes.
#[derive(Clone)]
pub struct BundleLayout {
    tensors: Vec<TensorSpec>,
    /// Tensor index by name.
    index: std::collections::HashMap<String, usize>,
    byte_len: u64,
}

impl BundleLayout {
    /// The most tensors a bundle may hold (a large model has a few thousand).
    pub const MAX_TENSORS: usize = 1 << 16;
    /// The longest tensor name, in bytes.
    pub const MAX_NAME: usize = 512;
    /// The most wire bytes a layout may have ([`from_wire`](Self::from_wire)): a frame's
    /// payload, `MAX_FRAME_LEN`.
    pub const MAX_WIRE: usize = 1 << 20;
    /// Where [`packed`](Self::packed) starts each tensor: a multiple of this many bytes
    /// (what CUDA's allocators give, and enough for any vector load).
    pub const ALIGN: u64 = 256;

    /// Tensors at the offsets given, checked (see the type's docs).
    ///
    /// # Errors
    /// A [`LayoutError`] naming the first tensor that breaks a rule.
    pub fn new(tensors: Vec<TensorSpec>) -> Result<Self, LayoutError> {
        if tensors.len() > Self::MAX_TENSORS {
            return Err(LayoutError::TooManyTensors(tensors.len()));
        }
        let mut index = std::collections::HashMap::with_capacity(tensors.len());
        let mut spans = Vec::with_capacity(tensors.len());
        let mut byte_len = 0;
        for (i, t) in tensors.iter().enumerate() {
            if t.name.is_empty() || t.name.len() > Self::MAX_NAME {
                return Err(LayoutError::BadName(t.name.len()));
            }
            if index.insert(t.name.clone(), i).is_some() {
                return Err(LayoutError::DuplicateName(t.name.clone()));
            }
            if t.offset % t.dtype.size() as u64 != 0 {
                return Err(LayoutError::Misaligned {
                    name: t.name.clone(),
                    offset: t.offset,
                });
            }
            let end = t
                .byte_len()
                .and_then(|len| t.offset.checked_add(len))
                .ok_or_else(|| LayoutError::TooLarge(t.name.clone()))?;
            if end > t.offset {
                spans.push((t.offset, end, i));
            }
            byte_len = byte_len.max(end);
        }
        spans.sort_unstable();
        for pair in spans.windows(2) {
            let ((_, end, a), (start, _, b)) = (pair[0], pair[1]);
            if start < end {
                return Err(LayoutError::Overlap(
                    tensors[a].name.clone(),
                    tensors[b].name.clone(),
                ));
            }
        }
        Ok(Self {
            tensors,
            index,
            byte_len,
        })
    }

    /// Tensors laid out in the order given, each at the next multiple of
    /// [`ALIGN`](Self::ALIGN) bytes.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn packed<S: Into<String>>(
        tensors: impl IntoIterator<Item = (S, DType, Shape)>,
    ) -> Result<Self, LayoutError> {
        let mut offset = 0u64;
        let mut specs = Vec::new();
        for (name, dtype, shape) in tensors {
            let name = name.into();
            let len = Layout::new(dtype, shape.clone())
                .byte_len()
                .ok_or_else(|| LayoutError::TooLarge(name.clone()))?;
            let next = offset
                .checked_add(len)
                .and_then(|end| end.checked_next_multiple_of(Self::ALIGN))
                .ok_or_else(|| LayoutError::TooLarge(name.clone()))?;
            specs.push(TensorSpec {
                name,
                dtype,
                shape,
                offset,
            });
            offset = next;
            if specs.len() > Self::MAX_TENSORS {
                return Err(LayoutError::TooManyTensors(specs.len()));
            }
        }
        Self::new(specs)
    }

    /// The tensors, in the order they were given.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&TensorSpec> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes a buffer needs to hold every tensor (the end of the last one).
    pub fn byte_len(&self) -> u64 {
        self.byte_len
    }

    /// How many tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether it holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

impl fmt::Debug for BundleLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BundleLayout")
            .field("tensors", &self.tensors.len())
            .field("byte_len", &self.byte_len)
            .finish()
    }
}

impl PartialEq for BundleLayout {
    fn eq(&self, other: &Self) -> bool {
        self.tensors == other.tensors
    }
}

impl Eq for BundleLayout {}

impl BundleLayout {
    /// Its wire bytes (see the type's docs).
    pub fn to_wire(&self) -> Vec<u8> {
        // Encoding a `Vec` of plain structs into memory cannot fail.
        bincode::serde::encode_to_vec(&self.tensors, bincode::config::standard())
            .unwrap_or_default()
    }

    /// A layout from its wire bytes, checked as [`new`](Self::new) checks.
    ///
    /// # Errors
    /// [`LayoutError::Malformed`] for bytes that are not exactly a list of tensors; as
    /// [`new`](Self::new).
    pub fn from_wire(bytes: &[u8]) -> Result<Self, LayoutError> {
        let config = bincode::config::standard().with_limit::<{ Self::MAX_WIRE }>();
        let (tensors, read): (Vec<TensorSpec>, usize) =
            bincode::serde::decode_from_slice(bytes, config)
                .map_err(|e| LayoutError::Malformed(e.to_string()))?;
        if read != bytes.len() {
            return Err(LayoutError::Malformed(format!(
                "{} bytes after the tensors",
                bytes.len() - read
            )));
        }
        Self::new(tensors)
    }
}

impl Serialize for BundleLayout {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.to_wire())
    }
}

impl<'de> Deserialize<'de> for BundleLayout {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, SeqAccess, Visitor};
        struct Bytes;
        impl<'de> Visitor<'de> for Bytes {
            type Value = BundleLayout;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a bundle layout: a byte string")
            }
            fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<BundleLayout, E> {
                BundleLayout::from_wire(b).map_err(E::custom)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<BundleLayout, A::Error> {
                // Formats without byte strings write bytes as a sequence of numbers.
                let mut bytes = Vec::new();
                while let Some(b) = seq.next_element::<u8>()? {
                    if bytes.len() == BundleLayout::MAX_WIRE {
                        return Err(de::Error::custom("a bundle layout longer than a frame"));
                    }
                    bytes.push(b);
                }
                self.visit_bytes(&bytes)
            }
        }
        d.deserialize_bytes(Bytes)
    }
}

impl TryFrom<Vec<TensorSpec>> for BundleLayout {
    type Error = LayoutError;
    fn try_from(tensors: Vec<TensorSpec>) -> Result<Self, LayoutError> {
        Self::new(tensors)
    }
}

impl From<BundleLayout> for Vec<TensorSpec> {
    fn from(layout: BundleLayout) -> Vec<TensorSpec> {
        layout.tensors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_len_checks_overflow() {
        let l = Layout::new(DType::F32, Shape::new([1920, 1080, 4]).unwrap());
        assert_eq!(l.byte_len(), Some(1920 * 1080 * 4 * 4));
        let huge = Layout::new(DType::F64, Shape::new([u64::MAX, 2]).unwrap());
        assert_eq!(huge.byte_len(), None);
        assert_eq!(Shape::new(vec![1; 9]), None);
    }

    #[test]
    fn a_shape_is_a_sequence_of_extents_on_the_wire() {
        let config = bincode::config::standard();
        for dims in [vec![], vec![7], vec![3, 5, 1 << 40], vec![u64::MAX; 8]] {
            let shape = Shape::new(dims.clone()).unwrap();
            let bytes = bincode::serde::encode_to_vec(&shape, config).unwrap();
            assert_eq!(bytes, bincode::serde::encode_to_vec(&dims, config).unwrap());
            let (back, used): (Shape, usize) =
                bincode::serde::decode_from_slice(&bytes, config).unwrap();
            assert_eq!((back.dims(), used), (&dims[..], bytes.len()));
            assert_eq!(back, shape);
        }
        let nine = bincode::serde::encode_to_vec(vec![1u64; 9], config).unwrap();
        let e = bincode::serde::decode_from_slice::<Shape, _>(&nine, config).unwrap_err();
        assert!(e.to_string().contains("shape of rank 9 exceeds 8"), "{e}");
        assert_eq!(format!("{:?}", Shape::new([2, 3]).unwrap()), "[2x3]");
    }

    fn spec(name: &str, dtype: DType, dims: &[u64], offset: u64) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: Shape::new(dims.to_vec()).unwrap(),
            offset,
        }
    }

    #[test]
    fn packed_bundles_align_each_tensor_and_index_them_by_name() {
        let layout = BundleLayout::packed([
            ("w", DType::BF16, Shape::new([3, 5]).unwrap()),
            ("b", DType::F32, Shape::vector(7)),
            ("empty", DType::F16, Shape::vector(0)),
            ("n", DType::U8, Shape::vector(1)),
        ])
        .unwrap();
        let offsets: Vec<u64> = layout.tensors().iter().map(|t| t.offset).collect();
        assert_eq!(offsets, [0, 256, 512, 512]);
        assert_eq!(layout.byte_len(), 513);
        assert_eq!(layout.get("b").unwrap().byte_len(), Some(28));
        assert_eq!(layout.get("nope"), None);
        assert_eq!(layout.len(), 4);
    }

    #[test]
    fn bad_layouts_are_refused_with_what_is_wrong() {
        use LayoutError::*;
        let bad = |t: Vec<TensorSpec>| BundleLayout::new(t).unwrap_err();
        assert_eq!(bad(vec![spec("", DType::U8, &[1], 0)]), BadName(0));
        let long = "x".repeat(BundleLayout::MAX_NAME + 1);
        assert_eq!(bad(vec![spec(&long, DType::U8, &[1], 0)]), BadName(513));
        assert_eq!(
            bad(vec![
                spec("a", DType::U8, &[1], 0),
                spec("a", DType::U8, &[1], 8)
            ]),
            DuplicateName("a".into())
        );
        assert!(matches!(
            bad(vec![spec("a", DType::F32, &[1], 2)]),
            Misaligned { offset: 2, .. }
        ));
        assert_eq!(
            bad(vec![spec("a", DType::U8, &[8], u64::MAX - 4)]),
            TooLarge("a".into())
        );
        assert_eq!(
            bad(vec![
                spec("a", DType::U8, &[8], 0),
                spec("b", DType::U8, &[8], 7)
            ]),
            Overlap("a".into(), "b".into())
        );
        let many = (0..=BundleLayout::MAX_TENSORS)
            .map(|i| spec(&i.to_string(), DType::U8, &[0], 0))
            .collect();
        assert_eq!(bad(many), TooManyTensors(BundleLayout::MAX_TENSORS + 1));
        // Empty tensors share no byte with anything.
        assert!(
            BundleLayout::new(vec![
                spec("a", DType::U8, &[8], 0),
                spec("z", DType::U8, &[0], 3)
            ])
            .is_ok()
        );
    }

    #[test]
    fn a_layout_is_one_byte_string_on_the_wire_and_20_000_tensors_fit_a_frame() {
        let layout = BundleLayout::packed((0..20_000).map(|i| {
            (
                format!("experts.{}.w{}", i / 125, i % 125),
                DType::BF16,
                Shape::vector(190_000),
            )
        }))
        .unwrap();
        let wire = layout.to_wire();
        // 16-byte names: 30 bytes a tensor at most (a 9-byte offset past 4 GiB).
        assert!(wire.len() <= 20_000 * 30, "{} bytes", wire.len());
        assert_eq!(BundleLayout::from_wire(&wire).unwrap(), layout);
        // Through serde (a field of a bincode message), as bytes.
        let config = bincode::config::standard();
        let framed = bincode::serde::encode_to_vec(&layout, config).unwrap();
        assert_eq!(framed.len(), wire.len() + 5, "a length and the bytes");
        let (back, _): (BundleLayout, usize) =
            bincode::serde::decode_from_slice(&framed, config).unwrap();
        assert_eq!(back, layout);
        // Bytes after the tensors, bytes cut short, and garbage are refused.
        let mut longer = wire.clone();
        longer.push(0);
        assert!(matches!(
            BundleLayout::from_wire(&longer),
            Err(LayoutError::Malformed(_))
        ));
        assert!(matches!(
            BundleLayout::from_wire(&wire[..wire.len() - 1]),
            Err(LayoutError::Malformed(_))
        ));
        assert!(matches!(
            BundleLayout::from_wire(&[0xff; 9]),
            Err(LayoutError::Malformed(_))
        ));
        // A length that claims more than a frame allocates nothing and is refused.
        assert!(matches!(
            BundleLayout::from_wire(&[0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f]),
            Err(LayoutError::Malformed(_))
        ));
    }

    proptest::proptest! {
        /// Any layout that decodes keeps its rules (a peer's layout is input): against a
        /// plain model of them, over arbitrary specs.
        #[test]
        fn decoding_keeps_the_rules(specs in proptest::collection::vec(
            ("[a-c]{1,2}", proptest::prelude::any::<DType>(),
             proptest::collection::vec(0u64..6, 0..3), 0u64..64),
            0..6,
        )) {
            let specs: Vec<TensorSpec> = specs
                .into_iter()
                .map(|(name, dtype, dims, offset)| spec(&name, dtype, &dims, offset))
                .collect();
            let bytes = bincode::serde::encode_to_vec(&specs, bincode::config::standard()).unwrap();
            let decoded = BundleLayout::from_wire(&bytes).map(|l| (l, 0));
            let names: std::collections::HashSet<_> = specs.iter().map(|t| &t.name).collect();
            let aligned = specs.iter().all(|t| t.offset % t.dtype.size() as u64 == 0);
            let spans: Vec<(u64, u64)> = specs
                .iter()
                .map(|t| (t.offset, t.offset + t.byte_len().unwrap()))
                .filter(|(a, b)| b > a)
                .collect();
            let disjoint = spans.iter().enumerate().all(|(i, a)| {
                spans[i + 1..].iter().all(|b| a.1 <= b.0 || b.1 <= a.0)
            });
            let ok = names.len() == specs.len() && aligned && disjoint;
            proptest::prop_assert_eq!(decoded.is_ok(), ok, "{:?}", specs);
            if let Ok((layout, _)) = decoded {
                // Empty tensors count too: every tensor starts inside (or at the end of) the
                // buffer that holds them.
                let end = specs.iter().map(|t| t.offset + t.byte_len().unwrap()).max().unwrap_or(0);
                proptest::prop_assert_eq!(layout.byte_len(), end);
                for t in &specs {
                    proptest::prop_assert_eq!(layout.get(&t.name), Some(t));
                }
            }
        }
    }
}
