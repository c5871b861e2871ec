#!/usr/bin/env python3
"""Where an engine's load of a received bundle spends its time (issue 25's follow-up).

The weight-sync benchmark's engine spends, at 7B, 2.6 ms queueing `copy_into` and then
7.9 ms waiting for the copies, while the same loader in one process takes 7.8 ms in all.
This probe tells the source from the loader: an engine process opens a trainer's bundle
once (an imported, IPC-mapped lease) and keeps a local copy of the same bytes, then times
each way of loading from each source (medians of `--reps`, after a warm-up):

- `plan`: `BundleLease.copy_into`'s plan (a memcpy per tensor of 1 MiB or more, one fused
  copy for the rest) — the time to queue it, and in all;
- `per-tensor`: `copy_` of every tensor;
- `foreach`: one `torch._foreach_copy_` of every tensor;
- `flat`: one copy of all the bytes into one flat buffer (the floor).

Prints one JSON line per (source, way). usage: python3 bench/loader_probe.py [--model M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from weight_sync import MODELS, model_spec, params_like  # noqa: E402


def timed(torch, fn, reps: int) -> dict:
    fn()
    torch.cuda.synchronize()
    queued, total = [], []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        q = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        queued.append(q - t)
        total.append(end - t)
    return {"queue_ms": round(statistics.median(queued) * 1e3, 3),
            "total_ms": round(statistics.median(total) * 1e3, 3)}


def engine(model: str, reps: int) -> None:
    import torch

    import baton

    node = baton.Node()
    mailbox = node.register("probe", "rl.Probe")
    node.connect_parent()
    spec = model_spec(model)
    params = params_like(torch, spec)
    call = mailbox.recv(timeout=120)
    with call.message["weights"].open() as lease:
        nbytes = lease.lease.nbytes
        local = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        local.copy_(torch.from_dlpack(lease.lease))
        flat_dst = torch.empty_like(local)
        layout = lease.layout
        out = {}
        for source in ("imported", "local"):
            src = torch.from_dlpack(lease.lease) if source == "imported" else local
            views = {}
            for name, dtype, shape, offset in layout.tensors:
                n = params[name].numel() * params[name].element_size()
                views[name] = src[offset:offset + n].view(getattr(torch, dtype)).view(shape)
            dst, srcs = list(params.values()), [views[n] for n in params]
            if source == "imported":
                ways = {"plan": lambda: lease.copy_into(params)}
            else:
                ways = {}
            ways["per-tensor"] = lambda: [d.copy_(s) for d, s in zip(dst, srcs)]
            ways["foreach"] = lambda: torch._foreach_copy_(dst, srcs)
            ways["flat"] = lambda: flat_dst.copy_(src)
            for way, fn in ways.items():
                out[f"{source}/{way}"] = timed(torch, fn, reps)
            del views, srcs, src
    call.reply({"results": out, "bytes": nbytes})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b", choices=sorted(MODELS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--role", default="trainer", choices=["trainer", "engine"],
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "engine":
        return engine(args.model, args.reps)
    import torch

    import baton

    node = baton.Node(token=baton.generate_token(), backend="cuda")
    child = node.spawn([sys.executable, os.path.abspath(__file__), "--role", "engine",
                        "--model", args.model, "--reps", str(args.reps)], timeout=120)
    bundle = node.allocate_bundle(model_spec(args.model))
    torch.cuda.synchronize()
    reply = child.peer.call("probe", "rl.Probe", {"weights": bundle}, timeout=600)
    for key, value in reply["results"].items():
        source, way = key.split("/")
        print(json.dumps({"bench": "loader_probe", "model": args.model,
                          "device": torch.cuda.get_device_name(), "source": source,
                          "way": way, "bytes": reply["bytes"], **value}), flush=True)
    bundle.returned(timeout=60)
    child.peer.close()
    child.wait(timeout=60)
    node.close()


if __name__ == "__main__":
    main()
