"""A CUDA engine for `test_cuda.py`'s lend test, spawned by the test's node (`Node.spawn`)
on the GPU `BATON_CUDA_DEVICE` names:
its weights are a bundle of its own — or, with `borrowed` as its argument, torch tensors
lent where PyTorch allocated them, a group of several allocations (`borrow_tensors`) —
which it lends to the test's node (the trainer) with
a stream-ordered call, each time after a spin and a write of its own queued on its stream;
once the lease is back it orders its stream after the trainer's copies and sends each
tensor's sum (float64) with the next lend.

    python lend_child.py [borrowed]
"""

import os
import sys

import torch

import baton

#: GPU clock cycles of the spin before the engine's own write (about a second on an H100).
SPIN = 2_000_000_000

torch.cuda.set_device(int(os.environ.get("BATON_CUDA_DEVICE", "0")))
node = baton.Node()  # the token, backend and device the test's node passed
peer = node.connect_parent()
# Small tensors and one of 64 MiB (across GPUs a copy-engine copy of its own).
spec = [(f"layers.{i}", (64, 40) if i % 3 else (48,), "bfloat16" if i % 2 else "float32")
        for i in range(12)] + [("big", (16 << 20,), "float32"), ("step", (), "int64")]
if sys.argv[1:] == ["borrowed"]:
    params = {n: torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
              for n, shape, dtype in spec}
    bundle = node.borrow_tensors(params)  # a BundleGroup: one lease over its allocations
    assert isinstance(bundle, baton.BundleGroup) and len(bundle) >= 2, bundle
else:
    bundle = node.allocate_bundle(spec)
    params = bundle.tensors()
stream = torch.cuda.current_stream()
sums = None
while True:
    # Its own last write, still queued when it lends: the trainer's copies must wait for it.
    torch.cuda._sleep(SPIN)
    for t in params.values():
        t.fill_(-1)
    try:
        answer = peer.call("trainer", "py.Lend", {"weights": bundle.share_mut(), "sums": sums},
                           timeout=60, stream=stream)
    except (baton.LinkClosed, baton.Timeout):
        break
    bundle.returned(timeout=60)
    if answer.get("stop"):
        break
    bundle.wait_on(stream)  # its reads after the trainer's copies
    sums = {n: float(t.double().sum()) for n, t in params.items()}
