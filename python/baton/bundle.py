"""Bundles: many named tensors in one buffer, leased and opened as one.

A model's weights are hundreds of tensors. Sent as one ``Buffer`` each, every sync grants
and offers hundreds of leases, and the receiver opens hundreds of allocations the first
time; sent as one bundle, a sync is one lease, and from the second sync on the receiver's
import cache has the allocation mapped already: it opens nothing.

- ``node.allocate_bundle(spec)`` gives a :class:`Bundle`: ``spec`` is a
  :class:`BundleLayout`, a dict ``{name: (shape, dtype)}`` or a list of
  ``(name, shape, dtype)``; every tensor sits at a multiple of 256 bytes.
- ``bundle.tensors()`` gives a dict of views of this process's memory, by name: NumPy
  arrays for host memory, torch tensors for device memory (or ask: ``"numpy"``,
  ``"torch"``, ``"cupy"``). bfloat16 needs torch or cupy (NumPy has no bfloat16) — or the
  ``ml_dtypes`` package.
- Put the bundle in a message as you would a ``Buffer``; the receiver gets a
  :class:`SharedBundle` and opens it into a :class:`BundleLease`, whose ``tensors()`` are
  views of the sender's memory and whose ``copy_into(params)`` copies every tensor into
  arrays of yours by name (an engine's ``load_weights``); the lease goes back once the
  ``BundleLease`` is released (or collected) and its views are gone, as for a ``Lease`` —
  a view kept in a variable keeps it.
- On device memory, a :class:`CopyPlan` (``CopyPlan(layout, tensors)``, made once) copies
  every tensor in one kernel launch: ``BundleLease.copy_into(plan)`` loads them,
  ``Bundle.copy_from(plan)`` publishes them; :func:`bundle_parameters` moves a
  ``torch.nn.Module``'s parameters into a bundle, so that training writes it directly.
- A model in several allocations (``Node.borrow_tensors``: one bundle per allocation of
  PyTorch's caching allocator) is a :class:`BundleGroup`: one message field, received as a
  :class:`SharedBundleGroup`, opened in one call into a :class:`BundleGroupLease` and
  loaded by one :class:`CopyPlan` of the group's ``layout``; each bundle stays one lease.
- On device memory, ``open(stream=s)``, ``peer.call(..., stream=s)`` and
  ``bundle.wait_on(s)`` order by fences on a stream of yours instead of synchronising
  the device (see the README's *Device memory and streams*).

- Versioned syncs (a model in several bundles, or sent to several engines): a
  :class:`SyncSender` stamps each bundle of version N+1 (``sender.share(part, bundle)``);
  a :class:`SyncReceiver` stages the parts in bundles of its own node and commits N+1 only
  once every part has landed, so it is always on exactly N or N+1 (``receiver.version``,
  ``receiver.parts``). A received bundle's version is ``SharedBundle.version`` and
  ``BundleLease.version``.

On the wire a bundle is Rust's ``baton_actors::SharedBundle``: Rust and Python peers send
each other bundles. A received layout is checked (unique names, aligned, disjoint
tensors) on arrival and against the buffer when opened; a stamp is checked when opened.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional

from ._baton import (Buffer, BundleLayout, Lease, Shared, SyncStamp, _SyncSender, _SyncState,
                     open_all, release_all, wait_all_on)

__all__ = [
    "Bundle", "BundleGroup", "BundleGroupLease", "BundleLayout", "BundleLease", "CopyPlan",
    "SharedBundle", "SharedBundleGroup", "SyncReceiver", "SyncSender", "SyncStamp",
    "WritableBundle", "bundle_parameters",
]

_ITEMSIZE = {
    "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2,
    "uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8, "float64": 8,
}


def _nbytes(dtype: str, shape: tuple) -> int:
    n = _ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def _numpy_dtype(dtype: str) -> Any:
    import numpy as np

    if dtype != "bfloat16":
        return np.dtype(dtype)
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(
            "NumPy has no bfloat16: use tensors('torch') or tensors('cupy'), "
            "or install ml_dtypes"
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def _framework(params: Mapping[str, Any]) -> str:
    """`torch`, `cupy` or `numpy`: what the first of `params` is."""
    first = next(iter(params.values()), None)
    module = type(first).__module__.split(".")[0]
    return module if module in ("torch", "cupy") else "numpy"


def _is_torch(params: Mapping[str, Any]) -> bool:
    return _framework(params) == "torch"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


def _views(memory: Any, layout: BundleLayout, framework: Optional[str]) -> Dict[str, Any]:
    """Views of each tensor of ``layout`` in ``memory`` (a Buffer or a Lease of bytes)."""
    if framework is None:
        framework = "numpy" if memory.device[0] == "cpu" else "torch"
    if framework == "numpy":
        flat = memory.numpy()

        def cut(start, end, dtype, shape):
            return flat[start:end].view(_numpy_dtype(dtype)).reshape(shape)

    elif framework == "torch":
        import torch

        flat = torch.from_dlpack(memory)

        def cut(start, end, dtype, shape):
            return flat[start:end].view(getattr(torch, dtype)).view(shape)

    elif framework == "cupy":
        import cupy

        flat = cupy.from_dlpack(memory)

        def cut(start, end, dtype, shape):
            # cupy takes the ml_dtypes bfloat16 where NumPy has it; else it has none.
            return flat[start:end].view(_numpy_dtype(dtype)).reshape(shape)

    else:
        raise ValueError(f"unknown framework {framework!r}: numpy, torch or cupy")
    return {
        name: cut(offset, offset + _nbytes(dtype, shape), dtype, shape)
        for name, dtype, shape, offset in layout.tensors
    }


class CopyPlan:
    """Where each tensor of a bundle goes in your own torch tensors, checked once and copied
    as one kernel launch every sync: ``BundleLease.copy_into(plan)`` (loading weights) and
    ``Bundle.copy_from(plan)`` (publishing them) queue every copy on torch's current stream
    (or ``stream=``) with no per-tensor work in Python — a 20,000-tensor shard copies in
    about the time of one flat copy of its bytes.

    ``tensors`` maps names of ``layout`` to contiguous CUDA tensors of the same dtype and
    number of bytes (the shape may differ). ``layout`` may also be a bundle group's (a tuple
    of its bundles' layouts, :class:`BundleGroup`): the plan then copies between every
    bundle of the group and the tensors in one launch (``BundleGroupLease.copy_into``). The plan holds the tensors' storages, so their
    memory stays allocated while it lives; a tensor re-pointed afterwards (``p.data = ...``)
    is not followed: make a new plan. ``copy_into(dict)`` makes and keeps plans by itself
    for the last sets of tensors it saw (a few per bundle layout, up to 256 layouts)."""

    __slots__ = ("layout", "tensors", "_spans", "_keep", "_ptrs", "_plans")

    def __init__(self, layout: Any, tensors: Mapping[str, Any]) -> None:
        import torch

        # A bundle group's layouts (a tuple, one per part): the plan runs on its leases.
        parts = None if isinstance(layout, BundleLayout) else tuple(layout)
        where = _parts_index(parts) if parts is not None else None
        spans: List[list] = [[] for _ in (parts or (layout,))]
        keep = []
        for name, value in tensors.items():
            if where is None:
                part, (dtype, shape, offset) = 0, layout[name]
            else:
                if name not in where:
                    raise KeyError(name)
                part, dtype, shape, offset = where[name]
            n = _nbytes(dtype, shape)
            if not isinstance(value, torch.Tensor) or value.device.type != "cuda":
                raise TypeError(f"tensor {name!r}: a CopyPlan copies into CUDA torch tensors, "
                                f"not {type(value).__name__}")
            if value.dtype != getattr(torch, dtype) or not value.is_contiguous() \
                    or value.numel() * value.element_size() != n:
                raise ValueError(
                    f"tensor {name!r}: the bundle has {dtype} of {n} bytes; the tensor is "
                    f"{value.dtype} of {value.numel() * value.element_size()} bytes"
                    f"{'' if value.is_contiguous() else ', not contiguous'}")
            spans[part].append((value.data_ptr(), offset, n))
            keep.append(value.untyped_storage())
        self.layout = layout if parts is None else parts
        self.tensors = tensors
        self._spans = spans[0] if parts is None else spans
        self._keep = keep
        self._ptrs = [value.data_ptr() for value in tensors.values()]
        self._plans: Dict[int, Any] = {}

    def _run(self, memory: Any, stream: Any, into_memory: bool) -> None:
        """Runs on ``memory``: a lease or buffer, or a group's list of them."""
        device = (memory[0] if isinstance(memory, list) else memory).device[1]
        plan = self._plans.get(device)
        if plan is None:
            from ._baton import _CopyPlan

            plan = self._plans[device] = _CopyPlan(memory, self._spans, self._keep)
        if stream is None:
            import torch

            stream = torch.cuda.current_stream(device)
        plan.run(memory, stream, into_memory=into_memory)

    def _matches(self, layout: BundleLayout, params: Mapping[str, Any]) -> bool:
        # A layout received again is the same object (the codec keeps the recent ones).
        return (len(params) == len(self._ptrs)
                and (layout is self.layout or layout == self.layout)
                and all(a is b and a.data_ptr() == p for a, b, p
                        in zip(params.values(), self.tensors.values(), self._ptrs)))

    def __len__(self) -> int:
        return len(self._ptrs)

    def __repr__(self) -> str:
        parts = "" if isinstance(self.layout, BundleLayout) else f", {len(self.layout)} parts"
        return f"CopyPlan({len(self._ptrs)} tensors{parts})"


