"""The copy kernel: every data movement of the native backend, and its launch object.

A block of a block table loads ``block_words`` words of one task from ``src`` once and stores
them to every destination of the task: the peers' receive regions (their NVLink-mapped
symmetric buffers), a peer's output in direct mode, and/or the local sink. One kernel serves
the send step (input -> peers and, for rows to self, the sink) and the receive step (regions ->
sink); a launch may also carry the handshake, progress reports or waits
(:mod:`.handshake`) and, for a reduce's send, the publish step of the pull maps. Words are 1, 2,
4 or 8 bytes (:func:`~..layout.word_size`); ``VEC`` is a divisibility hint (in words) for
16-byte vector accesses. Runs under ``TRITON_INTERPRET=1`` on CPU tensors too (the unit tests).
Design: ``packages/magi-comm/docs/native.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import protocol as proto
from ..layout import MAX_PEERS, BlockTable
from ..protocol import IDLE_WORD, MAX_REPORTING_PROGRAMS, PEER_WORDS, Handshake
from .compiled import CompiledKernel, args_device, specialization
from .handshake import (
    PEER_ARGS,
    await_rows,
    chunk_done,
    fail,
    handshake_end,
    handshake_start,
    peer_word,
    peer_word_at,
    poll_pause,
    progress_wanted,
    report_progress,
)

__all__ = ["CopyLaunch"]

PULL_ACCEPT = tl.constexpr(proto.PULL_ACCEPT)  # jit code reads module globals only as constexprs
UNACCEPTED = tl.constexpr(proto.MSG_PULLS_UNACCEPTED)

_TL = {torch.int64: tl.int64, torch.int32: tl.int32, torch.int16: tl.int16, torch.uint8: tl.uint8}


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
            epoch = (peer_word(c, p0, p1, p2, p3, p4, p5, p6, p7) >> 32) & 0x3FFFFFFF
            tl.atomic_xchg(
                decided.to(tl.pointer_type(tl.int64)) + c, 2 * epoch + bit, sem="release", scope="gpu"
            )


@triton.jit
def _check_unpulled(pulls, srcs, W: tl.constexpr, MAPW: tl.constexpr, PAUSE: tl.constexpr):
    """A staged reduce's receive copy, before it reads a region: every source of ``srcs`` (bit
    ``s``) published header 0 into row ``s`` of our pull-map area (``pulls``), i.e. sent its
    rows. A source that published a map believes we pull (the ranks' backends differ); its rows
    are not in our region, so the launch ends with an error instead of copying stale ones. The
    headers of this call are in place: each source publishes before its READY, which the
    stream awaited before this launch, and publishes its next call's only after our next arm
    (or, its arm known, after a pulled call, whose map this check finds)."""
    rows = pulls.to(tl.pointer_type(tl.int64))
    for s in tl.static_range(W):
        if (((srcs >> s) & 1) != 0) & (tl.load(rows + s * MAPW) != 0):
            fail(PAUSE, UNACCEPTED)


# ---- copy ----------------------------------------------------------------------------------


@triton.jit
def _row(base, off, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to word ``off`` after address ``base``; with ``ALIGNED`` marked 16-byte aligned (a
    pointer made from an integer carries no alignment, so its accesses would stay single words)."""
    ptr = base.to(tl.pointer_type(DT)) + off
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _put(
    base, task_dst, t, W: tl.constexpr, COL: tl.constexpr, start, offs, vals, mask, ALIGNED: tl.constexpr
):
    off = tl.load(task_dst + t * (W + 1) + COL)
    if off >= 0:
        tl.store(_row(base, off + start, vals.dtype, ALIGNED) + offs, vals, mask=mask)


@triton.jit
def _put_peer(
    peers, task_dst, task_split, task_within, maps, alloc_base, t, W: tl.constexpr, COL: tl.constexpr,
    start, offs, vals, mask, VEC: tl.constexpr, DIRECT: tl.constexpr, MAPW: tl.constexpr, pulled,
):  # fmt: skip
    # Peer COL's region in its receive buffer, unless the peer published a map of its output
    # (header > 0 = 1 + the symmetric allocation holding it): then straight into its output.
    # Regions start at 16-byte aligned field areas, and a map is published only for a 16-byte
    # aligned output, so with VEC > 1 (rows of a multiple of 16 bytes) every row is aligned.
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
        tl.store(_row(target, off + start, vals.dtype, VEC > 1) + offs, vals, mask=mask)


@triton.jit
def _copy_block(b, src, sink, peers, blk_task, blk_start, task_src, task_len, task_dst, task_split,
                task_within, maps, alloc_base, offs, DT: tl.constexpr, W: tl.constexpr, VEC: tl.constexpr,
                DIRECT: tl.constexpr, MAPW: tl.constexpr, pulled,
                PUBLISH: tl.constexpr, SRC16: tl.constexpr, SINK16: tl.constexpr):  # fmt: skip
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
        # block starts and task lengths are multiples of VEC words: the mask holds or fails for
        # whole 16-byte vectors
        left = tl.multiple_of(tl.load(task_len + t) - start, VEC)
        mask = offs < left
        vals = tl.load(_row(src, tl.load(task_src + t) + start, DT, SRC16 and VEC > 1) + offs, mask=mask)
        _put(sink, task_dst, t, W, W, start, offs, vals, mask, SINK16 and VEC > 1)
        for c in tl.static_range(W):
            _put_peer(peers, task_dst, task_split, task_within, maps, alloc_base, t, W, c, start, offs,
                      vals, mask, VEC, DIRECT, MAPW, pulled)  # fmt: skip


@triton.jit(do_not_specialize=PEER_ARGS)
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
    pulls,
    pull_srcs,
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
    ME: tl.constexpr,
    GP: tl.constexpr,
    PUBLISH: tl.constexpr,
    UNPULLED: tl.constexpr,
    HS_ARM: tl.constexpr,
    HS_READY: tl.constexpr,
    HS_WAIT_END: tl.constexpr,
    PROG: tl.constexpr,
    AWAIT: tl.constexpr,
    PAUSE: tl.constexpr,
    SRC16: tl.constexpr,
    SINK16: tl.constexpr,
):
    # src / sink / maps / alloc_base and the entries of ``peers`` (int64 (W,): each
    # peer's region area, NVLink-mapped) are addresses: symmetric-heap and peer memory is
    # addressed through plain integers, as in the verified peer-store recipe.
    # Program p copies blocks p, p + grid, ...: a grid smaller than the table
    # (NativeConfig.max_programs) leaves the other SMs to a kernel running beside the copy.
    # PROG (a send): one more program, the reporter; the others take the same stride inside
    # chunks of ``chunk_blocks`` blocks and mark each chunk done (``prog_cnt``: one int32 per
    # copying program, zero between launches; GP: a power of two >= their number). AWAIT (a receive copy): each block first waits for the rows
    # it reads (``wait_src`` / ``wait_rows`` per block).
    # PUBLISH (a reduce's send): program 0 writes every destination's pull-map header (``pub``:
    # the publish table, see terms.publish_table; ``pub_peers``: each peer's pull-map
    # area; ``accepts``: the destinations' accept words); rows of pulled destinations stay.
    # UNPULLED (a staged reduce's receive copy): every program first checks that the sources
    # ``pull_srcs`` sent their rows (``pulls``: our pull-map area; see _check_unpulled).
    handshake_start(sig, p0, p1, p2, p3, p4, p5, p6, p7, sig_peers, W, ME, HS_ARM, PAUSE)
    if UNPULLED:
        _check_unpulled(pulls, pull_srcs, W, MAPW, PAUSE)
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
        # programs 0..G-1 copy, chunk by chunk; program G reports (see report_progress)
        report = progress_wanted(prog_rows, maps, W, DIRECT, MAPW)
        G = G - 1
        if pid == G:
            if report != 0:
                report_progress(prog_cnt, tl.cdiv(nblocks, chunk_blocks), prog_rows, sig_peers,
                                 p0, p1, p2, p3, p4, p5, p6, p7, W, ME, GP, PAUSE)  # fmt: skip
        else:
            j = 0
            first = 0  # the chunk's first block
            while first < nblocks:
                b = first + pid
                end = tl.minimum(first + chunk_blocks, nblocks)
                while b < end:
                    _copy_block(b, src, sink, peers, blk_task, blk_start, task_src, task_len, task_dst,
                                task_split, task_within, maps, alloc_base, offs, DT, W, VEC, DIRECT, MAPW,
                                pulled, PUBLISH, SRC16, SINK16)  # fmt: skip
                    b += G
                if report != 0:
                    chunk_done(prog_cnt, j)
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
                seen = await_rows(sig, s, tl.load(wait_rows + b), peer_word_at(s, p0, p1, p2, p3, p4, p5, p6, p7),
                                   seen, W, PAUSE)  # fmt: skip
            _copy_block(b, src, sink, peers, blk_task, blk_start, task_src, task_len, task_dst,
                        task_split, task_within, maps, alloc_base, offs, DT, W, VEC, DIRECT, MAPW, pulled,
                        PUBLISH, SRC16, SINK16)  # fmt: skip
            b += G
    if FENCE and not (HS_READY or HS_WAIT_END):  # else the end handshake releases
        # Make this program's peer stores visible system-wide before the kernel can complete
        # (and hence before the stream-ordered NVSHMEM ready signal): CTA barrier, then one
        # release atomic at system scope (cumulative over the CTA's stores).
        tl.debug_barrier()
        tl.atomic_add(fence.to(tl.pointer_type(tl.int32)), 1, sem="release", scope="sys")
    handshake_end(
        sig, p0, p1, p2, p3, p4, p5, p6, p7, sig_peers, counter, W, ME, HS_READY, HS_WAIT_END, PAUSE
    )


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
    """Nanoseconds between the polls of a waiting program of the copy kernel."""
    return poll_pause(_copy.direct)


