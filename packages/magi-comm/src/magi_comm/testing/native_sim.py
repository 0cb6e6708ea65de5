"""In-process simulation of the native backend's transport for all ranks at once (CPU).

Builds every rank's schedule (rounds, copy tasks, blocks) exactly as the backend does, then
plays the protocol in lock step: round k = every rank's send step, then every rank's receive
step (the signals of the backend enforce exactly this order per pair). Buffers are flat word
tensors standing in for the symmetric buffers. The copy is done either by the reference
``apply_blocks`` or by the Triton kernel itself (``TRITON_INTERPRET=1`` on CPU tensors).

Holds the group_cast / group_reduce copy simulation and its check against the oracles
(:func:`check_layout`, entry :func:`main_triton`) and the entry points of the copy kernel's
handshake, wait bound, progress / receive-overlap and publish steps. The fused reduction's
checks are in :mod:`magi_comm.testing.native_sim_reduce`.
"""

from __future__ import annotations

import random
import sys

import torch

import magi_comm.testing as lib
from magi_comm._plan import CastPlan, ReducePlan, build_cast_plan, build_reduce_plan
from magi_comm.backends.native.layout import (
    SINK_CONCAT,
    SINK_SCATTER,
    TaskTable,
    apply_blocks,
    build_schedule,
    region_index,
    to_blocks,
)

ROW_WORDS = 3


def _copy(use_triton: bool, max_programs: int = 0):
    """``run(table, src, sink, peers, world, direct=None)``: the copy kernel's reference, or the
    Triton kernel (with at most ``max_programs`` programs striding over the blocks; 0: one per
    block). ``direct[c] = (peer c's output, word offset of each pair split)`` as for
    :func:`apply_blocks`; the Triton path hands it to the kernel the way the backend does: a
    map area ``[1 + allocation, byte offsets...]`` per peer and a table of allocation bases."""
    if not use_triton:
        return apply_blocks

    from magi_comm.backends.native.kernels import CopyLaunch

    fence = torch.zeros(4, dtype=torch.int32)
    kept: list[torch.Tensor] = []  # the last direct launch's map tables

    def run(table, src, sink, peers, world, direct=None):
        addr = [None if p is None else p.data_ptr() for p in peers]
        args = None
        if direct is not None:
            width = 1 + max((len(x[1]) for x in direct if x is not None), default=0)
            maps = torch.zeros((world, width), dtype=torch.int64)
            bases = torch.zeros((1, world), dtype=torch.int64)
            for c, x in enumerate(direct):
                if x is not None:
                    maps[c, 0] = 1  # allocation 0 of the table: the peer's output
                    maps[c, 1 : 1 + len(x[1])] = torch.as_tensor(x[1]) * src.element_size()
                    bases[0, c] = x[0].data_ptr()
            kept[:] = [maps, bases]
            args = (maps.data_ptr(), bases.data_ptr(), width)
        launch = CopyLaunch(
            table,
            addr,
            src.dtype,
            vec=1,
            num_warps=1,
            fence=fence.data_ptr(),
            direct=args,
            max_programs=max_programs,
        )
        launch(src.data_ptr(), sink.data_ptr())

    return run


def _split_starts(plan, src: int) -> list[int]:
    """Word offset in ``plan``'s output of each split its rank gets from ``src``, in pair order."""
    starts = [0]
    for n in plan.output_split_sizes:
        starts.append(starts[-1] + n)
    return [starts[j] * ROW_WORDS for j in plan.recv_split_ids[src]]


