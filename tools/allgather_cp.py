"""All-gather K/V context parallelism (the Llama-3 / Kvax method), the baseline of bench_dist.py.

Q is dispatched zigzag (rank i holds chunks i and 2*cp-1-i of each pair of rounds); every rank
all-gathers the whole K/V and runs one kernel call over its rows against the global keys.
Communication is (cp-1)/cp of K/V per rank whatever the mask, in the forward; the backward runs
``flex_flash_attn_func``'s backward over the gathered K/V (autograd) and reduce-scatters the
gathered dK/dV back to their owners (the same bytes again).

Each rank gathers ``[K; V]`` stacked along rows, so the gathered buffer is
``[K_0; V_0; K_1; V_1; ...]`` (``shard`` rows each). The kernel reads K from ``buf[:-shard]`` and V
from ``buf[shard:]``: two contiguous views of one buffer in which row ``2*r*shard + i`` is K of
rank r's row i in the first and V of the same row in the second. One collective, and no copy of
the gathered K/V on any call.

Backward (`_GatherKV`): the kernel's gradients of the two views, dK and dV, each
``(2*cp - 1)*shard`` rows, hold rank r's rows at ``[2*r*shard, (2*r + 1)*shard)`` (the rows in
between belong to the other view and are zero); they are copied into one ``[dK_0; dV_0; dK_1;
dV_1; ...]`` buffer (one pass) and ``reduce_scatter_tensor`` sums every rank's contribution into
each owner's ``[dK; dV]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ffa_kernels import flex_flash_attn_func
from magi_solver import AttnMask, DispatchAlg, DispatchConfig, DistAttnConfig, OverlapConfig, make_plan

# torch >= 2.13 names them *_single (the *_tensor names warn there); older torch has only those
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    shard = k.shape[0]
    kv = torch.cat([k, v])
    full = kv.new_empty((cp * kv.shape[0], *kv.shape[1:]))
    _all_gather(full, kv, group=group)
    return full[:-shard], full[shard:]


class _GatherKV(torch.autograd.Function):
    """``[K; V]`` of every rank gathered as ``[K_0; V_0; K_1; V_1; ...]``; returns the K view
    ``full[:-shard]`` and the V view ``full[shard:]``; the backward reduce-scatters their
    gradients back to ``(dk, dv)`` of the local rows."""

    @staticmethod
    def forward(ctx, k, v, group, cp):
        ctx.group, ctx.cp, ctx.shard = group, cp, k.shape[0]
        return _gather_kv(k, v, group, cp)

    @staticmethod
    def backward(ctx, dk_view, dv_view):
        cp, shard = ctx.cp, ctx.shard
        row = dk_view.shape[1:]
        grads = dk_view.new_empty((cp, 2, shard, *row))
        for j, g in ((0, dk_view), (1, dv_view)):
            if g is None:  # a view the loss does not reach
                grads[:, j].zero_()
                continue
            # rank r's rows at [2r*shard, (2r+1)*shard) of the view: the first cp-1 ranks by a
            # strided view, the last one is the view's tail
            grads[: cp - 1, j] = g[: (2 * cp - 2) * shard].view(cp - 1, 2, shard, *row)[:, 0]
            grads[cp - 1, j] = g[(2 * cp - 2) * shard :]
        local = grads.new_empty((2 * shard, *row))
        _reduce_scatter(local, grads.view(-1, *row), group=ctx.group)
        return local[:shard], local[shard:], None, None


class AllGatherCP:
    """Plan once per mask; ``forward(local_q, local_k, local_v)`` -> local out (zigzag layout)."""

    def __init__(self, mask: AttnMask, group: dist.ProcessGroup, chunk_size: int):
        self.group = group
        self.cp = cp = dist.get_world_size(group)
        rank = dist.get_rank(group)
        cfg = DistAttnConfig(
            dispatch_config=DispatchConfig(chunk_size=chunk_size, alg=DispatchAlg.ZIGZAG),
            overlap_config=OverlapConfig(degree=0),
        )
        plan = make_plan(mask, cp, cfg)
        self.plan = plan
        cs, shard = plan.chunk_size, plan.shard_seqlen
        # rows: this rank's local rows; columns: the row of each global (padded) token's K in the
        # gathered [K_0; V_0; K_1; V_1; ...] buffer
        col_of = {t: 2 * r * shard + i for r in range(cp) for i, t in enumerate(plan.position_ids(r))}
        q_r, k_r, ty = [], [], []
        for pos, c in enumerate(plan.ranks[rank].host_chunks):
            for b in mask.bands():
                piece = b.clip_rows(c * cs, (c + 1) * cs)
                if piece.is_empty():
                    continue
                # split columns by chunk so each piece maps to one contiguous gathered range
                c0, c1 = piece.touched_cols()
                for kc in range(c0 // cs, (c1 - 1) // cs + 1):
                    sub = piece.clip_cols(kc * cs, (kc + 1) * cs)
                    if sub.is_empty():
                        continue
                    dq = pos * cs - c * cs
                    dk = col_of[kc * cs] - kc * cs
                    for qs, qe, ks, ke, t in sub.shifted(dq, dk).to_slices():
                        q_r.append((qs, qe))
                        k_r.append((ks, ke))
                        ty.append(t)
        self.q_ranges, self.k_ranges, self.types = q_r, k_r, ty
        self._dev = None

    def _tensors(self, device):
        if self._dev is None:
            as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device).reshape(-1, 2)  # noqa: E731
            self._dev = (
                as_t(self.q_ranges),
                as_t(self.k_ranges),
                torch.tensor(self.types, dtype=torch.int32, device=device),
            )
        return self._dev

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        """Local out of the local (zigzag) rows; differentiable in q, k, v (``kwargs`` go to
        ``flex_flash_attn_func``, e.g. ``deterministic=True``)."""
        qr, kr, ty = self._tensors(q.device)
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            kf, vf = _GatherKV.apply(k, v, self.group, self.cp)
        else:
            kf, vf = _gather_kv(k, v, self.group, self.cp)
        return flex_flash_attn_func(q, kf, vf, qr, kr, ty, **kwargs)[0]

    def dispatch(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's zigzag rows of a global ``(T, ...)`` tensor (padding rows zero)."""
        pad = self.plan.padded_seqlen - x.shape[0]
        if pad:
            x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
        idx = torch.tensor(self.plan.position_ids(rank), device=x.device)
        return x.index_select(0, idx)
