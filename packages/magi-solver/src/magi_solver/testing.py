"""Masks and document lengths for tests, benchmarks and experiments (pure python, seeded)."""

from __future__ import annotations

import random

from magi_solver.band import Band
from magi_solver.config import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_solver.types import AttnMask


def random_mask(
    rng: random.Random, seqlen_q: int, seqlen_k: int | None = None, max_slices: int = 8, max_tries: int = 64
) -> AttnMask:
    """A mask of up to ``max_slices`` random slices of all four types, disjoint in cells (slices may
    share q rows and k columns), with ``sq != sk`` in general and possibly empty rows."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    want = rng.randint(1, max_slices)
    q: list[tuple[int, int]] = []
    k: list[tuple[int, int]] = []
    t: list[int] = []
    bands: list[Band] = []
    for _ in range(max_tries):
        if len(q) == want or seqlen_q == 0 or seqlen_k == 0:
            break
        qs = rng.randrange(seqlen_q)
        qe = rng.randint(qs + 1, seqlen_q)
        ks = rng.randrange(seqlen_k)
        ke = rng.randint(ks + 1, seqlen_k)
        typ = rng.randrange(4)
        b = Band.from_slice(qs, qe, ks, ke, typ)
        if any(not b.intersect(o).is_empty() for o in bands):
            continue
        bands.append(b)
        q.append((qs, qe))
        k.append((ks, ke))
        t.append(typ)
    return AttnMask(q, k, t, seqlen_q, seqlen_k)


def long_tailed_lengths(total: int, num_docs: int, seed: int = 0) -> list[int]:
    """``num_docs`` lengths summing to ``total``, log-normal (long tail), each at most ``total // 4``."""
    rng = random.Random(seed)
    raw = [rng.lognormvariate(0.0, 1.6) for _ in range(num_docs)]
    cap = total // 4
    scale = total / sum(raw)
    lens = [max(1, min(cap, int(x * scale))) for x in raw]
    i = 0
    while sum(lens) != total:  # spread the rounding error over documents that have room
        d = total - sum(lens)
        j = i % num_docs
        step = max(-lens[j] + 1, min(cap - lens[j], d))
        lens[j] += step
        i += 1
    return lens


def cu_seqlens(lens: list[int]) -> list[int]:
    """Cumulative lengths ``[0, l0, l0 + l1, ...]``."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def plan_config(
    chunk: int = 16,
    degree: int | None = 1,
    alg: str = "min_heap",
    min_chunk: int = 8,
    max_chunks: int = 8,
    overlap_alg: str = "uniform",
) -> DistAttnConfig:
    """A planner config for tests: ``chunk``-token chunks dispatched by ``alg``, a static
    overlap ``degree`` (None: dynamic, up to 4) with remote chunks of at least ``min_chunk``
    tokens, at most ``max_chunks`` of them, grouped by ``overlap_alg``."""
    overlap = (
        OverlapConfig(
            mode="dynamic",
            degree=None,
            dynamic_max_degree=4,
            min_chunk_size=min_chunk,
            max_num_chunks=max_chunks,
        )
        if degree is None
        else OverlapConfig(
            degree=degree, min_chunk_size=min_chunk, max_num_chunks=max_chunks, alg=overlap_alg
        )
    )
    return DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=chunk, alg=alg), overlap_config=overlap)
