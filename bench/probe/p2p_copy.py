#!/usr/bin/env python3
"""Issue 47, item 6: the fastest way to move one buffer from GPU 0 to GPU 1 (NVLink), in one
process, for sizes of 256 MiB, 1 GiB and 4 GiB. Candidates, each against torch's own
peer-to-peer copy (`dst.copy_(src)`, the weight-sync benchmark's `copy-p2p` floor):

- `torch-p2p`: `dst.copy_(src)` with dst on GPU 1, src on GPU 0;
- `ce-pull-N` / `ce-push-N`: `cudaMemcpyAsync` of the bytes cut into N pieces, one per stream,
  N = 1, 2, 4, 8 streams of GPU 1 (pull) or of GPU 0 (push): the copy engines, in parallel;
- `kernel-pull` / `kernel-push`: Baton's gather kernel's loop (16-byte words, one 64 KiB chunk
  per block, 512 threads) launched on GPU 1 reading GPU 0 (how `CopyPlan` runs across GPUs
  today) or on GPU 0 writing GPU 1.

Each line: median and best of `--reps` timed runs (after two warm-ups), in ms, and GB/s.

usage: python3 bench/probe/p2p_copy.py [--reps N]     (needs torch, cupy and two GPUs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import cupy as cp
import torch

KERNEL = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                  unsigned long long words, unsigned long long chunk_words) {
    unsigned long long start = (unsigned long long)blockIdx.x * chunk_words;
    unsigned long long end = start + chunk_words;
    if (end > words) end = words;
    for (unsigned long long i = start + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
}
"""


def timed(fn, reps: int) -> list:
    out = []
    for r in range(reps + 2):
        for d in (0, 1):
            torch.cuda.synchronize(d)
        t = time.perf_counter()
        fn()
        for d in (0, 1):
            torch.cuda.synchronize(d)
        if r >= 2:
            out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    for d in (0, 1):
        with cp.cuda.Device(d):
            try:
                cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
            except cp.cuda.runtime.CUDARuntimeError:
                pass
    kernels = {}
    for d in (0, 1):
        with cp.cuda.Device(d):
            kernels[d] = cp.RawKernel(KERNEL, "copy16")
    print(json.dumps({"probe": "p2p_copy", "devices": [torch.cuda.get_device_name(d) for d in (0, 1)],
                      "torch": torch.__version__, "cupy": cp.__version__}), flush=True)
    for size in (256 << 20, 1 << 30, 4 << 30):
        src = torch.empty(size, dtype=torch.uint8, device="cuda:0").random_()
        dst = torch.empty(size, dtype=torch.uint8, device="cuda:1")
        streams = {d: [torch.cuda.Stream(device=d) for _ in range(8)] for d in (0, 1)}
        results = {}

        def torch_p2p():
            with torch.cuda.device(1):
                dst.copy_(src)
        results["torch-p2p"] = timed(torch_p2p, args.reps)
        for n in (1, 2, 4, 8):
            for name, d in (("pull", 1), ("push", 0)):
                def ce(n=n, d=d):
                    piece = -(-size // n)
                    with cp.cuda.Device(d):
                        for i in range(n):
                            a, b = i * piece, min(size, (i + 1) * piece)
                            cp.cuda.runtime.memcpyAsync(
                                dst.data_ptr() + a, src.data_ptr() + a, b - a,
                                cp.cuda.runtime.memcpyDefault, streams[d][i].cuda_stream)
                results[f"ce-{name}-{n}"] = timed(ce, args.reps)
        words = size // 16
        chunk_words = (64 << 10) // 16
        blocks = -(-words // chunk_words)
        for name, d in (("pull", 1), ("push", 0)):
            def kern(d=d):
                with cp.cuda.Device(d):
                    kernels[d]((blocks,), (512,), (cp.uint64(src.data_ptr()), cp.uint64(dst.data_ptr()),
                                                   cp.uint64(words), cp.uint64(chunk_words)),
                               stream=cp.cuda.ExternalStream(streams[d][0].cuda_stream))
            results[f"kernel-{name}"] = timed(kern, args.reps)
        assert torch.equal(src.cpu()[:1 << 20], dst.cpu()[:1 << 20])
        base = statistics.median(results["torch-p2p"])
        for k, v in results.items():
            m = statistics.median(v)
            print(json.dumps({"probe": "p2p_copy", "bytes": size, "path": k,
                              "ms_median": round(m, 3), "ms_best": round(min(v), 3),
                              "gb_s": round(size / m / 1e6, 1),
                              "vs_torch_p2p": round(m / base, 3)}), flush=True)
        del src, dst
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
