"""GPU correctness of the sm90 CuTe DSL forward against a dense float64 oracle (self-contained).

Tolerance: ||out - ref64||_inf <= 2 * ||ref_lowprec - ref64||_inf + 1e-3, where ref_lowprec runs the
same math with P rounded to the input dtype; lse within 1e-3 relative; uncovered rows exactly
out = 0 / lse = -inf; the outputs' memory is poisoned with NaN before every launch.
"""

from __future__ import annotations

import random

import pytest
import torch

from ffa_kernels.testing import (
    block_causal_slices,
    grid_slices,
    segment_id_slices,
    sliding_window_slices,
    varlen_slices,
)

pytestmark = pytest.mark.gpu

pytest.importorskip("cutlass")


# ----------------------------------------------------------------------------- oracle
def dense_mask(q_ranges, k_ranges, types, tq, tk, device="cpu"):
    m = torch.zeros(tq, tk, dtype=torch.bool, device=device)
    for (qs, qe), (ks, ke), t in zip(q_ranges, k_ranges, types):
        sq, sk = qe - qs, ke - ks
        if sq <= 0 or sk <= 0:
            continue
        i = torch.arange(sq, device=device).unsqueeze(1)
        j = torch.arange(sk, device=device).unsqueeze(0)
        c = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if t in (1, 3):
            c &= j <= i + (sk - sq)
        if t in (2, 3):
            c &= j >= i
        assert not (m[qs:qe, ks:ke] & c).any(), "test bug: slices overlap"
        m[qs:qe, ks:ke] |= c
    return m


