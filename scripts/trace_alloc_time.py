#!/usr/bin/env python3
"""Host time of a recorded workload's allocations and frees, through PyTorch, per allocator.

A workload's step time under gpumem differs from PyTorch's by the host time the two allocators
spend inside PyTorch's calls, once the GPU time of the step is the same (BENCHMARKS.md §3,
session 26). That difference is a few milliseconds per step, under the machine's noise from run
to run, so a median step time cannot show it. This script measures it directly: it takes the
sequence of allocations and frees a PyTorch snapshot recorded (the order, the sizes, which
free goes with which allocation), and runs it, in a fresh process per allocator, through
c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete (scripts/allocbench/
torch_allocbench.cpp), which go to PyTorch's own allocator, or to gpumem's once
gpumem.torch.install() has switched it. No kernel runs, so this is host time only: what the
allocator costs the step, driver calls included.

Each process runs the sequence PASSES times: the first pass grows the pool as the recorded run
did (PyTorch's cudaMalloc calls, gpumem's pages); later passes meet a pool that already holds
what the sequence needs, as the steps of a long run do. What the recording never frees
(weights, optimizer state) is allocated in the first pass only and stays allocated, as in the
workload; everything else each pass frees as the recording did. Each pass is timed in CHUNKS
parts of equal op count (the first chunks of the first pass are where the pool grows).

With --cold-kib N each op instead runs on its recorded stream and is timed alone, after N KiB
of other memory have been written (gpumem_torch_run_trace_cold): in a training step, kernel
launches, PyTorch's dispatch and Python run between two allocator calls, so each call finds the
allocator's data out of the core's private caches. gpumem's own time is 573-632 ns a call in
the prefetch pipeline's step against 213-355 back to back (BENCHMARKS.md §3, session 33): what
the allocator costs a real step is its cost from cold caches. The table then gives ns per
allocation and per free (the clock's own cost per op taken off), each run's later passes'
median, beside the median native run's, and with --trace-steps the difference in µs per step.

Needs a CUDA GPU, PyTorch with CUDA, a C++ compiler and ninja (torch.utils.cpp_extension), and
for the gpumem rows the gpumem package on PYTHONPATH.

Usage:
    python3 scripts/trace_alloc_time.py TRACE [--allocators native,gpumem] [--variant NAME=CONF]
        [--passes 3] [--chunks 16] [--repeat 2] [--trace-steps 16] [--cold-kib 4096] [--out DIR]
"""
import argparse
import array
import ctypes
import gzip
import heapq
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def read_snapshot(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def ops_from_snapshot(snap, device=0):
    """The snapshot's allocations and frees as (sizes, slots, n_slots, streams, persistent,
    stream_of).

    sizes[i] > 0: allocate that many bytes into slots[i]; 0: free slots[i]. A free is the
    user's (`free_requested`, when PyTorch's caller let go), not the allocator's later
    `free_completed`, unless the trace has no `free_requested` (older PyTorch wrote `free`;
    a trace of completions only is taken as it is). Frees of blocks allocated before the recording started are left out, as
    are zero-byte allocations (PyTorch does not ask the allocator for those). Slots are reused
    lowest first, so n_slots is the most blocks live at once. persistent[i] is True for an
    allocation the recording never frees (weights, optimizer state): later passes leave it
    out, so that it is made once and stays, as in the workload's own later steps. streams is
    the set of the trace's streams; stream_of[i] the index of op i's stream in the order the
    trace first uses them (a free runs on its allocation's stream)."""
    traces = snap.get("device_traces") if isinstance(snap, dict) else None
    if not traces or device >= len(traces):
        raise ValueError(f"the snapshot has no allocation trace for device {device}")
    sizes, slots, streams = array.array("q"), array.array("q"), set()
    stream_of, stream_index, addr_stream = array.array("q"), {}, {}
    by_addr, free_slots, n_slots = {}, [], 0
    alloc_op = {}  # address -> index of its allocation op
    persistent = []
    actions = {e.get("action") for e in traces[device]}
    frees = next((a for a in ("free_requested", "free", "free_completed") if a in actions), None)
    for e in traces[device]:
        action = e.get("action")
        if action == "alloc":
            size = int(e["size"])
            if size <= 0:
                continue
            addr = e["addr"]
            if addr in by_addr:
                raise ValueError(f"address {addr:#x} allocated twice without a free")
            if free_slots:
                slot = heapq.heappop(free_slots)
            else:
                slot, n_slots = n_slots, n_slots + 1
            by_addr[addr] = slot
            alloc_op[addr] = len(sizes)
            sizes.append(size)
            slots.append(slot)
            persistent.append(True)
            stream = e.get("stream", 0)
            streams.add(stream)
            index = stream_index.setdefault(stream, len(stream_index))
            addr_stream[addr] = index
            stream_of.append(index)
        elif action == frees:
            slot = by_addr.pop(e["addr"], None)
            if slot is None:
                continue
            persistent[alloc_op.pop(e["addr"])] = False
            sizes.append(0)
            slots.append(slot)
            persistent.append(False)
            stream_of.append(addr_stream.pop(e["addr"]))
            heapq.heappush(free_slots, slot)
    if not sizes:
        raise ValueError("the snapshot's trace has no allocation")
    return sizes, slots, n_slots, streams, persistent, stream_of


def build_extension(build_dir):
    """bench_torch_alloc.py's extension (the same source holds gpumem_torch_run_trace), with
    the trace function's signature declared."""
    sys.path.insert(0, HERE)
    from bench_torch_alloc import build_extension as build_allocbench

    lib = build_allocbench(build_dir)
    lib.gpumem_torch_run_trace.restype = ctypes.c_double
    lib.gpumem_torch_run_trace.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int,
    ]
    lib.gpumem_torch_run_trace_cold.restype = ctypes.c_double
    lib.gpumem_torch_run_trace_cold.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p,
        ctypes.c_int,
    ]
    return lib


