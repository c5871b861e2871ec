#!/usr/bin/env python3
"""Symbolise scan.py's file offsets with nm of the same binary: stacksym.py BIN < stacks (from bench/stackscan.py)"""
import sys, subprocess, bisect, re
bin_ = sys.argv[1]
ph = subprocess.run(["readelf", "-lW", bin_], capture_output=True, text=True).stdout
loads = []
for line in ph.splitlines():
    p = line.split()
    if p and p[0] == "LOAD":
        off, va, fs = int(p[1], 16), int(p[2], 16), int(p[4], 16)
        loads.append((off, va, fs))
syms = []
for line in subprocess.run(["nm", "-C", "-n", "--defined-only", bin_], capture_output=True, text=True).stdout.splitlines():
    p = line.split(" ", 2)
    if len(p) == 3 and p[1] in "tTwW":
        syms.append((int(p[0], 16), p[2]))
addrs = [a for a, _ in syms]
def name(off):
    for o, va, fs in loads:
        if o <= off < o + fs:
            v = off - o + va
            i = bisect.bisect_right(addrs, v) - 1
            return syms[i][1] if i >= 0 else "?"
    return "?"
skip = re.compile(r"^(core::|std::rt|__rust|std::sys::backtrace)")
for line in sys.stdin:
    if line.startswith("  0x"):
        last = None
        for w in line.split():
            n = name(int(w, 16))
            n = re.sub(r"::h[0-9a-f]{16}$", "", n)
            if n != last:
                print("    " + n[:200])
            last = n
    else:
        print(line.rstrip())
