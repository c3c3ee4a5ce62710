#!/usr/bin/env bash
# Allocation latency of several gpumem builds on one GPU machine, pinned to one CPU and
# alternated round by round: the way to compare builds on the lent hosts, whose CPUs are not
# all equally fast at a given moment (BENCHMARKS.md §4, session 45) and whose speed drifts over
# minutes. Each round runs every build once per case, `bench alloc -p caching -p stitched
# --threads 1 --runs 9 --no-baselines`, under `taskset -c CPU`; caching is measured alongside as
# a control (a change to stitched should leave it alone, so its drift between builds shows the
# noise). POLICIES changes the policies measured (e.g. "buddy caching stitched" to check that a
# change to the engine slowed none of them). With MT=1, each round also runs the multi-thread
# case (`--threads 1,2,4,8 --runs 5`, unpinned: the threads need CPUs of their own).
#
# Usage, from the repository root on the GPU machine (binaries built on the development
# machine, stripped with `strip --strip-debug`, carried in the git-ignored .device/):
#     BINS="main:.device/gpumem.main new:target/release/gpumem" OUT=/some/dir \
#         bash scripts/device/ab_pinned.sh
# Optional: ROUNDS (8), CPU (3), POLICIES ("caching stitched"), CASES (default: the 64 MiB
# random case; any of `bench alloc --case`), MT, MT_CPUS (taskset list for the multi-thread
# case, default all), EXTRA (more `bench alloc` arguments, e.g. --sim to try the script without
# a GPU).
#
# Output: every figure as JSON lines in $OUT/<build>.r<round>.<case>.jsonl, and a table of each
# build's median over the rounds (with the rounds' range) per allocator and case on stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/ab_pinned}
ROUNDS=${ROUNDS:-8}
CPU=${CPU:-3}
CASES=${CASES:-random_512B_64MiB_live500}
EXTRA=${EXTRA:-}
pflags=()
for p in ${POLICIES:-caching stitched}; do pflags+=(-p "$p"); done
[[ -n "${BINS:-}" ]] || { echo "ab_pinned.sh: set BINS to \"name:binary ...\"" >&2; exit 2; }
for nb in $BINS; do
    [[ -x "${nb#*:}" ]] || { echo "ab_pinned.sh: ${nb#*:} is not an executable" >&2; exit 2; }
done
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,uuid --format=csv,noheader 2>/dev/null || echo "no GPU"
  grep -m1 "model name" /proc/cpuinfo; grep -m1 "^model\s" /proc/cpuinfo; } > "$OUT/machine.txt"

for r in $(seq "$ROUNDS"); do
    echo "== round $r/$ROUNDS" >&2
    for nb in $BINS; do
        n=${nb%%:*} b=${nb#*:}
        for c in $CASES; do
            # shellcheck disable=SC2086  # EXTRA is a list of arguments
            taskset -c "$CPU" "$b" bench alloc "${pflags[@]}" --threads 1 --case "$c" \
                --runs 9 --no-baselines $EXTRA --json-out "$OUT/$n.r$r.$c.jsonl" \
                > "$OUT/$n.r$r.$c.txt" 2>&1 || echo "ab_pinned.sh: $n round $r $c failed" >&2
        done
        if [[ -n "${MT:-}" ]]; then
            # shellcheck disable=SC2086
            taskset -c "${MT_CPUS:-0-$(($(nproc) - 1))}" "$b" bench alloc "${pflags[@]}" \
                --threads 1,2,4,8 --case mt_random_512B_1MiB_live200 --runs 5 --no-baselines \
                $EXTRA --json-out "$OUT/$n.r$r.mt.jsonl" > "$OUT/$n.r$r.mt.txt" 2>&1 \
                || echo "ab_pinned.sh: $n round $r multi-thread failed" >&2
        fi
    done
done

python3 - "$OUT" "$ROUNDS" $BINS <<'PY'
import collections, glob, json, statistics, sys
out, rounds, bins = sys.argv[1], int(sys.argv[2]), [b.split(':')[0] for b in sys.argv[3:]]
fig = collections.defaultdict(list)
for n in bins:
    for r in range(1, rounds + 1):
        for path in glob.glob(f"{out}/{n}.r{r}.*.jsonl"):
            for line in open(path):
                d = json.loads(line)
                case = d['case'] + ('' if d['threads'] == 1 else ' x%d' % d['threads'])
                fig[(d['allocator'], case, n)].append(d['ns_per_op'])
print("%-40s %s" % ("allocator, case (ns per op)", "  ".join("%22s" % n for n in bins)))
for a, c in sorted({(a, c) for a, c, _ in fig}):
    cells = []
    for n in bins:
        v = fig.get((a, c, n), [])
        cells.append("%7.1f (%5.1f-%5.1f)" % (statistics.median(v), min(v), max(v)) if v else "%22s" % "-")
    print("%-40s %s" % (a.replace('gpumem:', '') + ' ' + c, "  ".join(cells)))
PY
