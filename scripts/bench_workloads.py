#!/usr/bin/env python3
"""Real PyTorch workloads under four allocators, side by side, in one run.

    python3 scripts/bench_workloads.py                 # everything (12-13 minutes on an H200)
    python3 scripts/bench_workloads.py --workloads gpt2_train,prefetch_mlp --no-maxbatch

Each workload runs in a fresh process per allocator:

    native            PyTorch's caching allocator
    expandable        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    cudaMallocAsync   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
    gpumem            gpumem.torch.install() (GPUMEM_CONF, default policy stitched)
    gpumem-caching    gpumem with policy:caching (no virtual-memory calls), to tell the cost
                      of the stitched policy's mapping apart from the rest (opt-in;
                      --variant NAME=CONF adds others)
    gpumem-native     gpumem as a CUDAAllocator of its own (install(native=True)) instead of
                      behind PyTorch's CUDAPluggableAllocator (opt-in; built on first use)
    native-again      PyTorch's caching allocator once more (opt-in): an A/A control whose
                      step-time ratio to native is the noise of that figure on this machine

--repeat N runs every (workload, allocator) pair N times, interleaved (all allocators once,
then again), and reports each step-time ratio against the same round's native run, with the
median over rounds: the spread between rounds says how much of a difference is noise.

Workloads (models built from configs, nothing downloaded; the shapes of shared/anchors/wl.py,
the Llama model built in bfloat16 directly on the GPU): GPT-2 small training at sequence 1024 (gpt2_train) and at a random
sequence length 64-1024 per step (gpt2_varlen), ResNet-50 training (resnet50_train), a
Llama-style decoder generating 96 tokens for prompts of random length and batch
(llama_decode), an MLP fed by a two-stream prefetch pipeline using record_stream
(prefetch_mlp), and an inference server whose four threads each serve requests of random size
on their own stream (serve_threads; added after ANCHORS.md, so it has no published anchor).
Everything is seeded, so every allocator is asked for the same tensors.

Reported per workload and allocator:

- peak held: the most memory the allocator held from the driver. native and expandable:
  reserved_bytes.all.peak; cudaMallocAsync: the default memory pool's
  CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH (driver API, ctypes); gpumem: its reserved_bytes.all.peak.
  Cross-check: the device's used memory (cuMemGetInfo) at step boundaries, less the value
  before the workload (a lower bound that also counts CUDA libraries' own memory).
- peak live: requested_bytes.all.peak of the *native* run (the sizes the tensors asked for),
  the common denominator of every allocator's ratio.
- ratio = peak held / peak live, and the median step time (warm-up steps excluded) divided by
  native's.

Then, for gpt2_varlen, the largest batch that fits under a fixed cap (--cap-gib, 20 GiB) with
each allocator: binary search, one process per probe (the allocators' probes run side by side,
each capped with torch.cuda.set_per_process_memory_fraction); a probe fits when it raises no
out-of-memory error and its peak held stayed under the cap (cudaMallocAsync enforces the
fraction on live bytes only, so its held peak is checked afterwards).

Results: a table on stdout (last), JSON lines in $OUT/bench_workloads.jsonl (or --out).
With GPUMEM_BENCH_STEP_CALLS=1, gpumem's runs also record the driver calls of every step
(gpumem_step_driver_calls: per step, {call: [count, host seconds]}), to set each step's time
beside them; reading them after every step costs a little host time, so it is off by default.
With GPUMEM_BENCH_STEP_SPLIT=1, every run records where each step's time went (step_split:
host launch time, the thread's CPU time, the wait in synchronize, the GPU's span;
scripts/step_driver_time.py sets them beside native's).
With GPUMEM_BENCH_KERNEL_TIME=1, every run records the GPU time of its timed steps' kernels,
copies and memsets (torch.profiler, CUDA activity only, started after the warm-up steps): the
total per step and the largest entries by name (kernel_time); scripts/kernel_time.py sets them
beside native's. That asks whether the same kernels run slower on one allocator's memory,
without the drift of step time; the profiler adds host time, so such runs' step times are not
comparable with unprofiled ones.
With GPUMEM_BENCH_HOOK_TIME=1, gpumem's runs time every call PyTorch makes into gpumem
(gpumem.torch.time_hooks(): allocations, frees and record_stream, driver calls included) and
record, per step, the calls and host seconds inside them (gpumem_step_hooks) and their mean
over the timed steps (gpumem_hook_s_per_step): all the host time gpumem itself adds to a step.
With GPUMEM_BENCH_SNAPSHOT_DIR=DIR, each gpumem run also writes its snapshot there (with its
allocation history if GPUMEM_CONF has history:N).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GIB = 1 << 30

ALLOCATORS = ["native", "expandable", "cudaMallocAsync", "gpumem"]
# Opt-in: PyTorch's own allocator a second time in each round, an A/A control. Its step-time
# ratio to native is this machine's noise on that figure (nothing differs but the run).
CONTROLS = ["native-again"]
ALLOC_ENV = {
    "native": None,
    "native-again": None,
    "expandable": "expandable_segments:True",
    "cudaMallocAsync": "backend:cudaMallocAsync",
    "gpumem": None,
}
# gpumem configurations runnable by name (GPUMEM_CONF syntax); "gpumem" uses the environment's.
GPUMEM_VARIANTS = {"gpumem-caching": "policy:caching"}
# Opt-in: gpumem plugged in as a CUDAAllocator of its own (install(native=True), through
# GPUMEM_TORCH_NATIVE) instead of through PyTorch's CUDAPluggableAllocator, with the
# environment's configuration. "gpumem" follows GPUMEM_TORCH_NATIVE as set by the caller.
GPUMEM_NATIVE = "gpumem-native"


def is_gpumem(allocator: str) -> bool:
    # By name: a child process does not see the parent's --variant list (its GPUMEM_CONF comes
    # through the environment), so every "gpumem-*" name is gpumem.
    return allocator == "gpumem" or allocator.startswith("gpumem-")

# Steps per workload and warm-up steps left out of the median step time.
WORKLOADS = {
    "gpt2_train": {"steps": 6, "warmup": 2},
    "gpt2_varlen": {"steps": 16, "warmup": 2},
    "resnet50_train": {"steps": 8, "warmup": 2},
    "llama_decode": {"steps": 6, "warmup": 1},
    "prefetch_mlp": {"steps": 30, "warmup": 3},
    "serve_threads": {"steps": 24, "warmup": 4},
}

# ANCHORS.md §1: held / live of PyTorch's three allocators on these workloads (H200, wl.py).
ANCHOR_RATIOS = {
    "gpt2_train": {"native": 1.034, "expandable": 1.097, "cudaMallocAsync": 1.084},
    "gpt2_varlen": {"native": 1.722, "expandable": 1.071, "cudaMallocAsync": 1.088},
    "resnet50_train": {"native": 1.127, "expandable": 1.007, "cudaMallocAsync": 1.014},
    "llama_decode": {"native": 1.178, "expandable": 1.018, "cudaMallocAsync": 1.087},
    "prefetch_mlp": {"native": 1.277, "expandable": 1.072, "cudaMallocAsync": 1.106},
}

MAXBATCH_WORKLOAD = "gpt2_varlen"
MAXBATCH_STEPS = 6


# --------------------------------------------------------------------------------------------
# Child side: one workload under one allocator.
# --------------------------------------------------------------------------------------------


def gpt2_steps(torch, dev, steps, batch, lengths):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i in range(steps):
        x = torch.randint(0, 50257, (batch, lengths[i]), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def resnet_steps(torch, dev, steps, batch=128):
    import torchvision

    model = torchvision.models.resnet50(weights=None).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        x = torch.randn(batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def llama_steps(torch, dev, steps, rng):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096,
    )
    # Built in bfloat16 directly on the GPU: initializing 1.2 B parameters on the CPU takes
    # longer than the decoding itself, and every allocator sees the same requests either way.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for _ in range(steps):
            batch = rng.choice([1, 2, 4, 8])
            prompt = rng.randint(64, 2048)
            x = torch.randint(1, 32000, (batch, prompt), device=dev)
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=96,
                           min_new_tokens=96, do_sample=False)
            yield


def prefetch_steps(torch, dev, steps, rng):
    """Input batches copied host-to-device on a side stream, consumed on the main stream."""
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    # Pinned host batches made once, as a data loader's workers would have them ready: drawing
    # up to 32 MiB of random numbers on the host inside the step took longer than the step's
    # GPU work and made the step time measure the host's RNG instead of the pipeline.
    g = torch.Generator().manual_seed(0)
    host_batches = {n: torch.randn(n, 4096, generator=g).pin_memory() for n in (256, 512, 1024, 2048)}

    def load():
        host = host_batches[rng.choice([256, 512, 1024, 2048])]
        with torch.cuda.stream(side):
            return host.to(dev, non_blocking=True)

    nxt = load()
    for _ in range(steps):
        main.wait_stream(side)
        x = nxt
        x.record_stream(main)
        nxt = load()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x
        yield


def thread_cpus():
    """With GPUMEM_BENCH_PIN_THREADS=1 (scripts/lockstep_steps.py --pin-threads), the CPUs the
    process may run on, in order, for a multi-threaded workload to pin its thread i to the
    i-th of them (two processes pinned to the same CPUs then run each thread's work on the same
    CPU); otherwise None."""
    if os.environ.get("GPUMEM_BENCH_PIN_THREADS") != "1":
        return None
    return sorted(os.sched_getaffinity(0))


def serve_steps(torch, dev, steps, rng):
    """The inference server of scripts/record_trace.py (serve_threads): four threads, each on
    its own CUDA stream, serving two requests of random size per step, drawn from `rng`."""
    from record_trace import serve_threads  # same folder; imports torch, as this process has

    return serve_threads(steps, dev, [random.Random(rng.random()) for _ in range(4)],
                         pin=thread_cpus())


def varlen_lengths(steps, rng):
    return [rng.randint(64, 1024) for _ in range(steps)]


def make_workload(torch, name, steps, batch=None):
    dev = torch.device("cuda")
    rng = random.Random(0)
    torch.manual_seed(0)
    if name == "gpt2_train":
        return gpt2_steps(torch, dev, steps, batch or 16, [1024] * steps)
    if name == "gpt2_varlen":
        if batch is None:
            lengths = varlen_lengths(steps, rng)
        else:
            # Max-batch probes: the same random lengths for every batch size, ending with the
            # longest sequence, so the cap is tested after the layout has been churned.
            lengths = varlen_lengths(steps - 1, rng) + [1024]
        return gpt2_steps(torch, dev, steps, batch or 16, lengths)
    if name == "resnet50_train":
        return resnet_steps(torch, dev, steps, batch or 128)
    if name == "llama_decode":
        return llama_steps(torch, dev, steps, rng)
    if name == "prefetch_mlp":
        return prefetch_steps(torch, dev, steps, rng)
    if name == "serve_threads":
        return serve_steps(torch, dev, steps, rng)
    raise SystemExit(f"unknown workload {name}")


class DriverPool:
    """The CUDA driver's default memory pool of device 0, read through ctypes (what
    backend:cudaMallocAsync allocates from)."""

    RESERVED_MEM_HIGH = 6  # CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
    USED_MEM_HIGH = 8  # CU_MEMPOOL_ATTR_USED_MEM_HIGH

    def __init__(self, ordinal: int = 0):
        import ctypes

        self.ct = ctypes
        self.cuda = ctypes.CDLL("libcuda.so.1")
        dev = ctypes.c_int()
        self._check(self.cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        self.pool = ctypes.c_void_p()
        self._check(self.cuda.cuDeviceGetDefaultMemPool(ctypes.byref(self.pool), dev), "cuDeviceGetDefaultMemPool")

    @staticmethod
    def _check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    def attribute(self, attr: int) -> int:
        value = self.ct.c_uint64()
        self._check(self.cuda.cuMemPoolGetAttribute(self.pool, attr, self.ct.byref(value)), "cuMemPoolGetAttribute")
        return int(value.value)


def kernel_totals(torch, prof, steps, top=40):
    """GPU time of what `prof` saw run on the device (kernels, copies, memsets), per step:
    {"steps", "us_per_step", "events_per_step", "by_name": [[name, count, total µs], ...]}
    with the `top` largest names by total time."""
    by_name = {}
    total = 0.0
    n = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        total += us
        n += 1
        c = by_name.setdefault(e.name, [0, 0.0])
        c[0] += 1
        c[1] += us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"steps": steps, "us_per_step": total / steps, "events_per_step": n / steps,
            "by_name": [[name, c, round(us, 1)] for name, (c, us) in ranked]}


def step_deltas(snaps):
    """From cumulative readings taken after each step ({kind: {"calls", "seconds", ...}}, the
    first one the baseline): per step, {kind: [calls, seconds]} of the kinds called in it."""
    return [{k: [v["calls"] - a.get(k, {}).get("calls", 0), v["seconds"] - a.get(k, {}).get("seconds", 0.0)]
             for k, v in b.items() if v["calls"] > a.get(k, {}).get("calls", 0)}
            for a, b in zip(snaps, snaps[1:])]


def child(args) -> None:
    import torch

    if is_gpumem(args.allocator):
        import gpumem

        gpumem.torch.install()  # GPUMEM_CONF, set by the parent for variants
        if os.environ.get("GPUMEM_BENCH_HOOK_TIME") == "1":
            gpumem.torch.time_hooks(True)
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    if args.cap_bytes:
        torch.cuda.set_per_process_memory_fraction(args.cap_bytes / total, 0)
    free0, _ = torch.cuda.mem_get_info()
    used_peak = used0 = total - free0
    spec = WORKLOADS[args.workload]
    steps = args.steps or spec["steps"]
    out = {
        "workload": args.workload, "allocator": args.allocator, "batch": args.batch,
        "cap_bytes": args.cap_bytes, "steps": steps, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0), "backend": torch.cuda.get_allocator_backend(),
    }
    times = []
    oom = None
    calls_after_warmup = None
    # GPUMEM_BENCH_STEP_CALLS=1: gpumem's driver calls after every step, to set each step's
    # time beside its driver calls (off by default: reading them costs host time).
    step_calls = None
    if is_gpumem(args.allocator) and os.environ.get("GPUMEM_BENCH_STEP_CALLS") == "1":
        import gpumem

        step_calls = []
    # GPUMEM_BENCH_STEP_SPLIT=1: where each step's time goes. launch: host time until the
    # step's last kernel is queued (its allocations included); cpu: the thread's CPU time in
    # that span (less than launch when the thread was descheduled or waited); wait: the rest,
    # in torch.cuda.synchronize (the GPU still busy); gpu: the GPU's span from an event at the
    # step's start to one after its last kernel. A step slower by the same launch and cpu but
    # a longer wait ran slower on the GPU; by a longer launch and cpu, did more host work; by
    # a longer launch at the same cpu, ran on a slower or busier host.
    split = [] if os.environ.get("GPUMEM_BENCH_STEP_SPLIT") == "1" else None
    # GPUMEM_BENCH_HOOK_TIME=1: gpumem's hook totals after every step (see the docstring).
    step_hooks = None
    if is_gpumem(args.allocator) and os.environ.get("GPUMEM_BENCH_HOOK_TIME") == "1":
        import gpumem

        step_hooks = [gpumem.torch.hook_time()]

    # GPUMEM_BENCH_KERNEL_TIME=1: the profiler, started once the warm-up steps are done.
    kernel_prof = None
    want_kernels = os.environ.get("GPUMEM_BENCH_KERNEL_TIME") == "1"

    def split_mark():
        """(the thread's CPU time, an event recorded now): one end of a step's split."""
        cpu = time.thread_time()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return cpu, ev

    t = time.perf_counter()
    if split is not None:
        cpu0, ev0 = split_mark()
    try:
        for _ in make_workload(torch, args.workload, steps, args.batch):
            if split is not None:
                launched = time.perf_counter()
                cpu1, ev1 = split_mark()
            torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - t)
            if split is not None:
                split.append({"launch": launched - t, "cpu": cpu1 - cpu0, "wait": now - launched,
                              "gpu": ev0.elapsed_time(ev1) / 1000.0})
            if len(times) == spec["warmup"]:
                if is_gpumem(args.allocator):
                    import gpumem

                    calls_after_warmup = gpumem.torch.driver_calls()
                if want_kernels:
                    kernel_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    kernel_prof.start()
            if step_calls is not None:
                # Outside the timed span: the step's clock restarts below.
                step_calls.append(gpumem.torch.driver_calls())
            if step_hooks is not None:
                step_hooks.append(gpumem.torch.hook_time())  # outside the timed span too
            free, _ = torch.cuda.mem_get_info()
            used_peak = max(used_peak, total - free)
            t = time.perf_counter()
            if split is not None:
                cpu0, ev0 = split_mark()
    except torch.cuda.OutOfMemoryError as e:
        oom = f"OutOfMemoryError: {str(e)[:300]}"
    except RuntimeError as e:
        if "out of memory" not in str(e):
            raise
        oom = f"RuntimeError: {str(e)[:300]}"
    torch.cuda.synchronize()
    if kernel_prof is not None:
        kernel_prof.stop()
        out["kernel_time"] = kernel_totals(torch, kernel_prof, max(1, len(times) - spec["warmup"]))
    stats = torch.cuda.memory_stats()  # gpumem's after install() (patched), else PyTorch's
    warm = times[spec["warmup"]:] if len(times) > spec["warmup"] else times
    out.update({
        "oom": oom,
        "step_s": times,
        "step_split": split,
        "median_step_s": statistics.median(warm) if warm else None,
        "torch_reserved_peak": stats.get("reserved_bytes.all.peak"),
        "allocated_peak": stats.get("allocated_bytes.all.peak"),
        "requested_peak": stats.get("requested_bytes.all.peak"),
        "num_ooms": stats.get("num_ooms"),
        "num_device_alloc": stats.get("num_device_alloc"),
        "num_device_free": stats.get("num_device_free"),
        "driver_used_delta_peak": used_peak - used0,
    })
    if args.allocator == "cudaMallocAsync":
        try:
            pool = DriverPool(0)
            out["peak_held"] = pool.attribute(DriverPool.RESERVED_MEM_HIGH)
            out["pool_used_high"] = pool.attribute(DriverPool.USED_MEM_HIGH)
            out["peak_held_source"] = "cuMemPoolGetAttribute(RESERVED_MEM_HIGH)"
        except (OSError, AttributeError, RuntimeError) as e:
            out["peak_held"] = out["torch_reserved_peak"]
            out["peak_held_source"] = f"torch reserved_bytes.all.peak (driver query failed: {e})"
    else:
        out["peak_held"] = out["torch_reserved_peak"]
        out["peak_held_source"] = "reserved_bytes.all.peak"
    if is_gpumem(args.allocator):
        import gpumem

        out["gpumem_conf"] = gpumem.torch.conf()
        out["gpumem_install_mode"] = gpumem.torch.install_mode()
        total = gpumem.torch.driver_calls()
        out["gpumem_driver_calls"] = total
        # The calls of the timed steps alone, and the host seconds they took per step.
        if calls_after_warmup is not None:
            timed = {}
            for k, v in total.items():
                w = calls_after_warmup.get(k, {"calls": 0, "pages": 0, "seconds": 0.0})
                if v["calls"] > w["calls"]:
                    timed[k] = {"calls": v["calls"] - w["calls"], "seconds": v["seconds"] - w["seconds"]}
            out["gpumem_timed_driver_calls"] = timed
            n_timed = max(1, len(times) - spec["warmup"])
            out["gpumem_driver_s_per_step"] = sum(v["seconds"] for v in timed.values()) / n_timed
        if step_calls:
            # Per step: {kind: [calls, host seconds]} made during that step (from zero).
            out["gpumem_step_driver_calls"] = step_deltas([{}] + step_calls)
        if step_hooks is not None and len(step_hooks) > 1:
            # Per step: {hook: [calls, host seconds]} inside gpumem during that step.
            per_step = step_deltas(step_hooks)
            out["gpumem_step_hooks"] = per_step
            timed = per_step[spec["warmup"]:] or per_step
            out["gpumem_hook_s_per_step"] = statistics.mean(sum(v[1] for v in st.values()) for st in timed)
            out["gpumem_hook_calls_per_step"] = statistics.mean(sum(v[0] for v in st.values()) for st in timed)
        out["gpumem_policy_notes"] = gpumem.torch.policy_notes()
        snap_dir = os.environ.get("GPUMEM_BENCH_SNAPSHOT_DIR")
        if snap_dir:
            # The run's allocation history (GPUMEM_CONF=history:N records it), readable by
            # `gpumem replay` and PyTorch's visualizer: to compare runs event by event.
            os.makedirs(snap_dir, exist_ok=True)
            path = os.path.join(snap_dir, f"{args.workload}.{args.allocator}.{os.getpid()}.pickle")
            gpumem.torch.dump_snapshot(path)
            out["gpumem_snapshot"] = path
        out["gpumem_errors"] = gpumem.torch.error_counts()
        out["gpumem_oom_exception"] = gpumem.torch.oom_exception()
    print(json.dumps(out), flush=True)


# --------------------------------------------------------------------------------------------
# Parent side: the runs, the search and the tables.
# --------------------------------------------------------------------------------------------


def allocator_env(allocator):
    """The environment of a child process that runs under `allocator`: PyTorch's allocator
    settings cleared, then set for expandable segments or cudaMallocAsync, and GPUMEM_CONF
    for a named gpumem variant."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if ALLOC_ENV.get(allocator):
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_ENV[allocator]
    if allocator in GPUMEM_VARIANTS:
        env["GPUMEM_CONF"] = GPUMEM_VARIANTS[allocator]
    if allocator == GPUMEM_NATIVE:
        env["GPUMEM_TORCH_NATIVE"] = "1"
    return env


def run_child(workload, allocator, log_dir: Path, steps=None, batch=None, cap_bytes=None, timeout=300):
    env = allocator_env(allocator)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, "--allocator", allocator]
    if steps:
        cmd += ["--steps", str(steps)]
    if batch:
        cmd += ["--batch", str(batch)]
    if cap_bytes:
        cmd += ["--cap-bytes", str(cap_bytes)]
    tag = f"{workload}.{allocator}" + (f".b{batch}" if batch else "")
    start = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        stdout, stderr, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stderr, rc = e.stdout or "", (e.stderr or "") + f"\ntimed out after {timeout} s", -1
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    (log_dir / f"{tag}.log").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    if rc == 0 and lines:
        res = json.loads(lines[-1])
    else:
        tail = stderr.strip().splitlines()[-3:]
        res = {"workload": workload, "allocator": allocator, "batch": batch,
               "error": f"exit {rc}: {' | '.join(tail)}"}
    res["wall_s"] = round(time.time() - start, 1)
    return res


