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


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("heads", ["auto", "stage", "1", "2"])
def test_split_backward_nccl(heads):
    """The degree-0 backward split by keys (MAGI_DIST_BWD_SPLIT=1, at cp 2 where it is off by
    default), its calls' q heads per CTA each by the kernel's rule, the whole stage's, one or two
    (on the GQA cases: at these sizes the rule takes one everywhere), equals single-GPU attention,
    dq, dk and dv."""
    cases = [c for c in gpu_cases() if c.degree == 0 and (heads != "2" or (c.hq // c.hk) % 2 == 0)]
    assert cases
    env = {"MAGI_COMM_BACKEND": "native", "MAGI_DIST_BWD_SPLIT": "1", "MAGI_DIST_BWD_SPLIT_HEADS": heads}
    spawn_gloo(2, cases, env=env, backend="nccl")


def _preprocess_launches(rank: int, world: int, split: str) -> int:
    """This rank's launches of the backward preprocess in one degree-0 calc_attn backward
    (bf16 on its GPU; ``split``: $MAGI_DIST_BWD_SPLIT)."""
    import os

    import magi_dist as md
    from ffa_kernels.testing import preprocess_launches
    from magi_solver import DispatchConfig, DistAttnConfig, OverlapConfig

    os.environ["MAGI_DIST_BWD_SPLIT"] = split
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    mask = masks.varlen([0, 300, 310, 1500, 2000], causal=True)
    cfg = DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=256), overlap_config=OverlapConfig(degree=0)
    )
    key = md.magi_attn_flex_key(
        mask.q_ranges, mask.k_ranges, mask.mask_types, 2000, 2000, 8, 2, 64, None, dist_attn_config=cfg
    )
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (
        torch.randn(2000, h, 64, device=dev, dtype=torch.bfloat16, generator=g) for h in (8, 2, 2, 8)
    )
    lq, lk, lv = (md.dispatch(x, key).requires_grad_() for x in (q, k, v))
    out, _ = md.calc_attn(lq, lk, lv, key)
    with preprocess_launches() as launches:
        out.backward(md.dispatch(dout, key))
        torch.cuda.synchronize()
    assert lk.grad is not None and lk.grad.abs().max() > 0
    return len(launches)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("split", ["0", "1"])
def test_degree0_backward_launches_its_preprocess_once(split):
    """The preprocess enqueued ahead of the K/V cast (ffa_backward_prepare) is the one the
    stage kernels use: one launch per backward, split by keys or not."""
    from magi_dist.testing import run_ranks

    assert run_ranks(2, _preprocess_launches, split, backend="nccl", timeout=240) == [1, 1]
