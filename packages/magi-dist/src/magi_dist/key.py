"""Runtime keys: a hashable description of one distributed attention problem.

The runtimes themselves (plan, index tensors) and their cache live in ``magi_dist.runtime``;
the cross-rank check that every rank holds the same key, in ``magi_dist.fingerprint``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from magi_solver import AttnMask, AttnRanges, DistAttnConfig, masks


@dataclass(frozen=True)
class DistAttnRuntimeKey:
    """Identifies a plan: the mask, the head geometry, the process group and the config.

    Equal keys share one cached runtime (plan, comm arguments, index tensors). ``group`` (the
    ProcessGroup object, compared by identity) is part of the key: two groups over the same ranks
    give different keys, so a runtime never runs its collectives on another group.
    ``group_ranks`` (global ranks of the group, in group order) is what the ranks compare.
    """

    q_ranges: tuple[tuple[int, int], ...]
    k_ranges: tuple[tuple[int, int], ...]
    mask_types: tuple[int, ...]
    total_seqlen_q: int
    total_seqlen_k: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int  # q's and k's
    head_dim_v: int  # v's (equal to head_dim unless the model gives v its own, e.g. MLA)
    group_ranks: tuple[int, ...]
    config_json: str
    group: Any = field(default=None, repr=False)

    def __hash__(self) -> int:
        # Computed once: a key of 100k slices takes ~2 ms to hash, and every call looks it up.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def cp_size(self) -> int:
        return len(self.group_ranks)

    def mask(self) -> AttnMask:
        return AttnMask(
            list(self.q_ranges),
            list(self.k_ranges),
            list(self.mask_types),
            self.total_seqlen_q,
            self.total_seqlen_k,
        )


def resolve_group(cp_group_or_mesh: Any) -> Any:
    """A ``ProcessGroup``, a 1-D ``DeviceMesh`` or None (the default group) -> a ProcessGroup."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "cp_group_or_mesh: torch.distributed is not initialised (call init_process_group first)"
        )
    if cp_group_or_mesh is None:
        return dist.group.WORLD
    if cp_group_or_mesh is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives non-members
        raise ValueError("cp_group_or_mesh: this process is not a member of the group")
    if hasattr(cp_group_or_mesh, "get_group") and hasattr(cp_group_or_mesh, "ndim"):
        if cp_group_or_mesh.ndim != 1:
            raise ValueError(f"cp_group_or_mesh: expected a 1-D DeviceMesh, got ndim={cp_group_or_mesh.ndim}")
        return cp_group_or_mesh.get_group()
    if isinstance(cp_group_or_mesh, dist.ProcessGroup):
        return cp_group_or_mesh
    raise TypeError(
        f"cp_group_or_mesh: expected a ProcessGroup, a 1-D DeviceMesh or None, got {type(cp_group_or_mesh).__name__}"
    )


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return value


def _make_key(
    mask: AttnMask, num_heads_q, num_heads_kv, head_dim, cp_group_or_mesh, config, head_dim_v=None
) -> DistAttnRuntimeKey:
    hq, hk, d = (
        _positive("num_heads_q", num_heads_q),
        _positive("num_heads_kv", num_heads_kv),
        _positive("head_dim", head_dim),
    )
    dv = d if head_dim_v is None else _positive("head_dim_v", head_dim_v)
    if hq % hk:
        raise ValueError(f"num_heads_q: {hq} is not a multiple of num_heads_kv={hk}")
    if not isinstance(config, DistAttnConfig):
        raise TypeError(f"dist_attn_config: expected a DistAttnConfig, got {type(config).__name__}")
    group = resolve_group(cp_group_or_mesh)
    if dist.get_rank(group) < 0:
        raise ValueError("cp_group_or_mesh: this process is not a member of the group")
    q, k, t = mask.to_lists()
    return DistAttnRuntimeKey(
        q_ranges=tuple(q),
        k_ranges=tuple(k),
        mask_types=tuple(t),
        total_seqlen_q=mask.total_seqlen_q,
        total_seqlen_k=mask.total_seqlen_k,
        num_heads_q=hq,
        num_heads_kv=hk,
        head_dim=d,
        head_dim_v=dv,
        group_ranks=tuple(dist.get_process_group_ranks(group)),
        config_json=config.model_dump_json(),
        group=group,
    )


def magi_attn_flex_key(
    q_ranges: AttnRanges | Sequence[Sequence[int]],
    k_ranges: AttnRanges | Sequence[Sequence[int]],
    attn_mask_type: Any,
    total_seqlen_q: int,
    total_seqlen_k: int,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group_or_mesh: Any,
    dist_attn_config: DistAttnConfig | None = None,
    head_dim_v: int | None = None,
) -> DistAttnRuntimeKey:
    """Key of a mask given as slices (global coordinates; self-attention: totals equal).

    ``attn_mask_type`` is one type for all slices or one per slice (codes, strings or
    ``AttnMaskType``). The plan is made on first use, by each rank alone; the first collective
    use of the key object (``calc_attn``, ``undispatch``) checks that every rank of the group
    built the same key (``magi_dist.fingerprint``). ``head_dim`` is q's and k's head dim;
    ``head_dim_v`` V's (None: the same; e.g. 128 beside ``head_dim`` 192 for MLA-style models).
    """
    mask = AttnMask(q_ranges, k_ranges, attn_mask_type, total_seqlen_q, total_seqlen_k)
    config = DistAttnConfig() if dist_attn_config is None else dist_attn_config
    return _make_key(mask, num_heads_q, num_heads_kv, head_dim, cp_group_or_mesh, config, head_dim_v)


def magi_attn_varlen_key(
    cu_seqlens_q: Sequence[int] | torch.Tensor,
    cu_seqlens_k: Sequence[int] | torch.Tensor,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group_or_mesh: Any,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    dist_attn_config: DistAttnConfig | None = None,
    head_dim_v: int | None = None,
) -> DistAttnRuntimeKey:
    """Key of a packed-documents mask from cumulative lengths (see ``magi_solver.masks.varlen``);
    ``head_dim_v`` as in :func:`magi_attn_flex_key`."""
    mask = masks.varlen(cu_seqlens_q, cu_seqlens_k, causal=causal, window_size=window_size)
    config = DistAttnConfig() if dist_attn_config is None else dist_attn_config
    return _make_key(mask, num_heads_q, num_heads_kv, head_dim, cp_group_or_mesh, config, head_dim_v)
