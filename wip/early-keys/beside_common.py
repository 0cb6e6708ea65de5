"""wip/early-keys: the one-call backward the two "beside" scripts time (a cp-2-like shape on
one GPU: 32k q rows, 64k keys, 16 documents each over its local keys causal and 2048 remote
keys, bf16, Hq 32, Hk 8, D 128; float32 accumulators as magi-dist's)."""

import torch

from ffa_kernels import ffa_backward_stage, ffa_forward

TQ, TK, HQ, HK, D, DOC = 32768, 65536, 32, 8, 128, 2048


def one_call_backward(dev: torch.device, seed: int = 0):
    """A function that enqueues the backward once on ``dev``'s current stream."""
    torch.manual_seed(seed)
    qr, kr, ty = [], [], []
    for i in range(TQ // DOC):
        qr += [[i * DOC, (i + 1) * DOC]] * 2
        kr += [[i * DOC, (i + 1) * DOC], [TQ + i * DOC, TQ + (i + 1) * DOC]]
        ty += [1, 0]
    qr, kr, ty = (torch.tensor(x, dtype=torch.int32, device=dev) for x in (qr, kr, ty))
    bf = torch.bfloat16
    q = torch.randn(TQ, HQ, D, device=dev, dtype=bf)
    k = torch.randn(TK, HK, D, device=dev, dtype=bf)
    v = torch.randn(TK, HK, D, device=dev, dtype=bf)
    dout = torch.randn(TQ, HQ, D, device=dev, dtype=bf)
    out, lse, _ = ffa_forward(q, k, v, qr, kr, ty)
    acc = [torch.zeros(t.shape, device=dev) for t in (q, k, v)]
    return lambda: ffa_backward_stage(dout, q, k, v, out, lse, qr, kr, ty, *acc)