def simulate(
    lay: lib.Layout,
    kind: str,
    R: int,
    block_words: int,
    use_triton: bool = False,
    direct_ranks=frozenset(),
    max_programs: int = 0,
):
    """Returns per rank the sink (cast: output, reduce: concatenated receive rows) as (rows, 3).

    ``direct_ranks``: receivers of a cast whose output peers write straight into (direct mode:
    no region, no receive copy)."""
    W = lay.world
    plans: list[CastPlan] | list[ReducePlan]
    if kind == "cast":
        plans = [build_cast_plan(*lay.cast_args(r), r, W) for r in range(W)]
        sink_kind = SINK_SCATTER
    else:
        plans = [build_reduce_plan(*lay.reduce_args(r), r, W) for r in range(W)]
        sink_kind = SINK_CONCAT
    scheds = [build_schedule(p, R, sink_kind) for p in plans]
    copy = _copy(use_triton, max_programs)
    inputs = [
        (torch.arange(p.num_input_rows * ROW_WORDS, dtype=torch.int64) + 1_000_000 * (r + 1))
        for r, p in enumerate(plans)
    ]
    sink_rows = [p.num_output_rows if kind == "cast" else p.num_recv_rows for p in plans]
    sinks = [torch.full((n * ROW_WORDS,), -1, dtype=torch.int64) for n in sink_rows]
    region_words = R * ROW_WORDS
    bufs = [torch.full((max(W - 1, 0) * region_words,), -7, dtype=torch.int64) for _ in range(W)]
    k_max = max((s.num_rounds for s in scheds), default=0)
    for k in range(k_max):
        # pairing of the rounds: s sends d a chunk in round k <=> d expects one from s
        for s in range(W):
            for d in range(W):
                sends = k < scheds[s].num_rounds and d in scheds[s].rounds[k].send_peers
                recvs = k < scheds[d].num_rounds and s in scheds[d].rounds[k].recv_peers
                assert sends == recvs, (k, s, d)
        for r in range(W):
            if k >= scheds[r].num_rounds:
                continue
            rnd = scheds[r].rounds[k]
            _check_send_targets(rnd.send, r, W, R)
            bt = to_blocks(rnd.send, ROW_WORDS, block_words)
            peers = [None if d == r else bufs[d] for d in range(W)]
            if direct_ranks:
                direct = [
                    (sinks[d], _split_starts(plans[d], r)) if d in direct_ranks and d != r else None
                    for d in range(W)
                ]
                copy(bt, inputs[r], sinks[r], peers, W, direct)
            else:
                copy(bt, inputs[r], sinks[r], peers, W)
        for r in range(W):
            if k >= scheds[r].num_rounds or r in direct_ranks:
                continue
            bt = to_blocks(scheds[r].rounds[k].recv, ROW_WORDS, block_words)
            copy(bt, bufs[r], sinks[r], [None] * W, W)
            bufs[r].fill_(-7)  # the region is free again (ack); stale data must not be reused
    return [s.view(-1, ROW_WORDS) for s in sinks], [x.view(-1, ROW_WORDS) for x in inputs], plans


def _check_send_targets(table, r: int, W: int, R: int) -> None:
    """Sends stay inside region (r, d) of every peer d and never target self's column."""
    if table.num_tasks == 0:
        return
    for c in range(W):
        col = table.dst_row[:, c]
        sent = col >= 0
        if c == r:
            assert not sent.any()
            continue
        if sent.any():
            base = region_index(r, c) * R
            assert (col[sent] >= base).all()
            assert (col[sent] + table.nrows[sent] <= base + R).all()


def expected(lay: lib.Layout, kind: str, inputs, plans):
    """Cast: the oracle output. Reduce: the a2av receive buffer (sources ascending)."""
    W = lay.world
    if kind == "cast":
        return [lib.cast_oracle(lay, inputs, d, inputs[d]) for d in range(W)]
    chunks = lib._simulated_a2a(plans, inputs)
    return [torch.cat(chunks[d]) if chunks[d] else inputs[d][:0] for d in range(W)]


def check_layout(lay: lib.Layout, kind: str, R: int, block_words: int, **options) -> None:
    """`simulate` (``options``: its keyword arguments) against the oracle, rank by rank."""
    sinks, inputs, plans = simulate(lay, kind, R, block_words, **options)
    exp = expected(lay, kind, inputs, plans)
    for d in range(lay.world):
        assert torch.equal(sinks[d], exp[d]), (kind, R, block_words, d, lay)


