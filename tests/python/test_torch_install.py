"""install() inside a real PyTorch process, GPU or not (skipped without PyTorch): PyTorch's
pluggable-allocator API accepts gpumem's functions and hooks, the native path
(install(native=True)) builds against this PyTorch and becomes its allocator, and
c10::OutOfMemoryError is bound from the loaded libc10, so that an out-of-memory failure thrown
by the exported allocation function is that type. Allocations are served by a simulated device
and made through the exported C functions (as PyTorch calls them), so no GPU is needed and no
tensor is made."""

import pytest

from conftest import TORCH_STAT_KEYS, run_python

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


# CUDA graph capture through PyTorch's own entry points, as torch.cuda.graph drives them (the
# filter of torch._C._cuda_beginAllocateToPool takes every stream): requests made through the
# exported allocation hook go to a private pool, which empty_cache leaves while the pool has a
# user and gives back once the pool is released.
GRAPH_POOL_SCRIPT = """
eager = _native.torch_alloc(3 << 20, 0, 0)
_native.torch_free(eager, 0, 0)
torch._C._cuda_beginAllocateToPool(0, (0, 7))
inside = _native.torch_call_alloc_from_cpp(3 << 20, 0, 0)
users = _native.torch_pool_use_count(0, 0, 7)
torch._C._cuda_endAllocateToPool(0, (0, 7))
_native.torch_free(inside[1], 0, 0)
torch._C._cuda_emptyCache()
kept = gpumem.torch.memory_reserved(0)
torch._C._cuda_releasePool(0, (0, 7))
torch._C._cuda_emptyCache()
pool = {"inside": [inside[0], inside[1] == eager], "users": [users, _native.torch_pool_use_count(0, 0, 7)],
        "given_back": kept - gpumem.torch.memory_reserved(0)}
"""


# torch.compile's CUDA graph trees (mode="reduce-overhead") on the native path, through test
# entries of the native build that call c10 as the trees do: a pool is checkpointed after a
# recording and set back to it before the next one; its tensors carry raw_deleter().
CHECKPOINT_SCRIPT = """
tc = nat.gpumem_native_test_checkpoint
tc.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
               ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
               ctypes.c_char_p, ctypes.c_int]
td = nat.gpumem_native_test_deleter
td.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
raw_delete = torch._C._cuda_cudaCachingAllocator_raw_delete
def alloc_kept(n):
    p = ctypes.c_void_p()
    standard = td(n, 0, ctypes.byref(p))
    return p.value, standard
def pool_blocks(pool_id):
    return sorted(b["address"] for s in gpumem.torch.snapshot(0)["segments"]
                  if tuple(s["segment_pool_id"]) == pool_id
                  for b in s["blocks"] if b["state"] == "active_allocated")
cerr = ctypes.create_string_buffer(300)
state = ctypes.c_void_p()
vals = (ctypes.c_uint64 * 64)()
tree = {}
live_before = gpumem.torch.memory_allocated(0)
eager, tree["eager_standard"] = alloc_kept(1 << 20)
torch._C._cuda_beginAllocateCurrentThreadToPool(0, (0, 55))
cx, scx = alloc_kept(3 << 20)
cy, scy = alloc_kept(1 << 20)
ct, sct = alloc_kept(2 << 20)
tree["pool_standard"] = [scx, scy, sct]
raw_delete(ct)
torch._C._cuda_endAllocateToPool(0, (0, 55))
tree["checkpoint"] = tc(0, 0, 55, 0, ctypes.byref(state), vals, 64, cerr, 300)
# Replays happen; cy dies; a second recording into the pool adds cw.
raw_delete(cy)
torch._C._cuda_beginAllocateCurrentThreadToPool(0, (0, 55))
cw, _ = alloc_kept(2 << 20)
tree["while_filling"] = [tc(0, 0, 55, 1, ctypes.byref(state), vals, 64, cerr, 300), cerr.value.decode()]
torch._C._cuda_endAllocateToPool(0, (0, 55))
cerr.value = b""
tree["restore"] = [tc(0, 0, 55, 1, ctypes.byref(state), vals, 64, cerr, 300), cerr.value.decode()]
n_freed = vals[0]
freed = sorted(vals[1:1 + n_freed])
n_back = vals[1 + n_freed]
back = sorted([vals[2 + n_freed + 2 * i], vals[3 + n_freed + 2 * i]] for i in range(n_back))
tree["freed_ok"] = freed == sorted([cx, cw])
tree["back_ok"] = back == sorted([[cx, 1], [cy, 1]])
tree["pool_after"] = pool_blocks((0, 55)) == sorted([cx, cy])
check_live = torch._C._cuda_checkPoolLiveAllocations
tree["live_check"] = [check_live(0, (0, 55), {cx, cy}), check_live(0, (0, 55), {cx}),
                      check_live(0, (0, 55), {cx, cy, eager}), check_live(0, (0, 55), {cx, eager})]
tc(0, 0, 55, 2, ctypes.byref(state), vals, 64, cerr, 300)
for p in (cx, cy, eager):
    raw_delete(p)
# Through torch._C's own bindings, as the trees call them. Nothing is live at the restore, so
# no storage takes the block allocated again: the binding lets go of it, and the trees free it
# (it died since the checkpoint).
torch._C._cuda_beginAllocateCurrentThreadToPool(0, (0, 55))
cz, _ = alloc_kept(5 << 20)
torch._C._cuda_endAllocateToPool(0, (0, 55))
py_state = torch._C._cuda_getCheckpointState(0, (0, 55))
raw_delete(cz)
torch._C._cuda_setCheckpointPoolState(0, py_state, [], [])
tree["binding"] = [type(py_state).__name__, pool_blocks((0, 55)) == [cz]]
raw_delete(cz)
tree["live_after"] = gpumem.torch.memory_allocated(0) - live_before
torch._C._cuda_releasePool(0, (0, 55))
"""


