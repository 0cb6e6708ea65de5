"""A fake single-process world for the native backend: ranks are threads, CPU tensors are "GPUs".

Plugs in through the backend's one seam, its platform (:mod:`magi_comm.backends.native.platform`):
:func:`run_ranks` runs each rank on a thread with its own :class:`FakePlatform` installed
(:func:`~magi_comm.backends.native.platform.use_platform`). A platform hands the backend a
fake nvshmem4py (a symmetric heap of per-rank CPU tensors allocated collectively, signal set /
wait that block with a timeout, barriers), a fake ``cuda.core``, a CUDA stream / event API of
no-ops (every "kernel" runs synchronously on the host), torch.distributed's bootstrap calls, and
the two Triton kernels as reference implementations working on raw addresses
(:mod:`magi_comm.testing.native_fake_kernels`). Nothing is patched.

What it checks: every host-side path of ``magi_comm.backends.native`` (runtime bootstrap,
buffers and peer views, rounds, growth, signals and acknowledgements in the order the backend
issues them, fused and staged reductions, close / shutdown) with real concurrency between ranks:
a wait whose signal never comes raises after a timeout instead of passing.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import threading
import types

import torch

from magi_comm.backends.native.platform import use_platform

from . import native_fake_kernels as kernels
from .native_fake_kernels import TIMEOUT, CopyLaunch, launch_reduce, words_at

__all__ = [
    "TIMEOUT",
    "CopyLaunch",
    "FakePlatform",
    "FakeWorld",
    "default_collective",
    "launch_reduce",
    "run_ranks",
]


class FakeWorld:
    """The shared side of ``world`` simulated processes: symmetric heap, signals, barriers, the
    bootstrap's collectives, and counters of what the backend did (the tests assert on them).

    ``platforms[r]`` is rank ``r``'s :class:`FakePlatform`; ``dist`` the torch.distributed
    calls they share and ``kernels`` the kernel module they hand out (a test may replace
    either's members before it runs the ranks)."""

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
        self.host_ops_by = [0] * world  # NVSHMEM on-stream signal and wait operations per PE
        self.copy_program_caps: set[int] = set()  # max_programs of every copy launch built
        self.reduces = 0  # launches of the fused reduction kernel
        self.reduce_shapes: set[tuple] = set()  # (tile_rows, num_warps) given to those launches
        self.progress_signals = 0  # PROGRESS slots raised by send kernels
        self.row_waits_by_progress = 0  # receiving waits passed by PROGRESS before READY
        self.overlapped = 0  # receive steps launched beside the send kernel
        self.overlapped_reduces = 0  # of which fused reductions
        self.puts = 0
        self.memcpys = 0  # copies by the (fake) copy engines
        self.device_bytes = 0  # each simulated GPU's memory (0: the default heap is its floor)
        self.reduce_caps: set[int] = set()  # grid caps of fused reductions after the transfer
        self.puts_by = [0] * world
        self.direct_writes = 0  # copy-kernel launches that wrote straight into a peer's output
        self.pulled_rows = 0  # reduction terms read from a source's input (pull)
        self.published_maps = 0  # pull maps written by send launches (not header 0)
        self.one_launch_reduces = 0  # reductions that made their call's handshake (one launch)
        self.known_arms = 0  # arms a one-launch reduction did not await (known)
        self.unpulled_checks = 0  # staged receive copies that checked their sources sent
        self.errors: dict[int, BaseException] = {}  # each rank's failure (run_ranks)
        self.done_waits = 0  # DONE waits of fused reductions whose input may have been pulled
        self.done_signals = 0  # DONE raised by fused reductions
        self.gathered: list = [None] * world
        self.placements: list[list] = [[] for _ in range(world)]
        self.dist = types.SimpleNamespace(
            get_process_group_ranks=lambda group: list(range(self.world)),
            get_global_rank=lambda group, r: r,
            broadcast_object_list=self.broadcast_object_list,
            all_reduce=self.all_reduce,
            ReduceOp=types.SimpleNamespace(MAX="max"),
        )
        self.kernels = types.SimpleNamespace(
            CopyLaunch=self._copy_launch,
            launch_reduce=self._launch_reduce,
            reduce_tile_rows=kernels.reduce_tile_rows,
        )
        self.nvshmem_core, self.nvshmem_bindings = _nvshmem(self)
        self.platforms = [FakePlatform(self) for _ in range(world)]

    @property
    def pe(self) -> int:
        """The calling rank (the thread's, see :func:`run_ranks`)."""
        return self.local.pe

    def _copy_launch(self, *args, **kwargs) -> CopyLaunch:
        return CopyLaunch(*args, **kwargs, world=self)

    def _launch_reduce(self, *args, **kwargs) -> None:
        with self.cond:
            self.reduces += 1
        launch_reduce(*args, **kwargs, world=self)

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
        heap = self.heaps[self.pe][idx]
        assert heap is not None  # _find returns a live allocation
        slot = heap.view(-1).view(torch.uint8)[off : off + 8].view(torch.int64)
        with self.cond:
            self.waits += 1
            self.host_ops_by[self.pe] += 1
            if not self.cond.wait_for(lambda: int(slot[0]) >= value, timeout=TIMEOUT):
                raise TimeoutError(f"PE {self.pe}: signal wait for >= {value} timed out (deadlock)")

    # -- the kernels' handshake (system-scope atomics on raw addresses) --------------------------

    def kernel_add(self, addr: int) -> None:
        with self.cond:
            words_at(addr, 1, torch.int64)[0] += 1
            self.kernel_signals += 1
            self.cond.notify_all()

    def _raise_slot(self, addr: int, value: int, *counters: str) -> None:
        """An atomic max on the int64 at ``addr``, counted in ``counters``."""
        with self.cond:
            slot = words_at(addr, 1, torch.int64)
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
        slot = words_at(addr, 1, torch.int64)
        with self.cond:
            setattr(self, counter, getattr(self, counter) + 1)
            if not self.cond.wait_for(lambda: int(slot[0]) >= value, timeout=TIMEOUT):
                raise TimeoutError(f"PE {self.pe}: {what} wait for >= {value} timed out (deadlock)")

    def done_wait(self, addr: int, value: int) -> None:
        self._await_slot(addr, value, "done_waits", "DONE")

    def kernel_wait_rows(self, progress: int, want: int, ready: int, ready_want: int) -> None:
        """Wait until the slot at ``progress`` reaches ``want`` or the one at ``ready`` reaches
        ``ready_want`` (a receiving program waiting for a source's rows)."""
        p, r = words_at(progress, 1, torch.int64), words_at(ready, 1, torch.int64)
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


def _nvshmem(world: FakeWorld) -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
    """The fake ``nvshmem.core`` and ``nvshmem.bindings`` of ``world`` (every rank's)."""
    core = types.SimpleNamespace(
        get_unique_id=lambda empty=False: None if empty else "fake-uid",
        init=lambda device=None, uid=None, rank=None, nranks=None, initializer_method="": None,
        my_pe=lambda: world.pe,
        n_pes=lambda: world.world,
        get_version=lambda: "fake",
        tensor=world.tensor,
        get_peer_tensor=world.get_peer_tensor,
        free_tensor=world.free_tensor,
        finalize=lambda: world.barrier.wait(),
        SignalOp=SignalOp,
        ComparisonType=ComparisonType,
    )
    bindings = types.SimpleNamespace(
        signal_op_on_stream=world.signal_op_on_stream,
        putmem_signal_nbi_on_stream=world.putmem_signal_on_stream,
        signal_wait_until_on_stream=world.signal_wait_until_on_stream,
        barrier_all_on_stream=world.barrier_all_on_stream,
    )
    return core, bindings


class _Device:
    """``cuda.core.Device``."""

    def __init__(self, index=0):
        self.device_id = index

    def set_current(self):
        pass


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


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


# the torch.cuda calls the backend makes; every "kernel" has run by the time it returns
_CUDA = types.SimpleNamespace(
    is_available=lambda: True,
    current_device=lambda: 0,
    Stream=_Stream,
    Event=_Event,
    current_stream=lambda device=None: _Stream(),
    stream=lambda stream=None: contextlib.nullcontext(),
    synchronize=lambda device=None: None,
)


class FakePlatform:
    """One simulated process's platform (the attributes and methods of
    :class:`~magi_comm.backends.native.platform.CudaPlatform`): CPU tensors for device memory,
    ``world``'s fake nvshmem4py, bootstrap collectives and reference kernels."""

    def __init__(self, world: FakeWorld) -> None:
        self.world = world
        self.cuda = _CUDA
        self.dist = world.dist
        self.lock = threading.Lock()
        self.runtime = None

    def device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def device_memory(self, index: int) -> int:
        return self.world.device_bytes

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        pass

    def memcpy(self, dst: int, src: int, nbytes: int, stream) -> None:
        """The copy engines' copy, done at once (every stream is synchronous here)."""
        ctypes.memmove(dst, src, nbytes)
        with self.world.cond:
            self.world.memcpys += 1

    def nvshmem(self, heap_bytes: int):
        return self.world.nvshmem_core, self.world.nvshmem_bindings, _Device

    def kernels(self):
        return self.world.kernels


@contextlib.contextmanager
def default_collective(group, backend):
    """Context (on a rank's thread): a :class:`~magi_comm.GroupCollective` over this rank's
    native ``backend`` is magi_comm's shared instance of ``(group, "native")``, so code that
    calls ``magi_comm.group_cast(..., group)`` / ``get_group_collective(group)`` (with
    ``$MAGI_COMM_BACKEND=native``) runs on the fake world; ``group`` is any hashable object,
    one per rank (the ranks share the process). Yields the collective; closes it (and the
    backend) on exit."""
    from magi_comm import collective

    gc = collective.GroupCollective._over_backend(backend, group, backend.rank, backend.world_size)
    with collective._defaults_lock:
        collective._defaults[(group, "native")] = gc
    try:
        yield gc
    finally:
        with collective._defaults_lock:
            if collective._defaults.get((group, "native")) is gc:
                del collective._defaults[(group, "native")]
        gc.close()


def run_ranks(world: FakeWorld, fn) -> None:
    """Run ``fn(rank)`` on one thread per rank, each with its rank's platform installed as its
    process platform; re-raise the first failure. Every rank's failure stays in
    ``world.errors`` (rank -> exception): the one raised may be another rank's."""

    def body(rank):
        world.local.pe = rank
        try:
            with use_platform(world.platforms[rank]):
                fn(rank)
        except BaseException as e:
            world.errors[rank] = e
            world.barrier.abort()
            with world.cond:
                world.cond.notify_all()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    errors = list(world.errors.values())  # in the order they were raised
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
