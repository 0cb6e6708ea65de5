"""CTA order of the sm90 kernels (device side): which (work tile, head) a CTA runs.

The grid has ``num_work * num_heads`` CTAs. Heads go in groups of G (``flags >>
HEAD_GROUP_SHIFT``, chosen on the host: `interface.l2_head_group`, equal groups whose re-read data
fits in L2, raised by `bwd_interface.backward_head_group` in the deterministic backward);
inside a group the work tiles go in plan order (longest first), the G heads of one tile next
to each other.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .config import HEAD_GROUP_SHIFT


@cute.jit
def cta_work_and_head(flags, num_work, num_heads):
    """``(work tile index, head)`` of this CTA."""
    bid, _, _ = cute.arch.block_idx()
    group = flags >> HEAD_GROUP_SHIFT
    per_group = num_work * group
    g = bid // per_group
    h0 = g * group
    gsz = cutlass.min(group, num_heads - h0)
    idx = bid - g * per_group
    w = idx // gsz
    return w, h0 + idx - w * gsz
