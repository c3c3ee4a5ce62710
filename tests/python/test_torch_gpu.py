"""gpumem as PyTorch's allocator on a real GPU. Skipped (with the reason) without PyTorch or
CUDA. Every test runs its PyTorch code in a fresh interpreter: install() must precede CUDA's
initialization and holds for the whole process."""

import os
import pickle
import subprocess
import sys

import pytest

from conftest import (
    GIB,
    MIB,
    TORCH_STAT_KEYS,
    check_snapshot_shape,
    live_blocks,
    needs_torch_cuda,
    run_python,
)

pytestmark = needs_torch_cuda

PRELUDE = """
import json, torch, gpumem
gpumem.torch.install()
"""


@pytest.fixture(autouse=True, params=["pluggable", "native"])
def install_path(request, monkeypatch):
    """Every test runs twice: with gpumem behind PyTorch's CUDAPluggableAllocator, and as a
    CUDAAllocator of its own (install(native=True)). The children's install() calls read the
    choice from GPUMEM_TORCH_NATIVE."""
    monkeypatch.setenv("GPUMEM_TORCH_NATIVE", "1" if request.param == "native" else "0")
    return request.param


def test_install_then_train_a_small_model(install_path):
    r = run_python(
        PRELUDE
        + """
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
x = torch.randn(256, 512, device="cuda")
y = torch.randn(256, 512, device="cuda")
losses = []
for _ in range(30):
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
torch.cuda.synchronize()
s = gpumem.torch.memory_stats()
params = sum(p.numel() * p.element_size() for p in m.parameters())
print(json.dumps({
    "losses": losses, "params": params, "stats": dict(s),
    "torch_allocated": torch.cuda.memory_allocated(), "torch_max_reserved": torch.cuda.max_memory_reserved(),
    "devices": gpumem.torch.devices(), "errors": gpumem.torch.error_counts(),
    "oom_type": gpumem.torch.oom_exception(), "conf": gpumem.torch.conf(),
    "backend": torch.cuda.get_allocator_backend(), "mode": gpumem.torch.install_mode(),
}))
"""
    )
    losses = r["losses"]
    assert all(l == l for l in losses), "no NaN"
    assert losses[-1] < 0.9 * losses[0], losses
    s = r["stats"]
    assert set(s) == TORCH_STAT_KEYS
    # Live: parameters, AdamW's two moments, x and y at least.
    assert s["allocated_bytes.all.current"] >= 3 * r["params"] + 2 * 256 * 512 * 4
    assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
    assert s["num_ooms"] == 0
    # torch.cuda's own helpers read gpumem's statistics after install().
    assert r["torch_allocated"] == s["allocated_bytes.all.current"]
    assert r["torch_max_reserved"] == s["reserved_bytes.all.peak"]
    assert r["devices"] == [0]
    assert all(v == 0 for v in r["errors"].values()), r["errors"]
    assert r["oom_type"] == "c10::OutOfMemoryError"
    # The allocator PyTorch calls names itself: PyTorch's wrapper, or gpumem's own class.
    assert r["backend"] == {"pluggable": "pluggable", "native": "gpumem"}[install_path]
    assert r["mode"] == install_path


def test_cudnn_benchmark_mode_sizes_its_workspace_by_gpumem(install_path):
    # torch.backends.cudnn.benchmark asks the allocator how large a workspace it may take
    # (c10's cacheInfo). gpumem's native allocator answers; PyTorch's pluggable allocator has
    # no such hook and raises, which this test reports as a skip with PyTorch's message.
    r = run_python(
        PRELUDE
        + """
torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 7, stride=2, padding=3), torch.nn.ReLU(),
                        torch.nn.Conv2d(64, 64, 3, padding=1)).cuda()
x = torch.randn(16, 3, 224, 224, device="cuda")
try:
    for _ in range(3):
        m(x).square().mean().backward()
    torch.cuda.synchronize()
    out = {"ok": True, "grad": float(m[0].weight.grad.abs().sum().item())}
except RuntimeError as e:
    out = {"ok": False, "error": str(e)[:400]}
out["errors"] = gpumem.torch.error_counts()
print(json.dumps(out))
"""
    )
    if install_path == "pluggable" and not r["ok"]:
        assert "cacheInfo" in r["error"], r
        pytest.skip(f"PyTorch's pluggable allocator cannot run cudnn.benchmark: {r['error'][:160]}")
    assert r["ok"], r
    assert r["grad"] > 0
    assert all(v == 0 for v in r["errors"].values()), r["errors"]


