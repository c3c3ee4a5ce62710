"""The allocator PyTorch calls, exercised without PyTorch: the process-wide registry of
gpumem.torch is switched to simulated devices, and the same code the exported C functions run
is driven through gpumem._native (and, for failures, through the exported C function itself,
called from C++ as PyTorch calls it). Each test uses its own simulated device, since the
registry lives for the whole process."""

import gzip
import json
import pickle

import pytest

import gpumem
import gpumem.testing
from gpumem import _native
from conftest import (
    GIB,
    MIB,
    TORCH_STAT_KEYS,
    check_snapshot_shape,
    check_summary_against_stats,
    live_blocks,
    parse_summary,
)

DEVICES = 8


@pytest.fixture(scope="module", autouse=True)
def simulated_registry():
    _native.torch_use_simulated_devices(DEVICES, GIB, True)
    assert _native.torch_configure("policy:stitched") == "policy:stitched"
    yield


def test_stats_of_a_device_without_allocations_are_zero_with_torchs_keys():
    s = gpumem.torch.memory_stats(DEVICES - 1)
    assert set(s) == TORCH_STAT_KEYS
    assert s["allocated_bytes.all.current"] == 0 and s["reserved_bytes.all.peak"] == 0
    nested = gpumem.torch.memory_stats_as_nested_dict(DEVICES - 1)
    assert nested["requested_bytes"]["large_pool"]["freed"] == 0
    assert nested["max_split_size"] == -1


def test_alloc_and_free_are_counted_exactly():
    dev = 1
    p = _native.torch_alloc(1000, dev, 0)
    q = _native.torch_alloc(6 * MIB, dev, 0)
    s = gpumem.torch.memory_stats(f"cuda:{dev}")
    assert s["requested_bytes.all.current"] == 1000 + 6 * MIB
    assert s["allocated_bytes.all.current"] == 1024 + 6 * MIB
    assert gpumem.torch.memory_allocated(dev) == 1024 + 6 * MIB
    assert gpumem.torch.memory_reserved(dev) == s["reserved_bytes.all.current"] > 0
    assert dev in gpumem.torch.devices()
    assert _native.torch_owner_device(q + 4096) == dev
    assert _native.torch_free(p, dev, 0) == "freed"
    assert _native.torch_free(q, dev, 0) == "freed"
    assert gpumem.torch.memory_allocated(dev) == 0
    assert gpumem.torch.max_memory_allocated(dev) == 1024 + 6 * MIB
    gpumem.torch.reset_peak_memory_stats(dev)
    assert gpumem.torch.max_memory_allocated(dev) == 0
    assert _native.torch_owner_device(q) is None
    s = gpumem.torch.memory_stats(dev)
    assert s["allocation.all.allocated"] == 2 and s["allocation.all.freed"] == 2
    assert s["allocated_bytes.all.freed"] == 1024 + 6 * MIB
    gpumem.torch.reset_accumulated_memory_stats(dev)
    s = gpumem.torch.memory_stats(dev)
    assert s["allocation.all.allocated"] == 0 and s["allocated_bytes.all.freed"] == 0
    assert s["num_device_alloc"] == 0
    assert s["reserved_bytes.all.current"] > 0, "what is held stays"
    r = _native.torch_alloc(3000, dev, 0)
    s = gpumem.torch.memory_stats(dev)
    assert s["allocation.all.allocated"] == 1 and s["allocated_bytes.all.allocated"] == 3072
    assert _native.torch_free(r, dev, 0) == "freed"


def test_zero_bytes_get_the_null_pointer_like_pytorch():
    assert _native.torch_alloc(0, 2, 0) == 0
    assert _native.torch_free(0, 2, 0) == "null"
    assert _native.torch_call_alloc_from_cpp(0, 2, 0) == ("returned", 0)


