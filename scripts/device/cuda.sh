#!/usr/bin/env bash
# gpumem's CUDA work on the GPU machine, in one go: the GPU tests (plainly and under
# compute-sanitizer memcheck), `gpumem replay --device cuda` on the five anchor traces, `gpumem
# bench alloc`, and PyTorch's caching allocator on the same benchmark. Full logs go under $OUT;
# a short summary is printed last.
#
# Before (on the development machine, which has Rust; the GPU machine has none):
#     bash scripts/device/cuda.sh build
# which runs `cargo build --release -p gpumem-cli` and
# `cargo test --release -p gpumem-cuda --test gpu --no-run`, and copies the test binary to
# target/release/gpumem-cuda-gpu-tests. Carry target/release/gpumem and
# target/release/gpumem-cuda-gpu-tests (about 30 MB together); copy shared/traces/*.pickle.gz
# into .device/traces/.
#
# On the GPU machine, from the repository root:
#     OUT=/some/folder bash scripts/device/cuda.sh
# It needs: one CUDA GPU with driver ≥ 12.x, compute-sanitizer on PATH (or under
# /usr/local/cuda/bin), python3 with PyTorch (CUDA), a C++ compiler and ninja for the PyTorch
# extension. About 3–4 minutes on an H200. Its last stages run the bench on the simulated device
# too, so that the summary sets the CUDA runs beside the policies' own cost on the same host,
# and read the host's state (its clock, and whether another thread shares the core) beside
# single-thread runs (`scripts/device/clock_states.sh`).
#
# A good result: the tests pass both times and memcheck reports "ERROR SUMMARY: 0 errors"; every
# replay ends with "not returned" 0, physical (cuMemGetInfo) within a few percent of gpumem's
# accounting, and GPU peaks close to the simulated ones; the bench table has a figure in every
# cell and the target lines say which policies meet ≤ 40 / ≤ 100 ns and the multi-thread target.
set -uo pipefail
cd "$(dirname "$0")/../.."

BIN=target/release/gpumem
TESTS=target/release/gpumem-cuda-gpu-tests

if [[ "${1:-}" == "build" ]]; then
    set -e
    cargo build --release -p gpumem-cli
    exe=$(cargo test --release -p gpumem-cuda --test gpu --no-run --message-format=json \
        | python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
    [[ -n "$exe" ]] || { echo "cuda.sh: the GPU test binary was not built" >&2; exit 1; }
    cp "$exe" "$TESTS"
    ls -la "$BIN" "$TESTS"
    echo "built: carry $BIN and $TESTS"
    exit 0
fi

OUT=${OUT:-$PWD/out/cuda}
mkdir -p "$OUT"
STAGES="$OUT/stages.tsv"
: > "$STAGES"

for f in "$BIN" "$TESTS"; do
    [[ -x "$f" ]] || { echo "cuda.sh: $f is missing: run 'bash scripts/device/cuda.sh build' first" >&2; exit 2; }
done
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)

# stage NAME LOG COMMAND...: runs COMMAND with stdout+stderr in LOG, records rc and seconds.
stage() {
    local name=$1 logf=$2
    shift 2
    echo "== $name" >&2
    local t0=$SECONDS
    "$@" > "$logf" 2>&1
    local rc=$?
    printf '%s\t%d\t%d\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$logf" >> "$STAGES"
    return 0
}

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u; } > "$OUT/machine.txt" 2>&1

# 1. The GPU tests, then the same binary under memcheck.
stage "gpu tests" "$OUT/gpu_tests.log" "$TESTS" --ignored --test-threads=1
if [[ -n "$SANITIZER" ]]; then
    stage "gpu tests under memcheck" "$OUT/gpu_tests_memcheck.log" \
        "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 100 \
        "$TESTS" --ignored --test-threads=1
else
    echo "compute-sanitizer not found" > "$OUT/gpu_tests_memcheck.log"
    printf 'gpu tests under memcheck\t127\t0\t%s\n' "$OUT/gpu_tests_memcheck.log" >> "$STAGES"
fi