def driver_seconds(gt):
    return sum(v["seconds"] for v in gt.driver_calls().values())


def hook_seconds(gt):
    return sum(v["seconds"] for v in gt.hook_time().values())


def child(args):
    """One allocator in this process: every pass of the sequence, one JSON line on stdout."""
    import torch

    gt = None
    if args.allocator != "native":
        import gpumem.torch as gt

        # gpumem-native: gpumem as a CUDAAllocator of its own, without PyTorch's pluggable
        # wrapper (its build is cached after the first run); others follow GPUMEM_TORCH_NATIVE.
        gt.install(args.conf or None, native=True if args.allocator == "gpumem-native" else None)
        gt.time_hooks(True)
    lib = build_extension(args.build_dir)
    seqs = []
    with open(args.ops, "rb") as f:
        meta = json.loads(f.readline())
        for n in (meta["n_ops"], meta["n_later"]):  # the first pass's ops, then the later ones'
            sizes, slots, stream_of = array.array("q"), array.array("q"), array.array("q")
            sizes.frombytes(f.read(8 * n))
            slots.frombytes(f.read(8 * n))
            stream_of.frombytes(f.read(8 * n))
            seqs.append((sizes, slots, stream_of))
    torch.cuda.init()
    chunk_ns = (ctypes.c_double * args.chunks)()
    err = ctypes.create_string_buffer(1024)
    passes = []
    sums = (ctypes.c_double * 3)()
    for i in range(args.passes):
        sizes, slots, stream_of = seqs[min(i, 1)]
        n = len(sizes)
        d0 = driver_seconds(gt) if gt else 0.0
        h0 = hook_seconds(gt) if gt else 0.0
        # The first pass keeps what the recording never frees; later passes leave it out.
        cold = None
        if args.cold_kib:
            total = lib.gpumem_torch_run_trace_cold(
                sizes.buffer_info()[0], slots.buffer_info()[0], stream_of.buffer_info()[0], n,
                meta["n_slots"], meta["n_streams"], args.cold_kib << 10, int(i == 0), sums,
                err, len(err))
            allocs = n - sizes.count(0)
            cold = {"alloc_ns": sums[0] / allocs, "free_ns": sums[1] / max(1, n - allocs),
                    "clock_ns": sums[2], "allocs": allocs, "frees": n - allocs}
            chunk_ns[0] = total
        else:
            total = lib.gpumem_torch_run_trace(sizes.buffer_info()[0], slots.buffer_info()[0], n,
                                               meta["n_slots"], args.chunks, int(i == 0),
                                               chunk_ns, err, len(err))
        if total < 0:
            raise SystemExit(f"{args.allocator}: " + err.value.decode(errors="replace"))
        passes.append({
            "cold": cold,
            "ops": n,
            "ms": total / 1e6,
            "ns_per_op": total / n,
            "chunk_ms": [c / 1e6 for c in chunk_ns][:1 if cold else args.chunks],
            "driver_ms": (driver_seconds(gt) - d0) * 1e3 if gt else None,
            "hook_ms": (hook_seconds(gt) - h0) * 1e3 if gt else None,
        })
    held = gt.max_memory_reserved() if gt else torch.cuda.max_memory_reserved()
    print(json.dumps({"allocator": args.allocator, "conf": args.conf, "ops": n,
                      "peak_held": held, "passes": passes}), flush=True)


