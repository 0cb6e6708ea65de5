"""Pure host-side layout of the ``native`` backend: receive regions, rounds, copy tasks, blocks.

Nothing here touches CUDA, NVSHMEM or Triton; everything is a function of a cached plan
(:mod:`magi_comm._plan`) and a few integers, so it is unit-tested on the CPU and computed once per
(plan, row size) by the backend.

Receive buffer layout (one symmetric buffer per rank, ``capacity`` bytes, the same on every rank)
------------------------------------------------------------------------------------------------
The buffer of rank ``d`` holds one *region* per peer ``s != d`` (``W - 1`` regions); the region of
source ``s`` has index :func:`region_index` ``(s, d) = s - (s > d)``. A transfer only ever needs
values that both ends know locally (the pairing rule of docs/api.md makes the rows ``s`` sends ``d``,
in ``s``'s input order, equal to the rows ``d`` expects from ``s``, in ``d``'s output order):

* the sender ``s`` writes its ``q``-th row for ``d`` to region row ``q`` of region ``(s, d)``;
* the receiver ``d`` reads its ``q``-th row from ``s`` there and stores it to its *sink* row
  (the output row for group_cast, the concatenated receive row for group_reduce).

No offsets are exchanged for this. (A group_cast receiver in the backend's direct mode instead
publishes, per call, where each pair split starts in its output; send tasks of a cast therefore
stay inside one input split and carry its index among the pair's splits, see
:class:`TaskTable`.) A region holds ``region_rows`` rows
(:func:`region_rows`, from the capacity and the row size of the call); a pair that moves more
rows than that is moved in several *rounds* (round ``k`` carries pair rows
``[k * R, (k + 1) * R)``), with the signal / acknowledgement protocol of the backend between
rounds, so a fixed buffer serves any call. Rows a rank sends to itself never touch the buffer:
they are copied straight from the input into the sink in round 0.

Fields: a call moves one or two *fields* with the same rows (data, and for ``reduce_op="lse"``
the log-sum-exp). Field ``f`` occupies its own area of the buffer (:func:`field_offsets`); rows of
every field use the same region row numbers.

Copy tasks
----------
A :class:`TaskTable` lists maximal runs of rows that are contiguous in the source and in every
destination at once: ``src_row[t] .. src_row[t] + nrows[t]`` goes to ``dst_row[t, c] ..`` for every
column ``c`` with ``dst_row[t, c] >= 0`` (columns ``0..W-1``: the region rows in peer ``c``'s
buffer; column ``W``: the local sink). One task reads its rows once and writes them to every
destination (a true cast: no copy per destination). :func:`to_blocks` cuts tasks into fixed-size
blocks of words for the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._plan import _prefix

__all__ = [
    "MAX_PEERS",
    "PULL_ROW_MASK",
    "PULL_SOURCE_SHIFT",
    "PULL_SPLIT_MASK",
    "PULL_SPLIT_SHIFT",
    "SINK_CONCAT",
    "SINK_NONE",
    "SINK_SCATTER",
    "BlockTable",
    "Round",
    "Schedule",
    "TaskTable",
    "arrival_order",
    "build_pull_terms",
    "build_reduce_terms",
    "build_schedule",
    "bytes_needed",
    "field_offsets",
    "grown_capacity",
    "publish_row",
    "publish_table",
    "recv_waits",
    "reduce_waits",
    "region_index",
    "region_rows",
    "send_progress",
    "to_blocks",
    "unpack_pull_term",
    "word_size",
]

MAX_PEERS = 8  # ranks of one group (one NVLink node): peer columns of the copy kernel

SINK_SCATTER = "scatter"  # group_cast: row q from s -> output row scatter[recv_off[s] + q]
SINK_CONCAT = "concat"  # group_reduce: row q from s -> receive row recv_off[s] + q (a2av layout)
SINK_NONE = "none"  # fused group_reduce: rows stay in the regions (self rows in the input)

_ALIGN = 16  # bytes; field areas and the capacity are multiples of this
# A pull term (build_pull_terms): source << 56 | pair split << 32 | row inside the split.
PULL_SOURCE_SHIFT = 56
PULL_SPLIT_SHIFT = 32
PULL_SPLIT_MASK = (1 << (PULL_SOURCE_SHIFT - PULL_SPLIT_SHIFT)) - 1
PULL_ROW_MASK = (1 << PULL_SPLIT_SHIFT) - 1
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


def grown_capacity(current: int, needed: int, *, factor: float = 2.0) -> int:
    """Growth policy: at least ``needed``, at least ``factor`` x ``current``, 1 MiB aligned."""
    target = max(needed, int(current * factor), 1)
    mib = 1 << 20
    return (target + mib - 1) // mib * mib


def word_size(row_bytes: int, *tensors: torch.Tensor) -> int:
    """Widest copy word (8, 4, 2 or 1 bytes) dividing the row size and every tensor's address."""
    for w in (8, 4, 2, 1):
        if row_bytes % w:
            continue
        if all(t.data_ptr() % w == 0 and (t.storage_offset() * t.element_size()) % w == 0 for t in tensors):
            return w
    return 1


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
    W, r, R = plan.world_size, plan.rank, rows_per_region
    send_counts, recv_counts = list(plan.send_counts), list(plan.recv_counts)
    send_off, recv_off = _prefix(send_counts), _prefix(recv_counts)
    n_in = plan.num_input_rows
    gather = plan.gather_index
    if gather is None:
        gather = torch.arange(plan.num_send_rows, dtype=torch.int64)
    scatter = getattr(plan, "scatter_index", None) if sink == SINK_SCATTER else None
    # Casts keep each task inside one input split, with its split index per peer (direct mode).
    split_of = within_of = pair_pos = None
    if sink == SINK_SCATTER and n_in:
        in_sizes = torch.tensor(plan.input_split_sizes, dtype=torch.int64)
        split_of = torch.repeat_interleave(torch.arange(in_sizes.numel()), in_sizes, output_size=n_in)
        within_of = torch.arange(n_in) - (torch.cumsum(in_sizes, 0) - in_sizes)[split_of]
        pair_pos = torch.full((W, in_sizes.numel()), -1, dtype=torch.int64)
        for d, ids in enumerate(plan.send_split_ids):
            if d != r and ids:
                pair_pos[d, list(ids)] = torch.arange(len(ids))

    def sink_rows(s: int, q: torch.Tensor) -> torch.Tensor:
        rows = recv_off[s] + q
        return rows if scatter is None else scatter[rows]

    def rounds_of(n: int) -> int:
        return -(-n // R)

    k_max = max(
        [rounds_of(send_counts[d]) for d in range(W) if d != r]
        + [rounds_of(recv_counts[s]) for s in range(W) if s != r]
        + [1 if send_counts[r] > 0 and sink != SINK_NONE else 0]
    )
    rounds = []
    for k in range(k_max):
        lo, hi = k * R, (k + 1) * R
        dst = torch.full((W + 1, n_in), -1, dtype=torch.int64)
        send_peers = []
        for d in range(W):
            cnt = send_counts[d]
            stream = gather[send_off[d] : send_off[d] + cnt]
            if d == r:
                if k == 0 and cnt and sink != SINK_NONE:
                    dst[W, stream] = sink_rows(r, torch.arange(cnt, dtype=torch.int64))
                continue
            if cnt <= lo:
                continue
            send_peers.append(d)
            q = torch.arange(lo, min(hi, cnt), dtype=torch.int64)
            dst[d, stream[q]] = region_index(r, d) * R + (q - lo)
        items = torch.nonzero((dst >= 0).any(0)).flatten()
        if split_of is None:
            send = _runs(items, dst[:, items])
        else:
            send = _runs(items, dst[:, items], split_of[items])
            at = send.src_row  # the first input row of each task
            split_idx = torch.where(send.dst_row[:, :W] >= 0, pair_pos[:, split_of[at]].t(), -1)
            send = TaskTable(send.src_row, send.nrows, send.dst_row, split_idx.contiguous(), within_of[at])

        srcs, sinks, recv_peers = [], [], []
        for s in range(W):
            if s == r or recv_counts[s] <= lo:
                continue
            recv_peers.append(s)
            q = torch.arange(lo, min(hi, recv_counts[s]), dtype=torch.int64)
            srcs.append(region_index(s, r) * R + (q - lo))
            sinks.append(sink_rows(s, q))
        if srcs and sink != SINK_NONE:
            src_rows = torch.cat(srcs)
            rdst = torch.full((W + 1, src_rows.numel()), -1, dtype=torch.int64)
            rdst[W] = torch.cat(sinks)
            # a task stays inside one region: it waits for one source's rows (recv_waits)
            region = torch.cat([torch.full((x.numel(),), i, dtype=torch.int64) for i, x in enumerate(srcs)])
            recv = _runs(src_rows, rdst, region)
        else:
            recv = TaskTable.empty(W)
        rounds.append(Round(send, recv, tuple(send_peers), tuple(recv_peers)))
    return Schedule(R, tuple(rounds))


def build_reduce_terms(plan, rows_per_region: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per output row, its reduction terms in ascending source order (fused reduction).

    Only valid when every pair fits one region (``build_schedule(plan, R, SINK_NONE)`` has at
    most one round). Term ``k`` of output row ``j`` is the row ``term_row[j, k]`` of the input
    (``term_self[j, k]``: the rank's own contribution, read where the input holds it) or of the
    local receive regions (a peer's contribution, at region row ``region_index(s, r) * R + q``).

    Returns ``term_row`` int64 ``(N_out, W)``, ``term_self`` int8 ``(N_out, W)``, ``nterms``
    int64 ``(N_out,)``.
    """
    W, r, R = plan.world_size, plan.rank, rows_per_region
    n_out = plan.num_output_rows
    term_row = torch.full((n_out, max(W, 1)), -1, dtype=torch.int64)
    term_self = torch.zeros((n_out, max(W, 1)), dtype=torch.int8)
    nterms = torch.zeros(n_out, dtype=torch.int64)
    recv_counts, send_counts = list(plan.recv_counts), list(plan.send_counts)
    if any(recv_counts[s] > R for s in range(W) if s != r):
        raise ValueError("build_reduce_terms: a pair does not fit one region; use the staged reduction")
    recv_off = torch.tensor([*_prefix(recv_counts), sum(recv_counts)], dtype=torch.int64)
    gather = plan.gather_index
    if gather is None:
        gather = torch.arange(plan.num_send_rows, dtype=torch.int64)
    self_off = _prefix(send_counts)[r]
    self_stream = gather[self_off : self_off + send_counts[r]]
    for k, (out_rows, buf_rows) in enumerate(plan.slots):
        src = torch.searchsorted(recv_off, buf_rows, right=True) - 1
        q = buf_rows - recv_off[src]
        is_self = src == r
        peer_row = (src - (src > r).to(torch.int64)) * R + q
        rows = torch.where(
            is_self, self_stream[torch.where(is_self, q, 0)] if self_stream.numel() else 0, peer_row
        )
        term_row[out_rows, k] = rows
        term_self[out_rows, k] = is_self.to(torch.int8)
        nterms[out_rows] += 1
    return term_row, term_self, nterms


def build_pull_terms(plan, term_row: torch.Tensor, term_self: torch.Tensor, nterms: torch.Tensor,
                     rows_per_region: int) -> torch.Tensor:  # fmt: skip
    """Where each peer term of the fused reduction lies in its source's input, for a source that
    lets this rank read its rows in place (pull, see :mod:`magi_comm.backends._native_protocol`).

    The term at region row ``region_index(s, r) * R + q`` (:func:`build_reduce_terms`) is pair
    row ``q`` of source ``s``: row ``q - start`` of the ``j``-th split ``s`` sends this rank,
    whose first pair row is ``start`` (the splits pair one to one with this rank's output splits
    from ``s``, in order). Returns int64 ``(N_out, W)``: ``s << PULL_SOURCE_SHIFT | j <<
    PULL_SPLIT_SHIFT | (q - start)`` for peer terms, -1 for own and missing terms.
    """
    W, r, R = plan.world_size, plan.rank, rows_per_region
    out = torch.full(term_row.shape, -1, dtype=torch.int64)
    if term_row.numel() == 0:
        return out
    k = torch.arange(term_row.shape[1], dtype=torch.int64)
    peer = (term_self == 0) & (k[None, :] < nterms[:, None]) & (term_row >= 0)
    region = torch.div(term_row, R, rounding_mode="floor")
    source = region + (region >= r).to(torch.int64)
    q = term_row - region * R
    for s in range(W):
        here = peer & (source == s)
        if s == r or not bool(here.any()):
            continue
        sizes = torch.tensor([plan.output_split_sizes[j] for j in plan.recv_split_ids[s]], dtype=torch.int64)
        if sizes.numel() > PULL_SPLIT_MASK:
            raise ValueError(
                f"build_pull_terms: {sizes.numel()} splits from rank {s} do not fit the encoding"
            )
        ends = torch.cumsum(sizes, 0)
        j = torch.searchsorted(ends, q[here], right=True)
        within = q[here] - (ends - sizes)[j]
        out[here] = s << PULL_SOURCE_SHIFT | j << PULL_SPLIT_SHIFT | within
    return out


def unpack_pull_term(term: int) -> tuple[int, int, int]:
    """Inverse of the encoding of :func:`build_pull_terms`: ``(source, split, row)``."""
    return term >> PULL_SOURCE_SHIFT, (term >> PULL_SPLIT_SHIFT) & PULL_SPLIT_MASK, term & PULL_ROW_MASK


def publish_table(plan, map_width: int, pull: tuple[int, int, int] | None = None) -> torch.Tensor:
    """What a reduce's send launch publishes to each destination (see
    :mod:`magi_comm.backends._native_protocol`): int64 ``[W + 1 offsets, words...]``; row ``c``
    (words ``offsets[c]:offsets[c + 1]``) is empty where ``c`` gets no rows, else the header
    of ``c``'s pull-map row.

    ``pull = (allocation, input byte offset, row bytes)`` (the input lies in a symmetric
    allocation): row ``c`` is ``[1 + allocation, byte offset of each input split sent to c]``
    (at most ``map_width`` words; a destination with more splits gets ``[0]``: its rows are
    sent). None: ``[0]`` for every destination (rows sent, read from the regions).
    """
    W, r = plan.world_size, plan.rank
    in_off = _prefix(list(plan.input_split_sizes))
    rows = []
    for c in range(W):
        if c == r or plan.send_counts[c] == 0:
            rows.append([])
            continue
        ids = plan.send_split_ids[c]
        if pull is None or 1 + len(ids) > map_width:
            rows.append([0])
            continue
        alloc, offset, rb = pull
        rows.append([1 + alloc] + [offset + in_off[i] * rb for i in ids])
    offsets = [*_prefix([len(x) for x in rows]), sum(len(x) for x in rows)]
    return torch.tensor(offsets + [w for row in rows for w in row], dtype=torch.int64)


def publish_row(table: torch.Tensor, world_size: int, c: int) -> torch.Tensor:
    """Row ``c`` of a :func:`publish_table` (what destination ``c`` finds in its pull map)."""
    lo, hi = int(table[c]), int(table[c + 1])
    return table[world_size + 1 + lo : world_size + 1 + hi]


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
    peers: list[torch.Tensor],
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
            if c < world_size and direct is not None and direct[c] is not None:
                target, split_start = direct[c]
                off = int(split_start[int(table.task_split[t, c])]) + int(table.task_within[t])
            target[off + start : off + start + n] = vals


# --------------------------------------------------------------------------------------------
# progress (the receive step overlapped with the transfer, see _native_protocol)


def _block_spans(table: BlockTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: its task (int64), its first word inside the task and its length in words."""
    t = table.blk_task.to(torch.int64)
    start = table.blk_start
    n = torch.clamp(table.task_len[t] - start, max=table.block_words)
    return t, start, n


def send_progress(
    table: BlockTable, rank: int, world_size: int, region_rows: int, row_words: int, chunk_blocks: int
) -> torch.Tensor:
    """What the send kernel reports after each chunk of ``chunk_blocks`` blocks (host table).

    Returns int64 ``(chunks, W)``: entry ``(j, c)`` is the number of leading rows of this rank's
    region on peer ``c`` that are complete once blocks ``[0, (j + 1) * chunk_blocks)`` are
    copied (every row before the first word of a block still to come was written by a block
    already done); -1 where the table writes nothing to ``c``. The region of this rank on
    ``c`` starts at word ``region_index(rank, c) * region_rows * row_words`` of ``c``'s field
    area, as the send table's offsets count.
    """
    W, B = world_size, table.num_blocks
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    nch = -(-B // chunk_blocks)
    if B == 0:
        return torch.full((0, W), -1, dtype=torch.int64)
    t, start, n = _block_spans(table)
    dst = table.task_dst[t, :W]
    valid = dst >= 0
    base = torch.tensor(
        [region_index(rank, c) * region_rows * row_words if c != rank else 0 for c in range(W)],
        dtype=torch.int64,
    )
    first = dst + start[:, None] - base
    big = torch.iinfo(torch.int64).max
    pending = torch.where(valid, first, big)
    # the first word of a block still to come, from each block on
    later = torch.flip(torch.cummin(torch.flip(pending, [0]), 0).values, [0])
    total = torch.where(valid, first + n[:, None], 0).amax(0)
    nxt = torch.arange(1, nch + 1, dtype=torch.int64) * chunk_blocks  # the first block after chunk j
    at = torch.where((nxt < B)[:, None], later[torch.clamp(nxt, max=B - 1)], big)
    words = torch.where(at < big, at, total[None, :])
    return torch.where(valid.any(0)[None, :], words // row_words, -1)


def recv_waits(
    table: BlockTable, rank: int, world_size: int, region_rows: int, row_words: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What each block of a receive table waits for before reading the local regions.

    Returns ``(source, rows)``: int32 ``(B,)``, the rank whose region the block reads, and
    int64 ``(B,)``, how many leading rows of that region must be complete (the block's last
    row included). Receive tasks never cross regions (:func:`build_schedule`).
    """
    if table.num_blocks == 0:
        return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    t, start, n = _block_spans(table)
    first = table.task_src[t] + start
    span = region_rows * row_words
    region = first // span
    if bool(((first + n - 1) // span != region).any()):
        raise ValueError("recv_waits: a receive block crosses regions")
    source = region + (region >= rank).to(torch.int64)
    rows = (first + n - region * span + row_words - 1) // row_words
    return source.to(torch.int32), rows


def reduce_waits(
    term_row: torch.Tensor,
    term_self: torch.Tensor,
    nterms: torch.Tensor,
    rank: int,
    world_size: int,
    region_rows: int,
    tile_rows: int,
) -> torch.Tensor:
    """What each tile of ``tile_rows`` output rows of the fused reduction waits for.

    Takes the tables of :func:`build_reduce_terms`. Returns int64 ``(tiles, W)``: entry
    ``(i, s)`` is how many leading rows of source ``s``'s region the tile reads (0: none).
    """
    if tile_rows < 1:
        raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
    n_out, W = term_row.shape[0], world_size
    tiles = -(-n_out // tile_rows)
    need = torch.zeros(tiles * W, dtype=torch.int64)
    if n_out == 0:
        return need.view(tiles, W)
    k = torch.arange(term_row.shape[1], dtype=torch.int64)
    peer = (term_self == 0) & (k[None, :] < nterms[:, None]) & (term_row >= 0)
    region = torch.div(term_row, region_rows, rounding_mode="floor")
    source = region + (region >= rank).to(torch.int64)
    tile = (torch.arange(n_out, dtype=torch.int64) // tile_rows)[:, None].expand_as(term_row)
    idx = (tile * W + source)[peer]
    rows = (term_row - region * region_rows + 1)[peer]
    need.scatter_reduce_(0, idx, rows, reduce="amax")
    return need.view(tiles, W)


def arrival_order(need: torch.Tensor, recv_counts) -> torch.Tensor:
    """The order in which tiles of :func:`reduce_waits` ``need`` become ready when every
    source's rows arrive front to back at the same pace: by the largest fraction of a source's
    rows a tile needs (stable). Returns int32 ``(tiles,)``, tile indices."""
    counts = torch.tensor([max(int(n), 1) for n in recv_counts], dtype=torch.float64)
    frac = (need.to(torch.float64) / counts[None, :]).amax(1) if need.numel() else torch.zeros(need.shape[0])
    return torch.sort(frac, stable=True).indices.to(torch.int32)
