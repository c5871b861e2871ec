"""Liveness on the CUDA backend, two Python processes and PyTorch: **no wait on another
process is unbounded; memory returns once released.**

The scenario (from the issue): the parent allocates 256 MiB of device memory and sends it
to a child; the child opens it writable, queues a long kernel and then a write of a known
pattern on a torch stream, releases the lease and replies; the parent waits for
`leases_out == 0`, reads the pattern through a new view; the child then exits normally
(or, in the second test, is SIGKILLed); the parent calls `buf.release()`, `node.close()`,
then `torch.cuda.synchronize()` — which must return (on main, with counter fences, it never
did) — and the 256 MiB must be given back to the device.

Both tests run for each fence kind (`BATON_CUDA_FENCE`: counter, event) and each export
kind (`BATON_CUDA_EXPORT`: legacy, vmm, pool), with `BATON_FENCE_DEADLINE_MS=5000` (longer than the child's ~1 s kernel: an honest producer is never cut), all in
both processes' environments.

Every wait is bounded. A hang must fail a test, never hang pytest, and a CUDA call that
does not return cannot be interrupted in-process: so the whole parent side runs in a
subprocess (this file run as a script, `python test_liveness_cuda.py parent exit|sigkill`)
in a process group of its own, under a deadline; past it the group (the parent and its
child) is SIGKILLed and the test fails with what the parent printed, step by step. Inside
the parent every wait has its own, shorter deadline — Baton calls through `timeout=`,
polls through `wait_until`, and calls that take none (views that wait on fences,
`torch.cuda.synchronize()`) on a thread joined with a timeout — so a failure names the
wait that ran over. The child is killed and reaped in a `finally`, whatever happens.

Device memory is measured as the driver accounts it per process (`nvidia-smi
--query-compute-apps`), the parent's own usage against a baseline taken before the child
starts and before allocating; where that does not list the parent's pid (no `nvidia-smi`,
or a PID namespace), as device-wide free memory (`torch.cuda.mem_get_info`) against the
same baseline, the child being gone by then. Pool export keeps freed memory reserved for
the next allocation (up to its release threshold, 256 MiB, and Python cannot trim it):
there the test checks that the freed 256 MiB is reused by a new allocation of the same
size rather than given to the device.

Skipped, with the reason (`pytest -rs` prints it), without a GPU that Baton's CUDA backend
can use, without torch with CUDA, or where the device cannot export the way asked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import baton

FENCES = ("counter", "event")
EXPORTS = ("legacy", "vmm", "pool")
#: The fence deadline both processes run with (BATON_FENCE_DEADLINE_MS).
FENCE_DEADLINE_MS = 5000
#: The parent subprocess's deadline: well above a normal run (about 20 s, mostly imports)
#: plus any one of its own waits' deadlines, so that a wait that runs over is named by the
#: parent before this one fires.
PARENT_DEADLINE = 180.0
#: The parent's exit status when it finds no way to run (the reason on a "SKIP: " line).
SKIP_STATUS = 77

N = 64 << 20  # int32 elements: 256 MiB
SEED = 12345
#: GPU clock cycles of the child's spin before its write (about a second on an H100): the
#: write is still queued when the child lets go of the lease.
SPIN = 2_000_000_000
#: Per-wait deadline inside the parent and the child.
WAIT = 30.0
#: MiB of device memory the parent may use above its baseline at the end (lazily made
#: fence slabs and the like, in 2 MiB pages).
TOLERANCE_MIB = 8


# ---------------------------------------------------------------------------------------
# The tests (pytest's process: no CUDA work here but the skip check).


@pytest.fixture(scope="module")
def cuda_ready():
    """Skips, with the reason, unless Baton's CUDA backend and torch with CUDA work here."""
    try:
        baton.Node(token=baton.generate_token(), backend="cuda").close()
    except baton.BackendUnavailable as e:
        pytest.skip(f"no GPU for Baton's CUDA backend: {e}")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")