def _parts_index(layouts: tuple) -> Dict[str, tuple]:
    """Name -> (part, dtype, shape, offset) over a group's layouts; a name twice is refused."""
    where: Dict[str, tuple] = {}
    for part, layout in enumerate(layouts):
        for name, dtype, shape, offset in layout.tensors:
            if name in where:
                raise ValueError(f"tensor {name!r} is in two bundles of the group")
            where[name] = (part, dtype, shape, offset)
    return where


#: The plans `copy_into` made, by the id of their layout object, most recently used last
#: (an engine loads the same bundles into the same tensors every sync; a borrowed model
#: comes as one bundle per allocation, tens of them). A received layout that is the same
#: as one before is the same object (the codec keeps them), and a plan holds its layout,
#: so an id is not reused while its plan is here.
_PLANS: "OrderedDict[Any, List[CopyPlan]]" = OrderedDict()
#: The most plans kept.
_PLANS_KEPT = 256


def _plan_for(layout: Any, params: Mapping[str, Any]) -> Optional[CopyPlan]:
    """The plan for these destinations (``layout`` a bundle's, or a group's tuple of them),
    or None when one is not a contiguous CUDA tensor of its source's dtype and size (then
    each tensor is copied typed, converting)."""
    key = id(layout) if isinstance(layout, BundleLayout) else tuple(map(id, layout))
    plans = _PLANS.get(key)
    if plans is not None:
        _PLANS.move_to_end(key)
        for plan in plans:
            if plan._matches(layout, params):
                return plan
    try:
        plan = CopyPlan(layout, params)
    except (TypeError, ValueError):
        return None
    plans = _PLANS.setdefault(key, [])
    plans.insert(0, plan)
    del plans[4:]  # the same bundle into a few sets of tensors
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)
    return plan


