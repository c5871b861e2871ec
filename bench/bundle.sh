#!/usr/bin/env bash
# Builds the handoff benchmark (release) and gathers what a GPU machine without a Rust
# toolchain needs to run it into DIR (default .gpu-bench/): the benchmark executable, the
# renderer example when it exists, the PyTorch peer and run.sh.
#
# usage: bash bench/bundle.sh [DIR]      then, on the GPU machine: bash DIR/run.sh [--quick]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
dir=${1:-.gpu-bench}
exe=$(cargo bench --bench handoff --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "handoff":
        print(m["executable"])')
rm -rf "$dir" && mkdir -p "$dir/peers"
cp "$exe" "$dir/handoff" && strip "$dir/handoff"
if cargo build --release --example renderer >/dev/null 2>&1; then
  cp target/release/examples/renderer "$dir/renderer" && strip "$dir/renderer"
fi
cp bench/peers/*.py "$dir/peers/"
cp bench/gpu-run.sh "$dir/run.sh"
du -sh "$dir"
