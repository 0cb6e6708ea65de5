"""Frozen configuration models of the planner (validated on construction)."""

from __future__ import annotations

import math
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from magi_solver.dispatch import DispatchAlg

MAX_COST_FACTOR = 1e30
"""Upper bound of ``OverlapConfig``'s cost factors (see there)."""


class OverlapMode(str, Enum):
    """``static``: the configured degree; ``dynamic``: the cheapest degree in ``1..dynamic_max_degree``."""

    STATIC = "static"
    DYNAMIC = "dynamic"


class OverlapAlg(str, Enum):
    """How remote chunks (in global token order) are grouped into contiguous stages.

    ``uniform``: equal chunk counts; ``balanced``: equal cost (comm + calc) per stage.
    """

    UNIFORM = "uniform"
    BALANCED = "balanced"


class DispatchConfig(BaseModel):
    """How the q axis is cut into chunks and chunks are assigned to ranks.

    ``chunk_size`` is an upper bound: it shrinks so that every rank gets at least
    ``min_chunks_per_rank`` chunks. The token axis is padded to a multiple of ``chunk * cp_size``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    chunk_size: int = Field(2048, gt=0)
    alg: DispatchAlg = DispatchAlg.MIN_HEAP
    min_chunks_per_rank: int = Field(1, ge=1)


class OverlapConfig(BaseModel):
    """How remote K/V is split into stages overlapped with computation.

    ``degree`` 0: no overlap (all remote K/V arrives first, one kernel call over local+remote);
    ``N >= 1``: host stage plus N remote stages. Costs: a stage computes in
    ``calc_cost_factor * area`` and communicates in ``comm_cost_factor * tokens``, so
    ``comm_cost_factor / calc_cost_factor`` is the time of one K/V token relative to one mask
    cell (about ``(peak FLOP/s / link bytes/s) * (2*Hk*bytes) / (4*Hq)``: ~1000 for bf16 MHA on H100
    NVLink). Remote K/V is cut into at most ``max_num_chunks`` chunks of at least ``min_chunk_size``.
    Both factors are finite and at most ``MAX_COST_FACTOR`` (1e30): only their ratio matters, and
    the bound keeps every estimated cost (factor x area, summed over stages) a finite float.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: OverlapMode = OverlapMode.STATIC
    degree: int | None = Field(1, ge=0)
    dynamic_max_degree: int = Field(8, ge=1)
    min_chunk_size: int = Field(512, gt=0)
    max_num_chunks: int = Field(64, ge=1)
    alg: OverlapAlg = OverlapAlg.UNIFORM
    calc_cost_factor: float = 1.0
    comm_cost_factor: float = 1000.0

    @field_validator("calc_cost_factor", "comm_cost_factor", mode="before")
    @classmethod
    def _no_bool_cost_factor(cls, value, info):
        if isinstance(value, bool):
            raise ValueError(f"{info.field_name}: must be a real number, got bool {value!r}")
        return value

    @field_validator("calc_cost_factor", "comm_cost_factor")
    @classmethod
    def _check_cost_factor(cls, value: float, info) -> float:
        name = info.field_name
        low = "> 0" if name == "calc_cost_factor" else ">= 0"
        ok = math.isfinite(value) and (value > 0 if name == "calc_cost_factor" else value >= 0)
        if not ok or value > MAX_COST_FACTOR:
            raise ValueError(
                f"{name}: must be a finite number {low} and <= {MAX_COST_FACTOR:g}, got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _check_mode(self) -> OverlapConfig:
        if self.mode is OverlapMode.STATIC and self.degree is None:
            raise ValueError("degree: static overlap mode needs a degree (0 = no overlap); got None")
        return self


class DistAttnConfig(BaseModel):
    """Everything :func:`magi_solver.make_plan` needs besides the mask and ``cp_size``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dispatch_config: DispatchConfig = DispatchConfig()
    overlap_config: OverlapConfig = OverlapConfig()
