#!/usr/bin/env python3
"""Compare gpumem configurations on runs that freed their tensors in the same order.

A workload's runs do not all free in the same order (the prefetch pipeline draws one of a few
orders per run; BENCHMARKS.md §3, session 17), and how much the stitched policy remaps depends
on it more than on most settings. So unpaired rounds mix the two effects. This script groups
the runs of `bench_workloads.py` by the order of their allocation requests, read from the
snapshot each gpumem run wrote, and prints each group's runs side by side.

Record the runs with, on the GPU machine:

    GPUMEM_CONF=history:300000 GPUMEM_BENCH_STEP_CALLS=1 GPUMEM_BENCH_SNAPSHOT_DIR=$OUT/snaps \\
    OUT=$OUT/ab bash scripts/device/workloads_ab.sh prefetch_mlp 4 \\
        --allocators native,gpumem,gpumem-stream \\
        --variant gpumem-stream=range:stream,history:300000

then, wherever the files came back:

    python3 scripts/pair_by_order.py ab/bench_workloads.jsonl snaps/

Per run: pages mapped and host ms in driver calls per step over the timed steps (from
GPUMEM_BENCH_STEP_CALLS), and the mean step's excess over the median native step (the
workloads are seeded: step i draws the same batch in every run). Only gpumem runs have
snapshots; the order of a native run is unknown. No dependency beyond Python 3."""
import argparse
import gzip
import hashlib
import os
import pickle
import statistics
import sys
from collections import defaultdict

from step_driver_time import WARMUP, driver_ms, load_runs, native_steps  # same folder


def load_snapshot(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def request_order(snapshot):
    """A short hash of the order of allocation requests: (action, size, stream by first use)."""
    streams = {}
    key = []
    for trace in snapshot.get("device_traces", []):
        for e in trace:
            if e.get("action") in ("alloc", "free_requested"):
                s = streams.setdefault(e.get("stream"), len(streams))
                key.append((e["action"], e["size"], s))
    if not key:
        return None
    return hashlib.md5(repr(key).encode()).hexdigest()[:8]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", help="bench_workloads.jsonl")
    ap.add_argument("snapshots", help="the folder GPUMEM_BENCH_SNAPSHOT_DIR pointed at")
    ap.add_argument("--workload", default="prefetch_mlp")
    args = ap.parse_args()

    by_allocator = load_runs(args.jsonl, args.workload)
    steps, base = native_steps(by_allocator, f"{args.jsonl} for {args.workload}")

    groups = defaultdict(list)
    for r in (r for rs in by_allocator.values() for r in rs):
        snap = r.get("gpumem_snapshot")
        if not snap:
            continue
        path = os.path.join(args.snapshots, os.path.basename(snap))
        if not os.path.exists(path):
            print(f"missing snapshot {path}", file=sys.stderr)
            continue
        order = request_order(load_snapshot(path))
        per_step = r.get("gpumem_step_driver_calls") or []
        timed = per_step[WARMUP:steps]
        pages = sum(s.get("cuMemMap", [0, 0])[0] for s in timed)
        driver = statistics.mean(driver_ms(s) for s in timed) if timed else float("nan")
        excess = statistics.mean(1000.0 * r["step_s"][i] - base[i] for i in range(WARMUP, steps))
        groups[order].append((r["allocator"], os.path.basename(path), pages, driver, excess))

    if not groups:
        sys.exit("no gpumem run with a snapshot (set GPUMEM_BENCH_SNAPSHOT_DIR and history:N)")
    print(f"{'order':<9} {'allocator':<16} {'pages mapped':>12} {'driver ms/step':>15} "
          f"{'excess ms/step':>15}  snapshot")
    for order, members in sorted(groups.items(), key=lambda g: -len(g[1])):
        for name, snap, pages, driver, excess in sorted(members):
            print(f"{order:<9} {name:<16} {pages:>12} {driver:>15.2f} {excess:>+15.2f}  {snap}")
        print()
    print("(timed steps only; excess over the median native step of the same index)")


if __name__ == "__main__":
    main()
