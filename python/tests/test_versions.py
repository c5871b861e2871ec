"""Versioned syncs between two Python nodes: a version in two bundles is committed only
once both landed (``SharedBundle.version`` / ``BundleLease.version`` say which it is);
stale, skipping, forged, unstamped and cancelled parts are refused with typed errors while
the link carries on; an infeasible deadline is refused up front. The same on device
memory with torch (skipped without a GPU). The kill test is Rust's (`tests/versions.rs`)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import baton
from conftest import DEADLINE

SPEC = [("w", (64,), "int64"), ("b", (3,), "int64")]


def value(version: int, part: int) -> int:
    return (version << 16) | part


def whole(receiver: baton.SyncReceiver) -> bool:
    """Whether every element of every committed part encodes the receiver's version."""
    return all(
        (t == value(receiver.version, part)).all()
        for part, bundle in enumerate(receiver.parts)
        for t in bundle.tensors().values()
    )


class Engine:
    """A receiving node's mailbox served on a thread: each call's ``part`` goes to a
    ``SyncReceiver``; the reply is the committed version, or the refusal's class name."""

    def __init__(self, node: baton.Node, backend_node: baton.Node) -> None:
        self.receiver = baton.SyncReceiver(backend_node)
        self.mailbox = node.register("engine", "py.Part")
        self.seen: list = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            try:
                call = self.mailbox.recv(timeout=DEADLINE)
            except (baton.Timeout, baton.LinkClosed, baton.Released):
                return
            if call.message == "stop":
                call.reply(None)
                return
            shared = call.message["part"]
            self.seen.append((shared.version, shared.stamp))
            try:
                self.receiver.receive(shared)
                call.reply(self.receiver.version)
            except baton.Version as e:
                call.reply(type(e).__name__)


@pytest.fixture
def linked(node, token_file, short_dir):
    node.listen(short_dir, "py.sock")
    sender = baton.Node(token_file=str(token_file), backend="host")
    try:
        yield node, sender, sender.connect(short_dir / "py.sock", timeout=DEADLINE)
    finally:
        sender.close()


def write(parts: list, version: int) -> None:
    for part, bundle in enumerate(parts):
        bundle.returned(timeout=DEADLINE)
        for t in bundle.tensors().values():
            t[...] = value(version, part)


def test_a_version_in_two_bundles_commits_once_both_landed(linked):
    node, sender_node, to_engine = linked
    engine = Engine(node, node)
    parts = [sender_node.allocate_bundle(SPEC) for _ in range(2)]
    sender = baton.SyncSender()
    for version in (1, 2):
        assert sender.begin(2, deadline=30.0) == version
        write(parts, version)
        call = lambda part: to_engine.call(  # noqa: E731
            "engine", "py.Part", {"part": sender.share(part, parts[part])}, timeout=DEADLINE)
        assert call(1) == version - 1, "one part of two: the version before"
        assert engine.receiver.staging[:1] == (version,) and engine.receiver.staging[2:] == (1, 2)
        assert call(0) == version
        assert sender.finish() == version
        assert whole(engine.receiver) and len(engine.receiver.parts) == 2
        assert engine.seen[-1][0] == version and engine.seen[-1][1].parts == 2
    # The committed copy is the engine's own memory: the sender may write on.
    write(parts, 99)
    assert whole(engine.receiver) and engine.receiver.version == 2
    assert to_engine.call("engine", "py.Part", "stop", timeout=DEADLINE) is None


