#!/usr/bin/env bash
# Runs the handoff benchmark and its PyTorch peer on a GPU machine, from a bundle made by
# bench/bundle.sh. Results: stdout, and $OUT/bench.jsonl + $OUT/bench.log when OUT is set.
# Extra arguments go to the benchmark (e.g. --quick).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
renderer=()
[ -x "$here/renderer" ] && renderer=(--renderer "$here/renderer")
"$here/handoff" --torch "$here/peers/torch_mp.py" "${renderer[@]}" "$@" 2>&1 | tee "$out/bench.log"
