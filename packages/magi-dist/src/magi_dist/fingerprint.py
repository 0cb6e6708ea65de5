"""The cross-rank key check: every rank of a group holds the same key before the first data collective.

Each rank builds its key from its own arguments. Where they differ (``num_heads_kv``,
``cu_seqlens``, the config, ...) the ranks would plan different collectives: gloo aborts, NCCL
waits until its timeout, or the result is silently wrong. So the first collective use of a key
object (`check_key`, called by ``calc_attn``, ``undispatch`` and ``dispatch``'s backward)
all-gathers a small fingerprint of its fields, one int64 vector per rank, and every rank raises
the same ``ValueError`` naming the fields that differ and each rank's value.

Once per key object: the flag lives on the object, not in the runtime cache, so whether the
check runs depends only on the calls the ranks make (the same on every rank), never on what a
rank's cache holds; and later calls with the same object make no collective for it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from array import array
from importlib import metadata

import torch
import torch.distributed as dist

from magi_dist.key import DistAttnRuntimeKey

__all__ = ["check_key", "key_fingerprint"]

# First entry of every fingerprint: a peer that meets this all-gather from another call (of the
# same size) shows up as a mismatch here instead of as a wrong comparison.
_MAGIC = 0x6D6167694B657931  # "magiKey1"
_SCALARS = ("total_seqlen_q", "total_seqlen_k", "num_heads_q", "num_heads_kv", "head_dim", "head_dim_v")
_SEQUENCES = ("q_ranges", "k_ranges", "mask_types", "group_ranks")
_LABELS = {
    "q_ranges": "q_ranges (the slices' query ranges: cu_seqlens_q or q_ranges)",
    "k_ranges": "k_ranges (the slices' key ranges: cu_seqlens_k or k_ranges)",
    "mask_types": "mask_types (attn_mask_type, causal or window_size)",
    "config": "config (dist_attn_config)",
    "versions": "package versions (magi-dist, magi-solver, magi-comm, ffa-kernels)",
}
_PACKAGES = ("magi-dist", "magi-solver", "magi-comm", "ffa-kernels")
_CHECKED = "_fingerprint_checked"


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _flat(values) -> bytes:
    first = next(iter(values), None)
    flat = itertools.chain.from_iterable(values) if isinstance(first, tuple) else values
    return array("q", flat).tobytes()


@functools.cache
def _versions() -> str:
    found = []
    for name in _PACKAGES:
        try:
            found.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name}=?")
    return ",".join(found)


def key_fingerprint(key: DistAttnRuntimeKey) -> tuple[list[int], list[tuple[str, slice]]]:
    """The int64 vector the ranks compare, and which entries hold which field.

    Scalars go in as they are; sequences as (length, 64-bit digest); the config and the
    package versions as a digest. The group object is not in it: the all-gather runs on it.
    """
    values, fields = [_MAGIC], [("magic", slice(0, 1))]

    def add(name: str, *entries: int) -> None:
        fields.append((name, slice(len(values), len(values) + len(entries))))
        values.extend(entries)

    for name in _SCALARS:
        add(name, getattr(key, name))
    for name in _SEQUENCES:
        seq = getattr(key, name)
        add(name, len(seq), _digest(_flat(seq)))
    add("config", _digest(key.config_json.encode()))
    add("versions", _digest(_versions().encode()))
    return values, fields


def _ranks_phrase(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _describe(name: str, rows: list[tuple[int, ...]]) -> str:
    by_value: dict[tuple[int, ...], list[int]] = {}
    for rank, row in enumerate(rows):
        by_value.setdefault(row, []).append(rank)
    parts = []
    for row, ranks in by_value.items():
        if name in _SCALARS:
            shown = str(row[0])
        elif name in _SEQUENCES:
            shown = f"{row[0]} entries, digest {row[1] & (2**64 - 1):016x}"
        else:
            shown = f"digest {row[0] & (2**64 - 1):016x}"
        parts.append(f"{_ranks_phrase(ranks)}: {shown}")
    return f"{_LABELS.get(name, name)} differs: " + "; ".join(parts)


def check_key(key: DistAttnRuntimeKey) -> None:
    """Check, once per key object, that every rank of ``key.group`` holds an equal key.

    Collective over the group on the first call for this object (an all-gather of a few int64),
    nothing afterwards or on one rank. Call it on every rank, before the key's first data
    collective.

    Raises:
        ValueError on every rank, naming each field that differs and every rank's value.
    """
    if key.__dict__.get(_CHECKED) or key.cp_size == 1:
        return
    group = key.group
    if dist.get_rank(group) < 0:  # a collective on a group without this process would never end
        raise ValueError("key: made for a process group this process is not a member of")
    values, fields = key_fingerprint(key)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(key.cp_size)]
    dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).cpu().tolist()
    differ = [(name, at) for name, at in fields if any(r[at] != rows[0][at] for r in rows)]
    if differ:
        if differ[0][0] == "magic":
            raise ValueError(
                "magi_dist: the key check met a different collective on some ranks: the ranks did "
                "not call calc_attn/undispatch with this key in the same order"
            )
        details = "; ".join(_describe(name, [tuple(r[at]) for r in rows]) for name, at in differ)
        raise ValueError(
            f"magi_dist: the ranks of the group built different keys (every rank raises this): "
            f"{details}. Build the key from the same arguments on every rank."
        )
    object.__setattr__(key, _CHECKED, True)
