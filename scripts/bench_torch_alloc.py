#!/usr/bin/env python3
"""PyTorch's caching allocator beside gpumem on the allocation benchmark, in one run.

Builds scripts/allocbench/torch_allocbench.cpp (a small torch C++ extension: the op generator of
scripts/allocbench/ops.h, which is the one `gpumem bench alloc` reproduces, and a timed loop of
c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete), runs every case of the
benchmark through it (one warm run, then the median of three, as the anchor), then takes
`gpumem bench alloc --json` (run here, or read from --gpumem-json when the device script has
just run it) and prints one table: every gpumem policy, cudaMalloc, cudaMallocAsync and PyTorch
of this run, with PyTorch's anchor figures from ANCHORS.md §2.

Needs a CUDA GPU, PyTorch with CUDA, a C++ compiler and ninja (torch.utils.cpp_extension).
Usage: python3 scripts/bench_torch_alloc.py [--gpumem target/release/gpumem]
       [--gpumem-json FILE] [--threads 1,2,4,8] [--runs 3] [--out DIR]
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20

# The cases of `gpumem bench alloc` (crates/gpumem-cuda/src/bench/mod.rs):
# name, allocations per thread (timed, warm-up), most live, smallest size, largest size, seed.
SINGLE = [
    ("same_1MiB", 200_000, 200_000, 1, MIB, MIB + 1, 7),
    ("random_512B_64MiB_live500", 100_000, 100_000, 500, 512, 64 * MIB, 7),
    ("random_512B_1MiB_live2000", 200_000, 200_000, 2000, 512, MIB, 7),
]
MULTI = ("mt_random_512B_1MiB_live200", 50_000, 20_000, 200, 512, MIB, 100)

# ANCHORS.md §2 (H200): PyTorch caching allocator, cudaMallocAsync, cudaMalloc.
ANCHOR = {
    ("same_1MiB", 1): (228, 429, 34009),
    ("random_512B_64MiB_live500", 1): (682, 1597, 22783),
    ("random_512B_1MiB_live2000", 1): (712, 981, 3986),
    ("mt_random_512B_1MiB_live200", 1): (687, 976, None),
    ("mt_random_512B_1MiB_live200", 2): (1783, 4448, None),
    ("mt_random_512B_1MiB_live200", 4): (2467, 5167, None),
    ("mt_random_512B_1MiB_live200", 8): (2785, 5525, None),
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def build_extension(build_dir):
    from torch.utils.cpp_extension import load

    t0 = time.time()
    os.makedirs(build_dir, exist_ok=True)
    path = load(
        name="gpumem_torch_allocbench",
        sources=[os.path.join(HERE, "allocbench", "torch_allocbench.cpp")],
        extra_include_paths=[os.path.join(HERE, "allocbench")],
        extra_cflags=["-O2"],
        with_cuda=True,
        is_python_module=False,
        build_directory=build_dir,
        verbose=False,
    )
    # Not a Python module: load() returns the library's path (and has loaded it).
    lib = ctypes.CDLL(path)
    lib.gpumem_torch_run.restype = ctypes.c_double
    lib.gpumem_torch_run.argtypes = [
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64,
        ctypes.c_int64, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
    ]
    lib.gpumem_torch_count_ops.restype = ctypes.c_int64
    lib.gpumem_torch_count_ops.argtypes = [
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64,
    ]
    log(f"# built the PyTorch extension in {time.time() - t0:.0f} s")
    return lib


def torch_run(lib, n, live, lo, hi, seed, threads):
    err = ctypes.create_string_buffer(1024)
    ns = lib.gpumem_torch_run(n, live, lo, hi, seed, threads, 1, err, len(err))
    if ns < 0:
        raise RuntimeError("PyTorch run failed: " + err.value.decode(errors="replace"))
    return ns


def measure_torch(lib, threads_list, runs):
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    rows = []
    cases = [(c, 1) for c in SINGLE] + [(MULTI, t) for t in threads_list]
    for (name, n, n_warm, live, lo, hi, seed), threads in cases:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch_run(lib, n_warm, live, lo, hi, seed, threads)
        ts = [torch_run(lib, n, live, lo, hi, seed, threads) for _ in range(runs)]
        ops = sum(lib.gpumem_torch_count_ops(n, live, lo, hi, seed + t) for t in range(threads))
        anchor = ANCHOR.get((name, threads), (None, None, None))[0]
        row = {
            "case": name,
            "threads": threads,
            "allocator": "torch",
            "device": "cuda",
            "ns_per_op": statistics.median(ts),
            "runs_ns_per_op": ts,
            "ops_per_run": ops,
            "peak_held_bytes": torch.cuda.max_memory_reserved(),
            "anchor_torch_ns": anchor,
            "ratio_to_torch_anchor": statistics.median(ts) / anchor if anchor else None,
            "streams": "own (pool)" if threads > 1 else "default",
        }
        rows.append(row)
        log(f"  {name:<28} threads {threads} torch {row['ns_per_op']:>10.1f} ns/op")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return rows


def gpumem_rows(args):
    if args.gpumem_json:
        with open(args.gpumem_json) as f:
            return [json.loads(line) for line in f if line.strip()]
    cmd = [args.gpumem, "bench", "alloc", "--json", "--runs", str(args.runs),
           "--threads", ",".join(map(str, args.threads))]
    log("# running " + " ".join(cmd))
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def fmt(ns):
    if ns is None:
        return ""
    return f"{ns:.0f}" if ns >= 100 else f"{ns:.1f}"


def render(rows):
    order = []
    cols = []
    for r in rows:
        key = (r["case"], r["threads"])
        if key not in order:
            order.append(key)
        if r["allocator"] not in cols and r["allocator"] != "torch":
            cols.append(r["allocator"])
    cols.append("torch")
    header = ["case", "thr"] + cols + ["torch anchor", "best gpumem ÷ torch"]
    table = [header]
    for case, threads in order:
        cell = {r["allocator"]: r for r in rows if r["case"] == case and r["threads"] == threads}
        line = [case, str(threads)]
        for c in cols:
            line.append(fmt(cell[c]["ns_per_op"]) if c in cell else "")
        anchor = ANCHOR.get((case, threads), (None, None, None))[0]
        line.append(fmt(anchor))
        gp = [r["ns_per_op"] for a, r in cell.items() if a.startswith("gpumem:")]
        if gp and "torch" in cell:
            best = min(gp)
            line.append(f"{best / cell['torch']['ns_per_op']:.3f}")
        else:
            line.append("")
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    out = []
    for k, row in enumerate(table):
        out.append("  ".join(
            (row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]))
            for i in range(len(row))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpumem", default=os.path.join(ROOT, "target", "release", "gpumem"))
    p.add_argument("--gpumem-json", help="JSON lines of a `gpumem bench alloc --json` run")
    p.add_argument("--threads", default="1,2,4,8",
                   type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", help="folder for the merged JSON and the extension's build")
    args = p.parse_args()
    out_dir = args.out or tempfile.mkdtemp(prefix="gpumem-bench-")
    lib = build_extension(os.path.join(out_dir, "torch_ext_build"))
    log("# PyTorch caching allocator")
    rows = measure_torch(lib, args.threads, args.runs)
    rows = gpumem_rows(args) + rows
    with open(os.path.join(out_dir, "bench_alloc_all.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    import torch

    print(f"allocation latency, host ns per op (alloc or free), median of {args.runs} runs after "
          f"a warm-up; multi-thread rows: wall ÷ all ops, each thread on its own stream; "
          f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; "
          f"{time.strftime('%Y-%m-%d', time.gmtime())}")
    print(render(rows))
    print(f"(JSON lines of every figure: {os.path.join(out_dir, 'bench_alloc_all.jsonl')})")


if __name__ == "__main__":
    main()
