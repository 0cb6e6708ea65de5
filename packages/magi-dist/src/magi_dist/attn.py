"""calc_attn: context-parallel attention over dispatched q/k/v, stage by stage.

Forward: the host stage computes on local K/V while stage 0's remote K/V is group-cast; each
remote stage's K/V is prefetched while the previous stage computes; partials merge by log-sum-exp
in float32. A rank whose rows see one key set (overlap degree 0: all remote K/V first, then one
call over ``[local; remote]``) makes one plain kernel call, sink included. Backward: reuses the
saved out/lse, re-casts each stage's K/V, computes dq locally and group-reduces each stage's
partial dK/dV to their owners while the next stage computes. With ``MAGI_DIST_KEEP_KV=1`` (the
same on every rank) the degree-0 forward keeps its ``[local; remote]`` K/V rows for the backward,
which then casts nothing: one collective less per step, for the memory of those rows. With
``MAGI_DIST_BWD_SPLIT=1`` (the default from cp 4 on) the degree-0 backward computes the remote
keys' part first, starts their dK/dV reduce, and computes the local keys' part while it travels
(two kernel calls instead of one; the same collectives; ``MAGI_DIST_BWD_SPLIT_HEADS``: their
q heads per CTA). ``MAGI_DIST_FWD_SPLIT=1`` (opt-in) does the same to the degree-0 forward: the local keys' kernel while the remote K/V rows travel.
``MAGI_DIST_BWD_LOW_PRECISION_REDUCE=1`` (opt-in, the same on every rank) reduces the partial
dK/dV in the inputs' dtype instead of float32, as MagiAttention does by default: half the bytes,
each partial and the owner's sum of them per stage rounded to that dtype.

K and V travel as one packed row per token, ``(T, Hk * D + Hk * Dv)``: the token's K heads, then
its V heads; the kernels read the two halves in place (``_split``), so received rows are never
copied apart. With ``Dv == D`` the memory is that of a ``(T, 2, Hk, D)`` tensor.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ffa_kernels import (
    AttnForwardMeta,
    accumulator_dtype,
    apply_sink,
    backward_heads_per_cta,
    ffa_backward_prepare,
    ffa_backward_stage,
    ffa_forward,
    ffa_forward_stage,
    forward_accumulators,
    once_differentiable,
    sink_backward,
    validate_attn_inputs,
)
from magi_comm import group_cast, group_reduce
from magi_dist.fingerprint import check_key
from magi_dist.key import DistAttnRuntimeKey
from magi_dist.partials import Partials
from magi_dist.runtime import DistAttnRuntime, StageTensors, get_runtime

ENV_DSINK_REDUCE = "MAGI_DIST_DSINK_REDUCE"
_DSINK_OPS = ("none", "sum", "avg")
ENV_KEEP_KV = "MAGI_DIST_KEEP_KV"
ENV_BWD_SPLIT = "MAGI_DIST_BWD_SPLIT"
ENV_BWD_SPLIT_HEADS = "MAGI_DIST_BWD_SPLIT_HEADS"
ENV_FWD_SPLIT = "MAGI_DIST_FWD_SPLIT"
ENV_BWD_LOW_PRECISION_REDUCE = "MAGI_DIST_BWD_LOW_PRECISION_REDUCE"


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """``$name`` (stripped, lower case; ``default`` when unset or empty), one of ``choices``."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices} (or unset: {default}), got {value!r}")
    return value


def _flag(name: str, default: bool = False) -> bool:
    return _env_choice(name, ("0", "1"), "1" if default else "0") == "1"


def dsink_reduce() -> str:
    """``$MAGI_DIST_DSINK_REDUCE``: how the sink's gradient is combined over the ranks, ``none``
    (each rank keeps its rows' share; the default), ``sum`` or ``avg``."""
    return _env_choice(ENV_DSINK_REDUCE, _DSINK_OPS, "none")


# cp sizes from which the degree-0 backward is split by default: cp 4 varlen causal / full 64k
# step +1% / +14% with it (one run, 4x H100); cp 2 (2x H100, two alternating runs, with the
# reserved reduce buffer) -3.7% on varlen causal 64k, +2.0% on 128k, within 1.3% elsewhere
# (docs/perf.md)
BWD_SPLIT_MIN_CP = 4


