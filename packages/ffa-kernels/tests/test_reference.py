"""flex_flash_attn_func (reference backend) against the brute-force dense float64 oracle."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ffa_kernels import AttnForwardMeta, flex_flash_attn_func
from ffa_kernels.testing import dense_attention, random_problem, tile_config

# (block_rows, tile_elems, min_tile_cols): the default, and tiny tiles that force many blocks,
# column tiles, masked/unmasked tiles and local merges even on 20-token problems.
TILES = [(512, 1 << 22, 64), (3, 20, 1), (1, 1, 1), (4, 64, 2)]


def _int32(x, shape=(-1, 2)):
    return torch.tensor(x, dtype=torch.int32).view(*shape)


def _make_sink(rng, layout, tq, hq, dtype=torch.float32):
    if layout is None:
        return None
    s = rng.randint(1, 3)
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    shape = (s, hq) if layout == "sh" else (tq, s, hq)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _grads(out, inputs, dout):
    grads = torch.autograd.grad(out, inputs, dout, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


@settings(max_examples=40, deadline=None)
@given(
    rng=st.randoms(use_true_random=False),
    tiles=st.sampled_from(TILES),
    softcap=st.sampled_from([0.0, 0.5, 3.0]),
    sink_layout=st.sampled_from([None, "sh", "ssh"]),
    scale=st.sampled_from([None, 0.3, 1.7]),
    head_dim_v=st.sampled_from([None, None, 3, 12]),
)
def test_matches_oracle_fp64(rng, tiles, softcap, sink_layout, scale, head_dim_v):
    """Every feature against the float64 oracle; v may have its own head dim (MLA)."""
    p = random_problem(rng, head_dim_v=head_dim_v)
    tq, hq, _ = p.q.shape
    sink = _make_sink(rng, sink_layout, tq, hq, torch.float64)
    q, k, v = (x.clone().requires_grad_() for x in (p.q, p.k, p.v))
    inputs = [q, k, v] + ([sink.requires_grad_()] if sink is not None else [])
    kw = dict(sink_layout=sink_layout or "sh", softmax_scale=scale, softcap=softcap)
    with tile_config(*tiles):
        out, meta = flex_flash_attn_func(
            q, k, v, p.q_ranges, p.k_ranges, p.attn_type_map, sink=sink, return_max_logits=True, **kw
        )
        dout = torch.randn_like(out)
        grads = _grads(out, inputs, dout)
    ref_out, ref_lse, ref_max = dense_attention(q, k, v, p.qr, p.kr, p.types, sink=sink, **kw)
    ref_grads = _grads(ref_out, inputs, dout)

    assert out.dtype == torch.float64 and meta.lse.dtype == torch.float32
    assert not out.isnan().any() and not meta.lse.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(meta.lse, ref_lse.float(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(meta.max_logits, ref_max.float(), atol=1e-5, rtol=1e-6)
    for name, g, rg in zip(["q", "k", "v", "sink"], grads, ref_grads):
        assert not g.isnan().any(), name
        torch.testing.assert_close(g, rg, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize(
    ("dtype", "fwd_tol", "grad_tol"),
    [(torch.float32, 2e-5, 1e-4), (torch.bfloat16, 2e-2, 5e-2), (torch.float16, 4e-3, 1e-2)],
)
@settings(max_examples=15, deadline=None)
@given(rng=st.randoms(use_true_random=False), sink_layout=st.sampled_from([None, "sh", "ssh"]))
def test_low_precision(dtype, fwd_tol, grad_tol, rng, sink_layout):
    """fp32/bf16/fp16 inputs: math in float32, out in the input dtype; compared on the same
    (rounded) inputs to the float64 oracle."""
    p = random_problem(rng, dtype=dtype, head_dim=8)
    tq, hq, _ = p.q.shape
    sink = _make_sink(rng, sink_layout, tq, hq)
    softcap = rng.choice([0.0, 2.0])
    q, k, v = (x.clone().requires_grad_() for x in (p.q, p.k, p.v))
    inputs = [q, k, v] + ([sink.requires_grad_()] if sink is not None else [])
    out, meta = flex_flash_attn_func(
        q, k, v, p.q_ranges, p.k_ranges, p.attn_type_map, sink=sink, sink_layout=sink_layout or "sh",
        softcap=softcap, return_max_logits=True,
    )  # fmt: skip
    dout = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    grads = _grads(out, inputs, dout)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (p.q, p.k, p.v))
    s64 = sink.detach().double().requires_grad_() if sink is not None else None
    inputs64 = [q64, k64, v64] + ([s64] if s64 is not None else [])
    ref_out, ref_lse, ref_max = dense_attention(
        q64, k64, v64, p.qr, p.kr, p.types, sink=s64, sink_layout=sink_layout or "sh", softcap=softcap
    )
    ref_grads = _grads(ref_out, inputs64, dout.double())

    assert out.dtype == dtype and meta.lse.dtype == torch.float32 and meta.max_logits.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=fwd_tol, rtol=fwd_tol)
    torch.testing.assert_close(meta.lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(meta.max_logits.double(), ref_max, atol=1e-4, rtol=1e-5)
    for name, g, rg in zip(["q", "k", "v", "sink"], grads, ref_grads):
        assert g.dtype == (torch.float32 if name == "sink" else dtype)
        torch.testing.assert_close(
            g.double(), rg, atol=grad_tol, rtol=grad_tol, msg=lambda m, n=name: f"{n}: {m}"
        )


def _qkv(tq, tk, hq=2, hk=1, d=4, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()
        for shape in ((tq, hq, d), (tk, hk, d), (tk, hk, d))
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("tiles", [TILES[0], TILES[2]])
def test_uncovered_rows_zero_and_neg_inf(dtype, softcap, tiles):
    q, k, v = _qkv(6, 5, dtype=dtype)
    # rows 0 and 5 are not covered; rows 1, 2 are in a CAUSAL slice with sq=4 > sk=2 (empty rows)
    qr, kr, tm = _int32([[1, 5]]), _int32([[0, 2]]), _int32([1], (1,))
    with tile_config(*tiles):
        out, meta = flex_flash_attn_func(q, k, v, qr, kr, tm, softcap=softcap, return_max_logits=True)
        dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    for r in (0, 1, 2, 5):
        assert torch.equal(out[r], torch.zeros_like(out[r]))
        assert bool((meta.lse[r] == -math.inf).all())
    assert bool(meta.lse[3:5].isfinite().all()) and bool(out[3:5].ne(0).any())
    for g in grads:
        assert bool(g.isfinite().all())
    assert torch.equal(grads[0][[0, 1, 2, 5]], torch.zeros_like(grads[0][[0, 1, 2, 5]]))
    assert bool(grads[0][3:5].ne(0).any()) and bool(grads[1].ne(0).any()) and bool(grads[2].ne(0).any())


def test_uncovered_rows_with_sink():
    q, k, v = _qkv(4, 4)
    sink = torch.tensor([[0.5, -1.0], [2.0, 0.0]], dtype=torch.float32, requires_grad=True)  # (S=2, Hq=2)
    out, meta = flex_flash_attn_func(q, k, v, _int32([[2, 4]]), _int32([[0, 4]]), sink=sink)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    torch.testing.assert_close(meta.lse[:2], torch.logsumexp(sink, 0).expand(2, 2))
    (out * 1.0).sum().backward()
    assert bool(sink.grad.isfinite().all())


def test_no_slices_at_all():
    q, k, v = _qkv(3, 3)
    sink = torch.zeros(1, 2, dtype=torch.float32, requires_grad=True)
    empty = torch.zeros(0, 2, dtype=torch.int32)
    out, meta = flex_flash_attn_func(q, k, v, empty, empty, return_max_logits=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((meta.lse == -math.inf).all()) and bool((meta.max_logits == -math.inf).all())
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))
    out, meta = flex_flash_attn_func(q, k, v, empty, empty, sink=sink)
    torch.testing.assert_close(meta.lse, torch.zeros(3, 2))  # logsumexp of one zero logit


def test_zero_length_sequences():
    q, k, v = _qkv(0, 3)
    out, meta = flex_flash_attn_func(q, k, v, _int32([[0, 0]]), _int32([[0, 3]]))
    assert out.shape == (0, 2, 4) and meta.lse.shape == (0, 2)
    q, k, v = _qkv(3, 0)
    out, meta = flex_flash_attn_func(q, k, v, _int32([[0, 3]]), _int32([[0, 0]]))
    assert torch.equal(out, torch.zeros_like(out)) and bool((meta.lse == -math.inf).all())


def test_max_logits_per_head_and_before_softcap():
    q, k, v = _qkv(4, 4, hq=3, hk=1)
    with torch.no_grad():
        q[:, 0] *= 50  # head 0 gets logits far beyond the softcap
    qr, kr = _int32([[0, 4]]), _int32([[0, 4]])
    _, meta = flex_flash_attn_func(q, k, v, qr, kr, softcap=1.0, return_max_logits=True)
    _, _, ref_max = dense_attention(q, k, v, [[0, 4]], [[0, 4]], softcap=1.0)
    torch.testing.assert_close(meta.max_logits.double(), ref_max, rtol=1e-6, atol=1e-5)
    assert meta.max_logits[0] > 1.0  # raw logits, not capped ones
    _, meta = flex_flash_attn_func(q, k, v, qr, kr)
    assert meta.max_logits is None and isinstance(meta, AttnForwardMeta)


def test_gqa_equals_repeated_kv():
    """GQA = MHA with k/v repeated per group; dk/dv are the sums over the group's q heads."""
    q, k, v = _qkv(7, 9, hq=6, hk=2)
    qr, kr, tm = _int32([[0, 7], [0, 4]]), _int32([[0, 5], [5, 9]]), _int32([1, 2], (2,))
    k_rep, v_rep = (x.detach().repeat_interleave(3, 1).requires_grad_() for x in (k, v))
    out, meta = flex_flash_attn_func(q, k, v, qr, kr, tm, softcap=2.0)
    out_rep, meta_rep = flex_flash_attn_func(q, k_rep, v_rep, qr, kr, tm, softcap=2.0)
    torch.testing.assert_close(out, out_rep, atol=1e-12, rtol=0)
    torch.testing.assert_close(meta.lse, meta_rep.lse)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    dq_rep, dk_rep, dv_rep = torch.autograd.grad(out_rep, (q, k_rep, v_rep), dout)
    torch.testing.assert_close(dq, dq_rep, atol=1e-12, rtol=0)
    # kv head j serves q heads 3j, 3j+1, 3j+2
    torch.testing.assert_close(dk, dk_rep.view(9, 2, 3, 4).sum(2), atol=1e-12, rtol=0)
    torch.testing.assert_close(dv, dv_rep.view(9, 2, 3, 4).sum(2), atol=1e-12, rtol=0)


