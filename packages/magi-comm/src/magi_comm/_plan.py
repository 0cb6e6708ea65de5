"""Communication plans: the permutation metadata of one group_cast / group_reduce call.

A plan is a pure function of the split lists, the caller's rank and the world size. It holds
everything a backend needs besides the tensors: per-peer row counts for the all-to-all-v, the
row index that gathers the send buffer out of ``input`` and the row indices that scatter (or
reduce) the receive buffer into ``output``. Plans are built once and cached by
:class:`magi_comm.GroupCollective`, so a repeated call costs one dict lookup.

Layout conventions (the ``a2av`` backend relies on them, a native backend may too):

* send buffer = for each destination rank ``d`` ascending, the input splits that go to ``d``
  in input order (a split sent to several ranks appears once per rank);
* receive buffer = for each source rank ``s`` ascending, the segments ``s`` sent us, in the
  order ``s`` sent them, which by the contract of docs/api.md is our output order restricted to
  ``s``.

Everything here is validated strictly (``operator.index`` on every entry) because the lists
often come from user code or from JSON plans; the error names the argument and the value.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["CastPlan", "PairSignature", "ReducePlan", "build_cast_plan", "build_reduce_plan"]

# Polynomial hash over a split-size sequence (for the debug-mode cross-rank check). Kept below
# 2**62 so it fits in an int64 tensor.
_HASH_MOD = (1 << 61) - 1
_HASH_MUL = 1_000_003


@dataclass(frozen=True)
class PairSignature:
    """What one rank sends to (or expects from) one peer: rows, splits, hash of split sizes."""

    rows: int
    num_splits: int
    sizes_hash: int

    @staticmethod
    def of(sizes: Sequence[int]) -> PairSignature:
        h = 0
        for s in sizes:
            h = (h * _HASH_MUL + s + 1) % _HASH_MOD
        return PairSignature(sum(sizes), len(sizes), h)


@dataclass(frozen=True, eq=False)
class _DeviceIndices:
    gather: torch.Tensor | None
    scatter: torch.Tensor | None
    slots: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    sources_per_row: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class _PlanBase:
    rank: int
    world_size: int
    num_input_rows: int
    num_output_rows: int
    send_counts: tuple[int, ...]  # rows to each rank (all-to-all input split sizes)
    recv_counts: tuple[int, ...]  # rows from each rank (all-to-all output split sizes)
    send_signatures: tuple[PairSignature, ...]
    recv_signatures: tuple[PairSignature, ...]
    # int64 CPU row index: send buffer row k = input row gather_index[k]; None = identity.
    gather_index: torch.Tensor | None
    # The split structure (a native backend writes straight into a peer's output split by split):
    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    send_split_ids: tuple[tuple[int, ...], ...]  # per peer: the input splits it gets, in order
    recv_split_ids: tuple[tuple[int, ...], ...]  # per peer: the output splits it fills, in order
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def num_send_rows(self) -> int:
        return sum(self.send_counts)

    @property
    def num_recv_rows(self) -> int:
        return sum(self.recv_counts)

    def _move(self, device: torch.device) -> _DeviceIndices:  # pragma: no cover - abstract
        raise NotImplementedError

    def indices_on(self, device: torch.device) -> _DeviceIndices:
        """The plan's index tensors on ``device`` (copied once, then cached)."""
        key = str(device)
        cached = self._on_device.get(key)
        if cached is None:
            cached = self._move(device)
            self._on_device[key] = cached
        return cached


@dataclass(frozen=True, eq=False)
class CastPlan(_PlanBase):
    """Plan of a group_cast. ``scatter_index[k]`` = output row of receive-buffer row ``k``."""

    scatter_index: torch.Tensor | None = None  # None = identity (receive straight into output)

    def _move(self, device: torch.device) -> _DeviceIndices:
        def mv(t):
            return None if t is None else t.to(device, non_blocking=True)

        return _DeviceIndices(mv(self.gather_index), mv(self.scatter_index), (), None)


