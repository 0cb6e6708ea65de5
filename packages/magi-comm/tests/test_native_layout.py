"""CPU tests of the native backend's pure parts: regions, rounds, copy tasks, blocks, growth.

The transport of all ranks is simulated in-process (``magi_comm.testing.native_sim``; the fused
reduction: ``magi_comm.testing.native_sim_reduce``) and compared with the oracle (cast) and with
the a2av receive buffer (reduce, which the shared reduction then turns into bitwise identical
results). When triton is installed the same simulation also runs the real copy kernel under
``TRITON_INTERPRET=1`` in a subprocess.
"""

import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import magi_comm.testing as lib
from magi_comm._plan import build_cast_plan, build_reduce_plan
from magi_comm.backends.native.layout import (
    SINK_CONCAT,
    SINK_NONE,
    SINK_SCATTER,
    BlockTable,
    TaskTable,
    _runs,
    apply_blocks,
    build_schedule,
    bytes_needed,
    field_offsets,
    grown_capacity,
    region_index,
    region_rows,
    reserved_capacity,
    to_blocks,
    word_size,
)
from magi_comm.backends.native.progress import arrival_order, recv_waits, reduce_waits, send_progress
from magi_comm.backends.native.terms import build_reduce_terms
from magi_comm.testing import native_sim, native_sim_reduce


@settings(max_examples=80, deadline=None)
@given(
    world=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["cast", "reduce"]),
    R=st.sampled_from([1, 2, 3, 7, 1000]),
    block_words=st.sampled_from([1, 2, 4, 64]),
)
def test_simulated_transport_matches_oracle(world, seed, kind, R, block_words):
    lay = lib.random_layout(random.Random(seed), world, max_splits=5, max_size=6)
    native_sim.check_layout(lay, kind, R, block_words)


@settings(max_examples=80, deadline=None)
@given(
    world=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    direct_bits=st.integers(0, 31),
    R=st.sampled_from([1, 2, 3, 1000]),
    block_words=st.sampled_from([1, 4, 64]),
)
def test_simulated_direct_cast_matches_oracle(world, seed, direct_bits, R, block_words):
    """Receivers in direct mode (peers write straight into their output, split by split) and
    receivers on regions, mixed in one call, with rounds."""
    lay = lib.random_layout(random.Random(seed), world, max_splits=5, max_size=6)
    direct = frozenset(r for r in range(world) if direct_bits >> r & 1)
    native_sim.check_layout(lay, "cast", R, block_words, direct_ranks=direct)


def test_cast_tasks_stay_inside_input_splits():
    """Two input splits that are adjacent everywhere still make two tasks in a cast's send
    table (a peer's output may place them apart), each with its split index per peer."""
    plan = build_cast_plan([2, 3], [2, 3], [[1], [1]], [1, 1], 0, 2)
    send = build_schedule(plan, 100, SINK_SCATTER).rounds[0].send
    assert send.nrows.tolist() == [2, 3]
    assert send.split_idx[:, 1].tolist() == [0, 1] and (send.split_idx[:, 0] == -1).all()
    assert send.within.tolist() == [0, 0]
    reduce_plan = build_reduce_plan([2, 3], [2, 3], [1, 1], [[1], [1]], 0, 2)
    rsend = build_schedule(reduce_plan, 100, SINK_CONCAT).rounds[0].send
    assert rsend.nrows.tolist() == [5] and rsend.split_idx is None  # reduces keep maximal runs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_special_layouts(world):
    for lay in lib.special_layouts(world):
        for kind in ("cast", "reduce"):
            for R in (1, 2, 100):
                native_sim.check_layout(lay, kind, R, block_words=2)
            native_sim.check_layout(lay, "cast", R=2, block_words=2, direct_ranks=frozenset(range(world)))


def test_true_cast_reads_each_range_once():
    # rank 0 sends one split of 4 rows to ranks 0, 1 and 2: a single task, three destinations
    lay = lib._complete(random.Random(0), 3, [[4], [], []], [[[0, 1, 2]], [], []])
    plan = build_cast_plan(*lay.cast_args(0), 0, 3)
    sched = build_schedule(plan, 100, SINK_SCATTER)
    assert sched.num_rounds == 1
    send = sched.rounds[0].send
    assert send.num_tasks == 1 and int(send.nrows[0]) == 4
    assert (send.dst_row[0] >= 0).tolist() == [False, True, True, True]  # peers 1, 2 and the sink
    assert sched.rounds[0].send_peers == (1, 2)