def run_parent(ending: str, fence: str, export: str) -> str:
    """Runs the parent side in its own process group under PARENT_DEADLINE; returns its
    output. Fails the test on a non-zero exit or a timeout; skips on SKIP_STATUS."""
    env = dict(os.environ)
    for name in ("BATON_TOKEN", "BATON_TOKEN_FD"):
        env.pop(name, None)  # the parent makes its own deployment
    env.update(
        BATON_BACKEND="cuda",
        BATON_CUDA_FENCE=fence,
        BATON_CUDA_EXPORT=export,
        BATON_FENCE_DEADLINE_MS=str(FENCE_DEADLINE_MS),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(sys.path),
    )
    proc = subprocess.Popen(
        [sys.executable, __file__, "parent", ending],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        start_new_session=True,  # its own process group: the child is in it too
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=PARENT_DEADLINE)
    except subprocess.TimeoutExpired:
        timed_out = True
        out = ""
    finally:
        # Whatever happened: nothing of the group outlives the test.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if timed_out:
        try:
            out, _ = proc.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            out = "(no output: the pipe stayed open past the kill)"
    proc.wait(timeout=WAIT)
    label = f"[fence={fence} export={export} child {ending}]"
    if timed_out:
        finished = "ok" in out.splitlines()
        pytest.fail(
            f"{label} the parent side did not finish within {PARENT_DEADLINE:.0f}s "
            + ("(its checks passed, but it did not exit)" if finished else "(a wait hung)")
            + f"; its output:\n{out}"
        )
    if proc.returncode == SKIP_STATUS:
        reasons = [line[len("SKIP: "):] for line in out.splitlines() if line.startswith("SKIP: ")]
        pytest.skip(f"{label} " + (reasons[-1] if reasons else out))
    if proc.returncode != 0:
        pytest.fail(f"{label} the parent side failed (exit status {proc.returncode}); its output:\n{out}")
    return out


@pytest.mark.parametrize("export", EXPORTS)
@pytest.mark.parametrize("fence", FENCES)
def test_after_the_child_exits_synchronize_returns_and_the_memory_goes_back(cuda_ready, fence, export):
    out = run_parent("exit", fence, export)
    assert "ok" in out.splitlines(), out


@pytest.mark.parametrize("export", EXPORTS)
@pytest.mark.parametrize("fence", FENCES)
def test_after_the_child_is_sigkilled_synchronize_returns_and_the_memory_goes_back(cuda_ready, fence, export):
    out = run_parent("sigkill", fence, export)
    assert "ok" in out.splitlines(), out


# ---------------------------------------------------------------------------------------
# The two processes (this file run as a script). Plain Python: no pytest here.


class Fail(Exception):
    """A check of the parent failed (the message says which)."""


class Skip(Exception):
    """The parent cannot run here (the message says why)."""


def say(*words) -> None:
    print(*words, flush=True)


def wait_until(cond, what: str, timeout: float = WAIT, detail=lambda: "") -> None:
    """Polls `cond` until it holds; Fail past `timeout`."""
    import time

    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise Fail(f"timed out after {timeout:.0f}s waiting for {what}{detail()}")
        time.sleep(0.05)


