#!/bin/bash
# System calls per cached handoff round trip (item 2 `share`, host backend), both processes:
# perf stat follows the consumer the benchmark spawns. A full run and a --quick run differ
# by 19,800 round trips (22,000 against 2,200, warm-ups included); the socket floor (item 1)
# always runs, so its sendto/recvfrom are counted apart and left out. Prints one JSON line.
#
#   bash bench/handoff_syscalls.sh "$(cargo bench --bench handoff --no-run 2>&1 | sed -n 's/.*(\(.*\))$/\1/p')"
#   taskset -c 0 bash bench/handoff_syscalls.sh BIN      # both processes on one core
set -euo pipefail
BIN=$1
count() {
  perf stat -x, -e raw_syscalls:sys_enter -e syscalls:sys_enter_sendto -e syscalls:sys_enter_recvfrom \
    -- "$BIN" --items 2 --backends host "$@" 2>&1 >/dev/null | grep sys_enter | cut -d, -f1 | paste -sd' '
}
read -r fa fs fr < <(count)
read -r qa qs qr < <(count --quick)
python3 -c "
import json
a = ($fa - $fs - $fr) - ($qa - $qs - $qr)
print(json.dumps({'name': 'syscalls', 'item': 2, 'variant': 'share', 'backend': 'host',
    'label': 'system calls per cached round trip, both processes (perf stat: full run less --quick run, the floor\'s sendto/recvfrom left out)',
    'full_run': [$fa, $fs, $fr], 'quick_run': [$qa, $qs, $qr], 'round_trips_between': 19800,
    'syscalls_per_handoff': round(a / 19800, 2)}, sort_keys=True))"
