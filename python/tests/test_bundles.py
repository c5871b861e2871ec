"""Bundles: many named tensors in one buffer, one lease per sync, both ways between Python
and Rust, and between two Python nodes; forged layouts refused with the link unharmed.
(Device bundles with torch views: `test_cuda.py`.)"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

import baton
from conftest import DEADLINE, eventually, table

# A model-shaped set: float32 matrices, float16 norms, an int64 step.
SPEC = [
    (f"layers.{i}.weight", (24, 16), "float32") if i % 2 == 0
    else (f"layers.{i}.norm", (16,), "float16")
    for i in range(199)
] + [("step", (), "int64")]


def fill(views: dict, step: int) -> list:
    """Writes every tensor for `step`; returns what the partner should answer per tensor
    (sums; 2-byte types as the sum of their raw bits)."""
    expect = []
    for i, (name, _, dtype) in enumerate(SPEC):
        v = views[name]
        v[...] = step if dtype == "int64" else step + i / 256
        expect.append(float(v.view(np.uint16).sum(dtype=np.float64)) if v.itemsize == 2
                      else float(v.sum(dtype=np.float64)))
    return expect


def test_a_layout_packs_named_tensors_at_aligned_offsets():
    layout = baton.BundleLayout({"w": ((3, 5), "bfloat16"), "b": (7, np.float32)})
    assert layout.tensors == [("w", "bfloat16", (3, 5), 0), ("b", "float32", (7,), 256)]
    assert layout.nbytes == 256 + 28 and len(layout) == 2 and "b" in layout
    assert layout["b"] == ("float32", (7,), 256)
    with pytest.raises(KeyError):
        layout["nope"]
    assert baton.BundleLayout([("w", (3, 5), "bfloat16"), ("b", 7, "float32")]) == layout
    with pytest.raises(ValueError, match="two tensors are named"):
        baton.BundleLayout([("a", 1, "uint8"), ("a", 1, "uint8")])
    with pytest.raises(ValueError, match="name"):
        baton.BundleLayout([("", 1, "uint8")])
    with pytest.raises(TypeError, match="unknown element type"):
        baton.BundleLayout([("a", 1, "complex64")])


def test_a_python_bundle_syncs_to_rust_as_one_lease(node, peer):
    bundle = node.allocate_bundle(SPEC)
    assert isinstance(bundle, baton.Bundle) and len(bundle.layout) == 200
    views = bundle.tensors()
    assert views["layers.0.weight"].shape == (24, 16) and views["step"].shape == ()
    assert views["layers.1.norm"].dtype == np.float16
    # One allocation for every tensor.
    assert [b["bytes"] for b in node.lease_table()] == [bundle.nbytes]
    for step in range(3):
        expect = fill(views, step)
        reply = peer.call("bundles", "py.SumBundle", {"weights": bundle}, timeout=DEADLINE)
        assert reply["error"] is None, reply
        assert reply["names"] == [name for name, _, _ in SPEC]
        assert reply["sums"] == expect, step
        bundle.returned(timeout=DEADLINE)
        assert bundle.leases_out == 0


def test_a_rust_bundle_opens_in_python_as_a_dict_of_views(node, peer):
    reply = peer.call("bundler", "py.MakeBundle", {"tensors": 50, "seed": 7})
    shared = reply["weights"]
    assert isinstance(shared, baton.SharedBundle), reply
    assert len(shared.layout) == 50 and shared.layout["t3"] == ("float32", (4,), 768)
    with shared.open() as opened:
        views = opened.tensors()
        assert list(views) == [f"t{i}" for i in range(50)]
        for i in range(50):
            assert views[f"t{i}"].tolist() == [7.0 + i] * (i + 1)
        assert not views["t0"].flags.writeable
        del views
    eventually(lambda: table(peer)["leases"] == 0, "the bundle's lease to go back")
    # load_weights: copied into arrays of ours by name, no view kept.
    params = {f"t{i}": np.zeros(i + 1, np.float32) for i in range(0, 50, 7)}
    shared = peer.call("bundler", "py.MakeBundle", {"tensors": 50, "seed": 1})["weights"]
    opened = shared.open()
    opened.copy_into(params)
    assert opened.release() is True, "copy_into keeps no view"
    assert all(p.tolist() == [1.0 + i] * (i + 1) for i, p in zip(range(0, 50, 7), params.values()))
    eventually(lambda: table(peer)["leases"] == 0, "the second bundle's lease to go back")
    shared = peer.call("bundler", "py.MakeBundle", {"tensors": 2, "seed": 1})["weights"]
    with shared.open() as opened, pytest.raises(KeyError, match="t9"):
        opened.copy_into({"t9": np.zeros(10, np.float32)})


def _varint(n: int) -> bytes:
    """bincode's variable-length integer (standard configuration)."""
    if n < 251:
        return bytes([n])
    for marker, width in ((251, 2), (252, 4), (253, 8)):
        if n < 1 << (8 * width):
            return bytes([marker]) + n.to_bytes(width, "little")
    raise ValueError(n)


