"""Type stubs of the extension module `baton._baton` (re-exported by `baton`)."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any, Awaitable, Iterable, Literal, Mapping, Optional, Sequence, SupportsIndex, Tuple, TypedDict, Union

import baton.bundle

__version__: str
#: The MessagePack extension type of a buffer field (its data: the buffer's index among
#: the message's buffers, a big-endian u32).
MSGPACK_SHARED_EXT: int

#: An element type: a name ("float32"), a NumPy dtype or scalar type, or a torch dtype.
DTypeLike = Any
#: Values a message may hold: None, bool, int (64-bit), float, str, bytes, bytearray,
#: list, tuple, dict, Buffer (leased to the receiver), and nested combinations.
Value = Any
Device = Tuple[str, int]
#: A CUDA stream of the device's primary context: a ``torch.cuda.Stream``, a
#: ``cupy.cuda.Stream`` (kept alive by Baton once named), or a raw ``CUstream`` handle
#: (which must stay alive for the life of the process).
StreamLike = Any

def open_all(
    shared: list[Shared], *, writable: bool = False, stream: Any = None,
    layouts: Optional[Sequence[BundleLayout]] = None,
) -> list[Lease]:
    """Opens every ``Shared`` of the list as ``Shared.open`` does, in one call (one host
    wait without ``stream``); all or nothing: on an error every lease goes back.
    ``layouts``, one per buffer, are checked first (a buffer too small: ``ValueError``)."""

def release_all(leases: list[Lease]) -> bool:
    """Releases every ``Lease`` of the list as ``Lease.release`` does, in one call (one
    device synchronisation for those opened without a stream); whether all went back now."""

def wait_all_on(buffers: list[Buffer], stream: StreamLike) -> None:
    """``Buffer.wait_on`` for every buffer of the list, in one call: ``stream`` waits once
    for the release fences of all of them, not once per buffer."""

def generate_token() -> str:
    """A fresh random session token (64 hex digits), for a process that starts a deployment."""

def log_to_stderr(filter: str = "info") -> bool:
    """Sends Baton's tracing events to stderr (once per process); returns whether it did."""

class LeaseRow(TypedDict):
    """One buffer this node exports, in ``Node.lease_table()``."""

    #: The buffer's id.
    buffer: int
    #: Its bytes.
    bytes: int
    #: The leases out on it: ``(lease_id, pid of the holder)``.
    leases: list[tuple[int, int]]
    #: The pids of the processes that map it (a mapping outlives its leases: warm).
    mapped_by: list[int]
    #: No handle of it is left: it is freed once its leases and mappings are gone.
    retiring: bool
    #: A cut holder may still map it: it stays allocated until that process is dead.
    quarantined: bool


class ExportStats(TypedDict):
    """Counters of the buffers a node exports, from ``Node.export_stats()``."""

    #: Buffers alive (handles, leases or mappings out).
    buffers: int
    #: Of those, buffers no handle is left of, waiting to be freed.
    retiring: int
    #: Of those, buffers quarantined.
    quarantined: int
    #: Leases out.
    leases: int
    #: Bytes alive.
    bytes: int
    #: Leases granted so far.
    granted: int
    #: Buffers freed so far.
    freed: int


class ImportStats(TypedDict):
    """Counters of a node's import cache, from ``Node.import_stats()``."""

    #: Driver-level opens (or ``mmap``s): each first open of an allocation.
    opens: int
    #: Opens served from a mapping already there.
    hits: int
    #: Mappings closed.
    closes: int
    #: Handles refused as stale (an older generation of a reused allocation).
    stale: int
    #: Warm mappings dropped to stay within the warm budget.
    evictions: int
    #: Mappings open now.
    live: int
    #: Of those, warm ones (no lease uses them).
    warm: int
    #: Bytes of the warm mappings.
    warm_bytes: int


class PathRow(TypedDict):
    """Leases of one path, in ``Node.path_stats()["paths"]``."""

    #: The path's label, as ``Lease.path``: ``"host-memfd"``, ``"host-segment"``,
    #: ``"cuda-legacy"``, ``"cuda-vmm"``, ``"cuda-pool"`` (importers add ``"-peer-gpu"``),
    #: ``"tcp-copy"``, ``"nccl-copy"``, ``"other"``.
    path: str
    #: Leases this node granted on its buffers through it (exporters label device memory
    #: without ``"-peer-gpu"``: which GPU maps it is the importer's to know).
    granted: int
    #: Their bytes.
    granted_bytes: int
    #: Leases this node opened on other processes' buffers through it.
    opened: int
    #: Their bytes.
    opened_bytes: int


