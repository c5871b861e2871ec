"""Fixtures of the Python suite: the Rust partner process (`examples/py_partner.rs`), a
session token, nodes, and polling with deadlines.

Every wait here has a deadline; every child process is killed and reaped by its fixture,
also when a test fails.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import pytest

from source_guard import use_installed_baton

REPO = Path(__file__).resolve().parents[2]

# `python -m pytest` run inside python/ puts python/ first on sys.path, where the source
# package (without its compiled `_baton`) would shadow the installed one.
_refusal = use_installed_baton(REPO / "python", sys.path)
if _refusal is not None:
    pytest.exit(_refusal, returncode=4)

import baton  # noqa: E402  (after the guard above)

#: How long any single wait in the suite may take.
DEADLINE = 30.0


def partner_exe() -> Path:
    """The partner binary: $BATON_PY_PARTNER, else the debug build of the example."""
    path = Path(os.environ.get("BATON_PY_PARTNER", REPO / "target/debug/examples/py_partner"))
    if not path.exists():
        pytest.fail(
            f"the Rust partner {path} is missing: build it with "
            "`cargo build --example py_partner` (python/run-tests.sh does)"
        )
    return path


def eventually(cond: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Polls `cond` until it holds; fails the test past `timeout`. Never a bare sleep."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def pattern(seed: int, n: int) -> np.ndarray:
    """The partner's pattern buffer: ((i * 2654435761 + seed) mod 2**32) >> 8."""
    i = np.arange(n, dtype=np.uint64)
    return (((i * 2654435761 + seed) & 0xFFFFFFFF) >> 8).astype(np.uint32)


class Lines:
    """Lines of a child's stdout, read on a thread, taken with a deadline."""

    def __init__(self, stream) -> None:
        self._q: "queue.Queue[Optional[str]]" = queue.Queue()

        def pump() -> None:
            for line in stream:
                self._q.put(line.rstrip("\n"))
            self._q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def next(self, timeout: float = DEADLINE) -> str:
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no line from the child within {timeout}s")
        if line is None:
            pytest.fail("the child's stdout closed")
        return line


@dataclass
class Child:
    """A child process that its fixture kills and reaps."""

    proc: subprocess.Popen
    lines: Lines
    info: list = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill9(self) -> int:
        """SIGKILLs the child and reaps it; returns its status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(timeout=DEADLINE)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the partner exits when its stdin closes
                self.proc.wait(timeout=5)
            except (subprocess.TimeoutExpired, OSError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=DEADLINE)
        for s in (self.proc.stdin, self.proc.stdout):
            try:
                s.close()
            except OSError:
                pass


def spawn(args: list, env: Optional[dict] = None, pass_fds=()) -> Child:
    proc = subprocess.Popen(
        [str(a) for a in args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        pass_fds=pass_fds,
        text=True,
    )
    return Child(proc, Lines(proc.stdout))


@dataclass
class Partner:
    child: Child
    socket: str
    pid: int
    backend: str


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(baton.generate_token())
    return path


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A private directory with a short path (a socket's path has at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="baton-py-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def partner_factory(short_dir: Path, token_file: Path) -> Iterator[Callable[..., Partner]]:
    """Starts partners (each listening in its own directory); kills and reaps them after."""
    children: list = []

    def start(backend: str = "host") -> Partner:
        env = dict(os.environ, BATON_BACKEND=backend)
        env.pop("BATON_TOKEN", None)
        sock_dir = short_dir / f"p{len(children)}"
        child = spawn([partner_exe(), "serve", "--dir", sock_dir, "--token-file", token_file], env=env)
        children.append(child)
        line = child.lines.next()
        word, socket, pid, name = line.split()
        assert word == "ready", line
        return Partner(child, socket, int(pid), name)

    yield start
    for c in children:
        c.stop()


@pytest.fixture
def partner(partner_factory) -> Partner:
    return partner_factory("host")


@pytest.fixture
def node(token_file: Path) -> Iterator[baton.Node]:
    n = baton.Node(token_file=str(token_file), backend="host")
    yield n
    n.close()


@pytest.fixture
def peer(node: baton.Node, partner: Partner) -> baton.Peer:
    p = node.connect(partner.socket, timeout=DEADLINE)
    assert p.pid == partner.pid
    return p


def table(peer: baton.Peer) -> dict:
    """The partner's lease table: buffers, leases, holders (pids)."""
    return peer.call("table", "py.Table", timeout=DEADLINE)


def spawn_python(script: Path, args: list, token: str, extra_env: Optional[dict] = None) -> Child:
    """Runs a Python child the way a Baton supervisor does: the session token in an
    inherited pipe named by BATON_TOKEN_FD (`<fd>:<inode>`), never in its environment."""
    r, w = os.pipe()
    try:
        os.write(w, token.encode())
    finally:
        os.close(w)
    env = dict(os.environ)
    env.pop("BATON_TOKEN", None)
    env["BATON_TOKEN_FD"] = f"{r}:{os.fstat(r).st_ino}"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent)] + sys.path)
    env.update(extra_env or {})
    try:
        return spawn([sys.executable, script, *args], env=env, pass_fds=(r,))
    finally:
        os.close(r)


@pytest.fixture
def children() -> Iterator[list]:
    """Child processes a test starts; killed and reaped after it."""
    started: list = []
    yield started
    for c in started:
        c.stop()
