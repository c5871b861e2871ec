"""Baton's exceptions.

Each class is named after the Rust error variant it stands for, and carries the Rust
error's message unchanged:

- ``baton_actors::ActorError`` variants: ``Orphaned``, ``LinkClosed``, ``Timeout``, ...
- ``baton_ipc::Error`` variants (memory and transport), under ``Ipc``: ``BadToken``,
  ``Closed``, ``Refused``, ``StaleHandle``, ...
- ``CallFault`` variants (the remote side refused a call), under ``Remote``:
  ``NoSuchActor``, ``WrongType``, ``BadPayload``, ``ActorGone``, ``ReplyFailed``,
  ``RemoteOfferRefused``.

and three of the Python layer's own: ``Released`` (a lease, buffer or mailbox used after
it was released or closed), ``RuntimeGone`` (the extension's runtime thread is not
available, e.g. in a forked child) and ``Escalated`` (a ``Supervisor`` past its restart
limit).

A variant without a class of its own raises its group's class (``Ipc``, ``Remote``), else
``BatonError``. Catch ``BatonError`` for all of them.
"""

from __future__ import annotations

__all__ = [
    "BatonError",
    # ActorError
    "Encode", "Decode", "Remote", "LinkClosed", "PeerDied", "Orphaned", "WrongElementType",
    "OutOfBounds", "UnknownBuffer", "NotOwned", "NotReceived", "TooManyDescriptors",
    "UnknownLease", "ForeignOffer", "DuplicateLease", "UnknownCall", "Unexpected",
    "TooManyOffers", "TooManyLeases", "PeerNotReading", "OfferRefused", "RevokeDeadline",
    "Unresponsive", "PeerExited", "Mailbox", "Timeout", "NotReturned", "Spawn", "NoParent",
    "InfeasibleDeadline", "SyncOver", "PathDowngrade", "LeaseConflict",
    # VersionFault (a part of a versioned sync refused), under Version
    "Version", "Unversioned", "Malformed", "Stale", "Skipped", "SyncClosed", "Inconsistent",
    # CallFault
    "NoSuchActor", "WrongType", "BadPayload", "ActorGone", "ReplyFailed",
    "RemoteOfferRefused",
    # baton_ipc::Error
    "Ipc", "Message", "Io", "Closed", "PeerNotAllowed", "BadToken", "NoToken", "Refused",
    "UnexpectedMessage", "PeerIdentityMismatch", "MissingFds", "UnexpectedFds",
    "DescriptorsLost", "MissingFdSlot", "NotMapped", "PoolNotImported",
    "InsecureSocketDir", "ZeroSize", "SegmentNotFound", "MemoryTooSmall",
    "UnsealedMemory", "SegmentOwnerMismatch", "Shm", "UnsupportedBackend", "StaleHandle",
    "DeviceNotFound", "DeviceUnreachable", "PeerInOtherPidNamespace",
    "EventAcrossPidNamespaces", "SegmentAcrossPidNamespaces", "PoolAcrossDevices", "PoolTooLarge",
    "ForeignHandle", "Cuda", "EventsExhausted", "FencesExhausted",
    "AllocationGone", "SlabFull", "BackendUnavailable", "NotBorrowable", "CopyRefused",
    # The Python layer's
    "Released", "RuntimeGone", "Escalated",
]


class BatonError(Exception):
    """Every Baton error."""


# --- baton_actors::ActorError ---------------------------------------------------------

class Encode(BatonError):
    """A message or reply could not be encoded."""


class Decode(BatonError):
    """A message or reply could not be decoded."""


class Remote(BatonError):
    """The remote side answered a call with a fault (a subclass says which)."""


class LinkClosed(BatonError):
    """The link to the peer closed before the operation completed: closed by either side,
    or cut for a fault (the node's log says which). When the peer's process on this host
    is known to be gone, the subclass ``PeerDied`` is raised instead."""


class PeerDied(LinkClosed):
    """The link closed because the peer's process died (it exited, or was killed): a call
    pending then, or made after, raises this. A ``LinkClosed``, so code that catches that
    keeps working. (A peer on another host cannot be seen to die: its link's end is a
    plain ``LinkClosed``.)"""


class Orphaned(BatonError):
    """The buffer's exporter is gone: the lease is orphaned; drop it."""


class WrongElementType(BatonError, TypeError):
    """A buffer's element type is not the one asked for."""


class OutOfBounds(BatonError, IndexError):
    """An index or count outside the buffer."""


class UnknownBuffer(BatonError):
    """The buffer is not (or no longer) owned here."""


class NotOwned(BatonError):
    """A received buffer was put in an outgoing message: only its owner can share it."""