def test_memory_profiler_and_c10_statistics_see_gpumem(install_path):
    # torch.profiler with profile_memory=True is told of every CUDA allocation and free (by
    # gpumem's hooks, on both paths), and torch._C's own statistics (c10's getDeviceStats,
    # which the patched Python functions bypass) read gpumem's figures on the native path;
    # under PyTorch's pluggable allocator they raise.
    r = run_python(
        PRELUDE
        + """
from torch.profiler import profile, ProfilerActivity
x = torch.randn(1024, 1024, device="cuda")
float((x @ x).relu().sum().item())  # cuBLAS's workspace, kept for the process, made before
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
    y = x @ x
    z = torch.relu(y)
    del y
    total = float(z.sum().item())
    del z
    torch.cuda.synchronize()
# A report made inside an operator (the allocations of y, z and the sum) is counted in that
# operator's device memory, not listed as an event of its own; the frees, made by `del`
# outside any operator, are "[memory]" events. Each event's own share (children excluded)
# counts every report once.
cuda_events = [e.self_device_memory_usage for e in prof.events() if e.self_device_memory_usage != 0]
try:
    c10 = torch._C._cuda_memoryStats(0)
    c10_allocated = c10["allocated_bytes"]["all"]["current"]
except RuntimeError as e:
    c10_allocated = str(e)[:200]
print(json.dumps({"events": cuda_events, "c10_allocated": c10_allocated,
                  "gpumem_allocated": gpumem.torch.memory_allocated(0),
                  "errors": gpumem.torch.error_counts()}))
"""
    )
    events = r["events"]
    four_mib = 1024 * 1024 * 4
    # y and z (4 MiB each) allocated (by aten::mm and aten::relu) and freed; the sum's result
    # and any buffer of its reduction come and go too.
    assert events.count(four_mib) >= 2 and events.count(-four_mib) >= 2, events
    assert sum(events) == 0, f"every allocation in the window was freed in it: {events}"
    if install_path == "pluggable":
        assert "getDeviceStats" in str(r["c10_allocated"]), r["c10_allocated"]
    else:
        # x, and cuBLAS's workspace (kept by PyTorch for the process) if it came from the
        # allocator.
        assert r["c10_allocated"] == r["gpumem_allocated"] >= four_mib
    assert all(v == 0 for v in r["errors"].values()), r["errors"]


def test_cuda_graphs_keep_their_memory_and_replay_right(install_path):
    # torch.cuda.graph with gpumem: the capture's tensors come from a private pool, eager
    # tensors made after the capture never take the graph's memory (the graph would overwrite
    # them on replay), replays compute what eager code computes, a second graph can share the
    # pool, and the pool's memory goes back once the graphs are gone.
    r = run_python(
        PRELUDE
        + """
import gc
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
static_x = torch.randn(64, 1024, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):  # warm-up on the side stream, as PyTorch's documentation asks
        m(static_x)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    static_y = m(static_x)
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, pool=g.pool()):
    static_z = static_y * 2
graph_range = (static_y.data_ptr(), static_y.data_ptr() + static_y.numel() * 4)
# Eager tensors of the graph's sizes, made after the capture: none inside the graph's memory.
eager = [torch.empty(64, 4096, device="cuda") for _ in range(8)] + [torch.empty(64, 1024, device="cuda") for _ in range(8)]
overlap = [t.data_ptr() for t in eager if graph_range[0] <= t.data_ptr() < graph_range[1]]
for t in eager:
    t.fill_(7.0)
results = []
for i in range(3):
    x = torch.randn(64, 1024, device="cuda")
    static_x.copy_(x)
    g.replay()
    g2.replay()
    with torch.no_grad():
        want = m(x)
    results.append([torch.allclose(static_y, want, atol=1e-4), torch.allclose(static_z, 2 * want, atol=1e-4)])
intact = all(bool((t == 7.0).all()) for t in eager)
del eager
torch.cuda.synchronize()
reserved_with_graphs = torch.cuda.memory_reserved()
del g, g2, static_y, static_z
gc.collect()
torch.cuda.empty_cache()
print(json.dumps({"overlap": overlap, "results": results, "intact": intact,
                  "reserved_with_graphs": reserved_with_graphs,
                  "reserved_after": torch.cuda.memory_reserved(),
                  "errors": gpumem.torch.error_counts()}))
"""
    )
    assert r["overlap"] == [], "an eager tensor was placed in the graph's memory"
    assert r["results"] == [[True, True]] * 3, r["results"]
    assert r["intact"], "a replay overwrote an eager tensor"
    assert r["reserved_after"] < r["reserved_with_graphs"], r
    assert all(v == 0 for v in r["errors"].values()), r["errors"]


