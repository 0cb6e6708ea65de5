"""``make_plan``: dispatch, zero-redundancy K/V communication plan and overlap stages.

Only K/V move (self-attention: q and k are the same token axis). Per rank the mask is cut, as
bands, by its own rows, then by the owner of each key column; the remote columns it reads are
received exactly once, grouped into stages, and every received row is read by some slice.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from magi_solver.band import Band
from magi_solver.config import DispatchConfig, DistAttnConfig
from magi_solver.dispatch import solve_dispatch
from magi_solver.overlap import (
    ChunkCost,
    best_degree,
    group_chunks,
    no_overlap_cost,
    overlap_cost,
    stage_costs,
)
from magi_solver.plan_models import (
    CalcMeta,
    CommMeta,
    DistAttnPlan,
    GroupCastArgs,
    PlanStats,
    RankPlan,
    StageCalc,
)
from magi_solver.types import AttnMask, merge_intervals

Interval = tuple[int, int]


def chunk_grid(total_seqlen: int, cp_size: int, config: DispatchConfig) -> tuple[int, int, int]:
    """``(chunk_size, num_chunks, padded_seqlen)``: chunks of at most ``config.chunk_size`` tokens,
    at least ``min_chunks_per_rank`` per rank, ``num_chunks`` a multiple of ``cp_size``."""
    per_rank = cp_size * config.min_chunks_per_rank
    cs = max(1, min(config.chunk_size, -(-total_seqlen // per_rank)))
    num_chunks = -(-total_seqlen // (cs * cp_size)) * cp_size
    return cs, num_chunks, num_chunks * cs


def make_plan(
    mask: AttnMask,
    cp_size: int,
    config: DistAttnConfig | None = None,
    *,
    degree_agreement: Callable[[int], int] | None = None,
) -> DistAttnPlan:
    """Plan context-parallel attention of ``mask`` over ``cp_size`` ranks.

    Args:
        mask: a self-attention mask (``total_seqlen_q == total_seqlen_k``).
        cp_size: number of ranks, ``>= 1``.
        config: dispatch and overlap settings (``DistAttnConfig()`` by default).
        degree_agreement: in dynamic overlap mode, maps this process's chosen degree to the one all
            ranks use (magi-dist passes a cross-rank MAX); the plan already takes the max over
            the ranks it computes, so ``None`` is right whenever all ranks plan the same mask.
    Returns:
        A :class:`DistAttnPlan`.
    """
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask: expected an AttnMask, got {type(mask).__name__}")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size: must be an int >= 1, got {cp_size!r}")
    config = DistAttnConfig() if config is None else config
    if not isinstance(config, DistAttnConfig):
        raise TypeError(f"config: expected a DistAttnConfig, got {type(config).__name__}")
    if mask.total_seqlen_q != mask.total_seqlen_k:
        raise ValueError(
            f"mask: a distributed plan needs self-attention (total_seqlen_q == total_seqlen_k), "
            f"got {mask.total_seqlen_q} and {mask.total_seqlen_k}"
        )
    if mask.total_seqlen_q == 0:
        raise ValueError("mask: total_seqlen_q is 0; there is nothing to dispatch")

    cs, num_chunks, padded = chunk_grid(mask.total_seqlen_q, cp_size, config.dispatch_config)
    shard = padded // cp_size
    bands = [b for b in mask.bands() if not b.is_empty()]
    chunk_bands, workloads = _chunk_workloads(bands, cs, num_chunks)
    dispatch = solve_dispatch(workloads, cp_size, config.dispatch_config.alg)
    layout = _Layout.build(dispatch.bucket_partitions, cs)

    geoms = [_RankGeometry.build(r, layout, bands, chunk_bands, config) for r in range(cp_size)]
    ov = config.overlap_config
    degrees = [best_degree(g.host_cost, g.chunk_costs, ov) for g in geoms]
    degree = max(degrees)
    if degree_agreement is not None and ov.mode.value == "dynamic":
        degree = int(degree_agreement(degree))

    for g in geoms:
        g.assign_stages(degree, ov.alg, layout.shard)
    comm = _comm_args(geoms, layout, max(degree, 1))

    ranks = []
    for g in geoms:
        ranks.append(
            RankPlan(
                rank=g.rank,
                host_chunks=layout.parts[g.rank],
                host_ranges=[(a, b) for a, b, _ in g.host_ranges],
                calc=g.calc_meta(layout.shard),
                comm=CommMeta(stages=comm[g.rank]),
                area=g.area,
                estimated_cost=g.estimated_cost,
            )
        )
    stats = _stats(ranks, cp_size, shard)
    return DistAttnPlan(
        mask=mask,
        cp_size=cp_size,
        config=config,
        chunk_size=cs,
        num_chunks=num_chunks,
        padded_seqlen=padded,
        shard_seqlen=shard,
        chunk_workloads=workloads,
        dispatch=dispatch,
        overlap_degree=degree,
        ranks=ranks,
        stats=stats,
    )


def _chunk_workloads(bands: list[Band], cs: int, num_chunks: int) -> tuple[list[list[int]], list[int]]:
    """Band ids touching each chunk's rows, and each chunk's mask area."""
    chunk_bands: list[list[int]] = [[] for _ in range(num_chunks)]
    work = [0] * num_chunks
    for i, b in enumerate(bands):
        a, e = b.nonempty_rows()
        for c in range(a // cs, (e - 1) // cs + 1):
            area = b.clip_rows(c * cs, (c + 1) * cs).area()
            if area:
                chunk_bands[c].append(i)
                work[c] += area
    return chunk_bands, work


@dataclass
class _Layout:
    """Who owns which chunk, and where it sits in its owner's local buffer."""

    parts: list[list[int]]
    cs: int
    shard: int
    # maximal runs of consecutive chunks with one owner: global start/end, owner, owner-local start
    run_starts: list[int]
    run_ends: list[int]
    run_owner: list[int]
    run_local: list[int]

    @staticmethod
    def build(parts: list[list[int]], cs: int) -> _Layout:
        owner: dict[int, int] = {}
        local: dict[int, int] = {}
        for r, chunks in enumerate(parts):
            for pos, c in enumerate(chunks):
                owner[c], local[c] = r, pos * cs
        starts: list[int] = []
        ends: list[int] = []
        owners: list[int] = []
        locs: list[int] = []
        for c in range(len(owner)):
            if owners and owners[-1] == owner[c] and local[c] == locs[-1] + (ends[-1] - starts[-1]):
                ends[-1] += cs
            else:
                starts.append(c * cs)
                ends.append((c + 1) * cs)
                owners.append(owner[c])
                locs.append(local[c])
        shard = len(parts[0]) * cs
        return _Layout(parts, cs, shard, starts, ends, owners, locs)

    def host_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """Merged global ranges of ``rank``'s chunks with their local start."""
        out: list[list[int]] = []
        for pos, c in enumerate(self.parts[rank]):
            if out and out[-1][1] == c * self.cs:
                out[-1][1] += self.cs
            else:
                out.append([c * self.cs, (c + 1) * self.cs, pos * self.cs])
        return [(a, b, lo) for a, b, lo in out]

    def split_by_owner(self, g0: int, g1: int) -> list[tuple[int, int, int, int]]:
        """``[g0, g1)`` cut by owner: ``(g0', g1', owner, owner-local start)``."""
        out = []
        for i in _overlapping(self.run_starts, self.run_ends, g0, g1):
            a, b = max(g0, self.run_starts[i]), min(g1, self.run_ends[i])
            out.append((a, b, self.run_owner[i], self.run_local[i] + a - self.run_starts[i]))
        return out