def check_graph_tree(tree):
    # Only a pool's blocks carry raw_deleter() (the trees take their memory back through it);
    # eager tensors keep the per-device deleter.
    assert tree["eager_standard"] == 0 and tree["pool_standard"] == [1, 1, 1], tree
    assert tree["checkpoint"] == 0, tree
    rc, msg = tree["while_filling"]
    assert rc == 1 and "a capture is filling it" in msg, msg
    assert tree["restore"] == [0, ""], tree["restore"]
    assert tree["freed_ok"] and tree["back_ok"] and tree["pool_after"], tree
    # c10's checkPoolLiveAllocations, which the trees call after every recording and restore.
    assert tree["live_check"] == [True, False, False, False], tree["live_check"]
    assert tree["binding"] == ["_cuda_CUDAAllocator_AllocatorState", True], tree["binding"]
    assert tree["live_after"] == 0, tree


def check_graph_pool(pool):
    assert pool["inside"] == ["returned", False], "the capture took the stream's cached block"
    assert pool["users"] == [1, 0]
    # The pool's 20 MiB segment (a 3 MiB request) stayed through empty_cache while the pool
    # had a user, and went back after releasePool.
    assert pool["given_back"] == 20 << 20, pool


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
def test_install_binds_c10_out_of_memory_in_a_real_torch_process():
    r = run_python(
        """
import json, warnings, torch, gpumem
from gpumem import _native
# Serve from a simulated device: nothing in this process allocates a real tensor.
_native.torch_use_simulated_devices(1, 1 << 30)
torch.cuda.is_available = lambda: True   # install() on a machine without a GPU as well
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    gpumem.torch.install(conf="policy:stitched")
kind, cpp_type, what = _native.torch_call_alloc_from_cpp(4 << 30, 0, 0)
ok = _native.torch_call_alloc_from_cpp(1 << 20, 0, 0)
"""
        + GRAPH_POOL_SCRIPT
        + """
# torch.compile(mode="reduce-overhead")'s pool checkpoints: the pluggable wrapper has none, and
# the error says how to get them.
checkpoint_errors = []
for call in (lambda: torch._C._cuda_getCheckpointState(0, (0, 7)),
             lambda: torch._C._cuda_checkPoolLiveAllocations(0, (0, 7), set())):
    try:
        call()
        checkpoint_errors.append(None)
    except RuntimeError as e:
        checkpoint_errors.append(str(e))
print(json.dumps({
    "pool": pool,
    "checkpoint_errors": checkpoint_errors,
    "warnings": [str(x.message) for x in w if "gpumem" in str(x.message)],
    "oom_exception": gpumem.torch.oom_exception(),
    "backend": torch._C._cuda_getAllocatorBackend(),
    "patched": torch.cuda.memory_stats is gpumem.torch.memory_stats,
    "patched_reset": [torch.cuda.reset_accumulated_memory_stats is gpumem.torch.reset_accumulated_memory_stats,
                      torch.cuda.memory.reset_peak_memory_stats is gpumem.torch.reset_peak_memory_stats],
    "thrown": [kind, cpp_type, what[:200]],
    "served": ok[0],
    "keys": sorted(torch.cuda.memory_stats(0)),
    "fraction": [torch.cuda.get_per_process_memory_fraction(0), gpumem.torch.set_memory_fraction(0.3, 0),
                 torch.cuda.get_per_process_memory_fraction("cuda:0")],
}))
"""
    )
    assert r["warnings"] == []
    assert r["oom_exception"] == "c10::OutOfMemoryError"
    assert r["backend"] == "pluggable"
    assert r["patched"]
    assert r["patched_reset"] == [True, True]
    kind, cpp_type, what = r["thrown"]
    assert (kind, cpp_type) == ("threw", "c10::OutOfMemoryError")
    assert what.startswith("CUDA out of memory. gpumem on device 0")
    assert r["served"] == "returned"
    check_graph_pool(r["pool"])
    assert len(r["checkpoint_errors"]) == 2, r["checkpoint_errors"]
    for e in r["checkpoint_errors"]:
        assert e is not None and "install(native=True)" in e, e
    # torch.cuda.memory_stats (patched) has exactly the keys of PyTorch's own.
    assert set(r["keys"]) == TORCH_STAT_KEYS
    # torch.cuda.get_per_process_memory_fraction (patched) reads gpumem's cap as it was given.
    assert r["fraction"] == [1.0, None, 0.3]


