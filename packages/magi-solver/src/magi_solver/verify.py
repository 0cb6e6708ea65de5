"""Brute-force checks of a plan, cell by cell (small sizes: tests and research notebooks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from magi_solver.band import Band
from magi_solver.plan_models import DistAttnPlan, GroupCastArgs, RankPlan, StageCalc

T = TypeVar("T")


class PlanError(AssertionError):
    """A plan violates one of its invariants."""


def simulate_group_cast(args: Sequence[GroupCastArgs], inputs: Sequence[Sequence[T]]) -> list[list[T]]:
    """Pure-python group_cast with docs/api.md semantics: ``inputs[r]`` is rank r's input rows; returns
    every rank's output rows. Raises :class:`PlanError` when the ranks' arguments do not pair up."""
    cp = len(args)
    sent: dict[tuple[int, int], list[list[T]]] = {}
    for s, a in enumerate(args):
        if sum(a.input_split_sizes) != len(inputs[s]):
            raise PlanError(
                f"rank {s}: input splits sum to {sum(a.input_split_sizes)}, input has {len(inputs[s])}"
            )
        if len(a.dst_indices) != len(a.input_split_sizes):
            raise PlanError(f"rank {s}: {len(a.dst_indices)} dst lists for {len(a.input_split_sizes)} splits")
        pos = 0
        for size, dsts in zip(a.input_split_sizes, a.dst_indices):
            for r in dsts:
                if not 0 <= r < cp:
                    raise PlanError(f"rank {s}: destination {r} out of range")
                sent.setdefault((s, r), []).append(list(inputs[s][pos : pos + size]))
            pos += size
    outputs = []
    for r, a in enumerate(args):
        if len(a.src_index) != len(a.output_split_sizes):
            raise PlanError(f"rank {r}: {len(a.src_index)} sources for {len(a.output_split_sizes)} splits")
        taken: dict[int, int] = {}
        out: list[T] = []
        for size, s in zip(a.output_split_sizes, a.src_index):
            queue = sent.get((s, r), [])
            i = taken.get(s, 0)
            if i >= len(queue) or len(queue[i]) != size:
                raise PlanError(
                    f"rank {r}: output split of size {size} from rank {s} has no matching input split"
                )
            out += queue[i]
            taken[s] = i + 1
        for (s, dst), queue in sent.items():
            if dst == r and taken.get(s, 0) != len(queue):
                raise PlanError(
                    f"rank {r}: {len(queue) - taken.get(s, 0)} splits from rank {s} are never received"
                )
        outputs.append(out)
    return outputs


def _cells(calc: StageCalc) -> list[tuple[int, int]]:
    cells: list[tuple[int, int]] = []
    for (qs, qe), (ks, ke), t in zip(calc.q_ranges, calc.k_ranges, calc.attn_types):
        b = Band.from_slice(qs, qe, ks, ke, t)
        a, e = b.nonempty_rows()
        for q in range(a, e):
            lo, hi = b.row_span(q)
            cells.extend((q, k) for k in range(lo, hi))
    return cells


def check_plan(plan: DistAttnPlan) -> None:
    """Check every invariant of ``plan`` by enumerating cells (cost ~ mask area).

    Per rank: the union over stages of calc cells, mapped to global coordinates, equals that rank's
    rows of the mask, each cell once; each slice reads only rows that are local or received in its
    stage; every received row is read; no row is received twice or is local. Also: the group-cast
    arguments of every stage pair up across ranks, and local rows follow ascending chunk ids.
    """
    pos = [plan.position_ids(r) for r in range(plan.cp_size)]
    num_stages = _check_layout(plan, pos)
    received = [simulate_group_cast([r.comm.stages[t] for r in plan.ranks], pos) for t in range(num_stages)]

    dense = plan.mask.to_dense()
    for r in plan.ranks:
        want = {(q, k) for q in pos[r.rank] if q < plan.total_seqlen for k, v in enumerate(dense[q]) if v}
        stages = [(r.calc.host, pos[r.rank])] if not r.calc.kv_concat else []
        for t, calc in enumerate(r.calc.remote):
            buf = received[t][r.rank]
            stages.append((calc, pos[r.rank] + buf if r.calc.kv_concat else buf))
        _check_received_rows(r.rank, pos[r.rank], [rows[r.rank] for rows in received])
        got: list[tuple[int, int]] = []
        for calc, kv in stages:
            got += _stage_cells(plan, r, calc, pos[r.rank], kv)
        if len(got) != len(set(got)):
            raise PlanError(f"rank {r.rank}: a cell is computed twice")
        if set(got) != want:
            raise PlanError(
                f"rank {r.rank}: {len(want - set(got))} mask cells missing, {len(set(got) - want)} extra"
            )
        if r.area != len(got):
            raise PlanError(f"rank {r.rank}: area {r.area} != {len(got)}")


def _check_layout(plan: DistAttnPlan, pos: list[list[int]]) -> int:
    """Chunks assigned once, local rows in ascending chunk order; returns the (common) number of stages."""
    chunks = sorted(c for r in plan.ranks for c in r.host_chunks)
    if chunks != list(range(plan.num_chunks)):
        raise PlanError("chunks are not assigned exactly once")
    for r in plan.ranks:
        if r.host_chunks != sorted(r.host_chunks) or len(pos[r.rank]) != plan.shard_seqlen:
            raise PlanError(f"rank {r.rank}: local layout is not its chunks in ascending order")
    num_stages = {len(r.comm.stages) for r in plan.ranks}
    if len(num_stages) != 1:
        raise PlanError(f"ranks disagree on the number of stages: {num_stages}")
    return num_stages.pop()


def _check_received_rows(rank: int, local_rows: list[int], received: list[list[int]]) -> None:
    """No row is received twice (within a stage or across stages) or is already local."""
    seen_remote: set[int] = set()
    local = set(local_rows)
    for t, rows in enumerate(received):
        if set(rows) & local or seen_remote & set(rows) or len(set(rows)) != len(rows):
            raise PlanError(f"rank {rank} stage {t}: a row is received twice or is already local")
        seen_remote |= set(rows)


def _stage_cells(
    plan: DistAttnPlan, r: RankPlan, calc: StageCalc, local: list[int], kv: list[int]
) -> list[tuple[int, int]]:
    """The global cells one stage computes, after checking them against its buffers (``local``: the
    global row of each query row, ``kv``: of each key row); a remote stage must read every row it
    receives."""
    if calc.total_seqlen_k != len(kv):
        raise PlanError(f"rank {r.rank}: stage total_seqlen_k {calc.total_seqlen_k} != buffer {len(kv)}")
    cells = _cells(calc)
    if len(cells) != calc.area:
        raise PlanError(f"rank {r.rank}: stage area {calc.area} != {len(cells)} cells")
    got: list[tuple[int, int]] = []
    used: set[int] = set()
    for q, k in cells:
        if not (0 <= q < plan.shard_seqlen and 0 <= k < len(kv)):
            raise PlanError(f"rank {r.rank}: cell ({q}, {k}) outside the stage buffers")
        got.append((local[q], kv[k]))
        used.add(k)
    remote_rows = set(range(plan.shard_seqlen, len(kv))) if r.calc.kv_concat else set(range(len(kv)))
    if calc is not r.calc.host and not remote_rows <= used:
        raise PlanError(f"rank {r.rank}: {len(remote_rows - used)} received rows are never read")
    return got
