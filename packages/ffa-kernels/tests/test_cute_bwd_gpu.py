"""GPU correctness of the sm90 CuTe DSL backward against a dense float64 oracle (autograd
through `ffa_kernels.testing.dense_attention`).

Tolerance per gradient g in (dq, dk, dv): ||g - g64||_inf <= 2 * ||g_lowprec - g64||_inf + eps,
where g_lowprec runs the same math in float32 with P and dS rounded to the input dtype (what
the kernel feeds its GEMMs) and eps = 1e-3 * max(1, ||g64||_inf). The accumulators start with
random values (the kernel adds to them) and NaN-poisoned memory is left behind by the caching
allocator before every launch; no NaN ever; rows and keys nothing covers keep their values
bitwise.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from ffa_kernels import testing
from ffa_kernels.testing import (
    block_causal_slices,
    grid_slices,
    segment_id_slices,
    sliding_window_slices,
    varlen_slices,
)

pytestmark = pytest.mark.gpu

pytest.importorskip("cutlass")


def dense_mask(q_ranges, k_ranges, types, tq, tk, device="cuda"):
    return testing.dense_mask(q_ranges, k_ranges, types, tq, tk).to(device)


def random_slices(rng, tq, tk, n):
    return grid_slices(rng, tq, tk, n, density=0.4)


def poison_allocator(nbytes: int):
    """Fill freed caching-allocator memory with NaN so fresh allocations start poisoned."""
    x = torch.full((nbytes // 4 + 1024,), float("nan"), dtype=torch.float32, device="cuda")
    del x


# ----------------------------------------------------------------------------- oracle
def oracle_grads(q, k, v, dout, q_ranges, k_ranges, types, scale, softcap=0.0):
    """dq, dk, dv in float64: autograd through `ffa_kernels.testing.dense_attention`."""
    xs = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    out, _, _ = testing.dense_attention(*xs, q_ranges, k_ranges, types, softmax_scale=scale, softcap=softcap)
    out.backward(dout.double())
    return tuple(x.grad for x in xs)


def lowprec_grads(q, k, v, dout, mask, scale, softcap=0.0):
    """The same gradients in float32 with P and dS rounded to q's dtype, as the kernel feeds its
    GEMMs: (dq, dk, dv) in float64; their distance to the oracle sets the tolerance."""
    dt = torch.float32
    hq, hk = q.shape[1], k.shape[1]
    rep = hq // hk
    qf = q.to(dt).transpose(0, 1)  # (H, Tq, D)
    kf = k.to(dt).repeat_interleave(rep, dim=1).transpose(0, 1)
    vf = v.to(dt).repeat_interleave(rep, dim=1).transpose(0, 1)
    dof = dout.to(dt).transpose(0, 1)
    x = torch.matmul(qf, kf.transpose(1, 2)) * scale  # (H, Tq, Tk)
    t = None
    if softcap > 0:
        t = torch.tanh(x / softcap)
        x = softcap * t
    s = torch.where(mask.unsqueeze(0), x, torch.tensor(float("-inf"), dtype=dt, device=q.device))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.where(mask.unsqueeze(0), torch.exp(s - safe.unsqueeze(-1)), torch.zeros_like(s))
    delta = (dof * torch.matmul(p, vf)).sum(-1, keepdim=True)
    p = p.to(q.dtype).to(dt)
    dv = torch.matmul(p.transpose(1, 2), dof)
    ds = p * (torch.matmul(dof, vf.transpose(1, 2)) - delta)
    if t is not None:
        ds = ds * (1 - t * t)
    ds = ds.to(q.dtype).to(dt)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(1, 2), qf) * scale

    def per_kv_head(g):  # (Hq, Tk, D) -> (Tk, Hk, D), summed over each kv head's q heads
        return g.reshape(hk, rep, *g.shape[1:]).sum(1).transpose(0, 1)

    return dq.transpose(0, 1).double(), per_kv_head(dk).double(), per_kv_head(dv).double()


def forward_out_lse(q, k, v, q_ranges, k_ranges, types, scale, softcap=0.0):
    """The final out (q's dtype) and lse (float32) the backward is given, from float64 math."""
    out, lse, _ = testing.dense_attention(
        q.double(), k.double(), v.double(), q_ranges, k_ranges, types, softmax_scale=scale, softcap=softcap
    )
    return out.to(q.dtype), lse.float().contiguous()


# half an ulp of a gradient returned in the input dtype, relative to its magnitude
_ROUNDING = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12}