def test_torch_compile_reduce_overhead_trains_like_eager_on_the_native_path(install_path):
    # torch.compile(mode="reduce-overhead") records CUDA graphs into one pool (CUDA graph
    # trees). Two compiled modules train in sequence; after their graphs replay, the second
    # one's input changes shape, so a new graph is warmed up and recorded while the first one's
    # replayed outputs are live: the trees checkpoint the pool after each recording and set it
    # back first (c10's getCheckpointState / setCheckpointPoolState). Losses and gradients must
    # match eager PyTorch's, step by step. PyTorch's pluggable wrapper has no checkpoints.
    r = run_python(
        PRELUDE
        + """
import copy
torch.manual_seed(0)
f = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()
g = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 8)).cuda()
ef, eg = copy.deepcopy(f), copy.deepcopy(g)
cf = torch.compile(f, mode="reduce-overhead", dynamic=False)
cg = torch.compile(g, mode="reduce-overhead", dynamic=False)
def step(mf, mg, x, n):
    loss = mg(mf(x)[:n]).float().square().mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in list(mf.parameters()) + list(mg.parameters())]
    for p in list(mf.parameters()) + list(mg.parameters()):
        p.grad = None
    return loss.detach().clone(), grads
rows = []
try:
    for i, n in enumerate([64, 64, 64, 64, 32, 32, 32, 64, 32]):
        x = torch.randn(64, 256, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        lc, gc_ = step(cf, cg, x, n)
        le, ge = step(ef, eg, x, n)
        rows.append([i, n, torch.allclose(lc, le, rtol=1e-3, atol=1e-5),
                     all(torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(gc_, ge))])
    torch.cuda.synchronize()
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_container(0).tree_manager
    out = {"error": None, "rows": rows, "checkpoints": manager.debug_checkpointing_counter,
           "pool_blocks": sum(1 for s in gpumem.torch.snapshot()["segments"]
                              if tuple(s["segment_pool_id"]) != (0, 0))}
except Exception as e:
    out = {"error": f"{type(e).__name__}: {str(e)[:400]}", "rows": rows}
out["errors"] = gpumem.torch.error_counts()
print(json.dumps(out))
"""
    )
    if install_path == "pluggable":
        # gpumem's error (install() replaces PyTorch's bare "does not yet support") says how to
        # get them.
        assert r["error"] is not None and "install(native=True)" in r["error"], r
        pytest.skip(f"PyTorch's pluggable allocator has no pool checkpoints: {r['error'][:160]}")
    assert r["error"] is None, r
    assert [row[2:] for row in r["rows"]] == [[True, True]] * 9, r["rows"]
    assert r["checkpoints"] >= 1, "the run never set a pool back to a checkpoint"
    assert r["pool_blocks"] >= 1, "the graphs' memory was not in a private pool"
    assert all(v == 0 for v in r["errors"].values()), r["errors"]


