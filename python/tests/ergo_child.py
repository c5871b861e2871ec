"""A Python child started with `Node.spawn`: it joins its parent and serves one role.

    python ergo_child.py serve   # "worker": t.Sum (reply, then close at once), t.Hold, t.Drop,
                                 # t.Stall (kept, never answered), t.Echo (the message back)
    python ergo_child.py wait    # a mailbox nobody calls: exits 0 once recv raises LinkClosed
"""

import sys

import baton

role = sys.argv[1]

if role == "wait":
    node, parent = baton.Node.join(backend="host")  # the token and the link, one call
    mailbox = node.register("idle", "t.Nothing")
    try:
        mailbox.recv(timeout=120)  # far past the test's deadline: only the link's end ends it
    except baton.LinkClosed as e:
        print("LinkClosed:", e, flush=True)
        sys.exit(0)
    sys.exit(3)  # a call came: nobody sends one

node = baton.Node(backend="host")  # the token its parent passed it
sums = node.register("worker", "t.Sum")
holds = node.register("worker", "t.Hold")  # one name, several wire types
drops = node.register("worker", "t.Drop")
stalls = node.register("worker", "t.Stall")
echoes = node.register("worker", "t.Echo")
parent = node.connect_parent()  # linked once the names are there
held = []
stalled = []  # calls kept unanswered: their callers wait until they give up
while True:
    while stalls.pending:
        stalled.append(stalls.recv(timeout=1))
    while echoes.pending:
        call = echoes.recv(timeout=1)
        call.reply(call.message)
    for mailbox in (holds, drops):
        while mailbox.pending:
            call = mailbox.recv(timeout=1)
            if call.type_name == "t.Hold":
                held.append(call.message["data"].open())
            else:
                held.clear()
            call.reply(len(held))
    try:
        call = sums.recv(timeout=0.01)
    except baton.Timeout:
        continue
    with call.message["data"].open() as lease:
        total = float(lease.numpy().sum())
    call.reply({"sum": total, "pid": node.pid})
    if call.message.get("last"):
        node.close()  # right after the reply: the reply must still reach the caller
        sys.exit(0)
