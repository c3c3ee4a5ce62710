"""Diagnostics of gpumem.Allocator on the simulated device (no PyTorch, no GPU): the memory
summary, JSON statistics, snapshots with their history, leak reports, the leak check at exit
and gpumem.testing.assert_no_leaks."""

import gzip
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import gpumem
import gpumem.testing
from conftest import (
    GIB,
    MIB,
    OVERSIZE_ROWS,
    SUMMARY_ROWS,
    TORCH_STAT_KEYS,
    check_snapshot_shape,
    check_summary_against_stats,
    live_blocks,
    parse_summary,
)

HERE = os.path.basename(__file__)

def sim(conf="policy:native", memory=GIB):
    return gpumem.Allocator(conf=conf, device="sim", sim_memory=memory)


def test_summary_has_torchs_rows_and_the_exact_figures():
    a = sim()
    big = a.allocate(100 * MIB)
    other = a.allocate(60 * MIB)
    small = a.allocate(1000)
    a.free(other)
    text = a.memory_summary()
    for label, _ in SUMMARY_ROWS:
        assert f"| {label:<21} |" in text, label
    for label in OVERSIZE_ROWS:
        assert label in text
    assert "| Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |" in text
    assert "gpumem memory summary, device sim (policy native)" in text
    assert text.count("from large pool") == len(SUMMARY_ROWS)
    rows = parse_summary(text)
    # 100 MiB live, 160 MiB (+1 KiB) at the peak, 60 MiB freed; PyTorch's units: a column
    # is in KiB while its "all" value is under 768 MiB.
    assert rows[("Allocated memory", "large")] == [(102400, "KiB"), (163840, "KiB"), (163840, "KiB"), (61440, "KiB")]
    assert rows[("Requested memory", "small")][0] == (0, "KiB"), "1000 bytes: 0 whole KiB"
    assert rows[("Allocations", "all")] == [(2, ""), (3, ""), (3, ""), (1, "")]
    assert rows[("GPU reserved memory", "all")][0] == (163840 + 2048, "KiB"), "cached 60 MiB + 2 MiB small"
    assert rows[("GPU reserved segments", "all")] == [(3, ""), (3, ""), (3, ""), (0, "")]
    check_summary_against_stats(text, a.memory_stats())
    a.free(big)
    a.free(small)
    check_summary_against_stats(a.memory_summary(), a.memory_stats())


def test_abbreviated_summary_keeps_the_all_rows():
    a = sim(conf=None)
    ptrs = [a.allocate(n) for n in (800 * MIB, 300 * 1024, 12345)]
    short = a.memory_summary(abbreviated=True)
    assert "from large pool" not in short and "from small pool" not in short
    check_summary_against_stats(short, a.memory_stats(), abbreviated=True)
    rows = parse_summary(short)
    assert rows[("Allocated memory", "all")][0][1] == "MiB", "800 MiB: at least 768 MiB reads in MiB"
    assert rows[("Allocations", "all")][0] == (3, "")
    for p in ptrs:
        a.free(p)


def test_stats_json_has_nested_and_flat_statistics():
    a = sim()
    p = a.allocate(3 * MIB)
    data = json.loads(a.memory_stats_json())
    stats = a.memory_stats()
    assert data["flat"] == dict(stats)
    assert set(data["flat"]) == TORCH_STAT_KEYS
    assert data["stats"]["allocated_bytes"]["all"]["current"] == stats["allocated_bytes.all.current"] == 3 * MIB
    assert data["stats"]["reserved_bytes"]["large_pool"]["peak"] == 20 * MIB
    a.free(p)


def test_snapshot_has_torchs_shape_and_the_allocated_blocks():
    a = sim()
    p = a.allocate(5 * MIB)
    q = a.allocate(1000)
    r = a.allocate(2 * MIB)
    a.free(r)
    snap = a.snapshot()
    check_snapshot_shape(snap)
    assert live_blocks(snap) == {p: (5 * MIB, 5 * MIB, "large"), q: (1024, 1000, "small")}
    sizes = sorted((s["segment_type"], s["total_size"]) for s in snap["segments"])
    assert sizes == [("large", 20 * MIB), ("small", 2 * MIB)], "native: a 20 MiB and a 2 MiB segment"
    assert sum(s["total_size"] for s in snap["segments"]) == a.memory_stats()["reserved_bytes.all.current"]
    assert snap["device_traces"] == [[]], "no history unless asked for"
    assert snap["allocator_settings"]["gpumem_policy"] == "native"
    assert a.segments() == snap["segments"]
    assert pickle.loads(pickle.dumps(snap)) == snap
    a.free(p)
    a.free(q)
    assert live_blocks(a.snapshot()) == {}


