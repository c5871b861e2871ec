#!/usr/bin/env python3
"""Weight sync, trainer to inference engine, on one GPU (issue 25's benchmark).

A trainer process updates every weight of a model-shaped set each step (an optimizer-like
kernel: one `_foreach_add_` over every tensor) and hands the weights to an engine process,
which copies every tensor into its own preallocated parameters (as an engine's
`load_weights` does; every path loads the same way as Baton's `copy_into`), waits for
the copies, checks the step it was sent, and answers. A sync is timed from the trainer's
call (its update done) to the weights being its own again. In
the same run, the same bytes through:

- `baton-bundle`: one Baton bundle (one allocation, one lease per sync; the engine's
  import cache keeps it mapped, so a sync after the first opens nothing), with Python's
  conservative device synchronisation on send, open and release;
- `baton-bundle-ordered`: the same, stream-ordered (`call(..., stream=s)`,
  `open(stream=s)`, `wait_on(s)`): fences on the streams, no host synchronisation but the
  engine's own wait for its copies;
- `baton-borrowed`: the trainer's own torch tensors leased in place
  (`Node.borrow_tensors`: a group of one bundle per CUDA allocation of PyTorch's caching
  allocator, no copy into a Baton buffer, one lease over them all), the engine opening the
  group in one call and loading it with one `CopyPlan`; `leases_per_sync` is what the
  engine received (the distinct lease ids of the group's parts);
- `baton-push`: the other way round — the engine's parameters live in one bundle of its
  own, which it lends writable to the trainer for each sync (`bundle.share_mut()` in a
  stream-ordered call, sent while the trainer trains); the trainer opens it writable on its
  stream, writes every tensor from its own torch parameters with one `CopyPlan` launch
  (`BundleLease.copy_from`), gives it back with its release fence on that stream and
  answers; the engine's stream waits for the fence (`wait_on`) and the engine checks the
  step. The sync is timed to the trainer's copies done (its stream synchronised);
  `returned_ms_median` is the trainer's call to the engine having the lease back and its
  stream ordered after the copies (the weights are the engine's; it checks them after);
- `baton-push-borrowed`: the same with the engine's parameters torch tensors lent where
  PyTorch allocated them (`borrow_tensors`: a group, one writable lease);
- `torch-mp-push`: torch.multiprocessing the same way round — the engine's parameters are
  views of one flat bucket it shares once; each sync the engine says it is ready, the
  trainer copies into the bucket (as every torch loader here does), synchronises and
  answers the step;
- `torch-mp-tensors`: torch.multiprocessing, one CUDA tensor per weight (what RL
  frameworks do without bucketing);
- `torch-mp-flat`: torch.multiprocessing, one flat bucket and a layout (the bucketed fix);
- `copy`: the floor — one process copying the same tensors device to device: per tensor
  (one fused `_foreach_copy_` of the bf16 tensors; and as every path's loader does it, a
  memcpy per tensor of 1 MiB or more and one fused copy of words for the rest), and as one
  flat copy of the same bytes.

Prints one JSON line per path: per-sync time (median and p90 of the steps after the
first; the first apart), driver-level opens per sync after the first (Baton: the engine's
import cache counter), the engine's reserved device memory at the first and the last
step, and for Baton's paths where a sync's time goes (`stages_ms_median`: the engine's
`open`, `copy` (queueing `copy_into`), `release` and `wait` (for its copies), `engine` (all
of its handling), `call_overhead` (the call's round trip beyond the engine's handling:
encode, socket, mailbox hops, decode), split into `to_engine` (the trainer's call to the
engine's `recv` returning) and `from_engine` (the engine's `reply` to the trainer's call
returning), `returned` (the trainer's wait for the leases back));
then a summary line with the ratios the issue sets targets for.

Loading: Baton's engine copies with a `baton.CopyPlan` (one kernel launch for every
tensor); torch's engines as an engine does by hand (a `copy_` per tensor of 1 MiB or more,
one fused `_foreach_copy_` of the rest). `copy-per-tensor-loader` is that loader alone,
`copy-plan` Baton's alone, in one process.

Across GPUs (`--engine-device N`, issue 47 item 6): the trainer's weights on GPU 0, every
engine on GPU N (Baton's maps the bundle there, its `CopyPlan` reads over NVLink: one
copy-engine copy for a one-tensor model, the gather kernel for more;
torch's maps the bucket by CUDA IPC); the floor is then `copy-p2p`, a torch copy of the
same bytes from GPU 0 to GPU N in one process (and `copy-flat` the same copy within GPU 0).
The `flat-256m`, `flat-1g` and `flat-4g` models are one tensor of that size, for the
targets set by size.

usage: python3 bench/weight_sync.py [--model qwen2.5-0.5b|qwen2.5-7b|moe-20000|flat-1g|...]
                                    [--steps N] [--paths baton-bundle,torch-mp-tensors,...]
                                    [--engine-device N] [--pin T,E]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# Real configs (Hugging Face config.json): hidden, layers, intermediate, vocab, heads,
# key/value heads, whether lm_head is tied to the embedding.
MODELS = {
    "qwen2.5-0.5b": (896, 24, 4864, 151936, 14, 2, True),  # ~0.92 GiB in bf16, 290 tensors
    "qwen2.5-7b": (3584, 28, 18944, 152064, 28, 4, False),  # ~14.2 GiB in bf16, 339 tensors
}
#: A synthetic mixture-of-experts shard: 20,000 tensors, 7.6 GB in bf16 (issue 47).
MOE = "moe-20000"
#: One flat tensor of a size (the across-GPU targets are set by size).
FLAT = {"flat-256m": 256 << 20, "flat-1g": 1 << 30, "flat-4g": 4 << 30}
#: `--pin T,E`: the trainer's CPUs and every engine's, each one CPU or several joined by `+`
#: (children read it from the environment).
PIN_ENV = "WEIGHT_SYNC_PIN"


def pin(role: int) -> None:
    """Pins this process's threads from now on (and its children's) to the trainer's CPUs
    (`role` 0) or the engines' (1), when `--pin` asked for it."""
    cpus = os.environ.get(PIN_ENV)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")[role].split("+")})


