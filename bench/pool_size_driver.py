#!/usr/bin/env python3
"""The pool-size crash (`bench/pool_size_probe.py`) without Baton: the CUDA driver API
through ctypes exports a memory pool as a POSIX descriptor and one allocation's pointer; a
child process imports the pool (the descriptor over a Unix socket, SCM_RIGHTS), sets its
access, imports the pointer and reads 16 bytes — the calls Baton's importer makes. If this
child dies as Baton's importer does, the driver is at fault; if not, Baton's import is.

Found (H200, driver 580.159.04, 2026-11-26): 5 GiB imports; 5.5, 6, 6.5, 7 and 8 GiB die
with SIGSEGV in `cuMemPoolImportPointer` (the pool import and its access succeed) — the
driver's fault (`docs/bench/h200/run-bf-de6abf0-pool-size-driver.log`).

usage: SIZES=5,7 python3 bench/pool_size_driver.py   (GiB; fractions allowed)   (needs torch for the primary context)
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys

POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE

cuda = ctypes.CDLL("libcuda.so.1")


def check(name: str, *args) -> None:
    rc = getattr(cuda, name)(*args)
    if rc != 0:
        raise RuntimeError(f"{name} failed: CUresult {rc}")


def context() -> None:
    import torch

    torch.zeros(1, device="cuda")  # the primary context, current on this thread


def pool_props() -> ctypes.Array:
    props = (ctypes.c_ubyte * 88)()  # CUmemPoolProps, zeroed: no max size, default usage
    fields = (ctypes.c_int * 4).from_buffer(props)
    fields[0], fields[1], fields[2], fields[3] = PINNED, POSIX_FD, DEVICE, 0
    return props


def child(sock_fd: int) -> None:
    context()
    sock = socket.socket(fileno=sock_fd)
    data, fds, _, _ = socket.recv_fds(sock, 1024, 1)
    export = (ctypes.c_ubyte * 64).from_buffer_copy(data[:64])
    pool = ctypes.c_void_p()
    check("cuMemPoolImportFromShareableHandle", ctypes.byref(pool),
          ctypes.c_void_p(fds[0]), ctypes.c_int(POSIX_FD), ctypes.c_ulonglong(0))
    desc = (ctypes.c_int * 3)(DEVICE, 0, READ_WRITE)  # CUmemAccessDesc
    check("cuMemPoolSetAccess", pool, desc, ctypes.c_size_t(1))
    sock.sendall(b"pool imported;")
    ptr = ctypes.c_uint64()
    check("cuMemPoolImportPointer", ctypes.byref(ptr), pool, export)
    sock.sendall(b" pointer imported;")
    host = (ctypes.c_ubyte * 16)()
    check("cuMemcpyDtoH_v2", host, ptr, ctypes.c_size_t(16))
    sock.sendall(f" read {sum(host)}".encode())


def main() -> None:
    context()
    for gib in [float(x) for x in os.environ.get("SIZES", "5,7").split(",")]:
        size = int(gib * (1 << 30))
        pool, ptr, stream = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_void_p()
        check("cuMemPoolCreate", ctypes.byref(pool), pool_props())
        check("cuStreamCreate", ctypes.byref(stream), ctypes.c_uint(1))
        check("cuMemAllocFromPoolAsync", ctypes.byref(ptr), ctypes.c_size_t(size), pool, stream)
        check("cuMemsetD8Async", ptr, ctypes.c_ubyte(0), ctypes.c_size_t(size), stream)
        check("cuStreamSynchronize", stream)
        fd = ctypes.c_int()
        check("cuMemPoolExportToShareableHandle", ctypes.byref(fd), pool,
              ctypes.c_int(POSIX_FD), ctypes.c_ulonglong(0))
        export = (ctypes.c_ubyte * 64)()
        check("cuMemPoolExportPointer", export, ptr)
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                 str(theirs.fileno())], pass_fds=[theirs.fileno()])
        theirs.close()
        socket.send_fds(ours, [bytes(export)], [fd.value])
        ours.settimeout(120)
        said = b""
        try:
            while chunk := ours.recv(256):
                said += chunk
        except OSError as e:
            said += f" ({e!r})".encode()
        status = proc.wait(timeout=120)
        print(f"{gib} GiB: child said {said.decode()!r}, status {status}", flush=True)
        ours.close()
        os.close(fd.value)
        check("cuMemFreeAsync", ptr, stream)
        check("cuStreamSynchronize", stream)
        check("cuMemPoolDestroy", pool)


if __name__ == "__main__":
    child(int(sys.argv[2])) if sys.argv[1:2] == ["--child"] else main()
