"""docs/masks.md: every recipe's slices build exactly the cells of its FlexAttention ``mask_mod``
and of its ``magi_solver.masks`` builder, run through flex_flash_attn_func like the dense
oracle, and have their picture in docs/img/masks (drawn by tools/draw_masks.py)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from ffa_kernels import FlexMask, flex_flash_attn_func
from ffa_kernels.testing import dense_attention
from magi_solver import masks

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "masks.md"
BLOCK = re.compile(r"```python\n# mask: (\w+)\n(.*?)```", re.S)
SLICE_TYPES = ("full", "causal", "inv_causal", "bi_causal")


def _blocks() -> dict[str, dict]:
    out = {}
    for name, code in BLOCK.findall(DOC.read_text()):
        env: dict = {}
        exec(code, env)
        out[name] = env
    return out


def _shifted(m, by: int) -> list[tuple[int, int, int, int, int]]:
    q, k, t = m.to_lists()
    return [(qs + by, qe + by, ks + by, ke + by, int(ty)) for (qs, qe), (ks, ke), ty in zip(q, k, t)]


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


# FlexAttention mask_mods (b, h dropped), written as on the page: (q, kv) index grids -> bool
Q = lambda n, m: torch.arange(n).view(-1, 1)  # noqa: E731
KV = lambda n, m: torch.arange(m).view(1, -1)  # noqa: E731


def _mask_mod(name: str, tq: int, tk: int) -> torch.Tensor:
    q, kv = Q(tq, tk), KV(tq, tk)
    if name in SLICE_TYPES:
        d = tk - tq
        return {
            "full": torch.ones(tq, tk, dtype=torch.bool),
            "causal": kv <= q + d,
            "inv_causal": kv >= q,
            "bi_causal": (kv >= q) & (kv <= q + d),
        }[name].expand(tq, tk)
    causal = q >= kv
    if name == "varlen_causal":
        doc = _doc_ids([5, 7, 4])
        return (doc[q] == doc[kv]) & causal
    if name == "sliding_window":
        return (q - kv <= 3) & causal
    if name == "block_causal":
        video = _doc_ids([12, 8])
        return (video[q] == video[kv]) & (kv // 4 <= q // 4)
    if name == "prefix_lm":
        return (kv < 6) | causal
    if name == "shared_question":
        answer = _doc_ids([6, 5, 5])
        return causal & ((kv < 6) | (answer[q] == answer[kv]))
    if name == "sink_window":
        return causal & ((kv < 2) | (q - kv <= 3))
    raise AssertionError(f"no mask_mod for {name}")


def _builder_slices(name: str) -> list[tuple[int, int, int, int, int]] | None:
    built = {
        "varlen_causal": lambda: masks.varlen([0, 5, 12, 16], causal=True),
        "sliding_window": lambda: masks.sliding_window(16, (3, 0), causal=True),
        "block_causal": lambda: masks.block_causal([0, 12, 20], 4),
        "prefix_lm": lambda: masks.prefix_lm([0, 16], 6),
        "shared_question": lambda: masks.shared_question(6, [5, 5]),
    }
    if name in built:
        return _shifted(built[name](), 0)
    if name == "sink_window":  # the page: the sink slices plus a sliding window shifted by 2
        return [
            (0, 2, 0, 2, 1),
            (2, 16, 0, 2, 0),
            *_shifted(masks.sliding_window(14, (3, 0), causal=True), 2),
        ]
    return None


BLOCKS = _blocks()
NAMES = [
    *SLICE_TYPES,
    "varlen_causal",
    "sliding_window",
    "block_causal",
    "prefix_lm",
    "shared_question",
    "sink_window",
]


def test_the_page_has_every_recipe():
    assert list(BLOCKS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_recipe_builds_its_mask(name):
    env = BLOCKS[name]
    mask = FlexMask.from_ranges(
        env["q_ranges"], env["k_ranges"], env["attn_type_map"], env["total_q"], env["total_k"]
    )
    counts = torch.zeros(mask.total_q, mask.total_k, dtype=torch.int64)
    for qs, qe, ks, ke, typ in mask.slices:  # disjoint slices: no cell covered twice
        one = FlexMask.from_ranges([[qs, qe]], [[ks, ke]], [typ], mask.total_q, mask.total_k)
        counts += one.to_dense().to(torch.int64)
    assert int(counts.max()) <= 1, f"{name}: a cell is covered twice"
    dense = mask.to_dense()
    assert torch.equal(dense, _mask_mod(name, mask.total_q, mask.total_k)), f"{name}: not its mask_mod"
    assert mask.area() == int(dense.sum())
    want = _builder_slices(name)
    if want is not None:
        assert sorted(mask.slices) == sorted(want), f"{name}: not the magi_solver builder's slices"
    # the attention over it is the dense oracle's
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(mask.total_q, 2, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(mask.total_k, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out, _ = flex_flash_attn_func(q, k, v, mask=mask)
    ref, _, _ = dense_attention(q, k, v, mask.q_ranges, mask.k_ranges, mask.attn_type_map)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("name", ["slice_types", *NAMES[len(SLICE_TYPES) :]])
def test_recipe_has_its_picture(name):
    path = f"img/masks/{name}.png"
    assert f"]({path})" in DOC.read_text()
    assert (DOC.parent / path).is_file(), f"run python tools/draw_masks.py to draw {path}"
