#!/usr/bin/env python3
"""Times `gpumem replay TRACE --policy P` against Python's own `pickle.load` of the same file, on
the same machine in the same run (best of N wall times each, in separate processes), and prints
the ratio. The target of issue 2: replay of shared/traces/llama_decode.pickle.gz under one
policy in at most half of pickle.load's time.

    python3 scripts/bench_trace_load.py ../shared/traces/llama_decode.pickle.gz [--policy native] [--runs 5]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time


def best(cmd, runs):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return min(times), times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--policy", default="native")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gpumem", default=os.path.join(os.path.dirname(__file__), "..", "target", "release", "gpumem"))
    a = ap.parse_args()
    if not os.path.exists(a.gpumem):
        sys.exit(f"{a.gpumem} not found: cargo build --release -p gpumem-cli")
    py = [sys.executable, "-c", f"import gzip, pickle; pickle.load(gzip.open({a.trace!r}, 'rb'))"]
    gm = [a.gpumem, "replay", a.trace, "--policy", a.policy, "--json"]
    t_py, all_py = best(py, a.runs)
    t_gm, all_gm = best(gm, a.runs)
    out = {
        "trace": a.trace, "policy": a.policy, "machine": f"{platform.node()} {os.cpu_count()} cores",
        "python_pickle_load_s": round(t_py, 3), "gpumem_replay_s": round(t_gm, 3),
        "ratio": round(t_gm / t_py, 3), "runs": a.runs,
        "all_python_s": [round(x, 3) for x in all_py], "all_gpumem_s": [round(x, 3) for x in all_gm],
    }
    print(json.dumps(out))
    print(f"pickle.load {t_py:.3f} s | gpumem replay --policy {a.policy} {t_gm:.3f} s | "
          f"ratio {t_gm / t_py:.3f} (target <= 0.5)", file=sys.stderr)


if __name__ == "__main__":
    main()
