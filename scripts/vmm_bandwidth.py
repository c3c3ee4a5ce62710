#!/usr/bin/env python3
"""Copy bandwidth on memory mapped in different ways through the driver's virtual-memory API,
beside cudaMalloc'ed memory: which property of a mapping makes kernels run slower on it.

`scripts/kernel_pages.py` found a streaming copy slower on gpumem's memory than on PyTorch's
(H200, session 25). gpumem maps separate 2 MiB physical pages (cuMemCreate) side by side, in
whatever order they come, some mapped at a second address too, and sets access one mapped run
at a time. Each variant below changes one of those, on two buffers A and B of --mib each; the
figure is B.copy_(A) (PyTorch's copy kernel on tensors made from the raw addresses), GB/s
moved (read + write), median of --reps with CUDA events, and the ratio to cudaMalloc's:

    cudaMalloc          torch.empty (PyTorch's allocator: one cudaMalloc per buffer)
    one handle          one cuMemCreate per buffer, mapped whole
    64MiB handles       handles of 64 MiB, in order
    2MiB handles        2 MiB handles mapped in creation order, access set once per buffer
    2MiB shuffled       2 MiB handles mapped in a random order
    2MiB access/page    2 MiB handles in order, cuMemSetAccess once per page
    2MiB aliased        2 MiB handles in order, each also mapped at a second address
    NMiB handles        handles of 4-64 MiB, in order: where the loss stops
    2MiB of 64MiB       64 MiB handles mapped 2 MiB at a time (offsets into the handle, which
                        the driver's documentation says must be zero), in order or shuffled

    python3 scripts/vmm_bandwidth.py [--mib 4096] [--reps 20]
Needs a CUDA GPU and PyTorch (no gpumem)."""
from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_vmm import cu, ck, reserve, start_on_torch_device  # noqa: E402

MIB = 1 << 20


class Raw:
    """A float32 array at a raw device address, for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes // 4,), "typestr": "<f4",
                                         "data": (ptr, False), "version": 3}


class Mapping:
    """`nbytes` of virtual address space backed by handles of `handle` bytes. A mapping the
    driver refuses raises RuntimeError with nothing left held."""

    def __init__(self, prop, acc, nbytes, handle, shuffle=False, access_each=False, alias=False,
                 slice_=None):
        self.nbytes = nbytes
        self.handles = []
        self.ranges = []  # reserved virtual ranges
        self.mapped = []  # (address, bytes) of every mapping made
        try:
            for _ in range(nbytes // handle):
                h = ctypes.c_ulonglong()
                ck(cu.cuMemCreate(ctypes.byref(h), handle, ctypes.byref(prop), 0), "cuMemCreate")
                self.handles.append(h.value)
            # Mapped in pieces of `slice_` bytes (a handle's pieces at offsets into it, which
            # the driver documents as "currently must be zero"), or whole handles.
            piece = slice_ or handle
            pieces = [(h, off) for h in self.handles for off in range(0, handle, piece)]
            if shuffle:
                random.Random(1).shuffle(pieces)
            self.va = self._map(pieces, piece, acc, access_each)
            if alias:
                # Every handle mapped a second time, elsewhere, as a page gpumem moved leaves it.
                self._map(pieces, piece, acc, False)
        except RuntimeError:
            self.free()
            raise

    def _map(self, pieces, piece, acc, access_each):
        """`pieces` mapped side by side in a fresh range, access set once or per piece;
        returns the range's address."""
        va = reserve(self.nbytes)
        self.ranges.append(va)
        for i, (h, off) in enumerate(pieces):
            at = va + i * piece
            ck(cu.cuMemMap(at, piece, off, h, 0), f"cuMemMap at offset {off}")
            self.mapped.append((at, piece))
            if access_each:
                ck(cu.cuMemSetAccess(at, piece, ctypes.byref(acc), 1), "cuMemSetAccess")
        if not access_each:
            ck(cu.cuMemSetAccess(va, self.nbytes, ctypes.byref(acc), 1), "cuMemSetAccess")
        return va

    def tensor(self, torch):
        return torch.as_tensor(Raw(self.va, self.nbytes), device="cuda")

    def free(self):
        for at, n in self.mapped:
            ck(cu.cuMemUnmap(at, n), "cuMemUnmap")
        for va in self.ranges:
            ck(cu.cuMemAddressFree(va, self.nbytes), "cuMemAddressFree")
        for h in self.handles:
            ck(cu.cuMemRelease(h), "cuMemRelease")
        self.mapped, self.ranges, self.handles = [], [], []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=4096, help="size of each of A and B (a multiple of 64)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import torch

    prop, acc = start_on_torch_device(torch)
    if args.mib % 64:
        sys.exit("vmm_bandwidth.py: --mib must be a multiple of 64")
    nbytes = args.mib << 20

    def copy_gbps(a, b) -> float:
        for _ in range(2):
            b.copy_(a)
        times = []
        for _ in range(args.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1000.0)
        return 2 * nbytes / statistics.median(times) / 1e9

    variants = {
        "one handle": dict(handle=nbytes),
        "64MiB handles": dict(handle=64 * MIB),
        "32MiB handles": dict(handle=32 * MIB),
        "16MiB handles": dict(handle=16 * MIB),
        "8MiB handles": dict(handle=8 * MIB),
        "4MiB handles": dict(handle=4 * MIB),
        "2MiB handles": dict(handle=2 * MIB),
        "2MiB of 64MiB": dict(handle=64 * MIB, slice_=2 * MIB),
        "2MiB of 64MiB shuf": dict(handle=64 * MIB, slice_=2 * MIB, shuffle=True),
        "2MiB shuffled": dict(handle=2 * MIB, shuffle=True),
        "2MiB access/page": dict(handle=2 * MIB, access_each=True),
        "2MiB aliased": dict(handle=2 * MIB, alias=True),
    }
    results = {}
    # cudaMalloc first and last: the machine's drift over the run.
    a = torch.empty(nbytes // 4, device="cuda").uniform_()
    b = torch.empty_like(a)
    results["cudaMalloc"] = copy_gbps(a, b)
    del a, b
    torch.cuda.empty_cache()
    for name, kw in variants.items():
        made = []
        try:
            for _ in range(2):
                made.append(Mapping(prop, acc, nbytes, **kw))
        except RuntimeError as e:
            for m in made:
                m.free()
            print(f"{name}: not measured, the driver refused: {e}", flush=True)
            continue
        ma, mb = made
        a, b = ma.tensor(torch), mb.tensor(torch)
        a.uniform_()
        results[name] = copy_gbps(a, b)
        torch.cuda.synchronize()
        del a, b
        ma.free()
        mb.free()
    a = torch.empty(nbytes // 4, device="cuda").uniform_()
    b = torch.empty_like(a)
    results["cudaMalloc again"] = copy_gbps(a, b)
    base = results["cudaMalloc"]
    print(f"{'mapping':<20}{'copy GB/s':>12}{'÷ cudaMalloc':>14}")
    for name, v in results.items():
        print(f"{name:<20}{v:>12.1f}{v / base:>14.3f}")


if __name__ == "__main__":
    main()
