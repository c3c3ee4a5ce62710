#!/usr/bin/env python3
"""Record a PyTorch program's GPU allocation history as a snapshot that `gpumem replay` reads.

Two ways to use it:

    # one of the built-in workloads (pure torch, nothing downloaded)
    python3 scripts/record_trace.py --workload gpt_varlen --out my_trace.pickle.gz

    # your own script, run as __main__ with its arguments, recorded from start to end
    python3 scripts/record_trace.py --out my_trace.pickle.gz -- train.py --epochs 1

The output is `torch.cuda.memory._snapshot()` pickled (gzipped when the name ends in .gz),
recorded with `_record_memory_history(enabled="all")` under PyTorch's native caching allocator,
so it also carries that allocator's own segment events (which gpumem's simulation of it is
checked against). Stacks are left out unless --stacks is given (they make files much larger).
Then: `gpumem replay my_trace.pickle.gz`.
"""
import argparse
import gzip
import os
import pickle
import random
import runpy
import sys
import time

import torch


def gpt_varlen(steps: int, dev: torch.device):
    """A small GPT-style decoder trained with a random sequence length each step, with input
    batches prefetched on a side stream (so the trace has two streams and record_stream)."""
    vocab, d, layers, heads = 8192, 512, 6, 8

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(d)
            self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = torch.nn.LayerNorm(d)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.head = torch.nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            t = idx.shape[1]
            mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
            x = self.emb(idx)
            for b in self.blocks:
                x = b(x, mask)
            return self.head(x)

    model = GPT().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def load():
        x = torch.randint(0, vocab, (8, random.randint(64, 512))).pin_memory()
        with torch.cuda.stream(side):
            return x.to(dev, non_blocking=True)

    nxt = load()
    for _ in range(steps):
        main.wait_stream(side)
        x = nxt
        x.record_stream(main)
        nxt = load()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, logits, loss
        yield


