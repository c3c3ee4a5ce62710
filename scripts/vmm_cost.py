#!/usr/bin/env python3
"""Cost of the CUDA virtual-memory calls by physical chunk size: 1 GiB mapped as N chunks.
Run on a machine with an NVIDIA driver: python3 scripts/vmm_cost.py (no other dependency).
Is cuMemSetAccess (and map/unmap) paid per chunk (handle) or per byte?"""
import time
from ctypes import byref, c_int, c_ulonglong, c_void_p

from cuda_vmm import MIB, ck, cu, pinned_on

ck(cu.cuInit(0), "cuInit")
dev = c_int(); ck(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
ctx = c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(byref(ctx), dev), "retain"); ck(cu.cuCtxSetCurrent(ctx), "setcurrent")
prop, acc = pinned_on(0)
TOTAL = 1 << 30
def run(chunk, access_each, pages=False):
    """1 GiB as `chunk`-byte handles: created, mapped, access set (once for the whole range, or
    once per mapping with `access_each`), unmapped, released; ms for each step. With `pages`,
    each handle is mapped as separate 2 MiB mappings (offsets into the handle) and unmapped one
    mapping at a time, the way a pool that creates large handles but maps 2 MiB pages would."""
    unit = 2 * MIB if pages else chunk
    n = TOTAL // chunk
    va = c_ulonglong(); ck(cu.cuMemAddressReserve(byref(va), TOTAL, 0, 0, 0), "reserve")
    hs = []
    t0 = time.perf_counter()
    for _ in range(n):
        h = c_ulonglong(); ck(cu.cuMemCreate(byref(h), chunk, byref(prop), 0), "create"); hs.append(h.value)
    t1 = time.perf_counter()
    for i, h in enumerate(hs):
        for k in range(chunk // unit):
            ck(cu.cuMemMap(va.value + i * chunk + k * unit, unit, k * unit, h, 0), "map")
    t2 = time.perf_counter()
    if access_each:
        for i in range(TOTAL // unit):
            ck(cu.cuMemSetAccess(va.value + i * unit, unit, byref(acc), 1), "access")
    else:
        ck(cu.cuMemSetAccess(va.value, TOTAL, byref(acc), 1), "access")
    t3 = time.perf_counter()
    if pages:
        for i in range(TOTAL // unit):
            ck(cu.cuMemUnmap(va.value + i * unit, unit), "unmap")
    else:
        ck(cu.cuMemUnmap(va.value, TOTAL), "unmap")
    t4 = time.perf_counter()
    for h in hs:
        ck(cu.cuMemRelease(h), "release")
    t5 = time.perf_counter()
    ck(cu.cuMemAddressFree(va.value, TOTAL), "free")
    ms = lambda a, b: round((b - a) * 1e3, 2)
    return {"chunk_MiB": chunk // MIB, "chunks": n, "access_each": access_each,
            "create_ms": ms(t0, t1), "map_ms": ms(t1, t2), "set_access_ms": ms(t2, t3),
            "unmap_ms": ms(t3, t4), "release_ms": ms(t4, t5)}

def partial_unmap():
    """Can 2 MiB in the middle of a 32 MiB mapping be unmapped on its own? (CUresult)"""
    va = c_ulonglong(); ck(cu.cuMemAddressReserve(byref(va), 32 * MIB, 0, 0, 0), "reserve")
    h = c_ulonglong(); ck(cu.cuMemCreate(byref(h), 32 * MIB, byref(prop), 0), "create")
    ck(cu.cuMemMap(va.value, 32 * MIB, 0, h.value, 0), "map")
    r = cu.cuMemUnmap(va.value + 4 * MIB, 2 * MIB)
    cu.cuMemUnmap(va.value, 32 * MIB)
    cu.cuMemRelease(h.value); cu.cuMemAddressFree(va.value, 32 * MIB)
    return r

run(2 * MIB, False)  # warm-up
print(f"{'chunk':>6} {'n':>4} {'access':>8} {'create':>8} {'map':>7} {'access':>8} {'unmap':>7} {'release':>8}  (ms for 1 GiB)")
for chunk in (2 * MIB, 8 * MIB, 32 * MIB, 128 * MIB, 1024 * MIB):
    for per in (False, True):
        if chunk == 1024 * MIB and per:
            continue
        r = run(chunk, per)
        print(f"{r['chunk_MiB']:>5}M {r['chunks']:>4} {'each' if per else 'once':>8} {r['create_ms']:>8} {r['map_ms']:>7} {r['set_access_ms']:>8} {r['unmap_ms']:>7} {r['release_ms']:>8}")

print("\nlarge handles mapped as 2 MiB pages (separate mappings at offsets into each handle)")
print(f"{'chunk':>6} {'access':>8} {'create':>8} {'map':>7} {'access':>8} {'unmap':>7} {'release':>8}  (ms for 1 GiB)")
for chunk in (2 * MIB, 32 * MIB):
    for per in (False, True):
        try:
            r = run(chunk, per, pages=True)
        except RuntimeError as e:  # CUDA 13 on the H200: 801 (not supported) for offset != 0
            print(f"{chunk // MIB:>5}M {'each' if per else 'once':>8} {e}")
            continue
        print(f"{r['chunk_MiB']:>5}M {'each' if per else 'once':>8} {r['create_ms']:>8} {r['map_ms']:>7} {r['set_access_ms']:>8} {r['unmap_ms']:>7} {r['release_ms']:>8}")
print(f"\nunmapping 2 MiB inside a 32 MiB mapping: CUresult {partial_unmap()} (0 = allowed)")
