"""Where the time of one training step of attention goes: every CUDA kernel of
``flex_flash_attn_func``'s forward + backward (torch.profiler), summed by name, per case; with
``--fa4``, FlashAttention-4's step on the same inputs below it. Each step also says how long the
GPU sat idle between its first and last kernel (host stalls: a sync, or launches slower than
the kernels); ``--trace DIR`` writes each profile (CPU ops too) as a Chrome trace there.

    python tools/profile_step.py [--cases full8k,causal8k] [--steps 5] [--fa4] [--trace DIR]
"""

from __future__ import annotations

import argparse
import os
import re
from collections import defaultdict

import torch
from bench_ffa import case_inputs, make_cases, run_fa4, run_ffa_autograd, training_step
from torch.profiler import ProfilerActivity, profile


def kernel_times(fn, steps: int, trace: str | None = None) -> tuple[dict[str, tuple[int, float]], float]:
    """{kernel name: (calls per step, microseconds per step)} and the GPU's idle microseconds per
    step (the span from the first to the last kernel, less the time some kernel ran), both over
    the steps after the first of ``steps`` runs of ``fn`` (the first waits on the profiler's
    start-up; with ``steps`` = 1 it is all there is). ``trace``: a Chrome trace file to write
    (CPU ops and kernels)."""
    fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    kernels = sorted(
        (ev.time_range.start, ev.time_range.end, ev.name, ev.device_time)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    )
    counted = steps
    if steps > 1:  # every step launches the same kernels: drop the first step's share
        kernels = kernels[len(kernels) // steps :]
        counted = steps - 1
    acc: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for _, _, name, us in kernels:
        acc[name][0] += 1
        acc[name][1] += us
    busy, reach = 0.0, None
    for start, end, _, _ in kernels:  # union of the kernels' intervals (streams may overlap)
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    idle = (kernels[-1][1] - kernels[0][0] - busy) if kernels else 0.0
    return {name: (n // counted, us / counted) for name, (n, us) in acc.items()}, idle / counted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="full8k,causal8k")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fa4", action="store_true", help="also FlashAttention-4's step")
    ap.add_argument("--trace", help="folder for Chrome traces, one per case and library")
    args = ap.parse_args()
    for case in make_cases(args.cases.split(",")):
        *qkv, qr, kr, ty = case_inputs(case, requires_grad=True)
        # both libraries' steps as bench_ffa times them: forward, backward with a fixed gradient
        steps = [("FFA", training_step(run_ffa_autograd(*qkv, qr, kr, ty), qkv))]
        fa4 = run_fa4(case, *qkv) if args.fa4 else None
        if fa4 is not None:
            steps.append(("FA4", training_step(fa4, qkv)))
        for lib, fn in steps:
            trace = None
            if args.trace:
                os.makedirs(args.trace, exist_ok=True)
                trace = os.path.join(args.trace, re.sub(r"\W+", "_", case.name) + f"_{lib}.json")
            times, idle = kernel_times(fn, args.steps, trace)
            total = sum(us for _, us in times.values())
            print(
                f"\n{case.name}, {lib}: {total:.0f} us of kernels per step, GPU idle {idle:.0f} us between them"
            )
            for name, (n, us) in sorted(times.items(), key=lambda kv: -kv[1][1]):
                print(f"  {us:9.1f} us  x{n:<3d} {name[:110]}")


if __name__ == "__main__":
    main()