def test_snapshot_of_the_default_policy_shows_mapped_ranges():
    a = sim(conf="policy:stitched")
    ptrs = {a.allocate(n): n for n in (3 * MIB, 7 * MIB + 5, 4000)}
    snap = a.snapshot()
    check_snapshot_shape(snap)
    blocks = live_blocks(snap)
    assert {p: blocks[p][1] for p in ptrs} == ptrs
    assert all(s["is_expandable"] for s in snap["segments"])
    assert snap["allocator_settings"]["expandable_segments"] is True
    for p in ptrs:
        a.free(p)


def test_history_records_allocations_frees_and_segments():
    a = sim(conf="policy:native,history:100")
    p = a.allocate(5 * MIB)
    a.free(p)
    q = a.allocate(1000)
    trace = a.snapshot()["device_traces"][0]
    got = [(e["action"], e["addr"], e["size"]) for e in trace]
    seg = got[0][1]
    assert got[:4] == [
        ("segment_alloc", seg, 20 * MIB),
        ("alloc", p, 5 * MIB),
        ("free_requested", p, 5 * MIB),
        ("free_completed", p, 5 * MIB),
    ]
    assert got[-1] == ("alloc", q, 1000)
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)
    assert all("frames" not in e for e in trace), "no stacks without backtraces:1"
    a.free(q)


def test_history_is_a_ring_buffer():
    a = sim(conf="policy:native,history:3")
    for _ in range(5):
        a.free(a.allocate(4096))
    last = a.allocate(4096)
    a.free(last)
    trace = a.snapshot()["device_traces"][0]
    assert [(e["action"], e["addr"]) for e in trace] == [
        ("alloc", last),
        ("free_requested", last),
        ("free_completed", last),
    ]


def allocate_weights(a, n):
    # A named Python caller, to find in the stacks.
    return a.allocate(n)


def test_stacks_show_the_python_caller():
    a = sim(conf="policy:native,history:100,backtraces:1")
    live = allocate_weights(a, 6 * MIB)
    freed = allocate_weights(a, 1000)
    a.free(freed)
    snap = a.snapshot()
    check_snapshot_shape(snap)
    block = next(b for s in snap["segments"] for b in s["blocks"] if b["address"] == live)
    names = [f["name"] for f in block["frames"]]
    assert "allocate_weights" in names and "test_stacks_show_the_python_caller" in names
    caller = block["frames"][names.index("allocate_weights")]
    assert caller["filename"].endswith(HERE) and caller["line"] > 0
    # The native frames of gpumem come first (innermost); the interpreter's are replaced by
    # the Python frames.
    assert "Allocator::allocate" in names[0]
    assert not any(n.startswith("_PyEval") for n in names), names
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert all(e["frames"] for e in allocs), "every allocation has its native stack"
    entry = next(e for e in allocs if e["addr"] == live)
    assert "allocate_weights" in [f["name"] for f in entry["frames"]]
    a.free(live)


@pytest.mark.parametrize("name", ["snap.pickle", "snap.pickle.gz"])
@pytest.mark.parametrize("conf", ["policy:native,history:50", "policy:native,history:50,backtraces:1"])
def test_dump_snapshot_writes_what_snapshot_returns(tmp_path, name, conf):
    a = sim(conf=conf)
    p = a.allocate(5 * MIB)
    a.free(a.allocate(MIB))
    path = tmp_path / name
    a.dump_snapshot(str(path))
    raw = path.read_bytes()
    if name.endswith(".gz"):
        assert raw[:2] == b"\x1f\x8b"
        raw = gzip.decompress(raw)
    assert pickle.loads(raw) == a.snapshot()
    with pytest.raises(gpumem.GpumemError, match="cannot write"):
        a.dump_snapshot(str(tmp_path / "missing" / "x.pickle"))
    a.free(p)


def leak_here(a, n):
    return a.allocate(n)