def oracle(q, k, v, mask, scale, softcap=0.0, sink=None, sink_layout="sh", lowprec=False):
    """Dense attention. Returns (out f64, lse f64 (Tq,Hq), max_logits f64 (Hq,))."""
    dt = torch.float32 if lowprec else torch.float64
    tq, hq, _ = q.shape
    hk = k.shape[1]
    rep = hq // hk
    qf = q.to(dt).transpose(0, 1)  # (H, Tq, D)
    kf = k.to(dt).repeat_interleave(rep, dim=1).transpose(0, 1)
    vf = v.to(dt).repeat_interleave(rep, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # (H, Tq, Tk)
    neg = torch.tensor(float("-inf"), dtype=dt, device=q.device)
    max_logits = torch.where(mask, s, neg).amax(dim=(1, 2))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = torch.where(mask.unsqueeze(0), s, neg)
    lse = torch.logsumexp(s, dim=-1)  # (H, Tq)
    if sink is not None:
        sk = sink.to(device=q.device, dtype=dt)
        sink_lse = torch.logsumexp(sk, dim=0) if sink_layout == "sh" else torch.logsumexp(sk, dim=1).T
        if sink_lse.dim() == 1:
            sink_lse = sink_lse.unsqueeze(1).expand(hq, tq)
        lse = torch.logaddexp(lse, sink_lse)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    p = torch.where(mask.unsqueeze(0), p, torch.zeros_like(p))
    if lowprec:
        p = p.to(q.dtype).to(dt)
    out = torch.matmul(p, vf).transpose(0, 1)  # (Tq, H, D)
    if lowprec:
        out = out.to(q.dtype)
    return out.to(torch.float64), lse.T.to(torch.float64), max_logits.to(torch.float64)


def poison_allocator(nbytes: int):
    """Fill freed caching-allocator memory with NaN so torch.empty outputs start poisoned."""
    x = torch.full((nbytes // 4 + 1024,), float("nan"), dtype=torch.float32, device="cuda")
    del x


def run_case(
    q_ranges, k_ranges, types, tq, tk, hq=4, hk=4, d=128, dtype=torch.bfloat16, softcap=0.0,
    sink_layout=None, max_logits=False, seed=0, dv=None,
):  # fmt: skip
    """cute_forward against the oracle; ``dv``: v's (and out's) head dim (None: d)."""
    from ffa_kernels.cute import cute_forward

    dv = d if dv is None else dv
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tq, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(tk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(tk, hk, dv, device="cuda", dtype=dtype, generator=g)
    sink = None
    if sink_layout == "sh":
        sink = torch.randn(2, hq, device="cuda", generator=g)
    elif sink_layout == "ssh":
        sink = torch.randn(tq, 3, hq, device="cuda", generator=g)
    scale = d**-0.5
    mask = dense_mask(q_ranges, k_ranges, types, tq, tk, device="cuda")
    poison_allocator(4 * tq * hq * d * 4)
    out, lse, ml = cute_forward(
        q, k, v,
        torch.tensor(q_ranges, dtype=torch.int32, device="cuda").reshape(-1, 2),
        torch.tensor(k_ranges, dtype=torch.int32, device="cuda").reshape(-1, 2),
        torch.tensor(types, dtype=torch.int32, device="cuda"),
        softmax_scale=scale, softcap=softcap, sink=sink, sink_layout=sink_layout or "sh",
        return_max_logits=max_logits,
    )  # fmt: skip
    torch.cuda.synchronize()
    o64, l64, m64 = oracle(q, k, v, mask, scale, softcap, sink, sink_layout or "sh")
    olp, _, _ = oracle(q, k, v, mask, scale, softcap, sink, sink_layout or "sh", lowprec=True)
    assert out.shape == (tq, hq, dv) and out.dtype == q.dtype
    assert lse.shape == (tq, hq) and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    err = (out.double() - o64).abs().max().item()
    tol = 2 * (olp - o64).abs().max().item() + 1e-3
    assert err <= tol, f"out err {err:.3e} > tol {tol:.3e}"
    fin = torch.isfinite(l64)
    assert torch.equal(torch.isfinite(lse), fin), "lse finiteness differs"
    lerr = ((lse.double() - l64).abs() / l64.abs().clamp_min(1.0))[fin]
    assert lerr.numel() == 0 or lerr.max().item() <= 1e-3, f"lse rel err {lerr.max().item():.3e}"
    covered = mask.any(dim=1)
    if sink is None:
        assert torch.all(lse[~covered] == float("-inf")), "uncovered rows must have lse = -inf"
    assert torch.all(out[~covered] == 0), "uncovered rows must have out = 0"
    if max_logits:
        assert ml is not None and ml.shape == (hq,)
        fm = torch.isfinite(m64)
        assert torch.equal(torch.isfinite(ml), fm)
        assert torch.allclose(ml.double()[fm], m64[fm], rtol=1e-3, atol=1e-3), (ml, m64)
    else:
        assert ml is None
    return err, tol


def random_slices(rng, tq, tk, n):
    return grid_slices(rng, tq, tk, n, density=0.4)


# ----------------------------------------------------------------------------- tests
@pytest.mark.sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_full_and_causal(d, dtype):
    run_case([[0, 1000]], [[0, 1000]], [0], 1000, 1000, d=d, dtype=dtype)
    run_case([[0, 700]], [[0, 900]], [1], 700, 900, d=d, dtype=dtype)  # bottom-right causal, sq < sk
    run_case([[0, 900]], [[0, 300]], [1], 900, 300, d=d, dtype=dtype)  # sq > sk: first rows empty


@pytest.mark.sm90
@pytest.mark.parametrize("typ", [0, 1, 2, 3])
def test_varlen_each_type(typ):
    qr, kr, ty, t = varlen_slices([1, 77, 128, 300, 129, 513], typ)
    run_case(qr, kr, ty, t, t, d=128)


def _short_documents(seed: int, tq: int) -> list[list[int]]:
    """Documents of 1-300 rows, some rows between them in no document."""
    rng = random.Random(seed)
    docs, row = [], rng.randrange(0, 40)
    while row < tq:
        n = min(rng.choice([1, 5, 63, 64, 65, 127, 129, 200, 300]), tq - row)
        docs.append([row, row + n])
        row += n + rng.choice([0, 0, 0, 3, 130])
    return docs


@pytest.mark.sm90
@pytest.mark.parametrize("typ", [0, 1])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_short_documents_on_segment_tiles(typ, d, monkeypatch):
    """Short documents with gaps on per-document tiles (forced: tile_plan.SEGMENT_ROWS): the
    plan's q tiles start at every document (tile_plan.row_tiles); a tile that stops before the
    grid's end stores only its rows (from registers), the next tile's rows stay theirs (the
    poisoned memory would show NaN), and the rows it computes past its end count toward no
    max_logits. GQA, softcap and a sink."""
    from ffa_kernels.cute import tile_plan
    from ffa_kernels.cute.tile_plan import build_plan_cpu

    monkeypatch.setattr(tile_plan, "SEGMENT_ROWS", True)
    tq = 2000
    qr = _short_documents(7 + typ, tq)
    ty = [typ] * len(qr)
    work, _, _ = build_plan_cpu(torch.tensor(qr), torch.tensor(qr), torch.tensor(ty), tq, 128, 128)
    assert any(m0 % 128 for m0 in work[:, 0].tolist()), "the plan is expected to use segment tiles"
    run_case(qr, qr, ty, tq, tq, hq=8, hk=2, d=d, softcap=20.0, max_logits=True, sink_layout="sh")
    run_case(qr, qr, ty, tq, tq, hq=4, hk=4, d=d, dtype=torch.float16)
    from ffa_kernels.cute import interface

    monkeypatch.setattr(interface, "PACK_GQA", False)  # the GQA case again on unpacked tiles
    run_case(qr, qr, ty, tq, tq, hq=8, hk=2, d=d, softcap=20.0, max_logits=True, sink_layout="sh")


@pytest.mark.sm90
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("hq,hk", [(16, 2), (8, 4), (12, 3)])
def test_packed_gqa_tiles(d, dv, hq, hk, monkeypatch):
    """GQA packed tiles (forced: interface.PACK_GQA): a tile's row p is token m0 + p // G of q
    head hk * G + p % G, G = hq / hk (8, 2, 4). Short documents with gaps (uncovered rows: out 0,
    lse -inf), on per-document tiles and on the grid, 1500 rows (not a multiple of any tile's
    tokens); every mask type at D 128, causal with softcap, a sink and max_logits at every head
    dim; a sliding window."""
    from ffa_kernels.cute import interface, tile_plan

    monkeypatch.setattr(interface, "PACK_GQA", True)
    tq = 1500
    qr = _short_documents(11, tq)
    for seg in (True, False):
        monkeypatch.setattr(tile_plan, "SEGMENT_ROWS", seg)
        types = (0, 1, 2, 3) if d == 128 else (1,)
        for typ in types:
            run_case(qr, qr, [typ] * len(qr), tq, tq, hq=hq, hk=hk, d=d, dv=dv, seed=typ)
        run_case(qr, qr, [1] * len(qr), tq, tq, hq=hq, hk=hk, d=d, dv=dv, softcap=20.0,
                 max_logits=True, sink_layout="ssh", seed=5)  # fmt: skip
    qr, kr, ty = sliding_window_slices(tq, 200)
    run_case(qr, kr, ty, tq, tq, hq=hq, hk=hk, d=d, dv=dv, max_logits=True, sink_layout="sh")


@pytest.mark.sm90
def test_packed_gqa_chosen_by_plan_cost(monkeypatch):
    """Unforced (the default), 64:8 many short documents take packed tiles
    (choose_pack), the results as the unpacked kernel's within the oracle's tolerance; and
    $FFA_PACK_GQA=0 keeps them unpacked."""
    from ffa_kernels.cute import interface

    monkeypatch.setattr(interface, "PACK_GQA", None)
    monkeypatch.delenv(interface.ENV_PACK_GQA, raising=False)
    chosen = []
    real = interface.choose_pack
    monkeypatch.setattr(interface, "choose_pack", lambda *a: chosen.append(real(*a)) or chosen[-1])
    docs = [[i * 100, i * 100 + 90] for i in range(20)]
    run_case(docs, docs, [1] * len(docs), 2000, 2000, hq=64, hk=8)
    assert chosen == [8]
    monkeypatch.setenv(interface.ENV_PACK_GQA, "0")
    run_case(docs, docs, [1] * len(docs), 2000, 2000, hq=64, hk=8)
    assert chosen == [8]  # not asked again: packing not allowed


@pytest.mark.sm90
def test_short_documents_accumulate(monkeypatch):
    """The accumulate epilogue on segment tiles (forced): two calls over the same short
    documents (first and second half of each document's keys), rows of no document bitwise
    untouched."""
    from ffa_kernels.cute import tile_plan

    monkeypatch.setattr(tile_plan, "SEGMENT_ROWS", True)
    tq = 1500
    docs = _short_documents(11, tq)
    first = [[a, a + max(1, (b - a) // 2)] for a, b in docs]
    second = [[a + max(1, (b - a) // 2), b] for a, b in docs if a + max(1, (b - a) // 2) < b]
    calls = [(docs, first, [0] * len(docs))]
    if second:
        calls.append(
            ([d for d in docs if d[0] + max(1, (d[1] - d[0]) // 2) < d[1]], second, [0] * len(second))
        )
    run_accumulate_case(calls, tq, tq, hq=8, hk=2, d=128, max_logits=True, poison_empty=True)


@pytest.mark.sm90
def test_shared_q_rows_mixed_types():
    qr = [[0, 300], [0, 300], [300, 310], [310, 600], [310, 600]]
    kr = [[0, 100], [100, 500], [0, 700], [0, 50], [60, 61]]
    ty = [1, 2, 3, 1, 0]
    run_case(qr, kr, ty, 640, 700, d=64, dtype=torch.float16)
    run_case(qr, kr, ty, 640, 700, d=128)


@pytest.mark.sm90
@pytest.mark.parametrize("seed", range(6))
def test_random_slices(seed):
    rng = random.Random(seed)
    tq, tk = rng.randrange(1, 1500), rng.randrange(1, 1500)
    qr, kr, ty = random_slices(rng, tq, tk, rng.randrange(1, 7))
    d = rng.choice([64, 128])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    run_case(qr, kr, ty, tq, tk, d=d, dtype=dtype, seed=seed)


@pytest.mark.sm90
def test_uncovered_rows_and_empty():
    # rows 0..99 and 400..511 uncovered
    run_case([[100, 400]], [[0, 256]], [0], 512, 256)
    # nothing at all
    run_case([[0, 0]], [[0, 0]], [0], 200, 100)


@pytest.mark.sm90
@pytest.mark.parametrize("pack", [False, None])  # unpacked GQA tiles, and the default choice
@pytest.mark.parametrize("hq,hk", [(8, 2), (8, 1), (6, 3), (64, 8), (8, 8)])
def test_gqa(hq, hk, pack, monkeypatch):
    from ffa_kernels.cute import interface

    monkeypatch.setattr(interface, "PACK_GQA", pack)
    qr, kr, ty, t = varlen_slices([333, 700, 64], 1)
    run_case(qr, kr, ty, t, t, hq=hq, hk=hk)


@pytest.mark.sm90
@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap_and_max_logits(d):
    qr, kr, ty, t = varlen_slices([500, 300], 1)
    run_case(qr, kr, ty, t, t, d=d, softcap=20.0, max_logits=True)
    run_case(qr, kr, ty, t, t, d=d, softcap=0.0, max_logits=True)
    run_case(qr, kr, ty, t, t, d=d, softcap=5.0)


@pytest.mark.sm90
@pytest.mark.parametrize("layout", ["sh", "ssh"])
def test_sink(layout):
    qr, kr, ty, t = varlen_slices([257, 400], 1)
    run_case(qr, kr, ty, t, t, sink_layout=layout)
    run_case([[100, 400]], [[0, 256]], [2], 512, 256, sink_layout=layout)


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sliding_window_block_causal_and_segment_ids(dtype, d):
    qr, kr, ty = sliding_window_slices(1500, 200)
    run_case(qr, kr, ty, 1500, 1500, d=d, dtype=dtype)
    qr, kr, ty, t = block_causal_slices([700, 129, 1000], 128)
    run_case(qr, kr, ty, t, t, d=d, dtype=dtype)
    ids = [1] * 300 + [2] * 250 + [1] * 200 + [3] * 77 + [2] * 100
    qr, kr, ty = segment_id_slices(ids)
    run_case(qr, kr, ty, len(ids), len(ids), d=d, dtype=dtype, hq=8, hk=2)


@pytest.mark.sm90
def test_long_varlen_causal():
    rng = random.Random(3)
    lengths = [rng.randrange(64, 1500) for _ in range(6)]
    qr, kr, ty, t = varlen_slices(lengths, 1)
    run_case(qr, kr, ty, t, t, hq=4, hk=2)


@pytest.mark.sm90
def test_deterministic_repeat():
    from ffa_kernels.cute import cute_forward

    qr, kr, ty, t = varlen_slices([700, 900], 1)
    q = torch.randn(t, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, 4, 128, device="cuda", dtype=torch.bfloat16)
    args = (
        torch.tensor(qr, dtype=torch.int32, device="cuda"),
        torch.tensor(kr, dtype=torch.int32, device="cuda"),
        torch.tensor(ty, dtype=torch.int32, device="cuda"),
    )
    kw = dict(softmax_scale=None, softcap=0.0, sink=None, sink_layout="sh", return_max_logits=False)
    o1, l1, _ = cute_forward(q, k, v, *args, **kw)
    o2, l2, _ = cute_forward(q, k, v, *args, **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


# ----------------------------------------------------------------------------- accumulate mode
def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, -0 != +0): 'not written at all'."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def run_accumulate_case(
    calls, tq, tk, prior=None, hq=4, hk=4, d=128, dtype=torch.bfloat16, softcap=0.0, max_logits=False,
    poison_empty=False, seed=0, dv=None,
):  # fmt: skip
    """cute_forward_accumulate once per call, into one float32 accumulator, vs the float64 oracle.

    calls: list of (q_ranges, k_ranges, types); prior: same, or None: the accumulator starts from
    the oracle result of these slices (a previous partial, computed elsewhere), else 0 / -inf.
    The cells of all slices together must be disjoint; their union is the oracle's mask.
    poison_empty: rows whose starting lse is -inf start with out = NaN (their out is ignored).
    dv: v's (and out_acc's) head dim (None: d).
    Checks: rows covered by some call match the union's oracle with run_case's tolerance; rows
    covered by no call are bitwise untouched (out, lse); max_logits_acc is max-updated.
    """
    from ffa_kernels.cute import cute_forward_accumulate

    dv = d if dv is None else dv
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tq, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(tk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(tk, hk, dv, device="cuda", dtype=dtype, generator=g)
    scale = d**-0.5
    all_slices = [s for c in ([prior] if prior else []) + list(calls) for s in zip(*c)]
    qa, ka, ta = ([list(s[i]) if i < 2 else s[i] for s in all_slices] for i in range(3))
    mask = dense_mask(qa, ka, ta, tq, tk, device="cuda")  # asserts the cells are disjoint
    if prior is not None:
        pmask = dense_mask(*prior, tq, tk, device="cuda")
        po, pl, pm = oracle(q, k, v, pmask, scale, softcap)
        out_acc = po.float().contiguous()
        lse_acc = pl.float().contiguous()
        ml_acc = pm.float().contiguous()
    else:
        out_acc = torch.zeros(tq, hq, dv, device="cuda", dtype=torch.float32)
        lse_acc = torch.full((tq, hq), float("-inf"), device="cuda", dtype=torch.float32)
        ml_acc = torch.full((hq,), float("-inf"), device="cuda", dtype=torch.float32)
    if poison_empty:
        out_acc[torch.isinf(lse_acc)] = float("nan")
    out0, lse0 = out_acc.clone(), lse_acc.clone()
    call_rows = torch.zeros(tq, dtype=torch.bool, device="cuda")
    for qr, kr, ty in calls:
        call_rows |= dense_mask(qr, kr, ty, tq, tk, device="cuda").any(dim=1)
        res = cute_forward_accumulate(
            q, k, v,
            torch.tensor(qr, dtype=torch.int32, device="cuda").reshape(-1, 2),
            torch.tensor(kr, dtype=torch.int32, device="cuda").reshape(-1, 2),
            torch.tensor(ty, dtype=torch.int32, device="cuda"),
            out_acc, lse_acc,
            softmax_scale=scale, softcap=softcap, max_logits_acc=ml_acc if max_logits else None,
        )  # fmt: skip
        assert res[0] is out_acc and res[1] is lse_acc
    torch.cuda.synchronize()
    o64, l64, m64 = oracle(q, k, v, mask, scale, softcap)
    olp, _, _ = oracle(q, k, v, mask, scale, softcap, lowprec=True)
    # rows no call covers: not written at all (also inside tiles that other rows keep busy)
    assert _bits_equal(out_acc[~call_rows], out0[~call_rows]), "a row no call covers was written (out)"
    assert _bits_equal(lse_acc[~call_rows], lse0[~call_rows]), "a row no call covers was written (lse)"
    rows = call_rows
    if prior is not None:  # rows of the prior alone were checked bitwise above; compare the rest
        rows = call_rows | ~torch.isinf(lse0).all(dim=1)
    o, lt = out_acc[rows], lse_acc[rows]
    assert not torch.isnan(o).any(), "NaN in out_acc"
    assert not torch.isnan(lt).any(), "NaN in lse_acc"
    err = (o.double() - o64[rows]).abs().max().item() if o.numel() else 0.0
    tol = 2 * (olp - o64).abs().max().item() + 1e-3
    assert err <= tol, f"out err {err:.3e} > tol {tol:.3e}"
    fin = torch.isfinite(l64[rows])
    assert torch.equal(torch.isfinite(lt), fin), "lse finiteness differs"
    lerr = ((lt.double() - l64[rows]).abs() / l64[rows].abs().clamp_min(1.0))[fin]
    assert lerr.numel() == 0 or lerr.max().item() <= 1e-3, f"lse rel err {lerr.max().item():.3e}"
    if max_logits:
        fm = torch.isfinite(m64)
        assert torch.equal(torch.isfinite(ml_acc), fm)
        assert torch.allclose(ml_acc.double()[fm], m64[fm], rtol=1e-3, atol=1e-3), (ml_acc, m64)
    return err, tol


def _three_key_sets(tq, tk, types=(0, 1, 2)):
    """Three calls over disjoint key sets [0, a), [a, b), [b, tk) with different q coverage:
    rows [0, tq/8) only call A, the middle all three, the last q tiles (past 0.8 tq) none."""
    a, b = tk // 3, (2 * tk) // 3
    qa, qb, qc = [0, (tq * 5) // 8], [tq // 8, (tq * 4) // 5], [tq // 4, (tq * 3) // 4]
    return [
        ([qa], [[0, a]], [types[0]]),
        ([qb], [[a, b]], [types[1]]),
        ([qc, [qc[1], (tq * 4) // 5]], [[b, tk], [b, tk]], [types[2], 0]),
    ]


@pytest.mark.sm90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accumulate_three_key_sets(d, dtype):
    # tq = 1200: rows past 960 are covered by no call, tiles 1024.. have no entries at all
    run_accumulate_case(_three_key_sets(1200, 900), 1200, 900, d=d, dtype=dtype)
    # causal with sq > sk inside a call: its first rows are empty inside tiles that have entries
    calls = [([[0, 500]], [[0, 200]], [1]), ([[0, 500]], [[200, 300]], [0])]
    run_accumulate_case(calls, 640, 300, d=d, dtype=dtype)


@pytest.mark.sm90
@pytest.mark.parametrize("seed", range(6))
def test_accumulate_random(seed):
    """Random disjoint slices dealt to 2-3 calls (by key block), optionally a prior partial."""
    rng = random.Random(100 + seed)
    tq, tk = rng.randrange(1, 1500), rng.randrange(2, 1500)
    qr, kr, ty = random_slices(rng, tq, tk, rng.randrange(1, 7))
    ncalls = rng.choice([2, 3])
    groups = [([], [], []) for _ in range(ncalls + 1)]  # the last one is the prior
    for s in zip(qr, kr, ty):
        grp = groups[rng.randrange(ncalls + 1) if seed % 2 else rng.randrange(ncalls)]
        for lst, x in zip(grp, s):
            lst.append(x)
    calls = [gp for gp in groups[:ncalls] if gp[0]]
    prior = groups[ncalls] if groups[ncalls][0] else None
    d = rng.choice([64, 128])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    run_accumulate_case(calls, tq, tk, prior=prior, d=d, dtype=dtype, seed=seed)


@pytest.mark.sm90
def test_accumulate_prior_and_poison():
    """Starting from a finite partial (rows of the prior only must stay bitwise untouched) and
    from NaN in the out of -inf rows (taken over where a call covers the row, kept elsewhere)."""
    calls = _three_key_sets(1100, 1000)
    prior = ([[1050, 1100]], [[0, 1000]], [1])  # rows no call covers: must stay bitwise as they were
    run_accumulate_case(calls, 1100, 1000, prior=prior)
    run_accumulate_case(calls, 1100, 1000, poison_empty=True)
    run_accumulate_case(calls, 1100, 1000, prior=prior, poison_empty=True, dtype=torch.float16, d=64)
    # a prior on the same rows as the calls, with its own keys: a three-way merge on most rows
    calls = [([[0, 800]], [[0, 300]], [0]), ([[100, 800]], [[300, 700]], [1])]
    prior = ([[0, 800]], [[700, 1000]], [0])
    run_accumulate_case(calls, 900, 1000, prior=prior, poison_empty=True)


@pytest.mark.sm90
@pytest.mark.parametrize("d", [64, 128, 256])
def test_accumulate_softcap_max_logits_gqa(d):
    calls = _three_key_sets(800, 700, types=(1, 0, 3))
    run_accumulate_case(calls, 800, 700, d=d, softcap=20.0, max_logits=True, hq=8, hk=2)
    run_accumulate_case(calls, 800, 700, d=d, softcap=0.0, max_logits=True, hq=6, hk=3)
    prior = ([[700, 800]], [[0, 700]], [0])
    run_accumulate_case(calls, 800, 700, d=d, softcap=5.0, max_logits=True, prior=prior)


@pytest.mark.sm90
def test_accumulate_one_call_matches_cute_forward_and_empty_call():
    from ffa_kernels.cute import cute_forward, cute_forward_accumulate

    qr, kr, ty, t = varlen_slices([700, 129, 300], 1)
    q = torch.randn(t, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, 4, 128, device="cuda", dtype=torch.bfloat16)
    args = tuple(torch.tensor(x, dtype=torch.int32, device="cuda") for x in (qr, kr, ty))
    out, lse, _ = cute_forward(
        q, k, v, *args, softmax_scale=None, softcap=0.0, sink=None, sink_layout="sh", return_max_logits=False
    )
    out_acc = torch.zeros(t, 4, 128, device="cuda")
    lse_acc = torch.full((t, 4), float("-inf"), device="cuda")
    cute_forward_accumulate(q, k, v, *args, out_acc, lse_acc, softmax_scale=None, softcap=0.0)
    torch.cuda.synchronize()
    # same math; out only differs by the bf16 rounding of the normal mode's output
    assert (out_acc - out.float()).abs().max().item() <= 1e-2
    assert torch.allclose(lse_acc, lse, rtol=1e-5, atol=1e-5)
    # a call that covers nothing (and one with no rows) leaves the accumulator bitwise untouched
    o0, l0 = out_acc.clone(), lse_acc.clone()
    empty = torch.tensor([[0, 0]], dtype=torch.int32, device="cuda")
    cute_forward_accumulate(q, k, v, empty, empty, None, out_acc, lse_acc, softmax_scale=None, softcap=0.0)
    torch.cuda.synchronize()
    assert _bits_equal(out_acc, o0) and _bits_equal(lse_acc, l0)


@pytest.mark.sm90
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)], ids=["d128", "mla192_128"])
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float64])
def test_frontend_stages_use_the_kernel(monkeypatch, acc_dtype, dims):
    """ffa_forward_stage on sm90 (FFA_BACKEND=cute: no silent fallback) over three key sets, then
    apply_sink, equals the one-call oracle with the sink; float32 accumulators are merged by the
    kernel's epilogue, float64 ones by torch. dims: (q/k head dim, v head dim)."""
    from ffa_kernels import apply_sink, ffa_forward_stage

    monkeypatch.setenv("FFA_BACKEND", "cute")
    tq, tk, hq, hk = 1000, 900, 8, 2
    d, dv = dims
    calls = _three_key_sets(tq, tk, types=(1, 0, 3))
    q = torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tk, hk, dv, device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(2, hq, device="cuda")
    out_acc = torch.zeros(tq, hq, dv, device="cuda", dtype=acc_dtype)
    lse_acc = torch.full((tq, hq), float("-inf"), device="cuda", dtype=acc_dtype)
    ml_acc = torch.full((hq,), float("-inf"), device="cuda", dtype=acc_dtype)
    for qr, kr, ty in calls:
        r = [torch.tensor(x, dtype=torch.int32, device="cuda").reshape(-1, 2) for x in (qr, kr)]
        ty = torch.tensor(ty, dtype=torch.int32, device="cuda")
        ffa_forward_stage(q, k, v, *r, ty, out_acc, lse_acc, softcap=10.0, max_logits_acc=ml_acc)
    apply_sink(out_acc, lse_acc, sink, "sh")
    slices = [s for c in calls for s in zip(*c)]
    mask = dense_mask(
        [list(s[0]) for s in slices], [list(s[1]) for s in slices], [s[2] for s in slices], tq, tk, "cuda"
    )
    o64, l64, m64 = oracle(q, k, v, mask, d**-0.5, 10.0, sink=sink)
    olp, _, _ = oracle(q, k, v, mask, d**-0.5, 10.0, sink=sink, lowprec=True)
    assert not torch.isnan(out_acc).any()
    err = (out_acc.double() - o64).abs().max().item()
    assert err <= 2 * (olp - o64).abs().max().item() + 1e-3, err
    assert torch.allclose(lse_acc.double(), l64, rtol=1e-3, atol=1e-3)
    assert torch.allclose(ml_acc.double(), m64, rtol=1e-3, atol=1e-3)


@pytest.mark.sm90
@pytest.mark.parametrize("layout", ["sh", "ssh"])
def test_whole_forward_uses_the_kernel(monkeypatch, layout):
    """ffa_forward on sm90 (FFA_BACKEND=cute): one kernel call with the sink inside, out in bf16,
    lse and max_logits float32, equal to the float64 oracle within the low-precision error."""
    from ffa_kernels import ffa_forward

    monkeypatch.setenv("FFA_BACKEND", "cute")
    tq, tk, hq, hk, d = 1000, 900, 8, 2, 128
    calls = _three_key_sets(tq, tk, types=(1, 0, 3))
    slices = [s for c in calls for s in zip(*c)]
    q = torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tk, hk, d, device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(*((2, hq) if layout == "sh" else (tq, 2, hq)), device="cuda")
    qr = torch.tensor([list(s[0]) for s in slices], dtype=torch.int32, device="cuda")
    kr = torch.tensor([list(s[1]) for s in slices], dtype=torch.int32, device="cuda")
    ty = torch.tensor([s[2] for s in slices], dtype=torch.int32, device="cuda")
    poison_allocator(tq * hq * d * 2)
    out, lse, ml = ffa_forward(q, k, v, qr, kr, ty, sink=sink, sink_layout=layout, softcap=10.0,
                               return_max_logits=True)  # fmt: skip
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and ml.dtype == torch.float32
    mask = dense_mask(qr.tolist(), kr.tolist(), ty.tolist(), tq, tk, "cuda")
    o64, l64, m64 = oracle(q, k, v, mask, d**-0.5, 10.0, sink, layout)
    olp, _, _ = oracle(q, k, v, mask, d**-0.5, 10.0, sink, layout, lowprec=True)
    err = (out.double() - o64).abs().max().item()
    assert err <= 2 * (olp - o64).abs().max().item() + 1e-3, err
    assert torch.allclose(lse.double(), l64, rtol=1e-3, atol=1e-3)
    assert torch.allclose(ml.double(), m64, rtol=1e-3, atol=1e-3)


@pytest.mark.sm90
@pytest.mark.parametrize("accumulate", [False, True])
def test_packed_kv_read_in_place(monkeypatch, accumulate):
    """K/V as views kv[:, 0] / kv[:, 1] of a (Tk, 2, Hk, D) tensor (rows 2*Hk*D apart): the kernel
    reads them in place and gives bitwise the result of contiguous copies."""
    from ffa_kernels import ffa_forward, ffa_forward_stage

    monkeypatch.setenv("FFA_BACKEND", "cute")
    tq, tk, hq, hk, d = 700, 900, 8, 2, 128
    calls = _three_key_sets(tq, tk, types=(1, 0, 3))
    slices = [s for c in calls for s in zip(*c)]
    q = torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(tk, 2, hk, d, device="cuda", dtype=torch.bfloat16)
    qr = torch.tensor([list(s[0]) for s in slices], dtype=torch.int32, device="cuda")
    kr = torch.tensor([list(s[1]) for s in slices], dtype=torch.int32, device="cuda")
    ty = torch.tensor([s[2] for s in slices], dtype=torch.int32, device="cuda")
    results = []
    for k, v in ((kv[:, 0], kv[:, 1]), (kv[:, 0].contiguous(), kv[:, 1].contiguous())):
        if accumulate:
            out = torch.zeros(tq, hq, d, device="cuda")
            lse = torch.full((tq, hq), float("-inf"), device="cuda")
            ffa_forward_stage(q, k, v, qr, kr, ty, out, lse)
        else:
            poison_allocator(tq * hq * d * 2)
            out, lse, _ = ffa_forward(q, k, v, qr, kr, ty)
        results.append((out, lse))
    assert not torch.isnan(results[0][0]).any()
    assert _bits_equal(results[0][0], results[1][0]) and _bits_equal(results[0][1], results[1][1])


@pytest.mark.sm90
def test_head_dim_256_training_step():
    """flex_flash_attn_func at head_dim 256: the forward on the kernel, the backward on the
    reference (the backward kernel serves 64 and 128), both against float64 autograd."""
    from ffa_kernels import flex_flash_attn_func
    from ffa_kernels.testing import dense_attention, varlen_slices

    torch.manual_seed(0)
    qr, kr, ty, t = varlen_slices([300, 129, 400], 1)
    q, k, v = (
        torch.randn(t, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    ranges = [torch.tensor(x, dtype=torch.int32, device="cuda") for x in (qr, kr, ty)]
    out, _ = flex_flash_attn_func(q, k, v, *ranges)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = dense_attention(q64, k64, v64, qr, kr, ty)[0]
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert (out.double() - ref).abs().max() < 2e-2
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and (g.double() - r).abs().max() < 5e-2 * max(
            1.0, r.abs().max().item()
        )


# ----------------------------------------------------------------------------- MLA: head dims 192 / 128
MLA = dict(d=192, dv=128)  # q/k head dim 192, v (and out) head dim 128


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_full_and_causal(dtype):
    run_case([[0, 1000]], [[0, 1000]], [0], 1000, 1000, dtype=dtype, **MLA)
    run_case([[0, 700]], [[0, 900]], [1], 700, 900, dtype=dtype, **MLA)  # bottom-right causal, sq < sk
    run_case([[0, 900]], [[0, 300]], [1], 900, 300, dtype=dtype, **MLA)  # sq > sk: first rows empty


@pytest.mark.sm90
@pytest.mark.parametrize("typ", [0, 1, 2, 3])
def test_mla_varlen_each_type_and_uncovered_rows(typ):
    qr, kr, ty, t = varlen_slices([1, 77, 128, 300, 129, 513], typ)
    run_case(qr, kr, ty, t, t, **MLA)
    # rows 0..99 and 400..511 uncovered: out = 0, lse = -inf (in poisoned memory)
    run_case([[100, 400]], [[0, 256]], [typ], 512, 256, **MLA)


@pytest.mark.sm90
@pytest.mark.parametrize("pack", [False, None])  # unpacked GQA tiles, and the default choice
@pytest.mark.parametrize("hq,hk", [(8, 2), (8, 1), (16, 16)])
def test_mla_gqa_softcap_sink_and_max_logits(hq, hk, pack, monkeypatch):
    from ffa_kernels.cute import interface

    monkeypatch.setattr(interface, "PACK_GQA", pack)
    qr, kr, ty, t = varlen_slices([333, 700, 64], 1)
    run_case(qr, kr, ty, t, t, hq=hq, hk=hk, **MLA)
    run_case(qr, kr, ty, t, t, hq=hq, hk=hk, softcap=20.0, max_logits=True, **MLA)
    run_case(qr, kr, ty, t, t, hq=hq, hk=hk, sink_layout="ssh", seed=1, **MLA)


@pytest.mark.sm90
@pytest.mark.parametrize("seed", range(3))
def test_mla_random_slices(seed):
    rng = random.Random(50 + seed)
    tq, tk = rng.randrange(1, 1500), rng.randrange(1, 1500)
    qr, kr, ty = random_slices(rng, tq, tk, rng.randrange(1, 7))
    run_case(qr, kr, ty, tq, tk, dtype=rng.choice([torch.bfloat16, torch.float16]), seed=seed, **MLA)


@pytest.mark.sm90
def test_mla_accumulate():
    """The accumulate epilogue at 192 / 128: three key sets (rows no call covers stay bitwise
    untouched), a prior partial with NaN in its empty rows, softcap + max_logits with GQA."""
    run_accumulate_case(_three_key_sets(1200, 900), 1200, 900, **MLA)
    calls = _three_key_sets(1100, 1000)
    prior = ([[1050, 1100]], [[0, 1000]], [1])
    run_accumulate_case(calls, 1100, 1000, prior=prior, poison_empty=True, dtype=torch.float16, **MLA)
    calls = _three_key_sets(800, 700, types=(1, 0, 3))
    run_accumulate_case(calls, 800, 700, softcap=20.0, max_logits=True, hq=8, hk=2, **MLA)


@pytest.mark.sm90
def test_mla_k_and_v_strides_read_in_place(monkeypatch):
    """K and V with row strides of their own (a latent-style (Tk, 1, 192 + 128) tensor split
    into K and V; V from a packed (Tk, 2, Hk, 128) pair next to a contiguous K) are read in
    place and give bitwise the result of contiguous copies, in both epilogues."""
    from ffa_kernels import ffa_forward, ffa_forward_stage

    monkeypatch.setenv("FFA_BACKEND", "cute")
    tq, tk, hq = 700, 900, 8
    calls = _three_key_sets(tq, tk, types=(1, 0, 3))
    slices = [s for c in calls for s in zip(*c)]
    qr, kr, ty = (
        torch.tensor([list(s[i]) if i < 2 else s[i] for s in slices], dtype=torch.int32, device="cuda")
        for i in range(3)
    )
    q = torch.randn(tq, hq, 192, device="cuda", dtype=torch.bfloat16)
    latent = torch.randn(tk, 1, 320, device="cuda", dtype=torch.bfloat16)
    k2 = torch.randn(tk, 2, 192, device="cuda", dtype=torch.bfloat16)
    vv = torch.randn(tk, 2, 2, 128, device="cuda", dtype=torch.bfloat16)
    for k, v in ((latent[..., :192], latent[..., 192:]), (k2, vv[:, 1])):
        results = []
        for kk, vk in ((k, v), (k.contiguous(), v.contiguous())):
            out = torch.zeros(tq, hq, 128, device="cuda")
            lse = torch.full((tq, hq), float("-inf"), device="cuda")
            ffa_forward_stage(q, kk, vk, qr, kr, ty, out, lse)
            poison_allocator(tq * hq * 128 * 2)
            results.append((out, lse, *ffa_forward(q, kk, vk, qr, kr, ty)[:2]))
        assert not torch.isnan(results[0][0]).any() and not torch.isnan(results[0][2]).any()
        assert all(_bits_equal(a, b) for a, b in zip(*results))


@pytest.mark.sm90
def test_mla_training_step_forward_on_the_kernel_backward_on_the_reference(monkeypatch):
    """flex_flash_attn_func at 192 / 128: the forward runs on the kernel (FFA_BACKEND=cute: no
    fallback, which would raise; unset: no warning); the backward kernel does not serve it:
    under FFA_BACKEND=cute that is a RuntimeError naming head_dim, unset it falls back to the
    reference with one BackendFallbackWarning naming head_dim. Both against float64 autograd."""
    import warnings

    from ffa_kernels import BackendFallbackWarning, _backend, flex_flash_attn_func
    from ffa_kernels.testing import dense_attention

    torch.manual_seed(0)
    qr, kr, ty, t = varlen_slices([300, 129, 400], 1)
    q = torch.randn(t, 4, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, 2, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ranges = [torch.tensor(x, dtype=torch.int32, device="cuda") for x in (qr, kr, ty)]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = dense_attention(q64, k64, v64, qr, kr, ty)[0]
    _backend.reset_cache()  # the warn-once memory

    monkeypatch.setenv("FFA_BACKEND", "cute")
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendFallbackWarning)
        out, _ = flex_flash_attn_func(q, k, v, *ranges)
    assert out.shape == (t, 4, 128) and out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 2e-2
    dout = torch.randn_like(out)
    with pytest.raises(RuntimeError, match=r"FFA_BACKEND=cute, but .*head_dim: the sm90 backward"):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    monkeypatch.delenv("FFA_BACKEND")
    with warnings.catch_warnings(record=True) as fwd_record:
        warnings.simplefilter("always")
        out2, _ = flex_flash_attn_func(q, k, v, *ranges)
    assert not [w for w in fwd_record if issubclass(w.category, BackendFallbackWarning)]
    assert torch.equal(out2, out)
    with warnings.catch_warnings(record=True) as bwd_record:
        warnings.simplefilter("always")
        grads = torch.autograd.grad(out2, (q, k, v), dout)
    msgs = [str(w.message) for w in bwd_record if issubclass(w.category, BackendFallbackWarning)]
    assert len(msgs) == 1 and "head_dim" in msgs[0] and "got 192" in msgs[0], msgs
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        assert torch.isfinite(g).all() and (g.double() - r).abs().max() < 5e-2 * max(
            1.0, r.abs().max().item()
        )


def test_repeated_call_on_device_ranges_never_syncs_and_sees_in_place_writes():
    """Device range tensors checked by one call are remembered (a record beside them, also what
    the plan lookup reads): the next training step with them makes no device-to-host copy or
    other sync (torch's sync debug mode raises on one), and an in-place write to them is seen
    (the next call follows the new mask, against the oracle)."""
    from ffa_kernels import flex_flash_attn_func

    torch.manual_seed(7)
    tq, hq, d = 640, 4, 128
    q, k, v = (
        torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    qr = torch.tensor([[0, 384], [384, 640]], dtype=torch.int32, device="cuda")
    kr = qr.clone()
    tm = torch.tensor([1, 1], dtype=torch.int32, device="cuda")

    def step():
        out, _ = flex_flash_attn_func(q, k, v, qr, kr, tm)
        out.backward(torch.ones_like(out))
        return out

    step()  # checks the ranges (one host copy) and plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tm.fill_(0)  # in place: both documents become full
    out = step()
    scale = d**-0.5
    mask = dense_mask([[0, 384], [384, 640]], [[0, 384], [384, 640]], [0, 0], tq, tq, "cuda")
    ref, _, _ = oracle(q.detach(), k.detach(), v.detach(), mask, scale)
    low, _, _ = oracle(q.detach(), k.detach(), v.detach(), mask, scale, lowprec=True)
    err = (out.detach().double() - ref).abs().max().item()
    assert err <= 2 * (low - ref).abs().max().item() + 1e-3, err


def test_inference_mode_with_normalised_ranges():
    """Under torch.inference_mode the ranges' normalised copies (CPU ranges moved to the GPU, the
    type map made for None) are inference tensors, which keep no record: the call works, matches
    the oracle, and a normal call with the same ranges afterwards does too."""
    from ffa_kernels import flex_flash_attn_func

    torch.manual_seed(11)
    tq, hq, d = 300, 2, 64
    q, k, v = (torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qr = torch.tensor([[0, 120], [120, 300]], dtype=torch.int32)  # on the CPU
    mask = dense_mask([[0, 120], [120, 300]], [[0, 120], [120, 300]], [0, 0], tq, tq, "cuda")
    ref, _, _ = oracle(q, k, v, mask, d**-0.5)
    low, _, _ = oracle(q, k, v, mask, d**-0.5, lowprec=True)
    tol = 2 * (low - ref).abs().max().item() + 1e-3
    with torch.inference_mode():
        out, _ = flex_flash_attn_func(q, k, v, qr, qr.clone(), None)
    assert (out.double() - ref).abs().max().item() <= tol
    out, _ = flex_flash_attn_func(q, k, v, qr, qr.clone(), None)
    assert (out.double() - ref).abs().max().item() <= tol
