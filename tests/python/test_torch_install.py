"""install() inside a real PyTorch process, GPU or not (skipped without PyTorch): PyTorch's
pluggable-allocator API accepts gpumem's functions and hooks, and c10::OutOfMemoryError is bound
from the loaded libc10, so that an out-of-memory failure thrown by the exported allocation
function is that type. The allocation is served by a simulated device and made through the
exported C function from C++ (as PyTorch calls it), so no GPU is needed and no tensor is made."""

import pytest

from conftest import TORCH_STAT_KEYS, run_python

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


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
print(json.dumps({
    "warnings": [str(x.message) for x in w if "gpumem" in str(x.message)],
    "oom_exception": gpumem.torch.oom_exception(),
    "backend": torch._C._cuda_getAllocatorBackend(),
    "patched": torch.cuda.memory_stats is gpumem.torch.memory_stats,
    "thrown": [kind, cpp_type, what[:200]],
    "served": ok[0],
    "keys": sorted(torch.cuda.memory_stats(0)),
}))
"""
    )
    assert r["warnings"] == []
    assert r["oom_exception"] == "c10::OutOfMemoryError"
    assert r["backend"] == "pluggable"
    assert r["patched"]
    kind, cpp_type, what = r["thrown"]
    assert (kind, cpp_type) == ("threw", "c10::OutOfMemoryError")
    assert what.startswith("CUDA out of memory. gpumem on device 0")
    assert r["served"] == "returned"
    # torch.cuda.memory_stats (patched) has exactly the keys of PyTorch's own.
    assert set(r["keys"]) == TORCH_STAT_KEYS
