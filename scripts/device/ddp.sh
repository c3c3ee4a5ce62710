#!/usr/bin/env bash
# gpumem under torchrun with DistributedDataParallel over NCCL on two GPUs (issue 5, part 4):
# the DDP test, then a recorded run: the same seeded training under PyTorch's allocator and under
# gpumem (one pool per rank's device), compared step by step.
#
# Needs, built beforehand on the development machine (from the repository root):
#     .venv/bin/maturin build --release --out .device/wheels
# and `.device` carried (run tool `carry: [".device"]`). Kind: nvidia-h200-x2. The GPU machine
# needs python3 with PyTorch 2.11 (CUDA, NCCL) and pytest; no Rust, no network.
#
# Run from the repository root:  OUT=/some/dir bash scripts/device/ddp.sh
#
# Good result: the pytest line says "1 passed"; the table shows both ranks of the gpumem run
# with pools [0] and [1] respectively, and "largest relative loss difference ... OK" with no
# "problem:" lines. About 1-2 minutes. Logs: $OUT/ddp_*.log, $OUT/ddp_*.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out/ddp}"
mkdir -p "$OUT"
# NVLink multicast is off on these machines: keep NCCL and symmetric memory away from it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# shellcheck source=scripts/device/wheel.sh
source scripts/device/wheel.sh
install_gpumem_wheel "${TMPDIR:-/tmp}/gpumem-site"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"

echo "== pytest tests/python/test_ddp_gpu.py"
python3 -m pytest tests/python/test_ddp_gpu.py -v -rs -p no:cacheprovider >"$OUT/ddp_pytest.log" 2>&1
PYTEST_RC=$?

RUN_RC=0
for alloc in native gpumem; do
    echo "== torchrun --nproc_per_node=2 scripts/ddp_train.py --allocator $alloc"
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 scripts/ddp_train.py \
        --allocator "$alloc" --steps 40 --out "$OUT/ddp_$alloc.json" >"$OUT/ddp_$alloc.log" 2>&1 || RUN_RC=1
    tail -2 "$OUT/ddp_$alloc.log"
done
python3 scripts/ddp_train.py --compare "$OUT/ddp_native.json" "$OUT/ddp_gpumem.json" >"$OUT/ddp_compare.txt" 2>&1 || RUN_RC=1

echo
echo "================ summary (scripts/device/ddp.sh) ================"
echo "pytest (exit $PYTEST_RC): $(tail -1 "$OUT/ddp_pytest.log")"
cat "$OUT/ddp_compare.txt"
[ "$PYTEST_RC" -eq 0 ] && [ "$RUN_RC" -eq 0 ]
