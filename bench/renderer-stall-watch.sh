#!/usr/bin/env bash
# Renderer chaos runs that catch a freeze in the act: when a run's log is silent for 4 s,
# every renderer process of the run is SIGSTOPped, each thread's state (wchan, syscall) and
# the return addresses on its stack are written out (bench/stackscan.py), and it is
# SIGCONTed. The GPU machine has no gdb; symbolise here with the same binary:
#   python3 bench/stacksym.py path/to/renderer < RUN-stacks.txt
#   bash .gpu/run.sh --shell 'RUNS=8 bash bench/renderer-stall-watch.sh'   # logs in $OUT/stall
#   KIND=vmm ARGS="--kill-compositor 25" bash bench/renderer-stall-watch.sh  # extra renderer args
set -u
runs=${RUNS:-20}; kind=${KIND:-legacy}; size=${SIZE:-1920x1080}; deadline=${RUN_DEADLINE:-40}
frames=${FRAMES:-60}; read -r -a extra <<< "${ARGS:-}"
logs=${OUT:-/tmp}/stall; mkdir -p "$logs"
exe=$(command -v renderer)
here=$(cd "$(dirname "$0")" && pwd)
diag() {
  local d=$1
  for p in $(pgrep -f "^$exe") $(sed -n 's/.*child started child=[a-z0-9-]* pid=\([0-9]*\).*/\1/p' "$log"); do
    [ -d /proc/$p ] || continue
    echo "=== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-120)"
    for t in /proc/$p/task/*; do
      printf '%-8s %-16s %-24s %s\n' "${t##*/}" "$(cat $t/comm 2>/dev/null)" "$(cat $t/wchan 2>/dev/null)" "$(cut -d' ' -f1 $t/syscall 2>/dev/null)"
    done
    kill -STOP "$p"; sleep 0.3
    timeout 20 python3 "$here/stackscan.py" "$p" 2>&1
    kill -CONT "$p"
  done > "$d" 2>&1
}
bad=0
for i in $(seq 1 "$runs"); do
  log="$logs/$kind-$size-$i${TAG:+-$TAG}.txt"; out=$(mktemp -d /tmp/baton-chaos-out.XXXXXX)
  start=$(date +%s)
  RUST_LOG=${RUST_LOG:-info} BATON_CUDA_EXPORT=$kind timeout -k 5 "$deadline" "$exe" --backend cuda --size "$size" \
    --frames "$frames" --chaos 10 "${extra[@]}" --out "$out" > "$log" 2>&1 &
  rp=$!
  last=$(date +%s); lsz=0; dumped=0
  while kill -0 $rp 2>/dev/null; do
    sleep 0.5
    sz=$(stat -c %s "$log"); now=$(date +%s)
    if [ "$sz" != "$lsz" ]; then lsz=$sz; last=$now; fi
    if [ $dumped -eq 0 ] && [ $((now - last)) -ge 4 ]; then
      diag "${log%.txt}-stacks.txt"; dumped=1
      echo "run $i: silent 4 s at $((now - start)) s; stacks taken"
    fi
  done
  wait $rp; rc=$?
  rm -rf "$out"
  pkill -9 -f "^$exe" 2>/dev/null
  echo "run $i rc=$rc secs=$(( $(date +%s) - start )) dumped=$dumped late=$(grep -c 'fences are late' "$log") rereleased=$(grep -c 'released again' "$log") cut=$(grep -c 'did not land' "$log")"
  if [ $rc -ne 0 ] || [ $dumped -ne 0 ]; then bad=$((bad+1)); else rm -f "$log"; fi
done
echo "stall: $bad of $runs runs stalled or failed"
