#!/usr/bin/env python3
"""The PyTorch peer of the handoff benchmark (issue 7, item 7).

Passes CUDA tensors through torch.multiprocessing queues in the pattern Baton's benchmark
uses: a producer process sends a tensor, a consumer process receives it (torch opens the
CUDA IPC handle), touches it (takes its device pointer, as a kernel launch would) and drops
it, then acks on a second queue. Prints one JSON line per result, like the Rust benchmark
(`cargo bench --bench handoff -- --torch bench/peers/torch_mp.py` folds them into its
report so the ratio is a same-run ratio).

Variants, all with one tensor of 8 MiB (the size of Baton's item 2 buffer):
- roundtrip/cached ("consumer keeps the tensor"): the consumer holds the first tensor it
  received for the whole run, so torch's receive-side cache (storage_from_cache / the IPC
  handle cache) is hit every time, like Baton's consumer, which holds one lease. This is
  the figure issue 13 compares Baton's stream-ordered round trip with. What it includes,
  as torch implements it (torch/multiprocessing/reductions.py, torch/csrc/CudaIPCTypes.cpp;
  the torch version is printed in the torch_env line):
    * producer, every put: pickling through ForkingPickler; storage._share_cuda_(), which
      makes a CudaIPCSentData for the send: a new interprocess CUDA event
      (cudaEventCreateWithFlags(..., cudaEventInterprocess)) recorded on the producer's
      current stream (cudaEventRecord) and its handle (cudaIpcGetEventHandle) -- torch's
      acquire fence, made every send -- the memory handle, and a slot of its shared-memory
      reference-counter file; the queue's feeder thread and pipe;
    * consumer, every get: unpickling; on the cache hit, no cudaIpcOpenMemHandle and no
      event wait (torch waits on the producer's event only when it opens the handle, the
      miss), but _release_ipc_counter (the producer's counter slot given back), then the
      ack through a second queue;
    * no release fence: torch orders the consumer's work before the producer's reuse by
      the reference counter and its limbo of blocks whose events are not complete, not by
      a stream wait.
  So torch's cached round trip carries one event record per send and no waits; Baton's
  stream-ordered round trip carries an acquire fence, the importer's stream wait, a
  release fence and the exporter's stream wait: the comparison does not favour Baton;
- roundtrip/naive: the consumer holds nothing between messages (the usual way to write it):
  every receive opens the handle again and every drop closes it;
- pipelined: at most 256 tensors in flight, acks flowing back (the consumer holds the first).

usage: python3 bench/peers/torch_mp.py [--quick] [--device cuda]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

NBYTES = 8 << 20  # as Baton's item 2 buffer (a 1080p RGBA8 frame, rounded up)
WINDOW = 256


def consumer(inbox, acks, device):
    """Receive, touch, drop, ack; 'pin' holds the next tensor; None ends."""
    if device == "cuda":
        torch.cuda.set_device(0)
    pinned = []
    while True:
        item = inbox.get()
        if item is None:
            break
        seq, tensor, keep = item
        # Touch it: the device pointer a kernel would be given (the storage is open).
        _ = tensor.data_ptr()
        if keep:
            pinned.append(tensor)
        del tensor, item
        acks.put(seq)
    pinned.clear()


def percentile(sorted_values, q):
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 1))))
    return sorted_values[rank - 1]


def summary(ns):
    us = sorted(v / 1e3 for v in ns)
    return {
        "n": len(us),
        "min_us": round(us[0], 3),
        "p50_us": round(percentile(us, 0.50), 3),
        "p90_us": round(percentile(us, 0.90), 3),
        "p99_us": round(percentile(us, 0.99), 3),
        "max_us": round(us[-1], 3),
        "mean_us": round(statistics.fmean(us), 3),
    }


def emit(record):
    record.setdefault("bench", "torch_mp")
    record.setdefault("backend", "torch")
    print(json.dumps(record), flush=True)


def roundtrips(inbox, acks, tensor, warm, n, seq0):
    samples = []
    for i in range(warm + n):
        seq = seq0 + i
        t0 = time.perf_counter_ns()
        inbox.put((seq, tensor, False))
        got = acks.get()
        t1 = time.perf_counter_ns()
        if got != seq:
            raise RuntimeError(f"ack {got} for {seq}")
        if i >= warm:
            samples.append(t1 - t0)
    return samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    scale = 10 if args.quick else 1
    device = args.device

    mp.set_start_method("spawn")
    emit({
        "item": 0, "name": "torch_env", "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
    })

    inbox, acks = mp.Queue(), mp.Queue()
    proc = mp.Process(target=consumer, args=(inbox, acks, device), daemon=True)
    proc.start()
    try:
        x = torch.full((NBYTES,), 7, dtype=torch.uint8, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        seq = 1

        # Naive first (the consumer holds nothing yet).
        n = 3000 // scale
        s = roundtrips(inbox, acks, x, 200 // scale, n, seq)
        seq += 200 // scale + n
        emit({"item": 7, "name": "torch_roundtrip", "variant": "naive", "bytes": NBYTES,
              "label": "torch.multiprocessing round trip, consumer keeps nothing (reopens)",
              **summary(s)})

        # The consumer pins the tensor: later receives hit torch's cache.
        inbox.put((seq, x, True))
        assert acks.get() == seq
        seq += 1
        n = 5000 // scale
        s = roundtrips(inbox, acks, x, 300 // scale, n, seq)
        seq += 300 // scale + n
        emit({"item": 7, "name": "torch_roundtrip", "variant": "cached", "bytes": NBYTES,
              "label": "torch.multiprocessing round trip, consumer keeps the tensor (cache hit; an IPC event per send)",
              **summary(s)})

        # Pipelined, WINDOW in flight.
        n = 20000 // scale
        for timed in (False, True):
            count = n if timed else n // 10
            t0 = time.perf_counter_ns()
            sent = done = 0
            while done < count:
                while sent < count and sent - done < WINDOW:
                    inbox.put((seq + sent, x, False))
                    sent += 1
                acks.get()
                done += 1
            secs = (time.perf_counter_ns() - t0) / 1e9
            seq += count
        emit({"item": 7, "name": "torch_pipelined", "variant": "cached", "window": WINDOW,
              "n": n, "per_s": n / secs, "seconds": secs, "bytes": NBYTES,
              "label": f"torch.multiprocessing pipelined, {WINDOW} in flight, acks back"})
    finally:
        inbox.put(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip interpreter teardown: with CUDA IPC state alive it has crashed (SIGSEGV) after
    # all results were printed.
    os._exit(code)