def model_spec(name: str) -> list:
    """(name, shape, dtype) of every weight, in a checkpoint's order, plus a `step` scalar
    the engine checks."""
    if name in FLAT:
        return [("flat.weight", (FLAT[name] // 2,), "bfloat16"), ("step", (), "int64")]
    if name == MOE:
        # 160 experts x 125 projections of 190,000 bf16 each (380 kB): per-tensor costs
        # dominate unless a sync pays nothing per tensor.
        spec = [(f"experts.{i // 125}.w{i % 125}", (190_000,), "bfloat16") for i in range(20_000)]
        return spec + [("step", (), "int64")]
    hidden, layers, inter, vocab, heads, kv_heads, tied = MODELS[name]
    kv = hidden // heads * kv_heads
    spec = [("model.embed_tokens.weight", (vocab, hidden), "bfloat16")]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "self_attn.q_proj.weight", (hidden, hidden), "bfloat16"),
            (p + "self_attn.q_proj.bias", (hidden,), "bfloat16"),
            (p + "self_attn.k_proj.weight", (kv, hidden), "bfloat16"),
            (p + "self_attn.k_proj.bias", (kv,), "bfloat16"),
            (p + "self_attn.v_proj.weight", (kv, hidden), "bfloat16"),
            (p + "self_attn.v_proj.bias", (kv,), "bfloat16"),
            (p + "self_attn.o_proj.weight", (hidden, hidden), "bfloat16"),
            (p + "mlp.gate_proj.weight", (inter, hidden), "bfloat16"),
            (p + "mlp.up_proj.weight", (inter, hidden), "bfloat16"),
            (p + "mlp.down_proj.weight", (hidden, inter), "bfloat16"),
            (p + "input_layernorm.weight", (hidden,), "bfloat16"),
            (p + "post_attention_layernorm.weight", (hidden,), "bfloat16"),
        ]
    spec.append(("model.norm.weight", (hidden,), "bfloat16"))
    if not tied:
        spec.append(("lm_head.weight", (vocab, hidden), "bfloat16"))
    spec.append(("step", (), "int64"))
    return spec


SIZE = {"bfloat16": 2, "int64": 8}


def flat_layout(spec) -> tuple:
    """Where each tensor sits in one flat bucket, each at a multiple of 256 bytes (as in a
    Baton bundle): [(name, shape, dtype, offset, bytes)], total bytes."""
    import math

    out, at = [], 0
    for name, shape, dtype in spec:
        n = math.prod(shape) * SIZE[dtype]
        out.append((name, shape, dtype, at, n))
        at = (at + n + 255) // 256 * 256
    return out, at


def nbytes(spec) -> int:
    return flat_layout(spec)[1]


def params_like(torch, spec) -> dict:
    return {n: torch.empty(s, dtype=getattr(torch, d), device="cuda") for n, s, d in spec}


def summary(path: str, times: list, **extra) -> dict:
    rest = sorted(times[1:]) or times
    line = {
        "bench": "weight_sync",
        "path": path,
        "per_sync_ms_median": round(statistics.median(rest) * 1e3, 3),
        "per_sync_ms_p90": round(rest[int(len(rest) * 0.9) - 1 if len(rest) > 1 else 0] * 1e3, 3),
        "first_sync_ms": round(times[0] * 1e3, 3),
        "steps": len(times),
        **extra,
    }
    print(json.dumps(line), flush=True)
    return line


# ---- the floor: device-to-device copies in one process ----------------------------------

def run_copy(args, spec) -> list:
    import torch

    src, dst = params_like(torch, spec), params_like(torch, spec)
    src_list, dst_list = list(src.values()), list(dst.values())
    src_bytes = [t.view(-1).view(torch.uint8) for t in src_list]
    dst_bytes = [t.view(-1).view(torch.uint8) for t in dst_list]
    out = []
    plan_memory = None
    hows = ["per-tensor", "per-tensor-loader", "plan", "flat"]
    if args.engine_device:
        hows.append("p2p")  # the floor across GPUs: GPU 0 to the engine's GPU
    for how in hows:
        flat_src = torch.empty(nbytes(spec), dtype=torch.uint8, device="cuda")
        flat_dst = torch.empty_like(flat_src, device=f"cuda:{args.engine_device}"
                                    if how == "p2p" else "cuda")
        if how == "plan":
            plan_memory = _PlanFloor(torch, spec, dst)
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            if how in ("flat", "p2p"):
                flat_dst.copy_(flat_src)
            elif how == "per-tensor":
                torch._foreach_copy_(dst_list, src_list)
            elif how == "plan":
                plan_memory.copy_into(plan_memory.plan)
            else:
                load(dst_bytes, src_bytes)
            torch.cuda.synchronize()
            if how == "p2p":
                torch.cuda.synchronize(flat_dst.device)
            times.append(time.perf_counter() - t)
        out.append(summary(f"copy-{how}", times, opens_per_sync=0))
        del flat_src, flat_dst
    if plan_memory is not None:
        plan_memory.close()
    return out


class _PlanFloor:
    """Baton's loader alone: a bundle of this process's own, copied into `dst` by a
    `baton.CopyPlan` (no second process, no lease)."""

    def __init__(self, torch, spec, dst) -> None:
        import baton

        self.node = baton.Node(token=baton.generate_token(), backend="cuda")
        self.bundle = self.node.allocate_bundle(spec)
        self.plan = baton.CopyPlan(self.bundle.layout, dst)

    def copy_into(self, plan) -> None:
        self.bundle.copy_into(plan)

    def close(self) -> None:
        del self.plan
        self.bundle.release()
        self.node.close()


# ---- Baton: one bundle --------------------------------------------------------------------

def baton_engine(model: str, ordered: bool, kill: str, device: int = 0) -> None:
    """The engine, a child of the trainer (`Node.spawn`). `kill == "engine"`: SIGKILL
    itself in the middle of its third sync (the lease open, its copies queued)."""
    import signal

    pin(1)
    import torch

    import baton

    spec = model_spec(model)
    torch.cuda.set_device(device)  # its parameters, copies and waits on its own GPU
    node = baton.Node()  # the token, backend and device the trainer passed
    mailbox = node.register("engine", "rl.Weights")
    node.connect_parent()
    params = params_like(torch, spec)
    plan = None  # the engine's loading plan: made at the first sync, run every sync
    synced = 0
    while True:
        try:
            call = mailbox.recv(timeout=120)
        except baton.LinkClosed:
            return
        if call.message.get("stats"):  # asked between syncs, outside the timed window
            call.reply({"opens": node.import_stats()["opens"],
                        "reserved": torch.cuda.memory_reserved()})
            continue
        # Where the engine's time goes (seconds).
        stage = dict.fromkeys(("open", "copy", "release", "wait"), 0.0)
        t_in = time.perf_counter()
        ordering = {"stream": torch.cuda.current_stream()} if ordered else {}
        # A bundle, or (borrowed) a bundle group: one per allocation of the trainer's,
        # opened, loaded with one plan and released as one either way.
        sent = call.message["weights"]
        # The leases it came in, as received: a group's parts name one lease.
        leases = len({p._shared.lease_id for p in sent.parts}) \
            if isinstance(sent, baton.SharedBundleGroup) else 1
        t = time.perf_counter()
        weights = sent.open(**ordering)
        t1 = time.perf_counter()
        if plan is None or plan.layout != weights.layout:
            plan = baton.CopyPlan(weights.layout, params)
        weights.copy_into(plan)
        if synced == 2 and kill == "engine":
            os.kill(os.getpid(), signal.SIGKILL)
        t2 = time.perf_counter()
        weights.release()
        t3 = time.perf_counter()
        stage["open"] += t1 - t
        stage["copy"] += t2 - t1
        stage["release"] += t3 - t2
        synced += 1
        t = time.perf_counter()
        torch.cuda.current_stream().synchronize()  # loaded: what an engine waits for
        stage["wait"] = time.perf_counter() - t
        ok = int(params["step"].item()) == call.message["step"]
        stage["engine"] = time.perf_counter() - t_in
        # Both processes' perf_counter is CLOCK_MONOTONIC: comparable across them.
        call.reply({"ok": ok, "stages": stage, "leases": leases, "t_in": t_in,
                    "t_out": time.perf_counter()})


def run_baton(args, spec, ordered: bool, borrowed: bool = False) -> dict:
    import torch

    import baton

    node = baton.Node(token=baton.generate_token(), backend="cuda")
    child = node.spawn([sys.executable, os.path.abspath(__file__), "--role", "engine",
                        "--model", args.model, "--engine-device", str(args.engine_device)]
                       + (["--ordered"] if ordered else []),
                       env={"BATON_CUDA_DEVICE": str(args.engine_device)}, timeout=120)
    stream = torch.cuda.current_stream() if ordered else None
    if borrowed:
        views = params_like(torch, spec)  # the trainer's own parameters
        sent = node.borrow_tensors(views)  # a group: one bundle per allocation
    else:
        sent = node.allocate_bundle(spec)
        views = sent.tensors()
    weights = [v for n, v in views.items() if n != "step"]
    for w in weights:
        w.fill_(0)
    times, opens, reserved, stages, leases = [], [], [], [], []
    try:
        for step in range(args.steps):
            torch._foreach_add_(weights, 1e-3)  # the optimizer's update
            views["step"].fill_(step)
            torch.cuda.synchronize()  # the update is the trainer's step, not the sync's
            t = time.perf_counter()
            ordering = {"stream": stream} if ordered else {}
            reply = child.peer.call("engine", "rl.Weights", {"weights": sent, "step": step},
                                    timeout=120, **ordering)
            t_reply = time.perf_counter()
            sent.returned(timeout=120)
            if ordered:
                sent.wait_on(stream)  # the next update waits for the engine's copies
            times.append(time.perf_counter() - t)
            assert reply["ok"], (step, reply)
            leases.append(reply["leases"])
            # The trainer's view: the call's round trip less the engine's own time (messages,
            # encode and decode, mailbox hops), and the wait for the leases back.
            stages.append(dict(reply["stages"],
                               call_overhead=t_reply - t - reply["stages"]["engine"],
                               to_engine=reply["t_in"] - t, from_engine=t_reply - reply["t_out"],
                               returned=times[-1] - (t_reply - t)))
            if step in (0, args.steps - 1):  # the engine's counters, asked outside the timing
                stats = child.peer.call("engine", "rl.Weights", {"stats": True}, timeout=120)
                opens.append(stats["opens"])
                reserved.append(stats["reserved"])
    finally:  # also when a call fails (a group over the frame limit): the engine exits
        child.peer.close()
        child.wait(timeout=60)
        node.close()
    return summary(
        "baton-borrowed" if borrowed else
        "baton-bundle-ordered" if ordered else "baton-bundle", times,
        bundles=len(sent) if borrowed else 1,
        leases_per_sync=max(leases),
        opens_first=opens[0],
        opens_per_sync=(opens[-1] - opens[0]) / max(1, args.steps - 1),
        engine_reserved_mib=[reserved[0] >> 20, reserved[-1] >> 20],
        stages_ms_median={k: round(statistics.median(s[k] for s in stages[1:] or stages) * 1e3, 3)
                          for k in stages[0]},
    )


# ---- Baton: the engine lends its weights, the trainer writes them ------------------------------

def baton_push_engine(model: str, device: int = 0, borrowed: bool = False) -> None:
    """The engine of `baton-push`, a child of the trainer: its parameters live in one bundle
    of its own (`borrowed`: they are torch tensors, lent where PyTorch allocated them, a
    group), which it lends writable to the trainer for each sync (a call, stream-ordered
    after its reads of them). Once the lease is back it orders its stream after the
    trainer's copies, queues its read of the step they wrote, and lends again at once —
    ordered after that read, so the trainer's next copies wait for it on the GPU, not for
    the engine's host — then checks the value read. Each lend carries the check of the sync
    before the last; the engine's last message, the last one's."""
    pin(1)
    import torch

    import baton

    spec = model_spec(model)
    torch.cuda.set_device(device)
    node = baton.Node()  # the token, backend and device the trainer passed
    peer = node.connect_parent()
    if borrowed:
        params = params_like(torch, spec)
        bundle = node.borrow_tensors(params)
    else:
        bundle = node.allocate_bundle(spec)
        params = bundle.tensors()
    lend = bundle.share_mut()  # one writable lease, the only one while it is out
    stream = torch.cuda.current_stream()
    read = torch.empty((), dtype=torch.int64, pin_memory=True)  # the step, read back
    done = torch.cuda.Event()  # after the read
    report, pending = {}, None
    while True:
        try:
            answer = peer.call("trainer", "rl.Lend", {"weights": lend, "seen": report},
                               timeout=120, stream=stream)
        except baton.Message as e:  # a lend that does not fit a frame: say so, and go
            peer.call("trainer", "rl.Lend", {"error": str(e)}, timeout=120)
            return
        except baton.LinkClosed:
            return
        report = {}
        if pending is not None:  # the read queued after the sync before this one
            done.synchronize()
            step, t_returned = pending
            report = {"ok": int(read) == step, "step": step, "t_returned": t_returned,
                      "reserved": torch.cuda.memory_reserved()}
            pending = None
        if answer.get("stop"):
            bundle.returned(timeout=120)
            peer.call("trainer", "rl.Lend", {"seen": report}, timeout=120)
            return
        bundle.returned(timeout=120)
        bundle.wait_on(stream)  # its next reads after the trainer's copies
        # Both processes' perf_counter is CLOCK_MONOTONIC: comparable across them.
        pending = (answer["step"], time.perf_counter())
        read.copy_(params["step"], non_blocking=True)
        done.record(stream)


def run_baton_push(args, spec, borrowed: bool = False) -> dict:
    import torch

    import baton

    node = baton.Node(token=baton.generate_token(), backend="cuda")
    mailbox = node.register("trainer", "rl.Lend")
    opens = node.import_stats()["opens"]  # before the engine's first lend arrives (opened then)
    child = node.spawn([sys.executable, os.path.abspath(__file__), "--role", "engine-push",
                        "--model", args.model, "--engine-device", str(args.engine_device)]
                       + (["--borrowed"] if borrowed else []),
                       env={"BATON_CUDA_DEVICE": str(args.engine_device)}, timeout=120)
    stream = torch.cuda.current_stream()
    views = params_like(torch, spec)  # the trainer's own parameters: plain torch tensors
    weights = [v for n, v in views.items() if n != "step"]
    for w in weights:
        w.fill_(0)
    plan = None
    times, starts, returned, reserved, stages, leases = [], [], [], [], [], []
    opens_first = None

    def lend_in():  # the engine's next lend, with what it saw of an earlier sync
        call = mailbox.recv(timeout=120)
        if "error" in call.message:
            call.reply(None)
            raise baton.Message(f"the engine's lend: {call.message['error']}")
        seen = call.message["seen"]
        if seen:
            assert seen["ok"], seen
            returned.append(seen["t_returned"] - starts[seen["step"]])
            reserved.append(seen["reserved"])
        return call

    try:
        for step in range(args.steps):
            torch._foreach_add_(weights, 1e-3)  # the optimizer's update
            views["step"].fill_(step)
            torch.cuda.synchronize()  # the update is the trainer's step, not the sync's
            t = time.perf_counter()
            starts.append(t)
            call = lend_in()  # the engine's lend, in since the last sync
            t_recv = time.perf_counter()
            sent = call.message["weights"]
            lent = sent.open(writable=True, stream=stream)
            t_open = time.perf_counter()
            if plan is None or plan.layout != lent.layout:
                plan = baton.CopyPlan(lent.layout, views)
            lent.copy_from(plan, stream=stream)
            t_copy = time.perf_counter()
            lent.release()  # its release fence on `stream`, after the copies
            call.reply({"step": step})
            t_sent = time.perf_counter()
            stream.synchronize()  # the copies done: the weights are the trainer's again
            times.append(time.perf_counter() - t)
            # The leases it came in, as received: a group's parts name one lease.
            leases.append(len({p._shared.lease_id for p in sent.parts})
                          if isinstance(sent, baton.SharedBundleGroup) else 1)
            stages.append({"recv": t_recv - t, "open": t_open - t_recv, "copy": t_copy - t_open,
                           "release_reply": t_sent - t_copy, "wait": times[-1] - (t_sent - t)})
            if step == 0:
                opens_first = node.import_stats()["opens"] - opens
        call = lend_in()  # a lend the trainer does not take: the end
        call.message["weights"].release()
        call.reply({"stop": True})
        lend_in().reply(None)  # what the engine saw of the last sync
        assert len(returned) == args.steps, (len(returned), args.steps)
        opens_after = node.import_stats()["opens"] - opens - opens_first
    finally:
        child.wait(timeout=60)
        node.close()
    return summary(
        "baton-push-borrowed" if borrowed else "baton-push", times,
        bundles=len(sent) if borrowed else 1,
        leases_per_sync=max(leases),
        opens_first=opens_first,
        opens_per_sync=opens_after / max(1, args.steps - 1),
        engine_reserved_mib=[reserved[0] >> 20, reserved[-1] >> 20],
        returned_ms_median=round(statistics.median(returned[1:] or returned) * 1e3, 3),
        stages_ms_median={k: round(statistics.median(s[k] for s in stages[1:] or stages) * 1e3, 3)
                          for k in stages[0]},
    )


# ---- SIGKILL in the middle of a sync ---------------------------------------------------------

def device_free() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


def run_kill(args) -> None:
    """`--kill engine`: this process is the trainer; its engine dies in its third sync. The
    call fails with a typed error, the lease comes back, the engine's device memory returns
    to the device, and a new engine takes the next syncs. `--kill trainer`: see
    `kill_trainer`."""
    import subprocess

    import torch

    torch.cuda.init()
    spec = model_spec(args.model)
    if args.kill == "trainer":
        return kill_trainer(args)
    import baton

    before = device_free()
    node = baton.Node(token=baton.generate_token(), backend="cuda")
    bundle = node.allocate_bundle(spec)
    views = bundle.tensors()

    def engine():
        return node.spawn([sys.executable, os.path.abspath(__file__), "--role", "engine",
                           "--model", args.model, "--kill", "engine"], timeout=120)

    child, failed, t_kill, with_engine = engine(), None, None, None
    for step in range(3):
        views["step"].fill_(step)
        try:
            child.peer.call("engine", "rl.Weights", {"weights": bundle, "step": step}, timeout=60)
        except baton.BatonError as e:
            failed, t_kill = type(e).__name__, time.perf_counter()
        if step == 0:
            with_engine = device_free()
    bundle.returned(timeout=30)
    back_s = round(time.perf_counter() - t_kill, 3) if t_kill else None
    status = child.wait(timeout=30)
    engine_gone = device_free()
    # A new engine takes over.
    child = engine()
    views["step"].fill_(7)
    reply = child.peer.call("engine", "rl.Weights", {"weights": bundle, "step": 7}, timeout=60)
    child.peer.close()
    child.wait(timeout=30)
    bundle.release()
    node.close()
    torch.cuda.synchronize()
    print(json.dumps({
        "bench": "weight_sync", "kill": "engine", "call_failed_with": failed,
        "lease_back_s_after_failure": back_s, "engine_status": status,
        "new_engine_sync_ok": bool(reply and reply["ok"]),
        "device_free_after_kill_vs_start_mib": (engine_gone - before) >> 20,
        "device_freed_by_the_kill_mib": (engine_gone - with_engine) >> 20,
        "bundle_mib": bundle_mib(spec),
    }), flush=True)


def bundle_mib(spec) -> int:
    return nbytes(spec) >> 20


def kill_trainer(args) -> None:
    """`--kill trainer`: an engine that serves trainers (a process of its own, listening, as
    an inference service is) kills its trainer in the middle of a sync — the lease open,
    its copies queued — and must carry on: finish loading, be left with no mapping of the
    dead trainer's memory, serve the next trainer, and exit cleanly."""
    import queue
    import shutil
    import subprocess
    import tempfile
    import threading

    import baton

    sockets = tempfile.mkdtemp(prefix="baton-ws-")
    env = dict(os.environ, BATON_TOKEN=baton.generate_token())
    me = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--dir", sockets]
    before = device_free()
    engine = subprocess.Popen(me + ["--role", "engine-server"], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    lines: "queue.Queue[dict]" = queue.Queue()

    def read() -> None:
        for line in engine.stdout:
            if line.startswith("{"):
                lines.put(json.loads(line))

    threading.Thread(target=read, daemon=True).start()

    def expect(key: str) -> dict:
        while True:
            line = lines.get(timeout=120)
            if key in line:
                return line[key]

    try:
        expect("ready")
        victim = subprocess.run(me + ["--role", "client", "--steps", "5", "--kill-at", "2"],
                                env=env, timeout=120)
        after = expect("after_trainer_kill")
        again = subprocess.run(me + ["--role", "client", "--steps", "3"], env=env, timeout=120)
        engine.stdin.close()
        status = engine.wait(timeout=60)
        final = expect("engine_exit")
    finally:
        engine.kill()
        shutil.rmtree(sockets, ignore_errors=True)
    time.sleep(0.5)
    print(json.dumps({
        "bench": "weight_sync", "kill": "trainer", "trainer_status": victim.returncode,
        "engine_after_the_kill": after, "next_trainer_status": again.returncode,
        "engine": final, "engine_status": status,
        "device_free_vs_start_mib": (device_free() - before) >> 20,
    }), flush=True)


def engine_server(args) -> None:
    """The engine of `--kill trainer`: listens, loads what trainers send, kills the trainer
    whose call asks for it (`kill_me`) in the middle of loading; exits when stdin closes."""
    import signal
    import threading

    import torch

    import baton

    spec = model_spec(args.model)
    node = baton.Node(token=os.environ["BATON_TOKEN"], backend="cuda")
    node.listen(args.dir, "engine.sock")
    mailbox = node.register("engine", "rl.Weights")
    params = params_like(torch, spec)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    syncs = 0
    while not stop.is_set():
        try:
            call = mailbox.recv(timeout=0.2)
        except baton.Timeout:
            continue
        kill = call.message.get("kill_me", False)
        with call.message["weights"].open() as weights:
            weights.copy_into(params)
            if kill:
                os.kill(call.peer_pid, signal.SIGKILL)
        torch.cuda.current_stream().synchronize()  # the copies complete all the same
        if kill:
            t = time.monotonic()
            while node.import_stats()["live"] and time.monotonic() - t < 10:
                time.sleep(0.01)
            print(json.dumps({"after_trainer_kill": {
                "loaded_step_ok": int(params["step"].item()) == call.message["step"],
                "mappings_left": node.import_stats()["live"],
                "mapping_gone_after_s": round(time.monotonic() - t, 3),
                "reply_delivered": call.reply(None),
            }}), flush=True)
            continue
        syncs += 1
        call.reply({"ok": int(params["step"].item()) == call.message["step"]})
    node.close()
    print(json.dumps({"engine_exit": {"clean": True, "honest_syncs": syncs}}), flush=True)


def trainer_client(args) -> None:
    """A trainer of `--kill trainer`: connects to the engine and syncs `--steps` times (the
    sync numbered `--kill-at` asks the engine to kill it)."""
    import torch

    import baton

    spec = model_spec(args.model)
    node = baton.Node(token=os.environ["BATON_TOKEN"], backend="cuda")
    peer = node.connect(os.path.join(args.dir, "engine.sock"), timeout=60)
    bundle = node.allocate_bundle(spec)
    views = bundle.tensors()
    for step in range(args.steps):
        views["step"].fill_(step)
        torch.cuda.synchronize()
        reply = peer.call("engine", "rl.Weights",
                          {"weights": bundle, "step": step, "kill_me": step == args.kill_at},
                          timeout=60)
        assert reply["ok"], (step, reply)
        bundle.returned(timeout=60)
    node.close()


# ---- torch.multiprocessing ----------------------------------------------------------------

def torch_engine(model: str, flat: bool, inbox, outbox, device: int = 0) -> None:
    pin(1)
    import torch

    torch.cuda.set_device(device)
    spec = model_spec(model)
    params = params_like(torch, spec)
    dst = [p.view(-1).view(torch.uint8) for p in params.values()]
    sizes, end = [], 0
    for _, _, _, at, n in flat_layout(spec)[0]:
        sizes += [at - end, n]
        end = at + n
    while True:
        item = inbox.get()
        if item is None:
            return
        if item == "stats":  # asked between syncs, outside the timed window
            outbox.put(torch.cuda.memory_reserved())
            continue
        step, payload = item
        # The same loading as Baton's `copy_into`, so that the transports are compared: a
        # memcpy per large tensor, one fused copy (`_foreach_copy_`) of 8-byte words for
        # the small ones; the bucket cut by the layout.
        if flat:
            src = payload[:end].split(sizes)[1::2]
        else:
            src = [t.view(-1).view(torch.uint8) for t in payload]
        load(dst, src)
        del payload, item
        torch.cuda.current_stream().synchronize()
        outbox.put(int(params["step"].item()) == step)


def load(dst: list, src: list) -> None:
    """Copies byte tensors `src` into `dst` as Baton's `copy_into` does: a memcpy for each
    of 1 MiB or more, one fused copy of 8-byte words for the rest (every tensor of these
    models is a multiple of 8 bytes)."""
    import torch

    small_dst, small_src = [], []
    for d, s in zip(dst, src):
        if d.numel() >= 1 << 20:
            d.copy_(s)
        else:
            small_dst.append(d.view(torch.int64))
            small_src.append(s.view(torch.int64))
    if small_dst and small_dst[0].device == small_src[0].device:
        torch._foreach_copy_(small_dst, small_src)
    else:  # across GPUs (`--engine-device`): one copy each
        for d, s in zip(small_dst, small_src):
            d.copy_(s)


def torch_push_engine(model: str, inbox, outbox, device: int = 0) -> None:
    """The engine of `torch-mp-push`: its parameters are views of one flat bucket, which it
    shares with the trainer once (CUDA IPC); each sync it says it is ready (its reads done),
    the trainer writes the bucket and answers the step once its copies are done."""
    pin(1)
    import torch

    torch.cuda.set_device(device)
    spec = model_spec(model)
    bucket = torch.zeros(nbytes(spec), dtype=torch.uint8, device="cuda")
    step_view = next(bucket[at:at + n].view(getattr(torch, dtype)).view(shape)
                     for name, shape, dtype, at, n in flat_layout(spec)[0] if name == "step")
    outbox.put(bucket)
    ok = None
    while True:
        outbox.put(("ready", ok, torch.cuda.memory_reserved()))
        step = inbox.get()
        if step is None:
            return
        ok = int(step_view.item()) == step


def run_torch_push(args, spec) -> dict:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=torch_push_engine, args=(args.model, inbox, outbox,
                                                       args.engine_device))
    proc.start()
    bucket = outbox.get(timeout=300)  # the engine's parameters, opened here once
    views = params_like(torch, spec)
    src = [t.view(-1).view(torch.uint8) for t in views.values()]
    dst = [bucket[at:at + n] for _, _, _, at, n in flat_layout(spec)[0]]
    weights = [v for n, v in views.items() if n != "step"]
    for w in weights:
        w.zero_()
    times, reserved = [], []
    for step in range(args.steps):
        torch._foreach_add_(weights, 1e-3)
        views["step"].fill_(step)
        torch.cuda.synchronize()
        t = time.perf_counter()
        _, ok, mem = outbox.get(timeout=300)  # the engine's reads are done
        load(dst, src)
        torch.cuda.synchronize()
        inbox.put(step)
        times.append(time.perf_counter() - t)
        assert ok is None or ok, step
        reserved.append(mem)
    _, ok, mem = outbox.get(timeout=300)
    assert ok, "the last sync"
    inbox.put(None)
    del bucket, dst
    proc.join(60)
    return summary("torch-mp-push", times,
                   engine_reserved_mib=[reserved[0] >> 20, mem >> 20], torch=torch.__version__)


def run_torch(args, spec, flat: bool) -> dict:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=torch_engine,
                       args=(args.model, flat, inbox, outbox, args.engine_device))
    proc.start()
    if flat:
        bucket = torch.zeros(nbytes(spec), dtype=torch.uint8, device="cuda")
        views = {name: bucket[at:at + n].view(getattr(torch, dtype)).view(shape)
                 for name, shape, dtype, at, n in flat_layout(spec)[0]}
    else:
        views = params_like(torch, spec)
        for v in views.values():
            v.zero_()
    weights = [v for n, v in views.items() if n != "step"]
    times, reserved = [], []
    for step in range(args.steps):
        torch._foreach_add_(weights, 1e-3)
        views["step"].fill_(step)
        torch.cuda.synchronize()
        t = time.perf_counter()
        inbox.put((step, bucket if flat else list(views.values())))
        ok = outbox.get(timeout=300)
        times.append(time.perf_counter() - t)
        assert ok, step
        if step in (0, args.steps - 1):
            inbox.put("stats")
            reserved.append(outbox.get(timeout=300))
    inbox.put(None)
    proc.join(60)
    return summary(
        "torch-mp-flat" if flat else "torch-mp-tensors", times,
        engine_reserved_mib=[reserved[0] >> 20, reserved[-1] >> 20],
        torch=torch.__version__,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b",
                    choices=sorted(MODELS) + [MOE] + sorted(FLAT))
    ap.add_argument("--engine-device", type=int, default=0,
                    help="the engines' GPU (the trainer's is 0): across GPUs when not 0")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--paths", default="copy,baton-bundle,baton-bundle-ordered,"
                    "baton-borrowed,baton-push,baton-push-borrowed,torch-mp-flat,"
                    "torch-mp-push,torch-mp-tensors")
    ap.add_argument("--role", default="trainer",
                    choices=["trainer", "engine", "engine-push", "engine-server", "client"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--ordered", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--borrowed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kill", choices=["engine", "trainer"],
                    help="instead of timing: SIGKILL the engine (a child of the trainer), or "
                    "the trainer (of an engine serving trainers), in the middle of a sync, and "
                    "report how the survivor fares")
    ap.add_argument("--pin", metavar="T,E",
                    help="pin the trainer to CPU T and every engine to CPU E (all their "
                    "threads; several CPUs joined by +: the wake-up experiment of "
                    "docs/BENCHMARKS.md)")
    args = ap.parse_args()
    if args.pin:
        os.environ[PIN_ENV] = args.pin
    if args.role == "trainer":
        pin(0)
    if args.role == "engine":
        return baton_engine(args.model, args.ordered, args.kill or "", args.engine_device)
    if args.role == "engine-push":
        return baton_push_engine(args.model, args.engine_device, args.borrowed)
    if args.role == "engine-server":
        return engine_server(args)
    if args.role == "client":
        return trainer_client(args)
    if args.kill:
        return run_kill(args)
    import torch

    import baton

    spec = model_spec(args.model)
    print(json.dumps({
        "bench": "weight_sync", "model": args.model, "tensors": len(spec) - 1,
        "baton_commit": os.environ.get("BATON_COMMIT"),
        "bytes": nbytes(spec), "steps": args.steps, "engine_device": args.engine_device,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    }), flush=True)
    results = {}
    for path in args.paths.split(","):
        if path == "copy":
            for line in run_copy(args, spec):
                results[line["path"]] = line
        elif path in ("baton-bundle", "baton-bundle-ordered"):
            results[path] = run_baton(args, spec, ordered=path.endswith("ordered"))
        elif path in ("baton-borrowed", "baton-push-borrowed", "baton-push"):
            try:
                results[path] = run_baton_push(args, spec, borrowed=path.endswith("borrowed")) \
                    if path.startswith("baton-push") else \
                    run_baton(args, spec, ordered=False, borrowed=True)
            except baton.Message as e:
                # A model whose group does not fit one frame (its layouts travel inline
                # every sync: 20,000 tensors borrowed): a line that says so, not a crash.
                print(json.dumps({"bench": "weight_sync", "path": path, "error": str(e)}),
                      flush=True)
        elif path == "torch-mp-push":
            results[path] = run_torch_push(args, spec)
        elif path in ("torch-mp-flat", "torch-mp-tensors"):
            results[path] = run_torch(args, spec, flat=path == "torch-mp-flat")
        else:
            raise SystemExit(f"unknown path {path}")
        torch.cuda.empty_cache()
    med = {k: v["per_sync_ms_median"] for k, v in results.items()}
    ratios = {}
    for baton_path in ("baton-bundle", "baton-bundle-ordered", "baton-borrowed", "baton-push",
                       "baton-push-borrowed"):
        if baton_path not in med:
            continue
        b = med[baton_path]
        for k, v in med.items():
            if k.startswith("torch"):
                ratios[f"{k} / {baton_path}"] = round(v / b, 2)
            elif k.startswith("copy"):
                ratios[f"{baton_path} / {k}"] = round(b / v, 2)
    print(json.dumps({"bench": "weight_sync", "summary": ratios,
                      "targets": targets(args.model, med, results, args.engine_device)}),
          flush=True)


#: Issue 47's targets, per model: (what, numerator path, denominator path, bound, "<=" or ">=").
TARGETS = {
    "qwen2.5-7b": [("bundle <= 1.1x the flat copy", "baton-bundle", "copy-flat", 1.1, "<="),
                   ("torch flat bucket >= 1.25x the bundle", "torch-mp-flat", "baton-bundle", 1.25, ">=")],
    "qwen2.5-0.5b": [("bundle <= 1.5x the flat copy", "baton-bundle", "copy-flat", 1.5, "<="),
                     ("torch flat bucket >= 2x the bundle", "torch-mp-flat", "baton-bundle", 2.0, ">=")],
    MOE: [("bundle <= 2x the flat copy", "baton-bundle", "copy-flat", 2.0, "<=")],
}
#: For every model: the borrowed path against the bundle, with one lease per sync.
BORROWED = ("borrowed <= 1.2x the bundle", "baton-borrowed", "baton-bundle", 1.2, "<=")
#: The same for an engine that lends its torch tensors where they are (a group).
PUSH_BORROWED = ("push: borrowed <= 1.2x the push", "baton-push-borrowed", "baton-push", 1.2,
                 "<=")
#: Across GPUs, by size: from 1 GiB up, a sync at least 0.95x the speed of a torch
#: peer-to-peer copy of its bytes; at 256 MiB, at most 1.2x its time.
ACROSS_LARGE = ("bundle >= 0.95x the speed of a peer-to-peer copy", "copy-p2p", "baton-bundle",
                0.95, ">=")
ACROSS_SMALL = ("bundle <= 1.2x a peer-to-peer copy", "baton-bundle", "copy-p2p", 1.2, "<=")


def targets(model: str, med: dict, results: dict, engine_device: int = 0) -> dict:
    out = {}
    if engine_device:
        size = nbytes(model_spec(model))
        wanted = [ACROSS_LARGE] if size >= 1 << 30 else [ACROSS_SMALL] \
            if model == "flat-256m" else []
    else:
        wanted = TARGETS.get(model, []) + [BORROWED, PUSH_BORROWED]
    # Each bundle target also for the engine lending its weights (`baton-push`).
    wanted += [(f"push: {what.replace('bundle', 'push')}",
                "baton-push" if num == "baton-bundle" else num,
                "baton-push" if den == "baton-bundle" else den, bound, op)
               for what, num, den, bound, op in wanted if "baton-bundle" in (num, den)
               and "baton-borrowed" not in (num, den)]
    for what, num, den, bound, op in wanted:
        if num not in med or den not in med:
            continue
        ratio = round(med[num] / med[den], 3)
        met = ratio <= bound if op == "<=" else ratio >= bound
        if num in ("baton-borrowed", "baton-push-borrowed"):
            leases = results[num].get("leases_per_sync")
            met = met and leases == 1
            what += f" (leases per sync: {leases})"
        out[what] = {"ratio": ratio, "met": met}
    return out


if __name__ == "__main__":
    main()
