"""Masks of a block: the single place where slice geometry becomes row blocks and column tiles.

The reference forward and backward both walk the slices through `iter_row_blocks` and
`RowBlock.tiles`, so the mask semantics of docs/api.md live here only:

    local row i = q - qs, local column j = k - ks, sq = qe - qs, sk = ke - ks
    FULL: always   CAUSAL: j <= i + (sk - sq)   INVCAUSAL: j >= i   BICAUSAL: both

For a fixed row i the visible columns are one interval ``[lo(i), hi(i))`` and both ends are
non-decreasing in i. So a block of rows ``[a, b)`` sees exactly the columns
``[lo(a), hi(b - 1))`` (every one of them is visible from some row of the block), and
restricting each block to that interval is what keeps the work near the true area and the
memory at ``rows x cols`` per tile instead of ``Tq x Tk``.

Tile size: at most `BLOCK_ROWS` rows, and as many columns as keep the per-tile score matrix
``(Hq, rows, cols)`` under `TILE_ELEMS` elements (never fewer than `MIN_TILE_COLS`). These are
module attributes read at call time, so tests can shrink them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .._types import MaskType

__all__ = ["BLOCK_ROWS", "MIN_TILE_COLS", "TILE_ELEMS", "RowBlock", "Tile", "block_mask", "iter_row_blocks"]

BLOCK_ROWS = 512
TILE_ELEMS = 1 << 22
MIN_TILE_COLS = 64

_CAUSAL_LIKE = (MaskType.CAUSAL, MaskType.BICAUSAL)
_INV_LIKE = (MaskType.INVCAUSAL, MaskType.BICAUSAL)


def _col_lo(i: int, t: int) -> int:
    """First visible local column of local row i (ignoring the sk bound)."""
    return i if t in _INV_LIKE else 0


def _col_hi(i: int, sq: int, sk: int, t: int) -> int:
    """One past the last visible local column of local row i."""
    return min(sk, i + (sk - sq) + 1) if t in _CAUSAL_LIKE else sk


def visible_rows(sq: int, sk: int, t: int) -> tuple[int, int]:
    """Local rows ``[i_lo, i_hi)`` of a slice that see at least one column (may be empty)."""
    if sq <= 0 or sk <= 0 or (t == MaskType.BICAUSAL and sq > sk):
        return 0, 0  # BICAUSAL rows see [i, i + sk - sq], empty when sq > sk
    i_lo = max(0, sq - sk) if t in _CAUSAL_LIKE else 0  # CAUSAL: row i empty while i + sk - sq < 0
    i_hi = min(sq, sk) if t in _INV_LIKE else sq  # INVCAUSAL: row i empty once i >= sk
    return i_lo, max(i_lo, i_hi)


def block_mask(
    sq: int, sk: int, t: int, rows: tuple[int, int], cols: tuple[int, int], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Dense bool mask ``(rows[1]-rows[0], cols[1]-cols[0])`` of local rows x local cols of a slice.

    ``rows``/``cols`` are half-open local index ranges; ``block_mask(sq, sk, t, (0, sq), (0, sk))``
    is the whole slice mask.
    """
    i = torch.arange(rows[0], rows[1], device=device).view(-1, 1)
    j = torch.arange(cols[0], cols[1], device=device).view(1, -1)
    mask = (j < sk) & (i < sq) & (j >= 0) & (i >= 0)  # bounds (also gives the full 2-D shape)
    if t in _CAUSAL_LIKE:
        mask &= j <= i + (sk - sq)
    if t in _INV_LIKE:
        mask &= j >= i
    return mask


@dataclass(frozen=True)
class Tile:
    """Columns ``[k_start, k_end)`` (global) of a row block, with its mask.

    ``mask`` is a bool ``(rows, cols)`` tensor, or None when every cell of the tile is visible
    (the common case inside large slices, which then skips the masking work).
    """

    k_start: int
    k_end: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class RowBlock:
    """Rows ``[q_start, q_end)`` (global) of one slice, seeing columns ``[k_start, k_end)``."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    # slice geometry, to build tile masks
    qs: int
    ks: int
    sq: int
    sk: int
    mask_type: int

    @property
    def num_rows(self) -> int:
        return self.q_end - self.q_start

    def tiles(self, num_heads_q: int, device: torch.device | str) -> Iterator[Tile]:
        """Column tiles covering ``[k_start, k_end)``; masks are built lazily, one tile at a time.

        The columns that every row of the block sees, ``[lo(b - 1), hi(a))``, are tiled apart
        from the ragged edges on either side, so that masks are only built (and applied) on the
        edges, which are at most ``rows`` columns wide for the causal types.
        """
        rows = self.num_rows
        width = max(MIN_TILE_COLS, TILE_ELEMS // max(1, num_heads_q * rows))
        a, b = self.q_start - self.qs, self.q_end - self.qs  # local rows
        t, sq, sk = self.mask_type, self.sq, self.sk
        lo_a, hi_last = self.k_start - self.ks, self.k_end - self.ks  # local column span
        full_lo, full_hi = _col_lo(b - 1, t), _col_hi(a, sq, sk, t)
        if full_lo < full_hi:
            segments = [(lo_a, full_lo), (full_lo, full_hi), (full_hi, hi_last)]
        else:
            segments = [(lo_a, hi_last)]
        for s0, s1 in segments:
            for j0 in range(s0, s1, width):
                j1 = min(j0 + width, s1)
                # Every row of the block sees the whole tile iff the latest lo and the earliest
                # hi enclose it (lo and hi are monotone in the row).
                full = full_lo <= j0 and full_hi >= j1
                mask = None if full else block_mask(sq, sk, t, (a, b), (j0, j1), device)
                yield Tile(self.ks + j0, self.ks + j1, mask)


def iter_row_blocks(slices: list[tuple[int, int, int, int, int]]) -> Iterator[RowBlock]:
    """Yield the non-empty row blocks of every slice, slice by slice.

    Rows of a slice that see no column (CAUSAL with sq > sk, INVCAUSAL rows past sk, ...)
    are skipped entirely, and so are empty slices.
    """
    block_rows = BLOCK_ROWS
    for qs, qe, ks, ke, t in slices:
        sq, sk = qe - qs, ke - ks
        i_lo, i_hi = visible_rows(sq, sk, t)
        for a in range(i_lo, i_hi, block_rows):
            b = min(a + block_rows, i_hi)
            yield RowBlock(
                q_start=qs + a,
                q_end=qs + b,
                k_start=ks + _col_lo(a, t),
                k_end=ks + _col_hi(b - 1, sq, sk, t),
                qs=qs,
                ks=ks,
                sq=sq,
                sk=sk,
                mask_type=t,
            )