def test_mem_pool_keeps_its_memory_on_the_native_path(install_path):
    # torch.cuda.MemPool: on the native path a private pool of gpumem's (use_mem_pool fills it,
    # nothing else takes its memory, it goes back when the MemPool is destroyed); PyTorch's
    # pluggable wrapper cannot make one and says so.
    r = run_python(
        PRELUDE
        + """
import gc
try:
    pool = torch.cuda.MemPool()
except RuntimeError as e:
    print(json.dumps({"error": str(e)[:300]}))
    raise SystemExit
with torch.cuda.use_mem_pool(pool):
    x = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
users = pool.use_count()
ids = [list(s["segment_pool_id"]) for s in gpumem.torch.snapshot()["segments"]
       if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
pool_id = list(pool.id)
x_ptr = x.data_ptr()
del x
eager = [torch.empty(5 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
taken = [t.data_ptr() == x_ptr for t in eager]
del eager
torch.cuda.synchronize()
reserved = torch.cuda.memory_reserved()
del pool
gc.collect()
torch.cuda.empty_cache()
print(json.dumps({"error": None, "users": users, "ids": ids, "pool_id": pool_id, "taken": taken,
                  "given_back": reserved - torch.cuda.memory_reserved(),
                  "errors": gpumem.torch.error_counts()}))
"""
    )
    if install_path == "pluggable":
        assert "createOrIncrefPool" in r["error"], r
        return
    assert r["error"] is None, r["error"]
    assert r["users"] == 1
    assert r["ids"] == [r["pool_id"]], r
    assert not any(r["taken"]), "an eager tensor took the MemPool's memory"
    assert r["given_back"] >= 20 << 20, r
    assert all(v == 0 for v in r["errors"].values()), r["errors"]


def test_raw_allocations_on_a_side_stream_are_freed_by_pointer_alone():
    # torch.cuda.caching_allocator_alloc/delete: PyTorch's raw path (cuBLAS workspaces, NCCL,
    # thrust). Under the native allocator the delete carries only the pointer, so gpumem must
    # find the block itself, on whichever stream it was allocated.
    r = run_python(
        PRELUDE
        + """
side = torch.cuda.Stream()
base = gpumem.torch.memory_stats()["allocated_bytes.all.current"]
ptrs = [torch.cuda.caching_allocator_alloc(1 << 20, stream=side) for _ in range(4)]
ptrs += [torch.cuda.caching_allocator_alloc(3000) for _ in range(4)]
held = gpumem.torch.memory_stats()["allocated_bytes.all.current"] - base
for p in ptrs:
    torch.cuda.caching_allocator_delete(p)
after = gpumem.torch.memory_stats()["allocated_bytes.all.current"] - base
print(json.dumps({"held": held, "after": after, "errors": gpumem.torch.error_counts()}))
"""
    )
    assert r["held"] == 4 * (1 << 20) + 4 * 3072, r
    assert r["after"] == 0, r
    assert all(v == 0 for v in r["errors"].values()), r["errors"]


def test_stats_match_what_was_allocated():
    r = run_python(
        PRELUDE
        + """
base = gpumem.torch.memory_stats()
small = torch.empty(1000, dtype=torch.uint8, device="cuda")
large = torch.empty(3 * 2**20 + 1, dtype=torch.uint8, device="cuda")
during = gpumem.torch.memory_stats()
del small, large
after = gpumem.torch.memory_stats()
d = lambda s, k: s[k] - base[k]
print(json.dumps({
    "requested": d(during, "requested_bytes.all.current"),
    "allocated": d(during, "allocated_bytes.all.current"),
    "small": d(during, "allocated_bytes.small_pool.current"),
    "large": d(during, "allocated_bytes.large_pool.current"),
    "count": d(during, "allocation.all.current"),
    "after": d(after, "allocated_bytes.all.current"),
    "freed": d(after, "allocated_bytes.all.freed"),
}))
"""
    )
    assert r["requested"] == 1000 + 3 * MIB + 1
    assert r["allocated"] == 1024 + 3 * MIB + 512
    assert (r["small"], r["large"]) == (1024, 3 * MIB + 512)
    assert r["count"] == 2
    assert r["after"] == 0 and r["freed"] == 1024 + 3 * MIB + 512


