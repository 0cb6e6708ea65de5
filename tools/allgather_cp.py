"""All-gather K/V context parallelism (the Llama-3 / Kvax method), the baseline of bench_dist.py.

Q is dispatched zigzag (rank i holds chunks i and 2*cp-1-i of each pair of rounds); every rank
all-gathers the whole K/V and runs one kernel call over its rows against the global keys.
Forward only; communication is (cp-1)/cp of K/V per rank whatever the mask.

Each rank gathers ``[K; V]`` stacked along rows, so the gathered buffer is
``[K_0; V_0; K_1; V_1; ...]`` (``shard`` rows each). The kernel reads K from ``buf[:-shard]`` and V
from ``buf[shard:]``: two contiguous views of one buffer in which row ``2*r*shard + i`` is K of
rank r's row i in the first and V of the same row in the second. One collective, and no copy of
the gathered K/V on any call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ffa_kernels import flex_flash_attn_func
from magi_solver import AttnMask, DispatchAlg, DispatchConfig, DistAttnConfig, OverlapConfig, make_plan


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp = self.cp
        shard = k.shape[0]
        kv = torch.cat([k, v])
        full = kv.new_empty((cp * kv.shape[0], *kv.shape[1:]))
        dist.all_gather_into_tensor(full, kv, group=self.group)
        qr, kr, ty = self._tensors(q.device)
        return flex_flash_attn_func(q, full[:-shard], full[shard:], qr, kr, ty)[0]
