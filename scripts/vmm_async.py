#!/usr/bin/env python3
"""Can page mapping leave the host's critical path? Two experiments on one GPU.

1. A stream is made to wait on the device (cuStreamWaitValue32) for a flag in pinned host
   memory; a kernel that writes the pages is queued behind the wait; a background thread unmaps,
   maps and sets access, then sets the flag. Checks that the kernel saw the pages (the data are
   right) and times the host's side against doing the same calls inline.
2. The same wait, but the work queued behind it is cuMemsetD32Async and cuMemcpyHtoDAsync, with
   the page unmapped, mapped without access, or mapped with access when they are queued.

Result on the H200 (CUDA 13, BENCHMARKS.md §3): 1 works (data right; host 0.3-0.9 ms against
1.8-2.8 ms inline), but 2 refuses both calls (CUDA_ERROR_INVALID_VALUE) unless the page is
mapped with access when they are queued: the copy and memset calls check their pointers on the
host. PyTorch queues such calls on fresh allocations, so the mapping must be complete before an
allocation returns; only kernels could use memory mapped later.

Run on the GPU machine: python3 scripts/vmm_async.py (PyTorch with CUDA, libcuda.so.1)."""
import ctypes
import threading
import time
from ctypes import byref, c_uint, c_ulonglong, c_void_p

import torch

from cuda_vmm import PAGE, ck, cu, pinned_on


class View:
    """A CUDA array over raw device memory, for torch.as_tensor."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (ptr, False),
                                         "version": 3, "strides": None}


def main():
    torch.zeros(1, device="cuda")
    dev = torch.cuda.current_device()
    prop, acc = pinned_on(dev)
    pages = 16
    va = c_ulonglong()
    ck(cu.cuMemAddressReserve(byref(va), pages * PAGE, 0, 0, 0), "reserve")
    handles = []
    for _ in range(2 * pages):
        h = c_ulonglong()
        ck(cu.cuMemCreate(byref(h), PAGE, byref(prop), 0), "create")
        handles.append(h.value)
    host = c_void_p()
    ck(cu.cuMemHostAlloc(byref(host), 4096, 0x02), "host alloc")  # DEVICEMAP
    flag = c_uint.from_address(host.value)
    flag.value = 0
    dflag = c_ulonglong()
    ck(cu.cuMemHostGetDevicePointer_v2(byref(dflag), host, 0), "host device pointer")
    stream = torch.cuda.Stream()
    n = pages * PAGE // 4

    def remap(first):
        """Points the range at handles[first:first+pages] (unmapping what was there)."""
        for i in range(pages):
            ck(cu.cuMemMap(va.value + i * PAGE, PAGE, 0, handles[first + i], 0), "map")
        ck(cu.cuMemSetAccess(va.value, pages * PAGE, byref(acc), 1), "access")

    remap(0)
    view = torch.as_tensor(View(va.value, n), device="cuda")
    results = []
    for rnd in range(1, 7):
        asynchronous = rnd % 2 == 0
        first = pages * (rnd % 2)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)  # ~1 ms of earlier work on the stream
            t = time.perf_counter()
            if asynchronous:
                # The stream's old work used the old pages: the worker waits for it, remaps,
                # then releases the stream.
                done = torch.cuda.Event()
                done.record()
                ck(cu.cuStreamWaitValue32_v2(c_void_p(stream.cuda_stream), dflag.value, rnd,
                                             0), "wait value")  # GEQ

                def worker(done=done, first=first, rnd=rnd):
                    done.synchronize()
                    ck(cu.cuMemUnmap(va.value, pages * PAGE), "unmap")
                    remap(first)
                    flag.value = rnd

                th = threading.Thread(target=worker)
                th.start()
            else:
                torch.cuda.current_stream().synchronize()
                ck(cu.cuMemUnmap(va.value, pages * PAGE), "unmap")
                remap(first)
                flag.value = rnd
            view.fill_(float(rnd))
            host_us = (time.perf_counter() - t) * 1e6
        if asynchronous:
            th.join()
        torch.cuda.synchronize()
        ok = bool((view == float(rnd)).all().item())
        results.append((rnd, "async" if asynchronous else "inline", host_us, ok))
    print(f"{'round':>5} {'mode':>7} {'host µs (remap + fill queued)':>30} {'data ok':>8}")
    for r in results:
        print(f"{r[0]:>5} {r[1]:>7} {r[2]:>30.1f} {str(r[3]):>8}")

    # The copy and memset APIs check their pointers when they are queued. Which state must a
    # page be in by then: unmapped (a remap under way), mapped without access (access still to
    # be set), mapped with access?
    print("\nqueued on a stream held by a wait, the memory being in each state (CUresult; 0 = accepted)")
    ck(cu.cuMemUnmap(va.value, pages * PAGE), "unmap")
    host_buf = (ctypes.c_ubyte * PAGE)()
    rnd = 100
    for state in ("unmapped", "mapped, no access", "mapped with access"):
        torch.cuda.synchronize()
        if state != "unmapped":
            ck(cu.cuMemMap(va.value, PAGE, 0, handles[0], 0), "map")
        if state == "mapped with access":
            ck(cu.cuMemSetAccess(va.value, PAGE, byref(acc), 1), "access")
        rnd += 1
        sp = c_void_p(stream.cuda_stream)
        ck(cu.cuStreamWaitValue32_v2(sp, dflag.value, rnd, 0), "wait value")
        r_set = cu.cuMemsetD32Async(va.value, 0x11223344, PAGE // 4, sp)
        r_cpy = cu.cuMemcpyHtoDAsync_v2(va.value, ctypes.addressof(host_buf), PAGE, sp)
        if state != "unmapped":
            ck(cu.cuMemSetAccess(va.value, PAGE, byref(acc), 1), "access")
        flag.value = rnd
        err = None
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            err = str(e)[:80]
        print(f"  {state:<20} memset {r_set:>3}  memcpy {r_cpy:>3}  after the wait: {err or 'ok'}")
        if state != "unmapped":
            ck(cu.cuMemUnmap(va.value, PAGE), "unmap")


if __name__ == "__main__":
    main()
