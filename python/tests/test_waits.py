"""The waits of a Python thread on Baton's runtime (`Peer.call`, `Buffer.returned`,
`Mailbox.recv`): each ends with its answer, at its deadline, or at a signal (Ctrl-C) — the
wake-up is the answer's own, and a signal is still seen while nothing answers — and a wait
given up leaves the link working."""

from __future__ import annotations

import signal
import threading

import pytest

import baton
from conftest import DEADLINE
from test_ergonomics import root, spawn  # noqa: F401 (`root` is a fixture: a host node)


@pytest.fixture
def child(root: baton.Node) -> baton.Child:  # noqa: F811
    c = spawn(root, "serve")
    yield c
    c.kill()
    c.wait(timeout=DEADLINE)


class Interrupted(Exception):
    pass


@pytest.fixture
def alarm():
    """`alarm(seconds)`: SIGALRM then, its handler raising `Interrupted` in the main thread
    (as Ctrl-C's raises KeyboardInterrupt)."""

    def raise_interrupted(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, raise_interrupted)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def test_a_call_nobody_answers_ends_at_a_signal_and_the_link_keeps_working(child, alarm):
    alarm(0.2)
    # Without the signal, this call would end with baton.Timeout after DEADLINE.
    with pytest.raises(Interrupted):
        child.peer.call("worker", "t.Stall", {"n": 1}, timeout=DEADLINE)
    assert child.peer.connected
    assert child.peer.call("worker", "t.Echo", {"n": 2}, timeout=DEADLINE) == {"n": 2}


def test_a_call_nobody_answers_ends_at_its_deadline(child):
    with pytest.raises(baton.Timeout, match="remote call"):
        child.peer.call("worker", "t.Stall", {"n": 1}, timeout=0.2)
    assert child.peer.call("worker", "t.Echo", [1, 2, 3], timeout=DEADLINE) == [1, 2, 3]


def test_returned_ends_at_a_signal_while_a_lease_is_held(root, child, alarm):
    data = root.allocate(64, "float32")
    assert child.peer.call("worker", "t.Hold", {"data": data}, timeout=DEADLINE) == 1
    alarm(0.2)
    with pytest.raises(Interrupted):
        data.returned(timeout=DEADLINE)  # held until t.Drop: only the signal ends this
    assert data.leases_out == 1
    assert child.peer.call("worker", "t.Drop", None, timeout=DEADLINE) == 0
    data.returned(timeout=DEADLINE)
    assert data.leases_out == 0


def test_recv_ends_at_a_signal(root, alarm, tmp_path):
    mailbox = root.register("nobody-calls", "t.Nothing")
    root.listen(tmp_path / "s")
    alarm(0.2)
    with pytest.raises(Interrupted):
        # The node listens, so nothing but the signal ends this before its deadline (a
        # recv that missed the signal would raise baton.Timeout).
        mailbox.recv(timeout=DEADLINE)


def test_calls_from_many_threads_each_get_their_own_answer(root, child):
    data = [root.allocate(16, "float32") for _ in range(4)]
    errors: list[BaseException] = []

    def caller(i: int) -> None:
        try:
            for n in range(50):
                message = {"thread": i, "n": n}
                assert child.peer.call("worker", "t.Echo", message, timeout=DEADLINE) == message
                got = child.peer.call("worker", "t.Hold", {"data": data[i]}, timeout=DEADLINE)
                assert got >= 1
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert child.peer.call("worker", "t.Drop", None, timeout=DEADLINE) == 0
    for d in data:
        d.returned(timeout=DEADLINE)
        assert d.leases_out == 0


def test_calls_back_to_back_and_after_pauses_each_get_their_answer(root, child):
    """A thread that waited a moment ago watches for its answer before it sleeps; one idle
    longer sleeps at once (`runtime.rs`, `watch_window`). Bursts of calls with the buffer's
    return waited for, and calls after pauses longer than the active window, take both
    ways on both sides (the caller's wait and the child's mailbox): every answer is the
    call's own and every lease comes back."""
    import time

    data = root.allocate(16, "float32")
    for burst in range(6):
        for n in range(20):
            message = {"burst": burst, "n": n}
            assert child.peer.call("worker", "t.Echo", message, timeout=DEADLINE) == message
            assert child.peer.call("worker", "t.Hold", {"data": data}, timeout=DEADLINE) >= 1
            assert child.peer.call("worker", "t.Drop", None, timeout=DEADLINE) == 0
            data.returned(timeout=DEADLINE)
            assert data.leases_out == 0
        time.sleep(0.02)  # longer than the 5 ms active window: the next waits sleep at once