def bwd_split(cp_size: int) -> bool:
    """``$MAGI_DIST_BWD_SPLIT`` (read at each backward; ranks may differ, as it changes no
    collective): ``1`` splits the degree-0 backward by keys so that the remote rows' dK/dV
    reduce overlaps the local keys' kernel; unset: split from ``BWD_SPLIT_MIN_CP`` ranks on,
    where the reduce moves more of a step than at cp 2."""
    return _flag(ENV_BWD_SPLIT, default=cp_size >= BWD_SPLIT_MIN_CP)


def bwd_split_heads() -> str | int:
    """``$MAGI_DIST_BWD_SPLIT_HEADS`` (read and checked at each backward, used where it is split):
    the q heads per CTA of the split backward's two kernel calls. ``stage`` (or unset): both
    calls the whole stage's (`ffa_kernels.backward_heads_per_cta`; at cp 4 the step 1.6-3.6%
    faster on varlen causal than ``auto``, docs/perf.md "The split backward's calls at the
    stage's heads per CTA"); ``auto``: each call's own by the kernel's rule, which gives the
    smaller calls fewer than the whole stage; a positive integer: that many (it must divide
    Hq / Hk)."""
    raw = os.environ.get(ENV_BWD_SPLIT_HEADS, "").strip().lower() or "stage"
    if raw in ("auto", "stage"):
        return raw
    if raw.isascii() and raw.isdigit() and int(raw) > 0:
        return int(raw)
    raise ValueError(f"{ENV_BWD_SPLIT_HEADS}: expected auto, stage or a positive integer, got {raw!r}")


def fwd_split() -> bool:
    """``$MAGI_DIST_FWD_SPLIT`` (read at each forward; ranks may differ, as it changes no
    collective): ``1`` splits the degree-0 forward by keys, the local keys' kernel running while
    the remote K/V rows travel, the remote keys' after them, merged in float32 accumulators;
    ``0`` or unset: one call over ``[local; remote]`` once they have arrived (opt-in: the
    float32 pass over the output cost more than the cast it hides, -0.5 to -4.9% per step at
    cp 2 and cp 4 on H100s; docs/perf.md)."""
    return _flag(ENV_FWD_SPLIT)


def bwd_reduce_dtype(acc_dtype: torch.dtype, input_dtype: torch.dtype) -> torch.dtype:
    """The dtype the backward's partial [dK, dV] rows travel and are summed in:
    ``$MAGI_DIST_BWD_LOW_PRECISION_REDUCE`` = ``1``: ``input_dtype`` (bf16 / fp16 inputs: half
    the bytes of float32; each partial is rounded to it before it travels, and the owner's sum
    of the remote partials after each reduce, i.e. once per stage; the owner's own rows stay in
    ``acc_dtype`` until the final sum; the symmetric partials pool is not used); ``0`` or
    unset: ``acc_dtype``. Read at each backward, before its first collective; it must be the
    same on every rank (the reduce's rows are typed alike)."""
    return input_dtype if _flag(ENV_BWD_LOW_PRECISION_REDUCE) else acc_dtype


def keep_kv() -> bool:
    """``$MAGI_DIST_KEEP_KV`` (read at each forward, a forward recomputed by activation
    checkpointing too; it must be the same on every rank, as the backward's collectives follow it): ``1`` keeps the degree-0 forward's gathered K/V rows for the
    backward, ``0`` or unset casts them again there."""
    return _flag(ENV_KEEP_KV)


def _row_width(k: torch.Tensor, v: torch.Tensor) -> int:
    """Elements of one packed K/V row (`_pack`): ``Hk * D + Hk * Dv``."""
    return k.shape[1] * (k.shape[2] + v.shape[2])


