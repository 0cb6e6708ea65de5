"""The copy launches of a plan's transport: built once per (plan, row sizes, buffer), cached on the plan.

Everything a call needs except its tensors' addresses: the schedule (rounds, regions), and per
field and round a send and a receive :class:`~.kernels.copy.CopyLaunch` with their block tables
on the device, overlap tables included. ``packages/magi-comm/docs/native.md`` ("Receive
buffer", "Receive copy beside the transfer").
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from .config import CONSUMER_PROGRAMS, ENV_BUFFER_MB, OVERLAP_MIN_CHUNKS, NativeConfig
from .copy_engine import CopyEngineSend, copy_engine_copies
from .group_state import GroupState, host_to_device
from .layout import (
    SINK_CONCAT,
    SINK_NONE,
    SINK_SCATTER,
    BlockTable,
    Schedule,
    TaskTable,
    build_schedule,
    bytes_needed,
    field_offsets,
    region_rows,
    to_blocks,
)
from .progress import recv_waits, send_progress
from .protocol import MAX_REPORTING_PROGRAMS

__all__ = ["FieldLaunches", "Launches", "Layout"]

logger = logging.getLogger(__name__)

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_MAX_CHUNKS = 4096  # progress chunks of one send launch


class FieldLaunches(NamedTuple):
    """One field's part of a layout: its area's byte offset in the receive buffer, and per
    round ``(send launch, receive launch)``."""

    offset: int
    rounds: list[tuple]


class Layout(NamedTuple):
    """A plan's transport without the tensors: its schedule and every field's launches."""

    schedule: Schedule
    fields: list[FieldLaunches]


class Launches:
    """Builds (and caches on each plan) the schedules and copy launches of one backend's calls.

    Args:
        state: the group's shared state (buffer, tables the kernels read).
        config: the backend's settings (block size, warps, program cap, overlap).
        kernels: the kernel module (``CopyLaunch``), from the platform.
    """

    def __init__(self, state: GroupState, config: NativeConfig, kernels) -> None:
        self.state = state
        self.config = config
        self.kernels = kernels
        self.rank, self.world = state.rank, state.world

    def schedule(self, plan, R: int, sink: str) -> Schedule:
        """:func:`~.layout.build_schedule` of ``plan`` for ``R`` rows per region, cached on the
        plan (a layout in rounds is logged once)."""
        key = ("native-schedule", R, sink)
        sched = plan._on_device.get(key)
        if sched is None:
            sched = build_schedule(plan, R, sink)
            plan._on_device[key] = sched
            if sched.num_rounds > 1:
                logger.info(
                    "magi_comm native: rank %d moves this layout in %d rounds of %d rows per peer; a "
                    "larger $%s avoids the rounds",
                    self.rank,
                    sched.num_rounds,
                    R,
                    ENV_BUFFER_MB,
                )
        return sched

    def rows_per_region(self, rbs: tuple[int, ...]) -> int:
        """Rows per region for fields of ``rbs`` bytes per row; grows the buffer (collectively)
        when not even one row fits. Row sizes are the same on every rank, so is the decision."""
        st = self.state
        R = region_rows(st.capacity, self.world, rbs)
        if R < 1:
            st.grow(bytes_needed(self.world, rbs))
            R = region_rows(st.capacity, self.world, rbs)
        return R

    def layout(self, plan, sink_kind: str, rbs: tuple[int, ...], ws: tuple[int, ...]) -> Layout:
        """Everything a transport of ``plan`` into a ``sink_kind`` sink with fields of ``rbs``
        bytes per row, moved in words of ``ws`` bytes, needs except the tensors' addresses.

        Cached on the plan. Depends on the receive buffer (its size and address: part of the
        key), so a grown buffer gets a fresh entry, and on the backend's settings (also in the
        key: two backends of one group share its state, and may share a plan)."""
        st = self.state
        assert st.buf is not None  # the receive buffer exists once the group is set up
        key = ("native-layout", sink_kind, rbs, ws, st.capacity, st.buf.data_ptr(), self.config)
        layout = plan._on_device.get(key)
        if layout is not None:
            return layout
        R = self.rows_per_region(rbs)
        if st.capacity != key[4]:  # grew: the key names the old buffer
            return self.layout(plan, sink_kind, rbs, ws)
        sched = self.schedule(plan, R, sink_kind)
        # one round of one field: the receive step may run beside the transfer (overlap)
        cap = self.config.max_programs
        overlap = len(sched.rounds) == 1 and len(rbs) == 1 and self.overlap_on(sink_kind)
        overlap = overlap and 0 < cap <= MAX_REPORTING_PROGRAMS and not self.copy_engine_on(sink_kind)
        per_field = []
        with st.on_stream():  # block tables go to the device ahead of the kernels reading them
            for f, (rb, w, off) in enumerate(zip(rbs, ws, field_offsets(self.world, R, rbs))):
                rounds = [
                    self._round_launches(plan, sched, r, sink_kind, rb, w, off, k == 0 and f == 0, overlap)
                    for k, r in enumerate(sched.rounds)
                ]
                per_field.append(FieldLaunches(off, rounds))
        layout = plan._on_device[key] = Layout(sched, per_field)
        return layout

    def _round_launches(
        self,
        plan,
        sched: Schedule,
        rnd,
        sink_kind: str,
        rb: int,
        w: int,
        off: int,
        publishes: bool,
        overlap: bool,
    ) -> tuple:
        """``(send launch, receive launch)`` of one round of one field (area at byte ``off``,
        rows of ``rb`` bytes in words of ``w``). ``publishes``: the send launch writes the pull
        maps (a reduce's first send); ``overlap``: it reports progress / the receive launch
        waits where a pair is large enough."""
        st, W, cfg = self.state, self.world, self.config
        make, cap = self.kernels.CopyLaunch, cfg.max_programs
        block_words = max(1, cfg.block_bytes // w)
        peers = [None if pe == self.rank else st.peer_addr[pe] + off for pe in range(W)]
        dt = _WORD_DTYPES[w]
        vec = 16 // w if rb % 16 == 0 else 1
        copy_engine = self.copy_engine_on(sink_kind)
        # the copy engines move the rows: the launch only publishes and signals
        send_rows = TaskTable.empty(W) if copy_engine else rnd.send
        send = to_blocks(send_rows, rb // w, block_words)
        recv = to_blocks(rnd.recv, rb // w, block_words)
        progress = waits = None
        if overlap:
            progress, waits = self._overlap_tables(plan, send, recv, sched.region_rows, rb, w)
        # a cast's sends read the peers' maps: they may write straight into peer outputs
        direct: tuple[int, int, int] | None = (st.maps.data_ptr(), st.outputs.bases.data_ptr(), st.map_width)
        direct = direct if sink_kind == SINK_SCATTER else None
        # a reduce's first send (of the first field) publishes the pull-map headers
        publish: tuple[int, int, int, int] | None = (
            st.pull_peers.data_ptr(),
            st.accepts.data_ptr(),
            st.map_width,
            st.pull_decided.data_ptr(),
        )
        publish = publish if sink_kind != SINK_SCATTER and publishes else None
        sender = make(
            send.to(st.device, host_to_device),
            peers,
            dt,
            vec=vec,
            num_warps=cfg.num_warps,
            fence=st.fence_addr,
            direct=direct,
            max_programs=cap,
            handshake=st.handshake,
            progress=progress,
            publish=publish,
        )
        if copy_engine:
            copies = copy_engine_copies(rnd.send, peers, rb)
            sender = CopyEngineSend(sender, copies, st.rt.platform.memcpy)
        # a staged reduce's receive copy checks that its sources sent (none left rows to pull)
        sources = sum(1 << s for s in rnd.recv_peers)
        unpulled = (
            (st.pull_maps.data_ptr(), st.map_width, sources) if sink_kind == SINK_CONCAT and sources else None
        )
        receiver = make(
            recv.to(st.device, host_to_device),
            [None] * W,
            dt,
            vec=vec,
            num_warps=cfg.num_warps,
            # waiting programs must not fill the GPU (the send kernel needs SMs)
            max_programs=(cap or CONSUMER_PROGRAMS) if waits else cap,
            handshake=st.handshake if waits else None,
            waits=waits,
            unpulled=unpulled,
        )
        return sender, receiver

    def copy_engine_on(self, sink_kind: str) -> bool:
        """Whether a ``sink_kind`` call's sends go by the copy engines (``copy_engine``: the
        fused reduce's)."""
        return self.config.copy_engine and sink_kind == SINK_NONE

    def overlap_on(self, sink_kind: str) -> bool:
        """Whether the receive step of a ``sink_kind`` call may run beside its send kernel."""
        cfg = self.config
        kinds = (SINK_SCATTER, SINK_NONE) if cfg.overlap_reduce else (SINK_SCATTER,)
        return cfg.device_handshake and cfg.overlap_chunk_bytes > 0 and sink_kind in kinds

    def _overlap_tables(self, plan, send: BlockTable, recv: BlockTable, R: int, rb: int, w: int):
        """``(progress, waits)`` of a round's send and receive launches (see
        :class:`~.kernels.copy.CopyLaunch`): progress for the pairs that move at least
        ``OVERLAP_MIN_CHUNKS`` chunks (None if none), waits when some source's pair does
        (else None: the receive step follows the transfer)."""
        st, W, rank = self.state, self.world, self.rank
        big = self.config.overlap_chunk_bytes * OVERLAP_MIN_CHUNKS
        sends_big = [c != rank and plan.send_counts[c] * rb >= big for c in range(W)]
        recvs_big = [s != rank and plan.recv_counts[s] * rb >= big for s in range(W)]
        progress = waits = None
        if any(sends_big):
            chunk = max(1, self.config.overlap_chunk_bytes // (send.block_words * w))
            chunk = max(chunk, -(-send.num_blocks // _MAX_CHUNKS))
            rows = send_progress(send, rank, W, R, rb // w, chunk)
            rows[:, [c for c in range(W) if not sends_big[c]]] = -1
            progress = (st.to_device(rows), st.progress_cnt.data_ptr(), chunk)
        if any(recvs_big):
            waits = tuple(st.to_device(t) for t in recv_waits(recv, rank, W, R, rb // w))
        return progress, waits
