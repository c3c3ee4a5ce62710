#!/usr/bin/env bash
# Whether a change to a policy changed what it does: replays every bundled trace (and the
# shared anchor traces, when ../shared/traces is there) with two gpumem binaries and compares
# `gpumem replay --json` field for field, less its two timing fields (replay_seconds,
# ns_per_op). Placements, memory, driver calls of every kind, host waits and timelines must be
# the same for a refactor of the hot path.
#
# Usage, from the repository root (cargo build --release first):
#     bash scripts/same_replays.sh OLD_BINARY NEW_BINARY [POLICY...]    # default: stitched
# VARIANTS (optional): a list of extra replay arguments, one variant per line; default: none,
# `--gpu-lag-ms 10` (host waits, as if the GPU ran 10 ms behind) and `--conf range:shared`.
# Prints one line per difference and a count; exits 1 if any replay differs.
set -uo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 2 ]] || { echo "usage: same_replays.sh OLD_BINARY NEW_BINARY [POLICY...]" >&2; exit 2; }
old=$1 new=$2
shift 2
[[ $# -gt 0 ]] || set -- stitched
for b in "$old" "$new"; do
    [[ -x "$b" ]] || { echo "same_replays.sh: $b is not an executable" >&2; exit 2; }
done
if [[ -n "${VARIANTS:-}" ]]; then
    mapfile -t variants <<< "$VARIANTS"
else
    variants=("" "--gpu-lag-ms 10" "--conf range:shared")
fi
shopt -s nullglob
traces=(traces/*.gz traces/validation/*.gz traces/runs/*.gz ../shared/traces/*.pickle.gz)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The replay's JSON lines, keys sorted, without the timing fields.
canon() {
    python3 -c '
import json, sys
def strip(o):
    if isinstance(o, dict):
        return {k: strip(v) for k, v in o.items() if k not in ("replay_seconds", "ns_per_op")}
    if isinstance(o, list):
        return [strip(x) for x in o]
    return o
for line in sys.stdin:
    line = line.strip()
    if line.startswith("{"):
        print(json.dumps(strip(json.loads(line)), sort_keys=True))'
}

n=0 bad=0
for p in "$@"; do
    for v in "${variants[@]}"; do
        for t in "${traces[@]}"; do
            # shellcheck disable=SC2086  # a variant is a list of arguments
            "$old" replay "$t" -p "$p" $v --json 2>/dev/null | canon > "$tmp/old"
            # shellcheck disable=SC2086
            "$new" replay "$t" -p "$p" $v --json 2>/dev/null | canon > "$tmp/new"
            n=$((n + 1))
            if [[ ! -s "$tmp/old" ]]; then
                echo "no replay: $p ${v:-default} $t"
                bad=$((bad + 1))
            elif ! cmp -s "$tmp/old" "$tmp/new"; then
                echo "differs: $p ${v:-default} $t"
                bad=$((bad + 1))
            fi
        done
    done
done
echo "same_replays.sh: $n replays compared, $bad differ"
[[ $bad -eq 0 ]]
