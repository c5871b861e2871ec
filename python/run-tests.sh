#!/usr/bin/env bash
# The Python package's suite, as CI runs it (`.ci/run` calls this): a fresh virtual
# environment with maturin, pytest and NumPy; the wheel, built by maturin as a *dev* build
# (debug: quick to compile, and what the tests need; `pip install ./python` builds a
# release wheel); the Rust partner process of the tests (examples/py_partner.rs); pytest.
#
#   bash python/run-tests.sh            # every test (CUDA ones skip without a GPU/torch/cupy)
#   bash python/run-tests.sh -k leases  # extra arguments go to pytest
#
# Environment: PYTHON (default python3, >= 3.9), BATON_PY_VENV (default target/py-venv;
# recreated on every run).
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
venv="${BATON_PY_VENV:-target/py-venv}"

echo "python: fresh virtual environment in $venv ($("$python" --version))"
"$python" -m venv --clear "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "maturin>=1.9.4,<2" "pytest>=7" "numpy>=1.22"

echo "python: building the wheel (maturin, dev profile)"
rm -rf target/py-wheels
"$venv/bin/maturin" build --quiet --locked -m python/Cargo.toml --out target/py-wheels
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps target/py-wheels/baton-*.whl

echo "python: building the Rust partner (examples/py_partner.rs)"
cargo build --quiet --locked --example py_partner

echo "python: pytest"
BATON_PY_PARTNER="${CARGO_TARGET_DIR:-$PWD/target}/debug/examples/py_partner" \
  "$venv/bin/python" -m pytest python/tests -p no:cacheprovider -rs -q "$@"
