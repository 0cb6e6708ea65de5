"""AttnMaskType, AttnRange(s), AttnSlice and AttnMask."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import AttnMask, AttnMaskType, AttnRange, AttnRanges, AttnSlice

API_TABLE = {  # docs/api.md: sq=2, sk=5
    "full": ["11111", "11111"],
    "causal": ["11110", "11111"],
    "inv_causal": ["11111", "01111"],
    "bi_causal": ["11110", "01111"],
}


@pytest.mark.parametrize("label", list(API_TABLE))
def test_api_table(label):
    m = AttnMask([[0, 2]], [[0, 5]], label, 2, 5)
    rows = ["".join("1" if c else "0" for c in row) for row in m.to_dense()]
    assert rows == API_TABLE[label]
    assert m.area() == sum(r.count("1") for r in rows)


def test_mask_type_codes_and_strings():
    assert [int(t) for t in AttnMaskType] == [0, 1, 2, 3]
    assert AttnMaskType("causal") is AttnMaskType.CAUSAL
    assert AttnMaskType("inv_causal") is AttnMaskType.INVCAUSAL
    assert AttnMaskType("BICAUSAL") is AttnMaskType.BICAUSAL
    assert AttnMaskType(3).label == "bi_causal"
    for bad in ("sideways", 4, -1, None, True):
        with pytest.raises(ValueError, match="mask_type"):
            AttnMaskType.parse(bad)


def test_causal_rows_empty_when_sq_exceeds_sk_and_bicausal_empty():
    m = AttnMask([[0, 4]], [[0, 2]], "causal", 4, 2)
    assert m.to_dense() == [[False, False], [False, False], [True, False], [True, True]]
    assert AttnMask([[0, 4]], [[0, 2]], "bi_causal", 4, 2).area() == 0


range_lists = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 12)).map(lambda t: [t[0], t[0] + t[1]]), max_size=8
)


def tokens(ranges):
    return {t for s, e in ranges for t in range(s, e)}


@settings(max_examples=200, deadline=None)
@given(range_lists, range_lists)
def test_ranges_merge_intersect_area_sort(a, b):
    ra, rb = AttnRanges.from_ranges(a), AttnRanges.from_ranges(b)
    merged = ra.merge().to_naive_ranges()
    assert tokens(merged) == tokens(a)
    assert all(x[1] < y[0] for x, y in zip(merged, merged[1:])), (
        "merged ranges must be disjoint, non-touching"
    )
    assert ra.area() == len(tokens(a))
    assert tokens(ra.intersect(rb).to_naive_ranges()) == tokens(a) & tokens(b)
    assert ra.sort().is_sorted()
    assert ra.total_seqlen == sum(e - s for s, e in a)
    assert ra.is_non_overlap() == (sum(e - s for s, e in a) == len(tokens(a)))


@pytest.mark.parametrize("bad", [[-1, 3], [5, 2], "ab", [1, 2, 3]])
def test_bad_range_names_argument(bad):
    with pytest.raises(ValueError, match=r"ranges\[0\]"):
        AttnRanges.from_ranges([bad])
    with pytest.raises(ValueError):
        AttnRange(*bad) if isinstance(bad, list) and len(bad) == 2 else AttnRange(start=-1, end=0)


def test_check_non_overlap_sorted():
    AttnRanges.from_ranges([[0, 2], [2, 5]]).check_non_overlap_sorted()
    with pytest.raises(ValueError, match="cu: not sorted"):
        AttnRanges.from_ranges([[3, 4], [0, 2]]).check_non_overlap_sorted("cu")
    with pytest.raises(ValueError, match="overlap"):
        AttnRanges.from_ranges([[0, 3], [2, 4]]).check_non_overlap_sorted()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 9), st.integers(0, 9), st.integers(0, 3))
def test_slice_area_closed_form(sq, sk, t):
    s = AttnSlice(q_range=AttnRange(3, 3 + sq), k_range=AttnRange(1, 1 + sk), mask_type=t)
    m = AttnMask([[3, 3 + sq]], [[1, 1 + sk]], [t], 3 + sq, 1 + sk)
    assert s.area() == sum(map(sum, m.to_dense()))
    if t == AttnMaskType.CAUSAL and sq <= sk:
        assert s.area() == sq * sk - sq * (sq - 1) // 2


def test_mask_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="k_ranges: has 1 ranges but q_ranges has 2"):
        AttnMask([[0, 1], [1, 2]], [[0, 1]], "full", 2, 2)
    with pytest.raises(ValueError, match="mask_types: has 1 entries"):
        AttnMask([[0, 1], [1, 2]], [[0, 1], [0, 1]], ["full"], 2, 2)
    with pytest.raises(ValueError, match=r"mask_types\[1\]: unknown mask type"):
        AttnMask([[0, 1], [1, 2]], [[0, 1], [0, 1]], ["full", "diagonal"], 2, 2)
    with pytest.raises(ValueError, match=r"q_ranges\[0\]: range \[-1, 1\)"):
        AttnMask([[-1, 1]], [[0, 1]], "full", 2, 2)
    with pytest.raises(ValueError, match=r"k_ranges\[0\].*total_seqlen_k=2"):
        AttnMask([[0, 1]], [[0, 3]], "full", 2, 2)
    with pytest.raises(ValueError, match=r"q_ranges\[0\].*total_seqlen_q=2"):
        AttnMask([[0, 5]], [[0, 1]], "full", 2, 2)
    with pytest.raises(ValueError, match="total_seqlen_q"):
        AttnMask([[0, 1]], [[0, 1]], "full", -1, 2)
    with pytest.raises(ValueError, match="cover the same cells"):
        AttnMask([[0, 4], [2, 3]], [[0, 4], [1, 3]], ["causal", "full"], 4, 4)


def test_shared_rows_without_shared_cells_are_allowed():
    m = AttnMask([[0, 4], [0, 4]], [[0, 2], [2, 4]], ["full", "causal"], 4, 4)
    assert m.area() == 8 + 3  # causal with sq=4 > sk=2 leaves its first two rows empty


def test_mask_json_round_trip():
    m = AttnMask([[0, 4], [4, 8]], [[0, 4], [0, 8]], ["causal", 1], 8, 8)
    again = AttnMask.model_validate_json(m.model_dump_json())
    assert again == m and again.area() == m.area()
    with pytest.raises(ValueError, match="cover the same cells"):
        AttnMask.model_validate_json(
            m.model_dump_json().replace('"start":4,"end":8}]', '"start":2,"end":8}]', 1)
        )
