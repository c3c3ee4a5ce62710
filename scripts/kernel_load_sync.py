"""Whether a kernel's first launch waits for the device (CUDA's lazy module loading): queues a
half-second spin kernel on a side stream, then a fill_ (whose kernel is not loaded yet) there,
and prints when each call returned and whether the stream was still busy. Run it as
`python3 scripts/kernel_load_sync.py native` (PyTorch's allocator) or `... gpumem` (gpumem
installed first). On the H200 (2026-12-01) the fill_ returned after 0.507 s under both: the
load waited for the spin kernel. Needs PyTorch with CUDA."""
import json, sys, time, torch
if sys.argv[1] == "gpumem":
    import gpumem
    gpumem.torch.install()
main = torch.cuda.Stream(); side = torch.cuda.Stream()
n = 16 * 2**20
for s_ in (main, side):
    with torch.cuda.stream(s_):
        w = torch.empty(n, device="cuda"); torch.cuda._sleep(1000); torch.cuda.synchronize(); del w
out = {}
t0 = time.perf_counter()
with torch.cuda.stream(main):
    x = torch.empty(n, device="cuda")
    out["alloc_x"] = time.perf_counter() - t0
    side.wait_stream(main)
    out["wait_stream"] = time.perf_counter() - t0
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)
        out["sleep_queued"] = time.perf_counter() - t0
        out["busy_after_sleep"] = not side.query()
        x.fill_(1.0)
        out["fill_queued"] = time.perf_counter() - t0
    out["busy_after_fill"] = not side.query()
    out["query_done"] = time.perf_counter() - t0
torch.cuda.synchronize()
out["sync_done"] = time.perf_counter() - t0
print(sys.argv[1], json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}))
