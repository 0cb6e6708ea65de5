"""`FlexMask`: a mask's slices checked once, for `flex_flash_attn_func(..., mask=...)`.

Like FlexAttention's ``BlockMask``: build it once per mask (``FlexMask.from_ranges``, on the host,
outside any torch.compile region) and pass it to every call and layer that uses the mask. The
range values are checked when it is built (one host copy); calls with it then check nothing that
needs the device: no device-to-host copy, no sync, in eager mode and in a compiled graph alike.
Its tensors are recorded beside the checked slices (`_validate.register_mask`), so the
attention operator recognises them when it runs, also inside a compiled graph that only passes
tensors, and keeps the CuTe tile plans of the mask with that record.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._types import mask_type_code
from ._validate import MaskRecord, _check_ranges_uncached, mask_record, register_mask

__all__ = ["FlexMask"]

_I32_MAX = 2**31 - 1


def _total(name: str, x: object) -> int:
    if x is None:
        raise TypeError(f"FlexMask: {name} is required (the number of {name[-1]} tokens)")
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"FlexMask: {name} must be an int, got {type(x).__name__} {x!r}")
    if not 0 <= int(x) <= _I32_MAX:
        raise ValueError(f"FlexMask: {name} must be in [0, 2**31), got {int(x)}")
    return int(x)


def _int_tensor(name: str, x: object, pairs: bool, device: torch.device | None) -> torch.Tensor:
    """``x`` (a tensor of integers or a nested sequence of ints) as a fresh int32 tensor."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"FlexMask: {name} must hold integers, got dtype {x.dtype}")
        t = x.detach()
    else:
        if (
            not isinstance(x, Sequence)
            or isinstance(x, str)
            or (pairs and not all(isinstance(r, Sequence) and len(r) == 2 for r in x))
        ):
            shape = "(N, 2) pairs [start, end)" if pairs else "(N,) codes"
            raise TypeError(f"FlexMask: {name} must be a tensor or a sequence of {shape}, got {x!r:.80}")
        flat = [v for r in x for v in r] if pairs else [mask_type_code(c) for c in x]
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in flat):
            raise TypeError(f"FlexMask: {name} must hold ints, got {x!r:.80}")
        t = torch.tensor(flat, dtype=torch.int64)
        if pairs:
            t = t.reshape(-1, 2)
    want = "(N, 2)" if pairs else "(N,)"
    if (pairs and (t.dim() != 2 or t.shape[1] != 2)) or (not pairs and t.dim() != 1):
        raise ValueError(f"FlexMask: {name} must have shape {want}, got {tuple(t.shape)}")
    if t.numel() and (int(t.min()) < -_I32_MAX - 1 or int(t.max()) > _I32_MAX):
        raise ValueError(f"FlexMask: {name} has values outside int32: [{int(t.min())}, {int(t.max())}]")
    with torch.inference_mode(False):  # the mask's own tensors: never inference tensors (versions)
        return t.to(device=device if device is not None else t.device, dtype=torch.int32).clone()


