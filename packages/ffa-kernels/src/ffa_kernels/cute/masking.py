"""Band masking of one score block (device side).

A plan entry covers (q, k) iff qs <= q < qe, ks <= k < ke and lo <= k - q <= hi (see tile_plan.py).
For a block whose first key is kb in a tile whose first row is m0, each thread row r
(tile-relative) keeps the columns c (block-relative) with c_lo(r) <= c < c_hi(r):

    c_lo(r) = max(ks - kb, r + lo - (kb - m0)),  c_hi(r) = min(ke - kb, r + hi - (kb - m0) + 1)

and rows outside [qs - m0, qe - m0) keep nothing. Column coordinates are split into a
compile-time part (thread 0's coordinates) and a per-thread offset, so every per-element
test is a comparison against a constant.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .mma import acc_rows_cols


def block_is_full(kb, m0, tile_m: int, tile_n: int, ks, ke, lo, hi, qs, qe):
    """True when every cell of the (tile_m x tile_n) block is covered (no masking needed)."""
    d = kb - m0
    return (
        (ks <= kb)
        & (kb + tile_n <= ke)
        & (qs <= m0)
        & (m0 + tile_m <= qe)
        & (d - (tile_m - 1) >= lo)
        & (d + (tile_n - 1) <= hi)
    )


def score_coords(thr_mma_qk, tile_m: int, tile_n: int):
    """(this thread's coordinates, thread 0's coordinates) of the score tile, as (rows, cols) views."""
    ident = cute.make_identity_tensor((tile_m, tile_n))
    tScS = acc_rows_cols(thr_mma_qk.partition_C(ident))
    return tScS


@cute.jit
def apply_band_mask(
    acc_S: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor, kb, m0, ks, ke, lo, hi, qs, qe
):
    s = acc_rows_cols(acc_S)
    d = kb - m0
    col_off = tScS[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = tScS[r, 0][0]
        c_lo = cutlass.max(ks - kb, row + lo - d) - col_off
        c_hi = cutlass.min(ke - kb, row + hi - d + 1) - col_off
        row_ok = (row + m0 >= qs) & (row + m0 < qe)
        c_hi = c_hi if row_ok else Int32(-(1 << 20))
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = t0ScS[0, c][1]
            keep = (col >= c_lo) & (col < c_hi)
            s[r, c] = s[r, c] if keep else -Float32.inf
