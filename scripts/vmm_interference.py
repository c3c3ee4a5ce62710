#!/usr/bin/env python3
"""Do the CUDA virtual-memory calls slow down kernels that are running meanwhile? Host time is
what gpumem reports for its driver calls, but a call that edits the GPU's page tables may also
cost device time (a TLB invalidation, a pause of the engines), which host timings never see.

Method: queue a batch of kernels that take ~30 ms of device time (a memory-bound copy of a
1 GiB tensor, or a bf16 matmul), timed by CUDA events on the device. While they run, the host
either only polls the end event (baseline), or repeats one kind of driver call on memory no
kernel touches: map + set access + unmap of one 2 MiB page (what a remap does), the same of 16
pages at once, create + release of a page (no page table change), or an event record + query
on another stream. The difference in device time against the interleaved baselines, divided by
the calls made while the kernels ran, is the device time each call costs.

Run on the GPU machine: python3 scripts/vmm_interference.py [--out FILE.json] [--reps N]
Needs PyTorch with CUDA and the driver's libcuda.so.1."""
import argparse
import json
import statistics
import time
from ctypes import byref

import torch

from cuda_vmm import PAGE, ck, create_page, cu, reserve, start_on_torch_device


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per kernel and host action")
    args = ap.parse_args()

    prop, acc = start_on_torch_device(torch)
    span = 64 * PAGE
    base = reserve(span)
    handles = [create_page(prop) for _ in range(16)]

    def remap(n):
        def op():
            for i in range(n):
                ck(cu.cuMemMap(base + i * PAGE, PAGE, 0, handles[i], 0), "map")
            ck(cu.cuMemSetAccess(base, n * PAGE, byref(acc), 1), "access")
            ck(cu.cuMemUnmap(base, n * PAGE), "unmap")
        return op

    def create_release():
        ck(cu.cuMemRelease(create_page(prop)), "release")

    other = torch.cuda.Stream()

    def event_pair():
        ev = torch.cuda.Event()
        ev.record(other)
        ev.query()

    actions = [("poll only (baseline)", None, 0), ("remap 1 page", remap(1), 1),
               ("remap 16 pages", remap(16), 16), ("create + release", create_release, 0),
               ("event record + query", event_pair, 0)]

    a = torch.empty(1 << 29, dtype=torch.float16, device="cuda")  # 1 GiB
    b = torch.empty_like(a)
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def copy_batch():
        for _ in range(40):
            b.copy_(a)

    def matmul_batch():
        for _ in range(30):
            torch.mm(m, m)

    kernels = [("1 GiB copies", copy_batch), ("bf16 matmuls 8192²", matmul_batch)]

    def one(batch, op):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        batch()
        end.record()
        calls = 0
        while not end.query():
            if op is not None:
                op()
                calls += 1
        torch.cuda.synchronize()
        return start.elapsed_time(end), calls

    for _, batch in kernels:  # warm-up
        one(batch, None)
    rows = []
    for kname, batch in kernels:
        results = {name: ([], []) for name, _, _ in actions}
        for _ in range(args.reps):  # interleaved, so that drift hits every action alike
            for name, op, _ in actions:
                ms, calls = one(batch, op)
                results[name][0].append(ms)
                results[name][1].append(calls)
        base_ms = statistics.median(results[actions[0][0]][0])
        for name, _, pages in actions:
            ms, calls = results[name]
            med_ms, med_calls = statistics.median(ms), statistics.median(calls)
            per_call = ((med_ms - base_ms) * 1e3 / med_calls) if med_calls else None
            rows.append({"kernels": kname, "host action": name, "pages": pages,
                         "device_ms_median": med_ms, "device_ms_all": ms,
                         "calls_median": med_calls, "device_us_per_call": per_call})
    for h in handles:
        ck(cu.cuMemRelease(h), "release")
    ck(cu.cuMemAddressFree(base, span), "address free")

    print(f"{'kernels':<20} {'host action':<22} {'device ms':>10} {'calls':>7} {'device µs/call':>15}")
    for r in rows:
        pc = "–" if r["device_us_per_call"] is None else f"{r['device_us_per_call']:.2f}"
        print(f"{r['kernels']:<20} {r['host action']:<22} {r['device_ms_median']:>10.2f} "
              f"{r['calls_median']:>7.0f} {pc:>15}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "reps": args.reps,
                       "device": torch.cuda.get_device_name(0), "when": time.ctime()}, f, indent=1)


if __name__ == "__main__":
    main()
