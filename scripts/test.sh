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
# The PyTorch integration inside a real PyTorch process, still without a GPU: install(), both
# install paths and the native allocator's build, against PyTorch 2.11's CUDA build from PyPI
# (in .venv-torch, made by scripts/torch_env.sh: about 5 GB, downloaded once), served by the
# simulated device. GPUMEM_TEST_TORCH=0 leaves it out; where PyTorch cannot be installed (no
# network) the step says so and is skipped.
if [[ "${GPUMEM_TEST_TORCH:-1}" == 0 ]]; then
    echo "SKIPPED: the tests inside a real PyTorch process (GPUMEM_TEST_TORCH=0)"
elif cuda_home=$(bash scripts/torch_env.sh .venv-torch | tail -1) && [[ -d "$cuda_home" ]]; then
    VIRTUAL_ENV="$PWD/.venv-torch" .venv/bin/maturin develop --quiet
    CUDA_HOME="$cuda_home" PATH="$PWD/.venv-torch/bin:$PATH" \
        .venv-torch/bin/python -m pytest tests/python -q -rs -p no:cacheprovider
else
    echo "SKIPPED: the tests inside a real PyTorch process (PyTorch could not be installed;" \
        "scripts/torch_env.sh says why above)"
fi
