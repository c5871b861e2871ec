#!/usr/bin/env bash
# Device memory across two emulated hosts on one two-GPU machine (issue 27): Baton's
# typed-message copies (`baton-host-peer bench`, through the NCCL engine) against
# PyTorch's NCCL send/recv of the same sizes, in the same run, with the same NCCL
# environment: its socket transport over loopback (NCCL_NET=Socket, NCCL_SOCKET_IFNAME=lo,
# peer-to-peer and shared memory off) and a host id per process (BATON_HOST_ID,
# NCCL_HOSTID), so that both sides are "two hosts" to Baton and to NCCL alike.
#
# usage: bash bench/cross_host_nccl.sh PEER OUTDIR [SIZES] [REPS]
#   PEER: the baton-host-peer executable; OUTDIR: where the JSON lines and NCCL's logs go.
# Prints baton.jsonl, torch.jsonl, one summary line per size (the ratio), and the
# transport lines of NCCL's log ("via NET/Socket").
set -euo pipefail
peer=$1
out=$2
sizes=${3:-1,4096,1048576,67108864,268435456,1073741824}
reps=${4:-9}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
BATON_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
export BATON_TOKEN
export NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET

BATON_HOST_ID=a BATON_CUDA_DEVICE=0 NCCL_HOSTID=baton-a NCCL_DEBUG_FILE="$out/nccl.baton-a.%p.log" \
  timeout 600 "$peer" listen 127.0.0.1:0 --cuda > "$out/listen.out" 2> "$out/listen.err" &
listener=$!
at=""
for _ in $(seq 1 200); do
  at=$(sed -n 's/^listening //p' "$out/listen.out")
  [ -n "$at" ] && break
  sleep 0.05
done
[ -n "$at" ] || { echo "the listener did not listen" >&2; cat "$out/listen.err" >&2; exit 1; }
BATON_HOST_ID=b BATON_CUDA_DEVICE=1 NCCL_HOSTID=baton-b NCCL_DEBUG_FILE="$out/nccl.baton-b.%p.log" \
  timeout 600 "$peer" bench "$at" --cuda --sizes "$sizes" --reps "$reps" 2> "$out/bench.err" \
  | grep '^{' | tee "$out/baton.jsonl"
wait "$listener"

NCCL_DEBUG_FILE="$out/nccl.torch.%p.log" timeout 600 \
  python3 "$here/peers/torch_nccl_sendrecv.py" --sizes "$sizes" --reps "$reps" | tee "$out/torch.jsonl"

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
load = lambda f: {j["bytes"]: j for j in map(json.loads, open(f"{out}/{f}"))}
b, t = load("baton.jsonl"), load("torch.jsonl")
for n in sorted(b):
    if n in t:
        print(json.dumps({"item": "ratio", "bytes": n, "baton_gbps": b[n]["gbps"],
                          "torch_gbps": t[n]["gbps"],
                          "baton_over_torch_time": round(b[n]["median_s"] / t[n]["median_s"], 3)}))
PY
echo "NCCL transports:"
grep -h " via " "$out"/nccl.*.log | sed 's/^.*NCCL INFO //' | sort | uniq -c | head -12
