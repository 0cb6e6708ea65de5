"""Exact integer geometry of mask pieces.

Every slice type of docs/api.md is a *band*: the cells ``(q, k)`` with ``q0 <= q < q1``, ``k0 <= k < k1``
and, optionally, ``k - q >= lo`` and/or ``k - q <= hi``. Bands are closed under restriction to a
row range or a column range, have a closed-form area, touch a contiguous column interval, and
decompose back into at most three API slices. The planner works on bands so that cutting a mask
by chunks, owners and stages never needs a dense matrix.
"""

from __future__ import annotations

from typing import NamedTuple

# Mask type codes of docs/api.md (kept here as plain ints so this module has no dependencies).
FULL, CAUSAL, INVCAUSAL, BICAUSAL = 0, 1, 2, 3

_NO_LO = None
_NO_HI = None


class Band(NamedTuple):
    """Cells with ``q0<=q<q1``, ``k0<=k<k1``, ``k-q >= lo`` (if lo is not None), ``k-q <= hi`` (if hi is not None)."""

    q0: int
    q1: int
    k0: int
    k1: int
    lo: int | None
    hi: int | None

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def from_slice(qs: int, qe: int, ks: int, ke: int, mask_type: int) -> Band:
        """The band of one API slice (global coordinates, type code 0..3)."""
        lo = ks - qs if mask_type in (INVCAUSAL, BICAUSAL) else None
        hi = ke - qe if mask_type in (CAUSAL, BICAUSAL) else None
        return Band(qs, qe, ks, ke, lo, hi)

    # -- row-wise bounds ----------------------------------------------------------------------
    def nonempty_rows(self) -> tuple[int, int]:
        """The rows ``[a, b)`` that hold at least one cell (``a >= b`` when the band is empty)."""
        if self.k1 <= self.k0 or self.q1 <= self.q0:
            return (self.q0, self.q0)
        if self.lo is not None and self.hi is not None and self.hi < self.lo:
            return (self.q0, self.q0)
        a, b = self.q0, self.q1
        if self.hi is not None:  # need q + hi >= k0
            a = max(a, self.k0 - self.hi)
        if self.lo is not None:  # need q + lo <= k1 - 1
            b = min(b, self.k1 - self.lo)
        return (a, b) if a < b else (self.q0, self.q0)

    def is_empty(self) -> bool:
        a, b = self.nonempty_rows()
        return a >= b

    def row_span(self, q: int) -> tuple[int, int]:
        """Half-open column span ``[k_lo, k_hi)`` of row ``q`` (may be empty)."""
        lo = self.k0 if self.lo is None else max(self.k0, q + self.lo)
        hi = self.k1 if self.hi is None else min(self.k1, q + self.hi + 1)
        return (lo, hi)

    def touched_cols(self) -> tuple[int, int]:
        """Half-open column interval read by the band; consecutive rows' spans overlap, so it is contiguous."""
        a, b = self.nonempty_rows()
        if a >= b:
            return (self.k0, self.k0)
        return (self.row_span(a)[0], self.row_span(b - 1)[1])

    # -- restriction --------------------------------------------------------------------------
    def clip_rows(self, a: int, b: int) -> Band:
        return Band(max(self.q0, a), min(self.q1, b), self.k0, self.k1, self.lo, self.hi)

    def clip_cols(self, c: int, d: int) -> Band:
        return Band(self.q0, self.q1, max(self.k0, c), min(self.k1, d), self.lo, self.hi)

    def shifted(self, dq: int, dk: int) -> Band:
        """The same cells with every ``q`` moved by ``dq`` and every ``k`` by ``dk``."""
        lo = None if self.lo is None else self.lo + dk - dq
        hi = None if self.hi is None else self.hi + dk - dq
        return Band(self.q0 + dq, self.q1 + dq, self.k0 + dk, self.k1 + dk, lo, hi)

    def intersect(self, other: Band) -> Band:
        lo = _max_opt(self.lo, other.lo)
        hi = _min_opt(self.hi, other.hi)
        return Band(
            max(self.q0, other.q0),
            min(self.q1, other.q1),
            max(self.k0, other.k0),
            min(self.k1, other.k1),
            lo,
            hi,
        )

    # -- measures -----------------------------------------------------------------------------
    def area(self) -> int:
        """Number of covered cells, in closed form (no loop over rows)."""
        a, b = self.nonempty_rows()
        if a >= b:
            return 0
        total = 0
        for r0, r1, kind in self._pieces(a, b):
            n = r1 - r0
            if kind == FULL:
                total += n * (self.k1 - self.k0)
            elif kind == CAUSAL:  # row q spans [k0, q+hi]: width q + hi - k0 + 1, rising by one a row
                assert self.hi is not None  # _pieces labels a piece CAUSAL only on the hi diagonal
                first = r0 + self.hi - self.k0 + 1
                total += n * first + n * (n - 1) // 2
            elif kind == INVCAUSAL:  # row q spans [q+lo, k1): width k1 - q - lo, falling by one a row
                assert self.lo is not None  # ... and INVCAUSAL only on the lo diagonal
                first = self.k1 - r0 - self.lo
                total += n * first - n * (n - 1) // 2
            else:
                assert self.lo is not None and self.hi is not None  # BICAUSAL: both diagonals
                total += n * (self.hi - self.lo + 1)
        return total

    def to_slices(self) -> list[tuple[int, int, int, int, int]]:
        """Exact decomposition into at most three API slices ``(qs, qe, ks, ke, type)``, row-disjoint."""
        return self.slices_and_area()[0]

    def slices_and_area(self) -> tuple[list[tuple[int, int, int, int, int]], int]:
        """``(to_slices(), area())`` in one pass (the area terms as in `area`)."""
        a, b = self.nonempty_rows()
        if a >= b:
            return [], 0
        out: list[tuple[int, int, int, int, int]] = []
        total = 0
        for r0, r1, kind in self._pieces(a, b):
            n = r1 - r0
            if kind == FULL:
                out.append((r0, r1, self.k0, self.k1, FULL))
                total += n * (self.k1 - self.k0)
            elif kind == CAUSAL:  # bottom-right aligned: k <= q + (ke - qe) with ke = r1 + hi
                # row q spans [k0, q+hi]: width q + hi - k0 + 1, rising by one a row
                assert self.hi is not None
                out.append((r0, r1, self.k0, r1 + self.hi, CAUSAL))
                total += n * (r0 + self.hi - self.k0 + 1) + n * (n - 1) // 2
            elif kind == INVCAUSAL:  # top-left aligned: k >= q + (ks - qs) with ks = r0 + lo
                # row q spans [q+lo, k1): width k1 - q - lo, falling by one a row
                assert self.lo is not None
                out.append((r0, r1, r0 + self.lo, self.k1, INVCAUSAL))
                total += n * (self.k1 - r0 - self.lo) - n * (n - 1) // 2
            else:
                assert self.lo is not None and self.hi is not None
                out.append((r0, r1, r0 + self.lo, r1 + self.hi, BICAUSAL))
                total += n * (self.hi - self.lo + 1)
        return out, total

    def _pieces(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """Split non-empty rows ``[a, b)`` where the left/right bound switches between the rectangle
        edge and the diagonal; each piece is labelled with the API type whose shape it has."""
        cuts = {a, b}
        if self.lo is not None:  # left bound is q + lo from q = k0 - lo on (both agree there)
            cuts.add(min(max(self.k0 - self.lo, a), b))
        if self.hi is not None:  # right bound is q + hi before q = k1 - hi, k1 - 1 after
            cuts.add(min(max(self.k1 - self.hi, a), b))
        pts = sorted(cuts)
        pieces = []
        for r0, r1 in zip(pts[:-1], pts[1:]):
            if r0 >= r1:
                continue
            left_diag = self.lo is not None and r0 + self.lo >= self.k0
            right_diag = self.hi is not None and r0 + self.hi < self.k1
            kind = (BICAUSAL if right_diag else INVCAUSAL) if left_diag else CAUSAL if right_diag else FULL
            pieces.append((r0, r1, kind))
        return pieces


def _max_opt(x: int | None, y: int | None) -> int | None:
    if x is None:
        return y
    if y is None:
        return x
    return max(x, y)


def _min_opt(x: int | None, y: int | None) -> int | None:
    if x is None:
        return y
    if y is None:
        return x
    return min(x, y)
