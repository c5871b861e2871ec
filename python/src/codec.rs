//! Python values ↔ MessagePack, the encoding of messages that cross languages
//! (`baton_actors::Encoding::MessagePack`; the type table is in `python/README.md`).
//!
//! Buffers travel beside the bytes: a `baton.Buffer` in an outgoing value is encoded as the
//! extension [`MSGPACK_SHARED_EXT`] holding its index among the message's buffers (and is
//! leased to the receiver when the message is sent); in an incoming value, that extension
//! becomes a `baton.Shared` (an unopened lease). A received buffer (`Shared`, `Lease`)
//! cannot be put in a message: only its owner can share it.

use crate::bundle::{self, BundleLayout, LAYOUT_KEY};
use crate::errors::{Failure, OrRaise};
use crate::memory::{Buffer, Cuda, Lease, Shared, WritableShare};
use baton_actors::{ActorError, AnyBuffer, AnyShared, MSGPACK_SHARED_EXT, RawMessage};
use baton_ipc::Stream;
use baton_ipc::cuda::CudaBackend;
use pyo3::IntoPyObjectExt;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType,
};
use rmpv::Value;
use std::sync::Arc;

/// The method of an outgoing object that gives its wire value (`baton.Bundle`'s).
const WIRE_METHOD: &str = "__baton_wire__";

/// How deep values may nest, both ways (a cycle in an outgoing value hits it too).
const MAX_DEPTH: usize = 128;

/// An outgoing value: its bytes, its buffers, and the CUDA backend of its device buffers
/// (to synchronise before it leaves).
pub(crate) struct Outgoing {
    pub(crate) message: RawMessage,
    pub(crate) device: Option<Arc<CudaBackend>>,
}

fn encode_error(reason: String) -> Failure {
    Failure::Actor(ActorError::Encode {
        what: "message",
        reason,
    })
}

