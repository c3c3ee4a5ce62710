#!/usr/bin/env bash
# Cache lines the engine touches per alloc/free pair when each call finds its data out of the
# caches, as PyTorch's calls do in a real step (the step's kernel launches, Python and
# PyTorch's own work run between them): the measure of the allocator's footprint, which its
# instruction count (scripts/instr_replay.sh) does not show. In the prefetch pipeline's step on
# an H200 gpumem's own time is 573-632 ns a call, against 213-355 back to back (BENCHMARKS.md
# §3, session 33): the difference is cache misses.
#
# Method: `gpumem replay TRACE -p stitched --cold-kib 2048` writes 2 MiB of other memory
# before every allocation and free; callgrind simulates a 1 MiB last-level cache, so every
# line the engine touches in a call misses there unless the same call touched it before.
# Inclusive counts of the engine's `Allocator::place` and of the replay's `free_one`
# (`free_allocation`, or `free_on` with --free-by-address), less `PagePool::claim_slow` (the
# pool growing), divided by the trace's allocations: instructions, first-level data misses
# and last-level data misses (the lines of data the pair touches), and first-level
# instruction misses (the code's lines: callgrind's instruction cache is not cleared between
# calls, so these count code evicted by the engine's own calls only; a real step evicts more).
#
# Deterministic for one binary, but a change that moves the heap's layout (a structure's size)
# moves the count by up to about 2 lines a pair on its own (BENCHMARKS.md §3, session 33).
#
# Usage, from the repository root (needs valgrind; cargo build --release first):
#     bash scripts/cold_replay.sh BINARY TRACE [REPLAY ARGS...]
# Prints one line: Ir, D1 misses, LL data misses, I1 misses per pair.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "cold_replay.sh: valgrind is not installed" >&2; exit 2; }
[[ $# -ge 2 ]] || { echo "usage: cold_replay.sh BINARY TRACE [REPLAY ARGS...]" >&2; exit 2; }
bin=$1 trace=$2
shift 2
out=${COLD_OUT:-$(mktemp)}
[[ -n "${COLD_OUT:-}" ]] || trap 'rm -f "$out"' EXIT
valgrind --tool=callgrind --cache-sim=yes --LL=1048576,16,64 --callgrind-out-file="$out" \
    "$bin" replay "$trace" -p stitched --cold-kib 2048 "$@" >/dev/null 2>&1
allocs=$("$bin" replay "$trace" -p stitched --json "$@" 2>/dev/null |
    python3 -c "import json, sys; print(json.load(sys.stdin)['allocs'])")
callgrind_annotate --inclusive=yes --threshold=100 --show=Ir,D1mr,D1mw,DLmr,DLmw,I1mr "$out" 2>/dev/null |
    python3 scripts/engine_cost.py "$allocs" 6 | python3 -c '
import json, sys
c = json.load(sys.stdin)
ir, d1r, d1w, dlr, dlw, i1 = (a + b - s for a, b, s in zip(c["place"], c["free"], c["claim_slow"]))
print(f"per pair ({sys.argv[1]} allocations): Ir {ir:.0f}  D1 misses {d1r + d1w:.1f}  "
      f"LL data misses {dlr + dlw:.1f}  I1 misses {i1:.1f}")
' "$allocs"