def test_misuse_is_counted_and_reported_never_fatal():
    """Each kind of misuse is reported on stderr the first time it happens in the process, and
    only counted after that. The registry (counts and reports) lives for the whole process, so
    this runs in a fresh one: there the first report of each kind is always this test's."""
    import subprocess
    import sys

    child = r"""
import json
import gpumem
from gpumem import _native
_native.torch_use_simulated_devices(8, 1 << 30, True)
_native.torch_configure("policy:stitched")
dev = 3
p = _native.torch_alloc(4096, dev, 0)
outcomes = [
    _native.torch_free(p, dev, 0),
    _native.torch_free(p, dev, 0),
    _native.torch_free(0xBAD_0000, dev, 0),
    _native.torch_free(0xBAD_0000, 6, 0),  # a device where nothing was allocated
    _native.torch_record_stream(0xBAD_0000, 9),
    # Still serving.
    _native.torch_free(_native.torch_alloc(4096, dev, 0), dev, 0),
]
# A live block freed naming another device, with and without an allocator there: freed where
# it lives (not leaked), and reported once.
q, r_ = _native.torch_alloc(8192, dev, 0), _native.torch_alloc(8192, dev, 0)
_native.torch_alloc(512, 5, 0)
outcomes += [_native.torch_free(q, 5, 0), _native.torch_free(r_, 7, 0)]
outcomes.append(gpumem.torch.memory_allocated(dev))
print(json.dumps({"ptr": p, "outcomes": outcomes, "counts": gpumem.torch.error_counts()}))
"""
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["outcomes"] == [
        "freed", "double_free", "foreign", "foreign", False, "freed", "freed", "freed", 0
    ]
    assert out["counts"] == {
        "foreign_frees": 2,
        "double_frees": 1,
        "free_errors": 0,
        "record_stream_foreign": 1,
        "other_errors": 0,
        "wrong_device_frees": 2,
    }
    # One line for the double free and one for the first foreign free; the second foreign free
    # is only counted, and record_stream on foreign memory is ignored silently (as PyTorch
    # ignores it).
    later = " (later occurrences are only counted: gpumem.torch.error_counts())"
    lines = r.stderr.splitlines()
    assert lines[:2] == [
        f"gpumem: warning: double free of {out['ptr']:#x} on device 3" + later,
        "gpumem: warning: free of 0xbad0000, which gpumem did not allocate on device 3" + later,
    ], r.stderr
    assert len(lines) == 3 and lines[2].endswith(
        "named device 5, but gpumem allocated it on device 3: freed there" + later
    ), r.stderr


def test_record_stream_keeps_the_block_until_the_other_stream_is_done():
    dev = 4
    main, side = 0, 0x5000
    x = _native.torch_alloc(16 * MIB, dev, main)
    assert _native.torch_record_stream(x, side) is True
    assert _native.torch_free(x, dev, main) == "freed"
    y = _native.torch_alloc(16 * MIB, dev, main)
    assert y != x
    assert gpumem.torch.memory_stats(dev)["active_bytes.all.current"] == 32 * MIB
    # The side stream's work (the record_stream event, and the events the stitched policy
    # records at its own slow paths) completes; only then may x's memory be reused.
    assert _native.torch_sim_complete_events(dev) >= 1
    _native.torch_free(y, dev, main)
    z = _native.torch_alloc(16 * MIB, dev, main)
    assert gpumem.torch.memory_stats(dev)["active_bytes.all.current"] == 16 * MIB
    _native.torch_free(z, dev, main)


def test_out_of_memory_is_thrown_to_the_cpp_caller_and_the_process_survives():
    dev = 5
    gpumem.torch.set_memory_fraction(0.25, dev)
    kind, cpp_type, what = _native.torch_call_alloc_from_cpp(512 * MIB, dev, 0)
    assert kind == "threw"
    # Without PyTorch loaded c10's exception cannot be bound: the fallback type.
    assert cpp_type == "gpumem::OutOfMemoryError" == gpumem.torch.oom_exception()
    assert what.startswith("CUDA out of memory. gpumem on device 5")
    assert "may hold at most 256.00 MiB" in what
    with pytest.raises(gpumem.OutOfMemoryError, match="CUDA out of memory"):
        _native.torch_alloc(512 * MIB, dev, 0)
    assert gpumem.torch.memory_stats(dev)["num_ooms"] == 2
    kind, ptr = _native.torch_call_alloc_from_cpp(64 * MIB, dev, 0)
    assert kind == "returned" and ptr != 0
    assert _native.torch_free(ptr, dev, 0) == "freed"
    with pytest.raises(ValueError, match="0 <= fraction <= 1"):
        gpumem.torch.set_memory_fraction(1.5, dev)
    with pytest.raises(TypeError):
        gpumem.torch.set_memory_fraction("half", dev)