def _copy_by_name(lease: Lease, layout: BundleLayout, params: Any, stream: Any,
                  into_memory: bool) -> None:
    """A lease's copies from (``into_memory``: into) ``params`` by name: a plan (made and
    kept for contiguous torch tensors of the bundle's dtypes) as one launch on ``stream``,
    otherwise one typed copy per tensor."""
    if isinstance(params, CopyPlan):
        return params._run(lease, stream, into_memory=into_memory)
    framework = _framework(params)
    if framework == "torch" and lease.device[0] == "cuda":
        plan = _plan_for(layout, params)
        if plan is not None:
            return plan._run(lease, stream, into_memory=into_memory)
    views = _views(lease, layout, framework)
    try:
        for name, value in params.items():
            dst, src = (views[name], value) if into_memory else (value, views[name])
            if framework == "torch":
                dst.copy_(src)
            else:
                dst[...] = src
    finally:
        views.clear()


def _copy_group_by_name(leases: List[Lease], layouts: tuple, params: Any, stream: Any,
                        into_memory: bool) -> None:
    """``_copy_by_name`` over a group's leases: a plan over every bundle as one launch, or
    each bundle's tensors copied by name (a name in no bundle: ``KeyError``)."""
    if isinstance(params, CopyPlan):
        return params._run(leases, stream, into_memory=into_memory)
    if _framework(params) == "torch" and leases[0].device[0] == "cuda":
        plan = _plan_for(layouts, params)  # a name in no bundle: KeyError, from the plan
        if plan is not None:
            return plan._run(leases, stream, into_memory=into_memory)
    where = _parts_index(layouts)
    for name in params:
        if name not in where:
            raise KeyError(name)
    for layout, lease in zip(layouts, leases):
        names = [n for n, *_ in layout.tensors if n in params]
        if names:
            _copy_by_name(lease, layout, {n: params[n] for n in names}, stream, into_memory)


def bundle_parameters(node: Any, module: Any, *, buffers: bool = False) -> "Bundle":
    """Re-homes a ``torch.nn.Module``'s parameters (and, with ``buffers``, its buffers) into
    one new bundle of ``node``, once: each is copied into the bundle and the module's
    tensor is pointed at its view (``p.data = view``), so the optimizer's steps write the
    bundle itself and a sync sends it with no copy on the trainer's side. Returns the
    bundle; its layout's names are ``module.named_parameters()``'s (a tied weight once).

    Call it before building the optimizer or after: the optimizer keeps the parameter
    objects, whose data is now the bundle's. Between syncs, wait for ``returned()`` (and
    ``wait_on`` the training stream, stream-ordered) before the next step writes the
    weights: the engine may still be reading them. The bundle must be on the module's
    device (a CUDA node for a CUDA module)."""
    import torch

    named = list(module.named_parameters())
    if buffers:
        named += [(n, b) for n, b in module.named_buffers() if b is not None]
    spec = [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in named]
    bundle = node.allocate_bundle(spec)
    views = bundle.tensors("torch")
    with torch.no_grad():
        for name, t in named:
            view = views[name]
            if view.device != t.device:
                bundle.release()
                raise ValueError(f"{name} is on {t.device}; the bundle is on {view.device}: "
                                 "bundle a module on its node's device")
            view.copy_(t)
            t.data = view
    return bundle


