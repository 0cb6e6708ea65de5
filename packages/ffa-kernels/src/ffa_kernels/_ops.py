"""`flex_flash_attn_func` as PyTorch operators, for torch.compile (and export, meta/fake tensors).

- ``torch.ops.ffa_kernels.flex_flash_attn_forward(q, k, v, q_ranges, k_ranges, attn_type_map,
  sink, sink_layout, softmax_scale, softcap, return_max_logits, deterministic) -> (out, lse,
  max_logits)``: out ``(Tq, Hq, D)`` in q's dtype, lse ``(Tq, Hq)`` in the accumulator dtype
  (float32; float64 for float64 q), max_logits float32 ``(Hq,)`` or ``(0,)``.
- ``torch.ops.ffa_kernels.flex_flash_attn_backward(dout, q, k, v, out, lse, q_ranges, k_ranges,
  attn_type_map, softmax_scale, softcap, deterministic) -> (dq, dk, dv)``.

Their implementations are `_frontend`'s (`_run_forward`, `_backward_whole`): the same backend
choice (CuTe on sm90, else the reference, `_backend`), run eagerly when the compiled graph runs,
so the launch code sees real tensors and real CUDA streams. They check their arguments
themselves, the range values included (`validate_attn_args`: a `FlexMask`'s tensors or range
tensors seen before cost no device access; new ones one host copy), so tracing
`flex_flash_attn_func` can leave those data-dependent checks out without anything going
unchecked. The fake implementations give shapes and dtypes only. Autograd: the backward op, plus
`sink_backward` in plain torch ops; the backward op refuses a second derivative.
"""

from __future__ import annotations

import torch

from ._frontend import _backward_whole, _run_forward
from ._sink import sink_backward
from ._validate import accumulator_dtype, check_float_tensor, check_sink, validate_attn_args

__all__ = ["flex_flash_attn_backward", "flex_flash_attn_forward"]

# The operators synchronise with the host the first time they see new range tensors (the
# checks, the CuTe plan): not something to capture into a CUDA graph.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("ffa_kernels::flex_flash_attn_forward", mutates_args=(), tags=_TAGS)
def flex_flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None,
    sink: torch.Tensor | None,
    sink_layout: str,
    softmax_scale: float,
    softcap: float,
    return_max_logits: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = validate_attn_args(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    sink = check_sink(sink, sink_layout, args.q)
    return _run_forward(args, sink, sink_layout, return_max_logits)


@flex_flash_attn_forward.register_fake
def _forward_fake(
    q, k, v, q_ranges, k_ranges, attn_type_map, sink, sink_layout, softmax_scale, softcap,
    return_max_logits, deterministic,
):  # fmt: skip
    tq, hq, _ = q.shape
    out = q.new_empty((tq, hq, v.shape[2]))
    lse = q.new_empty((tq, hq), dtype=accumulator_dtype(q.dtype))
    max_logits = q.new_empty((hq,) if return_max_logits else (0,), dtype=torch.float32)
    return out, lse, max_logits


@torch.library.custom_op("ffa_kernels::flex_flash_attn_backward", mutates_args=(), tags=_TAGS)
def flex_flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None,
    softmax_scale: float,
    softcap: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = validate_attn_args(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    tq, hq, _ = args.q.shape
    shape = (tq, hq, args.v.shape[2])
    dout = check_float_tensor("dout", dout, shape, args.q.device)
    out = check_float_tensor("out", out, shape, args.q.device)
    lse = check_float_tensor("lse", lse, (tq, hq), args.q.device)
    dq, dk, dv = _backward_whole(args, dout, out, lse, deterministic)
    # fresh contiguous tensors, as the fake promises (the kernels' and the reference's are)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@flex_flash_attn_backward.register_fake
def _backward_fake(
    dout, q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, deterministic
):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ----------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_ranges, k_ranges, attn_type_map, sink, sink_layout, scale, cap, _, deterministic = inputs
    out, lse, max_logits = output
    ctx.save_for_backward(q, k, v, q_ranges, k_ranges, attn_type_map, sink, out, lse)
    ctx.sink_layout, ctx.softmax_scale, ctx.softcap = sink_layout, scale, cap
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse, max_logits)


def _backward(ctx, dout, _dlse, _dmax):
    q, k, v, q_ranges, k_ranges, attn_type_map, sink, out, lse = ctx.saved_tensors
    dq = dk = dv = dsink = None
    if any(ctx.needs_input_grad[:3]):
        dq, dk, dv = torch.ops.ffa_kernels.flex_flash_attn_backward(
            dout, q, k, v, out, lse, q_ranges, k_ranges, attn_type_map,
            ctx.softmax_scale, ctx.softcap, ctx.deterministic,
        )  # fmt: skip
    if sink is not None and ctx.needs_input_grad[6]:
        dsink = sink_backward(sink, ctx.sink_layout, out, dout, lse)
    return dq, dk, dv, None, None, None, dsink, None, None, None, None, None


flex_flash_attn_forward.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "flex_flash_attn_func: double backward is not supported (its backward is once_differentiable): "
        "a second derivative through it would be wrong"
    )


flex_flash_attn_backward.register_autograd(
    _no_double_backward, setup_context=lambda ctx, inputs, output: None
)
