#!/usr/bin/env bash
# Is a host's slow state a lower core clock, or a core that does less per cycle? The lent GPU
# machines run the same code at two speeds about 1.45x apart (BENCHMARKS.md §4, session 49), and
# their virtual machines expose no hardware counters. `gpumem bench alloc` measures the core's
# clock on the timed thread before each single-thread run (`runs_clock_ghz`, from a chain of
# dependent adds) and the independent adds it retires per cycle (`runs_adds_per_cycle`, four
# chains: lower when another thread shares the physical core; crates/gpumem-cuda/src/bench/
# clock.rs). This script runs caching and stitched on the simulated device, pinned to one CPU,
# ROUNDS times, and sets every run's time beside the two.
#
# Reading it: if the slow runs come with a clock about 1.45x lower, the host drops its clock,
# and cycles per op (ns x GHz) stay put. If the clock holds while the time grows, the core does
# less per cycle: with fewer adds per cycle, another thread shares the core; with as many, the
# slowdown is in what the probes do not touch (caches, memory).
#
# Usage, from the repository root (on the GPU machine: the binary built on the development
# machine and carried; it runs anywhere, the simulated device needs no GPU):
#     OUT=/some/dir bash scripts/device/clock_states.sh
# Optional: BIN (target/release/gpumem), ROUNDS (12), CPU (3), CASE (random_512B_64MiB_live500),
# RUNS (9 timed runs per invocation).
#
# Output: JSON lines in $OUT/r<round>.jsonl; on stdout, per round each policy's median ns and
# its clocks, then per policy the range of ns, GHz, adds per cycle and cycles per op over every
# run, the correlation of ns with GHz and with adds per cycle, and the runs split at the middle
# of their range of ns (slow and fast), with the median clock and adds per cycle of each.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/gpumem}
OUT=${OUT:-$PWD/out/clock_states}
ROUNDS=${ROUNDS:-12}
CPU=${CPU:-3}
CASE=${CASE:-random_512B_64MiB_live500}
RUNS=${RUNS:-9}
[[ -x "$BIN" ]] || { echo "clock_states.sh: $BIN is not an executable" >&2; exit 2; }
"$BIN" bench alloc --help | grep -q -- --no-clock \
    || { echo "clock_states.sh: $BIN predates the clock probe" >&2; exit 2; }
taskset -c "$CPU" true 2>/dev/null || { echo "clock_states.sh: no CPU $CPU here" >&2; exit 2; }
mkdir -p "$OUT"
{ grep -m1 "model name" /proc/cpuinfo; nproc; nvidia-smi --query-gpu=name,uuid --format=csv,noheader 2>/dev/null; } \
    | tee "$OUT/host.txt"
for r in $(seq -w "$ROUNDS"); do
    echo "round $r of $ROUNDS" >&2
    taskset -c "$CPU" "$BIN" bench alloc --sim --conf slack:0.1 -p caching -p stitched --threads 1 \
        --runs "$RUNS" --case "$CASE" --no-baselines --json-out "$OUT/r$r.jsonl" >/dev/null 2>&1 \
        || { echo "clock_states.sh: round $r failed" >&2; exit 1; }
done
python3 - "$OUT" <<'PY'
import glob, json, statistics as st, sys
out = sys.argv[1]
runs = {}
print("round  policy: median ns (clock range, GHz)")
for path in sorted(glob.glob(out + "/r*.jsonl")):
    row = []
    for line in open(path):
        m = json.loads(line)
        name = m["allocator"].split(":")[1]
        ns, ghz = m["runs_ns_per_op"], m.get("runs_clock_ghz", [])
        runs.setdefault(name, []).extend(zip(ns, ghz, m.get("runs_adds_per_cycle", [])))
        row.append(f"{name}: {st.median(ns):.1f} ({min(ghz):.2f}-{max(ghz):.2f})" if ghz else f"{name}: {st.median(ns):.1f}")
    print(f"{path.rsplit('/', 1)[1][1:-6]:>5}  " + "  ".join(row))
def corr(a, b):
    ok = len(a) > 2 and st.pstdev(a) > 0 and st.pstdev(b) > 0
    return st.correlation(a, b) if ok else float("nan")
print("\npolicy     runs   ns per op      GHz         adds/cycle   cycles per op (median)   corr(ns, GHz)  corr(ns, adds/cycle)")
for name, v in runs.items():
    ns, ghz, apc = [x[0] for x in v], [x[1] for x in v], [x[2] for x in v]
    cyc = [x * g for x, g in zip(ns, ghz)]
    print(f"{name:<10}{len(v):>5}   {min(ns):5.1f}-{max(ns):5.1f}   {min(ghz):.2f}-{max(ghz):.2f}   "
          f"{min(apc):.2f}-{max(apc):.2f}    {min(cyc):4.0f}-{max(cyc):4.0f} ({st.median(cyc):.0f})"
          f"          {corr(ns, ghz):+.2f}          {corr(ns, apc):+.2f}")
print("\nruns split at the middle of each policy's range of ns: count, median ns, GHz, adds/cycle")
for name, v in runs.items():
    mid = (min(x[0] for x in v) + max(x[0] for x in v)) / 2
    for label, part in (("fast", [x for x in v if x[0] <= mid]), ("slow", [x for x in v if x[0] > mid])):
        if part:
            print(f"{name:<10}{label}  {len(part):>4}  {st.median(x[0] for x in part):6.1f} ns  "
                  f"{st.median(x[1] for x in part):.2f} GHz  {st.median(x[2] for x in part):.2f}")
PY