class Bundle:
    """The owner's bundle: one ``Buffer`` of bytes and the :class:`BundleLayout` of the
    tensors in it (made by ``Node.allocate_bundle``). Leases, ``returned()`` and
    ``release()`` work as for the buffer."""

    __slots__ = ("_buffer", "_layout")

    def __init__(self, buffer: Buffer, layout: BundleLayout) -> None:
        if buffer.dtype != "uint8" or buffer.nbytes < layout.nbytes:
            raise ValueError(
                f"a bundle of {layout.nbytes} bytes needs a uint8 buffer at least that "
                f"large, not {buffer!r}"
            )
        self._buffer = buffer
        self._layout = layout

    @property
    def buffer(self) -> Buffer:
        """The buffer that holds every tensor."""
        return self._buffer

    @property
    def layout(self) -> BundleLayout:
        """Where each tensor is."""
        return self._layout

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    @property
    def device(self) -> tuple:
        return self._buffer.device

    def tensors(self, framework: Optional[str] = None) -> Dict[str, Any]:
        """A view of each tensor of this process's memory, by name, in layout order.
        NumPy views are read-only while a lease is out (writing would race the holders:
        ``returned()`` first); torch and CuPy views of device memory cannot be made
        read-only — write them only after ``returned()``, or write with ``copy_from``,
        which is refused while a lease is out."""
        return _views(self._buffer, self._layout, framework)

    @property
    def leases_out(self) -> int:
        """Leases on the bundle now out (as ``Buffer.leases_out``)."""
        return self._buffer.leases_out

    def wait_on(self, stream: Any) -> None:
        """Orders the work queued on ``stream`` from now on after the importers' work on the
        bundle (see ``Buffer.wait_on``): call it after ``returned()``, before writing the
        bundle on that stream again."""
        self._buffer.wait_on(stream)

    def returned(self, timeout: float) -> None:
        """Waits until every lease on the bundle is back (see ``Buffer.returned``)."""
        self._buffer.returned(timeout)

    def copy_into(self, params: Any, stream: Any = None) -> None:
        """Copies the bundle's tensors into yours, by name (as ``BundleLease.copy_into``,
        from this process's own bundle: a checkpoint restored, a plan measured alone)."""
        if isinstance(params, CopyPlan):
            return params._run(self._buffer, stream, into_memory=False)
        if self.device[0] == "cuda" and _is_torch(params):
            plan = _plan_for(self._layout, params)
            if plan is not None:
                return plan._run(self._buffer, stream, into_memory=False)
        views = self.tensors(_framework(params))
        try:
            for name, dst in params.items():
                if hasattr(dst, "copy_"):
                    dst.copy_(views[name])
                else:
                    dst[...] = views[name]
        finally:
            views.clear()

    def copy_from(self, params: Any, stream: Any = None) -> None:
        """Copies your tensors into the bundle, by name — ``params`` a :class:`CopyPlan` of
        this layout, or a mapping of names to tensors (or arrays) — as a trainer publishes
        its weights; refused while a lease is out (wait for ``returned()``). Device memory:
        one kernel launch on ``stream`` (default torch's current stream) for a plan or
        same-dtype contiguous torch tensors; otherwise one typed copy per tensor."""
        if isinstance(params, CopyPlan):
            return params._run(self._buffer, stream, into_memory=True)
        if self.device[0] == "cuda" and _is_torch(params):
            plan = _plan_for(self._layout, params)
            if plan is not None:
                return plan._run(self._buffer, stream, into_memory=True)
        if self._buffer.leases_out:
            raise BufferError(f"the bundle has {self._buffer.leases_out} lease(s) out: wait "
                              "for returned() before writing it")
        views = self.tensors(_framework(params))
        try:
            for name, src in params.items():
                dst = views[name]
                if hasattr(dst, "copy_"):
                    dst.copy_(src)
                else:
                    dst[...] = src
        finally:
            views.clear()

    def returned_async(self, timeout: float) -> Any:
        """``returned`` under asyncio."""
        return self._buffer.returned_async(timeout)

    def share_mut(self) -> "WritableBundle":
        """The bundle, to put in a message in its place when its receiver is to write it
        — an engine lending its weights to the trainer (GUIDE, *An engine lends its
        weights*): the lease it grants is the one lease on the bundle while it is out
        (``Buffer.share_mut``; sending it raises ``LeaseConflict`` while another is out).
        The receiver opens it ``writable=True`` and writes with ``copy_from``."""
        return WritableBundle(self)

    def release(self) -> bool:
        """Lets go of the buffer (see ``Buffer.release``)."""
        return self._buffer.release()

    def __baton_wire__(self) -> dict:
        # What Rust's `SharedBundle` is on the wire (the codec encodes it).
        return {"baton.bundle": self._layout, "buffer": self._buffer}

    def __repr__(self) -> str:
        return f"Bundle({len(self._layout)} tensors, {self._buffer!r})"


class WritableBundle:
    """A bundle or bundle group to be leased writable (``share_mut()``), for a message
    field: its receiver gets a ``SharedBundle`` (``SharedBundleGroup``) as for any, and
    the exporter's ledger keeps the lease the only one on each buffer while it is out."""

    __slots__ = ("_bundle",)

    def __init__(self, bundle: Any) -> None:
        self._bundle = bundle

    @property
    def bundle(self) -> Any:
        """The ``Bundle`` or ``BundleGroup``."""
        return self._bundle

    def __baton_wire__(self) -> dict:
        if isinstance(self._bundle, BundleGroup):
            return {"baton.bundles": [WritableBundle(b).__baton_wire__() for b in self._bundle]}
        return {"baton.bundle": self._bundle.layout, "buffer": self._bundle.buffer.share_mut()}

    def __repr__(self) -> str:
        return f"WritableBundle({self._bundle!r})"


