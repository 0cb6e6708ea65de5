"""A fake single-process world for the native backend: ranks are threads, CPU tensors are "GPUs".

Replaces, only inside a test (pytest ``monkeypatch``): the nvshmem4py modules (a symmetric heap
of per-rank CPU tensors allocated collectively, signal set / wait that block with a timeout,
barriers), ``cuda.core``, the CUDA stream / event API of torch (no-ops: every "kernel" runs
synchronously on the host), torch.distributed's bootstrap calls, and the two Triton kernels
(reference implementations working on raw addresses with ``ctypes.memmove``).

What it checks: every host-side path of ``magi_comm.backends.native`` (runtime bootstrap,
buffers and peer views, rounds, growth, signals and acknowledgements in the order the backend
issues them, fused and staged reductions, close / shutdown) with real concurrency between ranks:
a wait whose signal never comes raises after a timeout instead of passing.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import sys
import threading
import types

import native_sim
import torch

from magi_comm.backends import _native_protocol as proto
from magi_comm.backends._native_layout import apply_blocks, publish_row

TIMEOUT = 30.0


class FakeWorld:
    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=TIMEOUT)
        self.heaps: list[list[torch.Tensor | None]] = [[] for _ in range(world)]
        self.cond = threading.Condition()
        self.local = threading.local()
        self.box = None
        self.signals = 0
        self.waits = 0
        self.kernel_signals = 0  # handshake steps done by the (fake) kernels
        self.kernel_waits = 0
        self.host_ops_by = [0] * world
        self.copy_program_caps: set[int] = (
            set()
        )  # max_programs of every copy launch built  # NVSHMEM on-stream signal and wait operations per PE
        self.reduces = 0  # launches of the fused reduction kernel
        self.progress_signals = 0  # PROGRESS slots raised by send kernels
        self.row_waits_by_progress = 0  # receiving waits passed by PROGRESS before READY
        self.overlapped = 0  # receive steps launched beside the send kernel
        self.puts = 0
        self.puts_by = [0] * world
        self.direct_writes = 0  # copy-kernel launches that wrote straight into a peer's output
        self.pulled_rows = 0  # reduction terms read from a source's input (pull)
        self.published_maps = 0  # pull maps written by send launches (not header 0)
        self.done_waits = 0  # DONE waits of fused reductions whose input may have been pulled
        self.done_signals = 0  # DONE raised by fused reductions
        self.gathered: list = [None] * world
        self.placements: list[list] = [[] for _ in range(world)]

    @property
    def pe(self) -> int:
        return self.local.pe

    # -- heap ------------------------------------------------------------------------------

    def _find(self, addr: int) -> tuple[int, int]:
        for idx, t in enumerate(self.heaps[self.pe]):
            if t is None:
                continue
            base = t.data_ptr()
            if base <= addr < base + t.numel() * t.element_size():
                return idx, addr - base
        raise AssertionError(f"PE {self.pe}: address {addr:#x} is not in the symmetric heap")

    def place(self, pool: torch.Tensor, offsets: list[int]) -> None:
        """The calling PE's next allocations lie in ``pool`` (uint8) at these byte offsets
        (tests steer symmetric addresses with it)."""
        self.placements[self.pe] = [(pool, off) for off in offsets]

    def tensor(self, shape, dtype=torch.float32):
        if self.placements[self.pe]:
            pool, off = self.placements[self.pe].pop(0)
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            t = pool[off : off + nbytes].view(dtype).view(shape)
            t.zero_()
        else:
            t = torch.zeros(shape, dtype=dtype)
        self.heaps[self.pe].append(t)
        self.barrier.wait()  # nvshmem_malloc is collective
        return t

    def get_peer_tensor(self, t, pe):
        idx, off = self._find(t.data_ptr())
        assert off == 0
        return self.heaps[pe][idx]

    def free_tensor(self, t):
        idx, _ = self._find(t.data_ptr())
        self.barrier.wait()
        self.heaps[self.pe][idx] = None

    # -- signals (NVSHMEM on-stream ops; here synchronous) -------------------------------------

    def signal_op_on_stream(self, addr, value, op, pe, stream):
        idx, off = self._find(addr)
        assert off % 8 == 0 and op == SignalOp.SIGNAL_ADD and value == 1, "signals add 1"
        with self.cond:
            target = self.heaps[pe][idx].view(-1).view(torch.uint8)[off : off + 8].view(torch.int64)
            target[0] += value
            self.signals += 1
            self.host_ops_by[self.pe] += 1
            self.cond.notify_all()

    def putmem_signal_on_stream(self, dest, source, nbytes, sig_addr, value, op, pe, stream):
        idx, off = self._find(dest)
        with self.cond:
            target = self.heaps[pe][idx].view(-1).view(torch.uint8)
            assert off + nbytes <= target.numel(), "put past the end of the symmetric object"
            ctypes.memmove(target.data_ptr() + off, source, nbytes)
            self.puts += 1
            self.puts_by[self.pe] += 1
        self.signal_op_on_stream(sig_addr, value, op, pe, stream)

    def signal_wait_until_on_stream(self, addr, cmp, value, stream):
        idx, off = self._find(addr)
        assert cmp == ComparisonType.CMP_GE
        slot = self.heaps[self.pe][idx].view(-1).view(torch.uint8)[off : off + 8].view(torch.int64)
        with self.cond:
            self.waits += 1
            self.host_ops_by[self.pe] += 1
            if not self.cond.wait_for(lambda: int(slot[0]) >= value, timeout=TIMEOUT):
                raise TimeoutError(f"PE {self.pe}: signal wait for >= {value} timed out (deadlock)")

    # -- the kernels' handshake (system-scope atomics on raw addresses) --------------------------

    def kernel_add(self, addr: int) -> None:
        with self.cond:
            _words_at(addr, 1, torch.int64)[0] += 1
            self.kernel_signals += 1
            self.cond.notify_all()

    def _raise_slot(self, addr: int, value: int, *counters: str) -> None:
        """An atomic max on the int64 at ``addr``, counted in ``counters``."""
        with self.cond:
            slot = _words_at(addr, 1, torch.int64)
            slot[0] = max(int(slot[0]), value)
            for name in counters:
                setattr(self, name, getattr(self, name) + 1)
            self.cond.notify_all()

    def kernel_max(self, addr: int, value: int) -> None:
        self._raise_slot(addr, value, "kernel_signals", "progress_signals")

    def done_signal(self, addr: int, value: int) -> None:
        """The fused reduction's DONE (counted apart from the handshake's signals: the
        host-handshake path runs it too)."""
        self._raise_slot(addr, value, "done_signals")

    def _await_slot(self, addr: int, value: int, counter: str, what: str) -> None:
        """Block until the int64 at ``addr`` is >= ``value`` (a timeout means a deadlock)."""
        slot = _words_at(addr, 1, torch.int64)
        with self.cond:
            setattr(self, counter, getattr(self, counter) + 1)
            if not self.cond.wait_for(lambda: int(slot[0]) >= value, timeout=TIMEOUT):
                raise TimeoutError(f"PE {self.pe}: {what} wait for >= {value} timed out (deadlock)")

    def done_wait(self, addr: int, value: int) -> None:
        self._await_slot(addr, value, "done_waits", "DONE")

    def kernel_wait_rows(self, progress: int, want: int, ready: int, ready_want: int) -> None:
        """Wait until the slot at ``progress`` reaches ``want`` or the one at ``ready`` reaches
        ``ready_want`` (a receiving program waiting for a source's rows)."""
        p, r = _words_at(progress, 1, torch.int64), _words_at(ready, 1, torch.int64)
        with self.cond:
            self.kernel_waits += 1
            if not self.cond.wait_for(lambda: int(p[0]) >= want or int(r[0]) >= ready_want, timeout=TIMEOUT):
                raise TimeoutError(f"PE {self.pe}: wait for rows ({want:#x} / ready {ready_want}) timed out")
            self.row_waits_by_progress += int(int(p[0]) >= want and int(r[0]) < ready_want)

    def kernel_wait(self, addr: int, value: int) -> None:
        self._await_slot(addr, value, "kernel_waits", "kernel")

    def barrier_all_on_stream(self, stream):
        self.barrier.wait()

    # -- bootstrap -------------------------------------------------------------------------

    def all_reduce(self, tensor, op=None, group=None):
        assert op == "max", op
        self.gathered[self.pe] = tensor.clone()
        self.barrier.wait()
        out = torch.stack(self.gathered).amax(0)
        self.barrier.wait()
        tensor.copy_(out)

    def broadcast_object_list(self, box, src=0, group=None):
        self.barrier.wait()
        if self.pe == src:
            self.box = box[0]
        self.barrier.wait()
        box[0] = self.box


class SignalOp(enum.IntEnum):
    SIGNAL_SET = 0
    SIGNAL_ADD = 5


class ComparisonType(enum.IntEnum):
    CMP_EQ = 0
    CMP_GE = 5


def modules(world: FakeWorld) -> dict[str, types.ModuleType]:
    core = types.ModuleType("nvshmem.core")
    core.get_unique_id = lambda empty=False: None if empty else "fake-uid"
    core.init = lambda device=None, uid=None, rank=None, nranks=None, initializer_method="": None
    core.my_pe = lambda: world.pe
    core.n_pes = lambda: world.world
    core.get_version = lambda: "fake"
    core.tensor = world.tensor
    core.get_peer_tensor = world.get_peer_tensor
    core.free_tensor = world.free_tensor
    core.finalize = lambda: world.barrier.wait()
    core.SignalOp = SignalOp
    core.ComparisonType = ComparisonType
    bindings = types.ModuleType("nvshmem.bindings")
    bindings.signal_op_on_stream = world.signal_op_on_stream
    bindings.putmem_signal_nbi_on_stream = world.putmem_signal_on_stream
    bindings.signal_wait_until_on_stream = world.signal_wait_until_on_stream
    bindings.barrier_all_on_stream = world.barrier_all_on_stream
    pkg = types.ModuleType("nvshmem")
    pkg.core, pkg.bindings = core, bindings
    cuda_core = types.ModuleType("cuda.core")

    class Device:
        def __init__(self, index=0):
            self.device_id = index

        def set_current(self):
            pass

    cuda_core.Device = Device
    cuda = types.ModuleType("cuda")
    cuda.core = cuda_core
    return {
        "nvshmem": pkg,
        "nvshmem.core": core,
        "nvshmem.bindings": bindings,
        "cuda": cuda,
        "cuda.core": cuda_core,
    }


# --------------------------------------------------------------------------------------------
# kernels on raw addresses


def _words_at(addr: int, nwords: int, dtype: torch.dtype) -> torch.Tensor:
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
        world=None,
    ):
        assert max_programs >= 0
        assert (progress is None and waits is None and publish is None) or handshake is not None
        assert publish is None or direct is None
        self.table, self.peers, self.dtype, self.direct = table, peers, dtype, direct
        self.max_programs, self.handshake = max_programs, handshake
        self.progress, self.waits, self.publish = progress, waits, publish
        self.world = world
        with world.cond:
            world.copy_program_caps.add(max_programs)

    def _direct_targets(self):
        """Per peer column: (its output viewed as words, word offset of each pair split) for
        peers whose header says direct mode, else None (the kernel's branch, on the host)."""
        table, W = self.table, len(self.peers)
        maps_addr, bases_addr, width = self.direct
        maps = _words_at(maps_addr, W * width, torch.int64).view(W, width)
        wb = torch.empty(0, dtype=self.dtype).element_size()
        out = []
        for c in range(W):
            used = table.task_split[:, c] >= 0
            hdr = int(maps[c, 0])
            if hdr == 0 or not bool(used.any()):
                out.append(None)
                continue
            base = int(_words_at(bases_addr, hdr * W, torch.int64)[(hdr - 1) * W + c])
            nsplit = int(table.task_split[used, c].max()) + 1
            entries = maps[c, 1 : 1 + nsplit]
            assert bool((entries % wb == 0).all()), "split offsets must be whole words"
            starts = entries // wb
            ends = starts[table.task_split[used, c]] + table.task_within[used] + table.task_len[used]
            out.append((_words_at(base, int(ends.max()), self.dtype), starts))
            with self.world.cond:
                self.world.direct_writes += 1
        return out

    def __call__(self, src, sink, stream=None, sync=0, words=(), pub=0):
        W = len(self.peers)
        assert not sync or (self.handshake is not None and len(words) == W)
        assert not sync & proto.SIGNAL_PROGRESS or self.progress is not None
        assert not sync & proto.AWAIT_ROWS or self.waits is not None
        assert bool(pub) == (self.publish is not None), "a publishing launch takes a table, others none"
        steps = handshake_steps(self.world, self.handshake, W, sync, words)
        next(steps)  # the start of the kernel
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
            peers = _words_at(self.handshake.sig_peers, W, torch.int64).tolist()
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
        """The kernel's publish step: per destination of the table, its pull-map header (the
        map where it accepts pulls and the table has one, else 0) into row ``rank`` of its
        pull-map area. Returns the destinations whose rows are not sent."""
        W = len(self.peers)
        pub_peers, accepts, width, decided = self.publish
        table = _words_at(pub, W + 1 + int(_words_at(pub, W + 1, torch.int64)[W]), torch.int64)
        peer_rows = _words_at(pub_peers, W, torch.int64).tolist()
        accept = _words_at(accepts, W, torch.int64).tolist()
        pulled = []
        for c in range(W):
            mine = publish_row(table, W, c)
            if mine.numel() == 0:
                continue
            assert mine.numel() <= width, "a published map is wider than a map row"
            row = _words_at(peer_rows[c] + 8 * self.handshake.rank * width, mine.numel(), torch.int64)
            with self.world.cond:
                if int(mine[0]) > 0 and accept[c] == proto.PULL_ACCEPT:
                    row.copy_(mine)
                    pulled.append(c)
                    self.world.published_maps += 1
                else:
                    row[0] = 0
                epoch = proto.unpack_peer(epochs[c])[0]
                assert epoch > 0, "a publishing launch needs each destination's epoch"
                _words_at(decided, W, torch.int64)[c] = 2 * epoch + int(c in pulled)
        return pulled

    def _progress_wanted(self, rows) -> bool:
        """The kernel's rule: report unless every destination is in direct mode."""
        W = len(self.peers)
        if self.direct is None or not self.table.has_splits:
            return True
        maps = _words_at(self.direct[0], W * self.direct[2], torch.int64).view(W, self.direct[2])
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
        views = [_words_at(self.peers[c], reach[c], self.dtype) if reach[c] else None for c in range(W)]
        src_words = int((table.task_src + table.task_len).max())
        apply_blocks(
            table,
            _words_at(src, src_words, self.dtype),
            _words_at(sink, reach[W], self.dtype),
            views,
            W,
            direct,
        )