def _check(name, got, ref, lowp, rounded_to=None):
    """``rounded_to``: the dtype ``got`` was returned in (its rounding is added to the bound)."""
    assert not torch.isnan(got).any(), f"NaN in {name}"
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    scale = max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    tol = 2 * ((lowp - ref).abs().max().item() if ref.numel() else 0.0) + 1e-3 * scale
    if rounded_to is not None:
        tol += _ROUNDING[rounded_to] * scale
    assert err <= tol, f"{name} err {err:.3e} > tol {tol:.3e}"
    return err, tol


def _inputs(q_ranges, k_ranges, types, tq, tk, hq, hk, d, dtype, softcap, seed, scale=None):
    """Random q, k, v, dout, the final out / lse, the dense mask and the range tensors."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tq, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(tk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(tk, hk, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(tq, hq, d, device="cuda", dtype=dtype, generator=g)
    mask = dense_mask(q_ranges, k_ranges, types, tq, tk, device="cuda")
    out, lse = forward_out_lse(
        q, k, v, q_ranges, k_ranges, types, d**-0.5 if scale is None else scale, softcap
    )
    ranges = (
        torch.tensor(q_ranges, dtype=torch.int32, device="cuda").reshape(-1, 2),
        torch.tensor(k_ranges, dtype=torch.int32, device="cuda").reshape(-1, 2),
        torch.tensor(types, dtype=torch.int32, device="cuda"),
    )
    return g, q, k, v, dout, out, lse, mask, ranges


def run_bwd_whole_case(
    q_ranges, k_ranges, types, tq, tk, hq=4, hk=4, d=128, dtype=torch.bfloat16, softcap=0.0, seed=0,
    heads_per_cta=None, deterministic=False, config=None,
):  # fmt: skip
    """`cute_backward` (gradients in the input dtype; dK/dV stored by the kernel when one CTA
    walks the whole GQA group) against the oracle; rows / keys nothing covers are exactly 0;
    ``deterministic``: bitwise equal over 3 runs."""
    from ffa_kernels.cute import cute_backward

    _, q, k, v, dout, out, lse, mask, ranges = _inputs(
        q_ranges, k_ranges, types, tq, tk, hq, hk, d, dtype, softcap, seed
    )
    scale = d**-0.5
    poison_allocator(8 * max(tq, tk) * hq * d * 4)
    grads = cute_backward(q, k, v, dout, out, lse, *ranges, softmax_scale=scale, softcap=softcap,
                          heads_per_cta=heads_per_cta, deterministic=deterministic, config=config)  # fmt: skip
    torch.cuda.synchronize()
    ref = oracle_grads(q, k, v, dout, q_ranges, k_ranges, types, scale, softcap)
    lowp = lowprec_grads(q, k, v, dout, mask, scale, softcap)
    for name, got, r, lp in zip(("dq", "dk", "dv"), grads, ref, lowp):
        assert got.dtype == dtype and got.shape == r.shape, (name, got.dtype, got.shape)
        _check(name, got.double(), r, lp, rounded_to=dtype)
    q_cov, k_cov = mask.any(dim=1), mask.any(dim=0)
    assert not grads[0][~q_cov].any(), "dq rows nothing covers are not 0"
    assert not grads[1][~k_cov].any() and not grads[2][~k_cov].any(), "dk/dv keys nothing covers are not 0"
    if deterministic:  # bitwise the same on two more runs
        for _ in range(2):
            again = cute_backward(q, k, v, dout, out, lse, *ranges, softmax_scale=scale, softcap=softcap,
                                  heads_per_cta=heads_per_cta, deterministic=True, config=config)  # fmt: skip
            for name, a, b in zip(("dq", "dk", "dv"), grads, again):
                assert torch.equal(a, b), f"{name} differs between deterministic runs"


def run_bwd_case(
    q_ranges, k_ranges, types, tq, tk, hq=4, hk=4, d=128, dtype=torch.bfloat16, softcap=0.0, seed=0,
    acc_layout="separate", config=None, scale=None,
):  # fmt: skip
    from ffa_kernels.cute import cute_backward_stage

    g, q, k, v, dout, out, lse, mask, ranges = _inputs(
        q_ranges, k_ranges, types, tq, tk, hq, hk, d, dtype, softcap, seed, scale
    )
    scale = d**-0.5 if scale is None else scale
    dq0 = torch.randn(tq, hq, d, device="cuda", generator=g)
    dk0 = torch.randn(tk, hk, d, device="cuda", generator=g)
    dv0 = torch.randn(tk, hk, d, device="cuda", generator=g)
    poison_allocator(8 * max(tq, tk) * hq * d * 4)
    dq = dq0.clone()
    if acc_layout == "packed":  # views of one (Tk, 2, Hk, D) buffer: updated in place
        dkv = torch.stack([dk0, dv0], dim=1)
        dk, dv = dkv[:, 0], dkv[:, 1]
    elif acc_layout == "offset":  # bases 4 bytes past an 8-byte boundary: through temporaries

        def offset_copy(x):
            buf = torch.empty(x.numel() + 1, device="cuda")
            y = buf[1:].view(x.shape)
            y.copy_(x)
            return y

        dq, dk, dv = offset_copy(dq0), offset_copy(dk0), offset_copy(dv0)
        assert dk.data_ptr() % 8 == 4 and dq.data_ptr() % 16 != 0
    else:
        dk, dv = dk0.clone(), dv0.clone()
    cute_backward_stage(
        q, k, v, dout, out, lse, *ranges, dq, dk, dv, softmax_scale=scale, softcap=softcap, config=config
    )
    torch.cuda.synchronize()
    ref = oracle_grads(q, k, v, dout, q_ranges, k_ranges, types, scale, softcap)
    lowp = lowprec_grads(q, k, v, dout, mask, scale, softcap)
    errs = {}
    for name, got, base, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), (dq0, dk0, dv0), ref, lowp):
        errs[name] = _check(name, got.double() - base.double(), r, lp)
    # rows / keys nothing covers: accumulators bitwise unchanged
    q_cov, k_cov = mask.any(dim=1), mask.any(dim=0)
    assert torch.equal(dq[~q_cov], dq0[~q_cov]), "dq rows nothing covers changed"
    assert torch.equal(dk[~k_cov], dk0[~k_cov]), "dk rows nothing covers changed"
    assert torch.equal(dv[~k_cov], dv0[~k_cov]), "dv rows nothing covers changed"
    return errs


# ----------------------------------------------------------------------------- tests
@pytest.mark.sm90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bwd_full_and_causal(d, dtype):
    run_bwd_case([[0, 1000]], [[0, 1000]], [0], 1000, 1000, d=d, dtype=dtype)
    run_bwd_case([[0, 700]], [[0, 900]], [1], 700, 900, d=d, dtype=dtype)
    run_bwd_case([[0, 900]], [[0, 300]], [1], 900, 300, d=d, dtype=dtype)


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [0.3, 0.05])
def test_bwd_softmax_scales(dtype, scale):
    """Scales other than D ** -0.5: bfloat16 folds the scale into P (lse2 shifted, dV divided
    by it at the end), float16 multiplies dQ and dK by it instead (bwd_interface.fold_scale);
    with and without softcap. (Scales <= 0 are declined: test_backend.py.)"""
    run_bwd_case([[0, 700]], [[0, 900]], [1], 700, 900, d=64, dtype=dtype, scale=scale)
    qr, kr, ty, t = varlen_slices([1, 77, 300, 129], 1)
    run_bwd_case(qr, kr, ty, t, t, hq=4, hk=2, dtype=dtype, scale=scale, softcap=20.0 if scale > 0.1 else 0.0)


@pytest.mark.sm90
@pytest.mark.parametrize("d, deterministic", [(128, False), (128, True), (64, False)])
def test_bwd_64_row_blocks(d, deterministic):
    """64-row q blocks (the defaults are 80 rows at D 128 and 128 at D 64; 64 rows serve
    softcap, and without softcap they issue dV's GEMM before the dP^T wait): full, causal,
    documents, random slices sharing q rows, GQA, fp16; the whole-call backward too."""
    from ffa_kernels.cute.config import BwdConfig

    cfg = BwdConfig(head_dim=d, tile_m=64)
    if not deterministic:
        run_bwd_case([[0, 1000]], [[0, 1000]], [0], 1000, 1000, d=d, config=cfg)
        run_bwd_case([[0, 700]], [[0, 900]], [1], 700, 900, d=d, dtype=torch.float16, hq=8, hk=2, config=cfg)
        qr, kr, ty, t = varlen_slices([1, 77, 300, 129, 513], 1)
        run_bwd_case(qr, kr, ty, t, t, d=d, config=cfg)
        rng = random.Random(11)
        qr, kr, ty = random_slices(rng, 900, 1100, 5)
        run_bwd_case(qr, kr, ty, 900, 1100, d=d, config=cfg)
    qr, kr, ty, t = varlen_slices([300, 500, 161], 0)
    run_bwd_whole_case(qr, kr, ty, t, t, d=d, hq=4, hk=2, deterministic=deterministic, config=cfg)


@pytest.mark.sm90
@pytest.mark.parametrize("typ", [0, 1, 2, 3])
def test_bwd_varlen_each_type(typ):
    qr, kr, ty, t = varlen_slices([1, 77, 128, 300, 129, 513], typ)
    run_bwd_case(qr, kr, ty, t, t, d=128)


@pytest.mark.sm90
def test_bwd_shared_q_rows_mixed_types():
    qr = [[0, 300], [0, 300], [300, 310], [310, 600], [310, 600]]
    kr = [[0, 100], [100, 500], [0, 700], [0, 50], [60, 61]]
    ty = [1, 2, 3, 1, 0]
    run_bwd_case(qr, kr, ty, 640, 700, d=64, dtype=torch.float16)
    run_bwd_case(qr, kr, ty, 640, 700, d=128)


@pytest.mark.sm90
@pytest.mark.parametrize("seed", range(6))
def test_bwd_random_slices(seed):
    rng = random.Random(seed)
    tq, tk = rng.randrange(1, 1500), rng.randrange(1, 1500)
    qr, kr, ty = random_slices(rng, tq, tk, rng.randrange(1, 7))
    d = rng.choice([64, 128])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    run_bwd_case(qr, kr, ty, tq, tk, d=d, dtype=dtype, seed=seed)


@pytest.mark.sm90
def test_bwd_uncovered_rows_and_empty():
    run_bwd_case([[100, 400]], [[0, 256]], [0], 512, 256)
    run_bwd_case([[0, 0]], [[0, 0]], [0], 200, 100)


@pytest.mark.sm90
def test_bwd_prepare_is_reused_by_the_stage():
    """`ffa_backward_prepare` launches the preprocess once, the stage that follows with the same
    dout / out / lse launches none, and its gradients are bitwise those of a stage without it
    (deterministic mode: repeatable, so equality is the check); prepared for another scale, or
    for a dout the stage converts, the stage launches its own and the gradients are the same."""
    from ffa_kernels import ffa_backward_prepare, ffa_backward_stage

    qr, kr, types = [[0, 300], [300, 700]], [[0, 500], [200, 900]], [1, 0]
    _, q, k, v, dout, out, lse, _, ranges = _inputs(
        qr, kr, types, 700, 900, 8, 2, 128, torch.bfloat16, 0.0, 3
    )
    # (prepare's arguments, its launches, the stage's launches); None: no prepare
    cases = [
        (None, 0, 1),
        ({}, 1, 0),
        ({"softmax_scale": 0.5 * 128**-0.5}, 1, 1),  # another fold: the stage's own
        ({"dout": torch.float32}, 0, 1),  # the stage converts dout: nothing to prepare
    ]
    with testing.preprocess_launches() as launches:
        grads = []
        for prep, n_prep, n_stage in cases:
            do = dout.clone()  # another identity: an earlier case's cached statistics do not serve
            acc = [torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in (q, k, v)]
            before = len(launches)
            if prep is not None:
                kw = {k_: v_ for k_, v_ in prep.items() if k_ != "dout"}
                ffa_backward_prepare(do.to(prep.get("dout", do.dtype)), q, v, out, lse, **kw)
            assert len(launches) == before + n_prep, (prep, len(launches) - before)
            ffa_backward_stage(do, q, k, v, out, lse, *ranges, *acc, deterministic=True)
            assert len(launches) == before + n_prep + n_stage, (prep, len(launches) - before)
            grads.append(acc)
    assert grads[0][0].abs().max() > 0
    for got in grads[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), grads[0], got):
            assert torch.equal(a, b), f"{name} differs with the preprocess prepared"


@pytest.mark.sm90
@pytest.mark.parametrize("hq,hk", [(8, 2), (8, 1), (64, 8), (8, 8)])
def test_bwd_gqa(hq, hk):
    qr, kr, ty, t = varlen_slices([333, 700, 64], 1)
    run_bwd_case(qr, kr, ty, t, t, hq=hq, hk=hk)


@pytest.mark.sm90
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_softcap(d):
    qr, kr, ty, t = varlen_slices([500, 300], 1)
    run_bwd_case(qr, kr, ty, t, t, d=d, softcap=20.0)
    run_bwd_case(qr, kr, ty, t, t, d=d, softcap=5.0)


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_sliding_window_block_causal_and_segment_ids(dtype, d):
    qr, kr, ty = sliding_window_slices(1500, 200)
    run_bwd_case(qr, kr, ty, 1500, 1500, d=d, dtype=dtype)
    qr, kr, ty, t = block_causal_slices([700, 129, 1000], 128)
    run_bwd_case(qr, kr, ty, t, t, d=d, dtype=dtype)
    ids = [1] * 300 + [2] * 250 + [1] * 200 + [3] * 77 + [2] * 100
    qr, kr, ty = segment_id_slices(ids)
    run_bwd_case(qr, kr, ty, len(ids), len(ids), d=d, dtype=dtype, hq=8, hk=2)


@pytest.mark.sm90
@pytest.mark.parametrize(
    "hq,hk,heads_per_cta", [(4, 4, None), (8, 2, None), (8, 2, 2), (8, 2, 1), (16, 1, 4)]
)
def test_bwd_whole_call(hq, hk, heads_per_cta):
    """One whole backward in the input dtype: dK/dV stored by the kernel (one CTA per K/V head
    walking its whole group) or summed in float32 (the group split over CTAs)."""
    qr, kr, ty, t = varlen_slices([1, 300, 129, 513], 1)
    run_bwd_whole_case(qr, kr, ty, t, t, hq=hq, hk=hk, heads_per_cta=heads_per_cta)
    # key tiles nothing covers (keys 600..1100 of 1100): zeros, not left uninitialised
    run_bwd_whole_case([[0, 500]], [[0, 600]], [1], 500, 1100, hq=hq, hk=hk, heads_per_cta=heads_per_cta)


@pytest.mark.sm90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hk,heads_per_cta", [(4, 4, None), (8, 2, None), (8, 2, 1)])
def test_bwd_segment_key_tiles(d, hq, hk, heads_per_cta, monkeypatch):
    """Per-document key tiles forced (tile_plan.SEGMENT_ROWS): short documents with gaps, the
    keys not a multiple of 128. A key tile that stops at its document's end adds or stores dK/dV
    below its end only (with one writer per row: register stores, the next tile's rows left to
    it; whole tiles by TMA), keys of no document are 0, dQ gets each cell once; causal and full,
    softcap; in the poisoned allocator's memory (a row nobody writes would be NaN)."""
    from ffa_kernels.cute import tile_plan
    from ffa_kernels.cute.tile_plan import build_bwd_plan_cpu

    monkeypatch.setattr(tile_plan, "SEGMENT_ROWS", True)
    tk = 1700
    rng = random.Random(40 + d + hq)
    docs, row = [], rng.randrange(0, 30)
    while row < tk:
        n = min(rng.choice([1, 9, 63, 100, 127, 129, 250]), tk - row)
        docs.append([row, row + n])
        row += n + rng.choice([0, 0, 5, 140])
    for typ, softcap in ((1, 0.0), (0, 10.0)):
        ty = [typ] * len(docs)
        work, _, _ = build_bwd_plan_cpu(torch.tensor(docs), torch.tensor(docs), torch.tensor(ty), tk, 128, 80)
        n0, n_stop = work[:, 0].tolist(), work[:, 4].tolist()
        assert any(s < min(a + 128, tk) for a, s in zip(n0, n_stop)), "tiles that stop early are expected"
        run_bwd_whole_case(docs, docs, ty, tk, tk, hq=hq, hk=hk, d=d, softcap=softcap, seed=typ,
                           heads_per_cta=heads_per_cta)  # fmt: skip


@pytest.mark.sm90
@pytest.mark.parametrize("heads_per_cta", [None, 1])
@pytest.mark.parametrize("seed", range(4))
def test_bwd_deterministic_kernel(seed, heads_per_cta):
    """deterministic=True runs the kernel with ordered dQ adds (and, with a GQA group split
    over CTAs, ordered dK/dV adds: 4 addends per key, where the order changes the sum):
    correct, and bitwise equal over 3 runs (random slices that share q rows and key tiles)."""
    rng = random.Random(300 + seed)
    tq, tk = rng.randrange(64, 1500), rng.randrange(64, 1500)
    qr, kr, ty = random_slices(rng, tq, tk, rng.randrange(1, 7))
    run_bwd_whole_case(qr, kr, ty, tq, tk, hq=8, hk=2, d=rng.choice([64, 128]), seed=seed,
                       heads_per_cta=heads_per_cta, deterministic=True)  # fmt: skip
    qr, kr, ty, t = varlen_slices([1, 300, 129, 2000], 1)
    run_bwd_whole_case(qr, kr, ty, t, t, hq=4, hk=4, deterministic=True)


@pytest.mark.sm90
@pytest.mark.parametrize("seed", range(4))
def test_bwd_whole_call_random(seed):
    rng = random.Random(100 + seed)
    tq, tk = rng.randrange(1, 1500), rng.randrange(1, 1500)
    qr, kr, ty = random_slices(rng, tq, tk, rng.randrange(1, 7))
    run_bwd_whole_case(qr, kr, ty, tq, tk, hq=4, hk=2, d=rng.choice([64, 128]),
                       dtype=rng.choice([torch.bfloat16, torch.float16]), seed=seed,
                       softcap=rng.choice([0.0, 10.0]))  # fmt: skip


@pytest.mark.sm90
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fold", [1.0, 128**-0.5])
def test_bwd_preprocess_kernel(out_dtype, d, fold):
    """lse2 (shifted by -log2(fold)) and delta from the preprocess kernel equal torch's float32
    math; uncovered rows (lse = -inf) get +inf, the padding +inf / 0."""
    from ffa_kernels.cute.bwd_interface import bwd_preprocess

    tq, hq = 1037, 6
    dout = torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.randn(tq, hq, d, device="cuda", dtype=out_dtype)
    lse = torch.randn(tq, hq, device="cuda") * 5
    lse[::7, 1] = float("-inf")
    stats = bwd_preprocess(dout, out, lse, fold)
    torch.cuda.synchronize()
    delta = (dout.float() * out.float()).sum(-1).t()
    shifted = lse.t() * 1.4426950408889634 - math.log2(fold)
    lse2 = torch.where(lse.t() == float("-inf"), float("inf"), shifted)
    assert torch.allclose(stats[1, :, :tq], delta, rtol=1e-5, atol=1e-4)
    assert torch.allclose(stats[0, :, :tq], lse2, rtol=1e-6, atol=1e-6)
    assert torch.equal(stats[0, :, :tq].isinf(), lse2.isinf())
    assert bool((stats[0, :, tq:] == float("inf")).all()) and not stats[1, :, tq:].any()


@pytest.mark.sm90
@pytest.mark.parametrize("acc_layout", ["packed", "offset"])
def test_bwd_accumulator_layouts(acc_layout):
    qr, kr, ty, t = varlen_slices([300, 500], 1)
    run_bwd_case(qr, kr, ty, t, t, hq=4, hk=2, acc_layout=acc_layout)


@pytest.mark.sm90
def test_bwd_stages_sum_to_one_call():
    """Two stages over a split of the keys add up to one call over all of them."""
    from ffa_kernels.cute import cute_backward_stage

    t, hq, hk, d = 1100, 4, 2, 128
    q, k, v, dout = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk, hq))
    out, lse = forward_out_lse(q, k, v, [[0, t]], [[0, t]], [1], d**-0.5)
    r = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    whole = [torch.zeros(t, h, d, device="cuda") for h in (hq, hk, hk)]
    cute_backward_stage(
        q, k, v, dout, out, lse, r([[0, t]]), r([[0, t]]), r([1]), *whole, softmax_scale=None, softcap=0.0
    )
    split = [torch.zeros(t, h, d, device="cuda") for h in (hq, hk, hk)]
    # the causal mask as three stages: keys [0, 400) (their causal corner, then the FULL block
    # below it) and keys [400, t) (causal)
    for qr, kr, ty in (
        ([[0, 400]], [[0, 400]], [1]),
        ([[400, t]], [[0, 400]], [0]),
        ([[0, t]], [[400, t]], [1]),
    ):
        cute_backward_stage(
            q, k, v, dout, out, lse, r(qr), r(kr), r(ty), *split, softmax_scale=None, softcap=0.0
        )
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()