class NotReceived(BatonError):
    """open() of a buffer that was never received."""


class TooManyDescriptors(BatonError):
    """A message carries more descriptor-shared buffers than a frame may carry."""


class UnknownLease(BatonError):
    """The peer released a lease this link never granted it."""


class ForeignOffer(BatonError):
    """The peer offered a buffer it does not own."""


class DuplicateLease(BatonError):
    """The peer offered the same lease twice."""


class UnknownCall(BatonError):
    """The peer answered a call that is not pending."""


class Unexpected(BatonError):
    """The peer sent a message that makes no sense on an established link."""


class TooManyOffers(BatonError):
    """The peer sent more buffers in one message than accepted."""


class TooManyLeases(BatonError):
    """The peer's offers would hold more leases open than accepted."""


class PeerNotReading(BatonError):
    """The peer does not read what it makes us write."""


class OfferRefused(BatonError):
    """A buffer of the reply could not be opened in this process."""


class LeaseConflict(BatonError):
    """A lease would break one writer or many readers: a writable lease (``share_mut``)
    while another lease on the buffer is out, or any lease while a writable one is."""


class RevokeDeadline(BatonError):
    """The peer held a revoked lease past its deadline and was cut off."""


class Unresponsive(BatonError):
    """The peer sent nothing within the heartbeat deadline."""


class PeerExited(BatonError):
    """The link was cut because the peer's process exited while the link was still up (a
    descendant inherited its socket, so no end of stream came). The usual report of a
    peer's death is ``PeerDied``."""


class Mailbox(BatonError):
    """An actor's mailbox is closed."""


class Timeout(BatonError, TimeoutError):
    """A wait ran past its deadline."""


class NotReturned(Timeout):
    """Leases on a buffer were still out when ``Buffer.returned(timeout)`` gave up."""


class InfeasibleDeadline(BatonError):
    """A sync's deadline is past, nearer than the sender's minimum, or beyond a day:
    refused before anything is stamped."""


class SyncOver(BatonError):
    """The sender's sync is over (its deadline passed, it was cancelled, or none began):
    nothing more of it can be stamped."""


class Version(BatonError):
    """A receiver refused a part of a versioned sync: it keeps its version, the part's
    lease goes back, the link carries on."""


class Unversioned(Version):
    """The bundle carries no stamp (shared plainly, not by a SyncSender)."""


class Malformed(Version):
    """The stamp does not check (version 0, parts out of bounds, no time to live)."""


class Stale(Version):
    """The version is not newer than the receiver's."""


class Skipped(Version):
    """The version skips ahead: a receiver on N takes only N+1."""


class SyncClosed(Version):
    """A part of a sync that was cancelled, expired or replaced by a later one."""


class Inconsistent(Version):
    """A part that disagrees with its sync (another number of parts, a part twice)."""


class NoParent(BatonError):
    """``Node.join()`` in a process that ``Node.spawn`` (or Rust's ``spawn_child``) did
    not start."""


class Spawn(BatonError):
    """A child process could not be spawned."""


class PathDowngrade(BatonError):
    """A slower path than the one wanted would have been taken (a copy where a mapping was
    wanted, say), and the node refuses downgrades: the message names both paths. Set
    ``BATON_ALLOW_DOWNGRADE=1`` to take them (and be told)."""


# --- CallFault (under Remote) -----------------------------------------------------------

class NoSuchActor(Remote):
    """No actor is registered under the target name."""


class WrongType(Remote):
    """The target accepts another message type."""


class BadPayload(Remote):
    """The payload did not decode as the target's message type (or the target rejected it)."""


class ActorGone(Remote):
    """The target stopped (or dropped the call) before it answered."""


class ReplyFailed(Remote):
    """The reply could not be encoded or its buffers could not be shared."""


class RemoteOfferRefused(Remote):
    """A buffer of the call could not be opened by the receiver; every lease was given back."""


# --- baton_ipc::Error (under Ipc) -------------------------------------------------------

class Ipc(BatonError):
    """Memory or transport mechanics failed (a subclass says how)."""


class Message(Ipc):
    """A wire message was malformed (decode, size limit, digest)."""


class Io(Ipc):
    """An operating-system call failed."""


class Closed(Ipc):
    """The peer closed the link."""


class PeerNotAllowed(Ipc):
    """The peer's credentials are not allowed (another uid)."""


class BadToken(Ipc):
    """The peer could not prove it holds this session's token (the two sides were given
    different tokens)."""


class NoToken(Ipc):
    """This process was given no session token: pass ``token=`` or ``token_file=``, or
    start it with ``Node.spawn`` (or a Baton supervisor), which passes one."""


