"""Forward calls of FFA and of FlashAttention-4 on the same inputs, for Nsight Compute to profile
the two forward kernels side by side (GPU machine):

    ncu --clock-control none -k regex:"FFAForwardSm90|FlashAttentionForwardSm90" \\
        --launch-skip 2 --launch-count 2 --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section InstructionStats --section LaunchStats \\
        python3 tools/ncu_fwd.py causal --head-dim 64

``--launch-skip 2`` skips each library's first call (compilation, caches). bf16, 8192 tokens,
the heads of 16 x 128 at any head dim (32 heads at D 64, the benchmark's case).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mask", choices=("full", "causal"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    from flash_attn.cute import flash_attn_func

    from ffa_kernels import flex_flash_attn_func

    causal = args.mask == "causal"
    t, d = args.tokens, args.head_dim
    h = 16 * 128 // d
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ranges = torch.tensor([[0, t]], dtype=torch.int32, device="cuda")
    types = torch.tensor([1 if causal else 0], dtype=torch.int32, device="cuda")
    for _ in range(2):
        flex_flash_attn_func(q, k, v, ranges, ranges.clone(), types)
    for _ in range(2):
        flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=causal)
    for _ in range(2):
        flex_flash_attn_func(q, k, v, ranges, ranges.clone(), types)
    for _ in range(2):
        flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
