#!/usr/bin/env bash
# Runs every test of the project: formatting, lints, the Rust workspace's tests (GPU tests are
# listed as ignored without a GPU), and the Python package's tests on the simulated device.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The API documentation builds with every intra-doc link resolved.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
cargo test --workspace
# Tests that need a tool the Rust build does not (ignored above, with the reason).
if command -v g++ >/dev/null; then
    cargo test -p gpumem-core --lib -- --ignored bench_ops::tests::sequences_match_the_cpp_generator_op_by_op
else
    echo "SKIPPED: bench_ops::tests::sequences_match_the_cpp_generator_op_by_op (no g++)"
fi
# The Python module's Rust code (feature `python`, left out of the workspace build so that
# `cargo test` need not link libpython).
cargo clippy -p gpumem-py --features python --all-targets -- -D warnings
# The Python package: build the extension into a virtualenv, run its tests on the simulated
# device (the GPU tests skip themselves with the reason).
python3 -m venv .venv
.venv/bin/python -m pip install --quiet maturin pytest
VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --quiet
.venv/bin/python -m pytest tests/python -q -rs -p no:cacheprovider