def test_refused_versions_raise_typed_errors_and_the_link_carries_on(linked):
    node, sender_node, to_engine = linked
    engine = Engine(node, node)
    parts = [sender_node.allocate_bundle(SPEC) for _ in range(2)]

    def call(field) -> object:
        reply = to_engine.call("engine", "py.Part", {"part": field}, timeout=DEADLINE)
        for p in parts:
            p.returned(timeout=DEADLINE)  # taken or refused, the lease comes back
        return reply

    ahead = baton.SyncSender(version=3)
    ahead.begin(2, 30.0)
    assert call(ahead.share(0, parts[0])) == "Skipped"
    assert call(parts[0]) == "Unversioned", "a plain bundle is no part of a sync"
    sender = baton.SyncSender()
    sender.begin(2, 30.0)
    write(parts, 1)
    first = sender.share(0, parts[0])
    assert call(first) == 0
    assert call(sender.share(0, parts[0])) == "Inconsistent", "part 0 twice"
    # A cancelled sync: dropped by the engine, its last part refused.
    cancel = sender.cancel()
    assert cancel[0] == 1 and engine.receiver.cancel(cancel)
    with pytest.raises(baton.SyncOver):
        sender.share(1, parts[1])
    stale_part = {"baton.bundle": parts[1].layout, "buffer": parts[1].buffer,
                  "baton.sync": first.stamp}
    assert call(stale_part) == "SyncClosed"
    # The next sync commits; the same version again is stale.
    sender.begin(2, 30.0)
    assert [call(sender.share(i, parts[i])) for i in (0, 1)] == [0, 1]
    sender.finish()
    again = baton.SyncSender()
    again.begin(2, 30.0)
    assert call(again.share(0, parts[0])) == "Stale"
    assert engine.receiver.version == 1 and whole(engine.receiver)
    assert to_engine.call("engine", "py.Part", "stop", timeout=DEADLINE) is None


def test_a_forged_stamp_is_refused_when_opened(linked):
    """A stamp is data the peer wrote: one out of bounds is Malformed (the lease goes back),
    and one that is not a stamp at all does not decode (BadPayload)."""
    node, sender_node, to_engine = linked
    mailbox = node.register("opener", "py.Open")
    bundle = sender_node.allocate_bundle(SPEC)
    sender = baton.SyncSender()
    sender.begin(1, 30.0)
    honest = sender.share(0, bundle).stamp
    got = []

    def serve() -> None:
        call = mailbox.recv(timeout=DEADLINE)
        shared = call.message["part"]
        got.append(shared.version)
        try:
            shared.open()
        except baton.Malformed as e:
            got.append(str(e))
        call.reply(None)

    server = threading.Thread(target=serve)
    server.start()
    wire = {"baton.bundle": bundle.layout, "buffer": bundle.buffer,
            "baton.sync": {"version": 1, "sync": honest.sync, "part": 5, "parts": 2,
                           "ttl_ms": 1000}}
    assert to_engine.call("opener", "py.Open", {"part": wire}, timeout=DEADLINE) is None
    server.join(timeout=DEADLINE)
    assert got[0] == 1 and "part index" in got[1], got
    bundle.returned(timeout=DEADLINE)
    # Refused by the receiving mailbox as it decodes (the call never surfaces there).
    def drain() -> None:
        with pytest.raises(baton.Timeout):
            mailbox.recv(timeout=3)

    drainer = threading.Thread(target=drain)
    drainer.start()
    not_a_stamp = dict(wire, **{"baton.sync": "version 2"})
    with pytest.raises(baton.BadPayload, match="sync stamp"):
        to_engine.call("opener", "py.Open", {"part": not_a_stamp}, timeout=DEADLINE)
    drainer.join(timeout=DEADLINE)
    bundle.returned(timeout=DEADLINE)


def test_a_bundle_groups_bundles_keep_their_own_stamps(linked):
    """A group's list is read from its bytes, stamps too: an unstamped bundle and a stamped
    one arrive as one ``SharedBundleGroup`` whose parts say which carries what."""
    node, sender_node, to_engine = linked
    mailbox = node.register("grouped", "py.Group")
    bundles = [sender_node.allocate_bundle(SPEC) for _ in range(2)]
    sender = baton.SyncSender()
    sender.begin(2, 30.0)
    honest = sender.share(0, bundles[0]).stamp
    stamp = {"version": 1, "sync": honest.sync, "part": 0, "parts": 2, "ttl_ms": 1000}
    got = []

    def serve() -> None:
        call = mailbox.recv(timeout=DEADLINE)
        group = call.message["w"]
        got.append(type(group).__name__)
        got.append([(p.version, None if p.stamp is None else p.stamp.part) for p in group.parts])
        group.release()
        call.reply(None)

    server = threading.Thread(target=serve)
    server.start()
    wire = {"baton.bundles": [
        {"baton.bundle": bundles[1].layout, "buffer": bundles[1].buffer},
        {"baton.bundle": bundles[0].layout, "buffer": bundles[0].buffer, "baton.sync": stamp},
    ]}
    assert to_engine.call("grouped", "py.Group", {"w": wire}, timeout=DEADLINE) is None
    server.join(timeout=DEADLINE)
    assert got == ["SharedBundleGroup", [(None, None), (1, 0)]], got
    for bundle in bundles:
        bundle.returned(timeout=DEADLINE)


