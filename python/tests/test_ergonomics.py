"""The Python ergonomics of issues 25 (part 4) and 29 (part 3): a child started and linked
in one call, leases awaited (blocking and asyncio), a reply that survives the close right
after it, a mailbox that raises once its link is gone, a clear error without a token, and
`python -m pytest` run inside python/."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import baton
from conftest import DEADLINE, REPO

HERE = Path(__file__).parent
CHILD = [sys.executable, str(HERE / "ergo_child.py")]


@pytest.fixture
def root() -> baton.Node:
    n = baton.Node(token=baton.generate_token(), backend="host")
    yield n
    n.close()


def spawn(root: baton.Node, role: str) -> baton.Child:
    env = {"PYTHONPATH": os.pathsep.join([str(HERE)] + sys.path)}
    return root.spawn([*CHILD, role], env=env, timeout=DEADLINE)


def test_spawn_starts_a_python_child_with_the_token_and_a_link_in_one_call(root):
    child = spawn(root, "serve")
    try:
        assert child.peer.pid == child.pid
        assert child.peer.connected
        data = root.allocate(1000, "float32")
        data.numpy()[:] = 0.5
        got = child.peer.call("worker", "t.Sum", {"data": data, "last": False}, timeout=DEADLINE)
        assert got == {"sum": 500.0, "pid": child.pid}
    finally:
        child.kill()
        assert child.wait(timeout=DEADLINE) == -signal.SIGKILL


def test_a_reply_followed_by_close_reaches_the_caller(root):
    # Each round: the child replies and closes its node at once, then exits.
    for _ in range(5):
        child = spawn(root, "serve")
        data = root.allocate(64, "float32")
        data.numpy()[:] = 1.0
        got = child.peer.call("worker", "t.Sum", {"data": data, "last": True}, timeout=DEADLINE)
        assert got["sum"] == 64.0
        assert child.wait(timeout=DEADLINE) == 0
        data.returned(timeout=DEADLINE)  # the child's lease came back with its link


def test_returned_waits_for_the_leases_blocking_and_with_asyncio(root):
    child = spawn(root, "serve")
    try:
        data = root.allocate(256, "float32")
        data.returned(timeout=0)  # none out: at once
        assert child.peer.call("worker", "t.Hold", {"data": data}) == 1
        with pytest.raises(baton.NotReturned, match="1 leases out") as caught:
            data.returned(timeout=0.05)
        assert isinstance(caught.value, baton.Timeout)
        # It names the process that keeps the lease.
        assert f"held by lease" in str(caught.value) and f"(pid:{child.pid}@" in str(caught.value), caught.value
        assert child.peer.call("worker", "t.Drop", None) == 0
        data.returned(timeout=DEADLINE)

        async def hold_then_drop() -> None:
            assert child.peer.call("worker", "t.Hold", {"data": data}) == 1
            back = asyncio.ensure_future(data.returned_async(DEADLINE))
            await asyncio.sleep(0)
            assert not back.done()  # a lease is out
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, child.peer.call, "worker", "t.Drop", None)
            await asyncio.wait_for(back, DEADLINE)

        asyncio.run(hold_then_drop())
        assert data.leases_out == 0
    finally:
        child.kill()
        child.wait(timeout=DEADLINE)


def test_writes_of_a_leased_buffer_or_bundle_are_refused_until_returned(root):
    child = spawn(root, "serve")
    try:
        data = root.allocate(64, "float32")
        bundle = root.allocate_bundle({"w": ((4, 4), "float32")})
        assert child.peer.call("worker", "t.Hold", {"data": data}) == 1
        assert child.peer.call("worker", "t.Hold", {"data": bundle}) == 2
        assert data.leases_out == 1 and bundle.leases_out == 1
        view = data.numpy()
        assert not view.flags.writeable, "a lease is out: the owner's view is read-only"
        with pytest.raises(ValueError):
            view[0] = 1.0
        with pytest.raises(ValueError):
            bundle.tensors()["w"][0, 0] = 1.0
        with pytest.raises(BufferError, match="lease"):
            bundle.copy_from({"w": np.ones((4, 4), np.float32)})
        assert child.peer.call("worker", "t.Drop", None) == 0
        data.returned(timeout=DEADLINE)
        bundle.returned(timeout=DEADLINE)
        data.numpy()[:] = 3.0  # back: writable again
        bundle.copy_from({"w": np.ones((4, 4), np.float32)})
        assert bundle.tensors()["w"].sum() == 16.0
    finally:
        child.kill()
        child.wait(timeout=DEADLINE)


def test_sigkill_of_a_child_holding_a_lease_is_awaited_with_returned(root):
    child = spawn(root, "serve")
    data = root.allocate(1 << 16, "float32")
    data.numpy()[:] = np.arange(1 << 16, dtype=np.float32)
    assert child.peer.call("worker", "t.Hold", {"data": data}) == 1  # answered: held
    child.kill()
    assert child.wait(timeout=DEADLINE) == -signal.SIGKILL
    data.returned(timeout=DEADLINE)
    assert data.leases_out == 0


def test_a_mailbox_whose_link_is_gone_raises_instead_of_waiting(root):
    child = spawn(root, "wait")
    # The child's recv waits 120 s; the link's end must end it, with LinkClosed (exit 0),
    # well within our deadline.
    child.peer.close()
    assert child.wait(timeout=DEADLINE) == 0


def test_no_token_says_so(monkeypatch):
    monkeypatch.delenv("BATON_TOKEN", raising=False)
    monkeypatch.delenv("BATON_TOKEN_FD", raising=False)
    with pytest.raises(baton.NoToken, match="no session token was given"):
        baton.Node(backend="host")
    monkeypatch.setenv("BATON_TOKEN", "not-a-token")
    with pytest.raises(baton.NoToken, match="BATON_TOKEN is set but is not a token"):
        baton.Node(backend="host")


def test_join_outside_a_spawned_child_says_so(monkeypatch, root):
    monkeypatch.delenv("BATON_PARENT_SOCKET", raising=False)
    monkeypatch.setenv("BATON_TOKEN", baton.generate_token())
    with pytest.raises(baton.NoParent, match="BATON_PARENT_SOCKET"):
        baton.Node.join(backend="host")
    with pytest.raises(baton.NoParent):
        root.connect_parent()


def test_pytest_inside_python_uses_the_installed_package():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/test_listen.py"],
        cwd=REPO / "python", capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "No module named 'baton._baton'" not in out.stdout + out.stderr


def test_pytest_without_an_installed_package_refuses_with_what_to_do():
    # -S: no site-packages, and no PYTHONPATH (where a bundle may have installed the
    # package, as the GPU machine's run does), so only the source tree's package is left.
    code = (
        "import sys; sys.path.insert(0, 'tests'); from source_guard import use_installed_baton;"
        "from pathlib import Path; print(use_installed_baton(Path('.'), sys.path))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=REPO / "python", capture_output=True,
        text=True, timeout=60, env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "the baton package is not installed" in out.stdout
    assert "python/run-tests.sh" in out.stdout


def test_the_readme_opens_with_the_weight_sync_program_and_it_runs():
    readme = (REPO / "python/README.md").read_text()
    program = (REPO / "python/examples/weight_sync.py").read_text()
    first = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert first == program, "python/README.md's first code block is examples/weight_sync.py"
    lines = [line for line in program.splitlines() if line.strip()]
    assert len(lines) <= 60, f"the weight-sync program has {len(lines)} lines; the issue allows 60"
    out = subprocess.run(
        [sys.executable, str(REPO / "python/examples/weight_sync.py")],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "20 steps of 200 tensors checked" in out.stdout
