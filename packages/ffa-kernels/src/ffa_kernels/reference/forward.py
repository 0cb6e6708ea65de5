"""Reference (pure torch) forward: one stage of partial attention merged into accumulators.

Work is done tile by tile (see `_masks`): for a row block of one slice and a column tile it
sees, `forward_tile` returns the tile's normalised output and log-sum-exp; tiles of a row block
merge locally, then the block merges into the caller's accumulators. Slices that share query
rows therefore combine by the same log-sum-exp merge as separate stages do, which is what makes
stages over disjoint key sets add up exactly.

Inside a tile the heads are laid out "kv-head major": q rows become ``(Hk, G * rows, D)`` with
``G = Hq // Hk``, so one batched matmul against ``(Hk, cols, D)`` serves every q head of a kv
group without repeating k or v (GQA: q head h uses kv head ``h // G``).

A NaN or inf in K or V never reaches a row that does not see its key. Scores of hidden cells are
replaced (``masked_fill``), not added to, so a non-finite key is harmless there; but the hidden
cells of ``P @ V`` still multiply ``0 * NaN``. So each stage checks once whether K and V are
finite: if they are (the normal case) nothing changes; if not, the products of masked tiles go
through `masked_bmm`, which counts every hidden cell's product as exactly 0.
"""

from __future__ import annotations

import torch

from .._merge import merge_lse_
from .._validate import ValidatedAttnArgs
from . import masks as _masks

__all__ = ["all_finite", "block_queries", "forward_tile", "masked_bmm", "reference_forward_stage", "tile_kv"]

_NEG_INF = float("-inf")


