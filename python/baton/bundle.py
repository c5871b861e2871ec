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
- On device memory, ``open(stream=s)``, ``peer.call(..., stream=s)`` and
  ``bundle.wait_on(s)`` order by fences on a stream of yours instead of synchronising
  the device (see the README's *Device memory and streams*).

On the wire a bundle is Rust's ``baton_actors::SharedBundle``: Rust and Python peers send
each other bundles. A received layout is checked (unique names, aligned, disjoint
tensors) on arrival and against the buffer when opened.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from ._baton import Buffer, BundleLayout, Lease, Shared

__all__ = ["Bundle", "BundleLayout", "BundleLease", "SharedBundle"]

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


class _TorchPlan:
    """How to copy a bundle into torch tensors of the same dtypes and sizes, as bytes: one
    split of the lease's bytes; then each large tensor copied on its own (a device-to-device
    memcpy, at the bandwidth of a flat copy), and the small ones in one fused copy
    (``_foreach_copy_``) of 8-byte words where sizes allow, of bytes otherwise — a launch
    per small tensor would cost more than its copy."""

    __slots__ = ("layout", "params", "sizes", "end", "large", "groups")

    def __init__(self, layout, params, sizes, end, large, groups) -> None:
        self.layout, self.params, self.sizes, self.end = layout, list(params.values()), sizes, end
        self.large, self.groups = large, groups

    def matches(self, layout: BundleLayout, params: Mapping[str, Any]) -> bool:
        # A layout received again is the same object (the codec keeps the last few).
        return (len(params) == len(self.params)
                and all(a is b for a, b in zip(params.values(), self.params))
                and (layout is self.layout or layout == self.layout))

    def copy(self, lease: Lease) -> None:
        import torch

        # The split alternates the gap before a tensor and the tensor's bytes.
        chunks = torch.from_dlpack(lease)[: self.end].split(self.sizes)
        for dst, i in self.large:
            dst.copy_(chunks[i])
        for dtype, dst, index in self.groups:
            torch._foreach_copy_(dst, [chunks[i].view(dtype) for i in index])


#: Tensors at least this large are copied on their own (see `_TorchPlan`).
_LARGE = 1 << 20

#: The last few plans made (an engine loads the same bundle into the same tensors).
_PLANS: list = []


def _torch_plan(layout: BundleLayout, params: Mapping[str, Any]) -> Optional[_TorchPlan]:
    """The byte-copy plan for these destinations, or None when one is not a contiguous
    tensor of its source's dtype and size (then each tensor is copied typed, converting)."""
    import torch

    for plan in _PLANS:
        if plan.matches(layout, params):
            return plan
    spans = []
    for name, value in params.items():
        dtype, shape, offset = layout[name]
        n = _nbytes(dtype, shape)
        if (not isinstance(value, torch.Tensor) or value.dtype != getattr(torch, dtype)
                or not value.is_contiguous() or value.numel() * value.element_size() != n):
            return None
        spans.append((offset, n, value))
    spans.sort(key=lambda span: span[0])
    sizes, at, large = [], 0, []
    words = (torch.int64, [], [])
    rest = (torch.uint8, [], [])
    for offset, n, value in spans:
        sizes += [offset - at, n]
        at = offset + n
        data = value.view(-1).view(torch.uint8)
        if n >= _LARGE:
            large.append((data, len(sizes) - 1))
            continue
        # Offsets are multiples of 256 and torch's allocations of 512: only the size decides.
        group = words if n % 8 == 0 and value.data_ptr() % 8 == 0 else rest
        group[1].append(data.view(group[0]))
        group[2].append(len(sizes) - 1)
    groups = [g for g in (words, rest) if g[1]]
    plan = _TorchPlan(layout, params, sizes, at, large, groups)
    _PLANS.insert(0, plan)
    del _PLANS[4:]
    return plan


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
        """A view of each tensor of this process's memory, by name, in layout order
        (writable while no lease is out)."""
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

    def returned_async(self, timeout: float) -> Any:
        """``returned`` under asyncio."""
        return self._buffer.returned_async(timeout)

    def release(self) -> bool:
        """Lets go of the buffer (see ``Buffer.release``)."""
        return self._buffer.release()

    def __baton_wire__(self) -> dict:
        # What Rust's `SharedBundle` is on the wire (the codec encodes it).
        return {"baton.bundle": self._layout, "buffer": self._buffer}

    def __repr__(self) -> str:
        return f"Bundle({len(self._layout)} tensors, {self._buffer!r})"


class SharedBundle:
    """A received bundle, not opened yet (a ``baton.Shared`` and its layout)."""

    __slots__ = ("_layout", "_shared")

    def __init__(self, layout: BundleLayout, shared: Shared) -> None:
        self._layout = layout
        self._shared = shared

    @property
    def layout(self) -> BundleLayout:
        return self._layout

    @property
    def nbytes(self) -> int:
        return self._shared.nbytes

    def open(self, writable: bool = False, stream: Any = None) -> "BundleLease":
        """Opens the bundle's lease (see ``Shared.open``; ``stream`` makes it
        stream-ordered: no host synchronisation, the release fence recorded on that stream).
        Raises ``ValueError`` — and gives the lease back — when the layout reaches past the
        buffer."""
        if self._layout.nbytes > self._shared.nbytes:
            self._shared.release()
            raise ValueError(
                f"the bundle's tensors need {self._layout.nbytes} bytes; its buffer has "
                f"{self._shared.nbytes}"
            )
        return BundleLease(self._layout, self._shared.open(writable=writable, stream=stream))

    def release(self) -> bool:
        """Gives the lease back unopened."""
        return self._shared.release()

    def __repr__(self) -> str:
        return f"SharedBundle({len(self._layout)} tensors, {self._shared!r})"


class BundleLease:
    """An opened bundle: one ``Lease`` and the layout of its tensors. A context manager,
    released as a ``Lease`` is (the lease goes back once its views are gone)."""

    __slots__ = ("_layout", "_lease")

    def __init__(self, layout: BundleLayout, lease: Lease) -> None:
        self._layout = layout
        self._lease = lease

    @property
    def layout(self) -> BundleLayout:
        return self._layout

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

    def copy_into(self, params: Mapping[str, Any]) -> None:
        """Copies each tensor into the array of the same name in ``params`` — NumPy arrays,
        torch tensors or cupy arrays, of the tensor's shape — as an engine's
        ``load_weights`` does, and keeps no view: the lease can go back as soon as this
        returns. Raises ``KeyError`` for a name the bundle does not have.

        Into torch tensors of the bundle's dtypes, contiguous: copies of their bytes — a
        memcpy for each tensor of 1 MiB or more, one fused ``torch._foreach_copy_`` for the
        smaller ones — with the plan for these tensors kept for the next sync; otherwise one
        typed copy per tensor (converting dtypes). Copies are queued on torch's current
        stream."""
        first = next(iter(params.values()), None)
        module = type(first).__module__.split(".")[0]
        framework = module if module in ("torch", "cupy") else "numpy"
        if framework == "torch":
            plan = _torch_plan(self._layout, params)
            if plan is not None:
                return plan.copy(self._lease)
        views = _views(self._lease, self._layout, framework)
        try:
            for name, dst in params.items():
                src = views[name]
                if framework == "torch":
                    dst.copy_(src)
                else:
                    dst[...] = src
        finally:
            views.clear()

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
