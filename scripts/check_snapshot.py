#!/usr/bin/env python3
"""Checks that a memory snapshot has the shape of torch.cuda.memory._snapshot().

    python3 scripts/check_snapshot.py SNAPSHOT [--reference TORCH_SNAPSHOT] [--torch-tools]

SNAPSHOT (plain or gzipped pickle) is loaded with the standard pickle module only. Checked:
the top-level keys; every segment, block, frame and history entry has PyTorch's keys with
values of PyTorch's types; block states and actions are PyTorch's names; blocks tile their
segment; the segment's allocated/active/requested sizes add up. With --reference, the key
sets are also compared with those of a snapshot that PyTorch wrote. With --torch-tools,
torch.cuda._memory_viz's own functions (stats, trace, segment and trace plots) are run on it.
Prints one line per check and exits non-zero on the first failure.
"""

import argparse
import gzip
import pickle
import sys

SEGMENT_KEYS = {
    "device": int,
    "address": int,
    "total_size": int,
    "allocated_size": int,
    "active_size": int,
    "requested_size": int,
    "stream": int,
    "segment_type": str,
    "segment_pool_id": tuple,
    "is_expandable": bool,
    "frames": list,
    "blocks": list,
}
BLOCK_KEYS = {
    "address": int,
    "size": int,
    "requested_size": int,
    "state": str,
    "frames": list,
}
FRAME_KEYS = {"filename": str, "line": int, "name": str}
ENTRY_KEYS = {"action": str, "size": int, "stream": int, "time_us": int}
# Keys PyTorch adds to entries in some versions or settings only.
ENTRY_OPTIONAL = {"frames": list, "compile_context": str, "user_metadata": str}
STATES = {"active_allocated", "active_pending_free", "inactive"}
ACTIONS = {
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
}


def load(path):
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        return pickle.load(f)


class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)


def check_fields(obj, keys, where, optional=None, exact=False):
    expect(isinstance(obj, dict), f"{where}: not a dict but {type(obj).__name__}")
    optional = optional or {}
    if exact:
        extra = set(obj) - set(keys) - set(optional)
        expect(not extra, f"{where}: keys PyTorch does not write: {sorted(extra)}")
    for k, t in keys.items():
        expect(k in obj, f"{where}: no key {k!r} (has {sorted(obj)})")
        v = obj[k]
        # bool is a subclass of int: an int field must not hold a bool, and vice versa.
        ok = isinstance(v, t) and (t is bool or not isinstance(v, bool))
        expect(ok, f"{where}: {k!r} is {type(v).__name__}, PyTorch writes {t.__name__}")
    for k, t in optional.items():
        if k in obj:
            expect(isinstance(obj[k], t), f"{where}: {k!r} is {type(obj[k]).__name__}")


def check_frames(frames, where, exact=False):
    for i, fr in enumerate(frames):
        check_fields(fr, FRAME_KEYS, f"{where} frame {i}", exact=exact)


TOP_KEYS = ("segments", "device_traces", "allocator_settings", "external_annotations")