def to_kv_major(x: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``(rows, Hq, D)`` -> ``(Hk, G * rows, D)`` in ``dtype``, index ``[hk, g * rows + r]``."""
    rows, hq, d = x.shape
    g = hq // num_kv_heads
    x = x.to(dtype).reshape(rows, num_kv_heads, g, d)  # reshape, not view: x may be any strided view
    return x.permute(1, 2, 0, 3).reshape(num_kv_heads, g * rows, d)


def from_kv_major(y: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of `to_kv_major`: ``(Hk, G * rows, ...)`` -> ``(rows, Hq, ...)``."""
    hk, gr = y.shape[0], y.shape[1]
    g = gr // rows
    rest = y.shape[2:]
    y = y.reshape(hk, g, rows, *rest).movedim(2, 0)
    return y.reshape(rows, hk * g, *rest)


def block_queries(
    q: torch.Tensor, blk: _masks.RowBlock, num_kv_heads: int, dtype: torch.dtype, scale: float
) -> torch.Tensor:
    """The row block's queries, kv-major ``(Hk, G * R, D)``, multiplied by ``scale``.

    Out of place on purpose: for ``Hk = G = 1`` the kv-major view may alias ``q`` itself.
    """
    return to_kv_major(q[blk.q_start : blk.q_end], num_kv_heads, dtype).mul(scale)


def tile_kv(
    k: torch.Tensor, v: torch.Tensor, tile: _masks.Tile, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of a tile's columns as ``(Hk, C, D)`` in ``dtype``."""
    kh = k[tile.k_start : tile.k_end].to(dtype).transpose(0, 1)
    vh = v[tile.k_start : tile.k_end].to(dtype).transpose(0, 1)
    return kh, vh


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of every tensor is finite (one host sync per call)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def masked_bmm(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, group: int) -> torch.Tensor:
    """``torch.bmm(a, b)`` where the products of hidden cells count as exactly 0.

    ``a`` is ``(Hk, G * R, C)`` with ``a[h, g * R + i, j] == 0`` wherever ``mask[i, j]`` is False,
    ``b`` is ``(Hk, C, D)``, ``mask`` bool ``(R, C)``. A plain bmm turns ``0 * NaN`` (or
    ``0 * inf``) of a hidden cell into NaN; here a non-finite ``b[h, j, d]`` reaches row ``i`` only
    when row ``i`` sees column ``j``, and then exactly as in the plain product. Finite entries go
    through one bmm (with the non-finite ones zeroed); the non-finite entries, few in practice,
    are added back for the cells that see them.
    """
    bad = ~torch.isfinite(b)
    out = torch.bmm(a, b.masked_fill(bad, 0.0))
    cols = bad.any(dim=2).any(dim=0).nonzero().squeeze(1)  # columns with a non-finite entry
    if cols.numel():
        hk, gr, _ = a.shape
        rows, n, d = gr // group, cols.numel(), b.shape[2]
        a_bad = a[:, :, cols].reshape(hk, group, rows, n, 1)
        b_bad = b[:, cols, :].masked_fill(~bad[:, cols, :], 0.0).reshape(hk, 1, 1, n, d)
        seen = mask[:, cols].reshape(1, 1, rows, n, 1)
        out += torch.where(seen, a_bad * b_bad, 0.0).sum(dim=3).reshape(hk, gr, d)
    return out


def forward_tile(
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    mask: torch.Tensor | None,
    group: int,
    softcap: float,
    want_max: bool,
    kv_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention of one tile.

    Args:
        qh: ``(Hk, G * R, D)`` queries already multiplied by softmax_scale (kv-major, see module
            docstring), compute dtype. Pre-scaling the R x D queries saves a pass over R x C.
        kh, vh: ``(Hk, C, D)`` keys / values of the tile's columns.
        mask: bool ``(R, C)`` visible cells, or None when all are visible.
        group: ``G = Hq // Hk``, the q heads per kv head.
        softcap: logits are ``softcap * tanh(qh.k / softcap)`` if softcap > 0.
        want_max: also return the max of ``qh.k`` (= ``scale * q.k``) over visible cells.
        kv_finite: False when K or V may hold NaN/inf: ``P @ V`` then goes through `masked_bmm`
            so that a non-finite value reaches only the rows that see its key.

    Returns:
        out ``(Hk, G * R, D)`` normalised by the tile's own denominator (0 for rows with no
        visible cell), lse ``(Hk, G * R)`` (``-inf`` for such rows), and max ``(Hq,)`` or None.
    """
    hk, gr, _ = qh.shape
    cols = kh.shape[1]
    rows = gr // group
    s = torch.bmm(qh, kh.transpose(1, 2))  # (Hk, G*R, C), already scaled
    hidden = None if mask is None else ~mask
    if hidden is not None:
        s.view(hk, group, rows, cols).masked_fill_(hidden, _NEG_INF)
    max_part = None
    if want_max:
        # max_logits is defined before softcap, so take it from the raw (masked) scores.
        max_part = s.view(hk, group, rows * cols).amax(dim=-1).view(-1)
    if softcap > 0.0:
        s.div_(softcap).tanh_().mul_(softcap)
        if hidden is not None:
            # tanh maps the -inf of hidden cells to -1: hide them again.
            s.view(hk, group, rows, cols).masked_fill_(hidden, _NEG_INF)
    m = s.amax(dim=-1, keepdim=True)  # (Hk, G*R, 1); -inf for rows with nothing visible
    m = m.masked_fill(m == _NEG_INF, 0.0)
    p = s.sub_(m).exp_()
    denom = p.sum(dim=-1)  # (Hk, G*R)
    out = torch.bmm(p, vh) if kv_finite or mask is None else masked_bmm(p, vh, mask, group)
    out.div_(denom.masked_fill(denom == 0, 1.0).unsqueeze(-1))
    lse = torch.log(denom).add_(m.squeeze(-1))  # log(0) = -inf for empty rows
    return out, lse, max_part


def reference_forward_stage(
    args: ValidatedAttnArgs,
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    max_logits_acc: torch.Tensor | None,
) -> None:
    """Merge the attention of every slice in ``args`` into the accumulators, in place.

    ``out_acc`` ``(Tq, Hq, D)`` and ``lse_acc`` ``(Tq, Hq)`` are float32/float64; rows no slice
    touches are left as they are. ``max_logits_acc`` ``(Hq,)`` is max-updated when given.
    """
    q, k, v = args.q, args.k, args.v
    dtype = args.compute_dtype
    hq, hk = q.shape[1], k.shape[1]
    kv_finite = all_finite(k, v)
    for blk in _masks.iter_row_blocks(args.slices):
        rows = blk.num_rows
        qh = block_queries(q, blk, hk, dtype, args.softmax_scale)
        blk_acc: tuple[torch.Tensor, torch.Tensor] | None = None  # the block's (out, lse) so far
        for tile in blk.tiles(hq, q.device):
            kh, vh = tile_kv(k, v, tile, dtype)
            out_t, lse_t, max_t = forward_tile(
                qh, kh, vh, tile.mask, hq // hk, args.softcap, max_logits_acc is not None, kv_finite
            )
            if max_logits_acc is not None:
                assert max_t is not None  # forward_tile was asked for it (want_max)
                torch.maximum(max_logits_acc, max_t.to(max_logits_acc.dtype), out=max_logits_acc)
            if blk_acc is None:
                blk_acc = (out_t, lse_t)
            else:
                merge_lse_(blk_acc[0], blk_acc[1], out_t, lse_t)
        if blk_acc is None:  # cannot happen for a non-empty block, but stay safe
            continue
        out_blk, lse_blk = blk_acc
        merge_lse_(
            out_acc[blk.q_start : blk.q_end],
            lse_acc[blk.q_start : blk.q_end],
            from_kv_major(out_blk, rows),
            from_kv_major(lse_blk, rows),
        )
