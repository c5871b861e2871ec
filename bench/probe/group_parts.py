#!/usr/bin/env python3
"""What each part of a lease over several buffers costs its receiver, on host memory (no
GPU needed): a child lends a `BundleGroup` of `--parts` bundles (seven small tensors each,
as a borrowed model's allocations hold several) writable to its parent, once per step; the
parent takes the call, opens the group, gives it back and replies, idle 0.5 ms between
steps (a trainer's step). The stages are the weight-sync benchmark's (`bench/weight_sync.py`,
`baton-push-borrowed`): `recv` (the call in and decoded into Python), `open`,
`release_reply`. Run it with 1 part and with 43 (a 0.5B model's allocations): the
difference over 42 is the receiver's cost per part, without the fences a GPU adds.

Prints one JSON line: the parts, the steps and each stage's median in microseconds.

usage: python3 bench/probe/group_parts.py [--parts 43] [--steps 3000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import baton


def child(parts: int) -> None:
    node = baton.Node()  # the token and backend the parent passed
    peer = node.connect_parent()
    bundles = [node.allocate_bundle({f"p{i}.w{j}": ((256,), "float32") for j in range(7)})
               for i in range(parts)]
    group = baton.BundleGroup(bundles)
    lend = group.share_mut()
    while True:
        answer = peer.call("trainer", "rl.Lend", {"weights": lend}, timeout=60)
        if answer.get("stop"):
            return
        group.returned(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", type=int, default=43)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.parts)
    node = baton.Node(token=baton.generate_token(), backend="host")
    mailbox = node.register("trainer", "rl.Lend")
    engine = node.spawn([sys.executable, __file__, "--child", "--parts", str(args.parts)],
                        timeout=30)
    stages: dict = {"recv": [], "open": [], "release_reply": []}
    for step in range(args.steps):
        time.sleep(0.0005)
        t = time.perf_counter()
        call = mailbox.recv(timeout=60)
        t_recv = time.perf_counter()
        lent = call.message["weights"].open(writable=True)
        t_open = time.perf_counter()
        lent.release()
        call.reply({"stop": step == args.steps - 1})
        t_sent = time.perf_counter()
        for name, took in (("recv", t_recv - t), ("open", t_open - t_recv),
                           ("release_reply", t_sent - t_open)):
            stages[name].append(took)
    engine.wait(timeout=30)
    print(json.dumps({"probe": "group_parts", "parts": args.parts, "steps": args.steps,
                      "stages_us_median": {k: round(statistics.median(v) * 1e6, 1)
                                           for k, v in stages.items()}}))


if __name__ == "__main__":
    main()
