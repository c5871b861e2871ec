#!/usr/bin/env python3
"""Where a Python call's round trip goes: a trainer and a spawned engine (as in
`bench/weight_sync.py`), the engine answering at once, on the host and the CUDA backend,
carrying nothing, one buffer (opened and released, or not opened), or a bundle of
Qwen2.5-0.5B's 290 tensor names (tiny tensors: the layout and the lease are measured, not
the memory) — and the real 0.92 GiB of that bundle, opened; or those 290 names in 43 or 155
bundles (a borrowed model's shape: a lease per allocation), each opened, or as one
`BundleGroup` (opened and released in one call). Prints one JSON
line per case: the median round trip in microseconds over
`--calls` calls, the engine's own handling (open, release) apart, and the round trip cut in
two on the shared monotonic clock: `to_engine_us` (the trainer's call until the engine's
`recv` returns) and `from_engine_us` (the engine's `reply` until the trainer has the reply,
and the buffer back).

`--gap-ms 0,2,20`: each case again with the trainer idle that long between calls (a sync
every few milliseconds), so that the cost of waking threads that slept shows;
`--gap-calls` calls per idle case. `--cases nothing,buffer,...`: only the cases whose name
starts with one of these.

usage: python3 bench/probe/call_overhead.py [--calls N] [--backends host,cuda]
                                            [--gap-ms 0,2,20] [--gap-calls N] [--cases ...]
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
        for one in sent if isinstance(sent, list) else [] if sent is None else [sent]:
            if call.message["open"]:
                one.open().release()
            else:
                one.release()
        done = time.perf_counter()
        call.reply([t, done - t, time.perf_counter()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--backends", default="host,cuda")
    ap.add_argument("--gap-ms", default="0")
    ap.add_argument("--gap-calls", type=int, default=300)
    ap.add_argument("--cases", default="")
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
        cases = [("nothing", lambda: None, False),
                 ("buffer, unopened", lambda: node.allocate(1 << 18, "float32"), False),
                 ("buffer, opened", lambda: node.allocate(1 << 18, "float32"), True),
                 ("bundle of 290, unopened", lambda: node.allocate_bundle(spec), False),
                 ("bundle of 290, opened", lambda: node.allocate_bundle(spec), True),
                 ("bundle of Qwen2.5-0.5B (0.92 GiB), opened",
                  lambda: node.allocate_bundle(model_spec("qwen2.5-0.5b")), True),
                 # A borrowed model's shape: one bundle per allocation (the same 290 names).
                 ("43 bundles of 290 in all, opened",
                  lambda: [node.allocate_bundle(spec[i::43]) for i in range(43)], True),
                 ("155 bundles of 290 in all, opened",
                  lambda: [node.allocate_bundle(spec[i::155]) for i in range(155)], True),
                 # The same, as one group (what `borrow_tensors` returns): one field, one
                 # open and one release call on each side.
                 ("a group of 43 bundles, opened",
                  lambda: baton.BundleGroup(node.allocate_bundle(spec[i::43])
                                            for i in range(43)), True),
                 ("a group of 155 bundles, opened",
                  lambda: baton.BundleGroup(node.allocate_bundle(spec[i::155])
                                            for i in range(155)), True)]
        wanted = [c for c in args.cases.split(",") if c]
        cases = [(what, make(), opened) for what, make, opened in cases
                 if not wanted or any(what.startswith(w) for w in wanted)]
        median = lambda xs: round(statistics.median(xs[10:]) * 1e6, 1)  # noqa: E731
        for gap_ms in [float(g) for g in args.gap_ms.split(",")]:
            calls = args.calls if gap_ms == 0 else args.gap_calls
            for what, obj, opened in cases:
                rtt, handling, to_engine, from_engine = [], [], [], []
                for _ in range(calls):
                    if gap_ms:
                        time.sleep(gap_ms / 1e3)
                    t = time.perf_counter()
                    got, h, replied = child.peer.call("engine", "probe.Call",
                                                      {"w": obj, "open": opened}, timeout=60)
                    for one in obj if isinstance(obj, list) else [] if obj is None else [obj]:
                        one.returned(timeout=60)
                    end = time.perf_counter()
                    rtt.append(end - t)
                    handling.append(h)
                    to_engine.append(got - t)
                    from_engine.append(end - replied)
                print(json.dumps({"probe": "call_overhead", "backend": backend, "carrying": what,
                                  "gap_ms": gap_ms, "calls": calls,
                                  "round_trip_us": median(rtt),
                                  "to_engine_us": median(to_engine),
                                  "from_engine_us": median(from_engine),
                                  "engine_handling_us": median(handling)}),
                      flush=True)
        child.peer.close()
        child.wait(timeout=60)
        node.close()


if __name__ == "__main__":
    main()
