"""gpumem.Allocator over the simulated device: no PyTorch, no GPU."""

import time

import pytest

import gpumem
from conftest import GIB, MIB, TORCH_STAT_KEYS


def sim(conf="policy:native", memory=GIB, events="immediate"):
    return gpumem.Allocator(conf=conf, device="sim", sim_memory=memory, sim_events=events)


def test_stats_are_exact_under_pytorchs_rules():
    # The native policy follows PyTorch's caching allocator: sizes round up to 512 B, requests
    # up to 1 MiB get 2 MiB small segments, 1-10 MiB requests get 20 MiB segments.
    a = sim()
    small = a.allocate(1000)
    large = a.allocate(3 * MIB + 1)
    s = a.memory_stats()
    assert s["requested_bytes.all.current"] == 1000 + 3 * MIB + 1
    assert s["allocated_bytes.small_pool.current"] == 1024
    assert s["allocated_bytes.large_pool.current"] == 3 * MIB + 512
    assert s["allocation.all.current"] == 2
    assert s["reserved_bytes.small_pool.current"] == 2 * MIB
    assert s["reserved_bytes.large_pool.current"] == 20 * MIB
    assert s["segment.all.current"] == 2
    assert a.held_bytes == 22 * MIB
    a.free(small)
    a.free(large)
    s = a.memory_stats()
    assert s["allocated_bytes.all.current"] == 0
    assert s["allocated_bytes.all.peak"] == 1024 + 3 * MIB + 512
    assert s["allocated_bytes.all.allocated"] == s["allocated_bytes.all.freed"] == 1024 + 3 * MIB + 512
    assert s["requested_bytes.all.peak"] == 1000 + 3 * MIB + 1
    assert s["reserved_bytes.all.current"] == 22 * MIB, "freed blocks stay cached"
    assert s["inactive_split_bytes.all.current"] == 0, "coalesced back into whole segments"
    a.check()


