"""The native backend's two Triton kernels as reference implementations on raw host addresses.

The launch objects a :class:`~magi_comm.testing.native_fake.FakePlatform` hands the backend:
:class:`CopyLaunch` (``apply_blocks`` plus the kernels' handshake, progress and publish steps)
and :func:`launch_reduce` (the fused reduction's reference plus its wait and DONE steps). Each
takes the :class:`~magi_comm.testing.native_fake.FakeWorld` whose atomics and waits it uses
(``world=``) and counts what it did there.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from magi_comm.backends.native import protocol as proto
from magi_comm.backends.native.layout import apply_blocks
from magi_comm.backends.native.terms import publish_row

from . import native_sim_reduce

__all__ = [
    "TIMEOUT",
    "CopyLaunch",
    "await_rows",
    "handshake_steps",
    "launch_reduce",
    "reduce_tile_rows",
    "words_at",
]

TIMEOUT = 30.0  # seconds a fake wait blocks before it reports a deadlock


def words_at(addr: int, nwords: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat ``dtype`` tensor over ``nwords`` words of host memory at ``addr`` (no copy)."""
    if nwords <= 0:
        return torch.empty(0, dtype=dtype)
    nbytes = nwords * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=dtype)


class CopyLaunch:
    """The backend's per-layout launch object: `apply_blocks` (the copy kernel's reference) on
    raw addresses, each viewed as far as the table writes or reads it. With ``direct`` it reads
    the peers' map headers and the output table at launch time, as the kernel does."""

    def __init__(
        self,
        table,
        peers,
        dtype,
        *,
        vec=1,
        num_warps=8,
        fence=0,
        direct=None,
        max_programs=0,
        handshake=None,
        progress=None,
        waits=None,
        publish=None,
        unpulled=None,
        world=None,
    ):
        assert max_programs >= 0
        proto.check_copy_roles(
            peers=peers, handshake=handshake, progress=progress, waits=waits, publish=publish, direct=direct,
            unpulled=unpulled,
        )  # fmt: skip
        self.table, self.peers, self.dtype, self.direct = table, peers, dtype, direct
        self.max_programs, self.handshake = max_programs, handshake
        self.progress, self.waits, self.publish, self.unpulled = progress, waits, publish, unpulled
        self.world = world
        with world.cond:
            world.copy_program_caps.add(max_programs)

    def _direct_targets(self):
        """Per peer column: (its output viewed as words, word offset of each pair split) for
        peers whose header says direct mode, else None (the kernel's branch, on the host)."""
        table, W = self.table, len(self.peers)
        maps_addr, bases_addr, width = self.direct
        maps = words_at(maps_addr, W * width, torch.int64).view(W, width)
        wb = torch.empty(0, dtype=self.dtype).element_size()
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for c in range(W):
            used = table.task_split[:, c] >= 0
            hdr = int(maps[c, 0])
            if hdr == 0 or not bool(used.any()):
                out.append(None)
                continue
            base = int(words_at(bases_addr, hdr * W, torch.int64)[(hdr - 1) * W + c])
            nsplit = int(table.task_split[used, c].max()) + 1
            entries = maps[c, 1 : 1 + nsplit]
            assert bool((entries % wb == 0).all()), "split offsets must be whole words"
            starts = entries // wb
            ends = starts[table.task_split[used, c]] + table.task_within[used] + table.task_len[used]
            out.append((words_at(base, int(ends.max()), self.dtype), starts))
            with self.world.cond:
                self.world.direct_writes += 1
        return out

    def __call__(self, src, sink, stream=None, sync=0, words=(), pub=0):
        W = len(self.peers)
        assert not sync or (self.handshake is not None and len(words) == W)
        assert not sync & proto.SIGNAL_PROGRESS or self.progress is not None
        assert not sync & proto.AWAIT_ROWS or self.waits is not None
        assert bool(pub) == (self.publish is not None), "a publishing launch takes a table, others none"
        proto.refuse_known_arms(words)  # the real launch's rule
        steps = handshake_steps(self.world, self.handshake, W, sync, words)
        next(steps)  # the start of the kernel
        if self.unpulled is not None:  # a staged reduce's receive copy: every source sent
            pulls, width, sources = self.unpulled
            headers = words_at(pulls, W * width, torch.int64)[::width].tolist()
            with self.world.cond:
                self.world.unpulled_checks += 1
            assert not any(headers[s] for s in range(W) if sources >> s & 1), proto.MSG_PULLS_UNACCEPTED
        table = self.table
        if self.publish is not None:  # program 0 writes the headers; pulled rows are not sent
            pulled = self._publish(pub, words)
            if pulled:
                dst = table.task_dst.clone()
                dst[:, pulled] = -1
                self.table = dataclasses.replace(table, task_dst=dst)
        if sync & proto.AWAIT_ROWS:  # block by block, each after the rows it reads
            with self.world.cond:
                self.world.overlapped += 1
            source, rows = self.waits
            for b in range(self.table.num_blocks):
                await_rows(self.world, self.handshake, W, int(source[b]), int(rows[b]), words)
                self._copy(src, sink, b, b + 1)
        elif sync & proto.SIGNAL_PROGRESS and self.table.num_blocks:  # chunk by chunk, reported
            rows, _, chunk = self.progress
            peers = words_at(self.handshake.sig_peers, W, torch.int64).tolist()
            wanted = self._progress_wanted(rows)
            for j in range(rows.shape[0]):
                self._copy(src, sink, j * chunk, (j + 1) * chunk)
                for c in range(W):
                    if wanted and int(rows[j, c]) >= 0:
                        epoch = proto.unpack_peer(words[c])[0]
                        addr = peers[c] + 8 * (proto.PROGRESS * W + self.handshake.rank)
                        self.world.kernel_max(addr, proto.progress_value(epoch, int(rows[j, c])))
        elif self.table.num_blocks:
            self._copy(src, sink)
        self.table = table
        next(steps, None)  # the end

    def _publish(self, pub, epochs) -> list[int]:
        """The kernel's publish step (`publish_step`)."""
        return publish_step(self.world, self.handshake.rank, self.publish, pub, epochs)

    def _progress_wanted(self, rows) -> bool:
        """The kernel's rule: report unless every destination is in direct mode."""
        W = len(self.peers)
        if self.direct is None or not self.table.has_splits:
            return True
        maps = words_at(self.direct[0], W * self.direct[2], torch.int64).view(W, self.direct[2])
        return any(int(rows[0, c]) >= 0 and int(maps[c, 0]) == 0 for c in range(W))

    def _copy(self, src, sink, lo=0, hi=None):
        """Copy blocks ``[lo, hi)`` of the table."""
        table, W = self.table, len(self.peers)
        hi = table.num_blocks if hi is None else min(hi, table.num_blocks)
        if lo >= hi:
            return
        table = dataclasses.replace(table, blk_task=table.blk_task[lo:hi], blk_start=table.blk_start[lo:hi])
        direct = self._direct_targets() if self.direct is not None and table.has_splits else None
        ends = table.task_dst + table.task_len[:, None]
        reach = torch.where(table.task_dst >= 0, ends, 0).amax(0).tolist()  # words per column
        for c in range(W):
            assert reach[c] == 0 or self.peers[c], f"the table writes column {c} without an address"
        views = [words_at(self.peers[c], reach[c], self.dtype) if reach[c] else None for c in range(W)]
        src_words = int((table.task_src + table.task_len).max())
        apply_blocks(
            table,
            words_at(src, src_words, self.dtype),
            words_at(sink, reach[W], self.dtype),
            views,
            W,
            direct,
        )


