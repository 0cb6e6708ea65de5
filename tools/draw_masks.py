"""Draw the pictures of docs/masks.md from its code blocks (needs matplotlib).

Each ```python block that starts with ``# mask: NAME`` defines ``q_ranges``, ``k_ranges``,
``attn_type_map``, ``total_q``, ``total_k``; the block is built into an ``ffa_kernels.FlexMask``
(so the picture shows exactly what the page's slices do) and drawn cell by cell, each covered
cell coloured by the slice that covers it, the slice's number on its cells. The four slice
types share one picture (``slice_types.png``); every other block gets ``NAME.png``.

Usage: python tools/draw_masks.py [--doc docs/masks.md] [--out docs/img/masks]
"""

from __future__ import annotations

import argparse
import pathlib
import re

import torch

from ffa_kernels import FlexMask

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```python\n# mask: (\w+)\n(.*?)```", re.S)
SLICE_TYPES = ("full", "causal", "inv_causal", "bi_causal")


def load_masks(doc: pathlib.Path) -> dict[str, FlexMask]:
    """The masks of the page, by name, in page order."""
    masks = {}
    for name, code in BLOCK.findall(doc.read_text()):
        env: dict = {}
        exec(code, env)
        masks[name] = FlexMask.from_ranges(
            env["q_ranges"], env["k_ranges"], env["attn_type_map"], env["total_q"], env["total_k"]
        )
    return masks


def slice_ids(mask: FlexMask) -> torch.Tensor:
    """int ``(total_q, total_k)``: the index of the slice covering each cell, -1 for none."""
    ids = torch.full((mask.total_q, mask.total_k), -1, dtype=torch.int64)
    for n, (qs, qe, ks, ke, typ) in enumerate(mask.slices):
        one = FlexMask.from_ranges([[qs, qe]], [[ks, ke]], [typ], mask.total_q, mask.total_k)
        ids[one.to_dense()] = n
    return ids


def draw(ax, mask: FlexMask, title: str) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    ids = slice_ids(mask)
    palette = plt.get_cmap("tab10").colors
    cmap = ListedColormap(["#f4f4f4", *palette[: max(1, mask.num_slices)]])
    ax.imshow(ids + 1, cmap=cmap, vmin=0, vmax=max(1, mask.num_slices), interpolation="nearest")
    tq, tk = ids.shape
    ax.set_xticks([x - 0.5 for x in range(tk + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(tq + 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    step = 4 if max(tq, tk) > 10 else 2
    ax.set_xticks(range(0, tk, step))
    ax.set_yticks(range(0, tq, step))
    if mask.num_slices > 1:
        for n in range(mask.num_slices):
            cells = (ids == n).nonzero()  # row-major: the middle one lies on the slice
            if cells.numel():
                r, c = cells[cells.shape[0] // 2].tolist()
                ax.text(c, r, str(n), ha="center", va="center", fontsize=9, color="white", weight="bold")
    ax.set_xlabel("key token")
    ax.set_ylabel("query token")
    ax.set_title(title, fontsize=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default=str(ROOT / "docs" / "masks.md"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "masks"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    masks = load_masks(pathlib.Path(args.doc))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 4, figsize=(13, 2.6))
    for ax, name in zip(axes, SLICE_TYPES):
        draw(ax, masks[name], name.upper().replace("_", ""))
    fig.savefig(out / "slice_types.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    for name, mask in masks.items():
        if name in SLICE_TYPES:
            continue
        fig, ax = plt.subplots(figsize=(3.6, 3.6 * mask.total_q / mask.total_k))
        draw(ax, mask, f"{name}: {mask.num_slices} slices")
        fig.savefig(out / f"{name}.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(out / f"{name}.png")


if __name__ == "__main__":
    main()
