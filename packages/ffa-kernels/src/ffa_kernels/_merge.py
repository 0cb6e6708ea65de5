"""Log-sum-exp merge of partial attention results.

Two partial results over disjoint key sets, ``(o1, l1)`` and ``(o2, l2)`` (each ``o`` already
normalised by its own softmax denominator, each ``l`` its natural-log log-sum-exp), combine
exactly into

    l = logaddexp(l1, l2),   o = exp(l1 - l) * o1 + exp(l2 - l) * o2.

A side with ``l = -inf`` saw no key: it must contribute nothing, whatever its ``o`` holds (so a
caller may use uninitialised memory there), and ``-inf`` on both sides must stay ``-inf`` with
``o = 0`` instead of the NaN that ``exp(-inf - -inf)`` would give.
"""

from __future__ import annotations

import torch

__all__ = ["merge_finite_lse_", "merge_lse_"]

_NEG_INF = float("-inf")


def merge_lse_(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_part: torch.Tensor, lse_part: torch.Tensor
) -> None:
    """Merge ``(out_part, lse_part)`` into ``(out_acc, lse_acc)`` in place by log-sum-exp.

    Args:
        out_acc: float ``(..., D)`` accumulator, updated in place (may be a strided view).
        lse_acc: float ``(...)`` accumulator (``out_acc.shape[:-1]``), updated in place.
        out_part: ``(..., D)`` partial output, any float dtype (cast to ``out_acc.dtype``).
        lse_part: ``(...)`` partial log-sum-exp.

    Rows whose lse is ``-inf`` on one side take the other side unchanged; rows ``-inf`` on both
    sides get ``out = 0``, ``lse = -inf``. NaN in an lse propagates (it signals a real bug).
    """
    if out_acc.shape != out_part.shape or lse_acc.shape != lse_part.shape:
        raise ValueError(
            f"merge_lse_: shape mismatch, out_acc {tuple(out_acc.shape)} vs out_part {tuple(out_part.shape)}, "
            f"lse_acc {tuple(lse_acc.shape)} vs lse_part {tuple(lse_part.shape)}"
        )
    if out_acc.shape[:-1] != lse_acc.shape:
        raise ValueError(
            f"merge_lse_: lse shape {tuple(lse_acc.shape)} must equal out shape[:-1] {tuple(out_acc.shape[:-1])}"
        )
    lse_part = lse_part.to(lse_acc.dtype)
    out_part = out_part.to(out_acc.dtype)
    lse_new = torch.logaddexp(lse_acc, lse_part)
    # Subtract a finite reference so that the weights are exp(-inf - finite) = 0, never NaN.
    ref = lse_new.masked_fill(lse_new == _NEG_INF, 0.0)
    w_acc = torch.exp(lse_acc - ref).to(out_acc.dtype).unsqueeze(-1)
    w_part = torch.exp(lse_part - ref).to(out_acc.dtype).unsqueeze(-1)
    # where() rather than a product so that garbage (even NaN) behind an lse of -inf is ignored.
    empty_acc = (lse_acc == _NEG_INF).unsqueeze(-1)
    empty_part = (lse_part == _NEG_INF).unsqueeze(-1)
    merged = torch.where(empty_acc, 0.0, w_acc * out_acc) + torch.where(empty_part, 0.0, w_part * out_part)
    out_acc.copy_(merged)
    lse_acc.copy_(lse_new)


def merge_finite_lse_(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_part: torch.Tensor, lse_part: torch.Tensor
) -> None:
    """`merge_lse_` for partials whose ``out`` is finite everywhere (0 where ``lse = -inf``), as
    the kernels and fresh accumulators guarantee: a weight of 0 then removes a side exactly, so the
    NaN guards go and the update is two in-place passes over ``out_acc`` (this runs once per
    stage on the GPU hot path)."""
    lse_new = torch.logaddexp(lse_acc, lse_part.to(lse_acc.dtype))
    ref = lse_new.masked_fill(lse_new == _NEG_INF, 0.0)
    w_acc = torch.exp(lse_acc - ref).to(out_acc.dtype).unsqueeze(-1)
    w_part = torch.exp(lse_part.to(lse_acc.dtype) - ref).to(out_acc.dtype).unsqueeze(-1)
    out_acc.mul_(w_acc).addcmul_(out_part.to(out_acc.dtype), w_part)
    lse_acc.copy_(lse_new)