def publish_step(world, rank: int, publish, pub: int, epochs) -> list[int]:
    """A reduce's publish step (program 0 of its send kernel, or of a one-launch reduction):
    per destination of the table, its pull-map header (the map where it accepts pulls and the
    table has one, else 0) into row ``rank`` of its pull-map area, and the decision under the
    destination's epoch. Returns the destinations whose rows are not sent."""
    W = len(epochs)
    pub_peers, accepts, width, decided = publish
    table = words_at(pub, W + 1 + int(words_at(pub, W + 1, torch.int64)[W]), torch.int64)
    peer_rows = words_at(pub_peers, W, torch.int64).tolist()
    accept = words_at(accepts, W, torch.int64).tolist()
    pulled = []
    for c in range(W):
        mine = publish_row(table, W, c)
        if mine.numel() == 0:
            continue
        assert mine.numel() <= width, "a published map is wider than a map row"
        row = words_at(peer_rows[c] + 8 * rank * width, mine.numel(), torch.int64)
        with world.cond:
            if int(mine[0]) > 0 and accept[c] == proto.PULL_ACCEPT:
                row.copy_(mine)
                pulled.append(c)
                world.published_maps += 1
            else:
                row[0] = 0
            epoch = proto.unpack_peer(epochs[c])[0]
            assert epoch > 0, "a publishing launch needs each destination's epoch"
            words_at(decided, W, torch.int64)[c] = 2 * epoch + int(c in pulled)
    return pulled


def handshake_steps(world, hs, W, sync, words):
    """The kernels' handshake as a generator: one step at the kernel's start, one at its end."""

    def slot(base: int, kind: int, c: int) -> int:  # address of signal slot (kind, c) at base
        return base + 8 * (kind * W + c)

    signals_peers = hs is not None and sync & (proto.ARM_AND_WAIT | proto.READY_END)
    peers = words_at(hs.sig_peers, W, torch.int64).tolist() if signals_peers else []
    waits = [proto.unpack_peer(w) for w in words]
    if sync & proto.ARM_AND_WAIT:
        for c, (_, _, arm_now) in enumerate(waits):
            if arm_now:
                world.kernel_add(slot(peers[c], proto.ARM, hs.rank))
        for c, (arm_wait, _, _) in enumerate(waits):
            if arm_wait and not proto.arm_known(words[c]):
                world.kernel_wait(slot(hs.sig, proto.ARM, c), arm_wait)
            elif arm_wait:
                with world.cond:
                    world.known_arms += 1
    yield
    if sync & proto.READY_END:
        for c, (arm_wait, _, _) in enumerate(waits):
            if arm_wait:
                world.kernel_add(slot(peers[c], proto.READY, hs.rank))
    if sync & proto.WAIT_READY_END:
        for c, (_, ready_wait, _) in enumerate(waits):
            if ready_wait:
                world.kernel_wait(slot(hs.sig, proto.READY, c), ready_wait)
    yield


