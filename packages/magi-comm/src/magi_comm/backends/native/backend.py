"""The public backend class, :class:`NativeBackend`: lifecycle, symmetric outputs and the two calls.

The calls' bodies live in :mod:`.cast_path` and :mod:`.reduce_path`, the transfers and signals
in :mod:`.transport`. Design: ``packages/magi-comm/docs/native.md``.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from ..._plan import CastPlan, ReducePlan
from ...work import GroupCollectiveWork
from .cast_path import CastPath
from .config import ENV_BUFFER_MB, MIB, NativeConfig, unavailable
from .group_state import GroupState
from .launches import Launches
from .layout import MAX_PEERS, bytes_needed, reserved_capacity, row_bytes
from .platform import CudaPlatform, process_platform
from .reduce_path import ReducePath
from .runtime import Runtime
from .transport import Transport

__all__ = ["NativeBackend"]


logger = logging.getLogger(__name__)


class _EventWork:
    """A transport handle: waiting orders the caller's current stream after the event."""

    __slots__ = ("cuda", "device", "event")

    def __init__(self, cuda, event, device: int | None) -> None:
        self.cuda = cuda
        self.event = event
        self.device = device

    def wait(self, timeout=None) -> bool:
        self.cuda.current_stream(self.device).wait_event(self.event)
        return True


