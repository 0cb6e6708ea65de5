"""The reference backend never materialises Tq x Tk: it works in bounded tiles near the area."""

import torch

from ffa_kernels import ffa_backward_stage, flex_flash_attn_func
from ffa_kernels.reference import backward as _backward
from ffa_kernels.reference import forward as _forward
from ffa_kernels.reference import masks as _masks
from ffa_kernels.testing import tile_config

N = 16384  # Tq = Tk; Tq x Tk float32 scores would be 1 GiB per head
HQ, HK = 8, 2  # several heads (GQA): a tile's score tensor is (Hq, rows, cols)


def _qkv(n, hq, hk, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, d, generator=gen) for h in (hq, hk, hk))


def _record_forward(monkeypatch, seen):
    def stub(qh, kh, vh, mask, group, softcap, want_max, kv_finite=True):
        hk, gr, d = qh.shape
        seen.append((hk * group, gr // group, kh.shape[1], mask is not None))
        out = torch.zeros(hk, gr, d, dtype=qh.dtype)
        lse = torch.zeros(hk, gr, dtype=qh.dtype)
        return out, lse, (torch.zeros(hk * group, dtype=qh.dtype) if want_max else None)

    monkeypatch.setattr(_forward, "forward_tile", stub)


def _max_tile_elems(heads):
    # the score tensor of one tile: (heads, rows, cols), cols >= MIN_TILE_COLS
    return max(_masks.TILE_ELEMS, heads * _masks.BLOCK_ROWS * _masks.MIN_TILE_COLS)


def test_large_causal_walk_is_tiled_and_tight(monkeypatch):
    """16k x 16k causal, 8 q heads / 2 kv heads: every tile's (Hq, rows, cols) scores are bounded
    and the cells visited ~ the area."""
    seen = []
    _record_forward(monkeypatch, seen)
    q, k, v = _qkv(N, HQ, HK, 16)
    r = torch.tensor([[0, N]], dtype=torch.int32)
    flex_flash_attn_func(q, k, v, r, r, torch.tensor([1], dtype=torch.int32), return_max_logits=True)

    assert all(heads == HQ for heads, _, _, _ in seen)
    assert all(rows <= _masks.BLOCK_ROWS for _, rows, _, _ in seen)
    assert max(h * rows * cols for h, rows, cols, _ in seen) <= _max_tile_elems(HQ)
    assert max(h * rows * cols for h, rows, cols, _ in seen) < HQ * N * N // 32
    area = N * (N + 1) // 2
    visited = sum(rows * cols for _, rows, cols, _ in seen)
    # only the columns each row block can see: the waste is the ragged edge, < rows^2 per block
    assert area <= visited <= area + (N // _masks.BLOCK_ROWS) * _masks.BLOCK_ROWS**2
    assert visited <= 1.05 * area
    # masks only on the ragged diagonal edge (at most BLOCK_ROWS wide)
    assert all(cols <= _masks.BLOCK_ROWS for _, _, cols, masked in seen if masked)


def test_large_backward_walk_is_tiled(monkeypatch):
    seen = []

    def stub(qh, kh, vh, doh, lse_h, delta_h, mask, group, softcap, kv_finite=True):
        seen.append((qh.shape[0] * group, qh.shape[1] // group * kh.shape[1]))
        return torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)

    monkeypatch.setattr(_backward, "backward_tile", stub)
    q, k, v = _qkv(N, HQ, HK, 16, seed=1)
    dout, out = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(N, HQ)
    r = torch.tensor([[0, N // 2], [N // 2, N]], dtype=torch.int32)
    tm = torch.tensor([2, 3], dtype=torch.int32)  # INVCAUSAL, BICAUSAL
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    ffa_backward_stage(dout, q, k, v, out, lse, r, r, tm, dq, dk, dv)
    assert max(h * cells for h, cells in seen) <= _max_tile_elems(HQ)
    area = (N // 2) * (N // 2 + 1) // 2 + N // 2  # triangle + diagonal
    blocks = N // _masks.BLOCK_ROWS  # 16 row blocks per slice, 2 slices
    assert area <= sum(cells for _, cells in seen) <= area + blocks * _masks.BLOCK_ROWS**2


def test_real_compute_with_small_tiles_matches_direct_rows():
    """A real causal run in many small tiles; a few rows checked against a direct softmax."""
    n, d = 3000, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 1, d, generator=gen) for _ in range(3))
    r = torch.tensor([[0, n]], dtype=torch.int32)
    with tile_config(256, 256 * 700, 64):
        out, meta = flex_flash_attn_func(q, k, v, r, r, torch.tensor([1], dtype=torch.int32))
    for row in (0, 1, 255, 256, 1000, n - 1):
        logits = (q[row, 0] @ k[: row + 1, 0].T).double() * d**-0.5
        p = torch.softmax(logits, dim=-1)
        torch.testing.assert_close(out[row, 0].double(), p @ v[: row + 1, 0].double(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            meta.lse[row, 0].double(), torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5
        )
