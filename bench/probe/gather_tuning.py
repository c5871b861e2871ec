#!/usr/bin/env python3
"""Tuning Baton's gather kernel (`ipc/src/cuda/kernels/gather.cu`): the PTX Baton ships and
the kernel's source as it is in the tree (compiled here by NVRTC through CuPy), each at
several chunk sizes and block sizes, timed against one flat `cudaMemcpy` of the same bytes,
on the weight-sync layouts (Qwen2.5-0.5B, -7B, a 20,000-tensor shard). Prints one JSON line
per (layout, kernel, chunk, threads): the median time of `--reps` runs after two, its ratio
to the flat copy measured just before, and whether every tensor arrived.

`--variants` adds the entry points of `gather_variants.cu` beside this file (more loads in
flight per thread, cache hints), each under its own name; `--chunks` and `--threads` pick
the grid shapes tried.

usage: python3 bench/probe/gather_tuning.py [--reps N] [--layouts ...] [--variants]
       [--chunks 65536,...] [--threads 256,...]   (torch, CuPy, a GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
KERNELS = os.path.join(HERE, "..", "..", "ipc", "src", "cuda", "kernels")


def main() -> None:
    import cupy
    import torch

    import weight_sync as ws
    from batched_copy import moe_spec

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layouts", default="qwen2.5-0.5b,qwen2.5-7b,moe-20000")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--chunks", default="65536,131072,262144")
    ap.add_argument("--threads", default="256,512,1024")
    args = ap.parse_args()
    torch.cuda.init()
    stream = torch.cuda.Stream()
    kernels = {
        "shipped-ptx": cupy.RawModule(path=os.path.join(KERNELS, "gather.ptx"))
        .get_function("baton_gather"),
        "tree-source": cupy.RawModule(code=open(os.path.join(KERNELS, "gather.cu")).read())
        .get_function("baton_gather"),
    }
    if args.variants:
        variants = cupy.RawModule(code=open(os.path.join(HERE, "gather_variants.cu")).read())
        for v in ("u1", "u2", "u4", "u8", "u4cs", "u8cs"):
            kernels[v] = variants.get_function("baton_gather_" + v)
    print(json.dumps({"probe": "gather_tuning", "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__}), flush=True)
    for name in args.layouts.split(","):
        spec = moe_spec() if name == "moe-20000" else ws.model_spec(name)
        layout, total = ws.flat_layout(spec)
        src = torch.randint(0, 255, (total,), dtype=torch.uint8, device="cuda")
        flat_dst = torch.empty_like(src)
        params = ws.params_like(torch, spec)
        dst_bytes = [p.view(-1).view(torch.uint8) for p in params.values()]
        src_bytes = [src[at:at + n] for _, _, _, at, n in layout]

        def timed(fn) -> float:
            times = []
            for rep in range(args.reps + 2):
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                stream.synchronize()
                if rep >= 2:
                    times.append(time.perf_counter() - t)
            return statistics.median(times)

        def flat():
            with torch.cuda.stream(stream):
                flat_dst.copy_(src)

        for kname, fn in kernels.items():
            for chunk in map(int, args.chunks.split(",")):
                spans, first = [], 0
                for d, (_, _, _, at, ln) in zip(dst_bytes, layout):
                    spans += [d.data_ptr(), at, ln, first]
                    first += (ln + chunk - 1) // chunk
                table = cupy.asarray(spans, dtype=cupy.uint64)
                for threads in map(int, args.threads.split(",")):
                    def run(chunk=chunk, threads=threads, first=first, table=table):
                        with cupy.cuda.ExternalStream(stream.cuda_stream):
                            fn((first,), (threads,), (cupy.uint64(src.data_ptr()), table,
                                                      cupy.uint32(len(layout)),
                                                      cupy.uint64(chunk), cupy.int32(1)))
                    for p in params.values():
                        p.zero_()
                    floor = timed(flat)
                    took = timed(run)
                    ok = all(torch.equal(d, s) for d, s in zip(dst_bytes, src_bytes))
                    print(json.dumps({"layout": name, "kernel": kname, "chunk": chunk,
                                      "threads": threads, "ms": round(took * 1e3, 3),
                                      "flat_ms": round(floor * 1e3, 3),
                                      "ratio": round(took / floor, 4), "correct": ok}),
                          flush=True)
        del src, flat_dst, params, dst_bytes, src_bytes
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