def bounded(fn, what: str, timeout: float = WAIT):
    """Runs `fn` on a thread and returns its result; Fail if it does not return within
    `timeout` (the thread is left behind: the parent then exits with os._exit)."""
    import threading

    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the waiting thread)
            result["error"] = e

    t = threading.Thread(target=run, name=what, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise Fail(f"{what} did not return within {timeout:.0f}s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def cuda_device() -> int:
    return int(os.environ.get("BATON_CUDA_DEVICE", "0"))


def fill_pattern(torch, t) -> None:
    """Queues the pattern t[i] = 7 i + SEED (int32) on the current stream, in place."""
    torch.arange(t.numel(), out=t)
    t.mul_(7).add_(SEED)


def check_pattern(torch, t, chunk: int = 8 << 20) -> None:
    """Compares `t` with the pattern, chunk by chunk (no 256 MiB temporary)."""
    for start in range(0, t.numel(), chunk):
        stop = min(start + chunk, t.numel())
        want = torch.arange(start, stop, device=t.device, dtype=torch.int32).mul_(7).add_(SEED)
        if not torch.equal(t[start:stop], want):
            bad = (t[start:stop] != want).nonzero()[0].item() + start
            raise Fail(f"the data read through a new view is wrong: element {bad} is {t[bad].item()}, not {7 * bad + SEED}")


def long_kernel(torch) -> None:
    """Queues about a second of GPU work on the current stream."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(SPIN)
    else:  # a torch without its private spin helper: large matmuls
        a = torch.ones(8192, 8192, device="cuda")
        for _ in range(50):
            a = a @ a / 8192


def per_process_mib():
    """MiB of device memory this process uses by the driver's accounting (`nvidia-smi
    --query-compute-apps`); None where that does not list our pid (no `nvidia-smi`, a PID
    namespace)."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=WAIT,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 2 and fields[0] == str(os.getpid()) and fields[1].isdigit():
            return int(fields[1])
    return None


def memory_meter(torch):
    """(a function giving MiB of device memory in use, what it measures): this process's
    own use where the driver's per-process figure can be read, else the whole device's."""
    if per_process_mib() is not None:

        def own() -> int:
            mib = per_process_mib()
            if mib is None:
                raise Fail("nvidia-smi no longer lists this process")
            return mib

        return own, "this process's use (nvidia-smi)"

    def device_wide() -> int:
        free, total = torch.cuda.mem_get_info(cuda_device())
        return (total - free) >> 20

    return device_wide, "the whole device's use (mem_get_info; nvidia-smi does not list this pid)"


class ChildProc:
    """The child, started as a Baton supervisor starts one (the session token in an
    inherited pipe named by BATON_TOKEN_FD), its stdout read on a thread."""

    def __init__(self, socket: str, token: str) -> None:
        import queue
        import threading

        r, w = os.pipe()
        try:
            os.write(w, token.encode())
        finally:
            os.close(w)
        env = dict(os.environ, BATON_TOKEN_FD=f"{r}:{os.fstat(r).st_ino}")
        env.pop("BATON_TOKEN", None)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "child", socket],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, pass_fds=(r,), text=True,
            )
        finally:
            os.close(r)
        self.lines: "queue.Queue" = queue.Queue()

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))
            self.lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def next_line(self, timeout: float = WAIT) -> str:
        import queue

        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise Fail(f"no line from the child within {timeout:.0f}s") from None
        if line is None:
            raise Fail(f"the child's stdout closed (exit status {self.proc.poll()})")
        return line

    def wait(self, what: str, timeout: float = WAIT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Fail(f"the child did not {what} within {timeout:.0f}s") from None

    def kill(self) -> None:
        """SIGKILLs (if still running) and reaps; for `finally`."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            pass
        for s in (self.proc.stdin, self.proc.stdout):
            try:
                s.close()
            except OSError:
                pass


def parent(ending: str) -> None:
    import gc
    import shutil
    import tempfile

    try:
        import torch
    except ImportError:
        raise Skip("torch is not installed") from None
    if not torch.cuda.is_available():
        raise Skip("torch has no CUDA device")
    token = baton.generate_token()  # the parent starts the deployment
    try:
        node = baton.Node(token=token, backend="cuda")
    except baton.BackendUnavailable as e:
        raise Skip(f"no GPU for Baton's CUDA backend here: {e}") from None
    baton.log_to_stderr("warn")
    dev = cuda_device()
    torch.cuda.set_device(dev)
    env = {k: os.environ.get(k) for k in ("BATON_CUDA_FENCE", "BATON_CUDA_EXPORT", "BATON_FENCE_DEADLINE_MS")}
    say("step: parent", os.getpid(), "on", node.backend, env)

    # Warm up everything used after the baseline (kernel modules load on first launch and
    # take device memory; the export pool is made at the first allocation): a small Baton
    # buffer, filled and checked through torch as the big one will be.
    small = node.allocate(1 << 16, "int32")
    t = torch.from_dlpack(small)
    fill_pattern(torch, t)
    check_pattern(torch, t)
    del t
    small.release()
    wait_until(lambda: node.export_stats()["buffers"] == 0, "the warm-up buffer to be freed")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    used_mib, how = memory_meter(torch)
    baseline = used_mib()
    say(f"step: baseline {baseline} MiB, {how}")

    sock_dir = tempfile.mkdtemp(prefix="baton-live-")
    child = None
    try:
        socket = str(node.listen(os.path.join(sock_dir, "p"), "parent.sock"))
        child = ChildProc(socket, token)
        word, pid = child.next_line(timeout=2 * WAIT).split()  # torch's import is slow
        if (word, int(pid)) != ("ready", child.pid):
            raise Fail(f"the child said {word} {pid}")
        peer = node.accept(timeout=WAIT)
        if peer.pid != child.pid:
            raise Fail(f"a peer {peer.pid} linked in, not the child {child.pid}")
        say("step: child", child.pid, "linked")

        buf = node.allocate(N, "int32")
        reply = peer.call("filler", "liveness.Fill", {"buffer": buf}, timeout=2 * WAIT)
        say("step: child replied", reply)
        if reply.get("nbytes") != 4 * N:
            raise Fail(f"the child saw {reply.get('nbytes')} bytes, not {4 * N}")
        wait_until(lambda: buf.leases_out == 0, "the child's lease to come back (leases_out == 0)")
        say("step: leases_out == 0")

        def read_back() -> None:
            torch.cuda.set_device(dev)  # the current device is per thread
            view = torch.from_dlpack(buf)  # a new view: waits on the child's release fence
            check_pattern(torch, view)
            torch.cuda.synchronize(dev)  # a thread's own: name the device

        bounded(read_back, "reading the buffer through a new view")
        say("step: the pattern read back through a new view")

        if ending == "exit":
            child.proc.stdin.write("exit\n")
            child.proc.stdin.flush()
            status = child.wait("exit after being told to")
            if status != 0:
                raise Fail(f"the child exited with status {status}")
        else:
            child.proc.kill()
            status = child.wait("die of SIGKILL")
            if status != -signal.SIGKILL:
                raise Fail(f"the SIGKILLed child ended with status {status}")
        say("step: child ended", status)

        buf.release()
        node.close()
        say("step: buf.release(), node.close()")
        bounded(lambda: torch.cuda.synchronize(dev), "torch.cuda.synchronize() after buf.release() and node.close()")
        say("step: torch.cuda.synchronize() returned")

        def stats() -> str:
            return f"; Baton's export stats {node.export_stats()}, lease table {node.lease_table()}"

        wait_until(lambda: node.export_stats()["buffers"] == 0, "Baton to free the buffer", detail=stats)
        allowed = baseline + TOLERANCE_MIB
        if os.environ.get("BATON_CUDA_EXPORT") == "pool":
            # The pool keeps the freed 256 MiB reserved: a new allocation of that size must
            # reuse it (were it still held, use would grow by another 256 MiB).
            again = node.allocate(N, "int32")
            allowed += (4 * N) >> 20
            what = "a new 256 MiB pool allocation to reuse the freed memory"
        else:
            again = None
            what = "the 256 MiB to go back to the device"
        last = []

        def back() -> bool:
            gc.collect()
            torch.cuda.empty_cache()
            last[:] = [used_mib()]
            return last[0] <= allowed

        wait_until(back, what, detail=lambda: f": {last[0]} MiB used, baseline {baseline} MiB ({how}), "
                   f"at most {allowed} MiB allowed" + stats())
        say(f"step: {last[0]} MiB used, baseline {baseline} MiB, at most {allowed} allowed ({how})")
        if again is not None:
            again.release()
            wait_until(lambda: node.export_stats()["buffers"] == 0, "Baton to free the reused buffer", detail=stats)
    finally:
        if child is not None:
            child.kill()
        shutil.rmtree(sock_dir, ignore_errors=True)
    say("ok")


def child(socket: str) -> None:
    import torch

    baton.log_to_stderr("warn")
    torch.cuda.set_device(cuda_device())
    node = baton.Node(backend="cuda")  # the token from BATON_TOKEN_FD, read and closed
    # Load the kernels used below first (a first launch can wait for the device).
    x = torch.zeros(4, device="cuda", dtype=torch.int32)
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(1)
    fill_pattern(torch, x)
    torch.cuda.synchronize()
    mailbox = node.register("filler", "liveness.Fill")
    peer = node.connect(socket, timeout=WAIT)  # kept: the link lives as long as we do
    assert peer.connected
    say("ready", os.getpid())

    call = mailbox.recv(timeout=2 * WAIT)
    lease = call.message["buffer"].open(writable=True)
    nbytes = lease.nbytes
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        t = torch.from_dlpack(lease)  # the parent's memory
        long_kernel(torch)
        fill_pattern(torch, t)  # queued behind the long kernel; nobody waits for it here
        written = torch.cuda.Event()
        written.record(stream)
    del t
    released_now = lease.release()
    pending = not written.query()
    del lease
    call.reply({"nbytes": nbytes, "released_now": released_now, "write_pending_at_release": pending})
    sys.stdin.readline()  # "exit" (or EOF), unless SIGKILLed first
    # ... and exits normally, as a user's script ends.


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "child":
        child(sys.argv[2])
        sys.exit(0)
    try:
        parent(sys.argv[2])
    except Skip as e:
        say(f"SKIP: {e}")
        sys.stdout.flush()
        os._exit(SKIP_STATUS)
    except BaseException as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        say(f"FAIL: {e}")
        sys.stdout.flush()
        sys.stderr.flush()
        # A thread may be stuck in a CUDA call (that is what failed): exit without joining.
        os._exit(1)
    sys.exit(0)