class SharedBundle:
    """A received bundle, not opened yet (a ``baton.Shared``, its layout, and the stamp of
    the versioned sync it is a part of, if any)."""

    __slots__ = ("_layout", "_shared", "_stamp")

    def __init__(self, layout: BundleLayout, shared: Shared,
                 stamp: Optional[SyncStamp] = None) -> None:
        self._layout = layout
        self._shared = shared
        self._stamp = stamp

    @property
    def layout(self) -> BundleLayout:
        return self._layout

    @property
    def stamp(self) -> Optional[SyncStamp]:
        """The stamp of its versioned sync, as the sender wrote it (checked when opened)."""
        return self._stamp

    @property
    def version(self) -> Optional[int]:
        """The version it is a part of (None: not sent as part of a versioned sync)."""
        return None if self._stamp is None else self._stamp.version

    @property
    def nbytes(self) -> int:
        return self._shared.nbytes

    def open(self, writable: bool = False, stream: Any = None) -> "BundleLease":
        """Opens the bundle's lease (see ``Shared.open``; ``stream`` makes it
        stream-ordered: no host synchronisation, the release fence recorded on that stream).
        Raises ``ValueError`` when the layout reaches past the buffer, ``Malformed`` when
        the stamp does not check — and gives the lease back."""
        if self._stamp is not None:
            try:
                self._stamp.check()
            except Exception:
                self._shared.release()
                raise
        if self._layout.nbytes > self._shared.nbytes:
            self._shared.release()
            raise ValueError(
                f"the bundle's tensors need {self._layout.nbytes} bytes; its buffer has "
                f"{self._shared.nbytes}"
            )
        return BundleLease(self._layout, self._shared.open(writable=writable, stream=stream),
                           self._stamp)

    def release(self) -> bool:
        """Gives the lease back unopened."""
        return self._shared.release()

    def __repr__(self) -> str:
        return f"SharedBundle({len(self._layout)} tensors, {self._shared!r})"


class BundleLease:
    """An opened bundle: one ``Lease`` and the layout of its tensors. A context manager,
    released as a ``Lease`` is (the lease goes back once its views are gone)."""

    __slots__ = ("_layout", "_lease", "_stamp")

    def __init__(self, layout: BundleLayout, lease: Lease,
                 stamp: Optional[SyncStamp] = None) -> None:
        self._layout = layout
        self._lease = lease
        self._stamp = stamp

    @property
    def layout(self) -> BundleLayout:
        return self._layout

    @property
    def version(self) -> Optional[int]:
        """The version this bundle is a part of (None: not sent by a ``SyncSender``)."""
        return None if self._stamp is None else self._stamp.version

    @property
    def stamp(self) -> Optional[SyncStamp]:
        """The whole stamp of its versioned sync (checked when opened)."""
        return self._stamp

    @property
    def lease(self) -> Lease:
        """The lease on the whole buffer."""
        return self._lease

    @property
    def device(self) -> tuple:
        return self._lease.device

    def tensors(self, framework: Optional[str] = None) -> Dict[str, Any]:
        """A view of each tensor of the exporter's memory, by name, in layout order
        (read-only unless opened writable)."""
        return _views(self._lease, self._layout, framework)

    def copy_into(self, params: Any, stream: Any = None) -> None:
        """Copies each tensor into the array of the same name in ``params`` — a
        :class:`CopyPlan`, a :class:`Bundle` of the same layout, or a mapping of names to
        NumPy arrays, torch tensors or cupy arrays of the tensor's shape — as an engine's
        ``load_weights`` does, and keeps no view: the lease can go back as soon as this
        returns. Raises ``KeyError`` for a name the bundle does not have.

        Device memory: into a plan, or contiguous torch tensors of the bundle's dtypes, one
        kernel launch for every tensor (the plan for a mapping is made once and kept for
        the next syncs); into a bundle of the same layout, one contiguous copy; otherwise
        one typed copy per tensor (converting dtypes). Copies are queued on ``stream``
        (default torch's current stream). A lease opened stream-ordered (``open(stream=s)``)
        records its release fence on ``s`` only: run its copies on ``s`` too (pass
        ``stream=s``, or make ``s`` torch's current stream), as for its views."""
        if isinstance(params, Bundle) and params.layout == self._layout:
            return self._copy_whole(params, stream)
        _copy_by_name(self._lease, self._layout, params, stream, into_memory=False)

    def copy_from(self, params: Any, stream: Any = None) -> None:
        """Writes your tensors into the exporter's bundle, by name — the lease opened
        ``writable`` — as a trainer writes the weights an engine lent it (GUIDE, *An engine
        lends its weights*). ``params``: a :class:`CopyPlan` of this layout, or a mapping of
        names to torch tensors, NumPy or cupy arrays of the tensor's shape. Device memory:
        one kernel launch for every tensor of a plan or of contiguous torch tensors of the
        bundle's dtypes, queued on ``stream`` (default torch's current stream); otherwise
        one typed copy per tensor. Raises ``BufferError`` for a lease opened read-only,
        ``KeyError`` for a name the bundle does not have. Opened stream-ordered, the
        release fence is recorded on the lease's stream: write on that stream."""
        if not self._lease.writable:
            raise BufferError(f"lease {self._lease.lease_id} was opened read-only: open it "
                              "with writable=True to write into it")
        _copy_by_name(self._lease, self._layout, params, stream, into_memory=True)

    def _copy_whole(self, bundle: "Bundle", stream: Any) -> None:
        n = self._layout.nbytes
        if self.device[0] == "cpu":
            bundle.buffer.numpy()[:n] = self._lease.numpy()[:n]
            return
        import torch

        with torch.cuda.stream(stream) if stream is not None else _nothing():
            torch.from_dlpack(bundle.buffer)[:n].copy_(torch.from_dlpack(self._lease)[:n])

    def release(self) -> bool:
        """Gives the lease back (deferred while views are alive: see ``Lease.release``)."""
        return self._lease.release()

    def __enter__(self) -> "BundleLease":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self._lease.release()
        return False

    def __repr__(self) -> str:
        return f"BundleLease({len(self._layout)} tensors, {self._lease!r})"


