#!/usr/bin/env python3
"""Do the CUDA virtual-memory calls wait for the GPU? Each call is timed on the host twice: with
the GPU idle, and right after a ~20 ms spin kernel was queued (on PyTorch's default stream, then
on a separate stream). The calls touch only their own, unrelated memory, so a call that returns
only after the kernel finished (host time ≈ the kernel's, "kernel done" yes) synchronises with
the device as a side effect, and every such call in an allocator drains the GPU's queue.

Run on the GPU machine: python3 scripts/vmm_sync.py [--out FILE.json]
Needs PyTorch with CUDA (for the spin kernel: torch.cuda._sleep) and the driver's libcuda.so.1."""
import argparse
import json
import statistics
import time
from ctypes import byref, c_ulonglong

import torch

from cuda_vmm import PAGE, ck, create_page, cu, reserve, start_on_torch_device


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per call and state")
    args = ap.parse_args()

    prop, acc = start_on_torch_device(torch)
    span = 64 * PAGE
    base = reserve(span)

    # Calibrate the spin kernel to about 20 ms.
    cycles = 10_000_000
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    per_cycle = (time.perf_counter() - t) / cycles
    cycles = int(0.020 / per_cycle)

    def make_handle():
        return create_page(prop)

    def mapped():
        h = make_handle()
        ck(cu.cuMemMap(base, PAGE, 0, h, 0), "map")
        ck(cu.cuMemSetAccess(base, PAGE, byref(acc), 1), "access")
        return h

    def mapped_no_access():
        h = make_handle()
        ck(cu.cuMemMap(base, PAGE, 0, h, 0), "map")
        return h

    def unmap_release(h):
        ck(cu.cuMemUnmap(base, PAGE), "unmap")
        ck(cu.cuMemRelease(h), "release")

    def mem_alloc(_=None):
        p = c_ulonglong()
        ck(cu.cuMemAlloc_v2(byref(p), PAGE), "alloc")
        return p.value

    def nothing():
        return None

    # (name, prepare() -> state, call(state) -> result, cleanup(state, result)); only the call
    # is timed; cleanup undoes what prepare and the call left behind.
    cases = [
        ("cuMemCreate 2 MiB", nothing, lambda _: make_handle(),
         lambda _, h: ck(cu.cuMemRelease(h), "release")),
        ("cuMemMap 2 MiB", make_handle, lambda h: ck(cu.cuMemMap(base, PAGE, 0, h, 0), "map"),
         lambda h, _: unmap_release(h)),
        ("cuMemSetAccess 2 MiB", mapped_no_access,
         lambda h: ck(cu.cuMemSetAccess(base, PAGE, byref(acc), 1), "access"),
         lambda h, _: unmap_release(h)),
        ("cuMemUnmap 2 MiB", mapped, lambda h: ck(cu.cuMemUnmap(base, PAGE), "unmap"),
         lambda h, _: ck(cu.cuMemRelease(h), "release")),
        ("cuMemRelease 2 MiB (unmapped)", make_handle,
         lambda h: ck(cu.cuMemRelease(h), "release"), lambda h, _: None),
        ("cuMemAlloc 2 MiB", nothing, mem_alloc, lambda _, p: ck(cu.cuMemFree_v2(p), "free")),
        ("cuMemFree 2 MiB", mem_alloc, lambda p: ck(cu.cuMemFree_v2(p), "free"),
         lambda p, _: None),
    ]

    side = torch.cuda.Stream()
    states = [("idle", None), ("busy: default stream", torch.cuda.default_stream()),
              ("busy: side stream", side)]
    rows = []
    for name, prepare, call, cleanup in cases:
        for state, stream in states:
            times, done = [], []
            for _ in range(args.reps):
                s = prepare()
                torch.cuda.synchronize()
                ev = torch.cuda.Event()
                if stream is not None:
                    with torch.cuda.stream(stream):
                        torch.cuda._sleep(cycles)
                        ev.record()
                else:
                    ev.record()
                t = time.perf_counter()
                r = call(s)
                dt = time.perf_counter() - t
                done.append(ev.query())
                times.append(dt * 1e6)
                torch.cuda.synchronize()
                cleanup(s, r)
            rows.append({"call": name, "state": state, "median_us": statistics.median(times),
                         "max_us": max(times), "kernel_done_after_call": sum(done),
                         "reps": args.reps})
    ck(cu.cuMemAddressFree(base, span), "address free")

    print(f"spin kernel: {cycles * per_cycle * 1e3:.1f} ms ({cycles} cycles)")
    print(f"{'call':<32} {'state':<22} {'median µs':>10} {'max µs':>10} {'kernel done':>12}")
    for r in rows:
        print(f"{r['call']:<32} {r['state']:<22} {r['median_us']:>10.1f} {r['max_us']:>10.1f} "
              f"{r['kernel_done_after_call']:>5}/{r['reps']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"spin_ms": cycles * per_cycle * 1e3, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
