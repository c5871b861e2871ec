#!/usr/bin/env python3
"""What a bundle's layout costs a call, on host memory (no GPU needed): two Python nodes of
one process, linked; the median round trip of a call carrying one plain buffer against one
carrying a bundle with Qwen2.5-0.5B's 290 tensor names (each tensor 4 bytes, so that the
layout, not the memory, is what is measured). The receiver opens and releases what it gets.

usage: python3 bench/bundle_overhead.py   (with the package installed: a release build,
`pip install ./python`, for figures that mean anything)
"""

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import baton  # noqa: E402
from weight_sync import model_spec  # noqa: E402


def main() -> None:
    spec = [(name, (1,), "float32") for name, _, _ in model_spec("qwen2.5-0.5b")]
    token = baton.generate_token()
    sockets = tempfile.mkdtemp(prefix="baton-bo-")
    sender = baton.Node(token=token, backend="host")
    receiver = baton.Node(token=token, backend="host")
    receiver.listen(sockets, "r.sock")
    peer = sender.connect(os.path.join(sockets, "r.sock"))
    mailbox = receiver.register("sink", "bench.Sink")

    def serve() -> None:
        while True:
            try:
                call = mailbox.recv(timeout=5)
            except baton.BatonError:
                return
            with call.message["w"].open():
                pass
            call.reply(None)

    threading.Thread(target=serve, daemon=True).start()
    for what, obj in [("plain buffer", sender.allocate(1024, "float32")),
                      (f"bundle of {len(spec)} tensors", sender.allocate_bundle(spec))]:
        took = []
        for _ in range(300):
            t = time.perf_counter()
            peer.call("sink", "bench.Sink", {"w": obj})
            obj.returned(5)
            took.append(time.perf_counter() - t)
        print(f"{what}: median round trip {statistics.median(took[20:]) * 1e6:.1f} µs")
    sender.close()
    receiver.close()
    shutil.rmtree(sockets, ignore_errors=True)


if __name__ == "__main__":
    main()
