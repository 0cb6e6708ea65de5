"""CuTe DSL kernels for sm90 (Hopper).

``cute_forward`` is the entry point the frontend calls when backend == "cute".
``cute_forward_accumulate`` is the same forward merging its result, by log-sum-exp, into a
float32 (out, lse) accumulator in place (several calls over disjoint key sets combine exactly;
not wired into the frontend yet). Importing this package needs only torch (the host plan and
the config are torch/pure Python); both functions exist only when nvidia-cutlass-dsl is
installed, and cutlass itself is imported on first call.
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


def _cute_forward_accumulate(
    q,
    k,
    v,
    q_ranges,
    k_ranges,
    attn_type_map,
    out_acc,
    lse_acc,
    *,
    softmax_scale,
    softcap,
    max_logits_acc=None,
):
    """Forward on sm90 merged in place into out_acc f32 (Tq,Hq,D) / lse_acc f32 (Tq,Hq).

    Rows the call covers get l = logaddexp(l_acc, l), out = exp(l_acc - l) * out_acc +
    exp(l_new - l) * out_new; other rows are not written. max_logits_acc f32 (Hq,) or None is
    max-updated. No sink. Returns (out_acc, lse_acc). See ``launch.cute_forward_accumulate``.
    """
    from .launch import cute_forward_accumulate as _impl

    return _impl(
        q,
        k,
        v,
        q_ranges,
        k_ranges,
        attn_type_map,
        out_acc,
        lse_acc,
        softmax_scale=softmax_scale,
        softcap=softcap,
        max_logits_acc=max_logits_acc,
    )


if HAVE_CUTLASS:
    cute_forward = _cute_forward
    cute_forward_accumulate = _cute_forward_accumulate
    __all__ = ["HAVE_CUTLASS", "FwdConfig", "cute_forward", "cute_forward_accumulate", "default_config"]
else:  # the frontend sees no cute_forward and falls back to the reference backend
    __all__ = ["HAVE_CUTLASS", "FwdConfig", "default_config"]
