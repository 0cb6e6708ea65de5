"""Pipeline helpers (device side): named barriers, TMA tile loads, K/V/Q pipelines."""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync


class NamedBarrier(enum.IntEnum):
    # 0 is __syncthreads
    SchedWG1 = 1
    SchedWG2 = 2
    SchedWG3 = 3
    Epilogue = 4
    PdS = 5  # backward: dS written to / read from shared memory by both consumer warpgroups
    # backward: a consumer warpgroup's float32 dQ tile in shared memory (+ warpgroup index) is
    # free to write (the dQ writer warp's reduce-add has read it) / written (ready to add)
    DQEmptyWG1 = 6
    DQEmptyWG2 = 7
    DQFullWG1 = 8
    DQFullWG2 = 9


def tma_pipeline(barrier_ptr, num_stages: int, tx_bytes: int, consumer_warps: int):
    """A TMA pipeline of ``num_stages`` stages: one producer thread, ``consumer_warps`` MMA warps."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_ptr,
        num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_bytes,
        defer_sync=True,
    )


def make_tma_pipelines(storage, cfg, bytes_q: int, bytes_k: int, bytes_v: int):
    """The forward's Q (1 stage), K and V (cfg.num_stages each) pipelines."""
    warps = cfg.num_mma_wg * 4
    return (
        tma_pipeline(storage.mbar_q.data_ptr(), 1, bytes_q, warps),
        tma_pipeline(storage.mbar_k.data_ptr(), cfg.num_stages, bytes_k, warps),
        tma_pipeline(storage.mbar_v.data_ptr(), cfg.num_stages, bytes_v, warps),
    )


def tma_load_rows(atom, g_rows: cute.Tensor, row0, tile_rows: int, tile_cols: int, s_dst, stage, bar_ptr):
    """TMA-load rows [row0, row0 + tile_rows) of the 2-D (rows, cols) tma tensor into s_dst.

    s_dst is (tile_rows, tile_cols) or, with ``stage`` not None, (tile_rows, tile_cols, STAGES).
    Rows past the end of the tensor are zero-filled by the TMA unit.
    """
    g_tile = cute.local_tile(cute.domain_offset((row0, 0), g_rows), (tile_rows, tile_cols), (0, 0))
    s_part, g_part = cpasync.tma_partition(
        atom,
        0,
        cute.make_layout(1),
        cute.group_modes(s_dst, 0, 2),
        cute.group_modes(g_tile, 0, 2),
    )
    if cutlass.const_expr(stage is None):
        cute.copy(atom, g_part, s_part, tma_bar_ptr=bar_ptr)
    else:
        cute.copy(atom, g_part, s_part[None, stage], tma_bar_ptr=bar_ptr)


def consumer_wait(pipe, state):
    pipe.consumer_wait(state, pipe.consumer_try_wait(state))


def sched_barrier_sync(enabled: bool, wg_idx):
    """Wait for this consumer warpgroup's turn to issue WGMMAs (the warpgroups take turns in a
    ring: 0, 1, 0, 1, ... with two, 0, 1, 2, 0, ... with three)."""
    if cutlass.const_expr(enabled):
        cute.arch.barrier(barrier_id=int(NamedBarrier.SchedWG1) + wg_idx, number_of_threads=256)


def sched_barrier_arrive(enabled: bool, wg_idx, num_wg: int = 2):
    """Hand the WGMMA issue slot to the next consumer warpgroup of the ring of ``num_wg``."""
    if cutlass.const_expr(enabled):
        nxt = (wg_idx + 1) % num_wg
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.SchedWG1) + nxt, number_of_threads=256)
