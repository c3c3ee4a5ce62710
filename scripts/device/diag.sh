#!/usr/bin/env bash
# Diagnostics on the GPU machine (issue 6): gpumem's snapshots read by PyTorch's own tools,
# gpumem's summary of a PyTorch snapshot against torch.cuda.memory_stats(), and
# `gpumem monitor` against a process that leaks GPU memory on purpose.
#
# Needs, built beforehand on the development machine and carried in target/release/:
#     cargo build --release -p gpumem-cli                       # target/release/gpumem
#   optional (runs the NVML test marked "needs a CUDA GPU"):
#     cargo test --release -p gpumem-monitor --no-run           # target/release/deps/gpumem_monitor-*
# On the GPU machine: python3 with PyTorch (CUDA), NVML (the driver). No network, no Rust.
#
# Run from the repository root with $OUT set:   OUT=/tmp/out bash scripts/device/diag.sh
# Takes about a minute and a half. Logs and files go to $OUT; a summary table is printed last.
#
# A good result: every line of the table says "ok":
#   - torch.cuda._memory_viz trace_plot, segment_plot, stats and trace run on the snapshots
#     gpumem wrote (native and stitched policies, one with Rust stack frames), and
#     scripts/check_snapshot.py finds PyTorch's keys and types (compared with a snapshot
#     PyTorch wrote on the spot);
#   - `gpumem summary --check` of PyTorch's snapshot gives the same current figures as
#     torch.cuda.memory_stats() taken at the same moment (and the same reserved peak), and the
#     history replays backwards from the segments;
#   - `gpumem monitor --json --count 20` raises an alarm naming the pid of scripts/leaky.py
#     (128 MiB more every second) and none for a process that loads 4 GiB once;
#   - the Prometheus endpoint answers on 127.0.0.1 and the monitor stops cleanly on SIGINT.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for the results}"
mkdir -p "$OUT"
GPUMEM=${GPUMEM:-target/release/gpumem}
RESULTS="$OUT/diag_results.tsv"
: >"$RESULTS"
LOG="$OUT/diag.log"
: >"$LOG"

result() { # name status detail
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$RESULTS"
    printf '[%s] %s: %s\n' "$2" "$1" "$3" | tee -a "$LOG"
}
run_logged() { # name command...   (output to $OUT/name.log)
    local name=$1
    shift
    "$@" >"$OUT/$name.log" 2>&1
}

if [[ ! -x $GPUMEM ]]; then
    echo "missing $GPUMEM: run 'cargo build --release -p gpumem-cli' first" | tee -a "$LOG"
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.txt" 2>&1
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' >>"$LOG" 2>&1

# --- 1. Reference: a PyTorch snapshot and PyTorch's statistics at the same moment ----------
if run_logged diag_torch python3 scripts/device/diag_torch.py "$OUT"; then
    result "torch reference snapshot" ok "$(tail -1 "$OUT/diag_torch.log")"
else
    result "torch reference snapshot" FAIL "see diag_torch.log"
fi
REF="$OUT/torch_ref.pickle"

# --- 2. gpumem summary of PyTorch's snapshot vs torch.cuda.memory_stats() -------------------
if [[ -f $REF ]]; then
    "$GPUMEM" summary "$REF" >"$OUT/summary_torch_ref.txt" 2>&1
    if "$GPUMEM" summary --json --check "$REF" >"$OUT/summary_torch_ref.json" 2>>"$LOG"; then
        detail=$(python3 - "$OUT/summary_torch_ref.json" "$OUT/torch_stats.json" <<'EOF'
import json, sys
mine = json.load(open(sys.argv[1]))["flat"]
torch = json.load(open(sys.argv[2]))
exact = [k + ".all.current" for k in ("allocated_bytes", "reserved_bytes", "active_bytes",
         "requested_bytes", "segment", "allocation", "active", "inactive_split_bytes",
         "inactive_split")] + ["reserved_bytes.all.peak", "requested_bytes.all.peak",
         "allocation.all.allocated", "segment.all.allocated"]
bad = [f"{k}: gpumem {mine.get(k)} torch {torch.get(k)}" for k in exact if mine.get(k) != torch.get(k)]
est = mine["allocated_bytes.all.peak"] / max(1, torch["allocated_bytes.all.peak"]) - 1
print(("MISMATCH " + "; ".join(bad)) if bad else
      f"{len(exact)} figures equal to torch's; allocated peak (estimated) {100*est:+.3f}%")
EOF
)
        [[ $detail == MISMATCH* ]] && st=FAIL || st=ok
        result "summary of torch snapshot = memory_stats()" "$st" "$detail"
    else
        result "summary of torch snapshot = memory_stats()" FAIL "gpumem summary --check failed (diag.log)"
    fi
fi