def run_child(args, name, conf, ops_path, build_dir):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--conf", conf or "",
           "--ops", ops_path, "--build-dir", build_dir, "--passes", str(args.passes),
           "--chunks", str(args.chunks), "--timeout", str(args.timeout),
           "--cold-kib", str(args.cold_kib), args.trace]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"allocator": name, "error": f"no result within {args.timeout} s"}
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
    if out.returncode != 0 or line is None:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return {"allocator": name, "error": f"exit {out.returncode}: " + " | ".join(tail)}
    return json.loads(line)


def summary(run):
    """A run's figures: its first pass, and the median of its later passes (whole, and their
    second halves, where the recording's steps repeat a layout the pool already holds)."""
    ps = run["passes"]
    first, later = ps[0], ps[1:]
    out = {"first_ms": first["ms"], "first_driver_ms": first["driver_ms"],
           "first_hook_ms": first["hook_ms"]}
    if later:
        half = len(later[0]["chunk_ms"]) // 2
        out["later_ms"] = statistics.median(p["ms"] for p in later)
        out["later_half_ms"] = statistics.median(sum(p["chunk_ms"][half:]) for p in later)
        out["later_driver_ms"] = (statistics.median(p["driver_ms"] for p in later)
                                  if later[0]["driver_ms"] is not None else None)
        out["later_hook_ms"] = (statistics.median(p["hook_ms"] for p in later)
                                if later[0]["hook_ms"] is not None else None)
    return out


def render(results, trace_steps):
    """One row per run: the first pass and the later passes' median, ms, with gpumem's
    driver and hook ms in brackets, and each figure's difference from the median native run
    (per recorded step too, with trace_steps)."""
    sums = [(r, summary(r)) for r in results if "passes" in r]
    native = [s for r, s in sums if r["allocator"] == "native"]
    keys = ("first_ms", "later_ms", "later_half_ms")
    base = {k: statistics.median(s[k] for s in native) for k in keys
            if native and all(k in s for s in native)}

    def cell(s, k, driver=None, hook=None):
        if k not in s:
            return "-"
        c = f"{s[k]:.1f}"
        if driver and s.get(driver) is not None:
            c += f" [{s[driver]:.1f}, {s[hook]:.1f}]"
        if k in base:
            d = s[k] - base[k]
            c += f" {d:+.1f}" + (f" ({d / trace_steps:+.2f}/step)" if trace_steps else "")
        return c

    lines = ["allocator        round  held GiB | first pass, ms [driver, hook] vs native | "
             "later passes, median | their second halves"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['allocator']:<16} {r.get('round', '-'):>5}  {r['error']}")
            continue
        s = summary(r)
        lines.append(f"{r['allocator']:<16} {r.get('round', '-'):>5}  "
                     f"{r['peak_held'] / 2**30:8.2f} | "
                     f"{cell(s, 'first_ms', 'first_driver_ms', 'first_hook_ms')} | "
                     f"{cell(s, 'later_ms', 'later_driver_ms', 'later_hook_ms')} | "
                     f"{cell(s, 'later_half_ms')}")
    return "\n".join(lines)


