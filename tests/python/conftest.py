"""Shared helpers of gpumem's Python tests.

The tests in test_allocator.py and test_torch_entry_points.py run anywhere (CI has neither
PyTorch nor a GPU): they drive gpumem over its simulated device. The *_gpu.py tests need
PyTorch with CUDA and skip with the reason when either is missing; each of them runs its
PyTorch code in a fresh interpreter, because gpumem.torch.install() must come before CUDA is
initialized and holds for the life of a process.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

MIB = 1 << 20
GIB = 1 << 30

# torch.cuda.memory_stats()'s keys in PyTorch 2.11: torch/csrc/cuda/Module.cpp
# (THCPModule_memoryStats) flattened by torch/cuda/memory.py (memory_stats).
TORCH_STAT_ARRAYS = [
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
]
TORCH_STAT_KEYS = (
    {
        f"{name}.{pool}.{field}"
        for name in TORCH_STAT_ARRAYS
        for pool in ("all", "small_pool", "large_pool")
        for field in ("current", "peak", "allocated", "freed")
    }
    | {
        f"{name}.{field}"
        for name in ("oversize_allocations", "oversize_segments")
        for field in ("current", "peak", "allocated", "freed")
    }
    | {
        "num_alloc_retries",
        "num_ooms",
        "max_split_size",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
    }
)


def torch_cuda_reason():
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA device"
    return None


def gpu_count():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_torch_cuda = pytest.mark.skipif(
    torch_cuda_reason() is not None, reason=str(torch_cuda_reason())
)


def run_python(code, env=None, timeout=600):
    """Runs `code` in a fresh interpreter; returns the JSON object on its last stdout line."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"child exited with {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise AssertionError(
            f"child printed no JSON: {e}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        ) from e
