"""Device-side steps of the signalling protocol, shared by the copy kernel and the fused reduction.

Triton helpers inlined into the kernels: the packed per-peer words, the handshake at a send
launch's start and end, the waits of a receive step running beside the transfer and the send
kernel's progress reports. What each step does and why it is ordered so:
``packages/magi-comm/docs/native.md`` ("Signals", "Handshake in the kernels", "Receive copy beside
the transfer").
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import protocol as proto
from ..config import wait_timeout_s

__all__ = [
    "PEER_ARGS",
    "POLL_PAUSE_NS",
    "WAIT_LIMIT_NS",
    "WAIT_LIMIT_POLLS",
    "await_at_least",
    "await_rows",
    "backoff",
    "chunk_done",
    "fail",
    "handshake_end",
    "handshake_start",
    "peer_word",
    "peer_word_at",
    "poll_pause",
    "progress_wanted",
    "report_progress",
]

# jit code reads module globals only as constexprs
ARM = tl.constexpr(proto.ARM)
READY = tl.constexpr(proto.READY)
PROGRESS = tl.constexpr(proto.PROGRESS)
PEER_ARGS = [f"p{c}" for c in range(proto.PEER_WORDS)]  # a kernel's packed per-peer words
POLL_PAUSE_NS = 500
# How long a wait for a peer's signal may last (MAGI_COMM_NATIVE_WAIT_TIMEOUT_S): compiled, in
# nanoseconds of the GPU's global timer; under the interpreter (no inline PTX), in polls, one
# per millisecond of the timeout.
WAIT_LIMIT_NS = tl.constexpr(int(wait_timeout_s() * 1e9))
WAIT_LIMIT_POLLS = tl.constexpr(max(1, int(wait_timeout_s() * 1e3)))


def poll_pause(compiled: bool) -> int:
    """Nanoseconds between the polls of a waiting program: 0 when the kernel is not
    ``compiled`` (the interpreter has no inline PTX). Also the kernels' "compiled" flag."""
    return POLL_PAUSE_NS if compiled else 0


@triton.jit
def _clock(PAUSE: tl.constexpr):
    """The GPU's global timer (ns) in a compiled kernel (``PAUSE > 0``), 0 in the interpreter."""
    t = tl.full((), 0, tl.int64)
    if PAUSE > 0:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;",
            "=l,r",
            [tl.full((), 0, tl.int32)],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )
    return t


@triton.jit
def _waited_too_long(start, polls, PAUSE: tl.constexpr):
    """Whether a wait that began at ``_clock`` ``start`` and made ``polls`` polls is past the
    bound (``WAIT_LIMIT_NS`` of the global timer; ``WAIT_LIMIT_POLLS`` in the interpreter)."""
    if PAUSE > 0:
        late = (_clock(PAUSE) - start) > WAIT_LIMIT_NS
    else:
        late = polls > WAIT_LIMIT_POLLS
    return late