def _pack(k: torch.Tensor, v: torch.Tensor, extra_rows: int = 0) -> torch.Tensor:
    """Each token's K and V rows side by side, ``(T + extra_rows, Hk * D + Hk * Dv)``, the first T
    rows filled: one row per token is what the group-cast moves, and the kernels read the halves
    in place (``_split``: packed K/V)."""
    t = k.shape[0]
    kv = k.new_empty((t + extra_rows, _row_width(k, v)))
    # one copy kernel for both halves: 97 us against 172 for two strided copies ((32k, 8, 128) bf16,
    # H100). An out= call: not differentiable, as none is needed (called where autograd records
    # nothing: the autograd Function's forward and backward)
    torch.cat((k.flatten(1), v.flatten(1)), dim=1, out=kv[:t])
    return kv


def _split(kv: torch.Tensor, hk: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(R, Hk, D)`` and ``(R, Hk, Dv)`` of the K and V halves of packed rows ``kv``."""
    return kv[:, : hk * d].unflatten(1, (hk, d)), kv[:, hk * d :].unflatten(1, (hk, -1))


def _start_cast(rt: DistAttnRuntime, kv: torch.Tensor, stage: int, buf: torch.Tensor | None = None):
    """Begin receiving stage ``stage``'s remote K/V rows of packed ``kv`` ``(T, W)`` into ``buf``
    (a new ``(R, W)`` tensor when None). Returns ``(work, buf)``."""
    a = rt.cast_args[stage]
    if buf is None:
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
    """Begin summing stage ``stage``'s partial ``[dK, dV]`` rows into their owners' ``out``,
    cast first to ``out``'s dtype where it differs (`bwd_reduce_dtype`; the cast copy need not
    outlive the call: group_reduce holds what its transfer still reads)."""
    a = rt.kv_reduce_args(stage)
    return group_reduce(
        partial.to(out.dtype),
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


def _concat_kv(rt: DistAttnRuntime, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Degree 0: ``[local; remote]`` K/V rows in one packed ``(T + R, W)`` tensor, the
    remote rows cast straight into its tail (waited for)."""
    kv, work = _start_concat_kv(rt, k, v)
    work.wait()
    return kv


def _start_concat_kv(rt: DistAttnRuntime, k: torch.Tensor, v: torch.Tensor):
    """`_concat_kv` without the wait: ``(kv, work)``, the remote rows still travelling into
    ``kv[T:]`` until ``work.wait()``."""
    t = k.shape[0]
    kv = _pack(k, v, rt.cast_args[0].num_recv_tokens)
    work, _ = _start_cast(rt, kv[:t], 0, kv[t:])
    return kv, work


def _split_concat_forward(rt: DistAttnRuntime, q, k, v, sink, sink_layout, scale, softcap, want_max):
    """Degree 0 split by keys (`fwd_split`): ``(kv, (out, lse, max_logits))`` with ``kv`` the
    packed ``[local; remote]`` rows, as `_concat_kv` gives them. The local keys' part runs on the
    local rows alone (``kv[:T]``: no kernel reads a row the cast is writing) while the remote
    rows arrive, the remote keys' part over the whole buffer after them; the sink once at the end."""
    t, hk, d = k.shape
    kv, work = _start_concat_kv(rt, k, v)
    parts = rt.concat_parts(q.device)
    assert parts is not None  # a degree-0 rank with remote keys has its concatenated stage
    local, remote = parts
    out, lse, ml = forward_accumulators(q, max_logits=want_max, head_dim_v=v.shape[2])
    _fwd_stage(q, *_split(kv[:t], hk, d), local, out, lse, ml, scale, softcap)
    work.wait()
    _fwd_stage(q, *_split(kv, hk, d), remote, out, lse, ml, scale, softcap)
    apply_sink(out, lse, sink, sink_layout)
    return kv, (out.to(q.dtype), lse, ml)


def _fwd_stage(q, k, v, st: StageTensors, out, lse, ml, scale, softcap) -> None:
    if st.empty:
        return
    assert st.q_ranges is not None and st.k_ranges is not None  # a non-empty stage has its ranges
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


def _bwd_stage(
    dout, q, k, v, out, lse, st: StageTensors, dq, dk, dv, scale, softcap, det=False, heads_per_cta=None
) -> None:
    if st.empty:
        return
    assert st.q_ranges is not None and st.k_ranges is not None  # a non-empty stage has its ranges
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
        deterministic=det,
        heads_per_cta=heads_per_cta,
    )


