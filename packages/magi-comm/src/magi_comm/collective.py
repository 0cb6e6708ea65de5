"""GroupCast / GroupReduce front end: validation, plan cache, backend dispatch, lifecycle."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._debug import check_plans_agree, debug_enabled
from ._plan import CastPlan, ReducePlan, build_cast_plan, build_reduce_plan, check_split_sums
from ._reduce import REDUCE_OPS
from .backends import CommBackend, create_backend, resolve_backend_name
from .work import GroupCollectiveWork

__all__ = [
    "GroupCollective",
    "close_default_collectives",
    "get_group_collective",
    "group_cast",
    "group_reduce",
]

logger = logging.getLogger(__name__)

_DEFAULT_PLAN_CACHE_SIZE = 1024


# --------------------------------------------------------------------------------------------
# argument helpers


def _freeze(x) -> tuple:
    """Hashable form of a list of ints (a 1-D tensor is accepted too)."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    return tuple(x)


def _freeze2(x) -> tuple:
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    return tuple(_freeze(r) for r in x)


def _flag(name: str, value) -> bool:
    """A real bool (``acc_reduce="no"`` must not silently mean True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def _check_tensor_pair(op: str, input, output) -> None:
    for name, t in (("input", input), ("output", output)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{op}: {name} must have a row dimension (dim 0), got a 0-d tensor")
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: output.dtype ({output.dtype}) != input.dtype ({input.dtype})")
    if output.device != input.device:
        raise ValueError(f"{op}: output.device ({output.device}) != input.device ({input.device})")
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"{op}: rows of input and output differ: input.shape = {tuple(input.shape)}, "
            f"output.shape = {tuple(output.shape)} (all dims but the first must match)"
        )


def _check_rows(op: str, plan, input: torch.Tensor, output: torch.Tensor) -> None:
    # A cached plan was validated against the lists only; the tensors may differ per call.
    check_split_sums(op, plan.num_input_rows, plan.num_output_rows, input.shape[0], output.shape[0])


def _check_reduce_args(op, input, output, reduce_op, input_lse, output_lse) -> None:
    if not isinstance(reduce_op, str) or reduce_op not in REDUCE_OPS:
        raise ValueError(f"{op}: unknown reduce_op {reduce_op!r}; expected one of {', '.join(REDUCE_OPS)}")
    if not input.is_floating_point():
        raise TypeError(f"{op}: reductions need a floating-point dtype, got input.dtype = {input.dtype}")
    if reduce_op != "lse":
        for name, t in (("input_lse", input_lse), ("output_lse", output_lse)):
            if t is not None:
                raise ValueError(
                    f"{op}: {name} is only used with reduce_op='lse', got reduce_op={reduce_op!r}"
                )
        return
    for name, t, data in (("input_lse", input_lse, input), ("output_lse", output_lse, output)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{op}: reduce_op='lse' needs {name} as a (rows, heads) tensor, got {type(t).__name__}"
            )
        dname = name.removesuffix("_lse")
        if data.dim() < 2:
            raise ValueError(
                f"{op}: reduce_op='lse' needs {dname} of shape (rows, heads, ...), got {tuple(data.shape)}"
            )
        if t.shape != data.shape[:2]:
            raise ValueError(
                f"{op}: {name}.shape = {tuple(t.shape)} must be {dname}.shape[:2] = {tuple(data.shape[:2])}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
        if t.device != data.device:
            raise ValueError(f"{op}: {name}.device ({t.device}) != {dname}.device ({data.device})")
    if input_lse.dtype != output_lse.dtype:
        raise TypeError(f"{op}: output_lse.dtype ({output_lse.dtype}) != input_lse.dtype ({input_lse.dtype})")


# --------------------------------------------------------------------------------------------


class GroupCollective:
    """GroupCast / GroupReduce over one process group, with its backend and plan cache.

    Args:
        group: a torch.distributed process group; ``None`` = the default (WORLD) group.
            Ranks in all split arguments are ranks *within this group*.
        backend: ``"a2av"`` or ``"native"``; ``None`` reads ``$MAGI_COMM_BACKEND``
            (default ``"a2av"``).
        plan_cache_size: how many distinct split layouts to keep (LRU).

    Use as a context manager or call :meth:`close` to release the backend (a native backend
    owns symmetric buffers that must be freed collectively). Timeouts are those of the process
    group (``init_process_group(..., timeout=...)`` / ``new_group(timeout=...)``);
    :meth:`GroupCollectiveWork.wait` also accepts one.
    """

    def __init__(
        self, group=None, backend: str | None = None, *, plan_cache_size: int = _DEFAULT_PLAN_CACHE_SIZE
    ):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "magi_comm: torch.distributed is not initialized; call init_process_group first"
            )
        group = dist.group.WORLD if group is None else group
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("magi_comm: this process is not a member of the given group")
        world_size = dist.get_world_size(group)
        name = resolve_backend_name(backend)
        self._setup(
            group, rank, world_size, name, create_backend(name, group, rank, world_size), plan_cache_size
        )

    def _setup(
        self, group, rank: int, world_size: int, name: str, backend: CommBackend, cache_size: int
    ) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.backend_name = name
        self._backend: CommBackend | None = backend
        self._plans: OrderedDict = OrderedDict()
        self._plan_cache_size = cache_size
        self._lock = threading.Lock()
        logger.debug("GroupCollective(rank %d/%d, backend %r) created", rank, world_size, name)

    @classmethod
    def _over_backend(cls, backend: CommBackend, group, rank: int, world_size: int) -> GroupCollective:
        """A collective over an existing ``backend`` object, without torch.distributed's group
        queries (the native backend's fake world, ``magi_comm.testing.native_fake``, runs its
        ranks as threads of one process)."""
        gc = cls.__new__(cls)
        gc._setup(group, rank, world_size, backend.name, backend, _DEFAULT_PLAN_CACHE_SIZE)
        return gc

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._backend is None

    def close(self) -> None:
        """Release the backend and the cached plans (idempotent)."""
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()
        self._plans.clear()

    def __enter__(self) -> GroupCollective:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"GroupCollective(rank={self.rank}, world_size={self.world_size}, "
            f"backend={self.backend_name!r}, {state})"
        )

    def _require_backend(self) -> CommBackend:
        if self._backend is None:
            raise RuntimeError("magi_comm: this GroupCollective is closed")
        return self._backend

    # ---- outputs ---------------------------------------------------------------------------

    @property
    def symmetric_outputs(self) -> bool:
        """Whether :meth:`empty_output` allocates in the backend's symmetric memory (the native
        backend: a group_cast into it skips the receive copy, a group_reduce from it lets
        receivers pull its rows) rather than returning a plain ``torch.empty`` (a2av)."""
        return getattr(self._require_backend(), "empty_output", None) is not None

    def empty_output(
        self, shape, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Collective: an uninitialized ``shape`` / ``dtype`` tensor to receive group_cast rows in
        (or to hold group_reduce input rows).

        With the native backend it lives in the NVSHMEM symmetric heap (on this rank's GPU;
        ``device`` is ignored) and a group_cast into it, or into a contiguous 16-byte aligned
        row range of it, skips the receive copy: peers write the rows straight into it; a
        group_reduce from it (rows of a multiple of 16 bytes, 16-byte aligned) sends nothing
        to receivers that take the fused reduction: they read the rows there. Shapes
        may differ per rank; ranks allocate and free their outputs in the same order. Other
        backends return ``torch.empty(shape, dtype=dtype, device=device)``, where ``device=None``
        means the current CUDA device if the group communicates through NCCL, else the CPU, so
        code written for either backend gets a usable tensor. Release it with
        :meth:`free_output` (collective); the native backend frees what is left when the
        group's last native collective closes.
        """
        backend = self._require_backend()
        make = getattr(backend, "empty_output", None)
        if make is not None:
            return make(shape, dtype)
        if device is None:
            nccl = "nccl" in str(dist.get_backend(self.group)).lower()
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        return torch.empty(shape, dtype=dtype, device=device)

    def free_output(self, tensor: torch.Tensor) -> None:
        """Collective: release a tensor from :meth:`empty_output` (a no-op for plain tensors)."""
        free = getattr(self._require_backend(), "free_output", None)
        if free is not None:
            free(tensor)

    def reserve_rows(self, rows_per_peer: int, row_bytes: int) -> None:
        """Collective (every rank, the same arguments): let one call move up to
        ``rows_per_peer`` rows of ``row_bytes`` bytes between any two ranks in one round.

        The native backend grows its symmetric receive buffer where its per-peer regions hold
        fewer rows (a call that needs more rounds moves them one region at a time, and a
        group_reduce then leaves the fused reduction for its staged path); the growth is a
        collective, so ranks passing different values may hang. Backends without such a buffer
        (a2av) have nothing to reserve. Nothing shrinks: a smaller need keeps the buffer.
        """
        for name, value in (("rows_per_peer", rows_per_peer), ("row_bytes", row_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"reserve_rows: {name} must be an int >= 0, got {value!r}")
        reserve = getattr(self._require_backend(), "reserve_rows", None)
        if reserve is not None and rows_per_peer and row_bytes:
            reserve(rows_per_peer, row_bytes)

    # ---- plans -----------------------------------------------------------------------------

    def _plan(self, kind: str, builder, in_sizes, out_sizes, dst, src, dst_nested: bool, rows=(None, None)):
        try:
            args = (
                _freeze(in_sizes),
                _freeze(out_sizes),
                _freeze2(dst) if dst_nested else _freeze(dst),
                _freeze(src) if dst_nested else _freeze2(src),
            )
            key = (kind, *args)
            with self._lock:  # lookup and LRU touch race with eviction otherwise
                plan = self._plans.get(key)  # TypeError: an unhashable element
                if plan is not None:
                    self._plans.move_to_end(key)
                    return plan
        except TypeError:
            # Malformed arguments: let the builder name the culprit.
            return builder(in_sizes, out_sizes, dst, src, self.rank, self.world_size, *rows)
        plan = builder(*args, self.rank, self.world_size, *rows)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._plan_cache_size:
                self._plans.popitem(last=False)
        logger.debug(
            "%s plan built on rank %d: send %s recv %s", kind, self.rank, plan.send_counts, plan.recv_counts
        )
        return plan

    def cast_plan(
        self, input_split_sizes, output_split_sizes, dst_indices, src_index, _rows=(None, None)
    ) -> CastPlan:
        """The (cached) plan of a group_cast with these arguments; validates them."""
        return self._plan(
            "group_cast",
            build_cast_plan,
            input_split_sizes,
            output_split_sizes,
            dst_indices,
            src_index,
            True,
            _rows,
        )

    def reduce_plan(
        self, input_split_sizes, output_split_sizes, dst_index, src_indices, _rows=(None, None)
    ) -> ReducePlan:
        """The (cached) plan of a group_reduce with these arguments; validates them."""
        return self._plan(
            "group_reduce",
            build_reduce_plan,
            input_split_sizes,
            output_split_sizes,
            dst_index,
            src_indices,
            False,
            _rows,
        )

    # ---- collectives -----------------------------------------------------------------------

    def group_cast(
        self,
        input: torch.Tensor,
        output: torch.Tensor,
        input_split_sizes: Sequence[int],
        output_split_sizes: Sequence[int],
        dst_indices: Sequence[Sequence[int]],
        src_index: Sequence[int],
        async_op: bool = False,
    ) -> GroupCollectiveWork:
        """See :func:`magi_comm.group_cast`."""
        op = "group_cast"
        backend = self._require_backend()
        _check_tensor_pair(op, input, output)
        rows = (input.shape[0], output.shape[0])
        plan = self.cast_plan(input_split_sizes, output_split_sizes, dst_indices, src_index, rows)
        _check_rows(op, plan, input, output)
        if debug_enabled():
            check_plans_agree(op, plan, tuple(input.shape[1:]), input.dtype, self.group, input.device)
        return backend.group_cast(input, output, plan, _flag("async_op", async_op))

    def group_reduce(
        self,
        input: torch.Tensor,
        output: torch.Tensor,
        input_split_sizes: Sequence[int],
        output_split_sizes: Sequence[int],
        dst_index: Sequence[int],
        src_indices: Sequence[Sequence[int]],
        async_op: bool = False,
        reduce_op: str = "sum",
        input_lse: torch.Tensor | None = None,
        output_lse: torch.Tensor | None = None,
        acc_reduce: bool = True,
    ) -> GroupCollectiveWork:
        """See :func:`magi_comm.group_reduce`."""
        op = "group_reduce"
        backend = self._require_backend()
        _check_tensor_pair(op, input, output)
        _check_reduce_args(op, input, output, reduce_op, input_lse, output_lse)
        rows = (input.shape[0], output.shape[0])
        plan = self.reduce_plan(input_split_sizes, output_split_sizes, dst_index, src_indices, rows)
        _check_rows(op, plan, input, output)
        if debug_enabled():
            check_plans_agree(
                op, plan, tuple(input.shape[1:]), input.dtype, self.group, input.device, reduce_op=reduce_op
            )
        return backend.group_reduce(
            input,
            output,
            plan,
            _flag("async_op", async_op),
            reduce_op,
            input_lse,
            output_lse,
            _flag("acc_reduce", acc_reduce),
        )


# --------------------------------------------------------------------------------------------
# per-group default instances used by the module-level functions

_defaults: dict = {}
_defaults_lock = threading.Lock()


def get_group_collective(group=None, backend: str | None = None) -> GroupCollective:
    """The shared :class:`GroupCollective` of ``(group, backend)``, created on first use."""
    name = resolve_backend_name(backend)
    g = dist.group.WORLD if group is None else group
    with _defaults_lock:
        gc = _defaults.get((g, name))
        if gc is None or gc.closed:
            gc = GroupCollective(g, name)
            _defaults[(g, name)] = gc
    return gc


def close_default_collectives() -> None:
    """Close and forget every default instance (e.g. before ``destroy_process_group``)."""
    with _defaults_lock:
        items = list(_defaults.values())
        _defaults.clear()
    for gc in items:
        gc.close()


def group_cast(
    input: torch.Tensor,
    output: torch.Tensor,
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    dst_indices: Sequence[Sequence[int]],
    src_index: Sequence[int],
    group=None,
    async_op: bool = False,
    *,
    backend: str | None = None,
) -> GroupCollectiveWork:
    """GroupCast: send each input split to a set of ranks; fill output splits from one rank each.

    Args:
        input: ``(N_in, *row)`` tensor of any dtype; rows are split along dim 0.
        output: ``(N_out, *row)`` tensor, same dtype/device/row shape; overwritten entirely.
        input_split_sizes: ``n_in`` non-negative ints summing to ``N_in``.
        output_split_sizes: ``n_out`` non-negative ints summing to ``N_out``.
        dst_indices: ``n_in`` lists of distinct group ranks; split ``i`` goes to every rank in
            ``dst_indices[i]`` (empty: sent nowhere; may contain this rank).
        src_index: ``n_out`` group ranks; output split ``j`` is received from ``src_index[j]``.
        group: process group (None = WORLD). Ranks are group ranks.
        async_op: if True return at once; ``work.wait()`` finishes (and writes ``output``).
            ``input`` need not be kept alive meanwhile: the backends hold what the transfer
            still reads (a2av keeps its send buffer, ``input`` itself or a gathered copy, in the
            handle; native records ``input`` on its stream).
        backend: ``"a2av"`` | ``"native"``; None = ``$MAGI_COMM_BACKEND`` or ``"a2av"``.

    Pairing rule (docs/api.md): for each sender ``s`` and receiver ``d``, the splits ``s`` sends to
    ``d`` in ``s``'s input order fill ``d``'s output splits with source ``s`` in ``d``'s output
    order, one to one, with equal sizes. Every rank of the group must call this collectively.
    ``input`` and ``output`` must not overlap in memory. Not differentiable (no autograd).

    Returns:
        :class:`GroupCollectiveWork`; ``wait()`` returns ``output``. With ``async_op=False`` it
        is already finished.

    Raises:
        ValueError / TypeError (before any communication) naming the bad argument and value;
        :class:`PlanMismatchError` when ``MAGI_COMM_DEBUG=1`` and the ranks' arguments disagree.
    """
    return get_group_collective(group, backend).group_cast(
        input, output, input_split_sizes, output_split_sizes, dst_indices, src_index, async_op
    )


def group_reduce(
    input: torch.Tensor,
    output: torch.Tensor,
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    dst_index: Sequence[int],
    src_indices: Sequence[Sequence[int]],
    group=None,
    async_op: bool = False,
    reduce_op: str = "sum",
    input_lse: torch.Tensor | None = None,
    output_lse: torch.Tensor | None = None,
    acc_reduce: bool = True,
    *,
    backend: str | None = None,
) -> GroupCollectiveWork:
    """GroupReduce, the transpose of group_cast: send splits back and reduce them per output split.

    Args:
        input: ``(N_in, *row)`` floating-point tensor (for ``"lse"``: ``(N_in, heads, D, ...)``).
        output: ``(N_out, *row)``, same dtype/device/row shape; reduced into in place.
        input_split_sizes / output_split_sizes: non-negative ints summing to ``N_in`` / ``N_out``.
        dst_index: ``n_in`` group ranks; input split ``i`` goes to rank ``dst_index[i]``.
        src_indices: ``n_out`` lists of distinct group ranks; output split ``j`` is reduced from
            the splits sent by every rank in ``src_indices[j]`` (pairing as in group_cast).
        group, async_op, backend: as in :func:`group_cast`. With ``async_op`` the reduction
            runs in ``wait()``, so with ``acc_reduce`` the output's content at ``wait()`` time
            (not at the call) takes part: do not write it in between.
        reduce_op:
            ``"sum"``: ``out = [out_old +] sum of contributions``.
            ``"avg"``: that sum divided by the number of terms, i.e. ``len(src_indices[j])``,
            plus 1 when ``acc_reduce`` (the existing output is one term); a row with no term
            (no source, ``acc_reduce=False``) becomes 0.
            ``"lse"``: log-sum-exp merge of partial attention outputs:
            ``lse = log(sum_k exp(lse_k))``, ``out = sum_k exp(lse_k - lse) * out_k``; a term
            with ``lse_k = -inf`` contributes nothing (its rows may hold any value), and a row
            with no finite term gets ``out = 0``, ``lse = -inf`` (never NaN).
        input_lse: float ``(N_in, heads)``, only with ``"lse"``.
        output_lse: float ``(N_out, heads)``, only with ``"lse"``; read when ``acc_reduce`` and
            overwritten with the merged lse.
        acc_reduce: the existing ``output`` (and ``output_lse``) takes part in the reduction;
            with False it is overwritten (a split with no source becomes 0 / -inf).

    Accumulation is in float32 (float64 for float64 data) in a fixed order (existing output
    first, then sources in ascending rank), so results are bitwise deterministic; the result
    is cast back to ``output.dtype``.

    Returns:
        :class:`GroupCollectiveWork`; ``wait()`` performs the reduction and returns ``output``.
    """
    return get_group_collective(group, backend).group_reduce(
        input,
        output,
        input_split_sizes,
        output_split_sizes,
        dst_index,
        src_indices,
        async_op,
        reduce_op,
        input_lse,
        output_lse,
        acc_reduce,
    )