def test_default_policy_counts_exactly_and_holds_whole_pages():
    a = sim(conf=None)
    assert a.policy == "stitched"
    ptrs = [a.allocate(n) for n in (1000, 5 * MIB, 300 * 1024)]
    s = a.memory_stats()
    assert s["requested_bytes.all.current"] == 1000 + 5 * MIB + 300 * 1024
    assert s["allocated_bytes.all.current"] == 1024 + 5 * MIB + 300 * 1024
    assert s["allocated_bytes.small_pool.current"] == 1024 + 300 * 1024
    assert s["allocated_bytes.large_pool.current"] == 5 * MIB
    assert s["allocation.all.current"] == 3
    # Stitched packs the three blocks side by side and maps only the 2 MiB pages they touch:
    # 5 MiB + 301 KiB (5,551,104 bytes) allocated rounds up to three pages, 6 MiB.
    held = s["reserved_bytes.all.current"]
    allocated = s["allocated_bytes.all.current"]
    assert held == -(-allocated // (2 * MIB)) * (2 * MIB) == 6 * MIB
    assert held == a.held_bytes
    for p in ptrs:
        a.free(p)
    assert a.memory_stats()["allocated_bytes.all.current"] == 0
    a.check()


def test_larger_pages_hold_whole_pages_of_that_size():
    # page:16MiB (kernels stream faster over larger physical allocations): the same three
    # blocks, 5,551,104 bytes side by side, now hold one whole 16 MiB page.
    a = sim(conf="page:16MiB", memory=4 * GIB)
    ptrs = [a.allocate(n) for n in (1000, 5 * MIB, 300 * 1024)]
    assert a.memory_stats()["reserved_bytes.all.current"] == 16 * MIB == a.held_bytes
    ptrs.append(a.allocate(20 * MIB))
    # 25.3 MiB allocated in one range: two pages.
    assert a.held_bytes == 32 * MIB
    for p in ptrs:
        a.free(p)
    a.check()
    with pytest.raises(ValueError, match="power of two"):
        gpumem.Allocator(conf="page:24MiB", device="sim")
    # The other policies ignore it, as every stitched key.
    c = gpumem.Allocator(conf="policy:caching,page:16MiB", device="sim", sim_memory=4 * GIB)
    c.allocate(1000)
    assert c.held_bytes == 2 * MIB  # caching's small-pool segment


def test_memory_stats_has_exactly_torchs_keys():
    s = sim().memory_stats()
    assert set(s) == TORCH_STAT_KEYS
    assert list(s) == sorted(s), "sorted, as torch.cuda.memory_stats() returns them"
    assert s["max_split_size"] == -1
    assert all(isinstance(v, int) for v in s.values())


def test_record_stream_defers_reuse_until_the_other_stream_is_done():
    a = sim(events="manual")
    main, side = 0, 0x7F00_0000_1000
    x = a.allocate(8 * MIB, stream=main)
    a.record_stream(x, side)
    a.free(x, stream=main)
    s = a.memory_stats()
    assert s["allocated_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 8 * MIB, "waiting for the side stream"
    assert a.sim_pending_events() == 1
    y = a.allocate(8 * MIB, stream=main)
    assert y != x, "a block still in use on another stream must not be handed out"
    # The side stream catches up: the block becomes reusable.
    assert a.sim_complete_events() == 1
    a.free(y)
    z = a.allocate(8 * MIB, stream=main)
    assert a.memory_stats()["active_bytes.all.current"] == 8 * MIB, "only z is active now"
    a.free(z)
    assert a.memory_stats()["active_bytes.all.current"] == 0
    assert a.sim_pending_events() == 0


def test_without_record_stream_the_block_is_reused_at_once():
    # The control of the test above: the same sequence without record_stream reuses x.
    a = sim(events="manual")
    x = a.allocate(8 * MIB)
    a.free(x)
    assert a.allocate(8 * MIB) == x


def test_double_free_and_foreign_pointers_raise_clear_errors():
    a = sim()
    p = a.allocate(4096)
    a.free(p)
    with pytest.raises(gpumem.DoubleFreeError, match="double free"):
        a.free(p)
    with pytest.raises(gpumem.InvalidPointerError, match="not allocated by this gpumem allocator"):
        a.free(0xDEAD_BEEF_0000)
    with pytest.raises(gpumem.InvalidPointerError):
        a.record_stream(0xDEAD_BEEF_0000, 5)
    # Ints that cannot be device addresses are refused the same way, not with OverflowError.
    for bad in (-1, -p, 2**64 + p):
        with pytest.raises(gpumem.InvalidPointerError, match="not a device pointer"):
            a.free(bad)
        with pytest.raises(gpumem.InvalidPointerError, match="not a device pointer"):
            a.record_stream(bad, 5)
    # Nothing was lost: the allocator still works and its invariants hold.
    q = a.allocate(4096)
    a.free(q)
    a.check()


@pytest.mark.parametrize(
    "size, message",
    [(0, "at least 1 byte"), (-5, "at least 1 byte"), (2 * GIB, "larger than the whole device"), (2**70, "more than 2\\*\\*64")],
)
def test_absurd_sizes_raise(size, message):
    a = sim()
    with pytest.raises(gpumem.InvalidSizeError, match=message):
        a.allocate(size)
    assert a.held_bytes == 0


def test_memory_fraction_gives_an_out_of_memory_error_that_explains_itself():
    a = sim(conf="policy:stitched")
    a.set_memory_fraction(0.25)
    keep = a.allocate(100 * MIB)
    with pytest.raises(gpumem.OutOfMemoryError) as e:
        a.allocate(512 * MIB)
    msg = str(e.value)
    assert "out of memory" in msg and "tried to allocate 512.00 MiB" in msg
    assert "may hold at most 256.00 MiB" in msg
    s = a.memory_stats()
    assert s["num_ooms"] == 1
    assert s["reserved_bytes.all.current"] <= GIB // 4
    a.allocate(64 * MIB)  # the process goes on
    a.free(keep)
    with pytest.raises(ValueError, match="not in"):
        a.set_memory_fraction(1.5)
    a.set_cap(None)
    a.free(a.allocate(512 * MIB))


def test_empty_cache_returns_every_unused_byte():
    a = sim()
    p = a.allocate(64 * MIB)
    a.free(p)
    assert a.held_bytes == 64 * MIB
    assert a.empty_cache() == 64 * MIB
    assert a.held_bytes == 0
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    assert a.peak_held_bytes == 64 * MIB
    a.reset_peak_memory_stats()
    assert a.peak_held_bytes == 0
    assert a.memory_stats()["reserved_bytes.all.peak"] == 0


def test_driver_calls_are_counted():
    a = sim()
    a.free(a.allocate(64 * MIB))
    a.empty_cache()
    assert a.driver_calls() == {"cuMemAlloc": 1, "cuMemFree": 1}


def _streams_take_turns(a, rounds=None, seconds=None):
    """Four streams, each allocating and freeing 8-12 MiB in turn; stops after `rounds`, or
    once the policy notes something or `seconds` have passed. Returns the rounds made."""
    start, n = time.perf_counter(), 0
    while (rounds is None or n < rounds) and (
        seconds is None or (time.perf_counter() - start < seconds and not a.policy_notes())
    ):
        for stream in (1, 2, 3, 4):
            a.free(a.allocate((8 + n % 5) * MIB, stream))
        n += 1
    return n


def test_streams_stop_trading_pages_once_it_costs_more_than_the_budget():
    # The pool holds one stream's worth of pages, so each turn takes them from the stream
    # before: on the simulated device every move costs its modelled driver time, far more than
    # the wall time of a turn, so a budget of 1 % is spent within the first 100 ms window.
    # Ranges per stream: this one thread allocates on all four streams, which by default
    # (range:auto) would put them in one shared range, with no pages to trade.
    a = sim("policy:stitched,trade_budget:0.01,range:stream")
    _streams_take_turns(a, seconds=5.0)
    notes = a.policy_notes()
    assert len(notes) == 1 and "stopped taking each other's idle pages" in notes[0], notes
    assert a.memory_summary().rstrip().endswith(notes[0]), "the summary ends with the note"
    calls = sum(a.driver_calls().values())
    _streams_take_turns(a, rounds=200)
    # From then on each stream maps pages of its own, once, instead of trading.
    assert sum(a.driver_calls().values()) - calls < 200
    assert a.held_bytes >= 4 * 8 * MIB

    off = sim("policy:stitched,trade_budget:off,range:stream")
    _streams_take_turns(off, rounds=400)
    assert off.policy_notes() == []
    calls = sum(off.driver_calls().values())
    _streams_take_turns(off, rounds=200)
    assert sum(off.driver_calls().values()) - calls >= 200 * 4, "the streams keep trading"
    assert off.held_bytes <= 12 * MIB


def _random_sizes_churn(a, seconds=None, ops=None, live=200):
    """One stream keeping `live` blocks of random sizes (512 B to 64 MiB, log-uniform) alive,
    freeing a random one and allocating another, for `ops` operations, or for up to `seconds`
    of wall time or until the policy notes something."""
    import math
    import random

    rng = random.Random(7)
    blocks = []
    n, start = 0, time.perf_counter()
    while (ops is None or n < ops) and (
        seconds is None or (time.perf_counter() - start < seconds and not a.policy_notes())
    ):
        if len(blocks) < live:
            size = int(math.exp(rng.uniform(math.log(512), math.log(64 * MIB))))
            blocks.append(a.allocate(size))
        else:
            a.free(blocks.pop(rng.randrange(len(blocks))))
        n += 1
    return blocks


def test_remapping_over_the_budget_buys_spare_pages():
    # Random sizes keep moving the layout, so the pool keeps pointing virtual pages at other
    # physical pages; on the simulated device each remap costs its modelled driver time (tens
    # of microseconds). The windows are 100 ms of wall time, so the share of it this churn
    # spends remapping depends on the machine's speed: near the default budget of 20 % (a
    # loaded machine ran 10 s without three such windows in a row), well over 1 % on any. Once
    # three windows in a row are over it, the pool raises its spare pages and says so. (The
    # rule itself is tested on a driven clock in crates/gpumem-core/tests/stitched_remap_budget.rs.)
    a = sim("policy:stitched,remap_budget:0.01", memory=16 * GIB)
    _random_sizes_churn(a, seconds=10.0)
    notes = a.policy_notes()
    assert len(notes) == 1 and notes[0].startswith("stitched: spare pages raised to "), notes
    assert "over the remap_budget of 1 %" in notes[0], notes
    assert a.memory_summary().rstrip().endswith(notes[0]), "the summary ends with the note"

    off = sim("policy:stitched,remap_budget:off", memory=16 * GIB)
    _random_sizes_churn(off, ops=20_000)
    assert off.policy_notes() == []
    assert off.driver_calls().get("cuMemUnmap", 0) > 100, "the churn remaps"


def test_segments_describe_the_blocks():
    a = sim()
    p = a.allocate(5 * MIB)
    segs = a.segments()
    assert len(segs) == 1
    seg = segs[0]
    assert seg["total_size"] == 20 * MIB and seg["segment_type"] == "large"
    assert seg["allocated_size"] == 5 * MIB and seg["requested_size"] == 5 * MIB
    states = [(b["address"], b["size"], b["state"]) for b in seg["blocks"]]
    assert states[0] == (p, 5 * MIB, "active_allocated")
    assert sum(b["size"] for b in seg["blocks"]) == 20 * MIB
    assert {b["state"] for b in seg["blocks"][1:]} == {"inactive"}


def test_bad_configuration_and_devices_are_rejected():
    with pytest.raises(ValueError, match="unknown policy"):
        gpumem.Allocator(conf="policy:magic")
    with pytest.raises(ValueError, match="unknown key 'colour'"):
        gpumem.Allocator(conf="colour:blue")
    with pytest.raises(ValueError, match="'sim' or a CUDA device index"):
        gpumem.Allocator(device="tpu")
    with pytest.raises(ValueError, match="sim_events"):
        gpumem.Allocator(sim_events="sometimes")
    # A simulated device larger than any GPU once overflowed (a panic) or asked for terabytes
    # of page table (an abort): refused before anything is made.
    for policy in ("stitched", "expandable", "caching"):
        with pytest.raises(ValueError, match="more than the 4 TiB"):
            gpumem.Allocator(conf=f"policy:{policy}", sim_memory=2**62)
    with pytest.raises(ValueError, match="needs some memory"):
        gpumem.Allocator(sim_memory=0)
    a = gpumem.Allocator(conf="policy:stitched", sim_memory=4 * 2**40)
    a.free(a.allocate(1))


def test_cuda_device_without_a_gpu_is_a_clear_error():
    try:
        gpumem.cuda_device_count()
    except gpumem.GpumemError:
        pass
    else:
        pytest.skip("a CUDA driver is present")
    with pytest.raises(gpumem.GpumemError, match="cannot open CUDA device 0"):
        gpumem.Allocator(device=0)


def test_conf_from_the_environment(monkeypatch):
    monkeypatch.setenv("GPUMEM_CONF", "policy:buddy")
    a = gpumem.Allocator()
    assert a.policy == "buddy" and a.conf == "policy:buddy"
    monkeypatch.setenv("GPUMEM_CONF", "policy:")
    with pytest.raises(ValueError):
        gpumem.Allocator()
