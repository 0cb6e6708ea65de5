"""The fused reduction in the in-process simulation of the native backend (CPU, or one GPU).

Every rank's group_reduce sends in a single round with ``SINK_NONE`` (every peer row stays in the
regions, own rows in the input); the fused reduction then reads the rows through the term tables,
by the reference on the host (:func:`check_fused_reduce`) or by the Triton kernel with its wait
and DONE steps (under ``TRITON_INTERPRET=1`` on CPU tensors, or compiled on a GPU). Sources may
publish a map of their input instead of sending: the receiver reads those rows in place
(:func:`pulled_region`). ``native_fake_kernels`` reuses the host reference. The copy transport's
simulation and the kernels' other steps are in :mod:`magi_comm.testing.native_sim`.
"""

from __future__ import annotations

import ctypes
import random
import sys

import torch

import magi_comm.testing as lib
from magi_comm._plan import build_reduce_plan
from magi_comm.backends.native.layout import SINK_NONE, apply_blocks, build_schedule, to_blocks
from magi_comm.backends.native.terms import (
    build_pull_terms,
    build_reduce_terms,
    publish_row,
    publish_table,
    unpack_pull_term,
)

from .native_sim import _satisfied_signals

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fused_reference(out, inp, region, term_row, term_self, nterms, acc_reduce, average):
    adt = torch.float64 if out.dtype == torch.float64 else torch.float32
    res = out.to(adt) if acc_reduce else torch.zeros(out.shape, dtype=adt)
    for j in range(out.shape[0]):
        for k in range(int(nterms[j])):
            srcs = inp if term_self[j, k] else region
            res[j] = res[j] + srcs[int(term_row[j, k])].to(adt)
    if average:
        cnt = (nterms + int(acc_reduce)).clamp_min(1).to(adt)
        res = res / cnt[:, None]
    out.copy_(res.to(out.dtype))


def _host_words(addr: int, n: int) -> torch.Tensor:
    """``n`` int64 words of host memory at ``addr`` (no copy)."""
    return torch.frombuffer((ctypes.c_char * (8 * n)).from_address(addr), dtype=torch.int64)


def pulled_region(reg, term_row, term_self, nterms, pull) -> tuple[torch.Tensor, int]:
    """The fused reduction's pull on the host: ``reg`` (the local regions, rows of ``E``
    elements) with the rows of every source that published a map (its header in the
    ``pull_maps`` row is > 0) replaced by the input row the kernel reads instead, at its
    allocation's address (``alloc_base``) plus the split's offset plus the row inside it.
    ``pull = (term_pull, pull_maps, alloc_base, map_width)`` as for ``launch_reduce``.
    Returns the region and the number of terms read in place."""
    term_pull, pull_maps, alloc_base, width = pull
    W, E = term_row.shape[1], reg.shape[1]
    rb = E * reg.element_size()
    n = 0
    for j in range(term_row.shape[0]):
        for k in range(int(nterms[j])):
            tp = int(term_pull[j, k])
            if term_self[j, k] or tp < 0:
                continue
            c, split, within = unpack_pull_term(tp)
            if split >= width - 1:  # not in a map row: the kernel reads the region
                continue
            row = _host_words(pull_maps + 8 * c * width, 2 + split)
            if int(row[0]) <= 0:
                continue
            hdr = int(row[0])
            base = int(_host_words(alloc_base, hdr * W)[(hdr - 1) * W + c])
            at = base + int(row[1 + split]) + within * rb
            reg[int(term_row[j, k])] = torch.frombuffer(
                (ctypes.c_char * rb).from_address(at), dtype=reg.dtype
            )
            n += 1
    return reg, n


