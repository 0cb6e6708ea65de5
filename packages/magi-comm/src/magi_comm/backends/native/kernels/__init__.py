"""The native backend's Triton kernels (imported lazily: needs triton).

:class:`~.copy.CopyLaunch` (the copy kernel: sends, receive copies, the in-kernel handshake)
and :func:`~.reduce.launch_reduce` (the fused reduction); :mod:`.handshake` holds the device
steps of the signalling protocol both share, :mod:`.compiled` the launch path that skips
Triton's per-call argument binding. Design: ``packages/magi-comm/docs/native.md``.
"""

from .copy import CopyLaunch
from .reduce import REDUCE_WARPS, launch_reduce, reduce_tile_rows

__all__ = ["REDUCE_WARPS", "CopyLaunch", "launch_reduce", "reduce_tile_rows"]