# Loading a kernel for the first time (CUDA's lazy module loading) waits for the device, and so
# does mapping fresh pages: either would drain a busy stream's queue and hide the races the
# tests below are about. Run everything once first on STREAMS (n floats), so that the measured
# pass launches loaded kernels on pages already mapped.
WARM_UP = """
for s_ in STREAMS:
    with torch.cuda.stream(s_):
        w_ = torch.empty(n, device="cuda")
        torch.cuda._sleep(1000)
        w_.fill_(1.0)
        torch.cuda.synchronize()
        del w_
"""

RECORD_STREAM = """
# Both streams are created streams: the legacy default stream would synchronise with them
# implicitly and hide the race this test is about.
main = torch.cuda.Stream()
side = torch.cuda.Stream()
n = 16 * 2**20
""" + WARM_UP.replace("STREAMS", "(main, side)") + """
with torch.cuda.stream(main):
    x = torch.empty(n, device="cuda")
    x_ptr = x.data_ptr()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        # Keep the side stream busy for about half a second with a spin kernel, which
        # allocates nothing (allocating there could make gpumem wait for the side stream's
        # queued work, draining it), then use x there.
        torch.cuda._sleep(1_000_000_000)
        x.fill_(1.0)                       # x is used on the side stream after that
    side_busy = not side.query()
    if RECORD:
        x.record_stream(side)
    before = gpumem.torch.memory_stats()["active_bytes.all.current"]
    del x                                  # freed on main while the side still needs it
    pending = gpumem.torch.memory_stats()["active_bytes.all.current"]
    y = torch.empty(n, device="cuda")      # same size, main stream: a candidate for x's block
    y.fill_(2.0)                           # runs at once on the main stream
torch.cuda.synchronize()
print(json.dumps({"same_block": y.data_ptr() == x_ptr, "y_intact": bool((y == 2.0).all().item()),
                  "side_busy": side_busy, "active_before": before, "active_after_del": pending,
                  "errors": gpumem.torch.error_counts()}))
"""


def _busy_or_skip(r):
    if not r["side_busy"]:
        pytest.skip(f"could not keep the side stream busy, so the race cannot be shown: {r}")


def test_record_stream_is_honoured():
    r = run_python(PRELUDE + "RECORD = True\n" + RECORD_STREAM)
    _busy_or_skip(r)
    # x stays active (pending) after its free, until the side stream's event completes.
    assert r["active_after_del"] == r["active_before"], r
    assert not r["same_block"], ("x's block was handed out while the side stream still used it", r)
    assert r["y_intact"], "y was overwritten by the side stream's late write to x"


def test_record_stream_control_without_the_hint_reuses_the_block():
    # The control: without record_stream the allocator may (and gpumem does) reuse x's block
    # at once, and the side stream's late write lands in y. This shows the test above can fail.
    r = run_python(PRELUDE + "RECORD = False\n" + RECORD_STREAM)
    _busy_or_skip(r)
    assert r["same_block"], r
    assert not r["y_intact"], r


SHARED_HANDOVER = """
import json, torch, gpumem
gpumem.torch.install(conf=CONF)
n = 4 << 20                                # 16 MiB of float32
a, b = torch.cuda.Stream(), torch.cuda.Stream()
""" + WARM_UP.replace("STREAMS", "(a, b)") + """
with torch.cuda.stream(b):
    warm = torch.empty(1024, device="cuda")  # b holds a block of the pool during the handover
with torch.cuda.stream(a):
    x = torch.empty(n, device="cuda")
    x_ptr = x.data_ptr()
    torch.cuda._sleep(1_000_000_000)       # keeps a busy for about half a second
    x.fill_(1.0)                           # so this write lands late
    a_busy = not a.query()
    del x                                  # freed on its own stream: no record_stream needed
with torch.cuda.stream(b):
    y = torch.empty(n, device="cuda")      # same size, another stream
    y.fill_(2.0)
torch.cuda.synchronize()
print(json.dumps({"same_block": y.data_ptr() == x_ptr, "y_intact": bool((y == 2.0).all().item()),
                  "a_busy": a_busy, "errors": gpumem.torch.error_counts()}))
"""


