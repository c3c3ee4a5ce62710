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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import check_snapshot  # noqa: E402  (scripts/check_snapshot.py: PyTorch's snapshot shape)

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


# Why the GPU tests skip here (None: they run), worked out once for every test module.
TORCH_CUDA_REASON = torch_cuda_reason()
needs_torch_cuda = pytest.mark.skipif(TORCH_CUDA_REASON is not None, reason=str(TORCH_CUDA_REASON))


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


# The rows of torch.cuda.memory_summary() (torch/cuda/memory.py, memory_summary) with the
# statistics they show, and its columns.
SUMMARY_ROWS = [
    ("Allocated memory", "allocated_bytes"),
    ("Active memory", "active_bytes"),
    ("Requested memory", "requested_bytes"),
    ("GPU reserved memory", "reserved_bytes"),
    ("Non-releasable memory", "inactive_split_bytes"),
    ("Allocations", "allocation"),
    ("Active allocs", "active"),
    ("GPU reserved segments", "segment"),
    ("Non-releasable allocs", "inactive_split"),
]
OVERSIZE_ROWS = ["Oversize allocations", "Oversize GPU segments"]
COLUMNS = ["current", "peak", "allocated", "freed"]
SIZE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
COUNT_UNITS = {"": 1, "K": 1000, "M": 1000**2}

def parse_summary(text):
    """{(row label, "all" | "large" | "small"): [current, peak, allocated, freed]}, each cell
    as (number, unit)."""
    rows, metric = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] == "Metric":
            continue
        label = cells[0]
        if label.startswith("from "):
            key = (metric, label.split()[1])
        else:
            metric, key = label, (label, "all")
        parsed = []
        for c in cells[1:]:
            number, _, unit = c.partition(" ")
            parsed.append((int(number), unit.strip()))
        rows[key] = parsed
    return rows


def check_summary_against_stats(text, stats, abbreviated=False):
    """Every cell of the table is the statistic it stands for, in the cell's unit (truncated,
    as PyTorch's table truncates), and each column uses one unit."""
    rows = parse_summary(text)
    pools = [("all", "all")] if abbreviated else [("all", "all"), ("large", "large_pool"), ("small", "small_pool")]
    for label, name in SUMMARY_ROWS:
        units = SIZE_UNITS if name.endswith("bytes") else COUNT_UNITS
        for pool, pool_key in pools:
            cells = rows[(label, pool)]
            for col, (number, unit) in zip(COLUMNS, cells):
                value = stats[f"{name}.{pool_key}.{col}"]
                assert unit in units, (label, pool, col, unit)
                assert number == value // units[unit], (label, pool, col, number, unit, value)
                assert unit == rows[(label, "all")][COLUMNS.index(col)][1], "one unit per column"
    for label in OVERSIZE_ROWS:
        assert rows[(label, "all")] == [(0, "")] * 4
    if abbreviated:
        assert not any(pool != "all" for _, pool in rows)


def check_snapshot_shape(snap):
    """The shape of torch.cuda.memory._snapshot(), exactly: scripts/check_snapshot.py's check
    (the one the GPU scripts run on snapshots PyTorch and gpumem wrote)."""
    try:
        check_snapshot.check(snap, exact=True)
    except check_snapshot.Failed as e:
        raise AssertionError(str(e)) from None


def live_blocks(snap):
    return {
        b["address"]: (b["size"], b["requested_size"], seg["segment_type"])
        for seg in snap["segments"]
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    }
