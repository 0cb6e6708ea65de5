"""Per-key runtime: the plan of this rank and the index tensors the hot path needs, per device;
and the runtime cache (`get_runtime`, `clear_cache`).

Building a runtime makes no collective: every rank plans the same key the same way (the
planner is deterministic, and ``magi_dist.fingerprint`` checks before the first data collective
that the ranks hold the same key). So a rank whose cache differs from its peers' (it called
`clear_cache`, has a smaller ``MAGI_DIST_RUNTIME_CACHE_SIZE``, or caught an exception while
planning) only plans again; it never waits on a collective the others do not make.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from magi_dist.key import DistAttnRuntimeKey
from magi_solver import (
    DistAttnConfig,
    DistAttnPlan,
    GroupCastArgs,
    GroupReduceArgs,
    RankPlan,
    StageCalc,
    make_plan,
)

logger = logging.getLogger(__name__)

ENV_CACHE_SIZE = "MAGI_DIST_RUNTIME_CACHE_SIZE"
DEFAULT_CACHE_SIZE = 64


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
        # No degree agreement across ranks: with the same key every rank computes the same
        # degree (the plan takes the max over all ranks itself), and an agreement here would be
        # a collective that only the ranks planning now make.
        plan = make_plan(key.mask(), key.cp_size, config)
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

    def partial_rows(self) -> tuple[int, ...]:
        """Per partial ``[dK, dV]`` buffer of the backward (one per group-reduce, in call order;
        degree 0: the whole ``[local; remote]`` buffer, else each remote stage's), the most rows
        any rank's buffer has. The same on every rank (every rank holds the same plan), so
        decisions taken from it need no collective (``magi_dist.partials``)."""

        def rows(r: int) -> tuple[int, ...]:
            rp = self.plan.ranks[r]
            recv = rp.comm.num_recv_tokens_per_stage
            return (self.plan.shard_seqlen + recv[0],) if rp.calc.kv_concat else tuple(recv)

        def make() -> tuple[int, ...]:
            return tuple(max(col) for col in zip(*(rows(r) for r in range(self.plan.cp_size))))

        return self._cached("partial_rows", None, make)

    def max_pair_rows(self) -> int:
        """The most K/V rows any one rank receives from any one peer in one stage's group-cast
        (so also the most partial ``[dK, dV]`` rows it sends back to one owner in a
        group-reduce). The same on every rank (every rank holds the same plan)."""

        def make() -> int:
            most = 0
            for rp in self.plan.ranks:
                for a in rp.comm.stages:
                    per_src: dict[int, int] = {}
                    for n, src in zip(a.output_split_sizes, a.src_index):
                        per_src[src] = per_src.get(src, 0) + n
                    most = max(most, *per_src.values(), 0)
            return most

        return self._cached("max_pair_rows", None, make)

    def comm_device(self) -> torch.device:
        """Device of tensors the group's backend moves (CUDA for NCCL, CPU otherwise)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- device tensors (built once per device) -------------------------------------------------
    def _cached(self, name: str, device: torch.device | None, make):
        k = (name, device)
        if k not in self._device_cache:
            # Normal tensors even when first needed under torch.inference_mode(): inference
            # tensors cached here would break every later call outside it (no version counter,
            # not usable by autograd).
            with torch.inference_mode(False):
                self._device_cache[k] = make()
        return self._device_cache[k]

    def host_tensors(self, device: torch.device) -> StageTensors:
        return self._cached("host", device, lambda: StageTensors.build(self.me.calc.host, device))

    def remote_tensors(self, device: torch.device) -> list[StageTensors]:
        return self._cached(
            "remote", device, lambda: [StageTensors.build(c, device) for c in self.me.calc.remote]
        )

    def concat_parts(self, device: torch.device) -> tuple[StageTensors, StageTensors] | None:
        """Degree 0: the concatenated stage's slices split by the keys they read, ``(local part,
        remote part)`` (both in ``[local; remote]`` coordinates: keys below ``shard_seqlen`` are
        local); None when the rank has no such stage. The planner builds that stage from bands
        cut at the host ranges (``magi_solver.plan``, ``calc_meta``), so no slice reads both."""

        def make() -> tuple[StageTensors, StageTensors] | None:
            if not self.me.calc.kv_concat or not self.me.calc.remote:
                return None
            calc = self.me.calc.remote[0]
            shard = self.shard_seqlen
            local = [ks < shard for ks, _ in calc.k_ranges]
            assert not any(ks < shard < ke for ks, ke in calc.k_ranges), "a slice reads local and remote keys"
            return tuple(  # type: ignore[return-value]
                StageTensors.build(
                    StageCalc(
                        q_ranges=[r for r, m in zip(calc.q_ranges, local) if m == want],
                        k_ranges=[r for r, m in zip(calc.k_ranges, local) if m == want],
                        attn_types=[t for t, m in zip(calc.attn_types, local) if m == want],
                        total_seqlen_k=calc.total_seqlen_k,
                        area=0,  # not read here
                    ),
                    device,
                )
                for want in (True, False)
            )

        return self._cached("concat_parts", device, make)

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


# ----------------------------------------------------------------------------- the cache

_RUNTIMES: OrderedDict[DistAttnRuntimeKey, DistAttnRuntime] = OrderedDict()


def _cache_size() -> int:
    raw = os.environ.get(ENV_CACHE_SIZE, str(DEFAULT_CACHE_SIZE))
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"{ENV_CACHE_SIZE}: expected a positive int, got {raw!r}")
    return size


def get_runtime(key: DistAttnRuntimeKey) -> DistAttnRuntime:
    """The runtime of ``key`` on this rank, planned on first use.

    Local: no collective, whatever the cache holds. The cache keeps the
    ``MAGI_DIST_RUNTIME_CACHE_SIZE`` (default 64) most recently used runtimes.
    """
    if not isinstance(key, DistAttnRuntimeKey):
        raise TypeError(f"key: expected a DistAttnRuntimeKey, got {type(key).__name__}")
    size = _cache_size()
    rt = _RUNTIMES.get(key)
    if rt is not None:
        _RUNTIMES.move_to_end(key)
        return rt
    if dist.get_rank(key.group) < 0:
        raise ValueError("key: made for a process group this process is not a member of")
    rt = DistAttnRuntime.build(key)
    _RUNTIMES[key] = rt
    while len(_RUNTIMES) > size:
        _RUNTIMES.popitem(last=False)
    return rt


def clear_cache() -> None:
    """Drop every cached runtime (on this rank; its peers need not do the same)."""
    _RUNTIMES.clear()