class NativeBackend:
    """GroupCast / GroupReduce over NVSHMEM symmetric buffers on one node
    (``packages/magi-comm/docs/native.md``).

    Args:
        group, rank, world_size: the process group and this process's rank in it.
        config: sizes; default :meth:`NativeConfig.from_env`.
        platform: where CUDA, torch.distributed, nvshmem4py and the kernels come from; default
            :func:`~.platform.process_platform` (the CPU tests install a fake one there).
    """

    name = "native"

    def __init__(
        self,
        group,
        rank: int,
        world_size: int,
        config: NativeConfig | None = None,
        *,
        platform: CudaPlatform | None = None,
    ) -> None:
        self._platform = platform = platform or process_platform()
        if not platform.cuda.is_available():
            raise unavailable("CUDA is not available in this process")
        if world_size > MAX_PEERS:
            raise unavailable(f"world size {world_size} > {MAX_PEERS} (one NVLink node)")
        kernels = platform.kernels()
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.config = config or NativeConfig.from_env()
        rt = Runtime.acquire(platform, group, rank, world_size, self.config)
        with platform.lock:
            state = rt.states.get(rt.members)
            created = state is None
            if state is None:
                state = rt.states[rt.members] = GroupState(rt, self.config)
            state.refcount += 1
        self._rt = rt
        self._state: GroupState | None = state
        self._agree_on_fused_reduce(state, created)
        launches = Launches(state, self.config, kernels)
        transport = Transport(state, self.config, launches, kernels)
        self._cast = CastPath(state, transport)
        self._reduce = ReducePath(state, self.config, launches, transport, kernels)
        self._refused: set[tuple[int, int]] = set()  # reserve_rows needs refused (and logged)

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Collective: release this handle; the group's last handle frees the symmetric buffers."""
        state, self._state = self._state, None
        if state is None:
            return
        with self._platform.lock:
            state.refcount -= 1
            last = state.refcount == 0
            if last:
                self._rt.states.pop(self._rt.members, None)
        if last:
            state.close()
        self.group = None

    def __enter__(self) -> NativeBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require(self) -> GroupState:
        if self._state is None:
            raise RuntimeError("magi_comm native backend is closed")
        return self._state

    # ---- symmetric memory ------------------------------------------------------------------

    def empty_output(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Collective: an uninitialized tensor of ``shape`` / ``dtype`` in the NVSHMEM symmetric
        heap, on this rank's GPU. A group_cast into it (or into a contiguous, 16-byte aligned
        row range of it) runs in direct mode: peers write the rows straight into it, without
        the receive copy; a group_reduce from it leaves the rows there for receivers of the
        fused reduction (pull). Shapes may differ per rank (the allocation takes the largest).
        Free it with :meth:`free_output` (collective) or let :meth:`close` free it."""
        st = self._require()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"empty_output: dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(int(x) for x in shape)
        if any(x < 0 for x in shape):
            raise ValueError(f"empty_output: shape must not have negative sizes, got {shape}")
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        # One host collective: the largest size, and a check that every rank takes the same
        # slot with the same map geometry (the header names the slot, the kernel's row stride
        # is the map width).
        slot = st.outputs.free_slot()
        top = self._max_over_ranks([nbytes, slot, -slot, st.map_width, -st.map_width])
        if top[1] != -top[2] or top[3] != -top[4]:
            raise RuntimeError(
                "empty_output: ranks disagree on the output slot or on NativeConfig.map_entries "
                "(every rank must allocate and free its outputs in the same order, with one config)"
            )
        if slot < 0:
            raise RuntimeError(
                f"magi_comm native: {len(st.outputs.tensors)} symmetric outputs are alive "
                f"(NativeConfig.max_outputs); free some with free_output first"
            )
        return st.outputs.allocate(top[0], slot, shape, dtype)

    def free_output(self, tensor: torch.Tensor) -> None:
        """Collective: free a tensor from :meth:`empty_output` (every rank passes its own, of
        the same allocation)."""
        outputs = self._require().outputs
        a = outputs.index(tensor)
        if a is not None and tensor.data_ptr() != outputs.spans[a][0]:
            a = None
        a = -1 if a is None else a
        top = self._max_over_ranks([a, -a])  # every rank reaches the check, none hangs
        if a < 0:
            raise ValueError("free_output: tensor is not a tensor returned by empty_output (or was freed)")
        if top[0] != -top[1]:
            raise RuntimeError("free_output: ranks passed tensors of different allocations")
        outputs.free(a)

    def _max_over_ranks(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over the group (host-blocking)."""
        dist = self._platform.dist
        t = torch.tensor(values, dtype=torch.int64, device=self._require().device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def reserve(self, nbytes: int) -> None:
        """Collective: make the symmetric receive buffer at least ``nbytes`` bytes."""
        st = self._require()
        if nbytes > st.capacity:
            st.grow(nbytes)

    def reserve_rows(self, rows_per_peer: int, row_bytes: int) -> None:
        """Collective: regions of at least ``rows_per_peer`` rows of ``row_bytes`` bytes (one
        round for calls that move no more between two ranks; see
        :meth:`magi_comm.GroupCollective.reserve_rows`)."""
        st = self._require()
        needed = bytes_needed(self.world_size, (row_bytes,), rows_per_peer)
        if needed <= st.capacity:
            return
        # the heap also holds the symmetric outputs (the partial buffers among them) and the
        # signal areas, and NVSHMEM may fragment: half of it at most, and beside the outputs held
        # now and the buffer itself (the free space it leaves may lie between outputs) 64 MiB
        # left; whole MiB
        heap = st.rt.heap_bytes
        held = sum(end - start for start, end in st.outputs.spans.values())
        room = min(heap // 2, heap - held - st.capacity - 64 * MIB) // MIB * MIB
        new = reserved_capacity(needed, room)
        key = (rows_per_peer, row_bytes)
        if not new and key in self._refused:
            return  # refused before (and logged): no collective, every call of a step asks again
        # the size is a collective's: ranks whose heaps or outputs differed would allocate
        # different buffers, a silent corruption; a host all-reduce per growth or refusal
        agreed = self._max_over_ranks([new, -new])
        if agreed[0] != -agreed[1]:
            raise RuntimeError(
                f"reserve_rows: ranks sized the receive buffer differently ({-agreed[1]} to "
                f"{agreed[0]} bytes; 0: refused): their symmetric heaps ($NVSHMEM_SYMMETRIC_SIZE) "
                "or outputs differ"
            )
        if not new:
            self._refused.add(key)
            logger.info(
                "magi_comm native: %d rows of %d bytes per peer would need a receive buffer of "
                "%.0f MiB, more than the %.0f MiB the %.0f MiB symmetric heap leaves it: such "
                "calls move in rounds (a larger $NVSHMEM_SYMMETRIC_SIZE or $%s avoids them)",
                rows_per_peer,
                row_bytes,
                needed / MIB,
                room / MIB,
                heap / MIB,
                ENV_BUFFER_MB,
            )
            return
        st.grow(needed, new)

    @property
    def capacity(self) -> int:
        """Bytes of the symmetric receive buffer."""
        return self._require().capacity

    # ---- collectives -----------------------------------------------------------------------

    def group_cast(
        self, input: torch.Tensor, output: torch.Tensor, plan: CastPlan, async_op: bool
    ) -> GroupCollectiveWork:
        """Cast ``input`` ``(N_in, *row)`` rows into ``output`` ``(N_out, *row)`` (any dtype)."""
        self._check_device(input, output)
        plain = input.is_contiguous() and output.is_contiguous()  # then no torch op runs in the body
        body = partial(self._cast.run, input, output, plan)
        return self._run((input, output), body, output, async_op, torch_ops=not plain)

    def group_reduce(
        self,
        input: torch.Tensor,
        output: torch.Tensor,
        plan: ReducePlan,
        async_op: bool,
        reduce_op: str,
        input_lse: torch.Tensor | None,
        output_lse: torch.Tensor | None,
        acc_reduce: bool,
    ) -> GroupCollectiveWork:
        """Reduce ``input`` ``(N_in, *row)`` rows into ``output`` ``(N_out, *row)`` (float dtypes);
        for ``"lse"`` also ``input_lse`` ``(N_in, heads)`` into ``output_lse`` ``(N_out, heads)``."""
        self._check_device(input, output, input_lse, output_lse)
        self._require()
        R = self._reduce.fused_rows(plan, input, row_bytes(input), reduce_op)
        if R:
            body = partial(self._reduce.fused, plan, input, output, R, reduce_op, acc_reduce)
        else:
            body = partial(
                self._reduce.staged, plan, input, output, reduce_op, input_lse, output_lse, acc_reduce
            )
        plain = bool(R) and input.is_contiguous() and output.is_contiguous()
        return self._run((input, output, input_lse, output_lse), body, output, async_op, torch_ops=not plain)

    def _agree_on_fused_reduce(self, state: GroupState, created: bool) -> None:
        """Whether this rank's reduces on a 2-rank group may take one launch (``state.fused_alike``,
        read by ``ReducePath.one_launch``): only where both ranks take the fused reduction alike,
        so that a rank that takes it knows its peer accepts pulls (docs/native.md, "One launch on
        2 ranks"). The backend that creates the group's state (a collective construction: its
        symmetric memory) compares ``fused_reduce`` over the ranks (one host all-reduce); a later
        backend of the group whose ``fused_reduce`` differs from it turns one launch off on this
        rank (no collective: a program that creates its backends alike on every rank turns it
        off everywhere)."""
        if self.world_size != 2:
            return
        fused = int(self.config.fused_reduce)
        if created:
            top = self._max_over_ranks([fused, -fused])
            state.fused_alike = bool(fused) and top[0] == -top[1]
        elif bool(fused) != state.config.fused_reduce:
            state.fused_alike = False

    def _check_device(self, *tensors) -> None:
        dev = self._require().device
        for t in tensors:
            if t is not None and t.device != dev:
                raise ValueError(f"magi_comm native backend: tensors must be on {dev}, got one on {t.device}")

    def _run(self, tensors, body, output, async_op: bool, torch_ops: bool = True) -> GroupCollectiveWork:
        """Run ``body`` on the group stream, after the caller's stream; the handle's wait orders
        the caller's stream after it. ``torch_ops``: the body runs torch ops (they need the group
        stream as the current one; the kernel launches and signals name it explicitly)."""
        st, cuda = self._require(), self._platform.cuda
        st.stream.wait_stream(cuda.current_stream(st.device.index))
        if torch_ops:
            with st.on_stream(), torch.no_grad():
                keep = body()
        else:
            keep = body()
        event = cuda.Event()
        event.record(st.stream)
        for t in tensors:
            if t is not None:
                self._platform.record_stream(t, st.stream)
        work = _EventWork(cuda, event, st.device.index)
        handle = GroupCollectiveWork(output, [work], None, keepalive=keep)
        if not async_op:
            handle.wait()
        return handle