def _overlapping(starts: Sequence[int], ends: Sequence[int], c0: int, c1: int) -> range:
    """Indices of sorted disjoint intervals that meet ``[c0, c1)``."""
    i = bisect.bisect_right(ends, c0)
    j = bisect.bisect_left(starts, c1)
    return range(i, max(i, j))


def _split_band(b: Band) -> tuple[Interval, Interval | None]:
    """``(touched columns, core)`` of a non-empty band.

    The core ``[f0, f1)`` holds the columns that every non-empty row sees (row spans have
    non-decreasing ends, so it is ``[left end of the last row, right end of the first row)``):
    there the band is a full rectangle, whatever its diagonals. The rest of the touched columns,
    the ragged edges, is at most ``2 * rows`` wide. ``core`` is None when it is empty.
    """
    a, e = b.nonempty_rows()
    first, last = b.row_span(a), b.row_span(e - 1)
    core = (last[0], first[1]) if last[0] < first[1] else None
    return (first[0], last[1]), core


def _cut_band(
    b: Band, dq: int, starts: list[int], ends: list[int], locs: list[int], group_end: list[int] | None = None
) -> list[tuple[int, Band]]:
    """``b`` (rows moved by ``dq``) cut by the sorted disjoint intervals ``[starts[i], ends[i])``,
    each piece moved to its interval's buffer start ``locs[i]``: ``(interval index, piece)`` for
    the non-empty pieces, in interval order.

    The intervals form groups (``group_end[g]`` is one past the last interval of group g; one
    group when None), and the intervals of a group lie one after another in its buffer. A run of
    two or more intervals of one group that lie inside ``b``'s core is a single full rectangle:
    one piece, reported with the run's first index. Every other interval gives the piece it
    always did. So a band yields about as many pieces as its ragged edges meet intervals, plus
    one per group, rather than one per interval it reads, and the work is that size too.
    """
    (c0, c1), core = _split_band(b)
    idx = _overlapping(starts, ends, c0, c1)
    ia = ib = idx.start
    if core is not None:
        ia = bisect.bisect_left(starts, core[0], idx.start, idx.stop)
        ib = max(ia, bisect.bisect_right(ends, core[1], idx.start, idx.stop))
    out: list[tuple[int, Band]] = []

    def cut(i: int) -> None:
        piece = b.clip_cols(starts[i], ends[i])
        if not piece.is_empty():
            out.append((i, piece.shifted(dq, locs[i] - starts[i])))

    for i in range(idx.start, ia):
        cut(i)
    i = ia
    while i < ib:
        j = ib if group_end is None else min(ib, group_end[bisect.bisect_right(group_end, i)])
        if j - i >= 2:
            a, e = b.nonempty_rows()
            l1 = locs[j - 1] + ends[j - 1] - starts[j - 1]
            out.append((i, Band(a + dq, e + dq, locs[i], l1, None, None)))
        else:
            cut(i)
        i = j
    for i in range(ib, idx.stop):
        cut(i)
    return out


