"""Backend selection (FFA_BACKEND, capability, dtype, import guard) and the CuTe dispatch path."""

import sys
import types
import warnings

import pytest
import torch

from ffa_kernels import _backend, apply_sink, ffa_forward_stage, flex_flash_attn_func
from ffa_kernels._merge import merge_lse_
from ffa_kernels.cute.interface import accumulators_fit
from ffa_kernels.testing import dense_attention

CUDA = torch.device("cuda")
Fallback = _backend.BackendFallbackWarning


def _fallback_messages(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, Fallback)]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("FFA_BACKEND", raising=False)
    _backend.reset_cache()
    yield
    _backend.reset_cache()


def _fake_cute(with_forward=True, calls=None):
    """A stand-in for ``ffa_kernels.cute`` computing with the dense oracle, recording its calls."""
    mod = types.ModuleType("ffa_kernels.cute")
    if with_forward:

        def cute_forward(q, k, v, q_ranges, k_ranges, attn_type_map, *, softmax_scale, softcap, sink,
                         sink_layout, return_max_logits, kv_ready=None):  # fmt: skip
            if calls is not None:
                calls.append(dict(fn="forward", softmax_scale=softmax_scale, softcap=softcap, sink=sink,
                                  return_max_logits=return_max_logits, ranges_dtype=q_ranges.dtype,
                                  type_map=attn_type_map.tolist()))  # fmt: skip
            out, lse, mx = dense_attention(
                q.double(), k.double(), v.double(), q_ranges, k_ranges, attn_type_map,
                sink=sink, sink_layout=sink_layout, softmax_scale=softmax_scale, softcap=softcap,
            )  # fmt: skip
            return out.to(q.dtype), lse.float(), mx.float() if return_max_logits else None

        def cute_forward_accumulate(q, k, v, q_ranges, k_ranges, attn_type_map, out_acc, lse_acc, *,
                                    softmax_scale, softcap, max_logits_acc=None):  # fmt: skip
            if calls is not None:
                calls.append(dict(fn="accumulate", out_acc=out_acc.data_ptr()))
            out, lse, mx = dense_attention(
                q.double(), k.double(), v.double(), q_ranges, k_ranges, attn_type_map,
                softmax_scale=softmax_scale, softcap=softcap,
            )  # fmt: skip
            merge_lse_(out_acc, lse_acc, out.to(out_acc.dtype), lse.to(lse_acc.dtype))
            if max_logits_acc is not None:
                torch.maximum(max_logits_acc, mx.to(max_logits_acc.dtype), out=max_logits_acc)
            return out_acc, lse_acc

        mod.cute_forward = cute_forward
        mod.cute_forward_accumulate = cute_forward_accumulate
        mod.accumulators_fit = accumulators_fit
    return mod


def test_cpu_defaults_to_reference_without_importing_cute(monkeypatch):
    monkeypatch.setattr(_backend, "load_cute", lambda: pytest.fail("cute imported on CPU"))
    assert _backend.select_forward_backend(torch.device("cpu"), torch.bfloat16) == "reference"
    assert _backend.select_backward_backend(torch.device("cpu"), torch.bfloat16) == "reference"


