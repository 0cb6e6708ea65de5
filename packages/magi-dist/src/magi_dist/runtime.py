"""Per-key runtime: the plan of this rank and the index tensors the hot path needs, per device."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from magi_solver import (
    DistAttnConfig,
    DistAttnPlan,
    GroupCastArgs,
    GroupReduceArgs,
    RankPlan,
    StageCalc,
    make_plan,
)

if TYPE_CHECKING:
    from magi_dist.key import DistAttnRuntimeKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageTensors:
    """Kernel arguments of one stage on one device (None when the stage computes nothing)."""

    q_ranges: torch.Tensor | None
    k_ranges: torch.Tensor | None
    attn_types: torch.Tensor | None

    @staticmethod
    def build(calc: StageCalc, device: torch.device) -> StageTensors:
        if len(calc) == 0:
            return StageTensors(None, None, None)
        q = torch.tensor(calc.q_ranges, dtype=torch.int32, device=device).reshape(-1, 2)
        k = torch.tensor(calc.k_ranges, dtype=torch.int32, device=device).reshape(-1, 2)
        t = torch.tensor(calc.attn_types, dtype=torch.int32, device=device)
        return StageTensors(q, k, t)

    @property
    def empty(self) -> bool:
        return self.q_ranges is None


@dataclass
class DistAttnRuntime:
    """Everything calc_attn, dispatch and undispatch need for one key on this rank."""

    key: DistAttnRuntimeKey
    plan: DistAttnPlan
    rank: int
    group: dist.ProcessGroup
    _device_cache: dict = field(default_factory=dict)

    @staticmethod
    def build(key: DistAttnRuntimeKey) -> DistAttnRuntime:
        group = key.group
        config = DistAttnConfig.model_validate_json(key.config_json)
        plan = make_plan(key.mask(), key.cp_size, config, degree_agreement=_all_reduce_max(group))
        rank = dist.get_rank(group)
        logger.debug(
            "planned cp=%d: degree %d, imbalance %.4f, %d K/V rows received on rank %d",
            key.cp_size,
            plan.overlap_degree,
            plan.stats.imbalance,
            plan.stats.recv_tokens_per_rank[rank],
            rank,
        )
        return DistAttnRuntime(key=key, plan=plan, rank=rank, group=group)

    # -- plan views ---------------------------------------------------------------------------
    @property
    def me(self) -> RankPlan:
        return self.plan.ranks[self.rank]

    @property
    def shard_seqlen(self) -> int:
        return self.plan.shard_seqlen

    @property
    def cast_args(self) -> list[GroupCastArgs]:
        return self.me.comm.stages

    def kv_reduce_args(self, stage: int) -> GroupReduceArgs:
        """Group-reduce arguments of stage ``stage``'s partial ``[dK, dV]`` rows: the transpose of
        its group-cast."""
        return self._cached(f"kv_reduce_{stage}", None, lambda: self.cast_args[stage].to_group_reduce())

    def comm_device(self) -> torch.device:
        """Device of tensors the group's backend moves (CUDA for NCCL, CPU otherwise)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- device tensors (built once per device) -------------------------------------------------
    def _cached(self, name: str, device: torch.device, make):
        k = (name, device)
        if k not in self._device_cache:
            self._device_cache[k] = make()
        return self._device_cache[k]

    def host_tensors(self, device: torch.device) -> StageTensors:
        return self._cached("host", device, lambda: StageTensors.build(self.me.calc.host, device))

    def remote_tensors(self, device: torch.device) -> list[StageTensors]:
        return self._cached(
            "remote", device, lambda: [StageTensors.build(c, device) for c in self.me.calc.remote]
        )

    def position_ids(self, device: torch.device) -> torch.Tensor:
        """int64 ``(shard_seqlen,)``: padded global index of each local row."""
        return self._cached(
            "pos",
            device,
            lambda: torch.tensor(self.plan.position_ids(self.rank), dtype=torch.int64, device=device),
        )

    def unpermute_index(self, device: torch.device) -> torch.Tensor:
        """int64 ``(total_seqlen,)``: row of the rank-major gathered buffer holding each global token."""

        def make() -> torch.Tensor:
            order = [t for r in range(self.plan.cp_size) for t in self.plan.position_ids(r)]
            inv = torch.empty(len(order), dtype=torch.int64)
            inv[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(order), dtype=torch.int64)
            return inv[: self.plan.total_seqlen].to(device)

        return self._cached("unperm", device, make)


def _all_reduce_max(group: dist.ProcessGroup):
    """The overlap-degree agreement hook: a cross-rank MAX over ``group``."""

    def agree(degree: int) -> int:
        device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        )
        t = torch.tensor([degree], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    return agree