/// Encodes `value` (see the module docs). With `stream` (a Python stream object, for device
/// buffers), each buffer's acquire fence follows the work queued on it, and the caller need
/// not synchronise the device before sending (`Outgoing::device` stays `None`).
pub(crate) fn encode(
    value: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<Outgoing> {
    let mut buffers = Vec::new();
    let mut device = None;
    let mut order = Order {
        named: stream,
        stream: None,
        group: None,
    };
    let v = to_value(value, &mut buffers, &mut device, &mut order, 0)?;
    if order.stream.is_some() {
        device = None;
    }
    let mut bytes = Vec::new();
    write_tree(&mut bytes, &v)
        .map_err(|e| encode_error(e.to_string()))
        .or_raise(value.py())?;
    Ok(Outgoing {
        message: RawMessage::new(bytes, buffers),
        device,
    })
}

/// Marks, in a value tree of this module only, the MessagePack bytes of a bundle layout
/// kept as they are on the wire: written as they are ([`write_tree`]) and, received, read
/// without building a tree of them ([`read_tree`]). A bundle sent every sync carries its
/// layout (hundreds of tensors) every time; as bytes, encoding it is a copy and decoding it
/// a comparison with the layouts received before. Never on the wire as an extension.
const RAW_LAYOUT: i8 = -100;

/// Marks, as [`RAW_LAYOUT`] does, the MessagePack bytes of a received bundle group's list of
/// bundles, kept unparsed by [`read_tree`] and read by [`received_group`] straight from
/// them: a borrowed model's group is tens of bundles every sync, and a tree of values for
/// each (its keys, its layout's bytes, its buffer) was most of its receiver's decoding.
/// Never written, never on the wire as an extension.
const RAW_GROUP: i8 = -101;

/// Writes `v` as MessagePack, splicing [`RAW_LAYOUT`] bytes in as they are.
fn write_tree(out: &mut Vec<u8>, v: &Value) -> Result<(), String> {
    match v {
        Value::Map(entries) => {
            rmp::encode::write_map_len(out, entries.len() as u32).map_err(|e| e.to_string())?;
            for (k, v) in entries {
                write_tree(out, k)?;
                write_tree(out, v)?;
            }
        }
        Value::Array(items) => {
            rmp::encode::write_array_len(out, items.len() as u32).map_err(|e| e.to_string())?;
            for item in items {
                write_tree(out, item)?;
            }
        }
        Value::Ext(RAW_LAYOUT, raw) => out.extend_from_slice(raw),
        leaf => rmpv::encode::write_value(out, leaf).map_err(|e| e.to_string())?,
    }
    Ok(())
}

/// Reads one MessagePack value as [`rmpv::decode::read_value`] does, except that the value
/// of a map's [`LAYOUT_KEY`] is kept as its bytes (a [`RAW_LAYOUT`] mark), unparsed, and so
/// is that of a map's [`GROUP_KEY`] (a [`RAW_GROUP`] mark; stepped over within the same
/// depth bound).
fn read_tree(rd: &mut &[u8], depth: usize) -> Result<Value, String> {
    if depth > MAX_DEPTH {
        return Err(format!("values nest deeper than {MAX_DEPTH} levels"));
    }
    let Some(&first) = rd.first() else {
        return Err("the value ends early".into());
    };
    match rmp::Marker::from_u8(first) {
        rmp::Marker::FixMap(_) | rmp::Marker::Map16 | rmp::Marker::Map32 => {
            let n = rmp::decode::read_map_len(rd).map_err(|e| e.to_string())?;
            let mut entries = Vec::with_capacity((n as usize).min(rd.len() / 2));
            for _ in 0..n {
                let k = read_tree(rd, depth + 1)?;
                let raw = match k.as_str() {
                    Some(LAYOUT_KEY) => Some(RAW_LAYOUT),
                    Some(GROUP_KEY) => Some(RAW_GROUP),
                    _ => None,
                };
                let v = match raw {
                    Some(mark) => Value::Ext(mark, skipped(rd, depth + 1)?.to_vec()),
                    None => read_tree(rd, depth + 1)?,
                };
                entries.push((k, v));
            }
            Ok(Value::Map(entries))
        }
        rmp::Marker::FixArray(_) | rmp::Marker::Array16 | rmp::Marker::Array32 => {
            let n = rmp::decode::read_array_len(rd).map_err(|e| e.to_string())?;
            let mut items = Vec::with_capacity((n as usize).min(rd.len()));
            for _ in 0..n {
                items.push(read_tree(rd, depth + 1)?);
            }
            Ok(Value::Array(items))
        }
        // Not a container: nothing nested to look into.
        _ => rmpv::decode::read_value(rd).map_err(|e| e.to_string()),
    }
}

/// Steps over one MessagePack value ([`skip`]) and gives its bytes.
fn skipped<'a>(rd: &mut &'a [u8], depth: usize) -> Result<&'a [u8], String> {
    let at = *rd;
    skip(rd, depth)?;
    Ok(&at[..at.len() - rd.len()])
}