# 2. Replays of the anchor traces on the GPU, every policy.
shopt -s nullglob
traces=(.device/traces/*.pickle.gz .device/traces/*.pickle .device/traces/*.gmt*)
[[ ${#traces[@]} -gt 0 ]] || echo "cuda.sh: no traces in .device/traces/" >&2
for t in "${traces[@]}"; do
    name=$(basename "$t"); name=${name%%.*}
    stage "replay $name" "$OUT/replay_$name.log" \
        bash -c "'$BIN' replay '$t' --device cuda --json > '$OUT/replay_$name.jsonl'"
done

# 3. gpumem bench alloc (table in the log, JSON lines for the PyTorch script), then PyTorch's
#    caching allocator on the same sequences, side by side.
stage "bench alloc" "$OUT/bench_gpumem.log" "$BIN" bench alloc --json-out "$OUT/bench_gpumem.jsonl"
stage "bench torch" "$OUT/bench_torch.log" \
    python3 scripts/bench_torch_alloc.py --gpumem-json "$OUT/bench_gpumem.jsonl" --out "$OUT"

# 3b. The same policies on the simulated device, on this host: what the policy's own bookkeeping
#     costs here, beside what the CUDA backend's runs above read (no driver call is made in
#     either's timed runs once warm). `slack:0.1` as the CUDA runs reach it: on the GPU the remap
#     budget raises stitched's spare pages during the warm-up; the simulated driver is too fast
#     to trip it, and stitched would remap in every timed run instead. It runs after the CUDA
#     stages, not interleaved with them, so a host that changes speed in between shows in the
#     ratio (session 43: 0.62-0.87x, where interleaved rounds read the two alike). For a
#     question about the backend's cost, alternate the two in rounds (BENCHMARKS.md §4,
#     session 43).
stage "bench alloc sim" "$OUT/bench_sim.log" "$BIN" bench alloc --sim --threads 1 --conf slack:0.1 \
    -p caching -p buddy -p stitched --case same_1MiB --case random_512B_64MiB_live500 \
    --case random_512B_1MiB_live2000 --json-out "$OUT/bench_sim.jsonl"

# 3c. The host's state while it runs single-thread code: each run's time beside the core's
#     clock, its adds per cycle and the share of the run spent on a CPU (a lower clock, time
#     taken by other processes or the hypervisor, a core shared with another thread, or
#     none of these), pinned, in rounds (scripts/device/clock_states.sh; BENCHMARKS.md §4,
#     session 50).
stage "host state" "$OUT/clock_states.log" \
    env OUT="$OUT/clock_states" BIN="$BIN" ROUNDS=8 bash scripts/device/clock_states.sh

# 4. Summary.
python3 - "$OUT" <<'EOF'
import glob, json, os, re, sys
out = sys.argv[1]
print("\n================ gpumem CUDA summary ================")
print(open(os.path.join(out, "machine.txt")).read().strip())
print("\nstage                               rc   seconds")
for line in open(os.path.join(out, "stages.tsv")):
    name, rc, secs, _ = line.rstrip("\n").split("\t")
    print(f"{name:<34} {rc:>3} {secs:>9}")

def tail(path, pattern):
    try:
        return [l.rstrip() for l in open(path, errors="replace") if re.search(pattern, l)]
    except OSError:
        return ["(no log)"]

print("\nGPU tests:")
for l in tail(os.path.join(out, "gpu_tests.log"), r"^test result|FAILED|panicked"):
    print("  " + l)
print("under memcheck:")
for l in tail(os.path.join(out, "gpu_tests_memcheck.log"), r"^test result|ERROR SUMMARY|FAILED|Error|not found"):
    print("  " + l[:200])

print("\nreplay on the GPU (peaks in GiB; physical = cuMemGetInfo):")
print(f"  {'trace':<16}{'policy':<12}{'live':>8}{'sim':>8}{'gpu':>8}{'phys':>8}{'gpu/sim':>9}"
      f"{'phys/gpu':>9}{'phys/live':>10}{'ooms':>6}{'left':>8}{'wall s':>8}")
G = 1 << 30
for f in sorted(glob.glob(os.path.join(out, "replay_*.jsonl"))):
    trace = os.path.basename(f)[len("replay_"):-len(".jsonl")]
    rows = [json.loads(l) for l in open(f) if l.strip()]
    if not rows:
        print(f"  {trace:<16}(no result: see replay_{trace}.log)")
    for r in rows:
        print(f"  {trace:<16}{r['policy']:<12}{r['peak_live_bytes']/G:>8.2f}{r['sim_peak_held_bytes']/G:>8.2f}"
              f"{r['gpu_peak_held_bytes']/G:>8.2f}{r['physical_peak_bytes']/G:>8.2f}"
              f"{100*r['gpu_vs_sim']:>+8.2f}%{100*r['physical_vs_gpu']:>+8.2f}%{r['physical_ratio']:>10.4f}"
              f"{r['ooms']:>6}{r['not_returned_bytes']/(1<<20):>6.0f}Mi{r['gpu_seconds']:>8.1f}")

print("\ngpumem bench alloc targets:")
for l in tail(os.path.join(out, "bench_gpumem.log"), r"^targets|^  gpumem:"):
    print("  " + l.strip())
print("\nsame host, CUDA backend against the simulated device (ns per op, one thread; run one after\n"
      "the other, so the ratio also carries any change of the host's speed between them):")
def ns_by_case(name):
    try:
        return {(m["case"], m["allocator"]): m["ns_per_op"]
                for m in map(json.loads, open(os.path.join(out, name))) if m["threads"] == 1}
    except (OSError, ValueError):
        return {}
cuda, sim = ns_by_case("bench_gpumem.jsonl"), ns_by_case("bench_sim.jsonl")
print(f"  {'case':<28}{'allocator':<18}{'cuda':>9}{'sim':>9}{'ratio':>8}")
for key in sorted(sim):
    if key in cuda:
        print(f"  {key[0]:<28}{key[1]:<18}{cuda[key]:>9.1f}{sim[key]:>9.1f}{cuda[key] / sim[key]:>7.2f}x")
print("\nhost state, simulated device pinned (scripts/device/clock_states.sh, 8 rounds):")
state = tail(os.path.join(out, "clock_states.log"), r".")
at = next((i for i, l in enumerate(state) if l.startswith("policy ")), None)
for l in state[at:] if at is not None else state[-12:]:
    print("  " + l)
print("\nall allocators, one run (ns per op):")
try:
    text = open(os.path.join(out, "bench_torch.log"), errors="replace").read()
    start = text.find("allocation latency")
    print(text[start:] if start >= 0 else text[-3000:])
except OSError:
    print("(no bench_torch.log)")
EOF