@pytest.mark.parametrize("conf", ["range:shared", ""])
def test_a_shared_range_hands_a_block_to_another_stream_behind_its_work(conf):
    # range:shared, and the default (range:auto) once this one thread has allocated on both
    # streams: a block freed on one stream may go to another at once, and that stream then
    # waits (on the device) for the first one's queued work, so the late write to x lands
    # before y's fill.
    r = run_python(SHARED_HANDOVER.replace("CONF", repr(conf)))
    if not r["a_busy"]:
        pytest.skip(f"could not keep stream a busy, so the race cannot be shown: {r}")
    assert r["same_block"], ("the shared range did not hand x's block to stream b", r)
    assert r["y_intact"], ("stream b's fill ran before stream a's earlier write", r)


def test_ranges_per_stream_never_hand_a_block_to_another_stream():
    # range:stream, for contrast: each stream places its blocks in a range of its own.
    r = run_python(SHARED_HANDOVER.replace("CONF", repr("range:stream")))
    assert not r["same_block"], r
    assert r["y_intact"], r


def test_out_of_memory_observers_are_called_before_the_error(install_path):
    # torch.cuda.memory's recipe for a snapshot when memory runs out: an observer attached with
    # torch._C._cuda_attach_out_of_memory_observer is called before the error, with the
    # device, the request, the limit (here the cap) and the device's free bytes. The native
    # allocator calls it; PyTorch's pluggable allocator cannot attach one (reported as a skip).
    r = run_python(
        PRELUDE
        + """
torch.cuda.set_per_process_memory_fraction(0.05)
seen = []
try:
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(list(a)))
    attach_error = None
except RuntimeError as e:
    attach_error = str(e)[:200]
total = torch.cuda.get_device_properties(0).total_memory
try:
    x = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
    raised = False
except torch.cuda.OutOfMemoryError:
    raised = True
print(json.dumps({"attach_error": attach_error, "seen": seen, "raised": raised, "total": total,
                  "errors": gpumem.torch.error_counts()}))
"""
    )
    if install_path == "pluggable" and r["attach_error"] is not None:
        pytest.skip(f"PyTorch's pluggable allocator cannot attach an observer: {r['attach_error']}")
    assert r["attach_error"] is None and r["raised"], r
    assert len(r["seen"]) == 1, r["seen"]
    device, asked, limit, free = r["seen"][0]
    total = r["total"]
    assert device == 0 and asked == int(total * 0.1)
    assert abs(limit - 0.05 * total) <= 2 << 20, (limit, total)
    assert 0 < free <= total
    assert all(v == 0 for v in r["errors"].values()), r["errors"]


def test_out_of_memory_is_torch_out_of_memory_error_and_the_process_survives():
    r = run_python(
        PRELUDE
        + """
torch.cuda.set_per_process_memory_fraction(0.05)
read_back = torch.cuda.get_per_process_memory_fraction()
total = torch.cuda.get_device_properties(0).total_memory
keep = torch.empty(2**30, dtype=torch.uint8, device="cuda")
caught = {}
for label, nbytes in (("over_cap", int(total * 0.2)), ("absurd", 2**50)):
    try:
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        caught[label] = None
    except torch.cuda.OutOfMemoryError as e:
        caught[label] = ["OutOfMemoryError", str(e)]
    except RuntimeError as e:
        caught[label] = ["RuntimeError", str(e)]
after = torch.empty(2**30, dtype=torch.uint8, device="cuda")
after.fill_(7)
torch.cuda.synchronize()
s = gpumem.torch.memory_stats()
print(json.dumps({"caught": caught, "ooms": s["num_ooms"], "ok": int(after[123].item()),
                  "read_back": read_back,
                  "held": s["reserved_bytes.all.current"], "cap": int(total * 0.05)}))
"""
    )
    for label in ("over_cap", "absurd"):
        kind, msg = r["caught"][label]
        assert kind == "OutOfMemoryError", (label, kind, msg)
        assert msg.startswith("CUDA out of memory."), msg
        assert "gpumem" in msg
    assert r["ooms"] == 2
    assert r["ok"] == 7
    assert abs(r["read_back"] - 0.05) < 1e-9, "get_per_process_memory_fraction reads gpumem's cap"
    assert r["held"] <= r["cap"]