class DowngradeRow(TypedDict):
    """Downgrades of one kind, in ``Node.path_stats()["downgrades"]``."""

    #: The path wanted.
    wanted: str
    #: The slower path taken instead.
    taken: str
    #: Times it was taken.
    count: int


class PathStats(TypedDict):
    """A node's leases by path and the downgrades it took, from ``Node.path_stats()``."""

    #: One row per path taken so far.
    paths: list[PathRow]
    #: One row per kind of downgrade taken (each allowed by ``BATON_ALLOW_DOWNGRADE``).
    downgrades: list[DowngradeRow]


class Node:
    """This process in a Baton deployment.

    ``Node()`` takes the session token a Baton supervisor passed (``BATON_TOKEN_FD``, then
    ``BATON_TOKEN``); ``token=`` or ``token_file=`` give it explicitly. ``backend`` is
    ``"auto"`` (CUDA when a GPU is usable), ``"host"`` or ``"cuda"``; default
    ``BATON_BACKEND``.
    """

    def __init__(
        self,
        *,
        token: Optional[str] = None,
        token_file: Optional[Union[str, os.PathLike[str]]] = None,
        backend: Optional[Literal["auto", "host", "cuda"]] = None,
    ) -> None: ...
    @staticmethod
    def from_env(*, backend: Optional[Literal["auto", "host", "cuda"]] = None) -> Node:
        """The node of a process a Baton supervisor started."""
    @staticmethod
    def join(
        *, backend: Optional[Literal["auto", "host", "cuda"]] = None, timeout: float = 30.0
    ) -> Tuple[Node, Peer]:
        """The entry point of a child started with ``Node.spawn``: ``(node, parent)``. A child
        that serves names registers them first instead: ``Node()``, ``register``, then
        ``connect_parent()``. Raises ``NoParent`` in a process not started that way."""
    def connect_parent(self, *, timeout: float = 30.0) -> Peer:
        """Links to the parent that started this process with ``Node.spawn``. Raises
        ``NoParent`` in a process not started that way."""
    def spawn(
        self,
        args: Sequence[Union[str, os.PathLike[str]]],
        *,
        env: Optional[dict[str, str]] = None,
        timeout: float = 30.0,
    ) -> Child:
        """Starts ``args`` as a child linked to this node (the token through an inherited
        pipe, this node's backend); returns once it has linked."""
    @property
    def pid(self) -> int: ...
    @property
    def backend(self) -> str:
        """"host" or "cuda"."""
    def connect(self, path: Union[str, os.PathLike[str]], *, timeout: float = 30.0) -> Peer:
        """Links to the node listening at ``path`` (credentials and token checked)."""
    def listen(self, directory: Union[str, os.PathLike[str]], name: str = "node.sock") -> Path:
        """Accepts links at ``directory/name`` until ``close()``; returns the socket's path."""
    def accept(self, *, timeout: float = 30.0) -> Peer:
        """The next peer that linked to this node's listeners. Raises ``Timeout``."""
    def peers(self) -> list[Peer]:
        """The links up now."""
    def register(self, name: str, type_name: str) -> Mailbox:
        """Answers calls to ``name`` of wire type ``type_name``."""
    def allocate(
        self,
        shape: Union[SupportsIndex, Sequence[SupportsIndex]],
        dtype: Optional[DTypeLike] = None,
        *,
        timeout: float = 30.0,
    ) -> Buffer:
        """A buffer in this process's memory (device memory on the CUDA backend); float32
        unless ``dtype`` says otherwise."""
    def allocate_bundle(
        self,
        spec: Union[BundleLayout, Mapping[str, tuple], Sequence[tuple]],
        *,
        timeout: float = 30.0,
    ) -> "baton.bundle.Bundle":
        """A bundle: one buffer holding many named tensors (see ``baton.bundle``)."""
    def borrow_tensors(
        self, tensors: Union[Mapping[str, Any], Iterable[tuple[str, Any]]]
    ) -> "baton.bundle.BundleGroup":
        """Leases CUDA tensors PyTorch allocated, in place: a group of one bundle per CUDA
        allocation they lie in, sent and opened as one; their storages are kept until Baton
        is done with them."""
    def lease_table(self) -> list[LeaseRow]:
        """The buffers this node exports and their leases (``LeaseRow``)."""
    def export_stats(self) -> ExportStats:
        """Counters of the buffers this node exports (``ExportStats``)."""
    def import_stats(self) -> ImportStats:
        """Counters of this node's import cache (``ImportStats``)."""
    def path_stats(self) -> PathStats:
        """This node's leases by the path their bytes took, and its downgrades (``PathStats``)."""
    def close(self) -> None:
        """Waits (at most 2 s) for fences recorded for peers to land, then stops listening,
        closes every mailbox and link — waiting (at most 3 s) until each link's close has
        written the replies under way, so a reply made just before reaches its caller even
        if this process exits right after — and gives the device back what the backend
        keeps for reuse (a stream-ordered pool is retired: its memory goes back once its
        last buffer is freed)."""
    def __enter__(self) -> Node: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class Peer:
    """A linked process."""

    @property
    def pid(self) -> int: ...
    @property
    def uid(self) -> int | None: ...
    @property
    def connected(self) -> bool: ...
    def call(
        self,
        target: str,
        type_name: str,
        message: Value = None,
        *,
        timeout: float = 30.0,
        stream: Optional[StreamLike] = None,
    ) -> Value:
        """Calls the actor ``target`` with ``message`` (MessagePack) and returns its reply;
        buffers in the reply arrive as ``Shared``. ``stream``: device buffers' acquire
        fences are recorded on it, and the device is not synchronised first."""
    def ping(self, *, timeout: float = 30.0) -> float:
        """A round trip to the peer, in seconds."""
    def close(self) -> None: ...

