"""Weight sync on host memory: a trainer hands 200 tensors to an inference process 20
times; the engine copies them into its own parameters and answers a checksum."""
import sys

import numpy as np

import baton

SHAPES = [(256, 256) if i % 2 == 0 else (256,) for i in range(200)]  # matrices and norms


def engine() -> None:
    node = baton.Node()  # the session token the trainer passed us
    mailbox = node.register("engine", "rl.Weights")
    node.connect_parent()  # linked to the trainer, once the name is there
    params = [np.empty(shape, np.float32) for shape in SHAPES]
    while True:
        try:
            call = mailbox.recv(timeout=60)
        except baton.LinkClosed:  # the trainer is done and closed the link
            return
        for param, shared in zip(params, call.message["weights"]):
            with shared.open() as lease:  # the trainer's memory, no copy
                param[...] = lease.numpy()  # load_weights: one copy into our parameters
        call.reply(sum(float(p.sum(dtype=np.float64)) for p in params))


def trainer() -> None:
    node = baton.Node(token=baton.generate_token(), backend="host")
    child = node.spawn([sys.executable, __file__, "engine"])  # started, given the token, linked
    weights = [node.allocate(shape, "float32") for shape in SHAPES]
    for step in range(20):
        values = [np.float32(step + i / 1000) for i in range(len(SHAPES))]
        for w, v in zip(weights, values):
            w.numpy()[...] = v  # the optimizer's update, in place
        total = child.peer.call("engine", "rl.Weights", {"weights": weights})
        expect = sum(float(v) * np.prod(shape) for v, shape in zip(values, SHAPES))
        assert abs(total - expect) <= 1e-9 * expect, (step, total, expect)
        for w in weights:
            w.returned(timeout=10)  # the engine gave every lease back: ours to write again
    child.peer.close()
    assert child.wait(timeout=10) == 0
    node.close()
    print(f"weight sync: 20 steps of {len(SHAPES)} tensors checked")


if __name__ == "__main__":
    engine() if sys.argv[1:] == ["engine"] else trainer()
