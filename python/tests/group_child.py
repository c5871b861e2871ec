"""A CUDA engine for `test_cuda.py`'s bundle-group test, spawned by the test's node
(`Node.spawn`): it loads each bundle group it is sent into torch tensors of its own — with
one `CopyPlan` or by name, opened stream-ordered or not, as the call asks — and answers
each tensor's sum (float64) and the opens its import cache made so far.

    python group_child.py
"""

import torch

import baton

node = baton.Node()  # the token, backend and device the test's node passed
mailbox = node.register("engine", "py.Group")
node.connect_parent()
params = None
while True:
    try:
        call = mailbox.recv(timeout=60)
    except (baton.LinkClosed, baton.Timeout):
        break
    shared = call.message["weights"]
    assert isinstance(shared, baton.SharedBundleGroup), type(shared)
    stream = torch.cuda.current_stream() if call.message["ordered"] else None
    opened = shared.open(stream=stream)
    if params is None:
        params = {name: torch.zeros(shape, dtype=getattr(torch, dtype), device="cuda")
                  for layout in opened.layout for name, dtype, shape, _ in layout.tensors}
    opened.copy_into(baton.CopyPlan(opened.layout, params) if call.message["plan"] else params)
    opened.release()
    torch.cuda.current_stream().synchronize()
    call.reply({"sums": {n: float(t.double().sum()) for n, t in params.items()},
                "opens": node.import_stats()["opens"]})
