#!/usr/bin/env python3
"""Do kernels run as fast on memory from gpumem as on memory from PyTorch's allocator?

gpumem's default policy backs tensors with separate 2 MiB physical pages (cuMemCreate) mapped
side by side, some of them mapped at more than one address over a run; PyTorch's allocator
hands out pieces of large cudaMalloc segments. If the GPU's address translation (its TLBs)
or caches treated the two differently, a training step could take longer on the GPU with
gpumem even with no allocator call in it. This measures that directly, one fresh process per
allocator, on the same tensors:

1. fragment the pool: tensors of random sizes (1-64 MiB, seeded) up to --frag-gib, every
   other one freed, so that the tensors below land in holes and fresh memory as in a
   training run's later steps;
2. allocate A and B (--gib each, float32) and an 8192 x 8192 bfloat16 matmul's operands;
3. time, with CUDA events (median of --reps): B.copy_(A) (streaming, one address
   translation per 2 MiB), a gather of 64 Mi random elements of A (a translation per element,
   spread over all of A: the case that misses TLBs), and the matmul (compute-bound, a
   control that should not move).

Prints GB/s (gather: elements per ns) and TFLOP/s per allocator and each as a ratio to
native's, same machine, same run. Allocators (--allocators): native, expandable
(expandable_segments:True), gpumem (GPUMEM_CONF as set, default policy stitched),
gpumem-caching (policy:caching: cuMemAlloc segments, no mapping), gpumem-page16 (the default
policy on 16 MiB physical pages), and any --variant NAME=CONF (e.g. gpumem-page8=page:8MiB). Needs a CUDA GPU, PyTorch, and gpumem
importable for the gpumem run.

    python3 scripts/kernel_pages.py [--gib 4] [--frag-gib 16] [--reps 20] [--json OUT.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# name -> (PYTORCH_CUDA_ALLOC_CONF, GPUMEM_CONF)
ALLOCATORS = {
    "native": (None, None),
    "expandable": ("expandable_segments:True", None),
    "gpumem": (None, None),
    "gpumem-caching": (None, "policy:caching"),
    "gpumem-page16": (None, "page:16MiB"),
}


def child(args) -> None:
    if args.allocator.startswith("gpumem"):
        import gpumem

        gpumem.torch.install()
    import torch

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    # 1. A fragmented pool: random sizes, every other tensor freed.
    held, total = [], 0
    while total < args.frag_gib << 30:
        n = int(torch.randint(1 << 20, 64 << 20, (1,), generator=g)) // 4
        held.append(torch.empty(n, dtype=torch.float32, device=dev))
        total += 4 * n
    del held[::2]
    # 2. The tensors timed.
    n = (args.gib << 30) // 4
    a = torch.rand(n, device=dev)
    b = torch.empty_like(a)
    idx = torch.randint(0, n, (64 << 20,), device=dev)
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def timed(fn) -> float:
        """Median seconds of fn over args.reps, after two warm-up calls."""
        fn()
        fn()
        times = []
        for _ in range(args.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1000.0)
        return statistics.median(times)

    copy_s = timed(lambda: b.copy_(a))
    gather_s = timed(lambda: a[idx])
    mm_s = timed(lambda: x @ y)
    out = {
        "allocator": args.allocator,
        "copy_GBps": 2 * 4 * n / copy_s / 1e9,
        "gather_per_ns": idx.numel() / gather_s / 1e9,
        "matmul_TFLOPs": 2 * 8192**3 / mm_s / 1e12,
        "reserved_gib": torch.cuda.memory_stats().get("reserved_bytes.all.current", 0) / (1 << 30),
    }
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=4, help="size of each of A and B")
    ap.add_argument("--frag-gib", type=int, default=16, help="bytes allocated to fragment the pool")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="all allocators once per round, interleaved")
    ap.add_argument("--allocators", default="native,expandable,gpumem",
                    help=f"comma-separated, of {','.join(ALLOCATORS)}")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=CONF",
                    help="another gpumem configuration to run (NAME starting with 'gpumem-'), "
                         "e.g. gpumem-page8=page:8MiB; name it in --allocators")
    ap.add_argument("--json", help="append each run's result here")
    ap.add_argument("--allocator", help=argparse.SUPPRESS)  # set in the child process
    args = ap.parse_args()
    if args.allocator:
        child(args)
        return

    for v in args.variant:
        name, sep, conf = v.partition("=")
        if not sep or not name.startswith("gpumem-"):
            ap.error(f"--variant {v!r}: expected NAME=CONF with NAME starting with 'gpumem-'")
        ALLOCATORS[name] = (None, conf)
    names = args.allocators.split(",")
    unknown = [n for n in names if n not in ALLOCATORS]
    if unknown:
        sys.exit(f"kernel_pages.py: unknown allocator(s) {unknown}; known: {list(ALLOCATORS)}")
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names:
            torch_conf, gpumem_conf = ALLOCATORS[name]
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            if torch_conf:
                env["PYTORCH_CUDA_ALLOC_CONF"] = torch_conf
            if gpumem_conf:
                env["GPUMEM_CONF"] = gpumem_conf
            cmd = [sys.executable, __file__, "--allocator", name, "--gib", str(args.gib),
                   "--frag-gib", str(args.frag_gib), "--reps", str(args.reps)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                print(f"{name}: failed (exit {p.returncode})\n{p.stderr[-2000:]}", file=sys.stderr)
                continue
            res = json.loads(lines[-1])
            res["round"] = r
            results[name].append(res)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(res) + "\n")
            print(f"round {r} {name}: {res}", file=sys.stderr, flush=True)

    keys = ["copy_GBps", "gather_per_ns", "matmul_TFLOPs"]
    base = ({k: statistics.median(x[k] for x in results["native"]) for k in keys}
            if results.get("native") else None)
    print(f"{'allocator':<12}" + "".join(f"{k:>22}" for k in keys) + f"{'held GiB':>10}")
    for name, rs in results.items():
        if not rs:
            continue
        line = f"{name:<12}"
        for k in keys:
            m = statistics.median(x[k] for x in rs)
            ratio = f" ({m / base[k]:.3f})" if base else ""
            line += f"{m:>14.2f}{ratio:>8}"
        line += f"{statistics.median(x['reserved_gib'] for x in rs):>10.1f}"
        print(line)
    print("(medians over rounds of each run's median; in brackets, ÷ native's)")


if __name__ == "__main__":
    main()
