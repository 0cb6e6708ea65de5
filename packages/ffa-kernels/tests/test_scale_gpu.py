"""softmax_scale <= 0 on the GPU: the kernels decline it and the call runs on the reference
(one BackendFallbackWarning naming softmax_scale); forward and backward equal float64 autograd."""

import warnings

import pytest
import torch

from ffa_kernels import BackendFallbackWarning, _backend, flex_flash_attn_func
from ffa_kernels.testing import dense_attention

pytestmark = pytest.mark.gpu


@pytest.mark.sm90
@pytest.mark.parametrize("scale", [0.0, -0.07])
def test_non_positive_scale_runs_on_the_reference(scale):
    _backend.reset_cache()
    g = torch.Generator(device="cuda").manual_seed(3)
    t, h, d = 300, 2, 128
    q, k, v, dout = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    qr = torch.tensor([[0, 120], [120, 300]], dtype=torch.int32, device="cuda")
    kr = qr.clone()
    types = torch.tensor([1, 1], dtype=torch.int32, device="cuda")  # causal documents: masked cells
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out, _ = flex_flash_attn_func(*xs, qr, kr, types, softmax_scale=scale)
        out.backward(dout)
    messages = [str(w.message) for w in record if issubclass(w.category, BackendFallbackWarning)]
    assert any("softmax_scale" in m for m in messages), messages
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _, _ = dense_attention(*ref_in, qr.tolist(), kr.tolist(), types.tolist(), softmax_scale=scale)
    ref.backward(dout.double())
    assert torch.isfinite(out).all() and all(torch.isfinite(x.grad).all() for x in xs)
    assert (out.double() - ref).abs().max() < 2e-2
    for x, r in zip(xs, ref_in):
        assert (x.grad.double() - r.grad).abs().max() < 5e-2
