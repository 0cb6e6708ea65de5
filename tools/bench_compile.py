"""torch.compile vs eager: one training step (forward + backward) of a transformer block
(pre-norm GQA attention through ``flex_flash_attn_func`` + MLP) on packed documents.

The block is ``ffa_kernels.testing.PackedBlock``; compiled with inductor and ``fullgraph=True``
(the FFA operators are registered with torch.library, so the graph has no break). Every step
uses a new ``FlexMask`` with different document lengths of the same count, so the compiled
timing includes whatever re-tracing a change of lengths would cost (the run prints the number of
compiled frames: 1 means none). Usage (GPU machine):

    python tools/bench_compile.py [--total 8192] [--dim 2048] [--heads 16] [--kv-heads 4]
        [--head-dim 128] [--docs 12] [--iters 20]
"""

from __future__ import annotations

import argparse
import random

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from ffa_kernels import CAUSAL, FULL, FlexMask
from ffa_kernels.testing import PackedBlock


def doc_masks(total: int, docs: int, kind: int, count: int, device) -> list[FlexMask]:
    """``count`` masks of ``docs`` documents of random lengths summing to ``total``."""
    rng = random.Random(0)
    masks = []
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, total), docs - 1))
        ends = [*cuts, total]
        starts = [0, *cuts]
        ranges = torch.tensor(list(zip(starts, ends)), dtype=torch.int32, device=device)
        masks.append(FlexMask.from_ranges(ranges, ranges, [kind] * docs, total, total))
    return masks


def time_steps(model, xs, masks, warmup: int) -> float:
    """Mean milliseconds of one step (zero grads, forward, loss, backward) after ``warmup`` steps."""

    def step(x, mask):
        model.zero_grad(set_to_none=True)
        out = model(x, mask=mask)
        out.float().square().mean().backward()

    for i in range(warmup):
        step(xs[i % len(xs)], masks[i % len(masks)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for x, mask in zip(xs, masks):
        step(x, mask)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  bf16  T={args.total} dim={args.dim} "
        f"heads {args.heads}:{args.kv_heads} D={args.head_dim}"
    )
    print("| mask | eager ms/step | compiled ms/step | compiled / eager | compiled frames |")
    print("|---|---|---|---|---|")
    for name, kind in (("varlen causal", CAUSAL), ("varlen full", FULL)):
        masks = doc_masks(args.total, args.docs, kind, args.iters, dev)
        xs = [torch.randn(args.total, args.dim, device=dev, dtype=torch.bfloat16) for _ in range(args.iters)]
        model = PackedBlock(args.dim, args.heads, args.kv_heads, args.head_dim).to(dev, torch.bfloat16)
        eager = time_steps(model, xs, masks, warmup=3)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        comp = time_steps(compiled, xs, masks, warmup=3)
        print(f"| {name} | {eager:.3f} | {comp:.3f} | {comp / eager:.3f} | {counter.frame_count} |")


if __name__ == "__main__":
    main()
