"""``ffa_forward``'s ``kv_ready`` on a GPU: rows written by another stream while the kernel runs.

The late rows hold NaN when the forward is issued; a side stream sleeps, copies the real rows
in and raises the flag. A kernel that read them early would return NaN; the result must equal,
bitwise, the forward over complete rows, and the call must have lasted past the side stream's
sleep (it waited). The grids here take fewer CTAs than the GPU has SMs, so the side stream's
work always finds room even if the copy runs on SMs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ffa_kernels import BackendFallbackWarning, KVReady, ffa_forward

pytestmark = pytest.mark.gpu

_SLEEP_CYCLES = 20_000_000  # about 10 ms at the H100's clock


def _case(tq, tk, hq, hk, d, dv, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(tk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(tk, hk, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    half = tq // 2
    # local keys first in each q range's slices, then the late ones (a cp rank's [local; remote])
    qr = torch.tensor([[0, tq], [0, half], [half, tq]], dtype=torch.int32, device="cuda")
    kr = torch.tensor([[0, tk // 2], [tk // 2, tk - 100], [tk // 2, tk]], dtype=torch.int32, device="cuda")
    types = torch.tensor([1, 0, 3], dtype=torch.int32, device="cuda")
    return q, k, v, qr, kr, types


def _late_forward(q, k, v, qr, kr, types, first_row, **kw):
    """ffa_forward over copies of k, v whose rows ``first_row:`` a side stream writes (after a
    sleep) while the call runs: ``(out, lse, max_logits, ms the call's stream took)``."""
    kl, vl = k.clone(), v.clone()
    kl[first_row:], vl[first_row:] = float("nan"), float("nan")
    flag = torch.zeros(2, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(_SLEEP_CYCLES)
        kl[first_row:].copy_(k[first_row:])
        vl[first_row:].copy_(v[first_row:])
        flag[0].fill_(5)
    start.record()
    out = ffa_forward(q, kl, vl, qr, kr, types, kv_ready=KVReady(flag, 5, first_row), **kw)
    end.record()
    torch.cuda.synchronize()
    return (*out, start.elapsed_time(end))


@pytest.mark.sm90
@pytest.mark.parametrize(
    "hq,hk,d,dv,softcap",
    [(4, 2, 128, 128, 0.0), (8, 1, 128, 128, 5.0), (4, 4, 192, 128, 0.0), (4, 2, 64, 64, 0.0)],
)
@pytest.mark.parametrize("first_row", [0, 1000, 1024])  # 1000: inside a key block
def test_forward_waits_for_late_rows(hq, hk, d, dv, softcap, first_row):
    pytest.importorskip("cutlass")
    q, k, v, qr, kr, types = _case(1024, 2048, hq, hk, d, dv)
    want = ffa_forward(q, k, v, qr, kr, types, softcap=softcap, return_max_logits=True)
    *got, ms = _late_forward(q, k, v, qr, kr, types, first_row, softcap=softcap, return_max_logits=True)
    assert not torch.isnan(got[0]).any()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert ms > 3.0, f"the call took {ms:.2f} ms: it did not wait for the side stream's ~10 ms"


@pytest.mark.sm90
def test_no_late_row_never_waits():
    """``first_row == Tk``: nothing is late, so a flag that never rises stops nothing (a wait
    would end the launch at the bound)."""
    pytest.importorskip("cutlass")
    q, k, v, qr, kr, types = _case(1024, 2048, 4, 2, 128, 128)
    want = ffa_forward(q, k, v, qr, kr, types)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")  # never raised: nothing may wait on it
    got = ffa_forward(q, k, v, qr, kr, types, kv_ready=(flag, 1, 2048))
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reference_backend_waits_on_the_stream():
    """A head dim the kernels do not serve (32) runs on the reference, whose stream waits."""
    pytest.importorskip("cuda.bindings")
    q, k, v, qr, kr, types = _case(256, 512, 2, 1, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendFallbackWarning)  # said once per process
        want = ffa_forward(q, k, v, qr, kr, types)
        *got, ms = _late_forward(q, k, v, qr, kr, types, 256)
    assert not torch.isnan(got[0]).any()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ms > 3.0, f"the call took {ms:.2f} ms: it did not wait for the side stream's ~10 ms"
