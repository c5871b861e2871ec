"""Baton for Python: join a Baton deployment as a peer, exchange calls with Rust actors,
and use leased host and GPU buffers as zero-copy NumPy and DLPack arrays.

See the guide (``python/README.md``) for a tour.
"""

from __future__ import annotations

from . import errors
from ._baton import (
    MSGPACK_SHARED_EXT,
    Buffer,
    Call,
    Child,
    Lease,
    Mailbox,
    Node,
    Peer,
    Shared,
    WritableShare,
    __version__,
    generate_token,
    log_to_stderr,
)
from .bundle import (
    Bundle, BundleGroup, BundleGroupLease, BundleLayout, BundleLease, CopyPlan, SharedBundle,
    SharedBundleGroup, SyncReceiver, SyncSender, SyncStamp, WritableBundle, bundle_parameters,
)
from .supervisor import Supervisor
from .errors import *  # noqa: F401,F403  (the exception classes, as baton.Orphaned etc.)

__all__ = [
    "MSGPACK_SHARED_EXT",
    "Buffer",
    "Bundle",
    "BundleGroup",
    "BundleGroupLease",
    "BundleLayout",
    "BundleLease",
    "Call",
    "Child",
    "CopyPlan",
    "Lease",
    "Mailbox",
    "Node",
    "Peer",
    "Shared",
    "SharedBundle",
    "SharedBundleGroup",
    "Supervisor",
    "SyncReceiver",
    "SyncSender",
    "SyncStamp",
    "WritableBundle",
    "WritableShare",
    "__version__",
    "bundle_parameters",
    "errors",
    "generate_token",
    "log_to_stderr",
    *errors.__all__,
]
