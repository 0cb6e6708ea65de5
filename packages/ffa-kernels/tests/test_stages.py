"""Per-stage API: stages over disjoint key sets, accumulated, equal one call."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ffa_kernels import (
    apply_sink,
    ffa_backward_prepare,
    ffa_backward_stage,
    ffa_forward,
    ffa_forward_stage,
    flex_flash_attn_func,
    forward_accumulators,
    merge_lse_,
    sink_backward,
)
from ffa_kernels.testing import dense_attention, random_problem, tile_config

NEG_INF = -math.inf


def _int32(x, shape=(-1, 2)):
    return torch.tensor(x, dtype=torch.int32).view(*shape)


def _fresh_acc(tq, hq, d, dtype=torch.float64):
    return torch.zeros(tq, hq, d, dtype=dtype), torch.full((tq, hq), NEG_INF, dtype=dtype)


@settings(max_examples=40, deadline=None)
@given(
    rng=st.randoms(use_true_random=False),
    num_stages=st.integers(2, 3),
    softcap=st.sampled_from([0.0, 1.0]),
    sink_layout=st.sampled_from([None, "sh", "ssh"]),
    tiny_tiles=st.booleans(),
)
def test_stages_sum_to_one_call(rng, num_stages, softcap, sink_layout, tiny_tiles):
    p = random_problem(rng, max_slices=7)
    tq, hq, d = p.q.shape
    sink = None
    if sink_layout is not None:
        shape = (2, hq) if sink_layout == "sh" else (tq, 2, hq)
        sink = torch.randn(
            *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rng.getrandbits(32))
        )
    layout = sink_layout or "sh"
    q, k, v = (x.clone().requires_grad_() for x in (p.q, p.k, p.v))
    if sink is not None:
        sink.requires_grad_()

    # one call
    out, meta = flex_flash_attn_func(
        q, k, v, p.q_ranges, p.k_ranges, p.attn_type_map, sink=sink, sink_layout=layout, softcap=softcap,
        return_max_logits=True,
    )  # fmt: skip
    dout = torch.randn_like(out)
    inputs = [q, k, v] + ([sink] if sink is not None else [])
    grads = torch.autograd.grad(out, inputs, dout)

    # the same slices dealt at random into stages, run in a random order
    owner = [rng.randrange(num_stages) for _ in p.types]
    stages = []
    for s in range(num_stages):
        idx = torch.tensor([i for i, o in enumerate(owner) if o == s], dtype=torch.long)
        stages.append((p.q_ranges[idx], p.k_ranges[idx], p.attn_type_map[idx]))
    rng.shuffle(stages)

    out_acc, lse_acc = _fresh_acc(tq, hq, d)
    max_acc = torch.full((hq,), NEG_INF, dtype=torch.float64)
    cfg = (2, 8, 1) if tiny_tiles else (512, 1 << 22, 64)
    with tile_config(*cfg):
        for qr, kr, tm in stages:
            ffa_forward_stage(
                p.q, p.k, p.v, qr, kr, tm, out_acc, lse_acc, softcap=softcap, max_logits_acc=max_acc
            )
        apply_sink(out_acc, lse_acc, None if sink is None else sink.detach(), layout)
        torch.testing.assert_close(out_acc, out.detach(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse_acc.float(), meta.lse)
        torch.testing.assert_close(max_acc.float(), meta.max_logits)

        dq, dk, dv = torch.zeros_like(p.q), torch.zeros_like(p.k), torch.zeros_like(p.v)
        for qr, kr, tm in stages:
            ffa_backward_stage(dout, p.q, p.k, p.v, out_acc, lse_acc, qr, kr, tm, dq, dk, dv, softcap=softcap)
    for g, ref in zip((dq, dk, dv), grads):
        torch.testing.assert_close(g, ref, atol=1e-10, rtol=1e-10)
    if sink is not None:
        dsink = sink_backward(sink.detach(), layout, out_acc, dout, lse_acc)
        torch.testing.assert_close(dsink, grads[3], atol=1e-10, rtol=1e-10)


@settings(max_examples=25, deadline=None)
@given(
    rng=st.randoms(use_true_random=False),
    sink_layout=st.sampled_from([None, "sh", "ssh"]),
    softcap=st.sampled_from([0.0, 2.0]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
)
def test_whole_forward_equals_stage_and_sink(rng, sink_layout, softcap, dtype):
    """ffa_forward (one key set, sink inside, no autograd) = ffa_forward_stage + apply_sink, with
    out in q's dtype and lse / max_logits in the accumulator precision."""
    p = random_problem(rng, max_slices=6)
    q, k, v = (x.to(dtype) for x in (p.q, p.k, p.v))
    tq, hq, d = q.shape
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    sink = None
    if sink_layout is not None:
        sink = torch.randn(*((2, hq) if sink_layout == "sh" else (tq, 2, hq)), generator=gen)
    layout = sink_layout or "sh"
    out, lse, ml = ffa_forward(
        q, k, v, p.q_ranges, p.k_ranges, p.attn_type_map, sink=sink, sink_layout=layout, softcap=softcap,
        return_max_logits=True,
    )  # fmt: skip
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out_acc, lse_acc = _fresh_acc(tq, hq, d, acc)
    max_acc = torch.full((hq,), NEG_INF, dtype=acc)
    ffa_forward_stage(q, k, v, p.q_ranges, p.k_ranges, p.attn_type_map, out_acc, lse_acc, softcap=softcap,
                      max_logits_acc=max_acc)  # fmt: skip
    apply_sink(out_acc, lse_acc, sink, layout)
    assert out.dtype == dtype and lse.dtype == acc and ml.dtype == acc
    torch.testing.assert_close(out, out_acc.to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_acc, atol=0, rtol=0)
    torch.testing.assert_close(ml, max_acc, atol=0, rtol=0)
    # and the public one-call function agrees
    ref, meta = flex_flash_attn_func(
        q, k, v, p.q_ranges, p.k_ranges, p.attn_type_map, sink=sink, sink_layout=layout, softcap=softcap
    )
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(lse.float(), meta.lse)


