#!/usr/bin/env bash
# The Python package's diagnostics under real PyTorch on the GPU machine: the tests of
# summaries, snapshots with their history, leak reports and the leak check at exit (the GPU
# ones with PyTorch 2.11, the simulated ones too), then the cost of recording the history and
# stacks on PyTorch allocations.
#
# Needs, built beforehand on the development machine (from the repository root):
#     .venv/bin/maturin build --release --out .device/wheels
# and `.device` carried to the GPU machine (it is git-ignored): run tool `carry: [".device"]`.
# The GPU machine needs python3 with PyTorch 2.11 (CUDA) and pytest; no Rust, no network.
# Kind: nvidia-h200 (one GPU). About 1-2 minutes.
#
# Run from the repository root:  OUT=/some/dir bash scripts/device/pydiag.sh
#
# Good result: pytest ends with "N passed" and no failures (the GPU tests
# test_record_memory_history_through_torchs_function, test_leak_check_at_exit_names_the_leaked_tensor
# and test_snapshot_has_torchs_shape among them); the cost table lists, per configuration,
# microseconds per torch.empty + del of a 4 KiB tensor (history alone should cost little,
# stacks more). Full logs: $OUT/pytest.log, $OUT/cost.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out/pydiag}"
mkdir -p "$OUT"

# shellcheck source=scripts/device/wheel.sh
source scripts/device/wheel.sh
install_gpumem_wheel "${TMPDIR:-/tmp}/gpumem-site-pydiag"
python3 -c "import gpumem, torch; print('gpumem', gpumem.__version__, '| torch', torch.__version__, '|', torch.cuda.get_device_name(0))" \
    | tee "$OUT/versions.txt" || exit 3

echo "== pytest: diagnostics"
python3 -m pytest -v -rs -p no:cacheprovider \
    tests/python/test_diagnostics.py tests/python/test_torch_entry_points.py \
    "tests/python/test_torch_gpu.py::test_snapshot_has_torchs_shape" \
    "tests/python/test_torch_gpu.py::test_record_memory_history_through_torchs_function" \
    "tests/python/test_torch_gpu.py::test_leak_check_at_exit_names_the_leaked_tensor" \
    >"$OUT/pytest.log" 2>&1
PYTEST_RC=$?
grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/pytest.log" | sed 's/^/  /' | tail -60

echo "== cost of the history and stacks per PyTorch allocation"
: >"$OUT/cost.jsonl"
COST_RC=0
for conf in "policy:stitched" "policy:stitched,history:100000" "policy:stitched,history:100000,backtraces:1"; do
    python3 - "$conf" >>"$OUT/cost.jsonl" 2>>"$OUT/cost.err" <<'EOF' || COST_RC=1
import json, sys, time
import torch, gpumem
conf = sys.argv[1]
gpumem.torch.install(conf=conf)
# Capturing a backtrace per allocation is far slower (20,000 x 3 did not finish in two minutes
# on the H200 machine): fewer allocations there.
n = 500 if "backtraces" in conf else 20000
for _ in range(1000):  # warm up: the first page, the CUDA context
    del_me = torch.empty(4096, dtype=torch.uint8, device="cuda")
    del del_me
torch.cuda.synchronize()
best = None
for _ in range(3):
    t = time.perf_counter()
    for _ in range(n):
        x = torch.empty(4096, dtype=torch.uint8, device="cuda")
        del x
    dt = (time.perf_counter() - t) / n * 1e6
    best = dt if best is None else min(best, dt)
snap = gpumem.torch.snapshot()
print(json.dumps({"conf": conf, "us_per_alloc_free": round(best, 2),
                  "history_entries": len(snap["device_traces"][0])}))
EOF
done

echo
echo "================ summary (scripts/device/pydiag.sh) ================"
cat "$OUT/versions.txt"
echo "pytest (exit $PYTEST_RC): $(tail -1 "$OUT/pytest.log")"
echo "cost (exit $COST_RC), best of 3 x 20000 torch.empty(4 KiB) + del:"
python3 - "$OUT/cost.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"  {'configuration':48s} {'us/alloc+free':>14s} {'history entries':>16s}")
for r in rows:
    print(f"  {r['conf']:48s} {r['us_per_alloc_free']:14.2f} {r['history_entries']:16d}")
EOF
[ "$PYTEST_RC" -eq 0 ] && [ "$COST_RC" -eq 0 ]
