#!/usr/bin/env python3
"""GPU time of the same kernels under each allocator, beside PyTorch's own allocator.

Reads the JSON lines of `bench_workloads.py` run with GPUMEM_BENCH_KERNEL_TIME=1, in which every
run recorded, for its timed steps, the GPU time of its kernels, copies and memsets (total per
step, and the largest entries by name). The workloads are seeded, so every allocator runs the
same kernels on the same shapes; only the memory under them differs. A kernel that runs slower
on one allocator's memory shows here even when step time drifts by more than the difference.

Per workload it prints:
- per allocator, the GPU time per step of every round ÷ the same round's native run, and the
  median over rounds;
- the kernels with the most time under native: their µs per step under native, and each
  allocator's time for the same name ÷ native's (median over rounds).

Usage: python3 scripts/kernel_time.py BENCH_WORKLOADS.jsonl [--top 12]
No dependency beyond Python 3."""
import argparse
import json
import statistics
import sys
from collections import defaultdict


def load(jsonl):
    """{workload: {round: {allocator: kernel_time}}} of the runs that recorded kernel time."""
    runs = defaultdict(lambda: defaultdict(dict))
    with open(jsonl) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            kt = r.get("kernel_time")
            if kt and r.get("workload") and r.get("allocator"):
                runs[r["workload"]][r.get("round", 0)][r["allocator"]] = kt
    return runs


def per_name(kt):
    """{name: µs per step} of one run."""
    return {name: us / kt["steps"] for name, _count, us in kt["by_name"]}


def short(name, width=58):
    return name if len(name) <= width else name[: width - 1] + "…"


def compare(rounds, top):
    """The figures `report` prints, for one workload's rounds ({round: {allocator: kernel_time}}):
    {"native_us": median µs per step under native, or None,
     "allocators": {name: {"us": median µs per step, "ratios": [per round ÷ native]}},
     "kernels": [(name, native µs per step, {allocator: median ratio or None})]}."""
    allocators = []
    for by_alloc in rounds.values():
        for a in by_alloc:
            if a not in allocators:
                allocators.append(a)
    others = [a for a in allocators if a != "native"]
    paired = [by for by in rounds.values() if "native" in by]
    if not paired:
        return {"native_us": None, "allocators": {}, "kernels": []}
    out = {"native_us": statistics.median(by["native"]["us_per_step"] for by in paired),
           "allocators": {}, "kernels": []}
    for a in others:
        ratios = [by[a]["us_per_step"] / by["native"]["us_per_step"] for by in paired if a in by]
        if ratios:
            out["allocators"][a] = {"us": statistics.median(by[a]["us_per_step"] for by in paired if a in by),
                                    "ratios": ratios}
    native_names = defaultdict(list)
    for by in paired:
        for name, us in per_name(by["native"]).items():
            native_names[name].append(us)
    ranked = sorted(native_names.items(), key=lambda kv: -statistics.median(kv[1]))[:top]
    for name, us_list in ranked:
        cells = {}
        for a in others:
            ratios = []
            for by in paired:
                if a in by:
                    mine, theirs = per_name(by[a]).get(name), per_name(by["native"]).get(name)
                    if mine and theirs:
                        ratios.append(mine / theirs)
            cells[a] = statistics.median(ratios) if ratios else None
        out["kernels"].append((name, statistics.median(us_list), cells))
    return out


def report(workload, rounds, top):
    c = compare(rounds, top)
    print(f"\n== {workload}: GPU time of kernels, copies and memsets per timed step")
    if c["native_us"] is None:
        print("  (no native run: nothing to compare with)")
        return
    print(f"{'allocator':<22} {'µs/step (median)':>17} {'÷ native, per round':>30} {'median':>8}")
    print(f"{'native':<22} {c['native_us']:>17.0f}")
    for a, f in c["allocators"].items():
        per_round = " ".join(f"{x:.4f}" for x in f["ratios"])
        print(f"{a:<22} {f['us']:>17.0f} {per_round:>30} {statistics.median(f['ratios']):>8.4f}")
    others = list(c["allocators"])
    header = f"{'kernel (largest under native)':<58} {'native µs':>10}" + "".join(f" {a[:14]:>14}" for a in others)
    print("\n" + header)
    for name, us, cells in c["kernels"]:
        row = f"{short(name):<58} {us:>10.0f}"
        for a in others:
            r = cells.get(a)
            row += f" {r:>14.4f}" if r is not None else f" {'-':>14}"
        print(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per workload")
    args = ap.parse_args()
    runs = load(args.jsonl)
    if not runs:
        print(f"{args.jsonl}: no run recorded kernel_time (run bench_workloads.py with GPUMEM_BENCH_KERNEL_TIME=1)",
              file=sys.stderr)
        return 1
    for workload, rounds in runs.items():
        report(workload, rounds, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
