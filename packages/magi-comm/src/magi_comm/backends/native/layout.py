"""The receive buffer's layout and the copy tasks of a call: regions, rounds, tasks, blocks.

Pure host code (no CUDA, NVSHMEM or Triton): everything is a function of a cached plan
(:mod:`magi_comm._plan`) and a few integers, computed once per (plan, row size) by the backend
and unit-tested on the CPU. The layout (regions, the pairing rule that makes them need no
exchange, rounds, fields, tasks and blocks): ``packages/magi-comm/docs/native.md`` ("Receive
buffer").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..._plan import _prefix
from .config import MIB

__all__ = [
    "MAX_PEERS",
    "SINK_CONCAT",
    "SINK_NONE",
    "SINK_SCATTER",
    "BlockTable",
    "Round",
    "Schedule",
    "TaskTable",
    "apply_blocks",
    "build_schedule",
    "bytes_needed",
    "field_offsets",
    "grown_capacity",
    "region_index",
    "region_rows",
    "reserved_capacity",
    "row_bytes",
    "to_blocks",
    "word_size",
]

MAX_PEERS = 8  # ranks of one group (one NVLink node): peer columns of the copy kernel

SINK_SCATTER = "scatter"  # group_cast: row q from s -> output row scatter[recv_off[s] + q]
SINK_CONCAT = "concat"  # group_reduce: row q from s -> receive row recv_off[s] + q (a2av layout)
SINK_NONE = "none"  # fused group_reduce: rows stay in the regions (self rows in the input)

_ALIGN = 16  # bytes; field areas and the capacity are multiples of this
_UNBOUNDED = 1 << 62  # region_rows when there is no peer (world size 1)


def region_index(src: int, dst: int) -> int:
    """Index of source ``src``'s region in the buffer of ``dst`` (``src != dst``)."""
    return src - (src > dst)


