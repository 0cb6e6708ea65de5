"""PyTorch integration: torch.compile (fullgraph, no recompiles), the operators, FlexMask,
autocast and the backend fallback's warning / FFA_BACKEND=cute error.

torch.compile on the CPU is slow: tiny shapes; the inductor backend once on the CPU (the block
test), ``aot_eager`` elsewhere (it runs AOTAutograd with the operators' fake implementations and
autograd formulas, which is what the integration needs). The GPU test at the end compiles the
same block on sm90 with FFA_BACKEND=cute: the CuTe kernels behind the same operators.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from ffa_kernels import (
    CAUSAL,
    BackendFallbackWarning,
    FlexMask,
    _backend,
    _validate,
    flex_flash_attn_func,
)
from ffa_kernels.testing import PackedBlock, dense_attention, dense_mask

I32 = torch.int32


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("FFA_BACKEND", raising=False)
    torch._dynamo.reset()
    _backend.reset_cache()
    yield
    torch._dynamo.reset()
    _backend.reset_cache()


def _doc_ranges(lengths: list[int], device="cpu") -> torch.Tensor:
    ends = torch.tensor(lengths).cumsum(0)
    return torch.stack([ends - torch.tensor(lengths), ends], dim=1).to(device=device, dtype=I32)


def _step_lengths(step: int, total: int = 48, docs: int = 3) -> list[int]:
    """Document lengths that change every step, same count and same total."""
    first = 6 + 5 * step
    second = 9 + 3 * step
    return [first, second, total - first - second][:docs]


def _loss_and_grads(model, x, **kw):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = model(x, **kw)
    loss = (out * torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)).sum()
    loss.backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


# ----------------------------------------------------------------------------- torch.compile


def test_compiled_block_matches_eager_without_recompiles():
    """fullgraph inductor compile of attention + MLP, forward and backward, with a FlexMask whose
    document lengths change every step (same count): equal to eager, compiled once."""
    torch.manual_seed(0)
    model = PackedBlock()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for step in range(5):
        docs = _doc_ranges(_step_lengths(step))
        mask = FlexMask.from_ranges(docs, docs, [CAUSAL] * 3, 48, 48)
        x = torch.randn(48, 32)
        out, grads = _loss_and_grads(compiled, x, mask=mask)
        ref_out, ref_grads = _loss_and_grads(model, x, mask=mask)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    assert counter.frame_count == 1


def test_raw_ranges_compile_once_and_are_checked_when_run():
    """Raw range tensors under fullgraph compile: new values every step cost no recompile (the
    op checks them when it runs), and bad values still raise the eager ValueError."""
    torch.manual_seed(1)
    model = PackedBlock()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    types_ = torch.tensor([CAUSAL, 0, CAUSAL], dtype=I32)
    for step in range(5):
        docs = _doc_ranges(_step_lengths(step))
        x = torch.randn(48, 32)
        out, grads = _loss_and_grads(compiled, x, q_ranges=docs, k_ranges=docs, types=types_)
        ref_out, ref_grads = _loss_and_grads(model, x, q_ranges=docs, k_ranges=docs, types=types_)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    assert counter.frame_count == 1
    bad = torch.tensor([[0, 16], [16, 40], [40, 49]], dtype=I32)  # past Tq = 48: never unchecked
    with pytest.raises(ValueError, match=r"q_ranges\[2\] = \[40, 49\) has end > Tq = 48"):
        compiled(torch.randn(48, 32), q_ranges=bad, k_ranges=docs, types=types_)
    bad_type = torch.tensor([CAUSAL, 7, 0], dtype=I32)
    with pytest.raises(ValueError, match=r"attn_type_map\[1\] = 7 is not a mask type code"):
        compiled(torch.randn(48, 32), q_ranges=docs, k_ranges=docs, types=bad_type)


def test_compiled_call_returns_meta_sink_and_max_logits():
    """The whole signature under fullgraph: sink (differentiable), softcap, max_logits, meta."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(20, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(20, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(20, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = FlexMask.from_ranges([[0, 12], [12, 20]], [[0, 12], [0, 20]], ["causal", "full"], 20, 20)

    def f(q, k, v, sink, mask):
        return flex_flash_attn_func(q, k, v, mask=mask, sink=sink, softcap=3.0, return_max_logits=True)

    out, meta = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, sink, mask)
    ref, ref_meta = f(q, k, v, sink, mask)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(meta.lse, ref_meta.lse)
    torch.testing.assert_close(meta.max_logits, ref_meta.max_logits)
    assert meta.lse.dtype == torch.float32 and not meta.lse.requires_grad
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sink), dout)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    dense, _, _ = dense_attention(
        q, k, v, mask.q_ranges, mask.k_ranges, mask.attn_type_map, sink=sink, softcap=3.0
    )
    torch.testing.assert_close(out, dense)


