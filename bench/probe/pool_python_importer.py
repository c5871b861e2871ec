#!/usr/bin/env python3
"""Issue 46: a Python node (torch in the process) as the importer of a Rust process's pool
memory. It links to SOCKET with the session a Baton parent gives its children (the
environment), serves `sink` (wire type `py.Sink`, `{data: Shared<f32>}`: it opens the
buffer, torch sums it, it gives the lease back and answers `{len}`) and runs until killed.
`actors_cuda::pool_memory_a_live_peer_imported_goes_back_once_the_pool_is_idle` spawns it with
`BATON_POOL_REPRO=python` (`BATON_POOL_PYTHON_IMPORTER` names this file).

usage: python3 bench/probe/pool_python_importer.py SOCKET   (needs torch, the wheel, a GPU)
"""

import sys

import torch

import baton


def main() -> None:
    torch.zeros(1, device="cuda")
    node = baton.Node.from_env()
    sink = node.register("sink", "py.Sink")
    node.connect(sys.argv[1], timeout=30)
    while True:
        call = sink.recv(timeout=3600)
        lease = call.message["data"].open()
        t = torch.from_dlpack(lease)
        n = t.numel()
        float(t.sum())
        del t
        lease.release()
        call.reply({"len": n})


if __name__ == "__main__":
    main()
