"""CuTe DSL kernels for sm90 (Hopper).

``cute_forward`` is the entry point the frontend calls when backend == "cute". Importing this
package needs only torch (the host plan and the config are torch/pure Python); ``cute_forward``
exists only when nvidia-cutlass-dsl is installed, and cutlass itself is imported on first call.
"""

from __future__ import annotations

import importlib.util

from .config import FwdConfig, default_config

HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None


def _cute_forward(
    q,
    k,
    v,
    q_ranges,
    k_ranges,
    attn_type_map,
    *,
    softmax_scale,
    softcap,
    sink,
    sink_layout,
    return_max_logits,
):
    """Forward on sm90: returns (out (Tq,Hq,D) in q.dtype, lse f32 (Tq,Hq), max_logits f32 (Hq,) or None)."""
    from .launch import cute_forward as _impl

    return _impl(
        q,
        k,
        v,
        q_ranges,
        k_ranges,
        attn_type_map,
        softmax_scale=softmax_scale,
        softcap=softcap,
        sink=sink,
        sink_layout=sink_layout,
        return_max_logits=return_max_logits,
    )


if HAVE_CUTLASS:
    cute_forward = _cute_forward
    __all__ = ["HAVE_CUTLASS", "FwdConfig", "cute_forward", "default_config"]
else:  # the frontend sees no cute_forward and falls back to the reference backend
    __all__ = ["HAVE_CUTLASS", "FwdConfig", "default_config"]