_DTYPE_INDEX = {"uint8": 0, "int8": 1, "uint16": 2, "int16": 3, "uint32": 4, "int32": 5,
                "uint64": 6, "int64": 7, "float16": 8, "bfloat16": 9, "float32": 10,
                "float64": 11}


def wire_layout(tensors: list) -> bytes:
    """A layout's wire bytes, written by hand as a forger would: `(name, dtype, shape,
    offset)` each, unchecked (Rust's `BundleLayout::to_wire`)."""
    out = _varint(len(tensors))
    for name, dtype, shape, offset in tensors:
        out += _varint(len(name.encode())) + name.encode() + _varint(_DTYPE_INDEX[dtype])
        out += _varint(len(shape)) + b"".join(_varint(d) for d in shape) + _varint(offset)
    return out


def test_layout_wire_bytes_written_by_hand_are_the_ones_rust_writes(node, peer):
    layout = baton.BundleLayout([("a", (3, 5), "bfloat16"), ("b", (), "int64"),
                                 ("long name " * 30, (1 << 20,), "float32")])
    bundle = node.allocate_bundle(layout)
    tensors = [(n, d, s, o) for n, d, s, o in layout.tensors]
    wire = {"baton.bundle": wire_layout(tensors), "buffer": bundle.buffer}
    # Sent by hand, the partner sums the same tensors it sums of the bundle itself.
    assert peer.call("bundles", "py.SumBundle", {"weights": wire})["sums"] == \
        peer.call("bundles", "py.SumBundle", {"weights": bundle})["sums"]
    bundle.returned(timeout=DEADLINE)


def test_a_forged_bundle_layout_is_refused_and_the_link_carries_on(node, peer):
    buf = node.allocate(64, "uint8")
    overlapping = wire_layout([("a", "float32", [8], 0), ("b", "float32", [8], 16)])
    with pytest.raises(baton.BadPayload, match="overlap"):
        peer.call("bundles", "py.SumBundle", {"weights": {"baton.bundle": overlapping, "buffer": buf}})
    buf.returned(timeout=DEADLINE)  # the refused call's lease comes back
    past_the_end = wire_layout([("a", "float32", [1 << 20], 0)])
    reply = peer.call(
        "bundles", "py.SumBundle", {"weights": {"baton.bundle": past_the_end, "buffer": buf}}
    )
    assert "need" in reply["error"], reply
    buf.returned(timeout=DEADLINE)
    # The link carries the next, honest bundle.
    bundle = node.allocate_bundle({"x": (4, "float32")})
    bundle.tensors()["x"][:] = [1, 2, 3, 4]
    assert peer.call("bundles", "py.SumBundle", {"weights": bundle})["sums"] == [10.0]


