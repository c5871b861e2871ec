#!/usr/bin/env bash
# Device memory across two emulated hosts on one two-GPU machine (issue 27): Baton's
# typed-message copies (`baton-host-peer bench`, through the NCCL engine) against
# PyTorch's NCCL send/recv of the same sizes, in the same run, with the same NCCL
# environment: its socket transport (NCCL_NET=Socket, peer-to-peer and shared memory off)
# and a host id per process (BATON_HOST_ID, NCCL_HOSTID), so that both sides are "two
# hosts" to Baton and to NCCL alike. The two hosts are two network namespaces joined by a
# veth pair (10.77.0.1 and .2, NCCL_SOCKET_IFNAME on the veth) with BATON_BENCH_NETNS=1
# (needs root, `ip`, `unshare`, `nsenter`), else loopback (NCCL_SOCKET_IFNAME=lo).
#
# usage: [BATON_BENCH_NETNS=1] bash bench/cross_host_nccl.sh PEER OUTDIR [SIZES] [REPS]
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
export NCCL_NET=Socket NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET

# The hosts: in_a / in_b run a program on host a / b; if_a / if_b are their interfaces.
if [ "${BATON_BENCH_NETNS:-0}" = 1 ]; then
  holders=()
  trap 'kill "${holders[@]}" 2>/dev/null || true' EXIT
  for _ in a b; do
    unshare --net sleep 1200 &
    holders+=($!)
  done
  for h in "${holders[@]}"; do
    for _ in $(seq 1 200); do
      [ "$(readlink /proc/$h/ns/net)" != "$(readlink /proc/self/ns/net)" ] && break
      sleep 0.01
    done
  done
  ha=${holders[0]} hb=${holders[1]}
  nsenter -t "$ha" -n ip link add baton-a type veth peer name baton-b netns "$hb"
  for i in 0 1; do
    h=${holders[$i]} dev=(baton-a baton-b) ip4=(10.77.0.1 10.77.0.2)
    nsenter -t "$h" -n ip addr add "${ip4[$i]}/24" dev "${dev[$i]}"
    nsenter -t "$h" -n ip link set "${dev[$i]}" up
    nsenter -t "$h" -n ip link set lo up
  done
  # NCCL skips an interface that is not RUNNING, and a veth becomes RUNNING a moment after
  # `ip link set up` (the kernel's link watch, up to a second): wait for it.
  for i in 0 1; do
    h=${holders[$i]} dev=(baton-a baton-b)
    for n in $(seq 1 1000); do
      nsenter -t "$h" -n ip -o link show dev "${dev[$i]}" | grep -q ' state UP ' && break
      [ "$n" = 1000 ] && { echo "${dev[$i]} is not running 10 s after it was set up" >&2; exit 1; }
      sleep 0.01
    done
  done
  in_a=(nsenter -t "$ha" -n --) in_b=(nsenter -t "$hb" -n --)
  if_a=baton-a if_b=baton-b addr_a=10.77.0.1
  echo "hosts: two network namespaces joined by a veth pair (10.77.0.1, 10.77.0.2)"
else
  in_a=() in_b=() if_a=lo if_b=lo addr_a=127.0.0.1
  echo "hosts: loopback"
fi

BATON_HOST_ID=a BATON_CUDA_DEVICE=0 NCCL_HOSTID=baton-a NCCL_DEBUG_FILE="$out/nccl.baton-a.%p.log" \
  NCCL_SOCKET_IFNAME=$if_a \
  timeout 600 "${in_a[@]}" "$peer" listen "$addr_a:0" --cuda > "$out/listen.out" 2> "$out/listen.err" &
listener=$!
at=""
for _ in $(seq 1 200); do
  at=$(sed -n 's/^listening //p' "$out/listen.out")
  [ -n "$at" ] && break
  sleep 0.05
done
[ -n "$at" ] || { echo "the listener did not listen" >&2; cat "$out/listen.err" >&2; exit 1; }
BATON_HOST_ID=b BATON_CUDA_DEVICE=1 NCCL_HOSTID=baton-b NCCL_DEBUG_FILE="$out/nccl.baton-b.%p.log" \
  NCCL_SOCKET_IFNAME=$if_b \
  timeout 600 "${in_b[@]}" "$peer" bench "$at" --cuda --sizes "$sizes" --reps "$reps" 2> "$out/bench.err" \
  | grep '^{' | tee "$out/baton.jsonl"
wait "$listener"

# One rank per host, rendezvous at host a.
torch_rank() {
  local rank=$1 ifname=$2
  shift 2
  NCCL_SOCKET_IFNAME=$ifname NCCL_DEBUG_FILE="$out/nccl.torch.%p.log" timeout 600 "$@" \
    python3 "$here/peers/torch_nccl_sendrecv.py" --sizes "$sizes" --reps "$reps" \
    --rank "$rank" --master "$addr_a"
}
torch_rank 1 "$if_b" "${in_b[@]}" > "$out/torch.rank1.out" 2> "$out/torch.rank1.err" &
rank1=$!
torch_rank 0 "$if_a" "${in_a[@]}" 2> "$out/torch.rank0.err" | tee "$out/torch.jsonl"
wait "$rank1"

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
grep -h " via \|NET/Socket : Using" "$out"/nccl.*.log | sed 's/^.*NCCL INFO //' | sort | uniq -c | head -16
