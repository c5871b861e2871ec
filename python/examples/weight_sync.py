"""Weight sync on host memory: a trainer hands 200 tensors to an inference process 20
times, as one bundle; the engine copies them into its own parameters and answers a
checksum."""
import sys

import numpy as np

import baton

SPEC = [(f"layers.{i}.weight", (256, 256), "float32") if i % 2 == 0
        else (f"layers.{i}.norm", (256,), "float32") for i in range(200)]


def engine() -> None:
    node = baton.Node()  # the session token the trainer passed us
    mailbox = node.register("engine", "rl.Weights")
    node.connect_parent()  # linked to the trainer, once the name is there
    params = {name: np.empty(shape, dtype) for name, shape, dtype in SPEC}
    while True:
        try:
            call = mailbox.recv(timeout=60)
        except baton.LinkClosed:  # the trainer is done and closed the link
            return
        with call.message["weights"].open() as weights:  # the trainer's memory, one lease
            weights.copy_into(params)  # load_weights: one copy into our parameters, by name
        call.reply(sum(float(p.sum(dtype=np.float64)) for p in params.values()))


def trainer() -> None:
    node = baton.Node(token=baton.generate_token(), backend="host")
    child = node.spawn([sys.executable, __file__, "engine"])  # started, given the token, linked
    weights = node.allocate_bundle(SPEC)  # 200 tensors in one buffer
    tensors = weights.tensors()  # views of it, by name
    for step in range(20):
        values = [np.float32(step + i / 1000) for i in range(len(SPEC))]
        for t, v in zip(tensors.values(), values):
            t[...] = v  # the optimizer's update, in place
        total = child.peer.call("engine", "rl.Weights", {"weights": weights})
        expect = sum(float(v) * t.size for v, t in zip(values, tensors.values()))
        assert abs(total - expect) <= 1e-9 * expect, (step, total, expect)
        weights.returned(timeout=10)  # the engine gave the lease back: ours to write again
    child.peer.close()
    assert child.wait(timeout=10) == 0
    node.close()
    print(f"weight sync: 20 steps of {len(SPEC)} tensors checked")


if __name__ == "__main__":
    engine() if sys.argv[1:] == ["engine"] else trainer()
