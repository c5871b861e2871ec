"""Leases in Python: views keep them out, release() and `with` give them back (deferred
while views live), and any use after release raises."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import baton
from conftest import eventually, pattern, table


def lend(peer, index: int = 0, n: int = 1024, seed: int = 5) -> baton.Shared:
    reply = peer.call("lender", "py.Lend", {"index": index, "len": n, "seed": seed})
    assert reply["error"] is None
    return reply["buffer"]


def holders(peer) -> list:
    return table(peer)["holders"]


def test_dropping_the_last_numpy_view_releases_the_lease(node, peer):
    lease = lend(peer).open()
    arr = lease.numpy()
    part = arr[10:20]  # a view of the view: it keeps the lease out too
    del arr
    assert lease.views == 1
    assert lease.release() is False, "views are alive: the release is deferred"
    assert lease.released
    with pytest.raises(baton.Released, match="was released"):
        lease.numpy()
    # Still out, and the memory still readable through the view.
    assert holders(peer) == [node.pid]
    np.testing.assert_array_equal(part, pattern(5, 1024)[10:20])
    del part
    eventually(lambda: holders(peer) == [], "the lease to go back with its last view")
    assert lease.views == 0


def test_dropping_the_lease_object_and_its_views_releases_it(node, peer):
    arr = lend(peer).open().numpy()  # the Lease object is gone at once; the view is not
    assert holders(peer) == [node.pid]
    assert arr.sum() == pattern(5, 1024).sum()
    del arr
    gc.collect()
    eventually(lambda: holders(peer) == [], "the lease to go back")


def test_a_with_block_releases_and_use_after_release_raises(node, peer):
    shared = lend(peer)
    with shared.open() as lease:
        assert lease.tobytes() == pattern(5, 1024).tobytes()
        assert holders(peer) == [node.pid]
    assert lease.released
    eventually(lambda: holders(peer) == [], "the lease to go back at the end of the with block")
    for use in (lease.numpy, lease.tobytes, lease.__dlpack__):
        with pytest.raises(baton.Released, match=f"lease {lease.lease_id} was released"):
            use()
    with pytest.raises(baton.Released, match="opened already"):
        shared.open()
    assert lease.release() is False, "already back"


def test_release_without_views_gives_the_lease_back_at_once(node, peer):
    lease = lend(peer).open()
    assert lease.release() is True
    eventually(lambda: holders(peer) == [], "the lease to go back")


def test_an_unopened_buffer_can_be_released_and_not_opened_after(node, peer):
    shared = lend(peer)
    assert holders(peer) == [node.pid]
    assert shared.release() is True
    eventually(lambda: holders(peer) == [], "the unopened lease to go back")
    with pytest.raises(baton.Released, match="released"):
        shared.open()


def test_views_of_a_read_only_lease_cannot_write(peer):
    lease = lend(peer).open()
    assert not lease.writable
    arr = lease.numpy()
    assert not arr.flags.writeable
    with pytest.raises(ValueError):
        arr[0] = 1
    with pytest.raises(ValueError):
        arr.flags.writeable = True
    # DLPack before 1.0 has no read-only flag: such a capsule is refused, not handed out.
    with pytest.raises(BufferError, match="read-only"):
        lease.__dlpack__()
    assert lease.views == 1, "the refused capsule took no view"


def test_writes_through_a_writable_lease_reach_the_exporter(peer):
    n = 1024
    with lend(peer, n=n).open(writable=True) as lease:
        arr = lease.numpy()
        assert arr.flags.writeable
        arr[:] = 42
        del arr
    eventually(lambda: table(peer)["leases"] == 0, "the lease to go back")
    seen = peer.call("inspector", "py.Inspect", {"index": 0})
    assert seen == {"sum": 42 * n, "head": [42] * 8, "leases": 0}


def test_a_buffer_of_ours_outlives_its_handle_while_views_live(node, peer):
    buf = node.allocate(64, "int32")
    arr = buf.numpy()
    arr[:] = np.arange(64)
    assert buf.release() is True
    with pytest.raises(baton.Released, match="was released"):
        buf.numpy()
    with pytest.raises(baton.Released):
        peer.call("sink", "py.Sink", {"data": buf})
    arr += 1  # still mapped: the view holds the memory
    assert arr.sum() == np.arange(1, 65).sum()
    assert node.export_stats()["buffers"] == 1
    del arr
    eventually(lambda: node.export_stats()["buffers"] == 0, "the buffer to be freed")


def test_a_buffer_of_ours_leased_out_is_freed_after_the_lease_comes_back(node, peer):
    with node.allocate(128, "float32") as buf:
        buf.numpy()[:] = 1.0
        assert peer.call("sink", "py.Sink", {"data": buf})["sum"] == 128.0
    eventually(lambda: node.export_stats()["buffers"] == 0, "the buffer to be freed")
    assert node.export_stats()["freed"] == 1


def test_path_stats_count_each_lease_by_the_path_it_took(node, peer):
    assert node.path_stats() == {"paths": [], "downgrades": []}
    lease = lend(peer).open()
    assert lease.path in ("host-memfd", "host-segment"), lease.path
    nbytes = lease.numpy().nbytes
    stats = node.path_stats()
    assert stats["paths"] == [
        {"path": lease.path, "granted": 0, "granted_bytes": 0, "opened": 1, "opened_bytes": nbytes}
    ]
    assert stats["downgrades"] == []
    lease.release()
    # Counts are totals: a lease given back stays counted.
    assert node.path_stats()["paths"][0]["opened"] == 1
