#!/usr/bin/env python3
"""Step time of two allocators measured in lockstep on one GPU: each step's two times are
taken back to back, so the machine's drift cancels out of their ratio.

    python3 scripts/lockstep_steps.py --workloads gpt2_varlen --steps 64 \
        --pairs native:gpumem,native:native-again [--variant gpumem-flat=big_page:off]

Why: a step time ratio between two runs of a workload, one after the other, moves by up to
±15 % on the H200 machines this project is lent, PyTorch's allocator against itself included
(BENCHMARKS.md §3), so a 1 % target cannot be seen that way. Here both allocators' processes are
started side by side on the same GPU, each building the same seeded workload, and take turns:
the parent tells one to run a step (its kernels, then torch.cuda.synchronize), waits for its
time, then tells the other. The process not running waits on a pipe, so the GPU and the host's
cores serve one step at a time. The order alternates (A B, B A, A B, ...) so that neither side
always runs first. Each step i thus gives a pair (a_i, b_i) of the same work, taken within a
second of each other.

Reported per pair of allocators: each side's median over the timed steps (the first --warmup
left out), their ratio (the figure issue 5 asks for: median step time ÷ native's), the median of
the per-step ratios b_i / a_i, the ratio of total times, and 95 % intervals for the ratio of
medians and the median of step ratios from resampling the steps (paired, 2,000 draws). A pair with the same allocator on both
sides (native:native-again) is the control: its ratio shows what is left of the noise.

Both processes hold their memory on the GPU at once (GPT-2 with random lengths: 40 GiB under
PyTorch's allocator, 23 GiB under gpumem's), so the workload must fit twice. Each process also
reports its peak held and live bytes, and gpumem's processes the driver calls of each step, by
kind, with their host time (read between steps, outside the timed span). Every process also
reports each step's host part: the time until the step's work is queued, before it waits for
the GPU. With GPUMEM_BENCH_HOOK_TIME=1, gpumem's processes time every call PyTorch makes into
gpumem (about 45 ns per call of its own) and report them per step by hook.

Workloads and allocator names are those of scripts/bench_workloads.py (gpumem variants with
--variant NAME=CONF, as there). --cpus LIST runs both processes on the same CPUs; for a
workload that runs on one host thread, give one CPU (--cpus 4): the two processes then take
turns on the same virtual CPU, whose speed on a shared host is its own (the prefetch pipeline's
runs spread by 0.56 % each so, against about 2.6 % over CPUs 4-7 on other machines;
BENCHMARKS.md §3, session 33). Results: a
table on stdout (last), JSON lines in $OUT/lockstep.jsonl (or --out DIR). Runs in both orders
(native:gpumem and gpumem:native), and from several calls, are pooled per workload and
allocator with `--pool FILE...`: every step's ratio of the allocator's time over native's. The
pooled median's interval is given twice: resampling steps, and resampling whole runs (runs of
one workload differ by more than their steps say; the second is the one to judge a target by).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_workloads as bw  # noqa: E402  (same folder: the workloads and allocator names)

STEP_TIMEOUT_S = 180.0
BOOTSTRAP_DRAWS = 2000
RUN_BOOTSTRAP_DRAWS = 1000


# --------------------------------------------------------------------------------------------
# Child: one workload under one allocator, one step per "go" line on stdin.
# --------------------------------------------------------------------------------------------


def child(args) -> None:
    # The replies go through a copy of stdout; anything a library prints goes to stderr (the
    # log), so it cannot be taken for a reply.
    global REPLIES
    REPLIES = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.cpus:
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    if args.workload == SELFTEST:
        return selftest_child(args)
    import torch

    gm = None
    if bw.is_gpumem(args.allocator):
        import gpumem as gm

        gm.torch.install()  # GPUMEM_CONF from the parent for variants
    # GPUMEM_BENCH_HOOK_TIME=1: gpumem's own host time per step (bench_workloads.py's clock,
    # about 45 ns per call of its own).
    hooks = gm is not None and os.environ.get("GPUMEM_BENCH_HOOK_TIME") == "1"
    if hooks:
        gm.torch.time_hooks(True)
    torch.cuda.init()
    torch.cuda.synchronize()
    say({"ready": True, "pid": os.getpid(), "backend": torch.cuda.get_allocator_backend()})
    steps = bw.make_workload(torch, args.workload, args.steps, args.batch)
    while sys.stdin.readline().strip() == "go":
        before = gm.torch.driver_calls() if gm else None
        before_hooks = gm.torch.hook_time() if hooks else None
        t = time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            say({"error": "the workload ended early"})
            return
        # The host's part of the step: its kernels queued, before waiting for the GPU. Where
        # the GPU waits for the host (small steps), a difference here is a difference in step.
        launched = time.perf_counter() - t
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        msg = {"s": dt, "launch_s": launched}
        if gm:
            # The step's calls by kind, [calls, host seconds], and their seconds in all.
            (msg["driver"],) = bw.step_deltas([before, gm.torch.driver_calls()])
            msg["driver_s"] = sum(secs for _, secs in msg["driver"].values())
        if hooks:
            # PyTorch's calls into gpumem by hook, [calls, host seconds].
            (msg["hooks"],) = bw.step_deltas([before_hooks, gm.torch.hook_time()])
        say(msg)
    stats = torch.cuda.memory_stats()
    end = {"end": True, "peak_held": stats.get("reserved_bytes.all.peak"),
           "requested_peak": stats.get("requested_bytes.all.peak"),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if gm:
        end["gpumem_conf"] = gm.torch.conf()
        end["gpumem_errors"] = gm.torch.error_counts()
    say(end)


# A workload without torch or a GPU, to check the lockstep itself (tests/python): each step
# sleeps LOCKSTEP_SELFTEST_MS milliseconds, times LOCKSTEP_SELFTEST_GPUMEM_FACTOR under a gpumem
# name.
SELFTEST = "selftest"


def selftest_child(args) -> None:
    base = float(os.environ.get("LOCKSTEP_SELFTEST_MS", "20")) / 1e3
    if bw.is_gpumem(args.allocator):
        base *= float(os.environ.get("LOCKSTEP_SELFTEST_GPUMEM_FACTOR", "1"))
    say({"ready": True, "pid": os.getpid(), "backend": "selftest"})
    done = 0
    while sys.stdin.readline().strip() == "go":
        if done == args.steps:
            say({"error": "the workload ended early"})
            return
        t = time.perf_counter()
        time.sleep(base)
        done += 1
        dt = time.perf_counter() - t
        say({"s": dt, "launch_s": dt, "driver_s": 0.0 if bw.is_gpumem(args.allocator) else None})
    say({"end": True, "peak_held": None, "requested_peak": None})


REPLIES = sys.stdout


def parse_cpus(text: str) -> set:
    """'4-7,9' -> {4, 5, 6, 7, 9}."""
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def say(obj) -> None:
    REPLIES.write(json.dumps(obj) + "\n")
    REPLIES.flush()


# --------------------------------------------------------------------------------------------
# Parent: two children in lockstep.
# --------------------------------------------------------------------------------------------


class Side:
    """One child process and its replies."""

    def __init__(self, allocator: str, workload: str, steps: int, batch, log: Path, cpus=None,
                 pin_threads=False):
        env = bw.allocator_env(allocator)
        if pin_threads:
            env["GPUMEM_BENCH_PIN_THREADS"] = "1"
        cmd = [sys.executable, __file__, "--child", "--allocator", allocator, "--workload",
               workload, "--steps", str(steps)]
        if batch:
            cmd += ["--batch", str(batch)]
        if cpus:
            cmd += ["--cpus", cpus]
        self.name = allocator
        self.log = log
        self.err = open(log, "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, env=env, bufsize=0)
        self.fd = self.p.stdout.fileno()
        self.buf = b""

    def read(self, timeout=STEP_TIMEOUT_S) -> dict:
        """The child's next reply (one JSON line), read from the pipe's descriptor itself so
        that a line already buffered is never missed by select."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(0.0, left))
            if not ready:
                raise RuntimeError(f"{self.name}: no reply within {timeout:.0f} s (log: {self.log})")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.p.wait(timeout=10)
                lines = self.log.read_text().strip().splitlines() if self.log.exists() else []
                last = lines[-1] if lines else "no output"
                raise RuntimeError(f"{self.name}: the process ended (rc {self.p.returncode}): "
                                   f"{last} (log: {self.log})")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.name}: {msg['error']}")
        return msg

    def send(self, cmd: str) -> None:
        self.p.stdin.write((cmd + "\n").encode())

    def close(self) -> dict:
        end = {}
        try:
            self.send("stop")
            end = self.read(timeout=60)
        except (RuntimeError, BrokenPipeError, OSError) as e:
            end = {"close_error": str(e)}
        try:
            self.p.stdin.close()
            self.p.wait(timeout=30)
        except (subprocess.TimeoutExpired, OSError):
            self.p.kill()
        self.err.close()
        return end


