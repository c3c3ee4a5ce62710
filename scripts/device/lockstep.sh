#!/usr/bin/env bash
# Issue 5's step-time ratios in lockstep, pinned as BENCHMARKS.md §3 session 33 found best, with
# the A/A control (PyTorch against itself) in the same call. On the GPU machine, from the
# repository root, with a gpumem wheel in .device/wheels (see wheel.sh):
#
#     OUT=/some/folder bash scripts/device/lockstep.sh [pipeline|server|varlen|single|both] [ROUNDS]
#
# pipeline: the two-stream prefetch pipeline (one host thread), both processes on CPU 4, 300
#   steps a run, about 30 s a run: ROUNDS (default 4) rounds of native:native-again,
#   native:gpumem and gpumem:native (session 33: 16 gpumem runs read 1.0053, over runs
#   1.0026-1.0086, in two calls of 4 rounds).
# server: the four-thread inference server, on CPUs 4-7 with thread i on CPU 4+i in both
#   processes (--pin-threads), 64 steps a run.
# varlen: GPT-2 with random sequence lengths, both processes on CPUs 4-7, STEPS (default 64)
#   steps a run; not part of `both`. Its steps are host-bound and one run's ratio moves by
#   about 1.5 %, so the interval over runs needs many runs, and shorter runs give more of them
#   per call (session 38: six runs of 128 steps, about 75 s each, over runs 0.9990-1.0143;
#   session 39: 25 runs of 64 steps, about 50 s each, pooled with those: 0.9994-1.0053).
# single: the three single-stream workloads whose GPU sets the pace, GPT-2 training (16 steps),
#   ResNet-50 training (16 steps) and the Llama decoder (8 generations of 5-7 s a side), both
#   processes on CPUs 4-7; not part of `both`. Session 29 timed them once each (GPT-2 and the
#   decoder unpinned and with PyTorch first only); this part times them pinned in both orders.
#   SINGLE=... picks the workloads and their steps (default "gpt2_train:16 resnet50_train:16
#   llama_decode:8"; e.g. SINGLE=llama_decode:8 for more decoder generations in one call).
# Each part's JSON lines go to $OUT/<part>/lockstep.jsonl, pooled at the end (`--pool`: the
# pooled median of step ratios with its interval over steps and over whole runs; judge a target
# by the second). Pool several calls' files the same way (earlier calls' files are kept in
# results/lockstep/). The tables are printed last.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/lockstep}
PART=${1:-both}
ROUNDS=${2:-4}
case "$PART" in
    pipeline | server | varlen | single | both) ;;
    *) echo "lockstep.sh: expected pipeline, server, varlen, single or both, not '$PART'" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
source scripts/device/wheel.sh
install_gpumem_wheel /tmp/gpumem-site
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
# PAIRS=... overrides the pairs (e.g. native:native-again,native:gpumem-native,gpumem-native:native
# for the native install path).
PAIRS=${PAIRS:-native:native-again,native:gpumem,gpumem:native}
rc=0
if [[ $PART == pipeline || $PART == both ]]; then
    python3 scripts/lockstep_steps.py --workloads prefetch_mlp --steps 300 --cpus 4 \
        --pairs "$PAIRS" --repeat "$ROUNDS" --out "$OUT/pipeline" > "$OUT/pipeline.log" 2>&1 || rc=1
fi
if [[ $PART == server || $PART == both ]]; then
    python3 scripts/lockstep_steps.py --workloads serve_threads --steps 64 --cpus 4-7 \
        --pin-threads --pairs "$PAIRS" --repeat "$ROUNDS" --out "$OUT/server" \
        > "$OUT/server.log" 2>&1 || rc=1
fi
if [[ $PART == varlen ]]; then
    python3 scripts/lockstep_steps.py --workloads gpt2_varlen --steps "${STEPS:-64}" --cpus 4-7 \
        --pairs "$PAIRS" --repeat "$ROUNDS" --out "$OUT/varlen" > "$OUT/varlen.log" 2>&1 || rc=1
fi
if [[ $PART == single ]]; then
    # One lockstep call per workload and round, so that each workload keeps its own step count
    # and a call cut short by a time limit still has every workload's first rounds; the runs
    # collect in single/lockstep.jsonl as they end.
    mkdir -p "$OUT/single"
    for ((r = 1; r <= ROUNDS; r++)); do
        for w in ${SINGLE:-gpt2_train:16 resnet50_train:16 llama_decode:8}; do
            d="$OUT/single/${w%%:*}-$r"
            python3 scripts/lockstep_steps.py --workloads "${w%%:*}" --steps "${w##*:}" \
                --cpus 4-7 --pairs "$PAIRS" --repeat 1 --out "$d" >> "$OUT/single.log" 2>&1 || rc=1
            cat "$d/lockstep.jsonl" >> "$OUT/single/lockstep.jsonl" 2>/dev/null
        done
    done
fi
for p in pipeline server varlen single; do
    if [[ -f "$OUT/$p/lockstep.jsonl" ]]; then
        echo "== $p"
        python3 scripts/lockstep_steps.py --pool "$OUT/$p/lockstep.jsonl"
    fi
done
exit $rc