/// Steps over one MessagePack value without reading it into memory.
fn skip(rd: &mut &[u8], depth: usize) -> Result<(), String> {
    use rmp::Marker as M;
    if depth > MAX_DEPTH {
        return Err(format!("values nest deeper than {MAX_DEPTH} levels"));
    }
    fn take(rd: &mut &[u8], n: usize) -> Result<&'static [u8], String> {
        if rd.len() < n {
            return Err("the value ends early".into());
        }
        *rd = &rd[n..];
        Ok(&[])
    }
    fn len(rd: &mut &[u8], bytes: usize) -> Result<usize, String> {
        if rd.len() < bytes {
            return Err("the value ends early".into());
        }
        let n = rd[..bytes]
            .iter()
            .fold(0usize, |n, b| n << 8 | usize::from(*b));
        *rd = &rd[bytes..];
        Ok(n)
    }
    let Some((&first, rest)) = rd.split_first() else {
        return Err("the value ends early".into());
    };
    *rd = rest;
    let (items, bytes) = match M::from_u8(first) {
        M::FixPos(_) | M::FixNeg(_) | M::Null | M::True | M::False => (0, 0),
        M::U8 | M::I8 => (0, 1),
        M::U16 | M::I16 => (0, 2),
        M::U32 | M::I32 | M::F32 => (0, 4),
        M::U64 | M::I64 | M::F64 => (0, 8),
        M::FixStr(n) => (0, usize::from(n)),
        M::Str8 | M::Bin8 => (0, len(rd, 1)?),
        M::Str16 | M::Bin16 => (0, len(rd, 2)?),
        M::Str32 | M::Bin32 => (0, len(rd, 4)?),
        M::FixArray(n) => (usize::from(n), 0),
        M::Array16 => (len(rd, 2)?, 0),
        M::Array32 => (len(rd, 4)?, 0),
        M::FixMap(n) => (2 * usize::from(n), 0),
        M::Map16 => (2 * len(rd, 2)?, 0),
        M::Map32 => (2 * len(rd, 4)?, 0),
        M::FixExt1 => (0, 2),
        M::FixExt2 => (0, 3),
        M::FixExt4 => (0, 5),
        M::FixExt8 => (0, 9),
        M::FixExt16 => (0, 17),
        M::Ext8 => (0, len(rd, 1)? + 1),
        M::Ext16 => (0, len(rd, 2)? + 1),
        M::Ext32 => (0, len(rd, 4)? + 1),
        M::Reserved => return Err("a reserved MessagePack marker".into()),
    };
    take(rd, bytes)?;
    for _ in 0..items {
        skip(rd, depth + 1)?;
    }
    Ok(())
}

/// The stream an outgoing value's device buffers are ordered on: named by the caller,
/// wrapped at the first device buffer.
struct Order<'a, 'py> {
    named: Option<&'a Bound<'py, PyAny>>,
    stream: Option<Stream>,
    /// Inside a bundle group: its device buffers, shared unmarked and marked on the stream
    /// together once the group is encoded (`AnyBuffer::mark_all_on`: one fence wait, one
    /// record and one acquire fence for the lease over all of them).
    group: Option<Vec<AnyBuffer>>,
}