def run_pair(workload, a_name, b_name, steps, batch, log_dir: Path, cpus=None,
             pin_threads=False) -> dict:
    tag = f"{workload}.{a_name}.{b_name}.{int(time.time())}"
    a = Side(a_name, workload, steps, batch, log_dir / f"{tag}.a.log", cpus, pin_threads)
    b = Side(b_name, workload, steps, batch, log_dir / f"{tag}.b.log", cpus, pin_threads)
    sides = (a, b)
    out = {"workload": workload, "a": a_name, "b": b_name, "steps": steps, "batch": batch,
           "cpus": cpus, "pin_threads": pin_threads}
    try:
        for s in sides:
            s.read(timeout=300)  # ready: CUDA initialised
        keys = {"step_s": "s", "launch_s": "launch_s", "driver_s": "driver_s",
                "driver_calls": "driver", "hooks": "hooks"}
        got = [{k: [] for k in keys}, {k: [] for k in keys}]
        ta, tb = got[0]["step_s"], got[1]["step_s"]
        for i in range(steps):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for k in order:
                s = sides[k]
                s.send("go")
                msg = s.read()
                for key, field in keys.items():
                    got[k][key].append(msg.get(field))
            if (i + 1) % 8 == 0 or i + 1 == steps:
                print(f"  {workload} {a_name}:{b_name} step {i + 1}/{steps}: "
                      f"{ta[-1] * 1e3:.1f} / {tb[-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        for side, g in zip("ab", got):
            out.update({f"{side}_{key}": v for key, v in g.items()})
    except (RuntimeError, OSError) as e:  # OSError: a child gone before it read its "go"
        out["error"] = str(e)
    out["a_end"] = a.close()
    out["b_end"] = b.close()
    return out


def interval(draws) -> list:
    """The central 95 % of bootstrap draws: [low, high]."""
    xs = sorted(draws)
    return [xs[int(0.025 * len(xs))], xs[int(0.975 * len(xs)) - 1]]


def summarize(r: dict, warmup: int) -> dict:
    ta, tb = r["a_step_s"][warmup:], r["b_step_s"][warmup:]
    ma, mb = statistics.median(ta), statistics.median(tb)
    ratios = [y / x for x, y in zip(ta, tb)]
    rng = random.Random(1)
    n = len(ta)
    boot, boot_steps = [], []
    for _ in range(BOOTSTRAP_DRAWS):
        idx = [rng.randrange(n) for _ in range(n)]
        boot.append(statistics.median(tb[i] for i in idx) / statistics.median(ta[i] for i in idx))
        boot_steps.append(statistics.median(ratios[i] for i in idx))

    return {
        "timed_steps": n,
        "a_median_s": ma, "b_median_s": mb, "ratio_of_medians": mb / ma,
        "ci95": interval(boot),
        # Where steps differ in length (random sequence lengths), the median step of each side
        # may be a different step from one resample to the next; the step-by-step ratio
        # compares the same work and is the steadier figure there.
        "median_step_ratio": statistics.median(ratios),
        "median_step_ratio_ci95": interval(boot_steps),
        "geomean_step_ratio": statistics.geometric_mean(ratios),
        "ratio_of_totals": sum(tb) / sum(ta),
        "b_driver_ms_per_step": b_driver_ms(r.get("b_driver_s"), warmup),
        # The host's part of each step (queuing its work), B over A, step by step: where it
        # moves with the step ratio, the difference is host work.
        "median_launch_ratio": median_ratio(r.get("a_launch_s"), r.get("b_launch_s"), warmup),
    }


def median_ratio(a, b, warmup):
    """Median over the timed steps of b_i / a_i; None where a run did not record them."""
    pairs = [(x, y) for x, y in zip((a or [])[warmup:], (b or [])[warmup:])
             if x is not None and y is not None and x > 0]
    return statistics.median(y / x for x, y in pairs) if pairs else None


def b_driver_ms(driver_s, warmup):
    """B's driver milliseconds per timed step, if B reported them (gpumem does)."""
    timed = [d for d in (driver_s or [])[warmup:] if d is not None]
    return statistics.mean(timed) * 1e3 if timed else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--allocator", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--workloads", default="gpt2_varlen",
                    help=f"comma-separated, of: {', '.join(bw.WORKLOADS)}")
    ap.add_argument("--pairs", default="native:gpumem,native:native-again",
                    help="comma-separated A:B pairs; ratios are B / A")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per run (default: bench_workloads.py's, at least 16)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps left out of the figures (default: bench_workloads.py's)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: the workload's)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every pair")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=CONF",
                    help="a gpumem configuration under a name starting with gpumem-")
    ap.add_argument("--cpus", default=None, metavar="LIST",
                    help="run both processes on these CPUs (e.g. 4-7): then a difference in "
                         "where each was scheduled cannot favour one side")
    ap.add_argument("--pin-threads", action="store_true",
                    help="with --cpus: a multi-threaded workload (serve_threads) pins its thread "
                         "i to the i-th of those CPUs in both processes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the results")
    ap.add_argument("--pool", nargs="+", metavar="JSONL",
                    help="run nothing: pool the runs of these lockstep.jsonl files per workload "
                         "and allocator over native, both orders together")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    if args.pool:
        print_pooled(pool(args.pool))
        return 0
    for v in args.variant:
        name, _, conf = v.partition("=")
        if not name.startswith("gpumem-") or not conf:
            ap.error(f"--variant {v!r}: expected gpumem-NAME=CONF")
        bw.GPUMEM_VARIANTS[name] = conf
    known = set(bw.ALLOC_ENV) | set(bw.GPUMEM_VARIANTS) | {bw.GPUMEM_NATIVE}
    pairs = []
    for p in args.pairs.split(","):
        a, _, b = p.partition(":")
        for x in (a, b):
            if x not in known:
                ap.error(f"--pairs: unknown allocator {x!r} (known: {', '.join(sorted(known))})")
        if a == b:
            ap.error(f"--pairs {p}: name the control native-again, not twice the same")
        pairs.append((a, b))
    if args.cpus:
        try:
            if not parse_cpus(args.cpus) <= os.sched_getaffinity(0):
                ap.error(f"--cpus {args.cpus}: not all of them are available here")
        except ValueError:
            ap.error(f"--cpus {args.cpus!r}: expected a list like 4-7,9")
    if args.pin_threads and not args.cpus:
        ap.error("--pin-threads needs --cpus: the CPUs to pin the threads to")
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in bw.WORKLOADS and w != SELFTEST:
            ap.error(f"unknown workload {w!r}")
    out_dir = Path(args.out)
    log_dir = out_dir / "lockstep_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "lockstep.jsonl"
    rows = []
    with open(jsonl, "a") as f:
        for rnd in range(args.repeat):
            for w in workloads:
                spec = bw.WORKLOADS.get(w, {"steps": 16, "warmup": 2})
                steps = args.steps or max(16, spec["steps"])
                warmup = spec["warmup"] if args.warmup is None else args.warmup
                if steps - warmup < 4:
                    ap.error(f"{w}: {steps} steps leave fewer than 4 timed after {warmup} warm-up")
                for a, b in pairs:
                    print(f"round {rnd + 1}: {w}, {a} and {b} in lockstep, {steps} steps",
                          file=sys.stderr, flush=True)
                    r = run_pair(w, a, b, steps, args.batch, log_dir, args.cpus,
                                 args.pin_threads)
                    r["round"] = rnd + 1
                    r["warmup"] = warmup
                    if "error" not in r:
                        r["summary"] = summarize(r, warmup)
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    rows.append(r)
    print_table(rows)
    return 1 if any("error" in r for r in rows) else 0


