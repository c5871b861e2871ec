#!/usr/bin/env bash
# Runs the handoff benchmark and its PyTorch peer on a GPU machine, from a bundle made by
# bench/bundle.sh. Results: stdout, and $OUT/bench.jsonl + $OUT/bench.log when OUT is set.
# Extra arguments go to the benchmark (e.g. --quick, --items 2,8, --backends cuda-pool);
# they come after the defaults here, so they win (e.g. --budget 300).
#
# The benchmark skips parts that would start after BENCH_BUDGET seconds (default 500), so
# that a run under a 600 s per-command limit still ends with its table.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
[ -f "$here/COMMIT" ] && echo "# bundle of commit $(cat "$here/COMMIT")"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
renderer=()
[ -x "$here/renderer" ] && renderer=(--renderer "$here/renderer")
exe="$here/handoff"
# `--stages` needs the build with the stage probes (bench/bundle.sh's handoff-stages).
if [ -x "$here/handoff-stages" ] && printf '%s\n' "$@" | grep -qx -- --stages; then
  exe="$here/handoff-stages"
fi
"$exe" --torch "$here/peers/torch_mp.py" "${renderer[@]}" \
  --budget "${BENCH_BUDGET:-500}" "$@" 2>&1 | tee "$out/bench.log"
