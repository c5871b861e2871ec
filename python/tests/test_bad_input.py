"""Bad input is a Python exception named after its Rust error; the process, its link and
its other leases are unharmed."""

from __future__ import annotations

import numpy as np
import pytest

import baton
from conftest import DEADLINE, pattern, table


@pytest.fixture
def held(peer):
    """A lease held through each test: it must survive the bad input."""
    reply = peer.call("lender", "py.Lend", {"index": 0, "len": 512, "seed": 21})
    with reply["buffer"].open() as lease:
        yield lease


def still_fine(node, peer, held) -> None:
    assert peer.connected
    np.testing.assert_array_equal(held.numpy(), pattern(21, 512))
    assert table(peer)["holders"] == [node.pid]


def test_a_wrong_token_is_refused(node, peer, partner, held):
    stranger = baton.Node(token=baton.generate_token(), backend="host")
    try:
        with pytest.raises(baton.BadToken, match="does not hold this session's token"):
            stranger.connect(partner.socket, timeout=DEADLINE)
        assert stranger.peers() == []
    finally:
        stranger.close()
    still_fine(node, peer, held)


def test_a_malformed_token_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="64 hex digits"):
        baton.Node(token="not a token")
    path = tmp_path / "token"
    path.write_text("abcd")
    with pytest.raises(ValueError, match="64 hex digits"):
        baton.Node(token_file=str(path))
    with pytest.raises(ValueError, match="reading the token file"):
        baton.Node(token_file=str(tmp_path / "missing"))


def test_a_payload_of_the_wrong_type_is_bad_payload(node, peer, held):
    with pytest.raises(baton.BadPayload, match="could not decode message"):
        peer.call("checker", "py.CheckPair", {"seed": "seven"})
    with pytest.raises(baton.BadPayload, match="missing field"):
        peer.call("checker", "py.CheckPair", {"seed": 7})
    # A buffer of the wrong element type for its field: refused, and its lease given back.
    wrong = node.allocate(16, "float64")
    b = node.allocate(16, "float32")
    with pytest.raises(baton.BadPayload, match="F64"):
        peer.call("checker", "py.CheckPair", {"seed": 7, "a": wrong, "b": b})
    assert isinstance(baton.BadPayload("x"), baton.Remote)
    still_fine(node, peer, held)
    assert wrong.leases_out == 0 and b.leases_out == 0


def test_a_wrong_type_name_or_target_is_refused(node, peer, held):
    with pytest.raises(baton.WrongType, match='expected: "py.CheckPair"'):
        peer.call("checker", "py.Sink", {"data": None})
    with pytest.raises(baton.NoSuchActor):
        peer.call("nobody", "py.Table")
    still_fine(node, peer, held)


def test_a_lease_of_another_process_cannot_be_sent(node, peer, held):
    other = peer.call("lender", "py.Lend", {"index": 1, "len": 8, "seed": 1})["buffer"]
    message = "a received buffer cannot be forwarded: ask its owner to share it"
    with pytest.raises(baton.NotOwned, match=message):
        peer.call("sink", "py.Sink", {"data": other})
    with pytest.raises(baton.NotOwned, match=message):
        peer.call("sink", "py.Sink", {"data": held})
    # Neither was consumed: both still work.
    with other.open() as lease:
        assert lease.numpy().tolist() == pattern(1, 8).tolist()
    still_fine(node, peer, held)


def test_values_that_do_not_encode_are_refused_before_anything_is_sent(node, peer, held):
    with pytest.raises(TypeError, match="cannot put a object in a Baton message"):
        peer.call("echo", "py.Types", {"x": object()})
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(baton.Encode, match="nest deeper"):
        peer.call("echo", "py.Types", cycle)
    with pytest.raises(baton.Encode, match="64-bit"):
        peer.call("echo", "py.Types", 2**64)
    buf = node.allocate(8, "uint8")
    with pytest.raises(baton.Encode):
        peer.call("echo", "py.Types", [buf, 2**70])
    assert buf.leases_out == 0, "nothing was sent: no lease"
    still_fine(node, peer, held)


def test_bad_arguments_are_python_errors(node, peer):
    with pytest.raises(TypeError, match="unknown element type"):
        node.allocate(4, "complex64")
    with pytest.raises(ValueError, match="at most 8 dimensions"):
        node.allocate([1] * 9, "uint8")
    with pytest.raises(baton.ZeroSize):
        node.allocate(0, "uint8")
    with pytest.raises(ValueError, match="backend"):
        baton.Node(token=baton.generate_token(), backend="tpu")
    with pytest.raises(baton.Timeout):
        node.accept(timeout=0.05)
    mailbox = node.register("quiet", "py.Quiet")
    with pytest.raises(baton.Timeout, match="receiving a call timed out"):
        mailbox.recv(timeout=0.05)
    mailbox.close()
    with pytest.raises(baton.Released, match="closed"):
        mailbox.recv(timeout=1)


def test_a_wait_without_a_deadline_ends_when_its_mailbox_closes(node):
    import threading

    mailbox = node.register("idle", "py.Idle")
    got: dict = {}

    def wait() -> None:
        try:
            mailbox.recv()  # no timeout: until a call comes or the mailbox closes
        except baton.Released as e:
            got["error"] = str(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    mailbox.close()
    waiter.join(timeout=DEADLINE)
    assert not waiter.is_alive()
    assert got == {"error": "mailbox \"idle\" was closed"}
    assert mailbox.closed
    node.close()
    with pytest.raises(baton.Released, match="node was closed"):
        node.accept(timeout=1e12)