def test_an_infeasible_deadline_is_refused_up_front():
    sender = baton.SyncSender(version=4, min_deadline=0.1)
    for deadline in (-1.0, 0.0, 0.01, 2 * 86_400.0):
        with pytest.raises(baton.InfeasibleDeadline):
            sender.begin(1, deadline)
    assert sender.pending is None
    with pytest.raises(baton.SyncOver):
        sender.share(0, None)
    assert sender.begin(1, 5.0) == 5 and sender.pending == 5


def test_a_sync_past_its_deadline_is_dropped(linked):
    node, sender_node, to_engine = linked
    engine = Engine(node, node)
    parts = [sender_node.allocate_bundle(SPEC) for _ in range(2)]
    sender = baton.SyncSender()
    sender.begin(2, 0.3)
    late = sender.share(1, parts[1])
    assert to_engine.call("engine", "py.Part", {"part": sender.share(0, parts[0])},
                          timeout=DEADLINE) == 0
    time.sleep(0.35)
    with pytest.raises(baton.SyncOver, match="deadline"):
        sender.share(1, parts[1])
    assert engine.receiver.staging is None
    assert to_engine.call("engine", "py.Part", {"part": late}, timeout=DEADLINE) == "SyncClosed"
    assert engine.receiver.version == 0
    assert to_engine.call("engine", "py.Part", "stop", timeout=DEADLINE) is None


def test_a_device_sync_commits_whole(token_file, short_dir):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    try:
        node = baton.Node(token_file=str(token_file), backend="cuda")
    except baton.BackendUnavailable as e:
        pytest.skip(f"no GPU for Baton's CUDA backend: {e}")
    node.listen(short_dir, "py.sock")
    sender_node = baton.Node(token_file=str(token_file), backend="cuda")
    try:
        to_engine = sender_node.connect(short_dir / "py.sock", timeout=DEADLINE)
        engine = Engine(node, node)
        parts = [sender_node.allocate_bundle(SPEC) for _ in range(3)]
        sender = baton.SyncSender()
        for version in (1, 2, 3):
            sender.begin(3, 30.0)
            for part, bundle in enumerate(parts):
                bundle.returned(timeout=DEADLINE)
                for t in bundle.tensors("torch").values():
                    t.fill_(value(version, part))
            torch.cuda.synchronize()
            for part in range(3):
                to_engine.call("engine", "py.Part", {"part": sender.share(part, parts[part])},
                               timeout=DEADLINE)
            sender.finish()
            assert engine.receiver.version == version
            for part, bundle in enumerate(engine.receiver.parts):
                for t in bundle.tensors("torch").values():
                    assert bool((t == value(version, part)).all())
        assert to_engine.call("engine", "py.Part", "stop", timeout=DEADLINE) is None
    finally:
        sender_node.close()
        node.close()


def test_numpy_is_what_a_host_receiver_holds(linked):
    node, sender_node, to_engine = linked
    engine = Engine(node, node)
    bundle = sender_node.allocate_bundle(SPEC)
    sender = baton.SyncSender()
    sender.begin(1, 30.0)
    write([bundle], 1)
    assert to_engine.call("engine", "py.Part", {"part": sender.share(0, bundle)},
                          timeout=DEADLINE) == 1
    views = engine.receiver.parts[0].tensors()
    assert isinstance(views["w"], np.ndarray) and int(views["b"][0]) == value(1, 0)
    del views
    assert to_engine.call("engine", "py.Part", "stop", timeout=DEADLINE) is None
