#!/usr/bin/env python3
"""Issue 46: does a retired pool's memory come back while its Rust importer lives?

A Python node (torch holding the context, `BATON_CUDA_EXPORT=pool`) links a `py_partner`
(Baton's Rust example, serving), shares it a 64 MiB buffer (its `sink` reads it), frees it,
and then — by default — waits 3 s with the link up (past `POOL_IDLE_RETIRE`: the pool is
retired, `PoolRetired` sent, the partner drops its import) and measures; then closes the
node (the partner stays alive) and measures; then stops the partner and measures. With
`--close-first` the node closes at once after the free, as
`python/tests/test_cuda.py::test_a_closed_node_gives_the_device_its_memory_back` does.
With `--reverse` the partner exports and we import: it lends us 64 MiB of its pool
(`py.Lend`), torch reads it, we give the lease back, the partner drops its buffer
(`py.Forget`), and we measure 3 s later (its pool retired, the link up); `--write`: torch
also writes it (the lease opened writable), as the failing Rust pair's helper does.
Device memory in use (`torch.cuda.mem_get_info`, after a synchronise) since the partner
started is printed after each step.

usage: python3 bench/probe/pool_retire_python.py [--close-first | --reverse [--write]]
(needs torch, the baton wheel and a GPU; `BATON_PY_PARTNER` names the partner, else the GPU
bundle's)
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20


def main() -> None:
    os.environ["BATON_CUDA_EXPORT"] = "pool"
    import torch

    import baton

    def used() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    torch.zeros(1, device="cuda")
    where = tempfile.mkdtemp(prefix="baton-probe-")
    token = os.path.join(where, "token")
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, baton.generate_token().encode())
    os.close(fd)
    exe = os.environ.get("BATON_PY_PARTNER") or glob.glob(
        "/tmp/baton-gpu/target/*/examples/py_partner")[0]
    env = dict(os.environ, BATON_BACKEND="cuda")
    env.pop("BATON_TOKEN", None)
    partner = subprocess.Popen(
        [exe, "serve", "--dir", os.path.join(where, "p"), "--token-file", token],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    word, sock, _pid, _name = partner.stdout.readline().split()
    assert word == "ready", word
    base = used()

    def step(what: str) -> None:
        print(f"{what:<66} {(used() - base) / MIB:+8.1f} MiB in use", flush=True)

    node = baton.Node(token_file=token, backend="cuda")
    peer = node.connect(sock, timeout=10)
    step("node made and linked")
    if "--reverse" in sys.argv:
        shared = peer.call("lender", "py.Lend", {"index": 0, "len": 16 * MIB, "seed": 5})
        write = "--write" in sys.argv
        lease = shared["buffer"].open(writable=write)
        t = torch.from_dlpack(lease).view(torch.int32)
        int(t.sum())  # read it all
        if write:
            t.add_(1)
            torch.cuda.synchronize()
        del t
        step("the partner lent us 64 MiB of its pool; torch read it"
             + (" and wrote it" if write else ""))
        lease.release()
        del lease, shared
        end = time.monotonic() + 10
        while peer.call("table", "py.Table")["leases"] and time.monotonic() < end:
            time.sleep(0.01)
        assert peer.call("forgetter", "py.Forget", {"index": 0})
        step("the lease back, the partner dropped its buffer")
        time.sleep(3)
        step("3 s later: its pool retired, the link up")
        node.close()
        del peer, node
        time.sleep(2)
        step("node closed, 2 s later (the partner alive)")
        partner.terminate()
        partner.wait(10)
        return
    n = 16 * MIB  # float32: 64 MiB
    buf = node.allocate(n, "float32")
    t = torch.from_dlpack(buf)
    t.fill_(1.0)
    del t
    reply = peer.call("sink", "py.Sink", {"data": buf})
    assert reply["len"] == n and reply["sum"] == float(n), reply
    step("64 MiB shared and read by the partner")
    buf.release()
    end = time.monotonic() + 10
    while node.export_stats()["buffers"] and time.monotonic() < end:
        time.sleep(0.01)
    step("freed")
    if "--close-first" not in sys.argv:
        time.sleep(3)
        step("3 s later: the pool retired, the link up")
    node.close()
    del buf, peer, node
    time.sleep(2)
    step("node closed, 2 s later (the partner alive)")
    partner.terminate()
    partner.wait(10)
    time.sleep(0.5)
    step("the partner stopped")


if __name__ == "__main__":
    main()