def pool(paths) -> list:
    """Every run of the JSON lines files `paths`, pooled per workload and allocator, whichever
    side of its pair it ran on: each step's ratio is the allocator's time over PyTorch's
    (native) time at that step. Returns rows of figures (see `print_pooled`)."""
    runs = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if "summary" not in r:
                continue
            w = r["warmup"]
            ta, tb = r["a_step_s"][w:], r["b_step_s"][w:]
            if r["a"] == "native":
                name, ratios, rom = r["b"], [y / x for x, y in zip(ta, tb)], r["summary"]["ratio_of_medians"]
            elif r["b"] == "native":
                name, ratios, rom = r["a"], [x / y for x, y in zip(ta, tb)], 1 / r["summary"]["ratio_of_medians"]
            else:
                continue
            order = "native first" if r["a"] == "native" else "native second"
            runs.setdefault((r["workload"], name), []).append((ratios, rom, order))
    rows = []
    for (workload, name), rs in sorted(runs.items()):
        # A generator per group, so that a group's intervals do not depend on what else is pooled.
        rng = random.Random(1)
        steps = [x for ratios, _, _ in rs for x in ratios]
        n = len(steps)
        boot = [statistics.median(steps[rng.randrange(n)] for _ in range(n))
                for _ in range(BOOTSTRAP_DRAWS)]
        # Resampling whole runs (a cluster bootstrap) keeps each run's own level, which the
        # steps' resampling treats as if every step were drawn afresh: the honest interval of
        # the pooled median for "this workload, run again". Fewer draws: each draw is a median
        # over all the steps.
        m = len(rs)
        run_boot = [statistics.median([x for _ in range(m) for x in rs[rng.randrange(m)][0]])
                    for _ in range(RUN_BOOTSTRAP_DRAWS)] if m > 1 else None
        medians = [statistics.median(x) for x, _, _ in rs]
        orders = sorted({o for _, _, o in rs})
        rows.append({
            "workload": workload, "allocator": name, "runs": len(rs), "steps": n,
            "orders": orders,
            "median_step_ratio": statistics.median(steps),
            "median_step_ratio_ci95": interval(boot),
            "median_step_ratio_runs_ci95": interval(run_boot) if run_boot else None,
            "per_run_median_step_ratio": medians,
            # Runs differ by more than their steps say (each pair of processes has its own
            # placement in memory and on the host): the interval over runs is the honest one
            # for "a run of this workload".
            "runs_ci95": run_interval(medians),
            "per_run_ratio_of_medians": [m for _, m, _ in rs],
            "geomean_ratio_of_medians": statistics.geometric_mean([m for _, m, _ in rs]),
            # Per order, the runs' medians of step ratios: an allocator that pays for going
            # first or second (a warmer page cache, the other process's growth) shows here.
            "by_order": {o: [md for md, (_, _, oo) in zip(medians, rs) if oo == o] for o in orders},
        })
    return rows


