"""Slice geometry: the docs/api.md table, visible rows, and the row-block / tile walk."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ffa_kernels import BICAUSAL, CAUSAL, FULL, INVCAUSAL, MaskType, mask_type_code
from ffa_kernels.reference import masks as _masks
from ffa_kernels.testing import dense_mask, tile_config


def _rows(mask: torch.Tensor) -> str:
    return " / ".join("".join(str(int(x)) for x in row) for row in mask.tolist())


@pytest.mark.parametrize(
    ("t", "expected"),
    [
        (FULL, "11111 / 11111"),
        (CAUSAL, "11110 / 11111"),
        (INVCAUSAL, "11111 / 01111"),
        (BICAUSAL, "11110 / 01111"),
    ],
)
def test_api_table_sq2_sk5(t, expected):
    assert _rows(_masks.block_mask(2, 5, t, (0, 2), (0, 5))) == expected
    # the test oracle must agree with the table too (it is written independently)
    assert _rows(dense_mask([[0, 2]], [[0, 5]], [int(t)], 2, 5)) == expected


@pytest.mark.parametrize(
    ("t", "sq", "sk", "expected"),
    [
        (CAUSAL, 4, 2, "00 / 00 / 10 / 11"),  # first sq - sk rows empty
        (BICAUSAL, 4, 2, "00 / 00 / 00 / 00"),  # empty when sq > sk
        (INVCAUSAL, 4, 2, "11 / 01 / 00 / 00"),
        (BICAUSAL, 3, 3, "100 / 010 / 001"),  # diagonal when sq == sk
    ],
)
def test_tall_slices(t, sq, sk, expected):
    assert _rows(_masks.block_mask(sq, sk, t, (0, sq), (0, sk))) == expected
    assert _rows(dense_mask([[0, sq]], [[0, sk]], [int(t)], sq, sk)) == expected


def test_mask_type_codes():
    assert [int(x) for x in MaskType] == [0, 1, 2, 3]
    assert mask_type_code("inv_causal") == 2
    assert mask_type_code("bi_causal") == 3
    assert mask_type_code(MaskType.CAUSAL) == 1
    with pytest.raises(ValueError, match="sideways"):
        mask_type_code("sideways")
    with pytest.raises(ValueError, match="7"):
        mask_type_code(7)
    with pytest.raises(TypeError):
        mask_type_code(1.0)


@settings(max_examples=50, deadline=None)
@given(
    sq=st.integers(0, 12),
    sk=st.integers(0, 12),
    t=st.integers(0, 3),
    block_rows=st.integers(1, 5),
    tile_elems=st.integers(1, 40),
)
def test_tiles_cover_slice_exactly(sq, sk, t, block_rows, tile_elems):
    """Row blocks x tiles (with their masks) cover each cell of the slice exactly once."""
    qs, ks = 3, 2
    cover = torch.zeros(qs + sq + 1, ks + sk + 1, dtype=torch.int64)
    with tile_config(block_rows, tile_elems, 1):
        for blk in _masks.iter_row_blocks([(qs, qs + sq, ks, ks + sk, t)]):
            assert 0 < blk.num_rows <= block_rows
            for tile in blk.tiles(num_heads_q=2, device="cpu"):
                cols = tile.k_end - tile.k_start
                assert cols >= 1
                mask = torch.ones(blk.num_rows, cols, dtype=torch.bool) if tile.mask is None else tile.mask
                assert mask.shape == (blk.num_rows, cols)
                # the column range of a block is tight: every column is seen by some row
                assert bool(mask.any(dim=0).all())
                cover[blk.q_start : blk.q_end, tile.k_start : tile.k_end] += mask.to(torch.int64)
    expected = dense_mask([[qs, qs + sq]], [[ks, ks + sk]], [t], qs + sq + 1, ks + sk + 1).to(torch.int64)
    assert torch.equal(cover, expected)


def test_visible_rows_skip_empty_rows():
    rng = random.Random(0)
    for _ in range(200):
        sq, sk, t = rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 3)
        lo, hi = _masks.visible_rows(sq, sk, t)
        rows_with_cells = (
            dense_mask([[0, sq]], [[0, sk]], [t], sq, sk).any(dim=1).nonzero().flatten().tolist()
        )
        assert list(range(lo, hi)) == rows_with_cells, (sq, sk, t)