def test_operators_pass_opcheck():
    """The registrations (schema, fake, autograd, AOT dispatch with dynamic shapes) agree."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(12, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(10, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(10, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    qr = torch.tensor([[0, 12], [4, 10]], dtype=I32)
    kr = torch.tensor([[0, 5], [5, 10]], dtype=I32)
    tm = torch.tensor([CAUSAL, 2], dtype=I32)
    fwd = torch.ops.ffa_kernels.flex_flash_attn_forward
    torch.library.opcheck(fwd, (q, k, v, qr, kr, tm, None, "sh", 0.3, 0.0, True, False))
    out, lse, _ = fwd(q, k, v, qr, kr, tm, None, "sh", 0.3, 0.0, False, False)
    args = (
        torch.randn_like(out),
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse,
        qr,
        kr,
        tm,
        0.3,
        0.0,
        False,
    )
    torch.library.opcheck(torch.ops.ffa_kernels.flex_flash_attn_backward, args)


def test_operator_refuses_double_backward():
    q, k, v = (torch.randn(8, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    r = torch.tensor([[0, 8]], dtype=I32)
    out, _, _ = torch.ops.ffa_kernels.flex_flash_attn_forward(
        q, k, v, r, r, None, None, "sh", 0.5, 0.0, False, False
    )
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.grad(gq.sum(), q)


def test_meta_tensors_give_shapes():
    q = torch.empty(16, 4, 8, device="meta", dtype=torch.bfloat16)
    k = torch.empty(12, 2, 8, device="meta", dtype=torch.bfloat16)
    r = torch.empty(3, 2, device="meta", dtype=I32)
    out, meta = flex_flash_attn_func(q, k, k, r, r, return_max_logits=True)
    assert (out.shape, out.dtype, out.device.type) == ((16, 4, 8), torch.bfloat16, "meta")
    assert meta.lse.shape == (16, 4) and meta.lse.dtype == torch.float32 and meta.max_logits.shape == (4,)


# ----------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_casts_like_sdpa(compiled):
    """Under torch.autocast("cpu", bfloat16) fp32 q/k/v run in bf16 (out bf16), as SDPA does; the
    gradients of the fp32 leaves come back in fp32; the reference math itself is not autocast."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(24, h, 16, generator=gen, requires_grad=True) for h in (4, 2, 2))
    docs = _doc_ranges([10, 14])
    mask = FlexMask.from_ranges(docs, docs, [CAUSAL, CAUSAL], 24, 24)

    def f(q, k, v, mask):
        out, meta = flex_flash_attn_func(q, k, v, mask=mask)
        return out, meta.lse

    fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = fn(q, k, v, mask)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(g.dtype == torch.float32 for g in grads)
    # exactly the bf16 call without autocast
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    ref, ref_meta = flex_flash_attn_func(qb, kb, vb, mask=mask)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_meta.lse, atol=0, rtol=0)
    ref_grads = torch.autograd.grad(ref.float().sum(), (qb, kb, vb))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r.float(), atol=0, rtol=0)
    # and close to the float32 result
    full, _ = flex_flash_attn_func(q.detach(), k.detach(), v.detach(), mask=mask)
    torch.testing.assert_close(out.float(), full, atol=3e-2, rtol=3e-2)