def test_python_nodes_send_each_other_bundles_and_refuse_forged_ones(node, token_file, short_dir):
    """Python's own decoding checks a received layout: a forged one is answered BadPayload
    (the receiving mailbox carries on), an honest one opens as a dict of views."""
    node.listen(short_dir, "py.sock")
    sender = baton.Node(token_file=str(token_file), backend="host")
    try:
        to_node = sender.connect(short_dir / "py.sock", timeout=DEADLINE)
        mailbox = node.register("weights", "py.Weights")
        got = {}

        def serve() -> None:
            call = mailbox.recv(timeout=DEADLINE)  # the forged call never surfaces here
            shared = call.message["weights"]
            with shared.open() as opened:
                views = opened.tensors()
                got["w"] = views["w"].tolist()
                got["step"] = int(views["step"])
                del views
            call.reply(len(shared.layout))

        server = threading.Thread(target=serve)
        server.start()
        buf = sender.allocate(64, "uint8")
        forged = wire_layout([("w", "float32", [2], 0), ("w", "float32", [2], 8)])
        with pytest.raises(baton.BadPayload, match="two tensors are named"):
            to_node.call("weights", "py.Weights", {"weights": {"baton.bundle": forged, "buffer": buf}})
        buf.returned(timeout=DEADLINE)
        bundle = sender.allocate_bundle([("w", (2, 2), "float32"), ("step", (), "int64")])
        views = bundle.tensors()
        views["w"][...] = [[1, 2], [3, 4]]
        views["step"][...] = 9
        opens = node.import_stats()["opens"]
        assert to_node.call("weights", "py.Weights", {"weights": bundle}, timeout=DEADLINE) == 2
        server.join(timeout=DEADLINE)
        assert got == {"w": [[1.0, 2.0], [3.0, 4.0]], "step": 9}
        bundle.returned(timeout=DEADLINE)
        assert node.import_stats()["opens"] == opens + 1, "one open for the whole bundle"
    finally:
        sender.close()


def test_layouts_travel_as_bytes_among_every_kind_of_value(node, token_file, short_dir):
    """A layout is kept as its bytes on both sides (copied in on sending, compared with the
    layouts received before on arrival): values of every MessagePack width around and
    between two bundles — one of them in a list, one big enough for 32-bit offsets — come
    out as they went in, and a layout that is not a list of tensors is refused."""
    node.listen(short_dir, "py.sock")
    sender = baton.Node(token_file=str(token_file), backend="host")
    try:
        to_node = sender.connect(short_dir / "py.sock", timeout=DEADLINE)
        mailbox = node.register("echo", "py.Echo")
        small = sender.allocate_bundle([("a", (3,), "float32"), ("b", (), "int64")])
        big = sender.allocate_bundle([(f"t{i}", (70_000 + i,), "uint8") for i in range(3)])
        scalars = [0, 1, -1, 127, 128, -32, -33, 255, 256, -129, 65_535, 65_536, -32_769,
                   2**32, -(2**31) - 1, 2**63, -(2**63), 1.5, "", "x" * 31, "y" * 32,
                   "z" * 300, "w" * 70_000, b"", b"b" * 300, b"c" * 70_000, None, True, False,
                   [], {}, {"k": [1, {"l": []}]}, list(range(20)), {str(i): i for i in range(20)}]
        sent = {"before": scalars, "w": small, "list": [scalars, big, "after"], "z": scalars}
        got = {}

        def serve() -> None:
            for _ in range(2):
                call = mailbox.recv(timeout=DEADLINE)
                got["m"] = call.message
                for shared in (call.message["w"], call.message["list"][1]):
                    shared.release()
                call.reply(None)

        server = threading.Thread(target=serve)
        server.start()
        for _ in range(2):  # the second time the layouts are the ones received before
            assert to_node.call("echo", "py.Echo", sent, timeout=DEADLINE) is None
            m = got.pop("m")
            assert m["before"] == scalars and m["z"] == scalars
            assert m["list"][0] == scalars and m["list"][2] == "after"
            assert m["w"].layout == small.layout and m["list"][1].layout == big.layout
        server.join(timeout=DEADLINE)
        small.returned(timeout=DEADLINE)
        big.returned(timeout=DEADLINE)
        # Bytes that are not a layout (a list cut short, and bytes after a layout) are
        # refused by the receiving mailbox, which carries on, and so does the link.
        def drain() -> None:
            with pytest.raises(baton.Timeout):
                mailbox.recv(timeout=3)

        drainer = threading.Thread(target=drain)
        drainer.start()
        whole = wire_layout([("a", "uint8", [4], 0)])
        for bad in (whole[:-1], whole + b"\x00"):
            buf = sender.allocate(64, "uint8")
            with pytest.raises(baton.BadPayload, match="decode"):
                to_node.call("echo", "py.Echo", {"w": {"baton.bundle": bad, "buffer": buf}},
                             timeout=DEADLINE)
            buf.returned(timeout=DEADLINE)
        drainer.join(timeout=DEADLINE)
        assert to_node.ping(timeout=DEADLINE) > 0
    finally:
        sender.close()