def _pull_setup(plans, inputs, pull_ranks, r: int, width: int, rb: int):
    """What receiver ``r`` finds for sources in ``pull_ranks``: its pull-map area (int64
    ``(W, width)``, row ``s`` as ``s``'s send launch publishes it) and the table of peers'
    allocations (allocation ``s`` is source ``s``'s input, at its own address)."""
    W = len(plans)
    maps = torch.zeros((W, width), dtype=torch.int64)
    bases = torch.zeros((W, W), dtype=torch.int64)
    for s in pull_ranks:
        if s == r or plans[s].send_counts[r] == 0:
            continue
        bases[s, s] = inputs[s].data_ptr()
        row = publish_row(publish_table(plans[s], width, (s, 0, rb)), W, r)
        maps[s, : row.numel()] = row
    return maps, bases


def check_fused_reduce(
    lay: lib.Layout,
    R,
    dtype,
    op,
    acc,
    use_triton=False,
    E=3,
    waits=False,
    pull_ranks=frozenset(),
    device="cpu",
    known_rng=None,
) -> tuple[int, int]:
    """Send with SINK_NONE, reduce with the term tables; compare bitwise with the oracle.
    ``waits``: the reduction runs as beside a transfer (every tile waits for its rows; the
    signals already say they are in place; a grid of 2 programs strides over the tiles).
    ``pull_ranks``: sources whose rows are not sent: they publish a map of their input and
    the receivers read the rows there (the regions keep their poison for those); with Triton
    the reduction also runs its DONE step (raised on every source, awaited for a pulled
    input: the slots already hold the epoch). ``device``: where the Triton kernel runs (the
    interpreter on "cpu", the compiled kernel on a GPU; every rank's memory on that device).
    ``known_rng`` (Triton, every rank in ``pull_ranks``, no ``waits``): each rank's reduction is
    a one launch, making the call's handshake too (its START step), the random.Random marking
    some destinations' arms known. Returns how many destinations' arms were known and how many
    awaited, over the ranks (one launch only)."""
    W = lay.world
    plans = [build_reduce_plan(*lay.reduce_args(r), r, W) for r in range(W)]
    scheds = [build_schedule(p, R, SINK_NONE) for p in plans]
    assert all(s.num_rounds <= 1 for s in scheds)
    case = {"seed": R * 7 + W, "row_shape": (E,)}
    inputs = [lib.rank_data(case, r, p.num_input_rows, dtype) for r, p in enumerate(plans)]
    olds = [lib.rank_data(case, r, p.num_output_rows, dtype, salt=1) for r, p in enumerate(plans)]
    w = dtype.itemsize
    regions = [torch.full((max(W - 1, 0) * R, E), 1e4, dtype=dtype) for _ in range(W)]  # poison
    for r in range(W):
        if scheds[r].num_rounds and r not in pull_ranks:
            rnd = scheds[r].rounds[0]
            assert rnd.recv.num_tasks == 0 and not (rnd.send.dst_row[:, W] >= 0).any()
            bt = to_blocks(rnd.send, E, 4)
            peers = [None if d == r else regions[d].view(-1).view(_WORD[w]) for d in range(W)]
            apply_blocks(bt, inputs[r].view(-1).view(_WORD[w]), torch.empty(0, dtype=_WORD[w]), peers, W)
    width = 1 + max([len(p.send_split_ids[d]) for p in plans for d in range(W)], default=0)
    on = [x.to(device) for x in inputs]  # the inputs the pulled rows are read from
    known_arms = awaited_arms = 0
    for r in range(W):
        term_row, term_self, nterms = build_reduce_terms(plans[r], R)
        term_pull = build_pull_terms(plans[r], term_row, term_self, nterms, R)
        maps, bases = (x.to(device) for x in _pull_setup(plans, on, pull_ranks, r, width, E * w))
        out = olds[r].clone()
        if use_triton:
            out, arms = _triton_fused_reduce(plans, r, R, E, on, regions[r], olds[r], (term_row, term_self, nterms),
                                             (term_pull, maps, bases, width), op, acc, waits, r in pull_ranks,
                                             device, known_rng)  # fmt: skip
            known_arms, awaited_arms = known_arms + arms[0], awaited_arms + arms[1]
        else:
            pull = (term_pull, maps.data_ptr(), bases.data_ptr(), width)
            reg, _ = pulled_region(regions[r].clone(), term_row, term_self, nterms, pull)
            _fused_reference(out, inputs[r], reg, term_row, term_self, nterms, acc, op == "avg")
        exp = lib.reduce_oracle_sum_avg(lay, inputs, r, olds[r], op, acc)
        assert torch.equal(out.view(_WORD[w]), exp.view(_WORD[w])), (r, dtype, op, acc, lay, pull_ranks)
    return known_arms, awaited_arms