def _native_build_reason():
    """Why install(native=True) cannot build here (None if it can): it needs PyTorch, a C++
    compiler, ninja and a CUDA toolkit's headers."""
    if not HAVE_TORCH:
        return "PyTorch is not installed"
    import shutil

    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit (CUDA_HOME) for torch.utils.cpp_extension"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed"
    return None


@pytest.mark.skipif(_native_build_reason() is not None, reason=str(_native_build_reason()))
def test_native_install_builds_and_switches_pytorch_without_touching_cuda(tmp_path):
    # install(native=True) in a real PyTorch process, served by a simulated device: the
    # extension builds against this PyTorch, PyTorch's current allocator becomes gpumem's own
    # class (its name says so), and the build never asks a GPU for its architecture (that
    # would initialize CUDA, after which PyTorch refuses any switch): a GPU is faked whose
    # capability query fails the test if called.
    r = run_python(
        """
import json, os, warnings, torch, gpumem
from gpumem import _native
_native.torch_use_simulated_devices(1, 1 << 30)
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
asked = []
def capability(*a, **k):
    asked.append(a)
    raise RuntimeError("the build asked the GPU for its architecture")
torch.cuda.get_device_capability = capability
os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    gpumem.torch.install(conf="policy:stitched", native=True)
kind, cpp_type, what = _native.torch_call_alloc_from_cpp(4 << 30, 0, 0)
# PyTorch's own C++ entry points now reach gpumem through the native class: raw_delete
# (which knows only the pointer; one block was made on another stream) and empty_cache.
p = _native.torch_alloc(3 << 20, 0, 0)
q = _native.torch_alloc(5000, 0, 0x77)
allocated = gpumem.torch.memory_allocated(0)
torch.cuda.caching_allocator_delete(p)
torch._C._cuda_cudaCachingAllocator_raw_delete(q)
after_delete = gpumem.torch.memory_allocated(0)
reserved = gpumem.torch.memory_reserved(0)
torch._C._cuda_emptyCache()
after_empty = gpumem.torch.memory_reserved(0)
# cuDNN's benchmark mode asks c10's cacheInfo how large a workspace it may take.
import ctypes
nat = gpumem.torch._installed["allocator"]
largest = ctypes.c_size_t(0)
keep = _native.torch_alloc(100 << 20, 0, 0)
cache_rc = nat.gpumem_native_cache_info(0, ctypes.byref(largest))
"""
        + GRAPH_POOL_SCRIPT
        + CHECKPOINT_SCRIPT
        + """
# torch.cuda.MemPool: what its constructor and destructor call through c10 (a test entry: making
# one asks CUDA for the current device), and torch.cuda.use_mem_pool's calls in between.
mp = nat.gpumem_native_test_mem_pool
mp.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
merr = ctypes.create_string_buffer(300)
mem_pool = {"made": mp(0, 0, 99, 0, merr, 300), "users": [_native.torch_pool_use_count(0, 0, 99)]}
torch._C._cuda_beginAllocateCurrentThreadToPool(0, (0, 99))
in_pool = _native.torch_call_alloc_from_cpp(5 << 20, 0, 0)
mem_pool["users"].append(_native.torch_pool_use_count(0, 0, 99))
torch._C._cuda_endAllocateToPool(0, (0, 99))
torch._C._cuda_releasePool(0, (0, 99))
mem_pool["snapshot"] = [[list(s["segment_pool_id"]), [b["address"] for b in s["blocks"] if b["state"] == "active_allocated"]]
                        for s in gpumem.torch.snapshot(0)["segments"] if tuple(s["segment_pool_id"]) == (0, 99)]
mem_pool["in_pool"] = in_pool[1]
_native.torch_free(in_pool[1], 0, 0)
# Other memory cached at the MemPool's end: its destructor empties its own pool's cache alone.
_native.torch_free(_native.torch_alloc(7 << 20, 0, 0x77), 0, 0x77)
before = gpumem.torch.memory_reserved(0)
mem_pool["destroyed"] = mp(0, 0, 99, 2, merr, 300)
mem_pool["given_back"] = before - gpumem.torch.memory_reserved(0)
mem_pool["users"].append(_native.torch_pool_use_count(0, 0, 99))
mem_pool["use_on_oom"] = [mp(0, 0, 98, 1, merr, 300), merr.value.decode()]
# A hook table of the wrong length (a stale build against a newer package) is refused.
few = (ctypes.c_size_t * 3)(1, 2, 3)
short_err = ctypes.create_string_buffer(300)
short_rc = nat.gpumem_native_install(few, 3, short_err, len(short_err))
print(json.dumps({
    "pool": pool,
    "tree": tree,
    "mem_pool": mem_pool,
    "short_table": [short_rc, short_err.value.decode(),
                    len(gpumem.torch._native_hook_addresses(gpumem.torch._installed["library"]))],
    "cache_info": [cache_rc, largest.value],
    "allocated": allocated, "after_delete": after_delete, "reserved": reserved,
    "after_empty": after_empty, "errors": gpumem.torch.error_counts(),
    "mode": gpumem.torch.install_mode(),
    "backend": torch._C._cuda_getAllocatorBackend(),
    "asked": len(asked),
    "arch_env_left": os.environ.get("TORCH_CUDA_ARCH_LIST"),
    "initialized": torch.cuda.is_initialized(),
    "warnings": [str(x.message) for x in w if "gpumem" in str(x.message)],
    "oom_exception": gpumem.torch.oom_exception(),
    "patched": torch.cuda.memory_stats is gpumem.torch.memory_stats,
    "thrown": [kind, cpp_type],
}))
""",
        env={"GPUMEM_NATIVE_BUILD_DIR": str(tmp_path / "build")},
    )
    assert r["mode"] == "native"
    assert r["backend"] == "gpumem", "PyTorch's allocator is gpumem's own class"
    assert r["asked"] == 0 and r["arch_env_left"] is None and not r["initialized"]
    assert r["warnings"] == []
    assert r["oom_exception"] == "c10::OutOfMemoryError"
    assert r["patched"]
    assert r["thrown"] == ["threw", "c10::OutOfMemoryError"]
    assert (tmp_path / "build" / "gpumem_torch_allocator.so").exists()
    assert r["allocated"] == (3 << 20) + 5120
    assert r["after_delete"] == 0, "both blocks found by their pointer alone"
    assert r["reserved"] > 0 and r["after_empty"] == 0
    assert all(v == 0 for v in r["errors"].values()), r["errors"]
    # 1 GiB simulated, 100 MiB live: the rest can still be served (PyTorch's pluggable
    # allocator raises here instead).
    assert r["cache_info"] == [0, (1 << 30) - (100 << 20)]
    # CUDA graph capture: private pools through the same hooks as on the pluggable path.
    check_graph_pool(r["pool"])
    check_graph_tree(r["tree"])
    # torch.cuda.MemPool (native path only: PyTorch's pluggable wrapper has no
    # createOrIncrefPool): the pool is made with one user, use_mem_pool fills it, its
    # destructor lets go and empties it; use_on_oom is refused with a reason.
    m = r["mem_pool"]
    assert m["made"] == 0 and m["destroyed"] == 0, m
    assert m["users"] == [1, 2, 0], m["users"]
    assert m["snapshot"] == [[[0, 99], [m["in_pool"]]]], m["snapshot"]
    assert m["given_back"] == 20 << 20, m
    rc, msg = m["use_on_oom"]
    assert rc == 1 and "MemPool(use_on_oom=True) is not supported" in msg, m["use_on_oom"]
    rc, text, hooks = r["short_table"]
    assert rc == 1 and f"takes {hooks} hook addresses, not 3" in text, text


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
def test_native_install_that_cannot_build_leaves_pytorch_alone(tmp_path):
    # A build that fails (here: the build folder is a file) is a GpumemError that says what
    # the native path needs, and PyTorch's allocator stays its own.
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    r = run_python(
        """
import json, torch, gpumem
from gpumem import _native
_native.torch_use_simulated_devices(1, 1 << 30)
torch.cuda.is_available = lambda: True
try:
    gpumem.torch.install(native=True)
    err = None
except gpumem.GpumemError as e:
    err = str(e)
print(json.dumps({"error": err, "installed": gpumem.torch.is_installed(),
                  "backend": torch._C._cuda_getAllocatorBackend()}))
""",
        env={"GPUMEM_NATIVE_BUILD_DIR": str(blocker / "build")},
    )
    assert r["error"] is not None
    assert not r["installed"]
    assert r["backend"] == "native", "PyTorch's own allocator is still in place"


