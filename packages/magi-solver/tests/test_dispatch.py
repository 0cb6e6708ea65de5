"""Dispatch: golden cases, properties of every algorithm, and bad input."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import DispatchAlg, solve_dispatch


def test_min_heap_golden_case():
    sol = solve_dispatch([2, 4, 3, 16, 13, 5, 9, 10], 4, "min_heap")
    assert sol.minimax_workload == 18
    assert all(len(p) == 2 for p in sol.bucket_partitions)


def test_lpt_swap_beats_min_heap():
    # MinHeap's docstring example: greedy gives 19 / 17, the optimum is 18 / 18.
    assert solve_dispatch([8, 7, 6, 5, 4, 2, 2, 2], 2, "min_heap").minimax_workload == 19
    assert solve_dispatch([8, 7, 6, 5, 4, 2, 2, 2], 2, "lpt_swap").minimax_workload == 18


def test_zigzag_is_llama3_pattern():
    cp = 4
    sol = solve_dispatch([1.0] * (2 * cp), cp, DispatchAlg.ZIGZAG)
    assert sol.bucket_partitions == [[i, 2 * cp - 1 - i] for i in range(cp)]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.data())
def test_every_algorithm_partitions_with_equal_counts(k, per, data):
    w = data.draw(st.lists(st.integers(0, 100), min_size=k * per, max_size=k * per))
    results = {}
    for alg in DispatchAlg:
        sol = solve_dispatch(w, k, alg)
        flat = sorted(j for p in sol.bucket_partitions for j in p)
        assert flat == list(range(len(w)))
        assert all(len(p) == per for p in sol.bucket_partitions)
        assert all(p == sorted(p) for p in sol.bucket_partitions)
        loads = [sum(w[j] for j in p) for p in sol.bucket_partitions]
        assert sol.minimax_workload == max(loads) and sol.bucket_workloads == loads
        assert sol.minimax_workload >= sum(w) / k
        results[alg] = sol.minimax_workload
    assert results[DispatchAlg.LPT_SWAP] <= results[DispatchAlg.MIN_HEAP]


def test_bad_input():
    with pytest.raises(ValueError, match="num_buckets"):
        solve_dispatch([1, 2], 0)
    with pytest.raises(ValueError, match="workloads"):
        solve_dispatch([1], 2)
    with pytest.raises(ValueError, match="workloads"):
        solve_dispatch([1, -2], 1)
    with pytest.raises(ValueError, match="alg: unknown dispatch algorithm"):
        solve_dispatch([1, 2], 1, "best")
