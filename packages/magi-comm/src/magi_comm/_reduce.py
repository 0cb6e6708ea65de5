"""Deterministic range-scatter-reduce kernels shared by the backends (plain torch ops).

All reductions accumulate in float32 (float64 for float64 data) and apply contributions in a
fixed order: the existing output first (when ``acc_reduce``), then the sources in ascending
rank order. The order is realised by the plan's *slots* (see :class:`magi_comm._plan.ReducePlan`):
slot ``k`` holds, for every output row, its ``k``-th smallest source, and within a slot every
output row appears at most once, so ``index_add_`` never has two writers for one element.
The result is therefore bit-identical run to run and on every device.
"""

from __future__ import annotations

import torch

__all__ = ["REDUCE_OPS", "accumulate_dtype", "reduce_lse", "reduce_received", "reduce_sum_avg"]

REDUCE_OPS = ("sum", "avg", "lse")


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (no precision loss); every other float accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reduce_sum_avg(
    output: torch.Tensor,
    recv: torch.Tensor,
    slots,
    sources_per_row: torch.Tensor | None,
    *,
    average: bool,
    acc_reduce: bool,
) -> None:
    """Reduce the receive buffer into ``output`` in place.

    ``sum``: ``out = [out_old +] x_{s0} + x_{s1} + ...`` (ascending source ranks).
    ``avg``: the same sum divided by the number of terms, i.e. ``len(src_indices[j])`` plus one
    when ``acc_reduce`` (the existing output counts as a term). A row with no term at all
    (no source and ``acc_reduce=False``) becomes 0.
    """
    adt = accumulate_dtype(output.dtype)
    # A copy (not an alias) even for float32, so that a failure half-way leaves output intact.
    acc = (
        output.to(adt, copy=True)
        if acc_reduce
        else torch.zeros(output.shape, dtype=adt, device=output.device)
    )
    for out_rows, buf_rows in slots:
        acc.index_add_(0, out_rows, recv.index_select(0, buf_rows).to(adt))
    if average:
        assert sources_per_row is not None  # the plan's row counts: every avg call passes them
        count = sources_per_row + 1 if acc_reduce else sources_per_row
        # count == 0 only where nothing was added: acc is 0 there, and 0 / 1 = 0.
        count = count.clamp_min(1).to(adt).view(-1, *([1] * (output.dim() - 1)))
        acc.div_(count)
    output.copy_(acc)


def _bcast(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """(rows, heads) -> (rows, heads, 1, ...) to broadcast against (rows, heads, D, ...)."""
    return t.view(*t.shape, *([1] * (ndim - t.dim())))


def _weighted(w: torch.Tensor, x: torch.Tensor, adt: torch.dtype) -> torch.Tensor:
    # A zero weight (lse = -inf) must contribute exactly 0 even when x holds inf/NaN garbage,
    # which is what an attention kernel may leave in a row it never touched.
    wb = _bcast(w, x.dim())
    return torch.where(wb > 0, wb * x.to(adt), 0.0)


def reduce_lse(
    output: torch.Tensor,
    output_lse: torch.Tensor,
    recv: torch.Tensor,
    recv_lse: torch.Tensor,
    slots,
    *,
    acc_reduce: bool,
) -> None:
    """Merge partial attention outputs by log-sum-exp, in place into ``output``/``output_lse``.

    For a row/head with terms ``(o_k, l_k)`` (existing output first when ``acc_reduce``, then
    sources ascending): ``lse = log(sum_k exp(l_k))`` and ``out = sum_k exp(l_k - lse) * o_k``.
    Two passes (max, then weighted sums) keep it stable. Terms with ``l_k = -inf`` contribute
    nothing; a row whose terms are all ``-inf`` (or that has none) gets ``out = 0`` and
    ``lse = -inf``, never NaN.
    """
    adt = accumulate_dtype(output.dtype)
    ninf = float("-inf")
    if acc_reduce:
        old_lse = output_lse.to(adt)
        m = old_lse.clone()
    else:
        m = torch.full(output_lse.shape, ninf, dtype=adt, device=output.device)
    for out_rows, buf_rows in slots:
        cur = m.index_select(0, out_rows)
        m.index_copy_(0, out_rows, torch.maximum(cur, recv_lse.index_select(0, buf_rows).to(adt)))
    # Rows with every term at -inf: shift by 0 instead so exp() gives 0 rather than NaN.
    m = torch.where(m == ninf, 0.0, m)

    if acc_reduce:
        den = torch.exp(old_lse - m)
        num = _weighted(den, output, adt)
    else:
        den = torch.zeros_like(m)
        num = torch.zeros(output.shape, dtype=adt, device=output.device)
    for out_rows, buf_rows in slots:
        w = torch.exp(recv_lse.index_select(0, buf_rows).to(adt) - m.index_select(0, out_rows))
        den.index_add_(0, out_rows, w)
        num.index_add_(0, out_rows, _weighted(w, recv.index_select(0, buf_rows), adt))

    new_lse = m + torch.log(den)  # log(0) = -inf for rows without any finite term
    denb = _bcast(den, num.dim())
    out = torch.where(denb > 0, num / torch.where(denb > 0, denb, 1.0), 0.0)
    output.copy_(out)
    output_lse.copy_(new_lse)


def reduce_received(
    output: torch.Tensor,
    output_lse: torch.Tensor | None,
    recv: torch.Tensor,
    recv_lse: torch.Tensor | None,
    idx,
    reduce_op: str,
    acc_reduce: bool,
) -> None:
    """Reduce the receive buffer (a2av layout) into ``output`` by ``reduce_op``, in place.

    ``idx``: the plan's indices on the device (``slots``, ``sources_per_row``); ``output_lse`` /
    ``recv_lse`` only for ``"lse"``.
    """
    if reduce_op == "lse":
        assert output_lse is not None and recv_lse is not None  # "lse" carries both (checked upstream)
        reduce_lse(output, output_lse, recv, recv_lse, idx.slots, acc_reduce=acc_reduce)
    else:
        reduce_sum_avg(
            output,
            recv,
            idx.slots,
            idx.sources_per_row,
            average=reduce_op == "avg",
            acc_reduce=acc_reduce,
        )
