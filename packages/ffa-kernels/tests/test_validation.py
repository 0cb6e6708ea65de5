"""Bad inputs fail before any compute, with an error that names the argument and the value."""

import pytest
import torch

from ffa_kernels import ffa_backward_stage, ffa_forward_stage, flex_flash_attn_func
from ffa_kernels.reference import forward as _forward

I32 = torch.int32


def _base(tq=6, tk=5, hq=4, hk=2, d=8, dtype=torch.float32):
    q = torch.randn(tq, hq, d, dtype=dtype)
    k = torch.randn(tk, hk, d, dtype=dtype)
    v = torch.randn(tk, hk, d, dtype=dtype)
    qr = torch.tensor([[0, 6], [0, 3]], dtype=I32)
    kr = torch.tensor([[0, 3], [3, 5]], dtype=I32)
    tm = torch.tensor([1, 0], dtype=I32)
    return dict(q=q, k=k, v=v, q_ranges=qr, k_ranges=kr, attn_type_map=tm)


def _call(**overrides):
    kw = _base()
    kw.update(overrides)
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    qr, kr, tm = kw.pop("q_ranges"), kw.pop("k_ranges"), kw.pop("attn_type_map")
    return flex_flash_attn_func(q, k, v, qr, kr, tm, **kw)


B = _base()
CASES = [
    # (overrides, exception, regex that must appear in the message)
    (dict(q=B["q"][0]), ValueError, r"q must be 3-D.*\(4, 8\)"),
    (dict(k=B["k"].unsqueeze(0)), ValueError, r"k must be 3-D"),
    (dict(q=[1.0]), TypeError, r"q must be a torch.Tensor, got list"),
    (dict(q=B["q"].to(torch.int32)), TypeError, r"q dtype .* got torch.int32"),
    (dict(v=B["v"].double()), TypeError, r"one dtype.*v torch.float64"),
    (dict(q=B["q"].to("meta")), ValueError, r"one device.*q meta"),
    (dict(q=torch.randn(6, 3, 8)), ValueError, r"num_heads_q \(3\).*num_heads_kv \(2\)"),
    (dict(q=torch.randn(6, 4, 16)), ValueError, r"head_dim mismatch: q has 16, k has 8"),
    (dict(v=torch.randn(5, 4, 8)), ValueError, r"k and v must have the same tokens and heads.*\(5, 4, 8\)"),
    (dict(v=torch.randn(4, 2, 8)), ValueError, r"k and v must have the same tokens and heads.*\(4, 2, 8\)"),
    (dict(q=torch.randn(6, 4, 0), k=torch.randn(5, 2, 0), v=torch.randn(5, 2, 0)), ValueError, r"head_dim"),
    (
        dict(q_ranges=B["q_ranges"].long()),
        TypeError,
        r"q_ranges must be an int32 tensor, got dtype torch.int64",
    ),
    (dict(k_ranges=B["k_ranges"].float()), TypeError, r"k_ranges must be an int32.*float32"),
    (dict(q_ranges=[[0, 6], [0, 3]]), TypeError, r"q_ranges must be a torch.Tensor, got list"),
    (dict(q_ranges=B["q_ranges"].view(-1)), ValueError, r"q_ranges must have shape \(N, 2\), got \(4,\)"),
    (
        dict(k_ranges=torch.zeros(2, 3, dtype=I32)),
        ValueError,
        r"k_ranges must have shape \(N, 2\), got \(2, 3\)",
    ),
    (dict(k_ranges=B["k_ranges"][:1]), ValueError, r"same N, got 2 and 1"),
    (
        dict(q_ranges=torch.tensor([[-1, 6], [0, 3]], dtype=I32)),
        ValueError,
        r"q_ranges\[0\] = \[-1, 6\).*negative",
    ),
    (
        dict(k_ranges=torch.tensor([[0, 3], [4, 3]], dtype=I32)),
        ValueError,
        r"k_ranges\[1\] = \[4, 3\).*end < start",
    ),
    (
        dict(q_ranges=torch.tensor([[0, 7], [0, 3]], dtype=I32)),
        ValueError,
        r"q_ranges\[0\] = \[0, 7\).*Tq = 6",
    ),
    (
        dict(k_ranges=torch.tensor([[0, 3], [3, 6]], dtype=I32)),
        ValueError,
        r"k_ranges\[1\] = \[3, 6\).*Tk = 5",
    ),
    (
        dict(attn_type_map=torch.tensor([1], dtype=I32)),
        ValueError,
        r"attn_type_map must have shape \(N,\) = \(2,\)",
    ),
    (dict(attn_type_map=torch.tensor([1, 4], dtype=I32)), ValueError, r"attn_type_map\[1\] = 4 .* 0..3"),
    (dict(attn_type_map=torch.tensor([-1, 0], dtype=I32)), ValueError, r"attn_type_map\[0\] = -1"),
    (dict(attn_type_map=torch.tensor([1, 0])), TypeError, r"attn_type_map must be an int32.*int64"),
    (dict(softcap=-1.0), ValueError, r"softcap must be >= 0.*-1.0"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be finite, got nan"),
    (dict(softcap="1"), TypeError, r"softcap must be a real number, got str"),
    (dict(softmax_scale=float("inf")), ValueError, r"softmax_scale must be finite"),
    (dict(softmax_scale=torch.tensor(1.0)), TypeError, r"softmax_scale must be a real number, got Tensor"),
    (dict(sink=torch.zeros(2, 4, dtype=torch.float64)), TypeError, r"sink must be float32.*float64"),
    (dict(sink=torch.zeros(2, 3)), ValueError, r"sink_layout='sh' must have shape \(S_sink, 4\).*\(2, 3\)"),
    (dict(sink=torch.zeros(0, 4)), ValueError, r"S_sink >= 1.*\(0, 4\)"),
    (dict(sink=torch.zeros(2, 4), sink_layout="ssh"), ValueError, r"'ssh' must have shape \(6, S_sink, 4\)"),
    (dict(sink=torch.zeros(5, 2, 4), sink_layout="ssh"), ValueError, r"\(6, S_sink, 4\).*\(5, 2, 4\)"),
    (
        dict(sink=torch.zeros(2, 4), sink_layout="hs"),
        ValueError,
        r"sink_layout must be 'sh' or 'ssh', got 'hs'",
    ),
    (dict(sink=torch.zeros(2, 4).to("meta")), ValueError, r"sink must be on q's device"),
    (dict(sink=[0.0]), TypeError, r"sink must be a torch.Tensor"),
    (dict(deterministic=1), TypeError, r"deterministic must be a bool, got int"),
    (dict(return_max_logits="yes"), TypeError, r"return_max_logits must be a bool"),
]


@pytest.mark.parametrize(("overrides", "exc", "pattern"), CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input(monkeypatch, overrides, exc, pattern):
    def no_compute(*a, **k):  # validation must happen before any compute
        raise AssertionError("compute reached")

    monkeypatch.setattr(_forward, "forward_tile", no_compute)
    with pytest.raises(exc, match=pattern):
        _call(**overrides)


def test_float64_sink_allowed_for_float64_inputs():
    kw = _base(dtype=torch.float64)
    out, meta = flex_flash_attn_func(
        kw["q"], kw["k"], kw["v"], kw["q_ranges"], kw["k_ranges"], kw["attn_type_map"],
        sink=torch.zeros(1, 4, dtype=torch.float64),
    )  # fmt: skip
    assert meta.lse.dtype == torch.float32 and out.dtype == torch.float64


def test_valid_edge_values_accepted():
    # empty ranges anywhere in bounds, ends equal to Tq / Tk, softcap 0, integer scale
    kw = _base()
    qr = torch.tensor([[6, 6], [0, 6]], dtype=I32)
    kr = torch.tensor([[5, 5], [0, 5]], dtype=I32)
    out, _ = flex_flash_attn_func(kw["q"], kw["k"], kw["v"], qr, kr, None, softmax_scale=1, softcap=0)
    assert out.shape == (6, 4, 8)


def _acc(tq=6, hq=4, d=8, dtype=torch.float32):
    return torch.zeros(tq, hq, d, dtype=dtype), torch.full((tq, hq), float("-inf"), dtype=dtype)


@pytest.mark.parametrize(
    ("which", "value", "exc", "pattern"),
    [
        (
            "out_acc",
            torch.zeros(6, 4, 7),
            ValueError,
            r"out_acc must have shape \(6, 4, 8\), got \(6, 4, 7\)",
        ),
        (
            "out_acc",
            torch.zeros(6, 4, 8, dtype=torch.bfloat16),
            TypeError,
            r"out_acc must have dtype.*bfloat16",
        ),
        ("lse_acc", torch.zeros(6, 3), ValueError, r"lse_acc must have shape \(6, 4\)"),
        ("lse_acc", torch.zeros(6, 4).to("meta"), ValueError, r"lse_acc must be on q's device"),
        ("max_logits_acc", torch.zeros(3), ValueError, r"max_logits_acc must have shape \(4,\)"),
        ("max_logits_acc", torch.zeros(4, dtype=torch.float16), TypeError, r"max_logits_acc must have dtype"),
    ],
)
def test_forward_stage_accumulators(which, value, exc, pattern):
    kw = _base()
    out_acc, lse_acc = _acc()
    accs = dict(out_acc=out_acc, lse_acc=lse_acc, max_logits_acc=None)
    accs[which] = value
    with pytest.raises(exc, match=pattern):
        ffa_forward_stage(
            kw["q"], kw["k"], kw["v"], kw["q_ranges"], kw["k_ranges"], kw["attn_type_map"],
            accs["out_acc"], accs["lse_acc"], max_logits_acc=accs["max_logits_acc"],
        )  # fmt: skip


@pytest.mark.parametrize(
    ("which", "value", "exc", "pattern"),
    [
        ("dout", torch.zeros(6, 4, 7), ValueError, r"dout must have shape \(6, 4, 8\)"),
        ("dout", torch.zeros(6, 4, 8, dtype=torch.int32), TypeError, r"dout must be a floating-point"),
        ("out", torch.zeros(5, 4, 8), ValueError, r"out must have shape \(6, 4, 8\)"),
        ("lse", torch.zeros(6, 4, 1), ValueError, r"lse must have shape \(6, 4\)"),
        ("dq_acc", torch.zeros(6, 4, 8, dtype=torch.float16), TypeError, r"dq_acc must have dtype"),
        ("dk_acc", torch.zeros(6, 2, 8), ValueError, r"dk_acc must have shape \(5, 2, 8\)"),
        ("dv_acc", torch.zeros(5, 4, 8), ValueError, r"dv_acc must have shape \(5, 2, 8\)"),
        ("q_ranges", torch.tensor([[0, 9]], dtype=I32), ValueError, r"q_ranges must have the same N|same N"),
    ],
)
def test_backward_stage_arguments(which, value, exc, pattern):
    kw = _base()
    args = dict(
        dout=torch.zeros(6, 4, 8), out=torch.zeros(6, 4, 8), lse=torch.zeros(6, 4),
        dq_acc=torch.zeros(6, 4, 8), dk_acc=torch.zeros(5, 2, 8), dv_acc=torch.zeros(5, 2, 8),
        q_ranges=kw["q_ranges"],
    )  # fmt: skip
    args[which] = value
    with pytest.raises(exc, match=pattern):
        ffa_backward_stage(
            args["dout"], kw["q"], kw["k"], kw["v"], args["out"], args["lse"], args["q_ranges"],
            kw["k_ranges"], kw["attn_type_map"], args["dq_acc"], args["dk_acc"], args["dv_acc"],
        )  # fmt: skip


def test_validation_copies_the_ranges_to_host_once(monkeypatch):
    """Cheap validation: a single .tolist() of the range values (no per-slice syncs)."""
    calls = []
    real = torch.Tensor.tolist

    def counting(self):
        calls.append(tuple(self.shape))
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    _call()
    assert calls == [(2, 5)]


def test_range_checks_are_cached_by_identity_and_version():
    from ffa_kernels import _validate

    q, k, v = (torch.randn(8, 2, 4) for _ in range(3))
    qr = torch.tensor([[0, 8]], dtype=torch.int32)
    kr = torch.tensor([[0, 8]], dtype=torch.int32)
    calls = []
    real = _validate._check_ranges_uncached

    def counting(*args):
        calls.append(1)
        return real(*args)

    _validate._check_ranges_uncached = counting
    try:
        _validate._CHECKED_RANGES.clear()
        for _ in range(3):
            _validate.validate_attn_args(q, k, v, qr, kr, None, None, 0.0)
        assert len(calls) == 1  # same tensors: checked once
        kr[0, 1] = 9  # in-place write: out of bounds now, and must be re-checked
        with pytest.raises(ValueError, match="k_ranges"):
            _validate.validate_attn_args(q, k, v, qr, kr, None, None, 0.0)
        assert len(calls) == 2
    finally:
        _validate._check_ranges_uncached = real


def test_packed_kv_rows_are_read_in_place():
    """K/V views whose rows stand apart (kv[:, 0], kv[:, 1] of a (Tk, 2, Hk, D) tensor) pass
    validation without a copy and give the same result as contiguous K/V; other strides
    (non-contiguous heads) are copied."""
    from ffa_kernels._validate import validate_attn_args

    g = torch.Generator().manual_seed(3)
    q = torch.randn(12, 4, 8, generator=g)
    kv = torch.randn(10, 2, 2, 8, generator=g)
    r_q = torch.tensor([[0, 12]], dtype=torch.int32)
    r_k = torch.tensor([[0, 10]], dtype=torch.int32)
    args = validate_attn_args(q, kv[:, 0], kv[:, 1], r_q, r_k, None, None, 0.0)
    assert args.k.data_ptr() == kv.data_ptr() and args.v.data_ptr() == kv[:, 1].data_ptr()
    heads_apart = torch.randn(10, 2, 2, 8, generator=g)[:, :, 0]  # (Tk, Hk, D), heads 2*D apart
    args = validate_attn_args(q, heads_apart, heads_apart, r_q, r_k, None, None, 0.0)
    assert args.k.is_contiguous()
    ty = torch.tensor([1], dtype=torch.int32)
    out, meta = flex_flash_attn_func(q, kv[:, 0], kv[:, 1], r_q, r_k, ty)
    ref, ref_meta = flex_flash_attn_func(q, kv[:, 0].contiguous(), kv[:, 1].contiguous(), r_q, r_k, ty)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(meta.lse, ref_meta.lse, atol=0, rtol=0)


def test_kernel_reads_packed_kv_in_place():
    """The sm90 launch path takes packed K/V views as they are (row stride 2*Hk*D), and copies
    K/V whose rows are not 16 bytes apart or differ between K and V (nothing is launched)."""
    from ffa_kernels.cute.interface import _kv_rows

    kv = torch.randn(10, 2, 2, 8).to(torch.bfloat16)
    k, v, stride = _kv_rows(kv[:, 0], kv[:, 1])
    assert (k.data_ptr(), v.data_ptr(), stride) == (kv.data_ptr(), kv[:, 1].data_ptr(), 2 * 2 * 8)
    odd = torch.randn(10, 36).to(torch.bfloat16)[:, :32].view(10, 2, 16)  # rows 72 bytes apart
    k, v, stride = _kv_rows(odd, odd)
    assert k.is_contiguous() and k.data_ptr() != odd.data_ptr() and stride == 32
    k, v, stride = _kv_rows(kv[:, 0], kv[:, 0].contiguous())  # K and V strides differ
    assert k.is_contiguous() and v.is_contiguous() and stride == 16


def test_forward_reads_k_and_v_each_with_its_own_row_stride():
    """The forward kernel takes K's and V's row strides apart: packed K/V views, MLA's K (192)
    and V (128) with different strides, and a latent-style (Tk, 1, 192 + 128) tensor split into
    K and V are all read in place; rows not 16 bytes apart are copied (nothing is launched)."""
    from ffa_kernels.cute.interface import _rows_in_place

    kv = torch.randn(10, 2, 2, 8).to(torch.bfloat16)
    assert [(t.data_ptr(), s) for t, s in map(_rows_in_place, (kv[:, 0], kv[:, 1]))] == [
        (kv.data_ptr(), 2 * 2 * 8),
        (kv[:, 1].data_ptr(), 2 * 2 * 8),
    ]
    k, v = torch.randn(10, 2, 192).to(torch.bfloat16), torch.randn(10, 2, 128).to(torch.bfloat16)
    assert _rows_in_place(k) == (k, 2 * 192) and _rows_in_place(v) == (v, 2 * 128)
    latent = torch.randn(10, 1, 320).to(torch.bfloat16)
    (k, ks), (v, vs) = _rows_in_place(latent[..., :192]), _rows_in_place(latent[..., 192:])
    assert (k.data_ptr(), v.data_ptr(), ks, vs) == (latent.data_ptr(), latent.data_ptr() + 384, 320, 320)
    odd = torch.randn(10, 36).to(torch.bfloat16)[:, :32].view(10, 2, 16)  # rows 72 bytes apart
    t, stride = _rows_in_place(odd)
    assert t.is_contiguous() and t.data_ptr() != odd.data_ptr() and stride == 32
    heads_apart = torch.randn(10, 2, 2, 8).to(torch.bfloat16)[:, :, 0]  # heads 2*D apart
    t, stride = _rows_in_place(heads_apart)
    assert t.is_contiguous() and stride == 16


def _grads_through_autograd(dout_of):
    """Gradients of flex_flash_attn_func's output with the output gradient ``dout_of(out)``
    (the same q, k, v every call)."""
    torch.manual_seed(1)
    kw = _base()
    q, k, v = (kw.pop(n).requires_grad_() for n in ("q", "k", "v"))
    out, _ = flex_flash_attn_func(q, k, v, kw["q_ranges"], kw["k_ranges"], kw["attn_type_map"])
    return torch.autograd.grad(out, (q, k, v), dout_of(out))


def test_backward_dout_layouts_give_the_same_gradients():
    """A non-contiguous or differently typed output gradient gives the gradients of its
    contiguous, same-dtype values (never garbage or NaN)."""
    torch.manual_seed(0)
    dout = torch.randn(6, 4, 8, dtype=torch.float64)
    want = _grads_through_autograd(lambda out: dout.to(out.dtype))
    # a transposed view of a (8, 4, 6) tensor and an expanded one: both non-contiguous
    t = dout.to(torch.float32).permute(2, 1, 0).contiguous().permute(2, 1, 0)
    assert not t.is_contiguous()
    for dout_of in (lambda out: t, lambda out: dout):  # float64 dout: autograd casts it
        got = _grads_through_autograd(dout_of)
        for g, w in zip(got, want):
            assert torch.isfinite(g).all() and torch.allclose(g, w, rtol=1e-6, atol=1e-6)
    row = torch.randn(1, 4, 8).expand(6, 4, 8)
    got = _grads_through_autograd(lambda out: row)
    want = _grads_through_autograd(lambda out: row.contiguous())
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize(
    ("dout", "pattern"),
    [
        (torch.randn(6, 4, 7), r"(?i)shape"),
        (torch.randn(6, 8), r"(?i)shape"),
        (torch.randn(6, 4, 8, device="meta"), r"(?i)device"),
    ],
)
def test_backward_bad_dout_is_an_error(dout, pattern):
    """An output gradient of the wrong shape or device: a clear error before any compute."""
    with pytest.raises((RuntimeError, ValueError), match=pattern):
        _grads_through_autograd(lambda out: dout)


def test_backward_stage_deterministic_must_be_bool():
    kw = _base()
    with pytest.raises(TypeError, match="deterministic"):
        ffa_backward_stage(
            torch.zeros(6, 4, 8), kw["q"], kw["k"], kw["v"], torch.zeros(6, 4, 8), torch.zeros(6, 4),
            kw["q_ranges"], kw["k_ranges"], kw["attn_type_map"], torch.zeros(6, 4, 8), torch.zeros(5, 2, 8),
            torch.zeros(5, 2, 8), deterministic="yes",
        )  # fmt: skip


def test_checked_ranges_record_skips_inference_copies():
    """A record of checked ranges is kept for device tensors with a version counter only:
    normalised copies made under inference mode (here the type map made for None) keep none,
    and asking does not raise. (Meta tensors stand in for a CUDA device.)"""
    from ffa_kernels import _validate

    slices = [(0, 4, 0, 4, 0)]
    qr = torch.tensor([[0, 4]], dtype=torch.int32, device="meta")
    kr = torch.tensor([[0, 4]], dtype=torch.int32, device="meta")
    with torch.inference_mode():
        tm = torch.zeros(1, dtype=torch.int32, device="meta")
        _validate._remember_checked((qr, kr, tm, slices), 4, 4)
    assert _validate.mask_record(qr, kr, tm) is None
    tm = torch.zeros(1, dtype=torch.int32, device="meta")
    _validate._remember_checked((qr, kr, tm, slices), 4, 4)
    rec = _validate.mask_record(qr, kr, tm, 4, 4)
    assert rec is not None and not rec.owned and rec.slices == slices
    kr.add_(0)  # in place: the record no longer holds
    assert _validate.mask_record(qr, kr, tm, 4, 4) is None


def test_checked_ranges_record_never_replaces_a_flexmask_record():
    """A FlexMask's (owned) record of live tensors stays when a call checks the same tensors for
    other totals; an unowned record is replaced."""
    from ffa_kernels import _validate

    qr = torch.tensor([[0, 4]], dtype=torch.int32, device="meta")
    kr = torch.tensor([[0, 4]], dtype=torch.int32, device="meta")
    tm = torch.zeros(1, dtype=torch.int32, device="meta")
    owned = _validate.register_mask(qr, kr, tm, 4, 4, [(0, 4, 0, 4, 0)])
    _validate._remember_checked((qr, kr, tm, [(0, 4, 0, 4, 0)]), 8, 8)
    assert _validate.mask_record(qr, kr, tm) is owned
    qr2 = torch.tensor([[0, 4]], dtype=torch.int32, device="meta")
    _validate._remember_checked((qr2, kr, tm, [(0, 4, 0, 4, 0)]), 4, 4)
    first = _validate.mask_record(qr2, kr, tm, 4, 4)
    _validate._remember_checked((qr2, kr, tm, [(0, 4, 0, 4, 0)]), 8, 8)
    second = _validate.mask_record(qr2, kr, tm, 8, 8)
    assert first is not None and second is not None and second is not first