@triton.jit
def trap():
    """Abort the launch (compiled kernels only): the CUDA context is left in error, so the host's
    next CUDA call on this rank raises ("unspecified launch failure")."""
    tl.inline_asm_elementwise(
        "trap; mov.u32 $0, 0;", "=r,r", [tl.full((), 0, tl.int32)], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def fail(PAUSE: tl.constexpr, MSG: tl.constexpr):
    """End the kernel with an error instead of going on (a peer's signal that did not come
    within the bound, a peer that refuses what the launch needs). Compiled (``PAUSE > 0``):
    ``trap``; the interpreter raises an AssertionError with ``MSG`` from the launch."""
    if PAUSE > 0:
        trap()
    else:
        tl.static_assert(False, MSG)


WAIT_BOUND_PASSED = tl.constexpr("magi_comm native: a peer's signal did not come within the wait bound")


@triton.jit
def peer_word(c: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
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
def await_at_least(ptr, value, PAUSE: tl.constexpr, PACED: tl.constexpr):
    """Spin until the local int64 at ``ptr`` is >= ``value``, then acquire at system scope (the
    peer's stores released before its signal are visible to every thread of the program).
    Past the wait bound the kernel gives up with an error (`fail`). ``PACED``: a `backoff`
    between polls, for a wait that many programs make at once (the one-launch reduction's
    READY: about 2% less time a call at 16 MiB on 2x H100, docs/perf.md)."""
    start = _clock(PAUSE)
    polls = 0
    cur = tl.load(ptr, volatile=True)
    while cur < value:
        polls += 1
        if _waited_too_long(start, polls, PAUSE):
            fail(PAUSE, WAIT_BOUND_PASSED)
        if PACED:
            backoff(PAUSE)
        cur = tl.load(ptr, volatile=True)
    # a compare-and-swap that never swaps (counts are >= 0): the ordering point
    never = tl.full((), -1, tl.int64)
    tl.atomic_cas(ptr, never, never, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def add_to_peer(sig_peers, c: tl.constexpr, KIND: tl.constexpr, W: tl.constexpr, ME: tl.constexpr):
    """Add 1 to slot ``(KIND, ME)`` of peer ``c``'s signal array (system-scope release: this
    program's earlier stores, and the CTA's before a barrier, are visible first)."""
    peer = tl.load(sig_peers.to(tl.pointer_type(tl.int64)) + c).to(tl.pointer_type(tl.int64))
    tl.atomic_add(peer + KIND * W + ME, 1, sem="release", scope="sys")


@triton.jit
def handshake_start(sig, p0, p1, p2, p3, p4, p5, p6, p7, sig_peers, W: tl.constexpr, ME: tl.constexpr,
                     HS_ARM: tl.constexpr, PAUSE: tl.constexpr):  # fmt: skip
    """The send kernel's start (``HS_ARM``): program 0 adds 1 to ``ARM`` slot ``ME`` on every
    source flagged ``arm_now``; every program waits until each destination's ``ARM`` slot
    reaches ``arm_wait`` (its earlier use of its region and output is over), except where the
    word says the arm is known (a one-launch reduce only: docs/native.md, "The arm known")."""
    if HS_ARM:
        if tl.program_id(0) == 0:
            for c in tl.static_range(W):
                if (peer_word(c, p0, p1, p2, p3, p4, p5, p6, p7) & 1) != 0:
                    add_to_peer(sig_peers, c, ARM, W, ME)
        slots = sig.to(tl.pointer_type(tl.int64))
        for c in tl.static_range(W):
            word = peer_word(c, p0, p1, p2, p3, p4, p5, p6, p7)
            want = (word >> 32) & 0x3FFFFFFF
            if (want > 0) & (word >= 0):  # a known arm (the sign bit) is not awaited
                await_at_least(slots + ARM * W + c, want, PAUSE, False)


@triton.jit
def handshake_end(sig, p0, p1, p2, p3, p4, p5, p6, p7, sig_peers, counter, W: tl.constexpr, ME: tl.constexpr,
                   HS_READY: tl.constexpr, HS_WAIT_END: tl.constexpr, PAUSE: tl.constexpr):  # fmt: skip
    """The send kernel's end: the last program to finish signals ``READY`` to every
    destination (``HS_READY``) and then waits for every source's ``READY`` count
    (``HS_WAIT_END``), so the kernels after it on the stream find the peers' rows in place."""
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
                    if ((peer_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 32) & 0x3FFFFFFF) > 0:
                        add_to_peer(sig_peers, c, READY, W, ME)
            if HS_WAIT_END:
                slots = sig.to(tl.pointer_type(tl.int64))
                for c in tl.static_range(W):
                    want = (peer_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 1) & 0x7FFFFFFF
                    if want > 0:
                        await_at_least(slots + READY * W + c, want, PAUSE, False)


@triton.jit
def peer_word_at(s, p0, p1, p2, p3, p4, p5, p6, p7):
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
def backoff(PAUSE: tl.constexpr):
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
def await_rows(sig, s, rows, word, seen, W: tl.constexpr, PAUSE: tl.constexpr):
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
        start = _clock(PAUSE)
        polls = 0
        p = tl.load(prog, volatile=True)
        r = tl.load(rdy, volatile=True)
        while (p < want) & (r < ready_want):
            polls += 1
            if _waited_too_long(start, polls, PAUSE):
                fail(PAUSE, WAIT_BOUND_PASSED)
            backoff(PAUSE)
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
def chunk_done(done, j):
    """This program finished its blocks of chunk ``j``: its own word of ``done`` says so, with
    a system-scope release of its stores (its own address: the programs do not queue on one
    counter)."""
    tl.debug_barrier()
    tl.atomic_xchg(done.to(tl.pointer_type(tl.int32)) + tl.program_id(0), j + 1, sem="release", scope="sys")


@triton.jit
def report_progress(done, nchunks, prog_rows, sig_peers, p0, p1, p2, p3, p4, p5, p6, p7, W: tl.constexpr,
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
                    epoch = (peer_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 32) & 0x3FFFFFFF
                    peer = tl.load(sig_peers.to(tl.pointer_type(tl.int64)) + c).to(tl.pointer_type(tl.int64))
                    tl.atomic_max(peer + PROGRESS * W + ME, (epoch << 32) | rows, sem="release", scope="sys")
            reported = k
        else:
            backoff(PAUSE)
    tl.store(words, 0, mask=live)


@triton.jit
def progress_wanted(prog_rows, maps, W: tl.constexpr, DIRECT: tl.constexpr, MAPW: tl.constexpr):
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