def _integral(events: list[tuple[int, int]], points: list[int]) -> list[int]:
    """``W(x) = sum of w(k) over k < x`` at each of the sorted ``points``, where ``w`` is the step
    function of ``events`` ``(position, delta)``: ``w(k)`` = the sum of the deltas at positions <= k."""
    events.sort()
    out, i, d, dp = [], 0, 0, 0
    for x in points:
        while i < len(events) and events[i][0] <= x:
            d += events[i][1]
            dp += events[i][1] * events[i][0]
            i += 1
        out.append(d * x - dp)
    return out


@dataclass
class _RankGeometry:
    """One rank's bands (own rows), host pieces, needed remote columns and their stages.

    Every step is near-linear in the bands and intervals (see `_cut_band`): a band's core is
    handled as one rectangle, and only its ragged edges are cut interval by interval.
    """

    rank: int
    config: DistAttnConfig
    host_ranges: list[tuple[int, int, int]]
    rows: list[tuple[Band, int]]  # (band clipped to own rows, global->local row shift)
    host_bands: list[Band]
    remote_chunks: list[list[Interval]]
    chunk_costs: list[ChunkCost]
    host_cost: float
    area: int
    stage_runs: list[list[tuple[int, int, int]]] = field(default_factory=list)  # (g0, g1, buf start)
    stage_bands: list[list[Band]] = field(default_factory=list)
    estimated_cost: float = 0.0
    kv_concat: bool = False

    @staticmethod
    def build(
        rank: int, layout: _Layout, bands: list[Band], chunk_bands: list[list[int]], config: DistAttnConfig
    ) -> _RankGeometry:
        host = layout.host_ranges(rank)
        h_starts, h_ends, h_locs = [h[0] for h in host], [h[1] for h in host], [h[2] for h in host]
        rows = _own_rows(host, layout.cs, bands, chunk_bands)
        # host ranges lie one after another in the local buffer: one group
        host_bands = [p for b, dq in rows for _, p in _cut_band(b, dq, h_starts, h_ends, h_locs)]
        # remote columns: the columns the rows touch, less the host ranges
        needed = _subtract(merge_intervals(b.touched_cols() for b, _ in rows), host)
        ov = config.overlap_config
        total = sum(e - s for s, e in needed)
        target = max(ov.min_chunk_size, -(-total // ov.max_num_chunks))
        chunks = _cut(needed, target)
        # calc cost of each chunk: area of the rank's bands over the chunk's columns. Edges are
        # cut piece by piece; cores are rectangles, summed over each piece by one sweep.
        p_starts, p_ends, p_chunk = [], [], []
        for ci, pieces in enumerate(chunks):
            for s, e in pieces:
                p_starts.append(s)
                p_ends.append(e)
                p_chunk.append(ci)
        area_per_chunk = [0] * len(chunks)
        core_events: list[tuple[int, int]] = []
        for b, _ in rows:
            (c0, c1), core = _split_band(b)
            f0, f1 = core if core is not None else (c1, c1)
            for x0, x1 in ((c0, f0), (f1, c1)):
                for i in _overlapping(p_starts, p_ends, x0, x1):
                    piece = b.clip_cols(max(p_starts[i], x0), min(p_ends[i], x1))
                    area_per_chunk[p_chunk[i]] += piece.area()
            if core is not None:
                a, e = b.nonempty_rows()
                core_events += [(f0, e - a), (f1, a - e)]
        w = _integral(core_events, [x for s, e in zip(p_starts, p_ends) for x in (s, e)])
        for i, ci in enumerate(p_chunk):
            area_per_chunk[ci] += w[2 * i + 1] - w[2 * i]
        costs = [
            ChunkCost(ov.comm_cost_factor * sum(e - s for s, e in pieces), ov.calc_cost_factor * a)
            for pieces, a in zip(chunks, area_per_chunk)
        ]
        host_area = sum(b.area() for b, _ in rows) - sum(area_per_chunk)
        return _RankGeometry(
            rank=rank,
            config=config,
            host_ranges=host,
            rows=rows,
            host_bands=host_bands,
            remote_chunks=chunks,
            chunk_costs=costs,
            host_cost=ov.calc_cost_factor * host_area,
            area=host_area + sum(area_per_chunk),
        )

    def assign_stages(self, degree: int, alg, shard: int) -> None:
        """Group remote chunks into stages, lay out each stage buffer, cut bands by stage columns."""
        self._layout_stages(degree, alg, shard)
        self._cut_stage_bands()

    def _layout_stages(self, degree: int, alg, shard: int) -> None:
        """Stages (groups of remote chunks), the estimated cost, and each stage's runs of
        columns with their place in the stage buffer (``stage_runs``)."""
        self.kv_concat = degree == 0
        groups = (
            [list(range(len(self.remote_chunks)))]
            if degree == 0
            else group_chunks(self.chunk_costs, degree, alg)
        )
        self.estimated_cost = (
            no_overlap_cost(self.host_cost, self.chunk_costs)
            if degree == 0
            else overlap_cost(self.host_cost, stage_costs(self.chunk_costs, groups))
        )
        base = shard if self.kv_concat else 0
        self.stage_runs = []
        for g in groups:
            runs: list[list[int]] = []
            off = base
            for ci in g:
                for s, e in self.remote_chunks[ci]:
                    if runs and runs[-1][1] == s:
                        runs[-1][1] = e
                    else:
                        runs.append([s, e, off])
                    off += e - s
            self.stage_runs.append([(a, b, o) for a, b, o in runs])

    def _cut_stage_bands(self) -> None:
        """``stage_bands``: the rows' bands cut by the stages' columns, in buffer coordinates."""
        # stages are contiguous groups of globally ordered chunks, so all runs are sorted together,
        # and the runs of one stage lie one after another in its buffer
        flat = [(a, b, o, t) for t, runs in enumerate(self.stage_runs) for a, b, o in runs]
        starts, ends, locs = [f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat]
        stage_end = list(itertools.accumulate(len(runs) for runs in self.stage_runs))
        self.stage_bands = [[] for _ in self.stage_runs]
        for b, dq in self.rows:
            for i, piece in _cut_band(b, dq, starts, ends, locs, stage_end):
                self.stage_bands[flat[i][3]].append(piece)

    def calc_meta(self, shard: int) -> CalcMeta:
        recv = [sum(b - a for a, b, _ in runs) for runs in self.stage_runs]
        if self.kv_concat:
            host = _stage_calc([], shard)
            remote = [_stage_calc(self.host_bands + self.stage_bands[0], shard + recv[0])]
        else:
            host = _stage_calc(self.host_bands, shard)
            remote = [_stage_calc(bs, n) for bs, n in zip(self.stage_bands, recv)]
        return CalcMeta(host=host, remote=remote, kv_concat=self.kv_concat)


def _own_rows(
    host: list[tuple[int, int, int]], cs: int, bands: list[Band], chunk_bands: list[list[int]]
) -> list[tuple[Band, int]]:
    """The bands clipped to a rank's own rows (``host``: its (global start, end, local start)
    ranges of whole chunks of ``cs`` rows), each with its global -> local row shift."""
    rows: list[tuple[Band, int]] = []
    for g0, g1, l0 in host:
        ids = sorted({i for c in range(g0 // cs, g1 // cs) if c < len(chunk_bands) for i in chunk_bands[c]})
        for i in ids:
            b = bands[i].clip_rows(g0, g1)
            if not b.is_empty():
                rows.append((b, l0 - g0))
    return rows


def _subtract(intervals: list[Interval], holes: list[tuple[int, int, int]]) -> list[Interval]:
    """Sorted disjoint ``intervals`` less the sorted disjoint ``holes`` (``(start, end, ...)``)."""
    out: list[Interval] = []
    j = 0
    for s, e in intervals:
        while j < len(holes) and holes[j][1] <= s:
            j += 1
        k = j
        while s < e:
            if k < len(holes) and holes[k][0] < e:
                if holes[k][0] > s:
                    out.append((s, holes[k][0]))
                s = max(s, holes[k][1])
                k += 1
            else:
                out.append((s, e))
                break
    return out


def _cut(intervals: list[Interval], target: int) -> list[list[Interval]]:
    """Cut sorted intervals, in order, into chunks of ``target`` tokens (the last may be short)."""
    chunks: list[list[Interval]] = []
    cur: list[Interval] = []
    fill = 0
    for s, e in intervals:
        while s < e:
            take = min(e - s, target - fill)
            cur.append((s, s + take))
            s += take
            fill += take
            if fill == target:
                chunks.append(cur)
                cur, fill = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def _stage_calc(bands: list[Band], total_seqlen_k: int) -> StageCalc:
    q, k, t = [], [], []
    area = 0
    for b in bands:
        slices, n = b.slices_and_area()
        area += n
        for qs, qe, ks, ke, typ in slices:
            q.append((qs, qe))
            k.append((ks, ke))
            t.append(typ)
    return StageCalc(q_ranges=q, k_ranges=k, attn_types=t, total_seqlen_k=total_seqlen_k, area=area)


def _comm_args(geoms: list[_RankGeometry], layout: _Layout, num_stages: int) -> list[list[GroupCastArgs]]:
    """Group-cast arguments of every rank and stage (see docs/api.md for the pairing rule)."""
    cp = len(geoms)
    shard = layout.shard
    out: list[list[GroupCastArgs]] = [[] for _ in range(cp)]
    for t in range(num_stages):
        # receiver r needs owner-local rows [l0, l1) of sender s; kept in global order per receiver
        requests: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        recv_pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
        for g in geoms:
            runs = g.stage_runs[t] if t < len(g.stage_runs) else []
            for a, b, _ in runs:
                for a2, b2, s, l0 in layout.split_by_owner(a, b):
                    requests[s].append((l0, l0 + b2 - a2, g.rank))
                    recv_pieces[g.rank].append((s, l0, l0 + b2 - a2))
        cuts: list[list[int]] = []
        for s in range(cp):
            reqs = requests.get(s, [])
            pts = sorted({0, shard, *(x for l0, l1, _ in reqs for x in (l0, l1))})
            cuts.append(pts)
            starts_at: dict[int, list[int]] = defaultdict(list)
            ends_at: dict[int, list[int]] = defaultdict(list)
            for l0, l1, r in reqs:
                starts_at[l0].append(r)
                ends_at[l1].append(r)
            active: dict[int, int] = defaultdict(int)
            sizes, dsts = [], []
            for a, b in zip(pts, pts[1:]):
                for r in ends_at.get(a, ()):
                    active[r] -= 1
                for r in starts_at.get(a, ()):
                    active[r] += 1
                sizes.append(b - a)
                dsts.append(sorted(r for r, n in active.items() if n > 0))
            out[s].append(
                GroupCastArgs(input_split_sizes=sizes, output_split_sizes=[], dst_indices=dsts, src_index=[])
            )
        for r in range(cp):
            sizes, srcs = [], []
            for s, l0, l1 in recv_pieces[r]:
                pts = cuts[s]
                i = bisect.bisect_left(pts, l0)
                while pts[i] < l1:
                    sizes.append(min(pts[i + 1], l1) - pts[i])
                    srcs.append(s)
                    i += 1
            send = out[r][t]
            out[r][t] = GroupCastArgs(
                input_split_sizes=send.input_split_sizes,
                output_split_sizes=sizes,
                dst_indices=send.dst_indices,
                src_index=srcs,
            )
    return out


def _stats(ranks: list[RankPlan], cp: int, shard: int) -> PlanStats:
    areas = [r.area for r in ranks]
    mean = sum(areas) / cp
    per_stage = [r.comm.num_recv_tokens_per_stage for r in ranks]
    ring = [(cp - 1) * shard] * cp
    return PlanStats(
        area_per_rank=areas,
        imbalance=max(areas) / mean if mean > 0 else 1.0,
        recv_tokens_per_rank_stage=per_stage,
        recv_tokens_per_rank=[sum(s) for s in per_stage],
        ring_tokens_per_rank=ring,
        allgather_tokens_per_rank=list(ring),
    )
