"""Moving a call's rows and signalling their completion: the host path and the in-kernel handshake.

Both paths count the same calls and transfers per pair and raise the same signal slots, so ranks
may mix them on one pair. ``packages/magi-comm/docs/native.md`` ("Completion by signals",
"Handshake in the kernels", "Receive copy beside the transfer").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import NativeConfig
from .group_state import GroupState, host_to_device
from .launches import Launches
from .layout import SINK_NONE, SINK_SCATTER, Round, TaskTable, to_blocks, word_size
from .protocol import (
    ACK,
    ARM,
    ARM_AND_WAIT,
    AWAIT_ROWS,
    PULL_ACCEPT,
    READY,
    READY_END,
    SIGNAL_PROGRESS,
    WAIT_READY_END,
    pack_peer,
)

__all__ = ["Field", "Transport"]

# consume(stream, words, start=None): the fused reduction in place of the receive copies (words:
# the sources' packed waits when it runs beside the send kernel, else None; start: the call's
# packed words when it makes the call's handshake itself, one launch)
Consume = Callable[..., None]


@dataclass
class Field:
    """One tensor moved by a call: ``src`` rows (contiguous) land in ``sink`` rows (contiguous),
    ``row_bytes`` (:func:`~.layout.row_bytes` of ``src``, computed once per call) bytes each."""

    src: torch.Tensor
    sink: torch.Tensor
    row_bytes: int


class Transport:
    """Enqueues a call's transfers and signals on the group stream.

    Args:
        state: the group's shared state (buffers, signals, counters, streams).
        config: the backend's settings (``device_handshake``, ``max_programs``).
        launches: the backend's launch builder (schedules and copy launches per plan).
        kernels: the kernel module (``CopyLaunch``), from the platform.
    """

    def __init__(self, state: GroupState, config: NativeConfig, launches: Launches, kernels) -> None:
        self.state = state
        self.config = config
        self.launches = launches
        self.kernels = kernels
        self.rank, self.world = state.rank, state.world

    def move(
        self,
        plan,
        sink_kind: str,
        fields: list[Field],
        consume: Consume | None = None,
        maps=None,
        pub: int = 0,
        one_launch: bool = False,
    ) -> None:
        """Move every field's rows to their sinks (enqueued on the group stream).

        ``consume`` (fused reduction, ``SINK_NONE``, at most one round) replaces the receive
        copies: it runs once every peer's rows are in the local regions (or at once when there
        is no round), before the acknowledgements release the regions.
        ``maps`` (group_cast, direct mode): per source, ``(address, nbytes, token)`` of this
        rank's map for it; peers then write straight into the sink and no receive copy runs. A
        cast without maps puts header 0 (rows through the regions).
        ``pub`` (group_reduce): address of the publish table the first send launch writes to the
        destinations' pull maps (:func:`~.terms.publish_table`).
        ``one_launch`` (group_reduce, see ``ReducePath.one_launch``): ``consume`` makes the
        call's handshake itself, no send launch (one round and one field, kernel handshake).
        """
        st = self.state
        fields = [f for f in fields if f.row_bytes > 0]
        if not fields:
            if consume is not None:
                consume(st.stream, None)
            return
        rbs = tuple(f.row_bytes for f in fields)
        ws = tuple(word_size(rb, f.src, f.sink) for f, rb in zip(fields, rbs))
        sched, per_field = self.launches.layout(plan, sink_kind, rbs, ws)
        if consume is not None and sched.num_rounds > 1:
            raise AssertionError("fused consumption needs a single round")
        assert st.buf is not None  # the receive buffer exists once the group is set up
        base = st.buf.data_ptr()
        prepared = [
            (f.src.data_ptr(), f.sink.data_ptr(), base + off, runs)
            for f, (off, runs) in zip(fields, per_field)
        ]
        rounds = sched.rounds
        if one_launch:
            if consume is None or len(rounds) != 1 or len(prepared) != 1 or not self.config.device_handshake:
                raise AssertionError(
                    "one launch needs the fused reduction, one round, one field, the kernel handshake"
                )
            words, _ = self._count_one_round(rounds[0], sink_kind, maps, one_launch=True)
            consume(st.stream, None, words)
            return
        if len(rounds) == 1 and len(prepared) == 1 and self.config.device_handshake:
            self._in_kernels(rounds[0], prepared[0], sink_kind, consume, maps, pub)
        else:
            self._on_host(rounds, prepared, sink_kind, consume, maps, pub)

    # -- host path: NVSHMEM's on-stream signal and wait operations -----------------------------

    def _on_host(self, rounds, prepared, sink_kind: str, consume, maps, pub: int) -> None:
        """Any number of rounds and fields: arms, waits and ready / ack signals are NVSHMEM
        operations on the group stream around the copy launches."""
        st, n, stream = self.state, self.state.counts, self.state.stream
        if rounds:  # arm every source first: a rank never waits before its own arms are out
            for s in rounds[0].recv_peers:
                n.arms_made[s] += 1
                st.arm(s, self.arm_header(s, sink_kind, maps))
        for k, rnd in enumerate(rounds):
            for d in rnd.send_peers:
                if k == 0:  # d's earlier use of its region and output is over
                    st.wait(ARM, d, self._count_arm(d)[0])
                else:  # d consumed our previous round
                    n.acks_seen[d] += 1
                    st.wait(ACK, d, n.acks_seen[d])
            self._send_round(k, rnd, prepared, pub)
            for d in rnd.send_peers:
                n.sent[d] += 1
                st.signal(READY, d)
            for s in rnd.recv_peers:
                st.wait(READY, s, n.recvd[s] + 1)
            if consume is not None:
                consume(stream, None)
            elif maps is None:
                for _src, sink, local, runs in prepared:
                    runs[k][1](local, sink, stream)
            later = rounds[k + 1].recv_peers if k + 1 < len(rounds) else ()
            for s in rnd.recv_peers:
                n.recvd[s] += 1
                if s in later:
                    st.signal(ACK, s)
        if consume is not None and not rounds:
            consume(stream, None)

    def _send_round(self, k: int, rnd: Round, prepared, pub: int) -> None:
        """Round ``k``'s send launches, one per field."""
        st = self.state
        for src, sink, _local, runs in prepared:
            send = runs[k][0]
            if send.publish is None:
                send(src, sink, st.stream)
                continue
            # the publishing launch records its decisions under each destination's epoch
            epochs = tuple(
                pack_peer(st.counts.arms_seen[c] if c in rnd.send_peers else 0) for c in range(self.world)
            )
            send(src, sink, st.stream, words=epochs, pub=pub)

    def arm_header(self, s: int, sink_kind: str, maps) -> tuple[int, int, int] | None:
        """What arming source ``s`` puts first: ``(address, nbytes, dest)``, this rank's map for
        it in row ``rank`` of its map area (a cast: its output map in direct mode, header 0
        otherwise) or its accept word (a reduce: ``PULL_ACCEPT`` when the call takes the fused
        reduction, which reads rows in place, else 0), or None when ``s`` still holds that
        value (only this rank writes there)."""
        st, n = self.state, self.state.counts
        if sink_kind != SINK_SCATTER:
            word = PULL_ACCEPT if sink_kind == SINK_NONE else 0
            if n.accept_sent[s] == word:
                return None
            n.accept_sent[s] = word
            at = (st.accept_word if word == PULL_ACCEPT else st.zero_word).data_ptr()
            return (at, 8, st.accepts.data_ptr() + 8 * self.rank)
        header = maps[s] if maps is not None else (st.zero_word.data_ptr(), 8, 0)
        if n.map_sent[s] == header[2]:
            return None
        n.map_sent[s] = header[2]
        return (header[0], header[1], st.maps.data_ptr() + 8 * self.rank * st.map_width)

    # -- device path: the handshake inside the kernels -----------------------------------------

    def _in_kernels(self, rnd: Round, field, sink_kind: str, consume, maps, pub: int) -> None:
        """A call of one round and one field with the handshake inside the kernels: a
        one-program launch arms the sources and waits for the destinations' arms; the send
        kernel signals the destinations ready. The receive copy or the fused reduction (a
        cast into a symmetric output has none) either follows in stream order, after the send
        kernel's last program waited for the sources' rows, or, with overlap, runs beside the
        send kernel on the side stream (:meth:`_beside`). Same counts as the host path."""
        st = self.state
        words, ready_wait = self._count_one_round(rnd, sink_kind, maps)
        # One program arms and waits for the arms, so that a destination that is behind holds
        # one SM slot, not every program of the send kernel (an attention kernel running beside
        # the transfer keeps the others).
        self._arm_launch()(0, 0, st.stream, sync=ARM_AND_WAIT, words=words)
        src, sink, local, runs = field
        send, recv = runs[0]
        receives = consume is not None or maps is None
        progress = SIGNAL_PROGRESS if send.progress is not None else 0
        if receives and recv.waits is not None and rnd.recv_peers:
            self._beside(field, words, ready_wait, consume, progress, pub)
            return
        send(src, sink, st.stream, sync=READY_END | WAIT_READY_END | progress, words=words, pub=pub)
        if consume is not None:
            consume(st.stream, None)
        elif maps is None:
            recv(local, sink, st.stream)

    def _count_one_round(
        self, rnd: Round, sink_kind: str, maps, one_launch: bool = False
    ) -> tuple[tuple[int, ...], list[int]]:
        """Count the call on every pair of the round and put the arms that carry data (a map
        or an accept word: put-with-signal ahead of the kernels); returns the launch's packed
        per-peer words and the ``READY`` count awaited from each source (0: none).
        ``one_launch`` (a pulled one-launch reduce): a destination whose last call from us was
        one too has its arm known (``PairCounters.arm_known``; ``NativeConfig.known_arms``)."""
        st, n, W = self.state, self.state.counts, self.world
        arm_wait, ready_wait, arm_now, known = [0] * W, [0] * W, [False] * W, [False] * W
        for s in rnd.recv_peers:
            header = self.arm_header(s, sink_kind, maps)
            if header is None:
                arm_now[s] = True
            else:  # the map must land before the arm: a put-with-signal ahead of the kernel
                st.arm(s, header)
            n.arms_made[s] += 1
            n.recvd[s] += 1
            ready_wait[s] = n.recvd[s]
        for d in rnd.send_peers:
            arm_wait[d], known[d] = self._count_arm(d, one_launch)
            n.sent[d] += 1
        return tuple(pack_peer(*w) for w in zip(arm_wait, ready_wait, arm_now, known)), ready_wait

    def _count_arm(self, d: int, one_launch: bool = False) -> tuple[int, bool]:
        """Count a call with rows for destination ``d``: returns the ``ARM`` count to await
        (the pair's epoch) and whether ``d``'s arm is known (``one_launch``: a pulled one-launch
        reduce, whose last call to ``d`` was one too, with ``NativeConfig.known_arms``); the
        call then makes ``d``'s arm known for the next call only if it is such a launch."""
        n = self.state.counts
        n.arms_seen[d] += 1
        known = one_launch and self.config.known_arms and n.arm_known[d]
        n.arm_known[d] = one_launch
        return n.arms_seen[d], known

    def _arm_launch(self):
        """The group's launch without rows that only arms and waits (built on first use)."""
        st = self.state
        if st.arm_launch is None:
            with st.on_stream():  # the empty table's copy, ahead of the launch
                empty = to_blocks(TaskTable.empty(self.world), 1, 1).to(st.device, host_to_device)
                st.arm_launch = self.kernels.CopyLaunch(
                    empty,
                    [None] * self.world,
                    torch.int64,
                    max_programs=self.config.max_programs,
                    handshake=st.handshake,
                )
        return st.arm_launch

    def _beside(self, field, words, ready_wait: list[int], consume, progress: int, pub: int) -> None:
        """Overlap: the receive step starts with the send kernel (after the arms: the sink and
        the caller's earlier work are ordered through the group stream) on the side stream and
        reads each source's rows once they are reported in place; the group stream waits for
        it before the call ends."""
        st, n = self.state, self.state.counts
        src, sink, local, runs = field
        send, recv = runs[0]
        sources = tuple(
            pack_peer(n.arms_made[s], ready_wait[s]) if ready_wait[s] else pack_peer()
            for s in range(self.world)
        )
        st.armed_event.record(st.stream)
        st.side.wait_event(st.armed_event)
        send(src, sink, st.stream, sync=READY_END | progress, words=words, pub=pub)
        if consume is not None:
            consume(st.side, sources)
        else:
            recv(local, sink, st.side, sync=AWAIT_ROWS, words=sources)
        st.consumed_event.record(st.side)
        st.stream.wait_event(st.consumed_event)