fn to_value(
    obj: &Bound<'_, PyAny>,
    buffers: &mut Vec<AnyShared>,
    device: &mut Option<Arc<CudaBackend>>,
    order: &mut Order<'_, '_>,
    depth: usize,
) -> PyResult<Value> {
    let py = obj.py();
    if depth > MAX_DEPTH {
        return Err(encode_error(format!(
            "values nest deeper than {MAX_DEPTH} levels (a cycle?)"
        )))
        .or_raise(py);
    }
    if obj.is_none() {
        return Ok(Value::Nil);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Boolean(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return int_value(obj);
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::F64(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::String(s.to_cow()?.into_owned().into()));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Value::Binary(b.as_bytes().to_vec()));
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(Value::Binary(b.to_vec()));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l
            .iter()
            .map(|item| to_value(&item, buffers, device, order, depth + 1))
            .collect::<PyResult<_>>()
            .map(Value::Array);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t
            .iter()
            .map(|item| to_value(&item, buffers, device, order, depth + 1))
            .collect::<PyResult<_>>()
            .map(Value::Array);
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        return d
            .iter()
            .map(|(k, v)| {
                Ok((
                    to_value(&k, buffers, device, order, depth + 1)?,
                    to_value(&v, buffers, device, order, depth + 1)?,
                ))
            })
            .collect::<PyResult<_>>()
            .map(Value::Map);
    }
    let writable = obj.cast::<WritableShare>().ok();
    let buffer = match &writable {
        Some(w) => Some(w.get().buffer.bind(py).clone()),
        None => obj.cast::<Buffer>().ok().cloned(),
    };
    if let Some(b) = buffer {
        let b = b.get();
        if let (Some(named), None, Some(cuda)) = (order.named, &order.stream, b.cuda_of_device()) {
            order.stream = Some(crate::stream::named(named, &cuda)?);
        }
        let (shared, cuda) = match (&mut order.group, &order.stream, b.cuda_of_device()) {
            (Some(group), Some(_), Some(_)) => {
                group.push(b.handle().or_raise(py)?);
                b.share(None, writable.is_some())
            }
            _ => b.share(order.stream.as_ref(), writable.is_some()),
        }
        .or_raise(py)?;
        let index = u32::try_from(buffers.len()).expect("a frame holds far fewer buffers");
        buffers.push(shared);
        if cuda.is_some() {
            *device = cuda;
        }
        return Ok(Value::Ext(MSGPACK_SHARED_EXT, index.to_be_bytes().to_vec()));
    }
    if obj.is_instance_of::<Shared>() || obj.is_instance_of::<Lease>() {
        return Err(Failure::Actor(ActorError::NotOwned)).or_raise(py);
    }
    if let Ok(stamp) = obj.cast::<crate::versions::SyncStamp>() {
        return crate::versions::encode_stamp(&stamp.get().inner)
            .map_err(encode_error)
            .or_raise(py);
    }
    if let Ok(layout) = obj.cast::<BundleLayout>() {
        let raw = layout.get().wire().map_err(encode_error).or_raise(py)?;
        return Ok(Value::Ext(RAW_LAYOUT, raw.to_vec()));
    }
    // A `baton.Bundle` (Python, `baton/bundle.py`) says what it is on the wire.
    if obj.hasattr(WIRE_METHOD)? {
        let first = buffers.len();
        let wire = obj.call_method0(WIRE_METHOD)?;
        // A `baton.BundleGroup`: its bundles' buffers (one each, in order) are leased as
        // one lease over them all, marked on the stream together.
        let group = match wire.cast::<PyDict>() {
            Ok(d) => d.contains(GROUP_KEY)?,
            Err(_) => false,
        };
        let outer = if group {
            order.group.replace(Vec::new())
        } else {
            None
        };
        let value = to_value(&wire, buffers, device, order, depth + 1);
        if !group {
            return value;
        }
        let marked = std::mem::replace(&mut order.group, outer).unwrap_or_default();
        let value = value?;
        if let (Some(stream), false) = (&order.stream, marked.is_empty()) {
            AnyBuffer::mark_all_on(&marked, stream.clone())
                .map_err(Failure::from)
                .or_raise(py)?;
        }
        if first < buffers.len() {
            let parts = buffers.split_off(first + 1);
            buffers.extend(parts.into_iter().map(AnyShared::lease_with_previous));
        }
        return Ok(value);
    }
    // NumPy scalars and other numbers.
    if obj.hasattr("__index__")? {
        return int_value(&obj.call_method0("__index__")?);
    }
    if obj.hasattr("__float__")? {
        return Ok(Value::F64(obj.call_method0("__float__")?.extract()?));
    }
    Err(Failure::Type(format!(
        "cannot put a {} in a Baton message: use None, bool, int, float, str, bytes, list, \
         tuple, dict, or baton.Buffer",
        obj.get_type().name()?
    )))
    .or_raise(py)
}

fn int_value(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    if let Ok(i) = obj.extract::<i64>() {
        return Ok(Value::from(i));
    }
    if let Ok(u) = obj.extract::<u64>() {
        return Ok(Value::from(u));
    }
    Err(encode_error(format!(
        "{} does not fit MessagePack's 64-bit integers",
        obj.str()?
    )))
    .or_raise(obj.py())
}

/// Decodes a received message: its buffers become `baton.Shared`s where the value refers
/// to them; those it does not refer to are released.
pub(crate) fn decode(
    py: Python<'_>,
    what: &'static str,
    message: RawMessage,
    cuda: &Cuda,
) -> PyResult<Py<PyAny>> {
    let fail = |reason: String| Failure::Actor(ActorError::Decode { what, reason });
    let mut rd: &[u8] = &message.bytes;
    let value = read_tree(&mut rd, 0).map_err(fail).or_raise(py)?;
    if !rd.is_empty() {
        return Err(fail(format!("{} bytes after the value", rd.len()))).or_raise(py);
    }
    let mut buffers: Vec<Option<AnyShared>> = message.buffers.into_iter().map(Some).collect();
    to_py(py, value, &mut buffers, cuda).map_err(|e| match e {
        Decoded::Py(e) => e,
        Decoded::Bad(reason) => crate::errors::to_py(py, fail(reason)),
    })
}