def fmt_gib(b):
    return "-" if b is None else f"{b / GIB:.2f}"


def fmt_ratio(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def summarize(results, allocators):
    """Rows of ratios and step-time ratios per workload."""
    rows = []
    for w in WORKLOADS:
        runs = {a: results.get((w, a)) for a in allocators}
        if not any(runs.values()):
            continue
        native = runs.get("native") or {}
        live = native.get("requested_peak")
        base_t = native.get("median_step_s")
        row = {"workload": w, "peak_live": live, "alloc": {}}
        for a, r in runs.items():
            if r is None:
                continue
            cell = {"error": r.get("error") or r.get("oom")}
            if live and r.get("peak_held"):
                cell["ratio"] = r["peak_held"] / live
            if base_t and r.get("median_step_s"):
                cell["time"] = r["median_step_s"] / base_t
            cell["driver_delta_ratio"] = (r["driver_used_delta_peak"] / live) if live and r.get("driver_used_delta_peak") else None
            if r.get("gpumem_driver_s_per_step") is not None:
                cell["driver_ms"] = 1000 * r["gpumem_driver_s_per_step"]
            if r.get("gpumem_hook_s_per_step") is not None:
                cell["hook_ms"] = 1000 * r["gpumem_hook_s_per_step"]
            cell["peak_held"] = r.get("peak_held")
            cell["requested_peak"] = r.get("requested_peak")
            row["alloc"][a] = cell
        anchors = [row["alloc"][a]["ratio"] for a in ("native", "expandable", "cudaMallocAsync")
                   if a in row["alloc"] and "ratio" in row["alloc"][a]]
        row["best_anchor_here"] = min(anchors) if anchors else None
        # Workloads added after ANCHORS.md was measured have only this run's figures.
        row["best_anchor_published"] = min(ANCHOR_RATIOS[w].values()) if w in ANCHOR_RATIOS else None
        g = row["alloc"].get("gpumem", {})
        if "ratio" in g:
            row["gpumem_ratio_ok"] = g["ratio"] <= 1.02
            row["gpumem_beats_anchors"] = row["best_anchor_here"] is not None and g["ratio"] <= row["best_anchor_here"]
        if "time" in g:
            row["gpumem_time_ok"] = g["time"] <= 1.01
        rows.append(row)
    return rows


def merge_rounds(rows, per_round):
    """Step-time ratio = median of the per-round ratios (each against its own round's native);
    every round's value is kept under "times"."""
    for row in rows:
        for a, cell in row["alloc"].items():
            ts = []
            for rr in per_round:
                for r2 in rr:
                    if r2["workload"] == row["workload"] and r2["alloc"].get(a, {}).get("time") is not None:
                        ts.append(r2["alloc"][a]["time"])
            if ts:
                cell["times"] = ts
                cell["time"] = statistics.median(ts)
        g = row["alloc"].get("gpumem", {})
        if "time" in g:
            row["gpumem_time_ok"] = g["time"] <= 1.01


def print_tables(rows, allocators, maxbatch, cap_bytes):
    print()
    print("Peak held from the driver / peak live (peak live = requested_bytes.all.peak of the native run)")
    head = f"{'workload':<16}{'live GiB':>9}" + "".join(f"{a:>17}" for a in allocators) + f"{'best anchor':>13}  gpumem <=1.02 & <=best"
    print(head)
    for r in rows:
        cells = []
        for a in allocators:
            c = r["alloc"].get(a)
            if c is None:
                cells.append(f"{'-':>17}")
            elif "ratio" in c:
                flag = "" if not c.get("error") else "!"
                cells.append(f"{fmt_ratio(c['ratio']) + flag:>17}")
            else:
                cells.append(f"{'error':>17}")
        verdict = "-"
        if "gpumem_ratio_ok" in r:
            verdict = ("yes" if r["gpumem_ratio_ok"] else "NO") + " / " + ("yes" if r["gpumem_beats_anchors"] else "NO")
        print(f"{r['workload']:<16}{fmt_gib(r['peak_live']):>9}" + "".join(cells) + f"{fmt_ratio(r['best_anchor_here']):>13}  {verdict}")
    for title, key in (
        ("Median step time / native's (warm-up steps excluded); target for gpumem <= 1.01", "time"),
        ("Cross-check: device used memory at step boundaries minus before (cuMemGetInfo) / peak live",
         "driver_delta_ratio"),
        ("gpumem: host ms per timed step spent in driver calls (measured around each call)", "driver_ms"),
        ("gpumem: host ms per timed step inside PyTorch's calls into gpumem, driver calls included "
         "(GPUMEM_BENCH_HOOK_TIME=1)", "hook_ms"),
    ):
        if not any(key in c for r in rows for c in r["alloc"].values()):
            continue
        print()
        print(title)
        print(f"{'workload':<16}" + "".join(f"{a:>17}" for a in allocators))
        for r in rows:
            cells = [f"{fmt_ratio(r['alloc'].get(a, {}).get(key), 3):>17}" for a in allocators]
            print(f"{r['workload']:<16}" + "".join(cells))
    if any("times" in c for r in rows for c in r["alloc"].values()):
        print()
        print("Step time / native's in each round (the table above shows their median)")
        for r in rows:
            for a in allocators:
                ts = r["alloc"].get(a, {}).get("times")
                if ts and a != "native":
                    print(f"{r['workload']:<16}{a:<17}" + " ".join(f"{t:.3f}" for t in ts))
    errors = [(r["workload"], a, c["error"]) for r in rows for a, c in r["alloc"].items() if c.get("error")]
    for w, a, e in errors:
        print(f"! {w} under {a}: {e}")
    if maxbatch:
        print()
        print(f"Largest {MAXBATCH_WORKLOAD} batch under a {cap_bytes / GIB:.0f} GiB cap ({MAXBATCH_STEPS} steps, random lengths ending at 1024)")
        print(f"{'allocator':<17}{'fits':>6}{'fails':>7}{'held at fit GiB':>17}  why the next size failed")
        for a in allocators:
            m = maxbatch.get(a)
            if not m:
                continue
            print(f"{a:<17}{m['fit'] or '-':>6}{m['fail'] or '-':>7}{fmt_gib(m.get('held_at_fit')):>17}  {m.get('why') or ''}")


def probe_fits(r, cap_bytes):
    if r.get("error"):
        return False, r["error"][:120]
    if r.get("oom"):
        return False, "out of memory"
    if r.get("peak_held") is not None and r["peak_held"] > cap_bytes:
        return False, f"held {r['peak_held'] / GIB:.2f} GiB > cap"
    return True, None


def max_batch_search(allocators, cap_bytes, log_dir, jsonl, lo=1, hi=33, budget_s=240):
    """Bisection over the batch size, per allocator, the allocators' probes in parallel."""
    state = {a: {"fit": None, "fail": None, "lo": lo - 1, "hi": hi, "held_at_fit": None, "why": None} for a in allocators}
    start = time.time()
    rnd = 0
    while time.time() - start < budget_s:
        todo = {a: (s["lo"] + s["hi"]) // 2 for a, s in state.items() if s["hi"] - s["lo"] > 1}
        if not todo:
            break
        rnd += 1
        print(f"[maxbatch] round {rnd}: " + ", ".join(f"{a} b={b}" for a, b in todo.items()), flush=True)
        with ThreadPoolExecutor(len(todo)) as pool:
            futures = {a: pool.submit(run_child, MAXBATCH_WORKLOAD, a, log_dir, MAXBATCH_STEPS, b, cap_bytes, 300)
                       for a, b in todo.items()}
            for a, f in futures.items():
                r = f.result()
                r["probe"] = True
                jsonl.write(json.dumps(r) + "\n")
                jsonl.flush()
                ok, why = probe_fits(r, cap_bytes)
                s = state[a]
                b = todo[a]
                if ok:
                    s["lo"], s["fit"], s["held_at_fit"] = b, b, r.get("peak_held")
                else:
                    s["hi"], s["fail"], s["why"] = b, b, why
    else:
        print(f"[maxbatch] stopped after {budget_s} s; bounds are partial", flush=True)
    return state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--cap-gib", type=float, default=20.0)
    ap.add_argument("--no-maxbatch", action="store_true")
    ap.add_argument("--maxbatch-budget-s", type=float, default=240)
    ap.add_argument("--steps", type=int, help="override every workload's step count")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every pair this many times, interleaved; ratios are per round, then the median")
    ap.add_argument("--rotate", action="store_true",
                    help="with --repeat: rotate the allocators' order from one round to the next, "
                         "so that each runs first in some rounds")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=CONF",
                    help="an extra gpumem allocator NAME (starting with 'gpumem-') run with GPUMEM_CONF=CONF")
    # Child mode (used by the parent).
    ap.add_argument("--child", metavar="WORKLOAD")
    ap.add_argument("--allocator")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--cap-bytes", type=int)
    args = ap.parse_args()
    if args.child:
        args.workload = args.child
        child(args)
        return 0

    for v in args.variant:
        name, sep, conf = v.partition("=")
        if not sep or not name.startswith("gpumem-"):
            ap.error(f"--variant {v!r}: expected NAME=CONF with NAME starting with 'gpumem-'")
        GPUMEM_VARIANTS[name] = conf
    workloads = [w for w in args.workloads.split(",") if w]
    allocators = [a for a in args.allocators.split(",") if a]
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w} (known: {', '.join(WORKLOADS)})")
    for a in allocators:
        if a not in ALLOCATORS + CONTROLS + [GPUMEM_NATIVE] and a not in GPUMEM_VARIANTS:
            known = ALLOCATORS + CONTROLS + [GPUMEM_NATIVE] + list(GPUMEM_VARIANTS)
            ap.error(f"unknown allocator {a} (known: {', '.join(known)})")
    if "native" not in allocators:
        ap.error("the native run is the common denominator: keep it in --allocators")
    out_dir = Path(args.out)
    log_dir = out_dir / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    jsonl = open(out_dir / "bench_workloads.jsonl", "w")

    rounds = []  # one {(workload, allocator): result} per round
    pairs = [(w, a) for w in workloads for a in allocators]
    n = len(pairs) * args.repeat
    t0 = time.time()
    i = 0
    for rnd in range(args.repeat):
        results = {}
        if args.rotate:
            # Each allocator runs first in some rounds: the first run of a round can be slower
            # (a GPU idle since the last round), which would otherwise favour the later ones.
            k = rnd % len(allocators)
            order = allocators[k:] + allocators[:k]
            pairs = [(w, a) for w in workloads for a in order]
        for w, a in pairs:
            i += 1
            print(f"[{i}/{n}] {w} under {a}" + (f" (round {rnd + 1})" if args.repeat > 1 else "") + " ...",
                  end=" ", flush=True)
            r = run_child(w, a, log_dir, steps=args.steps)
            r["round"] = rnd
            results[(w, a)] = r
            jsonl.write(json.dumps(r) + "\n")
            jsonl.flush()
            status = r.get("error") or r.get("oom") or (
                f"held {fmt_gib(r.get('peak_held'))} GiB, median step {1000 * (r.get('median_step_s') or 0):.1f} ms")
            if r.get("gpumem_driver_s_per_step") is not None:
                status += f", driver calls {1000 * r['gpumem_driver_s_per_step']:.2f} ms/step"
            for note in r.get("gpumem_policy_notes") or []:
                status += f"\n    {note}"
            print(f"{status} ({r['wall_s']} s, {time.time() - t0:.0f} s in all)", flush=True)
        rounds.append(results)

    maxbatch = None
    cap_bytes = int(args.cap_gib * GIB)
    if not args.no_maxbatch:
        maxbatch = max_batch_search(allocators, cap_bytes, log_dir, jsonl, budget_s=args.maxbatch_budget_s)

    per_round = [summarize(r, allocators) for r in rounds]
    rows = per_round[0]
    if args.repeat > 1:
        merge_rounds(rows, per_round)
    summary = {"summary": rows, "maxbatch": maxbatch, "cap_bytes": cap_bytes,
               "anchor_ratios_published": ANCHOR_RATIOS, "wall_s": round(time.time() - t0, 1)}
    jsonl.write(json.dumps(summary) + "\n")
    jsonl.close()
    print_tables(rows, allocators, maxbatch, cap_bytes)
    print(f"\n(all runs: {time.time() - t0:.0f} s; JSON lines in {out_dir / 'bench_workloads.jsonl'}, logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
