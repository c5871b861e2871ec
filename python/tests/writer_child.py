"""A trainer for `test_crashes.py`'s lend test, spawned by the test's node (an engine,
`Node.spawn`): it takes the weights the engine lends it writable, writes the first tensor,
and then (`die`) SIGKILLs itself with the lease open and unanswered, or (`finish`) writes
the rest, gives the lease back and answers.

    python writer_child.py die|finish
"""

import os
import signal
import sys

import numpy as np

import baton

node = baton.Node()  # the token and backend the test's node passed
mailbox = node.register("trainer", "py.Lend")
node.connect_parent()
call = mailbox.recv(timeout=30)
lent = call.message["weights"].open(writable=True)
names = [name for name, *_ in lent.layout.tensors]
lent.copy_from({names[0]: np.full(lent.layout[names[0]][1], 7, dtype=np.float32)})
if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
lent.copy_from({name: np.full(lent.layout[name][1], 7, dtype=np.float32) for name in names[1:]})
lent.release()
call.reply("written")
node.close()
