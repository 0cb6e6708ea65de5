"""GroupCast / GroupReduce collectives with zero redundancy (all-to-all-v and NVSHMEM backends).

Quick use (every rank of the group calls collectively)::

    import magi_comm
    work = magi_comm.group_cast(x, out, in_splits, out_splits, dst_indices, src_index, group)
    work.wait()                                   # returns `out`
    magi_comm.group_reduce(dx, grad, in_splits, out_splits, dst_index, src_indices, group,
                           reduce_op="sum")       # finished work (async_op=False)

Semantics are fixed by docs/api.md (magi_comm section). Environment variables:
``MAGI_COMM_BACKEND`` (``a2av`` default, or ``native``: NVSHMEM, one node) and ``MAGI_COMM_DEBUG=1`` (check
across ranks that the split arguments of every call fit together).
"""

from ._debug import ENV_DEBUG, PlanMismatchError
from ._plan import CastPlan, ReducePlan, build_cast_plan, build_reduce_plan
from ._reduce import REDUCE_OPS
from .backends import (
    ENV_BACKEND,
    BackendUnavailableError,
    CommBackend,
    available_backends,
    register_backend,
)
from .collective import (
    GroupCollective,
    close_default_collectives,
    get_group_collective,
    group_cast,
    group_reduce,
)
from .work import GroupCollectiveWork

__version__ = "0.1.0"

__all__ = [
    "ENV_BACKEND",
    "ENV_DEBUG",
    "REDUCE_OPS",
    "BackendUnavailableError",
    "CastPlan",
    "CommBackend",
    "GroupCollective",
    "GroupCollectiveWork",
    "PlanMismatchError",
    "ReducePlan",
    "available_backends",
    "build_cast_plan",
    "build_reduce_plan",
    "close_default_collectives",
    "get_group_collective",
    "group_cast",
    "group_reduce",
    "register_backend",
]