# --- 3. Snapshots written by gpumem, read by PyTorch's tools --------------------------------
for variant in native stitched native-frames; do
    policy=${variant%-frames}
    conf=""
    [[ $variant == *-frames ]] && conf="backtraces:1"
    snap="$OUT/gpumem_$variant.pickle"
    if [[ ! -f $REF ]] || ! "$GPUMEM" replay "$REF" -p "$policy" --conf "$conf" --snapshot "$snap" \
        >"$OUT/replay_$variant.log" 2>&1; then
        result "gpumem snapshot ($variant)" FAIL "replay --snapshot failed (replay_$variant.log)"
        continue
    fi
    failed=""
    for cmd in trace_plot segment_plot; do
        python3 -m torch.cuda._memory_viz "$cmd" "$snap" -o "$OUT/viz_${variant}_$cmd.html" \
            >>"$OUT/viz_$variant.log" 2>&1 && [[ -s "$OUT/viz_${variant}_$cmd.html" ]] || failed+=" $cmd"
    done
    python3 -m torch.cuda._memory_viz stats "$snap" >"$OUT/viz_${variant}_stats.txt" 2>&1 \
        && grep -q total_reserved "$OUT/viz_${variant}_stats.txt" || failed+=" stats"
    python3 -m torch.cuda._memory_viz trace "$snap" >"$OUT/viz_${variant}_trace.txt" 2>&1 || failed+=" trace"
    python3 scripts/check_snapshot.py "$snap" --reference "$REF" --torch-tools \
        >"$OUT/check_$variant.log" 2>&1 || failed+=" check_snapshot"
    "$GPUMEM" summary --check "$snap" >"$OUT/summary_$variant.txt" 2>&1 || failed+=" summary--check"
    if [[ -z $failed ]]; then
        result "gpumem snapshot ($variant) in torch _memory_viz" ok \
            "trace_plot segment_plot stats trace; $(grep -h '^ok   keys' "$OUT/check_$variant.log" | cut -c6-60)"
    else
        result "gpumem snapshot ($variant) in torch _memory_viz" FAIL "failed:$failed (logs in \$OUT)"
    fi
done

# --- 4. gpumem monitor against a process that leaks on purpose -----------------------------
python3 scripts/leaky.py --mode leak --rate-mib 128 --seconds 45 >"$OUT/leaky_leak.log" 2>&1 &
LEAK_PID=$!
python3 scripts/leaky.py --mode step --step-gib 4 --step-at 8 --seconds 45 >"$OUT/leaky_step.log" 2>&1 &
STEP_PID=$!
sleep 4 # CUDA contexts up
"$GPUMEM" monitor --json --count 20 --window 10s >"$OUT/monitor.jsonl" 2>"$OUT/monitor.err"
mon_rc=$?
detail=$(python3 - "$OUT/monitor.jsonl" "$LEAK_PID" "$STEP_PID" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
leak, step = int(sys.argv[2]), int(sys.argv[3])
samples = [l for l in lines if l["type"] == "sample"]
end = [l for l in lines if l["type"] == "end"]
raised = end[0]["alarms_raised"] if end else []
pids = {a["pid"] for a in raised}
seen = {p["pid"] for s in samples for g in s["gpus"] for p in g["processes"]}
first = next((s["sample"] for s in samples for a in s["alarms"] if a.get("pid") == leak and a["new"]), None)
rate = next((a["rate_bytes_per_s"] for a in raised if a.get("pid") == leak), 0) / 2**20
ok = len(samples) == 20 and leak in pids and step not in pids
why = (f"{len(samples)} samples; alarm for leaky pid {leak} at sample {first} ({rate:.0f} MiB/s); "
       f"alarms for pids {sorted(p for p in pids if p is not None)}; step pid {step} "
       f"{'alarmed' if step in pids else 'quiet'}; pids visible {sorted(seen)}")
if leak not in seen:
    why += " (NVML shows no process of this container: per-process alarms impossible here)"
print(("ok " if ok else "FAIL ") + why)
EOF
)
[[ $mon_rc -eq 0 ]] || detail="FAIL monitor exited $mon_rc: $(tail -2 "$OUT/monitor.err")"
result "monitor alarm names the leaking pid" "${detail%% *}" "${detail#* }"

# Prometheus endpoint (on a free loopback port) and a clean stop on SIGINT.
"$GPUMEM" monitor --quiet --prometheus 127.0.0.1:0 >"$OUT/monitor_prom.out" 2>"$OUT/monitor_prom.err" &
MON_PID=$!
sleep 3
addr=$(grep -o 'http://[0-9.:]*/metrics' "$OUT/monitor_prom.err" | head -1)
python3 - "$addr" >"$OUT/metrics.txt" 2>&1 <<'EOF2'
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
EOF2
prom_rc=exited
if kill -0 "$MON_PID" 2>/dev/null; then
    kill -INT "$MON_PID"
    for _ in $(seq 50); do kill -0 "$MON_PID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$MON_PID" 2>/dev/null; then
        kill "$MON_PID"
        prom_rc=stuck
    else
        wait "$MON_PID"
        prom_rc=$?
    fi
fi
if grep -q '^gpumem_gpu_memory_total_bytes{' "$OUT/metrics.txt" && [[ $prom_rc == 0 ]] \
    && grep -q interrupted "$OUT/monitor_prom.err"; then
    result "prometheus endpoint + clean SIGINT" ok \
        "$(grep -c '^gpumem_' "$OUT/metrics.txt") samples served; exit 0 on SIGINT"
else
    result "prometheus endpoint + clean SIGINT" FAIL "exit $prom_rc; see metrics.txt, monitor_prom.err"
fi
kill "$LEAK_PID" "$STEP_PID" 2>/dev/null
wait "$LEAK_PID" "$STEP_PID" 2>/dev/null

# --- 5. The NVML test that needs a GPU (if its binary was carried) --------------------------
bin=$(ls target/release/deps/gpumem_monitor-* 2>/dev/null | grep -v '\.d$' | head -1)
if [[ -n $bin ]]; then
    if "$bin" --ignored >"$OUT/nvml_test.log" 2>&1; then
        result "NVML test (ignored without GPU)" ok "$(grep 'test result' "$OUT/nvml_test.log")"
    else
        result "NVML test (ignored without GPU)" FAIL "see nvml_test.log"
    fi
fi

echo
echo "== diag summary =="
column -t -s $'\t' "$RESULTS" 2>/dev/null || cat "$RESULTS"
! grep -q $'\tFAIL\t' "$RESULTS"
