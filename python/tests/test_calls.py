"""Calls between a Python process and a Rust one, with buffers both ways; the MessagePack
type table; numpy.from_dlpack on host memory."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import baton
from conftest import DEADLINE, eventually, pattern, table

N = 1 << 16


def test_python_calls_rust_with_two_buffers_and_gets_two_back(node, peer, partner):
    a = node.allocate(N, "uint32")
    b = node.allocate((N,), np.float32)
    assert (a.shape, a.dtype, a.device, a.nbytes) == ((N,), "uint32", ("cpu", 0), 4 * N)
    a.numpy()[:] = pattern(7, N)
    b.numpy()[:] = np.arange(N, dtype=np.float32) * 0.5

    reply = peer.call("checker", "py.CheckPair", {"seed": 7, "a": a, "b": b}, timeout=DEADLINE)

    assert reply["ok"], reply["detail"]
    assert reply["detail"] == f"{N} elements checked"
    sum_, doubled = reply["sum"], reply["doubled"]
    assert isinstance(sum_, baton.Shared) and isinstance(doubled, baton.Shared)
    assert (sum_.shape, sum_.dtype, doubled.dtype) == ((N,), "float32", "uint32")
    with sum_.open() as s, doubled.open() as d:
        assert s.exporter_pid == partner.pid and d.exporter_pid == partner.pid
        assert s.device == ("cpu", 0)
        want = pattern(7, N).astype(np.float32) + np.arange(N, dtype=np.float32) * 0.5
        np.testing.assert_array_equal(s.numpy(), want)
        np.testing.assert_array_equal(d.numpy(), pattern(7, N) * np.uint32(2))
        assert table(peer)["holders"] == [node.pid, node.pid]
    # Ours back to the partner; the partner's leases on a and b back to us.
    eventually(lambda: table(peer)["leases"] == 0, "the partner's lease table to empty")
    eventually(lambda: node.export_stats()["leases"] == 0, "the partner to release a and b")
    assert a.leases_out == 0 and b.leases_out == 0


def test_rust_calls_python_with_two_buffers_and_gets_two_back(node, peer, partner):
    seed, n = 11, 4096
    mailbox = node.register("scaler", "py.Scale")
    seen: dict = {}

    def serve() -> None:
        call = mailbox.recv(timeout=DEADLINE)
        seen["peer"] = call.peer_pid
        msg = call.message
        with msg["a"].open() as a, msg["b"].open() as b:
            seen["a_ok"] = bool(np.array_equal(a.numpy(), pattern(msg["seed"], n)))
            x = node.allocate(n, "float32")
            y = node.allocate(n, "int64")
            x.numpy()[:] = b.numpy() * 2
            y.numpy()[:] = a.numpy().astype(np.int64) - 1
        seen["replied"] = call.reply({"x": x, "y": y})

    server = threading.Thread(target=serve)
    server.start()
    try:
        done = peer.call(
            "caller", "py.CallBack", {"pid": node.pid, "target": "scaler", "seed": seed, "len": n},
            timeout=DEADLINE,
        )
    finally:
        server.join(timeout=DEADLINE)
    assert not server.is_alive()
    assert done == {"ok": True, "detail": f"{n} elements checked"}
    assert seen == {"peer": partner.pid, "a_ok": True, "replied": True}
    # The partner gave back x and y after checking them; we gave back a and b.
    eventually(lambda: node.export_stats()["leases"] == 0, "the partner to release x and y")
    eventually(lambda: table(peer)["leases"] == 0, "a and b back with the partner")


def test_recv_async_serves_rust_calls_and_a_cancelled_wait_loses_no_call(node, peer, partner):
    seed, n = 5, 512
    mailbox = node.register("scaler", "py.Scale")

    async def main() -> dict:
        # A wait cancelled before any call came: it must take none of the calls after it
        # (a helper thread blocked in a plain recv would swallow the next one).
        cancelled = asyncio.ensure_future(mailbox.recv_async())
        await asyncio.sleep(0.1)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        with pytest.raises(baton.Timeout):
            await mailbox.recv_async(timeout=0.05)

        # Rust calls back (peer.call blocks: on a thread); the loop serves it.
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(None, lambda: peer.call(
            "caller", "py.CallBack", {"pid": node.pid, "target": "scaler", "seed": seed, "len": n},
            timeout=DEADLINE,
        ))
        call = await mailbox.recv_async(timeout=DEADLINE)
        assert call.peer_pid == partner.pid
        msg = call.message
        with msg["a"].open() as a, msg["b"].open() as b:
            x, y = node.allocate(n, "float32"), node.allocate(n, "int64")
            x.numpy()[:] = b.numpy() * 2
            y.numpy()[:] = a.numpy().astype(np.int64) - 1
        assert call.reply({"x": x, "y": y})
        return await done

    assert asyncio.run(main()) == {"ok": True, "detail": f"{n} elements checked"}
    mailbox.close()

    async def closed() -> None:
        with pytest.raises(baton.Released):
            await mailbox.recv_async(timeout=DEADLINE)

    asyncio.run(closed())


def test_a_python_handler_of_another_type_is_refused_before_python_sees_it(node, peer):
    mailbox = node.register("scaler", "py.NotScale")
    done = peer.call(
        "caller", "py.CallBack", {"pid": node.pid, "target": "scaler", "seed": 1, "len": 8},
        timeout=DEADLINE,
    )
    assert not done["ok"]
    assert "WrongType" in done["detail"] and "py.NotScale" in done["detail"], done
    assert mailbox.pending == 0
    eventually(lambda: table(peer)["leases"] == 0, "the refused call's leases to go back")


def test_a_python_handler_that_rejects_answers_bad_payload(node, peer):
    mailbox = node.register("scaler", "py.Scale")

    def serve() -> None:
        call = mailbox.recv(timeout=DEADLINE)
        call.reject("no thanks")
        with pytest.raises(baton.Released, match="answered already"):
            call.reply(None)

    server = threading.Thread(target=serve)
    server.start()
    done = peer.call(
        "caller", "py.CallBack", {"pid": node.pid, "target": "scaler", "seed": 1, "len": 8},
        timeout=DEADLINE,
    )
    server.join(timeout=DEADLINE)
    assert not done["ok"] and 'BadPayload("no thanks")' in done["detail"], done
    # The call's leases were dropped with the call's message.
    eventually(lambda: table(peer)["leases"] == 0, "the rejected call's leases to go back")


def test_every_type_of_the_table_crosses_both_ways(peer):
    sent = {
        "flag": True,
        "small": 255,
        "signed": -123456,
        "big": 2**64 - 1,
        "negative": -(2**63),
        "single": 1.5,
        "double": 0.1,
        "text": "grüß dich ✓",
        "bytes": b"\x00\x01\xffbaton",
        "numbers": [1, 2, 3],
        "pair": (7, "seven"),
        "maybe": 5,
        "nothing": None,
        "map": {"a": -1, "b": 2},
        "kind": "Empty",
        "shape": {"Rect": {"w": 3, "h": 4}},
        "point": [-1, 2],
        "unit": None,
    }
    got = peer.call("echo", "py.Types", sent, timeout=DEADLINE)
    # Tuples come back as lists (MessagePack has one array type); the rest is unchanged.
    assert got == {**sent, "pair": [7, "seven"]}
    got = peer.call("echo", "py.Types", {**sent, "shape": {"Circle": 2.5}, "kind": {"Rect": {"w": 1, "h": 2}}})
    assert got["shape"] == {"Circle": 2.5} and got["kind"] == {"Rect": {"w": 1, "h": 2}}
    # NumPy scalars encode as the numbers they are.
    got = peer.call("echo", "py.Types", {**sent, "small": np.uint8(9), "double": np.float32(0.5)})
    assert (got["small"], got["double"]) == (9, 0.5)


def test_numpy_from_dlpack_round_trip_on_host(node, peer):
    shared = peer.call("lender", "py.Lend", {"index": 0, "len": 1000, "seed": 3})["buffer"]
    lease = shared.open()
    arr = np.from_dlpack(lease)
    assert lease.views == 1
    np.testing.assert_array_equal(arr, pattern(3, 1000))
    assert not arr.flags.writeable, "a lease opened read-only gives read-only DLPack views"
    # Zero-copy: the same memory as the NumPy view.
    assert arr.__array_interface__["data"][0] == lease.numpy().__array_interface__["data"][0]
    del arr
    eventually(lambda: lease.views == 0, "the DLPack views to go")

    # A writable buffer of ours, through DLPack, written by NumPy, read by Rust.
    buf = node.allocate(256, "float32")
    view = np.from_dlpack(buf)
    assert view.flags.writeable
    view[:] = np.arange(256, dtype=np.float32)
    reply = peer.call("sink", "py.Sink", {"data": buf})
    assert reply["sum"] == float(np.arange(256).sum()) and reply["len"] == 256
    assert reply["head"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert buf.__dlpack_device__() == (1, 0) and lease.__dlpack_device__() == (1, 0)
    lease.release()
    eventually(lambda: table(peer)["leases"] == 0, "the lease to go back")


def test_float16_and_bfloat16_buffers(node, peer):
    h = node.allocate((4, 8), "float16")
    assert h.numpy().dtype == np.float16 and h.numpy().shape == (4, 8)
    bf = node.allocate(16, "bfloat16")
    with pytest.raises(TypeError, match="bfloat16"):
        bf.numpy()
    # bfloat16 goes through DLPack (kDLBfloat) to consumers that have it.
    capsule = bf.__dlpack__(max_version=(1, 0))
    assert type(capsule).__name__ == "PyCapsule"
