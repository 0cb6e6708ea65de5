"""Small shared types: the mask-type integer codes and the forward metadata dataclass (what
``ffa_kernels`` re-exports, `__all__`), and `as_dtype`, an internal helper its modules share.

`ffa_kernels` must install and work alone (see docs/api.md), so it does not import `magi_solver`'s
`AttnMaskType`; it only speaks the integer codes that both packages agree on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["BICAUSAL", "CAUSAL", "FULL", "INVCAUSAL", "AttnForwardMeta", "MaskType", "mask_type_code"]


class MaskType(enum.IntEnum):
    """Integer codes of the four slice mask types, as used in `attn_type_map` (docs/api.md).

    With local row ``i`` and local column ``j`` of a slice of ``sq`` rows and ``sk`` columns:
    FULL keeps every cell, CAUSAL (bottom-right aligned) keeps ``j <= i + (sk - sq)``,
    INVCAUSAL (top-left aligned) keeps ``j >= i``, BICAUSAL keeps both.
    """

    FULL = 0
    CAUSAL = 1
    INVCAUSAL = 2
    BICAUSAL = 3


FULL = MaskType.FULL
CAUSAL = MaskType.CAUSAL
INVCAUSAL = MaskType.INVCAUSAL
BICAUSAL = MaskType.BICAUSAL

_NAMES = {
    "full": MaskType.FULL,
    "causal": MaskType.CAUSAL,
    "inv_causal": MaskType.INVCAUSAL,
    "invcausal": MaskType.INVCAUSAL,
    "bi_causal": MaskType.BICAUSAL,
    "bicausal": MaskType.BICAUSAL,
}


def mask_type_code(mask_type: object) -> int:
    """Return the integer code (0..3) of a mask type.

    Accepts an int code, a `MaskType`, one of the strings ``"full"``, ``"causal"``,
    ``"inv_causal"``, ``"bi_causal"``, or any enum whose ``.value`` is one of those (so a
    `magi_solver.AttnMaskType` member works without this package importing magi_solver).

    Raises:
        ValueError: unknown name or code out of 0..3.
        TypeError: anything else.
    """
    if isinstance(mask_type, bool):
        raise TypeError(f"mask type must be an int code or a name, got bool {mask_type!r}")
    if isinstance(mask_type, int):
        if not 0 <= int(mask_type) <= 3:
            raise ValueError(f"mask type code must be in 0..3, got {int(mask_type)}")
        return int(mask_type)
    if isinstance(mask_type, enum.Enum):
        return mask_type_code(mask_type.value)
    if isinstance(mask_type, str):
        try:
            return int(_NAMES[mask_type.lower()])
        except KeyError:
            raise ValueError(
                f"unknown mask type name {mask_type!r}; expected one of "
                "'full', 'causal', 'inv_causal', 'bi_causal'"
            ) from None
    raise TypeError(f"mask type must be an int code or a name, got {type(mask_type).__name__}")


@dataclass
class AttnForwardMeta:
    """Extra forward results of `flex_flash_attn_func`.

    Attributes:
        lse: float32 ``(Tq, Hq)``, natural-log log-sum-exp of each row's logits (sink included);
            ``-inf`` for a row that nothing covers.
        max_logits: float32 ``(Hq,)`` or None (only when ``return_max_logits=True``): per head, the
            max over covered cells of ``softmax_scale * q.k`` before softcap; ``-inf`` for a head
            with no covered cell.
    """

    lse: torch.Tensor
    max_logits: torch.Tensor | None


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it already is (``t.to(dtype)`` costs microseconds of
    host time even when it returns ``t``, which a training step's path feels)."""
    return t if t.dtype == dtype else t.to(dtype)
