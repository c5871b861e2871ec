"""PyTorch's NCCL send/recv between two processes, one GPU each, as between two hosts.

The baseline of `bench/cross_host_nccl.sh` (issue 27): the same sizes Baton copies across
emulated hosts, moved by `torch.distributed` over NCCL with the same environment (the
caller sets NCCL_NET=Socket, NCCL_SOCKET_IFNAME, P2P and SHM off); each rank gets its own
NCCL_HOSTID, so NCCL sees two hosts. One round: rank 0 sends the buffer and waits for a
one-byte answer from rank 1 (as Baton's round waits for the reply and the lease's return).
Prints one JSON line per size: {"item": "torch_nccl", "bytes", "reps", "median_s", "gbps"}.

usage: python3 torch_nccl_sendrecv.py --sizes 1,4096,... --reps 9 [--port 29533]
       [--rank R --master ADDR]   one rank only (the other started apart, e.g. in another
                                  network namespace), rendezvous at ADDR:port
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, sizes, reps, port, master="127.0.0.1"):
    os.environ["NCCL_HOSTID"] = f"torch-host-{rank}"
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=2,
        device_id=torch.device("cuda", rank),
    )
    ack = torch.zeros(1, dtype=torch.uint8, device="cuda")
    for n in sizes:
        buf = torch.full((n,), 5 if rank == 0 else 0, dtype=torch.uint8, device="cuda")
        times = []
        for rep in range(reps + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(ack, 1)
            else:
                dist.recv(buf, 0)
                dist.send(ack, 0)
            torch.cuda.synchronize()
            if rep > 0:
                times.append(time.perf_counter() - start)
        if rank == 1:
            assert int(buf[-1].item()) == 5, "the bytes did not land"
        if rank == 0:
            median = statistics.median(times)
            print(
                json.dumps(
                    {
                        "item": "torch_nccl",
                        "bytes": n,
                        "reps": reps,
                        "median_s": round(median, 6),
                        "gbps": round(n / median / 1e9, 3),
                    }
                ),
                flush=True,
            )
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1,4096,1048576,67108864,1073741824")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--rank", type=int)
    p.add_argument("--master", default="127.0.0.1")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.rank is None:
        mp.spawn(worker, args=(sizes, a.reps, a.port, a.master), nprocs=2, join=True)
    else:
        worker(a.rank, sizes, a.reps, a.port, a.master)


if __name__ == "__main__":
    main()
