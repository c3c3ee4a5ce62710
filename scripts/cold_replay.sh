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
# Inclusive counts of the engine's `Allocator::place` and free (`free_allocation`, or
# `free_on` with --free-by-address), less `PagePool::claim_slow` (the pool growing), divided by
# the trace's allocations: instructions, first-level data misses and last-level data misses
# (the lines of data the pair touches), and first-level instruction misses (the code's lines:
# callgrind's instruction cache is not cleared between calls, so these count code evicted by
# the engine's own calls only; a real step evicts more).
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
callgrind_annotate --inclusive=yes --threshold=100 --show=Ir,D1mr,D1mw,DLmr,DLmw,I1mr "$out" 2>/dev/null | python3 -c '
import re, sys
allocs = int(sys.argv[1])
wanted = {"engine::Allocator::place": "place", "engine::Allocator::free_allocation": "free",
          "engine::Allocator::free_on": "free", "PagePool::claim_slow": "claim_slow"}
found = {}
num = r"([\d,]+)\s+(?:\([^)]*\)\s+)?"
for line in sys.stdin:
    m = re.match(r"\s*" + num * 6 + r"(\S+) \[", line)
    if not m:
        continue
    v = [int(m.group(i).replace(",", "")) for i in range(1, 7)]
    for name, key in wanted.items():
        if m.group(7).endswith(name) and v[0] > found.get(key, [0])[0]:
            found[key] = v
z = [0] * 6
p, f, c = (found.get(k, z) for k in ("place", "free", "claim_slow"))
pair = [(a + b - s) / allocs for a, b, s in zip(p, f, c)]
ir, d1r, d1w, dlr, dlw, i1 = pair
print(f"per pair ({allocs} allocations): Ir {ir:.0f}  D1 misses {d1r + d1w:.1f}  "
      f"LL data misses {dlr + dlw:.1f}  I1 misses {i1:.1f}")
' "$allocs"
