"""Debug mode (``MAGI_COMM_DEBUG=1``): check across ranks that the plans of one call agree.

Without it, ranks that disagree on split sizes make the all-to-all fail obscurely, hang until
the process-group timeout, or silently misplace rows. With it, every call first all-gathers a
small int64 signature per rank (call kind, dtype, row shape, and for every peer the rows /
number of splits / hash of split sizes it sends and expects) and checks that what rank ``s``
sends to rank ``d`` is exactly what ``d`` expects from ``s``. All ranks see the same gathered
table, so they all raise together instead of leaving some of them blocked.
"""

from __future__ import annotations

import logging
import math
import os
import zlib

import torch
import torch.distributed as dist

from ._plan import _PlanBase

__all__ = ["ENV_DEBUG", "PlanMismatchError", "check_plans_agree", "debug_enabled"]

logger = logging.getLogger(__name__)

ENV_DEBUG = "MAGI_COMM_DEBUG"
_OPS = ("group_cast", "group_reduce")
_REDUCE_OPS = ("none", "sum", "avg", "lse")
_HEADER = 5  # op, reduce_op, dtype code, row numel, row shape code
_PER_PEER = 6  # send rows, send splits, send hash, recv rows, recv splits, recv hash


class PlanMismatchError(ValueError):
    """The ranks passed split arguments that do not fit together (debug mode only)."""


def debug_enabled() -> bool:
    return os.environ.get(ENV_DEBUG, "0").strip().lower() not in ("", "0", "false", "no", "off")


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def check_plans_agree(
    op: str,
    plan: _PlanBase,
    row_shape: tuple[int, ...],
    dtype: torch.dtype,
    group,
    device: torch.device,
    reduce_op: str | None = None,
) -> None:
    """All-gather the plan signatures and raise :class:`PlanMismatchError` on disagreement."""
    world = plan.world_size
    vec = [
        _OPS.index(op),
        _REDUCE_OPS.index(reduce_op or "none"),
        _code(str(dtype)),
        math.prod(row_shape),
        _code(str(tuple(row_shape))),
    ]
    for d in range(world):
        snd, rcv = plan.send_signatures[d], plan.recv_signatures[d]
        vec += [snd.rows, snd.num_splits, snd.sizes_hash, rcv.rows, rcv.num_splits, rcv.sizes_hash]
    mine = torch.tensor(vec, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu().tolist()

    problems = []
    for r in range(1, world):
        if table[r][:_HEADER] != table[0][:_HEADER]:
            a, b = table[0], table[r]
            problems.append(
                f"rank {r} calls {_OPS[b[0]]}(reduce_op={_REDUCE_OPS[b[1]]}) with rows of {b[3]} elements "
                f"(shape/dtype codes {b[4]}/{b[2]}) while rank 0 calls {_OPS[a[0]]}"
                f"(reduce_op={_REDUCE_OPS[a[1]]}) with rows of {a[3]} elements (codes {a[4]}/{a[2]})"
            )
    for s in range(world):
        for d in range(world):
            so = _HEADER + _PER_PEER * d
            ro = _HEADER + _PER_PEER * s + 3
            sent, expected = table[s][so : so + 3], table[d][ro : ro + 3]
            if sent != expected:
                problems.append(
                    f"rank {s} sends rank {d} {sent[0]} rows in {sent[1]} splits, but rank {d} expects "
                    f"{expected[0]} rows in {expected[1]} splits from rank {s}"
                    + (" (same totals, different split sizes)" if sent[:2] == expected[:2] else "")
                )
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise PlanMismatchError(
            f"{op}: the ranks' split arguments do not fit together "
            f"(checked because {ENV_DEBUG}=1; this is rank {plan.rank}):\n  {shown}{more}"
        )
    logger.debug("%s: plans agree across %d ranks", op, world)