def handshake_steps(world, hs, W, sync, words):
    """The kernels' handshake as a generator: one step at the kernel's start, one at its end."""
    slot = None if hs is None else (lambda base, kind, c: base + 8 * (kind * W + c))
    signals_peers = hs is not None and sync & (proto.ARM_AND_WAIT | proto.READY_END)
    peers = _words_at(hs.sig_peers, W, torch.int64).tolist() if signals_peers else []
    waits = [proto.unpack_peer(w) for w in words]
    if sync & proto.ARM_AND_WAIT:
        for c, (_, _, arm_now) in enumerate(waits):
            if arm_now:
                world.kernel_add(slot(peers[c], proto.ARM, hs.rank))
        for c, (arm_wait, _, _) in enumerate(waits):
            if arm_wait:
                world.kernel_wait(slot(hs.sig, proto.ARM, c), arm_wait)
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
):
    world = _current_world["world"]
    if waits is not None:
        need, order, sig, words, cap = waits
        assert sorted(order.tolist()) == list(range(need.shape[0]))
        assert cap > 0, "a waiting reduction needs a bounded grid"
        hs = proto.Handshake(sig, 0, 0, -1)
        with world.cond:
            world.overlapped += 1
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
        reg, pulled = native_sim.pulled_region(reg.clone(), term_row, term_self, nterms, pull)
        with world.cond:
            world.pulled_rows += pulled
    if out.shape[0] and E:
        native_sim._fused_reference(out, inp, reg, term_row, term_self, nterms, acc_reduce, average)
    if end is not None:
        _reduce_end(world, *end)