class Refused(Ipc):
    """The peer refused the link."""


class UnexpectedMessage(Ipc):
    """The peer sent something else than the handshake expects."""


class PeerIdentityMismatch(Ipc):
    """The peer claims another identity than the socket's process."""


class PeerInOtherPidNamespace(Ipc):
    """The peer's process lives in another PID namespace (a container of its own) and this
    kernel cannot prove and watch it without a pid (it needs SO_PEERPIDFD and pidfs, Linux
    6.9+). Run both in one PID namespace, or on a newer kernel (docs/CROSS_HOST.md,
    "Containers")."""


class EventAcrossPidNamespaces(Ipc):
    """A CUDA interprocess event would cross to or from a process in another PID namespace
    (a container of its own), refused before any driver call: the driver keeps such events
    in the exporter's /dev/shm, which containers do not share. Counter fences (the default)
    cross (docs/CROSS_HOST.md, "Containers")."""


class SegmentAcrossPidNamespaces(Ipc):
    """A named shared-memory segment of an exporter in another PID namespace is not in this
    process's /dev/shm (containers each have their own): named segments do not cross
    containers; use memfd host memory (BATON_HOST=memfd, the default on Linux)."""


class MissingFds(Ipc):
    """A frame announced file descriptors that did not arrive."""


class UnexpectedFds(Ipc):
    """The peer sent file descriptors no frame announced."""


class DescriptorsLost(Ipc):
    """File descriptors were lost (a descriptor limit)."""


class MissingFdSlot(Ipc):
    """A handle refers to a descriptor its frame did not carry."""


class NotMapped(Ipc):
    """A handle refers to a mapping this process does not have."""


class PoolNotImported(Ipc):
    """A handle refers to a CUDA pool not imported here."""


class InsecureSocketDir(Ipc):
    """The socket directory is not private."""


class ZeroSize(Ipc):
    """Zero bytes cannot be allocated."""


class SegmentNotFound(Ipc):
    """A named host segment does not exist (any more)."""


class MemoryTooSmall(Ipc):
    """The exported memory is smaller than its handle claims."""


class UnsealedMemory(Ipc):
    """A memfd came without its seals."""


class SegmentOwnerMismatch(Ipc):
    """A segment name does not belong to its exporter."""


class Shm(Ipc):
    """Shared memory failed."""


class UnsupportedBackend(Ipc):
    """No backend here opens handles of that kind."""


class StaleHandle(Ipc):
    """A handle of an older generation: the exporter freed that buffer."""


class DeviceNotFound(Ipc):
    """The memory's GPU (by UUID) is not one this process sees (``CUDA_VISIBLE_DEVICES``)."""


class DeviceUnreachable(Ipc):
    """The memory's GPU is visible, but this process's GPU cannot map it (no peer access)."""


class PoolAcrossDevices(Ipc):
    """Stream-ordered pool memory of another GPU: refused, since it dies with its exporter
    and would take this process's CUDA context with it. Share VMM or legacy memory across
    GPUs."""


class PoolTooLarge(Ipc):
    """Pool memory past the size the driver imports without crashing (5 GiB unless
    ``BATON_CUDA_POOL_LIMIT`` says otherwise): use VMM memory."""


class ForeignHandle(Ipc):
    """The handle comes from another machine or boot."""


class Cuda(Ipc):
    """A CUDA driver call failed."""


class EventsExhausted(Ipc):
    """Every interprocess event of the pool is lent out."""


class FencesExhausted(Ipc):
    """Every fence of the pool is lent out."""


class AllocationGone(Ipc):
    """The allocation was freed already."""


class SlabFull(Ipc):
    """A slab arena has no room."""


class BackendUnavailable(Ipc):
    """The backend asked for cannot be used here."""


class NotBorrowable(Ipc, ValueError):
    """Memory allocated outside Baton that Baton cannot lease (``Node.borrow_tensors``):
    expandable segments or another allocator's memory, another device's, or memory this
    process lent already."""


class CopyRefused(Ipc, ValueError):
    """A batched copy (``BundleLease.copy_into``, ``Bundle.copy_from``, ``CopyPlan``) was
    refused: a tensor outside any allocation of the device, on another device, or a buffer
    too short for the plan or overlapping its tensors."""


# --- The Python layer's -----------------------------------------------------------------

class Released(BatonError, ValueError):
    """A lease, buffer, received buffer or mailbox used after release()/close()/open()."""


class RuntimeGone(BatonError):
    """The extension's runtime thread is not available (e.g. in a forked child)."""


class Escalated(BatonError):
    """A ``baton.Supervisor`` passed its restart limit (or was closed): its child is
    killed, and every later use raises this."""
