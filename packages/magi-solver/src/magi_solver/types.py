"""Mask vocabulary of docs/api.md: mask types, half-open ranges, slices and masks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from enum import IntEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, RootModel, model_validator

from magi_solver.band import Band

_MAX_DENSE_CELLS = 1 << 24


class AttnMaskType(IntEnum):
    """Slice type; the int value is the code of docs/api.md, ``AttnMaskType("causal")`` parses the string."""

    FULL = 0
    CAUSAL = 1
    INVCAUSAL = 2
    BICAUSAL = 3

    @property
    def label(self) -> str:
        return _LABELS[self]

    @classmethod
    def _missing_(cls, value: object) -> AttnMaskType | None:
        if isinstance(value, str):
            key = value.strip().lower()
            for member, label in _LABELS.items():
                if key in (label, member.name.lower()):
                    return member
        return None

    @classmethod
    def parse(cls, value: Any, name: str = "mask_type") -> AttnMaskType:
        """Accept a member, an int code 0..3 or a string; raise ``ValueError`` naming ``name`` otherwise."""
        if isinstance(value, bool):
            raise ValueError(f"{name}: unknown mask type {value!r}")
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise ValueError(
                f"{name}: unknown mask type {value!r}; expected one of 0..3 or {list(_LABELS.values())}"
            ) from None


_LABELS = {
    AttnMaskType.FULL: "full",
    AttnMaskType.CAUSAL: "causal",
    AttnMaskType.INVCAUSAL: "inv_causal",
    AttnMaskType.BICAUSAL: "bi_causal",
}


class AttnRange(BaseModel):
    """Half-open token interval ``[start, end)`` with ``0 <= start <= end``."""

    model_config = ConfigDict(frozen=True)

    start: int
    end: int

    def __init__(self, start: int | None = None, end: int | None = None, /, **data: Any) -> None:
        if start is not None:
            data.setdefault("start", start)
        if end is not None:
            data.setdefault("end", end)
        super().__init__(**data)

    @model_validator(mode="after")
    def _check(self) -> AttnRange:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"range [{self.start}, {self.end}) is invalid: need 0 <= start <= end")
        return self

    @property
    def seqlen(self) -> int:
        return self.end - self.start

    def is_empty(self) -> bool:
        return self.end <= self.start

    def intersect(self, other: AttnRange) -> AttnRange:
        s, e = max(self.start, other.start), min(self.end, other.end)
        return AttnRange(s, max(s, e))

    def to_tuple(self) -> tuple[int, int]:
        return (self.start, self.end)

    def __repr__(self) -> str:
        return f"[{self.start}, {self.end})"


def _as_pair(item: Any, name: str, idx: int) -> tuple[int, int]:
    if isinstance(item, AttnRange):
        return item.to_tuple()
    if isinstance(item, dict) and set(item) == {"start", "end"}:
        item = (item["start"], item["end"])
    try:
        s, e = item
        s, e = int(s), int(e)
    except (TypeError, ValueError):
        raise ValueError(f"{name}[{idx}]: expected a pair [start, end), got {item!r}") from None
    if s < 0 or e < s:
        raise ValueError(f"{name}[{idx}]: range [{s}, {e}) is invalid: need 0 <= start <= end")
    return (s, e)


class AttnRanges(RootModel[list[AttnRange]]):
    """An ordered list of ranges; order is meaningful (it pairs with k ranges and mask types)."""

    model_config = ConfigDict(frozen=True)

    @classmethod
    def from_ranges(cls, ranges: Iterable[Any], *, name: str = "ranges") -> AttnRanges:
        """Build from ``[[s, e], ...]`` (or AttnRange items); ``ValueError`` naming ``name`` on bad items."""
        if isinstance(ranges, AttnRanges):
            return ranges
        pairs = [_as_pair(r, name, i) for i, r in enumerate(ranges)]
        return cls([AttnRange(s, e) for s, e in pairs])

    def to_naive_ranges(self) -> list[tuple[int, int]]:
        return [r.to_tuple() for r in self.root]

    # BaseModel.__iter__ yields (field, value) pairs; a list root iterates its items instead
    # (pydantic's documented RootModel pattern), an intended incompatible override.
    def __iter__(self) -> Iterator[AttnRange]:  # type: ignore[override]
        return iter(self.root)

    def __len__(self) -> int:
        return len(self.root)

    def __getitem__(self, i: int) -> AttnRange:
        return self.root[i]

    @property
    def total_seqlen(self) -> int:
        """Sum of lengths (counts overlapping tokens several times)."""
        return sum(r.seqlen for r in self.root)

    def area(self) -> int:
        """Number of distinct tokens covered."""
        return self.merge().total_seqlen

    def is_sorted(self) -> bool:
        return all(a.start <= b.start for a, b in zip(self.root, self.root[1:]))

    def is_non_overlap(self) -> bool:
        s = sorted(r for r in self.to_naive_ranges() if r[1] > r[0])
        return all(a[1] <= b[0] for a, b in zip(s, s[1:]))

    def sort(self) -> AttnRanges:
        return AttnRanges(sorted(self.root, key=lambda r: (r.start, r.end)))

    def merge(self) -> AttnRanges:
        """Sorted union: overlapping or touching ranges fused, empty ranges dropped."""
        return AttnRanges([AttnRange(s, e) for s, e in merge_intervals(self.to_naive_ranges())])

    def intersect(self, other: AttnRanges) -> AttnRanges:
        """Sorted, merged set intersection of the two unions."""
        a, b = self.merge().to_naive_ranges(), other.merge().to_naive_ranges()
        out, i, j = [], 0, 0
        while i < len(a) and j < len(b):
            s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
            if s < e:
                out.append(AttnRange(s, e))
            if a[i][1] < b[j][1]:
                i += 1
            else:
                j += 1
        return AttnRanges(out)

    def check_non_overlap_sorted(self, name: str = "ranges") -> None:
        """Raise ``ValueError`` naming ``name`` unless ranges are sorted and pairwise disjoint."""
        for i, (a, b) in enumerate(zip(self.root, self.root[1:])):
            if b.start < a.start:
                raise ValueError(f"{name}: not sorted at index {i + 1}: {b!r} starts before {a!r}")
            if b.start < a.end:
                raise ValueError(f"{name}: ranges {i} {a!r} and {i + 1} {b!r} overlap")

    def __repr__(self) -> str:
        return f"AttnRanges({self.to_naive_ranges()})"


def merge_intervals(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted union of half-open intervals; touching intervals fuse, empty ones vanish."""
    out: list[list[int]] = []
    for s, e in sorted(p for p in pairs if p[1] > p[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class AttnSlice(BaseModel):
    """One mask piece: ``q_range`` × ``k_range`` cut by ``mask_type`` (global coordinates)."""

    model_config = ConfigDict(frozen=True)

    q_range: AttnRange
    k_range: AttnRange
    mask_type: AttnMaskType = AttnMaskType.FULL

    @property
    def band(self) -> Band:
        return Band.from_slice(
            self.q_range.start, self.q_range.end, self.k_range.start, self.k_range.end, int(self.mask_type)
        )

    def area(self) -> int:
        """Covered cells, closed form: e.g. CAUSAL with sq <= sk is ``sq*sk - sq*(sq-1)/2``."""
        return self.band.area()


def _parse_types(mask_types: Any, n: int) -> list[AttnMaskType]:
    if isinstance(mask_types, (str, int, AttnMaskType)):
        return [AttnMaskType.parse(mask_types, "mask_types")] * n
    types = list(mask_types)
    if len(types) != n:
        raise ValueError(
            f"mask_types: has {len(types)} entries but q_ranges/k_ranges have {n}; they must match"
        )
    return [AttnMaskType.parse(t, f"mask_types[{i}]") for i, t in enumerate(types)]


class AttnMask(BaseModel):
    """A mask: the union of its slices, which must not cover a cell twice.

    ``AttnMask(q_ranges, k_ranges, mask_types, total_seqlen_q, total_seqlen_k)``; ranges are
    ``AttnRanges`` or ``[[s, e], ...]``; ``mask_types`` a list (or one value for all) of
    ``AttnMaskType``, codes 0..3 or strings.
    """

    model_config = ConfigDict(frozen=True)

    q_ranges: AttnRanges
    k_ranges: AttnRanges
    mask_types: list[AttnMaskType]
    total_seqlen_q: int
    total_seqlen_k: int

    def __init__(self, *args: Any, **data: Any) -> None:
        names = ("q_ranges", "k_ranges", "mask_types", "total_seqlen_q", "total_seqlen_k")
        if len(args) > len(names):
            raise TypeError(f"AttnMask takes at most {len(names)} positional arguments, got {len(args)}")
        for name, value in zip(names, args):
            if name in data:
                raise TypeError(f"AttnMask got {name} twice")
            data[name] = value
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _coerce(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        names = ("q_ranges", "k_ranges", "mask_types", "total_seqlen_q", "total_seqlen_k")
        missing = [n for n in names if n not in data]
        if missing:
            raise TypeError(f"AttnMask missing {missing}")
        data = dict(data)
        q = AttnRanges.from_ranges(data["q_ranges"], name="q_ranges")
        k = AttnRanges.from_ranges(data["k_ranges"], name="k_ranges")
        if len(q) != len(k):
            raise ValueError(f"k_ranges: has {len(k)} ranges but q_ranges has {len(q)}; they must match")
        data["q_ranges"], data["k_ranges"] = q, k
        data["mask_types"] = _parse_types(data["mask_types"], len(q))
        for name in ("total_seqlen_q", "total_seqlen_k"):
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be a non-negative int, got {value!r}")
        return data

    @model_validator(mode="after")
    def _check(self) -> AttnMask:
        self._check_bounds()
        self._check_no_double_cover()
        return self

    def _check_bounds(self) -> None:
        for name, ranges, total in (
            ("q_ranges", self.q_ranges, self.total_seqlen_q),
            ("k_ranges", self.k_ranges, self.total_seqlen_k),
        ):
            for i, r in enumerate(ranges):
                if r.end > total:
                    limit = "total_seqlen_q" if name == "q_ranges" else "total_seqlen_k"
                    raise ValueError(f"{name}[{i}]: {r!r} ends past {limit}={total}")

    def _check_no_double_cover(self) -> None:
        order = sorted(range(len(self)), key=lambda i: self.q_ranges[i].start)
        bands = self.bands()
        active: list[int] = []
        for i in order:
            b = bands[i]
            active = [j for j in active if bands[j].q1 > b.q0]
            for j in active:
                o = bands[j]
                if o.k0 < b.k1 and b.k0 < o.k1 and not b.intersect(o).is_empty():
                    raise ValueError(
                        f"q_ranges/k_ranges: slices {j} and {i} cover the same cells "
                        f"(q {self.q_ranges[j]!r}/{self.q_ranges[i]!r}, k {self.k_ranges[j]!r}/{self.k_ranges[i]!r})"
                    )
            active.append(i)

    # -- views --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.q_ranges)

    @property
    def slices(self) -> list[AttnSlice]:
        return [
            AttnSlice(q_range=q, k_range=k, mask_type=t)
            for q, k, t in zip(self.q_ranges, self.k_ranges, self.mask_types)
        ]

    def bands(self) -> list[Band]:
        return [
            Band.from_slice(q.start, q.end, k.start, k.end, int(t))
            for q, k, t in zip(self.q_ranges, self.k_ranges, self.mask_types)
        ]

    def area(self) -> int:
        """Number of covered cells."""
        return sum(b.area() for b in self.bands())

    def to_dense(self) -> list[list[bool]]:
        """Dense ``total_seqlen_q`` × ``total_seqlen_k`` boolean matrix (small sizes only, for tests)."""
        cells = self.total_seqlen_q * self.total_seqlen_k
        if cells > _MAX_DENSE_CELLS:
            raise ValueError(f"to_dense: mask has {cells} cells, more than the {_MAX_DENSE_CELLS} allowed")
        dense = [[False] * self.total_seqlen_k for _ in range(self.total_seqlen_q)]
        for b in self.bands():
            a, e = b.nonempty_rows()
            for q in range(a, e):
                lo, hi = b.row_span(q)
                row = dense[q]
                for k in range(lo, hi):
                    row[k] = True
        return dense

    def to_lists(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]]:
        """``(q_ranges, k_ranges, type codes)`` as plain lists (e.g. to build kernel tensors)."""
        return (
            self.q_ranges.to_naive_ranges(),
            self.k_ranges.to_naive_ranges(),
            [int(t) for t in self.mask_types],
        )

    @classmethod
    def from_bands(cls, bands: Sequence[Band], total_seqlen_q: int, total_seqlen_k: int) -> AttnMask:
        """Exact mask of a union of disjoint bands, each decomposed into at most three API slices."""
        qr, kr, ts = [], [], []
        for b in bands:
            for qs, qe, ks, ke, t in b.to_slices():
                qr.append((qs, qe))
                kr.append((ks, ke))
                ts.append(t)
        return cls(qr, kr, ts, total_seqlen_q, total_seqlen_k)