def test_bad_devices_fail_clearly():
    kind, cpp_type, what = _native.torch_call_alloc_from_cpp(512, DEVICES + 1, 0)
    assert (kind, cpp_type) == ("threw", "gpumem::Error")
    assert "does not exist" in what
    with pytest.raises(ValueError, match="invalid CUDA device index"):
        gpumem.torch.memory_stats(-1)
    with pytest.raises(ValueError, match="expected a CUDA device"):
        gpumem.torch.memory_stats("cpu")
    # A device past the last one present is an error, as PyTorch raises, not zeros.
    gpumem.torch.memory_stats(DEVICES - 1)
    for call in (gpumem.torch.memory_stats, gpumem.torch.snapshot, gpumem.torch.memory_fraction):
        with pytest.raises(ValueError, match=f"index {DEVICES} \\({DEVICES} device"):
            call(DEVICES)
    with pytest.raises(ValueError, match="invalid CUDA device index"):
        gpumem.torch.set_memory_fraction(0.5, DEVICES)
    # Yes/no arguments are bools: "false" is refused, not read as True.
    with pytest.raises(TypeError, match="abbreviated must be True or False"):
        gpumem.torch.memory_summary(0, abbreviated="false")
    with pytest.raises(TypeError, match="on must be True or False"):
        gpumem.torch.time_hooks("off")


def test_empty_cache_releases_all_devices():
    dev = 6
    p = _native.torch_alloc(100 * MIB, dev, 0)
    _native.torch_free(p, dev, 0)
    held = gpumem.torch.memory_reserved(dev)
    assert held >= 100 * MIB
    released = gpumem.torch.empty_cache()
    assert released >= held
    assert gpumem.torch.memory_reserved(dev) == 0


def test_configuration_is_fixed_once_allocators_exist():
    # The types install() documents: GpumemError for a change once gpumem serves
    # allocations, ValueError for a configuration that is not one.
    assert gpumem.torch.conf() == "policy:stitched"
    with pytest.raises(gpumem.GpumemError, match="cannot change"):
        _native.torch_configure("policy:buddy")
    with pytest.raises(ValueError, match="nonsense"):
        _native.torch_configure("policy:nonsense")
    assert _native.torch_configure("policy:stitched") == "policy:stitched"
    with pytest.raises(gpumem.GpumemError, match="choose the device source first"):
        _native.torch_use_simulated_devices(2)


def test_install_without_pytorch_says_what_is_missing():
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("PyTorch is installed; test_torch_gpu.py covers install()")
    with pytest.raises(gpumem.GpumemError, match="needs PyTorch"):
        gpumem.torch.install()
    assert not gpumem.torch.is_installed()


# Diagnostics of the PyTorch allocators. Device 0 is used by these tests only; device
# DEVICES - 1 never allocates.