def _triton_fused_reduce(
    plans,
    r,
    R,
    E,
    inputs,
    region,
    old,
    terms,
    pull,
    op,
    acc,
    waits,
    pulled,
    device,
    known_rng=None,
):
    """Rank ``r``'s fused reduction by the Triton kernel on ``device`` (see check_fused_reduce),
    with its DONE step: every source gets epoch 3 + r; our send of this call (epoch 5) left its
    rows to the even destinations, which already signalled DONE. ``known_rng`` (None: not one
    launch): the launch makes the call's handshake itself (its START step; every destination
    pulls, so all of them signalled DONE): it arms the sources, awaits the destinations' arms
    (not those the rng marks known: their slots stay 0), publishes our map into each
    destination's pull-map area (checked) and signals READY (checked). Returns the output (CPU)
    and how many destinations' arms were known and awaited."""
    from magi_comm.backends.native import protocol as proto
    from magi_comm.backends.native.kernels import launch_reduce, reduce_tile_rows
    from magi_comm.backends.native.progress import arrival_order, reduce_waits

    W = len(plans)
    term_row, term_self, nterms = terms
    sigs = [torch.zeros(proto.NUM_SIGNALS * W, dtype=torch.int64) for _ in range(W)]
    dst = [c != r and plans[r].send_counts[c] > 0 for c in range(W)]
    src = [c != r and plans[r].recv_counts[c] > 0 for c in range(W)]
    wait_args = None
    if waits:
        sigs[r], words = _satisfied_signals(W, R, r)
        need = reduce_waits(term_row, term_self, nterms, r, W, R, reduce_tile_rows(E, True))
        order = arrival_order(need, plans[r].recv_counts).flip(0).contiguous()  # any order works
    for c in range(W):
        sigs[r][proto.DONE * W + c] = 5 if dst[c] else 0
    start = None
    one_launch = known_rng is not None
    known = [d and known_rng.random() < 0.5 for d in dst] if one_launch else [False] * W
    if one_launch:
        assert not waits and pulled
        for c in range(W):
            sigs[r][proto.ARM * W + c] = 5 if dst[c] and not known[c] else 0
            sigs[r][proto.READY * W + c] = 1 if src[c] else 0
    sigs = [x.to(device) for x in sigs]
    if waits:
        wait_args = (need.to(device), order.to(device), sigs[r].data_ptr(), words, 2)
    sig_peers = torch.tensor([x.data_ptr() for x in sigs], dtype=torch.int64).to(device)
    counter = torch.zeros(4, dtype=torch.int32, device=device)
    hs = proto.Handshake(sigs[r].data_ptr(), sig_peers.data_ptr(), counter.data_ptr(), r)
    decided = torch.tensor([2 * 5 + (c % 2 == 0) if dst[c] else 0 for c in range(W)], dtype=torch.int64)
    decided = decided.to(device)
    done = tuple(proto.pack_done(5 if dst[c] else 0, 3 + r if src[c] else 0) for c in range(W))
    term_pull, maps, bases, width = pull
    if one_launch:
        words = tuple(
            proto.pack_peer(5 if dst[c] else 0, 1 if src[c] else 0, src[c], known[c]) for c in range(W)
        )
        table = publish_table(plans[r], width, (r, 0, E * inputs[r].element_size())).to(device)
        areas = [torch.zeros(W * width, dtype=torch.int64, device=device) for _ in range(W)]
        area_addrs = torch.tensor([a.data_ptr() for a in areas], dtype=torch.int64).to(device)
        accepts = torch.full((W,), proto.PULL_ACCEPT, dtype=torch.int64, device=device)
        start = (words, table.data_ptr(), area_addrs.data_ptr(), accepts.data_ptr())
    out = old.to(device, copy=True)
    region, tables = region.to(device), [t.to(device) for t in (term_row, term_self, nterms, term_pull)]
    launch_reduce(
        out,
        inputs[r],
        region,
        *tables[:3],
        acc_reduce=acc,
        average=op == "avg",
        waits=wait_args,
        pull=(tables[3], maps.data_ptr(), bases.data_ptr(), width),
        end=(hs, counter.data_ptr(), decided.data_ptr(), done, pulled),
        start=start,
    )
    sigs = [x.cpu() for x in sigs]
    if one_launch:
        for c in range(W):
            row = publish_row(table.cpu(), W, c)
            got = areas[c].cpu()[r * width : r * width + row.numel()]
            assert torch.equal(got, row), (r, c, got, row)  # our map, in c's area (empty: no rows)
            assert int(sigs[c][proto.READY * W + r]) == int(dst[c]), (r, c)  # READY raised
            assert int(sigs[c][proto.ARM * W + r]) == int(src[c]), (r, c)  # the source armed
            assert int(decided[c]) == (2 * 5 + 1 if dst[c] else 0), (r, c, decided)
    for c in range(W):
        assert int(sigs[c][proto.DONE * W + r]) == (3 + r if src[c] else 0), (r, c, sigs[c])
    assert int(counter[0]) == 0, counter
    arms = (sum(known), sum(dst) - sum(known)) if one_launch else (0, 0)
    return out.cpu(), arms