def test_autocast_leaves_float64_alone():
    q = torch.randn(8, 2, 4, dtype=torch.float64)
    r = torch.tensor([[0, 8]], dtype=I32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = flex_flash_attn_func(q, q, q, r, r)
    assert out.dtype == torch.float64


# ----------------------------------------------------------------------------- backend fallback


def _declining_cute(reason: str):
    mod = types.ModuleType("ffa_kernels.cute")

    def cute_forward(*args, **kwargs):
        raise NotImplementedError(reason)

    mod.cute_forward = cute_forward
    return mod


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fallback_warns_once_or_raises_under_ffa_backend_cute(monkeypatch, compiled):
    """A call the kernels decline (here: head_dim 192) runs on the reference with one warning
    naming the reason and the backend used; FFA_BACKEND=cute makes it a RuntimeError. Compiled
    calls decide in the operator, at run time, in the same place."""
    reason = "head_dim: the sm90 kernel supports (64, 128), got 192"
    monkeypatch.setattr(_backend, "_cute", _declining_cute(reason))
    monkeypatch.setattr(_backend, "select_forward_backend", lambda device, dtype: "cute")
    q = torch.randn(6, 2, 192, dtype=torch.float64)
    r = torch.tensor([[0, 6]], dtype=I32)

    def f(q, r):
        return flex_flash_attn_func(q, q, q, r, r)[0]

    fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = fn(q, r)
        fn(q, r)
    messages = [str(w.message) for w in record if issubclass(w.category, BackendFallbackWarning)]
    assert len(messages) == 1
    assert reason in messages[0] and "runs on the reference backend" in messages[0]
    torch.testing.assert_close(out, dense_attention(q, q, q, r, r)[0])
    monkeypatch.setenv("FFA_BACKEND", "cute")
    with pytest.raises(
        RuntimeError, match=r"FFA_BACKEND=cute, but the CuTe backend cannot serve this call: head_dim"
    ):
        fn(q, r)


def test_ffa_backend_reference_is_chosen_without_warning(monkeypatch):
    monkeypatch.setenv("FFA_BACKEND", "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendFallbackWarning)
        assert _backend.select_forward_backend(torch.device("cuda"), torch.float32) == "reference"


# ----------------------------------------------------------------------------- FlexMask


def test_flex_mask_holds_checked_tensors_and_needs_no_host_copy(monkeypatch):
    docs = [[0, 5], [5, 12]]
    mask = FlexMask.from_ranges(docs, docs, ["causal", CAUSAL], 12, 12)
    assert mask.q_ranges.dtype == I32 and mask.q_ranges.is_contiguous() and mask.num_slices == 2
    assert mask.slices == [(0, 5, 0, 5, 1), (5, 12, 5, 12, 1)]
    assert mask.area() == 15 + 28 == int(mask.to_dense().sum())
    torch.testing.assert_close(mask.to_dense(), dense_mask(docs, docs, [1, 1], 12, 12))
    assert mask.to("cpu") is mask and "num_slices=2" in repr(mask)
    with pytest.raises(AttributeError):
        mask.total_q = 3  # frozen
    calls = []
    monkeypatch.setattr(_validate, "_check_ranges_uncached", lambda *a: calls.append(a))
    q = torch.randn(12, 2, 8)
    out, _ = flex_flash_attn_func(q, q, q, mask=mask)
    ref, _, _ = dense_attention(q.double(), q.double(), q.double(), docs, docs, [1, 1])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert calls == []  # checked when built: no range check (and no host copy) per call


def test_flex_mask_written_in_place_is_checked_again():
    mask = FlexMask.from_ranges([[0, 8]], [[0, 8]], None, 8, 8)
    q = torch.randn(8, 2, 4)
    flex_flash_attn_func(q, q, q, mask=mask)
    mask.q_ranges[0, 1] = 9  # not silently unchecked: no longer recognised as the checked mask
    assert not mask.is_intact()
    with pytest.raises(ValueError, match=r"q_ranges\[0\] = \[0, 9\) has end > Tq = 8"):
        flex_flash_attn_func(q, q, q, mask=mask)


MASK_ERRORS = [
    (dict(q_ranges=[[0, 9]]), ValueError, r"q_ranges\[0\] = \[0, 9\) has end > Tq = 8"),
    (dict(k_ranges=[[3, 2]]), ValueError, r"k_ranges\[0\] = \[3, 2\) has end < start"),
    (dict(q_ranges=[[-1, 4]]), ValueError, r"q_ranges\[0\] = \[-1, 4\) has a negative start"),
    (dict(attn_type_map=[5]), ValueError, r"mask type code must be in 0\.\.3, got 5"),
    (dict(attn_type_map=torch.tensor([5])), ValueError, r"attn_type_map\[0\] = 5 is not a mask type code"),
    (dict(attn_type_map=["sideways"]), ValueError, r"unknown mask type name 'sideways'"),
    (dict(attn_type_map=[0, 1]), ValueError, r"attn_type_map must have shape \(N,\) = \(1,\)"),
    (dict(k_ranges=[[0, 4], [4, 8]]), ValueError, r"q_ranges and k_ranges must have the same N, got 1 and 2"),
    (dict(q_ranges=[[0, 4, 8]]), TypeError, r"q_ranges must be a tensor or a sequence of \(N, 2\) pairs"),
    (
        dict(q_ranges=torch.zeros(1, 3, dtype=I32)),
        ValueError,
        r"q_ranges must have shape \(N, 2\), got \(1, 3\)",
    ),
    (dict(k_ranges=torch.zeros(1, 2)), TypeError, r"k_ranges must hold integers, got dtype torch.float32"),
    (dict(q_ranges=[[0, 2**31]]), ValueError, r"q_ranges has values outside int32"),
    (dict(total_q=-1), ValueError, r"total_q must be in \[0, 2\*\*31\), got -1"),
    (dict(total_k=8.0), TypeError, r"total_k must be an int, got float 8.0"),
    (dict(total_k=None), TypeError, r"total_k is required"),
]


@pytest.mark.parametrize(("overrides", "exc", "pattern"), MASK_ERRORS, ids=[c[2][:28] for c in MASK_ERRORS])
def test_flex_mask_errors_name_the_argument(overrides, exc, pattern):
    kw = dict(q_ranges=[[0, 8]], k_ranges=[[0, 8]], attn_type_map=None, total_q=8, total_k=8)
    kw.update(overrides)
    with pytest.raises(exc, match=pattern):
        FlexMask.from_ranges(**kw)


def test_flex_mask_constructor_checks_too():
    with pytest.raises(TypeError, match=r"q_ranges must be an int32 tensor \(or use from_ranges\)"):
        FlexMask(torch.tensor([[0, 8]]), torch.tensor([[0, 8]], dtype=I32), torch.zeros(1, dtype=I32), 8, 8)
    with pytest.raises(ValueError, match=r"k_ranges\[0\] = \[0, 9\) has end > Tk = 8"):
        FlexMask(
            torch.tensor([[0, 8]], dtype=I32),
            torch.tensor([[0, 9]], dtype=I32),
            torch.zeros(1, dtype=I32),
            8,
            8,
        )


def test_flex_mask_must_fit_the_call():
    mask = FlexMask.from_ranges([[0, 8]], [[0, 8]], None, 8, 8)
    q = torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match=r"mask was built for total_q=8, but q has 6 tokens"):
        flex_flash_attn_func(q[:6], q, q, mask=mask)
    with pytest.raises(ValueError, match=r"mask was built for total_k=8, but k has 10 tokens"):
        flex_flash_attn_func(q, torch.randn(10, 2, 4), torch.randn(10, 2, 4), mask=mask)
    with pytest.raises(ValueError, match=r"either mask= or q_ranges / k_ranges / attn_type_map, not both"):
        flex_flash_attn_func(q, q, q, mask.q_ranges, mask=mask)
    with pytest.raises(TypeError, match=r"mask must be a ffa_kernels.FlexMask, got list"):
        flex_flash_attn_func(q, q, q, mask=[[0, 8]])
    with pytest.raises(ValueError, match=r"mask is on meta, q on cpu: move the mask once with mask.to"):
        flex_flash_attn_func(q, q, q, mask=_meta_mask())


def _meta_mask():
    """A FlexMask whose tensors live on the meta device (built without its checks, which would
    need the values)."""
    m = object.__new__(FlexMask)
    for name, shape in (("q_ranges", (1, 2)), ("k_ranges", (1, 2)), ("attn_type_map", (1,))):
        object.__setattr__(m, name, torch.empty(shape, dtype=I32, device="meta"))
    object.__setattr__(m, "total_q", 8)
    object.__setattr__(m, "total_k", 8)
    return m


# ----------------------------------------------------------------------------- GPU (sm90)


@pytest.mark.gpu
@pytest.mark.sm90
def test_compiled_block_on_sm90_runs_the_cute_kernels(monkeypatch):
    """The block compiled (inductor, fullgraph) on sm90 in bf16 with FFA_BACKEND=cute: the CuTe
    kernels run inside the compiled graph (their launch takes the real current stream), equal to
    eager, without recompiles over changing document lengths."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FFA_BACKEND", "cute")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = PackedBlock(dim=256, heads=4, kv_heads=2, head_dim=64).to(dev, torch.bfloat16)
    model32 = copy.deepcopy(model).float()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    total = 768
    for step in range(4):
        lengths = [100 + 37 * step, 300 - 11 * step]
        lengths.append(total - sum(lengths))
        docs = _doc_ranges(lengths, dev)
        mask = FlexMask.from_ranges(docs, docs, [CAUSAL] * 3, total, total)
        x = torch.randn(total, 256, device=dev, dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # the kernels must launch on the caller's stream
            out, grads = _loss_and_grads(compiled, x, mask=mask)
        torch.cuda.current_stream().wait_stream(stream)
        ref_out, ref_grads = _loss_and_grads(model, x, mask=mask)
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
        # bf16: inductor fuses the norms and the MLP with float32 intermediates where eager rounds
        # each op, so the compiled gradients differ from eager's by bf16 rounding; measured
        # against the float32 model, they must be as accurate as eager's.
        monkeypatch.setenv("FFA_BACKEND", "reference")
        _, exact_grads = _loss_and_grads(model32, x.float(), mask=mask)
        monkeypatch.setenv("FFA_BACKEND", "cute")
        for g, r, e in zip(grads, ref_grads, exact_grads):
            err_c, err_e = (float((a.float() - e).norm() / e.norm()) for a in (g, r))
            assert err_c <= 2 * err_e + 2e-3, (
                f"gradient {tuple(g.shape)}: compiled {err_c:.3g}, eager {err_e:.3g}"
            )
    assert counter.frame_count == 1
