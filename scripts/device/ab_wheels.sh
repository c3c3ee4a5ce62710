#!/usr/bin/env bash
# Step time of real PyTorch workloads under two builds of gpumem, in one call: ROUNDS
# interleaved rounds, each running `bench_workloads.py` once with the old wheel and once with the
# new one, each invocation against PyTorch's own allocator in the same process tree (so every
# gpumem figure has a native figure from the same minute). Host noise that drifts over minutes
# then hits both builds alike; the per-step driver calls are recorded too
# (GPUMEM_BENCH_STEP_CALLS=1), so runs can be set side by side step by step with
# scripts/step_driver_time.py. Session 18 compared main with two changes this way
# (BENCHMARKS.md §3).
#
# Needs two wheels (build them on the development machine, see wheel.sh):
#     .device/wheels_old/gpumem-*.whl   (e.g. main's, built before the change)
#     .device/wheels/gpumem-*.whl       (the change)
# and the tool's `carry: [".device"]`. On the GPU machine, from the repository root:
#     OUT=/some/folder bash scripts/device/ab_wheels.sh [WORKLOADS] [ROUNDS] [EXTRA ARGS...]
# WORKLOADS: comma-separated (default prefetch_mlp); ROUNDS: default 4; extra arguments go to
# bench_workloads.py (default `--allocators native,gpumem`). Stops starting rounds after
# AB_BUDGET_S seconds (default 400), so that a call stays within its time limit.
# Output: $OUT/{old,new}/r<round>/bench_workloads.jsonl and logs; every run in
# $OUT/ab_wheels.jsonl, with gpumem's runs named gpumem@old and gpumem@new; a line per run in
# $OUT/summary.txt, and scripts/step_driver_time.py's step-by-step table, printed last.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/ab_wheels}
WORKLOADS=${1:-prefetch_mlp}
ROUNDS=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
EXTRA=("$@")
if [[ ! " ${EXTRA[*]} " =~ " --allocators " ]]; then
    EXTRA+=(--allocators native,gpumem)
fi
mkdir -p "$OUT"
for v in old new; do
    dir=.device/wheels; [ $v = old ] && dir=.device/wheels_old
    wheel=$(ls -t $dir/gpumem-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { echo "ab_wheels.sh: no wheel in $dir" >&2; exit 2; }
    rm -rf /tmp/gpumem-$v
    python3 -m zipfile -e "$wheel" /tmp/gpumem-$v
done
relabel() { # jsonl build -> its lines, with gpumem's allocator names tagged @build
    [ -f "$1" ] || return 0
    python3 -c 'import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        if str(r.get("allocator", "")).startswith("gpumem"):
            r["allocator"] += "@" + sys.argv[2]
        print(json.dumps(r))' "$1" "$2"
}
start=$(date +%s)
: > "$OUT/summary.txt"
: > "$OUT/ab_wheels.jsonl"
for r in $(seq 1 "$ROUNDS"); do
    for v in old new; do
        if [ $(( $(date +%s) - start )) -gt "${AB_BUDGET_S:-400}" ]; then
            echo "ab_wheels.sh: time budget spent, stopped before round $r ($v)" | tee -a "$OUT/summary.txt"
            break 2
        fi
        GPUMEM_BENCH_STEP_CALLS=1 PYTHONPATH=/tmp/gpumem-$v python3 scripts/bench_workloads.py \
            --workloads "$WORKLOADS" --repeat 1 --no-maxbatch --out "$OUT/$v/r$r" "${EXTRA[@]}" \
            > "$OUT/$v.r$r.log" 2>&1
        rc=$?
        echo "$v round $r rc=$rc: $(grep -A20 '^Median step' "$OUT/$v.r$r.log" | grep -v '^Median\|^workload' | sed '/^$/q' | tr -s ' ' | tr '\n' ';')" >> "$OUT/summary.txt"
        # Every run in one file, gpumem's named by build (gpumem@old, gpumem@new), for
        # scripts/step_driver_time.py.
        relabel "$OUT/$v/r$r/bench_workloads.jsonl" "$v" >> "$OUT/ab_wheels.jsonl"
    done
done
cat "$OUT/summary.txt"
for w in ${WORKLOADS//,/ }; do
    python3 scripts/step_driver_time.py "$OUT/ab_wheels.jsonl" --workload "$w" || true
done
