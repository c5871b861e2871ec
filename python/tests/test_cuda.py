"""Device memory: a Rust-exported CUDA buffer viewed by torch and cupy (zero-copy, DLPack
and the CUDA array interface), written on a torch stream and read back by its exporter in
order; a buffer Python allocates on the device, written by torch, read by a Rust actor;
bundles of bfloat16 and float32 tensors both ways, as torch views; stream-ordered sends,
opens and releases that never synchronise the device.

Skipped, each with its reason (`pytest -rs` prints it), without a GPU that Baton's CUDA
backend can use, without torch with CUDA, or without cupy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import baton
from conftest import DEADLINE, eventually, pattern

HERE = Path(__file__).resolve().parent

N = 1 << 20
#: GPU clock cycles of a spin queued before a write (about a second on an H100): the write
#: is still queued when Python lets go of the memory, so the test fails if letting go does
#: not wait for the stream.
SPIN = 2_000_000_000


def spin(torch) -> None:
    """Queues a kernel that spins on the current stream (torch's private helper)."""
    torch.cuda._sleep(SPIN)


@pytest.fixture
def cuda_node(token_file):
    try:
        node = baton.Node(token_file=str(token_file), backend="cuda")
    except baton.BackendUnavailable as e:
        pytest.skip(f"no GPU for Baton's CUDA backend: {e}")
    yield node
    node.close()


@pytest.fixture
def cuda_peer(cuda_node, partner_factory):
    partner = partner_factory("cuda")
    assert partner.backend == "cuda", "the partner runs on device memory"
    return cuda_node.connect(partner.socket, timeout=DEADLINE)


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    # Load the kernels the tests launch: a kernel's first launch loads its module, which
    # can wait for the device, and would hide a missing wait of ours.
    x = torch.arange(4, device="cuda", dtype=torch.float32)
    torch.cuda._sleep(1)
    x.mul_(2)
    x.view(torch.int32).mul_(2)
    torch.empty_like(x).copy_(x)
    torch.cuda.synchronize()
    return torch


@pytest.fixture
def cupy():
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # cupy raises its own CUDARuntimeError without a device
        pytest.skip(f"cupy has no CUDA device: {e}")
    return cupy


def lend(peer, n=N, seed=5, index=0):
    return peer.call("lender", "py.Lend", {"index": index, "len": n, "seed": seed})["buffer"]


def inspect(peer, index=0):
    return peer.call("inspector", "py.Inspect", {"index": index})


def test_torch_reads_and_writes_a_rust_device_buffer_on_its_own_stream(torch, cuda_peer):
    lease = lend(cuda_peer).open(writable=True)
    assert lease.device == ("cuda", int(os.environ.get("BATON_CUDA_DEVICE", "0")))
    with pytest.raises(BufferError, match="device memory has no NumPy view"):
        lease.numpy()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        t = torch.from_dlpack(lease).view(torch.int32)  # zero-copy: the partner's memory
        assert t.is_cuda and t.data_ptr() == lease.__cuda_array_interface__["data"][0]
        want = torch.from_numpy(pattern(5, N).astype(np.int32)).cuda()
        assert torch.equal(t, want), "torch reads what the partner wrote"
        spin(torch)
        t.mul_(2)  # queued on our stream behind the spin; nobody waits for it here
        written = torch.cuda.Event()
        written.record(stream)
    del t
    # The lease goes back only after the context is synchronised: the partner must see the
    # write, not the memory as it was.
    lease.release()
    del lease
    eventually(lambda: cuda_peer.call("table", "py.Table")["leases"] == 0, "the lease to go back")
    assert written.query(), "the lease went back before our stream's write had run"
    assert inspect(cuda_peer)["sum"] == int(pattern(5, N).astype(np.uint64).sum() * 2)


def test_cupy_views_a_rust_device_buffer_through_dlpack_and_the_array_interface(cupy, cuda_peer):
    # Writable: a DLPack consumer older than DLPack 1.0 has no read-only flag to honour.
    lease = lend(cuda_peer, seed=8).open(writable=True)
    via_dlpack = cupy.from_dlpack(lease)
    np.testing.assert_array_equal(cupy.asnumpy(via_dlpack), pattern(8, N))
    cai = lease.__cuda_array_interface__
    assert cai["version"] == 3 and cai["typestr"] == "<u4" and cai["stream"]
    via_cai = cupy.asarray(lease)
    assert via_cai.data.ptr == via_dlpack.data.ptr, "both views are the partner's memory"
    np.testing.assert_array_equal(cupy.asnumpy(via_cai), pattern(8, N))
    del via_dlpack, via_cai
    assert lease.release() is False, "the array interface was read: the object is a view"
    assert inspect(cuda_peer)["leases"] == 1
    del lease
    eventually(lambda: inspect(cuda_peer)["leases"] == 0, "the lease to go back with its object")


def test_a_device_buffer_python_allocates_is_read_by_a_rust_actor(torch, cuda_node, cuda_peer):
    buf = cuda_node.allocate(N, "float32")
    assert buf.device[0] == "cuda"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        t = torch.from_dlpack(buf)
        source = torch.arange(N, device="cuda", dtype=torch.float32)
        spin(torch)
        t.copy_(source)  # queued behind the spin, not waited
        written = torch.cuda.Event()
        written.record(stream)
    # Sending synchronises the context first, so the partner reads what torch wrote.
    reply = cuda_peer.call("sink", "py.Sink", {"data": buf})
    assert written.query(), "the call left before our stream's write had run"
    assert reply["len"] == N
    assert reply["head"] == [float(i) for i in range(8)]
    assert reply["sum"] == float(N * (N - 1) // 2)
    del t
    buf.release()
    eventually(lambda: cuda_node.export_stats()["buffers"] == 0, "the device buffer to be freed")


def test_a_device_bundle_of_bfloat16_tensors_syncs_to_rust_as_torch_views(
    torch, cuda_node, cuda_peer
):
    spec = [
        (f"layers.{i}.weight", (64, 48), "bfloat16") if i % 2 == 0
        else (f"layers.{i}.norm", (48,), "float32")
        for i in range(200)
    ]
    bundle = cuda_node.allocate_bundle(spec)
    views = bundle.tensors()  # device memory: torch tensors by default
    assert views["layers.0.weight"].dtype == torch.bfloat16 and views["layers.0.weight"].is_cuda
    # One allocation: the second tensor starts at the first's end, rounded up to 256 bytes.
    assert views["layers.1.norm"].data_ptr() - views["layers.0.weight"].data_ptr() == 6144
    for step in range(3):
        expect = []
        for i, (name, _, dtype) in enumerate(spec):
            v = views[name]
            v.fill_(step + i / 64)  # torch's current stream; sending synchronises first
            if dtype == "bfloat16":
                expect.append(float((v.view(torch.int16).to(torch.int64) & 0xFFFF).sum()))
            else:
                expect.append(float(v.double().sum()))
        reply = cuda_peer.call("bundles", "py.SumBundle", {"weights": bundle}, timeout=DEADLINE)
        assert reply["error"] is None, reply
        assert reply["sums"] == expect, step
        bundle.returned(timeout=DEADLINE)


def test_a_rust_device_bundle_opens_in_python_as_torch_tensors(torch, cuda_peer):
    shared = cuda_peer.call("bundler", "py.MakeBundle", {"tensors": 20, "seed": 3})["weights"]
    assert isinstance(shared, baton.SharedBundle)
    # Writable: torch may take a DLPack capsule without the read-only flag (see
    # test_torch_reads_and_writes_a_rust_device_buffer_on_its_own_stream).
    with shared.open(writable=True) as opened:
        views = opened.tensors("torch")
        for i in range(20):
            t = views[f"t{i}"]
            assert t.is_cuda and t.tolist() == [3.0 + i] * (i + 1)
        del views, t
    eventually(lambda: cuda_peer.call("table", "py.Table")["leases"] == 0, "the lease to go back")
    # load_weights into torch tensors: of the same dtypes, one kernel launch (its plan kept
    # for the next sync); of another dtype, a typed copy per tensor.
    same = {f"t{i}": torch.zeros(i + 1, device="cuda") for i in (9, 0, 4)}
    other = {f"t{i}": torch.zeros(i + 1, device="cuda", dtype=torch.float64) for i in (1, 7)}
    for seed in (5, 6):
        shared = cuda_peer.call("bundler", "py.MakeBundle", {"tensors": 20, "seed": seed})["weights"]
        with shared.open() as opened:
            opened.copy_into(same)
            opened.copy_into(other)
        torch.cuda.synchronize()
        for params in (same, other):
            for name, t in params.items():
                i = int(name[1:])
                assert t.tolist() == [float(seed + i)] * (i + 1), (seed, name)
    eventually(lambda: cuda_peer.call("table", "py.Table")["leases"] == 0, "the leases to go back")


def test_stream_ordered_send_open_and_release_never_synchronise_the_device(torch, cuda_node, cuda_peer):
    """`peer.call(..., stream=s)`, `shared.open(stream=s)` and the release of such a lease
    order by fences on `s`, never by a host synchronisation: a spin queued on another
    stream before each of them is still running after it returns (a device
    synchronisation would have waited for it), and every read and write still lands in
    order."""
    s, other = torch.cuda.Stream(), torch.cuda.Stream()

    def busy() -> "torch.cuda.Event":
        """Three spins on the other stream (about 3 s: longer than any wait of the test's
        own), and an event after them."""
        with torch.cuda.stream(other):
            for _ in range(3):
                spin(torch)
            done = torch.cuda.Event()
            done.record(other)
        return done

    # Send: written on `s` behind a spin, sent with stream=s; the partner reads it after
    # the write (its read waits on the acquire fence recorded on `s`).
    buf = cuda_node.allocate(N, "float32")
    with torch.cuda.stream(s):
        t = torch.from_dlpack(buf)
        spin(torch)
        t.copy_(torch.arange(N, device="cuda", dtype=torch.float32))
    unrelated = busy()
    reply = cuda_peer.call("sink", "py.Sink", {"data": buf}, stream=s, timeout=DEADLINE)
    assert reply["sum"] == float(N * (N - 1) // 2), "the partner read before our write"
    assert not unrelated.query(), "sending synchronised the device"
    other.synchronize()
    buf.returned(timeout=DEADLINE)
    buf.wait_on(s)

    # Open: the partner's buffer on `s`, no host wait; written behind a spin, released;
    # the partner reads the write once the lease is back (it waits on the release fence).
    unrelated = busy()
    lease = lend(cuda_peer, seed=4).open(writable=True, stream=s)
    assert not unrelated.query(), "opening synchronised the device"
    with torch.cuda.stream(s):
        view = torch.from_dlpack(lease).view(torch.int32)
        spin(torch)
        view.mul_(2)
        written = torch.cuda.Event()
        written.record(s)
    del view
    unrelated = busy()
    lease.release()
    del lease
    eventually(lambda: inspect(cuda_peer)["leases"] == 0, "the lease to go back")
    assert not unrelated.query(), "the release synchronised the device"
    assert inspect(cuda_peer)["sum"] == int(pattern(4, N).astype(np.uint64).sum() * 2)
    assert written.query()
    other.synchronize()


def test_a_stream_ordered_bundle_sync_round_trip(torch, cuda_node, cuda_peer):
    """The weight-sync loop with no host synchronisation of ours: update on `s`, send on
    `s`, and after the lease is back, `wait_on(s)` before the next update."""
    s = torch.cuda.Stream()
    bundle = cuda_node.allocate_bundle([(f"w{i}", (256, 64), "bfloat16") for i in range(40)])
    views = bundle.tensors()
    with torch.cuda.stream(s):
        for step in range(3):
            for i, v in enumerate(views.values()):
                v.fill_(step + i)
            reply = cuda_peer.call("bundles", "py.SumBundle", {"weights": bundle}, stream=s,
                                   timeout=DEADLINE)
            want = [float((v.view(torch.int16).to(torch.int64) & 0xFFFF).sum()) for v in views.values()]
            assert reply["sums"] == want, step
            bundle.returned(timeout=DEADLINE)
            bundle.wait_on(s)


def test_a_copy_plan_publishes_and_loads_thousands_of_tensors_in_one_launch(
    torch, cuda_node, cuda_peer, token_file, short_dir
):
    # Odd sizes of two dtypes and enough tensors that the kernel's search runs deep; the
    # trainer's tensors are torch's own allocations.
    spec = [(f"t{i}", ((i * 7) % 300 + 1,), "bfloat16" if i % 3 else "float32")
            for i in range(3000)]
    params = {n: torch.randn(s, device="cuda").to(getattr(torch, d)) for n, s, d in spec}
    bundle = cuda_node.allocate_bundle(spec)
    plan = baton.CopyPlan(bundle.layout, params)
    assert len(plan) == len(spec)
    for step in range(2):
        for t in params.values():
            t.add_(1)
        bundle.copy_from(plan)  # torch's current stream; sending synchronises first
        reply = cuda_peer.call("bundles", "py.SumBundle", {"weights": bundle}, timeout=DEADLINE)
        assert reply["error"] is None, reply
        assert reply["sums"] == _bundle_sums(torch, bundle, params), step
        bundle.returned(timeout=DEADLINE)
    # Loading a bundle a Rust peer made (imported memory) through a plan.
    loaded = {f"t{i}": torch.zeros(i + 1, device="cuda") for i in range(20)}
    for seed in (9, 10):
        shared = cuda_peer.call("bundler", "py.MakeBundle", {"tensors": 20, "seed": seed})["weights"]
        with shared.open() as opened:
            opened.copy_into(baton.CopyPlan(opened.layout, loaded))
        torch.cuda.synchronize()
        for i in range(20):
            assert loaded[f"t{i}"].tolist() == [float(seed + i)] * (i + 1), (seed, i)
    # Refused, with the reason: another dtype, a host tensor, a write while a lease is out.
    with pytest.raises(ValueError, match="float64"):
        baton.CopyPlan(bundle.layout, {"t0": torch.zeros(1, device="cuda", dtype=torch.float64)})
    with pytest.raises(TypeError, match="CUDA"):
        baton.CopyPlan(bundle.layout, {"t0": torch.zeros(1)})
    holder = baton.Node(token_file=str(token_file), backend="cuda")
    try:
        mailbox = holder.register("hold", "py.Hold")
        holder.listen(short_dir, "holder.sock")
        peer = cuda_node.connect(short_dir / "holder.sock", timeout=DEADLINE)
        answered = threading.Thread(
            target=lambda: peer.call("hold", "py.Hold", {"w": bundle}, timeout=DEADLINE))
        answered.start()
        call = mailbox.recv(timeout=DEADLINE)  # the lease is out until the holder lets go
        with pytest.raises(BufferError, match="lease"):
            bundle.copy_from(plan)
        call.message["w"].release()
        call.reply(None)
        answered.join(DEADLINE)
        bundle.returned(timeout=DEADLINE)
        bundle.copy_from(plan)  # unleased again: allowed
    finally:
        holder.close()


def _bundle_sums(torch, bundle, params):
    """What py.SumBundle answers for `bundle`: per tensor in layout order, the sum of a
    float32 tensor's values, of a bfloat16 tensor's raw bits."""
    sums = []
    for name, dtype, _shape, _offset in bundle.layout.tensors:
        t = params[name]
        if dtype == "bfloat16":
            sums.append(float((t.view(torch.int16).to(torch.int64) & 0xFFFF).sum()))
        else:
            sums.append(float(t.double().sum()))
    return sums


def test_tensors_torch_allocated_are_leased_in_place_and_kept_until_baton_is_done(
    torch, cuda_node, cuda_peer
):
    # A model's parameters as PyTorch allocates them: small ones share the caching
    # allocator's segments, a large one has a segment of its own.
    params = {}
    for i in range(40):
        if i % 2 == 0:
            params[f"layers.{i}.weight"] = torch.empty((64, 48), dtype=torch.bfloat16, device="cuda")
        else:
            params[f"layers.{i}.norm"] = torch.empty((48,), dtype=torch.float32, device="cuda")
    params["embed"] = torch.empty((4096, 1024), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    bundles = cuda_node.borrow_tensors(params.items())
    assert 2 <= len(bundles) < len(params), "grouped by CUDA allocation"
    assert sorted(n for b in bundles for n, *_ in b.layout.tensors) == sorted(params)
    for b in bundles:
        for name, view in b.tensors().items():
            # No copy: a bundle's views are the tensors' own memory.
            assert view.data_ptr() == params[name].data_ptr(), name
            assert view.dtype == params[name].dtype and view.shape == params[name].shape
    # A trainer's steps: update in place, sync every bundle, wait for it back.
    for step in range(3):
        for i, t in enumerate(params.values()):
            t.fill_(step + i / 64)
        for b in bundles:
            reply = cuda_peer.call("bundles", "py.SumBundle", {"weights": b}, timeout=DEADLINE)
            assert reply["error"] is None, reply
            assert reply["sums"] == _bundle_sums(torch, b, params), step
        for b in bundles:
            b.returned(timeout=DEADLINE)

    # Lent once: the same memory again, tied weights, and tensors legacy IPC cannot share.
    with pytest.raises(baton.NotBorrowable):
        cuda_node.borrow_tensors({"again": params["embed"]})
    with pytest.raises(ValueError, match="share memory"):
        cuda_node.borrow_tensors({"a": params["embed"], "b": params["embed"][:2]})
    with pytest.raises(ValueError, match="contiguous"):
        cuda_node.borrow_tensors({"t": torch.empty((8, 4), device="cuda").t()})
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_node.borrow_tensors({"host": torch.ones(4)})

    # Baton keeps the storages: dropping the trainer's tensors frees nothing while the
    # bundles live; letting go of the bundles (the peer unmaps its warm mappings when
    # asked) gives the memory back to PyTorch.
    del params, view, t
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() >= allocated, "kept while Baton holds it"
    for b in bundles:
        assert b.release()
    del bundles, b

    def given_back():
        cuda_node.lease_table()  # any call into Baton runs deferred reference drops
        return torch.cuda.memory_allocated() < allocated

    eventually(given_back, "the borrowed tensors' memory to go back to PyTorch")


def test_a_borrowed_model_is_lent_opened_and_loaded_as_one_group(torch, cuda_node):
    # What a weight sync of borrowed tensors is: the trainer's parameters, in a handful of
    # the caching allocator's segments, lent as one group to an engine process that opens
    # it in one call and loads every tensor with one plan (one kernel launch over every
    # segment) — or by name, or stream-ordered — and opens nothing after the first sync.
    params = {}
    for i in range(30):
        shape = (64, 40) if i % 3 else (48,)
        params[f"layers.{i}"] = torch.empty(shape, dtype=torch.bfloat16 if i % 2 else torch.float32,
                                            device="cuda")
    params["embed"] = torch.empty((4096, 1024), dtype=torch.bfloat16, device="cuda")
    group = cuda_node.borrow_tensors(params)
    assert isinstance(group, baton.BundleGroup) and 2 <= len(group) < len(params)
    child = cuda_node.spawn([sys.executable, str(HERE / "group_child.py")], timeout=DEADLINE)
    try:
        for step, (plan, ordered) in enumerate([(True, False), (True, True), (False, False)]):
            for i, t in enumerate(params.values()):
                t.fill_(step + i / 32)
            torch.cuda.synchronize()
            reply = child.peer.call("engine", "py.Group", {"weights": group, "plan": plan,
                                                          "ordered": ordered}, timeout=DEADLINE)
            group.returned(timeout=DEADLINE)
            want = {n: float(t.double().sum()) for n, t in params.items()}
            assert reply["sums"] == want, (step, plan, ordered)
            assert reply["opens"] == len(group), "each segment opened once, at the first sync"
    finally:
        child.peer.close()
        child.wait(timeout=DEADLINE)
    assert group.release()


@pytest.mark.parametrize("engine_device,borrowed", [(0, False), (1, False), (0, True),
                                                     (1, True)])
def test_an_engine_lends_its_weights_and_the_trainer_writes_them_stream_ordered(
        torch, cuda_node, engine_device, borrowed):
    # A sync the other way round (GUIDE, *An engine lends its weights*): an engine process
    # lends its weight bundle with a stream-ordered call, its own write still queued behind
    # a spin; this process opens it writable on its stream, queues a spin of its own, then
    # writes every tensor with one plan (or by name) and gives the lease back. The engine's
    # reads after `returned()` and `wait_on` see exactly what was written: a copy that did
    # not wait for the engine's write, or a release fence the engine did not wait for,
    # shows as the engine's -1s. On a second GPU the bundle is that GPU's memory mapped
    # here, and the plan copies its 64 MiB tensor by the copy engine, the rest by one launch.
    # `borrowed`: the engine's weights are torch tensors lent as one lease over their
    # allocations (a group), whose parts wait once and release once on the trainer's stream.
    if engine_device >= torch.cuda.device_count():
        pytest.skip(f"needs {engine_device + 1} GPUs; torch sees {torch.cuda.device_count()}")
    mailbox = cuda_node.register("trainer", "py.Lend")
    child = cuda_node.spawn([sys.executable, str(HERE / "lend_child.py")]
                            + (["borrowed"] if borrowed else []), timeout=DEADLINE,
                            env={"BATON_CUDA_DEVICE": str(engine_device)})
    stream = torch.cuda.current_stream()
    params, want, opens = None, None, cuda_node.import_stats()["opens"]
    try:
        for step in range(4):
            call = mailbox.recv(timeout=DEADLINE)
            assert call.message["sums"] == want, step
            if step == 3:
                call.message["weights"].release()
                call.reply({"stop": True})
                break
            lent = call.message["weights"].open(writable=True, stream=stream)
            leases = lent.leases if borrowed else [lent.lease]
            assert len(leases) >= (2 if borrowed else 1)
            assert all(l.path.endswith("-peer-gpu") == (engine_device != 0) for l in leases)
            if params is None:
                layouts = lent.layout if borrowed else (lent.layout,)
                params = {name: torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
                          for layout in layouts for name, dtype, shape, _ in layout.tensors}
            for i, t in enumerate(params.values()):
                t.fill_(step + i / 32)
            spin(torch)  # the copies queued behind it: the release must wait for them
            lent.copy_from(baton.CopyPlan(lent.layout, params) if step == 1 else params)
            lent.release()
            call.reply({"step": step})
            want = {n: float(t.double().sum()) for n, t in params.items()}
        assert cuda_node.import_stats()["opens"] == opens + len(leases), \
            "each allocation opened once, at the first lend"
    finally:
        child.peer.close()  # a lend still waiting for its answer ends the engine
        child.wait(timeout=DEADLINE)


def test_expandable_segments_are_refused_with_a_reason(tmp_path, token_file):
    # PyTorch's expandable segments are VMM memory, which legacy IPC cannot share: a child
    # with that allocator setting is refused, clearly, and goes on.
    pytest.importorskip("torch", reason="torch is not installed")
    script = tmp_path / "expandable.py"
    script.write_text(
        "import sys, torch, baton\n"
        "if not torch.cuda.is_available():\n"
        "    print('no-gpu'); sys.exit(0)\n"
        "try:\n"
        "    node = baton.Node(token_file=sys.argv[1], backend='cuda')\n"
        "except baton.BackendUnavailable:\n"
        "    print('no-gpu'); sys.exit(0)\n"
        "t = torch.ones(1 << 20, device='cuda')\n"
        "try:\n"
        "    node.borrow_tensors({'t': t})\n"
        "    print('borrowed')\n"
        "except baton.NotBorrowable as e:\n"
        "    print('refused:', e)\n"
        "node.close()\n"
    )
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run(
        [sys.executable, str(script), str(token_file)],
        env=env, capture_output=True, text=True, timeout=DEADLINE,
    )
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-gpu":
        pytest.skip("no GPU for Baton's CUDA backend")
    assert out.stdout.startswith("refused:"), out.stdout
    assert "expandable segments" in out.stdout, out.stdout


@pytest.mark.parametrize("export", ["legacy", "vmm", "pool"])
def test_a_closed_node_gives_the_device_its_memory_back(
    torch, token_file, partner_factory, monkeypatch, export
):
    """A node links a partner, shares it a 64 MiB device buffer written by torch, frees it
    and closes: the device's memory in use (``torch.cuda.mem_get_info``, after a
    synchronise) comes back to within 4 MiB of where it was before the node was made —
    what the driver keeps of the streams the node made. The partner is started first, so
    that its own context is in both measures."""
    monkeypatch.setenv("BATON_CUDA_EXPORT", export)
    partner = partner_factory("cuda")
    mib = 1 << 20

    def used() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    before = used()
    try:
        node = baton.Node(token_file=str(token_file), backend="cuda")
    except baton.BackendUnavailable as e:
        pytest.skip(f"no GPU for Baton's CUDA backend with {export} memory: {e}")
    steps = [("node made", used())]
    peer = node.connect(partner.socket, timeout=DEADLINE)
    n = 16 * mib  # float32: 64 MiB
    buf = node.allocate(n, "float32")
    t = torch.from_dlpack(buf)
    t.fill_(1.0)
    del t
    reply = peer.call("sink", "py.Sink", {"data": buf})
    assert reply["len"] == n and reply["sum"] == float(n)
    steps.append(("64 MiB shared and read", used()))
    buf.release()
    eventually(lambda: node.export_stats()["buffers"] == 0, "the device buffer to be freed")
    node.close()
    del buf, peer, node
    # Frees run on the node's driver thread: the memory comes back within the deadline.
    end = time.monotonic() + DEADLINE
    while used() - before > 4 * mib and time.monotonic() < end:
        time.sleep(0.01)
    steps.append(("freed, node closed", used()))
    for what, u in steps:
        print(f"{export}: {what}: {(u - before) / mib:+.1f} MiB in use since before the node")
    kept = steps[-1][1] - before
    assert kept <= 4 * mib, (
        f"{export}: a closed node keeps {kept / mib:.1f} MiB of device memory (at most 4 allowed)"
    )