class BundleGroup:
    """Several bundles lent as one: one message field and **one lease over all their
    buffers**, opened by the receiver in one call into one :class:`BundleGroupLease`,
    loaded with one :class:`CopyPlan` (one kernel launch for every tensor of every bundle)
    and given back with one ``Release``. What ``Node.borrow_tensors`` returns — a model's
    tensors lie in many allocations of PyTorch's caching allocator, one bundle each — and
    what ``BundleGroup([b1, b2, ...])`` makes of bundles of yours. It is also a sequence
    of its bundles. The receiver's lease goes back once every bundle of it is released
    (a ``Lease`` of one bundle released alone waits for the others), and a revoke of any
    bundle asks for the whole lease. ``returned()`` waits until every bundle is back.
    Over a link to another host each bundle crosses as its own copy and lease."""

    __slots__ = ("_bundles", "_layout")

    def __init__(self, bundles: Any) -> None:
        self._bundles = tuple(bundles)
        if not self._bundles or not all(isinstance(b, Bundle) for b in self._bundles):
            raise TypeError("a BundleGroup is made of one baton.Bundle or more")
        self._layout = tuple(b.layout for b in self._bundles)
        _parts_index(self._layout)  # a name in two bundles is refused here

    @property
    def bundles(self) -> tuple:
        return self._bundles

    @property
    def layout(self) -> tuple:
        """The layouts of its bundles, in order (what a :class:`CopyPlan` takes)."""
        return self._layout

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bundles)

    @property
    def device(self) -> tuple:
        return self._bundles[0].device

    def tensors(self, framework: Optional[str] = None) -> Dict[str, Any]:
        """Views of every tensor of every bundle, by name (see ``Bundle.tensors``)."""
        out: Dict[str, Any] = {}
        for b in self._bundles:
            out.update(b.tensors(framework))
        return out

    @property
    def leases_out(self) -> int:
        return sum(b.leases_out for b in self._bundles)

    def wait_on(self, stream: Any) -> None:
        """``Bundle.wait_on`` for every bundle, in one call: ``stream`` waits once for the
        release fences of all of them (the group's lease comes back with one), not once
        per bundle."""
        wait_all_on([b.buffer for b in self._bundles], stream)

    def returned(self, timeout: float) -> None:
        """Waits until every lease on every bundle is back, within ``timeout`` in all."""
        import time

        give_up = time.monotonic() + timeout
        for b in self._bundles:
            b.returned(max(0.0, give_up - time.monotonic()))

    def copy_from(self, params: Any, stream: Any = None) -> None:
        """Copies your tensors into the bundles, by name (see ``Bundle.copy_from``): a
        :class:`CopyPlan` of ``layout`` or same-dtype contiguous torch tensors in one
        kernel launch; refused while a lease is out."""
        if self.leases_out:
            raise BufferError(f"the group has {self.leases_out} lease(s) out: wait for "
                              "returned() before writing it")
        if isinstance(params, CopyPlan):
            return params._run([b.buffer for b in self._bundles], stream, into_memory=True)
        if self.device[0] == "cuda" and _is_torch(params):
            plan = _plan_for(self._layout, params)
            if plan is not None:
                return plan._run([b.buffer for b in self._bundles], stream, into_memory=True)
        for b in self._bundles:
            b.copy_from({n: params[n] for n, *_ in b.layout.tensors if n in params}, stream)

    def share_mut(self) -> WritableBundle:
        """The group, to put in a message in its place when its receiver is to write it
        (see ``Bundle.share_mut``): one writable lease over every bundle."""
        return WritableBundle(self)

    def release(self) -> bool:
        """Lets go of every bundle: whether each was still held."""
        return all([b.release() for b in self._bundles])

    def __len__(self) -> int:
        return len(self._bundles)

    def __iter__(self) -> Any:
        return iter(self._bundles)

    def __getitem__(self, i: int) -> Bundle:
        return self._bundles[i]

    def __baton_wire__(self) -> dict:
        # `{"baton.bundles": [bundle, ...]}`, each what Rust's `SharedBundle` is.
        return {"baton.bundles": [b.__baton_wire__() for b in self._bundles]}

    def __repr__(self) -> str:
        return (f"BundleGroup({len(self._bundles)} bundles, "
                f"{sum(len(l) for l in self._layout)} tensors)")


