"""The measurement scripts' own arithmetic, on made-up inputs (no PyTorch, no GPU): what
scripts/kernel_time.py reports from bench_workloads.py's JSON lines, and how
bench_workloads.py sums a profiler's device events."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_time_line(allocator, rnd, by_name, steps=10):
    total = sum(us for _, _, us in by_name)
    return json.dumps({"workload": "w", "allocator": allocator, "round": rnd, "kernel_time": {
        "steps": steps, "us_per_step": total / steps, "events_per_step": 3, "by_name": by_name}})


def test_kernel_time_ratios_are_per_round_and_per_kernel(tmp_path):
    kt = load("kernel_time")
    lines = []
    # Round 0: gpumem's copy kernel 10 % slower; round 1: 20 % slower. The matrix multiply is
    # the same in both. A third allocator ran only in round 1.
    for rnd, slow in ((0, 1.1), (1, 1.2)):
        lines.append(kernel_time_line("native", rnd, [["gemm", 5, 8000.0], ["copy", 5, 2000.0]]))
        lines.append(kernel_time_line("gpumem", rnd, [["gemm", 5, 8000.0], ["copy", 5, 2000.0 * slow]]))
    lines.append(kernel_time_line("other", 1, [["gemm", 5, 4000.0]]))
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(lines + ['{"summary": []}', "not json"]) + "\n")
    runs = kt.load(str(path))
    c = kt.compare(runs["w"], top=5)
    assert c["native_us"] == pytest.approx(1000.0)
    g = c["allocators"]["gpumem"]
    assert g["ratios"] == pytest.approx([1.02, 1.04])
    assert g["us"] == pytest.approx(1030.0)
    assert c["allocators"]["other"]["ratios"] == pytest.approx([0.4])
    names = [k[0] for k in c["kernels"]]
    assert names == ["gemm", "copy"], "largest under native first"
    gemm, copy = c["kernels"]
    assert gemm[1] == pytest.approx(800.0) and gemm[2]["gpumem"] == pytest.approx(1.0)
    assert copy[2]["gpumem"] == pytest.approx(1.15), "median of 1.1 and 1.2"
    assert copy[2]["other"] is None, "a kernel the run did not record has no ratio"


def test_kernel_time_without_native_says_so(tmp_path, capsys, monkeypatch):
    kt = load("kernel_time")
    path = tmp_path / "bench.jsonl"
    path.write_text(kernel_time_line("gpumem", 0, [["k", 1, 10.0]]) + "\n")
    assert kt.compare(kt.load(str(path))["w"], top=3)["native_us"] is None
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"workload": "w", "allocator": "native", "step_s": [0.1]}\n')
    monkeypatch.setattr("sys.argv", ["kernel_time.py", str(empty)])
    assert kt.main() == 1
    assert "no run recorded kernel_time" in capsys.readouterr().err


def test_kernel_totals_sums_device_events_only():
    bw = load("bench_workloads")
    cuda, cpu = object(), object()
    fake_torch = SimpleNamespace(autograd=SimpleNamespace(DeviceType=SimpleNamespace(CUDA=cuda)))

    def event(name, device, us):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [event("gemm", cuda, 300.0), event("copy", cuda, 50.0), event("gemm", cuda, 100.0),
              event("aten::mm", cpu, 999.0)]
    prof = SimpleNamespace(events=lambda: events)
    t = bw.kernel_totals(fake_torch, prof, steps=2, top=1)
    assert t["us_per_step"] == pytest.approx(225.0), "CPU events are left out"
    assert t["events_per_step"] == pytest.approx(1.5)
    assert t["by_name"] == [["gemm", 2, 400.0]], "the largest name only, with its count"


def test_step_deltas_are_per_step_and_name_only_kinds_called():
    bw = load("bench_workloads")
    snaps = [{}, {"cuMemMap": {"calls": 2, "pages": 2, "seconds": 0.5}},
             {"cuMemMap": {"calls": 2, "pages": 2, "seconds": 0.5}},
             {"cuMemMap": {"calls": 5, "pages": 5, "seconds": 0.75},
              "cuEventRecord": {"calls": 1, "pages": 0, "seconds": 0.25}}]
    assert bw.step_deltas(snaps) == [{"cuMemMap": [2, 0.5]}, {},
                                     {"cuMemMap": [3, 0.25], "cuEventRecord": [1, 0.25]}]


def test_trace_ops_pair_each_free_with_its_allocation():
    tat = load("trace_alloc_time")
    mib = 1 << 20
    snap = {"device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 20 * mib, "stream": 0},
        {"action": "free_requested", "addr": 0x900, "size": 512, "stream": 0},  # before the recording
        {"action": "alloc", "addr": 0x100, "size": 3 * mib, "stream": 0},
        {"action": "alloc", "addr": 0x200, "size": 512, "stream": 0},
        {"action": "alloc", "addr": 0x300, "size": 0, "stream": 0},  # PyTorch never asks for 0 bytes
        {"action": "free_requested", "addr": 0x100, "size": 3 * mib, "stream": 0},
        {"action": "free_completed", "addr": 0x100, "size": 3 * mib, "stream": 0},
        {"action": "alloc", "addr": 0x100, "size": mib, "stream": 7},  # same address, new block
        {"action": "alloc", "addr": 0x400, "size": 1024, "stream": 0},
        {"action": "free_requested", "addr": 0x200, "size": 512, "stream": 0},
    ]]}
    sizes, slots, n_slots, streams, persistent, stream_of = tat.ops_from_snapshot(snap)
    assert list(sizes) == [3 * mib, 512, 0, mib, 1024, 0]
    # The freed slot 0 is taken again by the next allocation; the fourth block needs a third.
    assert list(slots) == [0, 1, 0, 0, 2, 1]
    assert n_slots == 3
    assert streams == {0, 7}
    # Streams by first use; each free on its allocation's stream.
    assert list(stream_of) == [0, 0, 0, 1, 0, 0]
    # The two blocks the recording never frees are made in the first pass only.
    assert persistent == [False, False, False, True, True, False]


def test_trace_ops_take_completed_frees_when_the_trace_has_no_requested_ones():
    tat = load("trace_alloc_time")
    snap = {"device_traces": [[
        {"action": "alloc", "addr": 1, "size": 8}, {"action": "alloc", "addr": 2, "size": 16},
        {"action": "free_completed", "addr": 1, "size": 8}, {"action": "free", "addr": 2}]]}
    sizes, slots, _, _, persistent, _ = tat.ops_from_snapshot(snap)
    # Legacy `free` comes before completions in the order of preference.
    assert list(sizes) == [8, 16, 0] and list(slots) == [0, 1, 1]
    assert persistent == [True, False, False]


def test_trace_ops_refuse_what_is_not_a_trace():
    tat = load("trace_alloc_time")
    with pytest.raises(ValueError, match="no allocation trace"):
        tat.ops_from_snapshot({"segments": []})
    with pytest.raises(ValueError, match="no allocation"):
        tat.ops_from_snapshot({"device_traces": [[{"action": "free_requested", "addr": 1}]]})
    with pytest.raises(ValueError, match="allocated twice"):
        tat.ops_from_snapshot({"device_traces": [[
            {"action": "alloc", "addr": 1, "size": 8}, {"action": "alloc", "addr": 1, "size": 8}]]})


def test_cold_trace_table_takes_the_clock_off_and_compares_with_native():
    tat = load("trace_alloc_time")

    def run(name, rnd, passes):
        return {"allocator": name, "round": rnd, "peak_held": 1 << 30, "passes": [
            {"ms": 1.0, "chunk_ms": [1.0], "driver_ms": None, "hook_ms": None,
             "cold": {"alloc_ns": a, "free_ns": f, "clock_ns": 20.0, "allocs": 100,
                      "frees": 100}} for a, f in passes]}

    # The first pass (pool growing) is left out; later passes' medians are taken.
    native = run("native", 0, [(9000.0, 900.0), (520.0, 320.0), (500.0, 300.0), (540.0, 340.0)])
    gm = run("gpumem", 0, [(20000.0, 400.0), (420.0, 250.0), (440.0, 270.0), (430.0, 260.0)])
    s = tat.cold_summary(gm)
    assert s["alloc_ns"] == pytest.approx(430.0 - 20.0)
    assert s["free_ns"] == pytest.approx(260.0 - 20.0)
    table = tat.render_cold([native, gm, {"allocator": "gpumem", "round": 1, "error": "boom"}],
                            trace_steps=4)
    row = next(ln for ln in table.splitlines() if ln.startswith("gpumem") and "boom" not in ln)
    # Against native's 500 / 300 (less the clock): alloc -90, free -60 ns; 100 of each per
    # pass: -15.0 µs per pass, -3.75 per step.
    assert "-90" in row and "-60" in row and "-15.0" in row and "-3.75" in row, row
    assert "boom" in table


def test_trace_time_table_sets_each_pass_beside_the_median_native_run():
    tat = load("trace_alloc_time")

    def run(name, rnd, ms, driver=None):
        # Each pass in two chunks: its first 60 % and its last 40 %.
        return {"allocator": name, "round": rnd, "peak_held": 2 << 30, "passes": [
            {"ms": m, "ns_per_op": m * 1e6 / 1000, "chunk_ms": [0.6 * m, 0.4 * m],
             "driver_ms": driver, "hook_ms": None if driver is None else driver + 1.0}
            for m in ms]}

    results = [run("native", 0, [100.0, 10.0, 30.0]), run("native", 1, [120.0, 14.0, 14.0]),
               run("gpumem", 0, [150.0, 9.0, 11.0], driver=40.0),
               {"allocator": "gpumem", "round": 1, "error": "exit 1: boom"}]
    s = tat.summary(results[2])
    assert s["first_ms"] == 150.0 and s["later_ms"] == pytest.approx(10.0)
    assert s["later_half_ms"] == pytest.approx(4.0), "median of 0.4 * 9 and 0.4 * 11"
    table = tat.render(results, trace_steps=10)
    row = next(ln for ln in table.splitlines() if ln.startswith("gpumem") and " 0 " in ln)
    # Native's runs: first passes 100 and 120 ms (median 110); later passes' medians 20 and 14
    # (median 17). So gpumem is +40 ms (+4 per step) and -7 ms (-0.7 per step).
    assert "150.0 [40.0, 41.0] +40.0 (+4.00/step)" in row
    assert "10.0 [40.0, 41.0] -7.0 (-0.70/step)" in row
    assert "exit 1: boom" in table


def run_lockstep(tmp_path, env_extra, pairs="native:gpumem,native:native-again", steps=10,
                 extra=()):
    import os
    import subprocess
    import sys

    env = {**os.environ, "LOCKSTEP_SELFTEST_MS": "8", **env_extra}
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "lockstep_steps.py"), "--workloads", "selftest",
         "--steps", str(steps), "--pairs", pairs, "--out", str(tmp_path), *extra],
        env=env, capture_output=True, text=True, timeout=120)
    rows = [json.loads(line) for line in (tmp_path / "lockstep.jsonl").read_text().splitlines()]
    return out, rows


def test_lockstep_pairs_each_step_and_sees_a_slower_side(tmp_path):
    # The self-test workload sleeps 8 ms a step, 10 % longer under a gpumem name: the lockstep
    # must give every step to both sides, in alternating order, and find the 10 %.
    out, rows = run_lockstep(tmp_path, {"LOCKSTEP_SELFTEST_GPUMEM_FACTOR": "1.1"})
    assert out.returncode == 0, out.stderr
    assert [(r["a"], r["b"]) for r in rows] == [("native", "gpumem"), ("native", "native-again")]
    for r in rows:
        assert len(r["a_step_s"]) == len(r["b_step_s"]) == 10
        assert r["summary"]["timed_steps"] == 8, "two warm-up steps left out"
        assert "end" in r["a_end"] and "end" in r["b_end"], "both children stopped cleanly"
    slow, same = rows[0]["summary"], rows[1]["summary"]
    assert slow["ratio_of_medians"] == pytest.approx(1.1, abs=0.03)
    assert slow["ci95"][0] <= slow["ratio_of_medians"] <= slow["ci95"][1]
    assert same["ratio_of_medians"] == pytest.approx(1.0, abs=0.03)
    assert rows[0]["b_driver_s"][0] == 0.0 and rows[0]["a_driver_s"][0] is None
    # The self-test's host part is its whole step, so its ratio is the step's.
    assert len(rows[0]["a_launch_s"]) == 10
    assert slow["median_launch_ratio"] == pytest.approx(1.1, abs=0.03)
    assert "| selftest | 1 | native | gpumem |" in out.stdout


def test_lockstep_reports_a_child_that_fails(tmp_path):
    out, rows = run_lockstep(tmp_path, {"LOCKSTEP_SELFTEST_MS": "not a number"},
                             pairs="native:gpumem", steps=6)
    assert out.returncode == 1
    assert "the process ended" in rows[0]["error"] and "ValueError" in rows[0]["error"]
    assert "error:" in out.stdout


def test_lockstep_pins_threads_only_with_cpus(tmp_path):
    import os

    import subprocess
    import sys

    refused = subprocess.run([sys.executable, str(SCRIPTS / "lockstep_steps.py"), "--workloads",
                              "selftest", "--pin-threads", "--out", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--pin-threads needs --cpus" in refused.stderr
    cpu = str(min(os.sched_getaffinity(0)))
    out, rows = run_lockstep(tmp_path, {}, pairs="native:gpumem", steps=6,
                             extra=["--cpus", cpu, "--pin-threads"])
    assert out.returncode == 0, out.stderr
    assert rows[0]["pin_threads"] is True and rows[0]["cpus"] == cpu


def test_thread_cpus_are_given_only_when_asked(monkeypatch):
    import os

    bw = load("bench_workloads")
    monkeypatch.delenv("GPUMEM_BENCH_PIN_THREADS", raising=False)
    assert bw.thread_cpus() is None
    monkeypatch.setenv("GPUMEM_BENCH_PIN_THREADS", "1")
    assert bw.thread_cpus() == sorted(os.sched_getaffinity(0))


def test_lockstep_refuses_bad_pairs(tmp_path):
    for pairs, says in (("native:native", "native-again"), ("native:nosuch", "unknown allocator")):
        import subprocess
        import sys

        out = subprocess.run([sys.executable, str(SCRIPTS / "lockstep_steps.py"), "--workloads",
                              "selftest", "--pairs", pairs, "--out", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and says in out.stderr


def test_lockstep_pool_turns_both_orders_into_allocator_over_native(tmp_path, capsys):
    ls = load("lockstep_steps")

    def run(a, b, ta, tb):
        r = {"workload": "w", "a": a, "b": b, "warmup": 1, "a_step_s": ta, "b_step_s": tb}
        r["summary"] = ls.summarize(r, 1)
        return json.dumps(r)

    # gpumem 2 % slower than native in one run, 4 % in the other, whichever side it ran on;
    # the control's run and a run that failed (no summary) are kept apart or left out.
    lines = [
        run("native", "gpumem", [9.0, 1.0, 2.0, 3.0], [9.0, 1.02, 2.04, 3.06]),
        run("gpumem", "native", [9.0, 1.04, 2.08, 3.12], [9.0, 1.0, 2.0, 3.0]),
        run("native", "native-again", [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]),
        json.dumps({"workload": "w", "a": "native", "b": "gpumem", "error": "it failed"}),
    ]
    path = tmp_path / "lockstep.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = {r["allocator"]: r for r in ls.pool([path])}
    g = rows["gpumem"]
    assert g["runs"] == 2 and g["steps"] == 6 and g["orders"] == ["native first", "native second"]
    assert g["per_run_median_step_ratio"] == pytest.approx([1.02, 1.04])
    assert g["per_run_ratio_of_medians"] == pytest.approx([1.02, 1.04])
    lo, hi = g["runs_ci95"]
    # Mean 1.03, standard error 0.01 (two runs 0.02 apart), t = 12.706 at one degree of freedom.
    assert lo < 1.03 < hi and hi - lo == pytest.approx(2 * 12.706 * 0.01, rel=1e-6)
    assert rows["native-again"]["median_step_ratio"] == pytest.approx(1.0)
    assert rows["native-again"]["runs_ci95"] is None, "one run has no interval over runs"
    # Resampling whole runs: each draw pools two runs picked from {1.02, 1.04} (three steps
    # each), so its median is 1.02 or 1.04 when both picks agree and between them otherwise;
    # resampling steps alone gives a narrower interval around the pooled median.
    rlo, rhi = g["median_step_ratio_runs_ci95"]
    assert rlo == pytest.approx(1.02) and rhi == pytest.approx(1.04)
    slo, shi = g["median_step_ratio_ci95"]
    assert rlo <= slo <= shi <= rhi
    assert rows["native-again"]["median_step_ratio_runs_ci95"] is None
    # Each order's runs apart: native first read 1.02, native second 1.04.
    assert g["by_order"] == {"native first": pytest.approx([1.02]),
                             "native second": pytest.approx([1.04])}
    ls.print_pooled(list(rows.values()))
    printed = capsys.readouterr().out
    assert "w gpumem by order: native first: 1 run(s), mean 1.0200; native second: 1 run(s), mean 1.0400" in printed
    assert "native-again by order" not in printed, "one order has no line"


def test_lockstep_pool_gives_a_group_the_same_intervals_whatever_else_is_pooled(tmp_path):
    ls = load("lockstep_steps")

    def run(a, b, ta, tb):
        r = {"workload": "w", "a": a, "b": b, "warmup": 0, "a_step_s": ta, "b_step_s": tb}
        r["summary"] = ls.summarize(r, 0)
        return json.dumps(r)

    base = [1.0, 1.1, 0.9, 1.2, 0.95, 1.05, 1.15, 0.85]
    gpumem = [run("native", "gpumem", base, [x * (1 + 0.01 * i) for i, x in enumerate(base)]),
              run("gpumem", "native", [x * (1.03 - 0.005 * i) for i, x in enumerate(base)], base)]
    # "expandable" sorts before "gpumem": pooled first, it must not move gpumem's draws.
    other = [run("native", "expandable", base, [x * (1.1 + 0.02 * i) for i, x in enumerate(base)])]
    alone, mixed = tmp_path / "alone.jsonl", tmp_path / "mixed.jsonl"
    alone.write_text("\n".join(gpumem) + "\n")
    mixed.write_text("\n".join(other + gpumem) + "\n")
    a = {r["allocator"]: r for r in ls.pool([alone])}["gpumem"]
    m = {r["allocator"]: r for r in ls.pool([mixed])}
    assert set(m) == {"gpumem", "expandable"}
    assert m["gpumem"]["median_step_ratio_ci95"] == a["median_step_ratio_ci95"]
    assert m["gpumem"]["median_step_ratio_runs_ci95"] == a["median_step_ratio_runs_ci95"]
    lo, hi = a["median_step_ratio_ci95"]
    assert lo < hi, "the steps differ, so their interval has a width"


def test_gpumem_native_runs_ask_for_the_native_path_and_others_do_not(monkeypatch):
    bw = load("bench_workloads")
    monkeypatch.delenv("GPUMEM_TORCH_NATIVE", raising=False)
    assert bw.allocator_env("gpumem-native")["GPUMEM_TORCH_NATIVE"] == "1"
    assert bw.is_gpumem("gpumem-native")
    for other in ("gpumem", "gpumem-caching", "native"):
        assert "GPUMEM_TORCH_NATIVE" not in bw.allocator_env(other), other
    # Given by the caller, the choice reaches "gpumem" runs unchanged.
    monkeypatch.setenv("GPUMEM_TORCH_NATIVE", "1")
    assert bw.allocator_env("gpumem")["GPUMEM_TORCH_NATIVE"] == "1"


def test_lockstep_takes_gpumem_native_as_a_gpumem_side(tmp_path):
    # native.sh's pairs: the native-path name is known to lockstep and runs as a gpumem side.
    out, rows = run_lockstep(tmp_path, {"LOCKSTEP_SELFTEST_GPUMEM_FACTOR": "1.1"},
                             pairs="native:gpumem-native", steps=6)
    assert out.returncode == 0, out.stderr
    assert [(r["a"], r["b"]) for r in rows] == [("native", "gpumem-native")]
    assert rows[0]["summary"]["ratio_of_medians"] == pytest.approx(1.1, abs=0.04)
