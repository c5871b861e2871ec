"""baton.Supervisor: a spawned child kept running — restarted after SIGKILL, the work that
failed run again on the new child, the restart limit escalating — and the supervised
weight-sync example."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import baton
from conftest import DEADLINE, REPO

HERE = Path(__file__).parent
SERVE = [sys.executable, str(HERE / "ergo_child.py"), "serve"]
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE)] + sys.path)}


@pytest.fixture
def root() -> baton.Node:
    n = baton.Node(token=baton.generate_token(), backend="host")
    yield n
    n.close()


def summed(root: baton.Node, value: float) -> baton.Buffer:
    data = root.allocate(100, "float32")
    data.numpy()[:] = value
    return data


def test_a_child_killed_under_the_work_is_restarted_and_the_work_run_again(root):
    with baton.Supervisor(root, SERVE, env=ENV, timeout=DEADLINE) as sup:
        data = summed(root, 2.0)
        first = sup.call("worker", "t.Sum", {"data": data, "last": False})
        assert first == {"sum": 200.0, "pid": sup.child.pid}

        attempts = []

        def work(peer):
            attempts.append(peer.pid)
            if len(attempts) == 1:
                os.kill(peer.pid, signal.SIGKILL)  # the child dies under the work
            return peer.call("worker", "t.Sum", {"data": data, "last": False}, timeout=DEADLINE)

        got = sup.run(work)
        assert len(attempts) == 2 and attempts[0] != attempts[1], attempts
        assert got == {"sum": 200.0, "pid": attempts[1]}
        assert sup.restarts == 1 and sup.exits == [-signal.SIGKILL]
        data.returned(timeout=DEADLINE)  # the dead child's lease came back

        # A child that died between calls is replaced by the next call.
        old = sup.child
        old.kill()
        assert sup.call("worker", "t.Sum", {"data": data, "last": False})["pid"] != old.pid
        assert sup.restarts == 2


def test_work_that_fails_for_another_reason_is_not_run_again(root):
    with baton.Supervisor(root, SERVE, env=ENV, timeout=DEADLINE) as sup:
        calls = []

        def work(peer):
            calls.append(peer.pid)
            return peer.call("nobody", "t.Sum", None, timeout=DEADLINE)

        with pytest.raises(baton.NoSuchActor):
            sup.run(work)
        assert len(calls) == 1 and sup.restarts == 0

        # Nor after its retries: the last failure passes through.
        def always_kill(peer):
            calls.append(peer.pid)
            os.kill(peer.pid, signal.SIGKILL)
            return peer.call("worker", "t.Sum", {"data": summed(root, 1.0)}, timeout=DEADLINE)

        with pytest.raises(baton.LinkClosed):
            sup.run(always_kill, retries=1)
        assert sup.restarts == 1


def test_more_restarts_than_the_limit_escalate_and_stop_the_supervisor(root):
    sup = baton.Supervisor(root, SERVE, env=ENV, max_restarts=2, within=60.0, timeout=DEADLINE)
    pids = []
    for _ in range(2):
        pids.append(sup.child.pid)
        sup.child.kill()
        sup.restart()
    assert sup.child.pid not in pids and sup.restarts == 2
    last = sup.child
    with pytest.raises(baton.Escalated, match="at most 2"):
        sup.restart()
    # The child is killed, and the supervisor stays stopped.
    with pytest.raises(baton.Released, match="reaped already"):
        last.wait(timeout=0)
    with pytest.raises(baton.Escalated):
        sup.call("worker", "t.Sum", None)
    assert sup.exits == [-signal.SIGKILL] * 3
    sup.close()


def test_the_supervised_weight_sync_example_runs():
    out = subprocess.run(
        [sys.executable, str(REPO / "python/examples/weight_sync_supervised.py")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "engine killed at step 3 and restarted once" in out.stdout
