"""Weight sync on host memory: an inference process lends its 200 weights, one bundle, to a
trainer 20 times; the trainer writes them in place, and the engine checks a checksum."""
import sys

import numpy as np

import baton

SPEC = [(f"layers.{i}.weight", (256, 256), "float32") if i % 2 == 0
        else (f"layers.{i}.norm", (256,), "float32") for i in range(200)]


def engine() -> None:
    node = baton.Node()  # the session token the trainer passed us
    trainer = node.connect_parent()  # linked to the trainer
    weights = node.allocate_bundle(SPEC)  # our parameters: 200 tensors in one buffer
    params = weights.tensors()  # views of it, by name
    total = None
    while True:  # lend them writable (one lease); the call returns once they are written
        answer = trainer.call("trainer", "rl.Lend", {"weights": weights.share_mut(),
                                                     "total": total}, timeout=60)
        weights.returned(timeout=10)  # the lease is back: ours to read
        if answer == "done":
            return
        total = sum(float(p.sum(dtype=np.float64)) for p in params.values())


def trainer() -> None:
    node = baton.Node(token=baton.generate_token(), backend="host")
    mailbox = node.register("trainer", "rl.Lend")
    child = node.spawn([sys.executable, __file__, "engine"])  # started, given the token, linked
    params = {name: np.empty(shape, dtype) for name, shape, dtype in SPEC}  # our own
    expect = None
    for step in range(21):
        call = mailbox.recv(timeout=60)  # the engine's lend, with its checksum of the last
        total = call.message["total"]
        assert total == expect or abs(total - expect) <= 1e-9 * expect, (step, total, expect)
        if step == 20:
            call.message["weights"].release()  # the last lend goes back unopened
            call.reply("done")
            break
        for i, p in enumerate(params.values()):
            p[...] = np.float32(step + i / 1000)  # the optimizer's update
        with call.message["weights"].open(writable=True) as weights:  # the engine's memory
            weights.copy_from(params)  # one copy into its parameters, by name
        call.reply("written")  # back when the block ended: the engine's to read
        expect = sum(float(p.sum(dtype=np.float64)) for p in params.values())
    assert child.wait(timeout=10) == 0
    node.close()
    print(f"weight sync: 20 steps of {len(SPEC)} tensors checked")


if __name__ == "__main__":
    engine() if sys.argv[1:] == ["engine"] else trainer()
