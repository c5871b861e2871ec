#!/usr/bin/env bash
# Mutation testing of the protocol cores with cargo-mutants (a dev tool: see
# docs/DEPENDENCIES.md; `cargo install cargo-mutants --locked`). Not part of CI: it takes
# long. Each set mutates one part of the code and runs the tests that guard it.
#
#   bash bench/mutants.sh [SET…]        sets: ledger exports supervisor link link-session cache ipc-link order wire
#                                       (default: ledger exports, the highest-value two)
#   BATON_MUTANTS_ITERATE=1 bash bench/mutants.sh SET
#                                       test again only what the last run of SET did not
#                                       catch (cargo mutants --iterate), after new tests
#   BATON_MUTANTS_SHARD=K/N BATON_MUTANTS_REPORT=docs/mutants/SET/shardK bash bench/mutants.sh SET
#                                       one shard of a set (cargo mutants --shard), its
#                                       lists in a directory of their own
#   BATON_MUTANTS_RE=REGEX BATON_MUTANTS_REPORT=DIR bash bench/mutants.sh SET
#                                       only SET's mutants whose name matches REGEX
#                                       (cargo mutants --re), e.g. a list of missed ones
#                                       after the set gained tests
#
# Budget for a 2-core machine: one mutant at a time (in place, so builds are incremental),
# cargo's build jobs capped (BATON_MUTANTS_BUILD_JOBS, default 2), in a copy of the
# tree (a git worktree of HEAD, so the caller's tree is never mutated), incremental builds
# in one target dir (BATON_MUTANTS_TARGET, default target/mutants), no baseline run (the
# caller's tests pass), each test run cut at its set's --timeout (a few times its usual length). Figures of a run on the 2-core
# development VM are in docs/mutants/README.md. The report of each set (caught, missed,
# timeout, unviable lists) is copied to docs/mutants/<set>/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
sets=("$@")
[ ${#sets[@]} -gt 0 ] || sets=(ledger exports)

command -v cargo-mutants >/dev/null || {
  echo "mutants: cargo-mutants not found: cargo install cargo-mutants --locked" >&2
  exit 1
}

target=${BATON_MUTANTS_TARGET:-$root/target/mutants}
# rustc ships lld (`rust-lld`, with a `gcc-ld/ld.lld` shim for cc): link with it where present.
lld_dir="$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/gcc-ld"
lld_flags=""
[ -x "$lld_dir/ld.lld" ] && lld_flags="-C link-arg=-fuse-ld=lld -C link-arg=-B$lld_dir"
tree=$(mktemp -d "${TMPDIR:-/tmp}/mutants-of-baton-XXXXXX")
cleanup() { git -C "$root" worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"; }
trap cleanup EXIT
git -C "$root" worktree add --detach "$tree" HEAD >/dev/null

# The files each set mutates, and the tests that run for each of its mutants.
args_of() {
  case "$1" in
    # The ledger is a state machine without I/O: its unit and property tests prove it.
    ledger) echo "-f actors/src/ledger.rs -f actors/src/ledger/tables.rs --cargo-arg=--lib --timeout 60" ;;
    # The export table: the actor protocol and lease tests drive it across processes.
    # (The first run, with actors_protocol and leases only, missed 31 of its first 49
    # mutants, in code that api, liveness and forwarding drive: see docs/mutants/exports.)
    exports) echo "-f actors/src/exports.rs --test-package baton --cargo-arg=--test=actors_protocol --cargo-arg=--test=leases --cargo-arg=--test=api --cargo-arg=--test=liveness --cargo-arg=--test=forwarding --timeout 300" ;;
    supervisor) echo "-f actors/src/supervisor.rs --test-package baton --cargo-arg=--test=actors_supervision --timeout 240" ;;
    # `ordering` since 7065eb2: its cache-hit and descriptor-batch tests guard the link.
    # `leases`, `liveness`, `status`, `api`, `soak` and `ergonomics` since 2026-11-26: they
    # drive the link's teardown (a socket that ends, a peer seen dead, a stopped peer), the
    # close's flush (ergonomics' reply-then-close) and the status answers, which the four
    # above left to them.
    # Since issue 28 the link's shell is link.rs and link/*.rs; its protocol, link_session.rs,
    # is its own set (`link-session`), proved by its unit and model tests.
    link) echo "-f actors/src/link.rs -f actors/src/link/*.rs --test-package baton --cargo-arg=--test=actors_protocol --cargo-arg=--test=bounds --cargo-arg=--test=actors_bad_input --cargo-arg=--test=ordering --cargo-arg=--test=leases --cargo-arg=--test=liveness --cargo-arg=--test=status --cargo-arg=--test=api --cargo-arg=--test=soak --cargo-arg=--test=ergonomics --timeout 300" ;;
    link-session) echo "-f actors/src/link_session.rs --cargo-arg=--lib --timeout 60" ;;
    # How byte arrays cross the wire (messages/src/byte_array.rs): its unit tests and the
    # codec's (exact bytes, wrong lengths refused, JSON's arrays).
    wire) echo "-f messages/src/byte_array.rs --test-package baton-messages --cargo-arg=--lib --timeout 60" ;;
    cache) echo "-f ipc/src/cache.rs -f ipc/src/cache/state.rs -f ipc/src/cache/close.rs -f ipc/src/cache/shared.rs -f ipc/src/cache/imported.rs --test-package baton-ipc --timeout 120" ;;
    # `--lib` runs baton-ipc's unit tests (the handshake's model test, the wire's, the socket
    # directory's); the facade's link tests cross real processes. (Without `--lib`, `--test`
    # would select only the facade's test targets.) The selections are `--cargo-arg`s, so
    # that each mutant's build makes only the test binaries that run.
    ipc-link) echo "-f ipc/src/link.rs -f ipc/src/link/*.rs --test-package baton-ipc --test-package baton --cargo-arg=--lib --cargo-arg=--test=link_bad_input --cargo-arg=--test=auth --cargo-arg=--test=host_link --timeout 240" ;;
    # Stream ordering on both sides of a handoff (order.rs) and the raw API over it: the
    # simulated device's tests (liveness, ordering) count and order every driver call.
    order) echo "-f actors/src/order.rs -f actors/src/raw.rs -f actors/src/buffer/lease.rs --test-package baton --cargo-arg=--test=liveness --cargo-arg=--test=ordering --timeout 120" ;;
    *) echo "mutants: unknown set $1" >&2; return 1 ;;
  esac
}