@pytest.mark.skipif(_native_build_reason() is not None, reason=str(_native_build_reason()))
def test_native_allocator_answers_c10_statistics_and_the_memory_profiler(tmp_path):
    # What the pluggable allocator cannot do, through PyTorch's own C++ entry points: c10's
    # statistics (torch._C's functions, not the patched Python ones) read gpumem's figures
    # and reset them, and torch.profiler with profile_memory=True is told of every allocation
    # and free with its bytes. Tensors' allocations are made by the allocator's allocate()
    # and freed by their DataPtr's deleter, as PyTorch does (a test entry supplies the device,
    # which no GPU can here).
    r = run_python(
        """
import ctypes, json, torch, gpumem
from gpumem import _native
from torch.profiler import profile, ProfilerActivity
_native.torch_use_simulated_devices(1, 1 << 30)
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
gpumem.torch.install(conf="policy:stitched", native=True)
nat = gpumem.torch._installed["allocator"]
f = nat.gpumem_native_test_allocate
f.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
              ctypes.c_char_p, ctypes.c_int]
err = ctypes.create_string_buffer(512)
def tensor(n, dropped):
    out = ctypes.c_void_p()
    assert f(n, 0, dropped, ctypes.byref(out), err, len(err)) == 0, err.value
    return out.value

def flat(nested, prefix=""):
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out.update(flat(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out

kept = tensor(3 << 20, 0)
tensor(1000, 1)
c10 = flat(torch._C._cuda_memoryStats(0))
same = c10 == dict(gpumem.torch.memory_stats(0))
torch._C._cuda_resetPeakMemoryStats(0)
peak_reset = flat(torch._C._cuda_memoryStats(0))
torch._C._cuda_resetAccumulatedMemoryStats(0)
accumulated_reset = flat(torch._C._cuda_memoryStats(0))
try:
    torch._C._cuda_memoryStats(70)
    bad_device = None
except RuntimeError as e:
    bad_device = str(e)
# torch._C's own getter of the fraction (not the patched Python one).
gpumem.torch.set_memory_fraction(0.4, 0)
fraction = torch._C._cuda_getMemoryFraction(0)
gpumem.torch.set_memory_fraction(1.0, 0)

with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    p = tensor(5 << 20, 0)
    tensor(2048, 1)
    torch._C._cuda_cudaCachingAllocator_raw_delete(p)
events = [e.device_memory_usage for e in prof.events() if e.name == "[memory]"]
# Outside the profiler nothing is reported (and nothing is recorded).
tensor(4096, 1)

# torch.cuda.memory's recipe for a snapshot when memory runs out: the observer is called
# before the error reaches PyTorch, with the request, the limit and the free bytes.
# (torch._C._cuda_attach_out_of_memory_observer initializes CUDA first, so a test entry
# attaches the observer through c10 as that binding does; the GPU tests call the binding.)
seen = []
Observer = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)
observer = Observer(lambda *a: seen.append(list(a)))
assert nat.gpumem_native_test_attach_oom_observer(observer) == 0
out = ctypes.c_void_p()
oom_rc = f(2 << 30, 0, 1, ctypes.byref(out), err, len(err))
oom_text = err.value.decode()
print(json.dumps({
    "oom": [oom_rc, oom_text[:60], seen],
    "same": same, "c10": c10, "fraction": fraction, "peak_reset": peak_reset,
    "accumulated_reset": accumulated_reset, "bad_device": bad_device, "events": events,
    "errors": gpumem.torch.error_counts(),
}))
""",
        env={"GPUMEM_NATIVE_BUILD_DIR": str(tmp_path / "build")},
    )
    c10 = r["c10"]
    assert r["same"], "torch._C's statistics are gpumem's, key for key"
    assert set(c10) == TORCH_STAT_KEYS
    assert c10["allocation.all.allocated"] == 2 and c10["allocation.all.freed"] == 1
    assert c10["allocated_bytes.all.current"] == 3 << 20
    assert c10["allocated_bytes.all.peak"] == (3 << 20) + 1024
    assert c10["requested_bytes.all.freed"] == 1000
    assert c10["max_split_size"] == -1
    peak = r["peak_reset"]
    assert peak["allocated_bytes.all.peak"] == 3 << 20, "the peak came down to the current"
    assert peak["allocation.all.allocated"] == 2, "totals stay"
    acc = r["accumulated_reset"]
    assert acc["allocation.all.allocated"] == 0 and acc["allocation.all.freed"] == 0
    assert acc["allocated_bytes.all.freed"] == 0 and acc["num_device_alloc"] == 0
    assert acc["allocated_bytes.all.current"] == 3 << 20, "current values stay"
    assert "invalid CUDA device index 70" in r["bad_device"]
    assert r["fraction"] == 0.4, "the cap as it was given"
    # Each allocation and free, with its bytes as handed out (2048 is already a multiple of
    # 512); the raw delete found its block by the pointer alone.
    assert r["events"] == [5 << 20, 2048, -2048, -(5 << 20)]
    rc, text, seen = r["oom"]
    assert rc == 1 and text.startswith("CUDA out of memory."), text
    # One call: device 0, the 2 GiB asked for, the 1 GiB device's limit and its free bytes
    # (3 MiB live, the rest of what gpumem holds cached).
    assert len(seen) == 1, seen
    device, asked, limit, free = seen[0]
    assert (device, asked, limit) == (0, 2 << 30, 1 << 30)
    assert (1 << 30) - (64 << 20) <= free <= (1 << 30) - (3 << 20), free
    assert all(v == 0 for v in r["errors"].values()), r["errors"]


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
def test_torch_cuda_memory_functions_read_gpumem_in_a_real_torch_process():
    # torch.cuda's own memory functions, as a program calls them, after install() on the
    # pluggable path (the default): each reads or changes gpumem's figures.
    r = run_python(
        """
import json, torch, gpumem
from gpumem import _native
_native.torch_use_simulated_devices(1, 1 << 30)
torch.cuda.is_available = lambda: True
gpumem.torch.install(conf="policy:stitched")
p = _native.torch_alloc(3 << 20, 0, 0)
q = _native.torch_alloc(5 << 20, 0, 0)
_native.torch_free(q, 0, 0)
out = {
    "allocated": torch.cuda.memory_allocated(0),
    "max_allocated": torch.cuda.max_memory_allocated(0),
    "reserved": [torch.cuda.memory_reserved(0), gpumem.torch.memory_reserved(0)],
    "nested": torch.cuda.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["current"],
    "summary": torch.cuda.memory_summary(0) == gpumem.torch.memory_summary(0),
    "snapshot": sorted(torch.cuda.memory._snapshot()),
    "segments": len(torch.cuda.memory_snapshot()),
}
torch.cuda.reset_peak_memory_stats(0)
out["peak_after_reset"] = torch.cuda.max_memory_allocated(0)
torch.cuda.reset_accumulated_memory_stats(0)
out["allocations_after_reset"] = torch.cuda.memory_stats(0)["allocation.all.allocated"]
# torch.cuda.empty_cache() calls this once CUDA is initialized (here it never is).
torch._C._cuda_emptyCache()
out["reserved_live"] = torch.cuda.memory_reserved(0)
_native.torch_free(p, 0, 0)
torch._C._cuda_emptyCache()
out["reserved_empty"] = torch.cuda.memory_reserved(0)
print(json.dumps(out))
"""
    )
    assert r["allocated"] == r["nested"] == 3 << 20
    assert r["max_allocated"] == 8 << 20
    reserved, gpumem_reserved = r["reserved"]
    assert reserved == gpumem_reserved >= 8 << 20
    assert r["summary"], "torch.cuda.memory_summary is gpumem's table"
    assert {"segments", "device_traces"} <= set(r["snapshot"])
    assert r["segments"] >= 1
    assert r["peak_after_reset"] == 3 << 20
    assert r["allocations_after_reset"] == 0
    # The freed block's pages went back; the live block's stay.
    assert 3 << 20 <= r["reserved_live"] < reserved
    assert r["reserved_empty"] == 0


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
def test_torchs_record_memory_history_takes_both_its_signatures_and_checks_them():
    # PyTorch's _record_memory_history takes its older form when `enabled` is a bool
    # (trace_alloc_max_entries, record_context): gpumem's replacement follows both, and refuses
    # what either refuses, instead of swallowing any keyword.
    r = run_python(
        """
import json, warnings, torch, gpumem
from gpumem import _native
_native.torch_use_simulated_devices(1, 1 << 30)
torch.cuda.is_available = lambda: True
gpumem.torch.install(conf="policy:stitched")
out = {}
def err(f):
    try:
        f()
    except Exception as e:
        return type(e).__name__
    return None
h = torch.cuda.memory._record_memory_history
out["misspelt"] = err(lambda: h(True, trace_alloc_max_entires=10))
out["misspelt_current"] = err(lambda: h("all", max_entires=10))
out["bad_context"] = err(lambda: h("all", context="bogus"))
out["bad_stacks"] = err(lambda: h("all", stacks="bogus"))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    h(True, trace_alloc_max_entries=1000, record_context=True, clear_history=True)
out["warned"] = [str(x.message) for x in w]
out["settings"] = list(_native.torch_history_settings())
out["flag"] = err(lambda: gpumem.torch.time_hooks("off"))
print(json.dumps(out))
"""
    )
    assert r["misspelt"] == r["misspelt_current"] == "TypeError"
    assert r["bad_context"] == r["bad_stacks"] == "ValueError"
    assert r["settings"] == [1000, True], "the legacy form's entries and context were kept"
    assert any("clear_history" in m for m in r["warned"]), r["warned"]
    assert r["flag"] == "TypeError", "a string is not read as True"


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
def test_memory_profiler_sees_the_pluggable_hooks():
    # On the default (pluggable) path too, torch.profiler with profile_memory=True is told of
    # each block gpumem's hooks hand out and take back, with its bytes: the hooks call c10's
    # profiler functions, which install() binds from the loaded libc10.
    r = run_python(
        """
import ctypes, json, torch, gpumem
from gpumem import _native
from torch.profiler import profile, ProfilerActivity
_native.torch_use_simulated_devices(1, 1 << 30)
torch.cuda.is_available = lambda: True
gpumem.torch.install(conf="policy:stitched")
lib = ctypes.CDLL(_native.__file__)
lib.gpumem_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.gpumem_torch_free_any.argtypes = [ctypes.c_void_p]
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    _, p = _native.torch_call_alloc_from_cpp(3 << 20, 0, 0)     # as PyTorch calls the hook
    _, q = _native.torch_call_alloc_from_cpp(1000, 0, 0x55)
    lib.gpumem_torch_free(p, 3 << 20, 0, None)
    lib.gpumem_torch_free_any(q)
    lib.gpumem_torch_free_any(q)                                 # a double free: no event
events = [e.device_memory_usage for e in prof.events() if e.name == "[memory]"]
_, outside = _native.torch_call_alloc_from_cpp(4096, 0, 0)
print(json.dumps({"events": events, "bound": _native.torch_profiler_bound(),
                  "errors": gpumem.torch.error_counts()}))
"""
    )
    assert r["bound"], "install() bound c10's profiler functions"
    assert r["events"] == [3 << 20, 1024, -(3 << 20), -1024]
    assert r["errors"]["double_frees"] == 1