def test_whole_forward_rejects_bad_sink_and_flag():
    q = torch.randn(8, 2, 16)
    k = v = torch.randn(8, 2, 16)
    r = _int32([[0, 8]])
    with pytest.raises(ValueError, match="sink"):
        ffa_forward(q, k, v, r, r, sink=torch.randn(3, 5))
    with pytest.raises(TypeError, match="return_max_logits"):
        ffa_forward(q, k, v, r, r, return_max_logits="yes")
    out, lse, ml = ffa_forward(q, k, v, r, r)
    assert ml is None and out.shape == q.shape and lse.shape == (8, 2)


@pytest.mark.parametrize("split", [1, 5, 9, 12])
def test_causal_split_by_key_chunks_in_local_coordinates(split):
    """magi-dist style: each stage gets only its own k/v chunk, ranges in that chunk's coordinates."""
    n, hq, hk, d = 13, 4, 2, 8
    gen = torch.Generator().manual_seed(split)
    q = torch.randn(n, hq, d, dtype=torch.float64, generator=gen)
    k = torch.randn(n, hk, d, dtype=torch.float64, generator=gen)
    v = torch.randn(n, hk, d, dtype=torch.float64, generator=gen)
    full_out, full_meta = flex_flash_attn_func(q, k, v, _int32([[0, n]]), _int32([[0, n]]), _int32([1], (1,)))
    dout = torch.randn_like(full_out)
    ref_q, ref_k, ref_v = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out, _, _ = dense_attention(ref_q, ref_k, ref_v, [[0, n]], [[0, n]], [1])
    ref_out.backward(dout)

    # keys [0, split): causal block on rows [0, split), full block below; keys [split, n): causal
    stage_a = (
        k[:split],
        v[:split],
        _int32([[0, split], [split, n]]),
        _int32([[0, split], [0, split]]),
        [1, 0],
    )
    stage_b = (k[split:], v[split:], _int32([[split, n]]), _int32([[0, n - split]]), [1])
    out_acc, lse_acc = _fresh_acc(n, hq, d)
    for kk, vv, qr, kr, tm in (stage_b, stage_a):
        ffa_forward_stage(q, kk, vv, qr, kr, _int32(tm, (-1,)), out_acc, lse_acc)
    torch.testing.assert_close(out_acc, full_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse_acc.float(), full_meta.lse)

    dq = torch.zeros_like(q)
    dk_parts, dv_parts = [], []
    for kk, vv, qr, kr, tm in (stage_a, stage_b):
        dk, dv = torch.zeros_like(kk), torch.zeros_like(vv)
        ffa_backward_stage(dout, q, kk, vv, out_acc, lse_acc, qr, kr, _int32(tm, (-1,)), dq, dk, dv)
        dk_parts.append(dk)
        dv_parts.append(dv)
    torch.testing.assert_close(dq, ref_q.grad, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.cat(dk_parts), ref_k.grad, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.cat(dv_parts), ref_v.grad, atol=1e-10, rtol=1e-10)