class SharedBundleGroup:
    """A received :class:`BundleGroup`, not opened yet: its bundles' leases."""

    __slots__ = ("_layout", "_shared", "_stamps", "_parts")

    def __init__(self, parts: List[SharedBundle]) -> None:
        parts = tuple(parts)
        self._layout = tuple(p._layout for p in parts)
        self._shared = [p._shared for p in parts]
        stamps = [p._stamp for p in parts]
        self._stamps = stamps if any(s is not None for s in stamps) else None
        self._parts: Optional[tuple] = parts

    @classmethod
    def _received(cls, layouts: tuple, shared: list,
                  stamps: Optional[list]) -> "SharedBundleGroup":
        # What the codec makes of a group on arrival: its layouts, buffers and stamps (None:
        # none stamped), and no object per bundle until `parts` asks for them.
        group = cls.__new__(cls)
        group._layout, group._shared, group._stamps, group._parts = layouts, shared, stamps, None
        return group

    @property
    def parts(self) -> tuple:
        """Its bundles, each a :class:`SharedBundle`."""
        if self._parts is None:
            stamps = self._stamps or [None] * len(self._shared)
            self._parts = tuple(SharedBundle(layout, shared, stamp) for layout, shared, stamp
                                in zip(self._layout, self._shared, stamps))
        return self._parts

    @property
    def layout(self) -> tuple:
        """The layouts of its bundles, in order (what a :class:`CopyPlan` takes)."""
        return self._layout

    @property
    def nbytes(self) -> int:
        return sum(shared.nbytes for shared in self._shared)

    def open(self, writable: bool = False, stream: Any = None) -> "BundleGroupLease":
        """Opens every bundle in one call (see ``SharedBundle.open``): without ``stream``
        the host waits once for all of them. All or nothing: if a bundle's stamp or size
        does not check, or one cannot be opened, every lease of the group goes back and the
        error is raised."""
        try:
            for stamp in self._stamps or ():
                if stamp is not None:
                    stamp.check()
            leases = open_all(self._shared, writable=writable, stream=stream,
                              layouts=self._layout)
        except Exception:
            self.release()
            raise
        return BundleGroupLease(self._layout, leases, writable)

    def release(self) -> bool:
        """Gives every lease back unopened (those opened already are left alone)."""
        return all([shared.release() for shared in self._shared])

    def __len__(self) -> int:
        return len(self._shared)

    def __repr__(self) -> str:
        return (f"SharedBundleGroup({len(self._shared)} bundles, "
                f"{sum(len(l) for l in self._layout)} tensors)")


class BundleGroupLease:
    """An opened bundle group: a ``Lease`` per bundle and their layouts; one
    ``copy_into``, one ``release``. A context manager."""

    __slots__ = ("_layout", "_leases", "_writable")

    def __init__(self, layout: tuple, leases: List[Lease], writable: Optional[bool] = None) -> None:
        self._layout = layout
        self._leases = leases
        # Whether every lease was opened writable (None: look at each when writing).
        self._writable = writable

    @property
    def layout(self) -> tuple:
        return self._layout

    @property
    def leases(self) -> List[Lease]:
        return list(self._leases)

    @property
    def device(self) -> tuple:
        return self._leases[0].device

    def tensors(self, framework: Optional[str] = None) -> Dict[str, Any]:
        """Views of every tensor of the exporter's memory, by name (see
        ``BundleLease.tensors``)."""
        out: Dict[str, Any] = {}
        for layout, lease in zip(self._layout, self._leases):
            out.update(_views(lease, layout, framework))
        return out

    def copy_into(self, params: Any, stream: Any = None) -> None:
        """Copies each tensor into yours by name, as ``BundleLease.copy_into``: into a
        :class:`CopyPlan` of ``layout`` (or same-dtype contiguous torch tensors, whose plan
        is made once and kept), one kernel launch for every tensor of every bundle;
        otherwise one typed copy per tensor. Raises ``KeyError`` for a name in no bundle."""
        _copy_group_by_name(self._leases, self._layout, params, stream, into_memory=False)

    def copy_from(self, params: Any, stream: Any = None) -> None:
        """Writes your tensors into the exporter's bundles by name, the group opened
        ``writable`` (see ``BundleLease.copy_from``): from a :class:`CopyPlan` of ``layout``
        or same-dtype contiguous torch tensors, one kernel launch for every tensor of every
        bundle; otherwise one typed copy per tensor."""
        if not self._writable:
            for lease in self._leases:
                if not lease.writable:
                    raise BufferError(f"lease {lease.lease_id} was opened read-only: open "
                                      "the group with writable=True to write into it")
        _copy_group_by_name(self._leases, self._layout, params, stream, into_memory=True)

    def release(self) -> bool:
        """Gives every lease back (each deferred while views of it are alive), in one call:
        after one device synchronisation for all of them when opened without a stream."""
        return release_all(self._leases)

    def __enter__(self) -> "BundleGroupLease":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.release()
        return False

    def __repr__(self) -> str:
        return (f"BundleGroupLease({len(self._leases)} bundles, "
                f"{sum(len(l) for l in self._layout)} tensors)")


