#!/usr/bin/env bash
# Records allocation traces on the GPU machine with scripts/record_trace.py: the trace bundled
# in traces/ (the README's first command replays it) and validation traces of other kinds.
# Needs: PyTorch with CUDA. Optional: target/release/gpumem (carried) for a replay check.
# Writes the traces and logs to $OUT.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
{
  nvidia-smi
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda)"
  for t in compute-sanitizer ncu nvcc; do printf '%s: ' "$t"; command -v "$t" || echo missing; done
} > "$OUT/env.txt" 2>&1
# WORKLOADS (name:steps, space-separated) picks what to record; the default is the bundled
# trace and the first validation set.
for w in ${WORKLOADS:-gpt_varlen:12 encdec:10 checkpointed:8 mlp:8}; do
  name=${w%%:*}; steps=${w##*:}
  python3 scripts/record_trace.py --workload "$name" --steps "$steps" --out "$OUT/$name.pickle.gz" 2>> "$OUT/record.log" \
    || echo "FAILED: $name" | tee -a "$OUT/record.log"
done
if [ -x target/release/gpumem ]; then
  for f in "$OUT"/*.pickle.gz; do target/release/gpumem replay "$f"; done > "$OUT/replay.txt" 2>&1
  tail -n 60 "$OUT/replay.txt"
fi
tail -n 5 "$OUT/record.log"
ls -la "$OUT"
