"""Launching a Triton kernel through its compiled handle, one per specialization.

Triton's ``kernel[grid](...)`` re-binds and re-specializes every argument in Python on every
call (~20-30 us per launch, and a collective makes two or three). :class:`CompiledKernel` keeps
the compiled kernel per specialization: the first launch of a specialization goes the regular
way (compiling, or fetching from Triton's cache), later ones go straight through the compiled
kernel's handle on the given stream. Its key mirrors Triton's own specialization rule (an int
is specialized on ``== 1``, on divisibility by 16 and on its width; a tensor on the 16-byte
alignment of its data pointer; plus the constexprs and launch options), so a cached kernel is
only reused where Triton would reuse it. A caller whose arguments are mostly fixed
(:class:`~.copy.CopyLaunch`) computes that key itself: the fixed part once, per launch only the
bits of the varying addresses.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CompiledKernel", "args_device", "specialization"]


def specialization(x) -> tuple:
    """What Triton specializes a runtime argument on (see the module docstring)."""
    if isinstance(x, int):
        return (x == 1, x % 16 == 0, -(2**31) <= x < 2**31)
    return (x.dtype, x.data_ptr() % 16 == 0)


class CompiledKernel:
    """A Triton kernel launched through its compiled handle, one per specialization."""

    def __init__(self, jit_fn) -> None:
        self.jit_fn = jit_fn
        # the interpreter (TRITON_INTERPRET=1, CPU tests) has no compiled handle: plain launches
        self.direct = hasattr(jit_fn, "device_caches")
        self.cache: dict[tuple, Any] = {}  # Triton's compiled kernels (untyped)
        self.variants: dict[tuple, int] = {}

    def variant(self, fixed: tuple) -> int:
        """A small int standing for ``fixed`` (the specialization of the arguments a caller
        never changes), so that a precomputed launch key stays cheap to hash."""
        return self.variants.setdefault(fixed, len(self.variants))

    def __call__(
        self,
        grid: tuple[int, int, int],
        args: tuple,
        consts: dict,
        num_warps: int,
        stream,
        key: tuple | None = None,
    ) -> None:
        """Launch on ``stream`` (a ``torch.cuda.Stream``; None = the current stream).

        ``key``: the specialization key of this launch when the caller computed it (it must
        determine everything Triton specializes on, see the module docstring); None computes
        it from the arguments."""
        if not self.direct:
            self.jit_fn[grid](*args, **consts, num_warps=num_warps)
            return
        if key is None:
            key = (
                tuple(specialization(a) for a in args),
                tuple(consts.values()),
                num_warps,
                args_device(args),
            )
        kernel = self.cache.get(key)
        if kernel is None:  # compile (or fetch from Triton's cache) and launch the regular way
            if stream is None:
                self.cache[key] = self.jit_fn[grid](*args, **consts, num_warps=num_warps)
            else:
                with torch.cuda.stream(stream):
                    self.cache[key] = self.jit_fn[grid](*args, **consts, num_warps=num_warps)
            return
        handle = (stream if stream is not None else torch.cuda.current_stream()).cuda_stream
        kernel.run(grid[0], grid[1], grid[2], handle, kernel.function, kernel.packed_metadata, None, None, None,
                   *args, *consts.values())  # fmt: skip


def args_device(args: tuple) -> int:
    """The CUDA device of the first tensor argument (kernels are compiled per device)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.index
    return torch.cuda.current_device()
