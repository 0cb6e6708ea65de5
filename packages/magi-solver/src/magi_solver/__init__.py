"""magi-solver: mask planning for context-parallel attention.

Masks as slices, load-balanced dispatch of q chunks to ranks, a zero-redundancy K/V communication
plan and overlap stages. Pure Python (pydantic only); no torch or numpy at import time.
"""

from magi_solver import masks
from magi_solver.band import Band
from magi_solver.config import DispatchConfig, DistAttnConfig, OverlapAlg, OverlapConfig, OverlapMode
from magi_solver.dispatch import DispatchAlg, DispatchSolution, solve_dispatch
from magi_solver.overlap import ChunkCost, overlap_cost
from magi_solver.plan import chunk_grid, make_plan
from magi_solver.plan_models import (
    CalcMeta,
    CommMeta,
    DistAttnPlan,
    GroupCastArgs,
    GroupReduceArgs,
    PlanStats,
    RankPlan,
    StageCalc,
)
from magi_solver.types import AttnMask, AttnMaskType, AttnRange, AttnRanges, AttnSlice

__version__ = "0.1.0"

__all__ = [
    "AttnMask",
    "AttnMaskType",
    "AttnRange",
    "AttnRanges",
    "AttnSlice",
    "Band",
    "CalcMeta",
    "ChunkCost",
    "CommMeta",
    "DispatchAlg",
    "DispatchConfig",
    "DispatchSolution",
    "DistAttnConfig",
    "DistAttnPlan",
    "GroupCastArgs",
    "GroupReduceArgs",
    "OverlapAlg",
    "OverlapConfig",
    "OverlapMode",
    "PlanStats",
    "RankPlan",
    "StageCalc",
    "chunk_grid",
    "make_plan",
    "masks",
    "overlap_cost",
    "solve_dispatch",
]
