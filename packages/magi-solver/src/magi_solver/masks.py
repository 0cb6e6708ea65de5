"""Mask builders. Each returns an exact ``AttnMask`` whose slices are disjoint.

Windows follow FlashAttention's convention: ``window_size=(left, right)``, ``-1`` meaning
unbounded, with query ``i`` of a document aligned to key ``i + sk - sq`` (bottom-right, as CAUSAL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from magi_solver.band import Band
from magi_solver.types import AttnMask, AttnMaskType, AttnRanges

__all__ = [
    "block_causal",
    "block_diagonal",
    "causal",
    "from_segment_ids",
    "full",
    "infer_attn_mask_from_cu_seqlens",
    "prefix_lm",
    "shared_question",
    "sliding_window",
    "varlen",
]


class IntArray(Protocol):
    """A 1-D integer array of another library (a torch tensor, a numpy array): read with ``tolist()``."""

    def tolist(self) -> Any: ...


def _cu_seqlens(values: Any, name: str) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    try:
        cu = [int(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a sequence of ints, got {values!r}") from None
    if not cu or cu[0] != 0:
        raise ValueError(f"{name}: must start with 0, got {cu[:4]!r}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"{name}: must be non-decreasing, but {name}[{i}]={cu[i]} < {cu[i - 1]}")
    return cu


def _window(window_size: Any, causal: bool) -> tuple[int | None, int | None]:
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected (left, right), got {window_size!r}") from None
    for w in (left, right):
        if w < -1:
            raise ValueError(f"window_size: entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    left_b = None if left == -1 else left
    right_b = None if right == -1 else right
    if causal:
        right_b = 0 if right_b is None else min(right_b, 0)
    return left_b, right_b


def _doc_bands(
    qs: int, qe: int, ks: int, ke: int, left: int | None, right: int | None, causal: bool, global_window: int
) -> list[Band]:
    """Bands of one document: the window band plus the global keys the window leaves out."""
    off = (ks - qs) + (ke - ks) - (qe - qs)  # k - q on the aligned diagonal
    lo = None if left is None else off - left
    hi = None if right is None else off + right
    bands = [Band(qs, qe, ks, ke, lo, hi)]
    g_end = min(ks + global_window, ke)
    if global_window > 0 and lo is not None:  # global keys left of the window
        bands.append(Band(qs, qe, ks, g_end, None, lo - 1))
    if global_window > 0 and hi is not None and not causal:  # and right of it, where causality allows
        bands.append(Band(qs, qe, ks, g_end, hi + 1, None))
    return [b for b in bands if not b.is_empty()]


def varlen(
    cu_seqlens_q: Sequence[int] | IntArray,
    cu_seqlens_k: Sequence[int] | IntArray | None = None,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    global_window_size: int = 0,
) -> AttnMask:
    """Block-diagonal document mask from cumulative lengths (ints, or a 1-D tensor / array).

    Document ``d`` holds queries ``[cu_q[d], cu_q[d+1])`` and keys ``[cu_k[d], cu_k[d+1])``
    (``cu_seqlens_k`` defaults to ``cu_seqlens_q``). ``causal`` is bottom-right aligned. A window
    keeps keys with ``-left <= j - (i + sk - sq) <= right``; ``global_window_size`` g additionally
    keeps the first g keys of each document visible to all its queries (causality still applies).
    """
    cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_q if cu_seqlens_k is None else _cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if len(cu_k) != len(cu_q):
        raise ValueError(
            f"cu_seqlens_k: has {len(cu_k)} entries but cu_seqlens_q has {len(cu_q)}; they must match"
        )
    if int(global_window_size) < 0:
        raise ValueError(f"global_window_size: must be >= 0, got {global_window_size!r}")
    left, right = _window(window_size, causal)
    bands: list[Band] = []
    for d in range(len(cu_q) - 1):
        bands += _doc_bands(
            cu_q[d], cu_q[d + 1], cu_k[d], cu_k[d + 1], left, right, causal, int(global_window_size)
        )
    return AttnMask.from_bands(bands, cu_q[-1], cu_k[-1])


def infer_attn_mask_from_cu_seqlens(
    cu_seqlens_q: Sequence[int] | IntArray,
    cu_seqlens_k: Sequence[int] | IntArray,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    global_window_size: int = 0,
) -> tuple[AttnRanges, AttnRanges, list[AttnMaskType], int, int]:
    """MagiAttention-compatible: ``(q_ranges, k_ranges, attn_mask_type, total_seqlen_q, total_seqlen_k)``."""
    m = varlen(
        cu_seqlens_q,
        cu_seqlens_k,
        causal=causal,
        window_size=window_size,
        global_window_size=global_window_size,
    )
    return m.q_ranges, m.k_ranges, list(m.mask_types), m.total_seqlen_q, m.total_seqlen_k


def full(seqlen_q: int, seqlen_k: int | None = None) -> AttnMask:
    """Every query sees every key."""
    return varlen([0, seqlen_q], [0, seqlen_q if seqlen_k is None else seqlen_k])


def causal(seqlen_q: int, seqlen_k: int | None = None) -> AttnMask:
    """Bottom-right aligned causal mask."""
    return varlen([0, seqlen_q], [0, seqlen_q if seqlen_k is None else seqlen_k], causal=True)


def sliding_window(
    seqlen: int, window_size: tuple[int, int], *, causal: bool = False, seqlen_k: int | None = None
) -> AttnMask:
    """Band mask ``-left <= j - (i + sk - sq) <= right`` built from the four slice types."""
    return varlen(
        [0, seqlen], [0, seqlen if seqlen_k is None else seqlen_k], causal=causal, window_size=window_size
    )


def from_segment_ids(
    segment_ids: Sequence[int],
    *,
    causal: bool = False,
    kv_segment_ids: Sequence[int] | None = None,
    pad_id: int | None = None,
) -> AttnMask:
    """Kvax-style document mask: query ``i`` sees key ``j`` iff ``seg_q[i] == seg_k[j]`` (and ``j <= i``
    when ``causal``, by absolute position). Tokens whose id is ``pad_id`` see and are seen by nothing.
    A segment id may recur in several runs; all runs of one id see each other.
    """
    q_ids = _ids(segment_ids, "segment_ids")
    k_ids = q_ids if kv_segment_ids is None else _ids(kv_segment_ids, "kv_segment_ids")
    q_runs, k_runs = _runs(q_ids, pad_id), _runs(k_ids, pad_id)
    bands: list[Band] = []
    for seg, qrs in q_runs.items():
        for qs, qe in qrs:
            for ks, ke in k_runs.get(seg, []):
                b = Band(qs, qe, ks, ke, None, 0 if causal else None)
                if not b.is_empty():
                    bands.append(b)
    return AttnMask.from_bands(bands, len(q_ids), len(k_ids))


def _ids(values: Any, name: str) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a sequence of ints, got {values!r}") from None


def _runs(ids: list[int], pad_id: int | None) -> dict[int, list[tuple[int, int]]]:
    runs: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            if ids[start] != pad_id:
                runs.setdefault(ids[start], []).append((start, i))
            start = i
    return runs


def block_causal(
    cu_seqlens: Sequence[int],
    block_size: int | None = None,
    *,
    cu_blocks: Sequence[int] | None = None,
) -> AttnMask:
    """Varlen block-causal (video): within a document, a query of block ``b`` sees every key of
    blocks ``0..b`` (full inside a block, causal between blocks). Blocks are ``block_size`` tokens
    from each document's start (the last one shorter), or given by ``cu_blocks`` (block boundaries,
    which must include every document boundary)."""
    cu = _cu_seqlens(cu_seqlens, "cu_seqlens")
    if (block_size is None) == (cu_blocks is None):
        raise ValueError("block_size/cu_blocks: give exactly one of them")
    if block_size is not None:
        if int(block_size) <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size!r}")
        bounds = sorted({*cu, *(p for s, e in zip(cu, cu[1:]) for p in range(s, e, int(block_size)))})
    else:
        bounds = _cu_seqlens(cu_blocks, "cu_blocks")
        if bounds[-1] != cu[-1] or not set(cu) <= set(bounds):
            raise ValueError("cu_blocks: must end at cu_seqlens[-1] and contain every document boundary")
    doc_start = dict.fromkeys(cu)
    q_ranges, k_ranges = [], []
    start = 0
    for s, e in zip(bounds, bounds[1:]):
        if s in doc_start:
            start = s
        if e > s:
            q_ranges.append((s, e))
            k_ranges.append((start, e))
    return AttnMask(q_ranges, k_ranges, AttnMaskType.FULL, cu[-1], cu[-1])


def prefix_lm(cu_seqlens: Sequence[int], prefix_lens: int | Sequence[int]) -> AttnMask:
    """Prefix-LM per document: the first ``p`` tokens see each other fully; later tokens are causal
    over the whole document (they see the prefix and earlier tokens)."""
    cu = _cu_seqlens(cu_seqlens, "cu_seqlens")
    n = len(cu) - 1
    prefixes = [int(prefix_lens)] * n if isinstance(prefix_lens, int) else [int(p) for p in prefix_lens]
    if len(prefixes) != n:
        raise ValueError(f"prefix_lens: has {len(prefixes)} entries for {n} documents")
    q, k, t = [], [], []
    for (s, e), p in zip(zip(cu, cu[1:]), prefixes):
        if p < 0:
            raise ValueError(f"prefix_lens: must be >= 0, got {p}")
        p = min(p, e - s)
        if p > 0:
            q.append((s, s + p))
            k.append((s, s + p))
            t.append(AttnMaskType.FULL)
        if s + p < e:
            q.append((s + p, e))
            k.append((s, e))
            t.append(AttnMaskType.CAUSAL)
    return AttnMask(q, k, t, cu[-1], cu[-1])


def shared_question(question_len: int, answer_lens: Sequence[int]) -> AttnMask:
    """Shared-question packing ``[Q, A1, A2, ...]``: Q is causal over itself; each answer sees all of
    Q and is causal over itself; answers never see each other."""
    if int(question_len) < 0:
        raise ValueError(f"question_len: must be >= 0, got {question_len!r}")
    q, k, t = [], [], []
    if question_len > 0:
        q.append((0, question_len))
        k.append((0, question_len))
        t.append(AttnMaskType.CAUSAL)
    pos = question_len
    for i, a in enumerate(answer_lens):
        if int(a) < 0:
            raise ValueError(f"answer_lens[{i}]: must be >= 0, got {a!r}")
        if a == 0:
            continue
        if question_len > 0:
            q.append((pos, pos + a))
            k.append((0, question_len))
            t.append(AttnMaskType.FULL)
        q.append((pos, pos + a))
        k.append((pos, pos + a))
        t.append(AttnMaskType.CAUSAL)
        pos += a
    return AttnMask(q, k, t, pos, pos)


def block_diagonal(masks: Sequence[AttnMask]) -> AttnMask:
    """Place masks one after another along both axes (e.g. several shared-question samples)."""
    q, k, t = [], [], []
    oq = ok = 0
    for m in masks:
        for qr, kr, mt in zip(m.q_ranges, m.k_ranges, m.mask_types):
            q.append((qr.start + oq, qr.end + oq))
            k.append((kr.start + ok, kr.end + ok))
            t.append(mt)
        oq += m.total_seqlen_q
        ok += m.total_seqlen_k
    return AttnMask(q, k, t, oq, ok)
