"""calc_attn: context-parallel attention over dispatched q/k/v, stage by stage.

Forward: the host stage computes on local K/V while stage 0's remote K/V is group-cast; each
remote stage's K/V is prefetched while the previous stage computes; partials merge by log-sum-exp
in float32. Backward: reuses the saved out/lse, re-casts each stage's K/V, computes dq locally and
group-reduces each stage's partial dK/dV to their owners while the next stage computes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ffa_kernels import AttnForwardMeta, apply_sink, ffa_backward_stage, ffa_forward_stage, sink_backward
from magi_comm import group_cast, group_reduce
from magi_dist.key import DistAttnRuntimeKey, get_runtime
from magi_dist.runtime import DistAttnRuntime, StageTensors

ENV_DSINK_REDUCE = "MAGI_DIST_DSINK_REDUCE"
_DSINK_OPS = ("none", "sum", "avg")


def _start_cast(rt: DistAttnRuntime, kv: torch.Tensor, stage: int):
    """Begin receiving stage ``stage``'s remote K/V; ``kv`` is ``[K; V]`` stacked along rows
    ``(2*T, Hk, D)``, and so is the returned buffer ``(2*R, Hk, D)``: both halves stay contiguous,
    so no stage copies K or V apart. Returns ``(work, buffer)``."""
    a = rt.kv_cast_args(stage)
    buf = kv.new_empty((a.num_recv_tokens, *kv.shape[1:]))
    work = group_cast(
        kv,
        buf,
        a.input_split_sizes,
        a.output_split_sizes,
        a.dst_indices,
        a.src_index,
        rt.group,
        async_op=True,
    )
    return work, buf


def _start_reduce(rt: DistAttnRuntime, partial: torch.Tensor, out: torch.Tensor, stage: int):
    """Begin summing stage ``stage``'s partial ``[dK; dV]`` rows into their owners' ``out``."""
    a = rt.kv_reduce_args(stage)
    return group_reduce(
        partial,
        out,
        a.input_split_sizes,
        a.output_split_sizes,
        a.dst_index,
        a.src_indices,
        rt.group,
        async_op=True,
        reduce_op="sum",
        acc_reduce=True,
    )


def _halves(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = kv.shape[0] // 2
    return kv[:n], kv[n:]


def _fwd_stage(q, k, v, st: StageTensors, out, lse, ml, scale, softcap) -> None:
    if st.empty:
        return
    ffa_forward_stage(
        q,
        k,
        v,
        st.q_ranges,
        st.k_ranges,
        st.attn_types,
        out,
        lse,
        softmax_scale=scale,
        softcap=softcap,
        max_logits_acc=ml,
    )


def _bwd_stage(dout, q, k, v, out, lse, st: StageTensors, dq, dk, dv, scale, softcap) -> None:
    if st.empty:
        return
    ffa_backward_stage(
        dout,
        q,
        k,
        v,
        out,
        lse,
        st.q_ranges,
        st.k_ranges,
        st.attn_types,
        dq,
        dk,
        dv,
        softmax_scale=scale,
        softcap=softcap,
    )


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulators are float32, float64 for float64 inputs (the CPU reference path): the
    ``compute_dtype`` of ffa_kernels' validated arguments, which the stage calls accumulate in."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _forward(rt: DistAttnRuntime, q, k, v, sink, sink_layout, scale, softcap, want_max):
    tq, hq, d = q.shape
    dev = q.device
    acc = _acc_dtype(q)
    out = torch.zeros((tq, hq, d), dtype=acc, device=dev)
    lse = torch.full((tq, hq), float("-inf"), dtype=acc, device=dev)
    ml = torch.full((hq,), float("-inf"), dtype=acc, device=dev) if want_max else None
    n = len(rt.cast_args)
    remote = rt.remote_tensors(dev)
    kv = torch.cat([k, v]) if n else None
    pending = _start_cast(rt, kv, 0) if n else None
    if rt.me.calc.kv_concat:
        work, buf = pending
        work.wait()
        kb, vb = _halves(buf)
        _fwd_stage(q, torch.cat([k, kb]), torch.cat([v, vb]), remote[0], out, lse, ml, scale, softcap)
    else:
        _fwd_stage(q, k, v, rt.host_tensors(dev), out, lse, ml, scale, softcap)
        for t in range(n):
            work, buf = pending
            work.wait()
            pending = _start_cast(rt, kv, t + 1) if t + 1 < n else None
            _fwd_stage(q, *_halves(buf), remote[t], out, lse, ml, scale, softcap)
    apply_sink(out, lse, sink, sink_layout)
    if ml is not None:
        red = ml.to(rt.comm_device())
        dist.all_reduce(red, op=dist.ReduceOp.MAX, group=rt.group)
        ml = red.to(dev)
    return out.to(q.dtype), lse, None if ml is None else ml.float()


def _backward(rt: DistAttnRuntime, dout, q, k, v, out, lse, scale, softcap):
    tk, hk, d = k.shape
    dev = q.device
    f32 = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=f32, device=dev)
    n = len(rt.cast_args)
    remote = rt.remote_tensors(dev)
    kv = torch.cat([k, v]) if n else None
    # owners' sums of the remote [dK; dV] (only when there are remote stages)
    dkv_remote = torch.zeros((2 * tk, hk, d), dtype=f32, device=dev) if n else None
    reduces = []
    pending = _start_cast(rt, kv, 0) if n else None
    if rt.me.calc.kv_concat:
        work, buf = pending
        work.wait()
        kb, vb = _halves(buf)
        rows = tk + kb.shape[0]
        dk_all = torch.zeros((rows, hk, d), dtype=f32, device=dev)
        dv_all = torch.zeros((rows, hk, d), dtype=f32, device=dev)
        _bwd_stage(
            dout,
            q,
            torch.cat([k, kb]),
            torch.cat([v, vb]),
            out,
            lse,
            remote[0],
            dq,
            dk_all,
            dv_all,
            scale,
            softcap,
        )
        dk, dv = dk_all[:tk], dv_all[:tk]  # the local rows' gradients, summed in place below
        reduces.append(_start_reduce(rt, torch.cat([dk_all[tk:], dv_all[tk:]]), dkv_remote, 0))
    else:
        dk = torch.zeros((tk, hk, d), dtype=f32, device=dev)
        dv = torch.zeros((tk, hk, d), dtype=f32, device=dev)
        _bwd_stage(dout, q, k, v, out, lse, rt.host_tensors(dev), dq, dk, dv, scale, softcap)
        for t in range(n):
            work, buf = pending
            work.wait()
            pending = _start_cast(rt, kv, t + 1) if t + 1 < n else None
            dkv_t = torch.zeros(buf.shape, dtype=f32, device=dev)  # [dK; dV] of the stage buffer
            _bwd_stage(dout, q, *_halves(buf), out, lse, remote[t], dq, *_halves(dkv_t), scale, softcap)
            reduces.append(_start_reduce(rt, dkv_t, dkv_remote, t))
    if n:
        for w in reduces:  # fixed order: the float32 sums are deterministic
            w.wait()
        dk += dkv_remote[:tk]
        dv += dkv_remote[tk:]
    return dq, dk, dv


def _reduce_dsink(dsink: torch.Tensor, rt: DistAttnRuntime) -> torch.Tensor:
    op = os.environ.get(ENV_DSINK_REDUCE, "none").lower()
    if op not in _DSINK_OPS:
        raise ValueError(f"{ENV_DSINK_REDUCE}: expected one of {_DSINK_OPS}, got {op!r}")
    if op == "none":
        return dsink
    red = dsink.to(rt.comm_device())
    dist.all_reduce(red, op=dist.ReduceOp.SUM, group=rt.group)
    if op == "avg":
        red /= rt.plan.cp_size
    return red.to(dsink.device)


class _DistAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, rt, sink_layout, scale, softcap, want_max):
        out, lse, ml = _forward(rt, q, k, v, sink, sink_layout, scale, softcap, want_max)
        ctx.save_for_backward(q, k, v, out, lse, sink)  # lse in accumulator precision
        ctx.rt, ctx.sink_layout, ctx.scale, ctx.softcap = rt, sink_layout, scale, softcap
        lse = lse.float()
        ctx.mark_non_differentiable(lse)
        if ml is not None:
            ctx.mark_non_differentiable(ml)
        return out, lse, ml

    @staticmethod
    def backward(ctx, dout, _dlse, _dml):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _backward(ctx.rt, dout, q, k, v, out, lse, ctx.scale, ctx.softcap)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = sink_backward(sink, ctx.sink_layout, out, dout, lse)
            if ctx.sink_layout == "sh":
                dsink = _reduce_dsink(dsink, ctx.rt)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None, None, None, None


def _check_local(name: str, x: object, rows: int, heads: int, d: int, total: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 3 and x.shape[0] == total and total != rows:
        raise ValueError(
            f"{name}: has {total} rows, the global length; calc_attn takes dispatched tensors "
            f"({rows} local rows): use dispatch({name}, key)"
        )
    if tuple(x.shape) != (rows, heads, d):
        raise ValueError(f"{name}: expected shape {(rows, heads, d)} for this key, got {tuple(x.shape)}")
    return x


def calc_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: DistAttnRuntimeKey,
    sink: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, AttnForwardMeta]:
    """Context-parallel attention of this rank's rows.

    Args:
        q: ``(shard_seqlen, Hq, D)``; k, v: ``(shard_seqlen, Hk, D)``: outputs of :func:`dispatch`.
        key: from ``magi_attn_flex_key`` / ``magi_attn_varlen_key`` over the same group.
        sink: float32 ``(S_sink, Hq)`` (shared by all rows; its gradient is reduced over the group as
            ``MAGI_DIST_DSINK_REDUCE`` = none|sum|avg says, default none) or ``(shard_seqlen, S_sink, Hq)``
            (per local row, dispatched).
        softmax_scale: None means ``D ** -0.5``. softcap: tanh soft-capping of logits when > 0.
        return_max_logits: also return the global per-head max of ``softmax_scale * q.k``.
    Returns:
        ``(local_out, AttnForwardMeta(lse, max_logits))``: out ``(shard_seqlen, Hq, D)`` in q's
        dtype, lse float32 ``(shard_seqlen, Hq)`` (local rows), max_logits float32 ``(Hq,)`` equal on
        every rank, or None.
    """
    rt = get_runtime(key)
    rows, total = rt.shard_seqlen, rt.plan.total_seqlen
    q = _check_local("q", q, rows, key.num_heads_q, key.head_dim, total)
    k = _check_local("k", k, rows, key.num_heads_kv, key.head_dim, total)
    v = _check_local("v", v, rows, key.num_heads_kv, key.head_dim, total)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: devices differ: {q.device}, {k.device}, {v.device}")
    sink_layout = "sh"
    if sink is not None:
        if not isinstance(sink, torch.Tensor):
            raise TypeError(f"sink: expected a torch.Tensor, got {type(sink).__name__}")
        if sink.dim() == 3:
            sink_layout = "ssh"
            if sink.shape[0] != rows or sink.shape[2] != key.num_heads_q:
                raise ValueError(
                    f"sink: expected (shard_seqlen={rows}, S_sink, Hq={key.num_heads_q}), got {tuple(sink.shape)}"
                )
        elif sink.dim() != 2 or sink.shape[1] != key.num_heads_q:
            raise ValueError(f"sink: expected (S_sink, Hq={key.num_heads_q}), got {tuple(sink.shape)}")
        if sink.device != q.device:
            raise ValueError(f"sink: must be on q's device {q.device}, got {sink.device}")
    scale = key.head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    softcap = float(softcap)
    if softcap < 0:
        raise ValueError(f"softcap: must be >= 0, got {softcap}")
    out, lse, ml = _DistAttnFunc.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        sink,
        rt,
        sink_layout,
        scale,
        softcap,
        bool(return_max_logits),
    )
    return out, AttnForwardMeta(lse=lse, max_logits=ml)