enum Decoded {
    Py(PyErr),
    Bad(String),
}

impl From<PyErr> for Decoded {
    fn from(e: PyErr) -> Self {
        Decoded::Py(e)
    }
}

fn to_py(
    py: Python<'_>,
    value: Value,
    buffers: &mut [Option<AnyShared>],
    cuda: &Cuda,
) -> Result<Py<PyAny>, Decoded> {
    Ok(match value {
        Value::Nil => py.None(),
        Value::Boolean(b) => PyBool::new(py, b).to_owned().into_any().unbind(),
        Value::Integer(i) => match (i.as_i64(), i.as_u64()) {
            (Some(v), _) => v.into_py_any(py)?,
            (None, Some(v)) => v.into_py_any(py)?,
            (None, None) => return Err(Decoded::Bad("an integer out of range".into())),
        },
        Value::F32(f) => f64::from(f).into_py_any(py)?,
        Value::F64(f) => f.into_py_any(py)?,
        Value::String(s) => match s.into_str() {
            Some(s) => PyString::new(py, &s).into_any().unbind(),
            None => return Err(Decoded::Bad("a string that is not UTF-8".into())),
        },
        Value::Binary(b) => PyBytes::new(py, &b).into_any().unbind(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item, buffers, cuda)?)?;
            }
            list.into_any().unbind()
        }
        Value::Map(entries) if entries.iter().any(|(k, _)| k.as_str() == Some(LAYOUT_KEY)) => {
            received_bundle(py, entries, buffers, cuda)?
        }
        Value::Map(entries) if entries.iter().any(|(k, _)| k.as_str() == Some(GROUP_KEY)) => {
            received_group(py, entries, buffers, cuda)?
        }
        Value::Map(entries) => {
            let dict = PyDict::new(py);
            for (k, v) in entries {
                let k = to_py(py, k, buffers, cuda)?;
                let v = to_py(py, v, buffers, cuda)?;
                dict.set_item(k, v)
                    .map_err(|e| Decoded::Bad(format!("a map key Python cannot use ({e})")))?;
            }
            dict.into_any().unbind()
        }
        Value::Ext(MSGPACK_SHARED_EXT, data) => take_buffer(py, &data, buffers, cuda)?,
        Value::Ext(tag, _) => {
            return Err(Decoded::Bad(format!(
                "MessagePack extension {tag} (Baton knows only {MSGPACK_SHARED_EXT}, a buffer)"
            )));
        }
    })
}

/// The buffer a [`MSGPACK_SHARED_EXT`] extension's data (its index, 4 bytes) names,
/// taken from the message's buffers (each once), as a `baton.Shared`.
fn take_buffer(
    py: Python<'_>,
    data: &[u8],
    buffers: &mut [Option<AnyShared>],
    cuda: &Cuda,
) -> Result<Py<PyAny>, Decoded> {
    let index = <[u8; 4]>::try_from(data)
        .map(u32::from_be_bytes)
        .map_err(|_| {
            Decoded::Bad(format!(
                "a buffer reference of {} bytes (4 expected)",
                data.len()
            ))
        })? as usize;
    let count = buffers.len();
    let shared = buffers
        .get_mut(index)
        .ok_or_else(|| {
            Decoded::Bad(format!(
                "buffer index {index} out of range ({count} buffers)"
            ))
        })?
        .take()
        .ok_or_else(|| Decoded::Bad(format!("buffer index {index} used twice")))?;
    Ok(Bound::new(py, Shared::new(shared, cuda.clone()))?
        .into_any()
        .unbind())
}