def test_env_var_values(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("FFA_BACKEND", "Reference")
    assert _backend.select_forward_backend(CUDA, torch.bfloat16) == "reference"
    monkeypatch.setenv("FFA_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"FFA_BACKEND.*'triton'"):
        _backend.select_forward_backend(torch.device("cpu"), torch.float32)
    monkeypatch.setenv("FFA_BACKEND", "cute")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        _backend.select_forward_backend(torch.device("cpu"), torch.float32)
    monkeypatch.setitem(sys.modules, "ffa_kernels.cute", None)  # import fails
    with pytest.raises(RuntimeError, match=r"FFA_BACKEND=cute.*cannot serve.*unavailable"):
        _backend.select_forward_backend(CUDA, torch.bfloat16)


@pytest.mark.parametrize(
    ("capability", "dtype", "reason"),
    [
        ((8, 0), torch.bfloat16, r"compute capability 8\.0 .* is not 9\.x"),
        ((9, 0), torch.float32, "float32 inputs"),
    ],
)
def test_forced_cute_raises_naming_the_reason(monkeypatch, capability, dtype, reason):
    """FFA_BACKEND=cute: what would be a fallback (with its warning) is a RuntimeError instead."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setitem(sys.modules, "ffa_kernels.cute", _fake_cute())
    monkeypatch.setenv("FFA_BACKEND", "cute")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fallback)  # raised, not warned
        with pytest.raises(
            RuntimeError, match=rf"FFA_BACKEND=cute, but the CuTe backend cannot serve this call: {reason}"
        ):
            _backend.select_forward_backend(CUDA, dtype)


@pytest.mark.parametrize(
    ("capability", "dtype", "module", "expected", "log"),
    [
        ((9, 0), torch.bfloat16, "ok", "cute", None),
        ((9, 0), torch.float16, "ok", "cute", None),
        ((8, 0), torch.bfloat16, "ok", "reference", "8.0 of cuda is not 9.x"),
        ((10, 0), torch.bfloat16, "ok", "reference", "10.0 of cuda is not 9.x"),
        ((9, 0), torch.float32, "ok", "reference", "float32 inputs (the kernels take float16/bfloat16"),
        ((9, 0), torch.bfloat16, "no_forward", "reference", "does not expose cute_forward"),
        ((9, 0), torch.bfloat16, "import_error", "reference", "import failed"),
    ],
)
def test_auto_selection_on_cuda(monkeypatch, capability, dtype, module, expected, log):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    fake = {"ok": _fake_cute(), "no_forward": _fake_cute(False), "import_error": None}[module]
    monkeypatch.setitem(sys.modules, "ffa_kernels.cute", fake)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert _backend.select_forward_backend(CUDA, dtype) == expected
    messages = _fallback_messages(record)
    if log is None:
        assert messages == []
    else:
        # warned once, not per call, naming the reason and the backend used
        assert len(messages) == 1 and log in messages[0] and "reference backend" in messages[0]


def test_backward_on_cute_runs_reference_and_warns_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "ffa_kernels.cute", _fake_cute())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert _backend.select_backward_backend(CUDA, torch.bfloat16) == "reference"
        assert _backend.select_backward_backend(CUDA, torch.bfloat16) == "reference"
    assert sum("no backward kernel" in m for m in _fallback_messages(record)) == 1


def test_cpu_is_not_a_fallback():
    """The kernels are CUDA-only: CPU tensors run on the reference without a warning."""
    q = torch.randn(4, 2, 8)
    r = torch.tensor([[0, 4]], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fallback)
        flex_flash_attn_func(q, q, q, r, r)


def test_cute_dispatch_path_sink_and_backward(monkeypatch):
    """With the CuTe backend selected, flex_flash_attn_func is one kernel call with the sink, and
    its result goes through the same backward."""
    calls = []
    monkeypatch.setattr(_backend, "_cute", _fake_cute(calls=calls))
    monkeypatch.setattr(_backend, "select_forward_backend", lambda device, dtype: "cute")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(7, 2, 8, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(7, 2, 8, generator=gen, dtype=torch.float64).requires_grad_()
    sink = torch.randn(2, 4, dtype=torch.float32, requires_grad=True)
    qr = torch.tensor([[0, 6], [2, 5]], dtype=torch.int32)
    kr = torch.tensor([[0, 4], [4, 7]], dtype=torch.int32)
    out, meta = flex_flash_attn_func(q, k, v, qr, kr, None, sink=sink, softcap=2.0, return_max_logits=True)
    assert len(calls) == 1 and calls[0]["fn"] == "forward" and calls[0]["sink"] is not None
    assert {
        k: calls[0][k] for k in ("softmax_scale", "softcap", "return_max_logits", "ranges_dtype", "type_map")
    } == dict(
        softmax_scale=8**-0.5, softcap=2.0, return_max_logits=True, ranges_dtype=torch.int32, type_map=[0, 0]
    )
    ref_out, ref_lse, ref_max = dense_attention(q, k, v, qr, kr, sink=sink, softcap=2.0)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(meta.lse, ref_lse.float())
    torch.testing.assert_close(meta.max_logits, ref_max.float())
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v, sink), dout)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("acc", ["float32", "float64", "float32-strided"])
def test_cute_stage_path_accumulates_in_place_or_merges(monkeypatch, acc):
    """A float32 contiguous accumulator is merged into by the kernel itself; float64 or strided
    ones get the kernel's fresh result merged by torch. Both equal the one-call oracle."""
    calls = []
    monkeypatch.setattr(_backend, "_cute", _fake_cute(calls=calls))
    monkeypatch.setattr(_backend, "select_forward_backend", lambda device, dtype: "cute")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(n, h, 8, generator=gen, dtype=torch.float64) for n, h in ((9, 4), (10, 2), (10, 2))
    )
    qr = torch.tensor([[0, 9], [3, 8], [0, 5]], dtype=torch.int32)
    kr = torch.tensor([[0, 4], [4, 10], [4, 10]], dtype=torch.int32)
    types_ = torch.tensor([1, 0, 2], dtype=torch.int32)
    dtype = torch.float64 if acc == "float64" else torch.float32
    if acc == "float32-strided":
        out_acc = torch.zeros(9, 4, 16, dtype=dtype)[..., ::2]
    else:
        out_acc = torch.zeros(9, 4, 8, dtype=dtype)
    lse_acc = torch.full((9, 4), float("-inf"), dtype=dtype)
    max_acc = torch.full((4,), float("-inf"), dtype=dtype)
    for part in ([0], [1, 2]):
        ffa_forward_stage(q, k, v, qr[part], kr[part], types_[part], out_acc, lse_acc, max_logits_acc=max_acc)
    apply_sink(out_acc, lse_acc, None, "sh")
    expected = "accumulate" if acc == "float32" else "forward"
    assert [c["fn"] for c in calls] == [expected, expected]
    if acc == "float32":
        assert calls[0]["out_acc"] == out_acc.data_ptr()
    ref_out, ref_lse, ref_max = dense_attention(q, k, v, qr, kr, types_)
    tol = 1e-5  # the kernel stand-in hands out float32 lse, like the kernel
    torch.testing.assert_close(out_acc.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse_acc.double(), ref_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(max_acc.double(), ref_max, atol=tol, rtol=tol)


def test_cute_not_implemented_falls_back_unless_forced(monkeypatch):
    def unsupported(*args, **kwargs):
        raise NotImplementedError("head_dim 3 is not supported")

    mod = types.ModuleType("ffa_kernels.cute")
    mod.cute_forward = unsupported
    monkeypatch.setattr(_backend, "_cute", mod)
    monkeypatch.setattr(_backend, "select_forward_backend", lambda device, dtype: "cute")
    q = torch.randn(4, 2, 3, dtype=torch.float64)
    r = torch.tensor([[0, 4]], dtype=torch.int32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out, _ = flex_flash_attn_func(q, q, q, r, r)
        flex_flash_attn_func(q, q, q, r, r)
    ref, _, _ = dense_attention(q, q, q, r, r)
    torch.testing.assert_close(out, ref)
    assert sum("(head_dim 3 is not supported)" in m for m in _fallback_messages(record)) == 1
    monkeypatch.setenv("FFA_BACKEND", "cute")
    with pytest.raises(RuntimeError, match=r"FFA_BACKEND=cute, but .*: head_dim 3 is not supported") as info:
        flex_flash_attn_func(q, q, q, r, r)
    assert isinstance(info.value.__cause__, NotImplementedError)


@pytest.mark.parametrize("scale", [0.0, -0.1])
@pytest.mark.parametrize("what", ["forward", "backward"])
def test_kernels_decline_scales_that_are_not_positive(scale, what):
    """The sm90 kernels mask scores to -inf before scaling them, so a softmax_scale <= 0 would
    give +inf / NaN in masked cells: they say so before anything runs (the frontend then falls
    back to the reference with a warning naming softmax_scale)."""
    from ffa_kernels.cute.interface import kernel_scales

    q = torch.empty(4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=f"softmax_scale: the sm90 {what} supports scales > 0"):
        kernel_scales(q, q, scale, 0.0, what)
    assert kernel_scales(q, q, 0.05, 0.0, what) == (0.05, 0.0)


def test_cuda_backend_choice_is_kept_per_variable_device_and_dtype(monkeypatch):
    """The choice for a CUDA device is made once per (direction, FFA_BACKEND value, device,
    dtype): setting FFA_BACKEND chooses afresh, a choice that raises is not kept, reset_cache
    forgets them. (No GPU needed: the selector is a stand-in.)"""
    calls = []

    def select(device, dtype):
        calls.append((device, dtype))
        if _backend.forced_backend() == "cute" and dtype == torch.float32:
            raise RuntimeError("FFA_BACKEND=cute, but the CuTe backend cannot serve this call")
        return "cute" if _backend.forced_backend() is None else _backend.forced_backend()

    dev = torch.device("cuda", 0)
    assert _backend._kept_choice("forward", dev, torch.bfloat16, select) == "cute"
    assert _backend._kept_choice("forward", dev, torch.bfloat16, select) == "cute"
    assert len(calls) == 1
    assert _backend._kept_choice("backward", dev, torch.bfloat16, select) == "cute"
    assert len(calls) == 2  # per direction
    monkeypatch.setenv("FFA_BACKEND", "reference")
    assert _backend._kept_choice("forward", dev, torch.bfloat16, select) == "reference"
    monkeypatch.setenv("FFA_BACKEND", "cute")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="FFA_BACKEND=cute"):
            _backend._kept_choice("forward", dev, torch.float32, select)
    assert len(calls) == 5  # the raise was not kept
    monkeypatch.delenv("FFA_BACKEND")
    _backend.reset_cache()
    assert _backend._kept_choice("forward", dev, torch.bfloat16, select) == "cute"
    assert len(calls) == 6
    # CPU devices choose every time
    cpu = torch.device("cpu")
    _backend._kept_choice("forward", cpu, torch.bfloat16, select)
    _backend._kept_choice("forward", cpu, torch.bfloat16, select)
    assert len(calls) == 8
