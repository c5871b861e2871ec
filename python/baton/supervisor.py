"""A small supervisor: keeps one spawned child running and re-runs what failed when it died.

``Supervisor(node, args)`` starts ``args`` with ``Node.spawn`` (the token through an
inherited pipe, this node's backend, linked in one call) and keeps it running:

- ``supervisor.call(target, type_name, message)`` is ``peer.call`` on the current child; if
  the child dies before it answers (``baton.LinkClosed``, ``PeerDied`` among them) the
  child is restarted and the call made again, up to ``retries`` times;
- ``supervisor.run(fn)`` does the same for any work: ``fn(peer)`` is called with the
  current child's link and called again on a new child if the child died under it (a
  ``LinkClosed`` or ``Orphaned`` raised while the child is found dead or unlinked);
- a child that dies between calls is restarted by the next call, or by ``restart()``.

The restart limit works as Rust's ``RestartPolicy``: more than ``max_restarts`` restarts
within ``within`` seconds raise ``baton.Escalated`` (the child is killed, and the
supervisor stops: every later call raises it too), so a child that dies at once never
loops. A child whose link is gone but which lives on (cut for a fault) is killed before it
is replaced: a child is restarted only once it is reaped. Each wait has a deadline
(``timeout``, for the spawn and each call).

Re-running is the caller's promise that the work can be done twice (a weight sync that
sends the same version again, a pure function of its inputs): what the dead child did
with its share of it is lost with it.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, TypeVar

from .errors import Escalated, LinkClosed, Orphaned, Timeout

T = TypeVar("T")


class Supervisor:
    """Keeps one child of ``node`` running (see the module docs)."""

    def __init__(
        self,
        node: Any,
        args: Sequence[Any],
        *,
        env: Optional[Dict[str, str]] = None,
        max_restarts: int = 5,
        within: float = 10.0,
        timeout: float = 30.0,
    ) -> None:
        if max_restarts < 0 or within <= 0 or timeout <= 0:
            raise ValueError("max_restarts >= 0, within > 0 and timeout > 0 are needed")
        self._node = node
        self._args = list(args)
        self._env = env
        self._max_restarts = max_restarts
        self._within = within
        self._timeout = timeout
        self._recent: Deque[float] = collections.deque()
        self._restarts = 0
        self._stopped: Optional[Escalated] = None
        self._exits: List[int] = []
        self._spawn()

    @property
    def child(self) -> Any:
        """The child running now (a ``baton.Child``)."""
        self._check()
        return self._child

    @property
    def peer(self) -> Any:
        """The link to the child running now; a child found dead is restarted first."""
        if not self._alive():
            self.restart()
        return self._child.peer

    @property
    def restarts(self) -> int:
        """Restarts so far."""
        return self._restarts

    @property
    def exits(self) -> List[int]:
        """How each replaced child ended, oldest first: its exit code, ``-signal`` if a
        signal ended it."""
        return list(self._exits)

    def restart(self) -> Any:
        """Replaces the child: kills it if it still runs, reaps it, and starts a new one.
        Raises ``Escalated`` past the restart limit. Returns the new child."""
        self._check()
        now = time.monotonic()
        while self._recent and now - self._recent[0] > self._within:
            self._recent.popleft()
        if len(self._recent) >= self._max_restarts:
            self._reap()
            self._stopped = Escalated(
                f"{len(self._recent) + 1} restarts of {self._args[0]!s} within "
                f"{self._within} s (at most {self._max_restarts}): the supervisor stopped"
            )
            raise self._stopped
        self._reap()
        self._recent.append(now)
        self._restarts += 1
        self._spawn()
        return self._child

    def call(
        self,
        target: str,
        type_name: str,
        message: Any = None,
        *,
        retries: int = 1,
        **kwargs: Any,
    ) -> Any:
        """``peer.call`` on the current child (``timeout`` defaults to the supervisor's),
        made again on a new child, up to ``retries`` times, if the child died first."""
        kwargs.setdefault("timeout", self._timeout)
        return self.run(
            lambda peer: peer.call(target, type_name, message, **kwargs), retries=retries
        )

    def run(self, fn: Callable[[Any], T], *, retries: int = 1) -> T:
        """``fn(peer)`` with the current child's link; if it raises ``LinkClosed`` or
        ``Orphaned`` and the child is found dead or unlinked, the child is restarted and
        ``fn`` run again, up to ``retries`` times. Other errors pass through, as does the
        last one."""
        attempt = 0
        while True:
            peer = self.peer
            try:
                return fn(peer)
            except (LinkClosed, Orphaned):
                if attempt >= retries or self._alive():
                    raise
                attempt += 1
                self.restart()

    def close(self) -> None:
        """Kills the child and reaps it; the supervisor stops."""
        if self._stopped is None:
            self._stopped = Escalated("the supervisor was closed")
        self._reap()

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        return (f"Supervisor({self._args[0]!s}, pid {self._child.pid}, "
                f"{self._restarts} restart(s))")

    # --- internals ------------------------------------------------------------------

    def _check(self) -> None:
        if self._stopped is not None:
            raise self._stopped

    def _exited(self) -> bool:
        """Whether the current child has exited (reaped now if it just did)."""
        if self._code is None:
            try:
                self._code = self._child.wait(timeout=0)
            except Timeout:
                return False
        return True

    def _alive(self) -> bool:
        """Whether the child runs and is linked (a child whose link is gone serves nobody)."""
        self._check()
        return self._child.peer.connected and not self._exited()

    def _reap(self) -> None:
        """Kills the current child if it still runs, reaps it, and notes how it ended."""
        if self._reaped:
            return
        if not self._exited():
            self._child.kill()
            self._code = self._child.wait(timeout=self._timeout)
        self._exits.append(self._code)
        self._reaped = True

    def _spawn(self) -> None:
        self._child = self._node.spawn(self._args, env=self._env, timeout=self._timeout)
        self._code: Optional[int] = None
        self._reaped = False
