"""Supervised weight sync on host memory: a trainer keeps an inference engine running with
baton.Supervisor and syncs 60 tensors to it each step. At step 3 the engine is SIGKILLed
in the middle of a sync: the supervisor restarts it and sends that step's weights again,
and every step's checksum is checked."""
import os
import signal
import sys

import numpy as np

import baton

SPEC = [(f"layers.{i}.weight", (128, 128), "float32") for i in range(60)]
STEPS, DOOMED = 8, 3


def engine() -> None:
    node = baton.Node()  # the session token the supervisor passed us
    mailbox = node.register("engine", "rl.Weights")
    node.connect_parent()  # linked to the trainer, once the name is there
    params = {name: np.empty(shape, dtype) for name, shape, dtype in SPEC}
    while True:
        try:
            call = mailbox.recv(timeout=60)
        except baton.LinkClosed:  # the trainer is done
            return
        with call.message["weights"].open() as weights:
            if call.message["die"]:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-sync, lease held
            weights.copy_into(params)
        call.reply({"step": call.message["step"],
                    "sum": sum(float(p.sum(dtype=np.float64)) for p in params.values())})


def trainer() -> None:
    node = baton.Node(token=baton.generate_token(), backend="host")
    engine_proc = baton.Supervisor(node, [sys.executable, __file__, "engine"],
                                   max_restarts=3, within=30.0, timeout=30.0)
    weights = node.allocate_bundle(SPEC)
    for step in range(STEPS):
        weights.returned(timeout=10)  # the last holder let go (or died): ours to write
        tensors = weights.tensors()
        for i, t in enumerate(tensors.values()):
            t[...] = np.float32(step + i / 100)  # the optimizer's update, in place
        del tensors

        def sync(peer):  # run again, on a new engine, if the engine dies under it
            die = step == DOOMED and engine_proc.restarts == 0
            return peer.call("engine", "rl.Weights",
                             {"weights": weights, "step": step, "die": die}, timeout=30)

        got = engine_proc.run(sync, retries=1)  # a dead engine is restarted, the sync re-sent
        expect = sum((step + i / 100) * 128 * 128 for i in range(len(SPEC)))
        assert got["step"] == step and abs(got["sum"] - expect) <= 1e-6 * expect, (step, got)
    assert engine_proc.restarts == 1 and engine_proc.exits == [-signal.SIGKILL]
    engine_proc.close()
    node.close()
    print(f"supervised weight sync: {STEPS} steps of {len(SPEC)} tensors checked, "
          f"engine killed at step {DOOMED} and restarted once")


if __name__ == "__main__":
    engine() if sys.argv[1:] == ["engine"] else trainer()
