#!/usr/bin/env python3
"""Each timed step of a workload under gpumem beside the same step under PyTorch's allocator:
how much of a step's extra time its driver calls explain.

Reads the JSON lines of `bench_workloads.py` run with GPUMEM_BENCH_STEP_CALLS=1 (for example
through scripts/device/workloads_ab.sh), in which every gpumem run records the driver calls of
each step. The same step of every run draws the same batch (the workloads are seeded), so a
step's excess is its time less the median of that step over the native runs (native and
native-again). Per allocator it prints, over all its runs' timed steps:

- the mean driver time per step and the mean excess over native;
- the least-squares line excess = slope × driver ms + intercept (a slope near 1: every
  millisecond in the driver is a millisecond of step, the host is the bottleneck);
- the median excess of the steps with (almost) no driver time, and of those with at least
  0.5 ms of it;
- per run: mean driver ms, mean excess, and the pages mapped in the timed steps; and, where
  steps made a host wait (`cuEventSynchronize`), their mean excess less the median excess of
  the same run's steps without driver calls, which takes out the run's own offset.

If the runs also recorded GPUMEM_BENCH_STEP_SPLIT=1, it then prints where the time went, per
run: the mean over timed steps of wall time, host launch time, the thread's CPU time while
launching, the wait in synchronize and the GPU's span, in ms, each also as the excess over the
median of the same step's figure in the native runs. Extra launch with extra CPU is host
work; extra launch without extra CPU, a slower or busier host; extra wait with the same
launch, slower GPU work.

Usage: python3 scripts/step_driver_time.py BENCH_WORKLOADS.jsonl [--workload prefetch_mlp]
No dependency beyond Python 3."""
import argparse
import json
import statistics
import sys
from collections import defaultdict

QUIET_MS = 0.1
BUSY_MS = 0.5


WARMUP = 3


def driver_ms(step):
    """Host milliseconds in driver calls of one step's record ({call: [count, seconds]})."""
    return 1000.0 * sum(seconds for _, seconds in step.values())


def load_runs(jsonl, workload):
    """The runs of `workload` in `jsonl` with step times, by allocator."""
    runs = defaultdict(list)
    with open(jsonl) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("workload") == workload and r.get("allocator") and r.get("step_s"):
                runs[r["allocator"]].append(r)
    return runs


def native_steps(runs, where):
    """(steps every run has, the median native time of each step in ms); exits without a
    native run."""
    natives = runs.get("native", []) + runs.get("native-again", [])
    if not natives:
        sys.exit(f"no native runs in {where}")
    steps = min(len(r["step_s"]) for rs in runs.values() for r in rs)
    return steps, [1000.0 * statistics.median(r["step_s"][i] for r in natives) for i in range(steps)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--workload", default="prefetch_mlp")
    args = ap.parse_args()

    runs = load_runs(args.jsonl, args.workload)
    steps, base = native_steps(runs, f"{args.jsonl} for {args.workload}")

    print(f"{args.workload}: {steps - WARMUP} timed steps per run, excess over the median native step")
    print(f"{'allocator':<16} {'runs':>4} {'drv ms':>7} {'excess':>7} {'slope':>6} {'icpt':>6} "
          f"{'quiet':>12} {'busy':>12}")
    details = []
    for name in sorted(runs):
        xs, ys = [], []
        for k, r in enumerate(runs[name]):
            per_step = r.get("gpumem_step_driver_calls")
            if per_step is not None and len(per_step) < steps:
                per_step = None
            rx, ry = [], []
            for i in range(WARMUP, steps):
                rx.append(driver_ms(per_step[i]) if per_step else 0.0)
                ry.append(1000.0 * r["step_s"][i] - base[i])
            xs += rx
            ys += ry
            if per_step:
                maps = sum(per_step[i].get("cuMemMap", [0, 0])[0] for i in range(WARMUP, steps))
                line = (f"  {name} run {k}: driver {statistics.mean(rx):.2f} ms/step, "
                        f"excess {statistics.mean(ry):+.2f} ms/step, {maps} pages mapped")
                # Steps with a host wait against the same run's steps without driver calls:
                # the run's own offset (this host moves whole runs by several %) cancels.
                waits = [y for i, y in zip(range(WARMUP, steps), ry)
                         if per_step[i].get("cuEventSynchronize", [0, 0])[0] > 0]
                quiet = [y for x, y in zip(rx, ry) if x < QUIET_MS]
                if waits and quiet:
                    line += (f"; {len(waits)} steps with a host wait, "
                             f"{statistics.mean(waits) - statistics.median(quiet):+.1f} ms "
                             "each against the run's quiet steps")
                details.append(line)
        mx, my = statistics.mean(xs), statistics.mean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        quiet = [y for x, y in zip(xs, ys) if x < QUIET_MS]
        busy = [y for x, y in zip(xs, ys) if x >= BUSY_MS]
        q = f"{statistics.median(quiet):+.2f} ({len(quiet)})" if quiet else "–"
        b = f"{statistics.median(busy):+.2f} ({len(busy)})" if busy else "–"
        print(f"{name:<16} {len(runs[name]):>4} {mx:>7.2f} {my:>+7.2f} {slope:>6.2f} "
              f"{my - slope * mx:>+6.2f} {q:>12} {b:>12}")
    print(f"(quiet: steps under {QUIET_MS} ms of driver calls; busy: at least {BUSY_MS} ms; "
          "median excess, with the number of steps)")
    print("\n".join(details))
    print_split(runs, steps, base)


SPLIT_KEYS = ["launch", "cpu", "wait", "gpu"]


def print_split(runs, steps, wall_base):
    """Where each run's step time went, beside the native runs' median of each step
    (`wall_base`: the median native step time of each step, from `native_steps`)."""
    natives = [r for name in ("native", "native-again") for r in runs.get(name, [])
               if r.get("step_split")]
    if not natives:
        return
    base = {k: [1000.0 * statistics.median(r["step_split"][i][k] for r in natives)
                for i in range(steps)] for k in SPLIT_KEYS}
    base["wall"] = wall_base
    print("\nwhere the time went, ms per timed step: mean (mean excess over native's median)")
    print(f"{'run':<20}" + "".join(f"{k:>18}" for k in ["wall"] + SPLIT_KEYS))
    for name in sorted(runs):
        for k, r in enumerate(runs[name]):
            sp = r.get("step_split")
            if not sp or len(sp) < steps:
                continue
            line = f"{name + ' ' + str(k):<20}"
            for key in ["wall"] + SPLIT_KEYS:
                vals = [1000.0 * (r["step_s"][i] if key == "wall" else sp[i][key])
                        for i in range(WARMUP, steps)]
                exc = [v - base[key][i] for v, i in zip(vals, range(WARMUP, steps))]
                line += f"{statistics.mean(vals):>9.2f} ({statistics.mean(exc):+6.2f})"
            print(line)


if __name__ == "__main__":
    main()