def test_summary_of_a_device_has_torchs_title_rows_and_figures():
    dev = 0
    ptrs = [_native.torch_alloc(n, dev, 0) for n in (40 * MIB, 1000)]
    text = gpumem.torch.memory_summary(dev)
    assert "gpumem CUDA memory summary, device ID 0 (policy stitched)" in text
    stats = gpumem.torch.memory_stats(dev)
    check_summary_against_stats(text, stats)
    rows = parse_summary(text)
    assert rows[("Requested memory", "all")][0] == ((40 * MIB + 1000) // 1024, "KiB")
    assert rows[("Allocations", "all")][:2] == [(2, ""), (2, "")]
    short = gpumem.torch.memory_summary(f"cuda:{dev}", abbreviated=True)
    check_summary_against_stats(short, stats, abbreviated=True)
    data = json.loads(gpumem.torch.memory_stats_json(dev))
    assert data["flat"] == dict(stats)
    for p in ptrs:
        assert _native.torch_free(p, dev, 0) == "freed"


def test_snapshot_of_a_device_holds_its_blocks(tmp_path):
    dev = 0
    p = _native.torch_alloc(9 * MIB, dev, 0x77)
    snap = gpumem.torch.snapshot(dev)
    check_snapshot_shape(snap)
    assert live_blocks(snap)[p] == (9 * MIB, 9 * MIB, "large")
    assert all(s["device"] == dev for s in snap["segments"])
    # Run after the summary test, this thread has allocated on stream 0 of the device before:
    # a second stream puts the device's streams in one range (range:auto), whose segments
    # carry the stream it was made for. Run alone, the block's segment is its stream's own.
    joined = any("range:auto" in n for n in gpumem.torch.policy_notes(dev))
    streams = {s["stream"] for s in snap["segments"] if p in [b["address"] for b in s["blocks"]]}
    assert streams == ({0} if joined else {0x77}), (streams, joined)
    assert gpumem.torch.memory_snapshot(dev) == snap["segments"]
    path = tmp_path / "dev0.pickle"
    gpumem.torch.dump_snapshot(str(path), dev)
    assert pickle.loads(path.read_bytes()) == snap
    assert snap["device_traces"] == [[]], "no history in this configuration"
    assert _native.torch_free(p, dev, 0x77) == "freed"


def test_dump_snapshot_of_an_unused_device_gzips_a_gz_path(tmp_path):
    path = tmp_path / "unused.pickle.gz"
    gpumem.torch.dump_snapshot(str(path), DEVICES - 1)
    assert path.read_bytes()[:2] == b"\x1f\x8b", "gzip magic"
    assert pickle.loads(gzip.decompress(path.read_bytes())) == gpumem.torch.snapshot(DEVICES - 1)
    assert DEVICES - 1 not in gpumem.torch.devices(), "writing it creates no allocator"


def test_snapshot_of_an_unused_device_is_empty():
    snap = gpumem.torch.snapshot(DEVICES - 1)
    check_snapshot_shape(snap)
    assert snap["segments"] == [] and snap["device_traces"] == [[]] * DEVICES
    assert snap["allocator_settings"]["gpumem_policy"] == "stitched"
    assert gpumem.torch.memory_snapshot(DEVICES - 1) == []
    assert len(gpumem.torch.leak_report(DEVICES - 1)) == 0
    assert DEVICES - 1 not in gpumem.torch.devices(), "reading diagnostics creates no allocator"


def test_leak_report_and_assert_no_leaks_of_a_device():
    dev = 0
    p = _native.torch_alloc(11 * MIB, dev, 0)
    report = gpumem.torch.leak_report(dev)
    assert not report.tracked, "this configuration does not track leaks"
    assert [(x["addr"], x["size"]) for x in report.allocations] == [(p, 11 * MIB)]
    assert gpumem.leak_report(device=dev).allocations == report.allocations
    with pytest.raises(AssertionError, match="11.00 MiB"):
        gpumem.testing.assert_no_leaks(device=dev)
    assert _native.torch_free(p, dev, 0) == "freed"
    gpumem.testing.assert_no_leaks(device=dev)


def test_history_cannot_change_once_the_allocators_exist():
    # What is in force (no history) is accepted; anything else says why and what to do.
    gpumem.torch.record_memory_history(False)
    with pytest.raises(gpumem.GpumemError, match="GPUMEM_CONF=history:N,backtraces:1"):
        gpumem.torch.record_memory_history(True, max_entries=1000)
    assert _native.torch_history_settings() == (0, False)
    with pytest.raises(ValueError, match="state"):
        gpumem.torch.record_memory_history("state")
    with pytest.raises(ValueError, match="positive"):
        gpumem.torch.record_memory_history(True, max_entries=0)
    # The simulated devices' size is checked as the Allocator's is.
    with pytest.raises(ValueError, match="more than the 4 TiB"):
        _native.torch_use_simulated_devices(1, 2**64 - 1, False)


def test_driver_calls_count_the_pages_gpumem_took_and_their_time():
    dev = 2  # only the zero-byte test touches device 2, and it allocates nothing there
    assert gpumem.torch.driver_calls(dev) == {}
    p = _native.torch_alloc(5 * MIB, dev, 0)
    calls = gpumem.torch.driver_calls(dev)
    # The default (stitched) policy backs 5 MiB with three 2 MiB pages: created and mapped.
    assert calls["cuMemCreate"]["calls"] == 3
    assert calls["cuMemMap"]["pages"] == 3
    # Every kind of call made is charged some time (the simulated device's cost model).
    assert all(v["seconds"] > 0.0 for v in calls.values() if v["calls"] > 0), calls
    assert _native.torch_free(p, dev, 0) == "freed"
    # Reusing the same pages needs no driver call at all.
    q = _native.torch_alloc(5 * MIB, dev, 0)
    assert gpumem.torch.driver_calls(dev) == calls
    assert _native.torch_free(q, dev, 0) == "freed"


def test_hooks_survive_a_closed_stderr():
    """PyTorch calls the free hook inside its deleters: reporting a foreign pointer there must
    not end the process when stderr is a pipe nobody reads any more (Python ignores SIGPIPE, so
    the write fails with EPIPE instead)."""
    import subprocess
    import sys

    child = r"""
import ctypes, sys
import gpumem
from gpumem import _native
_native.torch_use_simulated_devices(2, 1 << 30, True)
lib = ctypes.CDLL(_native.__file__)
lib.gpumem_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.gpumem_torch_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
sys.stdin.readline()  # the parent has closed our stderr by now
lib.gpumem_torch_free(0xDEAD000, 64, 0, None)
lib.gpumem_torch_set_memory_fraction(2.0, 0)
print(gpumem.torch.error_counts()["foreign_frees"], flush=True)
"""
    p = subprocess.Popen(
        [sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    p.stderr.close()
    out, _ = p.communicate("go\n", timeout=60)
    assert p.returncode == 0, (p.returncode, out)
    assert out.strip() == "1"


def _fresh_process(code: str) -> str:
    """Runs `code` in a new Python process (the registry is process-wide) and returns its
    stdout; fails with its stderr if it fails."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_memory_fraction_set_before_install_waits_for_the_allocator():
    """Setting a fraction first must not create the allocator (which would fix the
    configuration before install()); the cap applies once the allocator exists."""
    out = _fresh_process(r"""
import gpumem
from gpumem import _native, GpumemError
_native.torch_use_simulated_devices(2, 1 << 30, True)
gpumem.torch.set_memory_fraction(0.5, 0)
assert gpumem.torch.devices() == [], gpumem.torch.devices()
print(_native.torch_configure("policy:caching"))
try:
    _native.torch_alloc(600 << 20, 0, 0)
    print("no cap")
except gpumem.OutOfMemoryError as e:
    print("capped", "cap" in str(e))
p = _native.torch_alloc(100 << 20, 0, 0)
print(_native.torch_free(p, 0, 0))
""")
    assert out.split("\n")[:3] == ["policy:caching", "capped True", "freed"], out


@pytest.mark.parametrize("bad", ["cuda:x", "cuda:-1", "cpu", "cuda:1.5"])
def test_bad_device_strings_are_named(bad):
    with pytest.raises(ValueError, match="expected a CUDA device"):
        gpumem.torch.memory_stats(bad)


def test_policy_notes_are_empty_until_the_policy_changes_something():
    dev = 7
    assert gpumem.torch.policy_notes(dev) == []  # no allocator yet
    # One stream never takes pages from another, so the trade budget never switches.
    for size in (5 * MIB, 9 * MIB, 3 * MIB):
        assert _native.torch_free(_native.torch_alloc(size, dev, 0), dev, 0) == "freed"
    assert gpumem.torch.policy_notes(dev) == []
    assert gpumem.torch.memory_summary(dev).rstrip().endswith("|")  # nothing under the table
    with pytest.raises(ValueError, match="invalid CUDA device index"):
        gpumem.torch.policy_notes(-1)


def test_hook_time_counts_exactly_the_calls_made_while_on():
    """gpumem.torch.time_hooks(): every alloc, free and record_stream made while the clock is
    on is counted, with its time; none while it is off."""
    dev = 1
    before = gpumem.torch.hook_time()
    assert set(before) == {"alloc", "free", "record_stream"}
    # Off by default: calls leave the totals as they are.
    _native.torch_free(_native.torch_alloc(4096, dev, 0), dev, 0)
    assert gpumem.torch.hook_time() == before

    gpumem.torch.time_hooks(True)
    try:
        ptrs = [_native.torch_alloc(512 * (i + 1), dev, 0) for i in range(50)]
        _native.torch_record_stream(ptrs[0], 0x7000)
        for p in ptrs:
            assert _native.torch_free(p, dev, 0) == "freed"
        on = gpumem.torch.hook_time()
    finally:
        gpumem.torch.time_hooks(False)
    for hook, n in (("alloc", 50), ("free", 50), ("record_stream", 1)):
        assert on[hook]["calls"] - before[hook]["calls"] == n, hook
        assert on[hook]["seconds"] > before[hook]["seconds"], hook
    # Each call is timed around gpumem's work alone: far less than a millisecond per call.
    assert (on["alloc"]["seconds"] - before["alloc"]["seconds"]) / 50 < 1e-3

    _native.torch_free(_native.torch_alloc(4096, dev, 0), dev, 0)
    assert gpumem.torch.hook_time() == on, "switched off: nothing more counted"


# The native allocator (install(native=True)): what can be checked without PyTorch.


def test_native_choice_comes_from_the_argument_or_the_environment(monkeypatch):
    wanted = gpumem.torch._native_wanted
    monkeypatch.delenv("GPUMEM_TORCH_NATIVE", raising=False)
    assert wanted(None) is False, "the pluggable allocator by default"
    assert wanted(True) is True
    for text, expected in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("GPUMEM_TORCH_NATIVE", text)
        assert wanted(None) is expected, text
    monkeypatch.setenv("GPUMEM_TORCH_NATIVE", "1")
    assert wanted(False) is False, "the argument wins over the environment"
    monkeypatch.setenv("GPUMEM_TORCH_NATIVE", "maybe")
    with pytest.raises(gpumem.GpumemError, match="GPUMEM_TORCH_NATIVE='maybe': expected 1 or 0"):
        wanted(None)
    # install() refuses it before anything else (PyTorch or not).
    with pytest.raises(gpumem.GpumemError, match="GPUMEM_TORCH_NATIVE"):
        gpumem.torch.install()
    assert gpumem.torch.install_mode() is None and not gpumem.torch.is_installed()


def test_native_allocator_ships_its_source_and_finds_every_hook():
    import ctypes
    import re

    src = open(gpumem.torch._NATIVE_SOURCE).read()
    assert 'extern "C" int gpumem_native_install(const uintptr_t* addresses, int count' in src
    # The hooks gpumem_native_install fills, in the order it takes their addresses: the
    # exported ones in _NATIVE_HOOKS' order, then the three C++ hooks of CUDA graph capture.
    order = re.search(r"auto fields = std::make_tuple\(([^;]*)\);", src)
    assert order, "the table of hooks gpumem_native_install fills"
    fields = re.findall(r"&h\.(\w+)", order.group(1))
    expected = [n.removeprefix("gpumem_torch_") for n in gpumem.torch._NATIVE_HOOKS]
    renamed = {"set_memory_fraction": "set_fraction"}
    assert fields[: len(expected)] == [renamed.get(n, n) for n in expected], fields
    assert fields[len(expected) :] == [
        "begin_allocate_to_pool",
        "end_allocate_to_pool",
        "release_pool",
    ]
    assert [s for _, s in gpumem.torch._POOL_HOOKS] == [
        "set_begin_allocate_to_pool",
        "set_end_allocate_to_pool_fn",
        "set_release_pool",
    ]
    lib = ctypes.CDLL(_native.__file__)
    addresses = gpumem.torch._native_hook_addresses(lib)
    assert len(addresses) == len(fields)
    assert all(a > 0 for a in addresses)


def test_free_by_pointer_alone_finds_the_device_and_stream():
    # gpumem_torch_free_any, the native allocator's raw_delete, called as C++ calls it.
    import ctypes

    free_any = ctypes.CDLL(_native.__file__).gpumem_torch_free_any
    free_any.argtypes = [ctypes.c_void_p]
    free_any.restype = None
    dev = 6
    before = gpumem.torch.memory_allocated(dev)
    on_side_stream = _native.torch_alloc(3 * MIB, dev, 0xABC)
    small = _native.torch_alloc(700, dev, 0)
    assert gpumem.torch.memory_allocated(dev) == before + 3 * MIB + 1024
    errors_before = gpumem.torch.error_counts()
    free_any(on_side_stream)
    free_any(small)
    free_any(None)  # null: nothing to do
    assert gpumem.torch.memory_allocated(dev) == before
    assert gpumem.torch.error_counts() == errors_before, "found without naming device or stream"
    free_any(small)  # now a double free: counted, not fatal
    after = gpumem.torch.error_counts()
    assert after["double_frees"] == errors_before["double_frees"] + 1


def test_memory_fraction_reads_back_the_cap():
    dev = 5  # capped at 0.25 by the out-of-memory test above
    before = gpumem.torch.memory_fraction(dev)
    gpumem.torch.set_memory_fraction(0.4, f"cuda:{dev}")
    assert gpumem.torch.memory_fraction(dev) == 0.4
    gpumem.torch.set_memory_fraction(1.0, dev)
    assert gpumem.torch.memory_fraction(dev) == 1.0
    gpumem.torch.set_memory_fraction(before, dev)
    assert gpumem.torch.memory_fraction(dev) == before
    with pytest.raises(ValueError, match="CUDA device"):
        gpumem.torch.memory_fraction("cpu")


def test_a_graph_capture_is_served_from_its_own_pool_until_the_graph_is_gone():
    """CUDA graph capture as PyTorch's CUDAGraph drives it (the pool begun before the capture,
    ended after it, released when the graph is destroyed), through the shim's C++ hooks and
    the allocation hook: the capture stream's requests come from a private pool that nothing
    else takes while the graph lives, and its memory goes back once the graph is gone."""
    out = _fresh_process(r"""
import ctypes, json
import gpumem
from gpumem import _native
MIB = 1 << 20
_native.torch_use_simulated_devices(1, 1 << 30, True)
_native.torch_configure("policy:stitched")
cap, other, pool = 0xCA00, 0xD000, (0, 41)
eager = _native.torch_alloc(3 * MIB, 0, cap)
_native.torch_free(eager, 0, cap)  # cached on the capture stream
_native.torch_test_capture(True, 0, *pool, cap)
r = {"users": _native.torch_pool_use_count(0, *pool)}
inside = _native.torch_alloc(3 * MIB, 0, cap)
side = _native.torch_alloc(3 * MIB, 0, other)  # not part of the capture
r["inside_is_eager"] = inside == eager
r["inside"] = inside
r["side_is_inside"] = side == inside
_native.torch_free(inside, 0, cap)
r["reused_in_pool"] = _native.torch_alloc(3 * MIB, 0, cap) == inside
try:
    _native.torch_test_capture(True, 0, *pool, cap)
    r["twice"] = None
except gpumem.GpumemError as e:
    r["twice"] = str(e)
_native.torch_test_capture(False, 0, *pool, cap)
snap = gpumem.torch.snapshot(0)
r["pool_segments"] = [[s["segment_pool_id"], s["stream"], s["is_expandable"],
                       [b["address"] for b in s["blocks"] if b["state"] == "active_allocated"]]
                      for s in snap["segments"] if tuple(s["segment_pool_id"]) != (0, 0)]
r["summary"] = [l.strip() for l in gpumem.torch.memory_summary(0).splitlines() if "private pools" in l]
after = [_native.torch_alloc(3 * MIB, 0, cap) for _ in range(3)]
r["after_in_graph"] = inside in after
for p in after:
    _native.torch_free(p, 0, cap)
_native.torch_free(side, 0, other)
_native.torch_free(inside, 0, cap)
r["stats_allocated"] = gpumem.torch.memory_allocated(0)
gpumem.torch.empty_cache()
r["kept"] = gpumem.torch.memory_reserved(0)
release = ctypes.CDLL(_native.__file__).gpumem_torch_pool_release
release.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
err = ctypes.create_string_buffer(200)
r["release"] = [release(0, *pool, err, len(err)), release(0, *pool, err, len(err)), err.value.decode()]
r["users_after"] = _native.torch_pool_use_count(0, *pool)
gpumem.torch.empty_cache()
r["after_release"] = gpumem.torch.memory_reserved(0)
print(json.dumps(r))
""")
    r = json.loads(out)
    assert r["users"] == 1
    assert not r["inside_is_eager"], "the capture took the stream's cached eager block"
    assert not r["side_is_inside"]
    assert r["reused_in_pool"], "a block freed during the capture is the pool's to reuse"
    assert "already being filled" in r["twice"], r["twice"]
    # The snapshot names the graph's pool and its capture stream (stitched policy otherwise).
    assert r["pool_segments"] == [[[0, 41], 0xCA00, False, [r["inside"]]]], r["pool_segments"]
    assert not r["after_in_graph"], "after the capture an eager request got the graph's memory"
    # memory_summary says what the pool holds (a 20 MiB segment, the 3 MiB block live).
    assert len(r["summary"]) == 1 and "1 holding 20.00 MiB (3.00 MiB of it" in r["summary"][0], r["summary"]
    assert r["stats_allocated"] == 0
    assert r["kept"] >= 20 * MIB, "empty_cache took the memory of a graph still alive"
    rc_first, rc_second, msg = r["release"]
    assert rc_first == 0 and rc_second == 1 and "no user left" in msg, r["release"]
    assert r["users_after"] == 0
    assert r["after_release"] == 0, "the pool's memory went back once the graph was gone"


def test_the_checkpoint_exports_restore_a_pool_and_refuse_misuse():
    """The C functions behind c10's getCheckpointState / setCheckpointPoolState /
    checkPoolLiveAllocations (what the native allocator calls for torch.compile's CUDA graph
    trees), called through ctypes as C would: a pool's blocks are restored where they were,
    reported through the two callbacks; misuse is refused with a message, never a crash."""
    out = _fresh_process(r"""
import ctypes, json
import gpumem
from gpumem import _native
MIB = 1 << 20
_native.torch_use_simulated_devices(2, 1 << 30, True)
_native.torch_configure("policy:stitched")
lib = ctypes.CDLL(_native.__file__)
ck = lib.gpumem_torch_pool_checkpoint
ck.restype = ctypes.c_void_p
ck.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
ck_free = lib.gpumem_torch_pool_checkpoint_free
ck_free.argtypes = [ctypes.c_void_p]
CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64)
rs = lib.gpumem_torch_pool_restore
rs.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, CB, CB, ctypes.c_char_p, ctypes.c_size_t]
live = lib.gpumem_torch_pool_live_blocks
live.restype = ctypes.c_int64
live.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64),
                 ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