def test_leak_report_lists_the_leaked_allocation_with_its_size_and_caller():
    a = sim(conf="policy:stitched,leak_check:1,backtraces:1")
    leaked = leak_here(a, 12345)
    a.free(leak_here(a, 999))
    report = gpumem.leak_report(a)
    assert len(report) == 1 and report.total_bytes == 12345
    (entry,) = report.allocations
    assert (entry["addr"], entry["size"], entry["stream"]) == (leaked, 12345, 0)
    assert entry["age_s"] is not None and entry["age_s"] >= 0
    assert entry["site"].startswith("leak_here (") and HERE in entry["site"]
    assert [f["name"] for f in entry["frames"]][:2] == ["leak_here", "test_leak_report_lists_the_leaked_allocation_with_its_size_and_caller"]
    assert report.sites == [
        {"site": entry["site"], "count": 1, "bytes": 12345, "oldest_age_s": entry["age_s"], "streams": [0]}
    ]
    assert report.tracked and report.backtraces
    text = str(report)
    assert f"{leaked:#x}" in text and "12.06 KiB" in text and "leak_here (" in text
    assert json.loads(json.dumps(report.to_dict()))["total_bytes"] == 12345
    a.free(leaked)
    assert len(gpumem.leak_report(a)) == 0
    assert str(gpumem.leak_report(a)).strip() == "no live allocations"


def test_a_failed_free_keeps_the_call_site():
    a = sim(conf="policy:caching,leak_check:1,backtraces:1")
    p = leak_here(a, 4096)
    with pytest.raises(gpumem.InvalidPointerError):
        a.free(p + 512)
    (entry,) = gpumem.leak_report(a).allocations
    assert entry["addr"] == p and entry["site"].startswith("leak_here (")
    a.free(p)
    assert len(gpumem.leak_report(a)) == 0


def test_leak_report_without_tracking_still_lists_sizes_and_streams():
    a = sim(conf="policy:caching")
    p = a.allocate(7 * MIB, stream=0x42)
    report = gpumem.leak_report(a)
    assert not report.tracked
    assert [(x["addr"], x["size"], x["stream"], x["age_s"]) for x in report.allocations] == [(p, 7 * MIB, 0x42, None)]
    assert "GPUMEM_LEAK_CHECK=1" in str(report)
    a.free(p)


def test_assert_no_leaks_passes_when_clean_and_raises_with_the_report():
    a = sim(conf="policy:stitched,leak_check:1,backtraces:1")
    gpumem.testing.assert_no_leaks(a)
    p = a.allocate(2 * MIB)
    a.free(p)
    gpumem.testing.assert_no_leaks(a)
    kept = leak_here(a, 3 * MIB)
    with pytest.raises(AssertionError) as e:
        gpumem.testing.assert_no_leaks(a)
    msg = str(e.value)
    assert msg.startswith("gpumem: allocations leaked:")
    assert f"{kept:#x}" in msg and "3.00 MiB" in msg and "leak_here (" in msg
    a.free(kept)
    gpumem.testing.assert_no_leaks(a)
    with pytest.raises(TypeError):
        gpumem.leak_report(a, device=0)
    # A device index where the allocator goes: says which keyword was meant.
    with pytest.raises(TypeError, match="pass device=0"):
        gpumem.leak_report(0)
    with pytest.raises(TypeError, match="pass device=0"):
        gpumem.testing.assert_no_leaks(0)