def _keep_layouts(mailbox, calls: int, seen: list) -> None:
    """Serves `calls` calls carrying bundles in field "w": keeps their layouts in `seen`
    (one list per call), gives the bundles back unopened and replies."""
    for _ in range(calls):
        call = mailbox.recv(timeout=DEADLINE)
        got = call.message["w"]
        seen.append([shared.layout for shared in got])
        for shared in got:
            shared.release()
        call.reply(None)


def test_the_many_layouts_of_a_borrowed_model_are_decoded_once(node, token_file, short_dir):
    """A borrowed model comes as one bundle per allocation, tens of them every sync: each
    layout is decoded once, and a layout received again is the object received before
    (which is what lets ``copy_into`` keep each bundle's plan) — for 48 layouts in a call,
    more than a handful."""
    node.listen(short_dir, "py.sock")
    sender = baton.Node(token_file=str(token_file), backend="host")
    try:
        to_node = sender.connect(short_dir / "py.sock", timeout=DEADLINE)
        mailbox = node.register("many", "py.Many")
        bundles = [sender.allocate_bundle([(f"b{i}.w", (8 + i,), "float32"),
                                           (f"b{i}.b", (i + 1,), "int64")])
                   for i in range(48)]
        seen = []
        server = threading.Thread(target=_keep_layouts, args=(mailbox, 2, seen))
        server.start()
        for _ in range(2):
            assert to_node.call("many", "py.Many", {"w": bundles}, timeout=DEADLINE) is None
            for b in bundles:
                b.returned(timeout=DEADLINE)
        server.join(timeout=DEADLINE)
        first, second = seen
        assert [l == b.layout for l, b in zip(first, bundles)] == [True] * 48
        assert all(a is b for a, b in zip(first, second)), "every layout decoded once"
    finally:
        sender.close()


def test_the_layouts_kept_are_bounded_and_the_least_recent_go_first(node, token_file,
                                                                    short_dir):
    """The received layouts kept are bounded (256): after 288 other layouts have come, the
    first ones are decoded anew (a new object), while the ones received last are still the
    objects received before."""
    node.listen(short_dir, "py.sock")
    sender = baton.Node(token_file=str(token_file), backend="host")
    try:
        to_node = sender.connect(short_dir / "py.sock", timeout=DEADLINE)
        mailbox = node.register("kept", "py.Kept")
        batches = [[sender.allocate_bundle([(f"k{j}.{i}", (1 + i,), "int32")])
                    for i in range(48)] for j in range(7)]
        order = [0, 1, 2, 3, 4, 5, 6, 0, 6]
        seen = []
        server = threading.Thread(target=_keep_layouts, args=(mailbox, len(order), seen))
        server.start()
        for j in order:
            assert to_node.call("kept", "py.Kept", {"w": batches[j]}, timeout=DEADLINE) is None
            for b in batches[j]:
                b.returned(timeout=DEADLINE)
        server.join(timeout=DEADLINE)
        assert [l == b.layout for l, b in zip(seen[7], batches[0])] == [True] * 48
        assert not any(a is b for a, b in zip(seen[0], seen[7])), "the oldest went"
        assert all(a is b for a, b in zip(seen[6], seen[8])), "the last ones were kept"
    finally:
        sender.close()


