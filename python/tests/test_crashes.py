"""Crashes on either side: the Rust owner reclaims a SIGKILLed Python process's leases; a
Python process whose Rust exporter is SIGKILLed sees its leases orphaned and lives on."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import baton
from conftest import DEADLINE, eventually, pattern, spawn_python, table

HERE = Path(__file__).parent


def test_sigkill_of_the_python_process_reclaims_its_leases(node, peer, partner, token_file, children):
    child = spawn_python(HERE / "holder_child.py", [partner.socket], token_file.read_text())
    children.append(child)
    word, pid = child.lines.next().split()
    assert (word, int(pid)) == ("holding", child.pid)
    assert sorted(table(peer)["holders"]) == [child.pid, child.pid]

    status = child.kill9()
    assert status == -signal.SIGKILL

    eventually(lambda: table(peer)["holders"] == [], "the partner to reclaim the killed child's leases")
    # The partner's buffers are its own again: it reads them, nobody holds them.
    for index in (0, 1):
        seen = peer.call("inspector", "py.Inspect", {"index": index})
        assert seen["leases"] == 0 and seen["head"] == pattern(index, 8).tolist()


def test_a_supervised_child_reads_its_token_from_the_pipe_and_a_hand_started_one_from_the_environment(
    partner, token_file, children
):
    child = spawn_python(HERE / "holder_child.py", [partner.socket], token_file.read_text())
    children.append(child)
    assert child.lines.next().startswith("holding ")
    env = dict(os.environ, BATON_TOKEN=token_file.read_text().strip())
    env.pop("BATON_TOKEN_FD", None)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    from conftest import spawn

    by_hand = spawn([sys.executable, HERE / "env_child.py", partner.socket], env=env)
    children.append(by_hand)
    assert by_hand.lines.next() == "table 2"  # the holder's two leases
    assert by_hand.proc.wait(timeout=DEADLINE) == 0


def test_sigkill_of_the_rust_exporter_orphans_python_leases_and_the_process_lives_on(
    node, partner_factory
):
    doomed, survivor = partner_factory("host"), partner_factory("host")
    p_doomed = node.connect(doomed.socket)
    p_survivor = node.connect(survivor.socket)
    lease = p_doomed.call("lender", "py.Lend", {"index": 0, "len": 2048, "seed": 9})["buffer"].open()
    unopened = p_doomed.call("lender", "py.Lend", {"index": 1, "len": 16, "seed": 1})["buffer"]
    view = lease.numpy()
    other = p_survivor.call("lender", "py.Lend", {"index": 0, "len": 2048, "seed": 4})["buffer"].open()
    ours = node.allocate(32, "float32")
    ours.numpy()[:] = 2.0

    assert doomed.child.kill9() == -signal.SIGKILL

    eventually(lambda: lease.orphaned, "the lease to turn orphaned")
    assert not p_doomed.connected
    for use in (lease.numpy, lease.tobytes, lease.__dlpack__):
        with pytest.raises(baton.Orphaned, match=f"the exporter .* is gone: this lease is orphaned"):
            use()
    with pytest.raises(baton.Orphaned):
        unopened.open()
    with pytest.raises(baton.LinkClosed) as closed:
        p_doomed.call("table", "py.Table")
    # It says the peer died (a LinkClosed of its own class), not merely that a link closed.
    assert isinstance(closed.value, baton.PeerDied), repr(closed.value)
    assert "the peer process died" in str(closed.value)
    # The view taken before still reads the memory it mapped (never freed under it).
    np.testing.assert_array_equal(view, pattern(9, 2048))
    del view
    assert lease.release() is True

    # Everything else carries on: the other partner's lease, our buffer, new calls.
    np.testing.assert_array_equal(other.numpy(), pattern(4, 2048))
    assert p_survivor.call("sink", "py.Sink", {"data": ours})["sum"] == 64.0
    assert table(p_survivor)["holders"] == [node.pid]
    other.release()
    eventually(lambda: table(p_survivor)["holders"] == [], "the other lease to go back")


def test_a_trainer_killed_while_writing_lent_weights_leaves_the_engine_working(node):
    """An engine lends its weights writable (``share_mut``) to a trainer that is SIGKILLed
    in the middle of writing them: the engine's lend call raises ``LinkClosed`` (its
    ``PeerDied``), the lease comes back, the bundle holds what was written before the kill
    (half written: serve only a sync whose call returned), and the engine lends it to the
    next trainer, who writes all of it."""
    bundle = node.allocate_bundle([("a", (16,), "float32"), ("b", (16,), "float32")])
    views = bundle.tensors()
    for v in views.values():
        v[...] = 1
    doomed = node.spawn([sys.executable, str(HERE / "writer_child.py"), "die"], timeout=DEADLINE)
    with pytest.raises(baton.LinkClosed):
        doomed.peer.call("trainer", "py.Lend", {"weights": bundle.share_mut()}, timeout=DEADLINE)
    assert doomed.wait(timeout=DEADLINE) == -signal.SIGKILL
    bundle.returned(timeout=DEADLINE)
    assert bundle.leases_out == 0
    assert (views["a"] == 7).all() and (views["b"] == 1).all(), "written up to the kill"
    next_trainer = node.spawn([sys.executable, str(HERE / "writer_child.py"), "finish"],
                              timeout=DEADLINE)
    assert next_trainer.peer.call("trainer", "py.Lend", {"weights": bundle.share_mut()},
                                  timeout=DEADLINE) == "written"
    bundle.returned(timeout=DEADLINE)
    assert (views["a"] == 7).all() and (views["b"] == 7).all()
    assert next_trainer.wait(timeout=DEADLINE) == 0
    del views