err = ctypes.create_string_buffer(300)
r = {}
freed, back = [], []
on_freed = CB(lambda ctx, p: freed.append(p))
on_back = CB(lambda ctx, p: back.append(p))
cap, pool = 0xCA00, (0, 61)
_native.torch_alloc(MIB, 1, 0)  # device 1 has an allocator, but not the pool
r["no_allocator"] = [ck(0, *pool, err, len(err)) is None, err.value.decode()]
_native.torch_free(_native.torch_alloc(MIB, 0, 0), 0, 0)
r["unknown"] = [ck(0, *pool, err, len(err)) is None, err.value.decode()]
_native.torch_test_capture(True, 0, *pool, cap)
x = _native.torch_alloc(3 * MIB, 0, cap)
y = _native.torch_alloc(MIB, 0, cap)
_native.torch_test_capture(False, 0, *pool, cap)
cp = ck(0, *pool, err, len(err))
buf = (ctypes.c_uint64 * 1)()
r["live_count"] = live(0, *pool, buf, 1, err, len(err))  # two live, room for one
_native.torch_free(y, 0, cap)
r["wrong_device"] = [rs(1, cp, None, on_freed, on_back, err, len(err)), err.value.decode()]
r["no_checkpoint"] = [rs(0, None, None, on_freed, on_back, err, len(err)), err.value.decode()]
r["calls_before"] = [len(freed), len(back)]
r["restore"] = rs(0, cp, None, on_freed, on_back, err, len(err))
r["freed"] = freed == [x]
r["back"] = sorted(back) == sorted([x, y])
buf2 = (ctypes.c_uint64 * 4)()
n = live(0, *pool, buf2, 4, err, len(err))
r["live_after"] = sorted(buf2[:n]) == sorted([x, y])
ck_free(cp)
ck_free(None)
for p in (x, y):
    _native.torch_free(p, 0, cap)
r["allocated"] = gpumem.torch.memory_allocated(0)
r["errors"] = gpumem.torch.error_counts()
print(json.dumps(r))
""")
    r = json.loads(out)
    null, msg = r["no_allocator"]
    assert null and "no private pool on device 0" in msg, r["no_allocator"]
    null, msg = r["unknown"]
    assert null and "no private pool (0, 61)" in msg, r["unknown"]
    assert r["live_count"] == 2, "the count of live blocks, beyond the room given"
    rc, msg = r["wrong_device"]
    assert rc == 1 and "checkpoint of device 0 cannot be restored on device 1" in msg, msg
    rc, msg = r["no_checkpoint"]
    assert rc == 1 and "no checkpoint" in msg, msg
    assert r["calls_before"] == [0, 0], "a refused restore reports nothing"
    assert r["restore"] == 0
    assert r["freed"] and r["back"] and r["live_after"], r
    assert r["allocated"] == 0
    assert all(v == 0 for v in r["errors"].values()), r["errors"]
