#!/usr/bin/env python3
"""Poor man's stacks for a stopped process (no gdb needed): for each thread of PID, its state and the
words on its stack that point into the executable's text, as file offsets; bench/stacksym.py names
them. Usage: stackscan.py PID [BYTES]. A heuristic: stale return addresses appear too; the
top frames are the live ones."""
import os, sys, struct
pid = int(sys.argv[1]); depth = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
exe = os.readlink(f"/proc/{pid}/exe")
maps = []
for line in open(f"/proc/{pid}/maps"):
    parts = line.split()
    lo, hi = (int(x, 16) for x in parts[0].split("-"))
    maps.append((lo, hi, parts[1], int(parts[2], 16), parts[5] if len(parts) > 5 else ""))
text = [(lo, hi, off) for lo, hi, perm, off, path in maps if path == exe and "x" in perm]
mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
print(f"=== pid {pid} exe {exe}")
for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
    t = f"/proc/{pid}/task/{tid}"
    comm = open(f"{t}/comm").read().strip()
    try:
        sc = open(f"{t}/syscall").read().split()
    except Exception as e:
        sc = [str(e)]
    wchan = open(f"{t}/wchan").read().strip()
    print(f"--- tid {tid} {comm} wchan={wchan} syscall={sc[0]}")
    if len(sc) < 3 or sc[0] == "running":
        continue
    sp = int(sc[-2], 16); pc = int(sc[-1], 16)
    # the stack mapping holding sp
    end = next((hi for lo, hi, *_ in maps if lo <= sp < hi), sp + depth)
    n = min(depth, end - sp)
    try:
        mem.seek(sp); data = mem.read(n)
    except Exception as e:
        print("  read failed", e); continue
    out = []
    for i in range(0, len(data) - 7, 8):
        (w,) = struct.unpack_from("<Q", data, i)
        for lo, hi, off in text:
            if lo <= w < hi:
                out.append(w - lo + off)
    print("  " + " ".join(hex(x) for x in out[:400]))
