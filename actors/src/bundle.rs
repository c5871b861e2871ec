//! Bundles: many named, typed tensors in one buffer, leased and opened as one (see
//! [`Bundle`]).

use crate::buffer::{Buffer, Element, Lease, Shared};
use crate::error::ActorError;
use baton_ipc::cuda::CopySpan;
use baton_ipc::{MemPtr, Stream};
use baton_messages::{BundleLayout, SyncStamp, TensorSpec};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// The byte range of `name` in a bundle of `layout`, checked for element type `T`.
fn typed_range<T: Element>(
    layout: &BundleLayout,
    name: &str,
) -> Result<(usize, usize), ActorError> {
    let spec = spec_of(layout, name)?;
    if spec.dtype != T::DTYPE {
        return Err(ActorError::WrongElementType {
            expected: T::DTYPE,
            got: Some(spec.dtype),
        });
    }
    range_of(spec)
}

fn spec_of<'a>(layout: &'a BundleLayout, name: &str) -> Result<&'a TensorSpec, ActorError> {
    layout.get(name).ok_or_else(|| ActorError::NoSuchTensor {
        name: name.chars().take(BundleLayout::MAX_NAME).collect(),
    })
}

/// The byte range of a tensor (a layout's tensors fit `u64`; this checks they fit `usize`).
fn range_of(spec: &TensorSpec) -> Result<(usize, usize), ActorError> {
    let too_large = || ActorError::OutOfBounds {
        index: 0,
        len: usize::MAX,
        size: 0,
    };
    let start = usize::try_from(spec.offset).map_err(|_| too_large())?;
    let len = spec
        .byte_len()
        .and_then(|l| usize::try_from(l).ok())
        .ok_or_else(too_large)?;
    Ok((start, len))
}

/// The spans of a batched copy between a bundle of `layout` and device tensors of this
/// process, by name: `(name, data pointer)` each, for
/// [`CudaBackend::copy_plan`](baton_ipc::cuda::CudaBackend::copy_plan). Each tensor must be
/// as large as the bundle's tensor of that name. Run the plan on the bundle's memory
/// ([`BundleLease::lease`]'s pointer after [`BundleLease::wait_on`] the stream, or
/// [`Bundle::buffer`]'s after [`Buffer::wait_on`] and before
/// [`share_on`](Bundle::share_on) that stream): one kernel launch for every tensor.
///
/// # Errors
/// [`ActorError::NoSuchTensor`] for a name the layout lacks.
pub fn copy_spans(
    layout: &BundleLayout,
    tensors: &[(&str, u64)],
) -> Result<Vec<CopySpan>, ActorError> {
    tensors
        .iter()
        .map(|&(name, ptr)| {
            let (offset, len) = range_of(spec_of(layout, name)?)?;
            Ok(CopySpan {
                ptr,
                offset: offset as u64,
                len: len as u64,
            })
        })
        .collect()
}

/// The exporter's handle to a bundle: many named, typed tensors in one buffer, leased and
/// opened as one. Made by [`Node::allocate_bundle`](crate::Node::allocate_bundle); cloning
/// it clones the handle, as for [`Buffer`].
///
/// A model's weights are hundreds of tensors. Sent one buffer each, every sync grants,
/// offers and (the first time) opens hundreds of leases; sent as one [`Bundle`] — one
/// allocation with a [`BundleLayout`] of names, element types, shapes and offsets — a
/// sync is one lease, and from the second sync on the importer's cache already has the
/// allocation mapped: it opens nothing.
///
/// ```no_run
/// # async fn sync(node: baton_actors::Node) -> Result<(), baton_actors::ActorError> {
/// use baton_actors::{Bundle, SharedBundle};
/// use baton_messages::{BundleLayout, DType, Shape};
/// let layout = BundleLayout::packed([
///     ("wq", DType::F32, Shape::new([1024, 1024]).unwrap()),
///     ("norm", DType::F32, Shape::vector(1024)),
/// ])
/// .expect("a valid layout");
/// let weights: Bundle = node.allocate_bundle(layout)?;
/// weights.write("norm", &[1.0f32; 1024])?;
/// let shared: SharedBundle = weights.share(); // a field of a message, like a Shared<T>
/// # Ok(()) }
/// ```
///
/// The receiver [`open`](SharedBundle::open)s it into a [`BundleLease`], checked against
/// the buffer (a layout that does not fit is refused, so a tensor never reaches past the
/// mapping), and reads each tensor by name: in place for host memory
/// ([`tensor`](BundleLease::tensor)), as a device pointer for GPU memory
/// ([`tensor_ptr`](BundleLease::tensor_ptr), after [`wait_on`](BundleLease::wait_on)).
///
/// On the wire a `SharedBundle` is a struct of three fields, `"baton.bundle"` (the layout:
/// one byte string, [`BundleLayout::to_wire`]), `"buffer"` (a `Shared<u8>`) and
/// `"baton.sync"` (the [`SyncStamp`] of a versioned sync, or nil; a MessagePack map
/// without it decodes as nil): Python receives it as a `baton.SharedBundle` and sends a
/// `baton.Bundle` as the same.
///
/// A model in several bundles, or synced to several receivers, is synced as versions:
/// [`SyncSender`](crate::SyncSender) stamps each part
/// ([`share_stamped`](Self::share_stamped)) and
/// [`SyncReceiver`](crate::SyncReceiver) commits a version only once every part of it has
/// landed.
#[derive(Clone)]
pub struct Bundle {
    buffer: Buffer<u8>,
    layout: Arc<BundleLayout>,
}

