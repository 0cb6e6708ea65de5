"""calc_attn over NCCL on 2 GPUs (and on all GPUs of a larger machine), with both comm backends,
equals single-GPU attention (run on the device: pytest -m gpu)."""

import pytest
import torch

from magi_dist.testing import Case, spawn_gloo
from magi_solver import masks

pytestmark = pytest.mark.gpu


def gpu_cases() -> list[Case]:
    cu = [0, 300, 310, 1500, 2000]
    specs = [
        ("varlen-causal", masks.varlen(cu, causal=True), {}),
        ("varlen-full", masks.varlen(cu), {}),
        ("sliding-window", masks.sliding_window(1800, (200, 0), causal=True), {"sink": "sh"}),
        ("block-causal", masks.block_causal(cu, 128), {"softcap": 20.0}),
        ("gqa-8-2", masks.varlen(cu, causal=True), {"hq": 8, "hk": 2}),
        ("mla-192-128", masks.varlen(cu, causal=True), {"d": 192, "dv": 128}),  # Dv != D
        ("mla-192-128-b", masks.varlen(cu), {"d": 192, "dv": 128, "hk": 2}),  # the next degree
    ]
    out = []
    for i, (name, mask, kw) in enumerate(specs):
        for dtype, tol in (("float32", 5e-5), ("bfloat16", 3e-2)):
            degree = [0, 1, 2, None][i % 4]
            kw2 = {"hq": 8, "hk": 8, "d": 64, "chunk": 256, "min_chunk": 128, **kw}
            out.append(
                Case.from_mask(
                    f"{name}-{dtype}-deg{degree}", mask, degree=degree, dtype=dtype, tol=tol, seed=i, **kw2
                )
            )
    return out


def _worlds() -> list[int]:
    """2 GPUs, and every GPU of the machine when it has more (cp 4 / 8 on the larger machines)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return sorted({2, n}) if n >= 2 else [2]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("comm", ["a2av", "native"])
@pytest.mark.parametrize("world", _worlds())
def test_calc_attn_nccl(world, comm):
    spawn_gloo(world, gpu_cases(), env={"MAGI_COMM_BACKEND": comm}, backend="nccl")
