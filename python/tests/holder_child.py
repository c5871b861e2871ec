"""A Python peer started as a Baton supervisor starts its children (the token in an
inherited pipe): it links to a partner, takes leases on two of its buffers, keeps NumPy
views of them, says so, and waits to be killed (or for its stdin to close).

    python holder_child.py SOCKET
"""

import sys

import baton

node = baton.Node()  # the token from BATON_TOKEN_FD, read and closed
peer = node.connect(sys.argv[1], timeout=30)
leases = [
    peer.call("lender", "py.Lend", {"index": i, "len": 4096, "seed": i})["buffer"].open()
    for i in (0, 1)
]
views = [lease.numpy() for lease in leases]
assert all(v.size == 4096 for v in views)
print("holding", node.pid, flush=True)
sys.stdin.read()  # until the test closes our stdin (or kills us)