def await_rows(world, hs, W, s, rows, words) -> None:
    """The kernels' wait for the first ``rows`` rows of source ``s``'s region."""
    epoch, ready_want, _ = proto.unpack_peer(words[s])
    slot = lambda kind: hs.sig + 8 * (kind * W + s)  # noqa: E731
    world.kernel_wait_rows(
        slot(proto.PROGRESS), proto.progress_value(epoch, rows), slot(proto.READY), ready_want
    )


def launch_reduce(
    out,
    inp,
    region,
    term_row,
    term_self,
    nterms,
    *,
    acc_reduce,
    average,
    stream=None,
    waits=None,
    pull=None,
    end=None,
    start=None,
    tile_rows=None,
    num_warps=None,
    max_programs=0,
    world=None,
):
    """The fused reduction's reference (arguments of the real ``launch_reduce``) in ``world``;
    the tile shape (``tile_rows`` / ``num_warps``) changes no result: it is only recorded."""
    if tile_rows is not None or num_warps is not None:
        assert waits is None, "a waiting reduction keeps the default tile (its wait tables)"
        with world.cond:
            world.reduce_shapes.add((tile_rows, num_warps))
    if max_programs:
        assert waits is None, "a waiting reduction's grid is its waits' cap"
        with world.cond:
            world.reduce_caps.add(max_programs)
    if start is not None:
        assert end is not None and pull is not None and waits is None
        _reduce_start(world, end[0], end[2], pull[3], *start)
    if waits is not None:
        need, order, sig, words, cap = waits
        assert sorted(order.tolist()) == list(range(need.shape[0]))
        assert cap > 0, "a waiting reduction needs a bounded grid"
        hs = proto.Handshake(sig, 0, 0, -1)
        with world.cond:
            world.overlapped += 1
            world.overlapped_reduces += 1
        W = need.shape[1]
        for s in range(W):
            rows = int(need[:, s].max()) if need.numel() else 0
            if rows > 0:
                await_rows(world, hs, W, s, rows, words)
    E = out.shape[1]
    peer = term_row[(term_self == 0) & (term_row >= 0)]
    rows = int(peer.max()) + 1 if peer.numel() else 0
    nbytes = rows * E * out.element_size()
    if nbytes:
        raw = (ctypes.c_char * nbytes).from_address(region.data_ptr())
        reg = torch.frombuffer(raw, dtype=out.dtype).view(rows, E)
    else:
        reg = out[:0]
    if pull is not None and nbytes:
        reg, pulled = native_sim_reduce.pulled_region(reg.clone(), term_row, term_self, nterms, pull)
        with world.cond:
            world.pulled_rows += pulled
    if out.shape[0] and E:
        native_sim_reduce._fused_reference(out, inp, reg, term_row, term_self, nterms, acc_reduce, average)
    if end is not None:
        _reduce_end(world, *end)


def _reduce_start(world, hs, decided, width, words, pub, pub_peers, accepts) -> None:
    """A one-launch reduction's start: the send kernel's handshake (`handshake_steps`: arms and
    the destinations' arms, then READY and the sources' READY) around its publish step."""
    W = len(words)
    steps = handshake_steps(world, hs, W, proto.ARM_AND_WAIT | proto.READY_END | proto.WAIT_READY_END, words)
    next(steps)
    pulled = publish_step(world, hs.rank, (pub_peers, accepts, width, decided), pub, words)
    table = words_at(pub, W + 1, torch.int64).tolist()
    wanted = [c for c in range(W) if table[c + 1] > table[c]]
    assert pulled == wanted, proto.MSG_PULLS_REFUSED
    next(steps, None)
    with world.cond:
        world.one_launch_reduces += 1


def _reduce_end(world, hs, counter, decided, done_words, wait_done) -> None:
    """The fused reduction's DONE step (its last program)."""
    W = len(done_words)
    peers = words_at(hs.sig_peers, W, torch.int64).tolist()
    for c, word in enumerate(done_words):
        src_epoch = proto.unpack_peer(word)[1]
        if src_epoch:
            world.done_signal(peers[c] + 8 * (proto.DONE * W + hs.rank), src_epoch)
    if wait_done:
        got = words_at(decided, W, torch.int64)
        for c, word in enumerate(done_words):
            dst_epoch = proto.unpack_peer(word)[0]
            if dst_epoch:
                # the send launch ran before (the fake runs the overlapped steps in order)
                assert int(got[c]) >> 1 == dst_epoch, (int(got[c]), dst_epoch)
                if int(got[c]) & 1:
                    world.done_wait(hs.sig + 8 * (proto.DONE * W + c), dst_epoch)


def reduce_tile_rows(E: int, waiting: bool = False) -> int:
    """Rows per tile of the fused reduction (any value works for the fake; a small one makes
    several tiles)."""
    return 3
