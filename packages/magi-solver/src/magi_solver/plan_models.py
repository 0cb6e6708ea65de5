"""The distributed attention plan's data (docs/api.md): per-rank calc and comm metadata, plus statistics (built by `magi_solver.plan.make_plan`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from magi_solver.config import DistAttnConfig
from magi_solver.dispatch import DispatchSolution
from magi_solver.types import AttnMask

Range = tuple[int, int]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class StageCalc(_Frozen):
    """One kernel call in local coordinates: slices over this rank's q rows (``[0, shard_seqlen)``)
    and the rows of the stage's K/V buffer (``[0, total_seqlen_k)``)."""

    q_ranges: list[Range]
    k_ranges: list[Range]
    attn_types: list[int]
    total_seqlen_k: int
    area: int

    def __len__(self) -> int:
        return len(self.q_ranges)


class CalcMeta(_Frozen):
    """What a rank computes. ``host`` reads its local K/V; ``remote[i]`` reads the buffer received in
    stage ``i``. With ``kv_concat`` (overlap degree 0) there is one remote stage whose slices index
    the concatenation ``[local K/V ; received K/V]`` and ``host`` is empty."""

    host: StageCalc
    remote: list[StageCalc]
    kv_concat: bool = False


class GroupReduceArgs(_Frozen):
    """``group_reduce`` arguments (docs/api.md) of one stage: the transpose of :class:`GroupCastArgs`."""

    input_split_sizes: list[int]
    output_split_sizes: list[int]
    dst_index: list[int]
    src_indices: list[list[int]]


class GroupCastArgs(_Frozen):
    """``group_cast`` arguments (docs/api.md) of one stage. The input is the rank's local K/V
    (``shard_seqlen`` rows, every row in exactly one split); the output is the stage buffer."""

    input_split_sizes: list[int]
    output_split_sizes: list[int]
    dst_indices: list[list[int]]
    src_index: list[int]

    def to_group_reduce(self) -> GroupReduceArgs:
        """Send partial dK/dV of the stage buffer back to the owners and reduce them into local dK/dV."""
        return GroupReduceArgs(
            input_split_sizes=self.output_split_sizes,
            output_split_sizes=self.input_split_sizes,
            dst_index=self.src_index,
            src_indices=self.dst_indices,
        )

    @property
    def num_recv_tokens(self) -> int:
        return sum(self.output_split_sizes)

    @property
    def num_send_tokens(self) -> int:
        """Rows sent, counting a row once per destination."""
        return sum(s * len(d) for s, d in zip(self.input_split_sizes, self.dst_indices))


class CommMeta(_Frozen):
    """Group-cast arguments per remote stage (same count on every rank)."""

    stages: list[GroupCastArgs]

    @property
    def num_recv_tokens_per_stage(self) -> list[int]:
        return [s.num_recv_tokens for s in self.stages]


class RankPlan(_Frozen):
    """One rank's share: its chunks (ascending; the local layout), what it computes and communicates."""

    rank: int
    host_chunks: list[int]
    host_ranges: list[Range]
    calc: CalcMeta
    comm: CommMeta
    area: int
    estimated_cost: float


class PlanStats(_Frozen):
    """Balance and traffic. Tokens are K/V rows received by a rank (each row carries K and V)."""

    area_per_rank: list[int]
    imbalance: float
    recv_tokens_per_rank_stage: list[list[int]]
    recv_tokens_per_rank: list[int]
    ring_tokens_per_rank: list[int]
    allgather_tokens_per_rank: list[int]

    @property
    def total_recv_tokens(self) -> int:
        return sum(self.recv_tokens_per_rank)


class DistAttnPlan(_Frozen):
    """Output of :func:`magi_solver.make_plan`; round-trips through ``model_dump_json`` /
    ``model_validate_json``. The padded token axis (``padded_seqlen``) is cut into ``num_chunks``
    chunks of ``chunk_size``; rank ``r`` holds ``ranks[r].host_chunks`` concatenated."""

    mask: AttnMask
    cp_size: int
    config: DistAttnConfig
    chunk_size: int
    num_chunks: int
    padded_seqlen: int
    shard_seqlen: int
    chunk_workloads: list[int]
    dispatch: DispatchSolution
    overlap_degree: int
    ranks: list[RankPlan]
    stats: PlanStats

    @property
    def total_seqlen(self) -> int:
        return self.mask.total_seqlen_q

    @property
    def pad_size(self) -> int:
        return self.padded_seqlen - self.mask.total_seqlen_q

    def position_ids(self, rank: int) -> list[int]:
        """Global (padded) token index of each local row of ``rank``."""
        cs = self.chunk_size
        return [t for c in self.ranks[rank].host_chunks for t in range(c * cs, (c + 1) * cs)]