def test_a_bundle_group_is_sent_opened_loaded_and_given_back_as_one(node, token_file, short_dir):
    """A group of bundles (what ``borrow_tensors`` returns: a model in many allocations) is
    one message field: the receiver gets one ``SharedBundleGroup``, opens every lease in
    one call, reads and copies every tensor by name, and gives them all back in one call;
    the second sync opens nothing. Names in two bundles are refused when the group is
    made."""
    node.listen(short_dir, "py.sock")
    sender = baton.Node(token_file=str(token_file), backend="host")
    try:
        to_node = sender.connect(short_dir / "py.sock", timeout=DEADLINE)
        mailbox = node.register("group", "py.Group")
        specs = [[(f"b{i}.w", (3 + i, 2), "float32"), (f"b{i}.n", (i + 1,), "float16")]
                 for i in range(5)] + [[("step", (), "int64")]]
        group = baton.BundleGroup(sender.allocate_bundle(spec) for spec in specs)
        assert len(group) == 6 and [b.layout for b in group] == list(group.layout)
        with pytest.raises(ValueError, match="two bundles"):
            baton.BundleGroup([group[0], group[0]])
        got = []

        def serve() -> None:
            for _ in range(2):
                call = mailbox.recv(timeout=DEADLINE)
                shared = call.message["weights"]
                assert isinstance(shared, baton.SharedBundleGroup) and len(shared) == 6
                # Its bundles, made when asked for: each its layout and its lease, in order.
                assert tuple(p.layout for p in shared.parts) == shared.layout
                assert shared.parts is shared.parts
                assert len({p._shared.lease_id for p in shared.parts}) == 1, "one lease"
                dst = {n: np.zeros(s, dtype=d) for spec in specs for n, s, d in spec}
                with shared.open() as opened:
                    views = opened.tensors()
                    step = int(views["step"])
                    del views
                    opened.copy_into(dst)
                got.append((step, dst))
                call.reply(shared.nbytes)

        server = threading.Thread(target=serve)
        server.start()
        opens = node.import_stats()["opens"]
        for step in range(2):
            views = group.tensors()
            for i, (name, arr) in enumerate(sorted(views.items())):
                arr[...] = step * 100 + i
            del views
            nbytes = to_node.call("group", "py.Group", {"weights": group}, timeout=DEADLINE)
            assert nbytes == group.nbytes
            group.returned(timeout=DEADLINE)
            assert group.leases_out == 0
            if step == 0:
                assert node.import_stats()["opens"] == opens + 6, "one open per bundle, once"
        server.join(timeout=DEADLINE)
        assert node.import_stats()["opens"] == opens + 6, "the second sync opened nothing"
        for step, (seen_step, dst) in enumerate(got):
            assert seen_step == step * 100 + sorted(dst).index("step")
            for i, name in enumerate(sorted(dst)):
                assert (dst[name] == step * 100 + i).all(), (step, name)
    finally:
        sender.close()


def _three_bundle_group(node, token_file, short_dir):
    """A host sender linked to `node`, `node`'s mailbox for groups, and a group of three
    one-tensor bundles of the sender's."""
    node.listen(short_dir, "py.sock")
    sender = baton.Node(token_file=str(token_file), backend="host")
    try:
        to_node = sender.connect(short_dir / "py.sock", timeout=DEADLINE)
        mailbox = node.register("group", "py.Group")
        group = baton.BundleGroup(sender.allocate_bundle([(f"b{i}", (8,), "float32")])
                                  for i in range(3))
    except BaseException:
        sender.close()
        raise
    return sender, to_node, mailbox, group