def main_triton(n: int = 12) -> None:
    """Entry point for the TRITON_INTERPRET=1 subprocess of the unit tests."""
    rng = random.Random(7)
    for _ in range(n):
        world = rng.randint(1, 4)
        lay = lib.random_layout(rng, world, max_splits=4, max_size=5)
        for kind in ("cast", "reduce"):
            # max_programs: also grids smaller than the table (programs stride over the blocks)
            R, bw, programs = rng.choice([1, 2, 3, 50]), rng.choice([2, 4, 16]), rng.choice([0, 1, 2])
            check_layout(lay, kind, R=R, block_words=bw, use_triton=True, max_programs=programs)
        direct = frozenset(r for r in range(world) if rng.random() < 0.6)
        check_layout(
            lay,
            "cast",
            R=rng.choice([1, 3, 50]),
            block_words=4,
            use_triton=True,
            direct_ranks=direct,
            max_programs=rng.choice([0, 3]),
        )
    from magi_comm.backends.native.kernels import CopyLaunch

    ten_blocks = to_blocks(TaskTable(torch.tensor([0]), torch.tensor([40]), torch.tensor([[-1, 0]])), 1, 4)
    assert ten_blocks.num_blocks == 10
    for cap, programs in ((0, 10), (3, 3), (10, 10), (64, 10)):
        assert CopyLaunch(ten_blocks, [None], torch.int64, max_programs=cap).grid == (programs, 1, 1), cap
    try:
        one_task = TaskTable(torch.tensor([0]), torch.tensor([4]), torch.tensor([[-1, 0]]))
        CopyLaunch(to_blocks(one_task, 1, 4), [None], torch.int64, max_programs=-1)
    except ValueError as e:
        assert "max_programs" in str(e) and "-1" in str(e), e
    else:
        raise AssertionError("CopyLaunch accepted max_programs=-1")
    print("native_sim triton ok", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# the kernels' handshake (one process: the "peers" are local signal arrays)


def main_triton_handshake() -> None:
    """Entry point: the copy kernel's handshake steps under TRITON_INTERPRET=1.

    Rank 1 of 3 sends 16 words to peers 0 and 2 and to itself; the counts it waits for are
    already in its signal array (the interpreter runs one program at a time: a wait that is
    not yet satisfied would spin forever), so the test checks the signals it adds, that the
    finished-program counter returns to 0, and that the rows still arrive."""
    from magi_comm.backends.native import protocol as proto
    from magi_comm.backends.native.kernels import CopyLaunch

    W, me, n = 3, 1, 16
    sigs = [torch.zeros(proto.NUM_SIGNALS * W, dtype=torch.int64) for _ in range(W)]
    sig_peers = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64)
    counter = torch.zeros(4, dtype=torch.int32)
    hs = proto.Handshake(sigs[me].data_ptr(), sig_peers.data_ptr(), counter.data_ptr(), me)

    def slot(kind: int, c: int) -> int:
        return kind * W + c

    sigs[me][slot(proto.ARM, 0)] = 2  # destination 0 armed us twice, destination 2 once
    sigs[me][slot(proto.ARM, 2)] = 1
    sigs[me][slot(proto.READY, 2)] = 5  # source 2 sent its fifth transfer
    words = (proto.pack_peer(arm_wait=2), proto.pack_peer(), proto.pack_peer(1, 5, arm_now=True))
    task = TaskTable(torch.tensor([0]), torch.tensor([n]), torch.tensor([[0, -1, 0, 0]]))
    regions = [torch.full((n,), -1, dtype=torch.int64) for _ in range(W)]
    src = torch.arange(100, 100 + n, dtype=torch.int64)
    sink = torch.full((n,), -1, dtype=torch.int64)
    peers = [regions[0].data_ptr(), None, regions[2].data_ptr()]
    launch = CopyLaunch(to_blocks(task, 1, 4), peers, torch.int64, num_warps=1, handshake=hs, max_programs=2)
    before = [s.clone() for s in sigs]
    steps = proto.ARM_AND_WAIT | proto.READY_END | proto.WAIT_READY_END
    launch(src.data_ptr(), sink.data_ptr(), sync=steps, words=words)
    for t in (regions[0], regions[2], sink):
        assert torch.equal(t, src), t
    added = [s - b for s, b in zip(sigs, before)]
    expect = [torch.zeros_like(s) for s in sigs]
    expect[2][slot(proto.ARM, me)] = 1  # armed source 2 (program 0 only)
    expect[0][slot(proto.READY, me)] = 1  # ready to both destinations (last program only)
    expect[2][slot(proto.READY, me)] = 1
    assert all(torch.equal(a, e) for a, e in zip(added, expect)), added
    assert int(counter[0]) == 0, counter

    # without blocks one program still performs the handshake
    empty = TaskTable(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                      torch.zeros((0, W + 1), dtype=torch.int64))  # fmt: skip
    idle = CopyLaunch(to_blocks(empty, 1, 4), [None] * W, torch.int64, num_warps=1, handshake=hs)
    assert idle.grid[0] == 0 and idle.sync_grid[0] == 1
    idle(0, 0)  # a plain launch of nothing does nothing
    idle(0, 0, sync=proto.ARM_AND_WAIT, words=(proto.pack_peer(arm_now=True), *words[1:]))
    assert int(sigs[0][slot(proto.ARM, me)]) == 1 and int(sigs[2][slot(proto.ARM, me)]) == 2
    assert int(counter[0]) == 0
    try:
        CopyLaunch(to_blocks(task, 1, 4), peers, torch.int64)(src.data_ptr(), 0, sync=steps, words=words)
    except ValueError as e:
        assert "handshake" in str(e), e
    else:
        raise AssertionError("a launch without a handshake accepted handshake steps")

    print("native_sim handshake triton ok", file=sys.stderr)