def _single_stage(q, k, v, st: StageTensors, sink, sink_layout, scale, softcap, want_max):
    """The forward of a rank whose rows see one key set (degree 0, or no remote keys): one
    kernel call with the sink inside, output written in q's dtype (no float32 accumulators)."""
    assert st.q_ranges is not None and st.k_ranges is not None  # callers pass a non-empty stage
    return ffa_forward(
        q,
        k,
        v,
        st.q_ranges,
        st.k_ranges,
        st.attn_types,
        sink=sink,
        sink_layout=sink_layout,
        softmax_scale=scale,
        softcap=softcap,
        return_max_logits=want_max,
    )


def _staged(rt: DistAttnRuntime, q, k, v, sink, sink_layout, scale, softcap, want_max):
    """Host stage on local K/V, then each remote stage as its K/V arrive (the next one
    prefetched meanwhile), merged into float32 accumulators; the sink is applied once at the end."""
    dev = q.device
    out, lse, ml = forward_accumulators(q, max_logits=want_max, head_dim_v=v.shape[2])
    n = len(rt.cast_args)
    remote = rt.remote_tensors(dev)
    kv = _pack(k, v) if n else None
    pending = _start_cast(rt, kv, 0) if kv is not None else None
    _fwd_stage(q, k, v, rt.host_tensors(dev), out, lse, ml, scale, softcap)
    for t in range(n):
        assert kv is not None and pending is not None  # n > 0: packed, and stage t's cast started
        work, buf = pending
        work.wait()
        pending = _start_cast(rt, kv, t + 1) if t + 1 < n else None
        _fwd_stage(q, *_split(buf, *k.shape[1:]), remote[t], out, lse, ml, scale, softcap)
    apply_sink(out, lse, sink, sink_layout)
    return out.to(q.dtype), lse, ml


def _forward(rt: DistAttnRuntime, q, k, v, sink, sink_layout, scale, softcap, want_max):
    """``(out, lse, max_logits, kv)``: ``kv`` the degree-0 call's packed ``[local; remote]``
    K/V rows (None on the other paths), which the backward may reuse."""
    split = fwd_split()  # read (and a bad value raised) on every rank before any collective
    dev = q.device
    single = (sink, sink_layout, scale, softcap, want_max)
    remote = rt.remote_tensors(dev)[0] if rt.me.calc.kv_concat else None
    kv = None
    if remote is not None and not remote.empty:
        if split:
            kv, (out, lse, ml) = _split_concat_forward(rt, q, k, v, *single)
        else:
            kv = _concat_kv(rt, k, v)
            out, lse, ml = _single_stage(q, *_split(kv, *k.shape[1:]), remote, *single)
    elif not rt.cast_args and not (host := rt.host_tensors(dev)).empty:
        out, lse, ml = _single_stage(q, k, v, host, *single)
    else:
        # several stages, or nothing to compute (then every row is the sink's alone)
        out, lse, ml = _staged(rt, q, k, v, *single)
    if ml is not None:
        red = ml.to(rt.comm_device())
        dist.all_reduce(red, op=dist.ReduceOp.MAX, group=rt.group)
        ml = red.to(dev)
    return out, lse, None if ml is None else ml.float(), kv


