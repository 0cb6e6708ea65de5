"""Band masking of one score block (device side).

A plan entry covers (q, k) iff qs <= q < qe, ks <= k < ke and lo <= k - q <= hi (see tile_plan.py).
For a block whose first key is kb in a tile whose first row is m0, each thread row r
(tile-relative) keeps the columns c (block-relative) with c_lo(r) <= c < c_hi(r):

    c_lo(r) = max(ks - kb, r + lo - (kb - m0)),  c_hi(r) = min(ke - kb, r + hi - (kb - m0) + 1)

and rows outside [qs - m0, qe - m0) keep nothing. Column coordinates are split into a
compile-time part (thread 0's coordinates) and a per-thread offset.

With ``bit_runs`` (the forward at 128 keys per block): a thread's columns in the wgmma accumulator
come in pairs every 8 (thread 0's: 0, 1, 8, 9, 16, ...), so the kept columns of a row are a
contiguous run of its elements: per row the two bounds become element indices and one 32-bit word
with the run's bits set, and each element tests its own (constant) bit. ptxas turns those tests
into R2P (a register's bits to predicates, several at once) and one select per element, instead of
two compares and two selects per element.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

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


def _elements_below(x, num_cols: int):
    """How many of a thread's accumulator columns (thread-0 coordinates 0, 1, 8, 9, ... below
    ``num_cols``) lie below coordinate ``x`` (any Int32)."""
    x = cutlass.min(cutlass.max(x, 0), num_cols)
    return x // 8 * 2 + cutlass.min(x % 8, 2)


@dsl_user_op
def _bit_run(first: Int32, end: Int32, *, loc=None, ip=None) -> Uint32:
    """Bits ``[first, end)`` of a 32-bit word set (none when end <= first); first, end in
    [0, 32]. PTX shifts by 32 give 0 (shifts are clamped to the width), where LLVM's would be
    undefined, hence the inline PTX."""
    return Uint32(
        llvm.inline_asm(
            Uint32.mlir_type,
            [Int32(first).ir_value(loc=loc, ip=ip), Int32(end).ir_value(loc=loc, ip=ip)],
            "{ .reg .b32 t, u; shl.b32 t, -1, $1; sub.s32 u, 32, $2; shr.b32 u, -1, u; and.b32 $0, t, u; }",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def apply_band_mask(
    acc_S: cute.Tensor,
    tScS: cute.Tensor,
    t0ScS: cute.Tensor,
    kb,
    m0,
    ks,
    ke,
    lo,
    hi,
    qs,
    qe,
    bit_runs: cutlass.Constexpr = False,
    rows_per_token: cutlass.Constexpr = 1,
):
    """Mask one score block in registers (``acc_S``, wgmma accumulator layout) to the entry's
    band, -inf outside. ``bit_runs``: per row one 32-bit word of kept elements (rows of at most
    32 elements); else a comparison per element. The forward at 128 keys per block takes bit
    runs (causal D 64 8k: +4 to +7% in two alternating pairs on an H100, other masks within the
    runs' noise; docs/perf.md); the backward measured no gain from them and keeps the
    comparisons (4 bytes of spill with bit runs at D 128). ``rows_per_token``: packed GQA
    tiles (G rows per token, heads inner): a row's token is row // G; ``m0`` is a token."""
    s = acc_rows_cols(acc_S)
    ncol = cute.size(s, mode=[1])
    assert not bit_runs or ncol <= 32, f"bit_runs: a row of {ncol} elements does not fit one 32-bit word"
    num_cols = ncol // 2 * 8  # the tile's columns
    d = kb - m0
    col_off = tScS[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = tScS[r, 0][0]
        if cutlass.const_expr(rows_per_token > 1):
            row = row // rows_per_token
        c_lo = cutlass.max(ks - kb, row + lo - d) - col_off
        c_hi = cutlass.min(ke - kb, row + hi - d + 1) - col_off
        row_ok = (row + m0 >= qs) & (row + m0 < qe)
        if cutlass.const_expr(bit_runs):
            # one 32-bit word per row; the pairs-every-8 column layout is the wgmma
            # accumulator's (t0ScS[0, c] = c // 2 * 8 + c % 2: every masked-block GPU test
            # depends on it)
            first = _elements_below(c_lo, num_cols)
            end = _elements_below(c_hi, num_cols)
            end = end if row_ok else Int32(0)
            keep = _bit_run(first, end)
            for c in cutlass.range_constexpr(ncol):
                s[r, c] = s[r, c] if Boolean(keep & Uint32(1 << c)) else -Float32.inf
        else:
            # a comparison per element against thread 0's (compile-time) column coordinates
            c_hi = c_hi if row_ok else Int32(-(1 << 20))
            for c in cutlass.range_constexpr(ncol):
                col = t0ScS[0, c][1]
                keep = (col >= c_lo) & (col < c_hi)
                s[r, c] = s[r, c] if keep else -Float32.inf
