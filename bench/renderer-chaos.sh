#!/usr/bin/env bash
# The renderer's chaos runs of issue 23 on a GPU machine: the renderer example with
# `--chaos` (a worker SIGKILLed every K frames) RUNS times per export kind and frame size,
# each run under a deadline. One line per run: exit status, seconds, fps, restarts, leaked
# bytes (the renderer's own per-process device and host accounting), and the renderer
# processes left once it returned (there must be none). Last line: the count of runs that
# were not clean.
#
#   bash .gpu/run.sh --shell 'bash bench/renderer-chaos.sh'     # from a gpu-bundle
#   RUNS=2 SIZES=1920x1080 KINDS=legacy bash bench/renderer-chaos.sh
#   RUNS=4 ARGS="--kill-compositor 25" bash bench/renderer-chaos.sh   # the compositor too
#
# Needs the renderer example on PATH (`.gpu/run.sh --shell` puts the bundle's examples
# there). Logs of each run go to $OUT/renderer-chaos/ when OUT is set.
set -u
runs=${RUNS:-10}
sizes=${SIZES:-"1920x1080 3840x2160"}
kinds=${KINDS:-"legacy vmm pool"}
frames=${FRAMES:-60}
every=${CHAOS_EVERY:-10}
deadline=${RUN_DEADLINE:-90}
read -r -a extra <<< "${ARGS:-}"
logs=${OUT:-/tmp}/renderer-chaos
mkdir -p "$logs"
exe=$(command -v renderer) || { echo "renderer-chaos: no renderer on PATH" >&2; exit 2; }
bad=0
printf '%-7s %-10s %3s %4s %5s %7s %8s %14s %5s\n' kind size run rc secs fps restarts leaked stray
for kind in $kinds; do
  for size in $sizes; do
    for i in $(seq 1 "$runs"); do
      log="$logs/$kind-$size-$i.txt"
      out=$(mktemp -d /tmp/baton-chaos-out.XXXXXX)
      start=$(date +%s%N)
      BATON_CUDA_EXPORT=$kind timeout -k 5 "$deadline" "$exe" --backend cuda --size "$size" \
        --frames "$frames" --chaos "$every" "${extra[@]}" --out "$out" > "$log" 2>&1
      rc=$?
      ms=$(( ($(date +%s%N) - start) / 1000000 ))
      secs=$((ms / 1000)).$(( (ms % 1000) / 100 ))
      rm -rf "$out"
      # The renderer's children are this executable too: any left is a stray.
      sleep 0.2
      stray=$(pgrep -f -c "^$exe" || true)
      fps=$(sed -n 's/^fps  *\([0-9.]*\).*/\1/p' "$log" | tail -1)
      restarts=$(sed -n 's/^restarts  *\([0-9]*\).*/\1/p' "$log" | tail -1)
      leaked=$(sed -n 's/^leaked bytes  *\([0-9]*\).*/\1/p' "$log" | tail -1)
      printf '%-7s %-10s %3s %4s %5s %7s %8s %14s %5s\n' "$kind" "$size" "$i" "$rc" "$secs" \
        "${fps:--}" "${restarts:--}" "${leaked:--}" "$stray"
      if [ "$rc" -ne 0 ] || [ "${leaked:-x}" != 0 ] || [ "$stray" -ne 0 ]; then
        bad=$((bad + 1))
        pkill -9 -f "^$exe" 2>/dev/null
      fi
    done
  done
done
echo "renderer-chaos: $bad of $(( $(echo $kinds | wc -w) * $(echo $sizes | wc -w) * runs )) runs not clean"
[ "$bad" -eq 0 ]