@pytest.mark.sm90
@pytest.mark.parametrize("sink_layout", [None, "sh", "ssh"])
def test_flex_flash_attn_autograd_uses_kernel(monkeypatch, sink_layout):
    """flex_flash_attn_func's backward runs the kernel (FFA_BACKEND=cute: no silent fallback)
    and its dq, dk, dv, dsink match float64 autograd through the reference backend."""
    from ffa_kernels import flex_flash_attn_func

    qr, kr, ty, t = varlen_slices([300, 457], 1)
    hq, hk, d = 4, 2, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hk, hk))
    dout = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = None
    if sink_layout == "sh":
        sink = torch.randn(2, hq, device="cuda", generator=g)
    elif sink_layout == "ssh":
        sink = torch.randn(t, 3, hq, device="cuda", generator=g)
    r = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731

    def grads(xs, backend):
        monkeypatch.setenv("FFA_BACKEND", backend)
        xs = [x.detach().clone().requires_grad_(True) if x is not None else None for x in xs]
        out, _ = flex_flash_attn_func(
            *xs[:3], r(qr), r(kr), r(ty), sink=xs[3], sink_layout=sink_layout or "sh"
        )
        out.backward(dout.to(out.dtype))
        return [x.grad if x is not None else None for x in xs]

    got = grads([q, k, v, sink], "cute")
    ref = grads([x.double() if x is not None else None for x in (q, k, v, sink)], "reference")
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, ref):
        if b is None:
            continue
        assert not torch.isnan(a).any(), name
        err = (a.double() - b).abs().max().item()
        assert err <= 2e-2 * max(1.0, b.abs().max().item()), f"{name}: err {err:.3e}"


