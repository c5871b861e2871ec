"""A Python node that listens: a Rust process links to it with the session token, and each
side calls the other over that link."""

from __future__ import annotations

import os
import threading

import numpy as np

from conftest import DEADLINE, eventually, partner_exe, spawn, table


def test_a_rust_process_links_to_a_listening_python_node(node, token_file, short_dir, children):
    socket = node.listen(str(short_dir / "py"), "python.sock")
    assert socket.name == "python.sock" and socket.exists()
    env = dict(os.environ, BATON_BACKEND="host")
    child = spawn([partner_exe(), "connect", socket, "--token-file", token_file], env=env)
    children.append(child)
    word, _, pid, _ = child.lines.next().split()
    assert word == "ready"
    peer = node.accept(timeout=DEADLINE)
    assert peer.pid == int(pid) == child.pid
    assert [p.pid for p in node.peers()] == [child.pid]

    # Python calls Rust over the link Rust opened…
    lent = peer.call("lender", "py.Lend", {"index": 0, "len": 64, "seed": 2})["buffer"]
    with lent.open() as lease:
        assert lease.exporter_pid == child.pid
        assert lease.path == "host-memfd", "mapped from the partner's memfd, and labelled so"
        assert lease.numpy().shape == (64,)
    eventually(lambda: table(peer)["leases"] == 0, "the lease to go back")

    # …and Rust calls Python over it.
    mailbox = node.register("scaler", "py.Scale")

    def serve() -> None:
        call = mailbox.recv(timeout=DEADLINE)
        with call.message["a"].open() as a, call.message["b"].open() as b:
            x, y = node.allocate(a.shape, "float32"), node.allocate(a.shape, "int64")
            x.numpy()[:] = b.numpy() * 2
            y.numpy()[:] = a.numpy().astype(np.int64) - 1
        call.reply({"x": x, "y": y})

    server = threading.Thread(target=serve)
    server.start()
    done = peer.call("caller", "py.CallBack", {"pid": node.pid, "target": "scaler", "seed": 3, "len": 32})
    server.join(timeout=DEADLINE)
    assert done == {"ok": True, "detail": "32 elements checked"}
    node.close()
    assert not socket.exists(), "closing the node removes its socket"