# A mutant that breaks a test's cleanup (or hangs it until the timeout kills it) leaves that
# test's named segments in /dev/shm: the sweep at the end removes those of dead owners in
# the namespaces that appeared during the run (the tests' `t<pid>-<tag>`).
namespaces() { ls /dev/shm | sed -n 's/^\(t[0-9]*-[a-z0-9_-]*\)\.[0-9]*\.[0-9]*\.[0-9]*\.[0-9a-f]\{16\}$/\1/p' | sort -u; }
namespaces_before=$(namespaces)
sweep_new() {
  local ns
  for ns in $(comm -13 <(echo "$namespaces_before") <(namespaces)); do
    cargo run -q -p baton-cli --bin baton -- sweep --namespace "$ns" --sockets-in "$tree" | sed -n '/^namespace/p'
  done
}
trap 'sweep_new; cleanup' EXIT

for set in "${sets[@]}"; do
  read -r -a set_args <<<"$(args_of "$set")"
  out="$target/out/$set"
  mkdir -p "$out"
  start=$(date +%s)
  echo "== mutants: $set (${set_args[*]})"
  # cargo-mutants exits 2 when mutants were missed, 3 on timeouts: the report says which.
  # No debug info and rustc's own lld: most of a mutant's time is relinking the facade's
  # test binaries and helpers, and both cut it (measured in docs/mutants/README.md).
  (cd "$tree" && CARGO_TARGET_DIR="$target" CARGO_BUILD_JOBS="${BATON_MUTANTS_BUILD_JOBS:-2}" \
    CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_TEST_DEBUG=0 RUSTFLAGS="${RUSTFLAGS:-$lld_flags}" \
    cargo mutants --workspace --in-place --baseline=skip --build-timeout 600 \
      --cap-lints true --no-times -o "$out" ${BATON_MUTANTS_ITERATE:+--iterate} \
      ${BATON_MUTANTS_SHARD:+--shard "$BATON_MUTANTS_SHARD"} \
      ${BATON_MUTANTS_RE:+--re "$BATON_MUTANTS_RE"} "${set_args[@]}") || true
  took=$(( $(date +%s) - start ))
  report=${BATON_MUTANTS_REPORT:-docs/mutants/$set}
  mkdir -p "$report"
  for f in caught missed timeout unviable; do
    cp "$out/mutants.out/$f.txt" "$report/$f.txt" 2>/dev/null || : >"$report/$f.txt"
  done
  label="$set${BATON_MUTANTS_SHARD:+ shard $BATON_MUTANTS_SHARD}"
  [ -z "${BATON_MUTANTS_RE:-}" ] || label="$label, only those --re matched"
  echo "$label: $(wc -l <"$report/caught.txt") caught, $(wc -l <"$report/missed.txt") missed, $(wc -l <"$report/timeout.txt") timeout, $(wc -l <"$report/unviable.txt") unviable; ${took} s" \
    | tee "$report/summary.txt"
done