def run_script(code, env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMEM_LEAK_CHECK", "GPUMEM_CONF")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


LEAKY_PROGRAM = """
import gpumem
from gpumem import _native

def load_weights(a):
    return a.allocate(7 * 2**20)

a = gpumem.Allocator(conf="policy:native", device="sim")
kept = load_weights(a)
a.free(a.allocate(2**20))
_native.torch_use_simulated_devices(1, 2**30, False)
t = _native.torch_alloc(5 * 2**20, 0, 0)
print(f"{kept:#x} {t:#x}")
"""


def test_leak_check_at_exit_prints_the_leaked_allocations():
    proc = run_script(LEAKY_PROGRAM, {"GPUMEM_LEAK_CHECK": "1"})
    assert proc.returncode == 0, proc.stderr
    kept, torch_ptr = proc.stdout.split()
    err = proc.stderr
    assert err.count("gpumem leak check: allocations still live at exit") == 2, err
    # The gpumem.Allocator, with its Python call site.
    assert 'gpumem: gpumem.Allocator(device="sim", policy="native"), made at <module> (<string>:' in err
    line = textwrap.dedent(LEAKY_PROGRAM).splitlines().index("    return a.allocate(7 * 2**20)") + 1
    assert kept in err and "7.00 MiB" in err and f"load_weights (<string>:{line})" in err
    # PyTorch's allocator of device 0 (driven here as the C hook would).
    assert "gpumem: PyTorch allocator of device 0" in err
    assert torch_ptr in err and "5.00 MiB" in err
    assert "1.00 MiB" not in err, "the freed allocation is not reported"


def test_no_report_at_exit_without_the_variable_or_when_everything_was_freed():
    proc = run_script(LEAKY_PROGRAM, {"GPUMEM_CONF": "leak_check:1,backtraces:1"})
    assert proc.returncode == 0, proc.stderr
    assert "gpumem leak check" not in proc.stderr, proc.stderr
    clean = run_script(
        """
import gpumem
a = gpumem.Allocator(device="sim")
a.free(a.allocate(4096))
""",
        {"GPUMEM_LEAK_CHECK": "1"},
    )
    assert clean.returncode == 0, clean.stderr
    assert "gpumem leak check: every allocation was freed" in clean.stderr
    assert "still live" not in clean.stderr


def test_a_bad_leak_check_variable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("GPUMEM_LEAK_CHECK", "maybe")
    with pytest.raises(ValueError, match="GPUMEM_LEAK_CHECK"):
        gpumem.Allocator(device="sim")


def test_record_memory_history_before_the_first_allocation(tmp_path):
    # A fresh process: the PyTorch allocators' history is fixed when they are created.
    path = tmp_path / "hist.pickle.gz"
    r = run_script(
        f"""
import gzip, json, pickle, warnings
import gpumem
from gpumem import _native
_native.torch_use_simulated_devices(1, 2**30, False)
gpumem.torch.record_memory_history(True, max_entries=1000, stacks=True)
_native.torch_configure("policy:native")   # what install() does: the request survives it
p = _native.torch_alloc(3 * 2**20, 0, 0)
_native.torch_free(p, 0, 0)
q = _native.torch_alloc(1000, 0, 0)
snap = gpumem.torch.snapshot(0)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    gpumem.torch.record_memory_history(None)
gpumem.torch.dump_snapshot({str(path)!r})
try:
    gpumem.torch.record_memory_history(True, max_entries=10)
    err = None
except gpumem.GpumemError as e:
    err = str(e)
print(json.dumps({{
    "p": p, "q": q,
    "trace": [(e["action"], e["addr"], e["size"], bool(e.get("frames"))) for e in snap["device_traces"][0]],
    "warnings": [str(x.message) for x in w],
    "still": len(gpumem.torch.snapshot(0)["device_traces"][0]),
    "dumped": pickle.loads(gzip.open({str(path)!r}).read())["device_traces"] == gpumem.torch.snapshot(0)["device_traces"],
    "settings": _native.torch_history_settings(),
    "err": err,
}}))
""",
        {},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    p, q = out["p"], out["q"]
    actions = [(a, addr, size) for a, addr, size, _ in out["trace"] if not a.startswith("segment")]
    assert actions == [("alloc", p, 3 * MIB), ("free_requested", p, 3 * MIB), ("free_completed", p, 3 * MIB), ("alloc", q, 1000)]
    assert all(has for a, _, _, has in out["trace"] if a == "alloc"), "stacks at allocations"
    assert any(a == "segment_alloc" for a, _, _, _ in out["trace"])
    # Stopping is not possible once recording: a warning, and the history goes on.
    assert len(out["warnings"]) == 1 and "records the last 1000 events with stack traces" in out["warnings"][0]
    assert out["still"] == len(out["trace"])
    assert out["dumped"] is True
    assert out["settings"] == [1000, True]
    assert "before any tensor is created" in out["err"]


def test_an_invalid_gpumem_conf_is_reported_by_the_diagnostics_too():
    # Before any allocation the diagnostics describe the configuration the allocators will
    # have: with GPUMEM_CONF not one, they raise what the first allocation would, instead of
    # describing the defaults.
    r = run_script(
        """
        import gpumem
        from gpumem import _native
        _native.torch_use_simulated_devices(1, 2**30, False)
        for f in (lambda: gpumem.torch.memory_summary(0), lambda: gpumem.torch.snapshot(0)):
            try:
                f()
                print("no error")
            except gpumem.GpumemError as e:
                print("error:", e)
        """,
        {"GPUMEM_CONF": "policy:bogus"},
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(l.startswith("error: gpumem: GPUMEM_CONF:") for l in lines), r.stdout
    assert "bogus" in lines[0]