def check(data, exact=False):
    """Raises Failed at the first departure from PyTorch's shape. `exact`: no key beyond
    PyTorch's either (for snapshots gpumem writes, whose entries carry no optional key but
    frames); without it, keys are compared with a reference snapshot instead (--reference)."""
    expect(isinstance(data, dict), "the snapshot is not a dict")
    for k in TOP_KEYS:
        expect(k in data, f"no top-level key {k!r}")
    if exact:
        expect(set(data) == set(TOP_KEYS), f"top-level keys {sorted(data)}")
    expect(isinstance(data["segments"], list), "segments is not a list")
    expect(isinstance(data["device_traces"], list), "device_traces is not a list")
    expect(isinstance(data["allocator_settings"], dict), "allocator_settings is not a dict")
    expect(isinstance(data["external_annotations"], list), "external_annotations is not a list")
    nblocks = 0
    for i, s in enumerate(data["segments"]):
        where = f"segment {i}"
        check_fields(s, SEGMENT_KEYS, where, exact=exact)
        expect(s["segment_type"] in ("small", "large"), f"{where}: segment_type {s['segment_type']!r}")
        addr = s["address"]
        alloc = active = req = 0
        for j, b in enumerate(s["blocks"]):
            bw = f"{where} block {j}"
            check_fields(b, BLOCK_KEYS, bw, exact=exact)
            expect(b["state"] in STATES, f"{bw}: state {b['state']!r}")
            expect(b["address"] == addr, f"{bw}: at {b['address']:#x}, expected {addr:#x}")
            expect(b["size"] > 0, f"{bw}: empty block")
            check_frames(b["frames"], bw, exact)
            addr += b["size"]
            if b["state"] == "active_allocated":
                alloc += b["size"]
            if b["state"] != "inactive":
                active += b["size"]
                req += b["requested_size"]
                expect(b["requested_size"] <= b["size"], f"{bw}: requested more than its size")
            nblocks += 1
        expect(addr == s["address"] + s["total_size"], f"{where}: blocks do not tile it")
        expect(s["allocated_size"] == alloc, f"{where}: allocated_size {s['allocated_size']} != {alloc}")
        expect(s["active_size"] == active, f"{where}: active_size {s['active_size']} != {active}")
        expect(s["requested_size"] == req, f"{where}: requested_size {s['requested_size']} != {req}")
    nentries = 0
    entry_optional = {"frames": list} if exact else ENTRY_OPTIONAL
    for d, entries in enumerate(data["device_traces"]):
        expect(isinstance(entries, list), f"device_traces[{d}] is not a list")
        for i, e in enumerate(entries):
            where = f"device {d} entry {i}"
            keys = dict(ENTRY_KEYS)
            keys["device_free" if e.get("action") == "oom" else "addr"] = int
            check_fields(e, keys, where, entry_optional, exact)
            expect(e["action"] in ACTIONS, f"{where}: action {e['action']!r}")
            if "frames" in e:
                check_frames(e["frames"], where, exact)
            nentries += 1
    return nblocks, nentries


def key_sets(data):
    """Key sets of the first segment, block, frame and history entry of each action."""
    out = {}
    for s in data["segments"]:
        out.setdefault("segment", set(s))
        for b in s["blocks"]:
            out.setdefault("block", set(b))
            for fr in b["frames"]:
                out.setdefault("frame", set(fr))
    for entries in data["device_traces"]:
        for e in entries:
            out.setdefault("entry:" + e["action"], set(e) - set(ENTRY_OPTIONAL))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("snapshot")
    p.add_argument("--reference", help="a snapshot written by PyTorch, to compare key sets with")
    p.add_argument("--torch-tools", action="store_true", help="run torch.cuda._memory_viz on it")
    a = p.parse_args()
    try:
        data = load(a.snapshot)
        nblocks, nentries = check(data)
        print(f"ok   shape: {len(data['segments'])} segments, {nblocks} blocks, {nentries} history entries")
        if a.reference:
            ref = load(a.reference)
            check(ref)
            mine, theirs = key_sets(data), key_sets(ref)
            compared = 0
            for kind in sorted(set(mine) & set(theirs)):
                expect(
                    mine[kind] == theirs[kind],
                    f"{kind}: keys {sorted(mine[kind])} but PyTorch's have {sorted(theirs[kind])}",
                )
                compared += 1
            expect(compared > 0, "nothing in common with the reference to compare")
            print(f"ok   keys: {compared} kinds of record have PyTorch's key sets ({', '.join(sorted(set(mine) & set(theirs)))})")
        if a.torch_tools:
            from torch.cuda import _memory_viz as mv

            text = mv.segsum(data)
            expect("total_reserved" in text, "segsum printed no totals")
            print("ok   torch.cuda._memory_viz stats (segsum)")
            mv.trace(data)
            print("ok   torch.cuda._memory_viz trace")
            for name, fn in (("trace_plot", mv.trace_plot), ("segment_plot", mv.segment_plot)):
                html = fn(data)
                expect("snapshot.pickle" in html, f"{name} produced no page")
                print(f"ok   torch.cuda._memory_viz {name}: {len(html)} bytes of HTML")
    except Failed as e:
        print(f"FAIL {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
