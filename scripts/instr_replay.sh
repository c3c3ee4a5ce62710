#!/usr/bin/env bash
# Instructions per allocation and per alloc/free pair that the engine spends replaying a trace
# with the stitched policy on the simulated device: the measure of changes to the bookkeeping
# behind PyTorch's calls (BENCHMARKS.md §3, sessions 30-31), where the GPU machine's step-time
# noise hides a few hundred instructions.
#
# Method: callgrind's inclusive counts of the engine's `Allocator::place` and of the replay's
# `free_one` (`Allocator::free_allocation`, or `Allocator::free_on` with --free-by-address,
# which frees as PyTorch's hooks do; kept out of line so that its cost shows), less
# `PagePool::claim_slow` (mapping pages while the pool grows, which a settled step does not
# do), divided by the trace's allocations. Loading and checking the trace are left out by
# construction. Two builds of the same code differ by up to about 50 per pair (code layout).
#
# Usage, from the repository root (needs valgrind; cargo build --release first):
#     bash scripts/instr_replay.sh BINARY TRACE [REPLAY ARGS...]
# e.g. bash scripts/instr_replay.sh target/release/gpumem ../shared/traces/prefetch_mlp.pickle.gz
#      bash scripts/instr_replay.sh target/release/gpumem TRACE --gpu-lag-ms 10
#      bash scripts/instr_replay.sh target/release/gpumem TRACE --free-by-address
# Prints: place, free and claim_slow per allocation, then their sum less claim_slow per pair.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "instr_replay.sh: valgrind is not installed" >&2; exit 2; }
[[ $# -ge 2 ]] || { echo "usage: instr_replay.sh BINARY TRACE [REPLAY ARGS...]" >&2; exit 2; }
bin=$1 trace=$2
shift 2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" replay "$trace" -p stitched "$@" >/dev/null 2>&1
allocs=$("$bin" replay "$trace" -p stitched --json "$@" 2>/dev/null |
    python3 -c "import json, sys; print(json.load(sys.stdin)['allocs'])")
callgrind_annotate --inclusive=yes "$out" 2>/dev/null | python3 scripts/engine_cost.py "$allocs" 1 |
    python3 -c '
import json, sys
per = {k: v[0] for k, v in json.load(sys.stdin).items()}
pair = per["place"] + per["free"] - per["claim_slow"]
print(" ".join(f"{k} {v:.0f}" for k, v in per.items()),
      f"| place+free-claim_slow {pair:.0f} per pair ({sys.argv[1]} allocations)")
' "$allocs"
