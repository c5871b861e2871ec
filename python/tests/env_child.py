"""A Python peer started by hand with BATON_TOKEN in its environment (the fallback for
processes no supervisor started): it links to a partner, asks for its lease table, and
prints what it got.

    python env_child.py SOCKET
"""

import sys

import baton

node = baton.Node.from_env(backend="host")
peer = node.connect(sys.argv[1], timeout=30)
print("table", peer.call("table", "py.Table")["leases"], flush=True)
