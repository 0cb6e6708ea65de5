"""What the overlapped receive step waits for: the send kernel's progress reports, the rows each
receive block and each fused-reduction tile reads (host side, pure torch).

How the reports and waits work: ``packages/magi-comm/docs/native.md`` ("Receive copy beside the
transfer").
"""

from __future__ import annotations

import torch

from .layout import BlockTable, region_index

__all__ = ["arrival_order", "recv_waits", "reduce_waits", "send_progress"]


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
    row included). Receive tasks never cross regions (:func:`~.layout.build_schedule`).
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

    Takes the tables of :func:`~.terms.build_reduce_terms`. Returns int64 ``(tiles, W)``: entry
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
