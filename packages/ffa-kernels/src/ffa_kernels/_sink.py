"""Attention sink: extra logits in every row's softmax that contribute no output.

A sink of ``S`` logits ``z_1..z_S`` (per head, and per row for layout ``"ssh"``) joins the
softmax denominator only. With the attention's ``(out, lse)`` over the real keys and
``lse_sink = logsumexp_s z_s``:

    lse_final = logaddexp(lse, lse_sink),   out_final = out * exp(lse - lse_final).

For the backward, the sink's probabilities are ``P_s = exp(z_s - lse_final)`` and its "value"
is 0, so ``dP_s = 0`` and ``dz_s = P_s * (0 - delta)`` with ``delta = rowsum(dout * out_final)``:

    dsink = -sum_rows exp(z_s - lse_final) * delta     ("sh": summed over rows; "ssh": per row).

dq/dk/dv need nothing extra: the sink enters them only through lse_final and out_final.
"""

from __future__ import annotations

import torch

from ._merge import merge_lse_
from ._validate import check_sink_shape

__all__ = ["apply_sink", "sink_backward", "sink_lse"]

_NEG_INF = float("-inf")


def sink_lse(sink: torch.Tensor, sink_layout: str) -> torch.Tensor:
    """logsumexp of the sink logits: ``(Hq,)`` for ``"sh"`` ``(S, Hq)``, ``(Tq, Hq)`` for ``"ssh"``."""
    if sink_layout == "sh":
        return torch.logsumexp(sink, dim=0)
    if sink_layout == "ssh":
        return torch.logsumexp(sink, dim=1)
    raise ValueError(f"sink_layout must be 'sh' or 'ssh', got {sink_layout!r}")


def apply_sink(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, sink: torch.Tensor | None, sink_layout: str
) -> None:
    """Fold a sink into a finished forward result, in place.

    Args:
        out_acc: float32/float64 ``(Tq, Hq, D)``, the final (all stages merged) output.
        lse_acc: float32/float64 ``(Tq, Hq)``, its log-sum-exp.
        sink: float32 ``(S_sink, Hq)`` (layout ``"sh"``) or ``(Tq, S_sink, Hq)`` (``"ssh"``), or None
            (then nothing happens).
        sink_layout: ``"sh"`` or ``"ssh"``.

    Call it once, after every stage was merged (it is not a stage: a second call would count the
    sink twice). Rows with ``lse = -inf`` keep ``out = 0`` and get ``lse = logsumexp(sink)``.
    """
    if sink is None:
        return
    check_sink_shape(sink, sink_layout, lse_acc.shape[0], lse_acc.shape[1])
    # The sink is one more partial result over disjoint "keys": lse = logsumexp(sink) and a zero
    # output. The log-sum-exp merge already handles every -inf case (and zeroes a row nothing
    # covered, whatever it held), so reuse it instead of repeating its NaN-safe rescaling here.
    z = sink_lse(sink.to(lse_acc.dtype), sink_layout).expand_as(lse_acc)
    merge_lse_(out_acc, lse_acc, out_acc.new_zeros(()).expand_as(out_acc), z)


def sink_backward(
    sink: torch.Tensor, sink_layout: str, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """Gradient of the sink logits.

    Args:
        sink: ``(S_sink, Hq)`` (``"sh"``) or ``(Tq, S_sink, Hq)`` (``"ssh"``).
        sink_layout: ``"sh"`` or ``"ssh"``.
        out: ``(Tq, Hq, D)`` final output (after `apply_sink`).
        dout: ``(Tq, Hq, D)`` its gradient.
        lse: ``(Tq, Hq)`` final lse (after `apply_sink`).

    Returns:
        dsink, same shape and dtype as ``sink`` (math in float32, or float64 for float64 inputs).
    """
    check_sink_shape(sink, sink_layout, lse.shape[0], lse.shape[1])
    dtype = torch.float64 if torch.float64 in (sink.dtype, out.dtype, lse.dtype) else torch.float32
    delta = (out.to(dtype) * dout.to(dtype)).sum(dim=-1)  # (Tq, Hq)
    lse = lse.to(dtype)
    lse = lse.masked_fill(lse == _NEG_INF, float("inf")).unsqueeze(1)  # (Tq, 1, Hq); P = 0 if -inf
    z = sink.to(dtype)
    if sink_layout == "sh":
        z = z.unsqueeze(0)  # (1, S, Hq)
    grad = -(torch.exp(z - lse) * delta.unsqueeze(1))  # (Tq, S, Hq)
    if sink_layout == "sh":
        grad = grad.sum(dim=0)
    return grad.to(sink.dtype)