/// `baton.bundle.SharedBundle` and `SharedBundleGroup`, looked up once: a borrowed model's
/// group makes tens of bundles each sync.
static SHARED_BUNDLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static SHARED_GROUP: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The key of a bundle group's wire map (`baton.BundleGroup`): its one field, the list of
/// its bundles.
const GROUP_KEY: &str = "baton.bundles";

/// A received bundle group: a map of one field, [`GROUP_KEY`], whose value is a list of
/// one bundle or more; a `baton.SharedBundleGroup` of them, made in one call with their
/// layouts, buffers and stamps (no Python object per bundle: a borrowed model's group has
/// tens of them each sync). The list is read from its bytes (a [`RAW_GROUP`] mark), with
/// no tree of values: each bundle's keys are compared where they lie, its layout looked
/// up by its bytes, its buffer taken by its index.
fn received_group(
    py: Python<'_>,
    entries: Vec<(Value, Value)>,
    buffers: &mut [Option<AnyShared>],
    cuda: &Cuda,
) -> Result<Py<PyAny>, Decoded> {
    let not_a_group = || {
        Decoded::Bad(format!(
            "a bundle group is a map of one field, {GROUP_KEY:?}, a list of bundles"
        ))
    };
    let mut entries = entries.into_iter();
    let (Some((_, Value::Ext(RAW_GROUP, raw))), None) = (entries.next(), entries.next()) else {
        return Err(not_a_group());
    };
    let rd = &mut raw.as_slice();
    let n = rmp::decode::read_array_len(rd).map_err(|_| not_a_group())?;
    if n == 0 {
        return Err(Decoded::Bad("a bundle group of no bundle".into()));
    }
    // At most one bundle per byte left: a forged count allocates nothing it cannot fill.
    let mut layouts = Vec::with_capacity((n as usize).min(rd.len()));
    let shared = PyList::empty(py);
    let mut stamps: Vec<Option<crate::versions::SyncStamp>> = Vec::new();
    for _ in 0..n {
        let (layout, buffer, stamp) = group_bundle(py, rd, buffers, cuda)?;
        if stamp.is_some() {
            stamps.resize_with(layouts.len(), || None);
            stamps.push(stamp);
        } else if !stamps.is_empty() {
            stamps.push(None);
        }
        layouts.push(layout);
        shared.append(buffer)?;
    }
    if !rd.is_empty() {
        return Err(not_a_group());
    }
    let stamps = (!stamps.is_empty()).then(|| {
        stamps.resize_with(layouts.len(), || None);
        stamps
    });
    Ok(SHARED_GROUP
        .import(py, "baton.bundle", "SharedBundleGroup")?
        .call_method1("_received", (PyTuple::new(py, layouts)?, shared, stamps))?
        .unbind())
}