def _backward(rt: DistAttnRuntime, dout, q, k, v, out, lse, scale, softcap, det, kept=None, grad_dtype=None):
    """dq, dk, dv (``grad_dtype``, default the accumulators' dtype, float32 for 16-bit inputs)
    of this rank's rows: the stages' kernels (``det``: each bitwise
    repeatable) and the reduction of the remote rows' [dK, dV] to their owners.

    The partial [dK, dV] buffers (packed rows like the K/V they belong to) come from
    ``Partials`` (``magi_dist.partials``): symmetric outputs of the group's collective where its
    backend has them (native: the owners read the rows in place), else plain zeros; taken
    before the call's first collective.

    ``kept``: None (degree 0 casts the K/V rows again), or the forward's packed ``[local; remote]``
    K/V rows (`keep_kv`; an empty tensor on a rank whose forward had none: it computes nothing
    here, and casts nothing either, as no rank does then). ``grad_dtype``: the local rows' dK/dV
    sums with their owners' are written in it directly, one rounding of the same float32 sums,
    no float32 total and cast after it."""
    split = bwd_split(rt.plan.cp_size)  # read (and a bad value raised) before any collective
    # read and checked on every rank whatever its split (ranks may differ there): a bad value
    # raises everywhere before the first collective
    heads = bwd_split_heads()
    if isinstance(heads, int) and (q.shape[1] // k.shape[1]) % heads:
        raise ValueError(
            f"{ENV_BWD_SPLIT_HEADS}: must divide Hq / Hk = {q.shape[1] // k.shape[1]}, got {heads}"
        )
    tk, hk, d = k.shape
    dev = q.device
    f32 = accumulator_dtype(q.dtype)
    gdt = grad_dtype or f32
    n = len(rt.cast_args)
    common = (dout, q, out, lse, scale, softcap, det)
    if not n:
        dq = torch.zeros(q.shape, dtype=f32, device=dev)
        dk = torch.zeros(k.shape, dtype=f32, device=dev)
        dv = torch.zeros(v.shape, dtype=f32, device=dev)
        _bwd_stage(dout, q, k, v, out, lse, rt.host_tensors(dev), dq, dk, dv, scale, softcap, det)
        return dq.to(gdt), dk.to(gdt), dv.to(gdt)
    width = _row_width(k, v)
    red_dtype = bwd_reduce_dtype(f32, q.dtype)  # read before Partials.take's collectives
    parts = Partials.take(rt, (width,), f32, dev, reduce_dtype=red_dtype)
    dkv_remote: torch.Tensor | None  # owners' sums of the remote [dK, dV] rows, where kept apart
    if rt.me.calc.kv_concat:
        dq, dkv, reduces, dkv_remote = _backward_concat(
            rt, parts, k, v, common, red_dtype, kept, split, heads
        )
    else:
        dkv_remote = torch.zeros((tk, width), dtype=red_dtype, device=dev)
        dq, dk, dv, reduces = _backward_staged(rt, parts, k, v, dkv_remote, common)
    dq = dq.to(gdt)  # while the reduces travel: dq needs none of them
    for w in reduces:  # fixed order: the float32 sums are deterministic
        w.wait()
    if rt.me.calc.kv_concat:
        dk, dv = _split(dkv[:tk], hk, d)  # the local rows' own gradients (maybe in the pool)
    # None: the owners' sums were added into the local rows by the reduce
    remote_dk, remote_dv = (None, None) if dkv_remote is None else _split(dkv_remote, hk, d)
    # fresh tensors, never the pooled buffer (the next call overwrites it)
    dk, dv = _fresh(dk, remote_dk, gdt), _fresh(dv, remote_dv, gdt)
    parts.done()  # every reduce waited and the pooled rows read: the next call may reuse them
    return dq, dk, dv


def _fresh(a: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``a`` (float32, or the accumulators' dtype), plus ``b`` where given, written into a new
    contiguous tensor of ``dtype``: the gradient's final sum (or copy) and its cast in one pass."""
    out = torch.empty(a.shape, dtype=dtype, device=a.device)
    return out.copy_(a) if b is None else torch.add(a, b, out=out)


def _backward_concat(
    rt: DistAttnRuntime,
    parts: Partials,
    k,
    v,
    common,
    red_dtype: torch.dtype,
    kept=None,
    split: bool = False,
    heads: str | int = "stage",
):
    """Degree 0: one call over ``[local; remote]`` K/V into one ``[dK, dV]`` buffer whose remote
    tail is reduced to its owners. Returns ``(dq, dkv, works, dkv_remote)``: dq in the
    accumulators' dtype, the buffer, the reduce's work, and where the owners' sums of this rank's
    rows land: None when the reduce adds them straight into the buffer's local rows (one call,
    partials reduced in the buffer's dtype: nothing else writes those rows while the reduce runs;
    no zero-filled sum buffer, no final sum pass), else a zero-filled ``(T, W)`` buffer of
    ``red_dtype`` (`bwd_reduce_dtype`). ``kept``: as for `_backward` (the K/V rows are not cast
    again). ``split`` (`bwd_split`): two calls, the remote keys' first, then, while their rows'
    reduce travels, the local keys' on the local rows alone (views ``[:tk]``, so that no key tile
    of it reaches a row the reduce reads); ``heads`` (`bwd_split_heads`): their q heads per CTA.

    What reads no remote row (dq's, the buffer's and the owners' sums' zeros, the kernel's
    preprocess) is enqueued while the rows travel (cp 2 varlen causal 64k on 2x H100: 1.06 ->
    0.78 ms from the forward's end to the backward kernel; docs/perf.md)."""
    dout, q, out, lse, scale, softcap, det = common
    tk, hk, d = k.shape
    st = rt.remote_tensors(q.device)[0]
    rows = tk + rt.cast_args[0].num_recv_tokens
    # a rank whose stage is empty kept no rows (it computes nothing, only its partials are sent)
    assert kept is None or kept.shape[0] or st.empty, "no kept K/V rows for a stage with work"
    kv, cast = (kept, None) if kept is not None else _start_concat_kv(rt, k, v)
    dq = torch.zeros(q.shape, dtype=parts.dtype, device=q.device)
    dkv = parts.zeros(0, rows)
    first, last = st, None
    if split:  # the remote keys first, their rows' reduce started, then the local keys while it travels
        halves = rt.concat_parts(q.device)
        assert halves is not None  # a degree-0 rank has its concatenated stage
        last, first = halves
    # the local keys' call (split) writes the local rows while the reduce would add into them;
    # zeroed with the rest here, not behind the remote keys' kernel, where the reduce would wait
    # for the fill
    dkv_remote = (
        None
        if last is None and red_dtype == dkv.dtype
        else dkv.new_zeros((tk, dkv.shape[1]), dtype=red_dtype)
    )
    kvk, kvv = _split(kv, hk, d)
    # host work only (shapes and ranges), done while the rows travel
    hpc = _split_heads_per_cta(heads, q, kvk, kvv, st, softcap, det) if last is not None else None
    if not st.empty:
        ffa_backward_prepare(dout, q, v, out, lse, softmax_scale=scale, softcap=softcap)
    if cast is not None:
        cast.wait()
    _bwd_stage(dout, q, kvk, kvv, out, lse, first, dq, *_split(dkv, hk, d), scale, softcap, det, hpc)
    work = _start_reduce(rt, dkv[tk:], dkv[:tk] if dkv_remote is None else dkv_remote, 0)
    if last is not None:
        local_k, local_v = _split(kv[:tk], hk, d)
        local_dk, local_dv = _split(dkv[:tk], hk, d)
        _bwd_stage(
            dout, q, local_k, local_v, out, lse, last, dq, local_dk, local_dv, scale, softcap, det, hpc
        )
    return dq, dkv, [work], dkv_remote


def _split_heads_per_cta(heads: str | int, q, k, v, st: StageTensors, softcap, det) -> int | None:
    """The q heads per CTA of the split backward's two calls (`bwd_split_heads`): None (each
    call's own by the kernel's rule), the whole stage's (``k``, ``v``: its ``[local; remote]``
    rows), or the number set."""
    if heads == "auto" or st.empty:
        return None
    if heads == "stage":
        assert st.q_ranges is not None and st.k_ranges is not None  # a non-empty stage has its ranges
        return backward_heads_per_cta(
            q, k, v, st.q_ranges, st.k_ranges, st.attn_types, softcap=softcap, deterministic=det
        )
    return int(heads)


def _backward_staged(rt: DistAttnRuntime, parts: Partials, k, v, dkv_remote, common):
    """The host stage on local K/V, then each remote stage as its K/V arrive (the next one
    prefetched meanwhile), its partial ``[dK, dV]`` reduced to the owners while the next stage
    computes. Returns dq (the accumulators' dtype), the local rows' dk, dv (without the owners'
    sums) and the reduces' works."""
    dout, q, out, lse, scale, softcap, det = common
    hk, d = k.shape[1:]
    dev = q.device
    remote = rt.remote_tensors(dev)
    kv = _pack(k, v)
    pending = _start_cast(rt, kv, 0)
    dq = torch.zeros(q.shape, dtype=parts.dtype, device=dev)
    dk = torch.zeros(k.shape, dtype=dq.dtype, device=dev)
    dv = torch.zeros(v.shape, dtype=dq.dtype, device=dev)
    _bwd_stage(dout, q, k, v, out, lse, rt.host_tensors(dev), dq, dk, dv, scale, softcap, det)
    reduces = []
    n = len(rt.cast_args)
    for t in range(n):
        assert pending is not None  # stage t's cast started
        work, buf = pending
        work.wait()
        pending = _start_cast(rt, kv, t + 1) if t + 1 < n else None
        dkv_t = parts.zeros(t, buf.shape[0])  # [dK, dV] of the stage buffer
        kt, vt = _split(buf, hk, d)
        dkt, dvt = _split(dkv_t, hk, d)
        _bwd_stage(dout, q, kt, vt, out, lse, remote[t], dq, dkt, dvt, scale, softcap, det)
        reduces.append(_start_reduce(rt, dkv_t, dkv_remote, t))
    return dq, dk, dv, reduces


def _reduce_dsink(dsink: torch.Tensor, rt: DistAttnRuntime) -> torch.Tensor:
    op = dsink_reduce()
    if op == "none":
        return dsink
    red = dsink.to(rt.comm_device())
    dist.all_reduce(red, op=dist.ReduceOp.SUM, group=rt.group)
    if op == "avg":
        red /= rt.plan.cp_size
    return red.to(dsink.device)


class _DistAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, rt, sink_layout, scale, softcap, want_max, det):
        out, lse, ml, kv = _forward(rt, q, k, v, sink, sink_layout, scale, softcap, want_max)
        # MAGI_DIST_KEEP_KV: the degree-0 K/V rows for the backward (with the variable alike on
        # every rank, every rank skips the backward's cast; one without them keeps an empty tensor)
        kept = None
        keep = keep_kv()  # checked on every call, whatever the degree
        if keep and rt.me.calc.kv_concat and rt.cast_args:
            kept = kv if kv is not None else k.new_empty((0, _row_width(k, v)))
        if kept is not None and kept.numel():
            # the kept rows hold a copy of the local K/V: save views of it, not k and v too
            k, v = _split(kept[: k.shape[0]], *k.shape[1:])
        ctx.save_for_backward(q, k, v, out, lse, sink, kept)  # lse in accumulator precision
        ctx.rt, ctx.sink_layout, ctx.scale, ctx.softcap, ctx.det = rt, sink_layout, scale, softcap, det
        lse = lse.float()
        ctx.mark_non_differentiable(lse)
        if ml is not None:
            ctx.mark_non_differentiable(ml)
        return out, lse, ml

    @staticmethod
    @once_differentiable("magi_dist.calc_attn")  # a second grad raises instead of being wrong
    def backward(ctx, dout, _dlse, _dml):
        q, k, v, out, lse, sink, kept = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _backward(
            ctx.rt, dout, q, k, v, out, lse, ctx.scale, ctx.softcap, ctx.det, kept, grad_dtype=k.dtype
        )
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = sink_backward(sink, ctx.sink_layout, out, dout, lse)
            if ctx.sink_layout == "sh":
                dsink = _reduce_dsink(dsink, ctx.rt)
        # already in the inputs' dtype (grad_dtype; q, k and v share one)
        return dq, dk, dv, dsink, None, None, None, None, None, None


def _check_heads(name: str, x: object, heads: int, d: int) -> None:
    if isinstance(x, torch.Tensor) and x.dim() == 3 and tuple(x.shape[1:]) != (heads, d):
        raise ValueError(
            f"{name}: expected shape (local rows, {heads}, {d}) for this key, got {tuple(x.shape)}"
        )


def _check_rows(name: str, x: torch.Tensor, rows: int, total: int) -> None:
    if x.shape[0] == total and total != rows:
        raise ValueError(
            f"{name}: has {total} rows, the global length; calc_attn takes dispatched tensors "
            f"({rows} local rows): use dispatch({name}, key)"
        )
    if x.shape[0] != rows:
        raise ValueError(f"{name}: expected shape {(rows, *x.shape[1:])} for this key, got {tuple(x.shape)}")


def calc_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: DistAttnRuntimeKey,
    sink: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    return_max_logits: bool = False,
    deterministic: bool = False,
) -> tuple[torch.Tensor, AttnForwardMeta]:
    """Context-parallel attention of this rank's rows.

    Args:
        q: ``(shard_seqlen, Hq, D)``; k ``(shard_seqlen, Hk, D)``, v ``(shard_seqlen, Hk, Dv)``
            (``Dv``: the key's ``head_dim_v``, D unless given): outputs of :func:`dispatch`.
        key: from ``magi_attn_flex_key`` / ``magi_attn_varlen_key`` over the same group.
        sink: float32 ``(S_sink, Hq)`` (shared by all rows; its gradient is reduced over the group as
            ``MAGI_DIST_DSINK_REDUCE`` = none|sum|avg says, default none) or ``(shard_seqlen, S_sink, Hq)``
            (per local row, dispatched).
        softmax_scale: None means ``D ** -0.5``. softcap: tanh soft-capping of logits when > 0.
        return_max_logits: also return the global per-head max of ``softmax_scale * q.k``.
        deterministic: bitwise the same gradients run after run on every rank (each stage's
            backward kernel in its ordered mode; the dK/dV reductions always sum in a fixed order).
    Returns:
        ``(local_out, AttnForwardMeta(lse, max_logits))``: out ``(shard_seqlen, Hq, Dv)`` in q's
        dtype, lse float32 ``(shard_seqlen, Hq)`` (local rows), max_logits float32 ``(Hq,)`` equal on
        every rank, or None.
    Raises:
        TypeError / ValueError naming the argument: the checks of ``flex_flash_attn_func``
        (``ffa_kernels.validate_attn_inputs``) and the shapes this key needs, all before any
        collective; ValueError on every rank when the ranks built different keys (checked on
        the key object's first collective use, ``magi_dist.fingerprint``). Not differentiable
        twice (a second grad raises RuntimeError). Runs under ``torch.inference_mode()``.
    """
    if not isinstance(key, DistAttnRuntimeKey):
        raise TypeError(f"key: expected a DistAttnRuntimeKey, got {type(key).__name__}")
    # 1. Every argument, before any collective, with flex_flash_attn_func's own checks: a bad
    #    argument fails on every rank alike, not only on the ranks that happen to have work.
    _check_heads("q", q, key.num_heads_q, key.head_dim)
    _check_heads("k", k, key.num_heads_kv, key.head_dim)
    _check_heads("v", v, key.num_heads_kv, key.head_dim_v)
    sink_layout = "ssh" if isinstance(sink, torch.Tensor) and sink.dim() == 3 else "sh"
    args = validate_attn_inputs(
        q, k, v, sink=sink, sink_layout=sink_layout, softmax_scale=softmax_scale, softcap=softcap,
        return_max_logits=return_max_logits,
    )  # fmt: skip
    if not isinstance(deterministic, bool):
        raise TypeError(
            f"deterministic: expected a bool, got {type(deterministic).__name__} {deterministic!r}"
        )
    # 2. The key object's first collective use: every rank must hold the same key.
    check_key(key)
    # 3. The row counts, which the plan gives (planning is local).
    rt = get_runtime(key)
    for name, x in (("q", args.q), ("k", args.k), ("v", args.v)):
        _check_rows(name, x, rt.shard_seqlen, rt.plan.total_seqlen)
    out, lse, ml = _DistAttnFunc.apply(
        args.q,
        args.k.contiguous(),
        args.v.contiguous(),
        args.sink,
        rt,
        sink_layout,
        args.softmax_scale,
        args.softcap,
        args.return_max_logits,
        deterministic,
    )
    return out, AttnForwardMeta(lse=lse, max_logits=ml)