def _reduce_end(world, hs, counter, decided, done_words, wait_done) -> None:
    """The fused reduction's DONE step (its last program)."""
    W = len(done_words)
    peers = _words_at(hs.sig_peers, W, torch.int64).tolist()
    for c, word in enumerate(done_words):
        src_epoch = proto.unpack_peer(word)[1]
        if src_epoch:
            world.done_signal(peers[c] + 8 * (proto.DONE * W + hs.rank), src_epoch)
    if wait_done:
        got = _words_at(decided, W, torch.int64)
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


class _Stream:
    cuda_stream = 0

    def __init__(self, device=None, priority=0, **k):
        self.priority = priority

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class _PerThreadLock:
    """The runtime lock is per process; the fake's processes are threads."""

    def __init__(self):
        self._local = threading.local()

    def _lock(self):
        if not hasattr(self._local, "lock"):
            self._local.lock = threading.RLock()
        return self._local.lock

    def __enter__(self):
        return self._lock().__enter__()

    def __exit__(self, *exc):
        return self._lock().__exit__(*exc)


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


_current_world: dict = {}  # "world": the installed world (the fake reduction's waits need it)


def install(monkeypatch, world: FakeWorld) -> None:
    """Patch torch / nvshmem / the native module for the fake world (undone by monkeypatch)."""
    from magi_comm.backends import native

    monkeypatch.setitem(_current_world, "world", world)
    for name, mod in modules(world).items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)
    monkeypatch.setattr(native, "_device", lambda index: torch.device("cpu"))

    def counted_reduce(*args, **kwargs):
        with world.cond:
            world.reduces += 1
        launch_reduce(*args, **kwargs)

    def copy_launch(*args, **kwargs):
        return CopyLaunch(*args, **kwargs, world=world)

    monkeypatch.setattr(
        native,
        "_load_kernels",
        lambda: types.SimpleNamespace(
            CopyLaunch=copy_launch, launch_reduce=counted_reduce, reduce_tile_rows=reduce_tile_rows
        ),
    )
    monkeypatch.setattr(native, "_runtime_store", threading.local())
    monkeypatch.setattr(native._Runtime, "_lock", _PerThreadLock())
    fake_dist = types.SimpleNamespace(
        get_process_group_ranks=lambda group: list(range(world.world)),
        get_global_rank=lambda group, r: r,
        broadcast_object_list=world.broadcast_object_list,
        all_reduce=world.all_reduce,
        ReduceOp=types.SimpleNamespace(MAX="max"),
    )
    monkeypatch.setattr(native, "dist", fake_dist)
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1")


def installed(monkeypatch, world_size: int) -> FakeWorld:
    """A fake world of ``world_size`` ranks, installed for the test (see :func:`install`)."""
    world = FakeWorld(world_size)
    install(monkeypatch, world)
    return world


def run_ranks(world: FakeWorld, fn) -> None:
    """Run ``fn(rank)`` on one thread per rank; re-raise the first failure."""
    errors: list[BaseException] = []

    def body(rank):
        world.local.pe = rank
        try:
            fn(rank)
        except BaseException as e:
            errors.append(e)
            world.barrier.abort()
            with world.cond:
                world.cond.notify_all()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
