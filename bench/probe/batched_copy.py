#!/usr/bin/env python3
"""How to copy many tensors out of one buffer fastest: the candidates for a bundle's
`copy_into`, measured on the same layouts in one process, against one flat copy of the
same bytes.

- `flat`: one `cuMemcpyDtoDAsync` of every byte (the floor);
- `torch-loader`: what `BundleLease.copy_into` did before the batched copy: a torch
  `copy_` per tensor of 1 MiB or more, one `_foreach_copy_` of 8-byte words for the rest;
- `driver-loop`: one `cuMemcpyDtoDAsync_v2` per tensor (issued through ctypes here, so its
  host time is an upper bound of a Rust loop's);
- `batch`: one `cuMemcpyBatchAsync` (CUDA 12.8+; `_v2`, without `failIdx`, from 13.0);
- `kernel`: one gather kernel (CuPy `RawKernel`): each block copies 16-byte words of one
  chunk of one tensor;
- `baton-ptx`: Baton's own kernel (`ipc/src/cuda/kernels/gather.ptx`, loaded as the PTX it
  ships), both directions (`baton-ptx-from`: the tensors into the buffer).

Layouts: the Qwen2.5-0.5B and -7B weight shapes of `bench/weight_sync.py`, and a synthetic
mixture-of-experts shard of 20,000 tensors, 7.6 GB. Each line: host time to queue the
copies and the time to the copies done (median of `--reps`, after a warm-up), in ms.

usage: python3 bench/probe/batched_copy.py [--reps N]     (needs torch, cupy and a GPU)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

cuda = ctypes.CDLL("libcuda.so.1")
u64 = ctypes.c_uint64


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Attrs(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", Loc), ("dstLocHint", Loc),
                ("flags", ctypes.c_uint)]


KERNEL = r"""
extern "C" __global__ void gather(const unsigned char* src, const unsigned long long* dst,
                                  const unsigned long long* off, const unsigned long long* len,
                                  const unsigned int* chunk_copy, const unsigned long long* chunk_at,
                                  unsigned long long chunk) {
    unsigned int c = blockIdx.x;
    unsigned int i = chunk_copy[c];
    unsigned long long at = chunk_at[c];
    unsigned long long n = len[i] - at < chunk ? len[i] - at : chunk;
    const unsigned char* s = src + off[i] + at;
    unsigned char* d = (unsigned char*)dst[i] + at;
    if ((((unsigned long long)s | (unsigned long long)d | n) & 15) == 0) {
        const uint4* s4 = (const uint4*)s; uint4* d4 = (uint4*)d;
        for (unsigned long long k = threadIdx.x; k < n / 16; k += blockDim.x) d4[k] = s4[k];
    } else {
        for (unsigned long long k = threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
    }
}
"""


def moe_spec(n=20000, total=7.6e9):
    each = int(total / n) // 256 * 256 // 2  # bf16 elements
    return [(f"expert.{i}", (each,), "bfloat16") for i in range(n)]


def main() -> None:
    import cupy
    import torch

    import weight_sync as ws

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layouts", default="qwen2.5-0.5b,qwen2.5-7b,moe-20000")
    args = ap.parse_args()
    torch.cuda.init()
    stream = torch.cuda.Stream()
    handle = ctypes.c_void_p(stream.cuda_stream)
    batch = getattr(cuda, "cuMemcpyBatchAsync_v2", None)
    batch_v1 = getattr(cuda, "cuMemcpyBatchAsync", None)
    drv = ctypes.c_int()
    cuda.cuDriverGetVersion(ctypes.byref(drv))
    print(json.dumps({"probe": "batched_copy", "device": torch.cuda.get_device_name(),
                      "driver": drv.value, "batch_v2": batch is not None,
                      "batch_v1": batch_v1 is not None, "torch": torch.__version__}), flush=True)
    kernel = cupy.RawKernel(KERNEL, "gather")
    ptx = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "ipc", "src",
                       "cuda", "kernels", "gather.ptx")
    module = cupy.RawModule(path=ptx)
    for name in args.layouts.split(","):
        spec = moe_spec() if name == "moe-20000" else ws.model_spec(name)
        layout, total = ws.flat_layout(spec)
        src = torch.randint(0, 255, (total,), dtype=torch.uint8, device="cuda")
        params = ws.params_like(torch, spec)
        dst_bytes = [p.view(-1).view(torch.uint8) for p in params.values()]
        src_bytes = [src[at:at + n] for _, _, _, at, n in layout]
        flat_dst = torch.empty_like(src)
        n = len(layout)
        dsts = (u64 * n)(*[d.data_ptr() for d in dst_bytes])
        srcs = (u64 * n)(*[s.data_ptr() for s in src_bytes])
        sizes = (ctypes.c_size_t * n)(*[x[4] for x in layout])
        attrs = Attrs(1, Loc(1, 0), Loc(1, 0), 0)  # stream order, device 0 both sides
        idx = (ctypes.c_size_t * 1)(0)
        fail = ctypes.c_size_t()
        chunk = 1 << 16
        cc, ca = [], []
        for i, (_, _, _, at, ln) in enumerate(layout):
            for k in range(0, ln, chunk):
                cc.append(i)
                ca.append(k)
        k_dst = cupy.asarray([d.data_ptr() for d in dst_bytes], dtype=cupy.uint64)
        k_off = cupy.asarray([x[3] for x in layout], dtype=cupy.uint64)
        k_len = cupy.asarray([x[4] for x in layout], dtype=cupy.uint64)
        k_cc = cupy.asarray(cc, dtype=cupy.uint32)
        k_ca = cupy.asarray(ca, dtype=cupy.uint64)
        k_src = cupy.from_dlpack(src)

        def flat():
            rc = cuda.cuMemcpyDtoDAsync_v2(u64(flat_dst.data_ptr()), u64(src.data_ptr()),
                                           ctypes.c_size_t(total), handle)
            assert rc == 0, rc

        def loader():
            with torch.cuda.stream(stream):
                ws.load(dst_bytes, src_bytes)

        def loop():
            f = cuda.cuMemcpyDtoDAsync_v2
            for i in range(n):
                rc = f(u64(dsts[i]), u64(srcs[i]), ctypes.c_size_t(sizes[i]), handle)
                assert rc == 0, rc

        def batched():
            if batch is not None:
                rc = batch(dsts, srcs, sizes, ctypes.c_size_t(n), ctypes.byref(attrs), idx,
                           ctypes.c_size_t(1), handle)
            else:
                rc = batch_v1(dsts, srcs, sizes, ctypes.c_size_t(n), ctypes.byref(attrs), idx,
                              ctypes.c_size_t(1), ctypes.byref(fail), handle)
            assert rc == 0, rc

        def gather():
            with cupy.cuda.ExternalStream(stream.cuda_stream):
                kernel((len(cc),), (256,), (k_src, k_dst, k_off, k_len, k_cc, k_ca,
                                            cupy.uint64(chunk)))

        spans = []
        first = 0
        for d, (_, _, _, at, ln) in zip(dst_bytes, layout):
            spans += [d.data_ptr(), at, ln, first]
            first += (ln + chunk - 1) // chunk
        b_spans = cupy.asarray(spans, dtype=cupy.uint64)
        b_fn = module.get_function("baton_gather")

        def baton_ptx(into=1):
            with cupy.cuda.ExternalStream(stream.cuda_stream):
                b_fn((first,), (256,), (cupy.uint64(src.data_ptr()), b_spans, cupy.uint32(n),
                                        cupy.uint64(chunk), cupy.int32(into)))

        ways = {"flat": flat, "torch-loader": loader, "driver-loop": loop, "kernel": gather,
                "baton-ptx": baton_ptx, "baton-ptx-from": lambda: baton_ptx(0)}
        if batch is not None or batch_v1 is not None:
            ways["batch"] = batched
        for way, fn in ways.items():
            for p in params.values():
                p.zero_()
            queue, done = [], []
            for rep in range(args.reps + 2):
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                stream.synchronize()
                t2 = time.perf_counter()
                if rep >= 2:
                    queue.append(t1 - t)
                    done.append(t2 - t)
            # (`baton-ptx-from`, last, copied the zeroed tensors over the random buffer.)
            ok = way == "flat" or all(torch.equal(d, s) for d, s in zip(dst_bytes, src_bytes))
            print(json.dumps({"layout": name, "tensors": n, "bytes": total, "way": way,
                              "queue_ms": round(statistics.median(queue) * 1e3, 3),
                              "done_ms": round(statistics.median(done) * 1e3, 3),
                              "correct": ok}), flush=True)
        del src, params, dst_bytes, src_bytes, flat_dst, k_src
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
