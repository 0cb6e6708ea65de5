"""The packed K/V rows calc_attn moves between ranks (``attn._pack`` / ``attn._split``: a token's K
heads, then its V heads) read in place by the stage API: forward and backward equal the same
calls on contiguous K and V, bitwise (the backward in its deterministic mode), for v with q's
head dim and with its own (MLA 192/128).
On the CPU (reference backend, float64) and on an sm90 GPU (bf16; ``gpu`` marker): the kernels,
except the backward of 192/128, which the sm90 backward does not serve (it falls back to the
reference with a warning, so only the forward kernel reads those packed rows there)."""

import pytest
import torch

from ffa_kernels import accumulator_dtype, ffa_backward_stage, ffa_forward_stage, forward_accumulators
from magi_dist.attn import _pack, _split

HQ, HK = 4, 2


def _stage_results(q, k, v, dout, ranges, dk=None, dv=None):
    """out, lse of one forward stage and dq, dk, dv of one backward stage (dk / dv: the
    accumulators to add into, zeros of k's / v's shape when None)."""
    out, lse, _ = forward_accumulators(q, head_dim_v=v.shape[2])
    ffa_forward_stage(q, k, v, *ranges, out, lse)
    f32 = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=f32, device=q.device)
    dk = torch.zeros(k.shape, dtype=f32, device=q.device) if dk is None else dk
    dv = torch.zeros(v.shape, dtype=f32, device=q.device) if dv is None else dv
    # deterministic: the kernel's dq (and GQA dK/dV) additions in a fixed order, so that two
    # runs can be compared bitwise
    ffa_backward_stage(dout, q, k, v, out.to(q.dtype), lse, *ranges, dq, dk, dv, deterministic=True)
    return out, lse, dq, dk, dv


def _check(device: torch.device, dtype: torch.dtype, d: int, dv: int) -> None:
    g = torch.Generator(device=device).manual_seed(d + dv)
    t = 333
    q = torch.randn(t, HQ, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(t, HK, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(t, HK, dv, device=device, dtype=dtype, generator=g)
    dout = torch.randn(t, HQ, dv, device=device, dtype=dtype, generator=g)
    ranges = (
        torch.tensor([[0, 140], [140, 333]], dtype=torch.int32, device=device),
        torch.tensor([[0, 140], [140, 333]], dtype=torch.int32, device=device),
        torch.tensor([1, 0], dtype=torch.int32, device=device),
    )
    kv = _pack(k, v, extra_rows=5)
    kp, vp = _split(kv[:t], HK, d)
    assert torch.equal(kp, k) and torch.equal(vp, v)
    assert kp.stride(0) == vp.stride(0) == HK * (d + dv)  # views into the packed rows, not copies
    assert kp.data_ptr() == kv.data_ptr() and vp.data_ptr() == kv.data_ptr() + HK * d * kv.element_size()
    # the backward's partial [dK, dV] rows: the same packed layout, added into in place
    dkv = torch.zeros((t, HK * (d + dv)), dtype=accumulator_dtype(dtype), device=device)
    dkp, dvp = _split(dkv, HK, d)
    got = _stage_results(q, kp, vp, dout, ranges, dkp, dvp)
    want = _stage_results(q, k, v, dout, ranges)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    assert torch.equal(dkv, torch.cat([want[3].flatten(1), want[4].flatten(1)], dim=1))


@pytest.mark.parametrize("d, dv", [(16, 16), (24, 16)])
def test_packed_rows_on_cpu(d, dv):
    _check(torch.device("cpu"), torch.float64, d, dv)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("d, dv", [(128, 128), (64, 64), (192, 128)])
def test_packed_rows_on_sm90(d, dv):
    _check(torch.device("cuda"), torch.bfloat16, d, dv)
