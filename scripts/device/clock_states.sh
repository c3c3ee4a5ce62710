#!/usr/bin/env bash
# Why are some runs slow on a host: a lower clock, time taken by others, a shared core, or a
# core that does less per cycle for the same code? The lent GPU machines run the same code at
# two speeds about 1.45x apart (BENCHMARKS.md §4, session 49), and their virtual machines
# expose no hardware counters. `gpumem bench alloc` measures the core's
# clock on the timed thread before each single-thread run (`runs_clock_ghz`, from a chain of
# dependent adds) and the independent adds it retires per cycle (`runs_adds_per_cycle`, four
# chains: lower when another thread shares the physical core; crates/gpumem-cuda/src/bench/
# clock.rs), and the share of the run its thread spent on a CPU and waiting for one
# (`runs_on_cpu_share`, `runs_waiting_share`, the kernel's account: bench/thread_time.rs).
# This script runs caching and stitched on the simulated device, pinned to one CPU, ROUNDS
# times, and sets every run's time beside these readings.
#
# Reading it, for the slow runs against the fast ones:
# - a clock about as much lower: the host drops its clock; cycles per op (ns x GHz) stay put;
# - a smaller share on a CPU: other processes (waiting share) or the hypervisor (neither
#   share) took the time; the CPU time per op (ns x on-CPU share) stays put;
# - fewer adds per cycle: another thread shares the physical core;
# - none of these: the core did less per cycle for what the probes do not touch (caches,
#   memory).
#
# Usage, from the repository root (on the GPU machine: the binary built on the development
# machine and carried; it runs anywhere, the simulated device needs no GPU):
#     OUT=/some/dir bash scripts/device/clock_states.sh
# Optional: BIN (target/release/gpumem), ROUNDS (12), CPU (3), CASE (random_512B_64MiB_live500),
# RUNS (9 timed runs per invocation).
#
# Output: JSON lines in $OUT/r<round>.jsonl; on stdout, per round each policy's median ns and
# its clocks, then per policy the range of each reading over every run, and the runs split at
# the middle of their range of ns (slow and fast) with the median of each reading.
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
# Per run: ns per op, GHz, adds per cycle, on-CPU share, waiting share.
runs = {}
print("round  policy: median ns (clock range, GHz)")
for path in sorted(glob.glob(out + "/r*.jsonl")):
    row = []
    for line in open(path):
        m = json.loads(line)
        name = m["allocator"].split(":")[1]
        ns, ghz = m["runs_ns_per_op"], m.get("runs_clock_ghz", [])
        n = len(ns)
        cols = [m.get(k) or [float("nan")] * n for k in
                ("runs_clock_ghz", "runs_adds_per_cycle", "runs_on_cpu_share", "runs_waiting_share")]
        runs.setdefault(name, []).extend(zip(ns, *cols))
        row.append(f"{name}: {st.median(ns):.1f} ({min(ghz):.2f}-{max(ghz):.2f})" if ghz else f"{name}: {st.median(ns):.1f}")
    print(f"{path.rsplit('/', 1)[1][1:-6]:>5}  " + "  ".join(row))

def rng(xs, f):
    return f"{f(min(xs))}-{f(max(xs))}"
print("\npolicy     runs  ns per op     GHz        adds/cycle  on CPU     waiting    cycles/op (median)  CPU ns/op (median)")
for name, v in runs.items():
    ns, ghz, apc, cpu, wait = (list(c) for c in zip(*v))
    cyc = [x * g for x, g in zip(ns, ghz)]
    cns = [x * c for x, c in zip(ns, cpu)]
    pct = lambda x: f"{100 * x:3.0f}%"
    print(f"{name:<10}{len(v):>5}  {rng(ns, lambda x: f'{x:5.1f}')}  {rng(ghz, lambda x: f'{x:.2f}')}  "
          f"{rng(apc, lambda x: f'{x:.2f}')}   {rng(cpu, pct)}  {rng(wait, pct)}  "
          f"{rng(cyc, lambda x: f'{x:4.0f}')} ({st.median(cyc):.0f})   {rng(cns, lambda x: f'{x:5.1f}')} ({st.median(cns):.1f})")
print("\nruns split at the middle of each policy's range of ns: count, median ns, GHz, adds/cycle, on CPU, waiting")
for name, v in runs.items():
    mid = (min(x[0] for x in v) + max(x[0] for x in v)) / 2
    for label, part in (("fast", [x for x in v if x[0] <= mid]), ("slow", [x for x in v if x[0] > mid])):
        if part:
            med = [st.median(x[i] for x in part) for i in range(5)]
            print(f"{name:<10}{label}  {len(part):>4}  {med[0]:6.1f} ns  {med[1]:.2f} GHz  {med[2]:.2f}  "
                  f"{100 * med[3]:3.0f}%  {100 * med[4]:3.0f}%")
PY