def test_non_contiguous_inputs():
    """Transposed / strided views of q, k, v (and of the ranges) give bitwise the same result and
    gradients as contiguous copies."""
    q, k, v = _qkv(8, 9, hq=4, hk=2, d=6)
    q_nc = q.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # same values
    k_nc = k.detach().permute(2, 1, 0).contiguous().permute(2, 1, 0).requires_grad_()
    v_wide = torch.randn(9, 2, 12, dtype=torch.float64)
    v_wide[..., ::2] = v.detach()
    v_nc = v_wide[..., ::2].requires_grad_()  # every other element of a wider tensor
    qr = torch.tensor([[0, 99, 8, 99], [2, 99, 6, 99]], dtype=torch.int32)[:, ::2]  # non-contiguous
    kr, tm = _int32([[0, 4], [4, 9]]), _int32([1, 3], (2,))
    assert not any(x.is_contiguous() for x in (q_nc, k_nc, v_nc, qr))
    kw = dict(softcap=1.0, return_max_logits=True)
    out1, meta1 = flex_flash_attn_func(q_nc, k_nc, v_nc, qr, kr, tm, **kw)
    out2, meta2 = flex_flash_attn_func(q, k, v, qr.contiguous(), kr, tm, **kw)
    assert torch.equal(out1, out2) and torch.equal(meta1.lse, meta2.lse)
    assert torch.equal(meta1.max_logits, meta2.max_logits)
    dout = torch.randn(out1.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g1 = torch.autograd.grad(out1, (q_nc, k_nc, v_nc), dout)
    g2 = torch.autograd.grad(out2, (q, k, v), dout)
    for a, b in zip(g1, g2):
        assert not a.isnan().any() and torch.equal(a, b)


def test_deterministic_bitwise():
    q, k, v = _qkv(33, 29, hq=4, hk=2, d=8, dtype=torch.float32)
    args = (_int32([[0, 33], [10, 20]]), _int32([[0, 20], [20, 29]]), _int32([1, 0], (2,)))
    with tile_config(5, 40, 3):
        outs = []
        for _ in range(2):
            for x in (q, k, v):
                x.grad = None
            out, _ = flex_flash_attn_func(q, k, v, *args, deterministic=True)
            out.sum().backward()
            outs.append((out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_gradcheck_with_sink_and_softcap():
    q, k, v = _qkv(4, 5, hq=2, hk=1, d=3)
    sink = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
    qr, kr, tm = _int32([[0, 4], [1, 3]]), _int32([[0, 3], [3, 5]]), _int32([3, 2], (2,))

    def fn(q, k, v, sink):
        return flex_flash_attn_func(q, k, v, qr, kr, tm, sink=sink, sink_layout="ssh", softcap=1.5)[0]

    assert torch.autograd.gradcheck(fn, (q, k, v, sink))


def test_inputs_are_not_modified():
    # Hq = Hk = 1 makes the internal kv-major view of q alias q itself: no in-place op may touch it
    q, k, v = _qkv(9, 9, hq=1, hk=1, d=4)
    sink = torch.randn(2, 1, requires_grad=True)
    before = [x.detach().clone() for x in (q, k, v, sink)]
    out, _ = flex_flash_attn_func(q, k, v, _int32([[0, 9]]), _int32([[0, 9]]), _int32([1], (1,)), sink=sink,
                                  softmax_scale=0.7, softcap=2.0)  # fmt: skip
    out.sum().backward()
    for x, b in zip((q, k, v, sink), before):
        assert torch.equal(x.detach(), b)


def test_non_contiguous_dout():
    q, k, v = _qkv(5, 6, hq=4, hk=2, d=3)
    qr, kr = _int32([[0, 5]]), _int32([[0, 6]])
    out, _ = flex_flash_attn_func(q, k, v, qr, kr)
    dout_t = torch.randn(3, 4, 5, dtype=torch.float64).permute(2, 1, 0)  # (5, 4, 3), not contiguous
    g1 = torch.autograd.grad(out, (q, k, v), dout_t, retain_graph=True)
    g2 = torch.autograd.grad(out, (q, k, v), dout_t.contiguous())
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_stages_with_their_own_v_head_dim(split):
    """MLA-style heads (q/k 12, v 5) through the stage API: the stages of a key split, merged
    by log-sum-exp and their backward summed, equal one call and the oracle."""
    from ffa_kernels import ffa_backward_stage, ffa_forward_stage, forward_accumulators

    g = torch.Generator().manual_seed(split)
    tq, tk, hq, hk, d, dv = 30, 36, 4, 2, 12, 5
    q, k = (
        torch.randn(tq, hq, d, generator=g, dtype=torch.float64),
        torch.randn(tk, hk, d, generator=g, dtype=torch.float64),
    )
    v = torch.randn(tk, hk, dv, generator=g, dtype=torch.float64)
    cuts = [round(i * tk / split) for i in range(split + 1)]
    out, lse, _ = forward_accumulators(q, head_dim_v=dv)
    assert out.shape == (tq, hq, dv)
    stages = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        # rows see keys [a, b): full, in the stage's own key coordinates
        qr = torch.tensor([[0, tq]], dtype=torch.int32)
        kr = torch.tensor([[0, b - a]], dtype=torch.int32)
        stages.append((k[a:b], v[a:b], qr, kr))
        ffa_forward_stage(q, k[a:b], v[a:b], qr, kr, None, out, lse)
    qi, ki, vi = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse, _ = dense_attention(qi, ki, vi, [[0, tq]], [[0, tk]], [0])
    torch.testing.assert_close(out, ref_out.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=1e-10, rtol=1e-10)
    dout = torch.randn(tq, hq, dv, generator=g, dtype=torch.float64)
    ref = torch.autograd.grad(ref_out, (qi, ki, vi), dout)
    dq = torch.zeros_like(q)
    dk, dvv = torch.zeros_like(k), torch.zeros_like(v)
    for (ks, vs, qr, kr), (a, b) in zip(stages, zip(cuts[:-1], cuts[1:])):
        ffa_backward_stage(dout, q, ks, vs, out, lse, qr, kr, None, dq, dk[a:b], dvv[a:b])
    for got, want in zip((dq, dk, dvv), ref):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def test_kernels_decline_their_own_v_head_dim():
    """The sm90 kernels serve v's head dim equal to q's, and the forward also MLA's 192 / 128:
    anything else is declined before any launch (NotImplementedError, so that the frontend
    falls back to the reference); the backward of 192 / 128 is declined naming the head dim."""
    from ffa_kernels.cute.interface import kernel_scales

    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    for what in ("forward", "backward"):
        assert kernel_scales(q, q, None, 0.0, what) == (128**-0.5, 0.0)
        with pytest.raises(NotImplementedError, match="v's head dim"):
            kernel_scales(q, torch.zeros(4, 2, 64, dtype=torch.bfloat16), None, 0.0, what)
    q192, v128 = torch.zeros(4, 2, 192, dtype=torch.bfloat16), torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert kernel_scales(q192, v128, None, 0.0, "forward") == (192**-0.5, 0.0)
    with pytest.raises(NotImplementedError, match=r"v's head dim 128 at q's head dim 192, got 192"):
        kernel_scales(q192, q192, None, 0.0, "forward")
    with pytest.raises(
        NotImplementedError, match=r"head_dim: the sm90 backward supports \(64, 128\), got 192"
    ):
        kernel_scales(q192, v128, None, 0.0, "backward")
