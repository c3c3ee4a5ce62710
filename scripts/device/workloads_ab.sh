#!/usr/bin/env bash
# Step time of real PyTorch workloads under gpumem against PyTorch's own allocator, with an A/A
# control (PyTorch run a second time in each round: its ratio to the first run is what this
# machine's noise alone does to the figure). On the GPU machine, from the repository root, with
# a gpumem wheel in .device/wheels (see wheel.sh):
#
#     OUT=/some/folder bash scripts/device/workloads_ab.sh [WORKLOADS] [ROUNDS] [EXTRA ARGS...]
#
# WORKLOADS: comma-separated (default: all five); ROUNDS: interleaved rounds (default 3); extra
# arguments go to bench_workloads.py, e.g. `--allocators native,native-again,gpumem,gpumem-s5
# --variant gpumem-s5=slack:0.05`. The A/A-controlled runs of sessions 4 to 7 in BENCHMARKS.md §3
# were made with it (session 3's, the same method, with local wrappers that preceded it).
# Everything goes under $OUT; the tables are printed last.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/workloads_ab}
mkdir -p "$OUT"
WORKLOADS=${1:-gpt2_train,resnet50_train,llama_decode,prefetch_mlp,gpt2_varlen}
ROUNDS=${2:-3}
shift $(( $# > 2 ? 2 : $# ))
source scripts/device/wheel.sh
install_gpumem_wheel /tmp/gpumem-site
EXTRA=("$@")
if [[ ! " ${EXTRA[*]} " =~ " --allocators " ]]; then
    EXTRA+=(--allocators native,native-again,gpumem)
fi
python3 scripts/bench_workloads.py --workloads "$WORKLOADS" --repeat "$ROUNDS" --no-maxbatch \
    --out "$OUT" "${EXTRA[@]}" > "$OUT/bench.log" 2>&1
rc=$?
grep -q "^Peak held" "$OUT/bench.log" && sed -n "/^Peak held/,\$p" "$OUT/bench.log" || tail -30 "$OUT/bench.log"
exit $rc
