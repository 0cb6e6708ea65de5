"""Triton copy kernel of the ``native`` backend (imported lazily: needs triton).

One kernel serves every data movement of the backend: a block of a :class:`BlockTable` loads
``block_words`` words of one task from ``src`` ONCE and stores them to every destination of
the task: the peers' receive regions (through their NVLink-mapped symmetric buffers, a table of
up to 8 addresses) and/or the local sink. Used for

* the send step (``src`` = input, destinations = peer regions + the sink for rows sent to self;
  for a cast, a peer that published a map of its output in the symmetric heap gets the rows
  straight into that output instead: the backend's direct mode);
* the receive step (``src`` = the local symmetric buffer, destination = the sink).

A send launch may also carry the backend's handshake (:mod:`magi_comm.backends._native_protocol`):
program 0 arms the sources, every program waits for the destinations' arms before its first
store, and the last program to finish signals the destinations and waits for the sources.
With progress reports, a send launch copies chunk by chunk and one extra program reports
each destination's complete rows; a receive copy (or the fused reduction) with waits runs
beside it and makes each block (tile) wait for the rows it reads.

Words are 1, 2, 4 or 8 bytes (:func:`magi_comm.backends._native_layout.word_size`); ``VEC`` is
a divisibility hint (in words) for 16-byte vector accesses when every offset allows it.

A second kernel fuses group_reduce ``sum`` / ``avg`` for calls whose peer rows all fit the
receive regions at once: it reads every term where it lies (own input rows, peer rows in the
local regions) and accumulates in float32 (float64 for float64) in ascending source order,
existing output first, exactly the additions of :func:`magi_comm._reduce.reduce_sum_avg`.

Runs under ``TRITON_INTERPRET=1`` on CPU tensors too (the unit tests do that when triton is
installed).

Launch path: Triton's ``kernel[grid](...)`` re-binds and re-specializes every argument in
Python on every call (~20-30 µs per launch, and a collective makes two or three). `_Compiled`
keeps the compiled kernel per specialization: the first launch of a specialization goes the
regular way (compiling, or fetching from Triton's cache), later ones go straight through the
compiled kernel's handle on the given stream. Its key mirrors Triton's own specialization rule
(an int is specialized on ``== 1``, on divisibility by 16 and on its width; a tensor on the
16-byte alignment of its data pointer; plus the constexprs and launch options), so a cached
kernel is only reused where Triton would reuse it. A caller whose arguments are mostly fixed
(`CopyLaunch`) computes that key itself: the fixed part once, per launch only the bits of the
two varying addresses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _native_protocol as proto
from ._native_layout import (
    MAX_PEERS,
    PULL_ROW_MASK,
    PULL_SOURCE_SHIFT,
    PULL_SPLIT_MASK,
    PULL_SPLIT_SHIFT,
    BlockTable,
)
from ._native_protocol import IDLE_WORD, MAX_REPORTING_PROGRAMS, PEER_WORDS, Handshake

__all__ = ["CopyLaunch", "launch_reduce"]

# jit code reads module globals only as constexprs
ARM = tl.constexpr(proto.ARM)
READY = tl.constexpr(proto.READY)
PROGRESS = tl.constexpr(proto.PROGRESS)
DONE = tl.constexpr(proto.DONE)
PULL_ACCEPT = tl.constexpr(proto.PULL_ACCEPT)
_PUB_SHIFT_SRC = tl.constexpr(PULL_SOURCE_SHIFT)
_PUB_SHIFT_SPLIT = tl.constexpr(PULL_SPLIT_SHIFT)
_PUB_SPLIT_MASK = tl.constexpr(PULL_SPLIT_MASK)
_PUB_ROW_MASK = tl.constexpr(PULL_ROW_MASK)
_PEER_ARGS = [f"p{c}" for c in range(PEER_WORDS)]
_DONE_ARGS = [f"d{c}" for c in range(PEER_WORDS)]
_POLL_PAUSE_NS = 500

_TL = {torch.int64: tl.int64, torch.int32: tl.int32, torch.int16: tl.int16, torch.uint8: tl.uint8}


# ---- device handshake (see magi_comm.backends._native_protocol) ---------------------------


@triton.jit
def _word(c: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    """Peer ``c``'s packed handshake word (``c`` is a compile-time index)."""
    p = p0
    if c == 1:
        p = p1
    if c == 2:
        p = p2
    if c == 3:
        p = p3
    if c == 4:
        p = p4
    if c == 5:
        p = p5
    if c == 6:
        p = p6
    if c == 7:
        p = p7
    return p


