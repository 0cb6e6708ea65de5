"""Reference (pure torch) backward: one stage's contribution to dq, dk, dv.

With the FINAL (global) ``out`` and ``lse`` of every query row, the softmax probability of a
cell is ``P = exp(s - lse)`` no matter which stage or slice the cell belongs to, and with
``delta = rowsum(dout * out)``

    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - delta),
    dS_raw = dS * (1 - tanh^2)   (softcap chain rule: s = c * tanh(r / c), ds/dr = 1 - tanh^2),
    dQ += scale * dS_raw K,   dK += scale * dS_raw^T Q = dS_raw^T (scale * Q).

The queries are pre-multiplied by the scale once per row block (R x D work) instead of
scaling every R x C score tile; dQ gets its scale once per row block too.

Every term is a sum over cells, so the contributions of disjoint slices / stages simply add,
and the walk over row blocks and column tiles (shared with the forward through `_masks`)
can accumulate straight into the caller's buffers. A sink is not handled here: its only
effect on dq/dk/dv is already inside the final lse and out.

As in the forward, a NaN or inf in K or V does not reach the dq of a row that does not see its
key, nor the dk/dv of a key that only such rows see: when K or V is not all finite, P and dS of
hidden cells are set to exactly 0 (a row that sees a NaN key has lse NaN, so ``exp(-inf - lse)``
is NaN on its hidden cells; ``dO V^T`` holds the NaN of a hidden key, and 0 times NaN is NaN) and
``dS K`` goes through `masked_bmm`. A NaN in q or dout of a row is not covered: in the backward
it reaches the dk/dv of the keys in that row's tiles, as in the kernels.
"""

from __future__ import annotations

import torch

from .._validate import ValidatedAttnArgs
from . import masks as _masks
from .forward import all_finite, block_queries, from_kv_major, masked_bmm, tile_kv, to_kv_major

__all__ = ["backward_tile", "reference_backward_stage"]

_NEG_INF = float("-inf")


def backward_tile(
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    doh: torch.Tensor,
    lse_h: torch.Tensor,
    delta_h: torch.Tensor,
    mask: torch.Tensor | None,
    group: int,
    softcap: float,
    kv_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient contributions of one tile.

    Args:
        qh: ``(Hk, G * R, D)`` queries multiplied by softmax_scale (kv-major), compute dtype.
        doh: ``(Hk, G * R, D)`` output gradients (kv-major), compute dtype.
        kh, vh: ``(Hk, C, D)`` keys / values of the tile's columns.
        lse_h: ``(Hk, G * R, 1)`` final lse of the rows, with ``-inf`` replaced by ``+inf`` (so
            that a row nothing covers gets P = 0 instead of NaN).
        delta_h: ``(Hk, G * R, 1)`` ``rowsum(dout * out)``.
        mask: bool ``(R, C)`` visible cells, or None when all are visible.
        group: ``G = Hq // Hk``.
        kv_finite: False when K or V may hold NaN/inf: P and dS are then zeroed on hidden cells
            and ``dS K`` goes through `masked_bmm`, so a non-finite value reaches only the rows
            that see it (and the keys those rows see).

    Returns:
        dq / softmax_scale ``(Hk, G * R, D)`` (the caller applies the scale once per row block),
        dk ``(Hk, C, D)``, dv ``(Hk, C, D)`` (dk, dv summed over the G q heads of each kv head).
    """
    hk, gr, _ = qh.shape
    cols = kh.shape[1]
    rows = gr // group
    s = torch.bmm(qh, kh.transpose(1, 2))  # (Hk, G*R, C), already scaled
    tanh = None
    if softcap > 0.0:
        tanh = s.div_(softcap).tanh_()  # s now holds tanh(r / c); keep it for the chain rule
        s = tanh * softcap
    if mask is not None:
        # Hide before exp: a hidden cell may have a logit far above lse and overflow to inf.
        s.view(hk, group, rows, cols).masked_fill_(~mask, _NEG_INF)
    p = s.sub_(lse_h).exp_()
    # Where K/V may be non-finite, the hidden cells are zeroed (None: nothing to zero): a row that
    # sees a NaN key has lse NaN, and exp(-inf - NaN) is NaN on its hidden cells.
    zero_hidden = mask if not kv_finite else None
    if zero_hidden is not None:
        p.view(hk, group, rows, cols).masked_fill_(~zero_hidden, 0.0)
    dv = torch.bmm(p.transpose(1, 2), doh)
    ds = torch.bmm(doh, vh.transpose(1, 2)).sub_(delta_h).mul_(p)
    if tanh is not None:
        ds.mul_(tanh.mul_(tanh).neg_().add_(1.0))
    if zero_hidden is not None:
        ds.view(hk, group, rows, cols).masked_fill_(~zero_hidden, 0.0)
        dq = masked_bmm(ds, kh, zero_hidden, group)
    else:
        dq = torch.bmm(ds, kh)
    dk = torch.bmm(ds.transpose(1, 2), qh)
    return dq, dk, dv


def reference_backward_stage(
    args: ValidatedAttnArgs,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq_acc: torch.Tensor,
    dk_acc: torch.Tensor,
    dv_acc: torch.Tensor,
) -> None:
    """Add the gradient contributions of every slice in ``args`` to the accumulators, in place.

    ``dout``, ``out``: ``(Tq, Hq, Dv)``; ``lse``: ``(Tq, Hq)`` final (global, sink included);
    ``dq_acc`` ``(Tq, Hq, D)``, ``dk_acc``/``dv_acc`` ``(Tk, Hk, D)`` float32/float64.
    """
    q, k, v = args.q, args.k, args.v
    dtype = args.compute_dtype
    hq, hk = q.shape[1], k.shape[1]
    group = hq // hk
    kv_finite = all_finite(k, v)
    for blk in _masks.iter_row_blocks(args.slices):
        r0, r1 = blk.q_start, blk.q_end
        rows = r1 - r0
        qh = block_queries(q, blk, hk, dtype, args.softmax_scale)
        doh = to_kv_major(dout[r0:r1], hk, dtype)
        delta = (dout[r0:r1].to(dtype) * out[r0:r1].to(dtype)).sum(dim=-1, keepdim=True)  # (R, Hq, 1)
        delta_h = to_kv_major(delta, hk, dtype)
        lse_blk = lse[r0:r1].to(dtype)
        lse_blk = lse_blk.masked_fill(lse_blk == _NEG_INF, float("inf")).unsqueeze(-1)
        lse_h = to_kv_major(lse_blk, hk, dtype)
        dq_blk = torch.zeros_like(qh)
        for tile in blk.tiles(hq, q.device):
            c0, c1 = tile.k_start, tile.k_end
            kh, vh = tile_kv(k, v, tile, dtype)
            dq_t, dk_t, dv_t = backward_tile(
                qh, kh, vh, doh, lse_h, delta_h, tile.mask, group, args.softcap, kv_finite
            )
            dq_blk += dq_t
            dk_acc[c0:c1] += dk_t.transpose(0, 1).to(dk_acc.dtype)
            dv_acc[c0:c1] += dv_t.transpose(0, 1).to(dv_acc.dtype)
        dq_blk.mul_(args.softmax_scale)
        dq_acc[r0:r1] += from_kv_major(dq_blk, rows).to(dq_acc.dtype)
