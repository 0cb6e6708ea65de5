"""Public entry points: `flex_flash_attn_func` and the per-stage forward/backward.

`flex_flash_attn_func` means one stage plus the sink: on the reference backend its forward is
literally one stage into fresh accumulators followed by `apply_sink`; the CuTe kernel does the
same in one launch (the sink seeds its softmax state). Its backward is one `ffa_backward_stage`
with the final out/lse plus `sink_backward`. With the kernel, a stage merges into float32
accumulators inside its epilogue. magi-dist calls the stages itself, once per key set, to get
the same result for a mask whose keys live on several ranks.

Under torch.compile (and for meta / fake tensors) `flex_flash_attn_func` calls the operators
``torch.ops.ffa_kernels.flex_flash_attn_forward`` / ``..._backward`` (`_ops.py`) instead of the
autograd Function: the same computation (`_run_forward`, `_backward_whole`) behind a
``torch.library`` op that Dynamo does not trace into. Eager calls skip the dispatcher (its
Python custom-op layers cost more than the whole host path of a call).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import _backend
from ._flex_mask import FlexMask
from ._kv_ready import KVReady, check_kv_ready, wait_on_stream
from ._merge import merge_finite_lse_
from ._once_differentiable import once_differentiable
from ._sink import apply_sink, sink_backward
from ._types import AttnForwardMeta, as_dtype
from ._validate import (
    ValidatedAttnArgs,
    accumulator_dtype,
    check_accumulator,
    check_attn_metadata,
    check_bool,
    check_float_tensor,
    check_heads_per_cta,
    check_sink,
    check_token_tensor,
    validate_attn_args,
)
from .reference.backward import reference_backward_stage
from .reference.forward import reference_forward_stage

__all__ = [
    "backward_heads_per_cta",
    "ffa_backward_prepare",
    "ffa_backward_stage",
    "ffa_forward",
    "ffa_forward_stage",
    "flex_flash_attn_func",
    "once_differentiable",
]

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- dispatch


def _cute_module(args: ValidatedAttnArgs):
    """The CuTe kernels' module when they serve this call's device and dtype, else None."""
    if _backend.select_forward_backend(args.q.device, args.q.dtype) != _backend.CUTE:
        return None
    cute = _backend.load_cute()
    assert cute is not None  # select_forward_backend checked it
    return cute


def _kernel_declined(exc: NotImplementedError) -> None:
    # The kernel's way to say "this configuration is not supported" (head dim, dtype, ...): the
    # reference computes the same thing, only slower. `_backend.fallback` warns once per reason,
    # or raises RuntimeError under FFA_BACKEND=cute.
    _backend.fallback(str(exc), cause=exc)


def _autocast_on(kind: str) -> bool:
    """Whether autocast is enabled for the device type ``kind`` (False where it has none)."""
    if kind not in ("cuda", "cpu") and not torch.amp.is_autocast_available(kind):
        return False
    return torch.is_autocast_enabled(kind)


def _autocast_off(device: torch.device):
    """A context that turns autocast off on ``device`` (the reference backend's float32 math must
    not run in the autocast dtype), or a no-op when autocast is off there."""
    if torch._C._is_any_autocast_enabled() and _autocast_on(device.type):  # the first test: 0.3 us
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _reference_forward_stage(args: ValidatedAttnArgs, out_acc, lse_acc, max_logits_acc) -> None:
    with _autocast_off(args.q.device):
        reference_forward_stage(args, out_acc, lse_acc, max_logits_acc)


def _reference_backward_stage(args: ValidatedAttnArgs, dout, out, lse, dq_acc, dk_acc, dv_acc) -> None:
    with _autocast_off(args.q.device):
        reference_backward_stage(args, dout, out, lse, dq_acc, dk_acc, dv_acc)


def _kernel_forward(
    cute,
    args: ValidatedAttnArgs,
    sink,
    sink_layout: str,
    return_max_logits: bool,
    kv_ready: KVReady | None = None,
):
    """One plain kernel call over ``args``: (out in q's dtype, lse, max_logits or None)."""
    return cute.cute_forward(
        args.q,
        args.k,
        args.v,
        args.q_ranges,
        args.k_ranges,
        args.attn_type_map,
        softmax_scale=args.softmax_scale,
        softcap=args.softcap,
        sink=sink,
        sink_layout=sink_layout,
        return_max_logits=return_max_logits,
        kv_ready=kv_ready,
    )


def _forward_stage(
    args: ValidatedAttnArgs, out_acc: torch.Tensor, lse_acc: torch.Tensor, max_logits_acc: torch.Tensor | None
) -> None:
    cute = _cute_module(args)
    if cute is not None:
        try:
            if cute.accumulators_fit(out_acc, lse_acc, max_logits_acc):
                # The kernel's epilogue merges by log-sum-exp straight into the accumulators.
                cute.cute_forward_accumulate(
                    args.q,
                    args.k,
                    args.v,
                    args.q_ranges,
                    args.k_ranges,
                    args.attn_type_map,
                    out_acc,
                    lse_acc,
                    max_logits_acc=max_logits_acc,
                    softmax_scale=args.softmax_scale,
                    softcap=args.softcap,
                )
                return
            out, lse, max_logits = _kernel_forward(cute, args, None, "sh", max_logits_acc is not None)
        except NotImplementedError as exc:
            _kernel_declined(exc)
        else:
            # A finished (normalised) result for this key set; the kernel writes every row (0 where
            # nothing is covered), so the lean merge applies.
            merge_finite_lse_(out_acc, lse_acc, out, lse)
            if max_logits_acc is not None:
                torch.maximum(max_logits_acc, max_logits.to(max_logits_acc.dtype), out=max_logits_acc)
            return
    _reference_forward_stage(args, out_acc, lse_acc, max_logits_acc)


def _forward_whole(
    args: ValidatedAttnArgs,
    sink: torch.Tensor | None,
    sink_layout: str,
    return_max_logits: bool,
    kv_ready: KVReady | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The whole forward of `flex_flash_attn_func`: (out, lse, max_logits) in accumulator dtype
    (reference) or out in q's dtype (kernel; its sink goes into the softmax state directly).
    ``kv_ready`` (checked): the kernel waits for the late rows itself, the reference's stream
    before it starts."""
    cute = _cute_module(args)
    if cute is not None:
        try:
            return _kernel_forward(cute, args, sink, sink_layout, return_max_logits, kv_ready)
        except NotImplementedError as exc:
            _kernel_declined(exc)
    wait_on_stream(kv_ready)
    out_acc, lse_acc, max_acc = forward_accumulators(
        args.q, max_logits=return_max_logits, head_dim_v=args.v.shape[2]
    )
    _reference_forward_stage(args, out_acc, lse_acc, max_acc)
    apply_sink(out_acc, lse_acc, sink, sink_layout)
    return out_acc, lse_acc, max_acc


def _backward_kernel(device: torch.device, dtype: torch.dtype):
    """The CuTe module when its backward serves this device and dtype, else None."""
    if _backend.select_backward_backend(device, dtype) != _backend.CUTE:
        return None
    return _backend.load_cute()


def _backward_whole(
    args: ValidatedAttnArgs, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, deterministic: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one whole attention call, in the dtypes of q, k, v."""
    q, k, v = args.q, args.k, args.v
    cute = _backward_kernel(args.q.device, args.q.dtype)
    if cute is not None:
        try:
            # the gradients straight in the input dtype (no float32 dk/dv, no casts)
            return cute.cute_backward(
                q, k, v, dout, out, lse, args.q_ranges, args.k_ranges, args.attn_type_map,
                softmax_scale=args.softmax_scale, softcap=args.softcap, deterministic=deterministic,
            )  # fmt: skip
        except NotImplementedError as exc:
            _kernel_declined(exc)
    dtype = args.compute_dtype
    dq_acc = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=dtype, device=v.device)
    _reference_backward_stage(args, dout, out, lse, dq_acc, dk_acc, dv_acc)
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def _backward_stage(
    args: ValidatedAttnArgs,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq_acc: torch.Tensor,
    dk_acc: torch.Tensor,
    dv_acc: torch.Tensor,
    deterministic: bool = False,
    heads_per_cta: int | None = None,
) -> None:
    cute = _backward_kernel(args.q.device, args.q.dtype)
    if cute is not None:
        try:
            cute.cute_backward_stage(
                args.q,
                args.k,
                args.v,
                dout,
                out,
                lse,
                args.q_ranges,
                args.k_ranges,
                args.attn_type_map,
                dq_acc,
                dk_acc,
                dv_acc,
                softmax_scale=args.softmax_scale,
                softcap=args.softcap,
                heads_per_cta=heads_per_cta,
                deterministic=deterministic,
            )
            return
        except NotImplementedError as exc:
            _kernel_declined(exc)
    _reference_backward_stage(args, dout, out, lse, dq_acc, dk_acc, dv_acc)


def _run_forward(
    args: ValidatedAttnArgs, sink: torch.Tensor | None, sink_layout: str, return_max_logits: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flex_flash_attn_func`'s forward, as its operator returns it: out ``(Tq, Hq, Dv)`` in q's
    dtype, lse ``(Tq, Hq)`` in the accumulator dtype (float32; float64 for float64 q: what the
    backward gets back), max_logits float32 ``(Hq,)`` (empty ``(0,)`` unless asked for). All
    contiguous and fresh (the operator's fake implementation promises these layouts)."""
    out, lse, max_logits = _forward_whole(args, sink, sink_layout, return_max_logits)
    q = args.q
    if max_logits is None:
        max_logits = torch.empty(0, dtype=torch.float32, device=q.device)
    return (
        as_dtype(out, q.dtype),
        as_dtype(lse, accumulator_dtype(q.dtype)),
        as_dtype(max_logits, torch.float32),
    )


# ----------------------------------------------------------------------------- stage API


def forward_accumulators(
    q: torch.Tensor, *, max_logits: bool = False, head_dim_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fresh accumulators for `ffa_forward_stage` calls over the rows of ``q`` ``(Tq, Hq, D)``:
    ``out`` zeros ``(Tq, Hq, Dv)`` (``Dv = head_dim_v``, v's head dim; None: D), ``lse``
    ``-inf`` ``(Tq, Hq)`` and, with ``max_logits``, a ``-inf`` ``(Hq,)`` (else None); on q's
    device, in `accumulator_dtype` (float32; float64 for float64 q)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"forward_accumulators: q must be a (Tq, Hq, D) tensor, got {q!r:.80}")
    tq, hq, d = q.shape
    if head_dim_v is not None:
        if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int) or head_dim_v < 1:
            raise ValueError(f"forward_accumulators: head_dim_v must be an int >= 1, got {head_dim_v!r}")
        d = head_dim_v
    dtype = accumulator_dtype(q.dtype)
    out = torch.zeros((tq, hq, d), dtype=dtype, device=q.device)
    lse = torch.full((tq, hq), _NEG_INF, dtype=dtype, device=q.device)
    ml = torch.full((hq,), _NEG_INF, dtype=dtype, device=q.device) if max_logits else None
    return out, lse, ml


def ffa_forward_stage(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None,
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    max_logits_acc: torch.Tensor | None = None,
) -> None:
    """Compute one stage of attention and merge it into float accumulators, in place.

    Args:
        q: ``(Tq, Hq, D)``; k: ``(Tk, Hk, D)``, v: ``(Tk, Hk, Dv)`` (Dv may differ from D: MLA); float16/bfloat16/float32/float64, one dtype and
            device; ``Hq % Hk == 0``.
        q_ranges, k_ranges: int32 ``(N, 2)``, this stage's slices (in the coordinates of q and k).
        attn_type_map: int32 ``(N,)`` mask type codes, or None for all FULL.
        out_acc: float32 ``(Tq, Hq, Dv)`` (float64 allowed), initialised by the caller to 0
            (`forward_accumulators` makes all three).
        lse_acc: float32 ``(Tq, Hq)`` (float64 allowed), initialised by the caller to ``-inf``.
        softmax_scale: None means ``D ** -0.5``.
        softcap: logits ``softcap * tanh(scale * q.k / softcap)`` when > 0.
        max_logits_acc: optional float32 ``(Hq,)``, initialised to ``-inf``; max-updated with
            ``softmax_scale * q.k`` (before softcap) over the covered cells.

    Stages over disjoint sets of cells (e.g. different keys) merge exactly by log-sum-exp, in
    any order. Rows this stage does not cover are left untouched. No sink: after the last
    stage, call `apply_sink(out_acc, lse_acc, sink, sink_layout)` once.
    """
    args = validate_attn_args(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    tq, hq, _ = args.q.shape
    dv = args.v.shape[2]
    dev = args.q.device
    check_accumulator("out_acc", out_acc, (tq, hq, dv), dev)
    check_accumulator("lse_acc", lse_acc, (tq, hq), dev)
    if max_logits_acc is not None:
        check_accumulator("max_logits_acc", max_logits_acc, (hq,), dev)
    _forward_stage(args, out_acc, lse_acc, max_logits_acc)


def ffa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None = None,
    *,
    sink: torch.Tensor | None = None,
    sink_layout: str = "sh",
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    return_max_logits: bool = False,
    kv_ready: KVReady | tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The whole forward of one key set, sink included, without autograd.

    The same result as `flex_flash_attn_func`'s forward, for callers that run their own
    backward (magi-dist with a single stage): the kernel writes ``out`` in q's dtype directly,
    with no float32 accumulators to allocate, merge into and convert.

    Args: as `flex_flash_attn_func`, and
        kv_ready: `KVReady` ``(flag, value, first_row)`` (a 3-tuple is taken), or None: k and v
            rows ``first_row:`` may still be arriving when the call is issued (another stream,
            a copy engine or a peer GPU writes them); they are read only once the int32
            ``flag[0]`` holds ``value`` or more (acquire at system scope), the rows before them
            at once. The writer raises the word once the rows are complete (its values stay in
            ``[0, 2**31)``) and must need no SM for it: the waiting kernel may hold them all (a
            copy engine, a stream write). k and v must be read in place (dense rows a multiple
            of 16 bytes apart, 16-byte aligned): a copy would read the late rows early. The
            kernel waits in its load warp, each CTA at most once, at most about 69 s (then the
            launch ends with an error); the reference backend makes the stream wait, and its
            input checks then block the host until the flag holds (enqueue the writer first).

    Returns:
        ``(out, lse, max_logits)``: out ``(Tq, Hq, Dv)`` in q's dtype; lse ``(Tq, Hq)`` after sink
        and max_logits ``(Hq,)`` (or None) in float32, float64 for float64 inputs on the
        reference backend (the precision `ffa_backward_stage` then gets back).
    """
    args = validate_attn_args(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    sink = check_sink(sink, sink_layout, args.q)
    check_bool("return_max_logits", return_max_logits)
    ready = check_kv_ready(kv_ready, k, v)  # the caller's tensors: a copy would read rows early
    out, lse, max_logits = _forward_whole(args, sink, sink_layout, return_max_logits, ready)
    return out.to(args.q.dtype), lse, max_logits


def ffa_backward_stage(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None,
    dq_acc: torch.Tensor,
    dk_acc: torch.Tensor,
    dv_acc: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    heads_per_cta: int | None = None,
) -> None:
    """Add one stage's contribution to dq, dk, dv, in place.

    Args:
        dout: ``(Tq, Hq, Dv)`` gradient of the final output (any float dtype).
        q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap: as for
            `ffa_forward_stage` of the same stage.
        out: ``(Tq, Hq, Dv)`` FINAL output of the rows (all stages merged, sink applied).
        lse: ``(Tq, Hq)`` FINAL log-sum-exp of the rows (all stages, sink included).
        dq_acc: float32 ``(Tq, Hq, D)`` (float64 allowed), added to.
        dk_acc: float32 ``(Tk, Hk, D)``, dv_acc: float32 ``(Tk, Hk, Dv)`` (float64 allowed),
            added to.
        deterministic: bitwise the same additions run after run (as for
            `flex_flash_attn_func`).
        heads_per_cta: q heads one CTA of the CuTe kernel walks, a divisor of Hq / Hk (None: the
            kernel's rule for this call, `backward_heads_per_cta`); the reference backend
            computes the same sums whatever it is. For callers that split one key set into calls
            and want the launch shape of the whole (magi-dist's split backward).

    Because out and lse are the global ones, summing this over all stages gives exactly the
    gradient of the whole attention (the sink's own gradient is `sink_backward`).
    """
    args = validate_attn_args(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    tq, hq, d = args.q.shape
    tk, hk, _ = args.k.shape
    dv = args.v.shape[2]
    dev = args.q.device
    dout = check_float_tensor("dout", dout, (tq, hq, dv), dev)
    out = check_float_tensor("out", out, (tq, hq, dv), dev)
    lse = check_float_tensor("lse", lse, (tq, hq), dev)
    check_accumulator("dq_acc", dq_acc, (tq, hq, d), dev)
    check_accumulator("dk_acc", dk_acc, (tk, hk, d), dev)
    check_accumulator("dv_acc", dv_acc, (tk, hk, dv), dev)
    check_bool("deterministic", deterministic)
    heads_per_cta = check_heads_per_cta(heads_per_cta, hq, hk)
    _backward_stage(args, dout, out, lse, dq_acc, dk_acc, dv_acc, deterministic, heads_per_cta)


def backward_heads_per_cta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    deterministic: bool = False,
) -> int:
    """The q heads per CTA that `ffa_backward_stage` of these arguments launches with by the
    kernel's rule: a divisor of Hq / Hk, 1 where the reference backend would serve the call.

    Args: q ``(Tq, Hq, D)``, k ``(Tk, Hk, D)``, v ``(Tk, Hk, Dv)`` (only their shapes, dtypes and
    device are read), q_ranges / k_ranges int32 ``(N, 2)``, attn_type_map int32 ``(N,)`` or None,
    softmax_scale, softcap, deterministic: as for `ffa_backward_stage`. Plans the call (cached,
    as the call itself would) and launches nothing."""
    args = validate_attn_args(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    check_bool("deterministic", deterministic)
    cute = _backward_kernel(args.q.device, args.q.dtype)
    if cute is None:
        return 1
    try:
        return cute.cute_backward_heads_per_cta(
            args.q,
            args.k,
            args.v,
            args.q_ranges,
            args.k_ranges,
            args.attn_type_map,
            args.softcap,
            deterministic,
        )
    except NotImplementedError:
        return 1


def ffa_backward_prepare(
    dout: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> None:
    """Enqueue, on the current stream, the part of a backward that reads no K/V row: the
    per-row statistics of ``dout``, ``out`` and ``lse`` that every `ffa_backward_stage` call of
    this backward shares. Optional (a stage computes what it does not find): for callers whose
    K/V rows are still travelling, so that this runs meanwhile. The stage calls that follow reuse
    it when they get the very same ``dout``, ``out`` and ``lse`` objects, unchanged in place
    since, with q's dtype and ``softmax_scale`` as here, on the same stream, and no other
    backward ran between; ``dout`` must already be contiguous, 16-byte aligned and in q's dtype
    (else nothing is enqueued, as the stage would not find it). A no-op where the reference
    backend serves the backward.

    Args:
        dout, out: ``(Tq, Hq, Dv)``; lse: ``(Tq, Hq)``; q ``(Tq, Hq, D)``, v ``(Tk, Hk, Dv)``;
            softmax_scale, softcap: as for the `ffa_backward_stage` calls that follow.
    """
    q, v = check_token_tensor("q", q), check_token_tensor("v", v)
    tq, hq, _ = q.shape
    dev, dv = q.device, v.shape[2]
    check_float_tensor("dout", dout, (tq, hq, dv), dev)
    check_float_tensor("out", out, (tq, hq, dv), dev)
    check_float_tensor("lse", lse, (tq, hq), dev)
    cute = _backward_kernel(dev, q.dtype)
    if cute is None:
        return
    with contextlib.suppress(NotImplementedError):  # the stages fall back (and say so) themselves
        cute.cute_backward_prepare(q, v, dout, out, lse, softmax_scale=softmax_scale, softcap=softcap)


# ----------------------------------------------------------------------------- autograd


# ValidatedAttnArgs' fields after q, k, v, in order
_REST_FIELDS = tuple(f.name for f in dataclasses.fields(ValidatedAttnArgs))[3:]


class _FlexFlashAttn(torch.autograd.Function):
    """Autograd wrapper: differentiable in q, k, v and sink; lse and max_logits are not.

    Once differentiable: the backward is not itself differentiated (``create_graph=True`` then a
    second grad raises ``RuntimeError``)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, args, sink_layout, return_max_logits, deterministic):
        # What the operator (`_ops.py`) returns and saves too: out in q's dtype, lse in the
        # accumulator precision (float64 for float64 inputs).
        out, lse_acc, max_logits = _run_forward(args, sink, sink_layout, return_max_logits)
        lse = as_dtype(lse_acc, torch.float32)
        ctx.save_for_backward(q, k, v, sink, out, lse_acc)
        # q, k, v travel through save_for_backward only (version checks, freed after backward);
        # the rest of the validated arguments in field order (a tuple: dataclasses.replace costs
        # more than the checks of a call).
        ctx.rest = tuple(getattr(args, f) for f in _REST_FIELDS)
        ctx.sink_layout = sink_layout
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse, max_logits)
        # lse and max_logits take no gradient: autograd hands None instead of zero tensors
        ctx.set_materialize_grads(False)
        return out, lse, max_logits

    @staticmethod
    @once_differentiable("flex_flash_attn_func")  # a second grad raises instead of being wrong
    def backward(ctx, dout, _dlse, _dmax):
        q, k, v, sink, out, lse_acc = ctx.saved_tensors
        dq = dk = dv = dsink = None
        if dout is None:  # out's gradient is undefined (lse and max_logits take none): no grads
            return dq, dk, dv, dsink, None, None, None, None
        args = ValidatedAttnArgs(q, k, v, *ctx.rest)
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = _backward_whole(args, dout, out, lse_acc, ctx.deterministic)
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = sink_backward(sink, ctx.sink_layout, out, dout, lse_acc)
        return dq, dk, dv, dsink, None, None, None, None


def _autocast_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDPA's autocast policy: under ``torch.autocast(q's device type, dtype)``, floating q, k, v
    other than float64 are cast to the autocast dtype (differentiably: their gradients come back
    in their own dtype). The sink stays float32. A no-op outside autocast. Arguments that are not
    tensors pass through unchanged (the checks after it reject them with their messages)."""
    if not isinstance(q, torch.Tensor):
        return q, k, v
    kind = q.device.type
    if not _autocast_on(kind):
        return q, k, v
    dtype = torch.get_autocast_dtype(kind)

    def cast(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (dtype, torch.float64):
            return t.to(dtype)
        return t

    return cast(q), cast(k), cast(v)


def _mask_ranges(
    mask: object, q_ranges: object, k_ranges: object, attn_type_map: object, q: object, k: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The range tensors of ``mask=``, after checking that it fits the call (metadata only)."""
    if not isinstance(mask, FlexMask):
        raise TypeError(f"mask must be a ffa_kernels.FlexMask, got {type(mask).__name__}")
    if q_ranges is not None or k_ranges is not None or attn_type_map is not None:
        raise ValueError("pass either mask= or q_ranges / k_ranges / attn_type_map, not both")
    for name, t, total in (("q", q, mask.total_q), ("k", k, mask.total_k)):
        if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] != total:
            raise ValueError(
                f"mask was built for total_{name}={total}, but {name} has {t.shape[0]} tokens "
                f"(shape {tuple(t.shape)})"
            )
    if isinstance(q, torch.Tensor) and mask.q_ranges.device != q.device:
        raise ValueError(
            f"mask is on {mask.q_ranges.device}, q on {q.device}: move the mask once with mask.to(q.device)"
        )
    return mask.q_ranges, mask.k_ranges, mask.attn_type_map


def _traced(q: object) -> bool:
    """Whether this call is being traced (torch.compile / export) or runs on meta or fake
    tensors: then it goes through the operator, which checks the range values when it runs."""
    return torch.compiler.is_compiling() or (
        isinstance(q, torch.Tensor) and (q.is_meta or isinstance(q, FakeTensor))
    )


def flex_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor | None = None,
    k_ranges: torch.Tensor | None = None,
    attn_type_map: torch.Tensor | None = None,
    *,
    mask: FlexMask | None = None,
    sink: torch.Tensor | None = None,
    sink_layout: str = "sh",
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, AttnForwardMeta]:
    """Flexible-mask attention over a union of slices (docs/api.md), differentiable in q, k, v, sink.

    Args:
        q: ``(Tq, Hq, D)``; k: ``(Tk, Hk, D)``, v: ``(Tk, Hk, Dv)`` (Dv may differ from D, e.g. MLA's 192 / 128); float16/bfloat16/float32/float64 (the
            reference backend computes in float32, float64 for float64 inputs); ``Hq % Hk == 0``,
            q head h uses kv head ``h // (Hq // Hk)``. Under ``torch.autocast`` float32 (and
            float16/bfloat16) q, k, v are cast to the autocast dtype, as for SDPA.
        q_ranges, k_ranges: int32 ``(N, 2)`` half-open ``[start, end)`` ranges, on q's device
            (CPU is accepted too).
        attn_type_map: int32 ``(N,)`` codes FULL=0, CAUSAL=1, INVCAUSAL=2, BICAUSAL=3; None = all
            FULL. The slices must not cover a cell twice (not checked: it would cost an area pass).
        mask: a `FlexMask` (``FlexMask.from_ranges(...)``, checked once) instead of the three range
            arguments: no host copy or sync per call, in eager mode and under torch.compile.
        sink: float32 ``(S_sink, Hq)`` for ``sink_layout="sh"`` or ``(Tq, S_sink, Hq)`` for
            ``"ssh"``: extra logits in every row's softmax that add no output.
        softmax_scale: None means ``D ** -0.5``.
        softcap: when > 0 the logits are ``softcap * tanh(softmax_scale * q.k / softcap)``.
        deterministic: bitwise reproducible gradients. The reference backend always is; the
            CuTe backward then adds the partial dQ of each q block, and the partial dK/dV of
            the CTAs that share a K/V head, in a fixed order (semaphores).
        return_max_logits: also return ``meta.max_logits``.

    Returns:
        ``(out, meta)``: out ``(Tq, Hq, Dv)`` in q's dtype (0 for a row nothing covers);
        meta = `AttnForwardMeta` with lse float32 ``(Tq, Hq)`` (after sink; ``-inf`` for a row with
        neither a covered cell nor a sink) and max_logits float32 ``(Hq,)`` (max over covered
        cells of ``softmax_scale * q.k`` before softcap, ``-inf`` for a head with none) or None.

    Raises:
        TypeError / ValueError: invalid arguments, before any compute (the message names the
            argument and the value seen). Under torch.compile the range values (bounds, codes)
            are checked by the operator when the compiled graph runs, raising the same errors.

    Non-finite K/V: the reference backend never lets a NaN or inf in K or V reach a row that
    does not see its key (out, lse and dq of such rows, and dk/dv of keys only they see, are
    what a finite value would give). The CuTe GPU kernel keeps FlashAttention-4's behaviour: a
    NaN/inf in K or V inside a partially masked tile can reach the rows of that tile that do
    not see the key (0 x NaN in P @ V).

    torch.compile: traced with no graph break (``fullgraph=True``) into one operator per
    direction (``torch.ops.ffa_kernels.flex_flash_attn_forward`` / ``_backward``); range tensors
    whose values change between steps (same N) cause no recompile.
    """
    if mask is not None:
        q_ranges, k_ranges, attn_type_map = _mask_ranges(mask, q_ranges, k_ranges, attn_type_map, q, k)
    traced = _traced(q)
    if traced or torch._C._is_any_autocast_enabled():  # eager: skip the per-device test (~2 us)
        q, k, v = _autocast_inputs(q, k, v)
    if traced:
        # Metadata checks only (traceable); the operator checks the range values when it runs.
        q, k, v, qr, kr, tm, scale, cap = check_attn_metadata(
            q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap
        )
        sink = check_sink(sink, sink_layout, q)
        check_bool("deterministic", deterministic)
        check_bool("return_max_logits", return_max_logits)
        out, lse, max_logits = torch.ops.ffa_kernels.flex_flash_attn_forward(
            q, k, v, qr, kr, tm, sink, sink_layout, scale, cap, return_max_logits, deterministic
        )
        lse = lse.to(torch.float32)
    else:
        args = validate_attn_args(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
        sink = check_sink(sink, sink_layout, args.q)
        check_bool("deterministic", deterministic)
        check_bool("return_max_logits", return_max_logits)
        out, lse, max_logits = _FlexFlashAttn.apply(
            args.q, args.k, args.v, sink, args, sink_layout, return_max_logits, deterministic
        )
    return out, AttnForwardMeta(lse=lse, max_logits=max_logits if return_max_logits else None)