def main_triton_wait_bound() -> None:
    """Entry point: a wait for a signal that never comes ends with an error, not a hang, under
    TRITON_INTERPRET=1 with a short bound (run with ``MAGI_COMM_NATIVE_WAIT_TIMEOUT_S=0.05``:
    50 polls). Rank 1 of 2 waits for destination 0's arm (the send kernel's start), then for
    source 0's READY count (its end), then for source 0's rows (a receive copy beside the
    transfer); peer 0 never signals, so each launch raises."""
    from magi_comm.backends.native import protocol as proto
    from magi_comm.backends.native.kernels import CopyLaunch
    from magi_comm.backends.native.kernels.handshake import WAIT_LIMIT_POLLS

    assert int(WAIT_LIMIT_POLLS) == 50, "run with MAGI_COMM_NATIVE_WAIT_TIMEOUT_S=0.05"
    W, me, n = 2, 1, 8
    sigs = [torch.zeros(proto.NUM_SIGNALS * W, dtype=torch.int64) for _ in range(W)]
    sig_peers = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64)
    counter = torch.zeros(4, dtype=torch.int32)
    hs = proto.Handshake(sigs[me].data_ptr(), sig_peers.data_ptr(), counter.data_ptr(), me)
    task = TaskTable(
        torch.tensor([0]), torch.tensor([n]), torch.tensor([[0, -1, 0]])
    )  # to peer 0 and the sink
    region = torch.full((n,), -1, dtype=torch.int64)
    src, sink = torch.arange(n, dtype=torch.int64), torch.full((n,), -1, dtype=torch.int64)
    launch = CopyLaunch(to_blocks(task, 1, 4), [region.data_ptr(), None], torch.int64, num_warps=1,
                        handshake=hs, max_programs=1)  # fmt: skip
    cases = {
        "arm": (proto.ARM_AND_WAIT, proto.pack_peer(arm_wait=1)),
        "ready": (proto.READY_END | proto.WAIT_READY_END, proto.pack_peer(1, 1)),
    }
    for name, (steps, word) in cases.items():
        try:
            launch(src.data_ptr(), sink.data_ptr(), sync=steps, words=(word, proto.pack_peer()))
        except Exception as e:  # the interpreter's InterpreterError around the kernel's assertion
            assert "did not come within the wait bound" in str(e), (name, e)
        else:
            raise AssertionError(f"{name}: a wait for a signal that never comes returned")
        counter.zero_()  # the abandoned launch left its count of finished programs behind
    # a receive copy beside the transfer: the rows of source 0 never arrive
    rtask = TaskTable(torch.tensor([0]), torch.tensor([n]), torch.tensor([[-1, -1, 0]]))
    rtable = to_blocks(rtask, 1, 4)
    waits = (torch.zeros(rtable.num_blocks, dtype=torch.int32), torch.full((rtable.num_blocks,), n))
    recv = CopyLaunch(rtable, [None, None], torch.int64, num_warps=1, handshake=hs, max_programs=1,
                      waits=waits)  # fmt: skip
    try:
        recv(
            region.data_ptr(),
            sink.data_ptr(),
            sync=proto.AWAIT_ROWS,
            words=(proto.pack_peer(1, 1), proto.pack_peer()),
        )
    except Exception as e:
        assert "did not come within the wait bound" in str(e), e
    else:
        raise AssertionError("a receive copy waiting for rows that never come returned")
    print("native_sim wait bound triton ok", file=sys.stderr)