@dataclass(frozen=True, eq=False)
class FlexMask:
    """An immutable mask, its slices checked once: pass it as ``flex_flash_attn_func(..., mask=m)``.

    Build it with `from_ranges` (or the constructor with int32 tensors, which checks them the
    same way). The slices follow docs/api.md: slice ``i`` covers the cells of
    ``[q_ranges[i, 0], q_ranges[i, 1]) x [k_ranges[i, 0], k_ranges[i, 1])`` that its type keeps.

    Attributes:
        q_ranges, k_ranges: int32 ``(N, 2)`` contiguous, on the mask's device.
        attn_type_map: int32 ``(N,)`` mask type codes (all FULL when built with None).
        total_q, total_k: the token counts it was checked against (``q.shape[0]``, ``k.shape[0]``
            of the calls that use it).

    A mask lives on one device (`device`); calls need ``q`` there (``mask.to(q.device)`` once).
    Do not write into its tensors: a written tensor is no longer recognised as checked, and the
    call then checks the ranges again (correct, with one device-to-host copy).
    """

    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    attn_type_map: torch.Tensor
    total_q: int
    total_k: int
    _record: MaskRecord = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        total_q = _total("total_q", self.total_q)
        total_k = _total("total_k", self.total_k)
        tensors = {"q_ranges": self.q_ranges, "k_ranges": self.k_ranges, "attn_type_map": self.attn_type_map}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"FlexMask: {name} must be a torch.Tensor (or use from_ranges), got {type(t).__name__}"
                )
            if t.dtype != torch.int32:
                raise TypeError(
                    f"FlexMask: {name} must be an int32 tensor (or use from_ranges), got dtype {t.dtype}"
                )
        device = self.q_ranges.device
        for name, t in tensors.items():
            if t.device != device:
                raise ValueError(f"FlexMask: {name} is on {t.device}, q_ranges on {device}: one device")
        for name, t in tensors.items():
            if not t.is_contiguous() or t.is_inference():
                with torch.inference_mode(False):
                    t = t.contiguous() if not t.is_inference() else t.clone()
                object.__setattr__(self, name, t)
        qr, kr, tm, slices = _check_ranges_uncached(
            self.q_ranges, self.k_ranges, self.attn_type_map, total_q, total_k, device
        )
        object.__setattr__(self, "total_q", total_q)
        object.__setattr__(self, "total_k", total_k)
        object.__setattr__(self, "_record", register_mask(qr, kr, tm, total_q, total_k, slices))

    @classmethod
    def from_ranges(
        cls,
        q_ranges: torch.Tensor | Sequence[Sequence[int]],
        k_ranges: torch.Tensor | Sequence[Sequence[int]],
        attn_type_map: torch.Tensor | Sequence[object] | None = None,
        total_q: int | None = None,
        total_k: int | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> FlexMask:
        """Check the slices once and keep them on ``device``.

        Args:
            q_ranges, k_ranges: ``(N, 2)`` half-open ``[start, end)`` ranges: tensors of any
                integer dtype or sequences of pairs (copied: the mask owns its tensors).
            attn_type_map: ``(N,)`` codes or names (``0``..``3``, `MaskType`, ``"causal"``, ...);
                None = all FULL.
            total_q, total_k: the number of query and key tokens (``q.shape[0]``, ``k.shape[0]``
                of the calls). Required.
            device: where the mask lives (the calls' device); default: q_ranges' device when it
                is a tensor, else the CPU.

        Raises:
            TypeError / ValueError naming the argument and the value seen (a range out of
            ``[0, total)``, end < start, a code outside 0..3, mismatched N, ...).
        """
        total_q = _total("total_q", total_q)
        total_k = _total("total_k", total_k)
        if device is None:
            device = q_ranges.device if isinstance(q_ranges, torch.Tensor) else torch.device("cpu")
        device = torch.device(device)
        qr = _int_tensor("q_ranges", q_ranges, True, device)
        kr = _int_tensor("k_ranges", k_ranges, True, device)
        if kr.shape[0] != qr.shape[0]:
            raise ValueError(
                f"FlexMask: q_ranges and k_ranges must have the same N, got {qr.shape[0]} and {kr.shape[0]}"
            )
        if attn_type_map is None:
            tm = torch.zeros(qr.shape[0], dtype=torch.int32, device=device)
        else:
            tm = _int_tensor("attn_type_map", attn_type_map, False, device)
            if tm.shape[0] != qr.shape[0]:
                raise ValueError(
                    f"FlexMask: attn_type_map must have shape (N,) = ({qr.shape[0]},), got {tuple(tm.shape)}"
                )
        return cls(qr, kr, tm, total_q, total_k)

    # ------------------------------------------------------------------ views

    @property
    def device(self) -> torch.device:
        return self.q_ranges.device

    @property
    def num_slices(self) -> int:
        return self.q_ranges.shape[0]

    @property
    def slices(self) -> list[tuple[int, int, int, int, int]]:
        """The checked slices, ``(qs, qe, ks, ke, type)`` per slice (host ints, no device access)."""
        return list(self._record.slices)

    def to(self, device: torch.device | str) -> FlexMask:
        """The same mask on ``device`` (itself when already there); the checks are not repeated."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        new = object.__new__(FlexMask)
        with torch.inference_mode(False):
            q_ranges, k_ranges, attn_type_map = (
                t.to(device) for t in (self.q_ranges, self.k_ranges, self.attn_type_map)
            )
        object.__setattr__(new, "q_ranges", q_ranges)
        object.__setattr__(new, "k_ranges", k_ranges)
        object.__setattr__(new, "attn_type_map", attn_type_map)
        object.__setattr__(new, "total_q", self.total_q)
        object.__setattr__(new, "total_k", self.total_k)
        record = register_mask(
            q_ranges, k_ranges, attn_type_map, self.total_q, self.total_k, self._record.slices
        )
        object.__setattr__(new, "_record", record)
        return new

    def is_intact(self) -> bool:
        """Whether its tensors are still the ones checked (no in-place write since)."""
        return (
            mask_record(self.q_ranges, self.k_ranges, self.attn_type_map, self.total_q, self.total_k)
            is self._record
        )

    def area(self) -> int:
        """The number of covered cells (slices must not overlap, docs/api.md)."""
        total = 0
        for qs, qe, ks, ke, typ in self._record.slices:
            sq, sk = qe - qs, ke - ks
            if sq <= 0 or sk <= 0:
                continue
            # local row i sees the columns [lo(i), hi(i)] clipped to [0, sk - 1]
            i = torch.arange(sq, dtype=torch.int64)
            lo = i if typ in (2, 3) else torch.zeros_like(i)
            hi = i + (sk - sq) if typ in (1, 3) else torch.full_like(i, sk - 1)
            total += int((hi.clamp(max=sk - 1) - lo.clamp(min=0) + 1).clamp(min=0).sum())
        return total

    def to_dense(self) -> torch.Tensor:
        """bool ``(total_q, total_k)`` on the CPU: which cells the mask covers (small sizes: tests,
        pictures)."""
        from .testing import dense_mask

        s = self._record.slices
        return dense_mask(
            [[r[0], r[1]] for r in s],
            [[r[2], r[3]] for r in s],
            [r[4] for r in s],
            self.total_q,
            self.total_k,
        )

    def __repr__(self) -> str:
        return (
            f"FlexMask(num_slices={self.num_slices}, total_q={self.total_q}, total_k={self.total_k}, "
            f"device={self.device})"
        )
