#!/usr/bin/env bash
# Builds the handoff benchmark (release) and gathers what a GPU machine without a Rust
# toolchain needs to run it into DIR (default .gpu-bench/): the benchmark executable, the
# renderer example when it builds, the PyTorch peer and run.sh. Executables are stripped;
# the bundle must stay under 30 MiB (checked).
#
# usage: bash bench/bundle.sh [DIR]      then, on the GPU machine: bash DIR/run.sh [--quick]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
dir=${1:-.gpu-bench}
limit_mib=30
# The handoff benchmark's executable, built with the cargo arguments given.
handoff() {
  cargo bench --bench handoff --no-run --message-format=json "$@" 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "handoff":
        print(m["executable"])'
}
exe=$(handoff)
if [ -z "$exe" ] || [ ! -x "$exe" ]; then
  echo "bundle: the handoff benchmark did not build (cargo bench --bench handoff --no-run)" >&2
  exit 1
fi
rm -rf "$dir" && mkdir -p "$dir/peers"
cp "$exe" "$dir/handoff" && strip "$dir/handoff"
# With the stage probes (`--stages`: where one handoff's time goes, issue 24).
stages=$(handoff --features stage-probes)
if [ -n "$stages" ] && [ -x "$stages" ]; then
  cp "$stages" "$dir/handoff-stages" && strip "$dir/handoff-stages"
else
  echo "bundle: the handoff benchmark with stage-probes did not build: no handoff-stages" >&2
fi
target=$(cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
if cargo build --release --example renderer >/dev/null 2>&1; then
  cp "$target/release/examples/renderer" "$dir/renderer" && strip "$dir/renderer"
else
  echo "bundle: the renderer example did not build: item 6 will say 'not measured'" >&2
fi
cp bench/peers/*.py "$dir/peers/"
cp bench/gpu-run.sh "$dir/run.sh"
chmod +x "$dir/run.sh" "$dir/handoff"
git rev-parse HEAD > "$dir/COMMIT"
bytes=$(du -sb "$dir" | cut -f1)
if [ "$bytes" -gt $((limit_mib << 20)) ]; then
  echo "bundle: $dir is $((bytes >> 20)) MiB, over the ${limit_mib} MiB limit" >&2
  exit 1
fi
du -sh "$dir"
ls -l "$dir"
