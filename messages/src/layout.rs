//! Element types and shapes of typed buffers.

use serde::{Deserialize, Serialize};
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
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "Vec<u64>", into = "Vec<u64>")]
pub struct Shape(Vec<u64>);

impl Shape {
    /// The most dimensions a shape may have; decoding refuses more.
    pub const MAX_RANK: usize = 8;

    /// A shape from its extents, or `None` with more than [`MAX_RANK`](Self::MAX_RANK) of them.
    pub fn new(dims: impl Into<Vec<u64>>) -> Option<Self> {
        let dims = dims.into();
        (dims.len() <= Self::MAX_RANK).then_some(Self(dims))
    }

    /// A one-dimensional shape.
    pub fn vector(len: u64) -> Self {
        Self(vec![len])
    }

    /// The extents.
    pub fn dims(&self) -> &[u64] {
        &self.0
    }

    /// The number of elements, or `None` if it overflows `u64`.
    pub fn elements(&self) -> Option<u64> {
        self.0.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.0.iter().map(u64::to_string).collect();
        write!(f, "[{}]", dims.join("x"))
    }
}

impl TryFrom<Vec<u64>> for Shape {
    type Error = String;
    fn try_from(dims: Vec<u64>) -> Result<Self, String> {
        let rank = dims.len();
        Shape::new(dims).ok_or_else(|| format!("shape of rank {rank} exceeds {}", Shape::MAX_RANK))
    }
}

impl From<Shape> for Vec<u64> {
    fn from(s: Shape) -> Vec<u64> {
        s.0
    }
}

#[cfg(test)]
impl proptest::arbitrary::Arbitrary for Shape {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Shape>;
    fn arbitrary_with((): ()) -> Self::Strategy {
        use proptest::prelude::*;
        proptest::collection::vec(any::<u64>(), 0..=Shape::MAX_RANK)
            .prop_map(Shape)
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
}
