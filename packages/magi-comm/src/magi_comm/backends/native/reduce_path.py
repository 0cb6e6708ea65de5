"""group_reduce on the native backend: the fused reduction (terms read where they lie, pull
included) or the staged one (a receive scratch and the shared torch reduction).

``packages/magi-comm/docs/native.md`` ("GroupReduce", "Pull").
"""

from __future__ import annotations

import torch

from ..._reduce import reduce_received
from .config import CONSUMER_PROGRAMS, NativeConfig
from .group_state import GroupState, host_to_device
from .launches import Launches
from .layout import SINK_CONCAT, SINK_NONE, row_bytes
from .outputs import recent, spans_overlap
from .progress import arrival_order, reduce_waits
from .protocol import pack_done
from .terms import build_pull_terms, build_reduce_terms, publish_table
from .transport import Field, Transport

__all__ = ["ONE_LAUNCH_PROGRAMS", "ReducePath"]

# programs of a one-launch reduction (they stride over its tiles): each acquires its source's
# READY once. tools/bench_pull_floor.py's plain pull + add on 2x H100 put it near 2112 (level
# with one per tile alone, 3-5% less time in one launch at 16 MiB); the fused reduction's own
# sweeps (docs/perf.md, "group_reduce: the arm known", (b)): 1024 0.5-0.7% more GB/s than 2048
# in each of two turns; 768 level at 16 MiB, 4% less at 64; 512 less; 8192 and a program per
# tile less (the session before)
ONE_LAUNCH_PROGRAMS = 1024