def test_install_after_cuda_was_used_gives_a_clear_error():
    r = run_python(
        """
import json, torch, gpumem
x = torch.zeros(1, device="cuda")
try:
    gpumem.torch.install()
    print(json.dumps({"error": None}))
except gpumem.GpumemError as e:
    print(json.dumps({"error": str(e), "still_works": float((x + 1).item())}))
"""
    )
    assert r["error"] is not None
    assert "must run before PyTorch initializes CUDA" in r["error"]
    assert "PyTorch's own allocator already holds" in r["error"]
    assert r["still_works"] == 1.0


def test_zero_sized_tensors_and_empty_cache():
    r = run_python(
        PRELUDE
        + """
z = torch.empty(0, device="cuda")
z2 = torch.empty((0, 7), device="cuda")
zero_ptr = z.data_ptr()
del z, z2
big = torch.empty(2**30, dtype=torch.uint8, device="cuda")
del big
held_before = gpumem.torch.memory_reserved()
torch.cuda.empty_cache()
held_after = gpumem.torch.memory_reserved()
print(json.dumps({"zero_ptr": zero_ptr, "errors": gpumem.torch.error_counts(),
                  "before": held_before, "after": held_after}))
"""
    )
    assert r["zero_ptr"] == 0, "PyTorch's own allocator also gives null for zero bytes"
    assert all(v == 0 for v in r["errors"].values()), r["errors"]
    assert r["before"] >= GIB
    assert r["after"] <= r["before"] - GIB


def test_stats_keys_equal_native_pytorchs():
    native = run_python(
        """
import json, torch
x = torch.empty(10, device="cuda")
print(json.dumps(sorted(torch.cuda.memory_stats())))
"""
    )
    ours = run_python(
        PRELUDE
        + """
x = torch.empty(10, device="cuda")
print(json.dumps(sorted(torch.cuda.memory_stats())))
"""
    )
    assert ours == native


def test_snapshot_has_torchs_shape(tmp_path):
    path = tmp_path / "snap.pickle"
    r = run_python(
        """
import json, torch, gpumem
gpumem.torch.install(conf="history:10000")
x = torch.empty(5 * 2**20, dtype=torch.uint8, device="cuda")
snap = gpumem.torch.snapshot()
torch.cuda.memory._dump_snapshot(%r)
print(json.dumps({"x": x.data_ptr(),
                  "actions": sorted({e["action"] for t in snap["device_traces"] for e in t})}))
"""
        % str(path)
    )
    # The file torch.cuda.memory._dump_snapshot wrote has exactly the shape of PyTorch's own,
    # and holds the tensor as PyTorch would describe it.
    with open(path, "rb") as f:
        snap = pickle.load(f)
    check_snapshot_shape(snap)
    assert live_blocks(snap)[r["x"]] == (5 * MIB, 5 * MIB, "large")
    # One tensor allocated on a fresh pool: its segment's mapping and the allocation itself.
    assert "alloc" in r["actions"], r["actions"]
    assert set(r["actions"]) <= {"alloc", "segment_alloc", "segment_map"}, r["actions"]
    viz = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert viz.returncode == 0, viz.stderr


def test_conf_from_environment_and_bad_conf():
    r = run_python(PRELUDE + 'print(json.dumps({"conf": gpumem.torch.conf()}))', env={"GPUMEM_CONF": "policy:caching"})
    assert r["conf"] == "policy:caching"
    r = run_python(
        """
import json, gpumem
try:
    gpumem.torch.install(conf="policy:magic")
    print(json.dumps({"error": None}))
except ValueError as e:
    print(json.dumps({"error": str(e)}))
"""
    )
    assert r["error"] and "unknown policy" in r["error"]


