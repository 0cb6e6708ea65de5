"""The ``a2av`` backend: range-gather -> all_to_all_single -> range-scatter / scatter-reduce.

Works on any torch.distributed backend that implements ``all_to_all_single`` (gloo for CPU
tensors, NCCL for CUDA tensors). A split sent to m ranks is copied m times into the send buffer
(no true multicast); the native backend is meant to remove that redundancy.

Wire dtype: rows are moved as raw bytes through a same-itemsize view (1 byte -> uint8,
2 -> float16, 4 -> int32, 8 -> int64). The transport never does arithmetic, so the bits arrive
unchanged, and this avoids dtype gaps of the transports: gloo's all_to_all rejects int16
("Invalid scalar type", torch 2.13) and older gloo builds lack bfloat16; NCCL has no int16 or
bool. The 2-byte view is float16, not int16, precisely because gloo has no int16.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .._plan import CastPlan, ReducePlan
from .._reduce import reduce_received
from ..work import GroupCollectiveWork
from . import register_backend

__all__ = ["A2AVBackend", "wire_view"]

logger = logging.getLogger(__name__)

_WIRE_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """Zero-copy same-itemsize view of ``t`` used on the wire (see the module docstring)."""
    wire = _WIRE_DTYPES.get(t.element_size())
    if wire is None or wire == t.dtype:
        return t
    return t.view(wire)


class A2AVBackend:
    """all-to-all-v transport over one process group (stateless apart from the group)."""

    name = "a2av"

    def __init__(self, group, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def _what(self, op: str) -> str:
        return f"magi_comm.{op} (a2av backend, rank {self.rank} of {self.world_size})"

    def _all_to_all(self, recv, send, plan, async_op):
        return dist.all_to_all_single(
            wire_view(recv),
            wire_view(send),
            output_split_sizes=list(plan.recv_counts),
            input_split_sizes=list(plan.send_counts),
            group=self.group,
            async_op=async_op,
        )

    @staticmethod
    def _gather(t: torch.Tensor, gather: torch.Tensor | None) -> torch.Tensor:
        # index_select already yields a fresh contiguous buffer; without a permutation the
        # input itself is the send buffer (all_to_all_single needs it contiguous).
        return t.contiguous() if gather is None else t.index_select(0, gather)

    def group_cast(
        self, input: torch.Tensor, output: torch.Tensor, plan: CastPlan, async_op: bool
    ) -> GroupCollectiveWork:
        idx = plan.indices_on(input.device)
        with torch.no_grad():
            send = self._gather(input, idx.gather)
            # When the receive order already is the output order, receive straight into output.
            direct = idx.scatter is None and output.is_contiguous()
            recv = output if direct else output.new_empty((plan.num_recv_rows, *output.shape[1:]))
            work = self._all_to_all(recv, send, plan, async_op)

        def post() -> None:
            if direct:
                return
            if idx.scatter is None:
                output.copy_(recv)
            else:
                output.index_copy_(0, idx.scatter, recv)

        handle = GroupCollectiveWork(output, [work], post, (send, recv), self._what("group_cast"))
        if not async_op:
            handle.wait()
        return handle

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
        idx = plan.indices_on(input.device)
        with torch.no_grad():
            send = self._gather(input, idx.gather)
            recv = output.new_empty((plan.num_recv_rows, *output.shape[1:]))
            works = [self._all_to_all(recv, send, plan, async_op)]
            send_lse = recv_lse = None
            if reduce_op == "lse":
                assert input_lse is not None  # "lse" carries one (checked by the frontend)
                # The lse rides in a second all-to-all with the same split sizes.
                send_lse = self._gather(input_lse, idx.gather)
                recv_lse = input_lse.new_empty((plan.num_recv_rows, *input_lse.shape[1:]))
                works.append(self._all_to_all(recv_lse, send_lse, plan, async_op))

        def post() -> None:
            reduce_received(output, output_lse, recv, recv_lse, idx, reduce_op, acc_reduce)

        handle = GroupCollectiveWork(
            output, works, post, (send, recv, send_lse, recv_lse), self._what("group_reduce")
        )
        if not async_op:
            handle.wait()
        return handle

    def close(self) -> None:
        self.group = None


register_backend("a2av", A2AVBackend)