def _satisfied_signals(W: int, R: int, salt: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A signal array where every source's rows are in place (by PROGRESS for some sources, by
    READY for the others) and the matching per-source words (the interpreter runs one program
    at a time: a wait must already be satisfied)."""
    from magi_comm.backends.native import protocol as proto

    sig = torch.zeros(proto.NUM_SIGNALS * W, dtype=torch.int64)
    for s in range(W):
        if (s + salt) % 2:
            sig[proto.PROGRESS * W + s] = proto.progress_value(3, R)
            sig[proto.READY * W + s] = 4  # one short: only PROGRESS passes
        else:
            sig[proto.PROGRESS * W + s] = proto.progress_value(2, 10 * R)  # an older call's
            sig[proto.READY * W + s] = 5
    return sig, tuple(proto.pack_peer(3, 5) for _ in range(W))


def main_triton_overlap() -> None:
    """Entry point: the send kernel's progress reports and the receive copy's waits under
    TRITON_INTERPRET=1 (docs/native.md, "Receive copy beside the transfer").

    Rank 1 of 3 sends 24 words (rows of 2 words, blocks of 4) to peers 0 and 2 and itself
    with a grid of 2 programs and chunks of 2 blocks: peer 0's and peer 2's PROGRESS slot for
    rank 1 end at (epoch, 12 rows), every chunk's counter back at 0. Then a receive copy out of
    rank 1's own regions waits for sources 0 and 2, whose rows the signal array already
    reports (one by PROGRESS, one by READY), and moves the rows."""
    from magi_comm.backends.native import protocol as proto
    from magi_comm.backends.native.kernels import CopyLaunch
    from magi_comm.backends.native.progress import recv_waits, send_progress

    W, me, n, rw, R = 3, 1, 24, 2, 16
    sigs = [torch.zeros(proto.NUM_SIGNALS * W, dtype=torch.int64) for _ in range(W)]
    sig_peers = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64)
    counter = torch.zeros(4, dtype=torch.int32)
    chunk_cnt = torch.zeros(16, dtype=torch.int32)
    hs = proto.Handshake(sigs[me].data_ptr(), sig_peers.data_ptr(), counter.data_ptr(), me)
    span = R * rw
    # rows go to region index(1, 0) = 0 of peer 0 and index(1, 2) = 1 of peer 2
    task = TaskTable(torch.tensor([0]), torch.tensor([n // rw]),
                     torch.tensor([[region_index(me, 0) * R, -1, region_index(me, 2) * R, 0]]))  # fmt: skip
    table = to_blocks(task, rw, 4)
    rows = send_progress(table, me, W, R, rw, 2)
    assert rows.tolist() == [[4, -1, 4], [8, -1, 8], [12, -1, 12]], rows
    bufs = [torch.full((2 * span,), -1, dtype=torch.int64) for _ in range(W)]
    src = torch.arange(100, 100 + n, dtype=torch.int64)
    sink = torch.full((n,), -1, dtype=torch.int64)
    peers = [bufs[0].data_ptr(), None, bufs[2].data_ptr()]
    send = CopyLaunch(table, peers, torch.int64, num_warps=1, handshake=hs, max_programs=2,
                      progress=(rows, chunk_cnt.data_ptr(), 2))  # fmt: skip
    words = (proto.pack_peer(arm_wait=7), proto.pack_peer(), proto.pack_peer(arm_wait=9))
    send(src.data_ptr(), sink.data_ptr(), sync=proto.SIGNAL_PROGRESS, words=words)
    assert (
        torch.equal(bufs[0][:n], src)
        and torch.equal(bufs[2][span : span + n], src)
        and torch.equal(sink, src)
    )
    assert int(sigs[0][proto.PROGRESS * W + me]) == proto.progress_value(7, 12), sigs[0]
    assert int(sigs[2][proto.PROGRESS * W + me]) == proto.progress_value(9, 12), sigs[2]
    assert int(chunk_cnt.abs().sum()) == 0, chunk_cnt
    try:
        send(src.data_ptr(), 0, sync=proto.AWAIT_ROWS, words=words)
    except ValueError as e:
        assert "wait tables" in str(e), e
    else:
        raise AssertionError("a send without wait tables accepted AWAIT_ROWS")

    # receive: rank 1's regions hold 5 rows from source 0 (index 0) and 3 from source 2 (index 1)
    region = torch.arange(1000, 1000 + 2 * span, dtype=torch.int64)
    rsrc = torch.tensor([0, R])
    rtask = TaskTable(rsrc, torch.tensor([5, 3]), torch.tensor([[-1, -1, -1, 0], [-1, -1, -1, 5]]))
    rtable = to_blocks(rtask, rw, 4)
    source, need = recv_waits(rtable, me, W, R, rw)
    assert source.tolist() == [0, 0, 0, 2, 2] and need.tolist() == [2, 4, 5, 2, 3], (source, need)
    sig, swords = _satisfied_signals(W, R, 0)
    hs_recv = proto.Handshake(sig.data_ptr(), sig_peers.data_ptr(), counter.data_ptr(), me)
    out = torch.full((16,), -1, dtype=torch.int64)
    recv = CopyLaunch(rtable, [None] * W, torch.int64, num_warps=1, handshake=hs_recv, max_programs=2,
                      waits=(source, need))  # fmt: skip
    recv(region.data_ptr(), out.data_ptr(), sync=proto.AWAIT_ROWS, words=swords)
    assert torch.equal(out, torch.cat([region[:10], region[span : span + 6]])), out
    print("native_sim overlap triton ok", file=sys.stderr)


def main_triton_publish(device: str = "cpu") -> None:
    """Entry point: a reduce's send launch publishes pull maps under TRITON_INTERPRET=1.

    Rank 1 of 3 sends 8 words to peers 0 and 2. Peer 0 accepts pulls and the publish table
    has a map for it: the map lands in row 1 of peer 0's pull-map area and its region stays
    untouched; peer 2 does not accept: header 0 there, its rows arrive. A second launch with
    the header-0 table (a plain input) sends to both and clears peer 0's header. ``device``:
    where the kernel runs (the interpreter on "cpu"; twice per launch on a GPU, the second
    through the cached compiled kernel)."""
    from magi_comm.backends.native import protocol as proto
    from magi_comm.backends.native.kernels import CopyLaunch

    W, me, n, width = 3, 1, 8, 4

    def on(t):
        return t.to(device)

    sigs = [on(torch.zeros(proto.NUM_SIGNALS * W, dtype=torch.int64)) for _ in range(W)]
    sig_peers = on(torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64))
    counter = on(torch.zeros(4, dtype=torch.int32))
    hs = proto.Handshake(sigs[me].data_ptr(), sig_peers.data_ptr(), counter.data_ptr(), me)
    maps = [on(torch.full((W, width), 99, dtype=torch.int64)) for _ in range(W)]
    pub_peers = on(torch.tensor([m.data_ptr() for m in maps], dtype=torch.int64))
    accepts = on(torch.tensor([proto.PULL_ACCEPT, 0, 0], dtype=torch.int64))
    task = TaskTable(torch.tensor([0]), torch.tensor([n]), torch.tensor([[0, -1, 0, -1]]))
    regions = [on(torch.full((n,), -1, dtype=torch.int64)) for _ in range(W)]
    peers = [regions[0].data_ptr(), None, regions[2].data_ptr()]
    src = on(torch.arange(100, 100 + n, dtype=torch.int64))
    decided = on(torch.full((W,), -1, dtype=torch.int64))
    publish = (pub_peers.data_ptr(), accepts.data_ptr(), width, decided.data_ptr())
    launch = CopyLaunch(to_blocks(task, 1, 4).to(device), peers, torch.int64, num_warps=1, handshake=hs, max_programs=2,
                        fence=counter.data_ptr() + 8, publish=publish)  # fmt: skip
    with_maps = on(torch.tensor([0, 3, 3, 5, 5, 1000, 2000, 5, 3000], dtype=torch.int64))
    epochs = (proto.pack_peer(7), proto.pack_peer(), proto.pack_peer(4))  # no handshake steps
    for _ in range(1 if device == "cpu" else 2):
        launch(src.data_ptr(), 0, words=epochs, pub=with_maps.data_ptr())
    assert maps[0][me].tolist() == [5, 1000, 2000, 99], maps[0]  # peer 0 reads our input
    assert bool((regions[0] == -1).all()), regions[0]  # so nothing was sent to it
    assert int(maps[2][me, 0]) == 0 and torch.equal(regions[2], src), (maps[2], regions[2])
    assert bool((maps[me] == 99).all()) and bool((maps[0][[0, 2]] == 99).all())  # only row `me`
    assert decided.tolist() == [2 * 7 + 1, -1, 2 * 4], decided  # pulled by 0 (epoch 7), not by 2
    zeros = on(torch.tensor([0, 1, 1, 2, 0, 0], dtype=torch.int64))
    launch(
        src.data_ptr(),
        0,
        words=(proto.pack_peer(8), proto.pack_peer(), proto.pack_peer(5)),
        pub=zeros.data_ptr(),
    )
    assert int(maps[0][me, 0]) == 0 and torch.equal(regions[0], src), (maps[0], regions[0])
    assert decided.tolist() == [2 * 8, -1, 2 * 5], decided
    assert int(sigs[0].abs().sum() + sigs[2].abs().sum()) == 0  # no handshake step asked for
    try:
        launch(src.data_ptr(), 0)
    except ValueError as e:
        assert "publish table" in str(e), e
    else:
        raise AssertionError("a publishing launch ran without its table")
    print("native_sim publish triton ok", file=sys.stderr)


def main_triton_unpulled() -> None:
    """Entry point: a staged reduce's receive copy checks that its sources sent their rows,
    under TRITON_INTERPRET=1.

    Rank 1 of 3 receives from sources 0 and 2 (regions -> sink). With header 0 in both sources'
    rows of its pull-map area the rows arrive; a map in a row of a source that is not among the
    launch's changes nothing; a map in source 2's row (a source that left its rows for pulling)
    ends the launch with the error before any row is copied. (Which launches may take the check
    at all: test_native_compile's role test, through ``protocol.check_copy_roles``.)"""
    from magi_comm.backends.native import protocol as proto
    from magi_comm.backends.native.kernels import CopyLaunch

    W, me, n, width = 3, 1, 8, 4
    pull_maps = torch.zeros((W, width), dtype=torch.int64)
    # source 0's region rows go to sink words [0, n), source 2's to [n, 2n)
    task = TaskTable(
        torch.tensor([0, n]), torch.tensor([n, n]), torch.tensor([[-1, -1, -1, 0], [-1, -1, -1, n]])
    )
    region = torch.arange(100, 100 + 2 * n, dtype=torch.int64)
    launch = CopyLaunch(to_blocks(task, 1, 4), [None] * W, torch.int64, num_warps=1, max_programs=2,
                        unpulled=(pull_maps.data_ptr(), width, 0b101))  # fmt: skip
    for header in (0, 7):  # source 1 (this rank's own row) is not a source of the launch
        pull_maps[me, 0] = header
        sink = torch.full((2 * n,), -1, dtype=torch.int64)
        launch(region.data_ptr(), sink.data_ptr())
        assert torch.equal(sink, region), (header, sink)
    for source in (0, 2):
        pull_maps[:, 0] = 0
        pull_maps[source, 0] = 5  # 1 + an allocation: the source believes we read its input
        sink = torch.full((2 * n,), -1, dtype=torch.int64)
        try:
            launch(region.data_ptr(), sink.data_ptr())
        except Exception as e:  # the interpreter's InterpreterError around the kernel's assertion
            assert proto.MSG_PULLS_UNACCEPTED in str(e), (source, e)
        else:
            raise AssertionError(f"a receive copy read the region of source {source}, which left its rows")
        # the interpreter runs program 0 first: it checks before its block
        assert bool((sink == -1).all()), sink
    print("native_sim unpulled triton ok", file=sys.stderr)