_copy = CompiledKernel(_copy_kernel)


class CopyLaunch:
    """One copy-kernel launch whose block table, peer regions and options are fixed (a round of
    a cached layout); per call only the ``src`` / ``sink`` addresses, the stream and the
    handshake words change.

    Every fixed address argument is known at construction (absent peers and a missing fence
    point at the block table, 16-byte aligned), so of Triton's specialization only the two
    varying addresses' is left to compute per launch (the launch key given to `CompiledKernel`).

    Args:
        table: block table on the device (word offsets).
        peers: ``W`` addresses of peer ``c``'s region area (NVLink-mapped); None where no
            task writes (at most ``MAX_PEERS``).
        dtype: the word dtype (torch.int64 / int32 / int16 / uint8).
        vec: words per 16 bytes when all offsets are multiples of 16 bytes, else 1; with
            vec > 1 every peer address (``peers``, and the outputs of ``direct``'s maps) must be
            16-byte aligned too: the stores there are 16-byte vectors.
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
            :mod:`magi_comm.backends.native.protocol`); None: never.
        progress: ``(rows, done, chunk_blocks)`` for a send that reports its progress
            (``SIGNAL_PROGRESS``, at most ``MAX_REPORTING_PROGRAMS`` programs): ``rows`` the
            device table of :func:`~magi_comm.backends.native.progress.send_progress`, ``done``
            the address of local int32 words (one per program, zero between launches).
        waits: ``(source, rows)`` device tables of
            :func:`~magi_comm.backends.native.progress.recv_waits` for a receive copy that
            waits for its rows (``AWAIT_ROWS``).
        publish: ``(pub_peers, accepts, map_width, decided)`` for a reduce's send (round 0): program 0
            writes each destination's pull-map header, the publish table of the call (see
            :func:`~magi_comm.backends.native.terms.publish_table`), into row ``rank`` of
            that peer's pull-map area (``pub_peers``: address of an int64 ``(W,)`` table of
            those areas, NVLink-mapped; rows of ``map_width`` words), and rows for a
            destination that accepts pulls (``accepts``: address of the int64 ``(W,)`` accept
            words) and gets a map are not sent; ``decided``: address of local int64 ``(W,)``
            words where it records, per destination, ``2 * epoch + pulled`` (the epoch from the
            call's words, given also without handshake steps). Needs the handshake's rank.
        unpulled: ``(pulls, map_width, sources)`` for a staged reduce's receive copy (it runs
            after the sources' READY): every program first checks that each source of the
            bitmask ``sources`` published header 0 into its row of this rank's pull-map area
            (``pulls``: address of int64 ``(W, map_width)``), i.e. sent its rows here, and ends
            the launch with an error otherwise (docs/native.md, "The arm known").
    """

    def __init__(self, table: BlockTable, peers: list[int | None], dtype: torch.dtype, *, vec: int = 1,
                 num_warps: int = 8, fence: int = 0, direct: tuple[int, int, int] | None = None,
                 max_programs: int = 0, handshake: Handshake | None = None,
                 progress: tuple[torch.Tensor, int, int] | None = None,
                 waits: tuple[torch.Tensor, torch.Tensor] | None = None,
                 publish: tuple[int, int, int, int] | None = None,
                 unpulled: tuple[int, int, int] | None = None) -> None:  # fmt: skip
        W = len(peers)
        if W > MAX_PEERS:
            raise ValueError(f"the native copy kernel supports at most {MAX_PEERS} peers, got {W}")
        if max_programs < 0:
            raise ValueError(f"max_programs must be >= 0 (0: one program per block), got {max_programs}")
        proto.check_copy_roles(
            peers=peers, handshake=handshake, progress=progress, waits=waits, publish=publish, direct=direct,
            unpulled=unpulled,
        )  # fmt: skip
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
            unpulled[0] if unpulled else self.filler,
            unpulled[2] if unpulled else 0,
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
        self.progress, self.waits, self.publish = progress, waits, publish
        self.handshake = hs
        self.base_consts = dict(
            DT=_TL[dtype],
            W=W,
            BLOCK=table.block_words,
            VEC=vec,
            FENCE=int(bool(fence) and any(p for p in peers)),
            DIRECT=int(direct is not None and table.num_blocks > 0 and table.has_splits),
            MAPW=direct[2] if direct else (publish[2] if publish else (unpulled[1] if unpulled else 1)),
            ME=hs.rank if hs else 0,
            GP=triton.next_power_of_2(max(programs, 1)) if progress else 1,
            PUBLISH=int(publish is not None),  # the kernel's constexprs in its order (launched positionally)
            UNPULLED=int(unpulled is not None),
        )
        self.num_warps = num_warps
        self._modes: dict[tuple[int, bool, bool], tuple[dict, int]] = {}

    def _mode(self, sync: int, src16: bool, sink16: bool) -> tuple[dict, int]:
        """``(constexprs, variant)`` of handshake mode ``sync`` for a source / sink address that
        is (or not) 16-byte aligned (cached: they key the launch)."""
        got = self._modes.get((sync, src16, sink16))
        if got is None:
            consts = dict(self.base_consts, **_handshake_flags(sync), SRC16=int(src16), SINK16=int(sink16))
            variant = _copy.variant(
                (
                    tuple(specialization(a) for a in self.fixed),
                    tuple(consts.values()),
                    self.num_warps,
                    args_device(self.fixed),
                )
            )
            got = self._modes[(sync, src16, sink16)] = (consts, variant)
        return got

    def __call__(self, src: int, sink: int, stream: torch.cuda.Stream | None = None, sync: int = 0,
                 words: tuple[int, ...] = (), pub: int = 0) -> None:  # fmt: skip
        """Copy from address ``src`` to the peers and to address ``sink`` (0: no local sink).

        ``sync``: handshake steps (bits of :mod:`magi_comm.backends.native.protocol`) with
        ``words`` the packed per-peer words (:func:`~magi_comm.backends.native.protocol.pack_peer`,
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
        proto.refuse_known_arms(words)
        handshake_steps = proto.ARM_AND_WAIT | proto.READY_END | proto.WAIT_READY_END
        # a publishing launch writes the headers even without blocks
        grid = self.sync_grid if sync & handshake_steps or pub else self.grid
        if sync & proto.SIGNAL_PROGRESS:
            grid = self.report_grid
        if grid[0] == 0:
            return
        # 0 (an empty tensor: nothing is read or written) would turn the address 32-bit
        src, sink, pub = src or self.filler, sink or self.filler, pub or self.filler
        consts, variant = self._mode(sync, src % 16 == 0, sink % 16 == 0)
        key = (variant, pub % 16 == 0, src < 2**31, sink < 2**31, pub < 2**31)
        peer_words = (*words, *(IDLE_WORD,) * (PEER_WORDS - len(words)))
        _copy(grid, (src, sink, pub, *peer_words, *self.fixed), consts, self.num_warps, stream, key=key)
