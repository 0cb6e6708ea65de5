"""Load balance: assign q chunks (jobs with a workload) to buckets (ranks) with equal job counts."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from enum import Enum

from pydantic import BaseModel, ConfigDict


class DispatchAlg(str, Enum):
    """How chunks are assigned to ranks.

    - ``min_heap``: jobs by descending workload, each to the least-loaded non-full bucket
      (MagiAttention's default).
    - ``lpt_swap``: ``min_heap`` followed by pairwise swaps between the most loaded bucket and
      the others while they lower that bucket's load (never worse than ``min_heap``).
    - ``zigzag``: snake order, rank ``i`` gets chunks ``i`` and ``2*cp-1-i`` of each pair of rounds
      (Llama-3 / Kvax); workload-blind.
    - ``sequential``: contiguous blocks of chunks; workload-blind.
    """

    MIN_HEAP = "min_heap"
    LPT_SWAP = "lpt_swap"
    ZIGZAG = "zigzag"
    SEQUENTIAL = "sequential"


class DispatchSolution(BaseModel):
    """Result of :func:`solve_dispatch`: the max bucket workload and each bucket's job ids (sorted)."""

    model_config = ConfigDict(frozen=True)

    minimax_workload: float
    bucket_partitions: list[list[int]]
    bucket_workloads: list[float]

    @property
    def imbalance(self) -> float:
        """max / mean bucket workload (1.0 is perfect; 1.0 as well when all are zero)."""
        mean = sum(self.bucket_workloads) / len(self.bucket_workloads)
        return self.minimax_workload / mean if mean > 0 else 1.0


def solve_dispatch(
    workloads: Sequence[float], num_buckets: int, alg: DispatchAlg | str = DispatchAlg.MIN_HEAP
) -> DispatchSolution:
    """Partition job ids ``0..n-1`` into ``num_buckets`` buckets of ``ceil(n/num_buckets)`` jobs at most.

    Args:
        workloads: non-negative workload per job (``n >= num_buckets``).
        num_buckets: number of buckets (ranks), ``>= 1``.
        alg: a :class:`DispatchAlg` or its string value.
    Returns:
        ``DispatchSolution`` with ``bucket_partitions[b]`` sorted ascending.
    """
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 1:
        raise ValueError(f"num_buckets: must be an int >= 1, got {num_buckets!r}")
    jobs = [float(w) for w in workloads]
    if any(w < 0 for w in jobs):
        raise ValueError(f"workloads: must be >= 0, got {min(jobs)}")
    if len(jobs) < num_buckets:
        raise ValueError(f"workloads: {len(jobs)} jobs cannot fill num_buckets={num_buckets} buckets")
    try:
        alg = DispatchAlg(alg)
    except ValueError:
        raise ValueError(
            f"alg: unknown dispatch algorithm {alg!r}; one of {[a.value for a in DispatchAlg]}"
        ) from None
    parts = _SOLVERS[alg](jobs, num_buckets)
    parts = [sorted(p) for p in parts]
    loads = [sum(jobs[j] for j in p) for p in parts]
    return DispatchSolution(minimax_workload=max(loads), bucket_partitions=parts, bucket_workloads=loads)


def _min_heap(jobs: list[float], k: int) -> list[list[int]]:
    cap = -(-len(jobs) // k)
    # A stable ascending sort reversed: equal workloads come out by descending index (as MagiAttention).
    order = sorted(range(len(jobs)), key=lambda j: jobs[j])[::-1]
    heap = [(0.0, b) for b in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for j in order:
        load, b = heapq.heappop(heap)
        parts[b].append(j)
        if len(parts[b]) < cap:
            heapq.heappush(heap, (load + jobs[j], b))
    return parts


def _lpt_swap(jobs: list[float], k: int) -> list[list[int]]:
    parts = _min_heap(jobs, k)
    loads = [sum(jobs[j] for j in p) for p in parts]
    # Each bucket keeps its jobs sorted by workload so the best partner is a bisect away.
    sorted_parts = [sorted(p, key=lambda j: jobs[j]) for p in parts]
    keys = [[jobs[j] for j in p] for p in sorted_parts]
    # A swap moving delta > 0 from the max bucket to a lighter one with both ending below the old
    # max lowers the sum of squared loads, so this loop terminates.
    while True:
        top = max(range(k), key=lambda b: loads[b])
        best = None  # (new pair max, top job index, other bucket, other job index)
        for ia, wa in enumerate(keys[top]):
            for b in range(k):
                gap = loads[top] - loads[b]
                if b == top or gap <= 0:
                    continue
                # ideal partner weight moves half the gap: wb = wa - gap / 2
                pos = bisect.bisect_left(keys[b], wa - gap / 2)
                for ib in (pos - 1, pos):
                    if 0 <= ib < len(keys[b]):
                        delta = wa - keys[b][ib]
                        if 0 < delta < gap:
                            pair_max = max(loads[top] - delta, loads[b] + delta)
                            if best is None or pair_max < best[0]:
                                best = (pair_max, ia, b, ib)
        if best is None:
            return sorted_parts
        _, ia, b, ib = best
        ja, jb = sorted_parts[top][ia], sorted_parts[b][ib]
        delta = jobs[ja] - jobs[jb]
        loads[top] -= delta
        loads[b] += delta
        for bucket, old, new in ((top, ia, jb), (b, ib, ja)):
            del sorted_parts[bucket][old]
            del keys[bucket][old]
            pos = bisect.bisect_left(keys[bucket], jobs[new])
            sorted_parts[bucket].insert(pos, new)
            keys[bucket].insert(pos, jobs[new])


def _zigzag(jobs: list[float], k: int) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(k)]
    for j in range(len(jobs)):
        rnd, pos = divmod(j, k)
        parts[pos if rnd % 2 == 0 else k - 1 - pos].append(j)
    return parts


def _sequential(jobs: list[float], k: int) -> list[list[int]]:
    cap = -(-len(jobs) // k)
    return [list(range(b * cap, min((b + 1) * cap, len(jobs)))) for b in range(k)]


_SOLVERS = {
    DispatchAlg.MIN_HEAP: _min_heap,
    DispatchAlg.LPT_SWAP: _lpt_swap,
    DispatchAlg.ZIGZAG: _zigzag,
    DispatchAlg.SEQUENTIAL: _sequential,
}