impl fmt::Debug for Bundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bundle")
            .field("buffer", &self.buffer.id())
            .field("tensors", &self.layout.len())
            .finish()
    }
}

impl Bundle {
    pub(crate) fn new(buffer: Buffer<u8>, layout: BundleLayout) -> Self {
        Self {
            buffer,
            layout: Arc::new(layout),
        }
    }

    /// The buffer that holds every tensor: leases, [`returned`](Buffer::returned),
    /// streams and raw pointers work on it as on any buffer.
    pub fn buffer(&self) -> &Buffer<u8> {
        &self.buffer
    }

    /// The tensors' layout.
    pub fn layout(&self) -> &BundleLayout {
        &self.layout
    }

    /// Shares the bundle read-only, as [`Buffer::share`] does its buffer: one lease for
    /// every tensor.
    pub fn share(&self) -> SharedBundle {
        SharedBundle {
            layout: Arc::clone(&self.layout),
            buffer: self.buffer.share(),
            stamp: None,
        }
    }

    /// [`share`](Self::share), as a part of a versioned sync: `stamp` comes from
    /// [`SyncSender::stamp`](crate::SyncSender::stamp), and the receiver reads it from
    /// [`BundleLease::version`].
    pub fn share_stamped(&self, stamp: SyncStamp) -> SharedBundle {
        SharedBundle {
            stamp: Some(stamp),
            ..self.share()
        }
    }

    /// [`share`](Self::share), ordered after the work queued on `stream` (see
    /// [`Buffer::share_on`]).
    ///
    /// # Errors
    /// As [`Buffer::share_on`].
    pub fn share_on(&self, stream: impl Into<Stream>) -> Result<SharedBundle, ActorError> {
        Ok(SharedBundle {
            layout: Arc::clone(&self.layout),
            buffer: self.buffer.share_on(stream)?,
            stamp: None,
        })
    }

    /// [`share_stamped`](Self::share_stamped), ordered after the work queued on `stream`
    /// (see [`Buffer::share_on`]).
    ///
    /// # Errors
    /// As [`Buffer::share_on`].
    pub fn share_stamped_on(
        &self,
        stamp: SyncStamp,
        stream: impl Into<Stream>,
    ) -> Result<SharedBundle, ActorError> {
        Ok(SharedBundle {
            stamp: Some(stamp),
            ..self.share_on(stream)?
        })
    }

    /// Writes the whole tensor `name` (as [`Buffer::write_at`]: refused while a lease is
    /// out).
    ///
    /// # Errors
    /// [`ActorError::NoSuchTensor`], [`ActorError::WrongElementType`],
    /// [`ActorError::OutOfBounds`] when `data` is not the tensor's length, or as
    /// `write_at`.
    pub fn write<T: Element>(&self, name: &str, data: &[T]) -> Result<(), ActorError> {
        let (start, len) = typed_range::<T>(&self.layout, name)?;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.len() != len {
            return Err(ActorError::OutOfBounds {
                index: 0,
                len: data.len(),
                size: len / size_of::<T>(),
            });
        }
        self.buffer.write_at(start, bytes)
    }

