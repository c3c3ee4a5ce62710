#!/usr/bin/env bash
# Runs several device scripts in one GPU call and packs their logs into one archive (the device
# tool brings back at most 8 files). Usage: OUT=... bash scripts/device/batch.sh cuda probe ...
# Each script runs with its own OUT folder; its summary (the end of its output) is printed.
set -uo pipefail
cd "$(dirname "$0")/../.."
FINAL=${OUT:-out}
WORK=$(mktemp -d)
mkdir -p "$FINAL"
for s in "$@"; do
    mkdir -p "$WORK/$s"
    start=$(date +%s)
    OUT="$WORK/$s" timeout "${BATCH_TIMEOUT:-540}" bash "scripts/device/$s.sh" > "$WORK/$s/console.log" 2>&1
    rc=$?
    echo "=== $s: rc=$rc in $(( $(date +%s) - start ))s"
    tail -n "${TAIL:-45}" "$WORK/$s/console.log"
done
tar czf "$FINAL/logs.tgz" -C "$WORK" .
ls -la "$FINAL"
