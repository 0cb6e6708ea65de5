"""A small cache keyed by the identity of a few tensors, so hot paths skip device->host copies.

A hit needs the very same tensor objects (checked through weak references, so a recycled ``id``
never matches), the same storage pointer, shape and dtype, and the same in-place version counter
(an in-place write to a range tensor invalidates its entry).

What it cannot see: writes that bypass the version counter (through ``.numpy()``, ``.data``,
DLPack, or a collective such as ``dist.broadcast`` writing into an existing tensor). Callers
that must see those compare the contents too (``_validate`` does for host tensors). Inference
tensors have no version counter at all: they are never cached (a miss, not an error).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import torch

__all__ = ["IdentityCache", "cacheable"]


def _ident(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (id(t), t.data_ptr(), t._version, tuple(t.shape), t.dtype)


def cacheable(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether every tensor has a version counter (inference tensors have none)."""
    return not any(t is not None and t.is_inference() for t in tensors)


class IdentityCache:
    """LRU of at most ``maxsize`` values keyed by ``(tensors' identities, extra)``."""

    def __init__(self, maxsize: int = 64) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[tuple, tuple[tuple, Any]] = OrderedDict()

    def _key(self, tensors: Sequence[torch.Tensor | None], extra: Hashable) -> tuple:
        return (*(_ident(t) for t in tensors), extra)

    def get(self, tensors: Sequence[torch.Tensor | None], extra: Hashable = None) -> Any | None:
        """The value stored for these very tensors (unchanged since) and ``extra``, else None."""
        if not cacheable(tensors):
            return None
        key = self._key(tensors, extra)
        hit = self._entries.get(key)
        if hit is None:
            return None
        refs, value = hit
        for r, t in zip(refs, tensors):
            if (r is None) != (t is None) or (r is not None and r() is not t):
                del self._entries[key]
                return None
        self._entries.move_to_end(key)
        return value

    def put(self, tensors: Sequence[torch.Tensor | None], extra: Hashable, value: Any) -> None:
        """Store ``value`` for these tensors and ``extra`` (nothing for inference tensors)."""
        if not cacheable(tensors):
            return
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self._entries[self._key(tensors, extra)] = (refs, value)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
