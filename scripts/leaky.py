#!/usr/bin/env python3
"""A process that uses GPU memory in a known pattern, to test `gpumem monitor` against.

    python3 scripts/leaky.py --mode leak [--rate-mib 128] [--seconds 40]
    python3 scripts/leaky.py --mode step [--step-gib 4] [--step-at 8] [--seconds 40]

leak: keeps RATE MiB more GPU memory every second (a leak, on purpose).
step: takes STEP GiB once, STEP_AT seconds in (like loading a model), then holds it.

Uses PyTorch if it is installed, else CuPy. Prints its pid first, then one line per second,
and exits after SECONDS (or on SIGTERM/SIGINT).
"""

import argparse
import os
import signal
import sys
import time

MIB = 1 << 20


def allocator():
    """A function that returns a new device buffer of n bytes (kept alive by the caller)."""
    try:
        import torch

        if torch.cuda.is_available():
            dev = torch.device("cuda")
            # Touch the memory so that it is really backed.
            return "torch", lambda n: torch.ones(n, dtype=torch.uint8, device=dev)
    except ImportError:
        pass
    try:
        import cupy

        def alloc(n):
            a = cupy.empty(n, dtype=cupy.uint8)
            a.fill(1)
            return a

        return "cupy", alloc
    except ImportError:
        sys.exit("leaky.py needs PyTorch with CUDA, or CuPy")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["leak", "step"], default="leak")
    p.add_argument("--rate-mib", type=int, default=128, help="leak: MiB kept per second")
    p.add_argument("--step-gib", type=float, default=4.0, help="step: GiB taken once")
    p.add_argument("--step-at", type=float, default=8.0, help="step: seconds before taking it")
    p.add_argument("--seconds", type=float, default=40.0, help="how long to run")
    a = p.parse_args()

    stop = False

    def on_signal(_sig, _frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    lib, alloc = allocator()
    kept = [alloc(MIB)]  # creates the context
    print(f"pid {os.getpid()} mode {a.mode} via {lib}", flush=True)
    t0 = time.monotonic()
    held = MIB
    stepped = False
    while not stop and time.monotonic() - t0 < a.seconds:
        elapsed = time.monotonic() - t0
        if a.mode == "leak":
            kept.append(alloc(a.rate_mib * MIB))
            held += a.rate_mib * MIB
        elif not stepped and elapsed >= a.step_at:
            kept.append(alloc(int(a.step_gib * 1024) * MIB))
            held += int(a.step_gib * 1024) * MIB
            stepped = True
        print(f"t={elapsed:5.1f}s holding {held / MIB:.0f} MiB", flush=True)
        # Sleep to the next whole second since the start.
        next_t = t0 + int(elapsed) + 1
        while not stop and time.monotonic() < next_t:
            time.sleep(min(0.1, max(0.0, next_t - time.monotonic())))
    print(f"pid {os.getpid()} done, held {held / MIB:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