def cold_summary(run):
    """A cold run's later passes' medians: ns per allocation and per free, the clock's own
    cost taken off, and the pass's ops."""
    later = [p["cold"] for p in run["passes"][1:]] or [run["passes"][0]["cold"]]
    med = {k: statistics.median(c[k] for c in later) for k in ("alloc_ns", "free_ns", "clock_ns")}
    return {"alloc_ns": med["alloc_ns"] - med["clock_ns"],
            "free_ns": med["free_ns"] - med["clock_ns"], "clock_ns": med["clock_ns"],
            "allocs": later[0]["allocs"], "frees": later[0]["frees"]}


def render_cold(results, trace_steps):
    """One row per cold run: ns per allocation and per free, and their difference from the
    median native run's; per pass of the trace (and per recorded step, with trace_steps), the
    host time that difference adds."""
    sums = [(r, cold_summary(r)) for r in results if "passes" in r]
    native = [s for r, s in sums if r["allocator"] == "native"]
    base = ({k: statistics.median(s[k] for s in native) for k in ("alloc_ns", "free_ns")}
            if native else None)
    lines = ["allocator        round | ns per alloc | ns per free | clock ns | "
             "vs native: alloc, free | µs per pass" + (" | µs per step" if trace_steps else "")]
    for r in results:
        if "error" in r:
            lines.append(f"{r['allocator']:<16} {r.get('round', '-'):>5} | {r['error']}")
            continue
        s = cold_summary(r)
        row = (f"{r['allocator']:<16} {r.get('round', '-'):>5} | {s['alloc_ns']:12.0f} | "
               f"{s['free_ns']:11.0f} | {s['clock_ns']:8.0f} | ")
        if base:
            da, df = s["alloc_ns"] - base["alloc_ns"], s["free_ns"] - base["free_ns"]
            us = (da * s["allocs"] + df * s["frees"]) / 1e3
            row += f"{da:+8.0f}, {df:+6.0f}        | {us:+11.1f}"
            if trace_steps:
                row += f" | {us / trace_steps:+12.2f}"
        lines.append(row)
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="PyTorch snapshot (.pickle or .pickle.gz) with a trace")
    p.add_argument("--allocators", default="native,gpumem",
                   help="comma-separated: native, gpumem, gpumem-native (gpumem without "
                        "PyTorch's pluggable wrapper) and names given by --variant")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=CONF",
                   help="a gpumem run under configuration CONF (e.g. gpumem-page16=page:16MiB)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="rounds, the order rotated each round")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="training steps the trace holds: differences are also given per step")
    p.add_argument("--device", type=int, default=0, help="which device's trace to take")
    p.add_argument("--timeout", type=int, default=600, help="seconds per process")
    p.add_argument("--cold-kib", type=int, default=0, metavar="N",
                   help="time each op alone, on its recorded stream, after writing N KiB of "
                        "other memory (0: the passes timed in chunks, on one stream)")
    p.add_argument("--out", help="folder for the ops, the extension's build and the JSON lines")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--conf", default="", help=argparse.SUPPRESS)
    p.add_argument("--ops", help=argparse.SUPPRESS)
    p.add_argument("--build-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.passes < 1 or args.chunks < 1 or args.repeat < 1:
        p.error("--passes, --chunks and --repeat must be at least 1")
    if not 0 <= args.cold_kib <= 1 << 20:
        p.error(f"--cold-kib {args.cold_kib}: expected 0 to 1048576 (1 GiB)")
    if args.child:
        args.allocator = args.child
        return child(args)

    variants = {"native": None, "gpumem": "", "gpumem-native": ""}
    for v in args.variant:
        name, sep, conf = v.partition("=")
        if not sep or not name:
            p.error(f"--variant {v!r}: expected NAME=CONF")
        variants[name] = conf
    names = [a for a in args.allocators.split(",") if a]
    unknown = [a for a in names if a not in variants]
    if unknown:
        p.error(f"unknown allocator(s) {unknown}: give them with --variant NAME=CONF")

    out_dir = args.out or tempfile.mkdtemp(prefix="gpumem-trace-time-")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    try:
        snap = read_snapshot(args.trace)
        sizes, slots, n_slots, streams, persistent, stream_of = ops_from_snapshot(snap,
                                                                                  args.device)
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, KeyError, TypeError) as e:
        p.error(f"cannot read {args.trace} as a PyTorch snapshot with a trace: {e}")
    later = [i for i in range(len(sizes)) if not persistent[i]]
    if len(streams) > 1 and not args.cold_kib:
        log(f"# note: the trace uses {len(streams)} streams; every op runs on one stream here "
            f"(--cold-kib runs each on its own)")
    if args.chunks > len(later):
        p.error(f"--chunks {args.chunks}: the trace has only {len(later)} ops after its first pass")
    ops_path = os.path.join(out_dir, "ops.bin")
    with open(ops_path, "wb") as f:
        meta = {"n_ops": len(sizes), "n_later": len(later), "n_slots": n_slots,
                "n_streams": len(streams)}
        f.write((json.dumps(meta) + "\n").encode())
        f.write(sizes.tobytes())
        f.write(slots.tobytes())
        f.write(stream_of.tobytes())
        f.write(array.array("q", (sizes[i] for i in later)).tobytes())
        f.write(array.array("q", (slots[i] for i in later)).tobytes())
        f.write(array.array("q", (stream_of[i] for i in later)).tobytes())
    allocs = sum(1 for s in sizes if s > 0)
    kept = sum(persistent)
    log(f"# {args.trace}: {allocs} allocations, {len(sizes) - allocs} frees, at most {n_slots} "
        f"live, {kept} never freed (made in the first pass only) ({time.time() - t0:.1f} s)")
    build_dir = os.path.join(out_dir, "torch_ext_build")
    log("# building the PyTorch extension")
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r); "
                    "import trace_alloc_time as t; t.build_extension(%r)" % (HERE, build_dir)],
                   check=True)
    results = []
    jsonl = os.path.join(out_dir, "trace_alloc_time.jsonl")
    with open(jsonl, "w") as f:
        for rnd in range(args.repeat):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                t1 = time.time()
                r = run_child(args, name, variants[name], ops_path, build_dir)
                r["round"] = rnd
                results.append(r)
                f.write(json.dumps(r) + "\n")
                f.flush()
                first = r["passes"][0]["ms"] if "passes" in r else None
                log(f"[{rnd}] {name}: " + (f"pass 1 {first:.1f} ms" if first is not None
                                            else r["error"]) + f" ({time.time() - t1:.0f} s)")
    print(f"Host time of the allocations and frees of {os.path.basename(args.trace)} "
          f"({len(sizes)} ops), through PyTorch's allocator calls, {args.passes} passes")
    print(render_cold(results, args.trace_steps) if args.cold_kib
          else render(results, args.trace_steps))
    print(f"(JSON lines: {jsonl})")


if __name__ == "__main__":
    main()