def test_float32_accumulators_for_bf16_inputs():
    rng = random.Random(3)
    p = random_problem(rng, dtype=torch.bfloat16, head_dim=8)
    tq, hq, d = p.q.shape
    out_acc, lse_acc = _fresh_acc(tq, hq, d, torch.float32)
    ffa_forward_stage(p.q, p.k, p.v, p.q_ranges, p.k_ranges, p.attn_type_map, out_acc, lse_acc)
    out, meta = flex_flash_attn_func(p.q, p.k, p.v, p.q_ranges, p.k_ranges, p.attn_type_map)
    torch.testing.assert_close(out_acc.to(torch.bfloat16), out, atol=0, rtol=0)
    torch.testing.assert_close(lse_acc, meta.lse, atol=0, rtol=0)


def test_rows_outside_the_stage_are_untouched():
    """Poisoned accumulator rows that the stage does not cover keep their content exactly."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    out_acc = torch.full((6, 2, 4), math.nan, dtype=torch.float64)
    lse_acc = torch.full((6, 2), NEG_INF, dtype=torch.float64)
    ffa_forward_stage(q, k, v, _int32([[1, 3]]), _int32([[0, 6]]), None, out_acc, lse_acc)
    assert bool(out_acc[[0, 3, 4, 5]].isnan().all())  # untouched
    assert bool(out_acc[1:3].isfinite().all())  # NaN behind lse=-inf was ignored, not propagated
    ref, _ = flex_flash_attn_func(q, k, v, _int32([[1, 3]]), _int32([[0, 6]]))
    torch.testing.assert_close(out_acc[1:3], ref[1:3])
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    ffa_backward_stage(
        torch.ones_like(q), q, k, v, ref, lse_acc, _int32([[1, 3]]), _int32([[0, 6]]), None, dq, dk, dv
    )
    assert torch.equal(dq[[0, 3, 4, 5]], torch.zeros(4, 2, 4, dtype=torch.float64))


def test_merge_lse_edge_cases():
    out_acc = torch.tensor([[math.nan, 1.0], [2.0, 2.0], [5.0, 5.0], [7.0, 7.0]])
    lse_acc = torch.tensor([NEG_INF, 0.0, NEG_INF, 1.0])
    out_part = torch.tensor([[3.0, 3.0], [math.nan, 0.0], [math.inf, 1.0], [1.0, 1.0]])
    lse_part = torch.tensor([0.5, NEG_INF, NEG_INF, 1.0])
    merge_lse_(out_acc, lse_acc, out_part, lse_part)
    expected = torch.tensor([[3.0, 3.0], [2.0, 2.0], [0.0, 0.0], [4.0, 4.0]])
    torch.testing.assert_close(out_acc, expected)
    torch.testing.assert_close(lse_acc, torch.tensor([0.5, 0.0, NEG_INF, 1.0 + math.log(2.0)]))
    with pytest.raises(ValueError, match="shape"):
        merge_lse_(out_acc, lse_acc, out_part[:2], lse_part[:2])


@settings(max_examples=30, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_merge_lse_is_softmax_over_concatenated_keys(rng):
    """Merging two partial softmaxes equals one softmax over both key sets, in either order."""
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    rows, d = 5, 3
    logits = torch.randn(rows, 7, dtype=torch.float64, generator=gen) * 3
    vals = torch.randn(7, d, dtype=torch.float64, generator=gen)
    cut = rng.randint(0, 7)
    logits[rng.randrange(rows)] = NEG_INF  # a row with no key at all

    def part(a, b):
        lse = torch.logsumexp(logits[:, a:b], -1)
        w = torch.exp(logits[:, a:b] - lse.nan_to_num(neginf=0).unsqueeze(-1))
        return (w @ vals[a:b]).nan_to_num(0.0), lse

    full_out, full_lse = part(0, 7)
    for first, second in (((0, cut), (cut, 7)), ((cut, 7), (0, cut))):
        out_acc, lse_acc = part(*first)
        merge_lse_(out_acc, lse_acc, *part(*second))
        torch.testing.assert_close(out_acc, full_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse_acc, full_lse)


@pytest.mark.parametrize("layout", ["sh", "ssh"])
def test_apply_sink_matches_oracle(layout):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    sink = torch.randn(*((3, 2) if layout == "sh" else (5, 3, 2)), dtype=torch.float64, generator=gen)
    qr, kr = [[0, 4]], [[0, 5]]  # row 4 uncovered
    out_acc, lse_acc = _fresh_acc(5, 2, 4)
    ffa_forward_stage(q, k, v, _int32(qr), _int32(kr), None, out_acc, lse_acc)
    apply_sink(out_acc, lse_acc, sink, layout)
    ref_out, ref_lse, _ = dense_attention(q, k, v, qr, kr, sink=sink, sink_layout=layout)
    torch.testing.assert_close(out_acc, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse_acc, ref_lse, atol=1e-12, rtol=1e-12)
    before = (out_acc.clone(), lse_acc.clone())
    apply_sink(out_acc, lse_acc, None, layout)  # no sink: no-op
    assert torch.equal(out_acc, before[0]) and torch.equal(lse_acc, before[1])


@pytest.mark.parametrize(
    ("layout", "shape", "pattern"),
    [
        ("sh", (5, 1, 2), r"sink_layout='sh' must have shape \(S_sink, 2\).*\(5, 1, 2\)"),  # an "ssh" sink
        ("ssh", (4, 1, 2), r"'ssh' must have shape \(5, S_sink, 2\).*\(4, 1, 2\)"),
        ("sh", (0, 2), r"S_sink >= 1"),
        ("hs", (1, 2), r"sink_layout must be 'sh' or 'ssh', got 'hs'"),
    ],
)
def test_public_sink_helpers_validate_the_sink(layout, shape, pattern):
    """A wrongly shaped sink must not broadcast silently (e.g. (Tq, 1, Hq) read as "sh")."""
    out_acc, lse_acc = _fresh_acc(5, 2, 4)
    lse_acc.normal_(generator=torch.Generator().manual_seed(0))
    out_acc.normal_(generator=torch.Generator().manual_seed(1))
    before = (out_acc.clone(), lse_acc.clone())
    sink = torch.randn(*shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=pattern):
        apply_sink(out_acc, lse_acc, sink, layout)
    assert torch.equal(out_acc, before[0]) and torch.equal(lse_acc, before[1])  # untouched
    with pytest.raises(ValueError, match=pattern):
        sink_backward(sink, layout, out_acc, torch.randn_like(out_acc), lse_acc)


def test_stage_accumulators_may_be_strided_views():
    """Accumulators are written in place, never copied: strided views get the same result."""
    rng = random.Random(9)
    p = random_problem(rng, max_slices=5)
    tq, hq, d = p.q.shape
    tk, hk, _ = p.k.shape
    args = (p.q_ranges, p.k_ranges, p.attn_type_map)
    out_ref, lse_ref = _fresh_acc(tq, hq, d)
    ffa_forward_stage(p.q, p.k, p.v, *args, out_ref, lse_ref, softcap=1.0)
    out_big = torch.full((d, hq, tq), math.nan, dtype=torch.float64)
    lse_big = torch.full((hq, 2 * tq), math.nan, dtype=torch.float64)
    out_acc, lse_acc = out_big.permute(2, 1, 0), lse_big[:, ::2].t()
    out_acc.zero_()
    lse_acc.fill_(NEG_INF)
    ffa_forward_stage(p.q, p.k, p.v, *args, out_acc, lse_acc, softcap=1.0)
    assert torch.equal(out_acc, out_ref) and torch.equal(lse_acc, lse_ref)
    assert bool(lse_big[:, 1::2].isnan().all())  # the gaps of the strided view are untouched

    dout = torch.randn(tq, hq, d, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref = [torch.zeros(shape, dtype=torch.float64) for shape in ((tq, hq, d), (tk, hk, d), (tk, hk, d))]
    ffa_backward_stage(dout, p.q, p.k, p.v, out_ref, lse_ref, *args, *ref, softcap=1.0)
    views = [torch.zeros(x.shape[::-1], dtype=torch.float64).permute(2, 1, 0) for x in ref]
    ffa_backward_stage(dout, p.q, p.k, p.v, out_ref, lse_ref, *args, *views, softcap=1.0)
    for a, b in zip(views, ref):
        assert not a.is_contiguous() and torch.equal(a, b)


def test_finite_merge_equals_guarded_merge():
    from ffa_kernels._merge import merge_finite_lse_

    g = torch.Generator().manual_seed(3)
    t, h, d = 37, 3, 8
    lse_a = torch.randn(t, h, generator=g, dtype=torch.float64)
    lse_b = torch.randn(t, h, generator=g, dtype=torch.float64)
    lse_a[:5] = float("-inf")  # acc empty
    lse_b[3:9] = float("-inf")  # part empty (rows 3, 4: both)
    out_a = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    out_b = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    out_a[:5] = 0.0
    out_b[3:9] = 0.0
    ref_o, ref_l = out_a.clone(), lse_a.clone()
    merge_lse_(ref_o, ref_l, out_b, lse_b)
    got_o, got_l = out_a.clone(), lse_a.clone()
    merge_finite_lse_(got_o, got_l, out_b, lse_b)
    torch.testing.assert_close(got_l, ref_l, rtol=0, atol=0)
    torch.testing.assert_close(got_o, ref_o, rtol=1e-12, atol=1e-12)
    assert torch.all(got_o[3:5] == 0) and torch.all(got_l[3:5] == float("-inf"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_forward_accumulators(dtype):
    """Fresh stage accumulators: zeros / -inf in float32 (float64 for float64 q), q's shape."""
    q = torch.randn(5, 3, 4).to(dtype)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    out, lse, ml = forward_accumulators(q, max_logits=True)
    assert (out.shape, lse.shape, ml.shape) == ((5, 3, 4), (5, 3), (3,))
    assert out.dtype == lse.dtype == ml.dtype == want
    assert bool((out == 0).all()) and bool((lse == NEG_INF).all()) and bool((ml == NEG_INF).all())
    assert forward_accumulators(q)[2] is None
    with pytest.raises(ValueError, match="q must be a"):
        forward_accumulators(q[0])


