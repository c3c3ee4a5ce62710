#!/usr/bin/env python3
"""Records the reference for diag.sh: a PyTorch memory snapshot of a small training workload
(with its allocation history and Python stack frames), and PyTorch's own memory_stats() and
memory_summary() at the moment the snapshot is taken.

    python3 scripts/device/diag_torch.py OUT_DIR

Writes OUT_DIR/torch_ref.pickle, OUT_DIR/torch_stats.json, OUT_DIR/torch_summary.txt.
"""

import json
import os
import pickle
import sys

import torch


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    # Before the first allocation, so that the history is complete.
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    width = 2048
    model = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    side = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        batch = int(torch.randint(64, 1024, (1,), generator=gen))
        host = torch.randn(batch, width, pin_memory=True)
        # Copied on a side stream, used on the main one: the block is freed across streams.
        with torch.cuda.stream(side):
            x = host.to(dev, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
        x.record_stream(torch.cuda.current_stream())
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, loss
    keep = torch.empty(3 << 20, dtype=torch.uint8, device=dev)  # live at the end
    snap = torch.cuda.memory._snapshot()
    stats = torch.cuda.memory_stats()
    summary = torch.cuda.memory_summary()
    with open(os.path.join(out, "torch_ref.pickle"), "wb") as f:
        pickle.dump(snap, f)
    with open(os.path.join(out, "torch_stats.json"), "w") as f:
        json.dump(stats, f, indent=1, sort_keys=True)
    with open(os.path.join(out, "torch_summary.txt"), "w") as f:
        f.write(summary)
    n = sum(len(t) for t in snap["device_traces"])
    print(f"reference snapshot: {len(snap['segments'])} segments, {n} history entries; "
          f"{keep.numel()} bytes kept live")


if __name__ == "__main__":
    main()