def test_a_bundle_group_is_one_lease_back_once_every_bundle_is_released(
        node, token_file, short_dir):
    """A group is one lease over its bundles' buffers: the receiver's lease of a bundle
    released alone stays out until every bundle of the group is released, then all of
    them are back at once; the sender's ledger keeps a part per buffer."""
    sender, to_node, mailbox, group = _three_bundle_group(node, token_file, short_dir)
    try:
        steps = queue.Queue()

        def serve() -> None:
            call = mailbox.recv(timeout=DEADLINE)
            opened = call.message["weights"].open()
            call.reply(None)
            for lease in opened.leases:
                steps.get(timeout=DEADLINE)
                lease.release()
            steps.get(timeout=DEADLINE)

        server = threading.Thread(target=serve)
        server.start()
        assert to_node.call("group", "py.Group", {"weights": group}, timeout=DEADLINE) is None
        parts = [lid for row in sender.lease_table() for lid, _ in row["leases"]]
        assert len(parts) == 3 and len(set(parts)) == 3, "a part per buffer"
        for released in range(2):
            steps.put("release one")
            time.sleep(0.3)
            assert group.leases_out == 3, f"{released + 1} of 3 released: the lease is out"
        steps.put("release the last")
        group.returned(timeout=DEADLINE)
        assert group.leases_out == 0
        steps.put("done")
        server.join(timeout=DEADLINE)
    finally:
        sender.close()


def test_a_bundle_group_released_in_one_call_waits_for_its_views(
        node, token_file, short_dir):
    """``BundleGroupLease.release()`` gives every lease back in one call — except while a
    view of one is alive: it says so (``False``), and the group's one lease goes back when
    the last view goes."""
    sender, to_node, mailbox, group = _three_bundle_group(node, token_file, short_dir)
    try:
        steps = queue.Queue()
        released = []

        def serve() -> None:
            call = mailbox.recv(timeout=DEADLINE)
            opened = call.message["weights"].open()
            view = opened.tensors()["b1"]
            released.append(opened.release())
            call.reply(None)
            steps.get(timeout=DEADLINE)
            del view
            steps.get(timeout=DEADLINE)

        server = threading.Thread(target=serve)
        server.start()
        assert to_node.call("group", "py.Group", {"weights": group}, timeout=DEADLINE) is None
        assert released == [False], "a view of a part is alive"
        time.sleep(0.3)
        assert group.leases_out == 3
        steps.put("drop the view")
        group.returned(timeout=DEADLINE)
        steps.put("done")
        server.join(timeout=DEADLINE)
    finally:
        sender.close()


