"""Plans of all ranks + reduction kernels, with the all-to-all simulated in-process.

Cheap enough for hypothesis to explore many layouts and larger worlds than the gloo tests.
"""

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import magi_comm.testing as lib
from magi_comm._plan import _expand_ranges, build_cast_plan, build_reduce_plan

layouts = st.builds(
    lambda world, seed: lib.random_layout(random.Random(seed), world, max_splits=5, max_size=6),
    st.integers(1, 6),
    st.integers(0, 2**32 - 1),
)


def _data(lay, sizes_of, seed, salt=0):
    return [
        lib.rank_data({"seed": seed, "row_shape": (2,)}, r, sum(sizes_of[r]), torch.float32, salt)
        for r in range(lay.world)
    ]


@settings(max_examples=60, deadline=None)
@given(lay=layouts)
def test_plans_agree_across_ranks(lay):
    cast = [build_cast_plan(*lay.cast_args(r), r, lay.world) for r in range(lay.world)]
    red = [build_reduce_plan(*lay.reduce_args(r), r, lay.world) for r in range(lay.world)]
    for plans in (cast, red):
        for s in range(lay.world):
            for d in range(lay.world):
                assert plans[s].send_signatures[d] == plans[d].recv_signatures[s]
                assert plans[s].send_counts[d] == plans[d].recv_counts[s]


@settings(max_examples=60, deadline=None)
@given(lay=layouts, seed=st.integers(0, 10_000))
def test_simulated_cast(lay, seed):
    inputs = _data(lay, lay.in_sizes, seed)
    outs = lib.simulate_cast(lay, inputs)
    for d in range(lay.world):
        assert torch.equal(outs[d], lib.cast_oracle(lay, inputs, d, inputs[d]))


@settings(max_examples=60, deadline=None)
@given(lay=layouts, seed=st.integers(0, 10_000), op=st.sampled_from(["sum", "avg"]), acc=st.booleans())
def test_simulated_reduce(lay, seed, op, acc):
    inputs = _data(lay, lay.out_sizes, seed)
    olds = _data(lay, lay.in_sizes, seed, salt=1)
    res = lib.simulate_reduce(lay, inputs, olds, op, acc)
    for r in range(lay.world):
        assert torch.equal(res[r], lib.reduce_oracle_sum_avg(lay, inputs, r, olds[r], op, acc))


@settings(max_examples=40, deadline=None)
@given(lay=layouts, seed=st.integers(0, 10_000), acc=st.booleans())
def test_simulated_reduce_lse(lay, seed, acc):
    case = {"seed": seed, "row_shape": (2, 3)}
    inputs = [lib.rank_data(case, r, sum(lay.out_sizes[r]), torch.float32) for r in range(lay.world)]
    in_lses = [lib.rank_lse(case, r, sum(lay.out_sizes[r])) for r in range(lay.world)]
    olds = [lib.rank_data(case, r, sum(lay.in_sizes[r]), torch.float32, 1) for r in range(lay.world)]
    old_lses = [lib.rank_lse(case, r, sum(lay.in_sizes[r]), 1) for r in range(lay.world)]
    res = lib.simulate_reduce(lay, inputs, olds, "lse", acc, in_lses, old_lses)
    for r in range(lay.world):
        out, lse = res[r]
        exp_out, exp_lse = lib.reduce_oracle_lse(lay, inputs, in_lses, r, olds[r], old_lses[r], acc)
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(lse.double(), exp_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double(), exp_out, rtol=1e-5, atol=1e-5)


def test_expand_ranges():
    assert _expand_ranges([5, 0, 9], [2, 0, 3]).tolist() == [5, 6, 9, 10, 11]
    assert _expand_ranges([], []).numel() == 0


def test_identity_plans_skip_index_tensors():
    # one split per destination, in rank order, received in rank order: no permutation needed
    p = build_cast_plan([2, 3], [2, 3], [[0], [1]], [0, 1], 0, 2)
    assert p.gather_index is None and p.scatter_index is None
    p = build_cast_plan([2, 3], [2, 3], [[1], [0]], [1, 0], 0, 2)
    assert p.gather_index.tolist() == [2, 3, 4, 0, 1]
    assert p.scatter_index.tolist() == [2, 3, 4, 0, 1]
    assert p.send_counts == (3, 2) and p.recv_counts == (3, 2)
