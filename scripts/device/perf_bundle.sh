#!/usr/bin/env bash
# Packs the development machine's `perf`, with every library it loads and its own loader, into
# .device/perf/ (about 33 MB; .device/ is ignored by git), so that it runs on the GPU machine,
# which has no `perf`:
#     bash scripts/device/perf_bundle.sh                 # here, once
#     bash .device/perf/run.sh stat -e task-clock -- CMD # there (carry .device)
#
# What works there (session 49, an H100 host): software events (task-clock, page-faults,
# context-switches, cpu-migrations) and sampling on `cpu-clock` (`record -e cpu-clock`, then
# `report --stdio`). The virtual machine exposes no hardware counters: cycles, instructions,
# cache and branch misses read "not supported", as on dev. For instruction counts use
# scripts/instr_alloc.sh on dev (valgrind), which are the same on every x86-64 host.
set -euo pipefail
cd "$(dirname "$0")/../.."
PERF=$(command -v perf) || { echo "perf_bundle.sh: no perf on this machine" >&2; exit 2; }
DEST=.device/perf
rm -rf "$DEST"
mkdir -p "$DEST"
cp "$PERF" "$DEST/perf"
# Every shared library `ldd` resolves, and the loader (the line without "=>").
ldd "$PERF" | awk '/=> \// {print $3} /ld-linux/ && !/=>/ {print $1}' | while read -r lib; do
    cp -L "$lib" "$DEST/"
done
[[ -e "$DEST/ld-linux-x86-64.so.2" ]] || { echo "perf_bundle.sh: the loader was not found" >&2; exit 1; }
cat > "$DEST/run.sh" <<'RUN'
#!/bin/bash
# perf carried from the development machine with its libraries (the GPU hosts have none):
#   bash .device/perf/run.sh stat -e task-clock -- CMD...
d=$(cd "$(dirname "$0")" && pwd)
exec "$d/ld-linux-x86-64.so.2" --library-path "$d" "$d/perf" "$@"
RUN
chmod +x "$DEST/run.sh"
du -sh "$DEST"
# The bundle must run here through its own loader before it is worth carrying.
bash "$DEST/run.sh" --version