@dataclass(frozen=True, eq=False)
class ReducePlan(_PlanBase):
    """Plan of a group_reduce.

    ``slots[k] = (out_rows, buf_rows)``: for every output row that has at least ``k + 1``
    sources, its ``k``-th smallest source rank sent the receive-buffer row ``buf_rows[i]`` for
    output row ``out_rows[i]``. Rows within one slot are distinct, so applying slot 0, 1, ...
    with ``index_add_`` reduces every row in ascending source-rank order with no write
    conflicts: deterministic on CPU and GPU.
    """

    slots: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    sources_per_row: torch.Tensor | None = None  # int64 (num_output_rows,) for "avg"

    def _move(self, device: torch.device) -> _DeviceIndices:
        def mv(t):
            return None if t is None else t.to(device, non_blocking=True)

        return _DeviceIndices(
            mv(self.gather_index),
            None,
            tuple((mv(o), mv(b)) for o, b in self.slots),
            mv(self.sources_per_row),
        )


# --------------------------------------------------------------------------------------------
# helpers


def _expand_ranges(starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """Concatenate ``range(starts[i], starts[i] + lengths[i])`` for all i, vectorized."""
    if not lengths:
        return torch.empty(0, dtype=torch.int64)
    st = torch.tensor(starts, dtype=torch.int64)
    ln = torch.tensor(lengths, dtype=torch.int64)
    total = int(ln.sum())
    # Position of each range inside the result; row p of range i is starts[i] + (p - begin[i]).
    begin = torch.cumsum(ln, 0) - ln
    return torch.repeat_interleave(st - begin, ln, output_size=total) + torch.arange(total)


def _is_identity(starts: Sequence[int], lengths: Sequence[int], total: int) -> bool:
    """True when the ranges tile [0, total) in order (then the gather/scatter is a no-op)."""
    pos = 0
    for s, n in zip(starts, lengths):
        if n == 0:
            continue
        if s != pos:
            return False
        pos += n
    return pos == total


def _as_int(value, what: str, op: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {what} must be an int, got {value!r} ({type(value).__name__})") from None


def _check_sizes(sizes: Sequence, name: str, op: str) -> list[int]:
    out = []
    for i, v in enumerate(sizes):
        n = _as_int(v, f"{name}[{i}]", op)
        if n < 0:
            raise ValueError(f"{op}: {name}[{i}] = {n} is negative")
        out.append(n)
    return out


def _check_rank(value, what: str, op: str, world: int) -> int:
    r = _as_int(value, what, op)
    if not 0 <= r < world:
        raise ValueError(
            f"{op}: {what} = {r} is not a rank of the group (world_size {world}, valid 0..{world - 1})"
        )
    return r


def _check_rank_list(ranks, name: str, op: str, world: int) -> list[int]:
    if isinstance(ranks, torch.Tensor):
        ranks = ranks.tolist()
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"{op}: {name} must be a list of ranks, got {ranks!r} ({type(ranks).__name__})")
    out = [_check_rank(r, f"{name}[{k}]", op, world) for k, r in enumerate(ranks)]
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: {name} = {out} names a rank more than once")
    return out


def check_split_sums(
    op: str, in_sum: int, out_sum: int, input_rows: int | None, output_rows: int | None
) -> None:
    if input_rows is not None and in_sum != input_rows:
        raise ValueError(f"{op}: input_split_sizes sum to {in_sum}, but input has {input_rows} rows")
    if output_rows is not None and out_sum != output_rows:
        raise ValueError(f"{op}: output_split_sizes sum to {out_sum}, but output has {output_rows} rows")


def _prefix(sizes: Sequence[int]) -> list[int]:
    off, acc = [], 0
    for s in sizes:
        off.append(acc)
        acc += s
    return off


def _self_pair_check(op, rank, sent: list[int], received: list[int]) -> None:
    # The rank's own send-to-self and receive-from-self splits are both known locally, so the
    # one-to-one rule of docs/api.md can be checked for free without any communication.
    if sent != received:
        raise ValueError(
            f"{op}: rank {rank} sends itself splits of sizes {sent} but its output splits from "
            f"itself have sizes {received}; they must match one to one, in order"
        )


# --------------------------------------------------------------------------------------------
# builders


def _checked_args(
    op: str,
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    per_input: Sequence,
    per_output: Sequence,
    names: tuple[str, str],
    world_size: int,
    input_rows: int | None,
    output_rows: int | None,
) -> tuple[list[int], list[int], list[list[int]], list[list[int]]]:
    """Validated ``(in_sizes, out_sizes, ranks per input split, ranks per output split)``.

    ``names``: the rank arguments of ``op`` (per input split, per output split). The cast names
    a list of ranks per input split and one rank per output split, the reduce the other way
    round; both come back as lists (the reduce's source lists sorted: its fixed order).
    """
    in_sizes = _check_sizes(input_split_sizes, "input_split_sizes", op)
    out_sizes = _check_sizes(output_split_sizes, "output_split_sizes", op)
    check_split_sums(op, sum(in_sizes), sum(out_sizes), input_rows, output_rows)
    for ranks, sizes, name, split in (
        (per_input, in_sizes, names[0], "input_split_sizes"),
        (per_output, out_sizes, names[1], "output_split_sizes"),
    ):
        if len(ranks) != len(sizes):
            raise ValueError(f"{op}: len({name}) = {len(ranks)} != len({split}) = {len(sizes)}")
    cast = op == "group_cast"

    def ranks_of(x, name: str, many: bool) -> list[int]:
        if not many:
            return [_check_rank(x, name, op, world_size)]
        ranks = _check_rank_list(x, name, op, world_size)
        return ranks if cast else sorted(ranks)

    ins = [ranks_of(x, f"{names[0]}[{i}]", cast) for i, x in enumerate(per_input)]
    outs = [ranks_of(x, f"{names[1]}[{j}]", not cast) for j, x in enumerate(per_output)]
    return in_sizes, out_sizes, ins, outs


def _by_peer(world_size: int, ranks_per_split: list[list[int]]) -> list[list[int]]:
    """Split ids per peer, in split order (the pairing order of docs/api.md)."""
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i, ranks in enumerate(ranks_per_split):
        for r in ranks:
            out[r].append(i)
    return out


def _pair_fields(op, rank, world_size, in_sizes, out_sizes, sends, recvs) -> dict:
    """The fields both plans share: row totals, per-peer counts and signatures, gather index."""
    send_sizes = [[in_sizes[i] for i in sends[d]] for d in range(world_size)]
    recv_sizes = [[out_sizes[j] for j in recvs[s]] for s in range(world_size)]
    _self_pair_check(op, rank, send_sizes[rank], recv_sizes[rank])
    in_off = _prefix(in_sizes)
    g_starts = [in_off[i] for d in range(world_size) for i in sends[d]]
    g_lens = [in_sizes[i] for d in range(world_size) for i in sends[d]]
    gather = None if _is_identity(g_starts, g_lens, sum(in_sizes)) else _expand_ranges(g_starts, g_lens)
    return dict(
        rank=rank,
        world_size=world_size,
        num_input_rows=sum(in_sizes),
        num_output_rows=sum(out_sizes),
        send_counts=tuple(sum(x) for x in send_sizes),
        recv_counts=tuple(sum(x) for x in recv_sizes),
        send_signatures=tuple(PairSignature.of(x) for x in send_sizes),
        recv_signatures=tuple(PairSignature.of(x) for x in recv_sizes),
        gather_index=gather,
        input_split_sizes=tuple(in_sizes),
        output_split_sizes=tuple(out_sizes),
        send_split_ids=tuple(tuple(x) for x in sends),
        recv_split_ids=tuple(tuple(x) for x in recvs),
    )


def _common(op, input_split_sizes, output_split_sizes, per_input, per_output, names, rank, world_size,
            input_rows, output_rows) -> tuple[list[int], list[list[int]], list[list[int]], dict]:  # fmt: skip
    """What both builders start with: ``(out_sizes, ranks per output split, output split ids
    per peer, the shared plan fields)``, after validating the lists (see :func:`_checked_args`)."""
    in_sizes, out_sizes, dsts, srcs = _checked_args(
        op,
        input_split_sizes,
        output_split_sizes,
        per_input,
        per_output,
        names,
        world_size,
        input_rows,
        output_rows,
    )
    sends, recvs = _by_peer(world_size, dsts), _by_peer(world_size, srcs)
    return out_sizes, srcs, recvs, _pair_fields(op, rank, world_size, in_sizes, out_sizes, sends, recvs)


def build_cast_plan(
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    dst_indices: Sequence[Sequence[int]],
    src_index: Sequence[int],
    rank: int,
    world_size: int,
    input_rows: int | None = None,
    output_rows: int | None = None,
) -> CastPlan:
    """Build (without caching) the plan of a group_cast; validates the lists.

    ``input_rows`` / ``output_rows`` (the tensors' first dims), when given, are checked against
    the split sums first, since a wrong sum is the root cause of most other inconsistencies.
    Raises ValueError / TypeError naming the offending argument and value.
    """
    out_sizes, _, recvs, fields = _common(
        "group_cast", input_split_sizes, output_split_sizes, dst_indices, src_index,
        ("dst_indices", "src_index"), rank, world_size, input_rows, output_rows,
    )  # fmt: skip
    out_off = _prefix(out_sizes)
    s_starts = [out_off[j] for s in range(world_size) for j in recvs[s]]
    s_lens = [out_sizes[j] for s in range(world_size) for j in recvs[s]]
    # Every output row belongs to exactly one split with exactly one source, so the receive
    # buffer is a permutation of the output rows.
    scatter = None if _is_identity(s_starts, s_lens, sum(out_sizes)) else _expand_ranges(s_starts, s_lens)
    return CastPlan(**fields, scatter_index=scatter)


def build_reduce_plan(
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    dst_index: Sequence[int],
    src_indices: Sequence[Sequence[int]],
    rank: int,
    world_size: int,
    input_rows: int | None = None,
    output_rows: int | None = None,
) -> ReducePlan:
    """Build (without caching) the plan of a group_reduce; validates the lists (see build_cast_plan)."""
    out_sizes, srcs, recvs, fields = _common(
        "group_reduce", input_split_sizes, output_split_sizes, dst_index, src_indices,
        ("dst_index", "src_indices"), rank, world_size, input_rows, output_rows,
    )  # fmt: skip

    # Offset in the receive buffer of the segment source s sent for output split j.
    buf_pos: dict[tuple[int, int], int] = {}
    pos = 0
    for s in range(world_size):
        for j in recvs[s]:
            buf_pos[(s, j)] = pos
            pos += out_sizes[j]

    out_off = _prefix(out_sizes)
    max_sources = max((len(ss) for ss in srcs), default=0)
    slots = []
    for k in range(max_sources):
        js = [j for j, ss in enumerate(srcs) if len(ss) > k and out_sizes[j] > 0]
        lens = [out_sizes[j] for j in js]
        out_rows = _expand_ranges([out_off[j] for j in js], lens)
        buf_rows = _expand_ranges([buf_pos[(srcs[j][k], j)] for j in js], lens)
        if out_rows.numel():
            slots.append((out_rows, buf_rows))
    sources_per_row = torch.repeat_interleave(
        torch.tensor([len(ss) for ss in srcs], dtype=torch.int64),
        torch.tensor(out_sizes, dtype=torch.int64),
        output_size=sum(out_sizes),
    )
    return ReducePlan(**fields, slots=tuple(slots), sources_per_row=sources_per_row)
