#!/usr/bin/env bash
# One line per recorded trace under the stitched policy: held ÷ live, driver calls, estimated
# driver seconds, calls in the last quarter, host waits, out-of-memory errors and the live
# peak. The table of BENCHMARKS.md §1's sessions 27-28 (`--gpu-lag-ms 10`: host waits counted
# only where a GPU 10 ms behind the host would not have got there yet).
#
# Usage, from the repository root (cargo build --release first):
#     bash scripts/replay_summary.sh [CONF] [BINARY]     # e.g. "big_after:4GiB"; default: ""
# LAG (optional): the --gpu-lag-ms value, default 10; LAG=none counts every wait.
# Traces: ../shared/traces/*.gz (when present), traces/validation/*.gz, traces/gpt_varlen.pickle.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
conf=${1:-}
bin=${2:-target/release/gpumem}
[[ -x "$bin" ]] || { echo "replay_summary.sh: $bin is not an executable (cargo build --release)" >&2; exit 2; }
lag=(--gpu-lag-ms "${LAG:-10}")
[[ "${LAG:-10}" == none ]] && lag=()
shopt -s nullglob
status=0
for f in ../shared/traces/*.gz traces/validation/*.gz traces/gpt_varlen.pickle.gz; do
    name=$(basename "$f"); name=${name%%.*}
    if ! out=$("$bin" replay "$f" -p stitched --json "${lag[@]}" --conf "$conf" 2>&1); then
        echo "$name: replay failed: $(tail -1 <<< "$out")" >&2
        # A bad setting fails every trace alike: say it once.
        grep -q "configuration error" <<< "$out" && exit 2
        status=1
        continue
    fi
    python3 -c '
import json, sys
j = json.loads(sys.stdin.readline())
d = j["driver_calls"]
print("%-16s %.4f %7d calls %.3f s  last quarter %5d  waits %5d  ooms %d  live %.2f GiB" % (
    sys.argv[1], j["ratio"], j["driver_calls_total"], j["est_driver_seconds"],
    j["calls_by_quarter"][3], d.get("cuEventSynchronize", 0), j["ooms"], j["peak_live_bytes"] / 2**30))
' "$name" <<< "$out"
done
exit $status
