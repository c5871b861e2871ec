#!/usr/bin/env bash
# Runs one bundled GPU test and, every 0.2 s while it runs, snapshots the open descriptors
# and the driver mappings (/dev/nvidia* lines of /proc/PID/maps) of the test and every
# process below it; prints what changed since the last snapshot, with UTC times, so the
# changes line up with the test's RUST_LOG lines. For issue 46: which descriptor or
# mapping lives as long as a link.
#
#   bash .gpu/run.sh --shell 'bash bench/probe/fd_snapshot.sh actors_cuda TEST_NAME'
#
# Writes $OUT/fd-snapshot.log (changes) and $OUT/fd-snapshot-test.log (the test's output).
set -u
bin_name=${1:?test binary name (actors_cuda)}
test=${2:?test name}
box=${GPU_BOX:-/tmp/baton-gpu}
. "$box/paths.env"
rel=$(grep "/$bin_name-" "$box/tests.txt" | head -1)
bin="$BUILD_TARGET/$rel"
out=${OUT:-/tmp}
log=$out/fd-snapshot.log
: > "$log"
snap() {
  local f
  for f in /proc/"$1"/fd/*; do
    printf 'fd %s -> %s\n' "${f##*/}" "$(readlink "$f" 2>/dev/null)"
  done
  grep nvidia /proc/"$1"/maps 2>/dev/null | awk '{print "map", $2, $6, $1}' | sort | uniq -c |
    awk '{print $2, $3, $4, "x" $1}'
}
tree() {
  local p
  echo "$1"
  for p in $(pgrep -P "$1"); do tree "$p"; done
}
RUST_LOG=${RUST_LOG:-baton_ipc::cuda=debug,baton_ipc::cache=debug,baton_actors=debug} \
  "$bin" --exact "$test" --include-ignored --test-threads=1 >"$out/fd-snapshot-test.log" 2>&1 &
main=$!
declare -A prev
n=0
while kill -0 "$main" 2>/dev/null; do
  ts=$(date -u +%H:%M:%S.%N | cut -c1-12)
  for pid in $(tree "$main"); do
    now=$(snap "$pid")
    name=$(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null | cut -c1-80)
    if [ -z "${prev[$pid]+x}" ]; then
      { echo "$ts pid $pid new: $name"; echo "$now" | sed 's/^/    /'; } >>"$log"
    elif [ "${prev[$pid]}" != "$now" ]; then
      { echo "$ts pid $pid changed:"; diff <(echo "${prev[$pid]}") <(echo "$now") | grep '^[<>]' | sed 's/^/    /'; } >>"$log"
    fi
    prev[$pid]=$now
  done
  n=$((n + 1))
  if [ $((n % 5)) -eq 0 ]; then
    echo "$ts device used $(nvidia-smi --query-gpu=memory.used --format=csv,noheader -i 0)" >>"$log"
  fi
  sleep 0.2
done
wait "$main"
echo "test rc=$?" >>"$log"
