"""Does a cuStreamWaitValue64 that never lands block other streams of the context?

And can a wait on host-registered memory be released by a plain CPU store? A probe of the
driver's behaviour behind Baton's fence inbox (docs/ORDERING.md), run on a GPU machine:
`python3 bench/probe/wait_value_probe.py`. Prints one line per finding.
"""
import ctypes, mmap, time, sys

cu = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0:
        raise SystemExit(f"{what} failed: {r}")
u64 = ctypes.c_uint64
ck(cu.cuInit(0), "cuInit")
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ck(cu.cuCtxSetCurrent(ctx), "setcurrent")

def stream():
    s = ctypes.c_void_p(); ck(cu.cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate"); return s
def ready(s):
    r = cu.cuStreamQuery(s)
    if r not in (0, 600): raise SystemExit(f"cuStreamQuery {r}")
    return r == 0
def wait_ready(s, secs):
    end = time.time() + secs
    while time.time() < end:
        if ready(s): return True
        time.sleep(0.005)
    return ready(s)

N = int(sys.argv[1]) if len(sys.argv) > 1 else 24
d = u64(); ck(cu.cuMemAlloc_v2(ctypes.byref(d), 4096), "cuMemAlloc")
ck(cu.cuMemsetD8_v2(d, 0, 4096), "memset")
# 1. device word: one stream waits for a value never written; N others each memset a
#    different word; which of them finish?
sa = stream()
ck(cu.cuStreamWaitValue64_v2(sa, d, u64(1), 0), "wait")
others = [stream() for _ in range(N)]
for i, s in enumerate(others):
    ck(cu.cuMemsetD8Async(u64(d.value + 64 + 8 * i), 0xFF, 8, s), "memsetAsync")
time.sleep(0.5)
blocked = [i for i, s in enumerate(others) if not ready(s)]
print(f"device word: {len(blocked)} of {N} other streams blocked behind one unsatisfied wait: {blocked}")
# the release: memset the awaited word on each other stream in turn until the wait passes
released_by = None
for i, s in enumerate(others):
    if ready(s):
        ck(cu.cuMemsetD8Async(d, 0xFF, 8, s), "release")
        if wait_ready(sa, 1.0):
            released_by = i
            break
print(f"device word: wait released by a memset on an unblocked stream: {released_by is not None} (stream {released_by})")
for s in others:
    wait_ready(s, 2.0)
# 2. host-registered word: released by a CPU store?
buf = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
ck(cu.cuMemHostRegister_v2(ctypes.c_void_p(addr), 4096, 0x01 | 0x02), "cuMemHostRegister")
dp = u64(); ck(cu.cuMemHostGetDevicePointer_v2(ctypes.byref(dp), ctypes.c_void_p(addr), 0), "devptr")
sb = stream()
ck(cu.cuStreamWaitValue64_v2(sb, dp, u64(7), 0), "wait host")
time.sleep(0.2)
print(f"host word: waiting before the store: {not ready(sb)}")
blocked2 = [i for i, s in enumerate(others) if (cu.cuMemsetD8Async(u64(d.value + 64 + 8 * i), 0, 8, s) or True) and not wait_ready(s, 0.2)]
print(f"host word: other streams blocked behind it: {blocked2}")
ctypes.c_uint64.from_buffer(buf, 0).value = 7
print(f"host word: released by a CPU store: {wait_ready(sb, 2.0)}")
# 3. a GPU write into the host word from another stream (the producer's side)
sc = stream()
ck(cu.cuStreamWaitValue64_v2(sc, u64(dp.value + 8), u64(3), 0), "wait host 2")
sw = stream()
ck(cu.cuStreamWriteValue64_v2(sw, u64(dp.value + 8), u64(3), 0), "write host")
print(f"host word: released by a stream write: {wait_ready(sc, 2.0)}; CPU sees {ctypes.c_uint64.from_buffer(buf, 8).value}")