def test_record_memory_history_through_torchs_function(tmp_path):
    # The usual PyTorch recipe, unchanged: record, run, dump, open with _memory_viz.
    path = tmp_path / "hist.pickle"
    r = run_python(
        PRELUDE
        + """
torch.cuda.memory._record_memory_history(max_entries=100000)
def make_activations():
    return torch.empty(6 * 2**20, dtype=torch.uint8, device="cuda")
kept = make_activations()
tmp = torch.empty(2**20, dtype=torch.uint8, device="cuda")
del tmp
torch.cuda.memory._dump_snapshot(%r)
snap = gpumem.torch.snapshot()
trace = snap["device_traces"][0]
print(json.dumps({
    "kept": kept.data_ptr(),
    "actions": [e["action"] for e in trace],
    "alloc_sizes": [e["size"] for e in trace if e["action"] == "alloc"],
    "frames": all(e.get("frames") for e in trace if e["action"] == "alloc"),
    "summary": torch.cuda.memory_summary(abbreviated=True),
    "full": torch.cuda.memory_summary(),
    "allocated": torch.cuda.memory_allocated(),
}))
"""
        % str(path)
    )
    assert r["alloc_sizes"] == [6 * MIB, MIB]
    assert r["actions"].count("free_requested") == 1 and "segment_map" in r["actions"]
    assert r["frames"], "stacks recorded at each allocation"
    assert "gpumem CUDA memory summary, device ID 0" in r["summary"]
    assert "from large pool" not in r["summary"] and "from large pool" in r["full"]
    assert r["allocated"] == 6 * MIB
    for tool in ("stats", "trace_plot"):
        out = tmp_path / f"{tool}.out"
        args = [sys.executable, "-m", "torch.cuda._memory_viz", tool, str(path)]
        if tool == "trace_plot":
            args += ["-o", str(out)]
        viz = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert viz.returncode == 0, (tool, viz.stderr)


def test_leak_check_at_exit_names_the_leaked_tensor():
    code = (
        PRELUDE
        + """
leaked = torch.empty(7 * 2**20, dtype=torch.uint8, device="cuda")
freed = torch.empty(3 * 2**20, dtype=torch.uint8, device="cuda")
del freed
torch.cuda.synchronize()
print(hex(leaked.data_ptr()))
"""
    )
    env = dict(os.environ, GPUMEM_LEAK_CHECK="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    ptr = proc.stdout.split()[-1]
    err = proc.stderr
    assert "gpumem: PyTorch allocator of device 0" in err, err
    assert "gpumem leak check: allocations still live at exit" in err, err
    assert ptr in err and "7.00 MiB" in err, err
    assert "3.00 MiB" not in err, err


def test_hook_time_counts_pytorchs_own_calls():
    """time_hooks() times the calls PyTorch itself makes through the pluggable allocator: one
    allocation and one free per tensor, one record_stream per Tensor.record_stream."""
    r = run_python(
        PRELUDE
        + """
torch.empty(1, device="cuda")  # creates the device's allocator outside the timed span
gpumem.torch.time_hooks(True)
before = gpumem.torch.hook_time()
side = torch.cuda.Stream()
for i in range(100):
    t = torch.empty(1000 + i, device="cuda")
    if i == 0:
        t.record_stream(side)
    del t
torch.cuda.synchronize()
after = gpumem.torch.hook_time()
gpumem.torch.time_hooks(False)
print(json.dumps({k: [after[k]["calls"] - before[k]["calls"], after[k]["seconds"] - before[k]["seconds"]]
                  for k in after}))
"""
    )
    assert r["alloc"][0] == 100 and r["free"][0] == 100, r
    assert r["record_stream"][0] == 1, r
    # gpumem's own work per call: well under 100 µs each (it is about 0.1-2 µs).
    assert 0 < r["alloc"][1] < 100 * 100e-6, r
    assert 0 < r["free"][1] < 100 * 100e-6, r