class ReducePath:
    """The bodies of one backend's group_reduce (enqueued on the group stream).

    Args:
        state: the group's shared state.
        config: the backend's settings (``fused_reduce``, ``max_programs``).
        launches: the backend's launch builder (rows per region, schedules).
        transport: the backend's transport.
        kernels: the kernel module (``launch_reduce``, ``reduce_tile_rows``), from the platform.
    """

    def __init__(
        self, state: GroupState, config: NativeConfig, launches: Launches, transport: Transport, kernels
    ) -> None:
        self.state = state
        self.config = config
        self.launches = launches
        self.transport = transport
        self.kernels = kernels
        # the fused reduction's tile after the transfer (None: the kernel's default)
        self.shape = dict(tile_rows=config.reduce_tile_rows or None, num_warps=config.reduce_warps or None)

    def fused_rows(self, plan, input: torch.Tensor, rb: int, reduce_op: str) -> int:
        """Rows per region when the fused reduction applies to this call (``input`` has rows of
        ``rb`` bytes), else 0."""
        if not self.config.fused_reduce or reduce_op == "lse":
            return 0
        if rb == 0 or input.dim() < 1:
            return 0
        R = self.launches.rows_per_region((rb,))
        return R if self.launches.schedule(plan, R, SINK_NONE).num_rounds <= 1 else 0

    def fused(
        self, plan, input: torch.Tensor, output: torch.Tensor, R: int, reduce_op: str, acc_reduce: bool
    ) -> tuple:
        """Reduce ``sum`` / ``avg`` with the fused kernel (``R`` from :meth:`fused_rows`): terms
        are read where they lie, own rows in the input, peer rows in the regions or, for a
        source that lets this rank pull, in that source's input. Returns what must stay alive."""
        st = self.state
        src = input.contiguous()
        out = output if output.is_contiguous() else output.contiguous()
        rb, E = row_bytes(input), torch.Size(out.shape[1:]).numel()
        term_row, term_self, nterms, need, order, term_pull = self.terms(plan, R, out.device, E)
        pub, pulled = self.publish(plan, src, rb, fused=True, out=out)
        one_launch = self.one_launch(plan, pulled)

        def consume(stream, words, start=None):
            waits, shape = None, dict(self.shape, max_programs=self.config.reduce_programs)
            if words is not None:  # beside the transfer: wait for the peers' rows
                waits = (need, order, st.sig.data_ptr(), words, self.config.max_programs or CONSUMER_PROGRAMS)
                shape = {}  # its wait tables are cut by the default tile
            if start is not None:  # the call's handshake in this launch (one_launch)
                start = (start, pub, st.pull_peers.data_ptr(), st.accepts.data_ptr())
                shape["max_programs"] = self.config.reduce_programs or ONE_LAUNCH_PROGRAMS
            end = (st.handshake, st.reduce_counter, st.pull_decided.data_ptr(), self.done_words(plan), pulled)
            self.kernels.launch_reduce(
                out.view(out.shape[0], E),
                src.view(src.shape[0], E),
                st.buf,
                term_row,
                term_self,
                nterms,
                acc_reduce=acc_reduce,
                average=reduce_op == "avg",
                stream=stream,
                waits=waits,
                pull=(term_pull, st.pull_maps.data_ptr(), st.outputs.bases.data_ptr(), st.map_width),
                end=end,
                start=start,
                **shape,
            )

        self.transport.move(
            plan, SINK_NONE, [Field(src, src, rb)], consume=consume, pub=pub, one_launch=one_launch
        )
        if out is not output:
            output.copy_(out)
        return (src, out)

    def one_launch(self, plan, pulled: bool) -> bool:
        """Whether this fused call runs as one launch of the reduction (docs/native.md, "One
        launch on 2 ranks"): ``one_launch_pull``; two ranks whose backends take the fused
        reduction alike (``GroupState.fused_alike``), so that the peer takes it too and accepts
        our pulls (both count the same two pairs against the same region size); rows between
        the two (a call without has no round: the reduction alone runs); our rows for the peer,
        if any, left for pulling (``pulled``) with a map that fits its row; the kernel handshake
        on and no reduction beside the transfer."""
        st, cfg = self.state, self.config
        if not (cfg.one_launch_pull and st.fused_alike and st.world == 2):
            return False
        if not cfg.device_handshake or cfg.overlap_reduce:
            return False
        peer = 1 - st.rank
        if not plan.send_counts[peer]:  # nothing to publish: the launch arms and waits
            return bool(plan.recv_counts[peer])
        return pulled and 1 + len(plan.send_split_ids[peer]) <= st.map_width

    def staged(
        self,
        plan,
        input: torch.Tensor,
        output: torch.Tensor,
        reduce_op: str,
        input_lse: torch.Tensor | None,
        output_lse: torch.Tensor | None,
        acc_reduce: bool,
    ) -> tuple:
        """Rows land in a receive scratch laid out like a2av's; the shared torch reduction
        follows. Returns what must stay alive."""
        st = self.state
        src = input.contiguous()
        rb = row_bytes(input)
        recv = st.scratch_rows("data", plan.num_recv_rows, output)
        fields = [Field(src, recv, rb)]
        src_lse = recv_lse = None
        if reduce_op == "lse":
            assert input_lse is not None  # "lse" carries one (checked by the frontend)
            src_lse = input_lse.contiguous()
            recv_lse = st.scratch_rows("lse", plan.num_recv_rows, input_lse)
            fields.append(Field(src_lse, recv_lse, row_bytes(src_lse)))
        self.transport.move(plan, SINK_CONCAT, fields, pub=self.publish(plan, src, rb, fused=False)[0])
        idx = plan.indices_on(output.device)
        reduce_received(output, output_lse, recv, recv_lse, idx, reduce_op, acc_reduce)
        return (src, src_lse)

    def terms(self, plan, R: int, device, E: int) -> tuple:
        """The fused reduction's tables on ``device`` for rows of ``E`` elements: term rows,
        self flags, term counts (:func:`~.terms.build_reduce_terms`), the rows each tile waits
        for (:func:`~.progress.reduce_waits`), the order its tiles take
        (:func:`~.progress.arrival_order`) and where each peer term lies in its source's input
        (:func:`~.terms.build_pull_terms`). Cached on the plan."""
        st = self.state
        tile = self.kernels.reduce_tile_rows(E, True)
        key = ("native-terms", str(device), R, tile)
        terms = plan._on_device.get(key)
        if terms is None:
            host = build_reduce_terms(plan, R)
            need = reduce_waits(*host, st.rank, st.world, R, tile)
            order = arrival_order(need, plan.recv_counts)
            pull = build_pull_terms(plan, *host, R)
            with st.on_stream():  # ahead of the kernel reading them
                terms = tuple(host_to_device(t, device) for t in (*host, need, order, pull))
            plan._on_device[key] = terms
        return terms

    def publish(self, plan, src: torch.Tensor, rb: int, fused: bool, out: torch.Tensor | None = None):
        """``(address, pulled)`` of the publish table a reduce of ``src`` (rows of ``rb``
        bytes) into ``out`` sends with: its pair splits' offsets when ``fused`` and ``src``
        lies 16-byte aligned in a symmetric output and does not overlap ``out`` (our own
        reduction writes ``out`` while receivers may still read ``src``): receivers that
        accept may read the rows there (``pulled``); else header 0 for every destination.
        Cached on the plan: the header-0 table, and the pull maps of the last few inputs,
        keyed like the direct-mode maps."""
        st, outputs = self.state, self.state.outputs
        apart = out is None or not spans_overlap(src, out)
        aligned = rb % 16 == 0 and src.data_ptr() % 16 == 0
        # the copy engines push every row of a fused reduce (its SINK_NONE sends; the one rule of
        # Launches.copy_engine_on): nothing is offered for pulling
        pushed = self.launches.copy_engine_on(SINK_NONE)
        a = outputs.index(src) if fused and apart and aligned and not pushed else None

        def build(pull):
            with st.on_stream():  # ahead of the send kernel reading it
                return st.to_device(publish_table(plan, st.map_width, pull))

        if a is None:
            table = plan._on_device.get("native-publish-0")
            if table is None:
                table = plan._on_device["native-publish-0"] = build(None)
            return table.data_ptr(), False
        key = (a, outputs.generation[a], src.data_ptr(), rb)
        pull = (a, src.data_ptr() - outputs.spans[a][0], rb)
        table = recent(plan, "native-publish", key, lambda: build(pull))
        return table.data_ptr(), True

    def done_words(self, plan) -> tuple[int, ...]:
        """The fused reduction's end-step words of this call (after the transport counted it):
        per peer, the pair's epoch as a destination and as a source (0: no rows that way)."""
        n, rank = self.state.counts, self.state.rank
        return tuple(
            pack_done(
                n.arms_seen[c] if c != rank and plan.send_counts[c] else 0,
                n.arms_made[c] if c != rank and plan.recv_counts[c] else 0,
            )
            for c in range(self.state.world)
        )
