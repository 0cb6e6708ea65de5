"""dispatch / undispatch: global token axis <-> this rank's chunks (padded to the chunk grid)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from magi_dist.fingerprint import check_key
from magi_dist.key import DistAttnRuntimeKey
from magi_dist.runtime import DistAttnRuntime, get_runtime


def _take_local(x: torch.Tensor, rt: DistAttnRuntime, pad_value: float) -> torch.Tensor:
    pos = rt.position_ids(x.device)
    if rt.plan.pad_size:
        pad = x.new_full((rt.plan.pad_size, *x.shape[1:]), pad_value)
        x = torch.cat([x, pad], dim=0)
    return x.index_select(0, pos)


def _gather_global(local: torch.Tensor, rt: DistAttnRuntime) -> torch.Tensor:
    cp = rt.plan.cp_size
    if cp == 1:
        gathered = local
    else:
        comm_dev = rt.comm_device()
        src = local.contiguous().to(comm_dev)
        parts = [torch.empty_like(src) for _ in range(cp)]
        dist.all_gather(parts, src, group=rt.group)
        gathered = torch.cat(parts, dim=0).to(local.device)
    return gathered.index_select(0, rt.unpermute_index(local.device))


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rt: DistAttnRuntime, key: DistAttnRuntimeKey, pad_value: float):
        ctx.rt, ctx.key = rt, key
        return _take_local(x, rt, pad_value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # x is replicated and each rank uses only its rows: the full gradient is the union of the
        # ranks' local gradients, i.e. their all-gather (the key's first collective, perhaps).
        check_key(ctx.key)
        return _gather_global(grad, ctx.rt), None, None, None


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, rt: DistAttnRuntime) -> torch.Tensor:
        ctx.rt = rt
        return _gather_global(local, rt)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank holds the same global result (and loss): keep the rows this rank produced
        return _take_local(grad, ctx.rt, 0.0), None


def _check_global(x: object, rt: DistAttnRuntime, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[0] != rt.plan.total_seqlen:
        raise ValueError(
            f"{name}: expected the global token axis of length {rt.plan.total_seqlen} first, got shape {tuple(x.shape)}"
        )
    return x


def dispatch(x: torch.Tensor, key: DistAttnRuntimeKey, pad_value: float = 0.0) -> torch.Tensor:
    """Global ``(T, ...)`` -> this rank's ``(shard_seqlen, ...)``: its chunks in ascending chunk id,
    the tail padded with ``pad_value`` up to the chunk grid. Differentiable (backward all-gathers).

    Local (no collective) in the forward; the backward's all-gather is preceded, on the key
    object's first collective use, by the cross-rank key check (``magi_dist.fingerprint``)."""
    rt = get_runtime(key)
    x = _check_global(x, rt, "x")
    return _Dispatch.apply(x, rt, key, float(pad_value))


def undispatch(local_x: torch.Tensor, key: DistAttnRuntimeKey) -> torch.Tensor:
    """Inverse of :func:`dispatch`: every rank gets the global ``(T, ...)`` tensor (padding dropped).
    Collective over the key's group (the first use of a key object also checks that every rank
    holds the same key: ``magi_dist.fingerprint``). Differentiable (backward keeps this rank's
    rows)."""
    if not isinstance(key, DistAttnRuntimeKey):
        raise TypeError(f"key: expected a DistAttnRuntimeKey, got {type(key).__name__}")
    if not isinstance(local_x, torch.Tensor):
        raise TypeError(f"local_x: expected a torch.Tensor, got {type(local_x).__name__}")
    check_key(key)
    rt = get_runtime(key)
    if local_x.dim() < 1 or local_x.shape[0] != rt.shard_seqlen:
        raise ValueError(
            f"local_x: expected {rt.shard_seqlen} local rows (this key's shard), got shape {tuple(local_x.shape)}"
        )
    return _Undispatch.apply(local_x, rt)


def get_position_ids(key: DistAttnRuntimeKey) -> torch.Tensor:
    """int64 ``(shard_seqlen,)``: global token index of each local row (padding rows get indices
    ``>= total_seqlen``), on the group's communication device. Local (no collective)."""
    rt = get_runtime(key)
    return rt.position_ids(rt.comm_device())
