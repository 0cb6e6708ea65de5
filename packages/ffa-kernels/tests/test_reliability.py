"""Reliability of flex_flash_attn_func (issue 23): a right result or a clear error, no stale cache.

The multi-rank rows (ranges rewritten by ``dist.broadcast``, keys that differ between ranks)
are in integration_tests/test_reliability.py.
"""

import pytest
import torch

from ffa_kernels import flex_flash_attn_func, validate_attn_inputs
from ffa_kernels._identity_cache import IdentityCache

I32 = torch.int32


def _qkv(t=256, hq=2, hk=2, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(t, h, d, generator=g, dtype=dtype) for h in (hq, hk, hk))


def _ranges(*rows):
    return torch.tensor(rows, dtype=I32).reshape(-1, 2)


# ----------------------------------------------------------------------------- in-place rewrites


def _rewrite_numpy(t, i, j, value):
    t.numpy()[i, j] = value


def _rewrite_data(t, i, j, value):
    t.data[i, j] = value


def _rewrite_from_numpy_view(t, i, j, value):
    view = torch.from_numpy(t.numpy())  # another tensor on the same memory, its own version
    view[i, j] = value


REWRITES = [_rewrite_numpy, _rewrite_data, _rewrite_from_numpy_view]


@pytest.mark.parametrize("rewrite", REWRITES, ids=lambda f: f.__name__)
def test_ranges_rewritten_in_place_without_version_bump_are_checked_again(rewrite):
    q, k, v = _qkv()
    qr, kr = _ranges([0, 256]), _ranges([0, 256])
    flex_flash_attn_func(q, k, v, qr, kr)
    version = kr._version
    rewrite(kr, 0, 1, 10_000)
    assert kr._version == version  # the write is invisible to the version counter
    with pytest.raises(ValueError, match=r"k_ranges\[0\] = \[0, 10000\).*Tk = 256"):
        flex_flash_attn_func(q, k, v, qr, kr)


@pytest.mark.parametrize("rewrite", REWRITES, ids=lambda f: f.__name__)
def test_ranges_rewritten_in_place_give_the_new_mask(rewrite):
    q, k, v = _qkv()
    qr, kr, tm = _ranges([0, 256], [0, 100]), _ranges([0, 256], [0, 10]), torch.tensor([1, 0], dtype=I32)
    flex_flash_attn_func(q, k, v, qr[:1], kr[:1], tm[:1])
    flex_flash_attn_func(q, k, v, qr, kr, tm)
    rewrite(kr, 0, 1, 128)
    rewrite(qr, 1, 0, 150)
    rewrite(qr, 1, 1, 200)
    tm.numpy()[1] = 2
    out, meta = flex_flash_attn_func(q, k, v, qr, kr, tm)
    ref, ref_meta = flex_flash_attn_func(q, k, v, qr.clone(), kr.clone(), tm.clone())
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(meta.lse, ref_meta.lse, atol=0, rtol=0)


def test_equal_content_in_another_tensor_gives_that_tensors_values():
    """A content hit never hands back another (since rewritten) tensor's values."""
    q, k, v = _qkv()
    a, kr = _ranges([0, 256]), _ranges([0, 256])
    flex_flash_attn_func(q, k, v, a, kr)  # content [0, 256) cached
    b = a.clone()
    a.numpy()[0, 1] = 100  # a changes behind the version counter
    out, _ = flex_flash_attn_func(q, k, v, b, kr)  # b still holds [0, 256)
    ref, _ = flex_flash_attn_func(q, k, v, _ranges([0, 256]), kr.clone())
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


# ----------------------------------------------------------------------------- inference mode


def test_inference_mode_ranges_run_and_the_next_normal_call_works():
    q, k, v = _qkv()
    with torch.inference_mode():
        qr, kr = _ranges([0, 256]), _ranges([0, 200])
        out, _ = flex_flash_attn_func(q, k, v, qr, kr, torch.tensor([1], dtype=I32))
        assert out.is_inference()
    qn = q.clone().requires_grad_()
    ref, _ = flex_flash_attn_func(
        qn, k, v, _ranges([0, 256]), _ranges([0, 200]), torch.tensor([1], dtype=I32)
    )
    torch.testing.assert_close(out, ref.detach(), atol=0, rtol=0)
    ref.sum().backward()  # a normal (training) call after it, with the inference-mode ranges too
    out2, _ = flex_flash_attn_func(qn, k, v, qr, kr, torch.tensor([1], dtype=I32))
    torch.testing.assert_close(out2.detach(), ref.detach(), atol=0, rtol=0)


def test_identity_cache_skips_inference_tensors():
    cache = IdentityCache(maxsize=4)
    with torch.inference_mode():
        t = torch.zeros(3, dtype=I32)
    cache.put((t,), None, "value")  # no version counter to trust: not stored, no error
    assert cache.get((t,)) is None
    n = torch.zeros(3, dtype=I32)
    cache.put((n,), None, "value")
    assert cache.get((n,)) == "value"


# ----------------------------------------------------------------------------- double backward


def test_double_backward_is_refused():
    q, k, v = (x.requires_grad_() for x in _qkv(t=64))
    out, _ = flex_flash_attn_func(q, k, v, _ranges([0, 64]), _ranges([0, 64]), torch.tensor([1], dtype=I32))
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.grad(gq.sum(), q)


# ----------------------------------------------------------------------------- shared validation


BAD_INPUTS = [
    # (overrides, exception, message) for the checks magi_dist.calc_attn shares
    (dict(softcap=True), TypeError, r"softcap must be a real number, got bool True"),
    (dict(softmax_scale="0.5"), TypeError, r"softmax_scale must be a real number, got str '0.5'"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite, got nan"),
    (dict(sink=torch.zeros(2, 2, dtype=torch.float16)), TypeError, r"sink must be float32.*float16"),
    (dict(sink=torch.zeros(2, 2, dtype=torch.bfloat16)), TypeError, r"sink must be float32.*bfloat16"),
    (dict(sink=torch.zeros(2, 2, dtype=torch.int64)), TypeError, r"sink must be float32.*int64"),
    (dict(sink=torch.zeros(2, 3)), ValueError, r"sink with sink_layout='sh' must have shape \(S_sink, 2\)"),
    (dict(return_max_logits=1), TypeError, r"return_max_logits must be a bool, got int"),
]


@pytest.mark.parametrize(("overrides", "exc", "pattern"), BAD_INPUTS, ids=[c[2][:30] for c in BAD_INPUTS])
def test_validate_attn_inputs_matches_flex_flash_attn_func(overrides, exc, pattern):
    q, k, v = _qkv(t=16, dtype=torch.float32)
    with pytest.raises(exc, match=pattern):
        validate_attn_inputs(q, k, v, **overrides)
    with pytest.raises(exc, match=pattern):
        flex_flash_attn_func(q, k, v, _ranges([0, 16]), _ranges([0, 16]), **overrides)


def test_validate_attn_inputs_resolves_defaults():
    q, k, v = _qkv(t=16, d=16, dtype=torch.float32)
    sink = torch.zeros(16, 1, 2)
    got = validate_attn_inputs(q, k, v, sink=sink, sink_layout="ssh", softcap=2)
    assert got.softmax_scale == 16**-0.5 and got.softcap == 2.0 and isinstance(got.softcap, float)
    assert got.sink is sink and got.sink_layout == "ssh" and got.return_max_logits is False
