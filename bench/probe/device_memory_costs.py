#!/usr/bin/env python3
"""What each driver object Baton makes costs in device memory, and what gives it back.

The CUDA driver API through ctypes, with torch holding the primary context (as in a
PyTorch process): device free memory (`cuMemGetInfo_v2`) before and after each step, in
MiB. Steps: interprocess events (Baton's event fences and its event pool), streams (its
release streams), small legacy allocations (its fence inbox and counter slabs), a pool with
a 256 MiB release threshold (its export pool: what a freed allocation leaves reserved, and
which of "set the threshold to 0 and synchronise", "trim" and "destroy" gives it back), and
opening another process's legacy memory and event (an importer's side).

usage: python3 bench/probe/device_memory_costs.py      (needs torch and a GPU)
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys

cuda = ctypes.CDLL("libcuda.so.1")
MIB = 1 << 20
INTERPROCESS = 0x4 | 0x2  # CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING
RELEASE_THRESHOLD = 4  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
POSIX_FD, PINNED, DEVICE = 1, 1, 1


class Handle64(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def check(name: str, *args) -> None:
    rc = getattr(cuda, name)(*args)
    if rc != 0:
        raise RuntimeError(f"{name} failed: CUresult {rc}")


def context() -> None:
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()


def free() -> int:
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    check("cuCtxSynchronize")
    check("cuMemGetInfo_v2", ctypes.byref(f), ctypes.byref(t))
    return f.value


class Meter:
    def __init__(self) -> None:
        self.base = self.last = free()

    def step(self, what: str) -> None:
        now = free()
        print(f"{what:<62} step {(self.last - now) / MIB:+9.1f} MiB   "
              f"since start {(self.base - now) / MIB:+9.1f} MiB", flush=True)
        self.last = now


def events(m: Meter) -> None:
    evs = []
    for n in (1, 63, 64):
        for _ in range(n):
            e = ctypes.c_void_p()
            check("cuEventCreate", ctypes.byref(e), ctypes.c_uint(INTERPROCESS))
            evs.append(e)
        m.step(f"{len(evs)} interprocess events made")
    h = Handle64()
    check("cuIpcGetEventHandle", ctypes.byref(h), evs[0])
    m.step("an event's IPC handle taken")
    for e in evs:
        check("cuEventDestroy_v2", e)
    m.step("every event destroyed")


def streams(m: Meter) -> None:
    ss = []
    for n in (1, 3, 28):
        for _ in range(n):
            s = ctypes.c_void_p()
            check("cuStreamCreate", ctypes.byref(s), ctypes.c_uint(1))
            ss.append(s)
        m.step(f"{len(ss)} streams made")
    for s in ss:
        check("cuStreamDestroy_v2", s)
    m.step("every stream destroyed")


def small_allocations(m: Meter) -> None:
    ptrs = []
    for size in (8, 4096, 2 * MIB):
        p = ctypes.c_uint64()
        check("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(size))
        ptrs.append(p)
        m.step(f"cuMemAlloc of {size} bytes")
    for p in ptrs:
        check("cuMemFree_v2", p)
    m.step("all freed")


def pool(m: Meter, give_back: str) -> None:
    props = (ctypes.c_ubyte * 88)()
    fields = (ctypes.c_int * 4).from_buffer(props)
    fields[0], fields[1], fields[2], fields[3] = PINNED, POSIX_FD, DEVICE, 0
    p, s, ptr = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint64()
    check("cuMemPoolCreate", ctypes.byref(p), props)
    threshold = ctypes.c_uint64(256 * MIB)
    check("cuMemPoolSetAttribute", p, ctypes.c_int(RELEASE_THRESHOLD), ctypes.byref(threshold))
    check("cuStreamCreate", ctypes.byref(s), ctypes.c_uint(1))
    m.step(f"[{give_back}] pool made (threshold 256 MiB)")
    check("cuMemAllocFromPoolAsync", ctypes.byref(ptr), ctypes.c_size_t(256 * MIB), p, s)
    check("cuStreamSynchronize", s)
    m.step(f"[{give_back}] 256 MiB allocated from it")
    check("cuMemFreeAsync", ptr, s)
    if give_back == "trim before sync":
        check("cuMemPoolTrimTo", p, ctypes.c_size_t(0))
        m.step(f"[{give_back}] freed (async), trimmed at once")
    check("cuStreamSynchronize", s)
    m.step(f"[{give_back}] freed, stream synchronised")
    if give_back == "threshold 0":
        zero = ctypes.c_uint64(0)
        check("cuMemPoolSetAttribute", p, ctypes.c_int(RELEASE_THRESHOLD), ctypes.byref(zero))
        m.step(f"[{give_back}] threshold set to 0")
        check("cuStreamSynchronize", s)
        m.step(f"[{give_back}] stream synchronised again")
    if give_back in ("trim", "trim before sync"):
        check("cuMemPoolTrimTo", p, ctypes.c_size_t(0))
        m.step(f"[{give_back}] trimmed to 0")
    check("cuStreamDestroy_v2", s)
    check("cuMemPoolDestroy", p)
    m.step(f"[{give_back}] pool and stream destroyed")


def child(sock_fd: int) -> None:
    context()
    sock = socket.socket(fileno=sock_fd)
    p, e = ctypes.c_uint64(), ctypes.c_void_p()
    check("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(64 * MIB))
    check("cuEventCreate", ctypes.byref(e), ctypes.c_uint(INTERPROCESS))
    mh, eh = Handle64(), Handle64()
    check("cuIpcGetMemHandle", ctypes.byref(mh), p)
    check("cuIpcGetEventHandle", ctypes.byref(eh), e)
    sock.sendall(bytes(mh) + bytes(eh))
    sock.recv(1)  # until the parent is done


def imports(m: Meter) -> None:
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                             str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    data = b""
    while len(data) < 128:
        data += ours.recv(128 - len(data))
    m.step("(another process made 64 MiB and an event)")
    mh = Handle64.from_buffer_copy(data[:64])
    eh = Handle64.from_buffer_copy(data[64:])
    p, e = ctypes.c_uint64(), ctypes.c_void_p()
    check("cuIpcOpenMemHandle_v2", ctypes.byref(p), mh, ctypes.c_uint(1))
    m.step("its 64 MiB opened (cuIpcOpenMemHandle)")
    check("cuIpcOpenEventHandle", ctypes.byref(e), eh)
    m.step("its event opened (cuIpcOpenEventHandle)")
    check("cuIpcCloseMemHandle", p)
    check("cuEventDestroy_v2", e)
    m.step("both closed")
    ours.sendall(b"x")
    proc.wait(timeout=60)
    m.step("the other process exited")


def main() -> None:
    context()
    m = Meter()
    events(m)
    streams(m)
    small_allocations(m)
    for give_back in ("none", "threshold 0", "trim", "trim before sync"):
        pool(m, give_back)
    imports(m)


if __name__ == "__main__":
    child(int(sys.argv[2])) if sys.argv[1:2] == ["--child"] else main()