@pytest.mark.sm90
def test_deterministic_backward_is_bitwise_reproducible():
    """deterministic=True through flex_flash_attn_func: dq, dk, dv bitwise equal over 3 runs
    (GQA: the kernel sums a group's dK/dV in one CTA and orders the dQ adds)."""
    from ffa_kernels import flex_flash_attn_func

    qr, kr, ty, t = varlen_slices([700, 900], 1)
    r = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    q, k, v = (torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    dout = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out, _ = flex_flash_attn_func(*xs, r(qr), r(kr), r(ty), deterministic=True)
        out.backward(dout)
        runs.append([x.grad for x in xs])
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


@pytest.mark.sm90
def test_bwd_dout_layouts_through_autograd():
    """flex_flash_attn_func's backward on the kernel with a non-contiguous, an expanded and a
    float32 output gradient: bitwise the gradients of the contiguous bf16 one (deterministic
    mode, so that equal inputs give equal bits); a wrong shape is an error."""
    from ffa_kernels import flex_flash_attn_func

    torch.manual_seed(0)
    tq, h, d = 700, 4, 128
    q, k, v = (
        torch.randn(tq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    qr = torch.tensor([[0, 300], [300, 700]], dtype=torch.int32, device="cuda")
    ty = torch.tensor([1, 1], dtype=torch.int32, device="cuda")

    def grads(dout):
        out, _ = flex_flash_attn_func(q, k, v, qr, qr, ty, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    base = torch.randn(d, h, tq, device="cuda").to(torch.bfloat16)
    strided = base.permute(2, 1, 0)  # (tq, h, d), not contiguous
    row = torch.randn(1, h, d, device="cuda", dtype=torch.bfloat16).expand(tq, h, d)
    for dout in (strided, row):
        for g, w in zip(grads(dout), grads(dout.contiguous())):
            assert torch.isfinite(g).all() and torch.equal(g, w)
    for g, w in zip(grads(strided.float()), grads(strided.contiguous())):  # autograd casts to bf16
        assert torch.equal(g, w)
    with pytest.raises(RuntimeError, match=r"(?i)shape"):
        grads(torch.randn(tq, h, d - 1, device="cuda", dtype=torch.bfloat16))


@pytest.mark.sm90
def test_bwd_stage_deterministic_is_bitwise_repeatable():
    """ffa_backward_stage(deterministic=True) on the kernel: 3 runs add bitwise the same into
    float32 accumulators (GQA 8:1, a group split over CTAs), and agree with the default mode."""
    from ffa_kernels import ffa_backward_stage

    rng = random.Random(7)
    tq, tk = 900, 1100
    qr, kr, ty = random_slices(rng, tq, tk, 5)
    _, q, k, v, dout, out, lse, _, ranges = _inputs(qr, kr, ty, tq, tk, 8, 1, 128, torch.bfloat16, 0.0, 7)
    results = []
    for det in (True, True, True, False):
        accs = [torch.zeros(x.shape, device="cuda") for x in (q, k, v)]
        ffa_backward_stage(dout, q, k, v, out, lse, *ranges, *accs, deterministic=det)
        results.append(accs)
    for run in results[1:3]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], run))
    for a, b in zip(results[0], results[3]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
