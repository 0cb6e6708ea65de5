"""Overlap solver: group remote chunks into stages whose communication hides behind computation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from magi_solver.config import OverlapAlg, OverlapConfig, OverlapMode


class ChunkCost(NamedTuple):
    """Estimated time to receive (``comm``) and to compute (``calc``) one remote chunk or stage."""

    comm: float
    calc: float


def overlap_cost(host_calc: float, stages: Sequence[ChunkCost]) -> float:
    """``max(comm(P0), calc_host) + sum_i max(comm(P_i), calc(P_{i-1})) + calc(P_last)``.

    Stage ``P_i``'s communication runs while the previous stage (the host stage for ``P0``) computes.
    """
    if not stages:
        return host_calc
    total = max(stages[0].comm, host_calc)
    for prev, cur in zip(stages, stages[1:]):
        total += max(cur.comm, prev.calc)
    return total + stages[-1].calc


def no_overlap_cost(host_calc: float, chunks: Sequence[ChunkCost]) -> float:
    """Degree 0: everything is received first, then one kernel computes host and remote."""
    return sum(c.comm for c in chunks) + host_calc + sum(c.calc for c in chunks)


def group_chunks(chunks: Sequence[ChunkCost], degree: int, alg: OverlapAlg) -> list[list[int]]:
    """Split chunk ids ``0..n-1`` into ``degree`` contiguous groups (some empty when ``n < degree``)."""
    n = len(chunks)
    if alg is OverlapAlg.UNIFORM or n == 0:
        base, extra = divmod(n, degree)
        sizes = [base + (1 if g < extra else 0) for g in range(degree)]
    else:  # balanced: cut where the running cost crosses g/degree of the total
        weights = [c.comm + c.calc for c in chunks]
        total = sum(weights) or 1.0
        sizes, run, start = [], 0.0, 0
        for i, w in enumerate(weights):
            run += w
            while len(sizes) < degree - 1 and run >= total * (len(sizes) + 1) / degree:
                sizes.append(i + 1 - start)
                start = i + 1
        sizes += [n - start] + [0] * (degree - 1 - len(sizes))
    groups, start = [], 0
    for size in sizes:
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def stage_costs(chunks: Sequence[ChunkCost], groups: Sequence[Sequence[int]]) -> list[ChunkCost]:
    return [ChunkCost(sum(chunks[i].comm for i in g), sum(chunks[i].calc for i in g)) for g in groups]


def best_degree(host_calc: float, chunks: Sequence[ChunkCost], config: OverlapConfig) -> int:
    """The configured degree (static mode) or the cheapest one in ``1..dynamic_max_degree``
    by :func:`overlap_cost`, ties to the smaller degree (dynamic mode)."""
    if config.mode is OverlapMode.STATIC:
        assert config.degree is not None
        return config.degree
    best = None
    for degree in range(1, config.dynamic_max_degree + 1):
        cost = overlap_cost(host_calc, stage_costs(chunks, group_chunks(chunks, degree, config.alg)))
        if best is None or round(cost) < best[0]:
            best = (round(cost), degree)
    assert best is not None
    return best[1]