/// One bundle of a group's list, read from its bytes (see [`received_group`]): the checks
/// and errors of [`bundle_fields`].
fn group_bundle(
    py: Python<'_>,
    rd: &mut &[u8],
    buffers: &mut [Option<AnyShared>],
    cuda: &Cuda,
) -> Result<BundleFields, Decoded> {
    let only_bundles = || Decoded::Bad("a bundle group holds bundles only".into());
    let fields = rmp::decode::read_map_len(rd).map_err(|_| only_bundles())?;
    let (mut layout, mut buffer, mut stamp) = (None, None, None);
    for _ in 0..fields {
        // A key that is not a string is not one of a bundle's.
        let key = match rmp::decode::read_str_from_slice(*rd) {
            Ok((key, rest)) => {
                *rd = rest;
                Some(key)
            }
            Err(_) => {
                skip(rd, 2).map_err(Decoded::Bad)?;
                None
            }
        };
        let value = skipped(rd, 2).map_err(Decoded::Bad)?;
        match key {
            Some(LAYOUT_KEY) if layout.is_none() => {
                layout = Some(bundle::decode_layout(py, value).map_err(Decoded::Bad)?);
            }
            Some("buffer") if buffer.is_none() => {
                let mut data = value;
                buffer = Some(match rmp::decode::read_ext_meta(&mut data) {
                    Ok(meta) if meta.typeid == MSGPACK_SHARED_EXT => {
                        take_buffer(py, data, buffers, cuda)?
                    }
                    _ => return Err(Decoded::Bad("a bundle's buffer is not a buffer".into())),
                });
            }
            Some(STAMP_KEY) if stamp.is_none() => {
                stamp = Some(crate::versions::decode_stamp_bytes(value).map_err(Decoded::Bad)?);
            }
            _ => {
                return Err(Decoded::Bad(format!(
                    "a bundle has the fields {LAYOUT_KEY:?}, \"buffer\" and {STAMP_KEY:?} \
                     once each, not {}",
                    key.map_or_else(|| "a key that is not a string".into(), |k| format!("{k:?}"))
                )));
            }
        }
    }
    let Some(layout) = layout else {
        return Err(only_bundles());
    };
    let Some(buffer) = buffer else {
        return Err(Decoded::Bad("a bundle without its buffer".into()));
    };
    let stamp = stamp
        .flatten()
        .map(|inner| crate::versions::SyncStamp { inner });
    Ok((layout, buffer, stamp))
}

/// The key of a bundle's sync stamp in its wire map (nil or absent: none).
const STAMP_KEY: &str = "baton.sync";

/// A received bundle (the map of Rust's `SharedBundle`): its layout checked, then a
/// `baton.SharedBundle` of it and its buffer.
fn received_bundle(
    py: Python<'_>,
    entries: Vec<(Value, Value)>,
    buffers: &mut [Option<AnyShared>],
    cuda: &Cuda,
) -> Result<Py<PyAny>, Decoded> {
    let (layout, buffer, stamp) = bundle_fields(py, entries, buffers, cuda)?;
    Ok(SHARED_BUNDLE
        .import(py, "baton.bundle", "SharedBundle")?
        .call1((layout, buffer, stamp))?
        .unbind())
}

/// A received bundle's layout, its buffer (a `baton.Shared`) and its sync stamp.
type BundleFields = (
    Py<BundleLayout>,
    Py<PyAny>,
    Option<crate::versions::SyncStamp>,
);

/// A received bundle's fields, checked.
fn bundle_fields(
    py: Python<'_>,
    entries: Vec<(Value, Value)>,
    buffers: &mut [Option<AnyShared>],
    cuda: &Cuda,
) -> Result<BundleFields, Decoded> {
    let (mut layout, mut buffer, mut stamp) = (None, None, None);
    for (k, v) in entries {
        match k.as_str() {
            Some(LAYOUT_KEY) if layout.is_none() => {
                let Value::Ext(RAW_LAYOUT, raw) = v else {
                    unreachable!("read_tree keeps every layout as its bytes");
                };
                layout = Some(bundle::decode_layout(py, &raw).map_err(Decoded::Bad)?);
            }
            Some("buffer") if buffer.is_none() => buffer = Some(to_py(py, v, buffers, cuda)?),
            Some(STAMP_KEY) if stamp.is_none() => {
                stamp = Some(crate::versions::decode_stamp(v).map_err(Decoded::Bad)?);
            }
            _ => {
                return Err(Decoded::Bad(format!(
                    "a bundle has the fields {LAYOUT_KEY:?}, \"buffer\" and {STAMP_KEY:?} \
                     once each, not {k}"
                )));
            }
        }
    }
    let (Some(layout), Some(buffer)) = (layout, buffer) else {
        return Err(Decoded::Bad("a bundle without its buffer".into()));
    };
    if !buffer.bind(py).is_instance_of::<Shared>() {
        return Err(Decoded::Bad("a bundle's buffer is not a buffer".into()));
    }
    let stamp = stamp
        .flatten()
        .map(|inner| crate::versions::SyncStamp { inner });
    Ok((layout, buffer, stamp))
}