# Two-sided 95 % quantiles of Student's t, by degrees of freedom (1-10; 2.0 beyond).
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def run_interval(xs):
    """95 % interval of the mean of per-run figures `xs` (Student's t); None for one run."""
    if len(xs) < 2:
        return None
    m = statistics.mean(xs)
    half = (T95[len(xs) - 2] if len(xs) - 1 <= len(T95) else 2.0) * statistics.stdev(xs) / len(xs) ** 0.5
    return [m - half, m + half]


def print_pooled(rows) -> None:
    print("| workload | allocator ÷ native | runs (orders) | steps | median of step ratios (95 % CI "
          "over steps; over runs) | per run (mean, 95 % CI over runs) "
          "| ratio of medians, per run (geometric mean) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["median_step_ratio_ci95"]
        ci = f"{lo:.4f}–{hi:.4f}"
        if r.get("median_step_ratio_runs_ci95"):
            rlo, rhi = r["median_step_ratio_runs_ci95"]
            ci += f"; {rlo:.4f}–{rhi:.4f}"
        per_run = ", ".join(f"{x:.4f}" for x in r["per_run_median_step_ratio"])
        if r["runs_ci95"]:
            a, b = r["runs_ci95"]
            per_run += f" ({statistics.mean(r['per_run_median_step_ratio']):.4f}, {a:.4f}–{b:.4f})"
        rom = ", ".join(f"{x:.4f}" for x in r["per_run_ratio_of_medians"])
        print(f"| {r['workload']} | {r['allocator']} | {r['runs']} ({len(r['orders'])}) | {r['steps']} "
              f"| {r['median_step_ratio']:.4f} ({ci}) | {per_run} "
              f"| {rom} ({r['geomean_ratio_of_medians']:.4f}) |")
    # By order, under the table: mean of the runs' medians of step ratios, with its standard
    # error where there are two runs or more.
    for r in rows:
        parts = []
        for order, xs in r.get("by_order", {}).items():
            part = f"{order}: {len(xs)} run(s), mean {statistics.mean(xs):.4f}"
            if len(xs) > 1:
                part += f" ± {statistics.stdev(xs) / len(xs) ** 0.5:.4f}"
            parts.append(part)
        if len(parts) > 1:
            print(f"{r['workload']} {r['allocator']} by order: " + "; ".join(parts))


def gib(x):
    return f"{x / (1 << 30):.3f}" if x else "-"


def print_table(rows) -> None:
    print()
    print("| workload | round | A | B | A median ms | B median ms | B/A medians (95 % CI) "
          "| median of step ratios (95 % CI) | B/A totals | B/A host part | B driver ms/step "
          "| held A / B GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['workload']} | {r.get('round')} | {r['a']} | {r['b']} | error: "
                  f"{r['error'][:300]} |")
            continue
        s = r["summary"]
        drv = f"{s['b_driver_ms_per_step']:.2f}" if s["b_driver_ms_per_step"] is not None else "-"
        launch = s.get("median_launch_ratio")
        launch = f"{launch:.4f}" if launch is not None else "-"
        print(f"| {r['workload']} | {r['round']} | {r['a']} | {r['b']} "
              f"| {s['a_median_s'] * 1e3:.1f} | {s['b_median_s'] * 1e3:.1f} "
              f"| {s['ratio_of_medians']:.4f} ({s['ci95'][0]:.4f}–{s['ci95'][1]:.4f}) "
              f"| {s['median_step_ratio']:.4f} ({s['median_step_ratio_ci95'][0]:.4f}–"
              f"{s['median_step_ratio_ci95'][1]:.4f}) | {s['ratio_of_totals']:.4f} | {launch} | {drv} "
              f"| {gib(r['a_end'].get('peak_held'))} / {gib(r['b_end'].get('peak_held'))} |")


if __name__ == "__main__":
    sys.exit(main())
