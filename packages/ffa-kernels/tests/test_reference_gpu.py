"""The reference backend on CUDA tensors (and the default backend there) agrees with the CPU run.

Marked `gpu`: skipped without CUDA. Run on a GPU machine with `pytest -m gpu`.
"""

import random

import pytest
import torch

from ffa_kernels import apply_sink, ffa_backward_stage, ffa_forward_stage, flex_flash_attn_func
from ffa_kernels.testing import random_problem

pytestmark = pytest.mark.gpu


def _run(p, device, dtype, sink, layout, ranges_on_cpu=False):
    q, k, v = (x.to(device=device, dtype=dtype).requires_grad_() for x in (p.q, p.k, p.v))
    s = None if sink is None else sink.to(device).requires_grad_()
    rdev = "cpu" if ranges_on_cpu else device
    out, meta = flex_flash_attn_func(
        q, k, v, p.q_ranges.to(rdev), p.k_ranges.to(rdev), p.attn_type_map.to(rdev),
        sink=s, sink_layout=layout, softcap=1.5, return_max_logits=True,
    )  # fmt: skip
    dout = torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], device=device, dtype=dtype)
    inputs = [q, k, v] + ([s] if s is not None else [])
    grads = torch.autograd.grad(out, inputs, dout, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
    return [t.detach().cpu().double() for t in (out, meta.lse, meta.max_logits, *grads)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [None, "sh", "ssh"])
def test_reference_cuda_matches_cpu(monkeypatch, dtype, layout):
    monkeypatch.setenv("FFA_BACKEND", "reference")
    rng = random.Random(7)
    for trial in range(6):
        p = random_problem(rng, max_tokens=40, head_dim=16)
        tq, hq, _ = p.q.shape
        sink = None
        if layout is not None:
            sink = torch.randn(*((2, hq) if layout == "sh" else (tq, 2, hq)), dtype=torch.float32)
        cpu = _run(p, "cpu", dtype, sink, layout or "sh")
        gpu = _run(p, "cuda", dtype, sink, layout or "sh", ranges_on_cpu=bool(trial % 2))
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for a, b in zip(gpu, cpu):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_default_backend_on_cuda_matches_cpu_reference():
    """Whatever the default picks on this GPU (CuTe on sm90 when importable), same results."""
    rng = random.Random(11)
    for _ in range(4):
        p = random_problem(rng, max_tokens=300, head_dim=64, max_slices=5)
        hq = p.q.shape[1]
        sink = torch.randn(2, hq, dtype=torch.float32)
        gpu = _run(p, "cuda", torch.bfloat16, sink, "sh")
        cpu = _run(p, "cpu", torch.bfloat16, sink, "sh")
        for a, b in zip(gpu, cpu):
            torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def test_stage_api_on_cuda():
    rng = random.Random(5)
    p = random_problem(rng, max_tokens=64, head_dim=32, dtype=torch.bfloat16)
    q, k, v = (x.cuda() for x in (p.q, p.k, p.v))
    tq, hq, d = q.shape
    out_acc = torch.zeros(tq, hq, d, device="cuda")
    lse_acc = torch.full((tq, hq), float("-inf"), device="cuda")
    half = len(p.types) // 2
    parts = [slice(0, half), slice(half, None)]
    for part in parts:
        qr, kr, tm = p.q_ranges[part].cuda(), p.k_ranges[part].cuda(), p.attn_type_map[part].cuda()
        ffa_forward_stage(q, k, v, qr, kr, tm, out_acc, lse_acc)
    apply_sink(out_acc, lse_acc, None, "sh")
    out, meta = flex_flash_attn_func(q, k, v, p.q_ranges.cuda(), p.k_ranges.cuda(), p.attn_type_map.cuda())
    torch.testing.assert_close(out_acc.to(torch.bfloat16), out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_acc, meta.lse, atol=1e-3, rtol=1e-3)
    dq, dk, dv = (torch.zeros(x.shape, device="cuda") for x in (q, k, v))
    for part in parts:
        qr, kr, tm = p.q_ranges[part].cuda(), p.k_ranges[part].cuda(), p.attn_type_map[part].cuda()
        ffa_backward_stage(torch.ones_like(q), q, k, v, out_acc, lse_acc, qr, kr, tm, dq, dk, dv)
    for g in (dq, dk, dv):
        assert bool(g.isfinite().all())


def test_large_causal_peak_memory(monkeypatch):
    """16k x 16k causal, 4 q heads on 2 kv heads, reference backend, forward + backward: the peak
    stays below 1/8 of ONE head's Tq x Tk float32 matrix (the scores of all heads would be 32x)."""
    monkeypatch.setenv("FFA_BACKEND", "reference")
    n, hq, hk, d = 16384, 4, 2, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, d, device="cuda", generator=gen).requires_grad_() for h in (hq, hk, hk))
    r = torch.tensor([[0, n]], dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, meta = flex_flash_attn_func(q, k, v, r, r, torch.tensor([1], dtype=torch.int32, device="cuda"))
    out.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < n * n * 4 // 8, f"peak {peak / 2**20:.0f} MiB"
    row, head = n - 1, 3  # q head 3 uses kv head 1
    logits = (q[row, head] @ k[:, 1].T).double() * d**-0.5
    torch.testing.assert_close(
        meta.lse[row, head].double(), torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5
    )