def test_an_engine_lends_its_bundle_and_the_trainer_writes_it_in_place(node, token_file, short_dir):
    """The other way round from a sync the engine loads: the engine's weights are a bundle
    of its own, lent writable to the trainer (a call with ``bundle.share_mut()``); the
    trainer opens it writable, writes every tensor by name with ``copy_from`` and gives it
    back; the engine sees the new values once ``returned()``. While the writable lease is
    out the bundle is leased to nobody else (``LeaseConflict``), and while a read-only
    lease is out it is not lent writable. Opened read-only, ``copy_from`` is refused and
    writes nothing; a name the bundle does not have is a ``KeyError``; the lends after the
    first open nothing."""
    node.listen(short_dir, "py.sock")
    engine = baton.Node(token_file=str(token_file), backend="host")
    try:
        to_trainer = engine.connect(short_dir / "py.sock", timeout=DEADLINE)
        mailbox = node.register("trainer", "py.Lend")
        bundle = engine.allocate_bundle([("w", (2, 3), "float32"), ("b", (5,), "float16"),
                                         ("step", (), "int64")])
        refused, conflicts = [], []

        def train() -> None:
            for step in range(3):
                call = mailbox.recv(timeout=DEADLINE)
                new = {"w": np.full((2, 3), step + 0.5, dtype=np.float32),
                       "b": np.arange(5, dtype=np.float16) * step, "step": np.int64(step)}
                with call.message["weights"].open(writable=step > 0) as lent:
                    try:
                        lent.copy_from(new)
                    except BufferError as e:
                        refused.append(str(e))
                    if step == 1:
                        with pytest.raises(KeyError):
                            lent.copy_from({"nope": new["w"]})
                    # Out read-only, the bundle is not lent writable; out writable, it is
                    # lent to nobody else.
                    for other in [bundle.share_mut()] + ([bundle] if step == 1 else []):
                        try:
                            to_trainer.call("trainer", "py.Lend", {"weights": other},
                                            timeout=DEADLINE)
                        except baton.LeaseConflict as e:
                            conflicts.append(str(e))
                call.reply(step)

        trainer = threading.Thread(target=train)
        trainer.start()
        views = bundle.tensors()
        views["step"][...] = -1
        opens = node.import_stats()["opens"]
        for step in range(3):
            lend = bundle if step == 0 else bundle.share_mut()
            assert to_trainer.call("trainer", "py.Lend", {"weights": lend},
                                   timeout=DEADLINE) == step
            bundle.returned(timeout=DEADLINE)
            if step == 0:
                assert len(refused) == 1 and "read-only" in refused[0], refused
                assert int(views["step"]) == -1, "a read-only lease wrote nothing"
                continue
            assert int(views["step"]) == step
            assert (views["w"] == step + 0.5).all() and (views["b"] == np.arange(5) * step).all()
        trainer.join(timeout=DEADLINE)
        assert len(conflicts) == 4 and all("writable" in c for c in conflicts), conflicts
        assert node.import_stats()["opens"] == opens + 1, "one open, at the first lend"
        del views
    finally:
        engine.close()


def test_a_bundle_group_lent_writable_is_written_in_place_in_one_call(node, token_file, short_dir):
    """An engine whose weights are a group (PyTorch's allocations borrowed) lends them
    writable as one lease (``group.share_mut()``): the trainer opens the group writable,
    writes every tensor by name in one ``copy_from`` and gives it back in one call; the
    engine reads what was written. While it is out, no bundle of it is leased again; a
    name in no bundle is a ``KeyError``; opened read-only, nothing is written."""
    engine, to_trainer, mailbox, group = _three_bundle_group(node, token_file, short_dir)
    try:
        got = []

        def train() -> None:
            for writable in (False, True):
                call = mailbox.recv(timeout=DEADLINE)
                new = {f"b{i}": np.full(8, 10 * i + 1, dtype=np.float32) for i in range(3)}
                with call.message["weights"].open(writable=writable) as lent:
                    try:
                        with pytest.raises(KeyError):
                            lent.copy_from({"nope": new["b0"]})
                        lent.copy_from(new)
                        got.append("written")
                    except BufferError:
                        got.append("refused")
                    if writable:
                        try:
                            to_trainer.call("group", "py.Group", {"weights": group[1]},
                                            timeout=DEADLINE)
                        except baton.LeaseConflict:
                            got.append("conflict")
                call.reply(None)

        trainer = threading.Thread(target=train)
        trainer.start()
        views = group.tensors()
        for v in views.values():
            v[...] = -1
        for writable in (False, True):
            lend = group.share_mut() if writable else group
            assert to_trainer.call("group", "py.Group", {"weights": lend},
                                   timeout=DEADLINE) is None
            group.returned(timeout=DEADLINE)
            want = [10 * i + 1 if writable else -1 for i in range(3)]
            assert [float(views[f"b{i}"][0]) for i in range(3)] == want
            assert all((views[f"b{i}"] == want[i]).all() for i in range(3))
        trainer.join(timeout=DEADLINE)
        # Read-only: refused; writable: written, and a bundle of the group is leased to
        # nobody else meanwhile.
        assert got == ["refused", "written", "conflict"], got
        del views
    finally:
        engine.close()


