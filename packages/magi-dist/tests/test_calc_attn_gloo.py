"""calc_attn on CPU gloo groups of 1-4 processes equals single-process attention (fwd and bwd)."""

import random

import pytest

from magi_dist.testing import Case, spawn_gloo
from magi_solver import masks
from magi_solver.testing import random_mask

DEGREES = [0, 1, 2, None]  # None: dynamic


def cases(world: int) -> list[Case]:
    cu = [0, 37, 40, 121, 190]  # uneven documents; 190 is not a multiple of the chunk grid (padding)
    specs = [
        ("varlen-causal", masks.varlen(cu, causal=True), {}),
        ("varlen-full", masks.varlen(cu), {"hq": 4, "hk": 4}),
        ("sliding-window", masks.sliding_window(150, (13, 0), causal=True), {"sink": "sh"}),
        ("block-causal", masks.block_causal(cu, 9), {"softcap": 5.0}),
        ("random-slices", random_mask(random.Random(world), 170, max_slices=10), {"sink": "ssh"}),
        ("segments", masks.from_segment_ids([3] * 50 + [1] * 61 + [3] * 40, causal=True), {"hq": 8, "hk": 2}),
        ("float32", masks.varlen(cu, causal=True), {"dtype": "float32", "tol": 2e-4}),
        ("mla-dv", masks.varlen(cu, causal=True), {"d": 24, "dv": 16, "sink": "sh"}),  # Dv != D
    ]
    out = []
    for i, (name, mask, kw) in enumerate(specs):
        degree = DEGREES[(i + world) % len(DEGREES)]
        out.append(Case.from_mask(f"{name}-deg{degree}", mask, degree=degree, seed=i, **kw))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_calc_attn_matches_single_process(world):
    spawn_gloo(world, cases(world))


def test_every_overlap_degree_on_one_mask():
    mask = masks.varlen([0, 64, 200], causal=True)
    cases = [Case.from_mask(f"deg{d}", mask, degree=d, chunk=8, min_chunk=4) for d in DEGREES]
    # v with its own head dim (MLA): packed K/V rows of unequal halves at every degree, on 3 ranks
    cases += [
        Case.from_mask(f"dv-deg{d}", mask, degree=d, chunk=8, min_chunk=4, d=24, dv=16) for d in DEGREES
    ]
    spawn_gloo(3, cases)


def test_dsink_sum_reduce():
    mask = masks.varlen([0, 50, 120], causal=True)
    spawn_gloo(2, [Case.from_mask("sink-sum", mask, sink="sh")], env={"MAGI_DIST_DSINK_REDUCE": "sum"})


def test_bad_inputs_name_the_argument():
    from magi_dist.testing import spawn_gloo_fn

    spawn_gloo_fn(2, "check_bad_inputs")


@pytest.mark.slow
def test_cp8_on_cpu():
    """cp 8 (the scale-out size of the 8-GPU run), on 8 CPU gloo ranks."""
    cu = [0, 300, 310, 700, 1024]
    specs = [
        ("varlen-causal", masks.varlen(cu, causal=True), {"degree": 2}),
        ("block-causal", masks.block_causal(cu, 64), {"degree": None}),
        ("varlen-full-gqa", masks.varlen(cu), {"degree": 1, "hq": 8, "hk": 2}),
        ("random", random_mask(random.Random(8), 900, max_slices=12), {"degree": 0, "sink": "sh"}),
    ]
    cases = [Case.from_mask(n, m, chunk=32, min_chunk=16, seed=i, **kw) for i, (n, m, kw) in enumerate(specs)]
    spawn_gloo(8, cases)
