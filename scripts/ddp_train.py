#!/usr/bin/env python3
"""DistributedDataParallel training with gpumem as each rank's CUDA allocator.

Run one training under torchrun per allocator, then compare them:

    torchrun --standalone --nproc_per_node=2 scripts/ddp_train.py --allocator native --out native.json
    torchrun --standalone --nproc_per_node=2 scripts/ddp_train.py --allocator gpumem --out gpumem.json
    python3 scripts/ddp_train.py --compare native.json gpumem.json

Each rank trains the same seeded model on its own seeded data over NCCL. Under gpumem every
rank installs gpumem before touching CUDA, and the run checks that each rank has exactly one
pool, on its own device, that every parameter, gradient and optimizer state lives in it, that
no other device got memory from gpumem, and that no misuse was reported. --compare checks that
the per-step losses (all-reduced over ranks) of the two runs agree within --rtol, and prints a
table. Keep NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 set
on machines whose NVLink multicast is off.
"""

import argparse
import json
import os
import sys
import time


def build_model(torch, width: int, layers: int):
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width)]
    blocks.append(torch.nn.Linear(width, width))
    return torch.nn.Sequential(*blocks)


def train(args) -> int:
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    import torch

    if args.allocator == "gpumem":
        import gpumem

        gpumem.torch.install(conf=args.conf)  # before anything initializes CUDA
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)

    torch.manual_seed(0)
    model = build_model(torch, args.width, args.layers).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, step_s = [], []
    for step in range(args.steps):
        # Variable batch sizes so the allocator sees changing shapes.
        batch = [64, 256, 128, 512][step % 4]
        x = torch.randn(batch, args.width, generator=gen).to(device, non_blocking=True)
        y = torch.randn(batch, args.width, generator=gen).to(device, non_blocking=True)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        step_s.append(time.perf_counter() - t0)

    report = {
        "rank": rank,
        "local_rank": local_rank,
        "device": torch.cuda.get_device_name(device),
        "median_step_s": sorted(step_s[2:])[len(step_s[2:]) // 2],
    }
    if args.allocator == "gpumem":
        import gpumem
        from gpumem import _native

        tensors = list(model.parameters()) + [
            t for state in opt.state.values() for t in state.values() if torch.is_tensor(t) and t.is_cuda
        ]
        owners = {_native.torch_owner_device(t.data_ptr()) for t in tensors}
        n_devices = torch.cuda.device_count()
        others = {
            d: gpumem.torch.memory_stats(d)["reserved_bytes.all.peak"]
            for d in range(n_devices)
            if d != local_rank
        }
        stats = gpumem.torch.memory_stats(local_rank)
        report.update(
            {
                "gpumem_devices": gpumem.torch.devices(),
                "owners": sorted(o if o is not None else -1 for o in owners),
                "n_tensors": len(tensors),
                "other_devices_peak_reserved": others,
                "allocated_bytes": stats["allocated_bytes.all.current"],
                "peak_reserved": stats["reserved_bytes.all.peak"],
                "peak_requested": stats["requested_bytes.all.peak"],
                "errors": gpumem.torch.error_counts(),
                "oom_exception": gpumem.torch.oom_exception(),
            }
        )
        problems = []
        if report["gpumem_devices"] != [local_rank]:
            problems.append(f"pools on devices {report['gpumem_devices']}, expected [{local_rank}]")
        if report["owners"] != [local_rank]:
            problems.append(f"tensors owned by devices {report['owners']}")
        if any(others.values()):
            problems.append(f"gpumem memory on other devices: {others}")
        if any(report["errors"].values()):
            problems.append(f"misuse reported: {report['errors']}")
        report["problems"] = problems
    else:
        report["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        report["peak_requested"] = torch.cuda.memory_stats(device)["requested_bytes.all.peak"]
        report["problems"] = []

    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        out = {
            "allocator": args.allocator,
            "conf": args.conf,
            "world_size": world,
            "steps": args.steps,
            "losses": losses,
            "ranks": gathered,
            "nccl_version": _version_text(torch.cuda.nccl.version()),
            "torch": torch.__version__,
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps({"allocator": args.allocator, "final_loss": losses[-1],
                          "problems": [p for r in gathered for p in r["problems"]]}))
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(r["problems"] for r in gathered) else 0


def _version_text(v) -> str:
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def compare(paths, rtol: float) -> int:
    a, b = (json.load(open(p)) for p in paths)
    worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["losses"], b["losses"]))
    ok = len(a["losses"]) == len(b["losses"]) and worst <= rtol
    problems = [p for run in (a, b) for r in run["ranks"] for p in r["problems"]]
    print(f"DDP over {a['world_size']} GPUs, {a['steps']} steps, NCCL {a['nccl_version']}, torch {a['torch']}")
    print(f"{'run':<10} {'rank':>4} {'device':<22} {'peak reserved':>14} {'peak requested':>15} {'step ms':>8}  pools")
    for run in (a, b):
        for r in run["ranks"]:
            pools = r.get("gpumem_devices", "-")
            print(
                f"{run['allocator']:<10} {r['rank']:>4} {r['device'][:22]:<22} "
                f"{r['peak_reserved'] / 2**20:>11.1f} MiB {r['peak_requested'] / 2**20:>12.1f} MiB "
                f"{1000 * r['median_step_s']:>8.2f}  {pools}"
            )
    print(f"loss, step 0 / last: {a['allocator']} {a['losses'][0]:.6f} / {a['losses'][-1]:.6f}, "
          f"{b['allocator']} {b['losses'][0]:.6f} / {b['losses'][-1]:.6f}")
    print(f"largest relative loss difference: {worst:.2e} (tolerance {rtol:.0e}) -> {'OK' if ok else 'MISMATCH'}")
    for p in problems:
        print(f"problem: {p}")
    return 0 if ok and not problems else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocator", choices=["native", "gpumem"], default="gpumem")
    ap.add_argument("--conf", default=None, help="gpumem configuration (default: GPUMEM_CONF or the defaults)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--out", default="ddp_result.json")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"))
    ap.add_argument("--rtol", type=float, default=1e-4)
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare, args.rtol)
    if "LOCAL_RANK" not in os.environ:
        ap.error("run the training under torchrun (see the usage above)")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