@triton.jit
def _await_at_least(ptr, value):
    """Spin until the local int64 at ``ptr`` is >= ``value``, then acquire at system scope (the
    peer's stores released before its signal are visible to every thread of the program)."""
    cur = tl.load(ptr, volatile=True)
    while cur < value:
        cur = tl.load(ptr, volatile=True)
    # a compare-and-swap that never swaps (counts are >= 0): the ordering point
    never = tl.full((), -1, tl.int64)
    tl.atomic_cas(ptr, never, never, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def _handshake_start(sig, p0, p1, p2, p3, p4, p5, p6, p7, sig_peers, W: tl.constexpr, ME: tl.constexpr,
                     HS_ARM: tl.constexpr):  # fmt: skip
    slots = sig.to(tl.pointer_type(tl.int64))
    if HS_ARM:
        if tl.program_id(0) == 0:
            for c in tl.static_range(W):
                if (_word(c, p0, p1, p2, p3, p4, p5, p6, p7) & 1) != 0:
                    peer = tl.load(sig_peers.to(tl.pointer_type(tl.int64)) + c).to(tl.pointer_type(tl.int64))
                    tl.atomic_add(peer + ARM * W + ME, 1, sem="release", scope="sys")
        for c in tl.static_range(W):
            want = (_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 32) & 0x3FFFFFFF
            if want > 0:
                _await_at_least(slots + ARM * W + c, want)


@triton.jit
def _handshake_end(sig, p0, p1, p2, p3, p4, p5, p6, p7, sig_peers, counter, W: tl.constexpr, ME: tl.constexpr,
                   HS_READY: tl.constexpr, HS_WAIT_END: tl.constexpr):  # fmt: skip
    if HS_READY or HS_WAIT_END:
        # Every program releases its stores through the counter (system scope, cumulative over
        # the CTA after the barrier); the last one acquires them all and signals for everyone.
        tl.debug_barrier()
        cnt = counter.to(tl.pointer_type(tl.int32))
        finished = tl.atomic_add(cnt, 1, sem="acq_rel", scope="sys")
        if finished == tl.num_programs(0) - 1:
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # the next launch (stream order) starts at 0
            if HS_READY:
                for c in tl.static_range(W):
                    if ((_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 32) & 0x3FFFFFFF) > 0:
                        peer = tl.load(sig_peers.to(tl.pointer_type(tl.int64)) + c).to(
                            tl.pointer_type(tl.int64)
                        )
                        tl.atomic_add(peer + READY * W + ME, 1, sem="release", scope="sys")
            if HS_WAIT_END:
                slots = sig.to(tl.pointer_type(tl.int64))
                for c in tl.static_range(W):
                    want = (_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 1) & 0x7FFFFFFF
                    if want > 0:
                        _await_at_least(slots + READY * W + c, want)


@triton.jit
def _word_at(s, p0, p1, p2, p3, p4, p5, p6, p7):
    """Peer ``s``'s packed word (``s`` known only at run time)."""
    p = p0
    p = tl.where(s == 1, p1, p)
    p = tl.where(s == 2, p2, p)
    p = tl.where(s == 3, p3, p)
    p = tl.where(s == 4, p4, p)
    p = tl.where(s == 5, p5, p)
    p = tl.where(s == 6, p6, p)
    p = tl.where(s == 7, p7, p)
    return p


@triton.jit
def _backoff(PAUSE: tl.constexpr):
    """Sleep about ``PAUSE`` ns between polls (0: none; the interpreter has no inline PTX):
    every thread of every waiting program polls, and the polled word lies where the peer's
    NVLink stores land (L2), so a busy poll slows the transfer it waits for."""
    if PAUSE > 0:
        tl.inline_asm_elementwise(
            "nanosleep.u32 $1; mov.u32 $0, 0;",
            "=r,r",
            [tl.full((), PAUSE, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _await_rows(sig, s, rows, word, seen, W: tl.constexpr, PAUSE: tl.constexpr):
    """Wait until the first ``rows`` rows of source ``s``'s region are in place: its
    ``PROGRESS`` slot reaches them in this call's epoch, or its ``READY`` count is reached
    (every row of the call). ``seen``: a value of the slot already acquired by this program
    (-1: none; the caller tracks it per source). Returns the new ``seen``."""
    epoch = (word >> 32) & 0x3FFFFFFF
    want = (epoch << 32) | rows
    if want > seen:
        slots = sig.to(tl.pointer_type(tl.int64))
        prog = slots + PROGRESS * W + s
        rdy = slots + READY * W + s
        ready_want = (word >> 1) & 0x7FFFFFFF
        p = tl.load(prog, volatile=True)
        r = tl.load(rdy, volatile=True)
        while (p < want) & (r < ready_want):
            _backoff(PAUSE)
            p = tl.load(prog, volatile=True)
            r = tl.load(rdy, volatile=True)
        never = tl.full((), -1, tl.int64)
        if p >= want:  # acquire the value that passed (a later, larger one is as good)
            seen = tl.atomic_cas(prog, never, never, sem="acquire", scope="sys")
        else:  # the whole call arrived
            tl.atomic_cas(rdy, never, never, sem="acquire", scope="sys")
            seen = (epoch << 32) | 0xFFFFFFFF
        tl.debug_barrier()
    return seen


@triton.jit
def _chunk_done(done, j):
    """This program finished its blocks of chunk ``j``: its own word of ``done`` says so, with
    a system-scope release of its stores (its own address: the programs do not queue on one
    counter)."""
    tl.debug_barrier()
    tl.atomic_xchg(done.to(tl.pointer_type(tl.int32)) + tl.program_id(0), j + 1, sem="release", scope="sys")


@triton.jit
def _report_progress(done, nchunks, prog_rows, sig_peers, p0, p1, p2, p3, p4, p5, p6, p7, W: tl.constexpr,
                     ME: tl.constexpr, GP: tl.constexpr, PAUSE: tl.constexpr):  # fmt: skip
    """The reporter program (the last of the grid): whenever every copying program has
    finished chunk ``k - 1`` (the least of their ``done`` words is ``k``), acquire their stores
    and raise each destination's ``PROGRESS`` slot to the rows complete after chunk ``k - 1``;
    at the end put the words back to 0 for the next launch (stream order)."""
    G = tl.num_programs(0) - 1
    lanes = tl.arange(0, GP)
    words = done.to(tl.pointer_type(tl.int32)) + lanes
    live = lanes < G
    reported = 0
    while reported < nchunks:
        k = tl.min(tl.load(words, mask=live, other=2**30, volatile=True), 0)
        if k > reported:
            tl.atomic_add(words, 0, mask=live, sem="acquire", scope="sys")
            tl.debug_barrier()
            table = prog_rows.to(tl.pointer_type(tl.int64)) + (k - 1) * W
            for c in tl.static_range(W):
                rows = tl.load(table + c)
                if rows >= 0:
                    epoch = (_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 32) & 0x3FFFFFFF
                    peer = tl.load(sig_peers.to(tl.pointer_type(tl.int64)) + c).to(tl.pointer_type(tl.int64))
                    tl.atomic_max(peer + PROGRESS * W + ME, (epoch << 32) | rows, sem="release", scope="sys")
            reported = k
        else:
            _backoff(PAUSE)
    tl.store(words, 0, mask=live)


@triton.jit
def _progress_wanted(prog_rows, maps, W: tl.constexpr, DIRECT: tl.constexpr, MAPW: tl.constexpr):
    """Whether some destination reads its rows from the region (a destination in direct mode
    has them in its output when the send kernel ends: no progress to report to it)."""
    wanted = 0
    for c in tl.static_range(W):
        if tl.load(prog_rows.to(tl.pointer_type(tl.int64)) + c) >= 0:
            if DIRECT:
                if tl.load(maps.to(tl.pointer_type(tl.int64)) + c * MAPW) == 0:
                    wanted = 1
            else:
                wanted = 1
    return wanted


# ---- pull (group_reduce from a symmetric input) --------------------------------------------


@triton.jit
def _pulled_peers(pub, accepts, W: tl.constexpr):
    """Bit ``c`` set: destination ``c`` reads this launch's rows for it from our input (it
    accepts pulls and our publish table has a map for it), so they are not sent."""
    tab = pub.to(tl.pointer_type(tl.int64))
    mask = tl.full((), 0, tl.int32)
    for c in tl.static_range(W):
        lo = tl.load(tab + c)
        row = tl.load(tab + c + 1) > lo
        hdr = tl.load(tab + W + 1 + lo, mask=row, other=0)  # an empty last row: nothing to read
        accept = tl.load(accepts.to(tl.pointer_type(tl.int64)) + c)
        if (hdr > 0) & (accept == PULL_ACCEPT):
            mask = mask | (1 << c)
    return mask


@triton.jit
def _publish(pub, pub_peers, decided, pulled, offs, p0, p1, p2, p3, p4, p5, p6, p7, W: tl.constexpr,
             ME: tl.constexpr, MAPW: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Program 0 of a reduce send: write each destination's pull-map header into its row
    ``ME`` (a map where the destination pulls, else 0), released with the program's stores
    before the ready signal; and record the decision locally, ``decided[c] = 2 * epoch +
    pulled`` (the epoch from the destination's word: the fused reduction's end step waits for
    this call's decision, not for the accept word, which the destination may already have
    changed for its next call)."""
    tab = pub.to(tl.pointer_type(tl.int64))
    for c in tl.static_range(W):
        lo = tl.load(tab + c)
        hi = tl.load(tab + c + 1)
        if hi > lo:
            row = (
                tl.load(pub_peers.to(tl.pointer_type(tl.int64)) + c).to(tl.pointer_type(tl.int64)) + ME * MAPW
            )
            bit = (pulled >> c) & 1
            if bit != 0:
                i = 0
                while i < hi - lo:
                    m = offs < hi - lo - i
                    v = tl.load(tab + W + 1 + lo + i + offs, mask=m)
                    tl.store(row + i + offs, v, mask=m)
                    i += BLOCK
            else:
                tl.store(row, 0)
            epoch = (_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 32) & 0x3FFFFFFF
            tl.atomic_xchg(
                decided.to(tl.pointer_type(tl.int64)) + c, 2 * epoch + bit, sem="release", scope="gpu"
            )


# ---- copy ----------------------------------------------------------------------------------


@triton.jit
def _put(base, task_dst, t, W: tl.constexpr, COL: tl.constexpr, start, offs, vals, mask, VEC: tl.constexpr):
    off = tl.load(task_dst + t * (W + 1) + COL)
    if off >= 0:
        off = tl.multiple_of(off + start, VEC)
        ptr = base.to(tl.pointer_type(vals.dtype))
        tl.store(ptr + off + offs, vals, mask=mask)


@triton.jit
def _put_peer(
    anchor, peers, task_dst, task_split, task_within, maps, alloc_base, t, W: tl.constexpr, COL: tl.constexpr,
    start, offs, vals, mask, VEC: tl.constexpr, DIRECT: tl.constexpr, MAPW: tl.constexpr, WB: tl.constexpr,
    pulled,
):  # fmt: skip
    # Peer COL's region in its receive buffer, unless the peer published a map of its output
    # (header > 0 = 1 + the symmetric allocation holding it): then straight into its output.
    # Addresses from tables become word offsets from ``anchor`` with a VEC alignment hint.
    # ``anchor`` is an integer, and a pointer made from an integer carries no alignment, so
    # the stores compile to single words (sm_90 PTX: st.global.b64 for int64 words), not the
    # 16-byte vectors the hint is meant for; the fused reduction passes its base as a tensor
    # for that reason (measured there, docs/perf.md). Not changed here: unmeasured over NVLink.
    off = tl.load(task_dst + t * (W + 1) + COL)
    if (off >= 0) & (((pulled >> COL) & 1) == 0):
        target = tl.load(peers + COL)
        if DIRECT:
            row = maps.to(tl.pointer_type(tl.int64)) + COL * MAPW
            hdr = tl.load(row)
            if hdr > 0:
                j = tl.load(task_split + t * W + COL)
                entry = tl.load(row + 1 + j)  # bytes from the allocation's start to the split's
                target = tl.load(alloc_base.to(tl.pointer_type(tl.int64)) + (hdr - 1) * W + COL) + entry
                off = tl.load(task_within + t)
        off = tl.multiple_of((target - anchor) // WB + off + start, VEC)
        tl.store(anchor.to(tl.pointer_type(vals.dtype)) + off + offs, vals, mask=mask)


@triton.jit
def _copy_block(b, src, sink, anchor, peers, blk_task, blk_start, task_src, task_len, task_dst, task_split,
                task_within, maps, alloc_base, offs, DT: tl.constexpr, W: tl.constexpr, VEC: tl.constexpr,
                DIRECT: tl.constexpr, MAPW: tl.constexpr, WB: tl.constexpr, pulled,
                PUBLISH: tl.constexpr):  # fmt: skip
    """Block ``b``: load its words from ``src`` once, store them to every destination (not to
    the ``pulled`` ones; a block with no other destination reads nothing)."""
    t = tl.load(blk_task + b).to(tl.int64)
    live = 1
    if PUBLISH:
        live = (tl.load(task_dst + t * (W + 1) + W) >= 0).to(tl.int32)
        for c in tl.static_range(W):
            if (tl.load(task_dst + t * (W + 1) + c) >= 0) & (((pulled >> c) & 1) == 0):
                live = 1
    if live != 0:
        start = tl.load(blk_start + b)
        n = tl.load(task_len + t)
        mask = offs < n - start
        s_off = tl.multiple_of(tl.load(task_src + t) + start, VEC)
        vals = tl.load(src.to(tl.pointer_type(DT)) + s_off + offs, mask=mask)
        _put(sink, task_dst, t, W, W, start, offs, vals, mask, VEC)
        for c in tl.static_range(W):
            _put_peer(anchor, peers, task_dst, task_split, task_within, maps, alloc_base, t, W, c, start, offs,
                      vals, mask, VEC, DIRECT, MAPW, WB, pulled)  # fmt: skip


@triton.jit(do_not_specialize=_PEER_ARGS)
def _copy_kernel(
    src,
    sink,
    pub,
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,
    anchor,
    peers,
    blk_task,
    blk_start,
    task_src,
    task_len,
    task_dst,
    task_split,
    task_within,
    maps,
    alloc_base,
    pub_peers,
    accepts,
    decided,
    fence,
    sig,
    sig_peers,
    counter,
    prog_rows,
    prog_cnt,
    wait_src,
    wait_rows,
    nblocks,
    chunk_blocks,
    DT: tl.constexpr,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    FENCE: tl.constexpr,
    DIRECT: tl.constexpr,
    MAPW: tl.constexpr,
    WB: tl.constexpr,
    ME: tl.constexpr,
    GP: tl.constexpr,
    PUBLISH: tl.constexpr,
    HS_ARM: tl.constexpr,
    HS_READY: tl.constexpr,
    HS_WAIT_END: tl.constexpr,
    PROG: tl.constexpr,
    AWAIT: tl.constexpr,
    PAUSE: tl.constexpr,
):
    # src / sink / anchor / maps / alloc_base and the entries of ``peers`` (int64 (W,): each
    # peer's region area, NVLink-mapped) are addresses: symmetric-heap and peer memory is
    # addressed through plain integers, as in the verified peer-store recipe.
    # Program p copies blocks p, p + grid, ...: a grid smaller than the table
    # (NativeConfig.max_programs) leaves the other SMs to a kernel running beside the copy.
    # PROG (a send): one more program, the reporter; the others take the same stride inside
    # chunks of ``chunk_blocks`` blocks and mark each chunk done (``prog_cnt``: one int32 per
    # copying program, zero between launches; GP: a power of two >= their number). AWAIT (a receive copy): each block first waits for the rows
    # it reads (``wait_src`` / ``wait_rows`` per block).
    # PUBLISH (a reduce's send): program 0 writes every destination's pull-map header (``pub``:
    # the publish table, see _native_layout.publish_table; ``pub_peers``: each peer's pull-map
    # area; ``accepts``: the destinations' accept words); rows of pulled destinations stay.
    _handshake_start(sig, p0, p1, p2, p3, p4, p5, p6, p7, sig_peers, W, ME, HS_ARM)
    offs = tl.arange(0, BLOCK)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    pulled = tl.full((), 0, tl.int32)
    if PUBLISH:
        pulled = _pulled_peers(pub, accepts, W)
        if pid == 0:
            _publish(
                pub, pub_peers, decided, pulled, offs, p0, p1, p2, p3, p4, p5, p6, p7, W, ME, MAPW, BLOCK
            )
    if PROG:
        # programs 0..G-1 copy, chunk by chunk; program G reports (see _report_progress)
        report = _progress_wanted(prog_rows, maps, W, DIRECT, MAPW)
        G = G - 1
        if pid == G:
            if report != 0:
                _report_progress(prog_cnt, tl.cdiv(nblocks, chunk_blocks), prog_rows, sig_peers,
                                 p0, p1, p2, p3, p4, p5, p6, p7, W, ME, GP, PAUSE)  # fmt: skip
        else:
            j = 0
            first = 0  # the chunk's first block
            while first < nblocks:
                b = first + pid
                end = tl.minimum(first + chunk_blocks, nblocks)
                while b < end:
                    _copy_block(b, src, sink, anchor, peers, blk_task, blk_start, task_src, task_len, task_dst,
                                task_split, task_within, maps, alloc_base, offs, DT, W, VEC, DIRECT, MAPW, WB,
                                pulled, PUBLISH)  # fmt: skip
                    b += G
                if report != 0:
                    _chunk_done(prog_cnt, j)
                j += 1
                first += chunk_blocks
    else:
        b = pid
        last_src = -1
        seen = tl.full((), -1, tl.int64)
        while b < nblocks:
            if AWAIT:
                s = tl.load(wait_src + b)
                if s != last_src:
                    seen = tl.full((), -1, tl.int64)
                    last_src = s
                seen = _await_rows(sig, s, tl.load(wait_rows + b), _word_at(s, p0, p1, p2, p3, p4, p5, p6, p7),
                                   seen, W, PAUSE)  # fmt: skip
            _copy_block(b, src, sink, anchor, peers, blk_task, blk_start, task_src, task_len, task_dst,
                        task_split, task_within, maps, alloc_base, offs, DT, W, VEC, DIRECT, MAPW, WB, pulled,
                        PUBLISH)  # fmt: skip
            b += G
    if FENCE and not (HS_READY or HS_WAIT_END):  # else the end handshake releases
        # Make this program's peer stores visible system-wide before the kernel can complete
        # (and hence before the stream-ordered NVSHMEM ready signal): CTA barrier, then one
        # release atomic at system scope (cumulative over the CTA's stores).
        tl.debug_barrier()
        tl.atomic_add(fence.to(tl.pointer_type(tl.int32)), 1, sem="release", scope="sys")
    _handshake_end(sig, p0, p1, p2, p3, p4, p5, p6, p7, sig_peers, counter, W, ME, HS_READY, HS_WAIT_END)


def _handshake_flags(sync: int) -> dict[str, int]:
    """The copy kernel's handshake constexprs for the step bits ``sync``."""
    return dict(
        HS_ARM=int(bool(sync & proto.ARM_AND_WAIT)),
        HS_READY=int(bool(sync & proto.READY_END)),
        HS_WAIT_END=int(bool(sync & proto.WAIT_READY_END)),
        PROG=int(bool(sync & proto.SIGNAL_PROGRESS)),
        AWAIT=int(bool(sync & proto.AWAIT_ROWS)),
        PAUSE=_pause(),
    )


def _pause() -> int:
    """Nanoseconds between the polls of a waiting program (0 under the interpreter)."""
    return _POLL_PAUSE_NS if _copy.direct else 0


def _spec(x) -> tuple:
    """What Triton specializes a runtime argument on (see the module docstring)."""
    if isinstance(x, int):
        return (x == 1, x % 16 == 0, -(2**31) <= x < 2**31)
    return (x.dtype, x.data_ptr() % 16 == 0)


class _Compiled:
    """A Triton kernel launched through its compiled handle, one per specialization."""

    def __init__(self, jit_fn) -> None:
        self.jit_fn = jit_fn
        # the interpreter (TRITON_INTERPRET=1, CPU tests) has no compiled handle: plain launches
        self.direct = hasattr(jit_fn, "device_caches")
        self.cache: dict[tuple, object] = {}
        self.variants: dict[tuple, int] = {}

    def variant(self, fixed: tuple) -> int:
        """A small int standing for ``fixed`` (the specialization of the arguments a caller
        never changes), so that a precomputed launch key stays cheap to hash."""
        return self.variants.setdefault(fixed, len(self.variants))

    def __call__(
        self,
        grid: tuple[int, int, int],
        args: tuple,
        consts: dict,
        num_warps: int,
        stream,
        key: tuple | None = None,
    ) -> None:
        """Launch on ``stream`` (a ``torch.cuda.Stream``; None = the current stream).

        ``key``: the specialization key of this launch when the caller computed it (it must
        determine everything Triton specializes on, see the module docstring); None computes
        it from the arguments."""
        if not self.direct:
            self.jit_fn[grid](*args, **consts, num_warps=num_warps)
            return
        if key is None:
            key = (tuple(_spec(a) for a in args), tuple(consts.values()), num_warps, args_device(args))
        kernel = self.cache.get(key)
        if kernel is None:  # compile (or fetch from Triton's cache) and launch the regular way
            if stream is None:
                self.cache[key] = self.jit_fn[grid](*args, **consts, num_warps=num_warps)
            else:
                with torch.cuda.stream(stream):
                    self.cache[key] = self.jit_fn[grid](*args, **consts, num_warps=num_warps)
            return
        handle = (stream if stream is not None else torch.cuda.current_stream()).cuda_stream
        kernel.run(grid[0], grid[1], grid[2], handle, kernel.function, kernel.packed_metadata, None, None, None,
                   *args, *consts.values())  # fmt: skip


def args_device(args: tuple) -> int:
    """The CUDA device of the first tensor argument (kernels are compiled per device)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.index
    return torch.cuda.current_device()


_copy = _Compiled(_copy_kernel)


class CopyLaunch:
    """One copy-kernel launch whose block table, peer regions and options are fixed (a round of
    a cached layout); per call only the ``src`` / ``sink`` addresses, the stream and the
    handshake words change.

    Every fixed address argument is known at construction (absent peers and a missing fence
    point at the block table, 16-byte aligned), so of Triton's specialization only the two
    varying addresses' is left to compute per launch (the launch key given to `_Compiled`).

    Args:
        table: block table on the device (word offsets).
        peers: ``W`` addresses of peer ``c``'s region area (NVLink-mapped); None where no
            task writes (at most ``MAX_PEERS``).
        dtype: the word dtype (torch.int64 / int32 / int16 / uint8).
        vec: words per 16 bytes when all offsets are multiples of 16 bytes, else 1.
        num_warps: warps per program.
        fence: address of a local int32 counter; when given and a peer is written, every
            program ends with a system-scope release on it (peer stores visible before the
            kernel completes).
        direct: ``(maps, alloc_base, map_width)`` for a send table with split indices (a
            cast): ``maps`` is the address of the int64 ``(W, map_width)`` area where each
            peer publishes ``[header, split starts...]`` before the launch, ``alloc_base`` the
            address of the int64 ``(allocations, W)`` table of peers' symmetric allocations
            (see the backend's direct mode). None: regions only.
        max_programs: most programs in the grid (they stride over the blocks); 0: one program
            per block.
        handshake: where the kernel signals and waits when a call asks for it (see
            :mod:`magi_comm.backends._native_protocol`); None: never.
        progress: ``(rows, done, chunk_blocks)`` for a send that reports its progress
            (``SIGNAL_PROGRESS``, at most ``MAX_REPORTING_PROGRAMS`` programs): ``rows`` the
            device table of :func:`~magi_comm.backends._native_layout.send_progress`, ``done``
            the address of local int32 words (one per program, zero between launches).
        waits: ``(source, rows)`` device tables of
            :func:`~magi_comm.backends._native_layout.recv_waits` for a receive copy that
            waits for its rows (``AWAIT_ROWS``).
        publish: ``(pub_peers, accepts, map_width, decided)`` for a reduce's send (round 0): program 0
            writes each destination's pull-map header, the publish table of the call (see
            :func:`~magi_comm.backends._native_layout.publish_table`), into row ``rank`` of
            that peer's pull-map area (``pub_peers``: address of an int64 ``(W,)`` table of
            those areas, NVLink-mapped; rows of ``map_width`` words), and rows for a
            destination that accepts pulls (``accepts``: address of the int64 ``(W,)`` accept
            words) and gets a map are not sent; ``decided``: address of local int64 ``(W,)``
            words where it records, per destination, ``2 * epoch + pulled`` (the epoch from the
            call's words, given also without handshake steps). Needs the handshake's rank.
    """

    def __init__(self, table: BlockTable, peers: list[int | None], dtype: torch.dtype, *, vec: int = 1,
                 num_warps: int = 8, fence: int = 0, direct: tuple[int, int, int] | None = None,
                 max_programs: int = 0, handshake: Handshake | None = None,
                 progress: tuple[torch.Tensor, int, int] | None = None,
                 waits: tuple[torch.Tensor, torch.Tensor] | None = None,
                 publish: tuple[int, int, int] | None = None) -> None:  # fmt: skip
        W = len(peers)
        if W > MAX_PEERS:
            raise ValueError(f"the native copy kernel supports at most {MAX_PEERS} peers, got {W}")
        if max_programs < 0:
            raise ValueError(f"max_programs must be >= 0 (0: one program per block), got {max_programs}")
        programs = min(table.num_blocks, max_programs) if max_programs else table.num_blocks
        self.grid = (programs, 1, 1)
        # A handshake needs a program even without blocks (it still signals and waits).
        self.sync_grid = (max(programs, 1), 1, 1)
        # Reporting progress takes one more program (the reporter) and one done word per copier.
        if progress and max(programs, 1) > MAX_REPORTING_PROGRAMS:
            raise ValueError(
                f"progress reports need at most {MAX_REPORTING_PROGRAMS} programs, got {programs} "
                f"(set max_programs)"
            )
        self.report_grid = (max(programs, 1) + 1, 1, 1)
        # never 0: every address argument keeps the same (64-bit, aligned) specialization
        self.filler = table.blk_task.data_ptr() if table.num_blocks else (handshake.sig if handshake else 0)
        # Built on the host and moved without blocking it (the caller's current stream orders
        # the copy ahead of the launches, as for the block table).
        peer_table = torch.tensor([p or 0 for p in peers], dtype=torch.int64)
        dev = table.blk_task.device
        if dev.type == "cuda":
            peer_table = peer_table.pin_memory().to(dev, non_blocking=True)
        self.peer_table = peer_table
        hs = handshake
        self.fixed = (
            self.filler,  # the anchor of peer addresses (see _put_peer)
            self.peer_table,
            table.blk_task,
            table.blk_start,
            table.task_src,
            table.task_len,
            table.task_dst,
            table.task_split,
            table.task_within,
            direct[0] if direct else self.filler,
            direct[1] if direct else self.filler,
            publish[0] if publish else self.filler,
            publish[1] if publish else self.filler,
            publish[3] if publish else self.filler,
            fence or self.filler,
            hs.sig if hs else self.filler,
            hs.sig_peers if hs else self.filler,
            hs.counter if hs else self.filler,
            progress[0].data_ptr() if progress and progress[0].numel() else self.filler,  # never 0
            progress[1] if progress else self.filler,
            waits[0] if waits else self.filler,
            waits[1] if waits else self.filler,
            table.num_blocks,
            progress[2] if progress else 1,
        )
        if (progress or waits or publish) and hs is None:
            raise ValueError("progress, waits and publish need a handshake (the signal slots, the rank)")
        if publish and direct:
            raise ValueError("a launch either writes into peer outputs (a cast) or publishes (a reduce)")
        self.progress, self.waits, self.publish = progress, waits, publish
        self.handshake = hs
        self.base_consts = dict(
            DT=_TL[dtype],
            W=W,
            BLOCK=table.block_words,
            VEC=vec,
            FENCE=int(bool(fence) and any(p for p in peers)),
            DIRECT=int(direct is not None and table.num_blocks > 0 and table.has_splits),
            MAPW=direct[2] if direct else (publish[2] if publish else 1),
            WB=torch.empty(0, dtype=dtype).element_size(),
            ME=hs.rank if hs else 0,
            GP=triton.next_power_of_2(max(programs, 1)) if progress else 1,
            PUBLISH=int(publish is not None),  # the kernel's constexprs in its order (launched positionally)
        )
        self.num_warps = num_warps
        self._modes: dict[int, tuple[dict, int]] = {}

    def _mode(self, sync: int) -> tuple[dict, int]:
        """``(constexprs, variant)`` of handshake mode ``sync`` (cached: they key the launch)."""
        got = self._modes.get(sync)
        if got is None:
            consts = dict(self.base_consts, **_handshake_flags(sync))
            variant = _copy.variant(
                (
                    tuple(_spec(a) for a in self.fixed),
                    tuple(consts.values()),
                    self.num_warps,
                    args_device(self.fixed),
                )
            )
            got = self._modes[sync] = (consts, variant)
        return got

    def __call__(self, src: int, sink: int, stream: torch.cuda.Stream | None = None, sync: int = 0,
                 words: tuple[int, ...] = (), pub: int = 0) -> None:  # fmt: skip
        """Copy from address ``src`` to the peers and to address ``sink`` (0: no local sink).

        ``sync``: handshake steps (bits of :mod:`magi_comm.backends._native_protocol`) with
        ``words`` the packed per-peer words (:func:`~magi_comm.backends._native_protocol.pack_peer`,
        at most ``PEER_WORDS``); 0: a plain copy. ``pub``: address of the call's publish table
        (a launch built with ``publish``: required)."""
        if bool(pub) != (self.publish is not None):
            raise ValueError("a publishing launch needs the publish table (pub), others take none")
        if sync and self.handshake is None:
            raise ValueError("this launch was built without a handshake")
        if (sync & proto.SIGNAL_PROGRESS and self.progress is None) or (
            sync & proto.AWAIT_ROWS and self.waits is None
        ):
            raise ValueError("this launch was built without progress / wait tables")
        handshake_steps = proto.ARM_AND_WAIT | proto.READY_END | proto.WAIT_READY_END
        # a publishing launch writes the headers even without blocks
        grid = self.sync_grid if sync & handshake_steps or pub else self.grid
        if sync & proto.SIGNAL_PROGRESS:
            grid = self.report_grid
        if grid[0] == 0:
            return
        # 0 (an empty tensor: nothing is read or written) would turn the address 32-bit
        src, sink, pub = src or self.filler, sink or self.filler, pub or self.filler
        consts, variant = self._mode(sync)
        key = (variant, src % 16 == 0, sink % 16 == 0, pub % 16 == 0, src < 2**31, sink < 2**31, pub < 2**31)
        peer_words = (*words, *(IDLE_WORD,) * (PEER_WORDS - len(words)))
        _copy(grid, (src, sink, pub, *peer_words, *self.fixed), consts, self.num_warps, stream, key=key)


@triton.jit
def _reduce_end(sig, sig_peers, counter, decided, d0, d1, d2, d3, d4, d5, d6, d7, W: tl.constexpr,
                ME: tl.constexpr, WAIT_DONE: tl.constexpr):  # fmt: skip
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
            src_epoch = (_word(c, d0, d1, d2, d3, d4, d5, d6, d7) >> 1) & 0x7FFFFFFF
            if src_epoch > 0:
                peer = tl.load(sig_peers.to(tl.pointer_type(tl.int64)) + c).to(tl.pointer_type(tl.int64))
                tl.atomic_max(peer + DONE * W + ME, src_epoch, sem="release", scope="sys")
        if WAIT_DONE:
            slots = sig.to(tl.pointer_type(tl.int64))
            for c in tl.static_range(W):
                dst_epoch = (_word(c, d0, d1, d2, d3, d4, d5, d6, d7) >> 32) & 0x3FFFFFFF
                if dst_epoch > 0:
                    at = decided.to(tl.pointer_type(tl.int64)) + c
                    got = tl.load(at, volatile=True)
                    while (got >> 1) < dst_epoch:
                        got = tl.load(at, volatile=True)
                    got = tl.atomic_add(at, 0, sem="acquire", scope="gpu")
                    if (got & 1) != 0:
                        _await_at_least(slots + DONE * W + c, dst_epoch)


@triton.jit(do_not_specialize=_PEER_ARGS + _DONE_ARGS)
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
    ncb = tl.cdiv(E, BC)
    ntiles = tl.cdiv(n_rows, BR) * ncb
    tile = tl.program_id(0)
    seen = tl.full((8,), -1, tl.int64)  # per source, the PROGRESS value acquired so far
    lane = tl.arange(0, 8)
    while tile < ntiles:
        rt = tile // ncb
        if AWAIT:
            rt = tl.load(order + rt)
            for c in tl.static_range(W):
                rows_c = tl.load(need + rt * W + c)
                if rows_c > 0:
                    seen_c = tl.max(tl.where(lane == c, seen, -1), 0)
                    got = _await_rows(
                        sig, c, rows_c, _word(c, p0, p1, p2, p3, p4, p5, p6, p7), seen_c, W, PAUSE
                    )
                    seen = tl.where(lane == c, got, seen)
        rows = rt * BR + tl.arange(0, BR)
        cols = (tile % ncb) * BC + tl.arange(0, BC)
        rmask = rows < n_rows
        m = rmask[:, None] & (cols < E)[None, :]
        rows64 = rows.to(tl.int64)
        offs = rows64[:, None] * E + cols[None, :]
        if ACC:
            acc = tl.load(out + offs, mask=m, other=0).to(ACC_DT)
        else:
            acc = tl.zeros((BR, BC), dtype=ACC_DT)
        nt = tl.load(nterms + rows64, mask=rmask, other=0)
        for k in tl.static_range(TERMS):
            tr = tl.load(term_row + rows64 * TERMS + k, mask=rmask, other=0)
            ts = tl.load(term_self + rows64 * TERMS + k, mask=rmask, other=0) != 0
            has = rmask & (nt > k)
            toff = tr[:, None] * E + cols[None, :]
            mk = m & has[:, None]
            vs = tl.load(inp + toff, mask=mk & ts[:, None], other=0)
            if PULL:
                # per-row values as (BR, 1) tiles from the start (1-D rows mixed with 2-D
                # vector loads trip Triton's layout pass); unmasked loads at clamped indices
                # (row 0 and entry 0 always exist)
                tp = tl.load(term_pull + rows64[:, None] * TERMS + k, mask=rmask[:, None], other=-1)
                peer_term = has[:, None] & ~ts[:, None] & (tp >= 0)
                c = tl.where(peer_term, (tp >> _PUB_SHIFT_SRC) & 0xFF, 0)
                maps_row = pull_maps.to(tl.pointer_type(tl.int64)) + c * MAPW
                hdr = tl.load(maps_row)
                split = (tp >> _PUB_SHIFT_SPLIT) & _PUB_SPLIT_MASK
                pulled = peer_term & (hdr > 0) & (split < MAPW - 1)  # a map row holds MAPW - 1 splits
                base = tl.load(
                    alloc_base.to(tl.pointer_type(tl.int64)) + tl.where(pulled, (hdr - 1) * W + c, 0)
                )
                entry = tl.load(maps_row + tl.where(pulled, 1 + split, 0))
                within = tp & _PUB_ROW_MASK
                poff = tl.where(pulled, (base + entry - region_addr) // ES + within * E, 0)
                poff = tl.multiple_of(poff, [PV, PV])
                vp = tl.load(region + poff + cols[None, :], mask=mk & pulled, other=0)
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
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=m)
        tile += tl.num_programs(0)
    if END:
        _reduce_end(sig, sig_peers, counter, decided, d0, d1, d2, d3, d4, d5, d6, d7, W, ME, WAIT_DONE)


_reduce = _Compiled(_reduce_kernel)


def reduce_tile_rows(E: int, waiting: bool = False) -> int:
    """Rows per tile of the fused reduction for rows of ``E`` elements (the tables of
    :func:`~magi_comm.backends._native_layout.reduce_waits` are cut the same way). A waiting
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
    waits: tuple[torch.Tensor, int, tuple[int, ...], int] | None = None,
    pull: tuple[torch.Tensor, int, int, int] | None = None,
    end: tuple[Handshake, int, int, tuple[int, ...], bool] | None = None,
    tile_rows: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Fused deterministic sum / avg into ``out`` on ``stream`` (None: the current one).

    Args:
        out: ``(N_out, E)`` contiguous, float16 / bfloat16 / float32 / float64; read when
            ``acc_reduce``, overwritten.
        inp: the rank's contiguous input viewed ``(N_in, E)``, same dtype (own terms).
        region: the local receive regions (any dtype, read as rows of ``E`` elements of
            ``out.dtype``: peer terms; 16-byte aligned); None when there are none.
        term_row / term_self / nterms: from
            :func:`magi_comm.backends._native_layout.build_reduce_terms`, on ``out``'s device.
        waits: ``(need, order, sig, words, max_programs)`` to run beside the transfer
            (``AWAIT_ROWS``): ``need`` and ``order`` the device tables of
            :func:`~magi_comm.backends._native_layout.reduce_waits` (for
            :func:`reduce_tile_rows` ``(E, True)`` rows per tile) and ``arrival_order``, ``sig`` the address of the local
            signal array, ``words`` one packed word per peer (epoch and ``READY`` count of each
            source), ``max_programs`` the grid (its programs stride over the tiles). None: the
            peers' rows are already in place.
        pull: ``(term_pull, pull_maps, alloc_base, map_width)``: read the terms of sources that
            published a map from their inputs (``term_pull`` from
            :func:`~magi_comm.backends._native_layout.build_pull_terms` on the device,
            ``pull_maps`` the address of the local int64 ``(W, map_width)`` pull-map area,
            ``alloc_base`` of the int64 ``(allocations, W)`` table of peers' symmetric
            allocations). None: every peer term is in the regions.
        end: ``(handshake, counter, decided, done_words, wait_done)``: the DONE step after the
            last tile (:mod:`magi_comm.backends._native_protocol`): ``counter`` the address of
            a local int32, zero between launches, ``decided`` of the local int64 ``(W,)``
            decisions of the call's send (see :class:`CopyLaunch`, ``publish``), ``done_words`` one :func:`~magi_comm.backends._native_protocol.pack_done`
            word per peer; ``wait_done``: our input may be read in place (wait for the
            destinations). The launch then runs even without rows.
        tile_rows / num_warps: the tile height (default :func:`reduce_tile_rows`; a waiting
            reduction must keep the default, its wait tables are cut by it) and the warps per
            program (default ``REDUCE_WARPS``; tools/bench_reduce_kernel.py sweeps both).
    """
    n_rows, E = out.shape[0], out.shape[1]
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
    if waits is None:
        grid = (max(ntiles, 1), 1, 1)
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
    peer_words = (*words, *(IDLE_WORD,) * (PEER_WORDS - len(words)))
    done_words = (*done, *(IDLE_WORD,) * (PEER_WORDS - len(done)))
    args = (out, inp, region, region_addr, term_row, term_self, nterms, need, order, sig, *peer_words, *done_words,
            term_pull,
            pull_maps, alloc_base, decided, sig_peers, counter, n_rows, E)  # fmt: skip
    consts = dict(TERMS=W, BR=br, BC=bc, ACC=int(acc_reduce), AVG=int(average), ACC_DT=acc_dt,
                  W=min(W, PEER_WORDS), AWAIT=int(waits is not None), PAUSE=_pause(), PULL=int(pull is not None),
                  PV=16 // es if rb % 16 == 0 else 1, ES=es, MAPW=mapw, ME=me, END=int(end is not None),
                  WAIT_DONE=int(bool(wait_done)))  # fmt: skip
    _reduce(grid, args, consts, num_warps or REDUCE_WARPS[waits is not None], stream)
