#!/usr/bin/env bash
# Where the spread of `gpumem bench alloc` on the GPU host comes from. Session 37's H100 run
# read stitched's 64 MiB random case at 190.7, 130.2 and 197.8 ns in three timed runs of one
# call (caching 89.3, 90.8, 87.8 beside it); on the development machine the same binary on the
# simulated device reads 65-78 ns from run to run. This runs the same binary, every timed run
# printed: with the driver, unpinned and pinned to one CPU (taskset), twice each; then on the
# simulated device (slack:0.1, so that no page is remapped, as on the GPU once the remap budget
# has raised the spare pages) unpinned and pinned; then, where perf works, the CPU's own counts
# (instructions, cycles, branch misses, migrations) for each policy.
#
# Before: `bash scripts/device/cuda.sh build` on the development machine; carry
# target/release/gpumem. On the GPU machine, from the repository root:
#     OUT=/some/folder bash scripts/device/alloc_spread.sh
# Optional: POLICIES ("stitched caching"), CASE (random_512B_64MiB_live500), RUNS (9), CPU (4).
# Output: $OUT/table.txt (one line per figure: where, policy, each run's ns per op, driver
# calls per timed run), $OUT/perf_<policy>.txt, $OUT/machine.txt; the table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out/alloc_spread}"
mkdir -p "$OUT"
BIN=target/release/gpumem
[[ -x "$BIN" ]] || { echo "alloc_spread.sh: $BIN is missing: run 'bash scripts/device/cuda.sh build' first" >&2; exit 2; }
POLICIES=${POLICIES:-stitched caching}
CASE=${CASE:-random_512B_64MiB_live500}
RUNS=${RUNS:-9}
CPU=${CPU:-4}
{ nproc; lscpu; nvidia-smi -L; } > "$OUT/machine.txt" 2>&1
: > "$OUT/table.txt"
args=(bench alloc --case "$CASE" --runs "$RUNS" --no-baselines --json)
for p in $POLICIES; do args+=(-p "$p"); done

one() { # label, then the command
    local label=$1
    shift
    "$@" 2>> "$OUT/stderr.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    runs = ' '.join('%.1f' % x for x in r['runs_ns_per_op'])
    print('$label'.ljust(12), r['allocator'].ljust(18), runs, '| driver calls per run', r.get('driver_calls_per_run'))
" | tee -a "$OUT/table.txt" > /dev/null
}

for round in 1 2; do
    one "cuda" "$BIN" "${args[@]}"
    one "cuda cpu$CPU" taskset -c "$CPU" "$BIN" "${args[@]}"
done
one "sim" "$BIN" "${args[@]}" --sim --conf slack:0.1
one "sim cpu$CPU" taskset -c "$CPU" "$BIN" "${args[@]}" --sim --conf slack:0.1
if command -v perf > /dev/null; then
    for p in $POLICIES; do
        perf stat -e instructions,cycles,branch-misses,cpu-migrations,context-switches -- \
            "$BIN" bench alloc -p "$p" --case "$CASE" --runs "$RUNS" --no-baselines \
            > "$OUT/perf_$p.txt" 2>&1
        echo "== perf, $p" >> "$OUT/table.txt"
        grep -E "instructions|cycles|branch-misses|migrations|switches" "$OUT/perf_$p.txt" >> "$OUT/table.txt"
    done
fi
grep -E "Model name|^CPU\(s\)|NUMA node\(s\)" "$OUT/machine.txt"
cat "$OUT/table.txt"