def main_triton_reduce(n: int = 16) -> None:
    """Entry point: :func:`check_fused_reduce` through the Triton kernel under TRITON_INTERPRET=1."""
    rng = random.Random(11)
    for _ in range(n):
        world = rng.randint(1, 4)
        lay = lib.random_layout(rng, world, max_splits=4, max_size=5)
        # not bfloat16: the interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest even)
        dtype = rng.choice([torch.float32, torch.float64, torch.float16])
        pull = frozenset(r for r in range(world) if rng.random() < 0.5)
        check_fused_reduce(lay, 40, dtype, rng.choice(["sum", "avg"]), rng.random() < 0.5, use_triton=True,
                           E=rng.choice([3, 4, 8]), waits=rng.random() < 0.5, pull_ranks=pull)  # fmt: skip
    print("native_sim_reduce triton ok", file=sys.stderr)


def main_triton_one_launch(n: int = 10) -> None:
    """Entry point: the one-launch reduction (its START step: arms, the destinations' arms, some
    known and not awaited, the publish, READY, the sources' READY; then the tiles reading every
    peer row in place, with each source's header read once; then DONE) through the Triton kernel
    under TRITON_INTERPRET=1, against the oracle."""
    rng = random.Random(12)
    known = awaited = 0
    for _ in range(n):
        world = rng.randint(1, 3)
        lay = lib.random_layout(rng, world, max_splits=4, max_size=5)
        dtype = rng.choice([torch.float32, torch.float64, torch.float16])
        arms = check_fused_reduce(lay, 40, dtype, rng.choice(["sum", "avg"]), rng.random() < 0.5, use_triton=True,
                                  E=rng.choice([4, 8]), pull_ranks=frozenset(range(world)), known_rng=rng)  # fmt: skip
        known, awaited = known + arms[0], awaited + arms[1]
    assert known > 0 and awaited > 0, (known, awaited)  # both kinds of arm ran
    print(f"native_sim_reduce one launch triton ok ({known} arms known, {awaited} awaited)", file=sys.stderr)
