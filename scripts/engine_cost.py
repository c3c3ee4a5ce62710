#!/usr/bin/env python3
"""The engine's inclusive cost per allocation in a replay under callgrind, read from
`callgrind_annotate --inclusive=yes` on stdin: `Allocator::place`, the frees (the replay's
`free_one`, which calls `free_allocation`, or `free_on` when the replay frees by address) and
`PagePool::claim_slow` (mapping pages while the pool grows), each divided by the trace's
allocations. Exits with an error if the place or the free is not in the annotation. Shared by
scripts/instr_replay.sh and scripts/cold_replay.sh, which print it their own way.

    callgrind_annotate ... | python3 scripts/engine_cost.py ALLOCS EVENTS

EVENTS: how many event columns the annotation shows (its --show list). Prints one JSON
object: {"place": [...], "free": [...], "claim_slow": [...]}, a value per event.
"""
import json
import re
import sys

WANTED = {"engine::Allocator::place": "place", "replay::free_one": "free",
          "PagePool::claim_slow": "claim_slow"}
# Must be found: a replay always places and frees (claim_slow may never run).
REQUIRED = ("place", "free")


def engine_costs(lines, allocs, events):
    """Per allocation, each wanted function's inclusive counts (the largest line naming it:
    callgrind_annotate also lists callers' and inlined lines)."""
    num = r"([\d,]+)\s+(?:\([^)]*\)\s+)?"
    pattern = re.compile(r"\s*" + num * events + r"(\S+) \[")
    found = {}
    for line in lines:
        m = pattern.match(line)
        if not m:
            continue
        v = [int(m.group(i).replace(",", "")) for i in range(1, events + 1)]
        for name, key in WANTED.items():
            if m.group(events + 1).endswith(name) and v[0] > found.get(key, [0])[0]:
                found[key] = v
    missing = [k for k in REQUIRED if k not in found]
    if missing:
        # A renamed or inlined function would otherwise read as a cost of 0.
        sys.exit(f"engine_cost.py: no line names {missing} in the annotation "
                 f"(looked for {sorted(WANTED)})")
    return {k: [x / allocs for x in found.get(k, [0] * events)] for k in WANTED.values()}


if __name__ == "__main__":
    print(json.dumps(engine_costs(sys.stdin, int(sys.argv[1]), int(sys.argv[2]))))
