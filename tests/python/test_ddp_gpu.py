"""gpumem under torchrun with DistributedDataParallel over NCCL on two GPUs (skipped with the
reason on machines with fewer). Runs scripts/ddp_train.py once with PyTorch's allocator and once
with gpumem, and compares them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TORCH_CUDA_REASON, gpu_count

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ddp_train.py"

GPUS = gpu_count() if TORCH_CUDA_REASON is None else 0
pytestmark = pytest.mark.skipif(
    TORCH_CUDA_REASON is not None or GPUS < 2,
    reason=TORCH_CUDA_REASON or f"needs 2 CUDA devices, this machine has {GPUS}",
)

# NVLink multicast is off on the lent machines: keep NCCL and symmetric memory away from it.
MULTI_GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def torchrun(allocator: str, out: Path, steps: int = 20) -> subprocess.CompletedProcess:
    env = dict(os.environ, **MULTI_GPU_ENV)
    return subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(SCRIPT), "--allocator", allocator, "--steps", str(steps), "--out", str(out),
        ],
        capture_output=True, text=True, timeout=600, env=env,
    )


def test_ddp_on_two_gpus_matches_pytorchs_allocator(tmp_path):
    native, ours = tmp_path / "native.json", tmp_path / "gpumem.json"
    for allocator, out in (("native", native), ("gpumem", ours)):
        p = torchrun(allocator, out)
        assert p.returncode == 0, f"{allocator} run failed\n{p.stdout}\n{p.stderr[-4000:]}"
    import json

    run = json.loads(ours.read_text())
    assert run["world_size"] == 2
    for r in run["ranks"]:
        assert r["gpumem_devices"] == [r["local_rank"]], r
        assert r["owners"] == [r["local_rank"]], r
        assert not any(r["other_devices_peak_reserved"].values()), r
        assert r["oom_exception"] == "c10::OutOfMemoryError"
        assert r["problems"] == []
    cmp = subprocess.run(
        [sys.executable, str(SCRIPT), "--compare", str(native), str(ours)],
        capture_output=True, text=True, timeout=60,
    )
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert "OK" in cmp.stdout
