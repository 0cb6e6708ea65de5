"""Two training steps of FFA and of FlashAttention-4 on the same inputs, for Nsight Compute to
profile the backward kernels side by side (GPU machine):

    ncu --clock-control none -k regex:"FFABackwardSm90|FlashAttentionBackwardSm90" \\
        --launch-skip 2 --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \\
        --section Occupancy --section LaunchStats python3 tools/ncu_bwd.py full [--head-dim 128]

``--launch-skip 2`` skips the first step's kernels (compilation, caches). bf16, 8192 tokens, the
heads of 16 x 128 at any head dim. ``swa``: bench_ffa's sliding-window case (causal, window
1024, 8k, D 128) instead.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mask", choices=("full", "causal", "swa"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    if args.mask == "swa":
        from bench_ffa import case_inputs, make_cases, run_fa4, run_ffa_autograd, training_step

        case = make_cases(["swa8k"])[0]
        q, k, v, qr, kr, ty = case_inputs(case, requires_grad=True)
        steps = [
            training_step(run_ffa_autograd(q, k, v, qr, kr, ty), (q, k, v)),
            training_step(run_fa4(case, q, k, v), (q, k, v)),
        ]
        for _ in range(2):
            for step in steps:
                step()
        torch.cuda.synchronize()
        return
    from flash_attn.cute import flash_attn_func

    from ffa_kernels import flex_flash_attn_func

    causal = args.mask == "causal"
    t, d = args.tokens, args.head_dim
    h = 16 * 128 // d
    q, k, v = (
        torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn_like(q)
    ranges = torch.tensor([[0, t]], dtype=torch.int32, device="cuda")
    types = torch.tensor([1 if causal else 0], dtype=torch.int32, device="cuda")
    for _ in range(2):
        flex_flash_attn_func(q, k, v, ranges, ranges.clone(), types)[0].backward(grad)
        out = flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=causal)
        (out[0] if isinstance(out, tuple) else out).backward(grad.unsqueeze(0))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
