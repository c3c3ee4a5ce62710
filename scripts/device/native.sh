#!/usr/bin/env bash
# gpumem as a CUDAAllocator of its own (`gpumem.torch.install(native=True)`) on the GPU
# machine, against the pluggable path, in one call. From the repository root, with a gpumem
# wheel in .device/wheels (see wheel.sh) and `.device` carried:
#
#     OUT=/some/folder bash scripts/device/native.sh [tests] [calls] [steps] [ROUNDS]
#
# Parts (default: all three, in this order):
#   tests  the Python tests that need PyTorch: every GPU test runs on both paths
#          (test_torch_gpu.py's install_path fixture), and the native build's own tests
#          (test_torch_install.py). About 4-5 minutes (each test starts a fresh interpreter).
#   calls  ns per allocator call through PyTorch's raw-pointer calls, from cold caches (1 MiB
#          written before each call, as session 33 measured the step), on the prefetch trace:
#          native, gpumem (pluggable) and gpumem-native, ROUNDS rounds, CPUs 4-7. The wrapper's
#          cost is the difference between the two gpumem rows (session 33: 406-612 ns a call
#          outside gpumem's hooks on the pluggable path).
#   steps  the prefetch pipeline's step time in lockstep on one CPU (lockstep.sh's method):
#          ROUNDS rounds of native:gpumem-native, gpumem-native:native, native:gpumem and
#          gpumem:native, pooled per allocator (session 33: gpumem 1.0053, over runs
#          1.0026-1.0086).
# The native extension is built once first (timed; cached in $OUT/native_build for the
# children through GPUMEM_NATIVE_BUILD_DIR). Logs under $OUT; the tables are printed last.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/native}
PARTS=()
ROUNDS=2
for a in "$@"; do
    case "$a" in
        tests | calls | steps) PARTS+=("$a") ;;
        [0-9]*) ROUNDS=$a ;;
        *) echo "native.sh: expected tests, calls, steps or a round count, not '$a'" >&2; exit 2 ;;
    esac
done
[[ ${#PARTS[@]} -gt 0 ]] || PARTS=(tests calls steps)
mkdir -p "$OUT"
source scripts/device/wheel.sh
install_gpumem_wheel /tmp/gpumem-site
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
export GPUMEM_NATIVE_BUILD_DIR="$OUT/native_build"
TRACE=${TRACE:-.device/traces/prefetch_mlp.pickle.gz}
rc=0

start=$SECONDS
python3 - > "$OUT/build.log" 2>&1 <<'EOF' || rc=1
import torch, gpumem.torch as gt
gt._build_native_allocator(torch)
print("built; CUDA initialized by the build:", torch.cuda.is_initialized())
EOF
echo "native build: $((SECONDS - start)) s, rc $rc ($(tail -1 "$OUT/build.log"))" \
    | tee "$OUT/summary.txt"

for part in "${PARTS[@]}"; do
    case "$part" in
        tests)
            python3 -m pytest tests/python/test_torch_gpu.py tests/python/test_torch_install.py \
                -v -rs -p no:cacheprovider > "$OUT/pytest.log" 2>&1 || rc=1
            ;;
        calls)
            taskset -c 4-7 python3 scripts/trace_alloc_time.py "$TRACE" \
                --allocators native,gpumem,gpumem-native --cold-kib 1024 --passes 4 \
                --repeat "$ROUNDS" --out "$OUT/calls" > "$OUT/calls.log" 2>&1 || rc=1
            ;;
        steps)
            python3 scripts/lockstep_steps.py --workloads prefetch_mlp --steps 300 --cpus 4 \
                --pairs native:gpumem-native,gpumem-native:native,native:gpumem,gpumem:native \
                --repeat "$ROUNDS" --out "$OUT/steps" > "$OUT/steps.log" 2>&1 || rc=1
            ;;
    esac
done

{
    [[ -f $OUT/pytest.log ]] && { echo "== tests"; grep -E "^(FAILED|ERROR) " "$OUT/pytest.log"; tail -1 "$OUT/pytest.log"; }
    [[ -f $OUT/calls.log ]] && { echo "== calls (ns per call, cold)"; tail -20 "$OUT/calls.log"; }
    if [[ -f $OUT/steps/lockstep.jsonl ]]; then
        echo "== steps (pooled)"
        python3 scripts/lockstep_steps.py --pool "$OUT/steps/lockstep.jsonl"
    fi
} | tee -a "$OUT/summary.txt"
exit $rc
