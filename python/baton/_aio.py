"""asyncio forms of Baton's waits (``Mailbox.recv_async``).

A call is taken from a mailbox only here, on the event loop's thread, with the
non-blocking ``recv(timeout=0)``; the blocking part — waiting until a call is there — runs
on the loop's default executor in slices of at most half a second and takes nothing. So
cancelling the awaiting task never loses a call: at worst a helper thread finishes its
slice and returns.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from .errors import Timeout

# The longest one executor wait lasts: how long a helper thread may outlive a cancel, and
# how often the mailbox's other ends (closed, no link left) are looked at.
_SLICE = 0.5


async def recv(mailbox: Any, timeout: Optional[float]) -> Any:
    """The next call of ``mailbox`` within ``timeout`` seconds (``None``: no deadline)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        try:
            # Raises Released once closed, LinkClosed once nobody can call it.
            return mailbox.recv(timeout=0)
        except Timeout:
            pass
        left = _SLICE if deadline is None else min(_SLICE, deadline - loop.time())
        if left <= 0:
            raise Timeout(f"receiving a call: none came within {timeout} s")
        await loop.run_in_executor(None, mailbox._wait_ready, left)
