#!/usr/bin/env bash
# gpumem as PyTorch's allocator on the GPU machine (issue 5): installs the gpumem wheel built on
# the development machine, runs the Python test suite (the GPU tests with real PyTorch included),
# then the workload benchmark (scripts/bench_workloads.py), and prints the summary last.
#
# Needs, built beforehand on the development machine (from the repository root):
#     .venv/bin/maturin build --release --out .device/wheels      # or: pip wheel . -w .device/wheels
# and `.device` carried to the GPU machine (it is git-ignored): run tool `carry: [".device"]`.
# The GPU machine needs python3 with PyTorch 2.11 (CUDA), torchvision, transformers and pytest;
# no Rust, no network. Kind: nvidia-h200 (one GPU; the DDP test skips itself, see ddp.sh).
#
# Run from the repository root:  OUT=/some/dir bash scripts/device/torch.sh
# Optional: BENCH_ARGS="--no-maxbatch" (or --workloads/--steps) to shorten the benchmark;
#           SKIP_BENCH=1 to run the tests only.
#
# Good result: pytest ends with "N passed" (test_ddp_gpu skipped: needs 2 GPUs; no failures);
# the benchmark's first table shows gpumem's held/live <= 1.02 and <= the best of the three
# PyTorch allocators on every workload ("yes / yes"; serve_threads, four threads on their own
# streams, held 1.012-1.019 of live in sessions 20-21), the step-time table shows gpumem near
# 1.00 (one round moves by up to 20 % on this host: add native-again to --allocators and
# --repeat N to see how much; GPT-2 with random lengths pays for its pool's growth in the steps
# that grow it, docs/stitched.md), and the max-batch table shows
# gpumem's largest batch under the cap. Expect about 1 minute of tests and 12-13 minutes of
# benchmark (2026-12-01: 21 of its 24 runs took 8 minutes; pass BENCH_ARGS="--workloads ..." to
# split it across calls of a 10-minute limit). Full logs: $OUT/pytest.log, $OUT/bench.log,
# $OUT/bench_logs/*.log, $OUT/bench_workloads.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out/torch}"
mkdir -p "$OUT"

# shellcheck source=scripts/device/wheel.sh
source scripts/device/wheel.sh
install_gpumem_wheel "${TMPDIR:-/tmp}/gpumem-site"
python3 -c "import gpumem, torch; print('gpumem', gpumem.__version__, 'from', gpumem.__file__, '| torch', torch.__version__, '|', torch.cuda.get_device_name(0))" \
    | tee "$OUT/versions.txt" || exit 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/versions.txt" 2>&1 || true

echo "== pytest tests/python"
python3 -m pytest tests/python -v -rs -p no:cacheprovider >"$OUT/pytest.log" 2>&1
PYTEST_RC=$?
grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/pytest.log" | sed 's/^/  /' | tail -60

BENCH_RC=0
if [ -z "${SKIP_BENCH:-}" ]; then
    echo "== scripts/bench_workloads.py ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    python3 scripts/bench_workloads.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
    BENCH_RC=${PIPESTATUS[0]}
fi

echo
echo "================ summary (scripts/device/torch.sh) ================"
cat "$OUT/versions.txt"
echo "pytest (exit $PYTEST_RC): $(tail -1 "$OUT/pytest.log")"
if [ -z "${SKIP_BENCH:-}" ]; then
    echo "benchmark (exit $BENCH_RC):"
    sed -n '/^Peak held from the driver/,$p' "$OUT/bench.log"
fi
[ "$PYTEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
