"""Symmetric outputs (``NativeBackend.empty_output``): tensors in the NVSHMEM heap that peers write
into (a group_cast in direct mode) or read from (a group_reduce's pull).

``packages/magi-comm/docs/native.md`` ("Direct mode", "Pull").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .runtime import peer_view

__all__ = ["SymmetricOutputs", "recent", "spans_overlap"]

_ALIGN_OUT = 256  # bytes; symmetric outputs are padded to this
_MAPS_PER_PLAN = 4  # direct-mode maps / publish tables kept per plan (symmetric tensors used with it)


class SymmetricOutputs:
    """A group's table of symmetric outputs, one per slot.

    Every rank allocates and frees its outputs in the same order, so slot ``a`` names the same
    collective allocation on every rank: a map header ``1 + a`` tells a peer which one.

    Attributes:
        tensors: per slot the allocation (uint8), None where the slot is free.
        spans: live slot -> ``(start, end)`` address of its allocation.
        generation: allocations made in each slot so far (caches of maps keyed by address name
            the generation too: a freed slot's next allocation may hold the same address at
            another offset).
        bases: int64 ``(slots, W)`` device table: slot ``a``'s allocation as peer ``c``'s
            memory (NVLink-mapped addresses), read by the kernels.
    """

    def __init__(self, nvc, rank: int, world: int, device: torch.device, slots: int,
                 barrier: Callable[[], None]) -> None:  # fmt: skip
        self._nvc = nvc
        self._rank, self._world = rank, world
        self._barrier = barrier
        self.tensors: list[torch.Tensor | None] = [None] * slots
        self.spans: dict[int, tuple[int, int]] = {}
        self.generation = [0] * slots
        self.bases = torch.zeros((slots, world), dtype=torch.int64, device=device)

    def free_slot(self) -> int:
        """The slot the next symmetric output takes (the lowest free one), -1 if none."""
        return next((a for a, t in enumerate(self.tensors) if t is None), -1)

    def allocate(self, nbytes: int, a: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Collective: a ``shape`` / ``dtype`` tensor at the start of a new symmetric allocation of
        ``nbytes`` (the same on every rank, at least the tensor's size) in free slot ``a``."""
        nvc = self._nvc
        base = nvc.tensor((max(_ALIGN_OUT, -(-nbytes // _ALIGN_OUT) * _ALIGN_OUT),), dtype=torch.uint8)
        bases = [peer_view(nvc, base, self._rank, pe).data_ptr() for pe in range(self._world)]
        self.bases[a] = torch.tensor(bases, dtype=torch.int64)
        self.tensors[a] = base
        self.generation[a] += 1
        self.spans[a] = (base.data_ptr(), base.data_ptr() + base.numel())
        numel = torch.Size(shape).numel()
        return base[: numel * torch.empty(0, dtype=dtype).element_size()].view(dtype).view(shape)

    def index(self, t: torch.Tensor) -> int | None:
        """Slot of the symmetric output that holds all of ``t``'s bytes, or None."""
        if not self.spans:
            return None
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        for a, (start, end) in self.spans.items():
            if start <= lo and hi <= end:
                return a
        return None

    def free(self, a: int) -> None:
        """Collective: free slot ``a``'s output once every rank is done with every transfer."""
        self._barrier()
        base, self.tensors[a] = self.tensors[a], None
        del self.spans[a]
        self.bases[a] = torch.zeros(self._world, dtype=torch.int64)  # a host copy: in order
        self._nvc.free_tensor(base)

    def close(self) -> None:
        """Collective: free every live output."""
        for a in sorted(self.spans):
            self.free(a)


def recent(plan, name: str, key, build: Callable[[], object]):
    """``build()``, cached on ``plan`` under ``name`` for the last ``_MAPS_PER_PLAN`` keys (maps
    and publish tables of the last few symmetric tensors a plan was used with). A key names the
    tensor by its output's slot and generation, its address and row size."""
    cache = plan._on_device.setdefault(name, {})
    value = cache.pop(key, None)
    if value is None:
        value = build()
    cache[key] = value  # most recent last
    while len(cache) > _MAPS_PER_PLAN:
        del cache[next(iter(cache))]
    return value


def spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of two contiguous tensors intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
