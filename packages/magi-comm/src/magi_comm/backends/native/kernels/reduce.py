"""The fused reduction kernel: group_reduce ``sum`` / ``avg`` straight from where the terms lie.

For calls whose peer rows all fit the receive regions at once, it reads every term where it
lies (own input rows, peer rows in the local regions or, pulled, in a peer's input) and
accumulates in float32 (float64 for float64) in ascending source order, existing output first:
exactly the additions of :func:`magi_comm._reduce.reduce_sum_avg`, so bitwise equal to the a2av
path. Its last program performs the DONE step of the pull protocol. Design:
``packages/magi-comm/docs/native.md`` ("GroupReduce", "Pull").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import protocol as proto
from ..protocol import IDLE_WORD, PEER_WORDS, Handshake
from ..terms import PULL_ROW_MASK, PULL_SOURCE_SHIFT, PULL_SPLIT_MASK, PULL_SPLIT_SHIFT
from .compiled import CompiledKernel
from .copy import _publish, _pulled_peers
from .handshake import (
    PEER_ARGS,
    add_to_peer,
    await_at_least,
    await_rows,
    fail,
    handshake_start,
    peer_word,
    poll_pause,
)

__all__ = ["REDUCE_WARPS", "launch_reduce", "reduce_tile_rows"]

# jit code reads module globals only as constexprs
DONE = tl.constexpr(proto.DONE)
READY = tl.constexpr(proto.READY)
_PUB_SHIFT_SRC = tl.constexpr(PULL_SOURCE_SHIFT)
_PUB_SHIFT_SPLIT = tl.constexpr(PULL_SPLIT_SHIFT)
_PUB_SPLIT_MASK = tl.constexpr(PULL_SPLIT_MASK)
_PUB_ROW_MASK = tl.constexpr(PULL_ROW_MASK)
_DONE_ARGS = [f"d{c}" for c in range(PEER_WORDS)]
_START_ARGS = ["pub", "pub_peers", "accepts"]


# a one-launch reduce's destination does not accept pulls: its rows would need a send this launch
# cannot make (protocol.py says when and why it ends in this error)
REFUSED = tl.constexpr(proto.MSG_PULLS_REFUSED)


@triton.jit
def _reduce_start(sig, sig_peers, pub, pub_peers, accepts, decided, p0, p1, p2, p3, p4, p5, p6, p7,
                  W: tl.constexpr, ME: tl.constexpr, MAPW: tl.constexpr, PAUSE: tl.constexpr):  # fmt: skip
    """The call's handshake in the reduction itself (``START``: one launch on 2 ranks): program
    0 arms the sources flagged ``arm_now`` and waits for the destinations' arms (their earlier
    calls are over and their accept words in place) but those known (docs/native.md, "The
    arm known"), publishes every destination's pull map (each must pull: a destination that
    does not accept would need its rows sent, which this launch cannot do, so it traps
    instead; for a known arm the accept word read may be the previous call's, and a refusal
    goes unseen here: the staged receiver's receive copy stops instead), records the decisions
    under each destination's epoch and signals READY; every program then acquires each
    source's READY count before its first tile, pausing between polls (the whole grid polls at
    once: ``ONE_LAUNCH_PROGRAMS`` programs unless ``reduce_programs`` sets it). The words are
    those of the send kernel (``pack_peer``)."""
    if tl.program_id(0) == 0:
        # the send kernel's start, in this program alone: arm, then the destinations' arms
        handshake_start(sig, p0, p1, p2, p3, p4, p5, p6, p7, sig_peers, W, ME, 1, PAUSE)
        pulled = _pulled_peers(pub, accepts, W)
        tab = pub.to(tl.pointer_type(tl.int64))
        wanted = tl.full((), 0, tl.int32)
        for c in tl.static_range(W):
            if tl.load(tab + c + 1) > tl.load(tab + c):
                wanted = wanted | (1 << c)
        if pulled != wanted:
            fail(PAUSE, REFUSED)
        _publish(pub, pub_peers, decided, pulled, tl.arange(0, 16), p0, p1, p2, p3, p4, p5, p6, p7, W, ME,
                 MAPW, 16)  # fmt: skip
        tl.debug_barrier()  # the headers, released with the signal (cumulative over the CTA)
        for c in tl.static_range(W):
            if ((peer_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 32) & 0x3FFFFFFF) > 0:
                add_to_peer(sig_peers, c, READY, W, ME)
    slots = sig.to(tl.pointer_type(tl.int64))
    for c in tl.static_range(W):
        want = (peer_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 1) & 0x7FFFFFFF
        if want > 0:
            await_at_least(slots + READY * W + c, want, PAUSE, True)


@triton.jit
def _reduce_end(sig, sig_peers, counter, decided, d0, d1, d2, d3, d4, d5, d6, d7, W: tl.constexpr,
                ME: tl.constexpr, WAIT_DONE: tl.constexpr, PAUSE: tl.constexpr):  # fmt: skip
    """The fused reduction's last program: raise ``DONE`` on every source to the pair's epoch
    (this rank no longer reads its input); with ``WAIT_DONE`` (our input may be read in place)
    wait for ``DONE`` of every destination this call's send left its rows to (``decided``,
    written by the send kernel: waited for first, since the reduction may run beside it).
    Reads are complete once every program has counted itself (the values were used before),
    so GPU scope suffices there."""
    tl.debug_barrier()
    cnt = counter.to(tl.pointer_type(tl.int32))
    finished = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # the next launch starts at 0
        for c in tl.static_range(W):
            src_epoch = (peer_word(c, d0, d1, d2, d3, d4, d5, d6, d7) >> 1) & 0x7FFFFFFF
            if src_epoch > 0:
                peer = tl.load(sig_peers.to(tl.pointer_type(tl.int64)) + c).to(tl.pointer_type(tl.int64))
                tl.atomic_max(peer + DONE * W + ME, src_epoch, sem="release", scope="sys")
        if WAIT_DONE:
            slots = sig.to(tl.pointer_type(tl.int64))
            for c in tl.static_range(W):
                dst_epoch = (peer_word(c, d0, d1, d2, d3, d4, d5, d6, d7) >> 32) & 0x3FFFFFFF
                if dst_epoch > 0:
                    at = decided.to(tl.pointer_type(tl.int64)) + c
                    got = tl.load(at, volatile=True)
                    while (got >> 1) < dst_epoch:
                        got = tl.load(at, volatile=True)
                    got = tl.atomic_add(at, 0, sem="acquire", scope="gpu")
                    if (got & 1) != 0:
                        await_at_least(slots + DONE * W + c, dst_epoch, PAUSE, False)


@triton.jit(do_not_specialize=PEER_ARGS + _DONE_ARGS + _START_ARGS)
def _reduce_kernel(
    out,
    inp,
    region,
    region_addr,
    term_row,
    term_self,
    nterms,
    need,
    order,
    sig,
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,
    d0,
    d1,
    d2,
    d3,
    d4,
    d5,
    d6,
    d7,
    term_pull,
    pull_maps,
    alloc_base,
    decided,
    sig_peers,
    counter,
    n_rows,
    E,
    pub,
    pub_peers,
    accepts,
    TERMS: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    ACC: tl.constexpr,
    AVG: tl.constexpr,
    ACC_DT: tl.constexpr,
    W: tl.constexpr,
    AWAIT: tl.constexpr,
    PAUSE: tl.constexpr,
    PULL: tl.constexpr,
    PV: tl.constexpr,
    ES: tl.constexpr,
    MAPW: tl.constexpr,
    ME: tl.constexpr,
    END: tl.constexpr,
    WAIT_DONE: tl.constexpr,
    START: tl.constexpr,
):
    # Tiles of BR rows x BC columns; program p takes tiles p, p + grid, ... (one tile each
    # without AWAIT). AWAIT: before a tile, wait for the peers' rows it reads (``need``:
    # int64 (row tiles, W), leading region rows per source), as the receive copy does; row
    # tiles are taken in the order their rows arrive (``order``: int32 (row tiles,)).
    # PULL: a peer term whose source published a map (``pull_maps`` row c: [1 + allocation,
    # byte offset of each pair split], ``alloc_base``: the peers' allocations) is read from that
    # source's input over NVLink (``term_pull``: source, pair split, row inside it), the
    # others from the regions; addresses become element offsets from ``region`` (a tensor
    # argument: the compiler knows its 16-byte alignment, which a pointer made from an integer
    # would lose) so that the loads stay PV-element vectors. END: the DONE step (_reduce_end).
    # START: the arm, publish and READY steps and the wait for the sources (_reduce_start).
    if START:
        _reduce_start(sig, sig_peers, pub, pub_peers, accepts, decided, p0, p1, p2, p3, p4, p5, p6, p7,
                      W, ME, MAPW, PAUSE)  # fmt: skip
    ncb = tl.cdiv(E, BC)
    ntiles = tl.cdiv(n_rows, BR) * ncb
    tile = tl.program_id(0)
    seen = tl.full((8,), -1, tl.int64)  # per source, the PROGRESS value acquired so far
    lane = tl.arange(0, 8)
    # one launch (START): every source's pull-map header is in place once its READY is acquired,
    # before the first tile, so each source's header and allocation base are read once here, not
    # per tile (two of the three dependent loads ahead of each pulled row's NVLink read): +0.7%
    # GB/s at 64 MiB, +0.5-0.7% at 16 on 2x H100 (docs/perf.md, "group_reduce: the arm known",
    # (d)); the reduction after a transfer kept its per-tile loads (hoisted there it lost 6%)
    HOISTED: tl.constexpr = START  # (a start comes with PULL: launch_reduce refuses one without)
    if HOISTED:
        maps64 = pull_maps.to(tl.pointer_type(tl.int64))
        hdrs = tl.load(maps64 + lane * MAPW, mask=lane < W, other=0)
        bases = tl.load(
            alloc_base.to(tl.pointer_type(tl.int64)) + tl.where(hdrs > 0, (hdrs - 1) * W + lane, 0),
            mask=(lane < W) & (hdrs > 0),
            other=0,
        )
    # Every value is read once and the output written once: the own terms, the output and the
    # pulled rows load with evict_first, the output stores streaming (.cs); the region rows keep
    # the default (the variant measured had no hint there). +0.2-0.4% GB/s for
    # reduce-sym at 64 MiB and +2.6-3.2% for the plain reduce at 16 MiB on 2x H100, four turns
    # (docs/perf.md, "group_reduce: the arm known by default", (c)); .cg on the pulled load alone
    # was level, and ptxas refuses .cg with evict_first.
    while tile < ntiles:
        rt = tile // ncb
        if AWAIT:
            rt = tl.load(order + rt)
            for c in tl.static_range(W):
                rows_c = tl.load(need + rt * W + c)
                if rows_c > 0:
                    seen_c = tl.max(tl.where(lane == c, seen, -1), 0)
                    got = await_rows(
                        sig, c, rows_c, peer_word(c, p0, p1, p2, p3, p4, p5, p6, p7), seen_c, W, PAUSE
                    )
                    seen = tl.where(lane == c, got, seen)
        rows = rt * BR + tl.arange(0, BR)
        cols = (tile % ncb) * BC + tl.arange(0, BC)
        rmask = rows < n_rows
        m = rmask[:, None] & (cols < E)[None, :]
        rows64 = rows.to(tl.int64)
        offs = rows64[:, None] * E + cols[None, :]
        if ACC:
            acc = tl.load(out + offs, mask=m, other=0, eviction_policy="evict_first").to(ACC_DT)
        else:
            acc = tl.zeros((BR, BC), dtype=ACC_DT)
        nt = tl.load(nterms + rows64, mask=rmask, other=0)
        for k in tl.static_range(TERMS):
            tr = tl.load(term_row + rows64 * TERMS + k, mask=rmask, other=0)
            ts = tl.load(term_self + rows64 * TERMS + k, mask=rmask, other=0) != 0
            has = rmask & (nt > k)
            toff = tr[:, None] * E + cols[None, :]
            mk = m & has[:, None]
            vs = tl.load(inp + toff, mask=mk & ts[:, None], other=0, eviction_policy="evict_first")
            if PULL:
                # per-row values as (BR, 1) tiles from the start (1-D rows mixed with 2-D
                # vector loads trip Triton's layout pass); unmasked loads at clamped indices
                # (row 0 and entry 0 always exist)
                tp = tl.load(term_pull + rows64[:, None] * TERMS + k, mask=rmask[:, None], other=-1)
                peer_term = has[:, None] & ~ts[:, None] & (tp >= 0)
                c = tl.where(peer_term, (tp >> _PUB_SHIFT_SRC) & 0xFF, 0)
                maps_row = pull_maps.to(tl.pointer_type(tl.int64)) + c * MAPW
                split = (tp >> _PUB_SHIFT_SPLIT) & _PUB_SPLIT_MASK
                in_row = peer_term & (split < MAPW - 1)  # a map row holds MAPW - 1 splits
                if HOISTED:  # (BR, 1) picks from the per-source vectors
                    pick = lane[None, :] == c
                    hdr = tl.sum(tl.where(pick, hdrs[None, :], 0), axis=1)[:, None]
                    base = tl.sum(tl.where(pick, bases[None, :], 0), axis=1)[:, None]
                    pulled = in_row & (hdr > 0)
                    # its address needs no header: read while the header is still unknown
                    entry = tl.load(maps_row + tl.where(in_row, 1 + split, 0))
                else:
                    hdr = tl.load(maps_row)
                    pulled = in_row & (hdr > 0)
                    base = tl.load(
                        alloc_base.to(tl.pointer_type(tl.int64)) + tl.where(pulled, (hdr - 1) * W + c, 0)
                    )
                    entry = tl.load(maps_row + tl.where(pulled, 1 + split, 0))
                within = tp & _PUB_ROW_MASK
                poff = tl.where(pulled, (base + entry - region_addr) // ES + within * E, 0)
                poff = tl.multiple_of(poff, [PV, PV])
                vp = tl.load(
                    region + poff + cols[None, :], mask=mk & pulled, other=0, eviction_policy="evict_first"
                )
                vr = tl.load(region + toff, mask=mk & ~ts[:, None] & ~pulled, other=0)
                vr = tl.where(pulled, vp, vr)
            else:
                vr = tl.load(region + toff, mask=mk & ~ts[:, None], other=0)
            v = tl.where(ts[:, None], vs, vr).to(ACC_DT)
            acc = tl.where(has[:, None], acc + v, acc)
        if AVG:
            cnt = tl.maximum(nt + ACC, 1).to(ACC_DT)
            if tl.float32 == ACC_DT:
                acc = tl.math.div_rn(acc, cnt[:, None])
            else:
                acc = acc / cnt[:, None]
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=m, cache_modifier=".cs")
        tile += tl.num_programs(0)
    if END:
        _reduce_end(sig, sig_peers, counter, decided, d0, d1, d2, d3, d4, d5, d6, d7, W, ME, WAIT_DONE, PAUSE)


_reduce = CompiledKernel(_reduce_kernel)


def reduce_tile_rows(E: int, waiting: bool = False) -> int:
    """Rows per tile of the fused reduction for rows of ``E`` elements (the tables of
    :func:`~magi_comm.backends.native.progress.reduce_waits` are cut the same way). A waiting
    reduction's programs stride over the tiles: larger tiles keep more loads in flight. Else
    small tiles of about 1024 elements, 2 warps each (``REDUCE_WARPS``): on an H100 the
    fastest of a sweep of 1-64 rows x 1-16 warps for rows of 1024 bf16 (tools/
    bench_reduce_kernel.py, docs/perf.md: 64 MiB 101 us, 4 rows x 8 warps 135 us)."""
    bc = min(triton.next_power_of_2(max(E, 1)), 1024)
    return max(1, min(64, (16384 if waiting else 1024) // bc))


REDUCE_WARPS = {False: 2, True: 8}  # warps per program of the fused reduction, by waiting


def launch_reduce(
    out: torch.Tensor,
    inp: torch.Tensor,
    region: torch.Tensor | None,
    term_row: torch.Tensor,
    term_self: torch.Tensor,
    nterms: torch.Tensor,
    *,
    acc_reduce: bool,
    average: bool,
    stream: torch.cuda.Stream | None = None,
    waits: tuple[torch.Tensor, torch.Tensor, int, tuple[int, ...], int] | None = None,
    pull: tuple[torch.Tensor, int, int, int] | None = None,
    end: tuple[Handshake, int, int, tuple[int, ...], bool] | None = None,
    start: tuple[tuple[int, ...], int, int, int] | None = None,
    tile_rows: int | None = None,
    num_warps: int | None = None,
    max_programs: int = 0,
) -> None:
    """Fused deterministic sum / avg into ``out`` on ``stream`` (None: the current one).

    Args:
        out: ``(N_out, E)`` contiguous, float16 / bfloat16 / float32 / float64; read when
            ``acc_reduce``, overwritten.
        inp: the rank's contiguous input viewed ``(N_in, E)``, same dtype (own terms).
        region: the local receive regions (any dtype, read as rows of ``E`` elements of
            ``out.dtype``: peer terms; 16-byte aligned); None when there are none.
        term_row / term_self / nterms: from
            :func:`magi_comm.backends.native.terms.build_reduce_terms`, on ``out``'s device.
        waits: ``(need, order, sig, words, max_programs)`` to run beside the transfer
            (``AWAIT_ROWS``): ``need`` and ``order`` the device tables of
            :func:`~magi_comm.backends.native.progress.reduce_waits` (for
            :func:`reduce_tile_rows` ``(E, True)`` rows per tile) and ``arrival_order``, ``sig`` the address of the local
            signal array, ``words`` one packed word per peer (epoch and ``READY`` count of each
            source), ``max_programs`` the grid (its programs stride over the tiles). None: the
            peers' rows are already in place.
        pull: ``(term_pull, pull_maps, alloc_base, map_width)``: read the terms of sources that
            published a map from their inputs (``term_pull`` from
            :func:`~magi_comm.backends.native.terms.build_pull_terms` on the device,
            ``pull_maps`` the address of the local int64 ``(W, map_width)`` pull-map area,
            ``alloc_base`` of the int64 ``(allocations, W)`` table of peers' symmetric
            allocations). None: every peer term is in the regions.
        end: ``(handshake, counter, decided, done_words, wait_done)``: the DONE step after the
            last tile (:mod:`magi_comm.backends.native.protocol`): ``counter`` the address of
            a local int32, zero between launches, ``decided`` of the local int64 ``(W,)``
            decisions of the call's send (see :class:`~.copy.CopyLaunch`, ``publish``), ``done_words`` one :func:`~magi_comm.backends.native.protocol.pack_done`
            word per peer; ``wait_done``: our input may be read in place (wait for the
            destinations). The launch then runs even without rows.
        start: ``(words, pub, pub_peers, accepts)``: the call's handshake in this launch (one
            launch on 2 ranks; needs ``end`` and ``pull``, not ``waits``): ``words`` one
            :func:`~magi_comm.backends.native.protocol.pack_peer` word per peer (as the send
            kernel's: arm now, the destination's arm count, which is its epoch, the source's
            READY count), ``pub`` the call's publish table (every destination pulls),
            ``pub_peers`` the device table of the peers' pull-map areas, ``accepts`` the local
            accept words.
        tile_rows / num_warps: the tile height (default :func:`reduce_tile_rows`; a waiting
            reduction must keep the default, its wait tables are cut by it) and the warps per
            program (default ``REDUCE_WARPS``; tools/bench_reduce_kernel.py sweeps both).
        max_programs: without ``waits``, the most programs (they stride over the tiles; 0: one
            per tile), so that a reduction beside a kernel takes fewer SMs from it.
    """
    n_rows, E = out.shape[0], out.shape[1]
    if start is not None and (end is None or pull is None or waits is not None):
        raise ValueError("launch_reduce: start needs end and pull, and excludes waits")
    if waits is not None and tile_rows not in (None, reduce_tile_rows(E, True)):
        raise ValueError(f"tile_rows: a waiting reduction keeps reduce_tile_rows(E, True), got {tile_rows}")
    if (n_rows == 0 or E == 0) and end is None:
        return
    # the regions as a tensor of out's dtype (its alignment known to the compiler: vector loads)
    region = out if region is None or region.numel() == 0 else region.view(-1).view(out.dtype)
    region_addr = region.data_ptr()
    bc = min(triton.next_power_of_2(max(E, 1)), 1024)
    br = tile_rows or reduce_tile_rows(E, waits is not None)
    acc_dt = tl.float64 if out.dtype == torch.float64 else tl.float32
    W = term_row.shape[1]
    ntiles = triton.cdiv(n_rows, br) * triton.cdiv(E, bc)
    words: tuple[int, ...]  # one packed word per peer (none without waits)
    if waits is None:
        grid = (max(min(ntiles, max_programs) if max_programs > 0 else ntiles, 1), 1, 1)
        need, order, sig, words = nterms, nterms, out.data_ptr(), ()
    else:
        need, order, sig, words, cap = waits
        grid = (max(min(ntiles, cap) if cap else ntiles, 1), 1, 1)
    es = out.element_size()
    rb = E * es
    term_pull, pull_maps, alloc_base, mapw = pull if pull else (nterms, region_addr, region_addr, 1)
    if end is not None:
        hs, counter, decided, done, wait_done = end
        sig_peers, me = hs.sig_peers, hs.rank
        if waits is not None and sig != hs.sig:
            raise ValueError("launch_reduce: waits and end must name the same signal array")
        sig = hs.sig
    else:
        sig_peers, counter, decided, done, wait_done, me = region_addr, region_addr, region_addr, (), False, 0
    pub, pub_peers, accepts = region_addr, region_addr, region_addr
    if start is not None:
        words, pub, pub_peers, accepts = start
    peer_words = (*words, *(IDLE_WORD,) * (PEER_WORDS - len(words)))
    done_words = (*done, *(IDLE_WORD,) * (PEER_WORDS - len(done)))
    args = (out, inp, region, region_addr, term_row, term_self, nterms, need, order, sig, *peer_words, *done_words,
            term_pull,
            pull_maps, alloc_base, decided, sig_peers, counter, n_rows, E, pub, pub_peers, accepts)  # fmt: skip
    consts = dict(TERMS=W, BR=br, BC=bc, ACC=int(acc_reduce), AVG=int(average), ACC_DT=acc_dt,
                  W=min(W, PEER_WORDS), AWAIT=int(waits is not None), PAUSE=poll_pause(_reduce.direct), PULL=int(pull is not None),
                  PV=16 // es if rb % 16 == 0 else 1, ES=es, MAPW=mapw, ME=me, END=int(end is not None),
                  WAIT_DONE=int(bool(wait_done)), START=int(start is not None))  # fmt: skip
    _reduce(grid, args, consts, num_warps or REDUCE_WARPS[waits is not None], stream)