def _align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def region_rows(capacity: int, world_size: int, field_row_bytes: tuple[int, ...]) -> int:
    """Rows per region for a call whose fields have rows of ``field_row_bytes`` bytes.

    The largest ``R`` such that the ``W - 1`` regions of every field, each field area aligned
    to 16 bytes, fit in ``capacity`` bytes. 0 means that not even one row fits (the backend
    then grows the buffer; every rank sees the same row sizes, so they all decide alike).
    ``1 << 62`` when there is no peer (world size 1) or the rows are empty.
    """
    peers = world_size - 1
    per_row = sum(field_row_bytes)
    if peers <= 0 or per_row == 0:
        return _UNBOUNDED
    # Each field area is padded by < 16 bytes; reserve 16 per field.
    usable = capacity - _ALIGN * len(field_row_bytes)
    return max(0, usable // (peers * per_row))


def field_offsets(world_size: int, rows: int, field_row_bytes: tuple[int, ...]) -> tuple[int, ...]:
    """Byte offset of each field's area in the buffer (16-byte aligned, fields in order)."""
    peers = max(0, world_size - 1)
    offs, pos = [], 0
    for rb in field_row_bytes:
        offs.append(pos)
        pos = _align(pos + peers * rows * rb) if rows < _UNBOUNDED else pos
    return tuple(offs)


def bytes_needed(world_size: int, field_row_bytes: tuple[int, ...], rows: int = 1) -> int:
    """Smallest capacity with ``region_rows(...) >= rows``."""
    peers = world_size - 1
    if peers <= 0:
        return 0
    return peers * rows * sum(field_row_bytes) + _ALIGN * len(field_row_bytes)


def _mib_ceil(nbytes: int) -> int:
    return (nbytes + MIB - 1) // MIB * MIB


def grown_capacity(current: int, needed: int, *, factor: float = 2.0) -> int:
    """Growth policy: at least ``needed``, at least ``factor`` x ``current``, 1 MiB aligned."""
    return _mib_ceil(max(needed, int(current * factor), 1))


def reserved_capacity(needed: int, room: int) -> int:
    """The capacity a reserve of ``needed`` bytes grows the buffer to: the need and an eighth
    more, 1 MiB aligned, cut to ``room`` (what the heap leaves the buffer, whole MiB where the
    alignment matters); 0 when the need itself does not fit ``room``.

    Not :func:`grown_capacity`'s doubling: a reserve knows its need, and the next plans' needs
    differ by a few percent (each mask has its own; cp 4 128k: 782 and 801 MB), so the eighth
    keeps them from growing it again, where growing to the first need and then doubling took
    1492 MiB for them (docs/perf.md)."""
    if needed > room:
        return 0
    return min(_mib_ceil(needed + needed // 8), room)


def word_size(row_bytes: int, *tensors: torch.Tensor) -> int:
    """Widest copy word (8, 4, 2 or 1 bytes) dividing the row size and every tensor's address."""
    for w in (8, 4, 2, 1):
        if row_bytes % w:
            continue
        if all(t.data_ptr() % w == 0 and (t.storage_offset() * t.element_size()) % w == 0 for t in tensors):
            return w
    return 1


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (everything after the first dimension) of ``t``."""
    return torch.Size(t.shape[1:]).numel() * t.element_size()


# --------------------------------------------------------------------------------------------
# tasks


@dataclass(frozen=True, eq=False)
class TaskTable:
    """Copy tasks in rows. ``dst_row`` has ``W + 1`` columns (peers 0..W-1, then the sink); -1 = none.

    Shapes: ``src_row``/``nrows`` int64 ``(T,)``, ``dst_row`` int64 ``(T, W + 1)``.

    Send tables of a group_cast also say where a task lies in the pair's splits, for peers that
    take rows straight into their output (direct mode, see the backend): ``split_idx`` int64
    ``(T, W)``, the index of the task's input split among the splits sent to peer ``c`` (-1 =
    none), and ``within`` int64 ``(T,)``, the task's first row inside that split. A task never
    crosses an input split then. None where no direct write can happen.
    """

    src_row: torch.Tensor
    nrows: torch.Tensor
    dst_row: torch.Tensor
    split_idx: torch.Tensor | None = None
    within: torch.Tensor | None = None

    @property
    def num_tasks(self) -> int:
        return int(self.src_row.numel())

    @property
    def num_rows(self) -> int:
        return int(self.nrows.sum()) if self.num_tasks else 0

    @staticmethod
    def empty(world_size: int) -> TaskTable:
        z = torch.empty(0, dtype=torch.int64)
        return TaskTable(z, z, torch.empty(0, world_size + 1, dtype=torch.int64))


def _runs(src: torch.Tensor, dst: torch.Tensor, key: torch.Tensor | None = None) -> TaskTable:
    """Maximal runs of items that are consecutive in ``src`` and in every valid ``dst`` column.

    ``src``: int64 ``(M,)`` source rows in item order; ``dst``: int64 ``(C, M)``, -1 = not sent;
    ``key``: int64 ``(M,)`` or None, a value that must stay the same within a run. A new run
    starts where the source jumps, the set of valid columns changes, a valid destination jumps
    or the key changes. Returns the runs and the item index where each one starts.
    """
    m = int(src.numel())
    if m == 0:
        return TaskTable.empty(dst.shape[0] - 1)
    valid = dst >= 0
    cont = torch.zeros(m, dtype=torch.bool)
    if m > 1:
        same_cols = (valid[:, 1:] == valid[:, :-1]).all(0)
        dst_step = (~valid[:, 1:] | (dst[:, 1:] == dst[:, :-1] + 1)).all(0)
        cont[1:] = (src[1:] == src[:-1] + 1) & same_cols & dst_step
        if key is not None:
            cont[1:] &= key[1:] == key[:-1]
    starts = torch.nonzero(~cont).flatten()
    ends = torch.cat([starts[1:], torch.tensor([m])])
    return TaskTable(src[starts].clone(), ends - starts, dst[:, starts].t().contiguous())


@dataclass(frozen=True, eq=False)
class Round:
    """One round: the send tasks (input -> peer regions, and in round 0 self rows -> sink),
    the peers that get a chunk from us (to signal), the peers we get a chunk from (to wait
    for), and the receive tasks (own regions -> sink)."""

    send: TaskTable
    recv: TaskTable
    send_peers: tuple[int, ...]
    recv_peers: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Schedule:
    """All rounds of one call of one rank, for ``region_rows`` rows per region."""

    region_rows: int
    rounds: tuple[Round, ...]

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)


def build_schedule(plan, rows_per_region: int, sink: str) -> Schedule:
    """Rounds and copy tasks of ``plan`` (a CastPlan or ReducePlan) on its rank.

    Args:
        plan: the cached plan; uses ``rank``, ``world_size``, ``send_counts``, ``recv_counts``,
            ``gather_index`` and (for ``SINK_SCATTER``) ``scatter_index``.
        rows_per_region: ``R`` from :func:`region_rows` (>= 1).
        sink: ``SINK_SCATTER`` (rows land in ``output`` through the plan's scatter index),
            ``SINK_CONCAT`` (rows land in a receive buffer laid out like the a2av backend's:
            sources ascending, rows in order) or ``SINK_NONE`` (rows from peers stay in the
            regions and rows to self are not moved: the fused reduction reads them in place;
            no receive tasks).
    """
    if rows_per_region < 1:
        raise ValueError(f"rows_per_region must be >= 1, got {rows_per_region}")
    if sink not in (SINK_SCATTER, SINK_CONCAT, SINK_NONE):
        raise ValueError(f"unknown sink {sink!r}")
    R = rows_per_region
    gather = plan.gather_index
    if gather is None:
        gather = torch.arange(plan.num_send_rows, dtype=torch.int64)
    sink_rows = _sink_rows(plan, sink)
    # Casts keep each task inside one input split, with its split index per peer (direct mode).
    splits = _split_positions(plan) if sink == SINK_SCATTER and plan.num_input_rows else None
    rounds = []
    for k in range(_num_rounds(plan, R, sink)):
        send, send_peers = _send_tasks(plan, k, R, sink, gather, sink_rows, splits)
        recv, recv_peers = _recv_tasks(plan, k, R, sink, sink_rows)
        rounds.append(Round(send, recv, send_peers, recv_peers))
    return Schedule(R, tuple(rounds))


def _sink_rows(plan, sink: str):
    """``rows(s, q)``: the sink rows of the ``q``-th rows (a tensor) that source ``s`` sends."""
    recv_off = _prefix(list(plan.recv_counts))
    scatter = getattr(plan, "scatter_index", None) if sink == SINK_SCATTER else None

    def rows(s: int, q: torch.Tensor) -> torch.Tensor:
        at = recv_off[s] + q
        return at if scatter is None else scatter[at]

    return rows


def _num_rounds(plan, R: int, sink: str) -> int:
    """Rounds of a call: the most any pair needs, and round 0 for rows to self alone (unless
    they stay where they are, ``SINK_NONE``)."""
    r = plan.rank
    pairs = [n for c, n in enumerate(plan.send_counts) if c != r]
    pairs += [n for c, n in enumerate(plan.recv_counts) if c != r]
    own = 1 if plan.send_counts[r] > 0 and sink != SINK_NONE else 0
    return max([-(-n // R) for n in pairs] + [own])


def _split_positions(plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(split_of, within_of, pair_pos)``: per input row its input split and its row inside
    that split; per (peer, input split) the split's index among the splits sent to that peer
    (-1: not sent there)."""
    n_in, W, r = plan.num_input_rows, plan.world_size, plan.rank
    in_sizes = torch.tensor(plan.input_split_sizes, dtype=torch.int64)
    split_of = torch.repeat_interleave(torch.arange(in_sizes.numel()), in_sizes, output_size=n_in)
    within_of = torch.arange(n_in) - (torch.cumsum(in_sizes, 0) - in_sizes)[split_of]
    pair_pos = torch.full((W, in_sizes.numel()), -1, dtype=torch.int64)
    for d, ids in enumerate(plan.send_split_ids):
        if d != r and ids:
            pair_pos[d, list(ids)] = torch.arange(len(ids))
    return split_of, within_of, pair_pos


def _send_tasks(plan, k: int, R: int, sink: str, gather: torch.Tensor, sink_rows, splits):
    """Round ``k``'s send tasks (input rows -> peer regions, and in round 0 rows to self ->
    sink) and the peers they reach. ``splits``: :func:`_split_positions` for a cast (tasks
    then stay inside one input split and carry its position per peer), else None."""
    W, r = plan.world_size, plan.rank
    lo, hi = k * R, (k + 1) * R
    send_off = _prefix(list(plan.send_counts))
    dst = torch.full((W + 1, plan.num_input_rows), -1, dtype=torch.int64)
    peers = []
    for d, cnt in enumerate(plan.send_counts):
        stream = gather[send_off[d] : send_off[d] + cnt]
        if d == r:
            if k == 0 and cnt and sink != SINK_NONE:
                dst[W, stream] = sink_rows(r, torch.arange(cnt, dtype=torch.int64))
        elif cnt > lo:
            peers.append(d)
            q = torch.arange(lo, min(hi, cnt), dtype=torch.int64)
            dst[d, stream[q]] = region_index(r, d) * R + (q - lo)
    items = torch.nonzero((dst >= 0).any(0)).flatten()
    if splits is None:
        return _runs(items, dst[:, items]), tuple(peers)
    split_of, within_of, pair_pos = splits
    send = _runs(items, dst[:, items], split_of[items])
    at = send.src_row  # the first input row of each task
    split_idx = torch.where(send.dst_row[:, :W] >= 0, pair_pos[:, split_of[at]].t(), -1)
    send = TaskTable(send.src_row, send.nrows, send.dst_row, split_idx.contiguous(), within_of[at])
    return send, tuple(peers)


def _recv_tasks(plan, k: int, R: int, sink: str, sink_rows) -> tuple[TaskTable, tuple[int, ...]]:
    """Round ``k``'s receive tasks (own regions -> sink; none for ``SINK_NONE``) and the peers
    whose rows arrive in it."""
    W, r = plan.world_size, plan.rank
    lo, hi = k * R, (k + 1) * R
    srcs, sinks, peers = [], [], []
    for s, cnt in enumerate(plan.recv_counts):
        if s == r or cnt <= lo:
            continue
        peers.append(s)
        q = torch.arange(lo, min(hi, cnt), dtype=torch.int64)
        srcs.append(region_index(s, r) * R + (q - lo))
        sinks.append(sink_rows(s, q))
    if not srcs or sink == SINK_NONE:
        return TaskTable.empty(W), tuple(peers)
    src_rows = torch.cat(srcs)
    dst = torch.full((W + 1, src_rows.numel()), -1, dtype=torch.int64)
    dst[W] = torch.cat(sinks)
    # a task stays inside one region: it waits for one source's rows (recv_waits)
    region = torch.cat([torch.full((x.numel(),), i, dtype=torch.int64) for i, x in enumerate(srcs)])
    return _runs(src_rows, dst, region), tuple(peers)


# --------------------------------------------------------------------------------------------
# blocks


@dataclass(frozen=True, eq=False)
class BlockTable:
    """A TaskTable in copy words, cut into blocks of ``block_words`` words.

    ``blk_task`` int32 ``(B,)``, ``blk_start`` int64 ``(B,)`` (word offset inside the task),
    ``task_src``/``task_len`` int64 ``(T,)`` (words), ``task_dst`` int64 ``(T, W + 1)`` (word
    offsets, -1 = none); for direct writes ``task_split`` int64 ``(T, W)`` (the task's split
    among the pair's splits, -1 = none) and ``task_within`` int64 ``(T,)`` (words from the
    split's start to the task's).
    """

    blk_task: torch.Tensor
    blk_start: torch.Tensor
    task_src: torch.Tensor
    task_len: torch.Tensor
    task_dst: torch.Tensor
    task_split: torch.Tensor
    task_within: torch.Tensor
    block_words: int
    has_splits: bool = False  # some task can go straight into a peer's output (a cast's sends)

    @property
    def num_blocks(self) -> int:
        return int(self.blk_task.numel())

    def to(self, device, mover=None) -> BlockTable:
        """Copy to ``device``; ``mover(tensor, device)`` replaces ``tensor.to(device)`` if given."""

        def mv(t):
            return t.to(device) if mover is None else mover(t, device)

        return BlockTable(
            mv(self.blk_task),
            mv(self.blk_start),
            mv(self.task_src),
            mv(self.task_len),
            mv(self.task_dst),
            mv(self.task_split),
            mv(self.task_within),
            self.block_words,
            self.has_splits,
        )


def to_blocks(table: TaskTable, row_words: int, block_words: int) -> BlockTable:
    """Convert a row TaskTable into word offsets and cut every task into blocks."""
    if block_words < 1 or block_words & (block_words - 1):
        raise ValueError(f"block_words must be a power of two, got {block_words}")
    task_len = table.nrows * row_words
    task_src = table.src_row * row_words
    task_dst = torch.where(table.dst_row >= 0, table.dst_row * row_words, -1)
    nblk = (task_len + block_words - 1) // block_words
    total = int(nblk.sum()) if nblk.numel() else 0
    blk_task = torch.repeat_interleave(torch.arange(nblk.numel(), dtype=torch.int64), nblk, output_size=total)
    first = torch.cumsum(nblk, 0) - nblk
    blk_start = (torch.arange(total, dtype=torch.int64) - first[blk_task]) * block_words
    T, W = table.dst_row.shape[0], table.dst_row.shape[1] - 1
    if table.split_idx is None:
        task_split = torch.full((T, W), -1, dtype=torch.int64)
        task_within = torch.zeros(T, dtype=torch.int64)
    else:
        task_split = table.split_idx.contiguous()
        assert table.within is not None  # given with split_idx
        task_within = table.within * row_words
    return BlockTable(
        blk_task.to(torch.int32),
        blk_start,
        task_src,
        task_len,
        task_dst.contiguous(),
        task_split,
        task_within,
        block_words,
        bool((task_split >= 0).any()),  # on the host, before the table moves to the GPU
    )


def apply_blocks(
    table: BlockTable,
    src: torch.Tensor,
    sink: torch.Tensor,
    peers: Sequence[torch.Tensor | None],
    world_size: int,
    direct: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> None:
    """Reference implementation of the copy kernel on flat word tensors (tests, CPU).

    Block ``b`` copies ``src[task_src + start : ... + block_words]`` (clipped to the task) to
    ``peers[c][task_dst[t, c] + start ...]`` for every valid peer column and to ``sink`` for
    column ``W``. ``direct[c] = (target, split_start)`` (a peer in direct mode) replaces the
    peer's region: the rows go to ``target[split_start[task_split[t, c]] + task_within[t] +
    start ...]`` (word offsets), straight into that peer's output.
    """
    bw = table.block_words
    for b in range(table.num_blocks):
        t = int(table.blk_task[b])
        start = int(table.blk_start[b])
        n = min(bw, int(table.task_len[t]) - start)
        s0 = int(table.task_src[t]) + start
        vals = src[s0 : s0 + n]
        for c in range(world_size + 1):
            off = int(table.task_dst[t, c])
            if off < 0:
                continue
            target = sink if c == world_size else peers[c]
            peer_direct = direct[c] if c < world_size and direct is not None else None
            if peer_direct is not None:
                target, split_start = peer_direct
                off = int(split_start[int(table.task_split[t, c])]) + int(table.task_within[t])
            assert target is not None, f"the table writes column {c}, which has no region"
            target[off + start : off + start + n] = vals
