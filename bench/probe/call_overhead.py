#!/usr/bin/env python3
"""Where a Python call's round trip goes: a trainer and a spawned engine (as in
`bench/weight_sync.py`), the engine answering at once, on the host and the CUDA backend,
carrying nothing, one buffer (opened and released, or not opened), or a bundle of
Qwen2.5-0.5B's 290 tensor names (tiny tensors: the layout and the lease are measured, not
the memory) — and the real 0.92 GiB of that bundle, opened. Prints one JSON line per case: the median round trip in microseconds over
`--calls` calls, and the engine's own handling (open, release) apart.

usage: python3 bench/probe/call_overhead.py [--calls N] [--backends host,cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def engine() -> None:
    import baton

    node = baton.Node()
    mailbox = node.register("engine", "probe.Call")
    node.connect_parent()
    while True:
        try:
            call = mailbox.recv(timeout=60)
        except baton.LinkClosed:
            return
        t = time.perf_counter()
        sent = call.message["w"]
        if sent is not None and call.message["open"]:
            sent.open().release()
        elif sent is not None:
            sent.release()
        call.reply(time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--backends", default="host,cuda")
    ap.add_argument("--role", default="trainer")
    args = ap.parse_args()
    if args.role == "engine":
        return engine()
    import baton
    from weight_sync import model_spec

    spec = [(n, (1,), "float32") for n, _, _ in model_spec("qwen2.5-0.5b")]
    for backend in args.backends.split(","):
        node = baton.Node(token=baton.generate_token(), backend=backend)
        child = node.spawn([sys.executable, os.path.abspath(__file__), "--role", "engine"],
                           timeout=60)
        cases = [("nothing", None, False), ("buffer, unopened", node.allocate(1 << 18, "float32"), False),
                 ("buffer, opened", node.allocate(1 << 18, "float32"), True),
                 ("bundle of 290, unopened", node.allocate_bundle(spec), False),
                 ("bundle of 290, opened", node.allocate_bundle(spec), True),
                 ("bundle of Qwen2.5-0.5B (0.92 GiB), opened",
                  node.allocate_bundle(model_spec("qwen2.5-0.5b")), True)]
        for what, obj, opened in cases:
            rtt, handling = [], []
            for _ in range(args.calls):
                t = time.perf_counter()
                h = child.peer.call("engine", "probe.Call", {"w": obj, "open": opened}, timeout=60)
                if obj is not None:
                    obj.returned(timeout=60)
                rtt.append(time.perf_counter() - t)
                handling.append(h)
            print(json.dumps({"probe": "call_overhead", "backend": backend, "carrying": what,
                              "round_trip_us": round(statistics.median(rtt[10:]) * 1e6, 1),
                              "engine_handling_us": round(statistics.median(handling[10:]) * 1e6, 1)}),
                  flush=True)
        child.peer.close()
        child.wait(timeout=60)
        node.close()


if __name__ == "__main__":
    main()