class _Stamped:
    """A bundle with the stamp of a versioned sync, as a message field (what
    ``SyncSender.share`` gives)."""

    __slots__ = ("_bundle", "_stamp")

    def __init__(self, bundle: Bundle, stamp: SyncStamp) -> None:
        self._bundle = bundle
        self._stamp = stamp

    @property
    def stamp(self) -> SyncStamp:
        return self._stamp

    def __baton_wire__(self) -> dict:
        wire = self._bundle.__baton_wire__()
        wire["baton.sync"] = self._stamp
        return wire

    def __repr__(self) -> str:
        return f"{self._bundle!r} stamped {self._stamp!r}"


class SyncSender:
    """The sending side of versioned syncs: version N+1 of a whole (a model's weights) in
    ``parts`` bundles, to one or more receivers. ``begin(parts, deadline)`` starts the sync
    (refused with ``InfeasibleDeadline`` when ``deadline`` seconds cannot be met: past,
    under ``min_deadline``, over a day); ``share(part, bundle)`` gives the message field
    of each part (stamped; sent to every receiver, in messages of your own);
    ``finish()`` once every part was sent makes N+1 the sender's version. Past its deadline
    a sync stamps nothing more (``SyncOver``) and receivers drop what they staged of it;
    ``cancel()`` gives it up at once and returns ``(version, sync)`` for the receivers'
    ``SyncReceiver.cancel``.

    ``version`` is what the receivers have (0: nothing yet); a restarted sender starts from
    the version its receivers report."""

    __slots__ = ("_inner",)

    def __init__(self, version: int = 0, min_deadline: Optional[float] = None) -> None:
        self._inner = _SyncSender(version, min_deadline)

    @property
    def version(self) -> int:
        """The version the last finished sync made."""
        return self._inner.version

    @property
    def pending(self) -> Optional[int]:
        """The version the sync under way makes, if one is."""
        return self._inner.pending

    def begin(self, parts: int, deadline: float) -> int:
        """Begins the next version's sync, due in ``deadline`` seconds; returns its
        version."""
        return self._inner.begin(parts, deadline)

    def share(self, part: int, bundle: Bundle) -> _Stamped:
        """Part ``part`` of the sync under way, as a message field."""
        return _Stamped(bundle, self._inner.stamp(part))

    def finish(self) -> int:
        """Ends the sync once every part was shared: returns the new version."""
        return self._inner.finish()

    def cancel(self) -> Optional[tuple]:
        """Gives the sync under way up: ``(version, sync)`` to send the receivers, or
        None."""
        return self._inner.cancel()


class SyncReceiver:
    """The receiving side of versioned syncs: always on exactly one version, whole.

    ``receive(shared_bundle)`` checks the part's stamp (refusing stale, skipping, replaced,
    cancelled, expired, inconsistent, malformed and unstamped parts with a ``Version``
    error — the receiver keeps its version, the lease goes back), copies it into a staging
    bundle of ``node`` and gives the lease back; when the last part of the sync lands, the
    staging bundles become the committed ones at once. ``parts`` are the committed
    bundles (this process's memory: readable after the sender is gone); ``version`` their
    version (0: none yet). It costs a second copy of the model in ``node``'s memory.

    Load the committed parts into an engine's parameters with ``parts[i].copy_into(params)``
    after a commit (``receive`` returns the new version then, else None)."""

    __slots__ = ("_node", "_state", "_front", "_back")

    def __init__(self, node: Any) -> None:
        self._node = node
        self._state = _SyncState()
        self._front: list = []
        self._back: list = []

    @property
    def version(self) -> int:
        """The committed version."""
        return self._state.version

    @property
    def parts(self) -> list:
        """The committed version's bundles, by part index."""
        return list(self._front)

    @property
    def staging(self) -> Optional[tuple]:
        """``(version, sync, landed, parts)`` of the sync being staged, or None."""
        return self._state.staging

    def receive(self, part: SharedBundle, stream: Any = None) -> Optional[int]:
        """Takes a part of a sync; returns the version it committed, or None while parts
        are missing."""
        try:
            stamp = self._state.admit(part.stamp)
        except BaseException:
            part.release()  # refused: the lease goes back now
            raise
        back = self._back
        back.extend([None] * (stamp.parts - len(back)))
        del back[stamp.parts:]
        with part.open() as lease:
            staged = back[stamp.part]
            if staged is None or staged.layout != lease.layout or staged.leases_out:
                staged = back[stamp.part] = self._node.allocate_bundle(lease.layout)
            lease.copy_into(staged, stream)
            if lease.device[0] == "cuda":
                import torch

                (stream or torch.cuda.current_stream(lease.device[1])).synchronize()
        committed = self._state.landed(stamp)
        if committed is not None:
            self._front, self._back = list(back), list(self._front)
        return committed

    def cancel(self, cancel: tuple) -> bool:
        """Drops the staged sync when ``cancel`` — ``SyncSender.cancel()``'s
        ``(version, sync)`` — names it."""
        version, sync = cancel
        return self._state.cancel(version, sync)

    def __repr__(self) -> str:
        return f"SyncReceiver(version {self.version}, {len(self._front)} parts)"