def test_a_bundle_group_waits_on_a_stream_in_one_call_for_every_bundle(node):
    """``BundleGroup.wait_on`` is one call for every bundle (``wait_all_on``): host memory
    has nothing to wait for, and a bundle of the group already let go is refused — the
    call names every bundle, not only the first."""
    group = baton.BundleGroup([node.allocate_bundle({f"t{i}": ((4,), "float32")})
                               for i in range(3)])
    group.wait_on(None)
    assert group[2].release()
    with pytest.raises(baton.Released):
        group.wait_on(None)


def test_a_forged_bundle_group_is_refused_and_a_bad_part_gives_every_lease_back(
        node, token_file, short_dir):
    """A group map that is not one field holding a list of bundles is refused on arrival
    (``BadPayload``; its buffers go back, the link carries on); a group whose part does not
    fit its buffer is refused when opened, and every lease of the group goes back."""
    node.listen(short_dir, "py.sock")
    sender = baton.Node(token_file=str(token_file), backend="host")
    try:
        to_node = sender.connect(short_dir / "py.sock", timeout=DEADLINE)
        mailbox = node.register("group", "py.Group")
        honest = sender.allocate_bundle([("a", (4,), "float32")])
        part = {"baton.bundle": honest.layout, "buffer": honest.buffer}

        def drain() -> None:
            with pytest.raises(baton.Timeout):
                mailbox.recv(timeout=3)

        drainer = threading.Thread(target=drain)
        drainer.start()
        layout = honest.layout
        # The group's list is read from its bytes (no tree of values): each malformed part
        # is refused as the tree reader refused it.
        for forged in ({"baton.bundles": []}, {"baton.bundles": [1, part]},
                       {"baton.bundles": [part], "x": 1}, {"baton.bundles": part},
                       {"baton.bundles": [part, {"baton.bundle": layout, "buffer": 1}]},
                       {"baton.bundles": [part, {"baton.bundle": layout}]},
                       {"baton.bundles": [part, {7: 1}]},
                       {"baton.bundles": [{**part, "baton.sync": "not a stamp"}]},
                       {"baton.bundles": [{**part, "extra": None}]},
                       {"baton.bundles": [part, {}]}):
            with pytest.raises(baton.BadPayload):
                to_node.call("group", "py.Group", {"w": forged}, timeout=DEADLINE)
            honest.returned(timeout=DEADLINE)
        drainer.join(timeout=DEADLINE)

        small = sender.allocate(16, "uint8")
        too_big = {"baton.bundle": wire_layout([("b", "float32", [64], 0)]), "buffer": small}
        outcome = {}

        def serve() -> None:
            call = mailbox.recv(timeout=DEADLINE)
            try:
                call.message["w"].open()
            except ValueError as e:
                outcome["error"] = str(e)
            call.reply(None)

        server = threading.Thread(target=serve)
        server.start()
        to_node.call("group", "py.Group", {"w": {"baton.bundles": [part, too_big]}},
                     timeout=DEADLINE)
        server.join(timeout=DEADLINE)
        assert "need 256 bytes" in outcome["error"]
        honest.returned(timeout=DEADLINE)
        small.returned(timeout=DEADLINE)
        assert to_node.ping(timeout=DEADLINE) > 0
    finally:
        sender.close()


def test_numpy_views_of_bfloat16_need_ml_dtypes_and_say_so():
    layout = baton.BundleLayout({"w": (4, "bfloat16")})
    assert layout.nbytes == 8
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
    node = baton.Node(token=baton.generate_token(), backend="host")
    try:
        bundle = node.allocate_bundle(layout)
        if ml_dtypes is None:
            with pytest.raises(TypeError, match="bfloat16"):
                bundle.tensors()
        else:
            w = bundle.tensors()["w"]
            w[:] = [1.0, 2.0, 0.5, -3.0]
            assert w.dtype == np.dtype(ml_dtypes.bfloat16)
            assert w.view(np.uint16).tolist() == [0x3F80, 0x4000, 0x3F00, 0xC040]
    finally:
        node.close()