def test_rounds_split_large_pairs():
    lay = lib._complete(random.Random(0), 2, [[5], [3]], [[[1]], [[0]]])
    plan = build_cast_plan(*lay.cast_args(0), 0, 2)
    sched = build_schedule(plan, 2, SINK_SCATTER)
    assert sched.num_rounds == 3  # 5 rows out in chunks of 2, 3 rows in
    assert [r.send_peers for r in sched.rounds] == [(1,), (1,), (1,)]
    assert [r.recv_peers for r in sched.rounds] == [(1,), (1,), ()]
    assert [r.send.num_rows for r in sched.rounds] == [2, 2, 1]


def test_runs_merge_and_break():
    src = torch.tensor([0, 1, 2, 5, 6])
    dst = torch.tensor([[10, 11, 12, 13, 14], [-1, -1, 3, 4, 5]])
    t = _runs(src, dst)
    # break at 2 (column 1 starts), at 5 (source jumps); 6 continues 5
    assert t.src_row.tolist() == [0, 2, 5]
    assert t.nrows.tolist() == [2, 1, 2]
    assert t.dst_row.tolist() == [[10, -1], [12, 3], [13, 4]]


def test_to_blocks():
    t = TaskTable(torch.tensor([0, 4]), torch.tensor([3, 1]), torch.tensor([[5, -1], [-1, 0]]))
    b = to_blocks(t, row_words=2, block_words=4)  # tasks of 6 and 2 words
    assert b.blk_task.tolist() == [0, 0, 1]
    assert b.blk_start.tolist() == [0, 4, 0]
    assert b.task_src.tolist() == [0, 8]
    assert b.task_len.tolist() == [6, 2]
    assert b.task_dst.tolist() == [[10, -1], [-1, 0]]
    with pytest.raises(ValueError, match="power of two"):
        to_blocks(t, 2, 3)


def test_region_geometry():
    assert region_index(0, 1) == 0 and region_index(2, 1) == 1 and region_index(1, 2) == 1
    # W = 3: two regions; rows of 100 + 8 bytes
    cap = 1 << 20
    R = region_rows(cap, 3, (100, 8))
    offs = field_offsets(3, R, (100, 8))
    assert offs[0] == 0 and offs[1] % 16 == 0 and offs[1] >= 2 * R * 100
    assert offs[1] + 2 * R * 8 <= cap
    assert cap < 2 * (R + 1) * (100 + 8)  # the largest R: one more row per region does not fit
    assert region_rows(cap, 1, (100,)) >= 1 << 60  # no peers: unbounded
    assert region_rows(cap, 2, (0,)) >= 1 << 60  # empty rows
    assert region_rows(100, 2, (200,)) == 0  # a row does not fit -> the backend grows
    need = bytes_needed(2, (200,))
    assert region_rows(need, 2, (200,)) == 1
    assert region_rows(bytes_needed(4, (24, 8), rows=10), 4, (24, 8)) == 10


def test_growth_policy():
    mib = 1 << 20
    assert grown_capacity(256 * mib, 300 * mib) == 512 * mib  # doubles
    assert grown_capacity(256 * mib, 900 * mib + 5) == 901 * mib  # at least the need, MiB aligned
    assert grown_capacity(0, 1) == mib


def test_reserve_policy():
    """A reserve grows to its need and an eighth, within the room the heap leaves; a need past
    the room gets nothing, one within it never less than itself."""
    mib = 1 << 20
    need = 781983760  # cp 4 128k's dK/dV reduce (docs/perf.md)
    got = reserved_capacity(need, 5 << 30)
    assert got == 839 * mib and got % mib == 0
    assert 801177616 <= got < 2 * need  # the next mask's need fits, far from doubling
    assert reserved_capacity(need, 800 * mib) == 800 * mib  # cut to the room, still >= the need
    assert reserved_capacity(need, need) == need
    assert reserved_capacity(need, need - 1) == 0
    assert reserved_capacity(1, 4 * mib) == mib


def test_word_size():
    x = torch.zeros(16, dtype=torch.uint8)
    assert word_size(16, x) == 8
    assert word_size(12, x) == 4
    assert word_size(6, x) == 2
    assert word_size(3, x) == 1
    assert word_size(16, x[1:]) == 1  # misaligned view
    assert word_size(16, x[4:]) == 4


def test_schedule_rejects_bad_args():
    plan = build_cast_plan([1], [1], [[0]], [0], 0, 1)
    with pytest.raises(ValueError, match="rows_per_region"):
        build_schedule(plan, 0, SINK_SCATTER)
    with pytest.raises(ValueError, match="sink"):
        build_schedule(plan, 1, "nowhere")
    assert build_schedule(plan, 1, SINK_CONCAT).num_rounds == 1  # self only: one round, no peers