def test_backward_prepare_checks_its_arguments_and_changes_no_result(monkeypatch):
    """`ffa_backward_prepare` (the stages' shared preprocess, ahead of them): bad arguments raise
    naming the argument; on the reference backend it enqueues nothing (the kernel module is never
    loaded), and the stage that follows gives the same gradients as without it (the kernel path:
    test_cute_bwd_gpu.py)."""
    import ffa_kernels._backend as backend

    def no_kernel():
        raise AssertionError("ffa_backward_prepare loaded the kernel module on the reference backend")

    monkeypatch.setattr(backend, "load_cute", no_kernel)
    q, k, v = (torch.randn(6, 2, 4, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(6, 2, 4, dtype=torch.float64)
    qr, kr = _int32([0, 6]), _int32([0, 6])
    out, lse = _fresh_acc(6, 2, 4)
    ffa_forward_stage(q, k, v, qr, kr, None, out, lse)
    with pytest.raises(TypeError, match=r"^q must be a torch.Tensor"):
        ffa_backward_prepare(dout, q.numpy(), v, out, lse)
    with pytest.raises(ValueError, match=r"^v must be 3-D"):
        ffa_backward_prepare(dout, q, v[0], out, lse)
    with pytest.raises(ValueError, match=r"^dout must have shape"):
        ffa_backward_prepare(dout[:5], q, v, out, lse)
    with pytest.raises(ValueError, match=r"^lse must have shape"):
        ffa_backward_prepare(dout, q, v, out, lse[:, :1])
    grads = []
    for prepare in (False, True):
        acc = [torch.zeros_like(t) for t in (q, k, v)]
        if prepare:
            ffa_backward_prepare(dout, q, v, out, lse)
        ffa_backward_stage(dout, q, k, v, out, lse, qr, kr, None, *acc)
        grads.append(acc)
    assert grads[0][0].abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_backward_stage_heads_per_cta_is_checked_and_changes_no_sum():
    """``heads_per_cta`` (the CuTe kernel's launch shape) is checked before anything runs (a
    divisor of Hq / Hk, an int); the reference backend's sums are the same whatever it is;
    `backward_heads_per_cta` answers 1 where the reference backend serves the call."""
    from ffa_kernels import backward_heads_per_cta

    g = torch.Generator().manual_seed(3)
    tq, tk, hq, hk, d = 40, 56, 4, 2, 8
    q, dout = (torch.randn(tq, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(tk, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    qr, kr, tm = _int32([[0, 25], [25, 40]]), _int32([[0, 30], [10, 56]]), _int32([1, 0], (-1,))
    out, lse, _ = ffa_forward(q, k, v, qr, kr, tm)
    sums = []
    for h in (None, 1, 2):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        ffa_backward_stage(dout, q, k, v, out, lse, qr, kr, tm, dq, dk, dv, heads_per_cta=h)
        sums.append((dq, dk, dv))
    for other in sums[1:]:
        for a, b in zip(sums[0], other):
            assert torch.equal(a, b)
    zeros = [torch.zeros_like(x) for x in (q, k, v)]
    for bad, err in ((3, ValueError), (0, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(err, match="heads_per_cta"):
            ffa_backward_stage(dout, q, k, v, out, lse, qr, kr, tm, *zeros, heads_per_cta=bad)
    assert all(not z.any() for z in zeros)  # nothing ran
    assert backward_heads_per_cta(q, k, v, qr, kr, tm) == 1