class Child:
    """A child process started with ``Node.spawn``, linked to its parent. SIGKILLed when
    this object is collected while it still runs."""

    @property
    def peer(self) -> Peer:
        """The link to the child."""
    @property
    def pid(self) -> int: ...
    def wait(self, timeout: float = 30.0) -> int:
        """Its exit code (``-signal`` if a signal ended it). Raises ``Timeout``."""
    def kill(self) -> None:
        """SIGKILL (reap it with ``wait``)."""

class Mailbox:
    """Calls to a registered name."""

    @property
    def name(self) -> str: ...
    @property
    def type_name(self) -> str: ...
    @property
    def pending(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def recv(self, *, timeout: Optional[float] = None) -> Call:
        """The next call (``None``: wait until one comes or the mailbox closes). Raises
        ``Timeout``, ``Released`` once closed, or ``LinkClosed`` once no link is up and
        the node does not listen (nobody can call it any more)."""
    def recv_async(self, *, timeout: Optional[float] = None) -> Awaitable[Call]:
        """``recv`` for asyncio (awaitable), with the same errors. Cancelling it loses no
        call: calls are taken on the event loop's thread only."""
    def _wait_ready(self, timeout: float) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Mailbox: ...
    def __exit__(self, *exc: object) -> bool: ...

class Call:
    """A received call: answer it with ``reply`` or ``reject`` (dropped unanswered, the
    caller gets ``ActorGone``)."""

    @property
    def message(self) -> Value: ...
    @property
    def peer_pid(self) -> int: ...
    @property
    def type_name(self) -> str: ...
    def reply(self, value: Value = None, *, stream: Optional[StreamLike] = None) -> bool:
        """Answers; ``Buffer``s in ``value`` are leased to the caller. ``False``: the
        caller's link went down first."""
    def reject(self, reason: str) -> bool:
        """Refuses the call: the caller gets ``BadPayload(reason)``."""

class Shared:
    """A received buffer, not opened yet (dropping it releases the lease)."""

    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def lease_id(self) -> int: ...
    def open(self, *, writable: bool = False, stream: Optional[StreamLike] = None) -> Lease:
        """Maps the exporter's memory here. Raises ``Orphaned`` if the exporter is gone,
        ``Released`` if opened or released before. ``stream`` (device memory): the stream
        waits on the exporter's fence and the release fence is recorded on it — no host
        synchronisation."""
    def release(self) -> bool:
        """Gives the lease back unopened; returns whether it was still unopened."""

class Lease:
    """An opened lease: the exporter's memory, zero-copy.

    Views (``numpy()``, ``__dlpack__``) keep the lease out while they live;
    ``release()`` and the end of a ``with`` block make the lease unusable at once and give
    it back when its last view goes.
    """

    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> Device: ...
    @property
    def writable(self) -> bool: ...
    @property
    def lease_id(self) -> int: ...
    @property
    def exporter_pid(self) -> int: ...
    @property
    def path(self) -> str:
        """How its bytes reached this process: "host-memfd", "host-segment", "cuda-legacy",
        "cuda-vmm", "cuda-pool" (with "-peer-gpu" for another GPU's memory), "tcp-copy",
        "nccl-copy"."""
    @property
    def released(self) -> bool: ...
    @property
    def orphaned(self) -> bool: ...
    @property
    def views(self) -> int: ...
    def numpy(self) -> Any:
        """A zero-copy ``numpy.ndarray`` of host memory (read-only unless writable)."""
    def tobytes(self) -> bytes: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Device memory only (``AttributeError`` for host memory)."""
    def release(self) -> bool:
        """Returns whether the lease went back now (``False``: views are alive)."""
    def __enter__(self) -> Lease: ...
    def __exit__(self, *exc: object) -> bool: ...

class Buffer:
    """A buffer this process owns (``Node.allocate``): fill it through its views, put it
    in messages (each send leases it to the receiver)."""

    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> Device: ...
    @property
    def buffer_id(self) -> int: ...
    @property
    def released(self) -> bool: ...
    @property
    def leases_out(self) -> int: ...
    def share_mut(self) -> WritableShare:
        """The buffer, to put in a message in its place when its receiver is to write it:
        the one writable lease on the buffer while it is out (raises ``LeaseConflict`` on
        sending while another lease is out)."""
    def wait_on(self, stream: StreamLike) -> None:
        """Device memory: work queued on ``stream`` from now on waits for the importers'
        release fences (stream-ordered writes after ``returned()``)."""
    def returned(self, timeout: float = 30.0) -> None:
        """Waits until every lease on it is back. Raises ``NotReturned`` past ``timeout``."""
    def returned_async(self, timeout: float = 30.0) -> Awaitable[None]:
        """``returned`` for asyncio (awaitable)."""
    def numpy(self) -> Any:
        """A zero-copy ``numpy.ndarray`` of host memory: writable while no lease is out,
        read-only while one is (a view taken before stays writable: your race)."""
    def tobytes(self) -> bytes: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    def release(self) -> bool:
        """Drops Python's handle; the memory is freed once no view, lease or handle is left."""
    def __enter__(self) -> Buffer: ...
    def __exit__(self, *exc: object) -> bool: ...

class WritableShare:
    """A buffer to be leased writable (``Buffer.share_mut()``), for a message field."""

    @property
    def buffer(self) -> Buffer: ...

class _CopyPlan:
    """Copies between device buffers and many tensors by their data pointers, one kernel
    launch per run (``baton.CopyPlan`` makes and runs these): one buffer and its spans, or
    a list of buffers and a list of span lists, one per buffer."""

    def __init__(
        self,
        memory: Union[Lease, Buffer, list[Union[Lease, Buffer]]],
        spans: Union[Sequence[tuple[int, int, int]], Sequence[Sequence[tuple[int, int, int]]]],
        keep: Any,
    ) -> None: ...
    def run(
        self,
        memory: Union[Lease, Buffer, list[Union[Lease, Buffer]]],
        stream: Any,
        *,
        into_memory: bool = False,
    ) -> None: ...
    @property
    def end(self) -> int: ...
    @property
    def batched(self) -> bool: ...
    def __len__(self) -> int: ...

class BundleLayout:
    """Where many named tensors are in one buffer (each at a multiple of 256 bytes)."""

    def __init__(self, spec: Union[Mapping[str, tuple], Sequence[tuple]]) -> None: ...
    @property
    def tensors(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """``(name, dtype, shape, offset)`` of each tensor, in order."""
    @property
    def nbytes(self) -> int:
        """The bytes a buffer needs to hold every tensor."""
    def __getitem__(self, name: str) -> tuple[str, tuple[int, ...], int]: ...
    def __contains__(self, name: object) -> bool: ...
    def __len__(self) -> int: ...


class SyncStamp:
    """The stamp of one part of a versioned sync, as its sender wrote it."""

    @property
    def version(self) -> int: ...
    @property
    def sync(self) -> int: ...
    @property
    def part(self) -> int: ...
    @property
    def parts(self) -> int: ...
    @property
    def ttl_ms(self) -> int: ...
    def check(self) -> None:
        """Raises ``Malformed`` unless the stamp is well formed."""

class _SyncSender:
    def __init__(self, version: int = 0, min_deadline: Optional[float] = None) -> None: ...
    @property
    def version(self) -> int: ...
    @property
    def pending(self) -> Optional[int]: ...
    def begin(self, parts: int, deadline: float) -> int: ...
    def stamp(self, part: int) -> SyncStamp: ...
    def finish(self) -> int: ...
    def cancel(self) -> Optional[tuple[int, int]]: ...

class _SyncState:
    def __init__(self) -> None: ...
    @property
    def version(self) -> int: ...
    @property
    def staging(self) -> Optional[tuple[int, int, int, int]]: ...
    def admit(self, stamp: Optional[SyncStamp]) -> SyncStamp: ...
    def landed(self, stamp: SyncStamp) -> Optional[int]: ...
    def cancel(self, version: int, sync: int) -> bool: ...