def test_registering_native_imports_no_gpu_stack():
    code = (
        "import sys, magi_comm.backends.native\n"
        "bad = [m for m in ('nvshmem', 'triton', 'cuda.core') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "from magi_comm.backends import available_backends\n"
        "assert 'native' in available_backends()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize(
    ("module", "entry", "wait_bound_s"),
    [
        ("native_sim", "main_triton", None),
        ("native_sim_reduce", "main_triton_reduce", None),
        ("native_sim", "main_triton_handshake", None),
        ("native_sim", "main_triton_overlap", None),
        ("native_sim", "main_triton_publish", None),
        ("native_sim", "main_triton_unpulled", None),
        # a known arm's slot stays 0: a launch that waited for it would end at the bound, an error
        ("native_sim_reduce", "main_triton_one_launch", "5"),
        ("native_sim", "main_triton_wait_bound", "0.05"),  # 50 polls
    ],
)
def test_kernel_under_triton_interpreter(module, entry, wait_bound_s):
    """The kernels on CPU tensors under TRITON_INTERPRET=1, in a subprocess: the copy kernel
    (``main_triton``, its handshake, progress and publish steps, a staged receive copy's check
    of its sources' pull-map headers), the fused reduction (``main_triton_reduce``: also reading
    pulled rows in place and its DONE step), the one-launch reduction (``main_triton_one_launch``:
    its START step with known and awaited arms, the tiles with each source's header read once,
    DONE), and the waits for a peer that never signals (``main_triton_wait_bound``: its arm, its
    READY count, its rows end the launch with an error past ``MAGI_COMM_NATIVE_WAIT_TIMEOUT_S``;
    compiled, a trap, the CUDA context in error, not a hang)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    if wait_bound_s is not None:
        env["MAGI_COMM_NATIVE_WAIT_TIMEOUT_S"] = wait_bound_s
    code = f"from magi_comm.testing import {module}; {module}.{entry}()"
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "soon"])
def test_the_wait_timeout_must_be_a_positive_number(monkeypatch, value):
    from magi_comm.backends.native.config import ENV_WAIT_TIMEOUT, wait_timeout_s

    monkeypatch.setenv(ENV_WAIT_TIMEOUT, value)
    with pytest.raises(ValueError, match=ENV_WAIT_TIMEOUT):
        wait_timeout_s()
    monkeypatch.setenv(ENV_WAIT_TIMEOUT, "2.5")
    assert wait_timeout_s() == 2.5


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    op=st.sampled_from(["sum", "avg"]),
    acc=st.booleans(),
    pull_bits=st.integers(0, 31),
    E=st.sampled_from([3, 4, 8]),
)
def test_fused_reduce_terms_match_oracle(world, seed, dtype, op, acc, pull_bits, E):
    """The fused reduction's tables (reference kernel) against the oracle; sources in
    ``pull_bits`` publish their input's map instead of sending (build_pull_terms /
    publish_table: the receiver reads those rows in place)."""
    lay = lib.random_layout(random.Random(seed), world, max_splits=5, max_size=6)
    pull = frozenset(r for r in range(world) if pull_bits >> r & 1)
    native_sim_reduce.check_fused_reduce(lay, 40, dtype, op, acc, E=E, pull_ranks=pull)


def test_fused_reduce_terms_refuse_rounds():
    lay = lib._complete(random.Random(0), 2, [[5], [3]], [[[1]], [[0]]])
    plan = build_reduce_plan(*lay.reduce_args(0), 0, 2)
    with pytest.raises(ValueError, match="does not fit one region"):
        build_reduce_terms(plan, 2)


def _blocks(table: BlockTable, lo: int, hi: int) -> BlockTable:
    return BlockTable(table.blk_task[lo:hi], table.blk_start[lo:hi], *[getattr(table, f) for f in (
        "task_src", "task_len", "task_dst", "task_split", "task_within", "block_words", "has_splits")])  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(
    world=st.integers(2, 5),
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["cast", "reduce"]),
    row_words=st.sampled_from([1, 3, 4]),
    block_words=st.sampled_from([1, 2, 4, 16]),
    chunk_blocks=st.sampled_from([1, 2, 3, 100]),
)
def test_progress_and_waits_cover_exactly_the_rows(world, seed, kind, row_words, block_words, chunk_blocks):
    """Overlap: after each chunk of a send, the reported rows of every destination's region are
    written and the next row is not (the sender copies chunk by chunk into poisoned regions);
    at the end every row sent is reported. Each receive block waits for the rows it reads and
    no more; each tile of the fused reduction for the peer rows of its terms."""
    lay = lib.random_layout(random.Random(seed), world, max_splits=5, max_size=6)
    R = 64  # every pair fits one region: one round
    sink = SINK_SCATTER if kind == "cast" else SINK_NONE
    plans = [
        build_cast_plan(*lay.cast_args(r), r, world) if kind == "cast" else build_reduce_plan(*lay.reduce_args(r), r, world)
        for r in range(world)
    ]  # fmt: skip
    W, span = world, R * row_words
    for r, plan in enumerate(plans):
        (rnd,) = build_schedule(plan, R, sink).rounds or (None,)
        if rnd is None:
            continue
        table = to_blocks(rnd.send, row_words, block_words)
        rows = send_progress(table, r, W, R, row_words, chunk_blocks)
        assert rows.shape == (-(-table.num_blocks // chunk_blocks), W)
        bufs = [torch.full(((W - 1) * span,), -7, dtype=torch.int64) for _ in range(W)]
        src = torch.arange(plan.num_input_rows * row_words, dtype=torch.int64)
        sink_words = torch.zeros(max(plan.num_output_rows, 1) * row_words, dtype=torch.int64)
        for j in range(rows.shape[0]):
            part = _blocks(table, j * chunk_blocks, (j + 1) * chunk_blocks)
            apply_blocks(part, src, sink_words, [None if c == r else bufs[c] for c in range(W)], W)
            for c in range(W):
                sent = plan.send_counts[c] if c != r else 0
                if sent == 0:
                    assert int(rows[j, c]) == -1
                    continue
                got = int(rows[j, c])
                region = bufs[c][region_index(r, c) * span : region_index(r, c) * span + sent * row_words]
                written = (region != -7).view(sent, row_words).all(1)
                assert bool(written[:got].all()), (r, c, j, got)
                assert got == sent or not bool(written[got]), (r, c, j, got)
        for c in range(W):
            if c != r and plan.send_counts[c]:
                assert int(rows[-1, c]) == plan.send_counts[c]

        if kind == "cast":
            recv = to_blocks(rnd.recv, row_words, block_words)
            source, need = recv_waits(recv, r, W, R, row_words)
            for b in range(recv.num_blocks):
                t, start = int(recv.blk_task[b]), int(recv.blk_start[b])
                first = int(recv.task_src[t]) + start
                last = first + min(block_words, int(recv.task_len[t]) - start) - 1
                s = int(source[b])
                base = region_index(s, r) * span
                assert s != r and base <= first and last < base + plan.recv_counts[s] * row_words
                assert int(need[b]) == (last - base) // row_words + 1
        else:
            term_row, term_self, nterms = build_reduce_terms(plan, R)
            for tile_rows in (1, 3):
                need = reduce_waits(term_row, term_self, nterms, r, W, R, tile_rows)
                expect = torch.zeros_like(need)
                for j in range(term_row.shape[0]):
                    for k in range(int(nterms[j])):
                        if not term_self[j, k]:
                            reg, q = divmod(int(term_row[j, k]), R)
                            s = reg + (reg >= r)
                            expect[j // tile_rows, s] = max(int(expect[j // tile_rows, s]), q + 1)
                assert torch.equal(need, expect)


def test_progress_rejects_bad_chunks():
    with pytest.raises(ValueError, match="chunk_blocks"):
        send_progress(to_blocks(TaskTable.empty(2), 1, 1), 0, 2, 4, 1, 0)
    with pytest.raises(ValueError, match="tile_rows"):
        z = torch.zeros((0, 2), dtype=torch.int64)
        reduce_waits(z, z.to(torch.int8), z[:, 0], 0, 2, 4, 0)


def test_arrival_order_sorts_tiles_by_the_share_of_rows_they_need():
    # two sources with 10 and 4 rows: a tile needing 5 of 10 (0.5) comes after one needing
    # 1 of 4 (0.25) and before one needing 3 of 4 (0.75)
    need = torch.tensor([[0, 5, 0], [0, 0, 3], [0, 1, 1], [0, 0, 0], [0, 10, 4], [0, 2, 0]])
    order = arrival_order(need, [0, 10, 4])
    assert order.dtype == torch.int32
    assert order.tolist() == [3, 5, 2, 0, 1, 4]
