#!/usr/bin/env bash
# Instructions per alloc/free pair in `gpumem bench alloc`'s timed loop, on the simulated
# device: the measure of small changes to the allocation path, which the GPU machine's timing
# noise hides (see scripts/device/ab_pinned.sh). Deterministic: the same binary gives the same
# count to within a few instructions.
#
# Method: valgrind's cachegrind counts every instruction of the process at --runs 1 and at
# --runs 3; the difference is two timed runs (op generation, setup and the warm-up run cancel
# out), halved and divided by the case's allocations.
#
# Usage, from the repository root (needs valgrind; cargo build --release first):
#     bash scripts/instr_alloc.sh [BINARY...]        # default: target/release/gpumem
# Optional: CASES, a list of "policy[ --conf ...]|case|allocations" entries (default below:
# stitched with --conf slack:0.1 on the 64 MiB case, so that its timed runs make no driver
# calls, as on the GPU once the remap budget has raised spare pages).
# Optional: BRANCHES=1 also counts mispredicted branches per pair (cachegrind's branch model,
# a simple one: use it to find where, and time the change to decide). A mispredicted branch
# per pair was worth about 4 ns per operation on dev in session 45, far more than the
# instructions around it (BENCHMARKS.md §4).
# Prints one line per binary: instructions per pair for each entry, in order (with
# BRANCHES=1, "instructions/mispredicts").
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "instr_alloc.sh: valgrind is not installed" >&2; exit 2; }
[[ $# -gt 0 ]] || set -- target/release/gpumem
DEFAULT_CASES=(
    "stitched --conf slack:0.1|random_512B_64MiB_live500|100000"
    "stitched|random_512B_1MiB_live2000|200000"
    "stitched|same_1MiB|200000"
    "caching|random_512B_64MiB_live500|100000"
    "caching|random_512B_1MiB_live2000|200000"
    "buddy|random_512B_64MiB_live500|100000"
)
if [[ -n "${CASES:-}" ]]; then
    mapfile -t cases <<< "$CASES"
else
    cases=("${DEFAULT_CASES[@]}")
fi

branch_sim=no
[[ -n "${BRANCHES:-}" ]] && branch_sim=yes

count() { # binary, policy args, runs, case -> instructions [mispredicts] of the whole process
    # Builds since session 50 probe the core's clock before each timed run (about 11 million
    # instructions, untimed): leave it out, so that counts compare with older builds'.
    local no_clock=()
    "$1" bench alloc --help 2>/dev/null | grep -q -- --no-clock && no_clock=(--no-clock)
    # shellcheck disable=SC2086  # the policy entry is a list of arguments
    valgrind --tool=cachegrind --cache-sim=no --branch-sim=$branch_sim --cachegrind-out-file=/dev/null \
        "$1" bench alloc --sim -p $2 --threads 1 --runs "$3" --case "$4" "${no_clock[@]}" 2>&1 >/dev/null \
        | awk '/I *refs/ {gsub(",", "", $NF); i = $NF} /Mispredicts:/ && !m {gsub(",", "", $3); m = $3}
               END {print i, m}'
}

echo "instructions per alloc/free pair, timed loop:"
for e in "${cases[@]}"; do
    IFS='|' read -r p c _ <<< "$e"
    echo "  - $p, $c"
done
for bin in "$@"; do
    [[ -x "$bin" ]] || { echo "instr_alloc.sh: $bin is not an executable" >&2; exit 2; }
    line="$bin:"
    for e in "${cases[@]}"; do
        IFS='|' read -r p c n <<< "$e"
        read -r a am <<< "$(count "$bin" "$p" 1 "$c")"
        read -r b bm <<< "$(count "$bin" "$p" 3 "$c")"
        [[ -n "$a" && -n "$b" ]] || { echo "instr_alloc.sh: no count for $p $c" >&2; exit 1; }
        cell=$(awk -v a="$a" -v b="$b" -v n="$n" 'BEGIN { printf "%.0f", (b - a) / 2 / n }')
        if [[ $branch_sim == yes ]]; then
            [[ -n "$am" && -n "$bm" ]] || { echo "instr_alloc.sh: no branch count for $p $c" >&2; exit 1; }
            cell="$cell/$(awk -v a="$am" -v b="$bm" -v n="$n" 'BEGIN { printf "%.2f", (b - a) / 2 / n }')"
        fi
        line="$line $cell"
    done
    echo "$line"
done
