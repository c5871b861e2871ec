#!/usr/bin/env python3
"""Repro of an open bug: an importer process crashes (SIGSEGV) receiving a large
stream-ordered pool allocation.

On an NVIDIA H200 (driver 580.159.04, 2026-11-26), with the exporter's
`BATON_CUDA_EXPORT=pool`, a child that receives a buffer of 1, 4 or 5 GiB opens it; of 7 or 8
GiB it dies with SIGSEGV inside its `recv` (while Baton's runtime opens the offer:
`cuMemPoolImportFromShareableHandle` / `cuMemPoolImportPointer`), before any Python code
touches the memory. Legacy IPC and VMM buffers of 8 GiB open. The driver is at fault:
`bench/pool_size_driver.py` makes the same calls without Baton and its child dies the same
way, in `cuMemPoolImportPointer`, from 5.5 GiB. Bundles are VMM memory, so weight sync does
not meet it.

usage: BATON_CUDA_EXPORT=pool SIZES=5,7 python3 bench/pool_size_probe.py
Prints one line per size: what the child answered, or that it died and its status.
"""

from __future__ import annotations

import faulthandler
import os
import sys


def child() -> None:
    import torch

    import baton

    faulthandler.enable()
    node = baton.Node()
    mailbox = node.register("probe", "t.Probe")
    node.connect_parent()
    call = mailbox.recv(timeout=120)
    with call.message["buffer"].open() as lease:
        first = int(torch.from_dlpack(lease)[:16].sum().item())
    call.reply({"ok": True, "first_bytes_sum": first})


def main() -> None:
    import baton

    node = baton.Node(token=baton.generate_token(), backend="cuda")
    for gib in [int(x) for x in os.environ.get("SIZES", "5,7").split(",")]:
        spawned = node.spawn([sys.executable, os.path.abspath(__file__), "--child"], timeout=120)
        buffer = node.allocate(gib << 30, "uint8")
        try:
            answer = spawned.peer.call("probe", "t.Probe", {"buffer": buffer}, timeout=120)
            print(f"{gib} GiB: {answer}", flush=True)
            buffer.returned(timeout=60)
            spawned.peer.close()
            spawned.wait(timeout=60)
        except baton.BatonError as e:
            print(f"{gib} GiB: the child died ({e!r}), status {spawned.wait(timeout=30)}", flush=True)
        del buffer
    node.close()


if __name__ == "__main__":
    child() if sys.argv[1:] == ["--child"] else main()