def mlp(steps: int, dev: torch.device):
    """A plain MLP trained with fixed shapes: the simplest steady-state training loop."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU()) for _ in range(6)]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(steps):
        x = torch.randn(1024, 2048, device=dev)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def encdec(steps: int, dev: torch.device):
    """An encoder-decoder transformer (translation-like) with random source and target lengths."""
    d = 512
    model = torch.nn.Transformer(d_model=d, nhead=8, num_encoder_layers=4, num_decoder_layers=4,
                                 dim_feedforward=2048, batch_first=True).to(dev)
    emb = torch.nn.Embedding(8000, d).to(dev)
    head = torch.nn.Linear(d, 8000).to(dev)
    params = list(model.parameters()) + list(emb.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=1e-4)
    for _ in range(steps):
        b = random.choice([16, 32])
        src = torch.randint(0, 8000, (b, random.randint(32, 256)), device=dev)
        tgt = torch.randint(0, 8000, (b, random.randint(16, 128)), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mask = model.generate_square_subsequent_mask(tgt.shape[1] - 1, device=dev)
            out = model(emb(src), emb(tgt[:, :-1]), tgt_mask=mask)
            loss = torch.nn.functional.cross_entropy(head(out).float().reshape(-1, 8000), tgt[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def checkpointed(steps: int, dev: torch.device):
    """A deep MLP-transformer stack trained with activation checkpointing (recomputation in
    the backward pass changes the allocation pattern)."""
    from torch.utils.checkpoint import checkpoint
    d = 1024
    layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        for _ in range(16)).to(dev)
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-4)
    for _ in range(steps):
        x = torch.randn(16, random.choice([256, 512, 768]), d, device=dev, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = x
            for layer in layers:
                h = h + checkpoint(layer, h, use_reentrant=False)
            loss = h.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def vit_accum(steps: int, dev: torch.device):
    """A vision transformer trained with gradient accumulation over four micro-batches, mixed
    precision and gradient clipping (fixed shapes; the accumulated gradients live across
    micro-batches)."""
    d, patches, layers = 384, 196, 8
    enc = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d, 6, 4 * d, batch_first=True, norm_first=True), layers)
    embed = torch.nn.Conv2d(3, d, 16, 16)
    head = torch.nn.Linear(d, 1000)
    model = torch.nn.ModuleList([embed, enc, head]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        for _ in range(4):
            img = torch.randn(32, 3, 224, 224, device=dev)
            label = torch.randint(0, 1000, (32,), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                x = embed(img).flatten(2).transpose(1, 2)
                assert x.shape[1] == patches
                loss = torch.nn.functional.cross_entropy(head(enc(x).mean(1)).float(), label) / 4
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def unet_res(steps: int, dev: torch.device):
    """A small convolutional U-Net trained on images of a random resolution each step (as in
    multi-resolution diffusion training): every activation changes size with the resolution."""
    def block(i, o):
        return torch.nn.Sequential(torch.nn.Conv2d(i, o, 3, padding=1), torch.nn.GroupNorm(8, o), torch.nn.SiLU(),
                                   torch.nn.Conv2d(o, o, 3, padding=1), torch.nn.GroupNorm(8, o), torch.nn.SiLU())

    class UNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.d1, self.d2, self.d3 = block(3, 64), block(64, 128), block(128, 256)
            self.u2, self.u1 = block(256 + 128, 128), block(128 + 64, 64)
            self.out = torch.nn.Conv2d(64, 3, 1)

        def forward(self, x):
            a = self.d1(x)
            b = self.d2(torch.nn.functional.avg_pool2d(a, 2))
            c = self.d3(torch.nn.functional.avg_pool2d(b, 2))
            u = torch.nn.functional.interpolate(c, scale_factor=2.0)
            u = self.u2(torch.cat([u, b], 1))
            u = torch.nn.functional.interpolate(u, scale_factor=2.0)
            return self.out(self.u1(torch.cat([u, a], 1)))

    model = UNet().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        r = random.choice([128, 192, 256, 320])
        x = torch.randn(16, 3, r, r, device=dev).to(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (model(x).float() - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def serve_threads(steps: int, dev: torch.device, rngs=None, pin=None):
    """An inference server: four threads, each with its own CUDA stream, run a transformer
    encoder's forward pass (fp16, no gradients) on requests of random batch size and length.
    Each yielded step is one round in which every thread serves two requests; a request ends
    when its result reaches the host. `rngs`: one random.Random per thread (default: seeded 0-3).
    `pin`: CPUs; thread i then runs on pin[i % len(pin)] alone (Linux), so that two processes
    given the same list run each thread's work on the same CPU. scripts/bench_workloads.py runs
    the same workload."""
    import threading
    d = 768
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d, 12, 4 * d, batch_first=True), 6).to(dev).eval().half()
    streams = [torch.cuda.Stream() for _ in range(4)]
    rngs = rngs or [random.Random(i) for i in range(4)]
    errors = []

    def serve(i):
        try:
            if pin:
                os.sched_setaffinity(0, {pin[i % len(pin)]})  # 0: this thread only
            with torch.no_grad(), torch.cuda.stream(streams[i]):
                for _ in range(2):
                    x = torch.randn(rngs[i].choice([1, 4, 8, 16]), rngs[i].randint(32, 512), d, device=dev, dtype=torch.half)
                    model(x).sum().item()
        except Exception as e:  # a thread's exception is re-raised in the caller's thread
            errors.append(e)

    for _ in range(steps):
        ts = [threading.Thread(target=serve, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errors:
            raise errors[0]
        yield


def kv_decode(steps: int, dev: torch.device):
    """Batched greedy decoding with a key/value cache grown by concatenation each token (as
    simple generation loops do), prompts of random length, a new batch every step."""
    d, layers, vocab = 1024, 8, 16000
    emb = torch.nn.Embedding(vocab, d).to(dev).half()
    attn = torch.nn.ModuleList(torch.nn.MultiheadAttention(d, 16, batch_first=True) for _ in range(layers)).to(dev).half()
    mlp = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
                              for _ in range(layers)).to(dev).half()
    head = torch.nn.Linear(d, vocab).to(dev).half()
    with torch.no_grad():
        for _ in range(steps):
            b, p = random.choice([4, 8, 16]), random.randint(16, 256)
            tok = torch.randint(0, vocab, (b, p), device=dev)
            cache = [None] * layers
            x = emb(tok)
            for _ in range(48):
                for i in range(layers):
                    cache[i] = x if cache[i] is None else torch.cat([cache[i], x], 1)
                    x = x + attn[i](x, cache[i], cache[i], need_weights=False)[0]
                    x = x + mlp[i](x)
                tok = head(x[:, -1:]).argmax(-1)
                x = emb(tok)
            del cache, x, tok
            yield


WORKLOADS = {"gpt_varlen": gpt_varlen, "mlp": mlp, "encdec": encdec, "checkpointed": checkpointed,
             "vit_accum": vit_accum, "unet_res": unet_res, "serve_threads": serve_threads, "kv_decode": kv_decode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output file (.pickle or .pickle.gz)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), help="built-in workload to record")
    ap.add_argument("--steps", type=int, default=12, help="steps of the built-in workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stacks", action="store_true", help="record Python stacks (large files)")
    ap.add_argument("--max-entries", type=int, default=2_000_000, help="history ring-buffer size")
    ap.add_argument("script", nargs="*", help="a script to run (after --), with its arguments")
    a = ap.parse_args()
    if bool(a.workload) == bool(a.script):
        ap.error("give either --workload NAME or -- SCRIPT [ARGS...]")
    if not torch.cuda.is_available():
        print("record_trace: no CUDA device; recording needs a GPU", file=sys.stderr)
        return 2
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        print(f"record_trace: note: PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}", file=sys.stderr)
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all" if a.stacks else None, stacks="python",
        max_entries=a.max_entries)
    t0 = time.time()
    if a.workload:
        dev = torch.device("cuda")
        for i, _ in enumerate(WORKLOADS[a.workload](a.steps, dev)):
            torch.cuda.synchronize()
            print(f"\rstep {i + 1}/{a.steps}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    else:
        sys.argv = list(a.script)
        try:
            runpy.run_path(a.script[0], run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                print(f"record_trace: the script exited with {e.code}; saving what was recorded", file=sys.stderr)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    opener = gzip.open if a.out.endswith(".gz") else open
    with opener(a.out, "wb") as f:
        pickle.dump(snap, f)
    n = sum(len(t) for t in snap.get("device_traces", []))
    print(f"record_trace: {n} events in {time.time() - t0:.1f}s -> {a.out} ({os.path.getsize(a.out)} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
