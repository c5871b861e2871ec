#!/usr/bin/env python3
"""What waking a sleeping thread of another process costs after an idle gap, with nothing
of Baton in the way: two processes ping-pong 64 bytes over a Unix socket pair, the
initiator idle `--gap-ms` between round trips (a trainer's step between syncs). Three ways:

- `blocking`: both sides sleep in `recv` (the socket floor, and what a thread of any IPC
  library does while it waits: Baton's, `torch.multiprocessing`'s);
- `polling`: both sides poll the socket without sleeping (`MSG_DONTWAIT` in a loop): no
  thread ever sleeps, so no wake-up is paid — at the price of two cores kept busy;
- `blocking+spinners`: blocking, with one lowest-priority (`SCHED_IDLE`) busy process per
  CPU beside, so that no CPU ever goes idle (on a VM: no vCPU halts) while the sleeping
  threads still sleep.

Prints one JSON line per (way, gap): the median and p90 round trip in microseconds over
`--calls` round trips (after 20).

`--spin-while CMD ...` instead runs CMD with the spinners of `blocking+spinners` beside it
(what a whole benchmark gains when no CPU goes idle), and exits with its status.

usage: python3 bench/probe/wake_floor.py [--gap-ms 0,0.5,2,10] [--calls 300] [--ways ...]
       python3 bench/probe/wake_floor.py --spin-while CMD [ARGS ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MSG = b"x" * 64


def recv_exact(sock: socket.socket, poll: bool) -> None:
    got = 0
    while got < len(MSG):
        try:
            chunk = sock.recv(len(MSG) - got, socket.MSG_DONTWAIT if poll else 0)
        except BlockingIOError:
            continue
        if not chunk:
            raise EOFError
        got += len(chunk)


def responder(sock: socket.socket, poll: bool) -> None:
    try:
        while True:
            recv_exact(sock, poll)
            sock.sendall(MSG)
    except (EOFError, ConnectionError):
        os._exit(0)


def spinner(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def start_spinners() -> list:
    spinners = []
    for cpu in sorted(os.sched_getaffinity(0)):
        pid = os.fork()
        if pid == 0:
            spinner(cpu)
        spinners.append(pid)
    return spinners


def stop_spinners(spinners: list) -> None:
    for s in spinners:
        os.kill(s, 9)
        os.waitpid(s, 0)


def run(way: str, gap_s: float, calls: int) -> dict:
    poll = way == "polling"
    spinners = start_spinners() if way == "blocking+spinners" else []
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        responder(b, poll)
    b.close()
    times = []
    try:
        for i in range(calls + 20):
            if gap_s:
                end = time.perf_counter() + gap_s
                time.sleep(gap_s)
                while time.perf_counter() < end:
                    pass
            t = time.perf_counter()
            a.sendall(MSG)
            recv_exact(a, poll)
            if i >= 20:
                times.append(time.perf_counter() - t)
    finally:
        a.close()
        os.waitpid(pid, 0)
        stop_spinners(spinners)
    times.sort()
    return {"probe": "wake_floor", "way": way, "gap_ms": gap_s * 1e3, "calls": calls,
            "rtt_us_median": round(statistics.median(times) * 1e6, 1),
            "rtt_us_p90": round(times[int(len(times) * 0.9)] * 1e6, 1)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--spin-while":
        spinners = start_spinners()
        try:
            sys.exit(subprocess.call(sys.argv[2:]))
        finally:
            stop_spinners(spinners)
    ap = argparse.ArgumentParser()
    ap.add_argument("--gap-ms", default="0,0.5,2,10")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--ways", default="blocking,polling,blocking+spinners")
    args = ap.parse_args()
    print(json.dumps({"probe": "wake_floor", "cpus": len(os.sched_getaffinity(0)),
                      "kernel": os.uname().release}), flush=True)
    for gap in map(float, args.gap_ms.split(",")):
        for way in args.ways.split(","):
            print(json.dumps(run(way, gap / 1e3, args.calls)), flush=True)


if __name__ == "__main__":
    main()