    /// The tensor `name`, copied out.
    ///
    /// # Errors
    /// [`ActorError::NoSuchTensor`], [`ActorError::WrongElementType`], or as
    /// [`Buffer::read_into`].
    pub fn read<T: Element>(&self, name: &str) -> Result<Vec<T>, ActorError> {
        let (start, len) = typed_range::<T>(&self.layout, name)?;
        let mut out = vec![T::zeroed(); len / size_of::<T>()];
        self.buffer
            .read_into(start, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// Where the tensor `name` starts in this process (device or host memory), for work
    /// ordered with [`Buffer::wait_on`] and [`share_on`](Self::share_on).
    ///
    /// # Errors
    /// [`ActorError::NoSuchTensor`].
    pub fn tensor_ptr(&self, name: &str) -> Result<MemPtr, ActorError> {
        let (start, _) = range_of(spec_of(&self.layout, name)?)?;
        Ok(self.buffer.ptr().offset_by(start))
    }
}

/// A bundle inside a message: what [`Bundle::share`] makes, and what the receiver
/// [`open`](Self::open)s. Serializes only inside Baton's messages, like [`Shared`].
#[derive(Debug, Serialize, Deserialize)]
pub struct SharedBundle {
    /// The tensors (checked when decoded; checked against the buffer when opened).
    #[serde(rename = "baton.bundle", with = "arc_layout")]
    layout: Arc<BundleLayout>,
    /// The buffer that holds them.
    buffer: Shared<u8>,
    /// The stamp of a versioned sync (checked when opened).
    #[serde(rename = "baton.sync", default)]
    stamp: Option<SyncStamp>,
}

mod arc_layout {
    use baton_messages::BundleLayout;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::sync::Arc;

    pub(super) fn serialize<S: Serializer>(l: &Arc<BundleLayout>, s: S) -> Result<S::Ok, S::Error> {
        l.as_ref().serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Arc<BundleLayout>, D::Error> {
        BundleLayout::deserialize(d).map(Arc::new)
    }
}

impl SharedBundle {
    /// The tensors' layout.
    pub fn layout(&self) -> &BundleLayout {
        &self.layout
    }

    /// Whether this is a received bundle (as opposed to one about to be sent).
    pub fn is_received(&self) -> bool {
        self.buffer.is_received()
    }

    /// The stamp of the versioned sync this bundle is a part of, as the sender wrote it
    /// (unchecked until opened).
    pub fn stamp(&self) -> Option<&SyncStamp> {
        self.stamp.as_ref()
    }

    /// Opens a received bundle. The lease goes back when the [`BundleLease`] drops.
    ///
    /// # Errors
    /// [`ActorError::NotReceived`]; [`ActorError::BundleTooLarge`] when the layout reaches
    /// past the buffer, [`ActorError::Version`] when the stamp does not check (the lease
    /// goes back at once).
    pub fn open(self) -> Result<BundleLease, ActorError> {
        if let Some(stamp) = &self.stamp {
            stamp.check()?;
        }
        let lease = self.buffer.open()?;
        let needs = self.layout.byte_len();
        if needs > lease.len() as u64 {
            return Err(ActorError::BundleTooLarge {
                needs,
                len: lease.len() as u64,
            });
        }
        Ok(BundleLease {
            lease,
            layout: self.layout,
            stamp: self.stamp,
        })
    }
}

/// An importer's read-only guard on a received bundle: one lease on the exporter's buffer,
/// and its tensors by name (see [`Bundle`]). Dropping it gives the lease back.
pub struct BundleLease {
    lease: Lease<u8>,
    layout: Arc<BundleLayout>,
    stamp: Option<SyncStamp>,
}

impl fmt::Debug for BundleLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BundleLease")
            .field("lease", &self.lease.id())
            .field("tensors", &self.layout.len())
            .field("version", &self.version())
            .finish()
    }
}

impl BundleLease {
    /// The tensors' layout.
    pub fn layout(&self) -> &BundleLayout {
        &self.layout
    }

    /// The version this bundle is a part of, when it was sent as a part of a versioned
    /// sync (see [`SyncSender`](crate::SyncSender)); `None` for a bundle shared without.
    pub fn version(&self) -> Option<u64> {
        self.stamp.map(|s| s.version)
    }

    /// The whole stamp of its versioned sync (checked when opened).
    pub fn stamp(&self) -> Option<&SyncStamp> {
        self.stamp.as_ref()
    }

    /// The lease on the whole buffer.
    pub fn lease(&self) -> &Lease<u8> {
        &self.lease
    }

    /// The tensor `name` in place, without a copy: host memory only (see
    /// [`Lease::as_slice`]).
    ///
    /// # Errors
    /// [`ActorError::NoSuchTensor`], [`ActorError::WrongElementType`], or as
    /// `Lease::as_slice` ([`ActorError::NotHostMemory`] for device memory).
    pub fn tensor<T: Element>(&self, name: &str) -> Result<&[T], ActorError> {
        let (start, len) = typed_range::<T>(&self.layout, name)?;
        let bytes = &self.lease.as_slice()?[start..start + len];
        bytemuck::try_cast_slice(bytes).map_err(|_| ActorError::NotHostMemory)
    }

    /// The tensor `name`, copied out (host or device memory).
    ///
    /// # Errors
    /// [`ActorError::NoSuchTensor`], [`ActorError::WrongElementType`], or as
    /// [`Lease::read_into`].
    pub fn read<T: Element>(&self, name: &str) -> Result<Vec<T>, ActorError> {
        let (start, len) = typed_range::<T>(&self.layout, name)?;
        let mut out = vec![T::zeroed(); len / size_of::<T>()];
        self.lease
            .read_into(start, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// Where the tensor `name` is mapped in this process. Before queuing work that uses it
    /// on a stream, call [`wait_on`](Self::wait_on) with that stream.
    ///
    /// # Errors
    /// [`ActorError::NoSuchTensor`], [`ActorError::Orphaned`].
    pub fn tensor_ptr(&self, name: &str) -> Result<MemPtr, ActorError> {
        let (start, _) = range_of(spec_of(&self.layout, name)?)?;
        Ok(self.lease.ptr()?.offset_by(start))
    }

    /// Orders the work queued on `stream` from now on after the exporter's (see
    /// [`Lease::wait_on`]): once for every tensor of the bundle.
    ///
    /// # Errors
    /// As [`Lease::wait_on`].
    pub fn wait_on(&self, stream: impl Into<Stream>) -> Result<(), ActorError> {
        self.lease.wait_on(stream)
    }

    /// Gives the lease back now (the same as dropping it).
    pub fn release(self) {}
}
