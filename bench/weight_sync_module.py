#!/usr/bin/env python3
"""Weight sync of a real `torch.nn.Module` while it trains (issue 47, item 4): a
`transformers` `Qwen2ForCausalLM` built from Qwen2.5-0.5B's config with random weights (no
download), bf16, trained with AdamW on random tokens; after every optimizer step its weights
go to an engine process that holds the same model and loads them into its own parameters.

- `baton-module`: the trainer's parameters live in a Baton bundle (`baton.bundle_parameters`,
  once), so the optimizer writes the bundle and a sync has no trainer-side copy; the engine
  loads with a `baton.CopyPlan` into `model.named_parameters()`;
- `torch-mp-flat`: what a torch user does without Baton: each sync copies the parameters
  into one flat bucket (`_foreach_copy_` of their bytes) and sends it through
  torch.multiprocessing; the engine loads by hand (a `copy_` per tensor of 1 MiB or more,
  one fused copy of the rest), as `bench/weight_sync.py`'s torch engines do;
- `copy-flat`: the floor, one device copy of the same bytes in one process.

A sync is timed from after the optimizer step (synchronised) to the weights being the
trainer's again; the engine checks exact values of a weight it loaded against the trainer's.
Prints one JSON line per path and a summary line.

usage: python3 bench/weight_sync_module.py [--steps N]      (needs torch, transformers, a GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build_model(torch):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    return model


def probe(model) -> list:
    """A few exact values of one weight, to check a load."""
    return model.model.layers[0].mlp.up_proj.weight[0, :8].float().tolist()


def train_step(torch, model, opt) -> float:
    ids = torch.randint(0, 151936, (4, 128), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def trained(torch, model, opt, step_s: list, losses: list) -> list:
    """One optimizer step, timed apart from the sync; the probe of the weights it made."""
    t = time.perf_counter()
    losses.append(train_step(torch, model, opt))
    torch.cuda.synchronize()
    step_s.append(time.perf_counter() - t)
    return probe(model)


def baton_engine() -> None:
    import torch

    import baton

    model = build_model(torch)
    params = dict(model.named_parameters())
    node = baton.Node()
    mailbox = node.register("engine", "rl.Module")
    node.connect_parent()
    plan = None
    while True:
        try:
            call = mailbox.recv(timeout=120)
        except baton.LinkClosed:
            return
        with call.message["weights"].open() as weights:
            if plan is None or plan.layout != weights.layout:
                plan = baton.CopyPlan(weights.layout, params)
            weights.copy_into(plan)
        torch.cuda.current_stream().synchronize()
        call.reply({"ok": probe(model) == call.message["probe"]})


def run_baton(args) -> dict:
    import torch

    import baton

    model = build_model(torch)
    node = baton.Node(token=baton.generate_token(), backend="cuda")
    bundle = baton.bundle_parameters(node, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    child = node.spawn([sys.executable, os.path.abspath(__file__), "--role", "engine"], timeout=120)
    times, step_s, losses = [], [], []
    for step in range(args.steps):
        want = trained(torch, model, opt, step_s, losses)
        t = time.perf_counter()
        reply = child.peer.call("engine", "rl.Module", {"weights": bundle, "probe": want},
                                timeout=120)
        bundle.returned(timeout=120)
        times.append(time.perf_counter() - t)
        assert reply["ok"], step
    child.peer.close()
    child.wait(timeout=60)
    out = line("baton-module", times, step_s, losses, bundle_tensors=len(bundle.layout),
               bundle_bytes=bundle.layout.nbytes)
    del opt, model
    node.close()
    return out


def torch_engine(inbox, outbox) -> None:
    import torch

    from weight_sync import load

    model = build_model(torch)
    dst = [p.view(-1).view(torch.uint8) for p in model.parameters()]
    sizes = [d.numel() for d in dst]
    while True:
        item = inbox.get()
        if item is None:
            return
        bucket, want = item
        load(dst, list(bucket.split(sizes)))
        del bucket, item
        torch.cuda.current_stream().synchronize()
        outbox.put(probe(model) == want)


def run_torch(args) -> dict:
    import torch
    import torch.multiprocessing as mp

    model = build_model(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = [p.view(-1).view(torch.uint8) for p in model.parameters()]
    bucket = torch.empty(sum(p.numel() for p in params), dtype=torch.uint8, device="cuda")
    slots = list(bucket.split([p.numel() for p in params]))
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=torch_engine, args=(inbox, outbox))
    proc.start()
    times, step_s, losses = [], [], []
    for step in range(args.steps):
        want = trained(torch, model, opt, step_s, losses)
        t = time.perf_counter()
        torch._foreach_copy_(slots, params)  # the trainer-side copy into the bucket
        torch.cuda.synchronize()
        inbox.put((bucket, want))
        ok = outbox.get(timeout=300)
        times.append(time.perf_counter() - t)
        assert ok, step
    inbox.put(None)
    proc.join(60)
    return line("torch-mp-flat", times, step_s, losses, bucket_bytes=bucket.numel())


def run_floor(args) -> dict:
    import torch

    model = build_model(torch)
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return line("copy-flat", times, [], [], bytes=n)


def line(path: str, times: list, step_s: list, losses: list, **extra) -> dict:
    rest = sorted(times[1:]) or times
    out = {"bench": "weight_sync_module", "path": path,
           "per_sync_ms_median": round(statistics.median(rest) * 1e3, 3),
           "first_sync_ms": round(times[0] * 1e3, 3), "steps": len(times), **extra}
    if step_s:
        out["train_step_ms_median"] = round(statistics.median(step_s) * 1e3, 2)
        out["loss_first_last"] = [round(losses[0], 3), round(losses[-1], 3)]
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--role", default="trainer", choices=["trainer", "engine"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "engine":
        return baton_engine()
    import torch
    import transformers

    print(json.dumps({"bench": "weight_sync_module", "model": "Qwen2ForCausalLM (Qwen2.5-0.5B config)",
                      "steps": args.steps, "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "transformers": transformers.__version__}), flush=True)
    res = {}
    for run in (run_floor, run_baton, run_torch):
        out = run(args)
        res[out["path"]] = out["per_sync_ms_median"]
        torch.cuda.empty_cache()
    print(json.dumps({"bench": "weight_sync_module", "summary": {
        "baton-module / copy-flat": round(res["baton-module"] / res["copy-flat"], 2),
        "torch-mp-flat / baton-module": round(res["torch-mp-flat"] / res["baton-module"], 2),
    }}), flush=True)


if __name__ == "__main__":
    main()
