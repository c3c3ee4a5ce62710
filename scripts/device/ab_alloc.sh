#!/usr/bin/env bash
# Superseded by scripts/device/ab_pinned.sh (the builds pinned to one CPU, any number of them,
# caching as a control); kept because BENCHMARKS.md §4 (sessions 12-13) names its commands.
#
# Allocation latency, old binary against new, on one machine in one call: ROUNDS interleaved
# rounds, each running `gpumem bench alloc` with the old binary and then the new one (so host
# noise that drifts over minutes hits both alike), and a table of every (policy, case) as
# "old -> new" per round. A change of a few percent is hidden by the H200 host's run-to-run
# noise: with the same binary on both sides (an A/A run, BENCHMARKS.md §4 session 13) single-thread
# figures moved by -37 % to +45 % within a round, the 8-thread case by -5 % to +9 %. Count
# instructions for small changes (cachegrind on the simulated device); use this for a check that
# nothing got slower by more than that.
#
# Needs: the new binary at target/release/gpumem and an old one (e.g. a stripped build of an
# earlier commit copied into .device/, which is git-ignored and carried: run tool
# `carry: ["target/release/gpumem", ".device"]`).
#
# Run from the repository root:
#     OLD=.device/gpumem_prev OUT=/some/dir bash scripts/device/ab_alloc.sh
# Optional: ROUNDS (3), POLICIES ("buddy caching stitched"), THREADS ("1,8"), RUNS (9, the
# median of that many timed runs per figure), EXTRA (more `bench alloc` arguments, e.g.
# "--free-by-ptr" or "--sim" to try the script on a machine without a GPU).
#
# Output: the table on stdout; every figure as JSON lines in $OUT/{old,new}_r<round>.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out/ab_alloc}"
ROUNDS="${ROUNDS:-3}"
POLICIES="${POLICIES:-buddy caching stitched}"
THREADS="${THREADS:-1,8}"
RUNS="${RUNS:-9}"
EXTRA="${EXTRA:-}"
NEW=target/release/gpumem
[[ -n "${OLD:-}" && -x "$OLD" ]] || { echo "ab_alloc.sh: set OLD to the old gpumem binary" >&2; exit 2; }
[[ -x "$NEW" ]] || { echo "ab_alloc.sh: $NEW is missing: cargo build --release first" >&2; exit 2; }
mkdir -p "$OUT"

pflags=()
for p in $POLICIES; do pflags+=(-p "$p"); done
for r in $(seq 1 "$ROUNDS"); do
    for side in old new; do
        bin=$NEW; [[ $side == old ]] && bin=$OLD
        echo "== round $r/$ROUNDS: $side ($bin)" >&2
        # shellcheck disable=SC2086  # EXTRA is a list of arguments
        "$bin" bench alloc "${pflags[@]}" --runs "$RUNS" --no-baselines --threads "$THREADS" \
            --json-out "$OUT/${side}_r$r.jsonl" $EXTRA > "$OUT/${side}_r$r.txt" 2>&1 \
            || echo "ab_alloc.sh: $side round $r failed, see $OUT/${side}_r$r.txt" >&2
    done
done

python3 - "$OUT" "$ROUNDS" $POLICIES <<'EOF'
import json, sys
out, rounds, policies = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def load(path):
    figures = {}
    try:
        for line in open(path):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            figures[(r["allocator"], r["case"], r["threads"])] = r["ns_per_op"]
    except OSError:
        pass
    return figures

def cell(x):
    return "-" if x is None else (f"{x:.1f}" if x < 100 else f"{x:.0f}")

runs = [(load(f"{out}/old_r{r}.jsonl"), load(f"{out}/new_r{r}.jsonl")) for r in range(1, rounds + 1)]
cases = sorted({(k[1], k[2]) for _, new in runs for k in new})
print(f"ns per op, old -> new, rounds 1..{rounds} (median of the timed runs each)")
for p in policies:
    print(f"gpumem:{p}")
    for case, threads in cases:
        key = (f"gpumem:{p}", case, threads)
        cells = [f"{cell(old.get(key))} -> {cell(new.get(key))}" for old, new in runs]
        print(f"  {case:<28} x{threads:<2} " + " | ".join(cells))
EOF
