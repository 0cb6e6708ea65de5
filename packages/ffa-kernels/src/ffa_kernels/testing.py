"""Test helpers: a brute-force dense oracle and a random slice generator (small sizes only).

The oracle is written independently of the reference backend (no shared mask code): it builds
the dense ``(Tq, Tk)`` mask straight from the docs/api.md condition and runs a plain softmax, so it
can check the backend. It materialises ``Hq x Tq x Tk`` and is differentiable with
torch.autograd; pass float64 tensors for a tight comparison. Other packages (magi-dist) may use
it as their ground truth too.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import _frontend
from .reference import masks as _masks

__all__ = [
    "PackedBlock",
    "Problem",
    "block_causal_slices",
    "dense_attention",
    "dense_mask",
    "grid_slices",
    "is_sm90",
    "preprocess_launches",
    "random_disjoint_slices",
    "random_problem",
    "segment_id_slices",
    "sliding_window_slices",
    "tile_config",
    "varlen_slices",
]

RangesLike = torch.Tensor | Sequence[Sequence[int]]


def is_sm90() -> bool:
    """Whether a CUDA device of compute capability 9.x (the sm90 kernels' target) is present:
    the skip condition of the GPU tests that run the kernels."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _as_list(x: RangesLike | Sequence[int] | None) -> list:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return [list(r) if isinstance(r, Sequence) else int(r) for r in x]


def dense_mask(
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: torch.Tensor | Sequence[int] | None,
    total_q: int,
    total_k: int,
    *,
    counts: bool = False,
) -> torch.Tensor:
    """Dense mask ``(total_q, total_k)`` of a slice set, from the docs/api.md condition.

    With ``counts=True`` it returns int64 coverage counts instead of bools (a value > 1 means
    two slices cover the same cell, which a call must not do).
    """
    qr, kr = _as_list(q_ranges), _as_list(k_ranges)
    types = _as_list(attn_type_map) if attn_type_map is not None else [0] * len(qr)
    cover = torch.zeros(total_q, total_k, dtype=torch.int64)
    for (qs, qe), (ks, ke), t in zip(qr, kr, types):
        q = torch.arange(total_q).view(-1, 1)
        k = torch.arange(total_k).view(1, -1)
        i, j = q - qs, k - ks
        sq, sk = qe - qs, ke - ks
        m = (q >= qs) & (q < qe) & (k >= ks) & (k < ke)
        if t in (1, 3):  # CAUSAL, bottom-right aligned
            m = m & (j <= i + (sk - sq))
        if t in (2, 3):  # INVCAUSAL, top-left aligned
            m = m & (j >= i)
        cover += m.to(torch.int64)
    return cover if counts else cover > 0


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: torch.Tensor | Sequence[int] | None = None,
    *,
    sink: torch.Tensor | None = None,
    sink_layout: str = "sh",
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Brute-force flexible-mask attention, differentiable in q, k, v and sink.

    Same arguments as `ffa_kernels.flex_flash_attn_func`; computes in the dtype of q (use
    float64). Returns ``(out (Tq, Hq, Dv), lse (Tq, Hq), max_logits (Hq,))``, all in q's dtype
    (Dv: v's head dim, which may differ from q's and k's D).
    """
    tq, hq, d = q.shape
    tk, hk, _ = k.shape
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    mask = dense_mask(q_ranges, k_ranges, attn_type_map, tq, tk).to(q.device)
    g = hq // hk
    kk = k.repeat_interleave(g, dim=1)  # q head h -> kv head h // g
    vv = v.repeat_interleave(g, dim=1)
    raw = scale * torch.einsum("qhd,khd->hqk", q, kk)  # (Hq, Tq, Tk)
    neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
    max_logits = torch.where(mask, raw.detach(), neg_inf).reshape(hq, -1)
    max_logits = (
        max_logits.amax(-1)
        if max_logits.shape[1]
        else torch.full((hq,), float("-inf"), dtype=q.dtype, device=q.device)
    )
    s = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    # A huge finite value instead of -inf for hidden cells keeps autograd free of NaN; rows with
    # no covered key are zeroed / set to -inf explicitly below.
    very_negative = torch.finfo(q.dtype).min / 4
    s = torch.where(mask, s, torch.tensor(very_negative, dtype=q.dtype, device=q.device))
    logits = s
    if sink is not None:
        z = sink.to(q.dtype)
        z = z.t().unsqueeze(1).expand(hq, tq, z.shape[0]) if sink_layout == "sh" else z.permute(2, 0, 1)
        logits = torch.cat([s, z], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)  # (Hq, Tq)
    p = torch.exp(s - lse.unsqueeze(-1))
    has_key = mask.any(dim=-1)  # (Tq,)
    out = torch.einsum("hqk,khd->qhd", p, vv) * has_key.view(-1, 1, 1).to(q.dtype)
    valid = has_key.view(1, -1) | (sink is not None)
    lse = torch.where(valid, lse, neg_inf)
    return out, lse.t(), max_logits


def random_disjoint_slices(
    rng: random.Random, total_q: int, total_k: int, max_slices: int = 6, empty_prob: float = 0.1
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Random slices of all four types whose covered cells do not overlap.

    Candidates with random ranges (sometimes empty) and types are kept when they cover no cell
    already covered. Returns ``(q_ranges, k_ranges, types)`` as Python lists.
    """
    qr: list[list[int]] = []
    kr: list[list[int]] = []
    types: list[int] = []
    covered = torch.zeros(total_q, total_k, dtype=torch.bool)
    for _ in range(rng.randint(0, max_slices)):
        if rng.random() < empty_prob:
            qs = rng.randint(0, total_q)
            cand_q = [qs, qs]
        else:
            a, b = sorted((rng.randint(0, total_q), rng.randint(0, total_q)))
            cand_q = [a, b]
        a, b = sorted((rng.randint(0, total_k), rng.randint(0, total_k)))
        cand_k = [a, b]
        t = rng.randint(0, 3)
        m = dense_mask([cand_q], [cand_k], [t], total_q, total_k)
        if bool((m & covered).any()):
            continue
        covered |= m
        qr.append(cand_q)
        kr.append(cand_k)
        types.append(t)
    return qr, kr, types


def grid_slices(
    rng: random.Random, total_q: int, total_k: int, cuts: int, density: float
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Disjoint slices of random types from a grid: ``cuts`` random cuts per axis carve the
    (q, k) plane into rectangles and each is a slice with probability ``density`` (many slices
    share q rows and k columns). One FULL slice over everything if none is drawn.
    Returns ``(q_ranges, k_ranges, types)`` as Python lists; needs ``total_q, total_k >= 1``."""
    qb = [0, *sorted(rng.sample(range(1, total_q), min(cuts, total_q - 1))), total_q]
    kb = [0, *sorted(rng.sample(range(1, total_k), min(cuts, total_k - 1))), total_k]
    qr, kr, types = [], [], []
    for a in range(len(qb) - 1):
        for b in range(len(kb) - 1):
            if rng.random() < density:
                qr.append([qb[a], qb[a + 1]])
                kr.append([kb[b], kb[b + 1]])
                types.append(rng.randrange(4))
    if not qr:
        return [[0, total_q]], [[0, total_k]], [0]
    return qr, kr, types


@dataclass
class Problem:
    """A random attention problem: tensors plus its slices as tensors and as lists."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_ranges: torch.Tensor  # int32 (N, 2)
    k_ranges: torch.Tensor  # int32 (N, 2)
    attn_type_map: torch.Tensor  # int32 (N,)
    qr: list[list[int]]
    kr: list[list[int]]
    types: list[int]


def random_problem(
    rng: random.Random,
    *,
    dtype: torch.dtype = torch.float64,
    max_tokens: int = 20,
    max_slices: int = 6,
    head_dim: int | None = None,
    max_kv_heads: int = 2,
    max_group: int = 3,
    head_dim_v: int | None = None,
) -> Problem:
    """Random sizes (``1..max_tokens`` tokens, GQA heads), random disjoint slices, random data
    (``head_dim_v``: v's own head dim, as in MLA; None: the same as q's and k's)."""
    tq, tk = rng.randint(1, max_tokens), rng.randint(1, max_tokens)
    hk = rng.randint(1, max_kv_heads)
    hq = hk * rng.randint(1, max_group)
    d = head_dim if head_dim is not None else rng.choice([1, 4, 8])
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    q = torch.randn(tq, hq, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(tk, hk, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(tk, hk, head_dim_v or d, generator=gen, dtype=torch.float64).to(dtype)
    qr, kr, types = random_disjoint_slices(rng, tq, tk, max_slices)
    return Problem(
        q,
        k,
        v,
        torch.tensor(qr, dtype=torch.int32).view(-1, 2),
        torch.tensor(kr, dtype=torch.int32).view(-1, 2),
        torch.tensor(types, dtype=torch.int32),
        qr,
        kr,
        types,
    )


@contextlib.contextmanager
def tile_config(block_rows: int, tile_elems: int, min_tile_cols: int) -> Iterator[None]:
    """Temporarily change the reference backend's tile sizes (to exercise multi-tile paths)."""
    saved = _masks.BLOCK_ROWS, _masks.TILE_ELEMS, _masks.MIN_TILE_COLS
    _masks.BLOCK_ROWS, _masks.TILE_ELEMS, _masks.MIN_TILE_COLS = block_rows, tile_elems, min_tile_cols
    try:
        yield
    finally:
        _masks.BLOCK_ROWS, _masks.TILE_ELEMS, _masks.MIN_TILE_COLS = saved


@contextlib.contextmanager
def preprocess_launches() -> Iterator[list[int]]:
    """Count the CuTe backward's preprocess launches inside the block (GPU tests: whether a
    prepared preprocess is reused): yields a list that gets one entry per launch."""
    from .cute import bwd_interface

    launches: list[int] = []
    real = bwd_interface._preprocess_launcher

    def counted(*args):
        launch = real(*args)

        def counting(packed):
            launches.append(1)
            return launch(packed)

        return counting

    bwd_interface._preprocess_launcher = counted
    try:
        yield launches
    finally:
        bwd_interface._preprocess_launcher = real


# ----------------------------------------------------------------------------- mask builders
def varlen_slices(lengths, typ):
    qr, off = [], 0
    for n in lengths:
        qr.append([off, off + n])
        off += n
    return qr, [list(x) for x in qr], [typ] * len(lengths), off


def sliding_window_slices(t: int, w: int):
    """Causal window of w keys before each query, built from the four types: the first w+1 rows
    are CAUSAL, the rest one BICAUSAL band (k - q in [-w, 0])."""
    head = min(t, w + 1)
    qr, kr, ty = [[0, head]], [[0, head]], [1]
    if t > head:
        qr.append([head, t])
        kr.append([1, t])
        ty.append(3)
    return qr, kr, ty


def block_causal_slices(doc_lengths, block: int):
    """Varlen block-causal: a query of block b of a document sees blocks 0..b of it (FULL)."""
    qr, kr, pos = [], [], 0
    for n in doc_lengths:
        for s in range(pos, pos + n, block):
            e = min(s + block, pos + n)
            qr.append([s, e])
            kr.append([pos, e])
        pos += n
    return qr, kr, [0] * len(qr), pos


def segment_id_slices(ids):
    """Document mask from segment ids (runs of one id may recur: all its runs see each other)."""
    runs: dict[object, list[list[int]]] = {}
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            runs.setdefault(ids[start], []).append([start, i])
            start = i
    qr, kr = [], []
    for rs in runs.values():
        for a in rs:
            for b in rs:
                qr.append(a)
                kr.append(b)
    return qr, kr, [0] * len(qr)


class PackedBlock(nn.Module):
    """A pre-norm transformer block over packed tokens: GQA attention (K/V as views of one packed
    projection, the layout the kernels take in place) + MLP. Used by the torch.compile tests and
    tools/bench_compile.py.

    ``forward(x, q_ranges, k_ranges, types, mask=None)``: ``x`` is ``(T, dim)``; the mask is
    either the three slice tensors or a ``FlexMask``; returns ``(T, dim)`` in ``x``'s dtype.
    """

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8):
        super().__init__()
        self.h, self.hk, self.d = heads, kv_heads, head_dim
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, heads * head_dim)
        self.wkv = nn.Linear(dim, 2 * kv_heads * head_dim)
        self.wo = nn.Linear(heads * head_dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, q_ranges=None, k_ranges=None, types=None, mask=None):
        t = x.shape[0]
        h = self.norm1(x)
        q = self.wq(h).view(t, self.h, self.d)
        kv = self.wkv(h).view(t, 2, self.hk, self.d)
        o, _ = _frontend.flex_flash_attn_func(q, kv[:, 0], kv[:, 1], q_ranges, k_ranges, types, mask=mask)
        x = x + self.wo(o.reshape(t, -1))
        return x + self.mlp(self.norm2(x))
