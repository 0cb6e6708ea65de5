"""The fused reduction's term tables and the pull maps' encoding (host side, pure torch).

A fused ``sum`` / ``avg`` reads each output row's terms where they lie: the rank's own input,
its receive regions, or, for a source that lets it pull, that source's input. These tables say
where; the publish table is what a reduce's send launch writes into its destinations' pull
maps. The protocol around them: ``packages/magi-comm/docs/native.md`` ("Pull").
"""

from __future__ import annotations

import torch

from ..._plan import _prefix

__all__ = [
    "PULL_ROW_MASK",
    "PULL_SOURCE_SHIFT",
    "PULL_SPLIT_MASK",
    "PULL_SPLIT_SHIFT",
    "build_pull_terms",
    "build_reduce_terms",
    "publish_row",
    "publish_table",
    "unpack_pull_term",
]

# A pull term (build_pull_terms): source << 56 | pair split << 32 | row inside the split.
PULL_SOURCE_SHIFT = 56
PULL_SPLIT_SHIFT = 32
PULL_SPLIT_MASK = (1 << (PULL_SOURCE_SHIFT - PULL_SPLIT_SHIFT)) - 1
PULL_ROW_MASK = (1 << PULL_SPLIT_SHIFT) - 1


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
    lets this rank read its rows in place (pull, docs/native.md).

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
    docs/native.md, "Pull"): int64 ``[W + 1 offsets, words...]``; row ``c``
    (words ``offsets[c]:offsets[c + 1]``) is empty where ``c`` gets no rows, else the header
    of ``c``'s pull-map row.

    ``pull = (allocation, input byte offset, row bytes)`` (the input lies in a symmetric
    allocation): row ``c`` is ``[1 + allocation, byte offset of each input split sent to c]``
    (at most ``map_width`` words; a destination with more splits gets ``[0]``: its rows are
    sent). None: ``[0]`` for every destination (rows sent, read from the regions).
    """
    W, r = plan.world_size, plan.rank
    in_off = _prefix(list(plan.input_split_sizes))
    rows: list[list[int]] = []
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
