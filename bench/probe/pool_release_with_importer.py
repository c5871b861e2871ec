#!/usr/bin/env python3
"""Does another process's import of our memory pool keep freed pool memory on the device?

The driver API through ctypes, torch holding the primary context. We make a pool (release
threshold 256 MiB), allocate 256 MiB from it and export the pool and the pointer; a child
imports both, then frees its mapping (cuMemFreeAsync, synchronised) but keeps the imported
pool. We free our allocation and try to give the memory back (threshold 0, synchronise,
trim to 0) while the child still holds the imported pool, then after it destroyed it, then
after it exited. Device free memory is printed after each step.

With `--destroy-first`, the order Baton's pool retirement takes: we free our allocation and
destroy our pool while the child, alive, still holds the imported pool; then the child
destroys its import; then it synchronises its context; then it exits.

`--child-copies`: the child also does what Baton's importer does with a mapping between
import and free — asks its size (`cuMemGetAddressRange_v2`), reads it all into pageable host
memory and writes it all back (`cuMemcpyDtoHAsync`, `cuMemcpyHtoDAsync` on its stream, each
synchronised). `--child-memset`: a `cuMemsetD8Async` of it instead. `--mib N`: the size
(default 256). `--tell-at-once`: with `--destroy-first`, the child is told to destroy its import
the moment our `cuMemPoolDestroy` returns (no synchronise, no measure between), as Baton's
`PoolRetired` does. `--export-first`: the pool's descriptor is exported before the allocation
(as Baton's `ExportPool::create` does), not after. `--legacy-open`: we also share a 2 MiB
`cuMemAlloc` buffer by legacy IPC, which the child opens (`cuIpcOpenMemHandle`) before it
imports the pool and closes only after it destroyed its import — as Baton's importer keeps
the exporter's fence inbox mapped for as long as the link lives. `--legacy-both`: that, and
the child shares us a buffer the same way, which we keep open to the end (each side of a
Baton link maps the other's inbox). `--child-pool`: the child has an exported pool of its
own from the start (as a Baton backend of the pool kind has). `--no-torch`: each side takes
the primary context with the driver API alone, as cudarc does, instead of through torch.
`--threads`: the child's driver calls (import, copies, free, destroy) each run on a thread of
its own with the context pushed and popped around them, as Baton runs them.

`--baton-order`: a link's order, as Baton's trace shows it (`RUST_LOG=baton_ipc::cuda::calls=trace`):
each side makes its fence inbox (a 32 KiB `cuMemAlloc`, legacy-shared) and an exported pool of
its own first, and each opens the other's inbox (lazy peer access) before our allocation; the
allocation is zeroed, the child imports it, reads and writes it, frees it; we free it, drop the
threshold, destroy our pool; the child destroys its import; then we close our mapping of the
child's inbox, then the child closes its mapping of ours, each step measured. With it, `--parent-htod`: our
allocation is written from pageable host memory (`cuMemcpyHtoDAsync`, as Baton's `write_at`)
instead of zeroed; `--parent-dtoh`: we read it back into pageable memory after the child's use
(as `to_vec`).

usage: python3 bench/probe/pool_release_with_importer.py [--destroy-first] [--child-copies|--child-memset] [--mib N] [--tell-at-once] [--export-first] [--legacy-open|--legacy-both] [--child-pool] [--baton-order [--parent-htod] [--parent-dtoh]] [--no-torch] [--threads]
(needs torch and a GPU)
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import threading

cuda = ctypes.CDLL("libcuda.so.1")
MIB = 1 << 20
SIZE = (int(sys.argv[sys.argv.index("--mib") + 1]) if "--mib" in sys.argv else 256) * MIB
POSIX_FD, PINNED, DEVICE, READ_WRITE = 1, 1, 1, 3
LEGACY = "--legacy-open" in sys.argv or "--legacy-both" in sys.argv
BOTH = "--legacy-both" in sys.argv


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]
RELEASE_THRESHOLD = 4


def check(name: str, *args) -> None:
    rc = getattr(cuda, name)(*args)
    if rc != 0:
        raise RuntimeError(f"{name} failed: CUresult {rc}")


CTX = ctypes.c_void_p()


def on_thread(fn):
    """`fn()`; with `--threads` on a thread of its own with our context pushed and popped
    around it, as Baton's driver calls run (each on whichever thread, in a push/pop)."""
    if "--threads" not in sys.argv:
        return fn()
    out = {}

    def run() -> None:
        check("cuCtxPushCurrent_v2", CTX)
        try:
            out["v"] = fn()
        finally:
            check("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out.get("v")


def context() -> None:
    context_made()
    check("cuCtxGetCurrent", ctypes.byref(CTX))


def context_made() -> None:
    if "--no-torch" in sys.argv:
        # The primary context as cudarc (and so Baton) takes it: retained and made current.
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        check("cuInit", ctypes.c_uint(0))
        check("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(0))
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        check("cuCtxSetCurrent", ctx)
        return
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()


def free() -> int:
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    check("cuCtxSynchronize")
    check("cuMemGetInfo_v2", ctypes.byref(f), ctypes.byref(t))
    return f.value


def own_pool() -> ctypes.c_void_p:
    """A pool of our own with the POSIX-fd handle type, exported (as each Baton backend of
    the pool kind makes one when it starts)."""
    props = (ctypes.c_ubyte * 88)()
    fields = (ctypes.c_int * 4).from_buffer(props)
    fields[0], fields[1], fields[2], fields[3] = PINNED, POSIX_FD, DEVICE, 0
    pool, fd = ctypes.c_void_p(), ctypes.c_int()
    check("cuMemPoolCreate", ctypes.byref(pool), props)
    check("cuMemPoolExportToShareableHandle", ctypes.byref(fd), pool, ctypes.c_int(POSIX_FD),
          ctypes.c_ulonglong(0))
    return pool


def import_allocation(fd: int, export) -> tuple[ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p]:
    """The parent's pool imported from its descriptor (closed after), made accessible, the
    allocation `export` names mapped; and a stream of our own."""
    pool, ptr, s = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_void_p()
    check("cuMemPoolImportFromShareableHandle", ctypes.byref(pool),
          ctypes.c_void_p(fd), ctypes.c_int(POSIX_FD), ctypes.c_ulonglong(0))
    os.close(fd)
    desc = (ctypes.c_int * 3)(DEVICE, 0, READ_WRITE)
    check("cuMemPoolSetAccess", pool, desc, ctypes.c_size_t(1))
    check("cuMemPoolImportPointer", ctypes.byref(ptr), pool, export)
    check("cuStreamCreate", ctypes.byref(s), ctypes.c_uint(1))
    return pool, ptr, s


def unmap_then_destroy(sock: socket.socket, pool, ptr, s) -> None:
    """Frees our mapping (synchronised) and says so; once told, destroys the imported pool
    and says so; then waits to be told again."""
    def unmap() -> None:
        check("cuMemFreeAsync", ptr, s)
        check("cuStreamSynchronize", s)

    on_thread(unmap)
    sock.sendall(b"m")  # mapping freed, pool kept
    sock.recv(1)
    on_thread(lambda: check("cuMemPoolDestroy", pool))
    sock.sendall(b"p")  # imported pool destroyed
    sock.recv(1)


def child(sock_fd: int) -> None:
    context()
    kept = own_pool() if "--child-pool" in sys.argv else None  # noqa: F841 (kept to the end)
    sock = socket.socket(fileno=sock_fd)
    data, fds, _, _ = socket.recv_fds(sock, 1024, 1)
    export = (ctypes.c_ubyte * 64).from_buffer_copy(data[:64])
    legacy = ctypes.c_uint64()
    if LEGACY:
        # Open our parent's other (cuMemAlloc) buffer first, as Baton opens a peer's fence
        # inbox when the link comes up.
        handle = IpcMemHandle.from_buffer_copy(data[64:128])
        check("cuIpcOpenMemHandle_v2", ctypes.byref(legacy), handle, ctypes.c_uint(1))
    if BOTH:
        # ... and share one of ours the other way, as each side lends the other its inbox.
        mine, handle = ctypes.c_uint64(), IpcMemHandle()
        check("cuMemAlloc_v2", ctypes.byref(mine), ctypes.c_size_t(2 * MIB))
        check("cuIpcGetMemHandle", ctypes.byref(handle), mine)
        sock.sendall(bytes(handle))
    pool, ptr, s = import_allocation(fds[0], export)
    if "--child-copies" in sys.argv:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        check("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
        host = ctypes.create_string_buffer(size.value)
        check("cuMemcpyDtoHAsync_v2", host, ptr, size, s)
        check("cuStreamSynchronize", s)
        check("cuMemcpyHtoDAsync_v2", ptr, host, size, s)
        check("cuStreamSynchronize", s)
    if "--child-memset" in sys.argv:
        check("cuMemsetD8Async", ptr, ctypes.c_ubyte(7), ctypes.c_size_t(SIZE), s)
        check("cuStreamSynchronize", s)
    unmap_then_destroy(sock, pool, ptr, s)
    if LEGACY:
        check("cuIpcCloseMemHandle", legacy)
    check("cuCtxSynchronize")
    sock.sendall(b"s")  # context synchronised
    sock.recv(1)


def main() -> None:
    context()
    base = free()

    def step(what: str) -> None:
        print(f"{what:<66} {(base - free()) / MIB:+8.1f} MiB in use", flush=True)

    props = (ctypes.c_ubyte * 88)()
    fields = (ctypes.c_int * 4).from_buffer(props)
    fields[0], fields[1], fields[2], fields[3] = PINNED, POSIX_FD, DEVICE, 0
    pool, ptr, s = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_void_p()
    check("cuMemPoolCreate", ctypes.byref(pool), props)
    threshold = ctypes.c_uint64(256 * MIB)
    check("cuMemPoolSetAttribute", pool, ctypes.c_int(RELEASE_THRESHOLD), ctypes.byref(threshold))
    check("cuStreamCreate", ctypes.byref(s), ctypes.c_uint(1))
    fd = ctypes.c_int()

    def export_pool() -> None:
        check("cuMemPoolExportToShareableHandle", ctypes.byref(fd), pool, ctypes.c_int(POSIX_FD),
              ctypes.c_ulonglong(0))

    if "--export-first" in sys.argv:
        export_pool()
    check("cuMemAllocFromPoolAsync", ctypes.byref(ptr), ctypes.c_size_t(SIZE), pool, s)
    check("cuStreamSynchronize", s)
    step(f"{SIZE // MIB} MiB allocated from our pool")
    if "--export-first" not in sys.argv:
        export_pool()
    export = (ctypes.c_ubyte * 64)()
    check("cuMemPoolExportPointer", export, ptr)
    message = bytes(export)
    if LEGACY:
        other, handle = ctypes.c_uint64(), IpcMemHandle()
        check("cuMemAlloc_v2", ctypes.byref(other), ctypes.c_size_t(2 * MIB))
        check("cuIpcGetMemHandle", ctypes.byref(handle), other)
        message += bytes(handle)
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                             str(theirs.fileno()), *sys.argv[1:]], pass_fds=[theirs.fileno()])
    theirs.close()
    socket.send_fds(ours, [message], [fd.value])
    os.close(fd.value)
    theirs_legacy = ctypes.c_uint64()
    if BOTH:
        handle = IpcMemHandle.from_buffer_copy(ours.recv(64, socket.MSG_WAITALL))
        check("cuIpcOpenMemHandle_v2", ctypes.byref(theirs_legacy), handle, ctypes.c_uint(1))
    assert ours.recv(1) == b"m"
    base = free()  # the child's context is in the baseline from here
    step("(baseline again: the child imported the pool, mapped and unmapped)")
    check("cuMemFreeAsync", ptr, s)
    check("cuStreamSynchronize", s)
    zero = ctypes.c_uint64(0)
    check("cuMemPoolSetAttribute", pool, ctypes.c_int(RELEASE_THRESHOLD), ctypes.byref(zero))
    check("cuStreamSynchronize", s)
    step("freed, threshold 0, synchronised; the child holds the imported pool")
    if "--destroy-first" in sys.argv:
        check("cuMemPoolDestroy", pool)
        if "--tell-at-once" not in sys.argv:
            check("cuStreamSynchronize", s)
            step("our pool destroyed; the child, alive, holds the imported pool")
        ours.sendall(b"x")
        assert ours.recv(1) == b"p"
        step("the child destroyed its imported pool (alive)")
        ours.sendall(b"x")
        assert ours.recv(1) == b"s"
        step("the child closed its legacy mapping, synchronised (alive)" if LEGACY
             else "the child synchronised its context (alive)")
        ours.sendall(b"x")
        proc.wait(timeout=60)
        step("the child exited (its context's memory leaves the measure)")
        return
    check("cuMemPoolTrimTo", pool, ctypes.c_size_t(0))
    step("trimmed to 0; the child holds the imported pool")
    ours.sendall(b"x")
    assert ours.recv(1) == b"p"
    step("the child destroyed its imported pool")
    check("cuMemPoolTrimTo", pool, ctypes.c_size_t(0))
    step("trimmed to 0 again")
    ours.sendall(b"x")
    assert ours.recv(1) == b"s"
    ours.sendall(b"x")
    proc.wait(timeout=60)
    step("the child exited (its context's memory leaves the measure)")
    check("cuMemPoolDestroy", pool)
    step("our pool destroyed")


def inbox() -> tuple[ctypes.c_uint64, IpcMemHandle]:
    """A fence inbox as a Baton backend makes one: 32 KiB of `cuMemAlloc`, zeroed, shared
    by legacy IPC."""
    mem, handle = ctypes.c_uint64(), IpcMemHandle()
    check("cuMemAlloc_v2", ctypes.byref(mem), ctypes.c_size_t(32 << 10))
    check("cuMemsetD8_v2", mem, ctypes.c_ubyte(0), ctypes.c_size_t(32 << 10))
    check("cuIpcGetMemHandle", ctypes.byref(handle), mem)
    return mem, handle


def open_inbox(raw: bytes) -> ctypes.c_uint64:
    mapped = ctypes.c_uint64()
    check("cuIpcOpenMemHandle_v2", ctypes.byref(mapped), IpcMemHandle.from_buffer_copy(raw),
          ctypes.c_uint(1))
    return mapped


def baton_child(sock_fd: int) -> None:
    context()
    _mine, handle = inbox()
    kept = own_pool()  # noqa: F841 (kept to the end)
    sock = socket.socket(fileno=sock_fd)
    theirs = open_inbox(sock.recv(64, socket.MSG_WAITALL))
    sock.sendall(bytes(handle))
    data, fds, _, _ = socket.recv_fds(sock, 64, 1)
    export = (ctypes.c_ubyte * 64).from_buffer_copy(data[:64])
    pool, ptr, s = on_thread(lambda: import_allocation(fds[0], export))
    host = ctypes.create_string_buffer(SIZE)

    def copies() -> None:
        check("cuMemcpyDtoHAsync_v2", host, ptr, ctypes.c_size_t(SIZE), s)
        check("cuStreamSynchronize", s)
        check("cuMemcpyHtoDAsync_v2", ptr, host, ctypes.c_size_t(SIZE), s)
        check("cuStreamSynchronize", s)

    on_thread(copies)
    unmap_then_destroy(sock, pool, ptr, s)
    check("cuIpcCloseMemHandle", theirs)
    sock.sendall(b"c")  # our mapping of the parent's inbox closed
    sock.recv(1)


def baton_main() -> None:
    context()
    _mine, handle = inbox()
    props = (ctypes.c_ubyte * 88)()
    fields = (ctypes.c_int * 4).from_buffer(props)
    fields[0], fields[1], fields[2], fields[3] = PINNED, POSIX_FD, DEVICE, 0
    pool, fd = ctypes.c_void_p(), ctypes.c_int()
    check("cuMemPoolCreate", ctypes.byref(pool), props)
    threshold = ctypes.c_uint64(256 * MIB)
    check("cuMemPoolSetAttribute", pool, ctypes.c_int(RELEASE_THRESHOLD), ctypes.byref(threshold))
    check("cuMemPoolExportToShareableHandle", ctypes.byref(fd), pool, ctypes.c_int(POSIX_FD),
          ctypes.c_ulonglong(0))
    ours, theirs_sock = socket.socketpair()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                             str(theirs_sock.fileno()), *sys.argv[1:]],
                            pass_fds=[theirs_sock.fileno()])
    theirs_sock.close()
    ours.sendall(bytes(handle))
    theirs = open_inbox(ours.recv(64, socket.MSG_WAITALL))
    base = free()

    def step(what: str) -> None:
        print(f"{what:<66} {(base - free()) / MIB:+8.1f} MiB in use", flush=True)

    ptr, s = ctypes.c_uint64(), ctypes.c_void_p()
    check("cuStreamCreate", ctypes.byref(s), ctypes.c_uint(1))
    check("cuMemAllocFromPoolAsync", ctypes.byref(ptr), ctypes.c_size_t(SIZE), pool, s)
    export = (ctypes.c_ubyte * 64)()
    check("cuMemPoolExportPointer", export, ptr)
    if "--parent-htod" in sys.argv:  # as a Baton `write_at` does: from pageable memory
        pattern = ctypes.create_string_buffer(b"\x05" * SIZE, SIZE)
        check("cuMemcpyHtoDAsync_v2", ptr, pattern, ctypes.c_size_t(SIZE), s)
    else:
        check("cuMemsetD8Async", ptr, ctypes.c_ubyte(0), ctypes.c_size_t(SIZE), s)
    check("cuStreamSynchronize", s)
    step(f"{SIZE // MIB} MiB allocated from our pool (each side maps the other's inbox)")
    socket.send_fds(ours, [bytes(export)], [fd.value])
    assert ours.recv(1) == b"m"
    step("the child imported, read, wrote and freed its mapping")
    if "--parent-dtoh" in sys.argv:  # as a Baton `to_vec` does: into pageable memory
        back = ctypes.create_string_buffer(SIZE)
        check("cuMemcpyDtoHAsync_v2", back, ptr, ctypes.c_size_t(SIZE), s)
        check("cuStreamSynchronize", s)
        step("we read it back into pageable memory")
    check("cuMemFreeAsync", ptr, s)
    zero = ctypes.c_uint64(0)
    check("cuMemPoolSetAttribute", pool, ctypes.c_int(RELEASE_THRESHOLD), ctypes.byref(zero))
    check("cuStreamSynchronize", s)
    step("freed, threshold 0, synchronised")
    check("cuMemPoolDestroy", pool)
    os.close(fd.value)
    ours.sendall(b"x")
    assert ours.recv(1) == b"p"
    step("our pool destroyed, then the child destroyed its import (alive)")
    check("cuIpcCloseMemHandle", theirs)
    step("we closed our mapping of the child's inbox")
    ours.sendall(b"x")
    assert ours.recv(1) == b"c"
    step("the child closed its mapping of our inbox (alive)")
    ours.sendall(b"x")
    proc.wait(timeout=60)
    step("the child exited")


if __name__ == "__main__":
    ORDER = "--baton-order" in sys.argv
    if sys.argv[1:2] == ["--child"]:
        (baton_child if ORDER else child)(int(sys.argv[2]))
    else:
        (baton_main if ORDER else main)()
